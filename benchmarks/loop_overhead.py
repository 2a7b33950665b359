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
"""
from __future__ import annotations

import argparse
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="hydra+token_recycling")
    ap.add_argument("--tree", default='{"token_recycling": {"tree": [[0], [1], [2], [0, 0]]}}',
                    help="drafter_options as JSON (default: the README's Token Recycling tree)")
    ap.add_argument("--limit", type=int, default=3, help="prompts per file (default 3)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
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
    rows = []
    for name, runner in (("onnxruntime", fast), ("engine", engine)):
        clock = [0.0]
        wrapped = wrap_sessions(runner, clock)
        numpy_in = name == "engine"

        def run(ids):
            runner.generate(ids.numpy() if numpy_in else ids, max_new_tokens=args.max_new_tokens,
                            eos_token_id=tok.eos_token_id)
            return runner.last_stats

        run(prompts[0])  # warm-up
        clock[0], seconds, tokens, steps = 0.0, 0.0, 0, 0
        for ids in prompts:
            stats = run(ids)
            seconds, tokens, steps = seconds + stats["seconds"], tokens + stats["new_tokens"], steps + stats["steps"]
        loop = seconds - clock[0]
        rows.append({"runtime": name, "sessions_wrapped": wrapped, "seconds": seconds, "in_sessions_s": clock[0],
                     "loop_s": loop, "loop_share": loop / seconds, "tokens_per_s": tokens / seconds,
                     "steps": steps, "loop_ms_per_step": 1e3 * loop / steps})
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
