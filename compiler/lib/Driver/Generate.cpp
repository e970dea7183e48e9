// generateKernel: KernelSpec -> iha.kernel -> pipeline -> plan + C++ source.
#include <regex>

#include "loom/Dialect/Iha/IhaOps.h"
#include "loom/Dialect/Iha/Passes.h"
#include "loom/Dialect/Iha/Schedule.h"
#include "loom/compiler.h"
#include "loom/hash.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Target/Cpp/CppEmitter.h"
#include "mlir/Transforms/Passes.h"
#include "llvm/Support/raw_ostream.h"

namespace loom {
namespace {

using namespace loom::iha;

ElementType elementTypeOf(v1::DType dtype) {
  switch (dtype) {
    case v1::float16: return ElementType::f16;
    case v1::bfloat16: return ElementType::bf16;
    default: return ElementType::f32;
  }
}

MaskMode maskOf(v1::MaskMode mask) {
  switch (mask) {
    case v1::token_causal: return MaskMode::token_causal;
    case v1::none: return MaskMode::none;
    default: return MaskMode::flat_causal;
  }
}

ScheduleFields fieldsOf(const Schedule& schedule) {
  ScheduleFields fields{schedule.block_m(), schedule.block_n(), schedule.warps(), schedule.stages(), std::nullopt,
                        std::nullopt};
  if (schedule.mix() == v1::mix_fused) fields.mix = MixStrategy::fused;
  if (schedule.mix() == v1::mix_materialized) fields.mix = MixStrategy::materialized;
  if (schedule.collapse() == v1::collapse_fused) fields.collapse = CollapseStrategy::epilogue;
  if (schedule.collapse() == v1::collapse_separate) fields.collapse = CollapseStrategy::separate;
  return fields;
}

Schedule scheduleOf(ScheduleAttr attr) {
  Schedule schedule;
  schedule.set_block_m(int32_t(attr.getBlockM()));
  schedule.set_block_n(int32_t(attr.getBlockN()));
  schedule.set_warps(int32_t(attr.getWarps()));
  schedule.set_stages(int32_t(attr.getStages()));
  schedule.set_mix(attr.getMix() == MixStrategy::fused ? v1::mix_fused : v1::mix_materialized);
  schedule.set_collapse(attr.getCollapse() == CollapseStrategy::epilogue ? v1::collapse_fused : v1::collapse_separate);
  return schedule;
}

void readPlan(KernelOp kernel, KernelPlan& plan) {
  for (LaunchOp launch : kernel.getBlock().getOps<LaunchOp>()) {
    plan.launches.push_back({launch.getSymName().str(), int64_t(launch.getRowsPerToken()),
                             int64_t(launch.getRowsPerCta()), int64_t(launch.getGridY()),
                             int64_t(launch.getThreads())});
    if (!launch.getBlock().getOps<PremixOp>().empty())
      plan.workspaces.insert(plan.workspaces.end(), {Workspace::q_mixed, Workspace::k_mixed, Workspace::v_mixed});
    bool storesRows = false;
    launch.walk([&](StoreRowsOp) { storesRows = true; });
    if (storesRows) plan.workspaces.push_back(Workspace::o_pseudo);
  }
  plan.schedule = scheduleOf(kernel.getScheduleAttr());
}

}  // namespace

std::string workspaceName(Workspace workspace) {
  switch (workspace) {
    case Workspace::q_mixed: return "q_mixed";
    case Workspace::k_mixed: return "k_mixed";
    case Workspace::v_mixed: return "v_mixed";
    case Workspace::o_pseudo: return "o_pseudo";
  }
  return "?";
}

std::string tileHeaderFor(const v1::Target& target) {
  return target.kind() == v1::Target::cuda ? "loom/tile/cuda.h" : "loom/tile/host.h";
}

Result<v1::Target> parseTarget(const std::string& name) {
  v1::Target target;
  if (name == "cpu") {
    target.set_kind(v1::Target::cpu);
    return target;
  }
  if (!std::regex_match(name, std::regex("sm_[0-9]{2,3}a?")))
    return makeError("target '" + name + "' is not cpu or a CUDA arch like sm_80, sm_90a");
  target.set_kind(v1::Target::cuda);
  target.set_arch(name);
  return target;
}

Result<KernelPlan> generateKernel(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                                  const GenerateOptions& options) {
  if (Status valid = validateSpec(spec); !valid) return valid.error();

  mlir::MLIRContext context;
  context.loadDialect<IhaDialect, mlir::arith::ArithDialect, mlir::emitc::EmitCDialect>();
  std::string diagnostics;
  mlir::ScopedDiagnosticHandler handler(&context, [&](mlir::Diagnostic& diagnostic) {
    if (!diagnostics.empty()) diagnostics += "; ";
    diagnostics += diagnostic.str();
    return mlir::success();
  });

  const mlir::Location loc = mlir::UnknownLoc::get(&context);
  SpecAttr specAttr = SpecAttr::getChecked(
      [&] { return mlir::emitError(loc); }, &context, int64_t(spec.heads()), int64_t(spec.kv_heads()),
      int64_t(spec.pseudo_heads()), int64_t(spec.head_dim()), elementTypeOf(spec.dtype()), maskOf(spec.mask()),
      int64_t(spec.window()),
      spec.collapse() == v1::global ? CollapseMode::global : CollapseMode::per_head,
      llvm::APFloat(spec.rope_theta()), llvm::APFloat(effectiveScale(spec)));
  if (!specAttr) return makeError("spec: " + diagnostics);
  ScheduleAttr scheduleAttr = completeSchedule(specAttr, fieldsOf(schedule));
  if (auto why = checkSchedule(specAttr, scheduleAttr)) return makeError(*why);

  mlir::OpBuilder builder(&context);
  mlir::OwningOpRef<mlir::ModuleOp> module = mlir::ModuleOp::create(loc);
  builder.setInsertionPointToEnd(module->getBody());
  auto kernel = builder.create<KernelOp>(loc, "iha", specAttr, scheduleAttr);
  kernel.getBody().push_back(new mlir::Block());

  std::string irText;
  llvm::raw_string_ostream irStream(irText);
  auto configure = [&](mlir::PassManager& pm) {
    if (options.irLog) {
      context.disableMultithreading();
      pm.enableIRPrinting([](mlir::Pass*, mlir::Operation*) { return false; },
                          [](mlir::Pass*, mlir::Operation*) { return true; },
                          /*printModuleScope=*/true, /*printAfterOnlyOnChange=*/false,
                          /*printAfterOnlyOnFailure=*/false, irStream);
    }
  };

  // Phase 1: to launches; the plan is read here, before lowering erases it.
  mlir::PassManager schedulePm(&context);
  configure(schedulePm);
  buildIhaSchedulingPipeline(schedulePm);
  if (mlir::failed(schedulePm.run(*module))) return makeError("compiler: " + diagnostics);

  KernelPlan plan;
  plan.spec = spec;
  plan.target = target;
  readPlan(*module->getOps<KernelOp>().begin(), plan);

  // Phase 2: EmitC, then C++.
  mlir::PassManager lowerPm(&context);
  configure(lowerPm);
  buildIhaLoweringPipeline(lowerPm, tileHeaderFor(target));
  if (mlir::failed(lowerPm.run(*module))) return makeError("compiler: " + diagnostics);

  llvm::raw_string_ostream sourceStream(plan.source);
  if (mlir::failed(mlir::emitc::translateToCpp(*module, sourceStream)))
    return makeError("compiler: EmitC translation failed: " + diagnostics);
  plan.sourceHash = ContentHash().add(plan.source).hex();
  if (options.irLog) *options.irLog += irText;
  return plan;
}

}  // namespace loom
