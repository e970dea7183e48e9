// RUN: loom-opt %s --iha-build-kernel --iha-apply-schedule --iha-analyze-mask --canonicalize --cse | FileCheck %s
// RUN: loom-opt %s --iha-pipeline | FileCheck %s --check-prefix=EMITC
//
// Split-KV decoding (docs/compiler.md, "The decode step"): kv_splits = 3
// puts three CTAs on every (query block, head), y = head * 3 + split; each
// takes its share of the visible key blocks, stores its rows and their lse,
// and iha_combine merges the shares before the collapse.
iha.kernel @iha decode spec(#iha.spec<heads = 4, kv_heads = 2, pseudo_heads = 2, head_dim = 16, dtype = f16, mask = flat_causal, window = 0, collapse = per_head, rope_theta = 10000.0, scale = 0.25>) schedule(#iha.schedule<block_m = 16, block_n = 16, warps = 1, stages = 2, mix = fused, collapse = separate, kv_splits = 3>) {
}

// CHECK-LABEL: iha.launch @iha_append
// CHECK-LABEL: iha.launch @iha_attention
// CHECK-SAME: grid_y = 12
// CHECK: ^bb0(%{{.*}}: i64, %[[Y:.*]]: i64, %[[B:.*]]: i64):
// CHECK: %[[HEAD:.*]] = arith.floordivsi %[[Y]], %[[S:.*]] :
// CHECK: %[[SPLIT:.*]] = arith.remsi %[[Y]], %[[S]] :
// CHECK: arith.minsi
// CHECK: iha.kv_stream
// CHECK: iha.kv_loop
// CHECK: iha.store_split rows %{{.*}} head %[[HEAD]] batch %[[B]] split %[[SPLIT]]
// CHECK-NOT: iha.store_rows
// CHECK-LABEL: iha.launch @iha_combine
// CHECK: iha.combine_splits tokens
// CHECK-LABEL: iha.launch @iha_collapse
// CHECK: iha.collapse_rows
// EMITC: static constexpr int kv_splits = 3;
// EMITC: emitc.func @iha_attention
// EMITC: emitc.call_opaque "loom::store_split"
// EMITC: emitc.func @iha_combine
// EMITC: emitc.call_opaque "loom::combine_splits"
