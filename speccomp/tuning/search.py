"""Pick a self-drafter's layers on calibration prompts by measured tokens/s, and remember the choice.

    result = speccomp.search_drafter(model, "layer_skip", prompts=[ids, ...])
    result.best            # e.g. {"skip": [8, 10, 12, 14, 16, 18, 20]}
    speccomp.compile(model, drafter="layer_skip")   # now uses result.best

Candidates are a handful of exit layers (early_exit) or SWIFT-style skip sets (every other
layer of a middle span, of several widths) for layer_skip. Each candidate is compiled (weights
shared, so this is cheap), warmed up, and timed on the same prompts, candidates interleaved
prompt by prompt so machine noise falls on all of them alike. The winner is stored under the
user cache (`speccomp.models.cache_dir() / "search"`), keyed by the model's fingerprint, the
drafter, the tree, the device, dtype, thread count and CPU, and `compile` reads it back when the user gives
no options. Every candidate's decode is checked against the plain model's: a search never picks
a configuration that changed the output.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

import torch

from speccomp.models import cache_dir, write_atomically
from speccomp.errors import OptionError

KINDS = ("early_exit", "layer_skip")


def candidates(kind: str, num_layers: int) -> list[dict]:
    """The options tried for `kind` on a model with `num_layers` decoder layers (duplicates removed)."""
    n = num_layers
    out: list[dict] = []
    if kind == "early_exit":
        for frac in (0.5, 0.625, 0.75, 0.875):
            k = min(max(int(round(frac * n)) - 1, 0), n - 2)
            out.append({"exit_layer": k})
    elif kind == "layer_skip":
        for frac in (0.25, 0.35, 0.45):  # share of the layers skipped
            m = max(1, int(round(frac * n)))
            lo = max(1, (n - 2 * m) // 2) if n > 2 else 0  # centred, every other layer; keep the first and last
            skip = [i for i in range(lo, n - 1, 2)][:m] or [min(1, n - 1)]
            out.append({"skip": skip})
            block = list(range(max(1, (n - m) // 2), max(1, (n - m) // 2) + m))  # a contiguous middle block
            block = [i for i in block if i < n - 1] or [min(1, n - 1)]
            out.append({"skip": block})
    else:
        raise ValueError(f"search covers the drafters {list(KINDS)}, got {kind!r}")
    return list({json.dumps(c, sort_keys=True): c for c in out}.values())  # duplicates removed, first order kept


def _key(model, kind: str, tree) -> str:
    from speccomp.runtime.tree import parse_tree_spec

    from speccomp.tuning.step_curve import machine_key

    spec = None if tree is None else parse_tree_spec(tree)  # "4", 4 and Tree.chain(4) are one key
    # what the timing is valid for: model, device, dtype, threads and CPU (not the backend: search times eager and
    # its layer sets serve every backend's compile)
    machine = {k: v for k, v in machine_key(model, "eager").items() if k != "backend"}
    parts = [kind, repr(spec), json.dumps(machine, sort_keys=True)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def check_search_tree(tree) -> None:
    """Search times layer sets on a fixed tree (or the drafter's default); compile(tree="auto") takes autotune's
    stored result instead, which a search would neither read nor write."""
    from speccomp.errors import OptionError
    from speccomp.runtime.tree import AutoTreeSpec, parse_tree_spec

    if tree is not None and isinstance(parse_tree_spec(tree), AutoTreeSpec):
        raise OptionError("tree", tree, "search times layer sets on a fixed tree; tree='auto' reads autotune's "
                          "stored result, which a search neither reads nor writes",
                          "search with a fixed tree (or none), then run speccomp autotune")


def prompt_list(prompts) -> list | None:
    """Calibration prompts (search_drafter, autotune), token id tensors [n] or [1, n] (a [B, n] tensor: its rows), as
    a list of [1, n] tensors; None where `prompts` is not that."""
    prompts = list(prompts) if isinstance(prompts, torch.Tensor) and prompts.dim() == 2 else prompts
    ok = not isinstance(prompts, torch.Tensor) and isinstance(prompts, (list, tuple)) and all(
        isinstance(p, torch.Tensor) and p.dim() in (1, 2) for p in prompts)
    return [p if p.dim() == 2 else p[None] for p in prompts] if ok else None


def search_path(model, kind: str, tree):
    return cache_dir() / "search" / f"{kind}-{_key(model, kind, tree)}.json"


def cached_options(model, kind: str, tree) -> dict | None:
    """The options a previous search stored for this model/drafter/tree/machine, or None."""
    path = search_path(model, kind, tree)
    if not path.exists():
        return None
    try:
        return dict(json.loads(path.read_text())["best"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a damaged or unreadable cache entry is ignored (and overwritten by the next search)


@dataclass
class SearchResult:
    kind: str
    best: dict
    rows: list[dict] = field(default_factory=list)  # one per candidate: options, tokens_per_s, tau, identical
    path: str | None = None

    def table(self) -> str:
        lines = [f"| {self.kind} options | tokens/s | tau | identical |", "|---|---:|---:|---|"]
        for r in sorted(self.rows, key=lambda r: -r["tokens_per_s"]):
            mark = " **best**" if r["options"] == self.best else ""
            lines.append(f"| {json.dumps(r['options'])}{mark} | {r['tokens_per_s']:.2f} | {r['tau']:.2f} | {r['identical']} |")
        return "\n".join(lines)


def _checked(kind: str, tree, prompts, options) -> list:
    """search_drafter's arguments refused before any work; the prompts as a list of [1, n] tensors."""
    if kind not in KINDS:
        raise OptionError("kind", kind, f"search covers the drafters {list(KINDS)}", "pass one of them")
    check_search_tree(tree)
    checked = prompt_list(prompts)
    if checked is None:
        raise OptionError("prompts", prompts, "must be a list of token id tensors [1, n] or [n]",
                          "e.g. [chat_ids(tokenizer, text) for text in texts]")
    if not checked:
        raise OptionError("prompts", prompts, "holds no calibration prompt", "pass at least one prompt's token ids")
    if options is not None and (not isinstance(options, (list, tuple)) or not options
                                or not all(isinstance(o, dict) for o in options)):
        raise OptionError("options", options, "must be a non-empty list of drafter_options dicts (the candidates)",
                          "e.g. [{'exit_layer': 8}, {'exit_layer': 12}], or None for the default candidates")
    return checked


def search_drafter(
    model, kind: str, prompts, *, tree=None, max_new_tokens: int = 48, options: list[dict] | None = None,
    save: bool = True, progress: bool = False,
) -> SearchResult:
    """Time every candidate on `prompts` (token id tensors [1, n] or [n]); return and store the fastest."""
    import speccomp

    prompts = _checked(kind, tree, prompts, options)
    plain = speccomp.compile(model)
    n_layers = len(plain.graph.structure.layers)
    options = options if options is not None else candidates(kind, n_layers)
    compiled = [speccomp.compile(model, drafter=kind, drafter_options=dict(o), tree=tree) for o in options]
    refs = [plain.generate(p, max_new_tokens=max_new_tokens) for p in prompts]
    for sm in compiled:  # warm-up: first calls allocate
        sm.generate(prompts[0], max_new_tokens=min(8, max_new_tokens))
    seconds = [0.0] * len(options)
    tokens = [0] * len(options)
    taus: list[list[float]] = [[] for _ in options]
    identical = [True] * len(options)
    from tqdm import tqdm

    bar = tqdm(total=len(prompts) * len(options), desc=f"search {kind}", disable=not progress)
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        order = list(range(len(options)))
        order = order[i % len(order):] + order[: i % len(order)]  # rotate: no candidate always runs first
        for c in order:
            start = time.perf_counter()
            out = compiled[c].generate(p, max_new_tokens=max_new_tokens)
            seconds[c] += time.perf_counter() - start
            tokens[c] += out.shape[1] - p.shape[1]
            taus[c].append(compiled[c].last_stats["tau"])
            identical[c] &= torch.equal(out, ref)
            bar.update()
    bar.close()
    rows = [
        {"options": o, "tokens_per_s": tokens[c] / seconds[c], "tau": sum(taus[c]) / len(taus[c]), "identical": identical[c]}
        for c, o in enumerate(options)
    ]
    valid = [r for r in rows if r["identical"]]
    if not valid:  # would be a bug in speccomp, not a tuning outcome
        raise RuntimeError(f"every {kind} candidate changed the greedy output; please report this")
    best = max(valid, key=lambda r: r["tokens_per_s"])["options"]
    result = SearchResult(kind, best, rows)
    if save:
        path = search_path(model, kind, tree)
        write_atomically(path, json.dumps({"kind": kind, "tree": repr(tree), "best": best, "rows": rows}, indent=1))
        result.path = str(path)
    return result
