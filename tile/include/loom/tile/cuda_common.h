// What both CUDA implementations of the tile API share (mma.sync in
// cuda.h, wgmma in hopper.h): element conversions, the mixing, qk_norm and
// rotary embedding arithmetic, shuffles, and the token-parallel pre-mix and
// collapse launches. NVRTC-only: no host header is included.
#pragma once

#include "loom/tile/common.h"
#include "loom/tile/layout.h"
#include "loom/tile/ptx.h"

#define LOOM_KERNEL extern "C" __global__

namespace loom {

constexpr int kWarpSize = 32;
constexpr int kQuadSize = 4;             // threads sharing one row of an mma fragment
constexpr int kChunkElements = 8;        // 16 bytes of 16-bit elements
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

namespace cuda {

__device__ __forceinline__ float negativeInfinity() { return __int_as_float(0xff800000u); }

using ptx::sharedAddress;

__device__ __forceinline__ int lane() { return threadIdx.x % kWarpSize; }
__device__ __forceinline__ int warp() { return threadIdx.x / kWarpSize; }

//===--- element conversions (PTX, so no cuda_fp16.h is needed) ----------===//

template <class C>
__device__ __forceinline__ float toFloat(Bits16 bits) {
  if constexpr (C::dtype == DType::f16) return ptx::halfToFloat(bits);
  else return __int_as_float(int(Bits32(bits) << 16));
}

template <class C>
__device__ __forceinline__ Bits16 toBits(float value) {
  if constexpr (C::dtype == DType::f16) return ptx::floatToHalf(value);
  else return ptx::floatToBfloat16(value);
}

// Two floats into one register: `low` in bits 0-15 (the lower column).
template <class C>
__device__ __forceinline__ Bits32 pack(float low, float high) {
  if constexpr (C::dtype == DType::f16) return ptx::packHalf2(low, high);
  else return ptx::packBfloat162(low, high);
}

template <class C>
__device__ __forceinline__ float loadElement(const void* base, int64_t index) {
  return toFloat<C>(static_cast<const Bits16*>(base)[index]);
}

__device__ __forceinline__ float quadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

//===--- mixing and rotary embedding --------------------------------------===//

// Rotary angle of pair j at virtual position `position`, reduced to whole
// turns without fp64: rope_turns[j] is the pair's frequency in turns per
// position as a 64-bit fixed-point fraction, so the integer product wraps at
// whole turns exactly and its top 32 bits are the angle's fraction of a turn
// in [-1/2, 1/2) (about 1e-7 rad from the exact angle at any position); the
// sine and cosine of that small angle in float.
//
// A rounded table (rope_table_dtype, as public training code builds it):
// the angle is float32(position) * inv_freq in float32, which differs from
// the exact one by delta = p (inv_freq - exact) - (p inv_freq - angle), the
// second term the float32 product's own rounding (one fma); the exact
// angle's cosine and sine turned by delta (small: no range reduction), then
// rounded to the table's dtype (bfloat16: to nearest even).
__device__ __forceinline__ float roundToBfloat16(float x) {
  unsigned bits = __float_as_uint(x);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return __uint_as_float(bits & 0xffff0000u);
}
template <class C>
__device__ __forceinline__ void ropeSinCos(int64_t position, int j, float* sine, float* cosine) {
  constexpr float kTwoPiOver2To32 = 6.2831853071795865f / 4294967296.0f;
  const unsigned long long turns = static_cast<unsigned long long>(position) * C::rope_turns[j];
  const float reduced = float(static_cast<int>(static_cast<unsigned>(turns >> 32))) * kTwoPiOver2To32;
  __sincosf(reduced, sine, cosine);  // |reduced| <= pi: the fast path is accurate to ~4e-7
  if constexpr (C::rope_table != 0) {
    const float p = float(position);
    const float angle = p * C::rope_inv_freq[j];
    const float residual = fmaf(p, C::rope_inv_freq[j], -angle);  // p inv_freq - angle, exactly
    const float delta = fmaf(p, C::rope_freq_error[j], -residual);
    float sd, cd;
    __sincosf(delta, &sd, &cd);
    const float c = *cosine * cd - *sine * sd, s = *sine * cd + *cosine * sd;
    *cosine = C::rope_table == 2 ? roundToBfloat16(c) : c;
    *sine = C::rope_table == 2 ? roundToBfloat16(s) : s;
  }
}

// Element `c` of a rotated row, given the element and its partner (c +- d/2);
// rope_direction negative turns by the opposite angle.
template <class C>
__device__ __forceinline__ float rotate(float x, float partner, int64_t position, int c) {
  constexpr int half = C::head_dim / 2;
  float sine, cosine;
  ropeSinCos<C>(position, c % half, &sine, &cosine);
  if constexpr (C::rope_negative) sine = -sine;
  return c < half ? x * cosine - partner * sine : partner * sine + x * cosine;
}

// Chunks `lo` (columns column..+7, below d/2) and `hi` (d/2 further) of one
// row, rotated together: each element's partner is the other chunk's, and
// the pair shares one angle (one sine and cosine for two elements).
// Element e of lo and hi turned by the angle of cosine[e], sine[e].
__device__ __forceinline__ void turnPair(float (&lo)[kChunkElements], float (&hi)[kChunkElements], int e, float cosine,
                                         float sine) {
  const float l = lo[e], h = hi[e];
  lo[e] = l * cosine - h * sine;
  hi[e] = l * sine + h * cosine;
}
template <class C>
__device__ __forceinline__ void rotatePair(float (&lo)[kChunkElements], float (&hi)[kChunkElements], int64_t position,
                                           int column) {
  #pragma unroll
  for (int e = 0; e < kChunkElements; ++e) {
    float sine, cosine;
    ropeSinCos<C>(position, column + e, &sine, &cosine);
    if constexpr (C::rope_negative) sine = -sine;
    turnPair(lo, hi, e, cosine, sine);
  }
}

template <class C, Role R>
struct RoleOf {
  static constexpr int heads = R == Role::query ? C::heads : C::kv_heads;
  static constexpr bool rotated = C::rope_theta > 0 && R != Role::value;
  __device__ static const void* source(const IhaArgs& a) { return R == Role::query ? a.q : R == Role::key ? a.k : a.v; }
  __device__ static const float* alpha(const IhaArgs& a) {
    return R == Role::query ? a.alpha_q : R == Role::key ? a.alpha_k : a.alpha_v;
  }
  __device__ static const int64_t* stride(const IhaArgs& a) {
    return R == Role::query ? a.q_stride : R == Role::key ? a.k_stride : a.v_stride;
  }
  __device__ static void* workspace(const IhaArgs& a) {
    return R == Role::query ? a.q_mixed : R == Role::key ? a.k_mixed : a.v_mixed;
  }
};

// sum_m alpha[m, h, p] * x[b, n, m, c] read from global memory.
template <class C, Role R>
__device__ float mixFromGlobal(const IhaArgs& a, int64_t b, int64_t n, int h, int p, int c) {
  using Role_ = RoleOf<C, R>;
  const int64_t* s = Role_::stride(a);
  const float* alpha = Role_::alpha(a);
  const void* x = Role_::source(a);
  float sum = 0.0f;
  for (int m = 0; m < Role_::heads; ++m)
    sum += alpha[(m * Role_::heads + h) * C::pseudo_heads + p] * loadElement<C>(x, token_offset<C>(a, s, b, n) + m * s[2] + c);
  return sum;
}

// Element c of virtual row n*P + p of head h: mixed and, for q and k, rotated.
// In a decode step token n of q, k, v is token cache_len[b] + n of its
// sequence, and turns as such.
template <class C, Role R>
__device__ float mixedElement(const IhaArgs& a, int64_t b, int64_t n, int h, int p, int c) {
  const float x = mixFromGlobal<C, R>(a, b, n, h, p, c);
  if constexpr (!RoleOf<C, R>::rotated) {
    return x;
  } else {
    constexpr int half = C::head_dim / 2;
    const float partner = mixFromGlobal<C, R>(a, b, n, h, p, c < half ? c + half : c - half);
    const int64_t token = C::decode ? a.cache_len[b] + n : n;
    return rotate<C>(x, partner, rope_position<C>(a, token * C::pseudo_heads + p), c);
  }
}

// sum += w * the 16-byte chunk at `chunk` (global or shared memory), one
// load, widened to f32.
template <class C>
__device__ __forceinline__ void accumulateWords(const uint4& raw, float w, float (&sum)[kChunkElements]) {
  const Bits32 words[4] = {raw.x, raw.y, raw.z, raw.w};
  #pragma unroll
  for (int e = 0; e < kChunkElements; ++e)
    sum[e] += w * toFloat<C>(Bits16(e % 2 ? words[e / 2] >> 16 : words[e / 2] & 0xffffu));
}
template <class C>
__device__ __forceinline__ void accumulateChunk(const Bits16* chunk, float w, float (&sum)[kChunkElements]) {
  accumulateWords<C>(*reinterpret_cast<const uint4*>(chunk), w, sum);
}

// Source heads whose chunks mixChunk loads before it uses any: four loads
// (and their weights) in flight where one was, for 20 registers more.
constexpr int kMixLoadsInFlight = 4;

// One 16-byte chunk (8 columns from `column`) of the mixed row n*P + p of
// head h: sum_m alpha[m, h, p] * x[b, n, m, column..]. The heads are taken
// kMixLoadsInFlight at a time (their loads issued before the first is
// used: one round trip a batch, not a head), the batches not unrolled, so
// the producer's few registers suffice. In a decode step n is the token's place in its sequence: keys
// and values come from its cache slot (the step's own tokens were appended
// before the attention launch), queries from the step's q, token
// n - cache_len[b].
template <class C, Role R>
__device__ __forceinline__ void mixChunk(const IhaArgs& a, int64_t b, int64_t n, int h, int p, int column,
                                         float (&sum)[kChunkElements]) {
  using Role_ = RoleOf<C, R>;
  const int64_t* stride = Role_::stride(a);
  const float* alpha = Role_::alpha(a);
  const Bits16* row;
  int64_t headStride;
  if constexpr (C::decode && R != Role::query) {
    row = static_cast<const Bits16*>(R == Role::key ? a.k_cache : a.v_cache) +
          cache_slot(a, b, n) * C::kv_heads * C::head_dim + column;
    headStride = C::head_dim;
  } else {
    const int64_t token = C::decode ? n - a.cache_len[b] : n;
    row = static_cast<const Bits16*>(Role_::source(a)) + token_offset<C>(a, stride, b, token) + column;
    headStride = stride[2];
  }
  #pragma unroll
  for (int e = 0; e < kChunkElements; ++e) sum[e] = 0.0f;
  constexpr int F = kMixLoadsInFlight, batched = Role_::heads / F * F;
  #pragma unroll 1
  for (int m0 = 0; m0 < batched; m0 += F) {
    uint4 raw[F];
    float w[F];
    #pragma unroll
    for (int f = 0; f < F; ++f) {
      raw[f] = *reinterpret_cast<const uint4*>(row + (m0 + f) * headStride);
      w[f] = alpha[((m0 + f) * Role_::heads + h) * C::pseudo_heads + p];
    }
    #pragma unroll
    for (int f = 0; f < F; ++f) accumulateWords<C>(raw[f], w[f], sum);
  }
  #pragma unroll 1
  for (int m = batched; m < Role_::heads; ++m)
    accumulateChunk<C>(row + m * headStride, alpha[(m * Role_::heads + h) * C::pseudo_heads + p], sum);
}

// A chunk of a mixed row, rotated for q and k: the partner chunk (d/2
// columns away) is mixed too, so d/2 must be a multiple of 8 for RoPE
// (mixedChunkFits).
template <class C, Role R>
__device__ __forceinline__ void mixedChunk(const IhaArgs& a, int64_t b, int64_t n, int h, int p, int column,
                                           float (&out)[kChunkElements]) {
  mixChunk<C, R>(a, b, n, h, p, column, out);
  if constexpr (RoleOf<C, R>::rotated) {
    constexpr int half = C::head_dim / 2;
    float partner[kChunkElements];
    mixChunk<C, R>(a, b, n, h, p, column < half ? column + half : column - half, partner);
    #pragma unroll
    for (int e = 0; e < kChunkElements; ++e)
      out[e] = rotate<C>(out[e], partner[e], rope_position<C>(a, n * C::pseudo_heads + p), column + e);
  }
}

// Whether mixedChunk serves role R: its chunks never straddle RoPE's half.
template <class C, Role R>
constexpr bool mixedChunkFits = !RoleOf<C, R>::rotated || (C::head_dim / 2) % kChunkElements == 0;

// The row, in o_pseudo, lse and out, of virtual row `row` of sequence b: a
// decode step keeps only its own T * P rows.
template <class C>
__device__ __forceinline__ int64_t storedRow(const IhaArgs& a, int64_t row, int64_t b) {
  return C::decode ? row - cached_rows<C>(a, b) : row;
}

// A split share's lse, ln 2 * (m + log2 l) of its running max (log2
// domain) and denominator; -inf for a share without an allowed key.
__device__ __forceinline__ float splitLse(float m, float l) {
  return l > 0.0f ? kLn2 * (m + log2f(l)) : negativeInfinity();
}

// Zeroes M x N mma accumulator fragments.
template <class C, int M, int N>
__device__ __forceinline__ void zero(float (&t)[M][N][4]) {
  #pragma unroll
  for (int m = 0; m < M; ++m)
    #pragma unroll
    for (int n = 0; n < N; ++n)
      #pragma unroll
      for (int e = 0; e < 4; ++e) t[m][n][e] = 0.0f;
}

__device__ __forceinline__ float warpSum(float x) {
  #pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
__device__ __forceinline__ float warpMax(float x) {
  #pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// qk_norm "rms" on rows already mixed, rotated and stored: each becomes
// x / sqrt(mean(x^2) + eps). Normalising after the rotation is the same
// function as before it (a rotation keeps every pair's, so the row's, sum of
// squares), and lets every mixing path stay element-parallel. One warp a
// row: warps warpIndex, warpIndex + warpCount, ... of the caller take rows
// 0 .. rows-1; all 32 lanes of each must call. `element(r, c)` is the address
// of element c of row r, or null for a row to skip.
template <class C, Role R>
struct Normalized {
  static constexpr bool value = C::qk_norm && R != Role::value;
};

template <class C, class Element>
__device__ void normalizeRows(int rows, Element element, int warpIndex, int warpCount) {
  // Not unrolled: it runs inside the key-block loop of fused mixing, where
  // the accumulators hold nearly every register.
  #pragma unroll 1
  for (int r = warpIndex; r < rows; r += warpCount) {
    if (!element(r, 0)) continue;
    float squares = 0.0f;
    #pragma unroll 1
    for (int c = lane(); c < C::head_dim; c += kWarpSize) {
      const float x = toFloat<C>(*element(r, c));
      squares += x * x;
    }
    const float factor = rsqrtf(warpSum(squares) * (1.0f / C::head_dim) + C::qk_norm_eps);
    #pragma unroll 1
    for (int c = lane(); c < C::head_dim; c += kWarpSize) {
      Bits16* at = element(r, c);
      *at = toBits<C>(toFloat<C>(*at) * factor);
    }
  }
}

// Writes 8 consecutive 16-bit elements (one 16-byte chunk).
template <class C>
__device__ __forceinline__ void storeChunk(Bits16* destination, const float (&values)[kChunkElements]) {
  uint4 packed;
  packed.x = pack<C>(values[0], values[1]);
  packed.y = pack<C>(values[2], values[3]);
  packed.z = pack<C>(values[4], values[5]);
  packed.w = pack<C>(values[6], values[7]);
  *reinterpret_cast<uint4*>(destination) = packed;
}

//===--- the pieces of materialised mixing (premix) -------------------------===//

// The staged weights: the launch's dynamic shared memory.
__device__ __forceinline__ float* premixWeights() { return reinterpret_cast<float*>(ptx::dynamicShared16()); }

// V consecutive 16-bit elements (V / 2 registers) in one load.
template <int V>
__device__ __forceinline__ void loadPieceOf(const Bits16* from, Bits32 (&to)[V / 2]) {
  if constexpr (V == 8) {
    const uint4 v = *reinterpret_cast<const uint4*>(from);
    to[0] = v.x, to[1] = v.y, to[2] = v.z, to[3] = v.w;
  } else if constexpr (V == 4) {
    const uint2 v = *reinterpret_cast<const uint2*>(from);
    to[0] = v.x, to[1] = v.y;
  } else {
    static_assert(V == 2, "pieces of 2, 4 or 8 elements");
    to[0] = *reinterpret_cast<const Bits32*>(from);
  }
}

template <class C, int V>
__device__ __forceinline__ void unpackPiece(const Bits32 (&packed)[V / 2], float (&x)[V]) {
  #pragma unroll
  for (int e = 0; e < V / 2; ++e) {
    x[2 * e] = toFloat<C>(Bits16(packed[e] & 0xffffu));
    x[2 * e + 1] = toFloat<C>(Bits16(packed[e] >> 16));
  }
}

template <class C, int V>
__device__ __forceinline__ void storePiece(Bits16* to, const float (&x)[V]) {
  Bits32 packed[V / 2];
  #pragma unroll
  for (int e = 0; e < V / 2; ++e) packed[e] = pack<C>(x[2 * e], x[2 * e + 1]);
  if constexpr (V == 8) ptx::storeGlobal(to, packed[0], packed[1], packed[2], packed[3]);
  else if constexpr (V == 4) ptx::storeGlobal(to, packed[0], packed[1]);
  else *reinterpret_cast<Bits32*>(to) = packed[0];
}

// R consecutive staged weights (R * 4 bytes, aligned as much).
template <int R>
__device__ __forceinline__ void loadWeights(const float* from, float (&w)[R]) {
  if constexpr (R % 4 == 0) {
    #pragma unroll
    for (int r = 0; r < R; r += 4) {
      const float4 v = *reinterpret_cast<const float4*>(from + r);
      w[r] = v.x, w[r + 1] = v.y, w[r + 2] = v.z, w[r + 3] = v.w;
    }
  } else if constexpr (R == 2) {
    const float2 v = *reinterpret_cast<const float2*>(from);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = from[0];
  }
}

// RoPE at one virtual position for the pieces of a token: column c of a
// piece pairs with c +- d/2, held by the lane pieces/2 away where V divides
// d/2. Otherwise (layout.h, premixVector) d/2 is an odd multiple of V/2:
// element e's partner is element (e + V/2) % V of the lane holding column
// c +- d/2 (two lanes a piece; the middle piece's columns pair both ways).
// The angles once (a pseudo-head's rows share them), then any number of
// rows rotated.
template <class C, int V, bool Rotated>
struct RopeAngles {
  __device__ RopeAngles(int64_t, int, int) {}
};
template <class C, int V>
struct RopeAngles<C, V, true> {
  static constexpr int kShift = C::head_dim / 2 % V;  // a partner's element index, past e
  static_assert(kShift == 0 || 2 * kShift == V, "RoPE's partner column lies a whole or half a piece off");
  float sine[V], cosine[V];  // sine signed for the column's half
  int partnerLane[kShift == 0 ? 1 : V];
  __device__ RopeAngles(int64_t position, int piece, int pieces) {
    if constexpr (kShift == 0) {
      const int half = pieces / 2;
      const bool first = piece < half;
      partnerLane[0] = piece < pieces ? lane() + (first ? half : -half) : lane();
      #pragma unroll
      for (int e = 0; e < V; ++e) {
        ropeSinCos<C>(position, (piece % half) * V + e, &sine[e], &cosine[e]);
        if (C::rope_negative != first) sine[e] = -sine[e];  // first half: x cos - partner sin
      }
    } else {
      constexpr int half = C::head_dim / 2;
      #pragma unroll
      for (int e = 0; e < V; ++e) {
        const int c = piece * V + e;
        const bool first = c < half;
        const bool inside = piece < pieces;  // a lane past the token's pieces turns column e, unused
        partnerLane[e] = inside ? lane() - piece + (first ? c + half : c - half) / V : lane();
        ropeSinCos<C>(position, !inside ? e : first ? c : c - half, &sine[e], &cosine[e]);
        if (C::rope_negative != first) sine[e] = -sine[e];
      }
    }
  }
  template <int R>
  __device__ void rotate(float (&acc)[R][V]) const {
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      if constexpr (kShift == 0) {
        #pragma unroll
        for (int e = 0; e < V; ++e) {
          const float partner = __shfl_sync(0xffffffffu, acc[r][e], partnerLane[0]);
          acc[r][e] = fmaf(partner, sine[e], acc[r][e] * cosine[e]);
        }
      } else {  // every partner value read before any element turns
        float partner[V];
        #pragma unroll
        for (int e = 0; e < V; ++e) partner[e] = __shfl_sync(0xffffffffu, acc[r][(e + kShift) % V], partnerLane[e]);
        #pragma unroll
        for (int e = 0; e < V; ++e) acc[r][e] = fmaf(partner[e], sine[e], acc[r][e] * cosine[e]);
      }
    }
  }
};

// qk_norm on R rows whose pieces lie in `Lanes` consecutive lanes.
template <class C, int R, int V, int Lanes>
__device__ __forceinline__ void normalizePieces(float (&acc)[R][V]) {
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    float squares = 0.0f;
    #pragma unroll
    for (int e = 0; e < V; ++e) squares = fmaf(acc[r][e], acc[r][e], squares);
    #pragma unroll
    for (int offset = Lanes / 2; offset > 0; offset /= 2) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    const float factor = rsqrtf(squares * (1.0f / C::head_dim) + C::qk_norm_eps);
    #pragma unroll
    for (int e = 0; e < V; ++e) acc[r][e] *= factor;
  }
}

//===--- collapse epilogues over a staged block -----------------------------===//
// Both implementations stage the normalised block as f32 [block_m][pitch] in
// shared memory (the P rows of a token may sit in different warps); these
// loops are then the same, run by `threads` threads numbered from 0 by
// `thread`.

// per_head: out[n, head] = sum_p collapse[head, p] * O[n*P + p].
template <class C>
__device__ void storeCollapsed(const float* staging, int pitch, const IhaArgs& a, int64_t row0, int64_t head,
                               int64_t b, int thread, int threads) {
  // A head's whole tokens (cta_rows % P == 0); stacked heads' follow.
  constexpr int P = C::pseudo_heads, D = C::head_dim, tokens = C::cta_rows / P;
  Bits16* out = static_cast<Bits16*>(a.out);
  for (int index = thread; index < C::stacked_heads * tokens * D; index += threads) {
    const int t = index / D, c = index % D;
    const int64_t n = storedRow<C>(a, row0, b) / P + t % tokens, h = head + t / tokens;
    if (n >= step_tokens<C>(a, b)) continue;
    float sum = 0.0f;
    for (int p = 0; p < P; ++p) sum += a.collapse[h * P + p] * staging[(t * P + p) * pitch + c];
    out[token_offset<C>(a, a.out_stride, b, n) + h * a.out_stride[2] + c] = toBits<C>(sum);
  }
}

// Fused global collapse: the output tile [block_m / P][H][pitch] starts at zero...
template <class C>
__device__ void zeroOutTile(float* tile, int pitch, int thread, int threads) {
  for (int index = thread; index < (C::block_m / C::pseudo_heads) * C::heads * pitch; index += threads)
    tile[index] = 0.0f;
}

// ...gathers every head's share: out[t, h] += sum_p collapse[h, head*P + p] * O[t*P + p]...
template <class C>
__device__ void accumulateCollapsed(float* tile, int tilePitch, const float* staging, int pitch, const IhaArgs& a,
                                    int64_t head, int thread, int threads) {
  constexpr int P = C::pseudo_heads, D = C::head_dim;
  for (int index = thread; index < (C::block_m / P) * C::heads * D; index += threads) {
    const int c = index % D, h = (index / D) % C::heads, t = index / D / C::heads;
    float sum = 0.0f;
    for (int p = 0; p < P; ++p) sum += a.collapse[(h * C::heads + head) * P + p] * staging[(t * P + p) * pitch + c];
    tile[(t * C::heads + h) * tilePitch + c] += sum;
  }
}

// ...and is written out once.
template <class C>
__device__ void storeOutTile(const float* tile, int pitch, const IhaArgs& a, int64_t row0, int64_t b, int thread,
                             int threads) {
  constexpr int P = C::pseudo_heads, D = C::head_dim;
  Bits16* out = static_cast<Bits16*>(a.out);
  for (int index = thread; index < (C::block_m / P) * C::heads * D; index += threads) {
    const int c = index % D, h = (index / D) % C::heads, t = index / D / C::heads;
    const int64_t n = storedRow<C>(a, row0, b) / P + t;
    if (n < step_tokens<C>(a, b))
      out[token_offset<C>(a, a.out_stride, b, n) + h * a.out_stride[2] + c] = toBits<C>(tile[(t * C::heads + h) * pitch + c]);
  }
}

// A masked block's columns as bits (mask_scores of both engines): the
// thread's columns t * 8 + {0, 1} (t < NT) from its first as bits 2t + e.
template <bool Wide>
struct ColumnWord {
  using type = Bits32;
};
template <>
struct ColumnWord<true> {
  using type = Bits64;
};
template <int NT>
using ColumnBits = typename ColumnWord<(2 * NT > 32)>::type;
// Those of its columns that lie below x (relative to its first).
template <int NT>
__device__ __forceinline__ ColumnBits<NT> columnsBelow(int x) {
  const int c = x < 0 ? 0 : x > 8 * NT ? 8 * NT : x;  // (int: loom::min is the program's int64_t)
  const int n = ((c >> 2) & ~1) + ((c & 7) < 2 ? (c & 7) : 2);  // 2 per whole 8 columns, 0-2 of the last
  if constexpr (2 * NT < 64) return ColumnBits<NT>(~(~Bits64(0) << n));  // n <= 2 NT < 64
  else return n >= 64 ? ~Bits64(0) : ~(~Bits64(0) << n);
}

}  // namespace cuda

// The CTA's block along x (the query block of an attention launch), last
// first: the GPU starts CTAs in blockIdx order, so under a causal mask the
// query blocks with the most key blocks go first and the light ones fill
// the tail of the grid.
__device__ __forceinline__ int64_t block_x(const IhaArgs&) { return gridDim.x - 1 - blockIdx.x; }
__device__ __forceinline__ int64_t block_y(const IhaArgs&) { return blockIdx.y; }
// The batch entry: launches of more than 65535 entries are split in z.
__device__ __forceinline__ int64_t block_z(const IhaArgs& a) { return a.batch_offset + blockIdx.z; }

//===----------------------------------------------------------------------===//
// Pre-mix and collapse launches (token-parallel)
//===----------------------------------------------------------------------===//

// The premix of a role on the tensor cores (layout.h, premixOnTensorCores:
// its shared memory and rounds). Per round the CTA stages its next tokens'
// raw rows (16-byte loads), then each warp takes (token, m-tile) pairs: the
// m-tile's 16 output rows (p-major: row p M + h) are A (weights, hi and lo)
// times B (the token's M x d raw rows, ldmatrix.trans), d/8 accumulator
// tiles in registers; RoPE pairs column c with c + d/2, which the same
// thread holds (n-tile j and j + d/16), so the rotation needs no shuffle;
// qk_norm's sum of squares is the row's four lanes'; the rows are packed
// into the warp's staging rows and stored 16 bytes at a time.
template <class C, Role R>
__device__ void premixTensor(const IhaArgs& a, int64_t token0, int64_t b) {
  using Role_ = cuda::RoleOf<C, R>;
  constexpr int M = Role_::heads, P = C::pseudo_heads, D = C::head_dim, W = C::warps;
  constexpr int Mp = premixTensorSources(M);  // M padded to whole k-steps and m-tiles
  constexpr int tokens = C::block_m / P, tiles = Mp * P / 16, KS = Mp / 16, NT = D / 8;
  constexpr int round = premixTensorRoundTokens(M, P, tokens, W);
  constexpr int wp = premixTensorPitch(Mp), xp = premixTensorPitch(D);
  constexpr bool split = C::dtype == DType::bf16;  // bf16 weights as hi + lo; f16's 11 bits as one half
  static_assert(Mp % 16 == 0 && D % 16 == 0, "whole mma tiles");
  const int64_t L = seq_len<C>(a);
  const int64_t* s = Role_::stride(a);
  const float* alpha = Role_::alpha(a);
  Bits16* ws = static_cast<Bits16*>(Role_::workspace(a));
  Bits16* smem = reinterpret_cast<Bits16*>(ptx::dynamicShared16());
  auto mma = [](float(&d)[4], const Bits32(&w)[4], Bits32 b0, Bits32 b1) {
    if constexpr (C::dtype == DType::f16) ptx::mmaF16(d, w, b0, b1);
    else ptx::mmaBf16(d, w, b0, b1);
  };
  Bits16* hi = smem;
  Bits16* lo = hi + Mp * P * wp;
  Bits16* x = lo + Mp * P * wp;
  Bits16* staging = x + round * Mp * xp + cuda::warp() * 16 * xp;
  float* angles = reinterpret_cast<float*>(x + round * Mp * xp + W * 16 * xp);  // [round][P][d/2][sine, cosine]
  const int lane = cuda::lane(), threads = int(blockDim.x);

  __syncthreads();  // the previous role is done with the shared memory
  if constexpr (Mp != M) {  // the padding's weights: zeros (the chunks' barriers order them before the fill)
    #pragma unroll 1
    for (int e = int(threadIdx.x); e < Mp * P * wp; e += threads) {
      hi[e] = 0;
      if constexpr (split) lo[e] = 0;
    }
  }
  // Weights: output row r = p Mp + h, k = source m: alpha[m, h, p], brought
  // in as f32 by 4-byte asynchronous copies into the rows' space (unused
  // before the first round), a chunk at a time, and split there.
  constexpr int scratch = (round * Mp * xp + W * 16 * xp) * kTileElementBytes / kAccumulatorBytes;
  float* staged = reinterpret_cast<float*>(x);
  #pragma unroll 1
  for (int base = 0; base < M * M * P; base += scratch) {
    const int count = M * M * P - base < scratch ? M * M * P - base : scratch;
    #pragma unroll 1
    for (int e = int(threadIdx.x); e < count; e += threads) ptx::cpAsyncCa4(staged + e, alpha + base + e, true);
    ptx::cpAsyncCommit();
    ptx::cpAsyncWait<0>();
    __syncthreads();
    #pragma unroll 1
    for (int e = int(threadIdx.x); e < count; e += threads) {
      const int i = base + e, p = i % P, h = (i / P) % M, m = i / P / M, r = p * Mp + h;
      const float w = staged[e];
      const Bits16 high = cuda::toBits<C>(w);
      hi[r * wp + m] = high;
      if constexpr (split) lo[r * wp + m] = cuda::toBits<C>(w - cuda::toFloat<C>(high));
    }
    __syncthreads();  // the chunk is split before the next one lands over it
  }
  const Bits32 hiBase = cuda::sharedAddress(hi), loBase = cuda::sharedAddress(lo), xBase = cuda::sharedAddress(x);
  #pragma unroll 1
  for (int first = 0; first < tokens; first += round) {
    __syncthreads();  // the last round's rows are read (and the weights written)
    // The round's raw rows: token t's row m at x[(t Mp + m) xp], 16 bytes a
    // load; the padding's rows zeros.
    #pragma unroll 1
    for (int e = int(threadIdx.x); e < round * Mp * (D / 8); e += threads) {
      const int chunk = e % (D / 8), m = (e / (D / 8)) % Mp, t = e / (D / 8) / Mp;
      const int64_t n = token0 + first + t;
      Bits32 v[4] = {0, 0, 0, 0};
      if (m < M && first + t < tokens && n < a.tokens)
        cuda::loadPieceOf<8>(static_cast<const Bits16*>(Role_::source(a)) + b * s[0] + n * s[1] + m * s[2] + chunk * 8,
                             v);
      Bits32* to = reinterpret_cast<Bits32*>(x + (t * Mp + m) * xp + chunk * 8);  // 16-byte aligned: one st.shared.v4
      to[0] = v[0], to[1] = v[1], to[2] = v[2], to[3] = v[3];
    }
    if constexpr (Role_::rotated) {  // the round's angles, once (the sine signed for the first half's column)
      #pragma unroll 1
      for (int e = int(threadIdx.x); e < round * P * (D / 2); e += threads) {
        const int j = e % (D / 2), p = (e / (D / 2)) % P, t = e / (D / 2) / P;
        float sine, cosine;
        cuda::ropeSinCos<C>(rope_position<C>(a, (token0 + first + t) * P) + p, j, &sine, &cosine);
        angles[2 * e] = C::rope_negative ? -sine : sine;
        angles[2 * e + 1] = cosine;
      }
    }
    __syncthreads();
    #pragma unroll 1
    for (int pair = cuda::warp(); pair < round * tiles; pair += W) {
      const int t = pair / tiles, tile = pair % tiles;
      const int64_t n = token0 + first + t;
      if (first + t >= tokens || n >= a.tokens) continue;  // the whole warp
      const int p = tile * 16 / Mp;
      float acc[NT][4];
      #pragma unroll
      for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
      #pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        Bits32 ah[4], al[4];
        const Bits32 at = Bits32(((tile * 16 + fragment::aRow(lane)) * wp + ks * 16 + fragment::aColumn(lane)) *
                                 kTileElementBytes);
        ptx::ldmatrixX4(ah, hiBase + at);
        if constexpr (split) ptx::ldmatrixX4(al, loBase + at);
        #pragma unroll
        for (int jj = 0; jj < D / 16; ++jj) {
          Bits32 bx[4];
          ptx::ldmatrixX4Trans(bx, xBase + Bits32(((t * Mp + ks * 16 + fragment::bTransRow(lane)) * xp + jj * 16 +
                                                   fragment::bTransColumn(lane)) * kTileElementBytes));
          mma(acc[2 * jj], ah, bx[0], bx[1]);
          mma(acc[2 * jj + 1], ah, bx[2], bx[3]);
          if constexpr (split) {
            mma(acc[2 * jj], al, bx[0], bx[1]);
            mma(acc[2 * jj + 1], al, bx[2], bx[3]);
          }
        }
      }
      if constexpr (Role_::rotated) {
        // Column c = 8 j + 2 (lane % 4) + e of the first half and its partner c + d/2 (n-tile j + d/16).
        // The angles of c and c + 1 in one 16-byte read.
        const float* turn = angles + 2 * ((t * P + p) * (D / 2) + 2 * (lane % 4));
        #pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
          const float* at = turn + 16 * j;
          #pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float sine = at[2 * e], cosine = at[2 * e + 1];
            #pragma unroll
            for (int half = 0; half < 2; ++half) {  // rows lane / 4 and lane / 4 + 8
              const float x1 = acc[j][2 * half + e], x2 = acc[j + NT / 2][2 * half + e];
              acc[j][2 * half + e] = fmaf(x1, cosine, -x2 * sine);
              acc[j + NT / 2][2 * half + e] = fmaf(x1, sine, x2 * cosine);
            }
          }
        }
      }
      if constexpr (cuda::Normalized<C, R>::value) {
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
          float squares = 0.0f;
          #pragma unroll
          for (int j = 0; j < NT; ++j)
            squares = fmaf(acc[j][2 * half], acc[j][2 * half], fmaf(acc[j][2 * half + 1], acc[j][2 * half + 1], squares));
          squares += __shfl_xor_sync(0xffffffffu, squares, 1);
          squares += __shfl_xor_sync(0xffffffffu, squares, 2);
          const float factor = rsqrtf(squares * (1.0f / D) + C::qk_norm_eps);
          #pragma unroll
          for (int j = 0; j < NT; ++j) acc[j][2 * half] *= factor, acc[j][2 * half + 1] *= factor;
        }
      }
      // The 16 rows into the warp's staging rows, then 16 bytes a store.
      #pragma unroll
      for (int j = 0; j < NT; ++j)
        #pragma unroll
        for (int half = 0; half < 2; ++half)
          *reinterpret_cast<Bits32*>(staging + (lane / 4 + 8 * half) * xp + 8 * j + 2 * (lane % 4)) =
              cuda::pack<C>(acc[j][2 * half], acc[j][2 * half + 1]);
      __syncwarp();
      #pragma unroll
      for (int i = 0; i < 16 * (D / 8) / kWarpSize; ++i) {
        const int e = lane + i * kWarpSize;
        const int row = e / (D / 8), chunk = e % (D / 8), r = tile * 16 + row, h = r % Mp;
        const Bits32* from = reinterpret_cast<const Bits32*>(staging + row * xp + chunk * 8);
        if (Mp == M || h < M)
          ptx::storeGlobal(ws + ((b * M + h) * L + n * P + r / Mp) * D + chunk * 8, from[0], from[1], from[2], from[3]);
      }
      __syncwarp();  // the staging rows are read before the next pair writes them
    }
  }
}

