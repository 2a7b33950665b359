"""Text lookup for the model-free drafters, in plain Python (no torch: the exported engine's
torch-free runtime, speccomp/engine/runtime.py, drafts with the same code as drafters_ngram.py).

    Trie          draft paths under one root; equal prefixes share nodes; BFS order out
    NGramIndex    prompt lookup: where did the last n tokens occur before, and what followed
    fill_template Token Recycling: expand a static tree template from an adjacency table
    recycle       Token Recycling: update the table from every verified node's top-k
    merge_trees   SpecInfer's token-tree merge of several drafters' trees (speccomp/drafters/merge.py)
    shared_prefix how much of a drafter's cached text the text so far still holds (a draft model's rollback)
"""
from __future__ import annotations

from collections import defaultdict
from itertools import takewhile

# Occurrences of one n-gram looked at per step. Frequent short n-grams ("the") can occur thousands
# of times; the most recent few are the useful ones, and this keeps a step O(1) in the text length.
MAX_SCAN = 64


class Trie:
    """Draft paths under one root; equal prefixes share nodes. Node 0 is the root."""

    def __init__(self, root: int):
        self.tokens = [root]
        self.kids: list[dict[int, int]] = [{}]  # node -> {token: child}, in insertion order

    def child(self, node: int, token: int) -> int:
        c = self.kids[node].get(token)
        if c is None:
            c = len(self.tokens)
            self.tokens.append(token)
            self.kids.append({})
            self.kids[node][token] = c
        return c

    def insert(self, path: list[int]) -> bool:
        """Add a root-to-node path of tokens; True if it created any node."""
        before, node = len(self.tokens), 0
        for t in path:
            node = self.child(node, t)
        return len(self.tokens) > before

    def bfs(self, max_depth: int, max_nodes: int) -> tuple[list[int], list[int]]:
        """(parents, tokens) of the trie in BFS order (siblings in insertion order), cut at
        max_depth and max_nodes. BFS order keeps parents before children, so any prefix is a tree."""
        order, parents = self.bfs_nodes(max_depth, max_nodes)
        return parents, [self.tokens[u] for u in order]

    def bfs_nodes(self, max_depth: int, max_nodes: int) -> tuple[list[int], list[int]]:
        """(trie nodes, parents) in the order `bfs` gives."""
        order, parents, depth = [0], [-1], [0]
        i = 0
        while i < len(order) and len(order) < max_nodes:
            if depth[i] < max_depth:
                for c in self.kids[order[i]].values():
                    if len(order) >= max_nodes:
                        break
                    order.append(c)
                    parents.append(i)
                    depth.append(depth[i] + 1)
            i += 1
        return order, parents


class NGramIndex:
    """Every n-gram (min_ngram <= n <= max_ngram) of the text so far -> where it ended."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.begin([])

    def begin(self, tokens: list[int]) -> None:
        # n-gram tuple -> end positions (index of its last token), ascending. Only positions with a
        # next token are indexed, so every hit has a continuation and the root's own n-gram (which
        # ends at the last position) never matches itself.
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self.indexed = 0  # positions [0, indexed) are in the index
        self.extend(list(tokens))

    def extend(self, tokens: list[int]) -> None:
        end = len(tokens) - 1  # the last token has no successor yet
        if end < self.indexed:  # not a continuation of what we indexed (reused without begin)
            self.index.clear()
            self.indexed = 0
        for i in range(self.indexed, end):
            for n in range(self.min_ngram, min(self.max_ngram, i + 1) + 1):
                self.index[tuple(tokens[i - n + 1 : i + 1])].append(i)
        self.indexed = max(self.indexed, end)

    def matches(self, tokens: list[int]):
        """End positions of earlier occurrences of the suffix n-grams: longest n first, then most recent."""
        self.extend(tokens)
        seen = set()  # an occurrence of the 4-gram is also one of the 3-gram: use it once
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            ends = self.index.get(tuple(tokens[len(tokens) - n :]), ())
            for e in reversed(ends[-MAX_SCAN:]):
                if e not in seen:
                    seen.add(e)
                    yield e

    def add_branches(self, trie: Trie, tokens: list[int], branches: int, depth: int) -> None:
        """Insert up to `branches` continuations that are not already in `trie`."""
        added = 0
        for e in self.matches(tokens):
            if added >= branches:
                break
            added += trie.insert(tokens[e + 1 : e + 1 + depth])


def fill_template(trie: Trie, parents, ranks, adj: dict[int, list[int]]) -> None:
    """Grow `trie` (holding only its root) along a static template: the rank-r child of a node with
    token t gets adj[t][r]. A token with no row (never verified) stops its branch."""
    node_of = [0] + [None] * (len(parents) - 1)  # template node -> trie node; None: pruned
    for i in range(1, len(parents)):  # topological: the parent is filled (or pruned) first
        parent = node_of[parents[i]]
        if parent is None:
            continue
        row = adj.get(trie.tokens[parent])
        r = ranks[i]
        if row is not None and r < len(row):
            node_of[i] = trie.child(parent, row[r])  # top-k rows hold distinct tokens: no duplicate siblings


def recycle(adj: dict[int, list[int]], tokens: list[int], path: list[int], top: list[list[int]]) -> None:
    """Store every verified node's top-k next tokens, rejected nodes included: that is the recycling.
    The accepted path is written last so that, when a token sits at several nodes, its real context wins."""
    on_path = set(path)
    for i in [i for i in range(len(tokens)) if i not in on_path] + list(path):
        adj[tokens[i]] = top[i]


def merge_trees(root: int, drafts: list[tuple[list[int], list[int]]], max_depth: int, max_nodes: int):
    """SpecInfer's token-tree merge: every draft (parents, tokens) from the same root into one trie (equal token
    paths share a node), cut in BFS order to max_depth / max_nodes. Returns (parents, tokens, where): where[j][i]
    is the merged node of draft j's node i, None when the cut dropped it (a cut draft stays prefix-closed)."""
    trie, wheres = Trie(root), []
    for parents, tokens in drafts:
        where = [0]
        for i in range(1, len(parents)):
            where.append(trie.child(where[parents[i]], tokens[i]))
        wheres.append(where)
    order, parents = trie.bfs_nodes(max_depth, max_nodes)
    index = {node: i for i, node in enumerate(order)}
    return parents, [trie.tokens[u] for u in order], [[index.get(w) for w in where] for where in wheres]


def own_view(where: list, path: list[int]) -> tuple[list[int], list[int], list[int]]:
    """One draft's part of a verified merged tree: (its kept nodes, their merged nodes, the accepted merged `path`
    as far as it runs through them, in kept-node positions). Equal sibling tokens share a merged node: the first
    such node stands for it."""
    own = [i for i, m in enumerate(where) if m is not None]
    merged = [where[i] for i in own]
    index: dict[int, int] = {}
    for position, m in enumerate(merged):
        index.setdefault(m, position)
    return own, merged, [index[m] for m in takewhile(index.__contains__, path)]


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
