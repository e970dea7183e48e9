// iha-fuse-mixing: with schedule mix = fused, the attention mixes (and
// rotates) its own query block and K/V tiles from q, k, v and the weights,
// so the pre-mix launch and its three workspaces disappear.
#include "PassDetail.h"

namespace loom::iha {

#define GEN_PASS_DEF_IHAFUSEMIXING
#include "loom/Dialect/Iha/Passes.h.inc"

namespace {

struct FuseMixing : impl::IhaFuseMixingBase<FuseMixing> {
  void runOnOperation() override {
    getOperation().walk([&](KernelOp kernel) {
      if (!kernel.getScheduleAttr() || kernel.getScheduleAttr().getMix() != MixStrategy::fused) return;
      LaunchOp premix = findLaunch(kernel, kPremixLaunch);
      if (!premix) return;  // already fused
      premix.erase();
      if (LaunchOp attention = findLaunch(kernel, kAttentionLaunch)) {
        attention.walk([](mlir::Operation* op) {
          if (auto load = llvm::dyn_cast<LoadQOp>(op)) load.setMixed(true);
          if (auto stream = llvm::dyn_cast<KvStreamOp>(op)) stream.setMixed(true);
          if (auto loop = llvm::dyn_cast<KvLoopOp>(op)) loop.setMixed(true);
        });
      }
    });
  }
};

}  // namespace
}  // namespace loom::iha
