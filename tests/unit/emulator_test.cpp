// The real CUDA programs on the emulator: every shared case and freshly
// drawn ones through the sm_80 program (mma.sync; schedules covering 1 to 4
// stages, fused and materialised mixing, fused and separate collapse, 1 to
// 8 warps) and the sm_90a program (wgmma; 1 to 3 consumer warpgroups,
// block_n 64 to 256, 2 to 4 stages), in float16 and bfloat16, against the
// float64 reference with zero findings; and faults put into copies of the
// device code, each of which must fail with the finding it deserves.
#include <gtest/gtest.h>

#include <numeric>

#include "emu/emulator.h"
#include "io/npy.h"
#include "loom/runtime.h"
#include "loom/tile/layout.h"
#include "loom/tile_headers.h"
#include "reference/iha_reference.h"
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

Schedule schedule(int warps, int blockM, int blockN, int stages, v1::MixStrategy mix, v1::CollapseStrategy collapse,
                  v1::Engine engine = v1::engine_mma) {
  Schedule s;
  s.set_warps(warps);
  s.set_block_m(blockM);
  s.set_block_n(blockN);
  s.set_stages(stages);
  s.set_mix(mix);
  s.set_collapse(collapse);
  s.set_engine(engine);
  return s;
}

// The sm_80 schedules the sweep takes in turn; one that does not suit a spec
// falls back to the defaults.
Schedule portableSchedule(const KernelSpec& spec, int pick) {
  const int P = spec.pseudo_heads();
  switch (pick % 5) {
    case 1: return schedule(1, std::lcm(P, 16), 16, 1, v1::mix_materialized, v1::collapse_separate);
    case 2: return schedule(2, std::lcm(P, 32), 32, 3, v1::mix_fused, v1::collapse_fused);
    case 3: return schedule(4, std::lcm(P, 128), 64, 1, v1::mix_materialized, v1::collapse_fused);  // split K / V
    case 4: return schedule(4, std::lcm(P, 64), 32, 2, v1::mix_fused, v1::collapse_separate);
    default: return Schedule();
  }
}

Schedule hopperSchedule(int pick) {
  switch (pick % 4) {
    case 1: return schedule(4, 64, 64, 2, v1::mix_fused, v1::collapse_fused, v1::engine_wgmma);
    case 2: return schedule(12, 192, 192, 2, v1::mix_materialized, v1::collapse_separate, v1::engine_wgmma);
    case 3: return schedule(8, 128, 256, 4, v1::mix_materialized, v1::collapse_fused, v1::engine_wgmma);
    default: return Schedule();
  }
}

// Generates the plan for `target`, falling back to the default schedule
// where the chosen one does not fit the spec.
KernelPlan planFor(const KernelSpec& spec, Schedule wanted, const std::string& target) {
  auto plan = generateKernel(spec, wanted, *parseTarget(target));
  if (!plan) plan = generateKernel(spec, Schedule(), *parseTarget(target));
  EXPECT_TRUE(plan) << plan.error().message;
  return *plan;
}

// Runs the plan on the case and checks: no findings, and the covered output
// against the reference within the dtype's tolerance.
void expectClean(const KernelPlan& plan, const IhaCase& c, const std::string& what, uint64_t seed) {
  auto run = runOnEmulator(plan, c, options(seed));
  ASSERT_TRUE(run) << what << ": " << run.error().message << "\n" << run.error().log;
  std::printf("[ emu      ] %s %s: %.2f s, %lld CTAs\n", what.c_str(), plan.schedule.ShortDebugString().c_str(),
              run->runSeconds, (long long)run->coverage.ctas);
  EXPECT_EQ(run->findingCount, 0) << what << " " << plan.schedule.ShortDebugString() << "\n" << summary(*run);
  EXPECT_FALSE(run->deadlocked);
  const auto reference = reference::ihaForward(c.spec, c.inputs);
  const double error = coveredRelativeError(*run, reference.out, c.batch, c.tokens, c.spec.heads(), c.spec.head_dim());
  EXPECT_LE(error, toleranceFor(c.spec.dtype())) << what << " " << plan.schedule.ShortDebugString();
  {
    // lse of the covered rows (every head, every batch entry).
    std::vector<double> got, want;
    const int64_t P = c.spec.pseudo_heads();
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < c.spec.heads(); ++h)
        for (int64_t i = 0; i < c.tokens * P; ++i)
          if (run->covered[size_t(i / P)]) {
            const size_t at = size_t((b * c.spec.heads() + h) * c.tokens * P + i);
            got.push_back(run->lse[at]);
            want.push_back(reference.lse[at]);
          }
    EXPECT_LE(relativeError(got, want), toleranceFor(c.spec.dtype())) << what << " (lse)";
  }
}

