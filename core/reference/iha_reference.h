// The float64 oracle of Interleaved Head Attention (docs/IHA.md).
//
// Plain loops that follow the contract step by step: mix, interleave,
// normalise (qk_norm), rotate, attend, collapse. It shares no code with the
// generated kernels; every other backend is judged against it.
#pragma once

#include <cstdint>
#include <vector>

#include "loom/v1/loom.pb.h"

namespace loom::reference {

// Inputs in row-major order, widened to double:
//   q [B, N, H, d], k and v [B, N, G, d], alpha_q [H, H, P],
//   alpha_k and alpha_v [G, G, P], collapse [H, P] or [H, H*P].
struct IhaInputs {
  int64_t batch = 0;
  int64_t tokens = 0;
  std::vector<double> q, k, v;
  std::vector<double> alpha_q, alpha_k, alpha_v;
  std::vector<double> collapse;
};

struct IhaOutputs {
  std::vector<double> out;  // [B, N, H, d]
  std::vector<double> lse;  // [B, H, N*P]
};

// Whether virtual row i may attend to virtual row j under the spec's mask.
bool allowed(const v1::KernelSpec& spec, int64_t i, int64_t j);

// Computes IHA. The spec must have passed validateSpec and the input sizes
// must match it; the caller checks both.
IhaOutputs ihaForward(const v1::KernelSpec& spec, const IhaInputs& inputs);

// ihaForward with every mixed q, k and v row rounded to `dtype` (float16 or
// bfloat16) as soon as it is mixed, the rest in float64: the least any
// 16-bit tensor-core kernel loses, since its matrix units take the mixed
// rows in the dtype. How far this is from ihaForward says whether a case
// can check such a kernel against the contract's tolerance at all
// (docs/IHA.md, Numerics).
IhaOutputs ihaForwardWithRoundedMixing(const v1::KernelSpec& spec, const IhaInputs& inputs, v1::DType dtype);

}  // namespace loom::reference
