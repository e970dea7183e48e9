// iha-build-kernel: the spec-level program, one op per step of docs/IHA.md
// (and iha.backward after them in a backward kernel).
#include "PassDetail.h"

namespace loom::iha {

#define GEN_PASS_DEF_IHABUILDKERNEL
#include "loom/Dialect/Iha/Passes.h.inc"

namespace {

struct BuildKernel : impl::IhaBuildKernelBase<BuildKernel> {
  void runOnOperation() override {
    getOperation().walk([](KernelOp kernel) {
      if (!kernel.getBlock().empty()) return;  // already built
      auto builder = mlir::OpBuilder::atBlockEnd(&kernel.getBlock());
      const mlir::Location loc = kernel.getLoc();
      for (Role role : {Role::query, Role::key, Role::value})
        builder.create<MixOp>(loc, RoleAttr::get(kernel.getContext(), role));
      builder.create<AttendOp>(loc);
      builder.create<CollapseOp>(loc);
      if (kernel.getBackward()) builder.create<BackwardOp>(loc);
    });
  }
};

}  // namespace
}  // namespace loom::iha
