"""The decode loop: a KV cache the runtime owns, and plain greedy / sampled decoding.

`step` is any callable with the captured graph's convention (see capture.py):
    logits, new_kv, hidden = step(input_ids, position_ids, attention_mask, past_kv)
Backends hand the runtime such a callable; the runtime never looks inside it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .capture import KVSpec
from .sampling import Sampler


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
