// The sm_90a implementation of the tile API (Hopper: H100, H200), compiled
// by NVRTC with --gpu-architecture=sm_90a. Same program interface as cuda.h;
// the compiler emits a warp-specialised program for it:
//
//   pipeline_init                      all threads: mbarriers
//   if (is_producer) {                 warpgroup 0
//     producer_start                   setmaxnreg.dec
//     kv_load per key block            TMA of the mixed K / V tiles (or mix
//   } else {                           them on chip), completing on full[s]
//     consumer_start                   setmaxnreg.inc
//     load_q, kv_wait, mma_qk, mask_scores, softmax_update, mma_pv,
//     kv_release, kv_finish,
//     normalize, store_*               warpgroups 1..: 64 query rows each
//   }
//
// - Products by wgmma.mma_async: S = Q K^T with both operands in shared
//   memory (descriptors), O += P V with P from registers and V read
//   N-major from shared memory; f32 accumulators in the layout of mma.sync's
//   m16n8 tiles per warp, so masks and the online softmax keep their lane math.
// - Tiles live in 128-byte swizzled atoms (layout.h) that both the tensor
//   memory accelerator writes and the descriptors read; a producer that
//   mixes on chip writes the same swizzle with ordinary stores and fences
//   them for the async proxy (fence.proxy.async) before it arrives.
// - A `stages`-deep ring of K/V buffers with full / empty mbarriers.
// - Softmax overlapped with the matrix products, as FlashAttention-3 does
//   within a warpgroup: mma_pv packs P and owes its product; the next mma_qk
//   issues that block's S = Q K^T and the owed P V and waits for S alone,
//   so the exponentials of softmax_update run while P V is on the tensor
//   cores. softmax_update touches only S and the row statistics; mma_pv
//   waits for P V (its registers become the next P), hands its stage back
//   and rescales O by the softmax's correction.
// - Across warpgroups (two or more consumers), ping-pong: each takes its
//   turn at the tensor cores on a named barrier of its own, issues its
//   S = Q K^T and P V, and hands the turn to the next, so one warpgroup's
//   softmax runs while the other's products do. Warpgroup 0 starts.
// - The loop's arithmetic is FlashAttention-3's: S stays unscaled, the row
//   maximum is taken on it, and each exponential is one FFMA (s * scale -
//   max) and one MUFU.EX2 (ex2.approx.ftz); row sums stay per thread until
//   normalize; descriptors, stage indices and barrier addresses are 32-bit,
//   from a shared-window base computed once a tile. A store of the row sums
//   (the anchor) keeps the exponentials ahead of the wait for P V in the
//   machine code (softmax_update).
#pragma once

#include "loom/tile/cuda_common.h"
#include "loom/tile/wgmma.h"

