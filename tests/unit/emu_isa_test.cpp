// The emulator's instructions against the PTX ISA's own descriptions: the
// fragment layouts of ldmatrix and mma.sync as the ISA's figures give them
// (groupID = lane / 4, threadID_in_group = lane % 4), shfl.sync as the CUDA
// intrinsics define their lanes, bar.sync with thread counts, cp.async
// groups, mbarrier phases and transaction counts, tensor-map loads with
// out-of-bounds fill and swizzles, wgmma through matrix descriptors in every
// canonical layout, fences, setmaxnreg, elect.sync, global reductions and
// bulk reductions from shared memory.
// Each test runs a small CTA on the emulator, calling the instructions
// through the same table the emulated programs call.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "emu/cta.h"
#include "emu/instructions.h"
#include "emu/tensor_map.h"
#include "loom/half.h"
#include "test_util.h"

namespace loom::emu {
namespace {

const Api& isa() { return api(); }
int tid() { return Cta::current()->self().index; }
Cta& cta() { return *Cta::current(); }

struct Outcome {
  FindingLog log;
  std::vector<Finding> findings() const { return log.findings(); }
  bool has(FindingKind kind) const {
    for (const Finding& f : log.findings())
      if (f.kind == kind) return true;
    return false;
  }
  std::string text() const {
    std::string all;
    for (const Finding& f : log.findings()) all += format(f) + "\n";
    return all;
  }
};

// Runs `body` as every thread of a CTA of `threads`, with `shared` bytes of
// shared memory (a window base of 256) and, when given, global buffers.
void runCta(Outcome& run, int threads, int64_t shared, const std::function<void()>& body, GlobalMemory* global = nullptr,
            uint64_t seed = 1, const std::function<void(Cta&)>& before = {}) {
  CtaConfig config;
  config.threads = threads;
  config.sharedBytes = shared;
  config.sharedWindowBase = 256;
  config.findings = &run.log;
  config.global = global;
  config.seed = seed;
  Cta c(config);
  if (before) before(c);
  c.run(body);
}

uint32_t sharedAddress(int64_t offset) { return uint32_t(cta().sharedWindowBase() + offset); }

//===--- ldmatrix ------------------------------------------------------------===//

// Element (row, column) of 8x8 matrix m, as a recognisable 16-bit value.
uint16_t tag(int m, int row, int column) { return uint16_t(m * 64 + row * 8 + column + 1); }

TEST(EmuIsa, LdmatrixFragmentsFollowTheIsaFigure) {
  for (int matrices : {1, 2, 4})
    for (int transpose : {0, 1}) {
      Outcome run;
      std::vector<std::array<uint32_t, 4>> got(32);
      runCta(run, 32, 4096, [&] {
        const int lane = tid();
        if (lane == 0) {
          // Rows scattered: matrix m's row r at 16 * (3 * (8m + r) + 1) bytes.
          for (int m = 0; m < 4; ++m)
            for (int r = 0; r < 8; ++r)
              for (int c = 0; c < 8; ++c) {
                const uint16_t v = tag(m, r, c);
                std::memcpy(cta().shared() + 16 * (3 * (8 * m + r) + 1) + 2 * c, &v, 2);
                isa().access(cta().shared() + 16 * (3 * (8 * m + r) + 1) + 2 * c, 2, 1, nullptr);
              }
        }
        isa().barSync(0, 0, nullptr);
        // Threads 8m..8m+7 give the rows of matrix m; the others a bad
        // address the instruction must ignore.
        const bool provides = lane < 8 * matrices;
        const uint32_t address = provides ? sharedAddress(16 * (3 * lane + 1)) : 3;
        uint32_t r[4] = {};
        isa().ldmatrix(matrices, transpose, r, address, nullptr);
        std::copy(r, r + 4, got[size_t(lane)].begin());
      });
      ASSERT_TRUE(run.log.empty()) << run.text();
      for (int lane = 0; lane < 32; ++lane) {
        const int groupID = lane >> 2, threadInGroup = lane % 4;
        for (int m = 0; m < matrices; ++m) {
          // Each thread holds two consecutive elements of row groupID
          // (columns 2t, 2t+1); transposed, of column groupID (rows 2t, 2t+1).
          const uint16_t first = transpose ? tag(m, 2 * threadInGroup, groupID) : tag(m, groupID, 2 * threadInGroup);
          const uint16_t second =
              transpose ? tag(m, 2 * threadInGroup + 1, groupID) : tag(m, groupID, 2 * threadInGroup + 1);
          EXPECT_EQ(got[size_t(lane)][size_t(m)], uint32_t(first) | uint32_t(second) << 16)
              << "x" << matrices << (transpose ? ".trans" : "") << " lane " << lane << " matrix " << m;
        }
      }
    }
}

TEST(EmuIsa, LdmatrixRowAddressesMustBeAlignedAndInside) {
  Outcome run;
  runCta(run, 32, 1024, [&] {
    uint32_t r[4];
    isa().ldmatrix(1, 0, r, tid() == 3 ? sharedAddress(8) : sharedAddress(0), nullptr);
  });
  EXPECT_TRUE(run.has(FindingKind::misaligned)) << run.text();
  Outcome outside;
  runCta(outside, 32, 1024, [&] {
    uint32_t r[4];
    isa().ldmatrix(1, 0, r, sharedAddress(1024), nullptr);
  });
  EXPECT_TRUE(outside.has(FindingKind::outOfBounds)) << outside.text();
}

//===--- mma.sync m16n8k16 ---------------------------------------------------===//

// The ISA's fragment layouts for .m16n8k16 with .f16 / .bf16 (groupID =
// laneid >> 2, threadID_in_group = laneid % 4):
//   A a_i, i = 0..7: row groupID for i in {0,1,4,5}, else groupID + 8;
//                    col threadID_in_group * 2 + (i & 1), + 8 for i >= 4.
//   B b_i, i = 0..3: row threadID_in_group * 2 + (i & 1), + 8 for i >= 2; col groupID.
//   C c_i, i = 0..3: row groupID, + 8 for i >= 2; col threadID_in_group * 2 + (i & 1).
void aPosition(int lane, int i, int* row, int* col) {
  *row = (lane >> 2) + ((i == 2 || i == 3 || i == 6 || i == 7) ? 8 : 0);
  *col = (lane % 4) * 2 + (i & 1) + (i >= 4 ? 8 : 0);
}
void bPosition(int lane, int i, int* row, int* col) {
  *row = (lane % 4) * 2 + (i & 1) + (i >= 2 ? 8 : 0);
  *col = lane >> 2;
}
void cPosition(int lane, int i, int* row, int* col) {
  *row = (lane >> 2) + (i >= 2 ? 8 : 0);
  *col = (lane % 4) * 2 + (i & 1);
}

TEST(EmuIsa, MmaM16n8k16MatchesAProductOfTheIsaFragments) {
  std::mt19937_64 rng(testing::testSeed());
  std::normal_distribution<double> normal;
  for (int bf16 : {0, 1}) {
    double A[16][16], B[16][8], C[16][8];
    uint16_t Ab[16][16], Bb[16][8];
    for (int i = 0; i < 16; ++i)
      for (int k = 0; k < 16; ++k) {
        Ab[i][k] = bf16 ? half::floatToBfloat16(float(normal(rng))) : half::floatToHalf(float(normal(rng)));
        A[i][k] = bf16 ? half::bfloat16ToFloat(Ab[i][k]) : half::halfToFloat(Ab[i][k]);
      }
    for (int k = 0; k < 16; ++k)
      for (int j = 0; j < 8; ++j) {
        Bb[k][j] = bf16 ? half::floatToBfloat16(float(normal(rng))) : half::floatToHalf(float(normal(rng)));
        B[k][j] = bf16 ? half::bfloat16ToFloat(Bb[k][j]) : half::halfToFloat(Bb[k][j]);
      }
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 8; ++j) C[i][j] = float(normal(rng));
    std::vector<std::array<float, 4>> d(32);
    Outcome run;
    runCta(run, 32, 0, [&] {
      const int lane = tid();
      uint32_t a[4], b[2];
      uint16_t halves[8];
      for (int i = 0; i < 8; ++i) {
        int row, col;
        aPosition(lane, i, &row, &col);
        halves[i] = Ab[row][col];
      }
      for (int r = 0; r < 4; ++r) a[r] = uint32_t(halves[2 * r]) | uint32_t(halves[2 * r + 1]) << 16;
      for (int i = 0; i < 4; ++i) {
        int row, col;
        bPosition(lane, i, &row, &col);
        halves[i] = Bb[row][col];
      }
      for (int r = 0; r < 2; ++r) b[r] = uint32_t(halves[2 * r]) | uint32_t(halves[2 * r + 1]) << 16;
      float c[4];
      for (int i = 0; i < 4; ++i) {
        int row, col;
        cPosition(lane, i, &row, &col);
        c[i] = float(C[row][col]);
      }
      isa().mma16816(bf16, c, a, b[0], b[1], nullptr);
      std::copy(c, c + 4, d[size_t(lane)].begin());
    });
    ASSERT_TRUE(run.log.empty()) << run.text();
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) {
        int row, col;
        cPosition(lane, i, &row, &col);
        double expected = float(C[row][col]);
        for (int k = 0; k < 16; ++k) expected += A[row][k] * B[k][col];
        EXPECT_NEAR(d[size_t(lane)][size_t(i)], expected, 1e-5 * (1 + std::abs(expected)))
            << (bf16 ? "bf16" : "f16") << " lane " << lane << " c" << i;
      }
  }
}

