#include "emu/cta.h"

#include <boost/context/protected_fixedsize_stack.hpp>

#if defined(__SANITIZE_ADDRESS__)
#define LOOM_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOOM_EMU_ASAN 1
#endif
#endif
#ifdef LOOM_EMU_ASAN
#include <sanitizer/asan_interface.h>
#endif

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace loom::emu {
namespace {

thread_local Cta* gCta = nullptr;
thread_local Thread* gThread = nullptr;

constexpr size_t kSharedRedZone = 64 * 1024;
constexpr unsigned char kSharedGarbage = 0xcd;  // what shared memory holds before anyone writes it
constexpr int kDefaultRegisters = 240;

// The fiber stacks of the CTAs a worker thread runs, kept for its next CTA.
// Mapping a guarded stack for every emulated thread and unmapping it when
// its CTA ends made munmap (and the TLB shootdowns it sends to the other
// workers) the emulator's largest cost: about 40% of a decode test whose
// split grid holds hundreds of CTAs. Each stack keeps its guard page.
class StackPool {
 public:
  ~StackPool() { clear(); }
  boost::context::stack_context allocate(size_t bytes) {
    if (bytes != bytes_) {
      clear();
      bytes_ = bytes;
    }
    if (free_.empty()) {
      boost::context::stack_context stack = boost::context::protected_fixedsize_stack(bytes).allocate();
      mapped_ = stack.size;  // the bytes asked for, in pages, and the guard page
      return stack;
    }
    boost::context::stack_context stack = free_.back();
    free_.pop_back();
    return stack;
  }
  void release(boost::context::stack_context& stack) {
#ifdef LOOM_EMU_ASAN
    // A fiber's frames end without returning: their redzones stay poisoned.
    ASAN_UNPOISON_MEMORY_REGION(static_cast<char*>(stack.sp) - stack.size, stack.size);
#endif
    if (stack.size != mapped_ || free_.size() >= kKept) {
      boost::context::protected_fixedsize_stack().deallocate(stack);
      return;
    }
    free_.push_back(stack);
  }

 private:
  static constexpr size_t kKept = 1024;  // a CTA's most threads
  void clear() {
    for (boost::context::stack_context& stack : free_) boost::context::protected_fixedsize_stack().deallocate(stack);
    free_.clear();
  }
  size_t bytes_ = 0, mapped_ = 0;
  std::vector<boost::context::stack_context> free_;
};

thread_local StackPool gStacks;

// boost::context's StackAllocator over this thread's pool. A fiber gives its
// stack back where it is destroyed: on the worker that ran its CTA.
struct PooledStack {
  size_t bytes;
  boost::context::stack_context allocate() { return gStacks.allocate(bytes); }
  void deallocate(boost::context::stack_context& stack) { gStacks.release(stack); }
};

std::string hex(int64_t value) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(value));
  return text;
}

// The instruction an ordinary access of `size` bytes is, as findings name it.
const char* accessName(bool shared, bool write, uint32_t size) {
  static constexpr const char* kNames[2][2][5] = {
      {{"ld.global.b8", "ld.global.b16", "ld.global.b32", "ld.global.b64", "ld.global.b128"},
       {"st.global.b8", "st.global.b16", "st.global.b32", "st.global.b64", "st.global.b128"}},
      {{"ld.shared.b8", "ld.shared.b16", "ld.shared.b32", "ld.shared.b64", "ld.shared.b128"},
       {"st.shared.b8", "st.shared.b16", "st.shared.b32", "st.shared.b64", "st.shared.b128"}}};
  const int width = size == 1 ? 0 : size == 2 ? 1 : size == 4 ? 2 : size == 8 ? 3 : 4;
  return kNames[shared][write][width];
}

}  // namespace

void Coverage::add(const Coverage& o) {
  ctas += o.ctas;
  threads += o.threads;
  instructions += o.instructions;
  sharedAccesses += o.sharedAccesses;
  globalAccesses += o.globalAccesses;
  ldmatrix += o.ldmatrix;
  mma += o.mma;
  shfl += o.shfl;
  barriers += o.barriers;
  cpAsync += o.cpAsync;
  bulk += o.bulk;
  mbarrier += o.mbarrier;
  tma += o.tma;
  wgmma += o.wgmma;
}

