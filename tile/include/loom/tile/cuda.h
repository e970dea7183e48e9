// The CUDA implementation of the tile API, compiled at run time by NVRTC for
// sm_80 and later (FlashAttention-2 style):
//   - tensor cores through mma.sync.m16n8k16 (f16 or bf16 in, f32 out);
//   - ldmatrix for Q and K fragments, ldmatrix.trans for V;
//   - a cp.async shared-memory pipeline C::stages deep for K/V (raw token
//     rows when mixing is fused, mixed rows from the pre-mix workspace
//     otherwise), with conflict-free padded rows (layout.h);
//   - online softmax in registers, rows split across warps (16 per m-tile),
//     a row's values across the 4 threads of a quad; log2(e) folded into the
//     scale so the exponentials are exp2;
//   - the fused mixing (+ qk_norm, RoPE) prologue and the collapse epilogues.
// Workspaces hold 16-bit elements of the spec's dtype. No host header is
// included: this file and its includes are all NVRTC sees.
#pragma once

#include "loom/tile/cuda_common.h"

namespace loom {

namespace cuda {

template <class C>
struct Geometry {
  static_assert(C::dtype != DType::f32, "CUDA tiles take float16 or bfloat16 inputs");
  static_assert(C::block_m % (16 * C::warps) == 0, "block_m must be a multiple of 16 rows x warps");
  static_assert(C::block_n % kMmaK == 0, "block_n must be a multiple of 16");
  static_assert(C::head_dim % kChunkElements == 0, "head_dim must be a multiple of 8");
  static constexpr int threads = C::warps * kWarpSize;
  static constexpr int D = C::head_dim;
  static constexpr int Dp = paddedHeadDim(C::head_dim);
  static constexpr int pitch = tilePitch(C::head_dim);
  static constexpr int MT = C::block_m / (16 * C::warps);  // m-tiles per warp
  static constexpr int NT = C::block_n / 8;                // score n-tiles
  static constexpr int KT = Dp / kMmaK;                    // k-steps of Q K^T
  static constexpr int OT = Dp / 8;                        // output n-tiles
  static constexpr int PK = C::block_n / kMmaK;            // k-steps of P V
  // Q's A fragments stay in registers, or are read from the Q tile at every
  // key block (layout.h, qInRegisters).
  static constexpr bool qRegisters = qInRegisters(MT, C::head_dim, C::block_n);
  static constexpr int rawTokens = rawTokensPerBlock(C::block_n, C::pseudo_heads);
  // One stage of mixed rows (materialised mixing, not a decode step) runs
  // FlashAttention-2's split pipeline: K and V of a block in their own
  // commit groups, V(j) landing during S = Q K(j)^T and K(j + 1) during the
  // softmax and P V(j), one K and one V tile in shared memory (layout.h).
  static constexpr bool splitKv = splitKvPipeline(C::stages, C::fused_mix, C::decode, threads, C::head_dim);
  // Commit groups younger than Q's when q_wait waits for it.
  static constexpr int groupsAfterQ = splitKv ? 1 : C::stages - 1;
  static constexpr int rawRole = rawTokens * C::kv_heads * C::head_dim;  // elements per role per stage
};

__device__ __forceinline__ unsigned char* smem() { return ptx::dynamicShared<128>(); }

// The program's layout: fused mixing adds raw-row stages, a collapse in the
// epilogue a staging tile, a fused global collapse the output tile.
template <class C>
__device__ __forceinline__ AttentionSmem layout() {
  return attentionSmem(C::block_m, C::block_n, C::head_dim, C::stages, C::heads, C::kv_heads, C::pseudo_heads,
                       C::fused_mix, C::fused_collapse, C::fused_global_collapse);
}

// f(r, chunk) for every 16-byte chunk of a Rows x padded-d tile, the CTA's
// threads striding over them (chunk counts padded columns: those past
// head_dim are the caller's to fill with zeros).
template <class C, int Rows, class F>
__device__ __forceinline__ void forEachTileChunk(F&& f) {
  constexpr int chunks = Geometry<C>::Dp / kChunkElements;
  for (int index = threadIdx.x; index < Rows * chunks; index += Geometry<C>::threads) f(index / chunks, index % chunks);
}

// f(index) for index = threadIdx.x + k * Threads below Items, unrolled at
// compile time (no loop in the machine code, which the SASS reader would
// count once whatever its trips).
template <int Items, int Threads, class F>
__device__ __forceinline__ void forEachUnrolled(F&& f) {
  #pragma unroll
  for (int round = 0; round < (Items + Threads - 1) / Threads; ++round) {
    const int index = int(threadIdx.x) + round * Threads;
    if (Items % Threads != 0 && index >= Items) break;
    f(index);
  }
}

// First row of m-tile `mt` of this warp inside the query block.
template <class C>
__device__ __forceinline__ int tileRow(int mt) {
  return (mt * C::warps + warp()) * 16;
}

// Shared-window address of this lane's ldmatrix row of Q's A fragment
// (m-tile `mt`, k-step `kt`).
template <class C>
__device__ __forceinline__ Bits32 qFragmentAddress(int mt, int kt) {
  const Bits16* tile = reinterpret_cast<const Bits16*>(smem() + layout<C>().q);
  const int l = lane();
  return sharedAddress(tile + (tileRow<C>(mt) + fragment::aRow(l)) * Geometry<C>::pitch + kt * kMmaK +
                       fragment::aColumn(l));
}

// Byte offset of element (row, column) in a tile of Geometry::pitch: a
// constant wherever row and column are, so ldmatrix takes it as the
// immediate of one lane address computed once ([R + imm]).
template <class C>
constexpr Bits32 tileOffset(int row, int column) {
  return Bits32((row * Geometry<C>::pitch + column) * kTileElementBytes);
}

// One thread's place in the copies of mixed rows (copyRows): its 16-byte
// chunk column is fixed and its rows step by threads / chunks from r0, so
// every copy of a block is the thread's base addresses plus constants.
// Built once a CTA; the value rows sit at the same offset in theirs.
struct RowCursor {
  const Bits16* key;  // the thread's first element of block 0 (row r0) in the key rows
  int rows;           // rows from r0 to the end
};

template <class C>
constexpr bool kCursorCopies = Geometry<C>::threads % (Geometry<C>::Dp / kChunkElements) == 0;

template <class C>
__device__ __forceinline__ int cursorRow() {
  return int(threadIdx.x) / (Geometry<C>::Dp / kChunkElements);
}
template <class C>
__device__ __forceinline__ int cursorChunk() {
  return int(threadIdx.x) % (Geometry<C>::Dp / kChunkElements);
}

template <class C>
__device__ __forceinline__ RowCursor rowCursor(const Bits16* keys, int64_t rows) {
  const int r0 = cursorRow<C>();
  return RowCursor{keys + int64_t(r0) * Geometry<C>::D + cursorChunk<C>() * kChunkElements, int(rows) - r0};
}

//===--- warp-level matrix instructions and copies (loom/tile/ptx.h) -------===//

using ptx::ldmatrixX4;
using ptx::ldmatrixX4Trans;

// d += a (16x16, row) * b (16x8, col), f32 accumulators.
template <class C>
__device__ __forceinline__ void mma16816(float (&d)[4], const Bits32 (&a)[4], Bits32 b0, Bits32 b1) {
  if constexpr (C::dtype == DType::f16) ptx::mmaF16(d, a, b0, b1);
  else ptx::mmaBf16(d, a, b0, b1);
}

// d += a (16x8: a0 rows g, a1 rows g + 8) * b (8x8), f32 accumulators.
template <class C>
__device__ __forceinline__ void mma1688(float (&d)[4], Bits32 a0, Bits32 a1, Bits32 b0) {
  if constexpr (C::dtype == DType::f16) ptx::mmaF16K8(d, a0, a1, b0);
  else ptx::mmaBf16K8(d, a0, a1, b0);
}

// 16 bytes global -> shared; `valid` false zero-fills the destination.
__device__ __forceinline__ void copyAsync16(void* destination, const void* source, bool valid) {
  ptx::cpAsyncCg16(destination, source, valid);
}
__device__ __forceinline__ void commitCopies() { ptx::cpAsyncCommit(); }
template <int Pending>
__device__ __forceinline__ void waitCopies() {
  ptx::cpAsyncWait<Pending>();
}

}  // namespace cuda

//===----------------------------------------------------------------------===//
// Tiles: register-resident state of one thread (shared-memory tiles are
// carved from the dynamic shared memory by cuda::layout).
//===----------------------------------------------------------------------===//

template <class C, int = kDecodeStep<C>>
struct QTile {
  // A fragments of Q: all k-steps, or the current one when Q is read from
  // shared memory at every block.
  Bits32 a[cuda::Geometry<C>::MT][cuda::Geometry<C>::qRegisters ? cuda::Geometry<C>::KT : 1][4];
  Bits32 lane;  // this lane's ldmatrix address of m-tile 0, k-step 0
};

template <class C, int = kDecodeStep<C>>
struct KvPipeline {
  const Bits16* key;    // the K tile of the block being consumed
  const Bits16* value;  // its V tile
  Bits32 keyLane;       // this lane's ldmatrix addresses in them (pair 0, k-step 0)
  Bits32 valueLane;
  bool mixed;
  // The split pipeline (Geometry::splitKv): where mma_pv issues K(j + 1) from.
  cuda::RowCursor rows;  // the thread's copies of the kv head's mixed rows
  int upper;             // the blocks' end
};

template <class C, int = kDecodeStep<C>>
struct ScoreTile {
  float s[cuda::Geometry<C>::MT][cuda::Geometry<C>::NT][4];
  // P, packed to 16 bits once the softmax is done with S (half the
  // registers across P V): rows lane/4 and lane/4 + 8 of n-tile nt.
  Bits32 p[cuda::Geometry<C>::MT][cuda::Geometry<C>::NT][2];
};

template <class C, int = kDecodeStep<C>>
struct SoftmaxState {
  float m[cuda::Geometry<C>::MT][2];  // running max (log2 domain) of rows lane/4 and lane/4 + 8
  float l[cuda::Geometry<C>::MT][2];  // running denominator
};

template <class C, int = kDecodeStep<C>>
struct AccTile {
  float o[cuda::Geometry<C>::MT][cuda::Geometry<C>::OT][4];
};

}  // namespace loom

