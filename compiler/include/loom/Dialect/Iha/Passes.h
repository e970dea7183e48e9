// The iha passes (Passes.td) and the pipeline that runs them in order.
#pragma once

#include <memory>

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/EmitC/IR/EmitC.h"
#include "mlir/Pass/Pass.h"
#include "mlir/Pass/PassManager.h"

namespace loom::iha {

#define GEN_PASS_DECL
#include "loom/Dialect/Iha/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "loom/Dialect/Iha/Passes.h.inc"

// iha-build-kernel .. iha-fuse-collapse, then canonicalize and cse: from an
// iha.kernel to its final launches (where the kernel plan is read).
void buildIhaSchedulingPipeline(mlir::OpPassManager& pm);

// iha-lower-to-emitc with the given tile header.
void buildIhaLoweringPipeline(mlir::OpPassManager& pm, const std::string& tileHeader);

// Both: the whole way from spec to EmitC.
void buildIhaPipeline(mlir::OpPassManager& pm, const std::string& tileHeader = "loom/tile/host.h");

}  // namespace loom::iha