namespace loom {

namespace hopper {

constexpr int kWarpgroupThreads = 128;
constexpr int kWarpsPerWarpgroup = 4;
constexpr int kWgmmaRows = 64;
constexpr int kWgmmaK = 16;
constexpr int kConsumerBarrier = 1;  // named barrier of all consumer threads; 0 is __syncthreads
constexpr int kWarpgroupBarrier = 2; // + consumer warpgroup: one warpgroup's threads
constexpr int kProducerBarrier = kWarpgroupBarrier + kMaxConsumerWarpgroups;  // the producer warpgroup's threads
// + consumer warpgroup: its turn at the tensor cores (ping-pong, below)
constexpr int kSchedulerBarrier = kProducerBarrier + 1;

template <class C>
struct Geometry {
  static_assert(C::dtype != DType::f32, "CUDA tiles take float16 or bfloat16 inputs");
  static_assert(C::stacked_heads == 1, "sm_90a: one query head a CTA (stack_heads is the mma engine's)");
  static_assert(C::warps % kWarpsPerWarpgroup == 0 && C::block_m == 16 * C::warps,
                "sm_90a: block_m is 64 rows per consumer warpgroup");
  static_assert(C::warps / kWarpsPerWarpgroup <= kMaxConsumerWarpgroups, "at most 4 consumer warpgroups");
  static_assert(C::head_dim % kSwizzleAtomColumns == 0 && C::head_dim <= 256, "sm_90a: head_dim in {64, 128, 192, 256}");
  static_assert(C::block_n % 64 == 0 && C::block_n <= 256, "sm_90a: block_n in {64, 128, 192, 256}");
  static constexpr int consumers = C::warps / kWarpsPerWarpgroup;
  static constexpr int consumerThreads = consumers * kWarpgroupThreads;
  static constexpr int threads = consumerThreads + kWarpgroupThreads;
  static constexpr int D = C::head_dim;
  static constexpr int atoms = D / kSwizzleAtomColumns;
  static constexpr int NT = C::block_n / 8;   // 8-column tiles of S
  static constexpr int OT = D / 8;            // 8-column tiles of O
  static constexpr int KT = D / kWgmmaK;      // k-steps of Q K^T
  static constexpr int PK = C::block_n / kWgmmaK;  // k-steps of P V
  static constexpr int qAtomBytes = C::block_m * kSwizzleRowBytes;
  static constexpr int kvAtomBytes = C::block_n * kSwizzleRowBytes;
  static constexpr int kvTileBytes = atoms * kvAtomBytes;
  static constexpr int chunks = D / kChunkElements;  // 16-byte chunks per row
  // Q as wgmma's register A operand (S = Q K^T from registers, K-major K)
  // when the consumer's registers hold it beside S, O and P (layout.h):
  // each k-step then costs K's descriptor alone, where Q from shared memory
  // costs a second descriptor's uniform moves per wgmma (ptxas 13).
  static constexpr bool qInRegisters = wgmmaQInRegisters(C::block_n, D, C::consumer_registers);
};

template <class C>
__device__ __forceinline__ HopperSmem layout() {
  return hopperSmem(C::block_m, C::block_n, C::head_dim, C::stages, C::heads, C::pseudo_heads, C::fused_collapse,
                    C::fused_global_collapse, C::fused_mix ? C::kv_heads : 0);
}

// Dynamic shared memory, its base rounded up to the swizzle period.
__device__ __forceinline__ unsigned char* smem() {
  unsigned char* base = ptx::dynamicShared<kSwizzlePeriodBytes>();
  const Bits32 misalignment = cuda::sharedAddress(base) & (kSwizzlePeriodBytes - 1);
  return base + ((kSwizzlePeriodBytes - misalignment) & (kSwizzlePeriodBytes - 1));
}

template <class C>
__device__ __forceinline__ Bits64* barrier(int index) {
  return reinterpret_cast<Bits64*>(smem() + layout<C>().barriers) + index;
}
template <class C>
__device__ __forceinline__ Bits64* fullBarrier(int stage) { return barrier<C>(stage); }
template <class C>
__device__ __forceinline__ Bits64* emptyBarrier(int stage) { return barrier<C>(C::stages + stage); }
template <class C>
__device__ __forceinline__ Bits64* qBarrier(int warpgroup) { return barrier<C>(2 * C::stages + warpgroup); }

// The consumer warpgroup of this thread (0-based; the producer is -1), and
// the first query row of its 64.
__device__ __forceinline__ int consumerWarpgroup() { return int(threadIdx.x) / kWarpgroupThreads - 1; }
// The same, taken from lane 0 (the whole warp must call it): ptxas then
// knows it warp-uniform, so the role branch is uniform and what derives
// from it (the pipeline's stage and phase, the shared addresses of the
// descriptors) lives in uniform registers, not moved into them per wgmma.
__device__ __forceinline__ int warpgroupIndex() {
  return __shfl_sync(0xffffffffu, int(threadIdx.x) / kWarpgroupThreads, 0);
}
__device__ __forceinline__ int uniformConsumerWarpgroup() { return warpgroupIndex() - 1; }
__device__ __forceinline__ int consumerThread() { return int(threadIdx.x) - kWarpgroupThreads; }
// Row of accumulator element e of this thread inside the query block.
__device__ __forceinline__ int accumulatorRow(int e) {
  return consumerWarpgroup() * kWgmmaRows + (cuda::warp() % kWarpsPerWarpgroup) * 16 +
         fragment::accumulatorRow(cuda::lane(), e);
}

//===--- mbarriers, named barriers, fences -----------------------------------===//

__device__ __forceinline__ void mbarrierInit(Bits64* bar, unsigned count) {
  ptx::mbarrierInit(cuda::sharedAddress(bar), count);
}
__device__ __forceinline__ void mbarrierArrive(Bits64* bar) { ptx::mbarrierArrive(cuda::sharedAddress(bar)); }
__device__ __forceinline__ void mbarrierExpectBytes(Bits64* bar, unsigned bytes) {
  ptx::mbarrierArriveExpectTx(cuda::sharedAddress(bar), bytes);
}
// Blocks until the phase with parity `parity` has completed.
__device__ __forceinline__ void mbarrierWait(Bits64* bar, int parity) {
  ptx::mbarrierWaitParity(cuda::sharedAddress(bar), parity);
}
// The consumers' loop addresses the stage barriers as 32-bit shared-window
// addresses (barrierAddress, below), with no generic-pointer arithmetic.
__device__ __forceinline__ void mbarrierWait(Bits32 bar, int parity) { ptx::mbarrierWaitParity(bar, parity); }
__device__ __forceinline__ void mbarrierArrive(Bits32 bar) { ptx::mbarrierArrive(bar); }
template <int Id, int Threads>
__device__ __forceinline__ void namedBarrier() {
  ptx::barSync<Id, Threads>();
}
template <class C>
__device__ __forceinline__ void consumerSync() {
  namedBarrier<kConsumerBarrier, Geometry<C>::consumerThreads>();
}
// The barrier of consumer warpgroup `wg`'s threads alone (warpgroup-uniform
// `wg`; each warpgroup's bar.sync names its id as an immediate).
__device__ __forceinline__ void warpgroupBarrier(int wg) {
  static_assert(kMaxConsumerWarpgroups == 4, "one case per consumer warpgroup");
  switch (wg) {
    case 0: namedBarrier<kWarpgroupBarrier + 0, kWarpgroupThreads>(); break;
    case 1: namedBarrier<kWarpgroupBarrier + 1, kWarpgroupThreads>(); break;
    case 2: namedBarrier<kWarpgroupBarrier + 2, kWarpgroupThreads>(); break;
    default: namedBarrier<kWarpgroupBarrier + 3, kWarpgroupThreads>(); break;
  }
}
// Ordinary shared-memory stores become visible to wgmma and TMA.
__device__ __forceinline__ void fenceAsyncProxy() { ptx::fenceProxyAsync(); }

//===--- the tensor memory accelerator --------------------------------------===//

// One box of a 3-d tensor map into shared memory, completing on `bar`.
__device__ __forceinline__ void tmaLoad(void* destination, const TensorMap* map, int column, int row, int plane,
                                        Bits64* bar) {
  ptx::tmaLoad3d(cuda::sharedAddress(destination), map, column, row, plane, cuda::sharedAddress(bar));
}

//===--- wgmma ----------------------------------------------------------------===//

// (The descriptors are in cuda_common.h, shared with the wgmma backward.)
// The aligned dynamic shared memory (smem()) as a 32-bit shared-window
// address: descriptors are computed in 32 bits from it.
__device__ __forceinline__ Bits32 smemAddress() {
  const Bits32 base = cuda::sharedAddress(ptx::dynamicShared<kSwizzlePeriodBytes>());
  return (base + (kSwizzlePeriodBytes - 1)) & ~Bits32(kSwizzlePeriodBytes - 1);
}

// Barrier `index` of barrier<C>(index) as a shared-window address, from
// smemAddress() computed once (`smem`).
template <class C>
__device__ __forceinline__ Bits32 barrierAddress(Bits32 smem, int index) {
  return smem + layout<C>().barriers + index * Bits32(sizeof(Bits64));
}

using ptx::pinRegisters;
using ptx::wgmmaCommit;
using ptx::wgmmaFence;
using ptx::wgmmaWait;

}  // namespace hopper

//===----------------------------------------------------------------------===//
// Tiles: register state of one consumer thread (operands are in shared memory)
//===----------------------------------------------------------------------===//

template <class C>
struct QTile {
  int loads = 0;    // Q tiles loaded so far: the parity of the next one's barrier phase
  Bits32 base = 0;  // this warpgroup's rows: their shared address (set by load_q)
  // With Geometry::qInRegisters: k-step kt of the rows as wgmma's A operand.
  Bits32 a[hopper::Geometry<C>::qInRegisters ? hopper::Geometry<C>::KT : 1][4];
};

template <class C>
struct KvPipeline {
  int next = 0;   // the stage the next block goes to (producer) or comes from (consumer)
  int phase = 0;  // the parity of that stage's current round
  int stage = 0;  // consumer: the stage being consumed
  Bits32 smem = hopper::smemAddress();  // computed once: the loop adds offsets to it
  // Consumer: stage 0's K descriptor, computed once (a stage's is an offset from it).
  hopper::Descriptor k = hopper::descriptorAt(smem + hopper::layout<C>().k, 16, kSwizzlePeriodBytes);
};

template <class C>
struct ScoreTile {
  float s[hopper::Geometry<C>::NT * 4];  // element e of 8-column tile t at [t * 4 + e]
};

template <class C>
struct SoftmaxState {
  float m[2];  // running max (log2 domain) of this thread's rows (accumulatorRow(0), accumulatorRow(2))
  float l[2];  // running denominator: this thread's columns until normalize sums the quad
};

// The output accumulator and the P V product owed to it: P of the last
// block, packed as wgmma's A operand, and the stage holding its V. The
// product is issued by the next mma_qk (or kv_finish) and retired by the
// next mma_pv (or kv_finish). Every wgmma is issued on every path
// (ptxas serialises all of a kernel's wgmma when one sits in a branch it
// cannot prove warpgroup-uniform): before a tile's first block nothing is
// owed, P is zero and the product adds nothing.
template <class C>
struct AccTile {
  float o[hopper::Geometry<C>::OT * 4];
  Bits32 p[hopper::Geometry<C>::PK][4];
  Bits32 smem = 0;     // hopper::smemAddress(), kept from softmax_init
  float scale[2];      // O's correction from the last softmax: mma_pv applies it once P V retires
  int owedStage = -1;  // the stage of the P V owed; -1: none (P is zero)
  int turn = 0;        // ping-pong: this warpgroup's named barrier, and the next one's (set once, softmax_init)
  int nextTurn = 0;
};

template <class C>
struct OutTile {};  // in shared memory (HopperSmem::out)

//===----------------------------------------------------------------------===//
// Warp specialisation
//===----------------------------------------------------------------------===//

// Initialises the mbarriers; every thread of the CTA calls it first.
template <class C>
__device__ void pipeline_init() {
  using G = hopper::Geometry<C>;
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::stages; ++s) {
      // TMA: the producer's expect_tx arrival; on-chip mixing, or a decode
      // step's copies from its paged cache: every producer thread.
      hopper::mbarrierInit(hopper::fullBarrier<C>(s), C::fused_mix || C::decode ? hopper::kWarpgroupThreads : 1);
      hopper::mbarrierInit(hopper::emptyBarrier<C>(s), G::consumerThreads);
    }
    for (int w = 0; w < G::consumers; ++w) hopper::mbarrierInit(hopper::qBarrier<C>(w), 1);
    ptx::fenceMbarrierInit();
  }
  if constexpr (C::decode && C::kv_splits > 1) {
    // A split of a short sequence may have no key block; its kv_finish still
    // issues the (zero) P V product, over stage 0's V, which must then hold
    // finite values: zeros, before any block lands there.
    uint4* v = reinterpret_cast<uint4*>(hopper::smem() + hopper::layout<C>().v);
    for (int i = threadIdx.x; i < G::kvTileBytes / 16; i += G::threads) v[i] = {0u, 0u, 0u, 0u};
    hopper::fenceAsyncProxy();
  }
  __syncthreads();
}

