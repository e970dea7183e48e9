#include "io/case.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>

namespace loom {
namespace fs = std::filesystem;
namespace {

constexpr double kFloat32Tolerance = 1e-5;
constexpr double kFloat16Tolerance = 2e-3;
constexpr double kBfloat16Tolerance = 1e-2;
constexpr double kFloat32GradientTolerance = 1e-5;
constexpr double kFloat16GradientTolerance = 5e-3;
constexpr double kBfloat16GradientTolerance = 3e-2;
constexpr double kMixingNoise = 0.3;  // spread of drawn mixing weights around the identity

struct ExpectedShape {
  const char* name;
  std::vector<int64_t> shape;
};

Status checkArray(const std::string& path, const NpyArray& array, const std::vector<int64_t>& want,
                  bool isActivation, v1::DType dtype) {
  if (array.shape != want)
    return makeError(path + ": shape " + shapeString(array.shape) + " does not match the spec, want " +
                     shapeString(want));
  if (isActivation && array.type != storageTypeOf(dtype))
    return makeError(path + ": stored type does not match spec dtype " + dtypeName(dtype));
  if (!isActivation && array.type != NpyType::float32 && array.type != NpyType::float64)
    return makeError(path + ": weights must be float32 or float64");
  const std::vector<double> values = npyToDouble(array, dtype == v1::bfloat16);
  for (size_t i = 0; i < values.size(); ++i)
    if (!std::isfinite(values[i]))
      return makeError(path + ": element " + std::to_string(i) + " is " + (std::isnan(values[i]) ? "NaN" : "Inf"));
  return Status::success();
}

}  // namespace

std::vector<std::vector<int64_t>> inputShapes(const KernelSpec& spec, int64_t B, int64_t N) {
  const int64_t H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  const std::vector<int64_t> collapseShape =
      spec.collapse() == v1::per_head ? std::vector<int64_t>{H, P} : std::vector<int64_t>{H, H * P};
  return {{B, N, H, d}, {B, N, G, d}, {B, N, G, d}, {H, H, P}, {G, G, P}, {G, G, P}, collapseShape};
}

NpyType storageTypeOf(v1::DType dtype) {
  switch (dtype) {
    case v1::float16: return NpyType::float16;
    case v1::bfloat16: return NpyType::uint16;
    default: return NpyType::float32;
  }
}

std::vector<double> roundedToDtype(const std::vector<double>& values, v1::DType dtype) {
  return npyToDouble(npyFromDouble(values, {int64_t(values.size())}, storageTypeOf(dtype)), dtype == v1::bfloat16);
}

double toleranceFor(v1::DType dtype) {
  switch (dtype) {
    case v1::float16: return kFloat16Tolerance;
    case v1::bfloat16: return kBfloat16Tolerance;
    default: return kFloat32Tolerance;
  }
}

double gradientToleranceFor(v1::DType dtype) {
  switch (dtype) {
    case v1::float16: return kFloat16GradientTolerance;
    case v1::bfloat16: return kBfloat16GradientTolerance;
    default: return kFloat32GradientTolerance;
  }
}

Result<IhaCase> loadCase(const std::string& dir) {
  if (!fs::is_directory(dir)) return makeError(dir + ": not a case folder");
  auto spec = readSpecFile((fs::path(dir) / "spec.json").string());
  if (!spec) return spec.error();

  IhaCase c;
  c.spec = *spec;
  std::vector<NpyArray> arrays;
  for (const char* name : kCaseInputs) {
    auto array = readNpy((fs::path(dir) / (std::string(name) + ".npy")).string());
    if (!array) return array.error();
    arrays.push_back(std::move(*array));
  }
  const NpyArray& q = arrays[0];
  if (q.shape.size() != 4) return makeError((fs::path(dir) / "q.npy").string() + ": want 4 dimensions [B, N, H, d], got " + shapeString(q.shape));
  c.batch = q.shape[0];
  c.tokens = q.shape[1];
  const std::vector<std::vector<int64_t>> want = inputShapes(*spec, c.batch, c.tokens);
  std::vector<std::vector<double>*> targets = {&c.inputs.q,       &c.inputs.k,       &c.inputs.v,       &c.inputs.alpha_q,
                                               &c.inputs.alpha_k, &c.inputs.alpha_v, &c.inputs.collapse};
  for (size_t i = 0; i < arrays.size(); ++i) {
    const std::string path = (fs::path(dir) / (std::string(kCaseInputs[i]) + ".npy")).string();
    if (Status ok = checkArray(path, arrays[i], want[i], i < 3, spec->dtype()); !ok) return ok.error();
    *targets[i] = npyToDouble(arrays[i], spec->dtype() == v1::bfloat16);
  }
  c.inputs.batch = c.batch;
  c.inputs.tokens = c.tokens;
  if (const fs::path path = fs::path(dir) / "cu_seqlens.npy"; c.spec.varlen()) {
    // Varlen: one packed batch and its documents' bounds (docs/IHA.md, Varlen).
    if (c.batch != 1)
      return makeError((fs::path(dir) / "q.npy").string() + ": a varlen case packs its documents in one batch, got B = " +
                       std::to_string(c.batch));
    auto bounds = readNpy(path.string());
    if (!bounds) return makeError(bounds.error().message + " (a varlen case needs cu_seqlens.npy, int32)");
    if (bounds->type != NpyType::int32 || bounds->shape.size() != 1)
      return makeError(path.string() + ": want int32 [documents + 1], got " + shapeString(bounds->shape));
    for (double x : npyToDouble(*bounds)) c.inputs.cu_seqlens.push_back(int32_t(x));
    if (Status ok = validateCuSeqlens(c.inputs.cu_seqlens.data(), int64_t(c.inputs.cu_seqlens.size()), c.tokens); !ok)
      return makeError(path.string() + ": " + ok.error().message);
  } else if (fs::exists(path)) {
    return makeError(path.string() + ": cu_seqlens is for a varlen spec (spec.json has no \"varlen\": true)");
  }

  const fs::path expectedPath = fs::path(dir) / "expected.npy";
  if (fs::exists(expectedPath)) {
    auto expected = readNpy(expectedPath.string());
    if (!expected) return expected.error();
    if (expected->shape != want[0])
      return makeError(expectedPath.string() + ": shape " + shapeString(expected->shape) + " does not match q, want " +
                       shapeString(want[0]));
    c.expected = npyToDouble(*expected, false);
  }

  // float32 or float64 arrays of the given shape, checked as the weights are.
  auto readFloats = [&](const fs::path& path, const std::vector<int64_t>& shape) -> Result<std::vector<double>> {
    auto array = readNpy(path.string());
    if (!array) return array.error();
    if (Status ok = checkArray(path.string(), *array, shape, false, spec->dtype()); !ok) return ok.error();
    return npyToDouble(*array, false);
  };
  if (const fs::path path = fs::path(dir) / "dout.npy"; fs::exists(path)) {
    auto dout = readFloats(path, want[0]);
    if (!dout) return dout.error();
    c.dout = std::move(*dout);
  }
  // The expected gradients: all seven or none.
  reference::IhaGradients gradients;
  const std::vector<std::vector<double>*> slots = reference::gradientsOf(gradients);
  std::string missing;
  for (size_t i = 0; i < slots.size(); ++i) {
    const fs::path path = fs::path(dir) / ("expected_" + std::string(reference::kGradientNames[i]) + ".npy");
    if (!fs::exists(path)) {
      if (missing.empty()) missing = path.string();
      continue;
    }
    auto values = readFloats(path, want[i]);
    if (!values) return values.error();
    *slots[i] = std::move(*values);
  }
  const bool any = std::any_of(slots.begin(), slots.end(), [](const auto* g) { return !g->empty(); });
  if (any) {
    if (!missing.empty()) return makeError(missing + ": missing (a backward case has all seven expected gradients)");
    if (!c.dout) return makeError((fs::path(dir) / "dout.npy").string() + ": missing (the case has expected gradients)");
    c.expectedGradients = std::move(gradients);
  }
  return c;
}

Status writeCase(const std::string& dir, const IhaCase& c) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return makeError(dir + ": cannot create folder: " + ec.message());
  {
    std::ofstream spec(fs::path(dir) / "spec.json");
    spec << toJson(c.spec);
    if (!spec) return makeError(dir + "/spec.json: write failed");
  }
  const std::vector<std::vector<int64_t>> shapes = inputShapes(c.spec, c.batch, c.tokens);
  const std::vector<const std::vector<double>*> sources = {&c.inputs.q,       &c.inputs.k,       &c.inputs.v,
                                                           &c.inputs.alpha_q, &c.inputs.alpha_k, &c.inputs.alpha_v,
                                                           &c.inputs.collapse};
  for (size_t i = 0; i < sources.size(); ++i) {
    const NpyType type = i < 3 ? storageTypeOf(c.spec.dtype()) : NpyType::float32;
    const std::string path = (fs::path(dir) / (std::string(kCaseInputs[i]) + ".npy")).string();
    if (Status ok = writeNpy(path, npyFromDouble(*sources[i], shapes[i], type)); !ok) return ok;
  }
  if (!c.inputs.cu_seqlens.empty()) {
    const std::vector<double> bounds(c.inputs.cu_seqlens.begin(), c.inputs.cu_seqlens.end());
    const std::string path = (fs::path(dir) / "cu_seqlens.npy").string();
    if (Status ok = writeNpy(path, npyFromDouble(bounds, {int64_t(bounds.size())}, NpyType::int32)); !ok) return ok;
  }
  if (c.expected)
    return writeNpy((fs::path(dir) / "expected.npy").string(), npyFromDouble(*c.expected, shapes[0], NpyType::float64));
  return Status::success();
}

