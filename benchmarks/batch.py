"""Batched decoding on SmolLM2-135M, in one run: throughput and per-request latency at B = 1, 2, 4, 8, 16 for HF
batched greedy `generate`, speccomp's plain batched decoding and its speculative batched decoding.

    python benchmarks/batch.py                                   # onnxruntime backend, 64 new tokens, 2 threads
    python benchmarks/batch.py --batches 1,4 --max-new-tokens 32 # quicker
    python benchmarks/batch.py --drafter ngram --backend eager

Prompts: the held-out sets (gsm8k, vicuna_bench) round robin, the first 16 as chat turns; a batch of B takes the first
B, left-padded. At each B the speccomp variants take turns: one untimed round, then --repeats timed rounds (the best
of each kept); HF's batches run once untimed, then --repeats times. Rows stop at the model's eos.

    hf_batched        HF `model.generate(input_ids [B, n], attention_mask, do_sample=False)`, in a child process
                      started before this one loads ONNX Runtime (whose spinning thread pools slow torch code in
                      the same process), torch on 2 threads
    plain             speccomp.compile(model, backend=...).generate(ids, attention_mask=...): every row in one
                      forward a step (speccomp/runtime/batch.py)
    speculative       the same with --drafter (default token_recycling) and --tree (default: the drafter's), its
                      trees capped step by step by the load-aware budget (speccomp/runtime/budget.py; its step-cost
                      curve t(q, past), q <= 256, past <= 8192, is measured before any timing)
    spec_full         the same drafter, every row verifying its whole tree (load_aware=False)
    plain_again       plain decoding compiled a second time (sessions of its own): the A/A control, what two
                      identical rows differ by in this run (`--variants plain,plain_again,speculative`)

Throughput = new tokens of all rows / wall seconds of the batch (the best round); `paired` = the median over rounds
of plain's seconds / the row's seconds in the same round (back to back, so the machine's drift between rounds,
up to 10% here, cancels), and `ci95`: the geometric mean of those per-round ratios with its 95% confidence interval
(Student's t over the rounds' log ratios). The variants' order alternates round by round (forward, then reversed),
so no row always runs first or right after the biggest one. Latency = seconds from the batch's start to a
row's last token (HF returns every row at the end, so each of its rows' latency is the batch's). Every speccomp row
is compared with that prompt's own HF greedy reply (alone, unpadded, computed in the child): `rows_equal` counts
equal ones; HF's batched rows are compared too (padding changes HF's own numerics a little).

Writes the table to stdout and everything to --json (default benchmarks/results_batch.json). Run it on an idle
machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from speccomp.runtime.calls import left_pad

HERE = Path(__file__).resolve().parent


def prompts_ids(tok, n: int) -> list[torch.Tensor]:
    from speccomp.models import chat_ids
    from speccomp.prompts import HELD_OUT_SETS, load_prompts

    sets = [load_prompts(name) for name in HELD_OUT_SETS]
    chosen = [sets[i % len(sets)][i // len(sets)] for i in range(n)]  # round robin over the sets
    return [chat_ids(tok, p.text)[0] for p in chosen]


def left_padded(rows, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = left_pad(rows, pad)  # speccomp/runtime/calls.py
    return torch.from_numpy(ids), torch.from_numpy(mask)


def replies(out: torch.Tensor, width: int, eos: int) -> list[list[int]]:
    """Each row's new tokens up to and including its eos."""
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


def timed(run, repeats: int):
    """(best seconds, result) of `repeats` timed runs after one untimed warm-up."""
    run()
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


