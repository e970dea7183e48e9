// The contract between a CUDA tile program compiled for loom's emulator (see
// loom/tile/emu.h, the program's side) and the emulator that runs it
// (runtime/emu). The program exports two functions:
//   void loom_emu_bind(const loom::emu::Api*): the emulator's entry points;
//   void loom_emu_set_thread(const loom::emu::ThreadInfo*): called before
//     each switch to a CUDA thread's fiber, so threadIdx and friends read it.
// Every emulated instruction passes the program counter of its call site,
// so findings can name the source line. Plain C types only: both sides are
// compiled separately.
#pragma once

#include <cstdint>

namespace loom::emu {

constexpr uint32_t kAbiVersion = 5;

struct Dim3 {
  unsigned x, y, z;
};

// What a CUDA thread reads of itself.
struct ThreadInfo {
  Dim3 threadIdx, blockIdx, blockDim, gridDim;
};

// shfl.sync modes, as the PTX ISA numbers them.
enum ShuffleMode : int { kShuffleUp = 0, kShuffleDown = 1, kShuffleBfly = 2, kShuffleIdx = 3 };

struct Api {
  uint32_t version;
  // Loads and stores of the program's own code (sanitizer coverage hooks):
  // `size` bytes at `address`; shared, global and register state is checked.
  void (*access)(const void* address, uint32_t size, int write, const void* pc);

  unsigned char* (*dynamicShared)(int alignment, const void* pc);
  uint32_t (*sharedAddress)(const void* pointer, const void* pc);

  // bar.sync id, threads (threads 0: every thread of the CTA, __syncthreads).
  void (*barSync)(int id, int threads, const void* pc);
  // shfl.sync.mode.b32 d, a, b, c, membermask.
  uint32_t (*shfl)(int mode, uint32_t a, uint32_t b, uint32_t c, uint32_t membermask, const void* pc);
  // elect.sync: the elected lane; every lane of `membermask` calls it.
  uint32_t (*elect)(uint32_t membermask, const void* pc);

  // ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16.
  void (*ldmatrix)(int matrices, int transpose, uint32_t* registers, uint32_t address, const void* pc);
  // mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, D = C = d.
  void (*mma16816)(int bfloat16, float* d, const uint32_t* a, uint32_t b0, uint32_t b1, const void* pc);

  // cp.async.{ca,cg}.shared.global [dst], [src], cpSize, srcSize.
  void (*cpAsync)(uint32_t destination, const void* source, int cpSize, int srcSize, int cacheGlobal, const void* pc);
  void (*cpAsyncCommit)(const void* pc);
  void (*cpAsyncWait)(int pending, const void* pc);
  // red.shared.add.f32.
  void (*redSharedAddF32)(uint32_t address, float value, const void* pc);

  void (*mbarrierInit)(uint32_t address, uint32_t count, const void* pc);
  // mbarrier.arrive (expectTx < 0) or mbarrier.arrive.expect_tx (expectTx bytes).
  void (*mbarrierArrive)(uint32_t address, int64_t expectTx, const void* pc);
  // Blocks until the phase of parity `parity` has completed
  // (a loop of mbarrier.try_wait.parity).
  void (*mbarrierWaitParity)(uint32_t address, int parity, const void* pc);
  void (*fenceMbarrierInit)(const void* pc);
  void (*fenceProxyAsync)(const void* pc);

  // cp.async.bulk.tensor.{rank}d.shared::cluster.global.mbarrier::complete_tx::bytes.
  void (*tmaLoad)(uint32_t destination, const void* tensorMap, const int32_t* coordinates, int rank, uint32_t bar,
                  const void* pc);

  void (*wgmmaFence)(const void* pc);
  void (*wgmmaCommit)(const void* pc);
  void (*wgmmaWait)(int pending, const void* pc);
  // wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{f16,bf16}: A from the
  // descriptor aDesc or, when aRegisters is set, from four registers.
  void (*wgmmaMmaAsync)(int bfloat16, int n, float* d, uint64_t aDesc, const uint32_t* aRegisters, uint64_t bDesc,
                        int scaleD, int transposeA, int transposeB, const void* pc);
  // setmaxnreg.{inc,dec}.sync.aligned.u32 count.
  void (*setmaxnreg)(int increase, int count, const void* pc);

  // red.global.add.f32 [address], value: atomic against every CTA's.
  void (*redGlobalAddF32)(float* address, float value, const void* pc);
  // bar.arrive id, threads: counts toward the barrier without waiting.
  void (*barArrive)(int id, int threads, const void* pc);
  // bar.warp.sync membermask (__syncwarp): the member lanes' accesses so far
  // happen before each member's next.
  void (*warpSync)(uint32_t membermask, const void* pc);
  // cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [global],
  // [shared], bytes; cp.async.bulk.commit_group; cp.async.bulk.wait_group
  // (read: .read) pending.
  void (*bulkReduceAddF32)(float* global, uint32_t shared, uint32_t bytes, const void* pc);
  void (*bulkCommit)(const void* pc);
  void (*bulkWait)(int pending, int read, const void* pc);
};

}  // namespace loom::emu