// The absorbed and tensor-mixing decode steps' tiles and calls.
#include "loom/tile/cuda_absorbed.h"
#include "loom/tile/cuda_tensor_mixing.h"

namespace loom {

template <class C>
struct OutTile {};  // lives in shared memory (AttentionSmem::out)

//===----------------------------------------------------------------------===//
// The attention launch
//===----------------------------------------------------------------------===//

// Q's load is split around the K/V prologue so that the two overlap:
//   q_begin   (materialised) issues the cp.async copies of the Q tile from
//             q_mixed as one commit group;
//   kv_begin  issues the first stages - 1 K/V groups;
//   q_wait    waits for Q's group alone (the stages - 1 younger K/V groups
//             stay in flight), or, with fused mixing, mixes Q into the tile
//             while those copies fly; then each warp loads its A fragments.
template <class C, bool Mixed>
__device__ void q_begin(QTile<C, false>&, const IhaArgs& a, int64_t row0, int64_t head, int64_t b) {
  static_assert(C::stacked_heads == 1 || Mixed, "stacked heads mix their queries as they load");
  if constexpr (!Mixed) {
    using G = cuda::Geometry<C>;
    const int64_t L = seq_len<C>(a);
    Bits16* tile = reinterpret_cast<Bits16*>(cuda::smem() + cuda::layout<C>().q);
    const Bits16* q = static_cast<const Bits16*>(a.q_mixed);
    cuda::forEachTileChunk<C, C::block_m>([&](int r, int chunk) {
      const int64_t i = row0 + r;
      const bool inside = i < L && chunk * kChunkElements < G::D;
      const Bits16* source = q + ((b * C::heads + head) * L + i) * G::D + chunk * kChunkElements;
      cuda::copyAsync16(tile + r * G::pitch + chunk * kChunkElements, inside ? source : q, inside);
    });
    cuda::commitCopies();
  }
}

template <class C, bool Mixed>
__device__ void q_wait(QTile<C, false>& q, const IhaArgs& a, int64_t row0, int64_t head, int64_t b) {
  using G = cuda::Geometry<C>;
  Bits16* tile = reinterpret_cast<Bits16*>(cuda::smem() + cuda::layout<C>().q);
  if constexpr (Mixed) {
    // A decode step's rows end with its sequence, and its q holds only the step's tokens.
    const int64_t L = rows_end<C>(a, b);
    const int64_t firstToken = C::decode ? a.cache_len[b] : 0;
    cuda::forEachTileChunk<C, C::block_m>([&](int r, int chunk) {
      const CtaRow t = ctaRow<C>(r);
      const int64_t i = row0 + t.row;
      float values[kChunkElements] = {};
      if ((C::stacked_heads == 1 || t.owned) && i < L && chunk * kChunkElements < G::D) {
        const int64_t n = i / C::pseudo_heads;
        const int h = int(head) + t.head, p = int(i % C::pseudo_heads);
        if constexpr (cuda::mixedChunkFits<C, Role::query>) {  // 16-byte reads of every head's chunk
          cuda::mixedChunk<C, Role::query>(a, b, n, h, p, chunk * kChunkElements, values);
        } else {
          #pragma unroll
          for (int e = 0; e < kChunkElements; ++e)
            values[e] = cuda::mixedElement<C, Role::query>(a, b, n - firstToken, h, p, chunk * kChunkElements + e);
        }
      }
      cuda::storeChunk<C>(tile + r * G::pitch + chunk * kChunkElements, values);
    });
  } else {
    // kv_begin committed exactly groupsAfterQ groups after Q's.
    cuda::waitCopies<G::groupsAfterQ>();
  }
  __syncthreads();
  if constexpr (Mixed && cuda::Normalized<C, Role::query>::value) {  // the workspace rows are normalised already
    cuda::normalizeRows<C>(C::block_m, [&](int r, int c) { return tile + r * G::pitch + c; }, cuda::warp(), C::warps);
    __syncthreads();
  }
  q.lane = cuda::qFragmentAddress<C>(0, 0);
  if constexpr (G::qRegisters) {
    #pragma unroll
    for (int mt = 0; mt < G::MT; ++mt)
      #pragma unroll
      for (int kt = 0; kt < G::KT; ++kt)
        cuda::ldmatrixX4(q.a[mt][kt], q.lane + cuda::tileOffset<C>(mt * C::warps * kMTileRows, kt * kMmaK));
  }
}

template <class C>
__device__ void softmax_init(SoftmaxState<C, false>& state, AccTile<C, false>& acc) {
  using G = cuda::Geometry<C>;
  #pragma unroll
  for (int mt = 0; mt < G::MT; ++mt) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      state.m[mt][h] = cuda::negativeInfinity();
      state.l[mt][h] = 0.0f;
    }
    #pragma unroll
    for (int ot = 0; ot < G::OT; ++ot)
      #pragma unroll
      for (int e = 0; e < 4; ++e) acc.o[mt][ot][e] = 0.0f;
  }
}