template <class C>
__device__ __forceinline__ bool is_producer() {
  return hopper::warpgroupIndex() == 0;
}

template <class C>
__device__ __forceinline__ void producer_start() {
  ptx::setmaxnregDec<C::producer_registers>();
}

template <class C>
__device__ __forceinline__ void consumer_start() {
  ptx::setmaxnregInc<C::consumer_registers>();
}

namespace hopper {

// Element c of row r of a tile of 128-byte swizzled atoms `atomBytes` apart.
__device__ __forceinline__ Bits16* swizzledElement(unsigned char* tile, int atomBytes, int r, int c) {
  return reinterpret_cast<Bits16*>(tile + (c / kSwizzleAtomColumns) * atomBytes +
                                   swizzledChunk(r, (c % kSwizzleAtomColumns) / kChunkElements)) +
         c % kChunkElements;
}

// Mixes (and rotates K) key block `block` into the stage's K and V tiles,
// written in the swizzled layout by the producer warpgroup's threads. The
// block's tokens' raw rows (all G heads, keys and values) come into the
// ring (layout.h, hopperRingTokens) by cp.async, half a ring a step: the
// next step's copies are in flight while this step's rows are mixed from
// shared memory, 16 bytes a head (a decode step's through the page table,
// its slot found once a token). Rows past the sequence are zeros.
template <class C>
__device__ void mixKvTile(const IhaArgs& a, int64_t g, int64_t b, int64_t block, unsigned char* kTile,
                          unsigned char* vTile) {
  using G = Geometry<C>;
  constexpr int P = C::pseudo_heads, heads = C::kv_heads, D = G::D, halfChunks = G::chunks / 2;
  constexpr int tokenElements = 2 * heads * D;  // a ring token: its G key rows, then its G value rows
  constexpr int half = hopperRingTokens(heads, D) / 2;
  constexpr int pieces = 2 * heads * G::chunks;  // a token's 16-byte copies
  const int tid = int(threadIdx.x);
  Bits16* ring = reinterpret_cast<Bits16*>(smem() + layout<C>().ring);
  const int64_t L = rows_end<C>(a, b), j0 = block * C::block_n;
  const int64_t n0 = j0 / P, rowsEnd = j0 + C::block_n < L ? j0 + C::block_n : L;
  const int tokens = int((rowsEnd - 1) / P + 1 - n0);  // a block holds a row before L
  const int steps = (tokens + half - 1) / half;
  auto chunkOffset = [](int r, int chunk) { return (chunk / 8) * G::kvAtomBytes + swizzledChunk(r, chunk % 8); };
  if (j0 + C::block_n > L) {  // the last block's rows past the sequence
    const float zeros[kChunkElements] = {};
    for (int index = tid; index < C::block_n * G::chunks; index += kWarpgroupThreads) {
      const int r = index / G::chunks, chunk = index % G::chunks;
      if (j0 + r < L) continue;
      cuda::storeChunk<C>(reinterpret_cast<Bits16*>(kTile + chunkOffset(r, chunk)), zeros);
      cuda::storeChunk<C>(reinterpret_cast<Bits16*>(vTile + chunkOffset(r, chunk)), zeros);
    }
  }
  auto issue = [&](int step) {
    #pragma unroll 1
    for (int t = 0; t < half; ++t) {
      const int token = step * half + t;
      const bool inside = token < tokens;
      const int64_t n = n0 + token;
      const Bits16* keys;
      const Bits16* values;
      int64_t keyStride = D, valueStride = D;
      if constexpr (C::decode) {  // the step appended its own tokens: every row is in the cache
        const int64_t slot = inside ? cache_slot(a, b, n) * heads * D : 0;
        keys = static_cast<const Bits16*>(a.k_cache) + slot;
        values = static_cast<const Bits16*>(a.v_cache) + slot;
      } else {
        const int64_t at = inside ? n : 0;
        keys = static_cast<const Bits16*>(a.k) + b * a.k_stride[0] + at * a.k_stride[1];
        values = static_cast<const Bits16*>(a.v) + b * a.v_stride[0] + at * a.v_stride[1];
        keyStride = a.k_stride[2];
        valueStride = a.v_stride[2];
      }
      Bits16* target = ring + ((step % 2) * half + t) * tokenElements;
      #pragma unroll 4
      for (int round = 0; round < (pieces + kWarpgroupThreads - 1) / kWarpgroupThreads; ++round) {
        const int piece = round * kWarpgroupThreads + tid;
        if (pieces % kWarpgroupThreads != 0 && piece >= pieces) break;
        const int role = piece / (heads * G::chunks), m = piece / G::chunks % heads;
        const int column = piece % G::chunks * kChunkElements;
        const Bits16* source = role ? values + m * valueStride + column : keys + m * keyStride + column;
        ptx::cpAsyncCg16(target + (role * heads + m) * D + column, source, inside);
      }
    }
  };
  // sum_m alpha[m, g, p] x_m of the chunk at `column` of a ring token's rows.
  auto mix = [&](const Bits16* rows, const float* alpha, int p, int column, float (&sum)[kChunkElements]) {
    #pragma unroll
    for (int e = 0; e < kChunkElements; ++e) sum[e] = 0.0f;
    #pragma unroll 2
    for (int m = 0; m < heads; ++m)
      cuda::accumulateChunk<C>(rows + m * D + column, alpha[(m * heads + g) * P + p], sum);
  };
  issue(0);
  ptx::cpAsyncCommit();
  #pragma unroll 1
  for (int step = 0; step < steps; ++step) {
    if (step + 1 < steps) issue(step + 1);
    ptx::cpAsyncCommit();
    ptx::cpAsyncWait<1>();
    namedBarrier<kProducerBarrier, kWarpgroupThreads>();  // every thread's copies of this step landed
    const int64_t firstRow = (n0 + step * half) * P, endRow = (n0 + (step + 1) * half) * P;
    const int rLo = int((firstRow > j0 ? firstRow : j0) - j0), rHi = int((endRow < rowsEnd ? endRow : rowsEnd) - j0);
    // (row, chunk pair d/2 apart, role) items: one angle for a key pair's halves
    for (int item = tid; item < (rHi - rLo) * halfChunks * 2; item += kWarpgroupThreads) {
      const int r = rLo + item / (halfChunks * 2), role = item / halfChunks % 2, lo = item % halfChunks;
      const int64_t j = j0 + r;
      const int p = int(j % P), t = int(j / P - n0) - step * half;
      const Bits16* rows = ring + ((step % 2) * half + t) * tokenElements + role * heads * D;
      float first[kChunkElements], second[kChunkElements];
      mix(rows, role ? a.alpha_v : a.alpha_k, p, lo * kChunkElements, first);
      mix(rows, role ? a.alpha_v : a.alpha_k, p, (lo + halfChunks) * kChunkElements, second);
      if constexpr (cuda::RoleOf<C, Role::key>::rotated) {
        if (role == 0) cuda::rotatePair<C>(first, second, rope_position<C>(a, j), lo * kChunkElements);
      }
      unsigned char* tile = role ? vTile : kTile;
      cuda::storeChunk<C>(reinterpret_cast<Bits16*>(tile + chunkOffset(r, lo)), first);
      cuda::storeChunk<C>(reinterpret_cast<Bits16*>(tile + chunkOffset(r, lo + halfChunks)), second);
    }
    namedBarrier<kProducerBarrier, kWarpgroupThreads>();  // this half is free for step + 2's copies
  }
  if constexpr (cuda::Normalized<C, Role::key>::value)
    cuda::normalizeRows<C>(
        C::block_n, [&](int r, int c) { return swizzledElement(kTile, G::kvAtomBytes, r, c); }, cuda::warp(),
        kWarpsPerWarpgroup);
}

// A decode step over a mixed cache: copies key block `block` of kv head g
// (row n*P + p at token n's slot, the row as the append stored it: mixed,
// rotated, normalised) into the stage's swizzled K and V tiles with
// asynchronous 16-byte copies, every one of the thread's issued before any
// is waited for (at block_n 128, d 128: 32 a thread, 64 KB a CTA in flight);
// rows past the sequence take src-size 0 (zeros, nothing read). The caller
// waits for them and fences them for the async proxy.
template <class C>
__device__ void copyCachedKvTile(const IhaArgs& a, int64_t g, int64_t b, int64_t block, unsigned char* kTile,
                                 unsigned char* vTile) {
  using G = Geometry<C>;
  constexpr int P = C::pseudo_heads;
  const int64_t L = decode_len<C>(a, b);
  const Bits16* keys = static_cast<const Bits16*>(a.k_cache);
  const Bits16* values = static_cast<const Bits16*>(a.v_cache);
  for (int index = threadIdx.x; index < C::block_n * G::chunks; index += kWarpgroupThreads) {
    const int r = index / G::chunks, chunk = index % G::chunks;
    const int64_t j = block * C::block_n + r;
    const int offset = (chunk / 8) * G::kvAtomBytes + swizzledChunk(r, chunk % 8);
    const bool inside = j < L;
    const int64_t element =
        inside ? ((cache_slot(a, b, j / P) * C::kv_heads + g) * P + j % P) * G::D + chunk * kChunkElements : 0;
    ptx::cpAsyncCg16(kTile + offset, keys + element, inside);
    ptx::cpAsyncCg16(vTile + offset, values + element, inside);
  }
  ptx::cpAsyncCommit();
}

}  // namespace hopper

