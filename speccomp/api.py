"""`speccomp.compile(model)`: capture -> passes -> lower -> a model with `.generate`."""
from __future__ import annotations

import copy

import torch

from speccomp.backends import lower

from .calls import ACCEPTANCE, MAX_TREE, CallGuard, as_int, choice, generate_args
from .capture import capture
from .errors import OptionError, OptionTypeError
from .graph import SpecGraph, run_passes
from .runtime import decode_plain
from .sampling import Sampler
from .speculative import decode_speculative
from .tree import check_tree_width, tree_option

DRAFTERS: dict[str, object] = {}  # name -> drafter factory; filled by the drafter modules
SEARCHED = ("early_exit", "layer_skip")  # drafters whose layers speccomp.search_drafter can pick


def available_drafters() -> list[str]:
    return sorted(DRAFTERS)


class SpecModel:
    """A compiled causal LM. `generate` returns prompt + new tokens, like HF `generate`.

    Thread safety: `generate` may be called from several threads; calls on one SpecModel run one at a time
    (drafters keep per-generation state), and `last_stats` is the calling thread's own last call's."""

    export_refusal: str | None = None  # why `export` must refuse this kind of model (None: it can export)

    def __init__(self, spec_graph: SpecGraph, step, backend: str, drafter=None, model=None):
        self.graph = spec_graph
        self.model = model  # the source model (identity for export manifests)
        self.step = step
        self.backend = backend
        self.drafter = drafter
        self.kv = spec_graph.captured.kv
        self.max_positions = spec_graph.captured.max_positions
        self._calls = CallGuard()
        self.max_tree = max_tree_nodes(spec_graph.structure)
        weight = next(iter(spec_graph.gm.parameters()), None)
        self.device = weight.device if weight is not None else torch.device("cpu")

    @property
    def last_stats(self) -> dict:
        """new_tokens, steps (target forwards), tau, seconds, acceptance_by_depth, ... of this thread's last call."""
        return self._calls.stats

    @property
    def providers(self) -> list[str] | None:
        """The ONNX Runtime execution providers the sessions really run on (None: not an ONNX Runtime backend)."""
        return getattr(self.step, "providers", None)

    def with_drafter(self, drafter) -> "SpecModel":
        """A copy that shares this model's lowered graphs (and so its lock) but drafts with `drafter` (own stats)."""
        new = copy.copy(self)
        new.drafter, new._calls = drafter, CallGuard(lock=self._calls.lock)  # the graphs are shared: so is the lock
        return new

    def __repr__(self) -> str:
        drafter = getattr(self.drafter, "name", type(self.drafter).__name__) if self.drafter is not None else None
        on = f", providers={self.providers}" if self.providers else ""
        return f"{type(self).__name__}({self.graph.captured.model_type}, drafter={drafter!r}, backend={self.backend!r}{on})"

    def generate(
        self,
        input_ids,
        max_new_tokens: int,
        eos_token_id=None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        acceptance: str = "exact",
    ) -> torch.Tensor:
        """input_ids: [seq] or [1, seq] token ids (a LongTensor, an integer array or a list). eos_token_id: an int
        or a list of ints. acceptance: "exact" (lossless: greedy equality / rejection sampling) or "typical-lossy"
        (Medusa's typical acceptance with do_sample=True; LOSSY, the text no longer follows the model's
        distribution; `last_stats["lossless"]` says which ran). Every argument is checked before any work
        (speccomp/calls.py); a bad one raises OptionError / OptionTypeError naming it."""
        args = generate_args(input_ids, max_new_tokens, eos_token_id, do_sample, temperature, top_p, seed,
                             vocab_size=self.graph.captured.vocab_size, max_positions=self.max_positions)
        choice("acceptance", acceptance, ACCEPTANCE)
        if acceptance != "exact" and not args.do_sample:
            raise OptionError("acceptance", acceptance, "only changes sampling", "with greedy decoding use 'exact'")
        if acceptance != "exact" and self.drafter is None:
            raise OptionError("acceptance", acceptance, "needs a drafter (plain decoding accepts nothing)")
        if isinstance(input_ids, torch.Tensor):
            device, prompt = input_ids.device, input_ids.reshape(1, -1).long()
        else:
            device, prompt = self.device, torch.from_numpy(args.prompt)[None].to(self.device)
        sampler = Sampler(args.do_sample, args.temperature, args.top_p, args.seed)
        with self._calls.lock:
            new, stats = self._decode(prompt, args, sampler, acceptance)
            self._calls.stats = stats
        return torch.cat([prompt, new[None].to(device)], dim=1)

    def _decode(self, prompt: torch.Tensor, args, sampler: Sampler, acceptance: str) -> tuple[torch.Tensor, dict]:
        """(new tokens [m], stats): the decode loop itself; subclasses with other loops override this."""
        eos = set(args.eos)
        if self.drafter is None:
            new, stats = decode_plain(self.step, self.kv, prompt, args.max_new_tokens, eos, sampler)
        else:
            new, stats = decode_speculative(
                self.step, self.drafter, self.kv, prompt, args.max_new_tokens, eos, sampler, self.max_tree, acceptance
            )
        return new, {**stats.as_dict(), "acceptance": acceptance, "lossless": acceptance == "exact",
                     "backend": self.backend, "providers": self.providers}

    def export(self, path, tokenizer=None, overwrite: bool = False):
        """Write an engine directory (ONNX graph + manifest.json [+ tokenizer.json]) that `speccomp.load`
        runs with ONNX Runtime and numpy only. Plain, ngram, token_recycling and medusa compilations export.
        `path` must be a new or empty directory, or with overwrite=True an engine export wrote (nothing of
        anyone else's is ever deleted: backends/onnx_engine.py's `check_destination`)."""
        from speccomp.backends.onnx_engine import export_engine

        if self.export_refusal:
            from speccomp.engine import EngineError

            raise EngineError(self.export_refusal)
        return export_engine(self, path, tokenizer=tokenizer, overwrite=overwrite)


