// Runtime: spec -> generated program -> NVRTC -> loaded Kernel on the GPU.
#include "loom/runtime.h"

#include "api/compile.h"
#include "cpu/cpu_backend.h"
#include "cuda/driver.h"
#include "jit/nvrtc_compiler.h"
#include "loom/cache.h"
#include "loom/compiler.h"

namespace loom {

struct Runtime::State {
  std::shared_ptr<cuda::Device> device;
  std::unique_ptr<jit::NvrtcCompiler> compiler;
  std::unique_ptr<cache::KernelStore> store;  // null when disabled or unusable
};

Runtime::~Runtime() = default;

Result<std::unique_ptr<Runtime>> Runtime::create(const Options& options) {
  auto device = cuda::Device::open(options.device);
  if (!device) return device.error();
  std::unique_ptr<Runtime> runtime(new Runtime());
  runtime->state_ = std::make_unique<State>();
  runtime->state_->device = *device;
  const std::string cacheDir = options.cacheDir.empty() ? cpu::defaultCacheDir() : options.cacheDir;
  runtime->state_->compiler = std::make_unique<jit::NvrtcCompiler>(cacheDir);
  if (options.useKernelCache) {
    auto store = cache::openSqliteStore(cacheDir + "/kernels.sqlite");
    if (store) runtime->state_->store = std::move(*store);
    else std::fprintf(stderr, "loom: kernel cache unavailable (%s); compiling without it\n", store.error().message.c_str());
  }
  return runtime;
}

const cuda::DeviceInfo& Runtime::device() const { return state_->device->info(); }

v1::Target Runtime::target() const { return cuda::targetOf(device()); }

Result<std::shared_ptr<Kernel>> Runtime::kernel(const KernelSpec& spec, const Schedule& schedule) {
  const v1::Target device = target();
  cache::KernelStore* store = state_->store.get();
  Schedule chosen = schedule;
  std::string provenance = schedule.ByteSizeLong() ? "given schedule" : "default schedule";
  if (store && !schedule.ByteSizeLong()) {
    auto decision = store->getDecision(spec, cache::DeviceModel::of(device), jit::nvrtcVersion());
    if (decision && decision->has_value()) {
      chosen = (*decision)->decision.result.best();
      provenance = std::string((*decision)->decision.result.measured() ? "tuned" : "ranked (untimed)") + " schedule" +
                   ((*decision)->fallback ? " (" + (*decision)->note + ")" : "");
    }
  }
  // The artifact's address needs the generated source; generating is cheap.
  auto plan = generateKernel(spec, chosen, device);
  if (!plan) return plan.error();
  v1::CompiledKernel probe = toCompiledKernel(*plan);
  probe.set_toolchain(jit::nvrtcVersion() + (jit::nvrtcKnowsArch(device.arch()) ? " cubin" : " ptx"));
  if (store) {
    auto hit = store->getArtifact(cache::artifactKey(probe));
    if (hit && hit->has_value()) {
      auto kernel = load(**hit);
      if (kernel) (*kernel)->provenance_ = "kernel cache, " + provenance;
      return kernel;
    }
  }
  auto compiled = compileKernel(spec, chosen, device, *state_->compiler);
  if (!compiled) return compiled.error();
  if (store) (void)store->putArtifact(*compiled);  // a cache that cannot write only costs a recompile
  auto kernel = load(*compiled);
  if (kernel) (*kernel)->provenance_ = "compiled now, " + provenance;
  return kernel;
}

Result<std::shared_ptr<Kernel>> Runtime::load(const v1::CompiledKernel& compiled) {
  return Kernel::load(state_->device, compiled);
}

}  // namespace loom
