"""Autotune a drafter's token tree on this machine: measure, optimise, cache.

    result = speccomp.autotune(model, "layer_skip", prompts=[ids, ...])   # or: speccomp autotune --drafter X
    print(result.summary())
    fast = speccomp.compile(model, drafter="layer_skip", tree="auto")     # the stored tree

1. Measure, on the backend and machine in use:
   - acceptance (`Acceptance`): the drafter drafts a *probe tree* on the calibration prompts (a rank-0 spine
     D deep with the K top candidates under every spine node) and the target verifies as usual, which gives
         p[d-1][r] = P(rank-r child accepted | its parent accepted)
     (Sequoia's positional acceptance vector, one row per depth: self-drafters and heads get worse with depth),
     counted over the steps after the first `warmup` tokens of each reply: the steady state of a drafter whose
     state grows with the reply (Token Recycling's table, n-gram history), which a short cold reply understates.
   - t_verify(n) (`time_steps`): one verify step over n tree tokens at a representative context length
     (mean prompt + half the new tokens); linear between the timed sizes.
   - drafting (`draft_seconds`): graph drafters (layer_skip, early_exit) run one draft forward per depth over
     that depth's nodes, timed per width the same way, plus a per-level overhead measured on the probe; other
     drafters cost their median `propose` time per step in the probe. `observe` (token recycling's table
     update) is charged per verified node.
   - the loop's own cost per step (tree bookkeeping, masks, stats), a + b*n (`fit_loop_overhead`): every
     calibration decode's wall time minus the parts above. Also the share of each depth's nodes the drafter
     really sends (token recycling drops the children of tokens its table has no row for), which makes a
     tree's realized size n' <= n (`realized_size`).
2. Optimise (speccomp/tuning/tree_dp.py): for every depth limit <= D and every size n <= max_nodes the
   DP gives the tree with the highest E[tokens per step]; the prediction is
       tokens/s(tree) = E[tokens per step] / (t_verify(n') + t_draft(tree) + t_observe(n') + t_loop(n'))
   and it ranks the static trees (step 3 decodes the best). Dynamic trees (EAGLE-2 style, for the
   drafters that grow them) are a second mode: each budget of a small grid is decoded on the
   calibration prompts, its mean tokens per step and draft time measured, the same formula
   predicts its speed, and the budgets compete with the static trees.
3. Choose by measurement, check and cache: the DP's best predictions, the dynamic budgets, the hand-made shapes
   users pick (chains of 2 and 4, a binary 8-node tree: HAND_TREES) and the drafter's default tree decode the
   calibration prompts (each after an untimed warm-up; each output must equal plain greedy decoding): the cost
   model ranks what to try, measurement decides. The fastest few (FINALISTS, within FINALIST_MARGIN), the
   default and plain decoding then meet in a final round: side by side, prompt by prompt (the calibration decoded
   one configuration after the other, so a passing load could favour one), on the calibration prompts and the
   held-back ones (every third of `prompts`, or `check_prompts`), which no measurement above saw. The finalist
   fastest over both sets of prompts wins, and is stored only if it also decodes the held-back prompts faster
   than the default (else the default is stored, mode "default"), so a prediction that misses or a choice fitted
   to the calibration prompts cannot make tree="auto" worse than no tuning. The kept tree must beat plain decoding
   (the same target graph verifying the root alone) on the held-back prompts as well (the same test the default
   puts to the tuned tree): where it does not, no tree pays on this machine (SmartSpec switches
   speculation off then): the result says so (`plain`; `tree` stays the best tree measured) and compile(tree="auto") compiles plain decoding, with a warning naming the
   stored file. The result is stored as JSON in the user cache under `autotune/`, keyed by (model fingerprint,
   drafter, backend, device, dtype, threads, CPU); `speccomp.compile(..., tree="auto")` reads it back
   (`resolve_auto`), and with nothing stored tunes on first use, on the shipped prompts in the model's
   own tokenizer (`first_use_prompts`).

Drafters: early_exit, layer_skip, token_recycling, medusa, hydra, eagle, draft_model, quantized (backend
onnxruntime), and a draft LM given itself (`autotune(model, draft_lm, prompts)`, with its tokenizers in
drafter_options where it has its own), stored under its weights' fingerprint (and both tokenizers': `drafter_key`),
where compile(drafter=draft_lm, tree="auto") finds it. Through its own tokenizer a draft's tree reaches the target
mapped through text, so the probe's acceptance by rank is only roughly the draft's: the DP's ranking is rougher,
the measured choice is not. `ngram` and `suffix` shape their own trees from what they find and take none, so they
cannot be tuned (a clear error says so). Token
recycling is tuned as pure Token Recycling (`ngram_branches=0`) unless drafter_options say
otherwise: its prompt-lookup branch adds nodes the tree model does not see (with it, the
prediction is a lower bound). Its table learns from every verified node, so a big probe fills it
faster than a small tree would: its acceptance, and so the prediction for small trees, leans
optimistic; calibrate with generations as long as the real ones.
"""
from __future__ import annotations

import hashlib
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from speccomp.errors import SpeccompError
from speccomp.runtime.calls import MAX_TREE
from speccomp.runtime.decode import Draft, DraftContext, Drafter, RootOnly
from speccomp.runtime.tree import (DEFAULT_DYNAMIC_TOP_K, AutoTreeSpec, DynamicTreeSpec, Tree, TreeSizeError,
                                   parse_tree_spec)
from speccomp.tuning.step_curve import machine_key, store_curve
from speccomp.tuning.tree_dp import expected_accepted, optimal_trees

PROBE_DEPTH = 6
PROBE_RANKS = 8
DEFAULT_MAX_NODES = 64
DYNAMIC_BUDGETS = (4, 8, 12, 16, 24, 32)
TIMED_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)
REPORT_SIZES = (2, 4, 8, 16, 32, 64)  # sizes decoded for the report's "measured" points
FIRST_USE_PROMPTS = 2  # per shipped prompt file, when tree="auto" tunes on first use
FIRST_USE_NEW_TOKENS = 128  # each first-use prompt's reply (autotune's default)
PLANNED_CANDIDATES = 2  # the DP trees with the best predictions, decoded on the calibration prompts
# shapes users pick by hand, decoded too: autotune's tree must beat them where they beat its plan
FINALISTS = 5  # the calibration's fastest configurations that go on to the final round (`_final_choice`)
# ... those within this share of the fastest: calibration timings, taken one configuration after the other, can be
# that far off (EAGLE's chain of 2 measured 18% behind its fastest there, 6% ahead of it in the benchmark's
# side-by-side rows: benchmarks/README.md, "Autotune")
FINALIST_MARGIN = 0.2
HAND_TREES = {
    "chain 2": [[0], [0, 0]],
    "chain 4": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]],
    "binary 8": [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0]],
}
SCHEMA = 1
# options a drafter gained after results could be stored, at the value such a result was tuned with: a result without
# them keeps its own (the quantized drafter's default became 8-bit weights on 2026-11-28; its older trees were 4-bit's)
TUNED_BEFORE = {"quantized": {"bits": 4}}


def untunable(drafter: str) -> str | None:
    """Why the named drafter has no tree to tune (it declares no tree kinds), or None."""
    from speccomp.drafters.registry import DECLARED

    if drafter in DECLARED and not DECLARED[drafter].trees:
        return f"the {drafter} drafter shapes its own trees (from what it finds) and takes no tree="
    return None


class AutotuneError(SpeccompError, ValueError):
    """Autotuning cannot run as asked, or compile(tree="auto") finds no tuned tree (the message says what to do)."""


def is_auto(tree) -> bool:
    """True for the `tree=` values that ask for the autotuned tree ("auto", AutoTreeSpec())."""
    return isinstance(tree, AutoTreeSpec) or (isinstance(tree, str) and tree.strip().lower() == "auto")


# ---- Cache -----------------------------------------------------------------------------------


def is_draft_lm(drafter) -> bool:
    """A draft LM given itself (drafter=draft_lm: a module or a `speccomp.capture`), not a name or a Drafter."""
    from torch import nn

    from speccomp.frontend.convention import CapturedModel

    return isinstance(drafter, (nn.Module, CapturedModel))


def drafter_key(drafter, options: dict | None) -> str:
    """The name a tuned tree is stored under: a named drafter's name; for a draft LM given itself, "draft_lm-" and
    its weights' fingerprint, and where it drafts through text, "-tokens-" and a digest of both tokenizers: another
    draft, or the same draft with other tokenizers, is another tuning."""
    from speccomp.drafters.draft_model import check_draft_model_options

    if not is_draft_lm(drafter):  # drafter="draft_model" (its path in options) drafting through its own tokenizers too
        tokenizers = {k: v for k, v in (options or {}).items() if k in TOKENIZERS} if drafter == "draft_model" else {}
        return drafter + _tokens_digest(tokenizers) if len(tokenizers) == len(TOKENIZERS) else drafter
    from speccomp.frontend.convention import CapturedModel
    from speccomp.models import fingerprint

    check_draft_model_options(options)
    key = f"draft_lm-{fingerprint(drafter.model if isinstance(drafter, CapturedModel) else drafter)}"
    return key + _tokens_digest(options) if options else key


TOKENIZERS = ("target_tokenizer", "draft_tokenizer")  # a draft's tokenizers: part of its key, never stored (objects)


def _tokens_digest(options: dict) -> str:
    from speccomp.drafters.text_bridge import as_tokenizer

    text = "\n".join(as_tokenizer(options[p], p).to_str() for p in TOKENIZERS)
    return "-tokens-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_key(model, drafter: str, backend: str) -> dict:
    """What an autotune result is valid for: the model, drafter, backend, device, dtype, threads and CPU."""
    return {**machine_key(model, backend), "drafter": drafter}


def result_path(model, drafter: str, backend: str) -> Path:
    from speccomp.models import cache_dir

    key = cache_key(model, drafter, backend)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "autotune" / f"{drafter}-{backend}-{digest}.json"


