#include "reference/iha_reference.h"

#include <cmath>
#include <limits>

#include "loom/half.h"

namespace loom::reference {

double detail::roundTo(double x, v1::DType dtype) {
  switch (dtype) {
    case v1::float16: return double(half::halfToFloat(half::floatToHalf(float(x))));
    case v1::bfloat16: return double(half::bfloat16ToFloat(half::floatToBfloat16(float(x))));
    default: return x;
  }
}

namespace {
using detail::roundTo;

// qk_norm "rms": the row becomes x * r, r = (mean(x^2) + eps)^(-1/2); returns r.
double rmsNormalize(std::vector<double>& row, double eps) {
  double squares = 0;
  for (double x : row) squares += x * x;
  const double factor = 1.0 / std::sqrt(squares / double(row.size()) + eps);
  for (double& x : row) x *= factor;
  return factor;
}

}  // namespace

namespace detail {

double scaleOf(const v1::KernelSpec& spec) {
  return spec.has_scale() ? spec.scale() : 1.0 / std::sqrt(double(spec.head_dim()));
}

double ropeDirection(const v1::KernelSpec& spec) {
  return spec.rope_direction() == v1::KernelSpec::negative ? -1.0 : 1.0;
}

void rotate(std::vector<double>& row, int64_t position, double theta, double direction, int table) {
  const int64_t d = int64_t(row.size());
  for (int64_t j = 0; j < d / 2; ++j) {
    double c, s;
    if (table != 0) {
      const double angle = half::ropeTableAngle(position, half::ropeTableInvFreq(theta, int(j), int(d)));
      c = half::ropeTableRound(std::cos(angle), table);
      s = direction * half::ropeTableRound(std::sin(angle), table);
    } else {
      const double angle = direction * double(position) * std::pow(theta, -2.0 * double(j) / double(d));
      c = std::cos(angle);
      s = std::sin(angle);
    }
    const double x0 = row[j], x1 = row[j + d / 2];
    row[j] = x0 * c - x1 * s;
    row[j + d / 2] = x0 * s + x1 * c;
  }
}

Rows mixAndInterleave(const std::vector<double>& x, const std::vector<double>& alpha, int64_t b, int64_t tokens,
                      int64_t heads, int64_t pseudo, int64_t d, v1::DType rounding) {
  Rows rows(heads, std::vector<std::vector<double>>(tokens * pseudo, std::vector<double>(d, 0.0)));
  for (int64_t n = 0; n < tokens; ++n)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t p = 0; p < pseudo; ++p)
        for (int64_t m = 0; m < heads; ++m) {
          const double weight = alpha[(m * heads + h) * pseudo + p];
          const double* source = &x[((b * tokens + n) * heads + m) * d];
          for (int64_t c = 0; c < d; ++c) rows[h][n * pseudo + p][c] += weight * source[c];
        }
  if (rounding != v1::float32)
    for (auto& head : rows)
      for (auto& row : head)
        for (double& x : row) x = roundTo(x, rounding);
  return rows;
}

double qkNormEps(const v1::KernelSpec& spec) { return spec.has_qk_norm_eps() ? spec.qk_norm_eps() : 1e-6; }

void normalizeAndRotate(const v1::KernelSpec& spec, Rows& rows, std::vector<std::vector<double>>* factors,
                        int64_t firstPosition) {
  const double eps = qkNormEps(spec);
  if (factors) factors->assign(rows.size(), std::vector<double>(rows.empty() ? 0 : rows[0].size(), 1.0));
  // A rounded table's turn does not keep a row's norm: the norm is then
  // taken of the turned row (public code's order, docs/IHA.md, Options);
  // with exact angles either order is the same function.
  const bool turnFirst = spec.rope_table_dtype() != v1::KernelSpec::exact;
  for (size_t h = 0; h < rows.size(); ++h)
    for (size_t i = 0; i < rows[h].size(); ++i) {
      auto turn = [&] {
        if (spec.rope_theta() > 0)
          rotate(rows[h][i], firstPosition + int64_t(i), spec.rope_theta(), ropeDirection(spec),
                 int(spec.rope_table_dtype()));
      };
      if (turnFirst) turn();
      if (spec.qk_norm() == v1::KernelSpec::rms) {
        const double factor = rmsNormalize(rows[h][i], eps);
        if (factors) (*factors)[h][i] = factor;
      }
      if (!turnFirst) turn();
    }
}

double softmaxRow(const v1::KernelSpec& spec, const std::vector<double>& query,
                  const std::vector<std::vector<double>>& keys, int64_t i, std::vector<double>& weights) {
  const int64_t L = int64_t(keys.size()), d = int64_t(query.size());
  const double scale = scaleOf(spec);
  weights.assign(size_t(L), 0.0);
  double top = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < L; ++j) {
    if (!allowed(spec, i, j)) continue;
    double dot = 0;
    for (int64_t c = 0; c < d; ++c) dot += query[c] * keys[j][c];
    weights[j] = scale * dot;
    top = std::max(top, weights[j]);
  }
  double sum = 0;
  for (int64_t j = 0; j < L; ++j)
    if (allowed(spec, i, j)) sum += (weights[j] = std::exp(weights[j] - top));
  for (double& w : weights) w /= sum;  // masked entries stay 0
  return top + std::log(sum);
}

