// `loom run` and `loom draw` as a user calls them: exit codes and messages.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "cuda/driver.h"
#include "io/case.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::runLoom;
using testing::TempDir;

class CliRun : public ::testing::Test {
 protected:
  // A fresh random case, valid until a test breaks one part of it.
  void SetUp() override {
    std::mt19937_64 rng(testing::testSeed());
    spec_ = testing::randomSpec(rng);
    spec_.set_rope_theta(10000.0);
    IhaCase c = drawCase(spec_, 1, 5, rng());
    c.expected = reference::ihaForward(c.spec, c.inputs).out;
    ASSERT_TRUE(writeCase(caseDir(), c));
  }

  std::string caseDir() const { return dir_ / "case"; }
  testing::CommandResult run() const {
    return runLoom("run --case " + caseDir() + " --backend reference --out " + (dir_ / "out.npy"));
  }
  void writeSpec(const std::string& json) const { std::ofstream(caseDir() + "/spec.json") << json; }
  void expectBadInput(const std::string& fragment) const {
    const auto result = run();
    EXPECT_EQ(result.exitCode, 2) << result.output;
    EXPECT_NE(result.output.find(fragment), std::string::npos) << result.output;
    EXPECT_EQ(std::count(result.output.begin(), result.output.end(), '\n'), 1) << "one line: " << result.output;
  }

  TempDir dir_;
  KernelSpec spec_;
};

TEST_F(CliRun, PassesAndWritesTheOutput) {
  const auto result = run();
  EXPECT_EQ(result.exitCode, 0) << result.output;
  EXPECT_NE(result.output.find("ok"), std::string::npos);
  auto out = readNpy(dir_ / "out.npy");
  ASSERT_TRUE(out) << out.error().message;
  EXPECT_EQ(out->type, NpyType::float32);
  EXPECT_EQ(out->shape, (std::vector<int64_t>{1, 5, spec_.heads(), spec_.head_dim()}));
}

TEST_F(CliRun, OutDtypeChoosesTheFileType) {
  const auto result = runLoom("run --case " + caseDir() + " --out " + (dir_ / "o16.npy") + " --out-dtype bfloat16");
  EXPECT_EQ(result.exitCode, 0) << result.output;
  auto out = readNpy(dir_ / "o16.npy");
  ASSERT_TRUE(out);
  EXPECT_EQ(out->type, NpyType::uint16);
}

TEST_F(CliRun, WrongExpectedFailsTheCheck) {
  auto c = loadCase(caseDir());
  ASSERT_TRUE(c);
  std::vector<double> wrong = *c->expected;
  wrong[wrong.size() / 2] += 1.0;
  ASSERT_TRUE(writeNpy(caseDir() + "/expected.npy",
                       npyFromDouble(wrong, {1, 5, spec_.heads(), spec_.head_dim()}, NpyType::float64)));
  const auto result = run();
  EXPECT_EQ(result.exitCode, 1) << result.output;
  EXPECT_NE(result.output.find("FAILED"), std::string::npos);
}

TEST_F(CliRun, MissingFile) {
  fs::remove(caseDir() + "/v.npy");
  expectBadInput("v.npy: cannot open file");
}

TEST_F(CliRun, MalformedNpy) {
  std::ofstream(caseDir() + "/alpha_k.npy") << "\x93NUMPY garbage";
  expectBadInput("alpha_k.npy: malformed .npy");
}

TEST_F(CliRun, ShapesThatDisagree) {
  ASSERT_TRUE(writeNpy(caseDir() + "/k.npy",
                       npyFromDouble(std::vector<double>(2 * 5 * spec_.kv_heads() * spec_.head_dim(), 0.5),
                                     {2, 5, spec_.kv_heads(), spec_.head_dim()}, NpyType::float32)));
  expectBadInput("k.npy: shape [2, 5,");
}

