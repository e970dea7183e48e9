// generateKernel: KernelSpec -> iha.kernel -> pipeline -> plan + C++ source.
#include <algorithm>
#include <regex>

#include "loom/counters.h"
#include "loom/Dialect/Iha/IhaOps.h"
#include "loom/Dialect/Iha/Passes.h"
#include "loom/Dialect/Iha/Schedule.h"
#include "loom/compiler.h"
#include "loom/hash.h"
#include "loom/tile/layout.h"
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
  ScheduleFields fields;
  fields.blockM = schedule.block_m();
  fields.blockN = schedule.block_n();
  fields.warps = schedule.warps();
  fields.stages = schedule.stages();
  fields.producerRegisters = schedule.producer_registers();
  if (schedule.engine() == v1::engine_mma) fields.engine = Engine::mma;
  if (schedule.engine() == v1::engine_wgmma) fields.engine = Engine::wgmma;
  if (schedule.mix() == v1::mix_fused) fields.mix = MixStrategy::fused;
  if (schedule.mix() == v1::mix_materialized) fields.mix = MixStrategy::materialized;
  if (schedule.collapse() == v1::collapse_fused) fields.collapse = CollapseStrategy::epilogue;
  if (schedule.collapse() == v1::collapse_separate) fields.collapse = CollapseStrategy::separate;
  if (schedule.dq() == v1::dq_separate) fields.dq = DqStrategy::separate;
  if (schedule.dq() == v1::dq_atomic) fields.dq = DqStrategy::atomic;
  fields.kvSplits = schedule.kv_splits();
  fields.stackHeads = schedule.stack_heads();
  fields.absorbMixing = schedule.absorb_mixing();
  fields.tensorMixing = schedule.tensor_mixing();
  return fields;
}

// A backward plan's schedule says how dq is done, a decode plan's how many
// CTAs split its key blocks.
Schedule scheduleOf(ScheduleAttr attr, Direction direction) {
  Schedule schedule;
  schedule.set_block_m(int32_t(attr.getBlockM()));
  schedule.set_block_n(int32_t(attr.getBlockN()));
  schedule.set_warps(int32_t(attr.getWarps()));
  schedule.set_stages(int32_t(attr.getStages()));
  schedule.set_mix(attr.getMix() == MixStrategy::fused ? v1::mix_fused : v1::mix_materialized);
  schedule.set_collapse(attr.getCollapse() == CollapseStrategy::epilogue ? v1::collapse_fused : v1::collapse_separate);
  schedule.set_engine(attr.getEngine() == Engine::wgmma ? v1::engine_wgmma : v1::engine_mma);
  schedule.set_producer_registers(int32_t(attr.getProducerRegisters()));
  if (direction == Direction::backward)
    schedule.set_dq(attr.getDq() == DqStrategy::atomic ? v1::dq_atomic : v1::dq_separate);
  if (direction == Direction::decode) {
    schedule.set_kv_splits(int32_t(attr.getKvSplits()));
    schedule.set_stack_heads(attr.getStackHeads());
    schedule.set_absorb_mixing(attr.getAbsorbMixing());
    schedule.set_tensor_mixing(attr.getTensorMixing());
  }
  return schedule;
}

// Dynamic shared memory of the CUDA attention CTA (tile/include/loom/tile/layout.h).
// `backward`: the forward launch of a backward plan, on mma.sync whatever
// the plan's engine (a backward's engine is its key-block-outer launch's).
int64_t attentionSharedMemory(SpecAttr spec, ScheduleAttr schedule, bool backward = false) {
  if (schedule.getTensorMixing())
    return tensorMixingSmem(int(oneCtaStepHeads(spec, schedule)), int(spec.getHeadDim()), int(schedule.getStages()),
                            int(spec.getHeads()), int(spec.getKvHeads()))
        .total;
  if (schedule.getAbsorbMixing())
    return absorbedSmem(int(schedule.getBlockM()), int(spec.getHeadDim()), int(schedule.getStages()),
                        int(spec.getKvHeads()), int(spec.getPseudoHeads()), int(schedule.getWarps()),
                        spec.getQkNorm() == QkNorm::rms)
        .total;
  const bool fusedGlobal =
      schedule.getCollapse() == CollapseStrategy::epilogue && spec.getCollapse() == CollapseMode::global;
  return ctaSharedMemory(schedule.getEngine() == Engine::wgmma && !backward, int(schedule.getBlockM()),
                         int(schedule.getBlockN()),
                         int(spec.getHeadDim()), int(schedule.getStages()), int(spec.getHeads()), int(spec.getKvHeads()),
                         int(spec.getPseudoHeads()), schedule.getMix() == MixStrategy::fused,
                         schedule.getCollapse() == CollapseStrategy::epilogue, fusedGlobal);
}

// The wgmma backward's key-block-outer CTA: one warpgroup (64 key rows),
// 64-row query blocks (the N of S^T and dP^T).
constexpr int64_t kWgmmaBackwardWarps = 4, kWgmmaBackwardRows = 64;

