"""KV-cache compression policies: the `kv_cache=` spec, and the math as pure numpy functions.

Nothing here keeps state (speccomp/kv/cache.py does) and nothing imports torch: the torch runtime and the
torch-free engine compress with this one copy. Functions work on the runtime's cache layout
[L, 2, 1, Hkv, T, D] (keys at index 0, values at 1), on per-slot tables [L, Hkv, T] (votes, accumulated
attention, positions), or on one half of the cache [..., T, D].

Policies. Each keeps a recent full-precision window of W tokens that is never evicted or
quantised, so the newest W tokens can always be rolled back exactly:

    spec          what is kept                                                              W
    sink:B[:S]    StreamingLLM: the first S tokens (attention sinks, default 4) and the     B - S
                  B - S most recent
    snapkv:B      SnapKV, once after the prompt: the last w prompt tokens (observation      w
                  window, w = min(32, B // 2)) and the B - w earlier ones with most votes;
                  tokens decoded later are all kept
    h2o:B         H2O: the B // 2 most recent tokens and the B - B // 2 older ones with      B // 2
                  the largest accumulated attention; evicts while decoding
    kiviN[:R[:G]] KIVI: N-bit (N in 2, 4, 8) asymmetric quantisation of all but the R       R
                  most recent tokens (default 128); keys per channel over groups of G
                  tokens (default 32), values per token over groups of 32 channels (the
                  whole head where 32 does not divide it, e.g. D = 80);
                  8 // N codes packed per byte

Votes (SnapKV) and accumulated attention (H2O) are attention probabilities pooled per KV
head: the mean over the query heads that share it (GQA), summed over the queries that voted.

"Zero compression": a budget >= the tokens held (or a KIVI window >= them) keeps every token
in full precision, and the compressed cache equals the full cache bitwise.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

KIVI_BITS = (2, 4, 8)
DEFAULT_SINKS = 4  # StreamingLLM's 4 initial tokens
DEFAULT_KIVI_RESIDUAL = 128  # KIVI's full-precision residual length
DEFAULT_KIVI_GROUP = 32  # KIVI's group size (tokens per key group, channels per value group)
SNAPKV_WINDOW = 32  # SnapKV's observation window (capped at half the budget)
SNAPKV_KERNEL = 7  # SnapKV's pooling kernel: keep the neighbours of a voted token too

ACCEPTED_FORMS = (
    "'sink:BUDGET' or 'sink:BUDGET:SINKS' (StreamingLLM; SINKS may be 0), 'snapkv:BUDGET' (SnapKV), 'h2o:BUDGET' (H2O), "
    "'kivi2' / 'kivi4' / 'kivi8' optionally with ':RESIDUAL' or ':RESIDUAL:GROUP' (KIVI quantisation), "
    "with positive integers, e.g. 'sink:256', 'snapkv:512', 'h2o:512', 'kivi4', 'kivi2:64'"
)


class KVPolicyError(ValueError):
    """A kv_cache spec or budget that cannot work; the message says what is accepted."""


@dataclass(frozen=True)
class KVPolicy:
    kind: str  # "sink" | "snapkv" | "h2o" | "kivi"
    budget: int | None = None  # tokens kept (eviction policies); None for KIVI
    sinks: int = 0  # sink: initial tokens always kept
    bits: int | None = None  # kivi: 2, 4 or 8
    residual: int = 0  # kivi: recent tokens kept in full precision
    group: int = DEFAULT_KIVI_GROUP  # kivi: tokens per key group
    spec: str = ""  # the string it was parsed from

    @property
    def window(self) -> int:
        """Recent tokens never evicted or quantised (rollback is exact within them)."""
        if self.kind == "sink":
            return self.budget - self.sinks
        if self.kind == "snapkv":
            return snapkv_window(self.budget)
        if self.kind == "h2o":
            return self.budget // 2
        return self.residual

    @property
    def needs_attention(self) -> bool:
        """SnapKV and H2O choose tokens by attention probabilities; the graph must output them."""
        return self.kind in ("snapkv", "h2o")

    def check_window(self, min_window: int) -> None:
        """Raise KVPolicyError unless the recent window keeps a token tree of depth min_window - 1 (needs no model)."""
        if self.window < min_window:
            raise KVPolicyError(f"kv_cache {self.spec!r}: its recent full-precision window is {self.window} tokens but "
                                f"at least {min_window} (the token tree's depth + 1) must never be evicted or "
                                "quantised; raise the budget")

    def check(self, kv, max_positions: int | None = None, min_window: int = 1) -> "KVPolicy":
        """Raise KVPolicyError unless the policy fits this model's KV layout `kv` (a KVSpec, or anything with
        head_dim) and a token tree of depth min_window - 1."""
        if max_positions is not None:
            size = self.budget if self.budget is not None else self.residual
            if size > max_positions:
                what = "budget" if self.budget is not None else "full-precision window"
                raise KVPolicyError(f"kv_cache {self.spec!r}: {what} {size} is larger than the model's context of "
                                    f"{max_positions} positions; use at most {max_positions}")
            if self.kind == "kivi" and self.residual + self.group > max_positions:  # no group ever leaves the window
                raise KVPolicyError(f"kv_cache {self.spec!r}: a group of {self.group} tokens is quantised once it has "
                                    f"left the window of {self.residual}, which never happens within the model's "
                                    f"context of {max_positions} positions; use a window + group of at most "
                                    f"{max_positions}")
        self.check_window(min_window)
        if self.kind == "kivi":
            per_byte = 8 // self.bits
            if kv.head_dim % per_byte:
                raise KVPolicyError(f"kv_cache {self.spec!r}: {self.bits}-bit packing puts {per_byte} values in a "
                                    f"byte, but the head dimension {kv.head_dim} is not a multiple of {per_byte}; use "
                                    "'kivi8'")
        return self


def _int(text: str, what: str, spec, least: int = 1) -> int:
    try:
        digits = text[1:] if text.startswith("-") else text  # a negative number is refused below, as one
        if not (digits.isascii() and digits.isdecimal()):  # int() also reads "8_0", " 8" and other scripts' digits
            raise ValueError(text)
        value = int(text)
    except ValueError:
        raise KVPolicyError(f"bad kv_cache {spec!r}: {what} {text!r} is not an integer; accepted forms: {ACCEPTED_FORMS}") from None
    if value < least:
        raise KVPolicyError(f"bad kv_cache {spec!r}: {what} must be >= {least}, got {value}; accepted forms: {ACCEPTED_FORMS}")
    return value


def spec_of(policy: KVPolicy) -> str:
    """The string form of a policy's fields (what parse_kv_cache reads back), e.g. 'sink:256:4', 'kivi4:128:32'."""
    if policy.kind == "kivi":
        return f"kivi{policy.bits}:{policy.residual}:{policy.group}"
    return f"{policy.kind}:{policy.budget}" + (f":{policy.sinks}" if policy.kind == "sink" else "")


