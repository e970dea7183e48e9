// The `loom` Python module: the host API for Python programs.
//
//   import loom, torch
//   out = loom.iha(q, k, v, alpha_q, alpha_k, alpha_v, collapse, spec)   # any DLPack tensors
//   out = torch.from_dlpack(out)
//   dq, dk, dv, dalpha_q, dalpha_k, dalpha_v, dcollapse = loom.iha_backward(..., dout, spec)
//
// Built as loom._loom; python/loom/__init__.py re-exports it, and
// python/loom/torch.py builds autograd and a layer on top (loom.torch).
//
// CUDA tensors run the spec's kernel (tuned schedule and compiled kernel from
// the kernel cache or a loom service, else compiled now); host tensors run
// the same program on the host tile API (slow; for checking). Errors carry
// the C++ messages: ValueError for a bad spec, schedule or tensor,
// loom.Error for everything else (no GPU, a compile failure).
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "api/compile.h"
#include "api/strided.h"
#include "cpu/cpu_backend.h"
#include "cuda/driver.h"
#include "io/case.h"
#include "io/npy.h"
#include "jit/nvrtc_compiler.h"
#include "loom/cache.h"
#include "loom/client.h"
#include "loom/compiler.h"
#include "loom/counters.h"
#include "loom/runtime.h"
#include "loom/served.h"
#include "loom/spec.h"
#include "reference/iha_backward.h"
#include "reference/iha_reference.h"

namespace py = pybind11;

namespace loom::python {
namespace {

// A bad argument: raised as ValueError with the message.
struct BadArgument : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Anything else loom reports: raised as loom.Error.
struct LoomError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string withLog(const Error& error) {
  return error.log.empty() ? error.message : error.message + "\n" + error.log;
}

template <typename T>
T valueOr(Result<T> result, bool badArgument) {
  if (!result) {
    if (badArgument) throw BadArgument(withLog(result.error()));
    throw LoomError(withLog(result.error()));
  }
  return std::move(*result);
}
void check(const Status& status, bool badArgument) {
  if (!status) {
    if (badArgument) throw BadArgument(withLog(status.error()));
    throw LoomError(withLog(status.error()));
  }
}

// A spec or schedule given as a dict, a JSON string or a path to a JSON file.
std::string jsonText(const py::object& value, const char* what) {
  if (py::isinstance<py::dict>(value)) return py::module_::import("json").attr("dumps")(value).cast<std::string>();
  if (py::isinstance<py::str>(value)) {
    const std::string text = value.cast<std::string>();
    if (!text.empty() && text.front() == '{') return text;
    return valueOr(readTextFile(text), true);
  }
  throw BadArgument(std::string(what) + ": want a dict, a JSON string or a path to a JSON file");
}

// What a call's text parsed to, kept by the text: a steady-state call (the
// same spec and schedule every layer and step) parses and validates nothing.
// Only what parsed is kept; callers hold the GIL, which guards the maps. A
// process sees a handful of texts; past kMemoTexts the memo starts over.
constexpr size_t kMemoTexts = 1024;
template <typename T, typename Parse>
const T& memoized(std::unordered_map<std::string, T>& memo, std::string text, Parse parse) {
  if (auto found = memo.find(text); found != memo.end()) return found->second;
  T parsed = parse(text);  // throws for bad text: nothing kept
  if (memo.size() >= kMemoTexts) memo.clear();
  return memo.emplace(std::move(text), std::move(parsed)).first->second;
}

KernelSpec specOf(const py::object& value) {
  static std::unordered_map<std::string, KernelSpec> specs;
  return memoized(specs, jsonText(value, "spec"), [](const std::string& text) {
    KernelSpec spec = valueOr(parseSpecJson(text, "spec"), true);
    check(validateSpec(spec), true);
    return spec;
  });
}

Schedule scheduleOf(const py::object& value) {
  if (value.is_none()) return Schedule();
  static std::unordered_map<std::string, Schedule> schedules;
  return memoized(schedules, jsonText(value, "schedule"), [](const std::string& text) {
    return valueOr(parseScheduleJson(text, "schedule"), true);
  });
}

// Checks that `schedule` resolves for `spec` in `direction` on `target` (a
// ValueError naming the field if not), once a (spec, schedule, target,
// direction): resolving builds an MLIR context, which would cost more than a
// small problem's whole run. On CUDA only a forced schedule is checked (an
// empty one is the tuned decision's, checked where it was tuned).
void checkResolves(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                   Direction direction = Direction::forward, bool mixedCache = false) {
  if (target.kind() == v1::Target::cuda && schedule.ByteSizeLong() == 0) return;
  static std::unordered_set<std::string> resolved;
  std::string key = spec.SerializeAsString() + '\0' + schedule.SerializeAsString() + '\0' +
                    target.SerializeAsString() + '\0' + std::to_string(int(direction)) + (mixedCache ? "m" : "r");
  if (resolved.count(key)) return;
  valueOr(resolveSchedule(spec, schedule, target, direction, mixedCache), true);
  if (resolved.size() >= kMemoTexts) resolved.clear();
  resolved.insert(std::move(key));
}
const v1::Target& hostTarget() {
  static const v1::Target target = *parseTarget("cpu");
  return target;
}

py::object fromJson(const std::string& json) { return py::module_::import("json").attr("loads")(json); }

//===--- DLPack in --------------------------------------------------------===//

// A borrowed DLPack tensor: the capsule stays with (and is freed by) its
// producer's object, which we keep alive for the call.
struct Borrowed {
  py::object capsule;
  DLTensor* tensor = nullptr;
};

Borrowed borrow(const py::object& value, const char* name, std::optional<int64_t> stream) {
  Borrowed b;
  if (PyCapsule_IsValid(value.ptr(), "dltensor")) {
    b.capsule = value;
  } else if (py::hasattr(value, "__dlpack__")) {
    // A stream is passed to a CUDA producer only (it orders its work before
    // the stream's); without one, the device is not asked.
    const bool cuda = stream && py::tuple(value.attr("__dlpack_device__")())[0].cast<int>() == kDLCUDA;
    b.capsule = cuda ? value.attr("__dlpack__")(py::arg("stream") = *stream) : value.attr("__dlpack__")();
  } else {
    throw BadArgument(std::string(name) + ": not a DLPack tensor (no __dlpack__; torch, cupy, jax and numpy arrays are)");
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(b.capsule.ptr(), "dltensor"));
  if (!managed) throw BadArgument(std::string(name) + ": a DLPack capsule that was already consumed");
  b.tensor = &managed->dl_tensor;
  return b;
}

//===--- DLPack out: tensors loom allocates ---------------------------------===//

// Memory of an output: host bytes or a device buffer.
struct Storage {
  std::vector<uint8_t> host;
  std::unique_ptr<cuda::DeviceBuffer> device;
  void* data() { return device ? device->data() : static_cast<void*>(host.data()); }
};

// A tensor loom made, handed out through __dlpack__ (torch.from_dlpack,
// numpy.from_dlpack, cupy.from_dlpack take it).
class OutputTensor {
 public:
  OutputTensor(std::shared_ptr<Storage> storage, std::vector<int64_t> shape, DLDataType dtype, DLDevice device)
      : storage_(std::move(storage)), shape_(std::move(shape)), dtype_(dtype), device_(device) {}

