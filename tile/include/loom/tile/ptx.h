// Every PTX instruction the CUDA tile implementations (cuda.h, hopper.h,
// wgmma.h) use, each in exactly one function: nothing else in the tile
// headers holds assembly.
//
// NVRTC compiles the inline assembly below. loom's emulator compiles the
// same tile code as host C++ with LOOM_EMULATED defined; then these leaves
// come from loom/tile/emu.h, which hands each instruction to the emulator,
// where it runs as the PTX ISA defines it (runtime/emu).
#pragma once

#include "loom/tile/common.h"

namespace loom {

typedef unsigned short Bits16;
typedef unsigned int Bits32;
typedef unsigned long long Bits64;

}  // namespace loom

#ifdef LOOM_EMULATED
#include "loom/tile/emu.h"
#else

namespace loom::ptx {

//===--- shared memory ----------------------------------------------------===//

// The CTA's dynamic shared memory (declared `Alignment`-aligned; code that
// needs more aligns it itself).
template <int Alignment>
__device__ __forceinline__ unsigned char* dynamicShared() {
  extern __shared__ __align__(Alignment) unsigned char loom_shared[];
  return loom_shared;
}

// The same memory under a name of its own, 16-byte aligned: for the code
// both engines share (each declares its own at another alignment).
__device__ __forceinline__ unsigned char* dynamicShared16() {
  extern __shared__ __align__(16) unsigned char loom_shared16[];
  return loom_shared16;
}

// cvta.to.shared: the 32-bit shared-window address of a generic pointer.
__device__ __forceinline__ Bits32 sharedAddress(const void* pointer) {
  Bits32 address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
  return address;
}

//===--- wide global stores -----------------------------------------------===//
// One 8- or 16-byte store of registers computed apart (the compiler splits
// a vector built from them into 32-bit stores). `to` is a global address,
// aligned as wide as the store.

__device__ __forceinline__ void storeGlobal(void* to, Bits32 x, Bits32 y) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(to), "r"(x), "r"(y) : "memory");
}
__device__ __forceinline__ void storeGlobal(void* to, Bits32 x, Bits32 y, Bits32 z, Bits32 w) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(to), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}

//===--- conversions ------------------------------------------------------===//

__device__ __forceinline__ float halfToFloat(Bits16 bits) {
  float value;
  asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
  return value;
}
__device__ __forceinline__ Bits16 floatToHalf(float value) {
  Bits16 bits;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return bits;
}
__device__ __forceinline__ Bits16 floatToBfloat16(float value) {
  Bits16 bits;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return bits;
}
// Two floats into one register: `low` in bits 0-15.
__device__ __forceinline__ Bits32 packHalf2(float low, float high) {
  Bits32 packed;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
  return packed;
}
__device__ __forceinline__ Bits32 packBfloat162(float low, float high) {
  Bits32 packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
  return packed;
}

//===--- warp-level matrix instructions (sm_80) ---------------------------===//

__device__ __forceinline__ void ldmatrixX4(Bits32 (&r)[4], Bits32 address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrixX4Trans(Bits32 (&r)[4], Bits32 address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// d += a (16x16, row) * b (16x8, col), f32 accumulators.
__device__ __forceinline__ void mmaF16(float (&d)[4], const Bits32 (&a)[4], Bits32 b0, Bits32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mmaBf16(float (&d)[4], const Bits32 (&a)[4], Bits32 b0, Bits32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a (16x8, row) * b (8x8, col), f32 accumulators: half of m16n8k16's
// tensor work, for products whose k is at most 8.
__device__ __forceinline__ void mmaF16K8(float (&d)[4], Bits32 a0, Bits32 a1, Bits32 b0) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(b0));
}
__device__ __forceinline__ void mmaBf16K8(float (&d)[4], Bits32 a0, Bits32 a1, Bits32 b0) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(b0));
}

//===--- asynchronous copies and atomics -----------------------------------===//

