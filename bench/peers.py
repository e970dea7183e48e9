#!/usr/bin/env python3
"""What an IHA user would otherwise run, timed on the same problems as loom.

Two modes:

  python3 bench/peers.py --emit DIR [--grid quick|full]
      (no PyTorch needed; tests/gpu/prepare.sh runs it) writes one spec JSON
      per problem of the grid and DIR/problems.txt ("name tokens batch" lines),
      from which loom's kernels are compiled as bench bundles.

  python3 bench/peers.py --run OUT.json [--grid quick|full] [--backward]
      (on the GPU machine, PyTorch with CUDA) times, per problem, on fresh
      random inputs drawn as loom's cases are:
        eager    mixing, interleave, RoPE, torch SDPA with the IHA mask as a
                 boolean attn_mask, collapse (everything materialised)
        flex     the same mixing and collapse around torch.compile'd
                 flex_attention with the IHA mask as mask_mod (block-sparse)
        sdpa-*   for flat_causal without a window: SDPA's flash and cuDNN
                 backends (is_causal) over the interleaved sequence, mixing and
                 collapse timed too
      CUDA events, warm-up, median of repeated runs, the L2 flushed before
      each; TFLOP/s with docs/IHA.md's FLOP count; peak memory per method.
      --backward times a training step instead: each method's forward and
      its autograd backward (every gradient: q, k, v, the three mixings and
      collapse, from a fresh dout), counted as 3.5 forwards (FlashAttention's
      count: the backward is 2.5).

  python3 bench/peers.py --run OUT.json --decode [--loom BENCH.json]
      times one decode step (a new token per sequence) the way a generic
      attention library must take it: over a cache of the mixed, rotated
      pseudo-keys and values (G*P*d per token, materialised and contiguous,
      the layout most favourable to it), the new token's rows mixed, rotated
      and written in, the attention with the step's mask, the collapse; the
      attention once by SDPA (a boolean mask) and once by torch.compile'd
      flex_attention (a block mask, its decoding kernel for short queries).
      With loom-gpu-bench's JSON it prints loom's raw-cache step beside
      them (the speedup over the faster), and both layouts' cache bytes.

  python3 bench/peers.py --run OUT.json --ragged [--loom BENCH.json] [--ceilings CEILINGS.json]
      times ragged steps as serving engines batch them (docs/IHA.md, Ragged
      steps: 1 to 64 sequences, 1 to 8 new tokens each and prefill chunks of
      512, caches of 1k to 128k tokens) the way a generic library must: over
      a materialised pseudo-head cache, SDPA once a sequence and
      FlexAttention once over every sequence's packed rows (a block mask
      keeping each sequence to its own cache). With loom-gpu-bench's JSON
      (its bench-ragged rows) it prints loom's raw-cache step beside them,
      and for each the bytes a step moves and its time over the memory
      floor (those bytes at the measured copy ceiling, else the device's
      nominal bandwidth).

  python3 bench/peers.py --ragged-grid
      prints the ragged grid with each problem's bytes (no PyTorch needed).

bench/report.py joins OUT.json with loom-gpu-bench's JSON into the table.
"""
import argparse
import json
import math
import os
import sys

from ceilings import median_ms  # bench/ is the script's folder, so on sys.path

WARMUP, RUNS = 3, 10

