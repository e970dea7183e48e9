// The tensor-mixing decode step over a raw paged cache (mma.sync, sm_80 and
// later): a config with `tensor_mixing` runs the same program as any decode
// step, and cuda.h hands each call to this file.
//
// For P above 4 the absorbed step (cuda_absorbed.h) multiplies H P^2 G d
// a cached token, P times the attention; the mixing step mixes on the FMA
// units once a head. This step mixes each cached token's rows once, on the
// tensor cores, and keeps the mixed rows in registers as the next
// product's operand, and folds the values' mix into the probabilities as
// the absorbed step does (P times the mix, then times the raw value rows):
//   K~(g, j) = sum_m alpha_k[m, g, j] R(tP) x_m(t), then R(j) and qk_norm,
//   sum_j p(t, j) V~(g, j) = sum_m P'(t, m) v_m(t),
//   P'(t, m) = sum_j p(t, j) alpha_v[m, g, j].
// One CTA holds a token of every query head (up to 16: layout.h,
// stepHeads), two heads a warp, eight rows
// each (a token's P, or whole tokens of them: cta_rows): the warp's 16-row
// m-tile is heads 2w (rows lane/4) and 2w + 1 (rows lane/4 + 8). Per cached
// token t, a warp
// - mixes its heads' 16 key rows (h, j) over d: the weights (16 x 16 a
//   k-step of G) are the A operand, the token's raw rows X (G x d, staged
//   rotated by R(tP)) the B operand by ldmatrix.trans. The weights are
//   f32: in bf16 each is split into two halves, hi + lo, and both multiply
//   the same X (the mix keeps about 16 bits of each weight where one bf16
//   weight keeps 8; dropping lo raised drawn P 8 steps' error by up to
//   40%); f16's 11 bits take one;
// - turns each mixed row by R(j), j = lane/4 for both heads (its columns
//   c and c + d/2 in one thread), packs it to 16 bits: the accumulators'
//   layout is the B operand of S = Q K~^T as it stands (key j = lane/4,
//   columns 2 (lane % 4) ...), one n-tile a head;
// - S: Q (the 16 rows) times head 2w's keys gives the rows of head 2w
//   (rows lane/4), times head 2w + 1's the rows lane/4 + 8: half of each
//   product is another head's, never used;
// - the values: P' of each token = P beta, k the warp's two heads' keys j
//   (A: head 2w's probabilities in k 0-7 of its rows, head 2w + 1's in k
//   8-15 of its own, zeros elsewhere; B: each head's weights, n the kv
//   heads m), whose accumulators are the A operand of P' V (k the m, the
//   token's raw value rows by ldmatrix.trans) as they stand once packed:
//   one output accumulator holds both heads' rows, no value row is mixed.
//   A token costs G d multiply-adds a row here where mixing its values
//   cost twice that (bf16's two halves) and P V~ as much again.
// Where the warp's two heads read one kv head (H / G even: layout.h,
// tensorMixingPairs) their keys are one set: the warp mixes two tokens at
// a pass instead, the first's keys in rows lane/4 and the next's in
// lane/4 + 8 (the weights block-diagonal over the staged rows (m, t)), each
// score product whole, P' and P' V over both tokens at once.
// A warp owns whole query rows: the softmax needs no other warp. Key blocks
// of kTensorMixingTokens tokens, staged as the absorbed step stages its own
// (rows (m, t); issue / stageAngles / rotateStage). Keys past P (P < 8)
// score -inf.
#pragma once

