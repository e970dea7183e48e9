// The SASS reader (runtime/jit/sass.h) on checked-in excerpts of loom's own
// machine code (tests/data/sass: one tensor-core loop each, cut from
// `loom compile --sass-listing` of the paper's sm_90a default, H 16 P 4
// d 128 bf16 flat_causal), before and after the FlashAttention-3 loop and
// with its state warp-uniform, and on small listings written here that
// exercise the control-flow reading.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "jit/sass.h"
#include "test_util.h"

namespace loom {
namespace {

using jit::sass::analyzeFunction;
using jit::sass::parseListing;

std::string readExcerpt(const std::string& name) {
  std::ifstream in(testing::dataDir() + "/sass/" + name, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

v1::ResourceUsage analyze(const std::string& listing) {
  const auto functions = parseListing(listing);
  EXPECT_EQ(functions.size(), 1u);
  v1::ResourceUsage usage;
  if (!functions.empty()) analyzeFunction(functions[0], usage);
  return usage;
}

using jit::sass::classCount;

// The loop before: exponentials without .ftz (a range check and two
// predicated multiplies each), a separate scale, descriptors rebuilt per
// HGMMA, a 64-bit stage counter; ptxas hoists the wait for P V above every
// exponential; no ping-pong.
TEST(SassReader, ReadsTheOldLoop) {
  const v1::ResourceUsage u = analyze(readExcerpt("before-unmasked.sass"));
  ASSERT_EQ(u.loops_size(), 1);
  const v1::SassLoop& l = u.loops(0);
  EXPECT_EQ(l.instructions(), 930);
  EXPECT_EQ(classCount(l, "tensor"), 16);  // 8 HGMMA for S, 8 for P V
  EXPECT_EQ(l.exponentials(), 66);         // 64 of P, 2 corrections
  EXPECT_EQ(classCount(l, "fp32"), 536);
  EXPECT_DOUBLE_EQ(l.tensor_flops_per_warp(), 16 * 2.0 * 64 * 128 * 16 / 4);
  EXPECT_NEAR(l.instructions_per_tensor_mflop(), 930 / 1.048576, 1e-6);
  EXPECT_EQ(l.exponentials_in_pv_window(), 0);
  EXPECT_FALSE(l.ping_pong());
  EXPECT_TRUE(l.named_barriers_synced().empty());
  EXPECT_FALSE(l.masked());
  EXPECT_EQ(l.local_memory(), 0);
  // It misses the budget on both counts.
  const auto misses = jit::sass::budgetMisses(u, 128, true);
  EXPECT_EQ(misses.size(), 3u) << ::testing::PrintToString(misses);
}

// The loop now: one FFMA and one MUFU.EX2 an exponential, every exponential
// between the wait for S and the wait for P V, the turn taken on one named
// barrier and given on another.
TEST(SassReader, ReadsTheFlashAttention3Loop) {
  const v1::ResourceUsage u = analyze(readExcerpt("unmasked.sass"));
  ASSERT_EQ(u.loops_size(), 1);
  const v1::SassLoop& l = u.loops(0);
  EXPECT_EQ(classCount(l, "tensor"), 16);
  EXPECT_EQ(l.exponentials(), 66);
  EXPECT_LE(classCount(l, "fp32"), 272);  // max, FFMA, sum, rescale: 4 x 64 and the row bookkeeping
  EXPECT_EQ(l.exponentials_in_pv_window(), 66);
  EXPECT_TRUE(l.ping_pong());
  EXPECT_EQ(l.named_barriers_synced_size(), 1);
  EXPECT_EQ(l.named_barriers_arrived_size(), 1);
  EXPECT_FALSE(l.masked());
  EXPECT_LT(l.instructions(), 560);

  const v1::ResourceUsage m = analyze(readExcerpt("masked.sass"));
  ASSERT_EQ(m.loops_size(), 1);
  EXPECT_TRUE(m.loops(0).masked());
  EXPECT_GT(m.loops(0).instructions(), l.instructions());
}

// The loop since the pipeline's state became warp-uniform (uniform-*.sass):
// descriptors in uniform registers with no R2UR, Q as the register A operand
// of S = Q K^T (HGMMA with a register source and one descriptor), and the
// masked loop's mask as R2P (seven predicates from a byte) and FSEL. Cut at
// the loop text, so the counts are the issue's way of counting: under
// FlashAttention-3's 469 and 616.
TEST(SassReader, ReadsTheUniformLoop) {
  const v1::ResourceUsage u = analyze(readExcerpt("uniform-unmasked.sass"));
  ASSERT_EQ(u.loops_size(), 1);
  const v1::SassLoop& l = u.loops(0);
  EXPECT_EQ(l.instructions(), 453);
  EXPECT_EQ(classCount(l, "tensor"), 16);
  EXPECT_DOUBLE_EQ(l.tensor_flops_per_warp(), 16 * 2.0 * 64 * 128 * 16 / 4);  // register-A HGMMA counted alike
  EXPECT_EQ(classCount(l, "integer"), 8);
  EXPECT_EQ(l.exponentials_in_pv_window(), 66);
  EXPECT_TRUE(l.ping_pong());
  const std::string text = readExcerpt("uniform-unmasked.sass");
  EXPECT_EQ(text.find("R2UR"), std::string::npos);
  EXPECT_TRUE(jit::sass::budgetMisses(u, 128, true).empty());

  const v1::ResourceUsage m = analyze(readExcerpt("uniform-masked.sass"));
  ASSERT_EQ(m.loops_size(), 1);
  const v1::SassLoop& masked = m.loops(0);
  EXPECT_TRUE(masked.masked());
  EXPECT_EQ(masked.instructions(), 560);
  EXPECT_EQ(classCount(masked, "integer"), 40);
  EXPECT_NE(readExcerpt("uniform-masked.sass").find("R2P PR"), std::string::npos);
  EXPECT_TRUE(jit::sass::budgetMisses(m, 128, true).empty());
}

// Control flow: the loop is the natural loop of a back edge; a wait's retry
// placed after the exit (a branch out and one back in) belongs to it and is
// no loop of its own; a loop without tensor instructions is not reported,
// and of two nested tensor loops only the inner one is.
TEST(SassReader, FindsInnermostNaturalLoops) {
  const std::string listing = R"(
	.text.k:
        /*0000*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;
        /*0010*/                   MOV R0, RZ ;
.L_x_0:
        /*0020*/                   IADD3 R1, R1, 0x1, RZ ;
.L_x_1:
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+URZ], R3 ;
        /*0040*/              @!P0 BRA `(.L_x_9) ;
.L_x_2:
        /*0050*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0060*/                   MUFU.EX2 R5, R5 ;
        /*0070*/                   ISETP.NE.AND P1, PT, R1, 0x4, PT ;
        /*0080*/               @P1 BRA `(.L_x_1) ;
        /*0090*/                   ISETP.NE.AND P2, PT, R0, 0x8, PT ;
        /*00a0*/               @P2 BRA `(.L_x_0) ;
.L_x_3:
        /*00b0*/                   FADD R6, R6, 1 ;
        /*00c0*/                   ISETP.NE.AND P3, PT, R6, 0x8, PT ;
        /*00d0*/               @P3 BRA `(.L_x_3) ;
        /*00e0*/                   EXIT ;
.L_x_9:
        /*00f0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+URZ], R3 ;
        /*0100*/              @!P0 BRA `(.L_x_9) ;
        /*0110*/                   BRA `(.L_x_2) ;
)";
  const v1::ResourceUsage u = analyze(listing);
  ASSERT_EQ(u.setmaxnreg_size(), 1);
  EXPECT_EQ(u.setmaxnreg(0), 240);
  ASSERT_EQ(u.loops_size(), 1) << u.ShortDebugString();
  const v1::SassLoop& l = u.loops(0);
  EXPECT_EQ(l.first_offset(), 0x30);
  // 0x30..0x80 (six) and the out-of-line retry 0xf0..0x110 (three).
  EXPECT_EQ(l.instructions(), 9);
  EXPECT_DOUBLE_EQ(l.tensor_flops_per_warp(), 2.0 * 16 * 8 * 16);
  EXPECT_EQ(l.exponentials_in_pv_window(), -1);  // no wgmma waits
}

// A loop nested in a tensor-core loop (a copy loop with a runtime trip
// count) is counted once in its figures: the reader says so (inner_loops),
// leaving out waits (an mbarrier try-wait retried, an ELECT's loop).
TEST(SassReader, CountsTheLoopsNestedInATensorLoop) {
  const std::string listing = R"(
	.text.k:
        /*0000*/                   MOV R0, RZ ;
.L_x_0:
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
.L_x_1:
        /*0020*/                   LDGSTS.E.BYPASS.128 [R20], desc[UR4][R2.64] ;
        /*0030*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0040*/                   ISETP.NE.AND P1, PT, R1, R7, PT ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+URZ], R3 ;
        /*0070*/              @!P0 BRA `(.L_x_2) ;
        /*0080*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0090*/                   ISETP.NE.AND P2, PT, R0, 0x8, PT ;
        /*00a0*/               @P2 BRA `(.L_x_0) ;
        /*00b0*/                   EXIT ;
)";
  const v1::ResourceUsage u = analyze(listing);
  ASSERT_EQ(u.loops_size(), 1) << u.ShortDebugString();
  EXPECT_EQ(u.loops(0).instructions(), 10);  // 0x10..0xa0, the copy loop's body once
  EXPECT_EQ(u.loops(0).inner_loops(), 1);    // the copy loop, not the wait
  v1::ResourceUsage read = u;
  read.set_sass_read(true);
  EXPECT_NE(jit::sass::formatLoops({read}).find("holds 1 inner loop"), std::string::npos) << jit::sass::formatLoops({read});
}

