"""Speculative sampling is lossless: the emitted tokens follow the model's own distribution, for every drafter,
in the torch runtime (recursive rejection sampling, `speccomp.runtime.tree.sample_accept`) and in exported engines (the
numpy walk, `speccomp.engine.accept`). And the tests have power: for each of the two acceptance code paths, a
slightly wrong rule fails the same test with the same draws (torch: on its cheapest case, which takes POWER_DRAWS
draws where the other cases take DRAWS; engines: every case takes POWER_DRAWS, a draw costs 1 ms there).

Setup: a 2-layer Llama with a 5-token vocabulary, a 20-token prompt in which every token is followed by four
different ones (prompt lookup then drafts wide), temperature 1.5. Each draw generates 4 tokens from its own
seed, so the step after the prefill verifies trees two deep (an accepted path of two drafts, then a bonus); the
statistic is the joint law of the first 3 tokens, 125 outcomes, whose exact law comes from the model itself by
enumeration (31 HF forwards). Pearson's chi-square compares the draws with it (p > 1e-3 is required; seeds are
fixed, so every run of a test sees the same draws), and every test asserts that drafts were accepted in most
runs: a sampling test in which drafts are rarely accepted tests little beyond plain sampling.
"""
import numpy as np
import pytest
import torch

import speccomp
import speccomp.engine.runtime
import speccomp.runtime.decode
import speccomp.runtime.tree
from speccomp.runtime.sampling import warp
from tiny_models import tiny_llama

pytest.importorskip("scipy")

V = 5  # vocabulary of the model: 125 outcomes for 3 tokens
PROMPT = [0, 1, 2, 3, 4, 0, 2, 4, 1, 3, 0, 3, 1, 4, 2, 0, 4, 3, 2, 1]
TEMPERATURE = 1.5
NEW_TOKENS = 4  # the chi-square scores the first 3: 4 lets the step after the prefill accept 2 drafts
DRAWS = 600  # per torch case (4 to 9 ms a draw)
POWER_DRAWS = 1600  # the torch power test's case (its slightly wrong rule needs them), and every engine case (1 ms a draw)
MIN_ACCEPTED = 0.8  # drafts accepted in at least this share of the runs (measured: 0.87 to 1.00 over seed ranges)
MIN_DEEP = 0.03  # one step accepted two drafts in at least this share of the runs (measured: 0.045 to 0.23)
WIDE = [[0], [1], [2], [3], [0, 0], [1, 0]]  # 4 of the 5 tokens at depth 1: most runs accept a draft


def exact_distribution(model, ids, n, temperature, top_p):
    """P(t1, .., tn) of the model's own sampling, computed exactly by enumeration ([V] * n table)."""
    with torch.no_grad():
        p = warp(model(ids).logits[0, -1], temperature, top_p).double()
        if n == 1:
            return p
        V = p.shape[0]
        return torch.stack([
            p[t] * exact_distribution(model, torch.cat([ids, torch.tensor([[t]])], 1), n - 1, temperature, top_p)
            for t in range(V)
        ])


def chi2_pvalue(counts: np.ndarray, exact: np.ndarray) -> float:
    """Pearson's chi-square of observed `counts` against the probabilities `exact` (same shape, flat)."""
    from scipy.stats import chisquare

    assert counts[exact == 0].sum() == 0, "an outcome the model cannot produce was emitted"
    n = counts.sum()
    keep = exact * n >= 5  # chi-square wants expected counts >= 5: pool the rest into one cell
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(exact[keep], exact[~keep].sum()) * n
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=V, num_hidden_layers=2, initializer_range=0.3, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def captured(model):
    return speccomp.capture(model)  # exported once; each compile(captured, ...) rewrites a copy


@pytest.fixture(scope="module")
def exact(model):
    """top_p -> the exact law of the first 3 new tokens, flat [125] (outcome (a, b, c) at (a * V + b) * V + c)."""
    ids = torch.tensor([PROMPT])
    return {top_p: exact_distribution(model, ids, 3, TEMPERATURE, top_p).flatten().numpy() for top_p in (1.0, 0.8)}