class SharedCaseOnEmulator : public ::testing::TestWithParam<std::string> {};

TEST_P(SharedCaseOnEmulator, BothEnginesBothDtypesWithoutFindings) {
  auto loaded = loadCase(testing::casesDir() + "/" + GetParam());
  ASSERT_TRUE(loaded) << loaded.error().message;
  const auto names = testing::sharedCaseNames();
  const int index = int(std::find(names.begin(), names.end(), GetParam()) - names.begin());
  for (v1::DType dtype : {v1::float16, v1::bfloat16}) {
    const IhaCase c = withDtype(*loaded, dtype);
    const int pick = 2 * index + (dtype == v1::bfloat16);
    expectClean(planFor(c.spec, portableSchedule(c.spec, pick), "sm_80"), c, GetParam() + " sm_80",
                testing::testSeed() + uint64_t(pick));
    if (c.spec.head_dim() % 64 == 0)
      expectClean(planFor(c.spec, hopperSchedule(pick), "sm_90a"), c, GetParam() + " sm_90a",
                  testing::testSeed() + uint64_t(pick) + 1000);
  }
}

INSTANTIATE_TEST_SUITE_P(Vectors, SharedCaseOnEmulator, ::testing::ValuesIn(testing::sharedCaseNames()),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// Fresh specs (options of public IHA code included), shapes and data every
// run, on both engines: head_dim 64 or 128 so the sm_90a program takes
// wgmma.
class DrawnCaseOnEmulator : public ::testing::TestWithParam<int> {};

TEST_P(DrawnCaseOnEmulator, BothEnginesWithoutFindings) {
  std::mt19937_64 rng(testing::testSeed() + uint64_t(GetParam()) * 7727);
  const IhaCase c = testing::drawCheckableShape(rng, false, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_head_dim(64 * std::uniform_int_distribution<int>(1, 2)(rng));
    spec.set_dtype(GetParam() % 2 ? v1::bfloat16 : v1::float16);
    return testing::DrawnShape{spec, 1 + int64_t(rng() % 2), 8 + int64_t(rng() % 90)};
  });
  const KernelSpec& spec = c.spec;
  const std::string what = testing::describe(c);
  expectClean(planFor(spec, portableSchedule(spec, GetParam() + 1), "sm_80"), c, what + " sm_80", rng());
  expectClean(planFor(spec, hopperSchedule(GetParam() + 1), "sm_90a"), c, what + " sm_90a", rng());
}

INSTANTIATE_TEST_SUITE_P(Random, DrawnCaseOnEmulator, ::testing::Range(0, 4));

// The premix on the tensor cores (layout.h premixOnTensorCores: 16 source
// heads and more, padded to whole k-steps): drawn specs of 16, 24, 32, 40,
// 48 or 64 query heads (kv heads as many, or 8 or 16 where they divide
// them; 8 mix on the FMA units), P 1 to 4 or 8, head_dim
// 32 to 128, both dtypes, RoPE, qk_norm and the rotation's direction drawn;
// materialised mixing on sm_80 with one warp (a warp takes every m-tile of
// a round) and four, and on sm_90a; no findings, the reference's rows.
class TensorPremixOnEmulator : public ::testing::TestWithParam<int> {};

