// The kernel service, a real server on 127.0.0.1 with the real client: hit
// and miss, many concurrent clients, deadlines, invalid requests,
// credentials, health and reflection, metrics, a server killed during
// writes, and three replicas on one PostgreSQL store (one killed).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <nlohmann/json.hpp>
#include <fstream>
#include <set>
#include <thread>

#include "api/compile.h"
#include "jit/nvrtc_compiler.h"
#include "loom/cache.h"
#include "loom/client.h"
#include "loom/compiler.h"
#include "loom/counters.h"
#include "loom/hash.h"
#include "loom/service.h"
#include "loom/served.h"
#include "postgres_server.h"
#include "test_util.h"
#include "loom/request_checks.h"

namespace loom::service {
namespace {

constexpr const char* kToken = "test-token-0123456789abcdef";

KernelSpec spec(int heads, int window = 0) {
  return testing::makeSpec({.heads = heads, .headDim = 32, .window = window});
}

v1::Target sm80() {
  v1::Target t = *parseTarget("sm_80");
  t.mutable_device()->set_name("NVIDIA A100-SXM4-80GB");
  t.mutable_device()->set_sm_count(108);
  return t;
}

class Service : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream(dir_ / "token") << kToken << "\n";
    std::ofstream(dir_ / "wrong") << "not-the-token-at-all-0000\n";
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.cacheDir = dir_ / "cache";
    options.tokenFile = dir_ / "token";
    options.metricsPort = 0;
    auto server = KernelServer::start(options);
    ASSERT_TRUE(server) << server.error().message;
    server_ = std::move(*server);
    address_ = "127.0.0.1:" + std::to_string(server_->port());
  }
  void TearDown() override {
    if (server_) server_->shutdown(1000);
  }
  std::unique_ptr<KernelClient> client(const std::string& tokenFile = "") {
    auto c = KernelClient::connect(address_, tokenFile);
    EXPECT_TRUE(c);
    return std::move(*c);
  }

  testing::TempDir dir_;
  std::unique_ptr<KernelServer> server_;
  std::string address_;
};

TEST_F(Service, MissCompilesThenHitsTheCache) {
  auto c = client();
  auto first = c->getKernel(spec(2), sm80());
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_EQ(first->origin(), "compiled now");
  EXPECT_EQ(first->schedule_source(), "cost model");
  EXPECT_FALSE(first->kernel().binary().empty());
  auto second = c->getKernel(spec(2), sm80());
  ASSERT_TRUE(second);
  EXPECT_EQ(second->origin(), "kernel cache");
  EXPECT_EQ(second->kernel().binary(), first->kernel().binary());
  auto listed = c->listKernels();
  ASSERT_TRUE(listed);
  EXPECT_EQ(listed->entries_size(), 1);
}

// The backward kernel of the same spec: compiled apart (its own artifact),
// a backward CompiledKernel with the backward's entry points, then a hit;
// the forward's stays as it was.
TEST_F(Service, ServesTheBackwardKernelApart) {
  auto c = client();
  auto forward = c->getKernel(spec(2), sm80());
  ASSERT_TRUE(forward) << forward.error().message;
  auto backward = c->getKernel(spec(2), sm80(), 60000, v1::direction_backward);
  ASSERT_TRUE(backward) << backward.error().message;
  EXPECT_EQ(backward->origin(), "compiled now");
  EXPECT_EQ(backward->kernel().direction(), v1::direction_backward);
  EXPECT_EQ(backward->kernel().schedule().dq(), v1::dq_separate);
  EXPECT_NE(backward->kernel().source(), forward->kernel().source());
  bool hasKv = false;
  for (const v1::EntryPoint& entry : backward->kernel().entries()) hasKv |= entry.name() == "iha_bwd_kv";
  EXPECT_TRUE(hasKv);
  auto again = c->getKernel(spec(2), sm80(), 60000, v1::direction_backward);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->origin(), "kernel cache");
  auto forwardAgain = c->getKernel(spec(2), sm80());
  ASSERT_TRUE(forwardAgain);
  EXPECT_EQ(forwardAgain->kernel().direction(), v1::direction_forward);
  EXPECT_EQ(forwardAgain->kernel().binary(), forward->kernel().binary());
  auto listed = c->listKernels();
  ASSERT_TRUE(listed);
  EXPECT_EQ(listed->entries_size(), 2);
  // The decode steps over a raw and a mixed cache: two more kernels of
  // their own, each with the append launch first.
  for (v1::Direction direction : {v1::direction_decode, v1::direction_decode_mixed}) {
    auto decode = c->getKernel(spec(2), sm80(), 60000, direction);
    ASSERT_TRUE(decode) << decode.error().message;
    EXPECT_EQ(decode->kernel().direction(), direction);
    ASSERT_GT(decode->kernel().entries_size(), 0);
    EXPECT_EQ(decode->kernel().entries(0).name(), kDecodeAppendEntry);
    EXPECT_EQ(decode->kernel().schedule().mix(),
              direction == v1::direction_decode ? v1::mix_fused : v1::mix_materialized);
  }
  listed = c->listKernels();
  ASSERT_TRUE(listed);
  EXPECT_EQ(listed->entries_size(), 4);
  auto unknown = c->getKernel(spec(2), sm80(), 60000, v1::Direction(7));
  ASSERT_FALSE(unknown);
  EXPECT_NE(unknown.error().message.find("direction 7 is not forward, backward, decode or decode_mixed"), std::string::npos)
      << unknown.error().message;
}

