// RUN: loom-opt %s --iha-build-kernel --iha-apply-schedule --canonicalize --cse | FileCheck %s

// On wgmma (layout.h, backwardDqParts) the key-block-outer launch keeps
// its parts and the dq launch takes dq whole: grid y the heads, part 0.
// CHECK-LABEL: iha.kernel @widewgmma backward
// CHECK:         iha.launch @iha_bwd_kv attributes {grid_y = 4 : i64
// CHECK:           %[[WP:[0-9a-z_]+]] = arith.remsi %arg1
// CHECK-NEXT:      iha.kv_grad_begin cols %{{.*}} head %{{.*}} batch %arg2 part %[[WP]]
// CHECK:         iha.launch @iha_bwd_q attributes {grid_y = 4 : i64
// CHECK:           iha.dq_begin rows %{{.*}} head %arg1 batch %arg2 part %c0
iha.kernel @widewgmma backward spec(#iha.spec<heads = 4, kv_heads = 2, pseudo_heads = 2, head_dim = 256, dtype = bf16, mask = flat_causal, window = 3, collapse = per_head, rope_theta = 10000.0, scale = 0.0625>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = materialized, collapse = separate, engine = wgmma>) {
}

// At head_dim 192 three parts of 64 columns (two of 96 would start
// mid-atom).
// CHECK-LABEL: iha.kernel @d192wgmma backward
// CHECK:         iha.launch @iha_bwd_kv attributes {grid_y = 6 : i64
// CHECK:         iha.launch @iha_bwd_q attributes {grid_y = 4 : i64
// CHECK:           iha.dq_begin rows %{{.*}} head %arg1 batch %arg2 part %c0
iha.kernel @d192wgmma backward spec(#iha.spec<heads = 4, kv_heads = 2, pseudo_heads = 2, head_dim = 192, dtype = bf16, mask = flat_causal, window = 0, collapse = per_head, rope_theta = 10000.0, scale = 0.0625>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = materialized, collapse = separate, engine = wgmma>) {
}
