// The PTX instructions of loom/tile/ptx.h, executed as the PTX ISA defines
// them (fragment layouts, descriptor formats, barrier and mbarrier phases,
// asynchronous completion), on the emulator's CTA (cta.h). Each is checked
// against the ISA's rules as it runs; a broken rule is a finding.
#include "emu/instructions.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <sstream>

#include "emu/cta.h"
#include "emu/tensor_map.h"
#include "loom/half.h"

namespace loom::emu {

// The shared address of element (mn, k) of a 16-bit operand described by a
// wgmma matrix descriptor, per the PTX ISA's canonical layouts in 16-byte
// units: K-major ((8, n), 2) : ((W, SBO), 1) swizzled, ((1, SBO), LBO) not;
// MN-major ((W, n), (8, k)) : ((1, LBO), (W, SBO)) swizzled, ((n, SBO), (1, LBO))
// not, W = swizzle bytes / 16; then the swizzle XORs address bits [4, 4+b)
// with bits [7, 7+b) counted from the pattern start (the base offset).
uint32_t descriptorAddress(uint64_t desc, bool mnMajor, int mn, int k) {
  const uint32_t start = uint32_t(desc & 0x3fff) << 4;
  const uint32_t leading = uint32_t((desc >> 16) & 0x3fff) << 4;
  const uint32_t stride = uint32_t((desc >> 32) & 0x3fff) << 4;
  const uint32_t base = uint32_t((desc >> 49) & 7);
  const int mode = int((desc >> 62) & 3);
  const int bits = mode == 1 ? 3 : mode == 2 ? 2 : mode == 3 ? 1 : 0;
  const uint32_t width = 1u << bits;  // 16-byte units per row of the swizzle atom
  uint32_t offset;
  if (!mnMajor) {
    const uint32_t unit = uint32_t(k / 8), inside = uint32_t(k % 8) * 2;
    const uint32_t row = uint32_t(mn % 8), group = uint32_t(mn / 8);
    offset = bits ? row * width * 16 + group * stride + unit * 16 + inside
                  : row * 16 + group * stride + unit * leading + inside;
  } else {
    const uint32_t unit = uint32_t(mn / 8), inside = uint32_t(mn % 8) * 2;
    const uint32_t row = uint32_t(k % 8), group = uint32_t(k / 8);
    offset = bits ? (unit % width) * 16 + (unit / width) * leading + row * width * 16 + group * stride + inside
                  : unit * stride + row * 16 + group * leading + inside;
  }
  uint32_t address = start + offset;
  if (bits) address ^= (((address >> 7) - base) & (width - 1)) << 4;
  return address;
}

namespace {

Cta& cta() { return *Cta::current(); }

Cta::Members laneMask(uint32_t mask) { return Cta::Members(mask); }

std::string hex(uint64_t value) {
  std::ostringstream text;
  text << "0x" << std::hex << value;
  return text.str();
}

float element(uint16_t bits, bool bfloat16) {
  return bfloat16 ? half::bfloat16ToFloat(bits) : half::halfToFloat(bits);
}
uint16_t low(uint32_t packed) { return uint16_t(packed & 0xffffu); }
uint16_t high(uint32_t packed) { return uint16_t(packed >> 16); }

//===--- memory spaces ------------------------------------------------------===//

unsigned char* dynamicShared(int, const void*) {
  // The shared window's base is a seeded multiple of 128 below 1024: the
  // alignment cuda.h declares (128) holds, hopper.h's 1024 must be made.
  cta().maybeLand();
  return cta().shared();
}

uint32_t sharedAddress(const void* pointer, const void* pc) {
  Cta& c = cta();
  const int64_t offset = static_cast<const unsigned char*>(pointer) - c.shared();
  if (offset < 0 || offset > c.sharedBytes())
    c.report(FindingKind::outOfBounds, "cvta.to.shared", pc, "the pointer is not in the CTA's shared memory");
  return c.sharedAddressOf(pointer);
}

//===--- barriers and warp collectives --------------------------------------===//

void barSync(int id, int threads, const void* pc) {
  cta().maybeLand();
  cta().barrier(id, threads, pc);
}

void barArrive(int id, int threads, const void* pc) {
  cta().maybeLand();
  cta().barrier(id, threads, pc, /*wait=*/false);
}

uint32_t shfl(int mode, uint32_t a, uint32_t b, uint32_t c, uint32_t membermask, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  ++x.coverage_.shfl;
  struct Operands {
    uint32_t a, b, c, d;
  } mine{a, b, c, 0};
  x.collective(kWarpSize, "shfl.sync", laneMask(membermask), &mine, pc, [&](std::vector<void*>& lanes, std::vector<Thread*>&) {
    for (int lane = 0; lane < kWarpSize; ++lane) {
      if (!lanes[size_t(lane)]) continue;
      Operands& o = *static_cast<Operands*>(lanes[size_t(lane)]);
      // The ISA's pseudo-code: a segment of lanes, a clamp, then the source lane.
      const uint32_t bval = o.b & 31, cval = o.c & 31, segmask = (o.c >> 8) & 31;
      const uint32_t maxLane = (uint32_t(lane) & segmask) | (cval & ~segmask);
      const uint32_t minLane = uint32_t(lane) & segmask;
      int32_t j = lane;
      bool pval = false;
      switch (mode) {
        case kShuffleUp: j = lane - int32_t(bval); pval = j >= int32_t(maxLane); break;
        case kShuffleDown: j = lane + int32_t(bval); pval = j <= int32_t(maxLane); break;
        case kShuffleBfly: j = lane ^ int32_t(bval); pval = j <= int32_t(maxLane); break;
        default: j = int32_t(minLane | (bval & ~segmask)); pval = j <= int32_t(maxLane); break;
      }
      if (!pval) j = lane;
      if (!lanes[size_t(j)]) {
        Cta::current()->report(FindingKind::divergence, "shfl.sync", pc,
                               "lane " + std::to_string(lane) + " reads lane " + std::to_string(j) +
                                   ", which is not in the member mask " + hex(membermask),
                               -1);
        o.d = 0;
        continue;
      }
      o.d = static_cast<Operands*>(lanes[size_t(j)])->a;
    }
  });
  return mine.d;
}

void warpSync(uint32_t membermask, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  int unused = 0;
  x.collective(kWarpSize, "bar.warp.sync", laneMask(membermask), &unused, pc,
               [&](std::vector<void*>&, std::vector<Thread*>& lanes) {
                 std::vector<Clock> joined;
                 for (Thread* lane : lanes)
                   if (lane) {
                     joined.resize(std::max(joined.size(), lane->clock.size()), 0);
                     Cta::join(joined, lane->clock);
                   }
                 for (Thread* lane : lanes)
                   if (lane) {
                     lane->clock = joined;
                     ++lane->clock[size_t(lane->index)];
                   }
               });
}

uint32_t elect(uint32_t membermask, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  uint32_t leader = 0;
  x.collective(kWarpSize, "elect.sync", laneMask(membermask), &leader, pc, [&](std::vector<void*>& lanes, std::vector<Thread*>&) {
    const uint32_t elected = uint32_t(std::countr_zero(membermask));
    for (void* lane : lanes)
      if (lane) *static_cast<uint32_t*>(lane) = elected;
  });
  return leader;
}

//===--- ldmatrix and mma.sync (sm_80) -------------------------------------===//

void ldmatrix(int matrices, int transpose, uint32_t* registers, uint32_t address, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  ++x.coverage_.ldmatrix;
  const std::string name =
      "ldmatrix.sync.aligned.m8n8.x" + std::to_string(matrices) + (transpose ? ".trans" : "") + ".shared.b16";
  if (matrices != 1 && matrices != 2 && matrices != 4) {
    x.report(FindingKind::invalidOperand, name, pc, "the number of matrices must be 1, 2 or 4");
    return;
  }
  struct Operands {
    uint32_t address;
    uint32_t* registers;
  } mine{address, registers};
  x.collective(kWarpSize, "ldmatrix", laneMask(0xffffffffu), &mine, pc,
               [&](std::vector<void*>& lanes, std::vector<Thread*>& threads) {
                 // Matrix m's row r comes from the address of thread 8m + r.
                 uint16_t rows[4][8][8] = {};
                 for (int m = 0; m < matrices; ++m)
                   for (int r = 0; r < 8; ++r) {
                     const int provider = 8 * m + r;
                     const uint32_t rowAddress = static_cast<Operands*>(lanes[size_t(provider)])->address;
                     if (rowAddress % 16 != 0) {
                       x.report(FindingKind::misaligned, name, pc,
                                "row address " + hex(rowAddress) + " of thread " + std::to_string(provider) +
                                    " is not 16-byte aligned",
                                threads[size_t(provider)]->index);
                       continue;
                     }
                     auto offset = x.sharedOffset(rowAddress, 16, name.c_str(), pc);
                     if (!offset) continue;
                     Thread& reader = *threads[size_t(provider)];
                     x.checkShared(reader.index, reader.clock, *offset, 16, Cta::Access::read, name.c_str(), pc);
                     std::memcpy(rows[m][r], x.shared() + *offset, 16);
                   }
                 for (int lane = 0; lane < kWarpSize; ++lane) {
                   uint32_t* out = static_cast<Operands*>(lanes[size_t(lane)])->registers;
                   const int group = lane / 4, pair = 2 * (lane % 4);
                   for (int m = 0; m < matrices; ++m)
                     out[m] = transpose ? uint32_t(rows[m][pair][group]) | uint32_t(rows[m][pair + 1][group]) << 16
                                        : uint32_t(rows[m][group][pair]) | uint32_t(rows[m][group][pair + 1]) << 16;
                 }
               });
}

void mma16816(int bfloat16, float* d, const uint32_t* a, uint32_t b0, uint32_t b1, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  ++x.coverage_.mma;
  struct Operands {
    float* d;
    uint32_t a[4], b[2];
  } mine{d, {a[0], a[1], a[2], a[3]}, {b0, b1}};
  x.collective(kWarpSize, bfloat16 ? "mma.sync.m16n8k16.bf16" : "mma.sync.m16n8k16.f16", laneMask(0xffffffffu), &mine, pc,
               [&](std::vector<void*>& lanes, std::vector<Thread*>&) {
                 // Fragment layouts of m16n8k16 (groupID = lane / 4, t = lane % 4):
                 // A a0..a7 at (g | g+8, 2t+{0,1} | +8); B b0..b3 at (k 2t+{0,1} | +8, n g);
                 // C/D c0..c3 at (g | g+8, 2t+{0,1}).
                 float A[16][16], B[16][8], C[16][8];
                 for (int lane = 0; lane < kWarpSize; ++lane) {
                   const Operands& o = *static_cast<Operands*>(lanes[size_t(lane)]);
                   const int g = lane / 4, t = lane % 4;
                   for (int r = 0; r < 4; ++r) {
                     const int row = g + (r % 2) * 8, column = 2 * t + (r / 2) * 8;
                     A[row][column] = element(low(o.a[r]), bfloat16);
                     A[row][column + 1] = element(high(o.a[r]), bfloat16);
                   }
                   for (int r = 0; r < 2; ++r) {
                     B[2 * t + r * 8][g] = element(low(o.b[r]), bfloat16);
                     B[2 * t + r * 8 + 1][g] = element(high(o.b[r]), bfloat16);
                   }
                   for (int e = 0; e < 4; ++e) C[g + (e / 2) * 8][2 * t + e % 2] = o.d[e];
                 }
                 for (int lane = 0; lane < kWarpSize; ++lane) {
                   const Operands& o = *static_cast<Operands*>(lanes[size_t(lane)]);
                   const int g = lane / 4, t = lane % 4;
                   for (int e = 0; e < 4; ++e) {
                     const int row = g + (e / 2) * 8, column = 2 * t + e % 2;
                     float sum = C[row][column];
                     for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][column];
                     o.d[e] = sum;
                   }
                 }
               });
}

//===--- cp.async and shared-memory atomics ----------------------------------===//

void cpAsync(uint32_t destination, const void* source, int cpSize, int srcSize, int cacheGlobal, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  ++x.coverage_.cpAsync;
  Thread& t = x.self();
  const char* name = cacheGlobal ? "cp.async.cg.shared.global" : "cp.async.ca.shared.global";
  if ((cpSize != 4 && cpSize != 8 && cpSize != 16) || (cacheGlobal && cpSize != 16) || srcSize < 0 ||
      srcSize > cpSize) {
    x.report(FindingKind::invalidOperand, name, pc,
             "cp-size " + std::to_string(cpSize) + " with src-size " + std::to_string(srcSize) +
                 " (cp-size 4, 8 or 16, .cg only 16; src-size at most cp-size)");
    return;
  }
  if (destination % uint32_t(cpSize) != 0 || (srcSize > 0 && reinterpret_cast<uintptr_t>(source) % cpSize != 0)) {
    x.report(FindingKind::misaligned, name, pc, "source and destination must be aligned to cp-size");
    return;
  }
  auto offset = x.sharedOffset(destination, cpSize, name, pc);
  if (!offset) return;
  if (srcSize > 0 && x.config().global) {
    const GlobalMemory::Buffer* buffer = nullptr;
    const auto where = x.config().global->locate(source, size_t(srcSize), &buffer);
    if (where != GlobalMemory::Where::inside) {
      x.report(FindingKind::outOfBounds, name, pc,
               where == GlobalMemory::Where::redZone
                   ? "reads " + std::to_string(srcSize) + " bytes at byte " +
                         std::to_string(static_cast<const unsigned char*>(source) - buffer->data) + " of " +
                         buffer->name + ", which has " + std::to_string(buffer->bytes) + " bytes"
                   : std::string("reads global memory outside every launch buffer"));
      return;
    }
  }
  // The copy may land any moment from now: every earlier access to its
  // bytes must be ordered before this issue.
  x.checkShared(t.index, t.clock, *offset, cpSize, Cta::Access::write, name, pc);
  const int id = int(x.copies.size());
  x.copies.push_back({t.index, *offset, static_cast<const unsigned char*>(source), cpSize, srcSize, false, false, pc});
  for (int64_t i = *offset; i < *offset + cpSize; ++i) {
    if (x.shadow().flags[size_t(i)] & SharedShadow::kAsyncWrite)
      x.report(FindingKind::asyncAccess, name, pc, "a second copy into bytes another copy still has in flight");
    x.shadow().flags[size_t(i)] |= SharedShadow::kAsyncWrite;
    x.shadow().asyncOp[size_t(i)] = id;
  }
  t.uncommittedCopies.push_back(id);
}

void cpAsyncCommit(const void*) {
  Cta& x = cta();
  x.maybeLand();
  Thread& t = x.self();
  t.copyGroups.push_back(std::move(t.uncommittedCopies));
  t.uncommittedCopies.clear();
}

void cpAsyncWait(int pending, const void*) {
  Cta& x = cta();
  x.maybeLand();
  Thread& t = x.self();
  while (int(t.copyGroups.size()) > pending) {
    for (int id : t.copyGroups.front()) x.completeCopy(t, id);
    t.copyGroups.pop_front();
  }
}

void redSharedAddF32(uint32_t address, float value, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  Thread& t = x.self();
  const char* name = "red.shared.add.f32";
  if (address % 4 != 0) {
    x.report(FindingKind::misaligned, name, pc, "address " + hex(address) + " is not 4-byte aligned");
    return;
  }
  auto offset = x.sharedOffset(address, 4, name, pc);
  if (!offset) return;
  x.checkShared(t.index, t.clock, *offset, 4, Cta::Access::atomic, name, pc);
  float old;
  std::memcpy(&old, x.shared() + *offset, 4);
  old += value;
  std::memcpy(x.shared() + *offset, &old, 4);
}

// CTAs run on several OS threads at once: a global add is a
// compare-and-swap loop, as atomic against other CTAs as the GPU's.
void atomicAddF32(void* address, float value) {
  auto* word = static_cast<uint32_t*>(address);
  uint32_t seen = __atomic_load_n(word, __ATOMIC_RELAXED);
  for (;;) {
    float old;
    std::memcpy(&old, &seen, 4);
    const float sum = old + value;
    uint32_t next;
    std::memcpy(&next, &sum, 4);
    if (__atomic_compare_exchange_n(word, &seen, next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return;
  }
}

void redGlobalAddF32(float* address, float value, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  if (!x.checkGlobal(address, 4, true, "red.global.add.f32", pc)) return;
  atomicAddF32(address, value);
}

//===--- bulk reductions (cp.reduce.async.bulk) ------------------------------===//

// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [global],
// [shared], bytes: the async proxy reads `bytes` of shared memory (so the
// generic writes it reads need fence.proxy.async, and every thread's
// writes must be ordered before the issue) and adds them into global
// memory, element by element, atomically against every CTA's adds. The
// add is made at the issue; the shared bytes stay read until a
// cp.async.bulk.wait_group{.read} of the issuing thread covers the
// operation: a write into them before that is a finding, as is a CTA that
// ends with one in flight.
void bulkReduceAddF32(float* global, uint32_t source, uint32_t bytes, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  ++x.coverage_.bulk;
  Thread& t = x.self();
  const char* name = "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32";
  if (bytes == 0 || bytes % 16 != 0 || source % 16 != 0 || reinterpret_cast<uintptr_t>(global) % 16 != 0) {
    x.report(FindingKind::misaligned, name, pc,
             "size " + std::to_string(bytes) + " at shared " + hex(source) +
                 ": the size, the shared and the global address must be multiples of 16 (size not 0)");
    return;
  }
  auto offset = x.sharedOffset(source, int64_t(bytes), name, pc);
  if (!offset) return;
  for (uint32_t at = 0; at < bytes; at += 16)
    if (!x.checkGlobal(reinterpret_cast<unsigned char*>(global) + at, 16, true, name, pc)) return;
  x.checkAsyncProxyRead(t.index, t.clock, *offset, bytes, name, pc);
  for (uint32_t at = 0; at < bytes; at += 4) {
    float value;
    std::memcpy(&value, x.shared() + *offset + at, 4);
    atomicAddF32(reinterpret_cast<unsigned char*>(global) + at, value);
  }
  const int id = int(x.bulkReads.size());
  x.bulkReads.push_back({t.index, *offset, int64_t(bytes), false, pc});
  for (int64_t i = *offset; i < *offset + int64_t(bytes); ++i) ++x.shadow().asyncReads[size_t(i)];
  t.uncommittedBulk.push_back(id);
}

void bulkCommit(const void*) {
  Cta& x = cta();
  x.maybeLand();
  Thread& t = x.self();
  t.bulkGroups.push_back(std::move(t.uncommittedBulk));
  t.uncommittedBulk.clear();
}

// cp.async.bulk.wait_group{.read} pending: the thread's bulk groups but the
// newest `pending` complete (with .read, have read their sources; the
// emulator's adds are already made, so both retire the reads).
void bulkWait(int pending, int, const void*) {
  Cta& x = cta();
  x.maybeLand();
  Thread& t = x.self();
  while (int(t.bulkGroups.size()) > pending) {
    for (int id : t.bulkGroups.front()) x.retireBulkRead(t, id);
    t.bulkGroups.pop_front();
  }
}

//===--- mbarriers and fences -------------------------------------------------===//

Cta::Mbarrier* mbarrierAt(Cta& x, uint32_t address, const char* name, const void* pc, int64_t* offset) {
  if (address % 8 != 0) {
    x.report(FindingKind::misaligned, name, pc, "mbarrier address " + hex(address) + " is not 8-byte aligned");
    return nullptr;
  }
  auto at = x.sharedOffset(address, 8, name, pc);
  if (!at) return nullptr;
  *offset = *at;
  auto found = x.mbarriers.find(*at);
  if (found == x.mbarriers.end() || !found->second.initialized) {
    x.report(FindingKind::mbarrier, name, pc, "the mbarrier at shared " + hex(address) + " was never initialised");
    return nullptr;
  }
  return &found->second;
}

void mbarrierInit(uint32_t address, uint32_t count, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  ++x.coverage_.mbarrier;
  Thread& t = x.self();
  const char* name = "mbarrier.init.shared::cta.b64";
  if (address % 8 != 0) {
    x.report(FindingKind::misaligned, name, pc, "mbarrier address " + hex(address) + " is not 8-byte aligned");
    return;
  }
  if (count < 1 || count >= (1u << 20)) {
    x.report(FindingKind::invalidOperand, name, pc, "arrival count " + std::to_string(count) + " is not 1..2^20-1");
    return;
  }
  auto offset = x.sharedOffset(address, 8, name, pc);
  if (!offset) return;
  Cta::Mbarrier& m = x.mbarriers[*offset];
  if (m.initialized && !m.waiters.empty())
    x.report(FindingKind::mbarrier, name, pc, "re-initialised while threads wait on it");
  x.checkShared(t.index, t.clock, *offset, 8, Cta::Access::write, name, pc);
  for (int64_t i = *offset; i < *offset + 8; ++i) x.shadow().flags[size_t(i)] |= SharedShadow::kMbarrier;
  std::memset(x.shared() + *offset, 0, 8);
  m = Cta::Mbarrier{};
  m.initialized = true;
  m.expected = count;
  m.pending = count;
  m.phaseClock.assign(size_t(x.threadCount()) + 1, 0);
  m.done[0].assign(size_t(x.threadCount()) + 1, 0);
  m.done[1].assign(size_t(x.threadCount()) + 1, 0);
}

void mbarrierArrive(uint32_t address, int64_t expectTx, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  ++x.coverage_.mbarrier;
  Thread& t = x.self();
  const char* name = expectTx >= 0 ? "mbarrier.arrive.expect_tx.shared::cta.b64" : "mbarrier.arrive.shared::cta.b64";
  int64_t offset = 0;
  Cta::Mbarrier* m = mbarrierAt(x, address, name, pc, &offset);
  if (!m) return;
  // The object is read and updated atomically: ordered after its init.
  x.checkShared(t.index, t.clock, offset, 8, Cta::Access::atomic, name, pc);
  if (expectTx >= 0) {
    m->tx += expectTx;
    if (m->tx >= (int64_t(1) << 20))
      x.report(FindingKind::mbarrier, name, pc, "transaction count " + std::to_string(m->tx) + " exceeds 2^20-1");
  }
  if (--m->pending < 0)
    x.report(FindingKind::mbarrier, name, pc,
             "more arrivals than the count of " + std::to_string(m->expected) + " in phase " + std::to_string(m->phase));
  Cta::join(m->phaseClock, t.clock);
  ++t.clock[size_t(t.index)];  // a release: later writes are not covered by it
  x.checkPhase(offset, pc);
}

void mbarrierWaitParity(uint32_t address, int parity, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  ++x.coverage_.mbarrier;
  Thread& t = x.self();
  const char* name = "mbarrier.try_wait.parity.shared::cta.b64";
  while (true) {
    int64_t offset = 0;
    Cta::Mbarrier* m = mbarrierAt(x, address, name, pc, &offset);
    if (!m) return;
    if ((m->phase & 1) != uint32_t(parity & 1)) {
      Cta::join(t.clock, m->done[size_t(parity & 1)]);  // acquire the completed phase
      return;
    }
    m->waiters.emplace_back(t.index, parity & 1);
    x.block("mbarrier.try_wait.parity " + std::to_string(parity & 1) + " on shared " + hex(address), pc);
  }
}

void fenceMbarrierInit(const void*) { cta().maybeLand(); }

void fenceProxyAsync(const void*) {
  Cta& x = cta();
  x.maybeLand();
  Thread& t = x.self();
  t.proxyFences.push_back(t.clock[size_t(t.index)]);
  ++t.clock[size_t(t.index)];  // writes after the fence are not covered by it
}

//===--- the tensor memory accelerator ---------------------------------------===//

void tmaLoad(uint32_t destination, const void* tensorMap, const int32_t* coordinates, int rank, uint32_t bar,
             const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  ++x.coverage_.tma;
  Thread& t = x.self();
  const std::string name =
      "cp.async.bulk.tensor." + std::to_string(rank) + "d.shared::cluster.global.mbarrier::complete_tx::bytes";
  DecodedTensorMap map;
  if (!decodeTensorMap(tensorMap, &map)) {
    x.report(FindingKind::invalidOperand, name, pc, "the tensor map was not encoded by cuTensorMapEncodeTiled");
    return;
  }
  if (map.rank != rank) {
    x.report(FindingKind::invalidOperand, name, pc,
             "a " + std::to_string(rank) + "-d load of a rank-" + std::to_string(map.rank) + " tensor map");
    return;
  }
  if (destination % 128 != 0) {
    x.report(FindingKind::misaligned, name, pc, "destination " + hex(destination) + " is not 128-byte aligned");
    return;
  }
  const int64_t bytes = map.boxBytes();
  auto offset = x.sharedOffset(destination, bytes, name.c_str(), pc);
  if (!offset) return;
  Cta::TensorCopy copy;
  copy.thread = t.index;
  copy.destination = *offset;
  copy.barrier = bar;
  copy.pc = pc;
  copy.data.assign(size_t(bytes), 0);
  // The copy unit acquires what its issuer has seen; each copy is an epoch of its own.
  std::vector<Clock>& agent = x.agentClock();
  Cta::join(agent, t.clock);
  copy.clock = agent;
  ++agent[size_t(x.agent())];
  std::vector<int32_t> at(coordinates, coordinates + rank);
  const int issuer = t.index;
  GlobalMemory* global = x.config().global;
  copy.read = [map, at, destination, global, issuer, name, pc](std::vector<unsigned char>& data) {
    Cta& c = *Cta::current();
    bool reported = false;
    for (const BoxElement& e : boxElements(map, at.data(), destination)) {
      unsigned char* target = data.data() + e.offset;
      if (!e.source) {
        if (map.nanFill) std::memset(target, 0xff, size_t(map.elementBytes));
        else std::memset(target, 0, size_t(map.elementBytes));
        continue;
      }
      if (global && !reported) {
        const GlobalMemory::Buffer* buffer = nullptr;
        if (global->locate(e.source, size_t(map.elementBytes), &buffer) != GlobalMemory::Where::inside) {
          c.report(FindingKind::outOfBounds, name, pc,
                   "the tensor map's box reads global memory outside " +
                       (buffer ? buffer->name : std::string("every launch buffer")),
                   issuer);
          reported = true;
        }
      }
      std::memcpy(target, e.source, size_t(map.elementBytes));
    }
  };
  const int id = int(x.tensorCopies.size());
  for (int64_t i = *offset; i < *offset + bytes; ++i) {
    if (x.shadow().flags[size_t(i)] & SharedShadow::kAsyncWrite)
      x.report(FindingKind::asyncAccess, name, pc, "a copy into bytes another copy still has in flight");
    x.shadow().flags[size_t(i)] |= SharedShadow::kAsyncWrite;
    x.shadow().asyncOp[size_t(i)] = id + kTensorCopyTag;
  }
  x.tensorCopies.push_back(std::move(copy));
}

//===--- wgmma ---------------------------------------------------------------===//

struct MmaOperands {
  float* d;
  const uint32_t* a;
  uint64_t aDesc, bDesc;
  int n, bfloat16, scaleD, transposeA, transposeB;
};

void wgmmaFence(const void*) {
  Cta& x = cta();
  x.maybeLand();
  Thread& t = x.self();
  t.fenced = true;
  t.touchedSinceFence = false;
}

void wgmmaCommit(const void*) {
  Cta& x = cta();
  x.maybeLand();
  Thread& t = x.self();
  t.mmaGroups.push_back(std::move(t.uncommittedMmas));
  t.uncommittedMmas.clear();
}

// wgmma.wait_group: the groups older than the newest `pending` retire; this
// thread's share of their results lands in its accumulator registers.
void wgmmaWait(int pending, const void*) {
  Cta& x = cta();
  x.maybeLand();
  Thread& t = x.self();
  const size_t position = size_t(t.index - t.warpgroup * kWarpgroupSize);
  while (int(t.mmaGroups.size()) > pending) {
    for (int id : t.mmaGroups.front()) {
      x.retireMma(id);
      const Cta::Mma& m = x.mmas[size_t(id)];
      float* d = m.accumulators[position];
      auto acc = t.accumulators.find(d);
      if (acc != t.accumulators.end() && --acc->second.inFlight == 0) {
        std::memcpy(d, acc->second.value.data(), acc->second.value.size() * sizeof(float));
        const auto begin = reinterpret_cast<uintptr_t>(d);
        std::erase_if(t.pendingRegisters, [&](const Thread::RegisterRange& r) { return r.results && r.begin == begin; });
        t.accumulators.erase(acc);
      }
      if (!m.registerOperands.empty()) {
        const auto begin = reinterpret_cast<uintptr_t>(m.registerOperands[position]);
        auto range = std::find_if(t.pendingRegisters.begin(), t.pendingRegisters.end(),
                                  [&](const Thread::RegisterRange& r) { return !r.results && r.begin == begin; });
        if (range != t.pendingRegisters.end()) t.pendingRegisters.erase(range);
      }
    }
    t.mmaGroups.pop_front();
  }
}

void remember(std::vector<std::pair<uintptr_t, uintptr_t>>& arrays, uintptr_t begin, uintptr_t end) {
  for (const auto& known : arrays)
    if (known.first == begin) return;
  arrays.emplace_back(begin, end);
}

void wgmmaMmaAsync(int bfloat16, int n, float* d, uint64_t aDesc, const uint32_t* aRegisters, uint64_t bDesc,
                   int scaleD, int transposeA, int transposeB, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  ++x.coverage_.wgmma;
  Thread& self = x.self();
  const std::string name = "wgmma.mma_async.sync.aligned.m64n" + std::to_string(n) + "k16.f32." +
                           (bfloat16 ? "bf16.bf16" : "f16.f16");
  if (!self.fenced)
    x.report(FindingKind::asyncAccess, name, pc, "issued before any wgmma.fence of this thread");
  else if (self.touchedSinceFence)
    x.report(FindingKind::asyncAccess, name, pc,
             "registers a wgmma uses were accessed since the last wgmma.fence (fence before issuing)");
  MmaOperands mine{d, aRegisters, aDesc, bDesc, n, bfloat16, scaleD, transposeA, transposeB};
  x.collective(kWarpgroupSize, "wgmma.mma_async", x.warpgroupMembers(), &mine, pc,
               [&](std::vector<void*>& slots, std::vector<Thread*>& threads) {
    const MmaOperands& first = *static_cast<MmaOperands*>(slots[0]);
    for (size_t p = 0; p < slots.size(); ++p) {
      const auto* o = static_cast<MmaOperands*>(slots[p]);
      if (!o) continue;
      if (o->bDesc != first.bDesc || o->n != first.n || o->bfloat16 != first.bfloat16 || o->scaleD != first.scaleD ||
          o->transposeA != first.transposeA || o->transposeB != first.transposeB ||
          (o->a == nullptr) != (first.a == nullptr) || (!o->a && o->aDesc != first.aDesc)) {
        x.report(FindingKind::divergence, name, pc,
                 "the threads of a warpgroup issue it with different descriptors, shapes or flags", threads[p]->index);
        return;
      }
    }
    const int N = first.n;
    if (N < 8 || N > 256 || N % 8 != 0) {
      x.report(FindingKind::invalidOperand, name, pc, "N = " + std::to_string(N) + " is not 8..256 in steps of 8");
      return;
    }
    if (first.a && first.transposeA) {
      x.report(FindingKind::invalidOperand, name, pc, "A from registers cannot be transposed");
      return;
    }
    constexpr int M = 64, K = 16;
    std::vector<float> A(size_t(M * K)), B(size_t(K * N));
    std::vector<int64_t> units;  // 16-byte shared units the operands read
    auto load = [&](uint64_t desc, bool mnMajor, int mn, int k) -> float {
      const uint32_t address = descriptorAddress(desc, mnMajor, mn, k);
      auto offset = x.sharedOffset(address, 2, name.c_str(), pc);
      if (!offset) return 0.0f;
      units.push_back(*offset & ~int64_t(15));
      uint16_t bits;
      std::memcpy(&bits, x.shared() + *offset, 2);
      return element(bits, first.bfloat16);
    };
    if (first.a) {
      // A from registers: the m16n8k16 A layout per warp, warp w holding rows 16w..16w+15.
      for (size_t p = 0; p < slots.size(); ++p) {
        const auto* o = static_cast<MmaOperands*>(slots[p]);
        if (!o) continue;
        const int w = int(p) / kWarpSize, g = int(p % kWarpSize) / 4, t = int(p % 4);
        for (int r = 0; r < 4; ++r) {
          const int row = 16 * w + g + (r % 2) * 8, column = 2 * t + (r / 2) * 8;
          A[size_t(row * K + column)] = element(low(o->a[r]), first.bfloat16);
          A[size_t(row * K + column + 1)] = element(high(o->a[r]), first.bfloat16);
        }
      }
    } else {
      for (int m = 0; m < M; ++m)
        for (int k = 0; k < K; ++k) A[size_t(m * K + k)] = load(first.aDesc, first.transposeA, m, k);
    }
    for (int nn = 0; nn < N; ++nn)
      for (int k = 0; k < K; ++k) B[size_t(k * N + nn)] = load(first.bDesc, first.transposeB, nn, k);
    // The operands are read through the async proxy, after every thread of
    // the warpgroup issued the instruction.
    std::vector<Clock> clock(size_t(x.threadCount()) + 1, 0);
    for (Thread* t : threads)
      if (t) Cta::join(clock, t->clock);
    std::sort(units.begin(), units.end());
    units.erase(std::unique(units.begin(), units.end()), units.end());
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int64_t unit : units) {
      if (!ranges.empty() && ranges.back().first + ranges.back().second == unit) ranges.back().second += 16;
      else ranges.emplace_back(unit, 16);
    }
    for (const auto& [offset, bytes] : ranges)
      x.checkAsyncProxyRead(x.self().index, clock, offset, std::min<int64_t>(bytes, x.sharedBytes() - offset),
                            name.c_str(), pc);

    Cta::Mma op;
    op.warpgroup = threads[0] ? threads[0]->warpgroup : 0;
    op.operands = ranges;
    op.accumulators.assign(slots.size(), nullptr);
    if (first.a) op.registerOperands.assign(slots.size(), nullptr);
    const int id = int(x.mmas.size());
    for (size_t p = 0; p < slots.size(); ++p) {
      auto* o = static_cast<MmaOperands*>(slots[p]);
      if (!o) continue;
      Thread& t = *threads[p];
      const int w = int(p) / kWarpSize, g = int(p % kWarpSize) / 4, q = int(p % 4);
      // C from this thread's accumulators: an in-flight result if a wgmma
      // still owes one (chained on the same registers), else the registers.
      auto acc = t.accumulators.find(o->d);
      std::vector<float> c(size_t(N / 2));
      if (acc != t.accumulators.end()) c = acc->second.value;
      else std::memcpy(c.data(), o->d, c.size() * sizeof(float));
      std::vector<float> result(size_t(N / 2));
      for (int tile = 0; tile < N / 8; ++tile)
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * w + g + (e / 2) * 8, column = 8 * tile + 2 * q + e % 2;
          float sum = first.scaleD ? c[size_t(4 * tile + e)] : 0.0f;
          for (int k = 0; k < K; ++k) sum += A[size_t(row * K + k)] * B[size_t(k * N + column)];
          result[size_t(4 * tile + e)] = sum;
        }
      Thread::PendingAccumulator& pending = t.accumulators[o->d];
      pending.value = std::move(result);
      if (pending.inFlight++ == 0)
        t.pendingRegisters.push_back({reinterpret_cast<uintptr_t>(o->d),
                                      reinterpret_cast<uintptr_t>(o->d + N / 2), true});
      remember(t.wgmmaRegisters, reinterpret_cast<uintptr_t>(o->d), reinterpret_cast<uintptr_t>(o->d + N / 2));
      op.accumulators[p] = o->d;
      if (first.a) {
        op.registerOperands[p] = o->a;
        t.pendingRegisters.push_back(
            {reinterpret_cast<uintptr_t>(o->a), reinterpret_cast<uintptr_t>(o->a + 4), false});
        remember(t.wgmmaRegisters, reinterpret_cast<uintptr_t>(o->a), reinterpret_cast<uintptr_t>(o->a + 4));
      }
      t.uncommittedMmas.push_back(id);
    }
    for (const auto& [offset, bytes] : op.operands)
      for (int64_t i = offset; i < offset + bytes && i < x.sharedBytes(); ++i) ++x.shadow().asyncReads[size_t(i)];
    x.mmas.push_back(std::move(op));
  });
}

//===--- setmaxnreg ---------------------------------------------------------===//

void setmaxnreg(int increase, int count, const void* pc) {
  Cta& x = cta();
  x.maybeLand();
  const std::string name = std::string("setmaxnreg.") + (increase ? "inc" : "dec") + ".sync.aligned.u32";
  if (count < 24 || count > 256 || count % 8 != 0) {
    x.report(FindingKind::invalidOperand, name, pc,
             "register count " + std::to_string(count) + " is not a multiple of 8 in 24..256");
    return;
  }
  struct Request {
    int increase, count;
  } mine{increase, count};
  x.collective(kWarpgroupSize, "setmaxnreg", x.warpgroupMembers(), &mine, pc,
               [&](std::vector<void*>& slots, std::vector<Thread*>& threads) {
    int members = 0, current = -1;
    for (size_t p = 0; p < slots.size(); ++p) {
      if (!slots[p]) continue;
      const Request& r = *static_cast<Request*>(slots[p]);
      if (r.increase != mine.increase || r.count != mine.count) {
        x.report(FindingKind::divergence, name, pc, "not warpgroup-uniform: threads ask for different counts",
                 threads[p]->index);
        return;
      }
      ++members;
      current = threads[p]->registers;
    }
    if (increase && count < current) {
      x.report(FindingKind::invalidOperand, name, pc,
               "asks for " + std::to_string(count) + " registers while holding " + std::to_string(current));
      return;
    }
    if (!increase && count > current) {
      x.report(FindingKind::invalidOperand, name, pc,
               "releases down to " + std::to_string(count) + " registers while holding only " + std::to_string(current));
      return;
    }
    const int change = (count - current) * members;
    if (change > 0) {
      // .inc waits until other warpgroups have released enough of the file.
      while (x.freeRegisters < change) {
        x.registerWaiters.push_back(x.self().index);
        x.block("setmaxnreg.inc (" + std::to_string(change) + " registers wanted, " +
                    std::to_string(x.freeRegisters) + " free of the 64K file)",
                pc);
      }
    }
    x.freeRegisters -= change;
    for (Thread* t : threads)
      if (t) t->registers = count;
    if (change < 0) {
      const std::vector<int> waiters = std::move(x.registerWaiters);
      x.registerWaiters.clear();
      for (int w : waiters) x.wake(x.thread(w));
    }
  });
}

//===--- the table ----------------------------------------------------------===//

void access(const void* address, uint32_t size, int write, const void* pc) {
  Cta* x = Cta::current();
  if (x && x->running()) x->access(address, size, write != 0, pc);
}

}  // namespace