Cta::Cta(const CtaConfig& config) : random(config.seed), config_(config) {
  const int T = config.threads;
  threads_.resize(size_t(T));
  int registers = config.registersPerThread;
  const int file = kRegisterFile / std::max(config.ctasPerSm, 1);
  if (registers <= 0) registers = std::min(kDefaultRegisters, file / std::max(T, 1) / 8 * 8);
  for (int i = 0; i < T; ++i) {
    Thread& t = threads_[size_t(i)];
    t.index = i;
    t.lane = i % kWarpSize;
    t.warp = i / kWarpSize;
    t.warpgroup = i / kWarpgroupSize;
    t.info.threadIdx = {unsigned(i), 0, 0};
    t.info.blockIdx = config.blockIdx;
    t.info.blockDim = {unsigned(T), 1, 1};
    t.info.gridDim = config.gridDim;
    t.clock.assign(size_t(T) + 1, 0);
    t.clock[size_t(i)] = 1;
    t.registers = registers;
  }
  agentClock_.assign(size_t(T) + 1, 0);
  agentClock_[size_t(T)] = 1;
  freeRegisters = file - T * registers;
  sharedStorage_.assign(size_t(config.sharedBytes) + 2 * kSharedRedZone, kSharedGarbage);
  shared_ = sharedStorage_.data() + kSharedRedZone;
  shadow_.reset(size_t(config.sharedBytes));
  warpRendezvous_.resize(size_t((T + kWarpSize - 1) / kWarpSize));
  warpgroupRendezvous_.resize(size_t((T + kWarpgroupSize - 1) / kWarpgroupSize));
  coverage_.ctas = 1;
  coverage_.threads = T;
  if (freeRegisters < 0)
    report(FindingKind::invalidOperand, "launch", nullptr,
           std::to_string(T) + " threads of " + std::to_string(registers) + " registers exceed the 64K register file",
           -1);
}

Cta::~Cta() = default;

Cta* Cta::current() { return gCta; }
bool Cta::running() const { return gThread != nullptr; }
Thread& Cta::self() { return *gThread; }

void Cta::report(FindingKind kind, const std::string& instruction, const void* pc, const std::string& message,
                 int thread, int otherThread, const void* otherPc) {
  if (!config_.findings) return;
  Finding finding;
  finding.kind = kind;
  finding.instruction = instruction;
  finding.message = message;
  finding.pc = pc;
  finding.cta[0] = config_.blockIdx.x;
  finding.cta[1] = config_.blockIdx.y;
  finding.cta[2] = config_.blockIdx.z;
  finding.thread = thread == -2 ? (gThread ? gThread->index : -1) : thread;
  finding.otherThread = otherThread;
  finding.otherPc = otherPc;
  config_.findings->add(std::move(finding));
}

//===--- fibers and the scheduler -----------------------------------------===//

void Cta::run(const std::function<void()>& body) {
  Cta* outer = gCta;
  gCta = this;
  PooledStack stacks{config_.stackBytes};
  for (Thread& t : threads_) {
    t.fiber = boost::context::fiber(std::allocator_arg, stacks, [&body, &t](boost::context::fiber&& back) {
      t.back = std::move(back);
      body();
      t.state = Thread::State::finished;
      return std::move(t.back);
    });
    runQueue_.push_back(t.index);
  }
  schedule();
  // A deadlocked CTA's threads are unwound: destroying a suspended fiber
  // throws boost's forced_unwind through its frames.
  for (Thread& t : threads_) {
    gThread = &t;
    t.fiber = boost::context::fiber();
  }
  gThread = nullptr;
  gCta = outer;
}

void Cta::schedule() {
  while (true) {
    while (!runQueue_.empty()) {
      const int index = runQueue_.front();
      runQueue_.pop_front();
      Thread& t = threads_[size_t(index)];
      if (t.state != Thread::State::runnable) continue;
      gThread = &t;
      if (config_.setThread) config_.setThread(&t.info);
      t.fiber = std::move(t.fiber).resume();
      gThread = nullptr;
      if (config_.setThread) config_.setThread(nullptr);
    }
    const bool finished = std::all_of(threads_.begin(), threads_.end(),
                                      [](const Thread& t) { return t.state == Thread::State::finished; });
    if (finished) {
      // The CTA's shared memory goes with it: a copy still writing into it
      // was never waited for (its data unused, or a later CTA's clobbered).
      for (const Copy& c : copies)
        if (!c.done) {
          report(FindingKind::asyncAccess, "exit", c.pc,
                 "the CTA ends with a cp.async into its shared memory never waited for", -1);
          break;
        }
      for (const TensorCopy& c : tensorCopies)
        if (!c.landed) {
          report(FindingKind::asyncAccess, "exit", c.pc,
                 "the CTA ends with a TMA copy into its shared memory in flight", -1);
          break;
        }
      for (const BulkRead& r : bulkReads)
        if (!r.retired) {
          report(FindingKind::asyncAccess, "exit", r.pc,
                 "the CTA ends with a bulk reduction still reading its shared memory (no "
                 "cp.async.bulk.wait_group.read covers it)",
                 -1);
          break;
        }
      return;
    }
    if (landAny() && !runQueue_.empty()) continue;
    deadlocked_ = true;
    reportDeadlock();
    return;
  }
}

