#include "autotune/space.h"

#include "autotune/cost_model.h"

#include <numeric>
#include <set>

#include "loom/compiler.h"

namespace loom::autotune {
namespace {

constexpr int kWarpChoices[] = {1, 2, 4, 8};
constexpr int kBlockNChoices[] = {16, 32, 64, 128};
constexpr int kStageChoices[] = {1, 2, 3, 4};
constexpr int kMaxBlockM = 256;
constexpr int kMmaRows = 16;

}  // namespace

std::string scheduleKey(const Schedule& s) {
  return "bm" + std::to_string(s.block_m()) + ".bn" + std::to_string(s.block_n()) + ".w" + std::to_string(s.warps()) +
         ".s" + std::to_string(s.stages()) + (s.mix() == v1::mix_materialized ? ".materialized" : ".fused") +
         (s.collapse() == v1::collapse_separate ? ".separate" : ".epilogue");
}

SearchSpace searchSpace(const KernelSpec& spec, const v1::Target& target) {
  SearchSpace space;
  std::set<std::string> seen;
  const int P = spec.pseudo_heads();
  auto consider = [&](Schedule schedule) {
    auto resolved = resolveSchedule(spec, schedule, target);
    const std::string key = scheduleKey(resolved ? *resolved : schedule);
    if (!seen.insert(key).second) return;
    if (!resolved) {
      space.pruned.push_back({schedule, key, resolved.error().message});
      return;
    }
    if (target.kind() == v1::Target::cuda && fragmentRegisters(spec, *resolved) > kFragmentRegisterLimit) {
      space.pruned.push_back({*resolved, key,
                              "fragments need about " + std::to_string(fragmentRegisters(spec, *resolved)) +
                                  " registers per thread: certain to spill"});
      return;
    }
    space.candidates.push_back({*resolved, key});
  };

  for (int warps : kWarpChoices) {
    const int quantum = std::lcm(P, kMmaRows * warps);
    for (int blockM = quantum; blockM <= kMaxBlockM; blockM += quantum)
      for (int blockN : kBlockNChoices)
        for (int stages : kStageChoices)
          for (v1::MixStrategy mix : {v1::mix_fused, v1::mix_materialized})
            for (v1::CollapseStrategy collapse : {v1::collapse_fused, v1::collapse_separate}) {
              Schedule s;
              s.set_warps(warps);
              s.set_block_m(blockM);
              s.set_block_n(blockN);
              s.set_stages(stages);
              s.set_mix(mix);
              s.set_collapse(collapse);
              consider(s);
            }
  }
  // Never empty: the compiler's default, else the smallest footprint there
  // is (one warp, whole tokens of 16-row tiles, 16-key blocks, one stage,
  // everything materialised), even if its fragments are large.
  if (space.candidates.empty()) {
    Schedule minimal;
    minimal.set_warps(1);
    minimal.set_block_m(std::lcm(P, kMmaRows));
    minimal.set_block_n(kMmaRows);
    minimal.set_stages(1);
    minimal.set_mix(v1::mix_materialized);
    minimal.set_collapse(v1::collapse_separate);
    for (const Schedule& fallback : {Schedule(), minimal}) {
      if (auto resolved = resolveSchedule(spec, fallback, target); resolved) {
        space.candidates.push_back({*resolved, scheduleKey(*resolved)});
        break;
      }
    }
  }
  return space;
}

}  // namespace loom::autotune