namespace loom {
namespace tmix {

template <class C>
struct Geometry {
  using S = absorbed::Geometry<C>;  // the stages
  static constexpr int P = C::pseudo_heads, G = C::kv_heads, Gp = S::Gp, D = C::head_dim, pitch = S::pitch;
  static constexpr int tokens = kTensorMixingTokens;
  static constexpr int KT = D / kMmaK;        // k-steps of S (d)
  static constexpr int NT = D / 8;            // n-tiles of the mixed keys and of the output (d)
  // Tokens a pass: two where the warp's two heads read one kv head
  // (layout.h, tensorMixingPairs), which it then mixes together.
  static constexpr int passTokens = tensorMixingPassTokens(C::heads, C::kv_heads);
  static constexpr bool paired = passTokens == 2;
  // k-steps of the mix and of P' V: G's (two where G is over 16: H over 16),
  // or, paired, the stage's rows (m, t) of both tokens
  static constexpr int KM = tensorMixingKSteps(C::heads, C::kv_heads);
  // A pass's staged rows fit 8 (tensorMixingNarrow): the mix and P' V are
  // m16n8k8 (A's k 0-7, B's first matrix of each ldmatrix pair), P' one
  // n-tile.
  static constexpr bool narrow = tensorMixingNarrow(C::heads, C::kv_heads);
  static constexpr int foldTiles = narrow ? 1 : 2;  // n-tiles of P' a k-step
  // A block's mixes of the keys and of P': a token each, or, paired, two
  // tokens each (2 t and 2 t + 1 in pass t).
  static constexpr int passes = tokens / passTokens;
  // The first token of pass t.
  static constexpr int firstToken(int t) { return passTokens * t; }
  static constexpr bool rope = C::rope_theta > 0;
  // bf16 weights keep 8 bits: each is split into a hi and a lo half. f16's
  // 11 bits leave the output as f32 weights do (drawn P 8 steps on the
  // emulator: the same relative error to 2 digits), so f16 takes one.
  static constexpr bool split = C::dtype == DType::bf16;
  static constexpr int groups = rope ? KT / 2 : KT;  // k-steps mixed together: one and its partner d/2 on
  static constexpr int span = rope ? KT / 2 : 0;     // the partner's distance in k-steps
  static constexpr int threads = C::warps * kWarpSize;
  static_assert(C::block_n == tokens * P, "a key block is kTensorMixingTokens whole tokens");
  static_assert(C::stacked_heads == oneCtaHeads(true, C::heads, C::kv_heads, P, D),
                "a tensor-mixing CTA holds a token of every query head (stepHeads of them)");
  static_assert(C::warps == tensorMixingWarps(C::stacked_heads) && C::block_m == tensorMixingBlockM(C::stacked_heads),
                "a warp holds two heads' eight rows");
  static_assert(tensorMixingShapeProblem(C::stacked_heads, C::head_dim, C::pseudo_heads, rope) == nullptr,
                "no tensor-mixing step for this shape");
};

template <class C>
__device__ __forceinline__ AbsorbedSmem layout() {
  return absorbed::layout<C>();
}
// The query head of this thread's fragment half h (rows lane/4 + 8 h),
// counted from the CTA's first.
__device__ __forceinline__ int headOf(int h) { return 2 * cuda::warp() + h; }
// Its kv head, counted from the CTA's first (0 past the heads: their
// weights are zeros).
template <class C>
__device__ __forceinline__ int kvHeadOf(int head) {
  return head < C::stacked_heads ? head / (C::heads / C::kv_heads) : 0;
}
// Tile row r (16 a warp, 8 a head) as the CTA's row: head r / 8, row r % 8.
template <class C>
__device__ __forceinline__ CtaRow placeOf(int r) {
  const int head = r / kTensorMixingRows, row = r % kTensorMixingRows;
  return {head, row, head < C::stacked_heads && row < C::cta_rows};
}

}  // namespace tmix

template <class C>
struct QTile<C, kTensorMixingStep> {
  Bits32 lane;  // this lane's ldmatrix address of the warp's 16 query rows (k-step 0), read at every token
};

template <class C>
struct KvPipeline<C, kTensorMixingStep> {
  Bits32 keyLane[tmix::Geometry<C>::KM];    // ldmatrix.trans addresses of token 0's raw key rows (B of the mix)
  Bits32 valueLane[tmix::Geometry<C>::KM];  // and of its raw value rows (B of P' V)
  FastDivider pages;
  int32_t tokensEnd;  // the sequence's tokens once the step's are cached (absorbed::kvBegin)
};

template <class C>
struct ScoreTile<C, kTensorMixingStep> {
  float s[tmix::Geometry<C>::tokens][4];  // rows lane/4 (head 2w), lane/4 + 8 (2w + 1) x keys (t, 2 (lane % 4) ...)
  Bits32 p[tmix::Geometry<C>::tokens][2];  // the probabilities packed: P V's A operand
};

template <class C>
struct SoftmaxState<C, kTensorMixingStep> {
  float m[2];  // running max (log2 domain) of rows lane/4 and lane/4 + 8
  float l[2];  // the thread's share of their denominators
};

template <class C>
struct AccTile<C, kTensorMixingStep> {
  float o[tmix::Geometry<C>::NT][4];
};

namespace tmix {

// A weight as two 16-bit halves: hi its rounding, lo the rounding of the rest.
template <class C>
__device__ __forceinline__ void splitPair(float w0, float w1, Bits32& hi, Bits32& lo) {
  const float h0 = cuda::toFloat<C>(cuda::toBits<C>(w0)), h1 = cuda::toFloat<C>(cuda::toBits<C>(w1));
  hi = cuda::pack<C>(h0, h1);
  lo = cuda::pack<C>(w0 - h0, w1 - h1);
}

// Prologue: R(j)'s angles, then the warp's query rows, mixed (normalised,
// qk_norm) and rotated by their own position, into shared memory, where
// each token's scores read them (registers hold a token's mixed rows).
template <class C>
__device__ void qBegin(QTile<C, kTensorMixingStep>& q, const IhaArgs& a, int64_t row0, int64_t head0, int64_t b) {
  using T = Geometry<C>;
  const AbsorbedSmem s = layout<C>();
  if constexpr (T::rope) {
    constexpr int half = T::D / 2;
    float* turns = absorbed::sharedFloats<C>(s.turns);
    for (int index = threadIdx.x; index < kTensorMixingRows * half; index += T::threads) {
      const int j = index / half, c = index % half;
      float sine, cosine;
      cuda::ropeSinCos<C>(j, c, &sine, &cosine);
      turns[j * T::D + c] = cosine;
      turns[j * T::D + half + c] = C::rope_negative ? -sine : sine;
    }
  }
  Bits16* qTile = absorbed::sharedTile<C>(s.q);
  absorbed::forEachQueryRow<C, C::warps * kMTileRows>(
      a, row0, head0, b, [](int r) { return placeOf<C>(r); },
      [&](int r, int64_t i, bool valid, int lo, const float (&x)[kChunkElements], const float (&y)[kChunkElements]) {
        Bits16* row = qTile + r * T::pitch;
        if constexpr (T::rope) {
          float u[kChunkElements], w[kChunkElements];
          #pragma unroll
          for (int e = 0; e < kChunkElements; ++e) {
            u[e] = x[e];
            w[e] = y[e];
          }
          if (valid) cuda::rotatePair<C>(u, w, i, lo);
          cuda::storeChunk<C>(row + lo, u);
          cuda::storeChunk<C>(row + lo + T::D / 2, w);
        } else {
          cuda::storeChunk<C>(row + lo, x);
        }
      });
  __syncthreads();
  const int l = cuda::lane();
  q.lane = cuda::sharedAddress(qTile + (cuda::warp() * kMTileRows + fragment::aRow(l)) * T::pitch + fragment::aColumn(l));
}

// Vector v of this lane's weight fragments of k-step km (layout.h,
// AbsorbedSmem::weights): consecutive lanes, consecutive 16 bytes.
template <class C>
__device__ __forceinline__ uint4* weightVector(int km, int v) {
  return reinterpret_cast<uint4*>(cuda::smem() + layout<C>().weights) +
         ((km * 4 + v) * C::warps + cuda::warp()) * kWarpSize + cuda::lane();
}

// The stages' padding rows, the first blocks' copies, and the weights of
// the warp's rows, each split in two halves, as its lanes' fragments.
template <class C>
__device__ void kvBegin(KvPipeline<C, kTensorMixingStep>& pipe, const IhaArgs& a, int64_t kvHead, int64_t b,
                        int64_t lower, int64_t upper) {
  using T = Geometry<C>;
  absorbed::kvBegin<C>(pipe, a, b, lower, upper);
  const int l = cuda::lane(), j = l / 4, kv0 = int(kvHead);  // the kv head of the CTA's first query head
  // alpha[m, g, j] of row j of head h (zeros past the heads and G).
  auto weight = [&](const float* alpha, int h, int m, int row) {
    const int head = headOf(h);
    return head < C::stacked_heads && m < T::G ? alpha[(m * T::G + kv0 + kvHeadOf<C>(head)) * T::P + row] : 0.0f;
  };
  // The keys' rows past P are zeros. The values' weights of keys past P
  // are key P - 1's, never used (those keys' probabilities are zeros):
  // zeroing them compared 2 (lane % 4) + e with P as softmaxUpdate does,
  // the loop's compare was then taken from the prologue's, and ptxas
  // spilled (255 registers at H 8 G 4 P 5 without RoPE, where it takes 128).
  auto keyWeight = [&](int h, int m) { return j < T::P ? weight(a.alpha_k, h, m, j) : 0.0f; };
  auto valueWeight = [&](int h, int m, int key) { return weight(a.alpha_v, h, m, key < T::P ? key : T::P - 1); };
  #pragma unroll
  for (int km = 0; km < T::KM; ++km) {
    const int m = km * 16 + 2 * (l % 4);
    Bits32 words[4][4];
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
      if constexpr (T::paired) {
        // A: rows lane/4 (token 0's keys), lane/4 + 8 (token 1's); columns
        // m, m + 1 (then 8 on) are the staged rows (kv head m / 2, token
        // 0), (m / 2, token 1): a row's weight where the column's token is its own.
        const int token = r % 2;
        const float w = keyWeight(0, (m + 8 * (r / 2)) / 2);
        splitPair<C>(token == 0 ? w : 0.0f, token == 1 ? w : 0.0f, words[0][r], words[1][r]);
      } else {
        // A: rows lane/4 (h 0), lane/4 + 8 (h 1); columns m, m + 1, then 8 on.
        const int h = r % 2, column = m + 8 * (r / 2);
        splitPair<C>(keyWeight(h, column), keyWeight(h, column + 1), words[0][r], words[1][r]);
      }
    }
    // B of P' = P beta, n-tile r of the k-step: k = (head h, key j), j = 2
    // (lane % 4), + 1 (h 0; h 1 8 on), n = kv head 16 km + 8 r + lane/4;
    // paired, k = (token h, key j), n = the staged row 16 km + 8 r + lane/4
    // (kv head n / 2, token n % 2), zero where the tokens differ.
    #pragma unroll
    for (int r = 0; r < 2; ++r)
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int source = km * 16 + 8 * r + j, key = 2 * (l % 4);
        if constexpr (T::paired) {
          const bool own = source % 2 == h;
          splitPair<C>(own ? valueWeight(0, source / 2, key) : 0.0f, own ? valueWeight(0, source / 2, key + 1) : 0.0f,
                       words[2][2 * r + h], words[3][2 * r + h]);
        } else {
          splitPair<C>(valueWeight(h, source, key), valueWeight(h, source, key + 1), words[2][2 * r + h],
                       words[3][2 * r + h]);
        }
      }
    #pragma unroll
    for (int v = 0; v < 4; ++v)
      *weightVector<C>(km, v) = uint4{words[v][0], words[v][1], words[v][2], words[v][3]};
  }
}