// Hundreds of requests from many threads over four specs: all answered,
// and each spec compiled exactly once.
// The client side's steady state (issue: a host path without per-call
// work): ServedKernels fetches each (direction, spec) once over one channel;
// 200 more calls of each send nothing and move no counter (the server runs
// in this process: it compiles, reads and ranks nothing either), and give
// the kernel first served. After forget(), one request again, no new channel.
TEST_F(Service, ServedKernelsFetchOnceOverOneChannel) {
  auto moved = [](const std::vector<std::pair<std::string, int64_t>>& before, const std::string& name) {
    for (const auto& [key, value] : counters())
      if (key == name)
        for (const auto& [was, at] : before)
          if (was == name) return value - at;
    ADD_FAILURE() << "no counter " << name;
    return int64_t(-1);
  };
  ServedKernels served;
  const v1::Direction directions[] = {v1::direction_forward, v1::direction_backward, v1::direction_decode};
  const auto start = counters();
  std::vector<std::shared_ptr<const v1::CompiledKernel>> first;
  for (v1::Direction direction : directions) {
    auto kernel = served.get(address_, spec(2), sm80(), direction);
    ASSERT_TRUE(kernel) << kernel.error().message;
    EXPECT_EQ((*kernel)->direction(), direction);
    first.push_back(*kernel);
  }
  EXPECT_EQ(moved(start, "service_channels"), 1);
  EXPECT_EQ(moved(start, "service_requests"), 3);
  const auto warm = counters();
  for (int call = 0; call < 200; ++call)
    for (size_t i = 0; i < std::size(directions); ++i) {
      auto kernel = served.get(address_, spec(2), sm80(), directions[i]);
      ASSERT_TRUE(kernel) << kernel.error().message;
      ASSERT_EQ(kernel->get(), first[i].get()) << "call " << call << " gave another kernel";
    }
  const auto after = counters();
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_EQ(after[i].second, warm[i].second) << after[i].first << " moved in steady-state calls";
  // What was kept is what the service serves.
  auto direct = client()->getKernel(spec(2), sm80());
  ASSERT_TRUE(direct) << direct.error().message;
  EXPECT_EQ(direct->kernel().binary(), first[0]->binary());
  served.forget();
  const auto forgot = counters();
  auto again = served.get(address_, spec(2), sm80(), v1::direction_forward);
  ASSERT_TRUE(again) << again.error().message;
  EXPECT_EQ(moved(forgot, "service_requests"), 1);
  EXPECT_EQ(moved(forgot, "service_channels"), 0);
  EXPECT_EQ((*again)->binary(), first[0]->binary());
  // A service that is not there: an error naming it, nothing kept.
  auto nowhere = served.get("127.0.0.1:1", spec(2), sm80(), v1::direction_forward);
  ASSERT_FALSE(nowhere);
  EXPECT_NE(nowhere.error().message.find("127.0.0.1:1"), std::string::npos) << nowhere.error().message;
}

TEST_F(Service, ConcurrentClientsAndIdenticalMissesCompiledOnce) {
  constexpr int kThreads = 16, kEach = 15, kSpecs = 4;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      auto c = client();
      for (int i = 0; i < kEach; ++i) ok += c->getKernel(spec(2, 8 * ((t + i) % kSpecs)), sm80()).ok();
    });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(ok, kThreads * kEach);
  EXPECT_EQ(server_->compiles(), kSpecs);
}

TEST_F(Service, ADeadlineShorterThanTheCompile) {
  auto c = client();
  auto rushed = c->getKernel(spec(4), sm80(), /*deadlineMs=*/5);
  ASSERT_FALSE(rushed);
  EXPECT_NE(rushed.error().message.find("DEADLINE_EXCEEDED"), std::string::npos) << rushed.error().message;
  // The compile went on and lands in the cache.
  auto later = c->getKernel(spec(4), sm80());
  ASSERT_TRUE(later) << later.error().message;
}

TEST_F(Service, InvalidRequestsNameTheField) {
  auto c = client();
  KernelSpec bad = spec(4);
  bad.set_kv_heads(3);
  auto r = c->getKernel(bad, sm80());
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("INVALID_ARGUMENT"), std::string::npos);
  EXPECT_NE(r.error().message.find("kv_heads (3) must divide heads (4)"), std::string::npos) << r.error().message;

  KernelSpec huge = spec(4);
  huge.set_heads(100000);
  r = c->getKernel(huge, sm80());
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("spec.heads"), std::string::npos) << r.error().message;

  r = c->getKernel(spec(4), *parseTarget("cpu"));
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("target"), std::string::npos) << r.error().message;
  EXPECT_EQ(server_->compiles(), 0);
}

// The metrics page. (httplib.h must be compiled with the CPPHTTPLIB_*
// macros Debian's library was built with, service/CMakeLists.txt: without
// them httplib::Client is 8 bytes here and 16 in the library, whose code
// wrote the rest over this test's fixture under ThreadSanitizer.)
std::string metricsText(const KernelServer& server) {
  httplib::Client http("127.0.0.1", server.metricsPort());
  auto response = http.Get("/metrics");
  return response ? response->body : "";
}

