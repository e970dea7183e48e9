// RUN: loom-opt %s --iha-pipeline | FileCheck %s
// RUN: loom-opt %s --iha-pipeline | mlir-translate --mlir-to-cpp | FileCheck %s --check-prefix=CPP

// CHECK: emitc.include "loom/tile/host.h"
// CHECK: emitc.verbatim "struct IhaConfig {
// CHECK-LABEL: emitc.func @iha_attention(
// CHECK-SAME:    %[[ARGS:.*]]: !emitc.opaque<"loom::IhaArgs">) attributes {specifiers = ["LOOM_KERNEL"]}
// CHECK:   emitc.variable
// CHECK:   emitc.call_opaque "loom::block_x"(%[[ARGS]])
// CHECK:   emitc.call_opaque "loom::block_z"(%[[ARGS]])
// CHECK:   emitc.call_opaque "loom::q_begin"{{.*}}template_args = [#emitc.opaque<"IhaConfig">, #emitc.opaque<"true">]
// CHECK:   emitc.call_opaque "loom::kv_begin"
// CHECK:   emitc.call_opaque "loom::q_wait"{{.*}}template_args = [#emitc.opaque<"IhaConfig">, #emitc.opaque<"true">]
// CHECK:   emitc.for
// CHECK:     emitc.call_opaque "loom::kv_produce"
// CHECK:     emitc.call_opaque "loom::kv_wait"
// CHECK:     emitc.call_opaque "loom::mma_qk"
// CHECK:     emitc.call_opaque "loom::mask_scores"
// CHECK:     emitc.call_opaque "loom::softmax_update"
// CHECK:     emitc.call_opaque "loom::mma_pv"
// CHECK:   emitc.return
// CHECK-NOT: iha.

// The translated C++: one entry point, three loops, only two with a mask.
// CPP: #include "loom/tile/host.h"
// CPP: static constexpr int pseudo_heads = 3;
// CPP: static constexpr loom::Mask mask = loom::Mask::token_causal;
// CPP-LABEL: LOOM_KERNEL void iha_attention(loom::IhaArgs
// CPP: loom::q_begin<IhaConfig, true>(
// CPP: loom::kv_begin<IhaConfig, true>(
// CPP: loom::q_wait<IhaConfig, true>(
// CPP: for (int64_t
// CPP:   loom::mask_scores<IhaConfig>(
// CPP: for (int64_t
// CPP-NOT: mask_scores
// CPP: for (int64_t
// CPP:   loom::mask_scores<IhaConfig>(
// CPP: loom::store_collapsed<IhaConfig>(
// CPP-NOT: LOOM_KERNEL
iha.kernel @iha spec(#iha.spec<heads = 2, kv_heads = 1, pseudo_heads = 3, head_dim = 16, dtype = f16, mask = token_causal, window = 4, collapse = per_head, rope_theta = 10000.0, scale = 0.25>) {
}
