// Helpers shared by loom's tests: the case folders in tests/data, random
// specs, and running the loom binary.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <unistd.h>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <vector>

#include <gtest/gtest.h>

#include "io/case.h"
#include "io/npy.h"
#include "reference/iha_backward.h"
#include "reference/iha_reference.h"

namespace loom::testing {

// A spec from the fields a test cares about; kv_heads 0 means kv_heads = heads.
struct SpecFields {
  int heads = 4;
  int kvHeads = 0;
  int pseudoHeads = 2;
  int headDim = 64;
  v1::DType dtype = v1::bfloat16;
  v1::MaskMode mask = v1::flat_causal;
  int window = 0;
  v1::CollapseMode collapse = v1::per_head;
  double ropeTheta = 0;
};

inline KernelSpec makeSpec(const SpecFields& f) {
  KernelSpec spec;
  spec.set_heads(f.heads);
  spec.set_kv_heads(f.kvHeads ? f.kvHeads : f.heads);
  spec.set_pseudo_heads(f.pseudoHeads);
  spec.set_head_dim(f.headDim);
  spec.set_dtype(f.dtype);
  spec.set_mask(f.mask);
  spec.set_window(f.window);
  spec.set_collapse(f.collapse);
  spec.set_rope_theta(f.ropeTheta);
  return spec;
}

inline std::string dataDir() { return LOOM_TEST_DATA; }
inline std::string casesDir() { return dataDir() + "/cases"; }

inline std::vector<std::string> sharedCaseNames() {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(casesDir()))
    if (entry.is_directory()) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A fresh seed per process run, printed so a failure can be replayed with
// LOOM_TEST_SEED=<seed>.
inline uint64_t testSeed() {
  static const uint64_t seed = [] {
    if (const char* fixed = std::getenv("LOOM_TEST_SEED")) return uint64_t(std::stoull(fixed));
    return uint64_t(std::random_device{}()) << 32 | std::random_device{}();
  }();
  static bool printed = false;
  if (!printed) {
    std::printf("[ seed     ] LOOM_TEST_SEED=%llu\n", (unsigned long long)seed);
    printed = true;
  }
  return seed;
}

// The options of public IHA code (docs/IHA.md), each drawn where it applies:
// qk_norm rms (with the default epsilon or its own), rope_direction negative,
// window_align token, and window_rows (flat_causal without a window) at or
// off multiples of P.
inline void drawOptions(KernelSpec& spec, std::mt19937_64& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  if (pick(0, 2) == 0) {
    spec.set_qk_norm(v1::KernelSpec::rms);
    if (pick(0, 1)) spec.set_qk_norm_eps(std::pow(10.0, -pick(3, 7)));
  }
  if (spec.rope_theta() > 0 && pick(0, 1)) spec.set_rope_direction(v1::KernelSpec::negative);
  if (spec.window() > 0 && pick(0, 2) == 0) spec.set_window_align(v1::KernelSpec::token);
  if (spec.mask() == v1::flat_causal && spec.window() == 0 && pick(0, 2) == 0)
    spec.set_window_rows(pick(1, 3 * spec.pseudo_heads() + 2));
}

// Clears the options a test's own edits left meaningless (validateSpec
// refuses them): a direction without RoPE, an alignment without a window,
// window_rows off flat_causal or beside a window.
inline void dropStaleOptions(KernelSpec& spec) {
  if (spec.rope_theta() == 0) spec.clear_rope_direction();
  if (spec.window() == 0) spec.clear_window_align();
  if (spec.mask() != v1::flat_causal || spec.window() != 0) spec.clear_window_rows();
}

// The plain function of docs/IHA.md: no options.
inline void clearOptions(KernelSpec& spec) {
  spec.clear_qk_norm();
  spec.clear_qk_norm_eps();
  spec.clear_rope_direction();
  spec.clear_window_align();
  spec.clear_window_rows();
}

// A random valid spec: small enough for the float64 reference, with the
// options drawn too.
inline KernelSpec randomSpec(std::mt19937_64& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  KernelSpec spec;
  const int G = pick(1, 3);
  spec.set_kv_heads(G);
  spec.set_heads(G * pick(1, 3));
  spec.set_pseudo_heads(pick(1, 4));
  spec.set_head_dim(2 * pick(1, 12));
  spec.set_dtype(v1::float32);
  spec.set_mask(static_cast<v1::MaskMode>(pick(1, 3)));
  spec.set_window(pick(0, 1) ? 0 : pick(1, 6));
  spec.set_collapse(static_cast<v1::CollapseMode>(pick(1, 2)));
  spec.set_rope_theta(pick(0, 1) ? 0.0 : 10000.0);
  if (pick(0, 3) == 0) spec.set_scale(0.05 + 0.3 * std::uniform_real_distribution<double>()(rng));
  drawOptions(spec, rng);
  return spec;
}

// A spec, batch and token count a test drew.
struct DrawnShape {
  KernelSpec spec;
  int64_t batch = 1, tokens = 1;
};

// "<spec> B=<batch> N=<tokens>", how tests name a drawn case.
inline std::string describe(const IhaCase& c) {
  return c.spec.ShortDebugString() + " B=" + std::to_string(c.batch) + " N=" + std::to_string(c.tokens);
}

// A checkable case (findCheckableCase, or findCheckableBackwardCase with
// `backward`) of a shape drawn by `drawShape()`: a spec that has none in its
// dtype (ill-conditioned there) is said and another drawn, at most 16.
template <class DrawShape>
IhaCase drawCheckableShape(std::mt19937_64& rng, bool backward, DrawShape drawShape) {
  constexpr int kMaxSpecs = 16;
  for (int attempt = 1;; ++attempt) {
    const DrawnShape shape = drawShape();
    const uint64_t seed = rng();
    std::optional<IhaCase> c = backward ? findCheckableBackwardCase(shape.spec, shape.batch, shape.tokens, seed)
                                        : findCheckableCase(shape.spec, shape.batch, shape.tokens, seed);
    if (c) return std::move(*c);
    std::printf("[ redrawn  ] %s B=%lld N=%lld: no draw the roundings of its dtype leave checkable, another spec\n",
                shape.spec.ShortDebugString().c_str(), (long long)shape.batch, (long long)shape.tokens);
    if (attempt == kMaxSpecs) {
      ADD_FAILURE() << kMaxSpecs << " drawn specs in a row without a checkable case";
      return backward ? drawCheckableBackwardCase(shape.spec, shape.batch, shape.tokens, seed)
                      : drawCheckableCase(shape.spec, shape.batch, shape.tokens, seed);
    }
  }
}

// (query block, key block) pairs of one (batch entry, head) holding any
// allowed pair among the real rows of the query block, and of those the ones
// not wholly allowed and in bounds (they need an element-wise mask), counted
// by brute force with the reference's own mask. Query blocks of blockM rows
// start every rowStep rows; with `wholeQueryBlocks` a query block cut at the
// end needs the mask too (the backward's key-block-outer loop, whose rows
// past the end hold no data).
inline std::pair<int64_t, int64_t> bruteForcePairs(const KernelSpec& spec, int64_t rowStep, int64_t blockM,
                                                   int64_t blockN, int64_t tokens, bool wholeQueryBlocks) {
  const int64_t L = tokens * spec.pseudo_heads();
  int64_t visited = 0, masked = 0;
  for (int64_t r0 = 0; r0 < L; r0 += rowStep)
    for (int64_t c0 = 0; c0 < L; c0 += blockN) {
      bool any = false, all = c0 + blockN <= L && (!wholeQueryBlocks || r0 + blockM <= L);
      for (int64_t i = r0; i < std::min(r0 + blockM, L); ++i)
        for (int64_t j = c0; j < std::min(c0 + blockN, L); ++j) {
          const bool ok = reference::allowed(spec, i, j);
          any |= ok;
          all &= ok;
        }
      visited += any;
      masked += any && !all;
    }
  return {visited, masked};
}

// The forward's attention: a query block computes blockM rows from r0 and
// owns the whole tokens among them, so the next starts there.
inline std::pair<int64_t, int64_t> bruteForceBlocks(const KernelSpec& spec, int64_t blockM, int64_t blockN,
                                                    int64_t tokens) {
  const int64_t owned = blockM / spec.pseudo_heads() * spec.pseudo_heads();
  return bruteForcePairs(spec, owned, blockM, blockN, tokens, false);
}

struct CommandResult {
  int exitCode = -1;
  std::string output;  // stdout and stderr together
};

inline CommandResult runCommand(const std::string& command) {
  const std::string log = std::filesystem::temp_directory_path() / ("loom-cmd-" + std::to_string(::getpid()) + ".log");
  const int status = std::system((command + " > " + log + " 2>&1").c_str());
  CommandResult result;
  result.exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  result.output = text.str();
  std::filesystem::remove(log);
  return result;
}

inline CommandResult runLoom(const std::string& args) { return runCommand(std::string(LOOM_BINARY) + " " + args); }

// A scratch folder removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "loom-test-XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

//===--- the backward ----------------------------------------------------===//

// dout ~ N(0, 1), rounded to the spec's dtype as the kernel reads it.
inline std::vector<double> drawDout(const IhaCase& c, std::mt19937_64& rng) {
  return loom::drawDout(c.spec, c.batch, c.tokens, rng());
}

// drawDout for a fixed case (a shared one), drawn again while what a kernel
// rounds in the dtype alone (reference::ihaBackwardWithRoundedMixing: for
// float32 every partial sum, dcollapse's too) or its float32 arithmetic
// (backwardCheckShare) costs a gradient over checkableBackwardShare of its
// tolerance, as drawCheckableBackwardCase does for drawn cases; at most 16
// draws, the one they hurt least.
inline std::vector<double> drawCheckableDout(const IhaCase& c, std::mt19937_64& rng) {
  std::vector<double> best;
  double bestShare = std::numeric_limits<double>::infinity();
  for (int tries = 0; tries < 16; ++tries) {
    std::vector<double> dout = drawDout(c, rng);
    const double share = backwardCheckShare(c.spec, c.inputs, dout, reference::ihaBackward(c.spec, c.inputs, dout));
    if (share <= checkableBackwardShare(c.spec.dtype())) return dout;
    if (share < bestShare) {
      bestShare = share;
      best = std::move(dout);
    }
  }
  return best;
}

}  // namespace loom::testing
