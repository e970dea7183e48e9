// The decode step's oracle (reference::ihaDecode) against the forward's rows,
// the page-table checks, and `loom run --decode`.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <random>

#include <gtest/gtest.h>

#include "cpu/cpu_backend.h"
#include "api/compile.h"
#include "emu/emulator.h"
#include "jit/nvrtc_compiler.h"
#include "io/decode_case.h"
#include "loom/tile/layout.h"
#include "loom/compiler.h"
#include "loom/decode.h"
#include "reference/iha_decode.h"
#include "reference/iha_reference.h"
#include "host_tensors.h"
#include "loom/runtime.h"
#include "mutate.h"
#include "test_util.h"

namespace loom {
namespace {

// The largest scale * sum_e |q_e k_e| of row i of query head h over the keys
// it may see, in the forward's virtual rows of one sequence (q and k mixed,
// normalised and turned as the reference does): the size each score's
// rounding is relative to (a dot product's condition), at least its |score|.
double largestScoreMagnitude(const KernelSpec& spec, const reference::detail::Rows& q,
                             const reference::detail::Rows& k, int64_t h, int64_t i) {
  const int64_t g = h / (spec.heads() / spec.kv_heads());
  double largest = 0;
  for (int64_t j = 0; j < int64_t(k[size_t(g)].size()); ++j) {
    if (!reference::allowed(spec, i, j)) continue;
    double magnitude = 0;
    for (int64_t e = 0; e < spec.head_dim(); ++e)
      magnitude += std::abs(q[size_t(h)][size_t(i)][size_t(e)] * k[size_t(g)][size_t(j)][size_t(e)]);
    largest = std::max(largest, std::abs(reference::detail::scaleOf(spec)) * magnitude);
  }
  return largest;
}

// The forward's lse [1, H, n*P] over the sequence's first cache_len + T
// tokens, at the step's rows, against the step's [B, H, T*P]: the error's
// norm over that of each row's scale, the larger of |lse| and its largest
// score magnitude (scale * sum |q_e k_e|). An lse taken from rounded scores
// moves as far as they do, and a score moves in proportion to the products
// it sums, not to their sum: a row whose exponentials sum to about 1 has an
// lse near 0 whatever its scores (a bf16 step of three keys with qk_norm:
// lse 0.153, scores up to 11, moved by 0.004), and a row of one key whose
// normalised q and k are nearly orthogonal has a score near 0 (bf16, d 32:
// score 0.062, products summing to about 4, moved by 0.0014).
double lseError(const IhaCase& c, const DecodeCase& dc, const reference::DecodeOutputs& got) {
  const KernelSpec& spec = c.spec;
  const int64_t H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  const int64_t Tmost = dc.step.tokens;
  double error = 0, scale = 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t T = reference::stepRows(dc.step, b).count;
    if (T == 0) continue;
    const int64_t from = dc.cache.cacheLen[size_t(b)], to = from + T;
    const reference::IhaInputs inputs = sliceTokens(spec, c.inputs, b, 0, to);
    const auto forward = reference::ihaForward(spec, inputs);
    auto q = reference::detail::mixAndInterleave(inputs.q, inputs.alpha_q, 0, to, H, P, d);
    auto k = reference::detail::mixAndInterleave(inputs.k, inputs.alpha_k, 0, to, G, P, d);
    reference::detail::normalizeAndRotate(spec, q);
    reference::detail::normalizeAndRotate(spec, k);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < T * P; ++r) {
        const double want = forward.lse[size_t(h * to * P + from * P + r)];
        const double have = got.lse[size_t((b * H + h) * Tmost * P + r)];
        const double rowScale = std::max(std::abs(want), largestScoreMagnitude(spec, q, k, h, from * P + r));
        error += (have - want) * (have - want);
        scale += rowScale * rowScale;
      }
  }
  return std::sqrt(error) / std::max(std::sqrt(scale), 1e-300);
}

// The reference's own append, checked apart from appendToCache (which
// checkAppend, and so the backends' checks, build on). Slots the step must
// have filled are finite; every other slot is still the NaN it was poisoned
// with (nothing written outside the sequences' tokens).
void expectOnlyTheSequencesSlotsFilled(const DecodeCase& dc, const reference::PagedCache& after) {
  const int64_t E = reference::cacheTokenElements(dc.spec, after.mixed);
  std::vector<bool> owned(size_t(after.numPages * after.pageSize), false);
  for (int64_t b = 0; b < dc.shape.batch; ++b)
    for (int64_t t = 0; t < after.cacheLen[size_t(b)] + reference::stepRows(dc.step, b).count; ++t)
      owned[size_t(reference::cacheSlot(after, b, t))] = true;
  int64_t wrong = 0;
  for (size_t slot = 0; slot < owned.size(); ++slot)
    for (int64_t e = 0; e < E; ++e)
      for (const std::vector<double>* x : {&after.k, &after.v})
        wrong += std::isfinite((*x)[slot * size_t(E) + size_t(e)]) != owned[slot];
  EXPECT_EQ(wrong, 0) << "cache elements finite where no token is, or NaN where one is";
}

// The new tokens' raw k and v sit at their slots, exactly.
void expectRawAppend(const DecodeCase& dc, const reference::PagedCache& after) {
  const int64_t E = reference::cacheTokenElements(dc.spec, false);
  for (int64_t b = 0; b < dc.shape.batch; ++b) {
    const reference::StepRows rows = reference::stepRows(dc.step, b);
    for (int64_t t = 0; t < rows.count; ++t) {
      const int64_t slot = reference::cacheSlot(after, b, after.cacheLen[size_t(b)] + t);
      const size_t row = size_t((rows.first + t) * E);
      for (int64_t e = 0; e < E; ++e) {
        ASSERT_EQ(after.k[size_t(slot * E + e)], dc.step.k[row + size_t(e)]) << "b " << b << " t " << t;
        ASSERT_EQ(after.v[size_t(slot * E + e)], dc.step.v[row + size_t(e)]) << "b " << b << " t " << t;
      }
    }
  }
}

// Whether a step's rows can be checked in the case's 16-bit dtype, as
// findCheckableCase asks of a whole forward: the float64 step loses at most
// kCheckableShare of the tolerance with the cache's mixed rows rounded to the
// dtype (or, if more, with every mixed row, softmax weight and output rounded
// as ihaForwardWithTensorCoreRounding does), plus with the pseudo-head
// outputs rounded before the collapse (what a CUDA step keeps in o_pseudo).
// A step checks a few rows only, so a draw the forward could check may
// cancel in the collapse there.
bool stepCheckable(const IhaCase& c, DecodeLayout layout) {
  layout.layout = CacheLayout::mixed;
  auto dc = decodeCaseFrom(c, layout);
  if (!dc) return false;
  reference::PagedCache cache = dc->cache;
  cache.k = roundedToDtype(cache.k, c.spec.dtype());
  cache.v = roundedToDtype(cache.v, c.spec.dtype());
  const double mixing = relativeError(reference::ihaDecode(c.spec, dc->step, cache).out, dc->expected);
  // Pseudo-head p's outputs of every head, by a collapse that picks p alone.
  const int64_t H = c.spec.heads(), P = c.spec.pseudo_heads(), d = c.spec.head_dim();
  const bool global = c.spec.collapse() == v1::global;
  const std::vector<double>& weights = dc->step.collapse;
  std::vector<double> collapsed(dc->expected.size(), 0.0);
  for (int64_t p = 0; p < P; ++p) {
    reference::IhaInputs pick = dc->step;
    std::fill(pick.collapse.begin(), pick.collapse.end(), 0.0);
    for (int64_t h = 0; h < H; ++h) pick.collapse[size_t(global ? (h * H + h) * P + p : h * P + p)] = 1.0;
    reference::PagedCache fresh = dc->cache;
    const std::vector<double> o = roundedToDtype(reference::ihaDecode(c.spec, pick, fresh).out, c.spec.dtype());  // [B, T, H, d]
    for (size_t row = 0; row < o.size() / size_t(H * d); ++row)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t source = 0; source < H; ++source) {
          if (!global && source != h) continue;
          const double w = weights[size_t(global ? (h * H + source) * P + p : h * P + p)];
          for (int64_t e = 0; e < d; ++e)
            collapsed[(row * size_t(H) + size_t(h)) * size_t(d) + size_t(e)] +=
                w * o[(row * size_t(H) + size_t(source)) * size_t(d) + size_t(e)];
        }
  }
  const double collapse = relativeError(collapsed, dc->expected);
  // The step's rows of each sequence's forward with every row mixed, every
  // softmax weight and the output rounded (ihaForwardWithTensorCoreRounding).
  std::vector<double> rounded;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t fresh = layout.newTokensOf.empty() ? layout.newTokens : layout.newTokensOf[size_t(b)];
    const int64_t from = layout.cached.empty() ? c.tokens - fresh : layout.cached[size_t(b)];
    const int64_t to = from + fresh;
    if (fresh == 0) continue;
    const std::vector<double> out =
        reference::ihaForwardWithTensorCoreRounding(c.spec, sliceTokens(c.spec, c.inputs, b, 0, to), c.spec.dtype()).out;
    rounded.insert(rounded.end(), out.begin() + from * H * d, out.end());
  }
  const double tensorCores = relativeError(rounded, dc->expected);
  return std::max(mixing, tensorCores) + collapse <= kCheckableShare * toleranceFor(c.spec.dtype());
}

// A layout of T new tokens over pages of 1 to maxPage tokens, either cache
// layout, and cache lengths drawn until the step can be checked
// (stepCheckable), at most 16 tries; where none can, the case's inputs are
// drawn again (its spec, batch and tokens kept: findCheckableCase from a new
// seed), at most 8 times; nothing where the spec has no checkable step.
std::optional<DecodeLayout> tryCheckableLayout(std::mt19937_64& rng, IhaCase& c, int64_t T, int64_t maxPage,
                                               int64_t minCached = 0) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  DecodeLayout layout{T, pick(1, maxPage), pick(0, 1) ? CacheLayout::mixed : CacheLayout::raw, {}, rng()};
  for (int cases = 0; cases < 8; ++cases) {
    for (int tries = 0; tries < 16; ++tries) {
      layout.cached.clear();
      for (int64_t b = 0; b < c.batch; ++b)
        layout.cached.push_back(pick(std::min(minCached, c.tokens - T), c.tokens - T));
      if (stepCheckable(c, layout)) return layout;
    }
    std::printf("[ redrawn  ] %s: no step of %lld tokens the roundings of its dtype leave checkable, other inputs\n",
                testing::describe(c).c_str(), (long long)T);
    if (std::optional<IhaCase> again = findCheckableCase(c.spec, c.batch, c.tokens, rng())) c = std::move(*again);
  }
  return std::nullopt;
}

// tryCheckableLayout, where a spec with no checkable step fails the test.
DecodeLayout drawCheckableLayout(std::mt19937_64& rng, IhaCase& c, int64_t T, int64_t maxPage,
                                 int64_t minCached = 0) {
  if (std::optional<DecodeLayout> layout = tryCheckableLayout(rng, c, T, maxPage, minCached)) return *layout;
  ADD_FAILURE() << testing::describe(c) << ": 8 drawn inputs without a checkable step of " << T << " tokens";
  return DecodeLayout{T, maxPage, CacheLayout::raw, std::vector<int64_t>(size_t(c.batch), 0), rng()};
}

// A checkable case of a shape from `drawShape()` (drawCheckableShape; a
// freshly drawn spec each call) and a checkable
// step of T = 1 to maxT of its tokens (tryCheckableLayout): a spec with no
// checkable step (every input drawn leaves the step's rows to its dtype's
// roundings) is said and another drawn, at most 8; then the test fails.
struct DrawnStep {
  IhaCase c;
  int64_t T = 1;
  DecodeLayout layout;
};
template <class DrawShape>
DrawnStep drawCheckableStep(std::mt19937_64& rng, DrawShape drawShape, int64_t maxT, int64_t maxPage,
                            int64_t minCached = 0) {
  constexpr int kMaxSpecs = 8;
  for (int attempt = 1;; ++attempt) {
    DrawnStep step{testing::drawCheckableShape(rng, /*backward=*/false, drawShape)};
    step.T = std::uniform_int_distribution<int64_t>(1, std::min<int64_t>(maxT, step.c.tokens))(rng);
    if (std::optional<DecodeLayout> layout = tryCheckableLayout(rng, step.c, step.T, maxPage, minCached)) {
      step.layout = *layout;
      return step;
    }
    std::printf("[ redrawn  ] %s: no checkable step of %lld tokens, another spec\n",
                testing::describe(step.c).c_str(), (long long)step.T);
    if (attempt == kMaxSpecs) {
      ADD_FAILURE() << kMaxSpecs << " drawn specs in a row without a checkable step";
      step.layout = DecodeLayout{step.T, maxPage, CacheLayout::raw, std::vector<int64_t>(size_t(step.c.batch), 0), rng()};
      return step;
    }
  }
}

// A drawn spec the CUDA step takes (a 16-bit dtype, head_dim a multiple of
// 16), 1 to 3 sequences of minTokens to maxTokens.
testing::DrawnShape drawCudaShape(std::mt19937_64& rng, int64_t minTokens, int64_t maxTokens) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  KernelSpec spec = testing::randomSpec(rng);
  spec.set_dtype(pick(0, 1) ? v1::float16 : v1::bfloat16);
  spec.set_head_dim(int32_t(16 * pick(1, 4)));
  return testing::DrawnShape{spec, pick(1, 3), pick(minTokens, maxTokens)};
}
// A checkable case of such a shape.
IhaCase drawCudaCase(std::mt19937_64& rng, int64_t minTokens, int64_t maxTokens) {
  return testing::drawCheckableShape(rng, /*backward=*/false, [&] { return drawCudaShape(rng, minTokens, maxTokens); });
}

// The decode plan of the step's spec and cache layout for `target`.
Result<KernelPlan> decodePlan(const DecodeCase& dc, const Schedule& schedule, const std::string& target) {
  GenerateOptions options;
  options.direction = Direction::decode;
  options.mixedCache = dc.layout == CacheLayout::mixed;
  return generateKernel(dc.spec, schedule, *parseTarget(target), options);
}

// The generated decode step on the host tile API.
Result<cpu::CpuDecodeOutputs> runOnHost(const DecodeCase& dc, const Schedule& schedule = {}) {
  auto plan = decodePlan(dc, schedule, "cpu");
  if (!plan) return plan.error();
  return cpu::runDecodePlan(*plan, dc, {LOOM_TEST_CACHE, 2});
}

