// iha-apply-schedule: fix the schedule, then turn the spec-level steps into
// three launches (pre-mix, attention over query blocks, collapse) in their
// most general form: everything materialised, every key block visited with
// a mask. iha-analyze-mask, iha-fuse-mixing and iha-fuse-collapse narrow it.
#include "PassDetail.h"
#include "loom/Dialect/Iha/Schedule.h"

namespace loom::iha {

#define GEN_PASS_DEF_IHAAPPLYSCHEDULE
#include "loom/Dialect/Iha/Passes.h.inc"

namespace {

using mlir::Value;

std::optional<ScheduleFields> fieldsFromOptions(int64_t blockM, int64_t blockN, int64_t warps, int64_t stages,
                                                llvm::StringRef mix, llvm::StringRef collapse,
                                                llvm::StringRef engine, int64_t producerRegisters,
                                                llvm::StringRef dq, std::string* error) {
  ScheduleFields fields;
  fields.blockM = blockM;
  fields.blockN = blockN;
  fields.warps = warps;
  fields.stages = stages;
  fields.producerRegisters = producerRegisters;
  if (!dq.empty()) {
    fields.dq = symbolizeDqStrategy(dq);
    if (!fields.dq) {
      *error = "dq option '" + dq.str() + "' is not separate or atomic";
      return std::nullopt;
    }
  }
  if (!engine.empty()) {
    fields.engine = symbolizeEngine(engine);
    if (!fields.engine) {
      *error = "engine option '" + engine.str() + "' is not mma or wgmma";
      return std::nullopt;
    }
  }
  if (!mix.empty()) {
    fields.mix = symbolizeMixStrategy(mix);
    if (!fields.mix) {
      *error = "mix option '" + mix.str() + "' is not fused or materialized";
      return std::nullopt;
    }
  }
  if (!collapse.empty()) {
    fields.collapse = symbolizeCollapseStrategy(collapse);
    if (!fields.collapse) {
      *error = "collapse option '" + collapse.str() + "' is not epilogue or separate";
      return std::nullopt;
    }
  }
  return fields;
}

// A launch with an empty body taking the CTA's (x, y, batch) coordinates.
LaunchOp createLaunch(mlir::OpBuilder& builder, mlir::Location loc, llvm::StringRef name, int64_t rowsPerToken,
                      int64_t rowsPerCta, int64_t gridY, int64_t threads) {
  auto launch = builder.create<LaunchOp>(loc, name, rowsPerToken, rowsPerCta, gridY, threads);
  mlir::Block* body = new mlir::Block();
  launch.getBody().push_back(body);
  for (int i = 0; i < 3; ++i) body->addArgument(builder.getI64Type(), loc);
  return launch;
}

struct ApplySchedule : impl::IhaApplyScheduleBase<ApplySchedule> {
  using IhaApplyScheduleBase::IhaApplyScheduleBase;

  void runOnOperation() override {
    auto result = getOperation().walk([&](KernelOp kernel) {
      if (kernel.getBlock().getOps<AttendOp>().empty()) return mlir::WalkResult::advance();  // scheduled
      if (mlir::failed(schedule(kernel))) return mlir::WalkResult::interrupt();
      return mlir::WalkResult::advance();
    });
    if (result.wasInterrupted()) signalPassFailure();
  }

