"""SkipLayers / EarlyExit: derive a cheaper self-drafter from the target graph.

Expects: an annotated graph whose decoder layers each have one entry and one exit on the
residual stream, and whose `new_kv` output is stack([stack([k_l, v_l]) for every layer l]).

For every skipped layer l the residual stream bypasses the block:

    before:  ... ─► entry_l ─► [norm, attention, mlp] ─► exit_l ─► layer l+1 ...
    after:   ... ─► entry_l ─────────────────────────────────────► layer l+1 ...

and new_kv stacks only the kept layers' entries, so dead-code elimination removes the
skipped blocks whole (their cache reads included). The drafter keeps the target's weights
(the same parameters, nothing copied) and reads the target's KV cache for the kept layers.

EarlyExit(k) is SkipLayers({k+1, ..., L-1}): the final norm and LM head read layer k's exit
(LayerSkip, Draft&Verify and SWIFT are all points in this space). For early exit the kept
layers' keys/values are *exactly* the target's, so the drafter and target share the cache.
"""
from __future__ import annotations

import torch

from speccomp.errors import GraphStructureError
from speccomp.graph import Pass, SpecGraph, copy_meta

aten = torch.ops.aten


class SkipLayers(Pass):
    name = "skip_layers"

    def __init__(self, skip):
        self.skip = sorted({int(i) for i in skip})

    def options(self) -> dict:
        """The `drafter_options` that make this pass (reported by the drafter)."""
        return {"skip": list(self.skip)}

    def check(self, sg: SpecGraph) -> None:
        n = len(sg.structure.layers)
        bad = [i for i in self.skip if not 0 <= i < n]
        if bad:
            raise ValueError(f"layers {bad} do not exist; the model has layers 0..{n - 1}")
        if len(self.skip) >= n:
            raise ValueError(f"cannot skip all {n} layers; keep at least one")
        new_kv = sg.structure.new_kv
        if new_kv.target is not aten.stack.default or len(new_kv.args[0]) != n:
            raise GraphStructureError(f"new_kv is not a stack of {n} per-layer entries; was the graph captured by speccomp?")

    def rewrite(self, sg: SpecGraph) -> None:
        layers = sg.structure.layers
        resolved = {}  # exit node of a skipped layer -> the node that now carries the residual stream

        def resolve(node):
            while node in resolved:
                node = resolved[node]
            return node

        for i in self.skip:
            layer = layers[i]
            members = {n for n in sg.gm.graph.nodes if sg.layer_of(n) == layer.module}
            source = resolve(layer.entry)
            for user in list(layer.exit.users):
                if user not in members:
                    user.replace_input_with(layer.exit, source)
            resolved[layer.exit] = source

        kept = [i for i in range(len(layers)) if i not in self.skip]
        old = sg.structure.new_kv
        graph = sg.gm.graph
        with graph.inserting_after(old):
            new = graph.call_function(aten.stack.default, ([old.args[0][i] for i in kept],) + tuple(old.args[1:]))
        copy_meta(new, old)
        old.replace_all_uses_with(new)
        graph.erase_node(old)
        sg.structure.new_kv = new
        sg.kv_layers = [sg.kv_layers[i] for i in kept]


class EarlyExit(SkipLayers):
    name = "early_exit"

    def __init__(self, exit_layer: int, num_layers: int):
        if not 0 <= exit_layer < num_layers:
            raise ValueError(f"exit layer must be in [0, {num_layers - 1}], got {exit_layer}")
        super().__init__(range(exit_layer + 1, num_layers))
        self.exit_layer = exit_layer

    def options(self) -> dict:
        return {"exit_layer": self.exit_layer}
