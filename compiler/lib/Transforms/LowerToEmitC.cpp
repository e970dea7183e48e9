// iha-lower-to-emitc: launches become EmitC functions that call the tile API.
//
// The tile API (runtime/tile) is one interface with a host and a CUDA
// implementation; the program only names `loom::` calls, so the same source
// compiles against either. Per kernel the pass emits:
//   #include "<tile header>"
//   struct IhaConfig { ...spec and schedule as constants... };
//   LOOM_KERNEL void <launch>(loom::IhaArgs args) { ... }   // one per launch
#include <cmath>
#include <cstdio>

#include "PassDetail.h"
#include "llvm/ADT/TypeSwitch.h"
#include "mlir/IR/IRMapping.h"

namespace loom::iha {

#define GEN_PASS_DEF_IHALOWERTOEMITC
#include "loom/Dialect/Iha/Passes.h.inc"

namespace {

using mlir::Value;

constexpr llvm::StringLiteral kConfigName = "IhaConfig";
constexpr llvm::StringLiteral kArgsType = "loom::IhaArgs";

std::string floatLiteral(double value) {
  char text[48];
  std::snprintf(text, sizeof text, "%.9ef", value);
  return text;
}

std::string configStruct(SpecAttr spec, ScheduleAttr schedule) {
  auto line = [](llvm::StringRef type, llvm::StringRef name, const std::string& value) {
    return ("  static constexpr " + type + " " + name + " = " + value + ";\n").str();
  };
  std::string text = "struct " + kConfigName.str() + " {\n";
  text += line("int", "heads", std::to_string(spec.getHeads()));
  text += line("int", "kv_heads", std::to_string(spec.getKvHeads()));
  text += line("int", "pseudo_heads", std::to_string(spec.getPseudoHeads()));
  text += line("int", "head_dim", std::to_string(spec.getHeadDim()));
  text += line("loom::DType", "dtype", "loom::DType::" + stringifyElementType(spec.getDtype()).str());
  text += line("loom::Mask", "mask", "loom::Mask::" + stringifyMaskMode(spec.getMask()).str());
  text += line("int", "window", std::to_string(spec.getWindow()));
  text += line("loom::Collapse", "collapse", "loom::Collapse::" + stringifyCollapseMode(spec.getCollapse()).str());
  text += line("float", "rope_theta", floatLiteral(spec.getRopeTheta().convertToDouble()));
  text += line("float", "scale", floatLiteral(spec.getScale().convertToDouble()));
  text += line("int", "block_m", std::to_string(schedule.getBlockM()));
  text += line("int", "block_n", std::to_string(schedule.getBlockN()));
  text += line("int", "warps", std::to_string(schedule.getWarps()));
  text += line("int", "stages", std::to_string(schedule.getStages()));
  const bool fusedMix = schedule.getMix() == MixStrategy::fused;
  const bool fusedGlobal =
      schedule.getCollapse() == CollapseStrategy::epilogue && spec.getCollapse() == CollapseMode::global;
  text += line("bool", "fused_mix", fusedMix ? "true" : "false");
  text += line("bool", "fused_collapse", schedule.getCollapse() == CollapseStrategy::epilogue ? "true" : "false");
  text += line("bool", "fused_global_collapse", fusedGlobal ? "true" : "false");
  // Rotary inverse frequencies theta^(-2j/d), computed here in double so
  // device code needs no pow / exp2 of its own.
  const double theta = spec.getRopeTheta().convertToDouble();
  if (theta > 0) {
    std::string table;
    for (int64_t j = 0; j < spec.getHeadDim() / 2; ++j) {
      char value[40];
      std::snprintf(value, sizeof value, "%s%.17g", j ? ", " : "", std::pow(theta, -2.0 * double(j) / double(spec.getHeadDim())));
      table += value;
    }
    text += line("double", "rope_inv_freq[" + std::to_string(spec.getHeadDim() / 2) + "]", "{" + table + "}");
  }
  return text + "};";
}

// Emits one launch body op by op; `map` carries values across.
class LaunchLowering {
 public:
  LaunchLowering(mlir::OpBuilder& builder, KernelOp kernel, Value args)
      : b_(builder), kernel_(kernel), args_(args), ctx_(builder.getContext()) {}