// Materialised mixing (layout.h, premixVector: the thread geometry): each
// raw element is read once, V to a load; each mixed row is written once, V
// to a store. Per round a thread takes a piece of one token; per group it
// mixes R rows of one pseudo-head from the held piece and the staged
// weights, rotates them (the partner piece's values by shuffle; the angles
// once a group), normalises them (the row's sum of squares over the
// token's lanes) and stores them. Every lane of a warp runs every shuffle.
template <class C, Role R>
__device__ void premix(const IhaArgs& a, int64_t token0, int64_t b) {
  using Role_ = cuda::RoleOf<C, R>;
  constexpr int M = Role_::heads, P = C::pseudo_heads, D = C::head_dim;
  constexpr int V = premixVector(M, D), pieces = D / V, lanes = premixLanes(M, D);
  constexpr int Rg = premixRowGroup(M, D), Ps = premixStagedPseudo(M, P);
  constexpr int tokens = C::block_m / P;
  static_assert(pieces <= lanes && lanes <= kWarpSize && V % 2 == 0, "a token's pieces fit one warp");
  static_assert(!C::decode, "a decode step has no premix launch");
  if constexpr (premixOnTensorCores(M, P, D, C::block_m / P, C::warps)) {
    premixTensor<C, R>(a, token0, b);
    return;
  }
  const int threads = int(blockDim.x);
  const int perRound = threads / lanes;
  const int rounds = (tokens + perRound - 1) / perRound;
  const int piece = int(threadIdx.x) % lanes;
  const int64_t L = seq_len<C>(a);
  const int64_t* s = Role_::stride(a);
  const float* alpha = Role_::alpha(a);
  float* staged = cuda::premixWeights();
  Bits16* ws = static_cast<Bits16*>(Role_::workspace(a));
  // alpha[m, h, p] (row-major [M][M][P]) of pseudo-heads p0 .. p0 + Ps - 1
  // to staged[m][p - p0][h], by 4-byte asynchronous copies (no register
  // round trip; a pseudo-head past P is zero-filled, never read).
  auto stage = [&](int p0) {
    __syncthreads();  // the last weights (this role's or the previous one's) are read
    #pragma unroll 1
    for (int e = int(threadIdx.x); e < M * M * Ps; e += threads) {
      const int h = e % M, p = (e / M) % Ps, m = e / M / Ps;
      const bool valid = p0 + p < P;
      ptx::cpAsyncCa4(staged + e, alpha + (valid ? (m * M + h) * P + p0 + p : 0), valid);
    }
    ptx::cpAsyncCommit();
    ptx::cpAsyncWait<0>();
    __syncthreads();
  };
  if constexpr (Ps == P) stage(0);
  #pragma unroll 1
  for (int round = 0; round < rounds; ++round) {
    const int t = round * perRound + int(threadIdx.x) / lanes;
    const int64_t n = token0 + t;
    const bool active = piece < pieces && t < tokens && n < a.tokens;
    // A warp whose every lane is past the CTA's tokens skips the mixing.
    const int warpToken = round * perRound + cuda::warp() * kWarpSize / lanes;
    const bool warpActive = warpToken < tokens && token0 + warpToken < a.tokens;
    // The piece of every source head: the loads in flight together, then
    // widened to floats once.
    float held[M][V];
    {
      Bits32 packed[M][V / 2];
      if (active) {
        const Bits16* x = static_cast<const Bits16*>(Role_::source(a)) + b * s[0] + n * s[1] + piece * V;
        #pragma unroll
        for (int m = 0; m < M; ++m) cuda::loadPieceOf<V>(x + m * s[2], packed[m]);
      } else {
        #pragma unroll
        for (int m = 0; m < M; ++m)
          #pragma unroll
          for (int e = 0; e < V / 2; ++e) packed[m][e] = 0;
      }
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        cuda::unpackPiece<C, V>(packed[m], held[m]);
        ptx::pinRegisters(held[m]);  // widened here, once, not again in every group
      }
    }
    const int64_t position0 = rope_position<C>(a, n * P);
    #pragma unroll 1
    for (int p0 = 0; p0 < P; p0 += Ps) {
      if constexpr (Ps < P) stage(p0);
      if (!warpActive) continue;
      const int pEnd = P - p0 < Ps ? P : p0 + Ps;
      #pragma unroll 1
      for (int p = p0; p < pEnd; ++p) {
        // RoPE's angles: one position for every row of this pseudo-head.
        cuda::RopeAngles<C, V, Role_::rotated> angles(position0 + p, piece, pieces);
        Bits16* out = ws + ((b * M) * L + n * P + p) * D + piece * V;
        #pragma unroll 1
        for (int h0 = 0; h0 < M; h0 += Rg) {
          const float* weights = staged + ((p - p0) * M + h0);
          float acc[Rg][V];
          #pragma unroll
          for (int m = 0; m < M; ++m) {
            float w[Rg];
            cuda::loadWeights<Rg>(weights + m * Ps * M, w);
            #pragma unroll
            for (int r = 0; r < Rg; ++r)
              #pragma unroll
              for (int e = 0; e < V; ++e) acc[r][e] = m == 0 ? w[r] * held[m][e] : fmaf(w[r], held[m][e], acc[r][e]);
          }
          if constexpr (Role_::rotated) angles.rotate(acc);
          if constexpr (cuda::Normalized<C, R>::value) cuda::normalizePieces<C, Rg, V, lanes>(acc);
          if (active) {
            #pragma unroll
            for (int r = 0; r < Rg; ++r) cuda::storePiece<C, V>(out + (h0 + r) * L * D, acc[r]);
          }
        }
      }
    }
  }
}