# The problems that matter (issue 8): H in {8, 16}, P in {2, 4, H}, d in
# {64, 128}, N from 1k to 16k, flat_causal and token_causal, windows off and
# on, bf16 and fp16. "quick" is the subset one 8-minute GPU run affords.
def grid(which):
    problems = []

    def add(H, P, d, N, mask="flat_causal", window=0, dtype="bfloat16", batch=1):
        short = "bf16" if dtype == "bfloat16" else "fp16"
        name = f"h{H}p{P}d{d}-{mask.replace('_causal', '')}{f'-w{window}' if window else ''}-{short}-n{N}"
        spec = {"heads": H, "kv_heads": H, "pseudo_heads": P, "head_dim": d, "mask": mask, "window": window,
                "collapse": "per_head", "rope_theta": 10000.0, "dtype": dtype}
        problems.append({"name": name, "spec": spec, "tokens": N, "batch": batch})

    if which == "quick":
        for N in (1024, 4096):
            add(8, 8, 64, N)
            add(8, 4, 128, N)
        add(16, 2, 128, 8192)
        add(8, 4, 128, 4096, mask="token_causal")
        add(8, 4, 128, 4096, window=512)
        add(8, 4, 128, 4096, dtype="float16")
        return problems
    for H in (8, 16):
        for P in sorted({2, 4, H}):
            for d in (64, 128):
                for N in (1024, 4096, 16384):
                    if N * P > 65536:
                        continue
                    for mask in ("flat_causal", "token_causal"):
                        for window in (0, max(1, N // (2 * P * P))):
                            for dtype in ("bfloat16", "float16"):
                                add(H, P, d, N, mask, window, dtype)
    return problems


def decode_grid():
    """One new token per sequence over caches of `cached` tokens, batch 1 to 64, caches of 1k to 128k
    tokens, P = 2 to 8 (issue 19's benchmark)."""
    problems = []

    def add(H, G, P, d, cached, batch):
        spec = {"heads": H, "kv_heads": G, "pseudo_heads": P, "head_dim": d, "mask": "flat_causal", "window": 0,
                "collapse": "per_head", "rope_theta": 10000.0, "dtype": "bfloat16"}
        problems.append({"name": f"decode-h{H}g{G}p{P}d{d}-c{cached}b{batch}", "spec": spec, "cached": cached,
                         "batch": batch})

    for cached, batch in ((1024, 1), (16384, 1), (131072, 1), (2048, 64), (16384, 16), (16384, 64)):
        add(8, 8, 4, 128, cached, batch)
    for P in (2, 8):
        add(8, 8, P, 128, 16384, 16)
    add(32, 8, 2, 128, 16384, 16)
    return problems


def ragged_grid():
    """Ragged steps of one launch: each problem lists every sequence's cached tokens and new tokens. Decode
    tokens (1 to 8) beside prefill chunks of 512 over caches of 1k to 128k, 1 to 64 sequences."""
    problems = []
    spec = {"heads": 8, "kv_heads": 8, "pseudo_heads": 4, "head_dim": 128, "mask": "flat_causal", "window": 0,
            "collapse": "per_head", "rope_theta": 10000.0, "dtype": "bfloat16"}

    def add(name, cached, new):
        problems.append({"name": f"ragged-h8g8p4d128-{name}", "spec": spec, "cached": cached, "new": new})

    add("prefill512-c1k", [1024], [512])
    add("decode1x8-c16k", [16384] * 8, [1] * 8)
    add("spec4x4-c128k", [131072] * 4, [4] * 4)  # speculative decoding's 4-token verify steps
    add("mix1chunk15dec-c16k", [16384] * 16, [512] + [1] * 15)
    add("mix2chunks30dec-c32k", [32768] * 32, [512, 512] + [1] * 30)
    add("dec64x1to8-c4k", [4096 + 64 * i for i in range(64)], [1 + i % 8 for i in range(64)])
    return problems


def ragged_bytes(spec, cached, new):
    """What a ragged step must move at least: the raw cache it reads (every sequence's cached and new tokens'
    k and v, G d each), the new tokens' q, k and v read and out written, in the spec's 16-bit dtype."""
    H, G, d = spec["heads"], spec["kv_heads"], spec["head_dim"]
    tokens = sum(c + t for c, t in zip(cached, new))
    return 2 * (2 * G * d * tokens + (2 * H + 2 * G) * d * sum(new))


def nominal_gbs(device_name):
    """The device's nominal memory bandwidth (GB/s), where no measured copy ceiling is given."""
    for key, gbs in (("H200", 4800.0), ("H100", 3350.0), ("A100", 2039.0)):
        if key in device_name:
            return gbs
    return 0.0


def flops(spec, N, B):
    """4 d H B times the allowed (i, j) pairs, docs/IHA.md."""
    P, W = spec["pseudo_heads"], spec["window"]
    L = N * P
    if spec["mask"] == "flat_causal":
        pairs = sum(min(i + 1, W * P) if W else i + 1 for i in range(L))
    else:  # token_causal
        pairs = sum(P * (min(t + 1, W) if W else t + 1) for t in range(N)) * P
    return 4.0 * spec["head_dim"] * spec["heads"] * B * pairs


def emit(directory, problems):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "problems.txt"), "w") as listing:
        for p in problems:
            with open(os.path.join(directory, p["name"] + ".json"), "w") as f:
                json.dump(p["spec"], f)
            listing.write(f"{p['name']} {p['tokens']} {p['batch']}\n")
    decode = decode_grid()
    with open(os.path.join(directory, "decode-problems.txt"), "w") as listing:
        for p in decode:
            with open(os.path.join(directory, p["name"] + ".json"), "w") as f:
                json.dump(p["spec"], f)
            listing.write(f"{p['name']} {p['cached']} {p['batch']}\n")
    # Ragged steps: "name cached,... new,..." lines (loom-gpu-bench times a bench-ragged.NAME.pb over them).
    ragged = ragged_grid()
    with open(os.path.join(directory, "ragged-problems.txt"), "w") as listing:
        for p in ragged:
            with open(os.path.join(directory, p["name"] + ".json"), "w") as f:
                json.dump(p["spec"], f)
            listing.write(f"{p['name']} {','.join(map(str, p['cached']))} {','.join(map(str, p['new']))}\n")
    print(f"{len(problems)} problems, {len(decode)} decode and {len(ragged)} ragged problems written to {directory}")


