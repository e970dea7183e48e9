// loom's host API: turn a KernelSpec into a loaded CUDA kernel and launch it
// on tensors that already live on the GPU (raw pointers with strides, or
// DLPack tensors from PyTorch, JAX or CuPy).
//
//   auto runtime = loom::Runtime::create();            // fails plainly without a GPU
//   auto kernel = (*runtime)->kernel(spec);             // generate, NVRTC, load
//   (*kernel)->launch(tensors, stream);                 // validated, then launched
#pragma once

#include <cuda.h>
#include <dlpack/dlpack.h>

#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "loom/decode.h"
#include "loom/result.h"
#include "loom/spec.h"
#include "loom/v1/loom.pb.h"

namespace loom {

struct IhaArgs;

namespace cuda {
struct TmaMaps;
class Device;
class DeviceBuffer;
struct DeviceInfo;
}  // namespace cuda

enum class ElementKind { float32, float16, bfloat16 };

// A strided view of memory. Strides are in elements; empty means contiguous.
struct Tensor {
  void* data = nullptr;
  ElementKind element = ElementKind::float32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  int device = 0;  // CUDA ordinal; kHostDevice for host memory
};

inline constexpr int kHostDevice = -1;

// Bytes of one element of `kind`.
int64_t elementBytes(ElementKind kind);

// A tensor's strides in elements: its own, or C order when it has none.
std::vector<int64_t> stridesOf(const Tensor& tensor);

// The IHA operands. q, k, v and out are the spec's dtype; the weights and
// lse are float32. lse is optional.
struct IhaTensors {
  Tensor q, k, v;
  Tensor alpha_q, alpha_k, alpha_v, collapse;
  Tensor out;
  std::optional<Tensor> lse;
  // Varlen (KernelSpec.varlen; docs/IHA.md, Varlen): the documents' bounds,
  // int32 [documents + 1], dense, where the tensors are (device or host).
  // q, k, v and out then hold the packed tokens, [total, H | G, d] (or
  // [1, total, H | G, d]), and lse is [H, total * P] (or [1, H, total * P]).
  const int32_t* cu_seqlens = nullptr;
  int64_t documents = 0;
};

// A varlen spec's tensors as one batch: [total, ...] viewed as [1, total,
// ...], lse [H, total * P] as [1, H, total * P], the form the launches take;
// any other spec's (or tensors already batched) as they are.
IhaTensors batchedView(const KernelSpec& spec, const IhaTensors& tensors);

// Checks shapes, dtypes, strides, alignment and device against the spec
// before anything is launched; the error names the tensor.
Status validateTensors(const KernelSpec& spec, const IhaTensors& tensors, int device);

// The backward's operands (docs/IHA.md, Backward): dout, the gradient of
// out (the spec's dtype, out's shape, strided like an activation), and the
// gradients it returns, float32 and contiguous, each the shape of its input.
// The inputs are the forward's, in IhaTensors; out and lse there are not
// read (the backward recomputes the pseudo outputs and lse, which the
// collapsed out cannot give back), and lse, when given, receives them.
struct IhaGradTensors {
  Tensor dout;
  Tensor dq, dk, dv;
  Tensor dalpha_q, dalpha_k, dalpha_v, dcollapse;
};
// dout, dq, dk and dv of a varlen spec as one batch (batchedView).
IhaGradTensors batchedView(const KernelSpec& spec, const IhaGradTensors& grads);

// What a forward keeps for its backward (docs/compiler.md, The backward),
// in caller-owned dense tensors: q_mixed and o_pseudo [B, H, N*P, d],
// k_mixed and v_mixed [B, G, N*P, d] in the kernel's workspace element type
// (the spec's 16-bit dtype for CUDA kernels and the emulator, float32 on the
// host backend: savedRowElement), lse [B, H, N*P] float32. A forward given
// them (its mixing materialised, its collapse separate) fills them; a
// backward given them starts from there, skipping the pre-mix and the
// recomputed attention (one attention pass of work).
struct IhaSaved {
  Tensor q_mixed, k_mixed, v_mixed, o_pseudo, lse;
};
ElementKind savedRowElement(const KernelSpec& spec, bool cudaKernel);
// The forward schedule that keeps what its backward reads (IhaSaved):
// `schedule` with its mixing materialised and its collapse separate where
// unset; an error, naming the field, where it asks for either fused.
Result<Schedule> keepingSchedule(const Schedule& schedule);
// Checks the saved tensors against the spec, B and N; the error names the tensor.
Status validateSaved(const KernelSpec& spec, const IhaSaved& saved, int64_t batch, int64_t tokens, bool cudaKernel,
                     int device);

// validateTensors' checks for the inputs (q, k, v, the weights, lse when
// given) and the backward's own tensors; the error names the tensor.
Status validateGradTensors(const KernelSpec& spec, const IhaTensors& inputs, const IhaGradTensors& grads, int device);

// Views DLPack tensors as IhaGradTensors (errors begin with the name).
Result<IhaGradTensors> gradTensorsFromDlpack(const DLTensor* dout, const DLTensor* dq, const DLTensor* dk,
                                             const DLTensor* dv, const DLTensor* dalphaQ, const DLTensor* dalphaK,
                                             const DLTensor* dalphaV, const DLTensor* dcollapse);

// Views one DLPack tensor (float32, float16 or bfloat16; CUDA or host);
// errors begin with `name`.
Result<Tensor> tensorFromDlpack(const char* name, const DLTensor* tensor);

// Views DLPack tensors (lse may be null) as IhaTensors: CUDA tensors, or
// host tensors (device kHostDevice) for runOnHost.
Result<IhaTensors> tensorsFromDlpack(const DLTensor* q, const DLTensor* k, const DLTensor* v, const DLTensor* alphaQ,
                                     const DLTensor* alphaK, const DLTensor* alphaV, const DLTensor* collapse,
                                     const DLTensor* out, const DLTensor* lse);

// A decode step's paged cache (docs/IHA.md, Decode over a paged cache):
// k_cache and v_cache [num_pages, page_size, G, d] (raw) or [num_pages,
// page_size, G, P, d] (mixed), contiguous, in the spec's dtype;
// page_table [B, max_pages] and cache_len [B], int32, dense. The step's
// new tokens are an IhaTensors of N = T: q [B, T, H, d], k and v [B, T, G,
// d], out [B, T, H, d], lse [B, H, T*P] when given.
struct PagedCacheTensors {
  Tensor k_cache, v_cache;
  const int32_t* page_table = nullptr;
  const int32_t* cache_len = nullptr;
  int64_t max_pages = 0;
  CacheLayout layout = CacheLayout::raw;
  // A CUDA step's error word (device memory, one int32 the caller zeroes):
  // when set, the step checks its page table and lengths on the device (in
  // its append launch), skips the sequences it refuses (their out is not
  // defined) and writes 1 here if there was one. The caller reads it when
  // it likes: no synchronisation in the step.
  int32_t* page_errors = nullptr;
  // A ragged step (docs/IHA.md, Ragged steps): `batch` sequences bring
  // different numbers of new tokens, packed one sequence after another in
  // q [total, H, d], k and v [total, G, d] and out [total, H, d] (no lse);
  // query_start_loc [batch + 1], int32, dense, where the tensors are:
  // sequence b's rows query_start_loc[b] .. query_start_loc[b + 1] - 1 (0
  // to max_query_len of them), appended at its cache_len. max_query_len,
  // the most one sequence brings, sizes the grids (FlashAttention's
  // max_seqlen_q). The offsets are checked with the page table (a CUDA
  // step's checkPages copies them back); unchecked, they are trusted as the
  // page table is. Null: a uniform step.
  const int32_t* query_start_loc = nullptr;
  int64_t batch = 0;
  int64_t max_query_len = 0;
};

// A ragged step's packed tensors ([total, heads, d]) as one batch ([1,
// total, heads, d]), the form the operand checks take; a uniform step's as
// they are.
IhaTensors packedView(const IhaTensors& step, const PagedCacheTensors& cache);
// A ragged step's packed tensors as the launches index them: [batch,
// max_query_len, heads, d] whose batch stride is unused (the kernels find
// sequence b's rows through query_start_loc); a uniform step's as they are.
IhaTensors raggedLaunchView(const IhaTensors& step, const PagedCacheTensors& cache);

// Checks the step's tensors as a forward's of N = T (a ragged step's as
// one batch of its packed tokens), the cache's against the spec and its
// layout, and (with `checkPages`, host memory) the page table, lengths and
// a ragged step's query_start_loc (validateDecode) before anything is read
// or written; the error names the tensor or entry.
Status validateDecodeTensors(const KernelSpec& spec, const IhaTensors& step, const PagedCacheTensors& cache,
                             int device, bool checkPages = true);

namespace cpu {
struct CpuOptions;
}
namespace emu {
struct EmuOptions;
struct EmuRun;
}

// IHA on host tensors: the spec's generated program run on the host tile
// API (runtime/cpu), reading the inputs and writing out (and lse) in place;
// with `keep` (float32 rows), also what the backward needs (an unset
// schedule.mix and collapse then default to materialised and separate).
// Slow: for checking and for machines without a GPU.
Status runOnHost(const KernelSpec& spec, const IhaTensors& tensors, const Schedule& schedule,
                 const cpu::CpuOptions& options, const IhaSaved* keep = nullptr);

// IHA on host tensors through the CUDA program of `arch` (sm_80 ... sm_90a)
// run on the emulator (runtime/emu, "emu/emulator.h"): the device code as a
// GPU would run it, every access checked. out (and lse) are written in place;
// tokens outside the emulated CTAs (options.maxCtas) are left NaN. The run's
// report says what was covered and holds the findings: a run with any
// finding, or deadlocked, has failed whatever its numbers.
Result<emu::EmuRun> runOnEmulator(const KernelSpec& spec, const IhaTensors& tensors, const Schedule& schedule,
                                  const std::string& arch, const emu::EmuOptions& options,
                                  const IhaSaved* keep = nullptr);

// A decode step on host tensors: the spec's generated decode program on the
// host tile API appends the step's k and v to the cache (only their slots
// are written) and writes out (and lse) in place. cache_len is the caller's
// to advance by T afterwards. Slow: for checking and for machines without a GPU.
Status runDecodeOnHost(const KernelSpec& spec, const IhaTensors& step, const PagedCacheTensors& cache,
                       const Schedule& schedule, const cpu::CpuOptions& options);

// The backward on host tensors: the spec's generated backward on the host
// tile API, writing every gradient (and lse, when given) in place; from
// `saved` when a forward of the same inputs kept them.
Status runBackwardOnHost(const KernelSpec& spec, const IhaTensors& inputs, const IhaGradTensors& grads,
                         const Schedule& schedule, const cpu::CpuOptions& options, const IhaSaved* saved = nullptr);

// The backward on host tensors through the CUDA backward of `arch` on the
// emulator; the run's report holds its findings (any finding fails it).
Result<emu::EmuRun> runBackwardOnEmulator(const KernelSpec& spec, const IhaTensors& inputs, const IhaGradTensors& grads,
                                          const Schedule& schedule, const std::string& arch,
                                          const emu::EmuOptions& options, const IhaSaved* saved = nullptr);

// Bytes of the workspaces a compiled kernel's launches need for B x N
// tokens (its plan's q_mixed, k_mixed, v_mixed, o_pseudo; a backward's
// do_pseudo, delta, dq_pseudo, dk_pseudo, dv_pseudo, partials and lse),
// each rounded up to kWorkspaceAlignment: what a WorkspaceMemory must hold.
inline constexpr int64_t kWorkspaceAlignment = 256;
int64_t workspaceBytes(const v1::CompiledKernel& kernel, int64_t batch, int64_t tokens);

// Device memory the caller owns for a launch's workspaces: at least
// workspaceBytes(kernel, B, N) bytes at a kWorkspaceAlignment-aligned
// address, on the kernel's device, not used by other work until the launch
// has run. A launch given one allocates nothing and waits for nothing
// whatever the stream (loom.torch takes it from PyTorch's caching
// allocator, whose pools CUDA-graph capture understands).
struct WorkspaceMemory {
  void* data = nullptr;
  int64_t bytes = 0;
};

// A host tensor's elements widened to double, in C order.
std::vector<double> hostValues(const Tensor& tensor);

// A compiled kernel plan loaded on a device. Workspaces between its launches
// are the caller's (WorkspaceMemory), or else kept per stream (launches on
// one stream run in order, so they reuse them), allocated on a stream's
// first launch and grown as B and N grow: after a warm-up launch of the
// largest shape, a launch allocates nothing and waits for nothing
// (loom/counters.h). Launches from several threads take turns on the host.
class Kernel {
 public:
  static Result<std::shared_ptr<Kernel>> load(std::shared_ptr<cuda::Device> device, const v1::CompiledKernel& compiled);
  ~Kernel();

