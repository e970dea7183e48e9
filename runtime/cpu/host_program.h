// Generated programs compiled for the host: the CPU backend (host tile API,
// system C++ compiler) and the emulator (CUDA tiles, clang with memory-access
// hooks) both turn a plan's source into a shared object this way. Objects
// are cached by a hash of everything that changes them (source, compiler,
// flags, the tile headers), built beside their final name and renamed, so a
// crash never leaves a broken entry, and loaded once per process.
#pragma once

#include <filesystem>
#include <map>
#include <string>

#include "loom/result.h"
#include "loom/tile/common.h"

namespace loom::cpu {

struct HostProgram {
  std::string source;
  std::string compiler;  // a command: "c++", "clang++-19"
  std::string flags;     // before -I and the source
  // The tile headers by include path; empty: the embedded ones. Headers
  // named here replace the embedded ones of the same path (tests put faults
  // into copies of the device code this way).
  std::map<std::string, std::string> headerOverrides;
  std::string kind = "cpu";  // the cache subfolder
};

struct CompiledProgram {
  std::filesystem::path object;
  bool compiled = false;  // false: found in the cache
  double seconds = 0;
};

// Compiles `program` (or finds it) under `cacheDir`; a compiler failure
// carries the compiler's output.
Result<CompiledProgram> compileHostProgram(const HostProgram& program, const std::filesystem::path& cacheDir);

// dlopen's an object once per process (handles stay open).
Result<void*> loadHostProgram(const std::filesystem::path& object);

// q, k, v and out of a host run are dense [B][N][heads][d]: their strides in
// `args` (token-major, as loom's tensors are).
void setDenseStrides(IhaArgs& args, int64_t tokens, int64_t heads, int64_t kvHeads, int64_t headDim);

// The compiler a variable names (LOOM_EMU_CXX, CXX), else `fallback`.
std::string compilerFrom(const char* variable, const std::string& fallback);

}  // namespace loom::cpu
