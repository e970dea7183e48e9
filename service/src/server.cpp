// KernelService: thin handlers that validate, call the core (KernelProvider,
// the kernel cache, the tuner) and map results to gRPC status codes.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <httplib.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <future>
#include <map>
#include <set>
#include <mutex>
#include <regex>
#include <thread>

#include "api/provider.h"
#include "autotune/tuner.h"
#include "loom/cache_dir.h"
#include "cuda/driver.h"
#include "loom/cache.h"
#include "loom/client.h"
#include "loom/compiler.h"
#include "loom/hash.h"
#include "loom/service.h"
#include "loom/v1/service.grpc.pb.h"
#include "metrics.h"

namespace loom::service {
namespace {

using grpc::ServerContext;
using grpc::Status;
using grpc::StatusCode;

// Requests beyond these sizes are refused before any work starts.
constexpr int kMaxHeads = 1024;
constexpr int kMaxPseudoHeads = 64;
constexpr int kMaxWindow = 1 << 24;
constexpr int64_t kMaxTuneTokens = 1 << 20;

Status invalid(const std::string& message) { return Status(StatusCode::INVALID_ARGUMENT, message); }

Status checkSpec(const KernelSpec& spec) {
  if (spec.heads() > kMaxHeads || spec.kv_heads() > kMaxHeads)
    return invalid("spec.heads / spec.kv_heads over the limit of " + std::to_string(kMaxHeads));
  if (spec.pseudo_heads() > kMaxPseudoHeads)
    return invalid("spec.pseudo_heads over the limit of " + std::to_string(kMaxPseudoHeads));
  if (spec.window() > kMaxWindow) return invalid("spec.window over the limit of " + std::to_string(kMaxWindow));
  if (spec.window_rows() > kMaxWindow)
    return invalid("spec.window_rows over the limit of " + std::to_string(kMaxWindow));
  if (loom::Status valid = validateSpec(spec); !valid) return invalid("spec." + valid.error().message);
  return Status::OK;
}

Status checkTarget(const v1::Target& target) {
  if (target.kind() != v1::Target::cuda || !std::regex_match(target.arch(), std::regex("sm_[0-9]{2,3}a?")))
    return invalid("target: kind must be cuda with an arch such as sm_90a, got '" + target.arch() + "'");
  return Status::OK;
}

class KernelServiceImpl final : public v1::KernelService::Service {
 public:
  KernelServiceImpl(const ServerOptions& options, std::string token, Metrics& metrics)
      : cacheDir_(options.cacheDir.empty() ? defaultCacheDir() : options.cacheDir),
        provider_(cacheDir_, options.maxConcurrentCompiles),
        token_(std::move(token)),
        metrics_(metrics) {
    // A miss with no decision compiles the cost model's best schedule
    // (ranked once per spec and target, then remembered).
    provider_.setScheduleChooser([this](const KernelSpec& spec, const v1::Target& target) -> Result<Schedule> {
      const std::string key = cache::specKey(spec) + "/" + cache::DeviceModel::of(target).key();
      {
        std::lock_guard lock(rankedMutex_);
        if (auto found = ranked_.find(key); found != ranked_.end()) return found->second;
      }
      const autotune::SearchSpace space = autotune::searchSpace(spec, target);
      if (space.candidates.empty()) return makeError("no schedule fits");
      const autotune::Candidate* best = nullptr;
      double bestSeconds = 0;
      for (const auto& c : space.candidates) {
        const double seconds = autotune::estimateCost(spec, c.schedule, target, 1, kRankingTokens).seconds;
        if (!best || seconds < bestSeconds) best = &c, bestSeconds = seconds;
      }
      std::lock_guard lock(rankedMutex_);
      ranked_[key] = best->schedule;
      return best->schedule;
    });
    if (auto device = cuda::Device::open(0); device) device_ = *device;
  }

