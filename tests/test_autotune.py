"""Tree autotuning: the DP against brute force, acceptance measurement, the cache, and tree="auto" end to end."""
import itertools
import json
import random
import re
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import speccomp
from speccomp.tuning.autotune import (
    Acceptance,
    AutotuneError,
    draft_seconds,
    fit_loop_overhead,
    load_result,
    loop_seconds,
    measure_acceptance,
    monotone_fit,
    plan_static,
    plot_report,
    probe_tree,
    realized_size,
    resolve_auto,
    result_path,
)
from speccomp.errors import OptionError
from speccomp.runtime.decode import Draft, Drafter
from speccomp.runtime.tree import DynamicTreeSpec, Tree, greedy_accept
from speccomp.tuning.tree_dp import best_within, expected_accepted, optimal_trees
from speccomp.drafters.ngram import DEFAULT_RECYCLING_TREE
from tiny_models import keep_drafting, tiny_llama


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCOMP_CACHE", str(tmp_path))
    return tmp_path


def hf_greedy(model, ids, n):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)


# --------------------------------------------------------------------------------------------
# The DP
# --------------------------------------------------------------------------------------------


def ordered_trees(m: int, depth: int, max_depth: int, K: int):
    """Every ordered tree of m nodes rooted at `depth` (at most K children per node, none below max_depth),
    as a tuple of child subtrees in rank order."""
    if m == 1:
        yield ()
        return
    if depth == max_depth:
        return

    def forests(m, slots):
        if m == 0:
            yield ()
            return
        if slots == 0:
            return
        for s in range(1, m + 1):
            for first in ordered_trees(s, depth + 1, max_depth, K):
                for rest in forests(m - s, slots - 1):
                    yield (first,) + rest

    yield from forests(m - 1, K)


def as_choices(tree, prefix=()):
    out = []
    for r, child in enumerate(tree):
        out.append(list(prefix + (r,)))
        out += as_choices(child, prefix + (r,))
    return out


def random_table(rng, depth, K, exact=True):
    """A sub-stochastic acceptance table (each row sums to <= 1), as Fractions (exact) or floats."""
    table = []
    for _ in range(depth):
        w = [rng.randint(0, 9) for _ in range(K)]
        total = max(sum(w) + rng.randint(0, 9), 1)
        table.append([Fraction(x, total) if exact else x / total for x in w])
    return table


def check_valid(choices, n, max_depth, K):
    tree = Tree.from_choices(choices) if choices else Tree.from_parents((-1,))
    assert tree.size == n and tree.max_depth <= max_depth
    paths = {tuple(c) for c in choices}
    for c in choices:
        assert c[-1] < K
        if c[-1] > 0:  # rank-ordered: the rank r child exists only with ranks 0..r-1
            assert tuple(c[:-1]) + (c[-1] - 1,) in paths, (c, choices)


@pytest.mark.parametrize("seed", range(8))
def test_dp_equals_brute_force_exactly(seed):
    rng = random.Random(seed)
    D, K = rng.randint(1, 4), rng.randint(1, 4)
    p = random_table(rng, D, K)
    for limit in sorted({D, rng.randint(1, D)}):
        sols = optimal_trees(p, 8, max_depth=limit)
        for n in range(1, 9):
            values = [expected_accepted(as_choices(t), p) for t in ordered_trees(n, 0, limit, K)]
            sol = sols[n - 1]
            if not values:  # no ordered tree of n nodes fits the depth limit and K ranks
                assert sol is None
                continue
            assert sol is not None and sol.value == max(values)  # Fractions: exact
            assert expected_accepted(sol.choices, p) == sol.value
            check_valid(sol.choices, n, limit, K)
            assert sol.max_depth == max((len(c) for c in sol.choices), default=0)


def test_brute_force_enumerates_all_ordered_trees():
    # ordered trees of n nodes are counted by the Catalan number C(n-1); the brute force must see them all
    assert [sum(1 for _ in ordered_trees(n, 0, 99, 99)) for n in range(1, 9)] == [1, 1, 2, 5, 14, 42, 132, 429]


def test_dp_depth_independent_sequoia_table():
    # Sequoia's simpler p[r], the same at every depth
    rng = random.Random(11)
    row = random_table(rng, 1, 3)[0]
    p = [row] * 4
    sols = optimal_trees(p, 7)
    for n in range(1, 8):
        best = max(expected_accepted(as_choices(t), p) for t in ordered_trees(n, 0, 4, 3))
        assert sols[n - 1].value == best


def test_dp_known_shapes():
    # certain rank-0 guesses: the best tree is a chain and every node counts fully
    sols = optimal_trees([[1.0, 0.0]] * 6, 7)
    assert sols[6].choices == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert sols[6].value == 7
    # nothing below depth 1 is ever accepted: the best 4-node tree is a star of the top 3 candidates
    sols = optimal_trees([[0.5, 0.3, 0.1], [0.0, 0.0, 0.0]], 4)
    assert sols[3].choices == [[0], [1], [2]] and sols[3].value == pytest.approx(1.9)
    # depth limit 1 with 2 ranks: no tree of more than 3 nodes
    sols = optimal_trees([[0.5, 0.3]], 5, max_depth=1)
    assert sols[3] is None and sols[4] is None and sols[2].choices == [[0], [1]]


def test_dp_monotone_in_budget():
    rng = random.Random(5)
    for _ in range(3):
        p = random_table(rng, 5, 6, exact=False)
        sols = optimal_trees(p, 40)
        values = [s.value for s in sols if s is not None]
        assert len(values) == 40  # 5 deep x 6 wide holds 40 nodes
        assert all(b >= a - 1e-12 for a, b in zip(values, values[1:]))
        budgets = [best_within(sols, n).value for n in range(1, 41)]
        assert all(b >= a for a, b in zip(budgets, budgets[1:]))
        for s in sols:
            check_valid(s.choices, s.size, 5, 6)


