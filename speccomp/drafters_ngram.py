"""Drafters that need no model and no training: they guess from text the decode has already seen.

NGramDrafter (prompt lookup decoding, as HF's `prompt_lookup_num_tokens`, but as a tree):
    the last few tokens (ending at the root) occurred earlier -> what followed them then is the
    draft. Every earlier occurrence, most recent first, is one branch; branches merge into a trie.

TokenRecyclingDrafter (Luo et al. 2024, "Turning Trash into Treasure"):
    the target's top-k predictions at *every* verified node, accepted or not, are kept in an
    adjacency table adj[token] -> top-k next tokens. A draft is a static tree template filled by
    BFS: the rank-r child of a node with token t gets adj[t][r]. Plus, when prompt lookup finds
    a match, that continuation as an extra branch (a simple version of the paper's hybrid).

Both drafts are deterministic (probs=None), so they are lossless under greedy and under
rejection-sampling acceptance alike. Nodes come out in BFS order (parents before children,
shallow before deep), so cutting a draft to its first `max_nodes` nodes keeps a valid tree.
"""
from __future__ import annotations

import inspect
from collections import defaultdict

import torch

from .speculative import Draft, DraftContext, Drafter
from .tree import AutoTreeSpec, DynamicTreeSpec, Tree, parse_tree_spec

# Occurrences of one n-gram looked at per step. Frequent short n-grams ("the") can occur thousands
# of times; the most recent few are the useful ones, and this keeps a step O(1) in the text length.
MAX_SCAN = 64

# Token Recycling's default template: 24 drafts, depth 6, wide near the root where the
# adjacency guesses are best (the paper's tree has ~80 nodes; on CPU every node costs compute).
DEFAULT_RECYCLING_TREE = [
    [0], [1], [2], [3], [4], [5],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [2, 0, 0],
    [0, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0],
    [0, 0, 0, 0, 0], [1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0],
]  # fmt: skip


