"""Threads of a light drafter graph, A/B in one process: the head step on one ONNX Runtime thread beside a target
whose pool spins (what compile and the engine do now: `Drafter.light_graphs`) against both sessions on --threads
threads with spinning off (the rule before).

    python benchmarks/threads_ab.py                                     # hydra+token_recycling, backend and engine
    python benchmarks/threads_ab.py --drafter eagle --runtimes onnxruntime
    python benchmarks/threads_ab.py --drafter quantized --options '' --light int8,quantized
    python benchmarks/threads_ab.py --drafter '' --kv sink:256 --options '{"weights": "int8"}' --light int8,compressed_kv \
        --tree 4 --context 4096 --max-new-tokens 128      # the packed draft over a compressed cache, one 4096-token prompt x 4

One compile (and one export for the engine); the sessions of that same model are rebuilt under each setting
("before" / "now") from the same ONNX files, and the settings alternate per prompt (rotating order), so both see
the same machine. Prompts: the 3rd to 6th of gsm8k and vicuna_bench, 256 new tokens, after one warm-up. Every
reply is checked equal between the two settings (same graphs, same drafts). Run it on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = ("before", "now")


def sessions(obj, found: list, kind, depth: int = 6, seen=None) -> list:
    """(owner, attribute, value) of every `kind` instance reachable through attributes, lists and dicts of `obj`."""
    seen = set() if seen is None else seen
    if depth < 0 or id(obj) in seen or not hasattr(obj, "__dict__") or isinstance(obj, type):
        return found
    seen.add(id(obj))
    for name, value in vars(obj).items():
        if isinstance(value, kind):
            found.append((obj, name, value))
        for item in value if isinstance(value, (list, tuple)) else value.values() if isinstance(value, dict) else [value]:
            sessions(item, found, kind, depth - 1, seen)
    return found


def ort_session(path, threads: int, spin: bool):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def variants(runner, runtime: str, threads: int, light_names: list[str]) -> dict:
    """setting -> a function installing that setting's sessions in `runner`. A graph is light when its file's stem
    holds one of `light_names`; the one graph that is not is the target's. Each session holder is copied per setting
    with its own session and its own in-place cache bindings (a binding belongs to the session that made it)."""
    import copy

    from speccomp.backends.onnx_export import OrtStep
    from speccomp.engine.runtime import BoundSession, LayerBindings

    found = sessions(runner, [], BoundSession if runtime == "engine" else OrtStep)
    holders = {id(v): v for _, _, v in found}  # one holder may be reachable from two owners
    paths = {key: Path(v.session._model_path) for key, v in holders.items()}  # the file each session loaded
    light = {key: any(n in p.stem for n in light_names) for key, p in paths.items()}
    if sum(light.values()) != len(holders) - 1:
        raise SystemExit(f"expected one target and light drafter graphs (--light {','.join(light_names)}), found "
                         f"{[p.name for p in paths.values()]}")

    def rebuilt(holder, session):
        new = copy.copy(holder)
        new.session = session
        if runtime == "engine":
            new.binding, new.in_place = session.io_binding(), LayerBindings(session, holder.layers, holder.presents)
        elif hasattr(holder, "bindings"):  # OrtKVStep: the cache bound in place
            new.bindings = LayerBindings(session, holder.bindings.layers, holder.bindings.presents)
        return new

    built = {"before": {k: rebuilt(h, ort_session(paths[k], threads, spin=False)) for k, h in holders.items()},
             "now": {k: rebuilt(h, ort_session(paths[k], 1 if light[k] else threads, spin=not light[k]))
                     for k, h in holders.items()}}

    def install(setting):
        def run():
            for owner, name, value in found:
                setattr(owner, name, built[setting][id(value)])
        return run
    return {s: install(s) for s in SETTINGS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="hydra+token_recycling")
    ap.add_argument("--options", default='{"token_recycling": {"tree": [[0], [1], [2], [0, 0]]}}',
                    help="drafter_options as JSON ('' for none)")
    ap.add_argument("--runtimes", default="onnxruntime,engine")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--light", default="hydra,eagle,medusa", help="drafter graphs to run on one thread in the 'now' "
                    "setting: substrings of their ONNX files' stems, comma-separated (the quantized self-drafter: "
                    "int8,quantized for its backend and engine files)")
    ap.add_argument("--tree", help="tree= of the compile (a spec such as 4 or dynamic:16:4, or JSON choices)")
    ap.add_argument("--kv", help="kv_cache= of the compile (e.g. sink:256: the model drafts over that compressed cache)")
    ap.add_argument("--context", type=int, default=0, help="one prompt of this many tokens (every shipped prompt's text "
                    "run together), decoded --repeats times, instead of the chat prompts")
    ap.add_argument("--repeats", type=int, default=4, help="with --context: how many times (settings alternating)")
    ap.add_argument("--json", default=str(HERE / "results_threads_ab.json"))
    args = ap.parse_args(argv)

    import torch

    import speccomp
    from speccomp.models import chat_ids
    from speccomp.prompts import SETS, load_prompts
    from speccomp.runtime.tree import parse_tree_spec

    torch.set_num_threads(args.threads)
    model, tok = speccomp.load_default_model()
    prompts = [chat_ids(tok, p.text) for f in ("gsm8k", "vicuna_bench") for p in load_prompts(f, limit=6)[2:6]]
    if args.context:
        text = "\n\n".join(p.text for f in SETS for p in load_prompts(f))
        prompts = [tok(text, return_tensors="pt").input_ids[:, : args.context]] * args.repeats
    options = json.loads(args.options) if args.options else None
    tree = args.tree and parse_tree_spec(json.loads(args.tree) if args.tree.startswith("[") else args.tree)
    fast = speccomp.compile(model, drafter=args.drafter or None, drafter_options=options, kv_cache=args.kv, tree=tree,
                            backend="onnxruntime")
    rows = []
    for runtime in args.runtimes.split(","):
        runner = fast if runtime == "onnxruntime" else speccomp.load(
            fast.export(Path(tempfile.mkdtemp()) / "engine"), threads=args.threads)
        as_input = (lambda ids: ids.numpy()) if runtime == "engine" else (lambda ids: ids)
        install = variants(runner, runtime, args.threads, args.light.split(","))
        totals = {s: [0.0, 0, 0, 0.0] for s in SETTINGS}  # seconds, new tokens, steps, prefill seconds
        for i, ids in enumerate(prompts):
            replies = {}
            for setting in SETTINGS[i % 2:] + SETTINGS[: i % 2]:
                install[setting]()
                if i == 0:
                    runner.generate(as_input(ids), max_new_tokens=16, eos_token_id=tok.eos_token_id)
                replies[setting] = runner.generate(as_input(ids), max_new_tokens=args.max_new_tokens,
                                                   eos_token_id=tok.eos_token_id)
                stats = runner.last_stats
                for k, v in enumerate((stats["seconds"], stats["new_tokens"], stats["steps"], stats["prefill_seconds"])):
                    totals[setting][k] += v
            if not all((torch.as_tensor(replies[s]) == torch.as_tensor(replies["now"])).all() for s in SETTINGS):
                raise SystemExit(f"prompt {i}: the two settings decoded different replies")
            print(f"{runtime} prompt {i + 1}/{len(prompts)} done", file=sys.stderr)
        for setting, (seconds, tokens, steps, prefill) in totals.items():
            rows.append({"runtime": runtime, "setting": setting, "seconds": seconds, "tokens": tokens, "steps": steps,
                         "prefill_seconds": prefill, "tokens_per_s": tokens / seconds,
                         "decode_tokens_per_s": tokens / (seconds - prefill), "ms_per_step": 1e3 * (seconds - prefill) / steps})
        if runtime == "engine":
            del runner
    what = args.drafter or (f"the compressed cache's self-drafter (kv_cache={args.kv})" if args.kv else "plain")
    print(f"\nSmolLM2-135M, {what}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
          f"{args.threads} threads")
    print("| runtime | before: every session 2 threads, none spinning, tok/s | now: light graphs 1 thread, target "
          "spinning, tok/s | now / before | decode only (prefill left out): before / now tok/s, now / before |")
    print("|---|---:|---:|---:|---|")
    for runtime in args.runtimes.split(","):
        before, now = (next(r for r in rows if r["runtime"] == runtime and r["setting"] == s) for s in SETTINGS)
        b, n = before["decode_tokens_per_s"], now["decode_tokens_per_s"]
        print(f"| {runtime} | {before['tokens_per_s']:.1f} | {now['tokens_per_s']:.1f} | "
              f"{now['tokens_per_s'] / before['tokens_per_s']:.2f}x | {b:.1f} / {n:.1f}, {n / b:.2f}x |")
    command = " ".join(["python", "benchmarks/threads_ab.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps({"command": command, "settings": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
