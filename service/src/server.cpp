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
#include "loom/request_checks.h"

namespace loom::service {
namespace {

using grpc::ServerContext;
using grpc::Status;
using grpc::StatusCode;

constexpr int kMaxRankings = 4096;  // remembered in memory; the store keeps them all

Status invalid(const std::string& message) { return Status(StatusCode::INVALID_ARGUMENT, message); }

class KernelServiceImpl final : public v1::KernelService::Service {
 public:
  KernelServiceImpl(const ServerOptions& options, std::string cacheDir, std::unique_ptr<cache::KernelStore> store,
                    std::string token, Metrics& metrics)
      : cacheDir_(std::move(cacheDir)),
        provider_(cacheDir_, options.maxConcurrentCompiles, std::move(store)),
        token_(std::move(token)),
        metrics_(metrics),
        log_(options.requestLog ? options.requestLog
                                : [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); }) {
    // A miss with no decision compiles the cost model's best schedule.
    provider_.setScheduleChooser(
        [this](const KernelSpec& spec, const v1::Target& target) { return rankedSchedule(spec, target); });
    metrics_.setCounters([this] { return provider_.compiles(); }, [this] { return provider_.compilesInFlight(); });
    if (auto device = cuda::Device::open(0); device) device_ = *device;
  }

  Status GetKernel(ServerContext* context, const v1::GetKernelRequest* request,
                   v1::GetKernelResponse* response) override {
    return count("GetKernel", [&]() -> Status {
      if (Status ok = checkRequest(*request); !ok.ok()) return ok;
      // The work runs apart from this call: past the deadline the caller gets
      // DEADLINE_EXCEEDED while the compile finishes into the cache.
      // Identical requests in flight share one piece of work, so what
      // outlives its callers is one thread per distinct (spec, target), at
      // most kMaxOutstanding of them: past that the server sheds requests
      // instead of queueing compiles without end.
      const std::string key = cache::decisionSpecKey(request->spec(), request->direction()) + "@" +
                              request->shape_bucket() + "/" + request->target().SerializeAsString();
      std::shared_future<Result<ProvidedKernel>> future;
      {
        std::lock_guard lock(pendingMutex_);
        if (auto found = pending_.find(key); found != pending_.end()) {
          future = found->second;
        } else {
          if (pending_.size() >= kMaxOutstanding)
            return Status(StatusCode::RESOURCE_EXHAUSTED, "the server is working on " +
                                                              std::to_string(kMaxOutstanding) +
                                                              " distinct kernel requests; retry later");
          auto promise = std::make_shared<std::promise<Result<ProvidedKernel>>>();
          future = promise->get_future().share();
          pending_.emplace(key, future);
          std::thread([this, promise, key, spec = request->spec(), target = request->target(),
                       direction = request->direction(), bucket = request->shape_bucket(), worker = Worker(*this)] {
            auto provided = provider_.provide(spec, target, {}, direction, false, bucket);
            if (provided && provided->compileSeconds) metrics_.compileSeconds(*provided->compileSeconds);
            {
              // Forgotten before it is answered: a request that comes after the answer must not
              // join this finished work and hear "compiled now" again (the kernel is in the
              // store by now, so it finds it there).
              std::lock_guard lock(pendingMutex_);
              pending_.erase(key);
            }
            promise->set_value(std::move(provided));
          }).detach();
        }
      }
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
      if (Status ok = checkRequest(*request); !ok.ok()) return ok;
      // Clients will execute this kernel on their GPUs: it must be what it claims.
      if (ContentHash().add(kernel.SerializeAsString()).hex() != request->kernel_checksum())
        return invalid("kernel_checksum does not match the kernel");
      GenerateOptions generate;
      generate.direction = directionOf(result.direction());
      generate.mixedCache = mixedCacheOf(result.direction());
      auto plan = generateKernel(result.spec(), result.best(), result.target(), generate);
      if (!plan || plan->source != kernel.source())
        return invalid("kernel.source is not what this server generates for result.spec and result.best");
      if (!provider_.store()) return Status(StatusCode::UNAVAILABLE, "the kernel cache is unavailable");
      // The binary is a function of the source, the options and the
      // toolchain: the server compiles the source itself (or has it cached),
      // keeps its own binary and takes only the measurements, and only when
      // the worker's binary is the same bytes.
      auto own = provider_.provide(result.spec(), result.target(), result.best(), result.direction());
      if (!own) return Status(StatusCode::INTERNAL, "compiling kernel.source here: " + own.error().message);
      if (own->kernel.binary() != kernel.binary() || own->kernel.toolchain() != kernel.toolchain())
        return invalid("kernel.binary is not what this server's NVRTC (" + own->kernel.toolchain() +
                       ") builds from kernel.source: tune with the same toolchain as the server");
      cache::Decision decision;
      decision.spec = result.spec();
      decision.device = cache::DeviceModel::of(result.target());
      decision.toolchain = result.toolchain();
      decision.result = result;
      decision.candidatesJson = request->candidates_json().empty() ? "[]" : request->candidates_json();
      decision.artifactKey = cache::artifactKey(own->kernel);
      if (loom::Status ok = provider_.store()->putDecision(decision); !ok) return Status(StatusCode::INTERNAL, ok.error().message);
      response->set_artifact_key(decision.artifactKey);
      return Status::OK;
    });
  }

