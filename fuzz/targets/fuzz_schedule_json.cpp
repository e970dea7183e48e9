// Schedule JSON: a schedule or a clean error; a parsed schedule is resolved
// against a small spec on sm_80 and sm_90a (complete and checked, or refused
// with the field named), never a crash.
#include <cstdint>
#include <string>

#include "loom/compiler.h"
#include "loom/spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto schedule = loom::parseScheduleJson(text, "input");
  if (!schedule) return 0;
  static const loom::KernelSpec spec = *loom::parseSpecJson(
      R"({"heads": 4, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 64, "dtype": "bfloat16",
          "mask": "flat_causal", "collapse": "per_head"})",
      "fixed");
  for (const char* arch : {"sm_80", "sm_90a"}) (void)loom::resolveSchedule(spec, *schedule, *loom::parseTarget(arch));
  return 0;
}