namespace cuda {

// Roles of copyRows.
constexpr int kKeyRows = 1, kValueRows = 2;

// The rounds of one thread's cursor copies (RowCursor) of Rows rows: from
// its row r0 on, threads / chunks rows apart, into kTarget and vTarget
// (shared-window addresses of its first chunk) from key and value (its
// first elements) plus `first`, the roles asked for; src-size 0 from row
// `left` (its rows before the end) on, or where `column` is false (its
// chunk past the head dimension).
template <class C, int Rows, int Roles>
__device__ __forceinline__ void copyCursorRounds(Bits32 kTarget, const Bits16* key, Bits32 vTarget, const Bits16* value,
                                                 int64_t first, int r0, int left, bool column) {
  using G = Geometry<C>;
  constexpr int step = G::threads / (G::Dp / kChunkElements);  // rows a round
  constexpr int rounds = (Rows + step - 1) / step;
  #pragma unroll
  for (int round = 0; round < rounds; ++round) {
    if (Rows % step != 0 && round * step >= Rows - r0) break;
    const bool valid = column && round * step < left;
    const Bits32 target = Bits32(round * step * G::pitch * kTileElementBytes);
    const int64_t source = first + round * step * G::D;
    if constexpr ((Roles & kKeyRows) != 0) ptx::cpAsyncCg16(kTarget + target, key + source, valid);
    if constexpr ((Roles & kValueRows) != 0) ptx::cpAsyncCg16(vTarget + target, value + source, valid);
  }
}

// Copies mixed rows block * block_n .. + block_n of one kv head into the
// block's stage (`key`, `value`: the thread's first elements of block 0,
// RowCursor), rows past the end zero-filled, unrolled at compile time. A
// row past the end takes src-size 0: the copy zero-fills its 16 bytes and
// reads nothing (the address is never dereferenced).
template <class C, int Roles>
__device__ __forceinline__ void copyRows(const Bits16* key, const Bits16* value, int rows, int64_t block) {
  using G = Geometry<C>;
  static_assert(kCursorCopies<C>, "copyRows: a row's chunks must divide the threads");
  const AttentionSmem s = layout<C>();
  constexpr int chunks = G::Dp / kChunkElements, dChunks = G::D / kChunkElements;
  constexpr Bits32 stageBytes = Bits32(C::block_n * G::pitch * kTileElementBytes);
  const int r0 = cursorRow<C>(), chunk = cursorChunk<C>();
  const Bits32 at = Bits32(block % C::stages) * stageBytes +
                    Bits32((r0 * G::pitch + chunk * kChunkElements) * kTileElementBytes);
  const Bits32 kTarget = sharedAddress(smem() + s.k) + at, vTarget = sharedAddress(smem() + s.v) + at;
  const int64_t first = block * C::block_n * G::D;
  const int left = rows - int(block) * C::block_n;  // rows of this thread's in the block
  const bool column = dChunks == chunks || chunk < dChunks;
  copyCursorRounds<C, C::block_n, Roles>(kTarget, key, vTarget, value, first, r0, left, column);
}

// Issues the copies of key block `block` into its stage: raw token rows of
// k and v (mixed), or mixed rows from the workspaces.
template <class C, bool Mixed>
__device__ void issueKv(const IhaArgs& a, int64_t g, int64_t b, int64_t block) {
  using G = Geometry<C>;
  const AttentionSmem s = layout<C>();
  const int stage = int(block % C::stages);
  constexpr int dChunks = G::D / kChunkElements;
  if constexpr (Mixed) {
    // Token by token (its G rows of d are one run in the stage, and in a
    // paged cache's slot): the token's source found once, each thread's
    // 16-byte pieces of the run at compile-time offsets from it. Rows past
    // the end take src-size 0 (zeros, nothing read).
    Bits16* raw = reinterpret_cast<Bits16*>(smem() + s.raw) + stage * 2 * G::rawRole;
    const int64_t token0 = block * C::block_n / C::pseudo_heads;
    #pragma unroll
    for (int t = 0; t < G::rawTokens; ++t) {
      const int64_t n = token0 + t;
      const Bits16 *key, *value;
      int64_t headStride = G::D;  // elements from one head's row to the next
      bool inside;
      if constexpr (C::decode) {  // token n of the sequence, through the page table
        key = static_cast<const Bits16*>(a.k_cache);
        value = static_cast<const Bits16*>(a.v_cache);
        inside = n < a.cache_len[b] + step_tokens<C>(a, b);
        const int64_t slot = inside ? cache_slot(a, b, n) * C::kv_heads * G::D : 0;
        key += slot;
        value += slot;
      } else {
        inside = n < a.tokens;
        const int64_t token = inside ? n : 0;
        key = static_cast<const Bits16*>(a.k) + b * a.k_stride[0] + token * a.k_stride[1];
        value = static_cast<const Bits16*>(a.v) + b * a.v_stride[0] + token * a.v_stride[1];
        headStride = a.k_stride[2];
      }
      forEachUnrolled<C::kv_heads * dChunks, G::threads>([&](int piece) {
        const int m = piece / dChunks, column = (piece % dChunks) * kChunkElements;
        Bits16* target = raw + t * C::kv_heads * G::D + piece * kChunkElements;
        const int64_t kOffset = m * headStride + column;
        const int64_t vOffset = C::decode ? kOffset : m * a.v_stride[2] + column;
        copyAsync16(target, key + kOffset, inside);
        copyAsync16(target + G::rawRole, value + vOffset, inside);
      });
    }
  } else if constexpr (C::decode) {
    // A decode step over a mixed cache: row n*P + p of kv head g at its
    // token's slot. A thread's chunk column is fixed and its rows `step`
    // apart (as copyRows): each row's slot found once for K and V, the
    // copies unrolled at compile time.
    const int64_t L = rows_end<C>(a, b);
    Bits16* kTile = reinterpret_cast<Bits16*>(smem() + s.k) + stage * C::block_n * G::pitch;
    Bits16* vTile = reinterpret_cast<Bits16*>(smem() + s.v) + stage * C::block_n * G::pitch;
    const Bits16* kSource = static_cast<const Bits16*>(a.k_cache);
    const Bits16* vSource = static_cast<const Bits16*>(a.v_cache);
    auto copy = [&](int r, int chunk) {
      const int64_t j = block * C::block_n + r;
      const bool inside = j < L && chunk < dChunks;
      int64_t offset = 0;
      if (inside)
        offset = ((cache_slot(a, b, j / C::pseudo_heads) * C::kv_heads + g) * C::pseudo_heads + j % C::pseudo_heads) *
                     G::D + chunk * kChunkElements;
      copyAsync16(kTile + r * G::pitch + chunk * kChunkElements, kSource + offset, inside);
      copyAsync16(vTile + r * G::pitch + chunk * kChunkElements, vSource + offset, inside);
    };
    if constexpr (kCursorCopies<C>) {
      constexpr int chunks = G::Dp / kChunkElements;
      constexpr int step = G::threads / chunks, rounds = (C::block_n + step - 1) / step;
      const int r0 = int(threadIdx.x) / chunks, chunk = int(threadIdx.x) % chunks;
      #pragma unroll
      for (int round = 0; round < rounds; ++round) {
        const int r = r0 + round * step;
        if (C::block_n % step != 0 && r >= C::block_n) break;
        copy(r, chunk);
      }
    } else {  // head_dim 48 and the like: the strided loop
      forEachTileChunk<C, C::block_n>(copy);
    }
  } else {
    const int64_t L = rows_end<C>(a, b);
    const int64_t head = (b * C::kv_heads + g) * L * G::D;
    const Bits16* kSource = static_cast<const Bits16*>(a.k_mixed) + head;
    const Bits16* vSource = static_cast<const Bits16*>(a.v_mixed) + head;
    if constexpr (kCursorCopies<C>) {
      const RowCursor cursor = rowCursor<C>(kSource, L);
      copyRows<C, kKeyRows | kValueRows>(cursor.key, vSource + (cursor.key - kSource), cursor.rows, block);
    } else {  // head_dim 96 and the like: the strided loop
      Bits16* kTile = reinterpret_cast<Bits16*>(smem() + s.k) + stage * C::block_n * G::pitch;
      Bits16* vTile = reinterpret_cast<Bits16*>(smem() + s.v) + stage * C::block_n * G::pitch;
      forEachTileChunk<C, C::block_n>([&](int r, int chunk) {
        const int64_t j = block * C::block_n + r;
        const bool inside = j < L && chunk < dChunks;
        const int64_t offset = j * G::D + chunk * kChunkElements;
        copyAsync16(kTile + r * G::pitch + chunk * kChunkElements, inside ? kSource + offset : kSource, inside);
        copyAsync16(vTile + r * G::pitch + chunk * kChunkElements, inside ? vSource + offset : vSource, inside);
      });
    }
  }
}

//===--- qk_norm of fused keys ---------------------------------------------===//
// With fused mixing the keys are not normalised in the tile (that would be a
// second pass over it inside the key-block loop, where the accumulators hold
// nearly every register): the mixing sums each K row's squares, taken on
// the f32 values before they are rounded, into the row's padding (the
// kRowPadElements no ldmatrix reads, layout.h; or mma_qk from the rounded
// fragments, kFragmentKeySquares), and mma_qk scales each score column by
// its key's 1 / sqrt(mean + eps). Queries are normalised in their tile, once
// per CTA.

template <class C>
constexpr bool kFusedKeyNorm = C::fused_mix && C::qk_norm;
// mma_qk scales S itself (column by column) only for fused qk_norm keys.
template <class C>
constexpr bool kScaledScores = kFusedKeyNorm<C>;

// The f32 sum of squares kept in the padding of K row r.
template <class C>
__device__ __forceinline__ float* keySquares(const Bits16* kTile, int r) {
  return reinterpret_cast<float*>(const_cast<Bits16*>(kTile) + r * Geometry<C>::pitch + Geometry<C>::Dp);
}
// The mixing's pieces a K row (chunk pairs d/2 apart where RoPE turns
// whole chunks, else chunks): where they are a power of two, a row's pieces
// lie in consecutive lanes of one warp and its sum is a shuffle sum stored
// by the row's first lane; else mma_qk sums each row's squares from its own
// K fragments (a quad holds a row's columns). No atomics: the sum is one
// order, and no spin loop sits in the key-block loop.
template <class C>
constexpr int kKeyPieces = C::rope_theta > 0 && mixedChunkFits<C, Role::key> ? C::head_dim / 2 / kChunkElements
                                                                               : paddedHeadDim(C::head_dim) / kChunkElements;
template <class C>
constexpr bool kShuffledKeySquares = kFusedKeyNorm<C> && (kKeyPieces<C> & (kKeyPieces<C> - 1)) == 0 &&
                                     kKeyPieces<C> <= kWarpSize;
template <class C>
constexpr bool kFragmentKeySquares = kFusedKeyNorm<C> && !kShuffledKeySquares<C>;

// f(index, active) for index = threadIdx.x + k * Threads over Items rounded
// up to whole rounds, every lane of every warp in every round (active is
// index < Items), for the shuffles of kShuffledKeySquares.
template <int Items, int Threads, class F>
__device__ __forceinline__ void forEachUnrolledUniform(F&& f) {
  #pragma unroll
  for (int round = 0; round < (Items + Threads - 1) / Threads; ++round) {
    const int index = int(threadIdx.x) + round * Threads;
    f(index, Items % Threads == 0 || index < Items);
  }
}

// A row's share `squares` summed over its Pieces consecutive lanes and
// stored by the first (every lane calls; `store` where the row is real).
template <class C, int Pieces>
__device__ __forceinline__ void storeKeySquares(Bits16* kTile, int r, int piece, float squares, bool store) {
  #pragma unroll
  for (int offset = Pieces / 2; offset > 0; offset /= 2) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
  if (store && piece == 0) *keySquares<C>(kTile, r) = squares;
}

// Mixes (and rotates K) the raw rows of `block` into the K and V tiles.
template <class C>
__device__ void mixStagedKv(const IhaArgs& a, int64_t g, int64_t b, int64_t block) {
  using G = Geometry<C>;
  const AttentionSmem s = layout<C>();
  const Bits16* raw = reinterpret_cast<const Bits16*>(smem() + s.raw) + int(block % C::stages) * 2 * G::rawRole;
  Bits16* kTile = reinterpret_cast<Bits16*>(smem() + s.k);
  Bits16* vTile = reinterpret_cast<Bits16*>(smem() + s.v);
  const int64_t L = rows_end<C>(a, b), token0 = block * C::block_n / C::pseudo_heads;
  constexpr int half = C::head_dim / 2;
  // The chunk at `column` of the G staged rows of token t, mixed: one
  // 16-byte shared load a head.
  auto mix = [&](const Bits16* rows, const float* alpha, int t, int p, int column, float (&sum)[kChunkElements]) {
    #pragma unroll
    for (int e = 0; e < kChunkElements; ++e) sum[e] = 0.0f;
    #pragma unroll
    for (int m = 0; m < C::kv_heads; ++m)
      accumulateChunk<C>(rows + (t * C::kv_heads + m) * G::D + column, alpha[(m * C::kv_heads + g) * C::pseudo_heads + p],
                         sum);
  };
  auto mixElement = [&](const Bits16* rows, const float* alpha, int t, int p, int c) {
    float sum = 0.0f;
    for (int m = 0; m < C::kv_heads; ++m)
      sum += alpha[(m * C::kv_heads + g) * C::pseudo_heads + p] * toFloat<C>(rows[(t * C::kv_heads + m) * G::D + c]);
    return sum;
  };
  if constexpr (C::rope_theta > 0 && mixedChunkFits<C, Role::key>) {
    // Rotated keys in pairs of chunks d/2 apart: each key chunk mixed once
    // (not again as its partner's partner) and one angle for both halves.
    // Unrolled at compile time (one round at block_n 16 of four warps), so
    // the key-block loop's machine code holds all of its mixing.
    constexpr int halfChunks = half / kChunkElements, dChunks = G::D / kChunkElements;
    auto pair = [&](int index, bool active) {
      const int r = index / halfChunks, lo = (index % halfChunks) * kChunkElements, hi = lo + half;
      const int64_t j = block * C::block_n + r;
      const int t = int(j / C::pseudo_heads - token0), p = int(j % C::pseudo_heads);
      float keys[kChunkElements] = {}, partner[kChunkElements] = {};
      float values[kChunkElements] = {}, values2[kChunkElements] = {};
      if (active && j < L) {
        mix(raw, a.alpha_k, t, p, lo, keys);
        mix(raw, a.alpha_k, t, p, hi, partner);
        rotatePair<C>(keys, partner, rope_position<C>(a, j), lo);
      }
      if constexpr (kShuffledKeySquares<C>) {
        float squares = 0.0f;
        #pragma unroll
        for (int e = 0; e < kChunkElements; ++e) squares += keys[e] * keys[e] + partner[e] * partner[e];
        storeKeySquares<C, halfChunks>(kTile, r, index % halfChunks, squares, active);
      }
      if (!active) return;
      storeChunk<C>(kTile + r * G::pitch + lo, keys);
      storeChunk<C>(kTile + r * G::pitch + hi, partner);
      if (j < L) {
        mix(raw + G::rawRole, a.alpha_v, t, p, lo, values);
        mix(raw + G::rawRole, a.alpha_v, t, p, hi, values2);
      }
      storeChunk<C>(vTile + r * G::pitch + lo, values);
      storeChunk<C>(vTile + r * G::pitch + hi, values2);
    };
    if constexpr (kShuffledKeySquares<C>) {
      forEachUnrolledUniform<C::block_n * halfChunks, G::threads>(pair);
    } else {
      forEachUnrolled<C::block_n * halfChunks, G::threads>([&](int index) { pair(index, true); });
    }
    if constexpr (G::Dp > G::D) {  // the padded columns: zeros
      constexpr int padChunks = G::Dp / kChunkElements - dChunks;
      const float zeros[kChunkElements] = {};
      for (int index = threadIdx.x; index < C::block_n * padChunks; index += G::threads) {
        const int r = index / padChunks, column = (dChunks + index % padChunks) * kChunkElements;
        storeChunk<C>(kTile + r * G::pitch + column, zeros);
        storeChunk<C>(vTile + r * G::pitch + column, zeros);
      }
    }
  } else {
    // Unrolled at compile time, as the pairs above.
    constexpr int chunks = G::Dp / kChunkElements;
    auto piece = [&](int index, bool active) {
      const int r = index / chunks, chunk = index % chunks;
      const int64_t j = block * C::block_n + r;
      float keys[kChunkElements] = {}, values[kChunkElements] = {};
      if (active && j < L && chunk * kChunkElements < G::D) {
        const int t = int(j / C::pseudo_heads - token0), p = int(j % C::pseudo_heads);
        const int column = chunk * kChunkElements;
        if constexpr (mixedChunkFits<C, Role::key>) {
          mix(raw, a.alpha_k, t, p, column, keys);
        } else {  // RoPE's half inside a chunk: element by element
          #pragma unroll
          for (int e = 0; e < kChunkElements; ++e) {
            const int c = column + e;
            keys[e] = rotate<C>(mixElement(raw, a.alpha_k, t, p, c),
                                mixElement(raw, a.alpha_k, t, p, c < half ? c + half : c - half),
                                rope_position<C>(a, j), c);
          }
        }
        mix(raw + G::rawRole, a.alpha_v, t, p, column, values);
      }
      if constexpr (kShuffledKeySquares<C>) {
        float squares = 0.0f;
        #pragma unroll
        for (int e = 0; e < kChunkElements; ++e) squares += keys[e] * keys[e];
        storeKeySquares<C, chunks>(kTile, r, chunk, squares, active);
      }
      if (!active) return;
      storeChunk<C>(kTile + r * G::pitch + chunk * kChunkElements, keys);
      storeChunk<C>(vTile + r * G::pitch + chunk * kChunkElements, values);
    };
    if constexpr (kShuffledKeySquares<C>) {
      forEachUnrolledUniform<C::block_n * chunks, G::threads>(piece);
    } else {
      forEachUnrolled<C::block_n * chunks, G::threads>([&](int index) { piece(index, true); });
    }
  }
}

}  // namespace cuda