TEST(EmuIsa, AWarpThatDivergesAtMmaIsFound) {
  Outcome run;
  runCta(run, 32, 0, [&] {
    float d[4] = {};
    const uint32_t a[4] = {};
    if (tid() < 16) isa().mma16816(0, d, a, 0, 0, nullptr);
    else isa().shfl(kShuffleBfly, 0, 1, 0x1f, 0xffffffffu, nullptr);
  });
  EXPECT_TRUE(run.has(FindingKind::divergence)) << run.text();
}

//===--- shfl.sync -------------------------------------------------------------===//

// The CUDA intrinsics' lanes: width-sized segments; up / down stay inside the
// segment (else the own value), xor reads higher segments' own value, idx
// wraps the source lane into the segment.
int expectedSource(int mode, int lane, int b, int width) {
  const int segment = lane / width * width;
  switch (mode) {
    case kShuffleUp: return lane % width >= b ? lane - b : lane;
    case kShuffleDown: return lane % width + b < width ? lane + b : lane;
    case kShuffleBfly: return (lane ^ b) < segment + width ? lane ^ b : lane;
    default: return segment + b % width;
  }
}

TEST(EmuIsa, ShuffleModesWidthsAndMembers) {
  for (int mode : {kShuffleUp, kShuffleDown, kShuffleBfly, kShuffleIdx})
    for (int width : {32, 16, 8, 4})
      for (int b : {0, 1, 3, 5, 17}) {
        Outcome run;
        std::vector<uint32_t> got(32);
        runCta(run, 32, 0, [&] {
          const int lane = tid();
          const uint32_t c = uint32_t(32 - width) << 8 | (mode == kShuffleUp ? 0u : 0x1fu);
          got[size_t(lane)] = isa().shfl(mode, 1000u + uint32_t(lane), uint32_t(b), c, 0xffffffffu, nullptr);
        });
        ASSERT_TRUE(run.log.empty()) << run.text();
        for (int lane = 0; lane < 32; ++lane)
          EXPECT_EQ(got[size_t(lane)], 1000u + uint32_t(expectedSource(mode, lane, b, width)))
              << "mode " << mode << " width " << width << " b " << b << " lane " << lane;
      }
}

TEST(EmuIsa, ShuffleMemberMasks) {
  Outcome run;
  std::vector<uint32_t> got(32, 0);
  runCta(run, 32, 0, [&] {
    const int lane = tid();
    // Two halves shuffle apart, each with its own member mask.
    const uint32_t mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    got[size_t(lane)] = isa().shfl(kShuffleBfly, uint32_t(lane), 1, 0x1f, mask, nullptr);
  });
  EXPECT_TRUE(run.log.empty()) << run.text();
  for (int lane = 0; lane < 32; ++lane) EXPECT_EQ(got[size_t(lane)], uint32_t(lane ^ 1));
  Outcome outside;
  runCta(outside, 32, 0, [&] {
    if (tid() < 16) isa().shfl(kShuffleIdx, 0, 20, 0x1f, 0x0000ffffu, nullptr);  // reads lane 20, not a member
  });
  EXPECT_TRUE(outside.has(FindingKind::divergence)) << outside.text();
}

TEST(EmuIsa, ElectPicksTheLowestMember) {
  Outcome run;
  std::vector<uint32_t> got(32, 99);
  runCta(run, 32, 0, [&] {
    if (tid() >= 5) got[size_t(tid())] = isa().elect(0xffffffe0u, nullptr);
  });
  EXPECT_TRUE(run.log.empty()) << run.text();
  for (int lane = 5; lane < 32; ++lane) EXPECT_EQ(got[size_t(lane)], 5u);
}

//===--- bar.sync -------------------------------------------------------------===//