IhaInputs documentInputs(const v1::KernelSpec& spec, const IhaInputs& in, int64_t begin, int64_t end) {
  const int64_t H = spec.heads(), G = spec.kv_heads(), d = spec.head_dim();
  IhaInputs doc = in;
  doc.batch = 1;
  doc.tokens = end - begin;
  doc.cu_seqlens.clear();
  auto rows = [&](const std::vector<double>& x, int64_t heads) {
    return std::vector<double>(x.begin() + begin * heads * d, x.begin() + end * heads * d);
  };
  doc.q = rows(in.q, H);
  doc.k = rows(in.k, G);
  doc.v = rows(in.v, G);
  return doc;
}

int64_t collapseIndex(const v1::KernelSpec& spec, int64_t h, int64_t source, int64_t p) {
  const int64_t H = spec.heads(), P = spec.pseudo_heads();
  if (spec.collapse() == v1::per_head) return source == h ? h * P + p : -1;
  return (h * H + source) * P + p;
}

}  // namespace detail

bool allowed(const v1::KernelSpec& spec, int64_t i, int64_t j) {
  const int64_t P = spec.pseudo_heads();
  const int64_t W = spec.window();
  const int64_t ti = i / P, tj = j / P;
  if (spec.window_rows() > 0) return j <= i && i - j < spec.window_rows();  // flat_causal only
  if (W > 0 && spec.window_align() == v1::KernelSpec::token) {
    const bool own = spec.mask() == v1::flat_causal ? j <= i : spec.mask() == v1::token_causal ? tj <= ti : true;
    return own && 0 <= ti - tj && ti - tj < W;
  }
  switch (spec.mask()) {
    case v1::flat_causal: return j <= i && (W == 0 || i - j < W * P);
    case v1::token_causal: return tj <= ti && (W == 0 || ti - tj < W);
    case v1::none: return W == 0 || std::llabs(ti - tj) < W;
    default: return false;
  }
}

namespace {

// `rounding` (unless float32): the mixed rows, and with `tensorCoreRounding`
// also the softmax weights (the probabilities a tensor-core kernel feeds its
// P V product in the dtype) and the output (stored in the dtype).
IhaOutputs forward(const v1::KernelSpec& spec, const IhaInputs& in, v1::DType rounding, bool tensorCoreRounding) {
  using detail::Rows;
  const int64_t B = in.batch, N = in.tokens;
  const int64_t H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  const int64_t L = N * P;

  IhaOutputs result;
  result.out.assign(size_t(B * N * H * d), 0.0);
  result.lse.assign(size_t(B * H * L), 0.0);
  if (!in.cu_seqlens.empty()) {  // varlen: each document alone
    for (size_t doc = 0; doc + 1 < in.cu_seqlens.size(); ++doc) {
      const int64_t begin = in.cu_seqlens[doc], end = in.cu_seqlens[doc + 1];
      if (end == begin) continue;
      const IhaOutputs one = forward(spec, detail::documentInputs(spec, in, begin, end), rounding, tensorCoreRounding);
      std::copy(one.out.begin(), one.out.end(), result.out.begin() + begin * H * d);
      const int64_t rows = (end - begin) * P;
      for (int64_t h = 0; h < H; ++h)
        std::copy(one.lse.begin() + h * rows, one.lse.begin() + (h + 1) * rows, result.lse.begin() + h * L + begin * P);
    }
    return result;
  }

  std::vector<double> weights;
  for (int64_t b = 0; b < B; ++b) {
    Rows qRows = detail::mixAndInterleave(in.q, in.alpha_q, b, N, H, P, d, rounding);
    Rows kRows = detail::mixAndInterleave(in.k, in.alpha_k, b, N, G, P, d, rounding);
    const Rows vRows = detail::mixAndInterleave(in.v, in.alpha_v, b, N, G, P, d, rounding);
    detail::normalizeAndRotate(spec, qRows);
    detail::normalizeAndRotate(spec, kRows);

    // Step 4: softmax attention of every virtual row, per query head.
    Rows pseudoOut(H, std::vector<std::vector<double>>(L, std::vector<double>(d, 0.0)));
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G);
      for (int64_t i = 0; i < L; ++i) {
        result.lse[(b * H + h) * L + i] = detail::softmaxRow(spec, qRows[h][i], kRows[g], i, weights);
        if (tensorCoreRounding && rounding != v1::float32)
          for (double& w : weights) w = roundTo(w, rounding);
        for (int64_t j = 0; j < L; ++j)
          if (weights[j] != 0.0)
            for (int64_t c = 0; c < d; ++c) pseudoOut[h][i][c] += weights[j] * vRows[g][j][c];
      }
    }

    // Step 5: fold the P pseudo outputs back into H heads.
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h) {
        double* target = &result.out[((b * N + n) * H + h) * d];
        for (int64_t source = 0; source < H; ++source)
          for (int64_t p = 0; p < P; ++p) {
            const int64_t at = detail::collapseIndex(spec, h, source, p);
            if (at < 0) continue;
            for (int64_t c = 0; c < d; ++c) target[c] += in.collapse[at] * pseudoOut[source][n * P + p][c];
          }
      }
  }
  if (tensorCoreRounding && rounding != v1::float32)
    for (double& x : result.out) x = roundTo(x, rounding);
  return result;
}

}  // namespace

IhaOutputs ihaForward(const v1::KernelSpec& spec, const IhaInputs& inputs) {
  return forward(spec, inputs, v1::float32, false);
}

IhaOutputs ihaForwardWithRoundedMixing(const v1::KernelSpec& spec, const IhaInputs& inputs, v1::DType dtype) {
  return forward(spec, inputs, dtype, false);
}

IhaOutputs ihaForwardWithTensorCoreRounding(const v1::KernelSpec& spec, const IhaInputs& inputs, v1::DType dtype) {
  return forward(spec, inputs, dtype, true);
}

}  // namespace loom::reference
