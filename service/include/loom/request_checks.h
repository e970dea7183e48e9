// What the service checks of a request before any work starts: sizes,
// spec and target, the fields each method needs. Every message that echoes
// a client's text quotes a short, escaped prefix of it. Shared by the
// handlers and the request fuzzer (fuzz/), which needs no live server.
#pragma once

#include <grpcpp/support/status.h>

#include <string>
#include <string_view>

#include "loom/v1/service.pb.h"

namespace loom::service {

// At most `limit` bytes of `text`, quoted, with quotes, backslashes and
// anything outside printable ASCII escaped; a longer text says how long it was.
std::string shortQuote(std::string_view text, size_t limit = 40);

grpc::Status checkSpec(const v1::KernelSpec& spec);
// kind cuda, an arch loom supports (sm_80 and later) that this server's
// NVRTC knows.
grpc::Status checkTarget(const v1::Target& target);

grpc::Status checkRequest(const v1::GetKernelRequest& request);
grpc::Status checkRequest(const v1::PutTuningRequest& request);  // all but the compile
grpc::Status checkRequest(const v1::TuneRequest& request);
grpc::Status checkRequest(const v1::LookupDecisionRequest& request);
grpc::Status checkRequest(const v1::LeaseRequest& request);

// The bytes of one request of `method` ("GetKernel", "PutTuning", ...)
// parsed and checked as the service does; INVALID_ARGUMENT for bytes that
// are not such a message, UNIMPLEMENTED for an unknown method.
grpc::Status checkRequestBytes(std::string_view method, std::string_view bytes);

// One line of the JSON request log.
std::string requestLogLine(std::string_view method, std::string_view code, std::string_view message);

}  // namespace loom::service