def parse_kv_cache(spec) -> KVPolicy | None:
    """The user's kv_cache= as a KVPolicy (None stays None: the full cache). A KVPolicy built by hand is checked as
    its string form is (bits, budgets, sinks) and gets that form as its `spec` when it has none."""
    if spec is None:
        return spec
    if isinstance(spec, KVPolicy):
        checked = parse_kv_cache(spec_of(spec))
        try:  # its own spec names it only where that spec means these fields (not a label, nor an edited copy's)
            same = bool(spec.spec) and replace(parse_kv_cache(spec.spec), spec="") == replace(checked, spec="")
        except KVPolicyError:
            same = False
        return replace(checked, spec=spec.spec) if same else checked
    if not isinstance(spec, str):
        raise KVPolicyError(f"unknown kv_cache {spec!r}: expected a string; accepted forms: {ACCEPTED_FORMS}")
    text = spec.strip().lower()
    name, *args = text.split(":")
    if name.startswith("kivi"):
        bits_text = name[len("kivi"):]
        if not (bits_text.isdecimal() and bits_text.isascii()) or int(bits_text) not in KIVI_BITS:
            raise KVPolicyError(f"bad kv_cache {spec!r}: KIVI bits must be one of {list(KIVI_BITS)} (e.g. 'kivi4'), "
                                f"got {bits_text!r}")
        if len(args) > 2:
            raise KVPolicyError(f"bad kv_cache {spec!r}: too many ':' fields; accepted forms: {ACCEPTED_FORMS}")
        residual = _int(args[0], "full-precision window", spec) if args else DEFAULT_KIVI_RESIDUAL
        group = _int(args[1], "group size", spec) if len(args) == 2 else DEFAULT_KIVI_GROUP
        return KVPolicy("kivi", bits=int(bits_text), residual=residual, group=group, spec=spec)
    if name not in ("sink", "snapkv", "h2o"):
        raise KVPolicyError(f"unknown kv_cache {spec!r}; accepted forms: {ACCEPTED_FORMS}")
    most = 2 if name == "sink" else 1
    if not args or len(args) > most:
        takes = "BUDGET[:SINKS]" if most == 2 else "BUDGET"
        raise KVPolicyError(f"bad kv_cache {spec!r}: {name} takes {takes}; accepted forms: {ACCEPTED_FORMS}")
    budget = _int(args[0], "budget", spec)
    if name == "sink":
        # 0 sinks: a plain sliding window (also what 'sink:1' gets: a budget of 1 leaves no room for a sink)
        sinks = _int(args[1], "sink count", spec, least=0) if len(args) == 2 else min(DEFAULT_SINKS, budget - 1)
        if budget <= sinks:
            raise KVPolicyError(f"bad kv_cache {spec!r}: budget {budget} must exceed the {sinks} sink tokens to leave "
                                "a recent window")
        return KVPolicy("sink", budget=budget, sinks=sinks, spec=spec)
    if budget < 2:
        raise KVPolicyError(f"bad kv_cache {spec!r}: {name} needs a budget >= 2 (a recent window and selected tokens)")
    return KVPolicy(name, budget=budget, spec=spec)


