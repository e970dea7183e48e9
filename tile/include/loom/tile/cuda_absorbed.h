// The absorbed decode step over a raw paged cache (mma.sync, sm_80 and
// later): a config with `absorbed` runs the same program as any decode step
// (q_begin, kv_begin, the key-block loop of kv_wait, mma_qk, mask_scores,
// softmax_update, mma_pv, kv_release, normalize, store_split / store_rows),
// and cuda.h hands each of those calls to this file.
//
// A raw cache holds each token's G rows as projected; the step's score of
// query row (h, i) against virtual key row t*P + j is
//   q_hi . R(tP + j) sum_m alpha_k[m, g, j] x_m(t)
//     = sum_m alpha_k[m, g, j] (R(-j) q_hi) . (R(tP) x_m(t))
// (g = h's kv head; rotations of one angle pair commute). So the keys are
// never mixed: each cached row is rotated once by its token's angle, each
// query row becomes P rows (h, i, j) of R(-j) q (its "S rows"), the tensor
// cores take every S row against every raw row (m, t), and the products are
// combined over m with the f32 weights of the row's (g, j). The values'
// mixing folds into the probabilities the same way:
//   sum_{t,j} p_(hi)(tj) sum_m beta[m, g, j] v_m(t) = sum_{m,t} P'_(hi)(mt) v_m(t),
//   P'_(hi)(mt) = sum_j p_(hi)(tj) beta[m, g, j],
// a product over the raw value rows. The P rows of one query row share one
// running max (a row's softmax is over all of its (t, j)).
//
// One CTA holds a token of every query head (the config's stacked_heads is
// H): block_m query rows of 16-row m-tiles, each tile's 16 P S rows held by
// `split` warps (two where P is even: each half the S rows, half the output
// columns). A key block is kAbsorbedTokens tokens, its K and V stage rows
// ordered (m, t): one score n-tile is one head's eight tokens, so the
// combination over m is in each thread's own registers. Where P is not a
// power of two, a query row takes Pg (the next one) S rows, those past P
// scoring -inf.
//
// Per block: kv_wait rotates the staged keys in place; mma_qk multiplies and
// combines; softmax_update takes each query row's max over its S rows
// (shuffles: P divides the eight rows of a fragment half), writes the
// probabilities to shared memory, folds each warp's own query rows' into P'
// (16-bit, the P V operand) and, past a barrier, rescales the output rows;
// mma_pv multiplies P' by the raw value rows.
#pragma once

