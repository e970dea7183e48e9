#include "reference/iha_backward.h"

#include <algorithm>
#include <string>

namespace loom::reference {
namespace {

using detail::Rows;

// What a kernel stores: nothing rounded (the exact backward), every value
// it keeps rounded to a 16-bit dtype where the tensor cores take it, or to
// float32 where a float32 kernel keeps it (its accumulators too).
struct Rounding {
  bool on = false;
  v1::DType dtype = v1::float32;
  double operator()(double x) const {
    if (!on) return x;
    return dtype == v1::float32 ? double(float(x)) : detail::roundTo(x, dtype);
  }
  // Values a 16-bit kernel accumulates in f32 (every partial sum): rounded
  // only for a float32 kernel, where a sum that cancels keeps its terms'
  // rounding.
  double accumulator(double x) const { return on && dtype == v1::float32 ? double(float(x)) : x; }
};

void roundRows(Rows& rows, const Rounding& round) {
  if (!round.on) return;
  for (auto& head : rows)
    for (auto& row : head)
      for (double& x : row) x = round(x);
}

Rows zeroRows(int64_t heads, int64_t length, int64_t d) {
  return Rows(heads, std::vector<std::vector<double>>(length, std::vector<double>(d, 0.0)));
}

// The transposed mixing: dx[b, n, m, :] += sum_{h,p} alpha[m, h, p] *
// drows[h][n*P + p], and dalpha[m, h, p] += sum_{n,c} x[b, n, m, c] *
// drows[h][n*P + p][c].
void unmix(const Rows& drows, const std::vector<double>& x, const std::vector<double>& alpha, int64_t b,
           int64_t tokens, int64_t heads, int64_t pseudo, int64_t d, std::vector<double>& dx,
           std::vector<double>& dalpha, const Rounding& acc) {
  for (int64_t n = 0; n < tokens; ++n)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t p = 0; p < pseudo; ++p) {
        const std::vector<double>& g = drows[h][n * pseudo + p];
        for (int64_t m = 0; m < heads; ++m) {
          const int64_t at = (m * heads + h) * pseudo + p;
          const double* source = &x[((b * tokens + n) * heads + m) * d];
          double* target = &dx[((b * tokens + n) * heads + m) * d];
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) {
            target[c] = acc.accumulator(target[c] + alpha[at] * g[c]);
            dot = acc.accumulator(dot + source[c] * g[c]);
          }
          dalpha[at] = acc.accumulator(dalpha[at] + dot);
        }
      }
}

// The gradient through that norm, from the row before it (x), its factor r
// and the gradient of y: dx = r * dy - (r^3 / d) * (x . dy) * x.
void unnormalize(std::vector<double>& grad, const std::vector<double>& x, double r) {
  double dot = 0;
  for (size_t c = 0; c < x.size(); ++c) dot += x[c] * grad[c];
  const double k = r * r * r / double(x.size()) * dot;
  for (size_t c = 0; c < x.size(); ++c) grad[c] = r * grad[c] - k * x[c];
}

// q and k rows of one batch entry through steps 2 and 3, keeping what the
// backward of each needs: the rows before the norm and its factors.
struct Prepared {
  Rows mixed;                               // after step 1
  std::vector<std::vector<double>> factor;  // qk_norm's r per row
  Rows rows;                                // after steps 2 and 3: what attention sees
};

Prepared prepare(const v1::KernelSpec& spec, Rows mixed) {
  Prepared out;
  out.rows = mixed;
  out.mixed = std::move(mixed);
  detail::normalizeAndRotate(spec, out.rows, &out.factor);
  return out;
}

// Steps 3 and 2 backwards on the gradients of the attended rows, leaving
// the gradients of the mixed rows.
void unprepare(const v1::KernelSpec& spec, const Prepared& prepared, Rows& grads) {
  const int table = int(spec.rope_table_dtype());
  for (size_t h = 0; h < grads.size(); ++h)
    for (size_t i = 0; i < grads[h].size(); ++i) {
      auto unturn = [&] {  // the turn's transpose
        if (spec.rope_theta() > 0)
          detail::rotate(grads[h][i], int64_t(i), spec.rope_theta(), -detail::ropeDirection(spec), table);
      };
      if (table == 0) unturn();
      if (spec.qk_norm() == v1::KernelSpec::rms) {
        // The norm's input: the mixed row, or with a rounded table the turned one.
        std::vector<double> x = prepared.mixed[h][i];
        if (table != 0) detail::rotate(x, int64_t(i), spec.rope_theta(), detail::ropeDirection(spec), table);
        unnormalize(grads[h][i], x, prepared.factor[h][i]);
      }
      if (table != 0) unturn();
    }
}

}  // namespace

