// iha-lower-to-emitc: launches become EmitC functions that call the tile API.
//
// The tile API (tile/) is one interface with a host and a CUDA
// implementation; the program only names `loom::` calls, so the same source
// compiles against either. Per kernel the pass emits:
//   #include "<tile header>"
//   struct IhaConfig { ...spec and schedule as constants... };
//   LOOM_KERNEL void <launch>(loom::IhaArgs args) { ... }   // one per launch
#include <cmath>
#include <cstdio>

#include "PassDetail.h"
#include "loom/Dialect/Iha/Schedule.h"
#include "loom/half.h"
#include "llvm/ADT/TypeSwitch.h"
#include "mlir/IR/IRMapping.h"

namespace loom::iha {

#define GEN_PASS_DEF_IHALOWERTOEMITC
#include "loom/Dialect/Iha/Passes.h.inc"

namespace {

using mlir::Value;

constexpr llvm::StringLiteral kConfigName = "IhaConfig";
constexpr llvm::StringLiteral kArgsType = "loom::IhaArgs";
constexpr llvm::StringLiteral kMapsType = "const __grid_constant__ loom::TmaMaps";

std::string floatLiteral(double value) {
  char text[48];
  std::snprintf(text, sizeof text, "%.9ef", value);
  return text;
}

std::string configStruct(SpecAttr spec, ScheduleAttr schedule, bool backward, bool decode, bool mixedCache) {
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
  text += line("bool", "qk_norm", spec.getQkNorm() == QkNorm::rms ? "true" : "false");
  text += line("float", "qk_norm_eps", floatLiteral(spec.getQkNormEps().convertToDouble()));
  text += line("bool", "rope_negative", spec.getRopeDirection() == RopeDirection::negative ? "true" : "false");
  text += line("bool", "window_token_aligned", spec.getWindowAlign() == WindowAlign::token ? "true" : "false");
  text += line("int", "window_rows", std::to_string(spec.getWindowRows()));
  text += line("bool", "varlen", spec.getVarlen() ? "true" : "false");
  text += line("int", "rope_table", std::to_string(int(spec.getRopeTable())));
  text += line("int", "block_m", std::to_string(schedule.getBlockM()));
  // The rows a CTA owns and stores of each of its heads: the whole tokens
  // among its block_m, or with stack_heads among block_m / (H / G) rows
  // (loom/tile/common.h, ctaRow).
  const int64_t stacked = !decode                   ? 1
                          : schedule.getAbsorbMixing() || schedule.getTensorMixing() ? oneCtaStepHeads(spec, schedule)
                          : schedule.getStackHeads()   ? spec.getHeads() / spec.getKvHeads()
                                                       : 1;
  text += line("int", "cta_rows",
               std::to_string(schedule.getBlockM() / stacked / spec.getPseudoHeads() * spec.getPseudoHeads()));
  text += line("int", "stacked_heads", std::to_string(stacked));
  text += line("int", "block_n", std::to_string(schedule.getBlockN()));
  text += line("int", "warps", std::to_string(schedule.getWarps()));
  text += line("int", "stages", std::to_string(schedule.getStages()));
  const bool fusedMix = schedule.getMix() == MixStrategy::fused;
  const bool fusedGlobal =
      schedule.getCollapse() == CollapseStrategy::epilogue && spec.getCollapse() == CollapseMode::global;
  text += line("bool", "fused_mix", fusedMix ? "true" : "false");
  text += line("bool", "fused_collapse", schedule.getCollapse() == CollapseStrategy::epilogue ? "true" : "false");
  text += line("bool", "fused_global_collapse", fusedGlobal ? "true" : "false");
  if (backward) {
    text += line("bool", "atomic_dq", schedule.getDq() == DqStrategy::atomic ? "true" : "false");
    // The key-block-outer launch on wgmma (loom/tile/cuda_backward.h, bwgmma);
    // the plan's other launches stay on mma.sync.
    text += line("bool", "wgmma_backward", schedule.getEngine() == Engine::wgmma ? "true" : "false");
  }
  // A decode step (loom/tile/common.h's decode fields of IhaArgs).
  text += line("bool", "decode", decode ? "true" : "false");
  text += line("bool", "mixed_cache", mixedCache ? "true" : "false");
  // The keys' and values' mixing absorbed into the queries and the
  // probabilities (loom/tile/cuda_absorbed.h).
  text += line("bool", "absorbed", decode && schedule.getAbsorbMixing() ? "true" : "false");
  // Their mixing on the tensor cores, once a cached token (loom/tile/cuda_tensor_mixing.h).
  text += line("bool", "tensor_mixing", decode && schedule.getTensorMixing() ? "true" : "false");
  text += line("int", "kv_splits", std::to_string(decode ? schedule.getKvSplits() : 1));
  if (schedule.getEngine() == Engine::wgmma && !backward) {
    text += line("int", "producer_registers", std::to_string(schedule.getProducerRegisters()));
    text += line("int", "consumer_registers",
                 std::to_string(loom::consumerRegisters(int(schedule.getWarps()), int(schedule.getProducerRegisters()))));
  }
  // Rotary frequencies theta^(-2j/d) as turns per position in 64-bit fixed
  // point (f / 2pi * 2^64, computed here in long double): the device's
  // integer product position * turns wraps at whole turns exactly, so a
  // long sequence keeps its phase with no fp64 on the device.
  const double theta = spec.getRopeTheta().convertToDouble();
  if (theta > 0) {
    std::string table;
    constexpr long double kTwoPi = 6.283185307179586476925286766559L;
    for (int64_t j = 0; j < spec.getHeadDim() / 2; ++j) {
      const double frequency = std::pow(theta, -2.0 * double(j) / double(spec.getHeadDim()));
      const auto turns = static_cast<unsigned long long>(std::llroundl(std::ldexp((long double)frequency / kTwoPi, 64)));
      char value[40];
      std::snprintf(value, sizeof value, "%s%lluull", j ? ", " : "", turns);
      table += value;
    }
    text += line("unsigned long long", "rope_turns[" + std::to_string(spec.getHeadDim() / 2) + "]", "{" + table + "}");
    // A rounded table (rope_table_dtype): each pair's float32 inverse
    // frequency as public code computes it (loom/half.h) and its distance
    // from the exact one, from which the device turns the exact angle into
    // the float32 one (loom/tile/cuda_common.h, ropeSinCos).
    if (spec.getRopeTable() != RopeTable::exact) {
      std::string inverse, error;
      for (int64_t j = 0; j < spec.getHeadDim() / 2; ++j) {
        const float f = half::ropeTableInvFreq(theta, int(j), int(spec.getHeadDim()));
        const double exact = std::pow(theta, -2.0 * double(j) / double(spec.getHeadDim()));
        char value[48];
        std::snprintf(value, sizeof value, "%s%af", j ? ", " : "", double(f));
        inverse += value;
        std::snprintf(value, sizeof value, "%s%af", j ? ", " : "", double(float(double(f) - exact)));
        error += value;
      }
      const std::string pairs = std::to_string(spec.getHeadDim() / 2);
      text += line("float", "rope_inv_freq[" + pairs + "]", "{" + inverse + "}");
      text += line("float", "rope_freq_error[" + pairs + "]", "{" + error + "}");
    }
  }
  return text + "};";
}

// Emits one launch body op by op; `map` carries values across.
class LaunchLowering {
 public:
  // `maps` is the TmaMaps parameter of a warp-specialised CUDA launch (null
  // otherwise); `specialized` says the launch is warp-specialised.
  LaunchLowering(mlir::OpBuilder& builder, KernelOp kernel, Value args, Value maps, bool specialized)
      : b_(builder), kernel_(kernel), args_(args), maps_(maps), specialized_(specialized), ctx_(builder.getContext()) {}

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
  Value callValue(llvm::StringRef name, mlir::ValueRange operands, bool configured = true, mlir::Type type = {}) {
    mlir::ArrayAttr templateArgs = configured ? b_.getArrayAttr({word(kConfigName)}) : mlir::ArrayAttr{};
    return b_
        .create<mlir::emitc::CallOpaqueOp>(loc_, mlir::TypeRange{type ? type : b_.getI64Type()}, ("loom::" + name).str(),
                                           operands, mlir::ArrayAttr{}, templateArgs)
        .getResult(0);
  }
  // The launch arguments a call takes: IhaArgs, and the TmaMaps with them
  // where the launch has them.
  llvm::SmallVector<Value> launchArgs() {
    llvm::SmallVector<Value> values{args_};
    if (maps_) values.push_back(maps_);
    return values;
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
        .Case([&](mlir::arith::RemSIOp o) { return binary<mlir::emitc::RemOp>(o); })  // (of non-negative indices)
        .Case([&](mlir::arith::FloorDivSIOp o) { return helper("floordiv", o); })
        .Case([&](mlir::arith::CeilDivSIOp o) { return helper("ceildiv", o); })
        .Case([&](mlir::arith::MaxSIOp o) { return helper("max", o); })
        .Case([&](mlir::arith::MinSIOp o) { return helper("min", o); })
        .Case([&](SeqLenOp o) {
          map.map(o.getResult(), callValue("seq_len", {args_}));
          return mlir::success();
        })
        .Case([&](DocumentBoundOp o) {
          map.map(o.getResult(), callValue(o.getEnd() ? "document_end" : "document_first", {args_, get(o.getRow())}));
          return mlir::success();
        })
        .Case([&](DecodeLenOp o) {
          map.map(o.getResult(), callValue("decode_len", {args_, get(o.getBatch())}));
          return mlir::success();
        })
        .Case([&](CachedRowsOp o) {
          map.map(o.getResult(), callValue("cached_rows", {args_, get(o.getBatch())}));
          return mlir::success();
        })
        .Case([&](AppendCacheOp o) {
          call("append_cache", {args_, get(o.getToken0()), get(o.getBatch())});
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
          llvm::SmallVector<Value> operands{state("QTile")};
          operands.append(launchArgs());
          operands.append({get(o.getRow0()), get(o.getHead()), get(o.getBatch())});
          if (specialized_) {
            call("load_q", operands, {flag(o.getMixed())});
          } else {
            // Q's copies go out first; q_wait follows the K/V prologue
            // (kv_begin), so the first K/V copies overlap Q's load.
            call("q_begin", operands, {flag(o.getMixed())});
            pendingQ_ = QWait{std::move(operands), o.getMixed()};
          }
          call("softmax_init", {state("SoftmaxState"), state("AccTile")});
          return mlir::success();
        })
        .Case([&](KvStreamOp o) {
          if (specialized_) return lowerProducerStream(o);
          call("kv_begin",
               {state("KvPipeline"), args_, kvHead(get(o.getHead())), get(o.getBatch()), get(o.getLower()),
                get(o.getUpper())},
               {flag(o.getMixed())});
          finishQ();
          return mlir::success();
        })
        .Case([&](KvLoopOp o) {
          finishQ();  // a loop with no stream before it still needs Q
          return lowerKvLoop(o);
        })
        .Case([&](StoreRowsOp o) { return store("store_rows", o.getRow0(), o.getHead(), o.getBatch()); })
        .Case([&](StoreSplitOp o) {
          finishStream();
          call("normalize", {state("SoftmaxState"), state("AccTile")});
          call("store_split", {state("AccTile"), state("SoftmaxState"), args_, get(o.getRow0()), get(o.getHead()),
                               get(o.getBatch()), get(o.getSplit())});
          return mlir::success();
        })
        .Case([&](CombineSplitsOp o) {
          call("combine_splits", {args_, get(o.getToken0()), get(o.getBatch())});
          return mlir::success();
        })
        .Case([&](StoreCollapsedOp o) { return store("store_collapsed", o.getRow0(), o.getHead(), o.getBatch()); })
        .Case([&](AccumulateCollapsedOp o) {
          finishStream();
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
        .Case([&](CollapseGradOp o) {
          call("collapse_grad", {args_, get(o.getToken0()), get(o.getBatch())});
          return mlir::success();
        })
        .Case([&](UnmixOp o) {
          call("unmix", {args_, get(o.getToken0()), get(o.getBatch())},
               {"loom::Role::" + stringifyRole(o.getRole()).str()});
          return mlir::success();
        })
        .Case([&](ReduceGradsOp o) {
          call("reduce_grads", {args_, get(o.getChunk()), get(o.getBatch())});
          return mlir::success();
        })
        .Case([&](KvGradBeginOp o) {
          llvm::SmallVector<Value> operands{state("KvGradTile")};
          operands.append(launchArgs());
          operands.append({get(o.getCol0()), get(o.getHead()), get(o.getBatch()), get(o.getPart())});
          call("kv_grad_begin", operands);
          return mlir::success();
        })
        .Case([&](ForGroupHeadsOp o) {
          // Query heads g * (H / G) .. (g + 1) * (H / G) - 1.
          const int64_t group = kernel_.getSpec().getHeads() / kernel_.getSpec().getKvHeads();
          Value first = group == 1 ? get(o.getHead())
                                   : b_.create<mlir::emitc::MulOp>(loc_, b_.getI64Type(), get(o.getHead()), constant(group));
          Value last = b_.create<mlir::emitc::AddOp>(loc_, b_.getI64Type(), first, constant(group));
          auto loop = b_.create<mlir::emitc::ForOp>(loc_, first, last, constant(1));
          map.map(o.getBody().front().getArgument(0), loop.getInductionVar());
          mlir::OpBuilder::InsertionGuard guard(b_);
          b_.setInsertionPointToStart(loop.getBody());
          // The head's query loops take its blocks in order from the first
          // one's lower bound: that block is fetched ahead of them, and each
          // block's load fetches the next (the CUDA tiles' two query stages).
          auto loops = o.getBody().front().getOps<QLoopOp>();
          if (!loops.empty()) {
            QLoopOp firstLoop = *loops.begin();
            Value row0 = b_.create<mlir::emitc::MulOp>(loc_, b_.getI64Type(), get(firstLoop.getLower()),
                                                       constant(kernel_.getScheduleAttr().getBlockM()));
            llvm::SmallVector<Value> operands{state("QGradTile")};
            operands.append(launchArgs());
            operands.append({row0, loop.getInductionVar(), get(firstLoop.getBatch())});
            call("q_grad_ahead", operands);
          }
          return lowerBlock(o.getBody().front());
        })
        .Case([&](QLoopOp o) { return lowerQLoop(o); })
        .Case([&](KvGradStoreOp o) {
          // The query stages' last copies land (one may run past the loop's last block).
          call("q_grad_finish", {state("QGradTile"), args_});
          call("kv_grad_store", {state("KvGradTile"), args_, get(o.getCol0()), get(o.getHead()), get(o.getBatch())});
          return mlir::success();
        })
        .Case([&](DqBeginOp o) {
          llvm::SmallVector<Value> operands{state("QGradTile")};
          operands.append(launchArgs());
          operands.append({get(o.getRow0()), get(o.getHead()), get(o.getBatch())});
          if (producing_) {
            call("dq_begin_fill", operands);
            return mlir::success();
          }
          call("load_q_grad", operands);
          call("dq_init", {state("DqTile"), get(o.getPart())});
          return mlir::success();
        })
        .Case([&](DqLoopOp o) { return lowerDqLoop(o); })
        .Case([&](DqStoreOp o) {
          // The K and V stages' last copies land (one may run past the loop's last block).
          call("kv_grad_finish", {state("KvGradTile"), args_});
          call("dq_store", {state("DqTile"), args_, get(o.getRow0()), get(o.getHead()), get(o.getBatch())});
          return mlir::success();
        })
        .Case([&](WarpSpecializeOp o) { return lowerWarpSpecialize(o); })
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
    finishStream();
    call("normalize", {state("SoftmaxState"), state("AccTile")});
    call(name, {state("AccTile"), state("SoftmaxState"), args_, get(row0), get(head), get(batch)});
    return mlir::success();
  }

  // The q_wait owed by the last q_begin, if any.
  void finishQ() {
    if (!pendingQ_) return;
    call("q_wait", pendingQ_->operands, {flag(pendingQ_->mixed)});
    pendingQ_.reset();
  }

  // Warp-specialised consumers hand the last key block's stage back once its
  // P V product has retired.
  void finishStream() {
    if (specialized_) call("kv_finish", {state("KvPipeline"), state("AccTile")});
  }

  // pipeline_init; if (is_producer) { producer_start; <producer> }
  //                else { consumer_start; <consumer> }
  // A backward's dq launch (loom/tile/cuda_backward.h, bwgmma) calls its
  // own, whose producer is the last warpgroup.
  mlir::LogicalResult lowerWarpSpecialize(WarpSpecializeOp o) {
    const std::string prefix = kernel_.getBackward() ? "bwd_" : "";
    call(prefix + "pipeline_init", {});
    Value producer = callValue(prefix + "is_producer", {}, /*configured=*/true, b_.getI1Type());
    auto branch = b_.create<mlir::emitc::IfOp>(loc_, producer, /*addThenBlock=*/true, /*addElseBlock=*/true);
    mlir::OpBuilder::InsertionGuard guard(b_);
    auto side = [&](mlir::Region& region, llvm::StringRef start, mlir::Block& slice) {
      mlir::Block& block = region.front();
      if (!block.empty() && block.back().hasTrait<mlir::OpTrait::IsTerminator>()) b_.setInsertionPoint(&block.back());
      else b_.setInsertionPointToEnd(&block);
      call(prefix + start.str(), {});
      producing_ = start == "producer_start";
      const mlir::LogicalResult lowered = lowerBlock(slice);
      producing_ = false;
      if (mlir::failed(lowered)) return mlir::failure();
      if (block.empty() || !block.back().hasTrait<mlir::OpTrait::IsTerminator>()) {
        b_.setInsertionPointToEnd(&block);
        b_.create<mlir::emitc::YieldOp>(loc_);
      }
      return mlir::success();
    };
    // The kv head is computed apart in each branch.
    kvHeads_.clear();
    if (mlir::failed(side(branch.getThenRegion(), "producer_start", o.getProducer().front()))) return mlir::failure();
    kvHeads_.clear();
    return side(branch.getElseRegion(), "consumer_start", o.getConsumer().front());
  }

  // The producer's side of a stream: every key block of the range, in order.
  mlir::LogicalResult lowerProducerStream(KvStreamOp o) {
    Value head = kvHead(get(o.getHead()));
    auto loop = b_.create<mlir::emitc::ForOp>(loc_, get(o.getLower()), get(o.getUpper()), constant(1));
    mlir::OpBuilder::InsertionGuard guard(b_);
    b_.setInsertionPointToStart(loop.getBody());
    llvm::SmallVector<Value> operands{state("KvPipeline")};
    operands.append(launchArgs());
    operands.append({head, get(o.getBatch()), loop.getInductionVar()});
    call("kv_load", operands, {flag(o.getMixed())});
    return mlir::success();
  }

  // One FlashAttention step per key block: keep the pipeline `stages - 1`
  // blocks ahead, wait for this block, S = Q K^T, mask, online softmax, P V.
  mlir::LogicalResult lowerKvLoop(KvLoopOp o) {
    const int64_t ahead = kernel_.getScheduleAttr().getStages() - 1;
    Value lower = get(o.getLower()), upper = get(o.getUpper());
    Value head = kvHead(get(o.getHead()));  // before the loop, so later loops may reuse it
    auto loop = b_.create<mlir::emitc::ForOp>(loc_, lower, upper, constant(1));
    mlir::OpBuilder::InsertionGuard guard(b_);
    b_.setInsertionPointToStart(loop.getBody());
    Value block = loop.getInductionVar();
    Value kv = state("KvPipeline"), scores = state("ScoreTile");
    Value streamEnd = streamUpper(o);
    if (ahead > 0 && !specialized_) {
      Value next = b_.create<mlir::emitc::AddOp>(loc_, b_.getI64Type(), block, constant(ahead));
      call("kv_produce", {kv, args_, head, get(o.getBatch()), next, streamEnd}, {flag(o.getMixed())});
    }
    call("kv_wait", {kv, args_, head, get(o.getBatch()), block}, {flag(o.getMixed())});
    // Warp-specialised: mma_qk also retires the previous block's P V, so it
    // takes the accumulator to order its registers after that wait.
    if (specialized_) call("mma_qk", {scores, state("QTile"), kv, block, state("AccTile")});
    else call("mma_qk", {scores, state("QTile"), kv, block});
    if (o.getMasked()) {
      if (o.getLowerEdge()) call("mask_scores", {scores, args_, get(o.getRow0()), block}, {"true"});
      else call("mask_scores", {scores, args_, get(o.getRow0()), block});
    }
    // Masked: whether a row may have no allowed key in this block (its maximum -inf).
    call("softmax_update", {state("SoftmaxState"), scores, state("AccTile")}, {flag(o.getMasked())});
    call("mma_pv", {state("AccTile"), scores, kv, block});
    call("kv_release", {kv, block});
    return mlir::success();
  }

  // The backward's shared steps on a (query block, key block) pair: S, its
  // mask, P = exp(S - lse) and dS = P * (do V^T - D).
  // `outer` names the loop (loom::Outer): the CUDA tiles compute S^T with
  // warps over key rows in the key-block-outer launch, S with warps over
  // query rows in the dq launch.
  void backwardScores(bool masked, llvm::StringRef outer) {
    Value scores = state("BwdScores"), q = state("QGradTile"), kv = state("KvGradTile");
    call("bwd_scores", {scores, q, kv}, {outer});
    if (masked) call("bwd_mask", {scores, args_, q, kv}, {outer});
    call("bwd_probs", {scores, q}, {outer});
  }
  static constexpr llvm::StringLiteral kKeysOuter = "loom::Outer::keys";
  static constexpr llvm::StringLiteral kQueriesOuter = "loom::Outer::queries";

  // One key block's step over a query block: dV += P^T do, dK += dS^T Q
  // (and dq += dS K by atomic adds).
  mlir::LogicalResult lowerQLoop(QLoopOp o) {
    auto loop = b_.create<mlir::emitc::ForOp>(loc_, get(o.getLower()), get(o.getUpper()), constant(1));
    mlir::OpBuilder::InsertionGuard guard(b_);
    b_.setInsertionPointToStart(loop.getBody());
    Value row0 = b_.create<mlir::emitc::MulOp>(loc_, b_.getI64Type(), loop.getInductionVar(),
                                               constant(kernel_.getScheduleAttr().getBlockM()));
    Value scores = state("BwdScores"), q = state("QGradTile"), kv = state("KvGradTile");
    llvm::SmallVector<Value> operands{q};
    operands.append(launchArgs());
    operands.append({row0, get(o.getHead()), get(o.getBatch())});
    call("load_q_grad", operands, {"true"});
    backwardScores(o.getMasked(), kKeysOuter);
    call("bwd_dv", {kv, scores, q});
    call("bwd_ds", {scores, q, kv}, {kKeysOuter});
    call("bwd_dk", {kv, scores, q});
    if (o.getAtomicDq()) call("bwd_dq_atomic", {scores, q, kv, args_, get(o.getHead()), get(o.getBatch())});
    return mlir::success();
  }

  // One query block's dq step over a key block: dq += dS K.
  mlir::LogicalResult lowerDqLoop(DqLoopOp o) {
    Value head = kvHead(get(o.getHead()));
    // The launch's loops take the key blocks in order from the first one's
    // lower bound (iha-analyze-mask's ranges are contiguous): that block is
    // fetched ahead of them, and each block's load fetches the next (the
    // CUDA tiles' two K and V stages).
    // (Warp-specialised, the producer fills each block's stage in that order
    // and the consumers' kv_grad_ahead only finds the ring.)
    bool first = !producing_;
    for (mlir::Operation* op = o->getPrevNode(); op && first; op = op->getPrevNode()) first = !llvm::isa<DqLoopOp>(op);
    if (first) {
      Value col0 = b_.create<mlir::emitc::MulOp>(loc_, b_.getI64Type(), get(o.getLower()),
                                                 constant(kernel_.getScheduleAttr().getBlockN()));
      llvm::SmallVector<Value> operands{state("KvGradTile")};
      operands.append(launchArgs());
      operands.append({col0, head, get(o.getBatch())});
      call("kv_grad_ahead", operands);
    }
    auto loop = b_.create<mlir::emitc::ForOp>(loc_, get(o.getLower()), get(o.getUpper()), constant(1));
    mlir::OpBuilder::InsertionGuard guard(b_);
    b_.setInsertionPointToStart(loop.getBody());
    Value col0 = b_.create<mlir::emitc::MulOp>(loc_, b_.getI64Type(), loop.getInductionVar(),
                                               constant(kernel_.getScheduleAttr().getBlockN()));
    Value scores = state("BwdScores"), q = state("QGradTile"), kv = state("KvGradTile");
    llvm::SmallVector<Value> operands{kv};
    operands.append(launchArgs());
    operands.append({col0, head, get(o.getBatch())});
    if (producing_) {
      call("kv_grad_fill", operands);
      return mlir::success();
    }
    call("load_kv_grad", operands, {"true"});
    backwardScores(o.getMasked(), kQueriesOuter);
    call("bwd_ds", {scores, q, kv}, {kQueriesOuter});
    call("dq_accumulate", {state("DqTile"), scores, kv});
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
  Value maps_;
  bool specialized_;
  bool producing_ = false;  // lowering a warp-specialised launch's producer slice
  mlir::MLIRContext* ctx_;
  mlir::Location loc_ = mlir::UnknownLoc::get(ctx_);
  llvm::StringMap<Value> state_;
  llvm::DenseMap<int64_t, Value> constants_;
  llvm::DenseMap<Value, Value> kvHeads_;
  struct QWait {
    llvm::SmallVector<Value> operands;
    bool mixed;
  };
  std::optional<QWait> pendingQ_;
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
                                              configStruct(kernel.getSpec(), kernel.getScheduleAttr(), kernel.getBackward(),
                                                           kernel.getDecode(), kernel.getMixedCache()));
      for (LaunchOp launch : kernel.getBlock().getOps<LaunchOp>())
        if (mlir::failed(lowerLaunch(builder, kernel, launch))) return signalPassFailure();
      kernel.erase();
    }
  }

