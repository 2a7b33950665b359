"""Autotuned token trees against fixed ones, per drafter, SmolLM2-135M on CPU, in one run.

    python benchmarks/autotune.py --backend onnxruntime     # every tunable drafter (the issue-22 proof)
    python benchmarks/autotune.py --drafters token_recycling --limit 1 --max-new-tokens 64   # a quick look

For every drafter (default: every tunable one; `ngram` builds its own trees and takes none):

1. `speccomp.autotune` with its defaults (as `speccomp autotune` runs) on calibration prompts stores the tree
   for `tree="auto"` and writes its report PNG (`--report-dir`). The calibration prompts are held out from
   the same files: the next `--calib-per-file` prompts of each file after the `--limit` benchmarked ones
   (same kind of text, never the benchmark prompts themselves); `--calib-shipped` uses speccomp's shipped
   prompts instead. `--reuse` keeps a result already stored for this model / drafter / backend / machine.
2. Rows: `auto` (compile(tree="auto")), then the same lowered graphs with fixed trees (no recompile, so rows
   differ only by tree): chain2, chain4, binary8 (root + 7 drafts, depth 3) and the drafter's `default`
   tree (`--wide` adds Medusa's 63-node mc_sim_7b_63 tree and the 31-node binary tree), and `plain` (the
   same target graph, no drafts). `hf_greedy` (HF generate, timed first, before any ONNX Runtime session
   exists) gives the reference every output is compared with. For every prompt all rows run back to back,
   in an order that rotates from prompt to prompt, after one untimed warm-up per row.
3. Per row: tokens/s (prefill included), decode tokens/s (prefill and its token left out: what autotune
   predicts), tau, identical. Verdict per drafter: auto's decode tokens/s against the fastest fixed row,
   in total and as the geometric mean over prompts of auto / that row's per-prompt decode rates; the
   bar is "fastest, or within `--noise` (5%)".

Writes the tables to stdout and everything to `--json` (default benchmarks/results_autotune.json).
Run it on an otherwise idle machine: rows are timed, and a busy machine moves them a lot. The
self-drafters use the layers `speccomp search --drafter layer_skip|early_exit` stored on this
machine (run it first, as benchmarks/run.sh does), else their defaults.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROMPTS_DIR = HERE.parent / "speccomp" / "data" / "prompts"  # shipped prompt sets
DEFAULT_PROMPTS = [PROMPTS_DIR / f"{name}.jsonl" for name in ("alpaca", "gsm8k", "humaneval", "vicuna_bench")]
DRAFTERS = ["token_recycling", "medusa", "hydra", "eagle", "layer_skip", "early_exit"]  # every tunable drafter

# Medusa's default tree (FasterDecoding/Medusa, medusa_choices.py: mc_sim_7b_63): 63 drafts, depth 4, ranks 0..9
MEDUSA_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
    [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8],
    [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0],
    [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0],
    [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1],
    [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
]  # fmt: skip
BINARY_4 = [[(i >> (d - 1 - k)) & 1 for k in range(d)] for d in range(1, 5) for i in range(2**d)]  # 2+4+8+16 drafts


BINARY_8 = [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0]]  # root + 7 drafts


def fixed_rows(drafter: str, options: dict, wide: bool) -> list[tuple[str, object, dict]]:
    """(name, tree, drafter_options) of the fixed-tree rows of `drafter`; `wide` adds the 63- and 31-node trees."""
    opts = dict(options)
    rows = [("chain2", 2, opts), ("chain4", 4, opts), ("binary8", BINARY_8, opts), ("default", None, opts)]
    if wide:
        wide_opts = dict(opts, top_k=max(10, opts.get("top_k", 8))) if drafter == "token_recycling" else opts
        rows += [("medusa63", MEDUSA_63, wide_opts), ("binary31", BINARY_4, opts)]
    return rows


def _rows(speccomp, model, drafter: str, result, backend: str, wide: bool) -> dict:
    """name -> SpecModel: auto compiled once, every fixed tree on the same lowered graphs (`with_tree`: auto's, or
    the drafter's with the tuned options where autotune found plain decoding faster and auto compiled that)."""
    from speccomp.runtime.decode import RootOnly
    from speccomp.runtime.tree import parse_tree_spec
    from speccomp.tuning.autotune import with_tree

    auto = speccomp.compile(model, drafter=drafter, tree="auto", backend=backend)
    tuned = speccomp.compile(model, drafter=drafter, drafter_options=result.drafter_options, backend=backend)
    default = tuned.drafter.tree  # the default tree of the tuned options
    tuned = auto if auto.drafter is not None else tuned
    rows = {"plain": tuned.with_drafter(RootOnly()), "auto": auto}
    for name, tree, opts in fixed_rows(drafter, result.drafter_options, wide):
        spec = default if tree is None else parse_tree_spec(tree)
        try:
            rows[name] = (with_tree(tuned, spec) if opts == result.drafter_options else
                          speccomp.compile(model, drafter=drafter, tree=tree, drafter_options=opts, backend=backend))
        except (ValueError, TypeError) as exc:  # e.g. a tree deeper than the Medusa heads
            print(f"{drafter}/{name}: skipped ({exc})", file=sys.stderr)
    return rows


def _time_rows(rows: dict, bench: list, refs: list, max_new_tokens: int, eos, drafter: str) -> dict:
    """Every row on every prompt, side by side as autotune's final round times its finalists (rows rotating per
    prompt: speccomp/tuning/autotune.py `_side_by_side`, which raises where an output differs from HF's `refs`);
    totals and per-prompt rates."""
    from speccomp.tuning.autotune import _decode_totals, _side_by_side

    table = {}
    stats = _side_by_side(rows, [ids for _, ids in bench], max_new_tokens, eos, drafter, None, refs=refs)
    for name, runs in stats.items():
        seconds, _ = _decode_totals(runs)
        per_prompt = [{"category": category, "tokens_per_s": s["tokens_per_second"], "tau": s["tau"],
                       "decode_tokens_per_s": (s["new_tokens"] - 1) / max(s["seconds"] - s["prefill_seconds"], 1e-12)}
                      for (category, _), s in zip(bench, runs)]
        table[name] = {"tokens_per_s": sum(s["new_tokens"] for s in runs) / sum(s["seconds"] for s in runs),
                       "decode_tokens_per_s": sum(s["new_tokens"] - 1 for s in runs) / seconds,
                       "tau": sum(s["new_tokens"] for s in runs) / sum(s["steps"] for s in runs),
                       "identical": True, "per_prompt": per_prompt}  # else _side_by_side raised
    return table


def _verdict(table: dict, result, noise: float) -> dict:
    """auto against the fastest fixed row (by total decode tokens/s): in total, and as the geometric mean over
    prompts of auto's decode rate / that row's."""
    fixed = [n for n in table if n not in ("plain", "auto")]
    fastest = max(fixed, key=lambda n: table[n]["decode_tokens_per_s"])
    auto = table["auto"]["decode_tokens_per_s"]
    per_prompt = [a["decode_tokens_per_s"] / f["decode_tokens_per_s"]  # a reply of one token has no decode rate
                  for a, f in zip(table["auto"]["per_prompt"], table[fastest]["per_prompt"])
                  if a["decode_tokens_per_s"] > 0 and f["decode_tokens_per_s"] > 0]
    geomean = statistics.geometric_mean(per_prompt)
    return {
        "tree": result.tree, "mode": result.mode, "plain": result.plain,
        "predicted_tokens_per_s": result.predicted_tokens_per_s,
        "auto_vs_plain": auto / table["plain"]["decode_tokens_per_s"],
        "measured_decode_tokens_per_s": auto, "fastest_fixed": fastest,
        "auto_vs_fastest": auto / table[fastest]["decode_tokens_per_s"],
        "auto_vs_fastest_per_prompt_geomean": geomean,
        "fastest_or_within_noise": auto >= (1 - noise) * table[fastest]["decode_tokens_per_s"],
        "calibration_check": result.check,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafters", default=",".join(DRAFTERS), help=f"comma-separated (default {','.join(DRAFTERS)})")
    ap.add_argument("--prompts", nargs="+", default=[str(p) for p in DEFAULT_PROMPTS], help="benchmark JSONL files")
    ap.add_argument("--limit", type=int, default=2, help="prompts per benchmark file (default 2)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per benchmark prompt (default 128)")
    ap.add_argument("--calib-per-file", type=int, default=2, help="held-out calibration prompts per benchmark file (default 2)")
    ap.add_argument("--calib-shipped", action="store_true", help="calibrate on speccomp's shipped prompts instead")
    ap.add_argument("--calib-new-tokens", type=int, default=None, help="new tokens per calibration prompt (default: autotune's)")
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--wide", action="store_true", help="also the 63-node Medusa tree and the 31-node binary tree")
    ap.add_argument("--reuse", action="store_true", help="reuse a stored autotune result instead of tuning again")
    ap.add_argument("--noise", type=float, default=0.05, help="'within noise' tolerance of the fastest row (default 5%%)")
    ap.add_argument("--report-dir", default=str(HERE), help="where the autotune report PNGs go (default benchmarks/)")
    ap.add_argument("--json", default=str(HERE / "results_autotune.json"))
    args = ap.parse_args(argv)

    import speccomp
    from speccomp.tuning.autotune import load_result, plot_report
    from speccomp.models import chat_ids
    from speccomp.prompts import load_prompts

    torch.set_num_threads(args.threads)
    model, tok = speccomp.load_default_model()
    eos = tok.eos_token_id
    if args.calib_shipped:
        calib = [chat_ids(tok, p.text) for p in load_prompts(None)]
    else:  # held out: the prompts right after the benchmarked ones, from every file
        # round robin over the files: the prompts autotune holds back (every third) then come from several files
        calib = [chat_ids(tok, load_prompts(f)[args.limit + i].text) for i in range(args.calib_per_file)
                 for f in args.prompts if args.limit + i < len(load_prompts(f))]
    if not calib:
        raise SystemExit("no calibration prompts left in the files: lower --limit or use --calib-shipped")
    bench = [(Path(f).stem, chat_ids(tok, p.text)) for f in args.prompts for p in load_prompts(f, limit=args.limit)]
    load = lambda: " ".join(f"{x:.2f}" for x in __import__("os").getloadavg())  # noqa: E731
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "load_start": load()},
        "settings": vars(args), "command": "python " + " ".join(sys.argv), "drafters": {},
    }
    print(f"load average at start: {load()}", file=sys.stderr)

    def hf(ids):  # HF greedy: the reference outputs (and a baseline speed), before any ONNX Runtime session exists
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                              do_sample=False, eos_token_id=eos, pad_token_id=eos)

    hf(bench[0][1][:, :8])  # warm-up
    refs, hf_rate = [], []
    for _, ids in bench:
        start = time.perf_counter()
        refs.append(hf(ids))
        hf_rate.append((refs[-1].shape[1] - ids.shape[1]) / (time.perf_counter() - start))
    report["hf_greedy_tokens_per_s"] = statistics.mean(hf_rate)

    exit_code = 0
    for drafter in [d for d in args.drafters.split(",") if d]:
        print(f"\n=== {drafter} ===", file=sys.stderr)
        result = load_result(model, drafter, args.backend) if args.reuse else None
        if result is None:
            extra = {} if args.calib_new_tokens is None else {"max_new_tokens": args.calib_new_tokens}
            result = speccomp.autotune(model, drafter, calib, backend=args.backend, eos_token_id=eos, progress=True, **extra)
        print(result.summary(), file=sys.stderr)
        if args.report_dir:
            plot_report(result, Path(args.report_dir) / f"autotune_{drafter}.png")
        table = _time_rows(_rows(speccomp, model, drafter, result, args.backend, args.wide), bench, refs,
                           args.max_new_tokens, eos, drafter)
        verdict = _verdict(table, result, args.noise)
        report["drafters"][drafter] = {"autotune": result.to_dict(), "rows": table, "verdict": verdict}
        print(f"\n{drafter} on {args.backend} ({len(bench)} prompts, {args.max_new_tokens} new tokens, {args.threads} threads)")
        print("| row | tokens/s | decode tokens/s | tau | identical |")
        print("|---|---:|---:|---:|---|")
        for n, r in table.items():
            print(f"| {n} | {r['tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | {r['tau']:.2f} | {'yes' if r['identical'] else 'NO'} |")
        what = "plain decoding (no tree beat it)" if result.plain else f"{result.mode} tree {json.dumps(result.tree)}"
        print(f"auto = {what}: {100 * verdict['auto_vs_fastest']:.0f}% of the fastest "
              f"fixed row ({verdict['fastest_fixed']}), per-prompt geomean "
              f"{100 * verdict['auto_vs_fastest_per_prompt_geomean']:.0f}%; fastest or within {100 * args.noise:.0f}%: "
              f"{verdict['fastest_or_within_noise']}; {100 * verdict['auto_vs_plain']:.0f}% of plain")
        if not all(r["identical"] for r in table.values()):
            exit_code = 1
        Path(args.json).write_text(json.dumps(report, indent=1, default=float))  # after every drafter: no lost work
    report["machine"]["load_end"] = load()
    print(f"load average at end: {load()}", file=sys.stderr)
    Path(args.json).write_text(json.dumps(report, indent=1, default=float))
    print(f"\nwritten to {args.json}", file=sys.stderr)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
