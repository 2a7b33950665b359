"""TritonAttention: run every SDPA attention site in the Triton tree-attention kernel.

Expects: SDPA sites the way capture (+ TreeAttention) and GroupedQueryAttention leave them; run
GroupedQueryAttention first so K and V are the [b, Hkv, kv, D] cache tensors, not repeat_kv copies
(a graph without it still lowers correctly, the kernel then reads Hq copied heads with G = 1):

    aten.scaled_dot_product_attention(Q [b, Hq, q, D], K [b, Hkv, kv, D], V [b, Hkv, kv, Dv], M,
                                      scale=s, enable_gqa=True)
    float32 Q/K/V, M the graph's explicit mask (bool, or additive float), dropout_p == 0, is_causal False

Rewrite (per site):

    before:  Q, K, V, M ──► aten.scaled_dot_product_attention(Q, K, V, M, scale=s, enable_gqa=True) ──►
    after:   Q, K, V, M ──► speccomp.tree_attention(Q, K, V, M, s) ──►

The custom op (backends/triton_attention.py) is SDPA with enable_gqa semantics: query head h reads
KV head h // G, scale None means 1/sqrt(D), and the mask M alone decides who sees whom (causal
prefix, tree, sliding windows are all in M already).

Refused with GraphStructureError, never lowered to something that computes differently: dropout,
is_causal=True (causality would have to be in M), no mask, non-float32 attention, and the fused SDPA
variants (aten._scaled_dot_product_*_attention: other signatures and outputs). Eager attention sites
(softmax chains, e.g. Gemma2's softcapping) are not SDPA: they stay as they are, correct but not in
the kernel.
"""
from __future__ import annotations

import torch
from torch import fx

from speccomp.backends.triton_attention import TREE_ATTENTION
from speccomp.errors import GraphStructureError
from speccomp.frontend.graph import SDPA_OPS, Pass, SpecGraph
from speccomp.passes import SDPA, replace_attention, sdpa_arguments


class TritonAttention(Pass):
    name = "triton_attention"

    def sites(self, sg: SpecGraph) -> list[fx.Node]:
        return [n for n in sg.gm.graph.nodes if n.op == "call_function" and n.target is SDPA]

    def check(self, sg: SpecGraph) -> None:
        for node in sg.gm.graph.nodes:
            if node.op == "call_function" and node.target in SDPA_OPS and node.target is not SDPA:
                raise GraphStructureError(
                    f"{node.name}: TritonAttention lowers aten.scaled_dot_product_attention, found the fused variant "
                    f"{node.target}; lower the graph before any pass that picks an SDPA kernel"
                )
        for node in self.sites(sg):
            a = sdpa_arguments(node)
            where = f"attention {node.name}"
            if a["attn_mask"] is None:
                raise GraphStructureError(f"{where} has no mask; the Triton kernel applies the graph's explicit mask")
            if not (isinstance(a["dropout_p"], (int, float)) and a["dropout_p"] == 0):
                raise GraphStructureError(f"{where} has dropout_p={a['dropout_p']}; the Triton kernel has no dropout")
            if a["is_causal"] is not False:
                raise GraphStructureError(
                    f"{where} has is_causal={a['is_causal']}; the Triton kernel applies the mask alone, so causality "
                    "must be in the mask (as speccomp's capture builds it)"
                )
            if not (a["scale"] is None or isinstance(a["scale"], (int, float))):
                raise GraphStructureError(f"{where}: scale {a['scale']!r} is not a constant number")
            q, k, v = (a[n].meta.get("val") if isinstance(a[n], fx.Node) else None for n in ("query", "key", "value"))
            if q is None or k is None or v is None:
                raise GraphStructureError(f"{where}: query/key/value carry no shape metadata (meta['val'])")
            if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
                raise GraphStructureError(f"{where}: expected 4-D [b, heads, seq, dim] query/key/value, got "
                                          f"{q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
            if {q.dtype, k.dtype, v.dtype} != {torch.float32}:
                raise GraphStructureError(f"{where}: the Triton kernel computes in float32, got "
                                          f"{q.dtype}/{k.dtype}/{v.dtype}")
            hq, hkv = q.shape[1], k.shape[1]
            if isinstance(hq, int) and isinstance(hkv, int) and hq % hkv:
                raise GraphStructureError(f"{where}: {hq} query heads is not a multiple of {hkv} KV heads")

    def rewrite(self, sg: SpecGraph) -> None:
        graph = sg.gm.graph
        for node in self.sites(sg):
            args = [sdpa_arguments(node)[n] for n in ("query", "key", "value", "attn_mask", "scale")]
            with graph.inserting_after(node):
                new = graph.call_function(TREE_ATTENTION, tuple(args))
            new.meta.update(node.meta)  # module stack, stack trace, val: the output is the same tensor
            replace_attention(sg, node, new)
