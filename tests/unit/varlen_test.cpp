// Varlen (KernelSpec.varlen, docs/IHA.md "Varlen"): documents packed one
// after another in one batch, their bounds in cu_seqlens. Every backend's
// forward and backward of a packed batch equal, per document, the function
// of that document alone: the host tile API and the emulated CUDA programs of
// both engines against the float64 reference, on drawn specs, documents and
// data; the key blocks a CTA visits stop at its documents' bounds; and the
// faults that would let attention run across a document are found. (RoPE's
// positions restart in each document, but a score depends only on i - j:
// positions run across documents would change no score, only the angles'
// rounding far into a long batch, so no test can tell them apart.)
#include <gtest/gtest.h>

#include <numeric>

#include "cpu/cpu_backend.h"
#include "emu/emulator.h"
#include "host_tensors.h"
#include "io/case.h"
#include "loom/compiler.h"
#include "mutate.h"
#include "reference/iha_backward.h"
#include "reference/iha_reference.h"
#include "test_util.h"

namespace loom {
namespace {

cpu::CpuOptions cpuOptions() { return {LOOM_TEST_CACHE, 2}; }

Result<KernelPlan> planFor(const KernelSpec& spec, const Schedule& schedule, const std::string& target,
                           Direction direction = Direction::forward) {
  GenerateOptions options;
  options.direction = direction;
  return generateKernel(spec, schedule, *parseTarget(target), options);
}

// A drawn varlen spec (every mask, window and option randomSpec draws) of 1
// to 5 documents (`documents` where given) over `minTokens` to `maxTokens`
// tokens, checkable in its dtype.
IhaCase drawVarlenCase(std::mt19937_64& rng, bool backward, int64_t maxTokens, const std::vector<v1::DType>& dtypes,
                       const std::function<void(KernelSpec&)>& adjust = {}, int64_t minTokens = 1,
                       int64_t documents = 0) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  return testing::drawCheckableShape(rng, backward, [&] {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_varlen(true);
    spec.set_head_dim(int32_t(8 * pick(1, 4)));
    spec.set_dtype(dtypes[size_t(pick(0, int64_t(dtypes.size()) - 1))]);
    if (adjust) adjust(spec);
    testing::dropStaleOptions(spec);
    return testing::DrawnShape{spec, documents > 0 ? documents : pick(1, 5), pick(minTokens, maxTokens)};
  });
}

// Every gradient of a backward run within the dtype's tolerance of the
// case's expected ones (judged per document where one vanishes).
void expectGradients(const IhaCase& c, const reference::IhaGradients& got, const std::string& what = "") {
  const std::vector<double> errors = gradientErrors(c.spec, c.tokens, got, *c.expectedGradients, c.inputs.cu_seqlens);
  for (size_t i = 0; i < errors.size(); ++i)
    EXPECT_LE(errors[i], gradientToleranceFor(c.spec.dtype())) << reference::kGradientNames[i] << " " << what;
}

std::string describeDocuments(const IhaCase& c) {
  std::string text = testing::describe(c) + " cu_seqlens";
  for (int32_t bound : c.inputs.cu_seqlens) text += " " + std::to_string(bound);
  return text;
}

// Three schedules on the host: the defaults, and small and medium blocks
// (several query and key blocks a document, blocks across documents).
std::vector<Schedule> hostSchedules(const KernelSpec& spec) {
  const int P = spec.pseudo_heads();
  std::vector<Schedule> schedules(3);
  schedules[1].set_warps(1);
  schedules[1].set_block_m(std::lcm(P, 16));
  schedules[1].set_block_n(16);
  schedules[1].set_mix(v1::mix_materialized);
  schedules[1].set_collapse(v1::collapse_separate);
  schedules[2].set_warps(2);
  schedules[2].set_block_m(std::lcm(P, 32));
  schedules[2].set_block_n(32);
  schedules[2].set_mix(v1::mix_fused);
  schedules[2].set_collapse(v1::collapse_fused);
  return schedules;
}

// The reference's packing against its own batch loop: B sequences of n
// tokens as B documents of one batch give the same out, lse and gradients
// (the documents' code slices and scatters; the batch loop does not).
TEST(Varlen, ReferenceOfEqualDocumentsIsTheBatchedReference) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7a11);
  for (int draw = 0; draw < 4; ++draw) {
    KernelSpec spec = testing::randomSpec(rng);
    const int64_t B = 1 + int64_t(rng() % 3), n = 1 + int64_t(rng() % 7);
    const IhaCase batched = drawCase(spec, B, n, rng());
    spec.set_varlen(true);
    reference::IhaInputs packed = batched.inputs;
    packed.batch = 1;
    packed.tokens = B * n;
    for (int64_t b = 0; b <= B; ++b) packed.cu_seqlens.push_back(int32_t(b * n));
    SCOPED_TRACE(testing::describe(batched));
    const auto want = reference::ihaForward(batched.spec, batched.inputs);
    const auto got = reference::ihaForward(spec, packed);
    EXPECT_EQ(got.out, want.out);
    const int64_t H = spec.heads(), rows = n * spec.pseudo_heads();  // lse [B, H, n P] and [1, H, B n P]
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < rows; ++r)
          ASSERT_EQ(got.lse[size_t(h * B * rows + b * rows + r)], want.lse[size_t((b * H + h) * rows + r)]);
    const std::vector<double> dout = drawDout(batched.spec, B, n, rng());
    const auto wantGrads = reference::ihaBackward(batched.spec, batched.inputs, dout);
    const auto gotGrads = reference::ihaBackward(spec, packed, dout);
    const auto x = reference::gradientsOf(gotGrads), y = reference::gradientsOf(wantGrads);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_LE(relativeError(*x[i], *y[i]), 1e-12) << reference::kGradientNames[i];
  }
}

