"""`speccomp bench`: every drafter against HF greedy decoding, on the same prompts, in one run.

For each prompt the rows run back to back (their order rotates from prompt to prompt), so machine
noise hits all rows alike:

    hf_greedy         HF `model.generate(do_sample=False)`: the baseline every other row is checked against
    hf_prompt_lookup  HF assisted generation with `prompt_lookup_num_tokens=10` (a peer, not speccomp)
    plain             speccomp without a drafter (one token per target forward)
    <drafter>         `speccomp.compile(model, drafter=<drafter>)` for each requested drafter

Definitions (per row, over the prompts the row ran):
    tokens_per_second  sum(new tokens) / sum(wall seconds of generate)
    speedup            sum(baseline seconds) / sum(row seconds)   (a ratio of sums, same prompts)
    tau                mean over prompts of new tokens / target forwards (prefill included); HF rows
                       count forwards with a forward pre-hook on the model
    acceptance_by_depth  mean over prompts of `last_stats["acceptance_by_depth"]` (depth d averages the
                       prompts that drafted to depth d); empty for HF rows
    identical          every prompt's output tokens equal the baseline's exactly

Python use (tests run this on a tiny random model with token-id prompts):

    result = run_bench(model, [ids1, ids2], ["plain", "layer_skip"], max_new_tokens=32)
    print(result.markdown()); result.write_json("out.json"); result.plot("out.png")

The command line (`add_bench_parser`, `cmd_bench`) lives in speccomp/cli.py; the prompt files it reads load
here (`load_bench_prompts`). Heavy imports (torch, transformers, matplotlib, tqdm) stay inside functions so
`speccomp --help` is quick.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

BASELINE = "hf_greedy"
PROMPT_LOOKUP = "hf_prompt_lookup"
PLAIN = "plain"
PROMPT_LOOKUP_TOKENS = 10
SCHEMA_VERSION = 1


# ---- Inputs: prompts and rows ------------------------------------------------------------------
@dataclass(frozen=True)
class BenchPrompt:
    """One prompt as token ids [1, n] (already chat-templated when it came from text)."""

    id: str
    category: str
    input_ids: Any  # torch.LongTensor [1, n]


@dataclass(frozen=True)
class RowSpec:
    """One row of the table. kind: "hf_greedy" | "hf_prompt_lookup" | "speccomp"."""

    name: str
    kind: str
    drafter: str | None = None  # speccomp rows: drafter name (None = plain decoding)
    tree: Any = None  # speccomp drafter rows: the `tree=` given to speccomp.compile
    drafter_options: dict | None = None
    kv_cache: str | None = None  # KV-compression rows: the `kv_cache=` policy ...
    kv_mode: str | None = None  # ... and `kv_mode=` ("draft": lossless; "target": LOSSY)

    @property
    def lossy(self) -> bool:
        return self.kv_mode == "target"


def kv_rows(policies: str, mode: str = "draft") -> list[RowSpec]:
    """Rows for `speccomp bench --kv sink:256,kivi4 [--kv-mode target]`, named e.g. "kv-draft sink:256"."""
    from speccomp.kv.policies import parse_kv_cache

    if mode not in ("draft", "target"):
        raise ValueError(f"unknown --kv-mode {mode!r}; accepted: draft (lossless), target (LOSSY)")
    out = []
    for spec in [p.strip() for p in policies.split(",") if p.strip()]:
        parse_kv_cache(spec)  # a bad policy or budget fails before the model loads
        name = f"kv-{mode} {spec}" + (" (LOSSY)" if mode == "target" else "")
        if name in {r.name for r in out}:
            raise ValueError(f"--kv names {spec!r} twice; name each policy once")
        out.append(RowSpec(name, "speccomp", kv_cache=spec, kv_mode=mode))
    if not out:
        raise ValueError("--kv needs at least one policy, e.g. --kv sink:256,kivi4")
    return out


def row_spec(row: str | RowSpec, tree=None) -> RowSpec:
    """A RowSpec from a name: "hf_prompt_lookup", "plain" (or "none"), or a drafter name."""
    if isinstance(row, RowSpec):
        return row
    if not isinstance(row, str) or not row:
        raise ValueError(f"a bench row is a RowSpec or a name, got {row!r}")
    if row == BASELINE:
        raise ValueError(f"{BASELINE!r} is the baseline; it is always measured, do not list it")
    if row == PROMPT_LOOKUP:
        return RowSpec(PROMPT_LOOKUP, PROMPT_LOOKUP)
    if row in (PLAIN, "none"):
        return RowSpec(PLAIN, "speccomp")
    return RowSpec(row, "speccomp", drafter=row, tree=tree)


def default_rows(drafters: Sequence[str] | None = None, *, plain: bool = True, hf_prompt_lookup: bool = True, tree=None) -> list[RowSpec]:
    """The standard rows (baseline excluded): HF prompt lookup, plain speccomp, then every drafter.

    drafters=None means all of `speccomp.available_drafters()` at call time.
    """
    if drafters is None:
        from speccomp.drafters.registry import available_drafters

        drafters = available_drafters()
    rows = ([row_spec(PROMPT_LOOKUP)] if hf_prompt_lookup else []) + ([row_spec(PLAIN)] if plain else [])
    return rows + [row_spec(d, tree) for d in drafters]


def prepare_prompts(prompts: Sequence, tokenizer=None) -> list[BenchPrompt]:
    """BenchPrompts from token-id tensors / lists, BenchPrompts, or `speccomp.prompts.Prompt`s.

    Text prompts (Prompt) need `tokenizer` and get the chat template (`models.chat_ids`).
    Bare token ids get ids "0", "1", ... and category "default".
    """
    import torch

    from speccomp.prompts import Prompt

    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, BenchPrompt):
            ids, pid, cat = p.input_ids, p.id, p.category
        elif isinstance(p, Prompt):
            if tokenizer is None:
                raise ValueError(f"prompt {p.id!r} is text; give a tokenizer (or pass token ids)")
            from speccomp.models import chat_ids

            ids, pid, cat = chat_ids(tokenizer, p.text), p.id, p.category
        elif isinstance(p, (torch.Tensor, list, tuple)):
            ids, pid, cat = p, str(i), "default"
        else:
            raise ValueError(f"prompt {i}: expected token ids, a BenchPrompt or a Prompt, got {type(p).__name__}")
        ids = torch.as_tensor(ids)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ValueError(f"prompt {pid!r}: token ids must have shape [n] or [1, n] with n > 0, got {tuple(ids.shape)}")
        out.append(BenchPrompt(str(pid), str(cat or "default"), ids.long()))
    if not out:
        raise ValueError("no prompts to benchmark")
    # ids must be unique: results are matched to the baseline by id. Files number their prompts from 0 each,
    # so prompts from several files repeat ids; a repeat becomes "id#2", "id#3", ...
    used: set[str] = set()
    for k, p in enumerate(out):
        pid, n = p.id, 1
        while pid in used:  # "0", "0", "0#2" -> "0", "0#2", "0#2#2": bump until free
            n += 1
            pid = f"{p.id}#{n}"
        used.add(pid)
        out[k] = BenchPrompt(pid, p.category, p.input_ids)
    return out


# ---- Results -----------------------------------------------------------------------------------
@dataclass
class Measurement:
    prompt_id: str
    category: str
    new_tokens: int
    seconds: float
    forwards: int | None  # target forwards, prefill included (None: unknown)
    acceptance_by_depth: list
    identical: bool
    kv: dict | None = None  # KV rows: bytes held (last_stats kv_* entries)

    @property
    def tau(self) -> float | None:
        return self.new_tokens / self.forwards if self.forwards else None


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _kv_bytes(kvs: list[dict]) -> dict | None:
    """Mean over prompts of the KV bytes a row held at the end of generation: compressed (the draft
    cache in mode draft, the target's in mode target), and the full cache for the same tokens."""
    if not kvs:
        return None
    held = [k.get("kv_bytes_draft", k.get("kv_bytes_target")) for k in kvs]
    full = [k["kv_bytes_full"] for k in kvs]
    return {"compressed": _mean(held), "full": _mean(full), "ratio": _mean(full) / _mean(held) if _mean(held) else None}


def _mean_by_depth(lists) -> list[float]:
    depth = max((len(a) for a in lists), default=0)
    return [_mean([a[d] for a in lists if len(a) > d]) for d in range(depth)]


@dataclass
class RowResult:
    spec: RowSpec
    backend: str | None = None
    compile_seconds: float | None = None
    measurements: list[Measurement] = field(default_factory=list)
    error: str | None = None
    drafting: bool | None = None  # the compiled model has a drafter (not plain, kv_mode target, or a tree="auto"
    # where autotune found no tree paid here); None for HF rows and rows that failed to compile

    @property
    def identical(self) -> bool:
        return self.error is None and bool(self.measurements) and all(m.identical for m in self.measurements)

    def _aggregate(self, ms: list[Measurement], base: dict[str, float]) -> dict:
        secs, toks = sum(m.seconds for m in ms), sum(m.new_tokens for m in ms)
        base_secs = sum(base[m.prompt_id] for m in ms)
        return {"prompts": len(ms), "new_tokens": toks, "seconds": secs,
                "tokens_per_second": toks / secs if secs > 0 else None,
                "speedup": base_secs / secs if ms and secs > 0 else None, "tau": _mean([m.tau for m in ms])}

    def summary(self, baseline_seconds: dict[str, float]) -> dict:
        """The JSON row. `baseline_seconds`: prompt id -> baseline seconds."""
        ms = self.measurements
        spec = self.spec
        row = {
            "drafter": spec.name, "kind": "hf" if spec.kind in (BASELINE, PROMPT_LOOKUP) else "speccomp",
            "tree": None if spec.tree is None else str(spec.tree), "drafter_options": spec.drafter_options,
            "backend": self.backend, "compile_seconds": self.compile_seconds, **self._aggregate(ms, baseline_seconds),
            "acceptance_by_depth": _mean_by_depth([m.acceptance_by_depth for m in ms]), "identical": self.identical,
            "mismatched_prompts": [m.prompt_id for m in ms if not m.identical], "error": self.error,
            "kv_cache": spec.kv_cache, "kv_mode": spec.kv_mode, "lossless": not spec.lossy,
            "kv_bytes": _kv_bytes([m.kv for m in ms if m.kv]), "drafting": self.drafting,
        }
        cats: dict[str, list[Measurement]] = {}
        for m in ms:
            cats.setdefault(m.category, []).append(m)
        row["per_category"] = {c: self._aggregate(v, baseline_seconds) for c, v in cats.items()}
        row["per_prompt"] = [
            {
                "id": m.prompt_id, "category": m.category, "new_tokens": m.new_tokens, "seconds": m.seconds,
                "forwards": m.forwards, "tau": m.tau, "acceptance_by_depth": m.acceptance_by_depth,
                "identical": m.identical,
            }
            for m in ms
        ]
        return row


@dataclass
class BenchResult:
    header: dict
    rows: list[RowResult]  # rows[0] is the baseline
    prompts: list[BenchPrompt]

    @property
    def baseline(self) -> RowResult:
        return self.rows[0]

    def row_dicts(self) -> list[dict]:
        base = {m.prompt_id: m.seconds for m in self.baseline.measurements}
        return [r.summary(base) for r in self.rows]

    def to_dict(self) -> dict:
        return {"header": self.header, "rows": self.row_dicts()}

    def write_json(self, path) -> None:
        from speccomp.models import write_atomically

        write_atomically(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")  # never half a file

    def categories(self) -> list[str]:
        return list(dict.fromkeys(p.category for p in self.prompts))

    def all_identical(self, kinds: Sequence[str] = ("speccomp",)) -> bool:
        """True when every lossless row of the given kinds ("speccomp", "hf") ran without error and matched the
        baseline (LOSSY kv_mode="target" rows are expected to differ and are left out)."""
        return all(r["identical"] for r in self.row_dicts() if r["kind"] in kinds and r.get("lossless", True))

    def markdown(self) -> str:
        return format_markdown(self.header, self.row_dicts(), self.categories())

    def plot(self, path) -> None:
        plot_rows(self.row_dicts(), self.categories(), path, title=_plot_title(self.header))


# ---- Measuring ---------------------------------------------------------------------------------
def _hf_runner(model, eos, pad, extra: dict) -> Callable:
    import torch

    from speccomp.runtime.decode import synchronize

    def run(ids, max_new):
        ids = ids.to(model.device)
        forwards = 0

        def count(_module, _args):
            nonlocal forwards
            forwards += 1

        handle = model.register_forward_pre_hook(count)
        try:
            start = time.perf_counter()
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                eos_token_id=eos, pad_token_id=pad, **extra,
            )
            synchronize(model.device)
            secs = time.perf_counter() - start
        finally:
            handle.remove()
        return out.cpu(), secs, forwards, [], None

    return run


def _speccomp_runner(fast, eos) -> Callable:
    from speccomp.runtime.decode import synchronize

    def run(ids, max_new):
        ids = ids.to(fast.device)
        start = time.perf_counter()
        out = fast.generate(ids, max_new_tokens=max_new, eos_token_id=eos)
        synchronize(fast.device)
        secs = time.perf_counter() - start
        stats = fast.last_stats
        kv = {k: v for k, v in stats.items() if k.startswith("kv_bytes")} or None
        return out.cpu(), secs, stats.get("steps"), list(stats.get("acceptance_by_depth", [])), kv

    return run


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 300 else text[:297] + "..."


def _warn(msg: str) -> None:
    print(f"speccomp bench: {msg}", file=sys.stderr)


def machine_info() -> dict:
    import torch
    import transformers

    from speccomp import __version__

    return {
        "speccomp_version": __version__, "torch_version": torch.__version__,
        "transformers_version": transformers.__version__, "python_version": platform.python_version(),
        "platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_average_start": _loadavg(),
        "git_commit": _git_commit(),
    }


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _git_commit():
    """HEAD of the speccomp checkout (with "+dirty" for local changes), or None outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def run_bench(
    model, prompts: Sequence, rows: Sequence[str | RowSpec] | None = None, max_new_tokens: int = 128, *,
    tokenizer=None, eos_token_id=None, tree=None, backend: str = "eager", warmup: int = 1, progress: bool = True,
    prompt_lookup_num_tokens: int = PROMPT_LOOKUP_TOKENS, header: dict | None = None,
) -> BenchResult:
    """Measure HF greedy (baseline) and every row on every prompt; check outputs equal the baseline.

    prompts: token ids ([n] / [1, n] tensors or lists), BenchPrompts, or text `Prompt`s (need tokenizer).
    rows: names ("hf_prompt_lookup", "plain", drafter names) or RowSpecs; None = `default_rows()`.
    tree: `tree=` for the drafter rows given by name. eos_token_id: None = the tokenizer's, else the
    model's generation config's (the same value goes to every row). warmup: untimed runs of every row
    on the first prompt (at most 16 new tokens) before timing. A row that fails to compile or generate
    is kept with its `error` and skipped from then on; the run goes on.
    """
    from transformers.utils import logging as hf_logging

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    bench_prompts = prepare_prompts(prompts, tokenizer)
    specs = _row_specs(rows, tree)
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    info = _bench_header(model, bench_prompts, [s.name for s in specs], eos=eos_token_id, max_new_tokens=max_new_tokens,
                         warmup=warmup, backend=backend, tree=tree, prompt_lookup_num_tokens=prompt_lookup_num_tokens)
    info.update(header or {})
    results = [RowResult(spec) for spec in specs]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # HF generate's per-call notices would tear the progress bar
    try:
        runners = [_guarded(results, None, i, "compile failed",
                            lambda: _runner(model, results[i], eos_token_id, backend, prompt_lookup_num_tokens))
                   for i in range(len(specs))]
        for _ in range(warmup):
            for i, run in enumerate(runners):
                if run is not None:
                    _guarded(results, runners, i, "warmup failed",
                             lambda: run(bench_prompts[0].input_ids, min(max_new_tokens, 16)))
        _measure_rows(results, runners, bench_prompts, max_new_tokens, progress)
    finally:
        hf_logging.set_verbosity(verbosity)
    info["load_average_end"] = _loadavg()
    return BenchResult(info, results, bench_prompts)


def _row_specs(rows, tree) -> list[RowSpec]:
    """The baseline, then `rows` (None: `default_rows()`); names must be unique and kinds known."""
    specs = [RowSpec(BASELINE, BASELINE)] + [row_spec(r, tree) for r in (default_rows(tree=tree) if rows is None else rows)]
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate bench rows {dupes}; give each RowSpec its own name")
    for spec in specs:
        if spec.kind not in (BASELINE, PROMPT_LOOKUP, "speccomp"):
            raise ValueError(f"unknown row kind {spec.kind!r}; accepted: {[BASELINE, PROMPT_LOOKUP, 'speccomp']}")
    return specs


def _bench_header(model, prompts: list[BenchPrompt], names: list[str], *, eos, **settings) -> dict:
    """The JSON header: the machine, the run's settings, its rows and the columns' definitions."""
    info = machine_info()
    info.update({
        "schema_version": SCHEMA_VERSION,
        "date": _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "model": getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__,
        "model_class": type(model).__name__, "max_new_tokens": settings["max_new_tokens"],
        "warmup": settings["warmup"], "backend": settings["backend"],
        "tree": None if settings["tree"] is None else str(settings["tree"]), "eos_token_id": eos,
        "prompt_lookup_num_tokens": settings["prompt_lookup_num_tokens"], "n_prompts": len(prompts),
        "categories": list(dict.fromkeys(p.category for p in prompts)), "baseline": BASELINE, "rows": names,
        "definitions": {
            "speedup": "sum of baseline seconds / sum of row seconds over the same prompts",
            "tokens_per_second": "sum of new tokens / sum of generate wall seconds",
            "tau": "mean over prompts of new tokens / target forwards (prefill included)",
            "acceptance_by_depth": "mean over prompts of last_stats['acceptance_by_depth']",
            "identical": "every output equals the baseline's tokens exactly",
        },
    })
    return info


def _runner(model, res: RowResult, eos, backend: str, prompt_lookup_num_tokens: int) -> Callable:
    """How row `res` generates: `run(ids, max_new) -> (output, seconds, forwards, acceptance_by_depth, kv)`."""
    import speccomp

    spec = res.spec
    pad = eos if isinstance(eos, int) else (list(eos)[0] if eos else 0)
    if spec.kind == BASELINE:
        return _hf_runner(model, eos, pad, {})
    if spec.kind == PROMPT_LOOKUP:
        return _hf_runner(model, eos, pad, {"prompt_lookup_num_tokens": prompt_lookup_num_tokens})
    res.backend = backend
    start = time.perf_counter()
    fast = speccomp.compile(
        model, drafter=spec.drafter, tree=spec.tree if spec.drafter else None, backend=backend,
        drafter_options=spec.drafter_options if spec.drafter else None, kv_cache=spec.kv_cache, kv_mode=spec.kv_mode,
    )
    res.compile_seconds = time.perf_counter() - start
    res.drafting = getattr(fast, "drafter", None) is not None
    return _speccomp_runner(fast, eos)


def _guarded(results: list[RowResult], runners: list | None, i: int, what: str, call: Callable):
    """`call()` for row i. A row's failure is kept as its `error` (the row is skipped from then on: its runner
    becomes None) and the run goes on; the baseline's failure is raised."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - a broken drafter must not sink the other rows
        if i == 0:
            raise
        results[i].error = f"{what}: {_short(exc)}"
        _warn(f"row {results[i].spec.name}: {results[i].error}")
        if runners is not None:
            runners[i] = None
        return None


