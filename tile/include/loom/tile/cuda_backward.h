// The backward's tiles on the mma.sync path (sm_80 and later; included by
// cuda.h), FlashAttention-2's backward on the interleaved sequence:
//   - the collapse backward (do, D = rowsum(do * o), dcollapse partials), one
//     warp per pseudo row;
//   - the key-block-outer launch: a CTA holds one key block's K and V and,
//     for every query block and every query head of its group, computes
//     S^T = K Q^T with warps over key rows, P^T = exp2(S^T - lse), dV +=
//     P^T do, dP^T = V do^T, dS^T = P^T (dP^T - D) and dK += dS^T Q, all
//     by mma.sync.m16n8k16 with the C fragments of one product re-packed as
//     the A fragments of the next (FlashAttention-2's trick) and the other
//     operand by ldmatrix (.trans where it is the [k][n] tile);
//   - dq, a schedule choice: its own launch, where a CTA holds one query
//     block and, per key block, S = Q K^T, P, dP = do V^T, dS and dq += dS
//     K, with warps over query rows; or added in the key-block-outer launch
//     (dq atomic): dS^T staged in shared memory (dK reads it there too),
//     dq += dS K with warps over (query m-tile, head-dim pair) items and
//     red.global.add.f32 into dq's f32 workspace, which the collapse
//     backward zeroes;
//   - the transposed mixing (RoPE turned back, qk_norm's Jacobian, the
//     mixing's transpose) and the reduction of the partial sums.
// Q, K, V, o and do are 16-bit (the workspaces' element type); D, lse, the
// pseudo-row gradients and the partial sums are f32. Softmax is in the log2
// domain, as in the forward: the collapse backward writes lse * log2(e)
// beside D (lse_log2), which the loops read.
#pragma once

#include "loom/tile/wgmma.h"

