"""TreeAttention: let one forward pass score a whole token tree.

Expects: a captured graph (speccomp.capture) whose attention sites read an explicit mask
`M` [1, 1, q, kv] built by the model (bool for SDPA, 0/-inf additive for eager), with
kv = past + q. Adds one graph input

    tree_mask  bool [q, T]   T >= q: may query i see each of the *last T* key positions

and rewrites every mask that feeds attention:

    before:  M ──────────────────────────────────────────► sdpa(q, k, v, M)
    after:   M ─┐
                ├─ where(col < kv - T, P, M) & cat(ones[q, kv-T], tree_mask) ─► sdpa(q, k, v, M')
     tree_mask ─┘

Columns older than the last T keep the model's own mask (causal, padding, ...), so
model-specific masks keep working. P is M itself for full-attention layers; for
sliding-window layers P is the window recomputed from `position_ids`
(pos_i - k < window, and the key padding mask's 0s still hidden): HF measures windows in cache slots, and a tree node's slot is not
its position (siblings share a depth), so the slot-based window would hide keys a
sequential decode would see. Inside the last T columns the tree mask decides alone
(ANDed with M, which there is causal in slot order: ancestors always come first).

Positions are an input already: the runtime feeds position_ids = past + tree depth.
The runtime keeps T <= every sliding window so no tree key falls out of a window.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from speccomp.errors import GraphStructureError
from speccomp.frontend.graph import Pass, SpecGraph, copy_meta

aten = torch.ops.aten
TREE_MASK = "tree_mask"


class TreeAttention(Pass):
    name = "tree_attention"

    def check(self, sg: SpecGraph) -> None:
        if TREE_MASK in sg.input_names():
            raise GraphStructureError("TreeAttention was already applied to this graph")
        if "ort_attention" in sg.applied:  # the fused op takes a [1, 1, q, T] bias, not the tree mask's layout
            raise GraphStructureError(f"TreeAttention must run before OrtAttention (applied: {sg.applied}): "
                                      "[TreeAttention(), GroupedQueryAttention(), OrtAttention()]")
        if "attention_scores" in sg.applied:  # its scores were taken with the model's mask: siblings would see each other
            raise GraphStructureError(f"TreeAttention must run before AttentionScores (applied: {sg.applied}): "
                                      "[TreeAttention(), AttentionScores()]")
        for site in sg.structure.attention:
            if site.mask is None:
                raise GraphStructureError(f"attention {site.module} has no mask to rewrite")
            dims = site.mask.meta.get("val")
            if dims is None or dims.dim() != 4:
                raise GraphStructureError(f"mask of {site.module} is not a 4-D [b, h, q, kv] tensor")

    def rewrite(self, sg: SpecGraph) -> None:
        graph = sg.gm.graph
        inputs = sg.structure.inputs
        last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last_placeholder):
            tree = graph.placeholder(TREE_MASK)
        device = inputs["input_ids"].meta["val"].device if "val" in inputs["input_ids"].meta else None
        tree.meta["val"] = torch.empty(0, 0, dtype=torch.bool, device=device)  # shape symbolic; dtype, device read
        sg.structure.inputs[TREE_MASK] = tree

        # group attention sites by (mask node, window): each group gets one rewritten mask
        groups: dict[tuple[fx.Node, int | None], list] = {}
        for site in sg.structure.attention:
            groups.setdefault((site.mask, site.sliding_window), []).append(site)

        order = {n: i for i, n in enumerate(graph.nodes)}
        for (mask, window), sites in groups.items():
            first = min((s.mask_user for s in sites), key=order.get)
            with graph.inserting_before(first):
                new = self._tree_mask(graph, mask, tree, inputs, window)
            copy_meta(new, mask)
            for s in sites:
                s.mask_user.replace_input_with(mask, new)
                s.mask = new

    @staticmethod
    def _tree_mask(graph: fx.Graph, mask: fx.Node, tree: fx.Node, inputs, window: int | None) -> fx.Node:
        call = graph.call_function
        q = call(aten.sym_size.int, (tree, 0))
        t = call(aten.sym_size.int, (tree, 1))
        kv = call(aten.sym_size.int, (mask, 3))
        older = call(operator.sub, (kv, t))  # keys the tree does not govern
        device = mask.meta["val"].device  # the captured model's device (a constant op has no input to follow)
        ones = call(aten.ones.default, ([q, older],), {"dtype": torch.bool, "device": device})
        visible = call(aten.cat.default, ([ones, tree], 1))  # [q, kv]
        is_float = mask.meta["val"].dtype.is_floating_point
        allowed = call(aten.eq.Scalar, (mask, 0.0)) if is_float else mask  # additive 0 = visible
        if window is not None:
            cols = call(aten.arange.default, (kv,), {"dtype": torch.long, "device": device})  # [kv]
            pos = call(aten.view.default, (inputs["position_ids"], [-1, 1]))  # [q, 1]
            in_window = call(aten.lt.Scalar, (call(aten.sub.Tensor, (pos, cols)), window))  # [q, kv]
            if inputs.get("attention_mask") is not None:  # the key padding mask still hides what it hides
                padding = call(aten.ne.Scalar, (inputs["attention_mask"], 0))
                padding = call(aten.view.default, (padding, [-1, 1, 1, kv]))  # [b, 1, 1, kv]
                in_window = call(aten.logical_and.default, (in_window, padding))  # [b, 1, q, kv]
            older_col = call(aten.lt.Scalar, (cols, older))
            # where(older_col, in_window, allowed) on booleans, spelled with logic ops: ONNX Runtime's
            # CPU Where has no bool kernel, and the result is the same bits
            allowed = call(aten.logical_or.default, (
                call(aten.logical_and.default, (older_col, in_window)),
                call(aten.logical_and.default, (call(aten.logical_not.default, (older_col,)), allowed)),
            ))
        allowed = call(aten.logical_and.default, (allowed, visible))  # broadcast to [b, h, q, kv]
        if is_float:
            minimum = torch.finfo(mask.meta["val"].dtype).min
            zero = call(aten.zeros_like.default, (mask,))
            return call(aten.where.ScalarOther, (allowed, zero, minimum))
        return allowed
