"""Batched generate (speccomp/runtime/batch.py): every row of a left-padded batch is its own greedy decoding (its own
distribution when sampling), for every drafter that batches, with rows that accept different numbers of tokens, stop
at different steps and join a running batch; what cannot batch is refused by name."""
import numpy as np
import pytest
import torch

import speccomp
from speccomp.errors import OptionError
from speccomp.runtime.calls import left_pad, row_slots
from speccomp.runtime.batch import Batch
from speccomp.runtime.decode import Draft, Drafter, RootOnly, Sequence
from speccomp.runtime.sampling import Sampler
from speccomp.runtime.tree import Tree
from test_speculative import hf_greedy, repetitive_prompt
from tiny_models import tiny_llama

NEW = 32
LENGTHS = (24, 5, 17, 30, 9, 12, 21, 3)  # prompts of different lengths, some repetitive (drafts accepted), some not


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(num_hidden_layers=4, initializer_range=0.2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def captured(llama):
    return speccomp.capture(llama)


@pytest.fixture(scope="module")
def prompts():
    rows = []
    for i, n in enumerate(LENGTHS):
        if i % 2 == 0:
            rows.append(repetitive_prompt(96, i, n)[0])
        else:
            rows.append(torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(i)))
    return rows


@pytest.fixture(scope="module")
def greedy(llama, prompts):
    """Each prompt's own HF greedy continuation (no batch, no padding)."""
    return [hf_greedy(llama, p[None], NEW)[0, len(p):] for p in prompts]