namespace loom {
namespace absorbed {

template <class C>
struct Geometry {
  static constexpr int P = C::pseudo_heads, G = C::kv_heads, Gp = absorbedPaddedHeads(C::kv_heads);
  // The kv heads the CTA's query heads read (layout.h, stepHeads): its
  // weight tables and key norms hold theirs only.
  static constexpr int CG = stepKvHeads(C::stacked_heads, C::heads, C::kv_heads);
  static constexpr int Pg = absorbedRows(P);  // S rows a query row (those from P on score -inf)
  static constexpr int D = C::head_dim, Dp = paddedHeadDim(C::head_dim), pitch = tilePitch(C::head_dim);
  static constexpr int tokens =
      kDecodeStep<C> == kTensorMixingStep ? kTensorMixingTokens : kAbsorbedTokens;
  static constexpr int tiles = C::block_m / kMTileRows;  // 16-row m-tiles of query rows
  static constexpr int split = absorbedSplit(P, D);      // warps a query m-tile
  static constexpr int SM = Pg / split;                  // S m-tiles a warp
  static constexpr int KT = Dp / kMmaK;                  // k-steps of S
  static constexpr int OT = Dp / 8 / split;              // output n-tiles a warp
  static constexpr int ownRows = kMTileRows / split;     // query rows whose S rows a warp holds
  static constexpr int threads = C::warps * kWarpSize;
  static constexpr int stageRows = Gp * tokens;          // rows of K (and of V) a stage
  static constexpr int pPitch = absorbedPTilePitch(C::kv_heads);
  static constexpr int dChunks = D / kChunkElements;
  static_assert(C::block_n == tokens * P, "a key block is whole tokens");
  static_assert(C::stacked_heads ==
                    oneCtaHeads(kDecodeStep<C> == kTensorMixingStep, C::heads, C::kv_heads, P, C::head_dim),
                "an absorbed CTA holds a token of every query head (stepHeads of them)");
  static_assert(kDecodeStep<C> != kAbsorbedStep ||
                    absorbedShapeProblem(C::block_m, C::warps, C::head_dim, P) == nullptr,
                "no absorbed step for this shape");
  static_assert(!C::mixed_cache && C::decode, "the absorbed step reads a raw cache");
};

// The CTA's shared memory (the tensor-mixing step stages its key blocks
// here too: cuda_tensor_mixing.h).
template <class C>
__device__ __forceinline__ AbsorbedSmem layout() {
  if constexpr (kDecodeStep<C> == kTensorMixingStep)
    return tensorMixingSmem(C::stacked_heads, C::head_dim, C::stages, C::heads, C::kv_heads);
  else
    return absorbedSmem(C::block_m, C::head_dim, C::stages, C::kv_heads, C::pseudo_heads, C::warps, C::qk_norm);
}
template <class C>
__device__ __forceinline__ int tile() {
  return cuda::warp() / Geometry<C>::split;
}
template <class C>
__device__ __forceinline__ int part() {
  return cuda::warp() % Geometry<C>::split;
}
// The first S row (query row * P + j) of this warp's S m-tile `sm`.
template <class C>
__device__ __forceinline__ int sTileRow(int sm) {
  using A = Geometry<C>;
  return tile<C>() * kMTileRows * A::Pg + (part<C>() * A::SM + sm) * kMTileRows;
}
// The S row of this thread's fragment half h (rows lane/4, lane/4 + 8) of S m-tile sm.
template <class C>
__device__ __forceinline__ int sRowOf(int sm, int h) {
  return sTileRow<C>(sm) + cuda::lane() / 4 + 8 * h;
}
// The kv head whose keys query row r (of the CTA's) reads, counted from the
// CTA's first (kvBase); 0 for the rows past the CTA's heads (computed,
// never stored).
template <class C>
__device__ __forceinline__ int kvHeadOf(int r) {
  const CtaRow t = ctaRow<C>(r);
  return t.owned ? t.head / (C::heads / C::kv_heads) : 0;
}
// The first kv head of the CTA whose first query head is `head0`.
template <class C>
__device__ __forceinline__ int kvBase(int64_t head0) {
  return int(head0 / (C::heads / C::kv_heads));
}
template <class C>
__device__ __forceinline__ Bits16* sharedTile(int offset) {
  return reinterpret_cast<Bits16*>(cuda::smem() + offset);
}
template <class C>
__device__ __forceinline__ float* sharedFloats(int offset) {
  return reinterpret_cast<float*>(cuda::smem() + offset);
}
template <class C>
constexpr Bits32 tileOffset(int row, int column) {
  return Bits32((row * Geometry<C>::pitch + column) * kTileElementBytes);
}

}  // namespace absorbed

template <class C>
struct QTile<C, true> {
  Bits32 a[absorbed::Geometry<C>::SM][absorbed::Geometry<C>::KT][4];  // the warp's S rows, R(-j) q
};

template <class C>
struct KvPipeline<C, true> {
  Bits32 keyLane, valueLane;  // this lane's ldmatrix addresses in the block's stage
  FastDivider pages;          // the launch's page size
  int32_t tokensEnd;          // the sequence's tokens once the step's are cached (kvBegin)
};

template <class C>
struct ScoreTile<C, true> {
  float s[absorbed::Geometry<C>::SM][4];  // S rows x the block's eight tokens, combined over m
};

template <class C>
struct SoftmaxState<C, true> {
  float m[absorbed::Geometry<C>::SM][2];  // running max (log2 domain) of the thread's S rows' query rows
  float l[absorbed::Geometry<C>::SM][2];  // the thread's share of their denominators
  float outMax[2];                        // the running max of its output rows (lane/4, lane/4 + 8)
  float outSum[2];                        // their denominators, once normalize has them
};

template <class C>
struct AccTile<C, true> {
  float o[absorbed::Geometry<C>::OT][4];  // the warp's output columns of its m-tile
};

namespace absorbed {

// Each of the CTA's first Rows query rows mixed (and normalised, qk_norm),
// unrotated, a 16-byte piece (and with RoPE its partner d/2 further) a
// lane: `place(r)` is row r's CtaRow (its head counted from `head0`, the
// CTA's first), `emit(r, i, valid, lo, x, y)` gets
// the pieces at columns lo (and lo + d/2) of virtual row i (zeros where
// the row is not the CTA's or past the sequence). A row's pieces lie in
// `lanes` consecutive lanes of one warp, so qk_norm's mean of squares is a
// shuffle sum.
template <class C, int Rows, class Place, class Emit>
__device__ void forEachQueryRow(const IhaArgs& a, int64_t row0, int64_t head0, int64_t b, Place&& place, Emit&& emit) {
  constexpr int D = C::head_dim;
  const int64_t L = decode_len<C>(a, b);
  constexpr bool rope = C::rope_theta > 0;
  constexpr int pieces = rope ? D / 2 / kChunkElements : D / kChunkElements, lanes = nextPowerOfTwo(pieces);
  static_assert(lanes <= kWarpSize, "a query row's pieces lie in one warp");
  constexpr int rowsAWarp = kWarpSize / lanes;
  const int piece = cuda::lane() % lanes, lo = piece * kChunkElements, hi = lo + D / 2;
  for (int first = cuda::warp() * rowsAWarp; first < Rows; first += C::warps * rowsAWarp) {
    const int r = first + cuda::lane() / lanes;
    const bool inTile = r < Rows && piece < pieces;
    const CtaRow t = place(inTile ? r : 0);
    const int64_t i = row0 + t.row;
    const bool valid = inTile && t.owned && i < L;
    float x[kChunkElements] = {}, y[kChunkElements] = {};
    if (valid) {
      const int64_t n = i / C::pseudo_heads;
      const int p = int(i % C::pseudo_heads);
      cuda::mixChunk<C, Role::query>(a, b, n, head0 + t.head, p, lo, x);
      if constexpr (rope) cuda::mixChunk<C, Role::query>(a, b, n, head0 + t.head, p, hi, y);
    }
    if constexpr (C::qk_norm) {  // every lane of the warp takes part
      float squares = 0.0f;
      #pragma unroll
      for (int e = 0; e < kChunkElements; ++e) squares = fmaf(x[e], x[e], fmaf(y[e], y[e], squares));
      #pragma unroll
      for (int offset = lanes / 2; offset > 0; offset /= 2) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
      const float factor = rsqrtf(squares * (1.0f / D) + C::qk_norm_eps);
      #pragma unroll
      for (int e = 0; e < kChunkElements; ++e) {
        x[e] *= factor;
        y[e] *= factor;
      }
    }
    if (inTile) emit(r, i, valid, lo, x, y);
  }
}

// Prologue: the weights' tables, then R(-j) q of every S row into shared
// memory (over the stages, which kv_begin fills after), then each warp's
// fragments into registers.
template <class C>
__device__ void qBegin(QTile<C, true>& q, const IhaArgs& a, int64_t row0, int64_t head0, int64_t b) {
  using A = Geometry<C>;
  const AbsorbedSmem s = layout<C>();
  const int kv0 = kvBase<C>(head0);
  // alpha_k of each thread's S rows, [warp][m][lane / 4][sm][half]: one
  // vector load a head in mma_qk.
  float* alpha = sharedFloats<C>(s.alpha);
  constexpr int perWarp = A::Gp * 8 * 2 * A::SM;
  for (int index = threadIdx.x; index < C::warps * perWarp; index += A::threads) {
    const int w = index / perWarp, m = index % perWarp / (8 * 2 * A::SM), quad = index % (8 * 2 * A::SM) / (2 * A::SM);
    const int sm = index % (2 * A::SM) / 2, half = index % 2;
    const int sRow = (w / A::split) * kMTileRows * A::Pg + ((w % A::split) * A::SM + sm) * kMTileRows + quad + 8 * half;
    const int r = sRow / A::Pg, j = sRow % A::Pg;
    alpha[index] =
        m < A::G && j < A::P && ctaRow<C>(r).owned ? a.alpha_k[(m * A::G + kv0 + kvHeadOf<C>(r)) * A::P + j] : 0.0f;
  }
  float* beta = sharedFloats<C>(s.beta);
  for (int index = threadIdx.x; index < A::CG * A::Gp * A::P; index += A::threads) {
    const int g = index / (A::Gp * A::P), m = index / A::P % A::Gp, j = index % A::P;
    beta[index] = m < A::G ? a.alpha_v[(m * A::G + kv0 + g) * A::P + j] : 0.0f;
  }
  if constexpr (C::qk_norm) {  // alpha_k transposed: a row of G weights a mixed key row (g, j) of the CTA's
    float* weights = sharedFloats<C>(s.keyWeights);
    constexpr int pitch = absorbedGramPitch(A::G);
    for (int index = threadIdx.x; index < A::CG * A::P * pitch; index += A::threads) {
      const int row = index / pitch, m = index % pitch;
      weights[index] = m < A::G ? a.alpha_k[(m * A::G + kv0 + row / A::P) * A::P + row % A::P] : 0.0f;
    }
  }
  // R(-j) q: q is mixed unrotated (and normalised, qk_norm), then turned
  // once for each j by the angle of position n*P + p - j (the query's own
  // rotation and R(-j)).
  Bits16* qTile = sharedTile<C>(s.q);
  forEachQueryRow<C, C::block_m>(a, row0, head0, b, [](int r) { return ctaRow<C>(r); },
                                 [&](int r, int64_t i, bool valid, int lo, const float (&x)[kChunkElements],
                                     const float (&y)[kChunkElements]) {
    for (int j = 0; j < A::Pg; ++j) {
      Bits16* row = qTile + (r * A::Pg + j) * A::pitch;
      if constexpr (C::rope_theta > 0) {
        float u[kChunkElements], w[kChunkElements];
        #pragma unroll
        for (int e = 0; e < kChunkElements; ++e) {
          u[e] = x[e];
          w[e] = y[e];
        }
        if (valid) cuda::rotatePair<C>(u, w, i - j, lo);
        cuda::storeChunk<C>(row + lo, u);
        cuda::storeChunk<C>(row + lo + A::D / 2, w);
      } else {
        cuda::storeChunk<C>(row + lo, x);
      }
    }
  });
  __syncthreads();
  const int l = cuda::lane();
  #pragma unroll
  for (int sm = 0; sm < A::SM; ++sm) {
    const Bits32 lane =
        cuda::sharedAddress(qTile + (sTileRow<C>(sm) + fragment::aRow(l)) * A::pitch + fragment::aColumn(l));
    #pragma unroll
    for (int kt = 0; kt < A::KT; ++kt) cuda::ldmatrixX4(q.a[sm][kt], lane + Bits32(kt * kMmaK * kTileElementBytes));
  }
  __syncthreads();  // the stages overlap the query tile
}

// The copies of key block `block` (kAbsorbedTokens tokens) into its stage:
// threads / tokens threads a token, so each finds its token's slot once a
// block; a thread's 16-byte pieces of the token's G rows sit at
// compile-time offsets from its first (where a row's chunks and the
// token's threads divide one another). Tokens past the sequence take
// src-size 0 (zeros, nothing read).
template <class C, class Pipe>
__device__ void issue(const Pipe& pipe, const IhaArgs& a, int64_t b, int64_t block) {
  using A = Geometry<C>;
  constexpr int perToken = A::threads / A::tokens, items = A::G * A::dChunks;
  static_assert(A::threads % A::tokens == 0, "a token's copies take whole threads");
  const int t = int(threadIdx.x) / perToken, sub = int(threadIdx.x) % perToken;
  const AbsorbedSmem s = layout<C>();
  // Blocks and positions fit in 32 bits (launches refuse 2^31 virtual rows).
  const int stage = int(block) % C::stages, n = int(block) * A::tokens + t;
  const bool inside = n < pipe.tokensEnd;
  const int64_t slot = inside ? cache_slot(a, b, n, pipe.pages) * A::G * A::D : 0;
  const Bits16* key = static_cast<const Bits16*>(a.k_cache) + slot;
  const Bits16* value = static_cast<const Bits16*>(a.v_cache) + slot;
  const Bits32 kRow = cuda::sharedAddress(cuda::smem() + s.k) +
                      Bits32((stage * A::stageRows + t) * A::pitch * kTileElementBytes);
  const Bits32 toValues = Bits32(s.v - s.k);
  auto copy = [&](int m, int column) {
    const Bits32 target = kRow + Bits32((m * A::tokens * A::pitch + column) * kTileElementBytes);
    ptx::cpAsyncCg16(target, key + m * A::D + column, inside);
    ptx::cpAsyncCg16(target + toValues, value + m * A::D + column, inside);
  };
  if constexpr (perToken % A::dChunks == 0 || A::dChunks % perToken == 0) {
    const int m0 = sub / A::dChunks, c0 = sub % A::dChunks;
    #pragma unroll
    for (int round = 0; round < (items + perToken - 1) / perToken; ++round) {
      const int dm = round * perToken / A::dChunks, dc = round * perToken % A::dChunks;
      if (items % perToken != 0 && m0 + dm >= A::G) break;
      copy(m0 + dm, (c0 + dc) * kChunkElements);
    }
  } else {
    for (int piece = sub; piece < items; piece += perToken) copy(piece / A::dChunks, piece % A::dChunks * kChunkElements);
  }
}

// The block's rotary angles, R(tP) of each of its tokens, once a block into
// shared memory (cosines, then sines, of every pair of columns), before its
// copies are waited for: the rotation's threads read them, where each
// would compute the same angles for several heads.
template <class C>
__device__ void stageAngles(int64_t block) {
  using A = Geometry<C>;
  constexpr int half = A::D / 2;
  float* angles = sharedFloats<C>(layout<C>().angles);
  cuda::forEachUnrolled<A::tokens * half, A::threads>([&](int index) {
    const int t = index / half, c = index % half;
    float sine, cosine;
    cuda::ropeSinCos<C>((int(block) * A::tokens + t) * A::P, c, &sine, &cosine);
    angles[t * A::D + c] = cosine;
    angles[t * A::D + half + c] = C::rope_negative ? -sine : sine;
  });
}

// Each staged key row (m, t) turned by its token's angle, R(tP), in place.
// A thread's turns are unrolled up to kMaxUnrolledTurns (H = G = 16 P 1 d
// 128, one warp: 32 of about 70 instructions; past that, a loop the SASS
// reader counts once and the decode gate refuses).
constexpr int kMaxUnrolledTurns = 32;
template <class C>
__device__ void rotateStage(int64_t block) {
  using A = Geometry<C>;
  constexpr int halfChunks = A::D / 2 / kChunkElements, combos = A::tokens * halfChunks;
  Bits16* kStage = sharedTile<C>(layout<C>().k) + int(block) % C::stages * A::stageRows * A::pitch;
  const float* angles = sharedFloats<C>(layout<C>().angles);
  // A chunk pair's angles (token t, columns lo ..), then the turn of head m's row by them.
  auto anglesOf = [&](int t, int lo, float (&cosine)[kChunkElements], float (&sine)[kChunkElements]) {
    #pragma unroll
    for (int e = 0; e < kChunkElements; e += 4) {
      const float4 c = *reinterpret_cast<const float4*>(angles + t * A::D + lo + e);
      const float4 s = *reinterpret_cast<const float4*>(angles + t * A::D + A::D / 2 + lo + e);
      cosine[e] = c.x, cosine[e + 1] = c.y, cosine[e + 2] = c.z, cosine[e + 3] = c.w;
      sine[e] = s.x, sine[e + 1] = s.y, sine[e + 2] = s.z, sine[e + 3] = s.w;
    }
  };
  auto turnBy = [&](int m, int t, int lo, const float (&cosine)[kChunkElements], const float (&sine)[kChunkElements]) {
    Bits16* row = kStage + (m * A::tokens + t) * A::pitch;
    const uint4 low = *reinterpret_cast<const uint4*>(row + lo), high = *reinterpret_cast<const uint4*>(row + lo + A::D / 2);
    const Bits32 lw[4] = {low.x, low.y, low.z, low.w}, hw[4] = {high.x, high.y, high.z, high.w};
    float x[kChunkElements], y[kChunkElements];
    cuda::unpackPiece<C, kChunkElements>(lw, x);
    cuda::unpackPiece<C, kChunkElements>(hw, y);
    #pragma unroll
    for (int e = 0; e < kChunkElements; ++e) cuda::turnPair(x, y, e, cosine[e], sine[e]);
    cuda::storeChunk<C>(row + lo, x);
    cuda::storeChunk<C>(row + lo + A::D / 2, y);
  };
  auto turn = [&](int m, int t, int lo) {
    float cosine[kChunkElements], sine[kChunkElements];
    anglesOf(t, lo, cosine, sine);
    turnBy(m, t, lo, cosine, sine);
  };
  if constexpr (C::qk_norm && kDecodeStep<C> == kAbsorbedStep) {
    // a warp turns its own tokens' rows (keyNorms reads them past a __syncwarp)
    constexpr int rows = A::G * halfChunks;
    static_assert(A::tokens % C::warps == 0, "a warp turns whole tokens");
    #pragma unroll
    for (int turnRound = 0; turnRound < A::tokens / C::warps; ++turnRound) {
      const int t = cuda::warp() + turnRound * C::warps;
      #pragma unroll
      for (int round = 0; round < (rows + kWarpSize - 1) / kWarpSize; ++round) {
        const int index = round * kWarpSize + cuda::lane();
        if (rows % kWarpSize != 0 && index >= rows) break;
        turn(index / halfChunks, t, index % halfChunks * kChunkElements);
      }
    }
  } else if constexpr (A::threads % combos == 0) {
    constexpr int step = A::threads / combos;  // heads a round
    const int combo = int(threadIdx.x) % combos, m0 = int(threadIdx.x) / combos;
    const int t = combo / halfChunks, lo = combo % halfChunks * kChunkElements;
    #pragma unroll
    for (int round = 0; round < (A::G + step - 1) / step; ++round) {
      const int m = m0 + round * step;
      if (A::G % step != 0 && m >= A::G) break;
      turn(m, t, lo);
    }
  } else if constexpr (A::G * ((combos + A::threads - 1) / A::threads) <= kMaxUnrolledTurns) {
    // fewer threads than a head's combos (one warp at d 128: 64): a thread
    // owns every threads-th of them, reads each one's angles once and turns
    // it in every head, unrolled, so the key-block loop holds no inner loop
    // (H = G = 16 P 1 d 128, one warp: 32 turns; with each turn reading its
    // own angles ptxas hoisted them and spilled)
    #pragma unroll
    for (int k = 0; k < (combos + A::threads - 1) / A::threads; ++k) {
      const int combo = int(threadIdx.x) + k * A::threads, t = combo / halfChunks, lo = combo % halfChunks * kChunkElements;
      if (combos % A::threads != 0 && combo >= combos) break;
      float cosine[kChunkElements], sine[kChunkElements];
      anglesOf(t, lo, cosine, sine);
      #pragma unroll
      for (int m = 0; m < A::G; ++m) turnBy(m, t, lo, cosine, sine);
    }
  } else {
    for (int index = threadIdx.x; index < A::G * combos; index += A::threads)
      turn(index / combos, index % combos / halfChunks, index % halfChunks * kChunkElements);
  }
}

// qk_norm: 1 / rms of each mixed key row (g, j) of the block's tokens,
// without mixing them: |sum_m alpha_k[m, g, j] x_m|^2 = a^T X X^T a, with X
// the token's G raw rows (rotated or not: one rotation keeps their dot
// products) and a the row's weights. A warp takes its own tokens, `batch`
// at a time (absorbedGramTokens): their G raw rows each stacked into 16-row
// tiles, X X^T on the tensor cores (X's fragments are both operands), each
// token's diagonal block into the warp's Gram buffer, then each lane the
// quadratic forms of (G P batch) / 32 (row, token) pairs on the upper
// triangle, in f32.
template <class C>
__device__ void keyNorms(int64_t block) {
  using A = Geometry<C>;
  constexpr int batch = absorbedGramTokens(A::G, A::P, C::warps), R = batch * A::G;  // tokens, rows a product
  constexpr int tilesM = (R + 15) / 16, tilesN = (R + 7) / 8, pitch = absorbedGramPitch(A::G);
  constexpr int forms = A::CG * A::P;  // the CTA's mixed key rows
  constexpr int items = forms * batch;   // (row, token) pairs a product's forms
  static_assert(batch == 1 || items <= kWarpSize, "a batch's forms are one to a lane");
  const AbsorbedSmem smem = layout<C>();
  const Bits16* kStage = sharedTile<C>(smem.k) + int(block) % C::stages * A::stageRows * A::pitch;
  float* gram = sharedFloats<C>(smem.gram) + cuda::warp() * R * pitch;
  const float* weights = sharedFloats<C>(smem.keyWeights);
  float* norms = sharedFloats<C>(smem.keyNorms);
  const int l = cuda::lane();
  // A lane's pairs i = round * 32 + lane (row i % forms, token i / forms),
  // in passes of `held` rounds whose weights stay in registers (at most
  // 32), each pass reading the Gram matrices once.
  constexpr int rounds = (items + kWarpSize - 1) / kWarpSize;
  constexpr int held = rounds * pitch <= 32 ? rounds : pitch <= 32 ? 32 / pitch : 1;
  static_assert(batch == 1 || (rounds == 1 && held == 1), "a batch's lanes hold one pair each");
  static_assert(A::tokens % (C::warps * batch) == 0, "a warp's tokens are whole batches");
  #pragma unroll
  for (int tokenRound = 0; tokenRound < A::tokens / C::warps / batch; ++tokenRound) {
    // token u of the batch: the warp's (tokenRound batch + u)-th, as rotateStage turned them
    auto tokenOf = [&](int u) { return cuda::warp() + (tokenRound * batch + u) * C::warps; };
    float c[tilesM][tilesN][4];
    cuda::zero<C>(c);
    #pragma unroll
    for (int kt = 0; kt < A::KT; ++kt) {
      Bits32 x[tilesM][4];
      #pragma unroll
      for (int mt = 0; mt < tilesM; ++mt) {  // rows past R repeat the last (their products are never stored)
        const int r = mt * 16 + l % 16 < R ? mt * 16 + l % 16 : R - 1;
        const int m = batch == 1 ? r : r % A::G, u = batch == 1 ? 0 : r / A::G;
        cuda::ldmatrixX4(x[mt],
                         cuda::sharedAddress(kStage + (m * A::tokens + tokenOf(u)) * A::pitch + kt * kMmaK + l / 16 * 8));
      }
      #pragma unroll
      for (int mt = 0; mt < tilesM; ++mt)
        #pragma unroll
        for (int nt = 0; nt < tilesN; ++nt)  // B's n-tile nt is X's rows nt*8..: halves of an A fragment
          cuda::mma16816<C>(c[mt][nt], x[mt], x[nt / 2][nt % 2], x[nt / 2][2 + nt % 2]);
    }
    #pragma unroll
    for (int mt = 0; mt < tilesM; ++mt)
      #pragma unroll
      for (int nt = 0; nt < tilesN; ++nt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {  // a token's block: rows and columns u G .. u G + G - 1
          const int row = mt * 16 + l / 4 + 8 * (e / 2), column = nt * 8 + 2 * (l % 4) + e % 2;
          if (row < R && column < R && row / A::G == column / A::G)
            gram[row * pitch + column % A::G] = c[mt][nt][e];
        }
    __syncwarp();
    // sum_m w_m (X X^T_mm w_m + 2 sum_{m' > m} X X^T_mm' w_m'), on the
    // upper triangle, a 16-byte piece of a Gram row at a time; a batch's
    // lanes each read their own token's matrix (one pass of one round)
    const float* mine = gram + (batch > 1 && l < items ? l / forms : 0) * A::G * pitch;
    #pragma unroll
    for (int pass = 0; pass < (rounds + held - 1) / held; ++pass) {
      float w[held][pitch];
      #pragma unroll
      for (int h = 0; h < held; ++h) {  // pairs past the last (a partial round) take row 0's weights
        const int i = (pass * held + h) * kWarpSize + l;
        const int row = pass * held + h < rounds && i < items ? i % forms : 0;
        #pragma unroll
        for (int m = 0; m < pitch; m += 4) {
          const float4 four = *reinterpret_cast<const float4*>(weights + row * pitch + m);
          w[h][m] = four.x;
          w[h][m + 1] = four.y;
          w[h][m + 2] = four.z;
          w[h][m + 3] = four.w;
        }
      }
      float squares[held] = {};
      #pragma unroll
      for (int m = 0; m < A::G; ++m) {
        float diagonal = 0.0f, cross[held] = {};
        #pragma unroll
        for (int n = m / 4 * 4; n < pitch; n += 4) {
          const float4 four = *reinterpret_cast<const float4*>(mine + m * pitch + n);
          const float x[4] = {four.x, four.y, four.z, four.w};
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (n + e == m) diagonal = x[e];
            if (n + e <= m || n + e >= A::G) continue;
            #pragma unroll
            for (int h = 0; h < held; ++h) cross[h] = fmaf(x[e], w[h][n + e], cross[h]);
          }
        }
        #pragma unroll
        for (int h = 0; h < held; ++h) squares[h] = fmaf(w[h][m], fmaf(diagonal, w[h][m], 2.0f * cross[h]), squares[h]);
      }
      #pragma unroll
      for (int h = 0; h < held; ++h) {
        const int i = (pass * held + h) * kWarpSize + l;
        if (pass * held + h < rounds && (items % kWarpSize == 0 || i < items))
          norms[i % forms * A::tokens + tokenOf(i / forms)] = rsqrtf(squares[h] * (1.0f / A::D) + C::qk_norm_eps);
      }
    }
    __syncwarp();  // the Gram buffer is the warp's next tokens'
  }
}

template <class C, class Pipe>
__device__ void kvBegin(Pipe& pipe, const IhaArgs& a, int64_t b, int64_t lower, int64_t upper) {
  using A = Geometry<C>;
  pipe.pages = fastDivider(int32_t(a.page_size));
  pipe.tokensEnd = int32_t(a.cache_len[b] + step_tokens<C>(a, b));
  if constexpr (A::Gp != A::G) {  // the padding head's rows: zeros, never copied over (P' is 0 there)
    const AbsorbedSmem s = layout<C>();
    constexpr int rows = A::tokens, chunks = A::Dp / kChunkElements;
    const float zeros[kChunkElements] = {};
    for (int index = threadIdx.x; index < 2 * C::stages * rows * chunks; index += A::threads) {
      const int stage = index / (rows * chunks) % C::stages, v = index / (C::stages * rows * chunks);
      const int r = A::G * A::tokens + index / chunks % rows, column = index % chunks * kChunkElements;
      cuda::storeChunk<C>(sharedTile<C>(v ? s.v : s.k) + (stage * A::stageRows + r) * A::pitch + column, zeros);
    }
  }
  #pragma unroll 1
  for (int stage = 0; stage < C::stages - 1; ++stage) {
    if (lower + stage < upper) issue<C>(pipe, a, b, lower + stage);
    cuda::commitCopies();
  }
}

template <class C>
__device__ void kvWait(KvPipeline<C, true>& pipe, const IhaArgs& a, int64_t b, int64_t block) {
  using A = Geometry<C>;
  if constexpr (C::stages == 1) {
    issue<C>(pipe, a, b, block);
    cuda::commitCopies();
  }
  if constexpr (C::rope_theta > 0) stageAngles<C>(block);  // the last block's rotation is past a barrier
  cuda::waitCopies<C::stages - 1>();
  __syncthreads();
  if constexpr (C::rope_theta > 0) rotateStage<C>(block);
  if constexpr (C::qk_norm) {
    if constexpr (C::rope_theta > 0) __syncwarp();  // the warp's tokens' rows, turned
    keyNorms<C>(block);
  }
  if constexpr (C::rope_theta > 0 || C::qk_norm) __syncthreads();
  const AbsorbedSmem s = layout<C>();
  const int stage = int(block) % C::stages, l = cuda::lane();
  const Bits16* key = sharedTile<C>(s.k) + stage * A::stageRows * A::pitch;
  const Bits16* value = sharedTile<C>(s.v) + stage * A::stageRows * A::pitch;
  pipe.keyLane = cuda::sharedAddress(key + fragment::bRow(l) * A::pitch + fragment::bColumn(l));
  pipe.valueLane = cuda::sharedAddress(value + fragment::bTransRow(l) * A::pitch + fragment::bTransColumn(l) +
                                       part<C>() * A::OT * 8);
}

// S = (R(-j) q) . (R(tP) x_m(t)) for two heads m at a time (one ldmatrix of
// K a k-step), combined over m with each S row's alpha_k (one vector load
// of the thread's S rows' weights a head).
template <class C>
__device__ void mmaQk(ScoreTile<C, true>& s, QTile<C, true>& q, KvPipeline<C, true>& pipe) {
  using A = Geometry<C>;
  constexpr int weights = 2 * A::SM;  // the thread's S rows
  const float* alpha = sharedFloats<C>(layout<C>().alpha) + (cuda::warp() * A::Gp * 8 + cuda::lane() / 4) * weights;
  #pragma unroll
  for (int sm = 0; sm < A::SM; ++sm)
    #pragma unroll
    for (int e = 0; e < 4; ++e) s.s[sm][e] = 0.0f;
  #pragma unroll
  for (int pair = 0; pair < A::Gp / 2; ++pair) {
    float x[A::SM][2][4];
    #pragma unroll
    for (int sm = 0; sm < A::SM; ++sm)
      #pragma unroll
      for (int e = 0; e < 4; ++e) x[sm][0][e] = x[sm][1][e] = 0.0f;
    #pragma unroll
    for (int kt = 0; kt < A::KT; ++kt) {
      Bits32 k[4];
      cuda::ldmatrixX4(k, pipe.keyLane + tileOffset<C>(pair * 2 * A::tokens, kt * kMmaK));
      #pragma unroll
      for (int sm = 0; sm < A::SM; ++sm) {
        cuda::mma16816<C>(x[sm][0], q.a[sm][kt], k[0], k[1]);
        cuda::mma16816<C>(x[sm][1], q.a[sm][kt], k[2], k[3]);
      }
    }
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      float w[weights];
      #pragma unroll
      for (int e = 0; e < weights; e += 2) {
        const float2 pairOfWeights = *reinterpret_cast<const float2*>(alpha + (2 * pair + h) * 8 * weights + e);
        w[e] = pairOfWeights.x;
        w[e + 1] = pairOfWeights.y;
      }
      #pragma unroll
      for (int sm = 0; sm < A::SM; ++sm)
        #pragma unroll
        for (int e = 0; e < 4; ++e) s.s[sm][e] = fmaf(w[2 * sm + e / 2], x[sm][h][e], s.s[sm][e]);
    }
  }
  if constexpr (C::qk_norm) {  // each mixed key row's 1 / rms (its tokens: this thread's two columns)
    const float* norms = sharedFloats<C>(layout<C>().keyNorms) + fragment::accumulatorColumn(cuda::lane(), 0);
    #pragma unroll
    for (int sm = 0; sm < A::SM; ++sm)
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int sRow = sRowOf<C>(sm, h), j = sRow % A::Pg < A::P ? sRow % A::Pg : A::P - 1;
        const float2 scale = *reinterpret_cast<const float2*>(norms + (kvHeadOf<C>(sRow / A::Pg) * A::P + j) * A::tokens);
        s.s[sm][2 * h] *= scale.x;
        s.s[sm][2 * h + 1] *= scale.y;
      }
  }
}

