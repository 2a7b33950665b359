"""OrtAttention: every attention site becomes one fused attention call that writes the cache in place.

For the ONNX Runtime lowering only (on the lowered copy), after TreeAttention and GroupedQueryAttention.

Expects: every attention site is SDPA (no dropout, not `is_causal`) over `cat(past_kv[l, kv], new)` keys and
values, the cats used otherwise only by the `new_kv` output's `cat[..., past:]` slices, and `past_kv` used
otherwise only for its length (`sym_size(past_kv, 4)`). Anything else (eager softmax attention, a softcap):
`UnsupportedModelError`, and the backend keeps the plain export.

Rewrite (per layer l):

    before:  k = cat([past_kv[l, 0], new_k], 2);  v = cat([past_kv[l, 1], new_v], 2)
             o = sdpa(q, k, v, mask, scale);  new_kv row l = k[..., past:], v[..., past:]
    after:   o, present_key_l, present_value_l = group_query_attention(q * scale, new_k, new_v, past_key_l,
                                                                        past_value_l, mask -> additive bias, 1.0)
             new_kv row l = new_k, new_v;  past = attention_mask.shape[1] - input_ids.shape[1]
    graph:   inputs  past_kv  ->  past_key_l, past_value_l  ([1, Hkv, capacity, D]: one layer of the runtime's buffer)
             outputs + present_key_l, present_value_l (bound by the runtime to the same memory as past_key_l, ...)

Why: the plain export copies the whole past several times per layer per step (Concat, the repeat_kv Expand, a
Transpose), so the onnxruntime step at 4k tokens of context cost 5x the step at 300. `group_query_attention`
exports as ONNX Runtime's `com.microsoft.GroupQueryAttention`, which reads the shared KV heads in place and, when
past and present are one buffer, writes only this step's entries into it (`causal=0`: the tree, causal and window
masks all come in as the bias). Its torch implementation here is the reference the tests compare against.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from speccomp.errors import GraphStructureError, UnsupportedModelError
from speccomp.frontend.graph import Pass, SpecGraph, copy_meta
from speccomp.passes import SDPA, replace_attention, sdpa_arguments

aten = torch.ops.aten


@torch.library.custom_op("speccomp::group_query_attention", mutates_args=())
def group_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past_key: torch.Tensor,
                          past_value: torch.Tensor, bias: torch.Tensor, num_heads: int, kv_num_heads: int,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ONNX Runtime's GroupQueryAttention (causal=0), in torch: query [1, q, Hq*D], key/value [1, q, Hkv*D],
    past_key/value [1, Hkv, capacity, D] whose first T-q slots hold the past, bias [1, 1, q, T] (T = past + q).
    Returns (output [1, q, Hq*D], present_key, present_value): the past with the new entries at [T-q, T)."""
    q, total, d = query.shape[1], bias.shape[-1], past_key.shape[-1]
    present = []
    for past, new in ((past_key, key), (past_value, value)):
        buf = past.clone()
        buf[:, :, total - q : total] = new.view(1, q, kv_num_heads, d).transpose(1, 2)
        present.append(buf)
    heads = query.view(1, q, num_heads, d).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        heads, present[0][:, :, :total], present[1][:, :, :total], attn_mask=bias, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(1, q, num_heads * d), present[0], present[1]


@group_query_attention.register_fake
def _(query, key, value, past_key, past_value, bias, num_heads, kv_num_heads, scale):
    return query.new_empty(query.shape), torch.empty_like(past_key), torch.empty_like(past_value)


def fused_attention(q4, new_k, new_v, past_key, past_value, mask, scale: float):
    """SDPA's layout in and out ([1, H, q, D]) around `group_query_attention`; the boolean mask becomes a bias."""
    _, hq, q, d = q4.shape
    hkv = new_k.shape[1]
    bias = mask if mask.dtype != torch.bool else torch.zeros(mask.shape, dtype=q4.dtype).masked_fill(~mask, float("-inf"))
    bias = bias.expand(1, 1, q, bias.shape[-1])
    # The scale goes onto the queries and the op gets 1.0: ONNX Runtime's CPU kernel runs Q.K^T as a GEMM with
    # alpha = scale, and MLAS takes its M = 1 kernel (no copy of K into a packed panel per head) only for alpha = 1.
    # The onnxruntime step at 4096 tokens of context got 1.21x faster (benchmarks/ort_prescale.py); q > 1 still packs.
    # Exact for a power-of-two scale (head_dim 64: 1/8); other scales (and float16 queries) round slightly apart.
    flat = [t.transpose(1, 2).reshape(1, q, -1) for t in (q4 * scale, new_k, new_v)]
    out, present_k, present_v = group_query_attention(*flat, past_key, past_value, bias, hq, hkv, 1.0)
    return out.view(1, q, hq, d).transpose(1, 2), present_k, present_v