  mlir::LogicalResult lowerBlock(mlir::Block& block) {
    for (mlir::Operation& op : block)
      if (mlir::failed(lowerOp(&op))) return mlir::failure();
    return mlir::success();
  }

  mlir::IRMapping map;

 private:
  mlir::Type opaque(llvm::StringRef type) { return mlir::emitc::OpaqueType::get(ctx_, type); }
  mlir::Type tile(llvm::StringRef name) { return opaque(("loom::" + name + "<" + kConfigName + ">").str()); }
  mlir::Attribute word(llvm::StringRef text) { return mlir::emitc::OpaqueAttr::get(ctx_, text); }

  // The CTA's tiles, declared once at the top of the function on first use.
  Value state(llvm::StringRef name) {
    auto found = state_.find(name);
    if (found != state_.end()) return found->second;
    mlir::OpBuilder::InsertionGuard guard(b_);
    b_.setInsertionPointToStart(entryBlock());
    Value declared = b_.create<mlir::emitc::VariableOp>(loc_, tile(name), word(""));
    return state_[name] = declared;
  }

  // loom::<name><IhaConfig[, extra]>(operands...)
  void call(llvm::StringRef name, mlir::ValueRange operands, llvm::ArrayRef<llvm::StringRef> extraTemplateArgs = {}) {
    llvm::SmallVector<mlir::Attribute> templateArgs{word(kConfigName)};
    for (llvm::StringRef extra : extraTemplateArgs) templateArgs.push_back(word(extra));
    b_.create<mlir::emitc::CallOpaqueOp>(loc_, mlir::TypeRange{}, ("loom::" + name).str(), operands,
                                         /*args=*/mlir::ArrayAttr{}, b_.getArrayAttr(templateArgs));
  }
  Value callValue(llvm::StringRef name, mlir::ValueRange operands, bool configured = true) {
    mlir::ArrayAttr templateArgs = configured ? b_.getArrayAttr({word(kConfigName)}) : mlir::ArrayAttr{};
    return b_
        .create<mlir::emitc::CallOpaqueOp>(loc_, mlir::TypeRange{b_.getI64Type()}, ("loom::" + name).str(), operands,
                                           mlir::ArrayAttr{}, templateArgs)
        .getResult(0);
  }
  // Constants are declared once, at the top of the function.
  Value constant(int64_t value) {
    auto found = constants_.find(value);
    if (found != constants_.end()) return found->second;
    mlir::OpBuilder::InsertionGuard guard(b_);
    b_.setInsertionPointToStart(entryBlock());
    return constants_[value] =
               b_.create<mlir::emitc::ConstantOp>(loc_, b_.getI64Type(), b_.getI64IntegerAttr(value));
  }
  mlir::Block* entryBlock() {
    return &b_.getInsertionBlock()->getParent()->getParentOfType<mlir::emitc::FuncOp>().getBody().front();
  }
  Value get(Value value) { return map.lookup(value); }
  static llvm::StringRef flag(bool on) { return on ? "true" : "false"; }

  // The kv head of query head `head`: computed at its first use (the
  // kv_stream, which dominates the loops that follow) and reused.
  Value kvHead(Value head) {
    const int64_t group = kernel_.getSpec().getHeads() / kernel_.getSpec().getKvHeads();
    if (group == 1) return head;
    Value& cached = kvHeads_[head];
    if (!cached) cached = b_.create<mlir::emitc::DivOp>(loc_, b_.getI64Type(), head, constant(group));
    return cached;
  }

