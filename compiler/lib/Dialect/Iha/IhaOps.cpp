#include "loom/Dialect/Iha/IhaOps.h"

#include "loom/Dialect/Iha/Schedule.h"
#include "mlir/IR/OpImplementation.h"
#include "mlir/IR/PatternMatch.h"

using namespace mlir;
using namespace loom::iha;

#define GET_OP_CLASSES
#include "loom/Dialect/Iha/IhaOps.cpp.inc"

LogicalResult KernelOp::verify() {
  if (auto schedule = getScheduleAttr()) {
    if (auto why = getBackward() ? checkBackwardKernelSchedule(getSpec(), schedule) : checkSchedule(getSpec(), schedule))
      return emitOpError() << *why;
  }
  bool specLevel = false, launchLevel = false;
  for (Operation& op : getBlock()) {
    specLevel |= isa<MixOp, AttendOp, CollapseOp, BackwardOp>(op);
    if (isa<BackwardOp>(op) && !getBackward()) return emitOpError() << "holds iha.backward but is not a backward kernel";
    launchLevel |= isa<LaunchOp>(op);
  }
  if (specLevel && launchLevel) return emitOpError() << "mixes spec-level steps with launches";
  if (getDecode() && getBackward()) return emitOpError() << "cannot be both a decode step and a backward";
  if (getMixedCache() && !getDecode()) return emitOpError() << "has a mixed_cache but is not a decode kernel";
  if (getScheduleAttr() && getScheduleAttr().getStackHeads() && !getDecode())
    return emitOpError() << "stacks heads (schedule stack_heads) but is not a decode kernel";
  if (getScheduleAttr() && getScheduleAttr().getAbsorbMixing() && (!getDecode() || getMixedCache()))
    return emitOpError() << "absorbs the mixing (schedule absorb_mixing) but is not a decode kernel over a raw cache";
  if (getScheduleAttr() && getScheduleAttr().getTensorMixing() && (!getDecode() || getMixedCache()))
    return emitOpError() << "mixes the cached rows on the tensor cores (schedule tensor_mixing) but is not a decode "
                            "kernel over a raw cache";
  if (launchLevel && !getScheduleAttr()) return emitOpError() << "has launches but no schedule";
  return success();
}

static LogicalResult verifyIndexArguments(Operation* op, Block& block, unsigned count, StringRef what) {
  if (block.getNumArguments() != count)
    return op->emitOpError() << "body must take " << count << " i64 arguments (" << what << ")";
  for (BlockArgument argument : block.getArguments())
    if (!argument.getType().isInteger(64)) return op->emitOpError() << "body arguments must be i64 (" << what << ")";
  return success();
}

LogicalResult LaunchOp::verify() {
  if (getRowsPerToken() < 1 || getRowsPerCta() < 1 || getGridY() < 1 || getThreads() < 1)
    return emitOpError() << "grid and block sizes must be positive";
  return verifyIndexArguments(*this, getBlock(), 3, "x block, y index, batch");
}

LogicalResult ForEachHeadOp::verify() {
  if (!(*this)->getParentOfType<LaunchOp>()) return emitOpError() << "must be inside an iha.launch";
  return verifyIndexArguments(*this, getBody().front(), 1, "head");
}

LogicalResult ForGroupHeadsOp::verify() {
  if (!(*this)->getParentOfType<LaunchOp>()) return emitOpError() << "must be inside an iha.launch";
  return verifyIndexArguments(*this, getBody().front(), 1, "query head");
}

// A loop whose bounds are one value runs no step.
template <class LoopOp>
static LogicalResult eraseEmptyLoop(LoopOp op, PatternRewriter& rewriter) {
  if (op.getLower() != op.getUpper()) return failure();
  rewriter.eraseOp(op);
  return success();
}
LogicalResult KvLoopOp::canonicalize(KvLoopOp op, PatternRewriter& rewriter) { return eraseEmptyLoop(op, rewriter); }
LogicalResult QLoopOp::canonicalize(QLoopOp op, PatternRewriter& rewriter) { return eraseEmptyLoop(op, rewriter); }
LogicalResult DqLoopOp::canonicalize(DqLoopOp op, PatternRewriter& rewriter) { return eraseEmptyLoop(op, rewriter); }

//===----------------------------------------------------------------------===//
// Block ops: each belongs to a launch; a few check more.
//===----------------------------------------------------------------------===//

static LogicalResult verifyInLaunch(Operation* op) {
  if (!op->getParentOfType<LaunchOp>()) return op->emitOpError() << "must be inside an iha.launch";
  return success();
}

#define IHA_BLOCK_OP_VERIFIER(Op) \
  LogicalResult Op::verify() { return verifyInLaunch(*this); }
