"""Model-free drafters: prompt lookup (NGramDrafter) and Token Recycling.

Unit tests on hand-made token lists, then end-to-end: speculative decoding with these drafters
on a tiny random Llama must return exactly the tokens of HF greedy `generate`.
"""
import random

import pytest
import torch

from speccomp.drafters.ngram import (
    DEFAULT_RECYCLING_TREE,
    NGramDrafter,
    TokenRecyclingDrafter,
    make_ngram,
    make_token_recycling,
)
from speccomp.runtime.decode import Draft, DraftContext
from speccomp.runtime.tree import Tree


def ctx(tokens, max_depth=100, max_nodes=64):
    return DraftContext(list(tokens), cache=None, max_depth=max_depth, max_nodes=max_nodes)


def paths(draft: Draft) -> set[tuple[int, ...]]:
    """Root-to-leaf token paths of a draft (root token excluded)."""
    toks = draft.tokens.tolist()
    out = set()
    for row in draft.tree.paths.tolist():
        out.add(tuple(toks[i] for i in row[1:] if i >= 0))
    return out


def check_draft(draft: Draft, root: int):
    tree = draft.tree
    assert draft.tokens.dtype == torch.long and draft.tokens.shape == (tree.size,)
    assert int(draft.tokens[0]) == root and draft.probs is None
    assert all(p < i for i, p in enumerate(tree.parents) if i)  # topological
    assert tree.depth.tolist() == sorted(tree.depth.tolist())  # BFS: a prefix is a valid cut
    toks = draft.tokens.tolist()
    for kids in tree.children:  # no duplicate siblings, ranks 0..k-1 in node order
        assert len({toks[c] for c in kids}) == len(kids)
        assert [tree.ranks[c] for c in kids] == list(range(len(kids)))


# ---------------------------------------------------------------------------------------------
# NGramDrafter
# ---------------------------------------------------------------------------------------------

#            0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
TEXT = [1, 2, 3, 4, 9, 2, 3, 5, 9, 2, 3, 4, 7, 2, 3]  # root 3; "2 3" ends at 2, 6, 10


def test_ngram_trie_merges_most_recent_first():
    d = NGramDrafter(max_ngram=3, min_ngram=1, num_branches=3, max_depth=3)
    d.begin(TEXT[:5])
    draft = d.propose(ctx(TEXT))
    check_draft(draft, 3)
    # continuations after ends 10, 6, 2: [4 7 2], [5 9 2], [4 9 2]; the first and last share "4"
    assert draft.tokens.tolist() == [3, 4, 5, 7, 9, 9, 2, 2, 2]
    assert draft.tree.parents == (-1, 0, 0, 1, 1, 2, 3, 4, 5)
    assert paths(draft) == {(4, 7, 2), (4, 9, 2), (5, 9, 2)}
    assert draft.tree.ranks[1] == 0 and draft.tokens[1] == 4  # most recent occurrence is rank 0
    assert draft.tokens[draft.tree.children[1][0]] == 7  # ... at every level


def test_ngram_longest_match_first_then_shorter_fill():
    #       0  1  2  3  4  5  6  7  8  9
    text = [5, 1, 2, 8, 6, 2, 9, 1, 2]  # root 2: "1 2" at end 2, "2" alone also at end 5
    one = NGramDrafter(max_ngram=2, min_ngram=1, num_branches=1, max_depth=2).propose(ctx(text))
    assert paths(one) == {(8, 6)}  # the 2-gram match wins although "2 9" is more recent
    two = NGramDrafter(max_ngram=2, min_ngram=1, num_branches=2, max_depth=2).propose(ctx(text))
    assert paths(two) == {(8, 6), (9, 1)}
    assert two.tokens[1] == 8  # longer-match branch first
    only2 = NGramDrafter(max_ngram=2, min_ngram=2, num_branches=4, max_depth=2).propose(ctx(text))
    assert paths(only2) == {(8, 6)}


def test_ngram_repeated_continuations_do_not_use_up_branches():
    text = [7, 1, 7, 1, 7, 1, 7, 2, 3, 7]  # root 7: followed by 1 three times, once by 2
    draft = NGramDrafter(max_ngram=1, num_branches=2, max_depth=1).propose(ctx(text))
    assert sorted(draft.tokens.tolist()[1:]) == [1, 2]


