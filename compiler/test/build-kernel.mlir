// RUN: loom-opt %s --iha-build-kernel | FileCheck %s

// An empty kernel gets the five steps of the contract, in order.
// CHECK-LABEL: iha.kernel @iha
// CHECK-NEXT:    iha.mix query
// CHECK-NEXT:    iha.mix key
// CHECK-NEXT:    iha.mix value
// CHECK-NEXT:    iha.attend
// CHECK-NEXT:    iha.collapse
// CHECK-NEXT:  }
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 2, pseudo_heads = 2, head_dim = 16, dtype = f16, mask = flat_causal, window = 0, collapse = per_head, rope_theta = 10000.0, scale = 0.25>) {
}

// A kernel that already has a body is left alone.
// CHECK-LABEL: iha.kernel @built
// CHECK-NEXT:    iha.attend
// CHECK-NEXT:  }
iha.kernel @built spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 1, head_dim = 8, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
  iha.attend
}
