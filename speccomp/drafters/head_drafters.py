"""Head drafters: draft a token tree from the target's last hidden state with trained heads.

MedusaDrafter (below) and HydraDrafter (further down) share where heads come from and what they read:
the target's outputs at the newest token (reads = ("states",), handed over by `take_states`).

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
from functools import partial
from importlib import resources
from pathlib import Path

import torch

from speccomp.drafters.grow import MAX_DYNAMIC_DEPTH, grow, state_expander
from speccomp.errors import OptionError, OptionTypeError
from speccomp.drafters.hydra import MAX_SIBLINGS, HydraStep, load_hydra
from speccomp.drafters.medusa import HeadsError, MedusaHeads, display_kind, load_medusa
from speccomp.models import cache_dir, fingerprint
from speccomp.runtime.decode import Draft, DraftContext, Drafter, check_tree_kind, truncate
from speccomp.runtime.sampling import top_ids
from speccomp.runtime.tree import DynamicTreeSpec, Tree, check_tree_width

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
    return cache_dir() / HEAD_KINDS[kind] / fingerprint(model)


def _shipped_root(kind: str) -> Path:
    """Where heads of `kind` shipped with speccomp lie, one folder per model fingerprint."""
    return Path(str(resources.files("speccomp").joinpath(f"data/{HEAD_KINDS[kind]}")))


def shipped_heads_dir(model, kind: str = "medusa") -> Path | None:
    path = _shipped_root(kind) / fingerprint(model)
    return path if path.is_dir() else None


def find_heads(model, path=None, kind: str = "medusa") -> Path:
    if path is not None:
        return Path(path)
    for candidate in (heads_dir(model, kind), shipped_heads_dir(model, kind)):
        if candidate is not None and (candidate / "config.json").exists():
            return candidate
    layout = " (FasterDecoding/Medusa's layout)" if kind == "medusa" else ""
    weight = next(iter(model.parameters()), None)
    dtype = weight.dtype if weight is not None else torch.float32
    cast = ""
    if dtype != torch.float32:  # heads train in float32, and a cast model hashes otherwise
        roots = (cache_dir() / HEAD_KINDS[kind], _shipped_root(kind))  # (heads_dir's parent: no second fingerprint)
        kept = sorted(str(c.parent) for root in roots for c in root.glob("*/config.json"))
        cast = (f" (heads are kept under the float32 model's fingerprint, which a {str(dtype).removeprefix('torch.')} "
                f"model does not have; heads stored here: {kept or 'none'}: pass one as drafter_options={{'heads': DIR}})")
    raise HeadsError(f"no {display_kind(kind)[2:].strip()} heads for this model{cast}: train them with `speccomp "
                     f"train-heads --kind {kind}` (default model), or `speccomp.train_heads(model, prompts, out=DIR, "
                     f"kind={kind!r})` in Python, or pass drafter_options={{'heads': DIR}} for heads saved "
                     f"elsewhere{layout}")


class MedusaDrafter(Drafter):
    name = "medusa"
    reads = ("states",)  # the Medusa head states [K, H] of the newest token, computed inside the target graph
    trees = ("static",)
    observe_optional = True  # nothing to observe (states are handed every step)

    def __init__(self, heads: MedusaHeads, tree: Tree, heads_path: str | None = None):
        check_tree_kind(self, tree)
        check_heads_depth(tree, heads.num_heads, "Medusa")
        check_tree_width(tree, heads.vocab, "Medusa heads' vocabulary", tree)
        from speccomp.passes.medusa_heads import MedusaHeadsPass

        self.heads, self.tree, self.heads_path = heads, tree, heads_path
        self.target_passes = [MedusaHeadsPass(heads)]
        self.states = None
        self.top = max(tree.ranks) + 1
        self.max_tree_depth = heads.num_heads  # head k drafts depth k + 1
        self.options = {} if heads_path is None else {"heads": heads_path}

    def with_tree(self, tree) -> "MedusaDrafter":
        return MedusaDrafter(self.heads, tree, self.heads_path)

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
        top = top_ids(self._head_logits(), self.top).cpu()  # [K, top]; drafts are host tensors
        children = top[tree.depth[1:] - 1, torch.tensor(tree.ranks[1:], dtype=torch.long)]  # head d-1's rank-r token
        return Draft(tree, torch.cat([torch.tensor([ctx.tokens[-1]], dtype=torch.long), children]))


class HydraDrafter(Drafter):
    """Grow the tree depth by depth (speccomp/drafters/grow.py): head d reads each depth-d node's state and
    token and scores its children; the root's state is the target's final hidden state at the newest token.
    Static trees are at most K (the number of heads) deep; dynamic ones stop there. The head step is a graph
    (hydra.py's HydraStep), lowered by the compile's backend; an engine carries it as hydra.onnx."""

    name = "hydra"
    reads = ("states",)
    trees = ("static", "dynamic")
    graphs = ("head_step",)
    light_graphs = True  # a few MB of heads: one thread (backends/drafter_graph.py)
    observe_optional = True  # nothing to observe (states are handed every step)

    def __init__(self, heads, tree, heads_path: str | None = None, backend: str = "eager", lowered=None):
        check_tree_kind(self, tree)
        if isinstance(tree, Tree):
            check_heads_depth(tree, heads.num_heads, "Hydra")
        lower_step(self, HydraStep, heads, tree, lowered, backend, "Hydra head step")
        self.heads, self.tree, self.heads_path, self.backend = heads, tree, heads_path, backend
        self.h = None
        self.max_tree_depth = heads.num_heads
        self.options = {} if heads_path is None else {"heads": heads_path}

    def with_tree(self, tree) -> "HydraDrafter":
        return HydraDrafter(self.heads, tree, self.heads_path, self.backend, (self.module, self.step))

    def take_states(self, states) -> None:
        self.h = states[0]  # the target's final hidden state [H] at the newest token

    def propose(self, ctx: DraftContext) -> Draft:
        # grow.py's expander, shared with the engine
        expand = state_expander(partial(run_step, self.step, self.device), self.h.float().cpu().numpy())
        return grow(self.tree, ctx, expand, min(MAX_DYNAMIC_DEPTH, self.heads.num_heads))


def lower_step(drafter, module_cls, heads, tree, lowered, backend: str, what: str) -> None:
    """Set `drafter.module` (the step graph `module_cls(heads)`) and `drafter.step`, its lowering for `backend` (an
    OrtStep on the ONNX Runtime backends: what export copies); `lowered`: both, reused (with_tree). Checks the
    tree's sibling ranks against the step's top tokens."""
    module = module_cls(heads) if lowered is None else lowered[0]
    drafter.max_siblings = module.top
    check_tree_width(tree, module.top, f"{what} (its top min({MAX_SIBLINGS}, draft vocabulary "
                     f"{len(heads.draft_vocab)}) tokens)", tree)
    if lowered is None:
        from speccomp.backends.drafter_graph import lower_module

        lowered = module, lower_module(module, module.graph_spec(), backend)
    drafter.module, drafter.step = lowered
    drafter.device = drafter.module.draft_lm.device  # where the step's weights are (the model's device)


def run_step(step, device, *arrays) -> list:
    """A lowered step on numpy arrays (and ints: 0-d tensors) moved to `device`, numpy out (grow.py's host side
    and the engine share the numpy convention; on the CPU nothing is copied)."""
    with torch.no_grad():
        return [t.cpu().numpy() for t in step(*(torch.as_tensor(a, device=device) for a in arrays))]


def check_heads_depth(tree: Tree, num_heads: int, kind: str) -> None:
    """Head k drafts depth k + 1: a tree deeper than the heads cannot be filled."""
    if tree.max_depth > num_heads:
        raise OptionError("tree", tree.choices, f"is {tree.max_depth} deep but there are {num_heads} {kind} heads "
                          "(one per depth)", f"use a tree at most {num_heads} deep")


def heads_for(base, options: dict, kind: str) -> tuple[Path, str | None]:
    """The head directory a `kind` drafter uses, and the drafter_options={"heads": DIR} it came from (the only option;
    None: found in the caches), which the drafter declares as its options."""
    path = options.pop("heads", None)
    if options:
        raise OptionError("drafter_options", options, f"unknown {kind} options {sorted(options)}", "accepted: ['heads']")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise OptionTypeError("heads", path, f"must be a path to {display_kind(kind)} head directory, got "
                              f"{type(path).__name__}", f"e.g. drafter_options={{'heads': 'my-{kind}-heads/'}}")
    if base.model is None:
        raise ValueError(f"the {kind} drafter needs the model (speccomp.compile passes it)")
    return find_heads(base.model, path, kind), None if path is None else os.fspath(path)


def make_hydra(base, options: dict, tree, backend: str = "eager") -> HydraDrafter:
    path, given = heads_for(base, options, "hydra")
    return HydraDrafter(load_hydra(path, base.model), tree if tree is not None else DynamicTreeSpec(16, 4), given, backend)


def make_medusa(base, options: dict, tree, backend: str = "eager") -> MedusaDrafter:
    path, given = heads_for(base, options, "medusa")
    heads = load_medusa(path, base.model)
    if tree is None:  # the default tree, no deeper than these heads reach
        tree, _ = truncate(Tree.from_choices(DEFAULT_MEDUSA_TREE), heads.num_heads, len(DEFAULT_MEDUSA_TREE) + 1)
    return MedusaDrafter(heads, tree, given)
