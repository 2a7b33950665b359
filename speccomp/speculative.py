"""The speculative decode loop: draft a token tree, verify it in one target forward, keep the longest
path the target agrees with, repeat.

    prefill(prompt) -> root token
    loop:
        draft  = drafter.propose(context, root)      # Tree + one token per node, tokens[0] = root
        logits = target(draft tokens, positions = past + depth, tree_mask = ancestor-or-self)
        path, bonus = greedy_accept | sample_accept  # path starts at the root
        cache.append(new_kv, keep=path)              # KV of root + accepted drafts, in order
        emit tokens[path[1:]] + [bonus]; bonus is the next root

`target` is the lowered graph after the TreeAttention pass:
    logits, new_kv, hidden = target(input_ids, position_ids, attention_mask, past_kv, tree_mask)
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .capture import KVSpec
from .runtime import KVCache, Stats
from .sampling import Sampler
from .tree import Tree, greedy_accept, sample_accept, typical_accept_lossy


@dataclass
class Draft:
    tree: Tree
    tokens: torch.Tensor  # long [n], tokens[0] = root
    probs: torch.Tensor | None = None  # [n, V] draft distributions when tokens were *sampled*; None = deterministic


@dataclass
class DraftContext:
    """What a drafter may look at: the text so far, the target's cache, and the room left."""

    tokens: list[int]  # prompt + emitted tokens (the last one is the root)
    cache: KVCache  # target cache (holds every token but the root); scratch room after `length`
    max_depth: int  # deeper drafts could not be emitted (max_new_tokens) or would not fit
    max_nodes: int  # tree size limit (context left, sliding windows)


class Drafter:
    """Proposes a token tree each step. Subclasses override `propose`; the hooks are optional."""

    name = "drafter"

    def begin(self, prompt: list[int]) -> None:
        """A new generation starts with `prompt`."""

    def propose(self, ctx: DraftContext) -> Draft:
        raise NotImplementedError

    def observe(self, draft: Draft, path: list[int], target_logits: torch.Tensor) -> None:
        """After verification: the accepted `path` and the target's logits [n, V] at every node."""

    wants_states = False  # True: the runtime calls take_states after every target forward; "path": with every
    # newly accepted position's states ([m, ...]: after the prefill all prompt positions, then each accepted path)

    def take_states(self, states: tuple) -> None:
        """The target's outputs from `hidden` on (hidden [H], then extra outputs of passes, e.g. Medusa
        head states [K, H]) at the newest token: after the prefill its last prompt token, after a
        verification the last accepted node. With wants_states == "path" every newly accepted position
        instead ([m, H], ...: all prompt positions, then the accepted path root first). Called only when
        `wants_states` is set (True or "path")."""


ROOT_ONLY = Tree.from_parents((-1,))


def truncate(tree: Tree, max_depth: int, max_nodes: int) -> tuple[Tree, list[int]]:
    """The sub-tree of nodes with depth <= max_depth (and the first max_nodes of them), plus kept indices."""
    if tree.max_depth <= max_depth and tree.size <= max_nodes:  # the usual case: nothing to cut (decode loop)
        return tree, list(range(tree.size))
    return restrict(tree, [i for i, d in enumerate(tree.depth.tolist()) if d <= max_depth][:max_nodes])


def restrict(tree: Tree, keep: list[int]) -> tuple[Tree, list[int]]:
    """The sub-tree of the nodes `keep` (ascending, prefix-closed: every kept node's parent is kept), plus `keep`."""
    if len(keep) == tree.size:
        return tree, keep
    remap = {old: new for new, old in enumerate(keep)}
    parents = [-1] + [remap[tree.parents[i]] for i in keep[1:]]
    ranks = None if tree.ranks is None else [tree.ranks[i] for i in keep]
    return Tree.from_parents(parents, ranks), keep


def prefill(target, cache: KVCache, prompt: torch.Tensor):
    n = prompt.shape[1]
    positions = torch.arange(n, device=prompt.device)[None]
    mask = torch.ones(1, n, dtype=torch.long, device=prompt.device)
    causal = torch.ones(n, n, dtype=torch.bool, device=prompt.device).tril()
    with torch.no_grad():
        outs = target(prompt, positions, mask, cache.past(), causal)
    cache.append(outs[1])
    return outs  # logits, new_kv, hidden, *extra outputs of passes


