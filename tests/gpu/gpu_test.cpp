// GPU correctness: precompiled kernels (tests/gpu/prepare.sh writes them to
// build/gpu-bundles) run on the device against the float64 reference, on
// the shared cases and on cases drawn fresh, outputs poisoned with NaN
// before every launch. This binary holds no compiler: it links only the
// driver layer, so it runs on a GPU machine without MLIR.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <regex>

#include "cuda/case_runner.h"
#include "cuda/driver.h"
#include "io/case.h"
#include "io/decode_case.h"
#include "reference/iha_decode.h"
#include "loom/counters.h"
#include "loom/runtime.h"
#include "reference/iha_reference.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

std::string fromEnv(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value && *value ? value : fallback;
}
std::string bundleDir() { return fromEnv("LOOM_GPU_BUNDLES", LOOM_GPU_BUNDLES); }
std::string casesDir() { return fromEnv("LOOM_GPU_CASES", LOOM_TEST_DATA "/cases"); }

uint64_t seed() {
  static const uint64_t value = [] {
    const char* fixed = std::getenv("LOOM_TEST_SEED");
    const uint64_t s = fixed ? std::stoull(fixed) : (uint64_t(std::random_device{}()) << 32 | std::random_device{}());
    std::printf("[ seed     ] LOOM_TEST_SEED=%llu\n", (unsigned long long)s);
    return s;
  }();
  return value;
}

struct Bundle {
  std::string file, caseName, dtype, label;
  v1::CompiledKernel kernel;
};

// <case>.<dtype>.<label>.pb, the labels matching $LOOM_GPU_LABELS and the
// cases $LOOM_GPU_CASES_MATCH (regexes; all when unset): tests/gpu/run.sh
// checks the portable kernels and the sm_90a ones in separate runs, so a
// hang in one path cannot cost the other's results, and runs one case under
// compute-sanitizer.
std::vector<Bundle> bundles() {
  std::vector<Bundle> found;
  if (!fs::is_directory(bundleDir())) return found;
  const std::regex name(R"(([^.]+)\.([a-z0-9]+)\.([^.]+)\.pb)");
  const std::regex labels(fromEnv("LOOM_GPU_LABELS", ".*"));
  const std::regex cases(fromEnv("LOOM_GPU_CASES_MATCH", ".*"));  // e.g. one case under compute-sanitizer
  for (const auto& entry : fs::directory_iterator(bundleDir())) {
    std::smatch m;
    const std::string file = entry.path().filename().string();
    if (!std::regex_match(file, m, name) || m[1] == "bench" || !std::regex_match(m[3].str(), labels) ||
        !std::regex_match(m[1].str(), cases))
      continue;
    Bundle b{entry.path().string(), m[1], m[2], m[3], {}};
    std::ifstream in(b.file, std::ios::binary);
    if (!b.kernel.ParseFromIstream(&in)) continue;
    found.push_back(std::move(b));
  }
  std::sort(found.begin(), found.end(), [](const Bundle& a, const Bundle& b) { return a.file < b.file; });
  return found;
}

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    auto api = cuda::driver();
    if (!api) GTEST_SKIP() << "no GPU on this machine: " << api.error().message;
    auto device = cuda::Device::open(0);
    ASSERT_TRUE(device) << device.error().message;
    device_ = *device;
    all_ = bundles();
    if (all_.empty() && (std::getenv("LOOM_GPU_LABELS") || std::getenv("LOOM_GPU_CASES_MATCH")))
      GTEST_SKIP() << "no bundles match LOOM_GPU_LABELS / LOOM_GPU_CASES_MATCH in " << bundleDir();
    ASSERT_FALSE(all_.empty()) << "no kernel bundles in " << bundleDir() << ": run tests/gpu/prepare.sh first";
  }

  // Runs `c` twice through the kernel: checks the tolerance, lse, and that
  // the two runs agree bit for bit (a moving result is a race).
  void check(Kernel& kernel, const IhaCase& c, const std::string& what) {
    auto first = cuda::runCase(kernel, *device_, c);
    ASSERT_TRUE(first) << what << ": " << first.error().message;
    auto second = cuda::runCase(kernel, *device_, c);
    ASSERT_TRUE(second) << what << ": " << second.error().message;
    const auto reference = reference::ihaForward(c.spec, c.inputs);
    const double error = relativeError(first->out, reference.out);
    const double tolerance = toleranceFor(c.spec.dtype());
    EXPECT_LE(error, tolerance) << what;  // NaN (an unwritten element) fails too
    EXPECT_LE(relativeError(first->lse, reference.lse), tolerance) << what << " (lse)";
    EXPECT_EQ(first->out, second->out) << what << ": two runs differ";
    std::printf("[ gpu      ] %-48s rel. error %.2e (tolerance %.0e)\n", what.c_str(), error, tolerance);
  }

  // The first forward bundle (backward and decode bundles sort among them).
  const Bundle& firstForward() const {
    for (const Bundle& b : all_)
      if (b.kernel.direction() == v1::direction_forward) return b;
    return all_.front();
  }

  std::shared_ptr<cuda::Device> device_;
  std::vector<Bundle> all_;
};

