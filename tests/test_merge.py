"""Merged drafters ("hydra+token_recycling"): one tree from several drafters, still lossless."""
import pytest
import torch

import speccomp
from speccomp.drafters.merge import MERGED_RECYCLING_TREE, MergedDrafter
from speccomp.runtime.tree import Tree, greedy_accept
from test_speculative import hf_greedy, repetitive_prompt
from tiny_models import tiny_llama


@pytest.fixture(scope="module")
def llama6():
    return tiny_llama(num_hidden_layers=6, initializer_range=0.2)


def random_heads(model, kind, path):
    """Random Hydra heads or EAGLE head (scaled up so that they draft varied tokens), saved to `path`."""
    if kind == "hydra":
        from speccomp.drafters.hydra import new_hydra as new, save_hydra as save

        heads = new(model, torch.arange(model.config.vocab_size), 3)
    else:
        from speccomp.drafters.eagle import new_eagle as new, save_eagle as save

        heads = new(model, torch.arange(model.config.vocab_size))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in heads.parameters():
            w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    save(heads, path)
    return str(path)


def path_of(tree, i):
    """Node indices from the root to node i."""
    nodes = [i]
    while nodes[-1] != 0:
        nodes.append(tree.parents[nodes[-1]])
    return nodes[::-1]


def spy_merge(fast):
    """Record every merged draft, each drafter's own draft, and what each drafter was shown after verification."""
    merged: MergedDrafter = fast.drafter
    seen = {"drafts": [], "observed": []}
    propose, observes = merged.propose, [d.observe for d in merged.drafters]

    def spy_propose(ctx):
        draft = propose(ctx)
        seen["drafts"].append((draft, [(own.tokens.clone(), own.tree, where) for own, where in merged._last]))
        return draft

    def make_spy(i):
        def spy(draft, path, logits):
            seen["observed"].append((i, draft, list(path), logits))
            return observes[i](draft, path, logits)
        return spy

    merged.propose = spy_propose
    for i, d in enumerate(merged.drafters):
        d.observe = make_spy(i)
    return seen


CASES = [
    ("early_exit+token_recycling", {"early_exit": {"exit_layer": 3}, "token_recycling": {"tree": [[0], [1], [0, 0]]}}, "dynamic:6:2"),
    ("layer_skip+ngram", {"layer_skip": {"skip": [1, 3]}}, [[0], [0, 0], [0, 0, 0]]),
    ("token_recycling+ngram", None, None),
    ("hydra+token_recycling", "hydra", [[0], [1], [0, 0]]),
    ("hydra+token_recycling+ngram", "hydra", [[0], [1], [0, 0]]),  # three trees, two of them text drafters
    ("eagle+ngram", "eagle", "dynamic:6:2"),  # EAGLE takes the states of every accepted position ("path")
]


@pytest.mark.parametrize("name, options, tree", CASES)
def test_merged_greedy_identical_and_trees_are_unions(llama6, tmp_path, name, options, tree):
    if options in ("hydra", "eagle"):
        options = {options: {"heads": random_heads(llama6, options, tmp_path / options)}}
    fast = speccomp.compile(llama6, drafter=name, drafter_options=options, tree=tree)
    seen = spy_merge(fast)
    for seed in (0, 1):
        ids = repetitive_prompt(96, seed) if seed else torch.randint(3, 96, (1, 13), generator=torch.Generator().manual_seed(5))
        assert torch.equal(fast.generate(ids, max_new_tokens=48), hf_greedy(llama6, ids, 48))
    # every drafter's path sits in the merged tree at the node its map names; equal paths are one node
    grew = 0
    for draft, owns in seen["drafts"]:
        paths = {tuple(draft.tokens[path_of(draft.tree, i)].tolist()) for i in range(draft.tree.size)}
        assert len(paths) == draft.tree.size, "two merged nodes carry the same token path"
        for tokens, tree_, where in owns:
            for i in range(tree_.size):
                assert draft.tokens[path_of(draft.tree, where[i])].tolist() == tokens[path_of(tree_, i)].tolist()
        grew += draft.tree.size > max(t.size for _, t, _ in owns)
    assert grew, "no step merged anything beyond the larger drafter's tree: the test would not test merging"
    # after verification each drafter is shown its own tree and the longest path the target accepts in it
    assert seen["observed"]
    for _, draft, path, logits in seen["observed"]:
        assert logits.shape[0] == draft.tree.size
        own_path, _ = greedy_accept(draft.tree, draft.tokens, logits.argmax(-1))
        assert path == own_path


def test_merged_tree_fits_a_sliding_window():
    """Past the window the merged tree is cut to the window's node limit and stays lossless."""
    from tiny_models import WINDOW, _mistral

    target = _mistral(0)
    fast = speccomp.compile(target, drafter="layer_skip+token_recycling", drafter_options={"layer_skip": {"skip": [1]}},
                            tree="dynamic:6:2")
    assert fast.max_tree == WINDOW
    assert fast.drafter.drafters[1].tree == Tree.from_choices(MERGED_RECYCLING_TREE)  # the small default in a merge
    seen = spy_merge(fast)
    ids = repetitive_prompt(90, 1, n=12)
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert 12 + 30 > 2 * WINDOW
    assert torch.equal(fast.generate(ids, max_new_tokens=30), ref)
    assert max(d.tree.size for d, _ in seen["drafts"]) == WINDOW  # the cut was needed and applied


