"""Trained heads against each other, in one run: the shipped (or cached) heads vs candidate head directories.

    python benchmarks/heads_compare.py DIR [DIR ...]            # e.g. heads written by `speccomp train-heads --out DIR`
    python benchmarks/heads_compare.py DIR --kinds hydra,medusa --limit 2 --json out.json

Rows: HF greedy (the baseline every output is compared with), plain speccomp, the heads `compile` finds for
each kind in --kinds (user cache first, then the ones shipped in the package), and every candidate
directory (its kind read from its config.json). Prompts: the first --limit prompts of each file in --prompts,
by default gsm8k and vicuna_bench, the two shipped sets the shipped heads were not trained on; train
candidates on other files (`speccomp train-heads` defaults to alpaca + humaneval) so the comparison stays on
unseen prompts. Timing and columns are `speccomp bench`'s (speccomp/tuning/bench.py), with rows rotating per prompt.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS_DIR = HERE.parent / "speccomp" / "data" / "prompts"
UNSEEN = [PROMPTS_DIR / "gsm8k.jsonl", PROMPTS_DIR / "vicuna_bench.jsonl"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("candidates", nargs="*", help="head directories to compare (config.json + weights)")
    ap.add_argument("--kinds", default="hydra", help="kinds whose installed heads get a row (default hydra; '' for none)")
    ap.add_argument("--prompts", nargs="+", default=[str(p) for p in UNSEEN], help="JSONL prompt files (default gsm8k, vicuna_bench)")
    ap.add_argument("--limit", type=int, default=2, help="prompts per file (default 2)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--tree", default=None, help="tree for every heads row (default: each drafter's default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)

    # everything is checked before the model loads
    if args.limit < 1 or args.max_new_tokens < 1:
        raise SystemExit(f"--limit and --max-new-tokens must be >= 1, got {args.limit} and {args.max_new_tokens}")
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - {"medusa", "hydra", "eagle"}:
        raise SystemExit(f"--kinds takes medusa, hydra and/or eagle, got {args.kinds!r}")
    tree = None
    if args.tree is not None:
        from speccomp.runtime.tree import parse_tree_spec

        try:
            tree = parse_tree_spec(args.tree)
        except ValueError as exc:  # names the accepted forms
            raise SystemExit(f"--tree: {exc}") from None
    for f in args.prompts:
        if not Path(f).is_file():
            raise SystemExit(f"prompt file {f} does not exist (the default sets ship in speccomp/data/prompts/)")
    rows_spec = []
    for c in args.candidates:
        config = Path(c) / "config.json"
        if not config.is_file():
            raise SystemExit(f"{c}: no config.json; give directories written by `speccomp train-heads --out DIR`")
        kind = json.loads(config.read_text()).get("head_type", "medusa")
        rows_spec.append((f"{kind} {c}", kind, {"heads": str(c)}))  # the path as given: unique per directory
    if len({name for name, _, _ in rows_spec}) < len(rows_spec):
        raise SystemExit(f"a candidate directory is given twice: {args.candidates}")

    import torch

    import speccomp
    from speccomp.tuning.bench import RowSpec, load_bench_prompts, run_bench

    torch.set_num_threads(args.threads)
    model, tok = speccomp.load_default_model()
    prompts = load_bench_prompts(args.prompts, args.limit)  # ids "<file>/<id>", as `speccomp bench` names them
    rows = [RowSpec("plain", "speccomp")]
    rows += [RowSpec(f"{k} (installed)", "speccomp", drafter=k, tree=tree) for k in kinds]
    rows += [RowSpec(name, "speccomp", drafter=kind, tree=tree, drafter_options=opts) for name, kind, opts in rows_spec]
    result = run_bench(model, prompts, rows, max_new_tokens=args.max_new_tokens, tokenizer=tok, warmup=1,
                       header={"candidates": args.candidates, "prompt_files": args.prompts})
    print(result.markdown())
    if args.json:
        result.write_json(args.json)
        print(f"written to {args.json}", file=sys.stderr)
    return 0 if result.all_identical() else 1


if __name__ == "__main__":
    sys.exit(main())
