// KernelSpec and Schedule: reading them from JSON (protobuf's JSON mapping)
// and checking that a spec describes a computable IHA function.
#pragma once

#include <string>

#include "loom/result.h"
#include "loom/v1/loom.pb.h"

namespace loom {

using v1::KernelSpec;
using v1::Schedule;

// Parses protobuf JSON. `origin` (a file name, say) starts every error.
Result<KernelSpec> parseSpecJson(const std::string& json, const std::string& origin);
Result<Schedule> parseScheduleJson(const std::string& json, const std::string& origin);
Result<std::string> readTextFile(const std::string& path);
// A KernelSpec JSON file, parsed and validated; errors name the file.
Result<KernelSpec> readSpecFile(const std::string& path);

// Checks every rule of the IHA contract a spec alone can break; the error
// names the field: "kv_heads (3) must divide heads (4)".
Status validateSpec(const KernelSpec& spec);

// Checks a varlen launch's documents (KernelSpec.varlen): `count` = documents
// + 1 bounds, cu_seqlens[0] 0, never decreasing, the last `tokens`; the
// error names the entry: "cu_seqlens[2] (5) is below cu_seqlens[1] (7)".
Status validateCuSeqlens(const int32_t* cuSeqlens, int64_t count, int64_t tokens);

// JSON with the proto field names (snake_case), stable field order.
std::string toJson(const google::protobuf::Message& message);

// The softmax scale the spec asks for: its own or 1/sqrt(head_dim).
double effectiveScale(const KernelSpec& spec);

// The epsilon of qk_norm rms: the spec's own or 1e-6 (docs/IHA.md).
inline constexpr double kDefaultQkNormEps = 1e-6;
double effectiveQkNormEps(const KernelSpec& spec);

std::string maskName(v1::MaskMode mask);
std::string collapseName(v1::CollapseMode collapse);
std::string dtypeName(v1::DType dtype);

}  // namespace loom
