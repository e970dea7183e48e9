"""loom.torch with a real PyTorch (Debian's python3-torch on the CPU): the
autograd op through the float64 reference (torch.autograd.gradcheck) and
through loom's generated programs on the host (float32, against the float64
reference and against PyTorch's own autograd of iha_eager), iha_eager against
loom's C++ reference, the InterleavedHeadAttention layer on both backends, the
errors, and the custom op with torch.compile where the installed PyTorch has
them. Specs, shapes and data are drawn fresh every run (the seed is printed;
LOOM_TEST_SEED replays it). Run by CTest with PYTHONPATH set to build/python,
and by scripts/check-wheel against an installed wheel.
"""
import itertools
import json
import os
import random
import unittest

import torch

import loom
import loom.torch as lt

CACHE = os.environ.get("LOOM_TEST_CACHE", "")
SEED = int(os.environ.get("LOOM_TEST_SEED", random.SystemRandom().randrange(1 << 32)))
print(f"[ seed ] LOOM_TEST_SEED={SEED}  torch {torch.__version__}")
GRADIENTS = ("q", "k", "v", "alpha_q", "alpha_k", "alpha_v", "collapse")
FLOAT32_GRADIENT_TOLERANCE = 1e-5  # docs/IHA.md, Backward


def relative(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


def random_spec(rng, head_dims=(8, 16)):
    """A valid spec over every mask, windows, both collapses, RoPE, GQA and the options of public IHA code,
    kept where no gradient vanishes (docs/IHA.md, loom's notes on checking gradients): P >= 2, windows of
    two tokens or more, and two heads or more per mixing under qk_norm."""
    G = rng.choice((1, 2))
    spec = {"heads": G * rng.choice((1, 2)), "kv_heads": G, "pseudo_heads": rng.choice((2, 3)),
            "head_dim": rng.choice(head_dims), "mask": rng.choice(("flat_causal", "token_causal", "none")),
            "window": rng.choice((0, 0, 2, 3)), "collapse": rng.choice(("per_head", "global")),
            "rope_theta": rng.choice((0.0, 10000.0))}
    if spec["rope_theta"] > 0 and rng.random() < 0.5:
        spec["rope_direction"] = "negative"
    if spec["window"] > 0 and rng.random() < 0.5:
        spec["window_align"] = "token"
    if spec["mask"] == "flat_causal" and spec["window"] == 0 and rng.random() < 0.3:
        spec["window_rows"] = rng.choice((2, 3, 5))
    if rng.random() < 0.3:
        spec["scale"] = 0.1 + 0.3 * rng.random()
    if rng.random() < 0.4:
        spec["kv_heads"] = spec["heads"] = 2 * rng.choice((1, 2))
        spec["qk_norm"] = "rms"
    return spec


def draw(spec, B, N, dtype, gen, requires_grad=True):
    """q, k, v ~ N(0, 1); mixing the identity plus N(0, 0.3^2); collapse N(0, 1/fan-in) (docs/IHA.md's draws)."""
    H, G, P, d = spec["heads"], spec["kv_heads"], spec["pseudo_heads"], spec["head_dim"]
    weights = torch.float64 if dtype == torch.float64 else torch.float32
    fan = P if spec["collapse"] == "per_head" else H * P

    def mixing(n):
        return torch.eye(n, dtype=torch.float64)[:, :, None] + 0.3 * torch.randn(n, n, P, generator=gen,
                                                                                 dtype=torch.float64)

    tensors = [torch.randn(B, N, H, d, generator=gen, dtype=torch.float64),
               torch.randn(B, N, G, d, generator=gen, dtype=torch.float64),
               torch.randn(B, N, G, d, generator=gen, dtype=torch.float64),
               mixing(H), mixing(G), mixing(G),
               torch.randn(H, fan, generator=gen, dtype=torch.float64) / fan ** 0.5]
    typed = [t.to(dtype if i < 3 else weights) for i, t in enumerate(tensors)]
    return [t.requires_grad_(requires_grad) for t in typed]


def drawn_cases(seed, count, tokens, head_dims=(8, 16)):
    """`count` drawn specs with float64 inputs of B in {1, 2} and N in `tokens`, and the generator that drew them."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        spec = random_spec(rng, head_dims)
        B, N = rng.choice((1, 2)), rng.randint(*tokens)
        yield spec, draw(spec, B, N, torch.float64, gen), gen


CHECKABLE_SHARE = 0.125  # core/io/case.h, kCheckableFloat32BackwardShare (these draws are float32)
CHECKABLE_DRAWS = 16


def check_share(spec, exact, dout, want):
    """What float32 rounding alone can cost the draw's gradients against the float64 ones `want`, as a share of
    the tolerance: the larger of PyTorch's own float32 autograd of iha_eager and the C++ tests' measure
    (loom.backward_check_share: the float64 backward with every partial sum a float32 kernel keeps rounded, and
    with the inputs moved by a few units of roundoff). Gradients that cancel (dalpha of one head, a sum over
    tokens; dq and dk of a row whose few keys nearly agree) lose more than the tolerance to float32 rounding in
    any implementation; like drawCheckableBackwardCase in C++, the test draws again where that rounding alone
    costs over an eighth of it (docs/IHA.md, Backward, loom's notes (2))."""
    single = [t.detach().float().requires_grad_() for t in exact]
    got = torch.autograd.grad(lt.iha_eager(*single, spec), single, dout.float())
    eager = max(relative(g, w) for g, w in zip(got, want)) / FLOAT32_GRADIENT_TOLERANCE
    model = loom.backward_check_share(*[t.detach() for t in exact], dout, lt.spec_for(spec, torch.float32))
    return max(eager, model)


def iha(*tensors, spec, **options):
    return lt.iha(*tensors, spec, cache_dir=CACHE, threads=2, **options)


class Reference(unittest.TestCase):
    """float64: loom.torch.iha runs loom's float64 reference both ways."""

    def test_gradcheck_on_drawn_specs(self):
        for spec, tensors, _ in drawn_cases(SEED, 4, (1, 4), head_dims=(8,)):
            with self.subTest(spec=spec, q_shape=tuple(tensors[0].shape)):
                self.assertTrue(torch.autograd.gradcheck(lambda *t: iha(*t, spec=spec), tensors, eps=1e-6,
                                                         atol=1e-8, rtol=1e-6))

    def test_eager_matches_the_reference(self):
        """iha_eager (plain PyTorch ops) against loom's C++ float64 reference: two implementations of docs/IHA.md
        written apart, on drawn specs with every option."""
        for spec, tensors, gen in drawn_cases(SEED + 1, 8, (1, 9)):
            with self.subTest(spec=spec, q_shape=tuple(tensors[0].shape)):
                out = lt.iha_eager(*tensors, spec)
                self.assertLess(relative(out, iha(*tensors, spec=spec)), 1e-12)
                dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
                want = torch.autograd.grad(out, tensors, dout)
                got = [torch.from_dlpack(g) for g in loom.reference_backward(*[t.detach() for t in tensors], dout,
                                                                              lt.spec_for(spec, torch.float64))]
                for name, g, w in zip(GRADIENTS, got, want):
                    self.assertLess(relative(g, w), 1e-10, name)


class HostKernels(unittest.TestCase):
    """float32 on the CPU: loom's generated forward and backward programs on the host tile API."""

    def test_gradients_match_the_float64_reference_and_eager_autograd(self):
        for spec, exact, gen in drawn_cases(SEED + 2, 4, (2, 24)):
            with self.subTest(spec=spec, q_shape=tuple(exact[0].shape)):
                B, N = exact[0].shape[:2]
                for _ in range(CHECKABLE_DRAWS):
                    dout = torch.randn(B, N, spec["heads"], spec["head_dim"], generator=gen, dtype=torch.float64)
                    want_out = lt.iha_eager(*exact, spec)
                    want = torch.autograd.grad(want_out, exact, dout)
                    if check_share(spec, exact, dout, want) <= CHECKABLE_SHARE:
                        break
                    exact = draw(spec, B, N, torch.float64, gen)
                else:
                    self.fail(f"no draw of {CHECKABLE_DRAWS} whose float32 rounding alone leaves its gradients "
                              "within an eighth of the tolerance")
                launched = {}
                for save in (True, False):  # the backward from the kept forward (the default), and recomputing
                    single = [t.detach().float().requires_grad_() for t in exact]
                    out = iha(*single, spec=spec, save_forward=save)
                    self.assertEqual(out.dtype, torch.float32)
                    start = loom.counters()["launches"]
                    out.backward(dout.float())
                    launched[save] = loom.counters()["launches"] - start
                    self.assertLess(relative(out, want_out), 1e-5)
                    for name, t, w in zip(GRADIENTS, single, want):
                        self.assertEqual(t.grad.dtype, t.dtype, name)
                        self.assertLess(relative(t.grad, w), FLOAT32_GRADIENT_TOLERANCE, f"{name}, save {save}")
                self.assertLess(launched[True], launched[False], "the kept forward's backward recomputed it")

    def test_the_forward_keeps_its_rows_only_for_a_backward(self):
        """save_forward (the default): autograd holds the mixed rows and pseudo-head outputs ([B, H | G, N*P, d],
        float32 on the host); save_forward=False holds none; inference (no_grad) keeps nothing and launches as
        the non-keeping forward does."""
        gen = torch.Generator().manual_seed(SEED + 5)
        spec = {"heads": 4, "kv_heads": 2, "pseudo_heads": 3, "head_dim": 8, "mask": "flat_causal",
                "collapse": "global", "rope_theta": 10000.0}
        B, N = 2, 5
        tensors = draw(spec, B, N, torch.float32, gen)

        def forward(**options):
            start = loom.counters()["launches"]
            out = iha(*tensors, spec=spec, **options)
            return out, loom.counters()["launches"] - start

        kept, _ = forward()
        rows = [tuple(t.shape) for t in kept.grad_fn.saved_tensors if t.dim() == 4 and t.shape[2] == N * 3]
        self.assertEqual(sorted(rows), sorted([(B, 4, N * 3, 8), (B, 2, N * 3, 8), (B, 2, N * 3, 8),
                                               (B, 4, N * 3, 8)]))
        self.assertTrue(all(t.dtype == torch.float32 for t in kept.grad_fn.saved_tensors if t.dim() == 4 and
                            t.shape[2] == N * 3))
        plain, plain_launches = forward(save_forward=False)
        self.assertEqual([t.numel() for t in plain.grad_fn.saved_tensors if t.dim() == 4 and t.shape[2] == N * 3],
                         [])
        with torch.no_grad():
            inferred, inferred_launches = forward()
        self.assertEqual(inferred_launches, plain_launches)
        self.assertLess(relative(inferred, kept), 1e-5)

    def test_strided_inputs_and_a_dout_that_is_a_view(self):
        """q a slice of a wider projection, dout an expanded view (as sum() hands back): both made dense."""
        gen = torch.Generator().manual_seed(SEED + 3)
        spec = {"heads": 2, "kv_heads": 1, "pseudo_heads": 2, "head_dim": 8, "mask": "flat_causal", "window": 0,
                "collapse": "per_head", "rope_theta": 10000.0}
        q64, k, v, *weights = draw(spec, 1, 6, torch.float64, gen)
        wide = torch.randn(1, 6, 4, 8, generator=gen, dtype=torch.float64)
        wide[:, :, :2] = q64.detach()
        wide = wide.float().requires_grad_()
        q = wide[:, :, :2]
        others = [t.detach().float().requires_grad_() for t in (k, v, *weights)]
        iha(q, *others, spec=spec).sum().backward()
        exact = [q.detach().double().requires_grad_()] + [t.detach().double().requires_grad_() for t in others]
        lt.iha_eager(*exact, spec).sum().backward()
        self.assertLess(relative(wide.grad[:, :, :2], exact[0].grad), FLOAT32_GRADIENT_TOLERANCE)
        self.assertEqual(float(wide.grad[:, :, 2:].abs().max()), 0.0)

    def test_errors_name_what_is_wrong(self):
        gen = torch.Generator().manual_seed(SEED + 4)
        spec = {"heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 8, "mask": "none", "window": 0,
                "collapse": "per_head", "rope_theta": 0.0}
        tensors = draw(spec, 1, 3, torch.float32, gen)
        with self.assertRaisesRegex(ValueError, "spec says dtype bfloat16 but q is float32"):
            lt.iha(*tensors, dict(spec, dtype="bfloat16"))
        with self.assertRaisesRegex(ValueError, "alpha_q: dtype torch.float16"):
            lt.iha(*tensors[:3], tensors[3].half(), *tensors[4:], spec)
        with self.assertRaisesRegex(ValueError, "q: want 4 dimensions|q: shape"):
            lt.iha(tensors[0][0], *tensors[1:], spec)
        with self.assertRaisesRegex(ValueError, "k"):
            lt.iha(tensors[0], tensors[1][:, :, :1], *tensors[2:], spec)


class Decode(unittest.TestCase):
    """loom.torch.decode on host tensors over a paged cache under a shuffled page table: a chunked prefill
    (one step of the first tokens into an empty cache), then steps of T = 2 and T = 1, whose rows together are
    the forward's (docs/IHA.md, Decode over a paged cache), for both cache layouts."""

    @staticmethod
    def causal_spec(rng):
        while True:
            spec = random_spec(rng)
            if spec["mask"] != "none":
                return spec

    @staticmethod
    def empty_cache(spec, layout, B, N, page, dtype, device, gen):
        """B sequences' pages for N tokens each under a shuffled table (one spare page), the caches NaN, the
        lengths 0: (page_table, k_cache, v_cache, cache_len)."""
        G, P, d = spec["kv_heads"], spec["pseudo_heads"], spec["head_dim"]
        per = -(-N // page)
        pages = B * per + 1
        table = torch.randperm(pages, generator=gen)[:B * per].view(B, per).to(torch.int32).to(device)
        shape = (pages, page, G, d) if layout == "raw" else (pages, page, G, P, d)
        k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        return table, k_cache, v_cache, torch.zeros(B, dtype=torch.int32, device=device)

    def prefill_then_steps(self, seed, device, dtype, tolerance, head_dims=None):
        """Per layout, two drawn causal specs: the chunked prefill, then the steps, against the float64 eager
        forward; the cache's written slots counted, and (raw) read back as k was projected."""
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        for layout in ("raw", "mixed"):
            for _ in range(2):
                spec = self.causal_spec(rng)
                if head_dims:
                    spec["head_dim"] = rng.choice(head_dims)
                B, page, n0 = 2, rng.choice((1, 3, 16)), rng.randint(1, 8)
                N = n0 + 3
                G, P, d = spec["kv_heads"], spec["pseudo_heads"], spec["head_dim"]
                with self.subTest(spec=spec, layout=layout, page=page, prefill=n0, device=device):
                    tensors = draw(spec, B, N, dtype, gen, requires_grad=False)
                    want = lt.iha_eager(*[t.double() for t in tensors], spec)
                    tensors = [t.to(device) for t in tensors]
                    q, k, v, weights = tensors[0], tensors[1], tensors[2], tensors[3:]
                    table, k_cache, v_cache, cache_len = self.empty_cache(spec, layout, B, N, page, q.dtype, device,
                                                                         gen)
                    outs = []
                    for lo, hi in ((0, n0), (n0, n0 + 2), (n0 + 2, N)):
                        outs.append(lt.decode(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], *weights, k_cache, v_cache,
                                              table, cache_len, spec, cache=layout, cache_dir=CACHE, threads=2))
                        cache_len += hi - lo
                    self.assertLess(relative(torch.cat(outs, dim=1).cpu(), want.cpu()), tolerance)
                    filled = int(torch.isfinite(k_cache).flatten(2).all(dim=2).sum())
                    self.assertEqual(filled, B * N, "cache slots written: one per token")
                    if layout == "raw":
                        slots = [table[b, t // page] * page + t % page for b in range(B) for t in range(N)]
                        got = k_cache.flatten(0, 1)[torch.tensor(slots, dtype=torch.long, device=device)]
                        self.assertTrue(torch.equal(got.view(B, N, G, d), k), "the raw cache holds k as projected")

    def test_prefill_then_steps_give_the_forwards_rows(self):
        self.prefill_then_steps(SEED + 7, "cpu", torch.float32, 1e-5)

    def test_a_shared_prompt_is_one_copy_of_its_pages(self):
        """Prefix caching: three sequences open with one prompt, prefilled once into pages every page table
        names; then steps of each sequence's own tokens (T = 2, then 1) append to pages it owns. Every row
        equals the forward's over that sequence, and the shared pages stay as the prefill left them."""
        rng = random.Random(SEED + 11)
        gen = torch.Generator().manual_seed(SEED + 11)
        for layout in ("raw", "mixed"):
            spec = self.causal_spec(rng)
            B, page, shared = 3, rng.choice((1, 2, 4)), rng.randint(1, 3)
            n0 = shared * page
            N = n0 + 3
            G, P, d = spec["kv_heads"], spec["pseudo_heads"], spec["head_dim"]
            with self.subTest(spec=spec, layout=layout, page=page, shared=shared):
                q, k, v, *weights = draw(spec, B, N, torch.float32, gen, requires_grad=False)
                for x in (q, k, v):
                    x[1:, :n0] = x[0, :n0]  # the prompt
                want = lt.iha_eager(q.double(), k.double(), v.double(), *[w.double() for w in weights], spec)
                per = -(-N // page)
                pages = torch.randperm(shared + B * (per - shared) + 1, generator=gen).to(torch.int32)
                own = pages[shared:shared + B * (per - shared)].view(B, per - shared)
                table = torch.cat([pages[:shared].expand(B, shared), own], dim=1).contiguous()
                shape = (len(pages), page, G, d) if layout == "raw" else (len(pages), page, G, P, d)
                k_cache = torch.full(shape, float("nan"))
                v_cache = torch.full(shape, float("nan"))
                run = dict(cache=layout, cache_dir=CACHE, threads=2)
                prompt = lt.decode(q[:1, :n0], k[:1, :n0], v[:1, :n0], *weights, k_cache, v_cache, table[:1],
                                   torch.zeros(1, dtype=torch.int32), spec, **run)
                self.assertLess(relative(prompt, want[:1, :n0]), 1e-5)
                prefix = [c[pages[:shared].long()].clone() for c in (k_cache, v_cache)]
                cache_len = torch.full((B,), n0, dtype=torch.int32)
                outs = []
                for lo, hi in ((n0, n0 + 2), (n0 + 2, N)):
                    outs.append(lt.decode(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], *weights, k_cache, v_cache, table,
                                          cache_len, spec, **run))
                    cache_len += hi - lo
                self.assertLess(relative(torch.cat(outs, dim=1), want[:, n0:]), 1e-5)
                for before, c in zip(prefix, (k_cache, v_cache)):
                    self.assertTrue(torch.equal(c[pages[:shared].long()], before), "the shared pages are read only")
                filled = int(torch.isfinite(k_cache).flatten(2).all(dim=2).sum())
                self.assertEqual(filled, n0 + B * (N - n0), "one slot a token, the prompt's once")
                # A step that would write into the prompt's pages: refused, naming both entries.
                with self.assertRaisesRegex(Exception, r"page_table\[1\]\[%d\] is page %d, which page_table\[0\]"
                                            r"\[%d\] uses too; the step writes" % (shared - 1, int(pages[shared - 1]),
                                                                                    shared - 1)):
                    lt.decode(q[:, :1], k[:, :1], v[:, :1], *weights, k_cache, v_cache, table,
                              torch.tensor([N - 1, n0 - 1, N - 1], dtype=torch.int32), spec, **run)

    def ragged_steps(self, seed, device, dtype, tolerance, head_dims=None):
        """loom.torch.paged_attention: three sequences through three ragged steps, each step mixing prefill
        chunks (several pages), single decode tokens and sequences bringing nothing; every sequence's rows
        together are the float64 eager forward's over it, each slot written once, for both cache layouts."""
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        for layout in ("raw", "mixed"):
            spec = self.causal_spec(rng)
            if head_dims:
                spec["head_dim"] = rng.choice(head_dims)
            B, page = 3, rng.choice((2, 3, 4))
            N = 3 * page + 3
            # Each sequence's new tokens a step: a chunk of pages, one token, none, the rest.
            plans = [(2 * page + 1, 1, N - 2 * page - 2), (0, page + 2, N - page - 2), (1, 0, N - 1)]
            G, P, d = spec["kv_heads"], spec["pseudo_heads"], spec["head_dim"]
            with self.subTest(spec=spec, layout=layout, page=page, device=device):
                tensors = draw(spec, B, N, dtype, gen, requires_grad=False)
                want = lt.iha_eager(*[t.double() for t in tensors], spec)
                tensors = [t.to(device) for t in tensors]
                q, k, v, weights = tensors[0], tensors[1], tensors[2], tensors[3:]
                table, k_cache, v_cache, cache_len = self.empty_cache(spec, layout, B, N, page, q.dtype, device, gen)
                outs = [[] for _ in range(B)]
                for step in range(3):
                    counts = [plans[b][step] for b in range(B)]
                    lo = cache_len.tolist()
                    rows = [(b, lo[b], lo[b] + counts[b]) for b in range(B)]
                    packed = [torch.cat([x[b, a:z] for b, a, z in rows]) for x in (q, k, v)]
                    starts = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32, device=device)
                    out = lt.paged_attention(*packed, *weights, k_cache, v_cache, table, cache_len, starts, spec,
                                             cache=layout, cache_dir=CACHE, threads=2)
                    self.assertEqual(tuple(out.shape), (sum(counts), spec["heads"], d))
                    for b, part in enumerate(out.split(counts)):
                        outs[b].append(part)
                    cache_len += torch.tensor(counts, dtype=torch.int32, device=device)
                got = torch.stack([torch.cat(o) for o in outs])
                self.assertLess(relative(got.cpu(), want.cpu()), tolerance)
                filled = int(torch.isfinite(k_cache).flatten(2).all(dim=2).sum())
                self.assertEqual(filled, B * N, "cache slots written: one per token")

    def test_ragged_steps_mix_prefill_and_decode(self):
        self.ragged_steps(SEED + 13, "cpu", torch.float32, 1e-5)

    def test_ragged_errors_name_what_is_wrong(self):
        spec = {"heads": 2, "kv_heads": 1, "pseudo_heads": 2, "head_dim": 8, "mask": "flat_causal",
                "collapse": "per_head"}
        gen = torch.Generator().manual_seed(SEED)
        q, k, v, *weights = draw(spec, 1, 3, torch.float32, gen, requires_grad=False)
        q, k, v = q[0], k[0], v[0]  # three packed tokens
        k_cache, v_cache = torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8)
        table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
        lengths = torch.tensor([3, 1], dtype=torch.int32)
        run = dict(cache_dir=CACHE, threads=2)
        good = torch.tensor([0, 2, 3], dtype=torch.int32)
        lt.paged_attention(q, k, v, *weights, k_cache, v_cache, table, lengths, good, spec, **run)
        before = k_cache.clone()
        for starts, words in (([0, 3, 2], r"query_start_loc\[2\] is 2, below query_start_loc\[1\] 3"),
                              ([0, 1, 2], r"query_start_loc\[2\] is 2, but q packs 3 tokens"),
                              ([1, 2, 3], r"query_start_loc\[0\] is 1")):
            with self.assertRaisesRegex(ValueError, words):
                lt.paged_attention(q, k, v, *weights, k_cache, v_cache, table, lengths,
                                   torch.tensor(starts, dtype=torch.int32), spec, **run)
        with self.assertRaisesRegex(ValueError, r"page_table and cache_len: want one row / entry per sequence"):
            lt.paged_attention(q, k, v, *weights, k_cache, v_cache, table[:1], lengths[:1], good, spec, **run)
        with self.assertRaisesRegex(ValueError, r"packs its sequences' new tokens, \[total, H, d\]"):
            lt.paged_attention(q[None], k[None], v[None], *weights, k_cache, v_cache, table, lengths, good, spec,
                               **run)
        with self.assertRaisesRegex(ValueError, r"sequence 0 brings 2 new tokens, more than the step's most, 1"):
            lt.paged_attention(q, k, v, *weights, k_cache, v_cache, table, lengths, good, spec, max_query_len=1,
                               **run)
        self.assertTrue(torch.equal(k_cache, before), "a refused step writes nothing")

    @unittest.skipUnless(torch.cuda.is_available() and loom.devices(),
                         "no CUDA device for PyTorch and loom here (" + (loom.gpu_error()[:80] or "torch sees none")
                         + ")")
    def test_cuda_ragged_steps_run_the_decode_kernel(self):
        self.ragged_steps(SEED + 15, "cuda", torch.bfloat16, 3e-2, head_dims=(16, 64))

    @unittest.skipUnless(torch.cuda.is_available() and loom.devices(),
                         "no CUDA device for PyTorch and loom here (" + (loom.gpu_error()[:80] or "torch sees none")
                         + ")")
    def test_cuda_tensors_run_the_decode_kernel(self):
        # loom's CUDA kernels take the 16-bit dtypes and head dims of multiples of 8.
        self.prefill_then_steps(SEED + 9, "cuda", torch.bfloat16, 3e-2, head_dims=(16, 64))

    def test_errors_name_what_is_wrong(self):
        spec = {"heads": 2, "kv_heads": 1, "pseudo_heads": 2, "head_dim": 8, "mask": "flat_causal", "collapse": "per_head"}
        gen = torch.Generator().manual_seed(SEED)
        q, k, v, *weights = draw(spec, 1, 1, torch.float32, gen, requires_grad=False)
        k_cache, v_cache = torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8)
        table, lengths = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
        lt.decode(q, k, v, *weights, k_cache, v_cache, table, lengths, spec, cache_dir=CACHE, threads=2)
        with self.assertRaisesRegex(Exception, "page_table: dtype must be int32"):
            lt.decode(q, k, v, *weights, k_cache, v_cache, table.long(), lengths, spec, cache_dir=CACHE)
        with self.assertRaisesRegex(Exception, r"page_table\[0\]\[1\] is 7, outside the cache's 4 pages"):
            lt.decode(q, k, v, *weights, k_cache, v_cache, torch.tensor([[2, 7]], dtype=torch.int32),
                      torch.tensor([4], dtype=torch.int32), spec, cache_dir=CACHE)
        with self.assertRaisesRegex(Exception, "k_cache: want"):
            lt.decode(q, k, v, *weights, k_cache, v_cache, table, lengths, spec, cache="mixed", cache_dir=CACHE)


class Layer(unittest.TestCase):
    def test_parameters_are_the_documented_ones(self):
        layer = lt.InterleavedHeadAttention(32, heads=4, pseudo_heads=3, kv_heads=2, head_dim=8, collapse="global")
        shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
        self.assertEqual(shapes, {"q_proj.weight": (32, 32), "k_proj.weight": (16, 32), "v_proj.weight": (16, 32),
                                  "out_proj.weight": (32, 32), "alpha_q": (4, 4, 3), "alpha_k": (2, 2, 3),
                                  "alpha_v": (2, 2, 3), "collapse": (4, 12)})
        # Near the identity on the head axes; collapse 1/P on each head's own pseudo heads.
        identity = torch.eye(4)[:, :, None].expand(4, 4, 3)
        self.assertLess(float((layer.alpha_q - identity).abs().mean()), 0.2)
        self.assertTrue(torch.allclose(layer.collapse.view(4, 4, 3).sum(-1), torch.eye(4)))

    def test_loom_and_eager_layers_agree_forward_and_backward(self):
        rng = random.Random(SEED + 5)
        torch.manual_seed(SEED + 5)
        for _ in range(2):
            spec = random_spec(rng, head_dims=(8, 16))
            options = {k: spec[k] for k in ("mask", "window", "collapse", "rope_theta")}
            options.update({k: spec[k] for k in ("rope_direction", "window_align", "window_rows", "scale")
                            if k in spec})
            options["qk_norm"] = spec.get("qk_norm") == "rms"
            with self.subTest(spec=spec):
                layer = lt.InterleavedHeadAttention(24, spec["heads"], spec["pseudo_heads"], spec["kv_heads"],
                                                    spec["head_dim"], cache_dir=CACHE, threads=2, **options)
                eager = lt.InterleavedHeadAttention(24, spec["heads"], spec["pseudo_heads"], spec["kv_heads"],
                                                    spec["head_dim"], backend="eager", **options).double()
                eager.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
                # The same eager layer in float32: the projections around the kernel round in
                # float32 in both float32 layers, and a small parameter's gradient (alpha_v of
                # one head is two numbers, each a sum over every token) can lose more than 1e-5
                # to that alone; loom's may be off by 1e-5 or by what PyTorch's float32 loses
                # (four times over), whichever is more.
                eager32 = lt.InterleavedHeadAttention(24, spec["heads"], spec["pseudo_heads"], spec["kv_heads"],
                                                      spec["head_dim"], backend="eager", **options)
                eager32.load_state_dict(layer.state_dict())
                x = torch.randn(2, rng.randint(2, 12), 24)
                y = layer(x)
                y_eager = eager(x.double())
                self.assertEqual(y.shape, x.shape)
                self.assertLess(relative(y, y_eager), 1e-5)
                dy = torch.randn_like(y)
                y.backward(dy)
                y_eager.backward(dy.double())
                eager32(x).backward(dy)
                for (name, p), (_, p_eager), (_, p32) in zip(layer.named_parameters(), eager.named_parameters(),
                                                            eager32.named_parameters()):
                    floor = 4 * relative(p32.grad, p_eager.grad)
                    self.assertLess(relative(p.grad, p_eager.grad), max(FLOAT32_GRADIENT_TOLERANCE, floor), name)

    def test_qwen_norm_and_output_gate_follow_their_public_descriptions(self):
        """qk_norm_position="before_mixing" and gate=..., against a layer written here from the public
        descriptions alone: Qwen3's attention (q_norm and k_norm, RMSNorm over head_dim with a learned weight,
        on each projected head before anything else) and gated attention's G1 gate (Qiu et al., 2025: the
        attention output times sigmoid(x W_g), x the attention's input, one gate a head or a head and channel),
        around IHA written out (token-major pseudo-heads, RoPE at row n*P + p turning the usual way, causal
        over the interleaved rows, a per-head collapse). float64 (loom's float64 reference) to 1e-10 in the
        output and every gradient; float32 (the generated program on the host) to float32's tolerances."""
        torch.manual_seed(SEED + 12)
        dim, H, G, P, d, base, eps = 24, 4, 2, 3, 8, 500.0, 1e-6

        def written_out(layer, x):
            B, N, _ = x.shape
            q = layer.q_proj(x).view(B, N, H, d)
            k = layer.k_proj(x).view(B, N, G, d)
            v = layer.v_proj(x).view(B, N, G, d)
            rms = lambda t, w: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w  # Qwen3RMSNorm
            q, k = rms(q, layer.q_norm.weight), rms(k, layer.k_norm.weight)
            mix = lambda t, a: torch.einsum("bnmd,mhp->bnphd", t, a).reshape(B, N * P, a.shape[1], d)
            qs, ks, vs = mix(q, layer.alpha_q), mix(k, layer.alpha_k), mix(v, layer.alpha_v)
            angle = torch.arange(N * P, dtype=x.dtype)[:, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
            cos, sin = torch.cos(angle)[None, :, None, :], torch.sin(angle)[None, :, None, :]
            turn = lambda t: torch.cat([t[..., :d // 2] * cos - t[..., d // 2:] * sin,
                                        t[..., :d // 2] * sin + t[..., d // 2:] * cos], dim=-1)
            qs, ks = turn(qs), turn(ks)
            ks, vs = ks.repeat_interleave(H // G, dim=2), vs.repeat_interleave(H // G, dim=2)
            scores = torch.einsum("bihd,bjhd->bhij", qs, ks) / d ** 0.5
            causal = torch.ones(N * P, N * P, dtype=torch.bool).tril()
            weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            o = torch.einsum("bhij,bjhd->bihd", weights, vs).reshape(B, N, P, H, d)
            o = torch.einsum("hp,bnphd->bnhd", layer.collapse, o)
            g = torch.sigmoid(layer.gate_proj(x))
            o = o * (g.view(B, N, H, d) if layer.gate == "elementwise" else g[..., None])
            return layer.out_proj(o.reshape(B, N, H * d))

        for gate in ("headwise", "elementwise"):
            with self.subTest(gate=gate):
                layer = lt.InterleavedHeadAttention(dim, H, P, G, d, rope_theta=base, qk_norm=True, qk_norm_eps=eps,
                                                    qk_norm_position="before_mixing", gate=gate, bias=True,
                                                    cache_dir=CACHE, threads=2)
                self.assertEqual(tuple(layer.gate_proj.weight.shape), (H * d if gate == "elementwise" else H, dim))
                self.assertEqual(tuple(layer.q_norm.weight.shape), (d,))
                with torch.no_grad():  # weights away from their initial ones, so each gradient is exercised
                    for p in layer.parameters():
                        p.add_(0.2 * torch.randn_like(p))
                x = torch.randn(2, 7, dim)
                for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, FLOAT32_GRADIENT_TOLERANCE)):
                    layer.zero_grad()
                    model = layer.to(dtype)
                    mine = lt.InterleavedHeadAttention(dim, H, P, G, d, rope_theta=base, qk_norm=True,
                                                       qk_norm_eps=eps, qk_norm_position="before_mixing", gate=gate,
                                                       bias=True).double()
                    mine.load_state_dict({k: t.double() for k, t in model.state_dict().items()})
                    y, want = model(x.to(dtype)), written_out(mine, x.double())
                    self.assertLess(relative(y, want), 1e-10 if dtype == torch.float64 else 1e-5, str(dtype))
                    dy = torch.randn_like(want)
                    y.backward(dy.to(dtype))
                    want.backward(dy)
                    for (name, p), (_, p_want) in zip(model.named_parameters(), mine.named_parameters()):
                        self.assertLess(relative(p.grad, p_want.grad), tolerance, f"{dtype} {name}")
        with self.assertRaisesRegex(ValueError, "give qk_norm=True"):
            lt.InterleavedHeadAttention(dim, H, P, G, d, qk_norm_position="before_mixing")
        with self.assertRaisesRegex(ValueError, "gate: 'sigmoid'"):
            lt.InterleavedHeadAttention(dim, H, P, G, d, gate="sigmoid")

    def test_a_few_steps_lower_the_loss(self):
        torch.manual_seed(SEED + 6)
        layer = lt.InterleavedHeadAttention(16, 2, 2, head_dim=8, cache_dir=CACHE, threads=2)
        x, target = torch.randn(4, 10, 16), torch.randn(4, 10, 16)
        optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
        losses = []
        for _ in range(20):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(layer(x), target)
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
        self.assertLess(losses[-1], 0.9 * losses[0], losses)


class Varlen(unittest.TestCase):
    """loom.torch.iha_varlen (docs/IHA.md, Varlen): documents packed as flash_attn_varlen_func takes them give,
    per document, iha of that document alone, forward and backward (the weights' gradients summed), in float64
    (the reference; gradcheck too) and float32 (the host kernels); its ops pass opcheck."""

    def documents(self, rng, total):
        cuts = sorted(rng.sample(range(1, total), min(rng.randint(1, 3), total - 1)))
        return [0, *cuts, total]

    def test_packed_documents_are_each_alone(self):
        rng = random.Random(SEED + 40)
        for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, FLOAT32_GRADIENT_TOLERANCE)):
            for spec, exact, gen in drawn_cases(SEED + 41 + int(dtype == torch.float32), 3, (2, 16)):
                bounds = self.documents(rng, exact[0].shape[1])
                with self.subTest(dtype=dtype, spec=spec, cu_seqlens=bounds):
                    weights = torch.float64 if dtype == torch.float64 else torch.float32
                    packed = [(t[0] if i < 3 else t).detach().to(dtype if i < 3 else weights).requires_grad_()
                              for i, t in enumerate(exact)]
                    cu = torch.tensor(bounds, dtype=torch.int32)
                    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
                    out = lt.iha_varlen(*packed, cu, longest, spec, cache_dir=CACHE, threads=2)
                    self.assertEqual(tuple(out.shape), (bounds[-1], spec["heads"], spec["head_dim"]))
                    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
                    got = torch.autograd.grad(out, packed, dout)
                    want_grads = [torch.zeros_like(t) for t in packed]
                    for a, b in zip(bounds, bounds[1:]):
                        alone = [(t[a:b].unsqueeze(0) if i < 3 else t).detach().requires_grad_()
                                 for i, t in enumerate(packed)]
                        piece = iha(*alone, spec=spec)
                        self.assertLess(relative(out[a:b], piece[0]), tolerance, f"out of tokens {a}..{b}")
                        for i, g in enumerate(torch.autograd.grad(piece, alone, dout[a:b].unsqueeze(0))):
                            if i < 3:
                                want_grads[i][a:b] = g[0]
                            else:
                                want_grads[i] += g
                    for name, g, w in zip(GRADIENTS, got, want_grads):
                        self.assertLess(relative(g, w), tolerance, name)

    def test_gradcheck(self):
        rng = random.Random(SEED + 43)
        for spec, exact, _ in drawn_cases(SEED + 43, 2, (2, 5), head_dims=(8,)):
            bounds = self.documents(rng, exact[0].shape[1])
            packed = [(t[0] if i < 3 else t).detach().requires_grad_() for i, t in enumerate(exact)]
            cu = torch.tensor(bounds, dtype=torch.int32)
            with self.subTest(spec=spec, cu_seqlens=bounds):
                self.assertTrue(torch.autograd.gradcheck(
                    lambda *t: lt.iha_varlen(*t, cu, bounds[-1], spec, cache_dir=CACHE), packed, eps=1e-6,
                    atol=1e-8, rtol=1e-6))

    def test_errors_name_what_is_wrong(self):
        spec, exact, _ = next(drawn_cases(SEED + 44, 1, (4, 6)))
        packed = [(t[0] if i < 3 else t).detach().float() for i, t in enumerate(exact)]
        total = packed[0].shape[0]
        with self.assertRaisesRegex(ValueError, "cu_seqlens: want int32"):
            lt.iha_varlen(*packed, torch.tensor([0, total]), total, spec, cache_dir=CACHE)
        with self.assertRaisesRegex(ValueError, "must be the tokens packed"):
            lt.iha_varlen(*packed, torch.tensor([0, total + 1], dtype=torch.int32), total, spec, cache_dir=CACHE)
        with self.assertRaisesRegex(ValueError, "never decrease"):
            lt.iha_varlen(*packed, torch.tensor([0, 3, 2, total], dtype=torch.int32), total, spec, cache_dir=CACHE)

    def test_a_packed_training_step_is_the_per_document_loop(self):
        """One SGD step of an IHA layer on a packed batch (loom's host kernels) against the same step taken as a
        loop over the documents, each a batch of one: the same parameters after the step."""
        rng = random.Random(SEED + 46)
        torch.manual_seed(SEED + 46)
        layer = lt.InterleavedHeadAttention(16, heads=2, pseudo_heads=2, kv_heads=2, head_dim=8,
                                            mask=rng.choice(("flat_causal", "token_causal")), window=rng.choice((0, 3)),
                                            qk_norm=rng.random() < 0.5, cache_dir=CACHE, threads=2)
        looped = lt.InterleavedHeadAttention(16, heads=2, pseudo_heads=2, kv_heads=2, head_dim=8,
                                             mask=layer.spec["mask"], window=layer.spec["window"],
                                             qk_norm="qk_norm" in layer.spec, cache_dir=CACHE, threads=2)
        looped.load_state_dict(layer.state_dict())
        total = rng.randint(6, 20)
        bounds = self.documents(rng, total)
        x = torch.randn(total, 16)
        target = torch.randn(total, 16)
        cu = torch.tensor(bounds, dtype=torch.int32)
        step = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (layer, looped)]
        ((layer(x, cu, max(b - a for a, b in zip(bounds, bounds[1:]))) - target) ** 2).sum().backward()
        loss = sum(((looped(x[a:b][None])[0] - target[a:b]) ** 2).sum() for a, b in zip(bounds, bounds[1:]))
        loss.backward()
        for name, p in layer.named_parameters():
            other = dict(looped.named_parameters())[name]
            self.assertLess(relative(p.grad, other.grad), 1e-5, name)
        for s in step:
            s.step()
        for name, p in layer.named_parameters():
            self.assertLess(relative(p, dict(looped.named_parameters())[name]), 1e-6, name)
        # The eager layer packs the same way.
        layer.backend = "eager"
        with torch.no_grad():
            self.assertLess(relative(layer(x, cu), torch.cat([looped(x[a:b][None])[0]
                                                             for a, b in zip(bounds, bounds[1:])])), 1e-5)

    @unittest.skipUnless(lt.HAS_CUSTOM_OP, "torch.library.custom_op needs PyTorch 2.4 or later")
    def test_opcheck(self):
        gen = torch.Generator().manual_seed(SEED + 45)
        spec = random_spec(random.Random(SEED + 45))
        spec["head_dim"] = 8
        tensors = draw(spec, 1, 7, torch.float32, gen)
        packed = [(t[0] if i < 3 else t).detach() for i, t in enumerate(tensors)]
        spec_json = json.dumps({**lt.spec_for(spec, torch.float32), "varlen": True}, sort_keys=True)
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        options = (spec_json, None, None, CACHE, "", 2, False)
        for save in (True, False):
            torch.library.opcheck(torch.ops.loom.iha_varlen.default,
                                  (*[t.detach().requires_grad_() for t in packed], cu, *options, save))
        plain = [t.detach() for t in packed]
        _, lse, *rows = torch.ops.loom.iha_varlen.default(*plain, cu, *options, True)
        dout = torch.randn(7, spec["heads"], 8, generator=gen)
        for keep in (True, False):
            torch.library.opcheck(torch.ops.loom.iha_varlen_backward.default,
                                  (*plain, cu, dout, spec_json, None, CACHE, "", 2, True, *rows, lse, keep))


@unittest.skipUnless(lt.HAS_CUSTOM_OP, f"PyTorch {torch.__version__} has no torch.library.custom_op (2.4 and later): "
                                       "loom.torch.iha is an autograd.Function there")
class Compile(unittest.TestCase):
    """PyTorch 2: every loom op a custom op passing torch.library.opcheck, and torch.compile tracing loom.torch
    without a graph break (fullgraph), forward and backward as eager, dynamic shapes without a recompile a
    shape, and a decode loop."""

    def setUp(self):
        torch._dynamo.reset()
        self.rng = random.Random(SEED + 30)
        self.gen = torch.Generator().manual_seed(SEED + 30)

    def spec(self):
        spec = random_spec(self.rng)
        spec["head_dim"] = 8
        return spec

    def test_opcheck_every_op(self):
        spec = self.spec()
        tensors = draw(spec, 2, 6, torch.float32, self.gen)
        spec_json = json.dumps(lt.spec_for(spec, torch.float32), sort_keys=True)
        options = (spec_json, None, None, CACHE, "", 2, False)
        for save in (True, False):  # the forward keeping its rows for the backward, and not
            torch.library.opcheck(torch.ops.loom.iha.default, (*tensors, *options, save))
        plain = [t.detach() for t in tensors]
        _, lse, *rows = torch.ops.loom.iha.default(*plain, *options, True)
        dout = torch.randn(2, 6, spec["heads"], 8, generator=self.gen)
        for keep in (True, False):
            torch.library.opcheck(torch.ops.loom.iha_backward.default,
                                  (*plain, dout, spec_json, None, CACHE, "", 2, True, *rows, lse, keep))
        G, page = spec["kv_heads"], 4
        k_cache, v_cache = (torch.randn(8, page, G, 8, generator=self.gen) for _ in range(2))
        table = torch.randperm(8, generator=self.gen)[:6].view(2, 3).to(torch.int32)
        lengths = torch.tensor([3, 7], dtype=torch.int32)
        step = [t[:, :1].contiguous() for t in plain[:3]]
        torch.library.opcheck(torch.ops.loom.decode.default,
                              (*step, *plain[3:], k_cache, v_cache, table, lengths, None, spec_json, "raw", None,
                               CACHE, "", 2, True))
        # A ragged step: sequence 0 brings two tokens, sequence 1 one.
        packed = [torch.cat([t[0, :2], t[1, :1]]).contiguous() for t in plain[:3]]
        starts = torch.tensor([0, 2, 3], dtype=torch.int32)
        torch.library.opcheck(torch.ops.loom.paged_attention.default,
                              (*packed, *plain[3:], k_cache, v_cache, table, lengths, starts, 2, spec_json, "raw",
                               None, CACHE, "", 2, True))

    def test_fullgraph_forward_and_backward_match_eager(self):
        for _ in range(2):
            spec = self.spec()
            tensors = draw(spec, 2, 9, torch.float32, self.gen)
            with self.subTest(spec=spec):
                def loss(*t):
                    out, lse = iha(*t, spec=spec, return_lse=True)
                    return out.square().sum() + 1e-3 * lse.detach().sum()

                explained = torch._dynamo.explain(loss)(*tensors)
                self.assertEqual(explained.graph_break_count, 0, explained.break_reasons)
                compiled = torch.compile(loss, fullgraph=True)
                value = compiled(*tensors)
                value.backward()
                eager = [t.detach().clone().requires_grad_() for t in tensors]
                want = loss(*eager)
                want.backward()
                self.assertLess(abs(float(value) - float(want)) / abs(float(want)), 1e-5)
                exact = [t.detach().double().requires_grad_() for t in tensors]
                lt.iha_eager(*exact, spec).square().sum().backward()
                for name, t, e, w in zip(GRADIENTS, tensors, eager, exact):
                    self.assertLess(relative(t.grad, e.grad), FLOAT32_GRADIENT_TOLERANCE, f"{name} against eager")
                    self.assertLess(relative(t.grad, w.grad), 1e-4, f"{name} against float64")

    def test_a_model_under_dynamic_shapes_compiles_at_most_twice(self):
        """A model of two IHA layers over a sweep of batch sizes and lengths under dynamic=True: outputs and
        gradients as the eager model's, one or two graphs in all."""
        from torch._dynamo.utils import counters
        torch.manual_seed(SEED + 33)
        spec = self.spec()
        layers = [lt.InterleavedHeadAttention(32, spec["heads"], spec["pseudo_heads"], kv_heads=spec["kv_heads"],
                                              head_dim=8, mask=spec["mask"], collapse=spec["collapse"],
                                              rope_theta=spec["rope_theta"], cache_dir=CACHE, threads=2)
                  for _ in range(2)]
        model = torch.nn.Sequential(*layers)
        compiled = torch.compile(model, fullgraph=True, dynamic=True)
        counters.clear()
        sweep = [(1, 5), (1, 9), (2, 13), (1, 21), (2, 30), (3, 17)]
        for B, N in sweep:
            x = torch.randn(B, N, 32)
            got = compiled(x)
            got.square().sum().backward()
            compiled_grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            want = model(x)
            want.square().sum().backward()
            self.assertLess(relative(got, want), 1e-5, f"B {B} N {N}")
            for (name, p), g in zip(model.named_parameters(), compiled_grads):
                self.assertLess(relative(g, p.grad), 1e-5, f"B {B} N {N} {name}")
            model.zero_grad()
        frames = counters["stats"]["unique_graphs"]
        print(f"[ compile ] {len(sweep)} shapes under dynamic=True: {frames} graph(s) compiled")
        self.assertLessEqual(frames, 2)

    def test_a_decode_loop_compiles(self):
        spec = self.spec()
        spec["mask"] = "flat_causal"
        B, N, page = 2, 7, 4
        G, d = spec["kv_heads"], spec["head_dim"]
        tensors = [t.detach() for t in draw(spec, B, N, torch.float32, self.gen)]
        q, k, v, weights = tensors[0], tensors[1], tensors[2], tensors[3:]
        pages = B * (-(-N // page))
        table = torch.randperm(pages, generator=self.gen).view(B, -1).to(torch.int32)

        def run(step):
            k_cache = torch.zeros(pages, page, G, d)
            v_cache = torch.zeros(pages, page, G, d)
            lengths = torch.zeros(B, dtype=torch.int32)
            outs = []
            for t in range(N):
                outs.append(step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], k_cache, v_cache, lengths))
                lengths += 1
            return torch.cat(outs, dim=1), k_cache

        def step(qs, ks, vs, k_cache, v_cache, lengths):
            return lt.decode(qs, ks, vs, *weights, k_cache, v_cache, table, lengths, spec, cache_dir=CACHE, threads=2)

        compiled = torch.compile(step, fullgraph=True)
        got, got_cache = run(compiled)
        want, want_cache = run(step)
        self.assertTrue(torch.equal(got, want), "compiled steps differ from eager ones")
        self.assertTrue(torch.equal(got_cache, want_cache), "the compiled steps' appends differ")
        self.assertLess(relative(got, lt.iha_eager(*[t.double() for t in tensors], spec)), 1e-5)


class Schedules(unittest.TestCase):
    """A schedule a direction, and a deterministic backward (any PyTorch)."""

    def test_a_forward_schedule_the_backward_refuses_goes_to_the_forward_only(self):
        gen = torch.Generator().manual_seed(SEED + 31)
        spec = {"heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 64, "mask": "flat_causal",
                "collapse": "per_head", "rope_theta": 10000.0}
        tensors = draw(spec, 1, 9, torch.float32, gen)
        out = lt.iha(*tensors, spec, schedule={"engine": "engine_wgmma", "mix": "mix_fused"}, cache_dir=CACHE,
                     threads=2)
        out.square().sum().backward()
        exact = [t.detach().double().requires_grad_() for t in tensors]
        lt.iha_eager(*exact, spec).square().sum().backward()
        for name, t, w in zip(GRADIENTS, tensors, exact):
            self.assertLess(relative(t.grad, w.grad), 1e-4, name)
        with self.assertRaisesRegex(ValueError, "wgmma|engine"):  # the backward's own rules
            lt.iha(*[t.detach().clone().requires_grad_() for t in tensors], spec, cache_dir=CACHE, threads=2,
                   backward_schedule={"engine": "engine_wgmma"}).sum().backward()

    def test_deterministic_backward_is_bit_identical(self):
        gen = torch.Generator().manual_seed(SEED + 32)
        rng = random.Random(SEED + 32)
        spec = random_spec(rng)
        tensors = draw(spec, 2, 40, torch.float32, gen)
        dout = torch.randn(2, 40, spec["heads"], spec["head_dim"], generator=gen)

        def gradients(**options):
            leaves = [t.detach().clone().requires_grad_() for t in tensors]
            lt.iha(*leaves, spec, cache_dir=CACHE, threads=4, **options).backward(dout)
            return [t.grad for t in leaves]

        first, second = gradients(deterministic=True), gradients(deterministic=True)
        for name, a, b in zip(GRADIENTS, first, second):
            self.assertTrue(torch.equal(a, b), f"d{name} differs between two deterministic backwards")
        torch.use_deterministic_algorithms(True)
        try:
            third = gradients()
            with self.assertRaisesRegex(ValueError, "dq_separate"):
                gradients(backward_schedule={"dq": "dq_atomic"})
        finally:
            torch.use_deterministic_algorithms(False)
        for name, a, b in zip(GRADIENTS, first, third):
            self.assertTrue(torch.equal(a, b), f"d{name}: use_deterministic_algorithms gives another result")


class Cuda(unittest.TestCase):
    @unittest.skipUnless(torch.cuda.is_available() and loom.devices(),
                         "no CUDA device for PyTorch and loom here (" + (loom.gpu_error()[:80] or "torch sees none")
                         + ")")
    def test_bfloat16_layer_matches_eager_in_float64(self):
        torch.manual_seed(SEED + 8)
        layer = lt.InterleavedHeadAttention(256, 4, 2, kv_heads=2, head_dim=64, cache_dir=CACHE).cuda()
        eager = lt.InterleavedHeadAttention(256, 4, 2, kv_heads=2, head_dim=64, backend="eager").double().cuda()
        eager.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
        x = torch.randn(2, 100, 256, device="cuda")
        y = layer(x)
        y_eager = eager(x.double())
        self.assertLess(relative(y, y_eager), 3e-2)
        y.backward(torch.ones_like(y))
        y_eager.backward(torch.ones_like(y_eager))
        for (name, p), (_, p_eager) in zip(layer.named_parameters(), eager.named_parameters()):
            self.assertLess(relative(p.grad, p_eager.grad), 3e-2, name)


@unittest.skipUnless(torch.cuda.is_available() and loom.devices() and lt.HAS_CUSTOM_OP,
                     "no CUDA device for PyTorch and loom, or PyTorch before 2.4, here (" +
                     (loom.gpu_error()[:80] or f"torch {torch.__version__}") + ")")
class CudaOps(unittest.TestCase):
    """The PyTorch 2 checks on CUDA tensors: opcheck on the ops, torch.compile fullgraph forward and backward
    against eager, and a deterministic backward bit-identical run to run."""

    spec = {"heads": 4, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 64, "mask": "flat_causal",
            "collapse": "per_head", "rope_theta": 10000.0}

    def inputs(self, gen, B, N):
        return [t.detach().to("cuda", torch.bfloat16 if i < 3 else torch.float32).requires_grad_()
                for i, t in enumerate(draw(self.spec, B, N, torch.float64, gen, requires_grad=False))]

    def test_opcheck_compile_and_determinism(self):
        gen = torch.Generator().manual_seed(SEED + 40)
        tensors = self.inputs(gen, 2, 77)
        spec_json = json.dumps(lt.spec_for(self.spec, torch.bfloat16), sort_keys=True)
        for save in (True, False):
            torch.library.opcheck(torch.ops.loom.iha.default,
                                  (*tensors, spec_json, None, None, CACHE, "", 0, False, save))
        loss = lambda *t: iha(*t, spec=spec_json).float().square().sum()  # noqa: E731
        compiled = torch.compile(loss, fullgraph=True)
        value = compiled(*tensors)
        value.backward()
        eager = [t.detach().clone().requires_grad_() for t in tensors]
        loss(*eager).backward()
        for name, t, e in zip(GRADIENTS, tensors, eager):
            self.assertTrue(torch.equal(t.grad, e.grad) or relative(t.grad, e.grad) < 1e-2, name)
        dout = torch.randn(2, 77, 4, 64, generator=gen).to("cuda", torch.bfloat16)

        def gradients():
            leaves = [t.detach().clone().requires_grad_() for t in tensors]
            lt.iha(*leaves, self.spec, cache_dir=CACHE, deterministic=True).backward(dout)
            return [t.grad for t in leaves]

        for name, a, b in zip(GRADIENTS, gradients(), gradients()):
            self.assertTrue(torch.equal(a, b), f"d{name} differs between two deterministic backwards")


CUDA_SKIP = "no CUDA device for PyTorch and loom here (" + (loom.gpu_error()[:80] or "torch sees none") + ")"


@unittest.skipUnless(torch.cuda.is_available() and loom.devices(), CUDA_SKIP)
class CudaGraphs(unittest.TestCase):
    """loom.torch under torch.cuda.graph: captured once (after a warm-up on a side stream that compiles and loads
    the kernels), replayed on new values copied into the captured inputs, each replay equal bit for bit to an
    eager call on the same values and within the bf16 tolerance of float64 eager IHA; the replays move no
    loom.counters() (a replay does not pass through loom). Workspaces come from PyTorch's allocator, so the
    capture stream needs no launch of its own first."""

    spec = {"heads": 4, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 64, "mask": "flat_causal",
            "collapse": "per_head", "rope_theta": 10000.0}

    def inputs(self, gen, B, N):
        return [t.detach().to("cuda", torch.bfloat16 if i < 3 else torch.float32)
                for i, t in enumerate(draw(self.spec, B, N, torch.float64, gen, requires_grad=False))]

    @staticmethod
    def warm_up(call):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def test_forward_and_backward_replay_as_eager(self):
        gen = torch.Generator().manual_seed(SEED + 20)
        static = [t.requires_grad_() for t in self.inputs(gen, 2, 96)]
        dout = torch.randn(2, 96, 4, 64, generator=gen).to("cuda", torch.bfloat16)

        def step():
            for t in static:
                t.grad = None
            out = lt.iha(*static, self.spec, cache_dir=CACHE)
            out.backward(dout)
            return out

        self.warm_up(step)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        before = loom.counters()
        for replay in range(5):
            fresh = self.inputs(gen, 2, 96)
            with torch.no_grad():
                for t, value in zip(static, fresh):
                    t.copy_(value)
            graph.replay()
            torch.cuda.synchronize()
            replayed = out.clone(), [t.grad.clone() for t in static]
            eager = [t.detach().clone().requires_grad_() for t in fresh]
            eager_out = lt.iha(*eager, self.spec, cache_dir=CACHE)
            eager_out.backward(dout)
            self.assertTrue(torch.equal(replayed[0], eager_out), f"replay {replay}: out differs from eager")
            exact = [t.detach().double().cpu().requires_grad_() for t in fresh]
            want = lt.iha_eager(*exact, self.spec)
            self.assertLess(relative(replayed[0].cpu(), want), 3e-2)
            want.backward(dout.double().cpu())
            for name, got, w in zip(GRADIENTS, replayed[1], exact):
                self.assertLess(relative(got.cpu(), w.grad), 5e-2, f"replay {replay} d{name}")
        # The eager calls above moved launches; the replays alone move nothing.
        moved = {k: loom.counters()[k] - v for k, v in before.items() if loom.counters()[k] != v}
        self.assertEqual(set(moved), {"launches"}, moved)

    def test_decode_replays_over_new_page_tables(self):
        gen = torch.Generator().manual_seed(SEED + 21)
        B, page, cached = 2, 16, 40
        G, d = self.spec["kv_heads"], self.spec["head_dim"]
        pages = B * (-(-(cached + 1) // page))
        k_cache = torch.randn(pages, page, G, d, generator=gen).to("cuda", torch.bfloat16)
        v_cache = torch.randn(pages, page, G, d, generator=gen).to("cuda", torch.bfloat16)
        table = torch.randperm(pages, generator=gen).view(B, -1).to("cuda", torch.int32)
        lengths = torch.full((B,), cached, dtype=torch.int32, device="cuda")
        step = self.inputs(gen, B, 1)

        errors = torch.zeros(1, dtype=torch.int32, device="cuda")

        def call():
            return lt.decode(*step, k_cache, v_cache, table, lengths, self.spec, cache_dir=CACHE, check_pages=False,
                             page_errors=errors)

        self.warm_up(call)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for replay in range(10):
            table.copy_(torch.randperm(pages, generator=gen).view(B, -1).to("cuda", torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            replayed = out.clone()
            self.assertTrue(torch.equal(replayed, call()), f"replay {replay}: differs from an eager step")
        self.assertEqual(int(errors.item()), 0, "the device's page check refused a valid table")
        # A page entry out of range: the replay refuses that sequence (and only it) and says so.
        good = out.clone()
        table[1, 0] = pages + 3
        graph.replay()
        torch.cuda.synchronize()
        self.assertEqual(int(errors.item()), 1)
        self.assertTrue(torch.equal(out[0], good[0]), "the other sequence's step changed")


if __name__ == "__main__":
    unittest.main()
