"""KV-cache compression (issue 7): policy specs, the compression math, compressed caches (bytes, rollback),
the AttentionScores pass, and mode (a): a lossless self-drafter over the compressed cache."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import speccomp
from speccomp.backends import lower
from speccomp.frontend.convention import KVSpec
from speccomp.frontend import capture
from speccomp.kv.cache import make_cache, needs_votes
from speccomp.frontend.graph import SpecGraph, run_passes
from speccomp.kv.policies import (
    KVPolicyError,
    dequantize_keys,
    dequantize_values,
    full_bytes,
    gather_tokens,
    kivi_split,
    pack_codes,
    parse_kv_cache,
    policy_bytes,
    pool_votes,
    pooled_attention,
    quantize_keys,
    quantize_values,
    sink_keep,
    topk_keep,
    unpack_codes,
    value_group,
)
from speccomp.kv.target import _reads
from speccomp.passes.kv_compress import KIVI_INPUTS, AttentionScores, KiviCacheRead
from speccomp.passes.tree_attention import TreeAttention
from tiny_models import ARCHITECTURES, tiny_llama

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
POLICIES = ["sink:16", "snapkv:16", "h2o:16", "kivi4:8:8", "kivi2:8:8", "kivi8:8:8"]


def random_kv(spec: KVSpec, length: int, seed: int = 0) -> np.ndarray:
    """Keys/values as the compressed caches (numpy, shared with the engine) hold them."""
    return torch.randn(*spec.shape(length), generator=torch.Generator().manual_seed(seed)).numpy()


def random_votes(spec: KVSpec, length: int, seed: int = 1) -> np.ndarray:
    return torch.rand(spec.num_layers, spec.num_kv_heads, length, generator=torch.Generator().manual_seed(seed)).numpy()


# --------------------------------------------------------------------------------------
# Specs and validation
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, fields",
    [
        ("sink:256", dict(kind="sink", budget=256, sinks=4, window=252)),
        ("sink:64:2", dict(kind="sink", budget=64, sinks=2, window=62)),
        ("snapkv:512", dict(kind="snapkv", budget=512, window=32)),
        ("snapkv:16", dict(kind="snapkv", budget=16, window=8)),
        ("h2o:512", dict(kind="h2o", budget=512, window=256)),
        ("kivi4", dict(kind="kivi", bits=4, residual=128, group=32, window=128)),
        ("kivi2:64", dict(kind="kivi", bits=2, residual=64, group=32)),
        ("KIVI8:16:8", dict(kind="kivi", bits=8, residual=16, group=8)),
        ("sink:16:0", dict(kind="sink", budget=16, sinks=0, window=16)),  # a plain sliding window, as 'sink:1' gets
        ("sink:1", dict(kind="sink", budget=1, sinks=0, window=1)),
    ],
)
def test_parse_accepted_forms(spec, fields):
    policy = parse_kv_cache(spec)
    for name, value in fields.items():
        assert getattr(policy, name) == value, (spec, name)
    assert policy.spec == spec


@pytest.mark.parametrize(
    "spec, match",
    [
        ("sink:0", r"budget must be >= 1, got 0"),
        ("h2o:0", r"budget must be >= 1, got 0"),
        ("snapkv:-5", r"budget must be >= 1"),
        ("sink:abc", r"budget 'abc' is not an integer"),
        ("sink", r"sink takes BUDGET\[:SINKS\]"),
        ("sink:4:4", r"must exceed the 4 sink tokens"),
        ("h2o:1", r"needs a budget >= 2"),
        ("kivi3", r"KIVI bits must be one of \[2, 4, 8\]"),
        ("kivi16", r"KIVI bits must be one of \[2, 4, 8\]"),
        ("kivi", r"KIVI bits must be one of \[2, 4, 8\]"),
        ("kivi4:0", r"full-precision window must be >= 1"),
        ("kivi4:8:8:8", r"too many"),
        ("zip", r"unknown kv_cache 'zip'; accepted forms: 'sink:BUDGET'"),
        ("sink:8_0", r"budget '8_0' is not an integer"), ("h2o:\u0661\u0666", r"is not an integer"),
        ("kivi4: 16", r"is not an integer"),
        (42, r"expected a string"),
    ],
)
def test_bad_specs_name_accepted_forms(spec, match):
    with pytest.raises(KVPolicyError, match=match):
        parse_kv_cache(spec)
    assert issubclass(KVPolicyError, ValueError)


def test_policy_checks_context_window_and_packing():
    with pytest.raises(KVPolicyError, match=r"budget 300 is larger than the model's context of 256"):
        parse_kv_cache("sink:300").check(SPEC, max_positions=256)
    with pytest.raises(KVPolicyError, match=r"full-precision window 512 is larger than the model's context"):
        parse_kv_cache("kivi4:512").check(SPEC, max_positions=256)
    with pytest.raises(KVPolicyError, match=r"window is 4 tokens but at least 7"):
        parse_kv_cache("h2o:8").check(SPEC, min_window=7)
    odd = KVSpec(2, 2, 6, torch.float32)
    with pytest.raises(KVPolicyError, match=r"head dimension 6 is not a multiple of 4"):
        parse_kv_cache("kivi2").check(odd)
    parse_kv_cache("kivi4").check(odd)  # two 4-bit codes per byte fit 6 channels
    assert parse_kv_cache("sink:256").check(SPEC, max_positions=256, min_window=7).budget == 256


# --------------------------------------------------------------------------------------
# Compression math
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packing_round_trips_and_really_shrinks(bits):
    codes = np.random.default_rng(bits).integers(0, 2**bits, (3, 5, 16), dtype=np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == (3, 5, 16 * bits // 8)
    assert packed.nbytes == codes.nbytes * bits // 8 and (packed.flags.owndata or bits == 8)  # storage, not a view
    assert np.array_equal(unpack_codes(packed, bits), codes)
    if bits == 4:  # low nibble first: codes (1, 2) -> 0x21
        assert pack_codes(np.array([[1, 2]], dtype=np.uint8), 4).item() == 0x21


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_error_bounds_keys_per_channel_values_per_token(bits):
    g = np.random.default_rng(0)
    k = g.standard_normal((2, 3, 64, 16), dtype=np.float32)  # [..., T, D]
    k[..., 5] *= 50  # an outlier channel, as real keys have
    qk = quantize_keys(k, bits, group=16)
    assert qk.scale.shape == (2, 3, 4, 16)  # one (scale, min) per (group of 16 tokens, channel)
    err = np.abs(dequantize_keys(qk, 16) - k)
    bound = qk.scale.repeat(16, axis=-2) / 2  # [..., T, D]
    assert (err <= bound * (1 + 1e-5) + 1e-6).all()
    # per channel: the outlier channel's range does not coarsen the others
    assert err[..., 5].max() > 10 * err[..., [c for c in range(16) if c != 5]].max()

    v = g.standard_normal((2, 3, 64, 16), dtype=np.float32)
    v[..., 7, :] *= 50  # an outlier token
    qv = quantize_values(v, bits, group=8)
    assert qv.scale.shape == (2, 3, 64, 2)  # one (scale, min) per (token, 8 channels)
    err = np.abs(dequantize_values(qv, 8) - v)
    assert (err <= qv.scale.repeat(8, axis=-1) / 2 * (1 + 1e-5) + 1e-6).all()
    assert err[..., 7, :].max() > 10 * err[..., [t for t in range(64) if t != 7], :].max()


def test_more_bits_less_error():
    x = np.random.default_rng(2).standard_normal((1, 1, 64, 16), dtype=np.float32)
    errors = [float(np.abs(dequantize_keys(quantize_keys(x, b, 32), 32) - x).mean()) for b in (2, 4, 8)]
    assert errors[0] > 3 * errors[1] > 9 * errors[2] > 0


def test_constant_group_quantises_exactly():
    x = np.full((1, 1, 8, 8), 0.3, dtype=np.float32)
    assert np.array_equal(dequantize_keys(quantize_keys(x, 2, 8), 8), x)
    assert np.array_equal(dequantize_values(quantize_values(x, 2, 8), 8), x)


def test_sink_and_topk_selection():
    assert sink_keep(10, 2, 6).tolist() == [0, 1, 6, 7, 8, 9]
    assert sink_keep(5, 2, 6).tolist() == [0, 1, 2, 3, 4]
    scores = np.zeros((1, 2, 10), dtype=np.float32)
    scores[0, 0, 3] = scores[0, 1, 5] = 1.0  # heavy hitters differ per KV head
    scores[0, :, 8:] = 9.0  # recent tokens win by position, not by score
    keep = topk_keep(scores, recent=3, budget=4)  # 3 recent + 1 heavy hitter per KV head
    assert keep.tolist() == [[[3, 7, 8, 9], [5, 7, 8, 9]]]
    assert np.array_equal(keep, np.sort(keep, -1))  # position order is kept


def test_votes_pooled_per_kv_head_and_over_neighbours():
    probs = np.zeros((1, 4, 2, 6), dtype=np.float32)  # [L, H=4 query heads, q, T], 2 KV heads
    probs[0, 0, :, 1] = 1.0  # only query head 0 (KV head 0) looks at token 1
    pooled = pooled_attention(probs, num_kv_heads=2)  # [L, Hkv, q, T]
    assert pooled.shape == (1, 2, 2, 6)
    assert pooled[0, 0, :, 1].tolist() == [0.5, 0.5] and np.abs(pooled[0, 1]).sum() == 0
    votes = np.zeros((1, 1, 9), dtype=np.float32)
    votes[0, 0, 4] = 7.0
    smoothed = pool_votes(votes, kernel=3)
    assert np.nonzero(smoothed[0, 0])[0].tolist() == [3, 4, 5]  # a voted token lends its neighbours votes
    assert np.allclose(smoothed[0, 0, 3:6], 7 / 3)  # each the mean over its window of 3


def test_gather_tokens_per_head():
    kv = random_kv(SPEC, 6)
    keep = np.array([[[0, 2], [1, 5]], [[3, 4], [0, 1]]])  # [L, Hkv, 2]
    out = gather_tokens(kv, keep)
    assert out.shape == SPEC.shape(2)
    assert np.array_equal(out[1, :, 0, 0], kv[1, :, 0, 0][:, [3, 4]])
    assert np.array_equal(out[0, :, 0, 1], kv[0, :, 0, 1][:, [1, 5]])


# --------------------------------------------------------------------------------------
# Compressed caches: zero compression, bytes, rollback, the recent window
# --------------------------------------------------------------------------------------
def filled(policy_spec: str, full: np.ndarray, prompt: int, spec: KVSpec = SPEC):
    """A cache fed like the drafter feeds it: the prompt (compacted with votes), then one token at a time."""
    policy = parse_kv_cache(policy_spec)
    cache = make_cache(spec, policy)
    cache.append(full[..., :prompt, :])
    cache.compact(random_votes(spec, prompt) if policy.needs_attention else None)
    for t in range(prompt, full.shape[4]):
        cache.append(full[..., t : t + 1, :])
        cache.compact()
    return cache


@pytest.mark.parametrize("spec", ["sink:64", "snapkv:64", "h2o:64", "kivi4:64:8", "kivi2:64", "kivi8:70:8"])
def test_zero_compression_is_the_full_cache_bitwise(spec):
    full = random_kv(SPEC, 60)
    cache = filled(spec, full, prompt=40)
    assert np.array_equal(cache.dense(), full)
    assert np.array_equal(cache.workspace(5)[..., :60, :], full)
    assert cache.nbytes() == full.nbytes == full_bytes(SPEC, 60)


@pytest.mark.parametrize("spec", POLICIES)
def test_bytes_held_equal_the_closed_form(spec):
    full = random_kv(SPEC, 90)
    policy = parse_kv_cache(spec)
    cache = make_cache(SPEC, policy)
    cache.append(full[..., :50, :])
    cache.compact(random_votes(SPEC, 50) if policy.needs_attention else None)
    for t in range(50, 90):
        assert cache.nbytes() == policy_bytes(SPEC, policy, t, prompt_length=50), t
        cache.append(full[..., t : t + 1, :])
        cache.compact()
    assert cache.length == 90
    assert cache.nbytes() == policy_bytes(SPEC, policy, 90, prompt_length=50) < full_bytes(SPEC, 90)
    if policy.kind in ("sink", "h2o"):
        assert cache.slots == 16 and cache.nbytes() == full_bytes(SPEC, 16)
    if policy.kind == "snapkv":
        assert cache.slots == 16 + 40  # the prompt is compressed once; decoded tokens are kept
    if policy.kind == "kivi":  # the packed tensors' storage really is that small
        quantised, tail = kivi_split(90, 8, 8)
        assert (quantised, tail) == (80, 10) and cache.tail_len == tail
        codes = cache.keys.packed
        assert codes.dtype == np.uint8 and codes.flags.owndata and codes.nbytes == codes.size
        assert codes.size == 2 * 2 * quantised * 8 * policy.bits // 8


def test_kivi_memory_on_a_real_sized_head():
    """SmolLM2-like heads (D = 64) at 1k tokens, 128 of them full precision: int4 holds 29% of the full
    cache, int2 23% (codes 1/8 or 1/16 of fp32, plus fp32 scale and minimum per 32 values: 1/16)."""
    spec = KVSpec(num_layers=2, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    full = random_kv(spec, 1024)
    for text, ratio in (("kivi4", 0.29), ("kivi2", 0.235)):
        cache = filled(text, full, prompt=1000, spec=spec)
        held = cache.nbytes()
        assert held == policy_bytes(spec, parse_kv_cache(text), 1024) < ratio * full.nbytes, (text, held / full.nbytes)
        err = np.abs(cache.dense() - full)
        assert np.array_equal(cache.dense()[..., -128:, :], full[..., -128:, :])  # the residual window is exact
        assert 0 < err.max() < (1.0 if text == "kivi4" else 3.0)


@pytest.mark.parametrize("spec", POLICIES)
def test_recent_window_is_never_compressed(spec):
    full = random_kv(SPEC, 80)
    cache = filled(spec, full, prompt=30)
    w = cache.policy.window
    dense = cache.dense()
    if cache.policy.kind == "kivi":
        assert cache.tail_len >= w and np.array_equal(dense[..., -w:, :], full[..., -w:, :])
    else:  # every KV head holds the newest w positions, in full precision, last
        newest = np.arange(80 - w, 80)
        assert np.array_equal(cache.positions()[..., -w:], np.broadcast_to(newest, (2, 2, w)))
        assert np.array_equal(dense[..., -w:, :], full[..., -w:, :])
        # and every slot holds exactly the token at its position
        assert np.array_equal(dense, gather_tokens(full, cache.positions()))


@pytest.mark.parametrize("spec", POLICIES)
def test_rollback_is_exact(spec):
    full = random_kv(SPEC, 70)
    cache = filled(spec, full, prompt=40)
    before = (cache.dense().copy(), cache.nbytes(), cache.length, cache.slots)
    k = cache.policy.window  # a whole rejected draft path of the deepest tree the window allows
    cache.append(random_kv(SPEC, k, seed=9))
    assert cache.length == 70 + k
    cache.rollback(k)
    assert np.array_equal(cache.dense(), before[0]) and (cache.nbytes(), cache.length, cache.slots) == before[1:]
    # rolled back after a compaction, the dropped tokens are exactly the newest ones
    cache.append(full[..., 60:62, :])
    cache.compact()
    cache.rollback(2)
    assert cache.length == 70
    assert np.array_equal(cache.dense()[..., -3:, :], full[..., 67:70, :])


@pytest.mark.parametrize("spec", POLICIES)
def test_extend_is_append_then_compact(spec):
    """extend (the drafter's sync) holds what append + compact hold, to the bit: slots, positions, scores, length,
    bytes. For sink it copies only the kept tokens (a prompt far past the budget, then chunks that overflow it)."""
    policy = parse_kv_cache(spec)
    full = random_kv(SPEC, 140)
    a, b = make_cache(SPEC, policy), make_cache(SPEC, policy)
    chunks = ((0, 90), (90, 93), (93, 94), (94, 120), (120, 140))
    if policy.kind == "sink":  # fewer old slots than sinks, then a chunk far past the budget
        chunks = ((0, 2), (2, 90), *chunks[1:])
    for start, stop in chunks:
        votes = random_votes(SPEC, stop) if needs_votes(a, stop) else None
        a.append(full[..., start:stop, :])
        a.compact(votes)
        b.extend(full[..., start:stop, :], votes)
        assert (a.length, a.slots, a.nbytes()) == (b.length, b.slots, b.nbytes()) == (stop, a.slots, a.nbytes())
        assert np.array_equal(a.dense(), b.dense())
        if policy.kind != "kivi":
            assert np.array_equal(a.positions(), b.positions()) and np.array_equal(b.dense(), gather_tokens(full, b.positions()))
            assert np.array_equal(a.score[..., : a.slots], b.score[..., : b.slots])


@pytest.mark.parametrize("spec", ["sink:16", "h2o:16", "kivi4:8:8"])
def test_rollback_past_the_window_is_refused(spec):
    cache = filled(spec, random_kv(SPEC, 60), prompt=30)
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(cache.policy.window + 8)


def test_h2o_evicts_the_least_attended():
    policy = parse_kv_cache("h2o:8")  # the 4 most recent + 4 heavy hitters
    cache = make_cache(SPEC, policy)
    cache.append(random_kv(SPEC, 8))
    probs = np.zeros((2, 2, 8), dtype=np.float32)
    probs[:, 0, :6] = [0.5, 3, 2, 0.1, 0.2, 1]  # KV head 0: tokens 3, 4 least attended
    probs[:, 1, :6] = [0, 0.3, 0.2, 4, 5, 0.1]  # KV head 1: tokens 0, 5
    probs[:, :, 6:] = 0.0  # recent tokens stay whatever their score
    cache.accumulate(probs)
    cache.accumulate(probs)  # scores accumulate over steps
    assert np.array_equal(cache.score[..., :8], 2 * probs)
    cache.append(random_kv(SPEC, 2, seed=3))  # positions 8, 9: two tokens must go
    cache.compact()
    pos = cache.positions()
    assert pos[0, 0].tolist() == [0, 1, 2, 5, 6, 7, 8, 9]
    assert pos[1, 1].tolist() == [1, 2, 3, 4, 6, 7, 8, 9]
    assert cache.score[0, 0, :8].tolist() == [1.0, 6, 4, 2, 0, 0, 0, 0]  # scores move with tokens


# --------------------------------------------------------------------------------------
# The AttentionScores pass
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gemma2"])  # sdpa with GQA, eager with softcapping
def test_attention_scores_match_hf_attentions(name):
    model = ARCHITECTURES[name].build()
    sg = run_passes(SpecGraph.from_captured(capture(model)), [TreeAttention(), AttentionScores()])
    assert len(sg.gm.graph.output_node().args[0]) == 4
    step = lower(sg, "eager")
    if name == "llama":  # the scores read the un-repeated keys: lowering still drops every repeat_kv copy
        sdpa = [n for n in step.graph.nodes if "scaled_dot_product" in str(n.target)]
        assert sdpa and all(n.kwargs.get("enable_gqa") for n in sdpa)
    kv = sg.captured.kv
    ids = torch.randint(3, 100, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prefix = model(ids[:, :6], use_cache=True).past_key_values
        past = torch.stack([torch.stack([layer.keys, layer.values]) for layer in prefix.layers])
        out = step(ids[:, 6:], torch.arange(6, 10)[None], torch.ones(1, 10, dtype=torch.long), past,
                   torch.ones(4, 4, dtype=torch.bool).tril())
        model.set_attn_implementation("eager")
        ref = torch.stack([a[0] for a in model(ids, output_attentions=True).attentions])[:, :, 6:]  # [L, H, 4, 10]
    expected = pooled_attention(ref, kv.num_kv_heads)
    assert out[3].shape == (kv.num_layers, 1, kv.num_kv_heads, 4, 10)
    assert (out[3][:, 0] - expected).abs().max() < 1e-5
    assert torch.allclose(out[3].sum(-1), torch.ones(()))


# --------------------------------------------------------------------------------------
# Mode (a): a lossless self-drafter over the compressed cache
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    model = tiny_llama(num_hidden_layers=4, initializer_range=0.2)
    model.generation_config.eos_token_id = None  # HF would stop at the config's eos; speccomp is not told it
    return model


def hf_greedy(model, ids, n):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)


def prompt(seed=3, n=60):
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("spec", ["sink:16", "snapkv:16", "h2o:16", "kivi4:8:8", "kivi2:8:8"])
def test_draft_mode_greedy_equals_hf(llama, spec):
    fast = speccomp.compile(llama, kv_cache=spec)
    ids = prompt()  # 60 tokens: well past every budget / full-precision window
    assert torch.equal(fast.generate(ids, max_new_tokens=40), hf_greedy(llama, ids, 40))
    s = fast.last_stats
    assert s["lossless"] and s["kv_mode"] == "draft" and s["kv_cache"] == spec
    assert s["kv_bytes_draft"] == s["kv_bytes_draft_closed_form"] < s["kv_bytes_full"]
    assert s["kv_bytes_full"] == full_bytes(fast.kv, s["kv_tokens_full"])
    assert s["steps"] < 40  # some drafts were accepted: the drafter is real, not a no-op
    if spec in ("sink:16", "h2o:16"):
        assert s["kv_tokens_draft"] == 16


@pytest.fixture(scope="module")
def llama_base(llama):
    return SpecGraph.from_captured(capture(llama))


@pytest.fixture(scope="module")
def llama_step(llama_base):
    return lower(run_passes(llama_base.clone(), []), "eager")


def kivi_reader(base: SpecGraph, spec: str):
    policy = parse_kv_cache(spec)
    return lower(run_passes(base.clone(), [KiviCacheRead(policy.bits, policy.group, value_group(base.captured.kv.head_dim))]), "eager")


@pytest.mark.parametrize("spec", ["sink:64", "snapkv:64", "h2o:64", "kivi4:64:8", "kivi2:64:8"])
def test_zero_compression_gives_bitwise_identical_logits(llama, llama_step, spec):
    """Budget >= context: the target graph reads the compressed cache and the full one to the same bits."""
    step = llama_step
    ids = prompt(seed=6, n=50)
    with torch.no_grad():
        full = step(ids, torch.arange(50)[None], torch.ones(1, 50, dtype=torch.long), torch.zeros(step_kv(llama).shape(0)))[1]
    policy = parse_kv_cache(spec)
    cache = make_cache(step_kv(llama), policy)
    cache.append(full.numpy())
    cache.compact(random_votes(step_kv(llama), 50) if policy.needs_attention else None)
    token, pos, mask = torch.tensor([[7]]), torch.tensor([[50]]), torch.ones(1, 51, dtype=torch.long)
    with torch.no_grad():
        a = step(token, pos, mask, full)
        b = step(token, pos, mask, torch.from_numpy(cache.dense()))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def step_kv(model) -> KVSpec:
    c = model.config
    return KVSpec(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, torch.float32)


@pytest.mark.parametrize("name, spec", [("mistral", "sink:16"), ("gemma2", "h2o:16")])  # sliding windows; eager softmax
def test_draft_mode_other_architectures(name, spec):
    """Sliding windows count cache slots, and an evicting cache's slots are not positions: past the window the drafter
    masks every kept key and no draft is accepted (exact output, a drafter doing nothing, every step paying its
    forward): said at compile. KIVI keeps every token, so its slots are positions: it drafts, and its drafts are
    accepted, past the window too."""
    model = ARCHITECTURES[name].build()
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match=r"evicts tokens and the model has sliding-window attention.*'kivi4'"):
        evicting = speccomp.compile(model, kv_cache=spec)
    assert torch.equal(evicting.generate(ids, max_new_tokens=24), hf_greedy(model, ids, 24))  # exact all the same
    fast = speccomp.compile(model, kv_cache="kivi4:4:4", tree=3)
    assert torch.equal(fast.generate(ids, max_new_tokens=24), hf_greedy(model, ids, 24))
    assert fast.last_stats["steps"] < 24  # drafts accepted
    assert fast.last_stats["kv_bytes_draft"] < fast.last_stats["kv_bytes_full"]


def test_the_compressed_drafters_tree_is_checked_as_every_drafters(llama):
    """A rank past the vocabulary compiled and then failed in generate (IndexError); a top-k past it was accepted;
    tree='auto' was refused only after the capture."""
    for tree, words in (([[0], [100]], "sibling rank 100"), ("dynamic:16:100", "top_k"), ("auto", "autotune")):
        with pytest.raises(speccomp.OptionError, match=rf"^tree=.*{words}"):
            speccomp.compile(llama, kv_cache="sink:32", tree=tree)


def test_kivi_target_mode_on_onnxruntime_is_refused_naming_the_backend(llama, llama_base):
    """KIVI's target mode reads its cache through KiviCacheRead's graph (codes, scales, minima as inputs), which the
    ONNX Runtime backends do not feed: it failed with a KeyError inside OrtAttention, which took the dequantised cache
    for past_kv's own slice (now refused by its check, so such a graph keeps the copied-cache export)."""
    from speccomp.errors import UnsupportedModelError
    from speccomp.passes.grouped_query_attention import GroupedQueryAttention
    from speccomp.passes.ort_attention import OrtAttention

    for backend in ("onnxruntime", "inductor"):  # inductor: a ValueError about graph inputs it cannot size
        with pytest.raises(speccomp.OptionError, match=rf"^backend='{backend}'.*the {backend} backend does not feed.*"
                                                       r"kv_mode='draft'"):
            speccomp.compile(llama, kv_cache="kivi4:8:8", kv_mode="target", backend=backend)
    read = run_passes(llama_base.clone(), [KiviCacheRead(4, 8, 8)])
    with pytest.raises(UnsupportedModelError, match="does not take past_kv"):
        run_passes(read, [GroupedQueryAttention(), OrtAttention()])
    fast = speccomp.compile(llama, kv_cache="kivi4:8:8", kv_mode="target")
    with pytest.raises(speccomp.OptionTypeError, match=r"^ids=.*\[1, T\] tensor"):  # was an AttributeError
        fast.quality(prompt(seed=9)[0].tolist(), prompt_length=4)


def test_zero_compression_drafts_like_the_target(llama):
    fast = speccomp.compile(llama, kv_cache="sink:200", tree=3)
    ids = prompt(seed=4)
    assert torch.equal(fast.generate(ids, max_new_tokens=30), hf_greedy(llama, ids, 30))
    s = fast.last_stats
    assert s["kv_bytes_draft"] == s["kv_bytes_full"]
    assert s["acceptance_by_depth"][0] == 1.0  # the drafter is the target: its greedy chain is accepted


def test_drafts_rejected_every_step_still_exact(llama):
    """The drafter runs for real (its cache syncs every step), but every draft token is made wrong."""
    ids = prompt(seed=5)
    ref = hf_greedy(llama, ids, 30)[0].tolist()
    fast = speccomp.compile(llama, kv_cache="kivi2:8:8", tree=[[0], [1], [0, 0]])
    real_propose = fast.drafter.propose

    def wrong(ctx):
        draft = real_propose(ctx)
        target_next = ref[len(ctx.tokens)]  # what the target will emit after the root
        draft.tokens[1:] = (target_next + 1) % 96
        return draft

    fast.drafter.propose = wrong
    assert fast.generate(ids, max_new_tokens=30)[0].tolist() == ref
    s = fast.last_stats
    assert s["steps"] == 30 and all(a == 0 for a in s["acceptance_by_depth"])
    # last draft step: 28 tokens out, the newest (the root) not yet cached
    assert s["kv_tokens_full"] == 60 + 27 and s["kv_bytes_draft"] == s["kv_bytes_draft_closed_form"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kv_cache="kivi3"), r"KIVI bits must be one of \[2, 4, 8\]"),
        (dict(kv_cache="sink:0"), r"budget must be >= 1"),
        (dict(kv_cache="sink:4", kv_mode="fast"), r"kv_mode='fast': unknown kv_mode"),
        (dict(kv_cache="sink:64", kv_mode="target", drafter="ngram"), r"LOSSY.*plain decoding only"),
        (dict(kv_mode="draft"), r"needs a kv_cache= policy"),
        (dict(kv_cache="sink:64", drafter="ngram"), r"drop drafter="),
    ],
)
def test_bad_kv_options_fail_before_capture(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        speccomp.compile(llama, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kv_cache="sink:300"), r"budget 300 is larger than the model's context of 256"),
        (dict(kv_cache="h2o:8"), r"window is 4 tokens but at least 7"),  # dynamic tree: depth up to 6
        (dict(kv_cache="h2o:8", tree=2), None),  # a chain of 2 needs a window of 3 only
        # a group that never leaves the window within the context: nothing would ever be quantised (was accepted)
        (dict(kv_cache="kivi4:16:500"), r"a group of 500 tokens .* never happens within the model's context of 256"),
        (dict(kv_cache="snapkv:300", kv_mode="target"), r"budget 300 is larger"),  # was a bare KVPolicyError
        (dict(kv_cache="kivi4:200:64", kv_mode="target"), r"use a window \+ group of at most 256"),
    ],
)
def test_budget_checked_against_context_and_tree(llama, kwargs, match):
    if match is None:
        assert speccomp.compile(llama, **kwargs).drafter.min_window == 3
        return
    with pytest.raises(speccomp.OptionError, match=r"kv_cache='.*': .*" + match):  # named as the parameter, both modes
        speccomp.compile(llama, **kwargs)