// A switch's jump table (BRX, its labels in nvdisasm's BRANCH_TARGETS
// note) leads on to its cases: a tensor-core loop behind one is found (the
// fused-mixing wgmma consumer's was unreachable to the reader before).
TEST(SassReader, FollowsAJumpTable) {
  const std::string listing = R"(
	.text.k:
        /*0000*/                   MOV R4, 0x10 ;
        /*0010*/                   BRX R4 -0x20                                                    (*"BRANCH_TARGETS .L_x_5,.L_x_6"*);
.L_x_5:
        /*0020*/                   MOV R0, RZ ;
        /*0030*/                   BRA `(.L_x_0) ;
.L_x_6:
        /*0040*/                   MOV R0, 0x1 ;
.L_x_0:
        /*0050*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0060*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0070*/                   ISETP.NE.AND P2, PT, R0, 0x8, PT ;
        /*0080*/               @P2 BRA `(.L_x_0) ;
        /*0090*/                   EXIT ;
)";
  const v1::ResourceUsage u = analyze(listing);
  ASSERT_EQ(u.loops_size(), 1) << u.ShortDebugString();
  EXPECT_EQ(u.loops(0).first_offset(), 0x50);
  EXPECT_EQ(u.loops(0).instructions(), 4);
}

// The premix's shape: loops without tensor cores are read too, leaving out
// a shuffle's divergent path (taken by BRA.DIV only when the warp has
// diverged; its subroutine returns), and following ptxas's CALL.REL.NOINC
// out of a peeled loop; and the entry's memory instructions by width.
TEST(SassReader, ReadsLoopsWithoutTensorCoresAndMemoryWidths) {
  const std::string listing = R"(
	.text.k:
        /*0000*/                   LDG.E.128 R4, [R2.64] ;
        /*0010*/                   LDG.E.U16 R8, [R2.64+0x10] ;
        /*0020*/                   LDG.E R9, [R2.64+0x20] ;
        /*0030*/                   LDS.U16 R10, [R11] ;
.L_x_0:
        /*0040*/                   LDS.128 R12, [R11+0x10] ;
        /*0050*/                   FFMA R4, R12, R5, R4 ;
        /*0060*/                   BRA.DIV ~URZ, `(.L_x_8) ;
        /*0070*/                   SHFL.IDX PT, R6, R4, R7, 0x1f ;
.L_x_1:
        /*0080*/                   FFMA R4, R6, R5, R4 ;
        /*0090*/                   STG.E.64 desc[UR4][R2.64], R4 ;
        /*00a0*/                   ISETP.NE.AND P1, PT, R1, 0x4, PT ;
        /*00b0*/              @!P1 CALL.REL.NOINC `(.L_x_2) ;
        /*00c0*/                   BRA `(.L_x_0) ;
.L_x_2:
        /*00d0*/                   LDGSTS.E.BYPASS.128 [R20], desc[UR4][R2.64] ;
        /*00e0*/                   STG.E.U16 desc[UR4][R2.64], R4 ;
        /*00f0*/                   EXIT ;
.L_x_8:
        /*0100*/                   WARPSYNC R0 ;
        /*0110*/                   CALL.REL.NOINC `(.L_x_9) ;
        /*0120*/                   BRA `(.L_x_1) ;
.L_x_9:
        /*0130*/                   SHFL.IDX P0, R6, R4, R7, 0x1f ;
        /*0140*/                   RET.REL.NODEC R14 `(k) ;
)";
  const v1::ResourceUsage u = analyze(listing);
  EXPECT_EQ(u.loops_size(), 0);
  ASSERT_EQ(u.simt_loops_size(), 1) << u.ShortDebugString();
  const v1::SassLoop& l = u.simt_loops(0);
  EXPECT_EQ(l.first_offset(), 0x40);
  EXPECT_EQ(l.instructions(), 9);  // 0x40..0xc0; the divergent path 0x100..0x140 left out
  EXPECT_EQ(classCount(l, "fp32"), 2);
  EXPECT_EQ(classCount(l, "shuffle"), 1);
  const v1::SassMemory& m = u.memory();
  EXPECT_EQ(m.global_loads(), 3);
  EXPECT_EQ(m.global_loads_wide(), 1);
  EXPECT_EQ(m.global_loads_16bit(), 1);
  EXPECT_EQ(m.global_stores(), 2);
  EXPECT_EQ(m.global_stores_wide(), 1);
  EXPECT_EQ(m.global_stores_16bit(), 1);
  EXPECT_EQ(m.shared_loads(), 2);
  EXPECT_EQ(m.shared_loads_wide(), 1);
  EXPECT_EQ(m.shared_loads_16bit(), 1);
  EXPECT_EQ(m.async_copies(), 1);
  EXPECT_EQ(u.sass_reader(), jit::sass::kReaderVersion);
}