TEST_P(TensorPremixOnEmulator, MixesOnTheTensorCoresWithoutFindings) {
  std::mt19937_64 rng(testing::testSeed() + uint64_t(GetParam()) * 4099);
  auto pick = [&](std::initializer_list<int> from) { return *(from.begin() + rng() % from.size()); };
  const IhaCase c = testing::drawCheckableShape(rng, false, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    const int H = pick({16, 24, 32, 40, 48, 64});
    spec.set_heads(H);
    spec.set_kv_heads(H % 16 ? pick({8, H}) : pick({8, 16, H}));
    spec.set_pseudo_heads(H <= 32 ? pick({1, 2, 3, 4, 8}) : pick({1, 2, 3}));
    spec.set_head_dim(pick({32, 64, 128}));
    spec.set_dtype(GetParam() % 2 ? v1::bfloat16 : v1::float16);
    testing::dropStaleOptions(spec);
    return testing::DrawnShape{spec, 1, 6 + int64_t(rng() % 14)};
  });
  const KernelSpec& spec = c.spec;
  const int P = spec.pseudo_heads();
  const Schedule oneWarp = schedule(1, std::lcm(P, 16), 16, 1, v1::mix_materialized, v1::collapse_separate);
  const Schedule fourWarps = schedule(4, std::lcm(P, 64), 32, 2, v1::mix_materialized, v1::collapse_separate);
  Schedule hopper;
  hopper.set_mix(v1::mix_materialized);
  for (const auto& [given, target] : {std::pair{oneWarp, "sm_80"}, std::pair{fourWarps, "sm_80"}, std::pair{hopper, "sm_90a"}}) {
    auto plan = generateKernel(spec, given, *parseTarget(target));
    ASSERT_TRUE(plan) << testing::describe(c) << " " << target << ": " << plan.error().message;
    ASSERT_EQ(plan->schedule.mix(), v1::mix_materialized);
    auto tensor = [&](int M) {
      return premixOnTensorCores(M, P, int(spec.head_dim()), int(plan->schedule.block_m()) / P,
                                 int(plan->schedule.warps()));
    };
    const std::string what = testing::describe(c) + " (q on the " + (tensor(spec.heads()) ? "tensor cores" : "FMA units") +
                             ", k and v on the " + (tensor(spec.kv_heads()) ? "tensor cores" : "FMA units") + ")";
    // One warp or four: every drawn spec's queries fit (its weights within 64 KiB).
    if (plan->schedule.warps() <= 4) {
      ASSERT_TRUE(tensor(spec.heads())) << what;
    }
    expectClean(*plan, c, what + " " + target, rng());
  }
}

INSTANTIATE_TEST_SUITE_P(Random, TensorPremixOnEmulator, ::testing::Range(0, 4));

// The premix past head_dim 128 where d/2 is an odd multiple of 4 (136, 152,
// ..., 248): 8-column pieces (16-byte loads; halving them would take a
// token's pieces past a warp), RoPE's partner column half a piece off, in
// one of two lanes (layout.h premixVector, cuda_common.h RopeAngles). Drawn
// specs with RoPE, both directions, qk_norm drawn, materialised mixing on
// sm_80 and sm_90a: no findings, the reference's rows.
class HalfPiecePartnerPremixOnEmulator : public ::testing::TestWithParam<int> {};