namespace {

// `rounding` rounds what a kernel stores or hands its tensor cores (and, for
// float32, every partial sum it keeps).
IhaGradients backward(const v1::KernelSpec& spec, const IhaInputs& in, const std::vector<double>& dout,
                      const Rounding& rounding) {
  const int64_t B = in.batch, N = in.tokens;
  const int64_t H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  const int64_t L = N * P;
  const double scale = detail::scaleOf(spec);

  IhaGradients g;
  g.dq.assign(in.q.size(), 0.0);
  g.dk.assign(in.k.size(), 0.0);
  g.dv.assign(in.v.size(), 0.0);
  g.dalpha_q.assign(in.alpha_q.size(), 0.0);
  g.dalpha_k.assign(in.alpha_k.size(), 0.0);
  g.dalpha_v.assign(in.alpha_v.size(), 0.0);
  g.dcollapse.assign(in.collapse.size(), 0.0);
  if (!in.cu_seqlens.empty()) {  // varlen: each document alone, the weights' gradients summed
    for (size_t doc = 0; doc + 1 < in.cu_seqlens.size(); ++doc) {
      const int64_t begin = in.cu_seqlens[doc], end = in.cu_seqlens[doc + 1];
      if (end == begin) continue;
      const IhaGradients one =
          backward(spec, detail::documentInputs(spec, in, begin, end),
                   std::vector<double>(dout.begin() + begin * H * d, dout.begin() + end * H * d), rounding);
      std::copy(one.dq.begin(), one.dq.end(), g.dq.begin() + begin * H * d);
      std::copy(one.dk.begin(), one.dk.end(), g.dk.begin() + begin * G * d);
      std::copy(one.dv.begin(), one.dv.end(), g.dv.begin() + begin * G * d);
      for (auto [sum, part] : {std::pair{&g.dalpha_q, &one.dalpha_q}, {&g.dalpha_k, &one.dalpha_k},
                               {&g.dalpha_v, &one.dalpha_v}, {&g.dcollapse, &one.dcollapse}})
        for (size_t e = 0; e < sum->size(); ++e) (*sum)[e] += (*part)[e];
    }
    return g;
  }

  std::vector<double> weights, o(static_cast<size_t>(d));
  for (int64_t b = 0; b < B; ++b) {
    Prepared q = prepare(spec, detail::mixAndInterleave(in.q, in.alpha_q, b, N, H, P, d));
    Prepared k = prepare(spec, detail::mixAndInterleave(in.k, in.alpha_k, b, N, G, P, d));
    Rows v = detail::mixAndInterleave(in.v, in.alpha_v, b, N, G, P, d);
    roundRows(q.rows, rounding);  // the workspaces the kernel's loops read
    roundRows(k.rows, rounding);
    roundRows(v, rounding);

    // The collapse backward into the pseudo outputs: do = sum of collapse
    // weights times dout (it needs no forward value).
    Rows dO = zeroRows(H, L, d);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h) {
        const double* grad = &dout[((b * N + n) * H + h) * d];
        for (int64_t source = 0; source < H; ++source)
          for (int64_t p = 0; p < P; ++p) {
            const int64_t at = detail::collapseIndex(spec, h, source, p);
            if (at < 0) continue;
            for (int64_t c = 0; c < d; ++c) dO[source][n * P + p][c] += in.collapse[at] * grad[c];
          }
      }

    roundRows(dO, rounding);

    // Per query head and virtual row, as FlashAttention's backward: w
    // recomputed, the pseudo output o (for dcollapse and D = <do, o>), then
    // ds = w (dp - D) into dq, dk, dv.
    Rows dqRows = zeroRows(H, L, d), dkRows = zeroRows(G, L, d), dvRows = zeroRows(G, L, d);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kv = h / (H / G);
      for (int64_t i = 0; i < L; ++i) {
        detail::softmaxRow(spec, q.rows[h][i], k.rows[kv], i, weights);
        // o_pseudo as the forward's attention makes it: its tensor cores
        // take the unnormalised weights exp(s - max) in the dtype, and the
        // row's sum divides after (the error it leaves in D = <do, o> is
        // in every dS of the row).
        const double top = *std::max_element(weights.begin(), weights.end());
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t j = 0; j < L; ++j) {
          if (weights[j] == 0.0) continue;
          const double taken = rounding.on ? rounding(weights[j] / top) * top : weights[j];
          for (int64_t c = 0; c < d; ++c) o[c] = rounding.accumulator(o[c] + taken * v[kv][j][c]);
        }
        for (double& x : o) x = rounding(x);
        const int64_t n = i / P, p = i % P;
        for (int64_t target = 0; target < H; ++target) {
          const int64_t at = detail::collapseIndex(spec, target, h, p);
          if (at < 0) continue;
          const double* grad = &dout[((b * N + n) * H + target) * d];
          for (int64_t c = 0; c < d; ++c) g.dcollapse[at] = rounding.accumulator(g.dcollapse[at] + grad[c] * o[c]);
        }
        const std::vector<double>& dOi = dO[h][i];
        double D = 0;
        for (int64_t c = 0; c < d; ++c) D = rounding.accumulator(D + dOi[c] * o[c]);
        for (int64_t j = 0; j < L; ++j) {
          if (weights[j] == 0.0) continue;
          double dp = 0;
          for (int64_t c = 0; c < d; ++c) dp = rounding.accumulator(dp + dOi[c] * v[kv][j][c]);
          // The tensor cores take P and dS in the dtype.
          const double ds = rounding(weights[j] * (dp - D));
          const double w = rounding(weights[j]);
          for (int64_t c = 0; c < d; ++c) {
            dvRows[kv][j][c] = rounding.accumulator(dvRows[kv][j][c] + w * dOi[c]);
            dqRows[h][i][c] = rounding.accumulator(dqRows[h][i][c] + scale * ds * k.rows[kv][j][c]);
            dkRows[kv][j][c] = rounding.accumulator(dkRows[kv][j][c] + scale * ds * q.rows[h][i][c]);
          }
        }
      }
    }

    unprepare(spec, q, dqRows);
    unprepare(spec, k, dkRows);
    unmix(dqRows, in.q, in.alpha_q, b, N, H, P, d, g.dq, g.dalpha_q, rounding);
    unmix(dkRows, in.k, in.alpha_k, b, N, G, P, d, g.dk, g.dalpha_k, rounding);
    unmix(dvRows, in.v, in.alpha_v, b, N, G, P, d, g.dv, g.dalpha_v, rounding);
  }
  return g;
}

}  // namespace

