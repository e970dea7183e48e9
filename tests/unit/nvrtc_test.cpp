// Every generated CUDA program must compile under NVRTC on any machine, GPU
// or not: for a set of specs and their default schedules, on sm_80, sm_86,
// sm_89 and sm_90, with no spills and with tensor-core and cp.async
// instructions in the PTX.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "api/compile.h"
#include "jit/nvrtc_compiler.h"
#include "loom/compiler.h"
#include "test_util.h"

namespace loom {
namespace {

KernelSpec makeSpec(int H, int G, int P, int d, v1::MaskMode mask, int window, v1::CollapseMode collapse, double rope,
                    v1::DType dtype) {
  return testing::makeSpec({.heads = H, .kvHeads = G, .pseudoHeads = P, .headDim = d, .dtype = dtype, .mask = mask,
                            .window = window, .collapse = collapse, .ropeTheta = rope});
}

struct Named {
  std::string name;
  KernelSpec spec;
};

// Specs of public model families (docs/porting.md): nanochat-style (qk_norm
// with the dtype's epsilon, RoPE turned the other way, a window in whole
// tokens, q and k scaled by 1.2) and speedrun-style (qk_norm, a window in
// virtual rows off a multiple of P, GQA).
KernelSpec nanochatSpec() {
  KernelSpec spec = makeSpec(8, 8, 4, 128, v1::flat_causal, 256, v1::global, 10000, v1::bfloat16);
  spec.set_qk_norm(v1::KernelSpec::rms);
  spec.set_qk_norm_eps(0.0078125);
  spec.set_rope_direction(v1::KernelSpec::negative);
  spec.set_window_align(v1::KernelSpec::token);
  spec.set_scale(1.44 / std::sqrt(128.0));
  return spec;
}
KernelSpec speedrunSpec() {
  KernelSpec spec = makeSpec(8, 2, 2, 64, v1::flat_causal, 0, v1::per_head, 10000, v1::float16);
  spec.set_qk_norm(v1::KernelSpec::rms);
  spec.set_rope_direction(v1::KernelSpec::negative);
  spec.set_window_rows(385);
  return spec;
}

std::vector<Named> specs() {
  return {{"h8p8_d64_bf16_rope", makeSpec(8, 8, 8, 64, v1::flat_causal, 0, v1::per_head, 10000, v1::bfloat16)},
          {"gqa_p4_d128_fp16_window", makeSpec(8, 2, 4, 128, v1::flat_causal, 64, v1::per_head, 500000, v1::float16)},
          {"token_global_p2_d64", makeSpec(4, 4, 2, 64, v1::token_causal, 16, v1::global, 0, v1::float16)},
          {"mha_none_p1_d32", makeSpec(4, 4, 1, 32, v1::none, 0, v1::per_head, 0, v1::bfloat16)},
          {"nanochat_options", nanochatSpec()},
          {"speedrun_options", speedrunSpec()}};
}
constexpr int kPlainSpecs = 4;

const std::vector<std::string> kArchs = {"sm_80", "sm_86", "sm_89", "sm_90"};

class NvrtcCompiles : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(NvrtcCompiles, WithoutSpillsUsingTensorCoresAndAsyncCopies) {
  const Named named = specs()[size_t(std::get<0>(GetParam()))];
  const std::string arch = std::get<1>(GetParam());
  auto target = parseTarget(arch);
  ASSERT_TRUE(target);
  jit::NvrtcCompiler compiler("");
  std::shared_ptr<const jit::Artifact> artifact;
  auto kernel = compileKernel(named.spec, Schedule(), *target, compiler, &artifact);
  ASSERT_TRUE(kernel) << kernel.error().message << "\n" << kernel.error().log;
  EXPECT_EQ(artifact->binaryKind, "cubin");
  EXPECT_FALSE(artifact->binary.empty());
  EXPECT_TRUE(artifact->usesTensorCores()) << "no mma in the PTX";
  EXPECT_TRUE(artifact->usesAsyncCopies()) << "no cp.async in the PTX";
  ASSERT_FALSE(artifact->resources.empty()) << artifact->log;
  for (const auto& usage : artifact->resources) {
    EXPECT_EQ(usage.spill_store_bytes() + usage.spill_load_bytes(), 0) << usage.ShortDebugString();
    EXPECT_EQ(usage.stack_frame_bytes(), 0) << "fragments left registers: " << usage.ShortDebugString();
    EXPECT_GT(usage.registers(), 0);
  }
  std::printf("[ nvrtc    ] %s %s: %.2f s, %s\n", named.name.c_str(), arch.c_str(), artifact->compileSeconds,
              kernel->schedule().ShortDebugString().c_str());
}

auto nameOf = [](const auto& info) {
  return specs()[size_t(std::get<0>(info.param))].name + "_" + std::get<1>(info.param);
};

INSTANTIATE_TEST_SUITE_P(Specs, NvrtcCompiles,
                         ::testing::Combine(::testing::Range(0, kPlainSpecs), ::testing::ValuesIn(kArchs)), nameOf);
// The options (qk_norm in every mixing path, the other RoPE direction, the
// new window rules) on the first and the newest portable arch.
INSTANTIATE_TEST_SUITE_P(Options, NvrtcCompiles,
                         ::testing::Combine(::testing::Range(kPlainSpecs, int(specs().size())),
                                            ::testing::Values("sm_80", "sm_90")),
                         nameOf);

// The sm_90a path (engine wgmma, tile/include/loom/tile/hopper.h): every spec whose
// head_dim allows it gets it by default on sm_90a, under both mixing
// strategies. Zero spills and no stack frame; the PTX holds wgmma, the
// tensor memory accelerator (when it loads the mixed workspaces) and the
// register hand-over; ptxas warns of nothing (it warns when it serialises
// wgmma or ignores setmaxnreg).
class HopperCompiles : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(HopperCompiles, WithWgmmaTmaAndSetmaxnregWithoutSpills) {
  const Named named = specs()[size_t(std::get<0>(GetParam()))];
  const std::string mix = std::get<1>(GetParam());
  Schedule schedule;
  schedule.set_mix(mix == "fused" ? v1::mix_fused : v1::mix_materialized);
  jit::NvrtcCompiler compiler("");
  std::shared_ptr<const jit::Artifact> artifact;
  auto kernel = compileKernel(named.spec, schedule, *parseTarget("sm_90a"), compiler, &artifact);
  ASSERT_TRUE(kernel) << kernel.error().message << "\n" << kernel.error().log;
  EXPECT_EQ(kernel->schedule().engine(), v1::engine_wgmma);
  EXPECT_EQ(artifact->binaryKind, "cubin");
  EXPECT_TRUE(artifact->usesWgmma()) << "no wgmma.mma_async in the PTX";
  EXPECT_TRUE(artifact->usesSetmaxnreg()) << "no setmaxnreg in the PTX";
  EXPECT_NE(artifact->ptx.find("mbarrier.try_wait"), std::string::npos);
  if (mix == "fused") {
    EXPECT_NE(artifact->ptx.find("fence.proxy.async"), std::string::npos) << "mixed tiles unfenced";
  } else {
    EXPECT_TRUE(artifact->usesTma()) << "no cp.async.bulk.tensor in the PTX";
  }
  EXPECT_TRUE(artifact->warnings().empty()) << artifact->log;
  bool attention = false;
  for (const auto& usage : artifact->resources) {
    EXPECT_EQ(usage.spill_store_bytes() + usage.spill_load_bytes(), 0) << usage.ShortDebugString();
    EXPECT_EQ(usage.stack_frame_bytes(), 0) << usage.ShortDebugString();
    attention |= usage.entry() == "iha_attention";
  }
  EXPECT_TRUE(attention) << artifact->log;
  for (const v1::EntryPoint& entry : kernel->entries())
    if (entry.name() == "iha_attention") {
      EXPECT_TRUE(entry.warp_specialized());
      EXPECT_TRUE(entry.tensor_maps());
      EXPECT_EQ(entry.threads(), (kernel->schedule().warps() + 4) * 32);
    }
  std::printf("[ nvrtc    ] %s sm_90a %s: %.2f s, %s\n", named.name.c_str(), mix.c_str(), artifact->compileSeconds,
              kernel->schedule().ShortDebugString().c_str());
}

INSTANTIATE_TEST_SUITE_P(Specs, HopperCompiles,
                         ::testing::Combine(::testing::Values(0, 1, 2, 4, 5), ::testing::Values("materialized", "fused")),
                         nameOf);

// Where wgmma cannot serve a spec (d = 32) sm_90a keeps the portable path;
// asking for wgmma elsewhere than sm_90a is refused with the reason.
TEST(Nvrtc, HopperFallsBackAndRefusesWhereWgmmaCannotRun) {
  jit::NvrtcCompiler compiler("");
  auto portable = compileKernel(specs()[3].spec, Schedule(), *parseTarget("sm_90a"), compiler);
  ASSERT_TRUE(portable) << portable.error().message;
  EXPECT_EQ(portable->schedule().engine(), v1::engine_mma);
  Schedule wgmma;
  wgmma.set_engine(v1::engine_wgmma);
  auto refused = generateKernel(specs()[0].spec, wgmma, *parseTarget("sm_90"));
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("needs target sm_90a"), std::string::npos) << refused.error().message;
  auto tooSmall = generateKernel(specs()[3].spec, wgmma, *parseTarget("sm_90a"));
  ASSERT_FALSE(tooSmall);
  EXPECT_NE(tooSmall.error().message.find("head_dim"), std::string::npos) << tooSmall.error().message;
}

// The materialised path: pre-mix, attention from workspaces, separate collapse.
TEST(Nvrtc, MaterializedScheduleCompiles) {
  Schedule schedule;
  schedule.set_mix(v1::mix_materialized);
  schedule.set_collapse(v1::collapse_separate);
  schedule.set_stages(3);
  jit::NvrtcCompiler compiler("");
  std::shared_ptr<const jit::Artifact> artifact;
  auto kernel = compileKernel(specs()[0].spec, schedule, *parseTarget("sm_80"), compiler, &artifact);
  ASSERT_TRUE(kernel) << kernel.error().message << "\n" << kernel.error().log;
  ASSERT_EQ(kernel->entries_size(), 3);
  EXPECT_TRUE(artifact->usesAsyncCopies());
  EXPECT_EQ(artifact->spillBytes(), 0);
}

TEST(Nvrtc, FailuresCarryTheLog) {
  jit::NvrtcCompiler compiler("");
  auto result = compiler.compile("#include \"loom/tile/cuda.h\"\nthis is not CUDA;\n", "sm_80");
  ASSERT_FALSE(result);
  EXPECT_NE(result.error().message.find("NVRTC failed"), std::string::npos);
  EXPECT_NE(result.error().log.find("error"), std::string::npos) << result.error().log;
}

// The bulk reduction's leaves (loom/tile/ptx.h: cp.reduce.async.bulk add.f32,
// cp.async.bulk.commit_group and wait_group{.read}) assemble for sm_90a, as
// the emulator runs them (EmuIsa.BulkReductions...).
TEST(Nvrtc, BulkReductionsAssembleForHopper) {
  jit::NvrtcCompiler compiler("");
  const std::string source = R"(#include "loom/tile/ptx.h"
extern "C" __global__ void add_rows(float* g) {
  extern __shared__ __align__(128) unsigned char smem[];
  reinterpret_cast<float*>(smem)[threadIdx.x] = float(threadIdx.x);
  loom::ptx::fenceProxyAsync();
  __syncthreads();
  if (threadIdx.x == 0) {
    loom::ptx::bulkReduceAddF32(g, loom::Bits32(__cvta_generic_to_shared(smem)), 512);
    loom::ptx::bulkCommit();
    loom::ptx::bulkWaitRead<0>();
    loom::ptx::bulkWait<0>();
  }
}
)";
  auto result = compiler.compile(source, "sm_90a");
  ASSERT_TRUE(result) << result.error().message << "\n" << result.error().log;
}

