//===- IhaOps.td - iha operations ----------------------------*- tablegen -*-===//
//
// Three levels, each produced by a pass (docs/compiler.md):
//   spec level     iha.kernel holding iha.mix / iha.attend / iha.collapse
//   launch level   iha.launch regions holding block-level ops (iha.load_q,
//                  iha.kv_stream, iha.kv_loop, iha.store_*), after
//                  iha-apply-schedule, refined by the analysis and fusion passes
//   EmitC          calls into the tile API, after iha-lower-to-emitc
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_IHA_OPS
#define LOOM_IHA_OPS

include "loom/Dialect/Iha/IhaAttrs.td"
include "mlir/IR/SymbolInterfaces.td"
include "mlir/IR/RegionKindInterface.td"
include "mlir/Interfaces/SideEffectInterfaces.td"

//===----------------------------------------------------------------------===//
// Spec level
//===----------------------------------------------------------------------===//

def Iha_KernelOp : Iha_Op<"kernel", [IsolatedFromAbove, Symbol, SingleBlock, NoTerminator,
                                     NoRegionArguments, SymbolTable]> {
  let summary = "one IHA computation: its spec, its schedule, and its program";
  let description = [{
    The root of a loom program. `spec` fixes the function; `schedule`, once
    iha-apply-schedule has run, fixes how it is computed. A `backward` kernel
    computes the gradients of sum(out * dout) instead of out. A `decode`
    kernel is one decode step over a paged cache (docs/IHA.md, "Decode over a
    paged cache"): the new tokens' k and v appended, their rows attended to
    every cached row; `mixed_cache` caches the mixed, rotated pseudo-keys and
    values in place of the raw k and v. The body holds
    spec-level ops before scheduling and `iha.launch` ops after.

    Example:
    ```mlir
    iha.kernel @iha spec(#iha.spec<heads = 2, kv_heads = 2, pseudo_heads = 2,
        head_dim = 8, dtype = f32, mask = flat_causal, window = 0,
        collapse = per_head, rope_theta = 0.0, scale = 0.35355339059327373>) {
      iha.mix query
      iha.mix key
      iha.mix value
      iha.attend
      iha.collapse
    }
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name, Iha_SpecAttr:$spec,
                       OptionalAttr<Iha_ScheduleAttr>:$schedule, UnitAttr:$backward, UnitAttr:$decode,
                       UnitAttr:$mixed_cache);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = [{
    $sym_name (`backward` $backward^)? (`decode` $decode^)? (`mixed_cache` $mixed_cache^)?
    `spec` `(` $spec `)` (`schedule` `(` $schedule^ `)`)?
    attr-dict-with-keyword $body
  }];
  let hasVerifier = 1;
  let extraClassDeclaration = [{
    ::mlir::Block &getBlock() { return getBody().front(); }
  }];
}

def Iha_MixOp : Iha_Op<"mix", [HasParent<"KernelOp">]> {
  let summary = "mix heads into pseudo-heads and interleave them (steps 1-3)";
  let description = [{
    For every token n and pseudo index p, row n*P + p of head h becomes
    sum_m alpha[m, h, p] * x[n, m]: the interleaved virtual sequence of the
    role's projection. Query and key rows are then rotated at their virtual
    positions when the spec has rope_theta > 0.

    Example: `iha.mix key`
  }];
  let arguments = (ins Iha_RoleAttr:$role);
  let assemblyFormat = "$role attr-dict";
}

def Iha_AttendOp : Iha_Op<"attend", [HasParent<"KernelOp">]> {
  let summary = "softmax attention over the interleaved sequence (step 4)";
  let description = [{
    Each virtual row attends to the rows its mask allows (spec.mask and
    spec.window), with query head h reading kv head h / (H / G).

    Example: `iha.attend`
  }];
  let assemblyFormat = "attr-dict";
}

def Iha_CollapseOp : Iha_Op<"collapse", [HasParent<"KernelOp">]> {
  let summary = "fold pseudo outputs back into heads (step 5)";
  let description = [{
    per_head: out[n, h] = sum_p collapse[h, p] * o_h[n*P + p];
    global:   out[n, h] = sum_{h', p} collapse[h, h'*P + p] * o_h'[n*P + p].

    Example: `iha.collapse`
  }];
  let assemblyFormat = "attr-dict";
}

def Iha_BackwardOp : Iha_Op<"backward", [HasParent<"KernelOp">]> {
  let summary = "the gradients of sum(out * dout) through the five steps, in reverse";
  let description = [{
    After the forward steps of a `backward` kernel: dout through the
    collapse (do, dcollapse), the attention (FlashAttention-2's backward on
    the interleaved sequence, with P recomputed from the forward's lse), and
    RoPE, qk_norm and mixing transposed (dq, dk, dv, dalpha_*).

    Example: `iha.backward`
  }];
  let assemblyFormat = "attr-dict";
}

//===----------------------------------------------------------------------===//
// Launch level
//===----------------------------------------------------------------------===//

def Iha_LaunchOp : Iha_Op<"launch", [HasParent<"KernelOp">, Symbol, SingleBlock, NoTerminator,
                                     IsolatedFromAbove]> {
  let summary = "one kernel entry point: a grid of CTAs running the body";
  let description = [{
    The grid is (ceil(N * rows_per_token / rows_per_cta), grid_y, B). The body
    is what one CTA of `threads` threads does; its arguments are the CTA's
    coordinates (x block, y index, batch) as i64.

    Example:
    ```mlir
    iha.launch @iha_collapse {rows_per_cta = 16, rows_per_token = 1, grid_y = 1, threads = 128} {
    ^bb0(%x: i64, %y: i64, %batch: i64):
      ...
    }
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name, I64Attr:$rows_per_token, I64Attr:$rows_per_cta,
                       I64Attr:$grid_y, I64Attr:$threads);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$sym_name attr-dict-with-keyword $body";
  let hasVerifier = 1;
  let extraClassDeclaration = [{
    ::mlir::Block &getBlock() { return getBody().front(); }
    ::mlir::Value getBlockX() { return getBlock().getArgument(0); }
    ::mlir::Value getBlockY() { return getBlock().getArgument(1); }
    ::mlir::Value getBatch() { return getBlock().getArgument(2); }
  }];
}

// Ops of one CTA's program: they live inside an iha.launch (checked by
// their verifier, which each op may extend).
class Iha_BlockOp<string mnemonic, list<Trait> traits = []> : Iha_Op<mnemonic, traits> {
  let hasVerifier = 1;
}

def Iha_SeqLenOp : Iha_BlockOp<"seq_len", [Pure]> {
  let summary = "the virtual sequence length L = N * P at run time";
  let description = [{ Example: `%L = iha.seq_len : i64` }];
  let results = (outs I64:$result);
  let assemblyFormat = "attr-dict `:` type($result)";
}

def Iha_DocumentBoundOp : Iha_BlockOp<"document_bound", [Pure]> {
  let summary = "varlen: where the document holding a virtual row starts (or ends)";
  let description = [{
    In a kernel of a varlen spec (packed documents, cu_seqlens at run time),
    the first virtual row of the document holding virtual row `row`, or with
    `end` one past its last: iha-analyze-mask cuts a CTA's block ranges to
    its rows' documents.

    Example: `%first = iha.document_bound %row0 : i64`,
    `%end = iha.document_bound %last end : i64`
  }];
  let arguments = (ins I64:$row, UnitAttr:$end);
  let results = (outs I64:$result);
  let assemblyFormat = "$row (`end` $end^)? attr-dict `:` type($result)";
}

def Iha_DecodeLenOp : Iha_BlockOp<"decode_len", [Pure]> {
  let summary = "a decode step's virtual sequence length: (cache_len[batch] + T) * P";
  let description = [{
    In a decode kernel, the rows of sequence `batch` once the step's T new
    tokens are cached: the end of its keys and of its new query rows.

    Example: `%L = iha.decode_len batch %b : i64`
  }];
  let arguments = (ins I64:$batch);
  let results = (outs I64:$result);
  let assemblyFormat = "`batch` $batch attr-dict `:` type($result)";
}

def Iha_CachedRowsOp : Iha_BlockOp<"cached_rows", [Pure]> {
  let summary = "a decode step's first new virtual row: cache_len[batch] * P";
  let description = [{
    The new tokens of sequence `batch` sit after its cached ones, so its
    query rows start there (their RoPE positions and masks are the forward's).

    Example: `%r = iha.cached_rows batch %b : i64`
  }];
  let arguments = (ins I64:$batch);
  let results = (outs I64:$result);
  let assemblyFormat = "`batch` $batch attr-dict `:` type($result)";
}

def Iha_AppendCacheOp : Iha_BlockOp<"append_cache"> {
  let summary = "write a block of a decode step's new tokens' k and v into the paged cache";
  let description = [{
    For the CTA's new tokens [token0, token0 + rows_per_cta) of sequence
    `batch`: token t goes to position cache_len[batch] + t, in page
    page_table[batch][position / page_size], as the raw k and v or, in a
    `mixed_cache` kernel, as the mixed pseudo-keys (normalised, rotated at
    their virtual positions) and pseudo-values.

    Example: `iha.append_cache tokens %t0 batch %b`
  }];
  let arguments = (ins I64:$token0, I64:$batch);
  let assemblyFormat = "`tokens` $token0 `batch` $batch attr-dict";
}

def Iha_PremixOp : Iha_BlockOp<"premix"> {
  let summary = "materialise mixed (and rotated) rows of one role for a block of tokens";
  let description = [{
    Writes rows n*P + p for the CTA's tokens [token0, token0 + rows_per_cta)
    into the role's workspace (q_mixed [B, H, L, d], k_mixed / v_mixed
    [B, G, L, d]).

    Example: `iha.premix query tokens %t0 batch %b`
  }];
  let arguments = (ins Iha_RoleAttr:$role, I64:$token0, I64:$batch);
  let assemblyFormat = "$role `tokens` $token0 `batch` $batch attr-dict";
}

def Iha_CollapseRowsOp : Iha_BlockOp<"collapse_rows"> {
  let summary = "collapse pseudo outputs of a block of tokens into out (separate launch)";
  let description = [{ Example: `iha.collapse_rows tokens %t0 batch %b` }];
  let arguments = (ins I64:$token0, I64:$batch);
  let assemblyFormat = "`tokens` $token0 `batch` $batch attr-dict";
}

def Iha_LoadQOp : Iha_BlockOp<"load_q"> {
  let summary = "load the CTA's query block and reset its softmax state";
  let description = [{
    Rows [row0, row0 + block_m) of query head `head`: read from q_mixed, or,
    with `mixed`, mixed from q and alpha_q (and rotated) on the fly. The
    running max, denominator and output accumulator start empty.

    Example: `iha.load_q rows %r0 head %h batch %b {mixed}`
  }];
  let arguments = (ins I64:$row0, I64:$head, I64:$batch, UnitAttr:$mixed);
  let assemblyFormat = "`rows` $row0 `head` $head `batch` $batch attr-dict";
}

def Iha_KvStreamOp : Iha_BlockOp<"kv_stream"> {
  let summary = "start streaming key blocks [lower, upper) through the K/V pipeline";
  let description = [{
    The pipeline prologue: issues the loads of the first `stages - 1` key
    blocks of the range. The `iha.kv_loop`s that follow consume the range in
    order, each step issuing the load `stages - 1` blocks ahead.

    Example: `iha.kv_stream %lo to %hi head %h batch %b {mixed}`
  }];
  let arguments = (ins I64:$lower, I64:$upper, I64:$head, I64:$batch, UnitAttr:$mixed);
  let assemblyFormat = "$lower `to` $upper `head` $head `batch` $batch attr-dict";
}

def Iha_KvLoopOp : Iha_BlockOp<"kv_loop"> {
  let summary = "online-softmax steps over key blocks [lower, upper)";
  let description = [{
    For each key block: wait for its K/V tile, S = scale * Q K^T, apply the
    element-wise mask if `masked`, update the running max and denominator,
    rescale the accumulator and add P V. Only a loop marked `masked` applies
    a mask; iha-analyze-mask proves the others need none. A masked loop
    marked `lower_edge` (the blocks before the interior, where
    loom::leadingBlocksCrossOnlyTheLowerEdge holds) hides only keys below
    each row's first: its mask tests nothing else.

    Example: `iha.kv_loop %lo to %hi rows %r0 head %h batch %b {masked}`
  }];
  let arguments = (ins I64:$lower, I64:$upper, I64:$row0, I64:$head, I64:$batch,
                       UnitAttr:$masked, UnitAttr:$mixed, UnitAttr:$lower_edge);
  let assemblyFormat = "$lower `to` $upper `rows` $row0 `head` $head `batch` $batch attr-dict";
  // A loop whose bounds are one value runs no step: canonicalisation drops it.
  let hasCanonicalizeMethod = 1;
}

def Iha_StoreRowsOp : Iha_BlockOp<"store_rows"> {
  let summary = "normalise and write the block's pseudo outputs (and lse)";
  let description = [{
    o / l into o_pseudo [B, H, L, d] for a separate collapse; lse when asked.

    Example: `iha.store_rows rows %r0 head %h batch %b`
  }];
  let arguments = (ins I64:$row0, I64:$head, I64:$batch);
  let assemblyFormat = "`rows` $row0 `head` $head `batch` $batch attr-dict";
}

def Iha_StoreSplitOp : Iha_BlockOp<"store_split"> {
  let summary = "write a split CTA's normalised partial rows and their lse";
  let description = [{
    In a decode kernel with kv_splits > 1 each split CTA holds the rows of
    its share of the key blocks: o / l and lse (-inf where the share held
    no allowed key) into the splits workspace [B, H, kv_splits, T * P,
    d + 1] (float; lse in the last column), which iha.combine_splits merges.

    Example: `iha.store_split rows %r0 head %h batch %b split %s`
  }];
  let arguments = (ins I64:$row0, I64:$head, I64:$batch, I64:$split);
  let assemblyFormat = "`rows` $row0 `head` $head `batch` $batch `split` $split attr-dict";
}

def Iha_CombineSplitsOp : Iha_BlockOp<"combine_splits"> {
  let summary = "merge the split CTAs' partial rows of a block of tokens (flash-decoding's combine)";
  let description = [{
    For every head and pseudo-row of the CTA's new tokens: with M the
    largest split lse, o = sum_s e^(lse_s - M) o_s / sum_s e^(lse_s - M)
    into o_pseudo, and lse = M + log sum_s e^(lse_s - M) when asked.

    Example: `iha.combine_splits tokens %t0 batch %b`
  }];
  let arguments = (ins I64:$token0, I64:$batch);
  let assemblyFormat = "`tokens` $token0 `batch` $batch attr-dict";
}

def Iha_StoreCollapsedOp : Iha_BlockOp<"store_collapsed"> {
  let summary = "normalise, collapse per head in the epilogue and write out";
  let description = [{
    The block holds whole tokens, so out[n, h] = sum_p collapse[h, p] *
    o[n*P + p] needs nothing from other CTAs.

    Example: `iha.store_collapsed rows %r0 head %h batch %b`
  }];
  let arguments = (ins I64:$row0, I64:$head, I64:$batch);
  let assemblyFormat = "`rows` $row0 `head` $head `batch` $batch attr-dict";
}

def Iha_ForEachHeadOp : Iha_BlockOp<"for_each_head", [SingleBlock, NoTerminator]> {
  let summary = "run the body once per query head inside one CTA";
  let description = [{
    Used by a fused global collapse: one CTA computes every head of its
    query block so the mixture over heads stays on chip. The block
    argument is the head index.

    Example:
    ```mlir
    iha.for_each_head {
    ^bb0(%h: i64):
      ...
    }
    ```
  }];
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "attr-dict-with-keyword $body";
  let hasVerifier = 1;
}

def Iha_WarpSpecializeOp : Iha_BlockOp<"warp_specialize", [NoTerminator]> {
  let summary = "split a CTA into a producer warpgroup and consumer warpgroups";
  let description = [{
    Made by iha-warp-specialize for the wgmma engine. Both regions are slices
    of one program: `producer` keeps each `iha.kv_stream` (and what its
    bounds need) and streams those key blocks into the pipeline; `consumer`
    keeps everything else, and its `iha.kv_loop`s take the blocks in the
    same order. The producer runs on warpgroup 0 with its registers capped,
    the consumers on the rest.

    Example:
    ```mlir
    iha.warp_specialize producer {
      iha.kv_stream %lo to %hi head %h batch %b
    } consumer {
      iha.load_q rows %r0 head %h batch %b
      iha.kv_loop %lo to %hi rows %r0 head %h batch %b {masked}
      iha.store_collapsed rows %r0 head %h batch %b
    }
    ```
  }];
  let regions = (region SizedRegion<1>:$producer, SizedRegion<1>:$consumer);
  let assemblyFormat = "`producer` $producer `consumer` $consumer attr-dict";
}

def Iha_OutInitOp : Iha_BlockOp<"out_init"> {
  let summary = "zero the CTA's output tile for a fused global collapse";
  let description = [{ Example: `iha.out_init` }];
  let assemblyFormat = "attr-dict";
}

def Iha_AccumulateCollapsedOp : Iha_BlockOp<"accumulate_collapsed"> {
  let summary = "normalise one head's block and add its share to every output head";
  let description = [{
    out[n, h] += sum_p collapse[h, head*P + p] * o_head[n*P + p] for all h.

    Example: `iha.accumulate_collapsed rows %r0 head %h batch %b`
  }];
  let arguments = (ins I64:$row0, I64:$head, I64:$batch);
  let assemblyFormat = "`rows` $row0 `head` $head `batch` $batch attr-dict";
}

def Iha_StoreOutOp : Iha_BlockOp<"store_out"> {
  let summary = "write the CTA's output tile (all heads of its tokens)";
  let description = [{ Example: `iha.store_out rows %r0 batch %b` }];
  let arguments = (ins I64:$row0, I64:$batch);
  let assemblyFormat = "`rows` $row0 `batch` $batch attr-dict";
}

//===----------------------------------------------------------------------===//
// Launch level, backward (docs/compiler.md, "The backward")
//===----------------------------------------------------------------------===//

def Iha_CollapseGradOp : Iha_BlockOp<"collapse_grad"> {
  let summary = "dout through the collapse for a block of tokens: do, D = rowsum(do * o), dcollapse";
  let description = [{
    For the CTA's tokens: the pseudo-output gradients do [B, H, L, d], the
    FlashAttention pre-pass D = rowsum(do * o) [B, H, L] from the forward's
    pseudo outputs, and this CTA's share of dcollapse (a per-CTA partial
    sum, reduced by `iha.reduce_grads`). Zeroes dq's workspace rows when dq
    is accumulated by atomic adds.

    Example: `iha.collapse_grad tokens %t0 batch %b`
  }];
  let arguments = (ins I64:$token0, I64:$batch);
  let assemblyFormat = "`tokens` $token0 `batch` $batch attr-dict";
}

def Iha_KvGradBeginOp : Iha_BlockOp<"kv_grad_begin"> {
  let summary = "load a key block's K and V rows and zero its dK, dV accumulators";
  let description = [{
    `part` is the CTA's share of dK's and dV's columns (layout.h,
    backwardColumnParts: 0 where the head is one part).

    Example: `iha.kv_grad_begin cols %c0 head %g batch %b part %p`
  }];
  let arguments = (ins I64:$col0, I64:$head, I64:$batch, I64:$part);
  let assemblyFormat = "`cols` $col0 `head` $head `batch` $batch `part` $part attr-dict";
}

