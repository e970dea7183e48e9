// The generated backward's CUDA program (mma.sync, loom/tile/cuda_backward.h)
// on the emulator, for sm_80 and for sm_90a (which runs the portable tiles
// for the backward), in float16 and bfloat16: every shared backward case and
// freshly drawn specs, against the float64 backward reference on the same
// rounded inputs and dout, with zero findings (races, bounds, uninitialised
// or misaligned accesses, barrier misuse).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include <cstring>

#include "cpu/cpu_backend.h"
#include "emu/emulator.h"
#include "io/case.h"
#include "io/npy.h"
#include "loom/runtime.h"
#include "loom/compiler.h"
#include "reference/iha_backward.h"
#include "host_tensors.h"
#include "mutate.h"
#include "test_util.h"

namespace loom::emu {
namespace {

EmuOptions options(uint64_t seed) {
  EmuOptions o;
  o.cacheDir = LOOM_TEST_CACHE;
  o.threads = 2;
  o.seed = seed;
  return o;
}

Result<KernelPlan> backwardPlan(const KernelSpec& spec, const Schedule& schedule, const std::string& arch) {
  GenerateOptions generate;
  generate.direction = Direction::backward;
  return generateKernel(spec, schedule, *parseTarget(arch), generate);
}

// The defaults, and smaller blocks on fewer warps (more CTAs, several query
// and key blocks per sequence, every loop kind); dq in its own launch or by
// atomic adds, across both archs and dtypes.
Schedule scheduleFor(const KernelSpec& spec, int pick) {
  const int P = spec.pseudo_heads();
  Schedule s;
  if (pick % 4 == 1 || pick % 4 == 2) s.set_dq(v1::dq_atomic);
  if (pick % 3 == 1) {
    s.set_warps(1);
    s.set_block_m(std::lcm(P, 16));
    s.set_block_n(16);
  } else if (pick % 3 == 2) {
    s.set_warps(2);
    s.set_block_m(std::lcm(P, 32));
    s.set_block_n(32);
  }
  return s;
}

// The run is clean and every gradient within the dtype's tolerance of `want`;
// `wgmma` receives the wgmma instructions it ran.
void expectClean(const IhaCase& c, const reference::IhaGradients& want, const Schedule& schedule,
                 const std::string& arch, const std::string& what, uint64_t seed, int64_t* wgmma = nullptr) {
  auto plan = backwardPlan(c.spec, schedule, arch);
  ASSERT_TRUE(plan) << what << ": " << plan.error().message;
  auto run = runOnEmulator(*plan, c, options(seed));
  ASSERT_TRUE(run) << what << ": " << run.error().message << "\n" << run.error().log;
  std::printf("[ emu bwd  ] %s %s %s: %.2f s, %lld CTAs\n", what.c_str(), arch.c_str(),
              plan->schedule.ShortDebugString().c_str(), run->runSeconds, (long long)run->coverage.ctas);
  if (wgmma) *wgmma = int64_t(run->coverage.wgmma);
  EXPECT_EQ(run->findingCount, 0) << what << " " << arch << "\n" << summary(*run);
  EXPECT_FALSE(run->deadlocked);
  ASSERT_TRUE(run->gradients);
  const std::vector<double> errors = gradientErrors(c.spec, c.tokens, *run->gradients, want);
  std::string figures;
  for (size_t i = 0; i < errors.size(); ++i) {
    char text[48];
    std::snprintf(text, sizeof text, " %s %.1e", reference::kGradientNames[i], errors[i]);
    figures += text;
    EXPECT_LE(errors[i], gradientToleranceFor(c.spec.dtype()))
        << what << " " << arch << " " << reference::kGradientNames[i] << " " << plan->schedule.ShortDebugString();
  }
  std::printf("[ emu bwd  ]  %s\n", figures.c_str());
}

const char* const kArchs[] = {"sm_80", "sm_90a"};

std::vector<std::string> backwardCases() {
  std::vector<std::string> names;
  for (const std::string& name : testing::sharedCaseNames())
    if (name.rfind("bwd-", 0) == 0) names.push_back(name);
  return names;
}

// Each shared backward case in both 16-bit dtypes (inputs and dout rounded,
// the expected gradients recomputed on them) on both archs.
class SharedBackwardOnEmulator : public ::testing::TestWithParam<std::string> {};

TEST_P(SharedBackwardOnEmulator, BothArchsBothDtypesWithoutFindings) {
  auto loaded = loadCase(testing::casesDir() + "/" + GetParam());
  ASSERT_TRUE(loaded) << loaded.error().message;
  ASSERT_TRUE(loaded->dout);
  int pick = 0;
  for (v1::DType dtype : {v1::float16, v1::bfloat16})
    for (const char* arch : kArchs) {
      const IhaCase c = withDtype(*loaded, dtype);
      expectClean(c, *c.expectedGradients, scheduleFor(c.spec, pick), arch,
                  GetParam() + " " + dtypeName(dtype), testing::testSeed() + uint64_t(pick));
      ++pick;
    }
}

INSTANTIATE_TEST_SUITE_P(Vectors, SharedBackwardOnEmulator, ::testing::ValuesIn(backwardCases()),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// Fresh specs every run (every mask, windows, both collapses, RoPE, GQA and
// the options of public IHA code), small enough to emulate, drawn where the
// roundings every 16-bit kernel makes leave the gradients checkable
// (drawCheckableBackwardCase).
class DrawnBackwardOnEmulator : public ::testing::TestWithParam<int> {};

TEST_P(DrawnBackwardOnEmulator, MatchesTheReferenceWithoutFindings) {
  std::mt19937_64 rng(testing::testSeed() + uint64_t(GetParam()) * 7877);
  const IhaCase c = testing::drawCheckableShape(rng, true, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    // Up to 48 (6 chunks a row: the tile copies' cursor leaves threads out).
    spec.set_head_dim(8 * std::uniform_int_distribution<int>(1, 6)(rng));
    spec.set_dtype(GetParam() % 2 ? v1::bfloat16 : v1::float16);
    return testing::DrawnShape{spec, 1 + int64_t(rng() % 2), 1 + int64_t(rng() % 24)};
  });
  expectClean(c, *c.expectedGradients, scheduleFor(c.spec, GetParam()), kArchs[GetParam() % 2], testing::describe(c),
              rng());
}

INSTANTIATE_TEST_SUITE_P(Random, DrawnBackwardOnEmulator, ::testing::Range(0, 6));

// Past head_dim 128 the key-block-outer and dq launches split the gradient
// columns into parts, a CTA each (layout.h, backwardColumnParts; the CUDA
// tiles' dK, dV and dq keep their part's n-tiles, S^T and dP^T take every
// column): fresh specs at head_dim 256, 224 and, padded to 192 and 160
// with zeros, 184 and 152, both archs and dtypes, the defaults (dq in its own launch) and one warp on 16-row blocks
// with dq by atomic adds (each part adds its own columns).
class WideBackwardOnEmulator : public ::testing::TestWithParam<int> {};

TEST_P(WideBackwardOnEmulator, EveryPartMatchesTheReferenceWithoutFindings) {
  std::mt19937_64 rng(testing::testSeed() + uint64_t(GetParam()) * 3571);
  const int dims[] = {256, 184, 152, 224};
  const IhaCase c = testing::drawCheckableShape(rng, true, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_head_dim(dims[GetParam()]);
    spec.set_dtype(GetParam() % 2 ? v1::bfloat16 : v1::float16);
    return testing::DrawnShape{spec, 1, 1 + int64_t(rng() % 20)};
  });
  Schedule s;
  if (GetParam() >= 2) {
    s.set_dq(v1::dq_atomic);
    s.set_warps(1);
    s.set_block_m(std::lcm(int(c.spec.pseudo_heads()), 16));
    s.set_block_n(16);
  }
  expectClean(c, *c.expectedGradients, s, kArchs[GetParam() % 2], testing::describe(c), rng());
}

INSTANTIATE_TEST_SUITE_P(Drawn, WideBackwardOnEmulator, ::testing::Range(0, 4));

// The key-block-outer launch on wgmma (sm_90a, schedule.engine wgmma:
// loom/tile/cuda_backward.h, bwgmma): fresh specs at head_dim 64, 128, 192
// and 256 (its swizzled tiles' widths; past 128 the key-block-outer
// launch's CTAs take one of two (256) or three (192) parts of dK's and
// dV's columns, and the dq launch takes dq whole, reading Q and dO by
// descriptor) and 80, 96, 112 (tiles of two atoms, the columns past
// head_dim zeros by TMA), every mask, GQA, RoPE and qk_norm among them,
// sequences of one to three 64-row query and key blocks, in both dtypes,
// against the float64 reference with zero findings; its defaults and a CTA
// of two warpgroups with 128-row query blocks (d 64 and 96).
class WgmmaBackwardOnEmulator : public ::testing::TestWithParam<int> {};

TEST_P(WgmmaBackwardOnEmulator, MatchesTheReferenceWithoutFindings) {
  std::mt19937_64 rng(testing::testSeed() + uint64_t(GetParam()) * 6151);
  const IhaCase c = testing::drawCheckableShape(rng, true, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    constexpr int dims[] = {64, 64, 64, 128, 256, 256, 192, 192, 96, 80, 112, 96};
    spec.set_head_dim(dims[GetParam()]);
    spec.set_dtype(GetParam() % 2 ? v1::bfloat16 : v1::float16);
    return testing::DrawnShape{spec, 1, 8 + int64_t(rng() % 40)};
  });
  Schedule s;
  s.set_engine(v1::engine_wgmma);
  if (GetParam() == 2 || GetParam() == 11) {
    s.set_warps(8);
    s.set_block_n(128);
    s.set_block_m(128);
  }
  int64_t wgmma = 0;
  expectClean(c, *c.expectedGradients, s, "sm_90a", testing::describe(c), rng(), &wgmma);
  EXPECT_GT(wgmma, 0) << "the key-block-outer launch ran no wgmma";
}