// The append a backend's step made (checkAppend): a raw cache holds exactly
// the reference's append of the new tokens' k and v and what it held
// before, a mixed one the reference's mixed rows within the dtype's
// tolerance, finite exactly where a sequence's tokens are.
// Every slot no new token takes (every page the step only reads, a shared
// prefix's included) holds what it held, bit for bit in the dtype the
// backend's cache has (NaN where no token is; `inDtype` false: the float64
// oracle's own cache).
void expectReadSlotsKept(const DecodeCase& dc, const reference::PagedCache& got, bool inDtype = true) {
  const reference::PagedCache& before = dc.cache;
  const int64_t E = reference::cacheTokenElements(dc.spec, before.mixed);
  std::vector<bool> written(size_t(before.numPages * before.pageSize), false);
  for (int64_t b = 0; b < dc.shape.batch; ++b)
    for (int64_t t = 0; t < reference::stepRows(dc.step, b).count; ++t)
      written[size_t(reference::cacheSlot(before, b, before.cacheLen[size_t(b)] + t))] = true;
  int64_t changed = 0;
  for (const auto& [was, is] : {std::pair{&before.k, &got.k}, std::pair{&before.v, &got.v}}) {
    ASSERT_EQ(was->size(), is->size());
    const std::vector<double> rounded = inDtype ? roundedToDtype(*was, dc.spec.dtype()) : *was;
    for (size_t slot = 0; slot < written.size(); ++slot)
      for (int64_t e = 0; !written[slot] && e < E; ++e) {
        const size_t at = slot * size_t(E) + size_t(e);
        const bool same = std::isnan(rounded[at]) ? std::isnan((*is)[at]) : rounded[at] == (*is)[at];
        changed += !same;
      }
  }
  EXPECT_EQ(changed, 0) << cacheLayoutName(dc.layout) << " cache elements changed in slots the step only reads";
}

void expectAppend(const IhaCase& c, const DecodeCase& dc, const reference::PagedCache& got) {
  const AppendCheck check = checkAppend(dc, got);
  EXPECT_EQ(check.wrongElements, 0) << cacheLayoutName(dc.layout) << " cache elements other than the append's";
  EXPECT_LE(check.mixedError, toleranceFor(c.spec.dtype())) << "mixed rows appended";
  expectReadSlotsKept(dc, got);
}

// The host kernel's step: out and lse within the dtype's tolerance, and its append.
void expectHostStep(const IhaCase& c, const DecodeCase& dc, const Schedule& schedule = {}) {
  auto got = runOnHost(dc, schedule);
  ASSERT_TRUE(got) << got.error().message;
  const double tolerance = toleranceFor(c.spec.dtype());
  EXPECT_LE(relativeError(got->out, dc.expected), tolerance) << "out";
  reference::DecodeOutputs asLse{{}, got->lse};
  EXPECT_LE(lseError(c, dc, asLse), tolerance) << "lse";
  expectAppend(c, dc, got->cache);
}

// A step over a raw cache of the last of `tokens` tokens of one sequence
// (pages of 1 to pageMax tokens), for a drawn bf16 spec without a window of
// the given heads and head_dim (`adjust` sets the rest); the drawn case in c.
DecodeCase drawRawStep(std::mt19937_64& rng, IhaCase& c, int heads, int kvHeads, int P, int d, int64_t tokens,
                       int64_t pageMax, const std::function<void(KernelSpec&)>& adjust = {}, int64_t minCached = 0) {
  c = testing::drawCheckableShape(rng, /*backward=*/false, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_kv_heads(kvHeads);
    spec.set_heads(heads);
    spec.set_pseudo_heads(P);
    spec.set_head_dim(d);
    spec.set_dtype(v1::bfloat16);
    spec.clear_window();
    spec.clear_window_align();
    spec.clear_window_rows();
    if (adjust) adjust(spec);
    testing::dropStaleOptions(spec);
    return testing::DrawnShape{spec, 1, tokens};
  });
  DecodeLayout layout = drawCheckableLayout(rng, c, 1, pageMax, minCached);
  layout.layout = CacheLayout::raw;
  auto dc = decodeCaseFrom(c, layout);
  EXPECT_TRUE(dc) << dc.error().message;
  return dc ? *dc : DecodeCase{};
}

// The CUDA decode step of `arch` over the step's cache layout on the
// emulator: no finding, out and lse within the dtype's tolerance of the
// forward's rows, and its append.
void expectEmulatedStep(const IhaCase& c, const DecodeCase& dc, const std::string& arch, uint64_t seed,
                        const Schedule& schedule = {}) {
  auto plan = decodePlan(dc, schedule, arch);
  ASSERT_TRUE(plan) << plan.error().message;
  auto run = emu::runDecodeOnEmulator(*plan, dc, testing::emulatorOptions(seed));
  ASSERT_TRUE(run) << run.error().message;
  EXPECT_EQ(run->findingCount, 0) << emu::summary(*run);
  EXPECT_FALSE(run->deadlocked);
  const double tolerance = toleranceFor(c.spec.dtype());
  EXPECT_LE(relativeError(run->out, dc.expected), tolerance) << "out";
  reference::DecodeOutputs asLse{{}, run->lse};
  EXPECT_LE(lseError(c, dc, asLse), tolerance) << "lse";
  ASSERT_TRUE(run->cache);
  expectAppend(c, dc, *run->cache);
}

// generateKernel refuses the plan, and its message says `why`.
void expectPlanRefused(const KernelSpec& spec, const Schedule& schedule, const char* target,
                       const GenerateOptions& options, const std::string& why) {
  auto plan = generateKernel(spec, schedule, *parseTarget(target), options);
  ASSERT_FALSE(plan) << "expected a refusal saying: " << why;
  EXPECT_NE(plan.error().message.find(why), std::string::npos) << plan.error().message;
}

class SharedCaseDecode : public ::testing::TestWithParam<std::string> {};

// Every shared case: its last T tokens decoded over a cache of the others
// give expected.npy's rows there (computed outside loom), for T = 1 and 3,
// page sizes 1, 16 and 7 (which divides no case's length), both layouts.
TEST_P(SharedCaseDecode, GivesTheForwardsRows) {
  auto c = loadCase(testing::casesDir() + "/" + GetParam());
  ASSERT_TRUE(c) << c.error().message;
  if (c->spec.varlen()) GTEST_SKIP() << "a varlen case: a decode step's sequences are its page table's, not packed documents";
  ASSERT_TRUE(c->expected);
  const uint64_t seed = testing::testSeed();
  for (int64_t T : {int64_t(1), std::min<int64_t>(3, c->tokens)})
    for (int64_t pageSize : {1, 16, 7})
      for (CacheLayout layout : {CacheLayout::raw, CacheLayout::mixed}) {
        SCOPED_TRACE("T " + std::to_string(T) + ", page size " + std::to_string(pageSize) + ", " +
                     cacheLayoutName(layout));
        auto dc = decodeCaseFrom(*c, {T, pageSize, layout, {}, seed + uint64_t(pageSize)});
        ASSERT_TRUE(dc) << dc.error().message;
        ASSERT_TRUE(validateDecode(dc->shape, dc->cache.pageTable, dc->cache.cacheLen));
        reference::PagedCache cache = dc->cache;
        const auto got = reference::ihaDecode(c->spec, dc->step, cache);
        EXPECT_LT(relativeError(got.out, dc->expected), 1e-12);
        EXPECT_LT(lseError(*c, *dc, got), 1e-12);
        expectOnlyTheSequencesSlotsFilled(*dc, cache);
        if (layout == CacheLayout::raw) expectRawAppend(*dc, cache);
      }
}

// The same steps through the generated program on the host tile API, each
// layout at T = 1 over 16-token pages, T = 3 over 7-token pages (dividing
// no case's length) and T = 2 over pages of one token.
TEST_P(SharedCaseDecode, HostKernelGivesTheForwardsRows) {
  auto c = loadCase(testing::casesDir() + "/" + GetParam());
  ASSERT_TRUE(c) << c.error().message;
  if (c->spec.varlen()) GTEST_SKIP() << "a varlen case: a decode step's sequences are its page table's, not packed documents";
  const uint64_t seed = testing::testSeed();
  for (CacheLayout layout : {CacheLayout::raw, CacheLayout::mixed})
    for (auto [T, pageSize] : {std::pair<int64_t, int64_t>{1, 16}, {3, 7}, {2, 1}}) {
      T = std::min(T, c->tokens);
      SCOPED_TRACE("T " + std::to_string(T) + ", page size " + std::to_string(pageSize) + ", " +
                   cacheLayoutName(layout));
      auto dc = decodeCaseFrom(*c, {T, pageSize, layout, {}, seed + uint64_t(T)});
      ASSERT_TRUE(dc) << dc.error().message;
      expectHostStep(*c, *dc);
    }
}

// The CUDA program on the emulator: each shared case in a 16-bit dtype (its
// own, or float16 / bfloat16 by turns), T = 2 over 3-token pages, sm_80 and
// sm_90a by turns, over a raw and a mixed cache.
TEST_P(SharedCaseDecode, EmulatedCudaStepWithoutFindings) {
  auto loaded = loadCase(testing::casesDir() + "/" + GetParam());
  ASSERT_TRUE(loaded) << loaded.error().message;
  if (loaded->spec.varlen()) GTEST_SKIP() << "a varlen case: a decode step's sequences are its page table's, not packed documents";
  const auto names = testing::sharedCaseNames();
  const size_t index = size_t(std::find(names.begin(), names.end(), GetParam()) - names.begin());
  const IhaCase c = loaded->spec.dtype() != v1::float32 ? *loaded
                                                        : withDtype(*loaded, index % 2 ? v1::float16 : v1::bfloat16);
  const std::string arch = index % 2 ? "sm_90a" : "sm_80";
  const uint64_t seed = testing::testSeed();
  for (CacheLayout layout : {CacheLayout::raw, CacheLayout::mixed}) {
    SCOPED_TRACE(arch + " " + dtypeName(c.spec.dtype()) + " " + cacheLayoutName(layout));
    auto dc = decodeCaseFrom(c, {std::min<int64_t>(2, c.tokens), 3, layout, {}, seed});
    ASSERT_TRUE(dc) << dc.error().message;
    expectEmulatedStep(c, *dc, arch, seed);
  }
}

INSTANTIATE_TEST_SUITE_P(Vectors, SharedCaseDecode, ::testing::ValuesIn(testing::sharedCaseNames()),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

// Drawn specs (every mask, window, option, dtype) with sequences of their
// own lengths in one step, each against the float64 forward over its own
// first cache_len + T tokens.
TEST(Decode, DrawnSpecsWithRaggedLengthsGiveTheForwardsRows) {
  std::mt19937_64 rng(testing::testSeed());
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 24; ++draw) {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_dtype(static_cast<v1::DType>(pick(1, 3)));
    const int64_t B = pick(1, 3), N = pick(2, 20), T = pick(1, std::min<int64_t>(4, N));
    IhaCase c = drawCase(spec, B, N, rng());
    DecodeLayout layout{T, pick(0, 2) == 0 ? 16 : pick(1, 7), pick(0, 1) ? CacheLayout::mixed : CacheLayout::raw,
                        {}, rng()};
    for (int64_t b = 0; b < B; ++b) layout.cached.push_back(pick(0, N - T));
    SCOPED_TRACE(testing::describe(c) + " T=" + std::to_string(T) + " page " + std::to_string(layout.pageSize) + " " +
                 cacheLayoutName(layout.layout));
    auto dc = decodeCaseFrom(c, layout);
    ASSERT_TRUE(dc) << dc.error().message;
    ASSERT_TRUE(validateDecode(dc->shape, dc->cache.pageTable, dc->cache.cacheLen));
    reference::PagedCache cache = dc->cache;
    const auto got = reference::ihaDecode(spec, dc->step, cache);
    EXPECT_LT(relativeError(got.out, dc->expected), 1e-12);
    EXPECT_LT(lseError(c, *dc, got), 1e-12);
    expectOnlyTheSequencesSlotsFilled(*dc, cache);
  }
}

// The host kernel on drawn specs the dtype can check (docs/IHA.md, Numerics),
// ragged lengths, either layout, and a drawn schedule: the collapse fused or
// separate, key blocks of 16 to 64 rows.
TEST(Decode, HostKernelOnDrawnSpecsAndSchedules) {
  std::mt19937_64 rng(testing::testSeed() ^ 0xdec0de);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 6; ++draw) {
    const IhaCase c = testing::drawCheckableShape(rng, /*backward=*/false, [&] {
      KernelSpec spec = testing::randomSpec(rng);
      spec.set_dtype(static_cast<v1::DType>(pick(1, 3)));
      spec.set_head_dim(int32_t(8 * pick(1, 4)));  // the generated programs' widths
      return testing::DrawnShape{spec, pick(1, 3), pick(2, 24)};
    });
    const int64_t T = pick(1, std::min<int64_t>(5, c.tokens));
    DecodeLayout layout{T, pick(0, 1) ? 16 : pick(1, 9), pick(0, 1) ? CacheLayout::mixed : CacheLayout::raw, {}, rng()};
    for (int64_t b = 0; b < c.batch; ++b) layout.cached.push_back(pick(0, c.tokens - T));
    Schedule schedule;
    schedule.set_collapse(pick(0, 1) ? v1::collapse_fused : v1::collapse_separate);
    schedule.set_block_n(int32_t(16 << pick(0, 2)));
    SCOPED_TRACE(testing::describe(c) + " T=" + std::to_string(T) + " page " + std::to_string(layout.pageSize) + " " +
                 cacheLayoutName(layout.layout) + " schedule " + schedule.ShortDebugString());
    auto dc = decodeCaseFrom(c, layout);
    ASSERT_TRUE(dc) << dc.error().message;
    expectHostStep(c, *dc, schedule);
  }
}

// The emulated CUDA step on drawn specs the dtype can check, ragged lengths,
// page sizes and either cache layout.
TEST(Decode, EmulatedCudaStepOnDrawnSpecs) {
  std::mt19937_64 rng(testing::testSeed() ^ 0xc0da);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 3; ++draw) {
    auto [c, T, layout] = drawCheckableStep(rng, [&] { return drawCudaShape(rng, 2, 24); }, 4, 9);
    const std::string arch = pick(0, 1) ? "sm_90a" : "sm_80";
    SCOPED_TRACE(testing::describe(c) + " T=" + std::to_string(T) + " page " + std::to_string(layout.pageSize) + " " +
                 arch + " " + cacheLayoutName(layout.layout));
    auto dc = decodeCaseFrom(c, layout);
    ASSERT_TRUE(dc) << dc.error().message;
    expectEmulatedStep(c, *dc, arch, rng());
  }
}

// The mixing step with qk_norm (absorb_mixing false): each mixed key row's
// sum of squares is a shuffle sum over the lanes of its pieces where they
// are a power of two (head_dim 32: chunk pairs 2, chunks 4), else mma_qk's
// sum over its own K fragments (head_dim 48 with RoPE: 3 chunk pairs); no
// shared-memory atomics. Drawn specs, either arch, stacked or not: the
// emulated step gives the forward's rows with no finding.
TEST(Decode, MixingStepsNormaliseTheirKeysInOneOrder) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x9a55);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 4; ++draw) {
    auto [c, T, layout] = drawCheckableStep(
        rng,
        [&] {
          KernelSpec spec = testing::randomSpec(rng);
          spec.set_kv_heads(int32_t(pick(1, 2)));
          spec.set_heads(int32_t(spec.kv_heads() * pick(1, 2)));
          spec.set_pseudo_heads(int32_t(pick(1, 3)));
          spec.set_head_dim(draw < 2 ? 32 : 48);
          spec.set_rope_theta(draw % 2 ? 0.0 : 10000.0);
          spec.set_dtype(pick(0, 1) ? v1::float16 : v1::bfloat16);
          spec.set_qk_norm(v1::KernelSpec::rms);
          testing::dropStaleOptions(spec);
          return testing::DrawnShape{spec, pick(1, 2), pick(6, 30)};
        },
        3, 9);
    layout.layout = CacheLayout::raw;
    Schedule schedule;
    schedule.set_absorb_mixing(false);
    const std::string arch = draw % 2 ? "sm_80" : "sm_90a";
    SCOPED_TRACE(testing::describe(c) + " T=" + std::to_string(T) + " " + arch);
    auto dc = decodeCaseFrom(c, layout);
    ASSERT_TRUE(dc) << dc.error().message;
    auto plan = decodePlan(*dc, schedule, arch);
    ASSERT_TRUE(plan) << plan.error().message;
    EXPECT_EQ(plan->schedule.mix(), v1::mix_fused) << plan->schedule.ShortDebugString();
    expectEmulatedStep(c, *dc, arch, rng(), schedule);
  }
}

