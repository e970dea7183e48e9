// The host implementation of the tile API: each op does, with plain loops
// over one CTA's tiles, what the CUDA implementation's warps do together.
// A launcher (runtime/cpu) sets the CTA coordinates and calls a generated
// entry point once per CTA; CTAs may run on several threads.
//
// It is an emulation, not a model: the program's control flow (block
// ranges, masked and interior loops, the K/V pipeline's produce / wait /
// release order, fusion) is exactly the GPU's, and the pipeline checks that
// every block is produced before it is consumed.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <vector>

#include "loom/tile/common.h"
#include "loom/tile/layout.h"
#include "loom/half.h"

#define LOOM_KERNEL extern "C" __attribute__((visibility("default")))

namespace loom {
namespace host {

struct Coordinates {
  int64_t x = 0, y = 0, z = 0;
};
inline thread_local Coordinates cta;

// A warp-specialised program (engine wgmma) runs each CTA in two parts: the
// producer's, which records the key blocks it streams, then the consumers',
// whose waits must take exactly those blocks in that order.
enum class Part { whole, producer, consumer };
inline thread_local Part part = Part::whole;
struct Streamed {
  int64_t head, batch, block;
};
inline thread_local std::deque<Streamed> streamed;

// Counts of what the program did, read by tests through loom_host_stats.
struct Stats {
  std::atomic<int64_t> key_blocks{0};     // key blocks multiplied (mma_qk)
  std::atomic<int64_t> masked_blocks{0};  // key blocks masked element-wise
  std::atomic<int64_t> ctas{0};
};
inline Stats stats;

inline float toFloat(float x) { return x; }
using half::bfloat16ToFloat;
using half::floatToBfloat16;
using half::floatToHalf;
using half::halfToFloat;

template <class C>
float loadElement(const void* base, int64_t index) {
  if constexpr (C::dtype == DType::f32) return static_cast<const float*>(base)[index];
  else if constexpr (C::dtype == DType::f16) return halfToFloat(static_cast<const uint16_t*>(base)[index]);
  else return bfloat16ToFloat(static_cast<const uint16_t*>(base)[index]);
}

template <class C>
void storeElement(void* base, int64_t index, float value) {
  if constexpr (C::dtype == DType::f32) static_cast<float*>(base)[index] = value;
  else if constexpr (C::dtype == DType::f16) static_cast<uint16_t*>(base)[index] = floatToHalf(value);
  else static_cast<uint16_t*>(base)[index] = floatToBfloat16(value);
}

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "loom host tile API: %s\n", what);
  std::abort();
}

// qk_norm "rms": x / sqrt(mean(x^2) + eps) over the row.
template <class C>
void normalize(float* row) {
  float squares = 0.0f;
  for (int c = 0; c < C::head_dim; ++c) squares += row[c] * row[c];
  const float factor = 1.0f / std::sqrt(squares / C::head_dim + C::qk_norm_eps);
  for (int c = 0; c < C::head_dim; ++c) row[c] *= factor;
}

// theta^(-2j/d), the same doubles every row, computed once a program. Not a
// function's static: every program names its config IhaConfig, and a static
// of an inline function is one object (a unique symbol) across all the
// programs a process loads; this one has internal linkage.
namespace {
template <class C>
const std::array<double, C::head_dim / 2> ropeFrequency = [] {
  std::array<double, C::head_dim / 2> f{};
  for (int j = 0; j < C::head_dim / 2; ++j) f[j] = std::pow(double(C::rope_theta), -2.0 * j / C::head_dim);
  return f;
}();
template <class C>
const std::array<float, C::head_dim / 2> ropeInvFreq = [] {
  std::array<float, C::head_dim / 2> f{};
  for (int j = 0; j < C::head_dim / 2; ++j) f[j] = loom::half::ropeTableInvFreq(C::rope_theta, j, C::head_dim);
  return f;
}();
}  // namespace

// Half-split rotary embedding at virtual position `position` (by the opposite
// angle when rope_direction is negative, and back with `inverse`); angles in
// double so long sequences keep their phase.
template <class C>
void rotate(float* row, int64_t position, bool inverse = false) {
  constexpr int half = C::head_dim / 2;
  const std::array<double, half>& frequency = ropeFrequency<C>;
  const double direction = (C::rope_negative ? -1.0 : 1.0) * (inverse ? -1.0 : 1.0);
  for (int j = 0; j < half; ++j) {
    double c, s;
    if constexpr (C::rope_table != 0) {  // the public table (loom/half.h): float32 angle, rounded entries
      const double angle = loom::half::ropeTableAngle(position, ropeInvFreq<C>[j]);
      c = loom::half::ropeTableRound(std::cos(angle), C::rope_table);
      s = direction * loom::half::ropeTableRound(std::sin(angle), C::rope_table);
    } else {
      const double angle = direction * double(position) * frequency[j];
      c = std::cos(angle);
      s = std::sin(angle);
    }
    const float x0 = row[j], x1 = row[j + half];
    row[j] = float(x0 * c - x1 * s);
    row[j + half] = float(x0 * s + x1 * c);
  }
}

// Steps 1-3 for one virtual row at virtual position `position`: pseudo-head
// p of head `h` of the role mixed from element(m, c), the role's head m,
// then normalised (qk_norm) and rotated; `mixOnly` stops after the mixing.
template <class C, Role R, class Element>
void mixRowFrom(const IhaArgs& a, Element element, int64_t position, int64_t h, int64_t p, float* out, bool mixOnly) {
  constexpr int heads = R == Role::query ? C::heads : C::kv_heads;
  const float* alpha = R == Role::query ? a.alpha_q : R == Role::key ? a.alpha_k : a.alpha_v;
  for (int c = 0; c < C::head_dim; ++c) out[c] = 0.0f;
  for (int m = 0; m < heads; ++m) {
    const float weight = alpha[(m * heads + h) * C::pseudo_heads + p];
    for (int c = 0; c < C::head_dim; ++c) out[c] += weight * element(m, c);
  }
  if (mixOnly) return;
  // With a rounded RoPE table the norm is of the turned row (docs/IHA.md, Options).
  if (C::rope_table != 0 && C::rope_theta > 0 && R != Role::value) rotate<C>(out, position);
  if (C::qk_norm && R != Role::value) normalize<C>(out);
  if (C::rope_table == 0 && C::rope_theta > 0 && R != Role::value) rotate<C>(out, position);
}

