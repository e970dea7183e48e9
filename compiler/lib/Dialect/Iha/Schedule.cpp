#include "loom/Dialect/Iha/Schedule.h"

#include <iterator>
#include <numeric>

namespace loom::iha {
namespace {

constexpr int64_t kDefaultMaxBlockM = 128;
constexpr int64_t kDefaultMinBlockM = 64;
constexpr int64_t kDefaultBlockNs[] = {64, 32, 16};
// Per-thread f32 registers the default schedule lets the score, output and
// Q fragments take: MT * (3/4 d + block_n / 2) with MT m-tiles per warp.
constexpr int64_t kFragmentRegisterBudget = 128;
constexpr int64_t kDefaultStages = 2;

std::string str(int64_t value) { return std::to_string(value); }

}  // namespace

ScheduleAttr completeSchedule(SpecAttr spec, const ScheduleFields& given) {
  const int64_t P = spec.getPseudoHeads();
  int64_t warps = given.warps;
  int64_t blockM = given.blockM;
  if (warps == 0) {
    warps = 1;
    for (int64_t candidate : {4, 2, 1}) {
      if (blockM ? blockM % (kMmaRows * candidate) == 0 : std::lcm(P, kMmaRows * candidate) <= kDefaultMaxBlockM) {
        warps = candidate;
        break;
      }
    }
  }
  if (blockM == 0) {
    blockM = std::lcm(P, kMmaRows * warps);
    while (blockM < kDefaultMinBlockM) blockM *= 2;
  }
  int64_t blockN = given.blockN;
  if (blockN == 0) {
    const int64_t mTiles = blockM / (kMmaRows * warps);
    const int64_t paddedDim = (spec.getHeadDim() + kMmaRows - 1) / kMmaRows * kMmaRows;
    blockN = kDefaultBlockNs[std::size(kDefaultBlockNs) - 1];
    for (int64_t candidate : kDefaultBlockNs)
      if (mTiles * (paddedDim * 3 / 4 + candidate / 2) <= kFragmentRegisterBudget) {
        blockN = candidate;
        break;
      }
  }
  const MixStrategy mix = given.mix.value_or(MixStrategy::fused);
  const CollapseStrategy collapse = given.collapse.value_or(
      spec.getCollapse() == CollapseMode::per_head ? CollapseStrategy::epilogue : CollapseStrategy::separate);
  return ScheduleAttr::get(spec.getContext(), blockM, blockN, warps,
                           given.stages ? given.stages : kDefaultStages, mix, collapse);
}

std::optional<std::string> checkSchedule(SpecAttr spec, ScheduleAttr schedule) {
  const int64_t P = spec.getPseudoHeads();
  const int64_t blockM = schedule.getBlockM(), blockN = schedule.getBlockN();
  const int64_t warps = schedule.getWarps(), stages = schedule.getStages();
  if (warps != 1 && warps != 2 && warps != 4 && warps != 8)
    return "schedule.warps (" + str(warps) + ") must be 1, 2, 4 or 8";
  if (blockM < 1 || blockM > kMaxBlockRows)
    return "schedule.block_m (" + str(blockM) + ") must be in [1, " + str(kMaxBlockRows) + "]";
  if (blockM % P != 0)
    return "schedule.block_m (" + str(blockM) + ") must be a multiple of pseudo_heads (" + str(P) +
           ") so a query block holds whole tokens";
  if (blockM % (kMmaRows * warps) != 0)
    return "schedule.block_m (" + str(blockM) + ") must be a multiple of " + str(kMmaRows) + " rows per warp x " +
           str(warps) + " warps";
  if (blockN < kMmaRows || blockN > kMaxBlockRows || blockN % kMmaRows != 0)
    return "schedule.block_n (" + str(blockN) + ") must be a multiple of " + str(kMmaRows) + " in [" +
           str(kMmaRows) + ", " + str(kMaxBlockRows) + "]";
  if (stages < 1 || stages > kMaxStages)
    return "schedule.stages (" + str(stages) + ") must be in [1, " + str(kMaxStages) + "]";
  return std::nullopt;
}

}  // namespace loom::iha
