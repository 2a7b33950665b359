"""Compressed KV caches with exact byte accounting and exact rollback, in numpy.

One copy for both runtimes: the torch runtime hands them numpy views of its tensors (no copy on the CPU),
the torch-free engine its own arrays. Both kinds speak the runtime's layout ([L, 2, 1, Hkv, T, D], see
frontend/convention.py) and one protocol:

    cache.append(new_kv, keep=None)   new tokens, in full precision; nothing is compressed yet
    cache.compact(votes=None)         apply the policy to tokens older than the recent window W
    cache.extend(new_kv, votes=None)  append then compact, in one (a sink cache copies only the tokens it keeps)
    cache.rollback(n)                 drop the newest n tokens (exact: they are always full precision)
    cache.accumulate(probs)           H2O: add attention probabilities [L, Hkv, slots] to each slot's score
    cache.dense()                     what attention reads: [L, 2, 1, Hkv, slots, D]
    cache.workspace(room)             dense() in a buffer with `room` free slots after it (draft scratch)
    cache.nbytes()                    bytes of keys/values (and quantisation parameters) actually held

`length` counts the sequence's tokens the cache has seen; `slots` the tokens attention reads.

Why rollback is exact: `compact` never touches the newest W tokens (W = policy.window, validated
to be >= the token tree's depth + 1), and `append` compresses nothing. So rolling back tokens
appended since the last compact restores the cache bitwise, and rolling back up to W tokens at
any time drops exactly those tokens and leaves the others as they were.

EvictingCache (sink, snapkv, h2o): the kept tokens of each KV head in position order; heads of
SnapKV and H2O keep different tokens (same count). Attention over the cache does not care which
slot a key sits in (keys carry their rotary position, and every cached key is visible), so
evicting is a gather of the kept slots.

KiviCache: the oldest tokens as packed codes in whole groups (policies.quantize_keys /
quantize_values), the newest in a full-precision tail. `workspace` keeps a dequantised mirror for a
graph that reads dense float caches (each group is dequantised once); the mirror is scratch, not
what the cache holds, and is reported by `workspace_bytes`.
"""
from __future__ import annotations

import numpy as np

from speccomp.kv.policies import (KVPolicy, Quantized, dequantize_keys, dequantize_values, gather_slots, gather_tokens,
                                   pool_votes, quantize_keys, quantize_values, sink_keep, topk_keep, value_group)


def make_cache(kv, policy: KVPolicy, min_window: int = 1, dtype=np.float32):
    """A compressed cache for `policy` (checked against the model's KV layout and the tree depth). `kv`: a KVSpec
    or any layout with num_layers, num_kv_heads, head_dim; `dtype`: the numpy dtype of the keys/values held."""
    policy.check(kv, min_window=min_window)
    return (KiviCache if policy.kind == "kivi" else EvictingCache)(kv, policy, dtype)


def needs_votes(cache, target_length: int) -> bool:
    """SnapKV / H2O, before the first sync of a prompt longer than the budget: the observation window's votes
    (the attention of the last w prompt tokens over the prompt) choose what the prompt keeps."""
    return cache.length == 0 and cache.policy.needs_attention and target_length > cache.policy.budget


def all_layers(per_kept: np.ndarray, layer_index, num_layers: int) -> np.ndarray:
    """Scores of a draft graph's layers [L', ...] (`layer_index` of the model's) in a zero [L, ...] table: a
    drafter that skips layers has no votes from them."""
    if len(layer_index) == num_layers:
        return per_kept
    full = np.zeros((num_layers, *per_kept.shape[1:]), dtype=per_kept.dtype)
    full[np.asarray(layer_index)] = per_kept
    return full


def _shape(kv, length: int) -> tuple[int, ...]:
    return (kv.num_layers, 2, 1, kv.num_kv_heads, length, kv.head_dim)


def _grow(buffer: np.ndarray, axis: int, used: int, needed: int) -> np.ndarray:
    """`buffer` with capacity >= needed along `axis` (doubling, so appends are amortised O(1))."""
    if buffer.shape[axis] >= needed:
        return buffer
    shape = list(buffer.shape)
    shape[axis] = max(needed, 2 * shape[axis], 16)
    new = np.zeros(shape, dtype=buffer.dtype)
    index = (slice(None),) * axis + (slice(0, used),)
    new[index] = buffer[index]
    return new


