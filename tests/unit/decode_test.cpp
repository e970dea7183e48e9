// The decode step's oracle (reference::ihaDecode) against the forward's rows,
// the page-table checks, and `loom run --decode`.
#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "cpu/cpu_backend.h"
#include "api/compile.h"
#include "emu/emulator.h"
#include "jit/nvrtc_compiler.h"
#include "io/decode_case.h"
#include "loom/compiler.h"
#include "loom/decode.h"
#include "reference/iha_decode.h"
#include "host_tensors.h"
#include "loom/runtime.h"
#include "test_util.h"

namespace loom {
namespace {

// The forward's lse [1, H, n*P] over the sequence's first cache_len + T
// tokens, at the step's rows, against the step's [B, H, T*P].
double lseError(const IhaCase& c, const DecodeCase& dc, const reference::DecodeOutputs& got) {
  const int64_t H = c.spec.heads(), P = c.spec.pseudo_heads(), T = dc.step.tokens;
  std::vector<double> want, have;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t from = dc.cache.cacheLen[size_t(b)], to = from + T;
    const auto forward = reference::ihaForward(c.spec, sliceTokens(c.spec, c.inputs, b, 0, to));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < T * P; ++r) {
        want.push_back(forward.lse[size_t(h * to * P + from * P + r)]);
        have.push_back(got.lse[size_t((b * H + h) * T * P + r)]);
      }
  }
  return relativeError(have, want);
}

// Slots the step must have filled are finite; every other slot is still the
// NaN it was poisoned with (nothing written outside the sequences' tokens).
void expectOnlyTheSequencesSlotsFilled(const DecodeCase& dc, const reference::PagedCache& after) {
  const int64_t E = reference::cacheTokenElements(dc.spec, after.mixed);
  std::vector<bool> owned(size_t(after.numPages * after.pageSize), false);
  for (int64_t b = 0; b < dc.shape.batch; ++b)
    for (int64_t t = 0; t < after.cacheLen[size_t(b)] + dc.step.tokens; ++t)
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
  const int64_t E = reference::cacheTokenElements(dc.spec, false), T = dc.step.tokens;
  for (int64_t b = 0; b < dc.shape.batch; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = reference::cacheSlot(after, b, after.cacheLen[size_t(b)] + t);
      for (int64_t e = 0; e < E; ++e) {
        ASSERT_EQ(after.k[size_t(slot * E + e)], dc.step.k[size_t((b * T + t) * E + e)]) << "b " << b << " t " << t;
        ASSERT_EQ(after.v[size_t(slot * E + e)], dc.step.v[size_t((b * T + t) * E + e)]) << "b " << b << " t " << t;
      }
    }
}

// The generated decode step on the host tile API.
Result<cpu::CpuDecodeOutputs> runOnHost(const DecodeCase& dc, const Schedule& schedule = {}) {
  GenerateOptions options;
  options.direction = Direction::decode;
  options.mixedCache = dc.layout == CacheLayout::mixed;
  auto plan = generateKernel(dc.spec, schedule, *parseTarget("cpu"), options);
  if (!plan) return plan.error();
  return cpu::runDecodePlan(*plan, dc, {LOOM_TEST_CACHE, 2});
}

// The host kernel's step against the forward's rows (out and lse) within the
// dtype's tolerance, and its append: the raw cache holds exactly the new
// tokens' k and v, a mixed one the reference's mixed rows, and no slot
// outside the sequences' tokens was written.
void expectHostStep(const IhaCase& c, const DecodeCase& dc, const Schedule& schedule = {}) {
  auto got = runOnHost(dc, schedule);
  ASSERT_TRUE(got) << got.error().message;
  const double tolerance = toleranceFor(c.spec.dtype());
  EXPECT_LE(relativeError(got->out, dc.expected), tolerance) << "out";
  reference::DecodeOutputs asLse{{}, got->lse};
  EXPECT_LE(lseError(c, dc, asLse), tolerance) << "lse";
  expectOnlyTheSequencesSlotsFilled(dc, got->cache);
  if (dc.layout == CacheLayout::raw) {
    expectRawAppend(dc, got->cache);
  } else {
    reference::PagedCache want = dc.cache;
    reference::appendToCache(c.spec, dc.step, want);
    auto finite = [](std::vector<double> x) {
      for (double& e : x) e = std::isfinite(e) ? e : 0.0;
      return x;
    };
    EXPECT_LE(relativeError(finite(got->cache.k), finite(want.k)), tolerance) << "mixed keys appended";
    EXPECT_LE(relativeError(finite(got->cache.v), finite(want.v)), tolerance) << "mixed values appended";
  }
}

