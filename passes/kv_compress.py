"""KV compression passes. AttentionScores: expose attention probabilities, pooled per KV head.

Expects: an annotated graph (after TreeAttention and SkipLayers where they run, so the masks are
the ones attention really uses and the layers those that remain: both refuse to run after it)
whose attention sites are SDPA calls (query, keys as cat(past, new), mask, scale) or eager
softmaxes. Adds one output after the existing ones:

    attn  float [L', 1, Hkv, q, past + q]  softmax(Q K^T * scale + mask), mean over the query
                                           heads that share a KV head (GQA group), for the
                                           L' layers of sg.kv_layers (all, unless layers were skipped)

For an SDPA site the probabilities are recomputed next to the SDPA call from the same query,
the un-repeated keys (the K cat) and the same mask:

    query [1, H, q, D] ─► unflatten(1, [Hkv, G]) ─┐
    K cat [1, Hkv, kv, D] ─► unsqueeze(2) ─► T ───┴─► matmul * scale ─► mask ─► softmax ─► mean(G) ─► stack
    mask  [1, 1, q, kv] ─► unsqueeze(2) ──────────────────────────────┘

(reading the K cat, not SDPA's repeated keys, leaves the repeat chain for GroupedQueryAttention
to remove when lowering). An eager site's softmax already holds the probabilities.

SnapKV votes and H2O scores (speccomp/kv/policies.py) are sums of these rows over the queries
that vote. The extra matmul per layer is over the cache the graph reads; drafters over a
compressed cache read few keys, so it is cheap there.
"""
from __future__ import annotations

import torch
from torch import fx

from speccomp.errors import GraphStructureError
from speccomp.frontend.graph import Pass, SpecGraph, _cache_slot, copy_meta

aten = torch.ops.aten
ATTN_SCORES = "attn_scores"
_BOOL_OPS = {aten.logical_and.default, aten.logical_or.default, aten.logical_not.default, aten.eq.Scalar,
             aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar}


def _is_bool_mask(mask: fx.Node) -> bool:
    """SDPA masks are boolean (keep) or additive float; passes may leave no metadata on new masks."""
    val = mask.meta.get("val")
    return val.dtype == torch.bool if val is not None else mask.target in _BOOL_OPS


