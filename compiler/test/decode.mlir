// RUN: loom-opt %s --iha-build-kernel --iha-apply-schedule --iha-analyze-mask --canonicalize --cse | FileCheck %s
// RUN: loom-opt %s --iha-pipeline | FileCheck %s --check-prefix=EMITC
//
// A decode step over a raw paged cache (docs/IHA.md, Decode over a paged
// cache): the new tokens' k and v are appended first; the attention's query
// rows start at the sequence's cached rows and its keys end where the
// sequence does, cached and new.
iha.kernel @iha decode spec(#iha.spec<heads = 4, kv_heads = 2, pseudo_heads = 2, head_dim = 16, dtype = f16, mask = flat_causal, window = 0, collapse = per_head, rope_theta = 10000.0, scale = 0.25>) {
}

// CHECK-LABEL: iha.launch @iha_append
// CHECK: iha.append_cache tokens
// CHECK-LABEL: iha.launch @iha_attention
// CHECK: %[[CACHED:.*]] = iha.cached_rows batch
// CHECK: %[[ROW0:.*]] = arith.addi %[[CACHED]]
// CHECK: iha.load_q rows %[[ROW0]]
// CHECK: iha.decode_len batch
// CHECK: iha.kv_loop
// CHECK-NOT: iha.premix
// EMITC: static constexpr bool decode = true;
// EMITC-SAME: static constexpr bool mixed_cache = false;
// EMITC: emitc.func @iha_append
// EMITC: emitc.call_opaque "loom::append_cache"
// EMITC: emitc.func @iha_attention
// EMITC: emitc.call_opaque "loom::cached_rows"
// EMITC: emitc.call_opaque "loom::decode_len"
