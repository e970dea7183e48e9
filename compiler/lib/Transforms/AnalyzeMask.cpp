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

// Varlen: r (blocks of `block` rows) cut to the documents of rows
// [first, last] (loom::withinDocuments): the bounds looked up once a CTA.
BlockRanges<Value> cutToDocuments(mlir::OpBuilder& builder, IndexMath& math, mlir::Location loc,
                                  const BlockRanges<Value>& r, int64_t block, Value first, Value last) {
  auto bound = [&](Value row, bool end) -> Value {
    return builder.create<DocumentBoundOp>(loc, builder.getI64Type(), row, end);
  };
  const Value begin = bound(first, false), end = bound(last, true);
  // 1 where both rows lie in one document (their documents' starts differ by P or more otherwise).
  const Value same = math.sub(math.c(1), math.min(math.sub(bound(last, false), begin), math.c(1)));
  return withinDocuments(math, r, block, begin, end, same);
}

// The last row of a block of `size` rows from `first`, cut at seqLen.
Value lastRow(IndexMath& math, Value first, int64_t size, Value seqLen) {
  return math.sub(math.min(math.add(first, math.c(size)), seqLen), math.c(1));
}

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
      // A decode step's rows end where its sequence does, cached tokens and new.
      Value seqLen = kernel.getDecode()
                         ? Value(builder.create<DecodeLenOp>(stream.getLoc(), builder.getI64Type(), loop.getBatch()))
                         : Value(builder.create<SeqLenOp>(stream.getLoc(), builder.getI64Type()));
      const ScheduleAttr schedule = kernel.getScheduleAttr();
      BlockRanges<Value> r = blockRanges(math, maskRuleOf(kernel.getSpec()), schedule.getBlockM(),
                                         schedule.getBlockN(), Value(loop.getRow0()), seqLen);
      if (kernel.getSpec().getVarlen())
        r = cutToDocuments(builder, math, stream.getLoc(), r, schedule.getBlockN(), loop.getRow0(),
                           lastRow(math, loop.getRow0(), schedule.getBlockM(), seqLen));
      if (kernel.getDecode()) {
        // A ragged step's grid counts its longest sequence's rows: a CTA
        // past its own sequence's rows (row0 at or beyond decode_len) owns
        // none and visits no key block.
        const Value live = math.clamp(math.sub(seqLen, loop.getRow0()), math.c(0), math.c(1));
        const Value hi = math.add(r.lo, math.mul(math.sub(r.hi, r.lo), live));
        r = {r.lo, math.min(r.ilo, hi), math.min(r.ihi, hi), hi};
      }
      if (kernel.getDecode() && schedule.getKvSplits() > 1) {
        // Each split CTA takes its even share of the visible blocks [lo, hi);
        // every range is clamped to that share.
        const Value split = splitIndexOf(math, launch.getBlockY(), schedule.getKvSplits());
        const Value share = math.ceilDiv(math.sub(r.hi, r.lo), math.c(schedule.getKvSplits()));
        const Value first = math.min(math.add(r.lo, math.mul(split, share)), r.hi);
        const Value last = math.min(math.add(first, share), r.hi);
        r = {first, math.clamp(r.ilo, first, last), math.clamp(r.ihi, first, last), last};
      }

      stream.getLowerMutable().assign(r.lo);
      stream.getUpperMutable().assign(r.hi);
      builder.setInsertionPoint(loop);
      const bool mixed = loop.getMixed();
      auto emitLoop = [&](Value lower, Value upper, bool masked, bool lowerEdge) {
        builder.create<KvLoopOp>(loop.getLoc(), lower, upper, loop.getRow0(), loop.getHead(), loop.getBatch(),
                                 masked, mixed, lowerEdge);
      };
      // The leading blocks' mask tests each row's first key alone where no
      // such block reaches past a row's last or the end (a forward's wide
      // window; a varlen block may end its document anywhere, and a decode
      // step's rows are its stacked heads').
      const bool lowerEdge = !kernel.getDecode() && !kernel.getSpec().getVarlen() &&
                             leadingBlocksCrossOnlyTheLowerEdge(maskRuleOf(kernel.getSpec()), schedule.getBlockM(),
                                                                schedule.getBlockN());
      emitLoop(r.lo, r.ilo, /*masked=*/true, lowerEdge);
      emitLoop(r.ilo, r.ihi, /*masked=*/false, false);
      emitLoop(r.ihi, r.hi, /*masked=*/true, false);
      loop.erase();
    }
    splitBackwardLoops();
  }

  // The backward's loops, each alone and masked until analysed: a dq_loop
  // over the key blocks of a query block (the forward's ranges), a q_loop
  // over the query blocks of a key block (the transposed ranges,
  // loom::queryBlockRanges).
  void splitBackwardLoops() {
    llvm::SmallVector<mlir::Operation*> loops;
    getOperation().walk([&](mlir::Operation* op) {
      if (llvm::isa<QLoopOp, DqLoopOp>(op)) loops.push_back(op);
    });
    for (mlir::Operation* op : loops) {
      mlir::Block* block = op->getBlock();
      auto siblings = [&](auto typed) {
        using Loop = decltype(typed);
        return llvm::count_if(*block, [](mlir::Operation& other) { return llvm::isa<Loop>(other); });
      };
      auto kernel = op->getParentOfType<KernelOp>();
      const ScheduleAttr schedule = kernel.getScheduleAttr();
      const MaskRule rule = maskRuleOf(kernel.getSpec());
      // The ranges are computed once, before any head loop around the loop.
      mlir::Operation* outer = op;
      while (!llvm::isa<LaunchOp>(outer->getParentOp())) outer = outer->getParentOp();
      mlir::OpBuilder hoisted(outer);
      IndexMath math(hoisted, op->getLoc());
      Value seqLen = hoisted.create<SeqLenOp>(op->getLoc(), hoisted.getI64Type());
      mlir::OpBuilder builder(op);
      if (auto loop = llvm::dyn_cast<QLoopOp>(op)) {
        if (siblings(QLoopOp{}) != 1 || !loop.getMasked()) continue;
        BlockRanges<Value> r = queryBlockRanges(math, rule, schedule.getBlockM(), schedule.getBlockN(),
                                                Value(loop.getCol0()), seqLen);
        if (kernel.getSpec().getVarlen())
          r = cutToDocuments(hoisted, math, op->getLoc(), r, schedule.getBlockM(), loop.getCol0(),
                             lastRow(math, loop.getCol0(), schedule.getBlockN(), seqLen));
        for (auto [lower, upper, masked] : {std::tuple{r.lo, r.ilo, true}, {r.ilo, r.ihi, false}, {r.ihi, r.hi, true}})
          builder.create<QLoopOp>(loop.getLoc(), lower, upper, loop.getCol0(), loop.getHead(), loop.getBatch(), masked,
                                  loop.getAtomicDq());
      } else {
        auto dq = llvm::cast<DqLoopOp>(op);
        if (siblings(DqLoopOp{}) != 1 || !dq.getMasked()) continue;
        BlockRanges<Value> r =
            blockRanges(math, rule, schedule.getBlockM(), schedule.getBlockN(), Value(dq.getRow0()), seqLen);
        if (kernel.getSpec().getVarlen())
          r = cutToDocuments(hoisted, math, op->getLoc(), r, schedule.getBlockN(),
                             dq.getRow0(), lastRow(math, dq.getRow0(), schedule.getBlockM(), seqLen));
        for (auto [lower, upper, masked] : {std::tuple{r.lo, r.ilo, true}, {r.ilo, r.ihi, false}, {r.ihi, r.hi, true}})
          builder.create<DqLoopOp>(dq.getLoc(), lower, upper, dq.getRow0(), dq.getHead(), dq.getBatch(), masked);
      }
      op->erase();
    }
  }
};

}  // namespace
}  // namespace loom::iha
