// The tile API's shared part: what a generated IHA program and the runtime
// that launches it agree on. Compiles as host C++ and under NVRTC, so it
// includes no host header when NVRTC compiles it.
//
// A program names only loom:: calls; which implementation it gets depends on
// the header it includes: loom/tile/host.h (plain loops, one CTA at a time)
// or, for CUDA targets, the device implementation.
#pragma once

#ifdef __CUDACC_RTC__
typedef long long int64_t;
typedef int int32_t;
#define LOOM_HOST_DEVICE __host__ __device__
#else
#include <cstdint>
#define LOOM_HOST_DEVICE
#endif

#include "loom/tile/layout.h"

namespace loom {

enum class DType { f32, f16, bf16 };
enum class Mask { flat_causal, token_causal, none };
enum class Collapse { per_head, global };
enum class Role { query, key, value };
// Which loop of the backward a step belongs to: a key block's CTA over
// query blocks (dK, dV), or a query block's CTA over key blocks (dq).
enum class Outer { keys, queries };

// Everything a launch reads and writes. q, k, v and out hold the spec's
// dtype; strides are in elements for (batch, token, head), the head
// dimension is contiguous. Workspaces exist only when the kernel plan lists
// them: q_mixed [B, H, L, d], k_mixed and v_mixed [B, G, L, d], o_pseudo
// [B, H, L, d], of the implementation's element type (float on the host,
// the 16-bit dtype on CUDA). lse [B, H, L] is written when not null.
struct IhaArgs {
  const void* q;
  const void* k;
  const void* v;
  const float* alpha_q;
  const float* alpha_k;
  const float* alpha_v;
  const float* collapse;
  void* out;
  float* lse;
  void* q_mixed;
  void* k_mixed;
  void* v_mixed;
  void* o_pseudo;
  int64_t batch;
  int64_t tokens;
  int64_t q_stride[3];
  int64_t k_stride[3];
  int64_t v_stride[3];
  int64_t out_stride[3];
  // The batch entry of blockIdx.z = 0: a launch covers at most 65535
  // entries (the grid's z limit), so larger batches take several.
  int64_t batch_offset;

  // The backward (docs/IHA.md, Backward), null in a forward plan. dout has
  // out's dtype and strides; the gradients are float, dense [B, N, H|G, d]
  // and the weights' shapes. The workspaces: do_pseudo [B, H, L, d] (the
  // implementation's element type), delta [2, B, H, L] (rowStatsStride),
  // dq_pseudo [B, H, L, d], dk_pseudo and dv_pseudo [B, G, L, d] and partials [B * token CTAs]
  // [partial_entries] (float). lse holds the forward's. A decode plan with
  // kv_splits > 1 keeps its split CTAs' normalised partial rows in partials
  // (the splits workspace): [B, H, kv_splits, T * P, d + 1] float, each
  // row's lse in its last column.
  const void* dout;
  float* dq;
  float* dk;
  float* dv;
  float* dalpha_q;
  float* dalpha_k;
  float* dalpha_v;
  float* dcollapse;
  void* do_pseudo;
  float* delta;
  // The forward's lse in log2 units (lse * log2(e)) for the CUDA backward's
  // recomputed probabilities, written by its prep: the plane before delta's
  // in the delta workspace (setRowStats).
  float* lse_log2;
  float* dq_pseudo;
  float* dk_pseudo;
  float* dv_pseudo;
  float* partials;

  // A decode step (docs/IHA.md, Decode over a paged cache), null elsewhere:
  // tokens is the step's T, q, k, v and out its new tokens'. k_cache and
  // v_cache [num_pages, page_size, G, d] (raw) or [..., G, P, d] (mixed
  // cache), dense, in the dtype; page_table [batch, max_pages] and cache_len
  // [batch], int32. o_pseudo and lse cover the step's T * P rows.
  void* k_cache;
  void* v_cache;
  const int32_t* page_table;
  const int32_t* cache_len;
  int64_t page_size;
  int64_t max_pages;

  // Packed documents (KernelSpec.varlen), null elsewhere: cu_seqlens
  // [documents + 1], int32, ascending from 0 to tokens, the bounds of each
  // document among the launch's tokens (batch 1).
  const int32_t* cu_seqlens;
  int64_t documents;