  // With `keep` (device tensors, IhaSaved), also what the backward needs:
  // the kernel must materialise the mixing and keep the collapse separate.
  Status launch(const IhaTensors& tensors, CUstream stream = nullptr, const IhaSaved* keep = nullptr,
                const WorkspaceMemory* workspace = nullptr);
  Status launch(const DLTensor* q, const DLTensor* k, const DLTensor* v, const DLTensor* alphaQ,
                const DLTensor* alphaK, const DLTensor* alphaV, const DLTensor* collapse, const DLTensor* out,
                const DLTensor* lse = nullptr, CUstream stream = nullptr);

  // A backward kernel (CompiledKernel::direction backward): every gradient
  // of sum(out * dout) into `grads`, validated like launch; from `saved`
  // (what a forward launch of the same inputs kept) without its pre-mix and
  // attention launches.
  Status launchBackward(const IhaTensors& inputs, const IhaGradTensors& grads, CUstream stream = nullptr,
                        const IhaSaved* saved = nullptr, const WorkspaceMemory* workspace = nullptr);

  // A decode kernel (CompiledKernel::direction decode, a raw cache): one
  // step over the paged cache (docs/IHA.md, Decode over a paged cache). The
  // step's q, k, v, out (and lse) as an IhaTensors of N = T; the cache, page
  // table and lengths on the kernel's device. With `checkPages` (the
  // default) page_table and cache_len are copied to the host and checked
  // (validateDecodeTensors) before the launch: one small synchronous copy
  // a step. Without, only the tensors are checked: for a serving loop that
  // checks its page table where it builds it (a bad entry then reads or
  // writes outside the cache), and for timing the kernel alone.
  Status launchDecode(const IhaTensors& step, const PagedCacheTensors& cache, CUstream stream = nullptr,
                      bool checkPages = true, const WorkspaceMemory* workspace = nullptr);

