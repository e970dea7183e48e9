// RUN: loom-opt %s --iha-build-kernel --iha-apply-schedule | FileCheck %s
// RUN: loom-opt %s --iha-build-kernel --iha-apply-schedule="block-m=32 block-n=32 warps=2 stages=3 mix=materialized collapse=separate" | FileCheck %s --check-prefix=OPTS

// Defaults for P = 4: four warps, block_m = lcm(4, 64) = 64, block_n = 64.
// Everything starts materialised: pre-mix, attention with one masked loop
// over every key block, separate collapse.
// CHECK-LABEL: iha.kernel @iha
// CHECK-SAME:    schedule(<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = epilogue>)
// CHECK:         iha.launch @iha_premix attributes {grid_y = 1 : i64, rows_per_cta = 16 : i64, rows_per_token = 1 : i64, threads = 128 : i64}
// CHECK:           iha.premix query tokens
// CHECK:           iha.premix key tokens
// CHECK:           iha.premix value tokens
// CHECK:         iha.launch @iha_attention attributes {grid_y = 2 : i64, rows_per_cta = 64 : i64, rows_per_token = 4 : i64, threads = 128 : i64}
// CHECK:           %[[ROW0:[0-9a-z_]+]] = arith.muli %arg0, %{{.*}} : i64
// CHECK:           %[[L:[0-9a-z_]+]] = iha.seq_len : i64
// CHECK:           %[[NKB:[0-9a-z_]+]] = arith.ceildivsi %[[L]], %{{.*}} : i64
// CHECK:           iha.load_q rows %[[ROW0]] head %arg1 batch %arg2
// CHECK-NEXT:      iha.kv_stream %[[ZERO:[0-9a-z_]+]] to %[[NKB]] head %arg1 batch %arg2
// CHECK-NEXT:      iha.kv_loop %[[ZERO]] to %[[NKB]] rows %[[ROW0]] head %arg1 batch %arg2 {masked}
// CHECK-NEXT:      iha.store_rows rows %[[ROW0]] head %arg1 batch %arg2
// CHECK:         iha.launch @iha_collapse
// CHECK:           iha.collapse_rows tokens
iha.kernel @iha spec(#iha.spec<heads = 2, kv_heads = 1, pseudo_heads = 4, head_dim = 32, dtype = f32, mask = flat_causal, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
}

// Pass options fill the fields the kernel does not set.
// OPTS: schedule(<block_m = 32, block_n = 32, warps = 2, stages = 3, mix = materialized, collapse = separate>)
// OPTS: iha.launch @iha_attention attributes {grid_y = 2 : i64, rows_per_cta = 32 : i64, rows_per_token = 4 : i64, threads = 64 : i64}