// Lane's key weights of k-step km of the mix (the A operand, hi and lo).
template <class C>
__device__ __forceinline__ void keyWeights(int km, Bits32 (&hi)[4], Bits32 (&lo)[4]) {
  const uint4 h = *weightVector<C>(km, 0), o = *weightVector<C>(km, 1);
  hi[0] = h.x, hi[1] = h.y, hi[2] = h.z, hi[3] = h.w;
  lo[0] = o.x, lo[1] = o.y, lo[2] = o.z, lo[3] = o.w;
}
// Its value weights of n-tiles 2 km, 2 km + 1 of P' (the B operand, hi and lo).
template <class C>
__device__ __forceinline__ void valueWeights(int km, Bits32 (&hi)[2][2], Bits32 (&lo)[2][2]) {
  const uint4 h = *weightVector<C>(km, 2), o = *weightVector<C>(km, 3);
  hi[0][0] = h.x, hi[0][1] = h.y, hi[1][0] = h.z, hi[1][1] = h.w;
  lo[0][0] = o.x, lo[0][1] = o.y, lo[1][0] = o.z, lo[1][1] = o.w;
}

template <class C>
__device__ void kvWait(KvPipeline<C, kTensorMixingStep>& pipe, const IhaArgs& a, int64_t b, int64_t block) {
  using T = Geometry<C>;
  if constexpr (C::stages == 1) {
    absorbed::issue<C>(pipe, a, b, block);
    cuda::commitCopies();
  }
  if constexpr (T::rope) absorbed::stageAngles<C>(block);
  cuda::waitCopies<C::stages - 1>();
  __syncthreads();
  if constexpr (T::rope) {
    absorbed::rotateStage<C>(block);
    __syncthreads();
  }
  const AbsorbedSmem s = layout<C>();
  const int stage = int(block) % C::stages, l = cuda::lane();
  const Bits16* key = absorbed::sharedTile<C>(s.k) + stage * T::S::stageRows * T::pitch;
  const Bits16* value = absorbed::sharedTile<C>(s.v) + stage * T::S::stageRows * T::pitch;
  #pragma unroll
  for (int km = 0; km < T::KM; ++km) {
    // Rows past the staged heads repeat the last: their weights are zeros.
    // A k-step's row r is kv head r's row of token 0, or, paired, kv head
    // r / 2's of token r % 2 (mixKeys and mmaPv add the token, or the
    // pass's first).
    const int row = km * 16 + fragment::bTransRow(l), head = row / T::passTokens;
    const int staged = (head < T::Gp ? head : T::Gp - 1) * T::tokens + row % T::passTokens;
    pipe.keyLane[km] = cuda::sharedAddress(key + staged * T::pitch + fragment::bTransColumn(l));
    pipe.valueLane[km] = cuda::sharedAddress(value + staged * T::pitch + fragment::bTransColumn(l));
  }
}