std::vector<int32_t> drawDocuments(std::mt19937_64& rng, int64_t documents, int64_t tokens) {
  // Cut points: documents - 1 distinct tokens of 1 .. tokens - 1 where there
  // are enough (no document empty), else drawn with repeats (some empty).
  std::vector<int32_t> cuts;
  std::uniform_int_distribution<int64_t> cut(1, std::max<int64_t>(1, tokens - 1));
  while (int64_t(cuts.size()) < documents - 1) {
    const int32_t at = int32_t(tokens > 1 ? cut(rng) : tokens);
    if (documents - 1 > tokens - 1 || std::find(cuts.begin(), cuts.end(), at) == cuts.end()) cuts.push_back(at);
  }
  std::sort(cuts.begin(), cuts.end());
  // Three documents or more: one of a single token (the shortest a kernel
  // sees, shorter than any window), the first unless one already is.
  bool single = false;
  for (size_t i = 0; i <= cuts.size(); ++i)
    single |= (i < cuts.size() ? cuts[i] : int32_t(tokens)) - (i > 0 ? cuts[i - 1] : 0) == 1;
  if (documents >= 3 && documents <= tokens && !single) cuts[0] = 1;
  std::vector<int32_t> bounds = {0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(int32_t(tokens));
  return bounds;
}

IhaCase drawCase(const KernelSpec& spec, int64_t batch, int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  const NpyType activation = storageTypeOf(spec.dtype());
  // Round through the stored type so the case holds exactly what is on disk.
  auto draw = [&](int64_t count, double sigma, NpyType type) {
    std::vector<double> values(static_cast<size_t>(count));
    for (double& value : values) value = sigma * normal(rng);
    return npyToDouble(npyFromDouble(values, {count}, type), true);
  };
  const int64_t H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  IhaCase c;
  c.spec = spec;
  const int64_t documents = batch;
  if (spec.varlen()) batch = 1;  // one packed batch of `documents` documents (their bounds drawn last)
  c.batch = batch;
  c.tokens = tokens;
  c.inputs.batch = batch;
  c.inputs.tokens = tokens;
  c.inputs.q = draw(batch * tokens * H * d, 1.0, activation);
  c.inputs.k = draw(batch * tokens * G * d, 1.0, activation);
  c.inputs.v = draw(batch * tokens * G * d, 1.0, activation);
  // Mixing weights as the shared vectors hold them: near the identity (each
  // pseudo-head starts as its own head) plus noise.
  auto mixing = [&](int64_t heads) {
    std::vector<double> alpha(size_t(heads * heads * P));
    for (int64_t m = 0; m < heads; ++m)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t p = 0; p < P; ++p)
          alpha[(m * heads + h) * P + p] = (m == h ? 1.0 : 0.0) + kMixingNoise * normal(rng);
    return npyToDouble(npyFromDouble(alpha, {int64_t(alpha.size())}, NpyType::float32), true);
  };
  c.inputs.alpha_q = mixing(H);
  c.inputs.alpha_k = mixing(G);
  c.inputs.alpha_v = mixing(G);
  const int64_t fan = spec.collapse() == v1::per_head ? P : H * P;
  c.inputs.collapse = draw(H * fan, 1.0 / std::sqrt(double(fan)), NpyType::float32);
  if (spec.varlen()) c.inputs.cu_seqlens = drawDocuments(rng, std::max<int64_t>(1, documents), tokens);
  return c;
}