def _int_option(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class _Trie:
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

    def draft(self, max_depth: int, max_nodes: int) -> Draft:
        """The trie in BFS order (siblings in insertion order), cut at max_depth and max_nodes."""
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
        tokens = torch.tensor([self.tokens[u] for u in order], dtype=torch.long)
        return Draft(Tree.from_parents(parents), tokens)  # ranks: sibling order = insertion order


class NGramDrafter(Drafter):
    """Prompt lookup as a tree.

    max_ngram, min_ngram  n-gram lengths tried, longest first: the last n tokens (ending at the
                          root) are looked up among earlier text. Longer matches are more reliable;
                          shorter ones only fill branches the longer ones left free.
    num_branches          earlier occurrences used per step (each adds a branch unless its
                          continuation is already in the trie), most recent first.
    max_depth             tokens drafted after each occurrence.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, num_branches: int = 4, max_depth: int = 8):
        self.max_ngram = _int_option("max_ngram", max_ngram, 1)
        self.min_ngram = _int_option("min_ngram", min_ngram, 1)
        if max_ngram < min_ngram:
            raise ValueError(f"max_ngram ({max_ngram}) must be >= min_ngram ({min_ngram})")
        self.num_branches = _int_option("num_branches", num_branches, 1)
        self.max_depth = _int_option("max_depth", max_depth, 1)
        self.begin([])

    def begin(self, prompt: list[int]) -> None:
        # n-gram tuple -> end positions (index of its last token), ascending. Only positions with a
        # next token are indexed, so every hit has a continuation and the root's own n-gram (which
        # ends at the last position) never matches itself.
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self.indexed = 0  # positions [0, indexed) are in the index
        self._extend(list(prompt))

    def _extend(self, tokens: list[int]) -> None:
        end = len(tokens) - 1  # the last token has no successor yet
        if end < self.indexed:  # not a continuation of what we indexed (drafter reused without begin)
            self.index.clear()
            self.indexed = 0
        for i in range(self.indexed, end):
            for n in range(self.min_ngram, min(self.max_ngram, i + 1) + 1):
                self.index[tuple(tokens[i - n + 1 : i + 1])].append(i)
        self.indexed = max(self.indexed, end)

    def matches(self, tokens: list[int]):
        """End positions of earlier occurrences of the suffix n-grams: longest n first, then most recent."""
        self._extend(tokens)
        seen = set()  # an occurrence of the 4-gram is also one of the 3-gram: use it once
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            ends = self.index.get(tuple(tokens[len(tokens) - n :]), ())
            for e in reversed(ends[-MAX_SCAN:]):
                if e not in seen:
                    seen.add(e)
                    yield e

    def add_branches(self, trie: _Trie, tokens: list[int], branches: int, depth: int) -> None:
        """Insert up to `branches` continuations that are not already in `trie`."""
        added = 0
        for e in self.matches(tokens):
            if added >= branches:
                break
            added += trie.insert(tokens[e + 1 : e + 1 + depth])

    def propose(self, ctx: DraftContext) -> Draft:
        depth = min(self.max_depth, ctx.max_depth)
        trie = _Trie(ctx.tokens[-1])
        if depth > 0:
            self.add_branches(trie, ctx.tokens, self.num_branches, depth)
        return trie.draft(depth, ctx.max_nodes)  # no match: root only


class TokenRecyclingDrafter(Drafter):
    """Token Recycling: adjacency table of the target's past top-k guesses, expanded over a static tree.

    top_k           candidates kept per token (the template may use ranks 0..top_k-1).
    tree            static template: a Medusa-style choice list, an int k (chain) or a Tree;
                    default `DEFAULT_RECYCLING_TREE` (24 drafts, depth 6).
    ngram_branches  prompt-lookup continuations added as extra branches (0: pure Token Recycling).
    max_ngram, min_ngram, ngram_depth   the prompt lookup's options (see NGramDrafter).
    persist         keep the table across generations (as the paper does). Default False: every
                    generation starts empty, so its speed does not depend on earlier calls.
    """

    name = "token_recycling"

    def __init__(
        self, top_k: int = 8, tree=None, ngram_branches: int = 1, max_ngram: int = 4, min_ngram: int = 1,
        ngram_depth: int = 8, persist: bool = False,
    ):
        self.top_k = _int_option("top_k", top_k, 1)
        spec = parse_tree_spec(DEFAULT_RECYCLING_TREE if tree is None else tree)  # TreeError on bad trees
        if isinstance(spec, (DynamicTreeSpec, AutoTreeSpec)):
            raise ValueError(f"token_recycling needs a static tree (a choice list or an int k), got tree={tree!r}")
        self.tree = spec
        widest = max(spec.ranks)
        if widest >= top_k:
            raise ValueError(
                f"the tree uses sibling rank {widest} but top_k={top_k} keeps ranks 0..{top_k - 1}; "
                f"use top_k >= {widest + 1} or a narrower tree"
            )
        self.ngram_branches = _int_option("ngram_branches", ngram_branches, 0)
        ngram_depth = _int_option("ngram_depth", ngram_depth, 1)
        self.ngram = NGramDrafter(max_ngram, min_ngram, max(self.ngram_branches, 1), ngram_depth)
        if not isinstance(persist, bool):
            raise ValueError(f"persist must be True or False, got {persist!r}")
        self.persist = persist
        self.adj: dict[int, list[int]] = {}  # token -> the target's top-k next tokens, best first

    def begin(self, prompt: list[int]) -> None:
        if not self.persist:
            self.adj = {}
        if self.ngram_branches:
            self.ngram.begin(prompt)

    def propose(self, ctx: DraftContext) -> Draft:
        trie = _Trie(ctx.tokens[-1])
        node_of = [0] + [None] * (self.tree.size - 1)  # template node -> trie node; None: pruned
        for i in range(1, self.tree.size):  # topological: the parent is filled (or pruned) first
            parent = node_of[self.tree.parents[i]]
            if parent is None:
                continue
            row = self.adj.get(trie.tokens[parent])
            r = self.tree.ranks[i]
            if row is not None and r < len(row):  # a token never verified has no row: stop here
                node_of[i] = trie.child(parent, row[r])  # top-k rows hold distinct tokens: no duplicate siblings
        if self.ngram_branches and ctx.max_depth > 0:
            self.ngram.add_branches(trie, ctx.tokens, self.ngram_branches, min(self.ngram.max_depth, ctx.max_depth))
        return trie.draft(ctx.max_depth, ctx.max_nodes)

    def observe(self, draft: Draft, path: list[int], target_logits: torch.Tensor) -> None:
        # Every node's top-k, rejected nodes included: that is the recycling. The accepted path is
        # written last so that, when a token sits at several nodes, its real context wins.
        top = target_logits.topk(min(self.top_k, target_logits.shape[-1]), dim=-1).indices.tolist()
        tokens = draft.tokens.tolist()
        on_path = set(path)
        for i in [i for i in range(len(tokens)) if i not in on_path] + list(path):
            self.adj[tokens[i]] = top[i]


def _make(cls, options: dict):
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"unknown {cls.name} options {unknown}; accepted options: {accepted}")
    return cls(**options)


def make_ngram(**options) -> NGramDrafter:
    """The "ngram" drafter: options max_ngram, min_ngram, num_branches, max_depth."""
    return _make(NGramDrafter, options)


def make_token_recycling(**options) -> TokenRecyclingDrafter:
    """The "token_recycling" drafter: options top_k, tree, ngram_branches, max_ngram, min_ngram,
    ngram_depth, persist."""
    return _make(TokenRecyclingDrafter, options)