// Row n*P + p of head `h` of the role, from q, k or v. In a decode step
// token n of those is token cache_len[b] + n of its sequence, and turns as such.
template <class C, Role R>
void mixedRow(const IhaArgs& a, int64_t b, int64_t n, int64_t h, int64_t p, float* out, bool mixOnly = false) {
  const void* x = R == Role::query ? a.q : R == Role::key ? a.k : a.v;
  const int64_t* stride = R == Role::query ? a.q_stride : R == Role::key ? a.k_stride : a.v_stride;
  const int64_t token = C::decode ? a.cache_len[b] + n : n;
  const int64_t base = token_offset<C>(a, stride, b, n);
  mixRowFrom<C, R>(
      a, [&](int m, int c) { return loadElement<C>(x, base + m * stride[2] + c); },
      rope_position<C>(a, token * C::pseudo_heads + p), h,
      p, out, mixOnly);
}

// A decode step's key or value row n*P + p of kv head g, read through the
// page table: as stored in a mixed cache, mixed and rotated here from a raw one.
template <class C, Role R>
void cachedRow(const IhaArgs& a, int64_t b, int64_t n, int64_t g, int64_t p, float* out) {
  constexpr int P = C::pseudo_heads, D = C::head_dim;
  const void* cache = R == Role::key ? a.k_cache : a.v_cache;
  const int64_t slot = cache_slot(a, b, n);
  if constexpr (C::mixed_cache) {
    const int64_t base = ((slot * C::kv_heads + g) * P + p) * D;
    for (int c = 0; c < D; ++c) out[c] = loadElement<C>(cache, base + c);
  } else {
    const int64_t base = slot * C::kv_heads * D;
    mixRowFrom<C, R>(
        a, [&](int m, int c) { return loadElement<C>(cache, base + m * D + c); }, n * P + p, g, p, out, false);
  }
}

// Row `i` of a role: mixed on the fly, or read from its workspace; in a
// decode step a query row from the step's q, a key or value row from the cache.
template <class C, Role R, bool Mixed>
void virtualRow(const IhaArgs& a, int64_t b, int64_t h, int64_t i, float* out) {
  if (i >= rows_end<C>(a, b)) {
    for (int c = 0; c < C::head_dim; ++c) out[c] = 0.0f;  // past the end: zeros
    return;
  }
  if constexpr (C::decode) {
    const int64_t n = i / C::pseudo_heads, p = i % C::pseudo_heads;
    if constexpr (R == Role::query) mixedRow<C, R>(a, b, n - a.cache_len[b], h, p, out);
    else cachedRow<C, R>(a, b, n, h, p, out);
  } else if constexpr (Mixed) {
    mixedRow<C, R>(a, b, i / C::pseudo_heads, h, i % C::pseudo_heads, out);
  } else {
    constexpr int heads = R == Role::query ? C::heads : C::kv_heads;
    const float* ws = static_cast<const float*>(R == Role::query ? a.q_mixed : R == Role::key ? a.k_mixed : a.v_mixed);
    std::memcpy(out, ws + ((b * heads + h) * seq_len<C>(a) + i) * C::head_dim, sizeof(float) * C::head_dim);
  }
}

// The row index, in o_pseudo and lse, of virtual row `row` of sequence b:
// a decode step keeps only its own T * P rows.
template <class C>
int64_t storedRow(const IhaArgs& a, int64_t row, int64_t b) {
  return C::decode ? row - cached_rows<C>(a, b) : row;
}

}  // namespace host

inline int64_t block_x(const IhaArgs&) { return host::cta.x; }
inline int64_t block_y(const IhaArgs&) { return host::cta.y; }
inline int64_t block_z(const IhaArgs& a) { return a.batch_offset + host::cta.z; }

//===----------------------------------------------------------------------===//
// Tiles. On the GPU a QTile and the K/V pipeline live in shared memory, the
// score, softmax and accumulator tiles in registers spread over the warps.
//===----------------------------------------------------------------------===//

template <class C>
struct QTile {
  std::vector<float> x = std::vector<float>(size_t(C::block_m) * C::head_dim);
  bool live[C::block_m];  // a row of the sequence (not padding past its end or its stacked heads)
  bool issued = false;    // q_begin ran, q_wait not yet
  bool ready = false;     // q_wait ran: mma_qk may read x
  float* row(int r) { return &x[size_t(r) * C::head_dim]; }
};

template <class C>
struct KvPipeline {
  std::vector<float> k = std::vector<float>(size_t(C::stages) * C::block_n * C::head_dim);
  std::vector<float> v = std::vector<float>(size_t(C::stages) * C::block_n * C::head_dim);
  int64_t holds[C::stages];  // key block in each stage, -1 when free
  int columns[C::stages];    // its rows before the sequence's end (the rest are zeros, scored -inf)
  KvPipeline() {
    std::fill(holds, holds + C::stages, int64_t(-1));
    std::fill(columns, columns + C::stages, C::block_n);
  }
  float* key(int64_t block, int r) { return &k[(size_t(block % C::stages) * C::block_n + r) * C::head_dim]; }
  float* value(int64_t block, int r) { return &v[(size_t(block % C::stages) * C::block_n + r) * C::head_dim]; }
};

template <class C>
struct ScoreTile {
  std::vector<float> s = std::vector<float>(size_t(C::block_m) * C::block_n);
  float& at(int r, int c) { return s[size_t(r) * C::block_n + c]; }
};

template <class C>
struct SoftmaxState {
  float m[C::block_m];  // running row max of scaled scores
  float l[C::block_m];  // running softmax denominator
};

template <class C>
struct AccTile {
  std::vector<float> o = std::vector<float>(size_t(C::block_m) * C::head_dim);
  float* row(int r) { return &o[size_t(r) * C::head_dim]; }
};

// A fused global collapse's output: every head of the block's tokens.
template <class C>
struct OutTile {
  std::vector<float> o = std::vector<float>(size_t(C::block_m / C::pseudo_heads) * C::heads * C::head_dim);
  float* at(int token, int head) { return &o[(size_t(token) * C::heads + head) * C::head_dim]; }
};

//===----------------------------------------------------------------------===//
// Pre-mix and collapse launches (token-parallel)
//===----------------------------------------------------------------------===//

template <class C, Role R>
void premix(const IhaArgs& a, int64_t token0, int64_t b) {
  constexpr int heads = R == Role::query ? C::heads : C::kv_heads;
  float* ws = static_cast<float*>(R == Role::query ? a.q_mixed : R == Role::key ? a.k_mixed : a.v_mixed);
  const int64_t L = seq_len<C>(a);
  for (int64_t n = token0; n < token0 + C::block_m / C::pseudo_heads && n < a.tokens; ++n)
    for (int h = 0; h < heads; ++h)
      for (int p = 0; p < C::pseudo_heads; ++p)
        host::mixedRow<C, R>(a, b, n, h, p, ws + ((b * heads + h) * L + n * C::pseudo_heads + p) * C::head_dim);
}

