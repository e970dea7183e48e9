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
template <class C>
__device__ __forceinline__ void ropeSinCos(int64_t position, int j, float* sine, float* cosine) {
  constexpr float kTwoPiOver2To32 = 6.2831853071795865f / 4294967296.0f;
  const unsigned long long turns = static_cast<unsigned long long>(position) * C::rope_turns[j];
  const float reduced = float(static_cast<int>(static_cast<unsigned>(turns >> 32))) * kTwoPiOver2To32;
  __sincosf(reduced, sine, cosine);  // |reduced| <= pi: the fast path is accurate to ~4e-7
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
    sum += alpha[(m * Role_::heads + h) * C::pseudo_heads + p] * loadElement<C>(x, b * s[0] + n * s[1] + m * s[2] + c);
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
    return rotate<C>(x, partner, token * C::pseudo_heads + p, c);
  }
}

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
    if (n >= a.tokens) continue;
    float sum = 0.0f;
    for (int p = 0; p < P; ++p) sum += a.collapse[h * P + p] * staging[(t * P + p) * pitch + c];
    out[b * a.out_stride[0] + n * a.out_stride[1] + h * a.out_stride[2] + c] = toBits<C>(sum);
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
    if (n < a.tokens)
      out[b * a.out_stride[0] + n * a.out_stride[1] + h * a.out_stride[2] + c] = toBits<C>(tile[(t * C::heads + h) * pitch + c]);
  }
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
// Pre-mix and collapse launches (token-parallel, no shared memory)
//===----------------------------------------------------------------------===//

template <class C, Role R>
__device__ void premix(const IhaArgs& a, int64_t token0, int64_t b) {
  using Role_ = cuda::RoleOf<C, R>;
  constexpr int tokens = C::block_m / C::pseudo_heads;
  constexpr int chunks = C::head_dim / kChunkElements;
  const int64_t L = seq_len<C>(a);
  Bits16* ws = static_cast<Bits16*>(Role_::workspace(a));
  if constexpr (cuda::Normalized<C, R>::value) {
    // qk_norm: one warp per row, each lane one 16-byte chunk (head_dim <=
    // 256 is at most 32 of them), mixed, rotated and normalised in f32 and
    // rounded once. (Rounding the mixed row, then the normalised one, costs
    // 10-25% more error, and leaves the rows a backward's qk_norm Jacobian
    // sees further from the ones it differentiates.)
    static_assert(chunks <= kWarpSize, "one chunk per lane");
    constexpr int rowsPerToken = Role_::heads * C::pseudo_heads;
    for (int row = cuda::warp(); row < tokens * rowsPerToken; row += int(blockDim.x) / kWarpSize) {
      const int64_t n = token0 + row / rowsPerToken;
      const int h = (row / C::pseudo_heads) % Role_::heads, p = row % C::pseudo_heads;
      if (n >= a.tokens) continue;  // the whole warp
      const int chunk = cuda::lane();
      float values[kChunkElements] = {};
      float squares = 0.0f;
      if (chunk < chunks)
        #pragma unroll
        for (int e = 0; e < kChunkElements; ++e) {
          values[e] = cuda::mixedElement<C, R>(a, b, n, h, p, chunk * kChunkElements + e);
          squares += values[e] * values[e];
        }
      const float factor = rsqrtf(cuda::warpSum(squares) * (1.0f / C::head_dim) + C::qk_norm_eps);
      if (chunk < chunks) {
        #pragma unroll
        for (int e = 0; e < kChunkElements; ++e) values[e] *= factor;
        cuda::storeChunk<C>(ws + ((b * Role_::heads + h) * L + n * C::pseudo_heads + p) * C::head_dim +
                                chunk * kChunkElements,
                            values);
      }
    }
  } else {
    for (int index = threadIdx.x; index < tokens * Role_::heads * C::pseudo_heads * chunks; index += blockDim.x) {
      const int chunk = index % chunks;
      const int p = (index / chunks) % C::pseudo_heads;
      const int h = (index / chunks / C::pseudo_heads) % Role_::heads;
      const int64_t n = token0 + index / chunks / C::pseudo_heads / Role_::heads;
      if (n >= a.tokens) continue;
      float values[kChunkElements];
      #pragma unroll
      for (int e = 0; e < kChunkElements; ++e)
        values[e] = cuda::mixedElement<C, R>(a, b, n, h, p, chunk * kChunkElements + e);
      cuda::storeChunk<C>(ws + ((b * Role_::heads + h) * L + n * C::pseudo_heads + p) * C::head_dim + chunk * kChunkElements,
                          values);
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
    if (n >= a.tokens) continue;
    float sum = 0.0f;
    for (int source = 0; source < C::heads; ++source) {
      if (C::collapse == Collapse::per_head && source != h) continue;
      for (int p = 0; p < P; ++p) {
        const float w = C::collapse == Collapse::per_head ? a.collapse[h * P + p] : a.collapse[(h * C::heads + source) * P + p];
        sum += w * cuda::toFloat<C>(o[((b * C::heads + source) * L + n * P + p) * C::head_dim + c]);
      }
    }
    out[b * a.out_stride[0] + n * a.out_stride[1] + h * a.out_stride[2] + c] = cuda::toBits<C>(sum);
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
template <class C>
__device__ void append_cache(const IhaArgs& a, int64_t token0, int64_t b) {
  constexpr int D = C::head_dim, tokens = C::block_m / C::pseudo_heads;
  if constexpr (C::mixed_cache) {
    constexpr int P = C::pseudo_heads, G = C::kv_heads;
    const int warps = int(blockDim.x) / kWarpSize;
    #pragma unroll 1
    for (int row = cuda::warp(); row < 2 * tokens * G * P; row += warps) {
      const int p = row % P, g = (row / P) % G, t = (row / P / G) % tokens;
      const bool key = row / P / G / tokens == 0;
      const int64_t n = token0 + t;
      if (n >= a.tokens) continue;  // the whole warp
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
      if (n >= a.tokens) continue;
      const int64_t* stride = role == 0 ? a.k_stride : a.v_stride;
      const Bits16* source = static_cast<const Bits16*>(role == 0 ? a.k : a.v) + b * stride[0] + n * stride[1] +
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
    if (i >= L) continue;  // the whole warp: i is the warp's
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

}  // namespace loom