TEST_P(HalfPiecePartnerPremixOnEmulator, TurnsEveryColumnWithItsPartner) {
  std::mt19937_64 rng(testing::testSeed() + uint64_t(GetParam()) * 6421);
  const IhaCase c = testing::drawCheckableShape(rng, false, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_head_dim(136 + 16 * std::uniform_int_distribution<int>(0, 7)(rng));
    spec.set_rope_theta(10000.0);
    spec.set_rope_direction(rng() % 2 ? v1::KernelSpec::negative : v1::KernelSpec::positive);
    spec.set_dtype(GetParam() % 2 ? v1::bfloat16 : v1::float16);
    testing::dropStaleOptions(spec);
    return testing::DrawnShape{spec, 1, 2 + int64_t(rng() % 12)};
  });
  ASSERT_EQ(c.spec.head_dim() / 2 % 8, 4);
  ASSERT_EQ(premixVector(int(c.spec.heads()), int(c.spec.head_dim())), 8);
  const int P = c.spec.pseudo_heads();
  for (const auto& [given, target] :
       {std::pair{schedule(1, std::lcm(P, 16), 16, 1, v1::mix_materialized, v1::collapse_separate), "sm_80"},
        std::pair{schedule(4, std::lcm(P, 64), 32, 2, v1::mix_materialized, v1::collapse_separate), "sm_90a"}}) {
    auto plan = generateKernel(c.spec, given, *parseTarget(target));
    ASSERT_TRUE(plan) << testing::describe(c) << " " << target << ": " << plan.error().message;
    ASSERT_EQ(plan->schedule.mix(), v1::mix_materialized);
    expectClean(*plan, c, testing::describe(c) + " " + target, rng());
  }
}

INSTANTIATE_TEST_SUITE_P(Random, HalfPiecePartnerPremixOnEmulator, ::testing::Range(0, 2));

// The schedule space both engines take, each schedule exactly as given (no
// fallback): sm_80 with 1 to 8 warps, 1 to 4 stages, both mixings and both
// collapse placements; sm_90a with 1 to 3 consumer warpgroups, block_n 64 to
// 256, 2 to 4 stages, both mixings and the head-looped global collapse.
struct Variant {
  std::string target;
  Schedule schedule;
  v1::CollapseMode collapse;
};

std::vector<Variant> variants() {
  using v1::collapse_fused, v1::collapse_separate, v1::mix_fused, v1::mix_materialized, v1::engine_wgmma;
  return {
      {"sm_80", schedule(1, 16, 16, 1, mix_materialized, collapse_separate), v1::per_head},
      {"sm_80", schedule(2, 32, 32, 2, mix_fused, collapse_fused), v1::per_head},
      {"sm_80", schedule(4, 64, 32, 3, mix_materialized, collapse_fused), v1::global},
      {"sm_80", schedule(8, 128, 64, 4, mix_fused, collapse_separate), v1::per_head},
      {"sm_80", schedule(4, 128, 64, 4, mix_materialized, collapse_fused), v1::per_head},
      {"sm_80", schedule(8, 256, 64, 1, mix_materialized, collapse_separate), v1::global},  // split K / V
      {"sm_90a", schedule(4, 64, 64, 2, mix_fused, collapse_fused, engine_wgmma), v1::per_head},
      {"sm_90a", schedule(8, 128, 64, 3, mix_materialized, collapse_fused, engine_wgmma), v1::global},
      {"sm_90a", schedule(12, 192, 192, 2, mix_materialized, collapse_separate, engine_wgmma), v1::per_head},
      {"sm_90a", schedule(8, 128, 256, 2, mix_fused, collapse_separate, engine_wgmma), v1::global},
      {"sm_90a", schedule(4, 64, 128, 4, mix_materialized, collapse_fused, engine_wgmma), v1::per_head},
  };
}

class ScheduleOnEmulator : public ::testing::TestWithParam<int> {};

TEST_P(ScheduleOnEmulator, RunsAsGivenWithoutFindings) {
  const Variant v = variants()[size_t(GetParam())];
  std::mt19937_64 rng(testing::testSeed() + uint64_t(GetParam()) * 31);
  // A spec the schedule fits: a fused global collapse keeps every head's
  // output rows on chip, so some draws (many heads) are over the shared
  // memory of the large tiles; those are drawn again, nothing else is.
  KernelSpec spec;
  Result<KernelPlan> plan = makeError("no spec drawn");
  for (int draw = 0; draw < 50; ++draw) {
    spec = testing::randomSpec(rng);
    spec.set_pseudo_heads(2);
    spec.set_head_dim(64);
    spec.set_collapse(v.collapse);
    spec.set_dtype(GetParam() % 2 ? v1::bfloat16 : v1::float16);
    testing::dropStaleOptions(spec);
    plan = generateKernel(spec, v.schedule, *parseTarget(v.target));
    if (plan || plan.error().message.find("bytes of shared memory") == std::string::npos) break;
  }
  ASSERT_TRUE(plan) << spec.ShortDebugString() << ": " << plan.error().message;
  const IhaCase c = drawCheckableCase(spec, 1, 40 + int64_t(rng() % 60), rng());
  EXPECT_EQ(plan->schedule.warps(), v.schedule.warps());
  EXPECT_EQ(plan->schedule.stages(), v.schedule.stages());
  EXPECT_EQ(plan->schedule.block_n(), v.schedule.block_n());
  expectClean(*plan, c, v.target + " " + spec.ShortDebugString(), rng());
}

