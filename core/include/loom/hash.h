// Content hashes for cache keys and blob checksums: SHA-256 (OpenSSL) over
// length-prefixed fields, printed as 64 hex digits. The length prefix makes
// the fields unambiguous: ("ab", "c") and ("a", "bc") differ whatever bytes
// the fields hold.
#pragma once

#include <memory>
#include <string>
#include <string_view>

namespace loom {

class ContentHash {
 public:
  ContentHash();
  ~ContentHash();
  ContentHash(const ContentHash& other);
  ContentHash& operator=(const ContentHash&) = delete;

  // Adds one field: its length (8 bytes, little-endian), then its bytes.
  ContentHash& add(std::string_view bytes);
  // The digest of the fields so far (the hash may take more fields after).
  std::string hex() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// SHA-256 of `bytes` as they are (no length prefix), 64 hex digits.
std::string sha256Hex(std::string_view bytes);

}  // namespace loom