TEST_F(Gpu, EveryBundleMatchesTheReferenceOnSharedAndDrawnCases) {
  std::mt19937_64 rng(seed());
  for (const Bundle& b : all_) {
    if (b.kernel.direction() != v1::direction_forward) continue;  // EveryBackwardBundle*, EveryDecodeBundle*
    auto kernel = Kernel::load(device_, b.kernel);
    ASSERT_TRUE(kernel) << b.file << ": " << kernel.error().message;
    auto shared = loadCase(casesDir() + "/" + b.caseName);
    ASSERT_TRUE(shared) << shared.error().message;
    const IhaCase converted = withDtype(*shared, b.kernel.spec().dtype());
    check(**kernel, converted, b.caseName + " " + b.dtype + " " + b.label);
    // A fresh case of the same spec, with a length off the block sizes.
    const int64_t tokens = 1 + int64_t(rng() % 150), batch = 1 + int64_t(rng() % 2);
    const IhaCase drawn = drawCheckableCase(b.kernel.spec(), batch, tokens, rng());
    check(**kernel, drawn, b.caseName + " " + b.dtype + " " + b.label + " drawn N=" + std::to_string(tokens));
  }
}

// The decode kernels (tests/gpu/prepare.sh's "decode" bundles, and on
// sm_90a "decode-wgmma" and "decode-wgmma-split", a raw cache): each shared case's last T tokens decoded over a shuffled paged
// cache of the others (T = 1 over 16-token pages; T = 3 over 7-token pages
// with ragged lengths; T = 1 over 4-token pages after a prompt of two
// pages every sequence shares; a ragged step, a chunk of up to 9 tokens, a
// sequence bringing none and single tokens packed under query_start_loc,
// over 5-token pages), out and lse poisoned, within the dtype's tolerance
// of the forward's rows; the new tokens' k and v exactly at their slots and
// no other slot written; two runs equal bit for bit.
TEST_F(Gpu, EveryDecodeBundleMatchesTheForwardsRows) {
  std::mt19937_64 rng(seed() + 4);
  int checked = 0;
  for (const Bundle& b : all_) {
    if (b.kernel.direction() != v1::direction_decode) continue;
    auto kernel = Kernel::load(device_, b.kernel);
    ASSERT_TRUE(kernel) << b.file << ": " << kernel.error().message;
    auto shared = loadCase(casesDir() + "/" + b.caseName);
    ASSERT_TRUE(shared) << shared.error().message;
    const IhaCase c = withDtype(*shared, b.kernel.spec().dtype());
    DecodeLayout ragged{std::min<int64_t>(3, c.tokens), 7, CacheLayout::raw, {}, rng()};
    for (int64_t s = 0; s < c.batch; ++s) ragged.cached.push_back(int64_t(rng() % uint64_t(c.tokens - ragged.newTokens + 1)));
    // A shared prompt where the case has two sequences: two pages of 4
    // tokens every page table names, each sequence's own tokens after them.
    DecodeLayout sharing{1, 4, CacheLayout::raw, {}, rng()};
    sharing.sharedPages = 2;
    IhaCase prompt = c;
    if (c.batch >= 2 && c.tokens >= 10) {
      auto shared = withSharedPrefix(c, 8);
      ASSERT_TRUE(shared) << shared.error().message;
      prompt = std::move(*shared);
      for (int64_t s = 0; s < c.batch; ++s) sharing.cached.push_back(8 + int64_t(rng() % uint64_t(c.tokens - 8)));
    }
    // A ragged step (docs/IHA.md, Ragged steps): each sequence its own count
    // of new tokens, a prefill chunk of up to 9 beside single tokens, and
    // (two sequences or more) one bringing none; pages of 5.
    DecodeLayout packed{1, 5, CacheLayout::raw, {}, rng()};
    for (int64_t s = 0; s < c.batch; ++s)
      packed.newTokensOf.push_back(s == 1 ? 0 : s == 0 ? std::min<int64_t>(9, c.tokens) : 1 + int64_t(rng() % 2));
    for (const DecodeLayout& layout : {DecodeLayout{1, 16, CacheLayout::raw, {}, rng()}, ragged, sharing, packed}) {
      if (layout.sharedPages > 0 && layout.cached.empty()) continue;  // one sequence, or too short
      auto step = decodeCaseFrom(layout.sharedPages > 0 ? prompt : c, layout);
      ASSERT_TRUE(step) << step.error().message;
      std::string counts = "T=" + std::to_string(layout.newTokens);
      if (!layout.newTokensOf.empty()) {
        counts = "ragged T=";
        for (int64_t t : layout.newTokensOf) counts += std::to_string(t) + ",";
        counts.pop_back();
      }
      const std::string what = b.caseName + " " + b.dtype + " " + b.label + " " + counts + " page " +
                               std::to_string(layout.pageSize) + (layout.sharedPages > 0 ? " 2 pages shared" : "");
      auto first = cuda::runDecodeCase(**kernel, *device_, *step);
      ASSERT_TRUE(first) << what << ": " << first.error().message;
      auto second = cuda::runDecodeCase(**kernel, *device_, *step);
      ASSERT_TRUE(second) << what << ": " << second.error().message;
      const double error = relativeError(first->out, step->expected);
      EXPECT_LE(error, toleranceFor(c.spec.dtype())) << what;
      EXPECT_EQ(first->out, second->out) << what << ": two runs differ";
      // The cache: the step's slots hold its k and v, the rest what it held.
      EXPECT_EQ(checkAppend(*step, first->cache).wrongElements, 0) << what << ": cache elements other than the append's";
      std::printf("[ gpu dec  ] %-48s rel. error %.2e\n", what.c_str(), error);
    }
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "no decode bundles (tests/gpu/prepare.sh writes them)";
}

// One kernel launch captured into a CUDA graph on a stream of its own, after
// an eager warm-up launch on that stream (which grows the stream's
// workspaces, so the captured launch allocates nothing).
class CapturedLaunch {
 public:
  explicit CapturedLaunch(const cuda::DriverApi& api) : api_(api) {}
  ~CapturedLaunch() {
    if (exec_) api_.cuGraphExecDestroy(exec_);
    if (graph_) api_.cuGraphDestroy(graph_);
    if (stream_) api_.cuStreamDestroy(stream_);
  }
  CUstream stream() const { return stream_; }

  // Warms up, then captures `launch(stream)`; the counters are read after the warm-up.
  Status capture(const std::function<Status(CUstream)>& launch) {
    if (Status ok = cuda::check(api_.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate"); !ok) return ok;
    const int64_t before = launches();
    if (Status ok = launch(stream_); !ok) return ok;
    if (Status ok = cuda::check(api_.cuStreamSynchronize(stream_), "warm-up"); !ok) return ok;
    afterWarmUp_ = counters();
    perCall_ = launches() - before;
    if (Status ok = cuda::check(api_.cuStreamBeginCapture(stream_, CU_STREAM_CAPTURE_MODE_GLOBAL), "BeginCapture"); !ok)
      return ok;
    const Status captured = launch(stream_);
    if (Status ok = cuda::check(api_.cuStreamEndCapture(stream_, &graph_), "cuStreamEndCapture"); !ok) return ok;
    if (!captured) return captured;
    return cuda::check(api_.cuGraphInstantiateWithFlags(&exec_, graph_, 0), "cuGraphInstantiateWithFlags");
  }
  Status replay() const {
    if (Status ok = cuda::check(api_.cuGraphLaunch(exec_, stream_), "cuGraphLaunch"); !ok) return ok;
    return cuda::check(api_.cuStreamSynchronize(stream_), "replay");
  }
  // Since the warm-up: `launches` grown by `calls` launch calls' worth (the
  // captured one and the eager ones: replays launch nothing through loom),
  // every other counter unmoved but the test's own copies back (host_syncs).
  void expectOnlyLaunches(int64_t calls) const {
    EXPECT_GT(perCall_, 0) << "the warm-up launched no grid";
    const auto after = counters();
    for (size_t i = 0; i < after.size(); ++i) {
      const int64_t moved = after[i].second - afterWarmUp_[i].second;
      if (after[i].first == "launches") EXPECT_EQ(moved, calls * perCall_);
      else if (after[i].first != "host_syncs") EXPECT_EQ(moved, 0) << after[i].first << " moved";
    }
  }

 private:
  const cuda::DriverApi& api_;
  CUstream stream_ = nullptr;
  CUgraph graph_ = nullptr;
  CUgraphExec exec_ = nullptr;
  std::vector<std::pair<std::string, int64_t>> afterWarmUp_;
  int64_t perCall_ = 0;  // grids a launch call launches

  static int64_t launches() {
    for (const auto& [name, value] : counters())
      if (name == "launches") return value;
    return 0;
  }
};

// The first bundle of `direction` (a forward's of `label` where given).
const Bundle* firstOf(const std::vector<Bundle>& all, v1::Direction direction, const std::string& label = "") {
  for (const Bundle& b : all)
    if (b.kernel.direction() == direction && (label.empty() || b.label == label)) return &b;
  return nullptr;
}

// A decode bundle loaded, and its shared case's last token as a step over
// 16-token pages (a shuffled table drawn from `seed`), uploaded: what the
// decode graph and page-check tests start from.
struct DecodeStepOnDevice {
  std::shared_ptr<Kernel> kernel;
  IhaCase c;
  DecodeCase step;
  cuda::DecodeBuffers buffers;

  static Result<DecodeStepOnDevice> make(const std::shared_ptr<cuda::Device>& device, const Bundle& bundle,
                                         uint64_t seed) {
    auto kernel = Kernel::load(device, bundle.kernel);
    if (!kernel) return makeError(bundle.file + ": " + kernel.error().message);
    auto shared = loadCase(casesDir() + "/" + bundle.caseName);
    if (!shared) return shared.error();
    const IhaCase c = withDtype(*shared, bundle.kernel.spec().dtype());
    auto step = decodeCaseFrom(c, {1, 16, CacheLayout::raw, {}, seed});
    if (!step) return step.error();
    auto buffers = cuda::DecodeBuffers::upload(*device, *step);
    if (!buffers) return buffers.error();
    return DecodeStepOnDevice{*kernel, c, std::move(*step), std::move(*buffers)};
  }
};

// CUDA graphs (issue: a host path without per-call work): the default
// forward bundle's launch captured once, then replayed 20 times, each on a
// fresh draw of the same shapes written into the same buffers (out and lse
// poisoned): every replay within the tolerance of the float64 reference,
// every fifth equal bit for bit to an eager launch of the same buffers, and
// the replays generate, compile, load and allocate nothing.
TEST_F(Gpu, ForwardGraphReplaysMatchEager) {
  const Bundle* found = firstOf(all_, v1::direction_forward, "default");
  if (!found) GTEST_SKIP() << "no default forward bundle (tests/gpu/prepare.sh writes them)";
  auto kernel = Kernel::load(device_, found->kernel);
  ASSERT_TRUE(kernel) << found->file << ": " << kernel.error().message;
  std::mt19937_64 rng(seed() + 10);
  const KernelSpec& spec = found->kernel.spec();
  const int64_t batch = 2, tokens = 64 + int64_t(rng() % 100);
  auto buffers = cuda::CaseBuffers::upload(*device_, drawCheckableCase(spec, batch, tokens, rng()));
  ASSERT_TRUE(buffers) << buffers.error().message;
  CapturedLaunch graph(device_->api());
  ASSERT_TRUE(graph.capture([&](CUstream stream) { return (*kernel)->launch(buffers->tensors(), stream); }));
  int eager = 0;
  double worst = 0;
  for (int replay = 0; replay < 20; ++replay) {
    const IhaCase c = drawCheckableCase(spec, batch, tokens, rng());
    ASSERT_TRUE(buffers->rewrite(*device_, c));
    ASSERT_TRUE(buffers->poison(*device_));
    ASSERT_TRUE(graph.replay());
    auto replayed = buffers->download(*device_, c);
    ASSERT_TRUE(replayed) << replayed.error().message;
    const double error = relativeError(replayed->out, *c.expected);
    worst = std::max(worst, error);
    EXPECT_LE(error, toleranceFor(spec.dtype())) << "replay " << replay;
    if (replay % 5 != 0) continue;
    ASSERT_TRUE(buffers->poison(*device_));
    ASSERT_TRUE((*kernel)->launch(buffers->tensors(), graph.stream()));
    auto direct = buffers->download(*device_, c);
    ASSERT_TRUE(direct) << direct.error().message;
    EXPECT_EQ(direct->out, replayed->out) << "replay " << replay << " and an eager launch differ";
    EXPECT_EQ(direct->lse, replayed->lse) << "replay " << replay << " (lse)";
    ++eager;
  }
  graph.expectOnlyLaunches(eager + 1);  // the eager launches and the captured one
  std::printf("[ gpu graph] %s: 20 replays, B %lld N %lld, worst rel. error %.2e, %d eager launches equal\n",
              found->file.c_str(), (long long)batch, (long long)tokens, worst, eager);
}

// The same for the first backward bundle: its launches (the forward's
// recomputation and the gradients') captured once, replayed 20 times on
// fresh inputs and dout, gradients poisoned: each within the tolerance of
// the float64 backward, every fifth equal to an eager launch (but dq and
// dalpha_q under dq atomic, whose adds land in any order).
TEST_F(Gpu, BackwardGraphReplaysMatchEager) {
  const Bundle* found = firstOf(all_, v1::direction_backward);
  if (!found) GTEST_SKIP() << "no backward bundles (tests/gpu/prepare.sh writes them)";
  auto kernel = Kernel::load(device_, found->kernel);
  ASSERT_TRUE(kernel) << found->file << ": " << kernel.error().message;
  std::mt19937_64 rng(seed() + 11);
  const KernelSpec& spec = found->kernel.spec();
  const int64_t batch = 2, tokens = 32 + int64_t(rng() % 64);
  const IhaCase first = drawCheckableBackwardCase(spec, batch, tokens, rng());
  auto inputs = cuda::CaseBuffers::upload(*device_, first);
  ASSERT_TRUE(inputs) << inputs.error().message;
  auto grads = cuda::GradBuffers::upload(*device_, first);
  ASSERT_TRUE(grads) << grads.error().message;
  CapturedLaunch graph(device_->api());
  auto launch = [&](CUstream stream) { return (*kernel)->launchBackward(inputs->tensors(), grads->tensors(), stream); };
  ASSERT_TRUE(graph.capture(launch));
  const bool atomic = found->kernel.schedule().dq() == v1::dq_atomic;
  int eager = 0;
  double worst = 0;
  for (int replay = 0; replay < 20; ++replay) {
    const IhaCase c = drawCheckableBackwardCase(spec, batch, tokens, rng());
    ASSERT_TRUE(inputs->rewrite(*device_, c));
    ASSERT_TRUE(grads->rewrite(*device_, c));
    ASSERT_TRUE(grads->poison(*device_));
    ASSERT_TRUE(graph.replay());
    auto replayed = grads->download(*device_);
    ASSERT_TRUE(replayed) << replayed.error().message;
    const double error = worstGradientError(spec, tokens, *replayed, *c.expectedGradients);
    worst = std::max(worst, error);
    EXPECT_LE(error, gradientToleranceFor(spec.dtype())) << "replay " << replay;
    if (replay % 5 != 0) continue;
    ASSERT_TRUE(grads->poison(*device_));
    ASSERT_TRUE(launch(graph.stream()));
    auto direct = grads->download(*device_);
    ASSERT_TRUE(direct) << direct.error().message;
    const auto a = reference::gradientsOf(*direct), b = reference::gradientsOf(*replayed);
    for (size_t i = 0; i < a.size(); ++i) {
      const std::string name = reference::kGradientNames[i];
      if (atomic && (name == "dq" || name == "dalpha_q")) continue;
      EXPECT_EQ(*a[i], *b[i]) << "replay " << replay << " and an eager launch differ in " << name;
    }
    ++eager;
  }
  graph.expectOnlyLaunches(eager + 1);  // the eager launches and the captured one
  std::printf("[ gpu graph] %s: 20 replays, B %lld N %lld, worst gradient error %.2e, %d eager launches equal\n",
              found->file.c_str(), (long long)batch, (long long)tokens, worst, eager);
}

// Workspaces from the caller (WorkspaceMemory, what loom.torch passes from
// PyTorch's allocator): the default forward's and the first backward's
// launches captured on a stream that never launched before, with no
// warm-up, allocate nothing, and their replays equal a launch on the
// kernel's own workspaces bit for bit (dq and dalpha_q under dq atomic
// aside); a workspace a byte short is refused, naming the size it needs.
TEST_F(Gpu, CallerWorkspacesNeedNoWarmUp) {
  const Bundle* forward = firstOf(all_, v1::direction_forward, "default");
  const Bundle* backward = firstOf(all_, v1::direction_backward);
  if (!forward && !backward) GTEST_SKIP() << "no default forward or backward bundles (tests/gpu/prepare.sh)";
  std::mt19937_64 rng(seed() + 12);
  const cuda::DriverApi& api = device_->api();
  for (const Bundle* b : {forward, backward}) {
    if (!b) continue;
    SCOPED_TRACE(b->file);
    auto kernel = Kernel::load(device_, b->kernel);
    ASSERT_TRUE(kernel) << kernel.error().message;
    const KernelSpec& spec = b->kernel.spec();
    const int64_t batch = 1 + int64_t(rng() % 2), tokens = 16 + int64_t(rng() % 100);
    const IhaCase c = drawCheckableBackwardCase(spec, batch, tokens, rng());
    auto inputs = cuda::CaseBuffers::upload(*device_, c);
    ASSERT_TRUE(inputs) << inputs.error().message;
    auto grads = cuda::GradBuffers::upload(*device_, c);
    ASSERT_TRUE(grads) << grads.error().message;
    const bool isBackward = b->kernel.direction() == v1::direction_backward;
    auto launch = [&](CUstream stream, const WorkspaceMemory* memory) {
      return isBackward ? (*kernel)->launchBackward(inputs->tensors(), grads->tensors(), stream, nullptr, memory)
                        : (*kernel)->launch(inputs->tensors(), stream, nullptr, memory);
    };
    auto results = [&]() -> std::vector<std::vector<double>> {
      if (isBackward) {
        auto g = grads->download(*device_);
        EXPECT_TRUE(g) << g.error().message;
        std::vector<std::vector<double>> all;
        if (g)
          for (const std::vector<double>* one : reference::gradientsOf(*g)) all.push_back(*one);
        return all;
      }
      auto run = inputs->download(*device_, c);
      EXPECT_TRUE(run) << run.error().message;
      return run ? std::vector<std::vector<double>>{run->out, run->lse} : std::vector<std::vector<double>>{};
    };
    const int64_t bytes = workspaceBytes(b->kernel, batch, tokens);
    auto memory = cuda::DeviceBuffer::allocate(*device_, size_t(std::max<int64_t>(bytes, 1)));
    ASSERT_TRUE(memory) << memory.error().message;
    const WorkspaceMemory given{memory->data(), bytes};
    // Eager, on the kernel's own workspaces (default stream).
    ASSERT_TRUE(isBackward ? grads->poison(*device_) : inputs->poison(*device_));
    ASSERT_TRUE(launch(nullptr, nullptr));
    const auto own = results();
    // Captured cold on a new stream over the caller's memory.
    CUstream stream = nullptr;
    ASSERT_TRUE(cuda::check(api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate"));
    const auto before = counters();
    ASSERT_TRUE(cuda::check(api.cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL), "BeginCapture"));
    const Status captured = launch(stream, &given);
    CUgraph graph = nullptr;
    ASSERT_TRUE(cuda::check(api.cuStreamEndCapture(stream, &graph), "cuStreamEndCapture"));
    ASSERT_TRUE(captured) << captured.error().message;
    CUgraphExec exec = nullptr;
    ASSERT_TRUE(cuda::check(api.cuGraphInstantiateWithFlags(&exec, graph, 0), "instantiate"));
    for (const auto& [name, value] : counters())
      for (const auto& [was, at] : before)
        if (name == was && name != "launches") EXPECT_EQ(value, at) << name << " moved in the capture";
    ASSERT_TRUE(isBackward ? grads->poison(*device_) : inputs->poison(*device_));
    ASSERT_TRUE(cuda::check(api.cuGraphLaunch(exec, stream), "cuGraphLaunch"));
    ASSERT_TRUE(cuda::check(api.cuStreamSynchronize(stream), "replay"));
    const auto replayed = results();
    ASSERT_EQ(replayed.size(), own.size());
    for (size_t i = 0; i < own.size(); ++i) {
      const bool atomicGradient = isBackward && b->kernel.schedule().dq() == v1::dq_atomic &&
                                  (std::string(reference::kGradientNames[i]) == "dq" ||
                                   std::string(reference::kGradientNames[i]) == "dalpha_q");
      if (!atomicGradient) EXPECT_EQ(replayed[i], own[i]) << "result " << i << " differs from the own workspaces'";
    }
    api.cuGraphExecDestroy(exec);
    api.cuGraphDestroy(graph);
    api.cuStreamDestroy(stream);
    if (bytes > 0) {
      const WorkspaceMemory shortOne{memory->data(), bytes - 1};
      const Status refused = launch(nullptr, &shortOne);
      ASSERT_FALSE(refused);
      EXPECT_NE(refused.error().message.find(std::to_string(bytes)), std::string::npos) << refused.error().message;
    }
    std::printf("[ gpu ws   ] %s: captured cold over %lld caller bytes, equal to its own workspaces\n", b->file.c_str(),
                (long long)bytes);
  }
}

// The decode step: the first decode bundle's step captured with
// check_pages off (no synchronisation, no allocation in the launch), then
// replayed 100 times with a different page table each time (the cache
// rewritten to match, out poisoned): every replay within the tolerance of
// the forward's rows, every tenth equal bit for bit to an eager launch of
// the same buffers; the replays allocate, load and compile nothing.
TEST_F(Gpu, DecodeGraphReplaysMatchEager) {
  const Bundle* found = firstOf(all_, v1::direction_decode);
  if (!found) GTEST_SKIP() << "no decode bundles (tests/gpu/prepare.sh writes them)";
  std::mt19937_64 rng(seed() + 9);
  auto on = DecodeStepOnDevice::make(device_, *found, rng());
  ASSERT_TRUE(on) << on.error().message;
  const IhaCase& c = on->c;
  const DecodeCase* first = &on->step;
  cuda::DecodeBuffers* buffers = &on->buffers;
  std::shared_ptr<Kernel>* kernel = &on->kernel;
  const cuda::DriverApi& api = device_->api();
  CapturedLaunch graph(api);
  ASSERT_TRUE(graph.capture([&](CUstream stream) {
    return (*kernel)->launchDecode(buffers->tensors(), buffers->cache(), stream, /*checkPages=*/false);
  }));
  const PagedCacheTensors& cache = buffers->cache();
  const NpyType storage = storageTypeOf(c.spec.dtype());
  int eagerChecks = 0;
  double worst = 0;
  for (int replay = 0; replay < 100; ++replay) {
    auto step = decodeCaseFrom(c, {1, 16, CacheLayout::raw, {}, rng()});  // the same lengths, pages shuffled
    ASSERT_TRUE(step) << step.error().message;
    ASSERT_EQ(step->shape.numPages, first->shape.numPages);
    ASSERT_EQ(step->shape.maxPages, first->shape.maxPages);
    auto rewrite = [&](const Tensor& target, const std::vector<double>& values) {
      const NpyArray bytes = npyFromDouble(values, {int64_t(values.size())}, storage);
      return cuda::check(api.cuMemcpyHtoD(reinterpret_cast<CUdeviceptr>(target.data), bytes.bytes.data(),
                                          bytes.bytes.size()),
                         "cuMemcpyHtoD");
    };
    ASSERT_TRUE(rewrite(cache.k_cache, step->cache.k));
    ASSERT_TRUE(rewrite(cache.v_cache, step->cache.v));
    ASSERT_TRUE(cuda::check(api.cuMemcpyHtoD(reinterpret_cast<CUdeviceptr>(cache.page_table),
                                             step->cache.pageTable.data(),
                                             step->cache.pageTable.size() * sizeof(int32_t)),
                            "cuMemcpyHtoD of the page table"));
    ASSERT_TRUE(buffers->step().poison(*device_));
    ASSERT_TRUE(graph.replay());
    auto replayed = buffers->step().download(*device_, stepCase(*step));
    ASSERT_TRUE(replayed) << replayed.error().message;
    const double error = relativeError(replayed->out, step->expected);
    worst = std::max(worst, error);
    EXPECT_LE(error, toleranceFor(c.spec.dtype())) << "replay " << replay;
    if (replay % 10 != 0) continue;
    ASSERT_TRUE(rewrite(cache.k_cache, step->cache.k));  // the replay appended; the eager step appends the same
    ASSERT_TRUE(buffers->step().poison(*device_));
    ASSERT_TRUE((*kernel)->launchDecode(buffers->tensors(), cache, graph.stream(), false));
    ASSERT_TRUE(cuda::check(api.cuStreamSynchronize(graph.stream()), "eager"));
    auto eager = buffers->step().download(*device_, stepCase(*step));
    ASSERT_TRUE(eager) << eager.error().message;
    EXPECT_EQ(eager->out, replayed->out) << "replay " << replay << " and an eager step of the same buffers differ";
    ++eagerChecks;
  }
  graph.expectOnlyLaunches(eagerChecks + 1);  // the eager steps and the captured one
  std::printf("[ gpu graph] %s: 100 replays, worst rel. error %.2e, %d eager steps equal\n", found->file.c_str(), worst,
              eagerChecks);
}

// The device's page check (PagedCacheTensors::page_errors): the first
// decode bundle's step with an error word, on a valid table (word 0, the
// forward's rows), then with the last sequence's first page entry past the
// cache (word 1, the other sequences' rows unchanged, no fault), no host
// check either time.
TEST_F(Gpu, DevicePageCheckRefusesABadSequence) {
  const Bundle* found = firstOf(all_, v1::direction_decode);
  if (!found) GTEST_SKIP() << "no decode bundles (tests/gpu/prepare.sh writes them)";
  auto on = DecodeStepOnDevice::make(device_, *found, seed() + 13);
  ASSERT_TRUE(on) << on.error().message;
  const IhaCase& c = on->c;
  const DecodeCase* step = &on->step;
  cuda::DecodeBuffers* buffers = &on->buffers;
  std::shared_ptr<Kernel>* kernel = &on->kernel;
  auto word = cuda::DeviceBuffer::allocate(*device_, sizeof(int32_t));
  ASSERT_TRUE(word) << word.error().message;
  const cuda::DriverApi& api = device_->api();
  PagedCacheTensors cache = buffers->cache();
  cache.page_errors = static_cast<int32_t*>(word->data());
  auto run = [&](int32_t* errors) -> std::optional<cuda::DeviceRun> {
    EXPECT_TRUE(cuda::check(api.cuMemsetD8(word->get(), 0, sizeof(int32_t)), "cuMemsetD8"));
    EXPECT_TRUE(buffers->step().poison(*device_));
    const Status launched = (*kernel)->launchDecode(buffers->tensors(), cache, nullptr, /*checkPages=*/false);
    EXPECT_TRUE(launched) << launched.error().message;
    auto got = buffers->step().download(*device_, stepCase(*step));
    EXPECT_TRUE(got) << got.error().message;
    EXPECT_TRUE(cuda::check(api.cuMemcpyDtoH(errors, word->get(), sizeof(int32_t)), "cuMemcpyDtoH"));
    if (!got) return std::nullopt;
    return *got;
  };
  int32_t errors = -1;
  auto good = run(&errors);
  ASSERT_TRUE(good);
  EXPECT_EQ(errors, 0);
  EXPECT_LE(relativeError(good->out, step->expected), toleranceFor(c.spec.dtype()));
  const int64_t bad = c.batch - 1;
  std::vector<int32_t> table = step->cache.pageTable;
  table[size_t(bad * step->shape.maxPages)] = int32_t(step->shape.numPages + 7);
  ASSERT_TRUE(cuda::check(api.cuMemcpyHtoD(reinterpret_cast<CUdeviceptr>(cache.page_table), table.data(),
                                           table.size() * sizeof(int32_t)),
                          "cuMemcpyHtoD of the page table"));
  auto refused = run(&errors);
  ASSERT_TRUE(refused);
  EXPECT_EQ(errors, 1);
  const size_t row = good->out.size() / size_t(c.batch);
  EXPECT_TRUE(std::equal(good->out.begin(), good->out.begin() + long(row * size_t(bad)), refused->out.begin()))
      << "the other sequences' rows changed";
  std::printf("[ gpu pages] %s: a valid table passed, a bad entry of sequence %lld refused\n", found->file.c_str(),
              (long long)bad);
}

// The backward kernels (tests/gpu/prepare.sh's "backward" and
// "backward-atomic" bundles of the shared backward cases): every gradient
// within the dtype's tolerance of the float64 backward, on the shared case
// rounded to the dtype and on a fresh draw, gradients poisoned before each
// launch, and two runs equal bit for bit (its reductions run in a fixed
// order), but for dq and dalpha_q under dq atomic, whose adds land in any
// order. A "drawn-" bundle (prepare.sh: a spec no shared case has, such as
// head_dim 256's, its gradient columns in two parts) runs on the draw alone.
TEST_F(Gpu, EveryBackwardBundleMatchesTheReference) {
  std::mt19937_64 rng(seed() + 1);
  int checked = 0;
  for (const Bundle& b : all_) {
    if (b.kernel.direction() != v1::direction_backward) continue;
    auto kernel = Kernel::load(device_, b.kernel);
    ASSERT_TRUE(kernel) << b.file << ": " << kernel.error().message;
    std::optional<IhaCase> converted;
    if (b.caseName.rfind("drawn-", 0) != 0) {
      auto shared = loadCase(casesDir() + "/" + b.caseName);
      ASSERT_TRUE(shared) << shared.error().message;
      converted = withDtype(*shared, b.kernel.spec().dtype());
    }
    const int64_t tokens = 1 + int64_t(rng() % 150), batch = 1 + int64_t(rng() % 2);
    const IhaCase drawn = drawCheckableBackwardCase(b.kernel.spec(), batch, tokens, rng());
    const IhaCase* cases[] = {converted ? &*converted : nullptr, &drawn};
    for (const IhaCase* c : cases) {
      if (!c) continue;
      const bool atomic = b.kernel.schedule().dq() == v1::dq_atomic;
      const std::string what = b.caseName + " " + b.dtype + " " + b.label +
                               (c == &drawn ? " drawn N=" + std::to_string(tokens) : std::string());
      auto first = cuda::runBackwardCase(**kernel, *device_, *c);
      ASSERT_TRUE(first) << what << ": " << first.error().message;
      auto second = cuda::runBackwardCase(**kernel, *device_, *c);
      ASSERT_TRUE(second) << what << ": " << second.error().message;
      const std::vector<double> errors = gradientErrors(c->spec, c->tokens, *first, *c->expectedGradients);
      std::string figures;
      for (size_t i = 0; i < errors.size(); ++i) {
        EXPECT_LE(errors[i], gradientToleranceFor(c->spec.dtype())) << what << " " << reference::kGradientNames[i];
        char text[40];
        std::snprintf(text, sizeof text, " %s %.1e", reference::kGradientNames[i], errors[i]);
        figures += text;
      }
      const auto once = reference::gradientsOf(*first), twice = reference::gradientsOf(*second);
      for (size_t i = 0; i < once.size(); ++i) {
        const std::string name = reference::kGradientNames[i];
        if (atomic && (name == "dq" || name == "dalpha_q")) continue;
        EXPECT_EQ(*once[i], *twice[i]) << what << " " << name << ": two runs differ";
      }
      std::printf("[ gpu bwd  ] %-40s%s\n", what.c_str(), figures.c_str());
    }
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "no backward bundles (tests/gpu/prepare.sh writes them)";
}

// What the forward keeps feeds the backward: the "materialized" forward
// bundle of each backward case keeps its mixed rows, pseudo outputs and
// lse in device buffers (poisoned first), the "backward" bundle starts from
// them without its pre-mix and attention launches; every gradient within
// the tolerance of the float64 backward.
TEST_F(Gpu, KeptForwardFeedsTheBackward) {
  int checked = 0;
  for (const Bundle& b : all_) {
    if (b.label != "backward") continue;
    const auto forward = std::find_if(all_.begin(), all_.end(), [&](const Bundle& f) {
      return f.caseName == b.caseName && f.dtype == b.dtype && f.label == "materialized";
    });
    if (forward == all_.end()) continue;
    auto backwardKernel = Kernel::load(device_, b.kernel);
    auto forwardKernel = Kernel::load(device_, forward->kernel);
    ASSERT_TRUE(backwardKernel && forwardKernel) << b.file;
    auto shared = loadCase(casesDir() + "/" + b.caseName);
    ASSERT_TRUE(shared) << shared.error().message;
    const IhaCase c = withDtype(*shared, b.kernel.spec().dtype());
    auto gradients = cuda::runKeptBackwardCase(**forwardKernel, **backwardKernel, *device_, c);
    ASSERT_TRUE(gradients) << b.file << ": " << gradients.error().message;
    const std::vector<double> errors = gradientErrors(c.spec, c.tokens, *gradients, *c.expectedGradients);
    for (size_t i = 0; i < errors.size(); ++i)
      EXPECT_LE(errors[i], gradientToleranceFor(c.spec.dtype())) << b.file << " " << reference::kGradientNames[i];
    std::printf("[ gpu kept ] %-40s worst gradient error %.2e\n", (b.caseName + " " + b.dtype).c_str(),
                worstGradientError(c.spec, c.tokens, *gradients, *c.expectedGradients));
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "no backward bundle with a materialized forward twin (tests/gpu/prepare.sh)";
}

// The sm_90a path on long sequences: many key blocks stream through the
// mbarrier ring (every stage reused many times, its phases wrapping), and
// masked and unmasked blocks alternate. L = N * P = 2048 rows keeps the
// float64 reference to seconds.
TEST_F(Gpu, WgmmaOnLongSequences) {
  std::mt19937_64 rng(seed() + 2);
  int checked = 0;
  for (const Bundle& b : all_) {
    if (b.label != "hopper" || b.kernel.schedule().engine() != v1::engine_wgmma) continue;
    auto kernel = Kernel::load(device_, b.kernel);
    ASSERT_TRUE(kernel) << b.file << ": " << kernel.error().message;
    const int64_t tokens = 2048 / b.kernel.spec().pseudo_heads() - int64_t(rng() % 7);
    const IhaCase drawn = drawCheckableCase(b.kernel.spec(), 1, tokens, rng());
    check(**kernel, drawn, b.caseName + " " + b.dtype + " wgmma long N=" + std::to_string(tokens));
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "no sm_90a wgmma bundles (prepared for another arch)";
}

// More batch entries than a grid holds in z (65535): the launcher splits
// the batch over several launches (IhaArgs::batch_offset); every entry,
// the last ones included, must match the reference.
TEST_F(Gpu, BatchesBeyondTheGridLimit) {
  const Bundle* smallest = &firstForward();
  for (const Bundle& b : all_) {
    if (b.kernel.direction() != v1::direction_forward) continue;
    const KernelSpec& s = b.kernel.spec();
    const KernelSpec& t = smallest->kernel.spec();
    if (s.heads() * s.head_dim() < t.heads() * t.head_dim()) smallest = &b;
  }
  auto kernel = Kernel::load(device_, smallest->kernel);
  ASSERT_TRUE(kernel) << kernel.error().message;
  std::mt19937_64 rng(seed() + 3);
  constexpr int64_t kBatch = 65535 + 3;
  const IhaCase c = drawCheckableCase(smallest->kernel.spec(), kBatch, 2, rng());
  check(**kernel, c, smallest->caseName + " " + smallest->dtype + " B=" + std::to_string(kBatch));
}

// Strided q and out (rows padded to d + 8 elements) through the same kernel.
TEST_F(Gpu, StridedTensorsAndDlpack) {
  const Bundle& b = firstForward();
  auto kernel = Kernel::load(device_, b.kernel);
  ASSERT_TRUE(kernel) << kernel.error().message;
  std::mt19937_64 rng(seed() + 1);
  const KernelSpec& spec = b.kernel.spec();
  const IhaCase c = drawCheckableCase(spec, 2, 37, rng());
  auto buffers = cuda::CaseBuffers::upload(*device_, c);
  ASSERT_TRUE(buffers) << buffers.error().message;
  IhaTensors tensors = buffers->tensors();

  // The same q, re-laid with padded rows.
  const int64_t B = 2, N = 37, H = spec.heads(), d = spec.head_dim(), pitch = d + 8;
  NpyArray dense = npyFromDouble(c.inputs.q, {B, N, H, d}, storageTypeOf(spec.dtype()));
  std::vector<uint8_t> padded(size_t(B * N * H * pitch * 2), 0);
  for (int64_t row = 0; row < B * N * H; ++row)
    std::memcpy(&padded[size_t(row * pitch * 2)], &dense.bytes[size_t(row * d * 2)], size_t(d * 2));
  auto strided = cuda::DeviceBuffer::allocate(*device_, padded.size());
  ASSERT_TRUE(strided);
  ASSERT_TRUE(cuda::check(device_->api().cuMemcpyHtoD(strided->get(), padded.data(), padded.size()), "copy"));
  tensors.q.data = strided->data();
  tensors.q.strides = {N * H * pitch, H * pitch, pitch, 1};

  DLTensor dl[8];
  const Tensor* views[] = {&tensors.q, &tensors.k, &tensors.v, &tensors.alpha_q,
                           &tensors.alpha_k, &tensors.alpha_v, &tensors.collapse, &tensors.out};
  for (int i = 0; i < 8; ++i) {
    dl[i] = DLTensor{};
    dl[i].data = views[i]->data;
    dl[i].device = {kDLCUDA, 0};
    dl[i].ndim = int(views[i]->shape.size());
    dl[i].dtype = views[i]->element == ElementKind::float32
                      ? DLDataType{kDLFloat, 32, 1}
                      : views[i]->element == ElementKind::float16 ? DLDataType{kDLFloat, 16, 1} : DLDataType{kDLBfloat, 16, 1};
    dl[i].shape = const_cast<int64_t*>(views[i]->shape.data());
    dl[i].strides = views[i]->strides.empty() ? nullptr : const_cast<int64_t*>(views[i]->strides.data());
  }
  ASSERT_TRUE(buffers->poison(*device_));
  Status launched = (*kernel)->launch(&dl[0], &dl[1], &dl[2], &dl[3], &dl[4], &dl[5], &dl[6], &dl[7]);
  ASSERT_TRUE(launched) << launched.error().message;
  auto run = buffers->download(*device_, c);
  ASSERT_TRUE(run) << run.error().message;
  EXPECT_LE(relativeError(run->out, reference::ihaForward(spec, c.inputs).out), toleranceFor(spec.dtype()));
}

}  // namespace
}  // namespace loom
