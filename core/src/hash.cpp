#include "loom/hash.h"

#include <openssl/evp.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>

namespace loom {
namespace {

EVP_MD_CTX* newSha256() {
  EVP_MD_CTX* context = EVP_MD_CTX_new();
  if (!context || EVP_DigestInit_ex(context, EVP_sha256(), nullptr) != 1)
    throw std::runtime_error("OpenSSL: cannot start a SHA-256 digest");
  return context;
}

std::string hexDigest(EVP_MD_CTX* context) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (EVP_DigestFinal_ex(context, digest, &size) != 1) throw std::runtime_error("OpenSSL: SHA-256 failed");
  std::string text(size * 2, '0');
  static constexpr char kDigits[] = "0123456789abcdef";
  for (unsigned int i = 0; i < size; ++i) {
    text[2 * i] = kDigits[digest[i] >> 4];
    text[2 * i + 1] = kDigits[digest[i] & 15];
  }
  return text;
}

}  // namespace

struct ContentHash::State {
  EVP_MD_CTX* context;
  ~State() { EVP_MD_CTX_free(context); }
};

ContentHash::ContentHash() : state_(new State{newSha256()}) {}
ContentHash::~ContentHash() = default;
ContentHash::ContentHash(const ContentHash& other) : state_(new State{EVP_MD_CTX_new()}) {
  if (!state_->context || EVP_MD_CTX_copy_ex(state_->context, other.state_->context) != 1)
    throw std::runtime_error("OpenSSL: cannot copy a SHA-256 digest");
}

ContentHash& ContentHash::add(std::string_view bytes) {
  unsigned char length[8];
  const uint64_t size = bytes.size();
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(size >> (8 * i));
  EVP_DigestUpdate(state_->context, length, sizeof length);
  EVP_DigestUpdate(state_->context, bytes.data(), bytes.size());
  return *this;
}

std::string ContentHash::hex() const {
  ContentHash copy(*this);
  return hexDigest(copy.state_->context);
}

std::string sha256Hex(std::string_view bytes) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(newSha256(), EVP_MD_CTX_free);
  EVP_DigestUpdate(context.get(), bytes.data(), bytes.size());
  return hexDigest(context.get());
}

}  // namespace loom