@pytest.fixture(scope="module")
def heads(model, tmp_path_factory):
    """Random Medusa (2 heads), Hydra (2 heads) and EAGLE heads for the model, saved: kind -> directory."""
    from speccomp.drafters.eagle import new_eagle, save_eagle
    from speccomp.drafters.hydra import new_hydra, save_hydra
    from speccomp.drafters.medusa import new_heads, save_medusa

    root = tmp_path_factory.mktemp("heads")
    made = {"medusa": (new_heads(model, 2), save_medusa), "hydra": (new_hydra(model, torch.arange(V), 2), save_hydra),
            "eagle": (new_eagle(model, torch.arange(V)), save_eagle)}
    g = torch.Generator().manual_seed(0)
    for kind, (module, save) in made.items():
        with torch.no_grad():
            for w in module.parameters():
                w.copy_(torch.randn(w.shape, generator=g) * 0.5)
        save(module, root / kind)
    from speccomp.tuning.train_draft import draft_architecture, save_draft

    (root / "draft").mkdir()
    save_draft(draft_architecture(model, 1), root / "draft", model, 1)  # the model's first layer, as train-draft saves
    return {kind: str(root / kind) for kind in [*made, "draft"]}


# torch runtime: case -> (compile arguments given the heads' directories, top_p). top_p 0.8 makes the target give
# tokens probability 0 (a draft of one must always be rejected). Share of the test's runs that accepted a draft:
TORCH_CASES = {
    "early_exit": (lambda h: dict(drafter="early_exit", drafter_options={"exit_layer": 0}, tree=WIDE), 0.8),  # 1.00
    # EAGLE-2 style growth from the drafter's confidences: trees change shape from step to step
    "layer_skip-dynamic": (lambda h: dict(drafter="layer_skip", drafter_options={"skip": [0]}, tree="dynamic:6:3"),
                           1.0),  # 0.90
    "ngram": (lambda h: dict(drafter="ngram"), 0.8),  # 0.94
    # the recycling table persists across generations (as in the paper): it drafts from the first step on
    "token_recycling": (lambda h: dict(drafter="token_recycling", tree=WIDE,
                                       drafter_options={"top_k": 4, "persist": True, "ngram_branches": 0}), 1.0),  # 0.99
    "medusa": (lambda h: dict(drafter="medusa", drafter_options={"heads": h["medusa"]}, tree=WIDE), 1.0),  # 0.98
    "hydra": (lambda h: dict(drafter="hydra", drafter_options={"heads": h["hydra"]}, tree=WIDE), 0.8),  # 0.98
    "eagle": (lambda h: dict(drafter="eagle", drafter_options={"heads": h["eagle"]}, tree=WIDE), 1.0),  # 0.96
    # one tree merged from the Hydra heads' and Token Recycling's (whose prompt-lookup branch finds the prompt's bigrams)
    "hydra+token_recycling": (lambda h: dict(drafter="hydra+token_recycling", tree=WIDE, drafter_options={
        "hydra": {"heads": h["hydra"]}, "token_recycling": {"tree": [[0], [1], [0, 0]], "top_k": 3}}), 1.0),  # 0.98
}


def draft_lm():
    """A separate 1-layer draft LM of the model's vocabulary (its embedding is the model's: same seed): under sampling
    it draws its drafts from its own q and hands the sampler q (speccomp/drafters/draft_model.py)."""
    return tiny_llama(vocab_size=V, num_hidden_layers=1, initializer_range=0.3, tie_word_embeddings=True)


