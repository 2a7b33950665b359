"""The EAGLE drafter's host side, torch-free: the layer's own KV cache and which entries each step runs.

Both runtimes use it: the torch EagleDrafter (speccomp/drafters/eagle_drafter.py) with the layer step lowered by
the compile's backend, the engine (speccomp/engine/runtime.py) with eagle.onnx. `run` is that step
(speccomp/drafters/eagle.py's EagleStep) on numpy arrays:

    run(feats [q, H], tokens [q], positions [q], past_k [A, P, D], past_v, mask [q, P + q])
        -> out [q, H], new_k [A, q, D], new_v, top_logp [q, top], top_ids [q, top]

The layer keeps one entry per position of the text: (target feature f_p, next token x_{p+1}). The runtime hands
it the target's features of every newly accepted position (`take`: after the prefill all prompt positions,
after a verification every node of the accepted path). The next `expander` runs those pending entries in one
step into the committed cache; the last one's output is the layer's guess of the root's feature, whose top
tokens are the depth-1 drafts. A tree node c at depth d >= 1 that is expanded adds a scratch entry (the guessed
feature of its parent, its own token) at position root + d - 1, reading the committed cache, its ancestors'
scratch entries and itself; scratch entries are overwritten by the next step.
"""
from __future__ import annotations

import numpy as np

from speccomp.drafters.grow import Grown, ancestor_rows


class EagleCache:
    def __init__(self, run, num_heads: int, head_dim: int):
        self.run = run
        self.k = np.zeros((num_heads, 256, head_dim), dtype=np.float32)  # committed entries, then scratch
        self.v = np.zeros_like(self.k)
        self.begin([])

    def begin(self, prompt: list[int]) -> None:
        self.length, self.pending, self.prompt, self.root = 0, None, list(prompt), None

    def take(self, feats: np.ndarray) -> None:
        """Target features [m, H] of the newly accepted positions."""
        feats = np.asarray(feats, dtype=np.float32)
        self.pending = feats if self.pending is None else np.concatenate([self.pending, feats])
        prompt, self.prompt = self.prompt, None
        if prompt and self.length == 0 and len(self.pending) == len(prompt) > 1:
            # right after the prefill every prompt entry but the last already knows its next token (a prompt token):
            # they run now, with the prefill, rather than inside the first draft step
            self._append(self.pending[:-1], prompt[1:])
            self.pending = self.pending[-1:]

    def _room(self, n: int) -> None:
        if n > self.k.shape[1]:
            more = np.zeros((self.k.shape[0], max(n, 2 * self.k.shape[1]) - self.k.shape[1], self.k.shape[2]), np.float32)
            self.k, self.v = np.concatenate([self.k, more], 1), np.concatenate([self.v, more], 1)

    def _step(self, feats, tokens, positions, start: int, mask):
        """Entries at `positions` written to slots start..start+q-1: (out, top_logp, top_ids)."""
        q = len(tokens)
        self._room(start + q)
        out, k, v, logp, ids = self.run(np.ascontiguousarray(feats, dtype=np.float32), np.asarray(tokens, np.int64),
                                        np.asarray(positions, np.int64), self.k[:, :start], self.v[:, :start],
                                        np.asarray(mask, dtype=bool))
        self.k[:, start : start + q], self.v[:, start : start + q] = k, v
        return np.asarray(out), np.asarray(logp), np.asarray(ids)

    def _append(self, feats, tokens):
        """Commit entries (feats [m, H], next tokens [m]) after the committed ones."""
        m, c = len(tokens), self.length
        mask = np.tril(np.ones((m, c + m), dtype=bool), c)  # entry i (position c + i) reads positions <= c + i
        result = self._step(feats, tokens, np.arange(c, c + m), c, mask)
        self.length = c + m
        return result

    def _commit(self, tokens: list[int]):
        """Run the pending entries into the committed cache; the root's (guessed feature [1, H], logp, ids)."""
        if self.pending is None:  # proposed again without a verification in between: the same root
            return self.root
        m, c = len(self.pending), self.length
        if c + m != len(tokens) - 1:
            raise RuntimeError(f"EAGLE drafter out of step: {c} committed + {m} pending entries for "
                               f"{len(tokens) - 1} positions before the root")
        out, logp, ids = self._append(self.pending, tokens[c + 1 : c + m + 1])
        self.pending, self.root = None, (out[-1:], logp[-1:], ids[-1:])
        return self.root

    def expander(self, tokens: list[int]):
        """grow.py's `expand` for this step's tree: the root's tokens from the commit, deeper ones from scratch
        entries (one run per depth)."""
        root_out, root_logp, root_ids = self._commit(tokens)
        slot, out = {}, {0: root_out}
        self.out = out  # candidate -> the layer's guess of its feature, as far as this step expanded (for inspection)

        def expand(d: int, nodes: list[int], grown: Grown, k: int):
            if d == 0:
                return root_logp[:, :k].tolist(), root_ids[:, :k].tolist()
            base, used = self.length, len(slot)
            rows = np.array(ancestor_rows(nodes, grown, slot, used), dtype=bool)  # the root's entry is committed
            mask = np.concatenate([np.ones((len(nodes), base), dtype=bool), rows], 1)
            feats = np.concatenate([out[grown.parent[c]] for c in nodes])
            positions = [base + grown.depth[c] - 1 for c in nodes]
            o, logp, ids = self._step(feats, [grown.token[c] for c in nodes], positions, base + used, mask)
            for i, c in enumerate(nodes):
                out[c] = o[i : i + 1]
            return logp[:, :k].tolist(), ids[:, :k].tolist()

        return expand