namespace loom {

namespace cuda {

template <class C>
struct BackwardGeometry {
  using G = Geometry<C>;
  static_assert(C::block_n % (16 * C::warps) == 0, "the backward's key block holds 16 rows per warp");
  static constexpr int KMT = C::block_n / (16 * C::warps);  // key m-tiles per warp (key-block-outer)
  static constexpr int QNT = C::block_m / 8;                // query n-tiles of S^T
  static constexpr int QK = C::block_m / kMmaK;             // k-steps over query rows (dV, dK)
  // A CTA's share of the gradient columns (layout.h, backwardColumnParts):
  // dK and dV (key-block-outer) keep PT n-tiles, from the part's first.
  static_assert(C::wgmma_backward || backwardPartsEven(C::head_dim),
                "the backward's column parts are multiples of 16 columns");
  static constexpr int PARTS = backwardColumnParts(C::head_dim, C::wgmma_backward);
  static constexpr int PT = G::OT / PARTS;
  // The dq launch's parts and n-tiles (layout.h, backwardDqParts: on wgmma
  // dq is whole).
  static constexpr int DQ_PARTS = backwardDqParts(C::head_dim, C::wgmma_backward);
  static constexpr int DPT = G::OT / DQ_PARTS;
};

// Part `part`'s first column, of `Parts` parts of `Tiles` n-tiles each (0,
// known at compile time, where the head is one part): the key-block-outer
// launch's (partColumn) and the dq launch's (dqPartColumn).
template <int Parts, int Tiles>
__device__ __forceinline__ int firstColumn(int part) {
  if constexpr (Parts == 1) return 0;
  else return part * Tiles * 8;
}
template <class C>
__device__ __forceinline__ int partColumn(int part) {
  return firstColumn<BackwardGeometry<C>::PARTS, BackwardGeometry<C>::PT>(part);
}
template <class C>
__device__ __forceinline__ int dqPartColumn(int part) {
  return firstColumn<BackwardGeometry<C>::DQ_PARTS, BackwardGeometry<C>::DPT>(part);
}
// A column's byte offset in a padded 16-bit tile's rows.
__device__ __forceinline__ Bits32 columnBytes(int column) { return Bits32(column * kTileElementBytes); }

template <class C>
__device__ __forceinline__ BackwardSmem bwdSmem() {
  return backwardSmem(C::block_m, C::block_n, C::head_dim, C::atomic_dq);
}
template <class C>
__device__ __forceinline__ Bits16* bwdTile(int offset) {
  return reinterpret_cast<Bits16*>(smem() + offset);
}
template <class C>
__device__ __forceinline__ float* bwdFloats(int offset) {
  return reinterpret_cast<float*>(smem() + offset);
}
// The key-block-outer launch's K or V tile (at `offset`) as its products'
// ldmatrix read it: by pointer (ptxas keeps an address a k-step), or past
// head_dim 128 by its shared-window address (one register, each k-step's
// offset a constant: 32 addresses at head_dim 256 spilled the loop; at 128
// and below the pointer's loop is 7 instructions shorter on sm_80).
template <class C>
__device__ __forceinline__ auto keyBlockTile(int offset) {
  if constexpr (BackwardGeometry<C>::PARTS > 1) return sharedAddress(bwdTile<C>(offset));
  else return static_cast<const Bits16*>(bwdTile<C>(offset));
}

// The query and key tiles' copies by cursor (cuda.h, copyCursorRounds): a
// thread's chunk column fixed, its rows stepping by threads / chunks, every
// copy its base addresses plus constants. Where a row's chunks do not
// divide the threads, those past the last whole row of chunks sit the
// copies out (head_dim 192: 24 chunks, 48 of 64 threads, two rows a round),
// where a loop over (row, chunk) pairs would divide every index.
template <class C>
constexpr bool kBackwardCursor = Geometry<C>::threads >= Geometry<C>::Dp / kChunkElements;
template <class C>
__device__ __forceinline__ bool copiesByCursor() {
  constexpr int chunks = Geometry<C>::Dp / kChunkElements;
  return Geometry<C>::threads % chunks == 0 || int(threadIdx.x) < Geometry<C>::threads / chunks * chunks;
}

// First key row of key m-tile `mt` of this warp (key-block-outer launch).
template <class C>
__device__ __forceinline__ int keyRow(int mt) {
  return (mt * C::warps + warp()) * 16;
}

// Rows [first, first + Rows) of head h of a 16-bit workspace [B, heads, L, d]
// into a padded tile by cp.async, zeros past L and past d.
template <class C, int Rows>
__device__ void copyRows(Bits16* tile, const void* workspace, int heads, int64_t b, int64_t h, int64_t first,
                         int64_t L) {
  using G = Geometry<C>;
  const Bits16* rows = static_cast<const Bits16*>(workspace);
  forEachTileChunk<C, Rows>([&](int r, int chunk) {
    const int64_t i = first + r;
    const bool inside = i < L && chunk * kChunkElements < G::D;
    const Bits16* source = rows + ((b * heads + h) * L + i) * G::D + chunk * kChunkElements;
    copyAsync16(tile + r * G::pitch + chunk * kChunkElements, inside ? source : rows, inside);
  });
}

// The element offsets, from a tile's first, of this lane's ldmatrix rows:
// of the A operand (row-major [row][k]) for m-tile rows from `first`,
// k-step kt; of a B operand pair (n-tiles 2 pair, 2 pair + 1) from a
// [n][k] tile; and of one from a [k][n] tile by ldmatrix.trans.
template <class C>
__device__ __forceinline__ int aOffset(int first, int kt) {
  const int l = lane();
  return (first + fragment::aRow(l)) * Geometry<C>::pitch + kt * kMmaK + fragment::aColumn(l);
}
template <class C>
__device__ __forceinline__ int bOffset(int pair, int kt) {
  const int l = lane();
  return (pair * 16 + fragment::bRow(l)) * Geometry<C>::pitch + kt * kMmaK + fragment::bColumn(l);
}
template <class C>
__device__ __forceinline__ int bTransOffset(int kk, int pair) {
  const int l = lane();
  return (kk * kMmaK + fragment::bTransRow(l)) * Geometry<C>::pitch + pair * 16 + fragment::bTransColumn(l);
}
// Those operands from a tile by pointer, or by its shared-window address
// (32-bit arithmetic: a query stage's offset is known at run time only).
template <class C>
__device__ __forceinline__ void loadA(Bits32 (&a)[4], const Bits16* tile, int first, int kt) {
  ldmatrixX4(a, sharedAddress(tile + aOffset<C>(first, kt)));
}
template <class C>
__device__ __forceinline__ void loadB(Bits32 (&b)[4], const Bits16* tile, int pair, int kt) {
  ldmatrixX4(b, sharedAddress(tile + bOffset<C>(pair, kt)));
}
template <class C>
__device__ __forceinline__ void loadBTrans(Bits32 (&b)[4], const Bits16* tile, int kk, int pair) {
  ldmatrixX4Trans(b, sharedAddress(tile + bTransOffset<C>(kk, pair)));
}
template <class C>
__device__ __forceinline__ void loadA(Bits32 (&a)[4], Bits32 tile, int first, int kt) {
  ldmatrixX4(a, tile + Bits32(aOffset<C>(first, kt) * kTileElementBytes));
}
template <class C>
__device__ __forceinline__ void loadB(Bits32 (&b)[4], Bits32 tile, int pair, int kt) {
  ldmatrixX4(b, tile + Bits32(bOffset<C>(pair, kt) * kTileElementBytes));
}
template <class C>
__device__ __forceinline__ void loadBTrans(Bits32 (&b)[4], Bits32 tile, int kk, int pair) {
  ldmatrixX4Trans(b, tile + Bits32(bTransOffset<C>(kk, pair) * kTileElementBytes));
}

// The A fragments of k-step kk of a product whose left operand is the C
// fragments `t` (two n-tiles per k-step of 16).
template <class C, int N>
__device__ __forceinline__ void repack(Bits32 (&a)[4], const float (&t)[N][4], int kk) {
  a[0] = pack<C>(t[2 * kk][0], t[2 * kk][1]);
  a[1] = pack<C>(t[2 * kk][2], t[2 * kk][3]);
  a[2] = pack<C>(t[2 * kk + 1][0], t[2 * kk + 1][1]);
  a[3] = pack<C>(t[2 * kk + 1][2], t[2 * kk + 1][3]);
}

// Reverses the rotary embedding of element c (the rotation by -angle).
template <class C>
__device__ __forceinline__ float unrotate(float x, float partner, int64_t position, int c) {
  constexpr int half = C::head_dim / 2;
  float sine, cosine;
  ropeSinCos<C>(position, c % half, &sine, &cosine);
  if constexpr (!C::rope_negative) sine = -sine;
  return c < half ? x * cosine - partner * sine : partner * sine + x * cosine;
}

}  // namespace cuda

//===----------------------------------------------------------------------===//
// Tiles (registers; K, V, Q, do, lse and D live in shared memory)
//===----------------------------------------------------------------------===//

template <class C>
struct KvGradTile {
  float dk[cuda::BackwardGeometry<C>::KMT][cuda::BackwardGeometry<C>::PT][4];
  float dv[cuda::BackwardGeometry<C>::KMT][cuda::BackwardGeometry<C>::PT][4];
  int64_t col0;
  int part = 0;  // the CTA's share of dK's and dV's columns (BackwardGeometry::PT n-tiles from part * PT)
  int stage = 0;  // the K and V stage holding col0's rows (the dq launch's two; layout.h, BackwardSmem)
  // wgmma's dq launch: a side of its ring of K and V stages (bwgmma): the
  // parity each stage's mbarrier completes next (bit s: stage s; the
  // consumers' full, the producer's empty barriers), and whether a consumer
  // holds `stage`.
  unsigned phases = 0, held = 0;
  Bits32 base = 0, tiles = 0;
};

template <class C>
struct QGradTile {
  int64_t row0;
  int stage = 0;  // the query stage holding row0's rows (layout.h, BackwardSmem)
  // wgmma: the parity each stage's mbarrier completes next (bit s: stage
  // s); whether the other stage (stage ^ 1, the only one a fill can be in
  // flight to between steps) has a TMA fill issued and not yet waited for;
  // the aligned shared memory's and row0's stage's shared-window addresses.
  unsigned phases = 0;
  bool pending = false;
  Bits32 base = 0, tiles = 0;
  // wgmma's dq launch: Q's and dO's rows of the warp as wgmma's register A
  // operand, a k-step each (its S and dP then take K's and V's descriptors
  // alone), up to head_dim 128 (layout.h, wgmmaBackwardHoldsRows).
  static constexpr int kHeldSteps = C::wgmma_backward && wgmmaBackwardHoldsRows(C::head_dim) ? C::head_dim / 16 : 1;
  Bits32 qa[kHeldSteps][4], doa[kHeldSteps][4];
};

// The key-block-outer launch uses t (S^T, then P^T) and dt (dS^T), the dq
// launch s (S, then P) and ds (dS); each launch's unused pair is never
// touched and takes no registers.
template <class C>
struct BwdScores {
  float t[cuda::BackwardGeometry<C>::KMT][cuda::BackwardGeometry<C>::QNT][4];
  float dt[cuda::BackwardGeometry<C>::KMT][cuda::BackwardGeometry<C>::QNT][4];
  float s[cuda::Geometry<C>::MT][cuda::Geometry<C>::NT][4];
  float ds[cuda::Geometry<C>::MT][cuda::Geometry<C>::NT][4];
  // wgmma: P^T and dS^T (key-block-outer) or dS (dq) packed as the register
  // A operand of the next product, kept until it retires.
  Bits32 pa[C::wgmma_backward ? (C::block_m > C::block_n ? C::block_m : C::block_n) / 16 : 1][4];
  Bits32 da[C::wgmma_backward ? C::block_m / 16 : 1][4];
};

template <class C>
struct DqTile {
  float dq[cuda::Geometry<C>::MT][cuda::BackwardGeometry<C>::DPT][4];
  int part = 0;  // the CTA's share of dq's columns, as KvGradTile's
};

//===----------------------------------------------------------------------===//
// The key-block-outer launch on wgmma (sm_90a, schedule.engine wgmma)
//===----------------------------------------------------------------------===//

// The same steps and the same register tiles: a wgmma accumulator's rows
// are its warp's 16 (warp w of the CTA holds rows 16w..16w + 15 of the
// block, one m-tile a warp), its columns an mma.sync C fragment's, so the
// mask, the probabilities, dS and the stores read them as they stand, and
// P^T, dS^T and dS pack as wgmma's register A operand as they do as
// mma.sync's. What differs is the products, a warpgroup's wgmma over its
// 64 rows with the other operand by descriptor from 128-byte swizzled tiles
// that TMA fills (layout.h, backwardWgmmaSmem and backwardWgmmaDqSmem):
//   key-block-outer: S^T = K Q^T, dP^T = V dO^T (K-major A and B, N =
//     block_m); dV += P^T dO, dK += dS^T Q (A from registers, B N-major);
//   dq: S = Q K^T, dP = dO V^T (Q and dO held as register A operands, K
//     and V K-major, N = block_n); dq += dS K (K N-major).
// Past head_dim 128 the key-block-outer launch's CTA is one of the parts
// of the gradient columns (layout.h, backwardColumnParts: whole atoms, two
// of 128 at 256, three of 64 at 192): S^T and dP^T over every column, dV
// and dK over the part's (the N-major B from the part's first atom:
// columnProduct). The dq launch takes dq whole (backwardDqParts: 128
// accumulators a thread at 256, one CTA an SM) and reads Q and dO by
// descriptor there (held, 64 registers each would not fit beside dq).
// The products are issued, committed and waited for by the steps, so that
// one runs while the next step's arithmetic does (bwd_scores, bwd_dv).
// The dq launch is warp-specialised (iha-warp-specialize): a producer
// warpgroup after the consumer warps issues every TMA fill (the *_fill
// calls), the consumers only wait for what they use and hand it back
// (below, the ring). The key-block-outer launch's thread 0 fills its query
// stages itself: a producer warpgroup there would cost its second CTA an SM
// (docs/performance.md, The Hopper backward).
namespace bwgmma {

template <class C>
struct Geometry {
  static_assert(C::dtype != DType::f32, "CUDA tiles take float16 or bfloat16 inputs");
  static_assert(C::warps % 4 == 0 && C::block_n == 16 * C::warps,
                "wgmma backward: 64 key rows a warpgroup (block_n = 16 x warps)");
  static_assert(wgmmaBackwardHeadDim(C::head_dim), "wgmma backward: head_dim 64, 80, 96, 112, 128, 192 or 256");
  static_assert(C::block_m % 64 == 0 && C::block_m <= 256, "wgmma backward: block_m in {64, 128, 192, 256}");
  static_assert(!C::atomic_dq, "wgmma backward: dq in its own launch");
  static constexpr int D = C::head_dim;
  static constexpr int threads = C::warps * kWarpSize;
  static constexpr int KT = D / 16;           // k-steps of S^T and dP^T (d)
  static constexpr int QK = C::block_m / 16;  // k-steps of dV and dK (query rows)
  static constexpr int qAtomBytes = C::block_m * kSwizzleRowBytes;
  static constexpr int kvAtomBytes = C::block_n * kSwizzleRowBytes;
  static constexpr int atoms = wgmmaTileColumns(D) / kSwizzleAtomColumns;  // a tile's
  // A CTA's share of dK's and dV's columns (cuda::BackwardGeometry, PT
  // n-tiles), whole swizzle atoms: the N of their products; dq's (DPT: its
  // launch's CTA takes every column).
  static constexpr int PN = cuda::BackwardGeometry<C>::PT * 8;
  static constexpr int DQN = cuda::BackwardGeometry<C>::DPT * 8;
  static constexpr bool holdsRows = wgmmaBackwardHoldsRows(D);
};

template <class C>
__device__ __forceinline__ BackwardSmem layout() {
  return backwardWgmmaSmem(C::block_m, C::block_n, C::head_dim);
}
// The dynamic shared memory rounded up to the swizzle period (its 32-bit
// shared-window address, and as a pointer).
__device__ __forceinline__ Bits32 baseAddress() {
  const Bits32 base = cuda::sharedAddress(cuda::smem());
  return (base + (kSwizzlePeriodBytes - 1)) & ~Bits32(kSwizzlePeriodBytes - 1);
}
__device__ __forceinline__ unsigned char* base() {
  unsigned char* smem = cuda::smem();
  return smem + (baseAddress() - cuda::sharedAddress(smem));
}

// The dq launch's (layout.h).
template <class C>
__device__ __forceinline__ BackwardSmem dqLayout() {
  return backwardWgmmaDqSmem(C::block_m, C::block_n, C::head_dim);
}

// mbarrier `index` (0: K and V; 1 + s: query stage s) as a shared-window address.
template <class C>
__device__ __forceinline__ Bits32 barrierAt(int index, Bits32 base = baseAddress()) {
  return base + Bits32(layout<C>().barriers + index * 8);
}

// One thread fills `tile` (64-column atoms of block_m or block_n rows,
// `atomBytes` apart) with the rows from `first` of plane `plane` of `map`,
// completing on `bar` (whose expected bytes the caller set: tileBytes):
// where head_dim is whole atoms by one TMA box (the runtime's 4-d maps: 64
// columns, the tile's rows, every atom), else by a box an atom (3-d maps:
// head_dim columns, rows, planes; the columns past head_dim come as zeros).
// Rows past L come as zeros (the map's bounds).
template <class C>
__device__ __forceinline__ void tmaTile(Bits32 tile, int atomBytes, const TensorMap* map, int64_t first, int64_t plane,
                                        Bits32 bar) {
  if constexpr (C::head_dim % kSwizzleAtomColumns == 0) {
    ptx::tmaLoad4d(tile, map, 0, int(first), 0, int(plane), bar);
  } else {
    #pragma unroll
    for (int atom = 0; atom < Geometry<C>::atoms; ++atom)
      ptx::tmaLoad3d(tile + Bits32(atom * atomBytes), map, atom * kSwizzleAtomColumns, int(first), int(plane), bar);
  }
}
// The bytes a tile of `rows` lands (every box whole, zeros included).
template <class C>
constexpr int tileBytes(int rows) {
  return rows * wgmmaTileColumns(C::head_dim) * kTileElementBytes;
}

// One thread: the tiles of layout `w` from `tiles` on (a query stage's) <- Q
// and dO rows [row0, row0 + block_m) of plane `plane` (b * H + h), with
// their lse (log2 units) and D, by TMA on `bar` (past L: zeros, or the
// next head's; masked).
template <class C>
__device__ __forceinline__ void fillQueryTiles(const TmaMaps& maps, const BackwardSmem& w, Bits32 tiles, Bits32 bar,
                                               int64_t row0, int64_t plane, int64_t L) {
  static_assert(kRowStatsPlanes == 2, "lse_log2, then D");
  ptx::mbarrierArriveExpectTx(bar, 2 * (tileBytes<C>(C::block_m) + C::block_m * kAccumulatorBytes));
  constexpr int atomBytes = Geometry<C>::qAtomBytes;
  tmaTile<C>(tiles + Bits32(w.q), atomBytes, &maps.q, row0, plane, bar);
  tmaTile<C>(tiles + Bits32(w.dO), atomBytes, &maps.dO, row0, plane, bar);
  // Both planes of the rows' statistics in one box: D lands block_m floats
  // after lse (placeQueryBlock).
  ptx::tmaLoad2d(tiles + Bits32(w.lse), &maps.row_stats, int(plane * L + row0), 0, bar);
}

// Query stage `stage` <- Q and dO rows [row0, row0 + block_m) of query head
// h, with their lse and D, by TMA (one thread, on the stage's mbarrier).
template <class C>
__device__ void fillQueryStage(QGradTile<C>& q, const IhaArgs& a, const TmaMaps& maps, int stage, int64_t row0,
                               int64_t h, int64_t b, int64_t L);

// Stage `stage`'s TMA fill in the wgmma launches: its mbarrier (layout
// `w`'s, after the launch's first: 1 + stage). The key-block-outer launch
// waits for it by the parity it completes next (`phases`).
__device__ __forceinline__ Bits32 stageBarrier(Bits32 base, const BackwardSmem& w, int stage) {
  return base + Bits32(w.barriers + 8 * (1 + stage));
}
__device__ __forceinline__ void waitStage(unsigned& phases, Bits32 bar, int stage) {
  ptx::mbarrierWaitParity(bar, int(phases >> stage) & 1);
  phases ^= 1u << stage;
}
// Waits for the fill issued and not yet waited for, if any (a block
// fetched past a loop's last: a window ends it before L), in the stage
// other than `stage`.
__device__ __forceinline__ void drainStage(unsigned& phases, bool& pending, int stage, Bits32 base,
                                          const BackwardSmem& w) {
  if (!pending) return;
  waitStage(phases, stageBarrier(base, w, stage ^ 1), stage ^ 1);
  pending = false;
}

// The dq launch is warp-specialised: the CTA's last warpgroup is the
// producer, one of its threads issuing every TMA fill in the order the
// consumers (warps 0 .. C::warps - 1, as without it) use them, into a ring
// of two K and V stages. The mbarriers of its layout `w`: 0 the query block,
// 1 + s stage s full (its fill's bytes landed), 3 + s stage s empty (every
// consumer thread has left it). A ring's side (KvGradTile: stage, phases,
// held) counts its own uses; the producer's and the consumers' walk the
// same key blocks.
constexpr int kEmptyBarriers = 1 + kBackwardQueryStages;
__device__ __forceinline__ Bits32 emptyBarrier(Bits32 base, const BackwardSmem& w, int stage) {
  return base + Bits32(w.barriers + 8 * (kEmptyBarriers + stage));
}
template <class C>
__device__ __forceinline__ bool producerIssues() {
  return threadIdx.x == C::warps * kWarpSize;
}
// A consumer's next block: the stage it holds (if any) handed back to the
// producer, then the next stage's fill waited for (the wait makes lse and D
// visible; TMA writes and wgmma reads through the async proxy). Returns the
// stage.
__device__ __forceinline__ int nextFullStage(int& stage, unsigned& phases, unsigned& held, Bits32 base,
                                             const BackwardSmem& w) {
  if (held) {
    ptx::mbarrierArrive(emptyBarrier(base, w, stage));
    stage ^= 1;
  }
  ptx::mbarrierWaitParity(stageBarrier(base, w, stage), int(phases >> stage) & 1);
  phases ^= 1u << stage;
  held = 1;
  return stage;
}
// The producer's next stage, once every consumer has left it (the first
// fill of a stage waits on the parity before a fresh mbarrier's first
// phase, which has completed: it waits for nothing). Returns the stage.
__device__ __forceinline__ int nextEmptyStage(int& stage, unsigned& phases, Bits32 base, const BackwardSmem& w) {
  const int s = stage;
  ptx::mbarrierWaitParity(emptyBarrier(base, w, s), int((phases >> s) & 1) ^ 1);
  phases ^= 1u << s;
  stage ^= 1;
  return s;
}

// Descriptors: K-major rows [64 wg, 64 wg + 64) of a tile of `atomBytes`
// atoms at k-step kt; an N-major tile (n = d) at k-step kk of its rows.
__device__ __forceinline__ Bits64 kMajor(Bits32 tile, int atomBytes, int firstRow, int kt) {
  const int atom = kt / (kSwizzleAtomColumns / 16), inner = (kt % (kSwizzleAtomColumns / 16)) * 16 * kTileElementBytes;
  return hopper::advanced(hopper::descriptorAt(tile, 16, kSwizzlePeriodBytes),
                          atom * atomBytes + firstRow * kSwizzleRowBytes + inner);
}
__device__ __forceinline__ Bits64 nMajor(Bits32 tile, int atomBytes, int kk) {
  return hopper::advanced(hopper::descriptorAt(tile, atomBytes, kSwizzlePeriodBytes), kk * 16 * kSwizzleRowBytes);
}

// The products issue their wgmma only: the caller fences before (ordering
// its register accesses), commits after and waits where it reads the
// results (a product in flight overlaps the next step's arithmetic).
//
// acc = A B^T over d, both K-major: A the warpgroup's 64 rows of a tile of
// `aAtomBytes` atoms (K or V over the key-block-outer launch's queries), B a
// tile of `bAtomBytes` atoms, N its rows.
template <class C, int N>
__device__ __forceinline__ void rowProduct(float (&acc)[N / 2], Bits32 a, int aAtomBytes, Bits32 b, int bAtomBytes) {
  using G = Geometry<C>;
  // The warpgroup's first row, from lane 0 (uniform, as the stage bases).
  const int firstRow = C::warps == 4 ? 0 : __shfl_sync(0xffffffffu, cuda::warp() / 4, 0) * 64;
  #pragma unroll
  for (int kt = 0; kt < G::KT; ++kt)
    wgmma::Wgmma<C::dtype, N>::ss(acc, kMajor(a, aAtomBytes, firstRow, kt), kMajor(b, bAtomBytes, 0, kt), kt > 0);
}

// The same with A from registers (a[kt]: the warp's 16 rows, k-step kt:
// the dq launch's Q or dO).
template <class C, int N>
__device__ __forceinline__ void registerRowProduct(float (&acc)[N / 2], const Bits32 (&a)[C::head_dim / 16][4],
                                                   Bits32 b, int bAtomBytes) {
  static_assert(Geometry<C>::holdsRows, "Q and dO held in registers up to head_dim 128");
  #pragma unroll
  for (int kt = 0; kt < C::head_dim / 16; ++kt)
    wgmma::Wgmma<C::dtype, N>::rsKMajor(acc, a[kt], kMajor(b, bAtomBytes, 0, kt), kt > 0);
}

// The warp's 16 rows of a swizzled tile of `atomBytes` atoms (the
// warpgroup's 64 from row 64 wg) as wgmma's register A operand, by
// ldmatrix.x4 a k-step: lane l gives row l % 16, the 8 columns (l / 16) * 8
// of the step's 16 (the m16k16 A fragment).
template <class C>
__device__ __forceinline__ void loadRows(Bits32 (&a)[C::head_dim / 16][4], Bits32 tile, int atomBytes) {
  const int l = cuda::lane(), r = cuda::warp() * 16 + l % 16;
  #pragma unroll
  for (int kt = 0; kt < C::head_dim / 16; ++kt) {
    const int column = kt * 16 + (l / 16) * kChunkElements;
    ptx::ldmatrixX4(a[kt], tile + Bits32((column / kSwizzleAtomColumns) * atomBytes +
                                         swizzledChunk(r, (column % kSwizzleAtomColumns) / kChunkElements)));
  }
}

// T (the warpgroup's 64 rows by K, the thread's C fragments `t`) packed
// as wgmma's register A operand, a k-step of 16 each.
template <class C, int K, int Steps>
__device__ __forceinline__ void pack(Bits32 (&a)[Steps][4], const float (&t)[K / 8][4]) {
  static_assert(Steps >= K / 16, "a k-step a 16 columns");
  #pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) cuda::repack<C>(a[kk], t, kk);
}

// acc += T B: T packed (pack), B N columns from `column0` (whole atoms:
// a part's, cuda::partColumn) of a tile of `bAtomBytes` atoms read N-major
// (n = d), K its rows.
template <class C, int K, int N, int Steps>
__device__ __forceinline__ void columnProduct(float (&acc)[N / 2], const Bits32 (&a)[Steps][4], Bits32 b,
                                              int bAtomBytes, int column0) {
  const Bits32 first = b + Bits32(column0 / kSwizzleAtomColumns * bAtomBytes);
  #pragma unroll
  for (int kk = 0; kk < K / 16; ++kk)
    wgmma::Wgmma<C::dtype, N>::rs(acc, a[kk], nMajor(first, bAtomBytes, kk), true);
}

// The one m-tile of a register tile, as wgmma's flat accumulators.
template <int N, class T>
__device__ __forceinline__ float (&flat(T& tile))[N] {
  static_assert(sizeof(T) == N * sizeof(float), "one m-tile of accumulators");
  return reinterpret_cast<float(&)[N]>(tile);
}

}  // namespace bwgmma

//===----------------------------------------------------------------------===//
// The collapse backward (token-parallel)
//===----------------------------------------------------------------------===//

// One warp per pseudo row (token, source head, p): do = sum over output
// heads of collapse * dout (stored 16-bit), D = rowsum(do * o) from the
// stored (rounded) do, the row's lse in log2 units (the attention backward's
// exponentials subtract it as it is), and each connected output head's dout . o into the
// CTA's dcollapse partial sums in shared memory.
template <class C>
__device__ void collapse_grad(const IhaArgs& a, int64_t token0, int64_t b) {
  constexpr int P = C::pseudo_heads, D = C::head_dim, tokens = C::block_m / P;
  constexpr int64_t entries = partials::collapse_entries<C>();
  const int64_t L = seq_len<C>(a);
  float* partial = reinterpret_cast<float*>(cuda::smem());
  for (int e = threadIdx.x; e < entries; e += blockDim.x) partial[e] = 0.0f;
  __syncthreads();
  const Bits16* o = static_cast<const Bits16*>(a.o_pseudo);
  Bits16* dO = static_cast<Bits16*>(a.do_pseudo);
  const int warps = int(blockDim.x) / kWarpSize;
  for (int row = cuda::warp(); row < tokens * C::heads * P; row += warps) {
    const int t = row / (C::heads * P), source = (row / P) % C::heads, p = row % P;
    const int64_t n = token0 + t;
    if (n >= a.tokens) continue;  // the whole warp
    const int64_t i = n * P + p, at = ((b * C::heads + source) * L + i) * D;
    float delta = 0.0f;
    for (int c = cuda::lane(); c < D; c += kWarpSize) {
      float sum = 0.0f;
      for (int target = 0; target < C::heads; ++target) {
        const int64_t w = partials::collapse_index<C>(target, source, p);
        if (w < 0) continue;
        sum += a.collapse[w] * cuda::loadElement<C>(a.dout, b * a.out_stride[0] + n * a.out_stride[1] +
                                                                 target * a.out_stride[2] + c);
      }
      const Bits16 rounded = cuda::toBits<C>(sum);
      dO[at + c] = rounded;
      if constexpr (C::atomic_dq) a.dq_pseudo[at + c] = 0.0f;  // the key-block launch adds into it
      delta += cuda::toFloat<C>(rounded) * cuda::toFloat<C>(o[at + c]);
    }
    delta = cuda::warpSum(delta);
    if (cuda::lane() == 0) {
      const int64_t row = (b * C::heads + source) * L + i;
      a.delta[row] = delta;
      a.lse_log2[row] = a.lse[row] * kLog2e;
    }
    for (int target = 0; target < C::heads; ++target) {
      const int64_t w = partials::collapse_index<C>(target, source, p);
      if (w < 0) continue;
      float dot = 0.0f;
      for (int c = cuda::lane(); c < D; c += kWarpSize)
        dot += cuda::loadElement<C>(a.dout, b * a.out_stride[0] + n * a.out_stride[1] + target * a.out_stride[2] + c) *
               cuda::toFloat<C>(o[at + c]);
      dot = cuda::warpSum(dot);
      if (cuda::lane() == 0) ptx::redSharedAddF32(cuda::sharedAddress(partial + w), dot);
    }
  }
  __syncthreads();
  float* out = partials::slot<C>(a, token0, b);
  for (int e = threadIdx.x; e < entries; e += blockDim.x) out[e] = partial[e];
}

//===----------------------------------------------------------------------===//
// Loads shared by both loops
//===----------------------------------------------------------------------===//

// K and V rows [col0, col0 + block_n) of kv head g into K and V stage
// `stage` by cp.async (zeros past L), one commit group; Unrolled from the
// thread's cursor where a row's chunks divide the threads (the dq launch's
// loop), else by copyRows' loop (the key-block-outer launch's one block:
// there the cursor's registers cost its loop a spill).
template <class C, bool Unrolled = true>
__device__ void copyKvStage(const IhaArgs& a, int stage, int64_t col0, int64_t g, int64_t b, int64_t L) {
  using G = cuda::Geometry<C>;
  const BackwardSmem s = cuda::bwdSmem<C>();
  const int at = stage * s.kvStage;
  constexpr int chunks = G::Dp / kChunkElements, dChunks = G::D / kChunkElements;
  const int64_t rows = (b * C::kv_heads + g) * L;  // the kv head's first row in the workspaces
  if constexpr (Unrolled && cuda::kBackwardCursor<C>) {
    if (!cuda::copiesByCursor<C>()) {
      cuda::commitCopies();
      return;
    }
    const int r0 = cuda::cursorRow<C>(), chunk = cuda::cursorChunk<C>();
    const int64_t first = (rows + col0) * G::D + (r0 * G::D + chunk * kChunkElements);
    const Bits32 place = Bits32((r0 * G::pitch + chunk * kChunkElements) * kTileElementBytes);
    const Bits32 kTarget = cuda::sharedAddress(cuda::bwdTile<C>(s.k + at)) + place;
    const Bits32 vTarget = cuda::sharedAddress(cuda::bwdTile<C>(s.v + at)) + place;
    const int left = int(min(L - col0, int64_t(C::block_n))) - r0;  // the thread's rows before L
    const bool column = dChunks == chunks || chunk < dChunks;
    cuda::copyCursorRounds<C, C::block_n, cuda::kKeyRows | cuda::kValueRows>(
        kTarget, static_cast<const Bits16*>(a.k_mixed) + first, vTarget, static_cast<const Bits16*>(a.v_mixed) + first,
        0, r0, left, column);
  } else {
    cuda::copyRows<C, C::block_n>(cuda::bwdTile<C>(s.k + at), a.k_mixed, C::kv_heads, b, g, col0, L);
    cuda::copyRows<C, C::block_n>(cuda::bwdTile<C>(s.v + at), a.v_mixed, C::kv_heads, b, g, col0, L);
  }
  cuda::commitCopies();
}
// The shared-window address of kv's K and V stage's tile (`offset`: its stage 0's).
template <class C>
__device__ __forceinline__ Bits32 kvStageTile(int offset, const KvGradTile<C>& kv) {
  return cuda::sharedAddress(cuda::bwdTile<C>(offset)) + Bits32(kv.stage * cuda::bwdSmem<C>().kvStage);
}

// The dq launch's first key block (rows [col0, col0 + block_n) of kv head
// g) into the stage its loop's first load_kv_grad reads, without waiting:
// the loop takes the blocks in order from there, each fetching the next
// (as q_grad_ahead and the key-block-outer loop's query blocks).
template <class C>
__device__ void kv_grad_ahead(KvGradTile<C>& kv, const IhaArgs& a, int64_t col0, int64_t g, int64_t b) {
  __syncthreads();
  cuda::waitCopies<0>();
  copyKvStage<C>(a, kv.stage ^ 1, col0, g, b, seq_len<C>(a));
}

// K and V rows [col0, col0 + block_n) of kv head g; zeros past L. With
// Ahead (the dq launch's loop, after kv_grad_ahead) the rows are on their
// way into the other stage: the next block's are copied into the previous
// block's stage while this one is used, and only this block's copies are
// waited for. Without (the key-block-outer launch's one block), they are
// copied into stage 0 and waited for.
template <class C, bool Ahead = false>
__device__ void load_kv_grad(KvGradTile<C>& kv, const IhaArgs& a, int64_t col0, int64_t g, int64_t b) {
  const int64_t L = seq_len<C>(a);
  __syncthreads();  // every warp is done with the previous key block's stage
  if constexpr (Ahead) {
    if (col0 + C::block_n < L) copyKvStage<C>(a, kv.stage, col0 + C::block_n, g, b, L);
    else cuda::commitCopies();  // an empty group: the wait leaves the newest group in flight either way
    cuda::waitCopies<1>();
    kv.stage ^= 1;
  } else {
    copyKvStage<C, false>(a, 0, col0, g, b, L);
    cuda::waitCopies<0>();
  }
  __syncthreads();
  kv.col0 = col0;
}

// The dq launch on wgmma, warp-specialised (bwgmma): the producer fills
// the two K and V stages by TMA, one key block after another in the loop's
// order (kv_grad_fill); each consumer's load_kv_grad hands the stage of the
// block before back and waits for this block's.
template <class C>
__device__ void kv_grad_fill(KvGradTile<C>& kv, const IhaArgs&, const TmaMaps& maps, int64_t col0, int64_t g,
                             int64_t b) {
  if (!bwgmma::producerIssues<C>()) return;
  const BackwardSmem w = bwgmma::dqLayout<C>();
  const Bits32 base = bwgmma::baseAddress();
  const int stage = bwgmma::nextEmptyStage(kv.stage, kv.phases, base, w);
  const Bits32 bar = bwgmma::stageBarrier(base, w, stage), tiles = base + Bits32(w.k + stage * w.kvStage);
  ptx::mbarrierArriveExpectTx(bar, 2 * bwgmma::tileBytes<C>(C::block_n));
  const int64_t plane = b * C::kv_heads + g;
  constexpr int atomBytes = bwgmma::Geometry<C>::kvAtomBytes;
  bwgmma::tmaTile<C>(tiles, atomBytes, &maps.k, col0, plane, bar);
  bwgmma::tmaTile<C>(tiles + Bits32(w.v - w.k), atomBytes, &maps.v, col0, plane, bar);
}
// The consumers' side before the loops: the ring's base, once (the
// producer fills the first key block).
template <class C>
__device__ void kv_grad_ahead(KvGradTile<C>& kv, const IhaArgs&, const TmaMaps&, int64_t, int64_t, int64_t) {
  kv.base = bwgmma::baseAddress();
}
template <class C, bool Ahead>
__device__ void load_kv_grad(KvGradTile<C>& kv, const IhaArgs&, const TmaMaps&, int64_t col0, int64_t, int64_t) {
  static_assert(Ahead && C::wgmma_backward, "tensor maps: the dq launch's loop on wgmma");
  const BackwardSmem w = bwgmma::dqLayout<C>();
  const int stage = bwgmma::nextFullStage(kv.stage, kv.phases, kv.held, kv.base, w);
  kv.tiles = kv.base + Bits32(w.k + stage * w.kvStage);
  kv.col0 = col0;
}
// After the dq launch's loops: every copy they issued has landed (a key
// block fetched past the loop's last) before the CTA ends. (On wgmma the
// consumers have waited for every fill the producer issued.)
template <class C>
__device__ void kv_grad_finish(KvGradTile<C>&, const IhaArgs&) {
  if constexpr (!C::wgmma_backward) cuda::waitCopies<0>();
}

template <class C>
__device__ void kv_grad_begin(KvGradTile<C>& kv, const IhaArgs& a, int64_t col0, int64_t g, int64_t b,
                              int64_t part) {
  load_kv_grad<C>(kv, a, col0, g, b);
  kv.part = int(part);
  cuda::zero<C>(kv.dk);
  cuda::zero<C>(kv.dv);
}
// On wgmma: the mbarriers set up, then the block's K and V by TMA.
template <class C>
__device__ void kv_grad_begin(KvGradTile<C>& kv, const IhaArgs& a, const TmaMaps& maps, int64_t col0, int64_t g,
                              int64_t b, int64_t part) {
  static_assert(C::wgmma_backward, "the key-block-outer launch takes tensor maps on wgmma only");
  const BackwardSmem w = bwgmma::layout<C>();
  const Bits32 bar = bwgmma::barrierAt<C>(0);
  if (threadIdx.x == 0) {
    #pragma unroll
    for (int i = 0; i < 1 + kBackwardQueryStages; ++i) ptx::mbarrierInit(bwgmma::barrierAt<C>(i), 1);
    ptx::fenceMbarrierInit();
    ptx::mbarrierArriveExpectTx(bar, 2 * bwgmma::tileBytes<C>(C::block_n));
    const int64_t plane = b * C::kv_heads + g;
    constexpr int atomBytes = bwgmma::Geometry<C>::kvAtomBytes;
    bwgmma::tmaTile<C>(bwgmma::baseAddress() + Bits32(w.k), atomBytes, &maps.k, col0, plane, bar);
    bwgmma::tmaTile<C>(bwgmma::baseAddress() + Bits32(w.v), atomBytes, &maps.v, col0, plane, bar);
  }
  __syncthreads();  // the barriers are initialised before anyone waits
  ptx::mbarrierWaitParity(bar, 0);
  kv.col0 = col0;
  kv.part = int(part);
  cuda::zero<C>(kv.dk);
  cuda::zero<C>(kv.dv);
}

// Q and do rows [row0, row0 + block_m) of query head h, with lse and D,
// into query stage `stage` by cp.async (zeros past L), one commit group.
// A thread copies the same bytes of a stage for every block, so its own
// wait orders its copies before it writes that stage again.
template <class C>
__device__ void copyQueryStage(const IhaArgs& a, int stage, int64_t row0, int64_t h, int64_t b, int64_t L) {
  using G = cuda::Geometry<C>;
  const BackwardSmem s = cuda::bwdSmem<C>();
  const int at = stage * s.stage;
  constexpr int chunks = G::Dp / kChunkElements, dChunks = G::D / kChunkElements;
  const int64_t rows = (b * C::heads + h) * L;  // the head's first row in the workspaces
  if constexpr (cuda::kBackwardCursor<C>) {
    // The thread's 16-byte chunk column is fixed and its rows step by
    // threads / chunks: every copy is its base addresses plus constants,
    // unrolled; a row past L takes src-size 0 (zeros, nothing read).
    const int r0 = cuda::cursorRow<C>(), chunk = cuda::cursorChunk<C>();
    const int64_t first = (rows + row0) * G::D + (r0 * G::D + chunk * kChunkElements);
    const Bits16* q = static_cast<const Bits16*>(a.q_mixed) + first;
    const Bits16* dO = static_cast<const Bits16*>(a.do_pseudo) + first;
    const Bits32 place = Bits32((r0 * G::pitch + chunk * kChunkElements) * kTileElementBytes);
    const Bits32 qTarget = cuda::sharedAddress(cuda::bwdTile<C>(s.q + at)) + place;
    const Bits32 dOTarget = cuda::sharedAddress(cuda::bwdTile<C>(s.dO + at)) + place;
    const int left = int(min(L - row0, int64_t(C::block_m))) - r0;  // the thread's rows before L
    const bool column = dChunks == chunks || chunk < dChunks;
    if (cuda::copiesByCursor<C>())
      cuda::copyCursorRounds<C, C::block_m, cuda::kKeyRows | cuda::kValueRows>(qTarget, q, dOTarget, dO, 0, r0, left,
                                                                               column);
  } else {
    cuda::copyRows<C, C::block_m>(cuda::bwdTile<C>(s.q + at), a.q_mixed, C::heads, b, h, row0, L);
    cuda::copyRows<C, C::block_m>(cuda::bwdTile<C>(s.dO + at), a.do_pseudo, C::heads, b, h, row0, L);
  }
  float* lse = cuda::bwdFloats<C>(s.lse + at);
  float* delta = cuda::bwdFloats<C>(s.delta + at);
  #pragma unroll
  for (int k = 0; k < (C::block_m + G::threads - 1) / G::threads; ++k) {
    const int r = int(threadIdx.x) + k * G::threads;
    if (C::block_m % G::threads != 0 && r >= C::block_m) break;
    const bool valid = row0 + r < L;
    const int64_t row = rows + (valid ? row0 + r : 0);
    ptx::cpAsyncCa4(lse + r, a.lse_log2 + row, valid);
    ptx::cpAsyncCa4(delta + r, a.delta + row, valid);
  }
  cuda::commitCopies();
}
// The byte offset of q's stage from stage 0.
template <class C>
__device__ __forceinline__ int stageOf(const QGradTile<C>& q) {
  return q.stage * cuda::bwdSmem<C>().stage;
}
// The shared-window address of a query stage's tile (`offset`: its stage 0's).
template <class C>
__device__ __forceinline__ Bits32 stageTile(int offset, const QGradTile<C>& q) {
  return cuda::sharedAddress(cuda::bwdTile<C>(offset)) + Bits32(stageOf<C>(q));
}

// The first query block of head h (rows [row0, row0 + block_m)) into the
// stage the key-block-outer loop's first load_q_grad reads, without
// waiting: the loop takes the head's blocks in order from there
// (iha-analyze-mask's ranges are contiguous), each fetching the next.
// A block fetched past the loop's last (a window ends it before L) lands
// before its stage is written again.
template <class C>
__device__ void q_grad_ahead(QGradTile<C>& q, const IhaArgs& a, int64_t row0, int64_t h, int64_t b) {
  __syncthreads();        // every warp is done with the previous head's stages
  cuda::waitCopies<0>();  // and this thread's copies have landed
  copyQueryStage<C>(a, q.stage ^ 1, row0, h, b, seq_len<C>(a));
}
// On wgmma: the same, Q and dO by TMA.
template <class C>
__device__ void q_grad_ahead(QGradTile<C>& q, const IhaArgs& a, const TmaMaps& maps, int64_t row0, int64_t h,
                             int64_t b) {
  __syncthreads();
  q.base = bwgmma::baseAddress();
  if (q.pending) {  // the same in every thread
    // Every thread waits out the previous head's last fill before one of
    // them fills a stage again: a barrier two phases on would hold a late
    // thread's parity wait forever (found by the emulator, a windowed GQA spec).
    bwgmma::drainStage(q.phases, q.pending, q.stage, q.base, bwgmma::layout<C>());
    __syncthreads();
  }
  bwgmma::fillQueryStage<C>(q, a, maps, q.stage ^ 1, row0, h, b, seq_len<C>(a));
  q.pending = true;
}

// After the key-block-outer loops: every copy they issued has landed (a
// block fetched past the loop's last) before the CTA ends.
template <class C>
__device__ void q_grad_finish(QGradTile<C>& q, const IhaArgs&) {
  if constexpr (C::wgmma_backward) bwgmma::drainStage(q.phases, q.pending, q.stage, q.base, bwgmma::layout<C>());
  cuda::waitCopies<0>();
}

// Q and do rows [row0, row0 + block_m) of query head h, with lse and D;
// zeros past L. With Ahead (the key-block-outer loop, after q_grad_ahead)
// the rows are already on their way into the other stage: the next block's
// are copied into this block's predecessor's stage while this one is used,
// and only this block's copies are waited for. Without (the dq launch's
// one block), they are copied and waited for.
template <class C, bool Ahead = false>
__device__ void load_q_grad(QGradTile<C>& q, const IhaArgs& a, int64_t row0, int64_t h, int64_t b) {
  const int64_t L = seq_len<C>(a);
  __syncthreads();  // every warp is done with the previous block's stage
  if constexpr (Ahead) {
    if (row0 + C::block_m < L) copyQueryStage<C>(a, q.stage, row0 + C::block_m, h, b, L);
    else cuda::commitCopies();  // an empty group: the wait leaves the newest group in flight either way
    cuda::waitCopies<1>();
    q.stage ^= 1;
  } else {  // stage 0: the dq launch's second K and V stage lies over stage 1
    copyQueryStage<C>(a, 0, row0, h, b, L);
    cuda::waitCopies<0>();
    q.stage = 0;
  }
  __syncthreads();
  q.row0 = row0;
}
// On wgmma (the key-block-outer loop): the next block by TMA, this one's
// waited for on its stage's mbarrier (TMA writes and wgmma reads through
// the async proxy: no proxy fence; the wait makes lse and D visible).
// Without Ahead (the dq launch's one query block, warp-specialised): its
// Q, dO, lse and D (dq_begin_fill, mbarrier 0) waited for, Q and dO then
// held in registers.
template <class C, bool Ahead = false>
__device__ void load_q_grad(QGradTile<C>& q, const IhaArgs& a, const TmaMaps& maps, int64_t row0, int64_t h,
                            int64_t b) {
  static_assert(C::wgmma_backward, "tensor maps: the backward on wgmma");
  const int64_t L = seq_len<C>(a);
  if constexpr (!Ahead) {
    const BackwardSmem w = bwgmma::dqLayout<C>();
    q.base = bwgmma::baseAddress();
    ptx::mbarrierWaitParity(q.base + Bits32(w.barriers), 0);
    if constexpr (bwgmma::Geometry<C>::holdsRows) {
      bwgmma::loadRows<C>(q.qa, q.base + Bits32(w.q), bwgmma::Geometry<C>::qAtomBytes);
      bwgmma::loadRows<C>(q.doa, q.base + Bits32(w.dO), bwgmma::Geometry<C>::qAtomBytes);
    }
    q.tiles = q.base;
    q.stage = 0;
    q.row0 = row0;
    return;
  }
  __syncthreads();  // every warp is done with the previous block's stage (TMA refills it)
  // (32-bit: a head's rows are the TMA's int coordinates.)
  const bool more = int(row0) + C::block_m < int(L);
  if (more) bwgmma::fillQueryStage<C>(q, a, maps, q.stage, row0 + C::block_m, h, b, L);
  const BackwardSmem w = bwgmma::layout<C>();
  const int next = q.stage ^ 1;
  bwgmma::waitStage(q.phases, bwgmma::stageBarrier(q.base, w, next), next);
  q.stage = next;
  q.pending = more;  // into the stage just left, now the other
  q.tiles = q.base + Bits32(next * w.stage);
  q.row0 = row0;
}

namespace bwgmma {
template <class C>
__device__ void fillQueryStage(QGradTile<C>& q, const IhaArgs&, const TmaMaps& maps, int stage, int64_t row0,
                               int64_t h, int64_t b, int64_t L) {
  const BackwardSmem w = layout<C>();
  if (threadIdx.x == 0)
    fillQueryTiles<C>(maps, w, q.base + Bits32(stage * w.stage), stageBarrier(q.base, w, stage), row0,
                      b * C::heads + h, L);
}
}  // namespace bwgmma

// The dq launch's producer: its query block's Q, dO, lse and D onto mbarrier 0.
template <class C>
__device__ void dq_begin_fill(QGradTile<C>&, const IhaArgs& a, const TmaMaps& maps, int64_t row0, int64_t h,
                              int64_t b) {
  if (!bwgmma::producerIssues<C>()) return;
  const BackwardSmem w = bwgmma::dqLayout<C>();
  const Bits32 base = bwgmma::baseAddress();
  bwgmma::fillQueryTiles<C>(maps, w, base, base + Bits32(w.barriers), row0, b * C::heads + h, seq_len<C>(a));
}

// Warp specialisation of the wgmma backward's dq launch (bwgmma): every
// thread sets up the mbarriers of its layout, then the last warpgroup
// produces and the others consume, their registers moved by setmaxnreg
// (layout.h, consumerRegisters over backwardDqCtasPerSm's share).
template <class C>
__device__ void bwd_pipeline_init() {
  static_assert(C::wgmma_backward, "the wgmma backward's dq launch is warp-specialised");
  const BackwardSmem w = bwgmma::dqLayout<C>();
  if (threadIdx.x == 0) {
    const Bits32 base = bwgmma::baseAddress();
    #pragma unroll
    for (int i = 0; i < bwgmma::kEmptyBarriers; ++i) ptx::mbarrierInit(base + Bits32(w.barriers + 8 * i), 1);
    #pragma unroll
    for (int s = 0; s < kBackwardQueryStages; ++s)
      ptx::mbarrierInit(bwgmma::emptyBarrier(base, w, s), C::warps * kWarpSize);
    ptx::fenceMbarrierInit();
  }
  __syncthreads();  // the barriers are initialised before anyone waits or arrives
}
template <class C>
__device__ __forceinline__ bool bwd_is_producer() {
  return __shfl_sync(0xffffffffu, int(threadIdx.x) / kWarpgroupThreadCount, 0) ==
         C::warps * kWarpSize / kWarpgroupThreadCount;
}
template <class C>
__device__ __forceinline__ void bwd_producer_start() {
  ptx::setmaxnregDec<kBackwardDqProducerRegisters>();
}
template <class C>
__device__ __forceinline__ void bwd_consumer_start() {
  ptx::setmaxnregInc<consumerRegisters(C::warps, kBackwardDqProducerRegisters,
                                       backwardDqCtasPerSm(C::warps, C::head_dim))>();
}

//===----------------------------------------------------------------------===//
// The steps of a (query block, key block) pair
//===----------------------------------------------------------------------===//

// Outer::keys: S^T = K Q^T, warps over key rows.
// Outer::queries: S = Q K^T, warps over query rows.
// (Unscaled: bwd_probs folds scale * log2(e) into its exponentials.)
template <class C, Outer O>
__device__ void bwd_scores(BwdScores<C>& s, QGradTile<C>& q, KvGradTile<C>& kv) {
  using G = cuda::Geometry<C>;
  using BG = cuda::BackwardGeometry<C>;
  const BackwardSmem smem = cuda::bwdSmem<C>();
  const auto kTile = cuda::keyBlockTile<C>(smem.k);
  const Bits32 qTile = stageTile<C>(smem.q, q);
  if constexpr (O == Outer::keys) {
    if constexpr (C::wgmma_backward) {
      // S^T, then dP^T in flight while the probabilities and dV are made
      // (bwd_dv's wait retires it).
      using W = bwgmma::Geometry<C>;
      const BackwardSmem w = bwgmma::layout<C>();
      ptx::pinRegisters(bwgmma::flat<C::block_m / 2>(s.t));
      ptx::pinRegisters(bwgmma::flat<C::block_m / 2>(s.dt));
      ptx::wgmmaFence();
      bwgmma::rowProduct<C, C::block_m>(bwgmma::flat<C::block_m / 2>(s.t), q.base + Bits32(w.k), W::kvAtomBytes,
                                        q.tiles + Bits32(w.q), W::qAtomBytes);
      ptx::wgmmaCommit();
      bwgmma::rowProduct<C, C::block_m>(bwgmma::flat<C::block_m / 2>(s.dt), q.base + Bits32(w.v), W::kvAtomBytes,
                                        q.tiles + Bits32(w.dO), W::qAtomBytes);
      ptx::wgmmaCommit();
      ptx::wgmmaWait<1>();
      ptx::pinRegisters(bwgmma::flat<C::block_m / 2>(s.t));
    } else {
      cuda::zero<C>(s.t);
      #pragma unroll
      for (int kt = 0; kt < G::KT; ++kt) {
        Bits32 a[BG::KMT][4];
        #pragma unroll
        for (int mt = 0; mt < BG::KMT; ++mt) cuda::loadA<C>(a[mt], kTile, cuda::keyRow<C>(mt), kt);
        #pragma unroll
        for (int pair = 0; pair < BG::QNT / 2; ++pair) {
          Bits32 bq[4];
          cuda::loadB<C>(bq, qTile, pair, kt);
          #pragma unroll
          for (int mt = 0; mt < BG::KMT; ++mt) {
            cuda::mma16816<C>(s.t[mt][2 * pair], a[mt], bq[0], bq[1]);
            cuda::mma16816<C>(s.t[mt][2 * pair + 1], a[mt], bq[2], bq[3]);
          }
        }
      }
      // Scaled here (into the log2 domain), where bwd_probs then subtracts
      // lse alone: folding the scale into bwd_probs' FFMA costs this launch
      // under dq atomic at head_dim 128 a spill on sm_80.
      constexpr float scale = C::scale * kLog2e;
      #pragma unroll
      for (int mt = 0; mt < BG::KMT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < BG::QNT; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; ++e) s.t[mt][nt][e] *= scale;
    }
  } else if constexpr (C::wgmma_backward) {
    // S, then dP in flight while the probabilities are made (bwd_ds's wait
    // retires it).
    using W = bwgmma::Geometry<C>;
    const BackwardSmem w = bwgmma::dqLayout<C>();
    ptx::pinRegisters(bwgmma::flat<C::block_n / 2>(s.s));
    ptx::pinRegisters(bwgmma::flat<C::block_n / 2>(s.ds));
    ptx::wgmmaFence();
    if constexpr (W::holdsRows) {
      bwgmma::registerRowProduct<C, C::block_n>(bwgmma::flat<C::block_n / 2>(s.s), q.qa, kv.tiles, W::kvAtomBytes);
      ptx::wgmmaCommit();
      bwgmma::registerRowProduct<C, C::block_n>(bwgmma::flat<C::block_n / 2>(s.ds), q.doa,
                                                kv.tiles + Bits32(w.v - w.k), W::kvAtomBytes);
    } else {  // Q and dO by descriptor (the consumer warpgroup's 64 rows)
      bwgmma::rowProduct<C, C::block_n>(bwgmma::flat<C::block_n / 2>(s.s), q.base + Bits32(w.q), W::qAtomBytes,
                                        kv.tiles, W::kvAtomBytes);
      ptx::wgmmaCommit();
      bwgmma::rowProduct<C, C::block_n>(bwgmma::flat<C::block_n / 2>(s.ds), q.base + Bits32(w.dO), W::qAtomBytes,
                                        kv.tiles + Bits32(w.v - w.k), W::kvAtomBytes);
    }
    ptx::wgmmaCommit();
    ptx::wgmmaWait<1>();
    ptx::pinRegisters(bwgmma::flat<C::block_n / 2>(s.s));
  } else {
    cuda::zero<C>(s.s);
    #pragma unroll
    for (int kt = 0; kt < G::KT; ++kt) {
      Bits32 a[G::MT][4];
      #pragma unroll
      for (int mt = 0; mt < G::MT; ++mt) cuda::loadA<C>(a[mt], qTile, cuda::tileRow<C>(mt), kt);
      #pragma unroll
      for (int pair = 0; pair < G::NT / 2; ++pair) {
        Bits32 bk[4];
        cuda::loadB<C>(bk, kvStageTile<C>(smem.k, kv), pair, kt);
        #pragma unroll
        for (int mt = 0; mt < G::MT; ++mt) {
          cuda::mma16816<C>(s.s[mt][2 * pair], a[mt], bk[0], bk[1]);
          cuda::mma16816<C>(s.s[mt][2 * pair + 1], a[mt], bk[2], bk[3]);
        }
      }
    }
  }
}

// -inf for pairs the mask forbids and rows or columns past the end: each
// query row's visible keys (visibleColumns: the mask within its document)
// found once, then its elements compared with them.
template <class C, Outer O>
__device__ void bwd_mask(BwdScores<C>& s, const IhaArgs& a, QGradTile<C>& q, KvGradTile<C>& kv) {
  using G = cuda::Geometry<C>;
  using BG = cuda::BackwardGeometry<C>;
  const int L = int(seq_len<C>(a)), i0 = int(q.row0), j0 = int(kv.col0), l = cuda::lane();
  // A row sees from key 0 on unless a window or its document starts it later.
  constexpr bool kLowerEnd = windowed<C>() || C::varlen;
  if constexpr (O == Outer::keys) {
    // The thread's query columns (n-tile nt, column c) against its key rows.
    #pragma unroll
    for (int nt = 0; nt < BG::QNT; ++nt)
      #pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int i = i0 + nt * 8 + fragment::accumulatorColumn(l, c);
        const ColumnRange<int> keys = visibleColumns<C, int>(a, i);
        const int lo = keys.lo, hi = keys.hi < L - 1 ? keys.hi : L - 1;
        #pragma unroll
        for (int mt = 0; mt < BG::KMT; ++mt)
          #pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int j = j0 + cuda::keyRow<C>(mt) + fragment::accumulatorRow(l, 2 * r);
            if (i >= L || (kLowerEnd && j < lo) || j > hi) s.t[mt][nt][2 * r + c] = cuda::negativeInfinity();
          }
      }
  } else {
    #pragma unroll
    for (int mt = 0; mt < G::MT; ++mt)
      #pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = i0 + cuda::tileRow<C>(mt) + fragment::accumulatorRow(l, 2 * r);
        const ColumnRange<int> keys = visibleColumns<C, int>(a, i);
        const int lo = keys.lo, hi = keys.hi < L - 1 ? keys.hi : L - 1;
        #pragma unroll
        for (int nt = 0; nt < G::NT; ++nt)
          #pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int j = j0 + nt * 8 + fragment::accumulatorColumn(l, c);
            if (i >= L || (kLowerEnd && j < lo) || j > hi) s.s[mt][nt][2 * r + c] = cuda::negativeInfinity();
          }
      }
  }
}

