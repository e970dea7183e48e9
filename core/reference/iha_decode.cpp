// The float64 decode step: plain loops over the page table (iha_decode.h).
#include "reference/iha_decode.h"

namespace loom::reference {
namespace {

using detail::Rows;

// The virtual rows of every token 0 .. total - 1 of sequence b, read back
// from the cache: mixed (and for keys normalised and rotated) here from a
// raw cache, as stored from a mixed one.
void cachedRows(const v1::KernelSpec& spec, const PagedCache& cache, int64_t b, int64_t total,
                const DecodeInputs& step, Rows& kRows, Rows& vRows) {
  const int64_t G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  const int64_t E = cacheTokenElements(spec, cache.mixed);
  if (!cache.mixed) {
    std::vector<double> k(size_t(total * E)), v(size_t(total * E));
    for (int64_t t = 0; t < total; ++t) {
      const int64_t slot = cacheSlot(cache, b, t);
      for (int64_t e = 0; e < E; ++e) {
        k[size_t(t * E + e)] = cache.k[size_t(slot * E + e)];
        v[size_t(t * E + e)] = cache.v[size_t(slot * E + e)];
      }
    }
    kRows = detail::mixAndInterleave(k, step.alpha_k, 0, total, G, P, d);
    vRows = detail::mixAndInterleave(v, step.alpha_v, 0, total, G, P, d);
    detail::normalizeAndRotate(spec, kRows);
    return;
  }
  kRows.assign(size_t(G), std::vector<std::vector<double>>(size_t(total * P), std::vector<double>(size_t(d))));
  vRows = kRows;
  for (int64_t t = 0; t < total; ++t) {
    const int64_t slot = cacheSlot(cache, b, t);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t c = 0; c < d; ++c) {
          kRows[g][t * P + p][c] = cache.k[size_t(slot * E + (g * P + p) * d + c)];
          vRows[g][t * P + p][c] = cache.v[size_t(slot * E + (g * P + p) * d + c)];
        }
  }
}

// Rows [first, first + count) of x [rows, heads * d], from the first.
std::vector<double> packedRows(const std::vector<double>& x, StepRows rows, int64_t rowElements) {
  const auto begin = x.begin() + rows.first * rowElements;
  return std::vector<double>(begin, begin + rows.count * rowElements);
}

}  // namespace

StepRows stepRows(const DecodeInputs& step, int64_t b) {
  if (step.query_start_loc.empty()) return {b * step.tokens, step.tokens};
  return {step.query_start_loc[size_t(b)], int64_t(step.query_start_loc[size_t(b) + 1]) - step.query_start_loc[size_t(b)]};
}

int64_t stepTotal(const DecodeInputs& step) {
  return step.query_start_loc.empty() ? step.batch * step.tokens : step.query_start_loc.back();
}

int64_t cacheSlot(const PagedCache& cache, int64_t b, int64_t t) {
  const int64_t page = cache.pageTable[size_t(b * cache.maxPages + t / cache.pageSize)];
  return page * cache.pageSize + t % cache.pageSize;
}

int64_t cacheTokenElements(const v1::KernelSpec& spec, bool mixed) {
  return int64_t(spec.kv_heads()) * spec.head_dim() * (mixed ? spec.pseudo_heads() : 1);
}

void appendToCache(const v1::KernelSpec& spec, const DecodeInputs& step, PagedCache& cache) {
  const int64_t G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  const int64_t E = cacheTokenElements(spec, cache.mixed);
  for (int64_t b = 0; b < step.batch; ++b) {
    const int64_t start = cache.cacheLen[size_t(b)];
    const StepRows rows = stepRows(step, b);
    const int64_t T = rows.count;
    if (!cache.mixed) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = cacheSlot(cache, b, start + t);
        for (int64_t e = 0; e < E; ++e) {
          cache.k[size_t(slot * E + e)] = step.k[size_t((rows.first + t) * E + e)];
          cache.v[size_t(slot * E + e)] = step.v[size_t((rows.first + t) * E + e)];
        }
      }
      continue;
    }
    Rows kRows = detail::mixAndInterleave(packedRows(step.k, rows, G * d), step.alpha_k, 0, T, G, P, d);
    const Rows vRows = detail::mixAndInterleave(packedRows(step.v, rows, G * d), step.alpha_v, 0, T, G, P, d);
    detail::normalizeAndRotate(spec, kRows, nullptr, start * P);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = cacheSlot(cache, b, start + t);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t p = 0; p < P; ++p)
          for (int64_t c = 0; c < d; ++c) {
            cache.k[size_t(slot * E + (g * P + p) * d + c)] = kRows[g][t * P + p][c];
            cache.v[size_t(slot * E + (g * P + p) * d + c)] = vRows[g][t * P + p][c];
          }
    }
  }
}

DecodeOutputs ihaDecode(const v1::KernelSpec& spec, const DecodeInputs& step, PagedCache& cache) {
  appendToCache(spec, step, cache);
  const int64_t B = step.batch, Tmost = step.tokens;
  const int64_t H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(), d = spec.head_dim();
  DecodeOutputs result;
  result.out.assign(size_t(stepTotal(step) * H * d), 0.0);
  result.lse.assign(size_t(B * H * Tmost * P), 0.0);

  std::vector<double> weights;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = cache.cacheLen[size_t(b)];
    const StepRows rows = stepRows(step, b);
    const int64_t T = rows.count;
    Rows kRows, vRows;
    cachedRows(spec, cache, b, start + T, step, kRows, vRows);
    Rows qRows = detail::mixAndInterleave(packedRows(step.q, rows, H * d), step.alpha_q, 0, T, H, P, d);
    detail::normalizeAndRotate(spec, qRows, nullptr, start * P);

    // Each new virtual row r sits at virtual row start*P + r of the sequence:
    // the forward's mask, RoPE position and keys.
    Rows pseudoOut(size_t(H), std::vector<std::vector<double>>(size_t(T * P), std::vector<double>(size_t(d), 0.0)));
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G);
      for (int64_t r = 0; r < T * P; ++r) {
        result.lse[size_t((b * H + h) * Tmost * P + r)] = detail::softmaxRow(spec, qRows[h][r], kRows[g], start * P + r, weights);
        for (size_t j = 0; j < weights.size(); ++j)
          if (weights[j] != 0.0)
            for (int64_t c = 0; c < d; ++c) pseudoOut[h][r][c] += weights[j] * vRows[g][j][c];
      }
    }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        double* target = &result.out[size_t(((rows.first + t) * H + h) * d)];
        for (int64_t source = 0; source < H; ++source)
          for (int64_t p = 0; p < P; ++p) {
            const int64_t at = detail::collapseIndex(spec, h, source, p);
            if (at < 0) continue;
            for (int64_t c = 0; c < d; ++c) target[c] += step.collapse[size_t(at)] * pseudoOut[source][t * P + p][c];
          }
      }
  }
  return result;
}

}  // namespace loom::reference
