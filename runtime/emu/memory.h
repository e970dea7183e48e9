// The emulator's two memories. Global memory is the launch's buffers
// (tensors and workspaces), each allocated with red zones around it so an
// access just past any of them is caught. Shared memory is one CTA's dynamic
// shared memory with a shadow byte for byte: who wrote it last and when (a
// vector-clock epoch), who read it since, whether it was ever written, and
// whether an asynchronous copy or a wgmma still owns it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace loom::emu {

using Clock = uint32_t;

class GlobalMemory {
 public:
  static constexpr size_t kRedZone = 64 * 1024;

  struct Buffer {
    std::string name;
    unsigned char* data = nullptr;
    size_t bytes = 0;
    bool readOnly = false;
  };

  // `bytes` of storage filled with `fill`, between red zones.
  unsigned char* allocate(const std::string& name, size_t bytes, bool readOnly, unsigned char fill = 0);

  enum class Where { elsewhere, inside, redZone };
  // Where [address, address + bytes) falls; `buffer` is set when it touches one.
  Where locate(const void* address, size_t bytes, const Buffer** buffer) const;
  bool mayContain(const void* address) const {
    const auto a = reinterpret_cast<uintptr_t>(address);
    return a >= low_ && a < high_;
  }
  const std::vector<Buffer>& buffers() const { return buffers_; }

 private:
  struct Allocation {
    std::unique_ptr<unsigned char[]> storage;
    uintptr_t begin = 0, end = 0;  // with red zones
    size_t buffer = 0;
  };
  std::vector<Allocation> allocations_;  // sorted by address
  std::vector<Buffer> buffers_;
  uintptr_t low_ = UINTPTR_MAX, high_ = 0;
};

// The shadow of one CTA's shared memory.
class SharedShadow {
 public:
  static constexpr int kReadSlots = 4;
  static constexpr uint16_t kNobody = 0xffff;

  enum Flag : uint8_t {
    kWritten = 1,          // written at least once
    kAtomicWrite = 2,      // the last write was an atomic (atomics do not race with each other)
    kAsyncWrite = 4,       // a cp.async or TMA copy into it has not completed for its owner
    kAsyncProxyWrite = 16, // the last write came through the async proxy (TMA)
    kMbarrier = 32,        // holds an mbarrier object
  };

  void reset(size_t bytes);
  size_t size() const { return flags.size(); }

  // Column arrays, one entry per byte.
  std::vector<uint8_t> flags;
  std::vector<uint16_t> writer;
  std::vector<Clock> writeClock;
  std::vector<const void*> writePc;
  std::vector<uint16_t> readActor;  // kReadSlots per byte
  std::vector<Clock> readClock;
  std::vector<int32_t> asyncOp;     // the copy that owns the byte (kAsyncWrite), -1 none
  std::vector<uint8_t> asyncReads;  // wgmma operations in flight that read it
};

}  // namespace loom::emu