# drafts sampled from a real q (not point masses): the recursive rejection sampler's min(1, p/q) path
TORCH_CASES["draft_model"] = (lambda h: dict(drafter=draft_lm(), tree=WIDE), 1.0)
TORCH_CASES["draft_model-top_p"] = (lambda h: dict(drafter=draft_lm(), tree=WIDE), 0.8)
# a chain of 2 sampled drafts: Leviathan / Chen speculative sampling, the one-child case of the same sampler
TORCH_CASES["draft_model-chain"] = (lambda h: dict(drafter=draft_lm(), tree=2), 1.0)
# merged: every part drafts its top tokens (point masses: a merged node may come from several parts)
TORCH_CASES["draft_model+token_recycling"] = (lambda h: dict(drafter="draft_model+token_recycling", tree=WIDE,
                                                            drafter_options={"draft_model": {"path": h["draft"]}}), 0.8)

POWER_CASE = "token_recycling"  # the power test's case: cheap (no drafter forward), and it drafts the likely tokens
CASE_DRAWS = {POWER_CASE: POWER_DRAWS}  # the other cases take DRAWS


def sample(generate, seeds) -> tuple[np.ndarray, float, float]:
    """Counts [125] of the first 3 new tokens over `seeds`, the share of runs in which a draft was accepted (fewer
    target forwards than tokens), and the share in which one step accepted two drafts (prefill + 1 step)."""
    counts = np.zeros(V**3)
    accepted = deep = 0
    for seed in seeds:
        a, b, c = generate(seed)[:3]
        counts[(a * V + b) * V + c] += 1
        accepted += generate.steps < NEW_TOKENS
        deep += generate.steps == 2
    return counts, accepted / len(seeds), deep / len(seeds)


class TorchRun:
    def __init__(self, fast, top_p):
        self.fast, self.top_p, self.steps = fast, top_p, None
        self.ids = torch.tensor([PROMPT])

    def __call__(self, seed):
        out = self.fast.generate(self.ids, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=TEMPERATURE,
                                 top_p=self.top_p, seed=seed)
        self.steps = self.fast.last_stats["steps"]
        return out[0, len(PROMPT):].tolist()


def run_torch(case, captured, heads, exact):
    """Compile `case` (fresh: Token Recycling's table starts empty whatever ran before) and sample it: the chi-square
    p-value, the share of runs that accepted a draft / two drafts in one step, and the trees it verified."""
    fast, top_p = speccomp.compile(captured, **TORCH_CASES[case][0](heads)), TORCH_CASES[case][1]
    trees, probs = [], []
    propose = fast.drafter.propose

    def spy(ctx):
        draft = propose(ctx)
        trees.append(draft.tree)
        probs.append(draft.probs)
        return draft

    fast.drafter.propose = spy
    counts, accepted, deep = sample(TorchRun(fast, top_p), range(CASE_DRAWS.get(case, DRAWS)))
    return chi2_pvalue(counts, exact[top_p]), accepted, deep, trees, probs


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_sampling_distribution_equals_model(case, captured, heads, exact):
    """Speculative sampling draws from the model's own distribution, with drafts accepted in most runs."""
    p, accepted, deep, trees, probs = run_torch(case, captured, heads, exact)
    sampled_drafts = case.startswith("draft_model") and "+" not in case
    assert all(q is not None for q in probs) if sampled_drafts else not any(q is not None for q in probs)
    assert accepted >= MIN_ACCEPTED, f"drafts were accepted in only {accepted:.0%} of the runs: little is tested"
    assert deep >= MIN_DEEP, f"two drafts were accepted in one step in only {deep:.1%} of the runs"
    assert max(t.max_depth for t in trees) == 2  # trees two deep were verified
    if "dynamic" in case:
        assert len({t.parents for t in trees if t.max_depth == 2}) > 1, "a dynamic tree changes shape"
    assert p > 1e-3, f"speculative samples do not follow the model's distribution (chi-square p={p:.2g})"


# --------------------------------------------------------------------------------------------
# Power: a slightly wrong acceptance rule fails the same test with the same draws
# --------------------------------------------------------------------------------------------