// d += a b over a pass's staged rows: m16n8k16 (b0, b1 its k 0-7 and
// 8-15), or where they fit 8 (narrow) m16n8k8 over a's k 0-7 and b0.
template <class C>
__device__ __forceinline__ void mmaStaged(float (&d)[4], const Bits32 (&a)[4], Bits32 b0, Bits32 b1) {
  if constexpr (Geometry<C>::narrow) cuda::mma1688<C>(d, a[0], a[1], b0);
  else cuda::mma16816<C>(d, a, b0, b1);
}

// The mixed keys of k-step kt of token t (two n-tiles, the warp's 16 rows;
// paired, t is a pass's first token: rows lane/4 its keys, lane/4 + 8 the
// next token's).
template <class C>
__device__ __forceinline__ void mixKeys(float (&c)[2][4], const KvPipeline<C, kTensorMixingStep>& pipe,
                                        const Bits32 (&hi)[Geometry<C>::KM][4], const Bits32 (&lo)[Geometry<C>::KM][4],
                                        int t, int kt) {
  using T = Geometry<C>;
  #pragma unroll
  for (int e = 0; e < 4; ++e) c[0][e] = c[1][e] = 0.0f;
  #pragma unroll
  for (int km = 0; km < T::KM; ++km) {
    Bits32 x[4];
    cuda::ldmatrixX4Trans(x, pipe.keyLane[km] + Bits32((t * T::pitch + kt * kMmaK) * kTileElementBytes));
    mmaStaged<C>(c[0], hi[km], x[0], x[1]);
    mmaStaged<C>(c[1], hi[km], x[2], x[3]);
    if constexpr (T::split) {
      mmaStaged<C>(c[0], lo[km], x[0], x[1]);
      mmaStaged<C>(c[1], lo[km], x[2], x[3]);
    }
  }
}