def ci95(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-round ratios and its 95% confidence interval (Student's t over the log ratios)."""
    import math

    from scipy.stats import t

    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), float("nan"), float("nan")
    half = t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def hf_child(args) -> dict:
    """HF batched greedy at every B, and each prompt's own greedy reply (the reference)."""
    import speccomp

    torch.set_num_threads(args.threads)
    model, tok = speccomp.load_default_model()
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = prompts_ids(tok, max(args.batches))
    alone = []
    for r in rows:
        with torch.no_grad():
            out = model.generate(r[None], attention_mask=torch.ones(1, len(r), dtype=torch.long), do_sample=False,
                                 max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=pad)
        alone.append(replies(out, len(r), eos)[0])
    result = {"alone": alone, "batches": {}}
    for b in args.batches:
        ids, mask = left_padded(rows[:b], pad)

        def run():
            with torch.no_grad():
                return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=args.max_new_tokens,
                                      eos_token_id=eos, pad_token_id=pad)

        seconds, out = timed(run, args.repeats)
        got = replies(out, ids.shape[1], eos)
        result["batches"][str(b)] = {"seconds": seconds, "new_tokens": sum(len(g) for g in got),
                                     "latencies": [seconds] * b, "rows_equal": sum(g == a for g, a in zip(got, alone))}
        print(f"hf_batched B={b}: {seconds:.2f} s", file=sys.stderr, flush=True)
    return result


