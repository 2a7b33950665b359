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
import time

import torch

from speccomp.errors import OptionError
from speccomp.frontend.convention import KVSpec
from speccomp.runtime.budget import Budget, StepCosts
from speccomp.runtime.calls import row_slots, run_batch
from speccomp.runtime.decode import KVCache, Sequence


def step_costs(target, kv: KVSpec, device, threads=contextlib.nullcontext, measured: dict | None = None):
    """runtime/budget.py's StepCosts for `target`: forwards of q tokens over `past` cached slots (zeros), each under
    the `threads()` context decoding runs in (model.py's host_threads). The cache is allocated outside the timing
    (in a warm-up call): a fresh one per forward timed its zeroing too (3x t(1) at 3k slots)."""
    held = {}

    def run(q: int, past: int) -> None:
        n = past + q
        if held.get("cache") is None or held["cache"].capacity < n:
            held["cache"] = None  # the old one freed first
            held["cache"] = KVCache(kv, n, device)
        cache = held["cache"]
        cache.length = past
        with torch.no_grad(), threads():
            target(torch.zeros(1, q, dtype=torch.long, device=device), torch.arange(past, n, device=device)[None],
                   torch.ones(1, n, dtype=torch.long, device=device), cache.past(),
                   torch.ones(q, n, dtype=torch.bool, device=device).tril(past))

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