// Split-KV (flash-decoding): kv_splits CTAs per query block, each over its
// share of the visible key blocks, merged by the combine launch. Drawn specs
// with ragged caches of several 16-row key blocks, 2 to 6 splits (some
// shares empty where a sequence has fewer blocks than splits, or a window
// hides them), either layout: the host kernel, and for two of the draws the
// emulated CUDA step, give the forward's rows.
TEST(Decode, SplitKvStepsGiveTheForwardsRows) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x5b117);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 5; ++draw) {
    auto [c, T, layout] = drawCheckableStep(rng, [&] { return drawCudaShape(rng, 8, 48); }, 3, 16);
    Schedule schedule;
    schedule.set_kv_splits(int32_t(pick(2, 6)));
    schedule.set_block_n(16);
    const std::string arch = draw % 2 ? "sm_90a" : "sm_80";
    SCOPED_TRACE(testing::describe(c) + " T=" + std::to_string(T) + " page " + std::to_string(layout.pageSize) + " " +
                 cacheLayoutName(layout.layout) + " kv_splits " + std::to_string(schedule.kv_splits()));
    auto dc = decodeCaseFrom(c, layout);
    ASSERT_TRUE(dc) << dc.error().message;
    expectHostStep(c, *dc, schedule);
    if (draw < 2) expectEmulatedStep(c, *dc, arch, rng(), schedule);
  }
  // More splits than a warp has lanes (the CUDA combine's lanes keep two
  // weights each): 300 tokens of two pseudo-heads, no window, are 38 key
  // blocks, one a split, the last two splits without a key.
  KernelSpec spec = testing::randomSpec(rng);
  spec.set_dtype(v1::bfloat16);
  spec.set_head_dim(16);
  spec.set_pseudo_heads(2);
  spec.clear_window();
  spec.clear_window_align();
  spec.clear_window_rows();
  testing::dropStaleOptions(spec);
  ASSERT_TRUE(validateSpec(spec)) << spec.ShortDebugString();
  IhaCase c = drawCheckableCase(spec, 1, 300, rng());
  DecodeLayout layout = drawCheckableLayout(rng, c, 1, 16);
  layout.cached = {299};  // the last token's step, over all the others
  Schedule schedule;
  schedule.set_kv_splits(40);
  schedule.set_block_n(16);
  SCOPED_TRACE(testing::describe(c) + " kv_splits 40");
  auto dc = decodeCaseFrom(c, layout);
  ASSERT_TRUE(dc) << dc.error().message;
  expectEmulatedStep(c, *dc, "sm_80", rng(), schedule);
}

// stack_heads: one CTA per kv group holds every query head of the group,
// the same rows of each. Drawn GQA specs (2 to 4 query heads a kv head),
// T = 1 to 5 new tokens under query blocks small enough that a head's rows
// span several CTAs, either collapse, split or not, either layout: the host
// kernel, and for two of the draws the emulated CUDA step (sm_80, sm_90a),
// give the forward's rows; the plan's grid has a CTA per kv group.
TEST(Decode, StackedHeadsGiveTheForwardsRows) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x57ac4);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 6; ++draw) {
    const int64_t group = pick(2, 4);
    auto [c, T, layout] = drawCheckableStep(
        rng,
        [&] {
          KernelSpec spec = testing::randomSpec(rng);
          spec.set_kv_heads(int32_t(pick(1, 2)));
          spec.set_heads(int32_t(spec.kv_heads() * group));
          spec.set_pseudo_heads(int32_t(pick(1, 3)));
          spec.set_dtype(pick(0, 1) ? v1::float16 : v1::bfloat16);
          spec.set_head_dim(int32_t(16 * pick(1, 2)));
          testing::dropStaleOptions(spec);
          return testing::DrawnShape{spec, pick(1, 2), pick(6, 30)};
        },
        5, 16);
    const int64_t P = c.spec.pseudo_heads();
    Schedule schedule;
    schedule.set_stack_heads(true);
    schedule.set_warps(1);
    // 16 or 32 rows: as little as one token of each head in a CTA.
    schedule.set_block_m(int32_t(group * P <= 16 && pick(0, 1) ? 16 : 32 * ((group * P + 31) / 32)));
    schedule.set_block_n(16);
    if (pick(0, 2) == 0) schedule.set_kv_splits(int32_t(pick(2, 3)));
    else schedule.set_collapse(c.spec.collapse() == v1::per_head && pick(0, 1) ? v1::collapse_fused
                                                                               : v1::collapse_separate);
    SCOPED_TRACE(testing::describe(c) + " T=" + std::to_string(T) + " page " + std::to_string(layout.pageSize) + " " +
                 cacheLayoutName(layout.layout) + " schedule " + schedule.ShortDebugString());
    auto dc = decodeCaseFrom(c, layout);
    ASSERT_TRUE(dc) << dc.error().message;
    auto plan = decodePlan(*dc, schedule, "cpu");
    ASSERT_TRUE(plan) << plan.error().message;
    EXPECT_TRUE(plan->schedule.stack_heads());
    for (const LaunchPlan& launch : plan->launches)
      if (launch.name == kAttentionEntry) {
        EXPECT_EQ(launch.gridY, c.spec.kv_heads() * std::max(1, schedule.kv_splits())) << "a CTA per (kv group, split)";
        EXPECT_EQ(launch.rowsPerCta, schedule.block_m() / group / P * P) << "each head's rows";
      }
    expectHostStep(c, *dc, schedule);
    if (draw < 2) expectEmulatedStep(c, *dc, draw == 0 ? "sm_80" : "sm_90a", rng(), schedule);
  }
}

// A step of a case drawn by drawCheckableShape over `drawShape` whose CTA
// holds every head (`schedule` asks for the absorbed or the tensor-mixing
// step): T = 1 to 3 new tokens over a ragged raw cache, split or not
// (drawCheckableStep);
// the plan keeps the step asked for, one CTA a split and chunk of stepHeads
// heads (every head up to 16), and its emulated step gives the forward's rows.
template <class DrawShape>
void expectAllHeadsStep(std::mt19937_64& rng, DrawShape drawShape, Schedule schedule, const std::string& arch) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto [c, T, layout] =
      drawCheckableStep(rng, drawShape, 3, 9);
  layout.layout = CacheLayout::raw;
  if (pick(0, 1)) schedule.set_kv_splits(int32_t(pick(1, 4)));
  SCOPED_TRACE(testing::describe(c) + " T=" + std::to_string(T) + " page " + std::to_string(layout.pageSize) + " " +
               arch + " " + schedule.ShortDebugString());
  auto dc = decodeCaseFrom(c, layout);
  ASSERT_TRUE(dc) << dc.error().message;
  auto plan = decodePlan(*dc, schedule, arch);
  ASSERT_TRUE(plan) << plan.error().message;
  EXPECT_EQ(plan->schedule.absorb_mixing(), schedule.absorb_mixing()) << plan->schedule.ShortDebugString();
  EXPECT_EQ(plan->schedule.tensor_mixing(), schedule.tensor_mixing()) << plan->schedule.ShortDebugString();
  for (const LaunchPlan& launch : plan->launches) {
    if (launch.name != kAttentionEntry) continue;
    const int most = stepMostHeads(schedule.tensor_mixing(), c.spec.pseudo_heads(), c.spec.head_dim());
    EXPECT_EQ(launch.gridY, c.spec.heads() / stepHeads(c.spec.heads(), c.spec.kv_heads(), most) *
                                plan->schedule.kv_splits())
        << "a CTA a split and chunk of heads";
  }
  expectEmulatedStep(c, *dc, arch, rng(), schedule);
}

// H over 16 in CTAs of stepHeads heads (layout.h): chunks of 16 reading
// whole kv groups (32, 8), of 12 (24, 8: a CTA's kv heads start at 4), of
// 12 within a group of 24 (48, 2: a CTA's heads read one kv head), and of
// 16 with G = H (32, 32).
std::pair<int32_t, int32_t> drawChunkedHeads(std::mt19937_64& rng) {
  constexpr std::pair<int32_t, int32_t> kHeads[] = {{32, 8}, {24, 8}, {48, 2}, {32, 32}};
  return kHeads[std::uniform_int_distribution<int>(0, 3)(rng)];
}

// The absorbed step (the default over a raw cache where the spec allows it
// and it multiplies less than tensor mixing; loom/tile/cuda_absorbed.h): the cached rows are never mixed, the keys'
// mix absorbed into P rows of R(-j) q a query row, the values' into the
// probabilities. Drawn specs, qk_norm on and off (on: the keys' norms from
// each token's Gram matrix), P 1 to 8 (those not a power of two take
// padding S rows), G odd and even (a padding head; the last draw G 9 to 20,
// two 16-row Gram tiles where G > 16; one draw H over 16, drawChunkedHeads),
// head_dim 16 to 64, every mask and
// window, T = 1 to 3 new tokens (several tokens of every head in one CTA),
// ragged caches over drawn pages, split (shares empty) or not, sm_80 and
// sm_90a by turns: the emulated step gives the forward's rows with no
// finding, from a plan whose CTA holds every head.
TEST(Decode, AbsorbedStepsGiveTheForwardsRows) {
  std::mt19937_64 rng(testing::testSeed() ^ 0xab50);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 8; ++draw) {
    auto drawShape = [&] {
      KernelSpec spec = testing::randomSpec(rng);
      spec.set_pseudo_heads(int32_t(draw == 0 ? 8 : draw == 1 ? 3 : draw == 6 ? 1 : draw == 7 ? pick(1, 2) : pick(1, 5)));
      spec.set_kv_heads(int32_t(draw == 6 ? pick(9, 20) : pick(1, 3)));
      spec.set_heads(int32_t(spec.kv_heads() * pick(1, std::max<int64_t>(1, 8 / (spec.kv_heads() * spec.pseudo_heads())))));
      if (draw == 7) {
        const auto [heads, kvHeads] = drawChunkedHeads(rng);
        spec.set_heads(heads);
        spec.set_kv_heads(kvHeads);
      }
      spec.set_head_dim(int32_t(16 * pick(1, spec.pseudo_heads() > 4 || draw >= 6 ? 2 : 4)));
      spec.set_dtype(pick(0, 1) ? v1::float16 : v1::bfloat16);
      if (draw >= 2 && draw != 5) {
        spec.set_qk_norm(v1::KernelSpec::rms);
      } else if (draw < 2) {
        spec.clear_qk_norm();
        spec.clear_qk_norm_eps();
      }
      testing::dropStaleOptions(spec);
      return testing::DrawnShape{spec, pick(1, 2), pick(12, 40)};
    };
    Schedule schedule;
    schedule.set_absorb_mixing(true);  // at P above 4 it may mix on the tensor cores
    expectAllHeadsStep(rng, drawShape, schedule, draw % 2 ? "sm_90a" : "sm_80");
  }
}

// One-warp absorbed steps at head_dim 128 (H = G = 8 and 16, P 1, RoPE,
// no qk_norm: the drawn grid specs of LOOM_GRID_SEED 123 and 128): a warp
// has fewer threads than a head's (token, half-chunk) pieces of a key
// block, so rotateStage gives each thread pieces and turns them in every
// head, unrolled. Drawn masks, windows, dtypes and caches, sm_80 and sm_90a
// by turns: the emulated step gives the forward's rows with no finding.
TEST(Decode, OneWarpAbsorbedStepsTurnEveryHeadsKeys) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x1e7a);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 4; ++draw) {
    const int32_t heads = draw < 2 ? 8 : 16;
    auto drawShape = [&] {
      KernelSpec spec = testing::randomSpec(rng);
      spec.set_heads(heads);
      spec.set_kv_heads(heads);
      spec.set_pseudo_heads(1);
      spec.set_head_dim(128);
      spec.set_dtype(pick(0, 1) ? v1::float16 : v1::bfloat16);
      spec.set_rope_theta(10000);
      spec.clear_qk_norm();
      spec.clear_qk_norm_eps();
      testing::dropStaleOptions(spec);
      return testing::DrawnShape{spec, 1, pick(12, 40)};
    };
    Schedule schedule;
    schedule.set_absorb_mixing(true);
    schedule.set_warps(1);  // the default here; a warp a CTA is what the test is about
    expectAllHeadsStep(rng, drawShape, schedule, draw % 2 ? "sm_90a" : "sm_80");
  }
}

// A fault put into a tile header: `from` replaced by `to`, and the findings
// the emulator must report (none: the output must be wrong instead).
struct HeaderFault {
  const char* name;
  const char* from;
  const char* to;
  std::vector<emu::FindingKind> kinds;
};

// The plan's step on the emulator: no finding and the forward's rows as
// written; with each fault of `header`, the fault's findings (or a wrong
// output).
void expectHeaderFaultsFound(const IhaCase& c, const DecodeCase& dc, const KernelPlan& plan, const std::string& header,
                             const std::vector<HeaderFault>& faults, uint64_t seed) {
  emu::EmuOptions o = testing::emulatorOptions(seed);
  auto clean = emu::runDecodeOnEmulator(plan, dc, o);
  ASSERT_TRUE(clean) << clean.error().message;
  EXPECT_EQ(clean->findingCount, 0) << emu::summary(*clean);
  EXPECT_LE(relativeError(clean->out, dc.expected), toleranceFor(c.spec.dtype()));
  for (const HeaderFault& fault : faults) {
    SCOPED_TRACE(fault.name);
    o.headers = testing::mutatedHeader(header, fault.from, fault.to);
    ASSERT_FALSE(o.headers.empty());
    auto faulty = emu::runDecodeOnEmulator(plan, dc, o);
    ASSERT_TRUE(faulty) << faulty.error().message;
    if (fault.kinds.empty())  // NaN is as wrong as any other output off the reference
      EXPECT_FALSE(relativeError(faulty->out, dc.expected) <= toleranceFor(c.spec.dtype())) << emu::summary(*faulty);
    testing::expectEachFinding(*faulty, fault.kinds, fault.name, "wrong output");
  }
}

