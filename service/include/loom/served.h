// Kernels taken from loom services and kept for the life of the process:
// one channel a service, one GetKernel a (service, target, direction,
// spec); a later call is a map lookup and sends nothing (loom/counters.h:
// service_channels and service_requests stay put). loom.iha(service=...),
// loom.iha_backward and loom.decode take their kernels here.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "loom/client.h"
#include "loom/result.h"

namespace loom::service {

class ServedKernels {
 public:
  // The kernel `service` ("host:port") serves for the key (and shape
  // bucket: GetKernelRequest.shape_bucket), fetched once.
  Result<std::shared_ptr<const v1::CompiledKernel>> get(const std::string& service, const v1::KernelSpec& spec,
                                                        const v1::Target& target, v1::Direction direction,
                                                        const std::string& shapeBucket = "");
  // Drops the kept kernels (a decision tuned since is fetched on the next
  // call), not the channels.
  void forget();

 private:
  std::mutex mutex_;
  std::map<std::string, std::unique_ptr<KernelClient>> clients_;
  std::map<std::string, std::shared_ptr<const v1::CompiledKernel>> kernels_;
};

}  // namespace loom::service