class OrtAttention(Pass):
    name = "ort_attention"

    def _past_kv(self, sg: SpecGraph) -> fx.Node:
        return sg.structure.inputs["past_kv"]

    def check(self, sg: SpecGraph) -> None:
        if self.name in sg.applied:
            raise GraphStructureError(f"OrtAttention was already applied to this graph (applied: {sg.applied})")
        if "past_kv" not in sg.structure.inputs:
            raise GraphStructureError(f"the graph has no past_kv input (applied: {sg.applied}); OrtAttention reads the "
                                      "cache as cat(past_kv[l, kv], new): run it before passes that change that")
        past_kv, cats = self._past_kv(sg), set()
        for site in sg.structure.attention:
            args = sdpa_arguments(site.node) if site.node.target is SDPA else None
            if site.kind != "sdpa" or args is None:
                raise UnsupportedModelError(f"{site.module}: {site.kind} attention (the fused op takes SDPA sites)")
            if args["key"] is not site.key_cat or args["value"] is not site.value_cat:
                raise UnsupportedModelError(f"{site.module}: SDPA does not read cat(past, new) keys and values")
            if args["is_causal"] or args["dropout_p"] or not isinstance(args["attn_mask"], fx.Node):
                raise UnsupportedModelError(f"{site.module}: SDPA with is_causal, dropout or no mask")
            query = args["query"].meta.get("val")
            mask = args["attn_mask"].meta.get("val")  # TreeAttention's mask has no fake value: export checks it
            if query is None or query.dim() != 4 or (mask is not None and tuple(mask.shape[:2]) != (1, 1)):
                raise UnsupportedModelError(f"{site.module}: query or mask not [1, H, q, D] / [1, 1, q, T]")
            if query.shape[-1] % 8:  # ONNX Runtime refused it only when the first step ran
                raise UnsupportedModelError(f"{site.module}: head size {query.shape[-1]} (GroupQueryAttention takes "
                                            "multiples of 8)")
            for cat in (site.key_cat, site.value_cat):
                if not self._reads_past(cat.args[0][0], past_kv):  # KiviCacheRead's dequantised cache, say
                    raise UnsupportedModelError(f"{site.module}: the cache read {cat.name} does not take past_kv[l, kv]")
                if any(u is not site.node and not self._tail(u, past_kv) for u in cat.users):
                    raise UnsupportedModelError(f"{site.module}: the cache read {cat.name} has other users")
                cats.add(cat)
        for user in past_kv.users:
            if user.target is aten.sym_size.int and user.args[1] == 4 or "guards" in str(user.target):
                continue
            if user.target is not aten.select.int or not all(
                    u.target is aten.select.int and set(u.users) <= cats for u in user.users):
                raise UnsupportedModelError(f"past_kv is read by {user.format_node()}, not only by cat(past, new)")

    @staticmethod
    def _reads_past(node, past_kv: fx.Node) -> bool:
        """True for past_kv[l][kv]: select(select(past_kv, 0, l), 0, kv), the buffer the fused op reads in place."""
        return (isinstance(node, fx.Node) and node.target is aten.select.int and isinstance(node.args[0], fx.Node)
                and node.args[0].target is aten.select.int and node.args[0].args[0] is past_kv)

    @staticmethod
    def _tail(node: fx.Node, past_kv: fx.Node) -> bool:
        """True for cat[..., past:] along the token axis, past = past_kv.shape[4] (the new_kv output's slice of this
        step's entries)."""
        start = node.args[2] if node.target is aten.slice.Tensor and len(node.args) == 3 else None
        return (node.args[1] in (2, -2) and isinstance(start, fx.Node) and start.target is aten.sym_size.int
                and start.args == (past_kv, 4))

    def rewrite(self, sg: SpecGraph) -> None:
        graph, past_kv = sg.gm.graph, self._past_kv(sg)
        inputs = sg.structure.inputs
        last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
        presents = []
        for site in sorted(sg.structure.attention, key=lambda s: s.layer):
            kv_in = []
            for kv, cat in ((0, site.key_cat), (1, site.value_cat)):
                with graph.inserting_after(last_input):
                    last_input = graph.placeholder(f"past_{('key', 'value')[kv]}_{site.layer}")
                last_input.meta["val"] = cat.args[0][0].meta["val"]  # its shape along the token axis is the buffer's
                kv_in.append(last_input)
                for user in list(cat.users):
                    if user is not site.node:
                        user.replace_all_uses_with(cat.args[0][1])  # cat[..., past:] is this step's entries
                        graph.erase_node(user)
            args = sdpa_arguments(site.node)
            q, mask = args["query"], args["attn_mask"]
            scale = args["scale"] or q.meta["val"].shape[-1] ** -0.5
            new_k, new_v = site.key_cat.args[0][1], site.value_cat.args[0][1]
            with graph.inserting_before(site.node):
                call = graph.call_function(fused_attention, (q, new_k, new_v, *kv_in, mask, float(scale)))
                outs = [graph.call_function(operator.getitem, (call, i)) for i in range(3)]
            for n in (call, *outs[1:]):
                copy_meta(n, site.node)
            replace_attention(sg, site.node, outs[0])
            site.mask_user = call  # the fused call reads the mask (outs[0] only picks its output)
            presents += outs[1:]
        output = graph.output_node()
        output.args = (tuple(output.args[0]) + tuple(presents),)
        self._past_from_mask(graph, past_kv, inputs)

    @staticmethod
    def _past_from_mask(graph: fx.Graph, past_kv: fx.Node, inputs: dict) -> None:
        """past_kv.shape[4] -> attention_mask.shape[1] - input_ids.shape[1]; then past_kv is gone."""
        for user in [u for u in past_kv.users if u.target is aten.sym_size.int]:
            with graph.inserting_before(user):
                total = graph.call_function(aten.sym_size.int, (inputs["attention_mask"], 1))
                q = graph.call_function(aten.sym_size.int, (inputs["input_ids"], 1))
                past = graph.call_function(operator.sub, (total, q))
            user.replace_all_uses_with(past)
            graph.erase_node(user)
        graph.eliminate_dead_code()
        for user in list(past_kv.users):  # export's input guard call
            graph.erase_node(user)
        graph.erase_node(past_kv)
        inputs.pop("past_kv")
