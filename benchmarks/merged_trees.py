"""Which Token Recycling tree to merge with the Hydra heads: a few candidates beside Hydra's 5-node tree, one run.

    python benchmarks/merged_trees.py --json benchmarks/results_heads_merged_trees.json

Rows (HF greedy is the baseline; every output is checked against it): plain, Hydra alone, and Hydra merged
with Token Recycling on a chain of 3, on a 7-node tree (speccomp.drafters.merge.MERGED_RECYCLING_TREE), on
its own 24-node default, Hydra merged with prompt lookup instead, and all three merged. Prompts: the first --limit prompts of
gsm8k and vicuna_bench (files the shipped heads never saw). Timing and columns are `speccomp bench`'s.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "speccomp" / "data" / "prompts"
HYDRA_TREE = [[0], [1], [2], [0, 0]]  # what `speccomp autotune --drafter hydra` chose on the project machine
LOOKUP = {"num_branches": 2, "max_depth": 6}  # prompt lookup kept small beside the heads (its default: 4 x 8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=2, help="prompts per file (default 2)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    files = [PROMPTS_DIR / "gsm8k.jsonl", PROMPTS_DIR / "vicuna_bench.jsonl"]
    for f in files:
        if not f.is_file():
            raise SystemExit(f"{f} does not exist (the prompt sets ship in speccomp/data/prompts/)")

    import torch

    import speccomp
    from speccomp.tuning.bench import RowSpec, load_bench_prompts, run_bench
    from speccomp.drafters.merge import MERGED_RECYCLING_TREE

    torch.set_num_threads(2)
    model, tok = speccomp.load_default_model()
    merged = "hydra+token_recycling"
    rows = [
        RowSpec("plain", "speccomp"),
        RowSpec("hydra", "speccomp", drafter="hydra", tree=HYDRA_TREE),
        RowSpec("hydra + recycling chain 3", "speccomp", drafter=merged, tree=HYDRA_TREE,
                drafter_options={"token_recycling": {"tree": 3}}),
        RowSpec("hydra + recycling 7-node tree", "speccomp", drafter=merged, tree=HYDRA_TREE,
                drafter_options={"token_recycling": {"tree": MERGED_RECYCLING_TREE}}),
        RowSpec("hydra + recycling 24-node default", "speccomp", drafter=merged, tree=HYDRA_TREE,
                drafter_options={"token_recycling": {"tree": None}}),
        RowSpec("hydra + prompt lookup", "speccomp", drafter="hydra+ngram", tree=HYDRA_TREE,
                drafter_options={"ngram": LOOKUP}),
        RowSpec("hydra + recycling 7-node tree + prompt lookup", "speccomp", drafter="hydra+token_recycling+ngram",
                tree=HYDRA_TREE, drafter_options={"token_recycling": {"tree": MERGED_RECYCLING_TREE}, "ngram": LOOKUP}),
    ]
    prompts = load_bench_prompts([str(f) for f in files], args.limit)
    result = run_bench(model, prompts, rows, max_new_tokens=args.max_new_tokens, tokenizer=tok, warmup=1,
                       backend=args.backend, header={"prompt_files": [str(f) for f in files]})
    print(result.markdown())
    if args.json:
        result.write_json(args.json)
    return 0 if result.all_identical(("speccomp",)) else 1


if __name__ == "__main__":
    sys.exit(main())