  Status Tune(ServerContext* context, const v1::TuneRequest* request, grpc::ServerWriter<v1::TuneUpdate>* writer) override {
    return count("Tune", [&]() -> Status {
      if (Status ok = authorize(*context); !ok.ok()) return ok;
      if (Status ok = checkRequest(*request); !ok.ok()) return ok;
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
      if (Status ok = checkRequest(*request); !ok.ok()) return ok;
      if (!provider_.store()) return Status(StatusCode::UNAVAILABLE, "the kernel cache is unavailable");
      auto found = provider_.store()->getDecision(request->spec(), cache::DeviceModel::of(request->target()),
                                                  jit::nvrtcVersion(), request->direction(), request->shape_bucket());
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
      if (Status ok = checkRequest(*request); !ok.ok()) return ok;
      const std::string key = leaseKey(*request);
      const int64_t seconds = request->seconds() > 0 ? request->seconds() : kDefaultLeaseSeconds;
      if (provider_.store()) {  // in the store: every replica on it sees the same leases
        auto lease = provider_.store()->acquireLease(key, request->worker(), seconds);
        if (!lease) return Status(StatusCode::UNAVAILABLE, lease.error().message);
        response->set_granted(lease->granted);
        response->set_holder(lease->holder);
        response->set_expires_unix(lease->expires);
        return Status::OK;
      }
      const int64_t now = nowSeconds();
      std::lock_guard lock(leaseMutex_);
      auto& lease = leases_[key];
      if (lease.expires > now && lease.holder != request->worker()) {
        response->set_granted(false);
        response->set_holder(lease.holder);
        response->set_expires_unix(lease.expires);
        return Status::OK;
      }
      lease = {request->worker(), now + seconds};
      response->set_granted(true);
      response->set_holder(lease.holder);
      response->set_expires_unix(lease.expires);
      return Status::OK;
    });
  }

