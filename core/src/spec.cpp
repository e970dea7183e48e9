#include "loom/spec.h"

#include <google/protobuf/util/json_util.h>

#include <cmath>
#include <fstream>
#include <sstream>

namespace loom {
namespace {

template <typename Message>
Result<Message> parseJson(const std::string& json, const std::string& origin) {
  Message message;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto status = google::protobuf::util::JsonStringToMessage(json, &message, options);
  if (!status.ok()) return makeError(origin + ": " + std::string(status.message()));
  return message;
}

}  // namespace

Result<KernelSpec> parseSpecJson(const std::string& json, const std::string& origin) {
  return parseJson<KernelSpec>(json, origin);
}

Result<Schedule> parseScheduleJson(const std::string& json, const std::string& origin) {
  return parseJson<Schedule>(json, origin);
}

Result<std::string> readTextFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return makeError(path + ": cannot open file");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

Result<KernelSpec> readSpecFile(const std::string& path) {
  auto text = readTextFile(path);
  if (!text) return text.error();
  auto spec = parseSpecJson(*text, path);
  if (!spec) return spec.error();
  if (Status valid = validateSpec(*spec); !valid) return makeError(path + ": " + valid.error().message);
  return spec;
}

Status validateCuSeqlens(const int32_t* cu, int64_t count, int64_t tokens) {
  auto at = [&](int64_t i) { return "cu_seqlens[" + std::to_string(i) + "] (" + std::to_string(cu[i]) + ")"; };
  if (count < 2) return makeError("cu_seqlens: want documents + 1 >= 2 entries, got " + std::to_string(count));
  if (cu[0] != 0) return makeError(at(0) + " must be 0");
  for (int64_t i = 1; i < count; ++i)
    if (cu[i] < cu[i - 1]) return makeError(at(i) + " is below " + at(i - 1) + ": documents' bounds never decrease");
  if (cu[count - 1] != tokens)
    return makeError(at(count - 1) + " must be the tokens packed (" + std::to_string(tokens) + ")");
  return Status::success();
}

Status validateSpec(const KernelSpec& spec) {
  auto fail = [](const std::string& message) { return Status(makeError(message)); };
  if (spec.heads() < 1) return fail("heads (" + std::to_string(spec.heads()) + ") must be at least 1");
  if (spec.kv_heads() < 1) return fail("kv_heads (" + std::to_string(spec.kv_heads()) + ") must be at least 1");
  if (spec.heads() % spec.kv_heads() != 0)
    return fail("kv_heads (" + std::to_string(spec.kv_heads()) + ") must divide heads (" +
                std::to_string(spec.heads()) + ")");
  if (spec.pseudo_heads() < 1)
    return fail("pseudo_heads (" + std::to_string(spec.pseudo_heads()) + ") must be at least 1");
  if (spec.head_dim() < 1) return fail("head_dim (" + std::to_string(spec.head_dim()) + ") must be at least 1");
  if (spec.dtype() == v1::dtype_unspecified) return fail("dtype is missing (float32, float16 or bfloat16)");
  if (!v1::DType_IsValid(spec.dtype()))
    return fail("dtype (" + std::to_string(int(spec.dtype())) + ") is not float32, float16 or bfloat16");
  if (spec.mask() == v1::mask_unspecified) return fail("mask is missing (flat_causal, token_causal or none)");
  if (!v1::MaskMode_IsValid(spec.mask()))
    return fail("mask (" + std::to_string(int(spec.mask())) + ") is not flat_causal, token_causal or none");
  if (spec.collapse() == v1::collapse_unspecified) return fail("collapse is missing (per_head or global)");
  if (!v1::CollapseMode_IsValid(spec.collapse()))
    return fail("collapse (" + std::to_string(int(spec.collapse())) + ") is not per_head or global");
  if (spec.window() < 0) return fail("window (" + std::to_string(spec.window()) + ") must not be negative");
  // -0.0 too: it means 0 but is other bytes, so another cache key for one function.
  if (!std::isfinite(spec.rope_theta()) || std::signbit(spec.rope_theta()))
    return fail("rope_theta must be 0 (no rotary embedding) or positive");
  if (spec.rope_theta() > 0 && spec.head_dim() % 2 != 0)
    return fail("head_dim (" + std::to_string(spec.head_dim()) + ") must be even when rope_theta > 0");
  if (spec.has_scale() && (!std::isfinite(spec.scale()) || spec.scale() <= 0))
    return fail("scale must be positive and finite");
  // The options of public IHA code: each applies only where it means something,
  // so one function has one spec (and one cache key).
  if (!v1::KernelSpec::QkNorm_IsValid(spec.qk_norm())) return fail("qk_norm must be none or rms");
  if (spec.has_qk_norm_eps()) {
    if (spec.qk_norm() != v1::KernelSpec::rms) return fail("qk_norm_eps is set but qk_norm is none (set qk_norm rms)");
    if (!std::isfinite(spec.qk_norm_eps()) || spec.qk_norm_eps() <= 0)
      return fail("qk_norm_eps must be positive and finite");
  }
  if (!v1::KernelSpec::RopeDirection_IsValid(spec.rope_direction()))
    return fail("rope_direction must be positive or negative");
  if (spec.rope_direction() == v1::KernelSpec::negative && spec.rope_theta() == 0)
    return fail("rope_direction negative needs rotary embedding (rope_theta > 0)");
  if (!v1::KernelSpec::RopeTableDtype_IsValid(spec.rope_table_dtype()))
    return fail("rope_table_dtype must be exact, table_float32 or table_bfloat16");
  if (spec.rope_table_dtype() != v1::KernelSpec::exact && spec.rope_theta() == 0)
    return fail("rope_table_dtype " + std::string(v1::KernelSpec::RopeTableDtype_Name(spec.rope_table_dtype())) +
                " needs rotary embedding (rope_theta > 0)");
  if (!v1::KernelSpec::WindowAlign_IsValid(spec.window_align())) return fail("window_align must be virtual or token");
  if (spec.window_align() == v1::KernelSpec::token && spec.window() == 0)
    return fail("window_align token needs a window (window > 0 tokens)");
  if (spec.window_rows() < 0)
    return fail("window_rows (" + std::to_string(spec.window_rows()) + ") must not be negative");
  if (spec.window_rows() > 0) {
    if (spec.mask() != v1::flat_causal)
      return fail("window_rows counts a flat_causal window in virtual rows; mask is " + maskName(spec.mask()) +
                  " (use window, in tokens)");
    if (spec.window() != 0)
      return fail("window_rows (" + std::to_string(spec.window_rows()) + ") and window (" +
                  std::to_string(spec.window()) + ") both set a window: set one of them");
  }
  return Status::success();
}

std::string toJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.add_whitespace = true;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

double effectiveScale(const KernelSpec& spec) {
  return spec.has_scale() ? spec.scale() : 1.0 / std::sqrt(double(spec.head_dim()));
}

double effectiveQkNormEps(const KernelSpec& spec) {
  return spec.has_qk_norm_eps() ? spec.qk_norm_eps() : kDefaultQkNormEps;
}

std::string maskName(v1::MaskMode mask) { return v1::MaskMode_Name(mask); }
std::string collapseName(v1::CollapseMode collapse) { return v1::CollapseMode_Name(collapse); }
std::string dtypeName(v1::DType dtype) { return v1::DType_Name(dtype); }

}  // namespace loom
