"""Many sequences, one target forward per step: batched speculative decoding with ragged acceptance.

The rows share one KVCache and every step packs them into one forward of the same captured graph, one after the
other (how vLLM packs variable-length requests; no padding, no second graph):

    input_ids     [1, q1 + q2 + ...]   a joining row's prompt, the other rows' draft trees
    position_ids  [1, q1 + q2 + ...]   each row's own: its cached length + the node's depth
    tree_mask     [q, past + q]        a query of row r sees the cached slots of row r, and its own tree's ancestors

The tree mask covers every key (passes/tree_attention.py with T = past + q), so the model's own causal mask adds
nothing and rows never see each other. Each row then accepts its own number of tokens (`Sequence`, the same
per-sequence steps as the one-sequence loop in decode.py); the accepted entries are appended to the cache with
their row's tag, and the slots of a finished row are dropped by compacting the cache.

Rows join between steps (`add`; their prefill rides in the next step's forward) and leave when done: continuous
batching, which `speccomp serve` runs. With a load-aware budget (runtime/budget.py) a row whose drafter it switched
off (`Budget.idle`) decodes as a plain row would: its drafter is asked for nothing and, where it declares that costs
acceptance only (`Drafter.observe_optional`), does not observe the step either. Every row's output is its own greedy
decoding (its own distribution when sampling), because each query sees exactly the keys it would see alone, at the
positions it would have alone.

What cannot batch this way (refused by `check_batchable`): models with sliding-window attention (the model's window
is counted in cache slots, and a packed row's slots are not its positions), drafters that draft over the target's
own cache (they would read the other rows' entries), and compressed-KV models.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from speccomp.errors import OptionError
from speccomp.frontend.convention import KVSpec
from speccomp.runtime.budget import Budget, StepCosts
from speccomp.runtime.calls import row_slots, run_batch
from speccomp.runtime.decode import KVCache, Sequence, synchronize
from speccomp.runtime.packed import PackedBatch, Part


def step_costs(target, kv: KVSpec, device, threads=contextlib.nullcontext, measured: dict | None = None,
               max_positions: int | None = None):
    """runtime/budget.py's StepCosts for `target`: forwards of q tokens over `past` cached slots (zeros), each under
    the `threads()` context decoding runs in (model.py's host_threads). The cache is allocated outside the timing
    (in a warm-up call): a fresh one per forward timed its zeroing too (3x t(1) at 3k slots). A batch's slots are
    all its rows' together, more than one row's context: positions wrap at `max_positions` (a learned position table,
    GPT-2's, has no row past it; what a forward costs does not depend on the positions' values)."""
    held = {}

    def run(q: int, past: int) -> None:
        n = past + q
        if held.get("cache") is None or held["cache"].capacity < n:
            held["cache"] = None  # the old one freed first
            held["cache"] = KVCache(kv, n, device)
        cache = held["cache"]
        cache.length = past
        with torch.no_grad(), threads():
            positions = torch.arange(past, n, device=device)
            target(torch.zeros(1, q, dtype=torch.long, device=device),
                   (positions if max_positions is None else positions % max_positions)[None],
                   torch.ones(1, n, dtype=torch.long, device=device), cache.past(),
                   torch.ones(q, n, dtype=torch.bool, device=device).tril(past))
        synchronize(device)  # StepCosts times this call

    run.release = held.clear  # StepCosts lets go of the cache after each grid point: a long-lived model keeps none
    return StepCosts(run, measured=measured)


def check_batchable(model, rows: int) -> None:
    """A batch of `rows` > 1 sequences needs a model and drafter this module can pack (see the module docstring)."""
    if rows <= 1:
        return
    fix = "call generate once per prompt"
    if getattr(model, "batch_refusal", None):
        raise OptionError("input_ids", f"a batch of {rows}", model.batch_refusal, fix)
    windows = model.graph.captured.sliding_windows
    if windows:
        raise OptionError("input_ids", f"a batch of {rows}", f"{model.graph.captured.model_type} has sliding-window "
                          f"attention ({len(windows)} layers), whose window counts cache slots; packed rows' slots "
                          "are not their positions", fix)
    drafter = model.drafter
    if drafter is not None and "target_cache" in drafter.reads:
        raise OptionError("input_ids", f"a batch of {rows}", f"the {drafter.name} drafter drafts over the target's "
                          "own KV cache, which a batch shares between rows",
                          "batch with a drafter that reads no target cache (ngram, suffix, token_recycling, medusa, "
                          f"hydra, eagle, a draft model), or {fix}")


class Batch(PackedBatch):
    """Rows decoding together over one target graph (`target`: the calling convention plus tree_mask); the step
    itself is runtime/packed.py's."""

    def __init__(self, target, kv: KVSpec, capacity: int, device, max_tree: int, budget: Budget | None = None):
        super().__init__(capacity, max_tree, budget)
        self.target, self.device = target, device
        self.cache = KVCache(kv, capacity, device)

    def _prefill(self, rid: int) -> Part:
        n = len(self.rows[rid].prompt)
        return Part(rid, torch.tensor(self.rows[rid].prompt), np.arange(n), np.tri(n, dtype=bool))

    def _draft(self, rid: int, cap: int | None) -> Part:
        seq = self.rows[rid]
        draft = seq.draft(self.cache, cap)
        return Part(rid, draft.tokens, len(seq.context) - 1 + draft.tree.depth.cpu().numpy(),
                    draft.tree.mask.cpu().numpy(), draft)

    def _forward(self, parts: list[Part], mask: np.ndarray, observed) -> tuple:
        tokens = torch.cat([p.tokens.to(self.device) for p in parts])[None]
        positions = torch.from_numpy(np.concatenate([p.positions for p in parts]))[None].to(self.device)
        ones = torch.ones(1, mask.shape[1], dtype=torch.long, device=self.device)
        with torch.no_grad():
            return self.target(tokens, positions, ones, self.cache.past(), torch.from_numpy(mask).to(self.device))

    def _share(self, outs: tuple, at: int, n: int) -> tuple:
        return (outs[0][:, at:at + n], None, *(x[:, at:at + n] for x in outs[2:]))

    def _first(self, seq: Sequence, mine: tuple) -> None:
        seq.first(mine)

    def _append(self, outs: tuple, keep: list[int]) -> None:
        self.cache.append(outs[1], keep=torch.tensor(keep, device=self.cache.data.device))

    def _move(self, idx: np.ndarray) -> None:
        data = self.cache.data
        data[..., :len(idx), :] = data.index_select(4, torch.from_numpy(idx).to(data.device))

    def _settled(self, seq: Sequence, seconds: float, prefill: bool) -> None:
        seq.stats.seconds = seconds
        if prefill:
            seq.stats.prefill_seconds = seconds


def decode_batch(target, kv: KVSpec, device, seqs: list[Sequence], max_tree: int, budget: Budget | None = None) -> int:
    """Run `seqs` to the end together (all join at once); the number of target forwards it took."""
    capacity = sum(row_slots(len(s.prompt), s.max_new_tokens, max_tree) for s in seqs)
    return run_batch(Batch(target, kv, capacity, device, max_tree, budget), seqs)
