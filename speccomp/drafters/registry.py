"""The drafters `speccomp.compile` knows by name: each name's factory builds the drafter from the captured graph.

    factory(base: SpecGraph, options: dict, tree, backend: str) -> Drafter

Factories check their options (OptionError / OptionTypeError naming them) and the tree against what the
drafter can fill (depth, sibling ranks, dynamic top-k); `max_tree_nodes` is how many nodes one verification
holds for a model.
"""
from __future__ import annotations

from speccomp.backends import is_onnxruntime, lower
from speccomp.backends.onnx_export import QUANT_BLOCK, QUANT_BLOCKS
from speccomp.drafters.draft_model import DraftModelDrafter, make_named_draft_model
from speccomp.drafters.eagle_drafter import EagleDrafter, make_eagle
from speccomp.drafters.graph import GraphDrafter
from speccomp.drafters.head_drafters import HydraDrafter, MedusaDrafter, make_hydra, make_medusa
from speccomp.drafters.ngram import (NGramDrafter, SuffixDrafter, TokenRecyclingDrafter, make_ngram, make_suffix,
                                     make_token_recycling)
from speccomp.errors import OptionError, OptionTypeError
from speccomp.frontend.graph import SpecGraph, run_passes
from speccomp.runtime.calls import as_int
from speccomp.runtime.decode import Drafter
from speccomp.runtime.tree import AutoTreeSpec, DynamicTreeSpec, Tree, check_tree_width, max_tree_nodes, tree_option


DRAFTERS: dict[str, object] = {}  # name -> drafter factory
DECLARED: dict[str, type[Drafter]] = {}  # name -> the class it builds, whose attributes declare what it reads,
# which trees it takes and which parts are graphs (speccomp/runtime/decode.py's Drafter): read before it is built
SEARCHED = ("early_exit", "layer_skip")  # drafters whose layers speccomp.search_drafter can pick


def register(name: str, cls: type[Drafter]):
    """Decorator: `factory` builds drafter `name`, an instance of `cls`."""
    def add(factory):
        DRAFTERS[name], DECLARED[name] = factory, cls
        return factory

    return add


def available_drafters() -> list[str]:
    return sorted(DRAFTERS)


def _default_tree(tree, fallback, drafter: str, dynamic_ok: bool | None = None):
    """The user's tree= as a Tree (or a DynamicTreeSpec where the drafter declares dynamic trees), or `fallback`."""
    if dynamic_ok is None:
        dynamic_ok = "dynamic" in DECLARED[drafter].trees
    if tree is None:
        return fallback
    spec = tree_option(tree)
    if isinstance(spec, AutoTreeSpec):
        raise OptionError("tree", tree, "is resolved by speccomp.compile for named drafters only",
                          "pass a choice list or an int k (a chain)")
    if isinstance(spec, DynamicTreeSpec) and not dynamic_ok:
        raise OptionError("tree", tree, f"the {drafter!r} drafter takes static trees only (a choice list or an int k)",
                          "dynamic trees are grown by the drafters "
                          f"{[n for n, c in sorted(DECLARED.items()) if 'dynamic' in c.trees]}")
    return spec


def _graph_drafter(passes_for, default_name):
    def factory(base: SpecGraph, options: dict, tree, backend: str):
        from speccomp.passes.tree_attention import TreeAttention

        passes, rest = passes_for(base, options)
        if rest:
            raise OptionError("drafter_options", rest, f"unknown {default_name} options {sorted(rest)}",
                              f"accepted: {'exit_layer' if default_name == 'early_exit' else 'skip'}")
        spec = _default_tree(tree, DynamicTreeSpec(16, 4), default_name)
        check_tree_width(spec, base.captured.vocab_size, "model", tree)
        sg = run_passes(base.clone(), passes + [TreeAttention()])
        return GraphDrafter(lower(sg, backend, spin=False), sg.kv_layers, spec, default_name, passes[0].options(), sg)

    return factory


def _self_drafting_layers(base: SpecGraph, what: str) -> int:
    """The model's layer count, which a self-drafter (fewer layers draft, all verify) needs to be at least 2."""
    n = len(base.structure.layers)
    if n < 2:
        raise OptionError("model", f"a model of {n} layer", f"{what} drafts with some of the model's layers and "
                          "verifies with all of them, so it needs at least 2", "use a text drafter (ngram, "
                          "token_recycling, suffix) or heads (medusa, hydra, eagle)")
    return n