def max_tree_nodes(structure) -> int:
    """How many tree nodes fit in one verification: MAX_TREE, or less where a sliding window is smaller (every
    node of a tree must see the whole tree inside every window: passes/tree_attention.py)."""
    return min([MAX_TREE] + [s.sliding_window for s in structure.attention if s.sliding_window])


def _default_tree(tree, fallback, dynamic_ok: bool = False, drafter: str = ""):
    """The user's tree= as a Tree (or a DynamicTreeSpec where `dynamic_ok`), or `fallback` when None."""
    from .tree import AutoTreeSpec, DynamicTreeSpec, tree_option

    if tree is None:
        return fallback
    spec = tree_option(tree)
    if isinstance(spec, AutoTreeSpec):
        raise OptionError("tree", tree, "is resolved by speccomp.compile for named drafters only",
                          "pass a choice list or an int k (a chain)")
    if isinstance(spec, DynamicTreeSpec) and not dynamic_ok:
        raise OptionError("tree", tree, f"the {drafter!r} drafter takes static trees only (a choice list or an int k)",
                          "dynamic trees are grown by the early_exit, layer_skip, hydra and eagle drafters")
    return spec


def check_options(*, drafter=None, tree=None, kv_cache=None, kv_mode=None, backend: str = "eager",
                  drafter_options=None) -> None:
    """Everything `compile` can check before it has a model (names, types, forms): what the CLI runs before it
    loads one. What needs the model (layer indices, vocabulary, heads, windows) is checked by compile."""
    from speccomp.backends import check

    from .speculative import Drafter

    check(backend)  # unknown names and missing GPU providers fail here, before the capture
    if drafter_options is not None and not isinstance(drafter_options, dict):
        raise OptionTypeError("drafter_options", drafter_options, f"must be a dict, got {type(drafter_options).__name__}",
                              "e.g. drafter_options={'exit_layer': 12}")
    if drafter_options and not all(isinstance(k, str) for k in drafter_options):
        raise OptionTypeError("drafter_options", drafter_options, "option names must be strings")
    if kv_cache is not None or kv_mode is not None:
        from .drafters_kv import check_kv_options

        _, mode = check_kv_options(kv_cache, kv_mode, drafter)
        if mode == "target" and (tree is not None or drafter_options):
            raise OptionError("kv_mode", kv_mode, "'target' decodes without a drafter", "drop tree= and drafter_options=")
        if tree is not None:
            tree_option(tree, MAX_TREE)
        return
    if drafter is not None and not isinstance(drafter, Drafter):
        from .drafters_merge import check_merge, split_names

        merged = split_names(drafter)  # "hydra+token_recycling": one tree merged from several drafters
        if merged:
            check_merge(merged, drafter_options, tree, DRAFTERS)
        else:
            choice("drafter", drafter, DRAFTERS)
    if drafter is None and tree is not None:
        raise OptionError("tree", tree, "shapes the drafter's token tree, but no drafter was given",
                          "give a drafter too (see speccomp.available_drafters())")
    if drafter is None and drafter_options:
        raise OptionError("drafter_options", drafter_options, "given without a drafter", "give drafter= too")
    if tree is not None:
        tree_option(tree, MAX_TREE)