TEST(SassReader, ClassifiesOpcodes) {
  EXPECT_EQ(jit::sass::classOf("HGMMA.64x128x16.F32.BF16"), "tensor");
  EXPECT_EQ(jit::sass::classOf("MUFU.EX2"), "mufu_ex2");
  EXPECT_EQ(jit::sass::classOf("MUFU.RCP"), "mufu");
  EXPECT_EQ(jit::sass::classOf("FFMA.FTZ"), "fp32");
  EXPECT_EQ(jit::sass::classOf("F2FP.BF16.F32.PACK_AB"), "conversion");
  EXPECT_EQ(jit::sass::classOf("SHFL.BFLY"), "shuffle");
  EXPECT_EQ(jit::sass::classOf("IMAD.WIDE.U32"), "integer");
  EXPECT_EQ(jit::sass::classOf("R2UR"), "uniform");
  EXPECT_EQ(jit::sass::classOf("UIADD3"), "uniform");
  EXPECT_EQ(jit::sass::classOf("WARPGROUP.DEPBAR.LE"), "sync");
  EXPECT_EQ(jit::sass::classOf("BAR.ARV"), "sync");
  EXPECT_EQ(jit::sass::classOf("LDS.128"), "memory");
  EXPECT_EQ(jit::sass::classOf("STL"), "local");
  EXPECT_EQ(jit::sass::classOf("BRA"), "branch");
  EXPECT_EQ(jit::sass::classOf("MOV"), "other");
}

