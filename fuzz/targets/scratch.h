// A scratch folder per fuzzer process, for the surfaces that read files.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace loom::fuzz {

inline const std::filesystem::path& scratch() {
  static const std::filesystem::path dir = [] {
    auto path = std::filesystem::temp_directory_path() / ("loom-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
    return path;
  }();
  return dir;
}

inline std::string writeFile(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = (scratch() / name).string();
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data), std::streamsize(size));
  return path;
}

}  // namespace loom::fuzz
