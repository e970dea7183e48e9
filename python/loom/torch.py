"""loom.torch: Interleaved Head Attention for PyTorch, with autograd.

    import torch
    from loom.torch import iha, InterleavedHeadAttention

    out = iha(q, k, v, alpha_q, alpha_k, alpha_v, collapse, spec)   # differentiable in all seven
    layer = InterleavedHeadAttention(dim=256, heads=4, pseudo_heads=2)
    y = layer(x)                                                    # x [B, N, dim] -> [B, N, dim]

Shapes and the function are docs/IHA.md's: q [B, N, H, d], k and v [B, N, G, d],
alpha_q [H, H, P], alpha_k and alpha_v [G, G, P], collapse [H, P] (per_head) or
[H, H*P] (global). Where the tensors are decides what runs:

- CUDA, float16 or bfloat16: loom's CUDA kernels, forward and backward, on the
  current stream (the tuned schedule from the kernel cache, else the default),
  their workspaces from PyTorch's caching allocator: the calls can be captured
  by torch.cuda.graph (after a warm-up call that compiles and loads the
  kernels; decode with check_pages=False).
- CPU, float32, float16 or bfloat16: the same generated programs on loom's host
  tile API (slow: for checking and for tiny models).
- CPU, float64: loom's float64 reference, forward and backward (for
  torch.autograd.gradcheck; loom has no float64 kernels).

The mixing weights and collapse are float32 (float64 with float64 inputs). The
spec's dtype, when given, must be q's. With PyTorch 2.4 or later `iha` is the
custom op torch.ops.loom.iha (with a fake implementation), so torch.compile
traces it without a graph break; before that it is an autograd.Function.
`iha_eager` is the same function in plain PyTorch ops on the materialised
sequence: the baseline to compare with.
"""
import json
import math
from typing import Optional, Tuple

import torch

from . import _loom

__all__ = ["iha", "iha_varlen", "iha_eager", "decode", "paged_attention", "warmup", "InterleavedHeadAttention", "HAS_CUSTOM_OP", "spec_for"]

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# torch.library.custom_op (PyTorch 2.4 and later): an op torch.compile traces.
HAS_CUSTOM_OP = hasattr(torch, "library") and hasattr(torch.library, "custom_op")


def _spec_dict(spec) -> dict:
    if isinstance(spec, dict):
        return dict(spec)
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        return json.loads(spec)
    if isinstance(spec, str):
        with open(spec) as f:
            return json.load(f)
    raise TypeError("spec: want a dict, JSON text or a path to a JSON file")


def spec_for(spec, dtype: torch.dtype) -> dict:
    """The spec as a dict with q's dtype: a dict, JSON text or a path to a JSON
    file; a dtype it names must be `dtype`'s (float64 tensors run the float64
    reference whatever the spec names)."""
    s = _spec_dict(spec)
    if dtype == torch.float64:
        s.setdefault("dtype", "float32")
        return s
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"q: dtype {dtype}; loom takes float16, bfloat16, float32 (host) or float64 (reference)")
    name = _DTYPE_NAMES[dtype]
    if s.get("dtype", name) != name:
        raise ValueError(f"spec says dtype {s['dtype']} but q is {name}: cast q, k and v, or drop the spec's dtype")
    s["dtype"] = name
    return s


# spec_for's JSON text and the spec's output dimensions, kept by what the caller passed (a layer passes the same
# spec every call): a steady-state call parses no JSON. A path is not kept (its file may change).
_SPEC_TEXTS = {}


def _spec_text(spec, dtype: torch.dtype) -> str:
    try:
        key = (spec if isinstance(spec, str) else tuple(spec.items()), dtype)
        text = _SPEC_TEXTS.get(key)
    except (TypeError, AttributeError):  # unhashable values, or not a dict: spec_for says what is wrong
        return json.dumps(spec_for(spec, dtype), sort_keys=True)
    if text is None:
        text = json.dumps(spec_for(spec, dtype), sort_keys=True)
        if isinstance(spec, dict) or spec.lstrip().startswith("{"):
            if len(_SPEC_TEXTS) >= 1024:
                _SPEC_TEXTS.clear()
            _SPEC_TEXTS[key] = text
    return text


if hasattr(torch, "compiler") and hasattr(torch.compiler, "assume_constant_result"):
    # torch.compile evaluates it while tracing and keeps the text as a constant of the graph, where tracing
    # json.dumps would break the graph.
    _spec_text = torch.compiler.assume_constant_result(_spec_text)

_DIMS = {}


def _dims(spec_json: str) -> Tuple[int, int, int, int]:
    """(H, d, P, G) of spec_for's text, parsed once a text."""
    dims = _DIMS.get(spec_json)
    if dims is None:
        s = json.loads(spec_json)
        dims = (s["heads"], s["head_dim"], s["pseudo_heads"], s.get("kv_heads", s["heads"]))
        if len(_DIMS) >= 1024:
            _DIMS.clear()
        _DIMS[spec_json] = dims
    return dims


def _out_dims(spec_json: str) -> Tuple[int, int, int]:
    """(H, d, P) of spec_for's text: out is [B, N, H, d], lse [B, H, N*P]."""
    return _dims(spec_json)[:3]


def _stream(t: torch.Tensor):
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _prepared(tensors):
    """What loom reads, as DLPack capsules: detached (DLPack exports no tensor that requires grad), dense. loom
    launches on the stream it is given (the current one), so no producer stream needs ordering."""
    return [_capsule(t.detach().contiguous()) for t in tensors]


_capsule = torch.utils.dlpack.to_dlpack


