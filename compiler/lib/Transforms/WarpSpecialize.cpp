// iha-warp-specialize: with schedule engine = wgmma, the attention launch
// (and a backward's dq launch, iha_bwd_q) becomes an iha.warp_specialize
// whose two regions are slices of the one program. The producer slice keeps
// what it loads (every iha.kv_stream; the dq launch's dq_begin and
// dq_loops), the loops over heads around them, and the arithmetic their
// bounds need; the consumer slice is the rest (a backward's: the whole
// launch, its loads waiting on the producer's). A backward's key-block-outer
// launch is not split: a producer warpgroup beside its consumers (240
// registers) would cost its second CTA an SM.
// Both walk the same blocks in the same order, which is all the mbarrier
// ring between them relies on.
#include "PassDetail.h"
#include "loom/Dialect/Iha/Schedule.h"
#include "mlir/IR/IRMapping.h"

namespace loom::iha {

#define GEN_PASS_DEF_IHAWARPSPECIALIZE
#include "loom/Dialect/Iha/Passes.h.inc"

namespace {

// What a producer loads: the forward's key blocks, the backward's.
bool loads(mlir::Operation& op) { return llvm::isa<KvStreamOp, DqBeginOp, DqLoopOp>(op); }

// Drops from `block` whatever its loads do not need: other effects, head
// loops left without a load, and pure ops left without a use. Returns
// whether a load remains.
bool keepStreams(mlir::Block& block) {
  bool streams = false;
  for (mlir::Operation& op : llvm::make_early_inc_range(llvm::reverse(block))) {
    if (loads(op)) {
      streams = true;
    } else if (llvm::isa<ForEachHeadOp, ForGroupHeadsOp>(op)) {
      if (keepStreams(op.getRegion(0).front())) streams = true;
      else op.erase();
    } else if (!mlir::isPure(&op) || op.use_empty()) {
      op.erase();
    }
  }
  return streams;
}

struct WarpSpecialize : impl::IhaWarpSpecializeBase<WarpSpecialize> {
  void runOnOperation() override {
    getOperation().walk([&](KernelOp kernel) {
      if (!kernel.getScheduleAttr() || kernel.getScheduleAttr().getEngine() != Engine::wgmma) return;
      // A backward's recomputed forward stays on mma.sync; its attention
      // launches are wgmma's (loom/tile/cuda_backward.h, bwgmma).
      const llvm::StringRef name =
          kernel.getBackward() ? llvm::StringRef(kBackwardQEntry) : llvm::StringRef(kAttentionLaunch);
      LaunchOp launch = findLaunch(kernel, name);
      if (launch && launch.getBlock().getOps<WarpSpecializeOp>().empty()) split(launch);
    });
  }

  void split(LaunchOp launch) {
    mlir::Block& body = launch.getBlock();
    mlir::OpBuilder builder = mlir::OpBuilder::atBlockBegin(&body);
    auto split = builder.create<WarpSpecializeOp>(launch.getLoc());
    mlir::Block* producer = new mlir::Block();
    mlir::Block* consumer = new mlir::Block();
    split.getProducer().push_back(producer);
    split.getConsumer().push_back(consumer);
    for (mlir::Operation& op : llvm::make_early_inc_range(body))
      if (&op != split.getOperation()) op.moveBefore(consumer, consumer->end());

    mlir::IRMapping map;
    mlir::OpBuilder producerBuilder = mlir::OpBuilder::atBlockEnd(producer);
    for (mlir::Operation& op : *consumer) producerBuilder.clone(op, map);
    keepStreams(*producer);
    consumer->walk([](KvStreamOp stream) { stream.erase(); });
    launch.setThreads(launch.getThreads() + kWarpgroupWarps * kThreadsPerWarp);  // the producer warpgroup
  }
};

}  // namespace
}  // namespace loom::iha
