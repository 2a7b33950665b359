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

`--before [CHANGES]` adds, for each runtime, a row with the loop as it was before these changes (default: all),
the same run's A/B of them:
    binding   the KV cache's layers bound to the session afresh every run (`LayerBindings`,
              speccomp/engine/runtime.py, now keeps them bound; both runtimes)
    argmax    torch's argmax for greedy acceptance (runtime/sampling.py `argmax` scans with numpy; the torch loop)
    topk      a drafter's top k over the vocabulary as it was: torch.topk (Token Recycling's observe, Medusa's
              heads) and log_softmax + topk (a graph drafter's expand) in the torch loop, numpy's whole log-softmax
              and argpartition in the engine's expand (both now runtime/topk.py's grouped top k; the engine's Token
              Recycling reads a TopK in its graph either way)
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


CHANGES = ("binding", "argmax", "topk")


@contextlib.contextmanager
def before(changes):
    """The loop as it was before `changes` (the module docstring): every in-place session binds the cache's layers
    afresh each run (LayerBindings forgetting what it bound), greedy acceptance takes torch's argmax, the drafters'
    top k over the vocabulary is torch's topk (the torch loop) or numpy's argpartition (the engine)."""
    import numpy as np

    import speccomp.drafters.draft_model as draft_model
    import speccomp.drafters.graph as graph
    import speccomp.drafters.head_drafters as heads
    import speccomp.drafters.ngram as ngram
    import speccomp.engine.runtime as engine
    import speccomp.runtime.decode as decode
    from host_ops import numpy_top_ids, numpy_top_logp  # the engine's top k before runtime/topk.py
    from speccomp.engine.runtime import LayerBindings

    kept, numpy_argmax = LayerBindings.binding, decode.argmax
    tops = [(m, name, getattr(m, name)) for m, name in ((ngram, "top_ids"), (heads, "top_ids"), (graph, "torch_top"),
                                                        (draft_model, "torch_top"), (engine, "top_k"), (engine, "top_logp"))]

    def afresh(self, buffer, outputs):
        self._kept.clear()
        return kept(self, buffer, outputs)

    if "binding" in changes:
        LayerBindings.binding = afresh
    if "argmax" in changes:
        decode.argmax = lambda logits: logits.argmax(-1)
    if "topk" in changes:
        ngram.top_ids = heads.top_ids = lambda logits, k: logits.topk(min(k, logits.shape[-1]), dim=-1).indices
        graph.torch_top = draft_model.torch_top = lambda logits, k: tuple(
            x.tolist() for x in logits.float().log_softmax(-1).topk(k, dim=-1))
        engine.top_k = lambda scores, k: (None, numpy_top_ids(scores, k))
        engine.top_logp = lambda logits, k: tuple(np.asarray(x) for x in numpy_top_logp(logits, k))
    try:
        yield
    finally:
        LayerBindings.binding, decode.argmax = kept, numpy_argmax
        for module, name, value in tops:
            setattr(module, name, value)


def undone(name: str, changes) -> str:
    """What a `before` row of runtime `name` puts back (the engine's argmax never went through torch)."""
    words = {"binding": "layers rebound every run", "argmax": "torch's argmax",
             "topk": "numpy's argpartition top k" if name == "engine" else "torch's topk"}
    return ", ".join(words[c] for c in changes if name != "engine" or c != "argmax") or "nothing put back: an A/A row"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="hydra+token_recycling")
    ap.add_argument("--tree", default='{"token_recycling": {"tree": [[0], [1], [2], [0, 0]]}}',
                    help="drafter_options as JSON (default: the README's Token Recycling tree)")
    ap.add_argument("--limit", type=int, default=3, help="prompts per file (default 3)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--before", nargs="?", const=",".join(CHANGES), default="",
                    help=f"also each runtime's loop as it was before these changes (A/B), comma-separated from "
                         f"{','.join(CHANGES)} (bare: all)")
    ap.add_argument("--json", default=str(HERE / "results_loop_overhead.json"))
    args = ap.parse_args(argv)
    changes = [c for c in args.before.split(",") if c]
    if set(changes) - set(CHANGES):
        ap.error(f"--before {args.before}: unknown change(s) {sorted(set(changes) - set(CHANGES))}; choose from "
                 f"{','.join(CHANGES)}")

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
    variants += [(name, runner, True) for name, runner, _ in variants] if changes else []
    totals = {(name, old): {"seconds": 0.0, "in_sessions_s": 0.0, "tokens": 0, "steps": 0}
              for name, _, old in variants}

    def run(name, runner, old, ids):
        with before(changes) if old else contextlib.nullcontext():
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
        rows.append({"runtime": name + (f", before ({undone(name, changes)})" if old else ""),
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