// Pipeline prologue: blocks lower .. lower + stages - 2, one commit group
// each; the split pipeline's first K.
template <class C, bool Mixed>
__device__ void kv_begin(KvPipeline<C, false>& pipe, const IhaArgs& a, int64_t g, int64_t b, int64_t lower, int64_t upper) {
  pipe.mixed = Mixed;
  if constexpr (cuda::Geometry<C>::splitKv) {
    const int64_t L = rows_end<C>(a, b);
    const int64_t head = (b * C::kv_heads + g) * L * C::head_dim;
    pipe.rows = cuda::rowCursor<C>(static_cast<const Bits16*>(a.k_mixed) + head, L);
    pipe.upper = int(upper);
    if (lower < upper) cuda::copyRows<C, cuda::kKeyRows>(pipe.rows.key, nullptr, pipe.rows.rows, lower);
    cuda::commitCopies();
  } else {
    #pragma unroll 1
    for (int s = 0; s < C::stages - 1; ++s) {
      if (lower + s < upper) cuda::issueKv<C, Mixed>(a, g, b, lower + s);
      cuda::commitCopies();  // always, so group counting stays uniform
    }
  }
}

// The split pipeline issues its next K in mma_qk instead.
template <class C, bool Mixed>
__device__ void kv_produce(KvPipeline<C, false>&, const IhaArgs& a, int64_t g, int64_t b, int64_t block, int64_t upper) {
  if constexpr (!cuda::Geometry<C>::splitKv) {
    if (block < upper) cuda::issueKv<C, Mixed>(a, g, b, block);
    cuda::commitCopies();
  }
}