// Many concurrent misses for one new spec: one ranking, one compile, and
// the metrics say so (the waiters of a shared compile record nothing).
TEST_F(Service, IdenticalMissesRankAndCompileOnceAndAreCountedOnce) {
  constexpr int kClients = 12;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < kClients; ++t)
    threads.emplace_back([&] { ok += client()->getKernel(spec(2, 40), sm80()).ok(); });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(ok, kClients);
  EXPECT_EQ(server_->compiles(), 1);
  const std::string metrics = metricsText(*server_);
  EXPECT_NE(metrics.find("loom_compile_seconds_count 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("loom_compiles_total 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("loom_rankings_total 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("loom_compiles_in_flight 0\n"), std::string::npos) << metrics;
}

// The cost model's choice is kept in the store: a restarted server serves
// the first request for that spec from the cache without ranking again.
TEST_F(Service, TheRankingSurvivesARestart) {
  auto first = client()->getKernel(spec(2, 48), sm80());
  ASSERT_TRUE(first) << first.error().message;
  server_->shutdown(1000);
  server_.reset();
  SetUp();
  auto again = client()->getKernel(spec(2, 48), sm80());
  ASSERT_TRUE(again) << again.error().message;
  EXPECT_EQ(again->origin(), "kernel cache");
  EXPECT_EQ(again->schedule_source(), "cost model");
  EXPECT_EQ(again->kernel().schedule().SerializeAsString(), first->kernel().schedule().SerializeAsString());
  const std::string metrics = metricsText(*server_);
  EXPECT_NE(metrics.find("loom_rankings_total 0\n"), std::string::npos) << metrics;
  EXPECT_EQ(server_->compiles(), 0);
}

// A second server on a port the first holds fails to start (no
// SO_REUSEPORT sharing of the first one's clients).
TEST_F(Service, ABusyPortIsAnError) {
  ServerOptions options;
  options.listen = address_;
  options.cacheDir = dir_ / "other";
  auto second = KernelServer::start(options);
  ASSERT_FALSE(second) << "a second server started on " << address_;
  EXPECT_NE(second.error().message.find("could not listen on " + address_), std::string::npos)
      << second.error().message;
}

// Archs and enum values the service cannot serve are refused by name,
// before any ranking or compile.
TEST_F(Service, UnsupportedArchsAndUnknownValuesAreNamed) {
  auto c = client();
  auto refused = [&](const KernelSpec& s, const v1::Target& t, const std::string& expected) {
    auto r = c->getKernel(s, t);
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("INVALID_ARGUMENT"), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find(expected), std::string::npos) << r.error().message;
  };
  refused(spec(2), *parseTarget("sm_75"), "target.arch 'sm_75': unsupported arch (loom supports sm_80 and later");
  refused(spec(2), *parseTarget("sm_999"), "target.arch 'sm_999' is not an arch this server's NVRTC");
  refused(spec(2), *parseTarget("cpu"), "target.kind must be cuda: the service serves CUDA kernels (got cpu)");
  KernelSpec bad = spec(2);
  bad.set_dtype(static_cast<v1::DType>(99));
  refused(bad, sm80(), "spec.dtype (99) is not float32, float16 or bfloat16");
  bad = spec(2);
  bad.set_mask(static_cast<v1::MaskMode>(42));
  refused(bad, sm80(), "spec.mask (42) is not flat_causal, token_causal or none");
  auto lookup = c->lookupDecision(spec(2), sm80(), v1::Direction(9));
  ASSERT_FALSE(lookup);
  EXPECT_NE(lookup.error().message.find("is not forward, backward, decode or decode_mixed"), std::string::npos)
      << lookup.error().message;
  EXPECT_EQ(server_->compiles(), 0);
  EXPECT_NE(metricsText(*server_).find("loom_rankings_total 0\n"), std::string::npos);
}

// Client text comes back as a short, escaped prefix, and the request log
// is one JSON object per line whatever a field holds.
TEST(ServiceInput, EchoesAreBoundedAndTheLogIsJson) {
  testing::TempDir dir;
  std::mutex mutex;
  std::vector<std::string> lines;
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.cacheDir = dir / "cache";
  options.requestLog = [&](const std::string& line) {
    std::lock_guard lock(mutex);
    lines.push_back(line);
  };
  auto server = KernelServer::start(options);
  ASSERT_TRUE(server) << server.error().message;
  auto c = KernelClient::connect("127.0.0.1:" + std::to_string((*server)->port()));
  ASSERT_TRUE(c);
  v1::Target huge = sm80();
  huge.set_arch(std::string(1 << 20, 'x'));
  auto r = (*c)->getKernel(spec(2), huge);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("INVALID_ARGUMENT"), std::string::npos) << r.error().message.substr(0, 200);
  EXPECT_LT(r.error().message.size(), 400u);
  EXPECT_NE(r.error().message.find("(1048576 bytes)"), std::string::npos) << r.error().message;
  v1::Target forged = sm80();
  forged.set_arch("x\"}\n{\"method\": \"PutTuning\", \"code\": \"OK\"}");
  r = (*c)->getKernel(spec(2), forged);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("'x\"}\\x0a{\"method\""), std::string::npos) << r.error().message;
  (*server)->shutdown(1000);
  std::lock_guard lock(mutex);
  ASSERT_EQ(lines.size(), 2u);
  for (const std::string& line : lines) {
    EXPECT_EQ(line.find('\n'), std::string::npos);
    EXPECT_LT(line.size(), 1400u);
    const auto json = nlohmann::json::parse(line, nullptr, false);
    ASSERT_FALSE(json.is_discarded()) << line;
    EXPECT_EQ(json["method"], "GetKernel");
    EXPECT_EQ(json["code"], "INVALID_ARGUMENT");
  }
}