  // The device's check of a decode step's page table and lengths (a CUDA
  // launch given an error word; null elsewhere): the append launch writes
  // sequence_ok[b], 0 for a sequence whose length or pages (below
  // num_pages, k_cache's) are out of range, and then 1 into *page_errors.
  // The append skips such a sequence and its attention sees no rows
  // (decode_len 0): nothing outside the cache is read or written, and its
  // out is not defined.
  int64_t num_pages;
  int32_t* page_errors;
  int32_t* sequence_ok;

  // A ragged decode step (docs/IHA.md, Ragged steps), null for a uniform
  // one: query_start_loc [batch + 1], int32, ascending from 0, sequence b's
  // new tokens rows query_start_loc[b] .. query_start_loc[b + 1] - 1 of the
  // packed q, k, v and out ([total, H | G, d], their stride[0] unused);
  // tokens is then the most any sequence brings, which the grids and the
  // workspaces count.
  const int32_t* query_start_loc;
};

// The delta workspace's planes (layout.h, rowStatsStride; `workspace`: its
// first float, rows: B * H * L).
LOOM_HOST_DEVICE inline void setRowStats(IhaArgs& args, float* workspace, int64_t rows) {
  args.lse_log2 = workspace;
  args.delta = workspace ? workspace + rowStatsStride(rows) : nullptr;
}


// Integer helpers for block-range arithmetic (divisor > 0).
LOOM_HOST_DEVICE constexpr int64_t floordiv(int64_t a, int64_t b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}
LOOM_HOST_DEVICE constexpr int64_t ceildiv(int64_t a, int64_t b) { return -floordiv(-a, b); }
LOOM_HOST_DEVICE constexpr int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
LOOM_HOST_DEVICE constexpr int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }

// L = N * P, the virtual sequence length.
template <class C>
LOOM_HOST_DEVICE constexpr int64_t seq_len(const IhaArgs& args) {
  return args.tokens * C::pseudo_heads;
}

// A decode step's rows of sequence b: its first new virtual row (the rows
// before are cached), and the end of its rows once the step's T are cached.
template <class C>
LOOM_HOST_DEVICE constexpr int64_t cached_rows(const IhaArgs& args, int64_t b) {
  return int64_t(args.cache_len[b]) * C::pseudo_heads;
}
// Whether the device's page check (IhaArgs::sequence_ok) refused sequence b.
LOOM_HOST_DEVICE inline bool refused_sequence(const IhaArgs& args, int64_t b) {
  return args.sequence_ok && !args.sequence_ok[b];
}
// The new tokens sequence b brings to a decode step: T, or its share of a
// ragged step's packed rows. Elsewhere the launch's N.
template <class C>
LOOM_HOST_DEVICE constexpr int64_t step_tokens(const IhaArgs& args, int64_t b) {
  if constexpr (C::decode)
    if (args.query_start_loc) return int64_t(args.query_start_loc[b + 1]) - args.query_start_loc[b];
  return args.tokens;
}
// The element offset of token n's row (of q, k, v or out, whose strides
// are `stride`) in batch entry b: a ragged step's rows are packed.
template <class C>
LOOM_HOST_DEVICE constexpr int64_t token_offset(const IhaArgs& args, const int64_t* stride, int64_t b, int64_t n) {
  if constexpr (C::decode)
    if (args.query_start_loc) return (int64_t(args.query_start_loc[b]) + n) * stride[1];
  return b * stride[0] + n * stride[1];
}
template <class C>
LOOM_HOST_DEVICE constexpr int64_t decode_len(const IhaArgs& args, int64_t b) {
  return refused_sequence(args, b) ? 0 : (int64_t(args.cache_len[b]) + step_tokens<C>(args, b)) * C::pseudo_heads;
}
// Where the virtual rows of sequence b end: L, or a decode step's
// decode_len (its cached rows and its own).
template <class C>
LOOM_HOST_DEVICE constexpr int64_t rows_end(const IhaArgs& args, int64_t b) {
  return C::decode ? decode_len<C>(args, b) : seq_len<C>(args);
}
// Row i (of the step's T * P) of split s of head h in the splits workspace.
template <class C>
LOOM_HOST_DEVICE inline float* split_row(const IhaArgs& args, int64_t b, int64_t h, int64_t s, int64_t i) {
  return args.partials +
         (((b * C::heads + h) * C::kv_splits + s) * seq_len<C>(args) + i) * int64_t(C::head_dim + 1);
}

