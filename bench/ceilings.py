#!/usr/bin/env python3
"""The GPU's measured ceilings, the yardsticks for loom's numbers: a large
bf16 matrix product (TFLOP/s) and a device-to-device copy (GB/s), timed with
CUDA events (warm-up, then the median of repeated runs). Needs PyTorch with
CUDA; prints one line per ceiling and exits 2 without them.

    python3 bench/ceilings.py [OUT.json]
"""
import json
import statistics
import sys


def median_ms(torch, fn, runs=20, warmup=5, before=None):
    """Median CUDA-event time of fn() in ms; `before` runs ahead of each timed call, untimed."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if before:
            before()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main():
    try:
        import torch
    except ImportError:
        print("ceilings: PyTorch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("ceilings: no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(torch, lambda: torch.mm(a, b))
    matmul_tflops = 2 * n**3 / ms / 1e9
    print(f"ceiling bf16 matmul {n}x{n}x{n}: {matmul_tflops:.1f} TFLOP/s ({ms:.3f} ms)")
    src = torch.randn(1 << 28, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    ms = median_ms(torch, lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 4 / ms / 1e6
    print(f"ceiling device copy 1 GiB: {copy_gbs:.1f} GB/s ({ms:.3f} ms)")
    print(f"device: {torch.cuda.get_device_name(0)}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "bf16_matmul_tflops": matmul_tflops,
                       "copy_gbs": copy_gbs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