# ---- Token selection (eviction policies) ---------------------------------------------
def snapkv_window(budget: int) -> int:
    return min(SNAPKV_WINDOW, budget // 2)


def sink_keep(length: int, sinks: int, budget: int) -> np.ndarray:
    """Slots kept by StreamingLLM out of `length` in position order: [0, sinks) and the newest budget - sinks."""
    if length <= budget:
        return np.arange(length)
    return np.concatenate([np.arange(sinks), np.arange(length - (budget - sinks), length)])


def pool_votes(votes: np.ndarray, kernel: int = SNAPKV_KERNEL) -> np.ndarray:
    """Average each token's votes with its neighbours' (SnapKV keeps whole phrases, not lone tokens).

    votes [L, Hkv, T] -> [L, Hkv, T]; edges average over the tokens that exist (a window sum from a cumsum)."""
    T, r = votes.shape[-1], kernel // 2
    total = np.concatenate([np.zeros((*votes.shape[:-1], 1)), np.cumsum(votes, -1, dtype=np.float64)], -1)
    lo, hi = np.clip(np.arange(T) - r, 0, T), np.clip(np.arange(T) + r + 1, 0, T)
    return ((total[..., hi] - total[..., lo]) / (hi - lo)).astype(votes.dtype)


def topk_keep(scores: np.ndarray, recent: int, budget: int) -> np.ndarray:
    """Per KV head, the `budget` slots to keep: the `recent` newest and the highest-scoring older ones.

    scores [L, Hkv, T] (slots in position order) -> int64 [L, Hkv, min(T, budget)], ascending."""
    L, H, T = scores.shape
    if T <= budget:
        return np.broadcast_to(np.arange(T), (L, H, T))
    older, k = T - recent, budget - recent
    heavy = np.argpartition(-scores[..., :older], k - 1, axis=-1)[..., :k]  # [L, Hkv, budget - recent], unordered
    newest = np.broadcast_to(np.arange(older, T), (L, H, recent))
    return np.concatenate([np.sort(heavy, -1), newest], -1)


def gather_tokens(kv: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """kv [L, 2, 1, Hkv, T, D] with slots `keep` [L, Hkv, B] (per KV head) or [B] (all heads) -> [L, 2, 1, Hkv, B, D]."""
    if keep.ndim == 1:
        return np.take(kv, keep, axis=4)
    return np.take_along_axis(kv, keep[:, None, None, :, :, None], axis=4)


def gather_slots(table: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """A per-slot table [L, Hkv, T] at `keep` [L, Hkv, B] or [B] -> [L, Hkv, B]."""
    if keep.ndim == 1:
        return np.take(table, keep, axis=2)
    return np.take_along_axis(table, keep, axis=2)


def pooled_attention(probs, num_kv_heads: int):
    """Attention probabilities per query head [L, H, q, T] -> per KV head [L, Hkv, q, T] (mean over its group)."""
    L, H, q, T = probs.shape
    return probs.reshape(L, num_kv_heads, H // num_kv_heads, q, T).mean(2)


# ---- KIVI quantisation ---------------------------------------------------------------
@dataclass
class Quantized:
    """Packed codes plus the affine parameters that map them back: x ~= code * scale + minimum."""

    packed: np.ndarray  # uint8 [..., T, D * bits // 8]
    scale: np.ndarray  # float, broadcastable to [..., T, D] after the group reshape
    minimum: np.ndarray
    bits: int

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.minimum.nbytes


def quantize(x: np.ndarray, bits: int, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric min/max quantisation of `x`, one (scale, minimum) per slice along `axis`.

    Returns codes (uint8, values in [0, 2^bits - 1], shape of x) and scale, minimum (keepdims).
    |dequantize(...) - x| <= scale / 2 up to float rounding."""
    levels = 2**bits - 1
    lo = x.min(axis, keepdims=True)
    scale = (x.max(axis, keepdims=True) - lo) / np.asarray(levels, x.dtype)
    scale = np.where(scale > 0, scale, np.ones_like(scale))  # constant slice: codes 0, exact
    codes = np.clip(np.rint((x - lo) / scale), 0, levels).astype(np.uint8)
    return codes, scale, lo


def dequantize(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> np.ndarray:
    return codes.astype(scale.dtype) * scale + minimum


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [..., D] of `bits` bits -> uint8 [..., D * bits // 8]: 8 // bits codes per byte, low bits first."""
    per = 8 // bits
    if per == 1:
        return np.ascontiguousarray(codes)
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)  # [..., D/per, per]
    packed = grouped[..., 0].copy()
    for i in range(1, per):
        packed |= grouped[..., i] << np.uint8(bits * i)
    return packed


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of pack_codes: uint8 [..., P] -> uint8 codes [..., P * 8 // bits]."""
    per = 8 // bits
    if per == 1:
        return packed
    shifts = np.arange(0, 8, bits, dtype=np.uint8)  # [per]
    codes = (packed[..., None] >> shifts) & np.uint8(2**bits - 1)  # [..., P, per]
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def value_group(head_dim: int) -> int:
    """Channels per value group: KIVI's 32 where it divides the head, else the whole head."""
    return DEFAULT_KIVI_GROUP if head_dim % DEFAULT_KIVI_GROUP == 0 else head_dim


def quantize_keys(k: np.ndarray, bits: int, group: int) -> Quantized:
    """Keys [..., T, D], T a multiple of `group`: per channel over each group of `group` tokens
    (key outliers live in a few channels; a per-channel range keeps them from flattening the rest)."""
    *lead, T, D = k.shape
    grouped = k.reshape(*lead, T // group, group, D)  # [..., T/G, G, D]
    codes, scale, lo = quantize(grouped, bits, axis=-2)  # scale, lo [..., T/G, 1, D]
    return Quantized(pack_codes(codes.reshape(*lead, T, D), bits), scale.squeeze(-2), lo.squeeze(-2), bits)


def dequantize_keys(q: Quantized, group: int) -> np.ndarray:
    codes = unpack_codes(q.packed, q.bits)  # [..., T, D]
    *lead, T, D = codes.shape
    grouped = codes.reshape(*lead, T // group, group, D)
    return dequantize(grouped, q.scale[..., None, :], q.minimum[..., None, :]).reshape(*lead, T, D)


def quantize_values(v: np.ndarray, bits: int, group: int) -> Quantized:
    """Values [..., T, D]: per token over groups of `group` channels (each token's output mix is
    a weighted sum of whole value rows, so per-token ranges bound each row's error)."""
    *lead, T, D = v.shape
    grouped = v.reshape(*lead, T, D // group, group)  # [..., T, D/g, g]
    codes, scale, lo = quantize(grouped, bits, axis=-1)  # scale, lo [..., T, D/g, 1]
    return Quantized(pack_codes(codes.reshape(*lead, T, D), bits), scale.squeeze(-1), lo.squeeze(-1), bits)


def dequantize_values(q: Quantized, group: int) -> np.ndarray:
    codes = unpack_codes(q.packed, q.bits)  # [..., T, D]
    *lead, T, D = codes.shape
    grouped = codes.reshape(*lead, T, D // group, group)
    return dequantize(grouped, q.scale[..., None], q.minimum[..., None]).reshape(*lead, T, D)


def kivi_split(length: int, residual: int, group: int) -> tuple[int, int]:
    """(quantised tokens, full-precision tokens) of a KIVI cache holding `length` tokens.

    Whole groups of the oldest tokens are quantised once the full-precision tail would exceed
    residual + group - 1, so the tail stays in [residual, residual + group) once it is that long."""
    quantised = max(0, (length - residual) // group * group)
    return quantised, length - quantised


# ---- Closed-form sizes ---------------------------------------------------------------
# (kv: a KVSpec or any layout with num_layers, num_kv_heads, head_dim and a torch or numpy dtype)
def itemsize(dtype) -> int:
    size = getattr(dtype, "itemsize", None)  # torch.dtype and np.dtype have it
    return size if isinstance(size, int) else np.dtype(dtype).itemsize


def full_bytes(kv, length: int) -> int:
    """Bytes of `length` tokens of the uncompressed cache [L, 2, 1, Hkv, length, D]."""
    return length * kv.num_layers * 2 * kv.num_kv_heads * kv.head_dim * itemsize(kv.dtype)


def kivi_bytes(kv, policy: KVPolicy, length: int) -> int:
    """Packed codes + per-group scale and minimum + the full-precision tail."""
    quantised, tail = kivi_split(length, policy.residual, policy.group)
    L, H, D, item = kv.num_layers, kv.num_kv_heads, kv.head_dim, itemsize(kv.dtype)
    codes = 2 * quantised * D * policy.bits // 8  # keys and values
    key_params = 2 * (quantised // policy.group) * D * item  # scale + minimum per (group, channel)
    value_params = 2 * quantised * (D // value_group(D)) * item  # scale + minimum per (token, channel group)
    return L * H * (codes + key_params + value_params) + full_bytes(kv, tail)


def policy_bytes(kv, policy: KVPolicy, length: int, prompt_length: int | None = None) -> int:
    """Bytes a compressed cache holds after `length` tokens (`prompt_length` of them the prompt, for SnapKV)."""
    if policy.kind == "kivi":
        return kivi_bytes(kv, policy, length)
    if policy.kind == "snapkv":
        prompt = length if prompt_length is None else prompt_length
        return full_bytes(kv, min(prompt, policy.budget) + length - prompt)
    return full_bytes(kv, min(length, policy.budget))