void Cta::block(const std::string& what, const void* pc) {
  Thread& t = self();
  t.state = Thread::State::blocked;
  t.waitingFor = what;
  t.waitPc = pc;
  t.back = std::move(t.back).resume();
  t.waitingFor.clear();
  t.waitPc = nullptr;
}

void Cta::wake(Thread& t) {
  if (t.state != Thread::State::blocked) return;
  t.state = Thread::State::runnable;
  runQueue_.push_back(t.index);
}

void Cta::reportDeadlock() {
  std::ostringstream text;
  text << "every live thread waits and nothing in flight can wake one:";
  std::map<std::pair<std::string, const void*>, std::vector<int>> groups;
  int finished = 0;
  for (const Thread& t : threads_) {
    if (t.state == Thread::State::finished) ++finished;
    else groups[{t.waitingFor, t.waitPc}].push_back(t.index);
  }
  const void* firstPc = nullptr;
  for (const auto& [where, members] : groups) {
    text << " " << members.size() << " thread(s) (" << members.front() << ".." << members.back() << ") in "
         << where.first;
    const std::string line = where.second ? sourceLine(where.second) : "";
    if (!line.empty()) text << " at " << line;
    text << ";";
    if (!firstPc) firstPc = where.second;
  }
  if (finished) text << " " << finished << " thread(s) have exited;";
  for (const auto& [offset, m] : mbarriers)
    if (m.initialized && (m.pending != m.expected || m.tx != 0 || !m.waiters.empty()))
      text << " mbarrier at shared " << hex(config_.sharedWindowBase + offset) << ": phase " << m.phase << ", "
           << m.pending << " of " << m.expected << " arrivals pending, transaction count " << m.tx << ";";
  for (int id = 0; id < kNamedBarriers; ++id)
    if (!barriers_[size_t(id)].arrived.empty())
      text << " bar.sync " << id << ": " << barriers_[size_t(id)].arrived.size() << " of "
           << barriers_[size_t(id)].expected << " threads arrived;";
  report(FindingKind::deadlock, "", firstPc, text.str(), -1);
}

//===--- collectives and barriers -----------------------------------------===//

Cta::Members Cta::warpgroupMembers() {
  Members members;
  const int base = self().warpgroup * kWarpgroupSize;
  for (int p = 0; p < kWarpgroupSize && base + p < threadCount(); ++p) members.set(size_t(p));
  return members;
}

bool Cta::collective(int scope, const char* kind, const Members& members, void* payload, const void* pc,
                     const std::function<void(std::vector<void*>&, std::vector<Thread*>&)>& execute) {
  Thread& t = self();
  const int group = scope == kWarpSize ? t.warp : t.warpgroup;
  const int position = t.index - group * scope;
  auto& list = scope == kWarpSize ? warpRendezvous_[size_t(group)] : warpgroupRendezvous_[size_t(group)];
  const auto maskText = [&](const Members& m) {
    return scope == kWarpSize ? hex(int64_t(m.to_ullong() & 0xffffffffull)) : std::to_string(m.count()) + " threads";
  };
  if (!members.test(size_t(position))) {
    report(FindingKind::divergence, kind, pc, "executed by a thread outside its member mask " + maskText(members));
    return false;
  }
  Rendezvous* r = nullptr;
  for (Rendezvous& candidate : list)
    if (!candidate.done && candidate.members.test(size_t(position))) {
      r = &candidate;
      break;
    }
  if (r && (std::strcmp(r->kind, kind) != 0 || r->members != members)) {
    report(FindingKind::divergence, kind, pc,
           std::string("reached while other threads of its ") + (scope == kWarpSize ? "warp" : "warpgroup") +
               " wait at " + r->kind + " (members " + maskText(r->members) + " vs " + maskText(members) + ")");
    return false;
  }
  if (!r) {
    list.push_back(Rendezvous{kind, members, 0, int(members.count()), std::vector<void*>(size_t(scope), nullptr),
                              {}, pc, false});
    r = &list.back();
  }
  r->payload[size_t(position)] = payload;
  ++r->arrived;
  if (r->arrived < r->expected) {
    r->waiting.push_back(t.index);
    block(kind, pc);  // the last to arrive runs the collective, then wakes this thread
    return true;
  }
  std::vector<Thread*> participants(size_t(scope), nullptr);
  for (int p = 0; p < scope; ++p)
    if (members.test(size_t(p))) participants[size_t(p)] = &threads_[size_t(group * scope + p)];
  std::vector<void*> payloads = std::move(r->payload);
  const std::vector<int> waiting = std::move(r->waiting);
  r->done = true;
  list.remove_if([](const Rendezvous& x) { return x.done; });
  execute(payloads, participants);
  for (int w : waiting) wake(threads_[size_t(w)]);
  return true;
}