template <class C>
__device__ void collapse_rows(const IhaArgs& a, int64_t token0, int64_t b) {
  constexpr int P = C::pseudo_heads, tokens = C::block_m / P;
  const int64_t L = seq_len<C>(a);
  const Bits16* o = static_cast<const Bits16*>(a.o_pseudo);
  Bits16* out = static_cast<Bits16*>(a.out);
  for (int index = threadIdx.x; index < tokens * C::heads * C::head_dim; index += blockDim.x) {
    const int c = index % C::head_dim, h = (index / C::head_dim) % C::heads;
    const int64_t n = token0 + index / C::head_dim / C::heads;
    if (n >= step_tokens<C>(a, b)) continue;
    float sum = 0.0f;
    for (int source = 0; source < C::heads; ++source) {
      if (C::collapse == Collapse::per_head && source != h) continue;
      for (int p = 0; p < P; ++p) {
        const float w = C::collapse == Collapse::per_head ? a.collapse[h * P + p] : a.collapse[(h * C::heads + source) * P + p];
        sum += w * cuda::toFloat<C>(o[((b * C::heads + source) * L + n * P + p) * C::head_dim + c]);
      }
    }
    out[token_offset<C>(a, a.out_stride, b, n) + h * a.out_stride[2] + c] = cuda::toBits<C>(sum);
  }
}

