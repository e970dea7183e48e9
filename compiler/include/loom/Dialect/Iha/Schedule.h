// Rules that tie a Schedule to a Spec, shared by the op verifier, the
// iha-apply-schedule pass, and (later) the autotuner's search space.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "loom/Dialect/Iha/IhaDialect.h"
#include "loom/tile/layout.h"

namespace loom::iha {

// The tile API's limits (tile/): the GPU side splits a query block
// into warps of kMmaRows rows and steps key blocks by kMmaRows too.
inline constexpr int64_t kMmaRows = 16;
inline constexpr int64_t kHeadDimQuantum = 8;
inline constexpr int64_t kMaxHeadDim = 256;
inline constexpr int64_t kMaxBlockRows = 256;
inline constexpr int64_t kMaxStages = 4;
inline constexpr int64_t kDefaultStages = 2;  // the mma engine's, and a decode step's
inline constexpr int64_t kThreadsPerWarp = 32;

// The wgmma engine (sm_90a): 64 query rows per consumer warpgroup, one
// producer warpgroup, registers moved between them by setmaxnreg.
inline constexpr int64_t kWarpgroupWarps = 4;
inline constexpr int64_t kWarpgroupRows = 64;
inline constexpr int64_t kMinWgmmaStages = 2;  // a consumer returns a stage only after the next block's softmax
inline constexpr int64_t kMinWarpgroupRegisters = 24;
inline constexpr int64_t kMaxWarpgroupRegisters = 256;
inline constexpr int64_t kMaxWarps = 3 * kWarpgroupWarps;  // three consumer warpgroups
inline constexpr int64_t kMaxKvSplits = 512;                 // CTAs splitting a decode step's key blocks

struct ScheduleFields {
  int64_t blockM = 0, blockN = 0, warps = 0, stages = 0;
  std::optional<MixStrategy> mix;
  std::optional<CollapseStrategy> collapse;
  std::optional<Engine> engine;
  int64_t producerRegisters = 0;
  std::optional<DqStrategy> dq;
  int64_t kvSplits = 0;
  bool stackHeads = false;
  bool absorbMixing = false;
  bool tensorMixing = false;
};

// Registers per consumer thread: loom::consumerRegisters (loom/tile/layout.h).

// Why the given fields cannot be completed, naming the field: each must be
// 0 (the default) or inside the widest range any engine takes, so no
// default is derived from a value no schedule may have. Run before
// completeSchedule; checkSchedule then checks the completed schedule.
std::optional<std::string> checkScheduleFields(const ScheduleFields& given);

// Fills every unset field with the default for this spec. The mma engine:
// the largest warp count in {4, 2, 1} whose block_m = lcm(P, 16 * warps)
// stays within 128 rows (at least 64), the largest block_n in {64, 32, 16}
// whose fragments fit a register budget, two stages, fused mixing, and the
// collapse in the epilogue for per_head or in a separate launch for global.
// `hopper` (target sm_90a) makes wgmma the default engine where the spec
// and the given fields allow it (head_dim a multiple of 64, P dividing 128,
// 64 or 192): two consumer warpgroups (block_m 128), else one or three,
// block_n 128 (64 for head_dim > 128), three stages where they fit in
// shared memory (else two), materialised mixing fed by TMA, producer
// registers 24 (56 when the producer mixes on chip, 72 when it also applies
// qk_norm).
ScheduleAttr completeSchedule(SpecAttr spec, const ScheduleFields& given, bool hopper = false);

// The query heads a CTA of the one-CTA decode steps holds (loom::oneCtaHeads):
// tensor mixing's up to 16, the absorbed step's up to absorbedMostHeads.
inline int64_t oneCtaStepHeads(int64_t heads, int64_t kvHeads, int64_t pseudoHeads, int64_t headDim, bool tensor) {
  return loom::oneCtaHeads(tensor, int(heads), int(kvHeads), int(pseudoHeads), int(headDim));
}
inline int64_t oneCtaStepHeads(SpecAttr spec, ScheduleAttr schedule) {
  return oneCtaStepHeads(spec.getHeads(), spec.getKvHeads(), spec.getPseudoHeads(), spec.getHeadDim(),
                         schedule.getTensorMixing());
}

// A decode step's fields before completeSchedule: the mixing its cache
// fixes (fused over a raw cache, which it mixes as each block streams;
// materialized over a mixed one, read as stored), the mma engine where
// none is given, over a raw cache key blocks of 16 where block_n is unset,
// and with stack_heads a block_m holding a token of every stacked head
// (`stackRows`, H / G * P) where block_m is unset. The caller refuses a
// contrary mix or wgmma first.
// With absorb_mixing: key blocks of kAbsorbedTokens tokens, block_m the
// smallest power-of-two count of 16-row m-tiles holding a token of every
// head of a CTA (`ctaHeads` * `pseudoHeads` rows; ctaHeads is
// loom::stepHeads, every head up to 16), two warps an m-tile where its S
// rows split (loom::absorbedSplit), the collapse separate; with
// tensor_mixing the block and warps of ctaHeads heads, key blocks of
// mixingTokens tokens (loom::kTensorMixingTokens).
void completeDecodeFields(ScheduleFields& fields, bool mixedCache, int64_t stackRows, int64_t ctaHeads,
                          int64_t pseudoHeads, int64_t headDim, int64_t mixingTokens);

// Why a complete schedule cannot compute a backward kernel, naming the
// field: the backward reads the mixed rows from workspaces (mix
// materialized) and needs the pseudo outputs (collapse separate); on wgmma
// its key-block-outer launch takes whole warpgroups of 64 key rows and dq
// has its own launch.
std::optional<std::string> checkBackwardSchedule(ScheduleAttr schedule);
// A backward kernel's schedule whole: its forward launches (on mma.sync,
// whatever the engine: a backward's engine is its key-block-outer
// launch's) by checkSchedule, then checkBackwardSchedule.
std::optional<std::string> checkBackwardKernelSchedule(SpecAttr spec, ScheduleAttr schedule);

// Why `schedule` cannot compute `spec`, naming the field; nullopt when fine.
std::optional<std::string> checkSchedule(SpecAttr spec, ScheduleAttr schedule);

}  // namespace loom::iha