TEST(EmuIsa, NamedBarriersOrderTheirThreadsOnly) {
  // Warps 0-1 meet at barrier 1 (64 threads), warps 2-3 at barrier 2: what
  // warp 0 wrote before barrier 1, warp 1 may read after it.
  Outcome ordered;
  runCta(ordered, 128, 1024, [&] {
    const int t = tid();
    if (t < 32) isa().access(cta().shared() + 4 * t, 4, 1, nullptr);
    if (t < 64) isa().barSync(1, 64, nullptr);
    else isa().barSync(2, 64, nullptr);
    if (t >= 32 && t < 64) isa().access(cta().shared() + 4 * (t - 32), 4, 0, nullptr);
  });
  EXPECT_TRUE(ordered.log.empty()) << ordered.text();
  // Warp 2 reading warp 0's writes is not ordered by barrier 2.
  Outcome racy;
  runCta(racy, 128, 1024, [&] {
    const int t = tid();
    if (t < 32) isa().access(cta().shared() + 4 * t, 4, 1, nullptr);
    if (t < 64) isa().barSync(1, 64, nullptr);
    else isa().barSync(2, 64, nullptr);
    if (t >= 64 && t < 96) isa().access(cta().shared() + 4 * (t - 64), 4, 0, nullptr);
  });
  EXPECT_TRUE(racy.has(FindingKind::race)) << racy.text();
}

TEST(EmuIsa, BarrierMisuseIsFound) {
  Outcome counts;
  runCta(counts, 64, 0, [&] { isa().barSync(1, tid() < 32 ? 64 : 96, nullptr); });
  EXPECT_TRUE(counts.has(FindingKind::invalidOperand) || counts.has(FindingKind::barrier)) << counts.text();
  Outcome halfWarp;  // 16 threads of warp 0 and all of warp 1: 48 of 64 never completes
  runCta(halfWarp, 64, 0, [&] {
    if (tid() >= 16) isa().barSync(0, 0, nullptr);
  });
  EXPECT_TRUE(halfWarp.has(FindingKind::deadlock)) << halfWarp.text();
  Outcome divergent;  // 64 threads reach a 64-thread barrier, but half of warp 0 and half of warp 2
  runCta(divergent, 96, 0, [&] {
    const int t = tid();
    if ((t >= 16 && t < 64) || (t >= 64 && t < 80)) isa().barSync(3, 64, nullptr);
  });
  EXPECT_TRUE(divergent.has(FindingKind::barrier)) << divergent.text();
}

//===--- cp.async ------------------------------------------------------------===//

TEST(EmuIsa, CpAsyncCopiesZeroFillsAndCompletesByGroup) {
  GlobalMemory global;
  unsigned char* source = global.allocate("src", 256, true);
  for (int i = 0; i < 256; ++i) source[i] = uint8_t(i);
  Outcome run;
  std::vector<unsigned char> seen(64);
  runCta(run, 32, 1024, [&] {
    if (tid() != 0) return;
    // Three groups: 16 bytes (.cg), 8 of 16 bytes then zeros, 4 bytes (.ca).
    isa().cpAsync(sharedAddress(0), source, 16, 16, 1, nullptr);
    isa().cpAsyncCommit(nullptr);
    isa().cpAsync(sharedAddress(16), source + 32, 16, 8, 1, nullptr);
    isa().cpAsyncCommit(nullptr);
    isa().cpAsync(sharedAddress(48), source + 100, 4, 4, 0, nullptr);
    isa().cpAsyncCommit(nullptr);
    isa().cpAsyncWait(1, nullptr);  // the first two groups are done; the third may not be
    for (int i = 0; i < 32; ++i) isa().access(cta().shared() + i, 1, 0, nullptr);
    isa().cpAsyncWait(0, nullptr);
    isa().access(cta().shared() + 48, 4, 0, nullptr);
    std::memcpy(seen.data(), cta().shared(), 64);
  }, &global);
  EXPECT_TRUE(run.log.empty()) << run.text();
  for (int i = 0; i < 16; ++i) EXPECT_EQ(seen[size_t(i)], i);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(seen[size_t(16 + i)], 32 + i);
  for (int i = 8; i < 16; ++i) EXPECT_EQ(seen[size_t(16 + i)], 0) << "zero-filled past src-size";
  for (int i = 0; i < 4; ++i) EXPECT_EQ(seen[size_t(48 + i)], 100 + i);
}

TEST(EmuIsa, CpAsyncReadBeforeItsWaitIsFoundAndLandsAtSeededMoments) {
  GlobalMemory global;
  unsigned char* source = global.allocate("src", 16, true, 0x5a);
  int landedEarly = 0, notYet = 0;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    Outcome run;
    runCta(run, 32, 1024, [&] {
      if (tid() != 0) return;
      isa().access(cta().shared(), 16, 1, nullptr);  // written once before
      isa().cpAsync(sharedAddress(0), source, 16, 16, 1, nullptr);
      isa().cpAsyncCommit(nullptr);
      for (int i = 0; i < 6; ++i) isa().fenceMbarrierInit(nullptr);  // instructions in between
      (cta().shared()[0] == 0x5a ? landedEarly : notYet)++;         // raw look, no check
      isa().access(cta().shared(), 4, 0, nullptr);  // the bug: a read before cp.async.wait_group
      isa().cpAsyncWait(0, nullptr);
    }, &global, seed);
    EXPECT_TRUE(run.has(FindingKind::asyncAccess)) << "seed " << seed << "\n" << run.text();
  }
  EXPECT_GT(landedEarly, 0) << "copies land at arbitrary moments before their wait";
  EXPECT_GT(notYet, 0);
}

TEST(EmuIsa, CpAsyncRulesAndBounds) {
  GlobalMemory global;
  unsigned char* source = global.allocate("src", 32, true);
  Outcome run;
  runCta(run, 32, 1024, [&] {
    if (tid() == 0) isa().cpAsync(sharedAddress(0), source + 32, 16, 16, 1, nullptr);  // just past the end
    if (tid() == 1) isa().cpAsync(sharedAddress(8), source, 16, 16, 1, nullptr);       // misaligned destination
    if (tid() == 2) isa().cpAsync(sharedAddress(32), source, 8, 8, 1, nullptr);        // .cg takes only 16
  }, &global);
  EXPECT_TRUE(run.has(FindingKind::outOfBounds)) << run.text();
  EXPECT_TRUE(run.has(FindingKind::misaligned)) << run.text();
  EXPECT_TRUE(run.has(FindingKind::invalidOperand)) << run.text();
}

//===--- mbarrier --------------------------------------------------------------===//

