#include "autotune/space.h"

#include "autotune/cost_model.h"

#include <set>
#include <vector>

#include "loom/compiler.h"
#include "loom/tile/layout.h"

namespace loom::autotune {
namespace {

constexpr int kWarpChoices[] = {1, 2, 4, 8};
constexpr int kBlockNChoices[] = {16, 32, 64, 128};
constexpr int kStageChoices[] = {1, 2, 3, 4};
constexpr int kMaxBlockM = 256;
constexpr int kMmaRows = 16;
// The wgmma engine (sm_90a): 1 to 3 consumer warpgroups of 64 rows, its
// block_n set (layout.h), and the producer's register budget: the TMA producer is one
// thread and takes the minimum; a mixing producer computes and gets a choice.
constexpr int kWarpgroupChoices[] = {1, 2, 3};
constexpr int kTmaProducerRegisters[] = {24};
constexpr int kMixingProducerRegisters[] = {88, 104};
// Decode: CTAs splitting a step's key blocks (flash-decoding).
constexpr int kDecodeSplitChoices[] = {1, 2, 4, 8, 16, 32};
// The absorbed step runs one CTA a sequence: its splits alone fill the SMs
// (a one-warp CTA's, their sub-partitions: up to kMaxKvSplits).
constexpr int kAbsorbedSplitChoices[] = {1, 4, 16, 32, 64, 128, 256, 512};

}  // namespace

int64_t registerLimit(const Schedule& s) {
  if (s.engine() != v1::engine_wgmma) return kMaxThreadRegisters;
  return consumerRegisters(s.warps(), s.producer_registers());
}

namespace {
// Files `given`, as the compiler resolved it, once under its key (+ `suffix`):
// a candidate, or pruned with the compiler's reason or as likely to spill.
void consider(SearchSpace& space, std::set<std::string>& seen, const KernelSpec& spec, const v1::Target& target,
              const Schedule& given, const Result<Schedule>& resolved, const std::string& suffix = "") {
  const std::string key = scheduleKey(resolved ? *resolved : given) + suffix;
  if (!seen.insert(key).second) return;
  if (!resolved) {
    space.pruned.push_back({given, key, resolved.error().message});
    return;
  }
  const int64_t limit = registerLimit(*resolved);
  if (target.kind() == v1::Target::cuda && estimatedRegisters(spec, *resolved) > limit) {
    space.pruned.push_back({*resolved, key,
                            "needs about " + std::to_string(estimatedRegisters(spec, *resolved)) +
                                " registers per thread, over " + std::to_string(limit) + ": likely to spill"});
    return;
  }
  space.candidates.push_back({*resolved, key});
}
}  // namespace

std::string scheduleKey(const Schedule& s) {
  std::string key = "bm" + std::to_string(s.block_m()) + ".bn" + std::to_string(s.block_n()) + ".w" +
                    std::to_string(s.warps()) + ".s" + std::to_string(s.stages()) +
                    (s.mix() == v1::mix_materialized ? ".materialized" : ".fused") +
                    (s.collapse() == v1::collapse_separate ? ".separate" : ".epilogue");
  if (s.engine() == v1::engine_wgmma) key += ".wgmma.p" + std::to_string(s.producer_registers());
  if (s.dq() == v1::dq_atomic) key += ".dq-atomic";
  if (s.kv_splits() > 1) key += ".splits" + std::to_string(s.kv_splits());
  if (s.stack_heads()) key += ".stacked";
  if (s.absorb_mixing()) key += ".absorbed";
  if (s.tensor_mixing()) key += ".tensor-mixing";
  return key;
}

SearchSpace searchSpace(const KernelSpec& spec, const v1::Target& target) {
  SearchSpace space;
  std::set<std::string> seen;
  const int P = spec.pseudo_heads();
  auto consider = [&](const Schedule& schedule) {
    autotune::consider(space, seen, spec, target, schedule, resolveSchedule(spec, schedule, target));
  };

  // block_m: any multiple of 16 rows per warp holding a token (a CTA owns
  // the whole tokens among its rows; the cost model charges the rest).
  for (int warps : kWarpChoices) {
    const int quantum = kMmaRows * warps;
    for (int blockM = (P + quantum - 1) / quantum * quantum; blockM <= kMaxBlockM; blockM += quantum)
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
              s.set_engine(v1::engine_mma);
              consider(s);
            }
  }
  if (target.kind() == v1::Target::cuda && target.arch() == "sm_90a")
    for (int groups : kWarpgroupChoices)
      for (int blockN : kWgmmaBlockNs)
        for (int stages : kStageChoices)
          for (v1::MixStrategy mix : {v1::mix_materialized, v1::mix_fused})
            for (v1::CollapseStrategy collapse : {v1::collapse_fused, v1::collapse_separate})
              for (int producer : mix == v1::mix_fused ? std::vector<int>(std::begin(kMixingProducerRegisters),
                                                                         std::end(kMixingProducerRegisters))
                                                       : std::vector<int>(std::begin(kTmaProducerRegisters),
                                                                          std::end(kTmaProducerRegisters))) {
                Schedule s;
                s.set_engine(v1::engine_wgmma);
                s.set_warps(4 * groups);
                s.set_block_m(64 * groups);
                s.set_block_n(blockN);
                s.set_stages(stages);
                s.set_mix(mix);
                s.set_collapse(collapse);
                s.set_producer_registers(producer);
                consider(s);
              }
  // Never empty: the compiler's default, else the smallest footprint there
  // is (one warp, the 16-row tiles holding a token, 16-key blocks, one
  // stage, everything materialised), even if its fragments are large.
  if (space.candidates.empty()) {
    Schedule minimal;
    minimal.set_warps(1);
    minimal.set_block_m((P + kMmaRows - 1) / kMmaRows * kMmaRows);
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

SearchSpace backwardSearchSpace(const KernelSpec& spec, const v1::Target& target) {
  SearchSpace space;
  std::set<std::string> seen;
  const int P = spec.pseudo_heads();
  constexpr int kBackwardMaxBlockM = 128;
  for (int warps : {1, 2, 4})
    for (int rowsPerWarp : {16, 32}) {
      const int blockN = rowsPerWarp * warps;
      if (blockN > kBackwardMaxBlockM) continue;
      const int quantum = kMmaRows * warps;
      for (int blockM = (P + quantum - 1) / quantum * quantum; blockM <= kBackwardMaxBlockM; blockM += quantum) {
        for (v1::DqStrategy dq : {v1::dq_separate, v1::dq_atomic}) {
          Schedule s;
          s.set_warps(warps);
          s.set_block_m(blockM);
          s.set_block_n(blockN);
          s.set_stages(2);
          s.set_mix(v1::mix_materialized);
          s.set_collapse(v1::collapse_separate);
          s.set_engine(v1::engine_mma);
          s.set_dq(dq);
          auto resolved = resolveSchedule(spec, s, target, Direction::backward);
          const std::string key = scheduleKey(resolved ? *resolved : s) + ".backward";
          if (!seen.insert(key).second) continue;
          if (!resolved) space.pruned.push_back({s, key, resolved.error().message});
          else space.candidates.push_back({*resolved, key});
        }
      }
    }
  // sm_90a: the wgmma backward (loom/tile/cuda_backward.h, bwgmma): one or
  // two warpgroups of 64 key rows, query blocks of 64 rows a warpgroup.
  if (target.kind() == v1::Target::cuda && target.arch() == "sm_90a")
    for (int warpgroups : {1, 2}) {
      Schedule s;
      s.set_warps(4 * warpgroups);
      s.set_block_m(64 * warpgroups);
      s.set_block_n(64 * warpgroups);
      s.set_stages(2);
      s.set_mix(v1::mix_materialized);
      s.set_collapse(v1::collapse_separate);
      s.set_engine(v1::engine_wgmma);
      s.set_dq(v1::dq_separate);
      auto resolved = resolveSchedule(spec, s, target, Direction::backward);
      const std::string key = scheduleKey(resolved ? *resolved : s) + ".backward";
      if (!seen.insert(key).second) continue;
      if (!resolved) space.pruned.push_back({s, key, resolved.error().message});
      else space.candidates.push_back({*resolved, key});
    }
  return space;
}

SearchSpace decodeSearchSpace(const KernelSpec& spec, const v1::Target& target, bool mixedCache) {
  SearchSpace space;
  std::set<std::string> seen;
  const std::string suffix = mixedCache ? ".decode-mixed" : ".decode";
  // With kv groups of several query heads, each schedule also with the
  // group's heads stacked in one CTA (each key block staged and mixed once).
  const std::vector<bool> stackings = spec.heads() > spec.kv_heads() ? std::vector<bool>{false, true}
                                                                      : std::vector<bool>{false};
  for (bool stacked : stackings)
    for (int warps : {1, 2, 4})
      for (int blockN : {16, 32, 64})
        for (int stages : {1, 2})
          for (int splits : kDecodeSplitChoices) {
            Schedule s;
            s.set_warps(warps);
            s.set_block_n(blockN);
            s.set_stages(stages);
            s.set_kv_splits(splits);
            s.set_stack_heads(stacked);
            if (!mixedCache) {
              s.set_absorb_mixing(false);
              s.set_tensor_mixing(false);
            }
            consider(space, seen, spec, target, s, resolveSchedule(spec, s, target, Direction::decode, mixedCache),
                     suffix);
          }
  // Over a raw cache, the absorbed step (its own shape: pruned, with the
  // compiler's reason, where the spec rules it out), at every split count
  // up to one CTA an SM for a sequence.
  if (!mixedCache && target.kind() == v1::Target::cuda)
    for (int stages : {1, 2})
      for (int splits : kAbsorbedSplitChoices) {
        Schedule s;
        s.set_absorb_mixing(true);
        s.set_stages(stages);
        s.set_kv_splits(splits);
        consider(space, seen, spec, target, s, resolveSchedule(spec, s, target, Direction::decode, mixedCache), suffix);
        // The tensor-mixing step likewise (one CTA a sequence too).
        Schedule t;
        t.set_tensor_mixing(true);
        t.set_stages(stages);
        t.set_kv_splits(splits);
        consider(space, seen, spec, target, t, resolveSchedule(spec, t, target, Direction::decode, mixedCache), suffix);
      }
  // sm_90a: the wgmma step too (one consumer warpgroup, wgmma's key
  // blocks; pruned, with the compiler's reason, where head_dim rules it out).
  if (target.kind() == v1::Target::cuda && target.arch() == "sm_90a")
    for (int blockN : {64, 128})
      for (int stages : {2, 3})
        for (int splits : kDecodeSplitChoices) {
          Schedule s;
          s.set_engine(v1::engine_wgmma);
          s.set_block_n(blockN);
          s.set_stages(stages);
          s.set_kv_splits(splits);
          consider(space, seen, spec, target, s, resolveSchedule(spec, s, target, Direction::decode, mixedCache),
                   suffix);
        }
  if (space.candidates.empty())  // the compiler's default decode schedule, whatever it costs
    if (auto resolved = resolveSchedule(spec, Schedule(), target, Direction::decode, mixedCache); resolved)
      space.candidates.push_back({*resolved, scheduleKey(*resolved) + suffix});
  return space;
}

}  // namespace loom::autotune