class EvictingCache:
    def __init__(self, kv, policy: KVPolicy, dtype=np.float32):
        self.kv, self.policy = kv, policy
        self.data = np.zeros(_shape(kv, 0), dtype=dtype)  # [L, 2, 1, Hkv, capacity, D]
        L, H = kv.num_layers, kv.num_kv_heads
        self.pos = np.zeros((L, H, 0), dtype=np.int64)  # sequence position of each slot
        self.score = np.zeros((L, H, 0), dtype=np.float32)  # H2O accumulated attention
        self.slots = self.length = 0
        self.selected = False  # SnapKV selects once, after the prompt

    def _reserve(self, needed: int) -> None:
        self.data = _grow(self.data, 4, self.slots, needed)
        self.pos = _grow(self.pos, 2, self.slots, needed)
        self.score = _grow(self.score, 2, self.slots, needed)

    def append(self, new_kv: np.ndarray, keep=None) -> None:
        if keep is not None:
            new_kv = np.take(new_kv, keep, axis=4)
        self._write(new_kv, np.arange(new_kv.shape[4]), new_kv.shape[4])

    def _write(self, kv: np.ndarray, offsets: np.ndarray, seen: int) -> None:
        """`kv`'s tokens, at sequence positions length + offsets, into the next slots; the sequence saw `seen` new."""
        n, s = kv.shape[4], self.slots
        self._reserve(s + n)
        self.data[..., s : s + n, :] = kv
        self.pos[..., s : s + n] = self.length + offsets
        self.score[..., s : s + n] = 0
        self.slots += n
        self.length += seen

    def extend(self, new_kv: np.ndarray, votes: np.ndarray | None = None) -> None:
        """append(new_kv) then compact(votes). A sink cache copies only the new tokens it keeps: the first sync
        after a 4096-token prompt kept 256 of them after copying all 4096 (0.42 s of SmolLM2's cache, once a reply)."""
        p, s, n = self.policy, self.slots, new_kv.shape[4]
        if p.kind != "sink" or s + n <= p.budget:
            self.append(new_kv)
            self.compact(votes)
            return
        keep = sink_keep(s + n, p.sinks, p.budget)  # what compact would keep of the old slots and the new tokens
        self._keep(keep[keep < s])
        new = keep[keep >= s] - s
        self._write(new_kv[..., new, :], new, n)  # indexing reads a strided view as it is (np.take copied it all)

    def rollback(self, n: int) -> None:
        if n < 0 or n > self.slots:
            raise ValueError(f"cannot roll back {n} tokens from a cache of {self.slots}")
        if not (self.pos[..., self.slots - n : self.slots] == np.arange(self.length - n, self.length)).all():
            raise ValueError(f"cannot roll back {n} tokens: only the {self.policy.window} most recent are guaranteed "
                             "uncompressed")
        self.slots -= n
        self.length -= n

    def compact(self, votes: np.ndarray | None = None) -> None:
        """Evict down to the budget. votes [L, Hkv, slots]: SnapKV's window votes (required for its one
        selection when the prompt exceeds the budget); for H2O, attention to add to the scores first."""
        p, s = self.policy, self.slots
        if p.kind == "h2o" and votes is not None:
            self.accumulate(votes)
        if p.kind == "snapkv":
            if self.selected:
                return  # SnapKV compresses the prompt only; decoded tokens are all kept
            self.selected = True
            if s <= p.budget:
                return
            if votes is None:
                raise ValueError("SnapKV selection needs the observation window's votes [L, Hkv, slots]")
            keep = topk_keep(pool_votes(votes[..., :s].astype(np.float32)), p.window, p.budget)
        elif s <= p.budget:
            return
        elif p.kind == "sink":
            keep = sink_keep(s, p.sinks, p.budget)
        else:  # h2o
            keep = topk_keep(self.score[..., :s], p.window, p.budget)
        self._keep(keep)

    def _keep(self, keep: np.ndarray) -> None:
        n = keep.shape[-1]
        self.data[..., :n, :] = gather_tokens(self.data[..., : self.slots, :], keep)  # gathers copy: no overlap
        self.pos[..., :n] = gather_slots(self.pos[..., : self.slots], keep)
        self.score[..., :n] = gather_slots(self.score[..., : self.slots], keep)
        self.slots = n

    def accumulate(self, probs: np.ndarray) -> None:
        """Add attention probabilities [L, Hkv, >= slots] (pooled per KV head) to the slots' scores."""
        self.score[..., : self.slots] += probs[..., : self.slots].astype(np.float32)

    def positions(self) -> np.ndarray:
        """Sequence position held in each slot, [L, Hkv, slots]."""
        return self.pos[..., : self.slots]

    def dense(self) -> np.ndarray:
        return self.data[..., : self.slots, :]

    def workspace(self, room: int) -> np.ndarray:
        self._reserve(self.slots + room)
        return self.data[..., : self.slots + room, :]

    def nbytes(self) -> int:
        return self.dense().nbytes

    def workspace_bytes(self) -> int:
        return 0  # attention reads the held buffer itself


