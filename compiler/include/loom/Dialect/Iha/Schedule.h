// Rules that tie a Schedule to a Spec, shared by the op verifier, the
// iha-apply-schedule pass, and (later) the autotuner's search space.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "loom/Dialect/Iha/IhaDialect.h"

namespace loom::iha {

// The tile API's limits (runtime/tile): the GPU side splits a query block
// into warps of kMmaRows rows and steps key blocks by kMmaRows too.
inline constexpr int64_t kMmaRows = 16;
inline constexpr int64_t kHeadDimQuantum = 8;
inline constexpr int64_t kMaxHeadDim = 256;
inline constexpr int64_t kMaxBlockRows = 256;
inline constexpr int64_t kMaxStages = 4;
inline constexpr int64_t kThreadsPerWarp = 32;

struct ScheduleFields {
  int64_t blockM = 0, blockN = 0, warps = 0, stages = 0;
  std::optional<MixStrategy> mix;
  std::optional<CollapseStrategy> collapse;
};

// Fills every unset field with the default for this spec: the largest warp
// count in {4, 2, 1} whose block_m = lcm(P, 16 * warps) stays within 128
// rows (at least 64), the largest block_n in {64, 32, 16} whose fragments fit
// a register budget, two stages, fused mixing, and the collapse
// in the epilogue for per_head or in a separate launch for global.
ScheduleAttr completeSchedule(SpecAttr spec, const ScheduleFields& given);

// Why `schedule` cannot compute `spec`, naming the field; nullopt when fine.
std::optional<std::string> checkSchedule(SpecAttr spec, ScheduleAttr schedule);

}  // namespace loom::iha
