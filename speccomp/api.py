"""`speccomp.compile(model)`, the pipeline: validate -> capture -> plan (drafter, tree, KV mode) -> passes -> lower.

    check_options     everything checkable without the model (also what the CLI runs before loading one)
    capture           speccomp/frontend: the model as one flat FX graph (skipped for a `speccomp.capture` result)
    plan              tree="auto" resolved (speccomp/tuning/autotune.py; plain decoding where autotune measured no
                      tree faster), the tree fitted to the model's windows
    passes + lower    the drafter's factory (speccomp/drafters/registry.py) builds its graphs; the target gets the
                      drafter's passes + TreeAttention; speccomp/backends lowers each graph
"""
from __future__ import annotations

from torch import nn

from speccomp.backends import lower
from speccomp.drafters.draft_model import check_draft_model_options, make_draft_model
from speccomp.drafters.merge import check_merge, make_merged, split_names
from speccomp.drafters.registry import DECLARED, DRAFTERS, SEARCHED, check_named, max_tree_nodes
from speccomp.errors import OptionError, OptionTypeError
from speccomp.frontend import capture
from speccomp.frontend.convention import CapturedModel
from speccomp.frontend.graph import SpecGraph, run_passes
from speccomp.kv.draft import check_kv_options, compile_kv_draft
from speccomp.passes.tree_attention import TreeAttention
from speccomp.runtime.calls import MAX_TREE, choice
from speccomp.runtime.decode import Drafter, check_declaration
from speccomp.runtime.model import SpecModel
from speccomp.runtime.tree import tree_option


def check_options(*, drafter=None, tree=None, kv_cache=None, kv_mode=None, backend: str = "eager",
                  drafter_options=None) -> None:
    """Everything `compile` can check before it has a model (names, types, forms): what the CLI runs before it
    loads one. What needs the model (layer indices, vocabulary, heads, windows) is checked by compile."""
    from speccomp.backends import check

    check(backend)  # unknown names and missing GPU providers fail here, before the capture
    if drafter_options is not None and not isinstance(drafter_options, dict):
        raise OptionTypeError("drafter_options", drafter_options, f"must be a dict, got {type(drafter_options).__name__}",
                              "e.g. drafter_options={'exit_layer': 12}")
    if drafter_options and not all(isinstance(k, str) for k in drafter_options):
        raise OptionTypeError("drafter_options", drafter_options, "option names must be strings")
    if kv_cache is not None or kv_mode is not None:
        _, mode = check_kv_options(kv_cache, kv_mode, drafter, tree)
        if mode == "target" and (tree is not None or drafter_options):
            raise OptionError("kv_mode", kv_mode, "'target' decodes without a drafter", "drop tree= and drafter_options=")
    elif isinstance(drafter, Drafter):
        check_declaration(drafter)
    elif isinstance(drafter, (nn.Module, CapturedModel)):  # a draft model: checked against the target by its factory
        check_draft_model_options(drafter_options)
    elif drafter is not None:
        merged = split_names(drafter)  # "hydra+token_recycling": one tree merged from several drafters
        if merged:
            check_merge(merged, drafter_options, tree, DECLARED)
        else:
            choice("drafter", drafter, DRAFTERS)
        for i, name in enumerate(merged or [drafter]):  # tree= shapes the first drafter's tree
            check_named(name, tree if i == 0 else None, backend)
            _check_text_options(name, ((drafter_options or {}).get(name, {}) if merged else drafter_options) or {},
                                tree if i == 0 else None, merged=bool(merged))
    elif tree is not None:
        raise OptionError("tree", tree, "shapes the drafter's token tree, but no drafter was given",
                          "give a drafter too (see speccomp.available_drafters())")
    elif drafter_options:
        raise OptionError("drafter_options", drafter_options, "given without a drafter", "give drafter= too")
    if tree is not None:
        tree_option(tree, MAX_TREE)


def _check_text_options(name: str, options: dict, tree, merged: bool) -> None:
    """A text drafter's options (ngram, suffix, token_recycling) need no model: built once here (with the tree the
    user gave it, if any), so a bad one fails before the capture (and before the CLI loads a model). Its tree is
    compile's to check, against the model and a merge's default tree."""
    from speccomp.drafters.merge import in_part
    from speccomp.drafters.ngram import make_ngram, make_suffix, make_token_recycling

    make = {"ngram": make_ngram, "suffix": make_suffix, "token_recycling": make_token_recycling}.get(name)
    if make is not None:
        given = options.get("tree", tree) if name == "token_recycling" else None
        try:
            make(**{k: v for k, v in options.items() if k != "tree"}, **({"tree": given} if given is not None else {}))
        except (OptionError, OptionTypeError) as exc:
            if exc.parameter != "tree":
                raise in_part(name, options, exc) if merged else exc from None