// The host program of drawn varlen specs under three schedules: out and lse
// within the dtype's tolerance, and no more key blocks than the same tokens
// as one sequence.
TEST(Varlen, HostForwardMatchesTheReference) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7a12);
  for (int draw = 0; draw < 6; ++draw) {
    const IhaCase c = drawVarlenCase(rng, false, 40, {v1::float32, v1::float16, v1::bfloat16});
    SCOPED_TRACE(describeDocuments(c));
    const auto want = reference::ihaForward(c.spec, c.inputs);
    for (const Schedule& schedule : hostSchedules(c.spec)) {
      auto plan = planFor(c.spec, schedule, "cpu");
      ASSERT_TRUE(plan) << plan.error().message;
      auto got = cpu::runPlan(*plan, c, cpuOptions());
      ASSERT_TRUE(got) << got.error().message << "\n" << got.error().log;
      EXPECT_LE(relativeError(got->out, want.out), toleranceFor(c.spec.dtype())) << plan->schedule.ShortDebugString();
      EXPECT_LE(relativeError(got->lse, want.lse), toleranceFor(c.spec.dtype())) << "lse";
      const auto [dense, denseMasked] =
          testing::bruteForceBlocks(c.spec, plan->schedule.block_m(), plan->schedule.block_n(), c.tokens);
      EXPECT_LE(got->stats.keyBlocks, dense * c.spec.heads()) << "more key blocks than one sequence's";
    }
  }
}

// Documents whose rows fill whole blocks: every query block lies in one
// document and its key blocks end at the document's bounds, so the CTAs
// visit and mask exactly the blocks of each document as a sequence alone.
TEST(Varlen, KeyBlocksStopAtTheDocumentsBounds) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7a13);
  for (int draw = 0; draw < 4; ++draw) {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_varlen(true);
    spec.set_head_dim(8 * (1 + int32_t(rng() % 4)));
    Schedule schedule;
    schedule.set_warps(1);
    schedule.set_block_m(16 * spec.pseudo_heads());
    schedule.set_block_n(16);
    std::vector<int32_t> bounds = {0};
    int64_t visited = 0, masked = 0;
    for (int64_t doc = 0, documents = 2 + int64_t(rng() % 3); doc < documents; ++doc) {
      const int64_t tokens = 16 * (1 + int64_t(rng() % 3));  // whole query and key blocks
      bounds.push_back(bounds.back() + int32_t(tokens));
      KernelSpec alone = spec;
      alone.set_varlen(false);
      const auto [v, m] = testing::bruteForceBlocks(alone, schedule.block_m(), schedule.block_n(), tokens);
      visited += v;
      masked += m;
    }
    IhaCase c = drawCase(spec, 1, bounds.back(), rng());
    c.inputs.cu_seqlens = bounds;
    SCOPED_TRACE(describeDocuments(c));
    auto plan = planFor(spec, schedule, "cpu");
    ASSERT_TRUE(plan) << plan.error().message;
    auto got = cpu::runPlan(*plan, c, cpuOptions());
    ASSERT_TRUE(got) << got.error().message;
    EXPECT_EQ(got->stats.keyBlocks, visited * spec.heads());
    EXPECT_EQ(got->stats.maskedBlocks, masked * spec.heads());
    EXPECT_LE(relativeError(got->out, reference::ihaForward(spec, c.inputs).out), toleranceFor(spec.dtype()));
  }
}