def Iha_ForGroupHeadsOp : Iha_BlockOp<"for_group_heads", [SingleBlock, NoTerminator]> {
  let summary = "run the body once per query head reading kv head `head` (GQA)";
  let description = [{
    dK and dV of a kv head sum over the H / G query heads of its group: one
    CTA runs them all, so the sum needs no atomics. The block argument is
    the query head.

    Example:
    ```mlir
    iha.for_group_heads %g {
    ^bb0(%h: i64):
      ...
    }
    ```
  }];
  let arguments = (ins I64:$head);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$head attr-dict-with-keyword $body";
  let hasVerifier = 1;
}

def Iha_QLoopOp : Iha_BlockOp<"q_loop"> {
  let summary = "backward steps of a key block over query blocks [lower, upper)";
  let description = [{
    For each query block of `block_m` rows: load Q, do, lse and D; S =
    scale * Q K^T, masked if `masked`; P = exp(S - lse); dV += P^T do;
    dS = P * (do V^T - D); dK += scale * dS^T Q; with `atomic_dq`, dq +=
    scale * dS K by atomic adds. Only `masked` loops apply a mask;
    iha-analyze-mask proves the others need none.

    Example: `iha.q_loop %lo to %hi cols %c0 head %h batch %b {masked}`
  }];
  let arguments = (ins I64:$lower, I64:$upper, I64:$col0, I64:$head, I64:$batch,
                       UnitAttr:$masked, UnitAttr:$atomic_dq);
  let assemblyFormat = "$lower `to` $upper `cols` $col0 `head` $head `batch` $batch attr-dict";
  let hasCanonicalizeMethod = 1;
}