TEST_F(CliRun, KvHeadsNotDividingHeads) {
  writeSpec(R"({"heads": 4, "kv_heads": 3, "pseudo_heads": 2, "head_dim": 8, "mask": "flat_causal",
                "window": 0, "collapse": "per_head", "rope_theta": 0, "dtype": "float32"})");
  expectBadInput("kv_heads (3) must divide heads (4)");
}

TEST_F(CliRun, OddHeadDimWithRope) {
  writeSpec(R"({"heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 7, "mask": "flat_causal",
                "window": 0, "collapse": "per_head", "rope_theta": 10000, "dtype": "float32"})");
  expectBadInput("head_dim (7) must be even when rope_theta > 0");
}

// Each option of public IHA code is refused where it changes nothing, with
// the field named; a misspelt value is refused by the JSON reader.
TEST_F(CliRun, OptionsWhereTheyMeanNothing) {
  const std::string base = R"("heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 8, "collapse": "per_head",
                              "dtype": "float32", )";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("mask": "flat_causal", "window": 0, "rope_theta": 0, "qk_norm_eps": 1e-5)",
       "qk_norm_eps is set but qk_norm is none"},
      {R"("mask": "flat_causal", "window": 0, "rope_theta": 0, "qk_norm": "rms", "qk_norm_eps": -1)",
       "qk_norm_eps must be positive"},
      {R"("mask": "flat_causal", "window": 0, "rope_theta": 0, "rope_direction": "negative")",
       "rope_direction negative needs rotary embedding"},
      {R"("mask": "none", "window": 0, "rope_theta": 0, "window_align": "token")",
       "window_align token needs a window"},
      {R"("mask": "token_causal", "window": 0, "rope_theta": 0, "window_rows": 5)",
       "window_rows counts a flat_causal window in virtual rows; mask is token_causal"},
      {R"("mask": "flat_causal", "window": 2, "rope_theta": 0, "window_rows": 5)",
       "window_rows (5) and window (2) both set a window"},
      {R"("mask": "flat_causal", "window": 0, "rope_theta": 0, "qk_norm": "l2")", "qk_norm"},
  };
  for (const auto& [fields, fragment] : cases) {
    SCOPED_TRACE(fields);
    writeSpec("{" + base + fields + "}");
    expectBadInput(fragment);
  }
}

TEST_F(CliRun, NanInInputs) {
  auto q = readNpy(caseDir() + "/q.npy");
  ASSERT_TRUE(q);
  std::vector<double> values = npyToDouble(*q);
  values[3] = std::nan("");
  ASSERT_TRUE(writeNpy(caseDir() + "/q.npy", npyFromDouble(values, q->shape, q->type)));
  expectBadInput("q.npy: element 3 is NaN");
}

TEST_F(CliRun, InfInInputs) {
  auto v = readNpy(caseDir() + "/v.npy");
  ASSERT_TRUE(v);
  std::vector<double> values = npyToDouble(*v);
  values[0] = -INFINITY;
  ASSERT_TRUE(writeNpy(caseDir() + "/v.npy", npyFromDouble(values, v->shape, v->type)));
  expectBadInput("v.npy: element 0 is Inf");
}

TEST_F(CliRun, UnknownMaskName) {
  writeSpec(R"({"heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 8, "mask": "causal",
                "window": 0, "collapse": "per_head", "rope_theta": 0, "dtype": "float32"})");
  expectBadInput("mask");
}

TEST_F(CliRun, UnknownCollapseName) {
  writeSpec(R"({"heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 8, "mask": "none",
                "window": 0, "collapse": "sum", "rope_theta": 0, "dtype": "float32"})");
  expectBadInput("collapse");
}

TEST_F(CliRun, NegativeWindow) {
  writeSpec(R"({"heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 8, "mask": "none",
                "window": -1, "collapse": "per_head", "rope_theta": 0, "dtype": "float32"})");
  expectBadInput("window (-1) must not be negative");
}