def _measure_rows(results: list[RowResult], runners: list, prompts: list[BenchPrompt], max_new_tokens: int,
                  progress: bool) -> None:
    """Every row on every prompt, rows back to back per prompt in a rotating order; each output against the
    baseline's."""
    import torch
    from tqdm.auto import tqdm

    order = list(range(len(results)))
    bar = tqdm(total=len(prompts) * len(results), desc="bench", unit="gen", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    try:
        for k, prompt in enumerate(prompts):
            shift = k % len(order)
            outputs: dict[int, tuple] = {}
            for i in order[shift:] + order[:shift]:  # rotate so no row always runs first
                bar.set_postfix_str(f"{prompt.id} {results[i].spec.name}", refresh=False)
                run = runners[i]
                if run is not None:
                    out = _guarded(results, runners, i, f"generate failed on prompt {prompt.id}",
                                   lambda: run(prompt.input_ids, max_new_tokens))
                    if out is not None:
                        outputs[i] = out
                bar.update(1)
            ref, n_prompt = outputs[0][0], prompt.input_ids.shape[1]
            for i, (out, secs, forwards, accept, kv) in sorted(outputs.items()):
                same = out.shape == ref.shape and bool(torch.equal(out.cpu(), ref.cpu()))
                results[i].measurements.append(
                    Measurement(prompt.id, prompt.category, int(out.shape[1] - n_prompt), secs, forwards, accept, same, kv)
                )
    finally:
        bar.close()


# ---- Reporting ---------------------------------------------------------------------------------
def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def format_markdown(header: dict, rows: list[dict], categories: list[str]) -> str:
    lines = [
        f"model {header.get('model')} · {header.get('n_prompts')} prompt(s) · max_new_tokens {header.get('max_new_tokens')} · "
        f"greedy · backend {header.get('backend')} · tree {header.get('tree') or 'default'} · "
        f"torch {header.get('torch_version')} · {header.get('torch_threads')} threads / {header.get('cpu_count')} CPUs · "
        f"load avg {header.get('load_average_start')} -> {header.get('load_average_end')}",
        "",
        "| row | tokens | tok/s | speedup | tau | acceptance by depth | identical |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"][:6]) or "–"
        if len(r["acceptance_by_depth"]) > 6:
            acc += " …"
        ident = "yes" if r["identical"] else ("ERROR" if r["error"] else f"NO ({len(r['mismatched_prompts'])} differ)")
        if not r.get("lossless", True) and not r["error"]:
            ident += ", LOSSY by design"
        lines.append(
            f"| {r['drafter']} | {r['new_tokens']} | {_f(r['tokens_per_second'], '{:.1f}')} | {_f(r['speedup'], '{:.2f}x')} | "
            f"{_f(r['tau'])} | {acc} | {ident} |"
        )
    if len(categories) > 1 or categories != ["default"]:
        lines += ["", "speedup / tau per category", "", "| row | " + " | ".join(categories) + " |",
                  "|---|" + "---:|" * len(categories)]
        for r in rows:
            cells = [r["per_category"].get(c) for c in categories]
            cells = ["–" if pc is None else f"{_f(pc['speedup'], '{:.2f}x')} / {_f(pc['tau'])}" for pc in cells]
            lines.append(f"| {r['drafter']} | " + " | ".join(cells) + " |")
    kv = [r for r in rows if r.get("kv_bytes")]
    if kv:
        lines += ["", "KV cache held at the end of generation (bytes, mean over prompts; full = the whole cache for the same tokens)",
                  "", "| row | mode | compressed | full | full / compressed |", "|---|---|---:|---:|---:|"]
        for r in kv:
            b = r["kv_bytes"]
            mode = "draft (lossless)" if r["lossless"] else "target (LOSSY)"
            lines.append(f"| {r['drafter']} | {mode} | {_f(b['compressed'], '{:,.0f}')} | {_f(b['full'], '{:,.0f}')} | "
                         f"{_f(b['ratio'], '{:.2f}x')} |")
    errors = [r for r in rows if r["error"]]
    if errors:
        lines += [""] + [f"- {r['drafter']}: {r['error']}" for r in errors]
    return "\n".join(lines)