TEST(Nvrtc, ArtifactsAreCachedInMemoryAndOnDisk) {
  testing::TempDir cache;
  auto plan = generateKernel(specs()[3].spec, Schedule(), *parseTarget("sm_80"));
  ASSERT_TRUE(plan);
  jit::NvrtcCompiler first(cache.path());
  auto a = first.compile(plan->source, "sm_80");
  ASSERT_TRUE(a) << a.error().log;
  EXPECT_FALSE((*a)->fromCache);
  auto again = first.compile(plan->source, "sm_80");
  ASSERT_TRUE(again);
  EXPECT_EQ(a->get(), again->get());  // the same in-memory artifact
  jit::NvrtcCompiler second(cache.path());
  auto b = second.compile(plan->source, "sm_80");
  ASSERT_TRUE(b);
  EXPECT_TRUE((*b)->fromCache);
  EXPECT_EQ((*b)->binary, (*a)->binary);
  EXPECT_EQ((*b)->resources.size(), (*a)->resources.size());
  auto otherArch = second.compile(plan->source, "sm_86");
  ASSERT_TRUE(otherArch);
  EXPECT_FALSE((*otherArch)->fromCache);
}

TEST(Nvrtc, CompilesInParallel) {
  jit::NvrtcCompiler compiler("");
  std::vector<std::string> sources;
  for (int window : {0, 8, 32}) {
    KernelSpec spec = specs()[3].spec;
    spec.set_window(window);
    auto plan = generateKernel(spec, Schedule(), *parseTarget("sm_86"));
    ASSERT_TRUE(plan);
    sources.push_back(plan->source);
  }
  std::vector<std::thread> threads;
  std::vector<bool> ok(sources.size(), false);
  for (size_t i = 0; i < sources.size(); ++i)
    threads.emplace_back([&, i] { ok[i] = compiler.compile(sources[i], "sm_86").ok(); });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < ok.size(); ++i) EXPECT_TRUE(ok[i]) << i;
}