// Waits until `block` has landed (the stages - 1 younger groups may still be
// in flight), mixes it when mixing is fused, and points the pipe at it.
//
// Split (Geometry::splitKv): waits for K(block), whose barrier also tells
// that every warp is done with V(block - 1), then issues V(block) into it.
template <class C, bool Mixed>
__device__ void kv_wait(KvPipeline<C, false>& pipe, const IhaArgs& a, int64_t g, int64_t b, int64_t block) {
  using G = cuda::Geometry<C>;
  if constexpr (C::stages == 1 && !G::splitKv) {
    cuda::issueKv<C, Mixed>(a, g, b, block);
    cuda::commitCopies();
  }
  cuda::waitCopies<G::splitKv ? 0 : C::stages - 1>();
  __syncthreads();
  if constexpr (G::splitKv) {
    // The value rows at the thread's offset into the key rows' workspace.
    const Bits16* kMixed = static_cast<const Bits16*>(a.k_mixed);
    cuda::copyRows<C, cuda::kValueRows>(nullptr, static_cast<const Bits16*>(a.v_mixed) + (pipe.rows.key - kMixed),
                                        pipe.rows.rows, block);
    cuda::commitCopies();
  }
  const AttentionSmem s = cuda::layout<C>();
  if constexpr (Mixed) {
    cuda::mixStagedKv<C>(a, g, b, block);
    __syncthreads();
    pipe.key = reinterpret_cast<const Bits16*>(cuda::smem() + s.k);
    pipe.value = reinterpret_cast<const Bits16*>(cuda::smem() + s.v);
  } else {
    const int stage = int(block % C::stages);
    pipe.key = reinterpret_cast<const Bits16*>(cuda::smem() + s.k) + stage * C::block_n * G::pitch;
    pipe.value = reinterpret_cast<const Bits16*>(cuda::smem() + s.v) + stage * C::block_n * G::pitch;
  }
  const int l = cuda::lane();
  pipe.keyLane = cuda::sharedAddress(pipe.key + fragment::bRow(l) * G::pitch + fragment::bColumn(l));
  pipe.valueLane = cuda::sharedAddress(pipe.value + fragment::bTransRow(l) * G::pitch + fragment::bTransColumn(l));
}