  mlir::LogicalResult lowerOp(mlir::Operation* op) {
    loc_ = op->getLoc();
    return llvm::TypeSwitch<mlir::Operation*, mlir::LogicalResult>(op)
        .Case([&](mlir::arith::ConstantIntOp c) {
          map.map(c.getResult(), constant(c.value()));
          return mlir::success();
        })
        .Case([&](mlir::arith::AddIOp o) { return binary<mlir::emitc::AddOp>(o); })
        .Case([&](mlir::arith::SubIOp o) { return binary<mlir::emitc::SubOp>(o); })
        .Case([&](mlir::arith::MulIOp o) { return binary<mlir::emitc::MulOp>(o); })
        .Case([&](mlir::arith::FloorDivSIOp o) { return helper("floordiv", o); })
        .Case([&](mlir::arith::CeilDivSIOp o) { return helper("ceildiv", o); })
        .Case([&](mlir::arith::MaxSIOp o) { return helper("max", o); })
        .Case([&](mlir::arith::MinSIOp o) { return helper("min", o); })
        .Case([&](SeqLenOp o) {
          map.map(o.getResult(), callValue("seq_len", {args_}));
          return mlir::success();
        })
        .Case([&](PremixOp o) {
          const std::string role = "loom::Role::" + stringifyRole(o.getRole()).str();
          call("premix", {args_, get(o.getToken0()), get(o.getBatch())}, {role});
          return mlir::success();
        })
        .Case([&](CollapseRowsOp o) {
          call("collapse_rows", {args_, get(o.getToken0()), get(o.getBatch())});
          return mlir::success();
        })
        .Case([&](LoadQOp o) {
          call("load_q", {state("QTile"), args_, get(o.getRow0()), get(o.getHead()), get(o.getBatch())},
               {flag(o.getMixed())});
          call("softmax_init", {state("SoftmaxState"), state("AccTile")});
          return mlir::success();
        })
        .Case([&](KvStreamOp o) {
          call("kv_begin",
               {state("KvPipeline"), args_, kvHead(get(o.getHead())), get(o.getBatch()), get(o.getLower()),
                get(o.getUpper())},
               {flag(o.getMixed())});
          return mlir::success();
        })
        .Case([&](KvLoopOp o) { return lowerKvLoop(o); })
        .Case([&](StoreRowsOp o) { return store("store_rows", o.getRow0(), o.getHead(), o.getBatch()); })
        .Case([&](StoreCollapsedOp o) { return store("store_collapsed", o.getRow0(), o.getHead(), o.getBatch()); })
        .Case([&](AccumulateCollapsedOp o) {
          call("normalize", {state("SoftmaxState"), state("AccTile")});
          call("accumulate_collapsed", {state("OutTile"), state("AccTile"), state("SoftmaxState"), args_,
                                        get(o.getRow0()), get(o.getHead()), get(o.getBatch())});
          return mlir::success();
        })
        .Case([&](OutInitOp) {
          call("out_init", {state("OutTile")});
          return mlir::success();
        })
        .Case([&](StoreOutOp o) {
          call("store_out", {state("OutTile"), args_, get(o.getRow0()), get(o.getBatch())});
          return mlir::success();
        })
        .Case([&](ForEachHeadOp o) {
          auto loop = b_.create<mlir::emitc::ForOp>(loc_, constant(0), constant(kernel_.getSpec().getHeads()),
                                                    constant(1));
          map.map(o.getBody().front().getArgument(0), loop.getInductionVar());
          mlir::OpBuilder::InsertionGuard guard(b_);
          b_.setInsertionPointToStart(loop.getBody());
          return lowerBlock(o.getBody().front());
        })
        .Default([&](mlir::Operation* other) {
          return other->emitOpError() << "cannot be lowered to EmitC by iha-lower-to-emitc";
        });
  }

  template <typename EmitCOp, typename ArithOp>
  mlir::LogicalResult binary(ArithOp o) {
    map.map(o.getResult(), b_.create<EmitCOp>(loc_, b_.getI64Type(), get(o.getLhs()), get(o.getRhs())));
    return mlir::success();
  }
  template <typename ArithOp>
  mlir::LogicalResult helper(llvm::StringRef name, ArithOp o) {
    map.map(o.getResult(), callValue(name, {get(o.getLhs()), get(o.getRhs())}, /*configured=*/false));
    return mlir::success();
  }

  mlir::LogicalResult store(llvm::StringRef name, Value row0, Value head, Value batch) {
    call("normalize", {state("SoftmaxState"), state("AccTile")});
    call(name, {state("AccTile"), state("SoftmaxState"), args_, get(row0), get(head), get(batch)});
    return mlir::success();
  }

