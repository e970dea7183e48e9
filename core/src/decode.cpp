#include "loom/decode.h"

#include <unordered_map>

namespace loom {

Result<CacheLayout> parseCacheLayout(const std::string& name) {
  if (name == "raw") return CacheLayout::raw;
  if (name == "mixed") return CacheLayout::mixed;
  return makeError("cache layout '" + name + "': expected raw or mixed");
}

const char* cacheLayoutName(CacheLayout layout) { return layout == CacheLayout::raw ? "raw" : "mixed"; }

int64_t cacheBytesPerToken(const KernelSpec& spec, CacheLayout layout) {
  const int64_t elementBytes = spec.dtype() == v1::float32 ? 4 : 2;
  const int64_t perHead = int64_t(spec.head_dim()) * (layout == CacheLayout::mixed ? spec.pseudo_heads() : 1);
  return 2 * int64_t(spec.kv_heads()) * perHead * elementBytes;
}

Status validateDecode(const DecodeShape& shape, std::span<const int32_t> pageTable,
                      std::span<const int32_t> cacheLen, std::span<const int32_t> queryStartLoc) {
  const std::pair<const char*, int64_t> sizes[] = {{"batch", shape.batch},
                                                   {"new tokens", shape.newTokens},
                                                   {"num_pages", shape.numPages},
                                                   {"page_size", shape.pageSize},
                                                   {"max_pages", shape.maxPages}};
  for (const auto& [name, value] : sizes)
    if (value < 1) return makeError(std::string(name) + " must be at least 1, not " + std::to_string(value));
  if (int64_t(pageTable.size()) != shape.batch * shape.maxPages)
    return makeError("page_table has " + std::to_string(pageTable.size()) + " entries; [batch " +
                     std::to_string(shape.batch) + ", max_pages " + std::to_string(shape.maxPages) + "] needs " +
                     std::to_string(shape.batch * shape.maxPages));
  if (int64_t(cacheLen.size()) != shape.batch)
    return makeError("cache_len has " + std::to_string(cacheLen.size()) + " entries, one per sequence needs " +
                     std::to_string(shape.batch));
  const bool ragged = !queryStartLoc.empty();
  auto newTokensOf = [&](int64_t b) {
    return ragged ? int64_t(queryStartLoc[size_t(b) + 1]) - queryStartLoc[size_t(b)] : shape.newTokens;
  };
  if (ragged) {
    if (int64_t(queryStartLoc.size()) != shape.batch + 1)
      return makeError("query_start_loc has " + std::to_string(queryStartLoc.size()) + " entries; " +
                       std::to_string(shape.batch) + " sequences need " + std::to_string(shape.batch + 1));
    if (queryStartLoc[0] != 0)
      return makeError("query_start_loc[0] is " + std::to_string(queryStartLoc[0]) + ": the packed rows start at 0");
    for (int64_t b = 0; b < shape.batch; ++b) {
      const int64_t count = newTokensOf(b);
      const std::string at = "query_start_loc[" + std::to_string(b + 1) + "] is " +
                             std::to_string(queryStartLoc[size_t(b) + 1]) + ", ";
      if (count < 0)
        return makeError(at + "below query_start_loc[" + std::to_string(b) + "] " +
                         std::to_string(queryStartLoc[size_t(b)]) + ": the offsets must not decrease");
      if (count > shape.newTokens)
        return makeError(at + "so sequence " + std::to_string(b) + " brings " + std::to_string(count) +
                         " new tokens, more than the step's most, " + std::to_string(shape.newTokens) +
                         " (max_query_len)");
    }
    if (queryStartLoc[size_t(shape.batch)] != shape.totalTokens)
      return makeError("query_start_loc[" + std::to_string(shape.batch) + "] is " +
                       std::to_string(queryStartLoc[size_t(shape.batch)]) + ", but q packs " +
                       std::to_string(shape.totalTokens) + " tokens");
  }
  const int64_t capacity = shape.maxPages * shape.pageSize;
  // Each page's first user: (sequence, entry, whether the step writes there).
  struct User {
    int64_t sequence, entry;
    bool writes;
  };
  std::unordered_map<int32_t, User> first;
  auto name = [](int64_t b, int64_t e) {
    return "page_table[" + std::to_string(b) + "][" + std::to_string(e) + "]";
  };
  for (int64_t b = 0; b < shape.batch; ++b) {
    const int64_t length = cacheLen[size_t(b)], count = newTokensOf(b);
    const std::string sequence = "sequence " + std::to_string(b);
    if (length < 0) return makeError("cache_len[" + std::to_string(b) + "] is " + std::to_string(length) + ", negative");
    if (length + count > capacity)
      return makeError(sequence + ": cache_len " + std::to_string(length) + " + " + std::to_string(count) +
                       " new tokens do not fit its max_pages " + std::to_string(shape.maxPages) + " x page_size " +
                       std::to_string(shape.pageSize) + " = " + std::to_string(capacity) + " slots");
    const int64_t used = (length + count + shape.pageSize - 1) / shape.pageSize;
    for (int64_t e = 0; e < used; ++e) {
      const int32_t page = pageTable[size_t(b * shape.maxPages + e)];
      const std::string entry = name(b, e);
      if (page < 0 || page >= shape.numPages)
        return makeError(entry + " is " + std::to_string(page) + ", outside the cache's " +
                         std::to_string(shape.numPages) + " pages");
      // The step appends at positions length .. length + T - 1: a page
      // holding any of them is written.
      const bool writes = count > 0 && (e + 1) * shape.pageSize > length;
      auto [at, fresh] = first.try_emplace(page, User{b, e, writes});
      if (fresh) continue;
      const User& other = at->second;
      const std::string both = entry + " is page " + std::to_string(page) + ", which " +
                               name(other.sequence, other.entry) + " uses too";
      if (other.sequence == b)
        return makeError(both + ": one sequence's positions cannot share a page");
      if (writes || other.writes) {
        const int64_t writer = writes ? b : other.sequence;
        return makeError(both + "; the step writes sequence " + std::to_string(writer) + "'s new tokens there (cache_len " +
                         std::to_string(cacheLen[size_t(writer)]) +
                         "), and a shared page must lie wholly before every sharer's cache_len");
      }
      // Both only read it: a shared prefix.
    }
  }
  return {};
}

}  // namespace loom