// -inf where the mask forbids (query row, key t*P + j) or the token is past
// the sequence.
template <class C>
__device__ void maskScores(ScoreTile<C, true>& s, const IhaArgs& a, int64_t row0, int64_t block) {
  using A = Geometry<C>;
  const int L = int(decode_len<C>(a, block_z(a))), l = cuda::lane();
  #pragma unroll
  for (int sm = 0; sm < A::SM; ++sm)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int sRow = sRowOf<C>(sm, h), j = sRow % A::Pg;
      const int i = int(row0) + ctaRow<C>(sRow / A::Pg).row;
      const ColumnRange<int> range = allowedColumns<C, int>(i);
      const int hi = range.hi < L - 1 ? range.hi : L - 1;
      #pragma unroll
      for (int e = 2 * h; e < 2 * h + 2; ++e) {
        const int key = (int(block) * A::tokens + fragment::accumulatorColumn(l, e)) * A::P + j;
        if (key > hi || (windowed<C>() && key < range.lo)) s.s[sm][e] = cuda::negativeInfinity();
      }
    }
}

// The max of each query row over its P S rows: they are P consecutive rows
// of a fragment half, lanes 4 apart.
__device__ __forceinline__ float groupMax(float x, int P) {
  for (int offset = 4; offset < 4 * P; offset *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ float groupSum(float x, int P) {
  for (int offset = 4; offset < 4 * P; offset *= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Output row half h (lane/4, lane/4 + 8) of the thread's columns times factor.
template <class C>
__device__ __forceinline__ void scaleOutputRow(AccTile<C, true>& acc, int h, float factor) {
  #pragma unroll
  for (int ot = 0; ot < Geometry<C>::OT; ++ot) {
    acc.o[ot][2 * h] *= factor;
    acc.o[ot][2 * h + 1] *= factor;
  }
}

template <class C, bool Masked>
__device__ void softmaxUpdate(SoftmaxState<C, true>& state, ScoreTile<C, true>& s, AccTile<C, true>& acc) {
  using A = Geometry<C>;
  constexpr float scale = C::scale * kLog2e;
  const AbsorbedSmem smem = layout<C>();
  float* probs = sharedFloats<C>(smem.probs);
  float* rowMax = sharedFloats<C>(smem.rowMax);
  const int l = cuda::lane();
  #pragma unroll
  for (int sm = 0; sm < A::SM; ++sm)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int sRow = sRowOf<C>(sm, h), r = sRow / A::Pg, j = sRow % A::Pg;
      if (A::Pg != A::P && j >= A::P) s.s[sm][2 * h] = s.s[sm][2 * h + 1] = cuda::negativeInfinity();
      const float rowHigh = groupMax(cuda::quadMax(fmaxf(s.s[sm][2 * h], s.s[sm][2 * h + 1])), A::Pg);
      const float newMax = fmaxf(state.m[sm][h], rowHigh * scale);
      const float base = Masked && newMax == cuda::negativeInfinity() ? 0.0f : newMax;
      const float correction = ptx::exp2Ftz(state.m[sm][h] - base);
      const float p0 = ptx::exp2Ftz(fmaf(s.s[sm][2 * h], scale, -base));
      const float p1 = ptx::exp2Ftz(fmaf(s.s[sm][2 * h + 1], scale, -base));
      state.l[sm][h] = state.l[sm][h] * correction + p0 + p1;
      state.m[sm][h] = newMax;
      const int t = fragment::accumulatorColumn(l, 0);
      if (A::Pg == A::P || j < A::P) {
        probs[(r * A::tokens + t) * A::P + j] = p0;
        probs[(r * A::tokens + t + 1) * A::P + j] = p1;
      }
      if (l % 4 == 0 && j == 0) rowMax[r] = newMax;
    }
  __syncwarp();
  // P' of this warp's own query rows: lane -> (row, token pair), every head m.
  Bits16* pTile = sharedTile<C>(smem.pTile);
  const float* beta = sharedFloats<C>(smem.beta);
  constexpr int items = A::ownRows * A::tokens / 2;
  #pragma unroll
  for (int item = l; item < items; item += kWarpSize) {
    const int r = tile<C>() * kMTileRows + part<C>() * A::ownRows + item / (A::tokens / 2), t = item % (A::tokens / 2) * 2;
    float p0[A::P], p1[A::P];
    #pragma unroll
    for (int j = 0; j < A::P; ++j) {
      p0[j] = probs[(r * A::tokens + t) * A::P + j];
      p1[j] = probs[(r * A::tokens + t + 1) * A::P + j];
    }
    const float* weights = beta + kvHeadOf<C>(r) * A::Gp * A::P;
    #pragma unroll
    for (int m = 0; m < A::Gp; ++m) {
      float x0 = 0.0f, x1 = 0.0f;
      #pragma unroll
      for (int j = 0; j < A::P; ++j) {
        const float w = weights[m * A::P + j];
        x0 = fmaf(p0[j], w, x0);
        x1 = fmaf(p1[j], w, x1);
      }
      *reinterpret_cast<Bits32*>(pTile + r * A::pPitch + m * A::tokens + t) = cuda::pack<C>(x0, x1);
    }
  }
  __syncthreads();  // P' and the row maxima of both warps of the m-tile
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float newMax = rowMax[tile<C>() * kMTileRows + l / 4 + 8 * h], outMax = state.outMax[h];
    const float base = Masked && newMax == cuda::negativeInfinity() ? 0.0f : newMax;
    state.outMax[h] = newMax;
    scaleOutputRow<C>(acc, h, ptx::exp2Ftz(outMax - base));
  }
}

// acc += P' V over the block's raw value rows (k = m * tokens + t).
template <class C>
__device__ void mmaPv(AccTile<C, true>& acc, KvPipeline<C, true>& pipe) {
  using A = Geometry<C>;
  const int l = cuda::lane();
  const Bits32 pLane = cuda::sharedAddress(sharedTile<C>(layout<C>().pTile) +
                                           (tile<C>() * kMTileRows + fragment::aRow(l)) * A::pPitch + fragment::aColumn(l));
  #pragma unroll
  for (int kk = 0; kk < A::Gp / 2; ++kk) {
    Bits32 p[4];
    cuda::ldmatrixX4(p, pLane + Bits32(kk * kMmaK * kTileElementBytes));
    #pragma unroll
    for (int pair = 0; pair < A::OT / 2; ++pair) {
      Bits32 v[4];
      cuda::ldmatrixX4Trans(v, pipe.valueLane + tileOffset<C>(kk * kMmaK, pair * 16));
      cuda::mma16816<C>(acc.o[2 * pair], p, v[0], v[1]);
      cuda::mma16816<C>(acc.o[2 * pair + 1], p, v[2], v[3]);
    }
  }
}

template <class C>
__device__ void softmaxInit(SoftmaxState<C, true>& state, AccTile<C, true>& acc) {
  using A = Geometry<C>;
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    #pragma unroll
    for (int sm = 0; sm < A::SM; ++sm) {
      state.m[sm][h] = cuda::negativeInfinity();
      state.l[sm][h] = 0.0f;
    }
    state.outMax[h] = cuda::negativeInfinity();
    state.outSum[h] = 0.0f;
  }
  #pragma unroll
  for (int ot = 0; ot < A::OT; ++ot)
    #pragma unroll
    for (int e = 0; e < 4; ++e) acc.o[ot][e] = 0.0f;
}

// Each query row's denominator: the thread's shares over the quad and the
// row's P S rows, handed to the warps holding its output through shared
// memory with its max.
template <class C>
__device__ void normalize(SoftmaxState<C, true>& state, AccTile<C, true>& acc) {
  using A = Geometry<C>;
  const AbsorbedSmem smem = layout<C>();
  float* rowMax = sharedFloats<C>(smem.rowMax);
  float* rowSum = sharedFloats<C>(smem.rowSum);
  const int l = cuda::lane();
  #pragma unroll
  for (int sm = 0; sm < A::SM; ++sm)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int sRow = sRowOf<C>(sm, h);
      const float sum = groupSum(cuda::quadSum(state.l[sm][h]), A::Pg);
      if (l % 4 == 0 && sRow % A::Pg == 0) {
        rowSum[sRow / A::Pg] = sum;
        rowMax[sRow / A::Pg] = state.m[sm][h];
      }
    }
  __syncthreads();
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = tile<C>() * kMTileRows + l / 4 + 8 * h;
    state.outSum[h] = rowSum[r];
    state.outMax[h] = rowMax[r];
    scaleOutputRow<C>(acc, h, state.outSum[h] > 0.0f ? 1.0f / state.outSum[h] : 0.0f);
  }
}