TEST_F(CliRun, MissingCaseFolder) {
  const auto result = runLoom("run --case " + (dir_ / "nowhere"));
  EXPECT_EQ(result.exitCode, 2);
  EXPECT_NE(result.output.find("not a case folder"), std::string::npos) << result.output;
}

TEST(Cli, UnknownBackendAndHelp) {
  const auto bad = runLoom("run --case x --backend quantum");
  EXPECT_EQ(bad.exitCode, 2) << bad.output;
  EXPECT_NE(bad.output.find("quantum"), std::string::npos) << bad.output;
  const auto help = runLoom("run --help");
  EXPECT_EQ(help.exitCode, 0);
  EXPECT_NE(help.output.find("--backend"), std::string::npos);
}

TEST(Cli, EverySharedCasePasses) {
  TempDir dir;
  for (const std::string& name : testing::sharedCaseNames()) {
    const auto result = runLoom("run --case " + testing::casesDir() + "/" + name + " --out " + (dir / "out.npy"));
    EXPECT_EQ(result.exitCode, 0) << name << ": " << result.output;
  }
}

// New cases drawn with other seeds and shapes, through the CLI end to end.
TEST(Cli, DrawnCasesPass) {
  TempDir dir;
  std::mt19937_64 rng(testing::testSeed());
  for (int trial = 0; trial < 3; ++trial) {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_dtype(trial == 1 ? v1::float16 : trial == 2 ? v1::bfloat16 : v1::float32);
    std::ofstream(dir / "spec.json") << toJson(spec);
    const std::string caseDir = dir / ("drawn" + std::to_string(trial));
    const auto drawn = runLoom("draw --spec " + (dir / "spec.json") + " --out " + caseDir + " --tokens " +
                               std::to_string(3 + rng() % 6) + " --seed " + std::to_string(rng()));
    ASSERT_EQ(drawn.exitCode, 0) << drawn.output;
    const auto result = runLoom("run --case " + caseDir + " --out " + (dir / "out.npy"));
    EXPECT_EQ(result.exitCode, 0) << spec.ShortDebugString() << ": " << result.output;
  }
}

std::string cpuFlags() { return std::string(" --backend cpu --cache-dir ") + LOOM_TEST_CACHE; }

// The generated program on the host, with the default schedule and another
// one from a file, for every shared case.
TEST(Cli, EverySharedCasePassesOnCpu) {
  TempDir dir;
  std::ofstream(dir / "schedule.json") << R"({"block_n": 16, "stages": 3, "mix": "mix_materialized"})";
  for (const std::string& name : testing::sharedCaseNames()) {
    for (const std::string& schedule : {std::string(), " --schedule " + (dir / "schedule.json")}) {
      const auto result =
          runLoom("run --case " + testing::casesDir() + "/" + name + cpuFlags() + schedule + " --out " + (dir / "o.npy"));
      EXPECT_EQ(result.exitCode, 0) << name << schedule << ": " << result.output;
      EXPECT_NE(result.output.find("key blocks visited"), std::string::npos) << result.output;
    }
  }
}

TEST(Cli, DrawnCasesPassOnCpu) {
  TempDir dir;
  std::mt19937_64 rng(testing::testSeed() + 11);
  for (int trial = 0; trial < 3; ++trial) {
    KernelSpec spec = testing::randomSpec(rng);
    spec.set_head_dim(8 * (1 + int(rng() % 3)));
    std::ofstream(dir / "spec.json") << toJson(spec);
    const std::string caseDir = dir / ("drawn" + std::to_string(trial));
    ASSERT_EQ(runLoom("draw --spec " + (dir / "spec.json") + " --out " + caseDir + " --batch 2 --tokens " +
                      std::to_string(5 + rng() % 30) + " --seed " + std::to_string(rng()))
                  .exitCode,
              0);
    const auto result = runLoom("run --case " + caseDir + cpuFlags() + " --out " + (dir / "o.npy"));
    EXPECT_EQ(result.exitCode, 0) << spec.ShortDebugString() << ": " << result.output;
  }
}

