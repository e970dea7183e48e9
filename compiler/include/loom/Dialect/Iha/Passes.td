//===- Passes.td - iha passes --------------------------------*- tablegen -*-===//
#ifndef LOOM_IHA_PASSES
#define LOOM_IHA_PASSES

include "mlir/Pass/PassBase.td"

def IhaBuildKernel : Pass<"iha-build-kernel", "::mlir::ModuleOp"> {
  let summary = "Build the spec-level program of every empty iha.kernel";
  let description = [{
    Fills an empty `iha.kernel` with the five steps of the IHA contract:
    three `iha.mix`, one `iha.attend`, one `iha.collapse`.
  }];
}

def IhaApplySchedule : Pass<"iha-apply-schedule", "::mlir::ModuleOp"> {
  let summary = "Choose the schedule and turn the steps into tiled launches";
  let description = [{
    Completes the kernel's schedule (given fields win over the pass options,
    options over defaults), checks it against the spec, then rewrites the
    spec-level steps into launches: a pre-mix launch, an attention launch
    over query blocks of block_m virtual rows that loops over every key block
    with a mask, and a collapse launch. Later passes narrow and fuse.

    A `backward` kernel keeps the pre-mix and the attention (which stores the
    pseudo outputs and lse the backward needs) and adds the backward's
    launches: the collapse backward (do, D, dcollapse partials), the
    key-block-outer dK / dV loop over the query blocks of each key block
    (every query head of a kv head's group in one CTA), a query-block-outer
    dq loop (dq separate; with dq atomic the key-block loop adds into dq),
    the transposed mixing, and the reduction of the partial sums. Its
    schedule defaults to materialised mixing and a separate collapse.
  }];
  let options = [
    Option<"blockM", "block-m", "int64_t", "0", "virtual query rows per CTA (0: default)">,
    Option<"blockN", "block-n", "int64_t", "0", "virtual key rows per step (0: default)">,
    Option<"warps", "warps", "int64_t", "0", "warps per CTA (0: default)">,
    Option<"stages", "stages", "int64_t", "0", "K/V pipeline depth (0: default)">,
    Option<"mix", "mix", "std::string", "\"\"", "fused | materialized (empty: default)">,
    Option<"collapse", "collapse", "std::string", "\"\"", "epilogue | separate (empty: default)">,
    Option<"engine", "engine", "std::string", "\"\"", "mma | wgmma (empty: mma)">,
    Option<"producerRegisters", "producer-registers", "int64_t", "0",
           "registers of the wgmma engine's producer warpgroup (0: default)">,
    Option<"dq", "dq", "std::string", "\"\"", "separate | atomic: how a backward kernel computes dq (empty: separate)">
  ];
  let dependentDialects = ["::mlir::arith::ArithDialect"];
}

def IhaAnalyzeMask : Pass<"iha-analyze-mask", "::mlir::ModuleOp"> {
  let summary = "Visit only key blocks the mask allows; run interior blocks mask-free";
  let description = [{
    For a query block of rows [r0, r1) computes, as arithmetic on r0 and L,
    the key-block range [lo, hi) that holds any allowed pair under the
    spec's mask and window, and the sub-range [ilo, ihi) of blocks whose
    every pair is allowed and in bounds. The single masked loop over all
    blocks becomes three loops: masked [lo, ilo), interior [ilo, ihi)
    without a mask, masked [ihi, hi).
  }];
  let dependentDialects = ["::mlir::arith::ArithDialect"];
}

def IhaFuseMixing : Pass<"iha-fuse-mixing", "::mlir::ModuleOp"> {
  let summary = "Fuse mixing and RoPE into the attention's loads when the schedule says so";
  let description = [{
    With schedule mix = fused, deletes the pre-mix launch and marks the
    attention's query load and K/V stream `mixed`: they read q, k, v and the
    mixing weights directly and rotate rows on chip.
  }];
}

def IhaFuseCollapse : Pass<"iha-fuse-collapse", "::mlir::ModuleOp"> {
  let summary = "Fuse the collapse into the attention epilogue when the schedule says so";
  let description = [{
    With schedule collapse = epilogue, deletes the collapse launch. per_head:
    the store becomes `iha.store_collapsed`. global: one CTA runs every head
    of its query block (`iha.for_each_head`) and accumulates the output tile.
  }];
  let dependentDialects = ["::mlir::arith::ArithDialect"];
}

def IhaWarpSpecialize : Pass<"iha-warp-specialize", "::mlir::ModuleOp"> {
  let summary = "Split the attention launch into producer and consumer warpgroups (engine = wgmma)";
  let description = [{
    With schedule engine = wgmma, wraps the attention launch's program in an
    `iha.warp_specialize`: the producer region is the slice of the program
    that streams K/V (each `iha.kv_stream`, the head loops around it, the
    arithmetic of its bounds); the consumer region is the rest, without the
    streams. Other engines are left alone.
  }];
}

def IhaLowerToEmitC : Pass<"iha-lower-to-emitc", "::mlir::ModuleOp"> {
  let summary = "Lower launches to EmitC functions calling the tile API";
  let description = [{
    Each `iha.launch` becomes an `emitc.func` marked LOOM_KERNEL; block-level
    ops become calls into the tile API (the same source runs on the host and
    the CUDA implementation), kv loops become `emitc.for` with the pipeline's
    produce / wait steps, bound arithmetic becomes EmitC arithmetic. The
    kernel's spec and schedule become one `IhaConfig` struct of constants.
  }];
  let options = [
    Option<"tileHeader", "tile-header", "std::string", "\"loom/tile/host.h\"",
           "the tile API implementation the program includes">
  ];
  let dependentDialects = ["::mlir::emitc::EmitCDialect"];
}

#endif // LOOM_IHA_PASSES
