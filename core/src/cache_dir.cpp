#include "loom/cache_dir.h"

#include <cstdlib>
#include <filesystem>

namespace loom {

std::string defaultCacheDir() {
  if (const char* dir = std::getenv("LOOM_CACHE_DIR"); dir && *dir) return dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::string(xdg) + "/loom";
  if (const char* home = std::getenv("HOME"); home && *home) return std::string(home) + "/.cache/loom";
  return (std::filesystem::temp_directory_path() / "loom-cache").string();
}

}  // namespace loom