// Producer: fills the next stage with key block `block` of kv head g. With
// materialised mixing one thread issues the TMA copies of the mixed K and V
// rows; with fused mixing the whole warpgroup mixes them on chip. A decode
// step's producer reads its paged cache: it mixes the raw rows on chip, or
// copies the mixed rows of a mixed cache (a page table is no tensor map).
template <class C, bool Mixed>
__device__ void kv_load(KvPipeline<C>& pipe, const IhaArgs& a, const TmaMaps& maps, int64_t g, int64_t b,
                        int64_t block) {
  using G = hopper::Geometry<C>;
  const int stage = pipe.next, parity = pipe.phase;
  if (++pipe.next == C::stages) pipe.next = 0, pipe.phase ^= 1;
  const HopperSmem s = hopper::layout<C>();
  unsigned char* kTile = hopper::smem() + s.k + stage * G::kvTileBytes;
  unsigned char* vTile = hopper::smem() + s.v + stage * G::kvTileBytes;
  if constexpr (Mixed || C::decode) {
    hopper::mbarrierWait(hopper::emptyBarrier<C>(stage), parity ^ 1);  // the consumers' release of its last use
    if constexpr (Mixed) {
      hopper::mixKvTile<C>(a, g, b, block, kTile, vTile);
    } else {
      hopper::copyCachedKvTile<C>(a, g, b, block, kTile, vTile);
      ptx::cpAsyncWait<0>();  // the thread's copies landed: its own to fence and publish
    }
    hopper::fenceAsyncProxy();
    hopper::mbarrierArrive(hopper::fullBarrier<C>(stage));
  } else {
    if (threadIdx.x != 0) return;  // one thread drives the copy engine
    hopper::mbarrierWait(hopper::emptyBarrier<C>(stage), parity ^ 1);
    Bits64* full = hopper::fullBarrier<C>(stage);
    hopper::mbarrierExpectBytes(full, 2 * G::kvTileBytes);
    const int row = int(block * C::block_n), plane = int(b * C::kv_heads + g);
    #pragma unroll
    for (int atom = 0; atom < G::atoms; ++atom) {
      hopper::tmaLoad(kTile + atom * G::kvAtomBytes, &maps.k, atom * kSwizzleAtomColumns, row, plane, full);
      hopper::tmaLoad(vTile + atom * G::kvAtomBytes, &maps.v, atom * kSwizzleAtomColumns, row, plane, full);
    }
  }
}