  py::capsule dlpack(py::object /*stream*/) const {
    struct Context {
      std::shared_ptr<Storage> storage;
      std::vector<int64_t> shape;
      DLManagedTensor managed;
    };
    auto* context = new Context{storage_, shape_, {}};
    DLTensor& t = context->managed.dl_tensor;
    t.data = storage_->data();
    t.device = device_;
    t.ndim = int32_t(shape_.size());
    t.dtype = dtype_;
    t.shape = context->shape.data();
    t.strides = nullptr;  // compact, C order
    t.byte_offset = 0;
    context->managed.manager_ctx = context;
    context->managed.deleter = [](DLManagedTensor* self) { delete static_cast<Context*>(self->manager_ctx); };
    // A capsule nobody consumed frees the tensor itself.
    PyObject* capsule = PyCapsule_New(&context->managed, "dltensor", [](PyObject* object) {
      if (PyCapsule_IsValid(object, "dltensor")) {
        auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(object, "dltensor"));
        managed->deleter(managed);
      }
    });
    if (!capsule) throw py::error_already_set();
    return py::reinterpret_steal<py::capsule>(capsule);
  }
  py::tuple dlpackDevice() const { return py::make_tuple(int(device_.device_type), device_.device_id); }
  std::vector<int64_t> shape() const { return shape_; }
  std::string dtype() const {
    if (dtype_.code == kDLBfloat) return "bfloat16";
    return dtype_.bits == 64 ? "float64" : dtype_.bits == 32 ? "float32" : "float16";
  }
  std::string device() const { return device_.device_type == kDLCPU ? "cpu" : "cuda:" + std::to_string(device_.device_id); }

 private:
  std::shared_ptr<Storage> storage_;
  std::vector<int64_t> shape_;
  DLDataType dtype_;
  DLDevice device_;
};

DLDataType dlTypeOf(v1::DType dtype) {
  if (dtype == v1::bfloat16) return {kDLBfloat, 16, 1};
  if (dtype == v1::float16) return {kDLFloat, 16, 1};
  return {kDLFloat, 32, 1};
}
int64_t bytesOf(v1::DType dtype) { return dtype == v1::float32 ? 4 : 2; }

// A compact output on the inputs' device, and its DLTensor view.
struct Allocated {
  std::shared_ptr<OutputTensor> tensor;
  DLTensor view{};
  std::vector<int64_t> shape;
};

Allocated allocate(const std::vector<int64_t>& shape, DLDataType type, int64_t elementBytes, DLDevice device,
                   const std::shared_ptr<cuda::Device>& gpu) {
  Allocated a;
  a.shape = shape;
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  auto storage = std::make_shared<Storage>();
  if (device.device_type == kDLCPU) {
    storage->host.resize(size_t(count * elementBytes));
  } else {
    storage->device =
        std::make_unique<cuda::DeviceBuffer>(valueOr(cuda::DeviceBuffer::allocate(*gpu, size_t(count * elementBytes)), false));
  }
  a.tensor = std::make_shared<OutputTensor>(storage, shape, type, device);
  a.view.data = storage->data();
  a.view.device = device;
  a.view.ndim = int32_t(shape.size());
  a.view.dtype = type;
  a.view.shape = a.shape.data();
  return a;
}

//===--- the GPU: one Runtime per (device, cache) -----------------------------===//

std::mutex runtimesMutex;
std::map<std::pair<int, std::string>, std::shared_ptr<Runtime>> runtimes;

std::shared_ptr<Runtime> runtimeFor(int device, const std::string& cacheDir) {
  std::lock_guard lock(runtimesMutex);
  auto& slot = runtimes[{device, cacheDir}];
  if (!slot) {
    Runtime::Options options;
    options.device = device;
    options.cacheDir = cacheDir;
    slot = valueOr(Runtime::create(options), false);
  }
  return slot;
}

std::vector<std::shared_ptr<Runtime>> runtimesMade() {
  std::lock_guard lock(runtimesMutex);
  std::vector<std::shared_ptr<Runtime>> made;
  for (const auto& [key, runtime] : runtimes)
    if (runtime) made.push_back(runtime);
  return made;
}

// The kernels served kernels and the clients behind them (kernelFor).
std::mutex& servedMutex() {
  static std::mutex mutex;
  return mutex;
}
std::map<std::string, std::shared_ptr<Kernel>>& servedKernels() {
  static std::map<std::string, std::shared_ptr<Kernel>> kernels;
  return kernels;
}
service::ServedKernels& served() {
  static service::ServedKernels kernels;
  return kernels;
}

// loom.reload(): every Runtime and the served kernels forget what they kept,
// so that a decision tuned since is read on the next call.
void reloadKernels() {
  for (const std::shared_ptr<Runtime>& runtime : runtimesMade()) runtime->reload();
  std::lock_guard lock(servedMutex());
  servedKernels().clear();
  served().forget();
}

// The kernel of the launch's shape bucket (cache::shapeBucket: a forward's
// or backward's B and N, a decode step's B and cache capacity): the
// decision tuned for those shapes, else the nearest, else every shape's.
std::shared_ptr<Kernel> kernelFor(Runtime& runtime, const KernelSpec& spec, const Schedule& schedule,
                                  const std::string& service, v1::Direction direction, const std::string& bucket) {
  if (service.empty()) {
    switch (direction) {
      case v1::direction_backward: return valueOr(runtime.backwardKernel(spec, schedule, bucket), false);
      case v1::direction_decode:
      case v1::direction_decode_mixed:
        return valueOr(runtime.decodeKernel(spec, mixedCacheOf(direction) ? CacheLayout::mixed : CacheLayout::raw,
                                            schedule, bucket),
                       false);
      default: return valueOr(runtime.kernel(spec, schedule, bucket), false);
    }
  }
  // A service's kernels are kept too, loaded, by service, device, direction,
  // spec and bucket, fetched once over one channel a service
  // (service::ServedKernels; loom.reload() forgets the kernels).
  std::lock_guard lock(servedMutex());
  const std::string key = service + '\0' + std::to_string(runtime.device().ordinal) + '\0' +
                          std::to_string(int(direction)) + '\0' + spec.SerializeAsString() + '\0' + bucket;
  if (auto found = servedKernels().find(key); found != servedKernels().end()) return found->second;
  auto compiled = valueOr(served().get(service, spec, runtime.target(), direction, bucket), false);
  return servedKernels()[key] = valueOr(runtime.load(*compiled), false);
}

//===--- loom.iha --------------------------------------------------------===//

// The seven inputs of IHA, borrowed; q must be [B, N, H, d] (a ragged
// step's [total, H, d]: qRank 3).
struct Inputs {
  std::vector<Borrowed> borrowed;
  const DLTensor& q() const { return *borrowed[0].tensor; }
  const DLTensor* operator[](size_t i) const { return borrowed[i].tensor; }
};

Inputs borrowInputs(const py::object& q, const py::object& k, const py::object& v, const py::object& alphaQ,
                    const py::object& alphaK, const py::object& alphaV, const py::object& collapse,
                    std::optional<int64_t> stream, int qRank = 4) {
  Inputs inputs;
  const char* names[] = {"q", "k", "v", "alpha_q", "alpha_k", "alpha_v", "collapse"};
  const py::object* objects[] = {&q, &k, &v, &alphaQ, &alphaK, &alphaV, &collapse};
  for (int i = 0; i < 7; ++i) inputs.borrowed.push_back(borrow(*objects[i], names[i], stream));
  if (inputs.q().ndim != qRank)
    throw BadArgument(qRank == 4 ? "q: want 4 dimensions [B, N, H, d]"
                                 : "q: a ragged step packs its sequences' new tokens, [total, H, d]");
  return inputs;
}

// A DLPack tensor in C order without gaps (strides null or compact), or a ValueError.
void requireContiguous(const DLTensor& t, const std::string& name) {
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0 && t.strides; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expected) throw BadArgument(name + ": must be contiguous");
    expected *= t.shape[i];
  }
}

