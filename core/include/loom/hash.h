// Content hashes for cache keys: 64-bit FNV-1a over every input that
// changes a binary, printed as 16 hex digits.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace loom {

class ContentHash {
 public:
  ContentHash& add(std::string_view bytes) {
    for (unsigned char c : bytes) state_ = (state_ ^ c) * kPrime;
    // A separator, so ("ab", "c") and ("a", "bc") differ.
    state_ = (state_ ^ 0xff) * kPrime;
    return *this;
  }
  std::string hex() const {
    char text[17];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(state_));
    return text;
  }

 private:
  static constexpr uint64_t kOffset = 0xcbf29ce484222325ull;
  static constexpr uint64_t kPrime = 0x100000001b3ull;
  uint64_t state_ = kOffset;
};

}  // namespace loom