  Status GetKernel(ServerContext* context, const v1::GetKernelRequest* request,
                   v1::GetKernelResponse* response) override {
    return count("GetKernel", [&]() -> Status {
      if (Status ok = checkSpec(request->spec()); !ok.ok()) return ok;
      if (Status ok = checkTarget(request->target()); !ok.ok()) return ok;
      // The work runs apart from this call: past the deadline the caller gets
      // DEADLINE_EXCEEDED while the compile finishes into the cache.
      auto promise = std::make_shared<std::promise<Result<ProvidedKernel>>>();
      auto future = promise->get_future();
      std::thread([this, promise, spec = request->spec(), target = request->target(), worker = Worker(*this)] {
        ++metrics_.compilesInFlight;
        const auto start = std::chrono::steady_clock::now();
        auto provided = provider_.provide(spec, target);
        --metrics_.compilesInFlight;
        if (provided && provided->origin == "compiled now")
          metrics_.compileSeconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        promise->set_value(std::move(provided));
      }).detach();
      if (future.wait_until(context->deadline()) != std::future_status::ready)
        return Status(StatusCode::DEADLINE_EXCEEDED, "the kernel is still compiling; it will be in the cache");
      auto provided = future.get();
      if (!provided) return Status(StatusCode::INVALID_ARGUMENT, provided.error().message);
      if (provided->scheduleSource == "cost model") tuneInBackground(request->spec(), request->target());
      (provided->origin == "kernel cache" ? metrics_.cacheHits : metrics_.cacheMisses)++;
      *response->mutable_kernel() = std::move(provided->kernel);
      response->set_origin(provided->origin);
      response->set_schedule_source(provided->scheduleSource);
      return Status::OK;
    });
  }

  Status ListKernels(ServerContext*, const v1::ListKernelsRequest*, v1::ListKernelsResponse* response) override {
    return count("ListKernels", [&]() -> Status {
      if (!provider_.store()) return Status(StatusCode::UNAVAILABLE, "the kernel cache is unavailable");
      auto entries = provider_.store()->list();
      if (!entries) return Status(StatusCode::INTERNAL, entries.error().message);
      for (const auto& e : *entries) {
        v1::CacheEntry* entry = response->add_entries();
        entry->set_kind(e.kind);
        entry->set_id(e.id);
        entry->set_summary(e.summary);
        entry->set_bytes(e.bytes);
        entry->set_last_used(e.lastUsed);
      }
      return Status::OK;
    });
  }

  Status PutTuning(ServerContext* context, const v1::PutTuningRequest* request,
                   v1::PutTuningResponse* response) override {
    return count("PutTuning", [&]() -> Status {
      if (Status ok = authorize(*context); !ok.ok()) return ok;
      const v1::TuningResult& result = request->result();
      const v1::CompiledKernel& kernel = request->kernel();
      if (Status ok = checkSpec(result.spec()); !ok.ok()) return ok;
      if (Status ok = checkTarget(result.target()); !ok.ok()) return ok;
      // Clients will execute this kernel on their GPUs: it must be what it claims.
      if (ContentHash().add(kernel.SerializeAsString()).hex() != request->kernel_checksum())
        return invalid("kernel_checksum does not match the kernel");
      if (kernel.binary().empty() || kernel.entries().empty()) return invalid("kernel: no binary or entry points");
      if (kernel.spec().SerializeAsString() != result.spec().SerializeAsString())
        return invalid("kernel.spec differs from result.spec");
      if (kernel.target().arch() != result.target().arch()) return invalid("kernel.target.arch differs from result.target.arch");
      if (kernel.schedule().SerializeAsString() != result.best().SerializeAsString())
        return invalid("kernel.schedule is not result.best");
      auto plan = generateKernel(result.spec(), result.best(), result.target());
      if (!plan || plan->source != kernel.source())
        return invalid("kernel.source is not what this server generates for result.spec and result.best");
      if (!provider_.store()) return Status(StatusCode::UNAVAILABLE, "the kernel cache is unavailable");
      if (loom::Status ok = provider_.store()->putArtifact(kernel); !ok) return Status(StatusCode::INTERNAL, ok.error().message);
      cache::Decision decision;
      decision.spec = result.spec();
      decision.device = cache::DeviceModel::of(result.target());
      decision.toolchain = result.toolchain();
      decision.result = result;
      decision.candidatesJson = request->candidates_json().empty() ? "[]" : request->candidates_json();
      decision.artifactKey = cache::artifactKey(kernel);
      if (loom::Status ok = provider_.store()->putDecision(decision); !ok) return Status(StatusCode::INTERNAL, ok.error().message);
      response->set_artifact_key(decision.artifactKey);
      return Status::OK;
    });
  }