void Cta::barrier(int id, int count, const void* pc, bool wait) {
  ++coverage_.barriers;
  const int T = threadCount();
  if (id < 0 || id >= kNamedBarriers) {
    report(FindingKind::invalidOperand, "bar.sync", pc, "barrier " + std::to_string(id) + " does not exist (0..15)");
    return;
  }
  const int expected = count == 0 ? T : count;
  if (count != 0 && (count % kWarpSize != 0 || count > T)) {
    report(FindingKind::invalidOperand, "bar.sync", pc,
           "thread count " + std::to_string(count) + " is not a multiple of 32 up to the CTA's " + std::to_string(T));
    return;
  }
  Barrier& b = barriers_[size_t(id)];
  Thread& t = self();
  if (b.arrived.empty()) {
    b.expected = expected;
    b.pc = pc;
  } else if (b.expected != expected) {
    report(FindingKind::barrier, "bar.sync", pc,
           "barrier " + std::to_string(id) + " reached with " + std::to_string(expected) +
               " threads while others wait on it with " + std::to_string(b.expected));
  }
  b.arrived.push_back(t.index);
  if (wait) b.waiting.push_back(t.index);
  if (!wait) {  // bar.arrive: its accesses so far are released to the waiters
    b.arrivals.resize(size_t(T) + 1, 0);
    join(b.arrivals, t.clock);
    ++t.clock[size_t(t.index)];
  }
  if (int(b.arrived.size()) < b.expected) {
    if (wait) block("bar.sync " + std::to_string(id) + " (" + std::to_string(b.expected) + " threads)", pc);
    return;
  }
  // bar.sync is .aligned: a warp arrives whole or the code diverged.
  std::map<int, int> perWarp;
  for (int a : b.arrived) ++perWarp[a / kWarpSize];
  for (const auto& [warp, n] : perWarp)
    if (n != std::min(kWarpSize, T - warp * kWarpSize))
      report(FindingKind::barrier, "bar.sync", pc,
             "barrier " + std::to_string(id) + " completed with " + std::to_string(n) + " of warp " +
                 std::to_string(warp) + "'s threads: the warp diverged at an aligned barrier");
  // The waiting threads (not those that only arrived, which went on) leave
  // with everything every participant did before it reached the barrier.
  std::vector<Clock> joined(size_t(T) + 1, 0);
  join(joined, b.arrivals);
  const std::vector<int> waiting = std::move(b.waiting);
  for (int a : waiting) join(joined, threads_[size_t(a)].clock);
  b.arrived.clear();
  b.waiting.clear();
  b.arrivals.clear();
  for (int a : waiting) {
    threads_[size_t(a)].clock = joined;
    ++threads_[size_t(a)].clock[size_t(a)];
  }
  for (int a : waiting)
    if (a != t.index) wake(threads_[size_t(a)]);
}