// The backward plan (loom/tile/cuda_backward.h) for every spec, on sm_80 and
// sm_90a (which runs the portable tiles for the backward), dq in its own
// launch on one arch and by atomic adds on the other (alternating by spec):
// every entry point compiles to a cubin with zero spills and no stack frame,
// and the PTX holds the tensor-core products, the asynchronous copies and,
// for dq atomic, red.global.add.f32 instead of a dq launch.
class BackwardCompiles : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(BackwardCompiles, WithoutSpillsUsingTensorCores) {
  const Named named = specs()[size_t(std::get<0>(GetParam()))];
  const std::string arch = std::get<1>(GetParam());
  const bool atomic = (std::get<0>(GetParam()) + (arch == "sm_90a")) % 2 == 1;
  Schedule schedule;
  if (atomic) schedule.set_dq(v1::dq_atomic);
  jit::NvrtcCompiler compiler("");
  std::shared_ptr<const jit::Artifact> artifact;
  auto kernel = compileKernel(named.spec, schedule, *parseTarget(arch), compiler, &artifact, Direction::backward);
  ASSERT_TRUE(kernel) << kernel.error().message << "\n" << kernel.error().log;
  EXPECT_EQ(kernel->direction(), v1::direction_backward);
  EXPECT_EQ(artifact->binaryKind, "cubin");
  EXPECT_TRUE(artifact->usesTensorCores()) << "no mma in the PTX";
  EXPECT_TRUE(artifact->usesAsyncCopies()) << "no cp.async in the PTX";
  std::set<std::string> entries;
  for (const auto& usage : artifact->resources) {
    entries.insert(usage.entry());
    EXPECT_EQ(usage.spill_store_bytes() + usage.spill_load_bytes(), 0) << usage.ShortDebugString();
    EXPECT_EQ(usage.stack_frame_bytes(), 0) << usage.ShortDebugString();
    std::printf("[ nvrtc    ] backward %s %s dq %s %s: %d registers\n", named.name.c_str(), arch.c_str(),
                atomic ? "atomic" : "separate", usage.entry().c_str(), usage.registers());
  }
  for (const char* entry : {kBackwardPrepEntry, kBackwardKvEntry, kBackwardUnmixEntry, kBackwardReduceEntry,
                            kAttentionEntry})
    EXPECT_TRUE(entries.count(entry)) << entry << " missing from the ptxas report";
  EXPECT_EQ(entries.count(kBackwardQEntry), atomic ? 0u : 1u);
  EXPECT_EQ(artifact->ptx.find("red.global.add.f32") != std::string::npos, atomic);
}