def decode_speculative(
    target, drafter: Drafter, kv: KVSpec, prompt: torch.Tensor, max_new_tokens: int, eos: set[int],
    sampler: Sampler, max_tree: int, acceptance: str = "exact",
):
    """Lossless speculative decoding. Returns (new tokens [m], Stats with per-depth acceptance).

    acceptance="typical-lossy" (sampling only) swaps the exact rejection sampler for Medusa's typical
    acceptance: faster at high temperature, but the output no longer follows the model's distribution."""
    stats = Stats()
    start = time.perf_counter()
    device = prompt.device
    n = prompt.shape[1]
    cache = KVCache(kv, n + max_new_tokens + max_tree + 1, device)
    outs = prefill(target, cache, prompt)
    logits = outs[0]
    stats.prefill_seconds = time.perf_counter() - start
    drafter.begin(prompt[0].tolist())  # before take_states: a drafter may reset its state here
    if drafter.wants_states:
        drafter.take_states(tuple(x[0] if drafter.wants_states == "path" else x[0, -1] for x in outs[2:]))
    out = [int(sampler(logits[0, -1]))]
    stats.steps = 1  # the prefill produced the first token
    context = prompt[0].tolist() + out
    accepted_at_depth: list[int] = []  # how many steps accepted a draft at depth d (index d-1)
    proposed_at_depth: list[int] = []
    while len(out) < max_new_tokens and out[-1] not in eos:
        room = max_new_tokens - len(out)  # tokens still allowed, the bonus included
        ctx = DraftContext(context, cache, max_depth=room - 1, max_nodes=max_tree)
        draft = drafter.propose(ctx) if room > 1 else Draft(ROOT_ONLY, torch.tensor([out[-1]]))
        tree, keep = truncate(draft.tree, ctx.max_depth, ctx.max_nodes)
        tokens = draft.tokens[keep] if len(keep) != draft.tree.size else draft.tokens
        draft_probs = None if draft.probs is None else draft.probs[keep]
        draft = Draft(tree, tokens, draft_probs)
        past = cache.length
        mask = torch.ones(1, past + tree.size, dtype=torch.long, device=device)
        with torch.no_grad():
            outs = target(tokens[None].to(device), tree.positions(past, device), mask, cache.past(), tree.mask.to(device))
        logits, new_kv = outs[0][0], outs[1]  # logits [n, V]
        if acceptance == "typical-lossy":
            path, bonus = typical_accept_lossy(tree, tokens, sampler.probs(logits), generator=sampler.generator)
        elif sampler.do_sample:
            path, bonus = sample_accept(tree, tokens, sampler.probs(logits), draft_probs, sampler.generator)
        else:
            path, bonus = greedy_accept(tree, tokens, logits.argmax(-1))
        cache.append(new_kv, keep=torch.tensor(path, device=device))
        drafter.observe(draft, path, logits)
        if drafter.wants_states:
            at = path if drafter.wants_states == "path" else path[-1]
            drafter.take_states(tuple(x[0, at] for x in outs[2:]))
        stats.steps += 1
        depth = int(tree.max_depth)
        while len(proposed_at_depth) < depth:
            proposed_at_depth.append(0)
            accepted_at_depth.append(0)
        for d in range(depth):
            proposed_at_depth[d] += 1
        for d in range(len(path) - 1):
            accepted_at_depth[d] += 1
        for t in tokens[path[1:]].tolist() + [int(bonus)]:
            out.append(t)
            if t in eos or len(out) >= max_new_tokens:
                break
        context.extend(out[len(context) - n:])
    stats.new_tokens = len(out)
    stats.seconds = time.perf_counter() - start
    stats.acceptance_by_depth = [a / p if p else 0.0 for a, p in zip(accepted_at_depth, proposed_at_depth)]
    return torch.tensor(out, dtype=torch.long, device=device), stats
