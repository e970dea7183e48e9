// The CUDA tile code's lane arithmetic (loom/tile/layout.h, fragment::)
// against the PTX ISA's definitions of ldmatrix and of the mma.m16n8k16
// fragments, modelled here on the host: every element each lane receives
// must be the one the tensor-core instruction expects. This is the part of
// the device code most likely to be subtly wrong and least likely to show it.
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>

#include "loom/tile/layout.h"

namespace loom {
namespace {

using Coordinate = std::pair<int, int>;  // (row, column) in a shared-memory tile

int group(int lane) { return lane / 4; }           // PTX "groupID"
int inGroup(int lane) { return lane % 4; }         // PTX "threadID_in_group"

// PTX ISA, mma.m16n8k16 with .f16 / .bf16 A: element i (0..7, two per register).
Coordinate aElement(int lane, int i) {
  return {group(lane) + 8 * ((i / 2) % 2), 2 * inGroup(lane) + i % 2 + 8 * (i / 4)};
}
// B: element i (0..3) as (k, n).
Coordinate bElement(int lane, int i) { return {2 * inGroup(lane) + i % 2 + 8 * (i / 2), group(lane)}; }
// C / D: element i (0..3) as (row, column).
Coordinate cElement(int lane, int i) { return {group(lane) + 8 * (i / 2), 2 * inGroup(lane) + i % 2}; }

// PTX ISA, ldmatrix.m8n8.x4.b16: lanes 8j..8j+7 give the row addresses of
// matrix j; lane t receives, in register j, row t/4 elements 2(t%4) and
// 2(t%4)+1 of matrix j (with .trans: column t/4, rows 2(t%4) and 2(t%4)+1).
template <typename RowFn, typename ColumnFn>
Coordinate ldmatrix(int lane, int reg, int half, bool trans, RowFn rowAddress, ColumnFn columnAddress) {
  if (!trans) {
    const int source = 8 * reg + lane / 4;  // the lane that addressed this matrix row
    return {rowAddress(source), columnAddress(source) + 2 * (lane % 4) + half};
  }
  const int source = 8 * reg + 2 * (lane % 4) + half;
  return {rowAddress(source), columnAddress(source) + lane / 4};
}

TEST(Fragments, LdmatrixOfQGivesTheAOperand) {
  for (int lane = 0; lane < 32; ++lane)
    for (int reg = 0; reg < 4; ++reg)
      for (int half = 0; half < 2; ++half) {
        const Coordinate loaded = ldmatrix(lane, reg, half, false, fragment::aRow, fragment::aColumn);
        EXPECT_EQ(loaded, aElement(lane, 2 * reg + half)) << "lane " << lane << " a" << reg << "." << half;
      }
}

// K tile stored [key][d]: registers 0,1 are b0,b1 of keys 0..7, registers 2,3
// of keys 8..15; B's (k, n) is (d, key).
TEST(Fragments, LdmatrixOfKGivesTwoBOperands) {
  for (int lane = 0; lane < 32; ++lane)
    for (int reg = 0; reg < 4; ++reg)
      for (int half = 0; half < 2; ++half) {
        const Coordinate loaded = ldmatrix(lane, reg, half, false, fragment::bRow, fragment::bColumn);
        const auto [k, n] = bElement(lane, 2 * (reg % 2) + half);
        const Coordinate expected = {8 * (reg / 2) + n, k};  // (key row, d column)
        EXPECT_EQ(loaded, expected) << "lane " << lane << " reg " << reg << "." << half;
      }
}

// V tile stored [key][d], loaded transposed: registers 0,1 are b0,b1 of d
// columns 0..7, registers 2,3 of d 8..15; B's (k, n) is (key, d).
TEST(Fragments, TransposedLdmatrixOfVGivesTwoBOperands) {
  for (int lane = 0; lane < 32; ++lane)
    for (int reg = 0; reg < 4; ++reg)
      for (int half = 0; half < 2; ++half) {
        const Coordinate loaded = ldmatrix(lane, reg, half, true, fragment::bTransRow, fragment::bTransColumn);
        const auto [k, n] = bElement(lane, 2 * (reg % 2) + half);
        const Coordinate expected = {k, 8 * (reg / 2) + n};  // (key row, d column)
        EXPECT_EQ(loaded, expected) << "lane " << lane << " reg " << reg << "." << half;
      }
}

// P V reuses the scores: register j of the A operand is accumulator elements
// 2(j%2), 2(j%2)+1 of n-tile j/2, exactly as mma_pv packs them.
TEST(Fragments, ScoreAccumulatorsRepackAsTheAOperand) {
  for (int lane = 0; lane < 32; ++lane)
    for (int reg = 0; reg < 4; ++reg)
      for (int half = 0; half < 2; ++half) {
        const int element = 2 * (reg % 2) + half, nTile = reg / 2;
        const Coordinate packed = {fragment::accumulatorRow(lane, element),
                                   8 * nTile + fragment::accumulatorColumn(lane, element)};
        EXPECT_EQ(packed, aElement(lane, 2 * reg + half)) << "lane " << lane << " a" << reg << "." << half;
      }
}

TEST(Fragments, AccumulatorCoordinatesFollowTheIsa) {
  for (int lane = 0; lane < 32; ++lane)
    for (int e = 0; e < 4; ++e) {
      EXPECT_EQ(Coordinate(fragment::accumulatorRow(lane, e), fragment::accumulatorColumn(lane, e)), cElement(lane, e));
    }
}

// Every element of the 16x8 accumulator tile is owned by exactly one (lane, element).
TEST(Fragments, AccumulatorTileIsCoveredOnce) {
  int owners[16][8] = {};
  for (int lane = 0; lane < 32; ++lane)
    for (int e = 0; e < 4; ++e) ++owners[fragment::accumulatorRow(lane, e)][fragment::accumulatorColumn(lane, e)];
  for (auto& row : owners)
    for (int count : row) EXPECT_EQ(count, 1);
}

// The padded pitch keeps the eight row addresses of one ldmatrix phase in
// eight different 16-byte bank groups (no conflicts) for every head_dim
// multiple of 16 the tiles use.
TEST(Layout, PaddedRowsAreConflictFree) {
  for (int d = 16; d <= 256; d += 16) {
    const int pitchBytes = tilePitch(d) * kTileElementBytes;
    bool used[8] = {};
    for (int row = 0; row < 8; ++row) {
      const int group = (row * pitchBytes / 16) % 8;
      EXPECT_FALSE(used[group]) << "head_dim " << d << " row " << row;
      used[group] = true;
    }
  }
}

// The collapse epilogues store each accumulator fragment into the f32
// staging tile as 8-byte pairs (elements e and e + 1 of a lane). A warp's
// 8-byte stores run as two phases of 16 lanes; with stagingPitch no two
// lanes of a phase touch the same bank (32 banks of 4 bytes), for every
// head_dim. Without the pad the same stores are 4-way conflicted.
int worstBankConflict(int pitchFloats) {
  int worst = 1;
  for (int e = 0; e < 4; e += 2)
    for (int phase = 0; phase < 2; ++phase) {
      int hits[32] = {};
      for (int lane = phase * 16; lane < phase * 16 + 16; ++lane) {
        const int word = fragment::accumulatorRow(lane, e) * pitchFloats + fragment::accumulatorColumn(lane, e);
        for (int half = 0; half < 2; ++half) worst = std::max(worst, ++hits[(word + half) % 32]);
      }
    }
  return worst;
}

TEST(Layout, StagingStoresAreConflictFree) {
  for (int d = 8; d <= 256; d += 8) {
    EXPECT_EQ(worstBankConflict(stagingPitch(d)), 1) << "head_dim " << d;
  }
  EXPECT_EQ(worstBankConflict(paddedHeadDim(128)), 4);  // what the unpadded tile did
}

TEST(Layout, SharedMemoryRegionsDoNotOverlap) {
  for (bool mixed : {false, true})
    for (bool epilogue : {false, true})
      for (bool outTile : {false, true}) {
        const AttentionSmem s = attentionSmem(64, 64, 64, 3, 8, 2, 4, mixed, epilogue, outTile);
        EXPECT_LE(s.q, s.k);
        EXPECT_LT(s.k, s.v);
        EXPECT_LE(s.v, s.raw);
        EXPECT_LE(s.raw, s.out);
        EXPECT_LE(s.out, s.total);
        EXPECT_EQ(s.q % 16 + s.k % 16 + s.v % 16 + s.raw % 16 + s.out % 16, 0) << "16-byte aligned regions";
        if (epilogue) {
          EXPECT_GE(s.out, 64 * paddedHeadDim(64) * kAccumulatorBytes) << "staging fits before out";
        }
      }
}

// The sm_90a layout (hopper.h): the 16-byte chunk swizzle is the one TMA
// writes with CU_TENSOR_MAP_SWIZZLE_128B and wgmma descriptors read with
// swizzle mode 1 (address bits 4-6 XOR bits 7-9), and it spreads the eight
// rows of a swizzle period over all eight 16-byte bank groups for any chunk.
TEST(HopperLayout, SwizzleIsThe128BytePattern) {
  for (int row = 0; row < 256; ++row) {
    bool seen[8] = {};
    for (int chunk = 0; chunk < 8; ++chunk) {
      const int linear = row * kSwizzleRowBytes + chunk * 16;
      EXPECT_EQ(swizzledChunk(row, chunk), linear ^ (((linear >> 7) & 7) << 4)) << row << " " << chunk;
      EXPECT_EQ(swizzledChunk(row, chunk) / kSwizzleRowBytes, row) << "stays in its row";
      seen[(swizzledChunk(row, chunk) % kSwizzleRowBytes) / 16] = true;
    }
    for (bool s : seen) EXPECT_TRUE(s) << "row " << row << " is a permutation of its chunks";
  }
  for (int chunk = 0; chunk < 8; ++chunk) {
    bool groups[8] = {};
    for (int row = 0; row < 8; ++row) groups[(swizzledChunk(row, chunk) % kSwizzleRowBytes) / 16] = true;
    for (bool g : groups) EXPECT_TRUE(g) << "chunk " << chunk << " column reads conflict";
  }
}

// Every operand tile (and every stage of K and V) starts on the 1024-byte
// swizzle period, as descriptors with base offset 0 and TMA require; the
// regions follow each other; the staging tile has its own room exactly when
// the producer may still stream (the fused global collapse's head loop).
TEST(HopperLayout, TilesStartOnTheSwizzlePeriodAndDoNotOverlap) {
  for (int blockM : {64, 128, 192})
    for (int blockN : {64, 128, 192, 256})
      for (int d : {64, 128, 256})
        for (int stages = 1; stages <= 4; ++stages)
          for (bool epilogue : {false, true})
            for (bool outTile : {false, true}) {
              if (outTile && !epilogue) continue;
              const HopperSmem s = hopperSmem(blockM, blockN, d, stages, 8, 4, epilogue, outTile);
              const int kvTile = blockN * d * kTileElementBytes;
              for (int stage = 0; stage < stages; ++stage) {
                EXPECT_EQ((s.k + stage * kvTile) % kSwizzlePeriodBytes, 0);
                EXPECT_EQ((s.v + stage * kvTile) % kSwizzlePeriodBytes, 0);
              }
              EXPECT_EQ(s.q % kSwizzlePeriodBytes, 0);
              EXPECT_EQ(s.k, s.q + blockM * d * kTileElementBytes);
              EXPECT_EQ(s.v, s.k + stages * kvTile);
              const int operandsEnd = s.v + stages * kvTile;
              if (outTile) {
                EXPECT_GE(s.staging, operandsEnd) << "streaming continues under the staging tile";
              } else {
                EXPECT_EQ(s.staging, 0);
              }
              if (epilogue) {
                EXPECT_GE(s.out, s.staging + blockM * d * kAccumulatorBytes);
              }
              EXPECT_GE(s.barriers, s.out);
              EXPECT_EQ(s.barriers % kBarrierBytes, 0);
              EXPECT_EQ(s.anchors, s.barriers + (2 * stages + kMaxConsumerWarpgroups) * kBarrierBytes);
              EXPECT_EQ(s.total, s.anchors + 2 * blockM * kAccumulatorBytes + kSwizzlePeriodBytes)
                  << "an anchor a consumer thread, and room to align the base";
            }
}

}  // namespace
}  // namespace loom