INSTANTIATE_TEST_SUITE_P(Space, ScheduleOnEmulator, ::testing::Range(0, int(variants().size())),
                         [](const auto& info) {
                           const Variant v = variants()[size_t(info.param)];
                           return v.target + "_w" + std::to_string(v.schedule.warps()) + "_n" +
                                  std::to_string(v.schedule.block_n()) + "_s" + std::to_string(v.schedule.stages());
                         });

//===--- the host API -------------------------------------------------------===//

// loom::runOnEmulator on host tensors: q in a wider buffer (a token stride
// larger than its row), the others dense; out and lse come back through
// their own strides and match the reference, with zero findings.
TEST(HostApi, RunsStridedHostTensorsOnTheEmulator) {
  std::mt19937_64 rng(testing::testSeed() + 404);
  const IhaCase c = testing::drawCheckableShape(rng, false, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_head_dim(64);
    spec.set_dtype(v1::bfloat16);
    return testing::DrawnShape{spec, 1, 20 + int64_t(rng() % 40)};
  });
  const KernelSpec& spec = c.spec;
  const int64_t B = c.batch, N = c.tokens, H = spec.heads(), G = spec.kv_heads(), d = 64, P = spec.pseudo_heads();
  const NpyType storage = storageTypeOf(spec.dtype());
  auto bytesOf = [&](const std::vector<double>& values, NpyType type) {
    return npyFromDouble(values, {int64_t(values.size())}, type).bytes;
  };
  // q's rows sit 3 * d elements apart in a buffer of H + 3 heads per token.
  const int64_t qTokenStride = (H + 3) * d;
  std::vector<uint8_t> q(size_t(B * N * qTokenStride * 2), 0x7f);
  const std::vector<uint8_t> qDense = bytesOf(c.inputs.q, storage);
  for (int64_t n = 0; n < B * N; ++n)
    std::memcpy(&q[size_t(n * qTokenStride * 2)], &qDense[size_t(n * H * d * 2)], size_t(H * d * 2));
  std::vector<uint8_t> k = bytesOf(c.inputs.k, storage), v = bytesOf(c.inputs.v, storage);
  std::vector<uint8_t> aq = bytesOf(c.inputs.alpha_q, NpyType::float32), ak = bytesOf(c.inputs.alpha_k, NpyType::float32),
                       av = bytesOf(c.inputs.alpha_v, NpyType::float32),
                       collapse = bytesOf(c.inputs.collapse, NpyType::float32);
  std::vector<uint8_t> out(size_t(B * N * H * d * 2), 0xff), lse(size_t(B * H * N * P * 4), 0xff);
  auto tensor = [](std::vector<uint8_t>& bytes, ElementKind element, std::vector<int64_t> shape,
                   std::vector<int64_t> strides = {}) {
    return Tensor{bytes.data(), element, std::move(shape), std::move(strides), kHostDevice};
  };
  IhaTensors t;
  t.q = tensor(q, ElementKind::bfloat16, {B, N, H, d}, {N * qTokenStride, qTokenStride, d, 1});
  t.k = tensor(k, ElementKind::bfloat16, {B, N, G, d});
  t.v = tensor(v, ElementKind::bfloat16, {B, N, G, d});
  t.alpha_q = tensor(aq, ElementKind::float32, {H, H, P});
  t.alpha_k = tensor(ak, ElementKind::float32, {G, G, P});
  t.alpha_v = tensor(av, ElementKind::float32, {G, G, P});
  t.collapse = spec.collapse() == v1::global ? tensor(collapse, ElementKind::float32, {H, H * P})
                                             : tensor(collapse, ElementKind::float32, {H, P});
  t.out = tensor(out, ElementKind::bfloat16, {B, N, H, d});
  t.lse = tensor(lse, ElementKind::float32, {B, H, N * P});

  auto run = runOnEmulator(spec, t, Schedule(), "sm_80", options(rng()));
  ASSERT_TRUE(run) << run.error().message;
  EXPECT_EQ(run->findingCount, 0) << summary(*run);
  EXPECT_FALSE(run->deadlocked);
  const auto reference = reference::ihaForward(c.spec, c.inputs);
  EXPECT_LE(relativeError(hostValues(t.out), reference.out), toleranceFor(spec.dtype()))
      << spec.ShortDebugString() << " N=" << N;
  EXPECT_LE(relativeError(hostValues(*t.lse), reference.lse), toleranceFor(spec.dtype()));

  // A target that is not CUDA is refused with the reason.
  auto cpu = runOnEmulator(spec, t, Schedule(), "cpu", options(1));
  ASSERT_FALSE(cpu);
  EXPECT_NE(cpu.error().message.find("CUDA"), std::string::npos) << cpu.error().message;
}

