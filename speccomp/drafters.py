"""Self-drafters made from the target's own graph (EarlyExit / SkipLayers passes).

A `GraphDrafter` runs its graph level by level over a static token tree: one forward per
depth, scoring all nodes of that depth at once (tree-attention mask over the nodes drafted
so far), and gives node c the rank-r candidate of its parent (r = tree.ranks[c]).

The drafter reads the target's KV cache for the accepted prefix and writes its own entries
for draft nodes into the cache's scratch room past `cache.length` (the target's verify
forward overwrites them). Nothing is copied: same weights, same cache buffer.
"""
from __future__ import annotations

import torch

from .speculative import Draft, DraftContext, Drafter, truncate
from .tree import Tree


class GraphDrafter(Drafter):
    def __init__(self, step, kv_layers: list[int], tree: Tree, name: str):
        depths = tree.depth.tolist()
        if depths != sorted(depths):
            raise ValueError("graph drafters need tree nodes ordered by depth (Tree.from_choices orders them so)")
        self.step, self.tree, self.name = step, tree, name
        self.layer_index = torch.tensor(kv_layers)

    def propose(self, ctx: DraftContext) -> Draft:
        tree, _ = truncate(self.tree, ctx.max_depth, ctx.max_nodes)
        cache, base = ctx.cache, ctx.cache.length
        tokens = torch.zeros(tree.size, dtype=torch.long)
        tokens[0] = ctx.tokens[-1]
        depth = tree.depth.tolist()
        starts = [depth.index(d) for d in range(tree.max_depth + 1)] + [tree.size]
        for d in range(tree.max_depth):
            s, e = starts[d], starts[d + 1]  # nodes of depth d; their children are at depth d + 1
            with torch.no_grad():
                logits, new_kv, _ = self.step(
                    tokens[s:e][None],
                    (base + tree.depth[s:e])[None],
                    torch.ones(1, base + e, dtype=torch.long),
                    cache.data[..., : base + s, :],  # accepted prefix + draft nodes of shallower depths
                    tree.mask[s:e, :e],  # [depth-d nodes, all nodes so far]
                )
            cache.data[self.layer_index, :, :, :, base + s : base + e, :] = new_kv  # scratch room
            for u in range(s, e):
                kids = tree.children[u]
                if kids:
                    top = logits[0, u - s].topk(max(tree.ranks[c] for c in kids) + 1).indices
                    for c in kids:
                        tokens[c] = top[tree.ranks[c]]
        return Draft(tree, tokens)
