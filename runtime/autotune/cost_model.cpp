#include "autotune/cost_model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <queue>

#include "loom/compiler.h"
#include "loom/mask_rule.h"
#include "loom/tile/layout.h"

namespace loom::autotune {
namespace {

constexpr double kLaunchSeconds = 3e-6;
// Instructions a warp issues per key block besides its matrix products and
// exponentials: the pipeline's wait, barrier and copy issue, the softmax
// row reductions (quad shuffles), the loop and its addresses.
constexpr double kLoopInstructionsPerWarp = 150;
// What the warps' other work (exponentials, SIMT arithmetic) costs on top of
// the matrix products they overlap with: about two thirds is hidden.
constexpr double kExposedSimtShare = 0.35;
// The warp-specialised wgmma engine overlaps the softmax with the tensor
// cores by design (FlashAttention-3's ordering) and its producer loads by
// TMA while the consumers compute: less of either stays exposed.
constexpr double kWgmmaExposedSimtShare = 0.15;
constexpr double kWgmmaExposedOverlapShare = 0.10;
// Loads pipelined two or more stages deep overlap the math; what is left
// exposed of the smaller of the two (latency, contention) is this share.
constexpr double kExposedOverlapShare = 0.25;
constexpr int kLaneCount = 32;
constexpr int kCopyBytes = 16;  // cp.async chunk
constexpr int kMaxCtasPerSm = 32;
constexpr int kWarpsToSaturateTensorCores = 8;
constexpr int kBytes16 = 2;
constexpr int kMmaK = 16;
constexpr int kWarpgroupWarps = 4;

// CTAs an SM holds by shared memory (`smem` bytes each; 0: not limiting),
// registers (unless `wgmma`: setmaxnreg moves them, one CTA a SM) and threads.
int ctasPerSmOf(const DeviceModel& device, int64_t smem, int registers, int threads, bool wgmma = false) {
  int ctas = wgmma ? 1 : kMaxCtasPerSm;
  if (smem > 0) ctas = int(std::min<int64_t>(ctas, device.sharedMemoryPerSm / smem));
  if (!wgmma) ctas = std::min(ctas, device.registersPerSm / std::max(1, registers * threads));
  ctas = std::min(ctas, device.maxThreadsPerSm / threads);
  return std::max(ctas, 0);
}

}  // namespace

int64_t estimatedRegisters(const KernelSpec& spec, const Schedule& s) {
  // wgmma: a consumer thread's fragments (S, O, P, and Q where it fits;
  // loom::wgmmaQInRegisters) and its loop state.
  if (s.engine() == v1::engine_wgmma) {
    const int bn = int(s.block_n()), d = int(spec.head_dim());
    const bool qInRegisters = wgmmaQInRegisters(bn, d, consumerRegisters(int(s.warps()), int(s.producer_registers())));
    return kWgmmaLoopRegisters + wgmmaFragmentRegisters(bn, d) + (qInRegisters ? d / 4 : 0);
  }
  // Absorbed (cuda_absorbed.h): R(-j) q's fragments of the warp's S rows,
  // its output columns, and the rest (measured at 100-110 on ptxas 13, -O1).
  if (s.absorb_mixing()) {
    const int P = int(spec.pseudo_heads()), d = int(spec.head_dim()), split = absorbedSplit(P, d);
    return absorbedRows(P) / split * (paddedHeadDim(d) / kMmaK) * 4 + paddedHeadDim(d) / 8 / split * 4 + 104;
  }
  // Tensor mixing (cuda_tensor_mixing.h): the output (d / 2), and the rest
  // (measured at 150 to 154 on ptxas 13, -O1, d 128, RoPE, qk_norm on or off).
  if (s.tensor_mixing()) return paddedHeadDim(int(spec.head_dim())) / 2 + 154;
  return mmaRegisterEstimate(int(s.block_m() / (kMmaK * s.warps())), int(spec.head_dim()), int(s.block_n()),
                             s.mix() != v1::mix_materialized);
}

// The absorbed step's work a CTA a key block (cuda_absorbed.h): its products
// (S rows against every raw key row, then P' against every raw value row)
// and its f32 work (the combination over the kv heads, the values' fold,
// the staged keys' rotation).
struct AbsorbedBlockWork {
  double matrixFlops = 0, simtFlops = 0, exps = 0;
};
AbsorbedBlockWork absorbedBlockWork(const KernelSpec& spec, const Schedule& s) {
  const int64_t G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  const double paddedHeads = double(absorbedPaddedHeads(int(G))), rawRows = paddedHeads * kAbsorbedTokens;
  const double dp = double(paddedHeadDim(int(d))), sRows = double(s.block_m() * absorbedRows(int(P)));
  AbsorbedBlockWork w;
  w.matrixFlops = 2.0 * (sRows + double(s.block_m())) * rawRows * dp;
  // Combination: G a score; fold: P a P' element (block_m x tokens x Gp); rotation: 3 an element.
  w.simtFlops = 2.0 * (sRows * kAbsorbedTokens * double(G) + double(s.block_m() * kAbsorbedTokens * P) * paddedHeads) +
                (spec.rope_theta() > 0 ? 3.0 * double(kAbsorbedTokens * G * d) : 0.0);
  w.exps = sRows * kAbsorbedTokens;
  if (spec.qk_norm() == v1::KernelSpec::rms) {
    // Each token's Gram matrix of its raw key rows (16-row tiles on the
    // tensor cores), then one quadratic form a mixed key row of the CTA's kv
    // heads (G (G + 1) / 2
    // + G multiply-adds on the Gram matrix's upper triangle) and its scale
    // on the scores.
    const double gramRows = double((G + 15) / 16 * 16);
    w.matrixFlops += 2.0 * kAbsorbedTokens * gramRows * gramRows * dp;
    const int64_t ctaKvHeads =
        stepKvHeads(oneCtaHeads(false, int(spec.heads()), int(G), int(P), int(d)), int(spec.heads()), int(G));
    w.simtFlops +=
        2.0 * kAbsorbedTokens * double(ctaKvHeads * P) * double(G * (G + 1) / 2 + G) + sRows * kAbsorbedTokens;
  }
  return w;
}

// The tensor-mixing step's work a CTA a key block (cuda_tensor_mixing.h):
// its products as issued (tensorMixingTokenMacs, layout.h); its f32 work,
// R(j) on the mixed keys and R(tP) on the staged ones (3 an element),
// qk_norm's squares, the packing of the mixed keys (the values are never
// mixed: P' = P beta is a product, and its packing a sixteenth of the keys').
AbsorbedBlockWork tensorMixingBlockWork(const KernelSpec& spec, const Schedule& s) {
  const double d = double(paddedHeadDim(int(spec.head_dim())));
  const int tokens = kTensorMixingTokens;
  const double warpTokens = double(s.warps()) * tokens;
  AbsorbedBlockWork w;
  const int64_t ctasASequence = spec.heads() / oneCtaHeads(true, int(spec.heads()), int(spec.kv_heads()), 0, 0);
  w.matrixFlops = 2.0 * tokens *
                  double(tensorMixingTokenMacs(int(spec.heads()), int(spec.kv_heads()), int(spec.head_dim()),
                                               spec.dtype() == v1::bfloat16)) /
                  double(ctasASequence);
  // a warp's mixed rows of one role, one token (16 a pass)
  const double rows = 16.0 / tensorMixingPassTokens(int(spec.heads()), int(spec.kv_heads())) * d;
  w.simtFlops = warpTokens * rows * (1.0 + (spec.rope_theta() > 0 ? 3.0 : 0.0) +
                                     (spec.qk_norm() == v1::KernelSpec::rms ? 2.0 : 0.0)) +
                (spec.rope_theta() > 0 ? 3.0 * double(tokens * spec.kv_heads()) * d : 0.0);
  w.exps = warpTokens * 16.0 * kTensorMixingRows;
  return w;
}
// The block work of a step that holds every head in one CTA.
AbsorbedBlockWork allHeadsBlockWork(const KernelSpec& spec, const Schedule& s) {
  return s.tensor_mixing() ? tensorMixingBlockWork(spec, s) : absorbedBlockWork(spec, s);
}

DeviceModel deviceModel(const v1::Target& target) {
  DeviceModel m;
  const std::string arch = target.arch();
  const v1::DeviceProperties& p = target.device();
  // The efficiencies are the share of the dense matrix rate that published
  // attention kernels of each engine reach on long sequences at d 128:
  // FlashAttention-2 (mma.sync) about 70% on an A100 and 40% of an H100's
  // ceiling, FlashAttention-3 (wgmma, warp-specialised) about 75%; the
  // figures here are of the matrix work issued, diagonal blocks included.
  if (arch.rfind("sm_90", 0) == 0) {  // H100 / H200: bf16 GEMM measured at ~790 TFLOP/s, copy 4.3 TB/s
    m = {"hopper", 790e12, 0.50, 60e12, 4.2e12, 4.3e12, 12e12, 33e12, 0, 233472, 65536, 2048,
         arch == "sm_90a" ? 0.88 : 0.0};
  } else if (arch == "sm_80") {  // A100: 312 TFLOP/s dense bf16, 2 TB/s
    m = {"ampere", 312e12, 0.78, 19e12, 2.4e12, 1.8e12, 7e12, 19e12, 0, 167936, 65536, 2048};
  } else {  // sm_86 / sm_89 class
    m = {"ada", 150e12, 0.60, 40e12, 1.4e12, 0.9e12, 3e12, 18e12, 0, 102400, 65536, 1536};
  }
  m.smCount = int(smCountOf(target));  // the device's, else the arch's largest part
  m.sharedMemoryPerSm = sharedMemoryPerSmOf(target);  // the device's, else the arch's (the same figures)
  if (p.registers_per_multiprocessor() > 0) m.registersPerSm = p.registers_per_multiprocessor();
  return m;
}

double allowedPairs(const KernelSpec& spec, int64_t tokens) {
  const int64_t L = tokens * spec.pseudo_heads();
  const MaskRule rule = MaskRule::of(spec);
  double pairs = 0;
  for (int64_t i = 0; i < L; ++i) {
    const RowInterval row = allowedRows(rule, i, L);
    pairs += double(row.last - row.first + 1);
  }
  return pairs;
}

double ihaFlops(const KernelSpec& spec, int64_t batch, int64_t tokens) {
  return 4.0 * double(batch * spec.heads()) * double(spec.head_dim()) * allowedPairs(spec, tokens);
}

double ihaBackwardFlops(const KernelSpec& spec, int64_t batch, int64_t tokens) {
  return 2.5 * ihaFlops(spec, batch, tokens);
}

double operandBytes(const KernelSpec& spec, int64_t batch, int64_t tokens) {
  return double(batch) * double(tokens) * (2.0 * spec.heads() + 2.0 * spec.kv_heads()) * double(spec.head_dim()) * kBytes16;
}

// The key blocks every query block visits, and the masked ones among them,
// exactly as iha-analyze-mask's loops run them (the same loom::blockRanges).
BlockCounts countBlocks(const KernelSpec& spec, int64_t blockM, int64_t blockN, int64_t tokens) {
  const int64_t L = tokens * spec.pseudo_heads();
  const MaskRule rule = MaskRule::of(spec);
  IntegerMath math;
  BlockCounts counts;
  // A query block computes blockM rows and owns the whole tokens among them.
  const int64_t owned = blockM / spec.pseudo_heads() * spec.pseudo_heads();
  for (int64_t r0 = 0; r0 < L; r0 += owned) {
    const BlockRanges<int64_t> r = blockRanges(math, rule, blockM, blockN, r0, L);
    counts.visited += r.hi - r.lo;
    counts.masked += (r.ilo - r.lo) + (r.hi - r.ihi);
    counts.perQueryBlock.push_back(r.hi - r.lo);
  }
  return counts;
}

namespace {

// The grid's (query blocks x `copies` heads and batch entries) work spread
// over `slots` CTA slots as the hardware hands them out: in launch order,
// block x fastest and counting down (the last query block, under a causal
// mask the heaviest, first), each CTA to the slot that frees first. The
// mean load over the makespan: 1 when every slot stays busy to the end.
double scheduledEfficiency(const std::vector<int64_t>& perQueryBlock, int64_t copies, double slots) {
  const int64_t count = int64_t(perQueryBlock.size()) * copies;
  if (count == 0 || slots < 1) return 1.0;
  const size_t width = size_t(std::min<double>(slots, double(count)));
  std::priority_queue<double, std::vector<double>, std::greater<double>> free(std::greater<double>(),
                                                                              std::vector<double>(width, 0.0));
  double total = 0, makespan = 0;
  for (int64_t c = 0; c < copies; ++c)
    for (auto x = perQueryBlock.rbegin(); x != perQueryBlock.rend(); ++x) {
      const double work = double(*x);
      const double done = free.top() + work;
      free.pop();
      free.push(done);
      total += work;
      makespan = std::max(makespan, done);
    }
  return makespan > 0 ? total / (slots * makespan) : 1.0;
}

}  // namespace

std::optional<LoopIssue> loopIssueOf(const v1::ResourceUsage& attention) {
  if (!attention.sass_read() || attention.loops_size() == 0) return std::nullopt;
  LoopIssue issue;
  issue.pingPong = true;
  for (const v1::SassLoop& loop : attention.loops()) {
    double& slot = loop.masked() ? issue.masked : issue.unmasked;
    slot = std::max(slot, double(loop.instructions()));
    issue.exponentials = std::max(issue.exponentials, double(loop.exponentials()));
    const double window = std::max(0, loop.exponentials_in_pv_window());
    issue.inWindow = issue.inWindow == 0 ? window : std::min(issue.inWindow, window);
    issue.pingPong = issue.pingPong && loop.ping_pong();
  }
  issue.registers = int(attention.registers());
  if (issue.unmasked == 0) issue.unmasked = issue.masked;
  if (issue.masked == 0) issue.masked = issue.unmasked;
  return issue;
}

std::optional<PremixIssue> premixIssueOf(const v1::ResourceUsage& premix, const KernelSpec& spec,
                                         const Schedule& schedule) {
  if (!premix.sass_read()) return std::nullopt;
  // A mixing group on the FMA units holds at least 16 FMAs (its M R V: one
  // source head, as a single kv head's keys and values are, only V
  // products); the tensor path's own loops on the FMA units (its weights
  // split in halves, its angles) a few fp32 instructions.
  constexpr int kMixingFp32 = 16;
  const int P = int(spec.pseudo_heads()), D = int(spec.head_dim());
  const int sources[3] = {int(spec.heads()), int(spec.kv_heads()), int(spec.kv_heads())};
  auto onTensorCores = [&](int role) {
    return premixOnTensorCores(sources[role], P, D, int(schedule.block_m()) / P, int(schedule.warps()));
  };
  int fewest = kMixingFp32;
  for (int role = 0; role < 3; ++role)
    if (!onTensorCores(role))
      fewest = std::min(fewest, sources[role] * premixRowGroup(sources[role], D) * premixVector(sources[role], D));
  struct Mixing {
    int offset;
    double instructions;
    bool tensor;
  };
  std::vector<Mixing> mixing;
  for (const v1::SassLoop& loop : premix.simt_loops())
    for (const v1::SassClassCount& c : loop.classes())
      if (c.name() == "fp32" && c.count() >= fewest)
        mixing.push_back({loop.first_offset(), double(loop.instructions()), false});
  for (const v1::SassLoop& loop : premix.loops())
    mixing.push_back({loop.first_offset(), double(loop.instructions()), true});
  if (mixing.size() != 3) return std::nullopt;  // not the loops this model knows
  std::sort(mixing.begin(), mixing.end(), [](const Mixing& x, const Mixing& y) { return x.offset < y.offset; });
  PremixIssue issue;
  for (int role = 0; role < 3; ++role) {
    issue.perGroup[role] = mixing[size_t(role)].instructions;
    if (mixing[size_t(role)].tensor != onTensorCores(role)) return std::nullopt;  // each role's loop where its path puts it
  }
  return issue;
}

namespace {

// A role's premix on the tensor cores (layout.h premixOnTensorCores): the
// warp instructions one CTA issues for it, from the instructions of its
// mixing loop (`unit`: a round, or a (token, m-tile) pair where a warp takes
// several a round), or estimated from the loop's parts as the machine code
// has them (docs/performance.md, The premix on the tensor cores): the mma
// (two a product in bf16, hi and lo), the ldmatrix of the weights and the
// raw rows, about 13 instructions an n-tile of 8 columns (packs, staging
// stores, the 16-byte loads and stores out, their addresses), RoPE's
// rotation (about 1.1 d) and qk_norm's (about 1.25 d); a round adds its
// staging loop's body and its angles' (counted once), 15 of its own.
constexpr double kPremixTensorAmpereIssue = 0.94;
double premixTensorIssue(int sources, int P, int D, int ctaTokens, int warps, bool bf16, bool rotated, bool normalised,
                         bool ampere, std::optional<double> unit) {
  const int M = premixTensorSources(sources);  // padded to whole k-steps and m-tiles
  const int tiles = M * P / 16, round = premixTensorRoundTokens(sources, P, ctaTokens, warps);
  const int rounds = (ctaTokens + round - 1) / round, pairs = (round * tiles + warps - 1) / warps;
  const int threads = warps * 32;
  const double staging = std::ceil(double(round) * M * (D / 8) / threads) * 12.0 +
                         (rotated ? std::ceil(double(round) * P * (D / 2) / threads) * 35.0 : 0.0);
  double perUnit = 0;
  if (unit) {
    perUnit = *unit;
  } else {
    const double mma = double(M / 16) * (D / 8) * (bf16 ? 2 : 1);
    const double ldmatrix = double(M / 16) * (bf16 ? 2 : 1) + double(M / 16) * (D / 16);
    perUnit = mma + ldmatrix + 13.4 * (D / 8) + 27 + (rotated ? 1.1 * D : 0.0) + (normalised ? 1.25 * D + 8 : 0.0);
    if (pairs == 1) perUnit += 25 + (rotated ? 35 : 0) + 15;  // the round loop: its staging once
    // ptxas's sm_8x code for the same loop is shorter than sm_90's (over
    // eight draws of the SASS grid: 0.70-1.01 of it, most at head_dim 128
    // and few pseudo-heads, 0.83-0.93); fitted to the middle of the two.
    if (ampere) perUnit *= kPremixTensorAmpereIssue;
  }
  // A warp's loop iterations a round: the round itself, or its pairs (and
  // then the round's staging beside them).
  const double perRound = pairs == 1 ? perUnit : pairs * perUnit + staging;
  return double(rounds) * warps * perRound;
}

}  // namespace

PremixCost estimatePremixCost(const KernelSpec& spec, const Schedule& s, const v1::Target& target, int64_t batch,
                              int64_t tokens, const std::optional<PremixIssue>& issue) {
  const DeviceModel device = deviceModel(target);
  const int H = int(spec.heads()), G = int(spec.kv_heads()), P = int(spec.pseudo_heads()), D = int(spec.head_dim());
  const bool rope = spec.rope_theta() > 0, norm = spec.qk_norm() == v1::KernelSpec::rms;
  PremixCost c;
  const int tokensPerCta = int(s.block_m()) / P, threads = int(s.warps()) * 32;
  const double ctas = double(batch) * double((tokens + tokensPerCta - 1) / tokensPerCta);
  double issued = 0;
  const int sources[3] = {H, G, G};
  for (int role = 0; role < 3; ++role) {
    const int M = sources[role], V = premixVector(M, D), lanes = premixLanes(M, D), R = premixRowGroup(M, D);
    c.bytes += double(batch) * double(tokens) * double(M) * D * (1.0 + P) * 2.0;  // raw read, P mixed rows written
    // The warps that mix: those holding a token of the CTA, round by round.
    const int perRound = std::max(threads / lanes, 1);
    if (premixOnTensorCores(M, P, D, tokensPerCta, threads / 32)) {  // premixIssueOf checked the loop's path
      const bool rotated = role < 2 && rope, normalised = role < 2 && norm;
      const std::optional<double> unit = issue ? std::optional<double>(issue->perGroup[role]) : std::nullopt;
      issued += ctas * premixTensorIssue(M, P, D, tokensPerCta, threads / 32, spec.dtype() == v1::bfloat16, rotated,
                                         normalised, target.arch().rfind("sm_8", 0) == 0, unit);
      continue;
    }
    double warpRounds = 0;
    for (int first = 0; first < tokensPerCta; first += perRound)
      warpRounds += double((std::min(perRound, tokensPerCta - first) * lanes + 31) / 32);
    const double groups = double(P) * M / R;
    double perGroup = issue ? issue->perGroup[role] : 0.0;
    if (!issue) {
      // The loop's parts as the machine code has them (docs/performance.md,
      // The premix): the FMAs, the weights' vector loads, the packs and
      // stores with their addresses, the loop; RoPE's angles, shuffles and
      // rotation; qk_norm's squares, reduction and scale.
      const bool rotated = role < 2 && rope, normalised = role < 2 && norm;
      perGroup = double(M) * R * V + double(M) * R / 4 + R * (V / 2.0 + 3) + 20;
      if (rotated) perGroup += V * 12.0 + R * V * 2.0;
      if (normalised) perGroup += R * (2.0 * V + 2.0 * std::log2(double(lanes)) + 2);
    }
    issued += ctas * warpRounds * groups * perGroup;
  }
  c.memorySeconds = c.bytes / device.dramBytesPerSecond;
  c.issueSeconds = issued / (device.fmaFlops / 64.0);  // warp instructions: 4 a cycle an SM
  c.issueFromSass = issue.has_value();
  return c;
}

CostEstimate estimateCost(const KernelSpec& spec, const Schedule& s, const v1::Target& target, int64_t batch,
                          int64_t tokens, std::optional<int> registersPerThread, const std::optional<LoopIssue>& issue,
                          const std::optional<PremixIssue>& premixIssue) {
  const DeviceModel device = deviceModel(target);
  const int64_t H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  const int64_t L = tokens * P, heads = batch * H;
  const int64_t bm = s.block_m(), bn = s.block_n();
  const bool fusedMix = s.mix() != v1::mix_materialized;
  const bool fusedGlobal = s.collapse() == v1::collapse_fused && spec.collapse() == v1::global;
  const BlockCounts blocks = countBlocks(spec, bm, bn, tokens);

  CostEstimate e;
  e.usefulFlops = ihaFlops(spec, batch, tokens);
  e.matrixFlops = 4.0 * double(heads) * double(blocks.visited) * double(bm * bn * ((d + 15) / 16 * 16));
  const double exps = double(heads) * double(blocks.visited) * double(bm * bn);
  const double maskOps = double(heads) * double(blocks.masked) * double(bm * bn) * 8;
  // Mixing: G multiply-adds per element; fused redoes it for every visit of
  // a key block (and per query block), materialised does it once. Rotated
  // keys are mixed in pairs of chunks d/2 apart (once an element); a
  // rotated query chunk mixes its partner again.
  const double rope = spec.rope_theta() > 0 ? 2.0 : 1.0;
  const double kvMixPerVisit = double(bn * d) * double(G) * 2.0 * 2.0;
  double mixFlops = fusedMix ? double(heads) * (double(blocks.visited) * kvMixPerVisit + double(L * d * H) * 2 * rope)
                             : double(batch) * double(L * d) * 2.0 * (double(H * H) + 2.0 * G * G);
  // qk_norm: a square-and-add and a scale per q and k element; fused keys
  // are normalised again at every visit (their scores scaled per column).
  if (spec.qk_norm() == v1::KernelSpec::rms)
    mixFlops += fusedMix ? double(heads) * (double(blocks.visited) * (3.0 * bn * d + bm * bn) + 3.0 * double(L * d))
                         : double(batch) * double(L * d) * 3.0 * double(H + G);

  // Materialised mixing is its own launch (iha_premix) before attention:
  // it reads the raw q, k, v and writes the mixed rows, which the attention
  // launch reads; its mixing FLOP are its own, not the attention loop's.
  const double outBytes = double(batch) * double(tokens) * double(H * d) * kBytes16;
  const double rawBytes = operandBytes(spec, batch, tokens) - outBytes;
  const double mixedBytes = double(batch) * L * (H + 2.0 * G) * d * kBytes16;
  double bytes = fusedMix ? rawBytes + outBytes : mixedBytes + outBytes;
  const double premixBytes = fusedMix ? 0.0 : rawBytes + mixedBytes;
  if (!fusedMix) mixFlops = 0;
  if (s.collapse() == v1::collapse_separate) bytes += 2.0 * double(batch) * L * H * d * kBytes16;
  e.dramBytes = bytes + premixBytes;
  // K/V re-reads per visit come mostly from L2.
  const double kvRawRows = fusedMix ? double(G) * (double(bn) / P + 2.0) : double(bn);
  const double l2Bytes = double(heads) * double(blocks.visited) * kvRawRows * d * 2.0 * kBytes16;

  // Occupancy from shared memory and registers. The wgmma engine adds a
  // producer warpgroup and, moving registers with setmaxnreg, owns the SM.
  const bool wgmma = s.engine() == v1::engine_wgmma;
  const int threads = (s.warps() + (wgmma ? 4 : 0)) * 32;
  const int registers =
      registersPerThread.value_or(int(std::min<int64_t>(kMaxThreadRegisters, estimatedRegisters(spec, s))));
  const int64_t smem = target.kind() != v1::Target::cuda
                           ? 0
                           : ctaSharedMemory(wgmma, int(bm), int(bn), int(d), s.stages(), int(H), int(G), int(P),
                                             fusedMix, s.collapse() != v1::collapse_separate, fusedGlobal);
  e.ctasPerSm = ctasPerSmOf(device, smem, registers, threads, wgmma);
  if (e.ctasPerSm == 0) {
    e.seconds = 1e9;  // cannot launch
    e.bound = "resources";
    return e;
  }
  const int64_t owned = bm / P * P;
  const int64_t gridCtas = (L + owned - 1) / owned * (fusedGlobal ? 1 : H) * batch;
  const double slots = double(device.smCount) * e.ctasPerSm;
  e.waveEfficiency = scheduledEfficiency(blocks.perQueryBlock, (fusedGlobal ? 1 : H) * batch, slots);
  const double activeWarps = std::min<double>(double(e.ctasPerSm) * s.warps(), double(gridCtas) / device.smCount * s.warps());
  // mma.sync needs many warps in flight; wgmma two consumer warpgroups (one
  // computes while the other runs its softmax).
  const double tensorShare =
      wgmma ? device.wgmmaEfficiency * std::min(1.0, double(s.warps()) / kWarpsToSaturateTensorCores)
            : device.mmaSyncEfficiency * std::min(1.0, activeWarps / kWarpsToSaturateTensorCores);
  // A fused global collapse runs H heads in one CTA: the grid is H times smaller.
  const double utilisation = std::min(1.0, double(gridCtas) / device.smCount) * e.waveEfficiency;

  const double tensorTime = e.matrixFlops / (device.tensorFlops * tensorShare);
  const double paddedDim = double((d + 15) / 16 * 16);
  const double expTime = exps / device.expPerSecond;
  const double simtTime = (mixFlops + maskOps) / device.fmaFlops;
  // Every warp reads the whole K and V tile of each visited block through
  // ldmatrix: shared-memory traffic per FLOP falls as block_m per warp grows.
  // wgmma reads them once per warpgroup.
  const double readers = wgmma ? s.warps() / 4.0 : double(s.warps());
  const double sharedBytes = double(heads) * double(blocks.visited) * readers * 2.0 * bn * paddedDim * kBytes16;
  const double sharedTime = sharedBytes / device.sharedBytesPerSecond;
  // Per key block every warp also issues its loop: the pipeline, the
  // softmax reductions, and its share of the block's copies (a CTA of few
  // warps copies the whole tile with few threads). On the wgmma engine the
  // producer copies; the consumers' loop remains.
  const double copyInstructions =
      wgmma ? 0.0 : 2.0 * double(bn) * paddedDim * kBytes16 / (kCopyBytes * kLaneCount * double(s.warps()));
  const double loopOps = double(heads) * double(blocks.visited) * double(s.warps()) * kLaneCount *
                         (kLoopInstructionsPerWarp + copyInstructions);
  // The output is rescaled at every block: one multiply per element.
  const double rescaleOps = double(heads) * double(blocks.visited) * double(bm) * paddedDim;
  const double loopTime = (loopOps + rescaleOps) / device.fmaFlops;
  double computeTime = std::max(tensorTime, sharedTime) +
                       (wgmma ? kWgmmaExposedSimtShare : kExposedSimtShare) * (expTime + simtTime + loopTime);
  if (wgmma && issue) {
    // The machine code's loop: warp instructions issue at 4 a cycle an SM
    // (fmaFlops / 64 over the device: 2 FLOP x 128 lanes a cycle an SM), its
    // MUFU.EX2 at 16 lanes a cycle an SM (fmaFlops / 512).
    const double warps = double(heads) * double(s.warps());
    const double unmaskedBlocks = double(blocks.visited - blocks.masked), maskedBlocks = double(blocks.masked);
    const double issued = warps * (unmaskedBlocks * issue->unmasked + maskedBlocks * issue->masked);
    const double issueTime = issued / (device.fmaFlops / 64.0) / std::max(tensorShare / device.wgmmaEfficiency, 1e-3);
    const double mufuTime =
        warps * double(blocks.visited) * issue->exponentials / (device.fmaFlops / 512.0);
    const double softmaxTime = std::max(issueTime, mufuTime);
    const double hidden = issue->pingPong ? 1.0 : issue->exponentials > 0 ? issue->inWindow / issue->exponentials : 0.0;
    const double busy = std::max(tensorTime, sharedTime);
    computeTime = std::max(busy, softmaxTime) + (1.0 - hidden) * std::min(busy, softmaxTime) +
                  kWgmmaExposedSimtShare * simtTime;
  }
  // q, k, v and out from DRAM once (more with workspaces), and every query
  // block's re-reads of its K and V blocks from L2: a block of few rows reads
  // the same keys many times over.
  const double memoryTime = bytes / device.dramBytesPerSecond + l2Bytes / device.l2BytesPerSecond;
  // With one stage the loads are not overlapped with the math (unless K and
  // V split it: loom::splitKvPipeline); with more, a share of the smaller
  // stays exposed.
  const double exposed = wgmma ? kWgmmaExposedOverlapShare : kExposedOverlapShare;
  const bool pipelined = s.stages() > 1 || (!wgmma && splitKvPipeline(int(s.stages()), fusedMix, /*decode=*/false,
                                                                      int(s.warps()) * kLaneCount, int(d)));
  const double kernelTime = pipelined
                                ? std::max(computeTime, memoryTime) + exposed * std::min(computeTime, memoryTime)
                                : computeTime + memoryTime;
  // The premix launch: a grid over every token, bound by its bytes or by
  // the instructions it issues, whichever is larger.
  if (!fusedMix) {
    const PremixCost premix = estimatePremixCost(spec, s, target, batch, tokens, premixIssue);
    e.premixSeconds = std::max(premix.memorySeconds, premix.issueSeconds) + kLaunchSeconds;
  }
  const int launches = 1 + (s.collapse() == v1::collapse_separate ? 1 : 0);
  e.seconds = kernelTime / std::max(utilisation, 1e-3) + launches * kLaunchSeconds + e.premixSeconds;
  const double parts[] = {tensorTime, memoryTime, expTime, simtTime, sharedTime, e.premixSeconds};
  const char* names[] = {"tensor", "memory", "exp", "mixing", "shared memory", "premix"};
  e.bound = names[std::max_element(parts, parts + 6) - parts];
  return e;
}

CostEstimate estimateBackwardCost(const KernelSpec& spec, const Schedule& s, const v1::Target& target, int64_t batch,
                                  int64_t tokens, std::optional<int> registersPerThread,
                                  const std::optional<BackwardIssue>& issue) {
  const DeviceModel device = deviceModel(target);
  const int64_t H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  const int64_t L = tokens * P, heads = batch * H;
  const int64_t bm = s.block_m(), bn = s.block_n();
  const double paddedDim = double((d + 15) / 16 * 16);
  const BlockCounts blocks = countBlocks(spec, bm, bn, tokens);
  // The forward recomputed (2 products), the key-block-outer launch (4), and
  // dq: its own launch recomputing S, P and dP (3), or one product added to
  // the key-block-outer launch (dq atomic). A head past 128 columns is split
  // into parts (layout.h, backwardColumnParts), each a CTA computing S and
  // dP (and their exponentials) again over every column.
  // On wgmma the dq launch takes every column (layout.h, backwardDqParts).
  const bool atomicDq = s.dq() == v1::dq_atomic, wgmma = s.engine() == v1::engine_wgmma;
  const double columnParts = backwardColumnParts(int(d), wgmma);
  const double dqParts = backwardDqParts(int(d), wgmma);
  const double kProducts = 2 + (2 * columnParts + 2) + (atomicDq ? 1 : 2 * dqParts + 1);
  const double kExps = 1 + columnParts + (atomicDq ? 0 : dqParts);

  CostEstimate e;
  e.usefulFlops = ihaBackwardFlops(spec, batch, tokens);
  e.matrixFlops = 2.0 * kProducts * double(heads) * double(blocks.visited) * double(bm * bn) * paddedDim;
  const double exps = kExps * double(heads) * double(blocks.visited) * double(bm * bn);
  const double maskOps = kExps * double(heads) * double(blocks.masked) * double(bm * bn) * 8;
  // Mixing (pre-mix), its transpose (dx and dalpha: twice the work), and qk_norm's Jacobian.
  const double rope = spec.rope_theta() > 0 ? 2.0 : 1.0;
  double mixFlops = 3.0 * double(batch) * double(L * d) * 2.0 * (double(H * H) + 2.0 * G * G) * rope;
  if (spec.qk_norm() == v1::KernelSpec::rms) mixFlops += double(batch) * double(L * d) * 9.0 * double(H + G);

  const double rowBytes16 = double(batch) * L * d * kBytes16, rowBytes32 = double(batch) * L * d * 4.0;
  double bytes = operandBytes(spec, batch, tokens) + double(batch) * tokens * H * d * kBytes16;  // + dout
  bytes += 2.0 * rowBytes16 * (H + 2.0 * G);   // mixed rows written, read
  bytes += 4.0 * rowBytes16 * H;               // o and do, each written and read
  bytes += 2.0 * rowBytes32 * (H + 2.0 * G);   // pseudo-row gradients written, read
  bytes += double(batch) * tokens * (H + 2.0 * G) * d * 4.0;  // dq, dk, dv
  e.dramBytes = bytes;
  // Re-reads: the forward's (and the dq loop's) K and V per visit, the
  // key-block loop's Q and do per visit; dq atomic adds block_m x d f32 per
  // visit in L2 (a read-modify-write: counted twice).
  double l2Bytes =
      double(heads) * double(blocks.visited) * 2.0 * (bn + columnParts * bm + (atomicDq ? 0.0 : dqParts * bn)) * d *
      kBytes16;
  if (atomicDq) l2Bytes += double(heads) * double(blocks.visited) * double(bm) * d * 4.0 * 2.0;

  const int threads = s.warps() * 32;
  const int registers = registersPerThread.value_or(int(std::min<int64_t>(kMaxThreadRegisters, 200)));
  const int64_t smem = target.kind() != v1::Target::cuda ? 0
                       : wgmma ? std::max(backwardWgmmaSmem(int(bm), int(bn), int(d)).total,
                                          backwardWgmmaDqSmem(int(bm), int(bn), int(d)).total)
                               : backwardSmem(int(bm), int(bn), int(d), atomicDq).total;
  // (The key-block-outer launch, the longest; on wgmma only the dq launch
  // adds a producer warpgroup, within its CTAs' share.)
  e.ctasPerSm = ctasPerSmOf(device, smem, registers, threads);
  if (e.ctasPerSm == 0) {
    e.seconds = 1e9;
    e.bound = "resources";
    return e;
  }
  const int64_t gridCtas = (L + bn - 1) / bn * G * int64_t(columnParts) * batch;  // the key-block-outer launch, the longest
  const double slots = double(device.smCount) * e.ctasPerSm;
  e.waveEfficiency = double(gridCtas) / (std::ceil(double(gridCtas) / slots) * slots);
  const double activeWarps = std::min<double>(double(e.ctasPerSm) * s.warps(), double(gridCtas) / device.smCount * s.warps());
  // wgmma: its rate with one warpgroup a CTA, mma.sync's share with many warps.
  const double tensorShare =
      wgmma ? device.wgmmaEfficiency * std::min(1.0, activeWarps / kWarpsToSaturateTensorCores)
            : device.mmaSyncEfficiency * std::min(1.0, activeWarps / kWarpsToSaturateTensorCores);
  const double utilisation = std::min(1.0, double(gridCtas) / device.smCount) * e.waveEfficiency;
  const double tensorTime = e.matrixFlops / (device.tensorFlops * tensorShare);
  const double expTime = exps / device.expPerSecond;
  const double simtTime = (mixFlops + maskOps) / device.fmaFlops;
  // Every warp reads its operand tiles through ldmatrix: about four tile
  // reads per product; wgmma reads them once a warpgroup.
  const double readers = wgmma ? s.warps() / 4.0 : double(s.warps());
  const double sharedBytes =
      double(heads) * double(blocks.visited) * kProducts * readers * (bm + bn) / 2.0 * paddedDim * kBytes16;
  const double sharedTime = sharedBytes / device.sharedBytesPerSecond;
  double computeTime = std::max(tensorTime, sharedTime) + kExposedSimtShare * (expTime + simtTime);
  if (wgmma && issue) {
    // The machine code's loops: each visited pair is one iteration of the
    // key-block-outer loop in each of its parts' CTAs and one of the dq loop
    // in each of its own, their warps issuing 4 instructions a cycle an SM
    // (fmaFlops / 64 over the device).
    const double warps = double(heads) * double(s.warps());
    const double unmasked = double(blocks.visited - blocks.masked), masked = double(blocks.masked);
    const double issued =
        warps * (unmasked * (columnParts * issue->kv.unmasked + dqParts * issue->q.unmasked) +
                 masked * (columnParts * issue->kv.masked + dqParts * issue->q.masked));
    const double issueTime = issued / (device.fmaFlops / 64.0);
    computeTime = std::max(std::max(tensorTime, sharedTime), issueTime) + kWgmmaExposedSimtShare * simtTime;
  }
  const double memoryTime = bytes / device.dramBytesPerSecond + l2Bytes / device.l2BytesPerSecond;
  // mma.sync: the loads are not pipelined (cp.async, then wait), the smaller
  // of the two stays exposed whole; wgmma: TMA fetches the next block while
  // this one is used.
  const double kernelTime = wgmma ? std::max(computeTime, memoryTime) +
                                        kWgmmaExposedOverlapShare * std::min(computeTime, memoryTime)
                                  : computeTime + memoryTime;
  const int kLaunches = atomicDq ? 6 : 7;
  e.seconds = kernelTime / std::max(utilisation, 1e-3) + kLaunches * kLaunchSeconds;
  const double parts[] = {tensorTime, memoryTime, expTime, simtTime, sharedTime};
  const char* names[] = {"tensor", "memory", "exp", "mixing", "shared memory"};
  e.bound = names[std::max_element(parts, parts + 5) - parts];
  return e;
}

namespace {
// Tokens of the cache a new row can see: all of them, or a window's. W
// counts original tokens whatever its alignment (docs/IHA.md); window_rows
// R counts virtual rows, which reach ceil(R / P) tokens back (one more
// where they start within a token).
int64_t visibleTokens(const KernelSpec& spec, int64_t cachedTokens, int64_t newTokens) {
  const int64_t all = cachedTokens + newTokens, P = spec.pseudo_heads();
  const int64_t back = spec.window() > 0        ? spec.window()
                       : spec.window_rows() > 0 ? (spec.window_rows() + P - 1) / P + 1
                                                : all;
  return std::min(all, back + newTokens);
}
// A CTA keeps this many of its cp.async copies in flight per SM slot: one
// decode CTA alone cannot pull an SM's share of the bandwidth.
constexpr double kCtasToSaturateAnSm = 2.0;
}  // namespace

double decodeCacheBytes(const KernelSpec& spec, int64_t batch, int64_t cachedTokens, int64_t newTokens,
                        bool mixedCache) {
  const double perToken = 2.0 * spec.kv_heads() * (mixedCache ? spec.pseudo_heads() : 1) * spec.head_dim() * kBytes16;
  return double(batch) * double(visibleTokens(spec, cachedTokens, newTokens)) * perToken;
}

double ihaDecodeFlops(const KernelSpec& spec, int64_t batch, int64_t cachedTokens, int64_t newTokens) {
  const int64_t P = spec.pseudo_heads();
  return 4.0 * double(spec.head_dim()) * double(spec.heads()) * double(batch) * double(newTokens * P) *
         double(visibleTokens(spec, cachedTokens, newTokens) * P);
}

namespace {

// A decode step's attention grid: its CTAs (query blocks x heads, or kv
// groups stacked, x splits x batch) and each one's key blocks.
struct DecodeGrid {
  int64_t splits = 1, blocksPerCta = 0, ctas = 0;
};
DecodeGrid decodeGrid(const KernelSpec& spec, const Schedule& s, int64_t batch, int64_t cachedTokens,
                      int64_t newTokens) {
  const int64_t H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads();
  DecodeGrid grid;
  grid.splits = std::max<int64_t>(1, s.kv_splits());
  // Stacked, a CTA holds every query head of its kv group (block_m / (H / G)
  // rows of each): H / G times fewer CTAs stage and mix the cache; absorbed
  // and tensor mixing, every query head (or chunks of them: stepHeads).
  const bool oneCta = s.absorb_mixing() || s.tensor_mixing();
  const int64_t stacked = oneCta            ? oneCtaHeads(s.tensor_mixing(), int(H), int(G), int(P), int(spec.head_dim()))
                          : s.stack_heads() ? H / G
                                            : 1;
  const int64_t ownedRows = std::max<int64_t>(P, s.block_m() / stacked / P * P);
  const int64_t queryBlocks = (newTokens * P + ownedRows - 1) / ownedRows;
  const int64_t keyBlocks = (visibleTokens(spec, cachedTokens, newTokens) * P + s.block_n() - 1) / s.block_n();
  grid.blocksPerCta = (keyBlocks + grid.splits - 1) / grid.splits;
  grid.ctas = queryBlocks * (H / stacked) * grid.splits * batch;
  return grid;
}

// Dynamic shared memory of a decode step's attention CTA.
int64_t decodeSharedMemory(const KernelSpec& spec, const Schedule& s, bool mixedCache) {
  const int H = int(spec.heads()), G = int(spec.kv_heads()), P = int(spec.pseudo_heads()), d = int(spec.head_dim());
  if (s.tensor_mixing())
    return tensorMixingSmem(oneCtaHeads(true, H, G, P, d), d, int(s.stages()), H, G).total;
  if (s.absorb_mixing())
    return absorbedSmem(int(s.block_m()), d, int(s.stages()), G, P, int(s.warps()),
                        spec.qk_norm() == v1::KernelSpec::rms)
        .total;
  return ctaSharedMemory(s.engine() == v1::engine_wgmma, int(s.block_m()), int(s.block_n()), d, int(s.stages()), H,
                         G, P, !mixedCache, s.collapse() == v1::collapse_fused,
                         s.collapse() == v1::collapse_fused && spec.collapse() == v1::global);
}

}  // namespace

CostEstimate estimateDecodeCost(const KernelSpec& spec, const Schedule& s, const v1::Target& target, int64_t batch,
                                int64_t cachedTokens, int64_t newTokens, bool mixedCache,
                                std::optional<int> registersPerThread) {
  const DeviceModel device = deviceModel(target);
  const int64_t H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  const DecodeGrid grid = decodeGrid(spec, s, batch, cachedTokens, newTokens);
  const int64_t splits = grid.splits, blocksPerCta = grid.blocksPerCta, gridCtas = grid.ctas;
  const double paddedDim = double((d + 15) / 16 * 16);

  CostEstimate e;
  e.usefulFlops = ihaDecodeFlops(spec, batch, cachedTokens, newTokens);
  const bool absorbed = s.absorb_mixing() || s.tensor_mixing();  // a CTA of every head: its block work
  const AbsorbedBlockWork absorbedWork = absorbed ? allHeadsBlockWork(spec, s) : AbsorbedBlockWork{};
  e.matrixFlops = absorbed ? double(gridCtas) * double(blocksPerCta) * absorbedWork.matrixFlops
                           : 4.0 * double(gridCtas) * double(blocksPerCta) * double(s.block_m() * s.block_n()) * paddedDim;
  // Each CTA's share of the cache: a raw one's G heads per token, a mixed
  // one's P rows of the CTA's group.
  const double tokensPerCta = double(blocksPerCta * s.block_n()) / double(P);
  const double perToken = 2.0 * double(mixedCache ? P : G) * double(d) * kBytes16;
  const double l2Bytes = double(gridCtas) * tokensPerCta * perToken;
  e.dramBytes = decodeCacheBytes(spec, batch, cachedTokens, newTokens, mixedCache) +
                2.0 * double(batch) * double(newTokens) * double(H + 2 * G) * double(d) * kBytes16;
  // The combine: every split's rows (f32, lse beside) written, then read.
  if (splits > 1) e.dramBytes += 2.0 * double(batch * H * splits * newTokens * P) * double(d + 1) * 4.0;
  // A raw cache is mixed (and its keys rotated) on chip: each key or value
  // row from the G heads' rows of its token (rotated keys in pairs of
  // chunks, each element mixed once).
  // Absorbed, nothing is mixed: its f32 work is the combination, the fold
  // and the rotation (absorbedBlockWork).
  const double mixFlops = absorbed     ? double(gridCtas) * double(blocksPerCta) * absorbedWork.simtFlops
                          : mixedCache ? 0.0
                                       : double(gridCtas) * double(blocksPerCta * s.block_n()) * 2.0 * double(G) *
                                             double(d) * 2.0;
  const double exps = absorbed ? double(gridCtas) * double(blocksPerCta) * absorbedWork.exps
                               : double(gridCtas) * double(blocksPerCta) * double(s.block_m() * s.block_n());

  // wgmma (sm_90a): one CTA an SM with its producer warpgroup, which alone
  // mixes (or copies) the pages while the consumers' products overlap it.
  const bool wgmma = s.engine() == v1::engine_wgmma;
  const int threads = (s.warps() + (wgmma ? kWarpgroupWarps : 0)) * 32;
  const int registers = registersPerThread.value_or(int(estimatedRegisters(spec, s)));
  e.ctasPerSm = ctasPerSmOf(device, decodeSharedMemory(spec, s, mixedCache), registers, threads, wgmma);
  if (e.ctasPerSm == 0) {
    e.seconds = 1e9;
    e.bound = "resources";
    return e;
  }
  const double slots = double(device.smCount) * e.ctasPerSm;
  e.waveEfficiency = double(gridCtas) / (std::ceil(double(gridCtas) / slots) * slots);
  // The share of the bandwidth the grid can pull: kCtasToSaturateAnSm CTAs
  // per SM in flight reach an SM's share.
  const double bandwidthShare =
      std::min(1.0, double(gridCtas) / (device.smCount * std::min<double>(kCtasToSaturateAnSm, e.ctasPerSm))) *
      e.waveEfficiency;
  const double memoryTime = e.dramBytes / device.dramBytesPerSecond + l2Bytes / device.l2BytesPerSecond;
  const double computeShare = std::min(1.0, double(gridCtas) / device.smCount) * e.waveEfficiency;
  const double tensorTime =
      e.matrixFlops / (device.tensorFlops * (wgmma ? device.wgmmaEfficiency : device.mmaSyncEfficiency));
  // On mma.sync every warp mixes, then multiplies; on wgmma the producer's
  // four warps mix (half the issue rate of the eight that saturate an SM)
  // while the consumers multiply: compute is the longer of the two.
  const double mixTime = mixFlops / device.fmaFlops;
  const double expTime = exps / device.expPerSecond;
  const double simtTime =
      wgmma ? std::max(mixTime * kWarpsToSaturateTensorCores / kWarpgroupWarps - tensorTime - expTime, 0.0) + expTime
            : mixTime + expTime;
  // A CTA's key blocks run one after another: its loop's issue latency.
  const double loopTime = double(blocksPerCta) * kLoopInstructionsPerWarp * 4.0 / 1.5e9 *
                          std::ceil(double(gridCtas) / slots);
  const int launches = 3 + (splits > 1 ? 1 : 0);  // append, attention, (combine), collapse
  const double parts[] = {memoryTime / std::max(bandwidthShare, 1e-3),
                          (tensorTime + simtTime) / std::max(computeShare, 1e-3), loopTime};
  e.seconds = *std::max_element(parts, parts + 3) + launches * kLaunchSeconds;
  const char* names[] = {"memory", "compute", "latency"};
  e.bound = names[std::max_element(parts, parts + 3) - parts];
  return e;
}

DecodeFloor estimateDecodeFloor(const KernelSpec& spec, const Schedule& s, const v1::Target& target, int64_t batch,
                                int64_t cachedTokens, int64_t newTokens, bool mixedCache,
                                const std::optional<LoopIssue>& issue) {
  const DeviceModel device = deviceModel(target);
  const int64_t H = spec.heads(), G = spec.kv_heads(), d = spec.head_dim();
  const DecodeGrid grid = decodeGrid(spec, s, batch, cachedTokens, newTokens);
  const int64_t blocksPerCta = grid.blocksPerCta;
  DecodeFloor f;
  f.ctas = grid.ctas;
  f.bytes = decodeCacheBytes(spec, batch, cachedTokens, newTokens, mixedCache) +
            2.0 * double(batch) * double(newTokens) * double(H + 2 * G) * double(d) * kBytes16;
  f.memorySeconds = f.bytes / device.dramBytesPerSecond;
  const bool wgmma = s.engine() == v1::engine_wgmma;
  const double warps = double(s.warps() + (wgmma ? kWarpgroupWarps : 0));
  double perBlock = issue ? issue->unmasked : 0.0;
  const bool allHeads = s.absorb_mixing() || s.tensor_mixing();
  const AbsorbedBlockWork work = allHeads ? allHeadsBlockWork(spec, s) : AbsorbedBlockWork{};
  if (!issue) {
    // A raw cache's rows mixed on chip: G FMAs per element of a key and a
    // value row, over the CTA's warps.
    // Absorbed: its f32 work and its mma.sync instructions (4096 FLOP each).
    const double mixing = allHeads ? (work.simtFlops / 2.0 / 32.0 + work.matrixFlops / 4096.0) / warps
                          : mixedCache ? 0.0
                                       : double(s.block_n() * d) * double(G) * 2.0 / 32.0 / warps;
    perBlock = kLoopInstructionsPerWarp + mixing;
  }
  f.issueFromSass = issue.has_value();
  const double rate = device.fmaFlops / 64.0;                          // warp instructions a second, the device
  const double subPartitionRate = rate / (4.0 * double(device.smCount));  // one sub-partition's
  // The tensor pipe: the products issued, at the model's mma.sync (or
  // wgmma) share of the dense rate.
  const double padded = double(paddedHeadDim(int(d)));
  const double matrixFlops = allHeads ? work.matrixFlops : 4.0 * double(s.block_m() * s.block_n()) * padded;
  f.tensorSeconds = double(f.ctas) * double(blocksPerCta) * matrixFlops /
                    (device.tensorFlops * (wgmma ? device.wgmmaEfficiency : device.mmaSyncEfficiency));
  // The busiest SM's share of the grid (never less than the whole device's
  // issue spread evenly): its CTAs' warps over its four sub-partitions, and
  // at least its CTAs' blocks one after another, as
  // many CTAs at once as it holds (its shared memory, registers and
  // threads allow), each CTA's warps on the sub-partitions. A CTA of one
  // warp issues on one sub-partition of four: two such CTAs an SM issue
  // twice as fast as one; a CTA of four warps or more fills them alone.
  const int registers = issue && issue->registers > 0 ? issue->registers : int(estimatedRegisters(spec, s));
  const int threads = int(warps) * 32;
  const int resident =
      std::max(1, ctasPerSmOf(device, decodeSharedMemory(spec, s, mixedCache), registers, threads, wgmma));
  const double ctaBlocks = double(blocksPerCta) * perBlock / subPartitionRate;  // a warp's blocks
  const double perSm = std::ceil(double(f.ctas) / double(device.smCount));
  const double spread = perSm * warps / 4.0 * ctaBlocks;
  const double chained = std::ceil(perSm / resident) * std::ceil(warps / 4.0) * ctaBlocks;
  f.ctasPerSm = resident;
  f.issueSeconds = std::max(spread, chained);
  return f;
}

}  // namespace loom::autotune