// The emulator finds what the absorbed step's barriers prevent, and a
// wrong weight or norm: each fault of cuda_absorbed.h on the same drawn
// step (P 4, two warps an m-tile, RoPE and qk_norm), whose unchanged code
// has no finding.
TEST(Decode, AbsorbedStepFaultsAreFound) {
  const std::vector<HeaderFault> faults = {
      {"the barrier before the P' tile is read removed",
       "  __syncthreads();  // P' and the row maxima of both warps of the m-tile\n", "", {emu::FindingKind::race}},
      {"the warp's barrier before its fold removed", "  __syncwarp();\n  // P' of this warp's own", "  // P'",
       {emu::FindingKind::race}},
      {"the values' weights of the wrong pseudo-head",
       "        const float w = weights[m * A::P + j];", "        const float w = weights[m * A::P + (j + 1) % A::P];", {}},
      {"the warp's barrier between its Gram matrix and the norms removed", "    __syncwarp();\n    // sum_m w_m",
       "    // sum_m w_m", {emu::FindingKind::race}},
      {"the warp's barrier between its turned rows and their Gram matrix removed",
       "if constexpr (C::rope_theta > 0) __syncwarp();", "if constexpr (C::rope_theta > 0) {}", {emu::FindingKind::race}},
      {"a token's key norms stored as the next token's", "norms[i % forms * A::tokens + tokenOf(i / forms)] =",
       "norms[i % forms * A::tokens + (tokenOf(i / forms) + 1) % A::tokens] =", {}},
      // (the next: a short sequence's only live token is a batch's first)
      {"a batch's Gram matrices read as its next token's", "l < items ? l / forms : 0) * A::G * pitch;",
       "l < items ? (l / forms + 1) % batch : 0) * A::G * pitch;", {}},
  };
  std::mt19937_64 rng(testing::testSeed() ^ 0xfa17);
  IhaCase c;
  const DecodeCase step = drawRawStep(rng, c, 4, 2, 4, 32, 24, 5, [](KernelSpec& spec) {
    spec.set_qk_norm(v1::KernelSpec::rms);
    spec.set_rope_theta(10000);
  });
  const DecodeCase* dc = &step;
  auto plan = decodePlan(*dc, Schedule(), "sm_80");
  ASSERT_TRUE(plan) << plan.error().message;
  ASSERT_TRUE(plan->schedule.absorb_mixing());
  ASSERT_EQ(plan->schedule.warps(), 2) << "two warps share the m-tile";
  // G 2 P 4: a warp's four tokens take one Gram product and one pass of forms
  ASSERT_EQ(absorbedGramTokens(2, 4, 2), 4);
  ASSERT_EQ(absorbedGramTokens(4, 4, 4), 2);  // H 8 G 4 P 4: two tokens a warp, both in one product
  ASSERT_EQ(absorbedGramTokens(16, 4, 8), 1);
  expectHeaderFaultsFound(c, *dc, *plan, "loom/tile/cuda_absorbed.h", faults, rng());
}

// The tensor-mixing step (the default over a raw cache where it multiplies less
// than absorbing; loom/tile/cuda_tensor_mixing.h): each cached token's rows mixed on the
// tensor cores (bf16 weights in two halves), two heads a warp. Drawn
// specs: P 1 to 8 (mostly 5 to 8; below 8 the keys past P score -inf, below
// 5 several tokens of a head in its eight rows), H up to 16 (odd H: a warp's
// second head is padding), G dividing H (one draw an even H / G: a warp's
// heads share their keys and mix two tokens at once, tensorMixingPairs; one
// draw G 9 to 16 and H G or 2 G: a padding staged head where G is odd, two
// k-steps of staged rows where paired; one H over 16, drawChunkedHeads), head_dim
// 16 to 128 (32 on with
// RoPE), qk_norm on and off, f16 and bf16, every mask and window, T = 1 to
// 3, ragged caches over drawn pages, split or not, sm_80 and sm_90a by
// turns: the emulated step gives the forward's rows with no finding.
TEST(Decode, TensorMixingStepsGiveTheForwardsRows) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7e45);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 7; ++draw) {
    auto drawShape = [&] {
      KernelSpec spec = testing::randomSpec(rng);
      spec.set_pseudo_heads(int32_t(draw == 0 ? 8 : draw == 5 ? pick(1, 4) : pick(5, 8)));
      const int64_t kv = draw == 4 ? pick(9, 16) : pick(1, 4);
      spec.set_kv_heads(int32_t(kv));
      spec.set_heads(int32_t(kv * (draw == 4 ? pick(1, 2) : draw == 1 ? 2 * pick(1, 8 / kv) : pick(1, 16 / kv))));
      if (draw == 6) {
        const auto [heads, kvHeads] = drawChunkedHeads(rng);
        spec.set_heads(heads);
        spec.set_kv_heads(kvHeads);
      }
      spec.set_head_dim(int32_t(spec.rope_theta() > 0 ? 32 * pick(1, draw == 6 ? 1 : 4) : 16 * pick(1, draw == 6 ? 2 : 8)));
      spec.set_dtype(pick(0, 1) ? v1::float16 : v1::bfloat16);
      if (pick(0, 1)) {
        spec.set_qk_norm(v1::KernelSpec::rms);
      } else {
        spec.clear_qk_norm();
        spec.clear_qk_norm_eps();
      }
      testing::dropStaleOptions(spec);
      return testing::DrawnShape{spec, pick(1, 2), pick(8, 30)};
    };
    Schedule schedule;
    schedule.set_tensor_mixing(true);
    expectAllHeadsStep(rng, drawShape, schedule, draw % 2 ? "sm_90a" : "sm_80");
  }
}

// The emulator finds what the tensor-mixing step's barriers prevent, and
// its arithmetic's faults: each fault of cuda_tensor_mixing.h on the same
// drawn step (H 4, G 2: a warp's heads share their keys, and its mix and P' V are
// m16n8k8 over a pass's four staged rows; P 6: keys past P;
// RoPE and qk_norm; two warps; one split, so that its stages turn over),
// whose unchanged code has no finding; the faults of the unpaired path on
// a step of G = H 4.
TEST(Decode, TensorMixingFaultsAreFound) {
  const std::vector<HeaderFault> faults = {
      {"the barrier between a block's turned rows and their mix removed",
       "    absorbed::rotateStage<C>(block);\n    __syncthreads();", "    absorbed::rotateStage<C>(block);",
       {emu::FindingKind::race}},
      {"the stage released without a barrier", "  __syncthreads();  // the stage is the next block's copies'", "",
       {emu::FindingKind::race}},
      {"R(j) turned the other way", "            partner[n][e] = x * sn + y * cs;",
       "            partner[n][e] = y * cs - x * sn;", {}},
      {"keys past P scored", "      if (fragment::accumulatorColumn(l, e) >= T::P)", "      if (false)", {}},
      {"a key's norm taken from its neighbour", "const int source = 4 * (2 * (l % 4) + e);",
       "const int source = 4 * ((2 * (l % 4) + e + 1) % 8);", {}},
      {"a pass's P' times the next token's value rows", "Bits32((token * T::pitch + dn * kMmaK)",
       "Bits32(((token + 1) % T::tokens * T::pitch + dn * kMmaK)", {}},
      {"token 0's probabilities folded with token 1's value weights too",
       "      probs[2] = s.p[first + 1][0];\n      probs[3] = s.p[first + 1][1];",
       "      probs[2] = s.p[first][0];\n      probs[3] = s.p[first][1];",
       {}},
      {"a key row mixed from the other token's raw rows",
       "splitPair<C>(token == 0 ? w : 0.0f, token == 1 ? w : 0.0f,", "splitPair<C>(token == 1 ? w : 0.0f, token == 0 ? w : 0.0f,",
       {}},
      // G 2, paired: a pass's four staged rows fit 8 (tensorMixingNarrow)
      {"the narrow mix's raw rows taken from staged rows 8-15 (padding)", "    mmaStaged<C>(c[0], hi[km], x[0], x[1]);",
       "    mmaStaged<C>(c[0], hi[km], x[1], x[1]);", {}},
      {"the narrow P' V over value rows 8-15 (padding)", "        mmaStaged<C>(acc.o[2 * dn], a[t][km], x[0], x[1]);",
       "        mmaStaged<C>(acc.o[2 * dn], a[t][km], x[1], x[1]);", {}},
      {"the narrow products' A taken from k 8-15 (P''s second n-tile, the weights' padding)",
       "cuda::mma1688<C>(d, a[0], a[1], b0);", "cuda::mma1688<C>(d, a[2], a[3], b0);", {}},
      {"a block's copies waited for one stage late",
       "  cuda::waitCopies<C::stages - 1>();\n  __syncthreads();\n  if constexpr (T::rope) {",
       "  cuda::waitCopies<C::stages>();\n  __syncthreads();\n  if constexpr (T::rope) {",
       {emu::FindingKind::asyncAccess}},
  };
  std::mt19937_64 rng(testing::testSeed() ^ 0x7e46);
  IhaCase c;
  const DecodeCase step = drawRawStep(
      rng, c, 4, 2, 6, 32, 24, 5,
      [](KernelSpec& spec) {
        spec.set_qk_norm(v1::KernelSpec::rms);
        spec.set_rope_theta(10000);
      },
      /*minCached=*/16);  // eight key blocks at least
  const DecodeCase* dc = &step;
  Schedule unsplit;  // every key block in one CTA: its stages turn over
  unsplit.set_tensor_mixing(true);
  unsplit.set_kv_splits(1);
  auto plan = decodePlan(*dc, unsplit, "sm_80");
  ASSERT_TRUE(plan) << plan.error().message;
  ASSERT_TRUE(plan->schedule.tensor_mixing()) << plan->schedule.ShortDebugString();
  ASSERT_EQ(plan->schedule.warps(), 2) << "two heads a warp";
  ASSERT_TRUE(tensorMixingPairs(4, 2)) << "the two heads of a warp read one kv head";
  ASSERT_TRUE(tensorMixingNarrow(4, 2)) << "a pass's staged rows fit m16n8k8's k";
  expectHeaderFaultsFound(c, *dc, *plan, "loom/tile/cuda_tensor_mixing.h", faults, rng());
  // G = H: each warp's heads read their own kv heads, a token at a time.
  const std::vector<HeaderFault> unpaired = {
      {"each head's probabilities folded with the other head's value weights",
       "Bits32 probs[4] = {s.p[t][0], 0u, 0u, s.p[t][1]};", "Bits32 probs[4] = {0u, s.p[t][0], s.p[t][1], 0u};", {}},
      {"each head's keys mixed with the other head's weights",
       "splitPair<C>(keyWeight(h, column), keyWeight(h, column + 1),",
       "splitPair<C>(keyWeight(1 - h, column), keyWeight(1 - h, column + 1),", {}},
  };
  IhaCase own;
  const DecodeCase ownStep = drawRawStep(rng, own, 4, 4, 6, 32, 24, 5, {}, /*minCached=*/16);
  auto ownPlan = decodePlan(ownStep, unsplit, "sm_80");
  ASSERT_TRUE(ownPlan) << ownPlan.error().message;
  ASSERT_TRUE(ownPlan->schedule.tensor_mixing()) << ownPlan->schedule.ShortDebugString();
  ASSERT_FALSE(tensorMixingPairs(4, 4));
  expectHeaderFaultsFound(own, ownStep, *ownPlan, "loom/tile/cuda_tensor_mixing.h", unpaired, rng());
}

// sm_90a's wgmma step (engine wgmma): a producer warpgroup mixes each raw
// page's rows on chip (or copies a mixed cache's) into the swizzled stages,
// a consumer warpgroup takes 64 of the step's rows. Drawn specs of head_dim
// 64 or 128, T = 1 to 5, ragged caches over pages of 1 to 16 tokens, either
// layout, split (some shares empty) or not, either collapse: the emulated
// step gives the forward's rows with no finding, from a warp-specialised
// launch.
TEST(Decode, WgmmaStepsGiveTheForwardsRows) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x90a);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 4; ++draw) {
    auto [c, T, layout] = drawCheckableStep(
        rng,
        [&] {
          KernelSpec spec = testing::randomSpec(rng);
          spec.set_dtype(pick(0, 1) ? v1::float16 : v1::bfloat16);
          spec.set_head_dim(int32_t(64 * pick(1, 2)));
          return testing::DrawnShape{spec, pick(1, 2), pick(4, 40)};
        },
        5, 16);
    Schedule schedule;
    schedule.set_engine(v1::engine_wgmma);
    if (draw % 2) schedule.set_kv_splits(int32_t(pick(2, 4)));
    else schedule.set_collapse(pick(0, 1) ? v1::collapse_fused : v1::collapse_separate);
    if (pick(0, 1)) schedule.set_block_n(64);
    SCOPED_TRACE(testing::describe(c) + " T=" + std::to_string(T) + " page " + std::to_string(layout.pageSize) + " " +
                 cacheLayoutName(layout.layout) + " schedule " + schedule.ShortDebugString());
    auto dc = decodeCaseFrom(c, layout);
    ASSERT_TRUE(dc) << dc.error().message;
    auto plan = decodePlan(*dc, schedule, "sm_90a");
    // A global collapse in the epilogue keeps an f32 tile of every head's
    // tokens: with few pseudo-heads it can outgrow shared memory, which the
    // compiler rightly refuses; such a draw takes the separate collapse.
    if (!plan && schedule.collapse() == v1::collapse_fused &&
        plan.error().message.find("shared memory") != std::string::npos) {
      schedule.set_collapse(v1::collapse_separate);
      plan = decodePlan(*dc, schedule, "sm_90a");
    }
    ASSERT_TRUE(plan) << plan.error().message;
    EXPECT_EQ(plan->schedule.engine(), v1::engine_wgmma);
    for (const LaunchPlan& launch : plan->launches)
      if (launch.name == kAttentionEntry) EXPECT_EQ(launch.threads, 256) << "a producer and a consumer warpgroup";
    expectEmulatedStep(c, *dc, "sm_90a", rng(), schedule);
  }
}

// The wgmma step's producer over a raw cache streams each key block's
// tokens through its ring of raw rows (hopper.h, mixKvTile: half the ring
// copied by cp.async while the other half is mixed). A drawn step whose
// block takes four or more steps of the ring (G 2, d 64, P 2: 8 tokens a
// half, at least 25 tokens seen) has no finding; without the barrier that publishes a step's
// copies, or the one that frees its half for the copies two steps on, the
// emulator has findings (in one of up to four schedules).
TEST(Decode, WgmmaRingFaultsAreFound) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x41c6);
  IhaCase c;
  const DecodeCase step = drawRawStep(rng, c, 2, 2, 2, 64, 40, 7, {}, /*minCached=*/24);  // 25 tokens: 4 steps
  const DecodeCase* dc = &step;
  Schedule schedule;
  schedule.set_engine(v1::engine_wgmma);
  schedule.set_kv_splits(1);
  auto plan = decodePlan(*dc, schedule, "sm_90a");
  ASSERT_TRUE(plan) << plan.error().message;
  emu::EmuOptions o = testing::emulatorOptions(rng());
  auto clean = emu::runDecodeOnEmulator(*plan, *dc, o);
  ASSERT_TRUE(clean) << clean.error().message;
  EXPECT_EQ(clean->findingCount, 0) << emu::summary(*clean);
  EXPECT_LE(relativeError(clean->out, dc->expected), toleranceFor(c.spec.dtype()));
  const std::pair<const char*, const char*> faults[] = {
      {"the barrier publishing a step's copies removed",
       "    namedBarrier<kProducerBarrier, kWarpgroupThreads>();  // every thread's copies of this step landed\n"},
      {"the barrier freeing a half for later copies removed",
       "    namedBarrier<kProducerBarrier, kWarpgroupThreads>();  // this half is free for step + 2's copies\n"},
  };
  for (const auto& [name, line] : faults) {
    SCOPED_TRACE(name);
    o.headers = testing::mutatedHeader("loom/tile/hopper.h", line, "");
    ASSERT_FALSE(o.headers.empty());
    // What the emulator sees depends on the interleaving its seed draws (a
    // race, a read of rows not yet copied or of a copy still in flight; a
    // schedule that runs every warp past the mixing before any copies again
    // hides the second): up to four schedules, one must have a finding.
    Result<emu::EmuRun> faulty = makeError("not run");
    for (int schedule = 0; schedule < 4; ++schedule) {
      o.seed = rng();
      faulty = emu::runDecodeOnEmulator(*plan, *dc, o);
      ASSERT_TRUE(faulty) << faulty.error().message;
      if (faulty->findingCount > 0) break;
    }
    EXPECT_GT(faulty->findingCount, 0) << name << "\n" << emu::summary(*faulty);
    testing::expectEachFinding(*faulty, {}, name, "no finding");
  }
}

