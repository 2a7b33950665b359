"""The drafter protocol: drafters declare what they read and which trees they take (speccomp/runtime/decode.py),
the registry knows those declarations before it builds one, and tree growth is written once
(speccomp/drafters/grow.py). The decode loop, autotune, merges and export read the declarations only."""
import pytest
import torch

import speccomp
from speccomp.drafters.grow import LOG_MIN_PROB, cut, grow, grow_dynamic, grow_static, torch_top
from speccomp.drafters.registry import DECLARED, DRAFTERS
from speccomp.errors import OptionError
from speccomp.passes.tree_attention import TreeAttention
from speccomp.runtime.decode import READS, TREES, Draft, DraftContext, Drafter
from speccomp.runtime.tree import DynamicTreeSpec, Tree
from speccomp.tuning.autotune import AutotuneError, retree
from tiny_models import tiny_llama


def greedy(model, ids, n):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:]


def test_every_registered_drafter_declares_itself_in_known_words():
    assert set(DECLARED) == set(DRAFTERS) == set(speccomp.available_drafters())
    for name, cls in DECLARED.items():
        assert isinstance(cls.reads, tuple) and set(cls.reads) <= set(READS), name
        assert isinstance(cls.trees, tuple) and set(cls.trees) <= set(TREES), name
    # what the rest of speccomp relies on
    assert not DECLARED["ngram"].reads and not DECLARED["ngram"].trees  # a text drafter that shapes its own trees
    assert not DECLARED["token_recycling"].reads and DECLARED["token_recycling"].trees == ("static",)
    assert DECLARED["hydra"].reads == ("states",) and "dynamic" in DECLARED["hydra"].trees
    assert "path_states" in DECLARED["eagle"].reads and "own_cache" in DECLARED["eagle"].reads
    assert DECLARED["layer_skip"].reads == ("target_cache",) and DECLARED["layer_skip"].graphs == ("draft",)
    # a switched-off batch row may skip Token Recycling's observe (its table misses a step); a drafter that does not
    # say is observed every step
    assert all(isinstance(cls.observe_optional, bool) for cls in DECLARED.values())
    assert DECLARED["token_recycling"].observe_optional and not Drafter.observe_optional
    from speccomp.drafters.merge import MergedDrafter
    from speccomp.drafters.ngram import NGramDrafter, TokenRecyclingDrafter

    text = [TokenRecyclingDrafter(), NGramDrafter()]
    assert MergedDrafter(text, ["token_recycling", "ngram"]).observe_optional  # skipped: every part's may be
    assert not MergedDrafter([*text, Counter([])], ["token_recycling", "ngram", "counter"]).observe_optional


@pytest.mark.parametrize("name, options, tree", [
    ("ngram", {"max_depth": 3, "num_branches": 2}, None),
    ("token_recycling", {"top_k": 4, "ngram_branches": 0}, [[0], [1], [0, 0]]),
    ("early_exit", {"exit_layer": 0}, "dynamic:6:2"),
    ("layer_skip", {"skip": [1]}, [[0], [0, 0]]),
])
def test_describe_rebuilds_the_drafter_and_with_tree_keeps_its_graphs(name, options, tree):
    model = tiny_llama(initializer_range=0.2)
    fast = speccomp.compile(model, drafter=name, drafter_options=options, tree=tree)
    about = fast.drafter.describe()
    assert about["name"] == name and options.items() <= about["options"].items()
    assert about["reads"] == list(DECLARED[name].reads) and about["graphs"] == list(DECLARED[name].graphs)
    again = speccomp.compile(model, drafter=name, drafter_options=about["options"], tree=tree)
    assert again.drafter.describe() == about  # the declared options rebuild the same drafter
    for kind, other in (("static", Tree.chain(2)), ("dynamic", DynamicTreeSpec(4, 2))):
        if kind not in fast.drafter.trees:
            with pytest.raises(AutotuneError, match="no tree kinds|trees only"):
                retree(fast.drafter, other)
            continue
        moved = retree(fast.drafter, other)
        assert type(moved) is type(fast.drafter) and moved.tree == other and moved.options == fast.drafter.options
        assert getattr(moved, "step", None) is getattr(fast.drafter, "step", None)  # same lowered graph
        ids = torch.arange(3, 15)[None]
        again = fast.with_drafter(moved)
        assert torch.equal(again.generate(ids, max_new_tokens=24)[0, 12:], greedy(model, ids, 24))
        assert again.last_stats["tau"] > 1.0  # drafts of the new tree were accepted


class Counter(Drafter):
    """Drafts the next token of a fixed reference text; records what the loop handed it."""

    name = "counter"
    trees = ("static",)

    def __init__(self, reference: list[int], reads: tuple = ()):
        self.reference, self.reads, self.handed = reference, reads, []

    def propose(self, ctx: DraftContext) -> Draft:
        nxt = self.reference[len(ctx.tokens)] if len(ctx.tokens) < len(self.reference) else 0
        return Draft(Tree.chain(1), torch.tensor([ctx.tokens[-1], nxt]))

    def take_states(self, states):
        self.handed.append(tuple(s.shape for s in states))