// S of token t's mixed keys of k-step kt: head 2w's (rows lane/4 of c)
// into s0, head 2w + 1's into s1; paired, token 0's (rows lane/4 of c) into
// s0 and token 1's into s1, each product whole.
template <class C>
__device__ __forceinline__ void scoreKeys(float (&s0)[4], float (&s1)[4], const QTile<C, kTensorMixingStep>& q,
                                          const float (&c)[2][4], int kt) {
  Bits32 a[4];
  cuda::ldmatrixX4(a, q.lane + Bits32(kt * kMmaK * kTileElementBytes));
  cuda::mma16816<C>(s0, a, cuda::pack<C>(c[0][0], c[0][1]), cuda::pack<C>(c[1][0], c[1][1]));
  cuda::mma16816<C>(s1, a, cuda::pack<C>(c[0][2], c[0][3]), cuda::pack<C>(c[1][2], c[1][3]));
}

// Each token of the block (paired, both at once): its keys mixed, turned
// by R(j), scored.
template <class C>
__device__ void mmaQk(ScoreTile<C, kTensorMixingStep>& s, QTile<C, kTensorMixingStep>& q,
                      KvPipeline<C, kTensorMixingStep>& pipe) {
  using T = Geometry<C>;
  const int l = cuda::lane();
  const float* turns = absorbed::sharedFloats<C>(layout<C>().turns) + (l / 4) * T::D + 2 * (l % 4);
  Bits32 hi[T::KM][4], lo[T::KM][4];
  #pragma unroll
  for (int km = 0; km < T::KM; ++km) keyWeights<C>(km, hi[km], lo[km]);
  #pragma unroll
  for (int t = 0; t < T::passes; ++t) {
    float s0[4] = {}, s1[4] = {};
    float squares[2] = {};  // qk_norm: rows lane/4 of each head (token), the thread's columns
    #pragma unroll
    for (int group = 0; group < T::groups; ++group) {
      float c[2][4], partner[2][4];
      mixKeys<C>(c, pipe, hi, lo, T::firstToken(t), group);
      if constexpr (T::rope) mixKeys<C>(partner, pipe, hi, lo, T::firstToken(t), group + T::span);
      if constexpr (C::qk_norm)
        #pragma unroll
        for (int n = 0; n < 2; ++n)
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            squares[e / 2] = fmaf(c[n][e], c[n][e], squares[e / 2]);
            if constexpr (T::rope) squares[e / 2] = fmaf(partner[n][e], partner[n][e], squares[e / 2]);
          }
      if constexpr (T::rope) {  // R(j): columns 16 group + 8 n + 2 (lane % 4) + e % 2 and d/2 on
        #pragma unroll
        for (int n = 0; n < 2; ++n) {
          const float2 cosine = *reinterpret_cast<const float2*>(turns + group * kMmaK + 8 * n);
          const float2 sine = *reinterpret_cast<const float2*>(turns + T::D / 2 + group * kMmaK + 8 * n);
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float cs = e % 2 ? cosine.y : cosine.x, sn = e % 2 ? sine.y : sine.x;
            const float x = c[n][e], y = partner[n][e];
            c[n][e] = x * cs - y * sn;
            partner[n][e] = x * sn + y * cs;
          }
        }
        scoreKeys<C>(s0, s1, q, partner, group + T::span);
      }
      scoreKeys<C>(s0, s1, q, c, group);
    }
    if constexpr (C::qk_norm) {
      // 1 / rms of key row j = lane/4 of each head; column e of a thread's
      // scores is key 2 (lane % 4) + e, whose norm lane 4 (2 (lane % 4) + e) holds.
      float factor[2];
      #pragma unroll
      for (int h = 0; h < 2; ++h) factor[h] = rsqrtf(cuda::quadSum(squares[h]) * (1.0f / T::D) + C::qk_norm_eps);
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int source = 4 * (2 * (l % 4) + e);
        const float f0 = __shfl_sync(0xffffffffu, factor[0], source), f1 = __shfl_sync(0xffffffffu, factor[1], source);
        s0[e] *= f0;
        s1[2 + e] *= f1;
        if constexpr (T::paired) {  // both heads' rows score each token's keys
          s0[2 + e] *= f0;
          s1[e] *= f1;
        }
      }
    }
    if constexpr (T::paired) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        s.s[T::firstToken(t)][e] = s0[e];
        s.s[T::firstToken(t) + 1][e] = s1[e];
      }
    } else {
      s.s[t][0] = s0[0];
      s.s[t][1] = s0[1];
      s.s[t][2] = s1[2];
      s.s[t][3] = s1[3];
    }
  }
}

