// RUN: loom-opt %s --split-input-file --verify-diagnostics

// expected-error @+1 {{kv_heads (3) must divide heads (4)}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 3, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
}

// -----

// expected-error @+1 {{head_dim (12) is unsupported: it must be a multiple of 8 up to 256}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 12, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
}

// -----

// expected-error @+1 {{window (-1) must not be negative}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = none, window = -1, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
}

// -----

// expected-error @+1 {{schedule.block_m (16) must hold at least one token (pseudo_heads = 20 rows)}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 20, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 16, block_n = 64, warps = 1, stages = 2, mix = fused, collapse = epilogue>) {
}

// -----

// expected-error @+1 {{schedule.block_m (32) must be a multiple of 16 rows per warp x 4 warps}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 32, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = epilogue>) {
}

// -----

// expected-error @+1 {{schedule.stages (5) must be in [1, 4]}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 5, mix = fused, collapse = epilogue>) {
}

// -----

// expected-error @+1 {{schedule.block_n (24) must be a multiple of 16 in [16, 256]}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 24, warps = 4, stages = 2, mix = fused, collapse = epilogue>) {
}

// -----

// expected-error @+1 {{schedule.warps (3) must be 1, 2, 4 or 8}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 96, block_n = 64, warps = 3, stages = 2, mix = fused, collapse = epilogue>) {
}

// -----

iha.kernel @iha spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 1, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = epilogue>) {
  // expected-error @+1 {{body must take 3 i64 arguments (x block, y index, batch)}}
  iha.launch @bad attributes {grid_y = 1 : i64, rows_per_cta = 64 : i64, rows_per_token = 1 : i64, threads = 128 : i64} {
  ^bb0(%x: i64):
  }
}

// -----

// expected-error @+1 {{has launches but no schedule}}
iha.kernel @iha spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 1, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
  iha.launch @l attributes {grid_y = 1 : i64, rows_per_cta = 64 : i64, rows_per_token = 1 : i64, threads = 128 : i64} {
  ^bb0(%x: i64, %y: i64, %b: i64):
  }
}

// -----

iha.kernel @iha spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 1, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = epilogue>) {
  iha.launch @l attributes {grid_y = 1 : i64, rows_per_cta = 64 : i64, rows_per_token = 1 : i64, threads = 128 : i64} {
  ^bb0(%x: i64, %y: i64, %b: i64):
    // expected-error @+1 {{needs an iha.kv_stream before it in its block}}
    iha.kv_loop %x to %x rows %x head %y batch %b {masked}
  }
}

// -----

iha.kernel @iha spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 1, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = epilogue>) {
  iha.launch @l attributes {grid_y = 1 : i64, rows_per_cta = 64 : i64, rows_per_token = 1 : i64, threads = 128 : i64} {
  ^bb0(%x: i64, %y: i64, %b: i64):
    iha.kv_stream %x to %x head %y batch %b {mixed}
    // expected-error @+1 {{mixed (0) differs from its iha.kv_stream's (1)}}
    iha.kv_loop %x to %x rows %x head %y batch %b
  }
}

// -----

iha.kernel @iha spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 1, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = epilogue>) {
  iha.launch @l attributes {grid_y = 1 : i64, rows_per_cta = 64 : i64, rows_per_token = 1 : i64, threads = 128 : i64} {
  ^bb0(%x: i64, %y: i64, %b: i64):
    // expected-error @+1 {{belongs to a kernel of a varlen spec}}
    %first = iha.document_bound %x : i64
  }
}

// -----

iha.kernel @iha spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 1, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
  // expected-error @+1 {{must be inside an iha.launch}}
  %L = iha.seq_len : i64
}

// -----

// expected-error @+1 {{schedule.block_m (64) must be 64 rows per consumer warpgroup (128) with engine wgmma}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 64, dtype = bf16, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.125>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 8, stages = 2, mix = fused, collapse = epilogue, engine = wgmma, producer_registers = 24>) {
}

// -----

