// Spec JSON into a validated KernelSpec: a spec or a clean error; a spec
// that validates prints to JSON that parses back to the same spec.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "loom/spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto spec = loom::parseSpecJson(text, "input");
  if (!spec || !loom::validateSpec(*spec)) return 0;
  auto again = loom::parseSpecJson(loom::toJson(*spec), "printed");
  if (!again || again->SerializeAsString() != spec->SerializeAsString()) std::abort();
  return 0;
}