def _check_capture_current(captured: CapturedModel) -> None:
    """A capture's graph holds its model's parameter objects: after load_state_dict(assign=True) or a replaced
    submodule the model holds new ones and the capture the old, so compiling it decoded the old weights."""
    if isinstance(captured.model, nn.Module):
        own = {id(p) for p in captured.model.parameters()}
        if any(id(p) not in own for p in captured.graph_module.parameters()):
            raise OptionError("model", f"speccomp.capture({type(captured.model).__name__})", "the model's parameters "
                              "were replaced after this capture (load_state_dict(assign=True), a submodule swapped): "
                              "the capture holds the old ones", "capture the model again: speccomp.capture(model)")


def compile(model, *, drafter=None, tree=None, kv_cache=None, kv_mode: str | None = None,  # noqa: A001
            backend: str = "eager", drafter_options: dict | None = None) -> SpecModel:
    """Capture `model` with torch.export, rewrite the graph for speculative decoding, lower it.

    model: a Hugging Face causal LM, a plain nn.Module LM, or what `speccomp.capture(model)` returned
        (compiling one model several ways then exports it once).
    drafter: None (plain decoding), a name from `available_drafters()`, names joined by "+" (one tree merged
        from several drafters' trees, e.g. "hydra+token_recycling"; speccomp/drafters/merge.py), a `Drafter`, or
        a smaller draft LM with the target's tokenizer (an nn.Module or a `speccomp.capture` result: captured,
        rewritten and lowered like the target; speccomp/drafters/draft_model.py).
    tree: token tree for the drafter: a Medusa-style choice list, an int k (a chain of k), "dynamic:B:K", or
        "auto" (the tree `speccomp autotune` stored for this model, drafter, backend and machine).
    drafter_options: options of the named drafter (e.g. {"exit_layer": 12}, {"skip": [3, 5]}).
    backend: "eager" (FX graph with CPU lowering passes), "inductor" (torch.compile), "onnxruntime" (exported
        ONNX, ORT sessions; "onnxruntime:cuda" / "tensorrt" on a GPU), "triton" (Triton tree attention), "cudagraphs"
        (the eager step over the whole preallocated cache, captured and replayed as CUDA graphs; a GPU only).
    kv_cache: None (full cache) or a compression policy "POLICY[:BUDGET]": "sink:256", "snapkv:512", "h2o:512",
        "kivi4", "kivi2", ... (speccomp/kv/policies.py). kv_mode: "draft" (default with a policy; lossless: the
        model drafts for itself over the compressed cache and verifies against the full one, tree= shapes its
        drafts) or "target" (LOSSY: the model itself reads the compressed cache; plain decoding, `last_stats`
        says lossless=False; `.quality(ids, prompt_length)` measures perplexity and KL to the full cache).

    Every argument is checked before any work (`check_options`, then what needs the model right after the
    capture); a bad one raises OptionError / OptionTypeError naming it. The user's model is not changed."""
    captured = None
    if isinstance(model, CapturedModel):  # speccomp.capture(model) once, compiled several ways: rewrite a copy
        _check_capture_current(model)
        captured, model = model.copy(), model.model
    check_options(drafter=drafter, tree=tree, kv_cache=kv_cache, kv_mode=kv_mode, backend=backend,
                  drafter_options=drafter_options)
    if kv_cache is not None or kv_mode is not None:  # KV compression: kv_mode "draft" (lossless) or "target" (LOSSY)
        return _compile_kv(captured or capture(model), model, kv_cache, kv_mode, tree, backend, drafter_options)
    from speccomp.tuning.autotune import is_auto  # (speccomp.tuning imports this module)

    auto, given = is_auto(tree), _option_names(drafter_options)
    tree, drafter_options, plain = _resolve_auto(model, drafter, tree, backend, drafter_options)
    base = SpecGraph.from_captured(captured or capture(model))
    base.model = model  # drafters that look things up per model (stored heads, searches) need it
    if drafter is None or plain:  # plain decoding: the same loop and graph, verifying the root alone each step
        sg = run_passes(base, [TreeAttention()])
        return SpecModel(sg, lower(sg, backend), backend, model=model)
    try:
        if tree is not None:
            tree_option(tree, max_tree_nodes(base.structure))  # fits this model's windows
        return _compile_drafter(base, model, drafter, tree, backend, drafter_options)
    except (OptionError, OptionTypeError) as exc:
        stored = (exc.parameter == "tree" or exc.parameter in _option_names(drafter_options) - given
                  or (exc.parameter == "drafter_options" and not given and drafter_options))  # all of them stored
        if not (auto and stored):  # the user's own argument: as it is
            raise
        from speccomp.tuning.autotune import result_path

        first = (split_names(drafter) or [drafter])[0]
        where = f" {result_path(model, first, backend)}" if isinstance(first, str) else ""
        raise _from_stored(exc, f"read by tree='auto' from the stored autotune result{where}",
                           f"{exc.fix + '; or ' if exc.fix else ''}delete that result (speccomp autotune writes it "
                           "again) or pass an explicit tree") from None