def load_result(model, drafter: str, backend: str = "eager") -> "AutotuneResult | None":
    """The stored autotune result for this model/drafter/backend/machine, or None (a damaged file counts as none)."""
    path = result_path(model, drafter, backend)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA or data["key"] != cache_key(model, drafter, backend):
            return _ignored(path, f"written for schema {data.get('schema')!r} / another key, not this model's")
        result = AutotuneResult.from_dict(data)
        try:  # a tree that no longer parses is no result
            parse_tree_spec(result.tree, max_nodes=MAX_TREE)  # (no tree that cannot fit is built: 10^6 nodes, 931 GiB)
        except TreeSizeError:
            pass  # compile refuses it naming this file, before building it
        if not _well_formed(result):
            return _ignored(path, "a field tree='auto' reads has the wrong type")
        result.path = str(path)  # where it was read (a copied cache's file names its old place)
        for option, value in TUNED_BEFORE.get(drafter, {}).items():
            result.drafter_options.setdefault(option, value)
        result.drafter_options.pop("tokenizers", None)  # a draft's own-tokenizers mark (older files): not an option
        return result
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # OSError: unreadable (permissions, a
        # directory in its place); AttributeError: JSON that is not an object
        return _ignored(path, f"{type(exc).__name__}: {str(exc)[:200]}")


def trained_digest(model, drafter, options: dict | None) -> str | None:
    """A digest of the trained weights the named `drafter` loads for `model` with `options` (heads, a trained draft;
    the files of their folder), None where it loads none: a stored tree is for those weights, and heads trained again
    into the same folder need their own tuning."""
    from speccomp.drafters.head_drafters import HEAD_KINDS, find_heads
    from speccomp.engine.runtime import sha256  # the engine manifest's file digest
    from speccomp.tuning.train_draft import find_draft

    options = options if isinstance(options, dict) else {}
    try:
        if drafter in HEAD_KINDS:
            folder = find_heads(model, options.get("heads"), drafter)
        elif drafter == "draft_model":
            folder = find_draft(model, options.get("path"))[0]
        else:
            return None
    except (SpeccompError, TypeError):  # no heads (yet), a bad path: compile says so
        return None
    if folder is None or not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return hashlib.sha256("\n".join(f"{f.name} {sha256(f)}" for f in files).encode()).hexdigest()[:16]


def _ignored(path: Path, why: str) -> None:
    """A stored result that exists but cannot be used counts as none, said out loud: tree='auto' then tunes anew (and
    replaces it) or asks for autotune, and the user should know why their tuning was not used."""
    warnings.warn(f"ignoring the stored autotune result {path} ({why}); tree='auto' treats it as missing: run "
                  "speccomp autotune again, or delete the file", stacklevel=3)
    return None


def _well_formed(result: "AutotuneResult") -> bool:
    """The fields tree="auto" reads have their types (a hand-edited file counts as none, as a damaged one does)."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    c = result.check  # its speeds are read where plain decoding won (results stored before the verdict have none)
    return (isinstance(result.drafter_options, dict) and isinstance(result.plain, bool) and isinstance(c, dict)
            and (not result.plain or (number(result.plain_tokens_per_s) and number(result.measured_tokens_per_s)
                                      and (not c or (c.get("kept") in ("tuned", "default") and all(
                                          number(c.get(f"{k}_tokens_per_s")) for k in ("plain", c["kept"])))))))


def resolve_auto(model, drafter, backend: str, drafter_options: dict | None, merged: bool = False):
    """`tree="auto"` for compile: (the stored tree, the drafter options it was tuned with, plain), `plain` where
    autotune measured decoding without drafts faster than the tree it kept (`AutotuneResult.plain`; a warning names the
    stored file). A draft LM's options, its tokenizers, are part of its key and come back as given; options given
    that differ from the stored ones win, and then the tree drafts (the plain verdict was measured with others), as
    it does for the first drafter of a merge (`merged`: the merge itself was never measured)."""
    if is_draft_lm(drafter):
        result = load_result(model, drafter_key(drafter, drafter_options), backend)
        result = result or _tune_on_first_use(model, drafter, backend, drafter_options)
        return result.tree, drafter_options, not merged and _plain(result)
    if not isinstance(drafter, str):
        raise AutotuneError(
            "tree='auto' looks up the tree tuned for a named drafter; give drafter= a name from "
            "speccomp.available_drafters(), or pass your Drafter object an explicit tree"
        )
    if untunable(drafter):
        raise AutotuneError(f"tree='auto': {untunable(drafter)}; drop tree= (or use token_recycling, which takes a tuned tree)")
    name = drafter_key(drafter, drafter_options)  # a named draft_model with its own tokenizers: theirs in the key
    result = load_result(model, name, backend)
    if result is not None and result.trained is not None:  # tuned for heads / a draft: are they still those?
        # the folder it was tuned with, now (other heads or another draft the caller names: the `differ` warning below)
        if trained_digest(model, drafter, result.drafter_options) != result.trained:
            result = _ignored(Path(result.path), f"tuned with other {'draft' if drafter == 'draft_model' else 'heads'}"
                              " than those found now (trained again since?)")
    result = result or _tune_on_first_use(model, drafter, backend, drafter_options)
    stored = result.drafter_options
    given = {k: v for k, v in (drafter_options or {}).items() if k not in TOKENIZERS}
    tokenizers = {k: v for k, v in (drafter_options or {}).items() if k in TOKENIZERS}  # in the key, never stored
    differ = {k: v for k, v in given.items() if k not in stored or stored[k] != v}
    if differ:  # the stored options are complete (every option the drafter declares); the user's win
        warnings.warn(
            f"tree='auto': the stored tree was tuned with drafter_options={result.drafter_options}, not {differ}; "
            f"it may not be the best tree for these options (re-run speccomp autotune with them)",
            stacklevel=4,  # the user's compile call
        )
        return result.tree, {**result.drafter_options, **given, **tokenizers}, False
    return result.tree, {**result.drafter_options, **tokenizers}, not merged and _plain(result)


def _plain(result: "AutotuneResult") -> bool:
    """Whether tree="auto" decodes without drafts: autotune measured that faster than the tree it kept (warned)."""
    if not result.plain:
        return False
    c = result.check
    plain, tree = _verdict_speeds(c, result.plain_tokens_per_s, result.measured_tokens_per_s)
    warnings.warn(
        f"tree='auto': autotune measured decoding without drafts faster than the tree it kept for {result.drafter} "
        f"on {result.backend} on this machine ({plain:.1f} tok/s against {tree:.1f}"
        f"{' on prompts it was not calibrated on' if c else ''}; {result.path}): compiling plain decoding. Pass an "
        f"explicit tree (e.g. tree={json.dumps(result.tree)}) to draft anyway, or delete that file to tune again",
        stacklevel=5,  # the user's compile call
    )
    return True


def first_use_prompts(model, per_file: int = FIRST_USE_PROMPTS):
    """(calibration prompts as token ids, eos id) from the prompts shipped with speccomp in the model's own
    tokenizer, found beside its weights (a model loaded from a local directory, e.g. the default model), or None."""
    from speccomp.models import chat_ids, local_tokenizer
    from speccomp.prompts import SETS, load_prompts

    tok = local_tokenizer(model)
    if tok is None:
        return None
    by_file = [load_prompts(f, limit=per_file) for f in SETS]  # round robin: the held-back third spans the files
    texts = [ps[i].text for i in range(per_file) for ps in by_file if i < len(ps)]
    ids = [chat_ids(tok, t) if tok.chat_template else torch.tensor([tok(t).input_ids]) for t in texts]
    return ids, tok.eos_token_id


def _tune_on_first_use(model, drafter, backend: str, drafter_options: dict | None) -> "AutotuneResult":
    """tree="auto" with nothing stored: tune now (progress bar on stderr), store, and use the result."""
    found = first_use_prompts(model)
    name = drafter_key(drafter, drafter_options)
    if found is None:
        key = cache_key(model, name, backend)
        given = "draft_lm" if is_draft_lm(drafter) else repr(drafter)
        raise AutotuneError(
            f"tree='auto': no autotuned tree for drafter {name!r} on backend {backend!r} for this model and machine "
            f"(fingerprint {key['fingerprint']}, {key['device']}, {key['dtype']}, {key['threads']} threads), and no "
            "tokenizer beside the model's weights to tune it on first use with. Run "
            f"`speccomp.autotune(model, {given}, prompts, backend={backend!r})` with your prompts as token ids "
            "(or `speccomp autotune` for the default model) first; or pass an explicit tree (a choice list, an int k, "
            "'dynamic:B:K')"
        )
    prompts, eos = found
    # a draft LM's context bounds the text too (generate refuses a reply past it: check_context)
    limits = {"model's": _context_length(model),
              "draft model's": _context_length(drafter) if is_draft_lm(drafter) else None}
    whose, limit = min(((k, n) for k, n in limits.items() if n), key=lambda kn: kn[1], default=(None, None))
    prompts = [p for p in prompts if limit is None or p.shape[-1] + FIRST_USE_NEW_TOKENS <= limit]
    if not prompts:
        raise AutotuneError(
            f"tree='auto': no autotuned tree for drafter {name!r} on backend {backend!r} for this model and machine, "
            f"and none of the shipped prompts leaves room for {FIRST_USE_NEW_TOKENS} new tokens in the {whose} "
            f"context of {limit} positions to tune it on first use. Run `speccomp.autotune(model, ..., prompts, "
            "max_new_tokens=...)` with prompts that fit, or pass an explicit tree")
    print(f"tree='auto': no tree tuned for {name!r} on {backend!r} on this machine yet; tuning it now on "
          f"{len(prompts)} shipped prompts (once: the result is stored for the next compile)", file=sys.stderr)
    return autotune(model, drafter, prompts, backend=backend, drafter_options=drafter_options, eos_token_id=eos,
                    max_new_tokens=FIRST_USE_NEW_TOKENS, progress=True)


def _context_length(model) -> int | None:
    """The positions `model` (a Hugging Face model or a capture) holds, as its capture reads them; None: unknown."""
    from speccomp.frontend.hf import _max_positions, _text_config

    if hasattr(model, "max_positions"):  # a capture
        return model.max_positions
    return _max_positions(_text_config(model)) if hasattr(model, "config") else None


# ---- Drafters with another tree --------------------------------------------------------------


def retree(drafter: Drafter, tree) -> Drafter:
    """A drafter like `drafter` (same graphs, heads, options) that drafts `tree` (a Tree or DynamicTreeSpec):
    its declared `with_tree`, for speccomp's drafters and any custom Drafter that declares its tree kinds."""
    kind = "dynamic" if isinstance(tree, DynamicTreeSpec) else "static"
    if kind not in drafter.trees:
        if not drafter.trees:
            raise AutotuneError(f"the {drafter.name} drafter cannot take a tuned tree (it declares no tree kinds); "
                                "autotune works for drafters that do, e.g. early_exit, layer_skip, token_recycling, "
                                "medusa, hydra, eagle")
        raise AutotuneError(f"the {drafter.name} drafter takes {' or '.join(drafter.trees)} trees only; "
                            f"tune it with mode={drafter.trees[0]!r}")
    return drafter.with_tree(tree)