TEST(Cli, BadScheduleNamesTheField) {
  TempDir dir;
  std::ofstream(dir / "schedule.json") << R"({"block_m": 20})";
  const auto result = runLoom("run --case " + testing::casesDir() + "/h8p8-d64-fp16" + cpuFlags() + " --schedule " +
                              (dir / "schedule.json"));
  EXPECT_EQ(result.exitCode, 2) << result.output;
  EXPECT_NE(result.output.find("schedule.block_m (20) must be a multiple of 16 rows per warp x 1 warps"),
            std::string::npos)
      << result.output;
}

TEST(Cli, GenPrintsDeterministicSource) {
  TempDir dir;
  std::ofstream(dir / "spec.json") << R"({"heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 16,
      "mask": "token_causal", "window": 3, "collapse": "per_head", "rope_theta": 0, "dtype": "float16"})";
  const auto first = runLoom("gen --spec " + (dir / "spec.json") + " --target sm_80");
  const auto second = runLoom("gen --spec " + (dir / "spec.json") + " --target sm_80");
  EXPECT_EQ(first.exitCode, 0) << first.output;
  EXPECT_EQ(first.output, second.output);
  EXPECT_NE(first.output.find("LOOM_KERNEL void iha_attention"), std::string::npos);
  const auto bad = runLoom("gen --spec " + (dir / "spec.json") + " --target gpu");
  EXPECT_EQ(bad.exitCode, 2);
  EXPECT_NE(bad.output.find("target 'gpu'"), std::string::npos) << bad.output;
}