  // A decode step (docs/IHA.md, Decode over a paged cache): the new tokens'
  // k and v into the cache, then the attention of their T * P rows, which
  // start at the sequence's cached rows, over every row of the cache (the
  // raw cache mixed and rotated as each block streams in), then the
  // collapse over the T tokens. Launch grids count the step's T tokens.
  template <class TokenLaunch>
  mlir::LogicalResult scheduleDecode(KernelOp kernel, mlir::OpBuilder& builder, ScheduleAttr chosen,
                                     TokenLaunch& tokenLaunch) {
    const mlir::Location loc = kernel.getLoc();
    const SpecAttr spec = kernel.getSpec();
    const int64_t P = spec.getPseudoHeads();
    // With stack_heads a CTA holds the rows of every query head of a kv
    // group, head after head, each head the same whole tokens (block_m /
    // (H / G) rows of its own), and stages and mixes each key block once
    // for them all.
    // Absorbed and tensor mixing hold a token of every query head in one CTA.
    const int64_t stacked = chosen.getAbsorbMixing() || chosen.getTensorMixing() ? oneCtaStepHeads(spec, chosen)
                            : chosen.getStackHeads() ? spec.getHeads() / spec.getKvHeads()
                                                     : 1;
    const int64_t ownedRows = chosen.getBlockM() / stacked / P * P;
    tokenLaunch(kDecodeAppendLaunch, [&](mlir::OpBuilder& body, Value token0, Value batch) {
      body.create<AppendCacheOp>(loc, token0, batch);
    });
    // With kv_splits S the grid's y is (head, split): CTA y = head * S + split
    // takes split's share of the key blocks (iha-analyze-mask divides them);
    // stacked, (kv group, split), and the CTA's head is the group's first.
    const int64_t splits = chosen.getKvSplits();
    LaunchOp attention = createLaunch(builder, loc, kAttentionLaunch, P, ownedRows,
                                      spec.getHeads() / stacked * splits, chosen.getWarps() * kThreadsPerWarp);
    {
      mlir::OpBuilder body = mlir::OpBuilder::atBlockEnd(&attention.getBlock());
      IndexMath math(body, loc);
      Value head = splitHeadOf(math, attention.getBlockY(), splits), batch = attention.getBatch();
      if (stacked > 1) head = math.mul(head, math.c(stacked));
      Value cached = body.create<CachedRowsOp>(loc, body.getI64Type(), batch);
      Value row0 = math.add(cached, math.mul(attention.getBlockX(), math.c(ownedRows)));
      Value length = body.create<DecodeLenOp>(loc, body.getI64Type(), batch);
      Value zero = math.c(0);
      Value keyBlocks = math.ceilDiv(length, math.c(chosen.getBlockN()));
      // The step's queries are mixed as they load; cached keys and values
      // are mixed as they stream from a raw cache, read as stored from a
      // mixed one.
      const bool rawCache = !kernel.getMixedCache();
      body.create<LoadQOp>(loc, row0, head, batch, /*mixed=*/true);
      body.create<KvStreamOp>(loc, zero, keyBlocks, head, batch, /*mixed=*/rawCache);
      body.create<KvLoopOp>(loc, zero, keyBlocks, row0, head, batch, /*masked=*/true, /*mixed=*/rawCache,
                            /*lower_edge=*/false);
      if (splits > 1)
        body.create<StoreSplitOp>(loc, row0, head, batch, splitIndexOf(math, attention.getBlockY(), splits));
      else
        body.create<StoreRowsOp>(loc, row0, head, batch);
    }
    if (splits > 1)
      tokenLaunch(kDecodeCombineLaunch, [&](mlir::OpBuilder& body, Value token0, Value batch) {
        body.create<CombineSplitsOp>(loc, token0, batch);
      });
    tokenLaunch(kCollapseLaunch, [&](mlir::OpBuilder& body, Value token0, Value batch) {
      body.create<CollapseRowsOp>(loc, token0, batch);
    });
    return mlir::success();
  }