def test_expected_value_matches_greedy_acceptance_by_simulation():
    # the DP's objective is what greedy_accept really yields when the target's token is the rank-r
    # candidate of an accepted depth-d node with probability p[d][r]
    p = [[0.5, 0.2, 0.1], [0.6, 0.1, 0.0], [0.4, 0.2, 0.1]]
    sol = optimal_trees(p, 9)[8]
    tree = Tree.from_choices(sol.choices)
    depth = tree.depth.tolist()
    tokens = torch.tensor([0] + [100 + tree.ranks[i] for i in range(1, tree.size)])  # siblings: distinct tokens
    gen = torch.Generator().manual_seed(0)
    total, trials = 0, 4000
    for _ in range(trials):
        u = torch.rand(tree.size, generator=gen).tolist()
        want = []
        for i in range(tree.size):
            row = p[depth[i]] if depth[i] < len(p) else []
            acc, pick = 0.0, 999  # 999: a token no child has
            for r, q in enumerate(row):
                acc += q
                if u[i] < acc:
                    pick = 100 + r
                    break
            want.append(pick)
        path, _ = greedy_accept(tree, tokens, torch.tensor(want))
        total += len(path)  # accepted drafts + the root's slot = tokens emitted incl. the bonus
    mean = total / trials
    assert abs(mean - sol.value) < 0.06, (mean, sol.value)


def test_dp_rejects_bad_tables():
    with pytest.raises(ValueError, match="probability"):
        optimal_trees([[1.2]], 3)
    with pytest.raises(ValueError, match="at least one"):
        optimal_trees([], 3)
    with pytest.raises(ValueError, match="max_nodes"):
        optimal_trees([[0.5]], 0)


def test_plan_static_prediction_is_expected_over_step_time():
    p = [[0.8, 0.1], [0.7, 0.1], [0.6, 0.1]]
    flat = {"sizes": [1, 16], "verify_s": [0.05, 0.05], "widths": [], "draft_s": [], "propose_s": 0.001,
            "observe_per_node_s": 0.0, "loop_overhead_s": 0.0, "draft_overhead_per_level_s": 0.0}
    rows = plan_static(p, flat, 16, 3)
    assert [r["n"] for r in rows] == list(range(2, 16))  # 3 deep x 2 wide holds at most 15 nodes
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(r["expected"] / 0.051)
        assert r["expected"] == pytest.approx(expected_accepted(r["choices"], p))
    steep = dict(flat, verify_s=[0.05, 0.5])  # verification cost grows fast with n: small trees win
    assert max(plan_static(p, steep, 16, 3), key=lambda r: r["tokens_per_s"])["n"] < max(rows, key=lambda r: r["tokens_per_s"])["n"]


def test_loop_overhead_fit_recovers_a_line_and_clamps_noise():
    # exact points on 2 ms + 0.5 ms/node come back exactly, whatever the weights
    pts = [(1, 0.0025, 100), (5, 0.0045, 30), (49, 0.0265, 60), (17, 0.0105, 10)]
    a, b = fit_loop_overhead(pts)
    assert a == pytest.approx(0.002) and b == pytest.approx(0.0005)
    assert loop_seconds({"loop_overhead_s": a, "loop_overhead_per_node_s": b}, 9) == pytest.approx(0.0065)
    assert fit_loop_overhead([(8, 0.004, 5)]) == (0.004, 0.0)  # one size: a constant
    assert fit_loop_overhead([(1, 0.010, 1), (49, 0.002, 1)]) == (pytest.approx(0.006), 0.0)  # falling: flat mean
    a, b = fit_loop_overhead([(1, -0.004, 1), (49, 0.020, 1)])  # negative intercept: through the origin
    assert a == 0.0 and b > 0
    assert fit_loop_overhead([]) == (0.0, 0.0)


def test_graph_drafter_overhead_is_charged_per_draft_level():
    timing = {"widths": [1, 8], "draft_s": [0.05, 0.07], "draft_overhead_per_level_s": 0.005, "propose_s": 1.0}
    one_level = [[0], [1], [2]]  # root -> 3 children: one draft forward over the root
    chain = [[0], [0, 0], [0, 0, 0]]  # three forwards of width 1
    assert draft_seconds(timing, one_level) == pytest.approx(0.05 + 0.005)
    assert draft_seconds(timing, chain) == pytest.approx(3 * (0.05 + 0.005))
    old = {"widths": [1, 8], "draft_s": [0.05, 0.07], "draft_overhead_s": 0.02, "propose_s": 1.0}  # results stored before
    assert draft_seconds(old, one_level) == pytest.approx(0.07)
    assert draft_seconds({"widths": [], "propose_s": 0.3}, chain) == 0.3  # other drafters: the probe's propose time


def test_monotone_fit_and_realized_size():
    assert monotone_fit([3.0, 1.0, 2.0, 5.0, 4.0, 6.0]) == [2.0, 2.0, 2.0, 4.5, 4.5, 6.0]
    assert monotone_fit([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    # token recycling sends only the nodes its table has rows for: half of depth 1, a quarter of depth 2
    timing = {"presence": [0.5, 0.25]}
    assert realized_size(timing, [[0], [1], [0, 0], [0, 1]]) == 1 + 2 * 0.5 + 2 * 0.25
    assert realized_size({}, [[0], [1], [0, 0]]) == 4


# --------------------------------------------------------------------------------------------
# Measuring acceptance
# --------------------------------------------------------------------------------------------


class Oracle(Drafter):
    """Knows the greedy continuation: the true token sits at rank RANK[d] at depth d (nowhere if absent)."""

    name = "oracle"
    trees = ("static",)  # declared: autotune hands it other static trees through with_tree
    RANK = {1: 0, 2: 0, 3: 1}

    def __init__(self, ref: list[int], tree: Tree):
        self.ref, self.tree = ref, tree

    def with_tree(self, tree):
        return Oracle(self.ref, tree)

    def propose(self, ctx):
        tree, pos = self.tree, len(ctx.tokens)
        tokens = [ctx.tokens[-1]] + [0] * (tree.size - 1)
        true = [True] + [False] * (tree.size - 1)
        depth = tree.depth.tolist()
        for c in range(1, tree.size):
            d, r = depth[c], tree.ranks[c]
            t = self.ref[pos + d - 1] if pos + d - 1 < len(self.ref) else 0
            true[c] = true[tree.parents[c]] and self.RANK.get(d) == r
            tokens[c] = t if true[c] else (t + 1 + r) % 96
        return Draft(tree, torch.tensor(tokens))


def test_measure_acceptance_recovers_a_known_table():
    model = tiny_llama()
    ids = torch.arange(3, 13)[None]
    ref = hf_greedy(model, ids, 40)[0].tolist()
    sm = speccomp.compile(model, drafter=Oracle(ref, Tree.chain(1)))
    acc, steps, runs = measure_acceptance(sm, [ids], max_new_tokens=30, depth=4, ranks=3)
    assert len(steps) == runs[0]["steps"] - 1 and runs[0]["new_tokens"] == 30
    assert acc.p_raw[:3] == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    assert acc.visits[3] == 0 and acc.p[3] == [0.0, 0.0, 0.0]  # the spine is never accepted at depth 3
    assert acc.visits[0] == sum(1 for s in steps if s["room"] >= 1) and acc.visits[0] >= acc.visits[2] > 0
    # the DP's best 5-node tree reaches the true depth-3 token, which needs its rank-0 sibling before it
    sol = optimal_trees(acc.p_raw, 5)[4]
    assert sol.choices == [[0], [0, 0], [0, 0, 0], [0, 0, 1]] and sol.value == 4
    # each step knows how much of the reply exists before it; warmup leaves the early (cold) steps out
    gens = [s["generated"] for s in steps]
    assert gens == list(itertools.accumulate([len(s["path"]) for s in steps[:-1]], initial=0))
    late, late_steps, _ = measure_acceptance(sm, [ids], max_new_tokens=30, depth=4, ranks=3, warmup=12)
    counted = [s for s in late_steps if s["generated"] >= 12]
    assert 0 < len(counted) < len(late_steps)
    assert late.visits[0] == sum(1 for s in counted if s["room"] >= 1) < acc.visits[0]


def test_acceptance_shrinks_rarely_visited_depths():
    acc = Acceptance(hits=[[30, 10], [1, 0], [0, 0]], visits=[50, 1, 0])
    assert acc.p_raw[1] == [1.0, 0.0]
    assert acc.p[0] == [0.6, 0.2]
    assert acc.p[1] == pytest.approx([(1 + 4 * 0.6) / 5, (0 + 4 * 0.2) / 5])
    assert acc.p[2] == [0.0, 0.0]


def test_probe_tree_shape():
    probe = probe_tree(3, 4)
    assert probe.size == 13 and probe.max_depth == 3
    assert sorted(c for c in probe.choices if len(c) == 3) == [[0, 0, r] for r in range(4)]


# --------------------------------------------------------------------------------------------
# End to end: autotune, the cache, compile(tree="auto")
# --------------------------------------------------------------------------------------------


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 96, (1, 10), generator=g) for _ in range(2)]


