"""Merged drafters (SpecInfer's token-tree merge): several drafters propose, one tree is verified.

    speccomp.compile(model, drafter="hydra+token_recycling")

Each step every drafter drafts its own tree from the same root; the trees merge into one trie
(equal token paths share a node), which the target verifies in one forward. Different drafters
are right in different places: trained heads on new text, Token Recycling / prompt lookup where
the reply repeats itself or the prompt (numbers in a math answer, names, code), so the merged
tree is accepted deeper than either alone, for the cost of a few more verified nodes.

    hydra:  root - "The" - "answer"          merged: root - "The" - "answer"
                 \\ "So"                                  |       \\ "total"
    recycling: root - "The" - "total"                     \\ "So"

After verification every drafter sees its own tree again (its nodes, the part of the accepted
path that lies in its tree, the target's logits at its nodes), so a stateful drafter (Token
Recycling's table) learns from its own nodes as it would alone.

Lossless: the merged drafts are deterministic (every drafter here drafts by argmax / table
lookup, probs=None), and verification (greedy or SpecInfer's multi-draft rejection sampling)
is exact for any deterministic tree.

Rules, checked at compile time: at most one drafter that reads the model (heads, EAGLE, layer-skip /
early-exit graphs: they read the target's states or write its cache's scratch room); any number
of text drafters (ngram, token_recycling). Options go per drafter: drafter_options={"hydra":
{...}, "token_recycling": {"tree": [[0], [0, 0]]}}; `tree=` shapes the first drafter's tree. Token
Recycling after the first drafter defaults to a small 7-node tree (MERGED_RECYCLING_TREE).
"""
from __future__ import annotations

import dataclasses

import torch

from speccomp.drafters.lookup import merge_trees, own_view
from speccomp.errors import OptionError, OptionTypeError
from speccomp.runtime.calls import tightest_context
from speccomp.runtime.decode import READS, Draft, DraftContext, Drafter, restrict
from speccomp.runtime.tree import Tree