def test_draft_mode_with_layer_skip(llama):
    """drafter_options skip layers in the draft graph too (fewer layers and fewer keys per draft)."""
    fast = speccomp.compile(llama, kv_cache="h2o:16", drafter_options={"skip": [1]})
    assert fast.drafter.layer_index.tolist() == [0, 2, 3]
    ids = prompt(seed=8)
    assert torch.equal(fast.generate(ids, max_new_tokens=30), hf_greedy(llama, ids, 30))
    with pytest.raises(ValueError, match=r"unknown compressed-KV drafter options \['foo'\]"):
        speccomp.compile(llama, kv_cache="sink:16", drafter_options={"foo": 1})


# --------------------------------------------------------------------------------------
# Mode (b): the target reads the compressed cache (LOSSY), quality measured
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_scored(llama_base):
    return lower(run_passes(llama_base.clone(), [AttentionScores()]), "eager")


def text_ids(n=120, seed=7):
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def test_target_mode_is_labelled_lossy_and_measures_bytes(llama):
    fast = speccomp.compile(llama, kv_cache="sink:16", kv_mode="target")
    ids = prompt()
    out = fast.generate(ids, max_new_tokens=20)
    assert out.shape == (1, 80)
    s = fast.last_stats
    assert s["lossless"] is False and "lossy" in s and s["kv_mode"] == "target"
    assert s["kv_bytes_target"] == s["kv_bytes_target_closed_form"] == full_bytes(fast.kv, 16) < s["kv_bytes_full"]
    assert s["kv_tokens_target"] == 16 and s["kv_tokens_full"] == 79
    with pytest.raises(ValueError, match=r"kv_mode='target'.*plain decoding only"):
        speccomp.compile(llama, kv_cache="sink:16", kv_mode="target", drafter="ngram")