def test_autotune_layer_skip_then_compile_auto_equals_hf(cache):
    model = tiny_llama(num_hidden_layers=6, initializer_range=0.2)
    with pytest.raises(AutotuneError, match="no tokenizer beside the model's weights"):
        speccomp.compile(model, drafter="layer_skip", tree="auto")  # nothing stored, nothing to tune on
    result = speccomp.autotune(model, "layer_skip", prompts(), max_new_tokens=24, repeats=2, dynamic_budgets=(4, 8), max_nodes=16)
    result = keep_drafting(result)  # the tree's path (plain's: test_tree_auto_compiles_plain_decoding_where_no_tree_paid)
    # measurement: a probe of 6 depths x 8 ranks; probabilities, rows of disjoint events
    p = result.acceptance["p"]
    assert len(p) == 6 and all(len(row) == 8 for row in p)
    assert all(0.0 <= x <= 1.0 for row in p for x in row) and all(sum(row) <= 1 + 1e-9 for row in p)
    assert result.acceptance["visits"][0] > 0
    assert len(result.timing["verify_s"]) == len(result.timing["sizes"]) and all(t > 0 for t in result.timing["verify_s"])
    assert result.timing["widths"] and all(t > 0 for t in result.timing["draft_s"])  # a graph drafter: per-depth cost
    assert result.timing["presence"] == [1.0] * 6  # a graph drafter fills every node of its tree
    # optimisation: a DP tree for every size, better trees never predicted to accept less
    assert [r["n"] for r in result.static] == list(range(2, 17))
    expected = [r["expected"] for r in result.static]
    assert all(b >= a - 1e-9 for a, b in zip(expected, expected[1:]))
    assert [r["budget"] for r in result.dynamic] == [4, 8]
    # choice: the fastest measured decode among the DP's best, the budgets, the hand-made shapes and the default
    assert {"chain 2", "chain 4", "binary 8"} <= {r["label"] for r in result.measured}
    assert result.measured and all(r["identical"] for r in result.measured)
    fastest = max(result.measured, key=lambda r: r["measured_tokens_per_s"])
    if result.check.get("kept") != "default":
        assert result.tree == fastest["tree"] and result.measured_tokens_per_s == fastest["measured_tokens_per_s"]
    assert result.acceptance["warmup"] == 6  # max_new_tokens // 4
    # the cache: keyed by model, drafter, backend, machine
    assert result.path.startswith(str(cache)) and json.loads(open(result.path).read())["tree"] == result.tree
    assert load_result(model, "layer_skip").tree == result.tree
    assert load_result(model, "layer_skip", "onnxruntime") is None
    assert load_result(model, "early_exit") is None
    torch.set_num_threads(2)
    try:
        assert load_result(model, "layer_skip") is None  # timed with another thread count
    finally:
        torch.set_num_threads(1)
    # tree="auto": the stored tree and options, output exactly HF greedy
    fast = speccomp.compile(model, drafter="layer_skip", tree="auto")
    assert fast.drafter.options == result.drafter_options
    spec = result.tree_spec()
    assert fast.drafter.tree == spec
    if result.mode == "default":  # the default tree (layer_skip's: dynamic:16:4) held up better: it is stored
        assert result.tree == result.check["default"]
    else:
        assert (result.mode == "dynamic") == isinstance(spec, DynamicTreeSpec)
    for ids in prompts():
        assert torch.equal(fast.generate(ids, max_new_tokens=20, eos_token_id=2), hf_greedy(model, ids, 20))
    # a merge takes its first drafter's stored tree and options
    merged = speccomp.compile(model, drafter="layer_skip+ngram", tree="auto")
    assert merged.drafter.drafters[0].tree == spec and merged.drafter.drafters[0].options == result.drafter_options
    ids = prompts()[0]
    assert torch.equal(merged.generate(ids, max_new_tokens=20, eos_token_id=2), hf_greedy(model, ids, 20))
    with pytest.raises(AutotuneError, match="backend 'onnxruntime'"):
        speccomp.compile(model, drafter="layer_skip", tree="auto", backend="onnxruntime")
    with pytest.raises(AutotuneError, match=r"speccomp.autotune\(model, 'early_exit', prompts"):
        speccomp.compile(model, drafter="early_exit", tree="auto")
    other = tiny_llama(num_hidden_layers=6, initializer_range=0.21)  # another model: another fingerprint
    with pytest.raises(AutotuneError, match="no autotuned tree"):
        speccomp.compile(other, drafter="layer_skip", tree="auto")
    png = plot_report(result, cache / "report.png")
    assert png.stat().st_size > 10_000 and open(png, "rb").read(4) == b"\x89PNG"
    assert "chosen" in result.summary()
    # a damaged or hand-edited cache file is no result (these crashed tree="auto" or were trusted as they stood)
    good = json.loads(open(result.path).read())
    for edit in ([], "x", {"drafter_options": None}, {"drafter_options": [1]}, {"plain": "false"},
                 {"plain": True, "check": {"kept": "tuned"}}):
        open(result.path, "w").write(json.dumps({**good, **edit} if isinstance(edit, dict) else edit))
        assert load_result(model, "layer_skip") is None, edit
    open(result.path, "w").write(json.dumps(good))
    assert load_result(model, "layer_skip").tree == result.tree
    # a stored option the drafter refuses names the stored result as its source (the user passed tree="auto" only)
    open(result.path, "w").write(json.dumps({**good, "drafter_options": {"skip": [99]}}))
    with pytest.raises(speccomp.OptionError, match=r"skip=.*read by tree='auto' from the stored autotune result .*layer_skip-.*json, "
                                                   r"not given\).*delete that result"):
        speccomp.compile(model, drafter="layer_skip", tree="auto")
    with pytest.raises(speccomp.OptionError, match=r"skip=\[77\]: (?!.*stored autotune)"):  # the user's own: as it is
        speccomp.compile(model, drafter="layer_skip", tree="auto", drafter_options={"skip": [77]})
    # so does a stored tree too large for the model (its size check came before the stored source was known)
    open(result.path, "w").write(json.dumps({**good, "tree": [[i] for i in range(70)]}))
    with pytest.raises(speccomp.OptionError, match=r"tree=.*71 nodes.*read by tree='auto' from the stored autotune "
                                                   r"result .*layer_skip-.*json, not given"):
        speccomp.compile(model, drafter="layer_skip", tree="auto")
    open(result.path, "w").write(json.dumps(good))
    with pytest.raises(speccomp.OptionError, match=r"unknown layer_skip options \['bogus'\](?!.*stored autotune)"):
        speccomp.compile(model, drafter="layer_skip", tree="auto", drafter_options={"bogus": 1})
    open(result.path, "w").write("{not json")
    assert load_result(model, "layer_skip") is None