def Iha_KvGradStoreOp : Iha_BlockOp<"kv_grad_store"> {
  let summary = "write the key block's dK and dV pseudo rows";
  let description = [{ Example: `iha.kv_grad_store cols %c0 head %g batch %b` }];
  let arguments = (ins I64:$col0, I64:$head, I64:$batch);
  let assemblyFormat = "`cols` $col0 `head` $head `batch` $batch attr-dict";
}

def Iha_DqBeginOp : Iha_BlockOp<"dq_begin"> {
  let summary = "load a query block's Q, do, lse and D and zero its dq accumulator";
  let description = [{
    `part` is the CTA's share of dq's columns (layout.h, backwardDqParts:
    0 where the head is one part, as always on wgmma).

    Example: `iha.dq_begin rows %r0 head %h batch %b part %p`
  }];
  let arguments = (ins I64:$row0, I64:$head, I64:$batch, I64:$part);
  let assemblyFormat = "`rows` $row0 `head` $head `batch` $batch `part` $part attr-dict";
}

def Iha_DqLoopOp : Iha_BlockOp<"dq_loop"> {
  let summary = "dq steps of a query block over key blocks [lower, upper)";
  let description = [{
    For each key block: load K and V, S = scale * Q K^T (masked if
    `masked`), P = exp(S - lse), dS = P * (do V^T - D), dq += scale * dS K.

    Example: `iha.dq_loop %lo to %hi rows %r0 head %h batch %b {masked}`
  }];
  let arguments = (ins I64:$lower, I64:$upper, I64:$row0, I64:$head, I64:$batch, UnitAttr:$masked);
  let assemblyFormat = "$lower `to` $upper `rows` $row0 `head` $head `batch` $batch attr-dict";
  let hasCanonicalizeMethod = 1;
}

