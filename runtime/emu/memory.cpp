#include "emu/memory.h"

#include <algorithm>
#include <cstring>

namespace loom::emu {

unsigned char* GlobalMemory::allocate(const std::string& name, size_t bytes, bool readOnly, unsigned char fill) {
  Allocation allocation;
  const size_t total = bytes + 2 * kRedZone;
  allocation.storage.reset(new unsigned char[total]);
  std::memset(allocation.storage.get(), 0xa5, total);
  unsigned char* data = allocation.storage.get() + kRedZone;
  std::memset(data, fill, bytes);
  allocation.begin = reinterpret_cast<uintptr_t>(allocation.storage.get());
  allocation.end = allocation.begin + total;
  allocation.buffer = buffers_.size();
  buffers_.push_back({name, data, bytes, readOnly});
  low_ = std::min(low_, allocation.begin);
  high_ = std::max(high_, allocation.end);
  auto at = std::upper_bound(allocations_.begin(), allocations_.end(), allocation.begin,
                             [](uintptr_t a, const Allocation& b) { return a < b.begin; });
  allocations_.insert(at, std::move(allocation));
  return data;
}

GlobalMemory::Where GlobalMemory::locate(const void* address, size_t bytes, const Buffer** buffer) const {
  const auto a = reinterpret_cast<uintptr_t>(address);
  *buffer = nullptr;
  if (!mayContain(address)) return Where::elsewhere;
  auto at = std::upper_bound(allocations_.begin(), allocations_.end(), a,
                             [](uintptr_t x, const Allocation& b) { return x < b.begin; });
  if (at == allocations_.begin()) return Where::elsewhere;
  --at;
  if (a >= at->end) return Where::elsewhere;
  const Buffer& b = buffers_[at->buffer];
  *buffer = &b;
  const auto data = reinterpret_cast<uintptr_t>(b.data);
  return a >= data && a + bytes <= data + b.bytes ? Where::inside : Where::redZone;
}

void SharedShadow::reset(size_t bytes) {
  flags.assign(bytes, 0);
  writer.assign(bytes, kNobody);
  writeClock.assign(bytes, 0);
  writePc.assign(bytes, nullptr);
  readActor.assign(bytes * kReadSlots, kNobody);
  readClock.assign(bytes * kReadSlots, 0);
  asyncOp.assign(bytes, -1);
  asyncReads.assign(bytes, 0);
}

}  // namespace loom::emu
