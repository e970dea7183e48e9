// Keys of the kernel cache: content addresses and device models.
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <cmath>
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

namespace {

int64_t powerOfTwoAtLeast(int64_t value, int64_t least) {
  int64_t power = least;
  while (power < value && power < (int64_t(1) << 40)) power *= 2;
  return power;
}

}  // namespace

std::string shapeBucket(v1::Direction direction, int64_t batch, int64_t tokens) {
  if (direction == v1::direction_decode || direction == v1::direction_decode_mixed)
    return "c" + std::to_string(powerOfTwoAtLeast(tokens, 16)) + ".b" + std::to_string(powerOfTwoAtLeast(batch, 1));
  return "n" + std::to_string(powerOfTwoAtLeast(tokens, 16));
}

Result<BucketShape> parseShapeBucket(const std::string& bucket) {
  auto bad = [&] {
    return makeError("shape bucket '" + bucket + "': want n<tokens> (a forward or backward) or c<cache>.b<batch> (a "
                     "decode step), positive integers");
  };
  auto number = [](const std::string& text, int64_t* value) {
    if (text.empty() || text.size() > 15 || text.find_first_not_of("0123456789") != std::string::npos) return false;
    *value = std::stoll(text);
    return *value > 0;
  };
  BucketShape shape;
  if (bucket.size() > 1 && bucket[0] == 'n') {
    if (!number(bucket.substr(1), &shape.tokens)) return bad();
    return shape;
  }
  const size_t dot = bucket.find(".b");
  if (bucket.size() > 1 && bucket[0] == 'c' && dot != std::string::npos && number(bucket.substr(1, dot - 1), &shape.tokens) &&
      number(bucket.substr(dot + 2), &shape.batch))
    return shape;
  return bad();
}

double bucketDistance(const BucketShape& a, const BucketShape& b) {
  return std::abs(std::log2(double(a.tokens) / double(b.tokens))) + std::abs(std::log2(double(a.batch) / double(b.batch)));
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
