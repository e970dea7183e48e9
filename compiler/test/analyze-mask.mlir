// RUN: loom-opt %s --iha-build-kernel --iha-apply-schedule --iha-analyze-mask --canonicalize --cse | FileCheck %s

// flat_causal with a window: the stream covers [lo, hi) and three loops split
// it into masked / interior (no mask) / masked.
// CHECK-LABEL: iha.kernel @flat_window
// CHECK:         iha.launch @iha_attention
// CHECK:           %[[ROW0:[0-9a-z_]+]] = arith.muli %arg0
// CHECK:           %[[L:[0-9a-z_]+]] = iha.seq_len
// CHECK:           arith.minsi
// CHECK:           iha.kv_stream %[[LO:[0-9a-z_]+]] to %[[HI:[0-9a-z_]+]] head
// CHECK-NEXT:      iha.kv_loop %[[LO]] to %[[ILO:[0-9a-z_]+]] rows %[[ROW0]] head %arg1 batch %arg2 {masked}
// CHECK-NEXT:      iha.kv_loop %[[ILO]] to %[[IHI:[0-9a-z_]+]] rows %[[ROW0]] head %arg1 batch %arg2{{$}}
// CHECK-NEXT:      iha.kv_loop %[[IHI]] to %[[HI]] rows %[[ROW0]] head %arg1 batch %arg2 {masked}
iha.kernel @flat_window spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = flat_causal, window = 40, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
}

// A window wide enough that the blocks before the interior reach no row's
// last key (loom::leadingBlocksCrossOnlyTheLowerEdge: 200 rows against 64 x
// 64 blocks): the leading loop is marked lower_edge, its mask tests each
// row's first key alone; the trailing loop is masked in full. The window of
// 40 tokens above (80 rows) is too narrow for it.
// CHECK-LABEL: iha.kernel @wide_window
// CHECK:           iha.kv_stream %[[LO:[0-9a-z_]+]] to %[[HI:[0-9a-z_]+]] head
// CHECK-NEXT:      iha.kv_loop %[[LO]] to %[[ILO:[0-9a-z_]+]] {{.*}} {lower_edge, masked}
// CHECK-NEXT:      iha.kv_loop %[[ILO]] to %[[IHI:[0-9a-z_]+]] rows {{.*}}batch %arg2{{$}}
// CHECK-NEXT:      iha.kv_loop %[[IHI]] to %[[HI]] {{.*}} {masked}
iha.kernel @wide_window spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = flat_causal, window = 100, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
}

// No mask and no window: every block is visited, the stream starts at 0, the
// empty leading masked loop is dropped, and only the partial last block (if
// any) needs its bounds mask.
// CHECK-LABEL: iha.kernel @unmasked
// CHECK:           %[[ZERO:[0-9a-z_]+]] = arith.constant 0 : i64
// CHECK:           %[[NKB:[0-9a-z_]+]] = arith.ceildivsi
// CHECK:           %[[FULL:[0-9a-z_]+]] = arith.floordivsi
// CHECK:           iha.kv_stream %[[ZERO]] to %[[NKB]]
// CHECK-NEXT:      iha.kv_loop %[[ZERO]] to %[[FULL]]
// CHECK-NEXT:      iha.kv_loop %[[FULL]] to %[[NKB]] {{.*}} {masked}
iha.kernel @unmasked spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 1, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
}

// Running the pass twice changes nothing: analysed launches are skipped.
// CHECK-LABEL: iha.kernel @token
// CHECK-COUNT-3: iha.kv_loop
// CHECK-NOT:     iha.kv_loop
iha.kernel @token spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 3, head_dim = 16, dtype = f32, mask = token_causal, window = 2, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
}

// The options of public IHA code keep the three-loop split. window_rows (a
// window of 5 virtual rows, off a multiple of P = 2) and a flat_causal window
// aligned to tokens both bound the stream from below; the options survive the
// round trip through the printer. (Exactness of the ranges for every rule is
// tests/unit/mask_rule_test.cpp's job.)
// CHECK-LABEL: iha.kernel @window_rows spec(<{{.*}}qk_norm = rms, rope_direction = negative, window_rows = 5>)
// CHECK:           iha.kv_stream %[[LO:[0-9a-z_]+]] to %[[HI:[0-9a-z_]+]] head
// CHECK-NEXT:      iha.kv_loop %[[LO]] to %[[ILO:[0-9a-z_]+]] {{.*}} {masked}
// CHECK-NEXT:      iha.kv_loop %[[ILO]] to %[[IHI:[0-9a-z_]+]] rows
// CHECK-NEXT:      iha.kv_loop %[[IHI]] to %[[HI]] {{.*}} {masked}
iha.kernel @window_rows spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = flat_causal, window = 0, collapse = per_head, rope_theta = 1.0e+04, scale = 0.25, qk_norm = rms, rope_direction = negative, window_rows = 5>) {
}

// CHECK-LABEL: iha.kernel @token_aligned spec(<{{.*}}window = 4, {{.*}}window_align = token>)
// CHECK:           iha.kv_stream %[[LO:[0-9a-z_]+]] to %[[HI:[0-9a-z_]+]] head
// CHECK-NEXT:      iha.kv_loop %[[LO]] to
// CHECK-COUNT-2:   iha.kv_loop
iha.kernel @token_aligned spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 3, head_dim = 16, dtype = f32, mask = flat_causal, window = 4, collapse = per_head, rope_theta = 0.0, scale = 0.25, window_align = token>) {
}


// varlen: the ranges are cut to the documents of the block's first and last
// rows, looked up once (two starts and an end), and the three loops stay.
// CHECK-LABEL: iha.kernel @varlen spec(<{{.*}}varlen = true>)
// CHECK:           %[[ROW0:[0-9a-z_]+]] = arith.muli %arg0
// CHECK:           iha.document_bound %[[ROW0]] :
// CHECK:           iha.document_bound %[[LAST:[0-9a-z_]+]] end :
// CHECK:           iha.document_bound %[[LAST]] :
// CHECK:           iha.kv_stream %[[LO:[0-9a-z_]+]] to %[[HI:[0-9a-z_]+]] head
// CHECK-NEXT:      iha.kv_loop %[[LO]] to %[[ILO:[0-9a-z_]+]] {{.*}} {masked}
// CHECK-NEXT:      iha.kv_loop %[[ILO]] to %[[IHI:[0-9a-z_]+]] rows
// CHECK-NEXT:      iha.kv_loop %[[IHI]] to %[[HI]] {{.*}} {masked}
iha.kernel @varlen spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = flat_causal, window = 0, collapse = per_head, rope_theta = 1.0e+04, scale = 0.25, varlen = true>) {
}
