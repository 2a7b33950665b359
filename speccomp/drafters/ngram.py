"""Drafters that need no model and no training: they guess from text the decode has already seen.

NGramDrafter (prompt lookup decoding, as HF's `prompt_lookup_num_tokens`, but as a tree):
    the last few tokens (ending at the root) occurred earlier -> what followed them then is the
    draft. Every earlier occurrence, most recent first, is one branch; branches merge into a trie.

TokenRecyclingDrafter (Luo et al. 2024, "Turning Trash into Treasure"):
    the target's top-k predictions at *every* verified node, accepted or not, are kept in an
    adjacency table adj[token] -> top-k next tokens. A draft is a static tree template filled by
    BFS: the rank-r child of a node with token t gets adj[t][r]. Plus, when prompt lookup finds
    a match, that continuation as an extra branch (a simple version of the paper's hybrid).

SuffixDrafter (SuffixDecoding, Oliaro et al. 2024): the likeliest continuations of the text's longest
    recurring suffix, counted over the prompt, the reply so far and earlier replies of the same drafter
    (speccomp/drafters/suffix.py, shared with the engine).
All three drafts are deterministic (probs=None), so they are lossless under greedy and under
rejection-sampling acceptance alike. Nodes come out in BFS order (parents before children,
shallow before deep), so cutting a draft to its first `max_nodes` nodes keeps a valid tree.
"""
from __future__ import annotations

import inspect
import torch

from speccomp.runtime.calls import as_int, as_number
from speccomp.errors import OptionError, OptionTypeError
from speccomp.drafters.lookup import NGramIndex, Trie, fill_template, recycle
from speccomp.drafters.suffix import SuffixDecoder
from speccomp.runtime.decode import Draft, DraftContext, Drafter, check_tree_kind
from speccomp.runtime.sampling import top_ids
from speccomp.runtime.tree import AutoTreeSpec, DynamicTreeSpec, Tree, tree_option

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
    value = as_int(name, value, f"pass an int >= {minimum}")
    if value < minimum:
        raise OptionError(name, value, f"must be >= {minimum}", f"pass an int >= {minimum}")
    return value


def _draft(trie: Trie, max_depth: int, max_nodes: int) -> Draft:
    parents, tokens = trie.bfs(max_depth, max_nodes)
    return Draft(Tree.from_parents(parents), torch.tensor(tokens, dtype=torch.long))  # ranks: insertion order


class NGramDrafter(Drafter):
    """Prompt lookup as a tree.

    max_ngram, min_ngram  n-gram lengths tried, longest first: the last n tokens (ending at the
                          root) are looked up among earlier text. Longer matches are more reliable;
                          shorter ones only fill branches the longer ones left free.
    num_branches          earlier occurrences used per step (each adds a branch unless its
                          continuation is already in the trie), most recent first.
    max_depth             tokens drafted after each occurrence."""

    name = "ngram"
    observe_optional = True  # nothing to observe: its index catches up on the text at the next propose

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, num_branches: int = 4, max_depth: int = 8):
        self.max_ngram = _int_option("max_ngram", max_ngram, 1)
        self.min_ngram = _int_option("min_ngram", min_ngram, 1)
        if self.max_ngram < self.min_ngram:
            raise OptionError("max_ngram", max_ngram, f"must be >= min_ngram ({min_ngram})")
        self.num_branches = _int_option("num_branches", num_branches, 1)
        self.max_depth = _int_option("max_depth", max_depth, 1)
        self.lookup = NGramIndex(self.max_ngram, self.min_ngram)
        self.options = dict(max_ngram=self.max_ngram, min_ngram=self.min_ngram, num_branches=self.num_branches,
                            max_depth=self.max_depth)

    def fresh(self) -> "NGramDrafter":
        return NGramDrafter(**self.options)

    def begin(self, prompt: list[int]) -> None:
        self.lookup.begin(prompt)

    def propose(self, ctx: DraftContext) -> Draft:
        depth = min(self.max_depth, ctx.max_depth)
        trie = Trie(ctx.tokens[-1])
        if depth > 0:
            self.lookup.add_branches(trie, ctx.tokens, self.num_branches, depth)
        return _draft(trie, depth, ctx.max_nodes)  # no match: root only


