"""Every CPU backend against HF greedy decoding, SmolLM2-135M, in one run: end-to-end tokens/s and
per-step latency (1 token and a 16-node tree).

    python benchmarks/backends.py                          # 4 shared files x 1 prompt, 256 new tokens, 2 threads
    python benchmarks/backends.py --backends eager,onnxruntime,engine --limit 1 --max-new-tokens 64   # quicker
    python benchmarks/backends.py --tree auto     # speculative rows on each backend's autotuned tree
    python benchmarks/backends.py --drafter token_recycling --drafter 'hydra+token_recycling=[[0],[1],[2],[0,0]]'
                                                  # several drafters' rows in one run, each with its own tree

Rows (each with plain decoding and with every --drafter, default token_recycling):
    hf_greedy            HF `model.generate(do_sample=False)`, the reference every row is compared with
    eager                the FX graph after the CPU lowering passes (backends/eager.py)
    inductor             torch.compile / TorchInductor of that graph (compiled during the warm-up)
    onnxruntime          exported ONNX in ONNX Runtime sessions, decode loop in Python/torch
    engine               the same graph as an exported engine directory run by speccomp/engine/runtime.py's
                         numpy loop (IO binding; no torch on the hot path); in this process, so timed alike
    llama_cpp            a peer, not speccomp: llama.cpp (llama-cpp-python, an optional benchmark dependency:
                         `pip install llama-cpp-python`, built from source) greedy on the very GGUF file the
                         default model loads from (Q4_1 weights, quantized activations: NOT exact; its row
                         says how many replies equal HF's float32 greedy reply, and how many tokens they share
                         before the first difference). Only with --backends naming it.
Each backend runs in its own child process (--in-process: all in this one), next to HF greedy timed in
that same process: with every backend's models resident in one process, ONNX Runtime ran 20-35% slower
(measured: 21.1 vs 28.7 tok/s for the same row). Within a process, for every prompt all rows run back to
back in an order that rotates from prompt to prompt, after one untimed warm-up per row. Speedup = HF
seconds / row seconds over the same prompts (ratio of sums) and the geometric mean of the per-prompt ratios
(a reply that loops cannot dominate it), also per shared file (`geomean_by_file`: a file whose replies repeat
the question cannot carry the others); tau = new tokens / steps over all prompts.

Step latency: one forward of the target verify graph (after TreeAttention) with 300 cached tokens, for
q = 1 and for the 16-node tree of the first 15 drafts of token_recycling's default template; median of
--repeats runs per backend, in one process. `triton` and the GPU backends are left out: the Triton
kernel runs on CPU only in the (slow) interpreter, and this machine has no GPU.

Writes the tables to stdout and everything to --json (default benchmarks/results_backends.json).
Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROMPTS_DIR = HERE.parent / "speccomp" / "data" / "prompts"  # shipped prompt sets
FILES = ("alpaca", "gsm8k", "humaneval", "vicuna_bench")
BACKENDS = ("eager", "inductor", "onnxruntime", "engine")
sys.path.insert(0, str(HERE))
from step_cost import median_ms  # noqa: E402  (one warm-up call, then the median in ms)


def bench_tree(q: int):
    """The first q nodes of token_recycling's default template (q = 1: the root alone)."""
    from speccomp.drafters.ngram import DEFAULT_RECYCLING_TREE
    from speccomp.runtime.tree import Tree

    return Tree.from_choices(DEFAULT_RECYCLING_TREE[: q - 1]) if q > 1 else Tree.from_parents([-1])


