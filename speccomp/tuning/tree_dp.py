"""The tree that maximises expected accepted tokens, by dynamic programming (Sequoia's idea).

Model (positional acceptance, as in Sequoia, with a depth index): a node at depth d-1 that is on
the accepted path has its rank-r child accepted with probability p[d-1][r] (row d-1 of `p` is
depth d, column r is the drafter's r-th candidate). Under greedy acceptance the events "rank r is
the target's token" are disjoint across siblings (a drafter's candidates are distinct tokens), so
a node is on the accepted path with probability equal to the product of p over its path, and

    E[tokens per step] = 1 + sum over draft nodes of prod_{edges (d, r) on its path} p[d-1][r]

(the 1 is the bonus token the target adds after the accepted path). The tree's children are ranked
0..k-1 in order: a node's rank-r child exists only if ranks 0..r-1 do (a drafter's r-th
candidate), so a tree is an ordered tree and its choice list follows from its shape.

Recurrence (m nodes counting the subtree's own root; a node at depth d, depth limit D, K ranks):

    F(d, 1) = 1;   F(D, m > 1) = impossible
    F(d, m) = 1 + G(d, 0, m - 1)
    G(d, r, 0) = 0;   G(d, K, m > 0) = impossible
    G(d, r, m) = max_{1 <= s <= m} p[d][r] * F(d + 1, s) + G(d, r + 1, m - s)

F(d, m) is the best value of an m-node subtree hanging from a node at depth d, in units of "that
node is accepted"; G(d, r, m) places m nodes in the subtrees of the children of rank r, r+1, ...
(the rank-r child takes s of them). F(0, n) is the best expected number of tokens per step for
a tree of exactly n nodes (root included) and depth <= D. Cost O(D K N^2) for all n <= N at once.
The arithmetic is plain Python, so `fractions.Fraction` tables give exact optima (the tests use
that to compare with brute force).
"""
from __future__ import annotations

from dataclasses import dataclass

from speccomp.runtime.tree import Tree


@dataclass(frozen=True)
class TreeSolution:
    """The best tree of `size` nodes (root included): its expected tokens per step and choice list."""

    size: int
    value: object  # float or Fraction: 1 + sum of path products
    choices: list  # Medusa-style choice list (root omitted); [] for the root-only tree
    max_depth: int

    def tree(self) -> Tree:
        return Tree.from_parents((-1,)) if not self.choices else Tree.from_choices(self.choices)


def _table(p) -> list[list]:
    rows = [list(row) for row in p]
    if not rows or not any(rows):
        raise ValueError("the acceptance table p needs at least one depth row with at least one rank")
    for d, row in enumerate(rows):
        for r, x in enumerate(row):
            if not 0 <= x <= 1:
                raise ValueError(f"p[{d}][{r}] = {x} is not a probability in [0, 1]")
    return rows


def expected_accepted(tree, p):
    """E[tokens per step] of `tree` (a Tree or a choice list) under the acceptance table `p`.

    Straight from the definition: 1 + sum over draft nodes of the product of p along the node's path.
    Ranks or depths outside `p` have probability 0.
    """
    rows = [list(row) for row in p]
    choices = tree.choices if isinstance(tree, Tree) else tree
    total = 1
    for path in choices:
        prob = 1
        for d, r in enumerate(path):
            prob = prob * (rows[d][r] if d < len(rows) and r < len(rows[d]) else 0)
        total = total + prob
    return total


def optimal_trees(p, max_nodes: int, max_depth: int | None = None) -> list[TreeSolution | None]:
    """The best tree for every size n = 1..max_nodes (index n - 1); None where no tree of exactly n
    nodes fits the depth limit and the K = max row length ranks of `p`.

    p          p[d][r]: probability that the rank-r child of an accepted depth-d node is accepted
               (rows: depth 1, 2, ...; ragged rows are padded with 0).
    max_depth  deepest draft allowed (default: the number of rows of p).
    """
    rows = _table(p)
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes must be an int >= 1, got {max_nodes!r}")
    D = len(rows) if max_depth is None else min(int(max_depth), len(rows))
    if D < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    K = max(len(row) for row in rows)
    F, choice = _solve([row + [0] * (K - len(row)) for row in rows], D, K, max_nodes)
    out = []
    for n in range(1, max_nodes + 1):
        if F[0][n] is None:
            out.append(None)
            continue
        choices: list = []
        depth = _build(choice, 0, n, (), choices)
        choices.sort(key=lambda c: (len(c), c))
        out.append(TreeSolution(n, F[0][n], choices, depth))
    return out


def _solve(rows: list[list], D: int, K: int, N: int) -> tuple[list, list]:
    """The recurrence (module docstring): F[d][m] for m = 0..N (index 0 unused; None = no such subtree), and
    choice[d][r][m] = nodes given to the rank-r child when ranks r.. of a depth-d node take m nodes."""
    F = [[None] * (N + 1) for _ in range(D + 1)]
    choice = [[[0] * N for _ in range(K)] for _ in range(D)]
    F[D][1] = 1
    for d in range(D - 1, -1, -1):
        below = F[d + 1]
        # G for rank r + 1 (starting past the last rank: only the empty forest)
        nxt = [0] + [None] * (N - 1)
        for r in range(K - 1, -1, -1):
            q = rows[d][r]
            cur = [0] + [None] * (N - 1)
            ch = choice[d][r]
            for m in range(1, N):
                best, arg = None, 0
                for s in range(1, m + 1):
                    f, rest = below[s], nxt[m - s]
                    if f is None or rest is None:
                        continue
                    v = q * f + rest
                    if best is None or v > best:
                        best, arg = v, s
                cur[m], ch[m] = best, arg
            nxt = cur
        for m in range(1, N + 1):
            g = nxt[m - 1]
            F[d][m] = None if g is None else 1 + g
    return F, choice


def _build(choice: list, d: int, m: int, prefix: tuple, out: list) -> int:
    """Append the choices of the best m-node subtree under `prefix` (a depth-d node); return its depth below d."""
    rem, r, deepest = m - 1, 0, 0
    while rem > 0:
        s = choice[d][r][rem]
        child = prefix + (r,)
        out.append(list(child))
        deepest = max(deepest, 1 + _build(choice, d + 1, s, child, out))
        rem -= s
        r += 1
    return deepest


def best_within(solutions: list[TreeSolution | None], budget: int) -> TreeSolution:
    """The best of `solutions` with at most `budget` nodes (a budget, rather than an exact size)."""
    found = [s for s in solutions[:budget] if s is not None]
    if not found:
        raise ValueError(f"no tree of at most {budget} nodes")
    return max(found, key=lambda s: (s.value, -s.size))