def test_ngram_no_match_is_root_only():
    d = NGramDrafter()
    for text in ([4], [1, 2, 3, 4]):
        draft = d.propose(ctx(text))
        assert draft.tree == Tree.from_parents((-1,)) and draft.tokens.tolist() == [text[-1]]
    # the root's own n-gram (the last position) never matches itself
    draft = NGramDrafter().propose(ctx([3, 3]))
    assert draft.tokens.tolist() == [3, 3]


def test_ngram_respects_depth_and_nodes():
    text = list(range(20)) + list(range(10))  # root 9; continuation 10 11 12 ...
    full = NGramDrafter(max_depth=8).propose(ctx(text))
    assert full.tokens.tolist() == list(range(9, 18))
    assert NGramDrafter(max_depth=3).propose(ctx(text)).tree.max_depth == 3
    assert NGramDrafter(max_depth=8).propose(ctx(text, max_depth=2)).tokens.tolist() == [9, 10, 11]
    assert NGramDrafter().propose(ctx(text, max_depth=0)).tokens.tolist() == [9]
    d = NGramDrafter(max_ngram=1, num_branches=3, max_depth=4)
    draft = d.propose(ctx(TEXT, max_nodes=4))
    check_draft(draft, 3)
    assert draft.tree.size == 4 and draft.tokens.tolist() == [3, 4, 5, 7]  # BFS prefix of the trie
    assert d.propose(ctx(TEXT, max_nodes=1)).tree.size == 1


def test_ngram_incremental_index_matches_fresh():
    rng = random.Random(0)
    text = [rng.randrange(6) for _ in range(120)]
    inc = NGramDrafter(max_ngram=3, min_ngram=1, num_branches=3, max_depth=4)
    inc.begin(text[:10])
    for end in range(11, len(text) + 1, 3):  # grows by several tokens at a time, like the decode loop
        got = inc.propose(ctx(text[:end]))
        want = NGramDrafter(max_ngram=3, min_ngram=1, num_branches=3, max_depth=4).propose(ctx(text[:end]))
        assert got.tokens.tolist() == want.tokens.tolist() and got.tree == want.tree
        check_draft(got, text[end - 1])
    # a new generation: begin() forgets the old text
    inc.begin([8, 9])
    assert inc.propose(ctx([8, 9, 1])).tree.size == 1
    # reused without begin on a shorter text: re-indexes instead of using stale positions
    inc.propose(ctx(text))
    assert inc.propose(ctx([1, 2, 1])).tokens.tolist() == [1, 2, 1]


# ---------------------------------------------------------------------------------------------
# TokenRecyclingDrafter
# ---------------------------------------------------------------------------------------------


def logits_with_top(rows: list[list[int]], vocab: int = 32) -> torch.Tensor:
    """Logits [n, V] whose top-k at row i is rows[i], in that order."""
    out = torch.zeros(len(rows), vocab)
    for i, row in enumerate(rows):
        for r, t in enumerate(row):
            out[i, t] = 10.0 - r
    return out


def test_recycling_observe_uses_every_verified_node():
    d = TokenRecyclingDrafter(top_k=2, tree=[[0], [1], [0, 0]], ngram_branches=0)
    d.begin([1, 2, 3])
    assert d.adj == {}
    tree = Tree.from_parents((-1, 0, 0, 1))  # root 3 -> 4 (-> 6), 5
    draft = Draft(tree, torch.tensor([3, 4, 5, 6]))
    path = [0, 2]  # only node 2 (token 5) accepted
    d.observe(draft, path, logits_with_top([[5, 4], [6, 7], [8, 9], [10, 11]]))
    # rejected nodes 1 and 3 are recycled too
    assert d.adj == {3: [5, 4], 4: [6, 7], 5: [8, 9], 6: [10, 11]}


def test_recycling_accepted_path_wins_on_repeated_tokens():
    d = TokenRecyclingDrafter(top_k=1, tree=[[0]], ngram_branches=0)
    tree = Tree.from_parents((-1, 0, 0, 1))
    draft = Draft(tree, torch.tensor([3, 7, 5, 7]))  # token 7 at nodes 1 (accepted) and 3 (not)
    d.observe(draft, [0, 1], logits_with_top([[7], [20], [9], [21]]))
    assert d.adj[7] == [20]


