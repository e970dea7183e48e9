// iha-analyze-mask: visit only the key blocks a query block can see, and run
// the blocks whose every pair is allowed without a mask.
//
// For a query block of virtual rows [r0, r1), r1 = min(r0 + block_m, L), the
// pass computes (as arithmetic on r0 and L, so it holds for every CTA and
// every run-time length) the range [lo, hi) of key blocks holding at least
// one allowed pair, and [ilo, ihi) of blocks whose every pair is allowed and
// in bounds. With tok(i) = i / P and the window W*P in rows:
//
//   flat_causal   hi  = (r1-1)/bn + 1            lo  = (r0 - W*P + 1)/bn
//                 ihi = (r0 + 1)/bn              ilo = ceil((r1-1 - W*P + 1)/bn)
//   token_causal  hi  = (P*(tok(r1-1)+1) - 1)/bn + 1
//                 lo  = P*(tok(r0) - W + 1)/bn
//                 ihi = P*(tok(r0) + 1)/bn       ilo = ceil(P*(tok(r1-1) - W + 1)/bn)
//   none          hi  = (P*(tok(r1-1) + W) - 1)/bn + 1 (all blocks when W = 0)
//                 lo  = as token_causal          ihi = P*(tok(r0) + W)/bn
//                 ilo = as token_causal
//
// (divisions floor; lo and ilo terms only exist when W > 0), then clamps:
// hi <= ceil(L/bn), ihi <= floor(L/bn) (a partial last block needs its bounds
// mask), lo <= ilo <= ihi <= hi. The masked loop over every block becomes
// masked [lo, ilo), interior [ilo, ihi), masked [ihi, hi).
#include "PassDetail.h"

namespace loom::iha {

#define GEN_PASS_DEF_IHAANALYZEMASK
#include "loom/Dialect/Iha/Passes.h.inc"

namespace {

using mlir::Value;

struct BlockRanges {
  Value lo, ilo, ihi, hi;
};

BlockRanges computeRanges(IndexMath& m, SpecAttr spec, int64_t blockM, int64_t blockN, Value row0, Value seqLen) {
  const int64_t P = spec.getPseudoHeads(), W = spec.getWindow();
  Value zero = m.c(0), one = m.c(1), bn = m.c(blockN), p = m.c(P);
  Value rowLast = m.sub(m.min(m.add(row0, m.c(blockM)), seqLen), one);
  Value tokFirst = m.floorDiv(row0, p), tokLast = m.floorDiv(rowLast, p);
  Value allBlocks = m.ceilDiv(seqLen, bn), fullBlocks = m.floorDiv(seqLen, bn);
  auto fromRow = [&](Value row) { return m.floorDiv(m.max(zero, row), bn); };       // block holding row
  auto afterRow = [&](Value row) { return m.add(m.floorDiv(row, bn), one); };      // one past it
  auto firstFullFrom = [&](Value row) { return m.ceilDiv(m.max(zero, row), bn); };  // first block starting >= row

  BlockRanges r{zero, zero, zero, allBlocks};
  switch (spec.getMask()) {
    case MaskMode::flat_causal:
      r.hi = afterRow(rowLast);
      r.ihi = m.floorDiv(m.add(row0, one), bn);
      if (W > 0) {
        r.lo = fromRow(m.sub(row0, m.c(W * P - 1)));
        r.ilo = firstFullFrom(m.sub(rowLast, m.c(W * P - 1)));
      }
      break;
    case MaskMode::token_causal:
      r.hi = afterRow(m.sub(m.mul(p, m.add(tokLast, one)), one));
      r.ihi = m.floorDiv(m.mul(p, m.add(tokFirst, one)), bn);
      if (W > 0) {
        r.lo = fromRow(m.mul(p, m.sub(tokFirst, m.c(W - 1))));
        r.ilo = firstFullFrom(m.mul(p, m.sub(tokLast, m.c(W - 1))));
      }
      break;
    case MaskMode::none:
      r.ihi = fullBlocks;
      if (W > 0) {
        r.hi = afterRow(m.sub(m.mul(p, m.add(tokLast, m.c(W))), one));
        r.ihi = m.floorDiv(m.mul(p, m.add(tokFirst, m.c(W))), bn);
        r.lo = fromRow(m.mul(p, m.sub(tokFirst, m.c(W - 1))));
        r.ilo = firstFullFrom(m.mul(p, m.sub(tokLast, m.c(W - 1))));
      }
      break;
  }
  // Clamp into lo <= ilo <= ihi <= hi <= ceil(L/bn), ihi <= floor(L/bn).
  // Without a window lo = ilo = 0 and the lower clamps are no-ops.
  if (!(spec.getMask() == MaskMode::none && W == 0)) r.hi = m.min(r.hi, allBlocks);
  if (spec.getMask() != MaskMode::none || W > 0) r.ihi = m.min(r.ihi, fullBlocks);
  if (W > 0) {
    r.lo = m.min(r.lo, r.hi);
    r.ilo = m.clamp(r.ilo, r.lo, r.hi);
    r.ihi = m.clamp(r.ihi, r.ilo, r.hi);
  } else if (spec.getMask() != MaskMode::none) {
    r.ihi = m.min(r.ihi, r.hi);
  }
  return r;
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
      Value seqLen = builder.create<SeqLenOp>(stream.getLoc(), builder.getI64Type());
      const ScheduleAttr schedule = kernel.getScheduleAttr();
      BlockRanges r = computeRanges(math, kernel.getSpec(), schedule.getBlockM(), schedule.getBlockN(),
                                    loop.getRow0(), seqLen);

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