def fast_options(model) -> dict:
    return speccomp.compile(model, drafter="token_recycling").drafter.options


def test_autotune_token_recycling_static_tree(cache):
    from speccomp.runtime.budget import StepCosts
    from speccomp.tuning.step_curve import CURVE_PAST, CURVE_Q, load_curve

    model = tiny_llama(initializer_range=0.2)
    with pytest.raises(AutotuneError, match="static trees only"):
        speccomp.autotune(model, "token_recycling", prompts(), mode="dynamic", save=False)
    result = keep_drafting(speccomp.autotune(model, "token_recycling", prompts(), max_new_tokens=24, repeats=2,
                                             max_nodes=12, measure_sizes=[4]))
    # a static tree: the DP's or a hand-made one ("static"), or the drafter's own where it decoded fastest ("default":
    # on a tiny model the candidates' speeds differ by little, so which one wins is timing)
    assert result.mode in ("static", "default") and not result.dynamic
    assert result.drafter_options == {**fast_options(model), "ngram_branches": 0}  # pure Token Recycling, all options
    assert result.acceptance["probe_ranks"] == 8 and {r["n"] for r in result.measured} >= {4}
    assert all(0.0 <= f <= 1.0 for f in result.timing["presence"])
    fast = speccomp.compile(model, drafter="token_recycling", tree="auto")
    assert fast.drafter.tree == Tree.from_choices(result.tree) and fast.drafter.ngram_branches == 0
    # the batch budget's step-cost curve over batch size x tree size, stored beside the tree and planned with by
    # every later compile of this model on this backend (its grid not measured again), by no other backend's
    curve = load_curve(model, "eager")
    assert result.step_curve and (CURVE_Q, CURVE_PAST) in curve and (1, StepCosts.PAST0) in curve
    assert fast.step_costs().measured == curve and load_curve(model, "onnxruntime") is None
    for ids in prompts():
        assert torch.equal(fast.generate(ids, max_new_tokens=20, eos_token_id=2), hf_greedy(model, ids, 20))
    with pytest.warns(UserWarning, match="tuned with drafter_options"):
        tree, options, plain = resolve_auto(model, "token_recycling", "eager", {"ngram_branches": 1})
    # the user's options win, and then the tree drafts (a "plain" verdict was measured with other options)
    assert tree == result.tree and options == {**result.drafter_options, "ngram_branches": 1} and not plain


def test_a_capture_tunes_under_its_model_and_a_stored_file_is_named_where_it_was_read_or_ignored(cache):
    """autotune on speccomp.capture(model) (which compile takes) is keyed by the model: it crashed after all its
    decoding. A limit the drafter cannot reach is said; the file a result names is the one read (a copied cache's
    field names its old place); a damaged file is ignored out loud, naming it (it read as "no autotuned tree")."""
    from speccomp.tuning.step_curve import machine_key

    model = tiny_llama(initializer_range=0.2)
    cap = speccomp.capture(model)
    assert machine_key(cap, "eager") == machine_key(model, "eager")
    with pytest.warns(UserWarning, match=r"ranks=30 -> \d"):
        speccomp.autotune(cap, "token_recycling", prompts()[:2], max_new_tokens=8, repeats=1, max_nodes=4, ranks=30,
                          check_prompts=[])
    path = result_path(model, "token_recycling", "eager")
    assert path.exists() and load_result(model, "token_recycling").path == str(path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "path": "/elsewhere/token_recycling.json"}))
    assert load_result(model, "token_recycling").path == str(path)
    path.write_text(json.dumps({**data, "tree": 10 ** 6, "plain": False}))  # edited by hand: its read built 931 GiB
    assert load_result(model, "token_recycling").tree == 10 ** 6  # read, not built: compile refuses it by name
    with pytest.raises(speccomp.OptionError, match=r"tree=1000000: .*read by tree='auto' from the stored autotune"):
        speccomp.compile(cap, drafter="token_recycling", tree="auto")
    path.write_text(path.read_text()[:200])  # cut short (a full disk, a killed copy)
    with pytest.warns(UserWarning, match=f"ignoring the stored autotune result {re.escape(str(path))}"):
        with pytest.raises(AutotuneError, match="no autotuned tree"):  # the model has no tokenizer to tune on here
            speccomp.compile(cap, drafter="token_recycling", tree="auto")
    path.unlink()
    path.mkdir()  # unreadable (a directory in its place, a file without read permission): a traceback before
    with pytest.warns(UserWarning, match=f"ignoring the stored autotune result {re.escape(str(path))} \\(IsADir"):
        assert load_result(model, "token_recycling") is None


