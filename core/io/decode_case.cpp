#include "io/decode_case.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

namespace loom {
namespace {

// Rows [from, to) of x [B, N, heads, d] in sequence b.
std::vector<double> rows(const std::vector<double>& x, int64_t tokens, int64_t heads, int64_t d, int64_t b,
                         int64_t from, int64_t to) {
  const auto first = x.begin() + (b * tokens + from) * heads * d;
  return std::vector<double>(first, first + (to - from) * heads * d);
}

}  // namespace

AppendCheck checkAppend(const DecodeCase& step, const reference::PagedCache& after) {
  reference::PagedCache want = step.cache;
  reference::appendToCache(step.spec, step.step, want);
  AppendCheck check;
  if (after.k.size() != want.k.size() || after.v.size() != want.v.size()) {
    check.wrongElements = int64_t(std::max(after.k.size(), want.k.size()) + std::max(after.v.size(), want.v.size()));
    return check;
  }
  std::vector<double> gotFinite, wantFinite;  // the mixed rows where both are finite
  for (auto [got, expected] : {std::pair{&after.k, roundedToDtype(want.k, step.spec.dtype())}, {&after.v, roundedToDtype(want.v, step.spec.dtype())}})
    for (size_t i = 0; i < expected.size(); ++i) {
      const double g = (*got)[i], e = expected[i];
      if (step.layout == CacheLayout::raw) {
        check.wrongElements += std::isnan(e) ? !std::isnan(g) : g != e;
      } else if (std::isfinite(g) != std::isfinite(e)) {
        ++check.wrongElements;
      } else if (std::isfinite(e)) {
        gotFinite.push_back(g);
        wantFinite.push_back(e);
      }
    }
  if (step.layout == CacheLayout::mixed) check.mixedError = relativeError(gotFinite, wantFinite);
  return check;
}

reference::IhaInputs sliceTokens(const KernelSpec& spec, const reference::IhaInputs& inputs, int64_t b, int64_t from,
                                 int64_t to) {
  reference::IhaInputs slice = inputs;
  slice.batch = 1;
  slice.tokens = to - from;
  slice.q = rows(inputs.q, inputs.tokens, spec.heads(), spec.head_dim(), b, from, to);
  slice.k = rows(inputs.k, inputs.tokens, spec.kv_heads(), spec.head_dim(), b, from, to);
  slice.v = rows(inputs.v, inputs.tokens, spec.kv_heads(), spec.head_dim(), b, from, to);
  return slice;
}

Result<IhaCase> withSharedPrefix(const IhaCase& c, int64_t tokens) {
  if (tokens < 0 || tokens > c.tokens)
    return makeError("a shared prefix of " + std::to_string(tokens) + " tokens: the case has " +
                     std::to_string(c.tokens));
  if (c.spec.varlen())
    return makeError("a varlen case packs documents; a shared prefix is a decode step's (decode a case without varlen)");
  IhaCase shared = c;
  const int64_t N = c.tokens, d = c.spec.head_dim();
  for (auto [x, heads] : {std::pair{&shared.inputs.q, int64_t(c.spec.heads())},
                          std::pair{&shared.inputs.k, int64_t(c.spec.kv_heads())},
                          std::pair{&shared.inputs.v, int64_t(c.spec.kv_heads())}})
    for (int64_t b = 1; b < c.batch; ++b)
      std::copy_n(x->begin(), tokens * heads * d, x->begin() + b * N * heads * d);
  shared.expected.reset();
  shared.expectedGradients.reset();
  return shared;
}

IhaCase stepCase(const DecodeCase& step) {
  IhaCase c;
  c.spec = step.spec;
  c.batch = step.shape.batch;
  c.tokens = step.shape.newTokens;
  c.inputs = step.step;
  return c;
}

Result<DecodeCase> decodeCaseFrom(const IhaCase& c, const DecodeLayout& layout) {
  const int64_t B = c.batch, N = c.tokens, S = layout.pageSize;
  const int64_t H = c.spec.heads(), d = c.spec.head_dim();
  if (c.spec.varlen())
    return makeError("a varlen case packs documents; a decode step's sequences are its page table's (decode a "
                     "case without varlen)");
  const bool ragged = !layout.newTokensOf.empty();
  if (ragged && int64_t(layout.newTokensOf.size()) != B)
    return makeError(std::to_string(layout.newTokensOf.size()) + " new-token counts for " + std::to_string(B) +
                     " sequences");
  std::vector<int64_t> fresh = ragged ? layout.newTokensOf : std::vector<int64_t>(size_t(B), layout.newTokens);
  const int64_t T = *std::max_element(fresh.begin(), fresh.end());
  for (int64_t b = 0; b < B; ++b)
    if (fresh[size_t(b)] < (ragged ? 0 : 1) || fresh[size_t(b)] > N)
      return makeError("--decode " + std::to_string(fresh[size_t(b)]) + (ragged ? " for sequence " + std::to_string(b) : "") +
                       ": the case has " + std::to_string(N) + " tokens, so " + (ragged ? "0" : "1") + " to " +
                       std::to_string(N) + " new tokens");
  if (T < 1) return makeError("a ragged step where no sequence brings a token: at least one must");
  if (S < 1) return makeError("--page-size " + std::to_string(S) + ": must be at least 1");
  std::vector<int64_t> cached = layout.cached;  // default: each sequence ends at the case's last token
  if (cached.empty())
    for (int64_t b = 0; b < B; ++b) cached.push_back(N - fresh[size_t(b)]);
  if (int64_t(cached.size()) != B)
    return makeError(std::to_string(cached.size()) + " cached lengths for " + std::to_string(B) + " sequences");
  for (int64_t b = 0; b < B; ++b)
    if (cached[size_t(b)] < 0 || cached[size_t(b)] + fresh[size_t(b)] > N)
      return makeError("sequence " + std::to_string(b) + ": " + std::to_string(cached[size_t(b)]) + " cached + " +
                       std::to_string(fresh[size_t(b)]) + " new tokens: the case has " + std::to_string(N));

  const int64_t shared = layout.sharedPages, sharedTokens = shared * S;
  if (shared < 0) return makeError("shared pages: " + std::to_string(shared) + ", negative");
  for (int64_t b = 0; b < B && shared > 0; ++b) {
    if (cached[size_t(b)] < sharedTokens)
      return makeError("sequence " + std::to_string(b) + " caches " + std::to_string(cached[size_t(b)]) +
                       " tokens: a shared prefix of " + std::to_string(shared) + " pages (" +
                       std::to_string(sharedTokens) + " tokens) must lie wholly before its new tokens");
    const reference::IhaInputs mine = sliceTokens(c.spec, c.inputs, b, 0, sharedTokens);
    const reference::IhaInputs first = sliceTokens(c.spec, c.inputs, 0, 0, sharedTokens);
    if (mine.k != first.k || mine.v != first.v)
      return makeError("sequence " + std::to_string(b) + "'s first " + std::to_string(sharedTokens) +
                       " tokens' k and v differ from sequence 0's: shared pages hold one prefix");
  }

  DecodeCase dc;
  dc.spec = c.spec;
  dc.layout = layout.layout;
  reference::PagedCache& cache = dc.cache;
  cache.mixed = layout.layout == CacheLayout::mixed;
  cache.pageSize = S;
  std::vector<int64_t> pages(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) pages[size_t(b)] = (cached[size_t(b)] + fresh[size_t(b)] + S - 1) / S;
  // One spare page per sequence in the table and one in the cache, so that
  // neither ends where the step's pages do.
  cache.maxPages = *std::max_element(pages.begin(), pages.end()) + 1;
  cache.numPages = std::accumulate(pages.begin(), pages.end(), int64_t(0)) - shared * (B - 1) + 1;
  std::vector<int32_t> order(size_t(cache.numPages));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(layout.seed);
  std::shuffle(order.begin(), order.end(), rng);
  cache.pageTable.assign(size_t(B * cache.maxPages), -1);
  size_t next = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t e = 0; e < pages[size_t(b)]; ++e)
      cache.pageTable[size_t(b * cache.maxPages + e)] = b > 0 && e < shared ? cache.pageTable[size_t(e)] : order[next++];
  const int64_t E = reference::cacheTokenElements(c.spec, cache.mixed);
  cache.k.assign(size_t(cache.numPages * S * E), std::numeric_limits<double>::quiet_NaN());
  cache.v = cache.k;
  cache.cacheLen.assign(size_t(B), 0);

