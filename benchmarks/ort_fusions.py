"""Do ONNX Runtime's transformer-optimizer fusions (RMSNorm, residual add + RMSNorm, rotary) speed up the engine's step?

    python benchmarks/ort_fusions.py                 # SmolLM2-135M, 2 threads, 5 rounds

Issue 22 item 2 asks for fused RMSNorm / rotary / bias-add patterns on ONNX Runtime. This script exports the plain
engine (the onnxruntime backend's CPU graph: fused GroupQueryAttention, the cache bound in place), applies the fusions
of `onnxruntime.transformers` that match a Llama graph (`SimplifiedLayerNormalization`,
`SkipSimplifiedLayerNormalization`, `RotaryEmbedding`) to a copy of its target graph, and then:

    ops        the node count by op type, before and after
    agreement  greedy decoding of a few shipped prompts with both engines: identical tokens or not, and the largest
               logit difference on a verify step (the fused kernels round differently)
    steps      median ms of one forward (q = 1 and a chain of 8 at 300 cached tokens, q = 1 at 4096), each engine in a
               child process of its own, the two alternating for --rounds rounds (drift cancels in the paired ratio)

Nothing is shipped from this: it measures whether the fusion is worth shipping. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CELLS = ((300, 1), (300, 8), (4096, 1))  # (cached tokens, q)


def fuse(src: Path, dst: Path) -> dict:
    """dst: a copy of the engine at src whose target graph has ORT's Llama-pattern fusions; the op counts."""
    import onnx
    from onnxruntime.transformers.onnx_model_bert import BertOnnxModel

    model = onnx.load(src / "target.onnx")
    before = collections.Counter(n.op_type for n in model.graph.node)
    fused = BertOnnxModel(model, 0, 0)  # num_heads / hidden_size: unused by these fusions
    fused.fuse_simplified_layer_norm()
    fused.fuse_skip_simplified_layer_norm()
    fused.fuse_rotary_embeddings()
    fused.prune_graph()
    after = collections.Counter(n.op_type for n in fused.model.graph.node)
    shutil.copytree(src, dst)
    onnx.save(fused.model, dst / "target.onnx")
    return {"before": dict(before), "after": dict(after)}


def time_steps(path: str, threads: int, repeats: int) -> dict:
    """Child process: median ms per cell for the engine at `path`."""
    sys.path.insert(0, str(HERE))
    import speccomp
    from floor import engine_step
    from step_cost import median_ms

    engine = speccomp.load(path, threads=threads, verify=False)  # the fused copy's graph is not the manifest's
    return {f"{c}:{q}": median_ms(engine_step(engine, c, q), repeats) for c, q in CELLS}


def agreement(plain: Path, fused: Path, threads: int, prompts: int, tokens: int) -> dict:
    import numpy as np

    sys.path.insert(0, str(HERE))
    import speccomp
    from floor import engine_step
    from speccomp.prompts import load_prompts

    a, b = (speccomp.load(p, threads=threads, verify=False) for p in (plain, fused))
    delta = float(np.abs(engine_step(a, 300, 8)()[0] - engine_step(b, 300, 8)()[0]).max())
    same = []
    for prompt in [p for name in ("gsm8k", "vicuna_bench") for p in load_prompts(name, limit=prompts)]:
        ids = a.chat_ids(prompt.text)
        same.append(bool((a.generate(ids, tokens) == b.generate(ids, tokens)).all()))
    return {"max_logit_delta_q8": delta, "identical_replies": sum(same), "replies": len(same)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20, help="timed steps per cell per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3, help="per file, for the agreement check")
    ap.add_argument("--json", default=str(HERE / "results_ort_fusions.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(time_steps(args.child, args.threads, args.repeats)))
        return 0

    import torch

    import speccomp

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="speccomp-fusions-"))
    try:
        model, tokenizer = speccomp.load_default_model()
        plain = speccomp.compile(model, backend="onnxruntime").export(work / "plain", tokenizer=tokenizer)
        del model
        ops = fuse(Path(plain), work / "fused")
        agree = agreement(Path(plain), work / "fused", args.threads, args.prompts, 64)
        runs = {"plain": [], "fused": []}
        for r in range(args.rounds):
            for name in runs:
                out = subprocess.run([sys.executable, __file__, "--child", str(work / name), "--threads",
                                      str(args.threads), "--repeats", str(args.repeats)],
                                     check=True, capture_output=True, text=True).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1]))
                print(f"round {r} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    table = {}
    for c, q in CELLS:
        key = f"{c}:{q}"
        p, f = (median([run[key] for run in runs[n]]) for n in ("plain", "fused"))
        paired = median([a[key] / b[key] for a, b in zip(runs["plain"], runs["fused"])])
        table[key] = {"plain_ms": p, "fused_ms": f, "paired_plain_over_fused": paired}
    changed = sorted(set(ops["before"]) | set(ops["after"]), key=lambda o: -ops["before"].get(o, 0))
    print("ops changed: " + ", ".join(f"{o} {ops['before'].get(o, 0)} -> {ops['after'].get(o, 0)}" for o in changed
                                      if ops["before"].get(o, 0) != ops["after"].get(o, 0)))
    print(f"agreement: {agree}")
    print("| cached tokens | q | plain ms | fused ms | plain / fused (paired) |")
    print("|---:|---:|---:|---:|---:|")
    for key, row in table.items():
        c, q = key.split(":")
        print(f"| {c} | {q} | {row['plain_ms']:.2f} | {row['fused_ms']:.2f} | {row['paired_plain_over_fused']:.3f} |")
    command = " ".join(["python", "benchmarks/ort_fusions.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps({"command": command, "settings": vars(args), "load": os.getloadavg(),
                                           "ops": ops, "agreement": agree, "runs": runs, "table": table}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
