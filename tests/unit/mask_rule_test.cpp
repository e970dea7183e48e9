// loom::MaskRule and loom::blockRanges (loom/mask_rule.h), the derivation
// iha-analyze-mask emits and the cost model counts, against a brute-force
// reading of the reference's own mask: for every mask mode, window, window
// alignment and window_rows (at and off multiples of P), every block shape and
// many lengths, each row's allowed columns are one interval, each query
// block visits exactly the key blocks holding an allowed pair, and runs
// exactly the wholly allowed, in-bounds ones without a mask.
#include <gtest/gtest.h>

#include <numeric>

#include "loom/mask_rule.h"
#include "reference/iha_reference.h"
#include "test_util.h"

namespace loom {
namespace {

// Every spec shape of the mask: each mode with and without a window, both
// window alignments, and window_rows at, below and above multiples of P.
std::vector<KernelSpec> maskSpecs(int P) {
  std::vector<KernelSpec> specs;
  for (v1::MaskMode mask : {v1::flat_causal, v1::token_causal, v1::none})
    for (int window : {0, 1, 2, 3, 7})
      for (auto align : {v1::KernelSpec::virtual_, v1::KernelSpec::token}) {
        if (align == v1::KernelSpec::token && window == 0) continue;
        KernelSpec spec = testing::makeSpec({.heads = 1, .pseudoHeads = P, .headDim = 8, .mask = mask, .window = window});
        spec.set_window_align(align);
        specs.push_back(spec);
      }
  for (int rows : {1, P, P + 1, 2 * P - 1, 3 * P, 3 * P + 2, 17}) {
    KernelSpec spec = testing::makeSpec({.heads = 1, .pseudoHeads = P, .headDim = 8});
    spec.set_window_rows(rows);
    specs.push_back(spec);
  }
  return specs;
}

TEST(MaskRule, EveryRowSeesOneIntervalThatMovesRight) {
  for (int P = 1; P <= 4; ++P)
    for (const KernelSpec& spec : maskSpecs(P)) {
      ASSERT_TRUE(validateSpec(spec)) << spec.ShortDebugString();
      const MaskRule rule = MaskRule::of(spec);
      const int64_t L = 23 * P;
      RowInterval previous{0, 0};
      for (int64_t i = 0; i < L; ++i) {
        const RowInterval row = allowedRows(rule, i, L);
        for (int64_t j = 0; j < L; ++j)
          ASSERT_EQ(reference::allowed(spec, i, j), row.first <= j && j <= row.last)
              << spec.ShortDebugString() << " i=" << i << " j=" << j;
        ASSERT_TRUE(reference::allowed(spec, i, i)) << "every row keeps itself";
        if (i > 0) {
          EXPECT_GE(row.first, previous.first) << spec.ShortDebugString() << " i=" << i;
          EXPECT_GE(row.last, previous.last) << spec.ShortDebugString() << " i=" << i;
        }
        previous = row;
      }
    }
}

TEST(MaskRule, BlockRangesAreExactForEveryRule) {
  IntegerMath math;
  int64_t checked = 0;
  for (int P = 1; P <= 4; ++P)
    for (const KernelSpec& spec : maskSpecs(P)) {
      const MaskRule rule = MaskRule::of(spec);
      for (int64_t blockM : {int64_t(P) * 16, int64_t(std::lcm(P, 16)), int64_t(std::lcm(P, 32))})
        for (int64_t blockN : {16, 32, 48})
          for (int64_t tokens : {1, 2, 5, 13, 31, 40}) {
            const int64_t L = tokens * P;
            for (int64_t r0 = 0; r0 < L; r0 += blockM) {
              const BlockRanges<int64_t> r = blockRanges(math, rule, blockM, blockN, r0, L);
              ASSERT_LE(r.lo, r.ilo);
              ASSERT_LE(r.ilo, r.ihi);
              ASSERT_LE(r.ihi, r.hi);
              for (int64_t block = 0; block * blockN < L; ++block) {
                bool any = false, all = (block + 1) * blockN <= L;
                for (int64_t i = r0; i < std::min(r0 + blockM, L); ++i)
                  for (int64_t j = block * blockN; j < std::min((block + 1) * blockN, L); ++j) {
                    const bool ok = reference::allowed(spec, i, j);
                    any |= ok;
                    all &= ok;
                  }
                const std::string where = spec.ShortDebugString() + " block_m=" + std::to_string(blockM) +
                                          " block_n=" + std::to_string(blockN) + " L=" + std::to_string(L) +
                                          " r0=" + std::to_string(r0) + " key block " + std::to_string(block);
                ASSERT_EQ(any, r.lo <= block && block < r.hi) << where << ": visited";
                ASSERT_EQ(any && all, r.ilo <= block && block < r.ihi) << where << ": interior";
                ++checked;
              }
            }
          }
    }
  std::printf("[ blocks   ] %lld (query block, key block) pairs checked\n", (long long)checked);
}

// leadingBlocksCrossOnlyTheLowerEdge (a leading masked loop that tests
// first(i) alone): wherever it holds, every key of every block in [lo, ilo)
// is at or before each of the query block's rows' last and before the end;
// windows wide enough for it and too narrow, every mode and alignment and
// window_rows, several block shapes and lengths. It holds with leading
// blocks to check (the test can fail), and fails for some rule and shape.
TEST(MaskRule, LeadingBlocksCrossOnlyTheLowerEdgeWhereSaid) {
  IntegerMath math;
  int64_t checked = 0, refused = 0;
  for (int P = 1; P <= 3; ++P)
    for (v1::MaskMode mask : {v1::flat_causal, v1::token_causal, v1::none})
      for (int window : {0, 2, 9, 20, 41})
        for (auto align : {v1::KernelSpec::virtual_, v1::KernelSpec::token})
          for (int rows : {0, 15, 40, 97}) {
            if ((align == v1::KernelSpec::token && window == 0) || (rows > 0 && (mask != v1::flat_causal || window > 0)))
              continue;
            KernelSpec spec =
                testing::makeSpec({.heads = 1, .pseudoHeads = P, .headDim = 8, .mask = mask, .window = window});
            spec.set_window_align(align);
            spec.set_window_rows(rows);
            testing::dropStaleOptions(spec);
            ASSERT_TRUE(validateSpec(spec)) << spec.ShortDebugString();
            const MaskRule rule = MaskRule::of(spec);
            for (int64_t blockM : {int64_t(std::lcm(P, 16)), int64_t(std::lcm(P, 32))})
              for (int64_t blockN : {16, 32}) {
                if (!leadingBlocksCrossOnlyTheLowerEdge(rule, blockM, blockN)) {
                  refused += rule.lower != MaskRule::Lower::none;
                  continue;
                }
                for (int64_t tokens : {1, 7, 30, 61, 90}) {
                  const int64_t L = tokens * P;
                  for (int64_t r0 = 0; r0 < L; r0 += blockM) {
                    const BlockRanges<int64_t> r = blockRanges(math, rule, blockM, blockN, r0, L);
                    for (int64_t block = r.lo; block < r.ilo; ++block)
                      for (int64_t i = r0; i < std::min(r0 + blockM, L); ++i) {
                        const RowInterval row = allowedRows(rule, i, L);
                        ASSERT_LE((block + 1) * blockN - 1, row.last)
                            << spec.ShortDebugString() << " block_m=" << blockM << " block_n=" << blockN
                            << " L=" << L << " r0=" << r0 << " key block " << block << " row " << i;
                        ++checked;
                      }
                  }
                }
              }
          }
  std::printf("[ leading  ] %lld (leading key block, row) pairs checked; %lld rule shapes refused\n",
              (long long)checked, (long long)refused);
  EXPECT_GT(checked, 1000);
  EXPECT_GT(refused, 0);
}

TEST(MaskRule, QueryBlockRangesAreExactForEveryRule) {
  // The backward's key-block-outer loop: for each key block, the query
  // blocks holding an allowed pair, and the ones every pair of which is
  // allowed with both blocks whole (rows past the end hold no data).
  IntegerMath math;
  int64_t checked = 0;
  for (int P = 1; P <= 4; ++P)
    for (const KernelSpec& spec : maskSpecs(P)) {
      const MaskRule rule = MaskRule::of(spec);
      for (int64_t blockM : {int64_t(16), int64_t(32), int64_t(48), int64_t(std::lcm(P, 16))})
        for (int64_t blockN : {int64_t(16), int64_t(32), int64_t(64)})
          for (int64_t tokens : {1, 2, 5, 13, 31, 40}) {
            const int64_t L = tokens * P;
            for (int64_t c0 = 0; c0 < L; c0 += blockN) {
              const BlockRanges<int64_t> r = queryBlockRanges(math, rule, blockM, blockN, c0, L);
              ASSERT_LE(r.lo, r.ilo);
              ASSERT_LE(r.ilo, r.ihi);
              ASSERT_LE(r.ihi, r.hi);
              for (int64_t block = 0; block * blockM < L; ++block) {
                bool any = false, all = (block + 1) * blockM <= L && c0 + blockN <= L;
                for (int64_t i = block * blockM; i < std::min((block + 1) * blockM, L); ++i)
                  for (int64_t j = c0; j < std::min(c0 + blockN, L); ++j) {
                    const bool ok = reference::allowed(spec, i, j);
                    any |= ok;
                    all &= ok;
                  }
                const std::string where = spec.ShortDebugString() + " block_m=" + std::to_string(blockM) +
                                          " block_n=" + std::to_string(blockN) + " L=" + std::to_string(L) +
                                          " c0=" + std::to_string(c0) + " query block " + std::to_string(block);
                ASSERT_EQ(any, r.lo <= block && block < r.hi) << where << ": visited";
                ASSERT_EQ(any && all, r.ilo <= block && block < r.ihi) << where << ": interior";
                ++checked;
              }
            }
          }
    }
  std::printf("[ blocks   ] %lld (key block, query block) pairs checked\n", (long long)checked);
}

// Varlen (loom::withinDocuments): a CTA's ranges cut to the documents of
// its first and last rows. Over every rule, block shape and several packings
// (one-token, empty and window-short documents), in both loops (key blocks
// of a query block; query blocks of a key block): every block holding a pair
// allowed within one document is visited, and every block run without a mask
// has every pair allowed, within one document and in bounds.
TEST(MaskRule, DocumentRangesKeepEveryPairWithinItsDocument) {
  IntegerMath math;
  const std::vector<std::vector<int32_t>> packings = {
      {0, 40}, {0, 1, 40}, {0, 13, 13, 27, 40}, {0, 3, 4, 5, 21, 22, 40}, {0, 16, 32, 40}, {0, 39, 40}};
  int64_t checked = 0;
  for (int P = 1; P <= 4; ++P)
    for (const KernelSpec& spec : maskSpecs(P)) {
      const MaskRule rule = MaskRule::of(spec);
      const int64_t L = 40 * P;
      for (const std::vector<int32_t>& bounds : packings) {
        auto document = [&](int64_t row) {  // [first, end) virtual rows of row's document
          const int64_t token = row / P;
          size_t d = 0;
          while (!(bounds[d] <= token && token < bounds[d + 1])) ++d;
          return std::pair<int64_t, int64_t>{bounds[d] * P, bounds[d + 1] * P};
        };
        auto pair = [&](int64_t i, int64_t j) { return document(i) == document(j) && reference::allowed(spec, i, j); };
        for (int64_t blockM : {int64_t(std::lcm(P, 16)), int64_t(std::lcm(P, 32))})
          for (int64_t blockN : {16, 32}) {
            for (const bool keyBlocks : {true, false}) {  // the forward's loop, the backward's transposed one
              const int64_t outer = keyBlocks ? blockM : blockN, inner = keyBlocks ? blockN : blockM;
              for (int64_t start = 0; start < L; start += outer) {
                const int64_t last = std::min(start + outer, L) - 1;
                BlockRanges<int64_t> r = keyBlocks ? blockRanges(math, rule, blockM, blockN, start, L)
                                                   : queryBlockRanges(math, rule, blockM, blockN, start, L);
                const int64_t same = document(start) == document(last) ? 1 : 0;
                r = withinDocuments(math, r, inner, document(start).first, document(last).second, same);
                ASSERT_LE(r.lo, r.ilo);
                ASSERT_LE(r.ilo, r.ihi);
                ASSERT_LE(r.ihi, r.hi);
                for (int64_t block = 0; block * inner < L; ++block) {
                  // Whole blocks: the key block; in the transposed loop both (its rows past L hold no data).
                  bool any = false, all = (block + 1) * inner <= L && (keyBlocks || start + outer <= L);
                  for (int64_t a = start; a <= last; ++a)
                    for (int64_t b = block * inner; b < std::min((block + 1) * inner, L); ++b) {
                      const bool ok = keyBlocks ? pair(a, b) : pair(b, a);
                      any |= ok;
                      all &= ok;
                    }
                  const std::string where = spec.ShortDebugString() + (keyBlocks ? " key" : " query") +
                                            " blocks, start " + std::to_string(start) + " block " +
                                            std::to_string(block) + " block_m " + std::to_string(blockM) +
                                            " block_n " + std::to_string(blockN);
                  if (any) ASSERT_TRUE(r.lo <= block && block < r.hi) << where << ": an allowed pair not visited";
                  if (r.ilo <= block && block < r.ihi) ASSERT_TRUE(all) << where << ": run unmasked";
                  ++checked;
                }
              }
            }
          }
      }
    }
  std::printf("[ blocks   ] %lld block pairs of packed documents checked\n", (long long)checked);
}

}  // namespace
}  // namespace loom