// The host backward of drawn varlen specs: every gradient within the
// tolerance (the weights' summed over documents).
TEST(Varlen, HostBackwardMatchesTheReference) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7a14);
  for (int draw = 0; draw < 4; ++draw) {
    const IhaCase c = drawVarlenCase(rng, true, 24, {v1::float32, v1::float16, v1::bfloat16});
    SCOPED_TRACE(describeDocuments(c));
    for (const Schedule& schedule : hostSchedules(c.spec)) {
      Schedule s = schedule;
      s.clear_mix();
      s.clear_collapse();
      if (s.block_m() > 0) s.set_dq(s.block_n() == 16 ? v1::dq_atomic : v1::dq_separate);
      auto plan = planFor(c.spec, s, "cpu", Direction::backward);
      ASSERT_TRUE(plan) << plan.error().message;
      auto got = cpu::runBackwardPlan(*plan, c, cpuOptions());
      ASSERT_TRUE(got) << got.error().message << "\n" << got.error().log;
      expectGradients(c, got->gradients, plan->schedule.ShortDebugString());
    }
  }
}

// The emulated CUDA forward on both engines (head_dim 64 so that sm_90a
// takes wgmma), blocks across documents included: no finding, out and lse
// within the tolerance.
TEST(Varlen, EmulatedForwardOnBothEngines) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7a15);
  for (int draw = 0; draw < 4; ++draw) {
    const std::string arch = draw % 2 ? "sm_90a" : "sm_80";
    const IhaCase c = drawVarlenCase(rng, false, 48, {v1::float16, v1::bfloat16},
                                     [&](KernelSpec& spec) { spec.set_head_dim(64); });
    SCOPED_TRACE(describeDocuments(c) + " " + arch);
    Schedule schedule;
    if (draw >= 2) {  // small blocks: several a document, and blocks across documents
      schedule.set_block_m(int32_t(std::lcm(c.spec.pseudo_heads(), arch == "sm_80" ? 32 : 64)));
      schedule.set_block_n(arch == "sm_80" ? 32 : 64);
    }
    auto plan = planFor(c.spec, schedule, arch);
    if (!plan) plan = planFor(c.spec, Schedule(), arch);
    ASSERT_TRUE(plan) << plan.error().message;
    auto run = emu::runOnEmulator(*plan, c, testing::emulatorOptions(rng()));
    ASSERT_TRUE(run) << run.error().message << "\n" << run.error().log;
    std::printf("[ emu      ] %s %s: %.2f s, %lld CTAs\n", arch.c_str(), plan->schedule.ShortDebugString().c_str(),
                run->runSeconds, (long long)run->coverage.ctas);
    EXPECT_EQ(run->findingCount, 0) << emu::summary(*run);
    const auto want = reference::ihaForward(c.spec, c.inputs);
    EXPECT_LE(relativeError(run->out, want.out), toleranceFor(c.spec.dtype())) << plan->schedule.ShortDebugString();
    EXPECT_LE(relativeError(run->lse, want.lse), toleranceFor(c.spec.dtype())) << "lse";
  }
}

