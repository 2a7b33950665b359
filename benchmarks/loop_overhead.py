"""How much of a speculative decode is spent outside the model's forwards (issue 22: "loop overhead between
forwards ... under 10% of a step").

    python benchmarks/loop_overhead.py                          # hydra+token_recycling, onnxruntime + engine
    python benchmarks/loop_overhead.py --drafter token_recycling --limit 1

For the runtimes whose forwards are ONNX Runtime sessions (the onnxruntime backend, the exported engine), every
session of the compiled model (the target's and the drafter's graphs) is wrapped in a timer; a decode's wall time
minus the time inside those sessions is the loop: drafting on the host (tree growth, Token Recycling's table,
top-k), acceptance, cache bookkeeping, Python between forwards. Reported per runtime as seconds and as a share of
the decode, over the first --limit prompts of gsm8k and vicuna_bench (256 new tokens, each after one untimed
warm-up prompt). The timer itself costs two perf_counter calls per session run. Run it on an idle machine.

`--before` adds, for each runtime, a row with the loop as it was before 2026-11-28: the KV cache's layers bound to
the session afresh every run (`LayerBindings`, speccomp/engine/runtime.py, now keeps them bound) and torch's argmax
for greedy acceptance (runtime/sampling.py `argmax` now scans with numpy): the same run's A/B of those changes.
The rows take turns prompt by prompt, the order rotating, so a drift of the machine's speed hits them alike.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


class Timed:
    """An ONNX Runtime InferenceSession whose run / run_with_iobinding calls add their wall time to `clock`."""

    def __init__(self, session, clock: list):
        self._session, self._clock = session, clock

    def __getattr__(self, name):
        attr = getattr(self._session, name)
        if name not in ("run", "run_with_iobinding"):
            return attr

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self._clock[0] += time.perf_counter() - start

        return timed


def wrap_sessions(obj, clock: list, depth: int = 4, seen=None) -> int:
    """Wrap every InferenceSession reachable through attributes (and lists) of `obj`; how many were wrapped."""
    import onnxruntime as ort

    seen = set() if seen is None else seen
    if depth < 0 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, type(None))):
        return 0
    seen.add(id(obj))
    count = 0
    items = obj if isinstance(obj, (list, tuple)) else list(vars(obj).items()) if hasattr(obj, "__dict__") else []
    for item in items:
        name, value = item if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) else (None, item)
        if isinstance(value, ort.InferenceSession) and name is not None:
            setattr(obj, name, Timed(value, clock))
            count += 1
        else:
            count += wrap_sessions(value, clock, depth - 1, seen)
    return count


@contextlib.contextmanager
def before():
    """The loop as it was (the module docstring): every in-place session binds the cache's layers afresh each run
    (LayerBindings forgetting what it bound), greedy acceptance takes torch's argmax."""
    import speccomp.runtime.decode as decode
    from speccomp.engine.runtime import LayerBindings

    kept, numpy_argmax = LayerBindings.binding, decode.argmax

    def afresh(self, buffer, outputs):
        self._kept.clear()
        return kept(self, buffer, outputs)

    LayerBindings.binding, decode.argmax = afresh, lambda logits: logits.argmax(-1)
    try:
        yield
    finally:
        LayerBindings.binding, decode.argmax = kept, numpy_argmax


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="hydra+token_recycling")
    ap.add_argument("--tree", default='{"token_recycling": {"tree": [[0], [1], [2], [0, 0]]}}',
                    help="drafter_options as JSON (default: the README's Token Recycling tree)")
    ap.add_argument("--limit", type=int, default=3, help="prompts per file (default 3)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--before", action="store_true", help="also each runtime's loop as it was before 2026-11-28 (A/B)")
    ap.add_argument("--json", default=str(HERE / "results_loop_overhead.json"))
    args = ap.parse_args(argv)

    import torch

    import speccomp
    from speccomp.models import chat_ids
    from speccomp.prompts import load_prompts

    torch.set_num_threads(args.threads)
    model, tok = speccomp.load_default_model()
    prompts = [chat_ids(tok, p.text) for f in ("gsm8k", "vicuna_bench") for p in load_prompts(f, limit=args.limit)]
    options = json.loads(args.tree) if args.tree else None
    fast = speccomp.compile(model, drafter=args.drafter, drafter_options=options, backend="onnxruntime")
    engine = speccomp.load(fast.export(Path(tempfile.mkdtemp()) / "engine"), threads=args.threads)
    clocks = {"onnxruntime": [0.0], "engine": [0.0]}
    wrapped = {"onnxruntime": wrap_sessions(fast, clocks["onnxruntime"]), "engine": wrap_sessions(engine, clocks["engine"])}
    variants = [(name, runner, False) for name, runner in (("onnxruntime", fast), ("engine", engine))]
    variants += [(name, runner, True) for name, runner, _ in variants] if args.before else []
    totals = {(name, old): {"seconds": 0.0, "in_sessions_s": 0.0, "tokens": 0, "steps": 0}
              for name, _, old in variants}

    def run(name, runner, old, ids):
        with before() if old else contextlib.nullcontext():
            runner.generate(ids.numpy() if name == "engine" else ids, max_new_tokens=args.max_new_tokens,
                            eos_token_id=tok.eos_token_id)
        return runner.last_stats

    for variant in variants:
        run(*variant, prompts[0])  # warm-up
    for i, ids in enumerate(prompts):
        for name, runner, old in variants[i % len(variants):] + variants[: i % len(variants)]:
            clock, total = clocks[name], totals[name, old]
            start = clock[0]
            stats = run(name, runner, old, ids)
            total["in_sessions_s"] += clock[0] - start
            total["seconds"] += stats["seconds"]
            total["tokens"] += stats["new_tokens"]
            total["steps"] += stats["steps"]
    rows = []
    for (name, old), t in totals.items():
        loop = t["seconds"] - t["in_sessions_s"]
        rows.append({"runtime": name + (", before (layers rebound every run, torch's argmax)" if old else ""),
                     "sessions_wrapped": wrapped[name], "seconds": t["seconds"], "in_sessions_s": t["in_sessions_s"],
                     "loop_s": loop, "loop_share": loop / t["seconds"], "tokens_per_s": t["tokens"] / t["seconds"],
                     "steps": t["steps"], "loop_ms_per_step": 1e3 * loop / t["steps"]})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"\nSmolLM2-135M, {args.drafter}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, {args.threads} threads")
    print("| runtime | decode s | in ONNX Runtime s | loop s | loop share | loop ms per step | tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['runtime']} | {r['seconds']:.2f} | {r['in_sessions_s']:.2f} | {r['loop_s']:.2f} | "
              f"{100 * r['loop_share']:.1f}% | {r['loop_ms_per_step']:.2f} | {r['tokens_per_s']:.1f} |")
    command = " ".join(["python", "benchmarks/loop_overhead.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps({"command": command, "settings": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