def test_target_mode_zero_compression_is_the_model(llama):
    fast = speccomp.compile(llama, kv_cache="h2o:200", kv_mode="target")
    ids = prompt(seed=9)
    assert torch.equal(fast.generate(ids, max_new_tokens=30), hf_greedy(llama, ids, 30))
    q = fast.quality(text_ids(), prompt_length=60)
    assert q["mean_kl"] == 0.0 and q["perplexity_compressed"] == q["perplexity_full"]
    assert q["kv_bytes_compressed"] == q["kv_bytes_full"]


def test_quality_measured_token_by_token(llama, llama_base, llama_step, llama_scored):
    from speccomp.kv.target import kv_quality

    kv = step_kv(llama)
    results = {}
    for spec in ["kivi8:8:8", "kivi4:8:8", "kivi2:8:8", "sink:16", "snapkv:16", "h2o:16"]:
        reader = kivi_reader(llama_base, spec) if spec.startswith("kivi") else llama_step
        results[spec] = kv_quality(llama_step, reader, llama_scored, kv, parse_kv_cache(spec), text_ids(), 60)
    for spec, r in results.items():
        assert r["tokens_scored"] == 60 and r["mean_kl"] > 0, spec
        assert r["kv_bytes_compressed"] == r["kv_bytes_compressed_closed_form"] < r["kv_bytes_full"], spec
        assert 1 < r["perplexity_compressed"] < 1000 and r["perplexity_full"] == results["sink:16"]["perplexity_full"]
    # fewer bits, further from the full-cache model
    assert results["kivi8:8:8"]["mean_kl"] < results["kivi4:8:8"]["mean_kl"] < results["kivi2:8:8"]["mean_kl"]
    with pytest.raises(ValueError, match=r"prompt_length=.*must be an int in \[1, 119\]"):
        kv_quality(llama_step, llama_step, None, kv, parse_kv_cache("sink:16"), text_ids(), 120)