// The emulated CUDA backward (sm_80 and sm_90a): no finding, every gradient
// within the tolerance.
TEST(Varlen, EmulatedBackward) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7a16);
  for (int draw = 0; draw < 2; ++draw) {
    const std::string arch = draw % 2 ? "sm_90a" : "sm_80";
    const IhaCase c = drawVarlenCase(rng, true, 24, {v1::float16, v1::bfloat16},
                                     [&](KernelSpec& spec) { spec.set_head_dim(32); });
    SCOPED_TRACE(describeDocuments(c) + " " + arch);
    auto plan = planFor(c.spec, Schedule(), arch, Direction::backward);
    ASSERT_TRUE(plan) << plan.error().message;
    auto run = emu::runOnEmulator(*plan, c, testing::emulatorOptions(rng()));
    ASSERT_TRUE(run) << run.error().message << "\n" << run.error().log;
    EXPECT_EQ(run->findingCount, 0) << emu::summary(*run);
    ASSERT_TRUE(run->gradients);
    expectGradients(c, *run->gradients);
  }
}

// The same on sm_90a's wgmma backward (head_dim 64): TMA fills of each
// document's query blocks, and the dq launch's producer warpgroup walking
// each document's key blocks as its consumers do, blocks across documents
// included.
TEST(Varlen, EmulatedWgmmaBackward) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7a18);
  const IhaCase c = drawVarlenCase(rng, true, 40, {v1::float16, v1::bfloat16},
                                   [&](KernelSpec& spec) { spec.set_head_dim(64); });
  SCOPED_TRACE(describeDocuments(c));
  auto plan = planFor(c.spec, Schedule(), "sm_90a", Direction::backward);
  ASSERT_TRUE(plan) << plan.error().message;
  ASSERT_EQ(plan->schedule.engine(), v1::engine_wgmma);
  auto run = emu::runOnEmulator(*plan, c, testing::emulatorOptions(rng()));
  ASSERT_TRUE(run) << run.error().message << "\n" << run.error().log;
  EXPECT_EQ(run->findingCount, 0) << emu::summary(*run);
  ASSERT_TRUE(run->gradients);
  expectGradients(c, *run->gradients);
}

// What keeps each document alone, each broken in common.h on the same
// drawn case (several documents, blocks across them), is caught by the
// emulated forward's numbers.
TEST(Varlen, FaultsAreFound) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7a17);
  const IhaCase packed = drawVarlenCase(
      rng, false, 40, {v1::bfloat16},
      [&](KernelSpec& spec) {
        spec.set_head_dim(64);
        spec.set_rope_theta(10000);
        spec.set_mask(v1::flat_causal);
        spec.set_window(0);
        spec.clear_window_rows();
      },
      /*minTokens=*/24, /*documents=*/3);
  const IhaCase& c = packed;
  SCOPED_TRACE(describeDocuments(packed));
  Schedule schedule;
  schedule.set_block_m(int32_t(std::lcm(c.spec.pseudo_heads(), 32)));
  schedule.set_block_n(32);
  auto plan = planFor(c.spec, schedule, "sm_80");
  ASSERT_TRUE(plan) << plan.error().message;
  const auto want = reference::ihaForward(c.spec, packed.inputs);
  auto clean = emu::runOnEmulator(*plan, packed, testing::emulatorOptions(rng()));
  ASSERT_TRUE(clean) << clean.error().message;
  ASSERT_EQ(clean->findingCount, 0) << emu::summary(*clean);
  ASSERT_LE(relativeError(clean->out, want.out), toleranceFor(c.spec.dtype()));
  const std::pair<const char*, std::pair<const char*, const char*>> faults[] = {
      {"a masked block's rows see other documents' keys",
       {"    range.lo = range.lo > first ? range.lo : first;\n", ""}},
      {"a document's last key taken for the next one's first",
       {"int lo = 0, hi = int(a.documents);", "int lo = 0, hi = int(a.documents);\n  if (token > 0) --token;"}},
  };
  for (const auto& [fault, change] : faults) {
    emu::EmuOptions options = testing::emulatorOptions(rng());
    options.headers = testing::mutatedHeader("loom/tile/common.h", change.first, change.second);
    auto faulty = emu::runOnEmulator(*plan, packed, options);
    ASSERT_TRUE(faulty) << fault << ": " << faulty.error().message;
    EXPECT_GT(relativeError(faulty->out, want.out), toleranceFor(c.spec.dtype())) << fault << ": not found";
    testing::expectEachFinding(*faulty, {}, fault, "out wrong");
  }
}

