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
  // Varlen (KernelSpec.varlen): batch 1 holds documents one after another,
  // document i tokens [cu_seqlens[i], cu_seqlens[i + 1]); empty otherwise.
  std::vector<int32_t> cu_seqlens;
  // A ragged decode step (docs/IHA.md, Ragged steps): q, k and v pack every
  // sequence's new tokens, sequence b's rows query_start_loc[b] ..
  // query_start_loc[b + 1] - 1 of [total, heads, d], and tokens is the most
  // any sequence brings; empty for a uniform step (or a forward).
  std::vector<int32_t> query_start_loc;
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
// ihaForwardWithRoundedMixing with the softmax weights rounded to `dtype`
// too (a tensor-core kernel's P V takes them in the dtype) and the output
// (stored in the dtype): every rounding such a kernel cannot avoid, which
// a cancelling collapse amplifies alike (case.h, findCheckableCase).
IhaOutputs ihaForwardWithTensorCoreRounding(const v1::KernelSpec& spec, const IhaInputs& inputs, v1::DType dtype);

// The forward's steps, shared with the backward reference (iha_backward.h).
namespace detail {

// rows[head][virtual row][d].
using Rows = std::vector<std::vector<std::vector<double>>>;

// The value a 16-bit store of x keeps (float16 or bfloat16; float32 keeps
// the double).
double roundTo(double x, v1::DType dtype);

// The score scale: spec.scale, or 1/sqrt(d).
double scaleOf(const v1::KernelSpec& spec);

// +1, or -1 for rope_direction "negative".
double ropeDirection(const v1::KernelSpec& spec);

// Steps 1 and 2 for batch entry b of q (heads = H) or k / v (heads = G):
// row n*P + p of head h is sum_m alpha[m, h, p] * x[b, n, m, :], rounded to
// `rounding` unless float32.
Rows mixAndInterleave(const std::vector<double>& x, const std::vector<double>& alpha, int64_t b, int64_t tokens,
                      int64_t heads, int64_t pseudo, int64_t d, v1::DType rounding = v1::float32);

// qk_norm's epsilon (the schema's default where the spec names none).
double qkNormEps(const v1::KernelSpec& spec);

// qk_norm (when on) and RoPE (when rope_theta > 0) on q or k rows, row r
// at virtual position firstPosition + r (a decode step's rows start past
// the cache); with `factors`, each row's norm factor r (y = x * r; 1
// without qk_norm).
void normalizeAndRotate(const v1::KernelSpec& spec, Rows& rows, std::vector<std::vector<double>>* factors = nullptr,
                        int64_t firstPosition = 0);

// Half-split rotary embedding of a row at virtual position `position`;
// `direction` -1 turns by the opposite angle (and undoes a turn by +1, or
// with a rounded table is the turn's transpose). `table`: the spec's
// rope_table_dtype (0 exact angles; 1 and 2 the public table's entries,
// loom/half.h).
void rotate(std::vector<double>& row, int64_t position, double theta, double direction, int table = 0);

// Step 4 for virtual row i: the softmax weights of `query` against every
// row of `keys` under the mask (0 where masked) into `weights`; returns the
// row's lse.
double softmaxRow(const v1::KernelSpec& spec, const std::vector<double>& query,
                  const std::vector<std::vector<double>>& keys, int64_t i, std::vector<double>& weights);

// Varlen: tokens [begin, end) of a packed batch (batch 1) alone, a batch of
// one sequence without cu_seqlens. The forward and the backward of packed
// inputs are those of each document so taken (docs/IHA.md, Varlen).
IhaInputs documentInputs(const v1::KernelSpec& spec, const IhaInputs& in, int64_t begin, int64_t end);

// Step 5: the index into collapse of pseudo-head p of source head `source`
// in output head h, or -1 where per_head collapse does not connect them.
int64_t collapseIndex(const v1::KernelSpec& spec, int64_t h, int64_t source, int64_t p);

}  // namespace detail

}  // namespace loom::reference