// f(query row r, its CtaRow, fragment half h, first output column of n-tile
// ot) over the thread's output.
template <class C, class F>
__device__ __forceinline__ void forEachOutput(F&& f) {
  using A = Geometry<C>;
  const int l = cuda::lane();
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = tile<C>() * kMTileRows + l / 4 + 8 * h;
    f(r, ctaRow<C>(r), h, (part<C>() * A::OT) * 8 + (l % 4) * 2);
  }
}

template <class C>
__device__ void storeSplit(AccTile<C, true>& acc, SoftmaxState<C, true>& state, const IhaArgs& a, int64_t row0,
                           int64_t head, int64_t b, int64_t split) {
  using A = Geometry<C>;
  const int64_t L = seq_len<C>(a);
  forEachOutput<C>([&](int, CtaRow t, int h, int column) {
    const int64_t i = cuda::storedRow<C>(a, row0, b) + t.row;
    if (!t.owned || i >= L) return;
    float* row = split_row<C>(a, b, head + t.head, split, i);
    #pragma unroll
    for (int ot = 0; ot < A::OT; ++ot) {
      row[column + ot * 8] = acc.o[ot][2 * h];
      row[column + ot * 8 + 1] = acc.o[ot][2 * h + 1];
    }
    if (cuda::lane() % 4 == 0 && part<C>() == 0) row[C::head_dim] = cuda::splitLse(state.outMax[h], state.outSum[h]);
  });
}