  mlir::LogicalResult schedule(KernelOp kernel) {
    const SpecAttr spec = kernel.getSpec();
    ScheduleAttr chosen = kernel.getScheduleAttr();
    if (!chosen) {
      std::string error;
      auto fields = fieldsFromOptions(blockM, blockN, warps, stages, mix, collapse, engine, producerRegisters, dq, &error);
      if (!fields) return kernel.emitError() << error;
      if (auto why = checkScheduleFields(*fields)) return kernel.emitError() << *why;
      if (kernel.getDecode())
        completeDecodeFields(*fields, kernel.getMixedCache(),
                             spec.getHeads() / spec.getKvHeads() * spec.getPseudoHeads(),
                             oneCtaStepHeads(spec.getHeads(), spec.getKvHeads(), spec.getPseudoHeads(),
                                             spec.getHeadDim(), fields->tensorMixing),
                             spec.getPseudoHeads(), spec.getHeadDim(),
                             kTensorMixingTokens);
      if (kernel.getBackward()) {  // the backward reads mixed rows from workspaces
        fields->mix = fields->mix.value_or(MixStrategy::materialized);
        fields->collapse = fields->collapse.value_or(CollapseStrategy::separate);
      }
      chosen = completeSchedule(spec, *fields);
    }
    if (auto why = kernel.getBackward() ? checkBackwardKernelSchedule(spec, chosen) : checkSchedule(spec, chosen))
      return kernel.emitError() << *why;
    kernel.setScheduleAttr(chosen);

    for (mlir::Operation& op : llvm::make_early_inc_range(kernel.getBlock())) op.erase();
    mlir::OpBuilder builder = mlir::OpBuilder::atBlockEnd(&kernel.getBlock());
    const mlir::Location loc = kernel.getLoc();
    const int64_t P = spec.getPseudoHeads();
    const int64_t threads = chosen.getWarps() * kThreadsPerWarp;
    // A CTA computes block_m query rows and owns the whole tokens among
    // them: the block_m mod P rows after those are the next CTA's, computed
    // again there (so block_m need not be a multiple of P).
    const int64_t tokensPerCta = chosen.getBlockM() / P;
    const int64_t ownedRows = tokensPerCta * P;

    // Token-parallel launches: each CTA handles `tokensPerCta` tokens.
    auto tokenLaunch = [&](llvm::StringRef name, auto fillBody) {
      LaunchOp launch = createLaunch(builder, loc, name, 1, tokensPerCta, 1, threads);
      mlir::OpBuilder body = mlir::OpBuilder::atBlockEnd(&launch.getBlock());
      IndexMath math(body, loc);
      fillBody(body, math.mul(launch.getBlockX(), math.c(tokensPerCta)), launch.getBatch());
    };
    if (kernel.getDecode()) return scheduleDecode(kernel, builder, chosen, tokenLaunch);

    tokenLaunch(kPremixLaunch, [&](mlir::OpBuilder& body, Value token0, Value batch) {
      for (Role role : {Role::query, Role::key, Role::value})
        body.create<PremixOp>(loc, RoleAttr::get(kernel.getContext(), role), token0, batch);
    });

    // The attention: one CTA per (query block, head, batch).
    LaunchOp attention = createLaunch(builder, loc, kAttentionLaunch, P, ownedRows, spec.getHeads(), threads);
    {
      mlir::OpBuilder body = mlir::OpBuilder::atBlockEnd(&attention.getBlock());
      IndexMath math(body, loc);
      Value row0 = math.mul(attention.getBlockX(), math.c(ownedRows));
      Value seqLen = body.create<SeqLenOp>(loc, body.getI64Type());
      Value zero = math.c(0);
      Value keyBlocks = math.ceilDiv(seqLen, math.c(chosen.getBlockN()));
      Value head = attention.getBlockY(), batch = attention.getBatch();
      body.create<LoadQOp>(loc, row0, head, batch, /*mixed=*/false);
      body.create<KvStreamOp>(loc, zero, keyBlocks, head, batch, /*mixed=*/false);
      body.create<KvLoopOp>(loc, zero, keyBlocks, row0, head, batch, /*masked=*/true, /*mixed=*/false,
                            /*lower_edge=*/false);
      body.create<StoreRowsOp>(loc, row0, head, batch);
    }

    if (!kernel.getBackward()) {
      tokenLaunch(kCollapseLaunch, [&](mlir::OpBuilder& body, Value token0, Value batch) {
        body.create<CollapseRowsOp>(loc, token0, batch);
      });
      return mlir::success();
    }

    // The backward, after the forward's pseudo outputs and lse: dout
    // through the collapse (and D = rowsum(do * o)), FlashAttention-2's
    // backward over the interleaved sequence, then RoPE, qk_norm and
    // mixing transposed, then the reductions over tokens.
    tokenLaunch(kBwdPrepLaunch, [&](mlir::OpBuilder& body, Value token0, Value batch) {
      body.create<CollapseGradOp>(loc, token0, batch);
    });
    const bool atomicDq = chosen.getDq() == DqStrategy::atomic;
    // A head wider than a CTA's gradient columns is split into parts
    // (layout.h, backwardColumnParts): the grid's y is (head, part), CTA y
    // = head * parts + part, as a decode step's (head, split).
    const bool wgmma = chosen.getEngine() == Engine::wgmma;
    const int64_t parts = loom::backwardColumnParts(int(spec.getHeadDim()), wgmma);
    // Key-block-outer: one CTA per (key block, kv head, batch) runs every
    // query head of its group, so dK and dV sum without atomics.
    LaunchOp kv = createLaunch(builder, loc, kBwdKvLaunch, P, chosen.getBlockN(), spec.getKvHeads() * parts, threads);
    {
      mlir::OpBuilder body = mlir::OpBuilder::atBlockEnd(&kv.getBlock());
      IndexMath math(body, loc);
      Value col0 = math.mul(kv.getBlockX(), math.c(chosen.getBlockN()));
      Value seqLen = body.create<SeqLenOp>(loc, body.getI64Type());
      Value queryBlocks = math.ceilDiv(seqLen, math.c(chosen.getBlockM()));
      Value group = splitHeadOf(math, kv.getBlockY(), parts), batch = kv.getBatch();
      body.create<KvGradBeginOp>(loc, col0, group, batch, splitIndexOf(math, kv.getBlockY(), parts));
      auto heads = body.create<ForGroupHeadsOp>(loc, group);
      mlir::Block* headBody = new mlir::Block();
      heads.getBody().push_back(headBody);
      Value head = headBody->addArgument(body.getI64Type(), loc);
      mlir::OpBuilder inner = mlir::OpBuilder::atBlockEnd(headBody);
      inner.create<QLoopOp>(loc, IndexMath(inner, loc).c(0), queryBlocks, col0, head, batch, /*masked=*/true, atomicDq);
      body.create<KvGradStoreOp>(loc, col0, group, batch);
    }
    if (!atomicDq) {  // query-block-outer: dq with P and dS recomputed
      // Its own parts: on wgmma dq is whole (layout.h, backwardDqParts).
      const int64_t dqParts = loom::backwardDqParts(int(spec.getHeadDim()), wgmma);
      LaunchOp q = createLaunch(builder, loc, kBwdQLaunch, P, chosen.getBlockM(), spec.getHeads() * dqParts, threads);
      mlir::OpBuilder body = mlir::OpBuilder::atBlockEnd(&q.getBlock());
      IndexMath math(body, loc);
      Value row0 = math.mul(q.getBlockX(), math.c(chosen.getBlockM()));
      Value seqLen = body.create<SeqLenOp>(loc, body.getI64Type());
      Value keyBlocks = math.ceilDiv(seqLen, math.c(chosen.getBlockN()));
      Value head = splitHeadOf(math, q.getBlockY(), dqParts);
      body.create<DqBeginOp>(loc, row0, head, q.getBatch(), splitIndexOf(math, q.getBlockY(), dqParts));
      body.create<DqLoopOp>(loc, math.c(0), keyBlocks, row0, head, q.getBatch(), /*masked=*/true);
      body.create<DqStoreOp>(loc, row0, head, q.getBatch());
    }
    tokenLaunch(kBwdUnmixLaunch, [&](mlir::OpBuilder& body, Value token0, Value batch) {
      for (Role role : {Role::query, Role::key, Role::value})
        body.create<UnmixOp>(loc, RoleAttr::get(kernel.getContext(), role), token0, batch);
    });
    // One CTA row (grid x is 1) of chunks of the partial sums' entries.
    const int64_t entries = loom::backwardPartialEntries(spec.getHeads(), spec.getKvHeads(), P, spec.getCollapse() == CollapseMode::global);
    LaunchOp reduce = createLaunch(builder, loc, kBwdReduceLaunch, 1, kWholeSequenceRows,
                                   (entries + kReduceChunk - 1) / kReduceChunk, threads);
    mlir::OpBuilder body = mlir::OpBuilder::atBlockEnd(&reduce.getBlock());
    body.create<ReduceGradsOp>(loc, reduce.getBlockY(), reduce.getBatch());
    return mlir::success();
  }
};

}  // namespace
}  // namespace loom::iha