// P = exp2(S * scale * log2(e) - lse * log2(e)): the forward's
// probabilities, recomputed (flush-to-zero, as the forward's), with the
// collapse backward's lse * log2(e) (lse_log2).
template <class C, Outer O>
__device__ void bwd_probs(BwdScores<C>& s, QGradTile<C>& q) {
  using G = cuda::Geometry<C>;
  using BG = cuda::BackwardGeometry<C>;
  constexpr float scale = C::scale * kLog2e;
  const float* lse = cuda::bwdFloats<C>(cuda::bwdSmem<C>().lse + stageOf<C>(q));
  const int l = cuda::lane();
  if constexpr (C::wgmma_backward && O == Outer::queries) {
    lse = reinterpret_cast<const float*>(bwgmma::base() + bwgmma::dqLayout<C>().lse);
  }
  if constexpr (O == Outer::keys && C::wgmma_backward) {
    // The stage's lse by its shared-window address (q.tiles: no generic one to form).
    const Bits32 rows = q.tiles + Bits32(bwgmma::layout<C>().lse + kAccumulatorBytes * fragment::accumulatorColumn(l, 0));
    #pragma unroll
    for (int nt = 0; nt < BG::QNT; ++nt) {
      // The thread's two query columns of the n-tile, adjacent.
      const float2 pair = ptx::ldSharedF32x2(rows + Bits32(nt * 8 * kAccumulatorBytes));
      const float m[2] = {pair.x, pair.y};
      #pragma unroll
      for (int mt = 0; mt < BG::KMT; ++mt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) s.t[mt][nt][e] = ptx::exp2Ftz(fmaf(s.t[mt][nt][e], scale, -m[e % 2]));
    }
  } else if constexpr (O == Outer::keys) {
    // One column at a time (a float2 of both costs the key-block-outer
    // launch under dq atomic at head_dim 128 a spill on sm_80).
    #pragma unroll
    for (int nt = 0; nt < BG::QNT; ++nt)
      #pragma unroll
      for (int column = 0; column < 2; ++column) {
        const float m = lse[nt * 8 + fragment::accumulatorColumn(l, column)];
        #pragma unroll
        for (int mt = 0; mt < BG::KMT; ++mt) {
          s.t[mt][nt][column] = ptx::exp2Ftz(s.t[mt][nt][column] - m);
          s.t[mt][nt][column + 2] = ptx::exp2Ftz(s.t[mt][nt][column + 2] - m);
        }
      }
  } else {
    #pragma unroll
    for (int mt = 0; mt < G::MT; ++mt)
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m = lse[cuda::tileRow<C>(mt) + fragment::accumulatorRow(l, 2 * h)];
        #pragma unroll
        for (int nt = 0; nt < G::NT; ++nt) {
          s.s[mt][nt][2 * h] = ptx::exp2Ftz(fmaf(s.s[mt][nt][2 * h], scale, -m));
          s.s[mt][nt][2 * h + 1] = ptx::exp2Ftz(fmaf(s.s[mt][nt][2 * h + 1], scale, -m));
        }
      }
  }
}