def test_untunable_drafters_and_bad_settings_are_refused(cache):
    model = tiny_llama()
    with pytest.raises(AutotuneError, match="takes no tree"):
        speccomp.autotune(model, "ngram", prompts())
    with pytest.raises(OptionError, match="tree='auto': the ngram drafter builds its tree .* drop tree="):
        speccomp.compile(model, drafter="ngram", tree="auto")  # refused by check_options, before the capture
    with pytest.raises(AutotuneError, match="unknown drafter"):
        speccomp.autotune(model, "nope", prompts())
    with pytest.raises(AutotuneError, match="autotune its first drafter"):
        speccomp.autotune(model, "layer_skip+ngram", prompts())
    with pytest.raises(AutotuneError, match="max_nodes"):
        speccomp.autotune(model, "layer_skip", prompts(), max_nodes=1)
    with pytest.raises(AutotuneError, match="calibration prompt"):
        speccomp.autotune(model, "layer_skip", [])
    with pytest.raises(AutotuneError, match="named drafter"):
        speccomp.compile(model, drafter=Oracle([], Tree.chain(1)), tree="auto")
    with pytest.raises(ValueError, match="give a drafter"):
        speccomp.compile(model, tree="auto")
    assert not result_path(model, "layer_skip", "eager").exists()


def test_cli_parses_autotune():
    from speccomp.cli import build_parser, cmd_autotune

    args = build_parser().parse_args(["autotune", "--drafter", "layer_skip", "--max-nodes", "32", "--report", "r.png"])
    assert args.func is cmd_autotune and args.max_nodes == 32 and args.report == "r.png" and args.mode == "auto"


def test_level_by_level_drafters_pay_per_draft_depth():
    """A drafter with its own forward per depth (EAGLE) costs the probe's propose time scaled by depth."""
    from speccomp.tuning.autotune import draft_seconds

    timing = {"widths": [], "propose_s": 0.06, "propose_per_level_s": 0.01}
    assert draft_seconds(timing, [[0], [1], [0, 0]]) == pytest.approx(0.02)
    assert draft_seconds(timing, [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]) == pytest.approx(0.04)
    del timing["propose_per_level_s"]  # others (Medusa: one matmul for every depth) pay the probe's time
    assert draft_seconds(timing, [[0]]) == pytest.approx(0.06)