// Dynamic shared memory of a backward launch (layout.h: backwardSmem, or
// backwardWgmmaSmem for the key-block-outer launch on wgmma;
// collapseGradSmem, unmixSmem); 0 for the others.
int64_t backwardSharedMemory(SpecAttr spec, ScheduleAttr schedule, llvm::StringRef launch) {
  const int H = int(spec.getHeads()), P = int(spec.getPseudoHeads()), d = int(spec.getHeadDim());
  if (launch == kBackwardKvEntry && schedule.getEngine() == Engine::wgmma)
    return backwardWgmmaSmem(int(schedule.getBlockM()), int(schedule.getBlockN()), d).total;
  if (launch == kBackwardQEntry && schedule.getEngine() == Engine::wgmma)
    return backwardWgmmaDqSmem(int(schedule.getBlockM()), int(schedule.getBlockN()), d).total;
  if (launch == kBackwardKvEntry || launch == kBackwardQEntry)
    return backwardSmem(int(schedule.getBlockM()), int(schedule.getBlockN()), d,
                        launch == kBackwardKvEntry && schedule.getDq() == DqStrategy::atomic)
        .total;
  if (launch == kBackwardPrepEntry) return collapseGradSmem(H, P, spec.getCollapse() == CollapseMode::global);
  if (launch == kBackwardUnmixEntry) return unmixSmem(H, P, d);
  return 0;
}

void readPlan(KernelOp kernel, KernelPlan& plan) {
  const bool cuda = plan.target.kind() == v1::Target::cuda;
  for (LaunchOp launch : kernel.getBlock().getOps<LaunchOp>()) {
    const bool attention = launch.getSymName() == kAttentionEntry;
    const bool specialized = !launch.getBlock().getOps<WarpSpecializeOp>().empty();
    const bool premix = !launch.getBlock().getOps<PremixOp>().empty();
    const SpecAttr spec = kernel.getSpec();
    const int64_t sharedBytes =
        !cuda       ? 0
        : attention ? attentionSharedMemory(spec, kernel.getScheduleAttr(), kernel.getBackward())
        : premix    ? premixSmem(int(spec.getHeads()), int(spec.getKvHeads()), int(spec.getPseudoHeads()),
                                 int(spec.getHeadDim()), int(launch.getRowsPerCta()),
                                 int(launch.getThreads() / kThreadsPerWarp))
                    : backwardSharedMemory(spec, kernel.getScheduleAttr(), launch.getSymName());
    plan.launches.push_back({launch.getSymName().str(), int64_t(launch.getRowsPerToken()),
                             int64_t(launch.getRowsPerCta()), int64_t(launch.getGridY()),
                             int64_t(launch.getThreads()), sharedBytes, specialized,
                             cuda && takesTensorMaps(kernel, launch)});
    if (specialized && kernel.getBackward())
      plan.launches.back().ctasPerSm =
          backwardDqCtasPerSm(int(kernel.getScheduleAttr().getWarps()), int(kernel.getSpec().getHeadDim()));
    if (premix)
      plan.workspaces.insert(plan.workspaces.end(), {Workspace::q_mixed, Workspace::k_mixed, Workspace::v_mixed});
    bool storesRows = false;
    launch.walk([&](StoreRowsOp) { storesRows = true; });
    if (storesRows) plan.workspaces.push_back(Workspace::o_pseudo);
    bool storesSplits = false;
    launch.walk([&](StoreSplitOp) { storesSplits = true; });
    if (storesSplits) plan.workspaces.insert(plan.workspaces.end(), {Workspace::splits, Workspace::o_pseudo});
  }
  if (kernel.getBackward()) {
    plan.workspaces.insert(plan.workspaces.end(), {Workspace::do_pseudo, Workspace::delta, Workspace::dq_pseudo,
                                                   Workspace::dk_pseudo, Workspace::dv_pseudo, Workspace::partials});
  }
  plan.direction = kernel.getBackward() ? Direction::backward : kernel.getDecode() ? Direction::decode : Direction::forward;
  plan.mixedCache = kernel.getMixedCache();
  plan.schedule = scheduleOf(kernel.getScheduleAttr(), plan.direction);
  plan.workspaceElementBytes = cuda ? kTileElementBytes : int(sizeof(float));
}

// The dynamic shared memory one block may take on the target: its device's
// when the target names one, else the arch's.
int64_t sharedMemoryLimit(const v1::Target& target) {
  return target.device().shared_memory_per_block() > 0 ? target.device().shared_memory_per_block()
                                                       : defaultSharedMemoryPerBlock(target.arch());
}