TEST(Cli, CompileReportsResourcesAsJson) {
  const auto result = runLoom("compile --spec " + testing::casesDir() + "/gqa-rope/spec.json --dtype bfloat16 --target sm_80 --json");
  ASSERT_EQ(result.exitCode, 0) << result.output;
  EXPECT_NE(result.output.find("\"uses_tensor_cores\": true"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("\"uses_async_copies\": true"), std::string::npos);
  EXPECT_NE(result.output.find("\"spill_bytes\": 0"), std::string::npos);
  EXPECT_NE(result.output.find("\"registers\""), std::string::npos);
  EXPECT_NE(result.output.find("\"compile_seconds\""), std::string::npos);

  // sm_90a: the wgmma path, its instructions named in the report.
  const auto hopper =
      runLoom("compile --spec " + testing::casesDir() + "/gqa-rope/spec.json --dtype bfloat16 --target sm_90a --json");
  ASSERT_EQ(hopper.exitCode, 0) << hopper.output;
  for (const char* expected : {"\"uses_wgmma\": true", "\"uses_tma\": true", "\"uses_setmaxnreg\": true",
                               "\"engine\": \"engine_wgmma\"", "\"spill_bytes\": 0", "\"warnings\": []"})
    EXPECT_NE(hopper.output.find(expected), std::string::npos) << expected << "\n" << hopper.output;

  const auto fp32 = runLoom("compile --spec " + testing::casesDir() + "/gqa-rope/spec.json --target sm_80");
  EXPECT_EQ(fp32.exitCode, 2);
  EXPECT_NE(fp32.output.find("float32 is not supported on CUDA targets"), std::string::npos) << fp32.output;
}

// loom compile --sass on two shared cases: each sm_90a attention loop's
// figures, within the gate; the JSON report carries them too; loom sass
// reads the listing --sass-listing saved.
TEST(Cli, CompileReadsTheMachineCode) {
  TempDir dir;
  for (const char* name : {"gqa-rope", "h8p8-d64-fp16"}) {
    const auto result = runLoom("compile --spec " + testing::casesDir() + "/" + name +
                                "/spec.json --dtype bfloat16 --target sm_90a --sass --sass-listing " + (dir / "k.sass"));
    ASSERT_EQ(result.exitCode, 0) << result.output;
    for (const char* expected : {"SASS (nvdisasm", "iha_attention: ", "tensor-core loop", "per tensor MFLOP",
                                 "MUFU.EX2 in the P V window: ", "(ping-pong)", "within the gate", "setmaxnreg"})
      EXPECT_NE(result.output.find(expected), std::string::npos) << name << ": " << expected << "\n" << result.output;
    EXPECT_EQ(result.output.find("misses the gate"), std::string::npos) << result.output;
    const auto listing = runLoom("sass --listing " + (dir / "k.sass") + " --function iha_attention");
    ASSERT_EQ(listing.exitCode, 0) << listing.output;
    EXPECT_NE(listing.output.find("per tensor MFLOP"), std::string::npos) << listing.output;
  }
  const auto json = runLoom("compile --spec " + testing::casesDir() +
                            "/gqa-rope/spec.json --dtype bfloat16 --target sm_90a --json");
  ASSERT_EQ(json.exitCode, 0) << json.output;
  for (const char* expected : {"\"sass\"", "\"instructions_per_tensor_mflop\"", "\"exponentials_in_pv_window\"",
                               "\"ping_pong\": true"})
    EXPECT_NE(json.output.find(expected), std::string::npos) << expected << "\n" << json.output;
  const auto missing = runLoom("sass " + (dir / "nothing.cubin"));
  EXPECT_EQ(missing.exitCode, 2);
}

// loom compile --backward --sass on the paper's spec (H 16, P 4, head_dim
// 128, causal): the wgmma backward's loops against FlashAttention-3's
// backward loop (docs/performance.md), the dq launch warp-specialised (a
// producer warpgroup, setmaxnreg), and both launches' loops within it.
TEST(Cli, CompileHoldsTheBackwardToFlashAttention3sLoop) {
  TempDir dir;
  std::ofstream(dir / "spec.json") << R"({"heads": 16, "kv_heads": 16, "pseudo_heads": 4, "head_dim": 128,
    "dtype": "bfloat16", "mask": "flat_causal", "rope_theta": 10000, "collapse": "global"})";
  const auto result = runLoom("compile --spec " + (dir / "spec.json") + " --target sm_90a --backward --sass");
  ASSERT_EQ(result.exitCode, 0) << result.output;
  for (const char* expected : {"iha_bwd_kv: ", "iha_bwd_q: ", "setmaxnreg inc 232 dec 24",
                               "FlashAttention-3's backward loop", "performance losses: none"})
    EXPECT_NE(result.output.find(expected), std::string::npos) << expected << "\n" << result.output;
  EXPECT_EQ(result.output.find("misses the gate"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("within the gate"), std::string::npos) << result.output;
}

// With no driver the CUDA backend says so and what to use instead; with a
// GPU it must pass.
TEST(Cli, CudaBackendRunsOrSaysThereIsNoGpu) {
  TempDir dir;
  const auto result = runLoom("run --case " + testing::casesDir() + "/token-global --backend cuda --dtype float16 --out " +
                              (dir / "o.npy") + " --cache-dir " + LOOM_TEST_CACHE);
  if (result.output.find("no CUDA driver") != std::string::npos) {
    EXPECT_EQ(result.exitCode, 2);
    EXPECT_NE(result.output.find("--backend cpu"), std::string::npos);
  } else {
    EXPECT_EQ(result.exitCode, 0) << result.output;
  }
}

