// The CUDA tile programs (cuda.h, hopper.h and what the compiler generates
// for them) compiled as host C++ for loom's emulator (runtime/emu). The
// emulator's compiler includes this header first (-include) and defines
// LOOM_EMULATED; nothing of the tile code changes. It provides:
//   - the CUDA qualifiers and built-ins: threadIdx, blockIdx, blockDim,
//     gridDim (per CUDA thread: each runs as a fiber of the emulator),
//     __syncthreads, the __shfl_*_sync family, the math intrinsics the tiles
//     call (host libm), uint2, uint4, float2, float4;
//   - loom::ptx, the leaves of loom/tile/ptx.h: each instruction goes to the
//     emulator with its call site;
//   - the sanitizer-coverage hooks (clang -fsanitize-coverage=trace-loads,
//     trace-stores) through which the emulator sees every load and store of
//     the program, for its race, bounds, initialisation and alignment checks.
// The ABI these talk through is loom/tile/emu_abi.h.
#pragma once

#ifndef LOOM_EMULATED
#define LOOM_EMULATED 1
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "loom/tile/emu_abi.h"
#include "loom/half.h"

namespace loom {
typedef unsigned short Bits16;
typedef unsigned int Bits32;
typedef unsigned long long Bits64;
}  // namespace loom

//===--- CUDA qualifiers ----------------------------------------------------===//

#define __device__
#define __host__
#define __global__ __attribute__((visibility("default")))
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) alignas(n)
#define __shared__ static_assert(false, "__shared__ variables are not emulated: use loom::ptx::dynamicShared");

// The call site of an emulated instruction, for findings.
#define LOOM_EMU_PC __builtin_return_address(0)
#define LOOM_EMU_LEAF __attribute__((noinline, no_sanitize("coverage")))

namespace loom::emu {

inline const Api* api = nullptr;
inline thread_local const ThreadInfo* current = nullptr;

}  // namespace loom::emu

extern "C" __attribute__((visibility("default"), no_sanitize("coverage"))) void loom_emu_bind(
    const loom::emu::Api* api) {
  loom::emu::api = api;
}
extern "C" __attribute__((visibility("default"), no_sanitize("coverage"))) void loom_emu_set_thread(
    const loom::emu::ThreadInfo* thread) {
  loom::emu::current = thread;
}
extern "C" __attribute__((visibility("default"))) uint32_t loom_emu_abi_version() { return loom::emu::kAbiVersion; }

//===--- loads and stores ----------------------------------------------------===//

// Hidden: the program's own hooks, bound inside its shared object. Exported,
// a host process built with a sanitizer (whose runtime defines these names
// too) would take the calls, and the emulator would see no access.
#define LOOM_EMU_HOOK(kind, bytes, write)                                                                   \
  extern "C" __attribute__((visibility("hidden"), no_sanitize("coverage"))) void __sanitizer_cov_##kind##bytes( \
      void* address) {                                                                                      \
    if (loom::emu::current) loom::emu::api->access(address, bytes, write, LOOM_EMU_PC);                       \
  }
LOOM_EMU_HOOK(load, 1, 0)
LOOM_EMU_HOOK(load, 2, 0)
LOOM_EMU_HOOK(load, 4, 0)
LOOM_EMU_HOOK(load, 8, 0)
LOOM_EMU_HOOK(load, 16, 0)
LOOM_EMU_HOOK(store, 1, 1)
LOOM_EMU_HOOK(store, 2, 1)
LOOM_EMU_HOOK(store, 4, 1)
LOOM_EMU_HOOK(store, 8, 1)
LOOM_EMU_HOOK(store, 16, 1)
#undef LOOM_EMU_HOOK

//===--- built-in variables and vector types -------------------------------===//

#define threadIdx (::loom::emu::current->threadIdx)
#define blockIdx (::loom::emu::current->blockIdx)
#define blockDim (::loom::emu::current->blockDim)
#define gridDim (::loom::emu::current->gridDim)

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }

//===--- synchronisation and warp intrinsics -------------------------------===//