@pytest.mark.parametrize("spec", ["kivi4:8:8", "kivi2:8:8", "kivi8:8:8", "kivi4:64:8"])  # the last: nothing quantised
def test_kivi_cache_read_pass(llama, llama_base, llama_step, spec):
    """The graph reads the packed cache itself, bit for bit what the dequantised dense cache gives; past_kv
    is read for its shape only (a stride-0 view is passed)."""
    reader = kivi_reader(llama_base, spec)
    names = [n.name for n in reader.graph.nodes if n.op == "placeholder"]
    assert names == ["input_ids", "position_ids", "attention_mask", "past_kv", *KIVI_INPUTS]
    past = next(n for n in reader.graph.nodes if n.name == "past_kv")
    assert all(u.target is torch.ops.aten.sym_size.int or u.op == "call_module" for u in past.users)
    kv = step_kv(llama)
    ids = prompt(seed=10, n=50)
    with torch.no_grad():
        full = llama_step(ids, torch.arange(50)[None], torch.ones(1, 50, dtype=torch.long), torch.zeros(kv.shape(0)))[1]
    cache = make_cache(kv, parse_kv_cache(spec))
    cache.append(full.numpy())
    cache.compact()
    held = _reads(cache, kv, "cpu")  # past_kv, then the numpy cache's arrays as tensors
    assert held[0].stride() == (0,) * 6 and held[0].shape == kv.shape(50)
    tokens, pos, mask = torch.tensor([[5, 6]]), torch.tensor([[50, 51]]), torch.ones(1, 52, dtype=torch.long)
    with torch.no_grad():
        dense = llama_step(tokens, pos, mask, torch.from_numpy(cache.dense()))
        packed = reader(tokens, pos, mask, *held)
    assert torch.equal(dense[0], packed[0]) and torch.equal(dense[1], packed[1])
    if spec != "kivi4:64:8":
        assert cache.quantised == 40
        full_logits = llama_step(tokens, pos, mask, full)[0]
        assert not torch.equal(full_logits, packed[0])  # it really read the quantised keys/values


