// grpc_client: fetch a kernel from a loom service over gRPC, then launch it
// through the host API and check it against the float64 reference.
//
//   grpc_client [--server HOST:PORT] [spec.json]
//
// Without --server it starts a service in-process on a loopback port. Without
// a GPU it fetches the kernel (for sm_90a) and says why it cannot launch.
#include <cstdio>
#include <random>
#include <string>

#include "cuda/case_runner.h"
#include "cuda/driver.h"
#include "io/case.h"
#include "loom/client.h"
#include "loom/compiler.h"
#include "loom/runtime.h"
#include "loom/service.h"
#include "reference/iha_reference.h"

namespace {

constexpr const char* kDefaultSpec = R"({"heads": 4, "kv_heads": 2, "pseudo_heads": 4, "head_dim": 64,
  "mask": "flat_causal", "window": 0, "collapse": "per_head", "rope_theta": 10000, "dtype": "float16"})";

}  // namespace

int main(int argc, char** argv) {
  std::string server, specText = kDefaultSpec;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--server" && i + 1 < argc) server = argv[++i];
    else if (auto text = loom::readTextFile(arg); text) specText = *text;
    else return std::fprintf(stderr, "grpc_client: %s\n", text.error().message.c_str()), 2;
  }
  auto spec = loom::parseSpecJson(specText, "spec");
  if (!spec) return std::fprintf(stderr, "grpc_client: %s\n", spec.error().message.c_str()), 2;

  std::unique_ptr<loom::service::KernelServer> local;
  if (server.empty()) {
    loom::service::ServerOptions options;
    options.listen = "127.0.0.1:0";
    auto started = loom::service::KernelServer::start(options);
    if (!started) return std::fprintf(stderr, "grpc_client: %s\n", started.error().message.c_str()), 1;
    local = std::move(*started);
    server = "127.0.0.1:" + std::to_string(local->port());
  }

  // Ask for the kernel of this machine's GPU (or of an H200 when there is none).
  auto device = loom::cuda::Device::open(0);
  const loom::v1::Target target = device ? loom::cuda::targetOf((*device)->info()) : *loom::parseTarget("sm_90a");
  auto client = loom::service::KernelClient::connect(server);
  if (!client) return std::fprintf(stderr, "grpc_client: %s\n", client.error().message.c_str()), 1;
  auto response = (*client)->getKernel(*spec, target);
  if (!response) return std::fprintf(stderr, "grpc_client: %s\n", response.error().message.c_str()), 1;
  std::printf("fetched from %s: %s for %s (%s), schedule %s\n", server.c_str(), response->origin().c_str(),
              target.arch().c_str(), response->schedule_source().c_str(),
              response->kernel().schedule().ShortDebugString().c_str());
  if (!device) {
    std::printf("not launched: %s\n", device.error().message.c_str());
    return 0;
  }
  auto kernel = loom::Kernel::load(*device, response->kernel());
  if (!kernel) return std::fprintf(stderr, "grpc_client: %s\n", kernel.error().message.c_str()), 1;
  const loom::IhaCase input = loom::drawCheckableCase(*spec, 1, 300, std::random_device{}());
  auto run = loom::cuda::runCase(**kernel, **device, input);
  if (!run) return std::fprintf(stderr, "grpc_client: %s\n", run.error().message.c_str()), 1;
  const double error = loom::relativeError(run->out, *input.expected);
  std::printf("launched on %s: relative error %.2e against the float64 reference\n", (*device)->info().name.c_str(), error);
  return error <= loom::toleranceFor(spec->dtype()) ? 0 : 1;
}