// expected-error @+1 {{engine wgmma needs head_dim (32) a multiple of 64, at most 256 (use engine mma)}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 32, dtype = bf16, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.125>) schedule(#iha.schedule<block_m = 128, block_n = 64, warps = 8, stages = 2, mix = fused, collapse = epilogue, engine = wgmma, producer_registers = 24>) {
}

// -----

// expected-error @+1 {{schedule.producer_registers (20) must be a multiple of 8 in [24, 240]}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 64, dtype = bf16, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.125>) schedule(#iha.schedule<block_m = 128, block_n = 64, warps = 8, stages = 2, mix = fused, collapse = epilogue, engine = wgmma, producer_registers = 20>) {
}

// -----

// expected-error @+1 {{schedule.producer_registers is for engine wgmma only}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 64, dtype = bf16, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.125>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = epilogue, producer_registers = 24>) {
}

// -----

iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 64, dtype = bf16, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.125>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = fused, collapse = epilogue, engine = wgmma, producer_registers = 24>) {
  iha.launch @iha_attention attributes {grid_y = 4 : i64, rows_per_cta = 64 : i64, rows_per_token = 2 : i64, threads = 256 : i64} {
  ^bb0(%x: i64, %h: i64, %b: i64):
    %c0 = arith.constant 0 : i64
    iha.warp_specialize producer {
      iha.kv_stream %c0 to %c0 head %h batch %b
    } consumer {
      // expected-error @+1 {{mixed (1) differs from its iha.kv_stream's (0)}}
      iha.kv_loop %c0 to %c0 rows %c0 head %h batch %b {mixed}
    }
  }
}

// -----

// expected-error @+1 {{rope_direction negative needs rotary embedding (rope_theta > 0)}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25, rope_direction = negative>) {
}

// -----

// expected-error @+1 {{window_align token needs a window (window > 0 tokens)}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25, window_align = token>) {
}

// -----

// expected-error @+1 {{window_rows needs mask flat_causal and window 0}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = token_causal, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25, window_rows = 5>) {
}

// -----

// expected-error @+1 {{qk_norm_eps must be positive}}
iha.kernel @iha spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25, qk_norm = rms, qk_norm_eps = 0.0>) {
}

// -----

// expected-error @+1 {{holds iha.backward but is not a backward kernel}}
iha.kernel @iha spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 1, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
  iha.backward
}

// -----

iha.kernel @iha backward spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 1, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = materialized, collapse = separate>) {
  iha.launch @l attributes {grid_y = 1 : i64, rows_per_cta = 64 : i64, rows_per_token = 1 : i64, threads = 128 : i64} {
  ^bb0(%x: i64, %y: i64, %b: i64):
    // expected-error @+1 {{needs an iha.kv_grad_begin before it}}
    iha.q_loop %x to %x cols %x head %y batch %b {masked}
  }
}

// -----

iha.kernel @iha backward spec(#iha.spec<heads = 1, kv_heads = 1, pseudo_heads = 1, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) schedule(#iha.schedule<block_m = 64, block_n = 64, warps = 4, stages = 2, mix = materialized, collapse = separate>) {
  iha.launch @l attributes {grid_y = 1 : i64, rows_per_cta = 64 : i64, rows_per_token = 1 : i64, threads = 128 : i64} {
  ^bb0(%x: i64, %y: i64, %b: i64):
    iha.kv_grad_begin cols %x head %y batch %b part %b
    // expected-error @+1 {{needs an iha.dq_begin before it}}
    iha.dq_loop %x to %x rows %x head %y batch %b {masked}
  }
}

// -----

// expected-error @+1 {{has a mixed_cache but is not a decode kernel}}
iha.kernel @iha mixed_cache spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
}

// -----

// expected-error @+1 {{cannot be both a decode step and a backward}}
iha.kernel @iha backward decode spec(#iha.spec<heads = 4, kv_heads = 4, pseudo_heads = 2, head_dim = 16, dtype = f32, mask = none, window = 0, collapse = per_head, rope_theta = 0.0, scale = 0.25>) {
}
