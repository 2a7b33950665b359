"""A packed batch's step, written once for runtime/batch.py's Batch (torch) and the engine's EngineBatch (numpy);
torch-free. batch.py's docstring says what a packed step is and why each row decodes as if alone.

Here: which row owns each cache slot, the step's tree mask from it, each row's tree cap from the load-aware budget
(runtime/budget.py, which is charged a row's drafter time), acceptance row by row, dropping the slots of rows that
left. A subclass does what needs its tensors: `_prefill(rid)` / `_draft(rid, cap)` -> Part, `_forward(parts, mask,
observed)` -> outs, `_share(outs, at, n)` (a row's slice), `_first(row, mine)`, `_append(outs, keep)`, `_move(idx)`.
Rows are the runtime's generations (decode.py's Sequence, the engine's _Row): accept(draft, mine),
advance(draft, path, mine, idle), observes(idle).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from speccomp.runtime.calls import row_slots


@dataclass
class Part:
    """What one row feeds a step."""

    rid: int
    tokens: object  # the row's n tokens (a list or a tensor)
    positions: np.ndarray  # [n] their positions
    block: np.ndarray  # [n, n] bool: which of the row's own nodes each node sees (a prompt: causal; a tree: ancestors)
    draft: object = None  # what the row drafted (its runtime's type); None: a prefill


class PackedBatch:
    """Rows decoding together, one packed forward a step (the module docstring); subclassed per runtime."""

    error = RuntimeError  # what a full cache raises

    def __init__(self, capacity: int, max_tree: int, budget=None):
        """`budget`: load-aware caps on each row's tree (runtime/budget.py); None: every row its drafter's whole tree."""
        self.capacity, self.max_tree, self.budget = capacity, max_tree, budget
        self.owner = np.full(capacity, -1)  # row id of each cache slot
        self.rows: dict = {}
        self.reserved: dict[int, int] = {}  # row id -> slots set aside for it (its whole generation)
        self.forwards = 0
        self._next_id = 0
        self._joined: dict[int, float] = {}  # row id -> when it joined (its stats' seconds count from there)

    def need(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache slots a row needs at most: its text, plus the room its last step's tree is verified in."""
        return row_slots(prompt_len, max_new_tokens, self.max_tree)

    def free(self) -> int:
        return self.capacity - sum(self.reserved.values())

    def add(self, row) -> int:
        """A row joins (its prompt is prefilled by the next step); its id."""
        need = self.need(len(row.prompt), row.max_new_tokens)
        if need > self.free():
            raise self.error(f"the batch's cache has {self.free()} free slots, the row needs {need}")
        rid, self._next_id = self._next_id, self._next_id + 1
        self.rows[rid], self.reserved[rid], self._joined[rid] = row, need, time.perf_counter()
        return rid

    def remove(self, rid: int) -> None:
        """A row leaves (done, or its client went away): its slots are freed, its drafter told (Drafter.finish)."""
        self.rows[rid].finish()
        del self.rows[rid], self.reserved[rid], self._joined[rid]
        if self.budget is not None:
            self.budget.forget(rid)
        self._compact()

    def step(self) -> dict[int, list[int]]:
        """One forward for every unfinished row; the tokens each emitted (finished rows stay until `remove`)."""
        running = [rid for rid, row in self.rows.items() if row.out and not row.done]
        joining = [rid for rid, row in self.rows.items() if not row.out]
        caps = {} if self.budget is None else self.budget.caps_for(
            running, extra_q=sum(len(self.rows[r].prompt) for r in joining),
            remaining={r: self.rows[r].max_new_tokens - len(self.rows[r].out) for r in running},
            past=self.cache.length)
        parts = [self._prefill(rid) for rid in joining]
        parts += [self._charged(rid, self._draft, rid, caps.get(rid)) for rid in running]  # a look's drafting: its price
        if not parts:
            return {}
        idle = set() if self.budget is None else self.budget.idle
        outs = self._forward(parts, *self._mask(parts, idle))
        self.forwards += 1
        keep, owners, emitted, at = [], [], {}, 0
        for p in parts:
            row, n = self.rows[p.rid], len(p.tokens)
            before, mine = len(row.out), self._share(outs, at, n)
            if p.draft is None:
                self._first(row, mine)
                kept = list(range(n))
            else:
                kept = row.accept(p.draft, mine)
                self._charged(p.rid, row.advance, p.draft, kept, mine, p.rid in idle)  # and so is its learning
                if self.budget is not None:
                    self.budget.record(p.rid, kept, n)  # the tree's nodes, <= caps[rid]
            self._settled(row, time.perf_counter() - self._joined[p.rid], p.draft is None)
            keep += [at + k for k in kept]
            owners += [p.rid] * len(kept)
            emitted[p.rid] = row.out[before:]
            at += n
        start = self.cache.length
        self._append(outs, keep)
        self.owner[start:start + len(keep)] = owners
        return emitted

    def _charged(self, rid: int, fn, *args):
        """fn(*args), its seconds charged to the row's budget where they count (a look pays its drafter's time)."""
        if self.budget is None or not self.budget.charges(rid):
            return fn(*args)
        start = time.perf_counter()
        out = fn(*args)
        self.budget.charge(rid, time.perf_counter() - start)
        return out

    def _mask(self, parts: list[Part], idle: set) -> tuple[np.ndarray, list[int]]:
        """The step's tree mask [q, past + q] and the nodes whose outputs a drafter observes: not a prefill's, nor a
        switched-off row's whose drafter may skip observing (`observes`; a Token Recycling engine then computes no
        top-k for them)."""
        q = sum(len(p.tokens) for p in parts)
        if self.cache.length + q > self.capacity:  # the slots of rows that left, kept lazily, make the room:
            self._compact(force=True)  # every live row's slots and tree fit in its reservation, and those in capacity
        past = self.cache.length
        if past + q > self.capacity:
            raise self.error(f"KV cache overflow: {past} + {q} > capacity {self.capacity}")
        mask, observed, at = np.zeros((q, past + q), dtype=bool), [], 0
        for p in parts:
            n = len(p.tokens)
            mask[at:at + n, :past] = self.owner[:past] == p.rid
            mask[at:at + n, past + at:past + at + n] = p.block
            if p.draft is not None and self.rows[p.rid].observes(p.rid in idle):
                observed += range(at, at + n)
            at += n
        return mask, observed

    def _compact(self, force: bool = False) -> None:
        """Drop the slots of rows that left, keeping the others' in order (attention does not care where a key sits:
        its row tag and rotary position say all). Lazily: a left row's slots are untagged at once (no query sees
        them), and moved only once they are as many as the live ones (so a copy of the cache is amortised), or when a
        step needs them (`force`: a row admitted against the reservations may need slots left rows still hold)."""
        length = self.cache.length
        live = np.isin(self.owner[:length], list(self.rows))
        self.owner[:length][~live] = -1
        m = int(live.sum())
        if m == length or (length - m < m and not force):
            return
        idx = live.nonzero()[0]
        self._move(idx)
        self.owner[:m], self.owner[m:length] = self.owner[idx], -1
        self.cache.length = m

    def _settled(self, row, seconds: float, prefill: bool) -> None:
        """A row's step is done, `seconds` after it joined (a runtime that keeps per-row stats records them)."""
