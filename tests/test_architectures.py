"""Architecture breadth: every tiny `*ForCausalLM` in tiny_models.ARCHITECTURES must compile, be found
by `annotate`, and decode token-for-token like Hugging Face's own greedy `generate`.

Sliding-window models decode past their window (prompt 12 + 40 new tokens, window 8): the runtime
keeps a full cache and relies on the sliding mask HF builds from positions, while HF's `generate`
uses its own sliding caches, so equality checks the window is applied. `test_sliding_window_logits`
checks the same at the logit level (where a near-repetitive greedy output could hide a window
bug) and that the window changes the result at all.
"""
from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHITECTURES, UNSUPPORTED, WINDOW, captured, seeded_prompt, hf_greedy_with_margin as hf_greedy

import speccomp
from speccomp.frontend.graph import annotate
from speccomp.runtime.decode import FullCache
from speccomp.runtime.tree import Tree

PROMPT_LEN, NEW_TOKENS = 12, 40
MIN_MARGIN = 1e-2  # top-1 minus top-2 logit along HF's greedy path: the seeds in tiny_models give at least this
NAMES = list(ARCHITECTURES)
SLIDING = [n for n in NAMES if ARCHITECTURES[n].sliding_window]
assert PROMPT_LEN + NEW_TOKENS > 2 * WINDOW

_compiled: dict[str, tuple[torch.nn.Module, speccomp.SpecModel]] = {}


def compiled(name: str):
    """(HF model, speccomp model) for an architecture, compiled once per session (from the session's capture)."""
    if name not in _compiled:
        model, cap = captured(name)
        _compiled[name] = (model, speccomp.compile(cap))
    return _compiled[name]


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_generate_matches_hf(name):
    model, fast = compiled(name)
    prompt = seeded_prompt(PROMPT_LEN, model.config.vocab_size)
    want, margin = hf_greedy(model, prompt, NEW_TOKENS)
    assert margin >= MIN_MARGIN, f"{name}: HF's greedy path has a near-tie ({margin:.2e}); pick another seed"
    got = fast.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert want.shape == (1, PROMPT_LEN + NEW_TOKENS)
    assert torch.equal(got, want), f"{name}:\n speccomp {got[0, PROMPT_LEN:].tolist()}\n hf       {want[0, PROMPT_LEN:].tolist()}"


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_graph_structure(name):
    arch = ARCHITECTURES[name]
    model, fast = compiled(name)
    st = annotate(fast.graph.captured)
    n_layers = model.config.num_hidden_layers
    assert len(st.layers) == n_layers
    assert [s.layer for s in st.attention] == list(range(n_layers)), "one attention site per cache layer"
    assert {s.kind for s in st.attention} == {arch.attention}
    assert all(s.mask is not None for s in st.attention)
    # every attention site lives in its own decoder block
    assert [s.module.startswith(layer.module + ".") for s, layer in zip(st.attention, st.layers)] == [True] * n_layers
    assert len({layer.module for layer in st.layers}) == n_layers
    windows = [s.sliding_window for s in st.attention]
    assert windows == [arch.sliding_window if i in arch.sliding_layers else None for i in range(n_layers)]
    # one entry a sliding layer (Gemma3's decoder blocks carry layer_idx too: counted twice in messages and manifests)
    assert len(fast.graph.captured.sliding_windows) == len(arch.sliding_layers)
    # LM head: the linear that makes the logits, reading the model's output embedding matrix
    assert st.lm_head is not None and st.lm_head_module
    head_weight = st.lm_head.args[1]
    assert head_weight.op == "get_attr" and tuple(head_weight.meta["val"].shape) == tuple(
        model.get_output_embeddings().weight.shape
    )
    assert st.final_norm
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == arch.tied, f"{name}: registry says tied={arch.tied}, model is tied={tied}"
    assert (st.embedding.args[0] is head_weight) == tied, "tied embeddings share one weight node with the LM head"