// The stage (and the mixed tile) may be overwritten once every warp is done.
// The split pipeline's barriers are kv_wait's and mma_qk's.
template <class C>
__device__ __forceinline__ void kv_release(KvPipeline<C, false>&, int64_t) {
  if constexpr (!cuda::Geometry<C>::splitKv) __syncthreads();
}

// S = Q K^T, K fragments by ldmatrix (two n-tiles per load). S is left
// unscaled (softmax_update scales it in its exponentials' FFMA) unless fused
// keys are normalised here, column by column (kScaledScores).
template <class C>
__device__ void mma_qk(ScoreTile<C, false>& s, QTile<C, false>& q, KvPipeline<C, false>& pipe, int64_t) {
  using G = cuda::Geometry<C>;
  const int l = cuda::lane();
  #pragma unroll
  for (int mt = 0; mt < G::MT; ++mt)
    #pragma unroll
    for (int nt = 0; nt < G::NT; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) s.s[mt][nt][e] = 0.0f;
  float rowSquares[G::NT] = {};  // kFragmentKeySquares: this thread's share of key row nt * 8 + lane / 4
  #pragma unroll
  for (int kt = 0; kt < G::KT; ++kt) {
    constexpr bool inRegisters = G::qRegisters;
    if constexpr (!inRegisters) {
      #pragma unroll
      for (int mt = 0; mt < G::MT; ++mt)
        cuda::ldmatrixX4(q.a[mt][0], q.lane + cuda::tileOffset<C>(mt * C::warps * kMTileRows, kt * kMmaK));
    }
    #pragma unroll
    for (int pair = 0; pair < G::NT / 2; ++pair) {
      Bits32 b[4];
      cuda::ldmatrixX4(b, pipe.keyLane + cuda::tileOffset<C>(pair * 16, kt * kMmaK));
      #pragma unroll
      for (int mt = 0; mt < G::MT; ++mt) {
        cuda::mma16816<C>(s.s[mt][2 * pair], q.a[mt][inRegisters ? kt : 0], b[0], b[1]);
        cuda::mma16816<C>(s.s[mt][2 * pair + 1], q.a[mt][inRegisters ? kt : 0], b[2], b[3]);
      }
      if constexpr (cuda::kFragmentKeySquares<C>) {  // key row lane/4 of each n-tile: 4 of its columns
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
          const Bits32 words[2] = {b[2 * half], b[2 * half + 1]};
          float x[4];
          cuda::unpackPiece<C, 4>(words, x);
          #pragma unroll
          for (int e = 0; e < 4; ++e) rowSquares[2 * pair + half] = fmaf(x[e], x[e], rowSquares[2 * pair + half]);
        }
      }
    }
  }
  constexpr float scale = C::scale * kLog2e;
  if constexpr (cuda::kFusedKeyNorm<C>) {
    #pragma unroll
    for (int nt = 0; nt < G::NT; ++nt)
      #pragma unroll
      for (int column = 0; column < 2; ++column) {
        float squares;
        if constexpr (cuda::kFragmentKeySquares<C>) {  // the quad's sum of key row 2 (lane % 4) + column
          const float row = cuda::quadSum(rowSquares[nt]);
          squares = __shfl_sync(0xffffffffu, row, fragment::accumulatorColumn(l, column) * 4);
        } else {
          squares = *cuda::keySquares<C>(pipe.key, nt * 8 + fragment::accumulatorColumn(l, column));
        }
        const float columnScale = scale * rsqrtf(squares * (1.0f / C::head_dim) + C::qk_norm_eps);
        #pragma unroll
        for (int mt = 0; mt < G::MT; ++mt) {
          s.s[mt][nt][column] *= columnScale;
          s.s[mt][nt][column + 2] *= columnScale;
        }
      }
  }
}

