"""Drafter search: candidates are valid, the fastest lossless one is picked, stored, and reused by compile."""
import json
import os

import pytest
import torch

import speccomp
from speccomp.errors import OptionError
from speccomp.models import fingerprint
from speccomp.tuning.search import cached_options, candidates, search_drafter
from tiny_models import tiny_llama


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCOMP_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("n", [2, 3, 6, 30])
def test_candidates_are_valid_layer_sets(n):
    for c in candidates("early_exit", n):
        assert 0 <= c["exit_layer"] <= n - 2
    sets = candidates("layer_skip", n)
    assert sets and len({tuple(c["skip"]) for c in sets}) == len(sets)
    for c in sets:
        assert c["skip"] and all(0 <= i < n for i in c["skip"]) and len(c["skip"]) < n
    with pytest.raises(ValueError, match="search covers"):
        candidates("ngram", n)


def test_fingerprint_tracks_weights():
    a, b = tiny_llama(), tiny_llama()
    assert fingerprint(a) == fingerprint(b)  # same seed, same weights
    with torch.no_grad():
        b.lm_head.weight.view(-1)[0] += 1
    assert fingerprint(a) != fingerprint(b)


def test_search_picks_the_fastest_identical_candidate_and_compile_reuses_it(cache):
    model = tiny_llama(num_hidden_layers=6, initializer_range=0.2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (1, 10), generator=g) for _ in range(2)]
    assert cached_options(model, "layer_skip", None) is None
    result = search_drafter(model, "layer_skip", prompts, max_new_tokens=16)
    assert len(result.rows) == len(candidates("layer_skip", 6))
    assert all(r["identical"] for r in result.rows)  # every candidate decodes exactly like the model
    fastest = max(result.rows, key=lambda r: r["tokens_per_s"])
    assert result.best == fastest["options"]
    stored = json.loads(open(result.path).read())
    assert stored["best"] == result.best and result.path.startswith(str(cache))
    assert "**best**" in result.table()
    # compile without options now uses the stored choice; explicit options still win
    fast = speccomp.compile(model, drafter="layer_skip")
    assert fast.drafter.options == result.best
    explicit = speccomp.compile(model, drafter="layer_skip", drafter_options={"skip": [2]})
    assert explicit.drafter.options == {"skip": [2]}
    # a different tree is a different search key
    assert cached_options(model, "layer_skip", 2) is None
    ids = prompts[0]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(fast.generate(ids, max_new_tokens=20, eos_token_id=2), ref)  # tiny configs stop at 2


def test_damaged_cache_entry_is_ignored(cache):
    model = tiny_llama()
    result = search_drafter(model, "early_exit", [torch.arange(3, 12)], max_new_tokens=6, options=[{"exit_layer": 0}])
    assert result.best == {"exit_layer": 0}
    open(result.path, "w").write("{not json")
    assert cached_options(model, "early_exit", None) is None
    assert speccomp.compile(model, drafter="early_exit").drafter.options == {"exit_layer": 0}  # n // 2 - 1 default
    os.remove(result.path)
    os.mkdir(result.path)  # unreadable (as a file without read permission): compile raised IsADirectoryError
    assert cached_options(model, "early_exit", None) is None
    assert speccomp.compile(model, drafter="early_exit").drafter.options == {"exit_layer": 0}
    os.rmdir(result.path)
    # an edited entry's bad option names the file it came from (the user gave no options)
    open(result.path, "w").write(json.dumps({"best": {"exit_layer": 99}}))
    with pytest.raises(speccomp.OptionError, match=r"exit_layer=99: .*read from the stored search .*early_exit-.*, "
                                                   r"not given\); delete that file"):
        speccomp.compile(model, drafter="early_exit")


def test_search_rejects_bad_input(cache):
    model = tiny_llama()
    with pytest.raises(OptionError, match=r"kind='ngram': search covers the drafters \['early_exit', 'layer_skip'\]"):
        search_drafter(model, "ngram", [torch.arange(3, 9)])
    with pytest.raises(OptionError, match=r"prompts=\[\]: holds no calibration prompt"):
        search_drafter(model, "layer_skip", [])
    # raw errors before (a ZeroDivisionError, an AttributeError): named now
    with pytest.raises(speccomp.OptionError, match=r"options=\[\]: must be a non-empty list of drafter_options"):
        search_drafter(model, "layer_skip", [torch.arange(3, 9)], options=[])
    with pytest.raises(speccomp.OptionError, match=r"prompts=\[\[3, 4, 5\]\]: must be a list of token id tensors"):
        search_drafter(model, "layer_skip", [[3, 4, 5]])
    # compile(tree="auto") reads autotune's result, never a search's: such a search was stored where nothing looks
    with pytest.raises(speccomp.OptionError, match="^tree='auto': .*speccomp autotune"):
        search_drafter(model, "layer_skip", [torch.arange(3, 9)], tree="auto")