@pytest.mark.parametrize("name", SLIDING, ids=SLIDING)
def test_sliding_window_logits(name):
    """Logits along a sequence 5 windows long: decoding step by step (and a 4-token verify-shaped step)
    past the window must match HF's full forward, and differ from the same weights without a window."""
    model, fast = compiled(name)
    n = 40
    seq = seeded_prompt(n, model.config.vocab_size)
    target = FullCache(fast.step, fast.kv, n, "cpu")  # the decode loop's verifier: chains of q tokens past the prompt
    got = [target.prefill(seq[:, :PROMPT_LEN])[0][0]]
    chunks = [(i, i + 1) for i in range(PROMPT_LEN, 24)] + [(24, 28)] + [(i, i + 1) for i in range(28, n)]
    for a, b in chunks:
        got.append(target.verify(seq[0, a:b], Tree.chain(b - a - 1) if b - a > 1 else Tree.from_parents([-1]))[0][0])
        target.commit(list(range(b - a)))
    got = torch.cat(got)
    with torch.no_grad():
        want = model(seq, attention_mask=torch.ones_like(seq)).logits[0]
        unwindowed = ARCHITECTURES[name].build(sliding_window=255)(seq, attention_mask=torch.ones_like(seq)).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.allclose(unwindowed[:WINDOW], want[:WINDOW], atol=1e-4), "the window must not matter inside it"
    assert (unwindowed[2 * WINDOW:] - want[2 * WINDOW:]).abs().max() > 1e-2, "the window must matter past it"


def test_layer_types_decide_which_layers_slide():
    """HF builds each layer's mask from config.layer_types and config.sliding_window. SmolLM3 with a sliding
    layer in layer_types but use_sliding_window=False sets no window on the module, yet HF slides that layer: the
    window was missed, the tree's tokens saw keys HF hides, and token_recycling decoded other tokens than HF (plain
    decoding, reading HF's own mask, was right). EXAONE 4's global layers (ARCHITECTURES["exaone4"]) are the
    converse: a module window on a layer that does not slide."""
    model = ARCHITECTURES["smollm3"].build(use_sliding_window=False, layer_types=["sliding_attention", "full_attention",
                                                                                "full_attention"])
    assert [getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers] == [None] * 3
    fast = speccomp.compile(model, drafter="token_recycling")
    assert [s.sliding_window for s in annotate(fast.graph.captured).attention] == [WINDOW, None, None]
    prompt = seeded_prompt(PROMPT_LEN, model.config.vocab_size)
    want, margin = hf_greedy(model, prompt, NEW_TOKENS)
    assert margin >= MIN_MARGIN
    assert torch.equal(fast.generate(prompt, max_new_tokens=NEW_TOKENS), want)
    assert fast.last_stats["steps"] < NEW_TOKENS  # drafts were accepted: trees were verified past the window


def test_a_multimodal_models_windows_come_from_its_text_config():
    """An image-text model (*ForConditionalGeneration) keeps layer_types, sliding_window and its context length in its
    text_config: read from the outer config, EXAONE 4.5's global layer got its module's window (every decode wrong),
    Mistral3's windows were missed (trees wrong) and no context limit was set. Here EXAONE 4.5, text layers
    sliding / full / sliding."""
    import transformers

    text = dict(model_type="exaone4", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, initializer_range=0.5, sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, num_key_value_heads=2, out_hidden_size=32,
                  fullatt_block_indexes=[0])
    torch.manual_seed(0)
    model = transformers.Exaone4_5_ForConditionalGeneration(transformers.Exaone4_5_Config(
        text_config=text, vision_config=vision, image_token_id=127, video_token_id=126)).eval()
    fast = speccomp.compile(model, drafter="token_recycling")
    assert [s.sliding_window for s in annotate(fast.graph.captured).attention] == [WINDOW, None, WINDOW]
    assert fast.graph.captured.max_positions == 256  # the context limit too (it was None: no limit enforced)
    prompt = torch.randint(3, 120, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # (the outer config has no pad_token_id for hf_greedy to read)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) >= MIN_MARGIN
    assert torch.equal(fast.generate(prompt, max_new_tokens=NEW_TOKENS), out.sequences)
    assert fast.last_stats["steps"] < NEW_TOKENS


def test_single_token_prompt():
    """A 1-token prompt (past + q == 1) runs through the same graph as longer ones."""
    model, fast = compiled("llama")
    prompt = seeded_prompt(1, model.config.vocab_size)
    want, _ = hf_greedy(model, prompt, 5)
    assert torch.equal(fast.generate(prompt, max_new_tokens=5), want)


def test_longrope_decodes_up_to_its_switch_and_refuses_past_it():
    """Phi3's longrope changes its factors once the sequence passes original_max_position_embeddings, and HF then
    recomputes the whole cache: speccomp, keeping its cache, decoded other tokens from there on (every drafter, and
    a batch's long row switched its short rows). The context now ends at the switch (a warning says so)."""
    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [1.0, 2.0, 4.0, 8.0],
            "original_max_position_embeddings": 20, "rope_theta": 10000.0}
    model = ARCHITECTURES["phi3"].build(rope_parameters=rope, sliding_window=None, original_max_position_embeddings=20)
    with pytest.warns(UserWarning, match="longrope.*limited to 20 positions"):
        fast = speccomp.compile(model, drafter="ngram")
    prompt = seeded_prompt(12, model.config.vocab_size)
    want, _ = hf_greedy(model, prompt, 8)
    assert torch.equal(fast.generate(prompt, max_new_tokens=8), want)
    with pytest.raises(speccomp.OptionError, match="context of 20 positions"):
        fast.generate(prompt, max_new_tokens=9)


