"""Graph rewrites on captured speccomp graphs (each a `speccomp.frontend.graph.Pass`), and node helpers they share."""
from __future__ import annotations

import torch
from torch import fx

from speccomp.frontend.graph import copy_meta

SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")  # positional; scale, enable_gqa: keyword
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def sdpa_arguments(node: fx.Node) -> dict:
    """An aten.scaled_dot_product_attention call's arguments by name, defaults filled in."""
    return {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, node.args)), **node.kwargs}


def replace_node(old: fx.Node, new: fx.Node) -> None:
    """`new`, computing the same tensor as `old`, takes its provenance, value and users; `old` is erased."""
    copy_meta(new, old)
    new.meta["val"] = old.meta.get("val")
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def replace_attention(sg, old: fx.Node, new: fx.Node) -> None:
    """`replace_node` for an attention call, keeping the Structure annotation on live nodes."""
    replace_node(old, new)
    for site in sg.structure.attention:
        if site.node is old:
            site.node = new
        if site.mask_user is old:
            site.mask_user = new