// -inf for pairs the mask forbids and columns past the end. Fragment element
// e of n-tile nt sits at row lane/4 (+8 for e >= 2), column 2*(lane%4) + e%2.
// Each row sees one interval of keys (allowedColumns): the thread's columns
// inside it are a run of bits (cuda::columnsBelow), built once a row, and
// each element costs a bit test and a select, as in hopper.h. LowerEdge
// (iha.kv_loop's lower_edge): the block hides only keys below a row's first.
template <class C, bool LowerEdge = false>
__device__ void mask_scores(ScoreTile<C, false>& s, const IhaArgs& a, int64_t row0, int64_t block) {
  using G = cuda::Geometry<C>;
  // Rows fit in int (launches check L = N * P < 2^31).
  const int L = LowerEdge ? 0 : int(rows_end<C>(a, block_z(a))), i0 = int(row0);
  const int l = cuda::lane();
  const int first = int(block * C::block_n) + fragment::accumulatorColumn(l, 0);
  #pragma unroll
  for (int mt = 0; mt < G::MT; ++mt)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = i0 + ctaRow<C>(cuda::tileRow<C>(mt) + fragment::accumulatorRow(l, 2 * h)).row;
      const ColumnRange<int> range = visibleColumns<C, int>(a, i);
      const int lo = range.lo - first;  // relative to `first`
      cuda::ColumnBits<G::NT> allowed;
      if constexpr (LowerEdge) {
        allowed = ~cuda::columnsBelow<G::NT>(lo);
      } else {
        const int hi = (range.hi < L - 1 ? range.hi : L - 1) - first;
        allowed = cuda::columnsBelow<G::NT>(hi + 1);
        if constexpr (windowed<C>() || C::varlen) allowed &= ~cuda::columnsBelow<G::NT>(lo);
      }
      #pragma unroll
      for (int nt = 0; nt < G::NT; ++nt)
        #pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e)
          if (!((allowed >> (2 * nt + (e & 1))) & 1)) s.s[mt][nt][e] = cuda::negativeInfinity();
    }
}

// Online softmax on the fragments: new row max (quad reduction), rescale the
// accumulator and denominator by exp2(old - new), probabilities in place.
// The maximum is taken on S as mma_qk left it and scaled once; each
// exponential is exp2(s * scale - max): one FFMA and one MUFU.EX2 (ftz).
// Masked: as hopper.h's (a row the block's mask leaves no key has maximum
// -inf and takes its exponentials from 0); an unmasked block skips the test.
template <class C, bool Masked = true>
__device__ void softmax_update(SoftmaxState<C, false>& state, ScoreTile<C, false>& s, AccTile<C, false>& acc) {
  using G = cuda::Geometry<C>;
  constexpr float scale = cuda::kScaledScores<C> ? 1.0f : C::scale * kLog2e;
  #pragma unroll
  for (int mt = 0; mt < G::MT; ++mt)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      float rowMax = fmaxf(s.s[mt][0][2 * h], s.s[mt][0][2 * h + 1]);
      #pragma unroll
      for (int nt = 1; nt < G::NT; ++nt) rowMax = fmaxf(rowMax, fmaxf(s.s[mt][nt][2 * h], s.s[mt][nt][2 * h + 1]));
      const float newMax = fmaxf(state.m[mt][h], cuda::quadMax(rowMax) * scale);
      const float base = Masked && newMax == cuda::negativeInfinity() ? 0.0f : newMax;
      const float correction = ptx::exp2Ftz(state.m[mt][h] - base);
      float rowSum = 0.0f;
      #pragma unroll
      for (int nt = 0; nt < G::NT; ++nt) {
        const float p0 = ptx::exp2Ftz(fmaf(s.s[mt][nt][2 * h], scale, -base));
        const float p1 = ptx::exp2Ftz(fmaf(s.s[mt][nt][2 * h + 1], scale, -base));
        rowSum += p0 + p1;
        s.p[mt][nt][h] = cuda::pack<C>(p0, p1);
      }
      state.l[mt][h] = state.l[mt][h] * correction + rowSum;  // the thread's share: normalize adds the quad's
      state.m[mt][h] = newMax;
      #pragma unroll
      for (int ot = 0; ot < G::OT; ++ot) {
        acc.o[mt][ot][2 * h] *= correction;
        acc.o[mt][ot][2 * h + 1] *= correction;
      }
    }
}

// acc += P V: P's accumulator fragments are re-packed as A fragments (the
// m16n8 C layout of two n-tiles is the m16k16 A layout), V by ldmatrix.trans.
//
// Split pipeline: once every warp is done with K(block) (the barrier), V
// (block) has landed too (its group is the only one in flight) and K
// (block + 1) is issued into K's tile, to land during P V. Here rather than
// ahead of the softmax (FlashAttention-2's place): with S packed into P the
// copies' addresses find registers, where beside S ptxas spilled them.
template <class C>
__device__ void mma_pv(AccTile<C, false>& acc, ScoreTile<C, false>& s, KvPipeline<C, false>& pipe, int64_t block) {
  using G = cuda::Geometry<C>;
  if constexpr (G::splitKv) {
    cuda::waitCopies<0>();
    __syncthreads();
    if (block + 1 < pipe.upper) cuda::copyRows<C, cuda::kKeyRows>(pipe.rows.key, nullptr, pipe.rows.rows, block + 1);
    cuda::commitCopies();
  }
  #pragma unroll
  for (int kk = 0; kk < G::PK; ++kk) {
    Bits32 p[G::MT][4];
    #pragma unroll
    for (int mt = 0; mt < G::MT; ++mt) {
      p[mt][0] = s.p[mt][2 * kk][0];
      p[mt][1] = s.p[mt][2 * kk][1];
      p[mt][2] = s.p[mt][2 * kk + 1][0];
      p[mt][3] = s.p[mt][2 * kk + 1][1];
    }
    #pragma unroll
    for (int pair = 0; pair < G::OT / 2; ++pair) {
      Bits32 v[4];
      cuda::ldmatrixX4Trans(v, pipe.valueLane + cuda::tileOffset<C>(kk * kMmaK, pair * 16));
      #pragma unroll
      for (int mt = 0; mt < G::MT; ++mt) {
        cuda::mma16816<C>(acc.o[mt][2 * pair], p[mt], v[0], v[1]);
        cuda::mma16816<C>(acc.o[mt][2 * pair + 1], p[mt], v[2], v[3]);
      }
    }
  }
}

template <class C>
__device__ void normalize(SoftmaxState<C, false>& state, AccTile<C, false>& acc) {
  using G = cuda::Geometry<C>;
  #pragma unroll
  for (int mt = 0; mt < G::MT; ++mt)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      state.l[mt][h] = cuda::quadSum(state.l[mt][h]);
      const float inverse = state.l[mt][h] > 0.0f ? 1.0f / state.l[mt][h] : 0.0f;
      #pragma unroll
      for (int ot = 0; ot < G::OT; ++ot) {
        acc.o[mt][ot][2 * h] *= inverse;
        acc.o[mt][ot][2 * h + 1] *= inverse;
      }
    }
}