INSTANTIATE_TEST_SUITE_P(Drawn, WgmmaBackwardOnEmulator, ::testing::Range(0, 12));

// The host API's backward on host tensors (q strided, a padded buffer of
// H + 3 heads per token), through the host tile API and through the CUDA
// program on the emulator: every gradient written in place within the
// tolerance, lse too; tensors that do not fit are refused by name.
TEST(HostApiBackward, StridedHostTensorsOnTheHostAndTheEmulator) {
  std::mt19937_64 rng(testing::testSeed() + 505);
  const IhaCase c = testing::drawCheckableShape(rng, true, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_head_dim(16);
    spec.set_dtype(v1::float16);
    return testing::DrawnShape{spec, 1 + int64_t(rng() % 2), 5 + int64_t(rng() % 20)};
  });
  const KernelSpec& spec = c.spec;
  const int64_t B = c.batch, N = c.tokens, H = spec.heads(), G = spec.kv_heads(), d = spec.head_dim(),
                P = spec.pseudo_heads();
  auto bytesOf = [&](const std::vector<double>& values, NpyType type) {
    return npyFromDouble(values, {int64_t(values.size())}, type).bytes;
  };
  const int64_t qTokenStride = (H + 3) * d;
  std::vector<uint8_t> q(size_t(B * N * qTokenStride * 2), 0x7f);
  const std::vector<uint8_t> qDense = bytesOf(c.inputs.q, NpyType::float16);
  for (int64_t n = 0; n < B * N; ++n)
    std::memcpy(&q[size_t(n * qTokenStride * 2)], &qDense[size_t(n * H * d * 2)], size_t(H * d * 2));
  std::vector<uint8_t> k = bytesOf(c.inputs.k, NpyType::float16), v = bytesOf(c.inputs.v, NpyType::float16),
                       dout = bytesOf(*c.dout, NpyType::float16);
  std::vector<uint8_t> aq = bytesOf(c.inputs.alpha_q, NpyType::float32), ak = bytesOf(c.inputs.alpha_k, NpyType::float32),
                       av = bytesOf(c.inputs.alpha_v, NpyType::float32),
                       collapse = bytesOf(c.inputs.collapse, NpyType::float32);
  std::vector<uint8_t> lse(size_t(B * H * N * P * 4), 0xff);
  auto tensor = [](std::vector<uint8_t>& bytes, ElementKind element, std::vector<int64_t> shape,
                   std::vector<int64_t> strides = {}) {
    return Tensor{bytes.data(), element, std::move(shape), std::move(strides), kHostDevice};
  };
  IhaTensors t;
  t.q = tensor(q, ElementKind::float16, {B, N, H, d}, {N * qTokenStride, qTokenStride, d, 1});
  t.k = tensor(k, ElementKind::float16, {B, N, G, d});
  t.v = tensor(v, ElementKind::float16, {B, N, G, d});
  t.alpha_q = tensor(aq, ElementKind::float32, {H, H, P});
  t.alpha_k = tensor(ak, ElementKind::float32, {G, G, P});
  t.alpha_v = tensor(av, ElementKind::float32, {G, G, P});
  const std::vector<int64_t> collapseShape = spec.collapse() == v1::global ? std::vector<int64_t>{H, H * P}
                                                                           : std::vector<int64_t>{H, P};
  t.collapse = tensor(collapse, ElementKind::float32, collapseShape);
  t.lse = tensor(lse, ElementKind::float32, {B, H, N * P});
  const reference::IhaGradients& want = *c.expectedGradients;
  std::vector<std::vector<uint8_t>> buffers;
  for (const auto* g : reference::gradientsOf(want)) buffers.emplace_back(g->size() * 4, 0xff);
  IhaGradTensors g;
  g.dout = tensor(dout, ElementKind::float16, {B, N, H, d});
  g.dq = tensor(buffers[0], ElementKind::float32, {B, N, H, d});
  g.dk = tensor(buffers[1], ElementKind::float32, {B, N, G, d});
  g.dv = tensor(buffers[2], ElementKind::float32, {B, N, G, d});
  g.dalpha_q = tensor(buffers[3], ElementKind::float32, {H, H, P});
  g.dalpha_k = tensor(buffers[4], ElementKind::float32, {G, G, P});
  g.dalpha_v = tensor(buffers[5], ElementKind::float32, {G, G, P});
  g.dcollapse = tensor(buffers[6], ElementKind::float32, collapseShape);
  auto gathered = [&] {
    return reference::IhaGradients{hostValues(g.dq),       hostValues(g.dk),       hostValues(g.dv),
                                   hostValues(g.dalpha_q), hostValues(g.dalpha_k), hostValues(g.dalpha_v),
                                   hostValues(g.dcollapse)};
  };
  const std::string what = spec.ShortDebugString() + " B=" + std::to_string(B) + " N=" + std::to_string(N);
  const auto lseWant = reference::ihaForward(spec, c.inputs).lse;

  ASSERT_TRUE(runBackwardOnHost(spec, t, g, Schedule(), cpu::CpuOptions{LOOM_TEST_CACHE, 2})) << what;
  for (double e : gradientErrors(spec, N, gathered(), want)) EXPECT_LE(e, gradientToleranceFor(v1::float32)) << what;
  EXPECT_LE(relativeError(hostValues(*t.lse), lseWant), toleranceFor(v1::float32)) << what;

  for (auto& buffer : buffers) std::fill(buffer.begin(), buffer.end(), 0xff);
  auto run = runBackwardOnEmulator(spec, t, g, Schedule(), "sm_80", options(rng()));
  ASSERT_TRUE(run) << run.error().message;
  EXPECT_EQ(run->findingCount, 0) << summary(*run);
  for (double e : gradientErrors(spec, N, gathered(), want)) EXPECT_LE(e, gradientToleranceFor(v1::float16)) << what;
  EXPECT_LE(relativeError(hostValues(*t.lse), lseWant), toleranceFor(v1::float16)) << what;

  IhaGradTensors wrong = g;
  wrong.dk.shape = {B, N, H + 1, d};
  Status refused = runBackwardOnHost(spec, t, wrong, Schedule(), cpu::CpuOptions{LOOM_TEST_CACHE, 2});
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().message.rfind("dk: shape", 0), 0u) << refused.error().message;
  wrong = g;
  wrong.dout.element = ElementKind::bfloat16;
  refused = runBackwardOnHost(spec, t, wrong, Schedule(), cpu::CpuOptions{LOOM_TEST_CACHE, 2});
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().message.rfind("dout: element type bfloat16, want float16", 0), 0u)
      << refused.error().message;
}