def speccomp_rows(args, alone: list) -> dict:
    import speccomp

    torch.set_num_threads(args.threads)
    model, tok = speccomp.load_default_model()
    eos = tok.eos_token_id
    rows = prompts_ids(tok, max(args.batches))
    captured = speccomp.capture(model)
    spec = None
    if "speculative" in args.variants:
        spec = speccomp.compile(captured, backend=args.backend, drafter=args.drafter, tree=args.tree)
        costs = spec.step_costs()  # the load-aware budget's step-cost curve t(q, past), measured before any timing,
        costs.measure_ahead(256, costs.PAST0 << 5)  # on autotune's grid (tuning/step_curve.py), up to 16 rows' cache
    # every other row gets sessions of its own: spec_full's forwards of hundreds of tokens would otherwise grow the
    # ONNX Runtime arenas that the load-aware row's small forwards then run in (seen: up to 8% slower)
    make = {"plain": lambda: (speccomp.compile(captured, backend=args.backend), {}),
            "speculative": lambda: (spec, {}),  # load-aware (the default)
            "spec_full": lambda: (speccomp.compile(captured, backend=args.backend, drafter=args.drafter,
                                                   tree=args.tree), {"load_aware": False}),  # every row its whole tree
            "plain_again": lambda: (speccomp.compile(captured, backend=args.backend), {})}  # the A/A control
    variants = {name: make[name]() for name in args.variants}
    out = {name: {} for name in variants}
    for b in args.batches:  # at each B the variants take turns, repeat after repeat (drift hits them alike)
        ids, mask = left_padded(rows[:b], 0)
        best = {name: (float("inf"), None, None) for name in variants}
        rounds = {name: [] for name in variants}  # every timed round's seconds, for the paired ratio
        for repeat in range(args.repeats + 1):  # the first round untimed: a warm-up of every variant
            order = list(variants.items())
            for name, (fast, options) in order if repeat % 2 else order[::-1]:
                start = time.perf_counter()
                result = fast.generate(ids, max_new_tokens=args.max_new_tokens, attention_mask=mask, eos_token_id=eos,
                                       **options)
                seconds = time.perf_counter() - start
                if repeat:
                    rounds[name].append(seconds)
                if repeat and seconds < best[name][0]:
                    best[name] = (seconds, result, fast.last_stats)
        for name, (seconds, result, stats) in best.items():
            got = replies(result, ids.shape[1], eos)
            per_row = stats["rows"] if b > 1 else [stats]
            # paired: plain's time / this variant's within each round (they ran back to back, so a drift of the
            # machine's speed between rounds cancels), the median over rounds; every row's text is the same
            ratios = [p / v for p, v in zip(rounds["plain"], rounds[name])]
            out[name][str(b)] = {"seconds": seconds, "rounds": rounds[name], "paired_x_plain": statistics.median(ratios),
                                 "ci95_x_plain": ci95(ratios),
                                 "new_tokens": sum(len(g) for g in got),
                                 "latencies": [r["seconds"] for r in per_row],
                                 "forwards": stats.get("forwards", stats.get("steps")),
                                 "tau": [round(r["tau"], 3) for r in per_row],
                                 "rows_equal": sum(g == a for g, a in zip(got, alone))}
            print(f"{name} B={b}: {seconds:.2f} s", file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--backend", default="onnxruntime")
    parser.add_argument("--drafter", default="token_recycling")
    parser.add_argument("--tree", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--hf-repeats", type=int, default=None, help="HF's timed runs (default: --repeats)")
    parser.add_argument("--variants", default="plain,speculative,spec_full",
                        help="speccomp rows, plain first: plain, speculative, spec_full, plain_again (the A/A control)")
    parser.add_argument("--json", default=str(HERE / "results_batch.json"))
    parser.add_argument("--hf-child", default=None, help=argparse.SUPPRESS)  # internal: write HF's rows here
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.variants = args.variants.split(",")
    if (args.variants[0] != "plain" or len(set(args.variants)) < len(args.variants)
            or not set(args.variants) <= {"plain", "speculative", "spec_full", "plain_again"}):
        parser.error(f"--variants {','.join(args.variants)}: start with plain, then any of speculative, spec_full, "
                     "plain_again, each once")
    if args.hf_child:
        Path(args.hf_child).write_text(json.dumps(hf_child(args)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        child = Path(tmp) / "hf.json"
        forwarded = ["--batches", ",".join(map(str, args.batches)), "--max-new-tokens", str(args.max_new_tokens),
                     "--threads", str(args.threads), "--repeats", str(args.repeats if args.hf_repeats is None else args.hf_repeats)]
        subprocess.run([sys.executable, __file__, *forwarded, "--hf-child", str(child)], check=True)
        hf = json.loads(child.read_text())
    rows = {"hf_batched": hf["batches"], **speccomp_rows(args, hf["alone"])}
    print(f"\nSmolLM2-135M, {args.max_new_tokens} new tokens (eos stops a row), backend {args.backend}, "
          f"drafter {args.drafter}, tree {args.tree or 'default'}, {args.threads} threads")
    print(f"{'B':>3} {'row':<12} {'tok/s':>7} {'x HF':>6} {'x plain':>8} {'paired':>7} {'paired 95% CI':>20} "
          f"{'p50 lat s':>10} {'forwards':>9} {'equal':>6}")
    for b in map(str, args.batches):
        for name, table in rows.items():
            r = table[b]
            tps = r["new_tokens"] / r["seconds"]
            hf_tps = rows["hf_batched"][b]["new_tokens"] / rows["hf_batched"][b]["seconds"]
            plain_tps = rows["plain"][b]["new_tokens"] / rows["plain"][b]["seconds"]
            r |= {"tokens_per_second": tps, "x_hf": tps / hf_tps, "x_plain": tps / plain_tps,
                  "p50_latency": statistics.median(r["latencies"])}
            paired = f"{r['paired_x_plain']:7.2f}" if "paired_x_plain" in r else f"{'':>7}"
            ci = "{:.3f} [{:.3f}, {:.3f}]".format(*r["ci95_x_plain"]) if name not in ("hf_batched", "plain") else ""
            print(f"{b:>3} {name:<12} {tps:7.1f} {tps / hf_tps:6.2f} {tps / plain_tps:8.2f} {paired} {ci:>20} "
                  f"{r['p50_latency']:10.2f} {str(r.get('forwards', '')):>9} {r['rows_equal']:>3}/{b}")
    Path(args.json).write_text(json.dumps({"command": "python benchmarks/batch.py " + " ".join(argv or sys.argv[1:]),
                                           "machine": platform.processor() or platform.machine(),
                                           "cpus": os.cpu_count(), "args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