IHA_BLOCK_OP_VERIFIER(SeqLenOp)

// A decode step's ops exist only in a decode kernel.
static LogicalResult verifyInDecode(Operation* op) {
  if (failed(verifyInLaunch(op))) return failure();
  auto kernel = op->getParentOfType<KernelOp>();
  if (!kernel || !kernel.getDecode()) return op->emitOpError() << "belongs to a decode kernel";
  return success();
}
LogicalResult DecodeLenOp::verify() { return verifyInDecode(*this); }
LogicalResult DocumentBoundOp::verify() {
  if (failed(verifyInLaunch(*this))) return failure();
  auto kernel = (*this)->getParentOfType<KernelOp>();
  if (!kernel || !kernel.getSpec().getVarlen()) return emitOpError() << "belongs to a kernel of a varlen spec";
  return success();
}
LogicalResult CachedRowsOp::verify() { return verifyInDecode(*this); }
LogicalResult AppendCacheOp::verify() { return verifyInDecode(*this); }
LogicalResult CombineSplitsOp::verify() { return verifyInDecode(*this); }
LogicalResult StoreSplitOp::verify() {
  if (failed(verifyInDecode(*this))) return failure();
  auto kernel = (*this)->getParentOfType<KernelOp>();
  if (kernel.getScheduleAttr() && kernel.getScheduleAttr().getKvSplits() < 2)
    return emitOpError() << "belongs to a kernel whose schedule splits its key blocks (kv_splits > 1)";
  return success();
}
IHA_BLOCK_OP_VERIFIER(PremixOp)
IHA_BLOCK_OP_VERIFIER(CollapseRowsOp)
IHA_BLOCK_OP_VERIFIER(LoadQOp)
IHA_BLOCK_OP_VERIFIER(KvStreamOp)
IHA_BLOCK_OP_VERIFIER(StoreRowsOp)
IHA_BLOCK_OP_VERIFIER(StoreCollapsedOp)
IHA_BLOCK_OP_VERIFIER(OutInitOp)
IHA_BLOCK_OP_VERIFIER(AccumulateCollapsedOp)
IHA_BLOCK_OP_VERIFIER(StoreOutOp)
IHA_BLOCK_OP_VERIFIER(WarpSpecializeOp)
IHA_BLOCK_OP_VERIFIER(CollapseGradOp)
IHA_BLOCK_OP_VERIFIER(KvGradStoreOp)
IHA_BLOCK_OP_VERIFIER(DqBeginOp)
IHA_BLOCK_OP_VERIFIER(DqStoreOp)
IHA_BLOCK_OP_VERIFIER(UnmixOp)
IHA_BLOCK_OP_VERIFIER(ReduceGradsOp)
#undef IHA_BLOCK_OP_VERIFIER

// A key-block loop consumes a K/V stream opened earlier in its block (or,
// warp-specialised, in the producer's slice), with the same mixing.
LogicalResult KvLoopOp::verify() {
  if (failed(verifyInLaunch(*this))) return failure();
  KvStreamOp stream;
  for (Operation* op = (*this)->getPrevNode(); op && !stream; op = op->getPrevNode())
    stream = dyn_cast<KvStreamOp>(op);
  if (!stream)
    if (auto split = (*this)->getParentOfType<WarpSpecializeOp>())
      split.getProducer().walk([&](KvStreamOp found) { stream = found; });
  if (!stream) return emitOpError() << "needs an iha.kv_stream before it in its block";
  if (stream.getMixed() != getMixed())
    return emitOpError() << "mixed (" << getMixed() << ") differs from its iha.kv_stream's (" << stream.getMixed() << ")";
  return success();
}

// The key-block-outer backward: a q_loop runs after its block's K/V load.
static LogicalResult verifyAfter(Operation* op, StringRef opener, function_ref<bool(Operation*)> opens) {
  if (failed(verifyInLaunch(op))) return failure();
  for (Operation* at = op; at; at = at->getParentOp()) {
    if (isa<LaunchOp>(at)) break;
    for (Operation* previous = at->getPrevNode(); previous; previous = previous->getPrevNode())
      if (opens(previous)) return success();
  }
  return op->emitOpError() << "needs an " << opener << " before it";
}

LogicalResult KvGradBeginOp::verify() { return verifyInLaunch(*this); }

LogicalResult QLoopOp::verify() {
  return verifyAfter(*this, "iha.kv_grad_begin", [](Operation* op) { return isa<KvGradBeginOp>(op); });
}

LogicalResult DqLoopOp::verify() {
  return verifyAfter(*this, "iha.dq_begin", [](Operation* op) { return isa<DqBeginOp>(op); });
}