// The backward's gate (`loom compile --backward --sass`): an unmasked
// tensor-core loop over FlashAttention-3's backward figure is named with its
// entry, offset and figure; a masked loop is not held to it; local memory
// is a miss in any loop; a loop without tensor cores is not read.
TEST(SassGate, NamesEachBackwardLoopOverFlashAttention3s) {
  v1::ResourceUsage u;
  u.set_entry("iha_bwd_kv");
  auto loop = [&](int offset, double perMflop, bool masked, int local) {
    v1::SassLoop& l = *u.add_loops();
    l.set_first_offset(offset);
    l.set_tensor_flops_per_warp(1.048576e6);
    l.set_instructions_per_tensor_mflop(perMflop);
    l.set_masked(masked);
    l.set_local_memory(local);
  };
  loop(0x3a30, 407, false, 0);
  loop(0x1600, 600, true, 0);
  loop(0x5000, jit::sass::kFa3BackwardPerTensorMflop, false, 0);
  loop(0x6000, 300, true, 2);
  u.add_loops()->set_instructions_per_tensor_mflop(9999);  // no tensor cores
  const std::vector<std::string> misses = jit::sass::backwardGateMisses(u);
  ASSERT_EQ(misses.size(), 2u) << ::testing::PrintToString(misses);
  EXPECT_EQ(misses[0], "iha_bwd_kv loop at 0x3a30: 407 instructions per tensor MFLOP, over FlashAttention-3's backward "
                       "at head_dim 128 (371)");
  EXPECT_EQ(misses[1], "iha_bwd_kv loop at 0x6000 (masked): 2 local-memory instructions");
  // At head_dim 256 FA3's hdim-256 loop is the budget: the loop at it
  // (371) misses there too; with no anchor (head_dim 64) only local memory.
  const std::vector<std::string> wide = jit::sass::backwardGateMisses(u, 256);
  ASSERT_EQ(wide.size(), 3u) << ::testing::PrintToString(wide);
  EXPECT_EQ(wide[1], "iha_bwd_kv loop at 0x5000: 371 instructions per tensor MFLOP, over FlashAttention-3's backward "
                     "at head_dim 256 (329)");
  EXPECT_EQ(jit::sass::backwardGateMisses(u, 64).size(), 1u);
}

}  // namespace
}  // namespace loom