def test_draft_mode_with_4bit_weights_is_exact_and_refused_off_onnxruntime(llama):
    """drafter_options {"weights": "int4"} (QuantSpec's hierarchy): the draft graph's weight MatMuls as ONNX Runtime's
    MatMulNBits over the compressed cache, the float graph verifying: HF's greedy text, drafts accepted. Other weight
    kinds, and int4 / int8 off ONNX Runtime, are refused by name (int8 runs in tests/test_engine.py's matrix)."""
    import onnx

    from speccomp.errors import OptionError

    fast = speccomp.compile(llama, kv_cache="sink:16", tree=3, backend="onnxruntime",
                            drafter_options={"weights": "int4"})
    graph = onnx.load(str(fast.drafter.step.path), load_external_data=False).graph
    assert "MatMulNBits" in {n.op_type for n in graph.node}
    ids = prompt(seed=8, n=10).repeat(1, 5)  # repetitive: the 4-bit tiny model's drafts still get accepted
    assert torch.equal(fast.generate(ids, max_new_tokens=30), hf_greedy(llama, ids, 30))
    stats = fast.last_stats
    assert stats["tau"] > 1.0 and stats["kv_tokens_draft"] < stats["kv_tokens_full"]  # drafts accepted, cache compressed
    # the draft graph writes its entries into the compressed cache's own buffer (no copy of the cache a call)
    from speccomp.backends.onnx_kv import OrtKVStep, cache_buffer
    from speccomp.runtime.decode import DraftContext

    drafter = fast.drafter
    ctx = DraftContext(ids[0].tolist(), SimpleNamespace(data=torch.zeros(1)), 3, 4)
    whole = drafter._workspace(ctx)
    assert isinstance(drafter.step, OrtKVStep) and cache_buffer(whole[..., : drafter.cache.slots, :], 4) is whole
    assert drafter._room.length == drafter.cache.slots  # the slots in use are no scratch: a shorter view gets no writes
    assert cache_buffer(whole[..., : drafter.cache.slots - 1, :], 4) is None
    assert whole.data_ptr() == drafter.cache.data.ctypes.data  # the numpy cache itself, shared
    with pytest.raises(OptionError, match=r"weights='int2': unknown weights; accepted values: \['float', 'int4', 'int8'\]"):
        speccomp.compile(llama, kv_cache="sink:16", backend="onnxruntime", drafter_options={"weights": "int2"})
    for weights in ("int4", "int8"):
        with pytest.raises(OptionError, match=rf"weights='{weights}': {weights[3:]}-bit draft weights run in ONNX "
                                              r"Runtime.*backend='eager'"):
            speccomp.compile(llama, kv_cache="sink:16", drafter_options={"weights": weights})


