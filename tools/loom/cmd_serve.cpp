// loom serve: the kernel service. loom get: ask one for a kernel.
#include <csignal>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "autotune/measure.h"
#include "commands.h"
#include "cuda/case_runner.h"
#include "cuda/driver.h"
#include "loom/client.h"
#include "loom/compiler.h"
#include "loom/cache.h"
#include "loom/runtime.h"
#include "loom/service.h"

namespace loom::cli {
namespace {

std::atomic<bool> stopRequested{false};

int serve(const service::ServerOptions& options, int graceSeconds) {
  auto server = service::KernelServer::start(options);
  if (!server) return badInput(server.error().message);
  std::printf("loom serve: listening on %s (port %d), store %s%s%s; health and reflection on\n",
              options.listen.c_str(), (*server)->port(),
              options.store.empty() ? "the cache folder's SQLite file" : cache::redactedLocation(options.store).c_str(),
              (*server)->metricsPort() > 0 ? ", metrics on http://127.0.0.1:" : "",
              (*server)->metricsPort() > 0 ? (std::to_string((*server)->metricsPort()) + "/metrics").c_str() : "");
  std::fflush(stdout);
  std::signal(SIGINT, [](int) { stopRequested = true; });
  std::signal(SIGTERM, [](int) { stopRequested = true; });
  while (!stopRequested) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::printf("loom serve: shutting down, finishing requests in flight\n");
  (*server)->shutdown(graceSeconds * 1000);
  return kExitOk;
}

struct GetOptions {
  std::string server;
  bool embedded = false;
  std::string specPath;
  std::string target;
  std::string dtype;
  std::string tokenFile;
  std::string cacheDir;
  int deadlineMs = 120000;
  int64_t tokens = 4096;
};

// Times the kernel on random inputs as the tuner does (L2 flushed, median of
// 10 after warm-up).
void reportSpeed(const v1::CompiledKernel& compiled, int64_t tokens) {
  auto device = cuda::Device::open(0);
  if (!device) return;
  auto kernel = Kernel::load(*device, compiled);
  if (!kernel) return;
  const IhaCase c = drawCase(compiled.spec(), 1, tokens, std::random_device{}());
  auto buffers = cuda::CaseBuffers::upload(**device, c);
  auto flush = cuda::DeviceBuffer::allocate(**device, autotune::kL2FlushBytes);
  if (!buffers || !flush) return;
  auto timing = autotune::timeLaunches(**kernel, **device, {buffers->tensors()}, *flush, {3, 10, 10, 0});
  if (!timing) return;
  std::printf("speed: %.3f ms median for B=1, N=%lld on %s\n", timing->medianMs, (long long)tokens,
              (*device)->info().name.c_str());
}

int get(const GetOptions& options) {
  auto spec = readSpecFile(options.specPath);
  if (!spec) return badInput(spec.error().message);
  if (Status ok = overrideDtype(*spec, options.dtype); !ok) return badInput(ok.error().message);
  v1::Target target;
  if (!options.target.empty()) {
    auto parsed = parseTarget(options.target);
    if (!parsed) return badInput(parsed.error().message);
    target = *parsed;
  } else if (auto device = cuda::Device::open(0); device) {
    target = cuda::targetOf((*device)->info());
  } else {
    target = *parseTarget("sm_90a");
  }

  std::unique_ptr<service::KernelServer> embedded;
  std::string address = options.server;
  if (options.embedded) {  // the service in this process, on a loopback port, with its SQLite cache
    service::ServerOptions serverOptions;
    serverOptions.listen = "127.0.0.1:0";
    serverOptions.cacheDir = options.cacheDir;
    auto started = service::KernelServer::start(serverOptions);
    if (!started) return badInput(started.error().message);
    embedded = std::move(*started);
    address = "127.0.0.1:" + std::to_string(embedded->port());
    std::printf("started the service on %s with its embedded SQLite kernel cache\n", address.c_str());
  }
  if (address.empty()) return badInput("give --server HOST:PORT or --embedded");
  auto client = service::KernelClient::connect(address, options.tokenFile);
  if (!client) return badInput(client.error().message);
  auto response = (*client)->getKernel(*spec, target, options.deadlineMs);
  if (!response) return badInput(response.error().message);
  const v1::CompiledKernel& k = response->kernel();
  std::printf("kernel for %s on %s: %s, %s schedule\n", options.specPath.c_str(), target.arch().c_str(),
              response->origin().c_str(), response->schedule_source().c_str());
  std::printf("schedule: %s\n", k.schedule().ShortDebugString().c_str());
  std::printf("toolchain: %s, compiled in %.2f s, %zu-byte binary\n", k.toolchain().c_str(), k.compile_seconds(),
              k.binary().size());
  for (const auto& r : k.resources())
    std::printf("  %-14s %3d registers, %lld spill bytes\n", r.entry().c_str(), r.registers(),
                (long long)(r.spill_store_bytes() + r.spill_load_bytes()));
  for (const auto& e : k.entries())
    std::printf("  %-14s %4d threads, %lld bytes of dynamic shared memory\n", e.name().c_str(), e.threads(),
                (long long)e.shared_memory_bytes());
  if (cuda::driver().ok() && k.target().arch() == target.arch()) reportSpeed(k, options.tokens);
  else std::printf("speed: not measured (no GPU here)\n");
  if (embedded) embedded->shutdown();
  return kExitOk;
}

}  // namespace

void addServeCommands(CLI::App& app, std::function<int()>* action) {
  auto serveOptions = std::make_shared<service::ServerOptions>();
  CLI::App* serveCmd = app.add_subcommand(
      "serve", "Serve tuned, compiled IHA kernels over gRPC (KernelService; health and reflection on),\n"
               "from the kernel store (the cache folder's SQLite file, or --store postgresql://... that\n"
               "several replicas share), compiling misses with NVRTC (each once across the replicas).\n"
               "Plaintext only on loopback.");
  serveCmd->add_option("--listen", serveOptions->listen, "address to listen on")->capture_default_str();
  serveCmd->add_option("--cache-dir", serveOptions->cacheDir, "kernel cache folder (default ~/.cache/loom)");
  serveCmd->add_option("--store", serveOptions->store,
                       "the kernel store, if not the cache folder's SQLite file: postgresql://USER@HOST:PORT/DB\n"
                       "(a database several replicas share; docs/fleet.md) or a SQLite file");
  serveCmd->add_option("--token-file", serveOptions->tokenFile, "bearer token that writes (PutTuning, Tune) need");
  serveCmd->add_option("--tls-cert", serveOptions->tlsCert, "PEM certificate (with --tls-key) to serve TLS");
  serveCmd->add_option("--tls-key", serveOptions->tlsKey, "PEM private key");
  serveCmd->add_option("--tls-client-ca", serveOptions->tlsClientCa, "require client certificates signed by this CA");
  serveCmd->add_option("--metrics-port", serveOptions->metricsPort, "Prometheus metrics port (-1: off, 0: any)")
      ->capture_default_str();
  serveCmd->add_option("--max-compiles", serveOptions->maxConcurrentCompiles, "NVRTC compiles at once")
      ->capture_default_str();
  auto graceSeconds = std::make_shared<int>(60);
  serveCmd->add_option("--grace-seconds", *graceSeconds,
                       "on SIGTERM or SIGINT: how long requests in flight (a compile, a tuning) may take to finish "
                       "before they are cancelled")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  serveCmd->callback([serveOptions, graceSeconds, action] {
    *action = [serveOptions, graceSeconds] { return serve(*serveOptions, *graceSeconds); };
  });

  auto getOptions = std::make_shared<GetOptions>();
  CLI::App* getCmd = app.add_subcommand(
      "get", "Ask a kernel service for a spec's kernel and say where it came from (cache, compiled now,\n"
             "tuned schedule), its schedule and resources and, with a GPU, its speed.");
  getCmd->add_option("--server", getOptions->server, "HOST:PORT of a loom serve");
  getCmd->add_flag("--embedded", getOptions->embedded, "start the service in this process instead");
  getCmd->add_option("--spec", getOptions->specPath, "KernelSpec JSON file")->required();
  getCmd->add_option("--target", getOptions->target, "CUDA arch (default: this machine's GPU, else sm_90a)");
  getCmd->add_option("--dtype", getOptions->dtype, "override the spec's dtype (float16 or bfloat16)");
  getCmd->add_option("--token-file", getOptions->tokenFile, "bearer token file");
  getCmd->add_option("--cache-dir", getOptions->cacheDir, "with --embedded: the kernel cache folder");
  getCmd->add_option("--deadline-ms", getOptions->deadlineMs, "deadline of the request")->capture_default_str();
  getCmd->add_option("--tokens", getOptions->tokens, "N for the speed measurement")->capture_default_str();
  getCmd->callback([getOptions, action] { *action = [getOptions] { return get(*getOptions); }; });
}

}  // namespace loom::cli