def run_decode(out_path, loom_path=None):
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("peers: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        import torch._dynamo
        # Every problem is a shape of its own: compile each rather than fall back to eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as error:  # noqa: BLE001 - any import or compile failure means "unavailable"
        flex, flex_error = None, str(error)
    loom = {}
    if loom_path and os.path.exists(loom_path):
        loom = {r["name"]: r for r in json.load(open(loom_path))["results"] if r.get("direction") == "decode"}
    results = []
    print(f"{'problem':32s} {'sdpa ms':>9s} {'flex ms':>9s} {'loom ms':>9s} {'speedup':>8s} {'mixed GB':>9s} "
          f"{'raw GB':>8s}")
    for problem in decode_grid():
        spec, C, B = problem["spec"], problem["cached"], problem["batch"]
        H, G, P, d = spec["heads"], spec["kv_heads"], spec["pseudo_heads"], spec["head_dim"]
        L = (C + 1) * P
        dtype = torch.bfloat16
        gen = torch.Generator(device=device).manual_seed(len(results) + 1)
        row = {"name": problem["name"], "cached": C, "batch": B, "methods": {},
               "cache_bytes_mixed": B * (C + 1) * 2 * G * P * d * 2, "cache_bytes_raw": B * (C + 1) * 2 * G * d * 2}
        methods = ("sdpa-mixed-cache", "flex-mixed-cache")
        try:
            keys = torch.randn(B, G, L, d, device=device, dtype=dtype, generator=gen)
            values = torch.randn(B, G, L, d, device=device, dtype=dtype, generator=gen)
            q = torch.randn(B, 1, H, d, device=device, dtype=dtype, generator=gen)
            k = torch.randn(B, 1, G, d, device=device, dtype=dtype, generator=gen)
            v = torch.randn(B, 1, G, d, device=device, dtype=dtype, generator=gen)
            near_identity = lambda n: (torch.eye(n, device=device)[:, :, None]
                                       + 0.3 * torch.randn(n, n, P, device=device, generator=gen))
            aq, ak, av = near_identity(H), near_identity(G), near_identity(G)
            collapse = torch.randn(H, P, device=device, generator=gen) / math.sqrt(P)
            half = d // 2
            inv = spec["rope_theta"] ** (-2.0 * torch.arange(half, device=device, dtype=torch.float64) / d)
            angle = (C * P + torch.arange(P, device=device, dtype=torch.float64))[:, None] * inv
            cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
            # The new rows see every cached row and the new rows up to their own (flat_causal).
            mask = torch.ones(P, L, dtype=torch.bool, device=device)
            mask[:, C * P:] = torch.tril(torch.ones(P, P, dtype=torch.bool, device=device))

            def mix(x, alpha):  # [B, 1, M, d] -> [B, M', P, d]
                return torch.einsum("bnmc,mhp->bhnpc", x.float(), alpha).to(dtype).reshape(B, alpha.shape[1], P, d)

            def rope(x):
                a, b = x[..., :half], x[..., half:]
                return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

            gqa = {} if G == H else {"enable_gqa": True}

            def step(attend):  # the step around one attention: append, attend, collapse
                keys[:, :, C * P:] = rope(mix(k, ak))
                values[:, :, C * P:] = mix(v, av)
                o = attend(rope(mix(q, aq)), keys, values)
                return torch.einsum("hp,bhpc->bhc", collapse, o.float()).to(dtype)

            def measure(method, attend):
                try:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    ms = median_ms(torch, lambda: step(attend), runs=RUNS, warmup=WARMUP,
                                   before=lambda: flush.random_(0, 255))
                    row["methods"][method] = {"median_ms": ms, "peak_bytes": torch.cuda.max_memory_allocated()}
                except Exception as error:  # noqa: BLE001 - recorded, the table says why
                    row["methods"][method] = {"error": f"{type(error).__name__}: {str(error)[:160]}"}

            measure("sdpa-mixed-cache", lambda qs, ks, vs: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                                                          **gqa))
            if flex is not None:
                # The same mask as a block mask: new row i (of P) sees keys up to C*P + i.
                block_mask = create_block_mask(lambda b, h, qi, kj: kj <= C * P + qi, None, None, P, L, device=device)
                measure("flex-mixed-cache", lambda qs, ks, vs: flex(qs, ks, vs, block_mask=block_mask, **gqa))
            else:
                row["methods"]["flex-mixed-cache"] = {"error": f"unavailable: {flex_error[:160]}"}
            del keys, values
        except Exception as error:  # noqa: BLE001 - recorded, the table says why
            for method in methods:
                row["methods"].setdefault(method, {"error": f"{type(error).__name__}: {str(error)[:160]}"})
        torch.cuda.empty_cache()
        results.append(row)
        sdpa = row["methods"]["sdpa-mixed-cache"].get("median_ms")
        flex_ms = row["methods"]["flex-mixed-cache"].get("median_ms")
        peers = [x for x in (sdpa, flex_ms) if x]
        mine = loom.get(problem["name"], {}).get("median_ms")
        cell = lambda x: f"{x:9.3f}" if x else f"{'-':>9s}"
        # loom against the faster peer
        speedup = f"{min(peers) / mine:7.2f}x" if peers and mine else f"{'-':>8s}"
        print(f"{problem['name']:32s} {cell(sdpa)} {cell(flex_ms)} {cell(mine)} {speedup} "
              f"{row['cache_bytes_mixed'] / 1e9:9.2f} {row['cache_bytes_raw'] / 1e9:8.2f}", flush=True)
        # Written after every problem: a run cut short by its time limit keeps the rows it measured.
        with open(out_path + ".tmp", "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "direction": "decode",
                       "results": results}, f, indent=2)
        os.replace(out_path + ".tmp", out_path)
    return 0


