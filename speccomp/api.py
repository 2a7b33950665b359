"""`speccomp.compile(model)`: capture -> passes -> lower -> a model with `.generate`."""
from __future__ import annotations

import torch

from .capture import capture
from .graph import SpecGraph, run_passes
from .runtime import decode_plain
from .sampling import Sampler
from .speculative import decode_speculative

DRAFTERS: dict[str, object] = {}  # name -> drafter factory; filled by the drafter modules
SEARCHED = ("early_exit", "layer_skip")  # drafters whose layers speccomp.search_drafter can pick


def available_drafters() -> list[str]:
    return sorted(DRAFTERS)


def _choice(name: str, value, accepted) -> None:
    if value not in accepted:
        raise ValueError(f"unknown {name} {value!r}; accepted values: {sorted(accepted, key=str)}")


class SpecModel:
    """A compiled causal LM. `generate` returns prompt + new tokens, like HF `generate`."""

    def __init__(self, spec_graph: SpecGraph, step, backend: str, drafter=None, model=None):
        self.graph = spec_graph
        self.model = model  # the source model (identity for export manifests)
        self.step = step
        self.backend = backend
        self.drafter = drafter
        self.kv = spec_graph.captured.kv
        self.max_positions = spec_graph.captured.max_positions
        self.last_stats: dict = {}
        windows = [s.sliding_window for s in spec_graph.structure.attention if s.sliding_window]
        # a tree's nodes must all fit inside every sliding window (see passes/tree_attention.py)
        self.max_tree = min([64] + windows)

    def _check_inputs(self, input_ids, max_new_tokens, temperature, top_p) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.LongTensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [seq] or [1, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"speccomp decodes one sequence at a time (batch size 1), got batch size {input_ids.shape[0]}; "
                "call generate once per prompt"
            )
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty; give at least one prompt token")
        vocab = self.graph.captured.vocab_size
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise ValueError(f"input_ids must be in [0, {vocab}), got values in [{int(input_ids.min())}, {int(input_ids.max())}]")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if self.max_positions is not None and input_ids.shape[1] + max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
                f"of {self.max_positions} positions; shorten the prompt or ask for fewer tokens"
            )
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        return input_ids.long()

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        eos_token_id=None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        acceptance: str = "exact",
    ) -> torch.Tensor:
        """acceptance: "exact" (lossless: greedy equality / rejection sampling) or "typical-lossy"
        (Medusa's typical acceptance with do_sample=True; LOSSY, the text no longer follows the model's
        distribution; `last_stats["lossless"]` says which ran)."""
        input_ids = self._check_inputs(input_ids, max_new_tokens, temperature, top_p)
        _choice("acceptance", acceptance, ("exact", "typical-lossy"))
        if acceptance != "exact" and not do_sample:
            raise ValueError("acceptance='typical-lossy' only changes sampling; with greedy decoding use the exact default")
        if acceptance != "exact" and self.drafter is None:
            raise ValueError("acceptance='typical-lossy' needs a drafter (plain decoding accepts nothing)")
        if eos_token_id is None:
            eos = set()
        elif isinstance(eos_token_id, int):
            eos = {eos_token_id}
        else:
            eos = {int(e) for e in eos_token_id}
        sampler = Sampler(do_sample, temperature, top_p, seed)
        if self.drafter is None:
            new, stats = decode_plain(self.step, self.kv, input_ids, max_new_tokens, eos, sampler)
        else:
            new, stats = decode_speculative(
                self.step, self.drafter, self.kv, input_ids, max_new_tokens, eos, sampler, self.max_tree, acceptance
            )
        self.last_stats = stats.as_dict()
        self.last_stats.update(acceptance=acceptance, lossless=acceptance == "exact")
        return torch.cat([input_ids, new[None]], dim=1)


    def export(self, path, tokenizer=None, overwrite: bool = False):
        """Write an engine directory (ONNX graph + manifest.json [+ tokenizer.json]) that `speccomp.load`
        runs with ONNX Runtime and numpy only. Plain, ngram, token_recycling and medusa compilations export."""
        from speccomp.backends.onnx_engine import export_engine

        return export_engine(self, path, tokenizer=tokenizer, overwrite=overwrite)


