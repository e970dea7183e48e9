// iha-analyze-mask: visit only the key blocks a query block can see, and run
// the blocks whose every pair is allowed without a mask.
//
// For a query block of virtual rows [r0, r1), r1 = min(r0 + block_m, L), the
// pass emits (as arithmetic on r0 and L, so it holds for every CTA and every
// run-time length) the range [lo, hi) of key blocks holding at least one
// allowed pair, and [ilo, ihi) of blocks whose every pair is allowed and in
// bounds. The derivation, for every mask mode, window alignment and
// window_rows, is loom::blockRanges (loom/mask_rule.h), the same one the cost
// model evaluates on integers. The masked loop over every block becomes
// masked [lo, ilo), interior [ilo, ihi), masked [ihi, hi).
#include "PassDetail.h"

namespace loom::iha {

#define GEN_PASS_DEF_IHAANALYZEMASK
#include "loom/Dialect/Iha/Passes.h.inc"

namespace {

using mlir::Value;

struct AnalyzeMask : impl::IhaAnalyzeMaskBase<AnalyzeMask> {
  void runOnOperation() override {
    llvm::SmallVector<KvStreamOp> streams;
    getOperation().walk([&](KvStreamOp stream) { streams.push_back(stream); });
    for (KvStreamOp stream : streams) {
      auto launch = stream->getParentOfType<LaunchOp>();
      auto kernel = launch->getParentOfType<KernelOp>();
      auto loops = llvm::to_vector(launch.getBlock().getOps<KvLoopOp>());
      // Analysed launches hold three loops; only the single unanalysed loop
      // over every key block is rewritten.
      if (loops.size() != 1 || !loops.front().getMasked()) continue;
      KvLoopOp loop = loops.front();

      mlir::OpBuilder builder(stream);
      IndexMath math(builder, stream.getLoc());
      Value seqLen = builder.create<SeqLenOp>(stream.getLoc(), builder.getI64Type());
      const ScheduleAttr schedule = kernel.getScheduleAttr();
      const BlockRanges<Value> r = blockRanges(math, maskRuleOf(kernel.getSpec()), schedule.getBlockM(),
                                               schedule.getBlockN(), Value(loop.getRow0()), seqLen);

      stream.getLowerMutable().assign(r.lo);
      stream.getUpperMutable().assign(r.hi);
      builder.setInsertionPoint(loop);
      const bool mixed = loop.getMixed();
      auto emitLoop = [&](Value lower, Value upper, bool masked) {
        builder.create<KvLoopOp>(loop.getLoc(), lower, upper, loop.getRow0(), loop.getHead(), loop.getBatch(),
                                 masked, mixed);
      };
      emitLoop(r.lo, r.ilo, /*masked=*/true);
      emitLoop(r.ilo, r.ihi, /*masked=*/false);
      emitLoop(r.ihi, r.hi, /*masked=*/true);
      loop.erase();
    }
  }
};

}  // namespace
}  // namespace loom::iha
