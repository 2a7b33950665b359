#!/usr/bin/env python3
"""Draft models by size against every other drafter, in one run (issue 23).

    python benchmarks/draft_models.py --out DRAFTS --train-only        # distil the drafts (CLI train-draft), ~40 min
    python benchmarks/draft_models.py --out DRAFTS --json benchmarks/results_draft_models.json   # ~15 min, idle machine
    (the run in benchmarks/README.md: --layers 4 1 2 for both; 8 layers were timed per forward, not trained)

1. Drafts: `speccomp train-draft` (the CLI, as a user runs it) for SmolLM2 cut to each of --layers decoder layers,
   into DRAFTS/layers_L. The model's replies (the distilled text) are decoded once, by the first size's run, and copied
   into the others' `_train/` (train-draft resumes from a stored text), so every size learns from the same sequences:
   alpaca + humaneval, --train-limit prompts each, a greedy and a sampled reply per prompt, --epochs at --lr.
2. Cost of one draft forward per size (eager, 1 and 4 tokens after the cost curve's standard past, best of 20),
   against the model itself: what a draft level costs.
3. One `run_bench` (speccomp/tuning/bench.py, as `speccomp bench`): HF greedy in the same process (eager: no ONNX
   Runtime pools), plain, a draft_model row per size, hydra, eagle, suffix, token_recycling and ngram, each drafter's
   default tree, rows rotating per prompt, on the first --limit prompts of vicuna_bench and gsm8k: prompts none of
   the drafts or the shipped heads trained on. Every row's text is checked equal to HF greedy's.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS_DIR = HERE.parent / "speccomp" / "data" / "prompts"
UNSEEN = [str(PROMPTS_DIR / "vicuna_bench.jsonl"), str(PROMPTS_DIR / "gsm8k.jsonl")]
OTHERS = ["hydra", "eagle", "suffix", "token_recycling", "ngram"]


def train(out: Path, layers: list[int], args) -> None:
    """DRAFTS/layers_L for every size not trained yet; the distilled text decoded once and shared."""
    text = None
    for L in layers:
        d = out / f"layers_{L}"
        if (d / "draft.safetensors").is_file():
            text = text or d / "_train" / "tokens.safetensors"
            continue
        mine = d / "_train" / "tokens.safetensors"
        if text is not None and text.is_file() and not mine.exists():  # the first size's text: train-draft resumes from it
            (d / "_train").mkdir(parents=True, exist_ok=True)
            shutil.copy(text, mine)
        cmd = [sys.executable, "-m", "speccomp.cli", "train-draft", "--limit", str(args.train_limit), "--max-new-tokens",
               str(args.max_new_tokens), "--layers", str(L), "--epochs", str(args.epochs), "--lr", str(args.lr),
               "--threads", str(args.threads), "--out", str(d)]
        print("$", " ".join(cmd), file=sys.stderr, flush=True)
        t = time.perf_counter()
        subprocess.run(cmd, check=True)
        print(f"layers {L}: trained in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        text = d / "_train" / "tokens.safetensors"


def step_ms(model, layers: list[int]) -> dict:
    """One eager forward of 1 and of 4 tokens (best of 20) for each size and for the model (key 0)."""
    import speccomp
    from speccomp.tuning.train_draft import draft_architecture

    out = {}
    for L in [*layers, 0]:
        costs = speccomp.compile(model if L == 0 else draft_architecture(model, L)).step_costs()
        row = {}
        for q in (1, 4):
            for _ in range(3):
                costs.run(q, costs.PAST0)
            times = []
            for _ in range(20):
                t = time.perf_counter()
                costs.run(q, costs.PAST0)
                times.append(time.perf_counter() - t)
            row[f"q{q}_ms"] = round(min(times) * 1e3, 2)
        out["model" if L == 0 else f"layers_{L}"] = row
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory of the drafts (DRAFTS/layers_L), kept between runs")
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8], help="draft sizes in decoder layers")
    ap.add_argument("--cost-layers", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="sizes whose forward is timed (untrained cuts of the model: a forward's cost is its shape's)")
    ap.add_argument("--train-only", action="store_true", help="train the drafts and stop (timing needs an idle machine)")
    ap.add_argument("--train-limit", type=int, default=60, help="training prompts per file (alpaca, humaneval)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--limit", type=int, default=5, help="benchmark prompts per file (vicuna_bench, gsm8k)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows and the step costs here")
    args = ap.parse_args(argv)
    if not args.layers or any(L < 1 for L in args.layers) or len(set(args.layers)) < len(args.layers):
        raise SystemExit(f"--layers takes distinct sizes >= 1, got {args.layers}")
    out = Path(args.out)
    train(out, args.layers, args)
    if args.train_only:
        return 0

    import torch

    import speccomp
    from speccomp.tuning.bench import RowSpec, load_bench_prompts, run_bench

    torch.set_num_threads(args.threads)
    model, tok = speccomp.load_default_model()
    steps = step_ms(model, args.cost_layers)
    rows = [RowSpec("plain", "speccomp")]
    rows += [RowSpec(f"draft_model {L} layers", "speccomp", drafter="draft_model",
                     drafter_options={"path": str(out / f"layers_{L}")}) for L in args.layers]
    rows += [RowSpec(d, "speccomp", drafter=d) for d in OTHERS]
    result = run_bench(model, load_bench_prompts(UNSEEN, args.limit), rows, max_new_tokens=args.max_new_tokens,
                       tokenizer=tok, warmup=1, header={
                           "prompt_files": UNSEEN, "draft_step_ms": steps, "draft_training": {
                               "command": "speccomp train-draft", "prompts": "alpaca humaneval",
                               "limit": args.train_limit, "epochs": args.epochs, "lr": args.lr,
                               "max_new_tokens": args.max_new_tokens, "layers": args.layers}})
    print(result.markdown())
    print(json.dumps(steps, indent=1))
    if args.json:
        result.write_json(args.json)
        print(f"written to {args.json}", file=sys.stderr)
    return 0 if result.all_identical() else 1


if __name__ == "__main__":
    sys.exit(main())