def _default_tree(tree, fallback, dynamic_ok: bool = False, drafter: str = ""):
    """The user's tree= as a Tree (or a DynamicTreeSpec where `dynamic_ok`), or `fallback` when None."""
    from .tree import AutoTreeSpec, DynamicTreeSpec, parse_tree_spec

    if tree is None:
        return fallback
    spec = parse_tree_spec(tree)
    if isinstance(spec, AutoTreeSpec):
        raise ValueError(f"tree={tree!r} is resolved by speccomp.compile for named drafters only; pass a choice list or an int k (a chain)")
    if isinstance(spec, DynamicTreeSpec) and not dynamic_ok:
        raise ValueError(
            f"tree={tree!r}: the {drafter!r} drafter takes static trees only (a choice list or an int k); "
            "dynamic trees are grown by the early_exit, layer_skip, hydra and eagle drafters"
        )
    return spec


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
    """
    from speccomp.backends import check, lower
    from speccomp.passes.tree_attention import TreeAttention

    from .capture import CapturedModel
    from .speculative import Drafter

    captured = None
    if isinstance(model, CapturedModel):  # speccomp.capture(model) once, compiled several ways: rewrite a copy
        captured, model = model.copy(), model.model
    check(backend)  # unknown names and missing GPU providers fail here, before the capture
    if kv_cache is not None or kv_mode is not None:  # KV compression: kv_mode "draft" (lossless) or "target" (LOSSY)
        from .drafters_kv import check_kv_options, compile_kv_draft

        policy, mode = check_kv_options(kv_cache, kv_mode, drafter)
        if mode == "target" and (tree is not None or drafter_options):
            raise ValueError("kv_mode='target' decodes without a drafter; drop tree= and drafter_options=")
        base = SpecGraph.from_captured(captured or capture(model))
        base.model = model
        if mode == "target":  # the target itself reads the compressed cache
            from .kv_target import compile_kv_target

            return compile_kv_target(base, policy, backend)
        return compile_kv_draft(base, policy, tree, backend, drafter_options)
    from .autotune import is_auto, resolve_auto
    from .drafters_merge import check_merge, make_merged, split_names

    merged = split_names(drafter)  # "hydra+token_recycling": one tree merged from several drafters
    if drafter is not None and not isinstance(drafter, Drafter) and merged is None:
        _choice("drafter", drafter, DRAFTERS)
    if drafter is None and tree is not None:
        raise ValueError("tree= shapes the drafter's token tree; give a drafter too (see speccomp.available_drafters())")
    if drafter is None and drafter_options:
        raise ValueError("drafter_options= given without a drafter")
    if drafter_options is not None and not isinstance(drafter_options, dict):
        raise ValueError(f"drafter_options must be a dict, got {type(drafter_options).__name__}")
    if merged:  # names and options are checked before the capture
        check_merge(merged, drafter_options, tree, DRAFTERS)
    if is_auto(tree) and merged:  # the first drafter's stored tree (and options)
        tree, first = resolve_auto(model, merged[0], backend, (drafter_options or {}).get(merged[0]))
        if first:
            drafter_options = {**(drafter_options or {}), merged[0]: first}
    elif is_auto(tree):  # the tree `speccomp autotune` stored for this model, drafter, backend and machine
        tree, drafter_options = resolve_auto(model, drafter, backend, drafter_options)

    base = SpecGraph.from_captured(captured or capture(model))
    base.model = model  # drafters that look things up per model (stored heads, searches) need it
    if drafter is None:
        sg = run_passes(base, [])
        return SpecModel(sg, lower(sg, backend), backend, model=model)

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
        from speccomp.backends import lower
        from speccomp.passes.tree_attention import TreeAttention

        from .drafters import GraphDrafter
        from .tree import DynamicTreeSpec

        passes, rest = passes_for(base, options)
        if rest:
            raise ValueError(f"unknown {default_name} options {sorted(rest)}")
        sg = run_passes(base.clone(), passes + [TreeAttention()])
        spec = _default_tree(tree, DynamicTreeSpec(16, 4), dynamic_ok=True, drafter=default_name)
        drafter = GraphDrafter(lower(sg, backend), sg.kv_layers, spec, default_name)
        drafter.options = passes[0].options()  # what the user, a stored search or the defaults chose
        return drafter

    return factory


def _early_exit_passes(base: SpecGraph, options: dict):
    from speccomp.passes.layer_skip import EarlyExit

    n = len(base.structure.layers)
    k = options.pop("exit_layer", n // 2 - 1)
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"exit_layer must be an int in [0, {n - 2}], got {k!r}")
    if not 0 <= k < n - 1:
        raise ValueError(f"exit_layer must be in [0, {n - 2}] (the model has {n} layers), got {k}")
    return [EarlyExit(k, n)], options


def _layer_skip_passes(base: SpecGraph, options: dict):
    from speccomp.passes.layer_skip import SkipLayers

    n = len(base.structure.layers)
    skip = options.pop("skip", None)
    if skip is None:  # SWIFT-like default: every other layer of the middle half
        skip = list(range(n // 4, n - n // 4, 2))
    if not isinstance(skip, (list, tuple, set)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in skip):
        raise ValueError(f"skip must be a list of layer indices in [0, {n - 1}], got {skip!r}")
    if not skip:
        raise ValueError("skip is empty: the drafter would be the target itself; skip at least one layer")
    return [SkipLayers(skip)], options


def _ngram(base: SpecGraph, options: dict, tree, backend: str):
    from .drafters_ngram import make_ngram

    if tree is not None:
        raise ValueError("the ngram drafter builds its tree from the matches it finds; drop tree= (use max_depth / num_branches options)")
    return make_ngram(**options)


def _token_recycling(base: SpecGraph, options: dict, tree, backend: str):
    from .drafters_ngram import make_token_recycling

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
