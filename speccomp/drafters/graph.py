"""Self-drafters made from the target's own graph (EarlyExit / SkipLayers passes).

A `GraphDrafter` runs its graph level by level: one forward per depth, scoring every node of
that depth that is expanded at once (tree-attention mask over its expanded ancestors). Which nodes
expand and which tokens they get is speccomp/drafters/grow.py's (static and dynamic trees).

The drafter reads the target's KV cache for the accepted prefix and writes its own entries
for draft nodes into the cache's scratch room past `cache.length` (the target's verify
forward overwrites them). Nothing is copied: same weights, same cache buffer.
"""
from __future__ import annotations

import torch

from speccomp.drafters.grow import Grown, ancestor_rows, grow, torch_top
from speccomp.runtime.decode import Draft, DraftContext, Drafter, check_tree_kind


class GraphDrafter(Drafter):
    reads = ("target_cache",)
    trees = ("static", "dynamic")
    graphs = ("draft",)
    forward_per_level = True

    def __init__(self, step, kv_layers: list[int], tree, name: str, options: dict | None = None, graph=None,
                 light: bool = False):
        self.step, self.tree, self.name = step, tree, name
        self.light_graphs = light  # the quantized self-drafter's step: one thread beside the spinning target
        check_tree_kind(self, tree)
        self.layer_index = torch.tensor(kv_layers)
        self.options = dict(options or {})  # what the user, a stored search or the defaults chose
        self.graph = graph  # the SpecGraph `step` was lowered from (what an engine export writes), if known

    def with_tree(self, tree) -> "GraphDrafter":
        return GraphDrafter(self.step, self.layer_index.tolist(), tree, self.name, self.options, self.graph,
                            self.light_graphs)

    def _run(self, cache, base: int, used: int, tokens, position: int, mask) -> tuple:
        """Run `tokens` (all at `position`) after the prefix and the `used` scratch slots; store their KV. The step's
        outputs (logits [1, k, V] first)."""
        k, device = len(tokens), cache.data.device  # the host builds tokens and masks; the graph runs where the cache is
        with torch.no_grad():
            # past: the accepted prefix + scratch slots filled so far; mask [k, used + k] over those slots and nodes
            outs = self.step(tokens[None].to(device), torch.full((1, k), position, dtype=torch.long, device=device),
                             torch.ones(1, base + used + k, dtype=torch.long, device=device),
                             cache.data[..., : base + used, :], mask.to(device))
        cache.data[self.layer_index, :, :, :, base + used : base + used + k, :] = outs[1]
        return outs

    def _forward(self, cache, base: int, used: int, tokens, depth: int, mask):
        """Logits [k, V] of `tokens` (all at `depth`) after the prefix and the `used` scratch slots."""
        return self._run(cache, base, used, tokens, base + depth, mask)[0][0]

    def level_forward(self, cache, base: int, tokens) -> None:
        """One draft level: `tokens` scored together after `base` cached tokens of the target's `cache` (what
        autotune's time_steps times per width; DraftModelDrafter has the same method over its own cache)."""
        self._forward(cache, base, 0, tokens, 0, torch.eye(len(tokens), dtype=torch.bool))

    def propose(self, ctx: DraftContext) -> Draft:
        cache, base, slot = ctx.cache, ctx.cache.length, {}  # slot: candidate -> its scratch slot past `base`

        def expand(d: int, nodes: list[int], grown: Grown, k: int):
            used = len(slot)
            if used + len(nodes) > ctx.max_nodes:  # the drafter's tree mask must fit where the target's does
                return None
            rows = torch.tensor(ancestor_rows(nodes, grown, slot, used))
            logits = self._forward(cache, base, used, torch.tensor([grown.token[c] for c in nodes]), d, rows)
            return torch_top(logits, k)

        return grow(self.tree, ctx, expand)