void Cta::join(std::vector<Clock>& into, const std::vector<Clock>& from) {
  for (size_t i = 0; i < into.size() && i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

//===--- shared memory ----------------------------------------------------===//

uint32_t Cta::sharedAddressOf(const void* pointer) const {
  return uint32_t(int64_t(config_.sharedWindowBase) + (static_cast<const unsigned char*>(pointer) - shared_));
}

std::optional<int64_t> Cta::sharedOffset(uint32_t address, int64_t bytes, const char* instruction, const void* pc) {
  const int64_t offset = int64_t(address) - int64_t(config_.sharedWindowBase);
  if (offset < 0 || offset + bytes > config_.sharedBytes) {
    report(FindingKind::outOfBounds, instruction, pc,
           std::to_string(bytes) + " bytes at shared address " + hex(address) + " leave the " +
               std::to_string(config_.sharedBytes) + " bytes of dynamic shared memory [" +
               hex(config_.sharedWindowBase) + ", " + hex(config_.sharedWindowBase + config_.sharedBytes) + ")");
    return std::nullopt;
  }
  return offset;
}

std::optional<int64_t> Cta::sharedOffset(const void* pointer, int64_t bytes, const char* instruction,
                                         const void* pc) {
  return sharedOffset(sharedAddressOf(pointer), bytes, instruction, pc);
}

void Cta::checkShared(int actor, const std::vector<Clock>& clock, int64_t offset, int64_t bytes, Access access,
                      const char* instruction, const void* pc) {
  ++coverage_.sharedAccesses;
  SharedShadow& s = shadow_;
  const auto who = [&](int a) {
    return a == agent() ? std::string("the TMA unit") : "thread " + std::to_string(a);
  };
  bool reported = false;
  auto problem = [&](FindingKind kind, const std::string& message, int otherThread = -1,
                     const void* otherPc = nullptr) {
    if (reported) return;
    reported = true;
    report(kind, instruction, pc, message, actor == agent() ? -1 : actor, otherThread == agent() ? -1 : otherThread,
           otherPc);
  };
  // Spelled out only for a finding: this check runs on every shared access.
  const auto range = [&] {
    return "shared [" + hex(config_.sharedWindowBase + offset) + ", +" + std::to_string(bytes) + ")";
  };
  for (int64_t i = offset; i < offset + bytes; ++i) {
    const size_t b = size_t(i);
    const uint8_t flags = s.flags[b];
    if (flags & SharedShadow::kAsyncWrite) {
      const int op = s.asyncOp[b];
      const bool tensor = op >= kTensorCopyTag;
      const int owner = tensor ? tensorCopies[size_t(op - kTensorCopyTag)].thread : copies[size_t(op)].thread;
      const void* issued = tensor ? tensorCopies[size_t(op - kTensorCopyTag)].pc : copies[size_t(op)].pc;
      problem(FindingKind::asyncAccess,
              who(actor) + (access == Access::read ? " reads " : " writes ") + range() + " while the " +
                  (tensor ? "TMA copy" : "cp.async") + " thread " + std::to_string(owner) +
                  " issued into it is in flight (no " + (tensor ? "mbarrier wait" : "cp.async.wait_group") +
                  " covers it)",
              owner, issued);
    }
    if (s.asyncReads[b] && access != Access::read)
      problem(FindingKind::asyncAccess,
              who(actor) + " writes " + range() +
                  " while the async proxy still reads it (a wgmma before its wgmma.wait_group, or a bulk reduction "
                  "before its cp.async.bulk.wait_group.read)");
    if (access != Access::write && !(flags & SharedShadow::kWritten))
      problem(FindingKind::uninitialized, who(actor) + " reads " + range() + ", which no thread has written");
    const int writer = s.writer[b];
    if ((flags & SharedShadow::kWritten) && writer != actor && writer != SharedShadow::kNobody &&
        s.writeClock[b] > clock[size_t(writer)] &&
        !(access == Access::atomic && (flags & SharedShadow::kAtomicWrite)))
      problem(FindingKind::race,
              who(actor) + (access == Access::read ? " reads " : " writes ") + range() + " that " + who(writer) +
                  " wrote with no barrier or mbarrier ordering the two",
              writer, s.writePc[b]);
    if (access != Access::read) {
      for (int slot = 0; slot < SharedShadow::kReadSlots; ++slot) {
        const int reader = s.readActor[b * SharedShadow::kReadSlots + size_t(slot)];
        if (reader != SharedShadow::kNobody && reader != actor &&
            s.readClock[b * SharedShadow::kReadSlots + size_t(slot)] > clock[size_t(reader)])
          problem(FindingKind::race,
                  who(actor) + " writes " + range() + " that " + who(reader) +
                      " read with no barrier or mbarrier ordering the two",
                  reader);
      }
      s.writer[b] = uint16_t(actor);
      s.writeClock[b] = clock[size_t(actor)];
      s.writePc[b] = pc;
      uint8_t updated = uint8_t((flags | SharedShadow::kWritten) &
                                ~(SharedShadow::kAtomicWrite | SharedShadow::kAsyncProxyWrite));
      if (access == Access::atomic) updated |= SharedShadow::kAtomicWrite;
      s.flags[b] = updated;
      for (int slot = 0; slot < SharedShadow::kReadSlots; ++slot)
        s.readActor[b * SharedShadow::kReadSlots + size_t(slot)] = SharedShadow::kNobody;
    }
    if (access == Access::read) {
      // Keep this read; drop a read it is ordered after (FastTrack: a later
      // write racing with that one races with this one too).
      int free = -1;
      for (int slot = 0; slot < SharedShadow::kReadSlots; ++slot) {
        const size_t k = b * SharedShadow::kReadSlots + size_t(slot);
        const int reader = s.readActor[k];
        if (reader == actor || reader == SharedShadow::kNobody ||
            s.readClock[k] <= clock[size_t(reader)]) {
          free = slot;
          if (reader == actor) break;
        }
      }
      if (free < 0) free = int(b % SharedShadow::kReadSlots);
      s.readActor[b * SharedShadow::kReadSlots + size_t(free)] = uint16_t(actor);
      s.readClock[b * SharedShadow::kReadSlots + size_t(free)] = clock[size_t(actor)];
    }
  }
}

void Cta::checkAsyncProxyRead(int actor, const std::vector<Clock>& clock, int64_t offset, int64_t bytes,
                              const char* instruction, const void* pc) {
  for (int64_t i = offset; i < offset + bytes; ++i) {
    const size_t b = size_t(i);
    const uint8_t flags = shadow_.flags[b];
    if (!(flags & SharedShadow::kWritten) || (flags & SharedShadow::kAsyncProxyWrite)) continue;
    const int writer = shadow_.writer[b];
    if (writer == SharedShadow::kNobody || writer >= threadCount()) continue;
    const std::vector<Clock>& fences = threads_[size_t(writer)].proxyFences;
    const auto fence = std::lower_bound(fences.begin(), fences.end(), shadow_.writeClock[b]);
    if (fence != fences.end() && *fence <= clock[size_t(writer)]) continue;
    report(FindingKind::proxyFence, instruction, pc,
           "the async proxy reads shared [" + hex(config_.sharedWindowBase + i) + ", +" +
               std::to_string(offset + bytes - i) + ") that thread " + std::to_string(writer) +
               " wrote with generic stores and no fence.proxy.async between",
           actor < threadCount() ? actor : -1, writer, shadow_.writePc[b]);
    return;
  }
  checkShared(actor, clock, offset, bytes, Access::read, instruction, pc);
}

//===--- the device code's own loads and stores ---------------------------===//

void Cta::access(const void* address, uint32_t size, bool write, const void* pc) {
  Thread& t = self();
  const auto a = reinterpret_cast<uintptr_t>(address);
  const auto sharedLow = reinterpret_cast<uintptr_t>(sharedStorage_.data());
  if (a - sharedLow < sharedStorage_.size()) {
    const char* instruction = accessName(/*shared=*/true, write, size);
    if (a % size != 0)
      report(FindingKind::misaligned, instruction, pc,
             std::to_string(size) + "-byte access at shared address " + hex(sharedAddressOf(address)) +
                 ", not aligned to its size");
    const int64_t offset = static_cast<const unsigned char*>(address) - shared_;
    if (offset < 0 || offset + size > config_.sharedBytes) {
      report(FindingKind::outOfBounds, instruction, pc,
             std::to_string(size) + "-byte access at shared offset " + std::to_string(offset) + ", outside the " +
                 std::to_string(config_.sharedBytes) + " bytes of dynamic shared memory the launch has");
      return;
    }
    if (shadow_.flags[size_t(offset)] & SharedShadow::kMbarrier)
      report(FindingKind::mbarrier, instruction, pc, "an ordinary load or store touches an mbarrier object");
    checkShared(t.index, t.clock, offset, size, write ? Access::write : Access::read, instruction, pc);
    return;
  }
  if (config_.global && config_.global->mayContain(address)) {
    // Between the buffers lies other memory (a thread's stack, its
    // registers): that falls through to the registers' checks below.
    const GlobalMemory::Buffer* buffer = nullptr;
    if (config_.global->locate(address, size, &buffer) != GlobalMemory::Where::elsewhere) {
      checkGlobal(address, size, write, accessName(/*shared=*/false, write, size), pc, /*mustBeInABuffer=*/false);
      return;
    }
  }
  for (const Thread::RegisterRange& r : t.pendingRegisters)
    if (a < r.end && a + size > r.begin && (r.results || write)) {
      report(FindingKind::asyncAccess, write ? "st.local" : "ld.local", pc,
             r.results ? "accumulator registers of a wgmma in flight are accessed before the wgmma.wait_group that "
                         "retires it"
                       : "an A-operand register of a wgmma in flight is overwritten before the wgmma.wait_group that "
                         "retires it");
      break;
    }
  for (const auto& [begin, end] : t.wgmmaRegisters)
    if (a < end && a + size > begin) t.touchedSinceFence = true;
}

bool Cta::checkGlobal(const void* address, uint32_t size, bool write, const char* instruction,
                      const void* pc, bool mustBeInABuffer) {
  ++coverage_.globalAccesses;
  const auto a = reinterpret_cast<uintptr_t>(address);
  const GlobalMemory::Buffer* buffer = nullptr;
  const auto where = config_.global ? config_.global->locate(address, size, &buffer) : GlobalMemory::Where::elsewhere;
  if (where == GlobalMemory::Where::elsewhere) {
    if (!mustBeInABuffer) return true;
    report(FindingKind::outOfBounds, instruction, pc,
           std::to_string(size) + "-byte access at " + hex(int64_t(a)) + ", in none of the launch's buffers");
    return false;
  }
  if (where == GlobalMemory::Where::redZone) {
    const int64_t from = int64_t(a) - int64_t(reinterpret_cast<uintptr_t>(buffer->data));
    report(FindingKind::outOfBounds, instruction, pc,
           std::to_string(size) + "-byte " + (write ? "store" : "load") + " at byte " + std::to_string(from) +
               " of " + buffer->name + ", which has " + std::to_string(buffer->bytes) + " bytes");
    return false;
  }
  bool ok = true;
  if (a % size != 0) {
    report(FindingKind::misaligned, instruction, pc,
           std::to_string(size) + "-byte access into " + buffer->name + " not aligned to its size");
    ok = false;
  }
  if (write && buffer->readOnly) {
    report(FindingKind::readOnly, instruction, pc, "a store into the input " + buffer->name);
    ok = false;
  }
  return ok;
}

//===--- asynchronous operations ------------------------------------------===//

void Cta::landCopy(int id) {
  Copy& c = copies[size_t(id)];
  if (c.landed) return;
  unsigned char* destination = shared_ + c.destination;
  if (c.sourceBytes > 0) std::memcpy(destination, c.source, size_t(c.sourceBytes));
  std::memset(destination + c.sourceBytes, 0, size_t(c.bytes - c.sourceBytes));
  c.landed = true;
}

void Cta::completeCopy(Thread& t, int id) {
  Copy& c = copies[size_t(id)];
  if (c.done) return;
  landCopy(id);
  for (int64_t i = c.destination; i < c.destination + c.bytes; ++i)
    if (shadow_.asyncOp[size_t(i)] == id) {
      shadow_.flags[size_t(i)] &= uint8_t(~SharedShadow::kAsyncWrite);
      shadow_.asyncOp[size_t(i)] = -1;
    }
  c.done = true;
  // The data becomes the issuing thread's at its wait: others need a barrier
  // after that to read it. (The write itself was checked at the issue: it
  // may land any time after.)
  recordWrite(t.index, t.clock[size_t(t.index)], c.destination, c.bytes, c.pc);
}

void Cta::recordWrite(int actor, Clock clock, int64_t offset, int64_t bytes, const void* pc) {
  for (int64_t i = offset; i < offset + bytes; ++i) {
    const size_t b = size_t(i);
    shadow_.writer[b] = uint16_t(actor);
    shadow_.writeClock[b] = clock;
    shadow_.writePc[b] = pc;
    shadow_.flags[b] = uint8_t((shadow_.flags[b] | SharedShadow::kWritten) &
                               ~(SharedShadow::kAtomicWrite | SharedShadow::kAsyncProxyWrite));
    for (int slot = 0; slot < SharedShadow::kReadSlots; ++slot)
      shadow_.readActor[b * SharedShadow::kReadSlots + size_t(slot)] = SharedShadow::kNobody;
  }
}

void Cta::landTensorCopy(int id) {
  TensorCopy& c = tensorCopies[size_t(id)];
  if (c.landed) return;
  c.landed = true;
  c.read(c.data);  // the global box, swizzled as it lands
  for (size_t i = 0; i < c.data.size(); ++i) {
    const size_t b = size_t(c.destination) + i;
    if (shadow_.asyncOp[b] == id + kTensorCopyTag) {
      shadow_.flags[b] &= uint8_t(~SharedShadow::kAsyncWrite);
      shadow_.asyncOp[b] = -1;
    }
  }
  checkShared(agent(), c.clock, c.destination, int64_t(c.data.size()), Access::write, "cp.async.bulk.tensor", c.pc);
  std::memcpy(shared_ + c.destination, c.data.data(), c.data.size());
  for (size_t i = 0; i < c.data.size(); ++i) shadow_.flags[size_t(c.destination) + i] |= SharedShadow::kAsyncProxyWrite;
  completeTransactions(int64_t(c.barrier) - int64_t(config_.sharedWindowBase), int64_t(c.data.size()), c.clock, c.pc);
}

void Cta::retireMma(int id) {
  Mma& m = mmas[size_t(id)];
  if (m.retired) return;
  m.retired = true;
  for (const auto& [offset, bytes] : m.operands)
    for (int64_t i = offset; i < offset + bytes; ++i)
      if (shadow_.asyncReads[size_t(i)]) --shadow_.asyncReads[size_t(i)];
}

void Cta::retireBulkRead(Thread& waiter, int id) {
  BulkRead& r = bulkReads[size_t(id)];
  if (r.retired) return;
  r.retired = true;
  for (int64_t i = r.source; i < r.source + r.bytes; ++i)
    if (shadow_.asyncReads[size_t(i)]) --shadow_.asyncReads[size_t(i)];
  // The read happened before the wait returned: a later write must be
  // ordered after the waiter's wait, as after a read of its own.
  checkShared(waiter.index, waiter.clock, r.source, r.bytes, Access::read, "cp.async.bulk.wait_group.read", r.pc);
}

void Cta::maybeLand() {
  ++coverage_.instructions;
  if (random() % 4 != 0) return;
  std::vector<int> copyIds, tensorIds;
  for (size_t i = 0; i < copies.size(); ++i)
    if (!copies[i].landed) copyIds.push_back(int(i));
  for (size_t i = 0; i < tensorCopies.size(); ++i)
    if (!tensorCopies[i].landed) tensorIds.push_back(int(i));
  const size_t total = copyIds.size() + tensorIds.size();
  if (total == 0) return;
  const size_t pick = size_t(random() % total);
  if (pick < copyIds.size()) landCopy(copyIds[pick]);
  else landTensorCopy(tensorIds[pick - copyIds.size()]);
}

bool Cta::landAny() {
  bool any = false;
  for (size_t i = 0; i < tensorCopies.size(); ++i)
    if (!tensorCopies[i].landed) {
      landTensorCopy(int(i));
      any = true;
    }
  for (size_t i = 0; i < copies.size(); ++i)
    if (!copies[i].landed) landCopy(int(i));
  return any;
}

//===--- mbarriers --------------------------------------------------------===//

void Cta::completeTransactions(int64_t offset, int64_t bytes, const std::vector<Clock>& clock, const void* pc) {
  auto found = mbarriers.find(offset);
  if (found == mbarriers.end() || !found->second.initialized) {
    report(FindingKind::mbarrier, "complete_tx", pc,
           "a copy completes its bytes on shared " + hex(config_.sharedWindowBase + offset) +
               ", which holds no initialised mbarrier",
           -1);
    return;
  }
  Mbarrier& m = found->second;
  m.tx -= bytes;
  join(m.phaseClock, clock);
  checkPhase(offset, pc);
}

void Cta::checkPhase(int64_t offset, const void* pc) {
  Mbarrier& m = mbarriers[offset];
  if (m.pending > 0) return;
  if (m.tx < 0) {
    report(FindingKind::mbarrier, "mbarrier", pc,
           "the phase " + std::to_string(m.phase) + " of the mbarrier at shared " +
               hex(config_.sharedWindowBase + offset) + " can never complete: every arrival is in and its "
               "transaction count is " + std::to_string(m.tx) + " (more bytes completed than expect_tx announced)",
           -1);
    return;
  }
  if (m.tx > 0) return;
  m.done[m.phase & 1] = m.phaseClock;
  m.phaseClock.assign(size_t(threadCount()) + 1, 0);
  ++m.phase;
  m.pending = m.expected;
  std::vector<std::pair<int, int>> still;
  for (const auto& [thread, parity] : m.waiters) {
    if ((m.phase & 1) != uint32_t(parity)) wake(threads_[size_t(thread)]);
    else still.emplace_back(thread, parity);
  }
  m.waiters = std::move(still);
}

}  // namespace loom::emu
