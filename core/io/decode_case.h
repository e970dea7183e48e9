// A decode step built from a forward case (docs/IHA.md, "Decode over a paged
// cache"): the first tokens of each sequence go into a paged cache with a
// shuffled page table, the next T are the step's new tokens, and the
// forward's out rows at those tokens are what the step must give.
#pragma once

#include <cstdint>
#include <vector>

#include "io/case.h"
#include "loom/decode.h"
#include "reference/iha_decode.h"

namespace loom {

struct DecodeLayout {
  int64_t newTokens = 1;  // T
  int64_t pageSize = 16;
  CacheLayout layout = CacheLayout::raw;
  // Tokens already cached per sequence; empty: N - T for each, so that the
  // step decodes the case's last T tokens.
  std::vector<int64_t> cached;
  uint64_t seed = 1;  // the page table's shuffle
  // false: DecodeCase::expected stays empty (a step to time, whose cache is
  // too long for the float64 forward).
  bool expected = true;
  // Pages every sequence shares (a shared prefix: prefix caching, parallel
  // sampling): the first sharedPages pages of each sequence's table are the
  // same pages, written once. Each sequence caches at least their tokens and
  // its k and v there equal sequence 0's.
  int64_t sharedPages = 0;
  // A ragged step (docs/IHA.md, Ragged steps): sequence b brings
  // newTokensOf[b] new tokens (0 allowed; newTokens is then unused), packed
  // one sequence after another; empty: newTokens each.
  std::vector<int64_t> newTokensOf;
};

struct DecodeCase {
  KernelSpec spec;
  CacheLayout layout = CacheLayout::raw;
  DecodeShape shape;
  // The cache before the step: every slot no cached token holds is NaN, so a
  // kernel that reads past a sequence's tokens shows it. Page-table entries a
  // sequence does not use are -1.
  reference::PagedCache cache;
  reference::DecodeInputs step;  // batch B, tokens T (a ragged step: packed, with query_start_loc)
  // [B, T, H, d] (a ragged step's [total, H, d]): the case's expected.npy
  // rows where the step ends at the case's last token, the float64 forward
  // over the sequence's first cache_len + T tokens elsewhere.
  std::vector<double> expected;
};

// Builds the step. Errors name what does not fit: T and cached counts
// against the case's N, the page size.
Result<DecodeCase> decodeCaseFrom(const IhaCase& c, const DecodeLayout& layout);

// What a backend's step left in the cache (`after`), against the reference's
// append to the step's cache rounded to the spec's dtype. A raw cache must
// hold exactly that: the new tokens' k and v at their slots, every other
// element as it was (NaN where no token is). A mixed cache's rows are
// computed, so they are compared by relative error; its elements must still
// be finite exactly where a sequence's token is.
struct AppendCheck {
  int64_t wrongElements = 0;  // differing (raw), or finite where NaN is due or NaN where not (mixed)
  double mixedError = 0;      // the mixed rows' relative error over the finite elements; 0 for raw
};
AppendCheck checkAppend(const DecodeCase& step, const reference::PagedCache& after);

// The case with sequence 0's first `tokens` tokens (q, k and v) in every
// sequence (a shared prompt, for DecodeLayout::sharedPages), and no
// expected rows (the forward's change with them). Errors name a prefix
// longer than the case.
Result<IhaCase> withSharedPrefix(const IhaCase& c, int64_t tokens);

// The step's new tokens as a case of N = T (what the backends launch on).
IhaCase stepCase(const DecodeCase& step);

// Tokens [from, to) of sequence b of `inputs` as a batch of one, with the weights.
reference::IhaInputs sliceTokens(const KernelSpec& spec, const reference::IhaInputs& inputs, int64_t b, int64_t from,
                                 int64_t to);

}  // namespace loom
