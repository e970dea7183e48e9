#!/usr/bin/env python3
"""Train a tiny IHA language model with loom, and the same model with plain
PyTorch attention on the materialised sequence, from the same initial weights
on the same batches; print both loss curves.

The text is generated (a seeded toy grammar of agents, objects and places in
which each story ends by recalling the place its object was left, so a model
must look back over the context). On the CPU loom runs its generated programs
on the host tile API in float32 (a few minutes for the default 300 steps); on a
GPU its CUDA kernels in bfloat16.

    PYTHONPATH=build/python python3 examples/python/train_tiny.py            # or after `pip install .`
    python3 examples/python/train_tiny.py --steps 60 --check                 # what CI runs
    python3 examples/python/train_tiny.py --plot loss.png                    # with matplotlib installed

--check exits 1 unless loom's training loss fell below 80% of where it began
and its last losses are within 0.05 (nats) of the baseline's.
"""
import argparse
import math
import random
import sys
import time

import torch

from loom.torch import InterleavedHeadAttention

AGENTS = ["ana", "bo", "cy", "dee", "eli", "fay"]
OBJECTS = ["key", "cup", "map", "hat", "pen", "box"]
PLACES = ["desk", "shelf", "porch", "attic", "garden", "car"]


def story(rng: random.Random) -> str:
    agent, other = rng.sample(AGENTS, 2)
    thing, place = rng.choice(OBJECTS), rng.choice(PLACES)
    filler = " ".join(f"{rng.choice(AGENTS)} saw the {rng.choice(OBJECTS)}." for _ in range(rng.randint(0, 2)))
    return (f"{agent} put the {thing} in the {place}. {filler} {other} asked where the {thing} was. "
            f"{agent} said: the {place}.\n")


def corpus(characters: int, seed: int) -> str:
    rng = random.Random(seed)
    text = []
    while sum(map(len, text)) < characters:
        text.append(story(rng))
    return "".join(text)


class Block(torch.nn.Module):
    def __init__(self, dim, backend, args):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attention = InterleavedHeadAttention(dim, heads=args.heads, pseudo_heads=args.pseudo_heads,
                                                  kv_heads=args.kv_heads, head_dim=dim // args.heads,
                                                  mask="flat_causal", rope_theta=10000.0, backend=backend,
                                                  threads=args.threads)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab, backend, args):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, args.dim)
        self.blocks = torch.nn.ModuleList(Block(args.dim, backend, args) for _ in range(args.layers))
        self.norm = torch.nn.LayerNorm(args.dim)
        self.head = torch.nn.Linear(args.dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train(backend, data, vocab, args, device):
    """Loss per step; the same initial weights and batches for every backend (seeded)."""
    torch.manual_seed(args.seed)
    model = TinyLM(vocab, backend, args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    batches = torch.Generator().manual_seed(args.seed + 1)
    losses, start = [], time.time()
    for step in range(args.steps):
        at = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=batches)
        chunk = torch.stack([data[i:i + args.context + 1] for i in at.tolist()]).to(device)
        logits = model(chunk[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), chunk[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if step % args.every == 0 or step == args.steps - 1:
            print(f"  {backend:5s} step {step:4d}  loss {losses[-1]:.4f}  ({time.time() - start:.1f} s)", flush=True)
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per model (default 300)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64, help="tokens (characters) per sequence")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--pseudo-heads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="host path threads (0: all cores)")
    parser.add_argument("--every", type=int, default=25, help="print the loss every this many steps")
    parser.add_argument("--no-baseline", action="store_true", help="train only loom's model")
    parser.add_argument("--plot", help="write both loss curves to this PNG (needs matplotlib)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the loss fell and matched the baseline")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    text = corpus(60000, args.seed)
    alphabet = sorted(set(text))
    data = torch.tensor([alphabet.index(c) for c in text], dtype=torch.long)
    vocab = len(alphabet)
    print(f"text: {len(text)} characters, {vocab} symbols; model: {args.layers} IHA layers, dim {args.dim}, "
          f"H={args.heads} G={args.kv_heads} P={args.pseudo_heads}, context {args.context}; device {device}")
    print(f"uniform guess: loss {math.log(vocab):.4f}")

    curves = {"loom": train("loom", data, vocab, args, device)}
    if not args.no_baseline:
        curves["eager"] = train("eager", data, vocab, args, device)

    tail = max(1, args.steps // 10)
    final = {name: sum(c[-tail:]) / tail for name, c in curves.items()}
    for name, value in final.items():
        print(f"{name}: first loss {curves[name][0]:.4f}, mean of the last {tail} {value:.4f}")
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("--plot: matplotlib is not installed; the numbers above are the curves")
        else:
            for name, c in curves.items():
                plt.plot(c, label=f"{name} (final {final[name]:.3f})")
            plt.xlabel("step")
            plt.ylabel("training loss (nats / character)")
            plt.legend()
            plt.savefig(args.plot, dpi=120)
            print(f"wrote {args.plot}")

    if args.check:
        ok = final["loom"] < 0.8 * curves["loom"][0]
        print(f"check: loom's loss fell to {final['loom'] / curves['loom'][0]:.0%} of its first: "
              f"{'ok' if ok else 'FAILED (want under 80%)'}")
        if "eager" in final:
            gap = abs(final["loom"] - final["eager"])
            print(f"check: loom and the baseline end {gap:.4f} apart: {'ok' if gap <= 0.05 else 'FAILED (want 0.05)'}")
            ok = ok and gap <= 0.05
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