  Status ReleaseLease(ServerContext* context, const v1::LeaseRequest* request, v1::LeaseResponse* response) override {
    return count("ReleaseLease", [&]() -> Status {
      if (Status ok = authorize(*context); !ok.ok()) return ok;
      if (provider_.store()) {
        if (loom::Status ok = provider_.store()->releaseLease(leaseKey(*request), request->worker()); !ok)
          return Status(StatusCode::UNAVAILABLE, ok.error().message);
        response->set_granted(true);
        return Status::OK;
      }
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
  static constexpr size_t kMaxOutstanding = 256;
  std::mutex pendingMutex_;
  std::map<std::string, std::shared_future<Result<ProvidedKernel>>> pending_;  // GetKernel work in flight

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

  // The cost model's best schedule for (spec, device model): ranked once
  // however many requests ask at the same time, remembered, and kept in the
  // store so a restarted server need not rank again.
  Result<Schedule> rankedSchedule(const KernelSpec& spec, const v1::Target& target) {
    const std::string key = cache::specKey(spec) + "/" + cache::DeviceModel::of(target).key() + "/" +
                            autotune::kCostModelVersion + "/" + cache::kGeneratorVersion;
    std::promise<Result<Schedule>> promise;
    std::shared_future<Result<Schedule>> known;
    {
      std::lock_guard lock(rankedMutex_);
      if (auto found = ranked_.find(key); found != ranked_.end()) {
        known = found->second;
      } else {
        if (ranked_.size() >= kMaxRankings) ranked_.clear();
        ranked_.emplace(key, promise.get_future().share());
      }
    }
    if (known.valid()) return known.get();  // waits, outside the lock, for a ranking under way
    Result<Schedule> best = [&]() -> Result<Schedule> {
      if (provider_.store())
        if (auto kept = provider_.store()->getRanking(key); kept && kept->has_value()) return **kept;
      ++metrics_.rankings;
      const autotune::SearchSpace space = autotune::searchSpace(spec, target);
      auto ranked = autotune::rankByModel(spec, target, space, 1, kRankingTokens);
      if (ranked.empty()) return makeError("no schedule fits");
      if (provider_.store()) (void)provider_.store()->putRanking(key, ranked.front().candidate.schedule);
      return ranked.front().candidate.schedule;
    }();
    promise.set_value(best);
    return best;
  }

  std::shared_ptr<cuda::Device> device_;  // this server's GPU, if any
  std::mutex rankedMutex_;
  std::map<std::string, std::shared_future<Result<Schedule>>> ranked_;
  std::set<std::string> backgroundTunes_;
  static constexpr int kDefaultLeaseSeconds = 600;
  struct Lease {
    std::string holder;
    int64_t expires = 0;
  };
  static int64_t nowSeconds() {
    return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  }
  // "tune/<decision key>@<bucket>/<device model>": beside the provider's
  // "compile/" leases in the store.
  static std::string leaseKey(const v1::LeaseRequest& request) {
    return "tune/" + cache::decisionSpecKey(request.spec(), request.direction()) + "@" + request.shape_bucket() + "/" +
           cache::DeviceModel::of(request.target()).key();
  }
  std::mutex leaseMutex_;
  std::map<std::string, Lease> leases_;

  template <typename Handler>
  Status count(const std::string& method, Handler handler) {
    Status status = handler();
    const char* code = statusCodeName(status.error_code());
    metrics_.request(method, code);
    log_(requestLogLine(method, code, status.error_message()));
    // No answer carries more than a bounded message, whatever went into it.
    if (status.error_message().size() > kMaxErrorMessage)
      status = Status(status.error_code(), status.error_message().substr(0, kMaxErrorMessage) + "...");
    return status;
  }
  static constexpr size_t kMaxErrorMessage = 2048;

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
  std::function<void(const std::string&)> log_;
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
    // The store: the one named (PostgreSQL for replicas, or a SQLite file),
    // which must open; else the cache folder's SQLite file, which a server
    // survives losing (it then compiles every request).
    const std::string cacheDir = options.cacheDir.empty() ? defaultCacheDir() : options.cacheDir;
    std::unique_ptr<cache::KernelStore> store;
    if (!options.store.empty()) {
      auto opened = cache::openStore(options.store);
      if (!opened) return makeError("--store " + cache::redactedLocation(options.store) + ": " + opened.error().message);
      store = std::move(*opened);
    } else {
      store = KernelProvider::openCacheStore(cacheDir);
    }
    service_ = std::make_unique<KernelServiceImpl>(options, cacheDir, std::move(store), token, metrics_);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    // A port another server holds is an error, not a share of its clients.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.AddListeningPort(options.listen, credentials, &port_);
    builder.RegisterService(service_.get());
    builder.SetMaxReceiveMessageSize(options.maxMessageBytes);
    builder.SetMaxSendMessageSize(256 << 20);
    server_ = builder.BuildAndStart();
    if (!server_ || port_ == 0)
      return makeError("could not listen on " + options.listen + " (is another server on that port?)");
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