// An int32 array (page_table, cache_len) on the step's device: dense, of
// `rank` dimensions.
const int32_t* int32Array(const Borrowed& b, const char* name, int rank, const DLDevice& device,
                          std::vector<int64_t>* shape) {
  const DLTensor& t = *b.tensor;
  if (t.device.device_type != device.device_type || (device.device_type != kDLCPU && t.device.device_id != device.device_id))
    throw BadArgument(std::string(name) + ": must be on the step's device (" +
                      (device.device_type == kDLCPU ? std::string("host memory") : "cuda:" + std::to_string(device.device_id)) +
                      ")");
  if (t.dtype.code != kDLInt || t.dtype.bits != 32 || t.dtype.lanes != 1)
    throw BadArgument(std::string(name) + ": dtype must be int32");
  if (t.ndim != rank) throw BadArgument(std::string(name) + ": want " + std::to_string(rank) + " dimensions");
  shape->assign(t.shape, t.shape + t.ndim);
  requireContiguous(t, name);
  return reinterpret_cast<const int32_t*>(static_cast<const char*>(t.data) + t.byte_offset);
}

// Varlen: the documents' bounds (cu_seqlens, int32 [documents + 1] on q's
// device) into the tensors, when given; `keep` holds the borrowed capsule.
void documentsInto(const py::object& value, std::optional<int64_t> stream, const DLDevice& device, IhaTensors& t,
                   std::optional<Borrowed>& keep) {
  if (value.is_none()) return;
  keep = borrow(value, "cu_seqlens", stream);
  std::vector<int64_t> shape;
  t.cu_seqlens = int32Array(*keep, "cu_seqlens", 1, device, &shape);
  t.documents = shape[0] - 1;
  // Host bounds are checked here (a ValueError); a CUDA launch checks its own.
  if (device.device_type == kDLCPU && !t.q.shape.empty())
    check(validateCuSeqlens(t.cu_seqlens, shape[0], t.q.shape.size() == 4 ? t.q.shape[1] : t.q.shape[0]), true);
}

// The caller's workspace memory (a dense DLPack tensor of any dtype on the
// launch's CUDA device), or none.
std::optional<WorkspaceMemory> workspaceOf(const py::object& value, std::optional<int64_t> stream, DLDevice device,
                                           std::optional<Borrowed>& keepAlive) {
  if (value.is_none()) return std::nullopt;
  keepAlive = borrow(value, "workspace", stream);
  const DLTensor& t = *keepAlive->tensor;
  if (t.device.device_type != device.device_type || t.device.device_id != device.device_id)
    throw BadArgument("workspace: on another device than q");
  requireContiguous(t, "workspace");
  int64_t elements = 1;
  for (int i = 0; i < t.ndim; ++i) elements *= t.shape[i];
  return WorkspaceMemory{static_cast<char*>(t.data) + t.byte_offset, elements * ((t.dtype.bits * t.dtype.lanes + 7) / 8)};
}

// The forward's kept state (IhaSaved) from a sequence of five tensors
// (q_mixed, k_mixed, v_mixed, o_pseudo, lse), or none; `held` keeps the
// borrowed capsules for the call.
std::optional<IhaSaved> savedOf(const py::object& value, std::optional<int64_t> stream, std::vector<Borrowed>& held) {
  if (value.is_none()) return std::nullopt;
  const auto tensors = value.cast<std::vector<py::object>>();
  const char* names[] = {"q_mixed", "k_mixed", "v_mixed", "o_pseudo", "lse"};
  if (tensors.size() != 5)
    throw BadArgument("saved: want five tensors (q_mixed, k_mixed, v_mixed, o_pseudo, lse), got " +
                      std::to_string(tensors.size()));
  IhaSaved saved;
  Tensor* slots[] = {&saved.q_mixed, &saved.k_mixed, &saved.v_mixed, &saved.o_pseudo, &saved.lse};
  for (size_t i = 0; i < 5; ++i) {
    held.push_back(borrow(tensors[i], names[i], stream));
    *slots[i] = valueOr(tensorFromDlpack(names[i], held.back().tensor), true);
  }
  return saved;
}

// The forward kernel of a call: the keeping one where the call keeps its
// state (a service's own where it keeps, else this runtime's).
std::shared_ptr<Kernel> forwardKernelFor(Runtime& runtime, const KernelSpec& spec, const Schedule& schedule,
                                         const std::string& service, bool keeps, const std::string& bucket) {
  if (keeps && (service.empty() ||
                !kernelFor(runtime, spec, schedule, service, v1::direction_forward, bucket)->keepsForward()))
    return valueOr(runtime.keepingKernel(spec, schedule, bucket), false);
  return kernelFor(runtime, spec, schedule, service, v1::direction_forward, bucket);
}

py::object iha(const py::object& q, const py::object& k, const py::object& v, const py::object& alphaQ,
               const py::object& alphaK, const py::object& alphaV, const py::object& collapse,
               const py::object& specValue, std::optional<int64_t> stream, const py::object& out,
               const py::object& lse, const py::object& scheduleValue, const std::string& cacheDir,
               const std::string& service, int threads, const py::object& workspaceValue,
               const py::object& cuSeqlens, const py::object& savedValue) {
  const KernelSpec spec = specOf(specValue);
  const Schedule schedule = scheduleOf(scheduleValue);
  const Inputs inputs = borrowInputs(q, k, v, alphaQ, alphaK, alphaV, collapse, stream);
  const DLTensor& qt = inputs.q();
  const DLDevice device = qt.device;
  const bool onHost = device.device_type == kDLCPU;
  std::shared_ptr<Runtime> runtime;
  if (!onHost) runtime = runtimeFor(device.device_id, cacheDir);

  const std::vector<int64_t> outShape = {qt.shape[0], qt.shape[1], spec.heads(), spec.head_dim()};
  std::optional<Borrowed> outGiven, lseGiven;
  Allocated made;
  const DLTensor* outTensor = nullptr;
  if (out.is_none()) {
    made = allocate(outShape, dlTypeOf(spec.dtype()), bytesOf(spec.dtype()), device,
                    runtime ? runtime->gpu() : nullptr);
    outTensor = &made.view;
  } else {
    outGiven = borrow(out, "out", stream);
    outTensor = outGiven->tensor;
  }
  if (!lse.is_none()) lseGiven = borrow(lse, "lse", stream);

  IhaTensors tensors = valueOr(
      tensorsFromDlpack(inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5], inputs[6], outTensor,
                        lseGiven ? lseGiven->tensor : nullptr),
      true);
  std::optional<Borrowed> bounds;
  documentsInto(cuSeqlens, stream, device, tensors, bounds);
  std::vector<Borrowed> savedHeld;
  const std::optional<IhaSaved> saved = savedOf(savedValue, stream, savedHeld);
  const Schedule forced = saved ? valueOr(keepingSchedule(schedule), true) : schedule;
  if (onHost) {
    check(validateTensors(spec, tensors, kHostDevice), true);
    checkResolves(spec, forced, hostTarget());
    if (saved) check(validateSaved(spec, *saved, tensors.q.shape[0], tensors.q.shape[1], false, kHostDevice), true);
    const cpu::CpuOptions options{cacheDir, threads};
    py::gil_scoped_release release;
    check(runOnHost(spec, tensors, schedule, options, saved ? &*saved : nullptr), false);  // compiling, running
  } else {
    checkResolves(spec, forced, runtime->target());
    const IhaTensors launched = batchedView(spec, tensors);
    std::shared_ptr<Kernel> kernel =
        forwardKernelFor(*runtime, spec, schedule, service, saved.has_value(),
                         cache::shapeBucket(v1::direction_forward, launched.q.shape[0], launched.q.shape[1]));
    check(validateTensors(spec, tensors, device.device_id), true);
    if (saved)
      check(validateSaved(spec, *saved, tensors.q.shape[0], tensors.q.shape[1], true, device.device_id), true);
    std::optional<Borrowed> held;
    const std::optional<WorkspaceMemory> workspace = workspaceOf(workspaceValue, stream, device, held);
    py::gil_scoped_release release;
    check(kernel->launch(tensors, reinterpret_cast<CUstream>(stream.value_or(0)), saved ? &*saved : nullptr,
                         workspace ? &*workspace : nullptr),
          false);
  }
  if (outGiven) return out;
  return py::cast(made.tensor);
}

