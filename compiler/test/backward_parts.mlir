// RUN: loom-opt %s --iha-build-kernel --iha-apply-schedule --canonicalize --cse | FileCheck %s
// RUN: loom-opt %s --iha-pipeline | FileCheck %s --check-prefix=EMITC

// Past head_dim 128 the gradient columns split into parts (layout.h,
// backwardColumnParts; two at head_dim 256): the key-block-outer and dq
// launches' grid y is (head, part), the head and part taken from it.
// CHECK-LABEL: iha.kernel @wide backward
// CHECK:         iha.launch @iha_bwd_kv attributes {grid_y = 4 : i64
// CHECK:           %[[KVG:[0-9a-z_]+]] = arith.floordivsi %arg1, %[[TWO:[0-9a-z_]+]]
// CHECK:           %[[KVP:[0-9a-z_]+]] = arith.remsi %arg1, %[[TWO]]
// CHECK-NEXT:      iha.kv_grad_begin cols %{{.*}} head %[[KVG]] batch %arg2 part %[[KVP]]
// CHECK:           iha.for_group_heads %[[KVG]] {
// CHECK:           iha.kv_grad_store cols %{{.*}} head %[[KVG]] batch %arg2
// CHECK:         iha.launch @iha_bwd_q attributes {grid_y = 8 : i64
// CHECK:           %[[QH:[0-9a-z_]+]] = arith.floordivsi %arg1, %[[QTWO:[0-9a-z_]+]]
// CHECK:           %[[QP:[0-9a-z_]+]] = arith.remsi %arg1, %[[QTWO]]
// CHECK-NEXT:      iha.dq_begin rows %[[QROW0:[0-9a-z_]+]] head %[[QH]] batch %arg2 part %[[QP]]
// CHECK:           iha.dq_store rows %[[QROW0]] head %[[QH]] batch %arg2
// The part reaches the tiles: kv_grad_begin and dq_init take it.
// EMITC:       emitc.func @iha_bwd_kv
// EMITC:         %[[P:[0-9a-z_]+]] = emitc.rem
// EMITC:         emitc.call_opaque "loom::kv_grad_begin"({{.*}}, %[[P]])
// EMITC:       emitc.func @iha_bwd_q
// EMITC:         %[[QP:[0-9a-z_]+]] = emitc.rem
// EMITC:         emitc.call_opaque "loom::dq_init"({{.*}}, %[[QP]])
iha.kernel @wide backward spec(#iha.spec<heads = 4, kv_heads = 2, pseudo_heads = 2, head_dim = 256, dtype = f32, mask = flat_causal, window = 3, collapse = per_head, rope_theta = 10000.0, scale = 0.0625>) {
}