  // One FlashAttention step per key block: keep the pipeline `stages - 1`
  // blocks ahead, wait for this block, S = Q K^T, mask, online softmax, P V.
  mlir::LogicalResult lowerKvLoop(KvLoopOp o) {
    const int64_t ahead = kernel_.getScheduleAttr().getStages() - 1;
    Value lower = get(o.getLower()), upper = get(o.getUpper());
    auto loop = b_.create<mlir::emitc::ForOp>(loc_, lower, upper, constant(1));
    mlir::OpBuilder::InsertionGuard guard(b_);
    b_.setInsertionPointToStart(loop.getBody());
    Value block = loop.getInductionVar();
    Value kv = state("KvPipeline"), scores = state("ScoreTile");
    Value head = kvHead(get(o.getHead()));
    Value streamEnd = streamUpper(o);
    if (ahead > 0) {
      Value next = b_.create<mlir::emitc::AddOp>(loc_, b_.getI64Type(), block, constant(ahead));
      call("kv_produce", {kv, args_, head, get(o.getBatch()), next, streamEnd}, {flag(o.getMixed())});
    }
    call("kv_wait", {kv, args_, head, get(o.getBatch()), block}, {flag(o.getMixed())});
    call("mma_qk", {scores, state("QTile"), kv, block});
    if (o.getMasked()) call("mask_scores", {scores, args_, get(o.getRow0()), block});
    call("softmax_update", {state("SoftmaxState"), scores, state("AccTile")});
    call("mma_pv", {state("AccTile"), scores, kv, block});
    call("kv_release", {kv, block});
    return mlir::success();
  }

  // The end of the range the launch's kv_stream opened.
  Value streamUpper(KvLoopOp o) {
    for (mlir::Operation* op = o->getPrevNode(); op; op = op->getPrevNode())
      if (auto stream = llvm::dyn_cast<KvStreamOp>(op)) return get(stream.getUpper());
    return get(o.getUpper());
  }

  mlir::OpBuilder& b_;
  KernelOp kernel_;
  Value args_;
  mlir::MLIRContext* ctx_;
  mlir::Location loc_ = mlir::UnknownLoc::get(ctx_);
  llvm::StringMap<Value> state_;
  llvm::DenseMap<int64_t, Value> constants_;
  llvm::DenseMap<Value, Value> kvHeads_;
};

struct LowerToEmitC : impl::IhaLowerToEmitCBase<LowerToEmitC> {
  using IhaLowerToEmitCBase::IhaLowerToEmitCBase;

  void runOnOperation() override {
    mlir::ModuleOp module = getOperation();
    auto kernels = llvm::to_vector(module.getOps<KernelOp>());
    for (KernelOp kernel : kernels) {
      if (!kernel.getScheduleAttr()) {
        kernel.emitError() << "has no schedule: run iha-apply-schedule first";
        return signalPassFailure();
      }
      mlir::OpBuilder builder(kernel);
      builder.create<mlir::emitc::IncludeOp>(kernel.getLoc(), tileHeader, /*is_standard_include=*/false);
      builder.create<mlir::emitc::VerbatimOp>(kernel.getLoc(),
                                              configStruct(kernel.getSpec(), kernel.getScheduleAttr()));
      for (LaunchOp launch : kernel.getBlock().getOps<LaunchOp>())
        if (mlir::failed(lowerLaunch(builder, kernel, launch))) return signalPassFailure();
      kernel.erase();
    }
  }

  mlir::LogicalResult lowerLaunch(mlir::OpBuilder& builder, KernelOp kernel, LaunchOp launch) {
    mlir::MLIRContext* ctx = builder.getContext();
    auto argsType = mlir::emitc::OpaqueType::get(ctx, kArgsType);
    auto func = builder.create<mlir::emitc::FuncOp>(launch.getLoc(), launch.getSymName(),
                                                    builder.getFunctionType({argsType}, {}));
    func.setSpecifiersAttr(builder.getStrArrayAttr({"LOOM_KERNEL"}));
    mlir::Block* entry = func.addEntryBlock();
    mlir::OpBuilder body = mlir::OpBuilder::atBlockEnd(entry);
    LaunchLowering lowering(body, kernel, entry->getArgument(0));
    const char* coordinates[] = {"block_x", "block_y", "block_z"};
    for (int i = 0; i < 3; ++i) {
      Value coordinate = body
                             .create<mlir::emitc::CallOpaqueOp>(launch.getLoc(), mlir::TypeRange{body.getI64Type()},
                                                                std::string("loom::") + coordinates[i],
                                                                mlir::ValueRange{})
                             .getResult(0);
      lowering.map.map(launch.getBlock().getArgument(i), coordinate);
    }
    if (mlir::failed(lowering.lowerBlock(launch.getBlock()))) return mlir::failure();
    body.create<mlir::emitc::ReturnOp>(launch.getLoc(), Value{});
    return mlir::success();
  }
};

}  // namespace
}  // namespace loom::iha