def char_tokenizer():
    """A character-level fast tokenizer of the tiny models' 96 ids (printable ASCII), with no chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(c): c - 31 for c in range(32, 127)}}  # ids 1..95
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<unk>")


def test_tree_auto_tunes_on_first_use_and_keeps_what_held_back_prompts_prefer(cache, tmp_path, capsys):
    """compile(tree="auto") with nothing stored tunes on the shipped prompts in the model's own tokenizer (found beside
    its weights), holding back a third of them: the stored tree is the tuned one only if it decoded those faster than
    the drafter's default tree; then compile uses it, and the output is HF greedy's."""
    from transformers import AutoModelForCausalLM

    tiny_llama(num_hidden_layers=4, initializer_range=0.2, max_position_embeddings=1024).save_pretrained(tmp_path / "m")
    char_tokenizer().save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert load_result(model, "token_recycling") is None
    with pytest.raises(AutotuneError, match="check_prompts must be token id tensors"):
        speccomp.autotune(model, "token_recycling", [torch.tensor([[5, 6, 7]])], check_prompts=["hello"])
    for bad, words in ((dict(prompts=[[5, 6, 7]]), "prompts must be a list of token id tensors"),
                       (dict(dynamic_budgets=4), "dynamic_budgets must be a list of ints"),
                       (dict(measure_sizes=["x"]), "measure_sizes must be a list of ints"),
                       (dict(drafter_options=[1]), "drafter_options must be a dict")):  # each a raw error before
        with pytest.raises(AutotuneError, match=words):
            speccomp.autotune(model, "token_recycling", bad.pop("prompts", [torch.tensor([[5, 6, 7]])]), **bad)
    fast = speccomp.compile(model, drafter="token_recycling", tree="auto")
    assert "tuning it now on 8 shipped prompts" in capsys.readouterr().err
    stored = load_result(model, "token_recycling")
    c = stored.check
    default = [list(x) for x in Tree.from_choices(DEFAULT_RECYCLING_TREE).choices]
    assert "default" in {r["label"] for r in stored.measured}  # the default competes on the calibration prompts
    # the finalists (the calibration's fastest) decode both sets of prompts side by side; the fastest over both wins,
    # and is stored only if it also beats the default on the held-back ones
    assert c["prompts"] == 2 and c["calibration_prompts"] == 6 and c["default"] == default and 1 <= len(c["finalists"]) <= 5
    best = max(r["measured_tokens_per_s"] for r in stored.measured)
    assert all(f["calibration_tokens_per_s"] >= 0.8 * best for f in c["finalists"])
    assert c["tuned"] == max(c["finalists"], key=lambda f: f["combined_tokens_per_s"])["tree"]
    beats = c["tuned"] != default and c["tuned_tokens_per_s"] > c["default_tokens_per_s"]
    assert c["kept"] == ("tuned" if beats else "default") and (stored.mode == "default") == (not beats)
    assert stored.tree == (c["tuned"] if beats else default) and "held-back check" in stored.summary()
    # plain decoding where it beat the kept tree on the held-back prompts (test_tree_auto_compiles_plain_decoding_...)
    assert fast.drafter is None if stored.plain else fast.drafter.tree == stored.tree_spec()
    ids = torch.tensor([[ord(ch) - 31 for ch in "The quick brown fox jumps over the lazy dog. The quick brown"]])
    assert torch.equal(fast.generate(ids, max_new_tokens=30, eos_token_id=2), hf_greedy(model, ids, 30))


def test_tree_auto_on_first_use_tunes_only_on_prompts_that_fit_the_model(cache, tmp_path):
    """A model whose context holds none of the shipped prompts plus 128 new tokens: compile(tree="auto") says so
    (it raised max_new_tokens=128, an argument the user never passed)."""
    from transformers import AutoModelForCausalLM

    from speccomp.tuning.autotune import FIRST_USE_NEW_TOKENS, _context_length, first_use_prompts

    tiny_llama(max_position_embeddings=160).save_pretrained(tmp_path / "m")
    char_tokenizer().save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert _context_length(model) == _context_length(speccomp.capture(model)) == 160
    assert min(p.shape[-1] for p in first_use_prompts(model)[0]) + FIRST_USE_NEW_TOKENS > 160
    with pytest.raises(AutotuneError, match="none of the shipped prompts leaves room for 128 new tokens in the "
                                            "model's context of 160 positions"):
        speccomp.compile(model, drafter="token_recycling", tree="auto")
    # a draft LM's shorter context bounds the text too: first-use tuning failed inside generate, naming max_new_tokens
    long = tiny_llama(max_position_embeddings=1024)
    long.save_pretrained(tmp_path / "long")
    char_tokenizer().save_pretrained(tmp_path / "long")
    long = AutoModelForCausalLM.from_pretrained(tmp_path / "long").eval()
    with pytest.raises(AutotuneError, match="leaves room for 128 new tokens in the draft model's context of 160 "):
        speccomp.compile(long, drafter=model, tree="auto")


def test_plain_is_kept_only_where_it_beats_the_kept_tree_on_the_held_back_prompts():
    from speccomp.tuning.autotune import _kept

    row = lambda tree, rate: {"tree": tree, "mode": "static", "predicted_tokens_per_s": 1.0,  # noqa: E731
                              "measured_tokens_per_s": rate}
    measured = [row([[0]], 50.0), row([[1]], 48.0)]
    check = {"kept": "tuned", "tuned": [[0]], "default": [[1]], "tuned_tokens_per_s": 40.0,
             "default_tokens_per_s": 30.0, "plain_tokens_per_s": 45.0}
    kept = _kept(measured[0], check, measured, 49.0)  # held back: plain 45 > the tree's 40 (calibration: 49 < 50)
    assert kept["plain"] and kept["tree"] == [[0]] and kept["measured_tokens_per_s"] == 50.0  # the tree's numbers
    # the calibration speeds are the fastest of many trees' (optimistic): the held-back prompts decide
    assert not _kept(measured[0], {**check, "plain_tokens_per_s": 39.0}, measured, 60.0)["plain"]
    assert not _kept(measured[0], {**check, "plain_tokens_per_s": float("nan")}, measured, 60.0)["plain"]  # no speed
    assert _kept(measured[0], {}, measured, 51.0)["plain"]  # nothing held back: the calibration decides
    assert not _kept(measured[0], {}, measured, 49.0)["plain"]
    default = _kept(measured[0], {**check, "kept": "default"}, measured, 20.0)  # the default tree was kept: 30 < 45
    assert default["plain"] and default["mode"] == "default" and default["tree"] == [[1]]


def test_tree_auto_compiles_plain_decoding_where_no_tree_paid(cache):
    """An autotune result says whether plain decoding beat its tree on the held-back prompts (timing on a tiny model
    decides which way: the verdict must follow the numbers it stored). Where it did, compile(tree="auto") warns,
    naming the stored file, and compiles plain decoding (exact, one token per step); a merge, or options other than
    the tuned ones, still draft with the stored tree."""
    import dataclasses

    model = tiny_llama(initializer_range=0.2)
    result = speccomp.autotune(model, "token_recycling", prompts(), max_new_tokens=16, repeats=1, max_nodes=8,
                               check_prompts=prompts())
    c = result.check
    assert result.plain == (c["plain_tokens_per_s"] > c[f"{c['kept']}_tokens_per_s"]) and "decoding without drafts" in result.summary()
    # the default tree (25 nodes) is above max_nodes=8: the held-back check's baseline, never what is stored
    assert c["kept"] == "tuned" and result.mode != "default" and len(result.tree) + 1 <= 8
    stored = dataclasses.replace(result, plain=True)  # the verdict where no tree paid
    open(result.path, "w").write(json.dumps(stored.to_dict(), default=float))
    with pytest.warns(UserWarning, match=r"faster than the tree it kept for token_recycling .*" + re.escape(str(cache))):
        fast = speccomp.compile(model, drafter="token_recycling", tree="auto")
    assert fast.drafter is None and "compiles plain decoding" in load_result(model, "token_recycling").summary()
    ids = prompts()[0]
    assert torch.equal(fast.generate(ids, max_new_tokens=20, eos_token_id=2), hf_greedy(model, ids, 20))
    assert fast.last_stats["steps"] == fast.last_stats["new_tokens"]  # one token per forward
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a merge was never measured as a whole: it drafts, silently
        merged = speccomp.compile(model, drafter="token_recycling+ngram", tree="auto")
    assert merged.drafter.drafters[0].tree == Tree.from_choices(result.tree)
    with pytest.warns(UserWarning, match="tuned with drafter_options"):
        other = speccomp.compile(model, drafter="token_recycling", tree="auto", drafter_options={"ngram_branches": 1})
    assert other.drafter.tree == Tree.from_choices(result.tree)


def test_final_round_times_finalists_side_by_side_on_both_prompt_sets_and_keeps_the_default_unless_it_loses():
    """The calibration's fastest (within 20%: its one-after-the-other timings can be that far off), the default and
    plain decoding decode every calibration and held-back prompt in a final round, prompt by prompt with the order
    rotating; the fastest over both sets wins and is kept only where it beats the default on the held-back ones."""
    from speccomp.runtime.decode import RootOnly
    from speccomp.tuning.autotune import _final_choice, _finalists, _rate, _side_by_side

    model = tiny_llama(initializer_range=0.2)
    sm = speccomp.compile(model, drafter="token_recycling")
    default = [list(x) for x in sm.drafter.tree.choices]
    row = lambda tree, rate: {"tree": tree, "label": str(tree), "mode": "static", "predicted_tokens_per_s": 1.0,  # noqa: E731
                              "measured_tokens_per_s": rate, "decode_tokens": 10 * rate, "decode_seconds": 10.0}
    rows = [row([[0]], 50.0), row([[0], [0, 0]], 41.0), row([[0], [1]], 39.0), row(default, 45.0)]
    assert [r["tree"] for r in _finalists(rows)] == [[[0]], default, [[0], [0, 0]]]  # within 20% of the fastest
    more = [row([[i]], 50.0 - i) for i in range(7)]
    assert [r["tree"] for r in _finalists(more)] == [[[i]] for i in range(5)]  # at most 5
    g = torch.Generator().manual_seed(1)
    held = [torch.randint(3, 96, (1, 12), generator=g) for _ in range(2)]
    winner, c = _final_choice(sm, _finalists(rows), prompts(), held, 16, 2, None)
    assert c["prompts"] == 2 and c["calibration_prompts"] == 2 and c["default"] == default and len(c["finalists"]) == 3
    both = {json.dumps(f["tree"]): f["combined_tokens_per_s"] for f in c["finalists"]}
    assert both[json.dumps(winner["tree"])] == max(both.values()) and c["tuned"] == winner["tree"]
    held_rates = {json.dumps(f["tree"]): f["held_back_tokens_per_s"] for f in c["finalists"]}
    assert c["default_tokens_per_s"] == held_rates[json.dumps(default)]
    assert [f["calibration_tokens_per_s"] for f in c["finalists"]] == [50.0, 45.0, 41.0]
    beats = winner["tree"] != default and c["tuned_tokens_per_s"] > c["default_tokens_per_s"]
    assert c["kept"] == ("tuned" if beats else "default")
    assert _final_choice(sm, _finalists(rows), prompts(), [], 16, 2, None) == (rows[0], {})  # nothing held back

    class Logged:  # a compiled model whose decodes are logged in order (with `wrong`, its output is broken)
        def __init__(self, name, inner, log, wrong=False):
            self.name, self.inner, self.log, self.wrong = name, inner, log, wrong

        def generate(self, ids, **kw):
            out = self.inner.generate(ids, **kw)
            self.last_stats = self.inner.last_stats
            self.log.append(self.name)
            return torch.cat([out[:, :-1], (out[:, -1:] + 1) % 96], 1) if self.wrong else out

    log = []
    runs = {n: Logged(n, sm if n == "tree" else sm.with_drafter(RootOnly()), log) for n in ("plain", "tree", "other")}
    stats = _side_by_side(runs, prompts() + held, 16, 2, "token_recycling", None)
    assert log[3:] == ["plain", "tree", "other", "tree", "other", "plain",  # after one warm-up each, the order rotates
                       "other", "plain", "tree", "plain", "tree", "other"]
    assert [len(v) for v in stats.values()] == [4, 4, 4] and _rate(stats["tree"]) > 0
    runs["other"].wrong = True
    with pytest.raises(RuntimeError, match="tree other changed the greedy output"):
        _side_by_side(runs, prompts(), 16, 2, "token_recycling", None)
    runs["other"].wrong = False
    refs = [runs["plain"].generate(p, max_new_tokens=16, eos_token_id=2) for p in prompts()]
    _side_by_side(runs, prompts(), 16, 2, "token_recycling", None, refs=refs)  # given references are what counts
    with pytest.raises(RuntimeError, match="tree plain changed the greedy output"):
        _side_by_side(runs, prompts(), 16, 2, "token_recycling", None, refs=[r + 1 for r in refs])


def test_the_autotune_benchmark_times_its_rows_as_the_final_round():
    """benchmarks/autotune.py's rows go through the final round's `_side_by_side` (one copy of the rotation): its
    table adds up the runs' stats, one per-prompt entry each, and an output unlike HF's reference raises."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "autotune.py"
    spec = importlib.util.spec_from_file_location("autotune_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from speccomp.runtime.decode import RootOnly

    model = tiny_llama(initializer_range=0.2)
    sm = speccomp.compile(model, drafter="token_recycling")
    rows = {"plain": sm.with_drafter(RootOnly()), "tree": sm}
    cases = [("a", p) for p in prompts()]
    refs = [model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=16, do_sample=False, eos_token_id=2,
                           pad_token_id=2) for _, p in cases]
    table = bench._time_rows(rows, cases, refs, 16, 2, "token_recycling")
    assert set(table) == {"plain", "tree"} and all(len(r["per_prompt"]) == len(cases) for r in table.values())
    assert table["tree"]["tau"] > table["plain"]["tau"] == 1.0  # drafts were accepted; plain makes one a step
    assert all(r["decode_tokens_per_s"] > 0 and r["identical"] for r in table.values())
    with pytest.raises(RuntimeError, match="changed the greedy output"):
        bench._time_rows(rows, cases, [r[:, :-1] for r in refs], 16, 2, "token_recycling")