//===--- loom.iha_backward ------------------------------------------------===//

// The seven gradients of sum(out * dout), float32 and each the shape of its
// input, into the tensors given (any may be None: allocated and returned as
// loom.Tensor). CUDA tensors run the spec's backward kernel on `stream`,
// host tensors its program on the host tile API. The forward's out is not
// needed: the backward recomputes the pseudo outputs (lse, when given,
// receives them).
py::tuple ihaBackward(const py::object& q, const py::object& k, const py::object& v, const py::object& alphaQ,
                      const py::object& alphaK, const py::object& alphaV, const py::object& collapse,
                      const py::object& dout, const py::object& specValue, const std::vector<py::object>& given,
                      const py::object& lse, std::optional<int64_t> stream, const py::object& scheduleValue,
                      const std::string& cacheDir, const std::string& service, int threads,
                      const py::object& workspaceValue, const py::object& cuSeqlens, const py::object& savedValue) {
  const KernelSpec spec = specOf(specValue);
  const Schedule schedule = scheduleOf(scheduleValue);
  const Inputs inputs = borrowInputs(q, k, v, alphaQ, alphaK, alphaV, collapse, stream);
  const Borrowed doutBorrowed = borrow(dout, "dout", stream);
  const DLDevice device = inputs.q().device;
  const bool onHost = device.device_type == kDLCPU;
  std::shared_ptr<Runtime> runtime;
  if (!onHost) runtime = runtimeFor(device.device_id, cacheDir);

  const int64_t B = inputs.q().shape[0], N = inputs.q().shape[1];
  const std::vector<std::vector<int64_t>> shapes = inputShapes(spec, B, N);
  const char* names[] = {"dq", "dk", "dv", "dalpha_q", "dalpha_k", "dalpha_v", "dcollapse"};
  std::vector<Borrowed> borrowed(7);
  std::vector<Allocated> made(7);
  const DLTensor* views[7];
  for (size_t i = 0; i < 7; ++i) {
    if (i < given.size() && !given[i].is_none()) {
      borrowed[i] = borrow(given[i], names[i], stream);
      views[i] = borrowed[i].tensor;
    } else {
      made[i] = allocate(shapes[i], {kDLFloat, 32, 1}, 4, device, runtime ? runtime->gpu() : nullptr);
      views[i] = &made[i].view;
    }
  }
  std::optional<Borrowed> lseGiven;
  if (!lse.is_none()) lseGiven = borrow(lse, "lse", stream);
  // The backward does not read the forward's out: dout (its shape and dtype) stands in.
  IhaTensors tensors = valueOr(tensorsFromDlpack(inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5],
                                                 inputs[6], doutBorrowed.tensor, lseGiven ? lseGiven->tensor : nullptr),
                               true);
  IhaGradTensors grads = valueOr(gradTensorsFromDlpack(doutBorrowed.tensor, views[0], views[1], views[2], views[3],
                                                       views[4], views[5], views[6]),
                                 true);
  std::optional<Borrowed> bounds;
  documentsInto(cuSeqlens, stream, device, tensors, bounds);
  std::vector<Borrowed> savedHeld;
  const std::optional<IhaSaved> saved = savedOf(savedValue, stream, savedHeld);
  if (onHost) {
    check(validateGradTensors(spec, tensors, grads, kHostDevice), true);
    checkResolves(spec, schedule, hostTarget(), Direction::backward);
    if (saved) check(validateSaved(spec, *saved, B, N, false, kHostDevice), true);
    const cpu::CpuOptions options{cacheDir, threads};
    py::gil_scoped_release release;
    check(runBackwardOnHost(spec, tensors, grads, schedule, options, saved ? &*saved : nullptr), false);
  } else {
    checkResolves(spec, schedule, runtime->target(), Direction::backward);
    std::shared_ptr<Kernel> kernel = kernelFor(*runtime, spec, schedule, service, v1::direction_backward,
                                               cache::shapeBucket(v1::direction_backward, B, N));
    check(validateGradTensors(spec, tensors, grads, device.device_id), true);
    if (saved) check(validateSaved(spec, *saved, B, N, true, device.device_id), true);
    std::optional<Borrowed> held;
    const std::optional<WorkspaceMemory> workspace = workspaceOf(workspaceValue, stream, device, held);
    py::gil_scoped_release release;
    check(kernel->launchBackward(tensors, grads, reinterpret_cast<CUstream>(stream.value_or(0)),
                                 saved ? &*saved : nullptr, workspace ? &*workspace : nullptr),
          false);
  }
  py::tuple result(7);
  for (size_t i = 0; i < 7; ++i) result[i] = made[i].tensor ? py::cast(made[i].tensor) : given[i];
  return result;
}

//===--- loom.reference, generate, compile, devices --------------------------===//

// A host DLPack tensor's values (float64, or what tensorFromDlpack views) as
// doubles in C order.
std::vector<double> valuesOf(const DLTensor& t, const char* name) {
  if (t.device.device_type != kDLCPU) throw BadArgument(std::string(name) + ": the reference takes host tensors");
  if (t.dtype.code == kDLFloat && t.dtype.bits == 64 && t.dtype.lanes == 1) {
    Tensor layout;  // its shape and strides only: Tensor holds no float64
    layout.shape.assign(t.shape, t.shape + t.ndim);
    if (t.strides) layout.strides.assign(t.strides, t.strides + t.ndim);
    std::vector<double> values;
    const auto* base = reinterpret_cast<const double*>(static_cast<const char*>(t.data) + t.byte_offset);
    forEachElement(layout.shape, stridesOf(layout), [&](int64_t offset, int64_t) { values.push_back(base[offset]); });
    return values;
  }
  return hostValues(valueOr(tensorFromDlpack(name, &t), true));
}

