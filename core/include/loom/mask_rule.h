// The mask of docs/IHA.md step 4 as intervals, for block skipping.
//
// Under every mask mode and option, the key rows a virtual query row i may
// attend form one interval [first(i), last(i)], and both ends never decrease
// as i grows. MaskRule names the two ends; blockRanges derives, for a query
// block of rows [r0, r1), the key blocks [lo, hi) that hold an allowed pair
// and the blocks [ilo, ihi) every row sees whole and in bounds (they run
// without an element-wise mask). It is written once over any integer
// arithmetic: plain int64_t (the cost model, the tests) or IR that computes
// the ranges at run time (the compiler's iha-analyze-mask).
//
// With tok(i) = floor(i / P), bn the key block size, rLast = r1 - 1, and
// floor divisions:
//
//   upper end       last(i)                  hi                         ihi
//   row             i                        rLast/bn + 1               (r0 + 1)/bn
//   token           P*(tok(i)+1) - 1         (P*(tok(rLast)+1) - 1)/bn + 1   P*(tok(r0)+1)/bn
//   token ahead W   P*(tok(i)+W) - 1         (P*(tok(rLast)+W) - 1)/bn + 1   P*(tok(r0)+W)/bn
//   all             L - 1                    ceil(L/bn)                 L/bn
//
//   lower end       first(i)                 lo                         ilo
//   none            0                        0                          0
//   rows R          i - R + 1                max(0, r0 - R + 1)/bn      ceil(max(0, rLast - R + 1)/bn)
//   tokens W        P*(tok(i) - W + 1)       max(0, P*(tok(r0)-W+1))/bn ceil(max(0, P*(tok(rLast)-W+1))/bn)
//
// then clamped: hi <= ceil(L/bn), ihi <= floor(L/bn) (a partial last block
// needs its bounds mask), lo <= ilo <= ihi <= hi.
#pragma once

#include <cstdint>

#include "loom/spec.h"

namespace loom {

struct MaskRule {
  // last(i), the last key row query row i may attend.
  enum class Upper {
    row,         // j <= i: flat_causal
    token,       // tok(j) <= tok(i): token_causal, or a window aligned to tokens
    tokenAhead,  // tok(j) < tok(i) + window: none with a (two-sided) window
    all,         // every row: none without a window
  };
  // first(i), the first key row it may attend.
  enum class Lower {
    none,    // row 0
    rows,    // j > i - span: flat_causal windows counted in rows (window * P, or window_rows)
    tokens,  // tok(j) > tok(i) - span: windows counted in tokens
  };
  Upper upper = Upper::row;
  Lower lower = Lower::none;
  int64_t pseudoHeads = 1;
  int64_t span = 0;   // rows (Lower::rows) or tokens (Lower::tokens)
  int64_t ahead = 0;  // tokens (Upper::tokenAhead)