def _workspace(spec: str, batch: int, tokens: int, direction: str, device: torch.device, schedule, cache_dir: str,
               cache: str = "raw", service: str = "", keep: bool = False, cache_tokens: int = 0):
    """A CUDA launch's workspaces from PyTorch's caching allocator, on the current stream (None on the host):
    torch's memory statistics see them, and CUDA-graph capture takes them from the graph's pool. A decode
    step's cache_tokens (max_pages x page_size) picks its kernel's shape bucket, as the launch does."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    size = _loom.workspace_bytes(spec, batch, tokens, direction, cache, schedule, index, cache_dir, service, keep,
                                 cache_tokens)
    return _capsule(torch.empty(max(size, 1), dtype=torch.uint8, device=device))


def _check_inputs(q, weights):
    for name, t in zip(("alpha_q", "alpha_k", "alpha_v", "collapse"), weights):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: IHA's tensors share one device")
        want = torch.float64 if q.dtype == torch.float64 else torch.float32
        if t.dtype != want:
            raise ValueError(f"{name}: dtype {t.dtype}, want {want} (the mixing weights and collapse are float32)")


def _bounds(cu_seqlens: Optional[torch.Tensor], q: torch.Tensor):
    """A varlen call's cu_seqlens as loom reads it (int32, dense, on q's device), or None."""
    if cu_seqlens is None:
        return None
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens: want int32 [documents + 1], got {cu_seqlens.dtype} {list(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, q on {q.device}: IHA's tensors share one device")
    return _capsule(cu_seqlens.contiguous())


def _keeps(q: torch.Tensor, schedule: Optional[str], save_forward: bool) -> bool:
    """Whether a forward keeps what its backward reads: asked for, a kernel's (not the float64 reference's), and a
    forced schedule that allows it (its mixing not fused, its collapse not fused)."""
    return bool(save_forward) and q.dtype != torch.float64 and (schedule is None or not _fuses(schedule))


_FUSES = {}


def _fuses(schedule: str) -> bool:
    """Whether a forced schedule's text fuses the mixing or the collapse (parsed once a text)."""
    fuses = _FUSES.get(schedule)
    if fuses is None:
        s = json.loads(schedule)
        fuses = s.get("mix") == "mix_fused" or s.get("collapse") == "collapse_fused"
        if len(_FUSES) >= 1024:
            _FUSES.clear()
        _FUSES[schedule] = fuses
    return fuses


def _saved_rows(spec: str, q: torch.Tensor, keep: bool):
    """The rows a keeping forward fills (q_mixed, k_mixed, v_mixed, o_pseudo: [B, H | G, N*P, d], the spec's dtype
    on CUDA, float32 on the host), or four empty tensors."""
    if not keep:
        return tuple(q.new_empty(0) for _ in range(4))
    H, d, P, G = _dims(spec)
    B, L = q.shape[0], q.shape[1] * P
    dtype = q.dtype if q.is_cuda else torch.float32
    return tuple(torch.empty((B, n, L, d), dtype=dtype, device=q.device) for n in (H, G, G, H))


def _forward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, spec: str, schedule: Optional[str], cache_dir: str,
             service: str, threads: int, cu_seqlens: Optional[torch.Tensor] = None, keep: bool = False):
    """(out [B, N, H, d], lse [B, H, N*P] float32, rows): the forward, its pseudo-heads' log-sum-exp (a varlen
    call's: B = 1, the documents packed) and, with `keep`, the four saved rows the backward starts from
    (_saved_rows; else four empty tensors)."""
    _check_inputs(q, (alpha_q, alpha_k, alpha_v, collapse))
    tensors = _prepared((q, k, v, alpha_q, alpha_k, alpha_v, collapse))
    bounds = _bounds(cu_seqlens, q)
    rows = _saved_rows(spec, q, keep)
    if q.dtype == torch.float64:
        out, lse = _loom.reference(*tensors, spec, cu_seqlens=bounds)
        return torch.utils.dlpack.from_dlpack(out), torch.utils.dlpack.from_dlpack(lse), rows
    heads, head_dim, pseudo = _out_dims(spec)
    B, N = q.shape[0], q.shape[1]
    out = torch.empty((B, N, heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, heads, N * pseudo), dtype=torch.float32, device=q.device)
    _loom.iha(*tensors, spec, stream=_stream(q), out=_capsule(out), lse=_capsule(lse), schedule=schedule,
              cache_dir=cache_dir, service=service, threads=threads,
              workspace=_workspace(spec, B, N, "forward", q.device, schedule, cache_dir, service=service, keep=keep),
              cu_seqlens=bounds, saved=[_capsule(t) for t in (*rows, lse)] if keep else None)
    return out, lse, rows


def _deterministic_schedule(schedule: Optional[str]) -> str:
    """The backward schedule with dq reduced in a fixed order (dq_separate): bit-identical gradients run to run."""
    s = {} if schedule is None else json.loads(schedule)
    if s.get("dq", "dq_separate") not in ("dq_separate", "dq_unspecified"):
        raise ValueError(f"backward_schedule: dq {s['dq']} adds dq in any order; deterministic=True (or "
                         "torch.use_deterministic_algorithms) needs dq_separate")
    s["dq"] = "dq_separate"
    return json.dumps(s, sort_keys=True)


def _backward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, dout, spec: str, schedule: Optional[str],
              cache_dir: str, service: str, threads: int, deterministic: bool,
              cu_seqlens: Optional[torch.Tensor] = None, saved=None):
    """The seven gradients; `saved` (the four rows and lse a keeping forward filled) skips the pre-mix and the
    recomputed attention."""
    inputs = (q, k, v, alpha_q, alpha_k, alpha_v, collapse)
    tensors = _prepared(inputs)
    dout = _capsule(dout.detach().to(q.dtype).contiguous())
    bounds = _bounds(cu_seqlens, q)
    if q.dtype == torch.float64:
        grads = _loom.reference_backward(*tensors, dout, spec, cu_seqlens=bounds)
        return tuple(torch.utils.dlpack.from_dlpack(g) for g in grads)
    if deterministic:
        schedule = _deterministic_schedule(schedule)
    grads = [torch.empty(t.shape, dtype=torch.float32, device=q.device) for t in inputs]
    _loom.iha_backward(*tensors, dout, spec, grads=[_capsule(g) for g in grads], stream=_stream(q),
                       schedule=schedule, cache_dir=cache_dir, service=service, threads=threads,
                       workspace=_workspace(spec, q.shape[0], q.shape[1], "backward", q.device, schedule, cache_dir,
                                            service=service), cu_seqlens=bounds,
                       saved=None if saved is None else [_capsule(t) for t in saved])
    return tuple(g.to(t.dtype) for g, t in zip(grads, inputs))


def _decode(q, k, v, alpha_q, alpha_k, alpha_v, collapse, k_cache, v_cache, page_table, cache_len, page_errors,
            spec: str, cache: str, schedule: Optional[str], cache_dir: str, service: str, threads: int,
            check_pages: bool) -> torch.Tensor:
    _check_inputs(q, (alpha_q, alpha_k, alpha_v, collapse))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous: the step appends to it in place")
    heads, head_dim, _ = _out_dims(spec)
    out = torch.empty((q.shape[0], q.shape[1], heads, head_dim), dtype=q.dtype, device=q.device)
    tensors = _prepared((q, k, v, alpha_q, alpha_k, alpha_v, collapse, k_cache, v_cache, page_table, cache_len))
    workspace = _workspace(spec, q.shape[0], q.shape[1], "decode", q.device, schedule, cache_dir, cache, service,
                           cache_tokens=page_table.shape[1] * k_cache.shape[1])
    _loom.decode(*tensors, spec, cache=cache, out=_capsule(out), stream=_stream(q), schedule=schedule,
                 cache_dir=cache_dir, service=service, threads=threads, check_pages=check_pages, workspace=workspace,
                 page_errors=None if page_errors is None else _capsule(page_errors))
    return out


