"""SkipLayers / EarlyExit: derive a cheaper self-drafter from the target graph.

Expects: an annotated graph whose decoder layers each have one entry and one exit on the
residual stream, and whose `new_kv` output is stack([stack([k_l, v_l]) for every layer l]).

For every skipped layer l the residual stream bypasses the block:

    before:  ... ─► entry_l ─► [norm, attention, mlp] ─► exit_l ─► layer l+1 ...
    after:   ... ─► entry_l ─────────────────────────────────────► layer l+1 ...

and new_kv stacks only the kept layers' entries, so the skipped blocks are dead code and are
removed whole, cache reads and in-place ops included (`_remove_dead`: FX's own elimination
keeps every in-place op). The annotation follows the graph: the skipped layers and their
attention sites leave `sg.structure` (kept layers keep their model index, `Layer.index`), and
`sg.kv_layers` maps the remaining new_kv rows to cache layers. The drafter keeps the target's
weights (the same parameters, nothing copied) and reads the target's KV cache for the kept layers.

EarlyExit(k) is SkipLayers({k+1, ..., L-1}): the final norm and LM head read layer k's exit
(LayerSkip, Draft&Verify and SWIFT are all points in this space). For early exit the kept
layers' keys/values are *exactly* the target's, so the drafter and target share the cache.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from speccomp.errors import GraphStructureError
from speccomp.frontend.graph import Pass, SpecGraph, _is_impure, copy_meta

aten = torch.ops.aten


class SkipLayers(Pass):
    name = "skip_layers"

    def __init__(self, skip):
        self.skip = sorted({int(i) for i in skip})

    def options(self) -> dict:
        """The `drafter_options` that make this pass (reported by the drafter)."""
        return {"skip": list(self.skip)}

    def check(self, sg: SpecGraph) -> None:
        if "attention_scores" in sg.applied:  # its rows would still score the skipped layers, against fewer new_kv
            raise GraphStructureError(f"SkipLayers must run before AttentionScores (applied: {sg.applied}): "
                                      "[SkipLayers(...), TreeAttention(), AttentionScores()]")
        layers = sg.structure.layers
        blocks = [layer.module for layer in layers]
        shared = next((b for b in blocks if blocks.count(b) > 1), None)
        if shared is not None:  # one attention module per head: a "layer" is no block, and bypassing one cuts inside it
            raise GraphStructureError(f"decoder block {shared} holds {blocks.count(shared)} attention sites (e.g. one "
                                      "attention module per head): skipping layers needs one attention per block; "
                                      "decode plainly or with a drafter that reads no layers (ngram, suffix, "
                                      "token_recycling)")
        present = [layer.index for layer in layers]  # a graph with layers skipped already keeps its numbering
        bad = [i for i in self.skip if i not in present]
        if bad:
            total = sg.captured.kv.num_layers
            if all(0 <= i < total for i in bad):  # the model has them: an earlier pass skipped them
                raise ValueError(f"layers {bad} are not in this graph: an earlier pass skipped them (applied: "
                                 f"{sg.applied}; its layers are {present})")
            raise ValueError(f"layers {bad} do not exist; the model has layers 0..{total - 1}")
        if len(self.skip) >= len(layers):
            raise ValueError(f"cannot skip all {len(layers)} layers; keep at least one")
        new_kv = sg.structure.new_kv
        if new_kv.target is not aten.stack.default or len(new_kv.args[0]) != len(layers):
            raise GraphStructureError(
                f"new_kv is not a stack of {len(layers)} per-layer entries; was the graph captured by speccomp?"
            )
        if len(sg.kv_layers) != len(layers) or len(sg.structure.attention) != len(layers):
            raise GraphStructureError(
                f"the annotation lists {len(layers)} layers, {len(sg.structure.attention)} attention sites and "
                f"{len(sg.kv_layers)} cache rows; they must correspond one to one"
            )

    def rewrite(self, sg: SpecGraph) -> None:
        structure = sg.structure
        layers = structure.layers
        resolved = {}  # exit node of a skipped layer -> the node that now carries the residual stream

        def resolve(node):
            while node in resolved:
                node = resolved[node]
            return node

        skipped = [p for p, layer in enumerate(layers) if layer.index in self.skip]  # positions in new_kv
        bypassed = set()  # every node of the skipped blocks
        for layer in (layers[p] for p in skipped):
            members = {n for n in sg.gm.graph.nodes if sg.layer_of(n) == layer.module}
            bypassed |= members
            source = resolve(layer.entry)
            for user in list(layer.exit.users):
                if user not in members:
                    user.replace_input_with(layer.exit, source)
            resolved[layer.exit] = source

        kept = [p for p in range(len(layers)) if p not in skipped]
        old = structure.new_kv
        graph = sg.gm.graph
        with graph.inserting_after(old):
            new = graph.call_function(aten.stack.default, ([old.args[0][p] for p in kept],) + tuple(old.args[1:]))
        copy_meta(new, old)
        old.replace_all_uses_with(new)
        graph.erase_node(old)
        structure.new_kv = new
        _remove_dead(graph, bypassed)
        # the annotation follows the graph: the skipped blocks (their attention sites, masks' users and
        # exits) are dead code now, and later passes (TreeAttention) must only see what is still there
        kept_cache = {sg.kv_layers[p] for p in kept}
        structure.attention = [s for s in structure.attention if s.layer in kept_cache]
        structure.layers = [dataclasses.replace(layers[p], entry=resolve(layers[p].entry)) for p in kept]
        sg.kv_layers = [sg.kv_layers[p] for p in kept]


class EarlyExit(SkipLayers):
    name = "early_exit"

    def __init__(self, exit_layer: int, num_layers: int):
        if not 0 <= exit_layer < num_layers:
            raise ValueError(f"exit layer must be in [0, {num_layers - 1}], got {exit_layer}")
        super().__init__(range(exit_layer + 1, num_layers))
        self.exit_layer = exit_layer

    def options(self) -> dict:
        return {"exit_layer": self.exit_layer}


def _written_roots(node: fx.Node) -> list:
    """The tensors an in-place op writes (Falcon's `mlp_out += attn_out`, a MoE's `index_put_` of expert
    outputs), each followed through views back to the node that allocated it."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None or not schema.is_mutable:
        return []
    roots = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.kwargs.get(arg.name, node.args[i] if i < len(node.args) else None)
        for x in value if isinstance(value, (list, tuple)) else [value]:  # not a node: kept (conservative)
            while isinstance(x, fx.Node) and x.op == "call_function" and _is_view(x):
                x = x.args[0]
            roots.append(x)
    return roots


def _is_view(node: fx.Node) -> bool:
    """An op whose output aliases its first input: a view op, or an element of a list of views (the getitem
    after split / unbind / chunk, whose own target has no schema)."""
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and source.op == "call_function" and _is_view(source)
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


def _remove_dead(graph: fx.Graph, bypassed: set) -> None:
    """Erase what no output needs any more, in-place ops of the skipped blocks included.

    FX's dead-code elimination keeps every in-place op (it cannot tell whether the tensor written is read
    later), so a skipped block with one would still run whole. An in-place op inside a skipped block lives
    only if a live node reads what it writes, or what it writes comes from outside the skipped blocks."""
    live = set()

    def mark(todo: list) -> None:  # the nodes in `todo` and everything they are computed from
        while todo:
            n = todo.pop()
            if n not in live:
                live.add(n)
                todo.extend(n.all_input_nodes)

    mark([n for n in graph.nodes if n.op in ("placeholder", "output") or (n not in bypassed and _is_impure(n))])
    while grow := [n for n in bypassed
                   if n not in live and any(r in live or r not in bypassed for r in _written_roots(n))]:
        mark(grow)
    for n in reversed(list(graph.nodes)):
        if n not in live:
            graph.erase_node(n)