// What the CUDA backward refuses, naming the field.
TEST(BackwardOnEmulator, RefusesWhatItHasNoTilesFor) {
  KernelSpec spec = testing::makeSpec({.heads = 2, .pseudoHeads = 2, .headDim = 16});
  Schedule narrow;
  narrow.set_warps(4);
  narrow.set_block_m(64);
  narrow.set_block_n(32);
  auto refused = backwardPlan(spec, narrow, "sm_80");
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("schedule.block_n (32) must be a multiple of 16 rows per warp x 4"),
            std::string::npos)
      << refused.error().message;
}

// Where the wgmma backward is sm_90a's default and where it is refused:
// head_dim 64, 96, 128, 192 and 256 take it (its two attention launches
// take tensor maps, its pre-mix and forward stay on mma.sync), head_dim 32
// and 160, dq atomic and given mma tiles keep mma.sync; asked for
// elsewhere, the error says why.
TEST(BackwardPlan, WgmmaIsTheSm90aDefaultWhereItApplies) {
  auto spec = [](int d) { return testing::makeSpec({.heads = 4, .kvHeads = 2, .pseudoHeads = 2, .headDim = d}); };
  for (int d : {64, 96, 128, 192, 256}) {
    auto plan = backwardPlan(spec(d), Schedule(), "sm_90a");
    ASSERT_TRUE(plan) << plan.error().message;
    EXPECT_EQ(plan->schedule.engine(), v1::engine_wgmma) << d;
    EXPECT_NE(plan->source.find("wgmma_backward = true"), std::string::npos);
    // The key-block-outer launch's parts (whole 64-column atoms: three at
    // 192), the dq launch's one: grid y over kv heads 2 and heads 4.
    const int parts = d == 192 ? 3 : d == 256 ? 2 : 1;
    for (const LaunchPlan& launch : plan->launches) {
      EXPECT_EQ(launch.tensorMaps, launch.name == kBackwardKvEntry || launch.name == kBackwardQEntry) << launch.name;
      if (launch.name == kBackwardKvEntry) EXPECT_EQ(launch.gridY, 2 * parts) << d;
      if (launch.name == kBackwardQEntry) EXPECT_EQ(launch.gridY, 4) << d;
    }
    auto sm80 = backwardPlan(spec(d), Schedule(), "sm_80");
    ASSERT_TRUE(sm80) << sm80.error().message;
    EXPECT_EQ(sm80->schedule.engine(), v1::engine_mma) << d;
  }
  Schedule atomic;
  atomic.set_dq(v1::dq_atomic);
  Schedule tiles;
  tiles.set_warps(2);
  tiles.set_block_m(32);
  tiles.set_block_n(32);
  for (const auto& [d, schedule] :
       {std::pair{32, Schedule()}, std::pair{160, Schedule()}, std::pair{128, atomic}, std::pair{128, tiles}}) {
    auto plan = backwardPlan(spec(d), schedule, "sm_90a");
    ASSERT_TRUE(plan) << plan.error().message;
    EXPECT_EQ(plan->schedule.engine(), v1::engine_mma) << d << " " << schedule.ShortDebugString();
  }
  Schedule wgmma;
  wgmma.set_engine(v1::engine_wgmma);
  const std::pair<std::string, std::string> refusals[] = {
      {"sm_80", "needs target sm_90a"}, {"sm_90a", "head_dim 64, 80, 96, 112, 128, 192 or 256"}};
  for (const auto& [arch, why] : refusals)
    for (int d : {32, 160}) {
      auto refused = backwardPlan(spec(arch == "sm_80" ? 64 : d), wgmma, arch);
      ASSERT_FALSE(refused) << arch << " " << d;
      EXPECT_NE(refused.error().message.find(why), std::string::npos) << refused.error().message;
    }
  wgmma.set_dq(v1::dq_atomic);
  auto refused = backwardPlan(spec(64), wgmma, "sm_90a");
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("dq in its own launch"), std::string::npos) << refused.error().message;
}

