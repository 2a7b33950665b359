"""Tree growth, written once for every drafter that scores candidates depth by depth (graphs, heads, EAGLE).

A drafter supplies `expand(d, nodes, grown) -> log-probs [len(nodes), V]`: score the next token of each
candidate in `nodes` (all at depth d; node 0 is the root) and keep whatever state its children's expansion
will read (a KV slot, a head state). `grow` decides which candidates get expanded and which tokens they get:

- static tree (`Tree`): every node with children is expanded; child c takes its parent's rank-r token,
  r = tree.ranks[c]. The tree is first cut to the room the decode loop gives (`truncate`).
- dynamic tree (`DynamicTreeSpec`, EAGLE-2): each depth expands the `top_k` frontier candidates of highest
  cumulative log-probability, each proposing its `top_k` best next tokens; growth stops at `max_depth`, when
  `expand` returns None (no room left) or when even the likeliest frontier candidate is below MIN_PROB (rarely
  accepted, and every drafter forward costs real time on a CPU). The step's tree is the `budget` likeliest
  candidates: a prefix-closed set, since a child is never likelier than its parent.

`vocab` maps the drafter's vocabulary indices to token ids (heads that score a reduced draft vocabulary).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from speccomp.runtime.decode import Draft, DraftContext, truncate
from speccomp.runtime.tree import DynamicTreeSpec, Tree

MAX_DYNAMIC_DEPTH = 6  # EAGLE-2's default depth
MIN_PROB = 0.02  # stop expanding when the best frontier path is less likely than this
LOG_MIN_PROB = math.log(MIN_PROB)


@dataclass
class Grown:
    """The candidates grown so far: index 0 is the root, parent[c] < c, score = cumulative log-probability."""

    parent: list[int]
    token: list[int]
    depth: list[int]
    score: list[float] = field(default_factory=list)


def grow(tree, ctx: DraftContext, expand, vocab: torch.Tensor | None = None,
         max_depth: int = MAX_DYNAMIC_DEPTH) -> Draft:
    """The step's draft: `tree` (a Tree or a DynamicTreeSpec) filled by `expand` (see the module docstring)."""
    if isinstance(tree, DynamicTreeSpec):
        return _grow_dynamic(tree, ctx, expand, vocab, max_depth)
    tree, _ = truncate(tree, ctx.max_depth, ctx.max_nodes)
    depth = tree.depth.tolist()
    grown = Grown(list(tree.parents), [ctx.tokens[-1]] + [0] * (tree.size - 1), depth)
    for d in range(tree.max_depth):
        nodes = [u for u in range(tree.size) if depth[u] == d and tree.children[u]]
        logp = expand(d, nodes, grown)
        for i, u in enumerate(nodes):
            top = logp[i].topk(max(tree.ranks[c] for c in tree.children[u]) + 1).indices
            if vocab is not None:
                top = vocab[top]
            for c in tree.children[u]:
                grown.token[c] = int(top[tree.ranks[c]])
    return Draft(tree, torch.tensor(grown.token, dtype=torch.long))


def _grow_dynamic(spec: DynamicTreeSpec, ctx: DraftContext, expand, vocab, max_depth: int) -> Draft:
    budget = min(spec.budget, ctx.max_nodes - 1)
    grown = Grown([-1], [ctx.tokens[-1]], [0], [0.0])
    frontier = [0]
    for d in range(min(max_depth, ctx.max_depth, budget)):
        logp = expand(d, frontier, grown)
        if logp is None:
            break
        top_p, top = logp.float().topk(spec.top_k, dim=-1)  # [k, top_k]
        frontier = add_children(frontier, top_p, top if vocab is None else vocab[top], grown)
        if max(grown.score[c] for c in frontier) < LOG_MIN_PROB:
            break
    return select_tree(grown, budget)


def add_children(frontier: list[int], top_logp: torch.Tensor, top_tokens: torch.Tensor, grown: Grown) -> list[int]:
    """One level of dynamic growth: every frontier candidate c (row i) gets a child per column of top_tokens
    [k, top_k] (token ids) scored score[c] + top_logp[i, r]. Returns the next frontier: the top_k likeliest."""
    new = []
    logp, tokens = top_logp.tolist(), top_tokens.tolist()
    for i, c in enumerate(frontier):
        for r in range(len(tokens[i])):
            grown.parent.append(c)
            grown.token.append(tokens[i][r])
            grown.score.append(grown.score[c] + logp[i][r])
            grown.depth.append(grown.depth[c] + 1)
            new.append(len(grown.token) - 1)
    return sorted(new, key=lambda c: -grown.score[c])[: top_tokens.shape[1]]


def select_tree(grown: Grown, budget: int) -> Draft:
    """The draft of the `budget` likeliest candidates (prefix-closed, BFS order) of a grown candidate set."""
    score, depth, parent = grown.score, grown.depth, grown.parent
    order = sorted(range(1, len(grown.token)), key=lambda c: (-score[c], depth[c], c))
    chosen = {0}
    for c in order:
        if len(chosen) > budget:
            break
        if parent[c] in chosen:
            chosen.add(c)
    nodes = sorted(chosen, key=lambda c: (depth[c], -score[c], c))
    index = {c: i for i, c in enumerate(nodes)}
    tree = Tree.from_parents([-1] + [index[parent[c]] for c in nodes[1:]])
    return Draft(tree, torch.tensor([grown.token[c] for c in nodes], dtype=torch.long))


def ancestor_rows(nodes: list[int], grown: Grown, slot: dict[int, int], used: int) -> torch.Tensor:
    """Attention rows [k, used + k] for scoring `nodes` in scratch slots used..used+k-1: each sees the slots of
    its expanded ancestors (`slot`: candidate -> scratch slot) and itself. Fills slot[c] for the new nodes."""
    rows = torch.zeros(len(nodes), used + len(nodes), dtype=torch.bool)
    for i, c in enumerate(nodes):
        a = grown.parent[c]
        while a >= 0 and a in slot:
            rows[i, slot[a]] = True
            a = grown.parent[a]
        rows[i, used + i] = True
        slot[c] = used + i
    return rows
