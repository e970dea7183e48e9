// What the emulator finds wrong in device code, each with where it happened:
// the CTA, the CUDA thread, the instruction and, where the program carries
// debug information, the source line (resolved with addr2line from the call
// site's program counter).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace loom::emu {

enum class FindingKind {
  race,             // shared-memory accesses of two threads, one a write, not ordered by a barrier
  outOfBounds,      // a global access outside every launch buffer, a shared one outside the plan's
  uninitialized,    // a read of shared memory no one wrote
  misaligned,       // an access not aligned to its size (or an instruction's alignment rule)
  asyncAccess,      // cp.async / TMA / wgmma operands or results touched before their wait
  proxyFence,       // generic writes read by the async proxy without fence.proxy.async
  mbarrier,         // mbarrier misuse: uninitialised, over-arrived, a phase that cannot complete
  barrier,          // bar.sync misuse: divergence inside a warp, a thread count that changes
  divergence,       // a warp / warpgroup collective reached by only some of its threads, or with other operands
  deadlock,         // every live thread waits and nothing in flight can wake one
  invalidOperand,   // operands the ISA rules out (sizes, counts, descriptors, tensor maps)
  readOnly,         // a store into an input tensor
};

const char* kindName(FindingKind kind);

struct Finding {
  FindingKind kind = FindingKind::race;
  std::string message;      // what happened, with both sides for a race
  std::string instruction;  // "st.shared.b128", "ldmatrix.x4", "mbarrier.try_wait.parity", ...
  uint32_t cta[3] = {0, 0, 0};
  int thread = -1;          // CUDA thread index in the CTA; -1: the CTA as a whole
  const void* pc = nullptr;  // call site in the program
  std::string where;        // "cuda.h:312 (loom::cuda::issueKv<...>)", filled by symbolize()
  // The other side of a race: its thread (-1: none) and call site.
  int otherThread = -1;
  const void* otherPc = nullptr;
  std::string otherWhere;
};

// Findings of one run, shared by every CTA. The same (kind, call site) is
// kept once with a count, so one bug does not flood the report.
class FindingLog {
 public:
  explicit FindingLog(int limit = 50) : limit_(limit) {}
  void add(Finding finding);
  std::vector<Finding> findings() const;
  int64_t total() const;  // with repeats
  bool empty() const { return total() == 0; }
  // Fills `where` of every finding from its pc.
  void symbolize();

 private:
  mutable std::mutex mutex_;
  int limit_;
  std::vector<Finding> findings_;
  std::map<std::pair<int, const void*>, int64_t> repeats_;
  int64_t total_ = 0;
};

// "file:line (function)" of a program counter in a loaded object, or "".
std::string sourceLine(const void* pc);

// One line per finding: "race in CTA (0,1,0) thread 37 at cuda.h:312: ...".
std::string format(const Finding& finding);

}  // namespace loom::emu