// A decode step's new tokens into the paged cache: token n of the step goes
// to position cache_len[b] + n, as the raw k and v, or mixed (keys
// normalised and rotated there) into a mixed cache, in the dtype.
template <class C>
void append_cache(const IhaArgs& a, int64_t token0, int64_t b) {
  constexpr int P = C::pseudo_heads, D = C::head_dim, G = C::kv_heads;
  for (int64_t n = token0; n < token0 + C::block_m / P && n < step_tokens<C>(a, b); ++n) {
    const int64_t slot = cache_slot(a, b, a.cache_len[b] + n);
    for (int g = 0; g < G; ++g) {
      if constexpr (C::mixed_cache) {
        float row[D];
        for (int p = 0; p < P; ++p) {
          const int64_t base = ((slot * G + g) * P + p) * D;
          host::mixedRow<C, Role::key>(a, b, n, g, p, row);
          for (int c = 0; c < D; ++c) host::storeElement<C>(a.k_cache, base + c, row[c]);
          host::mixedRow<C, Role::value>(a, b, n, g, p, row);
          for (int c = 0; c < D; ++c) host::storeElement<C>(a.v_cache, base + c, row[c]);
        }
      } else {
        const int64_t base = (slot * G + g) * D;
        const int64_t k = token_offset<C>(a, a.k_stride, b, n) + g * a.k_stride[2];
        const int64_t v = token_offset<C>(a, a.v_stride, b, n) + g * a.v_stride[2];
        for (int c = 0; c < D; ++c) {
          host::storeElement<C>(a.k_cache, base + c, host::loadElement<C>(a.k, k + c));
          host::storeElement<C>(a.v_cache, base + c, host::loadElement<C>(a.v, v + c));
        }
      }
    }
  }
}

template <class C>
void collapse_rows(const IhaArgs& a, int64_t token0, int64_t b) {
  const int64_t L = seq_len<C>(a);
  constexpr int P = C::pseudo_heads, D = C::head_dim;
  for (int64_t n = token0; n < token0 + C::block_m / P && n < step_tokens<C>(a, b); ++n)
    for (int h = 0; h < C::heads; ++h) {
      float sum[D] = {};
      for (int source = 0; source < C::heads; ++source) {
        if (C::collapse == Collapse::per_head && source != h) continue;
        for (int p = 0; p < P; ++p) {
          const float w = C::collapse == Collapse::per_head ? a.collapse[h * P + p]
                                                            : a.collapse[(h * C::heads + source) * P + p];
          const float* o = static_cast<const float*>(a.o_pseudo) + ((b * C::heads + source) * L + n * P + p) * D;
          for (int c = 0; c < D; ++c) sum[c] += w * o[c];
        }
      }
      const int64_t base = token_offset<C>(a, a.out_stride, b, n) + h * a.out_stride[2];
      for (int c = 0; c < D; ++c) host::storeElement<C>(a.out, base + c, sum[c]);
    }
}

//===----------------------------------------------------------------------===//
// The attention launch
//===----------------------------------------------------------------------===//

// Q's load in two steps around the K/V prologue, as on the GPU: q_begin
// starts it, q_wait completes it; mma_qk checks the order.
template <class C, bool Mixed>
void q_begin(QTile<C>& q, const IhaArgs& a, int64_t row0, int64_t head, int64_t b) {
  static_assert(C::stacked_heads == 1 || Mixed, "stacked heads mix their queries as they load");
  host::stats.ctas++;
  for (int r = 0; r < C::block_m; ++r) {
    const CtaRow t = ctaRow<C>(r);
    q.live[r] = (C::stacked_heads == 1 || t.owned) && row0 + t.row < rows_end<C>(a, b);
    if (C::stacked_heads > 1 && !t.owned) {  // past the stacked heads' rows: zeros
      std::fill(q.row(r), q.row(r) + C::head_dim, 0.0f);
      continue;
    }
    host::virtualRow<C, Role::query, Mixed>(a, b, head + t.head, row0 + t.row, q.row(r));
  }
  q.issued = true;
  q.ready = false;
}

template <class C, bool Mixed>
void q_wait(QTile<C>& q, const IhaArgs&, int64_t, int64_t, int64_t) {
  if (!q.issued) host::fail("q_wait without a q_begin before it");
  q.issued = false;
  q.ready = true;
}

// Warp-specialised consumers load Q in one step.
template <class C, bool Mixed>
void load_q(QTile<C>& q, const IhaArgs& a, int64_t row0, int64_t head, int64_t b) {
  q_begin<C, Mixed>(q, a, row0, head, b);
  q_wait<C, Mixed>(q, a, row0, head, b);
}

template <class C>
void softmax_init(SoftmaxState<C>& state, AccTile<C>& acc) {
  for (int r = 0; r < C::block_m; ++r) {
    state.m[r] = -std::numeric_limits<float>::infinity();
    state.l[r] = 0.0f;
  }
  std::fill(acc.o.begin(), acc.o.end(), 0.0f);
}

namespace host {

// The async copy of key block `block` into its stage (cp.async / TMA on the GPU).
template <class C, bool Mixed>
void loadKv(KvPipeline<C>& pipe, const IhaArgs& a, int64_t g, int64_t b, int64_t block) {
  const int slot = int(block % C::stages);
  if (pipe.holds[slot] != -1) host::fail("K/V stage overwritten before it was released");
  for (int r = 0; r < C::block_n; ++r) {
    host::virtualRow<C, Role::key, Mixed>(a, b, g, block * C::block_n + r, pipe.key(block, r));
    host::virtualRow<C, Role::value, Mixed>(a, b, g, block * C::block_n + r, pipe.value(block, r));
  }
  pipe.holds[slot] = block;
  pipe.columns[slot] = int(std::clamp<int64_t>(rows_end<C>(a, b) - block * C::block_n, 0, C::block_n));
}

}  // namespace host

// Pipeline prologue: the first stages - 1 blocks of [lower, upper).
template <class C, bool Mixed>
void kv_begin(KvPipeline<C>& pipe, const IhaArgs& a, int64_t g, int64_t b, int64_t lower, int64_t upper) {
  for (int s = 0; s < C::stages; ++s) pipe.holds[s] = -1;
  for (int64_t block = lower; block < lower + C::stages - 1 && block < upper; ++block)
    host::loadKv<C, Mixed>(pipe, a, g, b, block);
}

template <class C, bool Mixed>
void kv_produce(KvPipeline<C>& pipe, const IhaArgs& a, int64_t g, int64_t b, int64_t block, int64_t upper) {
  if (block < upper) host::loadKv<C, Mixed>(pipe, a, g, b, block);
}