// A grouped-query spec whose last query block is cut short (L = 74 rows of
// 64-row blocks), several key blocks adding to each dq row.
IhaCase atomicCase(v1::DType dtype, uint64_t seed, int64_t tokens = 37) {
  KernelSpec spec = testing::makeSpec({.heads = 2, .kvHeads = 1, .pseudoHeads = 2, .headDim = 16, .dtype = dtype,
                                       .mask = v1::flat_causal, .collapse = v1::per_head, .ropeTheta = 10000});
  return drawCheckableBackwardCase(spec, 1, tokens, seed);
}

Schedule atomicSchedule() {
  Schedule s;
  s.set_warps(2);
  s.set_block_m(64);
  s.set_block_n(32);
  s.set_dq(v1::dq_atomic);
  return s;
}

// The wgmma backward's fault case: four 64-row query blocks (100 tokens,
// P 2) of two query heads a kv head's key blocks, at head_dim 64 (its
// narrowest tiles), a window ending each head's query loop before L (its
// last block fetched past the loop's last).
IhaCase wgmmaCase(v1::DType dtype, uint64_t seed) {
  KernelSpec spec = testing::makeSpec({.heads = 2, .kvHeads = 1, .pseudoHeads = 2, .headDim = 64, .dtype = dtype,
                                       .mask = v1::flat_causal, .window = 40, .collapse = v1::per_head,
                                       .ropeTheta = 10000});
  return drawCheckableBackwardCase(spec, 1, 100, seed);
}

