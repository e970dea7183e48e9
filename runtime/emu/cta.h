// One CTA of the emulator: every CUDA thread runs the unchanged device code
// on a fiber of its own (boost::context), so divergence, named barriers and
// warp specialisation run as written; a thread gives up the OS thread only
// when it must wait (a barrier, a collective the rest of its warp has not
// reached, an mbarrier phase, registers). The CTA also owns what the
// instructions act on: shared memory and its shadow, the vector clocks that
// order threads (FastTrack-style happens-before: barriers and mbarrier
// phases join clocks), mbarriers, and the asynchronous operations in flight
// (cp.async groups, TMA copies, wgmma groups), which land at seeded arbitrary
// moments between their issue and the wait that covers them.
//
// Internal to runtime/emu: instructions.cpp implements the PTX ISA on top.
#pragma once

#include <boost/context/fiber.hpp>

#include <array>
#include <bitset>
#include <cstdint>
#include <list>
#include <deque>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "emu/findings.h"
#include "emu/memory.h"
#include "loom/tile/emu_abi.h"

namespace loom::emu {

constexpr int kWarpSize = 32;
constexpr int kWarpgroupSize = 128;
constexpr int kRegisterFile = 65536;
constexpr int kNamedBarriers = 16;
constexpr int kTensorCopyTag = 1 << 24;  // SharedShadow::asyncOp of a TMA copy: tag + its index

// Counts of what was emulated, summed over CTAs.
struct Coverage {
  int64_t ctas = 0;
  int64_t threads = 0;
  int64_t instructions = 0;  // emulated PTX instructions (every leaf of loom/tile/ptx.h and the built-ins)
  int64_t sharedAccesses = 0, globalAccesses = 0;
  int64_t ldmatrix = 0, mma = 0, shfl = 0, barriers = 0, cpAsync = 0, mbarrier = 0, tma = 0, wgmma = 0, bulk = 0;
  void add(const Coverage& other);
};

struct CtaConfig {
  int threads = 32;
  int64_t sharedBytes = 0;
  uint32_t sharedWindowBase = 0;  // shared address of the dynamic shared memory's first byte
  Dim3 blockIdx{0, 0, 0};
  Dim3 gridDim{1, 1, 1};
  // Registers each thread holds at launch (what ptxas allocated); 0: the
  // largest multiple of 8 up to 240 that the CTA's share of the 64K file
  // allows, which is what ptxas gives loom's warp-specialised kernels.
  int registersPerThread = 0;
  // The CTAs an SM the launch is bounded for: setmaxnreg moves registers
  // within 64K / ctasPerSm.
  int ctasPerSm = 1;
  uint64_t seed = 1;
  GlobalMemory* global = nullptr;  // null: no global buffers are checked
  FindingLog* findings = nullptr;
  void (*setThread)(const ThreadInfo*) = nullptr;  // the program's loom_emu_set_thread
  size_t stackBytes = 256 * 1024;
};

struct Thread {
  enum class State { runnable, blocked, finished };
  int index = 0, lane = 0, warp = 0, warpgroup = 0;
  ThreadInfo info{};
  boost::context::fiber fiber;  // resumes this thread
  boost::context::fiber back;   // while it runs: returns to the scheduler
  State state = State::runnable;
  std::string waitingFor;
  const void* waitPc = nullptr;
  std::vector<Clock> clock;        // vector clock over threads and the TMA agent
  std::vector<Clock> proxyFences;  // own epochs at fence.proxy.async
  // cp.async: copies not yet committed, then groups oldest first.
  std::vector<int> uncommittedCopies;
  std::deque<std::vector<int>> copyGroups;
  // wgmma: operations not yet committed, then groups oldest first.
  std::vector<int> uncommittedMmas;
  std::deque<std::vector<int>> mmaGroups;
  // cp.reduce.async.bulk: operations not yet committed, then bulk groups oldest first.
  std::vector<int> uncommittedBulk;
  std::deque<std::vector<int>> bulkGroups;
  // Register state a wgmma in flight owns: accumulators (results pending)
  // and A operands (being read).
  struct PendingAccumulator {
    std::vector<float> value;  // what the in-flight operations leave
    int inFlight = 0;
  };
  std::map<float*, PendingAccumulator> accumulators;
  struct RegisterRange {
    uintptr_t begin, end;
    bool results;  // true: accumulators (no access); false: A operand (no write)
  };
  std::vector<RegisterRange> pendingRegisters;
  // wgmma.fence: register arrays a wgmma used, touched since the last fence?
  std::vector<std::pair<uintptr_t, uintptr_t>> wgmmaRegisters;
  bool touchedSinceFence = false;
  bool fenced = false;
  int registers = 0;
};

class Cta {
 public:
  explicit Cta(const CtaConfig& config);
  ~Cta();
  Cta(const Cta&) = delete;
  Cta& operator=(const Cta&) = delete;