def compile(  # noqa: A001
    model,
    *,
    drafter=None,
    tree=None,
    kv_cache=None,
    kv_mode: str | None = None,
    backend: str = "eager",
    drafter_options: dict | None = None,
) -> SpecModel:
    """Capture `model` with torch.export, rewrite the graph for speculative decoding, lower it.

    model: a Hugging Face causal LM, a plain nn.Module LM, or what `speccomp.capture(model)` returned
        (compiling one model several ways then exports it once).
    drafter: None (plain decoding), a name from `available_drafters()`, names joined by "+" (one tree merged
        from several drafters' trees, e.g. "hydra+token_recycling"; speccomp/drafters_merge.py), or a `Drafter`.
    tree: token tree for the drafter: a Medusa-style choice list, an int k (a chain of k), "dynamic:B:K", or
        "auto" (the tree `speccomp autotune` stored for this model, drafter, backend and machine).
    drafter_options: options of the named drafter (e.g. {"exit_layer": 12}, {"skip": [3, 5]}).
    backend: "eager" (FX graph with CPU lowering passes), "inductor" (torch.compile), "onnxruntime" (exported
        ONNX, ORT sessions; "onnxruntime:cuda" / "tensorrt" on a GPU), "triton" (Triton tree attention).
    kv_cache: None (full cache) or a compression policy "POLICY[:BUDGET]": "sink:256", "snapkv:512", "h2o:512",
        "kivi4", "kivi2", ... (speccomp/kv_policies.py). kv_mode: "draft" (default with a policy; lossless: the
        model drafts for itself over the compressed cache and verifies against the full one, tree= shapes its
        drafts) or "target" (LOSSY: the model itself reads the compressed cache; plain decoding, `last_stats`
        says lossless=False; `.quality(ids, prompt_length)` measures perplexity and KL to the full cache).

    Every argument is checked before any work (`check_options`, then what needs the model right after the
    capture); a bad one raises OptionError / OptionTypeError naming it. The user's model is not changed.
    """
    from .capture import CapturedModel

    captured = None
    if isinstance(model, CapturedModel):  # speccomp.capture(model) once, compiled several ways: rewrite a copy
        captured, model = model.copy(), model.model
    check_options(drafter=drafter, tree=tree, kv_cache=kv_cache, kv_mode=kv_mode, backend=backend,
                  drafter_options=drafter_options)
    if kv_cache is not None or kv_mode is not None:  # KV compression: kv_mode "draft" (lossless) or "target" (LOSSY)
        return _compile_kv(captured or capture(model), model, kv_cache, kv_mode, tree, backend, drafter_options)
    tree, drafter_options = _resolve_auto(model, drafter, tree, backend, drafter_options)
    base = SpecGraph.from_captured(captured or capture(model))
    base.model = model  # drafters that look things up per model (stored heads, searches) need it
    if tree is not None:
        tree_option(tree, max_tree_nodes(base.structure))  # fits this model's windows
    if drafter is None:
        sg = run_passes(base, [])
        return SpecModel(sg, lower(sg, backend), backend, model=model)
    return _compile_drafter(base, model, drafter, tree, backend, drafter_options)


def _compile_kv(captured, model, kv_cache, kv_mode, tree, backend: str, drafter_options):
    from .drafters_kv import check_kv_options, compile_kv_draft

    policy, mode = check_kv_options(kv_cache, kv_mode, None)
    base = SpecGraph.from_captured(captured)
    base.model = model
    if mode == "target":  # the target itself reads the compressed cache
        from .kv_target import compile_kv_target

        return compile_kv_target(base, policy, backend)
    return compile_kv_draft(base, policy, tree, backend, drafter_options)


def _resolve_auto(model, drafter, tree, backend: str, drafter_options):
    """tree="auto": the tree (and options) `speccomp autotune` stored for this model, drafter, backend and machine;
    for a merge, the first drafter's."""
    from .autotune import is_auto, resolve_auto
    from .drafters_merge import split_names

    if not is_auto(tree):
        return tree, drafter_options
    merged = split_names(drafter)
    if not merged:
        return resolve_auto(model, drafter, backend, drafter_options)
    tree, first = resolve_auto(model, merged[0], backend, (drafter_options or {}).get(merged[0]))
    if first:
        drafter_options = {**(drafter_options or {}), merged[0]: first}
    return tree, drafter_options


def _compile_drafter(base: SpecGraph, model, drafter, tree, backend: str, drafter_options) -> SpecModel:
    from speccomp.passes.tree_attention import TreeAttention

    from .drafters_merge import make_merged, split_names
    from .speculative import Drafter

    merged = split_names(drafter)
    if isinstance(drafter, Drafter):
        drafter_obj = drafter
    elif merged:
        drafter_obj = make_merged(merged, base, drafter_options, tree, backend, DRAFTERS)
    else:
        options = drafter_options
        if options is None and drafter in SEARCHED:  # a search on this machine may have chosen the layers
            from .search import cached_options

            options = cached_options(model, drafter, tree)
        drafter_obj = DRAFTERS[drafter](base, dict(options or {}), tree, backend)
    # a drafter may need the target graph to compute more (Medusa: head states on every token)
    target = run_passes(base.clone(), list(getattr(drafter_obj, "target_passes", [])) + [TreeAttention()])
    return SpecModel(target, lower(target, backend), backend, drafter=drafter_obj, model=model)