// Consumer: this warpgroup's 64 rows of the Q tile, by TMA from q_mixed or
// mixed (and rotated) on chip into the swizzled layout.
template <class C, bool Mixed>
__device__ void load_q(QTile<C>& q, const IhaArgs& a, const TmaMaps& maps, int64_t row0, int64_t head, int64_t b) {
  using G = hopper::Geometry<C>;
  const int wg = hopper::uniformConsumerWarpgroup();
  unsigned char* tile = hopper::smem() + hopper::layout<C>().q + wg * hopper::kWgmmaRows * kSwizzleRowBytes;
  q.base = hopper::smemAddress() + hopper::layout<C>().q + wg * hopper::kWgmmaRows * kSwizzleRowBytes;
  if constexpr (Mixed) {
    const int64_t L = rows_end<C>(a, b);
    const int t = hopper::consumerThread() % hopper::kWarpgroupThreads;
    for (int index = t; index < hopper::kWgmmaRows * G::chunks; index += hopper::kWarpgroupThreads) {
      const int r = index / G::chunks, chunk = index % G::chunks;
      const int64_t i = row0 + wg * hopper::kWgmmaRows + r;
      float values[kChunkElements] = {};
      if (i < L)
        cuda::mixedChunk<C, Role::query>(a, b, i / C::pseudo_heads, int(head), int(i % C::pseudo_heads),
                                           chunk * kChunkElements, values);
      cuda::storeChunk<C>(
          reinterpret_cast<Bits16*>(tile + (chunk / 8) * G::qAtomBytes + swizzledChunk(r, chunk % 8)), values);
    }
    if constexpr (cuda::Normalized<C, Role::query>::value) {
      hopper::warpgroupBarrier(wg);
      cuda::normalizeRows<C>(
          hopper::kWgmmaRows, [&](int r, int c) { return hopper::swizzledElement(tile, G::qAtomBytes, r, c); },
          cuda::warp() % hopper::kWarpsPerWarpgroup, hopper::kWarpsPerWarpgroup);
    }
    hopper::fenceAsyncProxy();
    hopper::warpgroupBarrier(wg);
  } else {
    static_assert(!C::decode, "a decode step mixes its queries as they load");
    Bits64* bar = hopper::qBarrier<C>(wg);
    if (hopper::consumerThread() % hopper::kWarpgroupThreads == 0) {
      hopper::mbarrierExpectBytes(bar, G::atoms * hopper::kWgmmaRows * kSwizzleRowBytes);
      const int row = int(row0) + wg * hopper::kWgmmaRows, plane = int(b * C::heads + head);
      #pragma unroll
      for (int atom = 0; atom < G::atoms; ++atom)
        hopper::tmaLoad(tile + atom * G::qAtomBytes, &maps.q, atom * kSwizzleAtomColumns, row, plane, bar);
    }
    hopper::mbarrierWait(bar, q.loads & 1);
  }
  if constexpr (G::qInRegisters) {
    // ldmatrix.x4 per k-step: lane l gives row l % 16 of its warp's 16, the
    // 8 columns (l / 16) * 8 of the step's 16, which makes the m16k16 A
    // fragment of wgmma (and mma.sync).
    const int l = cuda::lane(), r = (cuda::warp() % hopper::kWarpsPerWarpgroup) * 16 + l % 16;
    #pragma unroll
    for (int kt = 0; kt < G::KT; ++kt) {
      const int column = kt * hopper::kWgmmaK + (l / 16) * kChunkElements;
      ptx::ldmatrixX4(q.a[kt], q.base + (column / kSwizzleAtomColumns) * G::qAtomBytes +
                                   swizzledChunk(r, (column % kSwizzleAtomColumns) / kChunkElements));
    }
  }
  ++q.loads;
}

template <class C>
__device__ void softmax_init(SoftmaxState<C>& state, AccTile<C>& acc) {
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    state.m[h] = cuda::negativeInfinity();
    state.l[h] = 0.0f;
  }
  #pragma unroll
  for (int i = 0; i < hopper::Geometry<C>::OT * 4; ++i) acc.o[i] = 0.0f;
  #pragma unroll
  for (int kk = 0; kk < hopper::Geometry<C>::PK; ++kk)
    #pragma unroll
    for (int r = 0; r < 4; ++r) acc.p[kk][r] = 0u;
  acc.scale[0] = acc.scale[1] = 1.0f;
  acc.owedStage = -1;
  acc.smem = hopper::smemAddress();
  constexpr int consumers = hopper::Geometry<C>::consumers;
  const int wg = hopper::uniformConsumerWarpgroup();
  acc.turn = hopper::kSchedulerBarrier + wg;
  acc.nextTurn = hopper::kSchedulerBarrier + (wg + 1 == consumers ? 0 : wg + 1);
  if constexpr (consumers > 1)  // warpgroup 0's first turn (ping-pong)
    if (wg == consumers - 1)
      ptx::barArriveId<2 * hopper::kWarpgroupThreads>(hopper::kSchedulerBarrier);
}