  // Runs `body` as every thread of the CTA until each returns or the CTA
  // deadlocks (a finding; its threads are then unwound).
  void run(const std::function<void()>& body);
  bool deadlocked() const { return deadlocked_; }
  const Coverage& coverage() const { return coverage_; }

  // The CTA and thread running on this OS thread (null outside run()).
  static Cta* current();
  Thread& self();
  bool running() const;  // a thread of this CTA runs on this OS thread now
  Thread& thread(int index) { return threads_[size_t(index)]; }
  int threadCount() const { return int(threads_.size()); }
  const CtaConfig& config() const { return config_; }

  //===--- for the instructions (instructions.cpp) -------------------------===//

  // `thread` -2: the running thread; -1: the CTA as a whole. A race names
  // its other side (thread, call site).
  void report(FindingKind kind, const std::string& instruction, const void* pc, const std::string& message,
              int thread = -2, int otherThread = -1, const void* otherPc = nullptr);

  // Blocks the running thread until wake() (from another thread or an
  // asynchronous completion).
  void block(const std::string& what, const void* pc);
  void wake(Thread& thread);

  // A collective of a warp (scope = kWarpSize) or warpgroup (kWarpgroupSize):
  // the calling thread deposits `payload` and waits until every member of
  // `members` (positions of the scope's threads) has arrived at the same
  // `kind`; the last to arrive runs `execute` over all payloads (indexed by
  // position in the scope, null for non-members). False when the
  // collective could not form (a finding has been reported).
  using Members = std::bitset<kWarpgroupSize>;
  bool collective(int scope, const char* kind, const Members& members, void* payload, const void* pc,
                  const std::function<void(std::vector<void*>&, std::vector<Thread*>&)>& execute);
  // Every thread of the caller's warpgroup (that exists).
  Members warpgroupMembers();

  // bar.sync id, count (count 0: every thread of the CTA); `wait` false:
  // bar.arrive, which counts toward the barrier and goes on (a release: the
  // threads that wait there see the arriving thread's earlier accesses).
  void barrier(int id, int count, const void* pc, bool wait = true);

  // Happens-before: `into` takes every epoch of `from` it lacks.
  static void join(std::vector<Clock>& into, const std::vector<Clock>& from);
  int agent() const { return threadCount(); }  // the TMA unit's index in vector clocks
  std::vector<Clock>& agentClock() { return agentClock_; }

  //===--- shared memory -----------------------------------------------------===//

  unsigned char* shared() { return shared_; }
  int64_t sharedBytes() const { return config_.sharedBytes; }
  uint32_t sharedWindowBase() const { return config_.sharedWindowBase; }
  // Offset of a shared address / pointer in the dynamic shared memory, or
  // nullopt (reported) when [.., + bytes) leaves it.
  std::optional<int64_t> sharedOffset(uint32_t address, int64_t bytes, const char* instruction, const void* pc);
  std::optional<int64_t> sharedOffset(const void* pointer, int64_t bytes, const char* instruction, const void* pc);
  uint32_t sharedAddressOf(const void* pointer) const;

  // Checked accesses by `actor` (a thread, or the TMA agent) with vector
  // clock `clock`: races, uninitialised reads, async ownership.
  enum class Access { read, write, atomic };
  void checkShared(int actor, const std::vector<Clock>& clock, int64_t offset, int64_t bytes, Access access,
                   const char* instruction, const void* pc);
  // Records a write without checking it (an async copy completing: its
  // write was checked when it was issued).
  void recordWrite(int actor, Clock clock, int64_t offset, int64_t bytes, const void* pc);
  // A read by the async proxy (wgmma operands): generic writes must have been
  // fenced (fence.proxy.async) by their writer before `clock` saw them.
  void checkAsyncProxyRead(int actor, const std::vector<Clock>& clock, int64_t offset, int64_t bytes,
                           const char* instruction, const void* pc);
  SharedShadow& shadow() { return shadow_; }

  //===--- device code's own loads and stores (the coverage hooks) ------------===//