template <class C, bool Mixed>
void kv_wait(KvPipeline<C>& pipe, const IhaArgs& a, int64_t g, int64_t b, int64_t block) {
  if (host::part == host::Part::consumer) {  // the block must be the producer's next
    if (host::streamed.empty()) host::fail("consumer waits for a key block the producer never streamed");
    const host::Streamed next = host::streamed.front();
    if (next.head != g || next.batch != b || next.block != block)
      host::fail("consumer waits for a different key block than the producer streamed next");
    host::streamed.pop_front();
    host::loadKv<C, Mixed>(pipe, a, g, b, block);  // the full barrier completes
  } else if (C::stages == 1) {
    host::loadKv<C, Mixed>(pipe, a, g, b, block);  // no prefetch: load now
  }
  if (pipe.holds[block % C::stages] != block) host::fail("K/V block consumed before it was produced");
}

//===--- warp specialisation (engine wgmma), run as two parts per CTA ----===//

template <class C>
void pipeline_init() {}

template <class C>
bool is_producer() {
  if (host::part == host::Part::whole) host::fail("a warp-specialised program runs as producer, then consumer");
  return host::part == host::Part::producer;
}

template <class C>
void producer_start() {}

template <class C>
void consumer_start() {}

// The producer's step: key block `block` of kv head g enters the pipeline.
template <class C, bool Mixed>
void kv_load(KvPipeline<C>&, const IhaArgs&, int64_t g, int64_t b, int64_t block) {
  host::streamed.push_back({g, b, block});
}

template <class C>
void kv_finish(KvPipeline<C>&, AccTile<C>&) {}

template <class C>
void kv_release(KvPipeline<C>& pipe, int64_t block) {
  pipe.holds[block % C::stages] = -1;
}

template <class C>
void mma_qk(ScoreTile<C>& s, QTile<C>& q, KvPipeline<C>& pipe, int64_t block);

// Warp-specialised form: the accumulator only orders registers on the GPU.
template <class C>
void mma_qk(ScoreTile<C>& s, QTile<C>& q, KvPipeline<C>& pipe, int64_t block, AccTile<C>&) {
  mma_qk(s, q, pipe, block);
}

