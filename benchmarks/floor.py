"""How far a plain decode step is from this machine's memory floor, and how it grows with the context.

    python benchmarks/floor.py                               # SmolLM2-135M, 2 threads, contexts 128 ... 8192
    python benchmarks/floor.py --contexts 128,1024 --repeats 5

A decode step of a small LM on a CPU is bound by reading the weights (and the cache) once. This script
measures, in one process and one run:

    bandwidth   GB/s of a sum over a 1 GiB float32 tensor with --threads threads (what one read of memory costs)
    floor       (weight bytes + cache bytes at that context) / bandwidth: no step can take less
    step        one forward of one token (q = 1) after `context` cached tokens, median of --repeats, for
                  hf         the HF model with a DynamicCache (model(input_ids, past_key_values=...))
                  eager      speccomp's eager lowering of the verify graph (TreeAttention, GQA, packed linears,
                             the cache written in place)
                  onnxruntime  the same graph exported to ONNX (fused GroupQueryAttention, the cache bound in
                             place), ONNX Runtime's CPU provider
                  engine     the exported engine's own session call (IO binding, numpy)
                and, with --tree N, verifying a chain of N nodes at 300 tokens of context against the plain step
                (the two medians' ratio, and the median of --pairs ratios of a plain and a tree step timed back to
                back in blocks, which the machine's drift does not move)
                and each step as a fraction of the floor (floor / step: 1.0 would be reading memory only).

The torch rows (hf, eager) are timed first, before any ONNX Runtime session exists: ORT's thread pools spin
between runs and slow torch code in the same process. Writes a table to stdout, every number to --json (default
benchmarks/results_floor.json) and a plot of step time against context to --plot (default benchmarks/floor.png).
Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from step_cost import median_ms  # noqa: E402  (one warm-up call, then the median in ms)

ROWS = ("hf", "eager", "onnxruntime", "engine")


def paired_ratios(plain, tree, rounds: int, block: int = 5) -> list[float]:
    """tree's time over plain's, one ratio per round, each round a block of `block` calls of each back to back (order
    alternating), each block's median of its calls after the first: the machine's drift between rounds cancels in each
    ratio, which two medians timed minutes apart do not (three runs of the unpaired ratio on one idle night read 1.22,
    1.55 and 1.41 for the same graph), and each block runs one shape in a row as decoding with one tree does (a
    session's first call after another shape pays for it: strict alternation read 1.51-1.57 where blocks read less)."""
    import statistics
    import time

    plain(), tree()
    ratios = []
    for i in range(rounds):
        ms = {}
        for name, fn in ((("plain", plain), ("tree", tree)) if i % 2 == 0 else (("tree", tree), ("plain", plain))):
            times = []
            for _ in range(block):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            ms[name] = statistics.median(times[1:])
        ratios.append(ms["tree"] / ms["plain"])
    return ratios


def bandwidth_gbs(repeats: int) -> float:
    """Read bandwidth: the best of `repeats` sums over 1 GiB (the sum reads every byte once)."""
    x = torch.ones(2**28)  # 1 GiB of float32
    best = min(median_ms(lambda: x.sum(), 1) for _ in range(repeats))
    return x.nbytes / (best / 1e3) / 1e9


def hf_step(model, context: int, q: int = 1, cache=None):
    """`cache`: another step's (the paired ratio's plain and tree steps share one, as decoding does)."""
    from transformers import DynamicCache

    if cache is None:
        ids = torch.randint(10, 1000, (1, context), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            cache = model(ids, past_key_values=DynamicCache(), use_cache=True).past_key_values
    tokens = torch.full((1, q), 42)  # q > 1: a causal chain of q tokens (HF has no tree input; same cost)

    def step():
        with torch.no_grad():
            model(tokens, past_key_values=cache, use_cache=True)
        cache.crop(-q)  # back to `context` tokens: every call scores the same step

    step.cache = cache
    return step


def graph_step(fast, context: int, q: int = 1, device="cpu", cache=None, room: int = 0):
    """q tokens (a chain: the root and q - 1 drafts) after `context` cached tokens through the compiled model's
    verify step, over the runtime's own preallocated cache (what decoding hands it: a graph may write in place).
    `room`: slots beyond context + q (for another step sharing the cache, passed as `cache`)."""
    from speccomp.runtime.decode import target_cache

    if cache is None:
        cache = target_cache(fast.step, fast.kv, context + q + room, device)  # cudagraphs: the step's own buffer
        cache.data.normal_()
        cache.length = context
    tree = chain(q)
    args = (torch.full((1, q), 42, device=device), tree.positions(context, device),
            torch.ones(1, context + q, dtype=torch.long, device=device))
    mask = tree.mask.to(device)

    def step():
        with torch.no_grad():
            fast.step(*args, cache.past(), mask)

    step.cache = cache
    return step


def chain(q: int):
    from speccomp.runtime.decode import ROOT_ONLY
    from speccomp.runtime.tree import Tree

    return Tree.from_choices([[0] * d for d in range(1, q)]) if q > 1 else ROOT_ONLY


def engine_step(engine, context: int, q: int = 1, cache=None, room: int = 0):
    from speccomp.engine.runtime import KVCache

    if cache is None:
        cache = KVCache(engine.kv, context + q + room, engine.dtype)
        cache.length = context
    tree = chain(q)
    positions = tree.positions(context)[0].numpy()

    def step():
        return engine._forward(cache, [42] * q, positions, tree.mask.numpy())

    step.cache = cache
    return step


def main(argv=None) -> int:
    from speccomp.cli import positive  # argparse type: an int >= 1, the bad value named

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,300,512,1024,2048,4096,8000",
                    help="cached tokens per row, comma-separated")
    ap.add_argument("--tree", type=int, default=8, help="also time verifying a chain of this many nodes at 300 tokens "
                    "of context, against the plain step there (0: skip)")
    ap.add_argument("--pairs", type=positive, default=21, help="rounds of the paired tree / plain ratio (default 21)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated (default {','.join(ROWS)})")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps per cell (default 10)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(HERE / "results_floor.json"))
    ap.add_argument("--plot", default=str(HERE / "floor.png"))
    args = ap.parse_args(argv)

    import speccomp

    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = args.rows.split(",")
    model, tok = speccomp.load_default_model()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    gbs = bandwidth_gbs(5)
    captured = speccomp.capture(model)  # once, compiled both ways
    kv, cells, steps = captured.kv, [], {}

    def measure(row, make):  # every context, then the tree, of one row
        steps[row] = make
        for context in contexts:
            floor_ms = (weights + kv.bytes_per_token() * context) / (gbs * 1e9) * 1e3
            ms = median_ms(make(context), args.repeats)
            cells.append({"row": row, "context": context, "ms": ms, "floor_ms": floor_ms, "of_floor": floor_ms / ms})
            print(json.dumps(cells[-1]), file=sys.stderr, flush=True)
        if args.tree > 1:
            cells.append({"row": row, "context": 300, "q": args.tree, "ms": median_ms(make(300, args.tree), args.repeats)})
            plain = make(300, 1, room=args.tree)  # one cache for both, as in decoding (its bindings reused)
            ratios = sorted(paired_ratios(plain, make(300, args.tree, cache=plain.cache), args.pairs))
            cells[-1].update(paired_median=ratios[len(ratios) // 2], paired_quartiles=(ratios[len(ratios) // 4],
                                                                                     ratios[3 * len(ratios) // 4]))
            print(json.dumps(cells[-1]), file=sys.stderr, flush=True)

    if "hf" in rows:  # torch first: no ONNX Runtime pool spins beside it yet
        measure("hf", lambda c, q=1, cache=None, room=0: hf_step(model, c, q, cache))
    if "eager" in rows:
        eager = speccomp.compile(captured)
        measure("eager", lambda c, q=1, **kw: graph_step(eager, c, q, **kw))
    if "onnxruntime" in rows or "engine" in rows:
        ort = speccomp.compile(captured, backend="onnxruntime")
        if "onnxruntime" in rows:
            measure("onnxruntime", lambda c, q=1, **kw: graph_step(ort, c, q, **kw))
        if "engine" in rows:
            engine = speccomp.load(ort.export(Path(tempfile.mkdtemp(prefix="speccomp-floor-")) / "e"), threads=args.threads)
            measure("engine", lambda c, q=1, **kw: engine_step(engine, c, q, **kw))

    print(f"\nSmolLM2-135M, {args.threads} threads: read bandwidth {gbs:.1f} GB/s, weights {weights / 1e6:.0f} MB, "
          f"cache {kv.bytes_per_token() / 1e3:.1f} kB per token")
    print("| context | floor ms | " + " | ".join(f"{r} ms (of floor)" for r in steps) + " |")
    print("|---:|---:|" + "---:|" * len(steps))
    plain = [c for c in cells if "q" not in c]
    for context in contexts:
        row = [c for c in plain if c["context"] == context]
        print(f"| {context} | {row[0]['floor_ms']:.1f} | " + " | ".join(f"{c['ms']:.1f} ({c['of_floor']:.0%})" for c in row) + " |")
    for row in steps:
        at = {c["context"]: c["ms"] for c in plain if c["row"] == row}
        short = 300 if 300 in at else contexts[0]
        if 4096 in at or 8000 in at:
            long = 4096 if 4096 in at else 8000
            print(f"{row}: step at {long} / step at {short} tokens of context = {at[long] / at[short]:.2f}")
        tree = [c for c in cells if c["row"] == row and c.get("q")]
        if tree and 300 in at:
            low, high = tree[0]["paired_quartiles"]
            print(f"{row}: verifying a chain of {args.tree} / a plain step, at 300 tokens = {tree[0]['ms'] / at[300]:.2f} "
                  f"(medians); paired, blocks back to back: median {tree[0]['paired_median']:.2f}, quartiles {low:.2f}-{high:.2f} "
                  f"over {args.pairs} rounds")
    command = " ".join(["python", "benchmarks/floor.py", *(argv if argv is not None else sys.argv[1:])])
    report = {"command": command, "settings": vars(args), "bandwidth_gbs": gbs, "weight_bytes": weights,
              "kv_bytes_per_token": kv.bytes_per_token(), "load": os.getloadavg(), "cells": cells}
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row in steps:
            ax.plot(contexts, [c["ms"] for c in plain if c["row"] == row], marker="o", label=row)
        ax.plot(contexts, [c["floor_ms"] for c in plain if c["row"] == next(iter(steps))], "k--", label="memory floor")
        ax.set(xscale="log", xlabel="cached tokens", ylabel="ms per decode step (q = 1)",
               title=f"SmolLM2-135M plain decode step, {args.threads} threads")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