def test_a_quantized_result_stored_before_8_bit_weights_keeps_its_4_bits(cache):
    """A tree tuned for the quantized drafter before its default became 8-bit weights was tuned on 4-bit ones: its
    stored options lack `bits`, and tree="auto" compiles it with bits=4 (its own), not the new default under an old
    tree; a result that names its bits keeps them."""
    from speccomp.tuning.autotune import AutotuneResult, cache_key, result_path
    from speccomp.models import write_atomically

    model = tiny_llama()
    path = result_path(model, "quantized", "onnxruntime")
    for stored, bits in (({"block_size": 32}, 4), ({"bits": 8, "block_size": 32}, 8)):
        result = AutotuneResult("quantized", "onnxruntime", cache_key(model, "quantized", "onnxruntime"), stored,
                                "static", [[0], [0, 0]], 10.0, 10.0, 64, {}, {})
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(result.to_dict()))
        assert load_result(model, "quantized", "onnxruntime").drafter_options == {"block_size": 32, "bits": bits}
        fast = speccomp.compile(model, drafter="quantized", tree="auto", backend="onnxruntime")
        assert fast.drafter.options == {"bits": bits, "block_size": 32} and fast.drafter.tree.choices == [[0], [0, 0]]


def test_limits_given_bound_every_tree_and_what_is_left_out_is_said(cache):
    """max_depth / ranks bound the hand-made shapes and the default tree as they bound the DP's (the CLI: "measured and
    considered"; the default, depth 6 and 5 ranks, was stored under max_depth=1); budgets and sizes the caller gave
    above max_nodes are named, not dropped quietly; a dynamic top-k the drafter cannot score is refused before any
    measuring (it failed after the probe, naming a tree= the caller never gave)."""
    from speccomp.drafters.hydra import new_hydra, save_hydra

    model = tiny_llama(initializer_range=0.2)
    result = speccomp.autotune(model, "token_recycling", prompts(), max_new_tokens=12, repeats=1, max_depth=1,
                               ranks=1, check_prompts=[], save=False)
    assert not {r["label"] for r in result.measured} & {"chain 2", "chain 4", "binary 8", "default"}
    assert result.tree == [[0]]  # the one tree of depth 1 and rank 1
    with pytest.warns(UserWarning, match=r"leaving out measure_sizes \[16\] \(above 4\)"):
        speccomp.autotune(model, "token_recycling", prompts()[:1], max_new_tokens=8, repeats=1, max_nodes=4,
                          measure_sizes=[3, 16], check_prompts=[], save=False)
    with pytest.warns(UserWarning, match=r"leaving out dynamic_budgets \[32\] \(above 3\)"):
        speccomp.autotune(model, "layer_skip", prompts()[:1], max_new_tokens=8, repeats=1, max_nodes=4,
                          mode="dynamic", dynamic_budgets=(2, 32), check_prompts=[], save=False)
    save_hydra(new_hydra(model, torch.arange(96), 2).eval(), cache / "h")
    top = speccomp.compile(model, drafter="hydra", drafter_options={"heads": str(cache / "h")}).drafter.max_siblings
    with pytest.raises(AutotuneError, match=f"dynamic_top_k={top + 2}: the hydra drafter scores at most {top}"):
        speccomp.autotune(model, "hydra", prompts(), drafter_options={"heads": str(cache / "h")}, mode="dynamic",
                          dynamic_top_k=top + 2)