def _from_stored(exc, source: str, fix: str):
    """`exc` about an option that came from a stored result (a search's, an autotune's), not from the user's call:
    the same error, naming where the value was read."""
    return type(exc)(exc.parameter, exc.value, f"{exc.problem} ({source}, not given)", fix)


def _option_names(options) -> set:
    """The option names in drafter_options (a merge's nested ones too)."""
    options = options if isinstance(options, dict) else {}
    return set(options) | {k for v in options.values() if isinstance(v, dict) for k in v}


def _compile_kv(captured, model, kv_cache, kv_mode, tree, backend: str, drafter_options):
    policy, mode = check_kv_options(kv_cache, kv_mode, None, tree)
    base = SpecGraph.from_captured(captured)
    base.model = model
    if mode == "target":  # the target itself reads the compressed cache
        from speccomp.kv.target import compile_kv_target

        return compile_kv_target(base, policy, backend)
    return compile_kv_draft(base, policy, tree, backend, drafter_options)


def _check_convention(base, target, drafter) -> None:
    """A drafter's target_passes may add outputs (after logits, new_kv, hidden: Medusa's head states), never change the
    inputs the runtime passes by position, nor take the first outputs away (a new input took tree_mask's place, and
    generate failed inside torch with a missing argument)."""
    from speccomp.errors import GraphStructureError
    from speccomp.passes.tree_attention import TREE_MASK

    inputs, want = target.input_names(), base.input_names() + [TREE_MASK]
    outputs, before = len(target.gm.graph.output_node().args[0]), len(base.gm.graph.output_node().args[0])
    if inputs != want or outputs < before:
        raise GraphStructureError(
            f"the {drafter.name} drafter's target_passes {[p.name for p in drafter.target_passes]} left the target "
            f"graph with inputs {inputs} and {outputs} outputs; the runtime calls it with {want} and reads its first "
            f"{before} outputs: a target pass may add outputs after those, not inputs")


def _resolve_auto(model, drafter, tree, backend: str, drafter_options):
    """tree="auto": (tree, options, plain), the tree and options `speccomp autotune` stored for this model, drafter,
    backend and machine (tuned now, on first use, when none is stored), and whether it measured plain decoding
    faster than the tree it kept; for a merge, the first drafter's tree (the merge itself was never measured: it drafts)."""
    from speccomp.tuning.autotune import is_auto, resolve_auto

    if not is_auto(tree):
        return tree, drafter_options, False
    merged = split_names(drafter)
    if not merged:
        return resolve_auto(model, drafter, backend, drafter_options)
    # the first drafter's "plain" verdict is not the merge's: it drafts (no warning; no global filter: thread-safe)
    tree, first, _ = resolve_auto(model, merged[0], backend, (drafter_options or {}).get(merged[0]), merged=True)
    if first:
        drafter_options = {**(drafter_options or {}), merged[0]: first}
    return tree, drafter_options, False


def _compile_drafter(base: SpecGraph, model, drafter, tree, backend: str, drafter_options) -> SpecModel:
    merged = split_names(drafter)
    if isinstance(drafter, Drafter):
        drafter_obj = drafter
    elif isinstance(drafter, (nn.Module, CapturedModel)):
        drafter_obj = make_draft_model(base, drafter, drafter_options, tree, backend)
    elif merged:
        drafter_obj = make_merged(merged, base, drafter_options, tree, backend, DRAFTERS)
    else:
        options, stored = drafter_options, None
        if options is None and drafter in SEARCHED:  # a search on this machine may have chosen the layers
            from speccomp.tuning.search import cached_options, search_path

            options = cached_options(model, drafter, tree)
            stored = search_path(model, drafter, tree) if options is not None else None
        try:
            drafter_obj = DRAFTERS[drafter](base, dict(options or {}), tree, backend)
        except (OptionError, OptionTypeError) as exc:
            if stored is None:
                raise
            raise _from_stored(exc, f"read from the stored search {stored}",
                               "delete that file or run `speccomp search` again") from None
    # a drafter may need the target graph to compute more (Medusa: head states on every token)
    target = run_passes(base.clone(), list(drafter_obj.target_passes) + [TreeAttention()])
    _check_convention(base, target, drafter_obj)
    # a drafter with graphs of its own runs them as more sessions: then none spins (backends.lower), unless they
    # are light (one thread each: nothing then fights the target's spinning pool)
    spin = not drafter_obj.graphs or drafter_obj.light_graphs
    return SpecModel(target, lower(target, backend, spin=spin), backend, drafter=drafter_obj, model=model)


