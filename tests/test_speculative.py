"""Speculative decoding is lossless: greedy equality for every drafter, distribution equality when sampling."""
import pytest
import torch

import speccomp
from speccomp.sampling import warp
from tiny_models import ARCHITECTURES, tiny_llama


def hf_greedy(model, ids, n, eos=None):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0,
    )


def repetitive_prompt(vocab, seed=0, n=24):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, vocab, (8,), generator=g)
    return base.repeat(n // 8 + 1)[:n][None]


@pytest.fixture(scope="module")
def llama6():
    return tiny_llama(num_hidden_layers=6, initializer_range=0.2)


DRAFTER_CASES = [
    ("early_exit", {"exit_layer": 2}, None),
    ("early_exit", {"exit_layer": 3}, [[0], [1], [0, 0], [0, 0, 0], [1, 0]]),
    ("layer_skip", {"skip": [1, 3]}, 3),
    ("layer_skip", {}, [[0], [0, 0], [0, 1], [0, 0, 0]]),
    ("early_exit", {"exit_layer": 3}, "dynamic:8:3"),  # EAGLE-2 style, grown per step
    ("layer_skip", {"skip": [2, 3]}, "dynamic:5:2"),
]


@pytest.mark.parametrize("drafter, options, tree", DRAFTER_CASES)
def test_graph_drafters_greedy_identical(llama6, drafter, options, tree):
    fast = speccomp.compile(llama6, drafter=drafter, drafter_options=options, tree=tree)
    for seed in (0, 1):
        ids = repetitive_prompt(96, seed) if seed else torch.randint(3, 96, (1, 13), generator=torch.Generator().manual_seed(5))
        out = fast.generate(ids, max_new_tokens=48)
        assert torch.equal(out, hf_greedy(llama6, ids, 48))
        s = fast.last_stats
        assert s["new_tokens"] == 48 and 1 <= s["tau"] and s["steps"] <= 48
        assert all(0 <= a <= 1 for a in s["acceptance_by_depth"])


def test_dynamic_tree_shapes(llama6):
    """Dynamic trees differ from step to step, stay within the budget, and keep the deep paths the
    drafter is sure of (a repetitive prompt makes the early-exit drafter confident)."""
    fast = speccomp.compile(llama6, drafter="early_exit", drafter_options={"exit_layer": 4}, tree="dynamic:6:2")
    shapes = []
    drafter = fast.drafter
    propose = drafter.propose

    def spy(ctx):
        draft = propose(ctx)
        shapes.append(draft.tree.parents)
        assert draft.tree.size <= 7 and draft.tokens.shape == (draft.tree.size,)
        return draft

    drafter.propose = spy
    ids = repetitive_prompt(96, 2)
    assert torch.equal(fast.generate(ids, max_new_tokens=40), hf_greedy(llama6, ids, 40))
    assert len(set(shapes)) > 1, "a dynamic tree should change shape with the drafter's confidence"
    branching = [p for p in shapes if len(set(p[1:])) < len(p) - 1]  # some node has 2 children
    assert branching, "top_k=2 expansion should branch somewhere"
    assert fast.last_stats["tau"] > 1


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_architecture_layer_skip_greedy_identical(name):
    arch = ARCHITECTURES[name]
    model = arch.build()
    n = len(speccomp.compile(model).graph.structure.layers)
    fast = speccomp.compile(model, drafter="early_exit", drafter_options={"exit_layer": 0}, tree=[[0], [1], [0, 0], [0, 0, 0]])
    ids = repetitive_prompt(model.config.vocab_size, seed=3, n=14)
    eos = model.generation_config.eos_token_id  # HF stops there by default: give speccomp the same stop
    out = fast.generate(ids, max_new_tokens=30, eos_token_id=eos)  # 44 tokens: past every sliding window (8)
    assert torch.equal(out, hf_greedy(model, ids, 30, eos)), name
    assert n >= 2


def test_eos_and_max_new_tokens_inside_an_accepted_run(llama6):
    fast = speccomp.compile(llama6, drafter="early_exit", drafter_options={"exit_layer": 4}, tree=6)
    ids = repetitive_prompt(96, 2)
    free = fast.generate(ids, max_new_tokens=40)
    assert fast.last_stats["tau"] > 1  # runs of several tokens are accepted at once
    for k in (1, 2, 7, 13, 40):  # stop exactly at k tokens, wherever k falls inside an accepted run
        out = fast.generate(ids, max_new_tokens=k)
        assert torch.equal(out, free[:, : ids.shape[1] + k])
    gen = free[0, ids.shape[1]:].tolist()
    eos = gen[9]
    first = gen.index(eos)
    out = fast.generate(ids, max_new_tokens=40, eos_token_id=eos)
    assert out[0, ids.shape[1]:].tolist() == gen[: first + 1]
    assert torch.equal(out, hf_greedy(llama6, ids, 40, eos))


def test_bad_drafter_options(llama6):
    with pytest.raises(ValueError, match=r"exit_layer must be in \[0, 4\]"):
        speccomp.compile(llama6, drafter="early_exit", drafter_options={"exit_layer": 9})
    with pytest.raises(ValueError, match="unknown early_exit options"):
        speccomp.compile(llama6, drafter="early_exit", drafter_options={"exit": 1})
    with pytest.raises(ValueError, match="skip is empty"):
        speccomp.compile(llama6, drafter="layer_skip", drafter_options={"skip": []})
    with pytest.raises(ValueError, match="do not exist"):
        speccomp.compile(llama6, drafter="layer_skip", drafter_options={"skip": [7]})
    with pytest.raises(ValueError, match="orphan"):
        speccomp.compile(llama6, drafter="early_exit", tree=[[0], [1, 0], [2, 0, 0]])
    with pytest.raises(ValueError, match="give a drafter"):
        speccomp.compile(llama6, tree=4)


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


V = 5  # vocabulary of the sampling tests' model: 125 outcomes for 3 tokens


def sampling_drafter(model, kind, tmp_path):
    """compile() arguments for a drafter that really drafts on the tiny vocabulary-V model."""
    if "+" in kind:  # merged: the first drafter's tree plus the text drafter's (prompt lookup finds the repeat)
        first, text = kind.split("+")
        args = sampling_drafter(model, first, tmp_path)
        return dict(drafter=kind, tree=args["tree"], drafter_options={
            first: args.get("drafter_options") or {}, text: {"tree": [[0], [1], [0, 0]], "top_k": 3}})
    if kind == "early_exit":
        return dict(drafter="early_exit", drafter_options={"exit_layer": 1}, tree=[[0], [1], [0, 0]])
    g = torch.Generator().manual_seed(0)
    if kind == "medusa":
        from speccomp.medusa import new_heads, save_medusa

        heads, save = new_heads(model, 2), save_medusa
    elif kind == "hydra":
        from speccomp.hydra import new_hydra, save_hydra

        heads, save = new_hydra(model, torch.arange(V), 2), save_hydra
    else:
        from speccomp.eagle import new_eagle, save_eagle

        heads, save = new_eagle(model, torch.arange(V)), save_eagle
    with torch.no_grad():
        for w in heads.parameters():
            w.copy_(torch.randn(w.shape, generator=g) * 0.5)
    save(heads, tmp_path / kind)
    # random heads rarely guess right: draft 4 of the 5 tokens at depth 1 so that many drafts are verified
    return dict(drafter=kind, drafter_options={"heads": str(tmp_path / kind)}, tree=[[0], [1], [2], [3], [0, 0], [1, 0]])


@pytest.mark.parametrize("kind, top_p", [("early_exit", 0.8), ("medusa", 1.0), ("hydra", 0.8), ("eagle", 1.0),
                                         ("hydra+token_recycling", 1.0)])
def test_sampling_distribution_equals_model(kind, top_p, tmp_path):
    """Speculative sampling (drafts verified by recursive rejection sampling) draws from the model's own
    distribution: the joint law of 3 new tokens, so that drafts are verified (with 2 tokens the last
    step has room for no draft)."""
    from scipy.stats import chisquare

    model = tiny_llama(vocab_size=V, num_hidden_layers=4, initializer_range=0.3, tie_word_embeddings=True)
    ids = torch.tensor([[1, 2, 3, 4, 1, 2]])
    exact = exact_distribution(model, ids, 3, 1.5, top_p).flatten()
    fast = speccomp.compile(model, **sampling_drafter(model, kind, tmp_path))
    draws, accepted = 1200, 0
    counts = torch.zeros_like(exact)
    for seed in range(draws):
        out = fast.generate(ids, max_new_tokens=3, do_sample=True, temperature=1.5, top_p=top_p, seed=seed)
        a, b, c = out[0, -3:].tolist()
        counts[(a * V + b) * V + c] += 1
        accepted += fast.last_stats["steps"] < 3  # some draft was accepted: fewer forwards than tokens
    assert accepted > draws // 10, f"the drafter was accepted in only {accepted} of {draws} runs: nothing is tested"
    keep = exact * draws >= 5  # chi-square needs expected counts >= 5; pool the rest
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([exact[keep], exact[~keep].sum()[None]]) * draws
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
        assert counts[~keep].sum() == 0
    p = chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue
    assert p > 1e-3, f"speculative samples do not follow the model's distribution (chi-square p={p:.2g})"
    # and the test has power: the plain (non-tempered) distribution is rejected
    wrong = exact_distribution(model, ids, 3, 1.0, 1.0).flatten()
    keep = wrong * draws >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([wrong[keep], wrong[~keep].sum()[None]]) * draws
    assert chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue < 1e-3