LOOM_EMU_LEAF inline void __syncthreads() { loom::emu::api->barSync(0, 0, LOOM_EMU_PC); }
LOOM_EMU_LEAF inline void __syncwarp(unsigned mask = 0xffffffffu) { loom::emu::api->warpSync(mask, LOOM_EMU_PC); }

namespace loom::emu {
// The `c` operand of shfl.sync as the CUDA intrinsics build it.
constexpr uint32_t shuffleClamp(int width, bool up) { return uint32_t(32 - width) << 8 | (up ? 0u : 0x1fu); }
template <class T>
inline uint32_t bitsOf(T value) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  uint32_t bits;
  __builtin_memcpy(&bits, &value, 4);
  return bits;
}
template <class T>
inline T fromBits(uint32_t bits) {
  T value;
  __builtin_memcpy(&value, &bits, 4);
  return value;
}
}  // namespace loom::emu

template <class T>
LOOM_EMU_LEAF T __shfl_xor_sync(unsigned mask, T value, int laneMask, int width = 32) {
  return loom::emu::fromBits<T>(loom::emu::api->shfl(loom::emu::kShuffleBfly, loom::emu::bitsOf(value), uint32_t(laneMask),
                                                     loom::emu::shuffleClamp(width, false), mask, LOOM_EMU_PC));
}
template <class T>
LOOM_EMU_LEAF T __shfl_sync(unsigned mask, T value, int srcLane, int width = 32) {
  return loom::emu::fromBits<T>(loom::emu::api->shfl(loom::emu::kShuffleIdx, loom::emu::bitsOf(value), uint32_t(srcLane),
                                                     loom::emu::shuffleClamp(width, false), mask, LOOM_EMU_PC));
}
template <class T>
LOOM_EMU_LEAF T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  return loom::emu::fromBits<T>(loom::emu::api->shfl(loom::emu::kShuffleUp, loom::emu::bitsOf(value), delta,
                                                     loom::emu::shuffleClamp(width, true), mask, LOOM_EMU_PC));
}
template <class T>
LOOM_EMU_LEAF T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  return loom::emu::fromBits<T>(loom::emu::api->shfl(loom::emu::kShuffleDown, loom::emu::bitsOf(value), delta,
                                                     loom::emu::shuffleClamp(width, false), mask, LOOM_EMU_PC));
}

//===--- math intrinsics (host libm) ---------------------------------------===//

inline float __int_as_float(int bits) { return loom::emu::fromBits<float>(uint32_t(bits)); }
inline int __float_as_int(float value) { return int(loom::emu::bitsOf(value)); }
inline float __uint_as_float(unsigned bits) { return loom::emu::fromBits<float>(bits); }
inline unsigned __float_as_uint(float value) { return loom::emu::bitsOf(value); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline void __sincosf(float x, float* sine, float* cosine) {
  *sine = std::sin(x);
  *cosine = std::cos(x);
}
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float x, float y) { return x / y; }
using std::exp2f;
using std::fmaxf;
using std::fminf;
using std::log2f;
using std::rint;

//===--- loom::ptx, emulated (the device build's leaves: loom/tile/ptx.h) --===//