// S = scale * Q K^T for one key block; columns past the sequence's end
// (the stage's zero rows, which mask_scores sets to -inf in any case) are
// -inf without their products, and so are the rows of no query (past the
// end, or of no stacked head: never stored, their probabilities all 0).
template <class C>
void mma_qk(ScoreTile<C>& s, QTile<C>& q, KvPipeline<C>& pipe, int64_t block) {
  if (!q.ready) host::fail("S = Q K^T before Q's load completed (q_wait)");
  host::stats.key_blocks++;
  const int columns = pipe.columns[block % C::stages];
  for (int r = 0; r < C::block_m; ++r)
    for (int c = 0; c < C::block_n; ++c) {
      if (c >= columns || !q.live[r]) {
        s.at(r, c) = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float* qr = q.row(r);
      const float* kr = pipe.key(block, c);
      float dot = 0.0f;
      for (int d = 0; d < C::head_dim; ++d) dot += qr[d] * kr[d];
      s.at(r, c) = dot * C::scale;
    }
}

// Disallowed pairs and columns past the end get -inf. LowerEdge: a block
// before the interior whose keys the compiler proved are all at or before
// each row's last and before the end (iha.kv_loop's lower_edge): only keys
// below a row's first are hidden.
template <class C, bool LowerEdge = false>
void mask_scores(ScoreTile<C>& s, const IhaArgs& a, int64_t row0, int64_t block) {
  host::stats.masked_blocks++;
  const int64_t L = rows_end<C>(a, block_z(a));
  for (int r = 0; r < C::block_m; ++r)
    for (int c = 0; c < C::block_n; ++c) {
      const int64_t i = row0 + ctaRow<C>(r).row, j = block * C::block_n + c;
      const bool hidden =
          LowerEdge ? j < visibleColumns<C>(a, i).lo : (j >= L || !visible<C>(a, i, j));
      if (hidden) s.at(r, c) = -std::numeric_limits<float>::infinity();
    }
}

// Online softmax: new row max, rescale the accumulator and denominator by
// exp(old max - new max), turn scores into probabilities in place. Masked:
// the block's mask may leave a row no key (the device tiles test for it only
// then; here every row is tested).
template <class C, bool Masked = true>
void softmax_update(SoftmaxState<C>& state, ScoreTile<C>& s, AccTile<C>& acc) {
  for (int r = 0; r < C::block_m; ++r) {
    float rowMax = state.m[r];
    for (int c = 0; c < C::block_n; ++c) rowMax = std::max(rowMax, s.at(r, c));
    if (rowMax == -std::numeric_limits<float>::infinity()) {  // nothing allowed yet
      for (int c = 0; c < C::block_n; ++c) s.at(r, c) = 0.0f;
      continue;
    }
    const float correction = std::exp(state.m[r] - rowMax);
    float sum = 0.0f;
    for (int c = 0; c < C::block_n; ++c) {
      float& x = s.at(r, c);
      x = x == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(x - rowMax);  // exp(-inf) is 0
      sum += x;
    }
    state.l[r] = state.l[r] * correction + sum;
    state.m[r] = rowMax;
    float* o = acc.row(r);
    for (int d = 0; d < C::head_dim; ++d) o[d] *= correction;
  }
}

// acc += P V for one key block.
template <class C>
void mma_pv(AccTile<C>& acc, ScoreTile<C>& s, KvPipeline<C>& pipe, int64_t block) {
  for (int r = 0; r < C::block_m; ++r) {
    float* o = acc.row(r);
    for (int c = 0; c < C::block_n; ++c) {
      const float p = s.at(r, c);
      if (p == 0.0f) continue;
      const float* vr = pipe.value(block, c);
      for (int d = 0; d < C::head_dim; ++d) o[d] += p * vr[d];
    }
  }
}

template <class C>
void normalize(SoftmaxState<C>& state, AccTile<C>& acc) {
  for (int r = 0; r < C::block_m; ++r) {
    if (state.l[r] == 0.0f) continue;
    const float inverse = 1.0f / state.l[r];
    float* o = acc.row(r);
    for (int d = 0; d < C::head_dim; ++d) o[d] *= inverse;
  }
}

namespace host {
template <class C>
void storeLse(SoftmaxState<C>& state, const IhaArgs& a, int64_t row0, int64_t head, int64_t b) {
  if (!a.lse) return;
  const int64_t L = seq_len<C>(a), first = host::storedRow<C>(a, row0, b);
  for (int r = 0; r < C::block_m; ++r) {
    const CtaRow t = ctaRow<C>(r);
    if (t.owned && first + t.row < L)
      a.lse[(b * C::heads + head + t.head) * L + first + t.row] = state.m[r] + std::log(state.l[r]);
  }
}
}  // namespace host

template <class C>
void store_rows(AccTile<C>& acc, SoftmaxState<C>& state, const IhaArgs& a, int64_t row0, int64_t head, int64_t b) {
  const int64_t L = seq_len<C>(a), first = host::storedRow<C>(a, row0, b);
  for (int r = 0; r < C::block_m; ++r) {
    const CtaRow t = ctaRow<C>(r);
    if (t.owned && first + t.row < L)
      std::memcpy(static_cast<float*>(a.o_pseudo) + ((b * C::heads + head + t.head) * L + first + t.row) * C::head_dim,
                  acc.row(r), sizeof(float) * C::head_dim);
  }
  host::storeLse<C>(state, a, row0, head, b);
}

// A split CTA's share: its rows o / l and their lse (-inf for a share
// without an allowed key) into the splits workspace.
template <class C>
void store_split(AccTile<C>& acc, SoftmaxState<C>& state, const IhaArgs& a, int64_t row0, int64_t head, int64_t b,
                 int64_t split) {
  const int64_t L = seq_len<C>(a), first = host::storedRow<C>(a, row0, b);
  for (int r = 0; r < C::block_m; ++r) {
    const CtaRow t = ctaRow<C>(r);
    if (!t.owned || first + t.row >= L) continue;
    float* row = split_row<C>(a, b, head + t.head, split, first + t.row);
    std::memcpy(row, acc.row(r), sizeof(float) * C::head_dim);
    row[C::head_dim] = state.l[r] > 0.0f ? state.m[r] + std::log(state.l[r]) : -INFINITY;
  }
}

// The combine: each row of the CTA's tokens weighs its splits by e^(lse_s - M).
template <class C>
void combine_splits(const IhaArgs& a, int64_t token0, int64_t b) {
  constexpr int P = C::pseudo_heads, D = C::head_dim, S = C::kv_splits;
  const int64_t L = seq_len<C>(a);
  for (int64_t i = token0 * P; i < (token0 + C::block_m / P) * P && i < step_tokens<C>(a, b) * P; ++i)
    for (int h = 0; h < C::heads; ++h) {
      float most = -INFINITY;
      for (int s = 0; s < S; ++s) most = std::max(most, split_row<C>(a, b, h, s, i)[D]);
      float o[D] = {}, total = 0.0f;
      if (most != -INFINITY)
        for (int s = 0; s < S; ++s) {
          const float* row = split_row<C>(a, b, h, s, i);
          const float weight = std::exp(row[D] - most);
          if (weight == 0.0f) continue;  // (a share without keys: its row is 0 / 0)
          total += weight;
          for (int c = 0; c < D; ++c) o[c] += weight * row[c];
        }
      float* out = static_cast<float*>(a.o_pseudo) + ((b * C::heads + h) * L + i) * D;
      for (int c = 0; c < D; ++c) out[c] = total > 0.0f ? o[c] / total : 0.0f;
      if (a.lse) a.lse[(b * C::heads + h) * L + i] = total > 0.0f ? most + std::log(total) : -INFINITY;
    }
}

// per_head collapse in the epilogue: over the whole tokens the block owns.
template <class C>
void store_collapsed(AccTile<C>& acc, SoftmaxState<C>& state, const IhaArgs& a, int64_t row0, int64_t head,
                     int64_t b) {
  constexpr int P = C::pseudo_heads, tokens = C::cta_rows / P;  // a head's tokens (whole: cta_rows % P == 0)
  for (int t = 0; t < C::stacked_heads * tokens; ++t) {
    const int64_t n = host::storedRow<C>(a, row0, b) / P + t % tokens, h = head + t / tokens;
    if (n >= step_tokens<C>(a, b)) continue;
    const int64_t base = token_offset<C>(a, a.out_stride, b, n) + h * a.out_stride[2];
    for (int d = 0; d < C::head_dim; ++d) {
      float sum = 0.0f;
      for (int p = 0; p < P; ++p) sum += a.collapse[h * P + p] * acc.row(t * P + p)[d];
      host::storeElement<C>(a.out, base + d, sum);
    }
  }
  host::storeLse<C>(state, a, row0, head, b);
}

template <class C>
void out_init(OutTile<C>& out) {
  std::fill(out.o.begin(), out.o.end(), 0.0f);
}

// Global collapse, fused: this head's share of every output head.
template <class C>
void accumulate_collapsed(OutTile<C>& out, AccTile<C>& acc, SoftmaxState<C>& state, const IhaArgs& a, int64_t row0,
                          int64_t head, int64_t b) {
  static_assert(C::stacked_heads == 1, "a fused global collapse loops over the heads itself");
  constexpr int P = C::pseudo_heads;
  for (int t = 0; t < C::block_m / P; ++t)
    for (int h = 0; h < C::heads; ++h) {
      float* target = out.at(t, h);
      for (int p = 0; p < P; ++p) {
        const float w = a.collapse[(h * C::heads + head) * P + p];
        const float* o = acc.row(t * P + p);
        for (int d = 0; d < C::head_dim; ++d) target[d] += w * o[d];
      }
    }
  host::storeLse<C>(state, a, row0, head, b);
}

template <class C>
void store_out(OutTile<C>& out, const IhaArgs& a, int64_t row0, int64_t b) {
  constexpr int P = C::pseudo_heads;
  for (int t = 0; t < C::block_m / P; ++t) {
    const int64_t n = host::storedRow<C>(a, row0, b) / P + t;
    if (n >= step_tokens<C>(a, b)) break;
    for (int h = 0; h < C::heads; ++h) {
      const int64_t base = token_offset<C>(a, a.out_stride, b, n) + h * a.out_stride[2];
      for (int d = 0; d < C::head_dim; ++d) host::storeElement<C>(a.out, base + d, out.at(t, h)[d]);
    }
  }
}


//===----------------------------------------------------------------------===//
// The backward (docs/IHA.md, Backward; docs/compiler.md, The backward). Its
// launches run after the pre-mix and the forward's attention, which leave
// the mixed rows, the pseudo outputs o and lse in their workspaces.
//===----------------------------------------------------------------------===//

namespace host {

// Row i of head h of a float workspace [B, heads, L, width].
inline float* workspaceRow(void* base, int64_t b, int64_t heads, int64_t h, int64_t L, int64_t i, int64_t width) {
  return static_cast<float*>(base) + ((b * heads + h) * L + i) * width;
}

// Rows [first, first + count) of head h of a float workspace; zeros past L.
inline void loadRows(void* base, int64_t b, int64_t heads, int64_t h, int64_t L, int64_t first, int count, int width,
                     float* out) {
  for (int r = 0; r < count; ++r) {
    if (first + r < L) std::memcpy(out + size_t(r) * width, workspaceRow(base, b, heads, h, L, first + r, width),
                                   sizeof(float) * width);
    else std::fill(out + size_t(r) * width, out + size_t(r + 1) * width, 0.0f);
  }
}

// *target += value, atomically: CTAs of other key blocks add to the same
// dq rows at once (atomicAdd on the GPU).
inline void atomicAdd(float* target, float value) {
  auto* word = reinterpret_cast<uint32_t*>(target);
  uint32_t seen = __atomic_load_n(word, __ATOMIC_RELAXED);
  for (;;) {
    float current;
    std::memcpy(&current, &seen, sizeof current);
    const float sum = current + value;
    uint32_t next;
    std::memcpy(&next, &sum, sizeof next);
    if (__atomic_compare_exchange_n(word, &seen, next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return;
  }
}

}  // namespace host

// The collapse backward for the CTA's tokens: do = collapse^T dout per
// pseudo row, D = rowsum(do * o), and this CTA's dcollapse[target, source,
// p] = sum over its tokens of dout[n, target] . o[source][n*P + p].
template <class C>
void collapse_grad(const IhaArgs& a, int64_t token0, int64_t b) {
  constexpr int P = C::pseudo_heads, D = C::head_dim;
  const int64_t L = seq_len<C>(a);
  float* partial = partials::slot<C>(a, token0, b);
  std::fill(partial, partial + partials::collapse_entries<C>(), 0.0f);
  for (int64_t n = token0; n < token0 + partials::tokens_per_cta<C>() && n < a.tokens; ++n)
    for (int source = 0; source < C::heads; ++source)
      for (int p = 0; p < P; ++p) {
        const int64_t i = n * P + p;
        float* dO = host::workspaceRow(a.do_pseudo, b, C::heads, source, L, i, D);
        const float* o = host::workspaceRow(a.o_pseudo, b, C::heads, source, L, i, D);
        std::fill(dO, dO + D, 0.0f);
        for (int target = 0; target < C::heads; ++target) {
          const int64_t at = partials::collapse_index<C>(target, source, p);
          if (at < 0) continue;
          const int64_t base = b * a.out_stride[0] + n * a.out_stride[1] + target * a.out_stride[2];
          float dot = 0.0f;
          for (int c = 0; c < D; ++c) {
            const float g = host::loadElement<C>(a.dout, base + c);
            dO[c] += a.collapse[at] * g;
            dot += g * o[c];
          }
          partial[at] += dot;
        }
        float delta = 0.0f;
        for (int c = 0; c < D; ++c) delta += dO[c] * o[c];
        a.delta[(b * C::heads + source) * L + i] = delta;
        if (C::atomic_dq) std::fill_n(host::workspaceRow(a.dq_pseudo, b, C::heads, source, L, i, D), D, 0.0f);
      }
}

namespace host {
// The gradient columns [first, last) of a CTA's part of a head, of `parts`
// (layout.h, backwardColumnParts, or the dq launch's backwardDqParts; every
// column where the head is one part).
struct PartColumns {
  int first = 0, last = 0;
};
template <class C>
PartColumns partColumns(int64_t part, int parts = backwardColumnParts(C::head_dim, C::wgmma_backward)) {
  const int width = paddedHeadDim(C::head_dim) / parts, first = int(part) * width;
  return {first, std::min(first + width, C::head_dim)};
}
}  // namespace host

// A key block's K and V rows, and its dK and dV accumulators (the part's
// columns).
template <class C>
struct KvGradTile {
  int64_t col0 = 0;
  host::PartColumns part;
  std::vector<float> k = std::vector<float>(size_t(C::block_n) * C::head_dim);
  std::vector<float> v = std::vector<float>(size_t(C::block_n) * C::head_dim);
  std::vector<float> dk = std::vector<float>(size_t(C::block_n) * C::head_dim);
  std::vector<float> dv = std::vector<float>(size_t(C::block_n) * C::head_dim);
};

// A query block's Q and do rows, lse and D.
template <class C>
struct QGradTile {
  int64_t row0 = 0, head = 0, batch = 0;
  int64_t lse_rows = 0;  // the sequence's rows, L
  std::vector<float> q = std::vector<float>(size_t(C::block_m) * C::head_dim);
  std::vector<float> dO = std::vector<float>(size_t(C::block_m) * C::head_dim);
  float lse[C::block_m];
  float delta[C::block_m];
};

// P and dS of one (query block, key block) pair (registers on the GPU).
template <class C>
struct BwdScores {
  std::vector<float> p = std::vector<float>(size_t(C::block_m) * C::block_n);
  std::vector<float> ds = std::vector<float>(size_t(C::block_m) * C::block_n);
  float& at(int r, int c) { return p[size_t(r) * C::block_n + c]; }
  float& dsAt(int r, int c) { return ds[size_t(r) * C::block_n + c]; }
};

// The dq accumulator of a query block (dq separate; the part's columns).
template <class C>
struct DqTile {
  host::PartColumns part;
  std::vector<float> dq = std::vector<float>(size_t(C::block_m) * C::head_dim);
};

// The dq launch's first key block (the CUDA tiles fetch it ahead; the host
// has nothing to overlap), and each block; Ahead marks that loop's calls.
template <class C>
void kv_grad_ahead(KvGradTile<C>&, const IhaArgs&, int64_t, int64_t, int64_t) {}
template <class C, bool Ahead = false>
void load_kv_grad(KvGradTile<C>& kv, const IhaArgs& a, int64_t col0, int64_t g, int64_t b) {
  const int64_t L = seq_len<C>(a);
  kv.col0 = col0;
  host::loadRows(a.k_mixed, b, C::kv_heads, g, L, col0, C::block_n, C::head_dim, kv.k.data());
  host::loadRows(a.v_mixed, b, C::kv_heads, g, L, col0, C::block_n, C::head_dim, kv.v.data());
}

template <class C>
void kv_grad_begin(KvGradTile<C>& kv, const IhaArgs& a, int64_t col0, int64_t g, int64_t b, int64_t part) {
  host::stats.ctas++;
  kv.part = host::partColumns<C>(part);
  load_kv_grad<C>(kv, a, col0, g, b);
  std::fill(kv.dk.begin(), kv.dk.end(), 0.0f);
  std::fill(kv.dv.begin(), kv.dv.end(), 0.0f);
}

// The first query block of the key-block-outer loop's head (the CUDA
// tiles fetch it ahead; the host has nothing to overlap), the end of its
// loops (the CUDA tiles' last copies land), and each block; Ahead marks
// that loop's calls.
template <class C>
void q_grad_ahead(QGradTile<C>&, const IhaArgs&, int64_t, int64_t, int64_t) {}
template <class C>
void q_grad_finish(QGradTile<C>&, const IhaArgs&) {}
template <class C>
void kv_grad_finish(KvGradTile<C>&, const IhaArgs&) {}
template <class C, bool Ahead = false>
void load_q_grad(QGradTile<C>& q, const IhaArgs& a, int64_t row0, int64_t h, int64_t b) {
  const int64_t L = seq_len<C>(a);
  q.row0 = row0;
  q.head = h;
  q.batch = b;
  q.lse_rows = L;
  host::loadRows(a.q_mixed, b, C::heads, h, L, row0, C::block_m, C::head_dim, q.q.data());
  host::loadRows(a.do_pseudo, b, C::heads, h, L, row0, C::block_m, C::head_dim, q.dO.data());
  for (int r = 0; r < C::block_m; ++r) {
    const bool in = row0 + r < L;
    q.lse[r] = in ? a.lse[(b * C::heads + h) * L + row0 + r] : 0.0f;
    q.delta[r] = in ? a.delta[(b * C::heads + h) * L + row0 + r] : 0.0f;
  }
}

// S = scale * Q K^T (the same on the host in either loop: loom::Outer only
// says which rows the GPU's warps own). Rows and columns past the end are
// -inf without their products (bwd_mask sets them so in any case; where it
// does not run, their zero rows of q, do and K gave nothing).
template <class C, Outer>
void bwd_scores(BwdScores<C>& s, QGradTile<C>& q, KvGradTile<C>& kv) {
  host::stats.key_blocks++;
  const int64_t L = q.lse_rows;
  for (int r = 0; r < C::block_m; ++r)
    for (int c = 0; c < C::block_n; ++c) {
      if (q.row0 + r >= L || kv.col0 + c >= L) {
        s.at(r, c) = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float* qr = &q.q[size_t(r) * C::head_dim];
      const float* kr = &kv.k[size_t(c) * C::head_dim];
      float dot = 0.0f;
      for (int d = 0; d < C::head_dim; ++d) dot += qr[d] * kr[d];
      s.at(r, c) = dot * C::scale;
    }
}

// Disallowed pairs, and rows or columns past the end, get -inf.
template <class C, Outer>
void bwd_mask(BwdScores<C>& s, const IhaArgs& a, QGradTile<C>& q, KvGradTile<C>& kv) {
  host::stats.masked_blocks++;
  const int64_t L = seq_len<C>(a);
  for (int r = 0; r < C::block_m; ++r)
    for (int c = 0; c < C::block_n; ++c) {
      const int64_t i = q.row0 + r, j = kv.col0 + c;
      if (i >= L || j >= L || !visible<C>(a, i, j)) s.at(r, c) = -std::numeric_limits<float>::infinity();
    }
}

// P = exp(S - lse): the forward's probabilities, recomputed.
template <class C, Outer>
void bwd_probs(BwdScores<C>& s, QGradTile<C>& q) {
  for (int r = 0; r < C::block_m; ++r)
    for (int c = 0; c < C::block_n; ++c) s.at(r, c) = std::exp(s.at(r, c) - q.lse[r]);
}

// dV += P^T do.
template <class C>
void bwd_dv(KvGradTile<C>& kv, BwdScores<C>& s, QGradTile<C>& q) {
  for (int c = 0; c < C::block_n; ++c) {
    float* dv = &kv.dv[size_t(c) * C::head_dim];
    for (int r = 0; r < C::block_m; ++r) {
      const float p = s.at(r, c);
      if (p == 0.0f) continue;
      const float* dO = &q.dO[size_t(r) * C::head_dim];
      for (int d = kv.part.first; d < kv.part.last; ++d) dv[d] += p * dO[d];
    }
  }
}

// dS = P * (do V^T - D).
template <class C, Outer>
void bwd_ds(BwdScores<C>& s, QGradTile<C>& q, KvGradTile<C>& kv) {
  for (int r = 0; r < C::block_m; ++r)
    for (int c = 0; c < C::block_n; ++c) {
      const float p = s.at(r, c);
      if (p == 0.0f) {
        s.dsAt(r, c) = 0.0f;
        continue;
      }
      const float* dO = &q.dO[size_t(r) * C::head_dim];
      const float* vr = &kv.v[size_t(c) * C::head_dim];
      float dp = 0.0f;
      for (int d = 0; d < C::head_dim; ++d) dp += dO[d] * vr[d];
      s.dsAt(r, c) = p * (dp - q.delta[r]);
    }
}

// dK += scale * dS^T Q.
template <class C>
void bwd_dk(KvGradTile<C>& kv, BwdScores<C>& s, QGradTile<C>& q) {
  for (int c = 0; c < C::block_n; ++c) {
    float* dk = &kv.dk[size_t(c) * C::head_dim];
    for (int r = 0; r < C::block_m; ++r) {
      const float ds = s.dsAt(r, c) * C::scale;
      if (ds == 0.0f) continue;
      const float* qr = &q.q[size_t(r) * C::head_dim];
      for (int d = kv.part.first; d < kv.part.last; ++d) dk[d] += ds * qr[d];
    }
  }
}

namespace host {
// dq rows += scale * dS K, into `rows` (block_m x d), the part's columns.
template <class C>
void addDq(float* rows, BwdScores<C>& s, KvGradTile<C>& kv, PartColumns part) {
  for (int r = 0; r < C::block_m; ++r) {
    float* dq = rows + size_t(r) * C::head_dim;
    for (int c = 0; c < C::block_n; ++c) {
      const float ds = s.dsAt(r, c) * C::scale;
      if (ds == 0.0f) continue;
      const float* kr = &kv.k[size_t(c) * C::head_dim];
      for (int d = part.first; d < part.last; ++d) dq[d] += ds * kr[d];
    }
  }
}
}  // namespace host

// dq += scale * dS K by atomic adds into dq's workspace (dq atomic).
template <class C>
void bwd_dq_atomic(BwdScores<C>& s, QGradTile<C>& q, KvGradTile<C>& kv, const IhaArgs& a, int64_t h, int64_t b) {
  std::vector<float> rows(size_t(C::block_m) * C::head_dim, 0.0f);
  host::addDq<C>(rows.data(), s, kv, kv.part);
  const int64_t L = seq_len<C>(a);
  for (int r = 0; r < C::block_m && q.row0 + r < L; ++r) {
    float* target = host::workspaceRow(a.dq_pseudo, b, C::heads, h, L, q.row0 + r, C::head_dim);
    for (int d = kv.part.first; d < kv.part.last; ++d) host::atomicAdd(target + d, rows[size_t(r) * C::head_dim + d]);
  }
}

template <class C>
void kv_grad_store(KvGradTile<C>& kv, const IhaArgs& a, int64_t col0, int64_t g, int64_t b) {
  const int64_t L = seq_len<C>(a);
  const int first = kv.part.first, width = kv.part.last - first;
  for (int r = 0; r < C::block_n && col0 + r < L; ++r) {
    std::memcpy(host::workspaceRow(a.dk_pseudo, b, C::kv_heads, g, L, col0 + r, C::head_dim) + first,
                &kv.dk[size_t(r) * C::head_dim + first], sizeof(float) * width);
    std::memcpy(host::workspaceRow(a.dv_pseudo, b, C::kv_heads, g, L, col0 + r, C::head_dim) + first,
                &kv.dv[size_t(r) * C::head_dim + first], sizeof(float) * width);
  }
}

template <class C>
void dq_init(DqTile<C>& dq, int64_t part) {
  host::stats.ctas++;
  dq.part = host::partColumns<C>(part, backwardDqParts(C::head_dim, C::wgmma_backward));
  std::fill(dq.dq.begin(), dq.dq.end(), 0.0f);
}

template <class C>
void dq_accumulate(DqTile<C>& dq, BwdScores<C>& s, KvGradTile<C>& kv) {
  host::addDq<C>(dq.dq.data(), s, kv, dq.part);
}

template <class C>
void dq_store(DqTile<C>& dq, const IhaArgs& a, int64_t row0, int64_t h, int64_t b) {
  const int64_t L = seq_len<C>(a);
  const int first = dq.part.first, width = dq.part.last - first;
  for (int r = 0; r < C::block_m && row0 + r < L; ++r)
    std::memcpy(host::workspaceRow(a.dq_pseudo, b, C::heads, h, L, row0 + r, C::head_dim) + first,
                &dq.dq[size_t(r) * C::head_dim + first], sizeof(float) * width);
}

// A role's pseudo-row gradients back to its input for the CTA's tokens:
// RoPE turned back, qk_norm's Jacobian (from the re-mixed row), then the
// transposed mixing into dx (whole rows: the CTA owns its tokens) and this
// CTA's share of dalpha.
template <class C, Role R>
void unmix(const IhaArgs& a, int64_t token0, int64_t b) {
  constexpr int heads = R == Role::query ? C::heads : C::kv_heads;
  constexpr int P = C::pseudo_heads, D = C::head_dim;
  const void* x = R == Role::query ? a.q : R == Role::key ? a.k : a.v;
  const float* alpha = R == Role::query ? a.alpha_q : R == Role::key ? a.alpha_k : a.alpha_v;
  const int64_t* stride = R == Role::query ? a.q_stride : R == Role::key ? a.k_stride : a.v_stride;
  float* dx = R == Role::query ? a.dq : R == Role::key ? a.dk : a.dv;
  void* grads = R == Role::query ? a.dq_pseudo : R == Role::key ? a.dk_pseudo : a.dv_pseudo;
  const int64_t L = seq_len<C>(a);
  float* partial = partials::slot<C>(a, token0, b) + partials::alpha_offset<C, R>();
  std::fill(partial, partial + heads * heads * P, 0.0f);
  float g[D], mixed[D];
  for (int64_t n = token0; n < token0 + partials::tokens_per_cta<C>() && n < a.tokens; ++n) {
    float* rows = dx + (b * a.tokens + n) * heads * D;
    std::fill(rows, rows + heads * D, 0.0f);
    for (int h = 0; h < heads; ++h)
      for (int p = 0; p < P; ++p) {
        const int64_t i = n * P + p;
        std::memcpy(g, host::workspaceRow(grads, b, heads, h, L, i, D), sizeof g);
        if (R != Role::value) {
          // With a rounded RoPE table the norm's input is the turned row:
          // through the norm first, then the turn's transpose.
          if (C::rope_theta > 0 && C::rope_table == 0) host::rotate<C>(g, rope_position<C>(a, i), /*inverse=*/true);
          if (C::qk_norm) {  // dx = r g - (r^3 / d) (x . g) x
            host::mixedRow<C, R>(a, b, n, h, p, mixed, /*mixOnly=*/true);
            if (C::rope_theta > 0 && C::rope_table != 0) host::rotate<C>(mixed, rope_position<C>(a, i));
            float squares = 0.0f, dot = 0.0f;
            for (int c = 0; c < D; ++c) {
              squares += mixed[c] * mixed[c];
              dot += mixed[c] * g[c];
            }
            const float r = 1.0f / std::sqrt(squares / D + C::qk_norm_eps);
            const float k = r * r * r / D * dot;
            for (int c = 0; c < D; ++c) g[c] = r * g[c] - k * mixed[c];
          }
          if (C::rope_theta > 0 && C::rope_table != 0) host::rotate<C>(g, rope_position<C>(a, i), /*inverse=*/true);
        }
        for (int m = 0; m < heads; ++m) {
          const int64_t at = (int64_t(m) * heads + h) * P + p;
          const int64_t base = b * stride[0] + n * stride[1] + m * stride[2];
          float dot = 0.0f;
          for (int c = 0; c < D; ++c) {
            rows[m * D + c] += alpha[at] * g[c];
            dot += host::loadElement<C>(x, base + c) * g[c];
          }
          partial[at] += dot;
        }
      }
  }
}

// Chunk `chunk` of the partial sums, over every token CTA of every batch
// entry in order, into dcollapse and dalpha_q, dalpha_k, dalpha_v.
template <class C>
void reduce_grads(const IhaArgs& a, int64_t chunk, int64_t b) {
  if (b != 0) return;  // one CTA row does it
  constexpr int64_t entries = partials::entries<C>();
  const int64_t slots = a.batch * partials::token_ctas<C>(a);
  for (int64_t e = chunk * kReduceChunk; e < (chunk + 1) * kReduceChunk && e < entries; ++e) {
    float sum = 0.0f;
    for (int64_t slot = 0; slot < slots; ++slot) sum += a.partials[slot * entries + e];
    *partials::destination<C>(a, e) = sum;
  }
}

}  // namespace loom

// Entry points the CPU launcher looks up next to the kernels.
LOOM_KERNEL void loom_host_set_block(int64_t x, int64_t y, int64_t z) { loom::host::cta = {x, y, z}; }
// 0: a whole CTA; 1: the producer part of a warp-specialised CTA; 2: its
// consumer part, after which every streamed block must have been consumed.
LOOM_KERNEL void loom_host_set_part(int part) {
  if (part != 2 && !loom::host::streamed.empty()) {
    loom::host::streamed.clear();
    loom::host::fail("the producer streamed key blocks no consumer took");
  }
  loom::host::part = part == 1 ? loom::host::Part::producer
                     : part == 2 ? loom::host::Part::consumer
                                 : loom::host::Part::whole;
}
LOOM_KERNEL void loom_host_stats(int64_t* keyBlocks, int64_t* maskedBlocks, int64_t* ctas) {
  *keyBlocks = loom::host::stats.key_blocks.exchange(0);
  *maskedBlocks = loom::host::stats.masked_blocks.exchange(0);
  *ctas = loom::host::stats.ctas.exchange(0);
}