// Every request message's bytes go through the same checks without a
// server (what the request fuzzer drives): garbage is INVALID_ARGUMENT.
TEST(ServiceInput, RequestBytesAreCheckedWithoutAServer) {
  v1::GetKernelRequest good;
  *good.mutable_spec() = spec(2);
  *good.mutable_target() = sm80();
  EXPECT_TRUE(checkRequestBytes("GetKernel", good.SerializeAsString()).ok());
  EXPECT_EQ(checkRequestBytes("GetKernel", "\xff\xff\xff").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(checkRequestBytes("Nothing", "").error_code(), grpc::StatusCode::UNIMPLEMENTED);
  v1::LeaseRequest lease;
  *lease.mutable_spec() = spec(2);
  lease.set_worker(std::string(300, 'w'));
  EXPECT_EQ(checkRequestBytes("AcquireLease", lease.SerializeAsString()).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(shortQuote("a'b\\c\x01"), "'a\\'b\\\\c\\x01'");
  EXPECT_EQ(shortQuote(std::string(50, 'z'), 4), "'zzzz'... (50 bytes)");
}

// The options of public IHA code are part of the spec: a spec with them is
// its own kernel (compiled once, then a hit), and options where they mean
// nothing are refused with the field named, before any compile.
TEST_F(Service, OptionsAreServedAsTheirOwnSpec) {
  auto c = client();
  KernelSpec options = spec(2);
  options.set_rope_theta(10000);
  options.set_qk_norm(v1::KernelSpec::rms);
  options.set_rope_direction(v1::KernelSpec::negative);
  options.set_window_rows(7);
  KernelSpec plain = options;
  testing::clearOptions(plain);
  auto first = c->getKernel(options, sm80());
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_EQ(first->origin(), "compiled now");
  EXPECT_EQ(first->kernel().spec().window_rows(), 7);
  auto other = c->getKernel(plain, sm80());
  ASSERT_TRUE(other) << other.error().message;
  EXPECT_EQ(other->origin(), "compiled now") << "a spec without the options is another kernel";
  EXPECT_NE(other->kernel().source(), first->kernel().source());
  auto again = c->getKernel(options, sm80());
  ASSERT_TRUE(again);
  EXPECT_EQ(again->origin(), "kernel cache");
  EXPECT_EQ(server_->compiles(), 2);

  KernelSpec bad = options;
  bad.set_mask(v1::token_causal);
  auto refused = c->getKernel(bad, sm80());
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("INVALID_ARGUMENT"), std::string::npos);
  EXPECT_NE(refused.error().message.find("window_rows counts a flat_causal window"), std::string::npos)
      << refused.error().message;
  bad = options;
  bad.set_qk_norm(static_cast<v1::KernelSpec::QkNorm>(7));  // a value no loom knows, as another client may send
  refused = c->getKernel(bad, sm80());
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("qk_norm must be none or rms"), std::string::npos) << refused.error().message;
  EXPECT_EQ(server_->compiles(), 2);
}

// A tuning result and its kernel as a fleet worker would send them.
std::pair<v1::TuningResult, v1::CompiledKernel> tuned(const KernelSpec& s) {
  jit::NvrtcCompiler compiler("");
  Schedule schedule;
  schedule.set_block_n(32);
  auto kernel = compileKernel(s, *resolveSchedule(s, schedule, sm80()), sm80(), compiler);
  EXPECT_TRUE(kernel) << kernel.error().message;
  v1::TuningResult result;
  *result.mutable_spec() = s;
  *result.mutable_target() = sm80();
  *result.mutable_best() = kernel->schedule();
  result.set_measured(true);
  result.set_median_ms(0.5);
  result.set_toolchain(jit::nvrtcVersion());
  return {result, *kernel};
}

TEST_F(Service, WritesNeedTheCredentialAndAreChecked) {
  const auto [result, kernel] = tuned(spec(2, 16));
  auto anonymous = client()->putTuning(result, kernel);
  ASSERT_FALSE(anonymous);
  EXPECT_NE(anonymous.error().message.find("UNAUTHENTICATED"), std::string::npos) << anonymous.error().message;
  auto wrong = client(dir_ / "wrong")->putTuning(result, kernel);
  ASSERT_FALSE(wrong);
  EXPECT_NE(wrong.error().message.find("PERMISSION_DENIED"), std::string::npos) << wrong.error().message;

  auto writer = client(dir_ / "token");
  v1::CompiledKernel tampered = kernel;
  tampered.set_source(kernel.source() + "\n// something else\n");
  auto rejected = writer->putTuning(result, tampered);
  ASSERT_FALSE(rejected);
  EXPECT_NE(rejected.error().message.find("kernel.source"), std::string::npos) << rejected.error().message;

  // A binary other than the one the server's own NVRTC builds from that
  // source is refused, however well its checksum matches.
  v1::CompiledKernel swapped = kernel;
  std::string binary = kernel.binary();
  binary[binary.size() / 2] ^= 0x5a;
  swapped.set_binary(binary);
  rejected = writer->putTuning(result, swapped);
  ASSERT_FALSE(rejected);
  EXPECT_NE(rejected.error().message.find("kernel.binary is not what this server's NVRTC"), std::string::npos)
      << rejected.error().message;

  auto stored = writer->putTuning(result, kernel);
  ASSERT_TRUE(stored) << stored.error().message;
  EXPECT_EQ(stored->artifact_key(), cache::artifactKey(kernel));
  // The tuned schedule is now what GetKernel serves for that device, from the cache.
  auto served = client()->getKernel(spec(2, 16), sm80());
  ASSERT_TRUE(served) << served.error().message;
  EXPECT_EQ(served->schedule_source(), "tuned");
  EXPECT_EQ(served->origin(), "kernel cache");
  EXPECT_EQ(served->kernel().schedule().block_n(), 32);
}

