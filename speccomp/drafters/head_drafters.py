"""Head drafters: draft a token tree from the target's last hidden state with trained heads.

MedusaDrafter (below) and HydraDrafter (further down) share where heads come from and the
`wants_states` hook through which the runtime hands them the newest token's outputs.

MedusaDrafter:

The target graph (after the MedusaHeads pass) returns head states [K, H] for every token; the
runtime hands the drafter those of the newest token (`take_states`). Drafting is then one
matmul, [K, H] x LM head -> [K, V], and a top-k per head: a node at depth d with sibling rank r
gets head d-1's rank-r token (Medusa's cartesian trees; the tree's depth must be <= K). No extra
target forward: the heads ran inside the verification that just happened.

Where heads come from (first found): drafter_options={"heads": DIR}; the user cache
`<speccomp cache>/<kind dir>/<model fingerprint>/`; heads shipped in the package for the default
model (`speccomp/data/<kind dir>/<fingerprint>/`), where the kind dir is `heads` for Medusa (the
name predates Hydra) and `hydra` for Hydra.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import torch

from speccomp.drafters.graph import LOG_MIN_PROB, MAX_DYNAMIC_DEPTH, add_children, select_tree
from speccomp.errors import OptionTypeError
from speccomp.drafters.medusa import HeadsError, MedusaHeads, display_kind, load_medusa
from speccomp.models import cache_dir
from speccomp.runtime.decode import Draft, DraftContext, Drafter, truncate
from speccomp.runtime.tree import Tree, check_tree_width

# 16 drafts, depth <= 4: Medusa's sparse-tree idea (wide where the first head is sure), CPU-sized
DEFAULT_MEDUSA_TREE = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [1, 0], [2, 0], [0, 2],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0],
]  # fmt: skip


HEAD_KINDS = {"medusa": "heads", "hydra": "hydra", "eagle": "eagle"}  # kind -> directory name under the caches


def heads_dir(model, kind: str = "medusa") -> Path:
    """Where `speccomp train-heads` stores heads of `kind` for `model` (the user cache)."""
    from speccomp.models import fingerprint

    return cache_dir() / HEAD_KINDS[kind] / fingerprint(model)


def shipped_heads_dir(model, kind: str = "medusa") -> Path | None:
    from speccomp.models import fingerprint

    path = resources.files("speccomp").joinpath(f"data/{HEAD_KINDS[kind]}/{fingerprint(model)}")
    return Path(str(path)) if path.is_dir() else None


def find_heads(model, path=None, kind: str = "medusa") -> Path:
    if path is not None:
        return Path(path)
    for candidate in (heads_dir(model, kind), shipped_heads_dir(model, kind)):
        if candidate is not None and (candidate / "config.json").exists():
            return candidate
    layout = " (FasterDecoding/Medusa's layout)" if kind == "medusa" else ""
    raise HeadsError(
        f"no {display_kind(kind)[2:].strip()} heads for this model: train them with `speccomp train-heads --kind {kind}` "
        f"(default model), or `speccomp.train_heads(model, prompts, out=DIR, kind={kind!r})` in Python, "
        f"or pass drafter_options={{'heads': DIR}} for heads saved elsewhere{layout}"
    )


class MedusaDrafter(Drafter):
    name = "medusa"
    wants_states = True

    def __init__(self, heads: MedusaHeads, tree: Tree):
        check_heads_depth(tree, heads.num_heads, "Medusa")
        check_tree_width(tree, heads.vocab, "Medusa heads' vocabulary", tree)
        from speccomp.passes.medusa_heads import MedusaHeadsPass

        self.heads, self.tree = heads, tree
        self.target_passes = [MedusaHeadsPass(heads)]
        self.states = None
        self.top = max(tree.ranks) + 1

    def take_states(self, states) -> None:
        self.states = states[1]  # (hidden [H], medusa_states [K, H])

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


class HydraDrafter(Drafter):
    """Grow the tree depth by depth: head d reads each depth-d node's state and token, scores its children.

    Static trees: node c gets its parent's rank-r candidate (r = tree.ranks[c]); the tree's depth must be
    <= K. Dynamic trees (`DynamicTreeSpec`, EAGLE-2): the `top_k` likeliest frontier nodes (cumulative
    head probability) expand each depth; the step's tree is the `budget` likeliest candidates.
    """

    name = "hydra"
    wants_states = True

    def __init__(self, heads, tree):
        from speccomp.runtime.tree import DynamicTreeSpec

        if not isinstance(tree, (Tree, DynamicTreeSpec)):
            raise OptionTypeError("tree", tree, f"must be a Tree or a DynamicTreeSpec, got {type(tree).__name__}")
        if isinstance(tree, Tree):
            check_heads_depth(tree, heads.num_heads, "Hydra")
        check_tree_width(tree, len(heads.draft_vocab), "Hydra heads' draft vocabulary", tree)
        self.heads, self.tree = heads, tree
        self.h = None

    def take_states(self, states) -> None:
        self.h = states[0]  # the target's final hidden state [H] at the newest token

    def _expand(self, d: int, states: torch.Tensor, tokens: list[int]):
        """Head d on nodes (states [n, H], tokens) -> (child states [n, H], log-probs [n, Vd])."""
        from speccomp.passes.prepack_linear import linear

        with torch.no_grad():
            z = self.heads.step(d, states, torch.tensor(tokens))
            return z, linear(z, self.heads.draft_lm).log_softmax(-1)

    def propose(self, ctx: DraftContext) -> Draft:
        if isinstance(self.tree, Tree):
            return self._propose_static(ctx)
        spec = self.tree
        budget = min(spec.budget, ctx.max_nodes - 1)
        max_depth = min(MAX_DYNAMIC_DEPTH, self.heads.num_heads, ctx.max_depth, budget)
        vocab = self.heads.draft_vocab
        parent, token, score, depth = [-1], [ctx.tokens[-1]], [0.0], [0]
        out = {}  # expanded candidate -> its head's output, the state its children's head reads
        frontier = [0]
        for d in range(max_depth):
            states = torch.cat([self.h[None] if c == 0 else out[parent[c]] for c in frontier])
            z, logp = self._expand(d, states, [token[c] for c in frontier])
            for i, c in enumerate(frontier):
                out[c] = z[i : i + 1]
            top_p, top = logp.topk(spec.top_k, dim=-1)  # [k, top_k] draft-vocabulary indices
            frontier = add_children(frontier, top_p, vocab[top], parent, token, score, depth)
            if max(score[c] for c in frontier) < LOG_MIN_PROB:
                break
        return select_tree(parent, token, score, depth, budget)

    def _propose_static(self, ctx: DraftContext) -> Draft:
        tree, _ = truncate(self.tree, ctx.max_depth, ctx.max_nodes)
        vocab = self.heads.draft_vocab
        tokens = [0] * tree.size
        tokens[0] = ctx.tokens[-1]
        state = {0: self.h[None]}
        depth = tree.depth.tolist()
        for d in range(tree.max_depth):
            nodes = [u for u in range(tree.size) if depth[u] == d and tree.children[u]]
            z, logp = self._expand(d, torch.cat([state[u] for u in nodes]), [tokens[u] for u in nodes])
            for i, u in enumerate(nodes):
                top = logp[i].topk(max(tree.ranks[c] for c in tree.children[u]) + 1).indices  # draft-vocab indices
                for c in tree.children[u]:
                    tokens[c] = int(vocab[top[tree.ranks[c]]])
                    state[c] = z[i : i + 1]
        return Draft(tree, torch.tensor(tokens, dtype=torch.long))


def check_heads_depth(tree: Tree, num_heads: int, kind: str) -> None:
    """Head k drafts depth k + 1: a tree deeper than the heads cannot be filled."""
    if tree.max_depth > num_heads:
        from speccomp.errors import OptionError

        raise OptionError("tree", tree.choices, f"is {tree.max_depth} deep but there are {num_heads} {kind} heads "
                          "(one per depth)", f"use a tree at most {num_heads} deep")


def heads_for(base, options: dict, kind: str) -> Path:
    """The head directory a `kind` drafter uses: drafter_options={"heads": DIR} (the only option), else found."""
    path = options.pop("heads", None)
    if options:
        from speccomp.errors import OptionError

        raise OptionError("drafter_options", options, f"unknown {kind} options {sorted(options)}", "accepted: ['heads']")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise OptionTypeError("heads", path, f"must be a path to {display_kind(kind)} head directory, got "
                              f"{type(path).__name__}", f"e.g. drafter_options={{'heads': 'my-{kind}-heads/'}}")
    if base.model is None:
        raise ValueError(f"the {kind} drafter needs the model (speccomp.compile passes it)")
    return find_heads(base.model, path, kind)


def make_hydra(base, options: dict, tree) -> HydraDrafter:
    from speccomp.drafters.hydra import load_hydra
    from speccomp.runtime.tree import DynamicTreeSpec

    heads = load_hydra(heads_for(base, options, "hydra"), base.model)
    return HydraDrafter(heads, tree if tree is not None else DynamicTreeSpec(16, 4))


def make_medusa(base, options: dict, tree) -> MedusaDrafter:
    heads = load_medusa(heads_for(base, options, "medusa"), base.model)
    if tree is None:  # the default tree, no deeper than these heads reach
        tree, _ = truncate(Tree.from_choices(DEFAULT_MEDUSA_TREE), heads.num_heads, len(DEFAULT_MEDUSA_TREE) + 1)
    return MedusaDrafter(heads, tree)