  Status Tune(ServerContext* context, const v1::TuneRequest* request, grpc::ServerWriter<v1::TuneUpdate>* writer) override {
    return count("Tune", [&]() -> Status {
      if (Status ok = authorize(*context); !ok.ok()) return ok;
      if (Status ok = checkSpec(request->spec()); !ok.ok()) return ok;
      if (Status ok = checkTarget(request->target()); !ok.ok()) return ok;
      if (request->tokens() < 0 || request->tokens() > kMaxTuneTokens || request->batch() < 0 || request->batch() > 64)
        return invalid("tokens or batch out of range");
      autotune::TuneOptions options;
      options.tokens = request->tokens() ? request->tokens() : options.tokens;
      options.batch = request->batch() ? request->batch() : options.batch;
      options.budgetSeconds = request->budget_seconds() > 0 ? request->budget_seconds() : 60;
      options.cacheDir = cacheDir_;
      std::shared_ptr<cuda::Device> device;  // tuned offline unless this server has the GPU asked for
      if (auto opened = cuda::Device::open(0); opened && (*opened)->info().arch() == request->target().arch())
        device = *opened;
      ++metrics_.tunes;
      std::vector<v1::CompiledKernel> compiled;
      auto report = autotune::tune(request->spec(), request->target(), device, options,
                                   [&](const autotune::TuneProgress& p) {
                                     v1::TuneUpdate update;
                                     update.set_candidates(p.candidates);
                                     update.set_compiled(p.compiled);
                                     update.set_verified(p.verified);
                                     update.set_timed(p.timed);
                                     update.set_best(p.best);
                                     writer->Write(update);
                                   },
                                   &compiled);
      if (!report) return Status(StatusCode::FAILED_PRECONDITION, report.error().message);
      if (provider_.store())
        (void)autotune::storeTuning(*provider_.store(), request->spec(), request->target(), *report, compiled);
      v1::TuneUpdate done;
      done.set_done(true);
      *done.mutable_result() = report->result;
      writer->Write(done);
      return Status::OK;
    });
  }

  Status LookupDecision(ServerContext*, const v1::LookupDecisionRequest* request,
                        v1::LookupDecisionResponse* response) override {
    return count("LookupDecision", [&]() -> Status {
      if (Status ok = checkSpec(request->spec()); !ok.ok()) return ok;
      if (Status ok = checkTarget(request->target()); !ok.ok()) return ok;
      if (!provider_.store()) return Status(StatusCode::UNAVAILABLE, "the kernel cache is unavailable");
      auto found = provider_.store()->getDecision(request->spec(), cache::DeviceModel::of(request->target()),
                                                  jit::nvrtcVersion());
      if (!found) return Status(StatusCode::INTERNAL, found.error().message);
      if (found->has_value()) {
        response->set_found(!(*found)->fallback);
        response->set_fallback((*found)->fallback);
        *response->mutable_result() = (*found)->decision.result;
      }
      return Status::OK;
    });
  }

  Status AcquireLease(ServerContext* context, const v1::LeaseRequest* request, v1::LeaseResponse* response) override {
    return count("AcquireLease", [&]() -> Status {
      if (Status ok = authorize(*context); !ok.ok()) return ok;
      if (Status ok = checkSpec(request->spec()); !ok.ok()) return ok;
      if (request->worker().empty()) return invalid("worker: name the worker taking the lease");
      const std::string key = leaseKey(*request);
      const int64_t now = nowSeconds();
      std::lock_guard lock(leaseMutex_);
      auto& lease = leases_[key];
      if (lease.expires > now && lease.holder != request->worker()) {
        response->set_granted(false);
        response->set_holder(lease.holder);
        response->set_expires_unix(lease.expires);
        return Status::OK;
      }
      lease = {request->worker(), now + (request->seconds() > 0 ? request->seconds() : kDefaultLeaseSeconds)};
      response->set_granted(true);
      response->set_holder(lease.holder);
      response->set_expires_unix(lease.expires);
      return Status::OK;
    });
  }

