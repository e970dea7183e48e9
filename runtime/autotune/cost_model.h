// A static cost model: a roofline over the work a schedule really does
// (the key blocks iha-analyze-mask lets it visit, its mixing and collapse
// placement), scaled by occupancy, wave quantisation and pipelining. It
// orders candidates before anything is compiled, and is the ranking used
// when no GPU is present (such results are marked untimed).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "loom/spec.h"

namespace loom::autotune {

// Names the model's ranking: a choice kept in the kernel cache under an
// older version is ranked again. Change it with any change that can reorder
// the model's candidates.
inline constexpr const char* kCostModelVersion = "cost-model-2026-12-04-premix-issue";

// Ceilings of a device, from measurements where the workplace has them
// (docs/gpu-results.md) and vendor figures otherwise.
struct DeviceModel {
  std::string name;
  double tensorFlops = 0;        // dense f16/bf16 matrix rate, FLOP/s
  double mmaSyncEfficiency = 0;  // share of it mma.sync kernels reach
  double fmaFlops = 0;           // f32 FMA rate (mixing, masks)
  double expPerSecond = 0;       // special-function unit rate
  double dramBytesPerSecond = 0;
  double l2BytesPerSecond = 0;
  double sharedBytesPerSecond = 0;  // all SMs' shared-memory (ldmatrix) bandwidth
  int smCount = 0;
  int64_t sharedMemoryPerSm = 0;
  int registersPerSm = 0;
  int maxThreadsPerSm = 0;
  double wgmmaEfficiency = 0;    // share warp-specialised wgmma kernels reach (0: no wgmma)
};

DeviceModel deviceModel(const v1::Target& target);

// Key blocks visited by all query blocks of one (batch entry, head), and of
// those the ones that need an element-wise mask; and each query block's
// visits, first to last (a causal mask makes them uneven).
struct BlockCounts {
  int64_t visited = 0;
  int64_t masked = 0;
  std::vector<int64_t> perQueryBlock;
};
BlockCounts countBlocks(const KernelSpec& spec, int64_t blockM, int64_t blockN, int64_t tokens);

struct CostEstimate {
  double seconds = 0;
  double matrixFlops = 0;  // tensor-core work actually issued
  double usefulFlops = 0;  // 4 * d * allowed pairs (docs/IHA.md)
  double dramBytes = 0;
  int ctasPerSm = 0;
  // The grid's work over the CTA slots as the hardware starts them, in
  // launch order (query blocks heaviest first, as loom's CUDA grids run):
  // the mean load over the busiest slot's (1: even waves).
  double waveEfficiency = 0;
  double premixSeconds = 0;  // materialised mixing: its own launch (bytes, mixing FLOP), within `seconds`
  std::string bound;  // "tensor", "memory", "exp", "mixing"
};

// The machine code's figures of a compiled wgmma candidate's attention
// loops (runtime/jit/sass.h; SassLoop): instructions one warp issues per
// unmasked and per masked key block, its exponentials, how many of them sit
// in the P V window, and whether the consumer warpgroups ping-pong.
struct LoopIssue {
  double unmasked = 0;  // instructions per warp per unmasked key block
  double masked = 0;    // per masked key block (0: as unmasked)
  double exponentials = 0;
  double inWindow = 0;  // of the exponentials
  bool pingPong = false;
  int registers = 0;  // a thread's, as ptxas allocated them (0: not read)
};
// From a compiled kernel's attention-entry figures; nullopt without them.
std::optional<LoopIssue> loopIssueOf(const v1::ResourceUsage& attention);

// The machine code's figures of a compiled premix launch (iha_premix;
// cuda_common.h premix): for q, k and v (in address order, which is the
// order of the roles) the instructions one warp issues per iteration of the
// role's mixing loop: on the FMA units the innermost loop holding fp32 work,
// a group of R mixed rows; on the tensor cores (premixTensor, layout.h
// premixOnTensorCores) the innermost loop holding HMMA, a round of tokens
// (its staging counted once) or, where a warp takes several m-tiles a
// round, one (token, m-tile) pair.
struct PremixIssue {
  double perGroup[3] = {0, 0, 0};
};
// From a compiled premix entry's figures, its spec and schedule (which
// roles mix on the tensor cores); nullopt without them.
std::optional<PremixIssue> premixIssueOf(const v1::ResourceUsage& premix, const KernelSpec& spec,
                                         const Schedule& schedule);

// Materialised mixing's own launch: the bytes it must move (raw q, k, v
// read once, the mixed rows written once) at the DRAM bandwidth, and the
// instructions it issues (every warp's mixing groups, layout.h premix*
// geometry; `issue` from the machine code, else estimated from the same
// loop's parts) at four warp instructions a cycle an SM. The mixing loops
// only: the loads, the weights' staging and the round's set-up add about
// 5% at the paper's settings.
struct PremixCost {
  double bytes = 0;
  double memorySeconds = 0;  // the floor
  double issueSeconds = 0;
  bool issueFromSass = false;
  double floorRatio() const { return memorySeconds > 0 ? issueSeconds / memorySeconds : 0; }
};
PremixCost estimatePremixCost(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                              int64_t batch, int64_t tokens, const std::optional<PremixIssue>& issue = std::nullopt);

// `registersPerThread` from ptxas when known, else estimated. With `issue`
// (a compiled wgmma candidate), the softmax's cost is the machine code's:
// its loop's instructions at one a cycle on each of an SM's four
// sub-partitions (and its exponentials at the special-function unit's
// rate), hidden under the tensor time as far as the ping-pong (wholly) or
// the exponentials in the P V window (their share) hide it, in place of the
// assumed exposed share.
CostEstimate estimateCost(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target, int64_t batch,
                          int64_t tokens, std::optional<int> registersPerThread = std::nullopt,
                          const std::optional<LoopIssue>& issue = std::nullopt,
                          const std::optional<PremixIssue>& premixIssue = std::nullopt);

// The backward plan (docs/compiler.md, The backward): the forward's
// attention recomputed (two products per visited block pair), the
// key-block-outer launch (four: S^T, dV, dP^T, dK) and the dq launch
// (three: S, dP, dq), with three exponentials per pair; the workspaces
// (mixed rows, o and do 16-bit; the pseudo-row gradients f32) written and
// read once, each loop's re-reads of the other side's blocks from L2; the
// key-block-outer launch's grid (key blocks x kv heads x batch) and
// occupancy (its shared memory, `registersPerThread` from ptxas when known)
// set the utilisation. On wgmma (sm_90a): the tensor pipe at wgmma's rate,
// operands read once a warpgroup, the loads by TMA overlapped; with `issue`
// (the machine code's loops of the two launches) the instructions their
// warps issue bound the loops as well. A model to order candidates, never a
// measurement.
struct BackwardIssue {
  LoopIssue kv;  // iha_bwd_kv's loops
  LoopIssue q;   // iha_bwd_q's (dq separate)
};
CostEstimate estimateBackwardCost(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                                  int64_t batch, int64_t tokens, std::optional<int> registersPerThread = std::nullopt,
                                  const std::optional<BackwardIssue>& issue = std::nullopt);

// A decode step (docs/IHA.md, Decode over a paged cache): `newTokens` per
// sequence over caches of `cachedTokens`. Memory-bound at serving's batch
// sizes, so the terms are the bytes the step reads: each attention CTA
// (query block, head, split) streams its share of the visible cache, a raw
// cache's rows of all G kv heads (it mixes them on chip) or a mixed cache's
// P rows of its own group, from L2; DRAM sees each page once. The grid
// (query blocks x H x kv_splits x B) against the SMs sets how much of the
// bandwidth a step reaches; splits add the combine's partial rows and a
// launch. A model to order candidates, never a measurement.
CostEstimate estimateDecodeCost(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                                int64_t batch, int64_t cachedTokens, int64_t newTokens, bool mixedCache,
                                std::optional<int> registersPerThread = std::nullopt);

// A decode step's floor against its issue: the bytes it must move (the
// visible cache once, the step's q, k, v and out) at the DRAM bandwidth,
// and the instructions its attention launch issues: every warp's loop per
// key block (`issue` from the machine code's tensor-core loops, else
// estimated: the mixing's FMAs and the loop's fixed part), over the whole
// device or, where the grid is small, one CTA's blocks one after another
// on its warps' sub-partitions, wave after wave.
//
// `tensorSeconds` is the tensor pipe's time for the products the step
// issues at the model's share of the dense rate (DeviceModel's
// mmaSyncEfficiency or wgmmaEfficiency: what published attention kernels
// reach, not a measured pipe rate): the absorbed step trades the mixing's
// FMAs for products, and its floor is the larger of the two ratios.
struct DecodeFloor {
  double bytes = 0;
  double memorySeconds = 0;
  double issueSeconds = 0;
  double tensorSeconds = 0;
  int64_t ctas = 0;
  int ctasPerSm = 1;  // the attention CTAs an SM holds at once
  bool issueFromSass = false;
  double floorRatio() const { return memorySeconds > 0 ? issueSeconds / memorySeconds : 0; }
  double tensorRatio() const { return memorySeconds > 0 ? tensorSeconds / memorySeconds : 0; }
};
DecodeFloor estimateDecodeFloor(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                                int64_t batch, int64_t cachedTokens, int64_t newTokens, bool mixedCache,
                                const std::optional<LoopIssue>& issue = std::nullopt);

// The bytes of cache a decode step reads at least: every visible cached
// token's k and v once, raw (G d) or mixed (G P d), 16-bit.
double decodeCacheBytes(const KernelSpec& spec, int64_t batch, int64_t cachedTokens, int64_t newTokens, bool mixedCache);

// Estimated registers per thread of the attention kernel for a complete
// schedule: on the mma engine loom::mmaRegisterEstimate (fitted to ptxas),
// on the wgmma engine a consumer's fragments (S, O, P) and its loop state.
int64_t estimatedRegisters(const KernelSpec& spec, const Schedule& schedule);

// Allowed (i, j) pairs of one head and batch entry.
double allowedPairs(const KernelSpec& spec, int64_t tokens);

// The useful work of a forward pass, docs/IHA.md: 4 d H B times the allowed
// pairs. Every TFLOP/s loom reports divides this.
double ihaFlops(const KernelSpec& spec, int64_t batch, int64_t tokens);
// The backward's useful work by FlashAttention's count (five products of
// the forward's two: 2.5 forwards), whatever a schedule recomputes.
double ihaBackwardFlops(const KernelSpec& spec, int64_t batch, int64_t tokens);

// A decode step's useful work: 4 d H B times its T P query rows times the
// rows of the tokens they can see (the cache's and the step's).
double ihaDecodeFlops(const KernelSpec& spec, int64_t batch, int64_t cachedTokens, int64_t newTokens);

// q, k, v read and out written once, 16-bit: the bytes a pass must move.
double operandBytes(const KernelSpec& spec, int64_t batch, int64_t tokens);

}  // namespace loom::autotune
