"""Load-aware speculation: how many draft-tree nodes each row of a batch verifies this step. Torch-free: the torch
runtime's Batch (runtime/batch.py) and the engine's (engine/runtime.py) share it.

A batch step is one forward of every row's nodes packed together; on a CPU (and on a GPU once the batch is large)
its cost grows with the nodes, so trees that pay for one sequence make a big batch slower than plain decoding
(benchmarks/batch.py measured 0.42x plain at B = 8 with Token Recycling's full trees). The budget is chosen per step
for goodput, tokens gained per second (SmartSpec), allocating nodes across rows (TETRIS):

    gain  = sum over rows of E_r[tokens | cap_r]     cap_r: row r verifies at most the first cap_r nodes of its tree
    cost  = t(nodes of all rows + joining prompts)   t: the measured step-cost curve (StepCosts)

E_r[tokens | c] comes from row r's recent accepted paths (shrunk toward "no draft accepted" by PRIOR pseudo-records,
and a node is bought only where it raises the predicted goodput by more than MARGIN: measured, raw means over a few
lucky records bought nodes that did not pay, benchmarks/README.md "Batches"): a tree lists parents before children, so its first c nodes
form a tree and a path would have been accepted exactly up to its first node with index >= c; a record of a tree of
n nodes predicts every c <= n. Rows start at cap 1 (plain decoding, E = 1 exactly) and a greedy loop raises the cap of
whichever row improves gain / cost most, while one does.

Estimates need records at bigger caps, so rows look: one row a step, in turn, verifies the cap one above its choice
(rows with fewer than MIN_OWN recent records at that cap first). Looks are paid from a ledger, so that exploring can
never make a batch much slower than plain decoding (benchmarks/README.md "Batches"):

    ledger += LOOK_SHARE * t(q) every step     q: the step's nodes without the look
    ledger -= t(q + look's nodes) - t(q)       for a look, taken only while the ledger is not in debt
    ledger += the tokens the look gained over its row's choice, each at what a row costs a step: t(q) - t(q - 1)

(a token gained saves its row one step; in a batch that waits for its last row, that is the row's share of a forward,
not the step's mean price per token, which is what it is worth only where a queued request takes the freed place), so
looks cost at most LOOK_SHARE of the time plus one look beyond what they bring back; where they pay (one sequence,
cheap nodes) they fund themselves and happen every step. A look whose drafter offered fewer nodes is refunded the rest
(an empty Token Recycling table drafts nothing; that is no evidence and costs nothing). A look whose draft was
rejected also doubles the steps its row waits before its next look (up to MAX_BACKOFF; an accepted draft resets it).
A cap of 1 asks the drafter for nothing.

A row at cap 1 (not looking this step) has its drafter switched off (`idle`): nothing is asked of it, and the runtimes
skip its per-step upkeep too where the drafter declares that this costs acceptance only (`Drafter.observe_optional`:
Token Recycling's top-k over the vocabulary and table update, an engine's in-graph top-k of the row's node). Measured
(B = 8, 64 tokens, cProfile): keeping the drafters of every row that might look next learning cost ~3% of the batch's
time, ten times the looks' own nodes; a row learns from the nodes it verifies when it does look.
"""
from __future__ import annotations

import time
from collections import deque

CAPS = (1, 2, 4, 8, 16, 32, 64)  # the caps a row may get (the model's max_tree last)
HISTORY = 32  # accepted paths remembered per row
MIN_OWN = 4  # records a row needs before its own estimate is used (else the batch's pooled records)
MAX_BACKOFF = 64  # steps a row waits at most between looks after its looks kept finding its drafts rejected
MARGIN = 0.03  # a node is bought only where it raises the predicted goodput by more than this: estimates are noisy
PRIOR = 4  # pseudo-records of a step that accepted no draft, added to every estimate (Budget.expected)
LOOK_SHARE = 0.01  # looks may cost this share of the batch's step time, plus what they gain (the ledger above)


