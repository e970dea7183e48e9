// Keys of the kernel cache: content addresses and device models.
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <cstdio>

#include "loom/cache.h"
#include "loom/cache_dir.h"
#include "loom/hash.h"
#include "loom/tile_headers.h"

namespace loom::cache {

std::string DeviceModel::key() const { return name + "|" + arch + "|" + std::to_string(smCount); }
std::string DeviceModel::classKey() const { return arch + "|" + std::to_string(smCount); }

DeviceModel DeviceModel::of(const v1::Target& target) {
  DeviceModel model;
  model.name = target.device().name().empty() ? target.arch() : target.device().name();
  model.arch = target.arch();
  model.smCount = target.device().sm_count();
  return model;
}

namespace {

std::string deterministicBytes(const KernelSpec& spec) {
  std::string bytes;
  google::protobuf::io::StringOutputStream stream(&bytes);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  spec.SerializeToCodedStream(&coded);
  coded.Trim();
  return bytes;
}

class Fnv {
 public:
  Fnv& add(std::string_view bytes) {
    for (unsigned char c : bytes) state_ = (state_ ^ c) * kPrime;
    state_ = (state_ ^ 0xff) * kPrime;
    return *this;
  }
  std::string hex() const {
    char text[17];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(state_));
    return text;
  }

 private:
  static constexpr uint64_t kPrime = 0x100000001b3ull;
  uint64_t state_ = 0xcbf29ce484222325ull;
};

// Every input that changes a binary, in one order, for either hash.
template <class Hash>
std::string addressOf(const v1::CompiledKernel& kernel, const std::string& headersHash) {
  Hash hash;
  hash.add(kernel.source())
      .add(kernel.compile_options())
      .add(kernel.target().arch())
      .add(kernel.toolchain())
      .add(headersHash)
      .add(kGeneratorVersion);
  // A backward kernel's source differs anyway; its direction is named too
  // (forward keys are unchanged from before there was a backward).
  if (kernel.direction() == v1::direction_backward) hash.add("backward");
  return hash.hex();
}

template <class Hash>
std::string headersHashOf() {
  Hash hash;
  for (const tile::EmbeddedFile& file : tile::embeddedHeaders()) hash.add(file.path).add(file.text);
  return hash.hex();
}

}  // namespace

std::string artifactKey(const v1::CompiledKernel& kernel) {
  return addressOf<ContentHash>(kernel, tile::embeddedHeadersHash());
}

std::string specKey(const KernelSpec& spec) { return ContentHash().add(deterministicBytes(spec)).hex(); }

std::string decisionSpecKey(const KernelSpec& spec, v1::Direction direction) {
  switch (direction) {
    case v1::direction_backward: return specKey(spec) + ".backward";
    case v1::direction_decode: return specKey(spec) + ".decode";
    case v1::direction_decode_mixed: return specKey(spec) + ".decode_mixed";
    default: return specKey(spec);
  }
}

namespace schema3 {

std::string checksumOf(const std::string& blob) { return Fnv().add(blob).hex(); }

std::string artifactKey(const v1::CompiledKernel& kernel) {
  static const std::string headers = headersHashOf<Fnv>();  // once, not per record migrated
  return addressOf<Fnv>(kernel, headers);
}

std::string specKey(const KernelSpec& spec) { return Fnv().add(deterministicBytes(spec)).hex(); }

}  // namespace schema3

std::string storePath(const std::string& cacheDir) { return cacheDir + "/kernels.sqlite"; }

std::string defaultStorePath() { return storePath(defaultCacheDir()); }

}  // namespace loom::cache
