"""InPlaceKV: each layer writes its new keys/values into the runtime's cache buffer instead of concatenating.

Expects: cache reads `cat([past_kv[l, kv], new], 2)` (every capture has them; `frontend/graph.py` annotates them).

Rewrite (every such cat; eager lowering only, on the lowered copy):

    before:  k = cat([past_kv[l, 0], new_k], 2)          # a fresh [1, Hkv, past+q, D]: copies the whole past
    after:   k = extend_in_place(past_kv[l, 0], new_k)   # new_k written to slots [past, past+q) of the buffer
                                                          # past_kv views; k is a view of slots [0, past+q)

Why: the cat copies every layer's past every step, so a step's cost grew with the context far beyond the
attention reads (eager at 4k tokens: 1.9x the step at 300). The runtime's `KVCache` is preallocated (as in
gpt-fast) and hands the graph `data[..., :length, :]`; the slots past `length` are where this step's entries go
anyway (the commit copies the accepted ones there; graph drafters write theirs there), so writing them first
changes no value. `extend_in_place` writes only into a buffer that says so (`KV_ROOM`, set by KVCache) and only when
the view starts at slot 0, covers the owner's `length` slots in use and has room for q more; any other past (a
compressed cache, a user's tensor, a view that stops short of the slots in use) takes the cat, so the rewritten
graph is correct for every caller.
"""
from __future__ import annotations

import torch
from torch import fx

from speccomp.frontend.convention import room_owner
from speccomp.frontend.graph import Pass, SpecGraph, copy_meta

aten = torch.ops.aten
_INDEX_OPS = (aten.select.int, aten.slice.Tensor)


def free_room(view: torch.Tensor, q: int) -> torch.Tensor | None:
    """The runtime's cache buffer `view` is the first slots of (token axis -2), when q entries may be written right
    after it: the view starts at slot 0 and covers the owner's slots in use, and the buffer has room. Else None."""
    base = view._base
    owner = room_owner(base)
    if owner is None or q == 0 or view.dtype != base.dtype or view.stride(-2) != base.stride(-2):
        return None
    n, step, capacity = view.shape[-2], base.stride(-2), base.shape[-2]
    first_slot = (view.storage_offset() - base.storage_offset()) // step % capacity
    return base if first_slot == 0 and owner.length <= n and n + q <= capacity else None


def extend_in_place(past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """cat([past, new], 2), written into `past`'s buffer after it when the buffer allows (see the module)."""
    n = past.shape[2]
    if free_room(past, new.shape[2]) is None or new.dtype != past.dtype:
        return torch.cat([past, new], 2)
    full = past.as_strided((*past.shape[:2], n + new.shape[2], *past.shape[3:]), past.stride(), past.storage_offset())
    full[:, :, n:].copy_(new)
    return full


def _reads_cache(node: fx.Node, past_kv: fx.Node) -> bool:
    """True if `node` is past_kv indexed by select/slice only (past_kv[l, kv], with any [..., :n] slices)."""
    while isinstance(node, fx.Node) and node.target in _INDEX_OPS:
        node = node.args[0]
    return node is past_kv


class InPlaceKV(Pass):
    name = "inplace_kv"

    def sites(self, sg: SpecGraph) -> list[fx.Node]:
        past_kv = next((n for n in sg.gm.graph.nodes if n.op == "placeholder" and n.name == "past_kv"), None)
        return [
            n for n in sg.gm.graph.nodes
            if n.target is aten.cat.default and len(n.args[0]) == 2 and n.args[1] in (2, -2)
            and _reads_cache(n.args[0][0], past_kv)
        ]

    def rewrite(self, sg: SpecGraph) -> None:
        for cat in self.sites(sg):
            with sg.gm.graph.inserting_after(cat):
                new = sg.gm.graph.call_function(extend_in_place, tuple(cat.args[0]))
            copy_meta(new, cat)
            new.meta["val"] = cat.meta.get("val")
            cat.replace_all_uses_with(new)
            sg.gm.graph.erase_node(cat)
            for site in sg.structure.attention:  # keep the annotation pointing at live nodes
                site.key_cat = new if site.key_cat is cat else site.key_cat
                site.value_cat = new if site.value_cat is cat else site.value_cat
