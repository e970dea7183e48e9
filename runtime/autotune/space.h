// The schedule space of a spec on a target: every combination of the
// compiler's knobs, pruned by the compiler's own rules and the device's
// limits before anything is compiled. Never empty while any schedule fits
// the device: the default, or else the smallest footprint, remains.
#pragma once

#include <string>
#include <vector>

#include "loom/spec.h"

namespace loom::autotune {

// Per-thread registers the score, output and Q fragments may take before a
// candidate is pruned as certain to spill (255 is the hardware's cap; the
// rest of the kernel needs some too).
inline constexpr int64_t kFragmentRegisterLimit = 192;

// Registers a candidate's fragments may take before it is certain to spill:
// kFragmentRegisterLimit on the mma engine; on the wgmma engine what
// setmaxnreg leaves a consumer thread, less addresses and loop state.
int64_t registerLimit(const Schedule& schedule);

struct Candidate {
  Schedule schedule;  // complete: every field set
  std::string key;    // "bm64.bn64.w4.s2.fused.epilogue"
};

struct Pruned {
  Schedule schedule;
  std::string key;
  std::string reason;
};

struct SearchSpace {
  std::vector<Candidate> candidates;  // in a stable order
  std::vector<Pruned> pruned;
};

std::string scheduleKey(const Schedule& schedule);

SearchSpace searchSpace(const KernelSpec& spec, const v1::Target& target);

}  // namespace loom::autotune