@pytest.mark.parametrize("reads", [(), ("states",), ("path_states",)])
def test_the_loop_hands_states_as_declared(reads):
    model = tiny_llama(initializer_range=0.2)
    ids = torch.arange(3, 13)[None]
    ref = ids[0].tolist() + greedy(model, ids, 20).tolist()
    drafter = Counter(ref, reads)
    fast = speccomp.compile(model, drafter=drafter)
    assert fast.generate(ids, max_new_tokens=20)[0].tolist() == ref
    steps = fast.last_stats["steps"]
    assert fast.last_stats["tau"] > 1.5  # the reference's drafts were accepted
    hidden = model.config.hidden_size
    if not reads:
        assert drafter.handed == []
    elif reads == ("states",):  # the newest token's hidden state, after the prefill and every verification
        assert drafter.handed == [(torch.Size([hidden]),)] * steps
    else:  # every prompt position, then every accepted path (root first)
        assert drafter.handed[0] == (torch.Size([10, hidden]),)
        assert sum(s[0][0] for s in drafter.handed[1:]) == 20 - 1  # each emitted token's position once, but the last
        assert len(drafter.handed) == steps


def test_bad_declarations_are_refused_at_compile():
    model = tiny_llama()

    class Legacy(Counter):
        wants_states = True  # the old hook: speccomp would silently never hand it states

    with pytest.raises(OptionError, match="wants_states.*declare reads"):
        speccomp.compile(model, drafter=Legacy([], ()))
    with pytest.raises(OptionError, match="declares reads=.*'hidden'"):
        speccomp.compile(model, drafter=Counter([], ("hidden",)))
    unsure = Counter([], ())
    unsure.observe_optional = "yes"
    with pytest.raises(OptionError, match="observe_optional='yes'.*True"):
        speccomp.compile(model, drafter=unsure)
    for passes in (TreeAttention, TreeAttention(), (lambda sg: sg,)):  # a class, one pass, a function: after capture
        bad = Counter([], ())
        bad.target_passes = passes
        with pytest.raises(OptionError, match="declares target_passes=.*declare a tuple of Pass instances"):
            speccomp.compile(model, drafter=bad)
    undeclared = Counter([], ())
    undeclared.trees = ()
    with pytest.raises(AutotuneError, match="declares no tree kinds"):
        retree(undeclared, Tree.chain(2))
    with pytest.raises(AutotuneError, match="static trees only; tune it with mode='static'"):
        retree(Counter([], ()), DynamicTreeSpec(4, 2))


class Malformed(Counter):
    """Counter's drafts, spoiled one way (`how`), to see the loop refuse them."""

    def __init__(self, reference: list[int], how: str):
        super().__init__(reference)
        self.how = how

    def propose(self, ctx: DraftContext) -> Draft:
        draft = super().propose(ctx)
        tokens = draft.tokens
        return {"wrong_root": lambda: Draft(draft.tree, torch.tensor([ctx.tokens[-2], tokens[1]])),
                "too_few": lambda: Draft(draft.tree, tokens[:1]),
                "out_of_vocab": lambda: Draft(draft.tree, torch.tensor([tokens[0], 10**6])),
                "negative": lambda: Draft(draft.tree, torch.tensor([tokens[0], -1])),
                "floats": lambda: Draft(draft.tree, tokens.float()),
                "tuple": lambda: (draft.tree, tokens)}[self.how]()


class Appender(Counter):
    """Drafts after appending to ctx.tokens, the text the loop emits into (was: wrong tokens, no error)."""

    def propose(self, ctx: DraftContext) -> Draft:
        ctx.tokens.append(ctx.tokens[-1])
        return Draft(Tree.chain(1), torch.tensor([ctx.tokens[-2], ctx.tokens[-1]]))


@pytest.mark.parametrize("how, words", [
    ("wrong_root", "rooted at token .*the root must be the last token emitted"),  # was: another text, no error
    ("too_few", "not a 1-D integer tensor of 2 ids"),  # was: an export guard's AssertionError
    ("out_of_vocab", r"outside the vocabulary \[0, 96\)"),  # was: IndexError in the embedding
    ("negative", "outside the vocabulary"),  # was: wrapped silently by ONNX Runtime's Gather
    ("floats", "not a 1-D integer tensor"),
    ("tuple", "a tuple, not a Draft"),
])
def test_a_users_malformed_drafts_are_refused_naming_the_drafter(how, words):
    model = tiny_llama(initializer_range=0.2)
    ids = torch.arange(3, 13)[None]
    ref = ids[0].tolist() + greedy(model, ids, 8).tolist()
    fast = speccomp.compile(model, drafter=Malformed(ref, how))
    with pytest.raises(OptionError, match=rf"^drafter='counter': proposed .*{words}.*return Draft\(tree, tokens\)"):
        fast.generate(ids, max_new_tokens=8)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int32])