TEST(EmuIsa, MbarrierPhasesParityAndTransactionCounts) {
  Outcome run;
  std::vector<int> order;
  runCta(run, 64, 1024, [&] {
    const int t = tid();
    const uint32_t bar = sharedAddress(0);
    if (t == 0) isa().mbarrierInit(bar, 32, nullptr);
    isa().barSync(0, 0, nullptr);
    // Phase 0: warp 1 arrives, warp 0 waits for parity 0. Phase 1 also needs
    // 100 transaction bytes, announced by one arrival and completed by a
    // second announcement of -100? No: completed by tx only through copies;
    // here the expect_tx of 0 bytes keeps the count at zero.
    if (t >= 32) {
      isa().access(cta().shared() + 64 + 4 * (t - 32), 4, 1, nullptr);
      isa().mbarrierArrive(bar, -1, nullptr);
    } else {
      isa().mbarrierWaitParity(bar, 0, nullptr);
      isa().access(cta().shared() + 64 + 4 * t, 4, 0, nullptr);  // ordered by the phase
      if (t == 0) order.push_back(0);
    }
    isa().barSync(0, 0, nullptr);
    if (t >= 32) isa().mbarrierArrive(bar, 0, nullptr);  // phase 1 with arrive.expect_tx of 0 bytes
    else isa().mbarrierWaitParity(bar, 1, nullptr);
    if (t == 0) order.push_back(1);
  });
  EXPECT_TRUE(run.log.empty()) << run.text();
  EXPECT_EQ(order, (std::vector<int>{0, 1}));

  Outcome overArrived;
  runCta(overArrived, 32, 1024, [&] {
    if (tid() == 0) isa().mbarrierInit(sharedAddress(0), 1, nullptr);
    isa().barSync(0, 0, nullptr);
    if (tid() < 2) isa().mbarrierArrive(sharedAddress(0), 100, nullptr);  // two arrivals on a count of 1
  });
  EXPECT_TRUE(overArrived.has(FindingKind::mbarrier)) << overArrived.text();

  Outcome uninitialised;
  runCta(uninitialised, 32, 1024, [&] { isa().mbarrierArrive(sharedAddress(8), -1, nullptr); });
  EXPECT_TRUE(uninitialised.has(FindingKind::mbarrier)) << uninitialised.text();

  Outcome racyInit;  // other threads use the barrier before a barrier orders them after its init
  runCta(racyInit, 64, 1024, [&] {
    if (tid() == 0) isa().mbarrierInit(sharedAddress(0), 64, nullptr);
    else isa().fenceMbarrierInit(nullptr);
    if (tid() == 40) isa().mbarrierArrive(sharedAddress(0), -1, nullptr);
  });
  EXPECT_TRUE(racyInit.has(FindingKind::race)) << racyInit.text();
}

//===--- tensor maps and cp.async.bulk.tensor ----------------------------------===//

TEST(EmuIsa, TensorMapEncodingFollowsTheDriversRules) {
  CUtensorMap map;  // the type carries its own (128-byte) alignment
  alignas(16) static unsigned char data[1 << 16];
  const cuuint64_t dims[2] = {64, 100}, strides[1] = {128};
  const cuuint32_t box[2] = {64, 32}, ones[2] = {1, 1};
  auto encode = [&](void* address, const cuuint64_t* d, const cuuint64_t* s, const cuuint32_t* b,
                    CUtensorMapSwizzle swizzle) {
    return encodeTensorMapTiled(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, address, d, s, b, ones,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  };
  EXPECT_EQ(encode(data, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B), CUDA_SUCCESS) << lastEncodeError();
  EXPECT_EQ(encode(data + 8, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B), CUDA_ERROR_INVALID_VALUE);
  const cuuint64_t oddStride[1] = {120};
  EXPECT_EQ(encode(data, dims, oddStride, box, CU_TENSOR_MAP_SWIZZLE_128B), CUDA_ERROR_INVALID_VALUE);
  const cuuint32_t wide[2] = {128, 32};  // 256 bytes inside a 128-byte swizzle
  EXPECT_EQ(encode(data, dims, strides, wide, CU_TENSOR_MAP_SWIZZLE_128B), CUDA_ERROR_INVALID_VALUE);
  EXPECT_NE(lastEncodeError().find("swizzle"), std::string::npos);
  const cuuint32_t odd[2] = {4, 32};  // 8 bytes: not a multiple of 16
  EXPECT_EQ(encode(data, dims, strides, odd, CU_TENSOR_MAP_SWIZZLE_NONE), CUDA_ERROR_INVALID_VALUE);
  const cuuint32_t big[2] = {64, 300};
  EXPECT_EQ(encode(data, dims, strides, big, CU_TENSOR_MAP_SWIZZLE_NONE), CUDA_ERROR_INVALID_VALUE);
}

// A 2-d tile of 16-bit elements [rows][columns] loaded by boxes: where each
// element lands per the swizzle the driver documents ("16B chunks swizzled
// within a 32B / 64B / 128B span": with a destination aligned to the
// pattern, 16-byte chunk c of 128-byte line r goes to chunk c XOR (r mod the
// span's chunk count)), with out-of-bounds elements zero (or NaN) filled.
TEST(EmuIsa, TmaLoadsBoxesWithFillAndSwizzle) {
  constexpr int kColumns = 40, kRows = 50;
  GlobalMemory global;
  auto* tensor = reinterpret_cast<uint16_t*>(global.allocate("tensor", kRows * 128, true));
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 64; ++c) tensor[r * 64 + c] = uint16_t(r * 100 + c + 1);  // row pitch 128 bytes
  for (int swizzle : {0, 32, 64, 128})
    for (bool nan : {false, true}) {
      const int boxColumns = swizzle ? swizzle / 2 : 64;  // inner box = the swizzle span (or 128 bytes)
      const int boxRows = 16;
      CUtensorMap map;  // the type carries its own (128-byte) alignment
      const cuuint64_t dims[2] = {kColumns, kRows}, strides[1] = {128};
      const cuuint32_t box[2] = {cuuint32_t(boxColumns), cuuint32_t(boxRows)}, ones[2] = {1, 1};
      const auto mode = swizzle == 0    ? CU_TENSOR_MAP_SWIZZLE_NONE
                        : swizzle == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                        : swizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                        : CU_TENSOR_MAP_SWIZZLE_128B;
      ASSERT_EQ(encodeTensorMapTiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, tensor, dims, strides, box, ones,
                                     CU_TENSOR_MAP_INTERLEAVE_NONE, mode, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                                     nan ? CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
                                         : CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                CUDA_SUCCESS)
          << lastEncodeError();
      for (const auto& [c0, r0] : {std::pair{0, 0}, std::pair{-8, 40}, std::pair{24, -3}}) {
        Outcome run;
        std::vector<uint16_t> landed(size_t(boxRows * boxColumns));
        runCta(run, 32, 8192, [&] {
          if (tid() != 0) return;
          const uint32_t bar = sharedAddress(4096);
          isa().mbarrierInit(bar, 1, nullptr);
          isa().mbarrierArrive(bar, int64_t(boxRows) * boxColumns * 2, nullptr);
          const int32_t at[2] = {c0, r0};
          const uint32_t destination = sharedAddress(1024 - 256);  // the window base is 256: 1024-aligned
          isa().tmaLoad(destination, &map, at, 2, bar, nullptr);
          isa().mbarrierWaitParity(bar, 0, nullptr);
          std::memcpy(landed.data(), cta().shared() + 1024 - 256, landed.size() * 2);
        }, &global);
        ASSERT_TRUE(run.log.empty()) << run.text();
        const int rowBytes = boxColumns * 2, chunks = std::max(swizzle, 16) / 16;
        for (int r = 0; r < boxRows; ++r)
          for (int c = 0; c < boxColumns; ++c) {
            const int linear = r * rowBytes + c * 2;
            const int line = linear / 128, chunk = (linear % 128) / 16;
            const int placed = line * 128 + ((chunk & ~(chunks - 1)) | ((chunk ^ line) & (chunks - 1))) * 16 +
                               linear % 16;
            const int gr = r0 + r, gc = c0 + c;
            const bool inside = gr >= 0 && gr < kRows && gc >= 0 && gc < kColumns;
            const uint16_t expected = inside ? uint16_t(gr * 100 + gc + 1) : nan ? uint16_t(0xffff) : uint16_t(0);
            ASSERT_EQ(landed[size_t(placed / 2)], expected)
                << "swizzle " << swizzle << " box at (" << c0 << "," << r0 << ") element (" << r << "," << c << ")";
          }
      }
    }
}