// The C++ host API on packed tensors as a training loop holds them: q, k,
// v, out [total, H | G, d], lse [H, total * P], dout and dq, dk, dv
// [total, ...], the bounds beside them; and what it refuses, by name.
TEST(Varlen, HostApiTakesPackedTensors) {
  std::mt19937_64 rng(testing::testSeed() ^ 0x7a18);
  IhaCase c = drawVarlenCase(rng, true, 30, {v1::bfloat16, v1::float32});
  SCOPED_TRACE(describeDocuments(c));
  testing::HostTensors host(c);
  auto packed = [](Tensor t) {  // [1, total, ...] as [total, ...]
    t.shape.erase(t.shape.begin());
    return t;
  };
  IhaTensors t = host.inputs();
  for (Tensor* x : {&t.q, &t.k, &t.v, &t.out, &*t.lse}) *x = packed(*x);
  t.cu_seqlens = c.inputs.cu_seqlens.data();
  t.documents = int64_t(c.inputs.cu_seqlens.size()) - 1;
  IhaGradTensors g = host.grads();
  for (Tensor* x : {&g.dout, &g.dq, &g.dk, &g.dv}) *x = packed(*x);
  const cpu::CpuOptions options = cpuOptions();
  ASSERT_TRUE(runOnHost(c.spec, t, {}, options));
  const auto want = reference::ihaForward(c.spec, c.inputs);
  EXPECT_LE(relativeError(hostValues(t.out), want.out), toleranceFor(c.spec.dtype()));
  EXPECT_LE(relativeError(hostValues(*t.lse), want.lse), toleranceFor(c.spec.dtype()));
  ASSERT_TRUE(runBackwardOnHost(c.spec, t, g, {}, options));
  expectGradients(c, host.gradients());

  auto refusal = [&](const IhaTensors& bad, const KernelSpec& spec) {
    const Status status = runOnHost(spec, bad, {}, options);
    return status ? std::string("accepted") : status.error().message;
  };
  IhaTensors missing = t;
  missing.cu_seqlens = nullptr;
  EXPECT_NE(refusal(missing, c.spec).find("cu_seqlens: missing"), std::string::npos) << refusal(missing, c.spec);
  KernelSpec plain = c.spec;
  plain.set_varlen(false);
  EXPECT_NE(refusal(t, plain).find("the spec is not varlen"), std::string::npos) << refusal(t, plain);
  std::vector<int32_t> wrongEnd = c.inputs.cu_seqlens;
  wrongEnd.back() += 1;
  IhaTensors overrun = t;
  overrun.cu_seqlens = wrongEnd.data();
  EXPECT_NE(refusal(overrun, c.spec).find("must be the tokens packed"), std::string::npos) << refusal(overrun, c.spec);
}

// Refusals: a decode plan of a varlen spec, and bounds that break a rule.
TEST(Varlen, RefusalsNameTheRule) {
  KernelSpec spec = testing::makeSpec({.heads = 2, .pseudoHeads = 2, .headDim = 16});
  spec.set_varlen(true);
  GenerateOptions decode;
  decode.direction = Direction::decode;
  auto plan = generateKernel(spec, {}, *parseTarget("cpu"), decode);
  ASSERT_FALSE(plan);
  EXPECT_NE(plan.error().message.find("varlen"), std::string::npos) << plan.error().message;
  const std::vector<int32_t> decreasing = {0, 5, 3, 8}, offStart = {1, 8}, short_ = {0, 7};
  EXPECT_NE(validateCuSeqlens(decreasing.data(), 4, 8).error().message.find("cu_seqlens[2] (3) is below"),
            std::string::npos);
  EXPECT_NE(validateCuSeqlens(offStart.data(), 2, 8).error().message.find("cu_seqlens[0] (1) must be 0"),
            std::string::npos);
  EXPECT_NE(validateCuSeqlens(short_.data(), 2, 8).error().message.find("tokens packed (8)"), std::string::npos);
  EXPECT_TRUE(validateCuSeqlens(decreasing.data(), 2, 5));
}

}  // namespace
}  // namespace loom
