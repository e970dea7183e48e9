// Helpers every subcommand shares: errors, spec and schedule files.
#include <cstdio>

#include "commands.h"

namespace loom::cli {

int badInput(const std::string& message) {
  std::fprintf(stderr, "loom: %s\n", message.c_str());
  return kExitBadInput;
}

Status overrideDtype(KernelSpec& spec, const std::string& dtype) {
  if (dtype.empty()) return Status::success();
  v1::DType parsed;
  if (!v1::DType_Parse(dtype, &parsed) || parsed == v1::dtype_unspecified)
    return makeError("--dtype '" + dtype + "' is not float32, float16 or bfloat16");
  spec.set_dtype(parsed);
  return Status::success();
}

Result<Schedule> readScheduleFile(const std::string& path) {
  if (path.empty()) return Schedule();
  auto text = readTextFile(path);
  if (!text) return text.error();
  return parseScheduleJson(*text, path);
}

}  // namespace loom::cli
