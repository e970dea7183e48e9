#!/usr/bin/env python3
"""The per-call host cost of loom's calls at steady state (issue: a host path without per-call work).

For one small problem (the call itself is the cost: B 1, N 16, H 2, P 2, d 16 by default), times the forward,
backward and decode calls after a warm-up, and prints microseconds a call and what loom.counters() moved over
the timed calls (a steady state moves only `launches`). Host tensors run the generated program on the host tile
API; with --cuda (a GPU and PyTorch with CUDA) the same calls on CUDA tensors (host time a call: the GPU runs
behind), and beside them a decode step without its page-table check, the same step replayed from a CUDA graph
and PyTorch's SDPA over the same rows. PyTorch's own eager IHA (loom.torch.iha_eager, about twenty ops) is timed
beside them. Wall time and this process's CPU time a call (the CPU time is the steadier on a shared machine).
Numbers, not a test.

    PYTHONPATH=build/python python3 bench/host_overhead.py [--calls 200] [--rounds 5] [--tokens 16] [--cuda]
"""
import argparse
import json
import time

import torch

import loom
import loom.torch as lt


def timed(call, calls, rounds):
    """The best of `rounds` rounds of `calls` calls (a shared machine's other work only adds), and what the
    counters moved over all of them."""
    call()  # warm-up: generate, compile or read, load
    call()
    before = loom.counters()
    best_wall = best_cpu = float("inf")
    for _ in range(rounds):
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            call()
        best_wall = min(best_wall, (time.perf_counter() - start) / calls * 1e6)
        best_cpu = min(best_cpu, (time.process_time() - cpu) / calls * 1e6)
    after = loom.counters()
    moved = {key: after[key] - before[key] for key in after if after[key] != before[key]}
    return best_wall, best_cpu, moved


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls of each kind a round (default 200)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the best is printed (default 5)")
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
    if args.cuda:
        # Beside them on a GPU: the step without its page-table copy back, the same step replayed from a CUDA
        # graph, and PyTorch's own fused attention (SDPA) over the same N * P rows: the call overhead to beat.
        def unchecked():
            return lt.decode(*step, *weights, collapse, k_cache, v_cache, page_table, cache_len, spec,
                             check_pages=False)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            unchecked()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            unchecked()
        rows_q = torch.randn(1, H, N * P, d, generator=g).to(device, dtype)
        rows += [
            ("decode    loom.torch.decode, check_pages off", unchecked),
            ("decode    the same, CUDA graph replay", graph.replay),
            ("forward   torch SDPA (causal, N*P rows)",
             lambda: torch.nn.functional.scaled_dot_product_attention(rows_q, rows_q, rows_q, is_causal=True)),
        ]
    print(f"host overhead: B 1, N {N}, H {H}, G {G}, P {P}, d {d}, {dtype}, {device}, "
          f"best of {args.rounds} rounds of {args.calls} calls each after a warm-up")
    cpu_of = {}
    for name, call in rows:
        micros, cpu, moved = timed(call, args.calls, args.rounds)
        cpu_of[name] = cpu
        print(f"  {name:40s} {micros:9.1f} us a call ({cpu:7.1f} us CPU)   counters moved: {moved}")
    # The target: a loom.torch call at most half of the eager PyTorch one (CPU time).
    forward = cpu_of[rows[1][0]] / cpu_of[rows[2][0]]
    backward = cpu_of[rows[3][0]] / cpu_of[rows[4][0]]
    print(f"  loom.torch over iha_eager (CPU time): forward {forward:.2f}, forward + backward {backward:.2f}")


if __name__ == "__main__":
    main()