const Api& api() {
  static const Api table = {
      .version = kAbiVersion,
      .access = access,
      .dynamicShared = dynamicShared,
      .sharedAddress = sharedAddress,
      .barSync = barSync,
      .shfl = shfl,
      .elect = elect,
      .ldmatrix = ldmatrix,
      .mma16816 = mma16816,
      .cpAsync = cpAsync,
      .cpAsyncCommit = cpAsyncCommit,
      .cpAsyncWait = cpAsyncWait,
      .redSharedAddF32 = redSharedAddF32,
      .mbarrierInit = mbarrierInit,
      .mbarrierArrive = mbarrierArrive,
      .mbarrierWaitParity = mbarrierWaitParity,
      .fenceMbarrierInit = fenceMbarrierInit,
      .fenceProxyAsync = fenceProxyAsync,
      .tmaLoad = tmaLoad,
      .wgmmaFence = wgmmaFence,
      .wgmmaCommit = wgmmaCommit,
      .wgmmaWait = wgmmaWait,
      .wgmmaMmaAsync = wgmmaMmaAsync,
      .setmaxnreg = setmaxnreg,
      .redGlobalAddF32 = redGlobalAddF32,
      .barArrive = barArrive,
      .warpSync = warpSync,
      .bulkReduceAddF32 = bulkReduceAddF32,
      .bulkCommit = bulkCommit,
      .bulkWait = bulkWait,
  };
  return table;
}

}  // namespace loom::emu
