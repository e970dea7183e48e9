#include "cuda/case_runner.h"

namespace loom::cuda {
namespace {

constexpr unsigned char kPoisonByte = 0xff;  // NaN in float32, float16 and bfloat16

ElementKind elementOf(v1::DType dtype) {
  return dtype == v1::float16 ? ElementKind::float16 : dtype == v1::bfloat16 ? ElementKind::bfloat16 : ElementKind::float32;
}

}  // namespace

namespace {
// `values` in `type` into `buffer`, which must hold exactly that many bytes.
Status writeValues(const Device& device, const DeviceBuffer& buffer, const std::vector<double>& values, NpyType type,
                   const char* what) {
  const NpyArray host = npyFromDouble(values, {int64_t(values.size())}, type);
  if (host.bytes.size() != buffer.size())
    return makeError(std::string(what) + ": " + std::to_string(host.bytes.size()) + " bytes for a buffer of " +
                     std::to_string(buffer.size()) + " (another shape)");
  return check(device.api().cuMemcpyHtoD(buffer.get(), host.bytes.data(), host.bytes.size()), "cuMemcpyHtoD");
}
}  // namespace

Result<CaseBuffers> CaseBuffers::upload(const Device& device, const IhaCase& c) {
  if (Status ok = device.makeCurrent(); !ok) return ok.error();
  const KernelSpec& spec = c.spec;
  const int64_t B = c.batch, N = c.tokens, H = spec.heads(), P = spec.pseudo_heads();
  const NpyType storage = storageTypeOf(spec.dtype());
  const std::vector<std::vector<int64_t>> shapes = inputShapes(spec, B, N);
  struct Operand {
    const std::vector<double>* values;
    std::vector<int64_t> shape;
    NpyType type;
    Tensor* view;
  };
  CaseBuffers buffers;
  IhaTensors& t = buffers.tensors_;
  t.lse = Tensor{};
  std::vector<Operand> operands = {{&c.inputs.q, shapes[0], storage, &t.q},
                                   {&c.inputs.k, shapes[1], storage, &t.k},
                                   {&c.inputs.v, shapes[2], storage, &t.v},
                                   {&c.inputs.alpha_q, shapes[3], NpyType::float32, &t.alpha_q},
                                   {&c.inputs.alpha_k, shapes[4], NpyType::float32, &t.alpha_k},
                                   {&c.inputs.alpha_v, shapes[5], NpyType::float32, &t.alpha_v},
                                   {&c.inputs.collapse, shapes[6], NpyType::float32, &t.collapse},
                                   {nullptr, shapes[0], storage, &t.out},
                                   {nullptr, {B, H, N * P}, NpyType::float32, &*t.lse}};
  for (Operand& o : operands) {
    int64_t count = 1;
    for (int64_t extent : o.shape) count *= extent;
    auto buffer = DeviceBuffer::allocate(device, size_t(count * NpyArray::elementSize(o.type)));
    if (!buffer) return buffer.error();
    auto shared = std::make_shared<DeviceBuffer>(std::move(*buffer));
    if (o.values)
      if (Status ok = writeValues(device, *shared, *o.values, o.type, "an operand"); !ok) return ok.error();
    *o.view = Tensor{shared->data(), o.type == NpyType::float32 ? ElementKind::float32 : elementOf(spec.dtype()),
                     o.shape, {}, device.info().ordinal};
    buffers.buffers_.push_back(shared);
  }
  if (const std::vector<int32_t>& bounds = c.inputs.cu_seqlens; !bounds.empty()) {
    auto buffer = DeviceBuffer::allocate(device, bounds.size() * sizeof(int32_t));
    if (!buffer) return buffer.error();
    buffers.documents_ = std::make_shared<DeviceBuffer>(std::move(*buffer));
    if (Status ok = check(device.api().cuMemcpyHtoD(buffers.documents_->get(), bounds.data(),
                                                    bounds.size() * sizeof(int32_t)),
                          "cuMemcpyHtoD of cu_seqlens");
        !ok)
      return ok.error();
    t.cu_seqlens = static_cast<const int32_t*>(buffers.documents_->data());
    t.documents = int64_t(bounds.size()) - 1;
  }
  return buffers;
}

IhaTensors CaseBuffers::tensors() const { return tensors_; }

Status CaseBuffers::poison(const Device& device) const {
  for (size_t i = buffers_.size() - 2; i < buffers_.size(); ++i)
    if (Status ok = check(device.api().cuMemsetD8(buffers_[i]->get(), kPoisonByte, buffers_[i]->size()), "cuMemsetD8");
        !ok)
      return ok;
  return Status::success();
}


Status CaseBuffers::rewrite(const Device& device, const IhaCase& c) const {
  const NpyType storage = storageTypeOf(c.spec.dtype());
  const std::vector<double>* values[] = {&c.inputs.q,       &c.inputs.k,       &c.inputs.v,       &c.inputs.alpha_q,
                                         &c.inputs.alpha_k, &c.inputs.alpha_v, &c.inputs.collapse};
  const char* names[] = {"q", "k", "v", "alpha_q", "alpha_k", "alpha_v", "collapse"};
  for (size_t i = 0; i < 7; ++i)
    if (Status ok = writeValues(device, *buffers_[i], *values[i], i < 3 ? storage : NpyType::float32, names[i]); !ok)
      return ok;
  return Status::success();
}

Status GradBuffers::rewrite(const Device& device, const IhaCase& c) const {
  if (!c.dout) return makeError("the backward needs dout, the gradient of the output");
  return writeValues(device, *dout_, *c.dout, storageTypeOf(c.spec.dtype()), "dout");
}

Result<DeviceRun> CaseBuffers::download(const Device& device, const IhaCase& c) const {
  if (Status ok = check(device.api().cuCtxSynchronize(), "kernel execution"); !ok) return ok.error();
  DeviceRun run;
  NpyArray out;
  out.type = storageTypeOf(c.spec.dtype());
  out.shape = tensors_.out.shape;
  out.bytes.resize(buffers_[7]->size());
  if (Status ok = check(device.api().cuMemcpyDtoH(out.bytes.data(), buffers_[7]->get(), out.bytes.size()), "cuMemcpyDtoH");
      !ok)
    return ok.error();
  run.out = npyToDouble(out, c.spec.dtype() == v1::bfloat16);
  std::vector<float> lse(buffers_[8]->size() / sizeof(float));
  if (Status ok = check(device.api().cuMemcpyDtoH(lse.data(), buffers_[8]->get(), buffers_[8]->size()), "cuMemcpyDtoH");
      !ok)
    return ok.error();
  run.lse.assign(lse.begin(), lse.end());
  return run;
}

Result<DeviceRun> runCase(Kernel& kernel, const Device& device, const IhaCase& c) {
  auto buffers = CaseBuffers::upload(device, c);
  if (!buffers) return buffers.error();
  if (Status ok = buffers->poison(device); !ok) return ok.error();
  if (Status ok = kernel.launch(buffers->tensors()); !ok) return ok.error();
  return buffers->download(device, c);
}

namespace {

// The step's operands as CaseBuffers hold them: a ragged step's packed rows
// as one batch of its tokens.
IhaCase operandCase(const DecodeCase& step) {
  IhaCase c = stepCase(step);
  if (c.inputs.query_start_loc.empty()) return c;
  c.batch = c.inputs.batch = 1;
  c.tokens = c.inputs.tokens = c.inputs.query_start_loc.back();
  c.inputs.query_start_loc.clear();
  return c;
}

}  // namespace

IhaTensors DecodeBuffers::tensors() const {
  IhaTensors t = step_.tensors();
  if (!cache_.query_start_loc) return t;
  for (Tensor* x : {&t.q, &t.k, &t.v, &t.out}) x->shape.erase(x->shape.begin());  // [1, total, ...]: dense
  t.lse.reset();
  return t;
}

Result<DecodeBuffers> DecodeBuffers::upload(const Device& device, const DecodeCase& step) {
  auto operands = CaseBuffers::upload(device, operandCase(step));
  if (!operands) return operands.error();
  DecodeBuffers buffers;
  buffers.step_ = std::move(*operands);
  auto upload = [&](const void* bytes, size_t size) -> Result<void*> {
    auto buffer = DeviceBuffer::allocate(device, size);
    if (!buffer) return buffer.error();
    if (Status ok = check(device.api().cuMemcpyHtoD(buffer->get(), bytes, size), "cuMemcpyHtoD"); !ok) return ok.error();
    buffers.cacheBuffers_.push_back(std::make_shared<DeviceBuffer>(std::move(*buffer)));
    return buffers.cacheBuffers_.back()->data();
  };
  const NpyType storage = storageTypeOf(step.spec.dtype());
  const NpyArray k = npyFromDouble(step.cache.k, {int64_t(step.cache.k.size())}, storage);
  const NpyArray v = npyFromDouble(step.cache.v, {int64_t(step.cache.v.size())}, storage);
  auto kData = upload(k.bytes.data(), k.bytes.size());
  auto vData = upload(v.bytes.data(), v.bytes.size());
  auto table = upload(step.cache.pageTable.data(), step.cache.pageTable.size() * sizeof(int32_t));
  auto lengths = upload(step.cache.cacheLen.data(), step.cache.cacheLen.size() * sizeof(int32_t));
  for (const Result<void*>* r : {&kData, &vData, &table, &lengths})
    if (!*r) return r->error();
  std::vector<int64_t> shape = {step.shape.numPages, step.shape.pageSize, step.spec.kv_heads()};
  if (step.layout == CacheLayout::mixed) shape.push_back(step.spec.pseudo_heads());
  shape.push_back(step.spec.head_dim());
  PagedCacheTensors& cache = buffers.cache_;
  cache.k_cache = Tensor{*kData, elementOf(step.spec.dtype()), shape, {}, device.info().ordinal};
  cache.v_cache = Tensor{*vData, elementOf(step.spec.dtype()), shape, {}, device.info().ordinal};
  cache.page_table = static_cast<const int32_t*>(*table);
  cache.cache_len = static_cast<const int32_t*>(*lengths);
  cache.max_pages = step.shape.maxPages;
  cache.layout = step.layout;
  if (const std::vector<int32_t>& starts = step.step.query_start_loc; !starts.empty()) {
    auto uploaded = upload(starts.data(), starts.size() * sizeof(int32_t));
    if (!uploaded) return uploaded.error();
    cache.query_start_loc = static_cast<const int32_t*>(*uploaded);
    cache.batch = step.shape.batch;
    cache.max_query_len = step.shape.newTokens;
  }
  return buffers;
}

Result<reference::PagedCache> DecodeBuffers::downloadCache(const Device& device, const DecodeCase& step) const {
  if (Status ok = check(device.api().cuCtxSynchronize(), "kernel execution"); !ok) return ok.error();
  reference::PagedCache cache = step.cache;
  for (auto [target, buffer] : {std::pair{&cache.k, cacheBuffers_[0].get()}, {&cache.v, cacheBuffers_[1].get()}}) {
    NpyArray bytes;
    bytes.type = storageTypeOf(step.spec.dtype());
    bytes.shape = {int64_t(target->size())};
    bytes.bytes.resize(buffer->size());
    if (Status ok = check(device.api().cuMemcpyDtoH(bytes.bytes.data(), buffer->get(), buffer->size()), "cuMemcpyDtoH");
        !ok)
      return ok.error();
    *target = npyToDouble(bytes, step.spec.dtype() == v1::bfloat16);
  }
  return cache;
}

Result<DeviceDecodeRun> runDecodeCase(Kernel& kernel, const Device& device, const DecodeCase& step) {
  auto buffers = DecodeBuffers::upload(device, step);
  if (!buffers) return buffers.error();
  if (Status ok = buffers->step().poison(device); !ok) return ok.error();
  if (Status ok = kernel.launchDecode(buffers->tensors(), buffers->cache()); !ok) return ok.error();
  auto run = buffers->step().download(device, operandCase(step));
  if (!run) return run.error();
  auto cache = buffers->downloadCache(device, step);
  if (!cache) return cache.error();
  return DeviceDecodeRun{std::move(run->out), std::move(run->lse), std::move(*cache)};
}

Result<GradBuffers> GradBuffers::upload(const Device& device, const IhaCase& c) {
  if (!c.dout) return makeError("the backward needs dout, the gradient of the output");
  if (Status ok = device.makeCurrent(); !ok) return ok.error();
  const KernelSpec& spec = c.spec;
  const std::vector<std::vector<int64_t>> shapes = inputShapes(spec, c.batch, c.tokens);
  auto allocate = [&](size_t bytes) -> Result<std::shared_ptr<DeviceBuffer>> {
    auto buffer = DeviceBuffer::allocate(device, bytes);
    if (!buffer) return buffer.error();
    return std::make_shared<DeviceBuffer>(std::move(*buffer));
  };
  GradBuffers buffers;
  auto doutBuffer = allocate(c.dout->size() * size_t(NpyArray::elementSize(storageTypeOf(spec.dtype()))));
  if (!doutBuffer) return doutBuffer.error();
  buffers.dout_ = *doutBuffer;
  if (Status ok = buffers.rewrite(device, c); !ok) return ok.error();
  IhaGradTensors& g = buffers.tensors_;
  g.dout = Tensor{buffers.dout_->data(), elementOf(spec.dtype()), shapes[0], {}, device.info().ordinal};
  Tensor* targets[] = {&g.dq, &g.dk, &g.dv, &g.dalpha_q, &g.dalpha_k, &g.dalpha_v, &g.dcollapse};
  for (size_t i = 0; i < shapes.size(); ++i) {
    int64_t count = 1;
    for (int64_t extent : shapes[i]) count *= extent;
    auto buffer = allocate(size_t(count) * sizeof(float));
    if (!buffer) return buffer.error();
    *targets[i] = Tensor{(*buffer)->data(), ElementKind::float32, shapes[i], {}, device.info().ordinal};
    buffers.gradients_.push_back(*buffer);
  }
  return buffers;
}

Status GradBuffers::poison(const Device& device) const {
  for (const auto& buffer : gradients_)
    if (Status ok = check(device.api().cuMemsetD8(buffer->get(), kPoisonByte, buffer->size()), "cuMemsetD8"); !ok)
      return ok;
  return Status::success();
}

Result<reference::IhaGradients> GradBuffers::download(const Device& device) const {
  if (Status ok = check(device.api().cuCtxSynchronize(), "kernel execution"); !ok) return ok.error();
  reference::IhaGradients result;
  const auto slots = reference::gradientsOf(result);
  for (size_t i = 0; i < gradients_.size(); ++i) {
    std::vector<float> values(gradients_[i]->size() / sizeof(float));
    if (Status ok = check(device.api().cuMemcpyDtoH(values.data(), gradients_[i]->get(), gradients_[i]->size()),
                          "cuMemcpyDtoH");
        !ok)
      return ok.error();
    slots[i]->assign(values.begin(), values.end());
  }
  return result;
}

Result<reference::IhaGradients> runBackwardCase(Kernel& kernel, const Device& device, const IhaCase& c) {
  auto buffers = CaseBuffers::upload(device, c);
  if (!buffers) return buffers.error();
  auto grads = GradBuffers::upload(device, c);
  if (!grads) return grads.error();
  if (Status ok = grads->poison(device); !ok) return ok.error();
  if (Status ok = kernel.launchBackward(buffers->tensors(), grads->tensors()); !ok) return ok.error();
  return grads->download(device);
}

Result<reference::IhaGradients> runKeptBackwardCase(Kernel& forward, Kernel& backward, const Device& device,
                                                    const IhaCase& c) {
  auto buffers = CaseBuffers::upload(device, c);
  if (!buffers) return buffers.error();
  auto grads = GradBuffers::upload(device, c);
  if (!grads) return grads.error();
  auto saved = SavedBuffers::allocate(device, c.spec, c.batch, c.tokens);
  if (!saved) return saved.error();
  if (Status ok = grads->poison(device); !ok) return ok.error();
  if (Status ok = forward.launch(buffers->tensors(), nullptr, &saved->saved()); !ok) return ok.error();
  if (Status ok = backward.launchBackward(buffers->tensors(), grads->tensors(), nullptr, &saved->saved()); !ok)
    return ok.error();
  return grads->download(device);
}

Result<SavedBuffers> SavedBuffers::allocate(const Device& device, const KernelSpec& spec, int64_t B, int64_t N) {
  const int64_t L = N * spec.pseudo_heads(), H = spec.heads(), G = spec.kv_heads(), d = spec.head_dim();
  const ElementKind rows = savedRowElement(spec, true);
  SavedBuffers made;
  auto poisoned = [&](ElementKind element, std::vector<int64_t> shape) -> Result<Tensor> {
    int64_t count = 1;
    for (int64_t extent : shape) count *= extent;
    auto buffer = DeviceBuffer::allocate(device, size_t(count * elementBytes(element)));
    if (!buffer) return buffer.error();
    made.buffers_.push_back(std::make_shared<DeviceBuffer>(std::move(*buffer)));
    const DeviceBuffer& b = *made.buffers_.back();
    if (Status ok = check(device.api().cuMemsetD8(b.get(), kPoisonByte, b.size()), "cuMemsetD8"); !ok)
      return ok.error();
    return Tensor{b.data(), element, std::move(shape), {}, device.info().ordinal};
  };
  const std::pair<Tensor*, std::pair<ElementKind, std::vector<int64_t>>> slots[] = {
      {&made.saved_.q_mixed, {rows, {B, H, L, d}}},
      {&made.saved_.k_mixed, {rows, {B, G, L, d}}},
      {&made.saved_.v_mixed, {rows, {B, G, L, d}}},
      {&made.saved_.o_pseudo, {rows, {B, H, L, d}}},
      {&made.saved_.lse, {ElementKind::float32, {B, H, L}}}};
  for (const auto& [target, what] : slots) {
    auto tensor = poisoned(what.first, what.second);
    if (!tensor) return tensor.error();
    *target = *tensor;
  }
  return made;
}

size_t SavedBuffers::bytes() const {
  size_t total = 0;
  for (const auto& buffer : buffers_) total += buffer->size();
  return total;
}

}  // namespace loom::cuda