// Whether a program's config asks for the absorbed decode step (its
// `absorbed` member; configs without one, the tests' own, do not).
template <class C, class = void>
struct AbsorbedOf {
  static constexpr bool value = false;
};
template <class C>
struct AbsorbedOf<C, decltype(void(C::absorbed))> {
  static constexpr bool value = C::absorbed;
};
template <class C>
constexpr bool kAbsorbed = AbsorbedOf<C>::value;
// Whether it asks for the tensor-mixing decode step (`tensor_mixing`).
template <class C, class = void>
struct TensorMixingOf {
  static constexpr bool value = false;
};
template <class C>
struct TensorMixingOf<C, decltype(void(C::tensor_mixing))> {
  static constexpr bool value = C::tensor_mixing;
};
// The step a config's tiles are for: 0 the general one (cuda.h), 1 the
// absorbed decode step (cuda_absorbed.h), 2 the tensor-mixing one
// (cuda_tensor_mixing.h).
constexpr int kAbsorbedStep = 1, kTensorMixingStep = 2;
template <class C>
constexpr int kDecodeStep = AbsorbedOf<C>::value ? kAbsorbedStep : TensorMixingOf<C>::value ? kTensorMixingStep : 0;

// Tile row r of an attention CTA. A CTA owns cta_rows rows of its head
// (the whole tokens among its block_m; the rows after are the next CTA's);
// a decode CTA with stack_heads holds every query head of a kv group,
// stacked_heads of them, the same cta_rows rows of each, head after head.
// `head` is the offset from the CTA's first head, `row` from its row0, and
// `owned` says whether the CTA stores the row.
struct CtaRow {
  int head, row;
  bool owned;
};
template <class C>
LOOM_HOST_DEVICE constexpr CtaRow ctaRow(int r) {
  if constexpr (C::stacked_heads == 1) return {0, r, r < C::cta_rows};
  else return {r / C::cta_rows, r % C::cta_rows, r < C::stacked_heads * C::cta_rows};
}

// The cache slot (page * page_size + offset) of token `token` of sequence b,
// its page's index in the sequence given.
LOOM_HOST_DEVICE inline int64_t slot_in_page(const IhaArgs& args, int64_t b, int32_t token, int32_t page) {
  return int64_t(args.page_table[b * args.max_pages + page]) * args.page_size + (token - page * int32_t(args.page_size));
}
// The cache slot of token t of sequence b.
LOOM_HOST_DEVICE inline int64_t cache_slot(const IhaArgs& args, int64_t b, int64_t t) {
  // A sequence's positions are below 2^31: 32-bit division (a 64-bit one is
  // a subroutine call on the device).
  return slot_in_page(args, b, int32_t(t), int32_t(t) / int32_t(args.page_size));
}

// n / d for 0 <= n < 2^31 and a divisor d >= 1 fixed for a launch, by a
// multiply-high, an add and a shift (Granlund and Montgomery's round-up
// method, as CUTLASS's FastDivmod): the decode loops find a page per token.
struct FastDivider {
  unsigned magic = 1;
  int shift = 0;
};
LOOM_HOST_DEVICE inline FastDivider fastDivider(int32_t d) {
  int l = 0;
  while ((int64_t(1) << l) < d) ++l;  // ceil(log2 d)
  using U64 = unsigned long long;
  const U64 m = ((U64(1) << 32) * ((U64(1) << l) - U64(d))) / U64(d) + 1;
  return {unsigned(m), l};
}
LOOM_HOST_DEVICE inline int32_t divide(int32_t n, const FastDivider& f) {
  const unsigned high = unsigned((static_cast<unsigned long long>(f.magic) * unsigned(n)) >> 32);
  return int32_t((high + unsigned(n)) >> f.shift);
}
// cache_slot with the launch's page size as a FastDivider.
LOOM_HOST_DEVICE inline int64_t cache_slot(const IhaArgs& args, int64_t b, int64_t t, const FastDivider& pages) {
  return slot_in_page(args, b, int32_t(t), divide(int32_t(t), pages));
}

