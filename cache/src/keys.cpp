// Keys of the kernel cache: content addresses and device models.
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

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

std::string artifactKey(const v1::CompiledKernel& kernel) {
  return ContentHash()
      .add(kernel.source())
      .add(kernel.compile_options())
      .add(kernel.target().arch())
      .add(kernel.toolchain())
      .add(tile::embeddedHeadersHash())
      .add(kGeneratorVersion)
      .hex();
}

std::string specKey(const KernelSpec& spec) {
  std::string bytes;
  google::protobuf::io::StringOutputStream stream(&bytes);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  spec.SerializeToCodedStream(&coded);
  coded.Trim();
  return ContentHash().add(bytes).hex();
}

std::string storePath(const std::string& cacheDir) { return cacheDir + "/kernels.sqlite"; }

std::string defaultStorePath() { return storePath(defaultCacheDir()); }

}  // namespace loom::cache