// A CUDA decode step splits its cache by default so that a batch of one
// covers the SMs: the device's SMs over the step's CTAs a sequence (H, or
// G stacked), at most 16; unsplit where the collapse is asked in the
// epilogue, and on the CPU.
// The device's page check (IhaArgs::sequence_ok; a CUDA launch given an
// error word, EmuOptions::devicePageCheck here): a drawn step of two or
// three sequences on the emulator, the default step of either arch and
// either layout. With a valid table: error word 0, every sequence checked,
// the forward's rows. Then one sequence's page entry out of range (past
// num_pages, or negative), or its length past its pages: no finding (nothing
// read or written outside a buffer), error word 1, that sequence refused,
// the others' out rows and appended slots bit for bit those of the valid
// step, and every other cache element as it was.
TEST(Decode, DevicePageCheckRefusesABadSequenceAndTouchesNothing) {
  std::mt19937_64 rng(testing::testSeed() ^ 0xbadba6e);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto [c, T, layout] = drawCheckableStep(
      rng,
      [&] {
        KernelSpec spec = testing::randomSpec(rng);
        spec.set_dtype(pick(0, 1) ? v1::float16 : v1::bfloat16);
        spec.set_head_dim(int32_t(16 * pick(1, 4)));
        return testing::DrawnShape{spec, pick(2, 3), pick(6, 30)};
      },
      3, 9);
  const std::string arch = pick(0, 1) ? "sm_90a" : "sm_80";
  SCOPED_TRACE(testing::describe(c) + " T=" + std::to_string(T) + " page " + std::to_string(layout.pageSize) + " " +
               arch + " " + cacheLayoutName(layout.layout));
  auto valid = decodeCaseFrom(c, layout);
  ASSERT_TRUE(valid) << valid.error().message;
  auto plan = decodePlan(*valid, {}, arch);
  ASSERT_TRUE(plan) << plan.error().message;
  emu::EmuOptions options = testing::emulatorOptions(rng());
  options.devicePageCheck = true;
  auto good = emu::runDecodeOnEmulator(*plan, *valid, options);
  ASSERT_TRUE(good) << good.error().message;
  EXPECT_EQ(good->findingCount, 0) << emu::summary(*good);
  EXPECT_EQ(good->pageErrors, 0);
  EXPECT_EQ(good->sequenceOk, std::vector<int32_t>(size_t(c.batch), 1));
  EXPECT_LE(relativeError(good->out, valid->expected), toleranceFor(c.spec.dtype()));
  ASSERT_TRUE(good->cache);
  expectAppend(c, *valid, *good->cache);

  const DecodeShape& shape = valid->shape;
  const int64_t rowElements = (valid->layout == CacheLayout::mixed ? c.spec.pseudo_heads() : 1) *
                              c.spec.kv_heads() * c.spec.head_dim();
  const int64_t outRow = T * c.spec.heads() * c.spec.head_dim();
  auto same = [](double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); };
  for (int variant = 0; variant < 3; ++variant) {
    const int64_t bad = pick(0, c.batch - 1);
    DecodeCase broken = *valid;
    std::vector<int32_t>& table = broken.cache.pageTable;
    const int64_t used = (broken.cache.cacheLen[size_t(bad)] + T + shape.pageSize - 1) / shape.pageSize;
    if (variant == 2) broken.cache.cacheLen[size_t(bad)] = int32_t(shape.maxPages * shape.pageSize - T + pick(1, 5));
    else table[size_t(bad * shape.maxPages + pick(0, used - 1))] = variant == 0 ? int32_t(shape.numPages + pick(0, 4)) : -1;
    SCOPED_TRACE("sequence " + std::to_string(bad) + (variant == 2 ? ": length past its pages" : ": a page entry out of range"));
    auto run = emu::runDecodeOnEmulator(*plan, broken, options);
    ASSERT_TRUE(run) << run.error().message;
    EXPECT_EQ(run->findingCount, 0) << emu::summary(*run);
    EXPECT_FALSE(run->deadlocked);
    EXPECT_EQ(run->pageErrors, 1);
    for (int64_t b = 0; b < c.batch; ++b) {
      EXPECT_EQ(run->sequenceOk[size_t(b)], b == bad ? 0 : 1) << "sequence " << b;
      if (b == bad) continue;
      for (int64_t i = b * outRow; i < (b + 1) * outRow; ++i)
        ASSERT_TRUE(same(run->out[size_t(i)], good->out[size_t(i)])) << "sequence " << b << " out element " << i;
    }
    // The cache: the good sequences' new slots as the valid step wrote them, everything else as it was.
    ASSERT_TRUE(run->cache);
    std::vector<bool> appended(size_t(shape.numPages * shape.pageSize), false);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t t = valid->cache.cacheLen[size_t(b)]; b != bad && t < valid->cache.cacheLen[size_t(b)] + T; ++t)
        appended[size_t(reference::cacheSlot(valid->cache, b, t))] = true;
    auto stored = [&](const std::vector<double>& values) {  // as the dtype holds them
      const NpyArray bytes = npyFromDouble(values, {int64_t(values.size())}, storageTypeOf(c.spec.dtype()));
      return npyToDouble(bytes, c.spec.dtype() == v1::bfloat16);
    };
    const std::vector<double> kBefore = stored(valid->cache.k), vBefore = stored(valid->cache.v);
    int64_t wrong = 0;
    for (const auto& [after, written, before] : {std::tuple{&run->cache->k, &good->cache->k, &kBefore},
                                                 std::tuple{&run->cache->v, &good->cache->v, &vBefore}})
      for (size_t i = 0; i < after->size(); ++i)
        wrong += !same((*after)[i], appended[i / size_t(rowElements)] ? (*written)[i] : (*before)[i]);
    EXPECT_EQ(wrong, 0) << "cache elements other than the good sequences' appends";
  }
}

TEST(Decode, DefaultSplitsCoverTheSms) {
  auto splitsOf = [](int heads, int kvHeads, const v1::Target& target, Schedule schedule = {}) {
    const KernelSpec spec = testing::makeSpec({.heads = heads, .kvHeads = kvHeads, .pseudoHeads = 2, .headDim = 64,
                                               .dtype = v1::bfloat16, .mask = v1::flat_causal});
    auto resolved = resolveSchedule(spec, schedule, target, Direction::decode, /*mixedCache=*/true);
    EXPECT_TRUE(resolved) << resolved.error().message;
    return resolved ? resolved->kv_splits() : -1;
  };
  const v1::Target hopper = *parseTarget("sm_90a"), ampere = *parseTarget("sm_80");
  EXPECT_EQ(splitsOf(16, 16, hopper), 132 / 16);
  EXPECT_EQ(splitsOf(16, 4, ampere), 108 / 16);
  EXPECT_EQ(splitsOf(2, 2, hopper), 16);     // at most 16
  EXPECT_EQ(splitsOf(256, 256, hopper), 1);  // more heads than SMs
  Schedule stacked;
  stacked.set_stack_heads(true);
  EXPECT_EQ(splitsOf(32, 4, hopper, stacked), 16);  // 4 CTAs a sequence
  v1::Target small = hopper;
  small.mutable_device()->set_sm_count(64);
  EXPECT_EQ(splitsOf(16, 16, small), 4);
  Schedule epilogue;
  epilogue.set_collapse(v1::collapse_fused);
  EXPECT_EQ(splitsOf(16, 16, hopper, epilogue), 1);
  EXPECT_EQ(splitsOf(16, 16, *parseTarget("cpu")), 1);
  // The absorbed step over a raw cache: one CTA a sequence, its splits the
  // SMs; a CTA of fewer than four warps (a token of every head in one or
  // two 16-row m-tiles, P 1) covers the SMs' four sub-partitions as far as
  // an SM's shared memory holds its CTAs (228 KiB on sm_90a), at most
  // kMaxKvSplits (512).
  auto absorbedSplits = [](int heads, int kvHeads, int headDim, const v1::Target& target) {
    const KernelSpec spec = testing::makeSpec({.heads = heads, .kvHeads = kvHeads, .pseudoHeads = 1,
                                               .headDim = headDim, .dtype = v1::bfloat16, .mask = v1::flat_causal});
    auto resolved = resolveSchedule(spec, Schedule(), target, Direction::decode, /*mixedCache=*/false);
    EXPECT_TRUE(resolved) << resolved.error().message;
    EXPECT_TRUE(resolved && resolved->absorb_mixing()) << (resolved ? resolved->ShortDebugString() : "");
    return resolved ? std::pair{resolved->warps(), resolved->kv_splits()} : std::pair{-1, -1};
  };
  // H = G = 16, d 64: one warp, 81 KiB a CTA, two an SM.
  EXPECT_EQ(absorbedSplits(16, 16, 64, small), (std::pair{1, 64 * 2}));
  EXPECT_EQ(absorbedSplits(16, 16, 64, hopper), (std::pair{1, 132 * 2}));
  v1::Target smallShared = small;  // one such CTA an SM
  smallShared.mutable_device()->set_shared_memory_per_multiprocessor(100 * 1024);
  EXPECT_EQ(absorbedSplits(16, 16, 64, smallShared), (std::pair{1, 64}));
  // H 16 G 4, d 64: one warp, 22 KiB a CTA, four an SM (528), capped.
  EXPECT_EQ(absorbedSplits(16, 4, 64, hopper), (std::pair{1, 512}));
  EXPECT_EQ(absorbedSplits(16, 4, 64, small), (std::pair{1, 64 * 4}));
  EXPECT_EQ(absorbedSplits(32, 8, 128, small), (std::pair{2, 64 * 2}));
  EXPECT_EQ(absorbedSplits(64, 8, 64, small), (std::pair{4, 64}));
}

// NVRTC compiles the CUDA decode step's launches with zero spills and no stack frame.
TEST(Decode, NvrtcCompilesTheCudaStepWithoutSpills) {
  KernelSpec spec = testing::makeSpec({.heads = 8, .kvHeads = 2, .pseudoHeads = 4, .headDim = 128,
                                       .dtype = v1::bfloat16, .mask = v1::flat_causal, .ropeTheta = 10000});
  spec.set_qk_norm(v1::KernelSpec::rms);
  jit::NvrtcCompiler compiler("");
  // `entries` launches, none spilling or with a stack frame.
  auto expectClean = [&](const Schedule& schedule, const char* arch, bool mixed, size_t entries) {
    SCOPED_TRACE(std::string(arch) + (mixed ? " mixed cache " : " raw cache ") + schedule.ShortDebugString());
    std::shared_ptr<const jit::Artifact> artifact;
    auto kernel = compileKernel(spec, schedule, *parseTarget(arch), compiler, &artifact, Direction::decode, mixed);
    ASSERT_TRUE(kernel) << kernel.error().message << "\n" << kernel.error().log;
    EXPECT_EQ(kernel->direction(), mixed ? v1::direction_decode_mixed : v1::direction_decode);
    if (schedule.engine() != v1::engine_wgmma)  // wgmma's producer warpgroup reads the pages itself
      EXPECT_TRUE(artifact->usesAsyncCopies()) << "the cache's pages come in by cp.async";
    ASSERT_EQ(artifact->resources.size(), entries) << artifact->log;
    for (const auto& usage : artifact->resources) {
      EXPECT_EQ(usage.spill_store_bytes() + usage.spill_load_bytes(), 0) << usage.ShortDebugString();
      EXPECT_EQ(usage.stack_frame_bytes(), 0) << usage.ShortDebugString();
    }
  };
  Schedule unsplit;  // one CTA a head and sequence
  unsplit.set_kv_splits(1);
  Schedule split;  // over four CTAs: the split store and the combine launch too
  split.set_kv_splits(4);
  for (const char* arch : {"sm_80", "sm_90a"}) {
    for (bool mixed : {false, true}) {
      // iha_append, iha_attention; over a raw cache the absorbed step's
      // collapse is a launch of its own (iha_collapse)
      expectClean(unsplit, arch, mixed, mixed ? 2 : 3);
      expectClean({}, arch, mixed, 4);       // the default splits: + iha_combine, iha_collapse
    }
    expectClean(split, arch, false, 4);
  }
  // sm_90a's wgmma step: its producer warpgroup mixing the raw pages, or
  // copying a mixed cache's, at the registers setmaxnreg leaves it.
  Schedule wgmma;
  wgmma.set_engine(v1::engine_wgmma);
  wgmma.set_kv_splits(1);
  Schedule wgmmaSplit = wgmma;
  wgmmaSplit.set_kv_splits(4);
  for (bool mixed : {false, true}) {
    expectClean(wgmma, "sm_90a", mixed, 2);
    expectClean(wgmmaSplit, "sm_90a", mixed, 4);
  }
  // The default schedules of the shapes that press the registers hardest:
  // a GQA model's H 32 G 8 d 128 with RoPE (all eight heads mixed on chip),
  // and head_dim 256 with one kv head and with qk_norm.
  const KernelSpec hard[] = {
      testing::makeSpec({.heads = 32, .kvHeads = 8, .pseudoHeads = 2, .headDim = 128, .dtype = v1::bfloat16,
                         .mask = v1::flat_causal, .ropeTheta = 10000}),
      testing::makeSpec({.heads = 8, .kvHeads = 1, .pseudoHeads = 8, .headDim = 256, .dtype = v1::bfloat16,
                         .mask = v1::flat_causal, .ropeTheta = 10000}),
      [] {
        KernelSpec s = testing::makeSpec({.heads = 4, .kvHeads = 4, .pseudoHeads = 2, .headDim = 256,
                                          .dtype = v1::float16, .mask = v1::flat_causal});
        s.set_qk_norm(v1::KernelSpec::rms);
        return s;
      }()};
  Schedule stacked;  // and each GQA shape with its kv groups' heads in one CTA
  stacked.set_stack_heads(true);
  for (const KernelSpec& shape : hard) {
    spec = shape;
    for (const char* arch : {"sm_80", "sm_90a"}) {
      expectClean({}, arch, false, 4);  // split by default
      if (spec.heads() > spec.kv_heads()) expectClean(stacked, arch, false, 4);
    }
    for (bool mixed : {false, true}) expectClean(wgmma, "sm_90a", mixed, 2);
  }
}