// -inf where the mask forbids (query row, key t*P + j) or the token is past
// the sequence; both heads' rows lane/4 are the same row i.
template <class C>
__device__ void maskScores(ScoreTile<C, kTensorMixingStep>& s, const IhaArgs& a, int64_t row0, int64_t block) {
  using T = Geometry<C>;
  const int L = int(decode_len<C>(a, block_z(a))), l = cuda::lane();
  const int i = int(row0) + l / 4;
  const ColumnRange<int> range = allowedColumns<C, int>(i);
  const int hi = range.hi < L - 1 ? range.hi : L - 1;
  #pragma unroll
  for (int t = 0; t < T::tokens; ++t)
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = (int(block) * T::tokens + t) * T::P + fragment::accumulatorColumn(l, e);
      if (key > hi || (windowed<C>() && key < range.lo)) s.s[t][e] = cuda::negativeInfinity();
    }
}

template <class C, bool Masked>
__device__ void softmaxUpdate(SoftmaxState<C, kTensorMixingStep>& state, ScoreTile<C, kTensorMixingStep>& s,
                              AccTile<C, kTensorMixingStep>& acc) {
  using T = Geometry<C>;
  constexpr float scale = C::scale * kLog2e;
  const int l = cuda::lane();
  if constexpr (T::P < kTensorMixingRows) {  // keys j past P: no such key
    #pragma unroll
    for (int e = 0; e < 2; ++e)
      if (fragment::accumulatorColumn(l, e) >= T::P)
        #pragma unroll
        for (int t = 0; t < T::tokens; ++t) s.s[t][e] = s.s[t][2 + e] = cuda::negativeInfinity();
  }
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    float rowHigh = cuda::negativeInfinity();
    #pragma unroll
    for (int t = 0; t < T::tokens; ++t) rowHigh = fmaxf(rowHigh, fmaxf(s.s[t][2 * h], s.s[t][2 * h + 1]));
    const float newMax = fmaxf(state.m[h], cuda::quadMax(rowHigh) * scale);
    const float base = Masked && newMax == cuda::negativeInfinity() ? 0.0f : newMax;
    const float correction = ptx::exp2Ftz(state.m[h] - base);
    float sum = 0.0f;
    #pragma unroll
    for (int t = 0; t < T::tokens; ++t) {
      const float p0 = ptx::exp2Ftz(fmaf(s.s[t][2 * h], scale, -base));
      const float p1 = ptx::exp2Ftz(fmaf(s.s[t][2 * h + 1], scale, -base));
      sum += p0 + p1;
      s.p[t][h] = cuda::pack<C>(p0, p1);
    }
    state.l[h] = state.l[h] * correction + sum;
    state.m[h] = newMax;
    #pragma unroll
    for (int nt = 0; nt < T::NT; ++nt) {
      acc.o[nt][2 * h] *= correction;
      acc.o[nt][2 * h + 1] *= correction;
    }
  }
}

