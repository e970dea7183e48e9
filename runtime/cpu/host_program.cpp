#include "cpu/host_program.h"

#include <dlfcn.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>

#include "loom/cache_dir.h"
#include "loom/hash.h"
#include "loom/tile_headers.h"
#include "loom/counters.h"

namespace loom::cpu {
namespace fs = std::filesystem;
namespace {

// The headers a program compiles against, and their hash.
std::map<std::string, std::string> headerSet(const HostProgram& program, std::string* hash) {
  std::map<std::string, std::string> headers;
  for (const tile::EmbeddedFile& file : tile::embeddedHeaders()) headers[file.path] = file.text;
  for (const auto& [path, text] : program.headerOverrides) headers[path] = text;
  if (program.headerOverrides.empty()) {
    *hash = tile::embeddedHeadersHash();
  } else {
    ContentHash h;
    for (const auto& [path, text] : headers) h.add(path).add(text);
    *hash = h.hex();
  }
  return headers;
}

// The headers laid out once per header set.
Result<fs::path> materializeHeaders(const fs::path& cacheDir, const std::map<std::string, std::string>& headers,
                                    const std::string& hash) {
  const fs::path root = cacheDir / "include" / hash;
  for (const auto& [name, text] : headers) {
    const fs::path path = root / name;
    if (fs::exists(path)) continue;
    std::error_code ec;
    fs::create_directories(path.parent_path(), ec);
    if (ec) return makeError(path.parent_path().string() + ": " + ec.message());
    if (Status ok = writeFileAtomically(path, text); !ok) return ok.error();
  }
  return root;
}

}  // namespace

void setDenseStrides(IhaArgs& args, int64_t tokens, int64_t heads, int64_t kvHeads, int64_t headDim) {
  auto dense = [&](int64_t* stride, int64_t rowHeads) {
    stride[0] = tokens * rowHeads * headDim;
    stride[1] = rowHeads * headDim;
    stride[2] = headDim;
  };
  dense(args.q_stride, heads);
  dense(args.k_stride, kvHeads);
  dense(args.v_stride, kvHeads);
  dense(args.out_stride, heads);
}

std::string compilerFrom(const char* variable, const std::string& fallback) {
  const char* value = std::getenv(variable);
  return value && *value ? value : fallback;
}

Result<CompiledProgram> compileHostProgram(const HostProgram& program, const fs::path& cacheDir) {
  std::string headerHash;
  const std::map<std::string, std::string> headers = headerSet(program, &headerHash);
  const std::string key =
      ContentHash().add(program.source).add(program.compiler).add(program.flags).add(headerHash).hex();
  CompiledProgram result;
  const fs::path folder = cacheDir / program.kind;
  result.object = folder / (key + ".so");
  if (fs::exists(result.object)) {
    count(Counter::store_reads);
    return result;
  }
  count(Counter::programs_compiled);

  auto root = materializeHeaders(cacheDir, headers, headerHash);
  if (!root) return root.error();
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) return makeError(folder.string() + ": " + ec.message());
  const fs::path source = folder / (key + ".cpp");
  if (Status ok = writeFileAtomically(source, program.source); !ok) return ok.error();

  // Build beside the final name, then rename: a crash never leaves a
  // half-written object under the key.
  const fs::path temporary = temporaryBeside(result.object.string());
  const fs::path log = folder / (key + ".log");
  const std::string command = program.compiler + " " + program.flags + " -I'" + root->string() + "' '" +
                              source.string() + "' -o '" + temporary.string() + "' > '" + log.string() + "' 2>&1";
  const auto start = std::chrono::steady_clock::now();
  const int status = std::system(command.c_str());
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (status != 0) {
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    return makeError("the C++ compiler rejected the generated program (" + source.string() + ")", text.str());
  }
  fs::rename(temporary, result.object, ec);
  if (ec) return makeError(result.object.string() + ": " + ec.message());
  result.compiled = true;
  return result;
}

Result<void*> loadHostProgram(const fs::path& object) {
  static std::mutex mutex;
  static std::map<std::string, void*> loaded;
  std::lock_guard lock(mutex);
  if (auto found = loaded.find(object.string()); found != loaded.end()) return found->second;
  void* handle = ::dlopen(object.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) return makeError(object.string() + ": dlopen failed: " + ::dlerror());
  count(Counter::modules_loaded);
  loaded[object.string()] = handle;
  return handle;
}

}  // namespace loom::cpu