// The inputs of host tensors as the float64 reference takes them (a varlen
// spec's documents from cu_seqlens, host int32, checked).
reference::IhaInputs referenceInputs(const KernelSpec& spec, const Inputs& borrowed, const py::object& cuSeqlens) {
  const char* names[] = {"q", "k", "v", "alpha_q", "alpha_k", "alpha_v", "collapse"};
  const int64_t B = borrowed.q().shape[0], N = borrowed.q().shape[1];
  const std::vector<std::vector<int64_t>> shapes = inputShapes(spec, B, N);
  std::vector<std::vector<double>> values;
  for (size_t i = 0; i < 7; ++i) {
    const DLTensor& t = *borrowed[i];
    const std::vector<int64_t> shape(t.shape, t.shape + t.ndim);
    if (shape != shapes[i])
      throw BadArgument(std::string(names[i]) + ": shape " + shapeString(shape) + ", want " + shapeString(shapes[i]));
    values.push_back(valuesOf(t, names[i]));
  }
  reference::IhaInputs inputs{B, N, values[0], values[1], values[2], values[3], values[4], values[5], values[6], {}};
  if (spec.varlen() != !cuSeqlens.is_none())
    throw BadArgument(spec.varlen() ? "cu_seqlens: missing (a varlen spec packs documents)"
                                    : "cu_seqlens: given, but the spec is not varlen");
  if (!cuSeqlens.is_none()) {
    IhaTensors bounds;
    std::optional<Borrowed> keep;
    documentsInto(cuSeqlens, std::nullopt, DLDevice{kDLCPU, 0}, bounds, keep);
    inputs.cu_seqlens.assign(bounds.cu_seqlens, bounds.cu_seqlens + bounds.documents + 1);
    if (B != 1) throw BadArgument("q: a varlen spec's documents are packed in one batch, got B = " + std::to_string(B));
    check(validateCuSeqlens(inputs.cu_seqlens.data(), int64_t(inputs.cu_seqlens.size()), N), true);
  }
  return inputs;
}

// A float64 host loom.Tensor holding `data`.
py::object float64Tensor(const std::vector<double>& data, std::vector<int64_t> shape) {
  Allocated a = allocate(shape, {kDLFloat, 64, 1}, 8, DLDevice{kDLCPU, 0}, nullptr);
  std::memcpy(a.view.data, data.data(), data.size() * sizeof(double));
  return py::cast(a.tensor);
}

// The float64 oracle on host tensors; returns (out, lse) as float64.
py::tuple reference(const py::object& q, const py::object& k, const py::object& v, const py::object& alphaQ,
                    const py::object& alphaK, const py::object& alphaV, const py::object& collapse,
                    const py::object& specValue, const py::object& cuSeqlens) {
  const KernelSpec spec = specOf(specValue);
  const reference::IhaInputs inputs =
      referenceInputs(spec, borrowInputs(q, k, v, alphaQ, alphaK, alphaV, collapse, std::nullopt), cuSeqlens);
  reference::IhaOutputs outputs;
  {
    py::gil_scoped_release release;
    outputs = reference::ihaForward(spec, inputs);
  }
  const int64_t B = inputs.batch, N = inputs.tokens;
  return py::make_tuple(float64Tensor(outputs.out, {B, N, spec.heads(), spec.head_dim()}),
                        float64Tensor(outputs.lse, {B, spec.heads(), N * spec.pseudo_heads()}));
}

// The inputs, dout and spec of a backward on host tensors, checked.
struct BackwardArguments {
  KernelSpec spec;
  reference::IhaInputs inputs;
  std::vector<double> dout;
};
BackwardArguments backwardArguments(const py::object& q, const py::object& k, const py::object& v,
                                    const py::object& alphaQ, const py::object& alphaK, const py::object& alphaV,
                                    const py::object& collapse, const py::object& dout, const py::object& specValue,
                                    const py::object& cuSeqlens = py::none()) {
  BackwardArguments a{specOf(specValue), {}, {}};
  a.inputs =
      referenceInputs(a.spec, borrowInputs(q, k, v, alphaQ, alphaK, alphaV, collapse, std::nullopt), cuSeqlens);
  const Borrowed d = borrow(dout, "dout", std::nullopt);
  const std::vector<int64_t> doutShape(d.tensor->shape, d.tensor->shape + d.tensor->ndim);
  const std::vector<int64_t> want = {a.inputs.batch, a.inputs.tokens, a.spec.heads(), a.spec.head_dim()};
  if (doutShape != want) throw BadArgument("dout: shape " + shapeString(doutShape) + ", want " + shapeString(want));
  a.dout = valuesOf(*d.tensor, "dout");
  return a;
}

// The float64 backward oracle on host tensors: the seven gradients of
// sum(out * dout) as float64 loom.Tensors.
py::tuple referenceBackward(const py::object& q, const py::object& k, const py::object& v, const py::object& alphaQ,
                            const py::object& alphaK, const py::object& alphaV, const py::object& collapse,
                            const py::object& dout, const py::object& specValue, const py::object& cuSeqlens) {
  const BackwardArguments a = backwardArguments(q, k, v, alphaQ, alphaK, alphaV, collapse, dout, specValue, cuSeqlens);
  reference::IhaGradients gradients;
  {
    py::gil_scoped_release release;
    gradients = reference::ihaBackward(a.spec, a.inputs, a.dout);
  }
  const std::vector<std::vector<int64_t>> shapes = inputShapes(a.spec, a.inputs.batch, a.inputs.tokens);
  const auto slots = reference::gradientsOf(gradients);
  py::tuple result(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) result[i] = float64Tensor(*slots[i], shapes[i]);
  return result;
}

// backwardCheckShare (core/io/case.h) on host tensors.
double backwardCheckShare(const py::object& q, const py::object& k, const py::object& v, const py::object& alphaQ,
                          const py::object& alphaK, const py::object& alphaV, const py::object& collapse,
                          const py::object& dout, const py::object& specValue) {
  const BackwardArguments a = backwardArguments(q, k, v, alphaQ, alphaK, alphaV, collapse, dout, specValue);
  py::gil_scoped_release release;
  return loom::backwardCheckShare(a.spec, a.inputs, a.dout, reference::ihaBackward(a.spec, a.inputs, a.dout));
}

//===--- loom.decode ------------------------------------------------------===//

