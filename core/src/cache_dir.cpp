#include "loom/cache_dir.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace loom {

std::string defaultCacheDir() {
  if (const char* dir = std::getenv("LOOM_CACHE_DIR"); dir && *dir) return dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::string(xdg) + "/loom";
  if (const char* home = std::getenv("HOME"); home && *home) return std::string(home) + "/.cache/loom";
  return (std::filesystem::temp_directory_path() / "loom-cache").string();
}

std::string temporaryBeside(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return path + ".tmp" + std::to_string(::getpid()) + "." + std::to_string(counter++);
}

Status writeFileAtomically(const std::string& path, const std::string& bytes) {
  const std::string temporary = temporaryBeside(path);
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out << bytes;
    if (!out) return makeError(temporary + ": write failed");
  }
  std::error_code ec;
  std::filesystem::rename(temporary, path, ec);
  if (ec) {
    std::filesystem::remove(temporary, ec);
    return makeError(path + ": " + ec.message());
  }
  return Status::success();
}

}  // namespace loom