// dV += P^T do: P^T's C fragments re-packed as A, do by ldmatrix.trans.
template <class C>
__device__ void bwd_dv(KvGradTile<C>& kv, BwdScores<C>& s, QGradTile<C>& q) {
  using BG = cuda::BackwardGeometry<C>;
  if constexpr (C::wgmma_backward) {
    // dV's product in flight until bwd_dk's wait; this wait retires dP^T.
    const BackwardSmem w = bwgmma::layout<C>();
    constexpr int PN = bwgmma::Geometry<C>::PN;
    bwgmma::pack<C, C::block_m>(s.pa, s.t[0]);
    ptx::pinRegisters(bwgmma::flat<PN / 2>(kv.dv));
    ptx::wgmmaFence();
    bwgmma::columnProduct<C, C::block_m, PN>(bwgmma::flat<PN / 2>(kv.dv), s.pa, q.tiles + Bits32(w.dO),
                                             bwgmma::Geometry<C>::qAtomBytes, cuda::partColumn<C>(kv.part));
    ptx::wgmmaCommit();
    ptx::wgmmaWait<1>();
    ptx::pinRegisters(bwgmma::flat<C::block_m / 2>(s.dt));
    return;
  }
  const Bits32 dO = stageTile<C>(cuda::bwdSmem<C>().dO, q) + cuda::columnBytes(cuda::partColumn<C>(kv.part));
  #pragma unroll
  for (int kk = 0; kk < BG::QK; ++kk) {
    Bits32 p[BG::KMT][4];
    #pragma unroll
    for (int mt = 0; mt < BG::KMT; ++mt) cuda::repack<C>(p[mt], s.t[mt], kk);
    #pragma unroll
    for (int pair = 0; pair < BG::PT / 2; ++pair) {
      Bits32 b[4];
      cuda::loadBTrans<C>(b, dO, kk, pair);
      #pragma unroll
      for (int mt = 0; mt < BG::KMT; ++mt) {
        cuda::mma16816<C>(kv.dv[mt][2 * pair], p[mt], b[0], b[1]);
        cuda::mma16816<C>(kv.dv[mt][2 * pair + 1], p[mt], b[2], b[3]);
      }
    }
  }
}

