// Kernel: a CompiledKernel loaded on a device, validated and launched.
#include <algorithm>
#include <cstring>
#include <functional>
#include <tuple>

#include "cuda/driver.h"
#include "loom/runtime.h"
#include "loom/tile/common.h"
#include "loom/tile/layout.h"

namespace loom {
namespace {

constexpr int64_t kCopyAlignmentBytes = 16;  // cp.async moves 16-byte chunks
constexpr int64_t kMaxGridZ = 65535;          // the grid's z limit: batch entries per launch

ElementKind elementOf(v1::DType dtype) {
  return dtype == v1::float16 ? ElementKind::float16 : dtype == v1::bfloat16 ? ElementKind::bfloat16 : ElementKind::float32;
}

const char* nameOf(ElementKind kind) {
  return kind == ElementKind::float32 ? "float32" : kind == ElementKind::float16 ? "float16" : "bfloat16";
}

}  // namespace

int64_t elementBytes(ElementKind kind) { return kind == ElementKind::float32 ? 4 : 2; }

std::vector<int64_t> stridesOf(const Tensor& t) {
  if (!t.strides.empty()) return t.strides;
  std::vector<int64_t> strides(t.shape.size(), 1);
  for (int i = int(t.shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * t.shape[i + 1];
  return strides;
}

namespace {

std::string shapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

Status checkTensor(const char* name, const Tensor& t, const std::vector<int64_t>& shape, ElementKind element,
                   int device, bool activation) {
  auto fail = [&](const std::string& why) { return Status(makeError(std::string(name) + ": " + why)); };
  if (!t.data) return fail("no data pointer");
  if (t.device != device) {
    auto where = [](int ordinal) { return ordinal == kHostDevice ? std::string("host memory") : "CUDA device " + std::to_string(ordinal); };
    return fail("in " + where(t.device) + ", the kernel runs on " + where(device));
  }
  if (t.shape != shape) return fail("shape " + shapeText(t.shape) + ", want " + shapeText(shape));
  if (t.element != element) return fail(std::string("element type ") + nameOf(t.element) + ", want " + nameOf(element));
  if (!t.strides.empty() && t.strides.size() != t.shape.size()) return fail("strides and shape differ in rank");
  const std::vector<int64_t> strides = stridesOf(t);
  if (strides.back() != 1) return fail("the last dimension must be contiguous (stride 1)");
  if (!activation) {
    if (strides != stridesOf(Tensor{nullptr, t.element, t.shape, {}, 0})) return fail("must be contiguous");
    return Status::success();
  }
  const int64_t chunk = kCopyAlignmentBytes / elementBytes(element);
  for (size_t i = 0; i + 1 < strides.size(); ++i)
    if (strides[i] % chunk != 0)
      return fail("stride " + std::to_string(strides[i]) + " of dimension " + std::to_string(i) +
                  " is not a multiple of " + std::to_string(chunk) + " elements (16-byte rows)");
  if (reinterpret_cast<uintptr_t>(t.data) % kCopyAlignmentBytes != 0) return fail("data is not 16-byte aligned");
  return Status::success();
}

}  // namespace

Result<Tensor> tensorFromDlpack(const char* name, const DLTensor* t) {
  auto fail = [&](const std::string& why) { return makeError(std::string(name) + ": " + why); };
  if (!t) return fail("missing");
  if (t->device.device_type != kDLCUDA && t->device.device_type != kDLCPU)
    return fail("must be on a CUDA device or in host memory (DLPack kDLCUDA or kDLCPU)");
  if (t->dtype.lanes != 1) return fail("vector dtypes are not supported");
  Tensor view;
  if (t->dtype.code == kDLFloat && t->dtype.bits == 32) view.element = ElementKind::float32;
  else if (t->dtype.code == kDLFloat && t->dtype.bits == 16) view.element = ElementKind::float16;
  else if (t->dtype.code == kDLBfloat && t->dtype.bits == 16) view.element = ElementKind::bfloat16;
  else return fail("dtype must be float32, float16 or bfloat16");
  view.data = static_cast<char*>(t->data) + t->byte_offset;
  view.device = t->device.device_type == kDLCPU ? kHostDevice : t->device.device_id;
  view.shape.assign(t->shape, t->shape + t->ndim);
  if (t->strides) {
    // An extent-1 dimension's stride is never stepped: producers write any
    // value there (PyTorch writes 1), so it takes the span of the dimensions
    // inside it, as a C-order layout would.
    view.strides.assign(t->strides, t->strides + t->ndim);
    int64_t span = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
      if (t->shape[i] == 1) view.strides[size_t(i)] = span;
      span = std::max(span, view.strides[size_t(i)] * t->shape[i]);
    }
  }
  return view;
}

namespace {

// [n, ...] as [1, n, ...] (its strides too).
Tensor withBatchOfOne(Tensor t) {
  if (!t.strides.empty()) t.strides.insert(t.strides.begin(), t.strides.front() * t.shape.front());
  t.shape.insert(t.shape.begin(), 1);
  return t;
}

}  // namespace

IhaTensors batchedView(const KernelSpec& spec, const IhaTensors& t) {
  if (!spec.varlen() || t.q.shape.size() != 3) return t;
  IhaTensors view = t;
  for (Tensor* x : {&view.q, &view.k, &view.v, &view.out})
    if (x->shape.size() == 3) *x = withBatchOfOne(*x);
  if (view.lse && view.lse->shape.size() == 2) *view.lse = withBatchOfOne(*view.lse);
  return view;
}

IhaGradTensors batchedView(const KernelSpec& spec, const IhaGradTensors& g) {
  if (!spec.varlen() || g.dout.shape.size() != 3) return g;
  IhaGradTensors view = g;
  for (Tensor* x : {&view.dout, &view.dq, &view.dk, &view.dv})
    if (x->shape.size() == 3) *x = withBatchOfOne(*x);
  return view;
}

namespace {

// q, k, v and the weights (and `out` when `withOut`), then lse when given.
// A varlen spec's tensors are checked as one batch (batchedView).
Status validateOperands(const KernelSpec& spec, const IhaTensors& given, int device, bool withOut) {
  if (spec.varlen()) {
    if (!given.cu_seqlens || given.documents < 1)
      return makeError("cu_seqlens: missing (a varlen spec packs documents: give their bounds, int32 [documents + 1], "
                       "and documents >= 1)");
    if (given.q.shape.size() != 3 && !(given.q.shape.size() == 4 && given.q.shape[0] == 1))
      return makeError("q: a varlen spec's q is [total, H, d] (or [1, total, H, d]), got " + shapeText(given.q.shape));
  } else if (given.cu_seqlens) {
    return makeError("cu_seqlens: given, but the spec is not varlen (set varlen true to pack documents)");
  }
  const IhaTensors t = batchedView(spec, given);
  if (t.q.shape.size() != 4) return makeError("q: want 4 dimensions [B, N, H, d], got " + shapeText(t.q.shape));
  const int64_t B = t.q.shape[0], N = t.q.shape[1], H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(),
                d = spec.head_dim();
  if (B < 1 || N < 1) return makeError("q: B and N must be at least 1, got " + shapeText(t.q.shape));
  // The kernels index virtual rows (N * P) and their masks in 32 bits.
  if (N * P >= (int64_t(1) << 31))
    return makeError("q: N * pseudo_heads (" + std::to_string(N * P) + ") must be below 2^31");
  const ElementKind act = elementOf(spec.dtype());
  const ElementKind f32 = ElementKind::float32;
  const std::vector<int64_t> collapse =
      spec.collapse() == v1::per_head ? std::vector<int64_t>{H, P} : std::vector<int64_t>{H, H * P};
  struct Check {
    const char* name;
    const Tensor* tensor;
    std::vector<int64_t> shape;
    ElementKind element;
    bool activation;
  };
  std::vector<Check> checks = {{"q", &t.q, {B, N, H, d}, act, true},
                               {"k", &t.k, {B, N, G, d}, act, true},
                               {"v", &t.v, {B, N, G, d}, act, true},
                               {"alpha_q", &t.alpha_q, {H, H, P}, f32, false},
                               {"alpha_k", &t.alpha_k, {G, G, P}, f32, false},
                               {"alpha_v", &t.alpha_v, {G, G, P}, f32, false},
                               {"collapse", &t.collapse, collapse, f32, false}};
  if (withOut) checks.push_back({"out", &t.out, {B, N, H, d}, act, true});
  if (t.lse) checks.push_back({"lse", &*t.lse, {B, H, N * P}, f32, false});
  for (const Check& c : checks)
    if (Status ok = checkTensor(c.name, *c.tensor, c.shape, c.element, device, c.activation); !ok) return ok;
  return Status::success();
}

}  // namespace

Status validateTensors(const KernelSpec& spec, const IhaTensors& t, int device) {
  return validateOperands(spec, t, device, /*withOut=*/true);
}

Status validateGradTensors(const KernelSpec& spec, const IhaTensors& givenInputs, const IhaGradTensors& givenGrads,
                           int device) {
  if (Status ok = validateOperands(spec, givenInputs, device, /*withOut=*/false); !ok) return ok;
  const IhaTensors inputs = batchedView(spec, givenInputs);
  const IhaGradTensors g = batchedView(spec, givenGrads);
  const int64_t B = inputs.q.shape[0], N = inputs.q.shape[1], H = spec.heads(), G = spec.kv_heads(),
                P = spec.pseudo_heads(), d = spec.head_dim();
  const ElementKind f32 = ElementKind::float32;
  const std::vector<int64_t> collapse =
      spec.collapse() == v1::per_head ? std::vector<int64_t>{H, P} : std::vector<int64_t>{H, H * P};
  if (Status ok = checkTensor("dout", g.dout, {B, N, H, d}, elementOf(spec.dtype()), device, true); !ok) return ok;
  const std::tuple<const char*, const Tensor*, std::vector<int64_t>> gradients[] = {
      {"dq", &g.dq, {B, N, H, d}},          {"dk", &g.dk, {B, N, G, d}},
      {"dv", &g.dv, {B, N, G, d}},          {"dalpha_q", &g.dalpha_q, {H, H, P}},
      {"dalpha_k", &g.dalpha_k, {G, G, P}}, {"dalpha_v", &g.dalpha_v, {G, G, P}},
      {"dcollapse", &g.dcollapse, collapse}};
  for (const auto& [name, tensor, shape] : gradients)
    if (Status ok = checkTensor(name, *tensor, shape, f32, device, false); !ok) return ok;
  return Status::success();
}

IhaTensors packedView(const IhaTensors& step, const PagedCacheTensors& cache) {
  if (!cache.query_start_loc || step.q.shape.size() != 3) return step;
  IhaTensors view = step;
  for (Tensor* x : {&view.q, &view.k, &view.v, &view.out})
    if (x->shape.size() == 3) *x = withBatchOfOne(*x);
  return view;
}

IhaTensors raggedLaunchView(const IhaTensors& step, const PagedCacheTensors& cache) {
  if (!cache.query_start_loc) return step;
  IhaTensors view = step;
  for (Tensor* x : {&view.q, &view.k, &view.v, &view.out}) {
    std::vector<int64_t> shape = x->shape, strides = stridesOf(*x);
    if (shape.size() == 4) {  // [1, total, ...]
      shape.erase(shape.begin());
      strides.erase(strides.begin());
    }
    x->shape = {cache.batch, cache.max_query_len, shape[1], shape[2]};
    x->strides = {0, strides[0], strides[1], strides[2]};
  }
  return view;
}

Status validateDecodeTensors(const KernelSpec& spec, const IhaTensors& step, const PagedCacheTensors& cache,
                             int device, bool checkPages) {
  const bool ragged = cache.query_start_loc != nullptr;
  if (ragged) {
    if (step.q.shape.size() != 3)
      return makeError("q: a ragged step packs its sequences' new tokens, [total, H, d]; got " + shapeText(step.q.shape));
    if (step.lse) return makeError("lse: a ragged step gives none (its rows are packed); pass no lse");
    if (cache.batch < 1) return makeError("batch: a ragged step's sequences, at least 1, not " + std::to_string(cache.batch));
    if (cache.max_query_len < 1 || cache.max_query_len > step.q.shape[0])
      return makeError("max_query_len: the most new tokens one sequence brings, 1 to q's " +
                       std::to_string(step.q.shape[0]) + ", not " + std::to_string(cache.max_query_len));
  }
  if (Status ok = validateOperands(spec, packedView(step, cache), device, /*withOut=*/true); !ok) return ok;
  const int64_t B = ragged ? cache.batch : step.q.shape[0], T = ragged ? cache.max_query_len : step.q.shape[1];
  const bool mixed = cache.layout == CacheLayout::mixed;
  if (cache.k_cache.shape.size() != (mixed ? 5u : 4u))
    return makeError(std::string("k_cache: want ") + (mixed ? "[num_pages, page_size, G, P, d]" : "[num_pages, page_size, G, d]") +
                     " for a " + cacheLayoutName(cache.layout) + " cache, got " + shapeText(cache.k_cache.shape));
  std::vector<int64_t> shape = {cache.k_cache.shape[0], cache.k_cache.shape[1], spec.kv_heads()};
  if (mixed) shape.push_back(spec.pseudo_heads());
  shape.push_back(spec.head_dim());
  for (const auto& [name, tensor] : {std::pair{"k_cache", &cache.k_cache}, {"v_cache", &cache.v_cache}})
    if (Status ok = checkTensor(name, *tensor, shape, elementOf(spec.dtype()), device, false); !ok) return ok;
  if (!cache.page_table) return makeError("page_table: missing");
  if (!cache.cache_len) return makeError("cache_len: missing");
  if (cache.max_pages < 1) return makeError("page_table: max_pages must be at least 1, not " + std::to_string(cache.max_pages));
  // A sequence's positions are 32-bit on the device (cache_slot), its
  // virtual rows too.
  if (cache.max_pages * shape[1] * spec.pseudo_heads() >= (int64_t(1) << 31))
    return makeError("page_table: max_pages * page_size * pseudo_heads (" +
                     std::to_string(cache.max_pages * shape[1] * spec.pseudo_heads()) + ") must be below 2^31");
  if (!checkPages) return Status::success();
  return validateDecode({B, T, shape[0], shape[1], cache.max_pages, ragged ? step.q.shape[0] : 0},
                        {cache.page_table, size_t(B * cache.max_pages)}, {cache.cache_len, size_t(B)},
                        ragged ? std::span<const int32_t>(cache.query_start_loc, size_t(B + 1))
                               : std::span<const int32_t>());
}

ElementKind savedRowElement(const KernelSpec& spec, bool cudaKernel) {
  return cudaKernel ? elementOf(spec.dtype()) : ElementKind::float32;
}

Result<Schedule> keepingSchedule(const Schedule& schedule) {
  Schedule keeping = schedule;
  if (keeping.mix() == v1::mix_fused)
    return makeError("schedule.mix: mix_fused keeps no mixed rows for the backward; a forward that keeps them "
                     "materialises the mixing (mix_materialized)");
  if (keeping.collapse() == v1::collapse_fused)
    return makeError("schedule.collapse: collapse_fused keeps no pseudo-head outputs for the backward; a forward "
                     "that keeps them collapses separately (collapse_separate)");
  keeping.set_mix(v1::mix_materialized);
  keeping.set_collapse(v1::collapse_separate);
  return keeping;
}

Status validateSaved(const KernelSpec& spec, const IhaSaved& s, int64_t B, int64_t N, bool cudaKernel, int device) {
  const int64_t H = spec.heads(), G = spec.kv_heads(), L = N * spec.pseudo_heads(), d = spec.head_dim();
  const ElementKind rows = savedRowElement(spec, cudaKernel);
  const std::tuple<const char*, const Tensor*, std::vector<int64_t>, ElementKind> saved[] = {
      {"q_mixed", &s.q_mixed, {B, H, L, d}, rows},
      {"k_mixed", &s.k_mixed, {B, G, L, d}, rows},
      {"v_mixed", &s.v_mixed, {B, G, L, d}, rows},
      {"o_pseudo", &s.o_pseudo, {B, H, L, d}, rows},
      {"lse", &s.lse, {B, H, L}, ElementKind::float32}};
  for (const auto& [name, tensor, shape, element] : saved)
    if (Status ok = checkTensor(name, *tensor, shape, element, device, false); !ok) return ok;
  return Status::success();
}

namespace {

// Views each named DLPack tensor into its Tensor; the first that fails names itself.
Status viewAll(std::initializer_list<std::pair<const char*, std::pair<const DLTensor*, Tensor*>>> all) {
  for (const auto& [name, pair] : all) {
    auto view = tensorFromDlpack(name, pair.first);
    if (!view) return view.error();
    *pair.second = *view;
  }
  return Status::success();
}

}  // namespace

Result<IhaGradTensors> gradTensorsFromDlpack(const DLTensor* dout, const DLTensor* dq, const DLTensor* dk,
                                             const DLTensor* dv, const DLTensor* dalphaQ, const DLTensor* dalphaK,
                                             const DLTensor* dalphaV, const DLTensor* dcollapse) {
  IhaGradTensors tensors;
  if (Status ok = viewAll({{"dout", {dout, &tensors.dout}},
                           {"dq", {dq, &tensors.dq}},
                           {"dk", {dk, &tensors.dk}},
                           {"dv", {dv, &tensors.dv}},
                           {"dalpha_q", {dalphaQ, &tensors.dalpha_q}},
                           {"dalpha_k", {dalphaK, &tensors.dalpha_k}},
                           {"dalpha_v", {dalphaV, &tensors.dalpha_v}},
                           {"dcollapse", {dcollapse, &tensors.dcollapse}}});
      !ok)
    return ok.error();
  return tensors;
}

Result<IhaTensors> tensorsFromDlpack(const DLTensor* q, const DLTensor* k, const DLTensor* v, const DLTensor* alphaQ,
                                     const DLTensor* alphaK, const DLTensor* alphaV, const DLTensor* collapse,
                                     const DLTensor* out, const DLTensor* lse) {
  IhaTensors tensors;
  if (Status ok = viewAll({{"q", {q, &tensors.q}},
                           {"k", {k, &tensors.k}},
                           {"v", {v, &tensors.v}},
                           {"alpha_q", {alphaQ, &tensors.alpha_q}},
                           {"alpha_k", {alphaK, &tensors.alpha_k}},
                           {"alpha_v", {alphaV, &tensors.alpha_v}},
                           {"collapse", {collapse, &tensors.collapse}},
                           {"out", {out, &tensors.out}}});
      !ok)
    return ok.error();
  if (lse) {
    auto view = tensorFromDlpack("lse", lse);
    if (!view) return view.error();
    tensors.lse = *view;
  }
  return tensors;
}

Result<std::shared_ptr<Kernel>> Kernel::load(std::shared_ptr<cuda::Device> device, const v1::CompiledKernel& compiled) {
  if (compiled.binary().empty()) return makeError("compiled kernel has no binary");
  if (Status ok = device->makeCurrent(); !ok) return ok.error();
  std::shared_ptr<Kernel> kernel(new Kernel());
  kernel->device_ = device;
  kernel->compiled_ = compiled;
  const cuda::DriverApi& api = device->api();
  // A PTX binary must be NUL-terminated for the driver's JIT.
  std::string image = compiled.binary();
  if (compiled.toolchain().find("ptx") != std::string::npos) image.push_back('\0');
  if (Status ok = cuda::check(api.cuModuleLoadData(&kernel->module_, image.data()), "cuModuleLoadData"); !ok)
    return ok.error();
  for (const v1::EntryPoint& entry : compiled.entries()) {
    CUfunction function;
    if (Status ok = cuda::check(api.cuModuleGetFunction(&function, kernel->module_, entry.name().c_str()),
                                "cuModuleGetFunction(" + entry.name() + ")");
        !ok)
      return ok.error();
    if (entry.shared_memory_bytes() > 0) {
      if (entry.shared_memory_bytes() > device->info().sharedMemoryPerBlock)
        return makeError(entry.name() + " needs " + std::to_string(entry.shared_memory_bytes()) +
                         " bytes of shared memory; " + device->info().name + " allows " +
                         std::to_string(device->info().sharedMemoryPerBlock));
      if (Status ok = cuda::check(api.cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                         int(entry.shared_memory_bytes())),
                                  "cuFuncSetAttribute(" + entry.name() + ")");
          !ok)
        return ok.error();
    }
    kernel->functions_.push_back(function);
  }
  return kernel;
}

Kernel::~Kernel() {
  streams_.clear();
  if (module_) device_->api().cuModuleUnload(module_);
}

namespace {

// The lse a backward kernel's recomputation writes when the caller gives none.
constexpr char kLseWorkspace[] = "lse";
// A decode step's per-sequence verdicts of the device's page check.
constexpr char kSequenceOkWorkspace[] = "sequence_ok";

// A workspace's bytes (compiler.h's workspaceElements and
// workspaceElementBytes, from the record's own fields: the runtime links no
// compiler). The tiles the tensor cores read are 16-bit, the rest f32.
int64_t workspaceBytes(const v1::CompiledKernel& kernel, const std::string& name, int64_t batch, int64_t tokens) {
  const KernelSpec& spec = kernel.spec();
  const int64_t rows = batch * tokens * spec.pseudo_heads();
  const bool kv = name == "k_mixed" || name == "v_mixed" || name == "dk_pseudo" || name == "dv_pseudo";
  const int64_t heads = kv ? spec.kv_heads() : spec.heads();
  if (name == "q_mixed" || name == "k_mixed" || name == "v_mixed" || name == "o_pseudo" || name == "do_pseudo")
    return rows * heads * spec.head_dim() * kernel.workspace_element_bytes();
  if (name == "delta") return kRowStatsPlanes * rowStatsStride(rows * heads) * int64_t(sizeof(float));
  if (name == kLseWorkspace) return rows * heads * int64_t(sizeof(float));
  if (name == kSequenceOkWorkspace) return batch * int64_t(sizeof(int32_t));
  if (name == "partials") {
    for (const v1::EntryPoint& entry : kernel.entries())
      if (entry.name() == "iha_bwd_prep")
        return batch * ((tokens + entry.rows_per_cta() - 1) / entry.rows_per_cta()) *
               backwardPartialEntries(spec.heads(), spec.kv_heads(), spec.pseudo_heads(), spec.collapse() == v1::global) *
               int64_t(sizeof(float));
    return 0;
  }
  if (name == "splits")  // [B, H, kv_splits, T * P, d + 1]
    return rows * spec.heads() * std::max(kernel.schedule().kv_splits(), 1) * (spec.head_dim() + 1) *
           int64_t(sizeof(float));
  return rows * heads * spec.head_dim() * int64_t(sizeof(float));  // dq_pseudo, dk_pseudo, dv_pseudo
}

// The workspaces a kernel allocates: its plan's, and lse for a backward.
std::vector<std::string> workspaceNames(const v1::CompiledKernel& kernel) {
  std::vector<std::string> names(kernel.workspaces().begin(), kernel.workspaces().end());
  if (kernel.direction() == v1::direction_backward) names.push_back(kLseWorkspace);
  if (isDecode(kernel.direction())) names.push_back(kSequenceOkWorkspace);
  return names;
}

int64_t aligned(int64_t bytes) { return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment; }

}  // namespace

int64_t workspaceBytes(const v1::CompiledKernel& kernel, int64_t batch, int64_t tokens) {
  int64_t bytes = 0;
  for (const std::string& name : workspaceNames(kernel)) bytes += aligned(workspaceBytes(kernel, name, batch, tokens));
  return bytes;
}

void* Kernel::StreamState::workspace(const char* name) const {
  auto found = workspaces.find(name);
  return found == workspaces.end() ? nullptr : found->second;
}

Result<Kernel::StreamState*> Kernel::streamState(CUstream stream, int64_t batch, int64_t tokens,
                                                 const WorkspaceMemory* memory) {
  if (memory) {  // the caller's memory, carved in workspaceNames' order
    const int64_t needed = workspaceBytes(compiled_, batch, tokens);
    if (memory->bytes < needed)
      return makeError("workspace: " + std::to_string(memory->bytes) + " bytes, the launch needs " +
                       std::to_string(needed) + " (workspaceBytes for B = " + std::to_string(batch) +
                       ", N = " + std::to_string(tokens) + ")");
    if (needed > 0 && (!memory->data || reinterpret_cast<uintptr_t>(memory->data) % kWorkspaceAlignment != 0))
      return makeError("workspace: its address must be a multiple of " + std::to_string(kWorkspaceAlignment));
    if (callerStates_.size() >= 64 && !callerStates_.count(memory->data)) callerStates_.clear();
    std::unique_ptr<StreamState>& slot = callerStates_[memory->data];
    if (!slot) slot = std::make_unique<StreamState>();
    if (slot->rows != batch * tokens) {
      slot->workspaces.clear();
      char* at = static_cast<char*>(memory->data);
      for (const std::string& name : workspaceNames(compiled_)) {
        slot->workspaces[name] = at;
        at += aligned(workspaceBytes(compiled_, name, batch, tokens));
      }
      slot->rows = batch * tokens;
      slot->mapsShape = {0, 0};
    }
    return slot.get();
  }
  std::unique_ptr<StreamState>& slot = streams_[stream];
  if (!slot) slot = std::make_unique<StreamState>();
  StreamState& state = *slot;
  if (batch * tokens <= state.rows) return &state;
  // Work queued on the stream's old buffers must finish before they are freed.
  if (!state.owned.empty())
    if (Status ok = cuda::check(device_->api().cuStreamSynchronize(stream), "cuStreamSynchronize"); !ok)
      return ok.error();
  state.workspaces.clear();
  state.owned.clear();
  for (const std::string& name : workspaceNames(compiled_)) {
    const int64_t bytes = workspaceBytes(compiled_, name, batch, tokens);
    auto buffer = cuda::DeviceBuffer::allocate(*device_, size_t(bytes));
    if (!buffer) return buffer.error();
    state.owned.push_back(std::make_unique<cuda::DeviceBuffer>(std::move(*buffer)));
    state.workspaces[name] = state.owned.back()->data();
  }
  state.rows = batch * tokens;
  state.mapsShape = {0, 0};  // the maps pointed at the old buffers
  return &state;
}

namespace cuda {

// Tensor maps over the mixed workspaces [B * heads, L, d] (and a
// backward's do_pseudo) for the wgmma engine's TMA loads (loom::TmaMaps,
// loom/tile/cuda_common.h): boxes of one 128-byte swizzle atom (64 columns)
// by 64 query rows or block_n key rows.
// With fused mixing there are no workspaces and the maps stay unused.
Status encodeWorkspaceMaps(TensorMapEncoder encode, const std::function<Status(CUresult, const std::string&)>& check,
                           const v1::CompiledKernel& compiled, const IhaArgs& args, int64_t L, int64_t B,
                           TmaMaps& maps) {
  const KernelSpec& spec = compiled.spec();
  const CUtensorMapDataType type =
      spec.dtype() == v1::bfloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  constexpr cuuint32_t kAtomColumns = 64, kQueryRows = 64;
  auto map = [&](CUtensorMap& out, void* base, int64_t heads, cuuint32_t boxRows, const char* name) -> Status {
    if (!base) return Status::success();
    const int64_t d = spec.head_dim(), bytes = compiled.workspace_element_bytes();
    const cuuint64_t dims[3] = {cuuint64_t(d), cuuint64_t(L), cuuint64_t(B * heads)};
    const cuuint64_t strides[2] = {cuuint64_t(d * bytes), cuuint64_t(L * d * bytes)};
    const cuuint32_t box[3] = {kAtomColumns, boxRows, 1};
    const cuuint32_t elementStrides[3] = {1, 1, 1};
    return check(encode(&out, type, 3, base, dims, strides, box, elementStrides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                 std::string("cuTensorMapEncodeTiled(") + name + ")");
  };
  const cuuint32_t blockN = cuuint32_t(compiled.schedule().block_n());
  if (compiled.direction() == v1::direction_backward) {
    // The wgmma backward's launches: each tile whole in one box (4-d: 64
    // columns, block_m or block_n rows, atoms, planes); the rows' lse (log2
    // units) and D as two planes of B * H * L floats (2-d, block_m rows of
    // both a box, rowStatsStride apart; a head's rows past L are the next
    // head's, or zeros past the end).
    const int64_t d = spec.head_dim(), bytes = compiled.workspace_element_bytes();
    auto tiles = [&](CUtensorMap& out, void* base, int64_t heads, cuuint32_t boxRows, const char* name) -> Status {
      if (!base) return Status::success();
      const cuuint64_t dims[4] = {kAtomColumns, cuuint64_t(L), cuuint64_t(d / kAtomColumns), cuuint64_t(B * heads)};
      const cuuint64_t strides[3] = {cuuint64_t(d * bytes), cuuint64_t(kAtomColumns * bytes),
                                     cuuint64_t(L * d * bytes)};
      const cuuint32_t box[4] = {kAtomColumns, boxRows, cuuint32_t(d / kAtomColumns), 1};
      const cuuint32_t elementStrides[4] = {1, 1, 1, 1};
      return check(encode(&out, type, 4, base, dims, strides, box, elementStrides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                   std::string("cuTensorMapEncodeTiled(") + name + ")");
    };
    auto rowStats = [&](CUtensorMap& out, float* base) -> Status {
      if (!base) return Status::success();
      const int64_t rows = B * spec.heads() * L;
      const cuuint64_t dims[2] = {cuuint64_t(rows), kRowStatsPlanes};
      const cuuint64_t strides[1] = {cuuint64_t(rowStatsStride(rows) * int64_t(sizeof(float)))};
      const cuuint32_t box[2] = {cuuint32_t(compiled.schedule().block_m()), kRowStatsPlanes};
      const cuuint32_t elementStrides[2] = {1, 1};
      return check(encode(&out, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, base, dims, strides, box, elementStrides,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                   "cuTensorMapEncodeTiled(delta: lse_log2 and D)");
    };
    const cuuint32_t blockM = cuuint32_t(compiled.schedule().block_m());
    // A head_dim that is not whole atoms (80, 96, 112) takes the 3-d maps,
    // a box an atom, the columns past head_dim zeros (bwgmma::tmaTile).
    auto tile = [&](CUtensorMap& out, void* base, int64_t heads, cuuint32_t boxRows, const char* name) {
      return d % kAtomColumns == 0 ? tiles(out, base, heads, boxRows, name) : map(out, base, heads, boxRows, name);
    };
    if (Status ok = tile(maps.q, args.q_mixed, spec.heads(), blockM, "q_mixed"); !ok) return ok;
    if (Status ok = tile(maps.dO, args.do_pseudo, spec.heads(), blockM, "do_pseudo"); !ok) return ok;
    if (Status ok = tile(maps.k, args.k_mixed, spec.kv_heads(), blockN, "k_mixed"); !ok) return ok;
    if (Status ok = tile(maps.v, args.v_mixed, spec.kv_heads(), blockN, "v_mixed"); !ok) return ok;
    return rowStats(maps.row_stats, args.lse_log2);
  }
  if (Status ok = map(maps.q, args.q_mixed, spec.heads(), kQueryRows, "q_mixed"); !ok) return ok;
  if (Status ok = map(maps.k, args.k_mixed, spec.kv_heads(), blockN, "k_mixed"); !ok) return ok;
  return map(maps.v, args.v_mixed, spec.kv_heads(), blockN, "v_mixed");
}

}  // namespace cuda

Status Kernel::encodeTensorMaps(const IhaArgs& args, int64_t L, int64_t B, cuda::TmaMaps& maps) const {
  return cuda::encodeWorkspaceMaps(device_->api().cuTensorMapEncodeTiled, cuda::check, compiled_, args, L, B, maps);
}

namespace {

// The operands of the forward and a decode step as the launches read them
// (the backward's too, `outLike` its dout, read with out's strides).
IhaArgs operandArgs(const IhaTensors& t, const Tensor& outLike, const std::function<void*(const char*)>& workspace) {
  IhaArgs args{};
  args.q = t.q.data;
  args.k = t.k.data;
  args.v = t.v.data;
  args.alpha_q = static_cast<const float*>(t.alpha_q.data);
  args.alpha_k = static_cast<const float*>(t.alpha_k.data);
  args.alpha_v = static_cast<const float*>(t.alpha_v.data);
  args.collapse = static_cast<const float*>(t.collapse.data);
  args.out = outLike.data;
  args.lse = t.lse ? static_cast<float*>(t.lse->data) : nullptr;
  args.q_mixed = workspace("q_mixed");
  args.k_mixed = workspace("k_mixed");
  args.v_mixed = workspace("v_mixed");
  args.o_pseudo = workspace("o_pseudo");
  args.partials = static_cast<float*>(workspace("splits"));  // a split decode plan's (the backward's is set after)
  args.batch = t.q.shape[0];
  args.tokens = t.q.shape[1];
  args.cu_seqlens = t.cu_seqlens;
  args.documents = t.documents;
  const Tensor* strided[] = {&t.q, &t.k, &t.v, &outLike};
  int64_t* targets[] = {args.q_stride, args.k_stride, args.v_stride, args.out_stride};
  for (int i = 0; i < 4; ++i) {
    const std::vector<int64_t> s = stridesOf(*strided[i]);
    std::memcpy(targets[i], s.data(), 3 * sizeof(int64_t));
  }
  return args;
}

}  // namespace

Status Kernel::launchDecode(const IhaTensors& step, const PagedCacheTensors& cache, CUstream stream,
                            bool checkPages, const WorkspaceMemory* workspace) {
  const bool mixedKernel = mixedCacheOf(compiled_.direction());
  if (!mixedKernel && compiled_.direction() != v1::direction_decode)
    return makeError("this is not a decode kernel: compile one with direction decode (loom compile --decode)");
  if (mixedKernel != (cache.layout == CacheLayout::mixed))
    return makeError(std::string("this decode kernel reads a ") + (mixedKernel ? "mixed" : "raw") +
                     " cache, the step's is " + cacheLayoutName(cache.layout) + " (loom compile --decode --cache)");
  const bool ragged = cache.query_start_loc != nullptr;
  if (step.q.shape.size() != (ragged ? 3u : 4u))
    return makeError(ragged ? "q: a ragged step's is [total, H, d]" : "q: want 4 dimensions [B, T, H, d]");
  if (!cache.page_table || !cache.cache_len) return makeError("page_table and cache_len: missing");
  if (Status ok = device_->makeCurrent(); !ok) return ok;
  const int64_t B = ragged ? cache.batch : step.q.shape[0], T = ragged ? cache.max_query_len : step.q.shape[1];
  if (B < 1 || cache.max_pages < 1) return makeError("q: B must be at least 1, and page_table's max_pages too");
  // The page table, lengths and a ragged step's offsets come to the host to be checked.
  std::vector<int32_t> table(static_cast<size_t>(B * cache.max_pages)), lengths(static_cast<size_t>(B));
  std::vector<int32_t> starts(ragged ? static_cast<size_t>(B + 1) : 0);
  auto fetch = [&](std::vector<int32_t>& host, const int32_t* device, const char* what) {
    return cuda::check(device_->api().cuMemcpyDtoH(host.data(), reinterpret_cast<CUdeviceptr>(device),
                                                   host.size() * sizeof(int32_t)),
                       std::string("cuMemcpyDtoH of ") + what);
  };
  if (checkPages) {
    if (Status ok = fetch(table, cache.page_table, "page_table"); !ok) return ok;
    if (Status ok = fetch(lengths, cache.cache_len, "cache_len"); !ok) return ok;
    if (ragged)
      if (Status ok = fetch(starts, cache.query_start_loc, "query_start_loc"); !ok) return ok;
  }
  PagedCacheTensors checked = cache;
  checked.page_table = table.data();
  checked.cache_len = lengths.data();
  if (ragged) checked.query_start_loc = starts.data();
  if (Status ok = validateDecodeTensors(compiled_.spec(), step, checked, device_->info().ordinal, checkPages); !ok)
    return ok;
  std::lock_guard lock(mutex_);
  auto state = streamState(stream, B, T, workspace);
  if (!state) return state.error();
  const IhaTensors launched = raggedLaunchView(step, cache);
  IhaArgs args = operandArgs(launched, launched.out, [&](const char* name) { return (*state)->workspace(name); });
  args.query_start_loc = cache.query_start_loc;
  args.k_cache = cache.k_cache.data;
  args.v_cache = cache.v_cache.data;
  args.page_table = cache.page_table;
  args.cache_len = cache.cache_len;
  args.page_size = cache.k_cache.shape[1];
  args.max_pages = cache.max_pages;
  if (cache.page_errors) {  // the device's check, in the append launch
    args.num_pages = cache.k_cache.shape[0];
    args.page_errors = cache.page_errors;
    args.sequence_ok = static_cast<int32_t*>((*state)->workspace(kSequenceOkWorkspace));
  }
  return launchEntries(args, stream, /*skipForward=*/false, **state);
}

namespace {

// A varlen launch's bounds, copied to the host and checked
// (validateCuSeqlens): one small synchronous copy a launch.
Status checkDocuments(cuda::Device& device, const IhaTensors& t) {
  if (!t.cu_seqlens) return Status::success();
  std::vector<int32_t> bounds(size_t(t.documents + 1));
  if (Status ok = cuda::check(device.api().cuMemcpyDtoH(bounds.data(), reinterpret_cast<CUdeviceptr>(t.cu_seqlens),
                                                        bounds.size() * sizeof(int32_t)),
                              "cuMemcpyDtoH of cu_seqlens");
      !ok)
    return ok;
  return validateCuSeqlens(bounds.data(), int64_t(bounds.size()), t.q.shape[1]);
}

}  // namespace

bool Kernel::keepsForward() const {
  if (compiled_.direction() != v1::direction_forward) return false;
  for (const char* name : {"q_mixed", "k_mixed", "v_mixed", "o_pseudo"})
    if (std::find(compiled_.workspaces().begin(), compiled_.workspaces().end(), name) == compiled_.workspaces().end())
      return false;
  return true;
}

Status Kernel::launch(const IhaTensors& given, CUstream stream, const IhaSaved* keep, const WorkspaceMemory* workspace) {
  if (compiled_.direction() == v1::direction_backward)
    return makeError("this is a backward kernel: call launchBackward with dout and the gradients");
  if (isDecode(compiled_.direction()))
    return makeError("this is a decode kernel: call launchDecode with the step and its paged cache");
  if (Status ok = validateTensors(compiled_.spec(), given, device_->info().ordinal); !ok) return ok;
  const IhaTensors t = batchedView(compiled_.spec(), given);
  if (keep) {
    if (!keepsForward())
      return makeError("this forward kernel keeps no mixed rows and pseudo-head outputs for the backward: load it "
                       "with Runtime::keepingKernel (schedule.mix mix_materialized, collapse collapse_separate)");
    if (Status ok = validateSaved(compiled_.spec(), *keep, t.q.shape[0], t.q.shape[1], true, device_->info().ordinal);
        !ok)
      return ok;
  }
  if (Status ok = device_->makeCurrent(); !ok) return ok;
  if (Status ok = checkDocuments(*device_, t); !ok) return ok;
  const int64_t B = t.q.shape[0], N = t.q.shape[1];
  std::lock_guard lock(mutex_);
  auto state = streamState(stream, B, N, workspace);
  if (!state) return state.error();
  IhaArgs args = operandArgs(t, t.out, [&](const char* name) { return (*state)->workspace(name); });
  if (keep) {  // the launches write the caller's buffers instead of the kernel's own
    args.q_mixed = keep->q_mixed.data;
    args.k_mixed = keep->k_mixed.data;
    args.v_mixed = keep->v_mixed.data;
    args.o_pseudo = keep->o_pseudo.data;
    args.lse = static_cast<float*>(keep->lse.data);
  }
  return launchEntries(args, stream, /*skipForward=*/false, **state);
}

Status Kernel::launchEntries(IhaArgs& args, CUstream stream, bool skipForward, StreamState& state) {
  const int64_t B = args.batch, N = args.tokens;
  const bool wantsMaps = std::any_of(compiled_.entries().begin(), compiled_.entries().end(),
                                     [](const v1::EntryPoint& entry) { return entry.tensor_maps(); });
  const std::array<const void*, 5> buffers = {args.q_mixed, args.k_mixed, args.v_mixed, args.do_pseudo,
                                              args.lse_log2};
  if (wantsMaps && (state.mapsShape != std::make_pair(B, N) || state.mapsBuffers != buffers)) {
    if (!state.maps) state.maps = std::make_unique<cuda::TmaMaps>();
    if (Status ok = encodeTensorMaps(args, N * compiled_.spec().pseudo_heads(), B, *state.maps); !ok) return ok;
    state.mapsShape = {B, N};
    state.mapsBuffers = buffers;
  }

  for (int e = 0; e < compiled_.entries_size(); ++e) {
    const v1::EntryPoint& entry = compiled_.entries(e);
    // compiler.h's kPremixEntry and kAttentionEntry (loom_cuda links no compiler).
    if (skipForward && (entry.name() == "iha_premix" || entry.name() == "iha_attention")) continue;
    void* argsOnly[] = {&args};
    void* argsAndMaps[] = {&args, state.maps.get()};
    void** params = entry.tensor_maps() ? argsAndMaps : argsOnly;
    const int64_t rows = N * entry.rows_per_token();
    const unsigned gridX = unsigned((rows + entry.rows_per_cta() - 1) / entry.rows_per_cta());
    for (int64_t b0 = 0; b0 < B; b0 += kMaxGridZ) {
      args.batch_offset = b0;
      if (Status ok = cuda::check(
              device_->api().cuLaunchKernel(functions_[e], gridX, unsigned(entry.grid_y()),
                                            unsigned(std::min(B - b0, kMaxGridZ)), unsigned(entry.threads()), 1, 1,
                                            unsigned(entry.shared_memory_bytes()), stream, params, nullptr),
              "launch of " + entry.name());
          !ok)
        return ok;
    }
  }
  return Status::success();
}

Status Kernel::launchBackward(const IhaTensors& givenInputs, const IhaGradTensors& givenGrads, CUstream stream,
                              const IhaSaved* saved, const WorkspaceMemory* workspace) {
  if (compiled_.direction() != v1::direction_backward)
    return makeError("this is a forward kernel: Runtime::backwardKernel gives the backward's");
  if (Status ok = validateGradTensors(compiled_.spec(), givenInputs, givenGrads, device_->info().ordinal); !ok)
    return ok;
  const IhaTensors t = batchedView(compiled_.spec(), givenInputs);
  const IhaGradTensors g = batchedView(compiled_.spec(), givenGrads);
  if (saved)
    if (Status ok = validateSaved(compiled_.spec(), *saved, t.q.shape[0], t.q.shape[1], true, device_->info().ordinal);
        !ok)
      return ok;
  if (Status ok = device_->makeCurrent(); !ok) return ok;
  if (Status ok = checkDocuments(*device_, t); !ok) return ok;
  const int64_t B = t.q.shape[0], N = t.q.shape[1];
  std::lock_guard lock(mutex_);
  auto state = streamState(stream, B, N, workspace);
  if (!state) return state.error();
  auto carved = [&](const char* name) { return (*state)->workspace(name); };
  IhaArgs args = operandArgs(t, g.dout, carved);  // dout is read with out's strides
  args.out = nullptr;  // the backward writes no out
  args.lse = static_cast<float*>(t.lse ? t.lse->data : carved(kLseWorkspace));
  args.dout = g.dout.data;
  args.dq = static_cast<float*>(g.dq.data);
  args.dk = static_cast<float*>(g.dk.data);
  args.dv = static_cast<float*>(g.dv.data);
  args.dalpha_q = static_cast<float*>(g.dalpha_q.data);
  args.dalpha_k = static_cast<float*>(g.dalpha_k.data);
  args.dalpha_v = static_cast<float*>(g.dalpha_v.data);
  args.dcollapse = static_cast<float*>(g.dcollapse.data);
  args.do_pseudo = carved("do_pseudo");
  const int64_t rows = B * compiled_.spec().heads() * N * compiled_.spec().pseudo_heads();  // B * H * L
  setRowStats(args, static_cast<float*>(carved("delta")), rows);
  args.dq_pseudo = static_cast<float*>(carved("dq_pseudo"));
  args.dk_pseudo = static_cast<float*>(carved("dk_pseudo"));
  args.dv_pseudo = static_cast<float*>(carved("dv_pseudo"));
  args.partials = static_cast<float*>(carved("partials"));
  if (saved) {  // the forward's rows and lse: no pre-mix, no recomputed attention
    args.q_mixed = saved->q_mixed.data;
    args.k_mixed = saved->k_mixed.data;
    args.v_mixed = saved->v_mixed.data;
    args.o_pseudo = saved->o_pseudo.data;
    args.lse = static_cast<float*>(saved->lse.data);
  }
  return launchEntries(args, stream, /*skipForward=*/saved != nullptr, **state);
}

Status Kernel::launch(const DLTensor* q, const DLTensor* k, const DLTensor* v, const DLTensor* alphaQ,
                      const DLTensor* alphaK, const DLTensor* alphaV, const DLTensor* collapse, const DLTensor* out,
                      const DLTensor* lse, CUstream stream) {
  auto tensors = tensorsFromDlpack(q, k, v, alphaQ, alphaK, alphaV, collapse, out, lse);
  if (!tensors) return tensors.error();
  return launch(*tensors, stream);
}

}  // namespace loom