def _paged_attention(q, k, v, alpha_q, alpha_k, alpha_v, collapse, k_cache, v_cache, page_table, cache_len,
                     query_start_loc, max_query_len: int, spec: str, cache: str, schedule: Optional[str],
                     cache_dir: str, service: str, threads: int, check_pages: bool) -> torch.Tensor:
    _check_inputs(q, (alpha_q, alpha_k, alpha_v, collapse))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous: the step appends to it in place")
    if q.dim() != 3:
        raise ValueError(f"q: a ragged step packs its sequences' new tokens, [total, H, d]; got {tuple(q.shape)}")
    heads, head_dim, _ = _out_dims(spec)
    out = torch.empty((q.shape[0], heads, head_dim), dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:  # no sequence brings a token: nothing to append or attend
        return out
    tensors = _prepared((q, k, v, alpha_q, alpha_k, alpha_v, collapse, k_cache, v_cache, page_table, cache_len))
    batch = query_start_loc.shape[0] - 1
    workspace = _workspace(spec, batch, max_query_len, "decode", q.device, schedule, cache_dir, cache, service,
                           cache_tokens=page_table.shape[1] * k_cache.shape[1])
    _loom.decode(*tensors, spec, cache=cache, out=_capsule(out), stream=_stream(q), schedule=schedule,
                 cache_dir=cache_dir, service=service, threads=threads, check_pages=check_pages, workspace=workspace,
                 query_start_loc=_capsule(query_start_loc.contiguous()), max_query_len=max_query_len)
    return out


class _IhaFunction(torch.autograd.Function):
    """IHA with loom's backward (PyTorch before 2.4): saves the seven inputs and, where the forward keeps them
    (save_forward), its mixed rows, pseudo-head outputs and lse, from which the backward starts without
    recomputing the attention; else the backward recomputes it, as FlashAttention's does. lse is not
    differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, alpha_q, alpha_k, alpha_v, collapse, spec, schedule, backward_schedule, cache_dir,
                service, threads, deterministic, save_forward):
        ctx.keep = _keeps(q, schedule, save_forward)
        out, lse, rows = _forward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, spec, schedule, cache_dir, service,
                                  threads, keep=ctx.keep)
        ctx.save_for_backward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, *rows, lse)
        ctx.options = (spec, backward_schedule, cache_dir, service, threads, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        saved = ctx.saved_tensors
        grads = _backward(*saved[:7], dout, *ctx.options, saved=saved[7:] if ctx.keep else None)
        return (*grads, None, None, None, None, None, None, None, None)


def _varlen_forward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, cu_seqlens, spec, schedule, cache_dir, service,
                    threads, keep=False):
    """iha_varlen's forward on packed [total, ...] tensors: (out [total, H, d], lse [H, total * P], the saved rows
    [1, H | G, total * P, d] or four empty tensors)."""
    out, lse, rows = _forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), alpha_q, alpha_k, alpha_v, collapse,
                              spec, schedule, cache_dir, service, threads, cu_seqlens, keep)
    return out.squeeze(0), lse.squeeze(0), rows


def _varlen_backward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, cu_seqlens, dout, spec, schedule, cache_dir,
                     service, threads, deterministic, saved=None):
    if saved is not None:
        saved = (*saved[:4], saved[4].unsqueeze(0))
    grads = _backward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), alpha_q, alpha_k, alpha_v, collapse,
                      dout.unsqueeze(0), spec, schedule, cache_dir, service, threads, deterministic, cu_seqlens,
                      saved)
    return (grads[0].squeeze(0), grads[1].squeeze(0), grads[2].squeeze(0), *grads[3:])


class _IhaVarlenFunction(torch.autograd.Function):
    """iha_varlen with loom's backward (PyTorch before 2.4), saving as _IhaFunction; cu_seqlens is not
    differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, alpha_q, alpha_k, alpha_v, collapse, cu_seqlens, spec, schedule, backward_schedule,
                cache_dir, service, threads, deterministic, save_forward):
        ctx.keep = _keeps(q, schedule, save_forward)
        out, lse, rows = _varlen_forward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, cu_seqlens, spec, schedule,
                                         cache_dir, service, threads, ctx.keep)
        ctx.save_for_backward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, cu_seqlens, *rows, lse)
        ctx.options = (spec, backward_schedule, cache_dir, service, threads, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        saved = ctx.saved_tensors
        grads = _varlen_backward(*saved[:8], dout, *ctx.options, saved=saved[8:] if ctx.keep else None)
        return (*grads, None, None, None, None, None, None, None, None, None)


if HAS_CUSTOM_OP:
    Tensor = torch.Tensor
    Gradients = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
    Forward = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # out, lse, q_mixed, k_mixed, v_mixed, o_pseudo

    # The forward ops return (out, lse, q_mixed, k_mixed, v_mixed, o_pseudo): the rows are what the backward op
    # starts from where the forward keeps them (else four empty tensors); only out is differentiable.
    @torch.library.custom_op("loom::iha", mutates_args=())
    def _iha_op(q: Tensor, k: Tensor, v: Tensor, alpha_q: Tensor, alpha_k: Tensor, alpha_v: Tensor,
                collapse: Tensor, spec: str, schedule: Optional[str], backward_schedule: Optional[str],
                cache_dir: str, service: str, threads: int, deterministic: bool,
                save_forward: bool) -> Forward:
        out, lse, rows = _forward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, spec, schedule, cache_dir, service,
                                  threads, keep=_keeps(q, schedule, save_forward))
        return (out, lse, *rows)

    @_iha_op.register_fake
    def _iha_fake(q, k, v, alpha_q, alpha_k, alpha_v, collapse, spec, schedule, backward_schedule, cache_dir,
                  service, threads, deterministic, save_forward):
        heads, head_dim, pseudo = _out_dims(spec)
        return (q.new_empty((q.shape[0], q.shape[1], heads, head_dim)),
                q.new_empty((q.shape[0], heads, q.shape[1] * pseudo), dtype=torch.float32),
                *_saved_rows(spec, q, _keeps(q, schedule, save_forward)))

    @torch.library.custom_op("loom::iha_backward", mutates_args=())
    def _iha_backward_op(q: Tensor, k: Tensor, v: Tensor, alpha_q: Tensor, alpha_k: Tensor, alpha_v: Tensor,
                         collapse: Tensor, dout: Tensor, spec: str, schedule: Optional[str], cache_dir: str,
                         service: str, threads: int, deterministic: bool, q_mixed: Tensor, k_mixed: Tensor,
                         v_mixed: Tensor, o_pseudo: Tensor, lse: Tensor, keep: bool) -> Gradients:
        return _backward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, dout, spec, schedule, cache_dir, service,
                         threads, deterministic, saved=(q_mixed, k_mixed, v_mixed, o_pseudo, lse) if keep else None)

    @_iha_backward_op.register_fake
    def _iha_backward_fake(q, k, v, alpha_q, alpha_k, alpha_v, collapse, dout, spec, schedule, cache_dir, service,
                           threads, deterministic, q_mixed, k_mixed, v_mixed, o_pseudo, lse, keep):
        return tuple(torch.empty_like(t) for t in (q, k, v, alpha_q, alpha_k, alpha_v, collapse))

    def _setup_context(ctx, inputs, output):
        spec, schedule, backward_schedule, cache_dir, service, threads, deterministic, save_forward = inputs[7:]
        ctx.save_for_backward(*inputs[:7], *output[1:])
        ctx.keep = _keeps(inputs[0], schedule, save_forward)
        ctx.options = (spec, backward_schedule, cache_dir, service, threads, deterministic)
        ctx.mark_non_differentiable(*output[1:])

    def _iha_op_backward(ctx, dout, *_):
        saved = ctx.saved_tensors
        lse, rows = saved[7], saved[8:]
        grads = _iha_backward_op(*saved[:7], dout, *ctx.options, *rows, lse, ctx.keep)
        return (*grads, None, None, None, None, None, None, None, None)

    _iha_op.register_autograd(_iha_op_backward, setup_context=_setup_context)

    @torch.library.custom_op("loom::iha_varlen", mutates_args=())
    def _iha_varlen_op(q: Tensor, k: Tensor, v: Tensor, alpha_q: Tensor, alpha_k: Tensor, alpha_v: Tensor,
                       collapse: Tensor, cu_seqlens: Tensor, spec: str, schedule: Optional[str],
                       backward_schedule: Optional[str], cache_dir: str, service: str, threads: int,
                       deterministic: bool, save_forward: bool) -> Forward:
        out, lse, rows = _varlen_forward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, cu_seqlens, spec, schedule,
                                         cache_dir, service, threads, _keeps(q, schedule, save_forward))
        return (out, lse, *rows)

    @_iha_varlen_op.register_fake
    def _iha_varlen_fake(q, k, v, alpha_q, alpha_k, alpha_v, collapse, cu_seqlens, spec, schedule,
                         backward_schedule, cache_dir, service, threads, deterministic, save_forward):
        heads, head_dim, pseudo = _out_dims(spec)
        return (q.new_empty((q.shape[0], heads, head_dim)),
                q.new_empty((heads, q.shape[0] * pseudo), dtype=torch.float32),
                *_saved_rows(spec, q.unsqueeze(0), _keeps(q, schedule, save_forward)))

    @torch.library.custom_op("loom::iha_varlen_backward", mutates_args=())
    def _iha_varlen_backward_op(q: Tensor, k: Tensor, v: Tensor, alpha_q: Tensor, alpha_k: Tensor,
                                alpha_v: Tensor, collapse: Tensor, cu_seqlens: Tensor, dout: Tensor, spec: str,
                                schedule: Optional[str], cache_dir: str, service: str, threads: int,
                                deterministic: bool, q_mixed: Tensor, k_mixed: Tensor, v_mixed: Tensor,
                                o_pseudo: Tensor, lse: Tensor, keep: bool) -> Gradients:
        return _varlen_backward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, cu_seqlens, dout, spec, schedule,
                                cache_dir, service, threads, deterministic,
                                (q_mixed, k_mixed, v_mixed, o_pseudo, lse) if keep else None)

    @_iha_varlen_backward_op.register_fake
    def _iha_varlen_backward_fake(q, k, v, alpha_q, alpha_k, alpha_v, collapse, cu_seqlens, dout, spec, schedule,
                                  cache_dir, service, threads, deterministic, q_mixed, k_mixed, v_mixed, o_pseudo,
                                  lse, keep):
        return tuple(torch.empty_like(t) for t in (q, k, v, alpha_q, alpha_k, alpha_v, collapse))

    def _setup_varlen_context(ctx, inputs, output):
        spec, schedule, backward_schedule, cache_dir, service, threads, deterministic, save_forward = inputs[8:]
        ctx.save_for_backward(*inputs[:8], *output[1:])
        ctx.keep = _keeps(inputs[0], schedule, save_forward)
        ctx.options = (spec, backward_schedule, cache_dir, service, threads, deterministic)
        ctx.mark_non_differentiable(*output[1:])

    def _iha_varlen_op_backward(ctx, dout, *_):
        saved = ctx.saved_tensors
        lse, rows = saved[8], saved[9:]
        grads = _iha_varlen_backward_op(*saved[:8], dout, *ctx.options, *rows, lse, ctx.keep)
        return (*grads, None, None, None, None, None, None, None, None, None)

    _iha_varlen_op.register_autograd(_iha_varlen_op_backward, setup_context=_setup_varlen_context)

    @torch.library.custom_op("loom::decode", mutates_args=("k_cache", "v_cache", "page_errors"))
    def _decode_op(q: Tensor, k: Tensor, v: Tensor, alpha_q: Tensor, alpha_k: Tensor, alpha_v: Tensor,
                   collapse: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, cache_len: Tensor,
                   page_errors: Optional[Tensor], spec: str, cache: str, schedule: Optional[str], cache_dir: str,
                   service: str, threads: int, check_pages: bool) -> Tensor:
        return _decode(q, k, v, alpha_q, alpha_k, alpha_v, collapse, k_cache, v_cache, page_table, cache_len,
                       page_errors, spec, cache, schedule, cache_dir, service, threads, check_pages)

    @_decode_op.register_fake
    def _decode_fake(q, k, v, alpha_q, alpha_k, alpha_v, collapse, k_cache, v_cache, page_table, cache_len,
                     page_errors, spec, cache, schedule, cache_dir, service, threads, check_pages):
        heads, head_dim, _ = _out_dims(spec)
        return q.new_empty((q.shape[0], q.shape[1], heads, head_dim))

    @torch.library.custom_op("loom::paged_attention", mutates_args=("k_cache", "v_cache"))
    def _paged_attention_op(q: Tensor, k: Tensor, v: Tensor, alpha_q: Tensor, alpha_k: Tensor, alpha_v: Tensor,
                            collapse: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                            cache_len: Tensor, query_start_loc: Tensor, max_query_len: int, spec: str, cache: str,
                            schedule: Optional[str], cache_dir: str, service: str, threads: int,
                            check_pages: bool) -> Tensor:
        return _paged_attention(q, k, v, alpha_q, alpha_k, alpha_v, collapse, k_cache, v_cache, page_table,
                                cache_len, query_start_loc, max_query_len, spec, cache, schedule, cache_dir, service,
                                threads, check_pages)

    @_paged_attention_op.register_fake
    def _paged_attention_fake(q, k, v, alpha_q, alpha_k, alpha_v, collapse, k_cache, v_cache, page_table,
                              cache_len, query_start_loc, max_query_len, spec, cache, schedule, cache_dir, service,
                              threads, check_pages):
        heads, head_dim, _ = _out_dims(spec)
        return q.new_empty((q.shape[0], heads, head_dim))