def print_ragged_grid():
    print(f"{'problem':36s} {'seqs':>5s} {'new':>6s} {'cached':>9s} {'MB moved':>9s}")
    for p in ragged_grid():
        print(f"{p['name']:36s} {len(p['new']):5d} {sum(p['new']):6d} {sum(p['cached']):9d} "
              f"{ragged_bytes(p['spec'], p['cached'], p['new']) / 1e6:9.1f}")
    return 0


def run_ragged(out_path, loom_path=None, ceilings_path=None):
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("peers: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    flex, flex_error = None, ""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        import torch._dynamo
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as error:  # noqa: BLE001 - any import or compile failure means "unavailable"
        flex_error = str(error)
    loom = {}
    if loom_path and os.path.exists(loom_path):
        loom = {r["name"]: r for r in json.load(open(loom_path))["results"] if r.get("direction") == "ragged"}
    gbs = nominal_gbs(torch.cuda.get_device_name(0))
    if ceilings_path and os.path.exists(ceilings_path):
        gbs = json.load(open(ceilings_path)).get("copy_gbs", gbs)
    results = []
    print(f"{'problem':36s} {'sdpa ms':>9s} {'flex ms':>9s} {'loom ms':>9s} {'speedup':>8s} {'MB moved':>9s} "
          f"{'floor ms':>9s} {'loom/floor':>10s}")
    for index, problem in enumerate(ragged_grid()):
        spec, cached, new = problem["spec"], problem["cached"], problem["new"]
        H, G, P, d = spec["heads"], spec["kv_heads"], spec["pseudo_heads"], spec["head_dim"]
        dtype = torch.bfloat16
        gen = torch.Generator(device=device).manual_seed(index + 1)
        moved = ragged_bytes(spec, cached, new)
        row = {"name": problem["name"], "cached": cached, "new": new, "bytes_moved": moved,
               "floor_ms": moved / (gbs * 1e6) if gbs else None, "methods": {}}
        try:
            # Every sequence's mixed pseudo-keys and values [G, (C + T) P, d] (the layout most favourable to a
            # generic library), and its new tokens' mixed, rotated queries [H, T P, d]: the appends and the
            # mixing of the new rows are the same elementwise work for every method, so only the attention and
            # the per-sequence bookkeeping are timed.
            keys = [torch.randn(1, G, (c + t) * P, d, device=device, dtype=dtype, generator=gen)
                    for c, t in zip(cached, new)]
            values = [torch.randn_like(k) for k in keys]
            queries = [torch.randn(1, H, t * P, d, device=device, dtype=dtype, generator=gen) for t in new]
            gqa = {} if G == H else {"enable_gqa": True}

            def masks():  # flat_causal: new row i of a sequence sees keys up to C P + i
                out = []
                for c, t in zip(cached, new):
                    mask = torch.ones(t * P, (c + t) * P, dtype=torch.bool, device=device)
                    mask[:, c * P:] = torch.tril(torch.ones(t * P, t * P, dtype=torch.bool, device=device))
                    out.append(mask)
                return out

            sdpa_masks = masks()

            def sdpa():
                return [F.scaled_dot_product_attention(q, k, v, attn_mask=m, **gqa)
                        for q, k, v, m in zip(queries, keys, values, sdpa_masks) if q.shape[2]]

            def measure(method, fn):
                try:
                    torch.cuda.synchronize()
                    ms = median_ms(torch, fn, runs=RUNS, warmup=WARMUP, before=lambda: flush.random_(0, 255))
                    row["methods"][method] = {"median_ms": ms}
                except Exception as error:  # noqa: BLE001 - recorded, the table says why
                    row["methods"][method] = {"error": f"{type(error).__name__}: {str(error)[:160]}"}

            measure("sdpa-mixed-cache", sdpa)
            if flex is not None:
                # Every sequence's rows packed: a query row attends keys of its own sequence up to its position.
                q_all = torch.cat(queries, dim=2)
                k_all, v_all = torch.cat(keys, dim=2), torch.cat(values, dim=2)
                q_seq = torch.cat([torch.full((t * P,), b, device=device) for b, t in enumerate(new)])
                q_pos = torch.cat([c * P + torch.arange(t * P, device=device) for c, t in zip(cached, new)])
                k_seq = torch.cat([torch.full(((c + t) * P,), b, device=device) for b, (c, t) in enumerate(zip(cached, new))])
                k_pos = torch.cat([torch.arange((c + t) * P, device=device) for c, t in zip(cached, new)])
                block_mask = create_block_mask(
                    lambda b, h, qi, kj: (q_seq[qi] == k_seq[kj]) & (k_pos[kj] <= q_pos[qi]), None, None,
                    q_all.shape[2], k_all.shape[2], device=device)
                measure("flex-mixed-cache", lambda: flex(q_all, k_all, v_all, block_mask=block_mask, **gqa))
            else:
                row["methods"]["flex-mixed-cache"] = {"error": f"unavailable: {flex_error[:160]}"}
            del keys, values, queries
        except Exception as error:  # noqa: BLE001 - recorded, the table says why
            for method in ("sdpa-mixed-cache", "flex-mixed-cache"):
                row["methods"].setdefault(method, {"error": f"{type(error).__name__}: {str(error)[:160]}"})
        torch.cuda.empty_cache()
        mine = loom.get(problem["name"], {}).get("median_ms")
        if mine:
            row["methods"]["loom-raw-cache"] = {"median_ms": mine}
        results.append(row)
        sdpa_ms = row["methods"]["sdpa-mixed-cache"].get("median_ms")
        flex_ms = row["methods"]["flex-mixed-cache"].get("median_ms")
        peers = [x for x in (sdpa_ms, flex_ms) if x]
        cell = lambda x, w=9: f"{x:{w}.3f}" if x else f"{'-':>{w}s}"
        speedup = f"{min(peers) / mine:7.2f}x" if peers and mine else f"{'-':>8s}"
        floor = row["floor_ms"]
        ratio = f"{mine / floor:9.2f}x" if mine and floor else f"{'-':>10s}"
        print(f"{problem['name']:36s} {cell(sdpa_ms)} {cell(flex_ms)} {cell(mine)} {speedup} {moved / 1e6:9.1f} "
              f"{cell(floor)} {ratio}", flush=True)
        with open(out_path + ".tmp", "w") as f:  # after every problem: a run cut short keeps its rows
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "direction": "ragged",
                       "copy_gbs": gbs, "results": results}, f, indent=2)
        os.replace(out_path + ".tmp", out_path)
    return 0