class Batch:
    """Rows decoding together over one target graph (`target`: the calling convention plus tree_mask)."""

    def __init__(self, target, kv: KVSpec, capacity: int, device, max_tree: int, budget: Budget | None = None):
        """`budget`: load-aware caps on each row's tree (runtime/budget.py); None: every row its drafter's whole tree."""
        self.target, self.max_tree, self.device, self.budget = target, max_tree, device, budget
        self.cache = KVCache(kv, capacity, device)
        self.owner = torch.full((capacity,), -1, dtype=torch.long)  # row id of each cache slot
        self.rows: dict[int, Sequence] = {}
        self.reserved: dict[int, int] = {}  # row id -> slots set aside for it (its whole generation)
        self.forwards = 0
        self._next_id = 0
        self._joined: dict[int, float] = {}  # row id -> when it joined (its stats' seconds count from there)

    def need(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache slots a row needs at most: its text, plus the room its last step's tree is verified in."""
        return row_slots(prompt_len, max_new_tokens, self.max_tree)

    def free(self) -> int:
        return self.cache.capacity - sum(self.reserved.values())

    def add(self, seq: Sequence) -> int:
        """A row joins (its prompt is prefilled by the next step); its id."""
        need = self.need(len(seq.prompt), seq.max_new_tokens)
        if need > self.free():
            raise RuntimeError(f"the batch's cache has {self.free()} free slots, the row needs {need}")
        rid, self._next_id = self._next_id, self._next_id + 1
        self.rows[rid], self.reserved[rid] = seq, need
        self._joined[rid] = time.perf_counter()
        return rid

    def remove(self, rid: int) -> None:
        """A row leaves (done, or its client went away): its slots are freed."""
        self.rows.pop(rid)
        self.reserved.pop(rid)
        self._joined.pop(rid)
        if self.budget is not None:
            self.budget.forget(rid)
        self._compact()

    def step(self) -> dict[int, list[int]]:
        """One forward for every row: joining rows' prompts, the others' drafts. The tokens each row emitted this step
        (finished rows stay until `remove`, done)."""
        parts = []  # (row id, Draft or None for a prefill, tokens, positions, block mask)
        running = [rid for rid, seq in self.rows.items() if seq.out and not seq.done]
        joining = [rid for rid, seq in self.rows.items() if not seq.out]
        caps = {} if self.budget is None else self.budget.caps_for(
            running, extra_q=sum(len(self.rows[r].prompt) for r in joining),
            remaining={r: self.rows[r].max_new_tokens - len(self.rows[r].out) for r in running},
            past=self.cache.length)
        for rid in joining:
            n = len(self.rows[rid].prompt)
            parts.append((rid, None, torch.tensor(self.rows[rid].prompt), torch.arange(n),
                          torch.ones(n, n, dtype=torch.bool).tril()))
        for rid in running:
            start = time.perf_counter()
            draft = self.rows[rid].draft(self.cache, caps.get(rid))
            if self.budget is not None:
                self.budget.charge(rid, time.perf_counter() - start)  # a look's drafting is part of its price
            parts.append((rid, draft, draft.tokens, len(self.rows[rid].context) - 1 + draft.tree.depth, draft.tree.mask))
        if not parts:
            return {}
        outs = self._forward(parts)
        emitted, keep, owners, offset = {}, [], [], 0
        for rid, draft, tokens, _, _ in parts:
            q, seq, before = len(tokens), self.rows[rid], len(self.rows[rid].out)
            mine = (outs[0][:, offset:offset + q], None, *(x[:, offset:offset + q] for x in outs[2:]))
            if draft is None:
                seq.first(mine)
                kept = list(range(q))
            else:
                kept = seq.accept(draft, mine)
                start = time.perf_counter()
                seq.advance(draft, kept, mine, idle=self.budget is not None and rid in self.budget.idle)
                if self.budget is not None:
                    self.budget.charge(rid, time.perf_counter() - start)  # and so is its drafter's learning
                    self.budget.record(rid, kept, draft.tree.size)  # <= caps[rid]
            seq.stats.seconds = time.perf_counter() - self._joined[rid]
            if draft is None:
                seq.stats.prefill_seconds = seq.stats.seconds
            keep += [offset + i for i in kept]
            owners += [rid] * len(kept)
            emitted[rid] = seq.out[before:]
            offset += q
        start = self.cache.length
        self.cache.append(outs[1], keep=torch.tensor(keep, device=self.cache.data.device))
        self.owner[start:self.cache.length] = torch.tensor(owners)
        return emitted

    def _forward(self, parts) -> tuple:
        past = self.cache.length
        q = sum(len(p[2]) for p in parts)
        if past + q > self.cache.capacity:
            raise RuntimeError(f"KV cache overflow: {past} + {q} > capacity {self.cache.capacity}")
        mask = torch.zeros(q, past + q, dtype=torch.bool)
        owners, offset = self.owner[:past], 0
        for rid, _, tokens, _, block in parts:
            n = len(tokens)
            mask[offset:offset + n, :past] = owners == rid
            mask[offset:offset + n, past + offset:past + offset + n] = block
            offset += n
        tokens = torch.cat([p[2] for p in parts])[None].to(self.device)
        positions = torch.cat([p[3] for p in parts])[None].to(self.device)
        ones = torch.ones(1, past + q, dtype=torch.long, device=self.device)
        with torch.no_grad():
            outs = self.target(tokens, positions, ones, self.cache.past(), mask.to(self.device))
        self.forwards += 1
        return outs

    def _compact(self) -> None:
        """Drop the slots of rows that left, keeping the others' in order (attention does not care where a key sits:
        its row tag and rotary position say all). Lazily: a left row's slots are untagged at once (no query sees
        them), and moved only once they are as many as the live ones, so a copy of the cache is amortised."""
        length = self.cache.length
        gone = ~torch.isin(self.owner[:length], torch.tensor(list(self.rows), dtype=torch.long))
        self.owner[:length][gone] = -1
        dead = int(gone.sum())
        if dead == 0 or dead < length - dead:
            return
        idx = (~gone).nonzero()[:, 0]
        m = len(idx)
        self.cache.data[..., :m, :] = self.cache.data.index_select(4, idx.to(self.cache.data.device))
        self.owner[:m] = self.owner[idx].clone()
        self.owner[m:length] = -1
        self.cache.length = m


def decode_batch(target, kv: KVSpec, device, seqs: list[Sequence], max_tree: int, budget: Budget | None = None) -> int:
    """Run `seqs` to the end together (all join at once); the number of target forwards it took."""
    capacity = sum(row_slots(len(s.prompt), s.max_new_tokens, max_tree) for s in seqs)
    return run_batch(Batch(target, kv, capacity, device, max_tree, budget), seqs)
