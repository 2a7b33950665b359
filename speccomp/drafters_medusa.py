"""MedusaDrafter: draft a token tree from the Medusa head states of the last accepted token.

The target graph (after the MedusaHeads pass) returns head states [K, H] for every token; the
runtime hands the drafter those of the newest token (`take_states`). Drafting is then one
matmul, [K, H] x LM head -> [K, V], and a top-k per head: a node at depth d with sibling rank r
gets head d-1's rank-r token (Medusa's cartesian trees; the tree's depth must be <= K). No extra
target forward: the heads ran inside the verification that just happened.

Where heads come from (first found): drafter_options={"heads": DIR}; the user cache
`<speccomp cache>/heads/<model fingerprint>/`; heads shipped in the package for the default model.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from .medusa import HeadsError, MedusaHeads, load_medusa
from .models import cache_dir
from .speculative import Draft, DraftContext, Drafter, truncate
from .tree import Tree

# 16 drafts, depth <= 4: Medusa's sparse-tree idea (wide where the first head is sure), CPU-sized
DEFAULT_MEDUSA_TREE = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [1, 0], [2, 0], [0, 2],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0],
]  # fmt: skip


def heads_dir(model) -> Path:
    """Where `speccomp train-heads` stores heads for `model` (the user cache)."""
    from .search import fingerprint

    return cache_dir() / "heads" / fingerprint(model)


def shipped_heads_dir(model) -> Path | None:
    from .search import fingerprint

    path = resources.files("speccomp").joinpath(f"data/heads/{fingerprint(model)}")
    return Path(str(path)) if path.is_dir() else None


def find_heads(model, path=None) -> Path:
    if path is not None:
        return Path(path)
    for candidate in (heads_dir(model), shipped_heads_dir(model)):
        if candidate is not None and (candidate / "config.json").exists():
            return candidate
    raise HeadsError(
        "no Medusa heads for this model: train them with `speccomp train-heads` (default model), or "
        "`speccomp.train_heads(model, tokenizer)` in Python, or pass drafter_options={'heads': DIR} "
        "for heads in FasterDecoding/Medusa's layout"
    )


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, heads: MedusaHeads, tree: Tree):
        if tree.max_depth > heads.num_heads:
            raise ValueError(
                f"the tree is {tree.max_depth} deep but there are {heads.num_heads} Medusa heads (one per depth); "
                f"use a tree at most {heads.num_heads} deep"
            )
        from speccomp.passes.medusa_heads import MedusaHeadsPass

        self.heads, self.tree = heads, tree
        self.target_passes = [MedusaHeadsPass(heads)]
        self.states = None
        self.top = max(tree.ranks) + 1

    def take_states(self, states) -> None:
        self.states = states[0]  # [K, H]

    def _head_logits(self) -> torch.Tensor:
        with torch.no_grad():
            if self.heads.tied:  # one matmul of K rows against the (packed) LM head
                from speccomp.passes.prepack_linear import linear

                return linear(self.states, self.heads.lm_head)
            return self.heads.project(self.states)

    def propose(self, ctx: DraftContext) -> Draft:
        tree, _ = truncate(self.tree, ctx.max_depth, ctx.max_nodes)
        top = self._head_logits().topk(self.top, dim=-1).indices  # [K, top]
        depth = tree.depth.tolist()
        tokens = torch.empty(tree.size, dtype=torch.long)
        tokens[0] = ctx.tokens[-1]
        for c in range(1, tree.size):
            tokens[c] = top[depth[c] - 1, tree.ranks[c]]
        return Draft(tree, tokens)


def make_medusa(base, options: dict, tree) -> MedusaDrafter:
    path = options.pop("heads", None)
    if options:
        raise ValueError(f"unknown medusa options {sorted(options)}; accepted: ['heads']")
    model = base.model
    if model is None:
        raise ValueError("the medusa drafter needs the model (speccomp.compile passes it)")
    heads = load_medusa(find_heads(model, path), model)
    return MedusaDrafter(heads, tree if tree is not None else Tree.from_choices(DEFAULT_MEDUSA_TREE))
