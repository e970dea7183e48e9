#!/usr/bin/env python3
"""The per-call host cost of loom's calls at steady state (issue: a host path without per-call work).

For one small problem (the call itself is the cost: B 1, N 16, H 2, P 2, d 16 by default), times the forward,
backward and decode calls after a warm-up, and prints microseconds a call and what loom.counters() moved over
the timed calls (a steady state moves only `launches`). Host tensors run the generated program on the host tile
API; with --cuda (a GPU and PyTorch with CUDA) the same calls on CUDA tensors. PyTorch's own eager IHA
(loom.torch.iha_eager, about twenty ops) is timed beside them. Wall time and this process's CPU time a call
(the CPU time is the steadier on a shared machine). Numbers, not a test.

    PYTHONPATH=build/python python3 bench/host_overhead.py [--calls 500] [--tokens 16] [--cuda]
"""
import argparse
import json
import time

import torch

import loom
import loom.torch as lt


def timed(call, calls):
    call()  # warm-up: generate, compile or read, load
    call()
    before = loom.counters()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    after = loom.counters()
    moved = {key: after[key] - before[key] for key in after if after[key] != before[key]}
    return seconds / calls * 1e6, cpu / calls * 1e6, moved


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500, help="timed calls of each kind (default 500)")
    parser.add_argument("--tokens", type=int, default=16, help="N, the tokens (default 16)")
    parser.add_argument("--cuda", action="store_true", help="CUDA tensors on the first GPU (needs one)")
    parser.add_argument("--threads", type=int, default=1, help="host tile API threads (default 1)")
    args = parser.parse_args()
    device = "cuda" if args.cuda else "cpu"
    dtype = torch.bfloat16 if args.cuda else torch.float32
    spec = {"heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 16, "mask": "flat_causal", "window": 0,
            "collapse": "per_head", "rope_theta": 10000.0}
    H, G, P, d, N = 2, 2, 2, 16, args.tokens
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, N, n, d, generator=g).to(device, dtype) for n in (H, G, G))
    weights = [(torch.eye(n)[:, :, None] + 0.1 * torch.randn(n, n, P, generator=g)).to(device) for n in (H, G, G)]
    collapse = (torch.randn(H, P, generator=g) / P).to(device)
    inputs = (q, k, v, *weights, collapse)
    grads = [t.detach().clone().requires_grad_() for t in inputs]
    dout = torch.randn(1, N, H, d, generator=g).to(device, dtype)
    # A decode step of one token over a cache of N tokens in pages of 4.
    pages = (N + 1 + 3) // 4
    k_cache = torch.randn(pages, 4, G, d, generator=g).to(device, dtype)
    v_cache = torch.randn(pages, 4, G, d, generator=g).to(device, dtype)
    page_table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    cache_len = torch.tensor([N], dtype=torch.int32, device=device)
    step = tuple(t[:, :1] for t in (q, k, v))
    threads = {} if args.cuda else {"threads": args.threads}
    spec_json = json.dumps(lt.spec_for(spec, dtype))

    def backward():
        out = lt.iha(*grads, spec, **threads)
        out.backward(dout)

    def eager_backward():
        out = lt.iha_eager(*grads, spec)
        out.backward(dout)

    rows = [
        ("forward   loom.iha (C++ binding)", lambda: loom.iha(*inputs, spec_json, **threads)),
        ("forward   loom.torch.iha", lambda: lt.iha(*inputs, spec, **threads)),
        ("forward   iha_eager (PyTorch ops)", lambda: lt.iha_eager(*inputs, spec)),
        ("backward  loom.torch.iha + backward", backward),
        ("backward  iha_eager + backward", eager_backward),
        ("decode    loom.torch.decode (1 token)",
         lambda: lt.decode(*step, *weights, collapse, k_cache, v_cache, page_table, cache_len, spec, **threads)),
    ]
    print(f"host overhead: B 1, N {N}, H {H}, G {G}, P {P}, d {d}, {dtype}, {device}, "
          f"{args.calls} calls each after a warm-up")
    for name, call in rows:
        micros, cpu, moved = timed(call, args.calls)
        print(f"  {name:40s} {micros:9.1f} us a call ({cpu:7.1f} us CPU)   counters moved: {moved}")


if __name__ == "__main__":
    main()