# Token Recycling's tree when it complements another drafter (its own default has 24 nodes): every node
# costs verify time on CPU. Beside Hydra's 5-node tree, small complements (a chain of 3, this tree, prompt
# lookup) ran within noise of each other and 24 nodes ran 13-15% slower (benchmarks/merged_trees.py on 4 and on
# 12 prompts, README)
MERGED_RECYCLING_TREE = [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


class MergedDrafter(Drafter):
    def __init__(self, drafters: list[Drafter], names: list[str]):
        if len(drafters) < 2:
            raise ValueError("a merged drafter needs at least two drafters, e.g. drafter='hydra+token_recycling'")
        model = [d.name for d in drafters if d.reads]
        if len(model) > 1:
            raise ValueError(f"merged drafters {model} all read the model (states or caches): at most one may")
        self.drafters, self.names = drafters, names
        self.name = "+".join(names)
        self.reads = tuple(r for r in READS if any(r in d.reads for d in drafters))
        self.graphs = tuple(g for d in drafters for g in d.graphs)
        self.light_graphs = all(d.light_graphs for d in drafters if d.graphs)
        self.tree = drafters[0].tree
        self.options = {n: dict(d.options) for n, d in zip(names, drafters)}
        self.target_passes = [p for d in drafters for p in d.target_passes]
        self.observe_optional = all(d.observe_optional for d in drafters)  # one skip skips every part's observe
        self.max_positions = tightest_context(drafters)  # a draft model's bounds the merge's text (check_context)
        self._last: list[tuple[Draft, list]] = []  # per drafter: its draft, and its node -> merged node (or None)

    def fresh(self) -> "MergedDrafter":
        return MergedDrafter([d.fresh() for d in self.drafters], self.names)

    def begin(self, prompt: list[int]) -> None:
        for d in self.drafters:
            d.begin(prompt)

    def finish(self, text: list[int]) -> None:
        for d in self.drafters:
            d.finish(text)

    def take_states(self, states: tuple) -> None:
        for d in self.drafters:
            if "path_states" in self.reads and "path_states" not in d.reads and "states" in d.reads:
                d.take_states(tuple(x[-1] for x in states))  # handed the whole path; it reads the newest
            elif "path_states" in d.reads or "states" in d.reads:
                d.take_states(states)

    def propose(self, ctx: DraftContext) -> Draft:
        # each part drafts its top tokens even when the target samples (a draft model would sample its tree): a
        # merged node may come from several parts, so it must be a point mass, which verification keeps exact
        ctx = ctx if ctx.sampler is None else dataclasses.replace(ctx, sampler=None)
        drafts = [d.propose(ctx) for d in self.drafters]
        for d, draft in zip(self.drafters, drafts):
            if draft.probs is not None:  # sampled drafts carry their distributions; a merged node has several
                raise ValueError(f"{d.name} drafted by sampling; merged trees need deterministic drafts")
        parents, tokens, wheres = merge_trees(ctx.tokens[-1], [(list(x.tree.parents), x.tokens.tolist()) for x in drafts],
                                              ctx.max_depth, ctx.max_nodes)  # within the loop's limits
        self._last = list(zip(drafts, wheres))
        return Draft(Tree.from_parents(parents), torch.tensor(tokens, dtype=torch.long))

    def observe(self, draft: Draft, path: list[int], target_logits: torch.Tensor) -> None:
        if draft.tree.size == 1:  # the runtime verified the root alone (last token): so would each drafter
            for d in self.drafters:
                d.observe(draft, path, target_logits)
            return
        for d, (own_draft, where) in zip(self.drafters, self._last):
            own, merged, own_path = own_view(where, path)
            sub, _ = restrict(own_draft.tree, own)  # prefix-closed: parents come first
            rows = torch.tensor(merged, device=target_logits.device)  # index_select: 5x faster than a list index
            d.observe(Draft(sub, own_draft.tokens[own]), own_path, target_logits.index_select(0, rows))


def split_names(drafter: str) -> list[str] | None:
    """["hydra", "token_recycling"] for "hydra+token_recycling"; None for a single name."""
    return drafter.split("+") if isinstance(drafter, str) and "+" in drafter else None


def check_merge(names: list[str], options: dict | None, tree, declared: dict) -> None:
    """Refuse a bad merge before anything is captured or loaded: names (`declared`: drafter name -> its class),
    the one-model-drafter rule, options per drafter, one tree for the first drafter (tree= or its options)."""
    drafter = "+".join(names)
    unknown = [n for n in names if n not in declared]
    if unknown or len(set(names)) != len(names) or "" in names:
        raise OptionError("drafter", drafter, "merge distinct drafter names" + (f" (unknown: {unknown})" if unknown else ""),
                          f"join names from {sorted(declared)} with '+', e.g. 'hydra+token_recycling'")
    model_drafters = [n for n in names if declared[n].reads]
    if len(model_drafters) > 1:
        text = sorted(n for n, cls in declared.items() if not cls.reads)
        raise OptionError("drafter", drafter, f"merges {model_drafters}: at most one drafter that reads the model "
                          "(they would share its states and cache)", f"the others must be text drafters: {text}")
    options = dict(options or {})
    extra = sorted(set(options) - set(names))
    if extra:
        raise OptionError("drafter_options", options, f"names {extra}, which are not among the merged drafters {names}",
                          f"options of a merged drafter go per drafter, e.g. {{{names[0]!r}: {{...}}}}")
    for n, o in options.items():
        if not isinstance(o, dict):
            raise OptionTypeError("drafter_options", {n: o}, f"drafter_options[{n!r}] must be a dict of {n}'s options, "
                                  f"got {type(o).__name__}")
    if tree is not None and "tree" in options.get(names[0], {}):
        raise OptionError("tree", tree, f"given twice for {names[0]!r}: tree= and drafter_options[{names[0]!r}]['tree']",
                          "give one")


def in_part(name: str, given: dict, exc: OptionError) -> OptionError:
    """`exc` of merged drafter `name`, named where its option was given (`given`: drafter_options[name]): both
    token_recycling and ngram take max_ngram, so a bare `max_ngram=0` would not say which."""
    if exc.parameter not in given:
        return exc
    where = f"drafter_options[{name!r}][{exc.parameter!r}]"
    return type(exc)(where, exc.value, exc.problem, exc.fix.replace(f"{exc.parameter}=", where + "="))


def make_merged(names: list[str], base, options: dict | None, tree, backend: str, factories: dict) -> MergedDrafter:
    """The MergedDrafter of `names` (already checked by check_merge) over the captured graph `base`."""
    options = dict(options or {})
    drafters = []
    for i, n in enumerate(names):
        own = dict(options.get(n, {}))  # its own tree= first; then tree= for the first drafter, defaults for the rest
        default = "tree" not in own and i > 0 and n == "token_recycling"
        own_tree = own.pop("tree", tree if i == 0 else MERGED_RECYCLING_TREE if default else None)
        try:
            drafters.append(factories[n](base, own, own_tree, backend))
        except (OptionError, OptionTypeError) as exc:
            if exc.parameter in options.get(n, {}):  # an option given for this part (its tree too): named there
                raise in_part(n, options[n], exc) from None
            if not (default and exc.parameter == "tree"):
                raise
            raise OptionError("drafter_options", options, f"leaves {n} the merge's default tree {own_tree}, which "
                              f"does not fit its other options ({exc.problem})",
                              f"give {n} a tree of its own, e.g. drafter_options={{{n!r}: {{'tree': 3}}}}") from None
    return MergedDrafter(drafters, names)