def run(out_path, problems, backward=False):
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("peers: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        sdpa_kernel = None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as error:  # noqa: BLE001 - any import or compile failure means "unavailable"
        flex, flex_error = None, str(error)

    def time_ms(fn):  # the L2 flushed before every timed run
        return median_ms(torch, fn, runs=RUNS, warmup=WARMUP, before=lambda: flush.random_(0, 255))

    results = []
    for problem in problems:
        spec, N, B = problem["spec"], problem["tokens"], problem["batch"]
        H, G, P, d, W = spec["heads"], spec["kv_heads"], spec["pseudo_heads"], spec["head_dim"], spec["window"]
        L = N * P
        dtype = torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float16
        gen = torch.Generator(device=device).manual_seed(len(results) + 1)
        q = torch.randn(B, N, H, d, device=device, dtype=dtype, generator=gen)
        k = torch.randn(B, N, G, d, device=device, dtype=dtype, generator=gen)
        v = torch.randn(B, N, G, d, device=device, dtype=dtype, generator=gen)
        near_identity = lambda n: (torch.eye(n, device=device)[:, :, None]
                                   + 0.3 * torch.randn(n, n, P, device=device, generator=gen))
        aq, ak, av = near_identity(H), near_identity(G), near_identity(G)
        collapse = torch.randn(H, P, device=device, generator=gen) / math.sqrt(P)
        leaves = (q, k, v, aq, ak, av, collapse)
        if backward:
            for leaf in leaves:
                leaf.requires_grad_(True)
            dout = torch.randn(B, N, H, d, device=device, dtype=dtype, generator=gen)
        half = d // 2
        inv = spec["rope_theta"] ** (-2.0 * torch.arange(half, device=device, dtype=torch.float64) / d)
        angle = torch.arange(L, device=device, dtype=torch.float64)[:, None] * inv
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)

        def mix(x, alpha):  # [B, N, M, d] -> [B, M', L, d], row n*P + p
            y = torch.einsum("bnmc,mhp->bhnpc", x.float(), alpha).to(dtype)
            return y.reshape(B, alpha.shape[1], L, d)

        def rope(x):
            a, b = x[..., :half], x[..., half:]
            return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

        def fold(o):  # [B, H, L, d] -> [B, N, H, d]
            return torch.einsum("hp,bhnpc->bnhc", collapse, o.float().reshape(B, H, N, P, d)).to(dtype)

        def operands():
            return rope(mix(q, aq)), rope(mix(k, ak)), mix(v, av)

        i = torch.arange(L, device=device)
        def allowed(qi, kj):
            ti, tj = qi // P, kj // P
            if spec["mask"] == "flat_causal":
                ok = kj <= qi
                return ok & (qi - kj < W * P) if W else ok
            ok = tj <= ti
            return ok & (ti - tj < W) if W else ok

        work = flops(spec, N, B) * (3.5 if backward else 1.0)
        row = {"name": problem["name"], "tokens": N, "batch": B, "flops": work, "methods": {}}

        def measure(method, forward):
            # A training step: the forward, then every gradient from dout.
            fn = (lambda: torch.autograd.grad(forward(), leaves, dout)) if backward else forward
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                ms = time_ms(fn)
                peak = torch.cuda.max_memory_allocated() - base
                row["methods"][method] = {"median_ms": ms, "tflops": row["flops"] / (ms * 1e-3) / 1e12,
                                          "peak_bytes": peak}
            except Exception as error:  # noqa: BLE001 - recorded, the table says why
                row["methods"][method] = {"error": f"{type(error).__name__}: {str(error)[:160]}"}
            torch.cuda.empty_cache()

        if L <= 16384:  # a dense L x L boolean mask
            mask = allowed(i[:, None], i[None, :])
            def eager():
                qs, ks, vs = operands()
                return fold(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask))
            measure("eager", eager)
            del mask
        else:
            row["methods"]["eager"] = {"error": f"skipped: a dense {L}x{L} mask"}

        if flex is not None:
            block_mask = create_block_mask(lambda b, h, qi, kj: allowed(qi, kj), None, None, L, L, device=device)
            measure("flex", lambda: fold(flex(*operands(), block_mask=block_mask)))
        else:
            row["methods"]["flex"] = {"error": f"unavailable: {flex_error[:160]}"}

        if spec["mask"] == "flat_causal" and not W and sdpa_kernel is not None:
            for method, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                def causal(backend=backend):
                    with sdpa_kernel(backend):
                        return fold(F.scaled_dot_product_attention(*operands(), is_causal=True))
                measure(method, causal)
        results.append(row)
        best = {m: r.get("tflops") for m, r in row["methods"].items()}
        print(f"{problem['name']:36s} " + "  ".join(
            f"{m} {t:.1f}" if t else f"{m} -" for m, t in best.items()), flush=True)

    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "direction": "forward+backward" if backward else "forward", "results": results}, f, indent=2)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--emit", metavar="DIR", help="write the grid's specs for loom's bench bundles")
    mode.add_argument("--run", metavar="OUT.json", help="time the peers (PyTorch with CUDA)")
    mode.add_argument("--ragged-grid", action="store_true", help="print the ragged grid and each step's bytes")
    parser.add_argument("--grid", choices=("quick", "full"), default="quick")
    parser.add_argument("--backward", action="store_true",
                        help="with --run: time forward + backward (a training step) instead of the forward")
    parser.add_argument("--decode", action="store_true",
                        help="with --run: time a decode step over a materialised pseudo-head cache instead")
    parser.add_argument("--ragged", action="store_true",
                        help="with --run: time ragged steps (prefill chunks beside decode tokens) instead")
    parser.add_argument("--loom", metavar="BENCH.json",
                        help="with --decode or --ragged: loom-gpu-bench's results, printed beside")
    parser.add_argument("--ceilings", metavar="CEILINGS.json",
                        help="with --ragged: bench/ceilings.py's measured copy bandwidth for the memory floor")
    args = parser.parse_args()
    if args.ragged_grid:
        return print_ragged_grid()
    if args.run and args.ragged:
        return run_ragged(args.run, args.loom, args.ceilings)
    if args.run and args.decode:
        return run_decode(args.run, args.loom)
    problems = grid(args.grid)
    if args.emit:
        emit(args.emit, problems)
        return 0
    return run(args.run, problems, args.backward)


if __name__ == "__main__":
    sys.exit(main())