// One decode step over a paged cache (docs/IHA.md, Decode over a paged
// cache): the step's k and v appended to k_cache / v_cache in place, out
// [B, T, H, d] written (or allocated and returned). CUDA tensors (every one
// on the same device, page_table and cache_len too) run the spec's decode
// kernel on `stream`, host tensors its program on the host tile API.
py::object decode(const py::object& q, const py::object& k, const py::object& v, const py::object& alphaQ,
                  const py::object& alphaK, const py::object& alphaV, const py::object& collapse,
                  const py::object& kCache, const py::object& vCache, const py::object& pageTable,
                  const py::object& cacheLen, const py::object& specValue, const std::string& layoutName,
                  const py::object& out, const py::object& lse, std::optional<int64_t> stream,
                  const py::object& scheduleValue, const std::string& cacheDir, const std::string& service,
                  int threads, bool checkPages, const py::object& workspaceValue, const py::object& pageErrors,
                  const py::object& queryStartLoc, std::optional<int64_t> maxQueryLen) {
  const KernelSpec spec = specOf(specValue);
  const Schedule schedule = scheduleOf(scheduleValue);
  const CacheLayout layout = valueOr(parseCacheLayout(layoutName), true);
  // A ragged step (docs/IHA.md, Ragged steps): packed rows, its sequences' offsets.
  const bool ragged = !queryStartLoc.is_none();
  const Inputs inputs = borrowInputs(q, k, v, alphaQ, alphaK, alphaV, collapse, stream, ragged ? 3 : 4);
  const DLTensor& qt = inputs.q();
  const DLDevice device = qt.device;
  const bool onHost = device.device_type == kDLCPU;
  std::shared_ptr<Runtime> runtime;
  if (!onHost) runtime = runtimeFor(device.device_id, cacheDir);
  std::optional<Borrowed> starts;
  std::vector<int64_t> startsShape;
  const int32_t* startsData = nullptr;
  if (ragged) {
    if (!lse.is_none()) throw BadArgument("lse: a ragged step gives none (its rows are packed)");
    starts = borrow(queryStartLoc, "query_start_loc", stream);
    startsData = int32Array(*starts, "query_start_loc", 1, device, &startsShape);
    if (startsShape[0] < 2) throw BadArgument("query_start_loc: want [B + 1] entries, B at least 1");
    if (!maxQueryLen) {
      if (!onHost)
        throw BadArgument("max_query_len: give the most new tokens one sequence brings (a CUDA step does not read "
                          "query_start_loc back to find it)");
      int64_t most = 0;
      for (int64_t b = 0; b + 1 < startsShape[0]; ++b) most = std::max<int64_t>(most, startsData[b + 1] - startsData[b]);
      maxQueryLen = most;
    }
  }
  const int64_t sequences = ragged ? startsShape[0] - 1 : qt.shape[0];
  const std::vector<int64_t> outShape = ragged ? std::vector<int64_t>{qt.shape[0], spec.heads(), spec.head_dim()}
                                               : std::vector<int64_t>{qt.shape[0], qt.shape[1], spec.heads(), spec.head_dim()};
  std::optional<Borrowed> outGiven, lseGiven;
  Allocated made;
  const DLTensor* outTensor = nullptr;
  if (out.is_none()) {
    made = allocate(outShape, dlTypeOf(spec.dtype()), bytesOf(spec.dtype()), device, runtime ? runtime->gpu() : nullptr);
    outTensor = &made.view;
  } else {
    outGiven = borrow(out, "out", stream);
    outTensor = outGiven->tensor;
  }
  if (!lse.is_none()) lseGiven = borrow(lse, "lse", stream);
  IhaTensors tensors = valueOr(tensorsFromDlpack(inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5],
                                                 inputs[6], outTensor, lseGiven ? lseGiven->tensor : nullptr),
                               true);
  const Borrowed kc = borrow(kCache, "k_cache", stream), vc = borrow(vCache, "v_cache", stream);
  const Borrowed table = borrow(pageTable, "page_table", stream), lengths = borrow(cacheLen, "cache_len", stream);
  PagedCacheTensors cache;
  cache.k_cache = valueOr(tensorFromDlpack("k_cache", kc.tensor), true);
  cache.v_cache = valueOr(tensorFromDlpack("v_cache", vc.tensor), true);
  std::vector<int64_t> tableShape, lengthShape;
  cache.page_table = int32Array(table, "page_table", 2, device, &tableShape);
  cache.cache_len = int32Array(lengths, "cache_len", 1, device, &lengthShape);
  if (tableShape[0] != sequences || lengthShape[0] != sequences)
    throw BadArgument("page_table and cache_len: want one row / entry per sequence (B = " + std::to_string(sequences) +
                      "), got " + shapeString(tableShape) + " and " + shapeString(lengthShape));
  cache.max_pages = tableShape[1];
  cache.layout = layout;
  if (ragged) {
    cache.query_start_loc = startsData;
    cache.batch = sequences;
    cache.max_query_len = *maxQueryLen;
  }
  std::optional<Borrowed> errorWord;
  if (!pageErrors.is_none() && !onHost) {  // host tensors are checked on the host in any case
    errorWord = borrow(pageErrors, "page_errors", stream);
    std::vector<int64_t> wordShape;
    cache.page_errors = const_cast<int32_t*>(int32Array(*errorWord, "page_errors", 1, device, &wordShape));
    if (wordShape[0] < 1) throw BadArgument("page_errors: want one int32 element");
  }
  if (onHost) {
    check(validateDecodeTensors(spec, tensors, cache, kHostDevice), true);
    checkResolves(spec, schedule, hostTarget(), Direction::decode, layout == CacheLayout::mixed);
    const cpu::CpuOptions options{cacheDir, threads};
    py::gil_scoped_release release;
    check(runDecodeOnHost(spec, tensors, cache, schedule, options), false);
  } else {
    // launchDecode checks the tensors, then (check_pages) copies page_table
    // and cache_len back to check every entry before the launch.
    checkResolves(spec, schedule, runtime->target(), Direction::decode, layout == CacheLayout::mixed);
    // A decode step's bucket: its sequences and their cache capacity (the
    // lengths are the device's; max_pages * page_size bounds them).
    std::shared_ptr<Kernel> kernel =
        kernelFor(*runtime, spec, schedule, service, decodeDirectionOf(layout),
                  cache::shapeBucket(decodeDirectionOf(layout), sequences, cache.max_pages * cache.k_cache.shape[1]));
    std::optional<Borrowed> held;
    const std::optional<WorkspaceMemory> workspace = workspaceOf(workspaceValue, stream, device, held);
    py::gil_scoped_release release;
    check(kernel->launchDecode(tensors, cache, reinterpret_cast<CUstream>(stream.value_or(0)), checkPages,
                               workspace ? &*workspace : nullptr),
          false);
  }
  if (outGiven) return out;
  return py::cast(made.tensor);
}

// Bytes of the workspace a CUDA launch of B x N tokens needs (a decode
// step's N is its new tokens T): the kernel is found as the launch finds it.
int64_t workspaceBytesOf(const py::object& specValue, int64_t batch, int64_t tokens, const std::string& direction,
                         const std::string& layoutName, const py::object& scheduleValue, int device,
                         const std::string& cacheDir, const std::string& service, bool keep, int64_t cacheTokens) {
  const KernelSpec spec = specOf(specValue);
  const Schedule schedule = scheduleOf(scheduleValue);
  if (batch < 1 || tokens < 1) throw BadArgument("batch and tokens: want at least 1");
  if (keep && direction != "forward") throw BadArgument("keep: only a forward keeps what its backward reads");
  v1::Direction which = v1::direction_forward;
  if (direction == "backward") which = v1::direction_backward;
  else if (direction == "decode") which = decodeDirectionOf(valueOr(parseCacheLayout(layoutName), true));
  else if (direction != "forward") throw BadArgument("direction: want forward, backward or decode, not " + direction);
  std::shared_ptr<Runtime> runtime = runtimeFor(device, cacheDir);
  // The kernel of the launch's shape bucket, as the launch finds it.
  const std::string bucket = cache::shapeBucket(which, batch, isDecode(which) ? cacheTokens : tokens);
  if (keep)
    return workspaceBytes(forwardKernelFor(*runtime, spec, schedule, service, true, bucket)->compiled(), batch, tokens);
  return workspaceBytes(kernelFor(*runtime, spec, schedule, service, which, bucket)->compiled(), batch, tokens);
}

// loom.shape_bucket: the bucket a launch's decision is looked up under.
std::string shapeBucketOf(const std::string& direction, int64_t batch, int64_t tokens) {
  v1::Direction which = v1::direction_forward;
  if (direction == "backward") which = v1::direction_backward;
  else if (direction == "decode") which = v1::direction_decode;
  else if (direction != "forward") throw BadArgument("direction: want forward, backward or decode, not " + direction);
  if (batch < 1 || tokens < 1) throw BadArgument("batch and tokens: want at least 1");
  return cache::shapeBucket(which, batch, tokens);
}

