"""Speculative decoding is lossless: greedy equality for every drafter, distribution equality when sampling."""
import itertools

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


def exact_two_token_distribution(model, ids, temperature, top_p):
    """P(t1, t2) of the model's own sampling, computed exactly by enumeration."""
    with torch.no_grad():
        p1 = warp(model(ids).logits[0, -1], temperature, top_p)
        table = torch.zeros(p1.shape[0], p1.shape[0], dtype=torch.float64)
        for t1 in range(p1.shape[0]):
            seq = torch.cat([ids, torch.tensor([[t1]])], 1)
            table[t1] = p1[t1].double() * warp(model(seq).logits[0, -1], temperature, top_p).double()
    return table


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampling_distribution_equals_model(top_p):
    """Speculative sampling (drafts verified by recursive rejection sampling) draws from the model's own distribution."""
    from scipy.stats import chisquare

    model = tiny_llama(vocab_size=6, num_hidden_layers=4, initializer_range=0.3)
    ids = torch.tensor([[1, 2, 3, 4, 1, 2]])
    exact = exact_two_token_distribution(model, ids, 1.5, top_p)
    fast = speccomp.compile(model, drafter="early_exit", drafter_options={"exit_layer": 1}, tree=[[0], [1], [0, 0]])
    draws = 1500
    counts = torch.zeros_like(exact)
    for seed in range(draws):
        out = fast.generate(ids, max_new_tokens=2, do_sample=True, temperature=1.5, top_p=top_p, seed=seed)
        counts[out[0, -2], out[0, -1]] += 1
    keep = exact.flatten() * draws >= 5  # chi-square needs expected counts >= 5; pool the rest
    observed = torch.cat([counts.flatten()[keep], counts.flatten()[~keep].sum()[None]])
    expected = torch.cat([exact.flatten()[keep], exact.flatten()[~keep].sum()[None]]) * draws
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
        assert counts.flatten()[~keep].sum() == 0
    p = chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue
    assert p > 1e-3, f"speculative samples do not follow the model's distribution (chi-square p={p:.2g})"
    # and the test has power: the plain (non-tempered) distribution is rejected
    wrong = exact_two_token_distribution(model, ids, 1.0, 1.0).flatten() * draws
    assert chisquare(counts.flatten().numpy() + 1e-9, (wrong + 1e-9).numpy() * draws / (wrong.sum().item() + 1e-9 * wrong.numel())).pvalue < 1e-3