// Without a GPU, loom tune ranks with the cost model and says so.
TEST(Cli, TuneOfflineIsMarkedUntimed) {
  TempDir dir;
  std::ofstream(dir / "spec.json") << R"({"heads": 4, "kv_heads": 4, "pseudo_heads": 2, "head_dim": 32,
      "mask": "flat_causal", "window": 8, "collapse": "per_head", "rope_theta": 10000, "dtype": "bfloat16"})";
  if (cuda::driver().ok())
    GTEST_SKIP() << "a GPU is present: loom tune measures instead (covered by tests/gpu)";
  const auto noTarget = runLoom("tune --spec " + (dir / "spec.json"));
  EXPECT_EQ(noTarget.exitCode, 2);
  EXPECT_NE(noTarget.output.find("--target"), std::string::npos) << noTarget.output;

  const auto result = runLoom("tune --spec " + (dir / "spec.json") + " --target sm_80 --tokens 256 --compile-top 3 --out " +
                              (dir / "tuned.json") + " --bundles " + (dir / "bundles") + " --cache-dir " + LOOM_TEST_CACHE);
  ASSERT_EQ(result.exitCode, 0) << result.output;
  EXPECT_NE(result.output.find("UNTIMED"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("winner bm"), std::string::npos);
  // The decision (and the winner's kernel) landed in the cache.
  const auto listed = runLoom(std::string("cache --path ") + LOOM_TEST_CACHE + "/kernels.sqlite ls");
  EXPECT_EQ(listed.exitCode, 0) << listed.output;
  EXPECT_NE(listed.output.find("decision"), std::string::npos) << listed.output;
  EXPECT_NE(listed.output.find("untimed"), std::string::npos) << listed.output;
  EXPECT_NE(listed.output.find("artifact"), std::string::npos) << listed.output;
  auto saved = readTextFile(dir / "tuned.json");
  ASSERT_TRUE(saved);
  EXPECT_NE(saved->find("\"candidates\""), std::string::npos);
  EXPECT_EQ(saved->find("\"measured\": true"), std::string::npos);
  int bundles = 0;
  for (const auto& entry : fs::directory_iterator(dir / "bundles")) bundles += entry.path().extension() == ".pb";
  EXPECT_EQ(bundles, 3);
}

TEST(Cli, CpuBackendTakesADtype) {
  TempDir dir;
  const auto result = runLoom("run --case " + testing::casesDir() + "/gqa-rope" + cpuFlags() + " --dtype bfloat16 --out " +
                              (dir / "o.npy"));
  EXPECT_EQ(result.exitCode, 0) << result.output;
  EXPECT_NE(result.output.find("tolerance 1e-02 for bfloat16"), std::string::npos) << result.output;
}

//===--- loom run --backward ---------------------------------------------===//

std::vector<std::string> backwardCases() {
  std::vector<std::string> names;
  for (const std::string& name : testing::sharedCaseNames())
    if (name.rfind("bwd-", 0) == 0) names.push_back(name);
  return names;
}

// Every shared backward case: seven gradients checked and written, float64,
// each shaped as its input.
TEST(Cli, BackwardOnEverySharedBackwardCase) {
  ASSERT_FALSE(backwardCases().empty());
  for (const std::string& name : backwardCases()) {
    TempDir dir;
    const std::string caseDir = testing::casesDir() + "/" + name;
    const auto result = runLoom("run --case " + caseDir + " --backward --grad-out " + (dir / "grads"));
    EXPECT_EQ(result.exitCode, 0) << name << ": " << result.output;
    auto c = loadCase(caseDir);
    ASSERT_TRUE(c) << c.error().message;
    const auto shapes = inputShapes(c->spec, c->batch, c->tokens);
    for (size_t i = 0; i < shapes.size(); ++i) {
      const std::string gradient = reference::kGradientNames[i];
      EXPECT_NE(result.output.find(gradient + " "), std::string::npos) << result.output;
      auto written = readNpy(dir / ("grads/" + gradient + ".npy"));
      ASSERT_TRUE(written) << written.error().message;
      EXPECT_EQ(written->type, NpyType::float64);
      EXPECT_EQ(written->shape, shapes[i]) << gradient;
    }
    EXPECT_EQ(std::count(result.output.begin(), result.output.end(), '\n'), 8) << result.output;
  }
}

