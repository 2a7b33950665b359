"""Tree growth, written once for every drafter that scores candidates depth by depth (graphs, heads, EAGLE),
in plain Python so that the torch runtime and the torch-free engine (speccomp/engine/runtime.py) share it.

A drafter supplies `expand(d, nodes, grown, k) -> (top_logp, top_ids)`: for each candidate in `nodes` (all at
depth d; node 0 is the root) the log-probabilities and token ids of its k likeliest next tokens, best first
(nested lists or arrays [len(nodes)][k]); it keeps whatever state the children's expansion reads (a KV slot, a
head state). The functions here decide which candidates get expanded and which tokens they get:

- `grow_static(parents, ranks, root, expand)`: every node with children is expanded; child c takes its parent's
  rank-r token, r = ranks[c]. The caller has already cut the tree to the room the decode loop gives.
- `grow_dynamic(budget, top_k, root, expand, max_depth)` (EAGLE-2): each depth expands the `top_k` frontier
  candidates of highest cumulative log-probability, each proposing its `top_k` best next tokens; growth stops
  at `max_depth`, when `expand` returns None (no room left) or when even the likeliest frontier candidate is
  below MIN_PROB (rarely accepted, and every drafter forward costs real time on a CPU). The step's tree is the
  `budget` likeliest candidates: a prefix-closed set, since a child is never likelier than its parent.

`grow(tree, ctx, expand, max_depth)` is the torch runtime's entry: a Tree or DynamicTreeSpec in, a Draft out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from speccomp.runtime.topk import top_logp

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


def grow_static(parents: list[int], ranks: list[int], root: int, expand) -> list[int]:
    """The tokens of a static tree (parents in topological order, sibling ranks), root first."""
    n = len(parents)
    depth, children = [0] * n, [[] for _ in range(n)]
    for c in range(1, n):
        depth[c] = depth[parents[c]] + 1
        children[parents[c]].append(c)
    grown = Grown(list(parents), [root] + [0] * (n - 1), depth)
    k = max(ranks) + 1
    for d in range(max(depth)):
        nodes = [u for u in range(n) if depth[u] == d and children[u]]
        _, ids = expand(d, nodes, grown, k)
        for i, u in enumerate(nodes):
            for c in children[u]:
                grown.token[c] = int(ids[i][ranks[c]])
    return grown.token


def grow_dynamic(budget: int, top_k: int, root: int, expand, max_depth: int) -> tuple[list[int], list[int]]:
    """(parents, tokens) of the `budget` likeliest candidates grown from `root` (see the module docstring)."""
    grown = Grown([-1], [root], [0], [0.0])
    frontier = [0]
    for d in range(min(max_depth, budget)):
        top = expand(d, frontier, grown, top_k)
        if top is None:
            break
        frontier = add_children(frontier, top, grown)
        if max(grown.score[c] for c in frontier) < LOG_MIN_PROB:
            break
    return select_tree(grown, budget)


def add_children(frontier: list[int], top, grown: Grown) -> list[int]:
    """One level of dynamic growth: every frontier candidate c (row i) gets a child per column of top = (logp, ids)
    [k][top_k], scored score[c] + logp[i][r]. Returns the next frontier: the top_k likeliest new candidates."""
    logp, ids = top
    new = []
    for i, c in enumerate(frontier):
        for r in range(len(ids[i])):
            grown.parent.append(c)
            grown.token.append(int(ids[i][r]))
            grown.score.append(grown.score[c] + float(logp[i][r]))
            grown.depth.append(grown.depth[c] + 1)
            new.append(len(grown.token) - 1)
    return sorted(new, key=lambda c: -grown.score[c])[: len(ids[0])]


def select_tree(grown: Grown, budget: int) -> tuple[list[int], list[int]]:
    """(parents, tokens) of the `budget` likeliest candidates (prefix-closed, BFS order) of a grown set."""
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
    return [-1] + [index[parent[c]] for c in nodes[1:]], [grown.token[c] for c in nodes]


def siblings_in_rank_order(parents, ranks) -> bool:
    """Whether every node's children come in ascending rank order: a drafter that samples a static tree's children
    in rank order hands the sampler their distributions in that order, which must be the order it tests them in
    (Tree.from_choices trees always are). Both runtimes' draft models ask it once per tree."""
    last: dict[int, int] = {}
    for parent, rank in zip(list(parents)[1:], list(ranks)[1:]):
        if rank <= last.get(parent, -1):
            return False
        last[parent] = rank
    return True