def test_recycling_bfs_over_template_prunes_unknown():
    template = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    d = TokenRecyclingDrafter(top_k=2, tree=template, ngram_branches=0)
    d.begin([])
    assert d.propose(ctx([3])).tree.size == 1  # empty table: root only
    d.adj = {3: [4, 5], 4: [6, 7], 6: [8, 9]}  # 5 and 7 were never verified
    draft = d.propose(ctx([3]))
    check_draft(draft, 3)
    assert paths(draft) == {(4, 6, 8), (4, 7), (5,)}
    assert draft.tokens.tolist() == [3, 4, 5, 6, 7, 8]
    assert draft.tree.ranks == (0, 0, 1, 0, 1, 0)  # equal to the template ranks where nothing was pruned
    # ctx limits
    assert d.propose(ctx([3], max_depth=1)).tokens.tolist() == [3, 4, 5]
    assert d.propose(ctx([3], max_nodes=4)).tokens.tolist() == [3, 4, 5, 6]


def test_recycling_hybrid_adds_prompt_lookup_branch_merged():
    d = TokenRecyclingDrafter(top_k=2, tree=[[0], [1], [0, 0]], ngram_branches=1, ngram_depth=3)
    text = [3, 4, 11, 12, 9, 3]  # earlier "3" was followed by 4 11 12
    d.begin(text[:-1])
    d.adj = {3: [4, 5], 4: [6, 7]}
    draft = d.propose(ctx(text))
    check_draft(draft, 3)
    # the lookup branch 4 11 12 shares node "4" with the table's top-1 guess
    assert paths(draft) == {(4, 6), (4, 11, 12), (5,)}
    assert draft.tree.size == 6
    # unknown root token: the lookup branch is the fallback
    d.adj = {}
    assert paths(d.propose(ctx(text))) == {(4, 11, 12)}
    # pure recycling ignores the text
    d0 = TokenRecyclingDrafter(top_k=2, tree=[[0]], ngram_branches=0)
    assert d0.propose(ctx(text)).tree.size == 1


def test_recycling_begin_resets_unless_persist():
    for persist, size in ((False, 1), (True, 2)):
        d = TokenRecyclingDrafter(top_k=1, tree=[[0]], ngram_branches=0, persist=persist)
        d.begin([1])
        d.observe(Draft(Tree.from_parents((-1,)), torch.tensor([3])), [0], logits_with_top([[4]]))
        d.begin([1])
        assert d.propose(ctx([3])).tree.size == size


def test_default_recycling_tree():
    """The default tree; with a top_k below its widest rank, its nodes of the ranks top_k keeps (the default was
    refused, naming a tree nobody gave, and autotune could not tune top_k < 6 at all)."""
    t = Tree.from_choices(DEFAULT_RECYCLING_TREE)
    assert 20 <= t.size <= 30 and t.max_depth == 6
    assert TokenRecyclingDrafter().tree == TokenRecyclingDrafter(top_k=max(t.ranks) + 1).tree == t
    for k in (1, 3):
        narrow = TokenRecyclingDrafter(top_k=k).tree
        assert max(narrow.ranks) == k - 1 and narrow.max_depth == 6
        assert narrow.choices == [c for c in t.choices if max(c) < k]


# ---------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(max_ngram=1, min_ngram=2), "max_ngram"),
        (dict(min_ngram=0), "min_ngram"),
        (dict(num_branches=0), "num_branches"),
        (dict(max_depth=0), "max_depth"),
        (dict(max_ngram=2.0), "max_ngram"),
        (dict(max_depth=True), "max_depth"),
        (dict(depth=3), "unknown ngram options"),
    ],
)
def test_ngram_bad_options(options, words):
    with pytest.raises((ValueError, TypeError), match=words):
        make_ngram(**options)


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(top_k=0), "top_k"),
        (dict(top_k=2, tree=[[0], [2]]), "rank 2"),
        (dict(tree=[[0], [0, 0, 1]]), "orphan"),
        (dict(tree=[]), "empty"),
        (dict(tree="dynamic"), "static tree"),
        (dict(ngram_branches=-1), "ngram_branches"),
        (dict(max_ngram=1, min_ngram=3), "max_ngram"),
        (dict(ngram_depth=0), "ngram_depth"),
        (dict(persist="yes"), "persist"),
        (dict(k=8), "accepted options"),
    ],
)
def test_recycling_bad_options(options, words):
    with pytest.raises((ValueError, TypeError), match=words):
        make_token_recycling(**options)