def test_merged_drafter_bad_input(llama6):
    with pytest.raises(ValueError, match="at most one drafter that reads the model"):
        speccomp.compile(llama6, drafter="early_exit+layer_skip")
    with pytest.raises(ValueError, match=r"unknown: \['medus'\]"):
        speccomp.compile(llama6, drafter="medus+ngram")
    with pytest.raises(ValueError, match="distinct drafter names"):
        speccomp.compile(llama6, drafter="ngram+ngram")
    with pytest.raises(ValueError, match="go per drafter"):
        speccomp.compile(llama6, drafter="early_exit+ngram", drafter_options={"exit_layer": 2})
    with pytest.raises(TypeError, match="must be a dict"):
        speccomp.compile(llama6, drafter="early_exit+ngram", drafter_options={"early_exit": 2})
    with pytest.raises(ValueError, match="given twice"):
        speccomp.compile(llama6, drafter="token_recycling+ngram", tree=2, drafter_options={"token_recycling": {"tree": 3}})
    with pytest.raises(ValueError, match="given twice"):  # tree="auto" is a tree too, refused before any lookup
        speccomp.compile(llama6, drafter="token_recycling+ngram", tree="auto", drafter_options={"token_recycling": {"tree": 3}})
    # the merge's own default tree for token_recycling is named as such, with the option that replaces it
    with pytest.raises(ValueError, match=r"merge's default tree .*sibling rank.*'token_recycling': \{'tree': 3\}"):
        speccomp.compile(llama6, drafter="ngram+token_recycling", drafter_options={"token_recycling": {"top_k": 1}})
    assert speccomp.compile(llama6, drafter="ngram+token_recycling",  # the fix the message gives works
                            drafter_options={"token_recycling": {"top_k": 1, "tree": 3}}).drafter is not None
    # a tree a drafter refuses, given in its own options: named there (the message blamed a tree= nobody passed)
    with pytest.raises(ValueError, match=r"drafter_options\['ngram'\]\['tree'\]=3: .*drop drafter_options\['ngram'\]"):
        speccomp.compile(llama6, drafter="suffix+ngram", drafter_options={"ngram": {"tree": 3}})
    # each drafter still checks its own options, named where they were given (both parts take max_ngram)
    with pytest.raises(ValueError, match=r"^drafter_options\['early_exit'\]\['exit_layer'\]=9: must be"):
        speccomp.compile(llama6, drafter="early_exit+ngram", drafter_options={"early_exit": {"exit_layer": 9}})
    with pytest.raises(ValueError, match=r"^drafter_options\['token_recycling'\]\['max_ngram'\]=0: must be"):
        speccomp.compile(llama6, drafter="ngram+token_recycling", drafter_options={"token_recycling": {"max_ngram": 0}})


def test_text_drafter_options_are_checked_before_a_model_is_captured():
    """ngram / suffix / token_recycling options need no model: check_options (what the CLI runs before it loads
    one) refuses them now, where they failed only after the capture; an unknown option is named alone (the message
    showed a tree the caller never gave)."""
    from speccomp.api import check_options

    with pytest.raises(ValueError, match=r"^max_ngram=0: "):
        check_options(drafter="ngram", drafter_options={"max_ngram": 0})
    with pytest.raises(ValueError, match=r"^drafter_options\['token_recycling'\]\['max_ngram'\]=0: "):
        check_options(drafter="ngram+token_recycling", drafter_options={"token_recycling": {"max_ngram": 0}})
    with pytest.raises(ValueError, match=r"^drafter_options=\{'bogus': 1\}: unknown token_recycling options"):
        check_options(drafter="token_recycling", drafter_options={"bogus": 1})
    check_options(drafter="token_recycling", drafter_options={"tree": 3, "top_k": 4})  # trees: checked by compile


def test_merge_with_a_drafter_engines_cannot_run_is_not_exported(llama6, tmp_path, monkeypatch):
    """A drafter registered by the user merges like any other, but an engine cannot know its algorithm: export
    refuses the merge, naming it, before writing anything."""
    from speccomp.drafters import registry
    from speccomp.drafters.ngram import NGramDrafter
    from speccomp.engine.runtime import EngineError

    class Mine(NGramDrafter):
        name = "mine"

    monkeypatch.setitem(registry.DRAFTERS, "mine", lambda base, options, tree, backend: Mine())
    monkeypatch.setitem(registry.DECLARED, "mine", Mine)
    fast = speccomp.compile(llama6, drafter="mine+token_recycling")  # engine merges: test_engine.py
    ids = repetitive_prompt(96, 1)
    assert torch.equal(fast.generate(ids, max_new_tokens=20, eos_token_id=2), hf_greedy(llama6, ids, 20, eos=2))
    with pytest.raises(EngineError, match="drafter 'mine' cannot be exported as an engine yet"):
        fast.export(tmp_path / "engine")
    assert not (tmp_path / "engine").exists()  # refused before any work