def accept_at_temperature_one(tree, tokens, target_probs, draft_probs=None, generator=None):
    """sample_accept for deterministic drafts, except that it tests each draft against the model's un-warped
    (temperature 1) probabilities instead of the warped ones it then samples from: residuals and the bonus stay
    warped. (p ** TEMPERATURE, renormalised, is the temperature-1 distribution behind p when top_p = 1.)"""
    toks = tokens.tolist()
    coins = torch.rand(tree.size, generator=generator, dtype=torch.float64).tolist()
    path, u = [0], 0
    while True:
        p = target_probs[u].double() / target_probs[u].double().sum()
        accepted = None
        for c in tree.children[u]:
            unwarped = p**TEMPERATURE / (p**TEMPERATURE).sum()
            if coins[c] < float(unwarped[toks[c]]):  # the right rule: coins[c] < p[x]
                accepted = c
                break
            residual = p.clone()
            residual[toks[c]] = 0.0  # the residual, as the right rule
            if residual.sum() > 1e-12:
                p = residual / residual.sum()
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(accepted)
        u = accepted


def test_wrong_acceptance_rule_fails_the_sampling_test(captured, heads, exact, monkeypatch):
    """decode_speculative's acceptance (speccomp.runtime.decode.sample_accept) replaced by accept_at_temperature_one:
    the POWER_CASE case of test_sampling_distribution_equals_model (same POWER_DRAWS draws, same seeds), which passes
    with the right rule, fails. Measured offline on 4 seed ranges of POWER_DRAWS draws (seeds from 0, 10**5, 2 * 10**5,
    3 * 10**5): the right rule p = 0.19, 0.88, 0.78, 0.59; this rule p = 6e-7, 2e-8, 3e-10, 5e-14 (accepting with
    min(1, 1.25 p(x)) instead: p <= 3e-12). With DRAWS (600) draws this rule gave p from 2e-2 to 6e-5: too few."""
    monkeypatch.setattr(speccomp.runtime.decode, "sample_accept", accept_at_temperature_one)
    p, accepted, _, _, _ = run_torch(POWER_CASE, captured, heads, exact)
    assert accepted >= MIN_ACCEPTED
    assert p < 1e-3, f"a wrong acceptance rule passed the sampling test (chi-square p={p:.2g}): the test has no power"


def first_accepted_without_residual(children, toks, p, draft_probs, coins):
    """speccomp.runtime.tree._first_accepted with one step left out for sampled drafts (draft_probs given): a
    rejected child does not turn p into the residual max(p - q, 0), so the bonus after rejections comes from p."""
    for c in children:
        q = draft_probs[c].double() / draft_probs[c].double().sum()
        if coins[c] * float(q[toks[c]]) < float(p[toks[c]]):
            return c, p
    return None, p


@pytest.mark.parametrize("case", ["draft_model", "draft_model-chain"])
def test_wrong_rule_for_sampled_drafts_fails_the_sampling_test(case, captured, heads, exact, monkeypatch):
    """The draft model's sampled drafts (a tree, a chain) with the residual update left out: the same test fails
    (draws: POWER_DRAWS)."""
    monkeypatch.setattr(speccomp.runtime.tree, "_first_accepted", first_accepted_without_residual)
    monkeypatch.setitem(CASE_DRAWS, case, POWER_DRAWS)
    p, accepted, _, _, _ = run_torch(case, captured, heads, exact)
    assert accepted >= MIN_ACCEPTED
    assert p < 1e-3, f"a wrong rule for sampled drafts passed the sampling test (chi-square p={p:.2g}): no power"