// acc += P' V a token at a time: P' = P beta on the tensor cores (both
// heads' rows in one product, k their keys), packed as the A operand of
// the token's raw value rows (ldmatrix.trans, k the kv heads m); paired,
// both tokens at once (k of P' both tokens' keys, of P' V their staged rows).
template <class C>
__device__ void mmaPv(AccTile<C, kTensorMixingStep>& acc, ScoreTile<C, kTensorMixingStep>& s,
                      KvPipeline<C, kTensorMixingStep>& pipe) {
  using T = Geometry<C>;
  Bits32 hi[T::KM][2][2], lo[T::KM][2][2];
  #pragma unroll
  for (int km = 0; km < T::KM; ++km) valueWeights<C>(km, hi[km], lo[km]);
  Bits32 a[T::passes][T::KM][4];  // each pass's P', packed: the A operand of P' V
  #pragma unroll
  for (int t = 0; t < T::passes; ++t) {
    // A: head 2w's rows of P in k 0-7, head 2w + 1's in k 8-15; paired,
    // the pass's first token's probabilities in k 0-7 of every row, the
    // next token's in 8-15.
    Bits32 probs[4] = {s.p[t][0], 0u, 0u, s.p[t][1]};
    if constexpr (T::paired) {  // the pass's tokens
      const int first = T::firstToken(t);
      probs[0] = s.p[first][0];
      probs[1] = s.p[first][1];
      probs[2] = s.p[first + 1][0];
      probs[3] = s.p[first + 1][1];
    }
    #pragma unroll
    for (int km = 0; km < T::KM; ++km) {
      float folded[2][4] = {};  // P' of kv heads 16 km + 8 r + 2 (lane % 4) ...
      #pragma unroll
      for (int r = 0; r < T::foldTiles; ++r) {
        cuda::mma16816<C>(folded[r], probs, hi[km][r][0], hi[km][r][1]);
        if constexpr (T::split) cuda::mma16816<C>(folded[r], probs, lo[km][r][0], lo[km][r][1]);
      }
      a[t][km][0] = cuda::pack<C>(folded[0][0], folded[0][1]);
      a[t][km][1] = cuda::pack<C>(folded[0][2], folded[0][3]);
      a[t][km][2] = cuda::pack<C>(folded[1][0], folded[1][1]);
      a[t][km][3] = cuda::pack<C>(folded[1][2], folded[1][3]);
    }
  }
  #pragma unroll
  for (int dn = 0; dn < T::D / kMmaK; ++dn)
    #pragma unroll
    for (int t = 0; t < T::passes; ++t)
      #pragma unroll
      for (int km = 0; km < T::KM; ++km) {
        Bits32 x[4];
        const int token = T::firstToken(t);
        cuda::ldmatrixX4Trans(x, pipe.valueLane[km] + Bits32((token * T::pitch + dn * kMmaK) * kTileElementBytes));
        mmaStaged<C>(acc.o[2 * dn], a[t][km], x[0], x[1]);  // narrow: P''s first n-tile
        mmaStaged<C>(acc.o[2 * dn + 1], a[t][km], x[2], x[3]);
      }
}

template <class C>
__device__ void softmaxInit(SoftmaxState<C, kTensorMixingStep>& state, AccTile<C, kTensorMixingStep>& acc) {
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    state.m[h] = cuda::negativeInfinity();
    state.l[h] = 0.0f;
  }
  #pragma unroll
  for (int nt = 0; nt < Geometry<C>::NT; ++nt)
    #pragma unroll
    for (int e = 0; e < 4; ++e) acc.o[nt][e] = 0.0f;
}

template <class C>
__device__ void normalize(SoftmaxState<C, kTensorMixingStep>& state, AccTile<C, kTensorMixingStep>& acc) {
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    state.l[h] = cuda::quadSum(state.l[h]);
    const float factor = state.l[h] > 0.0f ? 1.0f / state.l[h] : 0.0f;
    #pragma unroll
    for (int nt = 0; nt < Geometry<C>::NT; ++nt) {
      acc.o[nt][2 * h] *= factor;
      acc.o[nt][2 * h + 1] *= factor;
    }
  }
}

// f(CtaRow, fragment half h, first output column) over the thread's rows.
template <class C, class F>
__device__ __forceinline__ void forEachOutput(F&& f) {
  const int l = cuda::lane();
  #pragma unroll
  for (int h = 0; h < 2; ++h) f(placeOf<C>(cuda::warp() * kMTileRows + 8 * h + l / 4), h, 2 * (l % 4));
}

template <class C>
__device__ void storeSplit(AccTile<C, kTensorMixingStep>& acc, SoftmaxState<C, kTensorMixingStep>& state,
                           const IhaArgs& a, int64_t row0, int64_t head, int64_t b, int64_t split) {
  const int64_t L = seq_len<C>(a);
  forEachOutput<C>([&](CtaRow t, int h, int column) {
    const int64_t i = cuda::storedRow<C>(a, row0, b) + t.row;
    if (!t.owned || i >= L) return;
    float* row = split_row<C>(a, b, head + t.head, split, i);
    #pragma unroll
    for (int nt = 0; nt < Geometry<C>::NT; ++nt) {
      row[column + nt * 8] = acc.o[nt][2 * h];
      row[column + nt * 8 + 1] = acc.o[nt][2 * h + 1];
    }
    if (cuda::lane() % 4 == 0) row[C::head_dim] = cuda::splitLse(state.m[h], state.l[h]);
  });
}

