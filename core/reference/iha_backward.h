// The float64 oracle of IHA's backward pass (docs/IHA.md, "Backward").
//
// Plain loops again, in the forward's order reversed: collapse, attention
// (FlashAttention's backward on each head's virtual sequence, the softmax
// weights recomputed from q, k and lse), RoPE, qk_norm, mixing. It recomputes
// the forward's intermediates itself and shares no code with the generated
// kernels; tests check it against central finite differences of ihaForward.
#pragma once

#include <vector>

#include "reference/iha_reference.h"

namespace loom::reference {

// Gradients of sum(out * dout) with respect to every input, widened to
// double and in the layouts of IhaInputs: dq [B, N, H, d], dk and dv
// [B, N, G, d], dalpha_q [H, H, P], dalpha_k and dalpha_v [G, G, P],
// dcollapse [H, P] or [H, H*P].
struct IhaGradients {
  std::vector<double> dq, dk, dv;
  std::vector<double> dalpha_q, dalpha_k, dalpha_v;
  std::vector<double> dcollapse;
};

// The gradient names in the order of IhaGradients, as the backward case
// files name them (expected_<name>.npy).
inline constexpr const char* kGradientNames[] = {"dq", "dk", "dv", "dalpha_q", "dalpha_k", "dalpha_v", "dcollapse"};

// Pointers to the members of `g`, in kGradientNames' order.
inline std::vector<std::vector<double>*> gradientsOf(IhaGradients& g) {
  return {&g.dq, &g.dk, &g.dv, &g.dalpha_q, &g.dalpha_k, &g.dalpha_v, &g.dcollapse};
}
inline std::vector<const std::vector<double>*> gradientsOf(const IhaGradients& g) {
  return {&g.dq, &g.dk, &g.dv, &g.dalpha_q, &g.dalpha_k, &g.dalpha_v, &g.dcollapse};
}

// Computes the gradients for `dout` [B, N, H, d]. The spec must have passed
// validateSpec and every size must match it; the caller checks both.
IhaGradients ihaBackward(const v1::KernelSpec& spec, const IhaInputs& inputs, const std::vector<double>& dout);

// ihaBackward with what every FlashAttention-style kernel rounds to `dtype`:
// for float16 or bfloat16 the attended q, k, v rows (its workspaces), the
// pseudo outputs o and their gradients do, and P and dS (the tensor cores'
// operands; o from the forward's unnormalised weights exp(s - max) rounded,
// as its tensor cores take them); for float32 those and every partial sum (dP, D, o, the
// pseudo-row gradients, dcollapse, the transposed mixing's sums), as a
// float32 kernel accumulates them: how far it is from ihaBackward says whether a case can check such a
// kernel against the gradient tolerance at all (docs/IHA.md, Numerics).
IhaGradients ihaBackwardWithRoundedMixing(const v1::KernelSpec& spec, const IhaInputs& inputs,
                                          const std::vector<double>& dout, v1::DType dtype);

// Does the function make gradient `gradient` (kGradientNames' order) vanish
// but for qk_norm's epsilon? With qk_norm a row mixed from one head is that
// head's row normalised whatever its weight, so dalpha_q (one head) and
// dalpha_k (one kv head) vanish; with one kv head a token's P keys are one
// row normalised (up to sign), so under a one-token window every query sees
// keys of equal score and softmax's shift invariance makes dq and dk (and
// dalpha_q, built from dq's rows) vanish too. Such a gradient has no relative error to speak of: a float32 kernel
// leaves rounding noise of its terms' size where the exact value is
// epsilon-sized.
// `tokens`: N of the case (a single token is a one-token window); also,
// where every row sees only itself (one pseudo head under a one-token
// window, a flat window of one row) dq, dk, dalpha_q and dalpha_k vanish
// exactly. A varlen case's gradients vanish where they do in each of its
// documents (`documents`, its cu_seqlens; empty documents aside).
bool vanishesButForEpsilon(const v1::KernelSpec& spec, int64_t tokens, size_t gradient,
                           const std::vector<int32_t>& documents = {});

// How epsilon-sized such a gradient is on `inputs`: the largest share
// eps / (mean square + eps) that qk_norm's epsilon takes of a q or k row's
// norm (0 without qk_norm). It is eps for rows of unit mean square, but a
// short row of small entries (head_dim 2, a drawn token near zero) gives
// epsilon a larger say, and the "vanishing" gradients grow with it.
double qkNormEpsilonWeight(const v1::KernelSpec& spec, const IhaInputs& inputs);

}  // namespace loom::reference