# --------------------------------------------------------------------------------------------
# Exported engines (numpy + ONNX Runtime): the walk-the-tree acceptance
# --------------------------------------------------------------------------------------------
ENGINE_CASES = {
    # Medusa heads: their residual blocks in target.onnx, their projection and top-k in medusa.onnx
    "medusa": (lambda h: dict(drafter="medusa", drafter_options={"heads": h["medusa"]}, tree=WIDE), 1.0),  # 0.98
    "ngram": (lambda h: dict(drafter="ngram"), 0.8),  # 0.93
    "token_recycling": (lambda h: dict(drafter="token_recycling", tree=WIDE,
                                       drafter_options={"top_k": 4, "persist": True, "ngram_branches": 0}), 0.8),  # 1.00
    # Hydra's head step in hydra.onnx, the tree grown in numpy, merged with Token Recycling's
    "hydra+token_recycling": (lambda h: dict(drafter="hydra+token_recycling", tree=WIDE, drafter_options={
        "hydra": {"heads": h["hydra"]}, "token_recycling": {"tree": [[0], [1], [0, 0]], "top_k": 3}}), 1.0),
    # the EAGLE layer step in eagle.onnx over the layer's own cache (eagle_cache.py, shared with the torch drafter)
    "eagle": (lambda h: dict(drafter="eagle", drafter_options={"heads": h["eagle"]}, tree=WIDE), 0.8),
    # a separate draft LM in draft_model.onnx: its children drawn from its own q in numpy, q handed to sample_accept
    "draft_model": (lambda h: dict(drafter=draft_lm(), tree=WIDE), 0.8),
    "draft_model-chain": (lambda h: dict(drafter=draft_lm(), tree=2), 1.0),
}


class EngineRun:
    def __init__(self, engine, top_p):
        self.engine, self.top_p, self.steps = engine, top_p, None
        self.ids = np.array([PROMPT], dtype=np.int64)

    def __call__(self, seed):
        out = self.engine.generate(self.ids, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=TEMPERATURE,
                                   top_p=self.top_p, seed=seed)
        self.steps = self.engine.last_stats["steps"]
        return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def engines(captured, heads, tmp_path_factory):
    """case -> a freshly loaded engine of it (Token Recycling's table starts empty), exported once per module from
    a compile on the onnxruntime backend."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    exported = {}

    def get(case):
        if case not in exported:
            fast = speccomp.compile(captured, backend="onnxruntime", **ENGINE_CASES[case][0](heads))
            exported[case] = fast.export(tmp_path_factory.mktemp("engines") / case)
        return speccomp.load(exported[case], threads=1)  # one thread: a tiny graph gains nothing from more

    return get


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_sampling_distribution_equals_model(case, engines, exact):
    """Sampling through an exported engine draws from the model's own distribution, drafts accepted in most runs."""
    top_p = ENGINE_CASES[case][1]
    engine, sampled = engines(case), []
    if case.startswith("draft_model"):  # its drafts are sampled: every tree it proposes comes with its q
        propose = engine.drafter.propose
        engine.drafter.propose = lambda *a: (propose(*a), sampled.append(engine.drafter.probs is not None))[0]
    counts, accepted, deep = sample(EngineRun(engine, top_p), range(POWER_DRAWS))
    assert all(sampled) and (len(sampled) > POWER_DRAWS) == case.startswith("draft_model"), len(sampled)
    assert accepted >= MIN_ACCEPTED, f"drafts were accepted in only {accepted:.0%} of the runs: little is tested"
    assert deep >= MIN_DEEP, f"two drafts were accepted in one step in only {deep:.1%} of the runs"
    p = chi2_pvalue(counts, exact[top_p])
    assert p > 1e-3, f"engine samples do not follow the model's distribution (chi-square p={p:.2g})"


def accept_redraw(tokens, children, pick):
    """speccomp.engine.accept, except that a rejection emits a fresh draw from the target's distribution: the
    rejected drafts keep their mass (the classic bug of resampling without removing them)."""
    path, node = [0], 0
    while True:
        t = pick(node)
        nxt = next((c for c in children[node] if tokens[c] == t), None)
        if nxt is None:
            return path, pick(node)
        path.append(nxt)
        node = nxt


