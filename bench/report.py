#!/usr/bin/env python3
"""The table of loom against its peers, from the JSON of one GPU run:

    python3 bench/report.py --loom bench.json --peers peers.json [--ceilings ceilings.json]
                            [--plot tflops.png] > report.md

bench.json comes from loom-gpu-bench, peers.json from bench/peers.py --run,
ceilings.json from bench/ceilings.py. Per problem: TFLOP/s of loom and of
each peer (docs/IHA.md's FLOP count), loom's ratio to the fastest peer, to
FlexAttention and to the bf16 matrix-product ceiling, peak extra memory, and
whether issue 8's targets hold (N*P >= 8192: at least the fastest peer and
1.2x FlexAttention; N*P >= 16384, d = 128, no window: 60% of the ceiling).
With a training-step peers.json (bench/peers.py --run --backward) loom's
time is its forward kernel's plus its backward kernel's (the bundle named
NAME-backward), against each peer's forward and autograd backward; the
FLOPs are 3.5 forwards and the target is the fastest peer. Where the run
timed loom.torch's default step (the keeping forward NAME-backward-keep and
the backward from what it kept, NAME-backward-kept), that pair is loom's
time, marked "kept", its memory the rows kept between the passes too.
No third-party package is needed; the plot needs matplotlib and is skipped
(with a note) without it.
"""
import argparse
import json
import re
import sys

PEERS = ("eager", "flex", "sdpa-flash", "sdpa-cudnn")


def shape_of(name):
    """h8p4d128-flat-bflo-n4096 -> (H, P, d, masked, windowed, N)."""
    m = re.match(r"h(\d+)p(\d+)d(\d+)-([a-z]+)(-w\d+)?-([a-z0-9]+)-n(\d+)$", name)
    if not m:
        return None
    return {"H": int(m[1]), "P": int(m[2]), "d": int(m[3]), "mask": m[4], "window": bool(m[5]), "N": int(m[7])}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loom", required=True)
    parser.add_argument("--peers", required=True)
    parser.add_argument("--ceilings")
    parser.add_argument("--plot")
    args = parser.parse_args()
    loom = {r["name"]: r for r in json.load(open(args.loom))["results"]}
    peers = json.load(open(args.peers))
    training = peers.get("direction") == 'forward+backward'
    ceiling = json.load(open(args.ceilings))["bf16_matmul_tflops"] if args.ceilings else None

    print(("Training step (forward + backward). " if training else "")
          + f"Device: {peers['device']}, PyTorch {peers['torch']}"
          + (f"; measured bf16 matmul ceiling {ceiling:.0f} TFLOP/s" if ceiling else ""))
    print()
    print("| problem | loom TFLOP/s | " + " | ".join(PEERS) + " | vs fastest peer | vs flex | vs ceiling | "
          "extra memory loom / fastest peer (MiB) | targets |")
    print("| --- | --- | " + " | ".join("---" for _ in PEERS) + " | --- | --- | --- | --- | --- |")
    missed = 0
    series = {}
    for row in peers["results"]:
        name, shape = row["name"], shape_of(row["name"])
        mine = loom.get(name)
        if training and mine:
            step = loom.get(name + "-backward")
            keeping, kept = loom.get(name + "-backward-keep"), loom.get(name + "-backward-kept")
            if keeping and kept:  # loom.torch's default: the backward from what the forward kept
                mine = {**kept, "median_ms": keeping["median_ms"] + kept["median_ms"],
                        "workspace_bytes": max(keeping["workspace_bytes"], kept["workspace_bytes"]) +
                        kept["saved_bytes"], "engine": kept["engine"] + ", kept"}
            else:
                mine = step and {**step, "median_ms": mine["median_ms"] + step["median_ms"],
                                 "workspace_bytes": max(mine["workspace_bytes"], step["workspace_bytes"])}
            if mine:
                mine["tflops"] = row["flops"] / (mine["median_ms"] * 1e-3) / 1e12
        cells = []
        fastest, fastest_memory = None, None
        for peer in PEERS:
            r = row["methods"].get(peer)
            if not r:
                cells.append("n/a")
            elif "error" in r:
                cells.append("failed" if not r["error"].startswith(("skipped", "unavailable")) else r["error"].split(":")[0])
            else:
                cells.append(f"{r['tflops']:.1f}")
                if fastest is None or r["tflops"] > fastest:
                    fastest, fastest_memory = r["tflops"], r["peak_bytes"]
                series.setdefault(peer, []).append((shape, r["tflops"]))
        if not mine:
            print(f"| {name} | not run | " + " | ".join(cells) + " | | | | | |")
            continue
        tflops = mine["tflops"]
        series.setdefault("loom", []).append((shape, tflops))
        flex = row["methods"].get("flex", {}).get("tflops")
        notes = []
        if shape and shape["N"] * shape["P"] >= 8192:
            if fastest and tflops < fastest:
                notes.append("slower than the fastest peer")
            if flex and tflops < 1.2 * flex and not training:
                notes.append("under 1.2x flex")
        if ceiling and not training and shape and shape["N"] * shape["P"] >= 16384 and shape["d"] == 128 and not shape["window"]:
            if tflops < 0.6 * ceiling:
                notes.append("under 60% of the ceiling")
        missed += bool(notes)
        ratio = lambda other: f"{tflops / other:.2f}x" if other else ""
        memory = f"{mine['workspace_bytes'] / 2**20:.0f} / " + (f"{fastest_memory / 2**20:.0f}" if fastest else "-")
        columns = [name, f"{tflops:.1f} ({mine['engine']})", *cells, ratio(fastest), ratio(flex),
                   f"{tflops / ceiling:.0%}" if ceiling else "", memory, "; ".join(notes) if notes else "met"]
        print("| " + " | ".join(columns) + " |")
    print()
    print(f"{missed} problem(s) miss a target." if missed else "Every target is met.")

    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("\n(no plot: matplotlib is not installed)", file=sys.stderr)
            return 0
        figure, axis = plt.subplots(figsize=(8, 5))
        for method, points in sorted(series.items()):
            points = sorted((s["N"] * s["P"], t) for s, t in points if s)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("N * P (virtual sequence length)")
        axis.set_ylabel("TFLOP/s")
        axis.set_title(f"IHA {'training step ' if training else ''}on {peers['device']}")
        axis.legend()
        figure.savefig(args.plot, dpi=120, bbox_inches="tight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
