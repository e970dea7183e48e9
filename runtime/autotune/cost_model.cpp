#include "autotune/cost_model.h"

#include <algorithm>
#include <cmath>

#include "loom/mask_rule.h"
#include "loom/tile/layout.h"

namespace loom::autotune {
namespace {

constexpr double kLaunchSeconds = 3e-6;
constexpr int kMaxCtasPerSm = 32;
constexpr int kWarpsToSaturateTensorCores = 8;
constexpr int kBaseRegisters = 64;  // addresses, loop state, softmax rows
constexpr int kBytes16 = 2;
constexpr int kMmaK = 16;

}  // namespace

int64_t fragmentRegisters(const KernelSpec& spec, const Schedule& s) {
  // wgmma: a consumer thread holds S (block_n / 2), O (d / 2) and P as
  // 16-bit pairs (block_n / 4); Q stays in shared memory.
  if (s.engine() == v1::engine_wgmma) return spec.head_dim() / 2 + 3 * s.block_n() / 4;
  const int64_t mTiles = s.block_m() / (kMmaK * s.warps());
  const int64_t paddedDim = (spec.head_dim() + kMmaK - 1) / kMmaK * kMmaK;
  return mTiles * (paddedDim * 3 / 4 + s.block_n() / 2);
}

DeviceModel deviceModel(const v1::Target& target) {
  DeviceModel m;
  const std::string arch = target.arch();
  const v1::DeviceProperties& p = target.device();
  if (arch.rfind("sm_90", 0) == 0) {  // H100 / H200: bf16 GEMM measured at ~790 TFLOP/s, copy 4.3 TB/s
    // wgmma: FlashAttention-3 reaches ~75% of the matrix rate.
    m = {"hopper", 790e12, 0.40, 60e12, 4.2e12, 4.3e12, 12e12, 33e12, 132, 233472, 65536, 2048,
         arch == "sm_90a" ? 0.70 : 0.0};
  } else if (arch == "sm_80") {  // A100
    m = {"ampere", 280e12, 0.65, 19e12, 1.7e12, 1.8e12, 5e12, 19e12, 108, 167936, 65536, 2048};
  } else {  // sm_86 / sm_89 class
    m = {"ada", 150e12, 0.60, 40e12, 1.4e12, 0.9e12, 3e12, 18e12, 84, 102400, 65536, 1536};
  }
  if (p.sm_count() > 0) m.smCount = p.sm_count();
  if (p.shared_memory_per_multiprocessor() > 0) m.sharedMemoryPerSm = p.shared_memory_per_multiprocessor();
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
  }
  return counts;
}

