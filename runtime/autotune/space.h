// The schedule space of a spec on a target: every combination of the
// compiler's knobs, pruned by the compiler's own rules and the device's
// limits before anything is compiled. Never empty while any schedule fits
// the device: the default, or else the smallest footprint, remains.
#pragma once

#include <string>
#include <vector>

#include "loom/spec.h"

namespace loom::autotune {

// Registers a candidate's threads may take (estimatedRegisters) before it is
// pruned as likely to spill: the hardware's 255 on the mma engine; on the
// wgmma engine what setmaxnreg leaves a consumer thread.
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

// The backward's space (docs/compiler.md, The backward): warps in {1, 2, 4},
// key blocks of 16 or 32 rows per warp, query blocks any multiple of 16
// rows per warp holding a token (up to 128), mixing materialised, the
// collapse separate, dq in its own launch or by atomic adds in the
// key-block-outer one; what the compiler refuses is
// pruned with its reason (head_dim over 128, shared memory).
SearchSpace backwardSearchSpace(const KernelSpec& spec, const v1::Target& target);

// A decode step's space (docs/compiler.md, The decode step) over a raw or a
// mixed cache: warps in {1, 2, 4}, key blocks of 16, 32 or 64 rows, one or
// two stages, the key blocks split over 1 to 32 CTAs (the collapse then
// separate); mixing as the cache needs it, the mma engine. What the
// compiler refuses (shared memory of the raw stages) is pruned with its
// reason.
SearchSpace decodeSearchSpace(const KernelSpec& spec, const v1::Target& target, bool mixedCache);

}  // namespace loom::autotune