def Iha_DqStoreOp : Iha_BlockOp<"dq_store"> {
  let summary = "write the query block's dq pseudo rows";
  let description = [{ Example: `iha.dq_store rows %r0 head %h batch %b` }];
  let arguments = (ins I64:$row0, I64:$head, I64:$batch);
  let assemblyFormat = "`rows` $row0 `head` $head `batch` $batch attr-dict";
}

def Iha_UnmixOp : Iha_BlockOp<"unmix"> {
  let summary = "a role's pseudo-row gradients back through RoPE, qk_norm and mixing";
  let description = [{
    For the CTA's tokens: each pseudo-row gradient is rotated back (query
    and key), taken through qk_norm's Jacobian from the re-mixed row
    (query and key, with qk_norm rms), then spread over the heads it was
    mixed from: dx[n, m] = sum_{h,p} alpha[m, h, p] * g[h][n*P + p], written
    whole for the CTA's tokens, and its share of dalpha[m, h, p] = sum_{n,c}
    x[n, m, c] * g[h][n*P + p, c] as a per-CTA partial sum.

    Example: `iha.unmix key tokens %t0 batch %b`
  }];
  let arguments = (ins Iha_RoleAttr:$role, I64:$token0, I64:$batch);
  let assemblyFormat = "$role `tokens` $token0 `batch` $batch attr-dict";
}

def Iha_ReduceGradsOp : Iha_BlockOp<"reduce_grads"> {
  let summary = "sum the per-CTA partials of dalpha_q, dalpha_k, dalpha_v and dcollapse";
  let description = [{
    Chunk `chunk` of the partial sums' entries, over every token CTA of every
    batch entry, in a fixed order (deterministic). Only batch 0 works.

    Example: `iha.reduce_grads chunk %y batch %b`
  }];
  let arguments = (ins I64:$chunk, I64:$batch);
  let assemblyFormat = "`chunk` $chunk `batch` $batch attr-dict";
}

#endif // LOOM_IHA_OPS