Schedule wgmmaSchedule() {
  Schedule s;
  s.set_engine(v1::engine_wgmma);
  return s;
}

// dq by red.global.add.f32 in the key-block-outer launch: one launch fewer
// than dq in its own, no findings (the adds of concurrent CTAs are atomic,
// bounds checked), and dq within the tolerance of the reference and of the
// separate launch's.
TEST(BackwardOnEmulator, DqByAtomicAddsMatchesItsOwnLaunch) {
  const IhaCase c = atomicCase(v1::float16, testing::testSeed() + 71);
  Schedule separate = atomicSchedule();
  separate.set_dq(v1::dq_separate);
  auto own = backwardPlan(c.spec, separate, "sm_80");
  auto atomic = backwardPlan(c.spec, atomicSchedule(), "sm_80");
  ASSERT_TRUE(own) << own.error().message;
  ASSERT_TRUE(atomic) << atomic.error().message;
  EXPECT_EQ(atomic->launches.size() + 1, own->launches.size());
  EXPECT_NE(atomic->source.find("bwd_dq_atomic"), std::string::npos);
  EXPECT_EQ(atomic->source.find("dq_accumulate"), std::string::npos);
  auto a = runOnEmulator(*atomic, c, options(testing::testSeed()));
  auto o = runOnEmulator(*own, c, options(testing::testSeed()));
  ASSERT_TRUE(a) << a.error().message << "\n" << a.error().log;
  ASSERT_TRUE(o) << o.error().message << "\n" << o.error().log;
  EXPECT_EQ(a->findingCount, 0) << summary(*a);
  EXPECT_EQ(o->findingCount, 0) << summary(*o);
  ASSERT_TRUE(a->gradients && o->gradients);
  const double tolerance = gradientToleranceFor(v1::float16);
  EXPECT_LE(relativeError(a->gradients->dq, c.expectedGradients->dq), tolerance);
  EXPECT_LE(relativeError(a->gradients->dq, o->gradients->dq), tolerance);
  const std::vector<double> errors = gradientErrors(c.spec, c.tokens, *a->gradients, *c.expectedGradients);
  for (size_t i = 0; i < errors.size(); ++i) EXPECT_LE(errors[i], tolerance) << reference::kGradientNames[i];
}

// Faults put into copies of dq atomic's device code, each reported as the
// finding it deserves, or a wrong dq where it is a wrong value. 100 tokens
// (four query blocks of 64 rows): a key block's loop fetches a query block
// ahead into a stage other warps read one block before.
struct BackwardFault {
  const char* name;
  const char* from;
  const char* to;
  std::vector<FindingKind> kinds;  // none: a gradient must be wrong instead
  bool dqLaunch = false;           // the fault is in the dq launch (dq separate), else dq atomic
  bool wgmma = false;              // the fault is in the key-block-outer launch on wgmma (sm_90a, head_dim 64)
  bool anyKind = false;            // one of `kinds` will do (which one depends on when the copies land)
};

class BackwardFaultOnEmulator : public ::testing::TestWithParam<int> {};

