#include "loom/served.h"

namespace loom::service {

Result<std::shared_ptr<const v1::CompiledKernel>> ServedKernels::get(const std::string& service,
                                                                     const v1::KernelSpec& spec,
                                                                     const v1::Target& target,
                                                                     v1::Direction direction,
                                                                     const std::string& shapeBucket) {
  const std::string key = service + '\0' + target.SerializeAsString() + '\0' + std::to_string(int(direction)) + '\0' +
                          spec.SerializeAsString() + '\0' + shapeBucket;
  std::lock_guard lock(mutex_);
  if (auto found = kernels_.find(key); found != kernels_.end()) return found->second;
  std::unique_ptr<KernelClient>& client = clients_[service];
  if (!client) {
    auto connected = KernelClient::connect(service);
    if (!connected) return connected.error();
    client = std::move(*connected);
  }
  auto response = client->getKernel(spec, target, 60000, direction, shapeBucket);
  if (!response) return makeError(service + ": " + response.error().message);
  return kernels_[key] = std::make_shared<const v1::CompiledKernel>(std::move(*response->mutable_kernel()));
}

void ServedKernels::forget() {
  std::lock_guard lock(mutex_);
  kernels_.clear();
}

}  // namespace loom::service