  mlir::LogicalResult lowerLaunch(mlir::OpBuilder& builder, KernelOp kernel, LaunchOp launch) {
    mlir::MLIRContext* ctx = builder.getContext();
    const bool specialized = !launch.getBlock().getOps<WarpSpecializeOp>().empty();
    const bool cuda = tileHeader != "loom/tile/host.h";
    llvm::SmallVector<mlir::Type> parameters{mlir::emitc::OpaqueType::get(ctx, kArgsType)};
    if (takesTensorMaps(kernel, launch) && cuda) parameters.push_back(mlir::emitc::OpaqueType::get(ctx, kMapsType));
    auto func = builder.create<mlir::emitc::FuncOp>(launch.getLoc(), launch.getSymName(),
                                                    builder.getFunctionType(parameters, {}));
    llvm::SmallVector<llvm::StringRef> specifiers{"LOOM_KERNEL"};
    // setmaxnreg needs a register cap at entry: one CTA of `threads` per SM
    // (the backward's dq launch: two with one consumer warpgroup up to
    // head_dim 128, layout.h backwardDqCtasPerSm).
    const int ctas = kernel.getBackward() ? backwardDqCtasPerSm(int(kernel.getScheduleAttr().getWarps()),
                                                                int(kernel.getSpec().getHeadDim()))
                                          : 1;
    const std::string bounds =
        "__launch_bounds__(" + std::to_string(launch.getThreads()) + ", " + std::to_string(ctas) + ")";
    if (specialized && cuda) specifiers.push_back(bounds);
    func.setSpecifiersAttr(builder.getStrArrayAttr(specifiers));
    mlir::Block* entry = func.addEntryBlock();
    mlir::OpBuilder body = mlir::OpBuilder::atBlockEnd(entry);
    LaunchLowering lowering(body, kernel, entry->getArgument(0),
                            entry->getNumArguments() > 1 ? entry->getArgument(1) : Value{}, specialized);
    // The CTA's coordinates, from the launch's arguments: block_z is the
    // batch entry, blockIdx.z plus the batch offset of the launch (grids
    // are at most 65535 deep in z, so larger batches take several launches).
    const char* coordinates[] = {"block_x", "block_y", "block_z"};
    for (int i = 0; i < 3; ++i) {
      Value coordinate = body
                             .create<mlir::emitc::CallOpaqueOp>(launch.getLoc(), mlir::TypeRange{body.getI64Type()},
                                                                std::string("loom::") + coordinates[i],
                                                                mlir::ValueRange{entry->getArgument(0)})
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