//===--- faults put into copies of the device code --------------------------===//

// A case with several key blocks per query block and a last block cut short.
IhaCase faultCase(v1::DType dtype) {
  KernelSpec spec = testing::makeSpec({.heads = 2, .kvHeads = 2, .pseudoHeads = 2, .headDim = 64, .dtype = dtype,
                                       .mask = v1::flat_causal, .collapse = v1::per_head, .ropeTheta = 10000});
  return drawCheckableCase(spec, 1, 100, testing::testSeed() + 3);
}

struct Fault {
  const char* name;
  const char* header;
  const char* from;
  const char* to;
  std::string target;
  Schedule schedule;
  // What the run must report; nothing: the output must be wrong instead.
  std::vector<FindingKind> kinds;
};

std::vector<Fault> faults() {
  const Schedule materialized = schedule(4, 64, 32, 2, v1::mix_materialized, v1::collapse_fused);
  // The split pipeline of one K and one V tile (stages 1, loom/tile/cuda.h).
  const Schedule split = schedule(4, 128, 64, 1, v1::mix_materialized, v1::collapse_fused);
  const Schedule hopper = schedule(8, 128, 64, 3, v1::mix_materialized, v1::collapse_fused, v1::engine_wgmma);
  const Schedule hopperMixing = schedule(8, 128, 64, 3, v1::mix_fused, v1::collapse_fused, v1::engine_wgmma);
  return {
      {"syncthreads_removed_from_the_kv_pipeline", "loom/tile/cuda.h",
       "__device__ __forceinline__ void kv_release(KvPipeline<C, false>&, int64_t) {\n"
       "  if constexpr (!cuda::Geometry<C>::splitKv) __syncthreads();",
       "__device__ __forceinline__ void kv_release(KvPipeline<C, false>&, int64_t) {", "sm_80", materialized,
       {FindingKind::race}},
      {"wait_group_allows_one_group_too_many", "loom/tile/cuda.h", "  cuda::waitCopies<G::splitKv ? 0 : C::stages - 1>();",
       "  cuda::waitCopies<G::splitKv ? 1 : C::stages>();", "sm_80", materialized, {FindingKind::asyncAccess}},
      {"q_wait_leaves_q_in_flight", "loom/tile/cuda.h",
       "    // kv_begin committed exactly groupsAfterQ groups after Q's.\n    cuda::waitCopies<G::groupsAfterQ>();",
       "    cuda::waitCopies<G::groupsAfterQ + 1>();", "sm_80", materialized, {FindingKind::asyncAccess}},
      {"wrong_ldmatrix_row_address", "loom/tile/cuda.h",
       "fragment::bRow(l) * G::pitch + fragment::bColumn(l));",
       "fragment::bRow(l) * G::pitch + fragment::bColumn(l) + 8);", "sm_80",
       materialized, {FindingKind::uninitialized}},
      {"a_fragment_registers_swapped", "loom/tile/cuda.h",
       "      p[mt][1] = s.p[mt][2 * kk][1];\n      p[mt][2] = s.p[mt][2 * kk + 1][0];",
       "      p[mt][2] = s.p[mt][2 * kk][1];\n      p[mt][1] = s.p[mt][2 * kk + 1][0];",
       "sm_80", materialized, {}},
      {"boundary_predicate_of_the_last_key_block_removed", "loom/tile/cuda.h",
       "const bool valid = column && round * step < left;", "const bool valid = column;", "sm_80",
       materialized, {FindingKind::outOfBounds}},
      {"split_pipeline_copies_k_before_every_warp_is_done_with_it", "loom/tile/cuda.h",
       "    cuda::waitCopies<0>();\n    __syncthreads();\n    if (block + 1 < pipe.upper)",
       "    cuda::waitCopies<0>();\n    if (block + 1 < pipe.upper)", "sm_80", split, {FindingKind::race}},
      {"split_pipeline_reads_v_before_it_lands", "loom/tile/cuda.h",
       "    cuda::waitCopies<0>();\n    __syncthreads();\n    if (block + 1 < pipe.upper)",
       "    __syncthreads();\n    if (block + 1 < pipe.upper)", "sm_80", split, {FindingKind::asyncAccess}},
      {"wrong_swizzle_mode_in_a_wgmma_descriptor", "loom/tile/cuda_common.h", "Bits32(1) << 30", "Bits32(2) << 30",
       "sm_90a", hopper, {FindingKind::uninitialized}},
      {"expect_tx_16_bytes_short", "loom/tile/hopper.h", "hopper::mbarrierExpectBytes(full, 2 * G::kvTileBytes);",
       "hopper::mbarrierExpectBytes(full, 2 * G::kvTileBytes - 16);", "sm_90a", hopper,
       {FindingKind::mbarrier, FindingKind::deadlock}},
      {"fence_proxy_async_removed_from_on_chip_mixing", "loom/tile/hopper.h",
       "    hopper::fenceAsyncProxy();\n    hopper::mbarrierArrive(hopper::fullBarrier<C>(stage));",
       "    hopper::mbarrierArrive(hopper::fullBarrier<C>(stage));", "sm_90a", hopperMixing,
       {FindingKind::proxyFence}},
      {"wgmma_wait_before_the_softmax_reads_s_removed", "loom/tile/hopper.h",
       "  hopper::wgmmaWait<1>();  // groups retire in order: S is done, P V may run on\n", "", "sm_90a", hopper,
       {FindingKind::asyncAccess}},
  };
}