// The generated backward on the host tile API: every shared backward case
// passes, seven float32 gradient files written.
TEST(Cli, BackwardOnEverySharedBackwardCaseOnCpu) {
  for (const std::string& name : backwardCases()) {
    TempDir dir;
    const std::string caseDir = testing::casesDir() + "/" + name;
    const auto result = runLoom("run --case " + caseDir + " --backward --grad-out " + (dir / "grads") + cpuFlags());
    EXPECT_EQ(result.exitCode, 0) << name << ": " << result.output;
    EXPECT_NE(result.output.find("cpu backward: schedule"), std::string::npos) << result.output;
    EXPECT_NE(result.output.find("dq: dq_separate"), std::string::npos) << result.output;
    for (const char* gradient : reference::kGradientNames) {
      auto written = readNpy(dir / ("grads/" + std::string(gradient) + ".npy"));
      ASSERT_TRUE(written) << written.error().message;
      EXPECT_EQ(written->type, NpyType::float32);
    }
  }
}

// The CUDA backward on the emulator: a shared backward case rounded to
// float16 passes with no findings, on sm_80 and sm_90a.
TEST(Cli, BackwardOnTheEmulator) {
  const std::string caseDir = testing::casesDir() + "/" + backwardCases().front();
  for (const char* arch : {"sm_80", "sm_90a"}) {
    const auto result = runLoom("run --case " + caseDir + " --backward --backend emu --dtype float16 --target " +
                                arch + " --cache-dir " + LOOM_TEST_CACHE);
    EXPECT_EQ(result.exitCode, 0) << result.output;
    EXPECT_NE(result.output.find("; 0 findings"), std::string::npos) << result.output;
    EXPECT_NE(result.output.find("dcollapse relative error"), std::string::npos) << result.output;
  }
}

// The CUDA backward on a GPU, or, without one, a plain one-line refusal.
TEST(Cli, BackwardOnCudaRunsOrSaysThereIsNoGpu) {
  const auto result = runLoom("run --case " + testing::casesDir() + "/" + backwardCases().front() +
                              " --backward --backend cuda --dtype float16 --cache-dir " + LOOM_TEST_CACHE);
  if (result.output.find("no CUDA driver") != std::string::npos) {
    EXPECT_EQ(result.exitCode, 2) << result.output;
    EXPECT_EQ(std::count(result.output.begin(), result.output.end(), '\n'), 2) << result.output;  // + the rounding note
  } else {
    EXPECT_EQ(result.exitCode, 0) << result.output;
    EXPECT_NE(result.output.find("cuda backward:"), std::string::npos) << result.output;
  }
}

// A gradient off by 1% fails the check and names itself; a case without
// dout, an incomplete set of expected gradients and a backend without a
// backward are bad input, each said in one line.
TEST(Cli, BackwardChecksAndRefusals) {
  TempDir dir;
  const std::string original = testing::casesDir() + "/" + backwardCases().front();
  const std::string copy = dir / "case";
  fs::copy(original, copy);
  auto dk = readNpy(copy + "/expected_dk.npy");
  ASSERT_TRUE(dk);
  std::vector<double> values = npyToDouble(*dk, false);
  for (double& x : values) x *= 1.01;
  ASSERT_TRUE(writeNpy(copy + "/expected_dk.npy", npyFromDouble(values, dk->shape, NpyType::float64)));
  const auto wrong = runLoom("run --case " + copy + " --backward");
  EXPECT_EQ(wrong.exitCode, 1) << wrong.output;
  EXPECT_NE(wrong.output.find("dk        relative error"), std::string::npos) << wrong.output;
  EXPECT_NE(wrong.output.find("FAILED"), std::string::npos) << wrong.output;

  auto oneLine = [](const testing::CommandResult& r, const std::string& fragment) {
    EXPECT_EQ(r.exitCode, 2) << r.output;
    EXPECT_NE(r.output.find(fragment), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  };
  fs::remove(copy + "/expected_dalpha_v.npy");
  oneLine(runLoom("run --case " + copy + " --backward"), "expected_dalpha_v.npy: missing");
  oneLine(runLoom("run --case " + testing::casesDir() + "/gqa-rope --backward"), "dout.npy: missing");
}

}  // namespace
}  // namespace loom