// A step to time (DecodeLayout::expected false) is the same step without
// the forward's rows: its cache, page table and new tokens as a checked one's.
TEST(Decode, TimingStepsSkipOnlyTheForward) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7157);
  KernelSpec spec = testing::makeSpec({.heads = 4, .kvHeads = 2, .pseudoHeads = 2, .headDim = 16,
                                       .dtype = v1::bfloat16, .mask = v1::flat_causal, .ropeTheta = 10000});
  const IhaCase c = drawCase(spec, 2, 11, rng());
  for (CacheLayout layout : {CacheLayout::raw, CacheLayout::mixed}) {
    const uint64_t seed = rng();
    auto checked = decodeCaseFrom(c, {2, 4, layout, {}, seed});
    auto timed = decodeCaseFrom(c, {2, 4, layout, {}, seed, false});
    ASSERT_TRUE(checked && timed);
    EXPECT_EQ(checked->expected.size(), size_t(2 * 2 * 4 * 16));
    EXPECT_TRUE(timed->expected.empty());
    EXPECT_EQ(timed->cache.pageTable, checked->cache.pageTable);
    EXPECT_EQ(timed->cache.cacheLen, checked->cache.cacheLen);
    EXPECT_TRUE(std::equal(timed->cache.k.begin(), timed->cache.k.end(), checked->cache.k.begin(), checked->cache.k.end(),
                           [](double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }));
    EXPECT_EQ(timed->step.q, checked->step.q);
    EXPECT_EQ(timed->step.k, checked->step.k);
  }
}

// What a decode plan cannot be (yet), each said.
TEST(Decode, PlansSayWhatTheyCannotBe) {
  const KernelSpec spec = testing::makeSpec({.heads = 4, .pseudoHeads = 2, .headDim = 64});
  GenerateOptions decode;
  decode.direction = Direction::decode;
  Schedule materialized;
  materialized.set_mix(v1::mix_materialized);
  expectPlanRefused(spec, materialized, "cpu", decode, "schedule.mix materialized does not apply to a decode step");
  GenerateOptions mixedDecode = decode;
  mixedDecode.mixedCache = true;
  Schedule fused;
  fused.set_mix(v1::mix_fused);
  expectPlanRefused(spec, fused, "cpu", mixedDecode,
                    "schedule.mix fused does not apply to a decode step over a mixed cache");
  KernelSpec half = spec;
  half.set_dtype(v1::float16);
  EXPECT_TRUE(generateKernel(half, {}, *parseTarget("sm_80"), decode));
  // Eight kv heads of d = 128 in the raw stages do not fit 64-row key
  // blocks in two stages: an unset block_n halves until they do (then an
  // unset stages drops to one); a schedule that sets both is refused.
  const KernelSpec wide = testing::makeSpec({.heads = 32, .kvHeads = 8, .pseudoHeads = 2, .headDim = 128});
  auto fitted = generateKernel(wide, {}, *parseTarget("sm_90a"), decode);
  ASSERT_TRUE(fitted) << fitted.error().message;
  EXPECT_LT(fitted->schedule.block_n(), 64);
  for (const LaunchPlan& launch : fitted->launches) EXPECT_LE(launch.sharedMemoryBytes, 232448) << launch.name;
  Schedule pinned;
  pinned.set_block_n(64);
  pinned.set_stages(2);
  expectPlanRefused(wide, pinned, "sm_90a", decode, "bytes of shared memory per block");
  GenerateOptions mixedForward;
  mixedForward.mixedCache = true;
  EXPECT_FALSE(generateKernel(spec, {}, *parseTarget("cpu"), mixedForward));
  // kv_splits: a decode step's, with the collapse after the combine.
  Schedule split;
  split.set_kv_splits(3);
  expectPlanRefused(spec, split, "cpu", GenerateOptions{}, "kv_splits is for decode plans only");
  Schedule splitFused = split;
  splitFused.set_collapse(v1::collapse_fused);
  expectPlanRefused(spec, splitFused, "sm_80", decode, "needs collapse separate");
  Schedule tooMany;
  tooMany.set_kv_splits(513);  // kMaxKvSplits + 1
  expectPlanRefused(spec, tooMany, "cpu", decode, "schedule.kv_splits (513) must be in [1, 512]");
  auto splitPlan = generateKernel(spec, split, *parseTarget("cpu"), decode);
  ASSERT_TRUE(splitPlan) << splitPlan.error().message;
  EXPECT_EQ(splitPlan->schedule.kv_splits(), 3);
  std::vector<std::string> names;
  for (const LaunchPlan& launch : splitPlan->launches) {
    names.push_back(launch.name);
    if (launch.name == kAttentionEntry) {
      EXPECT_EQ(launch.gridY, 3 * spec.heads()) << "a CTA per (head, split)";
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{kDecodeAppendEntry, kAttentionEntry, kDecodeCombineEntry, "iha_collapse"}));
  EXPECT_NE(std::find(splitPlan->workspaces.begin(), splitPlan->workspaces.end(), Workspace::splits),
            splitPlan->workspaces.end());
  // stack_heads: a decode step's, of kv groups of several heads, each head a token at least.
  Schedule stack;
  stack.set_stack_heads(true);
  expectPlanRefused(spec, stack, "cpu", decode, "stack_heads needs kv groups of several query heads");
  const KernelSpec gqa = testing::makeSpec({.heads = 8, .kvHeads = 2, .pseudoHeads = 4, .headDim = 64});
  expectPlanRefused(gqa, stack, "cpu", GenerateOptions{}, "stack_heads is for decode plans only");
  Schedule stackNarrow = stack;
  stackNarrow.set_block_m(8);
  stackNarrow.set_warps(1);
  expectPlanRefused(gqa, stackNarrow, "cpu", decode, "must hold a token of each of the 4 stacked heads");
  KernelSpec gqaGlobal = gqa;
  gqaGlobal.set_collapse(v1::global);
  Schedule stackFused = stack;
  stackFused.set_collapse(v1::collapse_fused);
  expectPlanRefused(gqaGlobal, stackFused, "cpu", decode,
                    "stack_heads needs collapse separate under a global collapse");
  Schedule stackWgmma = stack;
  stackWgmma.set_engine(v1::engine_wgmma);
  expectPlanRefused(gqa, stackWgmma, "sm_90a", decode, "stack_heads needs engine mma");
  // absorb_mixing: a CUDA decode step's over a raw cache, without qk_norm,
  // on its own shape.
  Schedule absorb;
  absorb.set_absorb_mixing(true);
  expectPlanRefused(spec, absorb, "sm_80", GenerateOptions{}, "absorb_mixing is for decode plans over a raw cache only");
  expectPlanRefused(spec, absorb, "sm_80", mixedDecode, "absorb_mixing is for decode plans over a raw cache only");
  expectPlanRefused(spec, absorb, "cpu", decode, "absorb_mixing needs a CUDA target");
  KernelSpec normed = spec;
  normed.set_qk_norm(v1::KernelSpec::rms);
  Schedule absorbWide = absorb;
  absorbWide.set_block_n(64);
  expectPlanRefused(spec, absorbWide, "sm_80", decode, "block_n (64) must be 16 with absorb_mixing");
  Schedule absorbStacked = absorb;
  absorbStacked.set_stack_heads(true);
  expectPlanRefused(gqa, absorbStacked, "sm_80", decode, "absorb_mixing already holds every query head");
  auto normedPlan = generateKernel(normed, Schedule(), *parseTarget("sm_80"), decode);
  ASSERT_TRUE(normedPlan) << normedPlan.error().message;
  EXPECT_TRUE(normedPlan->schedule.absorb_mixing()) << "qk_norm absorbs too (the keys' norms from Gram matrices)";
  // wgmma: sm_90a's, on its head dims and key blocks.
  Schedule wgmma;
  wgmma.set_engine(v1::engine_wgmma);
  expectPlanRefused(half, wgmma, "sm_80", decode, "wgmma needs target sm_90a");
  KernelSpec narrow = half;
  narrow.set_head_dim(32);
  expectPlanRefused(narrow, wgmma, "sm_90a", decode, "engine wgmma needs head_dim");
  Schedule wgmmaNarrowBlocks = wgmma;
  wgmmaNarrowBlocks.set_block_n(16);
  expectPlanRefused(half, wgmmaNarrowBlocks, "sm_90a", decode, "must be 64, 128, 192 or 256 with engine wgmma");
  for (bool mixed : {false, true}) {
    GenerateOptions options = decode;
    options.mixedCache = mixed;
    auto wgmmaPlan = generateKernel(half, wgmma, *parseTarget("sm_90a"), options);
    ASSERT_TRUE(wgmmaPlan) << wgmmaPlan.error().message;
    EXPECT_EQ(wgmmaPlan->schedule.warps(), 4) << "one consumer warpgroup: a step's rows are few";
    EXPECT_EQ(wgmmaPlan->schedule.block_m(), 64);
    EXPECT_GE(wgmmaPlan->schedule.producer_registers(), 40) << "the producer reads the pages through the table";
  }
  auto stackPlan = generateKernel(gqa, stack, *parseTarget("cpu"), decode);
  ASSERT_TRUE(stackPlan) << stackPlan.error().message;
  EXPECT_TRUE(stackPlan->schedule.stack_heads());
  EXPECT_EQ(stackPlan->schedule.block_m(), 64) << "four warps' rows hold 4 heads x 4 rows";
  auto plan = generateKernel(spec, {}, *parseTarget("cpu"), decode);
  ASSERT_TRUE(plan) << plan.error().message;
  EXPECT_EQ(plan->direction, Direction::decode);
  ASSERT_FALSE(plan->launches.empty());
  EXPECT_EQ(plan->launches.front().name, kDecodeAppendEntry);
}

// A step then the next: advancing cache_len by T and decoding again over
// the cache the first step wrote gives the forward's rows of the later tokens.
TEST(Decode, StepsChainOverTheCacheTheyWrite) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x5eed);
  for (CacheLayout layout : {CacheLayout::raw, CacheLayout::mixed}) {
    KernelSpec spec = testing::makeSpec({.heads = 4, .kvHeads = 2, .pseudoHeads = 3, .headDim = 16,
                                         .dtype = v1::float32, .mask = v1::token_causal, .ropeTheta = 10000});
    spec.set_qk_norm(v1::KernelSpec::rms);
    const int64_t N = 13;
    IhaCase c = drawCase(spec, 2, N, rng());
    c.expected = reference::ihaForward(spec, c.inputs).out;
    auto first = decodeCaseFrom(c, {2, 4, layout, {9, 9}, rng()});
    ASSERT_TRUE(first) << first.error().message;
    reference::PagedCache cache = first->cache;
    (void)reference::ihaDecode(spec, first->step, cache);
    for (int32_t& length : cache.cacheLen) length += 2;  // 11 cached: token 11 next, in the first step's last page
    auto second = decodeCaseFrom(c, {1, 4, layout, {11, 11}, 0});
    ASSERT_TRUE(second) << second.error().message;
    ASSERT_TRUE(validateDecode({2, 1, cache.numPages, cache.pageSize, cache.maxPages}, cache.pageTable, cache.cacheLen));
    const auto got = reference::ihaDecode(spec, second->step, cache);
    EXPECT_LT(relativeError(got.out, second->expected), 1e-12) << cacheLayoutName(layout);
  }
}

// The float64 oracle's step (the forward's rows to 1e-12, only the
// sequences' slots filled, every read slot kept) and the host program's.
void expectOracleAndHostStep(const IhaCase& c, const DecodeCase& dc) {
  reference::PagedCache cache = dc.cache;
  EXPECT_LT(relativeError(reference::ihaDecode(c.spec, dc.step, cache).out, dc.expected), 1e-12) << "oracle";
  expectOnlyTheSequencesSlotsFilled(dc, cache);
  expectReadSlotsKept(dc, cache, /*inDtype=*/false);
  expectHostStep(c, dc);
}

// A checkable case of `batch` sequences of N tokens for a drawn 16-bit spec
// whose head_dim every CUDA step takes (64 half the time: the wgmma step's
// too; always, with wgmma).
IhaCase drawStepCase(std::mt19937_64& rng, int64_t batch, int64_t N, bool wgmma = false) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  return testing::drawCheckableShape(rng, /*backward=*/false, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_dtype(pick(0, 1) ? v1::float16 : v1::bfloat16);
    spec.set_head_dim(int32_t(wgmma || pick(0, 1) ? 64 : 16 * pick(1, 3)));
    return testing::DrawnShape{spec, batch, N};
  });
}

// A prefix of whole pages shared by three sequences (prefix caching: one
// copy of a system prompt's pages in every table), each sequence's own
// tokens after it and a step of 1 to 3 new tokens appended to pages it owns:
// every backend (the float64 oracle, the host program, the CUDA steps of
// both arches and both sm_90a engines on the emulator) gives each sequence
// the forward's rows of its own whole sequence, writes only its own slots,
// and leaves the shared pages as they were, bit for bit.
TEST(Decode, SharedPrefixPagesAreReadByEverySharer) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x5eed);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 3; ++draw) {
    const int64_t S = pick(1, 6), T = pick(1, 3), shared = pick(1, 3), N = shared * S + T + pick(1, 9);
    DecodeLayout layout{T, S, draw % 2 ? CacheLayout::mixed : CacheLayout::raw, {}, rng()};
    layout.sharedPages = shared;
    IhaCase c;
    bool checkable = false;
    for (int tries = 0; tries < 16 && !checkable; ++tries) {
      c = drawStepCase(rng, 3, N);
      auto sharing = withSharedPrefix(c, shared * S);
      ASSERT_TRUE(sharing) << sharing.error().message;
      c = std::move(*sharing);
      layout.cached.clear();
      for (int64_t b = 0; b < 3; ++b) layout.cached.push_back(pick(shared * S, N - T));
      checkable = stepCheckable(c, layout);
    }
    ASSERT_TRUE(checkable) << testing::describe(c) << ": 16 draws without a checkable step";
    const std::string what = testing::describe(c) + ", " + cacheLayoutName(layout.layout) + " cache, pages of " +
                             std::to_string(S) + ", " + std::to_string(shared) + " shared, T " + std::to_string(T);
    SCOPED_TRACE(what);
    auto dc = decodeCaseFrom(c, layout);
    ASSERT_TRUE(dc) << dc.error().message;
    for (int64_t b = 1; b < 3; ++b)
      for (int64_t e = 0; e < shared; ++e)
        ASSERT_EQ(dc->cache.pageTable[size_t(b * dc->cache.maxPages + e)], dc->cache.pageTable[size_t(e)]);
    ASSERT_TRUE(validateDecode(dc->shape, dc->cache.pageTable, dc->cache.cacheLen));

    expectOracleAndHostStep(c, *dc);
    const uint64_t seed = rng();
    expectEmulatedStep(c, *dc, "sm_80", seed);
    expectEmulatedStep(c, *dc, "sm_90a", seed);
    Schedule wgmma;
    wgmma.set_engine(v1::engine_wgmma);
    auto wgmmaPlan = decodePlan(*dc, wgmma, "sm_90a");
    if (wgmmaPlan) expectEmulatedStep(c, *dc, "sm_90a", seed, wgmma);
    std::printf("[ shared   ] %s (sm_90a wgmma step: %s): page tables %s\n", what.c_str(),
                wgmmaPlan ? "emulated" : wgmmaPlan.error().message.c_str(), [&] {
      std::string t;
      for (int32_t e : dc->cache.pageTable) t += std::to_string(e) + " ";
      return t;
    }().c_str());
  }
}