  // The cached tokens go in through the step's own append, one sequence at a time.
  for (int64_t b = 0; b < B; ++b) {
    // The shared pages hold sequence 0's prefix; the others append after it.
    const int64_t from = b > 0 ? sharedTokens : 0;
    if (cached[size_t(b)] == from) {
      cache.cacheLen[size_t(b)] = int32_t(from);
      continue;
    }
    reference::PagedCache one;
    one.mixed = cache.mixed;
    one.numPages = cache.numPages;
    one.pageSize = S;
    one.maxPages = cache.maxPages;
    one.k = std::move(cache.k);
    one.v = std::move(cache.v);
    one.pageTable.assign(cache.pageTable.begin() + b * cache.maxPages,
                         cache.pageTable.begin() + (b + 1) * cache.maxPages);
    one.cacheLen = {int32_t(from)};
    reference::appendToCache(c.spec, sliceTokens(c.spec, c.inputs, b, from, cached[size_t(b)]), one);
    cache.k = std::move(one.k);
    cache.v = std::move(one.v);
    cache.cacheLen[size_t(b)] = int32_t(cached[size_t(b)]);
  }

  dc.step = c.inputs;
  dc.step.tokens = T;
  dc.step.q.clear();
  dc.step.k.clear();
  dc.step.v.clear();
  const int64_t total = std::accumulate(fresh.begin(), fresh.end(), int64_t(0));
  if (ragged) {
    dc.step.query_start_loc.assign(1, 0);
    for (int64_t b = 0; b < B; ++b) dc.step.query_start_loc.push_back(int32_t(dc.step.query_start_loc.back() + fresh[size_t(b)]));
  }
  if (layout.expected) dc.expected.reserve(size_t(total * H * d));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t from = cached[size_t(b)], to = from + fresh[size_t(b)];
    if (to == from) continue;
    const reference::IhaInputs step = sliceTokens(c.spec, c.inputs, b, from, to);
    dc.step.q.insert(dc.step.q.end(), step.q.begin(), step.q.end());
    dc.step.k.insert(dc.step.k.end(), step.k.begin(), step.k.end());
    dc.step.v.insert(dc.step.v.end(), step.v.begin(), step.v.end());
    if (!layout.expected) continue;
    const std::vector<double> want =
        to == N && c.expected ? rows(*c.expected, N, H, d, b, from, to)
                              : rows(reference::ihaForward(c.spec, sliceTokens(c.spec, c.inputs, b, 0, to)).out, to, H,
                                     d, 0, from, to);
    dc.expected.insert(dc.expected.end(), want.begin(), want.end());
  }
  dc.shape = {B, T, cache.numPages, S, cache.maxPages, ragged ? total : 0};
  return dc;
}

}  // namespace loom
