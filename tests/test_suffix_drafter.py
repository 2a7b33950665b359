"""Suffix decoding (speccomp/drafters/suffix.py): the count trie against brute force, the draft tree's
probabilities, the cross-request memory and its cap; greedy output exactly HF's, in the torch runtime and in an
engine (the same drafts)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import speccomp
from speccomp.drafters.suffix import SuffixDecoder, SuffixIndex, SuffixMemory
from speccomp.errors import OptionError
from tiny_models import tiny_llama


def brute_count(texts, s) -> int:
    return sum(1 for t in texts for i in range(len(t) - len(s) + 1) if t[i : i + len(s)] == s)


def test_index_counts_every_short_string_like_brute_force():
    rng = random.Random(0)
    texts = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    ix = SuffixIndex(depth=4)
    for t in texts:
        ix.new_text()
        ix.extend(t[:7])
        ix.extend(t[7:])  # appending in pieces is appending
    strings = {tuple(t[i:j]) for t in texts for i in range(len(t)) for j in range(i + 1, min(len(t), i + 4) + 1)}
    for s in strings:
        assert ix.count[ix.find(list(s))] == brute_count(texts, list(s)), s
    assert ix.find([9]) is None and all(level <= 4 for level in ix.level)


def test_draft_is_the_likeliest_continuations_of_the_longest_recurring_suffix():
    text = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]  # "5 1 2" never recurs; "1 2" did 3 times: then 3, 4, 3
    d = SuffixDecoder(max_match=4, max_depth=3, budget=5, min_prob=0.1, memory=0)
    d.begin(text)
    parents, tokens = d.propose(text, max_depth=8, max_nodes=64)
    # P(3) = 2/3, P(4) = 1/3; after "1 2 3": "1" and "5" (1/2 each, so 1/3); after "1 2 4": "1" (1/3)
    assert tokens[:3] == [2, 3, 4] and parents[:3] == [-1, 0, 0]
    assert sorted(zip(parents[3:], tokens[3:])) == [(1, 1), (1, 5), (2, 1)] and len(tokens) == 6
    assert d.propose(text, max_depth=1, max_nodes=64) == ([-1, 0, 0], [2, 3, 4])  # the room the loop gives
    assert d.propose(text, max_depth=8, max_nodes=2) == ([-1, 0], [2, 3])
    sure = SuffixDecoder(max_match=4, max_depth=3, budget=5, min_prob=0.5, memory=0)
    sure.begin(text)
    assert sure.propose(text, 8, 64) == ([-1, 0], [2, 3])  # only the 2/3 continuation clears min_prob
    assert d.propose([7, 8, 9], 8, 64) == ([-1], [9])  # another text: nothing recurs, root only


def test_memory_carries_earlier_replies_and_keeps_under_its_cap():
    d = SuffixDecoder(max_match=4, max_depth=4, budget=8, min_prob=0.1, memory=10_000)
    first = [5, 6, 7, 8, 9, 10, 11]
    d.begin(first[:2])
    d.propose(first, 4, 64)  # the first generation's text, as the loop hands it
    d.begin([40, 41, 5, 6])  # the next request: "5 6" continued in the last one
    parents, tokens = d.propose([40, 41, 5, 6], 4, 64)
    assert tokens == [6, 7, 8, 9, 10] and parents == [-1, 0, 1, 2, 3]
    assert SuffixDecoder(memory=0).memory is None
    small = SuffixMemory(depth=4, max_nodes=200)
    for i in range(30):
        small.add([100 + i] * 3 + list(range(10 * i, 10 * i + 10)))
        assert small.index.nodes <= 200 + 13 * 4 + 1
    assert len(small.texts) < 30 and small.texts[-1][0] == 129  # the oldest left, the newest stayed


def repetitive_prompt(seed: int, vocab: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (7,), generator=g).repeat(4)[None]


def hf_greedy(model, ids, n):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=None)


def test_suffix_drafter_is_exact_accepts_drafts_and_remembers_earlier_replies(tmp_path):
    model = tiny_llama(initializer_range=0.2)
    fast = speccomp.compile(model, drafter="suffix", backend="onnxruntime")
    steps = []
    for seed in (0, 0, 1):  # the same prompt twice: the second reply is drafted from the first one too
        ids = repetitive_prompt(seed)
        assert torch.equal(fast.generate(ids, max_new_tokens=40), hf_greedy(model, ids, 40))
        steps.append(fast.last_stats["steps"])
    assert steps[0] < 40 and steps[1] < steps[0], steps  # drafts accepted; memory helps the repeat
    # each whole text (prompt + reply) joined the memory when its generate returned, its last step's tokens too
    assert [len(t) for t in fast.drafter.decoder.memory.texts] == [28 + 40] * 3
    engine = speccomp.load(fast.export(tmp_path / "e"))
    assert engine.drafter.decoder.max_match == 16
    engine_steps = []
    for seed in (0, 0, 1):
        ids = repetitive_prompt(seed)
        out = engine.generate(ids.numpy(), max_new_tokens=40)
        assert np.array_equal(out, hf_greedy(model, ids, 40).numpy())
        engine_steps.append(engine.last_stats["steps"])
    assert engine_steps == steps, (engine_steps, steps)  # the engine remembers its earlier replies as torch does
    assert engine.drafter.decoder.memory.texts == fast.drafter.decoder.memory.texts
    fresh = speccomp.compile(model, drafter="suffix", backend="onnxruntime", drafter_options={"memory": 0})
    fresh.generate(repetitive_prompt(0), max_new_tokens=40)
    assert fresh.last_stats["steps"] == steps[0]  # without memory the repeat drafts as the first call did


def test_suffix_options_are_checked():
    model = tiny_llama()
    with pytest.raises(OptionError, match="min_prob"):
        speccomp.compile(model, drafter="suffix", drafter_options={"min_prob": 0})
    from speccomp.errors import OptionTypeError

    with pytest.raises(OptionTypeError, match="min_prob='0.1': must be a number, got str"):  # was "a probability"
        speccomp.compile(model, drafter="suffix", drafter_options={"min_prob": "0.1"})
    # numpy's and torch's numbers are numbers (were refused as "not a probability")
    for number in (np.float32(0.25), torch.tensor(0.25)):
        assert speccomp.compile(model, drafter="suffix", drafter_options={"min_prob": number}).drafter.options[
            "min_prob"] == 0.25
    with pytest.raises(OptionError, match="budget"):
        speccomp.compile(model, drafter="suffix", drafter_options={"budget": 0})
    with pytest.raises(OptionError, match="unknown suffix options"):
        speccomp.compile(model, drafter="suffix", drafter_options={"depth": 3})
    with pytest.raises(OptionError, match="drop tree="):
        speccomp.compile(model, drafter="suffix", tree=4)


def test_batched_rows_add_their_replies_to_the_memory(tmp_path):
    """Rows of a batch draft from the shared memory and, when the batch lets them go, add their texts to it (as a
    single generation does at the next one): after a batch of two, the first prompt alone again drafts from the
    batch's reply, in fewer steps than a drafter without memory, in torch and in an engine alike."""
    model = tiny_llama(initializer_range=0.2)
    fast = speccomp.compile(model, drafter="suffix", backend="onnxruntime")
    engine = speccomp.load(fast.export(tmp_path / "e"))
    batch = torch.cat([repetitive_prompt(0), repetitive_prompt(1)])
    forgetful = speccomp.compile(model, drafter="suffix", drafter_options={"memory": 0})
    forgetful.generate(repetitive_prompt(0), max_new_tokens=40)
    for run in (fast, engine):
        given = batch if run is fast else batch.numpy()
        out = run.generate(given, max_new_tokens=40)
        for row in range(2):
            want = hf_greedy(model, batch[row : row + 1], 40)
            assert np.array_equal(np.asarray(out[row : row + 1]), want.numpy())
        memory = (run.drafter if run is fast else engine.drafter).decoder.memory
        assert len(memory.texts) == 2 and all(len(t) >= 28 for t in memory.texts), [len(t) for t in memory.texts]
        ids = repetitive_prompt(0)
        again = run.generate(ids if run is fast else ids.numpy(), max_new_tokens=40)
        assert np.array_equal(np.asarray(again), hf_greedy(model, ids, 40).numpy())
        assert run.last_stats["steps"] < forgetful.last_stats["steps"], (run, run.last_stats["steps"], forgetful.last_stats["steps"])
