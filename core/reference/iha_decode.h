// The float64 oracle of an IHA decode step over a paged cache (docs/IHA.md,
// "Decode over a paged cache").
//
// A step appends the new tokens' keys and values to the cache, then attends
// their virtual rows to every cached row as the forward would: the same
// mixing, qk_norm, RoPE at the same virtual positions, the same mask. It
// reads and writes the cache only through the page table, so it checks the
// page arithmetic a kernel must get right as well as the function.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/iha_reference.h"

namespace loom::reference {

// A paged cache, widened to double. Token t of sequence b lives in page
// page_table[b * max_pages + t / page_size], slot t % page_size.
//   raw:   k, v [num_pages, page_size, G, d]     (the projections, unmixed)
//   mixed: k, v [num_pages, page_size, G, P, d]  (mixed; k also normalised and rotated)
struct PagedCache {
  bool mixed = false;
  int64_t numPages = 0, pageSize = 0, maxPages = 0;
  std::vector<double> k, v;
  std::vector<int32_t> pageTable;  // [B, max_pages]
  std::vector<int32_t> cacheLen;   // [B], tokens already cached
};

// The new tokens of a step: q [B, T, H, d], k and v [B, T, G, d], and the
// weights of IhaInputs (batch = B, tokens = T); a ragged step's
// (query_start_loc set) packed, q [total, H, d], k and v [total, G, d],
// tokens the most any sequence brings.
using DecodeInputs = IhaInputs;

// Sequence b's new tokens: the first one's row among the step's (packed or
// [B, T]) and how many.
struct StepRows {
  int64_t first, count;
};
StepRows stepRows(const DecodeInputs& step, int64_t b);
// Rows of all sequences together: B * T, or a ragged step's total.
int64_t stepTotal(const DecodeInputs& step);

struct DecodeOutputs {
  std::vector<double> out;  // [B, T, H, d]; a ragged step's [total, H, d]
  std::vector<double> lse;  // [B, H, T*P], the new virtual rows' (a ragged step's first T_b * P of each)
};

// The slot (page * page_size + offset) of token t of sequence b.
int64_t cacheSlot(const PagedCache& cache, int64_t b, int64_t t);

// Elements one token occupies in each of k and v: G*d (raw) or G*P*d (mixed).
int64_t cacheTokenElements(const v1::KernelSpec& spec, bool mixed);

// Writes the new tokens' k and v (mixed, normalised and rotated for a mixed
// cache) at positions cache_len[b] .. cache_len[b] + T - 1. cache_len is
// left as it was: the caller advances it by T once the step is done.
void appendToCache(const v1::KernelSpec& spec, const DecodeInputs& step, PagedCache& cache);

// appendToCache, then out and lse of the new tokens. The spec, the shapes
// and the page table must have passed validateSpec and validateDecode.
DecodeOutputs ihaDecode(const v1::KernelSpec& spec, const DecodeInputs& step, PagedCache& cache);

}  // namespace loom::reference