UNSUPPORTED_NAMES = list(UNSUPPORTED)


@pytest.mark.parametrize("name", UNSUPPORTED_NAMES, ids=UNSUPPORTED_NAMES)
def test_unsupported_model_raises(name):
    build, words = UNSUPPORTED[name]
    model = build()
    with pytest.raises(speccomp.UnsupportedModelError) as info:
        speccomp.compile(model)
    message = str(info.value).lower()
    assert all(w in message for w in words), f"{name}: message should name {words}: {info.value}"


def test_the_capture_check_scales_its_tolerance_with_the_outputs_magnitude():
    """The graph-vs-model check must refuse a wrong branch (an O(1) difference) but not float32 rounding of large
    values: on an H200 a real SmolLM2's logits (up to ~30) differed by 1.7e-4 between the graph and the model, two
    kernel choices for one matmul, and a fixed atol of 1e-4 refused the model."""
    from types import SimpleNamespace

    from speccomp.errors import UnsupportedModelError
    from speccomp.frontend.convention import check_outputs

    want = (torch.linspace(-30, 30, 101), torch.zeros(3), torch.ones(4))  # logits pass through 0 at index 50
    rounding = (want[0] + 2e-4, *want[1:])
    check_outputs(SimpleNamespace(model_type="llama"), rounding, want, 1e-4, "model", "q=1", "why")
    wrong = (want[0].clone(), *want[1:])
    wrong[0][50] += 0.5
    with pytest.raises(UnsupportedModelError, match=r"disagrees with the model on `logits` for q=1 \(max diff 0\.5"):
        check_outputs(SimpleNamespace(model_type="llama"), wrong, want, 1e-4, "model", "q=1", "why")
    masked = (torch.tensor([float("-inf"), 1.0, 2.0]), *want[1:])  # a -inf mask value does not widen the tolerance
    with pytest.raises(UnsupportedModelError, match="on `logits`"):
        check_outputs(SimpleNamespace(model_type="llama"), (torch.tensor([float("-inf"), 5.0, 2.0]), *want[1:]),
                      masked, 1e-4, "model", "q=1", "why")


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_static_whole_cache_form_matches_hf(name):
    """backends/cudagraphs.py's static form (the whole cache read, its free slots masked, tokens padded to power-of-two
    widths), here without graphs: every family's own masks and positions (causal, windows, learned or rotary
    positions) must keep it exact, trees included."""
    from speccomp.backends.cudagraphs import GraphedStep

    model, cap = captured(name)
    fast = speccomp.compile(cap, drafter="token_recycling", tree=[[0], [1], [0, 0]])
    fast.step = GraphedStep(fast.step, capture=False)
    prompt = seeded_prompt(PROMPT_LEN, model.config.vocab_size)
    want, _ = hf_greedy(model, prompt, NEW_TOKENS)
    assert torch.equal(fast.generate(prompt, max_new_tokens=NEW_TOKENS), want)
    widths = {width for width, _ in fast.step.seen}
    assert 16 in widths and any(1 < w < 16 for w in widths), f"the prefill and tree steps ran in the static form: {widths}"
