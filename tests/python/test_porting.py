"""docs/porting.md, checked: for each family of public IHA code, the attention
step written out here with that family's own conventions (tensor layouts,
weight index order, where the norm and the rotation sit, how the window is
counted; numpy, float64), then the loom spec docs/porting.md gives for it,
computed by loom's float64 reference and by the generated program on the
host. Inputs are drawn fresh every run (the seed is printed; LOOM_TEST_SEED
replays it). Run by CTest with PYTHONPATH set to build/python.
"""
import math
import os
import random
import unittest

import numpy as np

import loom

CACHE = os.environ.get("LOOM_TEST_CACHE", "")
SEED = int(os.environ.get("LOOM_TEST_SEED", random.SystemRandom().randrange(1 << 32)))
print(f"[ seed ] LOOM_TEST_SEED={SEED}")
FLOAT32_EPS = float(np.finfo(np.float32).eps)


def relative_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def rms_norm(x, eps):
    """torch.nn.functional.rms_norm over the last axis, without a weight."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rotary_tables(length, head_dim, base):
    """cos / sin [length, head_dim / 2] for positions 0 .. length - 1."""
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = np.outer(np.arange(length, dtype=np.float64), inv_freq)
    return np.cos(freqs), np.sin(freqs)


def to_bfloat16(x):
    """x rounded to bfloat16 (to nearest even), as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return bits.view(np.float32).astype(np.float64)


def rotary_tables_bfloat16(length, head_dim, base):
    """nanochat's table on a bf16 GPU: inv_freq = 1 / base ** (arange(0, d, 2) / d) and the angles
    outer(arange(length), inv_freq) in float32, their cos and sin rounded to bfloat16."""
    channel = np.arange(0, head_dim, 2, dtype=np.float32)
    inv_freq = (np.float32(1.0) / np.power(np.float32(base), channel / np.float32(head_dim))).astype(np.float32)
    freqs = np.outer(np.arange(length, dtype=np.float32), inv_freq).astype(np.float32)
    return to_bfloat16(np.cos(freqs.astype(np.float64))), to_bfloat16(np.sin(freqs.astype(np.float64)))


