// RUN: loom-opt %s --iha-build-kernel --iha-apply-schedule --iha-analyze-mask --iha-fuse-mixing | FileCheck %s

// mix = fused: no pre-mix launch; the attention's loads mix on the fly.
// CHECK-LABEL: iha.kernel @fused
// CHECK-NOT:     iha.launch @iha_premix
// CHECK:         iha.launch @iha_attention
// CHECK:           iha.load_q {{.*}} {mixed}
// CHECK:           iha.kv_stream {{.*}} {mixed}
// CHECK-COUNT-3:   iha.kv_loop {{.*}}mixed}
iha.kernel @fused spec(#iha.spec<heads = 2, kv_heads = 2, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = flat_causal, window = 0, collapse = per_head, rope_theta = 10000.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = epilogue>) {
}

// mix = materialized: the pre-mix launch stays, the loads read workspaces.
// CHECK-LABEL: iha.kernel @materialized
// CHECK:         iha.launch @iha_premix
// CHECK:         iha.launch @iha_attention
// CHECK-NOT:       mixed
// CHECK:       }
iha.kernel @materialized spec(#iha.spec<heads = 2, kv_heads = 2, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = flat_causal, window = 0, collapse = per_head, rope_theta = 10000.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = materialized, collapse = separate>) {
}
