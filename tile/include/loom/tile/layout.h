// Shared-memory layout of the CUDA attention CTA, as plain constexpr
// arithmetic: the device implementation carves its tiles with it, and the
// host (compiler plan, launcher, autotuner pruning) sizes the launch with
// the same numbers. Compiles as host C++ and under NVRTC.
#pragma once

namespace loom {

// 16-bit tiles are padded by one 16-byte chunk per row: with a row pitch of
// (d + 8) elements, the eight rows an ldmatrix phase reads start in eight
// different 16-byte bank groups, so the loads are conflict-free.
constexpr int kRowPadElements = 8;
constexpr int kMmaK = 16;                 // k extent of mma.m16n8k16
constexpr int kMTileRows = 16;            // rows of one mma.m16n8k16 m-tile
constexpr int kTileElementBytes = 2;      // f16 / bf16
constexpr int kAccumulatorBytes = 4;      // f32

// One token CTA's partial sums in a backward plan: dcollapse (H*P, or H*H*P
// for a global collapse), then dalpha_q (H*H*P), dalpha_k and dalpha_v
// (G*G*P each).
// The backward's reduce launch sums this many partial entries per CTA.
constexpr int kReduceChunk = 256;

constexpr long long backwardPartialEntries(long long heads, long long kvHeads, long long pseudo, bool global) {
  return (global ? heads : 1) * heads * pseudo + heads * heads * pseudo + 2 * kvHeads * kvHeads * pseudo;
}

// The backward's delta workspace holds kRowStatsPlanes planes of a query
// row's statistics, each rowStatsStride(rows) floats (rows: B * H * L;
// 16-byte aligned, so one 2-d TMA box takes a block's rows of both): lse
// in log2 units (lse * log2(e), the CUDA backward's), then D = rowsum(do *
// o). loom/tile/common.h's setRowStats points IhaArgs at them.
constexpr int kRowStatsPlanes = 2;
constexpr long long rowStatsStride(long long rows) { return (rows + 3) / 4 * 4; }

constexpr int paddedHeadDim(int headDim) { return (headDim + kMmaK - 1) / kMmaK * kMmaK; }
constexpr int tilePitch(int headDim) { return paddedHeadDim(headDim) + kRowPadElements; }
// Row pitch (f32 elements) of the collapse epilogues' staging tile. An
// accumulator fragment is stored as 8-byte pairs by 8 rows x 4 lanes; with a
// pitch of d + 8 floats rows r and r + 4 alone share banks, so a warp's
// 256 bytes take the two wavefronts they must (without the pad: 8-way).
constexpr int kStagingPadFloats = 8;
constexpr int stagingPitch(int headDim) { return paddedHeadDim(headDim) + kStagingPadFloats; }
// Register fragments of one mma.sync thread over the key loop, in 32-bit
// registers: per m-tile the output (Dp / 2), the scores (block_n / 2) and,
// while they fit, Q's A fragments (Dp / 4). Past kQFragmentRegisterBudget
// the Q fragments are read from the Q tile in shared memory at every key
// block instead (head_dim 256 and the like: FlashAttention-2 does so too),
// which costs one ldmatrix per k-step and spares MT * Dp / 4 registers.
constexpr int kQFragmentRegisterBudget = 160;
constexpr bool qInRegisters(int mTiles, int headDim, int blockN) {
  return mTiles * (paddedHeadDim(headDim) * 3 / 4 + blockN / 2) <= kQFragmentRegisterBudget;
}
constexpr int mmaFragmentRegisters(int mTiles, int headDim, int blockN) {
  return mTiles * (paddedHeadDim(headDim) / 2 + blockN / 2) +
         (qInRegisters(mTiles, headDim, blockN) ? mTiles * paddedHeadDim(headDim) / 4 : 0);
}

// A generated program may open with this line and ptxas options after it;
// the JIT (runtime/jit/nvrtc_compiler.cpp) passes them on. The source is the
// cache key, so the options travel with it. The generator asks for -O1 for
// the mma.sync attention with two m-tiles a warp (docs/performance.md, sm_80):
// at -O3 ptxas hoists fragment loads and copy addresses across the softmax
// and spills at 255 registers (as FlashAttention-2's own build of the shape
// does); -O1 keeps the loads interleaved with the products and spills nothing.
// -O1 applies to the whole program: the premix beside it mixes up to 16
// source heads clean at -O1, but at 32 it spills there (255 registers and
// 276 bytes, where -O3 takes 177), so above 16 the program stays at -O3 and
// the generator keeps one m-tile a warp.
constexpr const char* kPtxasOptionsLine = "// loom-ptxas-options:";
constexpr int kLowPressureMTiles = 1;        // at most this many m-tiles a warp: -O3
constexpr int kMaxPremixSourcesAtO1 = 16;    // source heads (H, G) of a program compiled at -O1
constexpr bool attentionAtO1(int mTiles, int heads, int kvHeads) {
  return mTiles > kLowPressureMTiles && heads <= kMaxPremixSourcesAtO1 && kvHeads <= kMaxPremixSourcesAtO1;
}

// Registers ptxas gives an mma.sync attention thread: the fragments and the
// rest (addresses, softmax rows, the pipeline, the epilogue), which grows
// with the head dimension and, with fused mixing (raw rows mixed on chip),
// with the key block. Fitted to ptxas 13's counts over head_dim 64-256,
// block_n 16-128 and one to three m-tiles per warp (sm_80, both mixings):
// every schedule it puts at or below kMaxThreadRegisters compiled without a
// spill, every one that spilled is above it.
constexpr int kMaxThreadRegisters = 255;
constexpr int mmaRegisterEstimate(int mTiles, int headDim, int blockN, bool fusedMix) {
  // The softmax rows (running max and sum of two rows) take 4 per m-tile.
  // Materialised mixing at two m-tiles a warp compiles at ptxas -O1
  // (kPtxasOptionsLine), whose rest is 32 registers smaller (refitted on
  // ptxas 13.0, sm_80, head_dim 64-256, block_n 16-128; at three m-tiles
  // d 96, block_n 32 spilled under the smaller rest, so those keep -O3's).
  const int rows = (!fusedMix && mTiles == kLowPressureMTiles + 1 ? 44 : 76) + 4 * mTiles;
  const int rest = fusedMix ? rows + paddedHeadDim(headDim) / 8 + blockN / 4 : rows + paddedHeadDim(headDim) / 16;
  return mmaFragmentRegisters(mTiles, headDim, blockN) + rest;
}

// One stage over mixed rows (materialised mixing, not a decode step) runs
// FlashAttention-2's split pipeline on the mma.sync engine (cuda.h,
// Geometry::splitKv): K and V in their own commit groups, so the loads
// overlap the products with one K and one V tile. Its copies are unrolled:
// a row's 16-byte chunks must divide the threads.
constexpr bool splitKvPipeline(int stages, bool fusedMix, bool decode, int threads, int headDim) {
  return stages == 1 && !fusedMix && !decode && threads % (paddedHeadDim(headDim) / (16 / kTileElementBytes)) == 0;
}

// Tokens whose raw rows one key block of `blockN` virtual rows can touch.
constexpr int rawTokensPerBlock(int blockN, int pseudoHeads) { return (blockN - 1) / pseudoHeads + 2; }

struct AttentionSmem {
  int q = 0;        // [block_m][pitch] 16-bit query tile
  int k = 0;        // mixed: one [block_n][pitch] tile; else `stages` of them
  int v = 0;        // likewise
  int raw = 0;      // mixed only: `stages` x {k, v} x [raw tokens][G][d] raw rows
  int staging = 0;  // collapse epilogues: [block_m][stagingPitch] f32, overlapping q/k/v/raw
  int out = 0;      // fused global collapse: [block_m / P][H][padded d] f32
  int total = 0;    // bytes of dynamic shared memory
};

constexpr AttentionSmem attentionSmem(int blockM, int blockN, int headDim, int stages, int heads, int kvHeads,
                                      int pseudoHeads, bool mixed, bool collapseInEpilogue, bool outTile) {
  AttentionSmem s;
  const int tile = tilePitch(headDim) * kTileElementBytes;
  const int kvTiles = mixed ? 1 : stages;
  s.q = 0;
  s.k = s.q + blockM * tile;
  s.v = s.k + kvTiles * blockN * tile;
  s.raw = s.v + kvTiles * blockN * tile;
  const int rawBytes = mixed ? stages * 2 * rawTokensPerBlock(blockN, pseudoHeads) * kvHeads * headDim * kTileElementBytes : 0;
  const int operandsEnd = s.raw + rawBytes;
  s.staging = 0;
  const int stagingEnd = collapseInEpilogue ? blockM * stagingPitch(headDim) * kAccumulatorBytes : 0;
  s.out = operandsEnd > stagingEnd ? operandsEnd : stagingEnd;
  const int outBytes = outTile ? (blockM / pseudoHeads) * heads * paddedHeadDim(headDim) * kAccumulatorBytes : 0;
  s.total = s.out + outBytes;
  return s;
}

// The absorbed decode step (loom/tile/cuda_absorbed.h; docs/performance.md,
// decode): a raw cache's keys and values are never mixed. Each query row
// (h, i) becomes P rows (h, i, j) of R(-j) q, multiplied on the tensor cores
// with the cached raw rows (rotated by their token's angle) and combined
// over the G heads with alpha in f32; the values' mix is folded into the
// probabilities. Key blocks of kAbsorbedTokens tokens, a stage's K (and V)
// rows ordered (head m, token t) so that a score n-tile is one head's tokens.
constexpr int kAbsorbedTokens = 8;
// Registers a thread may give Q's absorbed A fragments (its S rows' R(-j) q).
constexpr int kAbsorbedQRegisters = 64;
// A query row's S rows: P rounded up to a power of two (the rows past P
// score -inf), so that they share a max by shuffles within a fragment half.
constexpr int nextPowerOfTwo(int n) {
  int power = 1;
  while (power < n) power *= 2;
  return power;
}
constexpr int absorbedRows(int pseudoHeads) { return nextPowerOfTwo(pseudoHeads); }
// Warps sharing one 16-row m-tile of the output: two where its S rows split
// evenly and each warp's half of the output columns is whole ldmatrix pairs
// (head_dim a multiple of 32); each holds half of the S rows.
constexpr int absorbedSplit(int pseudoHeads, int headDim) {
  return absorbedRows(pseudoHeads) % 2 == 0 && paddedHeadDim(headDim) % 32 == 0 ? 2 : 1;
}
constexpr int absorbedPaddedHeads(int kvHeads) { return kvHeads + (kvHeads & 1); }
// An absorbed CTA's query block by default: a token of each of its
// ctaHeads heads in 16-row m-tiles, a power of two of them; and its warps
// (split ways an m-tile).
constexpr int absorbedBlockM(int ctaHeads, int pseudoHeads) {
  int tiles = 1;
  while (tiles * kMTileRows < ctaHeads * pseudoHeads) tiles *= 2;
  return tiles * kMTileRows;
}
constexpr int absorbedWarps(int blockM, int pseudoHeads, int headDim) {
  return absorbedSplit(pseudoHeads, headDim) * (blockM / kMTileRows);
}
// The most query heads an absorbed CTA holds: a token of each in at most
// eight warps of 16-row m-tiles (split ways each).
constexpr int absorbedMostHeads(int pseudoHeads, int headDim) {
  return 8 / absorbedSplit(pseudoHeads, headDim) * 16 / pseudoHeads;
}
// Why a shape has no absorbed step, or nullptr. blockM is the query rows
// (a token of every head at least), warps the CTA's.
constexpr const char* absorbedShapeProblem(int blockM, int warps, int headDim, int pseudoHeads) {
  const int split = absorbedSplit(pseudoHeads, headDim), dp = paddedHeadDim(headDim);
  if (pseudoHeads > 8) return "pseudo_heads must be at most 8 (a row's S rows share a max within 8 lanes)";
  if (headDim % kMmaK != 0) return "head_dim must be a multiple of 16";
  if (blockM % kMTileRows != 0 || warps != split * (blockM / kMTileRows))
    return "warps must be the query block's 16-row m-tiles, times 2 where they split";
  if (absorbedRows(pseudoHeads) / split * (dp / kMmaK) * 4 > kAbsorbedQRegisters)
    return "the absorbed queries' fragments (S m-tiles x head_dim / 16 k-steps) exceed 64 registers";
  return nullptr;
}

struct AbsorbedSmem {
  int q = 0;       // prologue only: [block_m * S rows][pitch] R(-j) q (overlaps the stages)
  int k = 0;       // `stages` x [Gp * tokens][pitch] raw key rows, row m * tokens + t
  int v = 0;       // likewise the value rows
  int pTile = 0;   // [block_m][tokens * Gp + 8] 16-bit: the probabilities with the values' mix folded in
  int probs = 0;   // [block_m][tokens][P] f32: a block's probabilities, for the fold
  int rowMax = 0;  // [block_m] f32: each query row's running max, for the warps holding its output
  int rowSum = 0;  // [block_m] f32: its denominator, at the end
  int alpha = 0;   // [warps][Gp][8][2 * S m-tiles] f32: the keys' weights of each thread's S rows
  int beta = 0;    // [G][Gp][P] f32: the values' weights, beta[g][m][j] (g of the CTA's kv heads)
  int angles = 0;  // [tokens][2][d / 2] f32: a block's rotary cosines, then sines, each token's
  // qk_norm only (absent, 0 bytes, without it):
  int keyWeights = 0;  // [G * P][gramPitch] f32: alpha_k of each mixed key row (g, j) of the CTA's, its G weights
  int gram = 0;        // [warps][gramTokens][G][gramPitch] f32: each warp's tokens' Gram matrices of their raw key rows
  int keyNorms = 0;    // [G * P][tokens] f32: 1 / rms of each mixed key row (g, j) of the CTA's, the block's tokens
  // the tensor-mixing step only (its q, 16 rows a warp, is read at every block; no pTile, probs, alpha, beta):
  int turns = 0;    // [8][2][d / 2] f32: R(j)'s cosines, then sines, for each j < 8
  int weights = 0;  // [KM][4][warps][32 lanes] 16 bytes: each lane's weight fragments, hi and lo halves
  int total = 0;
};

// A row of G floats rounded up to whole 16-byte vectors.
constexpr int absorbedGramPitch(int kvHeads) { return (kvHeads + 3) / 4 * 4; }
// qk_norm: the tokens one Gram product of a warp takes (its tokens are
// kAbsorbedTokens / warps): as many as stack their G raw rows into one
// 16-row tile and leave their G P quadratic forms one to a lane. At G 4,
// P 4 a warp's two tokens take one product and one pass of forms, where
// one each would leave three quarters of the tile and half the lanes idle.
constexpr int absorbedGramTokens(int kvHeads, int pseudoHeads, int warps) {
  const int own = warps < kAbsorbedTokens ? kAbsorbedTokens / warps : 1;
  int tokens = 1;
  while (own % (2 * tokens) == 0 && 2 * tokens * kvHeads <= 16 && 2 * tokens * kvHeads * pseudoHeads <= 32) tokens *= 2;
  return tokens;
}

constexpr int absorbedPTilePitch(int kvHeads) { return kAbsorbedTokens * absorbedPaddedHeads(kvHeads) + kRowPadElements; }

constexpr AbsorbedSmem absorbedSmem(int blockM, int headDim, int stages, int kvHeads, int pseudoHeads, int warps,
                                    bool qkNorm) {
  AbsorbedSmem s;
  const int tile = tilePitch(headDim) * kTileElementBytes, gp = absorbedPaddedHeads(kvHeads);
  const int stageBytes = gp * kAbsorbedTokens * tile;
  const int qBytes = blockM * absorbedRows(pseudoHeads) * tile, kvBytes = 2 * stages * stageBytes;
  s.q = 0;
  s.k = 0;
  s.v = stages * stageBytes;
  s.pTile = qBytes > kvBytes ? qBytes : kvBytes;
  s.probs = s.pTile + blockM * absorbedPTilePitch(kvHeads) * kTileElementBytes;
  s.rowMax = s.probs + blockM * kAbsorbedTokens * pseudoHeads * kAccumulatorBytes;
  s.rowSum = s.rowMax + blockM * kAccumulatorBytes;
  s.alpha = s.rowSum + blockM * kAccumulatorBytes;
  const int sTiles = absorbedRows(pseudoHeads) / absorbedSplit(pseudoHeads, headDim);
  s.beta = s.alpha + warps * gp * 8 * 2 * sTiles * kAccumulatorBytes;
  s.angles = s.beta + kvHeads * gp * pseudoHeads * kAccumulatorBytes;
  s.angles = (s.angles + 15) / 16 * 16;
  s.keyWeights = s.angles + kAbsorbedTokens * headDim * kAccumulatorBytes;
  const int gramRows = qkNorm ? absorbedGramPitch(kvHeads) * kAccumulatorBytes : 0;
  s.gram = s.keyWeights + kvHeads * pseudoHeads * gramRows;
  s.keyNorms = s.gram + warps * absorbedGramTokens(kvHeads, pseudoHeads, warps) * kvHeads * gramRows;
  s.total = s.keyNorms + (qkNorm ? kvHeads * pseudoHeads * kAbsorbedTokens * kAccumulatorBytes : 0);
  return s;
}

// The query heads a CTA of the one-CTA decode steps (absorbed, tensor
// mixing) holds: every head up to `most` (the step's: 16 for tensor
// mixing, absorbedMostHeads), else H / c CTAs a sequence of c heads each, c
// the largest divisor of H up to it whose heads read whole kv groups or one
// group's part (c a multiple of H / G, or H / G of c): a CTA's heads then
// read the kv heads kv0 .. kv0 + stepKvHeads - 1 and its tables hold only
// theirs. Each CTA stages every raw head (each mixed row mixes all G); the
// chunks' CTAs read the same cache lines. 0 where no c fits (H / G over
// `most` and not a multiple of a c).
constexpr int kStepMaxHeads = 16;  // tensor mixing: two a warp, eight warps
constexpr int stepHeads(int heads, int kvHeads, int most) {
  if (heads <= most) return heads;
  const int group = kvHeads > 0 ? heads / kvHeads : heads;
  for (int c = most; c >= 2; --c)
    if (heads % c == 0 && (c % group == 0 || group % c == 0)) return c;
  return 0;
}
// stepHeads, or every head where no chunk fits (the compiler's checks then
// refuse the step): what a CTA holds wherever the step is asked for.
constexpr int stepCtaHeads(int heads, int kvHeads, int most) {
  const int c = stepHeads(heads, kvHeads, most);
  return c > 0 ? c : heads;
}
// The most query heads a CTA of a one-CTA step holds: tensor mixing's 16,
// the absorbed step's absorbedMostHeads.
constexpr int stepMostHeads(bool tensorMixing, int pseudoHeads, int headDim) {
  return tensorMixing ? kStepMaxHeads : absorbedMostHeads(pseudoHeads, headDim);
}
// The query heads a CTA of that step holds for a spec (stepCtaHeads).
constexpr int oneCtaHeads(bool tensorMixing, int heads, int kvHeads, int pseudoHeads, int headDim) {
  return stepCtaHeads(heads, kvHeads, stepMostHeads(tensorMixing, pseudoHeads, headDim));
}
// The kv heads a CTA of stepHeads query heads reads.
constexpr int stepKvHeads(int ctaHeads, int heads, int kvHeads) {
  const int group = heads / kvHeads;
  return ctaHeads >= group ? ctaHeads / group : 1;
}

// The tensor-mixing decode step (loom/tile/cuda_tensor_mixing.h;
// docs/performance.md, decode): one CTA holds a token of every query head
// (up to 16: stepHeads), two heads a warp, kTensorMixingRows rows each (the P of a token, or whole
// tokens of them, at most 8), and mixes each cached token's G raw rows on
// the tensor cores into the mixed keys and values of the warp's heads,
// which stay in registers as the next product's operands. Its stages are
// the absorbed step's (rows (m, t)), of kTensorMixingTokens tokens.
constexpr int kTensorMixingRows = 8;
// Tokens a key block: four passes of a token, or two of two where paired
// (tensorMixingPassTokens), so that the block's fixed work (the output's
// rescaling, its barriers, waits and addresses) is shared by four tokens
// (H = G = 16, P 8, d 128: 829 instructions a warp a block of two, 1454 a
// block of four; 214-254 registers, no spill, over H 6 to 32, P 3 to 8,
// d 64 and 128, qk_norm, f16 and bf16, sm_80 and sm_90a).
constexpr int kTensorMixingTokens = 4;
constexpr int kTensorMixingMaxHeadDim = 128;  // a warp's mixed rows and output in registers
constexpr int tensorMixingWarps(int heads) { return (heads + 1) / 2; }
constexpr int tensorMixingBlockM(int heads) { return kTensorMixingRows * heads; }
// Why a spec has no tensor-mixing step, or nullptr (`heads` a CTA's: stepHeads).
constexpr const char* tensorMixingShapeProblem(int heads, int headDim, int pseudoHeads, bool rope) {
  if (pseudoHeads > kTensorMixingRows) return "pseudo_heads must be at most 8 (a warp's 16 rows are two heads' 8)";
  if (heads < 1 || heads > kStepMaxHeads)
    return "heads must be at most 16, or divide into CTAs of up to 16 that read whole kv groups (two a warp, eight "
           "warps)";
  if (headDim % kMmaK != 0 || headDim > kTensorMixingMaxHeadDim)
    return "head_dim must be a multiple of 16 up to 128 (a warp's mixed rows and output stay in registers)";
  if (rope && headDim % 32 != 0)
    return "head_dim must be a multiple of 32 with RoPE (a mixed column and its partner d/2 on in whole k-steps)";
  return nullptr;
}
// Whether a warp's two heads read one kv head (H / G even): their mixed
// keys are then one set, and the warp mixes two tokens at a pass, the
// first's keys in the rows lane/4, the next's in lane/4 + 8 (a
// k-step of the mix is 16 staged rows (m, t), the weights block-diagonal
// in t), so that each score product is whole (both heads' rows against one
// token's keys) and P' V reads both tokens' value rows in one k-step.
constexpr bool tensorMixingPairs(int heads, int kvHeads) {
  return kvHeads > 0 && heads % kvHeads == 0 && (heads / kvHeads) % 2 == 0;
}
// Tokens a warp mixes at a pass: two where its heads share their keys, else one.
constexpr int tensorMixingPassTokens(int heads, int kvHeads) { return tensorMixingPairs(heads, kvHeads) ? 2 : 1; }
// The staged rows (m, t) a pass's mix and P' V take as k: one token's G
// kv heads (padded to even: absorbedPaddedHeads), or, paired, both tokens'.
constexpr int tensorMixingStagedRows(int heads, int kvHeads) {
  return absorbedPaddedHeads(kvHeads) * tensorMixingPassTokens(heads, kvHeads);
}
// Whether they fit 8: the keys' mix and P' V are then mma m16n8k8 (half the
// tensor work of k 16, whose k 8-15 would be padding) and P' = P beta one
// n-tile of 8 staged rows where it is two.
constexpr bool tensorMixingNarrow(int heads, int kvHeads) { return tensorMixingStagedRows(heads, kvHeads) <= 8; }
// k-steps of the keys' mix, of P' = P beta's n-tile pairs and of P' V: the
// staged rows of a pass, 16 a step (one, of 8, where narrow).
constexpr int tensorMixingKSteps(int heads, int kvHeads) { return (tensorMixingStagedRows(heads, kvHeads) + 15) / 16; }
// Tensor-core multiply-adds a cached token costs each step (the products
// as issued, padding included), which decide between them by default:
// absorbed, every S row against every raw row and P' against every raw
// value row (block_m the 16-row tiles, a power of two of them, holding a
// token of every head); tensor mixing, a warp's keys' mix (k the staged
// rows; bf16 weights in two halves), scores (each half of a product
// another head's), P' = P beta (k the two heads' keys, n 8 staged rows a
// tile) and P' V (k the staged rows); paired (tensorMixingPairs), each
// product once for two tokens; every CTA of a sequence's (stepHeads).
constexpr long long absorbedTokenMacs(int heads, int kvHeads, int pseudoHeads, int headDim) {
  const int ctaHeads = stepHeads(heads, kvHeads, stepMostHeads(false, pseudoHeads, headDim));
  if (ctaHeads == 0) return 0;
  const long long blockM = absorbedBlockM(ctaHeads, pseudoHeads), d = paddedHeadDim(headDim);
  return heads / ctaHeads * (blockM * absorbedRows(pseudoHeads) + blockM) * absorbedPaddedHeads(kvHeads) * d;
}
constexpr long long tensorMixingTokenMacs(int heads, int kvHeads, int headDim, bool splitWeights) {
  const int ctaHeads = stepHeads(heads, kvHeads, stepMostHeads(true, 0, 0));
  if (ctaHeads == 0) return 0;
  const bool narrow = tensorMixingNarrow(heads, kvHeads);
  const long long d = paddedHeadDim(headDim), km = tensorMixingKSteps(heads, kvHeads), halves = splitWeights ? 2 : 1;
  const long long k = narrow ? 8 : 16, foldTiles = narrow ? 1 : 2;
  // a warp's, a pass (a token; paired, both), in 16 x 8 output tiles times their k
  const long long tileKs = d / 8 * halves * km * k + 2 * (d / 16) * 16 + foldTiles * halves * km * 16 + d / 8 * km * k;
  const long long passTokens = tensorMixingPassTokens(heads, kvHeads);
  return heads / ctaHeads * tensorMixingWarps(ctaHeads) * tileKs * 16 * 8 / passTokens;
}
// ctaHeads a CTA's (stepHeads) of the spec's heads.
constexpr AbsorbedSmem tensorMixingSmem(int ctaHeads, int headDim, int stages, int heads, int kvHeads) {
  AbsorbedSmem s;
  const int tile = tilePitch(headDim) * kTileElementBytes, tokens = kTensorMixingTokens;
  const int stageBytes = absorbedPaddedHeads(kvHeads) * tokens * tile;
  s.k = 0;
  s.v = stages * stageBytes;
  s.angles = (2 * stages * stageBytes + 15) / 16 * 16;
  s.turns = s.angles + tokens * headDim * kAccumulatorBytes;
  s.weights = s.turns + kTensorMixingRows * headDim * kAccumulatorBytes;
  s.q = s.weights + tensorMixingKSteps(heads, kvHeads) * 4 * tensorMixingWarps(ctaHeads) * 32 * 16;  // 32 lanes
  s.total = s.q + tensorMixingWarps(ctaHeads) * 16 * tile;
  return s;
}

// Shared-memory layout of the sm_90a (wgmma) attention CTA. Operand tiles are
// stored as the 128-byte swizzle atoms wgmma descriptors and the tensor
// memory accelerator agree on: for every 64 columns of the head dimension, a
// [rows][64] block of 128-byte rows whose 16-byte chunks are XOR-ed with the
// row index mod 8. Every tile starts on a 1024-byte boundary (the pattern's
// period); `total` includes the slack to align the base.
constexpr int kSwizzleAtomColumns = 64;
constexpr int kSwizzleRowBytes = 128;
constexpr int kSwizzlePeriodBytes = 1024;
constexpr int kBarrierBytes = 8;
constexpr int kMaxConsumerWarpgroups = 4;
// What the wgmma engine takes: block_n values (N of the S = Q K^T wgmma, a
// whole number of 64-row TMA boxes) and the per-block shared-memory limit of
// sm_90a (227 KiB with opt-in).
constexpr int kWgmmaBlockNs[] = {64, 128, 192, 256};
constexpr int kHopperSharedMemoryPerBlock = 232448;

// Registers per consumer thread once the producer warpgroup has given up
// its share (setmaxnreg): the CTA's share of the register file (64K over
// `ctasPerSm`) split over the consumer warpgroups, a multiple of 8, at most
// 240.
constexpr int kRegisterFileWords = 65536;
constexpr int kWarpgroupThreadCount = 128;
constexpr int kMaxConsumerRegisters = 240;
constexpr int consumerRegisters(int warps, int producerRegisters, int ctasPerSm = 1) {
  const int groups = warps / 4 > 0 ? warps / 4 : 1;
  const int left = (kRegisterFileWords / ctasPerSm / kWarpgroupThreadCount - producerRegisters) / groups / 8 * 8;
  return left < kMaxConsumerRegisters ? left : kMaxConsumerRegisters;
}

// sm_90a: a consumer thread's fragments in registers, S (block_n / 2), O
// (d / 2) and P as 16-bit pairs (block_n / 4), and Q as wgmma's register A
// operand (d / 4) when these and the loop's own (kWgmmaLoopRegisters) fit
// its budget; otherwise Q is read from shared memory by descriptor.
constexpr int kWgmmaLoopRegisters = 48;
constexpr int wgmmaFragmentRegisters(int blockN, int headDim) { return blockN / 2 + headDim / 2 + blockN / 4; }
constexpr bool wgmmaQInRegisters(int blockN, int headDim, int consumerRegisters) {
  return wgmmaFragmentRegisters(blockN, headDim) + headDim / 4 + kWgmmaLoopRegisters <= consumerRegisters;
}

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` inside an atom.
constexpr int swizzledChunk(int row, int chunk) { return row * kSwizzleRowBytes + ((chunk ^ (row % 8)) * 16); }

struct HopperSmem {
  int q = 0;         // [atoms][block_m][64] query tile
  int k = 0;         // `stages` x [atoms][block_n][64]
  int v = 0;         // likewise
  int staging = 0;   // collapse epilogues: [block_m][stagingPitch] f32
  int out = 0;       // fused global collapse: [block_m / P][H][d] f32
  int barriers = 0;  // full[stages], empty[stages], q[consumer warpgroups]
  int anchors = 0;   // one f32 a consumer thread: the softmax's scheduling anchor (hopper.h)
  int ring = 0;      // fused mixing: [2][ringTokens / 2][K, V][G][d] 16-bit raw rows, the producer's copies
  int ringTokens = 0;
  int total = 0;     // bytes of dynamic shared memory, alignment slack included
};

// The fused-mixing producer's ring of raw rows (hopper.h, mixKvTile): two
// halves of whole tokens (each token's G key rows, then its G value rows),
// one copied by cp.async while the other is mixed, about
// kHopperRingBytes in all, 2 to 16 tokens.
constexpr int kHopperRingBytes = 32768;
constexpr int hopperRingTokens(int kvHeads, int headDim) {
  const int token = 2 * kvHeads * headDim * kTileElementBytes;
  int tokens = kHopperRingBytes / token / 2 * 2;
  return tokens < 2 ? 2 : tokens > 16 ? 16 : tokens;
}

constexpr int alignUp(int value, int alignment) { return (value + alignment - 1) / alignment * alignment; }

constexpr HopperSmem hopperSmem(int blockM, int blockN, int headDim, int stages, int heads, int pseudoHeads,
                                bool collapseInEpilogue, bool outTile, int ringKvHeads = 0) {
  HopperSmem s;
  const int dPadded = alignUp(headDim, kSwizzleAtomColumns);
  s.q = 0;
  s.k = s.q + blockM * dPadded * kTileElementBytes;
  s.v = s.k + stages * blockN * dPadded * kTileElementBytes;
  const int operandsEnd = s.v + stages * blockN * dPadded * kTileElementBytes;
  const int stagingBytes = collapseInEpilogue ? blockM * stagingPitch(dPadded) * kAccumulatorBytes : 0;
  // The staging tile overlaps the operands once the kv stream is drained;
  // with a fused global collapse the producer streams the next head's blocks
  // meanwhile, so it gets its own room.
  s.staging = outTile ? operandsEnd : 0;
  const int stagingEnd = s.staging + stagingBytes;
  s.out = operandsEnd > stagingEnd ? operandsEnd : stagingEnd;
  const int outBytes = outTile ? (blockM / pseudoHeads) * heads * dPadded * kAccumulatorBytes : 0;
  s.barriers = alignUp(s.out + outBytes, kBarrierBytes);
  s.anchors = s.barriers + (2 * stages + kMaxConsumerWarpgroups) * kBarrierBytes;
  const int consumerThreads = 2 * blockM;  // a 128-thread warpgroup for each 64 rows
  s.ring = alignUp(s.anchors + consumerThreads * kAccumulatorBytes, 16);  // cp.async targets
  s.ringTokens = ringKvHeads > 0 ? hopperRingTokens(ringKvHeads, headDim) : 0;
  s.total = s.ring + s.ringTokens * 2 * ringKvHeads * headDim * kTileElementBytes + kSwizzlePeriodBytes;
  return s;
}

// Dynamic shared memory of the attention CTA of either engine: what the
// compiler's plan, the launcher and the tuner's pruning and cost model use.
constexpr int ctaSharedMemory(bool wgmma, int blockM, int blockN, int headDim, int stages, int heads, int kvHeads,
                              int pseudoHeads, bool mixed, bool collapseInEpilogue, bool outTile) {
  return wgmma ? hopperSmem(blockM, blockN, headDim, stages, heads, pseudoHeads, collapseInEpilogue, outTile,
                            mixed ? kvHeads : 0)
                     .total
               : attentionSmem(blockM, blockN, headDim, stages, heads, kvHeads, pseudoHeads, mixed, collapseInEpilogue,
                               outTile)
                     .total;
}

// The backward's gradient columns: a key-block-outer CTA keeps dK and dV,
// a dq CTA dq, in registers, at most kBackwardPartColumns columns of them
// (past 128, 2 x 16 rows a warp of dK and dV outgrow the registers). A
// wider head is split into parts of equal width, each its own CTA (the
// launches' grid y is head x part): S and dP take every column, so each
// part computes them again, and accumulates and stores its own columns.
// A part's width is a multiple of 16 (ldmatrix.trans pairs of n-tiles).
// The wgmma backward (sm_90a; cuda_backward.h, bwgmma) reads its tiles as
// 64-column swizzle atoms, so past 128 its parts are whole atoms: head_dim
// 192 and 256 in three (of 64: two of 96 would start mid-atom) and two
// parts.
constexpr int kBackwardPartColumns = 128;
constexpr int backwardColumnParts(int headDim, bool wgmma = false) {
  int parts = (paddedHeadDim(headDim) + kBackwardPartColumns - 1) / kBackwardPartColumns;
  if (wgmma && parts > 1)
    while (headDim % parts != 0 || headDim / parts % kSwizzleAtomColumns != 0) ++parts;
  return parts;
}
constexpr bool backwardPartsEven(int headDim) {
  return paddedHeadDim(headDim) % (backwardColumnParts(headDim) * kMmaK) == 0;
}
// The head dims the wgmma backward takes: multiples of 64 up to 256, and
// between 64 and 128 multiples of 16 (80, 96, 112: their tiles two atoms
// wide, the second filled to 128 columns with zeros by TMA; the products'
// k-steps stop at head_dim, dV's, dK's and dq's N is it). Its dq launch
// holds a warp's Q and dO rows as wgmma's register A operands up to
// head_dim 128 (64 registers each there) and reads them by descriptor past
// it.
constexpr bool wgmmaBackwardHeadDim(int headDim) {
  return (headDim % kSwizzleAtomColumns == 0 && headDim <= 4 * kSwizzleAtomColumns) ||
         (headDim > kSwizzleAtomColumns && headDim < kBackwardPartColumns && headDim % kMmaK == 0);
}
// A wgmma backward tile's columns: whole swizzle atoms.
constexpr int wgmmaTileColumns(int headDim) {
  return (headDim + kSwizzleAtomColumns - 1) / kSwizzleAtomColumns * kSwizzleAtomColumns;
}
constexpr bool wgmmaBackwardHoldsRows(int headDim) { return headDim <= kBackwardPartColumns; }
// The dq launch's parts: on wgmma one whatever the head (a warpgroup's 64
// query rows of dq at head_dim 256 are 128 accumulators a thread, which fit
// beside S's and dP's 32 each where Q and dO are read by descriptor), else
// the key-block-outer launch's (backwardColumnParts).
constexpr int backwardDqParts(int headDim, bool wgmma) { return wgmma ? 1 : backwardColumnParts(headDim); }

// Shared memory of the backward's launches on the mma.sync path. The
// key-block-outer and dq launches hold K and V (block_n rows), Q and do
// (block_m rows) as padded 16-bit tiles, then lse (log2 domain) and D of the
// query block as f32; with dq by atomic adds the key-block-outer launch also
// stages dS^T (block_n rows of block_m, 16-bit) for the dq product.
// The backward's CTA: K and V tiles, then kBackwardQueryStages query
// stages (Q, dO, lse, D; `stage` bytes apart: the key-block-outer loop
// copies the next query block into one while it uses the other), then the
// dS tile of atomic dq. The dq launch holds one query block (stage 0) and
// two K and V stages, `kvStage` bytes apart: the second over query stage 1
// (the CTA grows where two K and V tiles outgrow a query stage).
constexpr int kBackwardQueryStages = 2;
struct BackwardSmem {
  int k, v, q, dO, lse, delta, ds, total;
  int stage, kvStage;
  int barriers;  // the wgmma launch's mbarriers (K and V, then each query stage's); 0 elsewhere
};
// A query block's parts from byte `at` on: Q and dO tiles of `rows` bytes
// each, then lse and D (f32, blockM of each).
constexpr void placeQueryBlock(BackwardSmem& s, int at, int rows, int blockM) {
  s.q = at;
  s.dO = at + rows;
  s.lse = at + 2 * rows;
  s.delta = s.lse + blockM * kAccumulatorBytes;
}
constexpr BackwardSmem backwardSmem(int blockM, int blockN, int headDim, bool atomicDq = false) {
  const int kv = blockN * tilePitch(headDim) * kTileElementBytes;
  const int rows = blockM * tilePitch(headDim) * kTileElementBytes;
  BackwardSmem s{};
  s.k = 0;
  s.v = kv;
  placeQueryBlock(s, 2 * kv, rows, blockM);
  s.stage = 2 * rows + 2 * blockM * kAccumulatorBytes;
  s.ds = s.q + kBackwardQueryStages * s.stage;
  s.total = s.ds + (atomicDq ? blockN * tilePitch(blockM) * kTileElementBytes : 0);
  s.kvStage = s.q + s.stage;
  s.total = s.total > s.kvStage + 2 * kv ? s.total : s.kvStage + 2 * kv;
  return s;
}
// The wgmma backward's dq launch is warp-specialised (cuda_backward.h,
// bwgmma): a producer warpgroup (one thread issuing the TMA fills) at
// kBackwardDqProducerRegisters and the consumers at what is left of their
// CTA's share of the register file after setmaxnreg: with one consumer
// warpgroup two CTAs an SM (as without the producer). Five mbarriers: the
// query block's, each K and V stage full and empty. (The key-block-outer
// launch is not: its consumers need 240 registers, so a producer beside
// them would cost its second CTA an SM; docs/performance.md.)
constexpr int kBackwardDqProducerRegisters = 24;
constexpr int kBackwardWgmmaBarriers = 1 + 2 * kBackwardQueryStages;
// Past head_dim 128 one (its tiles take 198 KB at 256; and dq whole, 128
// accumulators a thread, needs more registers than two CTAs leave).
constexpr int backwardDqCtasPerSm(int warps, int headDim) { return warps == 4 && headDim <= 128 ? 2 : 1; }
// The key-block-outer launch on wgmma (sm_90a, schedule.engine wgmma): the
// same parts, K and V and each query stage's Q and dO as 128-byte swizzled
// tiles of 64-column atoms (what TMA writes and wgmma's descriptors read; no
// padding but the last atom's zeros past a head_dim of 80, 96 or 112:
// wgmmaTileColumns), the stages 1024 bytes apart, then the mbarriers their TMA
// copies complete on (K and V's, each query stage's), from a base the
// launch rounds up to the swizzle period (kSwizzlePeriodBytes of slack in
// total). No dS tile (dq has its own launch) and no second K and V stage.
constexpr BackwardSmem backwardWgmmaSmem(int blockM, int blockN, int headDim) {
  const int kv = blockN * wgmmaTileColumns(headDim) * kTileElementBytes;
  const int rows = blockM * wgmmaTileColumns(headDim) * kTileElementBytes;
  BackwardSmem s{};
  s.k = 0;
  s.v = kv;
  placeQueryBlock(s, 2 * kv, rows, blockM);
  s.stage = alignUp(2 * rows + 2 * blockM * kAccumulatorBytes, kSwizzlePeriodBytes);
  s.ds = s.q + kBackwardQueryStages * s.stage;
  s.kvStage = 0;
  s.barriers = s.ds;
  s.total = s.barriers + (1 + kBackwardQueryStages) * kBarrierBytes + kSwizzlePeriodBytes;
  return s;
}
// The dq launch on wgmma: the query block's Q and dO tiles (swizzled, as
// above), its lse and D, then two K and V stages (`kvStage` bytes apart:
// the next key block lands while this one is used), then the mbarriers (the
// query block's, each K and V stage's full and empty: kBackwardWgmmaBarriers).
constexpr BackwardSmem backwardWgmmaDqSmem(int blockM, int blockN, int headDim) {
  const int kv = blockN * wgmmaTileColumns(headDim) * kTileElementBytes;
  const int rows = blockM * wgmmaTileColumns(headDim) * kTileElementBytes;
  BackwardSmem s{};
  placeQueryBlock(s, 0, rows, blockM);
  s.stage = 0;
  s.k = alignUp(s.delta + blockM * kAccumulatorBytes, kSwizzlePeriodBytes);
  s.v = s.k + kv;
  s.kvStage = 2 * kv;
  s.ds = s.k + 2 * s.kvStage;
  s.barriers = s.ds;
  s.total = s.barriers + kBackwardWgmmaBarriers * kBarrierBytes + kSwizzlePeriodBytes;
  return s;
}
// The collapse backward's CTA: its dcollapse partial sums (f32).
constexpr int collapseGradSmem(int heads, int pseudo, bool global) {
  return (global ? heads : 1) * heads * pseudo * kAccumulatorBytes;
}
// The transposed mixing's CTA: a group of a token's pseudo-row gradients
// (f32, at most kUnmixStagedFloats) and the role's dalpha partial sums.
constexpr int kUnmixStagedFloats = 8192;
// A thread's elements of a token's dx held in registers across the groups
// (past them, summed in dx itself; cuda_backward.h, unmix).
constexpr int kUnmixAccumulators = 32;
constexpr int unmixGroupRows(int heads, int pseudo, int headDim) {
  return heads * pseudo * headDim <= kUnmixStagedFloats ? heads * pseudo : kUnmixStagedFloats / headDim;
}
constexpr int unmixSmem(int heads, int pseudo, int headDim) {
  return (unmixGroupRows(heads, pseudo, headDim) * headDim + heads * heads * pseudo) * kAccumulatorBytes;
}

// The materialised mixing launch (cuda_common.h, premix). A thread holds a
// piece of one token, V consecutive columns of each of the role's M source
// heads, read once with V-wide loads (16 bytes at V = 8) and kept as floats
// in registers (M * V, at most kPremixHeldFloats); from them it mixes every
// one of the M * P output rows' piece, R rows at a time (one pseudo-head p,
// R consecutive heads: the rows share their RoPE angles; R * V at most
// kPremixAccumulators), and stores each with one V-wide store. A token's
// pieces sit in one warp, in premixLanes consecutive lanes, so RoPE's
// partner column (d/2 away: piece j +- pieces/2 where V divides d/2) and
// qk_norm's sum of squares are shuffles. Where halving V to divide d/2
// would take the pieces past a warp (d/2 an odd multiple of 4 past d 128:
// 136, 152, ..., 248), V stays 8 and a partner column lies half a piece
// off, in one of two lanes (cuda_common.h, RopeAngles). The mixing weights are staged in shared memory as
// [m][p][h] (a group's R weights of one source head are consecutive: vector
// loads, the same address for every lane), P values at a time up to
// kPremixStagedAlphaFloats.
constexpr int kPremixHeldFloats = 64;
constexpr int kPremixAccumulators = 32;
constexpr int kPremixStagedAlphaFloats = 8192;
constexpr int premixVector(int sources, int headDim) {
  int v = 8;
  while (v > 2 && sources * v > kPremixHeldFloats) v /= 2;
  while (v < 8 && headDim / v > 32) v *= 2;  // a token's pieces in one warp
  // RoPE's partner piece lies pieces/2 away, or half a piece past it
  while (v > 1 && (headDim / 2) % v != 0 && headDim / (v / 2) <= 32) v /= 2;
  return v;
}
constexpr int premixLanes(int sources, int headDim) {
  int lanes = 1;
  while (lanes < headDim / premixVector(sources, headDim)) lanes *= 2;
  return lanes;
}
// R: the largest power of two dividing M with R * V accumulators at most
// kPremixAccumulators.
constexpr int premixRowGroup(int sources, int headDim) {
  int r = kPremixAccumulators / premixVector(sources, headDim);
  if (r > 8) r = 8;
  while (r > 1 && sources % r != 0) r /= 2;
  return r;
}
// Pseudo-heads whose weights are staged at once.
constexpr int premixStagedPseudo(int sources, int pseudo) {
  const int fit = kPremixStagedAlphaFloats / (sources * sources);
  return fit < 1 ? 1 : fit < pseudo ? fit : pseudo;
}
// The premix on the tensor cores (cuda_common.h, premixTensor), where a
// role's mixing is FMA-bound on the FMA units (M source heads at least
// kPremixTensorSources: a mixed element is M multiply-adds for 2 (1 + P)/P
// bytes; at 16 heads one k-step: H = G = 16, P = 4, d 128 models 0.35x of
// the floor on sm_80 where the FMA units took 1.42x; M padded to whole
// k-steps, premixTensorSources): each token's M x d raw rows are the B operand of mma.sync
// (ldmatrix.trans from shared memory), the weights of 16 output rows the A
// operand (f32 split in two 16-bit halves, hi and lo, in bf16; one half in
// f16), and a warp turns, normalises and stores its 16 rows from the
// accumulators. Output rows are p-major (row p M + h: an m-tile of 16 has
// one pseudo-head, one RoPE position); a round holds as many tokens as give
// every warp an m-tile (at most the CTA's). Shared memory, 16-bit elements,
// rows padded by 8 (ldmatrix's eight rows in distinct banks): the weights
// [M P][M + 8] hi, then lo; the round's tokens' raw rows [tokens][M][d + 8];
// each warp's 16 output rows [16][d + 8] (staged for 16-byte stores); then
// the round's RoPE angles, (sine, cosine) of each token, pseudo-head and
// frequency (f32, computed once a round for every m-tile that needs them).
// The f32 weights come in through the raw rows' space before the first round.
constexpr int kPremixTensorSources = 16;
constexpr int kPremixTensorWeightBytes = 65536;
constexpr int kPremixTensorSmemBytes = 98304;  // under every CUDA target's limit (sm_86 and sm_89: 99 KiB)
constexpr int premixTensorPitch(int columns) { return columns + 8; }
// Source heads padded to whole k-steps (and each pseudo-head's output rows
// to whole m-tiles): the padding's weights and raw rows are zeros, its
// output rows are not stored.
constexpr int premixTensorSources(int sources) { return (sources + 15) / 16 * 16; }
constexpr int premixTensorRoundTokens(int sources, int pseudo, int ctaTokens, int warps) {
  const int tiles = premixTensorSources(sources) * pseudo / 16;
  const int fit = warps / tiles > 0 ? warps / tiles : 1;
  return fit < ctaTokens ? fit : ctaTokens;
}
constexpr int premixTensorWeightsBytes(int sources, int pseudo) {
  const int padded = premixTensorSources(sources);
  return 2 * padded * pseudo * premixTensorPitch(padded) * kTileElementBytes;
}
constexpr int premixTensorTokensBytes(int sources, int pseudo, int headDim, int ctaTokens, int warps) {
  return premixTensorRoundTokens(sources, pseudo, ctaTokens, warps) * premixTensorSources(sources) *
         premixTensorPitch(headDim) * kTileElementBytes;
}
constexpr int premixTensorAnglesBytes(int sources, int pseudo, int headDim, int ctaTokens, int warps) {
  return premixTensorRoundTokens(sources, pseudo, ctaTokens, warps) * pseudo * headDim * kAccumulatorBytes;
}
constexpr int premixTensorSmem(int sources, int pseudo, int headDim, int ctaTokens, int warps) {
  return premixTensorWeightsBytes(sources, pseudo) + premixTensorTokensBytes(sources, pseudo, headDim, ctaTokens, warps) +
         warps * 16 * premixTensorPitch(headDim) * kTileElementBytes +
         premixTensorAnglesBytes(sources, pseudo, headDim, ctaTokens, warps);
}
// Whether a role of `sources` heads mixes on the tensor cores in a premix
// launch of `ctaTokens` tokens and `warps` warps a CTA.
constexpr bool premixOnTensorCores(int sources, int pseudo, int headDim, int ctaTokens, int warps) {
  return sources >= kPremixTensorSources && headDim % 16 == 0 && headDim <= 128 &&
         premixTensorWeightsBytes(sources, pseudo) <= kPremixTensorWeightBytes &&
         premixTensorSmem(sources, pseudo, headDim, ctaTokens, warps) <= kPremixTensorSmemBytes;
}
// A role's shared memory: its staged weights (f32), or the tensor path's.
constexpr int premixRoleSmem(int sources, int pseudo, int headDim, int ctaTokens, int warps) {
  return premixOnTensorCores(sources, pseudo, headDim, ctaTokens, warps)
             ? premixTensorSmem(sources, pseudo, headDim, ctaTokens, warps)
             : sources * sources * premixStagedPseudo(sources, pseudo) * kAccumulatorBytes;
}
constexpr int premixSmem(int heads, int kvHeads, int pseudo, int headDim, int ctaTokens, int warps) {
  const int q = premixRoleSmem(heads, pseudo, headDim, ctaTokens, warps);
  const int kv = premixRoleSmem(kvHeads, pseudo, headDim, ctaTokens, warps);
  return q > kv ? q : kv;
}

// Fragment geometry of mma.sync.m16n8k16 and ldmatrix.x4, as lane
// arithmetic shared by the device code and the host tests that check it
// against the PTX ISA's fragment layouts.
namespace fragment {

// Accumulator (and score) element e (0..3) of `lane` in an m16n8 tile.
constexpr int accumulatorRow(int lane, int e) { return lane / 4 + (e / 2) * 8; }
constexpr int accumulatorColumn(int lane, int e) { return (lane % 4) * 2 + e % 2; }

// ldmatrix.x4 row addresses. A (16x16, row-major) from a [row][k] tile:
// registers a0..a3 of mma's A operand.
constexpr int aRow(int lane) { return lane % 16; }
constexpr int aColumn(int lane) { return (lane / 16) * 8; }
// B from a [n][k] tile (K rows): b0, b1 of n-tile 0, then b0, b1 of n-tile 1.
constexpr int bRow(int lane) { return lane % 8 + (lane / 16) * 8; }
constexpr int bColumn(int lane) { return ((lane / 8) % 2) * 8; }
// B from a [k][n] tile (V rows) with .trans: b0, b1 of n-tile 0, then of n-tile 1.
constexpr int bTransRow(int lane) { return lane % 8 + ((lane / 8) % 2) * 8; }
constexpr int bTransColumn(int lane) { return (lane / 16) * 8; }
// A (16x16) from a [k][row] tile (its transpose stored) with .trans: a0..a3.
constexpr int aTransRow(int lane) { return lane % 8 + (lane / 16) * 8; }
constexpr int aTransColumn(int lane) { return ((lane / 8) % 2) * 8; }

}  // namespace fragment

}  // namespace loom
