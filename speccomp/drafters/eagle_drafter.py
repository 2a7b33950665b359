"""EagleDrafter: grow a token tree with the EAGLE head (speccomp/drafters/eagle.py) over its own KV cache.

The head keeps one entry per position of the text: (target feature f_p, next token x_{p+1}).
The runtime hands it the target's features of every newly accepted position (reads
"path_states": after the prefill all prompt positions, after a verification every node of the accepted
path). At the next `propose` those pending entries run through the layer in one forward and join
the committed cache; the output of the last one is the head's guess of the root's feature, whose
logits score the depth-1 drafts. A tree node c at depth d >= 1 that is expanded adds a scratch
entry (the guessed feature of its parent, its own token) at position root + d - 1, attending to the
committed cache, its ancestors' scratch entries and itself; scratch entries are dropped after the step.

Trees as for Hydra: a static `Tree` (node c gets its parent's rank-r candidate) or a
`DynamicTreeSpec` (EAGLE-2: the top_k likeliest frontier nodes expand each depth; the step's tree
is the `budget` likeliest candidates).
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from speccomp.drafters.grow import MAX_DYNAMIC_DEPTH, Grown, ancestor_rows, grow, torch_top
from speccomp.runtime.decode import Draft, DraftContext, Drafter, check_tree_kind
from speccomp.runtime.tree import DynamicTreeSpec

DEFAULT_EAGLE_TREE = DynamicTreeSpec(16, 4)


class EagleDrafter(Drafter):
    name = "eagle"
    reads = ("path_states", "own_cache")  # the target's features at every accepted position; its layer's KV
    trees = ("static", "dynamic")
    forward_per_level = True

    def __init__(self, head, tree, heads_path: str | None = None):
        self.head, self.tree, self.heads_path = head, tree, heads_path
        check_tree_kind(self, tree)
        self.options = {} if heads_path is None else {"heads": heads_path}
        a, d = head.num_heads, head.head_dim
        self.k = torch.zeros(a, 256, d)  # [A, capacity, D]: committed entries, then this step's scratch
        self.v = torch.zeros(a, 256, d)
        self.length = 0  # committed entries: positions 0 .. length-1
        self.pending = None  # target features [m, H] of positions length .. length+m-1, not yet run
        self.prompt = None  # set by begin, used once by the first take_states

    def with_tree(self, tree) -> "EagleDrafter":
        return EagleDrafter(self.head, tree, self.heads_path)

    def begin(self, prompt: list[int]) -> None:
        self.length, self.pending, self.prompt = 0, None, list(prompt)

    def take_states(self, states) -> None:
        # [m, H]: the prompt after the prefill, the accepted path after a verification (in the head's dtype)
        feats = states[0].to(self.head.fc.weight.dtype)
        self.pending = feats if self.pending is None else torch.cat([self.pending, feats])
        prompt, self.prompt = self.prompt, None
        if prompt and self.length == 0 and len(self.pending) == len(prompt) > 1:
            # right after the prefill: every prompt entry but the last already knows its next token (a prompt
            # token), so it runs now, with the prefill, rather than inside the first draft step
            with torch.no_grad():
                self._append(self.pending[:-1], torch.tensor(prompt[1:], dtype=torch.long))
            self.pending = self.pending[-1:]

    def _room(self, n: int) -> None:
        if n > self.k.shape[1]:
            grow = max(n, 2 * self.k.shape[1])
            self.k = torch.cat([self.k, self.k.new_zeros(self.k.shape[0], grow - self.k.shape[1], self.k.shape[2])], 1)
            self.v = torch.cat([self.v, self.v.new_zeros(self.v.shape[0], grow - self.v.shape[1], self.v.shape[2])], 1)

    def _run(self, feats, tokens, positions, start: int, mask):
        """Entries (feats [q, H], tokens [q]) at `positions`, written to slots start..start+q-1; each query attends
        to the slots `mask` [q, start + q] allows. Returns their outputs [q, H]."""
        head, q_len = self.head, len(tokens)
        u, q, k, v = head.entries(feats, tokens, positions)  # q, k, v: [q, A, D]
        self.k[:, start : start + q_len] = k.transpose(0, 1)
        self.v[:, start : start + q_len] = v.transpose(0, 1)
        end = start + q_len
        attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], self.k[None, :, :end], self.v[None, :, :end],
                                              attn_mask=mask)  # [1, A, q, D]
        return head.finish(u, attn[0].transpose(0, 1))

    def _commit(self, ctx: DraftContext) -> torch.Tensor:
        """Run the pending entries into the committed cache; the last output (the root's guessed feature) [1, H]."""
        if self.pending is None:  # proposed again without a verification in between: same root
            return self.root_out
        m, c = self.pending.shape[0], self.length
        if c + m != len(ctx.tokens) - 1:
            raise RuntimeError(f"EAGLE drafter out of step: {c} committed + {m} pending entries for "
                               f"{len(ctx.tokens) - 1} positions before the root")
        out = self._append(self.pending, torch.tensor(ctx.tokens[c + 1 : c + m + 1], dtype=torch.long))
        self.pending, self.root_out = None, out[-1:]
        return self.root_out

    def _append(self, feats, tokens) -> torch.Tensor:
        """Commit entries (feats [m, H], next tokens [m]) after the `length` committed ones; their outputs [m, H]."""
        m, c = len(tokens), self.length
        self._room(c + m + 64)
        mask = torch.ones(m, c + m, dtype=torch.bool).tril(c)  # entry i (position c + i) sees positions <= c + i
        out = self._run(feats, tokens, torch.arange(c, c + m), c, mask)
        self.length = c + m
        return out

    def _expand(self, nodes: list[int], grown: Grown, slot: dict, out: dict) -> torch.Tensor:
        """Scratch entries for `nodes` (all at one depth >= 1): (the guessed feature of the parent, the node's
        token) at position root + depth - 1; fills slot[c] and out[c]; log-probs [k, Vd]."""
        base, used = self.length, len(slot)
        self._room(base + used + len(nodes) + 1)
        rows = torch.tensor(ancestor_rows(nodes, grown, slot, used))  # the root's entry is committed: not in scratch
        mask = torch.cat([torch.ones(len(nodes), base, dtype=torch.bool), rows], 1)
        feats = torch.cat([out[grown.parent[c]] for c in nodes])
        positions = torch.tensor([base + grown.depth[c] - 1 for c in nodes])
        o = self._run(feats, torch.tensor([grown.token[c] for c in nodes]), positions, base + used, mask)
        for i, c in enumerate(nodes):
            out[c] = o[i : i + 1]
        return self._logp(o)

    def _logp(self, o: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [k, Vd] over the draft vocabulary (the packed LM-head kernel, as Hydra drafts)."""
        from speccomp.passes.prepack_linear import linear

        return linear(o, self.head.draft_lm).log_softmax(-1)

    def propose(self, ctx: DraftContext) -> Draft:
        with torch.no_grad():
            root_out = self._commit(ctx)
            slot, out = {}, {0: root_out}

            def expand(d: int, nodes: list[int], grown: Grown, k: int):
                logp = self._logp(root_out) if d == 0 else self._expand(nodes, grown, slot, out)
                return torch_top(logp, k, self.head.draft_vocab)

            # no deeper than the head was trained to draft: its guesses past that are rarely accepted
            return grow(self.tree, ctx, expand, min(MAX_DYNAMIC_DEPTH, self.head.train_steps or MAX_DYNAMIC_DEPTH))


def make_eagle(base, options: dict, tree) -> EagleDrafter:
    from speccomp.drafters.head_drafters import heads_for
    from speccomp.drafters.eagle import load_eagle

    from speccomp.runtime.tree import check_tree_width

    path, given = heads_for(base, options, "eagle")
    head = load_eagle(path, base.model)
    if tree is not None:
        check_tree_width(tree, len(head.draft_vocab), "EAGLE head's draft vocabulary", tree)
    return EagleDrafter(head, tree if tree is not None else DEFAULT_EAGLE_TREE, given)
