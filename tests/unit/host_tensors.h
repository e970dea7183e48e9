// Dense host tensors of a case for the host API (runOnHost, the backward,
// what a forward keeps), each buffer owned here and poisoned (0xff bytes,
// NaN in every float type) where the API writes.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "io/case.h"
#include "io/decode_case.h"
#include "io/npy.h"
#include "loom/runtime.h"

namespace loom::testing {

class HostTensors {
 public:
  explicit HostTensors(const IhaCase& c) : spec_(c.spec), batch_(c.batch), tokens_(c.tokens) {
    const KernelSpec& s = c.spec;
    const int64_t B = c.batch, N = c.tokens, H = s.heads(), G = s.kv_heads(), P = s.pseudo_heads(), d = s.head_dim();
    const ElementKind act = elementOf(s.dtype());
    if (!c.inputs.query_start_loc.empty()) {  // a ragged step: packed rows, no lse
      const int64_t total = c.inputs.query_start_loc.back();
      inputs_.q = values(c.inputs.q, act, {total, H, d});
      inputs_.k = values(c.inputs.k, act, {total, G, d});
      inputs_.v = values(c.inputs.v, act, {total, G, d});
      weights(c);
      inputs_.out = poisoned(act, {total, H, d});
      return;
    }
    inputs_.q = values(c.inputs.q, act, {B, N, H, d});
    inputs_.k = values(c.inputs.k, act, {B, N, G, d});
    inputs_.v = values(c.inputs.v, act, {B, N, G, d});
    weights(c);
    inputs_.out = poisoned(act, {B, N, H, d});
    inputs_.lse = poisoned(ElementKind::float32, {B, H, N * P});
    if (!c.dout) return;
    grads_.dout = values(*c.dout, act, {B, N, H, d});
    grads_.dq = poisoned(ElementKind::float32, inputs_.q.shape);
    grads_.dk = poisoned(ElementKind::float32, inputs_.k.shape);
    grads_.dv = poisoned(ElementKind::float32, inputs_.v.shape);
    grads_.dalpha_q = poisoned(ElementKind::float32, inputs_.alpha_q.shape);
    grads_.dalpha_k = poisoned(ElementKind::float32, inputs_.alpha_k.shape);
    grads_.dalpha_v = poisoned(ElementKind::float32, inputs_.alpha_v.shape);
    grads_.dcollapse = poisoned(ElementKind::float32, inputs_.collapse.shape);
  }

  const IhaTensors& inputs() const { return inputs_; }
  const IhaGradTensors& grads() const { return grads_; }

  // Buffers for what a forward keeps: rows of `rows` (float32 for the host
  // backend, the 16-bit dtype for CUDA programs), poisoned.
  IhaSaved saved(ElementKind rows) {
    const int64_t L = tokens_ * spec_.pseudo_heads(), H = spec_.heads(), G = spec_.kv_heads(), d = spec_.head_dim();
    return {poisoned(rows, {batch_, H, L, d}), poisoned(rows, {batch_, G, L, d}), poisoned(rows, {batch_, G, L, d}),
            poisoned(rows, {batch_, H, L, d}), poisoned(ElementKind::float32, {batch_, H, L})};
  }

  // The gradients as written, widened.
  reference::IhaGradients gradients() const {
    return {hostValues(grads_.dq),       hostValues(grads_.dk),       hostValues(grads_.dv),
            hostValues(grads_.dalpha_q), hostValues(grads_.dalpha_k), hostValues(grads_.dalpha_v),
            hostValues(grads_.dcollapse)};
  }

  // A decode step's cache as the host API takes it (this object holds the
  // spec of the step's case); the page table, lengths and a ragged step's
  // offsets point into `step`.
  PagedCacheTensors cache(const DecodeCase& step) {
    const ElementKind act = elementOf(spec_.dtype());
    std::vector<int64_t> shape = {step.shape.numPages, step.shape.pageSize, spec_.kv_heads()};
    if (step.layout == CacheLayout::mixed) shape.push_back(spec_.pseudo_heads());
    shape.push_back(spec_.head_dim());
    PagedCacheTensors cache{values(step.cache.k, act, shape), values(step.cache.v, act, shape),
                            step.cache.pageTable.data(),      step.cache.cacheLen.data(),
                            step.shape.maxPages,              step.layout};
    if (!step.step.query_start_loc.empty()) {
      cache.query_start_loc = step.step.query_start_loc.data();
      cache.batch = step.shape.batch;
      cache.max_query_len = step.shape.newTokens;
    }
    return cache;
  }

  static ElementKind elementOf(v1::DType dtype) {
    return dtype == v1::float16    ? ElementKind::float16
           : dtype == v1::bfloat16 ? ElementKind::bfloat16
                                   : ElementKind::float32;
  }

 private:
  void weights(const IhaCase& c) {
    const int64_t H = c.spec.heads(), G = c.spec.kv_heads(), P = c.spec.pseudo_heads();
    inputs_.alpha_q = values(c.inputs.alpha_q, ElementKind::float32, {H, H, P});
    inputs_.alpha_k = values(c.inputs.alpha_k, ElementKind::float32, {G, G, P});
    inputs_.alpha_v = values(c.inputs.alpha_v, ElementKind::float32, {G, G, P});
    inputs_.collapse = values(c.inputs.collapse, ElementKind::float32,
                              c.spec.collapse() == v1::global ? std::vector<int64_t>{H, H * P}
                                                              : std::vector<int64_t>{H, P});
  }
  Tensor values(const std::vector<double>& values, ElementKind element, std::vector<int64_t> shape) {
    const NpyType type = element == ElementKind::float32   ? NpyType::float32
                         : element == ElementKind::float16 ? storageTypeOf(v1::float16)
                                                           : storageTypeOf(v1::bfloat16);
    std::vector<uint8_t>& bytes = storage_.emplace_back(npyFromDouble(values, {int64_t(values.size())}, type).bytes);
    return Tensor{bytes.data(), element, std::move(shape), {}, kHostDevice};
  }
  Tensor poisoned(ElementKind element, std::vector<int64_t> shape) {
    int64_t count = 1;
    for (int64_t extent : shape) count *= extent;
    std::vector<uint8_t>& bytes = storage_.emplace_back(size_t(count * elementBytes(element)), 0xff);
    return Tensor{bytes.data(), element, std::move(shape), {}, kHostDevice};
  }

  KernelSpec spec_;
  int64_t batch_, tokens_;
  std::deque<std::vector<uint8_t>> storage_;  // stable addresses
  IhaTensors inputs_;
  IhaGradTensors grads_;
};

}  // namespace loom::testing