def apply_rotary_emb(x, cos, sin):
    """The rotation of nanochat-style and speedrun-style code on [B, L, heads, D]:
    y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos (it turns by minus the angle)."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return np.concatenate([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], axis=-1)


def attention(q, k, v, allowed, scale):
    """softmax(scale q k^T) v under a boolean mask; q [B, L, H, D], k / v [B, L, G, D]."""
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = scale * np.einsum("bihd,bjhd->bhij", q, k)
    s = np.where(allowed[None, None], s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("bhij,bjhd->bihd", w / w.sum(axis=-1, keepdims=True), v)


def interleave(x, mix):
    """Pseudo-heads: [B, T, heads, D] x mix [heads (source), heads (target), P]
    -> [B, T*P, heads, D], row t*P + p (token-major)."""
    B, T, heads, D = x.shape
    pseudo = np.einsum("btmd,mhp->btphd", x, mix)  # [B, T, P, heads, D]
    return pseudo.reshape(B, T * pseudo.shape[2], heads, D)


def draw(rng, B, T, H, G, D, P):
    q = rng.standard_normal((B, T, H, D))
    k = rng.standard_normal((B, T, G, D))
    v = rng.standard_normal((B, T, G, D))
    near_identity = lambda n: np.eye(n)[:, :, None] + 0.3 * rng.standard_normal((n, n, P))
    return q, k, v, near_identity(H), near_identity(G), near_identity(G)


class Families(unittest.TestCase):
    def check(self, spec, family_out, q, k, v, alpha_q, alpha_k, alpha_v, collapse):
        f32 = lambda x: np.ascontiguousarray(x, np.float32)
        ref, _ = loom.reference(*(f32(x) for x in (q, k, v, alpha_q, alpha_k, alpha_v, collapse)), spec)
        ref = np.from_dlpack(ref)
        out = np.from_dlpack(loom.iha(*(f32(x) for x in (q, k, v, alpha_q, alpha_k, alpha_v, collapse)), spec,
                                      cache_dir=CACHE))
        # The family's float64 code on the float32-rounded inputs loom sees.
        self.assertLessEqual(relative_error(ref, family_out), 1e-9, "loom's reference against the family")
        self.assertLessEqual(relative_error(out, family_out), 1e-5, "loom's program against the family")

    def test_nanochat_style(self, bfloat16_table=False):
        """Per-head mixing weights [H, H, P] as alpha[m, h, p]; rows token-major;
        rotary first, then parameter-free rms_norm with the dtype's epsilon;
        q and k times 1.2; a window of W whole tokens back from the query's
        token, causal on the interleaved rows; a global collapse [H, H*P] whose
        column h'*P + p takes pseudo-head p of head h'."""
        rng = np.random.default_rng(SEED + int(bfloat16_table))
        B, T, H, D, P, W, base = 2, 13, 4, 16, 3, 3, 10000.0
        q, k, v, mix_q, mix_k, mix_v = draw(rng, B, T, H, H, D, P)
        q, k, v, mix_q, mix_k, mix_v = (x.astype(np.float32).astype(np.float64) for x in (q, k, v, mix_q, mix_k, mix_v))
        c_proj = (rng.standard_normal((H, H * P)) / math.sqrt(H * P)).astype(np.float32).astype(np.float64)

        qs, ks, vs = interleave(q, mix_q), interleave(k, mix_k), interleave(v, mix_v)
        cos, sin = rotary_tables_bfloat16(T * P, D, base) if bfloat16_table else rotary_tables(T * P, D, base)
        qs, ks = apply_rotary_emb(qs, cos, sin), apply_rotary_emb(ks, cos, sin)
        qs, ks = rms_norm(qs, FLOAT32_EPS), rms_norm(ks, FLOAT32_EPS)
        qs, ks = qs * 1.2, ks * 1.2
        i, j = np.arange(T * P)[:, None], np.arange(T * P)[None, :]
        allowed = (j <= i) & (i // P - j // P < W)
        y = attention(qs, ks, vs, allowed, 1.0 / math.sqrt(D))  # [B, T*P, H, D]
        y = y.reshape(B, T, P, H, D).transpose(0, 1, 3, 2, 4).reshape(B, T, H * P, D)  # column h'*P + p
        family_out = np.einsum("hc,btcd->bthd", c_proj, y)

        spec = {"heads": H, "kv_heads": H, "pseudo_heads": P, "head_dim": D, "dtype": "float32",
                "mask": "flat_causal", "window": W, "window_align": "token", "collapse": "global",
                "rope_theta": base, "rope_direction": "negative", "qk_norm": "rms", "qk_norm_eps": FLOAT32_EPS,
                "scale": 1.44 / math.sqrt(D)}
        if bfloat16_table:
            # The table moves the function by about bfloat16's rounding: without rope_table_dtype loom is that far.
            f32 = lambda x: np.ascontiguousarray(x, np.float32)
            exact, _ = loom.reference(*(f32(x) for x in (q, k, v, mix_q, mix_k, mix_v, c_proj)), spec)
            self.assertGreater(relative_error(np.from_dlpack(exact), family_out), 1e-4)
            spec["rope_table_dtype"] = "table_bfloat16"
        self.check(spec, family_out, q, k, v, mix_q, mix_k, mix_v, c_proj)

    def test_nanochat_style_with_its_bfloat16_rotary_table(self):
        """The same model with the rotary table nanochat builds on a bfloat16 GPU (rope_table_dtype
        table_bfloat16): angles in float32, cos and sin in bfloat16, the norm taken of the turned rows."""
        self.test_nanochat_style(bfloat16_table=True)

    def test_speedrun_style(self):
        """Grouped-query attention with [G, G, P] key / value mixing; rms_norm
        with the dtype's epsilon, then the rotation; FlashAttention with
        window_size (w, 0) on the interleaved sequence (row i sees rows
        i - w .. i); its own softmax scale; per-head collapse [H, P]."""
        rng = np.random.default_rng(SEED + 1)
        B, T, H, G, D, P, w, base, scale = 1, 17, 6, 2, 16, 2, 6, 1024.0, 0.12
        q, k, v, mix_q, mix_k, mix_v = draw(rng, B, T, H, G, D, P)
        q, k, v, mix_q, mix_k, mix_v = (x.astype(np.float32).astype(np.float64) for x in (q, k, v, mix_q, mix_k, mix_v))
        lambdas = (rng.standard_normal((H, P)) / math.sqrt(P)).astype(np.float32).astype(np.float64)

        qs, ks, vs = interleave(q, mix_q), interleave(k, mix_k), interleave(v, mix_v)
        qs, ks = rms_norm(qs, FLOAT32_EPS), rms_norm(ks, FLOAT32_EPS)
        cos, sin = rotary_tables(T * P, D, base)
        qs, ks = apply_rotary_emb(qs, cos, sin), apply_rotary_emb(ks, cos, sin)
        i, j = np.arange(T * P)[:, None], np.arange(T * P)[None, :]
        allowed = (i - w <= j) & (j <= i)  # window_size = (w, 0)
        y = attention(qs, ks, vs, allowed, scale).reshape(B, T, P, H, D)
        family_out = np.einsum("hp,btphd->bthd", lambdas, y)

        spec = {"heads": H, "kv_heads": G, "pseudo_heads": P, "head_dim": D, "dtype": "float32",
                "mask": "flat_causal", "window": 0, "window_rows": w + 1, "collapse": "per_head",
                "rope_theta": base, "rope_direction": "negative", "qk_norm": "rms", "qk_norm_eps": FLOAT32_EPS,
                "scale": scale}
        self.check(spec, family_out, q, k, v, mix_q, mix_k, mix_v, lambdas)

    def test_iha_lite(self):
        """Mixing only: q'[b, t, h] = sum_m M_q[m, h] q[b, t, m] (likewise k, v),
        then plain causal attention with RoPE turned the usual way (GPT-NeoX
        half-split), and no fold: P = 1 with alpha[m, h, 0] = M[m, h] and a
        per-head collapse of ones."""
        rng = np.random.default_rng(SEED + 2)
        B, T, H, D, base = 2, 11, 4, 8, 500.0
        q, k, v, mix_q, mix_k, mix_v = draw(rng, B, T, H, H, D, 1)
        q, k, v = (x.astype(np.float32).astype(np.float64) for x in (q, k, v))
        M_q, M_k, M_v = (x[:, :, 0].astype(np.float32).astype(np.float64) for x in (mix_q, mix_k, mix_v))

        mixed = lambda x, M: np.einsum("btmd,mh->bthd", x, M)
        qs, ks, vs = mixed(q, M_q), mixed(k, M_k), mixed(v, M_v)
        cos, sin = rotary_tables(T, D, base)
        neox = lambda x: apply_rotary_emb(x, cos, -sin)  # the usual sense: y1 = x1 cos - x2 sin
        qs, ks = neox(qs), neox(ks)
        i, j = np.arange(T)[:, None], np.arange(T)[None, :]
        family_out = attention(qs, ks, vs, j <= i, 1.0 / math.sqrt(D))

        spec = {"heads": H, "kv_heads": H, "pseudo_heads": 1, "head_dim": D, "dtype": "float32",
                "mask": "flat_causal", "window": 0, "collapse": "per_head", "rope_theta": base}
        self.check(spec, family_out, q, k, v, M_q[:, :, None], M_k[:, :, None], M_v[:, :, None], np.ones((H, 1)))


if __name__ == "__main__":
    unittest.main()