std::string generate(const py::object& specValue, const py::object& scheduleValue, const std::string& targetName) {
  const KernelSpec spec = specOf(specValue);
  const v1::Target target = valueOr(parseTarget(targetName), true);
  return valueOr(generateKernel(spec, scheduleOf(scheduleValue), target), true).source;
}

// NVRTC, no GPU needed: the resolved schedule, the entry points with their
// resources, and which instructions the PTX uses.
py::dict compile(const py::object& specValue, const std::string& targetName, const py::object& scheduleValue) {
  const KernelSpec spec = specOf(specValue);
  const v1::Target target = valueOr(parseTarget(targetName), true);
  if (target.kind() != v1::Target::cuda) throw BadArgument("loom.compile needs a CUDA target such as sm_80 or sm_90a");
  const Schedule schedule = scheduleOf(scheduleValue);
  valueOr(resolveSchedule(spec, schedule, target), true);
  jit::NvrtcCompiler compiler("");
  std::shared_ptr<const jit::Artifact> artifact;
  v1::CompiledKernel kernel;
  {
    py::gil_scoped_release release;
    kernel = valueOr(compileKernel(spec, schedule, target, compiler, &artifact), false);
  }
  py::list entries;
  for (const v1::EntryPoint& entry : kernel.entries()) {
    py::dict e = fromJson(toJson(entry));
    for (const v1::ResourceUsage& usage : artifact->resources)
      if (usage.entry() == entry.name()) e["resources"] = fromJson(toJson(usage));
    entries.append(e);
  }
  py::dict report;
  report["target"] = targetName;
  report["toolchain"] = jit::nvrtcVersion();
  report["schedule"] = fromJson(toJson(kernel.schedule()));
  report["entries"] = entries;
  report["spill_bytes"] = artifact->spillBytes();
  report["uses_wgmma"] = artifact->usesWgmma();
  report["uses_tma"] = artifact->usesTma();
  report["uses_setmaxnreg"] = artifact->usesSetmaxnreg();
  report["uses_tensor_cores"] = artifact->usesTensorCores();
  report["warnings"] = artifact->warnings();
  report["source"] = kernel.source();
  return report;
}

// The GPUs loom can use; empty (with the reason in loom.gpu_error()) without.
py::list devices() {
  py::list found;
  auto api = cuda::driver();
  if (!api) return found;
  int count = 0;
  (*api)->cuDeviceGetCount(&count);
  for (int i = 0; i < count; ++i) {
    auto device = cuda::Device::open(i);
    if (!device) continue;
    const cuda::DeviceInfo& info = (*device)->info();
    py::dict d;
    d["ordinal"] = i;
    d["name"] = info.name;
    d["arch"] = info.arch();
    d["sm_count"] = info.smCount;
    found.append(d);
  }
  return found;
}

std::string gpuError() {
  auto api = cuda::driver();
  return api ? std::string() : api.error().message;
}

}  // namespace
}  // namespace loom::python

