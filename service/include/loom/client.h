// A C++ client of KernelService: fetch kernels, list the cache, upload
// tuning results.
#pragma once

#include <memory>
#include <string>

#include "loom/result.h"
#include "loom/v1/service.grpc.pb.h"

namespace loom::service {

class KernelClient {
 public:
  // `tokenFile` (optional) holds the bearer token sent with writes;
  // `tlsRoots` (optional) a PEM file of roots to trust (else plaintext).
  static Result<std::unique_ptr<KernelClient>> connect(const std::string& address, const std::string& tokenFile = "",
                                                       const std::string& tlsRoots = "");

  // `shapeBucket` (cache::shapeBucket of the launches' shapes): that
  // bucket's decision, else the nearest tuned one's, else every shape's.
  Result<v1::GetKernelResponse> getKernel(const v1::KernelSpec& spec, const v1::Target& target, int deadlineMs = 60000,
                                          v1::Direction direction = v1::direction_forward,
                                          const std::string& shapeBucket = "");
  Result<v1::ListKernelsResponse> listKernels();
  Result<v1::PutTuningResponse> putTuning(const v1::TuningResult& result, const v1::CompiledKernel& kernel,
                                          const std::string& candidatesJson = "[]");

  Result<v1::LookupDecisionResponse> lookupDecision(const v1::KernelSpec& spec, const v1::Target& target,
                                                    v1::Direction direction = v1::direction_forward,
                                                    const std::string& shapeBucket = "");
  // Leases for fleet pre-tuning (need the credential), one per (spec,
  // direction, device model, shape bucket).
  Result<v1::LeaseResponse> acquireLease(const v1::KernelSpec& spec, const v1::Target& target, const std::string& worker,
                                         int seconds = 600, v1::Direction direction = v1::direction_forward,
                                         const std::string& shapeBucket = "");
  Result<v1::LeaseResponse> releaseLease(const v1::KernelSpec& spec, const v1::Target& target, const std::string& worker,
                                         v1::Direction direction = v1::direction_forward,
                                         const std::string& shapeBucket = "");

  v1::KernelService::Stub& stub() { return *stub_; }
  // Adds the bearer token to a call's metadata.
  void authorize(grpc::ClientContext& context) const;

 private:
  std::unique_ptr<v1::KernelService::Stub> stub_;
  std::string token_;
};

// The canonical name of a gRPC status code ("INVALID_ARGUMENT").
const char* statusCodeName(grpc::StatusCode code);

// "StatusCode: message" of a failed call.
Error callError(const grpc::Status& status);

}  // namespace loom::service