// The CUDA decode step of `arch` (a raw cache) on the emulator: no finding,
// out and lse within the dtype's tolerance of the forward's rows, the new
// tokens' k and v exactly at their slots, nothing else written.
void expectEmulatedStep(const IhaCase& c, const DecodeCase& dc, const std::string& arch, uint64_t seed) {
  GenerateOptions options;
  options.direction = Direction::decode;
  auto plan = generateKernel(dc.spec, {}, *parseTarget(arch), options);
  ASSERT_TRUE(plan) << plan.error().message;
  emu::EmuOptions emuOptions;
  emuOptions.cacheDir = LOOM_TEST_CACHE;
  emuOptions.threads = 2;
  emuOptions.seed = seed;
  auto run = emu::runDecodeOnEmulator(*plan, dc, emuOptions);
  ASSERT_TRUE(run) << run.error().message;
  EXPECT_EQ(run->findingCount, 0) << emu::summary(*run);
  EXPECT_FALSE(run->deadlocked);
  const double tolerance = toleranceFor(c.spec.dtype());
  EXPECT_LE(relativeError(run->out, dc.expected), tolerance) << "out";
  reference::DecodeOutputs asLse{{}, run->lse};
  EXPECT_LE(lseError(c, dc, asLse), tolerance) << "lse";
  ASSERT_TRUE(run->cache);
  expectOnlyTheSequencesSlotsFilled(dc, *run->cache);
  expectRawAppend(dc, *run->cache);
}

class SharedCaseDecode : public ::testing::TestWithParam<std::string> {};