// Consumer: waits until the next stage holds key block `block`.
template <class C, bool Mixed>
__device__ void kv_wait(KvPipeline<C>& pipe, const IhaArgs&, int64_t, int64_t, int64_t) {
  pipe.stage = pipe.next;
  hopper::mbarrierWait(hopper::barrierAddress<C>(pipe.smem, pipe.stage), pipe.phase);  // full[stage]
  if (++pipe.next == C::stages) pipe.next = 0, pipe.phase ^= 1;
}

namespace hopper {

// Issues the owed P V product: O += P V, V read N-major from the owed stage
// (with nothing owed, from the stage being consumed: its values are finite
// and P is zero). The caller has fenced and commits.
template <class C>
__device__ __forceinline__ void issueOwedPv(AccTile<C>& acc, const KvPipeline<C>& pipe) {
  using G = Geometry<C>;
  const int stage = acc.owedStage >= 0 ? acc.owedStage : pipe.stage;
  const Descriptor v =
      offset(descriptorAt(acc.smem + layout<C>().v, G::kvAtomBytes, kSwizzlePeriodBytes), stage * G::kvTileBytes);
  #pragma unroll
  for (int kk = 0; kk < G::PK; ++kk)
    wgmma::Wgmma<C::dtype, C::head_dim>::rs(acc.o, acc.p[kk], advanced(v, kk * kWgmmaK * kSwizzleRowBytes), true);
}

// Waits for the P V product in flight, then hands the owed stage back.
template <class C>
__device__ __forceinline__ void retirePv(AccTile<C>& acc) {
  wgmmaWait<0>();
  pinRegisters(acc.o);
  if (acc.owedStage >= 0) mbarrierArrive(barrierAddress<C>(acc.smem, C::stages + acc.owedStage));  // empty[owed]
  acc.owedStage = -1;
}

// O *= the last softmax's correction, once the P V before it has retired
// (and before the next one adds to O).
template <class C>
__device__ __forceinline__ void rescaleOutput(AccTile<C>& acc) {
  #pragma unroll
  for (int t = 0; t < Geometry<C>::OT; ++t)
    #pragma unroll
    for (int e = 0; e < 4; ++e) acc.o[t * 4 + e] *= acc.scale[e / 2];
}

// Ping-pong: consumer warpgroup w waits on its own named barrier for its
// turn at the tensor cores (given by warpgroup w - 1 when that one has issued
// its products) and, once it has issued its own, gives the turn to w + 1.
// Each barrier counts the waiting warpgroup and the giving one.
//
// Every turn is taken and given unconditionally (a branch among wgmma makes
// ptxas serialise them all): the last warpgroup gives warpgroup 0 its first
// turn of a tile in softmax_init, and warpgroup 0 takes the turn the last
// warpgroup gives after its last product in normalize, so nothing is left
// pending on a barrier when the tile ends.
template <class C>
__device__ __forceinline__ void takeTurn(const AccTile<C>& acc) {
  if constexpr (Geometry<C>::consumers > 1) ptx::barSyncId<2 * kWarpgroupThreads>(acc.turn);
}
template <class C>
__device__ __forceinline__ void giveTurn(const AccTile<C>& acc) {
  if constexpr (Geometry<C>::consumers > 1) ptx::barArriveId<2 * kWarpgroupThreads>(acc.nextTurn);
}

}  // namespace hopper

// Nothing to do here: the stage goes back when the P V product reading it
// retires (mma_pv of the next block, or kv_finish).
template <class C>
__device__ __forceinline__ void kv_release(KvPipeline<C>&, int64_t) {}

// S = Q K^T (unscaled: the softmax folds the scale into its exponentials):
// block_n-wide wgmma over d / 16 k-steps, Q and K from their swizzled tiles.
// Then the last block's owed P V is issued, and only S is waited for: P V
// runs on while softmax_update works on S.
template <class C>
__device__ void mma_qk(ScoreTile<C>& s, QTile<C>& qt, KvPipeline<C>& pipe, int64_t, AccTile<C>& acc) {
  using G = hopper::Geometry<C>;
  const hopper::Descriptor k = hopper::offset(pipe.k, pipe.stage * G::kvTileBytes);
  hopper::takeTurn<C>(acc);
  hopper::pinRegisters(s.s);
  hopper::wgmmaFence();
  #pragma unroll
  for (int kt = 0; kt < G::KT; ++kt) {
    const int atom = kt / (kSwizzleAtomColumns / hopper::kWgmmaK);
    const int inner = (kt % (kSwizzleAtomColumns / hopper::kWgmmaK)) * hopper::kWgmmaK * kTileElementBytes;
    if constexpr (G::qInRegisters)
      wgmma::Wgmma<C::dtype, C::block_n>::rsKMajor(s.s, qt.a[kt], hopper::advanced(k, atom * G::kvAtomBytes + inner),
                                                   kt > 0);
    else  // Q from shared memory by its own descriptor
      wgmma::Wgmma<C::dtype, C::block_n>::ss(
          s.s, hopper::advanced(hopper::descriptorAt(qt.base, 16, kSwizzlePeriodBytes), atom * G::qAtomBytes + inner),
          hopper::advanced(k, atom * G::kvAtomBytes + inner), kt > 0);
  }
  hopper::wgmmaCommit();
  hopper::issueOwedPv<C>(acc, pipe);
  hopper::wgmmaCommit();
  hopper::giveTurn<C>(acc);
  hopper::wgmmaWait<1>();  // groups retire in order: S is done, P V may run on
  hopper::pinRegisters(s.s);
}

// -inf for pairs the mask forbids and columns past the end. Each of the
// thread's two rows sees one interval of keys (allowedColumns): the columns
// this thread holds (t * 8 + {0, 1} from its first, bit 2t + e) inside it
// are a run of bits, built once a row, and each element costs a bit test
// and a select, with a window or without.