def test_a_result_that_cannot_be_stored_is_used_and_said(tmp_path, monkeypatch):
    """A cache folder that cannot be written (here: a path through a file) lost the whole tuning run to a raw
    NotADirectoryError after all its decoding, and tree='auto' tuned again on every compile: now a warning naming
    the folder, and the result is returned (path None)."""
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("SPECCOMP_CACHE", str(tmp_path / "a_file" / "cache"))
    model = tiny_llama(initializer_range=0.2)
    with pytest.warns(UserWarning, match="could not store the result in .*a_file.*SPECCOMP_CACHE"):
        result = speccomp.autotune(model, "token_recycling", prompts()[:1], max_new_tokens=8, repeats=1, max_nodes=4,
                                   check_prompts=[])
    assert result.path is None and result.tree


def test_options_read_from_a_stored_file_name_it(cache):
    """An option a stored file supplied (an older version's option in an autotune result, a search's layers read by
    autotune) is reported with the file it came from, not as the caller's drafter_options."""
    from speccomp.models import write_atomically
    from speccomp.tuning.autotune import AutotuneResult, cache_key
    from speccomp.tuning.search import search_path

    model = tiny_llama(num_hidden_layers=4)
    path = result_path(model, "layer_skip", "eager")
    result = AutotuneResult("layer_skip", "eager", cache_key(model, "layer_skip", "eager"), {"old_option": 3},
                            "static", [[0], [0, 0]], 10.0, 10.0, 64, {}, {})
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(result.to_dict()))
    with pytest.raises(OptionError, match=f"old_option.*read by tree='auto' from the stored autotune result "
                                          f"{re.escape(str(path))}"):
        speccomp.compile(model, drafter="layer_skip", tree="auto")
    stored = search_path(model, "layer_skip", None)
    stored.parent.mkdir(parents=True, exist_ok=True)
    stored.write_text(json.dumps({"kind": "layer_skip", "best": {"skip": [9]}, "rows": []}))
    with pytest.raises(OptionError, match=f"read from the stored search {re.escape(str(stored))}"):
        speccomp.autotune(model, "layer_skip", prompts(), save=False)


def test_a_tree_tuned_for_heads_is_not_used_for_heads_trained_again(cache):
    """The stored result names the heads it was tuned with (a digest of their folder): heads trained again into the
    same folder (train-heads' own advice) made tree='auto' reuse the old tree quietly, or refuse it as too deep."""
    from speccomp.drafters.head_drafters import heads_dir
    from speccomp.drafters.medusa import new_heads, save_medusa
    from speccomp.tuning.autotune import trained_digest

    model = tiny_llama(initializer_range=0.2)
    save_medusa(new_heads(model, 3).eval(), heads_dir(model))
    result = speccomp.autotune(model, "medusa", prompts()[:1], max_new_tokens=8, repeats=1, max_nodes=4,
                               check_prompts=[])
    assert result.trained == trained_digest(model, "medusa", {}) is not None
    with warnings.catch_warnings(record=True) as said:  # the same heads: the stored tree (or its plain verdict)
        warnings.simplefilter("always")
        speccomp.compile(model, drafter="medusa", tree="auto")
    assert not [w for w in said if "other heads" in str(w.message)]
    torch.manual_seed(2)
    save_medusa(new_heads(model, 3).eval(), cache / "elsewhere")  # other heads named on purpose: the stored tree, said
    with pytest.warns(UserWarning, match=r"tuned with drafter_options=\{\}, not \{'heads': "):
        elsewhere = speccomp.compile(model, drafter="medusa", tree="auto", drafter_options={"heads": str(cache / "elsewhere")})
    assert elsewhere.drafter.tree == Tree.from_choices(result.tree)
    torch.manual_seed(1)
    save_medusa(new_heads(model, 2).eval(), heads_dir(model))  # trained again, into the same folder
    with pytest.warns(UserWarning, match="tuned with other heads than those found now"):
        with pytest.raises(AutotuneError, match="no autotuned tree"):  # no tokenizer here to tune again with
            speccomp.compile(model, drafter="medusa", tree="auto")


def test_results_measured_on_a_gpu_are_keyed_by_its_name(monkeypatch, tmp_path):
    """Hosts sharing a home folder and a CPU model but not a GPU read each other's trees and step-cost curves: a CUDA
    model's key and a GPU engine's name the GPU (the engine from the driver's list: no torch there)."""
    from speccomp.tuning import step_curve
    from speccomp.tuning.step_curve import engine_key, machine_key

    info = tmp_path / "gpus" / "0000:01:00.0" / "information"
    info.parent.mkdir(parents=True)
    info.write_text("Model: \t\t NVIDIA H200\nIRQ:   51\n")
    real_path = step_curve.Path
    monkeypatch.setattr(step_curve, "Path", lambda p: real_path(str(p).replace("/proc/driver/nvidia", str(tmp_path))))
    assert engine_key("sha", ["CUDAExecutionProvider", "CPUExecutionProvider"], None, True)["gpu"] == ["NVIDIA H200"]
    assert "gpu" not in engine_key("sha", ["CPUExecutionProvider"], None, True)
    assert "gpu" not in machine_key(tiny_llama(), "eager")  # a CPU model's key as before (stored results stay valid)
    if torch.cuda.is_available():
        assert machine_key(tiny_llama().cuda(), "eager")["gpu"] == torch.cuda.get_device_name(0)
