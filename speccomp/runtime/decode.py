"""The decode loops, and what they share: the KV cache the runtime owns, stats, the drafter protocol.

`step` / `target` is any callable with the captured graph's convention (speccomp/frontend/convention.py):
    logits, new_kv, hidden[, extra outputs] = target(input_ids, position_ids, attention_mask, past_kv[, tree_mask])
Backends hand the runtime such a callable; the runtime never looks inside it.

Plain decoding (`decode_plain`): one token per target forward, the baseline every speculative path must
reproduce. Speculative decoding (`decode_speculative`): draft a token tree, verify it in one target
forward, keep the longest path the target agrees with, repeat.

    prefill(prompt) -> root token
    loop:
        draft  = drafter.propose(ctx)                # ctx: text so far (root last), cache, room; Tree + tokens
        logits = target(draft tokens, positions = past + depth, tree_mask = ancestor-or-self)
        path, bonus = greedy_accept | sample_accept  # path starts at the root
        cache.append(new_kv, keep=path)              # KV of root + accepted drafts, in order
        emit tokens[path[1:]] + [bonus]; bonus is the next root
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from speccomp.frontend.convention import KVSpec
from speccomp.runtime.sampling import Sampler
from speccomp.runtime.tree import Tree, greedy_accept, sample_accept, typical_accept_lossy


class KVCache:
    """A preallocated cache [L, 2, 1, Hkv, capacity, D]; positions [0, length) are valid.

    Static storage (as in gpt-fast) means appending is a copy into place and dropping
    rejected tokens is just `length -= n`.
    """

    def __init__(self, spec: KVSpec, capacity: int, device="cpu"):
        self.spec = spec
        self.data = torch.zeros(spec.shape(capacity), dtype=spec.dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def past(self) -> torch.Tensor:
        return self.data[..., : self.length, :]  # [L, 2, 1, Hkv, length, D] (a view)

    def append(self, new_kv: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Append this step's entries; `keep` (indices along the token axis) selects some of them."""
        if keep is not None:
            new_kv = new_kv.index_select(4, keep)
        n = new_kv.shape[4]
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.length} + {n} > capacity {self.capacity}")
        self.data[..., self.length : self.length + n, :] = new_kv
        self.length += n

    def nbytes(self) -> int:
        """Bytes the valid part of the cache holds."""
        return self.length * self.spec.bytes_per_token()


@dataclass
class Stats:
    new_tokens: int = 0
    steps: int = 0  # target forwards after prefill
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    acceptance_by_depth: list = field(default_factory=list)  # P(draft at depth d accepted), d = 1, 2, ...

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "tau": self.new_tokens / max(self.steps, 1),
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "acceptance_by_depth": list(self.acceptance_by_depth),
            "tokens_per_second": self.new_tokens / self.seconds if self.seconds > 0 else float("nan"),
        }


def forward(step, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor):
    """Run `tokens` [1, q] at `positions` [1, q] against the cache; returns logits, new_kv, hidden."""
    mask = torch.ones(1, cache.length + tokens.shape[1], dtype=torch.long, device=tokens.device)
    with torch.no_grad():
        return step(tokens, positions, mask, cache.past())


def decode_plain(step, kv: KVSpec, prompt: torch.Tensor, max_new_tokens: int, eos: set[int], sampler: Sampler):
    """One token per target forward: the baseline every speculative path must reproduce."""
    stats = Stats()
    start = time.perf_counter()
    n = prompt.shape[1]
    cache = KVCache(kv, n + max_new_tokens, prompt.device)
    logits, new_kv, _ = forward(step, cache, prompt, torch.arange(n, device=prompt.device)[None])
    cache.append(new_kv)
    stats.prefill_seconds = time.perf_counter() - start
    out = [int(sampler(logits[0, -1]))]
    while len(out) < max_new_tokens and out[-1] not in eos:
        token = torch.tensor([[out[-1]]], device=prompt.device)
        logits, new_kv, _ = forward(step, cache, token, torch.tensor([[cache.length]], device=prompt.device))
        cache.append(new_kv)
        stats.steps += 1
        out.append(int(sampler(logits[0, -1])))
    stats.steps += 1  # the prefill forward produced the first token
    stats.new_tokens = len(out)
    stats.seconds = time.perf_counter() - start
    return torch.tensor(out, dtype=torch.long, device=prompt.device), stats


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
