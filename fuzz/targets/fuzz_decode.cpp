// A decode step's page table, lengths and (a ragged step's) query_start_loc
// from any bytes: validateDecode refuses them with a clean error, or the
// float64 decode step (which reads and writes the cache only through them,
// and the packed rows through the offsets) stays inside every buffer and
// gives finite rows.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "loom/decode.h"
#include "reference/iha_decode.h"

namespace {

struct Bytes {
  const uint8_t* data;
  size_t size;
  size_t at = 0;
  uint8_t next() { return at < size ? data[at++] : 0; }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Bytes in{data, size};
  loom::DecodeShape shape;
  shape.batch = in.next() % 4;
  shape.newTokens = in.next() % 5;
  shape.numPages = in.next() % 9;
  shape.pageSize = in.next() % 6;
  shape.maxPages = in.next() % 7;
  const bool mixed = in.next() & 1;
  const size_t tableSize = size_t(std::max<int64_t>(0, shape.batch * shape.maxPages)) + (in.next() % 3 == 0);
  std::vector<int32_t> table(tableSize), lengths(size_t(shape.batch));
  for (int32_t& entry : table) entry = int32_t(int8_t(in.next()));
  for (int32_t& length : lengths) length = int32_t(int8_t(in.next()));
  // A ragged step: B + 1 offsets (or a drawn wrong count of them) into totalTokens packed rows.
  std::vector<int32_t> starts;
  if (in.next() & 1) {
    shape.totalTokens = in.next() % 12;
    starts.resize(size_t(std::max<int64_t>(1, shape.batch + 1)) + (in.next() % 4 == 0));
    for (int32_t& start : starts) start = int32_t(int8_t(in.next()));
  }
  if (!loom::validateDecode(shape, table, lengths, starts)) return 0;

  loom::v1::KernelSpec spec;
  spec.set_heads(2);
  spec.set_kv_heads(1);
  spec.set_pseudo_heads(2);
  spec.set_head_dim(2);
  spec.set_mask(static_cast<loom::v1::MaskMode>(1 + in.next() % 3));
  spec.set_collapse(loom::v1::per_head);
  spec.set_rope_theta(10000);
  const int64_t B = shape.batch, T = shape.newTokens, E = loom::reference::cacheTokenElements(spec, mixed);
  loom::reference::PagedCache cache;
  cache.mixed = mixed;
  cache.numPages = shape.numPages;
  cache.pageSize = shape.pageSize;
  cache.maxPages = shape.maxPages;
  cache.k.assign(size_t(shape.numPages * shape.pageSize * E), 0.5);
  cache.v.assign(cache.k.size(), -0.25);
  cache.k.shrink_to_fit();
  cache.v.shrink_to_fit();
  cache.pageTable = table;
  cache.cacheLen = lengths;
  loom::reference::DecodeInputs step;
  step.batch = B;
  step.tokens = T;
  step.query_start_loc = starts;
  const int64_t rows = starts.empty() ? B * T : shape.totalTokens;
  step.q.assign(size_t(rows * 2 * 2), 0.75);
  step.k.assign(size_t(rows * 1 * 2), -0.5);
  step.v.assign(step.k.size(), 1.0);
  step.alpha_q = {1, 0.5, 0.25, 1, -0.5, 0.25, 1, 0};  // [H, H, P]
  step.alpha_k = {1, 0.5};                             // [G, G, P]
  step.alpha_v = {0.5, 1};
  step.collapse = {0.5, 0.5, -1, 2};  // [H, P]
  const loom::reference::DecodeOutputs out = loom::reference::ihaDecode(spec, step, cache);
  if (out.out.size() != size_t(rows * 2 * 2)) std::abort();
  for (double x : out.out)
    if (!std::isfinite(x)) std::abort();
  return 0;
}