// 16 bytes global -> shared; `valid` false zero-fills the destination.
__device__ __forceinline__ void cpAsyncCg16(void* destination, const void* source, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sharedAddress(destination)), "l"(source),
               "r"(valid ? 16 : 0));
}
// The same at a 32-bit shared-window address (a base plus a constant takes
// the instruction's immediate), with and without the zero fill.
__device__ __forceinline__ void cpAsyncCg16(Bits32 destination, const void* source, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(destination), "l"(source), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cpAsyncCg16(Bits32 destination, const void* source) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(destination), "l"(source));
}
// 4 bytes global -> shared (through L1: .cg takes 16 only); `valid` false
// zero-fills the destination.
__device__ __forceinline__ void cpAsyncCa4(void* destination, const void* source, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(sharedAddress(destination)), "l"(source),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cpAsyncCommit() { asm volatile("cp.async.commit_group;"); }
template <int Pending>
__device__ __forceinline__ void cpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending));
}
__device__ __forceinline__ void redSharedAddF32(Bits32 address, float value) {
  asm volatile("red.shared.add.f32 [%0], %1;" ::"r"(address), "f"(value) : "memory");
}
__device__ __forceinline__ void redGlobalAddF32(float* address, float value) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(address), "f"(value) : "memory");
}
// sm_90: `bytes` (a multiple of 16) of f32 at a shared-window address added
// into global memory by the async proxy, in the thread's bulk group; the
// source is read until a bulk wait with .read covers the group.
__device__ __forceinline__ void bulkReduceAddF32(float* global, Bits32 source, Bits32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(global),
               "r"(source), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulkCommit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void bulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(Pending) : "memory");
}
template <int Pending>
__device__ __forceinline__ void bulkWait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(Pending) : "memory");
}

// st.shared.f32 at a 32-bit shared-window address.
__device__ __forceinline__ void stSharedF32(Bits32 address, float value) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(address), "f"(value) : "memory");
}
// ld.shared.v2.f32 at one (8-byte aligned): no generic address to form.
__device__ __forceinline__ float2 ldSharedF32x2(Bits32 address) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(address) : "memory");
  return v;
}

//===--- the special-function unit -------------------------------------------===//

// 2^x on the special-function unit, subnormal inputs and results flushed to
// zero: one MUFU.EX2 (without .ftz ptxas wraps each in a range check and two
// predicated multiplies). Relative error within 2^-22; a result below
// 2^-126 is 0, which a softmax's exponentials of x - max lose nothing to.
__device__ __forceinline__ float exp2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

//===--- barriers, mbarriers, fences (sm_90) --------------------------------===//

// Named barrier `Id` of `Threads` threads, both immediates.
template <int Id, int Threads>
__device__ __forceinline__ void barSync() {
  asm volatile("bar.sync %0, %1;" ::"n"(Id), "n"(Threads) : "memory");
}
// Named barrier `id` (a warp-uniform register: no branch picks among
// immediates, and none may stand between wgmma instructions) of `Threads`
// threads; bar.arrive counts toward it without waiting.
template <int Threads>
__device__ __forceinline__ void barSyncId(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(Threads) : "memory");
}
template <int Threads>
__device__ __forceinline__ void barArriveId(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(Threads) : "memory");
}
__device__ __forceinline__ void mbarrierInit(Bits32 bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrierArrive(Bits32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrierArriveExpectTx(Bits32 bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Blocks until the phase with parity `parity` has completed.
__device__ __forceinline__ void mbarrierWaitParity(Bits32 bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nLOOM_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra LOOM_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void fenceMbarrierInit() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Ordinary shared-memory stores become visible to wgmma and TMA.
__device__ __forceinline__ void fenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

//===--- the tensor memory accelerator --------------------------------------===//

// One box of a 3-d tensor map into shared memory, completing on `bar`.
__device__ __forceinline__ void tmaLoad3d(Bits32 destination, const void* map, int c0, int c1, int c2, Bits32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::
          "r"(destination),
      "l"(reinterpret_cast<Bits64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// The same of a 4-d map (the wgmma backward's tiles: every atom of a row
// block in one box) and of a 2-d one (its rows' lse and D planes).
__device__ __forceinline__ void tmaLoad4d(Bits32 destination, const void* map, int c0, int c1, int c2, int c3,
                                          Bits32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];" ::"r"(destination),
      "l"(reinterpret_cast<Bits64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tmaLoad2d(Bits32 destination, const void* map, int c0, int c1, Bits32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          destination),
      "l"(reinterpret_cast<Bits64>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

//===--- wgmma bookkeeping and register hand-over (the products: wgmma.h) ---===//

__device__ __forceinline__ void wgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void wgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(Pending) : "memory");
}
// Keeps the compiler from moving accumulator accesses across a wgmma
// fence / wait.
template <int N>
__device__ __forceinline__ void pinRegisters(float (&r)[N]) {
  #pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int Count>
__device__ __forceinline__ void setmaxnregDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Count));
}
template <int Count>
__device__ __forceinline__ void setmaxnregInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Count));
}

}  // namespace loom::ptx

#endif  // LOOM_EMULATED
