"""backend="triton" on SmolLM2-135M, in Triton's CPU interpreter: the tokens equal HF greedy's.

    TRITON_INTERPRET=1 python benchmarks/triton_smollm2.py                    # 1 prompt, plain + token_recycling, 256 tokens
    TRITON_INTERPRET=1 python benchmarks/triton_smollm2.py --max-new-tokens 32   # a quick look

A correctness run, not a speed one: the interpreter executes every kernel program in numpy (seconds
per step for 30 layers), so the wall times say nothing about the kernel on a GPU. What it shows is
that the real model, lowered with every attention in `speccomp::tree_attention`, decodes token for
token like HF greedy, for plain decoding (q = 1 against a growing cache) and for token_recycling
(16-node trees). The test suite checks the same on tiny models; this is the full-size check it
cannot afford. Writes --json (default benchmarks/results_triton_smollm2.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = HERE.parent / "speccomp" / "data" / "prompts" / "alpaca.jsonl"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafters", default="plain,token_recycling", help="rows (default plain,token_recycling)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(HERE / "results_triton_smollm2.json"))
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("start Python with TRITON_INTERPRET=1 (this machine has no GPU): "
                         "TRITON_INTERPRET=1 python benchmarks/triton_smollm2.py")

    import torch

    import speccomp
    from speccomp.models import chat_ids
    from speccomp.prompts import load_prompts

    torch.set_num_threads(args.threads)
    model, tok = speccomp.load_default_model()
    eos = tok.eos_token_id
    prompt = load_prompts(PROMPTS if PROMPTS.exists() else None, limit=1)[0]
    ids = chat_ids(tok, prompt.text)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos)
    rows = []
    for name in args.drafters.split(","):
        fast = speccomp.compile(model, drafter=None if name == "plain" else name, backend="triton")
        sites = sum("tree_attention" in str(n.target) for n in fast.step.graph.nodes)
        start = time.perf_counter()
        out = fast.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
        seconds = time.perf_counter() - start
        row = {"row": name, "identical": bool(torch.equal(out, ref)), "new_tokens": out.shape[1] - ids.shape[1],
               "steps": fast.last_stats["steps"], "tau": fast.last_stats["tau"], "kernel_sites": sites,
               "interpreter_seconds": seconds}
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"prompt": prompt.text[:80], "prompt_tokens": ids.shape[1], "max_new_tokens": args.max_new_tokens,
              "command": " ".join(["TRITON_INTERPRET=1 python benchmarks/triton_smollm2.py", *(argv or sys.argv[1:])]),
              "rows": rows}
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
