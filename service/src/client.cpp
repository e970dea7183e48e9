#include "loom/client.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <iterator>

#include "loom/counters.h"
#include "loom/hash.h"
#include "loom/spec.h"

namespace loom::service {

const char* statusCodeName(grpc::StatusCode code) {
  static const char* names[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                                "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
                                "UNAUTHENTICATED"};
  const int index = int(code);
  return index >= 0 && index < int(std::size(names)) ? names[index] : "UNKNOWN";
}

Error callError(const grpc::Status& status) {
  return makeError(std::string(statusCodeName(status.error_code())) + ": " + status.error_message());
}

Result<std::unique_ptr<KernelClient>> KernelClient::connect(const std::string& address, const std::string& tokenFile,
                                                           const std::string& tlsRoots) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!tlsRoots.empty()) {
    auto roots = readTextFile(tlsRoots);
    if (!roots) return roots.error();
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = *roots;
    credentials = grpc::SslCredentials(ssl);
  }
  std::unique_ptr<KernelClient> client(new KernelClient());
  if (!tokenFile.empty()) {
    auto token = readTextFile(tokenFile);
    if (!token) return token.error();
    client->token_ = *token;
    while (!client->token_.empty() && std::isspace(static_cast<unsigned char>(client->token_.back()))) client->token_.pop_back();
  }
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(256 << 20);
  for (size_t begin = 0; begin <= address.size();) {
    size_t end = address.find(',', begin);
    if (end == std::string::npos) end = address.size();
    const std::string one = address.substr(begin, end - begin);
    if (one.empty()) return makeError("server address list '" + address + "' has an empty entry");
    client->stubs_.push_back(v1::KernelService::NewStub(grpc::CreateCustomChannel(one, credentials, arguments)));
    client->addresses_.push_back(one);
    count(Counter::service_channels);
    begin = end + 1;
  }
  // Clients of one process start on different replicas.
  static std::atomic<size_t> clients{0};
  client->current_ = clients++ % client->stubs_.size();
  return client;
}

template <class Request, class Response>
Result<Response> KernelClient::call(Method<Request, Response> method, const Request& request, bool write,
                                    std::optional<std::chrono::system_clock::time_point> until) {
  const size_t n = stubs_.size(), first = current_;
  Response response;
  grpc::Status status;
  for (size_t tried = 0; tried < n; ++tried) {
    const size_t i = (first + tried) % n;
    grpc::ClientContext context;
    context.set_deadline(until ? *until : std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (write) authorize(context);
    count(Counter::service_requests);
    status = ((*stubs_[i]).*method)(&context, request, &response);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE) {
      current_ = i;  // stay with the replica that answered
      break;
    }
  }
  if (!status.ok()) return callError(status);
  return response;
}

const std::string& KernelClient::address() const { return addresses_[current_ % addresses_.size()]; }

void KernelClient::authorize(grpc::ClientContext& context) const {
  if (!token_.empty()) context.AddMetadata("authorization", "Bearer " + token_);
}

Result<v1::GetKernelResponse> KernelClient::getKernel(const v1::KernelSpec& spec, const v1::Target& target,
                                                      int deadlineMs, v1::Direction direction,
                                                      const std::string& shapeBucket) {
  v1::GetKernelRequest request;
  *request.mutable_spec() = spec;
  *request.mutable_target() = target;
  request.set_direction(direction);
  request.set_shape_bucket(shapeBucket);
  return call(&v1::KernelService::Stub::GetKernel, request, false,
              std::chrono::system_clock::now() + std::chrono::milliseconds(deadlineMs));
}

Result<v1::ListKernelsResponse> KernelClient::listKernels() {
  return call(&v1::KernelService::Stub::ListKernels, v1::ListKernelsRequest(), false, std::nullopt);
}

Result<v1::PutTuningResponse> KernelClient::putTuning(const v1::TuningResult& result, const v1::CompiledKernel& kernel,
                                                      const std::string& candidatesJson) {
  v1::PutTuningRequest request;
  *request.mutable_result() = result;
  *request.mutable_kernel() = kernel;
  request.set_kernel_checksum(ContentHash().add(kernel.SerializeAsString()).hex());
  request.set_candidates_json(candidatesJson);
  return call(&v1::KernelService::Stub::PutTuning, request, true, std::nullopt);
}

Result<v1::LookupDecisionResponse> KernelClient::lookupDecision(const v1::KernelSpec& spec, const v1::Target& target,
                                                              v1::Direction direction, const std::string& shapeBucket) {
  v1::LookupDecisionRequest request;
  *request.mutable_spec() = spec;
  *request.mutable_target() = target;
  request.set_direction(direction);
  request.set_shape_bucket(shapeBucket);
  return call(&v1::KernelService::Stub::LookupDecision, request, false, std::nullopt);
}

namespace {
v1::LeaseRequest leaseRequest(const v1::KernelSpec& spec, const v1::Target& target, const std::string& worker,
                              int seconds, v1::Direction direction, const std::string& shapeBucket) {
  v1::LeaseRequest request;
  request.set_direction(direction);
  request.set_shape_bucket(shapeBucket);
  *request.mutable_spec() = spec;
  *request.mutable_target() = target;
  request.set_worker(worker);
  request.set_seconds(seconds);
  return request;
}
}  // namespace

Result<v1::LeaseResponse> KernelClient::acquireLease(const v1::KernelSpec& spec, const v1::Target& target,
                                                     const std::string& worker, int seconds, v1::Direction direction,
                                                     const std::string& shapeBucket) {
  return call(&v1::KernelService::Stub::AcquireLease,
              leaseRequest(spec, target, worker, seconds, direction, shapeBucket), true, std::nullopt);
}

Result<v1::LeaseResponse> KernelClient::releaseLease(const v1::KernelSpec& spec, const v1::Target& target,
                                                     const std::string& worker, v1::Direction direction,
                                                     const std::string& shapeBucket) {
  return call(&v1::KernelService::Stub::ReleaseLease, leaseRequest(spec, target, worker, 0, direction, shapeBucket),
              true, std::nullopt);
}

}  // namespace loom::service