IhaGradients ihaBackward(const v1::KernelSpec& spec, const IhaInputs& inputs, const std::vector<double>& dout) {
  return backward(spec, inputs, dout, Rounding{});
}

IhaGradients ihaBackwardWithRoundedMixing(const v1::KernelSpec& spec, const IhaInputs& inputs,
                                          const std::vector<double>& dout, v1::DType dtype) {
  return backward(spec, inputs, dout, Rounding{true, dtype});
}

bool vanishesButForEpsilon(const v1::KernelSpec& spec, int64_t tokens, size_t gradient,
                           const std::vector<int32_t>& documents) {
  if (!documents.empty()) {
    bool any = false;
    for (size_t doc = 0; doc + 1 < documents.size(); ++doc) {
      const int64_t length = documents[doc + 1] - documents[doc];
      if (length == 0) continue;
      if (!vanishesButForEpsilon(spec, length, gradient)) return false;
      any = true;
    }
    return any;
  }
  const std::string name = kGradientNames[gradient];
  const bool fromRows = name == "dq" || name == "dk" || name == "dalpha_q" || name == "dalpha_k";
  const bool onePseudoHead = spec.pseudo_heads() == 1;
  // The keys every query sees come from its own token: a one-token window
  // (a flat one only when a token is one row), or a single token.
  const bool oneToken = (spec.window() == 1 && (spec.mask() != v1::flat_causal ||
                                                spec.window_align() == v1::KernelSpec::token || onePseudoHead)) ||
                        tokens == 1;
  // A row that sees only itself has P = 1, so dS = P (dP - D) = 0: dq, dk and
  // the dalphas built from their rows vanish, qk_norm or not. Every rule
  // lets a row see an interval of rows around itself, so its neighbours say.
  auto everyRowSeesOnlyItself = [&] {
    const int64_t L = tokens * spec.pseudo_heads();
    for (int64_t i = 0; i < L; ++i)
      if ((i > 0 && allowed(spec, i, i - 1)) || (i + 1 < L && allowed(spec, i, i + 1))) return false;
    return true;
  };
  if (fromRows && everyRowSeesOnlyItself()) return true;
  if (spec.qk_norm() != v1::KernelSpec::rms) return false;
  // dq and dk vanish, and with them the dalphas built from their rows,
  // unless RoPE turns each of the token's rows by its own angle.
  const bool keysAgree = spec.kv_heads() == 1 && oneToken && spec.rope_theta() == 0;
  if (name == "dalpha_q") return spec.heads() == 1 || keysAgree;
  if (name == "dalpha_k") return spec.kv_heads() == 1;
  if (name == "dq" || name == "dk") return keysAgree;
  return false;
}

double qkNormEpsilonWeight(const v1::KernelSpec& spec, const IhaInputs& inputs) {
  if (spec.qk_norm() != v1::KernelSpec::rms) return 0;
  const double eps = detail::qkNormEps(spec);
  const int64_t N = inputs.tokens, H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  double weight = 0;
  for (int64_t b = 0; b < inputs.batch; ++b)
    for (const Rows& rows : {detail::mixAndInterleave(inputs.q, inputs.alpha_q, b, N, H, P, d),
                             detail::mixAndInterleave(inputs.k, inputs.alpha_k, b, N, G, P, d)})
      for (const auto& head : rows)
        for (const auto& row : head) {
          double meanSquare = 0;
          for (double x : row) meanSquare += x * x / double(d);
          weight = std::max(weight, eps / (meanSquare + eps));
        }
  return weight;
}

}  // namespace loom::reference