// A decode step's default kv_splits. Its grid is a CTA per query head (or
// kv group, stacked) per sequence, far below the SMs at serving's small
// batches, and each CTA would walk its whole cache alone. Split each
// sequence's key blocks so that one sequence's step covers the SMs (larger
// batches cover them anyway; the splits cost them the combine's partial
// rows, a few percent of the cache's bytes at d 128); at most
// kDefaultKvSplits. The tuner searches the others.
// An absorbed step runs one CTA a sequence (every head in it), so its
// splits alone cover the SMs: up to kMaxKvSplits. A CTA of fewer than four
// warps (an absorbed step of few rows: H 16 P 1 is one warp) issues on that
// many of an SM's four sub-partitions: its splits cover the sub-partitions
// as far as the CTAs an SM's shared memory holds at once (H 16 G 4 P 1 d 64,
// one warp: four an SM, 512 splits on an H100; H = G = 16: two, 264), more
// would only queue in later waves and add the combine's partial rows.
constexpr int64_t kDefaultKvSplits = 16;
constexpr int64_t kSubPartitions = 4;  // an SM's warp schedulers
// A window bounds the keys a step sees whatever the cache holds: no more
// splits than its key blocks (the absorbed step's of kAbsorbedTokens
// tokens, the others' of 16 rows).
int32_t defaultDecodeSplits(const KernelSpec& spec, const ScheduleFields& given, const v1::Target& target) {
  const bool allHeads = given.absorbMixing || given.tensorMixing;
  const int64_t ctas = allHeads ? spec.heads() / oneCtaStepHeads(spec.heads(), spec.kv_heads(), spec.pseudo_heads(),
                                                                  spec.head_dim(), given.tensorMixing)
                       : given.stackHeads ? spec.kv_heads()
                                          : spec.heads();
  int64_t most = allHeads ? kMaxKvSplits : kDefaultKvSplits;
  const int64_t windowRows = spec.window_rows() > 0 ? spec.window_rows() + spec.pseudo_heads()
                                                    : int64_t(spec.window()) * spec.pseudo_heads();
  const int64_t mixingTokens = kTensorMixingTokens;
  const int64_t blockRows = given.absorbMixing   ? int64_t(kAbsorbedTokens) * spec.pseudo_heads()
                            : given.tensorMixing ? mixingTokens * spec.pseudo_heads()
                                                 : kMmaRows;
  if (windowRows > 0) most = std::min<int64_t>(most, windowRows / blockRows + 1);
  int64_t perSm = 1;
  if (given.absorbMixing) {  // the block and warps completeDecodeFields will give it
    const int P = int(spec.pseudo_heads()), d = int(spec.head_dim());
    const int64_t blockM = given.blockM ? given.blockM
                                        : absorbedBlockM(int(oneCtaStepHeads(spec.heads(), spec.kv_heads(), P, d,
                                                                             false)),
                                                         P);
    const int64_t ctaWarps = given.warps ? given.warps : absorbedWarps(int(blockM), P, d);
    const int64_t smem = absorbedSmem(int(blockM), d, int(given.stages ? given.stages : kDefaultStages),
                                      int(spec.kv_heads()), P, int(ctaWarps), spec.qk_norm() == v1::KernelSpec::rms)
                             .total;
    perSm = std::clamp<int64_t>(std::min(kSubPartitions / ctaWarps, sharedMemoryPerSmOf(target) / smem), 1,
                                kSubPartitions);
  }
  return int32_t(std::clamp<int64_t>(smCountOf(target) * perSm / std::max<int64_t>(ctas, 1), 1, most));
}

// CUDA targets: 16-bit inputs, and a schedule whose shared memory fits. An
// unset mix falls back to materialised when fused mixing's raw-row stages
// do not fit.
std::optional<std::string> fitCudaTarget(SpecAttr spec, ScheduleAttr& schedule, const Schedule& requested,
                                         const v1::Target& target, bool backward) {
  if (spec.getDtype() == ElementType::f32)
    return "dtype float32 is not supported on CUDA targets: the tensor cores take float16 or bfloat16 "
           "(loom run --backend cuda --dtype float16|bfloat16 converts a case)";
  if (schedule.getEngine() == Engine::wgmma && target.arch() != "sm_90a")
    return "schedule.engine wgmma needs target sm_90a (wgmma and setmaxnreg exist only there), not " + target.arch();
  const int64_t limit = sharedMemoryLimit(target);
  if (attentionSharedMemory(spec, schedule, backward) > limit && requested.mix() == v1::mix_unspecified) {
    schedule = ScheduleAttr::get(spec.getContext(), schedule.getBlockM(), schedule.getBlockN(), schedule.getWarps(),
                                 schedule.getStages(), MixStrategy::materialized, schedule.getCollapse(),
                                 schedule.getEngine(), schedule.getProducerRegisters(), schedule.getDq(),
                                 schedule.getKvSplits(), schedule.getStackHeads(), schedule.getAbsorbMixing(),
                                 schedule.getTensorMixing());
  }
  const int64_t bytes = attentionSharedMemory(spec, schedule, backward);
  if (bytes > limit)
    return "schedule needs " + std::to_string(bytes) + " bytes of shared memory per block, over the " +
           target.arch() + " limit of " + std::to_string(limit) + " (lower block_m, block_n or stages)";
  return std::nullopt;
}

// The mma.sync forward over mixed rows at head_dim 128, of the
// fields the schedule left unset: FlashAttention-2's shape, 128 query rows
// of four warps (two m-tiles a warp: each K and V fragment serves both) and
// 64-key blocks in the split pipeline of one K and one V tile (stages 1,
// loom/tile/cuda.h), 68 KB a CTA: two CTAs an SM on an A100. At -O3 the
// second m-tile spills; the generator asks ptxas for -O1 (generateKernel),
// which the premix beside it takes up to 16 source heads (attentionAtO1).
ScheduleAttr withFlashAttention2Shape(SpecAttr spec, ScheduleAttr schedule, const ScheduleFields& given,
                                      const v1::Target& target) {
  constexpr int64_t kRows = 128, kKeys = 64, kWarps = 4;
  if (schedule.getEngine() != Engine::mma || schedule.getMix() != MixStrategy::materialized) return schedule;
  if (given.blockM || given.blockN || given.warps || given.stages) return schedule;
  if (paddedHeadDim(int(spec.getHeadDim())) != 128 || spec.getPseudoHeads() > kRows) return schedule;
  if (!attentionAtO1(int(kRows / (kMmaRows * kWarps)), int(spec.getHeads()), int(spec.getKvHeads())))
    return schedule;  // at -O3 the second m-tile spills
  ScheduleAttr shaped = ScheduleAttr::get(spec.getContext(), kRows, kKeys, kWarps, /*stages=*/1, schedule.getMix(),
                                          schedule.getCollapse(), schedule.getEngine(), schedule.getProducerRegisters(),
                                          schedule.getDq(), schedule.getKvSplits(), schedule.getStackHeads(),
                                          schedule.getAbsorbMixing(), schedule.getTensorMixing());
  if (checkSchedule(spec, shaped) || attentionSharedMemory(spec, shaped) > sharedMemoryLimit(target)) return schedule;
  return shaped;
}

}  // namespace

