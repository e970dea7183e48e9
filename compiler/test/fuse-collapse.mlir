// RUN: loom-opt %s --iha-build-kernel --iha-apply-schedule --iha-fuse-collapse | FileCheck %s

// per_head in the epilogue: no collapse launch; the store collapses.
// CHECK-LABEL: iha.kernel @per_head
// CHECK:         iha.launch @iha_attention attributes {grid_y = 2 : i64
// CHECK:           iha.store_collapsed rows
// CHECK-NOT:     iha.launch @iha_collapse
iha.kernel @per_head spec(#iha.spec<heads = 2, kv_heads = 2, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = flat_causal, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = epilogue>) {
}

// global in the epilogue: one CTA per query block runs every head and
// accumulates the output tile before one store.
// CHECK-LABEL: iha.kernel @global
// CHECK:         iha.launch @iha_attention attributes {grid_y = 1 : i64
// CHECK:           iha.out_init
// CHECK-NEXT:      iha.for_each_head {
// CHECK-NEXT:      ^bb0(%[[HEAD:[0-9a-z_]+]]: i64):
// CHECK:             iha.load_q rows %{{.*}} head %[[HEAD]]
// CHECK:             iha.accumulate_collapsed rows %{{.*}} head %[[HEAD]]
// CHECK:           }
// CHECK:           iha.store_out rows
// CHECK-NOT:     iha.launch @iha_collapse
iha.kernel @global spec(#iha.spec<heads = 2, kv_heads = 2, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = flat_causal, window = 0, collapse = global, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = epilogue>) {
}

// separate: the collapse launch stays and the attention stores rows.
// CHECK-LABEL: iha.kernel @separate
// CHECK:         iha.store_rows
// CHECK:         iha.launch @iha_collapse
iha.kernel @separate spec(#iha.spec<heads = 2, kv_heads = 2, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = flat_causal, window = 0, collapse = global, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = separate>) {
}