def test_factories_and_tree_errors():
    assert isinstance(make_ngram(), NGramDrafter) and make_ngram().name == "ngram"
    d = make_token_recycling(top_k=3, tree=4)  # an int is a chain
    assert d.name == "token_recycling" and d.tree == Tree.chain(4)
    with pytest.raises(ValueError, match=r"tree=\[\[0\], \[0\]\]: duplicate choice"):
        make_token_recycling(tree=[[0], [0]])


# ---------------------------------------------------------------------------------------------
# end to end: lossless on a tiny Llama
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target():
    from tiny_models import tiny_llama

    from speccomp.frontend import capture
    from speccomp.frontend.graph import SpecGraph, run_passes
    from speccomp.passes.tree_attention import TreeAttention

    model = tiny_llama()
    sg = run_passes(SpecGraph.from_captured(capture(model)), [TreeAttention()])
    return model, sg


_HF: dict = {}  # (prompt, n) -> HF greedy tokens: generate once per module, not once per drafter


PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 11, 12, 13, 14, 15, 16, 17, 18],
    [30, 31, 30, 31, 40, 41, 42, 30, 31, 30],
]


def run(tiny_target, drafter, prompt, n, max_tree=64, sampler=None):
    import speccomp.runtime.sampling
    from speccomp.runtime.decode import FullCache, decode

    _, sg = tiny_target
    prompt = torch.tensor([prompt])
    sampler = sampler or speccomp.runtime.sampling.Sampler()
    target = FullCache(sg.gm, sg.captured.kv, prompt.shape[1] + n + max_tree + 1, "cpu")
    return decode(target, drafter, prompt, n, eos=set(), sampler=sampler, max_tree=max_tree)


def hf_greedy(model, prompt, n):
    key = (tuple(prompt), n)
    if key not in _HF:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
        _HF[key] = out[0, ids.shape[1] :].tolist()
    return _HF[key]


@pytest.mark.parametrize(
    "make",
    [
        lambda: NGramDrafter(),
        lambda: NGramDrafter(max_ngram=2, num_branches=2, max_depth=5),
        lambda: TokenRecyclingDrafter(),
        lambda: TokenRecyclingDrafter(top_k=4, tree=[[0], [1], [0, 0], [0, 0, 0]], ngram_branches=0),
        lambda: TokenRecyclingDrafter(top_k=2, ngram_branches=0),
    ],
    ids=["ngram", "ngram_small", "recycling", "recycling_pure", "recycling_narrow_default"],
)
def test_lossless_greedy(tiny_target, make):
    model, _ = tiny_target
    n = 40
    taus = []
    drafter = make()  # reused across generations: begin() must reset it
    for prompt in PROMPTS:
        out, stats = run(tiny_target, drafter, prompt, n)
        assert out.tolist() == hf_greedy(model, prompt, n)
        assert stats.new_tokens == n
        taus.append(stats.new_tokens / stats.steps)
    print(f"tau per prompt: {[round(t, 2) for t in taus]}")
    assert max(taus) > 1.5


def test_lossless_small_tree_and_short_budget(tiny_target):
    """max_tree and max_new_tokens cut the drafts (ctx.max_nodes / ctx.max_depth)."""
    model, _ = tiny_target
    for n in (1, 2, 7):  # HF's first 7 tokens are a prefix of its first 40
        for drafter in (NGramDrafter(), TokenRecyclingDrafter()):
            out, _ = run(tiny_target, drafter, PROMPTS[0], n, max_tree=3)
            assert out.tolist() == hf_greedy(model, PROMPTS[0], 40)[:n]


def test_sampling_runs_with_deterministic_drafts(tiny_target):
    """Rejection-sampling acceptance with probs=None drafts; near-zero temperature is greedy."""
    import speccomp.runtime.sampling

    model, _ = tiny_target
    want = hf_greedy(model, PROMPTS[0], 40)[:30]
    for drafter in (NGramDrafter(), TokenRecyclingDrafter()):
        sampler = speccomp.runtime.sampling.Sampler(do_sample=True, temperature=1e-4, seed=0)
        out, stats = run(tiny_target, drafter, PROMPTS[0], 30, sampler=sampler)
        assert out.tolist() == want
        assert stats.new_tokens / stats.steps > 1