std::string workspaceName(Workspace workspace) {
  switch (workspace) {
    case Workspace::q_mixed: return "q_mixed";
    case Workspace::k_mixed: return "k_mixed";
    case Workspace::v_mixed: return "v_mixed";
    case Workspace::o_pseudo: return "o_pseudo";
    case Workspace::do_pseudo: return "do_pseudo";
    case Workspace::delta: return "delta";
    case Workspace::dq_pseudo: return "dq_pseudo";
    case Workspace::dk_pseudo: return "dk_pseudo";
    case Workspace::dv_pseudo: return "dv_pseudo";
    case Workspace::partials: return "partials";
    case Workspace::splits: return "splits";
  }
  return "?";
}

int workspaceElementBytes(const KernelPlan& plan, Workspace workspace) {
  const bool tile = workspace == Workspace::q_mixed || workspace == Workspace::k_mixed ||
                    workspace == Workspace::v_mixed || workspace == Workspace::o_pseudo ||
                    workspace == Workspace::do_pseudo;
  return tile ? plan.workspaceElementBytes : int(sizeof(float));
}

Status canKeepForward(const KernelPlan& forward) {
  if (forward.direction != Direction::forward) return makeError("only a forward plan keeps its state for a backward");
  for (Workspace w : kKeptWorkspaces)
    if (std::find(forward.workspaces.begin(), forward.workspaces.end(), w) == forward.workspaces.end())
      return makeError("this forward keeps no " + workspaceName(w) + " for the backward: it needs schedule.mix "
                       "mix_materialized and schedule.collapse collapse_separate (the plan has " +
                       forward.schedule.ShortDebugString() + ")");
  return Status::success();
}

Status checkKeptFits(const KeptForward& kept, const KernelPlan& backward, int64_t batch, int64_t tokens) {
  for (Workspace w : kKeptWorkspaces) {
    const size_t want = size_t(workspaceElements(backward, w, batch, tokens)) * size_t(workspaceElementBytes(backward, w));
    auto found = kept.rows.find(w);
    const size_t have = found == kept.rows.end() ? 0 : found->second.size();
    if (have != want)
      return makeError("the kept forward's " + workspaceName(w) + " does not fit this backward (" +
                       std::to_string(have) + " bytes, want " + std::to_string(want) + ")");
  }
  if (kept.lse.size() != size_t(batch * backward.spec.heads() * tokens * backward.spec.pseudo_heads()))
    return makeError("the kept forward's lse does not fit this backward");
  return Status::success();
}

bool recomputesForward(const LaunchPlan& launch) {
  return launch.name == kPremixEntry || launch.name == kAttentionEntry;
}

int64_t partialEntries(const KernelSpec& spec) {
  return backwardPartialEntries(spec.heads(), spec.kv_heads(), spec.pseudo_heads(), spec.collapse() == v1::global);
}

int64_t workspaceElements(const KernelSpec& spec, Workspace workspace, int64_t batch, int64_t tokens) {
  const bool kv = workspace == Workspace::k_mixed || workspace == Workspace::v_mixed ||
                  workspace == Workspace::dk_pseudo || workspace == Workspace::dv_pseudo;
  const int64_t rows = batch * (kv ? spec.kv_heads() : spec.heads()) * tokens * spec.pseudo_heads();
  return workspace == Workspace::delta ? kRowStatsPlanes * rowStatsStride(rows) : rows * spec.head_dim();
}

int64_t workspaceElements(const KernelPlan& plan, Workspace workspace, int64_t batch, int64_t tokens) {
  if (workspace == Workspace::splits)
    return batch * plan.spec.heads() * std::max<int64_t>(plan.schedule.kv_splits(), 1) * tokens *
           plan.spec.pseudo_heads() * (plan.spec.head_dim() + 1);
  if (workspace != Workspace::partials) return workspaceElements(plan.spec, workspace, batch, tokens);
  for (const LaunchPlan& launch : plan.launches)
    if (launch.name == kBackwardPrepEntry)
      return batch * ((tokens + launch.rowsPerCta - 1) / launch.rowsPerCta) * partialEntries(plan.spec);
  return 0;
}

int64_t smCountOf(const v1::Target& target) {
  if (target.device().sm_count() > 0) return target.device().sm_count();
  const std::string& arch = target.arch();
  if (arch.rfind("sm_90", 0) == 0) return 132;
  if (arch == "sm_80") return 108;
  return 84;
}

int64_t sharedMemoryPerSmOf(const v1::Target& target) {
  if (target.device().shared_memory_per_multiprocessor() > 0) return target.device().shared_memory_per_multiprocessor();
  const std::string& arch = target.arch();
  if (arch.rfind("sm_90", 0) == 0 || arch.rfind("sm_10", 0) == 0) return 233472;  // as defaultSharedMemoryPerBlock
  if (arch == "sm_80" || arch == "sm_87") return 167936;
  return 102400;
}

int64_t defaultSharedMemoryPerBlock(const std::string& arch) {
  if (arch.rfind("sm_90", 0) == 0 || arch.rfind("sm_10", 0) == 0) return kHopperSharedMemoryPerBlock;  // 227 KiB
  if (arch == "sm_80" || arch == "sm_87") return 166912;                           // 163 KiB
  return 101376;                                                                    // 99 KiB (sm_86, sm_89)
}

