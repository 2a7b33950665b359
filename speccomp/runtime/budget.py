"""Load-aware speculation: how many draft-tree nodes each row of a batch verifies this step. Torch-free: the torch
runtime's Batch (runtime/batch.py) and the engine's (engine/runtime.py) share it.

A batch step is one forward of every row's nodes packed together; on a CPU (and on a GPU once the batch is large)
its cost grows with the nodes, so trees that pay for one sequence make a big batch slower than plain decoding
(benchmarks/batch.py measured 0.42x plain at B = 8 with Token Recycling's full trees). The budget allocates nodes
across rows step by step (TETRIS), for goodput (SmartSpec) of the kind the batch has:

    requests queue for a place (`speccomp serve`, `Budget.queued`):  maximise  sum over rows of E_r / t(q)
    otherwise (generate's batches; a server with room):             maximise  1 / (t(q) * max over rows of S_r)

    E_r = E[tokens a step | cap_r]   cap_r: row r verifies its tree's first cap_r nodes   S_r = tokens left_r / E_r
    q   = the step's nodes (sum of caps + joining prompts)
    t   = the measured step-cost curve (StepCosts) at the batch's cached slots: a node costs more in a big batch

A queued request takes a freed place at once, so every token counts; a batch with nothing waiting runs until its
slowest row is done, so only raising that row (with every row tied with it) can shorten it: trees for the rows that
accept drafts while the batch waits for one that does not only cost (measured: 37% more nodes than plain for 2% fewer
forwards, benchmarks/README.md "Batches"). For one sequence both are its goodput E / t(q).

E_r[tokens | c] comes from row r's recent accepted paths (shrunk toward "no draft accepted" by PRIOR pseudo-records,
and a raise is made only where it raises the score by more than MARGIN: raw means over a few lucky records bought
nodes that did not pay): a tree lists parents before children, so its first c nodes form a tree and a path would have been
accepted exactly up to its first node with index >= c; a record of a tree of n nodes predicts every c <= n. Rows
start at cap 1 (plain decoding, E = 1 exactly) and a greedy loop makes the raise that scores best (queued: one row's
next cap; else the next caps of all the slowest rows together), while one does.

Estimates need records at bigger caps, so rows look: one row a step, in turn, verifies the cap one above its choice
(rows with fewer than MIN_OWN recent records at that cap first; with nothing queued only the slowest rows, whose
estimates alone can change the caps). Looks are paid from a ledger, never more than one step's time, so that
exploring cannot make a batch much slower than plain decoding (benchmarks/README.md "Batches"):

    ledger += LOOK_SHARE * t(q) every step     q: the step's nodes without the look
    ledger -= t(q + look's nodes) - t(q)       for a look, taken only while the ledger is not in debt
    ledger -= the looking row's drafter host time (drafting and observing: Budget.charge)
    ledger += the seconds the tokens the look gained over its row's choice save (Budget._worth)

so looks cost at most LOOK_SHARE of the time plus one look beyond what they bring back; where they pay (one sequence,
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
AHEAD_Q, AHEAD_PAST = 256, 4096  # the grid measured ahead (StepCosts.measure_ahead): 16 rows x 16 nodes, x 256 tokens
LOOK_SHARE = 0.01  # looks may cost this share of the batch's step time, plus what they gain (the ledger above)


class StepCosts:
    """t(q, past): seconds of one forward of q packed tokens over `past` cached slots, measured lazily by
    `run(q, past)` on a grid of powers of two (q from 1, past from PAST0; `warmup` untimed calls, then the fastest of
    `repeats`: noise only ever adds time) and interpolated linearly between grid points (extrapolated past the
    largest). A batch of B rows, each verifying c_r nodes over its own L_r cached tokens, is one such forward with
    q = sum of c_r and past = sum of L_r: every query is scored against every cached slot (the mask hides other rows'
    slots, it does not skip them), so a node costs more in a big batch than alone (SmolLM2-135M on onnxruntime, 2
    threads: t(16) - t(8) = 8 ms at past 256, 18 ms at past 3072). Kept non-decreasing in both: one noisy
    measurement must not make a bigger forward look cheaper than a smaller one, which would buy nodes that cost more
    than they gain. `measured` seeds the grid (a curve autotune stored: tuning/step_curve.py)."""

    MAX_Q, PAST0, MAX_PAST = 1024, 256, 16384  # measured up to here; larger extrapolates the last segment

    def __init__(self, run, repeats: int = 5, warmup: int = 2, measured: dict | None = None):
        self.run, self.repeats, self.warmup = run, repeats, warmup
        self.measured: dict[tuple[int, int], float] = dict(measured or {})  # (q, past) -> fastest seconds
        self._grid: dict[tuple[int, int], float] = {}  # (q, past) -> the monotone value at a grid point

    def _at(self, q: int, past: int) -> float:
        if (q, past) not in self._grid:
            if (q, past) not in self.measured:
                for _ in range(self.warmup):
                    self.run(q, past)
                times = []
                for _ in range(self.repeats):
                    start = time.perf_counter()
                    self.run(q, past)
                    times.append(time.perf_counter() - start)
                self.measured[(q, past)] = min(times)
                release = getattr(self.run, "release", None)
                if release is not None:  # let go of what the measurement allocated (a cache of past + q slots)
                    release()
            below = [self._at(q // 2, past)] if q > 1 else []
            below += [self._at(q, past // 2)] if past > self.PAST0 else []
            self._grid[(q, past)] = max([self.measured[(q, past)], *below])
        return self._grid[(q, past)]

    def measure_ahead(self, max_q: int = AHEAD_Q, max_past: int = AHEAD_PAST) -> None:
        """Measure the grid up to max_q x max_past now (autotune, `speccomp serve`'s start), not during batches."""
        q = 1
        while q <= max_q:
            past = self.PAST0
            while past <= max_past:
                self(q, past)
                past *= 2
            q *= 2

    def reset(self) -> None:
        """Forget every measurement (the next calls measure afresh)."""
        self.measured.clear()
        self._grid.clear()

    @staticmethod
    def _segment(x: int, first: int, last: int) -> tuple[int, float]:
        """The grid point at or below x (clamped to [first, last / 2]) and x's fraction of the way to the next."""
        lo = first
        while lo * 2 <= min(x, last // 2):
            lo *= 2
        return lo, (max(x, first) - lo) / lo

    def __call__(self, q: int, past: int = 0) -> float:
        q, past = max(1, int(q)), max(0, int(past))
        ql, qf = self._segment(q, 1, self.MAX_Q)
        pl, pf = self._segment(past, self.PAST0, self.MAX_PAST)

        def along_q(p: int) -> float:
            a = self._at(ql, p)
            return a if qf == 0 else a + (self._at(ql * 2, p) - a) * qf

        a = along_q(pl)
        return a if pf == 0 else a + (along_q(pl * 2) - a) * pf


class FixedCosts:
    """A given curve t(q, past) = fixed + per_token * q + per_slot * q * past (tests; or a model fitted elsewhere)."""

    def __init__(self, fixed: float, per_token: float, per_slot: float = 0.0):
        self.fixed, self.per_token, self.per_slot = fixed, per_token, per_slot

    def __call__(self, q: int, past: int = 0) -> float:
        return self.fixed + self.per_token * q + self.per_slot * q * past


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
        self.ledger = 0.0  # seconds looks may still spend (module docstring); below 0: in debt, no look
        self._look: tuple = ()  # this step's look: (row, its chosen cap, its nodes, the step's q without it, s/token)
        self._wait: dict[int, tuple[int, int]] = {}  # row id -> (steps before it may look again, its current backoff)
        self.idle: set[int] = set()  # rows whose drafter is switched off this step (set by caps_for)
        self._past, self._step_t = 0, {}  # the batch's cached slots this step (caps_for's `past`); t(q) at them
        self.queued = False  # requests wait for a place in the batch (`speccomp serve` sets it each step)

    def _t(self, q: int) -> float:
        """The step-cost curve at this step's cached slots (every row's, set by caps_for), memoised for the step: the
        greedy loop asks for the same q many times, and the past changes every step."""
        if q not in self._step_t:
            self._step_t[q] = self.costs(q, self._past)
        return self._step_t[q]

    @property
    def _looking(self) -> dict[int, int]:
        """Row id -> the cap it is looking at this step (above its choice): this step's look, if any."""
        return {self._look[0]: self._look[1] + self._look[2]} if self._look else {}

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
        if self._look and self._look[0] == rid:
            _, chosen, extra, q, per_token = self._look
            # refund what the look did not use (its drafter offered fewer nodes), credit what it gained
            self.ledger += self._t(q + extra) - self._t(q + max(0, nodes - chosen))
            gained = _gained(path[1:], nodes) - _gained(path[1:], chosen)  # tokens from the look's own nodes
            self.ledger += gained * per_token
            self._look = ()
            if nodes > chosen:  # a look that found no draft says nothing
                _, backoff = self._wait.get(rid, (0, 1))
                paid = gained > 0  # look again as soon as records allow
                backoff = 1 if paid else min(2 * backoff, MAX_BACKOFF)
                self._wait[rid] = (0 if paid else backoff, backoff)

    def charge(self, rid: int, seconds: float) -> None:
        """Host seconds row `rid`'s drafter spent this step (drafting, observing). Where a row looks from cap 1 they
        are part of its look's price (at cap 1 its drafter is switched off and spends none), so the ledger pays them;
        a row that looks from a bigger cap would have drafted anyway, and any other row's are not looks."""
        if self.charges(rid):
            self.ledger -= seconds

    def charges(self, rid: int) -> bool:
        """Whether `charge(rid, ...)` would count: only a look from cap 1 (the batch times nothing else)."""
        return bool(self._look) and self._look[0] == rid and self._look[1] == 1

    def forget(self, rid: int) -> None:
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

    def caps_for(self, rids: list[int], extra_q: int = 0, remaining: dict | None = None,
                 past: int = 0) -> dict[int, int]:
        """Each row's cap this step; `extra_q`: tokens of joining prompts riding in the same forward; `remaining`: row
        id -> tokens it may still emit (its max_new_tokens left; default: the same for every row); `past`: the slots
        cached for the batch (every query is scored against all of them, so they set what a node costs)."""
        self._past, self._step_t = past, {}
        if not rids:  # every row is joining (its prompt's forward)
            self.idle = set()
            return {}
        level = {r: 0 for r in rids}  # index into self.caps
        gains = {r: 1.0 for r in rids}
        left = {r: max(1.0, float(remaining[r])) if remaining else 1.0 for r in rids}
        self._look = ()  # a step that failed before its records leaves no look behind
        q = extra_q + len(rids)

        def score(q: int, gains: dict) -> float:
            if self.queued:  # requests wait: every token counts, goodput sum(E) / t(q)
                return sum(gains.values()) / self._t(q)
            return 1.0 / (self._t(q) * max(left[r] / gains[r] for r in rids))  # the batch waits for its slowest row

        def nodes(move: dict) -> int:
            return sum(self.caps[level[r] + 1] - self.caps[level[r]] for r in move)

        best = score(q, gains)
        while True:  # make the raise that scores best, while one raises the score by more than MARGIN
            scored = [(score(q + nodes(m), {**gains, **m}), m) for m in self._moves(rids, level, gains, left)]
            new, move = max(scored, key=lambda o: o[0], default=(0.0, {}))
            if new <= best * (1 + MARGIN):
                break
            best, q = new, q + nodes(move)
            for r, e in move.items():
                level[r], gains[r] = level[r] + 1, e
        caps = {r: self.caps[level[r]] for r in rids}
        for r in rids:  # rows whose last looks found drafts rejected wait longer and longer before the next
            wait, backoff = self._wait.get(r, (0, 1))
            self._wait[r] = (max(0, wait - 1), backoff)
        # rows that may look: not backing off, and, where the batch waits for its slowest rows, among them (only
        # their estimates can change the caps; another row's look would only break even on the ledger)
        can = [r for r in (rids if self.queued else self._slowest(gains, left))
               if level[r] + 1 < len(self.caps) and self._wait[r][0] == 0]
        curious = [r for r in can if self._unseen(r, self.caps[level[r] + 1])] or can
        step = self._t(q)
        self.ledger = min(self.ledger + LOOK_SHARE * step, step)  # not hoarded past one step's time
        if curious and self.ledger >= 0:  # one row a step, in turn, verifies the next cap up (module docstring)
            r = curious[self._turn % len(curious)]
            self._turn += 1
            chosen = self.caps[level[r]]
            caps[r] = self.caps[level[r] + 1]
            self.ledger -= self._t(q + caps[r] - chosen) - step
            self._look = (r, chosen, caps[r] - chosen, q, self._worth(r, q, chosen, gains, left))
        # switched off: verifying the root alone (a looking row verifies more); its upkeep may be skipped (docstring)
        self.idle = {r for r in rids if caps[r] == 1}
        return caps

    def _worth(self, rid: int, q: int, nodes: int, gains: dict, left: dict) -> float:
        """Seconds one more token of row `rid` saves (it verifies `nodes` of the step's `q`). Queued: the step's mean
        price per token. Else a token saves its row 1 / E of a step: the whole step where the batch waits for that row,
        only what the row adds to a forward, t(q) - t(q - nodes), where it does not (or not alone: rows tied with it
        hold the batch as long)."""
        if self.queued:
            return self._t(q) / sum(gains.values())
        if self._slowest(gains, left) == [rid]:  # alone the slowest: the batch ends when it does
            return self._t(q) / gains[rid]
        return (self._t(q) - (self._t(q - nodes) if q > nodes else 0.0)) / gains[rid]

    def _moves(self, rids, level, gains, left) -> list[dict]:
        """Candidate raises, each {row: E at its next cap}. Queued (goodput): any one row. Else only a raise of every
        row that needs the most steps helps (the batch waits for it): those rows together, or nothing."""
        nxt = {}
        for r in rids:
            e = self.expected(r, self.caps[level[r] + 1]) if level[r] + 1 < len(self.caps) else None
            if e is not None and e > gains[r]:
                nxt[r] = e
        if self.queued:
            return [{r: e} for r, e in nxt.items()]
        slowest = self._slowest(gains, left)
        return [{r: nxt[r] for r in slowest}] if all(r in nxt for r in slowest) else []

    @staticmethod
    def _slowest(gains: dict, left: dict) -> list[int]:
        """The rows that need the most steps still (tokens left / E), ties included."""
        worst = max(left[r] / gains[r] for r in gains)
        return [r for r in gains if left[r] / gains[r] >= worst * (1 - 1e-9)]

    def _unseen(self, rid: int, cap: int) -> bool:
        """Row `rid` has fewer than MIN_OWN recent records that ran at `cap` or above (so its estimate at `cap` is
        borrowed, stale or missing): such rows look before rows whose records can tell."""
        own = self._totals.get(rid)
        return own is None or own[self.caps.index(cap)][1] < MIN_OWN
