// A test case on disk (docs/IHA.md, "Test cases on disk"): spec.json plus the
// input arrays and, optionally, expected.npy in float64.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "io/npy.h"
#include "loom/result.h"
#include "loom/spec.h"
#include "reference/iha_backward.h"
#include "reference/iha_reference.h"

namespace loom {

struct IhaCase {
  KernelSpec spec;
  int64_t batch = 0;
  int64_t tokens = 0;
  // Inputs widened to double (q, k, v hold exactly the stored fp16 / bf16 values).
  reference::IhaInputs inputs;
  std::optional<std::vector<double>> expected;  // [B, N, H, d]
  // Backward cases (docs/IHA.md, "Backward"): dout.npy [B, N, H, d] and the
  // expected_<name>.npy of every gradient, each shaped as its input.
  std::optional<std::vector<double>> dout;
  std::optional<reference::IhaGradients> expectedGradients;
};

// The names of a case's input arrays, in the order they are read.
inline constexpr const char* kCaseInputs[] = {"q", "k", "v", "alpha_q", "alpha_k", "alpha_v", "collapse"};

// Their shapes for a spec, batch B and N tokens, in the same order.
std::vector<std::vector<int64_t>> inputShapes(const KernelSpec& spec, int64_t batch, int64_t tokens);

// Loads and checks a case folder: every shape against the spec, q/k/v stored
// in the spec's dtype, no NaN or Inf. Errors name the file or field. dout.npy
// and the expected gradients are read when present (all seven or none).
Result<IhaCase> loadCase(const std::string& dir);

// Writes spec.json, the inputs (q/k/v in the spec's dtype, weights float32)
// and, when the case has one, expected.npy (float64).
Status writeCase(const std::string& dir, const IhaCase& c);

// Draws a case the way the shared vectors are drawn: q, k, v ~ N(0, 1)
// rounded to the spec's dtype; mixing weights the identity plus N(0, 0.3^2),
// collapse weights N(0, 1/fan-in), in float32. The same seed gives the same
// case. A varlen spec's case packs `batch` documents into one batch of
// `tokens` (drawDocuments).
IhaCase drawCase(const KernelSpec& spec, int64_t batch, int64_t tokens, uint64_t seed);

// Varlen bounds [documents + 1] of `documents` documents over `tokens`
// tokens, cut at distinct random tokens (none empty) where there are
// enough, else with repeats (some empty); of three documents or more one
// is a single token.
std::vector<int32_t> drawDocuments(std::mt19937_64& rng, int64_t documents, int64_t tokens);

// A case for checking a 16-bit kernel against the contract's tolerance:
// drawCase with seed, seed + 1, ... until the float64 reference with its
// mixed rows, softmax weights and output rounded to the dtype (the least any
// tensor-core kernel loses: ihaForwardWithTensorCoreRounding) is within
// kCheckableShare of the dtype's tolerance, at most 64 draws;
// `expected` from the float64 reference. A spec may have no such draw (its
// function ill-conditioned in the dtype): findCheckableCase then gives none,
// so that a test draws another spec, and drawCheckableCase the draw the
// roundings hurt least (what the tuner verifies on). Draws are refused
// where the collapse cancels: pseudo-head outputs nearly equal with weights
// of opposite sign leave a small sum whose relative error is the rounding
// of its large terms (docs/IHA.md, Numerics). float32 specs take the first
// draw. The same seed gives the same case.
inline constexpr double kCheckableShare = 0.5;
// The backward's share of the gradient tolerance (backwardCheckShare) a
// checkable draw may take: a quarter for 16-bit dtypes; an eighth for
// float32, where a kernel's own partial sums are the roundings modelled and
// the CPU backend's dk was measured at 4.7 times the model's error (one
// token: its keys' dS sums to zero, and dk is the difference of two mixing
// weights times one row).
inline constexpr double kCheckableBackwardShare = 0.25;
inline constexpr double kCheckableFloat32BackwardShare = 0.125;
inline double checkableBackwardShare(v1::DType dtype) {
  return dtype == v1::float32 ? kCheckableFloat32BackwardShare : kCheckableBackwardShare;
}
std::optional<IhaCase> findCheckableCase(const KernelSpec& spec, int64_t batch, int64_t tokens, uint64_t seed);
IhaCase drawCheckableCase(const KernelSpec& spec, int64_t batch, int64_t tokens, uint64_t seed);

// The case with q, k, v (and dout) rounded to `dtype` and expected (and,
// with a dout, the expected gradients) recomputed by the float64 reference on exactly
// those inputs.
IhaCase withDtype(const IhaCase& c, v1::DType dtype);

// ||out - ref|| / ||ref||; NaN when any element of `out` is not finite.
double relativeError(const std::vector<double>& out, const std::vector<double>& ref);

// The contract's tolerance for a path whose inputs are `dtype`.
double toleranceFor(v1::DType dtype);

// The contract's tolerance for each gradient of the backward pass.
double gradientToleranceFor(v1::DType dtype);

// Each gradient's relative error against `want`, in kGradientNames' order;
// one the function makes vanish but for qk_norm's epsilon
// (reference::vanishesButForEpsilon) against all the gradients together,
// the size of its terms. NaN where `got` is not finite.
// `documents`: a varlen case's cu_seqlens (vanishesButForEpsilon).
std::vector<double> gradientErrors(const KernelSpec& spec, int64_t tokens, const reference::IhaGradients& got,
                                   const reference::IhaGradients& want, const std::vector<int32_t>& documents = {});
// The largest of gradientErrors; NaN when any is.
double worstGradientError(const KernelSpec& spec, int64_t tokens, const reference::IhaGradients& got,
                          const reference::IhaGradients& want, const std::vector<int32_t>& documents = {});

// dout [B, N, H, d] ~ N(0, 1), rounded to the spec's dtype as a kernel
// reads it. The same seed gives the same dout.
std::vector<double> drawDout(const KernelSpec& spec, int64_t batch, int64_t tokens, uint64_t seed);

// drawCheckableCase plus dout ~ N(0, 1) rounded to the dtype and the
// expected gradients; it draws again (seed + 1, ...) while the backward with
// the roundings every kernel of the dtype makes
// (reference::ihaBackwardWithRoundedMixing) is over checkableBackwardShare
// of the gradient tolerance in any gradient (a quarter, float32 an eighth:
// the model rounds what the kernels round, not in their order, and kernels
// measured up to 2.3 times its error on such draws, 4.7 in float32): a reduction over tokens that cancels
// (dalpha of one head), or dq of a row whose few keys nearly agree (dS
// rounded no longer sums to zero; in float32 dP - D cancelling for one
// token of collinear keys) can lose more than the tolerance to those
// roundings alone; or while the backward of q, k, v and dout moved by a
// random relative 4 units of float32's roundoff is (the float32 arithmetic
// every backend computes in: a dalpha whose reduction cancels, in float32,
// measured at 2.1 times the tolerance on a draw the rounding model passed).
// Some specs have no such draw in a 16-bit dtype (one kv
// head under a one-token window: a query's P keys are multiples of one row,
// their scores nearly agree, and every draw loses several times the
// tolerance to the roundings): findCheckableBackwardCase then gives none,
// drawCheckableBackwardCase the draw they hurt least.
std::optional<IhaCase> findCheckableBackwardCase(const KernelSpec& spec, int64_t batch, int64_t tokens,
                                                 uint64_t seed);
// The share of the gradient tolerance that measure gives inputs and dout
// whose float64 gradients are `expected`: the larger of the rounding model's
// and the float32 perturbation's worst gradient error, over the tolerance
// (the rounding model's alone where it is already over
// checkableBackwardShare).
double backwardCheckShare(const KernelSpec& spec, const reference::IhaInputs& inputs, const std::vector<double>& dout,
                          const reference::IhaGradients& expected);
IhaCase drawCheckableBackwardCase(const KernelSpec& spec, int64_t batch, int64_t tokens, uint64_t seed);

NpyType storageTypeOf(v1::DType dtype);
// `values` rounded to the storage type of `dtype`, as a kernel reads or
// stores them (float32 for float32).
std::vector<double> roundedToDtype(const std::vector<double>& values, v1::DType dtype);

}  // namespace loom