v1::CompiledKernel toCompiledKernel(const KernelPlan& plan) {
  v1::CompiledKernel kernel;
  *kernel.mutable_spec() = plan.spec;
  *kernel.mutable_schedule() = plan.schedule;
  *kernel.mutable_target() = plan.target;
  kernel.set_source(plan.source);
  kernel.set_source_hash(plan.sourceHash);
  for (const LaunchPlan& launch : plan.launches) {
    v1::EntryPoint* entry = kernel.add_entries();
    entry->set_name(launch.name);
    entry->set_rows_per_token(launch.rowsPerToken);
    entry->set_rows_per_cta(launch.rowsPerCta);
    entry->set_grid_y(launch.gridY);
    entry->set_threads(int32_t(launch.threads));
    entry->set_shared_memory_bytes(launch.sharedMemoryBytes);
    entry->set_warp_specialized(launch.warpSpecialized);
    entry->set_tensor_maps(launch.tensorMaps);
  }
  for (Workspace w : plan.workspaces) kernel.add_workspaces(workspaceName(w));
  kernel.set_workspace_element_bytes(plan.workspaceElementBytes);
  kernel.set_direction(directionOf(plan.direction, plan.mixedCache));
  return kernel;
}

std::string tileHeaderFor(const v1::Target& target, const Schedule& schedule, Direction direction) {
  if (target.kind() != v1::Target::cuda) return "loom/tile/host.h";
  // A backward on wgmma is cuda.h's (its key-block-outer launch, bwgmma).
  return schedule.engine() == v1::engine_wgmma && direction != Direction::backward ? "loom/tile/hopper.h"
                                                                                     : "loom/tile/cuda.h";
}

namespace {
// "sm_" and two or three digits, "a" for the arch-specific features (sm_90a's wgmma).
const std::regex& cudaArchPattern() {
  static const std::regex pattern("sm_([0-9]{2,3})a?");
  return pattern;
}
}  // namespace

Status checkCudaArch(const std::string& arch) {
  std::smatch match;
  if (!std::regex_match(arch, match, cudaArchPattern())) return makeError("not a CUDA arch like sm_80 or sm_90a");
  if (std::stoi(match[1]) < kMinimumCudaArch)
    return makeError("unsupported arch (loom supports sm_" + std::to_string(kMinimumCudaArch) +
                     " and later: it needs cp.async and bfloat16 mma)");
  return Status::success();
}

Result<v1::Target> parseTarget(const std::string& name) {
  v1::Target target;
  if (name == "cpu") {
    target.set_kind(v1::Target::cpu);
    return target;
  }
  if (!std::regex_match(name, cudaArchPattern()))
    return makeError("target '" + name + "' is not cpu or a CUDA arch like sm_80, sm_90a");
  target.set_kind(v1::Target::cuda);
  target.set_arch(name);
  return target;
}

namespace {

// A context with the dialects loaded and diagnostics collected as text.
struct CompilerContext {
  mlir::MLIRContext context;
  std::string diagnostics;
  mlir::ScopedDiagnosticHandler handler;