//===----------------------------------------------------------------------===//
// A decode step's append (docs/IHA.md, Decode over a paged cache)
//===----------------------------------------------------------------------===//

// The step's new tokens' k and v into their pages: token n goes to position
// cache_len[b] + n. A raw cache takes the rows as they are, 16 bytes a thread
// at a time. A mixed cache takes each token's G x P pseudo-rows mixed (keys
// normalised and rotated at their virtual position), in the dtype: one warp
// a row, a warp sum for qk_norm's mean of squares, taken on the mixed row
// before the rotation (which keeps it).
//
// With the device's page check (IhaArgs::sequence_ok, set by a launch given
// an error word) the append checks first: warp 0 reads the page-table
// entries the sequence's tokens use (only those: its length is checked
// against max_pages first) and writes the verdict, sequence_ok[b] (every
// CTA of the sequence writes the same), and 1 into *page_errors for a
// refused sequence; a refused sequence appends nothing, and the launches
// after see it refused (decode_len 0).
template <class C>
__device__ void append_cache(const IhaArgs& a, int64_t token0, int64_t b) {
  constexpr int D = C::head_dim, tokens = C::block_m / C::pseudo_heads;
  if (a.sequence_ok) {
    if (cuda::warp() == 0) {
      const int64_t length = a.cache_len[b], end = length + step_tokens<C>(a, b);
      bool ok = length >= 0 && end <= a.max_pages * a.page_size;
      if (ok)
        for (int64_t p = cuda::lane(); p < (end + a.page_size - 1) / a.page_size; p += kWarpSize) {
          const int32_t page = a.page_table[b * a.max_pages + p];
          ok &= page >= 0 && page < a.num_pages;
        }
      int all = ok;
      for (int lanes = kWarpSize / 2; lanes > 0; lanes /= 2) all &= __shfl_xor_sync(0xffffffffu, all, lanes);
      if (cuda::lane() == 0) {
        a.sequence_ok[b] = all;
        if (!all) *a.page_errors = 1;
      }
    }
    __syncthreads();
  }
  if (refused_sequence(a, b)) return;  // its pages are not to be trusted
  if constexpr (C::mixed_cache) {
    constexpr int P = C::pseudo_heads, G = C::kv_heads;
    const int warps = int(blockDim.x) / kWarpSize;
    #pragma unroll 1
    for (int row = cuda::warp(); row < 2 * tokens * G * P; row += warps) {
      const int p = row % P, g = (row / P) % G, t = (row / P / G) % tokens;
      const bool key = row / P / G / tokens == 0;
      const int64_t n = token0 + t;
      if (n >= step_tokens<C>(a, b)) continue;  // the whole warp
      float factor = 1.0f;
      if constexpr (C::qk_norm) {
        if (key) {
          float squares = 0.0f;
          #pragma unroll 1
          for (int c = cuda::lane(); c < D; c += kWarpSize) {
            const float x = cuda::mixFromGlobal<C, Role::key>(a, b, n, g, p, c);
            squares += x * x;
          }
          factor = rsqrtf(cuda::warpSum(squares) * (1.0f / D) + C::qk_norm_eps);
        }
      }
      Bits16* target = static_cast<Bits16*>(key ? a.k_cache : a.v_cache) +
                       ((cache_slot(a, b, a.cache_len[b] + n) * G + g) * P + p) * D;
      #pragma unroll 1
      for (int c = cuda::lane(); c < D; c += kWarpSize) {
        const float x = key ? cuda::mixedElement<C, Role::key>(a, b, n, g, p, c)
                            : cuda::mixedElement<C, Role::value>(a, b, n, g, p, c);
        target[c] = cuda::toBits<C>(x * factor);
      }
    }
  } else {
    constexpr int chunks = D / kChunkElements;
    for (int index = threadIdx.x; index < 2 * tokens * C::kv_heads * chunks; index += blockDim.x) {
      const int chunk = index % chunks, g = (index / chunks) % C::kv_heads;
      const int t = (index / chunks / C::kv_heads) % tokens, role = index / chunks / C::kv_heads / tokens;
      const int64_t n = token0 + t;
      if (n >= step_tokens<C>(a, b)) continue;
      const int64_t* stride = role == 0 ? a.k_stride : a.v_stride;
      const Bits16* source = static_cast<const Bits16*>(role == 0 ? a.k : a.v) + token_offset<C>(a, stride, b, n) +
                             g * stride[2] + chunk * kChunkElements;
      Bits16* target = static_cast<Bits16*>(role == 0 ? a.k_cache : a.v_cache) +
                       (cache_slot(a, b, a.cache_len[b] + n) * C::kv_heads + g) * D + chunk * kChunkElements;
      *reinterpret_cast<uint4*>(target) = *reinterpret_cast<const uint4*>(source);
    }
  }
}