def test_wrong_engine_acceptance_fails_the_sampling_test(engines, exact, monkeypatch):
    """The engine's acceptance (speccomp.engine.accept) replaced by accept_redraw: the medusa case of
    test_engine_sampling_distribution_equals_model (same POWER_DRAWS draws, same seeds), which passes with the right
    rule, fails. Measured offline on 4 seed ranges (seeds from 0, 10**5, 2 * 10**5, 3 * 10**5): the right rule
    p = 0.74, 0.39, 0.25, 0.019; accept_redraw p = 7e-41, 2e-45, 2e-46, 4e-36. (Random heads leave likely tokens
    undrafted, so rejections are frequent. The token_recycling engine drafts the 4 likeliest tokens, rejections are
    rare and this bug moves little mass there: p = 3e-5, 2e-9, 8e-6, 8e-3.)"""
    monkeypatch.setattr(speccomp.engine.runtime, "accept", accept_redraw)
    counts, accepted, _ = sample(EngineRun(engines("medusa"), 1.0), range(POWER_DRAWS))
    assert accepted >= MIN_ACCEPTED
    p = chi2_pvalue(counts, exact[1.0])
    assert p < 1e-3, f"the wrong engine rule passed the sampling test (chi-square p={p:.2g}): the test has no power"


def sample_accept_without_residual(tokens, children, target, probs, rng):
    """speccomp.engine.runtime.sample_accept with the residual update left out: a rejected child does not turn p
    into max(p - q, 0), so the token after rejections comes from p (the engine's twin of
    first_accepted_without_residual)."""
    coins = rng.random(len(tokens))
    path, u = [0], 0
    while True:
        p = target(u)
        nxt = next((c for c in children[u] if coins[c] * probs[c][tokens[c]] < p[tokens[c]]), None)
        if nxt is None:
            return path, int(rng.choice(len(p), p=p / p.sum()))
        path.append(nxt)
        u = nxt


def test_wrong_rule_for_sampled_drafts_fails_the_engine_sampling_test(engines, exact, monkeypatch):
    """The engine's draft model case with the residual update left out of its sampler: the same test fails."""
    monkeypatch.setattr(speccomp.engine.runtime, "sample_accept", sample_accept_without_residual)
    counts, accepted, _ = sample(EngineRun(engines("draft_model"), 1.0), range(POWER_DRAWS))
    assert accepted >= MIN_ACCEPTED
    p = chi2_pvalue(counts, exact[1.0])
    assert p < 1e-3, f"a wrong rule for sampled drafts passed the engine sampling test (chi-square p={p:.2g})"