  CompilerContext() : handler(&context, [this](mlir::Diagnostic& diagnostic) {
      if (!diagnostics.empty()) diagnostics += "; ";
      diagnostics += diagnostic.str();
      return mlir::success();
    }) {
    context.loadDialect<IhaDialect, mlir::arith::ArithDialect, mlir::emitc::EmitCDialect>();
  }
};

// The spec and its complete, checked schedule as attributes, the schedule's
// fields as given.
Result<std::pair<SpecAttr, ScheduleAttr>> resolveAsGiven(CompilerContext& c, const KernelSpec& spec,
                                                         const Schedule& schedule, const v1::Target& target,
                                                         Direction direction, bool mixedCache) {
  if (Status valid = validateSpec(spec); !valid) return valid.error();
  if (target.kind() == v1::Target::cuda)
    if (Status supported = checkCudaArch(target.arch()); !supported)
      return makeError("target '" + target.arch().substr(0, 40) + "': " + supported.error().message);
  const mlir::Location loc = mlir::UnknownLoc::get(&c.context);
  SpecAttr specAttr = SpecAttr::getChecked(
      [&] { return mlir::emitError(loc); }, &c.context, int64_t(spec.heads()), int64_t(spec.kv_heads()),
      int64_t(spec.pseudo_heads()), int64_t(spec.head_dim()), elementTypeOf(spec.dtype()), maskOf(spec.mask()),
      int64_t(spec.window()),
      spec.collapse() == v1::global ? CollapseMode::global : CollapseMode::per_head,
      llvm::APFloat(spec.rope_theta()), llvm::APFloat(effectiveScale(spec)),
      spec.qk_norm() == v1::KernelSpec::rms ? QkNorm::rms : QkNorm::none, llvm::APFloat(effectiveQkNormEps(spec)),
      spec.rope_direction() == v1::KernelSpec::negative ? RopeDirection::negative : RopeDirection::positive,
      spec.window_align() == v1::KernelSpec::token ? WindowAlign::token : WindowAlign::virtual_rows,
      int64_t(spec.window_rows()), spec.varlen(), static_cast<RopeTable>(int(spec.rope_table_dtype())));
  if (!specAttr) return makeError("spec: " + c.diagnostics);
  const bool hopper = target.kind() == v1::Target::cuda && target.arch() == "sm_90a";
  ScheduleFields given = fieldsOf(schedule);
  if (auto why = checkScheduleFields(given)) return makeError(*why);
  bool wgmmaBackward = false;  // a backward whose key-block-outer launch is on wgmma
  if (spec.varlen() && direction == Direction::decode)
    return makeError("varlen (packed documents) is for forward and backward plans; a decode step's sequences are "
                     "its page table's");
  if (given.kvSplits > 1 && direction != Direction::decode)
    return makeError("schedule.kv_splits is for decode plans only (it splits a decode step's cached key blocks)");
  if (given.stackHeads && direction != Direction::decode)
    return makeError("schedule.stack_heads is for decode plans only (it stacks a kv group's query heads in one CTA)");
  if (given.absorbMixing && (direction != Direction::decode || mixedCache))
    return makeError("schedule.absorb_mixing is for decode plans over a raw cache only (it never mixes the cached rows)");
  if (given.absorbMixing && target.kind() != v1::Target::cuda)
    return makeError("schedule.absorb_mixing needs a CUDA target (the host program mixes each cached row)");
  if (given.tensorMixing && (direction != Direction::decode || mixedCache))
    return makeError("schedule.tensor_mixing is for decode plans over a raw cache only (it mixes the cached rows)");
  if (given.tensorMixing && target.kind() != v1::Target::cuda)
    return makeError("schedule.tensor_mixing needs a CUDA target (the tensor cores)");
  if (direction == Direction::backward) {
    // Past kBackwardPartColumns (128) the key-block-outer and dq launches
    // split the gradient columns into parts, a CTA each (layout.h,
    // backwardColumnParts), whose widths the CUDA tiles take in 16s.
    if (target.kind() == v1::Target::cuda && !backwardPartsEven(int(spec.head_dim())))
      return makeError("head_dim " + std::to_string(spec.head_dim()) + " has no CUDA backward: above " +
                       std::to_string(kBackwardPartColumns) + " the gradient columns split into " +
                       std::to_string(backwardColumnParts(int(spec.head_dim()))) +
                       " parts a multiple of 16 wide each (head_dim 152-160, 184-192, 216-224 or 248-256)");
    // wgmma (sm_90a): one warpgroup of 64 key rows, 64-row query blocks
    // (loom/tile/cuda_backward.h, bwgmma), loads by TMA; the plan's other
    // launches are completed and checked on mma.sync, the engine put back
    // below.
    // The default on sm_90a where the spec allows it and the fields given
    // leave its tile free.
    wgmmaBackward = given.engine == Engine::wgmma ||
                    (!given.engine && hopper && wgmmaBackwardHeadDim(int(spec.head_dim())) &&
                     given.dq != DqStrategy::atomic && !given.warps && !given.blockM && !given.blockN);
    if (wgmmaBackward) {
      if (target.kind() != v1::Target::cuda || target.arch() != "sm_90a")
        return makeError("schedule.engine wgmma needs target sm_90a for a backward kernel (wgmma exists only there)");
      if (!wgmmaBackwardHeadDim(int(spec.head_dim())))
        return makeError("schedule.engine wgmma takes head_dim 64, 80, 96, 112, 128, 192 or 256 in a backward kernel "
                         "(128-byte swizzled tiles of 64 columns, a CTA's gradient columns whole tiles of them past "
                         "128), not " +
                         std::to_string(spec.head_dim()));
      if (given.dq == DqStrategy::atomic)
        return makeError("schedule.engine wgmma computes dq in its own launch in a backward kernel (dq separate)");
      if (!given.warps && !given.blockM && !given.blockN) {
        given.warps = kWgmmaBackwardWarps;
        given.blockM = std::max<int64_t>(kWgmmaBackwardRows, (spec.pseudo_heads() + 63) / 64 * 64);
        given.blockN = 16 * kWgmmaBackwardWarps;
      }
      given.engine = Engine::mma;
    }
    // Above head_dim 64 the key-block-outer CTA's dK and dV take 128
    // registers a thread: two warps on 32-row blocks leave S^T and dS^T
    // room (64-row query blocks spill); dq atomic's product on top of them
    // fits one warp on 16-row blocks (32-row ones spill 8 to 20 bytes).
    // Past head_dim 128 (a part of the columns a CTA: the same registers)
    // the tiles can outgrow a smaller SM's shared memory (sm_86, sm_89 at
    // head_dim 256): one warp on 16-row blocks there too.
    if (spec.head_dim() > 64 && !given.warps && !given.blockM && !given.blockN) {
      const bool atomic = given.dq == DqStrategy::atomic;
      auto blockM = [&](int64_t rows) { return (spec.pseudo_heads() + rows - 1) / rows * rows; };
      int64_t rows = atomic ? 16 : 32;
      if (target.kind() == v1::Target::cuda &&
          backwardSmem(int(blockM(rows)), int(rows), int(spec.head_dim()), atomic).total > sharedMemoryLimit(target))
        rows = 16;
      given.warps = rows / 16;
      given.blockM = blockM(rows);
      given.blockN = rows;
    }
    given.mix = given.mix.value_or(MixStrategy::materialized);
    given.collapse = given.collapse.value_or(CollapseStrategy::separate);
    given.engine = given.engine.value_or(Engine::mma);
  }
  if (direction == Direction::decode) {
    // The decode step mixes its rows as they stream from a raw cache (there
    // is no pre-mix of a cache), or reads a mixed cache's rows as stored: its
    // schedule's mix says which (fused, materialized), on the mma engine.
    const MixStrategy mix = mixedCache ? MixStrategy::materialized : MixStrategy::fused;
    if (given.mix && *given.mix != mix)
      return makeError(mixedCache ? "schedule.mix fused does not apply to a decode step over a mixed cache: its "
                                    "keys and values are read mixed (leave mix unset or materialized)"
                                  : "schedule.mix materialized does not apply to a decode step over a raw cache: it "
                                    "mixes each cached block as it streams (leave mix unset or fused)");
    if (!given.kvSplits && target.kind() == v1::Target::cuda && given.collapse.value_or(CollapseStrategy::separate) ==
                                                                     CollapseStrategy::separate)
      given.kvSplits = defaultDecodeSplits(spec, given, target);
    completeDecodeFields(given, mixedCache, spec.heads() / spec.kv_heads() * spec.pseudo_heads(),
                         oneCtaStepHeads(spec.heads(), spec.kv_heads(), spec.pseudo_heads(), spec.head_dim(),
                                         given.tensorMixing),
                         spec.pseudo_heads(), spec.head_dim(),
                         kTensorMixingTokens);
    // Split CTAs merge their rows in the combine launch, then collapse.
    if (given.kvSplits > 1) given.collapse = given.collapse.value_or(CollapseStrategy::separate);
  }
  ScheduleAttr scheduleAttr = completeSchedule(specAttr, given, hopper);
  if (auto why = checkSchedule(specAttr, scheduleAttr)) return makeError(*why);
  if (direction == Direction::backward) {
    if (wgmmaBackward)
      scheduleAttr = ScheduleAttr::get(specAttr.getContext(), scheduleAttr.getBlockM(), scheduleAttr.getBlockN(),
                                       scheduleAttr.getWarps(), scheduleAttr.getStages(), scheduleAttr.getMix(),
                                       scheduleAttr.getCollapse(), Engine::wgmma, scheduleAttr.getProducerRegisters(),
                                       scheduleAttr.getDq(), scheduleAttr.getKvSplits(), scheduleAttr.getStackHeads(),
                                       scheduleAttr.getAbsorbMixing(), scheduleAttr.getTensorMixing());
    if (auto why = checkBackwardKernelSchedule(specAttr, scheduleAttr)) return makeError(*why);
    if (target.kind() == v1::Target::cuda) {
      // The mma.sync backward (loom/tile/cuda_backward.h): warps own 16 key
      // rows each in the key-block-outer launch; dq has its own launch or is
      // added there by red.global.add.f32.
      if (scheduleAttr.getBlockN() % (kMmaRows * scheduleAttr.getWarps()) != 0)
        return makeError("schedule.block_n (" + std::to_string(scheduleAttr.getBlockN()) +
                         ") must be a multiple of 16 rows per warp x " + std::to_string(scheduleAttr.getWarps()) +
                         " warps for a CUDA backward kernel (its warps own the key rows)");
      const int64_t bytes = std::max<int64_t>(
          backwardSmem(int(scheduleAttr.getBlockM()), int(scheduleAttr.getBlockN()), int(spec.head_dim()),
                       scheduleAttr.getDq() == DqStrategy::atomic)
              .total,
          wgmmaBackward ? std::max(backwardWgmmaSmem(int(scheduleAttr.getBlockM()), int(scheduleAttr.getBlockN()),
                                                     int(spec.head_dim()))
                                       .total,
                                   backwardWgmmaDqSmem(int(scheduleAttr.getBlockM()), int(scheduleAttr.getBlockN()),
                                                       int(spec.head_dim()))
                                       .total)
                        : 0);
      const int64_t limit = sharedMemoryLimit(target);
      if (bytes > limit)
        return makeError("schedule needs " + std::to_string(bytes) + " bytes of shared memory per block in the "
                         "backward, over the " + target.arch() + " limit of " + std::to_string(limit) +
                         " (lower block_m or block_n)");
    }
  }
  if (target.kind() == v1::Target::cuda && direction == Direction::decode) {
    // A decode step keeps its mixing (fused over a raw cache): where the
    // stages do not fit, halve the key blocks, then keep one stage, then
    // collapse in its own launch (of the fields the schedule left unset).
    // wgmma keeps blocks of 64 keys and two stages at least.
    const int64_t limit = sharedMemoryLimit(target);
    const bool wgmma = scheduleAttr.getEngine() == Engine::wgmma;
    const int64_t leastBlockN = wgmma ? kWarpgroupRows : kMmaRows, leastStages = wgmma ? kMinWgmmaStages : 1;
    while (attentionSharedMemory(specAttr, scheduleAttr) > limit) {
      int64_t blockN = scheduleAttr.getBlockN(), stages = scheduleAttr.getStages();
      CollapseStrategy collapse = scheduleAttr.getCollapse();
      if (!given.blockN && blockN > leastBlockN) blockN /= 2;
      else if (!given.stages && stages > leastStages) stages = leastStages;
      else if (!given.collapse && collapse == CollapseStrategy::epilogue) collapse = CollapseStrategy::separate;
      else break;
      scheduleAttr = ScheduleAttr::get(specAttr.getContext(), scheduleAttr.getBlockM(), blockN, scheduleAttr.getWarps(),
                                       stages, scheduleAttr.getMix(), collapse,
                                       scheduleAttr.getEngine(), scheduleAttr.getProducerRegisters(),
                                       scheduleAttr.getDq(), scheduleAttr.getKvSplits(), scheduleAttr.getStackHeads(),
                                       scheduleAttr.getAbsorbMixing(), scheduleAttr.getTensorMixing());
    }
    if (auto why = checkSchedule(specAttr, scheduleAttr)) return makeError(*why);
  }
  if (target.kind() == v1::Target::cuda) {
    // A decode step keeps its mixing whatever shared memory it needs.
    Schedule requested = schedule;
    if (direction == Direction::decode) requested.set_mix(mixedCache ? v1::mix_materialized : v1::mix_fused);
    if (auto why = fitCudaTarget(specAttr, scheduleAttr, requested, target, direction == Direction::backward))
      return makeError(*why);
    if (direction == Direction::forward) scheduleAttr = withFlashAttention2Shape(specAttr, scheduleAttr, given, target);
  }
  return std::make_pair(specAttr, scheduleAttr);
}

// The same, with the defaults that depend on whether a schedule fits. A
// decode step over a raw cache (CUDA, the mma engine) holds every head in
// one CTA unless the schedule says (absorb_mixing and tensor_mixing unset):
// it absorbs the keys' and values' mixing into the queries and
// probabilities (the cached rows multiplied as stored), or mixes each
// cached token on the tensor cores, whichever multiplies less a cached
// token (P above 4 at head_dim 128; docs/performance.md, decode), each
// falling back to the other. Where neither can be had (the shape), it stacks a kv group's query heads in one CTA
// (stack_heads unset): each cached block is then staged and mixed once for
// the group's H / G heads, not once a head. Failing both, one head a CTA.
Result<std::pair<SpecAttr, ScheduleAttr>> resolve(CompilerContext& c, const KernelSpec& spec, const Schedule& schedule,
                                                  const v1::Target& target, Direction direction,
                                                  bool mixedCache = false) {
  const bool rawCudaMma = direction == Direction::decode && !mixedCache && target.kind() == v1::Target::cuda &&
                          schedule.engine() != v1::engine_wgmma;
  if (rawCudaMma && !schedule.has_absorb_mixing() && !schedule.has_tensor_mixing() && !schedule.stack_heads()) {
    // The one whose products cost less a cached token: absorbing multiplies
    // about H P^2 G d, mixing on the tensor cores about 24 H G d + 128 H d
    // (the keys' mix in bf16's two halves and P' V, G padded to 16; scores,
    // half of each product another head's; about half of all that where
    // H / G is even and a warp's two heads share their keys; layout.h).
    const bool tensorFirst =
        tensorMixingTokenMacs(int(spec.heads()), int(spec.kv_heads()), int(spec.head_dim()),
                              spec.dtype() == v1::bfloat16) <
        absorbedTokenMacs(int(spec.heads()), int(spec.kv_heads()), int(spec.pseudo_heads()), int(spec.head_dim()));
    for (const bool tensor : {tensorFirst, !tensorFirst}) {
      Schedule allHeads = schedule;
      if (tensor) allHeads.set_tensor_mixing(true);
      else allHeads.set_absorb_mixing(true);
      auto resolved = resolveAsGiven(c, spec, allHeads, target, direction, mixedCache);
      if (resolved) return resolved;
      c.diagnostics.clear();
    }
  }
  const bool stackByDefault = rawCudaMma && !schedule.has_stack_heads() && spec.kv_heads() > 0 &&
                              spec.heads() > spec.kv_heads();
  if (stackByDefault) {
    Schedule stacked = schedule;
    stacked.set_stack_heads(true);
    auto resolved = resolveAsGiven(c, spec, stacked, target, direction, mixedCache);
    if (resolved) return resolved;
    c.diagnostics.clear();
  }
  return resolveAsGiven(c, spec, schedule, target, direction, mixedCache);
}

}  // namespace