// docs/IHA.md step 4: may virtual row i attend to virtual row j? With the
// options: window_rows (flat_causal, a window in virtual rows) and a window
// aligned to tokens (0 <= tok(i) - tok(j) < W beside the mode's own rule).
// `Int` is int64_t, or int where the caller knows L < 2^31 (the device's
// masks: half the registers and no 64-bit division).
template <class C, class Int = int64_t>
LOOM_HOST_DEVICE constexpr bool allowed(Int i, Int j) {
  const Int P = C::pseudo_heads, W = C::window;
  const Int ti = i / P, tj = j / P;
  if (C::window_rows > 0) return j <= i && i - j < C::window_rows;
  if (C::window_token_aligned && W > 0) {
    const bool own = C::mask == Mask::flat_causal ? j <= i : C::mask == Mask::token_causal ? tj <= ti : true;
    return own && tj <= ti && ti - tj < W;
  }
  if (C::mask == Mask::flat_causal) return j <= i && (W == 0 || i - j < W * P);
  if (C::mask == Mask::token_causal) return tj <= ti && (W == 0 || ti - tj < W);
  return W == 0 || (ti > tj ? ti - tj : tj - ti) < W;
}

// The keys row i may see, as one interval: allowed<C>(i, j) holds exactly
// for lo <= j <= hi (every mask rule allows a contiguous run of keys), so a
// masked block costs two comparisons an element (one without a window).
template <class Int>
struct ColumnRange {
  Int lo, hi;
};
template <class C, class Int = int64_t>
LOOM_HOST_DEVICE constexpr ColumnRange<Int> allowedColumns(Int i) {
  const Int P = C::pseudo_heads, W = C::window;
  const Int ti = i / P;
  const Int tokenEnd = ti * P + P - 1;  // the last row of i's token
  if (C::window_rows > 0) return {i - C::window_rows + 1, i};
  if (C::window_token_aligned && W > 0)
    return {(ti - W + 1) * P, C::mask == Mask::flat_causal ? i : tokenEnd};
  if (C::mask == Mask::flat_causal) return {W == 0 ? Int(0) : i - W * P + 1, i};
  if (C::mask == Mask::token_causal) return {W == 0 ? Int(0) : (ti - W + 1) * P, tokenEnd};
  if (W == 0) return {Int(0), i + (Int(1) << (sizeof(Int) * 8 - 3))};
  return {(ti - W + 1) * P, (ti + W - 1) * P + P - 1};
}
// Varlen: the document holding `token`, [begin, end) in tokens, by a binary
// search of cu_seqlens (invariant cu[lo] <= token < cu[hi], so empty
// documents are stepped over): log2 of the documents' count in loads, made
// where a row's document is needed (a CTA's block ranges, masked blocks'
// rows, rotated rows), never in an unmasked block.
struct TokenRange {
  int begin, end;
};
LOOM_HOST_DEVICE inline TokenRange document_of(const IhaArgs& a, int64_t token) {
  int lo = 0, hi = int(a.documents);
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (a.cu_seqlens[mid] <= token) lo = mid;
    else hi = mid;
  }
  return {a.cu_seqlens[lo], a.cu_seqlens[lo + 1]};
}
// The virtual rows of the document holding virtual row i: its first, and
// one past its last.
template <class C>
LOOM_HOST_DEVICE inline int64_t document_first(const IhaArgs& a, int64_t i) {
  return int64_t(document_of(a, i / C::pseudo_heads).begin) * C::pseudo_heads;
}
template <class C>
LOOM_HOST_DEVICE inline int64_t document_end(const IhaArgs& a, int64_t i) {
  return int64_t(document_of(a, i / C::pseudo_heads).end) * C::pseudo_heads;
}
// RoPE's position of virtual row i: i, or with varlen its row within its
// document (positions restart in each).
template <class C>
LOOM_HOST_DEVICE inline int64_t rope_position(const IhaArgs& a, int64_t i) {
  if constexpr (C::varlen) return i - document_first<C>(a, i);
  else return i;
}
// allowedColumns within row i's document (varlen), the keys a masked block
// lets row i see.
template <class C, class Int = int64_t>
LOOM_HOST_DEVICE inline ColumnRange<Int> visibleColumns(const IhaArgs& a, Int i) {
  ColumnRange<Int> range = allowedColumns<C, Int>(i);
  if constexpr (C::varlen) {
    const TokenRange doc = document_of(a, i / C::pseudo_heads);
    const Int first = Int(doc.begin) * C::pseudo_heads, last = Int(doc.end) * C::pseudo_heads - 1;
    range.lo = range.lo > first ? range.lo : first;
    range.hi = range.hi < last ? range.hi : last;
  }
  return range;
}
// allowed<C> within one document (varlen).
template <class C, class Int = int64_t>
LOOM_HOST_DEVICE inline bool visible(const IhaArgs& a, Int i, Int j) {
  if constexpr (C::varlen) {
    const ColumnRange<Int> range = visibleColumns<C, Int>(a, i);
    return range.lo <= j && j <= range.hi;
  } else {
    return allowed<C, Int>(i, j);
  }
}