def test_a_policy_built_by_hand_is_checked_and_named_like_its_string(llama, tmp_path):
    """kv_cache=KVPolicy(...) was taken unchecked: its spec "" went into stats and the engine manifest (whose loader
    then refused the engine), and fields no string can give (3-bit KIVI) crashed mid-generate."""
    from speccomp.kv.policies import KVPolicy

    fast = speccomp.compile(llama, kv_cache=KVPolicy("sink", budget=16, sinks=4))
    ids = prompt()
    ref = hf_greedy(llama, ids, 20)
    assert torch.equal(fast.generate(ids, max_new_tokens=20), ref)
    assert fast.last_stats["kv_cache"] == "sink:16:4" and fast.last_stats["steps"] < 20
    assert speccomp.load(fast.export(tmp_path / "e")).generate(ids.numpy(), max_new_tokens=20).tolist() == ref.tolist()
    assert parse_kv_cache(parse_kv_cache("sink:16")).spec == "sink:16"  # a parsed policy keeps its words
    assert parse_kv_cache(KVPolicy("sink", budget=16, sinks=4, spec="sink:256")).spec == "sink:16:4"  # not a stale one
    for bad, words in ((KVPolicy("kivi", bits=3, residual=8), "KIVI bits"), (KVPolicy("sink", budget=4, sinks=4),
                       "must exceed the 4 sink"), (KVPolicy("lru", budget=8), "unknown kv_cache")):
        with pytest.raises(speccomp.OptionError, match=f"^kv_cache=.*{words}"):
            speccomp.compile(llama, kv_cache=bad)