TEST(EmuIsa, TmaCompletesTransactionsAndAShortExpectationNeverCompletes) {
  GlobalMemory global;
  void* tensor = global.allocate("tensor", 64 * 64 * 2, true, 1);
  CUtensorMap map;  // the type carries its own (128-byte) alignment
  const cuuint64_t dims[2] = {64, 64}, strides[1] = {128};
  const cuuint32_t box[2] = {64, 64}, ones[2] = {1, 1};
  ASSERT_EQ(encodeTensorMapTiled(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, tensor, dims, strides, box, ones,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
            CUDA_SUCCESS);
  for (int shortBy : {0, 16}) {
    Outcome run;
    runCta(run, 64, 16384, [&] {
      const uint32_t bar = sharedAddress(12288);
      if (tid() == 0) {
        isa().mbarrierInit(bar, 1, nullptr);
        isa().mbarrierArrive(bar, 64 * 64 * 2 - shortBy, nullptr);
        const int32_t at[2] = {0, 0};
        isa().tmaLoad(sharedAddress(1024 - 256), &map, at, 2, bar, nullptr);
      }
      isa().barSync(0, 0, nullptr);
      isa().mbarrierWaitParity(bar, 0, nullptr);
      isa().access(cta().shared() + 1024 - 256 + 2 * tid(), 2, 0, nullptr);  // ordered by the phase
    }, &global);
    if (shortBy == 0) EXPECT_TRUE(run.log.empty()) << run.text();
    else EXPECT_TRUE(run.has(FindingKind::mbarrier) && run.has(FindingKind::deadlock)) << run.text();
  }
  Outcome early;  // reading the box without waiting on the barrier
  runCta(early, 32, 16384, [&] {
    const uint32_t bar = sharedAddress(12288);
    if (tid() != 0) return;
    isa().mbarrierInit(bar, 1, nullptr);
    isa().mbarrierArrive(bar, 64 * 64 * 2, nullptr);
    const int32_t at[2] = {0, 0};
    isa().tmaLoad(sharedAddress(1024 - 256), &map, at, 2, bar, nullptr);
    isa().access(cta().shared() + 1024 - 256, 2, 0, nullptr);
  }, &global);
  EXPECT_TRUE(early.has(FindingKind::asyncAccess) || early.has(FindingKind::race)) << early.text();
}

//===--- wgmma -----------------------------------------------------------------===//

// Lays a 16-bit matrix out in shared memory as the ISA's canonical layouts
// describe it in words: core matrices of 8 rows of 16 bytes; without a
// swizzle, core matrices adjacent along the leading dimension `lbo` bytes
// apart and along the strided one `sbo`; with a swizzle of S bytes, atoms of
// 8 rows of S bytes whose 16-byte chunks are XORed with the row within the
// atom, atoms `sbo` apart along the strided dimension (and, MN-major, `lbo`
// apart along the leading one). `mnMajor` puts 8 consecutive MN elements in
// each 16 bytes, else 8 consecutive K elements.
struct Placed {
  uint64_t descriptor;
};

Placed place(unsigned char* shared, uint32_t windowBase, int64_t at, const std::vector<uint16_t>& matrix, int mnSize,
             int kSize, bool mnMajor, int swizzle, uint32_t lbo, uint32_t sbo) {
  for (int mn = 0; mn < mnSize; ++mn)
    for (int k = 0; k < kSize; ++k) {
      // Contiguous dimension c (8 elements to 16 bytes), strided dimension s.
      const int c = mnMajor ? mn : k, s = mnMajor ? k : mn;
      int64_t byte;
      if (!swizzle) {
        const int64_t core = (c / 8) * int64_t(mnMajor ? sbo : lbo) + (s / 8) * int64_t(mnMajor ? lbo : sbo);
        byte = core + (s % 8) * 16 + (c % 8) * 2;
      } else {
        const int perRow = swizzle / 2;  // elements in one row of the atom
        const int64_t atom = (c / perRow) * int64_t(mnMajor ? lbo : 0) + (s / 8) * int64_t(sbo);
        const int64_t linear = atom + (s % 8) * swizzle + (c % perRow) * 2;
        // The swizzle: the 16-byte chunk within the span XOR the 128-byte line.
        const int64_t line = (int64_t(windowBase) + at + linear) >> 7;
        byte = linear ^ ((line & (swizzle / 16 - 1)) << 4);
      }
      std::memcpy(shared + at + byte, &matrix[size_t(mn * kSize + k)], 2);
    }
  const uint32_t start = uint32_t(windowBase + at);
  const uint64_t mode = swizzle == 128 ? 1 : swizzle == 64 ? 2 : swizzle == 32 ? 3 : 0;
  return {uint64_t((start & 0x3ffff) >> 4) | uint64_t((lbo >> 4) & 0x3fff) << 16 | uint64_t((sbo >> 4) & 0x3fff) << 32 |
          mode << 62};
}

TEST(EmuIsa, WgmmaThroughDescriptorsInEveryCanonicalLayout) {
  std::mt19937_64 rng(testing::testSeed() + 11);
  std::normal_distribution<double> normal;
  constexpr int M = 64, K = 16;
  for (int N : {8, 64, 128})
    for (bool bMnMajor : {false, true})
      for (int swizzle : {0, 32, 64, 128}) {
        std::vector<uint16_t> a(size_t(M * K)), b(size_t(N * K));  // a[m][k], b[n][k]
        for (auto& x : a) x = half::floatToBfloat16(float(normal(rng)));
        for (auto& x : b) x = half::floatToBfloat16(float(normal(rng)));
        std::vector<std::vector<float>> d(128);
        Outcome run;
        runCta(run, 128, 65536, [&] {
          const int t = tid();
          static Placed pa, pb;
          if (t == 0) {
            // A K-major with a 128-byte swizzle (atom rows of 64 elements:
            // K = 16 fits in one), B in the layout under test; 1024-aligned.
            pa = place(cta().shared(), cta().sharedWindowBase(), 1024 - 256, a, M, K, false, 128, 16, 1024);
            const uint32_t lbo = swizzle ? uint32_t(8 * swizzle) : 2048, sbo = swizzle ? 8u * uint32_t(swizzle) : 128;
            const uint32_t leading = bMnMajor && swizzle ? uint32_t(8 * swizzle * ((K + 7) / 8)) : lbo;
            pb = place(cta().shared(), cta().sharedWindowBase(), 16384 - 256, b, N, K, bMnMajor, swizzle,
                       leading, bMnMajor ? uint32_t(8 * std::max(swizzle, 16)) : sbo);
            for (int64_t i = 0; i < 65536; i += 4) isa().access(cta().shared() + i, 4, 1, nullptr);
            isa().fenceProxyAsync(nullptr);
          }
          isa().barSync(0, 0, nullptr);
          std::vector<float> acc(size_t(N / 2), 0.0f);
          isa().wgmmaFence(nullptr);
          isa().wgmmaMmaAsync(1, N, acc.data(), pa.descriptor, nullptr, pb.descriptor, 0, 0, bMnMajor, nullptr);
          isa().wgmmaCommit(nullptr);
          isa().wgmmaWait(0, nullptr);
          d[size_t(t)] = acc;
        });
        ASSERT_TRUE(run.log.empty()) << "N " << N << (bMnMajor ? " MN" : " K") << "-major swizzle " << swizzle << "\n"
                                     << run.text();
        // The accumulator layout: warp w, lane l holds rows 16w + l/4 (+8),
        // columns 8j + 2(l%4) (+1) at d[4j + e].
        for (int t = 0; t < 128; ++t) {
          const int w = t / 32, l = t % 32;
          for (int j = 0; j < N / 8; ++j)
            for (int e = 0; e < 4; ++e) {
              const int row = 16 * w + l / 4 + (e / 2) * 8, column = 8 * j + 2 * (l % 4) + e % 2;
              double expected = 0;
              for (int k = 0; k < K; ++k)
                expected += double(half::bfloat16ToFloat(a[size_t(row * K + k)])) *
                            half::bfloat16ToFloat(b[size_t(column * K + k)]);
              ASSERT_NEAR(d[size_t(t)][size_t(4 * j + e)], expected, 1e-4 * (1 + std::abs(expected)))
                  << "N " << N << (bMnMajor ? " MN" : " K") << "-major swizzle " << swizzle << " row " << row
                  << " column " << column;
            }
        }
      }
}

TEST(EmuIsa, WgmmaAsynchronyFencesAndRegisterOperands) {
  // A from registers (the m16n8k16 A layout per warp), accumulating twice
  // into one accumulator before a single wait; reading it early is a finding.
  std::vector<uint16_t> b(size_t(64 * 16));
  for (size_t i = 0; i < b.size(); ++i) b[i] = half::floatToHalf(float(i % 7) - 3.0f);
  for (bool early : {false, true}) {
    Outcome run;
    std::vector<float> result(128 * 32);
    runCta(run, 128, 32768, [&] {
      const int t = tid();
      static Placed pb;
      if (t == 0) {
        pb = place(cta().shared(), cta().sharedWindowBase(), 1024 - 256, b, 64, 16, true, 128, 8192, 1024);
        for (int64_t i = 0; i < 32768; i += 4) isa().access(cta().shared() + i, 4, 1, nullptr);
        isa().fenceProxyAsync(nullptr);
      }
      isa().barSync(0, 0, nullptr);
      uint32_t a[4];
      for (int r = 0; r < 4; ++r) a[r] = uint32_t(half::floatToHalf(1.0f)) * 0x10001u;  // A all ones
      float acc[32] = {};
      isa().wgmmaFence(nullptr);
      isa().wgmmaMmaAsync(0, 64, acc, 0, a, pb.descriptor, 0, 0, 1, nullptr);
      isa().wgmmaMmaAsync(0, 64, acc, 0, a, pb.descriptor, 1, 0, 1, nullptr);
      isa().wgmmaCommit(nullptr);
      if (early) isa().access(&acc[0], 4, 0, nullptr);
      isa().wgmmaWait(0, nullptr);
      std::copy(acc, acc + 32, result.begin() + 32 * t);
    });
    if (early) {
      EXPECT_TRUE(run.has(FindingKind::asyncAccess)) << run.text();
      continue;
    }
    ASSERT_TRUE(run.log.empty()) << run.text();
    // D = 2 * ones(64x16) * B(16x64): column n sums B's column n, twice.
    for (int t = 0; t < 128; ++t) {
      const int l = t % 32;
      for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 4; ++e) {
          const int column = 8 * j + 2 * (l % 4) + e % 2;
          double expected = 0;
          for (int k = 0; k < 16; ++k) expected += 2 * half::halfToFloat(b[size_t(column * 16 + k)]);
          ASSERT_FLOAT_EQ(result[size_t(32 * t + 4 * j + e)], float(expected)) << "thread " << t;
        }
    }
  }
  Outcome unfenced;  // generic stores read by wgmma with no fence.proxy.async
  runCta(unfenced, 128, 32768, [&] {
    if (tid() == 0) {
      for (int64_t i = 0; i < 32768; i += 4) isa().access(cta().shared() + i, 4, 1, nullptr);
    }
    isa().barSync(0, 0, nullptr);
    float acc[32] = {};
    const uint64_t desc = uint64_t((cta().sharedWindowBase() + 768) >> 4) | uint64_t(1) << 16 | uint64_t(64) << 32 |
                          uint64_t(1) << 62;
    isa().wgmmaFence(nullptr);
    isa().wgmmaMmaAsync(0, 64, acc, desc, nullptr, desc, 0, 0, 0, nullptr);
    isa().wgmmaCommit(nullptr);
    isa().wgmmaWait(0, nullptr);
  });
  EXPECT_TRUE(unfenced.has(FindingKind::proxyFence)) << unfenced.text();
}