def _graph_drafter(passes_for, default_name):
    def factory(base: SpecGraph, options: dict, tree, backend: str):
        from speccomp.passes.tree_attention import TreeAttention

        from .drafters import GraphDrafter
        from .tree import DynamicTreeSpec

        passes, rest = passes_for(base, options)
        if rest:
            raise OptionError("drafter_options", rest, f"unknown {default_name} options {sorted(rest)}",
                              f"accepted: {'exit_layer' if default_name == 'early_exit' else 'skip'}")
        spec = _default_tree(tree, DynamicTreeSpec(16, 4), dynamic_ok=True, drafter=default_name)
        check_tree_width(spec, base.captured.vocab_size, "model", tree)
        sg = run_passes(base.clone(), passes + [TreeAttention()])
        drafter = GraphDrafter(lower(sg, backend), sg.kv_layers, spec, default_name)
        drafter.options = passes[0].options()  # what the user, a stored search or the defaults chose
        return drafter

    return factory


def _early_exit_passes(base: SpecGraph, options: dict):
    from speccomp.passes.layer_skip import EarlyExit

    n = len(base.structure.layers)
    k = options.pop("exit_layer", n // 2 - 1)
    k = as_int("exit_layer", k, f"pass a layer index in [0, {n - 2}]")
    if not 0 <= k < n - 1:
        raise OptionError("exit_layer", k, f"must be in [0, {n - 2}] (the model has {n} layers; the drafter exits "
                          "before the last)")
    return [EarlyExit(k, n)], options


def _layer_skip_passes(base: SpecGraph, options: dict):
    from speccomp.passes.layer_skip import SkipLayers

    n = len(base.structure.layers)
    skip = options.pop("skip", None)
    if skip is None:  # SWIFT-like default: every other layer of the middle half
        skip = list(range(n // 4, n - n // 4, 2))
    fix = f"pass a list of layer indices in [0, {n - 1}]"
    if isinstance(skip, (str, bytes, dict)) or getattr(skip, "ndim", 1) != 1 or not hasattr(skip, "__iter__"):
        raise OptionTypeError("skip", skip, f"must be a list of layer indices, got {type(skip).__name__}", fix)
    layers = sorted({as_int("skip", i, fix) for i in skip})
    if not layers:
        raise OptionError("skip", skip, "is empty: the drafter would be the target itself", "skip at least one layer")
    if layers[0] < 0 or layers[-1] >= n:
        raise OptionError("skip", skip, f"layers {[i for i in layers if not 0 <= i < n]} do not exist", fix)
    if len(layers) == n:
        raise OptionError("skip", skip, f"skips all {n} layers", "keep at least one")
    return [SkipLayers(layers)], options


def _ngram(base: SpecGraph, options: dict, tree, backend: str):
    from .drafters_ngram import make_ngram

    if tree is not None:
        raise OptionError("tree", tree, "the ngram drafter builds its tree from the matches it finds",
                          "drop tree= (use the max_depth / num_branches options)")
    return make_ngram(**options)


def _token_recycling(base: SpecGraph, options: dict, tree, backend: str):
    from .drafters_ngram import make_token_recycling

    if tree is not None and "tree" in options:
        raise OptionError("tree", tree, f"given twice (also drafter_options['tree']={options['tree']!r})", "give one")
    tree = options.pop("tree", tree)
    if tree is not None:
        tree_option(tree, max_tree_nodes(base.structure))
    return make_token_recycling(tree=tree, **options)


DRAFTERS["early_exit"] = _graph_drafter(_early_exit_passes, "early_exit")
DRAFTERS["layer_skip"] = _graph_drafter(_layer_skip_passes, "layer_skip")
DRAFTERS["ngram"] = _ngram
DRAFTERS["token_recycling"] = _token_recycling


def _medusa(base: SpecGraph, options: dict, tree, backend: str):
    from .drafters_medusa import make_medusa

    return make_medusa(base, options, _default_tree(tree, None, drafter="medusa"))


DRAFTERS["medusa"] = _medusa


def _hydra(base: SpecGraph, options: dict, tree, backend: str):
    from .drafters_medusa import make_hydra

    return make_hydra(base, options, _default_tree(tree, None, dynamic_ok=True, drafter="hydra"))


DRAFTERS["hydra"] = _hydra


def _eagle(base: SpecGraph, options: dict, tree, backend: str):
    from .drafters_eagle import make_eagle

    return make_eagle(base, options, _default_tree(tree, None, dynamic_ok=True, drafter="eagle"))


DRAFTERS["eagle"] = _eagle
