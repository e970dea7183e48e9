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
    if (auto why = checkSchedule(getSpec(), schedule)) return emitOpError() << *why;
  }
  bool specLevel = false, launchLevel = false;
  for (Operation& op : getBlock()) {
    specLevel |= isa<MixOp, AttendOp, CollapseOp>(op);
    launchLevel |= isa<LaunchOp>(op);
  }
  if (specLevel && launchLevel) return emitOpError() << "mixes spec-level steps with launches";
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

LogicalResult ForEachHeadOp::verify() { return verifyIndexArguments(*this, getBody().front(), 1, "head"); }

LogicalResult KvLoopOp::canonicalize(KvLoopOp op, PatternRewriter& rewriter) {
  if (op.getLower() != op.getUpper()) return failure();
  rewriter.eraseOp(op);
  return success();
}