def cut(parents: list[int], ranks: list[int], max_depth: int, max_nodes: int) -> tuple[list[int], list[int]]:
    """A static tree's nodes at depth <= max_depth, the first max_nodes of them: (parents, ranks) renumbered."""
    depth = [0] * len(parents)
    for c in range(1, len(parents)):
        depth[c] = depth[parents[c]] + 1
    keep = [c for c in range(len(parents)) if depth[c] <= max_depth][:max_nodes]
    new = {old: i for i, old in enumerate(keep)}
    return [-1] + [new[parents[c]] for c in keep[1:]], [ranks[c] for c in keep]


def ancestor_rows(nodes: list[int], grown: Grown, slot: dict[int, int], used: int) -> list[list[bool]]:
    """Attention rows [k][used + k] for scoring `nodes` in scratch slots used..used+k-1: each sees the slots of its
    expanded ancestors (`slot`: candidate -> scratch slot) and itself. Fills slot[c]."""
    rows = [[False] * (used + len(nodes)) for _ in nodes]
    for i, c in enumerate(nodes):
        a = grown.parent[c]
        while a >= 0 and a in slot:
            rows[i][slot[a]] = True
            a = grown.parent[a]
        rows[i][used + i] = True
        slot[c] = used + i
    return rows


def state_expander(run, root_state):
    """`expand` for a drafter whose step maps (depth d, parent states [n, H], parent tokens [n]) to (states [n, H],
    top log-probs [n, top], top ids [n, top]), numpy in and out (Hydra's head step, on either runtime): a candidate's
    state is the output of its parent's step; the root's is `root_state` (the target's hidden state)."""
    import numpy as np

    out = {}

    def expand(d: int, nodes: list[int], grown: Grown, k: int):
        states = np.stack([root_state if c == 0 else out[grown.parent[c]] for c in nodes])
        z, logp, ids = run(d, states, np.array([grown.token[c] for c in nodes], dtype=np.int64))
        for i, c in enumerate(nodes):
            out[c] = z[i]
        return logp[:, :k].tolist(), ids[:, :k].tolist()

    return expand


def grow(tree, ctx, expand, max_depth: int = MAX_DYNAMIC_DEPTH):
    """The torch runtime's step draft: `tree` (a Tree or a DynamicTreeSpec) filled by `expand`."""
    import torch

    from speccomp.runtime.decode import Draft, truncate
    from speccomp.runtime.tree import Tree

    root = ctx.tokens[-1]
    if isinstance(tree, Tree):
        tree, _ = truncate(tree, ctx.max_depth, ctx.max_nodes)
        tokens = grow_static(list(tree.parents), list(tree.ranks), root, expand)
    else:
        budget = min(tree.budget, ctx.max_nodes - 1)
        parents, tokens = grow_dynamic(budget, tree.top_k, root, expand, min(max_depth, ctx.max_depth))
        tree = Tree.from_parents(parents)
    return Draft(tree, torch.tensor(tokens, dtype=torch.long))


def torch_top(logits, k: int):
    """expand's answer from a torch drafter's logits [n, V]: the top k log-probabilities and ids, best first. On the
    CPU the engine's own numpy (runtime/topk.py `top_logp`: one pass for the top k, the log-softmax at those k only),
    so both runtimes score candidates alike; elsewhere torch's log_softmax and topk."""
    if logits.device.type == "cpu" and not logits.requires_grad:
        logp, ids = top_logp(logits.float().numpy(), k)
    else:
        logp, ids = logits.float().log_softmax(-1).topk(k, dim=-1)
    return logp.tolist(), ids.tolist()
