#!/usr/bin/env python3
"""A small serving engine over loom's paged decode: continuous batching in ragged steps (prefill chunks and
decode tokens in one launch), a shared system prompt's pages (prefix caching, copy-on-write for its last
partial page), and a page allocator that frees what a request leaves behind.

The model is a small IHA language model (loom.torch's InterleavedHeadAttention in every layer, seeded
random weights). Requests arrive at different steps, each a system prompt every request shares followed by
prompt tokens of its own, and ask for a number of greedy tokens. Every step the engine:
  1. admits the requests that have arrived: each gets the system prompt's full pages (shared, read only),
     a private copy of its last partial page, and pages of its own;
  2. runs one ragged step (docs/IHA.md, Ragged steps; one loom.torch.paged_attention call a layer): the
     admitted requests' own prompts, each prefilled over the cached system prompt, packed beside one
     decode token of every running request;
  3. retires the requests that have their tokens, giving their pages back (a shared page when its last
     sharer leaves; the system prompt's stay with the engine).
With --check every request's tokens are compared with recomputing its whole sequence with loom.torch.iha
(the layer's forward, no cache) at every step: they must be equal (in bfloat16 on a GPU, where the two
paths round differently, a first difference counts only where the recomputed logits of the two tokens lie
within bfloat16's rounding of each other).

    PYTHONPATH=build/python python3 examples/serving/engine.py                 # or after `pip install .`
    python3 examples/serving/engine.py --cache mixed --check                     # what CI runs, both layouts

On the CPU loom runs its generated decode program on the host tile API in float32; on a GPU its CUDA decode
kernels in bfloat16, and the engine reports decoded tokens per second.
"""
import argparse
import random
import sys
import time

import torch

from loom.torch import InterleavedHeadAttention, paged_attention


class PageAllocator:
    """A pool of cache pages with reference counts: a page returns to the pool when its last holder
    releases it (a shared prompt page is held by every request reading it, and by the engine)."""

    def __init__(self, pages: int):
        self.free = list(range(pages - 1, -1, -1))
        self.holders = [0] * pages

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("out of cache pages: raise --pages or lower the load")
        page = self.free.pop()
        self.holders[page] = 1
        return page

    def share(self, page: int) -> int:
        self.holders[page] += 1
        return page

    def release(self, page: int):
        self.holders[page] -= 1
        if self.holders[page] == 0:
            self.free.append(page)

    def in_use(self) -> int:
        return len(self.holders) - len(self.free)


class Block(torch.nn.Module):
    def __init__(self, args):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(args.dim), torch.nn.LayerNorm(args.dim)
        self.attention = InterleavedHeadAttention(args.dim, heads=args.heads, pseudo_heads=args.pseudo_heads,
                                                  kv_heads=args.kv_heads, head_dim=args.dim // args.heads,
                                                  mask="flat_causal", rope_theta=10000.0, init_noise=0.3,
                                                  threads=args.threads)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(args.dim, 4 * args.dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * args.dim, args.dim))


