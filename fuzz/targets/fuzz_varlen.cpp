// Varlen bounds (cu_seqlens) from any bytes: validateCuSeqlens refuses them
// with a clean error, or every token's document as the tile API finds it
// (loom/tile/common.h, document_of: a binary search every kernel makes)
// holds the token and is one of the bounds' intervals, and the float64
// reference of the packed batch stays inside its buffers with finite rows.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "loom/spec.h"
#include "loom/tile/common.h"
#include "reference/iha_reference.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int64_t tokens = data[0] % 24;
  std::vector<int32_t> bounds;
  for (size_t i = 1; i < size && bounds.size() < 12; ++i) bounds.push_back(int32_t(int8_t(data[i])));
  if (!loom::validateCuSeqlens(bounds.data(), int64_t(bounds.size()), tokens)) return 0;

  loom::IhaArgs args{};
  args.cu_seqlens = bounds.data();
  args.documents = int64_t(bounds.size()) - 1;
  for (int64_t token = 0; token < tokens; ++token) {
    const loom::TokenRange doc = loom::document_of(args, token);
    if (!(doc.begin <= token && token < doc.end)) std::abort();
    bool found = false;
    for (size_t i = 0; i + 1 < bounds.size(); ++i) found |= bounds[i] == doc.begin && bounds[i + 1] == doc.end;
    if (!found) std::abort();
  }

  loom::v1::KernelSpec spec;
  spec.set_heads(2);
  spec.set_kv_heads(1);
  spec.set_pseudo_heads(2);
  spec.set_head_dim(2);
  spec.set_mask(static_cast<loom::v1::MaskMode>(1 + data[0] % 3));
  spec.set_window(data[0] % 5 == 0 ? 2 : 0);
  spec.set_collapse(loom::v1::per_head);
  spec.set_rope_theta(10000);
  spec.set_varlen(true);
  loom::reference::IhaInputs in;
  in.batch = 1;
  in.tokens = tokens;
  in.q.assign(size_t(tokens * 2 * 2), 0.5);
  in.k.assign(size_t(tokens * 1 * 2), -0.25);
  in.v.assign(in.k.size(), 1.0);
  in.alpha_q.assign(2 * 2 * 2, 0.5);
  in.alpha_k.assign(1 * 1 * 2, 1.0);
  in.alpha_v.assign(1 * 1 * 2, 1.0);
  in.collapse.assign(2 * 2, 0.5);
  in.cu_seqlens = bounds;
  const auto out = loom::reference::ihaForward(spec, in);
  if (out.out.size() != size_t(tokens * 2 * 2) || out.lse.size() != size_t(2 * tokens * 2)) std::abort();
  for (double x : out.out)
    if (!std::isfinite(x)) std::abort();
  return 0;
}
