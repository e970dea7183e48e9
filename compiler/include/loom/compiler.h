// The compiler's front door: a KernelSpec + Schedule + Target in, a kernel
// plan out (C++ source through the iha pipeline and EmitC, plus how to
// launch each entry point). The CLI, the runtime and the service call this.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/result.h"
#include "loom/spec.h"

namespace loom {

// The attention launch's entry point (its resources are what the tuner and
// the reports look at; the pre-mix and collapse launches are small).
inline constexpr char kAttentionEntry[] = "iha_attention";

// One entry point. Its grid is (ceil(N * rows_per_token / rows_per_cta),
// grid_y, B) with `threads` threads per CTA.
struct LaunchPlan {
  std::string name;
  int64_t rowsPerToken = 1;
  int64_t rowsPerCta = 1;
  int64_t gridY = 1;
  int64_t threads = 32;
  int64_t sharedMemoryBytes = 0;  // dynamic shared memory (CUDA targets)
  bool warpSpecialized = false;   // producer warpgroup + consumer warpgroups (engine wgmma)
  bool tensorMaps = false;        // takes loom::TmaMaps after IhaArgs (CUDA, engine wgmma)
};

// Float workspaces a plan needs between launches (see loom/tile/common.h).
enum class Workspace { q_mixed, k_mixed, v_mixed, o_pseudo };

struct KernelPlan {
  KernelSpec spec;
  Schedule schedule;  // complete: every field set
  v1::Target target;
  std::string source;
  std::string sourceHash;
  std::vector<LaunchPlan> launches;  // in launch order
  std::vector<Workspace> workspaces;
  int workspaceElementBytes = 4;  // float on the host, the 16-bit dtype on CUDA
};

struct GenerateOptions {
  // When set, the IR after every pass is appended here (--print-ir-after-all).
  std::string* irLog = nullptr;
};

// The tile implementation a target's source includes.
std::string tileHeaderFor(const v1::Target& target, const Schedule& schedule);

// Generates the program. Invalid spec or schedule combinations fail with the
// compiler's diagnostic, which names the field.
Result<KernelPlan> generateKernel(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                                  const GenerateOptions& options = {});

// The schedule with every unset field defaulted, checked against the spec
// and (for CUDA) the target's shared memory; the error names the field.
Result<Schedule> resolveSchedule(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target);

// CUDA archs loom generates for: sm_80 and later ("sm_90a" for wgmma).
inline constexpr int kMinimumCudaArch = 80;
Status checkCudaArch(const std::string& arch);

// Parses "cpu", "sm_80", "sm_90a", ... into a Target.
Result<v1::Target> parseTarget(const std::string& name);

std::string workspaceName(Workspace workspace);

// Elements of a workspace for B = `batch`, N = `tokens`: [B][heads][N * P][d]
// with the query heads (q_mixed, o_pseudo) or the key/value heads.
int64_t workspaceElements(const KernelSpec& spec, Workspace workspace, int64_t batch, int64_t tokens);

// The plan as the schema's CompiledKernel (no binary yet).
v1::CompiledKernel toCompiledKernel(const KernelPlan& plan);

// Dynamic shared memory a CUDA arch gives one block (with opt-in), used
// when the target carries no device properties.
int64_t defaultSharedMemoryPerBlock(const std::string& arch);

}  // namespace loom