CostEstimate estimateCost(const KernelSpec& spec, const Schedule& s, const v1::Target& target, int64_t batch,
                          int64_t tokens, std::optional<int> registersPerThread) {
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
  // a key block (and per query block), materialised does it once.
  const double rope = spec.rope_theta() > 0 ? 2.0 : 1.0;
  const double kvMixPerVisit = double(bn * d) * double(G) * 2.0 * (1.0 + rope);
  double mixFlops = fusedMix ? double(heads) * (double(blocks.visited) * kvMixPerVisit + double(L * d * H) * 2 * rope)
                             : double(batch) * double(L * d) * 2.0 * (double(H * H) + 2.0 * G * G);
  // qk_norm: a square-and-add and a scale per q and k element; fused keys
  // are normalised again at every visit (their scores scaled per column).
  if (spec.qk_norm() == v1::KernelSpec::rms)
    mixFlops += fusedMix ? double(heads) * (double(blocks.visited) * (3.0 * bn * d + bm * bn) + 3.0 * double(L * d))
                         : double(batch) * double(L * d) * 3.0 * double(H + G);

  double bytes = operandBytes(spec, batch, tokens);
  if (!fusedMix) bytes += 2.0 * double(batch) * L * (H + 2.0 * G) * d * kBytes16;  // workspaces written and read
  if (s.collapse() == v1::collapse_separate) bytes += 2.0 * double(batch) * L * H * d * kBytes16;
  e.dramBytes = bytes;
  // K/V re-reads per visit come mostly from L2.
  const double kvRawRows = fusedMix ? double(G) * (double(bn) / P + 2.0) : double(bn);
  const double l2Bytes = double(heads) * double(blocks.visited) * kvRawRows * d * 2.0 * kBytes16;

  // Occupancy from shared memory and registers. The wgmma engine adds a
  // producer warpgroup and, moving registers with setmaxnreg, owns the SM.
  const bool wgmma = s.engine() == v1::engine_wgmma;
  const int threads = (s.warps() + (wgmma ? 4 : 0)) * 32;
  const int registers =
      registersPerThread.value_or(int(std::min<int64_t>(255, kBaseRegisters + fragmentRegisters(spec, s))));
  const int64_t smem = target.kind() != v1::Target::cuda
                           ? 0
                           : ctaSharedMemory(wgmma, int(bm), int(bn), int(d), s.stages(), int(H), int(G), int(P),
                                             fusedMix, s.collapse() != v1::collapse_separate, fusedGlobal);
  int ctas = wgmma ? 1 : kMaxCtasPerSm;
  if (smem > 0) ctas = std::min<int64_t>(ctas, device.sharedMemoryPerSm / smem);
  if (!wgmma) ctas = std::min(ctas, device.registersPerSm / std::max(1, registers * threads));
  ctas = std::min(ctas, device.maxThreadsPerSm / threads);
  e.ctasPerSm = std::max(ctas, 0);
  if (e.ctasPerSm == 0) {
    e.seconds = 1e9;  // cannot launch
    e.bound = "resources";
    return e;
  }
  const int64_t owned = bm / P * P;
  const int64_t gridCtas = (L + owned - 1) / owned * (fusedGlobal ? 1 : H) * batch;
  const double slots = double(device.smCount) * e.ctasPerSm;
  const double waves = std::ceil(double(gridCtas) / slots);
  e.waveEfficiency = double(gridCtas) / (waves * slots);
  const double activeWarps = std::min<double>(double(e.ctasPerSm) * s.warps(), double(gridCtas) / device.smCount * s.warps());
  // mma.sync needs many warps in flight; wgmma two consumer warpgroups (one
  // computes while the other runs its softmax).
  const double tensorShare =
      wgmma ? device.wgmmaEfficiency * std::min(1.0, double(s.warps()) / kWarpsToSaturateTensorCores)
            : device.mmaSyncEfficiency * std::min(1.0, activeWarps / kWarpsToSaturateTensorCores);
  // A fused global collapse runs H heads in one CTA: the grid is H times smaller.
  const double utilisation = std::min(1.0, double(gridCtas) / device.smCount) * e.waveEfficiency;

  const double tensorTime = e.matrixFlops / (device.tensorFlops * tensorShare);
  const double expTime = exps / device.expPerSecond;
  const double simtTime = (mixFlops + maskOps) / device.fmaFlops;
  // Every warp reads the whole K and V tile of each visited block through
  // ldmatrix: shared-memory traffic per FLOP falls as block_m per warp grows.
  // wgmma reads them once per warpgroup.
  const double paddedDim = double((d + 15) / 16 * 16);
  const double readers = wgmma ? s.warps() / 4.0 : double(s.warps());
  const double sharedBytes = double(heads) * double(blocks.visited) * readers * 2.0 * bn * paddedDim * kBytes16;
  const double sharedTime = sharedBytes / device.sharedBytesPerSecond;
  const double computeTime = std::max(tensorTime, sharedTime) + expTime + simtTime;  // issued in turn by each warp
  const double memoryTime = bytes / device.dramBytesPerSecond + l2Bytes / device.l2BytesPerSecond;
  // With one stage the loads are not overlapped with the math.
  const double kernelTime = s.stages() > 1 ? std::max(computeTime, memoryTime) : computeTime + memoryTime;
  const int launches = 1 + (fusedMix ? 0 : 1) + (s.collapse() == v1::collapse_separate ? 1 : 0);
  e.seconds = kernelTime / std::max(utilisation, 1e-3) + launches * kLaunchSeconds;
  const double parts[] = {tensorTime, memoryTime, expTime, simtTime, sharedTime};
  const char* names[] = {"tensor", "memory", "exp", "mixing", "shared memory"};
  e.bound = names[std::max_element(parts, parts + 5) - parts];
  return e;
}

}  // namespace loom::autotune
