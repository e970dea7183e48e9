// loom-opt: mlir-opt for the iha dialect. Runs iha passes (and MLIR's own)
// on .mlir files, for lit tests and for engineers watching a pass work.
#include "loom/Dialect/Iha/IhaOps.h"
#include "loom/Dialect/Iha/Passes.h"
#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/EmitC/IR/EmitC.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "mlir/Transforms/Passes.h"

int main(int argc, char** argv) {
  mlir::DialectRegistry registry;
  registry.insert<loom::iha::IhaDialect, mlir::arith::ArithDialect, mlir::emitc::EmitCDialect>();
  loom::iha::registerIhaPasses();
  mlir::registerCanonicalizerPass();
  mlir::registerCSEPass();
  mlir::PassPipelineRegistration<>("iha-pipeline", "the whole way from an iha.kernel to EmitC",
                                   [](mlir::OpPassManager& pm) { loom::iha::buildIhaPipeline(pm); });
  return mlir::asMainReturnCode(mlir::MlirOptMain(argc, argv, "loom-opt: the iha dialect's pass driver\n", registry));
}