  // The rule of a mask mode, window (tokens), window alignment and
  // window_rows, as docs/IHA.md defines them. The spec must be valid.
  static MaskRule of(v1::MaskMode mask, int64_t pseudoHeads, int64_t window, bool tokenAligned, int64_t windowRows) {
    MaskRule r;
    r.pseudoHeads = pseudoHeads;
    if (windowRows > 0) {  // flat_causal only
      r.lower = Lower::rows;
      r.span = windowRows;
      return r;
    }
    switch (mask) {
      case v1::token_causal: r.upper = Upper::token; break;
      case v1::none: r.upper = window > 0 ? (tokenAligned ? Upper::token : Upper::tokenAhead) : Upper::all; break;
      default: r.upper = Upper::row; break;
    }
    if (window > 0) {
      r.ahead = window;
      const bool rows = mask == v1::flat_causal && !tokenAligned;
      r.lower = rows ? Lower::rows : Lower::tokens;
      r.span = rows ? window * pseudoHeads : window;
    }
    return r;
  }
  static MaskRule of(const KernelSpec& spec) {
    return of(spec.mask(), spec.pseudo_heads(), spec.window(), spec.window_align() == v1::KernelSpec::token,
              spec.window_rows());
  }
};

// Integer arithmetic with floor division, for blockRanges on plain numbers.
struct IntegerMath {
  static int64_t c(int64_t v) { return v; }
  static int64_t add(int64_t a, int64_t b) { return a + b; }
  static int64_t sub(int64_t a, int64_t b) { return a - b; }
  static int64_t mul(int64_t a, int64_t b) { return a * b; }
  static int64_t floorDiv(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
  static int64_t ceilDiv(int64_t a, int64_t b) { return -floorDiv(-a, b); }
  static int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }
  static int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
  static int64_t clamp(int64_t x, int64_t lo, int64_t hi) { return min(max(x, lo), hi); }
};

// [first, last] of query row i, clipped to [0, L - 1].
struct RowInterval {
  int64_t first = 0, last = 0;
};
inline RowInterval allowedRows(const MaskRule& rule, int64_t i, int64_t L) {
  const int64_t P = rule.pseudoHeads, t = i / P;
  RowInterval r;
  switch (rule.upper) {
    case MaskRule::Upper::row: r.last = i; break;
    case MaskRule::Upper::token: r.last = P * (t + 1) - 1; break;
    case MaskRule::Upper::tokenAhead: r.last = P * (t + rule.ahead) - 1; break;
    case MaskRule::Upper::all: r.last = L - 1; break;
  }
  switch (rule.lower) {
    case MaskRule::Lower::none: r.first = 0; break;
    case MaskRule::Lower::rows: r.first = i - rule.span + 1; break;
    case MaskRule::Lower::tokens: r.first = P * (t - rule.span + 1); break;
  }
  r.first = r.first < 0 ? 0 : r.first;
  r.last = r.last > L - 1 ? L - 1 : r.last;
  return r;
}

template <class Value>
struct BlockRanges {
  Value lo, ilo, ihi, hi;  // masked [lo, ilo), interior [ilo, ihi), masked [ihi, hi)
};

// The key-block ranges of the query block starting at row0 (blockM rows, the
// last block cut at seqLen), in the arithmetic `m` provides: c, add, sub,
// mul, floorDiv, ceilDiv, max, min, clamp.
template <class Math, class Value>
BlockRanges<Value> blockRanges(Math& m, const MaskRule& rule, int64_t blockM, int64_t blockN, Value row0,
                               Value seqLen) {
  using Upper = MaskRule::Upper;
  using Lower = MaskRule::Lower;
  Value zero = m.c(0), one = m.c(1), bn = m.c(blockN), p = m.c(rule.pseudoHeads);
  Value rowLast = m.sub(m.min(m.add(row0, m.c(blockM)), seqLen), one);
  Value allBlocks = m.ceilDiv(seqLen, bn), fullBlocks = m.floorDiv(seqLen, bn);
  auto tokenOf = [&](Value row) { return m.floorDiv(row, p); };
  auto fromRow = [&](Value row) { return m.floorDiv(m.max(zero, row), bn); };       // the block holding row
  auto afterRow = [&](Value row) { return m.add(m.floorDiv(row, bn), one); };      // one past it
  auto firstFullFrom = [&](Value row) { return m.ceilDiv(m.max(zero, row), bn); };  // first block starting >= row

  BlockRanges<Value> r{zero, zero, fullBlocks, allBlocks};
  switch (rule.upper) {
    case Upper::row:
      r.hi = afterRow(rowLast);
      r.ihi = m.floorDiv(m.add(row0, one), bn);
      break;
    case Upper::token:
      r.hi = afterRow(m.sub(m.mul(p, m.add(tokenOf(rowLast), one)), one));
      r.ihi = m.floorDiv(m.mul(p, m.add(tokenOf(row0), one)), bn);
      break;
    case Upper::tokenAhead:
      r.hi = afterRow(m.sub(m.mul(p, m.add(tokenOf(rowLast), m.c(rule.ahead))), one));
      r.ihi = m.floorDiv(m.mul(p, m.add(tokenOf(row0), m.c(rule.ahead))), bn);
      break;
    case Upper::all: break;
  }
  switch (rule.lower) {
    case Lower::none: break;
    case Lower::rows:
      r.lo = fromRow(m.sub(row0, m.c(rule.span - 1)));
      r.ilo = firstFullFrom(m.sub(rowLast, m.c(rule.span - 1)));
      break;
    case Lower::tokens:
      r.lo = fromRow(m.mul(p, m.sub(tokenOf(row0), m.c(rule.span - 1))));
      r.ilo = firstFullFrom(m.mul(p, m.sub(tokenOf(rowLast), m.c(rule.span - 1))));
      break;
  }
  // Clamp into lo <= ilo <= ihi <= hi <= ceil(L/bn), ihi <= floor(L/bn).
  // Without a lower end lo = ilo = 0 and the lower clamps are no-ops.
  if (rule.upper != Upper::all) {
    r.hi = m.min(r.hi, allBlocks);
    r.ihi = m.min(r.ihi, fullBlocks);
  }
  if (rule.lower != Lower::none) {
    r.lo = m.min(r.lo, r.hi);
    r.ilo = m.clamp(r.ilo, r.lo, r.hi);
    r.ihi = m.clamp(r.ihi, r.ilo, r.hi);
  } else if (rule.upper != Upper::all) {
    r.ihi = m.min(r.ihi, r.hi);
  }
  return r;
}

// Whether the masked blocks before a query block's interior ([lo, ilo) of
// blockRanges) can hide only keys below a window's lower edge, whatever the
// length: every key of such a block is at or before each of the block's
// rows' last and before the end, so a mask there need test only first(i).
// The last such block ends by rowLast - reach (ilo is the first block
// starting at or past rowLast's first visible key: rows, reach = span -
// blockN + 1; tokens, P span - P - blockN + 2), every row's last is at or
// past row0 = rowLast - (blockM - 1) (all: the end, past rowLast), and
// rowLast is before the end.
inline bool leadingBlocksCrossOnlyTheLowerEdge(const MaskRule& rule, int64_t blockM, int64_t blockN) {
  const int64_t P = rule.pseudoHeads;
  int64_t reach = 0;
  switch (rule.lower) {
    case MaskRule::Lower::none: return false;  // no leading blocks
    case MaskRule::Lower::rows: reach = rule.span - blockN + 1; break;
    case MaskRule::Lower::tokens: reach = P * rule.span - P - blockN + 2; break;
  }
  return reach >= (rule.upper == MaskRule::Upper::all ? 0 : blockM - 1);
}

// Varlen (packed documents): ranges r (of blocks of `block` rows) cut to the
// documents of a block's first and last rows, virtual rows [first, end).
// `same` is 1 where both lie in one document, else 0: then every block is
// masked, since the block's rows see different keys. Each row's own
// document lies within [first, end), so no allowed pair is cut.
template <class Math, class Value>
BlockRanges<Value> withinDocuments(Math& m, BlockRanges<Value> r, int64_t block, Value first, Value end, Value same) {
  Value b = m.c(block);
  r.hi = m.min(r.hi, m.ceilDiv(end, b));
  r.lo = m.min(m.max(r.lo, m.floorDiv(first, b)), r.hi);
  r.ilo = m.clamp(m.max(r.ilo, m.ceilDiv(first, b)), r.lo, r.hi);
  r.ihi = m.clamp(m.min(r.ihi, m.floorDiv(end, b)), r.ilo, r.hi);
  r.ihi = m.add(r.ilo, m.mul(m.sub(r.ihi, r.ilo), same));
  return r;
}

// The transposed ranges, for a backward kernel whose CTA owns a key block and
// loops over query blocks: for the key block starting at col0 (blockN rows,
// cut at seqLen), the query blocks (blockM rows from multiples of blockM)
// [lo, hi) holding an allowed pair, and [ilo, ihi) whose every pair is
// allowed with both blocks whole (query rows past the end need the mask too:
// they hold no data). Since first(i) and last(i) never decrease, the rows
// seeing any key of [c0, c1] are [start(c0), end(c1)], with start(c) the
// first row whose last(i) >= c and end(c) the last row whose first(i) <= c:
//
//   upper end    start(c)                    lower end   end(c)
//   row          c                           none        L - 1
//   token        P*tok(c)                    rows R      c + R - 1
//   token ahead  P*max(0, tok(c) - W + 1)    tokens W    P*(tok(c) + W) - 1
//   all          0
//
// lo = start(c0)/bm, hi = end(cLast)/bm + 1, ilo = ceil(start(cLast)/bm),
// ihi = (end(c0) + 1)/bm, empty for a partial key block; then clamped as
// blockRanges is: hi <= ceil(L/bm), ihi <= floor(L/bm), lo <= ilo <= ihi <= hi.
template <class Math, class Value>
BlockRanges<Value> queryBlockRanges(Math& m, const MaskRule& rule, int64_t blockM, int64_t blockN, Value col0,
                                    Value seqLen) {
  using Upper = MaskRule::Upper;
  using Lower = MaskRule::Lower;
  Value zero = m.c(0), one = m.c(1), bm = m.c(blockM), p = m.c(rule.pseudoHeads);
  Value colEnd = m.min(m.add(col0, m.c(blockN)), seqLen);
  Value colLast = m.sub(colEnd, one);
  Value allBlocks = m.ceilDiv(seqLen, bm), fullBlocks = m.floorDiv(seqLen, bm);
  auto tokenOf = [&](Value row) { return m.floorDiv(row, p); };
  auto start = [&](Value c) -> Value {
    switch (rule.upper) {
      case Upper::row: return c;
      case Upper::token: return m.mul(p, tokenOf(c));
      case Upper::tokenAhead: return m.mul(p, m.max(zero, m.sub(tokenOf(c), m.c(rule.ahead - 1))));
      case Upper::all: break;
    }
    return zero;
  };
  // end(c), or nothing for Lower::none (every later row).
  auto end = [&](Value c) -> Value {
    if (rule.lower == Lower::rows) return m.add(c, m.c(rule.span - 1));
    return m.sub(m.mul(p, m.add(tokenOf(c), m.c(rule.span))), one);
  };
  BlockRanges<Value> r{zero, zero, fullBlocks, allBlocks};
  if (rule.upper != Upper::all) {
    r.lo = m.floorDiv(start(col0), bm);
    r.ilo = m.ceilDiv(start(colLast), bm);
  }
  if (rule.lower != Lower::none) {
    r.hi = m.min(m.add(m.floorDiv(end(colLast), bm), one), allBlocks);
    r.ihi = m.min(m.floorDiv(m.add(end(col0), one), bm), fullBlocks);
  }
  r.lo = m.min(r.lo, r.hi);
  r.ilo = m.clamp(r.ilo, r.lo, r.hi);
  r.ihi = m.clamp(r.ihi, r.ilo, r.hi);
  // A partial key block (the last one) has no interior: 1 when whole, else 0.
  Value whole = m.floorDiv(m.sub(colEnd, col0), m.c(blockN));
  r.ihi = m.add(r.ilo, m.mul(m.sub(r.ihi, r.ilo), whole));
  return r;
}

}  // namespace loom