def with_tree(sm, tree):
    """A shallow copy of the SpecModel `sm` (same lowered graphs) whose drafter drafts `tree`."""
    return sm.with_drafter(retree(sm.drafter, tree))


def probe_tree(depth: int, ranks: int) -> Tree:
    """A rank-0 spine `depth` deep with `ranks` candidates under every spine node (1 + depth * ranks nodes)."""
    return Tree.from_choices([[0] * (d - 1) + [r] for d in range(1, depth + 1) for r in range(ranks)])


# ---- Measuring -------------------------------------------------------------------------------


class _Recorder(Drafter):
    """Wraps a drafter: times propose / observe and records each step's tree and accepted path."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name = inner.name
        self.reads, self.trees, self.graphs = inner.reads, inner.trees, inner.graphs
        self.steps: list[dict] = []
        self._propose_s, self._max_depth, self._generated = 0.0, 0, 0

    def begin(self, prompt):
        self._generated = 0  # tokens of this reply so far: how warm the drafter's state is at a step
        self.inner.begin(prompt)

    def take_states(self, states):
        self.inner.take_states(states)

    def propose(self, ctx: DraftContext) -> Draft:
        start = time.perf_counter()
        draft = self.inner.propose(ctx)
        self._propose_s = time.perf_counter() - start
        self._max_depth = ctx.max_depth
        return draft

    def observe(self, draft: Draft, path, target_logits):
        start = time.perf_counter()
        self.inner.observe(draft, path, target_logits)
        self.steps.append({
            "propose_s": self._propose_s, "observe_s": time.perf_counter() - start, "size": draft.tree.size,
            "ranks": draft.tree.ranks, "path": list(path), "room": self._max_depth,
            "per_depth": torch.bincount(draft.tree.depth).tolist(), "generated": self._generated,
        })
        self._generated += len(path)
        self._propose_s, self._max_depth = 0.0, 0  # the last step of a decode verifies the root alone, unproposed


PRIOR_VISITS = 4  # pseudo-visits pulling a deep, rarely reached depth's estimate towards the depth above


@dataclass
class Acceptance:
    """Positional acceptance measured with a probe tree (row d = depth d + 1, column r = rank r).

    Each accepted spine node at depth d is a visit of row d, and a hit at (d, r) when its rank-r child is the
    one the target accepted (a child the drafter could not propose counts as not accepted), so
    p_raw[d][r] = hits[d][r] / visits[d]. Deep rows see few visits (the spine must be accepted that far),
    so `p` shrinks each row below depth 1 towards the row above with PRIOR_VISITS pseudo-visits:
    p[d][r] = (hits[d][r] + PRIOR_VISITS * p[d-1][r]) / (visits[d] + PRIOR_VISITS). One lucky visit then
    does not make a depth look certain; with many visits the data wins. A depth never visited gets 0:
    the tree does not reach where calibration never went. Rows stay sub-stochastic.
    """

    hits: list[list[int]]
    visits: list[int]

    @property
    def p_raw(self) -> list[list[float]]:
        return [[h / v if v else 0.0 for h in row] for row, v in zip(self.hits, self.visits)]

    @property
    def p(self) -> list[list[float]]:
        out: list[list[float]] = []
        for row, v in zip(self.hits, self.visits):
            if not out or not v:
                out.append([h / v if v else 0.0 for h in row])
            else:
                out.append([(h + PRIOR_VISITS * q) / (v + PRIOR_VISITS) for h, q in zip(row, out[-1])])
        return out

    def add(self, step: dict) -> None:
        depth, ranks = len(self.visits), len(self.hits[0])
        path, node_ranks = step["path"], step["ranks"]
        for i in range(min(depth, step["room"], len(path))):  # path[i] is an accepted spine node at depth i
            self.visits[i] += 1
            if i + 1 >= len(path):
                break
            r = node_ranks[path[i + 1]]
            if r < ranks:
                self.hits[i][r] += 1
            if r != 0:  # off the spine: the probe has no children there
                break


def _decode_totals(runs: list[dict]) -> tuple[float, int]:
    """(wall seconds, verify steps) of decode runs' `last_stats`, leaving out the prefill (it counts as a step)."""
    return sum(r["seconds"] - r["prefill_seconds"] for r in runs), sum(r["steps"] - 1 for r in runs)


def _run(sm, prompts, max_new_tokens, eos, refs=None, bar=None) -> dict:
    """Decode every prompt with `sm`; stats summed over prompts, and whether all outputs equal `refs`.

    Decode tokens/s and tokens per verify step leave out the prefill and its token. Also returns `runs`, each
    decode's `last_stats` (wall time, prefill time, steps).
    """
    runs, identical, outs = [], True, []
    for i, p in enumerate(prompts):
        out = sm.generate(p, max_new_tokens=max_new_tokens, eos_token_id=eos)
        runs.append(dict(sm.last_stats))
        outs.append(out)
        if refs is not None:
            identical &= bool(torch.equal(out, refs[i]))
        if bar is not None:
            bar.update()
    tokens = sum(r["new_tokens"] - 1 for r in runs)
    _, steps = _decode_totals(runs)
    return {"tokens_per_s": _rate(runs),
            "tokens_per_step": tokens / steps if steps else float("nan"),
            "identical": identical, "outputs": outs, "runs": runs}


def measure_acceptance(sm, prompts, *, max_new_tokens: int, eos=None, depth: int, ranks: int, warmup: int = 0,
                       bar=None):
    """Acceptance table of `sm`'s drafter from a probe tree (depth x ranks), counted over the steps taken once
    `warmup` tokens of the reply exist: the steady state a long reply decodes in, not the cold start of a drafter
    whose state grows with the reply (Token Recycling's table, n-gram history). Every step if none is that late.

    Returns (Acceptance, recorded steps, last_stats of every decode).
    """
    probe = with_tree(sm, probe_tree(depth, ranks))
    probe.generate(prompts[0], max_new_tokens=min(4, max_new_tokens))  # warm-up, not recorded
    recorder = _Recorder(probe.drafter)
    probe.drafter = recorder
    runs = _run(probe, prompts, max_new_tokens, eos, bar=bar)["runs"]
    acc = Acceptance([[0] * ranks for _ in range(depth)], [0] * depth)
    steady = [st for st in recorder.steps if st["generated"] >= warmup] or recorder.steps
    for step in steady:
        acc.add(step)
    return acc, recorder.steps, runs


def _interp(xs: list, ys: list, x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1] + (ys[-1] - ys[-2]) * (x - xs[-1]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1]


def monotone_fit(ys: list[float]) -> list[float]:
    """The closest non-decreasing sequence to `ys` in least squares (pool adjacent violators).

    Scoring more tokens does not cost less; on a busy machine single medians still dip, and a dip would
    make the optimiser prefer a size for its noise. The raw medians stay in the result for the report.
    """
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out += [s / c] * c
    return out


