// iha-warp-specialize: with schedule engine = wgmma, the attention launch
// becomes an iha.warp_specialize whose two regions are slices of the one
// program. The producer slice keeps every iha.kv_stream, the loops over
// heads around it, and the arithmetic its bounds need; the consumer slice is
// everything else. Both walk the same key blocks in the same order, which is
// all the mbarrier ring between them relies on.
#include "PassDetail.h"
#include "loom/Dialect/Iha/Schedule.h"
#include "mlir/IR/IRMapping.h"

namespace loom::iha {

#define GEN_PASS_DEF_IHAWARPSPECIALIZE
#include "loom/Dialect/Iha/Passes.h.inc"

namespace {

// Drops from `block` whatever a kv_stream does not need: other effects,
// head loops left without a stream, and pure ops left without a use.
// Returns whether a kv_stream remains.
bool keepStreams(mlir::Block& block) {
  bool streams = false;
  for (mlir::Operation& op : llvm::make_early_inc_range(llvm::reverse(block))) {
    if (llvm::isa<KvStreamOp>(op)) {
      streams = true;
    } else if (auto heads = llvm::dyn_cast<ForEachHeadOp>(op)) {
      if (keepStreams(heads.getBody().front())) streams = true;
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
      if (kernel.getBackward()) return;  // a backward's engine is its key-block-outer launch's (mma.sync forward)
      LaunchOp attention = findLaunch(kernel, kAttentionLaunch);
      if (!attention || !attention.getBlock().getOps<WarpSpecializeOp>().empty()) return;
      split(attention);
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