template <class C>
__device__ void storeRows(AccTile<C, true>& acc, SoftmaxState<C, true>& state, const IhaArgs& a, int64_t row0,
                          int64_t head, int64_t b) {
  using A = Geometry<C>;
  const int64_t L = seq_len<C>(a);
  Bits16* o = static_cast<Bits16*>(a.o_pseudo);
  forEachOutput<C>([&](int, CtaRow t, int h, int column) {
    const int64_t i = cuda::storedRow<C>(a, row0, b) + t.row;
    if (!t.owned || i >= L) return;
    const int64_t rowIndex = (b * C::heads + head + t.head) * L + i;
    #pragma unroll
    for (int ot = 0; ot < A::OT; ++ot)
      *reinterpret_cast<Bits32*>(o + rowIndex * A::D + column + ot * 8) =
          cuda::pack<C>(acc.o[ot][2 * h], acc.o[ot][2 * h + 1]);
    if (a.lse && cuda::lane() % 4 == 0 && part<C>() == 0)
      a.lse[rowIndex] = kLn2 * (state.outMax[h] + log2f(state.outSum[h]));
  });
}

}  // namespace absorbed

// The tile API's calls on the absorbed tiles (the others are cuda.h's).
template <class C, bool Mixed>
__device__ void q_begin(QTile<C, true>& q, const IhaArgs& a, int64_t row0, int64_t head, int64_t b) {
  absorbed::qBegin<C>(q, a, row0, head, b);
}
template <class C, bool Mixed>
__device__ void q_wait(QTile<C, true>&, const IhaArgs&, int64_t, int64_t, int64_t) {}
template <class C>
__device__ void softmax_init(SoftmaxState<C, true>& state, AccTile<C, true>& acc) {
  absorbed::softmaxInit<C>(state, acc);
}
template <class C, bool Mixed>
__device__ void kv_begin(KvPipeline<C, true>& pipe, const IhaArgs& a, int64_t, int64_t b, int64_t lower, int64_t upper) {
  absorbed::kvBegin<C>(pipe, a, b, lower, upper);
}
template <class C, bool Mixed>
__device__ void kv_produce(KvPipeline<C, true>& pipe, const IhaArgs& a, int64_t, int64_t b, int64_t block,
                           int64_t upper) {
  if (block < upper) absorbed::issue<C>(pipe, a, b, block);
  cuda::commitCopies();
}
template <class C, bool Mixed>
__device__ void kv_wait(KvPipeline<C, true>& pipe, const IhaArgs& a, int64_t, int64_t b, int64_t block) {
  absorbed::kvWait<C>(pipe, a, b, block);
}
template <class C>
__device__ __forceinline__ void kv_release(KvPipeline<C, true>&, int64_t) {
  __syncthreads();  // the stage, P' and the row maxima are the next block's
}
template <class C>
__device__ void mma_qk(ScoreTile<C, true>& s, QTile<C, true>& q, KvPipeline<C, true>& pipe, int64_t) {
  absorbed::mmaQk<C>(s, q, pipe);
}
template <class C>
__device__ void mask_scores(ScoreTile<C, true>& s, const IhaArgs& a, int64_t row0, int64_t block) {
  absorbed::maskScores<C>(s, a, row0, block);
}
template <class C, bool Masked = true>
__device__ void softmax_update(SoftmaxState<C, true>& state, ScoreTile<C, true>& s, AccTile<C, true>& acc) {
  absorbed::softmaxUpdate<C, Masked>(state, s, acc);
}
template <class C>
__device__ void mma_pv(AccTile<C, true>& acc, ScoreTile<C, true>&, KvPipeline<C, true>& pipe, int64_t) {
  absorbed::mmaPv<C>(acc, pipe);
}
template <class C>
__device__ void normalize(SoftmaxState<C, true>& state, AccTile<C, true>& acc) {
  absorbed::normalize<C>(state, acc);
}
template <class C>
__device__ void store_split(AccTile<C, true>& acc, SoftmaxState<C, true>& state, const IhaArgs& a, int64_t row0,
                            int64_t head, int64_t b, int64_t split) {
  absorbed::storeSplit<C>(acc, state, a, row0, head, b, split);
}
template <class C>
__device__ void store_rows(AccTile<C, true>& acc, SoftmaxState<C, true>& state, const IhaArgs& a, int64_t row0,
                           int64_t head, int64_t b) {
  absorbed::storeRows<C>(acc, state, a, row0, head, b);
}

}  // namespace loom
