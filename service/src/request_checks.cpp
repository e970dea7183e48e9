#include "loom/request_checks.h"

#include <nlohmann/json.hpp>

#include <regex>

#include "jit/nvrtc_compiler.h"
#include "loom/cache.h"
#include "loom/compiler.h"
#include "loom/spec.h"

namespace loom::service {
namespace {

using grpc::Status;
using grpc::StatusCode;

// Requests beyond these sizes are refused before any work starts.
constexpr int kMaxHeads = 1024;
constexpr int kMaxPseudoHeads = 64;
constexpr int kMaxWindow = 1 << 24;
constexpr int64_t kMaxTuneTokens = 1 << 20;
constexpr int64_t kMaxTuneBatch = 64;
constexpr size_t kMaxWorkerName = 256;
constexpr size_t kMaxLoggedMessage = 1024;

Status invalid(const std::string& message) { return Status(StatusCode::INVALID_ARGUMENT, message); }

}  // namespace

std::string shortQuote(std::string_view text, size_t limit) {
  std::string out = "'";
  const std::string_view shown = text.substr(0, limit);
  for (unsigned char c : shown) {
    if (c == '\'' || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += char(c);
    } else {
      static constexpr char kDigits[] = "0123456789abcdef";
      out += "\\x";
      out += kDigits[c >> 4];
      out += kDigits[c & 15];
    }
  }
  out += "'";
  if (shown.size() < text.size()) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}

Status checkSpec(const v1::KernelSpec& spec) {
  if (spec.heads() > kMaxHeads || spec.kv_heads() > kMaxHeads)
    return invalid("spec.heads / spec.kv_heads over the limit of " + std::to_string(kMaxHeads));
  if (spec.pseudo_heads() > kMaxPseudoHeads)
    return invalid("spec.pseudo_heads over the limit of " + std::to_string(kMaxPseudoHeads));
  if (spec.window() > kMaxWindow) return invalid("spec.window over the limit of " + std::to_string(kMaxWindow));
  if (spec.window_rows() > kMaxWindow)
    return invalid("spec.window_rows over the limit of " + std::to_string(kMaxWindow));
  if (loom::Status valid = validateSpec(spec); !valid) return invalid("spec." + valid.error().message);
  return Status::OK;
}

Status checkTarget(const v1::Target& target) {
  if (target.kind() != v1::Target::cuda)
    return invalid("target.kind must be cuda: the service serves CUDA kernels (got " +
                   (v1::Target::Kind_IsValid(target.kind()) ? v1::Target::Kind_Name(target.kind())
                                                            : std::to_string(int(target.kind()))) +
                   ")");
  if (loom::Status supported = checkCudaArch(target.arch()); !supported)
    return invalid("target.arch " + shortQuote(target.arch()) + ": " + supported.error().message);
  if (!jit::nvrtcKnowsArch(target.arch()))
    return invalid("target.arch " + shortQuote(target.arch()) + " is not an arch this server's NVRTC (" +
                   jit::nvrtcVersion() + ") compiles for");
  return Status::OK;
}

namespace {
Status checkSpecAndTarget(const v1::KernelSpec& spec, const v1::Target& target) {
  if (Status ok = checkSpec(spec); !ok.ok()) return ok;
  return checkTarget(target);
}

// The service caches and serves the forward, the backward and the two
// decode steps (raw and mixed cache), each under its own decision key.
Status checkDirection(v1::Direction direction) {
  if (!v1::Direction_IsValid(direction))
    return invalid("direction " + std::to_string(int(direction)) +
                   " is not forward, backward, decode or decode_mixed");
  return Status::OK;
}

// A shape bucket is empty (every shape) or cache::shapeBucket's form, of
// the direction's kind: "n<N>" for the forward and backward, "c<C>.b<B>"
// for a decode step.
Status checkBucket(const std::string& bucket, v1::Direction direction, const char* field) {
  if (bucket.empty()) return Status::OK;
  if (bucket.size() > 40) return invalid(std::string(field) + ": longer than 40 characters");
  auto shape = cache::parseShapeBucket(bucket);
  if (!shape) return invalid(std::string(field) + ": " + shape.error().message);
  const bool decode = direction == v1::direction_decode || direction == v1::direction_decode_mixed;
  if (decode != (bucket[0] == 'c'))
    return invalid(std::string(field) + " " + shortQuote(bucket) + ": a " + (decode ? "decode step's" : "forward's or backward's") +
                   " bucket is " + (decode ? "c<cache>.b<batch>" : "n<tokens>"));
  return Status::OK;
}
}  // namespace

Status checkRequest(const v1::GetKernelRequest& request) {
  if (Status ok = checkDirection(request.direction()); !ok.ok()) return ok;
  if (Status ok = checkBucket(request.shape_bucket(), request.direction(), "shape_bucket"); !ok.ok()) return ok;
  return checkSpecAndTarget(request.spec(), request.target());
}

Status checkRequest(const v1::PutTuningRequest& request) {
  const v1::TuningResult& result = request.result();
  const v1::CompiledKernel& kernel = request.kernel();
  if (Status ok = checkSpecAndTarget(result.spec(), result.target()); !ok.ok()) return ok;
  if (kernel.binary().empty() || kernel.entries().empty()) return invalid("kernel: no binary or entry points");
  if (kernel.spec().SerializeAsString() != result.spec().SerializeAsString())
    return invalid("kernel.spec differs from result.spec");
  if (kernel.target().arch() != result.target().arch())
    return invalid("kernel.target.arch differs from result.target.arch");
  if (kernel.schedule().SerializeAsString() != result.best().SerializeAsString())
    return invalid("kernel.schedule is not result.best");
  if (kernel.direction() != result.direction()) return invalid("kernel.direction differs from result.direction");
  if (Status ok = checkDirection(result.direction()); !ok.ok()) return ok;
  if (Status ok = checkBucket(result.shape_bucket(), result.direction(), "result.shape_bucket"); !ok.ok()) return ok;
  if (!request.candidates_json().empty() && !nlohmann::json::accept(request.candidates_json()))
    return invalid("candidates_json is not JSON");
  return Status::OK;
}

Status checkRequest(const v1::TuneRequest& request) {
  if (Status ok = checkSpecAndTarget(request.spec(), request.target()); !ok.ok()) return ok;
  if (request.tokens() < 0 || request.tokens() > kMaxTuneTokens)
    return invalid("tokens (" + std::to_string(request.tokens()) + ") must be 0 (the default) to " +
                   std::to_string(kMaxTuneTokens));
  if (request.batch() < 0 || request.batch() > kMaxTuneBatch)
    return invalid("batch (" + std::to_string(request.batch()) + ") must be 0 (the default) to " +
                   std::to_string(kMaxTuneBatch));
  return Status::OK;
}

Status checkRequest(const v1::LookupDecisionRequest& request) {
  if (Status ok = checkDirection(request.direction()); !ok.ok()) return ok;
  if (Status ok = checkBucket(request.shape_bucket(), request.direction(), "shape_bucket"); !ok.ok()) return ok;
  return checkSpecAndTarget(request.spec(), request.target());
}

Status checkRequest(const v1::LeaseRequest& request) {
  if (Status ok = checkDirection(request.direction()); !ok.ok()) return ok;
  if (Status ok = checkBucket(request.shape_bucket(), request.direction(), "shape_bucket"); !ok.ok()) return ok;
  if (Status ok = checkSpec(request.spec()); !ok.ok()) return ok;
  if (request.worker().empty()) return invalid("worker: name the worker taking the lease");
  if (request.worker().size() > kMaxWorkerName)
    return invalid("worker: a name of at most " + std::to_string(kMaxWorkerName) + " bytes, got " +
                   shortQuote(request.worker()));
  return Status::OK;
}

namespace {
template <typename Message>
Status parseAndCheck(std::string_view bytes) {
  Message message;
  if (!message.ParseFromArray(bytes.data(), int(bytes.size())))
    return invalid(std::string("not a ") + Message::descriptor()->name() + " message");
  return checkRequest(message);
}
}  // namespace

Status checkRequestBytes(std::string_view method, std::string_view bytes) {
  if (method == "GetKernel") return parseAndCheck<v1::GetKernelRequest>(bytes);
  if (method == "PutTuning") return parseAndCheck<v1::PutTuningRequest>(bytes);
  if (method == "Tune") return parseAndCheck<v1::TuneRequest>(bytes);
  if (method == "LookupDecision") return parseAndCheck<v1::LookupDecisionRequest>(bytes);
  if (method == "AcquireLease" || method == "ReleaseLease") return parseAndCheck<v1::LeaseRequest>(bytes);
  if (method == "ListKernels") {
    v1::ListKernelsRequest message;
    return message.ParseFromArray(bytes.data(), int(bytes.size())) ? Status::OK
                                                                    : invalid("not a ListKernelsRequest message");
  }
  return Status(StatusCode::UNIMPLEMENTED, "no method " + shortQuote(method));
}

std::string requestLogLine(std::string_view method, std::string_view code, std::string_view message) {
  nlohmann::json line = {{"method", std::string(method)}, {"code", std::string(code)}};
  if (!message.empty()) {
    std::string shown(message.substr(0, kMaxLoggedMessage));
    if (shown.size() < message.size()) shown += "... (" + std::to_string(message.size()) + " bytes)";
    line["message"] = shown;
  }
  // Invalid UTF-8 is replaced, never thrown on: the log takes any bytes.
  return line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace loom::service