// A step's writes go to pages one sequence names once: a shared page the
// step would write, or a page one sequence names twice, is refused (the
// rule and both entries named), and nothing runs.
TEST(Decode, SharedPagesTheStepWouldWriteAreRefused) {
  // Pages of 4; sequence 0 caches 8 (pages 3, 1 full), sequence 1 caches 6.
  const DecodeShape shape{2, 1, 8, 4, 3};
  const std::vector<int32_t> lengths = {8, 6};
  // Sequence 1 shares page 3 (positions 0-3, before its cache_len 6).
  EXPECT_TRUE(validateDecode(shape, std::vector<int32_t>{3, 1, 5, 3, 2, -1}, lengths));
  auto expectRefused = [&](std::vector<int32_t> table, const std::string& words) {
    Status status = validateDecode(shape, table, lengths);
    ASSERT_FALSE(status) << words;
    EXPECT_NE(status.error().message.find(words), std::string::npos) << status.error().message;
  };
  // ... and page 1 holds its position 6, the step's append: refused.
  expectRefused({3, 1, 5, 3, 1, -1}, "page_table[1][1] is page 1, which page_table[0][1] uses too; the step writes "
                                     "sequence 1's new tokens there (cache_len 6)");
  // The writer first: sequence 0 appends at 8, into page 5; sequence 1 reads it.
  expectRefused({3, 1, 5, 5, 2, -1}, "page_table[1][0] is page 5, which page_table[0][2] uses too; the step writes "
                                     "sequence 0's new tokens there (cache_len 8)");
  // One sequence's two positions in one page.
  expectRefused({3, 3, 5, 4, 2, -1}, "page_table[0][1] is page 3, which page_table[0][0] uses too: one sequence's "
                                     "positions cannot share a page");
  // Three sharers of two pages, each appending into its own.
  EXPECT_TRUE(validateDecode({3, 2, 9, 4, 4}, std::vector<int32_t>{0, 1, 2, -1, 0, 1, 3, 4, 0, 1, 5, -1},
                             std::vector<int32_t>{9, 12, 8}));
}

// A ragged step (docs/IHA.md, Ragged steps): sequences bringing different
// numbers of new tokens in one launch, packed by query_start_loc. Four drawn
// sequences: one brings none (its cache read by nobody, written nowhere; in
// the first draw, whose head_dim the wgmma step takes, it is empty: no key
// block, which the wgmma step once read an unfilled stage for),
// one a single decode token, one a prefill chunk of several pages, and one
// a drawn count whose append starts on a page boundary; pages of 2 to 4
// tokens, the 16-bit dtypes; two draws: a raw cache, then a mixed one with
// a shared prefix page. Each backend's packed rows against the forward's rows of
// each sequence's own tokens: the float64 oracle, the host program, the
// emulated CUDA steps (the default schedule on one of sm_80 and sm_90a, a
// split one on the other), and the sm_90a wgmma step where head_dim allows; the append
// checked as every step's, the read-only slots bit for bit.
TEST(Decode, RaggedStepsGiveEachSequencesRows) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7a66);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 2; ++draw) {
    const int64_t S = pick(2, 4), chunk = S * 2 + pick(0, S - 1);
    const int64_t shared = draw % 2, N = shared * S + chunk + pick(1, 6);
    DecodeLayout layout{1, S, draw == 1 ? CacheLayout::mixed : CacheLayout::raw, {}, rng()};
    layout.sharedPages = shared;
    IhaCase c;
    bool checkable = false;
    for (int tries = 0; tries < 16 && !checkable; ++tries) {
      c = drawStepCase(rng, 4, N, /*wgmma=*/draw == 0);
      if (shared) {
        auto sharing = withSharedPrefix(c, shared * S);
        ASSERT_TRUE(sharing) << sharing.error().message;
        c = std::move(*sharing);
      }
      // Sequence order drawn: none, one, a chunk, and a drawn count appended
      // from a page boundary (role 3).
      std::vector<int> roles = {0, 1, 2, 3};
      std::shuffle(roles.begin(), roles.end(), rng);
      const int64_t counts[] = {0, 1, chunk, pick(1, S + 1)};
      layout.newTokensOf.clear();
      layout.cached.clear();
      for (int role : roles) {
        const int64_t fresh = counts[role], least = shared * S;
        int64_t cached = pick(least, N - fresh);
        if (role == 3) cached = std::max(least, cached / S * S);
        if (role == 0 && draw == 0) cached = 0;  // an empty sequence: no key block at all
        layout.newTokensOf.push_back(fresh);
        layout.cached.push_back(cached);
      }
      checkable = stepCheckable(c, layout);
    }
    ASSERT_TRUE(checkable) << testing::describe(c) << ": 16 draws without a checkable ragged step";
    std::string counts;
    for (int64_t b = 0; b < 4; ++b)
      counts += std::to_string(layout.cached[size_t(b)]) + "+" + std::to_string(layout.newTokensOf[size_t(b)]) + " ";
    const std::string what = testing::describe(c) + ", " + cacheLayoutName(layout.layout) + " cache, pages of " +
                             std::to_string(S) + ", " + std::to_string(shared) + " shared, cached+new " + counts;
    SCOPED_TRACE(what);
    auto dc = decodeCaseFrom(c, layout);
    ASSERT_TRUE(dc) << dc.error().message;
    ASSERT_EQ(dc->step.query_start_loc.size(), 5u);
    ASSERT_EQ(dc->shape.newTokens, chunk);
    ASSERT_TRUE(validateDecode(dc->shape, dc->cache.pageTable, dc->cache.cacheLen, dc->step.query_start_loc));
    const int64_t total = dc->step.query_start_loc.back();
    ASSERT_EQ(int64_t(dc->expected.size()), total * c.spec.heads() * c.spec.head_dim());

    expectOracleAndHostStep(c, *dc);
    const uint64_t seed = rng();
    Schedule split;
    split.set_kv_splits(int32_t(pick(2, 3)));
    // The default step on one arch, a split one on the other (the draws alternate them).
    expectEmulatedStep(c, *dc, draw % 2 ? "sm_90a" : "sm_80", seed);
    expectEmulatedStep(c, *dc, draw % 2 ? "sm_80" : "sm_90a", seed, split);
    Schedule wgmma;
    wgmma.set_engine(v1::engine_wgmma);
    auto wgmmaPlan = decodePlan(*dc, wgmma, "sm_90a");
    if (wgmmaPlan) expectEmulatedStep(c, *dc, "sm_90a", seed, wgmma);
    auto byDefault = decodePlan(*dc, {}, "sm_90a");
    ASSERT_TRUE(byDefault) << byDefault.error().message;
    std::printf("[ ragged   ] %s: total %lld, sm_90a default %s, wgmma step %s\n", what.c_str(), (long long)total,
                byDefault->schedule.ShortDebugString().c_str(),
                wgmmaPlan ? "emulated" : wgmmaPlan.error().message.c_str());
  }
}

// A ragged step's grid counts its longest sequence's rows; the CTAs past a
// shorter sequence's own rows visit no key block: the host program's step
// over a 9-token chunk, a single token and an empty sequence multiplies
// exactly the key blocks of the two non-empty sequences' own steps, run
// alone (their outputs equal too, the same program on the same rows).
TEST(Decode, RaggedStepsVisitOnlyTheirOwnSequencesKeyBlocks) {
  std::mt19937_64 rng(testing::testSeed() ^ 0xb10c);
  KernelSpec spec = testing::makeSpec({.heads = 4, .kvHeads = 2, .pseudoHeads = 2, .headDim = 16,
                                       .dtype = v1::float32, .mask = v1::flat_causal, .ropeTheta = 10000});
  const IhaCase c = testing::drawCheckableShape(rng, false, [&] { return testing::DrawnShape{spec, 3, 24}; });
  const std::vector<int64_t> cached = {8, 20, 12}, fresh = {9, 1, 0};
  for (const Schedule& schedule : {Schedule(), [] {
         Schedule split;
         split.set_kv_splits(2);
         return split;
       }()}) {
    DecodeLayout ragged{1, 4, CacheLayout::raw, cached, rng()};
    ragged.newTokensOf = fresh;
    auto dc = decodeCaseFrom(c, ragged);
    ASSERT_TRUE(dc) << dc.error().message;
    auto all = runOnHost(*dc, schedule);
    ASSERT_TRUE(all) << all.error().message;
    int64_t alone = 0;
    std::vector<double> rows;
    for (int64_t b = 0; b < 3; ++b) {
      if (fresh[size_t(b)] == 0) continue;
      IhaCase one = c;
      one.batch = 1;
      one.tokens = cached[size_t(b)] + fresh[size_t(b)];
      one.inputs = sliceTokens(c.spec, c.inputs, b, 0, one.tokens);
      one.expected.reset();
      auto single = decodeCaseFrom(one, {fresh[size_t(b)], 4, CacheLayout::raw, {cached[size_t(b)]}, rng()});
      ASSERT_TRUE(single) << single.error().message;
      auto run = runOnHost(*single, schedule);
      ASSERT_TRUE(run) << run.error().message;
      alone += run->stats.keyBlocks;
      rows.insert(rows.end(), run->out.begin(), run->out.end());
    }
    EXPECT_GT(alone, 0);
    EXPECT_EQ(all->stats.keyBlocks, alone) << schedule.ShortDebugString();
    EXPECT_LT(relativeError(all->out, rows), 1e-6) << schedule.ShortDebugString();
    std::printf("[ ragged   ] %s: %lld key blocks multiplied, as the sequences alone\n",
                schedule.ShortDebugString().c_str(), (long long)all->stats.keyBlocks);
  }
}

// What a ragged step's query_start_loc may not be, each named; a sequence
// bringing no token writes nothing, so it may end on a page it shares.
TEST(Decode, BadQueryStartLocsAreNamed) {
  // Pages of 4; two sequences, at most 5 new tokens each, 6 packed.
  const DecodeShape shape{2, 5, 8, 4, 3, 6};
  const std::vector<int32_t> table = {0, 1, 2, 3, 4, 5}, lengths = {3, 6};
  EXPECT_TRUE(validateDecode(shape, table, lengths, std::vector<int32_t>{0, 1, 6}));
  auto expectError = [&](DecodeShape s, std::vector<int32_t> t, std::vector<int32_t> l, std::vector<int32_t> q,
                         const std::string& words) {
    Status status = validateDecode(s, t, l, q);
    ASSERT_FALSE(status) << words;
    EXPECT_NE(status.error().message.find(words), std::string::npos) << status.error().message;
  };
  expectError(shape, table, lengths, {0, 1}, "query_start_loc has 2 entries; 2 sequences need 3");
  expectError(shape, table, lengths, {1, 2, 6}, "query_start_loc[0] is 1: the packed rows start at 0");
  expectError(shape, table, lengths, {0, 4, 3}, "query_start_loc[2] is 3, below query_start_loc[1] 4: the offsets "
                                                "must not decrease");
  expectError(shape, table, lengths, {0, 6, 6}, "query_start_loc[1] is 6, so sequence 0 brings 6 new tokens, more "
                                                "than the step's most, 5 (max_query_len)");
  expectError(shape, table, lengths, {0, 1, 5}, "query_start_loc[2] is 5, but q packs 6 tokens");
  // Sequence 1's 5 new tokens from 6 reach its third page, which sequence
  // 0 appends into (its position 3).
  expectError(shape, {0, 1, 2, 3, 4, 0}, lengths, {0, 1, 6},
              "page_table[1][2] is page 0, which page_table[0][0] uses too; the step writes sequence");
  expectError({2, 7, 8, 4, 3, 9}, table, lengths, {0, 2, 9}, "sequence 1: cache_len 6 + 7 new tokens do not fit");
  // Sequence 0 brings nothing: its pages are only read, its partly filled
  // second page (positions 4-7, cache_len 6) shared with sequence 1, which
  // caches 8 and appends into its own third.
  EXPECT_TRUE(validateDecode({2, 5, 8, 4, 3, 3}, std::vector<int32_t>{0, 7, 2, 0, 7, 5}, std::vector<int32_t>{6, 8},
                             std::vector<int32_t>{0, 0, 3}));
  // Bringing one token, it would write there.
  expectError({2, 5, 8, 4, 3, 4}, {0, 7, 2, 0, 7, 5}, {6, 8}, {0, 1, 4},
              "page_table[1][1] is page 7, which page_table[0][1] uses too; the step writes sequence 0's");
}

// What a step's page table and lengths may not be, each named.
TEST(Decode, BadPageTablesAndLengthsAreNamed) {
  const DecodeShape shape{2, 1, 6, 4, 3};
  const std::vector<int32_t> table = {4, 0, -1, 2, 5, 1}, lengths = {5, 8};
  ASSERT_TRUE(validateDecode(shape, table, lengths));
  auto expectError = [&](DecodeShape s, std::vector<int32_t> t, std::vector<int32_t> l, const std::string& words) {
    Status status = validateDecode(s, t, l);
    ASSERT_FALSE(status) << words;
    EXPECT_NE(status.error().message.find(words), std::string::npos) << status.error().message;
  };
  expectError(shape, {4, 0, -1, 2, 6, 1}, lengths, "page_table[1][1] is 6, outside the cache's 6 pages");
  expectError(shape, {4, -1, -1, 2, 5, 1}, lengths, "page_table[0][1] is -1");
  expectError(shape, {4, 0, -1, 2, 0, 1}, lengths,
              "page_table[1][1] is page 0, which page_table[0][1] uses too; the step writes sequence 0's");
  expectError(shape, table, {5, 12}, "sequence 1: cache_len 12 + 1 new tokens do not fit");
  expectError(shape, table, {-1, 8}, "cache_len[0] is -1, negative");
  expectError({2, 0, 6, 4, 3}, table, lengths, "new tokens must be at least 1");
  expectError({2, 1, 6, 0, 3}, table, lengths, "page_size must be at least 1");
  expectError(shape, {4, 0, -1, 2, 5}, lengths, "page_table has 5 entries");
  expectError(shape, table, {5}, "cache_len has 1 entries");
  // Entries past a sequence's last page are never read: anything goes there.
  EXPECT_TRUE(validateDecode(shape, std::vector<int32_t>{4, 0, 99, 2, 5, 1}, lengths));
}

TEST(Decode, TheRawCacheIsPTimesSmaller) {
  const KernelSpec spec = testing::makeSpec({.heads = 8, .kvHeads = 2, .pseudoHeads = 4, .headDim = 64});
  EXPECT_EQ(cacheBytesPerToken(spec, CacheLayout::raw), 2 * 2 * 64 * 2);  // k and v, G d, bfloat16
  EXPECT_EQ(cacheBytesPerToken(spec, CacheLayout::mixed), 4 * cacheBytesPerToken(spec, CacheLayout::raw));
  EXPECT_EQ(reference::cacheTokenElements(spec, true), 2 * 4 * 64);
}

