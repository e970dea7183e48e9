// The compiler's front door: a KernelSpec + Schedule + Target in, a kernel
// plan out (C++ source through the iha pipeline and EmitC, plus how to
// launch each entry point). The CLI, the runtime and the service call this.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loom/decode.h"
#include "loom/result.h"
#include "loom/spec.h"

namespace loom {

// The attention launch's entry point (its resources are what the tuner and
// the reports look at; the pre-mix and collapse launches are small).
inline constexpr char kAttentionEntry[] = "iha_attention";
// The pre-mix launch of a plan with the mixing materialised.
inline constexpr char kPremixEntry[] = "iha_premix";

// A decode plan's first launch: the step's new tokens' k and v into the
// paged cache (its attention reads them back from there).
inline constexpr char kDecodeAppendEntry[] = "iha_append";
// A decode plan with kv_splits > 1: the split CTAs' partial rows merged,
// before the collapse.
inline constexpr char kDecodeCombineEntry[] = "iha_combine";

// A backward plan's entry points, in launch order after the pre-mix and the
// forward's attention (recomputing the pseudo outputs and lse):
inline constexpr char kBackwardPrepEntry[] = "iha_bwd_prep";      // do, D, dcollapse partials
inline constexpr char kBackwardKvEntry[] = "iha_bwd_kv";          // key-block-outer: dK, dV (and dq, atomic)
inline constexpr char kBackwardQEntry[] = "iha_bwd_q";            // query-block-outer: dq (dq separate)
inline constexpr char kBackwardUnmixEntry[] = "iha_bwd_unmix";    // RoPE, qk_norm, mixing transposed
inline constexpr char kBackwardReduceEntry[] = "iha_bwd_reduce";  // dalpha_*, dcollapse from the partials

// The reduce launch's CTA covers the whole sequence (grid x is 1), and its
// grid y splits the partial sums' entries into chunks (loom/tile/layout.h's
// kReduceChunk).
inline constexpr int64_t kWholeSequenceRows = int64_t(1) << 30;

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
  // Warp-specialised: the CTAs an SM its register bounds assume (setmaxnreg
  // moves registers within the CTA's share of the file; layout.h).
  int ctasPerSm = 1;
};

// Float workspaces a plan needs between launches (see loom/tile/common.h).
// The backward's: do_pseudo [B, H, L, d] (the dtype on CUDA), delta [2, B, H, L]
// (lse in log2 units, then D; loom/tile/layout.h, rowStatsStride), dq_pseudo
// [B, H, L, d], dk_pseudo and dv_pseudo [B, G, L, d], and partials
// [B * token CTAs][partialEntries] (all float).
// splits: a decode plan's split partial rows [B, H, kv_splits, T * P, d + 1]
// (float, lse last).
enum class Workspace {
  q_mixed, k_mixed, v_mixed, o_pseudo, do_pseudo, delta, dq_pseudo, dk_pseudo, dv_pseudo, partials, splits
};

// Which function a plan computes (the schema's v1::Direction).
// decode: one step over a paged cache (docs/IHA.md, Decode over a paged cache).
enum class Direction { forward, backward, decode };
// The schema tells the two caches' decode kernels apart (loom/decode.h:
// isDecode, mixedCacheOf); a plan says decode and its mixedCache.
inline Direction directionOf(v1::Direction direction) {
  return direction == v1::direction_backward ? Direction::backward
         : isDecode(direction)               ? Direction::decode
                                             : Direction::forward;
}
inline v1::Direction directionOf(Direction direction, bool mixedCache = false) {
  return direction == Direction::backward ? v1::direction_backward
         : direction == Direction::decode ? decodeDirectionOf(mixedCache ? CacheLayout::mixed : CacheLayout::raw)
                                          : v1::direction_forward;
}

struct KernelPlan {
  Direction direction = Direction::forward;
  KernelSpec spec;
  Schedule schedule;  // complete: every field set
  v1::Target target;
  std::string source;
  std::string sourceHash;
  std::vector<LaunchPlan> launches;  // in launch order
  std::vector<Workspace> workspaces;
  int workspaceElementBytes = 4;  // float on the host, the 16-bit dtype on CUDA
  // A decode plan's cache: mixed pseudo-keys and values [pages, S, G, P, d],
  // or (false) the raw k and v [pages, S, G, d].
  bool mixedCache = false;
};