//===----------------------------------------------------------------------===//
// A decode step's combine of its kv splits
//===----------------------------------------------------------------------===//

// The combine (flash-decoding's second pass): one warp a row of the CTA's
// tokens, of every head. Its lanes take the splits' lse, M the largest, and
// each keeps the weights e^(lse_s - M) of the splits s = lane + 32k; then
// lane by lane the columns sum their splits, each weight read from its
// lane by a shuffle (computed once a row, not once a column).
template <class C>
__device__ void combine_splits(const IhaArgs& a, int64_t token0, int64_t b) {
  constexpr int P = C::pseudo_heads, D = C::head_dim, rows = C::block_m / P * P, S = C::kv_splits;
  constexpr int perLane = (S + kWarpSize - 1) / kWarpSize;
  const int64_t L = seq_len<C>(a);
  const int l = cuda::lane();
  for (int task = cuda::warp(); task < rows * C::heads; task += int(blockDim.x) / kWarpSize) {
    const int h = task % C::heads;
    const int64_t i = token0 * P + task / C::heads;
    if (i >= step_tokens<C>(a, b) * P) continue;  // the whole warp: i is the warp's
    float lse[perLane], weight[perLane];
    float most = cuda::negativeInfinity();
    #pragma unroll
    for (int k = 0; k < perLane; ++k) {
      const int s = l + k * kWarpSize;
      lse[k] = s < S ? split_row<C>(a, b, h, s, i)[D] : cuda::negativeInfinity();
      most = fmaxf(most, lse[k]);
    }
    most = cuda::warpMax(most);
    float total = 0.0f;
    #pragma unroll
    for (int k = 0; k < perLane; ++k) {
      weight[k] = most == cuda::negativeInfinity() ? 0.0f : expf(lse[k] - most);  // 0: a share without keys
      total += weight[k];
    }
    total = cuda::warpSum(total);
    // Every lane shuffles (the mask is the whole warp); lanes past D drop their sums.
    for (int c0 = 0; c0 < D; c0 += kWarpSize) {
      const int c = c0 + l;
      float sum = 0.0f;
      #pragma unroll
      for (int k = 0; k < perLane; ++k)
        // eight splits' loads in flight at once: unrolled whole, 256 splits
        // (a one-warp absorbed step's default) hoisted 256 loads and spilled
        #pragma unroll 8
        for (int j = 0; j < kWarpSize && k * kWarpSize + j < S; ++j) {
          const float w = __shfl_sync(0xffffffffu, weight[k], j);
          if (w != 0.0f && c < D) sum += w * split_row<C>(a, b, h, k * kWarpSize + j, i)[c];
        }
      if (c < D)
        static_cast<Bits16*>(a.o_pseudo)[((b * C::heads + h) * L + i) * D + c] =
            cuda::toBits<C>(total > 0.0f ? sum / total : 0.0f);
    }
    if (l == 0 && a.lse)
      a.lse[(b * C::heads + h) * L + i] = total > 0.0f ? most + logf(total) : cuda::negativeInfinity();
  }
}

