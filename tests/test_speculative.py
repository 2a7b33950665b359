"""Speculative decoding is lossless: greedy equality for every drafter (sampling: tests/test_sampling.py)."""
import pytest
import torch

import speccomp
from tiny_models import tiny_llama


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
        # drafts were accepted: fewer target forwards than tokens (measured: 24 to 39 steps, depth-1 acceptance >= 0.16)
        assert s["new_tokens"] == 48 and s["tau"] == 48 / s["steps"] and s["tau"] > 1.1
        assert s["acceptance_by_depth"][0] > 0.1 and all(0 <= a <= 1 for a in s["acceptance_by_depth"])


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
    with pytest.raises(ValueError, match=r"exit_layer=9: must be in \[0, 4\]"):
        speccomp.compile(llama6, drafter="early_exit", drafter_options={"exit_layer": 9})
    with pytest.raises(ValueError, match="unknown early_exit options"):
        speccomp.compile(llama6, drafter="early_exit", drafter_options={"exit": 1})
    with pytest.raises(ValueError, match=r"skip=\[\]: is empty"):
        speccomp.compile(llama6, drafter="layer_skip", drafter_options={"skip": []})
    with pytest.raises(ValueError, match="do not exist"):
        speccomp.compile(llama6, drafter="layer_skip", drafter_options={"skip": [7]})
    with pytest.raises(ValueError, match="orphan"):
        speccomp.compile(llama6, drafter="early_exit", tree=[[0], [1, 0], [2, 0, 0]])
    with pytest.raises(ValueError, match="give a drafter"):
        speccomp.compile(llama6, tree=4)