struct GenerateOptions {
  // When set, the IR after every pass is appended here (--print-ir-after-all).
  std::string* irLog = nullptr;
  // backward: the gradients of sum(out * dout) (docs/IHA.md, Backward);
  // decode: a step over a paged cache, whose layout `mixedCache` picks.
  Direction direction = Direction::forward;
  bool mixedCache = false;
};

// The tile implementation a target's source includes.
std::string tileHeaderFor(const v1::Target& target, const Schedule& schedule, Direction direction);

// Generates the program. Invalid spec or schedule combinations fail with the
// compiler's diagnostic, which names the field.
Result<KernelPlan> generateKernel(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                                  const GenerateOptions& options = {});

// The schedule with every unset field defaulted, checked against the spec
// and (for CUDA) the target's shared memory; the error names the field. A
// decode step's over a mixed cache with `mixedCache`.
Result<Schedule> resolveSchedule(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                                 Direction direction = Direction::forward, bool mixedCache = false);

// CUDA archs loom generates for: sm_80 and later ("sm_90a" for wgmma).
inline constexpr int kMinimumCudaArch = 80;
Status checkCudaArch(const std::string& arch);

// Parses "cpu", "sm_80", "sm_90a", ... into a Target.
Result<v1::Target> parseTarget(const std::string& name);

std::string workspaceName(Workspace workspace);

// Elements of a workspace for B = `batch`, N = `tokens`: [B][heads][N * P][d]
// with the query heads (q_mixed, o_pseudo) or the key/value heads.
int64_t workspaceElements(const KernelSpec& spec, Workspace workspace, int64_t batch, int64_t tokens);
// Every workspace of a plan, the partial sums too (their count depends on
// the plan's token CTAs).
int64_t workspaceElements(const KernelPlan& plan, Workspace workspace, int64_t batch, int64_t tokens);

// Bytes per element of a workspace: the 16-bit dtype on CUDA for the tiles
// the tensor cores read (q_mixed, k_mixed, v_mixed, o_pseudo, do_pseudo),
// float everywhere else and on the host.
int workspaceElementBytes(const KernelPlan& plan, Workspace workspace);

// What a forward keeps for its backward (docs/compiler.md, The backward):
// the mixed rows and the pseudo outputs, each workspace's bytes in the
// plan's element type (workspaceElementBytes), and lse [B, H, L]. A forward
// plan keeps them when its mixing is materialised and its collapse
// separate; a backward given them skips its pre-mix and attention launches,
// which would compute exactly these.
inline constexpr Workspace kKeptWorkspaces[] = {Workspace::q_mixed, Workspace::k_mixed, Workspace::v_mixed,
                                                Workspace::o_pseudo};
struct KeptForward {
  std::map<Workspace, std::vector<uint8_t>> rows;
  std::vector<float> lse;
};
// Whether the forward plan writes everything a KeptForward holds; else why not.
Status canKeepForward(const KernelPlan& forward);
// Whether `kept` fits the backward plan's workspaces and lse for B x N; else
// which part does not.
Status checkKeptFits(const KeptForward& kept, const KernelPlan& backward, int64_t batch, int64_t tokens);
// The launches of a backward plan a KeptForward replaces (the pre-mix and the attention).
bool recomputesForward(const LaunchPlan& launch);

// Entries of one CTA's partial sums in a backward plan: dcollapse, then
// dalpha_q, dalpha_k, dalpha_v (the layout loom/tile/host.h's backward uses).
int64_t partialEntries(const KernelSpec& spec);

// The plan as the schema's CompiledKernel (no binary yet).
v1::CompiledKernel toCompiledKernel(const KernelPlan& plan);

// Dynamic shared memory a CUDA arch gives one block (with opt-in), used
// when the target carries no device properties.
int64_t defaultSharedMemoryPerBlock(const std::string& arch);

// The SMs of the target's device, or of its arch's largest part (H100 and
// H200 132, A100 108; 84 for the sm_86 / sm_89 class): the decode step's
// default kv_splits and the cost model's device take them.
int64_t smCountOf(const v1::Target& target);

// The shared memory of one SM of the target's device, or of its arch's
// (228 KiB on sm_90, 164 KiB on sm_80, 100 KiB for the sm_86 / sm_89
// class): the CTAs an SM holds at once, for the decode step's default
// kv_splits and the cost model's device.
int64_t sharedMemoryPerSmOf(const v1::Target& target);

}  // namespace loom
