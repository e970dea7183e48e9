// iha-fuse-collapse: with schedule collapse = epilogue, the attention writes
// `out` itself and the collapse launch and the o_pseudo workspace go.
//   per_head: a query block holds whole tokens, so each CTA collapses its
//             own head's P rows per token (iha.store_collapsed).
//   global:   every output head mixes every head, so one CTA runs all heads
//             of its query block (iha.for_each_head) and accumulates the
//             output tile on chip before one store.
#include "PassDetail.h"

namespace loom::iha {

#define GEN_PASS_DEF_IHAFUSECOLLAPSE
#include "loom/Dialect/Iha/Passes.h.inc"

namespace {

void fusePerHead(LaunchOp attention) {
  attention.walk([](StoreRowsOp store) {
    mlir::OpBuilder builder(store);
    builder.create<StoreCollapsedOp>(store.getLoc(), store.getRow0(), store.getHead(), store.getBatch());
    store.erase();
  });
}

void fuseGlobal(LaunchOp attention) {
  mlir::Block& body = attention.getBlock();
  mlir::OpBuilder builder = mlir::OpBuilder::atBlockBegin(&body);
  const mlir::Location loc = attention.getLoc();
  builder.create<OutInitOp>(loc);
  auto heads = builder.create<ForEachHeadOp>(loc);
  mlir::Block* headBody = new mlir::Block();
  heads.getBody().push_back(headBody);
  mlir::Value head = headBody->addArgument(builder.getI64Type(), loc);

  // Everything after the for_each_head moves inside it, reading its head.
  headBody->getOperations().splice(headBody->end(), body.getOperations(), std::next(heads->getIterator()),
                                   body.end());
  attention.getBlockY().replaceAllUsesWith(head);

  heads.walk([&](StoreRowsOp store) {
    mlir::OpBuilder inner(store);
    inner.create<AccumulateCollapsedOp>(store.getLoc(), store.getRow0(), store.getHead(), store.getBatch());
    store.erase();
  });
  // row0 is computed inside the loop; recompute it after for the store.
  builder.setInsertionPointAfter(heads);
  IndexMath math(builder, loc);
  const int64_t blockM = attention.getRowsPerCta();
  mlir::Value row0 = math.mul(attention.getBlockX(), math.c(blockM));
  if (attention->getParentOfType<KernelOp>().getDecode())  // a decode step's rows start past the cache
    row0 = math.add(builder.create<CachedRowsOp>(loc, builder.getI64Type(), attention.getBatch()), row0);
  builder.create<StoreOutOp>(loc, row0, attention.getBatch());
  attention.setGridY(1);
}

struct FuseCollapse : impl::IhaFuseCollapseBase<FuseCollapse> {
  void runOnOperation() override {
    getOperation().walk([&](KernelOp kernel) {
      if (!kernel.getScheduleAttr() || kernel.getScheduleAttr().getCollapse() != CollapseStrategy::epilogue) return;
      LaunchOp collapse = findLaunch(kernel, kCollapseLaunch);
      if (!collapse) return;  // already fused
      collapse.erase();
      LaunchOp attention = findLaunch(kernel, kAttentionLaunch);
      if (!attention) return;
      if (kernel.getSpec().getCollapse() == CollapseMode::per_head) fusePerHead(attention);
      else fuseGlobal(attention);
    });
  }
};

}  // namespace
}  // namespace loom::iha
