// RUN: loom-opt %s --split-input-file --iha-build-kernel --iha-apply-schedule --iha-analyze-mask --iha-fuse-mixing --iha-fuse-collapse --canonicalize --cse --iha-warp-specialize | FileCheck %s
// RUN: loom-opt %s --split-input-file --iha-build-kernel --iha-apply-schedule --iha-analyze-mask --iha-fuse-mixing --iha-fuse-collapse --canonicalize --cse --iha-warp-specialize --iha-lower-to-emitc="tile-header=loom/tile/hopper.h" | mlir-translate --split-input-file --mlir-to-cpp | FileCheck %s --check-prefix=CPP

// engine = wgmma, per_head: the attention launch splits into two slices of
// one program. The producer keeps the stream and the arithmetic of its
// bounds, nothing else; the consumer keeps the rest, without the stream.
// A producer warpgroup joins the two consumer warpgroups: 384 threads.
// CHECK-LABEL: iha.kernel @per_head
// CHECK:         iha.launch @iha_attention attributes {{{.*}}threads = 384 : i64}
// CHECK-NEXT:    ^bb0
// CHECK-NEXT:      iha.warp_specialize producer {
// CHECK-NOT:         iha.load_q
// CHECK-NOT:         iha.kv_loop
// CHECK:             iha.kv_stream
// CHECK-NOT:         iha.store
// CHECK:           } consumer {
// CHECK-NOT:         iha.kv_stream
// CHECK:             iha.load_q
// CHECK:             iha.kv_loop
// CHECK:             iha.kv_loop {{.*}}{masked}
// CHECK:             iha.store_collapsed
// CHECK:           }
iha.kernel @per_head spec(#iha.spec<heads = 4, kv_heads = 2, pseudo_heads = 2, head_dim = 64, dtype = bf16, mask = flat_causal, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.125>) schedule(#iha.schedule<block_m = 128, block_n = 128, warps = 8, stages = 2, mix = materialized, collapse = epilogue, engine = wgmma, producer_registers = 24>) {
}

// -----

// global, collapsed in the epilogue: the head loop is kept on both sides,
// so the producer streams every head's blocks in the consumers' order.
// CHECK-LABEL: iha.kernel @global
// CHECK:         iha.warp_specialize producer {
// CHECK:           iha.for_each_head {
// CHECK:             iha.kv_stream
// CHECK-NOT:         iha.accumulate_collapsed
// CHECK:         } consumer {
// CHECK:           iha.out_init
// CHECK:           iha.for_each_head {
// CHECK-NOT:         iha.kv_stream
// CHECK:             iha.accumulate_collapsed
// CHECK:           iha.store_out
iha.kernel @global spec(#iha.spec<heads = 2, kv_heads = 2, pseudo_heads = 4, head_dim = 64, dtype = f16, mask = token_causal, window = 2, collapse = global, rope_theta = 10000.0, scale = 0.125>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 3, mix = fused, collapse = epilogue, engine = wgmma, producer_registers = 56>) {
}

// -----

// The mma engine is left as it was.
// CHECK-LABEL: iha.kernel @portable
// CHECK-NOT:     iha.warp_specialize
// CHECK:         iha.kv_stream
iha.kernel @portable spec(#iha.spec<heads = 2, kv_heads = 2, pseudo_heads = 2, head_dim = 64, dtype = f16, mask = flat_causal, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.125>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = epilogue>) {
}

// The C++: register caps for setmaxnreg, the tensor maps as a grid
// constant, one if / else with the producer's loop of kv_load.
// CPP: static constexpr int producer_registers = 24;
// CPP: static constexpr int consumer_registers = 240;
// CPP-LABEL: LOOM_KERNEL __launch_bounds__(384, 1) void iha_attention(loom::IhaArgs {{.*}}, const __grid_constant__ loom::TmaMaps
// CPP: loom::pipeline_init<IhaConfig>();
// CPP: bool [[PRODUCER:v[0-9]+]] = loom::is_producer<IhaConfig>();
// CPP-NEXT: if ([[PRODUCER]]) {
// CPP: loom::producer_start<IhaConfig>();
// CPP: for (
// CPP-NEXT: loom::kv_load<IhaConfig, false>(
// CPP: } else {
// CPP: loom::consumer_start<IhaConfig>();
// CPP: loom::load_q<IhaConfig, false>(
// CPP: loom::kv_wait<IhaConfig, false>(
// CPP: loom::mma_qk<IhaConfig>(
// CPP: loom::kv_finish<IhaConfig>(