// Decisions by shape over the service: a tuning uploaded for a shape
// bucket is served to GetKernel and LookupDecision of that bucket and, the
// nearest tuned, of others; without a bucket, the decision for every
// shape (the default where none was tuned). Leases are per bucket, and a
// bucket of the wrong kind or form is refused naming the field.
TEST_F(Service, DecisionsAreServedByShapeBucket) {
  auto writer = client(dir_ / "token");
  auto [result, kernel] = tuned(spec(2, 16));
  result.set_shape_bucket("n8192");
  ASSERT_TRUE(writer->putTuning(result, kernel));
  for (const std::string bucket : {"n8192", "n4096"}) {
    auto served = client()->getKernel(spec(2, 16), sm80(), 60000, v1::direction_forward, bucket);
    ASSERT_TRUE(served) << served.error().message;
    EXPECT_EQ(served->kernel().schedule().block_n(), 32) << bucket;
    EXPECT_EQ(served->schedule_source(),
              bucket == "n8192" ? "tuned" : "tuned (tuned for shape bucket n8192, the nearest to n4096)");
    auto known = client()->lookupDecision(spec(2, 16), sm80(), v1::direction_forward, bucket);
    ASSERT_TRUE(known) << known.error().message;
    EXPECT_TRUE(known->found());
    EXPECT_EQ(known->result().shape_bucket(), "n8192");
  }
  EXPECT_TRUE(writer->acquireLease(spec(2, 16), sm80(), "node-a", 60, v1::direction_forward, "n1024")->granted());
  EXPECT_FALSE(writer->acquireLease(spec(2, 16), sm80(), "node-b", 60, v1::direction_forward, "n1024")->granted());
  EXPECT_TRUE(writer->acquireLease(spec(2, 16), sm80(), "node-b", 60, v1::direction_forward, "n2048")->granted())
      << "another bucket is leased apart";
  auto wrongKind = client()->getKernel(spec(2, 16), sm80(), 60000, v1::direction_forward, "c4096.b8");
  ASSERT_FALSE(wrongKind);
  EXPECT_NE(wrongKind.error().message.find("shape_bucket 'c4096.b8': a forward's or backward's bucket is n<tokens>"),
            std::string::npos)
      << wrongKind.error().message;
  auto malformed = client()->lookupDecision(spec(2, 16), sm80(), v1::direction_decode, "c4096");
  ASSERT_FALSE(malformed);
  EXPECT_NE(malformed.error().message.find("shape_bucket: shape bucket 'c4096'"), std::string::npos)
      << malformed.error().message;
}

TEST_F(Service, LeasesKeepTwoWorkersApartAndExpire) {
  auto writer = client(dir_ / "token");
  auto first = writer->acquireLease(spec(2), sm80(), "node-a", /*seconds=*/1);
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_TRUE(first->granted());
  auto second = writer->acquireLease(spec(2), sm80(), "node-b");
  ASSERT_TRUE(second);
  EXPECT_FALSE(second->granted());
  EXPECT_EQ(second->holder(), "node-a");
  EXPECT_TRUE(writer->acquireLease(spec(4), sm80(), "node-b")->granted()) << "another spec is free";
  std::this_thread::sleep_for(std::chrono::milliseconds(2100));  // node-a died: its lease lapses
  EXPECT_TRUE(writer->acquireLease(spec(2), sm80(), "node-b")->granted());
  ASSERT_TRUE(writer->releaseLease(spec(2), sm80(), "node-b"));
  EXPECT_TRUE(writer->acquireLease(spec(2), sm80(), "node-c")->granted());
  EXPECT_FALSE(client()->acquireLease(spec(8), sm80(), "anonymous"));
}

// `loom pretune` against the server: tunes what is missing, then skips it.
// One spec carries options of public IHA code: its decision is its own.
TEST_F(Service, PretuneTunesWhatIsMissingOnce) {
  KernelSpec options = spec(4, 4);
  options.set_qk_norm(v1::KernelSpec::rms);
  options.set_window(0);
  options.set_window_rows(9);
  std::ofstream(dir_ / "specs.json") << "[" << toJson(spec(2, 4)) << "," << toJson(options) << "]";
  const std::string command = "LOOM_CACHE_DIR=" + (dir_ / "worker") + " " + LOOM_BINARY + " pretune --server " +
                              address_ + " --specs " + (dir_ / "specs.json") + " --token-file " + (dir_ / "token") +
                              " --target sm_80 --tokens 256 --compile-top 1 --decode raw";
  const auto first = testing::runCommand(command);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  // Three directions of both specs: the backward and the raw-cache decode
  // step ranked offline too.
  EXPECT_NE(first.output.find("pretune: 6 tuned, 0 skipped, 0 failed"), std::string::npos) << first.output;
  EXPECT_NE(first.output.find("spec 1 (backward): tuned (untimed) and uploaded"), std::string::npos) << first.output;
  EXPECT_NE(first.output.find("spec 0 (decode, raw cache): tuned (untimed) and uploaded"), std::string::npos)
      << first.output;
  const auto second = testing::runCommand(command);
  ASSERT_EQ(second.exitCode, 0) << second.output;
  EXPECT_NE(second.output.find("pretune: 0 tuned, 6 skipped, 0 failed"), std::string::npos) << second.output;
  auto decodeDecision = client()->lookupDecision(options, *parseTarget("sm_80"), v1::direction_decode);
  ASSERT_TRUE(decodeDecision);
  EXPECT_TRUE(decodeDecision->found());
  EXPECT_EQ(decodeDecision->result().direction(), v1::direction_decode);
  EXPECT_FALSE(client()->lookupDecision(options, *parseTarget("sm_80"), v1::direction_decode_mixed)->found());
  auto backward = client()->lookupDecision(options, *parseTarget("sm_80"), v1::direction_backward);
  ASSERT_TRUE(backward);
  EXPECT_TRUE(backward->found());
  EXPECT_EQ(backward->result().direction(), v1::direction_backward);
  EXPECT_NE(backward->result().best().dq(), v1::dq_unspecified);  // a backward schedule says how dq is summed
  auto decision = client()->lookupDecision(options, *parseTarget("sm_80"));
  ASSERT_TRUE(decision);
  EXPECT_TRUE(decision->found());
  EXPECT_FALSE(decision->result().measured());
  EXPECT_EQ(decision->result().spec().window_rows(), 9);
  KernelSpec plain = options;
  testing::clearOptions(plain);
  auto withoutOptions = client()->lookupDecision(plain, *parseTarget("sm_80"));
  ASSERT_TRUE(withoutOptions);
  EXPECT_FALSE(withoutOptions->found()) << "the spec without its options was never tuned";

  // --buckets: each direction once per shape bucket, filed under it; the
  // decision for every shape above stays.
  std::ofstream(dir_ / "one.json") << "[" << toJson(spec(2, 4)) << "]";
  const std::string bucketed = "LOOM_CACHE_DIR=" + (dir_ / "worker") + " " + LOOM_BINARY + " pretune --server " +
                               address_ + " --specs " + (dir_ / "one.json") + " --token-file " + (dir_ / "token") +
                               " --target sm_80 --buckets 300,5000 --compile-top 1";
  const auto third = testing::runCommand(bucketed);
  ASSERT_EQ(third.exitCode, 0) << third.output;
  EXPECT_NE(third.output.find("pretune: 4 tuned, 0 skipped, 0 failed"), std::string::npos) << third.output;
  EXPECT_NE(third.output.find("spec 0 [n512]: tuned (untimed) and uploaded"), std::string::npos) << third.output;
  EXPECT_NE(third.output.find("spec 0 (backward) [n8192]: tuned (untimed) and uploaded"), std::string::npos)
      << third.output;
  const auto fourth = testing::runCommand(bucketed);
  EXPECT_NE(fourth.output.find("pretune: 0 tuned, 4 skipped, 0 failed"), std::string::npos) << fourth.output;
  for (const auto& [direction, bucket] : {std::pair{v1::direction_forward, "n512"}, {v1::direction_forward, "n8192"},
                                          {v1::direction_backward, "n512"}, {v1::direction_backward, "n8192"}}) {
    auto found = client()->lookupDecision(spec(2, 4), *parseTarget("sm_80"), direction, bucket);
    ASSERT_TRUE(found) << found.error().message;
    EXPECT_EQ(found->result().shape_bucket(), bucket);
  }
  EXPECT_EQ(client()->lookupDecision(spec(2, 4), *parseTarget("sm_80"))->result().shape_bucket(), "");
}