  Status ReleaseLease(ServerContext* context, const v1::LeaseRequest* request, v1::LeaseResponse* response) override {
    return count("ReleaseLease", [&]() -> Status {
      if (Status ok = authorize(*context); !ok.ok()) return ok;
      std::lock_guard lock(leaseMutex_);
      auto found = leases_.find(leaseKey(*request));
      if (found != leases_.end() && found->second.holder == request->worker()) leases_.erase(found);
      response->set_granted(true);
      return Status::OK;
    });
  }

  int64_t compiles() const { return provider_.compiles(); }

  // Work that outlives its request (a compile past its deadline, a
  // background tune) finishes before the service goes away.
  ~KernelServiceImpl() override {
    std::unique_lock lock(workersMutex_);
    workersDone_.wait(lock, [this] { return workers_ == 0; });
  }

 private:
  class Worker {  // counts a detached thread while it lives
   public:
    explicit Worker(KernelServiceImpl& service) : service_(&service) {
      std::lock_guard lock(service_->workersMutex_);
      ++service_->workers_;
    }
    Worker(const Worker& other) : Worker(*other.service_) {}
    ~Worker() {
      std::lock_guard lock(service_->workersMutex_);
      if (--service_->workers_ == 0) service_->workersDone_.notify_all();
    }

   private:
    KernelServiceImpl* service_;
  };
  std::mutex workersMutex_;
  std::condition_variable workersDone_;
  int workers_ = 0;

  static constexpr int64_t kRankingTokens = 4096;

  // With the GPU a request asked for, an untuned spec is tuned in the
  // background (once) and its decision stored for the next request.
  void tuneInBackground(const KernelSpec& spec, const v1::Target& target) {
    if (!device_ || device_->info().arch() != target.arch()) return;
    {
      std::lock_guard lock(leaseMutex_);
      if (!backgroundTunes_.insert(cache::specKey(spec) + "/" + target.arch()).second) return;
    }
    std::thread([this, spec, target, worker = Worker(*this)] {
      autotune::TuneOptions options;
      options.cacheDir = cacheDir_;
      options.budgetSeconds = 60;
      std::vector<v1::CompiledKernel> compiled;
      auto report = autotune::tune(spec, cuda::targetOf(device_->info()), device_, options, {}, &compiled);
      if (!report || !provider_.store()) return;
      ++metrics_.tunes;
      (void)autotune::storeTuning(*provider_.store(), spec, cuda::targetOf(device_->info()), *report, compiled);
    }).detach();
  }

  std::shared_ptr<cuda::Device> device_;  // this server's GPU, if any
  std::mutex rankedMutex_;
  std::map<std::string, Schedule> ranked_;  // the cost model's choice per spec and device model
  std::set<std::string> backgroundTunes_;
  static constexpr int kDefaultLeaseSeconds = 600;
  struct Lease {
    std::string holder;
    int64_t expires = 0;
  };
  static int64_t nowSeconds() {
    return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  }
  static std::string leaseKey(const v1::LeaseRequest& request) {
    return cache::specKey(request.spec()) + "/" + cache::DeviceModel::of(request.target()).key();
  }
  std::mutex leaseMutex_;
  std::map<std::string, Lease> leases_;

  template <typename Handler>
  Status count(const std::string& method, Handler handler) {
    const Status status = handler();
    const char* code = statusCodeName(status.error_code());
    metrics_.request(method, code);
    std::fprintf(stderr, "{\"method\": \"%s\", \"code\": \"%s\"%s%s%s}\n", method.c_str(), code,
                 status.ok() ? "" : ", \"message\": \"", status.ok() ? "" : status.error_message().c_str(), status.ok() ? "" : "\"");
    return status;
  }

  Status authorize(const ServerContext& context) const {
    if (token_.empty()) return Status(StatusCode::PERMISSION_DENIED, "this server takes no writes: start it with --token-file");
    const auto found = context.client_metadata().find("authorization");
    if (found == context.client_metadata().end())
      return Status(StatusCode::UNAUTHENTICATED, "writes need an authorization: Bearer <token> header");
    if (std::string(found->second.data(), found->second.size()) != "Bearer " + token_)
      return Status(StatusCode::PERMISSION_DENIED, "the credential is not accepted");
    return Status::OK;
  }