const std::vector<BackwardFault>& backwardFaults() {
  static const std::vector<BackwardFault> faults = {
      {"ds_staging_barrier_removed", "          }\n      __syncthreads();\n    }\n  } else {",
       "          }\n    }\n  } else {", {FindingKind::race}},
      {"dq_row_bound_removed", "if (i + row < L && c + column < G::D)", "if (c + column < G::D)",
       {FindingKind::outOfBounds}},
      {"dq_zeroing_removed", "      if constexpr (C::atomic_dq) a.dq_pseudo[at + c] = 0.0f;", "", {}},
      // The query stages: the next block fetched while this one is used.
      {"query_block_used_before_its_copies_land", "    cuda::waitCopies<1>();\n    q.stage ^= 1;",
       "    cuda::waitCopies<2>();\n    q.stage ^= 1;", {FindingKind::asyncAccess}},
      {"next_block_fetched_before_the_warps_leave_its_stage",
       "  __syncthreads();  // every warp is done with the previous block's stage\n", "", {FindingKind::race}},
      {"next_block_fetched_into_the_stage_in_use",
       "copyQueryStage<C>(a, q.stage, row0 + C::block_m, h, b, L);",
       "copyQueryStage<C>(a, q.stage ^ 1, row0 + C::block_m, h, b, L);",
       {FindingKind::asyncAccess}},
      {"lse_left_in_the_natural_log", "a.lse_log2[row] = a.lse[row] * kLog2e;", "a.lse_log2[row] = a.lse[row];", {}},
      // The dq launch's K and V stages: the next key block fetched while this one is used.
      {"key_block_used_before_its_copies_land", "    cuda::waitCopies<1>();\n    kv.stage ^= 1;",
       "    cuda::waitCopies<2>();\n    kv.stage ^= 1;", {FindingKind::asyncAccess}, true},
      {"next_key_block_fetched_before_the_warps_leave_its_stage",
       "  __syncthreads();  // every warp is done with the previous key block's stage\n", "", {FindingKind::race},
       true},
      {"next_key_block_fetched_into_the_stage_in_use", "copyKvStage<C>(a, kv.stage, col0 + C::block_n, g, b, L);",
       "copyKvStage<C>(a, kv.stage ^ 1, col0 + C::block_n, g, b, L);", {FindingKind::asyncAccess}, true},
      {"first_key_block_fetched_into_the_other_stage", "copyKvStage<C>(a, kv.stage ^ 1, col0, g, b, seq_len<C>(a));",
       "copyKvStage<C>(a, kv.stage, col0, g, b, seq_len<C>(a));", {FindingKind::asyncAccess}, true},
      // The key-block-outer launch on wgmma: its query blocks by TMA, read by wgmma.
      {"wgmma_query_block_used_before_its_copies_land",
       "  bwgmma::waitStage(q.phases, bwgmma::stageBarrier(q.base, w, next), next);\n", "",
       {FindingKind::race}, false, true},
      {"wgmma_query_stage_expects_16_bytes_short",
       "2 * (tileBytes<C>(C::block_m) + C::block_m * kAccumulatorBytes));",
       "2 * (tileBytes<C>(C::block_m) + C::block_m * kAccumulatorBytes) - 16);",
       {FindingKind::mbarrier, FindingKind::deadlock}, false, true},
      {"wgmma_next_block_fetched_into_the_stage_in_use",
       "if (more) bwgmma::fillQueryStage<C>(q, a, maps, q.stage, row0 + C::block_m, h, b, L);",
       "if (more) bwgmma::fillQueryStage<C>(q, a, maps, q.stage ^ 1, row0 + C::block_m, h, b, L);",
       {FindingKind::deadlock}, false, true},
      {"wgmma_next_block_fetched_before_the_warps_leave_its_stage",
       "  __syncthreads();  // every warp is done with the previous block's stage (TMA refills it)\n", "",
       {FindingKind::race}, false, true},
      {"wgmma_next_head_filled_before_every_thread_drains",
       "    bwgmma::drainStage(q.phases, q.pending, q.stage, q.base, bwgmma::layout<C>());\n    __syncthreads();\n",
       "    bwgmma::drainStage(q.phases, q.pending, q.stage, q.base, bwgmma::layout<C>());\n",
       {FindingKind::deadlock}, false, true},
      // The dq launch, warp-specialised: a producer warpgroup fills its ring of
      // two K and V stages by TMA, the consumers hand each back.
      {"wgmma_key_block_used_before_its_fill_lands",
       "  ptx::mbarrierWaitParity(stageBarrier(base, w, stage), int(phases >> stage) & 1);\n", "",
       {FindingKind::race}, true, true},
      {"wgmma_stage_never_handed_back", "    ptx::mbarrierArrive(emptyBarrier(base, w, stage));\n", "",
       {FindingKind::deadlock}, true, true},
      // A fill's expect_tx lands in the phase still in flight (mbarrier
      // misuse); or, where its bytes land first, the full barrier runs a
      // phase ahead and the consumers wait on one already passed (a
      // deadlock: LOOM_TEST_SEED=14922406096604178476).
      {"wgmma_stage_refilled_before_the_consumers_leave_it",
       "  ptx::mbarrierWaitParity(emptyBarrier(base, w, s), int((phases >> s) & 1) ^ 1);\n", "",
       {FindingKind::mbarrier, FindingKind::deadlock}, true, true, true},
      {"wgmma_first_fill_waits_for_a_release_never_made", "int((phases >> s) & 1) ^ 1);", "int((phases >> s) & 1));",
       {FindingKind::deadlock}, true, true},
      // Every consumer thread's release completes a phase: the producer's parity comes round again.
      {"wgmma_empty_barrier_counts_one_release", "ptx::mbarrierInit(bwgmma::emptyBarrier(base, w, s), C::warps * kWarpSize);",
       "ptx::mbarrierInit(bwgmma::emptyBarrier(base, w, s), 1);", {FindingKind::deadlock}, true, true},
      {"wgmma_key_block_read_from_the_other_stage", "kv.tiles = kv.base + Bits32(w.k + stage * w.kvStage);",
       "kv.tiles = kv.base + Bits32(w.k + (stage ^ 1) * w.kvStage);", {FindingKind::race}, true, true},
      {"wgmma_query_block_used_before_its_fill_lands", "    ptx::mbarrierWaitParity(q.base + Bits32(w.barriers), 0);\n",
       "", {FindingKind::race}, true, true},
      {"wgmma_producer_keeps_its_registers", "ptx::setmaxnregDec<kBackwardDqProducerRegisters>();", "",
       {FindingKind::deadlock}, true, true},
      {"wgmma_scores_read_before_their_products_retire",
       "      ptx::wgmmaCommit();\n      ptx::wgmmaWait<1>();\n      ptx::pinRegisters(bwgmma::flat<C::block_m / 2>(s.t));",
       "      ptx::wgmmaCommit();\n      ptx::pinRegisters(bwgmma::flat<C::block_m / 2>(s.t));", {FindingKind::asyncAccess},
       false, true},
      {"wgmma_dp_read_before_its_product_retires",
       "    ptx::wgmmaCommit();\n    ptx::wgmmaWait<1>();\n    ptx::pinRegisters(bwgmma::flat<C::block_m / 2>(s.dt));",
       "    ptx::wgmmaCommit();\n    ptx::pinRegisters(bwgmma::flat<C::block_m / 2>(s.dt));", {FindingKind::asyncAccess},
       false, true},
      {"wgmma_dv_operand_overwritten_in_flight", "bwgmma::pack<C, C::block_m>(s.da, s.dt[0]);",
       "bwgmma::pack<C, C::block_m>(s.pa, s.dt[0]);", {FindingKind::asyncAccess}, false, true},
      {"wgmma_dv_taken_over_the_values_tile", "s.pa, q.tiles + Bits32(w.dO),", "s.pa, q.base + Bits32(w.v),", {},
       false, true},
      {"wgmma_dq_taken_over_the_values_tile", "(dq.dq), s.pa, kv.tiles,",
       "(dq.dq), s.pa, kv.tiles + Bits32(bwgmma::dqLayout<C>().v - bwgmma::dqLayout<C>().k),",
       {}, true, true},
      {"wgmma_lse_of_the_next_head", "&maps.row_stats, int(plane * L + row0), 0, bar);",
       "&maps.row_stats, int((plane + 1) * L + row0), 0, bar);",
       {}, false, true},
  };
  return faults;
}

