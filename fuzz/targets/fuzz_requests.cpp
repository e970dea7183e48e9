// The bytes of each gRPC request message through the service's checks (no
// server): the first byte picks the method. OK or a status, never a crash;
// the message of a refusal is bounded whatever the request held.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "loom/request_checks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static constexpr std::string_view kMethods[] = {"GetKernel", "PutTuning",    "Tune",        "LookupDecision",
                                                  "AcquireLease", "ReleaseLease", "ListKernels", "Unknown"};
  const std::string_view method = kMethods[data[0] % std::size(kMethods)];
  const grpc::Status status =
      loom::service::checkRequestBytes(method, std::string_view(reinterpret_cast<const char*>(data + 1), size - 1));
  if (status.error_message().size() > 1024) std::abort();
  (void)loom::service::requestLogLine(method, "INVALID_ARGUMENT", status.error_message());
  return 0;
}