INSTANTIATE_TEST_SUITE_P(Specs, BackwardCompiles,
                         ::testing::Combine(::testing::Range(0, int(specs().size())), ::testing::Values("sm_80", "sm_90a")),
                         nameOf);

TEST(Nvrtc, ParsesThePtxasReport) {
  const std::string log =
      "ptxas info    : Compiling entry function 'iha_attention' for 'sm_80'\n"
      "ptxas info    : Function properties for iha_attention\n"
      "    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
      "ptxas info    : Used 168 registers, used 1 barriers, 384 bytes cmem[0]\n"
      "ptxas info    : Function properties for iha_collapse\n"
      "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 32 registers, 2048 bytes smem, 384 bytes cmem[0]\n";
  const auto usage = jit::parsePtxasReport(log);
  ASSERT_EQ(usage.size(), 2u);
  EXPECT_EQ(usage[0].entry(), "iha_attention");
  EXPECT_EQ(usage[0].registers(), 168);
  EXPECT_EQ(usage[0].spill_store_bytes(), 8);
  EXPECT_EQ(usage[0].spill_load_bytes(), 12);
  EXPECT_EQ(usage[0].stack_frame_bytes(), 16);
  EXPECT_EQ(usage[1].shared_memory_bytes(), 2048);
}

TEST(Nvrtc, Float32IsRejectedForCudaWithAHint) {
  KernelSpec spec = specs()[3].spec;
  spec.set_dtype(v1::float32);
  auto plan = generateKernel(spec, Schedule(), *parseTarget("sm_80"));
  ASSERT_FALSE(plan);
  EXPECT_NE(plan.error().message.find("float32 is not supported on CUDA targets"), std::string::npos);
}

}  // namespace
}  // namespace loom