def _schedule_text(schedule) -> Optional[str]:
    return None if schedule is None else (schedule if isinstance(schedule, str) else json.dumps(schedule))


if hasattr(torch, "compiler") and hasattr(torch.compiler, "assume_constant_result"):
    _schedule_text = torch.compiler.assume_constant_result(_schedule_text)  # as _spec_text


def _wants_backward(save_forward: bool, tensors) -> bool:
    """Whether a forward keeps what its backward reads: asked to, and a backward can follow (grad mode on and an
    input that requires grad; inference keeps nothing)."""
    return bool(save_forward) and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def iha(q, k, v, alpha_q, alpha_k, alpha_v, collapse, spec, *, schedule=None, backward_schedule=None,
        deterministic: bool = False, return_lse: bool = False, save_forward: bool = True, cache_dir: str = "",
        service: str = "", threads: int = 0):
    """out [B, N, H, d] = IHA(q, k, v; alpha_q, alpha_k, alpha_v, collapse) for `spec` (a dict, JSON text or a
    path; its dtype, when given, q's). Differentiable in all seven tensors.

    `schedule` (dict or JSON) forces the forward's schedule, `backward_schedule` the backward's (each checked
    against its own direction's rules; unset, each is the tuned one from the kernel cache, else the default).
    `deterministic=True`, or torch.use_deterministic_algorithms(True), makes the backward bit-identical run to
    run: dq is reduced in a fixed order (dq_separate) where the tuner may pick atomic adds, at the cost of the
    separate reduction (a few percent of the backward). `return_lse=True` returns (out, lse), lse [B, H, N*P]
    float32 the pseudo-heads' log-sum-exp (natural log; not differentiable): what merging partial attentions
    needs. `save_forward=True` (the default) keeps what the backward reads where one can follow (grad mode on and
    an input requiring grad; inference keeps nothing): the forward materialises its mixing and collapses
    separately (docs/compiler.md, The backward), and autograd holds its mixed rows, pseudo-head outputs and lse,
    (2H + 2G) x P x d elements a token in the kernel's dtype (float32 on the CPU) beside the inputs, so that the
    backward skips the pre-mix and the attention it would recompute (a forward pass of work).
    `save_forward=False` saves only the seven inputs and recomputes (the memory-lean choice, FlashAttention's); a
    `schedule` fusing the mixing or the collapse implies it. `cache_dir` is the kernel cache (default
    ~/.cache/loom), `service` "HOST:PORT" of a loom service (or several replicas, comma-separated: one that is down is skipped) to take CUDA kernels from (a forward that keeps, where
    the service's does not, is compiled here), `threads` the host path's."""
    spec_json = _spec_text(spec, q.dtype)
    deterministic = bool(deterministic or torch.are_deterministic_algorithms_enabled())
    save = _wants_backward(save_forward, (q, k, v, alpha_q, alpha_k, alpha_v, collapse))
    args = (q, k, v, alpha_q, alpha_k, alpha_v, collapse, spec_json, _schedule_text(schedule),
            _schedule_text(backward_schedule), cache_dir, service, threads, deterministic, save)
    out, lse = _iha_op(*args)[:2] if HAS_CUSTOM_OP else _IhaFunction.apply(*args)
    return (out, lse) if return_lse else out