// A CUtensorMap: 128 opaque bytes, encoded on the host by
// cuTensorMapEncodeTiled and passed by value as a __grid_constant__.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

// The tensor maps of a warp-specialised attention launch (and of the wgmma
// backward's key-block-outer launch), over the mixed workspaces [B * heads,
// L, d] (16-bit) and do_pseudo: boxes of 64 columns by 64 rows (q, dO) or
// block_n rows (k, v), 128-byte swizzle; and a backward's lse and D as one
// run of B * heads * L floats each (coordinate (b * heads + h) * L + i),
// boxes of 64. Unused with fused mixing.
struct TmaMaps {
  TensorMap q;
  TensorMap k;
  TensorMap v;
  TensorMap dO;
  TensorMap row_stats;  // the backward's lse_log2 and D planes (2-d)
};

namespace hopper {

// wgmma's shared-memory matrix descriptors for 128-byte swizzled tiles (the
// sm_90a forward, loom/tile/hopper.h, and the wgmma backward). `leading` is the
// byte step between 64-column atoms along N of an N-major operand (unused,
// 16, for K-major ones); `stride` the step between 8-row groups.
// A descriptor as its two words: the low one holds the start address (bits
// 0-13, in 16-byte units) and the leading byte offset, the high one the
// stride and the swizzle mode (bits 62-63 of the whole: 1, 128-byte), the
// same for every tile of a kind.
struct Descriptor {
  Bits32 lo, hi;
};
__device__ __forceinline__ Descriptor descriptorAt(Bits32 address, int leading, int stride) {
  return {((address >> 4) & 0x3FFF) | Bits32((leading >> 4) & 0x3FFF) << 16,
          Bits32((stride >> 4) & 0x3FFF) | Bits32(1) << 30};
}
// The descriptor `bytes` further on: only the start address grows (shared
// addresses stay below 2^18, so it never carries into the next field).
__device__ __forceinline__ Descriptor offset(Descriptor d, int bytes) { return {d.lo + Bits32(bytes >> 4), d.hi}; }
__device__ __forceinline__ Bits64 advanced(Descriptor d, int bytes) {
  const Descriptor at = offset(d, bytes);
  return Bits64(at.hi) << 32 | Bits64(at.lo);
}

}  // namespace hopper

}  // namespace loom