def test_the_nucleus_cut_at_exactly_one_minus_top_p_is_hfs_in_both_runtimes():
    """Uniform logits over 5 tokens: running totals 0.2, 0.4, ... land exactly on 1 - top_p. HF (and the torch
    runtime) cut such a total in float32; the engine cut it in float64 and kept one token more, a token the target
    never samples (at top_p=0.8 it drew token 0 a fifth of the time)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    for top_p in (0.8, 0.6, 0.4):
        hf = TopPLogitsWarper(top_p)(None, torch.zeros(1, 5))[0].isfinite()
        assert hf.sum() < 5
        assert torch.equal(warp(torch.zeros(5), 1.0, top_p) > 0, hf)
        assert np.array_equal(speccomp.engine.runtime.warp(np.zeros(5, np.float32), 1.0, top_p) > 0, hf.numpy())
    # and on large vocabularies the two keep the same tokens (a float32 running total had 27 of 600 differ at 151936)
    g = np.random.default_rng(0)
    for i in range(60):
        x = g.standard_normal((32000, 151936)[i % 2]).astype(np.float32) * 3
        t, top_p = (0.7, 1.0, 1.3)[i % 3], (0.8, 0.9, 0.95)[i % 3]
        assert np.array_equal(speccomp.engine.runtime.warp(x, t, top_p) > 0, (warp(torch.from_numpy(x), t, top_p) > 0).numpy())


def test_a_temperature_near_zero_samples_the_greedy_text(captured, heads, engines):
    """temperature -> 0 leaves the argmax's point mass: sampling at 1e-45 (logits / T overflows float32: the torch
    sampler's) and at the smallest float64 (it overflows there too: the engine's and the draft model's q) gives the
    greedy text, in both runtimes, drafts sampled from a draft LM's q included. Dividing before shifting by the max
    made inf - inf = nan there (multinomial refused it; HF's sampler does too)."""
    for logits, point in (([0.5, 3.0, -1.0, 2.0], [0, 1, 0, 0]), ([1.0, -np.inf, 4.0, 4.0], [0, 0, 0.5, 0.5])):
        for t in (1e-45, 5e-324):  # a tie shares the mass
            assert np.array_equal(warp(torch.tensor(logits), t).numpy(), point)
            assert np.array_equal(speccomp.engine.runtime.warp(np.array(logits, np.float32), t, 1.0), point)
    ids = torch.tensor([PROMPT])
    greedy = speccomp.compile(captured).generate(ids, max_new_tokens=12)
    for case in ("draft_model", "medusa"):
        torch_model = speccomp.compile(captured, backend="onnxruntime", **ENGINE_CASES[case][0](heads))
        for t in (1e-45, 5e-324):
            for run in (torch_model, engines(case)):
                out = run.generate(ids, max_new_tokens=12, do_sample=True, temperature=t, seed=0)
                assert np.array_equal(np.asarray(out), greedy.numpy()), (case, t, type(run).__name__)


def test_the_engines_warp_at_extreme_temperatures_keeps_torchs_tokens_without_warnings():
    """Temperatures past float32's range (1e-320, 1e300) are valid: the torch warp gives the argmax's point mass or a
    flat distribution in silence; the engine's printed numpy "overflow encountered" RuntimeWarnings for the same
    (correct) result. Same kept tokens, no warning."""
    import warnings

    g = np.random.default_rng(1)
    for t in (5e-324, 1e-320, 1e-40, 1e30, 1e300):
        for top_p in (1.0, 0.5):
            x = g.standard_normal(50).astype(np.float32)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                p = speccomp.engine.runtime.warp(x, t, top_p)
            assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-9
            if t < 1:  # (at 1e300 every logit is 0: the kept tokens tie at the cut, which the sorts may break apart)
                assert np.array_equal(p > 0, (warp(torch.from_numpy(x), t, top_p) > 0).numpy()), (t, top_p)
            else:
                assert (p > 0).sum() == (warp(torch.from_numpy(x), t, top_p) > 0).sum(), (t, top_p)


def test_greedy_argmax_picks_what_torch_picks():
    """runtime/sampling.py's argmax (numpy's scan for float32 CPU logits) returns torch's index everywhere: the first of
    tied maxima, the first NaN, inf over finite values, any shape and any strides; other dtypes go through torch."""
    from speccomp.runtime.sampling import argmax

    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(0)
    cases = [torch.tensor([1.0, 3.0, 3.0, 2.0]), torch.tensor([1.0, nan, 5.0, nan]), torch.tensor([-inf] * 4),
             torch.tensor([1.0, inf, inf]), torch.tensor([[0.0, 0.0], [2.0, 2.0]]),
             torch.randn(3, 7, 50, generator=g)[:, ::2], torch.randn(2, 5, 50, generator=g).transpose(0, 1),
             torch.randint(0, 3, (4, 96), generator=g).float(), torch.randn(2, 9, generator=g).to(torch.bfloat16),
             torch.randn(3, 11, generator=g).requires_grad_()]
    for logits in cases:
        got, want = argmax(logits), logits.argmax(-1)
        assert got.dtype == want.dtype and torch.equal(got, want), logits


def _reference_top(row: np.ndarray, k: int) -> list[int]:
    """The k largest of one row by a plain sort: larger first, ties by the lower id, NaN after every number."""
    return sorted(range(len(row)), key=lambda j: (bool(np.isnan(row[j])), 0.0 if np.isnan(row[j]) else -row[j], j))[:k]


def test_top_k_is_the_k_largest_with_ties_by_id():
    """runtime/topk.py's grouped top k (the k groups of largest maxima, then their scores) against a plain sort, on
    rows built to trip it: ties everywhere (integers), ties across groups whose lower id sits in a later group, rows
    almost all -inf (fewer finite scores than k), NaN, vocabularies not a multiple of its group size, small ones
    (sorted whole), other dtypes and strides."""
    from speccomp.runtime.topk import ROWS, top_k

    rng = np.random.default_rng(0)
    rows = []
    for trial in range(240):
        vocab, n, k = int(rng.choice([7, 300, 4096, 4099, 6144])), int(rng.integers(1, 4)), int(rng.integers(1, 12))
        kind = trial % 4
        x = rng.standard_normal((n, vocab)).astype(np.float32)
        if kind == 1:
            x = rng.integers(-3, 3, (n, vocab)).astype(np.float32)
        elif kind == 2:
            x[rng.random((n, vocab)) < 0.998] = -np.inf
        elif kind == 3:
            x[rng.random((n, vocab)) < 0.002] = np.nan
        rows.append((x, k))
    groups = 4096 // ROWS
    crafted = np.zeros((1, 4096), dtype=np.float32)
    crafted[0, groups - 1] = crafted[0, 5 * groups + 3] = 5.0  # group 3 (id 643) is chosen first; id 127 is lower
    rows += [(crafted, 1), (crafted, 2)]
    sparse = np.full((1, 512), -np.inf, dtype=np.float32)  # two numbers, both in group 0: fewer groups than k
    sparse[0, 0], sparse[0, 512 // ROWS] = 5.0, 4.0
    rows += [(sparse, 2), (sparse, 5), (rng.integers(0, 50, (2, 4096)), 4), (rng.integers(0, 50, (2, 4096)).astype(np.uint8), 4)]
    x = rng.standard_normal((3, 9000))
    rows += [(x, 5), (x.astype(np.float16), 5), (x[:, ::2], 5), (np.full((2, 4096), -np.inf, np.float32), 3)]
    for x, k in rows:
        values, ids = top_k(x, k)
        want = [_reference_top(row, min(k, x.shape[1])) for row in np.asarray(x, dtype=np.float64)]
        assert ids.tolist() == want, (x.shape, k)
        assert np.array_equal(values, np.take_along_axis(np.asarray(x), np.array(want), -1), equal_nan=True)
    assert top_k(crafted, 1)[1].tolist() == [[groups - 1]]
    assert top_k(sparse, 2)[1].tolist() == [[0, 512 // ROWS]]
    with pytest.raises(ValueError, match="scores \\[n, V\\]"):
        top_k(np.zeros(5), 1)
    with pytest.raises(ValueError, match="k >= 1 of a vocabulary of V >= 1, got k=3, V=0"):
        top_k(np.zeros((2, 0)), 3)


def test_top_logp_and_top_ids_agree_with_torch():
    """The log-softmax at the top k (runtime/topk.py `top_logp`, both runtimes' dynamic trees) equals torch's
    log_softmax then topk; the torch runtime's `top_ids` (Token Recycling's observe, Medusa's heads) returns
    torch.topk's ids on the CPU through numpy (bf16 too, as float32) and through torch elsewhere (a tensor that requires grad)."""
    from speccomp.drafters.grow import torch_top
    from speccomp.runtime.sampling import top_ids
    from speccomp.runtime.topk import top_logp

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 49152, generator=g) * 4
    want = logits.log_softmax(-1).topk(8)
    logp, ids = top_logp(logits.numpy(), 8)
    assert np.array_equal(ids, want.indices.numpy()) and np.allclose(logp, want.values.numpy(), atol=1e-5)
    assert torch_top(logits, 8) == (logp.tolist(), ids.tolist())
    for x in (logits, logits[:, ::3], logits[:2].clone().requires_grad_()):
        assert torch.equal(top_ids(x, 8), x.topk(8).indices), x.shape
    rounded = logits[:2].to(torch.bfloat16)  # ties among the top values: the lower id first, on both paths
    want = [_reference_top(row, 8) for row in rounded.float().numpy()]
    assert top_ids(rounded.float(), 8).tolist() == want
    assert torch.equal(rounded.float().gather(-1, top_ids(rounded, 8)), rounded.float().topk(8).values)
    assert top_ids(torch.tensor([[1.0, 3.0, 2.0]]), 10).tolist() == [[1, 2, 0]]  # k cut to the vocabulary