class FaultOnEmulator : public ::testing::TestWithParam<int> {};

TEST_P(FaultOnEmulator, FailsWithTheMatchingFinding) {
  const Fault fault = faults()[size_t(GetParam())];
  const IhaCase c = faultCase(GetParam() % 2 ? v1::bfloat16 : v1::float16);
  auto plan = generateKernel(c.spec, fault.schedule, *parseTarget(fault.target));
  ASSERT_TRUE(plan) << plan.error().message;
  // The unchanged code passes on the same case, schedule and seed...
  EmuOptions o = options(testing::testSeed());
  auto clean = runOnEmulator(*plan, c, o);
  ASSERT_TRUE(clean) << clean.error().message;
  EXPECT_EQ(clean->findingCount, 0) << summary(*clean);
  const auto reference = reference::ihaForward(c.spec, c.inputs);
  EXPECT_LE(relativeError(clean->out, reference.out), toleranceFor(c.spec.dtype()));
  // ... and the fault does not.
  o.headers = testing::mutatedHeader(fault.header, fault.from, fault.to);
  ASSERT_FALSE(o.headers.empty());
  auto faulty = runOnEmulator(*plan, c, o);
  ASSERT_TRUE(faulty) << faulty.error().message << "\n" << faulty.error().log;
  if (fault.kinds.empty()) {
    EXPECT_GT(relativeError(faulty->out, reference.out), toleranceFor(c.spec.dtype()))
        << fault.name << ": the output should be wrong\n" << summary(*faulty);
  }
  testing::expectEachFinding(*faulty, fault.kinds, fault.name, "wrong output");
}