def _calibration_text(prompts, length: int) -> torch.Tensor:
    """`length` tokens of the calibration text: the prompts one after another, cycled."""
    text = torch.cat([p[0] for p in prompts])
    return text.repeat(length // text.numel() + 1)[:length]


def time_steps(sm, prompts, *, context_len: int, sizes, widths=(), repeats: int = 5, bar=None) -> dict:
    """Median seconds of a verify step at each tree size (and of a graph drafter's forward at each width).

    A verify step is what the decode loop does per step besides drafting: the target forward over
    n tree tokens at `context_len` cached tokens, the argmax, greedy acceptance and the cache append.
    Sizes (and widths) are interleaved in a rotating order, after one untimed pass.
    """
    from speccomp.runtime.decode import prefill, synchronize, target_cache
    from speccomp.runtime.tree import greedy_accept

    device = sm.device
    # the calibration text, room for 64 more, in the storage decoding uses (cudagraphs: its graphed steps are timed)
    cache = target_cache(sm.step, sm.kv, context_len + DEFAULT_MAX_NODES + 2, device)
    prefill(sm.step, cache, _calibration_text(prompts, context_len)[None].to(device))
    base = cache.length
    drafter = sm.drafter if "draft" in sm.drafter.graphs else None  # a draft graph: its forward is timed per width
    widths = list(widths) if drafter is not None else []
    jobs = [("verify", n) for n in sizes] + [("draft", w) for w in widths]
    trees = {n: Tree.from_parents((-1,)) if n == 1 else Tree.chain(n - 1) for n in sizes}
    tokens = _calibration_text(prompts, max(list(sizes) + widths + [1]))
    on_device = tokens.to(device)

    def run(kind: str, n: int) -> float:
        start = time.perf_counter()
        if kind == "verify":
            tree = trees[n]
            mask = torch.ones(1, base + n, dtype=torch.long, device=device)
            with torch.no_grad():
                outs = sm.step(on_device[None, :n], tree.positions(base, device), mask, cache.past(),
                               tree.mask.to(device))
            path, _ = greedy_accept(tree, tokens[:n], outs[0][0].argmax(-1).cpu())
            cache.append(outs[1], keep=torch.tensor(path, device=device))
        else:
            drafter.level_forward(cache, base, tokens[:n])
        synchronize(device)
        seconds = time.perf_counter() - start
        cache.length = base
        return seconds

    for _ in range(2):  # warm-up: first calls at a shape allocate (a cudagraphs step captures its graph here)
        for job in jobs:
            run(*job)
    times: dict = {job: [] for job in jobs}
    for rep in range(repeats):
        k = rep % len(jobs)
        for job in jobs[k:] + jobs[:k]:
            times[job].append(run(*job))
        if bar is not None:
            bar.update()
    verify = [statistics.median(times[("verify", n)]) for n in sizes]
    draft = [statistics.median(times[("draft", w)]) for w in widths]
    return {"sizes": list(sizes), "verify_raw_s": verify, "verify_s": monotone_fit(verify),
            "widths": widths, "draft_raw_s": draft, "draft_s": monotone_fit(draft)}


# ---- Result --------------------------------------------------------------------------------


@dataclass
class AutotuneResult:
    drafter: str
    backend: str
    key: dict
    drafter_options: dict
    mode: str  # "static" | "dynamic": which kind of tree won; "default": the drafter's own tree held up better
    tree: object  # choice list (static) or "dynamic:BUDGET:TOPK"
    predicted_tokens_per_s: float
    measured_tokens_per_s: float  # decode speed of the chosen tree on the calibration prompts (prefill excluded)
    context_len: int
    acceptance: dict  # p, hits, visits, probe_depth, probe_ranks
    timing: dict  # sizes, verify_s, widths, draft_s, draft_overhead_per_level_s, propose_s, observe_per_node_s, loop_*
    static: list = field(default_factory=list)  # per size n: the DP's best tree and its prediction
    dynamic: list = field(default_factory=list)  # per budget: expected, mean size, prediction, measurement
    measured: list = field(default_factory=list)  # decoded configurations: predicted vs measured tokens/s
    plain_tokens_per_s: float = float("nan")  # the same target graph, one token per step
    check: dict = field(default_factory=dict)  # held-back prompts: the tuned and the default tree's decode speed
    step_curve: str | None = None  # where the batch step-cost curve was stored (tuning/step_curve.py)
    trained: str | None = None  # digest of the heads / trained draft it was tuned with (`trained_digest`)
    # decoding without drafts beat `tree` on the held-back prompts: tree="auto" compiles plain decoding (`tree` stays the
    # best tree: what a merge, or an explicit tree=result.tree, drafts)
    plain: bool = False
    path: str | None = None
    schema: int = SCHEMA

    @classmethod
    def from_dict(cls, data: dict) -> "AutotuneResult":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict:
        return asdict(self)

    def tree_spec(self):
        """The chosen tree as compile takes it: a Tree or a DynamicTreeSpec."""
        return parse_tree_spec(self.tree)

    def summary(self) -> str:
        k, a, t, c = self.key, self.acceptance, self.timing, self.check
        lines = [
            f"autotune {self.drafter} on {self.backend} ({k['device']}, {k['dtype']}, {k['threads']} threads, "
            f"{k['cpu']}), options {self.drafter_options}",
            f"chosen: {self.mode} tree {json.dumps(self.tree)} (fastest measured decode of the calibration prompts)",
            f"  predicted {self.predicted_tokens_per_s:.1f} tok/s, measured {self.measured_tokens_per_s:.1f} tok/s "
            f"(decode, calibration prompts); no drafts (1 token per step) {self.plain_tokens_per_s:.1f} tok/s",
            f"acceptance p[depth][rank] (probe {a['probe_depth']}x{a['probe_ranks']}):",
        ]
        lines += [f"  depth {d} ({v:>4} visits): " + " ".join(f"{x:.2f}" for x in row)
                  for d, (row, v) in enumerate(zip(a["p"], a["visits"]), 1)]
        if "loop_overhead_per_node_s" in t:
            draft = (f", draft overhead {1e3 * t['draft_overhead_per_level_s']:.1f} ms per draft level"
                     if t.get("widths") else "")
            lines.append(f"step costs: loop overhead {1e3 * t['loop_overhead_s']:.1f} ms + "
                         f"{1e3 * t['loop_overhead_per_node_s']:.2f} ms/node{draft}")
        chosen = lambda tree: " **chosen**" if tree == self.tree else ""  # noqa: E731
        lines += ["| n | depth | E[tokens/step] | step ms | predicted tok/s |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['n']}{chosen(r['choices'])} | {r['depth']} | {r['expected']:.2f} | "
                  f"{1e3 * r['step_s']:.1f} | {r['tokens_per_s']:.1f} |"
                  for r in self.static if r["n"] in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) or chosen(r["choices"])]
        if self.step_curve:
            lines.append(f"batch step-cost curve t(q, past) stored: {self.step_curve}")
        if self.dynamic:
            lines += ["| dynamic budget | E[tokens/step] | mean nodes | step ms | predicted tok/s | measured tok/s |",
                      "|---:|---:|---:|---:|---:|---:|"]
            lines += [f"| {r['budget']}:{r['top_k']} | {r['expected']:.2f} | {r['mean_size']:.1f} | "
                      f"{1e3 * r['step_s']:.1f} | {r['tokens_per_s']:.1f} | {r['measured_tokens_per_s']:.1f} |"
                      for r in self.dynamic]
        if self.measured:
            lines += ["| decoded | predicted tok/s | measured tok/s | E pred | E meas | identical |",
                      "|---|---:|---:|---:|---:|---|"]
            lines += [f"| {r['label']}{chosen(r.get('tree'))} | {r['predicted_tokens_per_s']:.1f} | {r['measured_tokens_per_s']:.1f} | "
                      f"{r['expected']:.2f} | {r['measured_tokens_per_step']:.2f} | {r['identical']} |"
                      for r in self.measured]
        if not self.plain and self.predicted_tokens_per_s < self.plain_tokens_per_s:
            lines.append(f"note: even the best tree is predicted slower than decoding without drafts "
                         f"({self.plain_tokens_per_s:.1f} tok/s): this drafter does not pay on this machine")
        if c:
            lines += [f"final round, side by side on the calibration prompts and {c['prompts']} held-back ones (no "
                      "measurement above saw them):",
                      "| finalist | calibration tok/s | held-back tok/s | both tok/s |", "|---|---:|---:|---:|"]
            lines += [f"| {f['label']}{chosen(f['tree'])} | {f['calibration_tokens_per_s']:.1f} | "
                      f"{f['held_back_tokens_per_s']:.1f} | {f['combined_tokens_per_s']:.1f} |" for f in c.get("finalists", [])]
            lines.append(f"held-back check: tuned tree {json.dumps(c['tuned'])} {c['tuned_tokens_per_s']:.1f} tok/s, "
                         f"default tree {json.dumps(c['default'])} {c['default_tokens_per_s']:.1f} tok/s: "
                         f"kept the {c['kept']} tree")
            if "plain_tokens_per_s" in c:
                lines.append(f"decoding without drafts: {c['plain_tokens_per_s']:.1f} tok/s on the held-back prompts")
        if self.plain:
            lines.append(f"no tree beat decoding without drafts on this machine: tree='auto' compiles plain decoding "
                         f"(an explicit tree, e.g. {json.dumps(self.tree)}, still drafts)")
        if self.path:
            lines.append(f"stored in {self.path}")
        return "\n".join(lines)


# ---- Optimise --------------------------------------------------------------------------------


def _tree_widths(choices: list) -> list[int]:
    """Nodes per depth (root first) of a choice list."""
    widths = [1]
    for c in choices:
        while len(widths) <= len(c):
            widths.append(0)
        widths[len(c)] += 1
    return widths


def draft_seconds(timing: dict, choices: list) -> float:
    """Predicted drafting time of a static tree: per-depth forwards (graph drafters) or the probe's propose time.

    A graph drafter pays, per draft level, one forward over that level's nodes plus the Python/top-k
    work around it (`draft_overhead_per_level_s`: the probe's propose time beyond its timed forwards, per
    probe level; paid per level, so a one-level tree does not pay for six).
    """
    if timing["widths"]:
        forwards = _tree_widths(choices)[:-1]  # every depth that has children below it runs one forward over its nodes
        per_level = timing.get("draft_overhead_per_level_s")
        overhead = per_level * len(forwards) if per_level is not None else timing.get("draft_overhead_s", 0.0)  # old results
        return overhead + sum(_interp(timing["widths"], timing["draft_s"], w) for w in forwards)
    if timing.get("propose_per_level_s") is not None:  # drafters that run one forward per draft level (EAGLE)
        return timing["propose_per_level_s"] * (len(_tree_widths(choices)) - 1)
    return timing["propose_s"]


def loop_seconds(timing: dict, n: float) -> float:
    """The decode loop's own cost of a step verifying n nodes: a + b*n (`fit_loop_overhead`)."""
    return timing.get("loop_overhead_s", 0.0) + timing.get("loop_overhead_per_node_s", 0.0) * n


def _verify_seconds(timing: dict, n: float) -> float:
    return _interp(timing["sizes"], timing["verify_s"], n)


def step_seconds(timing: dict, n: float, draft_s: float) -> float:
    """Predicted seconds of one decode step: verify n nodes + draft + observe + the loop's own overhead."""
    return _verify_seconds(timing, n) + draft_s + timing["observe_per_node_s"] * n + loop_seconds(timing, n)