TEST(EmuIsa, DescriptorBaseOffsetShiftsTheSwizzlePhase) {
  // A 128B-swizzled K-major matrix whose pattern starts 128 bytes past a
  // 1024-byte boundary: base offset (start >> 7) & 7 = 1 keeps row 0's
  // chunks unswizzled.
  const uint32_t start = 1024 + 128;
  const uint64_t withBase = uint64_t(start >> 4) | uint64_t(1) << 16 | uint64_t(64) << 32 | uint64_t(1) << 49 |
                            uint64_t(1) << 62;
  const uint64_t withoutBase = withBase & ~(uint64_t(7) << 49);
  for (int k = 0; k < 16; ++k) {
    EXPECT_EQ(descriptorAddress(withBase, false, 0, k), start + uint32_t(k) * 2);
    EXPECT_EQ(descriptorAddress(withBase, false, 3, k), start + 3 * 128 + ((uint32_t(k / 8) ^ 3) * 16) + (k % 8) * 2);
  }
  EXPECT_NE(descriptorAddress(withoutBase, false, 0, 0), start);  // phase 1: chunk 0 moves
}

//===--- setmaxnreg ------------------------------------------------------------===//

TEST(EmuIsa, SetmaxnregMovesRegistersWithinTheFile) {
  // 384 threads at 168 registers fill 64512 of the 65536: the producer
  // warpgroup gives 144 each back, the consumers take them (up to 240).
  Outcome run;
  std::vector<int> registers(384);
  runCta(run, 384, 0, [&] {
    const int t = tid();
    if (t < 128) isa().setmaxnreg(0, 24, nullptr);
    else isa().setmaxnreg(1, 240, nullptr);
    registers[size_t(t)] = cta().self().registers;
  });
  EXPECT_TRUE(run.log.empty()) << run.text();
  EXPECT_EQ(registers[0], 24);
  EXPECT_EQ(registers[200], 240);
  Outcome greedy;  // consumers asking for more than the file holds wait forever
  runCta(greedy, 384, 0, [&] {
    if (tid() < 128) isa().setmaxnreg(0, 56, nullptr);
    else isa().setmaxnreg(1, 256, nullptr);
  });
  EXPECT_TRUE(greedy.has(FindingKind::deadlock)) << greedy.text();
  Outcome uneven;
  runCta(uneven, 128, 0, [&] { isa().setmaxnreg(0, tid() < 64 ? 24 : 32, nullptr); });
  EXPECT_TRUE(uneven.has(FindingKind::divergence)) << uneven.text();
  Outcome odd;
  runCta(odd, 128, 0, [&] { isa().setmaxnreg(0, 100, nullptr); });
  EXPECT_TRUE(odd.has(FindingKind::invalidOperand)) << odd.text();
}