  const v1::CompiledKernel& compiled() const { return compiled_; }
  // Whether a forward launch can keep IhaSaved (its mixing materialised,
  // its collapse separate: keepingSchedule).
  bool keepsForward() const;
  // Where the kernel came from: "compiled now", "kernel cache", and whether
  // its schedule was tuned (and on which device) or the default.
  const std::string& provenance() const { return provenance_; }

 private:
  friend class Runtime;
  // What the launches on one stream (or over one caller's memory) use.
  struct StreamState {
    std::vector<std::unique_ptr<cuda::DeviceBuffer>> owned;  // the stream's own workspaces (none over a caller's)
    std::map<std::string, void*> workspaces;                // by name
    int64_t rows = 0;  // B * N the workspaces hold
    // Tensor maps over the mixed rows (wgmma engine), encoded for one (B, N)
    // and kept until either changes or the rows move.
    std::unique_ptr<cuda::TmaMaps> maps;
    std::pair<int64_t, int64_t> mapsShape{0, 0};
    std::array<const void*, 5> mapsBuffers{};  // the rows the maps point at (a kept forward's, or the workspaces)
    void* workspace(const char* name) const;   // nullptr where the plan has none of that name
  };
  Kernel() = default;
  // The stream's state, its workspaces grown to B x N tokens, or the state
  // over the caller's `memory` (the caller holds mutex_).
  Result<StreamState*> streamState(CUstream stream, int64_t batch, int64_t tokens,
                                   const WorkspaceMemory* memory = nullptr);
  // Runs every entry point on `args` (B = args.batch, N = args.tokens).
  // skipForward: not the pre-mix and attention launches (a backward from a kept forward).
  Status launchEntries(IhaArgs& args, CUstream stream, bool skipForward, StreamState& state);
  Status encodeTensorMaps(const IhaArgs& args, int64_t L, int64_t B, cuda::TmaMaps& maps) const;