def fit_loop_overhead(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least-squares a, b >= 0 of overhead(n) = a + b*n from (n, seconds per step, weight) points.

    Each point is one calibration decode (weight = its steps) at its mean tree size: the plain reference run
    (n = 1), the probe and every dynamic budget. One distinct size gives b = 0 and a = the weighted mean; a
    negative slope or intercept (noise) is clamped to 0 and the other refitted.
    """
    pts = [(float(n), float(y), float(w)) for n, y, w in points if w > 0]
    if not pts:
        return 0.0, 0.0
    sw = sum(w for _, _, w in pts)
    mean_n = sum(w * n for n, _, w in pts) / sw
    mean_y = sum(w * y for _, y, w in pts) / sw
    var = sum(w * (n - mean_n) ** 2 for n, _, w in pts)
    if var <= 1e-12 * sw:
        return max(0.0, mean_y), 0.0
    b = sum(w * (n - mean_n) * (y - mean_y) for n, y, w in pts) / var
    a = mean_y - b * mean_n
    if b < 0:  # more nodes never cost less: a flat line
        return max(0.0, mean_y), 0.0
    if a < 0:  # a line through the origin
        b = max(0.0, sum(w * n * y for n, y, w in pts) / sum(w * n * n for n, _, w in pts))
        return 0.0, b
    return a, b


def _loop_point(runs: list[dict], steps: list[dict], timing: dict) -> tuple[float, float, float]:
    """(mean tree size, loop seconds per step, steps) of decode runs whose steps a _Recorder timed (or of a
    drafter-less run when `steps` is empty: every step then verifies the root alone)."""
    wall, n_steps = _decode_totals(runs)
    if not steps:  # plain decoding: one node per step, nothing proposed
        return 1.0, (wall - n_steps * _verify_seconds(timing, 1)) / max(n_steps, 1), n_steps
    parts = sum(_verify_seconds(timing, s["size"]) + s["propose_s"] + s["observe_s"] for s in steps)
    return statistics.mean(s["size"] for s in steps), (wall - parts) / len(steps), len(steps)


def realized_size(timing: dict, choices: list) -> float:
    """Expected nodes a drafter really sends for a tree: token recycling drops the children of tokens its
    table has no row for (`presence[d-1]` = share of depth-d nodes present in the probe; 1 for the others)."""
    presence = timing.get("presence") or []
    widths = _tree_widths(choices)
    return 1 + sum(w * (presence[d - 1] if d - 1 < len(presence) else 1.0) for d, w in enumerate(widths) if d > 0)


def predict_static(p, timing: dict, choices: list, expected=None) -> dict:
    """A static tree's predicted decode speed: E[tokens per step] / predicted seconds per step."""
    expected = float(expected_accepted(choices, p) if expected is None else expected)
    t_draft = draft_seconds(timing, choices)
    size = realized_size(timing, choices)
    t = step_seconds(timing, size, t_draft)
    return {"n": len(choices) + 1, "depth": max(len(c) for c in choices), "expected": expected,
            "realized_size": size, "step_s": t, "draft_s": t_draft, "tokens_per_s": expected / t, "choices": choices}


def plan_static(p, timing: dict, max_nodes: int, max_depth: int) -> list[dict]:
    """For every size n = 2..max_nodes: the DP's best tree over depth limits 1..max_depth by predicted tokens/s."""
    best: dict[int, dict] = {}
    for depth in range(1, max_depth + 1):
        for sol in optimal_trees(p, max_nodes, depth)[1:]:
            if sol is None:
                continue
            row = predict_static(p, timing, sol.choices, sol.value)
            if sol.size not in best or row["tokens_per_s"] > best[sol.size]["tokens_per_s"]:
                best[sol.size] = row
    return [best[n] for n in sorted(best)]


# ---- The whole thing -------------------------------------------------------------------------


def _default_options(drafter, options: dict | None) -> dict | None:
    """The drafter_options autotune compiles with: the caller's, else Token Recycling's without its n-gram branches."""
    if options is not None:
        return dict(options)
    if not isinstance(drafter, str):  # a draft LM given itself: no stored defaults
        return None
    if drafter == "token_recycling":
        return {"ngram_branches": 0}
    return None  # compile reads the layers `speccomp search` chose on this machine, naming the file if they are bad


def _check_arguments(drafter, mode: str, drafter_options, **ints) -> None:
    """Refuse what autotune cannot tune, before any work: merged, unknown or tree-less drafters, bad settings."""
    from speccomp.drafters.merge import split_names
    from speccomp.drafters.registry import DRAFTERS

    if is_draft_lm(drafter):
        pass  # a draft LM given itself: its options were checked by drafter_key
    elif split_names(drafter):
        raise AutotuneError(
            f"cannot autotune the merged drafter {drafter!r} as a whole: autotune its first drafter "
            f"({split_names(drafter)[0]!r}); compile(drafter={drafter!r}, tree='auto') then uses that drafter's tree"
        )
    elif not isinstance(drafter, str) or drafter not in DRAFTERS:
        raise AutotuneError(f"unknown drafter {drafter!r}; accepted values: {sorted(DRAFTERS)}, or a draft LM itself")
    elif untunable(drafter):
        raise AutotuneError(f"cannot autotune {drafter!r}: {untunable(drafter)}; tune token_recycling or a self-drafter instead")
    if mode not in ("auto", "static", "dynamic"):
        raise AutotuneError(f"unknown mode {mode!r}; accepted values: ['auto', 'dynamic', 'static']")
    if drafter_options is not None and not isinstance(drafter_options, dict):
        raise AutotuneError(f"drafter_options must be a dict of the drafter's options, got {drafter_options!r:.200}; "
                            "e.g. drafter_options={'top_k': 8}")
    lows = {"max_nodes": 2, "max_depth": 1, "ranks": 1, "max_new_tokens": 2, "repeats": 1, "dynamic_top_k": 1,
            "warmup": 0}
    for name, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < lows[name]:
            raise AutotuneError(f"{name} must be an int >= {lows[name]}, got {value!r}")


def _int_list(name: str, value):
    """`value` (dynamic_budgets, measure_sizes: any iterable of integers, numpy's included) as a list of ints."""
    import operator

    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        value = list(value)  # once: a generator is read here, not used up by a check
        if any(isinstance(v, bool) for v in value):
            raise TypeError
        return [operator.index(v) for v in value]
    except TypeError:
        raise AutotuneError(f"{name} must be a list of ints, got {value!r:.200}; e.g. {name}=[4, 8, 16]") from None


def _split_prompts(prompts, check_prompts) -> tuple[list, list]:
    """(calibration prompts, held-back prompts), each [1, n]; without `check_prompts`, every third prompt is held
    back (prompts listed file by file in turn, as the shipped ones are, then leave out prompts of several files)."""
    from speccomp.tuning.search import prompt_list

    checked = prompt_list(prompts)
    if checked is None:
        raise AutotuneError(f"prompts must be a list of token id tensors [1, n] or [n], got {prompts!r:.200}; e.g. "
                            "[chat_ids(tokenizer, text) for text in texts]")
    prompts = checked
    if not prompts:
        raise AutotuneError("autotune needs at least one calibration prompt (token ids)")
    if check_prompts is None:
        prompts, check_prompts = [p for i, p in enumerate(prompts) if i % 3 != 2], prompts[2::3]
    if not all(isinstance(p, torch.Tensor) and p.dim() in (1, 2) for p in check_prompts):
        raise AutotuneError(f"check_prompts must be token id tensors [1, n] or [n], got {check_prompts!r:.200}")
    return prompts, [p if p.dim() == 2 else p[None] for p in check_prompts]


@dataclass
class _Session:
    """One autotune run: the compiled model, the calibration decodes' settings and what is measured (`_session`)."""

    drafter: str
    sm: object  # the model compiled with the drafter (and its default tree)
    prompts: list
    max_new_tokens: int
    eos: object
    max_nodes: int  # largest tree considered
    depth: int  # the probe tree: depth x ranks
    ranks: int
    do_static: bool
    budgets: list  # dynamic budgets decoded
    sizes: list  # tree sizes whose verify step is timed
    extra_sizes: list  # static tree sizes decoded besides the chosen one
    context_len: int
    warmup: int = 0  # acceptance counts steps after this many tokens of a reply
    bar: object = None
    limits: tuple = (None, None)  # the caller's max_depth and ranks: no static tree considered goes past them

    def decode(self, sm, refs=None, what: str | None = None) -> dict:
        """`_run` on the calibration prompts; with `what`, an output that is not `refs` raises (a bug)."""
        run = _run(sm, self.prompts, self.max_new_tokens, self.eos, refs, bar=self.bar)
        if what is not None and not run["identical"]:
            raise RuntimeError(f"{what} changed the greedy output; please report this")
        return run


def _session(sm, drafter: str, mode: str, prompts, *, max_nodes: int, max_depth: int, ranks: int, dynamic_budgets,
             measure_sizes, max_new_tokens: int, eos, warmup: int = 0, dynamic_top_k: int = 1) -> _Session:
    """The probe, the sizes to time and the trees to decode, within the model's limits (sliding windows)."""
    dynamic_ok = "dynamic" in sm.drafter.trees
    if mode == "dynamic" and not dynamic_ok:
        raise AutotuneError(f"the {drafter} drafter takes static trees only; use mode='static' (or 'auto')")
    do_dynamic = mode == "dynamic" or (mode == "auto" and dynamic_ok)
    asked_nodes, asked_ranks = max_nodes, ranks
    max_nodes = min(max_nodes, sm.max_tree)
    if max_nodes < 2:
        raise AutotuneError(f"the model fits trees of at most {sm.max_tree} nodes (sliding window); nothing to tune")
    # the probe may be larger than the trees considered: only the model's limit applies
    depth = min(max_depth, sm.drafter.max_tree_depth or max_depth, sm.max_tree - 1)
    ranks = min(ranks, sm.drafter.max_siblings or ranks)
    while 1 + depth * ranks > sm.max_tree and ranks > 1:
        ranks -= 1
    while 1 + depth * ranks > sm.max_tree:
        depth -= 1
    depth = min(depth, max_nodes - 1)
    budgets = sorted({b for b in dynamic_budgets if 1 <= b <= max_nodes - 1}) if do_dynamic else []
    _check_wanted(sm, drafter, do_dynamic, max_nodes, dynamic_top_k, dynamic_budgets, measure_sizes)
    if do_dynamic and not budgets:
        raise AutotuneError(f"no dynamic budget in {list(dynamic_budgets)} fits trees of {max_nodes} nodes")
    asked = {"max_nodes": (asked_nodes, DEFAULT_MAX_NODES, max_nodes), "max_depth": (max_depth, PROBE_DEPTH, depth),
             "ranks": (asked_ranks, PROBE_RANKS, ranks)}
    cut = [f"{k}={a} -> {used}" for k, (a, default, used) in asked.items() if a != default and used < a]
    if cut:  # a limit the user chose that the model or drafter cannot reach: tuned within theirs, said so
        warnings.warn(f"autotune: {', '.join(cut)}: the limits here are trees of at most {sm.max_tree} nodes (the "
                      f"model), depth {sm.drafter.max_tree_depth or 'any'} and {sm.drafter.max_siblings or 'any'} "
                      f"siblings (the {drafter} drafter), a probe of at most {sm.max_tree} nodes and depths below "
                      "max_nodes", stacklevel=3)
    probe_size = 1 + depth * ranks
    sizes = sorted({n for n in TIMED_SIZES if n <= max(max_nodes, probe_size)} | {max_nodes, probe_size})
    if measure_sizes == "report":
        measure_sizes = [n for n in REPORT_SIZES if n <= max_nodes]
    extra_sizes = sorted({int(n) for n in (measure_sizes or []) if 2 <= int(n) <= max_nodes})
    context_len = int(sum(p.shape[1] for p in prompts) / len(prompts)) + max_new_tokens // 2
    if sm.max_positions is not None:
        context_len = max(1, min(context_len, sm.max_positions - max(sizes) - 2))
    return _Session(drafter, sm, prompts, max_new_tokens, eos, max_nodes, depth, ranks, mode in ("auto", "static"),
                    budgets, sizes, extra_sizes, context_len, warmup, limits=(max_depth, asked_ranks))


def _check_wanted(sm, drafter: str, do_dynamic: bool, max_nodes: int, top_k: int, budgets, sizes) -> None:
    """Before any measuring: a dynamic top-k the drafter cannot score is refused; budgets and sizes the caller gave
    that no tree of max_nodes holds are named (they are left out)."""
    if do_dynamic and sm.drafter.max_siblings and top_k > sm.drafter.max_siblings:
        raise AutotuneError(f"dynamic_top_k={top_k}: the {drafter} drafter scores at most {sm.drafter.max_siblings} "
                            f"tokens per node; give dynamic_top_k <= {sm.drafter.max_siblings} (or mode='static')")
    given = do_dynamic and list(budgets) != list(DYNAMIC_BUDGETS)  # the defaults cut to max_nodes are no news
    left_out = {"dynamic_budgets": [b for b in budgets if b > max_nodes - 1] if given else [],
                "measure_sizes": [n for n in sizes or [] if n > max_nodes] if sizes != "report" else []}
    said = [f"{k} {v} (above {max_nodes - 1 if k == 'dynamic_budgets' else max_nodes})"
            for k, v in left_out.items() if v]
    if said:
        warnings.warn(f"autotune: leaving out {' and '.join(said)}: trees here have at most {max_nodes} nodes, root "
                      "included (max_nodes, the model's sliding windows)", stacklevel=4)


def _step_costs(s: _Session, steps: list[dict], repeats: int) -> dict:
    """`time_steps`, plus what the probe's recorded steps cost beyond it: propose, observe, per-level overhead."""
    widths = [w for w in s.sizes if w <= max(s.max_nodes - 1, s.ranks)]  # a depth of the trees (or of the probe)
    timing = time_steps(s.sm, s.prompts, context_len=s.context_len, sizes=s.sizes, widths=widths, repeats=repeats,
                        bar=s.bar)
    probe_choices = probe_tree(s.depth, s.ranks).choices
    proposed = [st for st in steps if st["room"] > 0]
    timing["propose_s"] = statistics.median(st["propose_s"] for st in proposed) if proposed else 0.0
    timing["observe_per_node_s"] = statistics.median(st["observe_s"] / st["size"] for st in steps) if steps else 0.0
    timing["draft_overhead_per_level_s"] = 0.0
    probe_levels = len(_tree_widths(probe_choices)) - 1
    if timing["widths"]:  # what propose costs beyond its forwards (Python, top-k), per draft level of the probe
        beyond = max(0.0, timing["propose_s"] - draft_seconds(timing, probe_choices))
        timing["draft_overhead_per_level_s"] = beyond / probe_levels
    elif s.sm.drafter.forward_per_level:  # its own forward per level: propose time scales with depth
        timing["propose_per_level_s"] = timing["propose_s"] / probe_levels
    # nodes the drafter really sent, per depth, against the probe's (token recycling prunes rowless tokens)
    presence = []
    for d in range(1, s.depth + 1):
        sent = [st["per_depth"][d] if d < len(st["per_depth"]) else 0 for st in steps if st["room"] >= d]
        presence.append(min(1.0, sum(sent) / (s.ranks * len(sent))) if sent else 1.0)
    timing["presence"] = presence
    return timing


def _decode_dynamic(s: _Session, b: int, top_k: int, refs) -> tuple[int, list[dict], dict]:
    """Decode dynamic budget `b` with its steps recorded: (b, steps, run)."""
    s.bar.set_postfix_str(f"dynamic budget {b}")
    dyn = _warm(with_tree(s.sm, DynamicTreeSpec(b, top_k)), s.prompts, s.eos)
    dyn.drafter = recorder = _Recorder(dyn.drafter)
    return b, recorder.steps, s.decode(dyn, refs, what=f"{s.drafter} with tree dynamic:{b}:{top_k}")


def _dynamic_row(timing: dict, b: int, top_k: int, steps: list[dict], run: dict) -> dict:
    """A decoded dynamic budget's steady-state tokens per step and tree size, its prediction and measurement."""
    from speccomp.drafters.grow import MAX_DYNAMIC_DEPTH

    full = [st for st in steps if st["room"] >= min(b, MAX_DYNAMIC_DEPTH)] or steps  # steady state
    expected = statistics.mean(len(st["path"]) for st in full) if full else 1.0
    mean_size = statistics.mean(st["size"] for st in full) if full else 1.0
    t_draft = statistics.median(st["propose_s"] for st in steps) if steps else 0.0
    t = step_seconds(timing, mean_size, t_draft)
    return {
        "budget": b, "top_k": top_k, "expected": expected, "mean_size": mean_size, "draft_s": t_draft,
        "step_s": t, "tokens_per_s": expected / t, "measured_tokens_per_s": run["tokens_per_s"],
        "measured_tokens_per_step": run["tokens_per_step"], "identical": run["identical"], **_totals(run),
    }


def _measure(s: _Session, top_k: int, repeats: int):
    """Step 1: (plain decoding's run, Acceptance, timing, the decoded dynamic budgets as (b, steps, run))."""
    s.bar.set_postfix_str("greedy decoding without drafts (reference)")
    ref = s.decode(_warm(s.sm.with_drafter(RootOnly()), s.prompts, s.eos))  # through the same lowered target graph
    s.bar.set_postfix_str(f"acceptance, probe {s.depth}x{s.ranks}")
    acc, steps, probe_runs = measure_acceptance(s.sm, s.prompts, max_new_tokens=s.max_new_tokens, eos=s.eos,
                                                depth=s.depth, ranks=s.ranks, warmup=s.warmup, bar=s.bar)
    s.bar.set_postfix_str("step costs")
    timing = _step_costs(s, steps, repeats)
    # dynamic budgets: decoded now, since their wall times also calibrate the loop overhead
    dynamic = [_decode_dynamic(s, b, top_k, ref["outputs"]) for b in s.budgets]
    # the decode loop's own cost per step (tree bookkeeping, masks, stats), a + b*n over every calibration
    # decode: wall time minus the parts timed above, per step, at the run's mean tree size
    recorded = [(probe_runs, steps)] + [(run["runs"], st) for _, st, run in dynamic]
    points = [_loop_point(ref["runs"], [], timing)] + [_loop_point(r, st, timing) for r, st in recorded if st]
    timing["loop_points"] = [list(pt) for pt in points]
    timing["loop_overhead_s"], timing["loop_overhead_per_node_s"] = fit_loop_overhead(points)
    return ref, acc, timing, dynamic


def _fits(s: _Session, choices: list) -> bool:
    """Whether a static tree fits the drafter (depth, siblings) and the limits this run was given (max_nodes,
    max_depth, ranks)."""
    if not choices:
        return True
    d, (max_depth, max_ranks) = s.sm.drafter, s.limits
    depth, ranks = max(len(c) for c in choices), 1 + max(max(c) for c in choices)
    return (len(choices) + 1 <= s.max_nodes and depth <= min(d.max_tree_depth or depth, max_depth or depth)
            and ranks <= min(d.max_siblings or ranks, max_ranks or ranks))


def _default_fits(s: _Session) -> bool:
    """Whether the drafter's default tree is within the limits this run was given (max_nodes, root included; a
    static one's depth and ranks too): one past them is only the baseline of the held-back check, never stored."""
    tree = s.sm.drafter.tree
    if isinstance(tree, DynamicTreeSpec):
        return tree.budget + 1 <= s.max_nodes
    return _fits(s, [list(c) for c in tree.choices])


def _candidates(s: _Session, static_rows: list[dict], p, timing: dict, top_k: int) -> list[tuple[str, str, object, dict]]:
    """(label, mode, tree, predicted row) of every configuration decoded on the calibration prompts: the DP trees
    with the best predictions, the report's sizes, the hand-made shapes users pick (HAND_TREES) and the drafter's
    default tree. The prediction only ranks what to try; the measured decodes pick (`_final_choice`)."""
    out, seen = [], set()

    def add(label: str, mode: str, tree, row: dict) -> None:
        key = json.dumps(tree)
        if key not in seen:
            seen.add(key)
            out.append((label, mode, tree, row))

    by_n = {r["n"]: r for r in static_rows}
    for row in sorted(static_rows, key=lambda r: -r["tokens_per_s"])[:PLANNED_CANDIDATES]:
        add(f"static n={row['n']}", "static", row["choices"], row)
    for n in s.extra_sizes:
        if n in by_n:
            add(f"static n={n}", "static", by_n[n]["choices"], by_n[n])
    if s.do_static:
        for label, choices in HAND_TREES.items():
            if _fits(s, choices):
                add(label, "static", choices, predict_static(p, timing, choices))
    default = _tree_value(s.sm.drafter.tree)
    dynamic_default = isinstance(s.sm.drafter.tree, DynamicTreeSpec)
    if ((s.budgets if dynamic_default else s.do_static) and default not in [f"dynamic:{b}:{top_k}" for b in s.budgets]
            and _default_fits(s)):
        row = {} if dynamic_default else predict_static(p, timing, default)
        add("default", "default", default, row)
    return out


def _decode_candidates(s: _Session, candidates: list, refs) -> list[dict]:
    """Decode every candidate on the calibration prompts: predicted against measured tokens/s."""
    measured = []
    for label, mode, tree, row in candidates:
        s.bar.set_postfix_str(f"decoding {label}")
        run = s.decode(_warm(with_tree(s.sm, parse_tree_spec(tree)), s.prompts, s.eos), refs,
                       what=f"{s.drafter} with the tree {tree}")
        measured.append({
            "label": label, "mode": mode, "tree": tree, "n": row.get("n", float("nan")),
            "expected": row.get("expected", float("nan")),
            "predicted_tokens_per_s": row.get("tokens_per_s", float("nan")),
            "measured_tokens_per_s": run["tokens_per_s"], "measured_tokens_per_step": run["tokens_per_step"],
            "identical": run["identical"], **_totals(run),
        })
    return measured


def _warm(sm, prompts, eos):
    """`sm` after one short untimed decode: a tree's first step with new shapes pays one-off costs (ONNX Runtime
    plans memory for every new input shape) that must not count against it."""
    sm.generate(prompts[0], max_new_tokens=4, eos_token_id=eos)
    return sm


def _totals(run: dict) -> dict:
    """Decode tokens and seconds of a `_run` (prefill left out): what combining runs over more prompts adds up."""
    seconds, _ = _decode_totals(run["runs"])
    return {"decode_tokens": sum(r["new_tokens"] - 1 for r in run["runs"]), "decode_seconds": seconds}


def _measured_dynamic(row: dict) -> dict:
    """A dynamic budget's row of the predicted-vs-measured table."""
    return {"label": f"dynamic:{row['budget']}:{row['top_k']}", "mode": "dynamic",
            "tree": f"dynamic:{row['budget']}:{row['top_k']}", "n": row["mean_size"],
            "expected": row["expected"], "predicted_tokens_per_s": row["tokens_per_s"],
            "measured_tokens_per_s": row["measured_tokens_per_s"],
            "measured_tokens_per_step": row["measured_tokens_per_step"], "identical": row["identical"],
            "decode_tokens": row["decode_tokens"], "decode_seconds": row["decode_seconds"]}


def _finalists(measured: list[dict]) -> list[dict]:
    """The calibration's fastest configurations: at most FINALISTS, within FINALIST_MARGIN of the fastest (closer
    than calibration noise can tell apart on a handful of prompts)."""
    if not measured:
        raise AutotuneError("nothing was decoded to choose from (no tree fits this model and these settings)")
    ranked = sorted(measured, key=lambda r: -r["measured_tokens_per_s"])
    best = ranked[0]["measured_tokens_per_s"]
    return [r for r in ranked if r["measured_tokens_per_s"] >= (1 - FINALIST_MARGIN) * best][:FINALISTS]


def autotune(
    model, drafter, prompts, *, backend: str = "eager", drafter_options: dict | None = None,
    max_nodes: int = DEFAULT_MAX_NODES, max_depth: int = PROBE_DEPTH, ranks: int = PROBE_RANKS, mode: str = "auto",
    dynamic_budgets=DYNAMIC_BUDGETS, dynamic_top_k: int = DEFAULT_DYNAMIC_TOP_K, max_new_tokens: int = 128,
    warmup: int | None = None, eos_token_id=None, repeats: int = 5, measure_sizes=None, check_prompts=None,
    save: bool = True, progress: bool = False) -> AutotuneResult:
    """Measure acceptance and step costs of `drafter` on `model`, pick the fastest tree, store it.

    drafter        a name from available_drafters(), or a draft LM itself (as compile takes it; drafter_options
                   its tokenizers where it has its own): stored under its fingerprint (`drafter_key`)
    prompts        calibration prompts (token id tensors [1, n] or [n]); backend: as compile's
    max_nodes      largest tree considered, root included (also capped by the model's sliding windows)
    max_depth, ranks   the probe tree: depths measured and candidates per node (no static tree considered, the DP's,
                   the hand-made shapes or the default, goes past them; dynamic budgets grow as they do)
    mode           "static", "dynamic" (drafters that grow trees: early_exit, layer_skip, hydra, eagle) or
                   "auto" (both where the drafter supports dynamic trees; the faster prediction wins)
    dynamic_budgets    budgets tried in dynamic mode (draft nodes, root not counted), with `dynamic_top_k`
    max_new_tokens per calibration reply: as long as real replies (a drafter's state grows with the reply)
    warmup         acceptance counts the steps after this many tokens of each reply (default max_new_tokens // 4)
    measure_sizes  static tree sizes to decode for predicted-vs-measured rows besides the chosen one
    check_prompts  prompts the tuned tree must beat the drafter's default tree on (else the default is stored);
                   None: every third of `prompts` when there are 3 or more (they are then not calibrated on)
    save           store the result where compile(tree="auto") finds it, and the target's batch step-cost curve
                   over batch size x tree size (tuning/step_curve.py), which every later compile's batches plan with
    The tree stored is, of the calibration's fastest among the DP's best predictions, the dynamic budgets, hand-made
    shapes (HAND_TREES) and the default, the one that decoded all prompts fastest in a final round side by side
    with the default and plain decoding, and then beat the default on the held-back prompts. Every decoded
    configuration is compared with plain greedy decoding; a mismatch raises.
    """
    import speccomp
    from tqdm import tqdm

    warmup = max_new_tokens // 4 if warmup is None else warmup
    name = drafter_key(drafter, drafter_options)  # stored under: a drafter's name, or a draft LM's fingerprint
    _check_arguments(drafter, mode, drafter_options, max_nodes=max_nodes, max_depth=max_depth, ranks=ranks,
                     max_new_tokens=max_new_tokens, repeats=repeats, dynamic_top_k=dynamic_top_k, warmup=warmup)
    dynamic_budgets = _int_list("dynamic_budgets", dynamic_budgets)
    if measure_sizes is not None and measure_sizes != "report":
        measure_sizes = _int_list("measure_sizes", measure_sizes)
    prompts, check_prompts = _split_prompts(prompts, check_prompts)
    options = _default_options(drafter, drafter_options)
    sm = speccomp.compile(model, drafter=drafter, drafter_options=None if options is None else dict(options),
                          backend=backend)
    # stored with the result; a draft LM's tokenizers are in its key, not stored (its drafter says "tokenizers": "own")
    options = dict(sm.drafter.options or {}) if is_draft_lm(drafter) else dict(sm.drafter.options or options or {})
    if not is_draft_lm(drafter):
        options.pop("tokenizers", None)  # the named draft_model's own-tokenizers mark: its tokenizers are in its key
    s = _session(sm, name, mode, prompts, max_nodes=max_nodes, max_depth=max_depth, ranks=ranks,
                 dynamic_budgets=dynamic_budgets, measure_sizes=measure_sizes, max_new_tokens=max_new_tokens,
                 eos=eos_token_id, warmup=warmup, dynamic_top_k=dynamic_top_k)
    runs = 2 * len(prompts) + repeats + len(s.budgets) * len(prompts)
    s.bar = tqdm(total=runs, desc=f"autotune {name}", disable=not progress, unit="run")
    ref, acc, timing, dynamic = _measure(s, dynamic_top_k, repeats)
    static_rows = plan_static(acc.p, timing, s.max_nodes, s.depth) if s.do_static else []  # 2. optimise
    dynamic_rows = [_dynamic_row(timing, b, dynamic_top_k, steps, run) for b, steps, run in dynamic]
    candidates = _candidates(s, static_rows, acc.p, timing, dynamic_top_k)
    s.bar.total += len(candidates) * len(prompts)
    measured = _decode_candidates(s, candidates, ref["outputs"]) + [_measured_dynamic(r) for r in dynamic_rows]
    chosen, check = _final_choice(sm, _finalists(measured), prompts, check_prompts, max_new_tokens, eos_token_id,
                                  s.bar, keep_default=_default_fits(s))  # 3.
    s.bar.close()
    acceptance = {"p": acc.p, "p_raw": acc.p_raw, "hits": acc.hits, "visits": acc.visits, "probe_depth": s.depth,
                  "probe_ranks": s.ranks, "warmup": warmup}
    result = AutotuneResult(drafter=name, backend=backend, key=cache_key(model, name, backend), drafter_options=options,
                            **_kept(chosen, check, measured, ref["tokens_per_s"]), context_len=s.context_len,
                            acceptance=acceptance, timing=timing, static=static_rows, dynamic=dynamic_rows,
                            measured=measured, plain_tokens_per_s=ref["tokens_per_s"], check=check)
    return _store(result, sm, model, drafter) if save else result


def _kept(chosen: dict, check: dict, measured: list[dict], plain_tokens_per_s: float) -> dict:
    """The stored configuration's fields: the final choice, or the drafter's default tree where the held-back
    prompts kept it (its speed is then what the default measured on them); "plain" where decoding without drafts
    beat that tree on the held-back prompts (with none held back, on the calibration prompts: `plain_tokens_per_s`;
    a tree with no speed there keeps drafting)."""
    if check.get("kept") != "default":
        kept = {"mode": chosen["mode"], "tree": chosen["tree"], "predicted_tokens_per_s": chosen["predicted_tokens_per_s"],
                "measured_tokens_per_s": chosen["measured_tokens_per_s"]}
    else:
        row = next((r for r in measured if r["tree"] == check["default"]), {})
        kept = {"mode": "default", "tree": check["default"],
                "predicted_tokens_per_s": row.get("predicted_tokens_per_s", float("nan")),
                "measured_tokens_per_s": check["default_tokens_per_s"]}
    plain, tree = _verdict_speeds(check, plain_tokens_per_s, kept["measured_tokens_per_s"])
    return {**kept, "plain": bool(plain > tree)}  # nan (nothing measured) compares False: the tree drafts


def _verdict_speeds(check: dict, plain_calibration: float, kept_calibration: float) -> tuple[float, float]:
    """(plain, kept tree) decode tok/s the plain verdict compares: on the held-back prompts, or without any the
    calibration's (the kept tree is then the calibration's choice)."""
    if check:
        return check["plain_tokens_per_s"], check[f"{check['kept']}_tokens_per_s"]
    return plain_calibration, kept_calibration


def _store(result: AutotuneResult, sm, model, drafter) -> AutotuneResult:
    """Write `result` where compile(tree="auto") finds it, with the batch step-cost curve of a model that batches
    (its budget's curve, learnt here; tuning/step_curve.py)."""
    from speccomp.models import write_atomically

    path = result_path(model, result.drafter, result.backend)
    result.trained = trained_digest(model, drafter, result.drafter_options) if isinstance(drafter, str) else None
    try:
        if not getattr(sm, "batch_refusal", None):
            result.step_curve = str(store_curve(model, result.backend, sm.step_costs()))
        write_atomically(path, json.dumps(result.to_dict(), indent=1, default=float))
        result.path = str(path)
    except OSError as exc:  # tuned all the same: the caller (or this compile) uses the result; it is just not kept
        warnings.warn(f"autotune: could not store the result in {path.parent} ({exc}); it is used but not kept, so "
                      "tree='auto' tunes again next time: set SPECCOMP_CACHE to a writable folder", stacklevel=3)
    return result


def _tree_value(spec):
    """A tree as a stored result holds it: a choice list, or "dynamic:B:K"."""
    return str(spec) if isinstance(spec, DynamicTreeSpec) else [list(c) for c in spec.choices]


def _final_choice(sm, finalists: list[dict], calibration, held_back, max_new_tokens: int, eos, bar,
                  keep_default: bool = True) -> tuple[dict, dict]:
    """The final round: the finalists (measured rows), the drafter's default tree (`sm`'s own) and plain decoding
    decode the calibration and the held-back prompts side by side (`_side_by_side`), every output checked against
    plain decoding's. The finalist fastest over both sets of prompts wins; the default is kept ("kept": "default")
    unless the winner also decodes the held-back prompts faster than it, or the default is past the run's limits
    (`keep_default` False: it is then the baseline only). ({} and the calibration's fastest
    without held-back prompts.)

    Why again, side by side: the calibration decoded one configuration after the other, so a load that came and
    went moved one against another (FINALIST_MARGIN); here a prompt's decodes follow each other, in an order that
    rotates."""
    if not held_back:
        return finalists[0], {}
    default = _tree_value(sm.drafter.tree)
    runs = {"plain": sm.with_drafter(RootOnly())}  # as trees: the root alone
    for tree in [r["tree"] for r in finalists] + [default]:
        runs.setdefault(json.dumps(tree), sm if tree == default else with_tree(sm, parse_tree_spec(tree)))
    prompts = list(calibration) + list(held_back)
    stats = _side_by_side(runs, prompts, max_new_tokens, eos, sm.drafter.name, bar)
    held = range(len(calibration), len(prompts))
    both = lambda tree: _rate(stats[json.dumps(tree)])  # noqa: E731
    held_rate = lambda key: _rate([stats[key][i] for i in held])  # noqa: E731
    winner = max(finalists, key=lambda r: both(r["tree"]))
    tuned, base = held_rate(json.dumps(winner["tree"])), held_rate(json.dumps(default))
    beats = winner["tree"] != default and (tuned > base or not keep_default)  # a default past the limits is no choice
    return winner, {
        "prompts": len(held), "calibration_prompts": len(calibration), "tuned": winner["tree"], "default": default,
        "tuned_tokens_per_s": tuned, "default_tokens_per_s": base, "kept": "tuned" if beats else "default",
        "plain_tokens_per_s": held_rate("plain"),
        "finalists": [{"tree": r["tree"], "label": r["label"], "calibration_tokens_per_s": r["measured_tokens_per_s"],
                       "held_back_tokens_per_s": held_rate(json.dumps(r["tree"])),
                       "combined_tokens_per_s": both(r["tree"])} for r in finalists],
    }


def _side_by_side(runs: dict, prompts, max_new_tokens: int, eos, name: str, bar, refs=None) -> dict[str, list[dict]]:
    """key -> every prompt's `last_stats` decoded by `runs[key]`: each after one untimed warm-up, then prompt by
    prompt, every run in turn (the order rotating from prompt to prompt, so no run always follows the same one).
    Every output must equal `refs[i]` (default: the "plain" run's; a tree that changes the greedy output is a bug:
    it raises). benchmarks/autotune.py times its rows with it too."""
    keys = list(runs)
    if bar is not None:
        bar.total += len(keys) * len(prompts)
        bar.set_postfix_str(f"final round: {len(keys)} side by side")
    for key in keys:
        _warm(runs[key], prompts, eos)
    stats = {key: [] for key in keys}
    for i, prompt in enumerate(prompts):
        outs = {}
        for key in keys[i % len(keys):] + keys[: i % len(keys)]:
            outs[key] = runs[key].generate(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos)
            stats[key].append(dict(runs[key].last_stats))
            if bar is not None:
                bar.update()
        for key, out in outs.items():
            if not torch.equal(out, outs["plain"] if refs is None else refs[i]):
                against = "plain decoding's" if refs is None else "the reference's"
                raise RuntimeError(f"{name} with the tree {key} changed the greedy output (against {against}) while "
                                   "timed side by side; please report this")
    return stats


def _rate(runs: list[dict]) -> float:
    """Decode tokens/s over `last_stats` entries (prefill and its token left out), nan where none took time."""
    seconds, _ = _decode_totals(runs)
    return sum(r["new_tokens"] - 1 for r in runs) / seconds if seconds > 0 else float("nan")


# ---- Report ----------------------------------------------------------------------------------


def plot_report(result: AutotuneResult, path) -> Path:
    """PNG: verify (and draft) latency by size, acceptance heat map by depth x rank, predicted vs measured tok/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    t = result.timing
    ax = axes[0]
    ax.plot(t["sizes"], [1e3 * s for s in t.get("verify_raw_s", t["verify_s"])], "o", color="C0", label="verify step, median")
    ax.plot(t["sizes"], [1e3 * s for s in t["verify_s"]], "-", color="C0", label="verify step, monotone fit (used)")
    if t.get("widths"):
        ax.plot(t["widths"], [1e3 * s for s in t.get("draft_raw_s", t["draft_s"])], "s", color="C1", label="draft forward per depth, median")
        ax.plot(t["widths"], [1e3 * s for s in t["draft_s"]], "--", color="C1", label="draft forward, monotone fit (used)")
    ax.set(xlabel="tokens in the forward (tree size n / depth width)", ylabel="ms (median)",
           title=f"latency at {result.context_len} cached tokens ({result.backend})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    ax, p = axes[1], result.acceptance["p"]
    top = max(max(r) for r in p)
    im = ax.imshow(p, cmap="viridis", vmin=0, vmax=max(0.01, top), aspect="auto")
    for d, row in enumerate(p):
        for r, x in enumerate(row):
            ax.text(r, d, f"{x:.2f}", ha="center", va="center", fontsize=7, color="w" if x < 0.5 * top else "k")
    ax.set(xlabel="rank r (drafter's r-th candidate)", ylabel="depth",
           title="P(rank-r child accepted | parent accepted)")
    ax.set_xticks(range(len(p[0])))
    ax.set_yticks(range(len(p)), [str(d + 1) for d in range(len(p))])
    fig.colorbar(im, ax=ax, fraction=0.046)

    ax = axes[2]
    if result.static:
        ax.plot([r["n"] for r in result.static], [r["tokens_per_s"] for r in result.static], "-", label="predicted, best static tree of n nodes")
    stat = [r for r in result.measured if r["mode"] == "static"]
    if stat:
        ax.plot([r["n"] for r in stat], [r["measured_tokens_per_s"] for r in stat], "o", label="measured, static")
    dyn = [r for r in result.measured if r["mode"] == "dynamic"]
    if dyn:
        ax.plot([r["n"] for r in dyn], [r["predicted_tokens_per_s"] for r in dyn], "x", label="predicted, dynamic (mean nodes)")
        ax.plot([r["n"] for r in dyn], [r["measured_tokens_per_s"] for r in dyn], "^", label="measured, dynamic")
    if not math.isnan(result.plain_tokens_per_s):
        ax.axhline(result.plain_tokens_per_s, color="gray", ls=":", label="no drafts (1 token per step)")
    chosen = result.tree if isinstance(result.tree, str) else f"{len(result.tree) + 1} nodes"
    chosen += " (the default tree)" if result.mode == "default" else ""
    ax.set(xlabel="tree size n (nodes, root included)", ylabel="decode tokens/s",
           title=f"{result.drafter}: chosen {chosen}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    from speccomp.tuning.bench import save_figure

    return save_figure(fig, path, dpi=110)