class AttentionScores(Pass):
    name = "attention_scores"

    def check(self, sg: SpecGraph) -> None:
        if ATTN_SCORES in {n.meta.get("speccomp_output") for n in sg.gm.graph.nodes}:
            raise GraphStructureError("AttentionScores was already applied to this graph")
        for site in sg.structure.attention:
            if site.kind == "sdpa" and (site.mask is None or site.node.args[0].meta.get("val") is None):
                raise GraphStructureError(f"attention {site.module} has no mask or query shape to score with")

    def rewrite(self, sg: SpecGraph) -> None:
        graph = sg.gm.graph
        out = graph.output_node()
        hkv = sg.captured.kv.num_kv_heads
        pooled = []
        kept = set(sg.kv_layers)  # SkipLayers may have removed some layers' attention
        with graph.inserting_before(out):
            for site in sorted((s for s in sg.structure.attention if s.layer in kept), key=lambda s: s.layer):
                probs = self._sdpa_probs(graph, site, hkv) if site.kind == "sdpa" else self._eager_probs(graph, site, hkv)
                pooled.append(copy_meta(graph.call_function(aten.mean.dim, (probs, [2])), site.node))  # [1, Hkv, q, kv]
            stacked = graph.call_function(aten.stack.default, (pooled, 0))  # [L, 1, Hkv, q, kv]
        stacked.meta["speccomp_output"] = ATTN_SCORES
        out.args = (tuple(out.args[0]) + (stacked,),)

    @staticmethod
    def _sdpa_probs(graph: fx.Graph, site, hkv: int) -> fx.Node:
        call = graph.call_function
        query = site.node.args[0]
        heads, head_dim = query.meta["val"].shape[1], query.meta["val"].shape[-1]
        scale = site.node.kwargs.get("scale") or head_dim**-0.5
        q = call(aten.unflatten.int, (query, 1, [hkv, heads // hkv]))  # [1, Hkv, G, q, D]
        k = call(aten.transpose.int, (call(aten.unsqueeze.default, (site.key_cat, 2)), -1, -2))  # [1, Hkv, 1, D, kv]
        scores = call(aten.mul.Tensor, (call(aten.matmul.default, (q, k)), scale))  # [1, Hkv, G, q, kv]
        mask = site.mask
        if mask.meta.get("val") is not None and mask.meta["val"].shape[1] != 1:  # per-head mask [1, H, q, kv]
            mask = call(aten.unflatten.int, (mask, 1, [hkv, heads // hkv]))
        else:
            mask = call(aten.unsqueeze.default, (mask, 2))  # [1, 1, 1, q, kv]
        if _is_bool_mask(site.mask):
            scores = call(aten.where.ScalarOther, (mask, scores, float("-inf")))
        else:
            scores = call(aten.add.Tensor, (scores, mask))
        return call(aten._softmax.default, (scores, -1, False))

    @staticmethod
    def _eager_probs(graph: fx.Graph, site, hkv: int) -> fx.Node:
        heads = site.node.meta["val"].shape[1] if site.node.meta.get("val") is not None else None
        if heads is None:
            raise GraphStructureError(f"eager attention {site.module} has no shape metadata on its softmax")
        probs = graph.call_function(aten.unflatten.int, (site.node, 1, [hkv, heads // hkv]))  # [1, Hkv, G, q, kv]
        return graph.call_function(aten._to_copy.default, (probs,), {"dtype": torch.float32})


KIVI_INPUTS = ("kv_tail", "kv_key_codes", "kv_key_scale", "kv_key_min", "kv_value_codes", "kv_value_scale",
               "kv_value_min")


class KiviCacheRead(Pass):
    """Make attention read a KIVI cache (speccomp/kv/cache.py KiviCache) as it is held.

    Expects: every attention site's K and V are cat([past_kv[l, kv], new], -2) (annotate's K/V cats).
    Adds inputs (after the existing ones; Tq quantised tokens, G key group, g value group, P = D*bits/8):

        kv_tail         float [L, 2, 1, Hkv, tail, D]   newest tokens, full precision
        kv_key_codes    uint8 [L, 1, Hkv, Tq, P]        packed codes
        kv_key_scale    float [L, 1, Hkv, Tq/G, D]      per (group of G tokens, channel)
        kv_key_min      float [L, 1, Hkv, Tq/G, D]
        kv_value_codes  uint8 [L, 1, Hkv, Tq, P]
        kv_value_scale  float [L, 1, Hkv, Tq, D/g]      per (token, group of g channels)
        kv_value_min    float [L, 1, Hkv, Tq, D/g]

    and rewrites each layer's cache read:

        before:  cat([past_kv[l, 0], k_new])
        after:   cat([dequant(kv_key_codes[l], scale[l], min[l]), kv_tail[l, 0], k_new])
                 dequant: codes ─► (>> shifts) & mask ─► float ─► * scale + min   (per layer)

    `past_kv` stays an input for its *shape* only (the model builds its mask and positions from
    the cache length, Tq + tail): pass a stride-0 view, torch.zeros(()).expand(L, 2, 1, Hkv, Tq + tail, D).
    The rewrite checks that nothing reads its values any more. Each layer's dequantised keys/values
    live only while that layer runs (FX frees values after their last use), so a forward holds the
    packed cache plus one layer in float, not the whole cache in float.
    """

    name = "kivi_cache_read"

    def __init__(self, bits: int, group: int, value_group: int):
        self.bits, self.group, self.value_group = bits, group, value_group

    def check(self, sg: SpecGraph) -> None:
        if KIVI_INPUTS[0] in sg.input_names():
            raise GraphStructureError("KiviCacheRead was already applied to this graph")
        for site in sg.structure.attention:
            for cat in (site.key_cat, site.value_cat):
                if _cache_slot(cat, sg.structure.inputs["past_kv"]) is None:
                    raise GraphStructureError(f"attention {site.module} does not read cat([past_kv[l, kv], new])")

    def rewrite(self, sg: SpecGraph) -> None:
        graph = sg.gm.graph
        past = sg.structure.inputs["past_kv"]
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        new_inputs = {}
        for name in KIVI_INPUTS:
            with graph.inserting_after(last):
                last = new_inputs[name] = graph.placeholder(name)
        sg.structure.inputs.update(new_inputs)
        val = past.meta.get("val")  # the captured cache: where (GPU too) and in what dtype the keys/values live
        like = (val.device if val is not None else None, sg.captured.kv.dtype)
        for site in sg.structure.attention:
            for cat, kv_index in ((site.key_cat, 0), (site.value_cat, 1)):
                old = cat.args[0][0]
                with graph.inserting_before(cat):
                    dequant = self._dequantised(graph, new_inputs, site.layer, kv_index, like)
                    tail = _layer(graph, _layer(graph, new_inputs["kv_tail"], site.layer), kv_index)  # [1, Hkv, t, D]
                cat.args = ([dequant, tail] + list(cat.args[0][1:]),) + tuple(cat.args[1:])
                _erase_if_dead(graph, old)
        readers = [u for u in past.users if u.target is not aten.sym_size.int and u.op != "call_module"]
        if readers:
            raise GraphStructureError(f"past_kv values are still read by {[u.name for u in readers]} after KiviCacheRead")

    def _unpacked(self, graph: fx.Graph, codes: fx.Node, like: tuple) -> fx.Node:
        """uint8 [..., P] -> [..., D] in the cache's dtype (8 // bits codes per byte, low bits first, as pack_codes;
        codes < 256 are exact in every float dtype). like: (device, dtype) of the captured cache."""
        call = graph.call_function
        device, dtype = like
        if self.bits != 8:
            shifts = call(aten.arange.start_step, (0, 8, self.bits), {"dtype": torch.uint8, "device": device})
            spread = call(aten.bitwise_right_shift.Tensor, (call(aten.unsqueeze.default, (codes, -1)), shifts))
            codes = call(aten.flatten.using_ints, (call(aten.bitwise_and.Scalar, (spread, 2**self.bits - 1)), -2, -1))
        return call(aten._to_copy.default, (codes,), {"dtype": dtype})

    def _dequantised(self, graph: fx.Graph, inputs: dict, layer: int, kv_index: int, like: tuple) -> fx.Node:
        """Layer `layer`'s keys (kv_index 0: groups of G tokens, dim d = 2) or values (1: groups of g channels,
        d = 3) as [1, Hkv, Tq, D] in the cache's dtype: codes unflattened at d into [groups, group size] * scale
        + min."""
        call = graph.call_function
        kind, d, size = ("key", 2, self.group) if kv_index == 0 else ("value", 3, self.value_group)
        codes = self._unpacked(graph, _layer(graph, inputs[f"kv_{kind}_codes"], layer), like)  # [1, Hkv, Tq, D]
        scale = _layer(graph, inputs[f"kv_{kind}_scale"], layer)  # keys [1, Hkv, Tq/G, D], values [1, Hkv, Tq, D/g]
        minimum = _layer(graph, inputs[f"kv_{kind}_min"], layer)
        grouped = call(aten.unflatten.int, (codes, d, [call(aten.sym_size.int, (scale, d)), size]))
        x = call(aten.add.Tensor, (call(aten.mul.Tensor, (grouped, call(aten.unsqueeze.default, (scale, d + 1)))),
                                   call(aten.unsqueeze.default, (minimum, d + 1))))
        return call(aten.flatten.using_ints, (x, d, d + 1))


def _layer(graph: fx.Graph, node: fx.Node, layer: int) -> fx.Node:
    """node[layer]: [L, ...] -> [...]."""
    return graph.call_function(aten.select.int, (node, 0, layer))


def _erase_if_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Remove an unused select chain down to (not including) the placeholder."""
    while node.op == "call_function" and not node.users:
        parent = node.args[0]
        graph.erase_node(node)
        node = parent
