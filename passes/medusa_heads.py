"""MedusaHeads: make the verify forward also return the Medusa head states of every token.

Expects: an annotated graph whose third output is the final hidden state h [1, q, H] (after the
final norm: what the LM head reads), and MedusaHeads whose hidden size is H.

    before:  ... h ─► lm_head ─► logits                 outputs (logits, new_kv, h)
    after:   ... h ─► lm_head ─► logits
                 └─► for k < K:  s_k = ResBlocks_k(h)    (linear + SiLU + residual, L times)
                     stack(s_0..s_K-1, dim=-2) ─► medusa_states [1, q, K, H]
                                                        outputs (logits, new_kv, h, medusa_states)

The heads' projection to the vocabulary is *not* applied in the graph: with tied heads it is
the LM head, and the runtime needs head logits for one row only (the last accepted token),
so it projects K rows there instead of K * q here (the LM head is ~20% of SmolLM2's weights).
Head weights become parameters of the graph module (`medusa.{k}.{j}.linear`), so every
backend lowers them like the model's own linears.
"""
from __future__ import annotations

import torch

from speccomp.errors import GraphStructureError
from speccomp.frontend.graph import Pass, SpecGraph, copy_meta

aten = torch.ops.aten


class MedusaHeadsPass(Pass):
    name = "medusa_heads"

    def __init__(self, heads):
        self.heads = heads

    def check(self, sg: SpecGraph) -> None:
        out = sg.gm.graph.output_node().args[0]
        if len(out) != 3:
            raise GraphStructureError(f"expected the 3 outputs (logits, new_kv, hidden), got {len(out)}; applied twice?")
        h = sg.structure.final_hidden.meta.get("val")
        if h is None or h.shape[-1] != self.heads.hidden:
            raise GraphStructureError(
                f"the heads expect hidden size {self.heads.hidden}, the model's final hidden state is "
                f"{None if h is None else h.shape[-1]}"
            )

    def rewrite(self, sg: SpecGraph) -> None:
        gm, graph = sg.gm, sg.gm.graph
        gm.add_module("medusa", self.heads.blocks)  # parameters shared with the heads object
        output = graph.output_node()
        h = sg.structure.final_hidden
        states = []
        with graph.inserting_before(output):
            for k, blocks in enumerate(self.heads.blocks):
                x = h
                for j in range(len(blocks)):
                    w = graph.get_attr(f"medusa.{k}.{j}.linear.weight")
                    b = graph.get_attr(f"medusa.{k}.{j}.linear.bias")
                    y = graph.call_function(aten.linear.default, (x, w, b))
                    x = graph.call_function(aten.add.Tensor, (x, graph.call_function(aten.silu.default, (y,))))
                states.append(x)
            stacked = graph.call_function(aten.stack.default, (states, -2))  # [1, q, K, H]
        copy_meta(stacked, h)
        output.args = (tuple(output.args[0]) + (stacked,),)