TEST_P(BackwardFaultOnEmulator, FailsWithTheMatchingFinding) {
  const BackwardFault& fault = backwardFaults()[size_t(GetParam())];
  const v1::DType dtype = GetParam() % 2 ? v1::bfloat16 : v1::float16;
  const IhaCase c = fault.wgmma ? wgmmaCase(dtype, testing::testSeed() + 73)
                                : atomicCase(dtype, testing::testSeed() + 72, 100);
  Schedule schedule = atomicSchedule();
  if (fault.dqLaunch) schedule.set_dq(v1::dq_separate);  // its own launch, over seven key blocks
  if (fault.wgmma) schedule = wgmmaSchedule();
  auto plan = backwardPlan(c.spec, schedule, fault.wgmma ? "sm_90a" : "sm_80");
  ASSERT_TRUE(plan) << plan.error().message;
  EmuOptions o = options(testing::testSeed());
  o.headers = testing::mutatedHeader("loom/tile/cuda_backward.h", fault.from, fault.to);
  ASSERT_FALSE(o.headers.empty());
  auto faulty = runOnEmulator(*plan, c, o);
  ASSERT_TRUE(faulty) << faulty.error().message << "\n" << faulty.error().log;
  if (fault.kinds.empty()) {
    ASSERT_TRUE(faulty->gradients);
    const std::vector<double> errors = gradientErrors(c.spec, c.tokens, *faulty->gradients, *c.expectedGradients);
    EXPECT_FALSE(std::all_of(errors.begin(), errors.end(),
                             [&](double e) { return e <= gradientToleranceFor(c.spec.dtype()); }))
        << fault.name << ": a gradient should be wrong\n" << summary(*faulty);
  }
  if (fault.anyKind)
    testing::expectSomeFinding(*faulty, fault.kinds, fault.name);
  else
    testing::expectEachFinding(*faulty, fault.kinds, fault.name, "a wrong gradient");
}

INSTANTIATE_TEST_SUITE_P(Mutations, BackwardFaultOnEmulator, ::testing::Range(0, int(backwardFaults().size())),
                         [](const auto& info) { return std::string(backwardFaults()[size_t(info.param)].name); });

//===--- what the forward keeps for the backward ---------------------------===//

// A forward that keeps its mixed rows, pseudo outputs and lse, then a
// backward from them: on the host backend (float32 rows) and on the
// emulator (16-bit rows; on sm_90a also from the wgmma forward, whose
// pre-mix and pseudo outputs the mma.sync backward reads), through the host
// API. The kept tensors are
// written whole (poisoned before), the backward runs no attention CTA, and
// every gradient is within the tolerance of the float64 backward and of the
// recomputing backward's.
class KeptForwardBackward : public ::testing::TestWithParam<std::string> {};

