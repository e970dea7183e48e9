"""Tests of the `loom` Python module's paths that need no GPU: host tensors
through the generated program, the float64 reference, NVRTC compilation,
source generation and the errors. Inputs are drawn fresh every run (the seed
is printed; LOOM_TEST_SEED replays it). Run by CTest with PYTHONPATH set to
build/python.
"""
import json
import math
import os
import random
import unittest

import numpy as np

import loom

DATA = os.environ.get("LOOM_TEST_DATA", os.path.join(os.path.dirname(__file__), "..", "data"))
CACHE = os.environ.get("LOOM_TEST_CACHE", "")
SEED = int(os.environ.get("LOOM_TEST_SEED", random.SystemRandom().randrange(1 << 32)))
print(f"[ seed ] LOOM_TEST_SEED={SEED}")
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def numpy_iha(spec, q, k, v, alpha_q, alpha_k, alpha_v, collapse):
    """docs/IHA.md in float64 numpy, written apart from loom's C++ reference."""
    H, G, P, d = spec["heads"], spec["kv_heads"], spec["pseudo_heads"], spec["head_dim"]
    B, N = q.shape[:2]
    L, W = N * P, spec.get("window", 0)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    mix = lambda x, alpha: np.einsum("bnmc,mhp->bhnpc", x, np.asarray(alpha, np.float64)).reshape(B, -1, L, d)
    qs, ks, vs = mix(q, alpha_q), mix(k, alpha_k), mix(v, alpha_v)
    if spec.get("qk_norm", "none") == "rms":
        eps = spec.get("qk_norm_eps", 1e-6)
        norm = lambda x: x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        qs, ks = norm(qs), norm(ks)
    theta = spec.get("rope_theta", 0.0)
    if theta > 0:
        half = d // 2
        sign = -1.0 if spec.get("rope_direction", "positive") == "negative" else 1.0
        angle = sign * np.arange(L)[:, None] * theta ** (-2.0 * np.arange(half) / d)
        cos, sin = np.cos(angle), np.sin(angle)

        def rotate(x):
            a, b = x[..., :half], x[..., half:]
            return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

        qs, ks = rotate(qs), rotate(ks)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    ti, tj = i // P, j // P
    mask = spec.get("mask", "flat_causal")
    rows = spec.get("window_rows", 0)
    if rows > 0:
        allowed = (j <= i) & (i - j < rows)
    elif W > 0 and spec.get("window_align", "virtual") == "token":
        own = {"flat_causal": j <= i, "token_causal": tj <= ti, "none": np.ones_like(i, bool)}[mask]
        allowed = own & (ti - tj >= 0) & (ti - tj < W)
    elif mask == "flat_causal":
        allowed = (j <= i) & ((W == 0) | (i - j < W * P))
    elif mask == "token_causal":
        allowed = (tj <= ti) & ((W == 0) | (ti - tj < W))
    else:
        allowed = (W == 0) | (np.abs(ti - tj) < W)
    scale = spec.get("scale", 1.0 / math.sqrt(d))
    group = H // G
    o = np.empty((B, H, L, d))
    for h in range(H):
        s = scale * np.einsum("bic,bjc->bij", qs[:, h], ks[:, h // group])
        s = np.where(allowed, s, -np.inf)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        o[:, h] = np.einsum("bij,bjc->bic", w / w.sum(axis=-1, keepdims=True), vs[:, h // group])
    o = o.reshape(B, H, N, P, d)
    c = np.asarray(collapse, np.float64)
    if spec.get("collapse", "per_head") == "per_head":
        return np.einsum("hp,bhnpc->bnhc", c, o)
    return np.einsum("hsp,bsnpc->bnhc", c.reshape(H, H, P), o)


def draw(rng, spec, B, N):
    """Inputs drawn as the shared vectors are: q, k, v ~ N(0, 1); mixing near the identity."""
    H, G, P, d = spec["heads"], spec["kv_heads"], spec["pseudo_heads"], spec["head_dim"]
    dtype = np.float16 if spec["dtype"] == "float16" else np.float32
    q = rng.standard_normal((B, N, H, d)).astype(dtype)
    k = rng.standard_normal((B, N, G, d)).astype(dtype)
    v = rng.standard_normal((B, N, G, d)).astype(dtype)
    near_identity = lambda n: (np.eye(n)[:, :, None] + 0.3 * rng.standard_normal((n, n, P))).astype(np.float32)
    fan_in = P if spec.get("collapse", "per_head") == "per_head" else H * P
    shape = (H, P) if fan_in == P else (H, H * P)
    collapse = (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)
    return q, k, v, near_identity(H), near_identity(G), near_identity(G), collapse


def random_spec(rng):
    G = int(rng.integers(1, 3))
    spec = {
        "heads": G * int(rng.integers(1, 3)),
        "kv_heads": G,
        "pseudo_heads": int(rng.integers(1, 4)),
        "head_dim": 8 * int(rng.integers(1, 4)),
        "dtype": "float32" if rng.integers(0, 2) else "float16",
        "mask": ["flat_causal", "token_causal", "none"][int(rng.integers(0, 3))],
        "window": 0 if rng.integers(0, 2) else int(rng.integers(1, 5)),
        "collapse": "per_head" if rng.integers(0, 2) else "global",
        "rope_theta": 0.0 if rng.integers(0, 2) else 10000.0,
    }
    # The options of public IHA code, where each applies.
    if rng.integers(0, 3) == 0:
        spec["qk_norm"] = "rms"
        if rng.integers(0, 2):
            spec["qk_norm_eps"] = float(10.0 ** -int(rng.integers(3, 8)))
    if spec["rope_theta"] > 0 and rng.integers(0, 2):
        spec["rope_direction"] = "negative"
    if spec["window"] > 0 and rng.integers(0, 3) == 0:
        spec["window_align"] = "token"
    if spec["mask"] == "flat_causal" and spec["window"] == 0 and rng.integers(0, 3) == 0:
        spec["window_rows"] = int(rng.integers(1, 3 * spec["pseudo_heads"] + 3))
    return spec


def relative_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


class HostTensors(unittest.TestCase):
    def test_shared_cases_match_their_expected_outputs(self):
        cases = os.path.join(DATA, "cases")
        names = sorted(os.listdir(cases))
        self.assertTrue(names)
        for name in names:
            folder = os.path.join(cases, name)
            with open(os.path.join(folder, "spec.json")) as f:
                spec = json.load(f)
            arrays = [np.load(os.path.join(folder, f"{a}.npy")) for a in
                      ("q", "k", "v", "alpha_q", "alpha_k", "alpha_v", "collapse")]
            expected = np.load(os.path.join(folder, "expected.npy"))
            documents = {}  # a varlen case's bounds (docs/IHA.md, Varlen)
            if spec.get("varlen"):
                documents["cu_seqlens"] = np.load(os.path.join(folder, "cu_seqlens.npy"))
            out = np.from_dlpack(loom.iha(*arrays, spec, cache_dir=CACHE, **documents))
            with self.subTest(case=name):
                self.assertEqual(out.shape, expected.shape)
                self.assertLessEqual(relative_error(out, expected), TOLERANCE[spec["dtype"]])

    def test_drawn_specs_match_the_reference_and_numpy(self):
        rng = np.random.default_rng(SEED)
        for trial in range(4):
            spec = random_spec(rng)
            B, N = int(rng.integers(1, 3)), int(rng.integers(1, 24))
            inputs = draw(rng, spec, B, N)
            out = np.from_dlpack(loom.iha(*inputs, spec, cache_dir=CACHE))
            ref, _ = loom.reference(*inputs, spec)
            ref = np.from_dlpack(ref)
            independent = numpy_iha(spec, *inputs)
            with self.subTest(trial=trial, spec=spec, B=B, N=N):
                self.assertEqual(out.dtype, np.float16 if spec["dtype"] == "float16" else np.float32)
                self.assertLessEqual(relative_error(ref, independent), 1e-9)
                self.assertLessEqual(relative_error(out, ref), TOLERANCE[spec["dtype"]])

    def test_out_and_lse_are_written_in_place_through_strides(self):
        rng = np.random.default_rng(SEED + 1)
        spec = {"heads": 2, "kv_heads": 1, "pseudo_heads": 3, "head_dim": 16, "dtype": "float32",
                "mask": "flat_causal", "collapse": "per_head", "rope_theta": 10000.0}
        B, N = 2, 11
        q, k, v, aq, ak, av, c = draw(rng, spec, B, N)
        # q inside rows padded to 24 elements: a strided view.
        padded = np.zeros((B, N, 2, 24), np.float32)
        padded[..., :16] = q
        strided_q = padded[..., :16]
        self.assertFalse(strided_q.flags["C_CONTIGUOUS"])
        out = np.full((B, N, 2, 16), np.nan, np.float32)
        lse = np.full((B, 2, N * 3), np.nan, np.float32)
        result = loom.iha(strided_q, k, v, aq, ak, av, c, spec, out=out, lse=lse, cache_dir=CACHE)
        self.assertIs(result, out)
        ref, ref_lse = (np.from_dlpack(t) for t in loom.reference(q, k, v, aq, ak, av, c, spec))
        self.assertLessEqual(relative_error(out, ref), 1e-5)
        self.assertLessEqual(relative_error(lse, ref_lse), 1e-5)

    def test_a_schedule_can_be_forced(self):
        rng = np.random.default_rng(SEED + 2)
        spec = {"heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 64, "dtype": "float16",
                "mask": "token_causal", "collapse": "per_head", "rope_theta": 0.0}
        inputs = draw(rng, spec, 1, 40)
        ref = np.from_dlpack(loom.reference(*inputs, spec)[0])
        for schedule in ({"block_m": 32, "block_n": 16, "warps": 2, "stages": 3},
                         {"engine": "engine_wgmma", "mix": "mix_fused"}):  # the sm_90a program structure
            out = np.from_dlpack(loom.iha(*inputs, spec, schedule=schedule, cache_dir=CACHE))
            with self.subTest(schedule=schedule):
                self.assertLessEqual(relative_error(out, ref), TOLERANCE["float16"])


class Counters(unittest.TestCase):
    """loom.counters(): after a warm-up call, steady-state calls of the same spec and shapes generate, compile,
    read and load nothing; only `launches` moves (the C++ test HostPath.SteadyStateCallsChangeOnlyLaunches does
    the same for the decode step)."""

    def test_steady_state_calls_change_only_launches(self):
        rng = np.random.default_rng(SEED + 11)
        spec = random_spec(rng)
        spec["dtype"] = "float32"
        B, N = int(rng.integers(1, 3)), int(rng.integers(2, 12))
        inputs = draw(rng, spec, B, N)
        dout = rng.standard_normal((B, N, spec["heads"], spec["head_dim"])).astype(np.float32)
        for name, call in (("forward", lambda: loom.iha(*inputs, spec, cache_dir=CACHE, threads=1)),
                           ("backward", lambda: loom.iha_backward(*inputs, dout, spec, cache_dir=CACHE, threads=1))):
            with self.subTest(direction=name, spec=spec, B=B, N=N):
                call()  # warm-up: generate, compile or read, load
                start = loom.counters()
                call()
                per_call = loom.counters()["launches"] - start["launches"]
                self.assertGreater(per_call, 0)
                before = loom.counters()
                for _ in range(50):
                    result = call()
                after = loom.counters()
                self.assertEqual(set(before), {"programs_generated", "programs_compiled", "store_reads",
                                               "modules_loaded", "device_allocations", "host_syncs", "launches",
                                               "service_channels", "service_requests"})
                moved = {key: after[key] - before[key] for key in before if after[key] != before[key]}
                self.assertEqual(moved, {"launches": 50 * per_call})
                if name == "forward":  # the kept program still computes the function
                    ref, _ = loom.reference(*inputs, spec)
                    self.assertLessEqual(relative_error(np.from_dlpack(result), np.from_dlpack(ref)), 1e-5)


class KeptForward(unittest.TestCase):
    """A forward given `saved` keeps what the backward reads; iha_backward given it starts there: the same
    gradients as a backward that recomputes the attention, from fewer launches (no pre-mix, no attention)."""

    def test_a_backward_from_the_kept_forward(self):
        rng = np.random.default_rng(SEED + 21)
        spec = random_spec(rng)
        spec["dtype"] = "float32"
        B, N = int(rng.integers(1, 3)), int(rng.integers(2, 12))
        H, G, P, d = spec["heads"], spec["kv_heads"], spec["pseudo_heads"], spec["head_dim"]
        inputs = draw(rng, spec, B, N)
        dout = rng.standard_normal((B, N, H, d)).astype(np.float32)
        saved = [np.full((B, n, N * P, d), np.nan, np.float32) for n in (H, G, G, H)]
        lse = np.full((B, H, N * P), np.nan, np.float32)
        saved.append(lse)
        out = np.from_dlpack(loom.iha(*inputs, spec, lse=lse, saved=saved, cache_dir=CACHE, threads=1))
        ref, ref_lse = (np.from_dlpack(t) for t in loom.reference(*inputs, spec))
        self.assertLessEqual(relative_error(out, ref), 1e-5)
        self.assertLessEqual(relative_error(lse, ref_lse), 1e-5)
        for name, t in zip(("q_mixed", "k_mixed", "v_mixed", "o_pseudo"), saved):
            self.assertTrue(np.isfinite(t).all(), f"{name} not wholly written")

        def backward(**options):
            start = loom.counters()["launches"]
            grads = loom.iha_backward(*inputs, dout, spec, cache_dir=CACHE, threads=1, **options)
            return [np.from_dlpack(g) for g in grads], loom.counters()["launches"] - start

        recomputed, _ = backward()  # warm-up: the backward's program generated, compiled or read
        recomputed, recomputing = backward()
        kept, keeping = backward(saved=saved)
        # The recomputing backward is held to the float64 one elsewhere (test_torch, on checkable draws); here
        # both start from the same float32 rows. A gradient may be zero (a window of one key): norms, not ratios.
        for name, got, again in zip(("dq", "dk", "dv", "dalpha_q", "dalpha_k", "dalpha_v", "dcollapse"), kept,
                                    recomputed):
            with self.subTest(gradient=name, spec=spec, B=B, N=N):
                self.assertTrue(np.isfinite(got).all())
                self.assertLessEqual(np.linalg.norm(got - again), 1e-5 * np.linalg.norm(again))
        self.assertLess(keeping, recomputing, "the backward from a kept forward launched as many grids")

    def test_what_cannot_keep_is_refused(self):
        spec = Errors.spec
        inputs = draw(np.random.default_rng(SEED + 22), spec, 1, 5)
        B, N, H, G, P, d = 1, 5, 2, 2, 2, 8
        saved = [np.zeros((B, n, N * P, d), np.float32) for n in (H, G, G, H)] + [np.zeros((B, H, N * P), np.float32)]
        with self.assertRaisesRegex(ValueError, "schedule.mix: mix_fused keeps no mixed rows"):
            loom.iha(*inputs, spec, saved=saved, schedule={"mix": "mix_fused"}, cache_dir=CACHE)
        with self.assertRaisesRegex(ValueError, "schedule.collapse: collapse_fused"):
            loom.iha(*inputs, spec, saved=saved, schedule={"collapse": "collapse_fused"}, cache_dir=CACHE)
        with self.assertRaisesRegex(ValueError, "^saved: want five tensors"):
            loom.iha(*inputs, spec, saved=saved[:4], cache_dir=CACHE)
        with self.assertRaisesRegex(ValueError, "^o_pseudo: shape"):
            loom.iha(*inputs, spec, saved=[*saved[:3], saved[3][:, :, 1:], saved[4]], cache_dir=CACHE)
        dout = np.zeros((B, N, H, d), np.float32)
        with self.assertRaisesRegex(ValueError, "^k_mixed: element type float16, want float32"):
            loom.iha_backward(*inputs, dout, spec, saved=[saved[0], saved[1].astype(np.float16), *saved[2:]],
                              cache_dir=CACHE)


class ShapeBuckets(unittest.TestCase):
    """loom.shape_bucket: the bucket a launch's tuned decision is looked up under (README, decisions by shape)."""

    def test_buckets_round_up_to_powers_of_two(self):
        self.assertEqual(loom.shape_bucket("forward", 2, 3000), "n4096")
        self.assertEqual(loom.shape_bucket("backward", 1, 4096), "n4096")
        self.assertEqual(loom.shape_bucket("decode", 5, 40000), "c65536.b8")
        with self.assertRaisesRegex(ValueError, "direction: want forward, backward or decode"):
            loom.shape_bucket("sideways", 1, 16)
        with self.assertRaisesRegex(ValueError, "at least 1"):
            loom.shape_bucket("forward", 0, 16)


class Errors(unittest.TestCase):
    spec = {"heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 8, "dtype": "float32",
            "mask": "none", "collapse": "per_head", "rope_theta": 0.0}

    def inputs(self):
        return draw(np.random.default_rng(SEED + 3), self.spec, 1, 5)

    def test_a_bad_spec_names_the_field(self):
        bad = dict(self.spec, kv_heads=3)
        with self.assertRaisesRegex(ValueError, "kv_heads"):
            loom.iha(*self.inputs(), bad)
        with self.assertRaisesRegex(ValueError, "spec"):
            loom.iha(*self.inputs(), 42)

    def test_a_bad_tensor_is_named(self):
        q, k, v, aq, ak, av, c = self.inputs()
        with self.assertRaisesRegex(ValueError, r"^k: shape"):
            loom.iha(q, k[:, :, :1], v, aq, ak, av, c, self.spec)
        with self.assertRaisesRegex(ValueError, r"^v: element type float16, want float32"):
            loom.iha(q, k, v.astype(np.float16), aq, ak, av, c, self.spec)
        with self.assertRaisesRegex(ValueError, r"^alpha_q: not a DLPack tensor"):
            loom.iha(q, k, v, [[1.0]], ak, av, c, self.spec)

    def test_a_bad_schedule_is_a_value_error(self):
        with self.assertRaisesRegex(ValueError, "block_m"):
            loom.iha(*self.inputs(), self.spec, schedule={"block_m": 3})

    def test_a_failure_that_is_not_the_callers_is_a_loom_error(self):
        # The host program cannot be built where the cache cannot be written.
        with self.assertRaises(loom.Error) as raised:
            loom.iha(*self.inputs(), self.spec, cache_dir="/proc/loom-cannot-write-here")
        self.assertIn("/proc/loom-cannot-write-here", str(raised.exception))
        self.assertIsInstance(raised.exception, RuntimeError)

    def test_no_gpu_is_said_plainly(self):
        if loom.devices():
            self.skipTest("this machine has a GPU")
        self.assertIn("GPU", loom.gpu_error())


class Compiler(unittest.TestCase):
    hopper_spec = {"heads": 8, "kv_heads": 8, "pseudo_heads": 4, "head_dim": 128, "dtype": "bfloat16",
                   "mask": "flat_causal", "collapse": "per_head", "rope_theta": 10000.0}

    def test_sm90a_compiles_to_the_wgmma_path_without_spills(self):
        report = loom.compile(self.hopper_spec, "sm_90a")
        self.assertEqual(report["schedule"]["engine"], "engine_wgmma")
        self.assertTrue(report["uses_wgmma"] and report["uses_tma"] and report["uses_setmaxnreg"])
        self.assertEqual(report["spill_bytes"], 0)
        self.assertEqual(report["warnings"], [])
        attention = [e for e in report["entries"] if e["name"] == "iha_attention"][0]
        self.assertTrue(attention["warp_specialized"])
        self.assertEqual(attention["threads"], 384)

    def test_sm80_compiles_to_mma_sync(self):
        report = loom.compile(self.hopper_spec, "sm_80")
        self.assertFalse(report["uses_wgmma"])
        self.assertTrue(report["uses_tensor_cores"])
        self.assertEqual(report["schedule"]["engine"], "engine_mma")

    def test_generate_gives_the_program(self):
        source = loom.generate(self.hopper_spec, target="sm_90a")
        self.assertIn('#include "loom/tile/hopper.h"', source)
        self.assertIn("iha_attention", source)
        with self.assertRaisesRegex(ValueError, "target"):
            loom.generate(self.hopper_spec, target="gpu")


if __name__ == "__main__":
    unittest.main()