def left_padded(rows, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = left_pad(rows, pad)  # speccomp/runtime/calls.py
    return torch.from_numpy(ids), torch.from_numpy(mask)


def check_rows(fast, prompts, greedy, b: int, **options):
    ids, mask = left_padded(prompts[:b])
    out = fast.generate(ids, max_new_tokens=NEW, attention_mask=mask, **options)
    assert out.shape == (b, ids.shape[1] + NEW) and torch.equal(out[:, : ids.shape[1]], ids)
    for i in range(b):
        assert torch.equal(out[i, ids.shape[1]:], greedy[i]), f"row {i} (prompt of {len(prompts[i])} tokens)"
    return fast.last_stats


@pytest.mark.parametrize("b", [1, 2, 4, 8])
def test_rows_equal_their_own_greedy(captured, prompts, greedy, b):
    fast = speccomp.compile(captured, drafter="token_recycling")
    check_rows(fast, prompts, greedy, b)  # load-aware caps (timing-dependent: equality only)
    stats = check_rows(fast, prompts, greedy, b, load_aware=False)  # every row its whole tree
    if b == 1:
        assert "rows" not in stats  # one sequence: the one-sequence loop
        return
    rows = stats["rows"]
    assert stats["batch"] == b and [r["new_tokens"] for r in rows] == [NEW] * b
    # drafts were accepted, in different numbers per row (ragged acceptance), in fewer forwards than tokens
    assert max(r["tau"] for r in rows) > 1.3 and len({r["steps"] for r in rows}) > 1
    assert stats["forwards"] == max(r["steps"] for r in rows) < NEW


def test_a_padded_batch_of_one_and_a_half_precision_mask_decode_as_hf(captured, prompts, greedy, tmp_path):
    """[1, n] left-padded (a tokenizer pads a list of one prompt too) was refused as padding for a single sequence,
    where HF decodes it and returns the padding in front; a bfloat16 mask was numpy's TypeError. Both runtimes."""
    fast = speccomp.compile(captured, drafter="token_recycling", backend="onnxruntime")
    engine = speccomp.load(fast.export(tmp_path / "e"))
    ids, mask = left_padded(prompts[:2])
    short = int(mask.sum(1).argmin())  # the padded row
    one, one_mask = ids[short:short + 1], mask[short:short + 1]
    assert not one_mask.all()
    want = torch.cat([one[0], greedy[short]])[None]
    assert torch.equal(fast.generate(one, max_new_tokens=NEW, attention_mask=one_mask.to(torch.bfloat16)), want)
    assert engine.generate(one.numpy(), max_new_tokens=NEW, attention_mask=one_mask.numpy()).tolist() == want.tolist()
    out = fast.generate(ids, max_new_tokens=NEW, attention_mask=mask.to(torch.bfloat16))
    assert all(torch.equal(out[i, ids.shape[1]:], greedy[i]) for i in range(2))
    with pytest.raises(speccomp.OptionTypeError, match="^input_ids=.*must hold integer token ids"):
        fast.generate(ids.to(torch.bfloat16), max_new_tokens=NEW, attention_mask=mask)  # was numpy's TypeError


@pytest.fixture(scope="module")
def heads(llama, tmp_path_factory):
    from speccomp.drafters.eagle import save_eagle
    from speccomp.drafters.hydra import save_hydra
    from speccomp.drafters.medusa import new_heads, save_medusa
    from test_eagle import random_eagle
    from test_medusa import random_hydra

    root = tmp_path_factory.mktemp("batch_heads")
    save_medusa(new_heads(llama, 2), root / "medusa")
    save_hydra(random_hydra(llama, 2, vocab=torch.arange(3, 80)), root / "hydra")
    save_eagle(random_eagle(llama, vocab=torch.arange(3, 80)), root / "eagle")
    return {k: str(root / k) for k in ("medusa", "hydra", "eagle")}


CASES = {
    "plain": lambda h, m: dict(),
    "ngram": lambda h, m: dict(drafter="ngram"),
    "suffix": lambda h, m: dict(drafter="suffix"),
    "medusa": lambda h, m: dict(drafter="medusa", drafter_options={"heads": h["medusa"]}, tree=[[0], [1], [0, 0]]),
    "hydra": lambda h, m: dict(drafter="hydra", drafter_options={"heads": h["hydra"]}, tree="dynamic:6:2"),
    "eagle": lambda h, m: dict(drafter="eagle", drafter_options={"heads": h["eagle"]}),
    "hydra+token_recycling": lambda h, m: dict(drafter="hydra+token_recycling",
                                               drafter_options={"hydra": {"heads": h["hydra"]}}),
    # the target as its own draft model: every draft accepted, each row's draft cache its own
    "draft_model": lambda h, m: dict(drafter=m, tree=3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_batching_drafter_keeps_each_rows_greedy_text(captured, llama, prompts, greedy, heads, case):
    fast = speccomp.compile(captured, **CASES[case](heads, llama), backend="onnxruntime" if case == "ngram" else "eager")
    rows = check_rows(fast, prompts, greedy, 4, load_aware=False)["rows"]
    if case == "draft_model":
        assert all(r["tau"] > 3 for r in rows)  # chains of 3, all accepted (the last step may be shorter)
    elif case in ("ngram", "suffix", "hydra+token_recycling"):
        assert max(r["tau"] for r in rows) > 1.1


class RepeatLast(Drafter):
    """A user's drafter that shapes its own trees (as examples/custom_pass_and_drafter.py's): the root twice."""
    name, reads, trees = "repeat_last", (), ()

    def propose(self, ctx) -> Draft:
        return Draft(Tree.chain(1), torch.tensor([ctx.tokens[-1]] * 2))


def test_a_custom_drafter_batches_once_it_says_how_to_copy_itself(captured, prompts, greedy):
    """Without fresh() a batch is refused naming fresh() and the batch (a TypeError about copying before)."""
    fast = speccomp.compile(captured, drafter=RepeatLast())
    with pytest.raises(OptionError, match=r"drafter='repeat_last': has no fresh\(\): a batch gives each row"):
        check_rows(fast, prompts, greedy, 2)
    fresh = type("Fresh", (RepeatLast,), {"fresh": lambda self: type(self)()})
    assert check_rows(speccomp.compile(captured, drafter=fresh()), prompts, greedy, 2)["batch"] == 2


def test_rows_stop_at_their_own_eos_and_are_padded(captured, llama, prompts, tmp_path, monkeypatch):
    fast = speccomp.compile(captured, drafter="token_recycling")
    plain = hf_greedy(llama, prompts[0][None], NEW)[0, len(prompts[0]):]
    eos = int(plain[5])  # row 0 stops at its 6th token; others stop where they meet it, or run to NEW
    ids, mask = left_padded(prompts[:4])
    out = fast.generate(ids, max_new_tokens=NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=1)
    lengths = []
    for i in range(4):
        want = hf_greedy(llama, prompts[i][None], NEW, eos=eos)[0, len(prompts[i]):]
        stop = (want == eos).nonzero()
        n = int(stop[0]) + 1 if len(stop) else NEW
        lengths.append(n)
        assert torch.equal(out[i, ids.shape[1]: ids.shape[1] + n], want[:n])
        assert (out[i, ids.shape[1] + n:] == 1).all()  # padded after its eos
    assert lengths[0] == 6 and out.shape[1] == ids.shape[1] + max(lengths)
    assert [r["new_tokens"] for r in fast.last_stats["rows"]] == lengths
    # several eos ids and no pad_token_id: padded with the first given, as HF's generate pads (eos_token_id[0])
    other = min(set(range(eos)) - set(out.flatten().tolist()))  # an id below eos that no row emits
    again = fast.generate(ids, max_new_tokens=NEW, attention_mask=mask, eos_token_id=[eos, other])
    for i, n in enumerate(lengths):
        start = ids.shape[1] + n
        assert torch.equal(again[i, :start], out[i, :start]) and (again[i, start:] == eos).all()
    # ... unless the model's generation_config names a pad id: HF pads with that (speccomp padded with eos), and so
    # does an engine exported from it (its manifest records the id)
    monkeypatch.setattr(llama.generation_config, "pad_token_id", 1)
    engine = speccomp.load(fast.export(tmp_path / "engine"))
    assert engine.manifest["model"]["pad_token_id"] == 1
    for padded in (fast.generate(ids, max_new_tokens=NEW, attention_mask=mask, eos_token_id=[eos, other]),
                   torch.from_numpy(engine.generate(ids, max_new_tokens=NEW, attention_mask=mask,
                                                    eos_token_id=[eos, other]))):
        assert torch.equal(padded, out)
    # that pad id in front of a row without attention_mask: HF's generate reads it as padding, speccomp read the
    # tokens as text (another continuation, silently): refused, by both runtimes, for one row and a batch
    unmasked = ids.clone()
    unmasked[ids == 0] = 1  # left_padded's padding, as the model's pad id
    for generate in (fast.generate, engine.generate):
        for rows in (unmasked, unmasked[mask[:, 0] == 0][:1]):
            with pytest.raises(OptionError, match="attention_mask=None: is missing and input_ids starts with the pad "
                                                  "id 1: HF's generate reads that as left padding"):
                generate(rows, max_new_tokens=4, eos_token_id=eos)
        assert generate(unmasked[mask[:, 0] == 1][:1], max_new_tokens=2).shape[0] == 1  # one that does not start so
    monkeypatch.setattr(llama.generation_config, "eos_token_id", 1)  # the pad id is the model's eos: HF reads it as
    assert fast.generate(unmasked[mask[:, 0] == 0][:1], max_new_tokens=2).shape[0] == 1  # text (no eos given here)
    from speccomp.runtime.calls import model_pad_id

    assert model_pad_id(llama, 2) == 1 and model_pad_id(llama, 1) is None  # past the LM head's rows: none (an
    # engine recorded it, and its load refused it as corrupt)


def test_rows_join_a_running_batch(captured, llama, prompts, greedy):
    """Continuous batching: rows join between steps (their prefill rides in the others' step) and leave when done,
    and the cache's slots of a finished row are reclaimed; every row still decodes its own greedy text."""
    fast = speccomp.compile(captured, drafter="ngram")
    batch = Batch(fast.step, fast.kv, 400, fast.device, fast.max_tree)

    def row(i, n=NEW):
        return Sequence(prompts[i].tolist(), fast.drafter.fresh(), Sampler(), n, set(), fast.max_tree)

    seqs = {batch.add(row(0)): 0, batch.add(row(1, 8)): 1}
    emitted = {rid: [] for rid in seqs}
    for step in range(12):
        if step == 3:  # a new row joins while the others decode
            rid = batch.add(row(2))
            seqs[rid], emitted[rid] = 2, []
        for rid, tokens in batch.step().items():
            emitted[rid] += tokens
        for rid in [r for r, s in batch.rows.items() if s.done]:
            batch.remove(rid)
            assert not (batch.owner[: batch.cache.length] == rid).any()  # its slots are gone
    while batch.rows:
        for rid, tokens in batch.step().items():
            emitted[rid] += tokens
        for rid in [r for r, s in batch.rows.items() if s.done]:
            batch.remove(rid)
    for rid, i in seqs.items():
        want = greedy[i][: 8 if i == 1 else NEW]
        assert emitted[rid] == want.tolist(), f"row {i}"
    assert batch.cache.length == 0 and batch.free() == 400
    with pytest.raises(RuntimeError, match="free slots"):
        batch.add(row(0, 400))


def test_a_row_admitted_into_room_that_left_rows_still_hold_gets_it():
    """A row that leaves frees its reservation at once but its cache slots only lazily (PackedBatch._compact), so a
    row admitted against the reservations (`free()`, as `speccomp serve` admits) may need slots a left row still
    holds: the step compacts then (before, it raised 'KV cache overflow' and a server failed every row in flight).
    Cache filled exactly: A (short) and B (long) reserve it all; C takes A's reservation when A leaves, and the dead
    slots of A and then C stay fewer than B's live ones, so only a step that needs them moves them."""
    llama = tiny_llama(num_hidden_layers=2)
    fast = speccomp.compile(llama)  # plain decoding: one token a step, so the slot arithmetic below is exact
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 24, 5)]
    lengths = (8, 32, 8)  # new tokens of A, B, C
    want = [hf_greedy(llama, torch.tensor([p]), n)[0, len(p):].tolist() for p, n in zip(prompts, lengths)]

    tree = 2  # the room a row keeps for its last step's tree: small, so the dead slots outgrow it

    def row(i):
        return Sequence(prompts[i], RootOnly(), Sampler(), lengths[i], set(), tree)

    needs = [row_slots(len(prompts[i]), lengths[i], tree) for i in range(3)]
    batch = Batch(fast.step, fast.kv, needs[0] + needs[1], fast.device, tree)
    ids = {batch.add(row(0)): 0, batch.add(row(1)): 1}
    emitted, joined, compacted = {i: [] for i in range(3)}, False, 0
    while batch.rows:
        length = batch.cache.length
        for rid, tokens in batch.step().items():
            emitted[ids[rid]] += tokens
        compacted += batch.cache.length < length
        for rid in [r for r, s in batch.rows.items() if s.done]:
            batch.remove(rid)
            if ids[rid] == 0 and not joined:  # C takes exactly the room A left
                assert batch.free() == needs[2] and (batch.owner[: batch.cache.length] == -1).sum() > 0
                ids[batch.add(row(2))], joined = 2, True
    assert joined and compacted >= 1
    assert [emitted[i] for i in range(3)] == want


@pytest.mark.parametrize("runtime", ["torch", "engine"])
def test_batch_sampling_follows_each_rows_distribution(runtime, tmp_path):
    """Sampling with B = 8: each row's first 3 tokens follow the model's exact law (test_sampling's setup and
    chi-square), drafts accepted in most rows: in the torch runtime drafts sampled from a draft model's own
    distribution, in an engine prompt lookup's."""
    from test_sampling import MIN_ACCEPTED, NEW_TOKENS, PROMPT, TEMPERATURE, V, chi2_pvalue, draft_lm, exact_distribution

    model = tiny_llama(vocab_size=V, num_hidden_layers=2, initializer_range=0.3, tie_word_embeddings=True)
    exact = exact_distribution(model, torch.tensor([PROMPT]), 3, TEMPERATURE, 1.0).flatten().numpy()
    if runtime == "torch":
        fast = speccomp.compile(model, drafter=draft_lm(), tree=[[0], [1], [2], [3], [0, 0], [1, 0]])
        generate = fast.generate
    else:
        fast = speccomp.load(speccomp.compile(model, drafter="ngram", backend="onnxruntime").export(tmp_path / "e"))
        generate = fast.generate
    counts, accepted, b = np.zeros(V**3), 0, 8
    for call in range(75):  # 600 draws, 8 rows a call (each row its own seed, calls.row_seed)
        out = generate(np.array([PROMPT] * b), max_new_tokens=NEW_TOKENS, do_sample=True,
                       temperature=TEMPERATURE, seed=call, load_aware=False)
        for row, stats in zip(np.asarray(out)[:, len(PROMPT):].tolist(), fast.last_stats["rows"]):
            a, c, d = row[:3]
            counts[(a * V + c) * V + d] += 1
            accepted += stats["steps"] < NEW_TOKENS
    assert accepted / 600 >= MIN_ACCEPTED
    p = chi2_pvalue(counts, exact)
    assert p > 1e-3, f"batched samples do not follow the model's distribution (chi-square p={p:.2g})"


@pytest.mark.parametrize("runtime", ["torch", "engine"])
def test_a_batch_per_seed_never_draws_one_sample_twice(runtime, tmp_path):
    """Row r of a call seeded s samples with calls.row_seed(s, r): row 0 with s itself (a batch of one samples as a
    single call does), the others with a hash of (s, r). Best-of-n with a batch per seed so never repeats a
    sample (with seeds s + r, row 1 of seed 0 was row 0 of seed 1, the same text)."""
    from speccomp.runtime.calls import row_seed

    seeds = {row_seed(s, r) for s in range(64) for r in range(16)}
    assert len(seeds) == 64 * 16 and all(row_seed(s, 0) == s and 0 <= row_seed(s, 9) < 2**63 for s in range(64))
    model = tiny_llama(num_hidden_layers=1, initializer_range=0.3)
    fast = speccomp.compile(model)
    if runtime == "engine":
        fast = speccomp.load(speccomp.compile(model, backend="onnxruntime").export(tmp_path / "e"))
    prompt = np.arange(3, 11)[None]
    options = dict(max_new_tokens=24, do_sample=True, temperature=1.5)
    pair = np.asarray(fast.generate(np.repeat(prompt, 2, 0), **options, seed=0))
    alone = [np.asarray(fast.generate(torch.as_tensor(prompt) if runtime == "torch" else prompt, **options, seed=s))[0]
             for s in (0, 1)]
    assert np.array_equal(pair[0], alone[0]) and not np.array_equal(pair[1], alone[1])
    assert not np.array_equal(pair[0], pair[1])


def test_budget_predicts_every_smaller_cap_from_accepted_paths():
    from speccomp.runtime.budget import PRIOR, Budget, FixedCosts

    budget = Budget(FixedCosts(1.0, 0.01), max_nodes=64)
    for path in ([0, 1, 3, 9], [0, 2], [0, 1, 5, 6, 40]):  # accepted node indices, root first
        budget.record(7, path, 64)
    budget.record(7, [0], 64)
    shrunk = lambda extra: 1 + extra / (4 + PRIOR)  # noqa: E731  4 records + PRIOR that accepted nothing
    assert budget.expected(7, 1) == 1.0
    assert budget.expected(7, 2) == shrunk(1 + 0 + 1 + 0)  # only node 1 is within the first 2 nodes
    assert budget.expected(7, 8) == shrunk(2 + 1 + 3 + 0)
    assert budget.expected(7, 64) == shrunk(3 + 1 + 4 + 0)
    assert budget.expected(8, 8) == budget.expected(7, 8)  # a row without records borrows the batch's
    budget.forget(7)
    assert budget.expected(7, 8) is None and budget.expected(8, 8) is None  # forgotten with its row
    budget.record(1, [0, 1], 4)
    assert budget.expected(1, 8) is None  # nothing ran at a cap of 8: unknown, not guessed


def test_budget_gives_nodes_where_they_pay():
    """Cheap nodes: the row whose drafts are accepted gets a big cap and the row whose drafts never are stays plain;
    dear nodes: every row plain, and a row without records of its own at the next cap up explores it first, until it
    has them: then the batch decodes plainly (a cap of 1 drafts nothing) but for the looks its ledger pays for."""
    from speccomp.runtime.budget import HISTORY, Budget, FixedCosts

    def budget(per_token):
        b = Budget(FixedCosts(1.0, per_token), max_nodes=64)
        for i in range(8):
            b.record(0, [0, 1, 3, 7, 15] if i % 2 else [0], 64)  # four drafts accepted every other step
            b.record(1, [0], 64)  # none
        return b

    cheap = budget(0.001)
    cheap.queued = True  # requests wait for a place: every token counts (goodput); see the next test otherwise
    for _ in range(2):
        caps = cheap.caps_for([0, 1])
        assert caps[0] >= 16 and caps[1] <= 2
    dear = budget(10.0)  # a node costs ten times the step's fixed part
    looks, idles = [], []
    for _ in range(2 * HISTORY):
        caps = dear.caps_for([0, 1, 2])
        looks.append([r for r, c in caps.items() if c > 1])
        idles.append(set(dear.idle))
        for r in caps:
            dear.record(r, [0], caps[r])  # every draft rejected
    assert all(len(r) <= 1 for r in looks)  # one row looks at a time
    assert looks[0] == [2]  # the row without records looks first; rows 0 and 1 can tell (8 records each)
    assert idles[0] == {0, 1}  # ... so their drafters are switched off: no look is coming, no upkeep is paid
    assert all(idle.isdisjoint(look) for idle, look in zip(idles, looks))
    assert any(idle == {0, 1, 2} for idle in idles)  # while no look is affordable every drafter is off
    # a look (10) costs a third of the step (t(3) = 31): the 1% share pays for one every ~32 steps
    assert 1 < sum(map(len, looks)) <= 1 + 2 * HISTORY * 0.01 * 31 / 10


def test_a_batch_with_nothing_waiting_raises_its_slowest_rows():
    """Nothing queued: the batch runs until its slowest row is done, so a tree pays only where it shortens that row.
    Cheap nodes: rows that both accept drafts get big caps together; a row whose drafts are never accepted holds the
    batch, so neither gets a tree; a row with few tokens left does not hold it, so the other gets its tree alone."""
    from speccomp.runtime.budget import Budget, FixedCosts

    def chosen(accepting, remaining=None):
        b = Budget(FixedCosts(1.0, 0.001), max_nodes=64)
        for i in range(8):
            for r in (0, 1):
                b.record(r, [0, 1, 3, 7, 15] if r in accepting and i % 2 else [0], 64)
        caps = b.caps_for([0, 1], remaining=remaining)
        return {r: c if b._looking.get(r) is None else b.caps[b.caps.index(c) - 1] for r, c in caps.items()}  # no look

    both = chosen({0, 1})
    assert both[0] >= 16 and both[1] >= 16
    assert chosen({0}) == {0: 1, 1: 1}  # row 1 needs as many steps with or without row 0's tree
    alone = chosen({0}, remaining={0: 64, 1: 4})
    assert alone[0] >= 16 and alone[1] == 1


def test_looks_spend_at_most_their_share_unless_they_pay():
    """Looks are paid from a ledger: LOOK_SHARE of the step time plus what the looks gained. Where every look is
    rejected they cost at most that share (and one look), their drafters' host time included; where they are accepted
    they fund a look every step; a look whose drafter offered nothing costs nothing."""
    from speccomp.runtime.budget import LOOK_SHARE, Budget, FixedCosts

    def run(accept: bool, steps=400, rows=(0, 1, 2, 3), offered=None, host=0.0):
        b = Budget(FixedCosts(1.0, 0.2), max_nodes=64)  # a look's node: a fifth of the step (t(4) = 1.8, t(5) = 2.0)
        spent = base = 0.0
        for _ in range(steps):
            caps = b.caps_for(list(rows))
            base += b.costs(len(rows))
            spent += b.costs(sum(caps.values())) - b.costs(len(rows))
            for r in caps:  # every row's drafter reports its host seconds; only a look's are the ledger's
                spent += host if r in b._looking else 0.0
                b.charge(r, host if r in b._looking else 1e9)
            for r, cap in caps.items():
                nodes = cap if offered is None else min(cap, offered)
                b.record(r, [0, 1] if accept and cap > 1 else [0], nodes)
                b._wait[r] = (0, 1)  # no backoff: the ledger alone limits the looks here
                b.history[r].clear()  # nor records: the greedy loop never buys a node, every extra node is a look
            b._totals = {key: [[0, 0] for _ in b.caps] for key in b._totals}
        return spent / base

    share = run(accept=False)
    assert 0.5 * LOOK_SHARE < share <= LOOK_SHARE + 0.2 / (1.8 * 400) + 1e-9  # the share, plus at most one look
    dear = run(accept=False, host=0.3)  # a look's drafter works for 0.3 s besides its node's 0.2 s: fewer looks
    assert 0.5 * LOOK_SHARE < dear <= LOOK_SHARE + 0.5 / (1.8 * 400) + 1e-9
    paid = run(accept=True)
    assert paid > 0.9 * (2.0 - 1.8) / 1.8  # a look nearly every step: a gained token is worth more than a node
    b = Budget(FixedCosts(1.0, 0.2), max_nodes=64)
    for _ in range(10):  # the drafter has nothing to offer (a 1-node tree): looks go on, every step, for free
        assert b.caps_for([0, 1, 2, 3])[0] == 2 or b._looking
        for r in range(4):
            b.record(r, [0], 1)
    assert b.ledger >= 0


def test_few_lucky_records_do_not_buy_nodes():
    """Estimates are shrunk toward "no draft accepted" and a node must raise the predicted goodput by MARGIN: one
    lucky record at a cap (a long accepted path) buys nothing where nodes cost what they gain on average; many such
    records do. The benchmark that motivated it: benchmarks/README.md, batches."""
    from speccomp.runtime.budget import MARGIN, PRIOR, Budget, FixedCosts

    def caps(records):
        b = Budget(FixedCosts(1.0, 0.25), max_nodes=64)  # a node costs a quarter of the step's fixed part
        for _ in range(records):
            b.record(0, [0, 1], 2)  # a cap of 2 gained one token
        cap, look = b.caps_for([0])[0], b._looking.get(0)  # a look is exploration (one cap up), not a purchase
        chosen = cap if look is None else b.caps[b.caps.index(look) - 1]
        return chosen > 1, b.expected(0, 2)

    bought, e = caps(1)
    assert e == 1 + 1 / (1 + PRIOR) and not bought  # its raw mean (2 tokens) would have bought the node
    assert e / 1.5 <= (1 + MARGIN) * (1 / 1.25) < 2 / 1.5  # goodput with the node (t(2) = 1.5) against without
    bought, e = caps(32)
    assert e == 1 + 32 / (32 + PRIOR) and bought  # 32 records: the node pays and is bought


def test_a_look_that_found_no_draft_is_no_evidence():
    """A row that looked at cap 2 but whose drafter had nothing to draft (a 1-node tree: Token Recycling's table is
    empty at first) looks again at once; looks whose drafts are rejected come less and less often, and after MIN_OWN
    of them the row's records tell that cap 2 does not pay: it stays at cap 1, its drafter off, between looks."""
    from speccomp.runtime.budget import MIN_OWN, Budget, FixedCosts

    budget = Budget(FixedCosts(1.0, 0.005), max_nodes=64)  # looks that cost less than LOOK_SHARE: backoff alone
    for _ in range(3 * MIN_OWN):
        assert budget.caps_for([0]) == {0: 2} and not budget.idle  # a row that looks keeps its drafter on
        budget.record(0, [0], 1)  # the drafter offered the root alone
    assert budget.expected(0, 2) is None
    waits = []
    for _ in range(MIN_OWN):  # real drafts, rejected: the row waits longer and longer between looks
        steps = 0
        while budget.caps_for([0]) != {0: 2}:
            assert budget.idle == {0}  # backing off: its drafter is switched off
            budget.record(0, [0], 1)  # a plain step
            steps += 1
            assert steps < 100
        budget.record(0, [0], 2)
        waits.append(steps)
    assert waits == sorted(waits) and waits[-1] > waits[0]
    assert budget.expected(0, 2) == 1.0 and budget.caps_for([0]) == {0: 1} and budget.idle == {0}


def test_step_costs_are_the_fastest_run_and_never_fall_with_q_or_past():
    """Noise only adds time (the fastest timed run is kept), and a bigger forward never looks cheaper than a smaller
    one, in tokens or in cached slots (a slow measurement at q = 2 lifts q = 4's), so the budget never buys nodes on
    a measurement's noise; between grid points the curve interpolates, and a seeded grid is not measured again."""
    import time as clock

    from speccomp.runtime.budget import StepCosts

    calls = []
    seconds = {(1, 256): 0.002, (2, 256): 0.012, (4, 256): 0.004, (1, 512): 0.001, (2, 512): 0.020}

    def run(q, past):
        calls.append((q, past))
        clock.sleep(seconds[(q, past)] * (3 if len(calls) % 4 == 0 else 1))  # every 4th call is slow

    released = []
    run.release = lambda: released.append(1)
    costs = StepCosts(run, repeats=4, warmup=1)
    assert 0.012 <= costs(2) < 0.02 and calls.count((2, 256)) == 5  # 1 untimed + 4 timed, the slow one not kept
    assert costs(4) == costs(2) and costs(3) == costs(2)  # 4's own 4 ms is lifted to 2's 12 ms
    assert costs(1) < costs(2)
    assert costs(1, 512) == costs(1, 256)  # 512's own 1 ms is lifted to 256's 2 ms
    assert costs(2, 512) > costs(2, 256) and costs(2, 0) == costs(2, 256)  # below the grid: its first row
    assert costs(2, 384) == pytest.approx((costs(2, 256) + costs(2, 512)) / 2)  # halfway between two grid rows
    assert len(released) == len(costs.measured) == 5  # what each measurement allocated was let go of
    n = len(calls)
    seeded = StepCosts(run, measured=costs.measured)
    assert seeded(2, 384) == costs(2, 384) and len(calls) == n  # a stored curve (tuning/step_curve.py) is used as is


def test_a_stored_step_curve_is_what_later_batches_plan_with(llama, prompts, greedy, tmp_path, monkeypatch):
    """The curve autotune stores (tuning/step_curve.py, measured afresh over a stale seed) is found by a later
    compile's batches on onnxruntime, whose forwards run with torch at one thread: it is keyed by the user's count."""
    from speccomp.runtime.budget import AHEAD_Q
    from speccomp.tuning.step_curve import load_curve, store_curve

    monkeypatch.setenv("SPECCOMP_CACHE", str(tmp_path))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        costs = speccomp.compile(llama, drafter="token_recycling", backend="onnxruntime").step_costs()
        costs.measured[(1, 256)] = 123.0  # a stale point: storing measures again
        store_curve(llama, "onnxruntime", costs, max_q=AHEAD_Q, max_past=512)
        stored = load_curve(llama, "onnxruntime")
        assert stored[(1, 256)] < 1 and (AHEAD_Q, 512) in stored
        assert load_curve(llama, "onnxruntime", threads=1) is None and load_curve(llama, "eager") is None
        fast = speccomp.compile(llama, drafter="token_recycling", backend="onnxruntime")
        check_rows(fast, prompts, greedy, 2)
        assert fast._step_costs.measured == stored  # planned with the stored grid; nothing measured in generate
    finally:
        torch.set_num_threads(before)


def test_an_engine_stores_its_step_curve_and_later_engines_start_from_it(captured, tmp_path, monkeypatch):
    """`speccomp serve` measures the engine's grid at its first start and stores it (Engine.store_step_curve, keyed
    by the target graph's SHA-256, providers, threads, spinning): a later Engine of the same directory on this
    machine measures nothing; another thread count, or a damaged file, starts from nothing."""
    from speccomp.tuning.step_curve import curve_path

    monkeypatch.setenv("SPECCOMP_CACHE", str(tmp_path / "cache"))
    path = speccomp.compile(captured, drafter="token_recycling").export(tmp_path / "e")
    first = speccomp.load(path, threads=1)
    assert first.step_costs().measured == {}  # nothing stored yet
    stored = first.store_step_curve(max_q=4, max_past=512)
    assert stored == curve_path(first._curve_key) and stored.is_file()
    points = dict(first.step_costs().measured)
    assert set(points) == {(q, past) for q in (1, 2, 4) for past in (256, 512)}

    def no_forward(q, past):
        raise AssertionError(f"measured t({q}, {past}) although it was stored")

    later = speccomp.load(path, threads=1)
    costs = later.step_costs()
    assert costs.measured == points
    costs.run = no_forward
    later.store_step_curve(max_q=4, max_past=512)  # a second serve start: nothing to measure
    assert first.step_costs()(3, 300) == costs(3, 300) > 0  # interpolated from the stored grid
    assert speccomp.load(path, threads=2).step_costs().measured == {}  # another key
    for damaged in ("{not json", "[]", "null"):
        stored.write_text(damaged)
        assert speccomp.load(path, threads=1).step_costs().measured == {}, damaged  # measured afresh, not an error


def test_a_bigger_batch_cache_makes_nodes_dearer():
    """Every query is scored against every cached slot of the batch, so the same acceptance buys fewer nodes over a
    long batch cache than over a short one (StepCosts measures t(q, past); FixedCosts' per_slot models it)."""
    from speccomp.runtime.budget import Budget, FixedCosts

    def caps(past):
        b = Budget(FixedCosts(1.0, 0.02, per_slot=1e-4), max_nodes=64)  # a node: 0.03 of a step at 100 slots, 1.02 at 10k
        b.queued, b.ledger = True, float("-inf")  # goodput: any row's raise may be bought; no look
        for _ in range(16):
            for rid in (0, 1):
                b.record(rid, [0, 1, 2, 3], 8)  # three drafts accepted, then none: E[tokens | cap 2] ~ 1.44
                b.record(rid, [0], 8)
        return sum(b.caps_for([0, 1], past=past).values())

    short, long = caps(100), caps(10_000)
    assert short > long == 2, (short, long)  # the long cache: plain decoding


def test_load_aware_batches_follow_the_step_cost(captured, prompts, greedy):
    """The batch's caps follow the cost curve it is given: with free nodes it speculates (fewer forwards than tokens),
    with dear nodes it decodes (nearly) plainly; the text is each row's greedy text either way."""
    from speccomp.runtime.budget import FixedCosts

    fast = speccomp.compile(captured, drafter="token_recycling")
    fast._step_costs = FixedCosts(1.0, 0.0)
    free = check_rows(fast, prompts, greedy, 4)
    fast._step_costs = FixedCosts(0.0, 1.0)
    dear = check_rows(fast, prompts, greedy, 4)
    assert free["forwards"] < NEW and dear["forwards"] > free["forwards"]
    assert max(r["tau"] for r in dear["rows"]) < max(r["tau"] for r in free["rows"])


def spied_run(batch, rows) -> tuple[dict, dict]:
    """`rows` to the end in `batch` (a load-aware torch Batch or engine EngineBatch), each row's drafter spied on: per
    row, one (switched off, nodes its drafter observed, tokens emitted) per step after its prefill; each row's output."""
    calls, log, outs = {}, {}, {}
    # a look's ledger is also charged its drafter's real host seconds (Budget.charge), which differ between the
    # runtimes and with the machine's load; here it counts the given curve's costs only, so both runs decide alike
    batch.budget.charge = lambda rid, seconds: None
    for row in rows:
        rid = batch.add(row)
        calls[rid], log[rid], observe = [0], [], row.drafter.observe

        def spy(*args, _observe=observe, _calls=calls[rid]):
            _calls[0] += len(args[2])  # the target's logits at every verified node, in both runtimes
            return _observe(*args)

        row.drafter.observe = spy
    while batch.rows:
        before = {rid: (calls[rid][0], bool(row.out)) for rid, row in batch.rows.items()}
        for rid, tokens in batch.step().items():
            if before[rid][1]:  # not its prefill
                log[rid].append((rid in batch.budget.idle, calls[rid][0] - before[rid][0], len(tokens)))
        for rid in [r for r, row in batch.rows.items() if row.done]:
            outs[rid] = list(batch.rows[rid].out)
            batch.remove(rid)
    return log, outs


@pytest.mark.parametrize("b", [2, 4])
def test_switched_off_rows_skip_their_upkeep_and_resume(captured, prompts, greedy, b, tmp_path):
    """With dear nodes the budget switches rows' drafters off between looks (runtime/budget.py `idle`): a switched-off
    Token Recycling row does not observe the step (no top-k over the vocabulary; in an engine no TopK for its node),
    every other row does; switched back on, its drafts are accepted again; each row's text stays its own greedy text,
    and the torch runtime and the engine switch, observe and accept alike step by step."""
    from speccomp.runtime.budget import Budget, FixedCosts

    fast = speccomp.compile(captured, drafter="token_recycling", backend="onnxruntime")
    engine = speccomp.load(fast.export(tmp_path / "e"))
    costs = FixedCosts(1.0, 0.1)  # a node costs a tenth of a step: rows decode plainly but for their looks
    seqs = [Sequence(p.tolist(), fast.drafter.fresh(), Sampler(), NEW, set(), fast.max_tree) for p in prompts[:b]]
    log, outs = spied_run(Batch(fast.step, fast.kv, 1000, fast.device, fast.max_tree, Budget(costs, fast.max_tree)),
                          seqs)
    engine._step_costs = costs
    topk_rows, run = [], engine.session.run  # the nodes the target graph's TopK reads, each forward
    engine.session.run = lambda feeds, names: topk_rows.append(len(feeds["top_ids_rows"])) or run(feeds, names)
    engine_log, engine_outs = spied_run(engine.batch(1000), [engine.row(p.numpy(), NEW, eos_token_id=[])
                                                             for p in prompts[:b]])
    for i in range(b):
        assert outs[i] == engine_outs[i] == greedy[i].tolist(), f"row {i}"
    assert engine_log == log  # the same switch-offs, observes and accepted drafts, step by step
    steps = [step for row in log.values() for step in row]
    assert all(bool(observed) == (not idle) for idle, observed, _ in steps)  # switched off: no observe; else always
    assert sum(topk_rows) == sum(observed for _, observed, _ in steps)  # an engine's TopK: observed nodes only
    assert sum(idle for idle, _, _ in steps) >= len(steps) // 4  # the switch-off was active
    resumed = [n for row in log.values() for k, (_, _, n) in enumerate(row) if any(idle for idle, _, _ in row[:k])]
    assert max(resumed) > 1  # a row switched off earlier had drafts accepted after


def test_what_cannot_batch_is_refused_by_name(captured, prompts, tmp_path):
    from tiny_models import ARCHITECTURES

    ids, mask = left_padded(prompts[:2])
    skip = speccomp.compile(captured, drafter="layer_skip", drafter_options={"skip": [1]})
    with pytest.raises(OptionError, match="layer_skip drafter drafts over the target's own KV cache"):
        skip.generate(ids, max_new_tokens=4, attention_mask=mask)
    windowed = speccomp.compile(ARCHITECTURES["mistral"].build())
    with pytest.raises(OptionError, match="sliding-window attention"):
        windowed.generate(torch.ones(2, 4, dtype=torch.long), max_new_tokens=4)
    compressed = speccomp.compile(captured, kv_cache="sink:16")
    with pytest.raises(OptionError, match="compressed"):
        compressed.generate(ids, max_new_tokens=4, attention_mask=mask)
    plain = speccomp.compile(captured)
    right = mask.flip(1)  # padding on the right
    with pytest.raises(OptionError, match="attention_mask.*not left-padded"):
        plain.generate(ids, max_new_tokens=4, attention_mask=right)
    with pytest.raises(OptionError, match="input_ids.*ragged"):
        plain.generate([[5, 6, 7], [5, 6]], max_new_tokens=4)
    with pytest.raises(OptionError, match="attention_mask.*shape"):
        plain.generate(ids, max_new_tokens=4, attention_mask=mask[:, 1:])
    with pytest.raises(OptionError, match=r"input_ids=.*must be \[seq\], \[1, seq\] or a batch \[B, seq\], got shape "
                                          r"\(1, 2, \d+\)"):  # was "has padding for a single sequence"
        plain.generate(ids[None], max_new_tokens=4, attention_mask=mask[None])
    one = prompts[0].tolist()  # one sequence as a list, with HF's all-ones mask as a list: what a tensor gets
    assert torch.equal(plain.generate(one, max_new_tokens=4, attention_mask=[1] * len(one)),
                       plain.generate(torch.tensor([one]), max_new_tokens=4))
    with pytest.raises(OptionError, match="max_new_tokens"):  # every row is checked as a single call's
        plain.generate(ids, max_new_tokens=10_000, attention_mask=mask)
    from speccomp.errors import OptionTypeError

    for bad, error, words in ((dict(pad_token_id=[1, 2]), OptionTypeError, "pad_token_id.*one token id"),
                              (dict(pad_token_id=500), OptionError, "pad_token_id.*outside the vocabulary"),
                              (dict(pad_token_id="0"), OptionTypeError, "pad_token_id"),
                              (dict(load_aware="yes"), OptionTypeError, "load_aware.*True or False")):
        with pytest.raises(error, match=words):
            plain.generate(ids, max_new_tokens=4, attention_mask=mask, **bad)
        with pytest.raises(error, match=words):  # one sequence: checked the same, though it pads nothing
            plain.generate(ids[:1], max_new_tokens=4, **bad)


ENGINE_CASES = {
    "token_recycling": lambda h, m: dict(drafter="token_recycling"),
    "hydra+token_recycling": CASES["hydra+token_recycling"],
    "draft_model": CASES["draft_model"],
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_batches_rows_equal_their_own_greedy(captured, llama, prompts, greedy, heads, case, tmp_path):
    """The exported engine packs a batch the same way (numpy, ONNX Runtime): every row its own greedy text, for
    B in {2, 4, 8} on the recycling case, and the same forwards as the torch runtime's batch."""
    fast = speccomp.compile(captured, **ENGINE_CASES[case](heads, llama), backend="onnxruntime")
    engine = speccomp.load(fast.export(tmp_path / "e"))
    for b in (2, 4, 8) if case == "token_recycling" else (4,):
        ids, mask = left_padded(prompts[:b])
        out = engine.generate(ids.numpy(), max_new_tokens=NEW, attention_mask=mask.numpy(), load_aware=False)
        for i in range(b):
            assert out[i, ids.shape[1]:].tolist() == greedy[i].tolist(), f"row {i} of {b}"
        fast.generate(ids, max_new_tokens=NEW, attention_mask=mask, load_aware=False)
        assert [r["steps"] for r in engine.last_stats["rows"]] == [r["steps"] for r in fast.last_stats["rows"]]
        assert engine.last_stats["forwards"] == fast.last_stats["forwards"]


def test_engine_refuses_batches_it_cannot_pack(captured, prompts, tmp_path):
    from speccomp.engine.runtime import EngineError

    ids, mask = left_padded(prompts[:2])
    engine = speccomp.load(speccomp.compile(captured, drafter="early_exit").export(tmp_path / "e"))
    with pytest.raises(EngineError, match="early_exit drafter drafts over the target's own KV cache"):
        engine.generate(ids.numpy(), max_new_tokens=4, attention_mask=mask.numpy())
    plain = speccomp.load(tmp_path / "e", draft=False)  # the fix the error names: plain decoding batches
    assert plain.generate(ids.numpy(), max_new_tokens=4, attention_mask=mask.numpy()).shape == (2, ids.shape[1] + 4)
    from speccomp.errors import OptionError, OptionTypeError

    for bad, error, words in ((dict(pad_token_id=500), OptionError, "pad_token_id.*outside the vocabulary"),
                              (dict(load_aware=1), OptionTypeError, "load_aware.*True or False")):
        with pytest.raises(error, match=words):
            plain.generate(ids.numpy(), max_new_tokens=4, attention_mask=mask.numpy(), **bad)
        with pytest.raises(error, match=words):
            plain.generate(ids.numpy()[1:], max_new_tokens=4, **bad)


def test_persist_gives_every_row_one_recycling_table(captured, prompts, greedy, tmp_path):
    """token_recycling persist=True keeps its table across generations, batch rows and served requests included:
    every row reads and writes the drafter's one table (lossless: the target verifies every draft). Before, each row
    started from an empty table of its own and dropped it when it left, in both runtimes."""
    fast = speccomp.compile(captured, drafter="token_recycling", drafter_options={"persist": True},
                            backend="onnxruntime")
    engine = speccomp.load(fast.export(tmp_path / "e"))
    ids, mask = left_padded(prompts[:4])
    for runtime, array in ((fast, lambda t: t), (engine, lambda t: t.numpy())):
        assert runtime.drafter.adj == {}
        out = runtime.generate(array(ids), max_new_tokens=NEW, attention_mask=array(mask), load_aware=False)
        for i in range(4):
            assert out[i, ids.shape[1]:].tolist() == greedy[i].tolist(), f"row {i}"
        assert len(runtime.drafter.adj) > 20, type(runtime).__name__  # what the rows recycled stayed
        learned = dict(runtime.drafter.adj)
        runtime.generate(array(ids[:1, -prompts[0].shape[0]:]), max_new_tokens=4)  # a later single call reads it
        assert set(learned) <= set(runtime.drafter.adj)


def test_load_aware_batches_of_a_model_with_learned_positions(tmp_path):
    """GPT-2's position table ends at its context (256 here): the budget's timing forwards run over a batch's slots,
    all rows' together (from 256), and once fed those as positions, an IndexError in both runtimes. Their positions
    wrap at the context now (a forward's cost does not depend on them): every row its own HF greedy text."""
    from tiny_models import ARCHITECTURES

    model = ARCHITECTURES["gpt2"].build()
    assert model.config.n_positions == 256
    fast = speccomp.compile(model, drafter="ngram", backend="onnxruntime")
    rows = [repetitive_prompt(96, seed, n)[0] for seed, n in ((1, 10), (2, 6))]
    ids, mask = left_padded(rows)
    engine = speccomp.load(fast.export(tmp_path / "e"))
    for runtime, array in ((fast, lambda t: t), (engine, lambda t: t.numpy())):
        out = runtime.generate(array(ids), max_new_tokens=12, attention_mask=array(mask), load_aware=True)
        for i, row in enumerate(rows):
            assert out[i, ids.shape[1]:].tolist() == hf_greedy(model, row[None], 12)[0, len(row):].tolist(), (runtime, i)