  void access(const void* address, uint32_t size, bool write, const void* pc);
  // A global access: false (reported) when it touches a red zone, is
  // misaligned or stores into an input, or, `mustBeInABuffer` (an atomic),
  // lies in none of the launch's buffers; true when it may proceed.
  bool checkGlobal(const void* address, uint32_t size, bool write, const char* instruction, const void* pc,
                   bool mustBeInABuffer = true);

  //===--- asynchronous operations in flight ----------------------------------===//

  struct Copy {  // cp.async
    int thread = 0;
    int64_t destination = 0;  // shared offset
    const unsigned char* source = nullptr;
    int bytes = 0, sourceBytes = 0;
    bool landed = false, done = false;
    const void* pc = nullptr;
  };
  struct TensorCopy {  // cp.async.bulk.tensor
    int thread = 0;
    int64_t destination = 0;
    std::vector<unsigned char> data;  // the box as it lands (global read at landing)
    std::function<void(std::vector<unsigned char>&)> read;
    std::vector<Clock> clock;  // the agent's clock for this copy
    uint32_t barrier = 0;
    bool landed = false;
    const void* pc = nullptr;
  };
  struct Mma {  // wgmma.mma_async of one warpgroup
    int warpgroup = 0;
    std::vector<std::pair<int64_t, int64_t>> operands;  // shared ranges it reads
    std::vector<float*> accumulators;                   // by position in the warpgroup
    std::vector<const uint32_t*> registerOperands;      // by position (A from registers), or empty
    bool retired = false;
  };
  struct BulkRead {  // cp.reduce.async.bulk: the async proxy reading shared memory
    int thread = 0;
    int64_t source = 0, bytes = 0;  // shared offset and size
    bool retired = false;
    const void* pc = nullptr;
  };
  std::vector<Copy> copies;
  std::vector<TensorCopy> tensorCopies;
  std::vector<Mma> mmas;
  std::vector<BulkRead> bulkReads;
  void landCopy(int id);
  void completeCopy(Thread& thread, int id);
  void landTensorCopy(int id);
  void retireMma(int id);
  // The bulk read `id` done (cp.async.bulk.wait_group{.read} of `waiter`):
  // its bytes are free to write once the waiter's wait is ordered first.
  void retireBulkRead(Thread& waiter, int id);
  // Lands one pending copy at random now and then (the seeded arbitrary
  // moment); called by every instruction.
  void maybeLand();

  //===--- mbarriers ------------------------------------------------------------===//

  struct Mbarrier {
    bool initialized = false;
    uint32_t expected = 0;
    int64_t pending = 0;
    int64_t tx = 0;
    uint32_t phase = 0;
    std::vector<Clock> phaseClock;             // joined by arrivals and completed copies
    std::array<std::vector<Clock>, 2> done;    // clocks of the last completed phase of each parity
    std::vector<std::pair<int, int>> waiters;  // thread, parity
  };
  std::map<int64_t, Mbarrier> mbarriers;  // by shared offset
  void completeTransactions(int64_t offset, int64_t bytes, const std::vector<Clock>& clock, const void* pc);
  void checkPhase(int64_t offset, const void* pc);

  //===--- registers (setmaxnreg) -----------------------------------------------===//

  int freeRegisters = 0;  // registers of the 64K file no warpgroup holds
  std::vector<int> registerWaiters;  // threads whose setmaxnreg.inc waits for them

  Coverage coverage_;
  std::mt19937_64 random;

 private:
  void schedule();
  void reportDeadlock();
  bool landAny();

  CtaConfig config_;
  std::vector<Thread> threads_;
  std::deque<int> runQueue_;
  bool deadlocked_ = false;
  std::vector<unsigned char> sharedStorage_;
  unsigned char* shared_ = nullptr;
  SharedShadow shadow_;
  std::vector<Clock> agentClock_;
  struct Rendezvous {
    const char* kind;
    Members members;
    int arrived = 0, expected = 0;
    std::vector<void*> payload;
    std::vector<int> waiting;
    const void* pc;
    bool done = false;
  };
  std::vector<std::list<Rendezvous>> warpRendezvous_, warpgroupRendezvous_;
  struct Barrier {
    int expected = 0;
    std::vector<int> arrived;        // every thread counted, waiting or not
    std::vector<int> waiting;        // those of them at bar.sync
    std::vector<Clock> arrivals;     // the clocks bar.arrive's threads released
    const void* pc = nullptr;
  };
  std::array<Barrier, kNamedBarriers> barriers_;
};

}  // namespace loom::emu