TEST_P(KeptForwardBackward, BackwardFromItSkipsTheRecomputedAttention) {
  const bool wgmma = GetParam() == "sm_90a-wgmma";
  const std::string arch = wgmma ? "sm_90a" : GetParam();
  std::mt19937_64 rng(testing::testSeed() + (arch == "cpu" ? 801 : 802) + (wgmma ? 1 : 0));
  const IhaCase c = testing::drawCheckableShape(rng, true, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_head_dim(wgmma ? 64 : 8 * std::uniform_int_distribution<int>(1, 3)(rng));
    spec.set_dtype(arch == "cpu" ? v1::float32 : (rng() % 2 ? v1::bfloat16 : v1::float16));
    return testing::DrawnShape{spec, 1 + int64_t(rng() % 2), 3 + int64_t(rng() % (wgmma ? 10 : 20))};
  });
  const KernelSpec& spec = c.spec;
  const int64_t N = c.tokens;
  Schedule forwardSchedule;
  if (wgmma) forwardSchedule.set_engine(v1::engine_wgmma);
  const std::string what = testing::describe(c) + " " + arch;
  const bool host = arch == "cpu";
  const double tolerance = gradientToleranceFor(spec.dtype());

  testing::HostTensors kept(c), recomputed(c);
  const IhaSaved saved = kept.saved(savedRowElement(spec, !host));
  Result<emu::EmuRun> forwardRun = emu::EmuRun{};
  if (host) {
    Status ok = runOnHost(spec, kept.inputs(), Schedule(), cpu::CpuOptions{LOOM_TEST_CACHE, 2}, &saved);
    ASSERT_TRUE(ok) << what << ": " << ok.error().message;
  } else {
    forwardRun = runOnEmulator(spec, kept.inputs(), forwardSchedule, arch, options(rng()), &saved);
    ASSERT_TRUE(forwardRun) << what << ": " << forwardRun.error().message;
    EXPECT_EQ(forwardRun->findingCount, 0) << summary(*forwardRun);
  }
  for (const Tensor* t : {&saved.q_mixed, &saved.k_mixed, &saved.v_mixed, &saved.o_pseudo, &saved.lse}) {
    const std::vector<double> values = hostValues(*t);
    EXPECT_TRUE(std::all_of(values.begin(), values.end(), [](double x) { return std::isfinite(x); }))
        << what << ": a kept tensor has unwritten elements";
  }
  EXPECT_LE(relativeError(hostValues(saved.lse), reference::ihaForward(spec, c.inputs).lse), toleranceFor(spec.dtype()));

  if (host) {
    Status ok = runBackwardOnHost(spec, kept.inputs(), kept.grads(), Schedule(), cpu::CpuOptions{LOOM_TEST_CACHE, 2},
                                  &saved);
    ASSERT_TRUE(ok) << what << ": " << ok.error().message;
    ok = runBackwardOnHost(spec, recomputed.inputs(), recomputed.grads(), Schedule(),
                           cpu::CpuOptions{LOOM_TEST_CACHE, 2});
    ASSERT_TRUE(ok) << what << ": " << ok.error().message;
  } else {
    auto run = runBackwardOnEmulator(spec, kept.inputs(), kept.grads(), Schedule(), arch, options(rng()), &saved);
    ASSERT_TRUE(run) << what << ": " << run.error().message;
    EXPECT_EQ(run->findingCount, 0) << summary(*run);
    EXPECT_EQ(run->attentionCtas, 0) << what << ": the backward recomputed the attention";
    auto again = runBackwardOnEmulator(spec, recomputed.inputs(), recomputed.grads(), Schedule(), arch, options(rng()));
    ASSERT_TRUE(again) << what << ": " << again.error().message;
    EXPECT_GT(again->attentionCtas, 0);
  }
  const reference::IhaGradients fromKept = kept.gradients(), fromScratch = recomputed.gradients();
  const std::vector<double> errors = gradientErrors(spec, N, fromKept, *c.expectedGradients);
  const std::vector<double> apart = gradientErrors(spec, N, fromKept, fromScratch);
  for (size_t i = 0; i < errors.size(); ++i) {
    EXPECT_LE(errors[i], tolerance) << what << " " << reference::kGradientNames[i];
    EXPECT_LE(apart[i], tolerance) << what << " " << reference::kGradientNames[i] << " against the recomputing backward";
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, KeptForwardBackward, ::testing::Values("cpu", "sm_80", "sm_90a", "sm_90a-wgmma"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// The host backend's stats show what the kept backward skips; what cannot be
// kept, and saved tensors that do not fit, are refused by name.
TEST(KeptForwardOnCpu, SkipsThePremixAndAttentionAndRefusesWhatDoesNotFit) {
  std::mt19937_64 rng(testing::testSeed() + 803);
  const IhaCase c = testing::drawCheckableShape(rng, true, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_head_dim(16);
    return testing::DrawnShape{spec, 1, 9};
  });
  const KernelSpec& spec = c.spec;
  Schedule materialized;
  materialized.set_mix(v1::mix_materialized);
  materialized.set_collapse(v1::collapse_separate);
  auto forward = generateKernel(spec, materialized, *parseTarget("cpu"));
  auto backward = backwardPlan(spec, Schedule(), "cpu");
  ASSERT_TRUE(forward && backward);
  KeptForward kept;
  auto out = cpu::runPlan(*forward, c, {LOOM_TEST_CACHE, 2}, &kept);
  ASSERT_TRUE(out) << out.error().message;
  auto fromKept = cpu::runBackwardPlan(*backward, c, {LOOM_TEST_CACHE, 2}, &kept);
  auto fromScratch = cpu::runBackwardPlan(*backward, c, {LOOM_TEST_CACHE, 2});
  ASSERT_TRUE(fromKept && fromScratch);
  // Without the attention launch's CTAs and its key blocks.
  EXPECT_LT(fromKept->stats.attentionCtas, fromScratch->stats.attentionCtas);
  EXPECT_LT(fromKept->stats.keyBlocks, fromScratch->stats.keyBlocks);

  Schedule fused = materialized;
  fused.set_collapse(v1::collapse_fused);
  auto epilogue = generateKernel(spec, fused, *parseTarget("cpu"));
  ASSERT_TRUE(epilogue);
  auto refused = cpu::runPlan(*epilogue, c, {LOOM_TEST_CACHE, 2}, &kept);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("keeps no o_pseudo"), std::string::npos) << refused.error().message;

  testing::HostTensors host(c);
  IhaSaved wrong = host.saved(ElementKind::float32);
  wrong.o_pseudo.shape[2] += 1;
  Status status = runOnHost(spec, host.inputs(), Schedule(), cpu::CpuOptions{LOOM_TEST_CACHE, 2}, &wrong);
  ASSERT_FALSE(status);
  EXPECT_EQ(status.error().message.rfind("o_pseudo: shape", 0), 0u) << status.error().message;
  wrong = host.saved(ElementKind::float16);
  status = runBackwardOnHost(spec, host.inputs(), host.grads(), Schedule(), cpu::CpuOptions{LOOM_TEST_CACHE, 2}, &wrong);
  ASSERT_FALSE(status);
  EXPECT_EQ(status.error().message.rfind("q_mixed: element type float16, want float32", 0), 0u)
      << status.error().message;
}

}  // namespace
}  // namespace loom::emu