def iha_varlen(q, k, v, alpha_q, alpha_k, alpha_v, collapse, cu_seqlens, max_seqlen, spec, *, schedule=None,
               backward_schedule=None, deterministic: bool = False, return_lse: bool = False,
               save_forward: bool = True, cache_dir: str = "", service: str = "", threads: int = 0):
    """IHA over packed documents (docs/IHA.md, Varlen), as flash_attn_varlen_func takes them: q [total, H, d], k
    and v [total, G, d] hold the documents one after another, cu_seqlens (int32 [documents + 1], on q's device)
    their bounds. Returns out [total, H, d]: per document, `iha` of that document alone (attention never
    crosses a document; RoPE positions, masks and windows restart in each). Differentiable in the seven tensors
    (the weights' gradients summed over the documents). The spec is `iha`'s, `varlen` set here; max_seqlen, the
    longest document, is taken for flash_attn_varlen_func's callers and not needed (loom's grid covers the
    packed tokens). The other options are `iha`'s (save_forward too); return_lse gives lse [H, total * P]. Each
    call copies cu_seqlens to the host once to check it."""
    s = _spec_dict(spec)
    s["varlen"] = True
    spec_json = _spec_text(json.dumps(s, sort_keys=True), q.dtype)
    del max_seqlen  # flash_attn_varlen_func's argument: loom's grid covers the packed tokens
    deterministic = bool(deterministic or torch.are_deterministic_algorithms_enabled())
    save = _wants_backward(save_forward, (q, k, v, alpha_q, alpha_k, alpha_v, collapse))
    args = (q, k, v, alpha_q, alpha_k, alpha_v, collapse, cu_seqlens, spec_json, _schedule_text(schedule),
            _schedule_text(backward_schedule), cache_dir, service, threads, deterministic, save)
    out, lse = _iha_varlen_op(*args)[:2] if HAS_CUSTOM_OP else _IhaVarlenFunction.apply(*args)
    return (out, lse) if return_lse else out


