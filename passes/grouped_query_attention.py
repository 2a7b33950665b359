"""GroupedQueryAttention: let SDPA read the shared KV heads instead of materialised copies.

Expects: SDPA attention sites whose key and value are HF's `repeat_kv` pattern

    K [b, Hkv, s, D] ─► unsqueeze(2) ─► expand [b, Hkv, G, s, D] ─► clone ─► view [b, Hkv*G, s, D]

Rewrite (per site; sites without the pattern, e.g. G == 1, are left alone):

    before:  sdpa(Q, view(clone(expand(K))), view(clone(expand(V))), M)
    after:   sdpa(Q, K, V, M, enable_gqa=True)

Why: the clone writes G copies of the whole cache (past + q rows) every step, per layer;
at 2k cached tokens that is ~95% of attention time. SDPA's `enable_gqa` maps query head h
to KV head h // G — the same pairing as repeat_kv — and gives bitwise-identical outputs
(checked in tests/test_lowering_passes.py).
"""
from __future__ import annotations

import torch
from torch import fx

from speccomp.frontend.graph import Pass, SpecGraph
from speccomp.passes import SDPA, replace_attention

aten = torch.ops.aten


def _unrepeat(node: fx.Node) -> fx.Node | None:
    """The [b, Hkv, s, D] source of a repeat_kv chain ending at `node`, or None."""
    if node.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return None
    expand = node.args[0]
    if expand.target is aten.clone.default:  # else a reshape of an expand (no explicit clone)
        expand = expand.args[0]
    if expand.target is not aten.expand.default:
        return None
    unsq = expand.args[0]
    return unsq.args[0] if unsq.target is aten.unsqueeze.default and unsq.args[1] == 2 else None


class GroupedQueryAttention(Pass):
    name = "grouped_query_attention"

    def sites(self, sg: SpecGraph):
        out = []
        for node in sg.gm.graph.nodes:
            if node.target is not SDPA or node.kwargs.get("enable_gqa"):
                continue
            k0, v0 = _unrepeat(node.args[1]), _unrepeat(node.args[2])
            if k0 is None or v0 is None:
                continue
            qv, kv = node.args[0].meta.get("val"), k0.meta.get("val")
            if qv is None or kv is None or qv.dim() != 4 or kv.dim() != 4:
                continue
            out.append((node, k0, v0))
        return out

    def rewrite(self, sg: SpecGraph) -> None:
        for node, k0, v0 in self.sites(sg):
            args = list(node.args)
            args[1], args[2] = k0, v0
            with sg.gm.graph.inserting_after(node):
                new = sg.gm.graph.call_function(SDPA, tuple(args), {**node.kwargs, "enable_gqa": True})
            replace_attention(sg, node, new)
        # the repeat chains are now dead; Pass.__call__ removes them