class TinyLM(torch.nn.Module):
    """Embedding, IHA blocks, head. forward() is the whole sequence at once (loom.torch.iha in every layer);
    step() is the served path: a ragged step's new tokens over each layer's paged cache
    (loom.torch.paged_attention)."""

    def __init__(self, vocab: int, args):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, args.dim)
        self.blocks = torch.nn.ModuleList(Block(args) for _ in range(args.layers))
        self.norm = torch.nn.LayerNorm(args.dim)
        self.head = torch.nn.Linear(args.dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = x + b.attention(b.norm1(x))
            x = x + b.mlp(b.norm2(x))
        return self.head(self.norm(x))

    def step(self, tokens, caches, page_table, cache_len, starts, most, layout, dtype, threads):
        """tokens [total]: sequence b's new tokens are tokens[starts[b]:starts[b + 1]], at its positions
        cache_len[b] onwards -> logits [total, vocab]; appends each layer's k and v to its cache (the caller
        advances cache_len). `most`: the most new tokens of one sequence."""
        x = self.embed(tokens)
        total = x.shape[0]
        for b, (k_cache, v_cache) in zip(self.blocks, caches):
            a = b.attention
            h = b.norm1(x)
            H, G, d = a.heads, a.kv_heads, a.head_dim
            q = a.q_proj(h).view(total, H, d).to(dtype)
            k = a.k_proj(h).view(total, G, d).to(dtype)
            v = a.v_proj(h).view(total, G, d).to(dtype)
            o = paged_attention(q, k, v, a.alpha_q.float(), a.alpha_k.float(), a.alpha_v.float(),
                                a.collapse.float(), k_cache, v_cache, page_table, cache_len, starts, a.spec,
                                cache=layout, max_query_len=most, threads=threads)
            x = x + a.out_proj(o.to(x.dtype).reshape(total, H * d))
            x = x + b.mlp(b.norm2(x))
        return self.head(self.norm(x))


class Request:
    def __init__(self, rid, arrival, prompt, wanted):
        self.rid, self.arrival, self.prompt, self.wanted = rid, arrival, prompt, wanted
        self.pages, self.length, self.generated, self.logits = [], 0, [], []


class Engine:
    def __init__(self, model, args, device, dtype):
        self.model, self.args, self.device, self.dtype = model, args, device, dtype
        a = model.blocks[0].attention
        G, P, d, S = a.kv_heads, a.pseudo_heads, a.head_dim, args.page_size
        shape = (args.pages, S, G, d) if args.cache == "raw" else (args.pages, S, G, P, d)
        self.caches = [(torch.full(shape, float("nan"), dtype=dtype, device=device),
                        torch.full(shape, float("nan"), dtype=dtype, device=device)) for _ in model.blocks]
        self.pool = PageAllocator(args.pages)
        self.running, self.done = [], []
        self.shared, self.system = [], []  # the system prompt's pages, and its tokens
        self.peak_pages = 0
        self.decoded_tokens = 0
        self.steps_mixed = 0  # ragged steps holding a prefill and a decode token together

    def _run(self, batch):
        """One ragged step of `batch`, (request, its new tokens, its cached length) each: the logits of each
        request's last new token."""
        width = max(len(r.pages) for r, _, _ in batch)
        table = torch.tensor([r.pages + [-1] * (width - len(r.pages)) for r, _, _ in batch], dtype=torch.int32,
                             device=self.device)
        cache_len = torch.tensor([n for _, _, n in batch], dtype=torch.int32, device=self.device)
        counts = [len(new) for _, new, _ in batch]
        starts = torch.tensor([0] + [sum(counts[:i + 1]) for i in range(len(counts))], dtype=torch.int32,
                              device=self.device)
        tokens = torch.tensor([t for _, new, _ in batch for t in new], device=self.device)
        logits = self.model.step(tokens, self.caches, table, cache_len, starts, max(counts), self.args.cache,
                                 self.dtype, self.args.threads)
        return logits[starts[1:].long() - 1]

    def _grow(self, r, length):
        """Pages enough for `length` tokens."""
        while len(r.pages) * self.args.page_size < length:
            r.pages.append(self.pool.take())

    def prefill_system(self, system):
        """The system prompt into pages of the engine's own, once; its full pages are shared from then on."""
        holder = Request(-1, 0, system, 0)
        self._grow(holder, len(system))
        with torch.no_grad():
            self._run([(holder, system, 0)])
        self.shared, self.system = holder.pages, system

    def admit(self, r):
        """Shares the system prompt's full pages, copies its last partial page (copy on write: the request
        appends there) and takes pages for its own prompt, which the next step prefills over the cached
        system prompt."""
        S, n = self.args.page_size, len(self.system)
        full = n // S
        r.pages = [self.pool.share(p) for p in self.shared[:full]]
        if n % S:
            own = self.pool.take()
            for k_cache, v_cache in self.caches:
                k_cache[own].copy_(k_cache[self.shared[full]])
                v_cache[own].copy_(v_cache[self.shared[full]])
            r.pages.append(own)
        self._grow(r, len(r.prompt))
        r.length = n
        self.running.append(r)

    def run_step(self):
        """One ragged step: every admitted request's own prompt (a prefill chunk over the cached system
        prompt) and one token of every running request that still wants one, packed in one launch a layer."""
        batch = []
        for r in self.running:
            if not r.generated:  # admitted: its prompt after the system prompt
                batch.append((r, r.prompt[r.length:], r.length))
            elif len(r.generated) < r.wanted:
                self._grow(r, r.length + 1)
                batch.append((r, [r.generated[-1]], r.length))
        if not batch:
            return
        with torch.no_grad():
            last = self._run(batch)
        prefills = 0
        for (r, new, _), token, logits in zip(batch, last.argmax(-1).tolist(), last.float().cpu()):
            prefills += not r.generated
            self.decoded_tokens += bool(r.generated)
            r.length += len(new)
            r.generated.append(int(token))
            r.logits.append(logits)
        self.steps_mixed += 0 < prefills < len(batch)

    def retire(self):
        for r in [r for r in self.running if len(r.generated) >= r.wanted]:
            for page in r.pages:
                self.pool.release(page)
            r.pages = []
            self.running.remove(r)
            self.done.append(r)

    def serve(self, requests):
        pending = sorted(requests, key=lambda r: r.arrival)
        step = 0
        while pending or self.running:
            while pending and pending[0].arrival <= step:
                self.admit(pending.pop(0))
            self.run_step()
            self.peak_pages = max(self.peak_pages, self.pool.in_use())
            self.retire()
            step += 1
        return step


def recompute(model, r, device, tie, tolerance):
    """r's greedy tokens recomputed over its whole sequence with loom.torch.iha at every step, following the
    served tokens; returns (equal, what to print). The served logits must lie within `tolerance` of the
    recomputed ones (relative, over the vocabulary). A first difference of tokens is a tie, not a failure,
    where the recomputed logits of the two tokens lie within `tie` of each other relative to the largest."""
    tokens = list(r.prompt)
    want = []
    with torch.no_grad():
        for served, served_logits in zip(r.generated, r.logits):
            logits = model(torch.tensor([tokens], device=device))[0, -1].float().cpu()
            error = float((served_logits - logits).norm() / logits.norm())
            if not error <= tolerance:  # NaN too
                return False, f"logits {error:.2e} from the recomputed ones at token {len(want)}: DIFFERENT"
            want.append(int(logits.argmax()))
            if want[-1] != served:
                gap = float(logits[want[-1]] - logits[served]) / float(logits.abs().max())
                if gap > tie:
                    return False, f"recomputed {want}: DIFFERENT (logit gap {gap:.2e})"
                return True, f"recomputed {want}: a tie within the dtype's rounding (logit gap {gap:.2e}), equal before"
            tokens.append(served)
    return True, f"recomputed {want}: equal"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--system", type=int, default=11, help="system prompt tokens every request shares")
    parser.add_argument("--own", type=int, default=5, help="at most this many prompt tokens of a request's own")
    parser.add_argument("--new", type=int, default=6, help="at most this many tokens generated a request")
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--cache", choices=("raw", "mixed", "both"), default="raw",
                        help="cache layout: raw (as projected, P times smaller) or mixed; both: run each")
    parser.add_argument("--vocab", type=int, default=48)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--pseudo-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="host path threads (0: all cores)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless every request's tokens equal recomputing its sequence each step")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args).to(device)
    rng = random.Random(args.seed)
    system = [rng.randrange(args.vocab) for _ in range(args.system)]
    failed = False
    for layout in (("raw", "mixed") if args.cache == "both" else (args.cache,)):
        args.cache = layout
        requests = [Request(i, rng.randrange(0, 2 * args.requests // 3 + 1),
                            system + [rng.randrange(args.vocab) for _ in range(rng.randint(1, args.own))],
                            rng.randint(1, args.new)) for i in range(args.requests)]
        engine = Engine(model, args, device, dtype)
        start = time.time()
        engine.prefill_system(system)
        steps = engine.serve(requests)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.time() - start
        a = model.blocks[0].attention
        G, P, d = a.kv_heads, a.pseudo_heads, a.head_dim
        per_token = 2 * G * d * (P if layout == "mixed" else 1) * torch.finfo(dtype).bits // 8 * args.layers
        shared = len(system) // args.page_size
        print(f"{layout} cache: {len(requests)} requests served in {steps} steps, {engine.decoded_tokens} tokens "
              f"decoded in ragged steps ({engine.steps_mixed} of them prefilling and decoding together); "
              f"{per_token} bytes a cached token ({args.layers} layers, G={G} d={d}"
              f"{f' P={P}' if layout == 'mixed' else ''}); the system prompt's {shared} full pages held once for "
              f"all {len(requests)} requests ({shared * (len(requests) - 1)} pages saved); peak "
              f"{engine.peak_pages} pages of {args.page_size} tokens in use, {engine.pool.in_use()} after the "
              f"last request (the system prompt's)")
        if device == "cuda":
            print(f"  {engine.decoded_tokens / seconds:.1f} decoded tokens per second ({seconds:.2f} s, "
                  "compiles included)")
        if args.check:
            tie, tolerance = (0.0, 1e-4) if dtype == torch.float32 else (2.0 ** -7, 3e-2)
            for r in sorted(engine.done, key=lambda r: r.rid):
                same, said = recompute(model, r, device, tie, tolerance)
                failed |= not same
                print(f"  request {r.rid}: arrived at step {r.arrival}, prompt {len(r.prompt)} tokens, served "
                      f"{r.generated}, {said}")
    if args.check:
        print("check: " + ("FAILED" if failed else "every request's tokens equal recomputing its sequence"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