def _plot_title(header: dict) -> str:
    return (f"{header.get('model')}: {header.get('n_prompts')} prompt(s), {header.get('max_new_tokens')} new tokens, "
            f"{header.get('torch_threads')} threads, {str(header.get('date', ''))[:10]}")


def plot_rows(rows: list[dict], categories: list[str], path, title: str = "") -> None:
    """Grouped bars: speedup (top) and tau (bottom) per category (+ all) for every non-baseline row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = categories + ["all"] if len(categories) > 1 else list(categories)
    shown = [r for r in rows if r["drafter"] != BASELINE]
    width_in = max(6.0, 0.45 * len(groups) * max(1, len(shown)) + 2)
    fig, axes = plt.subplots(2, 1, figsize=(width_in, 7.5), sharex=True, layout="constrained")
    width = 0.8 / max(1, len(shown))
    for ax, key, label in ((axes[0], "speedup", f"speedup vs {BASELINE}"), (axes[1], "tau", "tau (tokens / target forward)")):
        for j, r in enumerate(shown):
            vals = [(r if g == "all" else r["per_category"].get(g, {})).get(key) for g in groups]
            vals = [float("nan") if v is None else v for v in vals]
            xs = [x + (j - (len(shown) - 1) / 2) * width for x in range(len(groups))]
            bars = ax.bar(xs, vals, width, label=r["drafter"] + ("" if r["identical"] else " (NOT identical)"))
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(range(len(groups)), groups, rotation=20, ha="right")
    if title:
        fig.suptitle(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(4, max(1, len(shown))), fontsize=8)
    save_figure(fig, path, dpi=120)


# ---- Command line (registered by speccomp/cli.py) ----------------------------------------------
def load_bench_prompts(files: Sequence[str] | None, limit: int | None):
    """Text prompts from each file (first `limit` of each); ids become "<file stem>/<id>" with several files
    and an empty category becomes the file stem. None = the prompts shipped with speccomp."""
    from speccomp.prompts import Prompt, load_prompts

    if not files:
        return load_prompts(None, limit=limit)
    out = []
    for f in files:
        stem = Path(f).stem
        for p in load_prompts(f, limit=limit):
            pid = f"{stem}/{p.id}" if len(files) > 1 else p.id
            out.append(Prompt(pid, p.category or stem, p.text))
    return out


PLOT_MARK = "speccomp-plot-1"  # in a plot's metadata: the CLI replaces an existing plot only if it carries this
PLOT_KEYS = {".png": "Software", ".pdf": "Creator", ".svg": "Creator"}  # the formats plots are saved in, and where


def save_figure(fig, path, dpi: int) -> Path:
    """Save a matplotlib figure (PNG, PDF or SVG: cli.check_plot_flag) marked as speccomp's in its metadata, so that a
    later run may replace it and never a user's own picture (cli.check_output_file); closes the figure."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path = path if path.suffix else path.with_name(path.name + ".png")  # what matplotlib writes for a bare name
    path.parent.mkdir(parents=True, exist_ok=True)
    key = PLOT_KEYS.get(path.suffix.lower())
    fig.savefig(path, dpi=dpi, **({"metadata": {key: PLOT_MARK}} if key else {}))
    plt.close(fig)
    return path

