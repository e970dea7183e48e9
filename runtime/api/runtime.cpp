// Runtime: spec -> generated program -> NVRTC -> loaded Kernel on the GPU.
#include "loom/runtime.h"

#include "api/provider.h"
#include "loom/cache_dir.h"
#include "cuda/driver.h"
#include "jit/nvrtc_compiler.h"
#include "loom/cache.h"
#include "loom/compiler.h"

namespace loom {

struct Runtime::State {
  std::shared_ptr<cuda::Device> device;
  std::unique_ptr<KernelProvider> provider;
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<Kernel>> kept;  // by direction, spec and schedule (serialized)
};

Runtime::~Runtime() = default;

Result<std::unique_ptr<Runtime>> Runtime::create(const Options& options) {
  auto device = cuda::Device::open(options.device);
  if (!device) return device.error();
  std::unique_ptr<Runtime> runtime(new Runtime());
  runtime->state_ = std::make_unique<State>();
  runtime->state_->device = *device;
  runtime->state_->provider =
      std::make_unique<KernelProvider>(options.cacheDir.empty() ? defaultCacheDir() : options.cacheDir);
  return runtime;
}

std::shared_ptr<cuda::Device> Runtime::gpu() const { return state_->device; }

const cuda::DeviceInfo& Runtime::device() const { return state_->device->info(); }

v1::Target Runtime::target() const { return cuda::targetOf(device()); }

// The provider's kernel for `direction`, loaded, its provenance saying
// where it came from (`what` names a direction other than the forward).
Result<std::shared_ptr<Kernel>> Runtime::provideAndLoad(const KernelSpec& spec, const Schedule& schedule,
                                                        v1::Direction direction, const std::string& what,
                                                        bool keepsForward, const std::string& shapeBucket) {
  const std::string key = std::to_string(int(direction)) + (keepsForward ? "k" : "") + '\0' +
                          spec.SerializeAsString() + '\0' + schedule.SerializeAsString() + '\0' + shapeBucket;
  {
    std::lock_guard lock(state_->mutex);
    if (auto found = state_->kept.find(key); found != state_->kept.end()) return found->second;
  }
  auto provided = state_->provider->provide(spec, target(), schedule, direction, keepsForward, shapeBucket);
  if (!provided) return provided.error();
  auto kernel = load(provided->kernel);
  if (!kernel) return kernel.error();
  (*kernel)->provenance_ = provided->origin + ", " + provided->scheduleSource + " schedule" + what;
  std::lock_guard lock(state_->mutex);
  return state_->kept.emplace(key, *kernel).first->second;  // another thread's, where it loaded first
}

void Runtime::reload() {
  std::lock_guard lock(state_->mutex);
  state_->kept.clear();
}

Result<std::shared_ptr<Kernel>> Runtime::kernel(const KernelSpec& spec, const Schedule& schedule,
                                                const std::string& shapeBucket) {
  return provideAndLoad(spec, schedule, v1::direction_forward, "", false, shapeBucket);
}

Result<std::shared_ptr<Kernel>> Runtime::keepingKernel(const KernelSpec& spec, const Schedule& schedule,
                                                       const std::string& shapeBucket) {
  return provideAndLoad(spec, schedule, v1::direction_forward, " (keeping the forward)", true, shapeBucket);
}

Result<std::shared_ptr<Kernel>> Runtime::backwardKernel(const KernelSpec& spec, const Schedule& schedule,
                                                        const std::string& shapeBucket) {
  return provideAndLoad(spec, schedule, v1::direction_backward, " (backward)", false, shapeBucket);
}

Result<std::shared_ptr<Kernel>> Runtime::decodeKernel(const KernelSpec& spec, CacheLayout layout,
                                                      const Schedule& schedule, const std::string& shapeBucket) {
  return provideAndLoad(spec, schedule, decodeDirectionOf(layout),
                        std::string(" (decode, ") + cacheLayoutName(layout) + " cache)", false, shapeBucket);
}

Result<std::shared_ptr<Kernel>> Runtime::load(const v1::CompiledKernel& compiled) {
  return Kernel::load(state_->device, compiled);
}

}  // namespace loom
