"""Synthetic instructions for head training: deterministic, distinct, every kind covered, bad sizes refused."""
import re

import pytest

from speccomp.cli import main
from speccomp.tuning.synthetic_prompts import KINDS, synthetic_prompts

FIELD = re.compile(r"\{[a-z]+[0-9]?\}")  # a template field left unfilled (code snippets may hold "{}")


def test_same_seed_same_prompts_other_seed_other_prompts():
    a = synthetic_prompts(300, seed=0)
    assert a == synthetic_prompts(300, seed=0)
    assert a != synthetic_prompts(300, seed=1)
    assert len(a) == 300 and len(set(a)) == 300


def test_every_kind_in_turn_and_every_field_filled():
    prompts = synthetic_prompts(800, seed=3)
    assert not [p for p in prompts if FIELD.search(p)]
    first_round = prompts[: len(KINDS)]  # one prompt of each kind, in KINDS order
    for (kind, templates), text in zip(KINDS.items(), first_round):
        stems = [t.split("{")[0] for t in templates]
        assert any(text.startswith(stem) for stem in stems), (kind, text)
    other_stems = {t.split("{")[0] for kind, ts in KINDS.items() if kind != "math" for t in ts}
    math_stems = [t.split("{")[0] for t in KINDS["math"]]
    math_stems = [m for m in math_stems if not any(o.startswith(m) or m.startswith(o) for o in other_stems)]
    assert len(math_stems) >= 8  # stems only arithmetic templates have
    n_math = sum(any(p.startswith(stem) for stem in math_stems) for p in prompts)
    assert n_math >= 0.8 * len(prompts) / len(KINDS)  # kinds in turn: arithmetic gets (nearly) its full share


def test_word_problems_are_well_posed():
    checked = 0
    for p in synthetic_prompts(800, seed=0):
        m = re.match(r"A shop sells .* for \$(\d+) each\. Maria buys (\d+) and pays with a \$(\d+) bill", p)
        if m:
            price, count, bill = map(int, m.groups())
            assert bill >= price * count, p
            checked += 1
    assert checked >= 3


@pytest.mark.parametrize("n", [0, -1, 2.5, True, "10"])
def test_bad_sizes_are_refused(n):
    with pytest.raises(ValueError, match="synthetic prompts must be an int >= 1"):
        synthetic_prompts(n)


def test_more_than_the_templates_can_make_is_refused():
    with pytest.raises(ValueError, match="distinct synthetic prompts; ask for at most"):
        synthetic_prompts(10**6)


@pytest.mark.parametrize("flag, value", [("--synthetic", "-3"), ("--synthetic", "1000000"), ("--soft-labels", "-1"),
                                         ("--soft-labels", "1")])
def test_cli_refuses_bad_training_data_options_before_loading_the_model(capsys, monkeypatch, flag, value):
    import speccomp.cli as cli

    def no_load(args):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(cli, "_load", no_load)
    assert main(["train-heads", "--kind", "hydra", flag, value, "--prompts", "x.jsonl"]) == 2
    err = capsys.readouterr().err
    assert flag in err or "synthetic" in err
