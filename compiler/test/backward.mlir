// RUN: loom-opt %s --iha-build-kernel --iha-apply-schedule --iha-analyze-mask --canonicalize --cse | FileCheck %s
// RUN: loom-opt %s --iha-build-kernel --iha-apply-schedule="dq=atomic" --iha-analyze-mask --canonicalize --cse | FileCheck %s --check-prefix=ATOMIC
// RUN: loom-opt %s --iha-pipeline | FileCheck %s --check-prefix=EMITC
// RUN: not loom-opt %s --iha-build-kernel --iha-apply-schedule="mix=fused" 2>&1 | FileCheck %s --check-prefix=REFUSED

// A backward kernel keeps the pre-mix and the attention, which stores the
// pseudo outputs (no collapse launch), then adds the backward's launches.
// The key-block-outer launch runs one CTA per (key block, kv head, batch)
// over the group's query heads, its query-block loop split by the
// transposed mask ranges (computed once, before the head loop); the
// separate dq launch loops over key blocks by the forward's ranges.
// CHECK-LABEL: iha.kernel @gqa backward
// CHECK-SAME:    schedule(<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = materialized, collapse = separate>)
// CHECK:         iha.launch @iha_premix
// CHECK:         iha.launch @iha_attention
// CHECK:           iha.store_rows
// CHECK-NOT:     iha.launch @iha_collapse
// CHECK:         iha.launch @iha_bwd_prep attributes {grid_y = 1 : i64, rows_per_cta = 32 : i64, rows_per_token = 1 : i64
// CHECK:           iha.collapse_grad tokens
// CHECK:         iha.launch @iha_bwd_kv attributes {grid_y = 2 : i64, rows_per_cta = 64 : i64, rows_per_token = 2 : i64
// CHECK:           %[[COL0:[0-9a-z_]+]] = arith.muli %arg0
// CHECK-NEXT:      iha.kv_grad_begin cols %[[COL0]] head %arg1 batch %arg2 part %c0_i64
// CHECK:           iha.seq_len
// CHECK:           iha.for_group_heads %arg1 {
// CHECK-NEXT:      ^bb0(%[[H:[0-9a-z_]+]]: i64):
// CHECK-NEXT:        iha.q_loop %[[LO:[0-9a-z_]+]] to %[[ILO:[0-9a-z_]+]] cols %[[COL0]] head %[[H]] batch %arg2 {masked}
// CHECK-NEXT:        iha.q_loop %[[ILO]] to %[[IHI:[0-9a-z_]+]] cols %[[COL0]] head %[[H]] batch %arg2{{$}}
// CHECK-NEXT:        iha.q_loop %[[IHI]] to %[[HI:[0-9a-z_]+]] cols %[[COL0]] head %[[H]] batch %arg2 {masked}
// CHECK-NEXT:      }
// CHECK-NEXT:      iha.kv_grad_store cols %[[COL0]] head %arg1 batch %arg2
// CHECK:         iha.launch @iha_bwd_q attributes {grid_y = 4 : i64, rows_per_cta = 64 : i64, rows_per_token = 2 : i64
// CHECK:           iha.dq_begin rows %[[ROW0:[0-9a-z_]+]] head %arg1 batch %arg2 part %c0_i64
// CHECK:           iha.dq_loop %{{.*}} to %[[DILO:[0-9a-z_]+]] rows %[[ROW0]] head %arg1 batch %arg2 {masked}
// CHECK-NEXT:      iha.dq_loop %[[DILO]] to %[[DIHI:[0-9a-z_]+]] rows %[[ROW0]] head %arg1 batch %arg2{{$}}
// CHECK-NEXT:      iha.dq_loop %[[DIHI]] to %{{.*}} rows %[[ROW0]] head %arg1 batch %arg2 {masked}
// CHECK-NEXT:      iha.dq_store rows %[[ROW0]] head %arg1 batch %arg2
// CHECK:         iha.launch @iha_bwd_unmix
// CHECK:           iha.unmix query tokens
// CHECK-NEXT:      iha.unmix key tokens
// CHECK-NEXT:      iha.unmix value tokens
// CHECK:         iha.launch @iha_bwd_reduce attributes {grid_y = 1 : i64, rows_per_cta = 1073741824 : i64
// CHECK:           iha.reduce_grads chunk %arg1 batch %arg2

// dq by atomic adds: the key-block loops say so, and there is no dq launch.
// ATOMIC-LABEL: iha.kernel @gqa backward
// ATOMIC-SAME:    dq = atomic
// ATOMIC:         iha.q_loop {{.*}} {atomic_dq, masked}
// ATOMIC-NOT:     iha.launch @iha_bwd_q
// ATOMIC:         iha.launch @iha_bwd_unmix

// The backward reads every mixed row many times: fused mixing is refused.
// REFUSED: schedule.mix must be materialized for a backward kernel

// The program: one LOOM_KERNEL per launch; the key-block step's tile calls.
// EMITC:       static constexpr bool atomic_dq = false;
// EMITC:       emitc.func @iha_bwd_kv
// EMITC:         emitc.call_opaque "loom::kv_grad_begin"
// EMITC:         emitc.for
// EMITC:           emitc.for
// EMITC:             emitc.call_opaque "loom::load_q_grad"
// EMITC-NEXT:        emitc.call_opaque "loom::bwd_scores"
// EMITC-NEXT:        emitc.call_opaque "loom::bwd_mask"
// EMITC-NEXT:        emitc.call_opaque "loom::bwd_probs"
// EMITC-NEXT:        emitc.call_opaque "loom::bwd_dv"
// EMITC-NEXT:        emitc.call_opaque "loom::bwd_ds"
// EMITC-NEXT:        emitc.call_opaque "loom::bwd_dk"
// EMITC:         emitc.call_opaque "loom::kv_grad_store"
// EMITC:       emitc.func @iha_bwd_q
// EMITC:         emitc.call_opaque "loom::load_q_grad"
// EMITC-NEXT:    emitc.call_opaque "loom::dq_init"
// EMITC:           emitc.call_opaque "loom::load_kv_grad"
// EMITC:           emitc.call_opaque "loom::dq_accumulate"
// EMITC:         emitc.call_opaque "loom::dq_store"
// EMITC:       emitc.func @iha_bwd_unmix
// EMITC:       emitc.func @iha_bwd_reduce
iha.kernel @gqa backward spec(#iha.spec<heads = 4, kv_heads = 2, pseudo_heads = 2, head_dim = 8, dtype = f32, mask = flat_causal, window = 3, collapse = per_head, rope_theta = 10000.0, scale = 0.35355339059327373>) {
}
