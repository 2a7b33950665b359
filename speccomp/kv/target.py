"""Mode (b) of KV compression, LOSSY: the target itself reads the compressed cache.

The output is no longer the model's own: every token attends to what the policy kept (or to
dequantised keys/values). Everything here says so: `last_stats["lossless"]` is False and
`kv_mode` is "target". Quality is measured, not assumed: `kv_quality` runs a fixed text through
the model token by token with the compressed cache and with the full one, and reports both
perplexities and the mean KL divergence between their next-token distributions.

    prefill   the prompt runs with full attention over itself (its keys/values are exact), then the
              cache compacts it (SnapKV / H2O: votes from a forward of the last w prompt tokens)
    decode    token -> graph(past_kv = cache.dense(), positions = true positions) -> append -> compact
              (H2O: the graph also outputs the token's attention, added to the slots' scores)

Graphs: `step`, the captured one, runs the prompt (and the full-cache reference in kv_quality).
Eviction policies hand it their dense [L, 2, 1, Hkv, slots, D] kept tokens as past_kv; H2O and SnapKV
also get a copy with AttentionScores (`scored`), used only where attention is needed (the observation
window, H2O's decode steps), never for the prompt, whose [n, n] probabilities would be large. KIVI
decodes through `reader`, the graph after passes/kv_compress.py KiviCacheRead: attention reads the
packed codes and dequantises one layer at a time inside the forward.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from speccomp.backends import is_onnxruntime, lower
from speccomp.errors import OptionError, OptionTypeError
from speccomp.frontend.graph import run_passes
from speccomp.runtime.model import SpecModel
from speccomp.frontend.convention import KVSpec
from speccomp.kv.cache import make_cache
from speccomp.kv.draft import as_numpy, as_torch, numpy_dtype, policy_fits
from speccomp.kv.policies import KVPolicy, full_bytes, policy_bytes, snapkv_window, value_group
from speccomp.runtime.decode import KVCache, RootOnly, decode


def _run(step, tokens: torch.Tensor, start: int, past: torch.Tensor, *held):
    """tokens [1, q] at positions start.. over `past` (any number of slots; `held`: KiviCacheRead's inputs)."""
    q, device = tokens.shape[1], past.device  # the model's device: the numpy cache's arrays are moved there
    mask = torch.ones(1, past.shape[4] + q, dtype=torch.long, device=device)
    with torch.no_grad():
        return step(tokens, torch.arange(start, start + q, device=device)[None], mask, past, *held)


def _reads(cache, kv: KVSpec, device) -> tuple:
    """What the compressed-cache graph takes after the mask: the dense cache, or past_kv (a stride-0 view: only its
    shape is read) and KIVI's packed arrays; the numpy cache's arrays as tensors on `device` (no copies on the CPU)."""
    if not hasattr(cache, "graph_inputs"):
        return (torch.from_numpy(cache.dense()).to(device, kv.dtype),)
    past = torch.zeros((), dtype=kv.dtype, device=device).expand(kv.shape(cache.length))
    return (past, *(torch.from_numpy(a).to(device) if a.dtype == np.uint8 else as_torch(a, past)
                    for a in cache.graph_inputs()))


def _votes(scored, policy: KVPolicy, prompt: torch.Tensor, full_kv: torch.Tensor) -> np.ndarray | None:
    """SnapKV / H2O votes [L, Hkv, n]: attention of the last w prompt tokens over the whole prompt."""
    n = prompt.shape[1]
    if not policy.needs_attention or n <= policy.budget:
        return None
    w = min(snapkv_window(policy.budget), n)
    outs = _run(scored, prompt[:, n - w :], n - w, full_kv[..., : n - w, :])
    return as_numpy(outs[-1][:, 0].sum(2))  # [L, 1, Hkv, w, n] -> [L, Hkv, n]


def prefill(step, scored, kv: KVSpec, policy: KVPolicy, prompt: torch.Tensor):
    """(logits of the prompt, compressed cache holding it)."""
    cache = make_cache(kv, policy, dtype=numpy_dtype(kv.dtype))
    outs = _run(step, prompt, 0, torch.zeros(kv.shape(0), dtype=kv.dtype, device=prompt.device))
    cache.append(as_numpy(outs[1]))
    cache.compact(_votes(scored, policy, prompt, outs[1]))
    return outs[0], cache


def step_token(reader, scored, cache, policy: KVPolicy, token: int, position: int, device) -> torch.Tensor:
    """One token through the graph (on `device`) over the compressed cache; its KV joins the cache. Returns logits
    [V]. `reader` reads the cache as held (KIVI: KiviCacheRead graph); H2O reads through `scored`."""
    outs = _run(scored if policy.kind == "h2o" else reader, torch.tensor([[token]], device=device), position,
                *_reads(cache, cache.kv, device))
    if policy.kind == "h2o":
        cache.accumulate(as_numpy(outs[-1][:, 0, :, 0]))  # this token's attention over the slots it read
    cache.append(as_numpy(outs[1]))
    cache.compact()
    return outs[0][0, -1]


class CompressedTarget:
    """The verifier of speccomp/runtime/decode.py's loop for kv_mode='target': the target reads the compressed
    cache. Root-only trees (plain decoding); no cache for graph drafters (`cache` None)."""

    cache = None

    def __init__(self, step, reader, scored, kv: KVSpec, policy: KVPolicy):
        self.step, self.reader, self.scored, self.kv, self.policy = step, reader, scored, kv, policy
        self.compressed, self.prompt_length = None, 0

    def prefill(self, prompt: torch.Tensor) -> tuple:
        logits, self.compressed = prefill(self.step, self.scored, self.kv, self.policy, prompt)
        self.prompt_length, self.device = prompt.shape[1], prompt.device
        return (logits,)

    def verify(self, tokens: torch.Tensor, tree) -> tuple:
        if tree.size != 1:
            raise ValueError("kv_mode='target' decodes plainly: it verifies the root alone")
        position = self.compressed.length  # every token so far is in the cache (compressed or not)
        logits = step_token(self.reader, self.scored, self.compressed, self.policy, int(tokens[0]), position,
                            self.device)
        return (logits[None, None],)

    def commit(self, path: list[int]) -> None:
        """Nothing left to keep: verify already appended the root's entry (and compacted)."""

    def kv_stats(self) -> dict:
        cache, kv, policy = self.compressed, self.kv, self.policy
        return {"kv_cache": policy.spec, "kv_mode": "target",
                "kv_bytes_full": full_bytes(kv, cache.length),  # what the full cache would hold for the same tokens
                "kv_bytes_target": cache.nbytes(),
                "kv_bytes_target_closed_form": policy_bytes(kv, policy, cache.length, self.prompt_length),
                "kv_tokens_full": cache.length, "kv_tokens_target": cache.slots}


def kv_quality(step, reader, scored, kv: KVSpec, policy: KVPolicy, ids: torch.Tensor, prompt_length: int) -> dict:
    """Teacher-forced quality of the compressed cache on `ids` [1, T]: the first `prompt_length` tokens are
    the prompt (compressed after prefill), then every later token is fed one at a time.

    Compares each next-token distribution with the full-cache model's (same graph, full cache, same
    token-by-token schedule): mean KL(full || compressed) in nats, and both perplexities over the
    predicted tokens ids[prompt_length:]."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        raise OptionTypeError("ids", ids if not isinstance(ids, torch.Tensor) else f"tensor of shape {list(ids.shape)}",
                              "must be a [1, T] tensor of token ids", "e.g. torch.tensor([ids])")
    T = ids.shape[1]
    if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or not 0 < prompt_length < T:
        raise OptionError("prompt_length", prompt_length, f"must be an int in [1, {T - 1}] for a text of {T} tokens")
    full = KVCache(kv, T, ids.device)
    full_outs = _run(step, ids[:, :prompt_length], 0, full.past())
    full.append(full_outs[1])
    full_logits = full_outs[0][0, -1]
    logits, cache = prefill(step, scored, kv, policy, ids[:, :prompt_length])
    small_logits = logits[0, -1]
    kl = nll_full = nll_small = 0.0
    for t in range(prompt_length, T):
        target = int(ids[0, t])
        p_full = full_logits.float().log_softmax(-1)
        p_small = small_logits.float().log_softmax(-1)
        kl += float((p_full.exp() * (p_full - p_small)).sum())
        nll_full -= float(p_full[target])
        nll_small -= float(p_small[target])
        if t + 1 == T:
            break
        outs = _run(step, ids[:, t : t + 1], t, full.past())
        full.append(outs[1])
        full_logits = outs[0][0, -1]
        small_logits = step_token(reader, scored, cache, policy, target, t, ids.device)
    m = T - prompt_length
    return {"kv_cache": policy.spec, "tokens_scored": m, "mean_kl": kl / m,
            "perplexity_full": math.exp(nll_full / m), "perplexity_compressed": math.exp(nll_small / m),
            "kv_bytes_full": full.past().nbytes, "kv_bytes_compressed": cache.nbytes(),
            "kv_bytes_compressed_closed_form": policy_bytes(kv, policy, cache.length, prompt_length)}


class LossyKVModel(SpecModel):
    """kv_mode='target': plain decoding over the compressed cache. LOSSY: `last_stats["lossless"]` is False."""

    export_refusal = ("a kv_mode='target' model cannot be exported: the engine runtime decodes over the full KV cache, "
                      "so the engine would silently be a plain full-cache one; export a compile without kv_cache=")
    batch_refusal = "a kv_mode='target' model decodes over one sequence's compressed cache"

    def __init__(self, spec_graph, step, backend: str, policy: KVPolicy, reader=None, scored=None):
        super().__init__(spec_graph, step, backend)
        self.policy, self.scored = policy, scored
        self.reader = step if reader is None else reader

    def _decode(self, prompt, args, sampler, acceptance):  # acceptance is "exact": generate refuses others without a drafter
        target = CompressedTarget(self.step, self.reader, self.scored, self.kv, self.policy)
        new, stats = decode(target, RootOnly(), prompt, args.max_new_tokens, set(args.eos), sampler, self.max_tree)
        return new, {**stats.as_dict(), "lossless": False, "lossy": "target reads the compressed KV cache",
                     "backend": self.backend, "providers": self.providers, **target.kv_stats()}

    def quality(self, ids: torch.Tensor, prompt_length: int) -> dict:
        """kv_quality of this model's policy on `ids` (see kv_quality)."""
        return kv_quality(self.step, self.reader, self.scored, self.kv, self.policy, ids, prompt_length)


def compile_kv_target(base, policy: KVPolicy, backend: str) -> LossyKVModel:
    from speccomp.passes.kv_compress import AttentionScores, KiviCacheRead

    kv = base.captured.kv
    policy_fits(policy, policy.spec, lambda: policy.check(kv, base.captured.max_positions))  # an OptionError on kv_cache
    if policy.kind == "kivi" and (is_onnxruntime(backend) or backend == "inductor"):  # a KeyError / ValueError inside
        raise OptionError("backend", backend, f"kv_mode='target' with {policy.spec!r} reads its quantised cache through "
                          f"a graph of codes, scales and minima that the {backend} backend does not feed",
                          f"use backend='eager', or kv_mode='draft' (lossless; runs on {backend})")
    target = run_passes(base.clone(), [])
    reader = scored = None
    if policy.needs_attention:
        scored = lower(run_passes(base.clone(), [AttentionScores()]), backend, spin=False)
    if policy.kind == "kivi":
        reader = lower(run_passes(base.clone(), [KiviCacheRead(policy.bits, policy.group, value_group(kv.head_dim))]),
                       backend, spin=False)
    return LossyKVModel(target, lower(target, backend, spin=False), backend, policy, reader, scored)