INSTANTIATE_TEST_SUITE_P(Mutations, FaultOnEmulator, ::testing::Range(0, int(faults().size())),
                         [](const auto& info) { return std::string(faults()[size_t(info.param)].name); });

// One stage on the wgmma engine deadlocks: a consumer returns a stage only
// when the next block's softmax retires the P V it owes. The schedule checks
// refuse it now; forced into the program, the emulator finds the deadlock.
TEST(EmulatorFault, OneWgmmaStageDeadlocksAndIsRefused) {
  const IhaCase c = faultCase(v1::bfloat16);
  Schedule one = schedule(8, 128, 64, 1, v1::mix_materialized, v1::collapse_fused, v1::engine_wgmma);
  auto refused = generateKernel(c.spec, one, *parseTarget("sm_90a"));
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("schedule.stages (1) must be at least 2 with engine wgmma"),
            std::string::npos)
      << refused.error().message;
  one.set_stages(2);
  auto plan = generateKernel(c.spec, one, *parseTarget("sm_90a"));
  ASSERT_TRUE(plan) << plan.error().message;
  EmuOptions o = options(testing::testSeed());
  const std::string from = "static constexpr int stages = 2;";
  const size_t at = plan->source.find(from);
  ASSERT_NE(at, std::string::npos);
  o.source = plan->source;
  o.source.replace(at, from.size(), "static constexpr int stages = 1;");
  auto run = runOnEmulator(*plan, c, o);
  ASSERT_TRUE(run) << run.error().message;
  EXPECT_TRUE(run->deadlocked) << summary(*run);
  EXPECT_TRUE(std::any_of(run->findings.begin(), run->findings.end(),
                          [](const Finding& f) { return f.kind == FindingKind::deadlock; }))
      << summary(*run);
}

// Emulating some CTAs of a long sequence: whole query blocks, the first and
// the last; their tokens are right, the rest are not computed.
TEST(Emulator, SomeCtasOfALongSequence) {
  KernelSpec spec = testing::makeSpec({.heads = 2, .pseudoHeads = 2, .headDim = 64, .dtype = v1::bfloat16});
  const IhaCase c = drawCheckableCase(spec, 1, 400, testing::testSeed() + 9);
  const KernelPlan plan = planFor(spec, Schedule(), "sm_90a");
  EmuOptions o = options(testing::testSeed());
  o.maxCtas = 4;
  auto run = runOnEmulator(plan, c, o);
  ASSERT_TRUE(run) << run.error().message;
  EXPECT_EQ(run->attentionCtasRun, 4);
  EXPECT_GT(run->attentionCtas, 4);
  EXPECT_TRUE(run->covered.front());
  EXPECT_TRUE(run->covered.back());
  EXPECT_LT(std::count(run->covered.begin(), run->covered.end(), true), int64_t(run->covered.size()));
  EXPECT_EQ(run->findingCount, 0) << summary(*run);
  EXPECT_LE(coveredRelativeError(*run, *c.expected, 1, 400, 2, 64), toleranceFor(v1::bfloat16));
}

TEST(Emulator, RefusesPlansItCannotRun) {
  KernelSpec spec = testing::makeSpec({.heads = 2, .pseudoHeads = 2, .headDim = 64, .dtype = v1::bfloat16});
  const IhaCase c = drawCase(spec, 1, 4, 1);
  auto cpuPlan = generateKernel(spec, Schedule(), *parseTarget("cpu"));
  ASSERT_TRUE(cpuPlan);
  auto run = runOnEmulator(*cpuPlan, c, options(1));
  ASSERT_FALSE(run);
  EXPECT_NE(run.error().message.find("CUDA programs"), std::string::npos);
}

}  // namespace
}  // namespace loom::emu
