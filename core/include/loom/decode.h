// A decode step over a paged cache (docs/IHA.md, "Decode over a paged
// cache"): its cache layouts, its sizes, and the checks a step's page table
// and lengths must pass before anything reads or writes through them.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "loom/result.h"
#include "loom/spec.h"

namespace loom {

// raw: the projections' k and v, G*d per token (loom mixes and rotates them
// on chip). mixed: the pseudo-keys and values, G*P*d per token, k already
// normalised and rotated (the layout a generic attention library needs).
enum class CacheLayout { raw, mixed };

Result<CacheLayout> parseCacheLayout(const std::string& name);  // "raw" | "mixed"
const char* cacheLayoutName(CacheLayout layout);

// The schema tells the two layouts' decode kernels apart: direction_decode
// (raw) and direction_decode_mixed.
inline bool isDecode(v1::Direction direction) {
  return direction == v1::direction_decode || direction == v1::direction_decode_mixed;
}
inline bool mixedCacheOf(v1::Direction direction) { return direction == v1::direction_decode_mixed; }
inline v1::Direction decodeDirectionOf(CacheLayout layout) {
  return layout == CacheLayout::mixed ? v1::direction_decode_mixed : v1::direction_decode;
}

// Bytes of k and v together that one cached token takes, in the spec's dtype.
int64_t cacheBytesPerToken(const KernelSpec& spec, CacheLayout layout);

// The sizes of a step: B sequences, T new tokens each, and the cache's
// pages (k_cache, v_cache [num_pages, page_size, ...], page_table
// [B, max_pages]).
struct DecodeShape {
  int64_t batch = 0;
  int64_t newTokens = 0;  // T; a ragged step's most new tokens of one sequence
  int64_t numPages = 0;
  int64_t pageSize = 0;
  int64_t maxPages = 0;
  int64_t totalTokens = 0;  // a ragged step's packed rows (query_start_loc[B] must equal it)
};

// Checks a step against its cache: B, T, page_size, num_pages and
// max_pages positive; page_table of B * max_pages entries and cache_len of
// B; each sequence's 0 <= cache_len and cache_len + T <= max_pages *
// page_size; every page it uses (its positions 0 .. cache_len + T - 1) in
// [0, num_pages). A page may be named by several sequences' entries (a
// shared prefix: prefix caching, parallel sampling, beams) when every one
// of them only reads it, the page lying wholly before that sequence's
// cache_len; a page the step writes (one holding a new token's position) is
// named by that entry alone, and no sequence names a page twice. Errors name
// the entry and the rule: "page_table[1][3] is 40, outside the cache's 32
// pages", "page_table[2][1] is page 7, which page_table[0][1] uses too; the
// step writes sequence 2's new tokens there (cache_len 20), ...".
//
// A ragged step (docs/IHA.md, Ragged steps) gives queryStartLoc [B + 1]:
// 0 first, never decreasing, totalTokens last, each sequence's share
// (query_start_loc[b + 1] - query_start_loc[b], zero allowed) at most
// newTokens, and the checks above use each sequence's own count.
Status validateDecode(const DecodeShape& shape, std::span<const int32_t> pageTable,
                      std::span<const int32_t> cacheLen, std::span<const int32_t> queryStartLoc = {});

}  // namespace loom