// LowerEdge (iha.kv_loop's lower_edge): the block hides only keys below a
// row's first, so neither the row's last nor the end is read.
template <class C, bool LowerEdge = false>
__device__ void mask_scores(ScoreTile<C>& s, const IhaArgs& a, int64_t row0, int64_t block) {
  using G = hopper::Geometry<C>;
  // Rows fit in int (launches check L = N * P < 2^31).
  const int first = int(block * C::block_n) + fragment::accumulatorColumn(cuda::lane(), 0);
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const ColumnRange<int> range = visibleColumns<C, int>(a, int(row0) + hopper::accumulatorRow(2 * h));
    cuda::ColumnBits<G::NT> allowed;
    if constexpr (LowerEdge) {
      allowed = ~cuda::columnsBelow<G::NT>(range.lo - first);
    } else {
      const int L = int(rows_end<C>(a, block_z(a)));
      const int hi = (range.hi < L - 1 ? range.hi : L - 1) - first, lo = range.lo - first;  // relative to `first`
      allowed = cuda::columnsBelow<G::NT>(hi + 1);
      if constexpr (windowed<C>() || C::varlen) allowed &= ~cuda::columnsBelow<G::NT>(lo);
    }
    #pragma unroll
    for (int t = 0; t < G::NT; ++t)
      #pragma unroll
      for (int e = 2 * h; e < 2 * h + 2; ++e)
        if (!((allowed >> (2 * t + (e & 1))) & 1)) s.s[t * 4 + e] = cuda::negativeInfinity();
  }
}

// Online softmax on the accumulator fragments, as in cuda.h: a row's values
// sit in the 4 threads of a quad. The maxima and exponentials of S come
// first, while the last block's P V may still be running; O is rescaled
// after it retires.
//
// S is unscaled: the maximum is taken on it and scaled once, and each
// exponential is exp2(s * scale - max), one FFMA and one MUFU.EX2. O is not
// touched (P V may still be adding to it): its correction is owed to the
// next mma_qk or kv_finish. The row sums stay per thread (normalize adds
// the quad's).
//
// Masked: the block's mask may leave a row no key, its maximum -inf, and the
// exponentials are then taken from 0 (-inf - -inf would be NaN). An unmasked
// block gives every row a finite maximum, and skips the test.
template <class C, bool Masked = true>
__device__ void softmax_update(SoftmaxState<C>& state, ScoreTile<C>& s, AccTile<C>& acc) {
  using G = hopper::Geometry<C>;
  constexpr float scale = C::scale * kLog2e;
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    float rowMax = fmaxf(s.s[2 * h], s.s[2 * h + 1]);
    #pragma unroll
    for (int t = 1; t < G::NT; ++t) rowMax = fmaxf(rowMax, fmaxf(s.s[t * 4 + 2 * h], s.s[t * 4 + 2 * h + 1]));
    const float newMax = fmaxf(state.m[h], cuda::quadMax(rowMax) * scale);
    const float base = Masked && newMax == cuda::negativeInfinity() ? 0.0f : newMax;
    acc.scale[h] = ptx::exp2Ftz(state.m[h] - base);
    float rowSum = 0.0f;
    #pragma unroll
    for (int t = 0; t < G::NT; ++t)
      #pragma unroll
      for (int e = 2 * h; e < 2 * h + 2; ++e)
        rowSum += (s.s[t * 4 + e] = ptx::exp2Ftz(fmaf(s.s[t * 4 + e], scale, -base)));
    state.l[h] = state.l[h] * acc.scale[h] + rowSum;
    state.m[h] = newMax;
  }
  // The scheduling anchor: a store of the row sums, which need every
  // exponential, ahead of mma_pv's wait for P V. ptxas keeps a shared store
  // before a wgmma wait, so the exponentials stay in the P V window instead
  // of all following a wait hoisted above them (loom compile --sass shows
  // how many do; the SASS gates hold it).
  ptx::stSharedF32(acc.smem + hopper::layout<C>().anchors + kAccumulatorBytes * hopper::consumerThread(),
                   state.l[0] + state.l[1]);
}

// O += P V, owed: P is re-packed from the S fragments into wgmma's register
// A operand (the m16n8 layout of two 8-column tiles is the m16k16 A
// layout) and issued by the next mma_qk, behind that block's S = Q K^T.
template <class C>
__device__ void mma_pv(AccTile<C>& acc, ScoreTile<C>& s, KvPipeline<C>& pipe, int64_t) {
  using G = hopper::Geometry<C>;
  hopper::retirePv<C>(acc);  // the last P V is done: its P registers are free, O may change
  hopper::rescaleOutput<C>(acc);
  #pragma unroll
  for (int kk = 0; kk < G::PK; ++kk) {
    acc.p[kk][0] = cuda::pack<C>(s.s[(2 * kk) * 4 + 0], s.s[(2 * kk) * 4 + 1]);
    acc.p[kk][1] = cuda::pack<C>(s.s[(2 * kk) * 4 + 2], s.s[(2 * kk) * 4 + 3]);
    acc.p[kk][2] = cuda::pack<C>(s.s[(2 * kk + 1) * 4 + 0], s.s[(2 * kk + 1) * 4 + 1]);
    acc.p[kk][3] = cuda::pack<C>(s.s[(2 * kk + 1) * 4 + 2], s.s[(2 * kk + 1) * 4 + 3]);
  }
  acc.owedStage = pipe.stage;
}

// After a consumer's last key block: its owed P V is issued and retired,
// and its stage goes back to the producer (which may be streaming the next
// head's blocks). A forward tile always has a key block (its diagonal), so
// something is owed; a decode step's sequence with no rows (a ragged
// step's empty sequence, or one the device's page check refused) has no
// key block and owes nothing: no stage was filled to read, O stays zero
// and normalize() writes zero rows.
template <class C>
__device__ void kv_finish(KvPipeline<C>& pipe, AccTile<C>& acc) {
  hopper::takeTurn<C>(acc);
  hopper::pinRegisters(acc.o);
  hopper::wgmmaFence();
  if (!C::decode || acc.owedStage >= 0) hopper::issueOwedPv<C>(acc, pipe);  // (a forward always owes)
  hopper::wgmmaCommit();
  hopper::giveTurn<C>(acc);
  hopper::retirePv<C>(acc);
}