def test_target_mode_kivi_runs_on_a_bfloat16_model(llama):
    """KiviCacheRead dequantised into float32 whatever the model's dtype: a bfloat16 model's attention then met float32
    keys (dtype mismatch). The codes are now read in the cache's dtype."""
    import copy

    half = copy.deepcopy(llama).to(torch.bfloat16)
    fast = speccomp.compile(half, kv_cache="kivi8:8:8", kv_mode="target")
    ids = prompt()
    out = fast.generate(ids, max_new_tokens=10)
    assert out.shape == (1, 70) and fast.last_stats["kv_mode"] == "target"
    assert out[0, 60] == speccomp.compile(half).generate(ids, max_new_tokens=1)[0, 60]  # from the exact prefill


class _Seen(Exception):
    pass


def test_compressed_caches_reach_their_graphs_on_the_models_device():
    """A GPU model's compressed cache lives in numpy on the host; what the graphs get (tokens, positions, masks, the
    cache's arrays) must be on the model's device. The meta device stands in for a GPU: every tensor a graph is
    handed is recorded, then the call stops. Before, target mode made them all on the CPU and draft mode's SnapKV /
    H2O observation forward did too."""
    from speccomp.kv.target import CompressedTarget, step_token

    seen = []

    def graph(*args):
        seen.extend(a.device.type for a in args if isinstance(a, torch.Tensor))
        raise _Seen

    meta = torch.device("meta")
    for spec in ("sink:16", "h2o:16", "kivi4:8:8"):
        policy = parse_kv_cache(spec)
        with pytest.raises(_Seen):
            CompressedTarget(graph, graph, graph, SPEC, policy).prefill(torch.zeros(1, 5, dtype=torch.long, device=meta))
        cache = make_cache(SPEC, policy)
        cache.append(np.random.default_rng(0).standard_normal(SPEC.shape(40)).astype(np.float32))
        cache.compact()
        with pytest.raises(_Seen):
            step_token(graph, graph, cache, policy, 5, 40, meta)
    fast = speccomp.compile(tiny_llama(), kv_cache="snapkv:16", tree=2)
    fast.drafter.step = graph
    target = SimpleNamespace(data=torch.zeros(fast.kv.shape(40), device=meta), length=40)
    with pytest.raises(_Seen):
        fast.drafter._observe(target, list(range(41)))
    assert seen and set(seen) == {"meta"}
