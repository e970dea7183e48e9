// host_jit: a host application that asks loom for an IHA kernel at run time
// and runs one forward pass on the GPU.
//
//   host_jit [spec.json] [--tokens N]
//
// Without a GPU it still JIT-compiles the kernel for sm_90a with NVRTC and
// prints the resource report, then says why it cannot launch.
#include <cstdio>
#include <random>
#include <string>

#include "api/compile.h"
#include "cuda/case_runner.h"
#include "cuda/driver.h"
#include "io/case.h"
#include "loom/runtime.h"
#include "loom/spec.h"
#include "reference/iha_reference.h"

namespace {

constexpr const char* kDefaultSpec = R"({"heads": 8, "kv_heads": 8, "pseudo_heads": 8, "head_dim": 64,
  "mask": "flat_causal", "window": 0, "collapse": "per_head", "rope_theta": 10000, "dtype": "bfloat16"})";

}  // namespace

int main(int argc, char** argv) {
  std::string specText = kDefaultSpec, origin = "built-in spec";
  int64_t tokens = 256;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--tokens" && i + 1 < argc) {
      tokens = std::stoll(argv[++i]);
    } else if (arg == "--help") {
      std::printf("usage: host_jit [spec.json] [--tokens N]\n");
      return 0;
    } else {
      auto text = loom::readTextFile(arg);
      if (!text) return std::fprintf(stderr, "host_jit: %s\n", text.error().message.c_str()), 2;
      specText = *text;
      origin = arg;
    }
  }
  auto spec = loom::parseSpecJson(specText, origin);
  if (!spec) return std::fprintf(stderr, "host_jit: %s\n", spec.error().message.c_str()), 2;

  auto runtime = loom::Runtime::create();
  if (!runtime) {
    // No GPU: the JIT half still runs.
    loom::v1::Target target;
    target.set_kind(loom::v1::Target::cuda);
    target.set_arch("sm_90a");
    loom::jit::NvrtcCompiler compiler("");
    auto compiled = loom::compileKernel(*spec, {}, target, compiler);
    if (!compiled) return std::fprintf(stderr, "host_jit: %s\n%s\n", compiled.error().message.c_str(), compiled.error().log.c_str()), 1;
    std::printf("compiled %s for %s in %.2f s (%s):\n", origin.c_str(), target.arch().c_str(),
                compiled->compile_seconds(), compiled->toolchain().c_str());
    for (const auto& r : compiled->resources())
      std::printf("  %-14s %3d registers, %lld spill bytes\n", r.entry().c_str(), r.registers(),
                  (long long)(r.spill_store_bytes() + r.spill_load_bytes()));
    std::printf("not launched: %s\n", runtime.error().message.c_str());
    return 0;
  }

  auto kernel = (*runtime)->kernel(*spec);
  if (!kernel) return std::fprintf(stderr, "host_jit: %s\n%s\n", kernel.error().message.c_str(), kernel.error().log.c_str()), 1;
  std::printf("%s on %s (%s): schedule %s\n", origin.c_str(), (*runtime)->device().name.c_str(),
              (*runtime)->device().arch().c_str(), (*kernel)->compiled().schedule().ShortDebugString().c_str());

  // One forward pass on random inputs, checked against the float64 reference.
  const loom::IhaCase input = loom::drawCheckableCase(*spec, 1, tokens, std::random_device{}());
  auto device = loom::cuda::Device::open(0);
  if (!device) return std::fprintf(stderr, "host_jit: %s\n", device.error().message.c_str()), 1;
  auto run = loom::cuda::runCase(**kernel, **device, input);
  if (!run) return std::fprintf(stderr, "host_jit: %s\n", run.error().message.c_str()), 1;
  const double error = loom::relativeError(run->out, *input.expected);
  std::printf("N = %lld: relative error %.2e against the float64 reference (tolerance %.0e)\n", (long long)tokens,
              error, loom::toleranceFor(spec->dtype()));
  return error <= loom::toleranceFor(spec->dtype()) ? 0 : 1;
}