template <class C>
__device__ void normalize(SoftmaxState<C>& state, AccTile<C>& acc) {
  using G = hopper::Geometry<C>;
  if constexpr (G::consumers > 1)  // the turn the last warpgroup gave after its last product (ping-pong)
    if (hopper::consumerWarpgroup() == 0) ptx::barSyncId<2 * hopper::kWarpgroupThreads>(hopper::kSchedulerBarrier);
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    state.l[h] = cuda::quadSum(state.l[h]);
    const bool empty = !(state.l[h] > 0.0f);
    const float inverse = empty ? 0.0f : 1.0f / state.l[h];
    #pragma unroll
    for (int t = 0; t < G::OT; ++t) {
      acc.o[t * 4 + 2 * h] = empty ? 0.0f : acc.o[t * 4 + 2 * h] * inverse;
      acc.o[t * 4 + 2 * h + 1] = empty ? 0.0f : acc.o[t * 4 + 2 * h + 1] * inverse;
    }
  }
}

namespace hopper {

template <class C>
__device__ void storeLse(SoftmaxState<C>& state, const IhaArgs& a, int64_t row0, int64_t head, int64_t b) {
  if (!a.lse || cuda::lane() % kQuadSize != 0) return;
  const int64_t L = seq_len<C>(a);
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = accumulatorRow(2 * h);
    const int64_t i = cuda::storedRow<C>(a, row0, b) + r;
    if (r < C::cta_rows && i < L) a.lse[(b * C::heads + head) * L + i] = kLn2 * (state.m[h] + log2f(state.l[h]));
  }
}

// The normalised block as f32 [block_m][d] in shared memory; waits for
// every consumer first (the staging tile may overlap the operand tiles).
template <class C>
__device__ float* stageOutput(AccTile<C>& acc) {
  using G = Geometry<C>;
  float* staging = reinterpret_cast<float*>(smem() + layout<C>().staging);
  consumerSync<C>();
  const int l = cuda::lane();
  constexpr int pitch = stagingPitch(C::head_dim);
  #pragma unroll
  for (int t = 0; t < G::OT; ++t)
    #pragma unroll
    for (int e = 0; e < 4; e += 2)  // elements e, e + 1: adjacent columns, one 8-byte store
      *reinterpret_cast<float2*>(staging + accumulatorRow(e) * pitch + t * 8 + fragment::accumulatorColumn(l, e)) =
          make_float2(acc.o[t * 4 + e], acc.o[t * 4 + e + 1]);
  consumerSync<C>();
  return staging;
}

}  // namespace hopper

template <class C>
__device__ void store_rows(AccTile<C>& acc, SoftmaxState<C>& state, const IhaArgs& a, int64_t row0, int64_t head,
                           int64_t b) {
  using G = hopper::Geometry<C>;
  const int64_t L = seq_len<C>(a);
  Bits16* o = static_cast<Bits16*>(a.o_pseudo);
  const int l = cuda::lane();
  #pragma unroll
  for (int t = 0; t < G::OT; ++t)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = hopper::accumulatorRow(2 * h);
      const int64_t i = cuda::storedRow<C>(a, row0, b) + r;
      const int c = t * 8 + fragment::accumulatorColumn(l, 0);
      if (r < C::cta_rows && i < L)
        *reinterpret_cast<Bits32*>(o + ((b * C::heads + head) * L + i) * G::D + c) =
            cuda::pack<C>(acc.o[t * 4 + 2 * h], acc.o[t * 4 + 2 * h + 1]);
    }
  hopper::storeLse<C>(state, a, row0, head, b);
}

// A split CTA's share (kv_splits > 1, decode): its normalised rows as f32
// and their lse (-inf for a share without an allowed key) into the splits
// workspace, for the combine launch (combine_splits, cuda_common.h).
template <class C>
__device__ void store_split(AccTile<C>& acc, SoftmaxState<C>& state, const IhaArgs& a, int64_t row0, int64_t head,
                            int64_t b, int64_t split) {
  using G = hopper::Geometry<C>;
  const int64_t L = seq_len<C>(a);
  const int l = cuda::lane();
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = hopper::accumulatorRow(2 * h);
    const int64_t i = cuda::storedRow<C>(a, row0, b) + r;
    if (r >= C::cta_rows || i >= L) continue;
    float* row = split_row<C>(a, b, head, split, i);
    #pragma unroll
    for (int t = 0; t < G::OT; ++t) {
      const int c = t * 8 + fragment::accumulatorColumn(l, 0);
      row[c] = acc.o[t * 4 + 2 * h];
      row[c + 1] = acc.o[t * 4 + 2 * h + 1];
    }
    if (l % kQuadSize == 0)
      row[C::head_dim] = cuda::splitLse(state.m[h], state.l[h]);
  }
}

// per_head collapse: out[n, head] = sum_p collapse[head, p] * O[n*P + p].
template <class C>
__device__ void store_collapsed(AccTile<C>& acc, SoftmaxState<C>& state, const IhaArgs& a, int64_t row0,
                                int64_t head, int64_t b) {
  using G = hopper::Geometry<C>;
  cuda::storeCollapsed<C>(hopper::stageOutput<C>(acc), stagingPitch(C::head_dim), a, row0, head, b,
                          hopper::consumerThread(),
                          G::consumerThreads);
  hopper::storeLse<C>(state, a, row0, head, b);
}

template <class C>
__device__ void out_init(OutTile<C>&) {
  using G = hopper::Geometry<C>;
  cuda::zeroOutTile<C>(reinterpret_cast<float*>(hopper::smem() + hopper::layout<C>().out), G::D,
                       hopper::consumerThread(), G::consumerThreads);
  hopper::consumerSync<C>();
}

// Global collapse, fused: this head's share of every output head.
template <class C>
__device__ void accumulate_collapsed(OutTile<C>&, AccTile<C>& acc, SoftmaxState<C>& state, const IhaArgs& a,
                                     int64_t row0, int64_t head, int64_t b) {
  using G = hopper::Geometry<C>;
  const float* staging = hopper::stageOutput<C>(acc);
  cuda::accumulateCollapsed<C>(reinterpret_cast<float*>(hopper::smem() + hopper::layout<C>().out), G::D, staging,
                               stagingPitch(C::head_dim), a,
                               head, hopper::consumerThread(), G::consumerThreads);
  hopper::storeLse<C>(state, a, row0, head, b);
  hopper::consumerSync<C>();  // the next head's staging reuses the tile
}

template <class C>
__device__ void store_out(OutTile<C>&, const IhaArgs& a, int64_t row0, int64_t b) {
  using G = hopper::Geometry<C>;
  cuda::storeOutTile<C>(reinterpret_cast<const float*>(hopper::smem() + hopper::layout<C>().out), G::D, a, row0, b,
                        hopper::consumerThread(), G::consumerThreads);
}

}  // namespace loom