  std::string cacheDir_;
  KernelProvider provider_;
  std::string token_;
  Metrics& metrics_;
};

bool isLoopback(const std::string& address) {
  return address.rfind("127.", 0) == 0 || address.rfind("localhost:", 0) == 0 || address.rfind("[::1]", 0) == 0;
}

class Server final : public KernelServer {
 public:
  Result<int> start(const ServerOptions& options) {
    std::string token;
    if (!options.tokenFile.empty()) {
      auto text = readTextFile(options.tokenFile);
      if (!text) return makeError("--token-file: " + text.error().message);
      token = *text;
      while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
      if (token.size() < 16) return makeError("--token-file: the token must be at least 16 characters");
    }
    std::shared_ptr<grpc::ServerCredentials> credentials;
    if (!options.tlsCert.empty()) {
      auto cert = readTextFile(options.tlsCert);
      auto key = readTextFile(options.tlsKey);
      if (!cert || !key) return makeError("--tls-cert / --tls-key: cannot read the certificate or key");
      grpc::SslServerCredentialsOptions ssl(options.tlsClientCa.empty()
                                                ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
      ssl.pem_key_cert_pairs.push_back({*key, *cert});
      if (!options.tlsClientCa.empty()) {
        auto ca = readTextFile(options.tlsClientCa);
        if (!ca) return makeError("--tls-client-ca: " + ca.error().message);
        ssl.pem_root_certs = *ca;
      }
      credentials = grpc::SslServerCredentials(ssl);
    } else if (!isLoopback(options.listen)) {
      return makeError("refusing to serve " + options.listen +
                       " without TLS: plaintext is only for loopback (give --tls-cert and --tls-key)");
    } else {
      credentials = grpc::InsecureServerCredentials();
    }
    service_ = std::make_unique<KernelServiceImpl>(options, token, metrics_);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    builder.AddListeningPort(options.listen, credentials, &port_);
    builder.RegisterService(service_.get());
    builder.SetMaxReceiveMessageSize(options.maxMessageBytes);
    builder.SetMaxSendMessageSize(256 << 20);
    server_ = builder.BuildAndStart();
    if (!server_ || port_ == 0) return makeError("could not listen on " + options.listen);
    if (options.metricsPort >= 0) {
      http_ = std::make_unique<httplib::Server>();
      http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& response) {
        response.set_content(metrics_.text(), "text/plain; version=0.0.4");
      });
      metricsPort_ = options.metricsPort == 0 ? http_->bind_to_any_port("127.0.0.1")
                                              : (http_->bind_to_port("127.0.0.1", options.metricsPort) ? options.metricsPort : -1);
      if (metricsPort_ < 0) return makeError("could not listen for metrics on port " + std::to_string(options.metricsPort));
      httpThread_ = std::thread([this] { http_->listen_after_bind(); });
    }
    return port_;
  }

  ~Server() override { shutdown(0); }
  int port() const override { return port_; }
  int metricsPort() const override { return metricsPort_; }
  int64_t compiles() const override { return service_->compiles(); }

  void shutdown(int graceMilliseconds) override {
    std::lock_guard lock(shutdownMutex_);
    if (stopped_ || !server_) return;
    stopped_ = true;
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(graceMilliseconds));
    if (http_) {
      http_->stop();
      if (httpThread_.joinable()) httpThread_.join();
    }
  }
  void wait() override { server_->Wait(); }

 private:
  Metrics metrics_;
  std::unique_ptr<KernelServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<httplib::Server> http_;
  std::thread httpThread_;
  int port_ = 0, metricsPort_ = -1;
  std::mutex shutdownMutex_;
  bool stopped_ = false;
};

}  // namespace

Result<std::unique_ptr<KernelServer>> KernelServer::start(const ServerOptions& options) {
  auto server = std::make_unique<Server>();
  auto started = server->start(options);
  if (!started) return started.error();
  return std::unique_ptr<KernelServer>(std::move(server));
}

}  // namespace loom::service