// Outer::keys: dP^T = V do^T, dS^T = P^T (dP^T - D).
// Outer::queries: dP = do V^T, dS = P (dP - D).
template <class C, Outer O>
__device__ void bwd_ds(BwdScores<C>& s, QGradTile<C>& q, KvGradTile<C>& kv) {
  using G = cuda::Geometry<C>;
  using BG = cuda::BackwardGeometry<C>;
  const BackwardSmem smem = cuda::bwdSmem<C>();
  const auto vTile = cuda::keyBlockTile<C>(smem.v);
  const Bits32 dOTile = stageTile<C>(smem.dO, q);
  const float* delta = cuda::bwdFloats<C>(smem.delta + stageOf<C>(q));
  const int l = cuda::lane();
  if constexpr (O == Outer::keys) {
    // dP^T: on wgmma bwd_scores issued it and bwd_dv's wait retired it.
    if constexpr (!C::wgmma_backward) {
      cuda::zero<C>(s.dt);
      #pragma unroll
      for (int kt = 0; kt < G::KT; ++kt) {
        Bits32 a[BG::KMT][4];
        #pragma unroll
        for (int mt = 0; mt < BG::KMT; ++mt) cuda::loadA<C>(a[mt], vTile, cuda::keyRow<C>(mt), kt);
        #pragma unroll
        for (int pair = 0; pair < BG::QNT / 2; ++pair) {
          Bits32 b[4];
          cuda::loadB<C>(b, dOTile, pair, kt);
          #pragma unroll
          for (int mt = 0; mt < BG::KMT; ++mt) {
            cuda::mma16816<C>(s.dt[mt][2 * pair], a[mt], b[0], b[1]);
            cuda::mma16816<C>(s.dt[mt][2 * pair + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
    #pragma unroll
    for (int nt = 0; nt < BG::QNT; ++nt) {
      float d[2];
      if constexpr (C::wgmma_backward) {  // the thread's two query columns, adjacent
        const float2 pair = ptx::ldSharedF32x2(q.tiles + Bits32(bwgmma::layout<C>().delta + kAccumulatorBytes *
                                                                  (nt * 8 + fragment::accumulatorColumn(l, 0))));
        d[0] = pair.x, d[1] = pair.y;
      } else {  // one at a time (as bwd_probs: a float2 spills dq atomic at head_dim 128 on sm_80)
        d[0] = delta[nt * 8 + fragment::accumulatorColumn(l, 0)];
        d[1] = delta[nt * 8 + fragment::accumulatorColumn(l, 1)];
      }
      #pragma unroll
      for (int mt = 0; mt < BG::KMT; ++mt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) s.dt[mt][nt][e] = s.t[mt][nt][e] * (s.dt[mt][nt][e] - d[e % 2]);
    }
    // dq atomic: dS^T (16-bit, as the products read it) to shared memory,
    // where bwd_dk takes its warp's rows and bwd_dq_atomic every row; dS^T
    // leaves the registers here.
    if constexpr (C::atomic_dq) {
      constexpr int pitch = tilePitch(C::block_m);
      Bits16* dsTile = cuda::bwdTile<C>(smem.ds);
      #pragma unroll
      for (int mt = 0; mt < BG::KMT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < BG::QNT; ++nt)
          #pragma unroll
          for (int e = 0; e < 4; e += 2) {
            const int row = cuda::keyRow<C>(mt) + fragment::accumulatorRow(l, e);
            const int column = nt * 8 + fragment::accumulatorColumn(l, e);
            *reinterpret_cast<Bits32*>(dsTile + row * pitch + column) =
                cuda::pack<C>(s.dt[mt][nt][e], s.dt[mt][nt][e + 1]);
          }
      __syncthreads();
    }
  } else {
    if constexpr (C::wgmma_backward) {  // dP: bwd_scores issued it
      ptx::wgmmaWait<0>();
      ptx::pinRegisters(bwgmma::flat<C::block_n / 2>(s.ds));
      delta = reinterpret_cast<const float*>(bwgmma::base() + bwgmma::dqLayout<C>().delta);
    } else {
      cuda::zero<C>(s.ds);
      #pragma unroll
      for (int kt = 0; kt < G::KT; ++kt) {
        Bits32 a[G::MT][4];
        #pragma unroll
        for (int mt = 0; mt < G::MT; ++mt) cuda::loadA<C>(a[mt], dOTile, cuda::tileRow<C>(mt), kt);
        #pragma unroll
        for (int pair = 0; pair < G::NT / 2; ++pair) {
          Bits32 b[4];
          cuda::loadB<C>(b, kvStageTile<C>(smem.v, kv), pair, kt);
          #pragma unroll
          for (int mt = 0; mt < G::MT; ++mt) {
            cuda::mma16816<C>(s.ds[mt][2 * pair], a[mt], b[0], b[1]);
            cuda::mma16816<C>(s.ds[mt][2 * pair + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
    #pragma unroll
    for (int mt = 0; mt < G::MT; ++mt)
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float d = delta[cuda::tileRow<C>(mt) + fragment::accumulatorRow(l, 2 * h)];
        #pragma unroll
        for (int nt = 0; nt < G::NT; ++nt) {
          s.ds[mt][nt][2 * h] = s.s[mt][nt][2 * h] * (s.ds[mt][nt][2 * h] - d);
          s.ds[mt][nt][2 * h + 1] = s.s[mt][nt][2 * h + 1] * (s.ds[mt][nt][2 * h + 1] - d);
        }
      }
  }
}

// dK += dS^T Q (the scale is applied when stored); dS^T re-packed from its
// C fragments, or under dq atomic read back from where bwd_ds staged it.
template <class C>
__device__ void bwd_dk(KvGradTile<C>& kv, BwdScores<C>& s, QGradTile<C>& q) {
  using BG = cuda::BackwardGeometry<C>;
  if constexpr (C::wgmma_backward) {  // this wait retires dV's product and dK's
    const BackwardSmem w = bwgmma::layout<C>();
    constexpr int PN = bwgmma::Geometry<C>::PN;
    bwgmma::pack<C, C::block_m>(s.da, s.dt[0]);
    ptx::pinRegisters(bwgmma::flat<PN / 2>(kv.dk));
    ptx::wgmmaFence();
    bwgmma::columnProduct<C, C::block_m, PN>(bwgmma::flat<PN / 2>(kv.dk), s.da, q.tiles + Bits32(w.q),
                                             bwgmma::Geometry<C>::qAtomBytes, cuda::partColumn<C>(kv.part));
    ptx::wgmmaCommit();
    ptx::wgmmaWait<0>();
    ptx::pinRegisters(bwgmma::flat<PN / 2>(kv.dv));
    ptx::pinRegisters(bwgmma::flat<PN / 2>(kv.dk));
    return;
  }
  const Bits32 qTile = stageTile<C>(cuda::bwdSmem<C>().q, q) + cuda::columnBytes(cuda::partColumn<C>(kv.part));
  #pragma unroll
  for (int kk = 0; kk < BG::QK; ++kk) {
    Bits32 ds[BG::KMT][4];
    #pragma unroll
    for (int mt = 0; mt < BG::KMT; ++mt) {
      if constexpr (C::atomic_dq) {  // from the staged dS^T (bwd_ds)
        const Bits16* dsTile = cuda::bwdTile<C>(cuda::bwdSmem<C>().ds);
        const int l = cuda::lane();
        cuda::ldmatrixX4(ds[mt], cuda::sharedAddress(dsTile + (cuda::keyRow<C>(mt) + fragment::aRow(l)) *
                                                                  tilePitch(C::block_m) +
                                                              kk * kMmaK + fragment::aColumn(l)));
      } else {
        cuda::repack<C>(ds[mt], s.dt[mt], kk);
      }
    }
    #pragma unroll
    for (int pair = 0; pair < BG::PT / 2; ++pair) {
      Bits32 b[4];
      cuda::loadBTrans<C>(b, qTile, kk, pair);
      #pragma unroll
      for (int mt = 0; mt < BG::KMT; ++mt) {
        cuda::mma16816<C>(kv.dk[mt][2 * pair], ds[mt], b[0], b[1]);
        cuda::mma16816<C>(kv.dk[mt][2 * pair + 1], ds[mt], b[2], b[3]);
      }
    }
  }
}

namespace cuda {
// A thread's accumulator fragments of rows first(mt) + fragment rows, the
// NT n-tiles of columns from `column0` (a part's), as f32 rows of a
// workspace [B, heads, L, d], times `scale`; rows past L skipped.
template <class C, int MTiles, int NT, class FirstRow>
__device__ void storeFragments(const float (&acc)[MTiles][NT][4], float* workspace, int heads, int64_t b, int64_t h,
                               int64_t row0, int64_t L, float scale, int column0, FirstRow first) {
  using G = Geometry<C>;
  const int l = lane();
  #pragma unroll
  for (int mt = 0; mt < MTiles; ++mt)
    #pragma unroll
    for (int ot = 0; ot < NT; ++ot)
      #pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int64_t i = row0 + first(mt) + fragment::accumulatorRow(l, e);
        const int c = column0 + ot * 8 + fragment::accumulatorColumn(l, e);
        if (i >= L || c >= G::D) continue;
        *reinterpret_cast<float2*>(workspace + ((b * heads + h) * L + i) * G::D + c) =
            make_float2(acc[mt][ot][e] * scale, acc[mt][ot][e + 1] * scale);
      }
}
}  // namespace cuda

template <class C>
__device__ void kv_grad_store(KvGradTile<C>& kv, const IhaArgs& a, int64_t col0, int64_t g, int64_t b) {
  const int64_t L = seq_len<C>(a);
  auto first = [](int mt) { return cuda::keyRow<C>(mt); };
  const int column0 = cuda::partColumn<C>(kv.part);
  cuda::storeFragments<C>(kv.dk, a.dk_pseudo, C::kv_heads, b, g, col0, L, C::scale, column0, first);
  cuda::storeFragments<C>(kv.dv, a.dv_pseudo, C::kv_heads, b, g, col0, L, 1.0f, column0, first);
}

// dq += scale * dS K by atomic adds (dq atomic), from the dS^T bwd_ds
// staged: each (query m-tile, head-dim pair) item is an mma over the
// block's key rows, dS as the A operand by ldmatrix.trans of the staged
// dS^T, K by ldmatrix.trans, added into dq's workspace by
// red.global.add.f32 (other key blocks' CTAs add to the same rows). The
// next query block's load_q_grad synchronises before bwd_ds stages again.
template <class C>
__device__ void bwd_dq_atomic(BwdScores<C>&, QGradTile<C>& q, KvGradTile<C>& kv, const IhaArgs& a, int64_t h,
                              int64_t b) {
  using G = cuda::Geometry<C>;
  using BG = cuda::BackwardGeometry<C>;
  static_assert(C::block_m % 16 == 0, "dq atomic takes 16-row query m-tiles");
  constexpr int pitch = tilePitch(C::block_m);
  const BackwardSmem smem = cuda::bwdSmem<C>();
  const Bits16* dsTile = cuda::bwdTile<C>(smem.ds);
  const Bits16* kTile = cuda::bwdTile<C>(smem.k);
  const int l = cuda::lane();
  // The part's head-dim pairs (its dK and dV columns: each part adds its own).
  constexpr int pairs = BG::PT / 2, items = C::block_m / 16 * pairs;
  const int firstPair = cuda::partColumn<C>(kv.part) / 16;
  const int L = int(seq_len<C>(a)), row0 = int(q.row0);
  float* dq = a.dq_pseudo + (b * C::heads + h) * L * G::D;
  #pragma unroll 1
  for (int item = cuda::warp(); item < items; item += C::warps) {
    const int m0 = item / pairs * 16, pair = firstPair + item % pairs;
    float acc[2][4] = {};
    #pragma unroll 1
    for (int kk = 0; kk < C::block_n / kMmaK; ++kk) {
      Bits32 ds[4], k[4];
      cuda::ldmatrixX4Trans(ds, cuda::sharedAddress(dsTile + (kk * kMmaK + fragment::aTransRow(l)) * pitch + m0 +
                                                   fragment::aTransColumn(l)));
      cuda::loadBTrans<C>(k, kTile, kk, pair);
      cuda::mma16816<C>(acc[0], ds, k[0], k[1]);
      cuda::mma16816<C>(acc[1], ds, k[2], k[3]);
    }
    // Rows i and i + 8 of the m-tile, columns c, c + 1 of each n-tile.
    const int i = row0 + m0 + fragment::accumulatorRow(l, 0);
    const int c = 2 * pair * 8 + fragment::accumulatorColumn(l, 0);
    float* at = dq + (i * G::D + c);
    #pragma unroll
    for (int half = 0; half < 2; ++half)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = (e / 2) * 8, column = half * 8 + e % 2;
        if (i + row < L && c + column < G::D) ptx::redGlobalAddF32(at + row * G::D + column, acc[half][e] * C::scale);
      }
  }
}

template <class C>
__device__ void dq_init(DqTile<C>& dq, int64_t part) {
  cuda::zero<C>(dq.dq);
  dq.part = int(part);
}

// dq += dS K: dS's C fragments re-packed as A, K by ldmatrix.trans.
template <class C>
__device__ void dq_accumulate(DqTile<C>& dq, BwdScores<C>& s, KvGradTile<C>& kv) {
  using G = cuda::Geometry<C>;
  if constexpr (C::wgmma_backward) {  // K read N-major from its stage
    bwgmma::pack<C, C::block_n>(s.pa, s.ds[0]);
    constexpr int N = bwgmma::Geometry<C>::DQN;
    ptx::pinRegisters(bwgmma::flat<N / 2>(dq.dq));
    ptx::wgmmaFence();
    bwgmma::columnProduct<C, C::block_n, N>(bwgmma::flat<N / 2>(dq.dq), s.pa, kv.tiles,
                                            bwgmma::Geometry<C>::kvAtomBytes, cuda::dqPartColumn<C>(dq.part));
    ptx::wgmmaCommit();
    ptx::wgmmaWait<0>();
    ptx::pinRegisters(bwgmma::flat<N / 2>(dq.dq));
    return;
  }
  const Bits32 kTile = kvStageTile<C>(cuda::bwdSmem<C>().k, kv) + cuda::columnBytes(cuda::dqPartColumn<C>(dq.part));
  #pragma unroll
  for (int kk = 0; kk < G::PK; ++kk) {
    Bits32 ds[G::MT][4];
    #pragma unroll
    for (int mt = 0; mt < G::MT; ++mt) cuda::repack<C>(ds[mt], s.ds[mt], kk);
    #pragma unroll
    for (int pair = 0; pair < cuda::BackwardGeometry<C>::DPT / 2; ++pair) {
      Bits32 b[4];
      cuda::loadBTrans<C>(b, kTile, kk, pair);
      #pragma unroll
      for (int mt = 0; mt < G::MT; ++mt) {
        cuda::mma16816<C>(dq.dq[mt][2 * pair], ds[mt], b[0], b[1]);
        cuda::mma16816<C>(dq.dq[mt][2 * pair + 1], ds[mt], b[2], b[3]);
      }
    }
  }
}

template <class C>
__device__ void dq_store(DqTile<C>& dq, const IhaArgs& a, int64_t row0, int64_t h, int64_t b) {
  cuda::storeFragments<C>(dq.dq, a.dq_pseudo, C::heads, b, h, row0, seq_len<C>(a), C::scale,
                          cuda::dqPartColumn<C>(dq.part), [](int mt) { return cuda::tileRow<C>(mt); });
}

//===----------------------------------------------------------------------===//
// The transposed mixing and the reduction (token-parallel)
//===----------------------------------------------------------------------===//

// For each token of the CTA, the role's pseudo-row gradients in groups of
// rows: one warp per row turns RoPE back and applies qk_norm's Jacobian
// (dx = r g - (r^3 / d)(x . g) x with x re-mixed from the inputs), adds x_m .
// g into dalpha[m, h, p] for every source head m, and stages the row in
// shared memory; then each thread adds sum_{h,p} alpha[m, h, p] g[h, p][c]
// into its elements (m, c) of the token's dx, written once at the end.
template <class C, Role R>
__device__ void unmix(const IhaArgs& a, int64_t token0, int64_t b) {
  using Role_ = cuda::RoleOf<C, R>;
  constexpr int heads = Role_::heads, P = C::pseudo_heads, D = C::head_dim, tokens = C::block_m / P;
  constexpr int rows = heads * P, groupRows = unmixGroupRows(C::heads, P, D);
  constexpr int threads = cuda::Geometry<C>::threads;
  constexpr int perThread = (heads * D + threads - 1) / threads;
  // A thread's elements of the token's dx: summed over the groups of rows
  // in registers, or past kUnmixAccumulators of them (head_dim 256, 16
  // heads on two warps: 64) in dx itself, each group adding its sums to
  // what the thread wrote there before (a CTA owns its tokens' rows).
  constexpr bool registers = perThread <= kUnmixAccumulators;
  const int64_t L = seq_len<C>(a);
  float* staged = reinterpret_cast<float*>(cuda::smem());
  float* partial = staged + groupRows * D;
  for (int e = threadIdx.x; e < heads * heads * P; e += threads) partial[e] = 0.0f;
  const float* grads = R == Role::query ? a.dq_pseudo : R == Role::key ? a.dk_pseudo : a.dv_pseudo;
  float* dx = R == Role::query ? a.dq : R == Role::key ? a.dk : a.dv;
  const float* alpha = Role_::alpha(a);
  const void* x = Role_::source(a);
  const int64_t* stride = Role_::stride(a);
  #pragma unroll 1
  for (int64_t n = token0; n < token0 + tokens && n < a.tokens; ++n) {
    float acc[registers ? perThread : 1];
    #pragma unroll
    for (int k = 0; k < (registers ? perThread : 1); ++k) acc[k] = 0.0f;
    float* dxRow = dx + (b * a.tokens + n) * heads * D;
    #pragma unroll 1
    for (int first = 0; first < rows; first += groupRows) {
      __syncthreads();  // the previous group's rows are read
      #pragma unroll 1
      for (int row = first + cuda::warp(); row < first + groupRows && row < rows; row += C::warps) {
        const int h = row / P, p = row % P;
        const int64_t i = n * P + p;
        const float* g = grads + ((b * heads + h) * L + i) * D;
        float* out = staged + (row - first) * D;
        constexpr int half = D / 2;
        // With a rounded RoPE table the norm's input is the turned row (the
        // forward turns, then normalises): through the norm first, then the
        // turn's transpose; else the turn's transpose first.
        constexpr bool turnedNorm = C::rope_table != 0 && Role_::rotated && cuda::Normalized<C, R>::value;
        for (int c = cuda::lane(); c < D; c += kWarpSize) {
          float value = g[c];
          if constexpr (Role_::rotated && !turnedNorm)
            value = cuda::unrotate<C>(value, g[c < half ? c + half : c - half], rope_position<C>(a, i), c);
          out[c] = value;
        }
        if constexpr (cuda::Normalized<C, R>::value) {
          auto input = [&](int c) {  // element c of the norm's input
            const float mixed = cuda::mixFromGlobal<C, R>(a, b, n, h, p, c);
            if constexpr (!turnedNorm) return mixed;
            else
              return cuda::rotate<C>(mixed, cuda::mixFromGlobal<C, R>(a, b, n, h, p, c < half ? c + half : c - half),
                                     rope_position<C>(a, i), c);
          };
          float squares = 0.0f, dot = 0.0f;
          for (int c = cuda::lane(); c < D; c += kWarpSize) {
            const float x = input(c);
            squares += x * x;
            dot += x * out[c];
          }
          const float r = rsqrtf(cuda::warpSum(squares) * (1.0f / D) + C::qk_norm_eps);
          const float k = r * r * r * (1.0f / D) * cuda::warpSum(dot);
          for (int c = cuda::lane(); c < D; c += kWarpSize) out[c] = r * out[c] - k * input(c);
        }
        if constexpr (turnedNorm) {  // the turn's transpose of the row just written
          float turned[(D + kWarpSize - 1) / kWarpSize];
          __syncwarp();
          #pragma unroll
          for (int e = 0; e < (D + kWarpSize - 1) / kWarpSize; ++e) {
            const int c = cuda::lane() + e * kWarpSize;
            if (c < D) turned[e] = cuda::unrotate<C>(out[c], out[c < half ? c + half : c - half], rope_position<C>(a, i), c);
          }
          __syncwarp();
          #pragma unroll
          for (int e = 0; e < (D + kWarpSize - 1) / kWarpSize; ++e) {
            const int c = cuda::lane() + e * kWarpSize;
            if (c < D) out[c] = turned[e];
          }
        }
        #pragma unroll 1
        for (int m = 0; m < heads; ++m) {
          float dot = 0.0f;
          for (int c = cuda::lane(); c < D; c += kWarpSize)
            dot += cuda::loadElement<C>(x, b * stride[0] + n * stride[1] + m * stride[2] + c) * out[c];
          dot = cuda::warpSum(dot);
          if (cuda::lane() == 0) partial[(m * heads + h) * P + p] += dot;  // one warp owns the row
        }
      }
      __syncthreads();
      auto groupSum = [&](int e) {  // the group's rows' share of dx element e
        const int m = e / D, c = e % D;
        float sum = 0.0f;
        #pragma unroll 1
        for (int row = first; row < first + groupRows && row < rows; ++row)
          sum += alpha[(m * heads + row / P) * P + row % P] * staged[(row - first) * D + c];
        return sum;
      };
      if constexpr (registers) {
        #pragma unroll
        for (int k = 0; k < perThread; ++k) {
          const int e = threadIdx.x + k * threads;
          if (e >= heads * D) continue;
          acc[k] += groupSum(e);
        }
      } else {
        #pragma unroll 1
        for (int e = threadIdx.x; e < heads * D; e += threads) dxRow[e] = (first == 0 ? 0.0f : dxRow[e]) + groupSum(e);
      }
    }
    if constexpr (registers) {
      #pragma unroll
      for (int k = 0; k < perThread; ++k) {
        const int e = threadIdx.x + k * threads;
        if (e < heads * D) dxRow[e] = acc[k];
      }
    }
  }
  __syncthreads();
  float* out = partials::slot<C>(a, token0, b) + partials::alpha_offset<C, R>();
  for (int e = threadIdx.x; e < heads * heads * P; e += threads) out[e] = partial[e];
}

// Chunk `chunk` of the partial sums over every token CTA of every batch
// entry, in order, into dcollapse and the dalphas; one CTA row does it.
template <class C>
__device__ void reduce_grads(const IhaArgs& a, int64_t chunk, int64_t b) {
  if (b != 0) return;
  constexpr int64_t entries = partials::entries<C>();
  const int64_t slots = a.batch * partials::token_ctas<C>(a);
  for (int64_t e = chunk * kReduceChunk + threadIdx.x; e < (chunk + 1) * kReduceChunk && e < entries; e += blockDim.x) {
    float sum = 0.0f;
    for (int64_t slot = 0; slot < slots; ++slot) sum += a.partials[slot * entries + e];
    *partials::destination<C>(a, e) = sum;
  }
}

}  // namespace loom