class TokenRecyclingDrafter(Drafter):
    """Token Recycling: adjacency table of the target's past top-k guesses, expanded over a static tree.

    top_k           candidates kept per token (the template may use ranks 0..top_k-1).
    tree            static template: a Medusa-style choice list, an int k (chain) or a Tree;
                    default `DEFAULT_RECYCLING_TREE` (24 drafts, depth 6; with top_k < 6 its nodes of the ranks
                    top_k keeps).
    ngram_branches  prompt-lookup continuations added as extra branches (0: pure Token Recycling).
    max_ngram, min_ngram, ngram_depth   the prompt lookup's options (see NGramDrafter).
    persist         keep the table across generations (as the paper does), one table for every row of a
                    batch and every request served. Default False: every generation starts empty, so its
                    speed does not depend on earlier calls."""

    name = "token_recycling"
    trees = ("static",)
    # a skipped observe leaves the table without that step's top-k (later drafts may be staler, and the target
    # verifies every one of them); the n-gram branch reads the text at the next propose, missing nothing
    observe_optional = True

    def __init__(self, top_k: int = 8, tree=None, ngram_branches: int = 1, max_ngram: int = 4, min_ngram: int = 1,
                 ngram_depth: int = 8, persist: bool = False):
        self.top_k = top_k = _int_option("top_k", top_k, 1)
        if tree is not None:
            spec = tree_option(tree)
        else:  # the default, cut to the ranks top_k keeps (all of them from top_k = 6 on)
            spec = Tree.from_choices([c for c in DEFAULT_RECYCLING_TREE if max(c) < top_k])
        self.tree = spec
        if isinstance(spec, (DynamicTreeSpec, AutoTreeSpec)):
            raise OptionError("tree", tree, "token_recycling needs a static tree", "a choice list or an int k")
        widest = max(spec.ranks)
        if widest >= top_k:
            raise OptionError("tree", tree if tree is not None else "default", f"uses sibling rank {widest} but "
                              f"top_k={top_k} keeps ranks 0..{top_k - 1}", f"use top_k >= {widest + 1} or a narrower tree")
        self.ngram_branches = _int_option("ngram_branches", ngram_branches, 0)
        ng = self.ngram = NGramDrafter(max_ngram, min_ngram, max(self.ngram_branches, 1),
                                       _int_option("ngram_depth", ngram_depth, 1))
        if not isinstance(persist, bool):
            raise OptionTypeError("persist", persist, "must be True or False")
        self.persist = persist
        self.adj: dict[int, list[int]] = {}  # token -> the target's top-k next tokens, best first
        self.max_siblings = top_k
        self.options = dict(top_k=top_k, ngram_branches=self.ngram_branches, max_ngram=ng.max_ngram,
                            min_ngram=ng.min_ngram, ngram_depth=ng.max_depth, persist=persist)

    def with_tree(self, tree) -> "TokenRecyclingDrafter":
        """The same options drafting `tree` (a fresh table)."""
        check_tree_kind(self, tree)
        return TokenRecyclingDrafter(tree=tree, **self.options)

    def fresh(self) -> "TokenRecyclingDrafter":
        """One batch row's drafter. With persist, every row reads and writes this drafter's table (so batches and
        served requests learn from each other and from single calls, as they do one after another); otherwise a
        table of its own. Sharing is lossless: the target verifies every draft."""
        new = self.with_tree(self.tree)
        if self.persist:
            new.adj = self.adj
        return new

    def begin(self, prompt: list[int]) -> None:
        if not self.persist:
            self.adj = {}
        if self.ngram_branches:
            self.ngram.begin(prompt)

    def propose(self, ctx: DraftContext) -> Draft:
        trie = Trie(ctx.tokens[-1])
        fill_template(trie, self.tree.parents, self.tree.ranks, self.adj)
        if self.ngram_branches and ctx.max_depth > 0:
            self.ngram.lookup.add_branches(trie, ctx.tokens, self.ngram_branches, min(self.ngram.max_depth, ctx.max_depth))
        return _draft(trie, ctx.max_depth, ctx.max_nodes)

    def observe(self, draft: Draft, path: list[int], target_logits: torch.Tensor) -> None:
        top = top_ids(target_logits, self.top_k).tolist()
        recycle(self.adj, draft.tokens.tolist(), path, top)


class SuffixDrafter(Drafter):
    """Suffix decoding as a tree (speccomp/drafters/suffix.py).

    max_match   longest suffix of the text looked up (tokens)
    max_depth   deepest draft
    budget      most draft nodes per step
    min_prob    a continuation seen in fewer than this share of the occurrences (times its parent's) is not drafted
    memory      trie nodes kept of earlier generations' texts (prompt + reply), oldest dropped first; 0: none"""

    name = "suffix"
    observe_optional = True  # nothing to observe: its index catches up on the text at the next propose

    def __init__(self, max_match: int = 16, max_depth: int = 8, budget: int = 16, min_prob: float = 0.1,
                 memory: int = 100_000):
        ints = {k: _int_option(k, v, lo) for k, v, lo in (("max_match", max_match, 1), ("max_depth", max_depth, 1),
                                                           ("budget", budget, 1), ("memory", memory, 0))}
        min_prob = as_number("min_prob", min_prob, "e.g. min_prob=0.1")  # numpy and 0-d tensor numbers too
        if not 0 < min_prob <= 1:
            raise OptionError("min_prob", min_prob, "must be a probability in (0, 1]", "e.g. min_prob=0.1")
        self.options = dict(ints, min_prob=min_prob)
        self.decoder = SuffixDecoder(**self.options)

    def fresh(self) -> "SuffixDrafter":
        """A drafter of its own for one row of a batch: it reads this one's memory of past texts and adds its own
        text to it when the batch lets the row go (finish)."""
        new = SuffixDrafter(**{**self.options, "memory": 0})
        new.decoder, new.options = self.decoder.row(), dict(self.options)
        return new

    def finish(self, text: list[int]) -> None:
        self.decoder.finish(text)

    def begin(self, prompt: list[int]) -> None:
        self.decoder.begin(prompt)

    def propose(self, ctx: DraftContext) -> Draft:
        parents, tokens = self.decoder.propose(ctx.tokens, ctx.max_depth, ctx.max_nodes)
        return Draft(Tree.from_parents(parents), torch.tensor(tokens, dtype=torch.long))


def _make(cls, options: dict):
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise OptionError("drafter_options", {k: options[k] for k in unknown}, f"unknown {cls.name} options {unknown}",
                          f"accepted options: {accepted}")  # the unknown ones alone: not a tree the caller never gave
    return cls(**options)


def make_ngram(**options) -> NGramDrafter:
    """The "ngram" drafter: options max_ngram, min_ngram, num_branches, max_depth."""
    return _make(NGramDrafter, options)


def make_token_recycling(**options) -> TokenRecyclingDrafter:
    """The "token_recycling" drafter: options top_k, tree, ngram_branches, max_ngram, min_ngram,
    ngram_depth, persist."""
    return _make(TokenRecyclingDrafter, options)


def make_suffix(**options) -> SuffixDrafter:
    """The "suffix" drafter: options max_match, max_depth, budget, min_prob, memory."""
    return _make(SuffixDrafter, options)