namespace {
constexpr int kMaxDraws = 64;

// A drawn case: the first of up to kMaxDraws whose `share` (the rounding
// model's error over the tolerance) is at most `limit`, else the one with
// the least.
struct Drawn {
  IhaCase c;
  bool checkable = false;
};

template <class Draw, class Share>
Drawn drawWhile(Draw draw, Share share, double limit) {
  Drawn best;
  double least = std::numeric_limits<double>::infinity();
  for (int at = 0; at < kMaxDraws; ++at) {
    IhaCase c = draw(at);
    const double s = share(c);
    if (s <= limit) return {std::move(c), true};
    if (!(s >= least)) {
      least = s;
      best.c = std::move(c);
    }
  }
  return best;
}

double forwardShare(const IhaCase& c) {
  if (c.spec.dtype() == v1::float32) return 0;
  const auto rounded = reference::ihaForwardWithTensorCoreRounding(c.spec, c.inputs, c.spec.dtype());
  return relativeError(rounded.out, *c.expected) / toleranceFor(c.spec.dtype());
}

Drawn drawForward(const KernelSpec& spec, int64_t batch, int64_t tokens, uint64_t seed) {
  auto draw = [&](int at) {
    IhaCase c = drawCase(spec, batch, tokens, seed + uint64_t(at));
    c.expected = reference::ihaForward(spec, c.inputs).out;
    return c;
  };
  return drawWhile(draw, forwardShare, kCheckableShare);
}

std::optional<IhaCase> checkableOnly(Drawn drawn) {
  if (!drawn.checkable) return std::nullopt;
  return std::move(drawn.c);
}
}  // namespace