namespace loom::ptx {

template <int Alignment>
LOOM_EMU_LEAF unsigned char* dynamicShared() {
  return emu::api->dynamicShared(Alignment, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline unsigned char* dynamicShared16() { return emu::api->dynamicShared(16, LOOM_EMU_PC); }
LOOM_EMU_LEAF inline Bits32 sharedAddress(const void* pointer) { return emu::api->sharedAddress(pointer, LOOM_EMU_PC); }

inline float halfToFloat(Bits16 bits) { return half::halfToFloat(bits); }
inline Bits16 floatToHalf(float value) { return half::floatToHalf(value); }
inline Bits16 floatToBfloat16(float value) { return half::floatToBfloat16(value); }
inline Bits32 packHalf2(float low, float high) {
  return Bits32(half::floatToHalf(low)) | Bits32(half::floatToHalf(high)) << 16;
}
inline Bits32 packBfloat162(float low, float high) {
  return Bits32(half::floatToBfloat16(low)) | Bits32(half::floatToBfloat16(high)) << 16;
}

LOOM_EMU_LEAF inline void ldmatrixX4(Bits32 (&r)[4], Bits32 address) {
  emu::api->ldmatrix(4, 0, r, address, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void ldmatrixX4Trans(Bits32 (&r)[4], Bits32 address) {
  emu::api->ldmatrix(4, 1, r, address, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void mmaF16(float (&d)[4], const Bits32 (&a)[4], Bits32 b0, Bits32 b1) {
  emu::api->mma16816(0, d, a, b0, b1, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void mmaBf16(float (&d)[4], const Bits32 (&a)[4], Bits32 b0, Bits32 b1) {
  emu::api->mma16816(1, d, a, b0, b1, LOOM_EMU_PC);
}

// m16n8k8: the m16n8k16 product whose k 8-15 are zeros (a0, a1 are A's
// k 0-7 in both layouts, b0 B's), the same sums.
LOOM_EMU_LEAF inline void mmaF16K8(float (&d)[4], Bits32 a0, Bits32 a1, Bits32 b0) {
  const Bits32 a[4] = {a0, a1, 0u, 0u};
  emu::api->mma16816(0, d, a, b0, 0u, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void mmaBf16K8(float (&d)[4], Bits32 a0, Bits32 a1, Bits32 b0) {
  const Bits32 a[4] = {a0, a1, 0u, 0u};
  emu::api->mma16816(1, d, a, b0, 0u, LOOM_EMU_PC);
}

LOOM_EMU_LEAF inline void cpAsyncCg16(void* destination, const void* source, bool valid) {
  emu::api->cpAsync(emu::api->sharedAddress(destination, LOOM_EMU_PC), source, 16, valid ? 16 : 0, 1, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void cpAsyncCg16(Bits32 destination, const void* source, bool valid) {
  emu::api->cpAsync(destination, source, 16, valid ? 16 : 0, 1, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void cpAsyncCg16(Bits32 destination, const void* source) {
  emu::api->cpAsync(destination, source, 16, 16, 1, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void cpAsyncCa4(void* destination, const void* source, bool valid) {
  emu::api->cpAsync(emu::api->sharedAddress(destination, LOOM_EMU_PC), source, 4, valid ? 4 : 0, 0, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void cpAsyncCommit() { emu::api->cpAsyncCommit(LOOM_EMU_PC); }
template <int Pending>
LOOM_EMU_LEAF void cpAsyncWait() {
  emu::api->cpAsyncWait(Pending, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void redSharedAddF32(Bits32 address, float value) {
  emu::api->redSharedAddF32(address, value, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void redGlobalAddF32(float* address, float value) {
  emu::api->redGlobalAddF32(address, value, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void bulkReduceAddF32(float* global, Bits32 source, Bits32 bytes) {
  emu::api->bulkReduceAddF32(global, source, bytes, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void bulkCommit() { emu::api->bulkCommit(LOOM_EMU_PC); }
template <int Pending>
LOOM_EMU_LEAF void bulkWaitRead() {
  emu::api->bulkWait(Pending, 1, LOOM_EMU_PC);
}
template <int Pending>
LOOM_EMU_LEAF void bulkWait() {
  emu::api->bulkWait(Pending, 0, LOOM_EMU_PC);
}

template <int Id, int Threads>
LOOM_EMU_LEAF inline void barSync() {
  emu::api->barSync(Id, Threads, LOOM_EMU_PC);
}
template <int Threads>
LOOM_EMU_LEAF inline void barSyncId(int id) {
  emu::api->barSync(id, Threads, LOOM_EMU_PC);
}
template <int Threads>
LOOM_EMU_LEAF inline void barArriveId(int id) {
  emu::api->barArrive(id, Threads, LOOM_EMU_PC);
}
// st.shared.f32 at a shared-window address: an ordinary store into the
// CTA's shared memory (not a leaf, so the emulator checks it as any other).
inline void stSharedF32(Bits32 address, float value) {
  unsigned char* base = dynamicShared<16>();
  *reinterpret_cast<float*>(base + (address - sharedAddress(base))) = value;
}
// ld.shared.v2.f32: an ordinary load, checked as any other.
inline float2 ldSharedF32x2(Bits32 address) {
  unsigned char* base = dynamicShared<16>();
  return *reinterpret_cast<const float2*>(base + (address - sharedAddress(base)));
}
// st.global.v2 / v4: one 8- or 16-byte store (not a leaf: the emulator
// checks it as any other).
inline void storeGlobal(void* to, Bits32 x, Bits32 y) { *static_cast<uint2*>(to) = uint2{x, y}; }
inline void storeGlobal(void* to, Bits32 x, Bits32 y, Bits32 z, Bits32 w) {
  *static_cast<uint4*>(to) = uint4{x, y, z, w};
}
// ex2.approx.ftz.f32: subnormal inputs and results flushed to zero (the
// host's exp2 stands for the special-function unit's approximation).
inline float exp2Ftz(float x) {
  if (std::fabs(x) < 1.17549435e-38f) x = 0.0f;
  const float y = std::exp2(x);
  return y < 1.17549435e-38f ? 0.0f : y;
}
LOOM_EMU_LEAF inline void mbarrierInit(Bits32 bar, unsigned count) { emu::api->mbarrierInit(bar, count, LOOM_EMU_PC); }
LOOM_EMU_LEAF inline void mbarrierArrive(Bits32 bar) { emu::api->mbarrierArrive(bar, -1, LOOM_EMU_PC); }
LOOM_EMU_LEAF inline void mbarrierArriveExpectTx(Bits32 bar, unsigned bytes) {
  emu::api->mbarrierArrive(bar, int64_t(bytes), LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void mbarrierWaitParity(Bits32 bar, int parity) {
  emu::api->mbarrierWaitParity(bar, parity, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void fenceMbarrierInit() { emu::api->fenceMbarrierInit(LOOM_EMU_PC); }
LOOM_EMU_LEAF inline void fenceProxyAsync() { emu::api->fenceProxyAsync(LOOM_EMU_PC); }

LOOM_EMU_LEAF inline void tmaLoad3d(Bits32 destination, const void* map, int c0, int c1, int c2, Bits32 bar) {
  const int32_t coordinates[3] = {c0, c1, c2};
  emu::api->tmaLoad(destination, map, coordinates, 3, bar, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void tmaLoad4d(Bits32 destination, const void* map, int c0, int c1, int c2, int c3, Bits32 bar) {
  const int32_t coordinates[4] = {c0, c1, c2, c3};
  emu::api->tmaLoad(destination, map, coordinates, 4, bar, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void tmaLoad2d(Bits32 destination, const void* map, int c0, int c1, Bits32 bar) {
  const int32_t coordinates[2] = {c0, c1};
  emu::api->tmaLoad(destination, map, coordinates, 2, bar, LOOM_EMU_PC);
}

LOOM_EMU_LEAF inline void wgmmaFence() { emu::api->wgmmaFence(LOOM_EMU_PC); }
LOOM_EMU_LEAF inline void wgmmaCommit() { emu::api->wgmmaCommit(LOOM_EMU_PC); }
template <int Pending>
LOOM_EMU_LEAF void wgmmaWait() {
  emu::api->wgmmaWait(Pending, LOOM_EMU_PC);
}
LOOM_EMU_LEAF inline void wgmmaMmaAsync(bool bfloat16, int n, float* d, Bits64 aDesc, const unsigned* aRegisters,
                                        Bits64 bDesc, bool scaleD, bool transposeA, bool transposeB) {
  emu::api->wgmmaMmaAsync(bfloat16, n, d, aDesc, aRegisters, bDesc, scaleD, transposeA, transposeB, LOOM_EMU_PC);
}
// The accumulators stay in memory across every emulated call, so there is
// nothing to pin.
template <int N>
inline void pinRegisters(float (&)[N]) {}
template <int Count>
LOOM_EMU_LEAF void setmaxnregDec() {
  emu::api->setmaxnreg(0, Count, LOOM_EMU_PC);
}
template <int Count>
LOOM_EMU_LEAF void setmaxnregInc() {
  emu::api->setmaxnreg(1, Count, LOOM_EMU_PC);
}

}  // namespace loom::ptx
