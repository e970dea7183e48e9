#include "loom/Dialect/Iha/Passes.h"
#include "mlir/Transforms/Passes.h"

namespace loom::iha {

void buildIhaSchedulingPipeline(mlir::OpPassManager& pm) {
  pm.addPass(createIhaBuildKernel());
  pm.addPass(createIhaApplySchedule());
  pm.addPass(createIhaAnalyzeMask());
  pm.addPass(createIhaFuseMixing());
  pm.addPass(createIhaFuseCollapse());
  pm.addPass(mlir::createCanonicalizerPass());
  pm.addPass(mlir::createCSEPass());
  pm.addPass(createIhaWarpSpecialize());
}

void buildIhaLoweringPipeline(mlir::OpPassManager& pm, const std::string& tileHeader) {
  IhaLowerToEmitCOptions options;
  options.tileHeader = tileHeader;
  pm.addPass(createIhaLowerToEmitC(options));
}

void buildIhaPipeline(mlir::OpPassManager& pm, const std::string& tileHeader) {
  buildIhaSchedulingPipeline(pm);
  buildIhaLoweringPipeline(pm, tileHeader);
}

}  // namespace loom::iha