std::optional<IhaCase> findCheckableCase(const KernelSpec& spec, int64_t batch, int64_t tokens, uint64_t seed) {
  return checkableOnly(drawForward(spec, batch, tokens, seed));
}

IhaCase drawCheckableCase(const KernelSpec& spec, int64_t batch, int64_t tokens, uint64_t seed) {
  return drawForward(spec, batch, tokens, seed).c;
}

namespace {
double norm2(const std::vector<double>& x) {
  double sum = 0;
  for (double v : x) sum += v * v;
  return sum;
}
}  // namespace

std::vector<double> gradientErrors(const KernelSpec& spec, int64_t tokens, const reference::IhaGradients& got,
                                   const reference::IhaGradients& want, const std::vector<int32_t>& documents) {
  const auto gotSlots = reference::gradientsOf(got);
  const auto wantSlots = reference::gradientsOf(want);
  double total = 0;
  for (const auto* g : wantSlots) total += norm2(*g);
  std::vector<double> errors;
  for (size_t i = 0; i < gotSlots.size(); ++i) {
    if (gotSlots[i]->size() != wantSlots[i]->size()) {
      errors.push_back(std::nan(""));
      continue;
    }
    double difference = 0;
    bool finite = true;
    for (size_t k = 0; k < gotSlots[i]->size(); ++k) {
      finite = finite && std::isfinite((*gotSlots[i])[k]);
      const double e = (*gotSlots[i])[k] - (*wantSlots[i])[k];
      difference += e * e;
    }
    const double scale = reference::vanishesButForEpsilon(spec, tokens, i, documents) ? total : norm2(*wantSlots[i]);
    errors.push_back(finite ? std::sqrt(difference) / std::max(std::sqrt(scale), 1e-300) : std::nan(""));
  }
  return errors;
}

double worstGradientError(const KernelSpec& spec, int64_t tokens, const reference::IhaGradients& got,
                          const reference::IhaGradients& want, const std::vector<int32_t>& documents) {
  double worst = 0;
  for (double e : gradientErrors(spec, tokens, got, want, documents)) {
    if (std::isnan(e)) return e;
    worst = std::max(worst, e);
  }
  return worst;
}