def _early_exit_passes(base: SpecGraph, options: dict):
    from speccomp.passes.layer_skip import EarlyExit

    n = _self_drafting_layers(base, "early_exit")
    k = options.pop("exit_layer", n // 2 - 1)
    k = as_int("exit_layer", k, f"pass a layer index in [0, {n - 2}]")
    if not 0 <= k < n - 1:
        raise OptionError("exit_layer", k, f"must be in [0, {n - 2}] (the model has {n} layers; the drafter exits "
                          "before the last)")
    return [EarlyExit(k, n)], options


def _layer_skip_passes(base: SpecGraph, options: dict):
    from speccomp.passes.layer_skip import SkipLayers

    n = _self_drafting_layers(base, "layer_skip")
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


# text drafters that shape their own trees: how, and the options that shape them (tree= is refused)
OWN_TREES = {"ngram": ("builds its tree from the matches it finds", "max_depth / num_branches"),
             "suffix": ("grows its tree from the continuations it has counted", "budget / max_depth / min_prob")}


def check_named(name: str, tree, backend: str) -> None:
    """What a registered drafter refuses before any model is loaded (check_options, so the CLI fails at once, and
    its factory): tree= where it shapes its own trees, a backend it cannot run on."""
    if tree is not None and name in OWN_TREES:
        how, knobs = OWN_TREES[name]
        raise OptionError("tree", tree, f"the {name} drafter {how}", f"drop tree= (use the {knobs} options)")
    if name == "quantized" and not is_onnxruntime(backend):
        raise OptionError("backend", backend, "the quantized drafter runs ONNX Runtime's MatMulNBits kernels "
                          "(torch's int8 weight-only CPU matmul measured 5x slower than float32 here)",
                          "use backend='onnxruntime'")


def _own_trees(make, name: str):
    """The factory of a text drafter that shapes its own trees (OWN_TREES)."""
    def factory(base: SpecGraph, options: dict, tree, backend: str):
        check_named(name, tree, backend)
        return make(**options)

    return factory


register("ngram", NGramDrafter)(_own_trees(make_ngram, "ngram"))
register("suffix", SuffixDrafter)(_own_trees(make_suffix, "suffix"))


@register("token_recycling", TokenRecyclingDrafter)
def _token_recycling(base: SpecGraph, options: dict, tree, backend: str):
    if tree is not None and "tree" in options:
        raise OptionError("tree", tree, f"given twice (also drafter_options['tree']={options['tree']!r})", "give one")
    tree = options.pop("tree", tree)
    if tree is not None:
        tree_option(tree, max_tree_nodes(base.structure))
    return make_token_recycling(tree=tree, **options)


register("early_exit", GraphDrafter)(_graph_drafter(_early_exit_passes, "early_exit"))
register("layer_skip", GraphDrafter)(_graph_drafter(_layer_skip_passes, "layer_skip"))


@register("quantized", GraphDrafter)
def _quantized(base: SpecGraph, options: dict, tree, backend: str):
    """QuantSpec's self-drafter: the target's own graph with 4- or 8-bit weights (ONNX Runtime's MatMulNBits, an
    eighth or a quarter of the weight bytes per step) drafts depth by depth over the target's cache; the float graph
    verifies. Options: bits (8, the default, or 4), block_size (weights per quantisation block, default 128)."""
    from speccomp.passes.tree_attention import TreeAttention

    check_named("quantized", tree, backend)
    bits = as_int("bits", options.pop("bits", 8), "pass 8 or 4")
    if bits not in (4, 8):
        raise OptionError("bits", bits, "MatMulNBits weights are 4 or 8 bits", "bits=8 (the default) or bits=4")
    block = as_int("block_size", options.pop("block_size", QUANT_BLOCK), f"pass one of {list(QUANT_BLOCKS)}")
    if block not in QUANT_BLOCKS:
        raise OptionError("block_size", block, f"ONNX Runtime's quantiser takes blocks of {list(QUANT_BLOCKS)} weights",
                          "e.g. 128 (the default) or 32")
    if options:
        raise OptionError("drafter_options", options, f"unknown quantized options {sorted(options)}",
                          "accepted: bits, block_size")
    # default: 8 bits, blocks of 128 weights and a chain of 4 (benchmarks/quantized_drafter.py, chosen on gsm8k /
    # vicuna_bench's 3rd and 4th prompts, checked on alpaca / humaneval's): 8-bit drafts are accepted at almost every
    # depth of a chain of 4 (tau 4.5-4.6) and a draft call costs about what a 4-bit one does on a CPU (int8 compute
    # either way); blocks of 128 carry a quarter of the scales of blocks of 32 (a draft call 12.6 against 13.9 ms,
    # tau 4.53 against 4.65: 1.46x / 1.52x plain against 1.38x / 1.35x); 4 bits, a chain of 2 (the first default)
    # 1.01x / 1.16x; dynamic:16:4 verifies too many nodes to pay
    spec = _default_tree(tree, Tree.from_choices([[0] * d for d in range(1, 5)]), "quantized")
    check_tree_width(spec, base.captured.vocab_size, "model", tree)
    sg = run_passes(base.clone(), [TreeAttention()])
    # one thread (lower's `quantize`), as the light head steps: a one-token step over packed weights is mostly small
    # nodes, which a second thread only wakes up for (11.5 against 12.6 ms alone), and the target's pool may then spin
    # between its runs; 1.06-1.09x in the loop against both on 2 sleeping threads (benchmarks/threads_ab.py
    # --drafter quantized)
    step = lower(sg, backend, spin=False, quantize=(bits, block))
    return GraphDrafter(step, sg.kv_layers, spec, "quantized", {"bits": bits, "block_size": block}, sg, light=True)


def _head_drafter(name: str, make):
    def factory(base: SpecGraph, options: dict, tree, backend: str):
        return make(base, options, _default_tree(tree, None, name), backend)

    return factory


for _name, _cls, _make in (("medusa", MedusaDrafter, make_medusa), ("hydra", HydraDrafter, make_hydra),
                           ("eagle", EagleDrafter, make_eagle)):
    register(_name, _cls)(_head_drafter(_name, _make))

register("draft_model", DraftModelDrafter)(make_named_draft_model)  # a trained draft (speccomp train-draft)