def test_a_users_drafts_in_a_narrower_integer_type_decode_the_models_text(dtype):
    """int16 / uint8 ids passed the draft check and failed in the embedding (eager: 'Expected ... Long, Int'; inductor:
    an InductorBackendError blaming the C++ compiler)."""
    class Narrow(Counter):
        def propose(self, ctx: DraftContext) -> Draft:
            draft = super().propose(ctx)
            return Draft(draft.tree, draft.tokens.to(dtype))

    model = tiny_llama(initializer_range=0.2)
    ids = torch.arange(3, 13)[None]
    ref = ids[0].tolist() + greedy(model, ids, 12).tolist()
    fast = speccomp.compile(model, drafter=Narrow(ref))
    assert fast.generate(ids, max_new_tokens=12)[0].tolist() == ref and fast.last_stats["steps"] < 12


def test_a_drafter_cannot_change_the_text_it_is_shown():
    model = tiny_llama(initializer_range=0.2)
    ids = torch.arange(3, 13)[None]
    ref = ids[0].tolist() + greedy(model, ids, 12).tolist()
    assert speccomp.compile(model, drafter=Appender(ref)).generate(ids, max_new_tokens=12)[0].tolist() == ref


def test_a_users_drafter_named_like_a_builtin_is_not_exported(tmp_path):
    """Its manifest entry named speccomp's drafter: the engine would draft with that one (or call itself corrupt)."""
    from speccomp.engine.runtime import EngineError

    class Mine(Counter):
        name = "ngram"

    fast = speccomp.compile(tiny_llama(), drafter=Mine([]), backend="onnxruntime")
    with pytest.raises(EngineError, match="user-written Mine named like speccomp's own ngram"):
        fast.export(tmp_path / "e")
    assert not (tmp_path / "e").exists()


# ---- tree growth, written once ------------------------------------------------------------------------------


def scorer(table: dict[int, list[float]], calls: list):
    """expand() over a fixed table: candidate token -> logits of the next token (LOGP's are log-probs already)."""
    def expand(d, nodes, grown, k):
        calls.append((d, list(nodes)))
        return torch_top(torch.tensor([table[grown.token[c]] for c in nodes]), k)

    return expand


LOGP = {t: [float(x) for x in torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0]).roll(t).log_softmax(-1)] for t in range(5)}


def test_static_growth_fills_ranks_and_expands_only_parents():
    tree = Tree.from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    calls = []
    draft = grow(tree, DraftContext([4, 0], None, 8, 16), scorer(LOGP, calls))
    # token t's ranking is (t, t+1, t+2, ...) mod 5: root 0 -> [0]=0, [1]=1; [0,0]=0, [0,1]=1; [0,0,0]=0
    assert draft.tokens.tolist() == [0, 0, 1, 0, 1, 0] and draft.tree == tree
    assert calls == [(0, [0]), (1, [1]), (2, [3])]  # leaves are never expanded
    tokens = grow_static(list(tree.parents), list(tree.ranks), 0, scorer(LOGP, []))  # the torch-free core
    assert tokens == draft.tokens.tolist()
    cut_parents, cut_ranks = cut(list(tree.parents), list(tree.ranks), 1, 16)  # one token of room: depth 1 only
    assert (cut_parents, cut_ranks) == ([-1, 0, 0], [0, 0, 1])
    short = grow(tree, DraftContext([4, 0], None, 1, 16), scorer(LOGP, []))
    assert list(short.tree.parents) == cut_parents and short.tokens.tolist() == [0, 0, 1]


def test_dynamic_growth_keeps_the_likeliest_prefix_closed_candidates():
    calls = []
    draft = grow(DynamicTreeSpec(4, 2), DraftContext([4, 0], None, 8, 16), scorer(LOGP, calls), max_depth=3)
    assert [d for d, _ in calls] == [0, 1, 2] and all(len(n) <= 2 for _, n in calls)
    tree, tokens = draft.tree, draft.tokens.tolist()
    assert tree.size == 5 and tokens[0] == 0
    assert all(tree.parents[c] < c for c in range(1, tree.size))  # prefix-closed, BFS order
    score = [0.0]
    for c in range(1, tree.size):
        score.append(score[tree.parents[c]] + LOGP[tokens[tree.parents[c]]][tokens[c]])
    assert score[1] == max(score[1:])  # the likeliest candidate is first
    assert grow_dynamic(4, 2, 0, scorer(LOGP, []), 3) == (list(tree.parents), tokens)  # the torch-free core
    stop = grow(DynamicTreeSpec(4, 2), DraftContext([4, 0], None, 8, 16), lambda d, n, g, k: None)
    assert stop.tree.size == 1  # expand said: no room
    flat = {t: [0.0] * 100 for t in range(100)}  # 1% each, below MIN_PROB: nothing worth a second level
    calls = []
    grow(DynamicTreeSpec(8, 2), DraftContext([4, 0], None, 8, 16), scorer(flat, calls))
    assert len(calls) == 1
