// A C++ client of KernelService: fetch kernels, list the cache, upload
// tuning results.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/result.h"
#include "loom/v1/service.grpc.pb.h"

namespace loom::service {

class KernelClient {
 public:
  // `address`: HOST:PORT, or several replicas' comma-separated
  // (HOST:PORT,HOST:PORT,...): a call goes to the replica that answered
  // last and moves on to the next when one is unreachable (UNAVAILABLE);
  // every call is safe to repeat on another replica. Clients of one
  // process start on different replicas.
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

  // The replica this client calls first now.
  const std::string& address() const;
  // Adds the bearer token to a call's metadata.
  void authorize(grpc::ClientContext& context) const;

 private:
  // One unary call: on the current replica, then each other while the
  // answer is UNAVAILABLE, a fresh context each attempt (deadline `until`
  // for every attempt when given, else 30 s from the attempt; a write
  // carries the token).
  template <class Request, class Response>
  using Method = grpc::Status (v1::KernelService::Stub::*)(grpc::ClientContext*, const Request&, Response*);
  template <class Request, class Response>
  Result<Response> call(Method<Request, Response> method, const Request& request, bool write,
                        std::optional<std::chrono::system_clock::time_point> until);

  std::vector<std::unique_ptr<v1::KernelService::Stub>> stubs_;
  std::vector<std::string> addresses_;
  std::atomic<size_t> current_{0};
  std::string token_;
};

// The canonical name of a gRPC status code ("INVALID_ARGUMENT").
const char* statusCodeName(grpc::StatusCode code);

// "StatusCode: message" of a failed call.
Error callError(const grpc::Status& status);

}  // namespace loom::service