// One message through a method by name; returns the status and the reply bytes.
std::pair<grpc::Status, std::string> rawCall(const std::string& address, const std::string& method,
                                             const std::string& request) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue queue;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call = stub.PrepareCall(&context, method, &queue);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  queue.Next(&tag, &ok);
  grpc::Slice slice(request);
  grpc::ByteBuffer buffer(&slice, 1);
  call->Write(buffer, reinterpret_cast<void*>(2));
  queue.Next(&tag, &ok);
  call->WritesDone(reinterpret_cast<void*>(3));
  queue.Next(&tag, &ok);
  grpc::ByteBuffer reply;
  call->Read(&reply, reinterpret_cast<void*>(4));
  queue.Next(&tag, &ok);
  std::string bytes;
  if (ok) {
    std::vector<grpc::Slice> slices;
    (void)reply.Dump(&slices);
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  queue.Next(&tag, &ok);
  return {status, bytes};
}

TEST_F(Service, HealthReflectionAndMetricsAnswer) {
  // grpc.health.v1: an empty request (the whole server); SERVING is field 1 = 1.
  auto [health, healthReply] = rawCall(address_, "/grpc.health.v1.Health/Check", "");
  ASSERT_TRUE(health.ok()) << health.error_message();
  EXPECT_EQ(healthReply, std::string("\x08\x01", 2));
  // Reflection: list_services (field 7, empty string).
  auto [reflection, services] =
      rawCall(address_, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", std::string("\x3a\x00", 2));
  ASSERT_TRUE(reflection.ok()) << reflection.error_message();
  EXPECT_NE(services.find("loom.v1.KernelService"), std::string::npos);

  ASSERT_TRUE(client()->getKernel(spec(2), sm80()));
  const std::string metrics = metricsText(*server_);
  EXPECT_NE(metrics.find("loom_requests_total{method=\"GetKernel\",code=\"OK\"} 1"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("loom_cache_misses_total 1"), std::string::npos);
}

TEST(ServiceStartup, RefusesPlaintextOffLoopbackAndShortTokens) {
  ServerOptions options;
  options.listen = "0.0.0.0:0";
  auto open = KernelServer::start(options);
  ASSERT_FALSE(open);
  EXPECT_NE(open.error().message.find("without TLS"), std::string::npos);
  testing::TempDir dir;
  std::ofstream(dir / "token") << "short";
  options.listen = "127.0.0.1:0";
  options.tokenFile = dir / "token";
  auto weak = KernelServer::start(options);
  ASSERT_FALSE(weak);
  EXPECT_NE(weak.error().message.find("at least 16 characters"), std::string::npos);
}

// Waits until a `loom serve` child accepts TCP connections on 127.0.0.1:port,
// or has exited, or the deadline passed; a child that never listened is killed
// and reaped, so a failed wait leaves no server behind. Polling with plain sockets keeps the
// gRPC client out of its reconnect backoff: a channel that failed to connect
// while the server was still starting (slowly, under a sanitizer) waits up to
// seconds before it tries again, however soon the server is up.
::testing::AssertionResult waitUntilListening(pid_t server, int port, std::chrono::seconds deadline = std::chrono::seconds(90)) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (std::chrono::steady_clock::now() < until) {
    int status = 0;
    if (::waitpid(server, &status, WNOHANG) == server)
      return ::testing::AssertionFailure() << "loom serve exited before it listened (status " << status << ")";
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return ::testing::AssertionFailure() << "socket() failed";
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(uint16_t(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool connected = ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
    ::close(fd);
    if (connected) return ::testing::AssertionSuccess();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(server, SIGKILL);
  ::waitpid(server, nullptr, 0);
  return ::testing::AssertionFailure() << "loom serve did not listen on port " << port << " within " << deadline.count() << " s";
}

// `loom serve` killed with SIGKILL while uploads stream in: after a restart
// every acknowledged write is there.
TEST(ServiceCrash, AcknowledgedWritesSurviveSigkill) {
  testing::TempDir dir;
  std::ofstream(dir / "token") << kToken;
  auto startServer = [&](int port) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const std::string listen = "127.0.0.1:" + std::to_string(port);
      ::execl(LOOM_BINARY, LOOM_BINARY, "serve", "--listen", listen.c_str(), "--cache-dir", (dir / "cache").c_str(),
              "--token-file", (dir / "token").c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    return pid;
  };
  const int port = 20000 + int(::getpid() % 20000);
  pid_t server = startServer(port);
  ASSERT_TRUE(waitUntilListening(server, port));
  const std::string address = "127.0.0.1:" + std::to_string(port);
  auto writer = KernelClient::connect(address, dir / "token");
  ASSERT_TRUE(writer);
  const auto [result, kernel] = tuned(spec(2, 16));
  // Distinct decisions: the same kernel reported for several device models.
  std::vector<std::string> acknowledged;  // the upload thread's until it is joined
  std::atomic<int> acknowledgedCount{0};
  std::atomic<bool> stop{false};
  std::thread uploads([&] {
    for (int i = 0; i < 400 && !stop; ++i) {
      v1::TuningResult r = result;
      r.mutable_target()->mutable_device()->set_name("GPU " + std::to_string(i));
      if ((*writer)->putTuning(r, kernel).ok()) {
        acknowledged.push_back("GPU " + std::to_string(i));
        ++acknowledgedCount;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // not up yet, or gone
      }
    }
  });
  for (int wait = 0; wait < 200 && acknowledgedCount < 20; ++wait) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ::kill(server, SIGKILL);
  ::waitpid(server, nullptr, 0);
  stop = true;
  uploads.join();
  ASSERT_GE(acknowledged.size(), 10u) << "the server took too few writes before it was killed";

  server = startServer(port);
  ASSERT_TRUE(waitUntilListening(server, port));
  auto reader = KernelClient::connect(address);
  Result<v1::ListKernelsResponse> listed = makeError("not yet");
  for (int wait = 0; wait < 100 && !listed; ++wait) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    listed = (*reader)->listKernels();
  }
  ::kill(server, SIGTERM);
  ::waitpid(server, nullptr, 0);
  ASSERT_TRUE(listed) << listed.error().message;
  int found = 0;
  for (const std::string& device : acknowledged)
    for (const auto& entry : listed->entries()) found += entry.id().find(device + "|") != std::string::npos;
  EXPECT_EQ(found, int(acknowledged.size()));
}

// SIGTERM while a request compiles: the request still completes, then the
// server exits cleanly.
TEST(ServiceShutdown, FinishesRequestsInFlight) {
  testing::TempDir dir;
  const int port = 40000 + int(::getpid() % 20000);
  const pid_t server = ::fork();
  if (server == 0) {
    const std::string listen = "127.0.0.1:" + std::to_string(port);
    ::execl(LOOM_BINARY, LOOM_BINARY, "serve", "--listen", listen.c_str(), "--cache-dir", (dir / "cache").c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_TRUE(waitUntilListening(server, port));
  auto client = KernelClient::connect("127.0.0.1:" + std::to_string(port));
  ASSERT_TRUE(client);
  ASSERT_TRUE((*client)->listKernels());
  Result<v1::GetKernelResponse> response = makeError("not sent");
  std::thread request([&] { response = (*client)->getKernel(spec(8, 24), sm80()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(150));  // the compile is under way
  ::kill(server, SIGTERM);
  request.join();
  int status = 0;
  ::waitpid(server, &status, 0);
  ASSERT_TRUE(response) << response.error().message;
  EXPECT_EQ(response->origin(), "compiled now");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}


//===--- replicas on one PostgreSQL store --------------------------------===//

// `loom serve` processes on one database (a private PostgreSQL server):
// each on its own loopback port with its own metrics port.
class Replicas : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    postgres_ = testing::PostgresServer::start(&why);
    if (!postgres_ && why.find("not installed") != std::string::npos) GTEST_SKIP() << why;
    ASSERT_TRUE(postgres_) << why;
    url_ = postgres_->createDatabase();
    std::ofstream(dir_ / "token") << kToken;
  }
  void TearDown() override {
    for (const Replica& r : replicas_)
      if (r.pid > 0) {
        ::kill(r.pid, SIGKILL);
        ::waitpid(r.pid, nullptr, 0);
      }
  }

  struct Replica {
    pid_t pid = -1;
    int port = 0, metricsPort = 0;
    std::string address() const { return "127.0.0.1:" + std::to_string(port); }
  };

  void start(int count) {
    for (int i = 0; i < count; ++i) {
      Replica r;
      r.port = testing::freePort();
      r.metricsPort = testing::freePort();
      r.pid = ::fork();
      if (r.pid == 0) {
        const std::string listen = "127.0.0.1:" + std::to_string(r.port), metrics = std::to_string(r.metricsPort);
        const std::string cacheDir = dir_ / ("cache" + std::to_string(i));
        ::execl(LOOM_BINARY, LOOM_BINARY, "serve", "--listen", listen.c_str(), "--store", url_.c_str(), "--cache-dir",
                cacheDir.c_str(), "--metrics-port", metrics.c_str(), "--token-file", (dir_ / "token").c_str(),
                static_cast<char*>(nullptr));
        ::_exit(127);
      }
      replicas_.push_back(r);
    }
    for (const Replica& r : replicas_) ASSERT_TRUE(waitUntilListening(r.pid, r.port));
  }

  // Every replica's address, starting at replica `first`.
  std::string addresses(size_t first = 0) const {
    std::string list;
    for (size_t i = 0; i < replicas_.size(); ++i)
      list += (i ? "," : "") + replicas_[(first + i) % replicas_.size()].address();
    return list;
  }

  // One counter of a replica's metrics page (-1 when it cannot be read).
  int64_t metric(const Replica& r, const std::string& name) const {
    httplib::Client http("127.0.0.1", r.metricsPort);
    auto response = http.Get("/metrics");
    if (!response) return -1;
    const size_t at = response->body.find("\n" + name + " ");
    return at == std::string::npos ? -1 : std::stoll(response->body.substr(at + name.size() + 2));
  }

  testing::TempDir dir_;
  std::unique_ptr<testing::PostgresServer> postgres_;
  std::string url_;
  std::vector<Replica> replicas_;
};

// 64 clients spread over three replicas ask for overlapping specs: every
// call answers, and across the replicas each spec is compiled exactly once
// (the compile lease in the database); a lease taken through one replica
// is held against workers on the others.
TEST_F(Replicas, ThreeOnOneDatabaseCompileEachSpecOnce) {
  start(3);
  constexpr int kClients = 64, kSpecs = 6;
  std::atomic<int> ok{0};
  std::mutex errorsMutex;
  std::vector<std::string> errors;
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t)
    threads.emplace_back([&, t] {
      auto c = KernelClient::connect(addresses(size_t(t) % replicas_.size()));
      ASSERT_TRUE(c);
      for (int i = 0; i < kSpecs; ++i) {
        auto got = (*c)->getKernel(spec(2, 8 * ((t + i) % kSpecs)), sm80(), 300000);
        if (got) ++ok;
        else {
          std::lock_guard lock(errorsMutex);
          errors.push_back(got.error().message);
        }
      }
    });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(ok, kClients * kSpecs) << (errors.empty() ? "" : errors.front());
  int64_t compiles = 0, served = 0;
  for (const Replica& r : replicas_) {
    const int64_t mine = metric(r, "loom_compiles_total");
    ASSERT_GE(mine, 0) << "replica on " << r.address() << " has no metrics";
    compiles += mine;
    served += metric(r, "loom_cache_hits_total") + metric(r, "loom_cache_misses_total");
  }
  EXPECT_EQ(compiles, kSpecs) << "each spec compiled once across the replicas";
  EXPECT_EQ(served, kClients * kSpecs) << "every request answered by some replica";

  auto a = KernelClient::connect(replicas_[0].address(), dir_ / "token");
  auto b = KernelClient::connect(replicas_[2].address(), dir_ / "token");
  ASSERT_TRUE(a && b);
  auto first = (*a)->acquireLease(spec(4), sm80(), "worker-a", 60);
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_TRUE(first->granted());
  auto second = (*b)->acquireLease(spec(4), sm80(), "worker-b", 60);
  ASSERT_TRUE(second) << second.error().message;
  EXPECT_FALSE(second->granted());
  EXPECT_EQ(second->holder(), "worker-a");
}

// SIGKILL of one replica while writers upload through all three: every
// acknowledged upload is in the database, the writers fail over and keep
// going with no error, and the other replicas serve what was written.
TEST_F(Replicas, AKilledReplicaLosesNoAcknowledgedUploadAndClientsFailOver) {
  start(3);
  const auto [result, kernel] = tuned(spec(2, 16));
  constexpr int kWriters = 4;
  std::mutex mutex;
  std::vector<std::string> acknowledged, errors;
  std::atomic<int> count{0}, afterKill{0};
  std::atomic<bool> killed{false}, stop{false};
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w)
    writers.emplace_back([&, w] {
      auto writer = KernelClient::connect(addresses(size_t(w) % replicas_.size()), dir_ / "token");
      ASSERT_TRUE(writer);
      for (int i = 0; !stop && i < 1000; ++i) {
        v1::TuningResult r = result;
        const std::string device = "GPU " + std::to_string(w) + "-" + std::to_string(i);
        r.mutable_target()->mutable_device()->set_name(device);
        auto put = (*writer)->putTuning(r, kernel);
        std::lock_guard lock(mutex);
        if (put) {
          acknowledged.push_back(device);
          ++count;
          afterKill += killed.load();
        } else {
          errors.push_back(put.error().message);
        }
      }
    });
  for (int wait = 0; wait < 600 && count < 40; ++wait) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_GE(count, 40) << "the replicas took too few writes";
  ::kill(replicas_[0].pid, SIGKILL);
  ::waitpid(replicas_[0].pid, nullptr, 0);
  replicas_[0].pid = -1;
  killed = true;
  for (int wait = 0; wait < 600 && afterKill < 40; ++wait) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  stop = true;
  for (auto& thread : writers) thread.join();
  EXPECT_GE(afterKill, 40) << "the writers did not go on through the other replicas";
  EXPECT_TRUE(errors.empty()) << errors.size() << " uploads failed, the first: " << errors.front();

  auto reader = KernelClient::connect(addresses(0));  // the dead replica first: the client moves on
  ASSERT_TRUE(reader);
  auto listed = (*reader)->listKernels();
  ASSERT_TRUE(listed) << listed.error().message;
  std::set<std::string> devices;
  for (const auto& entry : listed->entries())
    if (entry.kind() == "decision") devices.insert(entry.id());
  int found = 0;
  for (const std::string& device : acknowledged)
    for (const std::string& id : devices) found += id.find("/" + device + "|") != std::string::npos;
  EXPECT_EQ(found, int(acknowledged.size())) << "acknowledged uploads missing after the kill";
  v1::Target gpu = sm80();
  gpu.mutable_device()->set_name(acknowledged.back());
  auto decision = (*reader)->lookupDecision(spec(2, 16), gpu);
  ASSERT_TRUE(decision) << decision.error().message;
  EXPECT_TRUE(decision->found());
  EXPECT_NE((*reader)->address(), replicas_[0].address());
}

}  // namespace
}  // namespace loom::service