// Whether allowedColumns' lower end can exclude a key (a window), or every
// row may see from key 0.
template <class C>
LOOM_HOST_DEVICE constexpr bool windowed() {
  return C::window_rows > 0 || C::window > 0;
}

// The backward's partial sums: one slot per token CTA (block_m / P tokens) of
// each batch entry, laid out as loom::backwardPartialEntries says (dcollapse,
// then dalpha_q, dalpha_k, dalpha_v); both tile implementations use these.
namespace partials {

template <class C>
LOOM_HOST_DEVICE constexpr int64_t tokens_per_cta() {
  return C::block_m / C::pseudo_heads;
}
template <class C>
LOOM_HOST_DEVICE constexpr int64_t token_ctas(const IhaArgs& a) {
  return (a.tokens + tokens_per_cta<C>() - 1) / tokens_per_cta<C>();
}
template <class C>
LOOM_HOST_DEVICE constexpr int64_t entries() {
  return backwardPartialEntries(C::heads, C::kv_heads, C::pseudo_heads, C::collapse == Collapse::global);
}
template <class C>
LOOM_HOST_DEVICE constexpr int64_t collapse_entries() {
  return (C::collapse == Collapse::global ? C::heads : 1) * C::heads * C::pseudo_heads;
}
// Where a role's dalpha starts.
template <class C, Role R>
LOOM_HOST_DEVICE constexpr int64_t alpha_offset() {
  constexpr int64_t q = collapse_entries<C>(), k = q + int64_t(C::heads) * C::heads * C::pseudo_heads;
  return R == Role::query ? q : R == Role::key ? k : k + int64_t(C::kv_heads) * C::kv_heads * C::pseudo_heads;
}
// The slot of the token CTA starting at token0 of batch entry b.
template <class C>
LOOM_HOST_DEVICE float* slot(const IhaArgs& a, int64_t token0, int64_t b) {
  return a.partials + (b * token_ctas<C>(a) + token0 / tokens_per_cta<C>()) * entries<C>();
}
// The collapse weight from pseudo output (source, p) to output head target,
// or -1 where they are not connected (per_head, other heads).
template <class C>
LOOM_HOST_DEVICE constexpr int64_t collapse_index(int64_t target, int64_t source, int64_t p) {
  if (C::collapse == Collapse::per_head) return source == target ? target * C::pseudo_heads + p : -1;
  return (target * C::heads + source) * C::pseudo_heads + p;
}

// Where reduced entry e of the partial sums goes.
template <class C>
LOOM_HOST_DEVICE float* destination(const IhaArgs& a, int64_t e) {
  if (e < alpha_offset<C, Role::query>()) return a.dcollapse + e;
  if (e < alpha_offset<C, Role::key>()) return a.dalpha_q + (e - alpha_offset<C, Role::query>());
  if (e < alpha_offset<C, Role::value>()) return a.dalpha_k + (e - alpha_offset<C, Role::key>());
  return a.dalpha_v + (e - alpha_offset<C, Role::value>());
}

}  // namespace partials

}  // namespace loom
