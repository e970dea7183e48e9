#include "loom/Dialect/Iha/Passes.h"
#include "mlir/Transforms/Passes.h"

namespace loom::iha {

void buildIhaPipeline(mlir::OpPassManager& pm, const std::string& tileHeader) {
  pm.addPass(createIhaBuildKernel());
  pm.addPass(createIhaApplySchedule());
  pm.addPass(createIhaAnalyzeMask());
  pm.addPass(createIhaFuseMixing());
  pm.addPass(createIhaFuseCollapse());
  pm.addPass(mlir::createCanonicalizerPass());
  pm.addPass(mlir::createCSEPass());
  IhaLowerToEmitCOptions options;
  options.tileHeader = tileHeader;
  pm.addPass(createIhaLowerToEmitC(options));
}

}  // namespace loom::iha
