// NVRTC: generated CUDA programs to cubin (or PTX for an arch NVRTC cannot
// assemble), with ptxas's resource report kept beside the binary. Compiled
// artifacts are cached in memory and on disk under a key that hashes
// everything that changes the binary: source, options, arch, NVRTC version
// and the tile headers. Compiles of different programs run in parallel.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "loom/result.h"
#include "loom/v1/loom.pb.h"

namespace loom::jit {

// Fast-math choices, stated: approximate exp2 and division are used by the
// tile code explicitly where it wants them; the compiler flag stays off so
// no other arithmetic changes behind the code's back.
inline constexpr const char* kNvrtcOptions = "-std=c++17 --ptxas-options=-v -default-device";

struct Artifact {
  std::string arch;         // "sm_90a"
  std::string binaryKind;   // "cubin" or "ptx"
  std::string binary;       // cubin bytes, or PTX text
  std::string ptx;          // always kept: the instructions tests look for
  std::string log;          // NVRTC's program log (ptxas report included)
  std::vector<v1::ResourceUsage> resources;
  double compileSeconds = 0;
  bool fromCache = false;
  std::string key;

  bool usesTensorCores() const;  // mma.sync / wgmma in the PTX
  bool usesAsyncCopies() const;  // cp.async in the PTX
  // The sm_90a path's instructions in the PTX.
  bool usesWgmma() const;        // wgmma.mma_async
  bool usesTma() const;          // cp.async.bulk.tensor
  bool usesSetmaxnreg() const;   // setmaxnreg
  // The log's warnings and ptxas's C7xxx notes (it says there when it
  // serialises wgmma or ignores setmaxnreg), as printed.
  std::vector<std::string> warnings() const;
  // What costs this kernel speed, one line each: spills, stack frames,
  // ptxas's performance notes, fp64 and local memory (performanceLosses).
  std::vector<std::string> performanceLosses() const;
  int64_t spillBytes() const;    // spill stores + loads over all entries
};

// "nvrtc-13.0"
std::string nvrtcVersion();

// Whether every compile for `arch` reads its SASS into the resources'
// loops (sass.h): sm_90a, whose wgmma loops the SASS gates and the cost
// model read. Other archs' are read on demand (sass::readLoops).
bool readsSassOnCompile(const std::string& arch);

// The artifact's resources with the SASS figures (sass.h) of every entry:
// as the compile read them, or read now (any arch). An error when there is
// no nvdisasm or it fails.
Result<std::vector<v1::ResourceUsage>> resourcesWithSass(const Artifact& artifact);

// Whether NVRTC can produce a cubin for `arch` (else PTX for its compute arch).
bool nvrtcKnowsArch(const std::string& arch);

// Parses ptxas's -v report (one entry per compiled function: registers,
// spills, stack frame, shared memory, its C7xxx performance notes) and
// reads each entry's PTX for fp64 and local-memory instructions.
std::vector<v1::ResourceUsage> parsePtxasReport(const std::string& log, const std::string& ptx = "");

// ptxas's register count of `entry` among `resources`; 0 when it is absent.
int registersOf(const std::vector<v1::ResourceUsage>& resources, std::string_view entry);

// One line per performance loss of the entries: spill bytes, a stack frame,
// each ptxas note, fp64 instructions, local memory. Empty: nothing ptxas or
// the PTX shows costs speed.
std::vector<std::string> performanceLosses(const std::vector<v1::ResourceUsage>& resources);

class NvrtcCompiler {
 public:
  // `cacheDir` empty: memory cache only.
  explicit NvrtcCompiler(std::string cacheDir);

  // Compiles `source` for `arch`; a failure carries NVRTC's log. Safe to call
  // from several threads; identical requests share one artifact.
  Result<std::shared_ptr<const Artifact>> compile(const std::string& source, const std::string& arch);

 private:
  Result<std::shared_ptr<const Artifact>> compileUncached(const std::string& source, const std::string& arch,
                                                          const std::string& key);
  std::shared_ptr<const Artifact> readDisk(const std::string& key);
  void writeDisk(const Artifact& artifact);

  std::string cacheDir_;
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<const Artifact>> memory_;
};

}  // namespace loom::jit