class KiviCache:
    def __init__(self, kv, policy: KVPolicy, dtype=np.float32):
        self.kv, self.policy = kv, policy
        self.group, self.vgroup = policy.group, value_group(kv.head_dim)
        self.keys: Quantized | None = None  # packed [L, 1, Hkv, quantised, D*bits/8], per (group, channel) params
        self.values: Quantized | None = None  # packed [L, 1, Hkv, quantised, D*bits/8], per (token, channel group)
        self.tail = np.zeros(_shape(kv, 0), dtype=dtype)  # full precision [L, 2, 1, Hkv, cap, D]
        self.quantised = self.tail_len = 0
        self.mirror: np.ndarray | None = None  # dequantised [0, quantised) + tail copy + room (workspace)

    @property
    def length(self) -> int:
        return self.quantised + self.tail_len

    @property
    def slots(self) -> int:
        return self.length

    def append(self, new_kv: np.ndarray, keep=None) -> None:
        if keep is not None:
            new_kv = np.take(new_kv, keep, axis=4)
        n = new_kv.shape[4]
        self.tail = _grow(self.tail, 4, self.tail_len, self.tail_len + n)
        self.tail[..., self.tail_len : self.tail_len + n, :] = new_kv
        self.tail_len += n

    def rollback(self, n: int) -> None:
        if n < 0 or n > self.tail_len:
            raise ValueError(f"cannot roll back {n} tokens: only the {self.tail_len} newest are in full precision "
                             f"(the policy guarantees {self.policy.window})")
        self.tail_len -= n

    def extend(self, new_kv: np.ndarray, votes: np.ndarray | None = None) -> None:
        self.append(new_kv)
        self.compact(votes)

    def compact(self, votes: np.ndarray | None = None) -> None:
        """Quantise whole groups of the oldest full-precision tokens while the tail exceeds the window."""
        p, g = self.policy, self.group
        n = (self.tail_len - p.residual) // g * g  # tokens to quantise (whole groups, oldest first)
        if n <= 0:
            return
        old = self.tail[..., :n, :]  # [L, 2, 1, Hkv, n, D]
        keys = quantize_keys(old[:, 0], p.bits, g)
        values = quantize_values(old[:, 1], p.bits, self.vgroup)
        if self.mirror is not None and self.mirror.shape[4] < self.quantised + n:
            self.mirror = None  # too small: the next workspace() rebuilds it
        if self.mirror is not None:  # dequantise each group once, where the workspace will read it
            self.mirror[:, 0, ..., self.quantised : self.quantised + n, :] = dequantize_keys(keys, g)
            self.mirror[:, 1, ..., self.quantised : self.quantised + n, :] = dequantize_values(values, self.vgroup)
        self.keys = keys if self.keys is None else _cat(self.keys, keys)
        self.values = values if self.values is None else _cat(self.values, values)
        self.quantised += n
        rest = self.tail_len - n
        self.tail[..., :rest, :] = self.tail[..., n : self.tail_len, :].copy()  # shift left; copy: overlap
        self.tail_len = rest

    def accumulate(self, probs: np.ndarray) -> None:
        pass  # KIVI keeps every token; attention does not choose

    def _dequantised(self) -> np.ndarray:
        """[L, 2, 1, Hkv, quantised, D]."""
        if self.keys is None:
            return self.tail[..., :0, :]
        return np.stack([dequantize_keys(self.keys, self.group), dequantize_values(self.values, self.vgroup)], 1)

    def dense(self) -> np.ndarray:
        return np.concatenate([self._dequantised(), self.tail[..., : self.tail_len, :]], axis=4)

    def workspace(self, room: int) -> np.ndarray:
        needed = self.length + room
        if self.mirror is None or self.mirror.shape[4] < needed:
            mirror = np.zeros(_shape(self.kv, max(needed, 2 * self.length)), dtype=self.tail.dtype)
            mirror[..., : self.quantised, :] = self._dequantised()
            self.mirror = mirror
        self.mirror[..., self.quantised : self.length, :] = self.tail[..., : self.tail_len, :]
        return self.mirror[..., :needed, :]

    def graph_inputs(self) -> tuple:
        """What a graph rewritten by passes/kv_compress.py KiviCacheRead reads after past_kv (KIVI_INPUTS: the tail,
        key codes, key scale, key min, value codes, value scale, value min)."""
        if self.keys is None:  # nothing quantised yet: empty arrays of the right ranks
            L, H, D, dtype = self.kv.num_layers, self.kv.num_kv_heads, self.kv.head_dim, self.tail.dtype
            codes = np.zeros((L, 1, H, 0, D * self.policy.bits // 8), dtype=np.uint8)
            kparam = np.zeros((L, 1, H, 0, D), dtype=dtype)
            vparam = np.zeros((L, 1, H, 0, D // self.vgroup), dtype=dtype)
            return self.tail[..., : self.tail_len, :], codes, kparam, kparam, codes, vparam, vparam
        k, v = self.keys, self.values
        return self.tail[..., : self.tail_len, :], k.packed, k.scale, k.minimum, v.packed, v.scale, v.minimum

    def nbytes(self) -> int:
        held = self.tail[..., : self.tail_len, :].nbytes
        if self.keys is not None:
            held += self.keys.nbytes() + self.values.nbytes()
        return held

    def workspace_bytes(self) -> int:
        return 0 if self.mirror is None else self.mirror.nbytes


def _cat(a: Quantized, b: Quantized) -> Quantized:
    """Quantized tokens a then b. Exact-size storage, so the packed bytes held are the bytes used; codes and
    parameters (per key group, per value token) all run along axis -2."""
    return Quantized(np.concatenate([a.packed, b.packed], -2), np.concatenate([a.scale, b.scale], -2),
                     np.concatenate([a.minimum, b.minimum], -2), a.bits)