  std::shared_ptr<cuda::Device> device_;
  v1::CompiledKernel compiled_;
  CUmodule module_ = nullptr;
  std::vector<CUfunction> functions_;  // one per entry, in launch order
  std::mutex mutex_;                   // a launch at a time on the host
  std::map<CUstream, std::unique_ptr<StreamState>> streams_;
  std::map<void*, std::unique_ptr<StreamState>> callerStates_;  // by the caller's memory (its maps kept)
  std::string provenance_ = "loaded";
};

class Runtime {
 public:
  struct Options {
    int device = 0;
    // Kernel cache (kernels.sqlite: tuned schedules, compiled kernels) and
    // NVRTC artifacts; empty: $LOOM_CACHE_DIR or ~/.cache/loom.
    std::string cacheDir;
  };

  // Opens the GPU. Without a driver or device the error says so.
  static Result<std::unique_ptr<Runtime>> create(const Options& options);
  static Result<std::unique_ptr<Runtime>> create() { return create(Options{}); }
  ~Runtime();

  const cuda::DeviceInfo& device() const;
  // The opened device (for buffers that live beside its kernels).
  std::shared_ptr<cuda::Device> gpu() const;
  // The device as a compile target (arch and properties).
  v1::Target target() const;

  // Loads the spec's kernel: with no schedule given, the one tuned for this
  // device model (or its class) in the kernel cache, else the default; the
  // compiled kernel from the cache, else generated and compiled by NVRTC
  // (and stored). `shapeBucket` (cache::shapeBucket(direction, B, N), or
  // of a decode step's batch and cache length): the decision tuned for
  // those shapes, else for the nearest tuned ones, else for every shape;
  // empty, the one for every shape. Every direction takes it.
  Result<std::shared_ptr<Kernel>> kernel(const KernelSpec& spec, const Schedule& schedule = {},
                                         const std::string& shapeBucket = "");
  // The spec's forward kernel that can keep what its backward reads
  // (Kernel::launch with IhaSaved): the given schedule, else the tuned one
  // (or the default), with its mixing materialised and its collapse
  // separate (keepingSchedule); kept apart from kernel()'s.
  Result<std::shared_ptr<Kernel>> keepingKernel(const KernelSpec& spec, const Schedule& schedule = {},
                                                const std::string& shapeBucket = "");
  // The spec's backward kernel (Kernel::launchBackward), cached apart from
  // the forward's.
  Result<std::shared_ptr<Kernel>> backwardKernel(const KernelSpec& spec, const Schedule& schedule = {},
                                                 const std::string& shapeBucket = "");
  // The spec's decode kernel over a cache of `layout` (Kernel::launchDecode),
  // tuned and cached apart from the other directions (and layouts).
  Result<std::shared_ptr<Kernel>> decodeKernel(const KernelSpec& spec, CacheLayout layout = CacheLayout::raw,
                                               const Schedule& schedule = {}, const std::string& shapeBucket = "");
  // Loads an already compiled kernel (from the cache or the service).
  Result<std::shared_ptr<Kernel>> load(const v1::CompiledKernel& compiled);

  // kernel, backwardKernel and decodeKernel keep what they load, by spec,
  // schedule, direction and shape bucket, for the Runtime's life: a steady-state call is a
  // lookup (no store read, generation or module load). A decision tuned
  // since (loom tune, a service) is picked up after reload(), which forgets
  // them (kernels already handed out stay valid), or by a new Runtime.
  void reload();

 private:
  Runtime() = default;
  Result<std::shared_ptr<Kernel>> provideAndLoad(const KernelSpec& spec, const Schedule& schedule,
                                                 v1::Direction direction, const std::string& what,
                                                 bool keepsForward, const std::string& shapeBucket);
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace loom
