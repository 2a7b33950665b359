"""Self-drafters made from the target's own graph (EarlyExit / SkipLayers passes).

A `GraphDrafter` runs its graph level by level: one forward per depth, scoring all nodes
of that depth at once (tree-attention mask over the nodes drafted so far). Two tree modes:

- static (a `Tree`): node c gets the rank-r candidate of its parent (r = tree.ranks[c]);
- dynamic (`DynamicTreeSpec`, EAGLE-2): each depth expands the `top_k` frontier nodes of
  highest *cumulative* draft probability, each proposing its `top_k` best next tokens; the
  step's tree is the `budget` candidates of highest cumulative probability (a prefix-closed
  set: a child is never likelier than its parent). Expansion stops early when even the best
  frontier node has cumulative probability below `min_prob`: such drafts are rarely
  accepted, and on CPU every drafter forward costs real time.

The drafter reads the target's KV cache for the accepted prefix and writes its own entries
for draft nodes into the cache's scratch room past `cache.length` (the target's verify
forward overwrites them). Nothing is copied: same weights, same cache buffer.
"""
from __future__ import annotations

import math

import torch

from speccomp.runtime.decode import Draft, DraftContext, Drafter, truncate
from speccomp.runtime.tree import DynamicTreeSpec, Tree

MAX_DYNAMIC_DEPTH = 6  # EAGLE-2's default depth
MIN_PROB = 0.02  # stop expanding when the best frontier path is less likely than this
LOG_MIN_PROB = math.log(MIN_PROB)


class GraphDrafter(Drafter):
    def __init__(self, step, kv_layers: list[int], tree, name: str):
        if isinstance(tree, Tree):
            depths = tree.depth.tolist()
            if depths != sorted(depths):
                raise ValueError("graph drafters need tree nodes ordered by depth (Tree.from_choices orders them so)")
        elif not isinstance(tree, DynamicTreeSpec):
            raise TypeError(f"tree must be a Tree or a DynamicTreeSpec, got {type(tree).__name__}")
        self.step, self.tree, self.name = step, tree, name
        self.layer_index = torch.tensor(kv_layers)

    def _forward(self, cache, base: int, used: int, tokens, depth: int, mask):
        """Score `tokens` (all at `depth`) after the prefix and the `used` scratch slots; store their KV."""
        k = len(tokens)
        with torch.no_grad():
            logits, new_kv, _ = self.step(
                tokens[None],
                torch.full((1, k), base + depth, dtype=torch.long),
                torch.ones(1, base + used + k, dtype=torch.long),
                cache.data[..., : base + used, :],  # accepted prefix + scratch slots filled so far
                mask,  # [k, used + k] over the scratch slots and these nodes
            )
        cache.data[self.layer_index, :, :, :, base + used : base + used + k, :] = new_kv
        return logits[0]

    def propose(self, ctx: DraftContext) -> Draft:
        if isinstance(self.tree, DynamicTreeSpec):
            return self._propose_dynamic(ctx)
        tree, _ = truncate(self.tree, ctx.max_depth, ctx.max_nodes)
        cache, base = ctx.cache, ctx.cache.length
        tokens = torch.zeros(tree.size, dtype=torch.long)
        tokens[0] = ctx.tokens[-1]
        depth = tree.depth.tolist()
        starts = [depth.index(d) for d in range(tree.max_depth + 1)] + [tree.size]
        for d in range(tree.max_depth):
            s, e = starts[d], starts[d + 1]  # nodes of depth d; their children are at depth d + 1
            logits = self._forward(cache, base, s, tokens[s:e], d, tree.mask[s:e, :e])
            for u in range(s, e):
                kids = tree.children[u]
                if kids:
                    top = logits[u - s].topk(max(tree.ranks[c] for c in kids) + 1).indices
                    for c in kids:
                        tokens[c] = top[tree.ranks[c]]
        return Draft(tree, tokens)

    def _propose_dynamic(self, ctx: DraftContext) -> Draft:
        spec: DynamicTreeSpec = self.tree
        budget = min(spec.budget, ctx.max_nodes - 1)
        max_depth = min(MAX_DYNAMIC_DEPTH, ctx.max_depth, budget)
        cache, base = ctx.cache, ctx.cache.length
        # candidates: index 0 is the root; parent < child; score = cumulative log-probability
        parent, token, score, depth = [-1], [ctx.tokens[-1]], [0.0], [0]
        slot_of: dict[int, int] = {}  # candidate -> scratch slot of its KV (expanded candidates only)
        slot_mask = torch.zeros(0, 0, dtype=torch.bool)  # ancestor-or-self among the expanded candidates
        frontier = [0]
        for d in range(max_depth):
            if not frontier or (d > 0 and max(score[c] for c in frontier) < LOG_MIN_PROB):
                break
            used, k = len(slot_of), len(frontier)
            if used + k > ctx.max_nodes:  # the drafter's tree mask must fit where the target's does
                break
            rows = torch.zeros(k, used + k, dtype=torch.bool)
            for i, c in enumerate(frontier):
                if parent[c] >= 0:
                    rows[i, :used] = slot_mask[slot_of[parent[c]]]
                rows[i, used + i] = True
            slot_mask = torch.cat([torch.cat([slot_mask, torch.zeros(used, k, dtype=torch.bool)], 1), rows], 0)
            for i, c in enumerate(frontier):
                slot_of[c] = used + i
            logits = self._forward(cache, base, used, torch.tensor([token[c] for c in frontier]), d, rows)
            logp, top = logits.float().log_softmax(-1).topk(spec.top_k, dim=-1)  # [k, top_k]
            frontier = add_children(frontier, logp, top, parent, token, score, depth)
        return select_tree(parent, token, score, depth, budget)


def add_children(frontier: list[int], top_logp: torch.Tensor, top_tokens: torch.Tensor, parent: list[int],
                 token: list[int], score: list[float], depth: list[int]) -> list[int]:
    """One level of dynamic growth: every frontier node c (row i) gets a child per column of top_tokens [k, top_k]
    (token ids) with cumulative score score[c] + top_logp[i, r]; appended to the candidate lists. Returns the next
    frontier: the top_k likeliest new candidates."""
    new = []
    for i, c in enumerate(frontier):
        for r in range(top_tokens.shape[1]):
            parent.append(c)
            token.append(int(top_tokens[i, r]))
            score.append(score[c] + float(top_logp[i, r]))
            depth.append(depth[c] + 1)
            new.append(len(token) - 1)
    return sorted(new, key=lambda c: -score[c])[: top_tokens.shape[1]]


def select_tree(parent: list[int], token: list[int], score: list[float], depth: list[int], budget: int) -> Draft:
    """The draft of the `budget` likeliest candidates (prefix-closed, BFS order) of a grown candidate set.

    Candidate 0 is the root; parent[c] < c; score = cumulative log-probability (never above the parent's).
    """
    order = sorted(range(1, len(token)), key=lambda c: (-score[c], depth[c], c))
    chosen = {0}
    for c in order:
        if len(chosen) > budget:
            break
        if parent[c] in chosen:
            chosen.add(c)
    nodes = sorted(chosen, key=lambda c: (depth[c], -score[c], c))
    index = {c: i for i, c in enumerate(nodes)}
    tree = Tree.from_parents([-1] + [index[parent[c]] for c in nodes[1:]])
    return Draft(tree, torch.tensor([token[c] for c in nodes], dtype=torch.long))