class StepCosts:
    """t(q): seconds of one forward of q packed tokens, measured lazily at powers of two by `run(q)` (`warmup` untimed
    calls, then the fastest of `repeats`: noise only ever adds time) and interpolated linearly between them
    (extrapolated past the largest). Kept non-decreasing in q (t(2q) >= t(q)): one noisy measurement must not make a
    bigger forward look cheaper than a smaller one, which would buy nodes that cost more than they gain."""

    MAX_Q = 1024  # measured up to here; larger q extrapolates the last segment

    def __init__(self, run, repeats: int = 5, warmup: int = 2):
        self.run, self.repeats, self.warmup, self.measured = run, repeats, warmup, {}
        self._curve: dict[int, float] = {}  # q -> the interpolated, monotone t(q): asked for every step

    def _at(self, q: int) -> float:
        if q not in self.measured:
            for _ in range(self.warmup):
                self.run(q)
            times = []
            for _ in range(self.repeats):
                start = time.perf_counter()
                self.run(q)
                times.append(time.perf_counter() - start)
            self.measured[q] = min(times)
        return max(self.measured[q], self._at(q // 2)) if q > 1 else self.measured[q]

    def __call__(self, q: int) -> float:
        q = max(1, int(q))
        if q not in self._curve:
            lo = min(1 << (q.bit_length() - 1), self.MAX_Q // 2)  # the power of two at or below q
            a = self._at(lo)
            self._curve[q] = a if lo == q else a + (self._at(lo * 2) - a) * (q - lo) / lo
        return self._curve[q]


class FixedCosts:
    """A given curve t(q) = fixed + per_token * q (tests; or a model fitted elsewhere)."""

    def __init__(self, fixed: float, per_token: float):
        self.fixed, self.per_token = fixed, per_token

    def __call__(self, q: int) -> float:
        return self.fixed + self.per_token * q


def _gained(path_nodes: tuple[int, ...], cap: int) -> int:
    """Tokens a step would have gained under `cap`: the accepted drafts with index < cap (indices grow along a path,
    parents coming first), plus the bonus token."""
    return 1 + sum(1 for i in path_nodes if i < cap)


class Budget:
    def __init__(self, costs, max_nodes: int):
        self.costs = costs
        self.caps = [c for c in CAPS if c < max_nodes] + [max_nodes]
        self.history: dict[int, deque] = {}  # row id -> (accepted draft node indices, cap it ran at)
        # running totals, so an estimate is O(1): row id (None: the whole batch) -> [tokens, records] per cap
        self._totals: dict = {None: [[0, 0] for _ in self.caps]}
        self._turn = 0
        self._looking: dict[int, int] = {}  # row id -> the cap it is looking at this step (above its choice)
        self.ledger = 0.0  # seconds looks may still spend (module docstring); below 0: in debt, no look
        self._look: tuple = ()  # this step's look: (row, its chosen cap, its nodes, the step's q without it, s/token)
        self._wait: dict[int, tuple[int, int]] = {}  # row id -> (steps before it may look again, its current backoff)
        self.idle: set[int] = set()  # rows whose drafter is switched off this step (set by caps_for)

    def _count(self, rid: int, record: tuple, sign: int) -> None:
        path, ran = record
        for k, cap in enumerate(self.caps):
            if cap > ran:
                break
            for key in (rid, None):
                self._totals[key][k][0] += sign * _gained(path, cap)
                self._totals[key][k][1] += sign

    def record(self, rid: int, path: list[int], nodes: int) -> None:
        """Row `rid` verified a tree of `nodes` nodes (at most its cap; fewer where the drafter had less to offer) and
        accepted `path`. It predicts every cap up to `nodes` and says nothing of bigger ones: a look at cap 2 that found
        no draft (Token Recycling's table still empty) is no evidence that drafts fail, and costs nothing to repeat."""
        history = self.history.setdefault(rid, deque(maxlen=HISTORY))
        self._totals.setdefault(rid, [[0, 0] for _ in self.caps])
        if len(history) == HISTORY:
            self._count(rid, history[0], -1)  # the oldest record leaves
        history.append((tuple(path[1:]), nodes))
        self._count(rid, history[-1], +1)
        if self._looking.pop(rid, None) is not None and self._look and self._look[0] == rid:
            _, chosen, extra, q, per_token = self._look
            # refund what the look did not use (its drafter offered fewer nodes), credit what it gained
            self.ledger += self.costs(q + extra) - self.costs(q + max(0, nodes - chosen))
            self.ledger += (_gained(path[1:], nodes) - _gained(path[1:], chosen)) * per_token
            self._look = ()
            if nodes > chosen:  # a look that found no draft says nothing
                _, backoff = self._wait.get(rid, (0, 1))
                paid = len(path) > 1  # a draft was accepted: look again as soon as records allow
                backoff = 1 if paid else min(2 * backoff, MAX_BACKOFF)
                self._wait[rid] = (0 if paid else backoff, backoff)

    def forget(self, rid: int) -> None:
        self._looking.pop(rid, None)
        if self._look and self._look[0] == rid:
            self._look = ()
        self._wait.pop(rid, None)
        for record in self.history.pop(rid, ()):
            self._count(rid, record, -1)
        self._totals.pop(rid, None)

    def expected(self, rid: int, cap: int) -> float | None:
        """E[tokens a step | cap] for row `rid`, None where no record ran at a cap that large."""
        if cap <= 1:
            return 1.0
        k = self.caps.index(cap)
        own = self._totals.get(rid)
        tokens, records = own[k] if own is not None and own[k][1] >= MIN_OWN else self._totals[None][k]
        # shrunk toward "no draft accepted" (PRIOR pseudo-records of 1 token): a cap chosen on a few lucky records
        # keeps producing records at that cap, so raw means over few records overpay (benchmarks/README.md, batches)
        return (tokens + PRIOR) / (records + PRIOR) if records else None

    def caps_for(self, rids: list[int], extra_q: int = 0) -> dict[int, int]:
        """Each row's cap this step; `extra_q`: tokens of joining prompts riding in the same forward."""
        level = {r: 0 for r in rids}  # index into self.caps
        gains = {r: 1.0 for r in rids}
        q, total = extra_q + len(rids), float(len(rids))
        best = total / self.costs(q)
        while True:
            pick = None
            for r in rids:
                if level[r] + 1 >= len(self.caps):
                    continue
                nxt = self.caps[level[r] + 1]
                e = self.expected(r, nxt)
                if e is None:
                    continue
                dq = nxt - self.caps[level[r]]
                score = (total - gains[r] + e) / self.costs(q + dq)
                if score > best * (1 + MARGIN) and (pick is None or score > pick[0]):
                    pick = (score, r, e, dq)
            if pick is None:
                break
            best, r, e, dq = pick
            total += e - gains[r]
            level[r], gains[r], q = level[r] + 1, e, q + dq
        caps = {r: self.caps[level[r]] for r in rids}
        for r in rids:  # rows whose last looks found drafts rejected wait longer and longer before the next
            wait, backoff = self._wait.get(r, (0, 1))
            self._wait[r] = (max(0, wait - 1), backoff)
        can = [r for r in rids if level[r] + 1 < len(self.caps) and self._wait[r][0] == 0]
        curious = [r for r in can if self._unseen(r, self.caps[level[r] + 1])] or can
        step = self.costs(q)
        self.ledger = min(self.ledger + LOOK_SHARE * step, step)  # not hoarded past one step's time
        if curious and self.ledger >= 0:  # one row a step, in turn, verifies the next cap up (module docstring)
            r = curious[self._turn % len(curious)]
            self._turn += 1
            chosen = self.caps[level[r]]
            caps[r] = self._looking[r] = self.caps[level[r] + 1]
            self.ledger -= self.costs(q + caps[r] - chosen) - step
            self._look = (r, chosen, caps[r] - chosen, q, step - (self.costs(q - 1) if q > 1 else 0.0))
        # switched off: verifying the root alone (a looking row verifies more); its upkeep may be skipped (docstring)
        self.idle = {r for r in rids if caps[r] == 1}
        return caps

    def _unseen(self, rid: int, cap: int) -> bool:
        """Row `rid` has fewer than MIN_OWN recent records that ran at `cap` or above (so its estimate at `cap` is
        borrowed, stale or missing): such rows look before rows whose records can tell."""
        own = self._totals.get(rid)
        return own is None or own[self.caps.index(cap)][1] < MIN_OWN