def decode(q, k, v, alpha_q, alpha_k, alpha_v, collapse, k_cache, v_cache, page_table, cache_len, spec, *,
           cache: str = "raw", schedule=None, cache_dir: str = "", service: str = "",
           threads: int = 0, check_pages: bool = True, page_errors: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode step over a paged cache (docs/IHA.md, Decode over a paged cache): the new tokens' q
    [B, T, H, d], k and v [B, T, G, d]; k_cache and v_cache [num_pages, page_size, G, d] (cache="raw": the
    projections, P times smaller) or [num_pages, page_size, G, P, d] (cache="mixed"), the spec's dtype;
    page_table [B, max_pages] and cache_len [B], int32. Appends k and v to the caches in place at positions
    cache_len .. cache_len + T - 1 (advance cache_len by T afterwards) and returns out [B, T, H, d]. CUDA
    tensors (all on one device, page_table and cache_len too) run loom's decode kernel on the current stream;
    host tensors run the generated decode program on the host tile API. check_pages=False (CUDA) skips copying
    page_table and cache_len back to check them: no host synchronisation in the step (a serving loop that
    builds them checked; CUDA-graph capture). page_errors (CUDA), a one-element int32 tensor on the device that
    the caller zeroes: the step checks the page table and lengths on the device, skips the sequences it refuses
    (their out is not defined; nothing outside the cache is read or written) and writes 1 there if it refused
    one, with no synchronisation (read it when you like; with check_pages=False, under CUDA graphs too). With
    PyTorch 2.4 and later it is the custom op torch.ops.loom.decode (mutating k_cache, v_cache and page_errors),
    which torch.compile traces."""
    args = (q, k, v, alpha_q, alpha_k, alpha_v, collapse, k_cache, v_cache, page_table, cache_len, page_errors,
            _spec_text(spec, q.dtype), cache, _schedule_text(schedule), cache_dir, service, threads,
            check_pages)
    return _decode_op(*args) if HAS_CUSTOM_OP else _decode(*args)


def paged_attention(q, k, v, alpha_q, alpha_k, alpha_v, collapse, k_cache, v_cache, page_table, cache_len,
                    query_start_loc, spec, *, cache: str = "raw", max_query_len: Optional[int] = None, schedule=None,
                    cache_dir: str = "", service: str = "", threads: int = 0,
                    check_pages: bool = True) -> torch.Tensor:
    """A ragged step over a paged cache (docs/IHA.md, Ragged steps), as serving engines batch: B sequences
    each bring their own number of new tokens (a prefill chunk over a cached prefix, a single decode token, or
    none), packed one sequence after another in q [total, H, d], k and v [total, G, d]; query_start_loc [B + 1]
    (int32, cumulative: sequence b's rows are query_start_loc[b] .. query_start_loc[b + 1] - 1), cache_len [B]
    and page_table [B, max_pages] (int32), k_cache and v_cache as for decode (cache="raw" or "mixed"). Appends
    each sequence's new k and v at its cache_len (in place; advance cache_len by each sequence's count
    afterwards) and returns out [total, H, d]: each new token's row over its own sequence, as iha gives it.
    max_query_len, the most new tokens one sequence brings, sizes the launch; left None it is read from
    query_start_loc (a synchronisation for CUDA tensors: a serving loop passes it). CUDA tensors run loom's decode
    kernel on the current stream; host tensors (float32 and the 16-bit dtypes) the generated program on the host
    tile API. check_pages as for decode. With PyTorch 2.4 and later it is the custom op
    torch.ops.loom.paged_attention (mutating k_cache and v_cache)."""
    if max_query_len is None:
        counts = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(counts.max()) if counts.numel() else 0
    args = (q, k, v, alpha_q, alpha_k, alpha_v, collapse, k_cache, v_cache, page_table, cache_len,
            query_start_loc, int(max_query_len), _spec_text(spec, q.dtype), cache, _schedule_text(schedule),
            cache_dir, service, threads, check_pages)
    return _paged_attention_op(*args) if HAS_CUSTOM_OP else _paged_attention(*args)


def warmup(spec, shapes, directions=("forward", "backward"), *, device="cpu", dtype: Optional[torch.dtype] = None,
           cache: str = "raw", cache_dir: str = "", threads: int = 0) -> dict:
    """Generates, compiles (or reads from the kernel cache) and loads loom's kernels for `spec` ahead of the first
    step, and grows their workspaces to the largest shape: one call of each of `directions` ("forward",
    "backward", "decode": one token over a cache of N) for each (B, N) in `shapes`, on random tensors of `device`
    (dtype: the spec's, else bfloat16 on CUDA and float32 on the CPU). Later calls of those shapes then only
    launch. Returns what loom.counters() moved (the one-time cost)."""
    s = _spec_dict(spec)
    if dtype is None:
        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(
            s.get("dtype", ""), torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    unknown = set(directions) - {"forward", "backward", "decode"}
    if unknown:
        raise ValueError(f"directions: {sorted(unknown)} are not forward, backward or decode")
    H, G, P, d = s["heads"], s.get("kv_heads", s["heads"]), s["pseudo_heads"], s["head_dim"]
    fan = P if s.get("collapse", "per_head") == "per_head" else H * P
    before = _loom.counters()
    for B, N in shapes:
        q, k, v = (torch.randn(B, N, n, d, device=device).to(dtype) for n in (H, G, G))
        weights = [torch.eye(n, device=device)[:, :, None].expand(n, n, P).contiguous() for n in (H, G, G)]
        collapse = torch.full((H, fan), 1.0 / fan, device=device)
        inputs = [q, k, v, *weights, collapse]
        if "forward" in directions:
            iha(*inputs, s, cache_dir=cache_dir, threads=threads)
        if "backward" in directions:
            grads = [t.detach().clone().requires_grad_() for t in inputs]
            iha(*grads, s, cache_dir=cache_dir, threads=threads).backward(torch.ones_like(q))
        if "decode" in directions:
            page = 16
            pages = (N + 1 + page - 1) // page
            rows = (G,) if cache == "raw" else (G, P)
            k_cache = torch.zeros(B * pages, page, *rows, d, device=device, dtype=dtype)
            v_cache = torch.zeros_like(k_cache)
            table = torch.arange(B * pages, dtype=torch.int32, device=device).view(B, pages)
            lengths = torch.full((B,), N, dtype=torch.int32, device=device)
            decode(q[:, :1], k[:, :1], v[:, :1], *weights, collapse, k_cache, v_cache, table, lengths, s,
                   cache=cache, cache_dir=cache_dir, threads=threads)
    after = _loom.counters()
    return {key: after[key] - before[key] for key in after if after[key] != before[key]}


def _allowed(s: dict, L: int, P: int, device) -> torch.Tensor:
    """[L, L] bool: may virtual row i attend to row j (docs/IHA.md, step 4 and the options)."""
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(L, device=device)[None, :]
    ti, tj = i // P, j // P
    mask, W = s.get("mask", "flat_causal"), int(s.get("window", 0))
    if int(s.get("window_rows", 0)) > 0:
        return (j <= i) & (i - j < int(s["window_rows"]))
    if W > 0 and s.get("window_align", "virtual") == "token":
        own = (j <= i) if mask == "flat_causal" else (tj <= ti) if mask == "token_causal" else torch.ones_like(i == j)
        return own & (ti - tj >= 0) & (ti - tj < W)
    if mask == "flat_causal":
        return (j <= i) & ((i - j < W * P) if W > 0 else True)
    if mask == "token_causal":
        return (tj <= ti) & ((ti - tj < W) if W > 0 else True)
    return (torch.abs(ti - tj) < W) if W > 0 else torch.ones_like(i == j)


def iha_eager(q, k, v, alpha_q, alpha_k, alpha_v, collapse, spec) -> torch.Tensor:
    """IHA in plain PyTorch ops on the materialised sequence (docs/IHA.md step by step: mix, interleave,
    qk_norm, RoPE, masked softmax attention over N*P rows, collapse), differentiated by PyTorch's own
    autograd; any device and dtype. O((N*P)^2) memory: the baseline, not the fast path."""
    s = _spec_dict(spec)
    B, N, H, d = q.shape
    G, P = k.shape[2], int(s["pseudo_heads"])
    L = N * P
    dt = q.dtype
    qm = torch.einsum("bnmc,mhp->bhnpc", q, alpha_q.to(dt)).reshape(B, H, L, d)
    km = torch.einsum("bnmc,mgp->bgnpc", k, alpha_k.to(dt)).reshape(B, G, L, d)
    vm = torch.einsum("bnmc,mgp->bgnpc", v, alpha_v.to(dt)).reshape(B, G, L, d)
    if s.get("qk_norm", "none") == "rms":
        eps = float(s.get("qk_norm_eps", 1e-6))
        qm = qm / torch.sqrt(qm.pow(2).mean(-1, keepdim=True) + eps)
        km = km / torch.sqrt(km.pow(2).mean(-1, keepdim=True) + eps)
    theta = float(s.get("rope_theta", 0.0))
    if theta > 0:
        half = d // 2
        inv = theta ** (-2.0 * torch.arange(half, device=q.device, dtype=torch.float64) / d)
        angle = torch.arange(L, device=q.device, dtype=torch.float64)[:, None] * inv[None, :]
        if s.get("rope_direction", "positive") == "negative":
            angle = -angle
        cos, sin = angle.cos().to(dt), angle.sin().to(dt)

        def rotate(x):
            a, b = x[..., :half], x[..., half:]
            return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

        qm, km = rotate(qm), rotate(km)
    km = km.repeat_interleave(H // G, dim=1)
    vm = vm.repeat_interleave(H // G, dim=1)
    scale = float(s["scale"]) if "scale" in s else 1.0 / math.sqrt(d)
    scores = torch.matmul(qm, km.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~_allowed(s, L, P, q.device), float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), vm).reshape(B, H, N, P, d)
    if s.get("collapse", "per_head") == "per_head":
        return torch.einsum("bhnpc,hp->bnhc", o, collapse.to(dt))
    return torch.einsum("bgnpc,hgp->bnhc", o, collapse.to(dt).reshape(H, H, P))


class _RmsNorm(torch.nn.Module):
    """torch.nn.RMSNorm where PyTorch predates it (2.4): x / sqrt(mean(x^2) + eps) * weight over the last
    axis, eps None meaning the dtype's machine epsilon."""

    def __init__(self, d: int, eps: Optional[float]):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight


class InterleavedHeadAttention(torch.nn.Module):
    """A drop-in IHA attention block: x [B, N, dim] -> [B, N, dim], or packed documents x [total, dim] with
    cu_seqlens (forward(x, cu_seqlens, max_seqlen), as flash_attn_varlen_func's callers pass them).

    Parameters (state_dict names):
      q_proj.weight [H*d, dim], k_proj.weight and v_proj.weight [G*d, dim], out_proj.weight [dim, H*d]
        (and .bias with bias=True): the projections, as nn.Linear.
      alpha_q [H, H, P], alpha_k and alpha_v [G, G, P]: the mixing, alpha[m, h, p] weighing source head m in
        pseudo head p of head h; initialised to the identity on the head axes plus N(0, init_noise^2) noise
        (the noise tells the P pseudo heads apart).
      collapse [H, P] (per_head) or [H, H*P] (global): 1/P on each head's own pseudo heads.
    The function options are docs/IHA.md's (mask, window, RoPE, qk_norm, window_align, window_rows, scale).
    Two conventions of public models sit around the kernel, in the layer:
      qk_norm_position="before_mixing" (with qk_norm=True): Qwen3's query/key norm, an RMS norm over head_dim
        with a learned weight (q_norm.weight and k_norm.weight [d], initialised to ones), applied to every raw
        head before the mixing; loom then attends over the normalised heads with no norm of its own (the
        default, "after_mixing", is loom's spec qk_norm: each mixed row normalised, no weight).
      gate="headwise" or "elementwise": the sigmoid output gate of gated attention (Qiu et al., 2025, its G1
        position): the attention's output multiplied by sigmoid(gate_proj(x)) before out_proj, x the layer's
        input; gate_proj [H, dim] (one gate a head) or [H*d, dim] (one a head and channel), bias as the
        projections'.
    `compute_dtype`: what q, k and v are cast to for the attention (default: bfloat16 on CUDA, float32 on the
    CPU, float64 for float64 inputs); the mixing weights stay float32. `backend`: "loom" (loom's kernels) or
    "eager" (iha_eager, plain PyTorch ops: the baseline)."""

    def __init__(self, dim: int, heads: int, pseudo_heads: int, kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, *, mask: str = "flat_causal", window: int = 0,
                 collapse: str = "per_head", rope_theta: float = 10000.0, rope_direction: str = "positive",
                 qk_norm: bool = False, qk_norm_eps: Optional[float] = None, window_align: str = "virtual",
                 window_rows: int = 0, scale: Optional[float] = None, bias: bool = False, init_noise: float = 0.1,
                 compute_dtype: Optional[torch.dtype] = None, backend: str = "loom", schedule=None,
                 cache_dir: str = "", threads: int = 0, qk_norm_position: str = "after_mixing",
                 gate: Optional[str] = None):
        super().__init__()
        H, G = heads, kv_heads or heads
        d = head_dim or dim // heads
        P = pseudo_heads
        if H % G:
            raise ValueError(f"kv_heads ({G}) must divide heads ({H})")
        if backend not in ("loom", "eager"):
            raise ValueError(f"backend: {backend!r}, want 'loom' or 'eager'")
        if qk_norm_position not in ("after_mixing", "before_mixing"):
            raise ValueError(f"qk_norm_position: {qk_norm_position!r}, want 'after_mixing' or 'before_mixing'")
        if qk_norm_position == "before_mixing" and not qk_norm:
            raise ValueError("qk_norm_position='before_mixing' places a norm: give qk_norm=True")
        if gate not in (None, "headwise", "elementwise"):
            raise ValueError(f"gate: {gate!r}, want None, 'headwise' or 'elementwise'")
        self.heads, self.kv_heads, self.pseudo_heads, self.head_dim = H, G, P, d
        self.compute_dtype, self.backend = compute_dtype, backend
        self.schedule, self.cache_dir, self.threads = schedule, cache_dir, threads
        s = {"heads": H, "kv_heads": G, "pseudo_heads": P, "head_dim": d, "mask": mask, "window": window,
             "collapse": collapse, "rope_theta": rope_theta}
        # Options only where they change the function (loom refuses the rest).
        self.norm_before_mixing = qk_norm and qk_norm_position == "before_mixing"
        if qk_norm and not self.norm_before_mixing:
            s["qk_norm"] = "rms"
            if qk_norm_eps is not None:
                s["qk_norm_eps"] = qk_norm_eps
        if rope_theta > 0 and rope_direction != "positive":
            s["rope_direction"] = rope_direction
        if window > 0 and window_align != "virtual":
            s["window_align"] = window_align
        if window_rows > 0:
            s["window_rows"] = window_rows
        if scale is not None:
            s["scale"] = scale
        self.spec = s
        # What forward passes: text is a constant to torch.compile, where a dict's ints turn symbolic under
        # dynamic=True and cannot be serialised while tracing.
        self._spec_json = json.dumps(s, sort_keys=True)
        self.q_proj = torch.nn.Linear(dim, H * d, bias=bias)
        self.k_proj = torch.nn.Linear(dim, G * d, bias=bias)
        self.v_proj = torch.nn.Linear(dim, G * d, bias=bias)
        self.out_proj = torch.nn.Linear(H * d, dim, bias=bias)
        if self.norm_before_mixing:
            norm = getattr(torch.nn, "RMSNorm", _RmsNorm)  # eps None: the dtype's machine epsilon in both
            self.q_norm, self.k_norm = norm(d, eps=qk_norm_eps), norm(d, eps=qk_norm_eps)
        self.gate = gate
        if gate:
            self.gate_proj = torch.nn.Linear(dim, H * d if gate == "elementwise" else H, bias=bias)

        def near_identity(n):
            eye = torch.eye(n)[:, :, None].expand(n, n, P)
            return torch.nn.Parameter(eye + init_noise * torch.randn(n, n, P))

        self.alpha_q, self.alpha_k, self.alpha_v = near_identity(H), near_identity(G), near_identity(G)
        if collapse == "per_head":
            self.collapse = torch.nn.Parameter(torch.full((H, P), 1.0 / P))
        else:
            own = torch.eye(H)[:, :, None].expand(H, H, P) / P
            self.collapse = torch.nn.Parameter(own.reshape(H, H * P).clone())

    def extra_repr(self) -> str:
        return f"spec={self.spec}, backend={self.backend!r}"

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                max_seqlen: Optional[int] = None) -> torch.Tensor:
        """x [B, N, dim] -> [B, N, dim]; with cu_seqlens (int32 [documents + 1]) x is [total, dim], documents
        packed one after another, each attended alone (iha_varlen; docs/IHA.md, Varlen)."""
        if cu_seqlens is not None:
            return self._packed(x, cu_seqlens, max_seqlen)
        B, N, _ = x.shape
        H, G, d = self.heads, self.kv_heads, self.head_dim
        dt, wt = self._dtypes(x)
        q, k = self._normed(self.q_proj(x).view(B, N, H, d), self.k_proj(x).view(B, N, G, d))
        q, k = q.to(dt), k.to(dt)
        v = self.v_proj(x).view(B, N, G, d).to(dt)
        weights = [w.to(wt) for w in (self.alpha_q, self.alpha_k, self.alpha_v, self.collapse)]
        if self.backend == "eager":
            o = iha_eager(q, k, v, *weights, self.spec)
        else:
            o = iha(q, k, v, *weights, self._spec_json, schedule=self.schedule, cache_dir=self.cache_dir,
                    threads=self.threads)
        return self.out_proj(self._gated(o.to(x.dtype), x).reshape(B, N, H * d))

    def _normed(self, q: torch.Tensor, k: torch.Tensor):
        """q and k [..., heads, d] as the kernel takes them: normalised here where the norm comes before the
        mixing (Qwen-style), else as projected."""
        if self.norm_before_mixing:
            return self.q_norm(q), self.k_norm(k)
        return q, k

    def _gated(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention's output o [..., H, d] times the sigmoid gate of x (one a head, or a head and channel)."""
        if not self.gate:
            return o
        g = torch.sigmoid(self.gate_proj(x))
        return o * (g.view(*o.shape) if self.gate == "elementwise" else g.unsqueeze(-1))

    def _dtypes(self, x: torch.Tensor):
        """(the attention's dtype, the weights')."""
        dt = self.compute_dtype or (torch.float64 if x.dtype == torch.float64 else
                                    torch.bfloat16 if x.is_cuda else torch.float32)
        return dt, torch.float64 if dt == torch.float64 else torch.float32

    def _packed(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: Optional[int]) -> torch.Tensor:
        total = x.shape[0]
        H, G, d = self.heads, self.kv_heads, self.head_dim
        dt, wt = self._dtypes(x)
        q, k = self._normed(self.q_proj(x).view(total, H, d), self.k_proj(x).view(total, G, d))
        q, k = q.to(dt), k.to(dt)
        v = self.v_proj(x).view(total, G, d).to(dt)
        weights = [w.to(wt) for w in (self.alpha_q, self.alpha_k, self.alpha_v, self.collapse)]
        if self.backend == "eager":  # each document alone
            bounds = cu_seqlens.tolist()
            o = torch.cat([iha_eager(q[a:b][None], k[a:b][None], v[a:b][None], *weights, self.spec)[0]
                           for a, b in zip(bounds, bounds[1:])])
        else:
            o = iha_varlen(q, k, v, *weights, cu_seqlens, max_seqlen, self._spec_json, schedule=self.schedule,
                           cache_dir=self.cache_dir, threads=self.threads)
        return self.out_proj(self._gated(o.to(x.dtype), x).reshape(total, H * d))
