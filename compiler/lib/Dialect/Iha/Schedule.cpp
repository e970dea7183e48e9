#include "loom/Dialect/Iha/Schedule.h"

#include <algorithm>
#include <iterator>

namespace loom::iha {
namespace {

constexpr int64_t kDefaultWarps = 4;
constexpr int64_t kDefaultWarpgroups = 2;
constexpr int64_t kDefaultBlockNs[] = {64, 32, 16};

constexpr int64_t kTmaProducerRegisters = 24;
// A mixing producer (hopper.h, mixKvTile: a ring of raw rows by cp.async,
// mixed from shared memory) spills at 56; one that also normalises the
// keys (qk_norm) needs more still (at 88 ptxas spills its row loop; at 104
// the decode step's, 8 bytes at H = G = 32, P 6, d 64). 112 leaves two
// consumer warpgroups the 200 registers 104 did (consumerRegisters rounds
// to 8), one the most: so one consumer warpgroup's mixing producer takes
// 112 too (at 88 the decode step of H 32 G 16 P 3 d 128 spilled 8 bytes).
constexpr int64_t kMixingProducerRegisters = 88;
constexpr int64_t kNormalizingProducerRegisters = 112;
// A decode step's producer over a mixed cache copies its rows (at the TMA
// producer's 24 ptxas spills the slot arithmetic).
constexpr int64_t kCopyingProducerRegisters = 56;

std::string str(int64_t value) { return std::to_string(value); }

CollapseStrategy defaultCollapse(SpecAttr spec) {
  return spec.getCollapse() == CollapseMode::per_head ? CollapseStrategy::epilogue : CollapseStrategy::separate;
}

bool wgmmaHeadDim(int64_t d) { return d % kWarpgroupRows == 0 && d <= kMaxBlockRows; }

// Consumer warpgroups for the wgmma engine: as given, else two (128 query
// rows, as FlashAttention-3 runs; each warpgroup's accumulators fit the
// registers setmaxnreg gives it), or enough for one token of a very large P.
int64_t wgmmaWarpgroups(SpecAttr spec, const ScheduleFields& given) {
  if (given.warps) return given.warps / kWarpgroupWarps;
  if (given.blockM) return given.blockM / kWarpgroupRows;
  return std::max(kDefaultWarpgroups, (spec.getPseudoHeads() + kWarpgroupRows - 1) / kWarpgroupRows);
}

// Stages of the wgmma engine by default: three where they fit in sm_90a's
// shared memory (a consumer holds two stages while the last block's P V
// retires, so the third lets the producer stay a block ahead), else two.
int64_t wgmmaStages(SpecAttr spec, int64_t blockM, int64_t blockN, CollapseStrategy collapse, MixStrategy mix) {
  const bool epilogue = collapse == CollapseStrategy::epilogue;
  const bool outTile = epilogue && spec.getCollapse() == CollapseMode::global;
  const HopperSmem three =
      hopperSmem(int(blockM), int(blockN), int(spec.getHeadDim()), 3, int(spec.getHeads()), int(spec.getPseudoHeads()),
                 epilogue, outTile, mix == MixStrategy::fused ? int(spec.getKvHeads()) : 0);
  return three.total <= loom::kHopperSharedMemoryPerBlock ? 3 : kDefaultStages;
}

ScheduleAttr completeWgmma(SpecAttr spec, const ScheduleFields& given) {
  const int64_t warps = given.warps ? given.warps : std::max<int64_t>(wgmmaWarpgroups(spec, given), 1) * kWarpgroupWarps;
  const int64_t blockM = given.blockM ? given.blockM : warps * kMmaRows;
  const int64_t blockN = given.blockN ? given.blockN : (spec.getHeadDim() <= 128 ? 128 : 64);
  const MixStrategy mix = given.mix.value_or(MixStrategy::materialized);
  const CollapseStrategy collapse = given.collapse.value_or(defaultCollapse(spec));
  return ScheduleAttr::get(
      spec.getContext(), blockM, blockN, warps,
      given.stages ? given.stages : wgmmaStages(spec, blockM, blockN, collapse, mix), mix, collapse, Engine::wgmma,
      given.producerRegisters
          ? given.producerRegisters
          : (mix != MixStrategy::fused                ? kTmaProducerRegisters
             : spec.getQkNorm() == QkNorm::rms || warps == kWarpgroupWarps ? kNormalizingProducerRegisters
                                                                           : kMixingProducerRegisters),
      given.dq.value_or(DqStrategy::separate), given.kvSplits ? given.kvSplits : 1, given.stackHeads,
      given.absorbMixing, given.tensorMixing);
}

std::optional<std::string> checkWgmma(SpecAttr spec, ScheduleAttr schedule) {
  const int64_t P = spec.getPseudoHeads(), d = spec.getHeadDim();
  const int64_t blockM = schedule.getBlockM(), blockN = schedule.getBlockN(), warps = schedule.getWarps();
  const int64_t producer = schedule.getProducerRegisters();
  if (!wgmmaHeadDim(d))
    return "engine wgmma needs head_dim (" + str(d) + ") a multiple of 64, at most 256 (use engine mma)";
  if (warps != 4 && warps != 8 && warps != 12)
    return "schedule.warps (" + str(warps) + ") must be 4, 8 or 12 with engine wgmma: 1 to 3 consumer warpgroups";
  if (blockM != warps * kMmaRows)
    return "schedule.block_m (" + str(blockM) + ") must be 64 rows per consumer warpgroup (" + str(warps * kMmaRows) +
           ") with engine wgmma";
  if (blockM < P)
    return "schedule.block_m (" + str(blockM) + ") must hold at least one token (pseudo_heads = " + str(P) + " rows)";
  if (std::find(std::begin(loom::kWgmmaBlockNs), std::end(loom::kWgmmaBlockNs), blockN) == std::end(loom::kWgmmaBlockNs))
    return "schedule.block_n (" + str(blockN) + ") must be 64, 128, 192 or 256 with engine wgmma";
  // A consumer hands a stage back only when the next block's softmax
  // retires the P V it owes; with one stage the producer waits for that
  // stage to load the next block, and both wait forever (found by the
  // emulator).
  if (schedule.getStages() < kMinWgmmaStages)
    return "schedule.stages (" + str(schedule.getStages()) + ") must be at least " + str(kMinWgmmaStages) +
           " with engine wgmma: a consumer returns a stage only after the next block's softmax, so one stage deadlocks";
  if (producer < kMinWarpgroupRegisters || producer > loom::kMaxConsumerRegisters || producer % 8 != 0)
    return "schedule.producer_registers (" + str(producer) + ") must be a multiple of 8 in [" +
           str(kMinWarpgroupRegisters) + ", " + str(loom::kMaxConsumerRegisters) + "]";
  if (loom::consumerRegisters(int(warps), int(producer)) < producer)
    return "schedule.producer_registers (" + str(producer) + ") leaves the consumers " +
           str(loom::consumerRegisters(int(warps), int(producer))) + " registers, fewer than the producer's";
  return std::nullopt;
}

}  // namespace

std::optional<std::string> checkScheduleFields(const ScheduleFields& given) {
  const std::pair<const char*, std::pair<int64_t, int64_t>> fields[] = {
      {"block_m", {given.blockM, kMaxBlockRows}},
      {"block_n", {given.blockN, kMaxBlockRows}},
      {"warps", {given.warps, kMaxWarps}},
      {"stages", {given.stages, kMaxStages}},
      {"producer_registers", {given.producerRegisters, kMaxWarpgroupRegisters}},
      {"kv_splits", {given.kvSplits, kMaxKvSplits}}};
  for (const auto& [name, field] : fields) {
    const auto [value, most] = field;
    if (value < 0 || value > most)
      return std::string("schedule.") + name + " (" + str(value) + ") must be in [1, " + str(most) + "], or 0 for the default";
  }
  return std::nullopt;
}

ScheduleAttr completeSchedule(SpecAttr spec, const ScheduleFields& given, bool hopper) {
  // wgmma when asked for; on Hopper also by default, where the spec and the
  // fields given allow it.
  if (given.engine == Engine::wgmma) return completeWgmma(spec, given);
  if (!given.engine && hopper && wgmmaHeadDim(spec.getHeadDim()) && wgmmaWarpgroups(spec, given) > 0) {
    const ScheduleAttr wgmma = completeWgmma(spec, given);
    if (!checkWgmma(spec, wgmma)) return wgmma;
  }
  // Four warps of one 16-row m-tile each (64 rows, FlashAttention-2's
  // shape per warp), whatever P: a CTA owns the whole tokens among its
  // rows, so block_m need not be a multiple of P and the fragments per warp
  // do not grow with it.
  const int64_t P = spec.getPseudoHeads();
  int64_t warps = given.warps;
  int64_t blockM = given.blockM;
  if (warps == 0) {
    warps = 1;
    for (int64_t candidate : {kDefaultWarps, int64_t(2), int64_t(1)})
      if (!blockM || blockM % (kMmaRows * candidate) == 0) {
        warps = candidate;
        break;
      }
  }
  if (blockM == 0) blockM = (P + kMmaRows * warps - 1) / (kMmaRows * warps) * (kMmaRows * warps);
  int64_t blockN = given.blockN;
  if (blockN == 0) {
    // The widest key block whose registers fit (loom::mmaRegisterEstimate):
    // d 128 gets 64-key blocks, d 256 16 (fused mixing) or 32 (materialised).
    const int mTiles = int(blockM / (kMmaRows * warps));
    const bool fusedMix = given.mix.value_or(MixStrategy::fused) == MixStrategy::fused;
    blockN = kDefaultBlockNs[std::size(kDefaultBlockNs) - 1];
    for (int64_t candidate : kDefaultBlockNs)
      if (loom::mmaRegisterEstimate(mTiles, int(spec.getHeadDim()), int(candidate), fusedMix) <=
          loom::kMaxThreadRegisters) {
        blockN = candidate;
        break;
      }
  }
  return ScheduleAttr::get(spec.getContext(), blockM, blockN, warps, given.stages ? given.stages : kDefaultStages,
                           given.mix.value_or(MixStrategy::fused), given.collapse.value_or(defaultCollapse(spec)),
                           Engine::mma, given.producerRegisters, given.dq.value_or(DqStrategy::separate),
                           given.kvSplits ? given.kvSplits : 1, given.stackHeads, given.absorbMixing,
                           given.tensorMixing);
}



void completeDecodeFields(ScheduleFields& fields, bool mixedCache, int64_t stackRows, int64_t ctaHeads,
                          int64_t pseudoHeads, int64_t headDim, int64_t mixingTokens) {
  fields.mix = mixedCache ? MixStrategy::materialized : MixStrategy::fused;
  fields.engine = fields.engine.value_or(Engine::mma);
  // Over a raw cache, key blocks of 16 rows unless asked otherwise: the
  // mixing of all G staged heads (twice per element with RoPE) keeps
  // ptxas near 255 registers, and only 16 stays clear of spills for every
  // shape. ptxas 13, block_m 64 of 4 warps, stages 1 to 3, sm_80 and
  // sm_90a: block_n 16 compiled clean over head_dim 64-256, G 1-8, P 2-8,
  // RoPE and qk_norm; block_n 32 spilled at H 32 G 8 P 2 d 128 with RoPE
  // (sm_90a, two stages) and at d 256; 64 more so. A memory-bound step
  // loses little with it: the smaller staging leaves room for more CTAs
  // per SM. The tuner searches the wider blocks (and drops what spills).
  constexpr int64_t kRawCacheBlockN = 16;
  if (fields.engine == Engine::wgmma) {
    // wgmma (asked for; sm_90a): one consumer warpgroup unless given, its 64
    // rows already T * P of a step's; wgmma's key blocks (64 to 256, the
    // engine's default) and a producer warpgroup mixing them on chip.
    if (!fields.warps && !fields.blockM) fields.warps = kWarpgroupWarps;
    // Over a mixed cache the producer copies the rows through the page
    // table (no TMA): at the TMA producer's 24 registers, or 32, ptxas spills
    // its slot arithmetic; 40 compiled clean (d 64 and 128, sm_90a), so the
    // mixing producer's 56.
    if (mixedCache && !fields.producerRegisters) fields.producerRegisters = kCopyingProducerRegisters;
    return;
  }
  if (fields.tensorMixing) {
    // Tensor mixing: key blocks of mixingTokens tokens; two heads' eight
    // rows a warp; two stages; the collapse in its own launch.
    if (!fields.blockN) fields.blockN = mixingTokens * pseudoHeads;
    if (!fields.blockM) fields.blockM = tensorMixingBlockM(int(ctaHeads));
    if (!fields.warps) fields.warps = tensorMixingWarps(int(ctaHeads));
    fields.collapse = fields.collapse.value_or(CollapseStrategy::separate);
    return;
  }
  if (fields.absorbMixing) {
    // Absorbed (the keys' and values' mix into the queries and
    // probabilities): key blocks of kAbsorbedTokens tokens; the query block a
    // token of every head of the CTA's (stepHeads: H * P rows up to 16 heads) in 16-row m-tiles, a power of two of
    // them, two warps each where their S rows split (absorbedSplit); two
    // stages; the collapse in its own launch.
    if (!fields.blockN) fields.blockN = kAbsorbedTokens * pseudoHeads;
    if (!fields.blockM) fields.blockM = absorbedBlockM(int(ctaHeads), int(pseudoHeads));
    if (!fields.warps) fields.warps = absorbedWarps(int(fields.blockM), int(pseudoHeads), int(headDim));
    fields.collapse = fields.collapse.value_or(CollapseStrategy::separate);
    return;
  }
  if (!mixedCache && !fields.blockN) fields.blockN = kRawCacheBlockN;
  // Stacked heads share the query block: one 16-row m-tile a warp (four
  // warps unless given) unless a token of every head needs more.
  const int64_t step = kMmaRows * (fields.warps ? fields.warps : kDefaultWarps);
  if (fields.stackHeads && !fields.blockM) fields.blockM = std::max<int64_t>(1, (stackRows + step - 1) / step) * step;
}

std::optional<std::string> checkBackwardSchedule(ScheduleAttr schedule) {
  if (schedule.getEngine() == Engine::wgmma) {
    // The key-block-outer launch on wgmma (loom/tile/cuda_backward.h, bwgmma).
    if (schedule.getWarps() % 4 != 0 || schedule.getBlockN() != 16 * schedule.getWarps())
      return "schedule.block_n must be 16 x warps, in whole warpgroups (64 key rows each), for a wgmma backward "
             "kernel (block_n " + str(schedule.getBlockN()) + ", warps " + str(schedule.getWarps()) + ")";
    if (schedule.getBlockM() % 64 != 0 || schedule.getBlockM() > 256)
      return "schedule.block_m must be 64, 128, 192 or 256 for a wgmma backward kernel (the N of its S^T), not " +
             str(schedule.getBlockM());
    if (schedule.getDq() == DqStrategy::atomic)
      return "schedule.dq must be separate for a wgmma backward kernel (dq in its own launch)";
  } else if (schedule.getEngine() != Engine::mma) {
    return "schedule.engine must be mma or wgmma for a backward kernel";
  }
  if (schedule.getMix() != MixStrategy::materialized)
    return "schedule.mix must be materialized for a backward kernel: its loops read every mixed row many times";
  if (schedule.getCollapse() != CollapseStrategy::separate)
    return "schedule.collapse must be separate for a backward kernel: it needs the pseudo outputs";
  return std::nullopt;
}

std::optional<std::string> checkBackwardKernelSchedule(SpecAttr spec, ScheduleAttr schedule) {
  const ScheduleAttr forward =
      ScheduleAttr::get(spec.getContext(), schedule.getBlockM(), schedule.getBlockN(), schedule.getWarps(),
                        schedule.getStages(), schedule.getMix(), schedule.getCollapse(), Engine::mma,
                        schedule.getProducerRegisters(), schedule.getDq(), schedule.getKvSplits(),
                        schedule.getStackHeads(), schedule.getAbsorbMixing(), schedule.getTensorMixing());
  if (auto why = checkSchedule(spec, forward)) return why;
  return checkBackwardSchedule(schedule);
}

std::optional<std::string> checkSchedule(SpecAttr spec, ScheduleAttr schedule) {
  const int64_t P = spec.getPseudoHeads();
  const int64_t blockM = schedule.getBlockM(), blockN = schedule.getBlockN();
  const int64_t warps = schedule.getWarps(), stages = schedule.getStages();
  if (stages < 1 || stages > kMaxStages)
    return "schedule.stages (" + str(stages) + ") must be in [1, " + str(kMaxStages) + "]";
  if (schedule.getKvSplits() < 1 || schedule.getKvSplits() > kMaxKvSplits)
    return "schedule.kv_splits (" + str(schedule.getKvSplits()) + ") must be in [1, " + str(kMaxKvSplits) + "]";
  if (schedule.getKvSplits() > 1 && schedule.getCollapse() != CollapseStrategy::separate)
    return "schedule.kv_splits (" + str(schedule.getKvSplits()) + ") needs collapse separate: a split CTA holds "
           "part of each row's keys, so its rows are collapsed only after the combine launch merges them";
  if (schedule.getStackHeads()) {
    const int64_t group = spec.getHeads() / spec.getKvHeads();
    if (group < 2)
      return "schedule.stack_heads needs kv groups of several query heads (heads " + str(spec.getHeads()) +
             ", kv_heads " + str(spec.getKvHeads()) + ")";
    if (schedule.getEngine() != Engine::mma) return "schedule.stack_heads needs engine mma";
    if (blockM / group < P)
      return "schedule.block_m (" + str(blockM) + ") must hold a token of each of the " + str(group) +
             " stacked heads (" + str(group * P) + " rows) with stack_heads";
    if (spec.getCollapse() == CollapseMode::global && schedule.getCollapse() == CollapseStrategy::epilogue)
      return "schedule.stack_heads needs collapse separate under a global collapse (its fused epilogue loops over "
             "every head in one CTA)";
  }
  // The one-CTA steps hold stepHeads query heads a CTA (every head up to 16).
  const int most = stepMostHeads(schedule.getTensorMixing(), int(P), int(spec.getHeadDim()));
  const int64_t stepH = stepHeads(int(spec.getHeads()), int(spec.getKvHeads()), most);
  if ((schedule.getAbsorbMixing() || schedule.getTensorMixing()) && stepH == 0)
    return std::string(schedule.getAbsorbMixing() ? "schedule.absorb_mixing" : "schedule.tensor_mixing") +
           ": heads " + str(spec.getHeads()) + " (kv_heads " + str(spec.getKvHeads()) +
           ") do not divide into CTAs that read whole kv groups (up to 16 heads; absorbed, up to " +
           str(stepMostHeads(false, int(P), int(spec.getHeadDim()))) + ")";
  // Both one-CTA steps turn a cached row by R(tP) and R(j) apart, which a
  // rounded RoPE table does not compose to R(tP + j).
  if ((schedule.getAbsorbMixing() || schedule.getTensorMixing()) && spec.getRopeTable() != RopeTable::exact)
    return std::string(schedule.getAbsorbMixing() ? "schedule.absorb_mixing" : "schedule.tensor_mixing") +
           " turns a cached row by R(tP) and R(j) apart, which a rounded RoPE table (rope_table_dtype " +
           stringifyRopeTable(spec.getRopeTable()).str() + ") does not compose to R(tP + j)";
  if (schedule.getAbsorbMixing()) {
    const int64_t H = stepH;
    if (schedule.getEngine() != Engine::mma) return "schedule.absorb_mixing needs engine mma";
    if (schedule.getStackHeads())
      return "schedule.absorb_mixing already holds every query head in one CTA (leave stack_heads unset)";
    if (blockN != kAbsorbedTokens * P)
      return "schedule.block_n (" + str(blockN) + ") must be " + str(kAbsorbedTokens * P) + " with absorb_mixing (" +
             str(kAbsorbedTokens) + " tokens a key block)";
    if (blockM < H * P)
      return "schedule.block_m (" + str(blockM) + ") must hold a token of every query head of a CTA (" +
             str(H * P) + " rows) with absorb_mixing";
    if (const char* why = absorbedShapeProblem(int(blockM), int(warps), int(spec.getHeadDim()), int(P)))
      return std::string("schedule.absorb_mixing: ") + why + " (block_m " + str(blockM) + ", warps " + str(warps) +
             ", head_dim " + str(spec.getHeadDim()) + ", pseudo_heads " + str(P) + ")";
    if (schedule.getCollapse() != CollapseStrategy::separate)
      return "schedule.absorb_mixing needs collapse separate (its CTA stores every head's rows)";
  }
  if (schedule.getTensorMixing()) {
    const int64_t H = stepH;
    const bool rope = spec.getRopeTheta().convertToDouble() > 0;
    if (schedule.getEngine() != Engine::mma) return "schedule.tensor_mixing needs engine mma";
    if (schedule.getAbsorbMixing())
      return "schedule.tensor_mixing and absorb_mixing exclude each other (one mixes the cached rows, the other never)";
    if (schedule.getStackHeads())
      return "schedule.tensor_mixing already holds every query head in one CTA (leave stack_heads unset)";
    if (const char* why = tensorMixingShapeProblem(int(H), int(spec.getHeadDim()), int(P), rope))
      return std::string("schedule.tensor_mixing: ") + why + " (heads " + str(spec.getHeads()) + ", kv_heads " +
             str(spec.getKvHeads()) + ", head_dim " + str(spec.getHeadDim()) + ", pseudo_heads " + str(P) + ")";
    const int64_t tokens = kTensorMixingTokens;
    if (blockN != tokens * P)
      return "schedule.block_n (" + str(blockN) + ") must be " + str(tokens * P) + " with tensor_mixing (" +
             str(tokens) + " tokens a key block)";
    if (blockM != tensorMixingBlockM(int(H)) || warps != tensorMixingWarps(int(H)))
      return "schedule.block_m and warps (" + str(blockM) + ", " + str(warps) + ") must be " +
             str(tensorMixingBlockM(int(H))) + " and " + str(tensorMixingWarps(int(H))) +
             " with tensor_mixing (8 rows a head, two heads a warp)";
    if (schedule.getCollapse() != CollapseStrategy::separate)
      return "schedule.tensor_mixing needs collapse separate (its CTA stores every head's rows)";
    if (schedule.getProducerRegisters() != 0)
      return "schedule.producer_registers is for engine wgmma only (its producer warpgroup)";
    return std::nullopt;
  }
  if (schedule.getEngine() == Engine::wgmma) return checkWgmma(spec, schedule);
  if (schedule.getProducerRegisters() != 0)
    return "schedule.producer_registers is for engine wgmma only (its producer warpgroup)";
  if (warps != 1 && warps != 2 && warps != 4 && warps != 8)
    return "schedule.warps (" + str(warps) + ") must be 1, 2, 4 or 8";
  if (schedule.getAbsorbMixing()) return std::nullopt;  // its warps share m-tiles (checked above)
  if (blockM < 1 || blockM > kMaxBlockRows)
    return "schedule.block_m (" + str(blockM) + ") must be in [1, " + str(kMaxBlockRows) + "]";
  if (blockM < P)
    return "schedule.block_m (" + str(blockM) + ") must hold at least one token (pseudo_heads = " + str(P) + " rows)";
  if (blockM % (kMmaRows * warps) != 0)
    return "schedule.block_m (" + str(blockM) + ") must be a multiple of " + str(kMmaRows) + " rows per warp x " +
           str(warps) + " warps";
  if (blockN < kMmaRows || blockN > kMaxBlockRows || blockN % kMmaRows != 0)
    return "schedule.block_n (" + str(blockN) + ") must be a multiple of " + str(kMmaRows) + " in [" +
           str(kMmaRows) + ", " + str(kMaxBlockRows) + "]";
  return std::nullopt;
}

}  // namespace loom::iha