// Every shared case: its last T tokens decoded over a cache of the others
// give expected.npy's rows there (computed outside loom), for T = 1 and 3,
// page sizes 1, 16 and 7 (which divides no case's length), both layouts.
TEST_P(SharedCaseDecode, GivesTheForwardsRows) {
  auto c = loadCase(testing::casesDir() + "/" + GetParam());
  ASSERT_TRUE(c) << c.error().message;
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
// sm_90a by turns.
TEST_P(SharedCaseDecode, EmulatedCudaStepWithoutFindings) {
  auto loaded = loadCase(testing::casesDir() + "/" + GetParam());
  ASSERT_TRUE(loaded) << loaded.error().message;
  const auto names = testing::sharedCaseNames();
  const size_t index = size_t(std::find(names.begin(), names.end(), GetParam()) - names.begin());
  const IhaCase c = loaded->spec.dtype() != v1::float32 ? *loaded
                                                        : withDtype(*loaded, index % 2 ? v1::float16 : v1::bfloat16);
  const std::string arch = index % 2 ? "sm_90a" : "sm_80";
  SCOPED_TRACE(arch + " " + dtypeName(c.spec.dtype()));
  const uint64_t seed = testing::testSeed();
  auto dc = decodeCaseFrom(c, {std::min<int64_t>(2, c.tokens), 3, CacheLayout::raw, {}, seed});
  ASSERT_TRUE(dc) << dc.error().message;
  expectEmulatedStep(c, *dc, arch, seed);
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

// The emulated CUDA step on drawn specs the dtype can check, ragged lengths
// and page sizes.
TEST(Decode, EmulatedCudaStepOnDrawnSpecs) {
  std::mt19937_64 rng(testing::testSeed() ^ 0xc0da);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int draw = 0; draw < 3; ++draw) {
    const IhaCase c = testing::drawCheckableShape(rng, /*backward=*/false, [&] {
      KernelSpec spec = testing::randomSpec(rng);
      spec.set_dtype(pick(0, 1) ? v1::float16 : v1::bfloat16);
      spec.set_head_dim(int32_t(16 * pick(1, 4)));
      return testing::DrawnShape{spec, pick(1, 3), pick(2, 24)};
    });
    const int64_t T = pick(1, std::min<int64_t>(4, c.tokens));
    DecodeLayout layout{T, pick(1, 9), CacheLayout::raw, {}, rng()};
    for (int64_t b = 0; b < c.batch; ++b) layout.cached.push_back(pick(0, c.tokens - T));
    const std::string arch = pick(0, 1) ? "sm_90a" : "sm_80";
    SCOPED_TRACE(testing::describe(c) + " T=" + std::to_string(T) + " page " + std::to_string(layout.pageSize) + " " +
                 arch);
    auto dc = decodeCaseFrom(c, layout);
    ASSERT_TRUE(dc) << dc.error().message;
    expectEmulatedStep(c, *dc, arch, rng());
  }
}

// NVRTC compiles the CUDA decode step's launches with zero spills and no stack frame.
TEST(Decode, NvrtcCompilesTheCudaStepWithoutSpills) {
  KernelSpec spec = testing::makeSpec({.heads = 8, .kvHeads = 2, .pseudoHeads = 4, .headDim = 128,
                                       .dtype = v1::bfloat16, .mask = v1::flat_causal, .ropeTheta = 10000});
  spec.set_qk_norm(v1::KernelSpec::rms);
  jit::NvrtcCompiler compiler("");
  for (const char* arch : {"sm_80", "sm_90a"}) {
    std::shared_ptr<const jit::Artifact> artifact;
    auto kernel = compileKernel(spec, Schedule(), *parseTarget(arch), compiler, &artifact, Direction::decode);
    ASSERT_TRUE(kernel) << kernel.error().message << "\n" << kernel.error().log;
    EXPECT_TRUE(artifact->usesAsyncCopies()) << "the cache's pages come in by cp.async";
    ASSERT_EQ(artifact->resources.size(), 2u) << artifact->log;  // iha_append, iha_attention
    for (const auto& usage : artifact->resources) {
      EXPECT_EQ(usage.spill_store_bytes() + usage.spill_load_bytes(), 0) << arch << " " << usage.ShortDebugString();
      EXPECT_EQ(usage.stack_frame_bytes(), 0) << arch << " " << usage.ShortDebugString();
    }
  }
}

// What a decode plan cannot be (yet), each said.
TEST(Decode, PlansSayWhatTheyCannotBe) {
  const KernelSpec spec = testing::makeSpec({.heads = 4, .pseudoHeads = 2, .headDim = 64});
  GenerateOptions decode;
  decode.direction = Direction::decode;
  Schedule materialized;
  materialized.set_mix(v1::mix_materialized);
  auto refused = generateKernel(spec, materialized, *parseTarget("cpu"), decode);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("schedule.mix materialized does not apply to a decode step"),
            std::string::npos);
  GenerateOptions mixedDecode = decode;
  mixedDecode.mixedCache = true;
  auto cuda = generateKernel(spec, {}, *parseTarget("sm_80"), mixedDecode);
  ASSERT_FALSE(cuda);
  EXPECT_NE(cuda.error().message.find("has no decode kernel over a mixed cache yet"), std::string::npos)
      << cuda.error().message;
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
  auto refusedWide = generateKernel(wide, pinned, *parseTarget("sm_90a"), decode);
  ASSERT_FALSE(refusedWide);
  EXPECT_NE(refusedWide.error().message.find("bytes of shared memory per block"), std::string::npos)
      << refusedWide.error().message;
  GenerateOptions mixedForward;
  mixedForward.mixedCache = true;
  EXPECT_FALSE(generateKernel(spec, {}, *parseTarget("cpu"), mixedForward));
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
  expectError(shape, {4, 0, -1, 2, 0, 1}, lengths, "page_table[1][1] is page 0, which page_table[0][1] uses too");
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
    expectOnlyTheSequencesSlotsFilled(*dc, after);
    if (layout == CacheLayout::raw) expectRawAppend(*dc, after);

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
  auto cuda = testing::runLoom("run --case " + cs + " --decode 1 --backend cuda --out " + (dir / "x.npy"));
  EXPECT_EQ(cuda.exitCode, 2) << cuda.output;
  EXPECT_NE(cuda.output.find("has no decode launch yet"), std::string::npos) << cuda.output;
}

}  // namespace
}  // namespace loom