namespace cuda {

// lse = ln 2 * (m + log2 l) for the thread's rows (one writer per quad).
template <class C>
__device__ void storeLse(SoftmaxState<C, false>& state, const IhaArgs& a, int64_t row0, int64_t head, int64_t b) {
  if (!a.lse || lane() % kQuadSize != 0) return;
  const int64_t L = seq_len<C>(a);
  #pragma unroll
  for (int mt = 0; mt < Geometry<C>::MT; ++mt)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const CtaRow t = ctaRow<C>(tileRow<C>(mt) + lane() / kQuadSize + h * 8);
      const int64_t i = storedRow<C>(a, row0, b) + t.row;
      if (t.owned && i < L)
        a.lse[(b * C::heads + head + t.head) * L + i] = kLn2 * (state.m[mt][h] + log2f(state.l[mt][h]));
    }
}

// The normalised block as f32 in shared memory, for the collapse epilogues.
template <class C>
__device__ float* stageOutput(AccTile<C, false>& acc) {
  using G = Geometry<C>;
  float* staging = reinterpret_cast<float*>(smem() + layout<C>().staging);
  __syncthreads();  // the staging area overlaps the Q / K / V tiles
  const int l = lane();
  constexpr int pitch = stagingPitch(C::head_dim);
  #pragma unroll
  for (int mt = 0; mt < G::MT; ++mt)
    #pragma unroll
    for (int ot = 0; ot < G::OT; ++ot)
      #pragma unroll
      for (int e = 0; e < 4; e += 2)  // elements e, e + 1: adjacent columns, one 8-byte store
        *reinterpret_cast<float2*>(staging + (tileRow<C>(mt) + fragment::accumulatorRow(l, e)) * pitch + ot * 8 +
                                   fragment::accumulatorColumn(l, e)) = make_float2(acc.o[mt][ot][e], acc.o[mt][ot][e + 1]);
  __syncthreads();
  return staging;
}

}  // namespace cuda

template <class C>
__device__ void store_rows(AccTile<C, false>& acc, SoftmaxState<C, false>& state, const IhaArgs& a, int64_t row0, int64_t head,
                           int64_t b) {
  using G = cuda::Geometry<C>;
  const int64_t L = seq_len<C>(a);
  Bits16* o = static_cast<Bits16*>(a.o_pseudo);
  const int l = cuda::lane();
  #pragma unroll
  for (int mt = 0; mt < G::MT; ++mt)
    #pragma unroll
    for (int ot = 0; ot < G::OT; ++ot)
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const CtaRow t = ctaRow<C>(cuda::tileRow<C>(mt) + l / kQuadSize + h * 8);
        const int64_t i = cuda::storedRow<C>(a, row0, b) + t.row;
        const int c = ot * 8 + (l % kQuadSize) * 2;
        if (!t.owned || i >= L || c >= G::D) continue;
        *reinterpret_cast<Bits32*>(o + ((b * C::heads + head + t.head) * L + i) * G::D + c) =
            cuda::pack<C>(acc.o[mt][ot][2 * h], acc.o[mt][ot][2 * h + 1]);
      }
  cuda::storeLse<C>(state, a, row0, head, b);
}

// A split CTA's share (kv_splits > 1): its normalised rows as f32 and their
// lse (-inf for a share without an allowed key) into the splits workspace,
// element by element (a row of d + 1 floats has no wider alignment).
template <class C>
__device__ void store_split(AccTile<C, false>& acc, SoftmaxState<C, false>& state, const IhaArgs& a, int64_t row0, int64_t head,
                            int64_t b, int64_t split) {
  using G = cuda::Geometry<C>;
  const int64_t L = seq_len<C>(a);
  const int l = cuda::lane();
  #pragma unroll
  for (int mt = 0; mt < G::MT; ++mt)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const CtaRow t = ctaRow<C>(cuda::tileRow<C>(mt) + l / kQuadSize + h * 8);
      const int64_t i = cuda::storedRow<C>(a, row0, b) + t.row;
      if (!t.owned || i >= L) continue;
      float* row = split_row<C>(a, b, head + t.head, split, i);
      #pragma unroll
      for (int ot = 0; ot < G::OT; ++ot) {
        const int c = ot * 8 + (l % kQuadSize) * 2;
        if (c >= G::D) continue;
        row[c] = acc.o[mt][ot][2 * h];
        row[c + 1] = acc.o[mt][ot][2 * h + 1];
      }
      if (l % kQuadSize == 0)
        row[C::head_dim] = cuda::splitLse(state.m[mt][h], state.l[mt][h]);
    }
}

// per_head collapse: out[n, head] = sum_p collapse[head, p] * O[n*P + p].
template <class C>
__device__ void store_collapsed(AccTile<C, false>& acc, SoftmaxState<C, false>& state, const IhaArgs& a, int64_t row0,
                                int64_t head, int64_t b) {
  using G = cuda::Geometry<C>;
  cuda::storeCollapsed<C>(cuda::stageOutput<C>(acc), stagingPitch(C::head_dim), a, row0, head, b, threadIdx.x,
                          G::threads);
  cuda::storeLse<C>(state, a, row0, head, b);
}

template <class C>
__device__ void out_init(OutTile<C>&) {
  using G = cuda::Geometry<C>;
  cuda::zeroOutTile<C>(reinterpret_cast<float*>(cuda::smem() + cuda::layout<C>().out), G::Dp, threadIdx.x, G::threads);
  __syncthreads();
}

// Global collapse, fused: this head's share of every output head.
template <class C>
__device__ void accumulate_collapsed(OutTile<C>&, AccTile<C, false>& acc, SoftmaxState<C, false>& state, const IhaArgs& a,
                                     int64_t row0, int64_t head, int64_t b) {
  static_assert(C::stacked_heads == 1, "a fused global collapse loops over the heads itself");
  using G = cuda::Geometry<C>;
  const float* staging = cuda::stageOutput<C>(acc);
  cuda::accumulateCollapsed<C>(reinterpret_cast<float*>(cuda::smem() + cuda::layout<C>().out), G::Dp, staging,
                               stagingPitch(C::head_dim), a, head,
                               threadIdx.x, G::threads);
  cuda::storeLse<C>(state, a, row0, head, b);
  __syncthreads();  // the next head's Q load reuses the staging area
}

template <class C>
__device__ void store_out(OutTile<C>&, const IhaArgs& a, int64_t row0, int64_t b) {
  using G = cuda::Geometry<C>;
  cuda::storeOutTile<C>(reinterpret_cast<const float*>(cuda::smem() + cuda::layout<C>().out), G::Dp, a, row0, b,
                        threadIdx.x, G::threads);
}

}  // namespace loom

#include "loom/tile/cuda_backward.h"