Result<Schedule> resolveSchedule(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                                 Direction direction, bool mixedCache) {
  CompilerContext c;
  auto resolved = resolve(c, spec, schedule, target, direction, mixedCache);
  if (!resolved) return resolved.error();
  return scheduleOf(resolved->second, direction);
}

Result<KernelPlan> generateKernel(const KernelSpec& spec, const Schedule& schedule, const v1::Target& target,
                                  const GenerateOptions& options) {
  count(Counter::programs_generated);
  CompilerContext c;
  mlir::MLIRContext& context = c.context;
  std::string& diagnostics = c.diagnostics;
  auto resolved = resolve(c, spec, schedule, target, options.direction, options.mixedCache);
  if (!resolved) return resolved.error();
  const auto [specAttr, scheduleAttr] = *resolved;
  const mlir::Location loc = mlir::UnknownLoc::get(&context);

  mlir::OpBuilder builder(&context);
  mlir::OwningOpRef<mlir::ModuleOp> module = mlir::ModuleOp::create(loc);
  builder.setInsertionPointToEnd(module->getBody());
  const bool decode = options.direction == Direction::decode;
  if (options.mixedCache && !decode) return makeError("a mixed cache belongs to a decode step (direction decode)");
  auto kernel = builder.create<KernelOp>(loc, "iha", specAttr, scheduleAttr,
                                         /*backward=*/options.direction == Direction::backward, decode,
                                         /*mixed_cache=*/decode && options.mixedCache);
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
  buildIhaLoweringPipeline(lowerPm, tileHeaderFor(target, plan.schedule, options.direction));
  if (mlir::failed(lowerPm.run(*module))) return makeError("compiler: " + diagnostics);

  llvm::raw_string_ostream sourceStream(plan.source);
  if (mlir::failed(mlir::emitc::translateToCpp(*module, sourceStream)))
    return makeError("compiler: EmitC translation failed: " + diagnostics);
  // The mma.sync attention (forward, decode) with two or more m-tiles a
  // warp, and the absorbed decode step: ptxas -O1 (loom::kPtxasOptionsLine
  // says why; the absorbed step, paper spec, sm_90a: 206 registers and no
  // spill at -O1, 255 and 16 bytes spilled at -O3, the same loop within 0.5%).
  const Schedule& resolvedSchedule = plan.schedule;
  const int mTiles = int(resolvedSchedule.block_m() / (kMmaRows * resolvedSchedule.warps()));
  if (target.kind() == v1::Target::cuda && options.direction != Direction::backward &&
      resolvedSchedule.engine() == v1::engine_mma &&
      (resolvedSchedule.absorb_mixing() || resolvedSchedule.tensor_mixing() ||
       attentionAtO1(mTiles, int(spec.heads()), int(spec.kv_heads()))))
    plan.source = std::string(kPtxasOptionsLine) + " -O1\n" + plan.source;
  plan.sourceHash = ContentHash().add(plan.source).hex();
  if (options.irLog) *options.irLog += irText;
  return plan;
}

}  // namespace loom