PYBIND11_MODULE(_loom, m) {
  using namespace loom::python;
  m.doc() = "loom: generated, autotuned Interleaved Head Attention kernels (docs/IHA.md)";
  m.attr("__version__") = LOOM_VERSION;
  m.attr("generator_version") = loom::cache::kGeneratorVersion;
  static py::exception<LoomError> error(m, "Error", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const BadArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const LoomError& e) {
      error(e.what());
    }
  });

  py::class_<OutputTensor, std::shared_ptr<OutputTensor>>(m, "Tensor",
                                                           "An output loom allocated; take it with from_dlpack")
      .def("__dlpack__", &OutputTensor::dlpack, py::arg("stream") = py::none())
      .def("__dlpack_device__", &OutputTensor::dlpackDevice)
      .def_property_readonly("shape", &OutputTensor::shape)
      .def_property_readonly("dtype", &OutputTensor::dtype)
      .def_property_readonly("device", &OutputTensor::device)
      .def("__repr__", [](const OutputTensor& t) {
        std::string shape;
        for (int64_t extent : t.shape()) shape += (shape.empty() ? "" : ", ") + std::to_string(extent);
        return "loom.Tensor(shape=(" + shape + "), dtype=" + t.dtype() + ", device=" + t.device() + ")";
      });

  m.def("iha", &iha,
        "out = IHA(q, k, v; alpha_q, alpha_k, alpha_v, collapse) for `spec` (dict, JSON text or file).\n"
        "Tensors: any DLPack producers (torch, cupy, jax, numpy) on one CUDA device, or all in host memory\n"
        "(then the generated program runs on the host tile API, slowly). Shapes as docs/IHA.md: q [B, N, H, d],\n"
        "k and v [B, N, G, d] in the spec's dtype; weights float32. `stream`: a CUDA stream handle (int).\n"
        "`out` / `lse`: tensors to write (else out is allocated and returned as loom.Tensor).\n"
        "`schedule`: force a schedule (else the tuned one from the cache, or the default).\n"
        "`service`: 'host:port' of a loom service to take the kernel from. `cache_dir`: the kernel cache.\n"
        "`workspace` (CUDA): a dense tensor of at least workspace_bytes(...) bytes on q's device for the\n"
        "launch's workspaces (else the kernel keeps its own per stream); ignored for host tensors.\n"
        "`cu_seqlens` (a varlen spec): int32 [documents + 1] on q's device, the packed documents' bounds; q, k, v\n"
        "and out are then [1, total, H | G, d] (docs/IHA.md, Varlen).\n"
        "`saved`: five dense tensors on q's device that receive what the backward reads: q_mixed and o_pseudo\n"
        "[B, H, N*P, d], k_mixed and v_mixed [B, G, N*P, d] (the spec's dtype on CUDA, float32 on the host), lse\n"
        "[B, H, N*P] float32; iha_backward given them skips the pre-mix and the recomputed attention. The forward\n"
        "then materialises the mixing and collapses separately (a schedule asking for either fused is refused);\n"
        "lse is saved's.",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("alpha_q"), py::arg("alpha_k"), py::arg("alpha_v"),
        py::arg("collapse"), py::arg("spec"), py::arg("stream") = py::none(), py::arg("out") = py::none(),
        py::arg("lse") = py::none(), py::arg("schedule") = py::none(), py::arg("cache_dir") = "",
        py::arg("service") = "", py::arg("threads") = 0, py::arg("workspace") = py::none(),
        py::arg("cu_seqlens") = py::none(), py::arg("saved") = py::none());
  m.def("iha_backward", &ihaBackward,
        "(dq, dk, dv, dalpha_q, dalpha_k, dalpha_v, dcollapse): the gradients of sum(out * dout) for `spec`,\n"
        "float32, each the shape of its input, by loom's backward kernels (CUDA tensors, on `stream`) or its\n"
        "program on the host tile API (host tensors). dout: out's shape, the spec's dtype. `grads`: up to seven\n"
        "tensors to write (None: allocated and returned as loom.Tensor). `lse`: receives the recomputed lse.\n"
        "`schedule`, `cache_dir`, `service`, `threads`, `workspace`, `cu_seqlens` as for iha (the backward\n"
        "kernel is cached apart). `saved`: what iha(..., saved=...) kept of the same inputs: the backward starts\n"
        "from it (no pre-mix, no recomputed attention).",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("alpha_q"), py::arg("alpha_k"), py::arg("alpha_v"),
        py::arg("collapse"), py::arg("dout"), py::arg("spec"), py::arg("grads") = std::vector<py::object>{},
        py::arg("lse") = py::none(), py::arg("stream") = py::none(), py::arg("schedule") = py::none(),
        py::arg("cache_dir") = "", py::arg("service") = "", py::arg("threads") = 0,
        py::arg("workspace") = py::none(), py::arg("cu_seqlens") = py::none(), py::arg("saved") = py::none());
  m.def("decode", &decode,
        "One decode step over a paged cache (docs/IHA.md, Decode over a paged cache): the new\n"
        "tokens' q [B, T, H, d], k and v [B, T, G, d] and the weights as for iha; k_cache and v_cache\n"
        "[num_pages, page_size, G, d] (cache='raw') or [num_pages, page_size, G, P, d] (cache='mixed') in the\n"
        "spec's dtype; page_table [B, max_pages] and cache_len [B], int32. Appends the step's k and v at\n"
        "positions cache_len .. cache_len + T - 1 (in place; advance cache_len by T yourself) and returns out\n"
        "[B, T, H, d] (or writes `out`; `lse` [B, H, T*P] when given). CUDA tensors (all on one device, page_table\n"
        "and cache_len too) run loom's decode kernel on `stream` (the tuned schedule from the kernel cache, else\n"
        "the default; `service`: fetched from a loom-service), host tensors the generated decode program on the\n"
        "host tile API. check_pages (CUDA): copy page_table and cache_len back and check every entry before the\n"
        "launch (a synchronous copy a step); False skips it for a serving loop that builds them checked, and for\n"
        "CUDA-graph capture (a bad entry then reads or writes outside the cache). page_errors (CUDA): a one-element\n"
        "int32 tensor on the device that the caller zeroes: the step checks page_table and cache_len on the device\n"
        "first, skips the sequences it refuses (their out is not defined; nothing outside the cache is touched) and\n"
        "writes 1 there if it refused one; read it when you like. Host tensors are always checked on the host.\n"
        "A ragged step (docs/IHA.md, Ragged steps): query_start_loc [B + 1], int32 on q's device, and q\n"
        "[total, H, d], k and v [total, G, d] packing each sequence's new tokens (0 or more) after the last's;\n"
        "sequence b's are rows query_start_loc[b] .. query_start_loc[b + 1] - 1, appended at its cache_len\n"
        "(advance it by its own count); out is [total, H, d], no lse. max_query_len, the most one sequence\n"
        "brings, sizes the launch: needed for CUDA tensors, found from query_start_loc for host ones.",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("alpha_q"), py::arg("alpha_k"), py::arg("alpha_v"),
        py::arg("collapse"), py::arg("k_cache"), py::arg("v_cache"), py::arg("page_table"), py::arg("cache_len"),
        py::arg("spec"), py::arg("cache") = "raw", py::arg("out") = py::none(), py::arg("lse") = py::none(),
        py::arg("stream") = py::none(), py::arg("schedule") = py::none(), py::arg("cache_dir") = "",
        py::arg("service") = "", py::arg("threads") = 0, py::arg("check_pages") = true,
        py::arg("workspace") = py::none(), py::arg("page_errors") = py::none(),
        py::arg("query_start_loc") = py::none(), py::arg("max_query_len") = py::none());
  m.def("workspace_bytes", &workspaceBytesOf,
        "Bytes of the `workspace` a CUDA launch of `batch` x `tokens` needs (a decode step: tokens = T, its new\n"
        "tokens, and cache_tokens its cache capacity, max_pages x page_size), for `direction` 'forward', 'backward'\n"
        "or 'decode' (`cache` 'raw' or 'mixed'), the kernel found as the launch finds it (`schedule`, `cache_dir`,\n"
        "`service`, the shapes' bucket; `keep`: a forward given `saved`) on CUDA `device`. Needs a GPU.",
        py::arg("spec"), py::arg("batch"), py::arg("tokens"), py::arg("direction") = "forward",
        py::arg("cache") = "raw", py::arg("schedule") = py::none(), py::arg("device") = 0, py::arg("cache_dir") = "",
        py::arg("service") = "", py::arg("keep") = false, py::arg("cache_tokens") = 0);
  m.def("shape_bucket", &shapeBucketOf,
        "The shape bucket a launch's kernel decision is looked up under (docs/caching: n<N> for a forward or\n"
        "backward of N tokens, c<C>.b<B> for a decode step of B sequences over caches of C tokens; powers of two).",
        py::arg("direction"), py::arg("batch"), py::arg("tokens"));
  m.def("reference_backward", &referenceBackward,
        "The seven gradients of sum(out * dout) by the float64 backward reference, on host tensors, as float64\n"
        "loom.Tensors (inputs may be float64, float32 or the 16-bit dtypes); `cu_seqlens` (host int32) for a\n"
        "varlen spec",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("alpha_q"), py::arg("alpha_k"), py::arg("alpha_v"),
        py::arg("collapse"), py::arg("dout"), py::arg("spec"), py::arg("cu_seqlens") = py::none());
  m.def("backward_check_share", &backwardCheckShare,
        "How much of the spec dtype's gradient tolerance rounding alone can cost on these inputs and dout: the\n"
        "float64 backward with what a kernel of the dtype rounds (for float32 every partial sum), and with the\n"
        "inputs moved by a few units of float32's roundoff, against the exact one, over the tolerance. Over 0.25 the draw cannot judge a kernel (docs/IHA.md, Backward)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("alpha_q"), py::arg("alpha_k"), py::arg("alpha_v"),
        py::arg("collapse"), py::arg("dout"), py::arg("spec"));
  m.def("reference", &reference,
        "(out, lse) of the float64 reference (the oracle) on host tensors (float64, float32 or the 16-bit\n"
        "dtypes), as float64 loom.Tensors; `cu_seqlens` (host int32) for a varlen spec",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("alpha_q"), py::arg("alpha_k"), py::arg("alpha_v"),
        py::arg("collapse"), py::arg("spec"), py::arg("cu_seqlens") = py::none());
  m.def("generate", &generate, "The C++ source loom generates for `spec` on `target` (cpu, sm_80, sm_90a, ...)",
        py::arg("spec"), py::arg("schedule") = py::none(), py::arg("target") = "cpu");
  m.def("compile", &compile,
        "Compile `spec` for a CUDA `target` with NVRTC (no GPU needed): schedule, entry points and their\n"
        "registers / spills, the instructions used (wgmma, TMA, setmaxnreg), ptxas warnings, the source",
        py::arg("spec"), py::arg("target") = "sm_90a", py::arg("schedule") = py::none());
  m.def("reload", &reloadKernels,
        "Forget the CUDA kernels loom keeps in memory (by spec, schedule and direction, from the kernel cache or a\n"
        "service), so that the next call reads a decision tuned since (loom tune, pretune, a service's); the host\n"
        "path's programs depend on no decision and stay");
  m.def(
      "counters",
      [] {
        py::dict result;
        for (const auto& [name, value] : loom::counters()) result[py::str(name)] = value;
        return result;
      },
      "Cumulative counts of the work behind loom's calls in this process: programs_generated, programs_compiled,\n"
      "store_reads, modules_loaded, device_allocations, host_syncs, launches, service_channels, service_requests.\n"
      "After a warm-up call, a steady-state call of the same spec and shapes changes only launches");
  m.def("devices", &devices, "The CUDA devices loom can use (empty without a GPU: see gpu_error())");
  m.def("gpu_error", &gpuError, "Why no GPU is usable ('' when one is)");
}