//===--- shared memory checks --------------------------------------------------===//

TEST(EmuIsa, SharedMemoryChecks) {
  Outcome uninitialised;
  runCta(uninitialised, 32, 256, [&] { isa().access(cta().shared() + 4 * tid(), 4, 0, nullptr); });
  EXPECT_TRUE(uninitialised.has(FindingKind::uninitialized)) << uninitialised.text();
  Outcome misaligned;
  runCta(misaligned, 32, 256, [&] {
    isa().access(cta().shared() + 16 * tid() % 256, 16, 1, nullptr);
    if (tid() == 0) isa().access(cta().shared() + 8, 16, 0, nullptr);
  });
  EXPECT_TRUE(misaligned.has(FindingKind::misaligned)) << misaligned.text();
  Outcome outside;
  runCta(outside, 32, 256, [&] { isa().access(cta().shared() + 256 + 4 * tid(), 4, 1, nullptr); });
  EXPECT_TRUE(outside.has(FindingKind::outOfBounds)) << outside.text();
  Outcome atomics;  // atomics from every thread do not race; a plain read after them does, without a barrier
  runCta(atomics, 64, 256, [&] {
    if (tid() == 0) isa().access(cta().shared(), 4, 1, nullptr);
    isa().barSync(0, 0, nullptr);
    isa().redSharedAddF32(sharedAddress(0), 1.0f, nullptr);
  });
  EXPECT_TRUE(atomics.log.empty()) << atomics.text();
}

// red.global.add.f32 from four CTAs on four OS threads at once, every thread
// adding to the same words: the sums are exact (small integers, any order),
// so an add lost to a race shows; out of bounds, into an input, misaligned
// and outside every buffer are each found and change nothing.
TEST(EmuIsa, GlobalReductionsAreAtomicAcrossCtasAndChecked) {
  GlobalMemory global;
  auto* sums = reinterpret_cast<float*>(global.allocate("sums", 8 * sizeof(float), false));
  auto* input = reinterpret_cast<float*>(global.allocate("input", 4 * sizeof(float), true));
  constexpr int kCtas = 4, kThreads = 64, kRounds = 50;
  std::vector<Outcome> runs(kCtas);
  std::vector<std::thread> workers;
  for (int c = 0; c < kCtas; ++c)
    workers.emplace_back([&, c] {
      runCta(runs[size_t(c)], kThreads, 0, [&] {
        for (int round = 0; round < kRounds; ++round) isa().redGlobalAddF32(sums + (tid() + round) % 8, 1.0f, nullptr);
      }, &global, uint64_t(c + 1));
    });
  for (std::thread& w : workers) w.join();
  for (const Outcome& run : runs) EXPECT_TRUE(run.log.empty()) << run.text();
  float total = 0;
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(sums[i], float(kCtas * kThreads * kRounds / 8)) << i;
    total += sums[i];
  }
  EXPECT_EQ(total, float(kCtas * kThreads * kRounds));

  Outcome wrong;
  float local = 0;
  runCta(wrong, 32, 0, [&] {
    if (tid() == 0) isa().redGlobalAddF32(sums + 8, 1.0f, nullptr);  // just past the end
    if (tid() == 1) isa().redGlobalAddF32(input, 1.0f, nullptr);     // an input
    if (tid() == 2)
      isa().redGlobalAddF32(reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(sums) + 2), 1.0f, nullptr);
    if (tid() == 3) isa().redGlobalAddF32(&local, 1.0f, nullptr);    // no launch buffer
  }, &global);
  EXPECT_TRUE(wrong.has(FindingKind::outOfBounds)) << wrong.text();
  EXPECT_TRUE(wrong.has(FindingKind::readOnly)) << wrong.text();
  EXPECT_TRUE(wrong.has(FindingKind::misaligned)) << wrong.text();
  EXPECT_EQ(input[0], 0.0f);
  EXPECT_EQ(local, 0.0f);
  EXPECT_EQ(sums[0], float(kCtas * kThreads * kRounds / 8));
}

// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 from four CTAs
// on four OS threads at once into the same floats: every thread writes its
// float of shared memory, fences the async proxy, a barrier, and thread 0
// adds the CTA's 64 floats with one bulk reduction, then waits for its read.
// The sums are exact (small integers, any order). Each misuse is found: no
// fence.proxy.async, a writer not ordered before the issue, the source
// written before the read wait, the CTA ending with the read in flight, a
// size or address not a multiple of 16, past a buffer's end, into an input.
TEST(EmuIsa, BulkReductionsAddAtomicallyAndHoldTheirSourceUntilTheReadWait) {
  GlobalMemory global;
  auto* sums = reinterpret_cast<float*>(global.allocate("sums", 64 * sizeof(float), false));
  auto* input = reinterpret_cast<float*>(global.allocate("input", 64 * sizeof(float), true));
  constexpr int kCtas = 4, kThreads = 64;
  // Each thread's float, fenced for the async proxy unless `fence` is false;
  // the barrier orders the writes before thread 0's issue unless `barrier` is false.
  auto write = [&](int ctaIndex, bool fence, bool barrier) {
    const float value = float(ctaIndex + 1) * float(tid() + 1);
    std::memcpy(cta().shared() + 4 * tid(), &value, 4);
    isa().access(cta().shared() + 4 * tid(), 4, 1, nullptr);
    if (fence) isa().fenceProxyAsync(nullptr);
    if (barrier) isa().barSync(0, 0, nullptr);
  };
  std::vector<Outcome> runs(kCtas);
  std::vector<std::thread> workers;
  for (int c = 0; c < kCtas; ++c)
    workers.emplace_back([&, c] {
      runCta(runs[size_t(c)], kThreads, 256, [&] {
        write(c, true, true);
        if (tid() == 0) {
          isa().bulkReduceAddF32(sums, sharedAddress(0), 256, nullptr);
          isa().bulkCommit(nullptr);
          isa().bulkWait(0, 1, nullptr);
        }
      }, &global, uint64_t(c + 1));
    });
  for (std::thread& w : workers) w.join();
  for (const Outcome& run : runs) EXPECT_TRUE(run.log.empty()) << run.text();
  for (int i = 0; i < 64; ++i) EXPECT_EQ(sums[i], float((1 + 2 + 3 + 4) * (i + 1))) << i;

  const std::pair<const char*, std::function<void()>> misuses[] = {
      {"no fence.proxy.async", [&] {
         write(0, false, true);
         if (tid() == 0) {
           isa().bulkReduceAddF32(sums, sharedAddress(0), 256, nullptr);
           isa().bulkCommit(nullptr);
           isa().bulkWait(0, 1, nullptr);
         }
       }},
      {"a writer not ordered before the issue", [&] {
         if (tid() == 0) {
           isa().bulkReduceAddF32(sums, sharedAddress(0), 256, nullptr);
           isa().bulkCommit(nullptr);
           isa().bulkWait(0, 1, nullptr);
         }
         write(0, true, false);
       }},
      {"the source written before the read wait", [&] {
         write(0, true, true);
         if (tid() == 0) {
           isa().bulkReduceAddF32(sums, sharedAddress(0), 256, nullptr);
           isa().bulkCommit(nullptr);
           isa().access(cta().shared(), 4, 1, nullptr);
           isa().bulkWait(0, 1, nullptr);
         }
       }},
      {"the CTA ending with the read in flight", [&] {
         write(0, true, true);
         if (tid() == 0) {
           isa().bulkReduceAddF32(sums, sharedAddress(0), 256, nullptr);
           isa().bulkCommit(nullptr);
         }
       }},
  };
  const FindingKind expected[] = {FindingKind::proxyFence, FindingKind::race, FindingKind::asyncAccess,
                                  FindingKind::asyncAccess};
  for (size_t m = 0; m < std::size(misuses); ++m) {
    Outcome run;
    runCta(run, kThreads, 256, misuses[m].second, &global);
    EXPECT_TRUE(run.has(expected[m])) << misuses[m].first << ":\n" << run.text();
  }
  const float before = sums[0];
  Outcome wrong;
  runCta(wrong, 32, 256, [&] {
    write(0, true, true);
    if (tid() == 0) isa().bulkReduceAddF32(sums, sharedAddress(0), 8, nullptr);            // size not a multiple of 16
    if (tid() == 1) isa().bulkReduceAddF32(sums + 1, sharedAddress(0), 16, nullptr);       // global not 16-aligned
    if (tid() == 2) isa().bulkReduceAddF32(sums + 60, sharedAddress(0), 32, nullptr);      // past the end
    if (tid() == 3) isa().bulkReduceAddF32(input, sharedAddress(0), 16, nullptr);          // into an input
  }, &global);
  EXPECT_TRUE(wrong.has(FindingKind::misaligned)) << wrong.text();
  EXPECT_TRUE(wrong.has(FindingKind::outOfBounds)) << wrong.text();
  EXPECT_TRUE(wrong.has(FindingKind::readOnly)) << wrong.text();
  EXPECT_EQ(sums[0], before) << "a refused reduction added nothing";
  EXPECT_EQ(input[0], 0.0f);
}

//===--- conversions -------------------------------------------------------------===//

TEST(EmuIsa, HalfAndBfloat16RoundToNearestEven) {
  std::mt19937_64 rng(testing::testSeed() + 5);
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = uint32_t(rng());
    if (i % 3 == 0) bits = (bits & 0x807fffffu) | uint32_t(100 + rng() % 50) << 23;  // near half's range
    float f;
    std::memcpy(&f, &bits, 4);
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);  // the compiler's IEEE round-to-nearest-even
    uint16_t expected;
    std::memcpy(&expected, &h, 2);
    ASSERT_EQ(half::floatToHalf(f), expected) << std::hexfloat << f;
    ASSERT_EQ(half::halfToFloat(expected), float(h));
    // bfloat16: the top 16 bits, rounded to nearest even on the rest.
    const uint32_t rest = bits & 0xffffu, kept = bits >> 16;
    const uint32_t rounded = rest > 0x8000u || (rest == 0x8000u && (kept & 1)) ? kept + 1 : kept;
    ASSERT_EQ(half::floatToBfloat16(f), uint16_t(rounded)) << std::hexfloat << f;
  }
  EXPECT_EQ(half::floatToHalf(65520.0f), 0x7c00) << "rounds past the largest half to infinity";
  EXPECT_EQ(half::floatToHalf(65519.0f), 0x7bff);
  EXPECT_EQ(half::floatToHalf(std::ldexp(1.0f, -25)), 0) << "ties to even at half the smallest subnormal";
  EXPECT_EQ(half::floatToHalf(std::ldexp(1.5f, -25)), 1);
}

}  // namespace
}  // namespace loom::emu
