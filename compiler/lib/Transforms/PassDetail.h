// Private to the iha passes: the generated pass bases and small helpers.
#pragma once

#include "loom/Dialect/Iha/IhaOps.h"
#include "loom/Dialect/Iha/Passes.h"
#include "loom/compiler.h"
#include "loom/mask_rule.h"
#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/IR/Builders.h"

namespace loom::iha {

// Launch names the passes agree on.
inline constexpr llvm::StringLiteral kPremixLaunch = "iha_premix";
inline constexpr llvm::StringLiteral kAttentionLaunch = loom::kAttentionEntry;
inline constexpr llvm::StringLiteral kCollapseLaunch = "iha_collapse";
inline constexpr llvm::StringLiteral kDecodeAppendLaunch = loom::kDecodeAppendEntry;
inline constexpr llvm::StringLiteral kDecodeCombineLaunch = loom::kDecodeCombineEntry;
// The backward's (docs/compiler.md, "The backward").
inline constexpr llvm::StringLiteral kBwdPrepLaunch = loom::kBackwardPrepEntry;
inline constexpr llvm::StringLiteral kBwdKvLaunch = loom::kBackwardKvEntry;
inline constexpr llvm::StringLiteral kBwdQLaunch = loom::kBackwardQEntry;
inline constexpr llvm::StringLiteral kBwdUnmixLaunch = loom::kBackwardUnmixEntry;
inline constexpr llvm::StringLiteral kBwdReduceLaunch = loom::kBackwardReduceEntry;

inline LaunchOp findLaunch(KernelOp kernel, llvm::StringRef name) {
  for (auto launch : kernel.getBlock().getOps<LaunchOp>())
    if (launch.getSymName() == name) return launch;
  return {};
}

// The spec's mask as intervals (loom/mask_rule.h).
inline MaskRule maskRuleOf(SpecAttr spec) {
  const v1::MaskMode mask = spec.getMask() == MaskMode::token_causal ? v1::token_causal
                            : spec.getMask() == MaskMode::none       ? v1::none
                                                                     : v1::flat_causal;
  return MaskRule::of(mask, spec.getPseudoHeads(), spec.getWindow(), spec.getWindowAlign() == WindowAlign::token,
                      spec.getWindowRows());
}

// i64 arithmetic for index computations; canonicalisation folds constants.
class IndexMath {
 public:
  IndexMath(mlir::OpBuilder& builder, mlir::Location loc) : b_(builder), loc_(loc) {}
  mlir::Value c(int64_t value) { return b_.create<mlir::arith::ConstantIntOp>(loc_, value, 64); }
  mlir::Value add(mlir::Value x, mlir::Value y) { return b_.create<mlir::arith::AddIOp>(loc_, x, y); }
  mlir::Value sub(mlir::Value x, mlir::Value y) { return b_.create<mlir::arith::SubIOp>(loc_, x, y); }
  mlir::Value mul(mlir::Value x, mlir::Value y) { return b_.create<mlir::arith::MulIOp>(loc_, x, y); }
  mlir::Value floorDiv(mlir::Value x, mlir::Value y) { return b_.create<mlir::arith::FloorDivSIOp>(loc_, x, y); }
  mlir::Value rem(mlir::Value x, mlir::Value y) { return b_.create<mlir::arith::RemSIOp>(loc_, x, y); }
  mlir::Value ceilDiv(mlir::Value x, mlir::Value y) { return b_.create<mlir::arith::CeilDivSIOp>(loc_, x, y); }
  mlir::Value max(mlir::Value x, mlir::Value y) { return b_.create<mlir::arith::MaxSIOp>(loc_, x, y); }
  mlir::Value min(mlir::Value x, mlir::Value y) { return b_.create<mlir::arith::MinSIOp>(loc_, x, y); }
  mlir::Value clamp(mlir::Value x, mlir::Value lo, mlir::Value hi) { return min(max(x, lo), hi); }

 private:
  mlir::OpBuilder& b_;
  mlir::Location loc_;
};

// A decode kernel with kv_splits S runs S attention CTAs per (query block,
// head): grid y = head * S + split. iha-apply-schedule lays the grid out;
// iha-analyze-mask gives each split its share of the key blocks.
inline mlir::Value splitHeadOf(IndexMath& math, mlir::Value blockY, int64_t splits) {
  return splits == 1 ? blockY : math.floorDiv(blockY, math.c(splits));
}
inline mlir::Value splitIndexOf(IndexMath& math, mlir::Value blockY, int64_t splits) {
  return math.rem(blockY, math.c(splits));
}

}  // namespace loom::iha
