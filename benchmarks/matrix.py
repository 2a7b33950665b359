"""Drafter x runtime matrix on SmolLM2-135M: is every output HF greedy's, token for token?

    python benchmarks/matrix.py                              # every drafter, eager / onnxruntime / engine, 256 tokens
    python benchmarks/matrix.py --drafters hydra,eagle --runtimes onnxruntime,engine --max-new-tokens 64

A correctness check too long for the test suite (which runs one prompt per drafter on eager and one
onnxruntime + engine row): every drafter on

    eager         the FX graph after the CPU lowering passes
    onnxruntime   the graphs exported to ONNX, run by ONNX Runtime from the torch runtime's loop
    engine        the onnxruntime compilation exported as an engine directory and run in a child process in
                  which `import torch` fails (speccomp/engine/runtime.py's numpy loop)

on the first prompt of each shared prompt file (the chat template applied), each output compared with HF
greedy `generate`. Drafts must also be accepted (tau > 1), or the tree path went untested. Nothing is timed.
Writes a table to stdout and every cell to --json (default benchmarks/results_matrix.json); exits 1 when a
cell differs from HF or fails.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("alpaca", "gsm8k", "humaneval", "vicuna_bench")
DRAFTERS = {  # name -> drafter_options (explicit layers: what `speccomp search` picked here, README)
    "plain": None, "ngram": None, "token_recycling": None, "early_exit": {"exit_layer": 25},
    "layer_skip": {"skip": list(range(11, 19))}, "medusa": None, "hydra": None, "eagle": None,
    "hydra+token_recycling": {"token_recycling": {"tree": [[0], [1], [0, 0]]}},
    "kv_cache=h2o:128": {"skip": list(range(11, 19))},  # kv_mode="draft": layer_skip over an H2O cache of 128
}
RUNTIMES = ("eager", "onnxruntime", "engine")

ENGINE_CHILD = """
import json, sys
for name in ("torch", "transformers"):
    sys.modules[name] = None  # `import torch` raises ImportError in this process
import speccomp
engine = speccomp.load(sys.argv[1], verify=False)
rows = []
for ids in json.loads(sys.argv[2]):
    out = engine.generate([ids], max_new_tokens=int(sys.argv[3]), eos_token_id=engine.eos_token_id)
    rows.append({"out": out[0, len(ids):].tolist(), "tau": engine.last_stats["tau"]})
print(json.dumps(rows))
"""


def run_engine(path: Path, prompts: list[list[int]], n: int) -> list[dict]:
    child = subprocess.run([sys.executable, "-c", ENGINE_CHILD, str(path), json.dumps(prompts), str(n)],
                           capture_output=True, text=True, timeout=3600)
    if child.returncode != 0:
        raise RuntimeError(child.stderr[-2000:])
    return json.loads(child.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafters", default=",".join(DRAFTERS), help=f"comma-separated (default {','.join(DRAFTERS)})")
    ap.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"comma-separated (default {','.join(RUNTIMES)})")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(HERE / "results_matrix.json"))
    args = ap.parse_args(argv)

    import torch

    import speccomp
    from speccomp.models import chat_ids
    from speccomp.prompts import load_prompts

    torch.set_num_threads(args.threads)
    model, tok = speccomp.load_default_model()
    eos, n = tok.eos_token_id, args.max_new_tokens
    prompts = {f: chat_ids(tok, load_prompts(f, limit=1)[0].text) for f in FILES}
    refs = {f: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)[0, ids.shape[1]:].tolist() for f, ids in prompts.items()}
    runtimes = args.runtimes.split(",")
    cells, tmp = [], Path(tempfile.mkdtemp(prefix="speccomp-matrix-"))
    for name in args.drafters.split(","):
        drafter = None if name == "plain" or name.startswith("kv_cache=") else name
        kv_cache = name.split("=", 1)[1] if name.startswith("kv_cache=") else None
        fast = None
        for runtime in runtimes:
            start, cell = time.perf_counter(), {"drafter": name, "runtime": runtime}
            try:
                if runtime != "engine" or fast is None or fast.backend != "onnxruntime":
                    fast = speccomp.compile(model, drafter=drafter, drafter_options=DRAFTERS[name], kv_cache=kv_cache,
                                            backend="eager" if runtime == "eager" else "onnxruntime")
                if runtime == "engine":
                    rows = run_engine(fast.export(tmp / name.replace("+", "_").replace("=", "_").replace(":", "_")), [ids[0].tolist() for ids in prompts.values()], n)
                else:
                    rows = []
                    for ids in prompts.values():
                        out = fast.generate(ids, max_new_tokens=n, eos_token_id=eos)
                        rows.append({"out": out[0, ids.shape[1]:].tolist(), "tau": fast.last_stats["tau"]})
                cell["identical"] = [r["out"] == refs[f] for f, r in zip(prompts, rows)]
                cell["tau"] = [round(r["tau"], 3) for r in rows]
            except Exception as exc:  # one failing cell is reported, the rest still run
                cell["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                traceback.print_exc()
            cell["seconds"] = round(time.perf_counter() - start, 1)
            cells.append(cell)
            print(json.dumps(cell), file=sys.stderr, flush=True)
        del fast

    print(f"\nSmolLM2-135M, {n} new tokens, first prompt of {', '.join(FILES)}: identical to HF greedy (tau per prompt)")
    print("| drafter | " + " | ".join(runtimes) + " |")
    print("|---|" + "---|" * len(runtimes))
    ok = True
    for name in args.drafters.split(","):
        row = []
        for runtime in runtimes:
            c = next(c for c in cells if c["drafter"] == name and c["runtime"] == runtime)
            good = "error" not in c and all(c["identical"]) and (name == "plain" or min(c["tau"]) > 1.0)
            ok &= good
            row.append(c.get("error", "") if "error" in c else
                       f"{sum(c['identical'])}/{len(c['identical'])} identical, tau {', '.join(f'{t:.2f}' for t in c['tau'])}")
        print(f"| {name} | " + " | ".join(row) + " |")
    command = " ".join(["python", "benchmarks/matrix.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps({"command": command, "settings": vars(args), "cells": cells}, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
