// The iha dialect's operations, generated from IhaOps.td.
#pragma once

#include "loom/Dialect/Iha/IhaDialect.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/PatternMatch.h"
#include "mlir/IR/SymbolTable.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#define GET_OP_CLASSES
#include "loom/Dialect/Iha/IhaOps.h.inc"

namespace loom::iha {

// A CUDA launch that takes loom::TmaMaps after its IhaArgs: the
// warp-specialised attention, and the key-block-outer and dq launches of a
// backward on wgmma (their K, V, Q and dO tiles, lse and D by TMA).
inline bool takesTensorMaps(KernelOp kernel, LaunchOp launch) {
  if (!launch.getBlock().getOps<WarpSpecializeOp>().empty()) return true;
  return kernel.getBackward() && kernel.getScheduleAttr() && kernel.getScheduleAttr().getEngine() == Engine::wgmma &&
         (launch.getSymName() == "iha_bwd_kv" || launch.getSymName() == "iha_bwd_q");
}

}  // namespace loom::iha