std::vector<double> drawDout(const KernelSpec& spec, int64_t batch, int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> dout(size_t(batch * tokens * spec.heads() * spec.head_dim()));
  for (double& x : dout) x = normal(rng);
  return roundedToDtype(dout, spec.dtype());
}

namespace {
// What the float32 arithmetic every backend computes in can cost a gradient
// that cancels (kernels' float32 products and partial sums miss by a few
// units of its roundoff, which a reduction whose terms cancel magnifies): q,
// k, v and dout each moved by a random relative kFloat32Ulps units of
// float32's roundoff, through the float64 backward. The model of rounded
// mixing leaves it out, as it rounds only what a kernel stores in the dtype.
constexpr double kFloat32Ulps = 4;
reference::IhaGradients backwardOfFloat32Perturbation(const KernelSpec& spec, reference::IhaInputs inputs,
                                                      std::vector<double> dout) {
  std::mt19937_64 rng(0x5eed + uint64_t(inputs.tokens) * 1000003 + uint64_t(inputs.batch));
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  const double relative = kFloat32Ulps * std::ldexp(1.0, -24);
  for (std::vector<double>* x : {&inputs.q, &inputs.k, &inputs.v, &dout})
    for (double& e : *x) e *= 1 + relative * unit(rng);
  return reference::ihaBackward(spec, inputs, dout);
}
}  // namespace

double backwardCheckShare(const KernelSpec& spec, const reference::IhaInputs& inputs, const std::vector<double>& dout,
                          const reference::IhaGradients& expected) {
  const double tolerance = gradientToleranceFor(spec.dtype());
  const auto rounded = reference::ihaBackwardWithRoundedMixing(spec, inputs, dout, spec.dtype());
  const double roundings = worstGradientError(spec, inputs.tokens, rounded, expected, inputs.cu_seqlens) / tolerance;
  if (std::isnan(roundings) || roundings > checkableBackwardShare(spec.dtype())) return roundings;  // refused already
  const auto perturbed = backwardOfFloat32Perturbation(spec, inputs, dout);
  return std::max(roundings, worstGradientError(spec, inputs.tokens, perturbed, expected, inputs.cu_seqlens) / tolerance);
}

namespace {
Drawn drawBackward(const KernelSpec& spec, int64_t batch, int64_t tokens, uint64_t seed) {
  auto draw = [&](int at) {
    IhaCase c = drawCheckableCase(spec, batch, tokens, seed + uint64_t(at) * 1000003);
    c.dout = drawDout(spec, batch, tokens, seed ^ (0x9e3779b97f4a7c15ull * uint64_t(at + 1)));
    c.expectedGradients = reference::ihaBackward(spec, c.inputs, *c.dout);
    return c;
  };
  auto share = [](const IhaCase& c) { return backwardCheckShare(c.spec, c.inputs, *c.dout, *c.expectedGradients); };
  return drawWhile(draw, share, checkableBackwardShare(spec.dtype()));
}
}  // namespace

std::optional<IhaCase> findCheckableBackwardCase(const KernelSpec& spec, int64_t batch, int64_t tokens,
                                                 uint64_t seed) {
  return checkableOnly(drawBackward(spec, batch, tokens, seed));
}

IhaCase drawCheckableBackwardCase(const KernelSpec& spec, int64_t batch, int64_t tokens, uint64_t seed) {
  return drawBackward(spec, batch, tokens, seed).c;
}

IhaCase withDtype(const IhaCase& c, v1::DType dtype) {
  IhaCase converted = c;
  converted.spec.set_dtype(dtype);
  auto round = [&](std::vector<double>& values) { values = roundedToDtype(values, dtype); };
  for (std::vector<double>* values : {&converted.inputs.q, &converted.inputs.k, &converted.inputs.v}) round(*values);
  if (converted.dout) round(*converted.dout);  // a kernel reads dout in the dtype too
  converted.expected = reference::ihaForward(converted.spec, converted.inputs).out;
  if (converted.dout) converted.expectedGradients = reference::ihaBackward(converted.spec, converted.inputs, *converted.dout);
  return converted;
}

double relativeError(const std::vector<double>& out, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < out.size() && i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) return std::nan("");
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  if (out.size() != ref.size()) return std::nan("");
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-300);
}

}  // namespace loom