def skip_indices(text: str) -> str:
    """--skip's type: comma-separated 0-based prompt indices (kept as given: it is passed on to child processes)."""
    if not all(i.strip().isdigit() for i in text.split(",") if i.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated 0-based prompt indices (e.g. --skip 2,3)")
    return text


def select_prompts(tok, files: str, limit: int, skip: str) -> list:
    """(file, chat-templated ids) of the first `limit` prompts of each shipped file in `files` (comma-separated),
    leaving out the 0-based indices in `skip`: the prompts of a run, here and in hf_alone.py."""
    from speccomp.models import chat_ids
    from speccomp.prompts import load_prompts

    left_out = {int(i) for i in skip.split(",") if i.strip()}
    return [(f, chat_ids(tok, p.text)) for f in files.split(",")
            for i, p in enumerate(load_prompts(PROMPTS_DIR / f"{f}.jsonl", limit=limit)) if i not in left_out]


def by_file(row: dict) -> str:
    """A row's geometric means per shared file, as a table cell."""
    return " / ".join(f"{g:.2f}x" for g in row["geomean_by_file"].values())


def step_inputs(sg, q: int, past: int):
    """Inputs of the verify graph: q tokens (bench_tree) against `past` cached ones."""
    from speccomp.frontend.convention import example_inputs

    tree = bench_tree(q)
    ids, _, mask, past_kv = example_inputs(sg.captured.kv, q, past, vocab_size=sg.captured.vocab_size)
    return ids, tree.positions(past), mask, past_kv, tree.mask


def llama_cpp_row(args, eos: int):
    """A generate(ids) -> (new tokens, {}) of llama.cpp on the default model's own GGUF file: greedy (top_k=1,
    temperature 0, no repeat penalty), the prompt's token ids as they are (same chat template and tokens as every
    other row), stopping at the eos token (kept, as HF keeps it) or after --max-new-tokens."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit("backend llama_cpp needs llama-cpp-python (`pip install llama-cpp-python`: an optional "
                         "benchmark dependency, it builds llama.cpp from source)") from None
    from speccomp.models import gguf_path

    llm = Llama(model_path=str(gguf_path()), n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads,
                verbose=False)

    for _ in zip(range(4), llm.generate([eos] * 8, top_k=1, temp=0.0, repeat_penalty=1.0)):
        pass  # warm-up, as every other row has: first-call costs are not timed

    def run(ids):
        llm.reset()  # no prefix reuse from the previous call: every row prefills its whole prompt
        out = []
        for t in llm.generate(ids[0].tolist(), top_k=1, temp=0.0, repeat_penalty=1.0):
            out.append(t)
            if t == eos or len(out) == args.max_new_tokens:
                break
        return out, {}

    return run


def run_children(args, backends: list[str], argv) -> int:
    """Each backend in its own process (HF greedy timed alongside it there); one merged report."""
    import subprocess

    tmp = Path(tempfile.mkdtemp(prefix="speccomp-bench-"))
    common = [x for d in args.drafter for x in ("--drafter", d)] + ["--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens),
              "--threads", str(args.threads), "--past", str(args.past), "--repeats", str(args.repeats),
              "--files", args.files, "--skip", args.skip]
    common += ["--tree", args.tree] if args.tree else []
    children = {}
    for backend in backends:
        out = tmp / f"{backend}.json"
        print(f"--- {backend} (child process) ---", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, __file__, *common, "--backends", backend, "--in-process", "--json", str(out)],
                       check=False)
        if not out.exists():
            print(f"{backend}: the child process wrote no results", file=sys.stderr)
            continue
        children[backend] = json.loads(out.read_text())
    e2e, latency = [], []
    for backend, child in children.items():
        hf = next(r for r in child["end_to_end"] if r["row"] == "hf_greedy")
        for r in child["end_to_end"]:
            if r["row"] != "hf_greedy":
                e2e.append(dict(r, hf_tokens_per_second=hf["tokens_per_second"]))
        latency += child["step_latency"]
    report = {"machine": {b: c["machine"] for b, c in children.items()}, "settings": vars(args),
              "command": " ".join(["python", "benchmarks/backends.py", *(argv if argv is not None else sys.argv[1:])]),
              "end_to_end": e2e, "step_latency": latency, "processes": children}
    print(f"\nend to end: SmolLM2-135M, {args.max_new_tokens} new tokens, {args.threads} threads; one process per backend, "
          "speedup against HF greedy timed in that process")
    print("| row | tokens/s | HF greedy tokens/s (same process) | speedup vs HF greedy (total / geomean per prompt) "
          f"| geomean {' / '.join(e2e[0]['geomean_by_file'])} | tau | replies equal to HF's | setup s |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for r in e2e:
        print(f"| {r['row']} | {r['tokens_per_second']:.1f} | {r['hf_tokens_per_second']:.1f} | {r['speedup_vs_hf']:.2f}x / "
              f"{r['geomean_speedup_vs_hf']:.2f}x | {by_file(r)} | {r['tau']:.2f} | {r['replies_equal_to_hf']}/{r['prompts']} | "
              f"{r['setup_seconds']:.0f} |")
    print(f"\nstep latency: one verify forward with {args.past} cached tokens (median of {args.repeats})")
    print("| backend | 1 token ms | 16-node tree ms | tree / token |")
    print("|---|---:|---:|---:|")
    for backend in dict.fromkeys(r["backend"] for r in latency):
        one = next(r["ms"] for r in latency if r["backend"] == backend and r["q"] == 1)
        tree = next(r["ms"] for r in latency if r["backend"] == backend and r["q"] == 16)
        print(f"| {backend} | {one:.1f} | {tree:.1f} | {tree / one:.2f} |")
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.json}")
    exact = [r for r in e2e if r["row"] != "llama_cpp"]  # the peer is not exact, and not speccomp's contract
    return 0 if exact and all(r["identical"] for r in exact) and len(children) == len(backends) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated (default {','.join(BACKENDS)})")
    ap.add_argument("--drafter", action="append", help="drafter of speculative rows, NAME or NAME=TREE (its own tree); "
                                                       "repeat for several (default token_recycling)")
    ap.add_argument("--tree", default=None,
                    help="tree of the speculative rows: 'auto' (each backend's stored `speccomp autotune` result) or a "
                         "spec as for compile (default: the drafter's own default tree)")
    ap.add_argument("--limit", type=int, default=1, help="prompts per shared file (default 1)")
    ap.add_argument("--files", default=",".join(FILES), help=f"shared prompt files (default {','.join(FILES)})")
    ap.add_argument("--skip", default="", type=skip_indices, help="0-based prompt indices to leave out of every file, comma-separated "
                                               "(e.g. the prompts a tree was calibrated on)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--past", type=int, default=300, help="cached tokens in the step-latency rows (default 300)")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per step-latency cell (default 20)")
    ap.add_argument("--json", default=str(HERE / "results_backends.json"))
    ap.add_argument("--in-process", action="store_true",
                    help="all backends in this one process (default: one child process per backend, each with its "
                         "own HF baseline; models of other backends resident in the same process slow ONNX Runtime)")
    args = ap.parse_args(argv)
    args.drafter = args.drafter or ["token_recycling"]
    # a row per --drafter as given (NAME or NAME=TREE): the same drafter may come twice with two trees
    drafters = {d: (d.split("=", 1)[0], d.split("=", 1)[1] if "=" in d else args.tree) for d in args.drafter}
    backends = [b for b in args.backends.split(",") if b]
    if not args.in_process and len(backends) > 1:
        return run_children(args, backends, argv)

    import speccomp

    torch.set_num_threads(args.threads)
    model, tok = speccomp.load_default_model()
    eos = tok.eos_token_id
    prompts = select_prompts(tok, args.files, args.limit, args.skip)
    load = lambda: " ".join(f"{x:.2f}" for x in os.getloadavg())  # noqa: E731
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "load_start": load()},
              "settings": vars(args), "command": " ".join(["python", "benchmarks/backends.py", *(argv or sys.argv[1:])])}

    # ---- build every row -----------------------------------------------------------------------
    rows: dict[str, object] = {}  # name -> generate(ids) -> (new tokens list, stats dict)
    if "llama_cpp" in backends:
        rows["llama_cpp"] = llama_cpp_row(args, eos)
    setup: dict[str, float] = {}
    steps: dict[str, object] = {}  # backend -> the verify step (for latency)
    tmp = Path(tempfile.mkdtemp(prefix="speccomp-bench-"))

    def hf(ids):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos)
        return out[0, ids.shape[1]:].tolist(), {}

    rows["hf_greedy"] = hf
    ort_models = {}  # drafter -> the onnxruntime rows' compiled models; the engine rows export these
    order = [b for b in backends if b not in ("engine", "llama_cpp")] + (["engine"] if "engine" in backends else [])
    for backend in order:
        for spec in (None, *drafters):
            name = f"{backend}/{spec or 'plain'}"
            drafter, tree = drafters.get(spec, (None, None))
            start = time.perf_counter()
            if backend == "engine":
                fast = ort_models.get(spec) or speccomp.compile(model, drafter=drafter, backend="onnxruntime", tree=tree)
                engine = speccomp.load(fast.export(tmp / f"engine{len(setup)}", tokenizer=tok), threads=args.threads)
                del fast  # compiled only to export: its ONNX Runtime sessions (and weights) leave the process
                gc.collect()

                def run(ids, engine=engine):
                    out = engine.generate(ids.numpy(), max_new_tokens=args.max_new_tokens, eos_token_id=eos)
                    return out[0, ids.shape[1]:].tolist(), engine.last_stats

                if drafter is not None:
                    steps["engine"] = engine
            else:
                fast = speccomp.compile(model, drafter=drafter, backend=backend, tree=tree)
                if backend == "onnxruntime":
                    ort_models[spec] = fast

                def run(ids, fast=fast):
                    out = fast.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
                    return out[0, ids.shape[1]:].tolist(), fast.last_stats

                if drafter is not None:
                    steps[backend] = fast
            run(prompts[0][1][:, :32])  # warm-up; inductor compiles here (prefill, 1 token, tree classes)
            setup[name] = time.perf_counter() - start
            rows[name] = run
            print(f"built {name} in {setup[name]:.0f}s", file=sys.stderr)

    # ---- end to end -----------------------------------------------------------------------------
    names = list(rows)
    seconds = {n: 0.0 for n in names}
    tokens = {n: 0 for n in names}
    taus = {n: [] for n in names}
    identical = {n: True for n in names}
    per_prompt = {n: [] for n in names}  # seconds of each prompt
    shared = {n: [] for n in names}  # tokens equal to HF's reply before the first difference, per prompt
    same = {n: 0 for n in names}  # prompts whose reply equals HF's
    for i, (file, ids) in enumerate(prompts):
        order = names[i % len(names):] + names[: i % len(names)]
        ref = None
        results = {}
        for n in order:
            start = time.perf_counter()
            out, stats = rows[n](ids)
            per_prompt[n].append(time.perf_counter() - start)
            seconds[n] += per_prompt[n][-1]
            tokens[n] += len(out)
            results[n] = out
            if stats:
                taus[n].append((stats["new_tokens"], stats["steps"]))
        ref = results["hf_greedy"]
        for n in names:
            identical[n] &= results[n] == ref
            shared[n].append(next((k for k, (a, b) in enumerate(zip(results[n], ref)) if a != b), min(len(ref), len(results[n]))))
            same[n] += results[n] == ref
        print(f"prompt {i + 1}/{len(prompts)} ({file}) done", file=sys.stderr)
    e2e = []
    for n in names:
        e2e.append({
            "row": n, "tokens_per_second": tokens[n] / seconds[n], "speedup_vs_hf": seconds["hf_greedy"] / seconds[n],
            "geomean_speedup_vs_hf": statistics.geometric_mean(h / s for h, s in zip(per_prompt["hf_greedy"], per_prompt[n])),
            "prompt_seconds": per_prompt[n],
            "tau": sum(t for t, _ in taus[n]) / sum(s for _, s in taus[n]) if taus[n] else 1.0,  # tokens per step
            "identical": identical[n], "setup_seconds": setup.get(n, 0.0), "replies_equal_to_hf": same[n],
            "prompts": len(prompts), "tokens_shared_with_hf": shared[n],
            # per shared file: a file whose replies repeat the question (gsm8k) must not carry the others
            "geomean_by_file": {f: statistics.geometric_mean(
                h / s for (g, _), h, s in zip(prompts, per_prompt["hf_greedy"], per_prompt[n]) if g == f)
                for f in dict.fromkeys(g for g, _ in prompts)},
        })
    report["end_to_end"] = e2e

    # ---- per-step latency -----------------------------------------------------------------------
    latency = []
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)  # as in generate: a step called with autograd on records a graph, ~50x slower at q=1
    for backend, obj in steps.items():
        for q in (1, 16):
            if backend == "engine":  # the engine's own session call: numpy inputs, IO binding
                from speccomp.engine.runtime import KVCache, tree_arrays

                depth, tree_mask, _ = tree_arrays(list(bench_tree(q).parents))
                cache = KVCache(obj.kv, args.past + q, obj.dtype)
                cache.length = args.past
                toks = list(range(5, 5 + q))
                ms = median_ms(lambda: obj._forward(cache, toks, args.past + depth, tree_mask), args.repeats)
            else:
                inputs = step_inputs(obj.graph, q, args.past)
                ms = median_ms(lambda: obj.step(*inputs), args.repeats)
            latency.append({"backend": backend, "q": q, "ms": ms})
    torch.set_grad_enabled(grad)
    report["step_latency"] = latency
    report["machine"]["load_end"] = load()

    # ---- tables ---------------------------------------------------------------------------------
    print(f"\nend to end: SmolLM2-135M, {len(prompts)} prompts ({args.files}; {args.limit} each, skipping {args.skip or 'none'}), "
          f"{args.max_new_tokens} new tokens, {args.threads} threads")
    print(f"| row | tokens/s | speedup vs HF greedy | geomean {' / '.join(e2e[0]['geomean_by_file'])} | tau | "
          "replies equal to HF's | setup s |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for r in e2e:
        print(f"| {r['row']} | {r['tokens_per_second']:.1f} | {r['speedup_vs_hf']:.2f}x | {by_file(r)} | {r['tau']:.2f} | "
              f"{r['replies_equal_to_hf']}/{r['prompts']} | {r['setup_seconds']:.0f} |")
    print(f"\nstep latency: one verify forward with {args.past} cached tokens (median of {args.repeats})")
    print("| backend | 1 token ms | 16-node tree ms | tree / token |")
    print("|---|---:|---:|---:|")
    for backend in steps:
        one = next(r["ms"] for r in latency if r["backend"] == backend and r["q"] == 1)
        tree = next(r["ms"] for r in latency if r["backend"] == backend and r["q"] == 16)
        print(f"| {backend} | {one:.1f} | {tree:.1f} | {tree / one:.2f} |")
    print(f"load average: start {report['machine']['load_start']}, end {report['machine']['load_end']}")
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.json}")
    return 0 if all(r["identical"] for r in e2e if r["row"] != "llama_cpp") else 1


if __name__ == "__main__":
    sys.exit(main())
