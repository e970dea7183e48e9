#!/usr/bin/env python3
"""IHA from Python with loom: PyTorch tensors on the GPU when there is one,
else NumPy arrays on the host (the same generated program on the host tile
API). Checks the result against loom's float64 reference.

    PYTHONPATH=build/python python3 examples/python/iha.py [--tokens 256]
"""
import argparse

import numpy as np

import loom

SPEC = {"heads": 8, "kv_heads": 2, "pseudo_heads": 4, "head_dim": 64, "dtype": "float16",
        "mask": "flat_causal", "window": 0, "collapse": "per_head", "rope_theta": 10000.0}


def inputs(rng, B, N):
    H, G, P, d = SPEC["heads"], SPEC["kv_heads"], SPEC["pseudo_heads"], SPEC["head_dim"]
    near_identity = lambda n: (np.eye(n)[:, :, None] + 0.3 * rng.standard_normal((n, n, P))).astype(np.float32)
    return (rng.standard_normal((B, N, H, d)).astype(np.float16),
            rng.standard_normal((B, N, G, d)).astype(np.float16),
            rng.standard_normal((B, N, G, d)).astype(np.float16),
            near_identity(H), near_identity(G), near_identity(G),
            (rng.standard_normal((H, P)) / np.sqrt(P)).astype(np.float32))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    host = inputs(np.random.default_rng(), 1, args.tokens)
    gpus = loom.devices()
    if gpus:
        import torch  # the GPU path: any DLPack producer works the same way
        tensors = [torch.from_numpy(x).cuda() for x in host]
        out = loom.iha(*tensors, SPEC, stream=torch.cuda.current_stream().cuda_stream)
        result = torch.from_dlpack(out).float().cpu().numpy()
        where = f"{gpus[0]['name']} ({gpus[0]['arch']})"
    else:
        print(f"no GPU ({loom.gpu_error()[:60]}...): running on the host tile API")
        result = np.from_dlpack(loom.iha(*host, SPEC)).astype(np.float32)
        where = "the host"
    reference = np.from_dlpack(loom.reference(*host, SPEC)[0])
    error = np.linalg.norm(result - reference) / np.linalg.norm(reference)
    print(f"IHA on {where}: out {tuple(result.shape)}, relative error {error:.2e} against the float64 reference")
    return 0 if error <= 2e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