template <class C>
__device__ void storeRows(AccTile<C, kTensorMixingStep>& acc, SoftmaxState<C, kTensorMixingStep>& state,
                          const IhaArgs& a, int64_t row0, int64_t head, int64_t b) {
  const int64_t L = seq_len<C>(a);
  Bits16* o = static_cast<Bits16*>(a.o_pseudo);
  forEachOutput<C>([&](CtaRow t, int h, int column) {
    const int64_t i = cuda::storedRow<C>(a, row0, b) + t.row;
    if (!t.owned || i >= L) return;
    const int64_t rowIndex = (b * C::heads + head + t.head) * L + i;
    #pragma unroll
    for (int nt = 0; nt < Geometry<C>::NT; ++nt)
      *reinterpret_cast<Bits32*>(o + rowIndex * C::head_dim + column + nt * 8) =
          cuda::pack<C>(acc.o[nt][2 * h], acc.o[nt][2 * h + 1]);
    if (a.lse && cuda::lane() % 4 == 0) a.lse[rowIndex] = kLn2 * (state.m[h] + log2f(state.l[h]));
  });
}

}  // namespace tmix

// The tile API's calls on the tensor-mixing tiles.
template <class C, bool Mixed>
__device__ void q_begin(QTile<C, kTensorMixingStep>& q, const IhaArgs& a, int64_t row0, int64_t head, int64_t b) {
  tmix::qBegin<C>(q, a, row0, head, b);
}
template <class C, bool Mixed>
__device__ void q_wait(QTile<C, kTensorMixingStep>&, const IhaArgs&, int64_t, int64_t, int64_t) {}
template <class C>
__device__ void softmax_init(SoftmaxState<C, kTensorMixingStep>& state, AccTile<C, kTensorMixingStep>& acc) {
  tmix::softmaxInit<C>(state, acc);
}
template <class C, bool Mixed>
__device__ void kv_begin(KvPipeline<C, kTensorMixingStep>& pipe, const IhaArgs& a, int64_t kvHead, int64_t b,
                         int64_t lower, int64_t upper) {
  tmix::kvBegin<C>(pipe, a, kvHead, b, lower, upper);
}
template <class C, bool Mixed>
__device__ void kv_produce(KvPipeline<C, kTensorMixingStep>& pipe, const IhaArgs& a, int64_t, int64_t b, int64_t block,
                           int64_t upper) {
  if (block < upper) absorbed::issue<C>(pipe, a, b, block);
  cuda::commitCopies();
}
template <class C, bool Mixed>
__device__ void kv_wait(KvPipeline<C, kTensorMixingStep>& pipe, const IhaArgs& a, int64_t, int64_t b, int64_t block) {
  tmix::kvWait<C>(pipe, a, b, block);
}
template <class C>
__device__ __forceinline__ void kv_release(KvPipeline<C, kTensorMixingStep>&, int64_t) {
  __syncthreads();  // the stage is the next block's copies'
}
template <class C>
__device__ void mma_qk(ScoreTile<C, kTensorMixingStep>& s, QTile<C, kTensorMixingStep>& q,
                       KvPipeline<C, kTensorMixingStep>& pipe, int64_t) {
  tmix::mmaQk<C>(s, q, pipe);
}
template <class C>
__device__ void mask_scores(ScoreTile<C, kTensorMixingStep>& s, const IhaArgs& a, int64_t row0, int64_t block) {
  tmix::maskScores<C>(s, a, row0, block);
}
template <class C, bool Masked = true>
__device__ void softmax_update(SoftmaxState<C, kTensorMixingStep>& state, ScoreTile<C, kTensorMixingStep>& s,
                               AccTile<C, kTensorMixingStep>& acc) {
  tmix::softmaxUpdate<C, Masked>(state, s, acc);
}
template <class C>
__device__ void mma_pv(AccTile<C, kTensorMixingStep>& acc, ScoreTile<C, kTensorMixingStep>& s,
                       KvPipeline<C, kTensorMixingStep>& pipe, int64_t) {
  tmix::mmaPv<C>(acc, s, pipe);
}
template <class C>
__device__ void normalize(SoftmaxState<C, kTensorMixingStep>& state, AccTile<C, kTensorMixingStep>& acc) {
  tmix::normalize<C>(state, acc);
}
template <class C>
__device__ void store_split(AccTile<C, kTensorMixingStep>& acc, SoftmaxState<C, kTensorMixingStep>& state,
                            const IhaArgs& a, int64_t row0, int64_t head, int64_t b, int64_t split) {
  tmix::storeSplit<C>(acc, state, a, row0, head, b, split);
}
template <class C>
__device__ void store_rows(AccTile<C, kTensorMixingStep>& acc, SoftmaxState<C, kTensorMixingStep>& state,
                           const IhaArgs& a, int64_t row0, int64_t head, int64_t b) {
  tmix::storeRows<C>(acc, state, a, row0, head, b);
}

}  // namespace loom