// runDecodeOnHost on host tensors: the step written in place, only the new
// tokens' cache slots touched, and what does not fit named before anything runs.
TEST(DecodeHostApi, StepsInPlaceAndChecksItsTensors) {
  std::mt19937_64 rng(testing::testSeed() ^ 0xa91);
  KernelSpec spec = testing::makeSpec({.heads = 4, .kvHeads = 2, .pseudoHeads = 3, .headDim = 16,
                                       .dtype = v1::bfloat16, .mask = v1::token_causal, .ropeTheta = 10000});
  spec.set_qk_norm(v1::KernelSpec::rms);
  const IhaCase c = testing::drawCheckableShape(rng, false, [&] { return testing::DrawnShape{spec, 2, 15}; });
  const cpu::CpuOptions options{LOOM_TEST_CACHE, 2};
  for (CacheLayout layout : {CacheLayout::raw, CacheLayout::mixed}) {
    SCOPED_TRACE(cacheLayoutName(layout));
    auto dc = decodeCaseFrom(c, {2, 4, layout, {9, 13}, rng()});
    ASSERT_TRUE(dc) << dc.error().message;
    testing::HostTensors t(stepCase(*dc));
    const PagedCacheTensors cache = t.cache(*dc);
    Status ran = runDecodeOnHost(spec, t.inputs(), cache, {}, options);
    ASSERT_TRUE(ran) << ran.error().message;
    EXPECT_LE(relativeError(hostValues(t.inputs().out), dc->expected), toleranceFor(spec.dtype()));
    reference::DecodeOutputs asLse{{}, hostValues(*t.inputs().lse)};
    EXPECT_LE(lseError(c, *dc, asLse), toleranceFor(spec.dtype()));
    reference::PagedCache after = dc->cache;
    after.k = hostValues(cache.k_cache);
    after.v = hostValues(cache.v_cache);
    expectAppend(c, *dc, after);

    auto expectRefused = [&](const PagedCacheTensors& bad, const std::string& words) {
      Status status = runDecodeOnHost(spec, t.inputs(), bad, {}, options);
      ASSERT_FALSE(status) << words;
      EXPECT_NE(status.error().message.find(words), std::string::npos) << status.error().message;
    };
    PagedCacheTensors otherLayout = cache;
    otherLayout.layout = layout == CacheLayout::raw ? CacheLayout::mixed : CacheLayout::raw;
    expectRefused(otherLayout, "k_cache: want [num_pages, page_size, G");
    PagedCacheTensors otherType = cache;
    otherType.v_cache.element = ElementKind::float16;
    expectRefused(otherType, "v_cache: element type");
    std::vector<int32_t> table = dc->cache.pageTable;
    table[0] = 999;
    PagedCacheTensors outside = cache;
    outside.page_table = table.data();
    expectRefused(outside, "page_table[0][0] is 999, outside the cache's");
    std::vector<int32_t> lengths = {9, int32_t(dc->shape.maxPages * dc->shape.pageSize)};
    PagedCacheTensors full = cache;
    full.cache_len = lengths.data();
    expectRefused(full, "sequence 1: cache_len");
    // Sequence 1's append page (its entry 3: positions 12-15, cache_len 13)
    // made sequence 0's first page: refused, neither cache touched.
    const std::vector<double> kBefore = hostValues(cache.k_cache), vBefore = hostValues(cache.v_cache);
    std::vector<int32_t> sharing = dc->cache.pageTable;
    sharing[size_t(dc->shape.maxPages + 3)] = sharing[0];
    PagedCacheTensors writesShared = cache;
    writesShared.page_table = sharing.data();
    expectRefused(writesShared, "page_table[1][3] is page " + std::to_string(sharing[0]) +
                                    ", which page_table[0][0] uses too; the step writes sequence 1's new tokens there");
    auto same = [](const std::vector<double>& a, const std::vector<double>& b) {
      return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                        [](double x, double y) { return std::isnan(x) ? std::isnan(y) : x == y; });
    };
    EXPECT_TRUE(same(hostValues(cache.k_cache), kBefore));
    EXPECT_TRUE(same(hostValues(cache.v_cache), vBefore));
  }
}

// The host API's ragged step: packed q, k, v and out, query_start_loc,
// batch and max_query_len in the cache's tensors; each sequence's rows and
// append as the oracle's. Bad offsets, a missing max_query_len, an lse and
// unpacked q are refused by name, neither cache touched.
TEST(DecodeHostApi, RaggedStepsInPlaceAndBadOffsetsAreRefused) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x4a66);
  KernelSpec spec = testing::makeSpec({.heads = 4, .kvHeads = 2, .pseudoHeads = 2, .headDim = 16,
                                       .dtype = v1::float16, .mask = v1::flat_causal, .ropeTheta = 10000});
  const IhaCase c = testing::drawCheckableShape(rng, false, [&] { return testing::DrawnShape{spec, 3, 14}; });
  const cpu::CpuOptions options{LOOM_TEST_CACHE, 2};
  for (CacheLayout layout : {CacheLayout::raw, CacheLayout::mixed}) {
    SCOPED_TRACE(cacheLayoutName(layout));
    // 9 new tokens over 5 cached (a prefill chunk over three pages of 4), 1 over 12, none over 7.
    DecodeLayout ragged{1, 4, layout, {5, 12, 7}, rng()};
    ragged.newTokensOf = {9, 1, 0};
    auto dc = decodeCaseFrom(c, ragged);
    ASSERT_TRUE(dc) << dc.error().message;
    testing::HostTensors t(stepCase(*dc));
    const PagedCacheTensors cache = t.cache(*dc);
    ASSERT_EQ(t.inputs().q.shape, (std::vector<int64_t>{10, 4, 16}));
    Status ran = runDecodeOnHost(spec, t.inputs(), cache, {}, options);
    ASSERT_TRUE(ran) << ran.error().message;
    EXPECT_LE(relativeError(hostValues(t.inputs().out), dc->expected), toleranceFor(spec.dtype()));
    reference::PagedCache after = dc->cache;
    after.k = hostValues(cache.k_cache);
    after.v = hostValues(cache.v_cache);
    expectAppend(c, *dc, after);

    const std::vector<double> kBefore = hostValues(cache.k_cache), vBefore = hostValues(cache.v_cache);
    auto expectRefused = [&](const IhaTensors& step, const PagedCacheTensors& bad, const std::string& words) {
      Status status = runDecodeOnHost(spec, step, bad, {}, options);
      ASSERT_FALSE(status) << words;
      EXPECT_NE(status.error().message.find(words), std::string::npos) << status.error().message;
    };
    std::vector<int32_t> falling = {0, 9, 8, 10};
    PagedCacheTensors notMonotonic = cache;
    notMonotonic.query_start_loc = falling.data();
    expectRefused(t.inputs(), notMonotonic, "query_start_loc[2] is 8, below query_start_loc[1] 9");
    std::vector<int32_t> short_ = {0, 9, 10, 9};
    PagedCacheTensors fewer = cache;
    fewer.query_start_loc = short_.data();
    expectRefused(t.inputs(), fewer, "query_start_loc[3] is 9, below query_start_loc[2] 10");
    PagedCacheTensors noMost = cache;
    noMost.max_query_len = 0;
    expectRefused(t.inputs(), noMost, "max_query_len: the most new tokens one sequence brings");
    PagedCacheTensors tooFew = cache;
    tooFew.max_query_len = 8;
    expectRefused(t.inputs(), tooFew, "sequence 0 brings 9 new tokens, more than the step's most, 8");
    // Sequence 1's 1 new token from 12 fills its page 3 (positions 12-15): full at 16.
    std::vector<int32_t> lengths = {5, int32_t(dc->shape.maxPages * dc->shape.pageSize), 7};
    PagedCacheTensors full = cache;
    full.cache_len = lengths.data();
    expectRefused(t.inputs(), full, "sequence 1: cache_len");
    IhaTensors withLse = t.inputs();
    std::vector<float> lse(size_t(3 * 4 * 9 * 2));
    withLse.lse = Tensor{lse.data(), ElementKind::float32, {3, 4, 18}, {}, kHostDevice};
    expectRefused(withLse, cache, "lse: a ragged step gives none");
    IhaTensors batched = t.inputs();
    batched.q.shape = {1, 10, 4, 16};
    expectRefused(batched, cache, "q: a ragged step packs its sequences' new tokens, [total, H, d]");
    auto same = [](const std::vector<double>& a, const std::vector<double>& b) {
      return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                        [](double x, double y) { return std::isnan(x) ? std::isnan(y) : x == y; });
    };
    EXPECT_TRUE(same(hostValues(cache.k_cache), kBefore));
    EXPECT_TRUE(same(hostValues(cache.v_cache), vBefore));
  }
}

TEST(DecodeCli, DecodesACaseAndSaysWhatDoesNotFit) {
  testing::TempDir dir;
  const std::string cs = testing::casesDir() + "/" + testing::sharedCaseNames().front();
  auto ok = testing::runLoom("run --case " + cs + " --decode 2 --page-size 5 --cache mixed --seed 7 --out " +
                             (dir / "out.npy"));
  EXPECT_EQ(ok.exitCode, 0) << ok.output;
  EXPECT_NE(ok.output.find("cache raw"), std::string::npos) << ok.output;
  EXPECT_NE(ok.output.find("cache mixed"), std::string::npos) << ok.output;
  EXPECT_NE(ok.output.find("against the forward's rows of the last 2 tokens"), std::string::npos) << ok.output;
  auto written = readNpy(dir / "out.npy");
  ASSERT_TRUE(written) << written.error().message;
  EXPECT_EQ(written->shape.at(1), 2);

  // Every sequence over one copy of a shared prompt's pages (the first case of at least two sequences).
  bool sharedRan = false;
  for (const std::string& name : testing::sharedCaseNames()) {
    auto shared = loadCase(testing::casesDir() + "/" + name);
    ASSERT_TRUE(shared) << shared.error().message;
    if (shared->batch < 2 || shared->spec.varlen() || shared->tokens < 5) continue;
    auto run = testing::runLoom("run --case " + testing::casesDir() + "/" + name +
                                " --decode 1 --page-size 2 --shared-pages 2 --backend cpu --cache-dir " +
                                std::string(LOOM_TEST_CACHE) + " --out " + (dir / "shared.npy"));
    EXPECT_EQ(run.exitCode, 0) << run.output;
    EXPECT_NE(run.output.find("shared prefix: sequence 0's first 4 tokens in every sequence, in 2 pages"),
              std::string::npos)
        << run.output;
    EXPECT_NE(run.output.find("append: 0 cache elements differ"), std::string::npos) << run.output;
    sharedRan = true;
    break;
  }
  EXPECT_TRUE(sharedRan) << "no shared case of two sequences and five tokens to share a prompt";

  // A ragged step: the first case of two sequences, one bringing three
  // tokens, the other none, on the host program and the emulated sm_90a step.
  bool raggedRan = false;
  for (const std::string& name : testing::sharedCaseNames()) {
    auto two = loadCase(testing::casesDir() + "/" + name);
    ASSERT_TRUE(two) << two.error().message;
    if (two->batch != 2 || two->spec.varlen() || two->tokens < 5) continue;
    for (const std::string backend : {"cpu", "emu --target sm_90a --dtype bfloat16"}) {
      auto run = testing::runLoom("run --case " + testing::casesDir() + "/" + name + " --ragged 3,0 --page-size 2 " +
                                  "--backend " + backend + " --cache-dir " + std::string(LOOM_TEST_CACHE) +
                                  " --out " + (dir / "ragged.npy"));
      EXPECT_EQ(run.exitCode, 0) << run.output;
      EXPECT_NE(run.output.find("ragged decode: cached + new tokens of each sequence " +
                                std::to_string(two->tokens - 3) + " + 3, " + std::to_string(two->tokens) +
                                " + 0 (3 packed, query_start_loc 0 3 3)"),
                std::string::npos)
          << run.output;
      EXPECT_NE(run.output.find("against the forward's rows of each sequence's new tokens"), std::string::npos)
          << run.output;
      EXPECT_NE(run.output.find("append: 0 cache elements differ"), std::string::npos) << run.output;
      auto packed = readNpy(dir / "ragged.npy");
      ASSERT_TRUE(packed) << packed.error().message;
      EXPECT_EQ(packed->shape, (std::vector<int64_t>{3, two->spec.heads(), two->spec.head_dim()}));
    }
    auto counts = testing::runLoom("run --case " + testing::casesDir() + "/" + name + " --ragged 3,0,1 --out " +
                                   (dir / "x.npy"));
    EXPECT_EQ(counts.exitCode, 2) << counts.output;
    EXPECT_NE(counts.output.find("--ragged: 3 counts for the case's 2 sequences"), std::string::npos) << counts.output;
    auto none = testing::runLoom("run --case " + testing::casesDir() + "/" + name + " --ragged 0,0 --out " +
                                 (dir / "x.npy"));
    EXPECT_EQ(none.exitCode, 2) << none.output;
    EXPECT_NE(none.output.find("a ragged step where no sequence brings a token"), std::string::npos) << none.output;
    raggedRan = true;
    break;
  }
  EXPECT_TRUE(raggedRan) << "no shared case of two sequences and five tokens for a ragged step";
  auto unshared = testing::runLoom("run --case " + cs + " --shared-pages 2 --out " + (dir / "x.npy"));
  EXPECT_EQ(unshared.exitCode, 2) << unshared.output;
  EXPECT_NE(unshared.output.find("--shared-pages 2: a decode step's"), std::string::npos) << unshared.output;
  auto tooMany = testing::runLoom("run --case " + cs + " --decode 100000 --out " + (dir / "x.npy"));
  EXPECT_EQ(tooMany.exitCode, 2) << tooMany.output;
  EXPECT_NE(tooMany.output.find("--decode 100000: the case has"), std::string::npos) << tooMany.output;
  auto cpu = testing::runLoom("run --case " + cs + " --decode 3 --page-size 4 --backend cpu --cache-dir " +
                              std::string(LOOM_TEST_CACHE) + " --out " + (dir / "cpu.npy"));
  EXPECT_EQ(cpu.exitCode, 0) << cpu.output;
  EXPECT_NE(cpu.output.find("cpu decode: schedule"), std::string::npos) << cpu.output;
  auto emu = testing::runLoom("run --case " + cs + " --decode 2 --backend emu --dtype float16 --cache-dir " +
                              std::string(LOOM_TEST_CACHE) + " --out " + (dir / "emu.npy"));
  EXPECT_EQ(emu.exitCode, 0) << emu.output;
  EXPECT_NE(emu.output.find("0 findings"), std::string::npos) << emu.output;
  EXPECT_NE(cpu.output.find("append: 0 cache elements differ"), std::string::npos) << cpu.output;
  EXPECT_NE(emu.output.find("append: 0 cache elements differ"), std::string::npos) << emu.output;
  auto mixed = testing::runLoom("run --case " + cs + " --decode 2 --page-size 3 --cache mixed --backend cpu --cache-dir " +
                                std::string(LOOM_TEST_CACHE) + " --out " + (dir / "mixed.npy"));
  EXPECT_EQ(mixed.exitCode, 0) << mixed.output;
  EXPECT_NE(mixed.output.find("append: mixed rows' relative error"), std::string::npos) << mixed.output;
  EXPECT_NE(mixed.output.find(", 0 elements finite where no token"), std::string::npos) << mixed.output;
  // The CUDA step: with no driver it says so and what to use instead; with
  // a GPU it must pass, out and append.
  auto cuda = testing::runLoom("run --case " + cs + " --decode 2 --page-size 5 --backend cuda --dtype float16 --out " +
                               (dir / "cuda.npy") + " --cache-dir " + LOOM_TEST_CACHE);
  if (cuda.output.find("no CUDA driver") != std::string::npos) {
    EXPECT_EQ(cuda.exitCode, 2) << cuda.output;
    EXPECT_NE(cuda.output.find("--backend cpu"), std::string::npos) << cuda.output;
  } else {
    EXPECT_EQ(cuda.exitCode, 0) << cuda.output;
    EXPECT_NE(cuda.output.find("cuda decode: "), std::string::npos) << cuda.output;
    EXPECT_NE(cuda.output.find("append: 0 cache elements differ"), std::string::npos) << cuda.output;
  }
}

}  // namespace
}  // namespace loom
