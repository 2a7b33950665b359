"""Public API contract on a tiny random Llama: equality with HF greedy, stats, bad input, debug dumps."""
import pytest
import torch

import speccomp
from speccomp.frontend.graph import annotate
from tiny_models import tiny_llama


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama()
    return model, speccomp.compile(model)


def hf_greedy(model, ids, n, eos=None):
    # an explicit all-ones mask: otherwise HF infers padding wherever a prompt token equals pad_token_id
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0
    )


def test_greedy_equals_hf(tiny):
    model, fast = tiny
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(1))
    out = fast.generate(ids, max_new_tokens=40)
    assert torch.equal(out, hf_greedy(model, ids, 40))
    stats = fast.last_stats
    assert stats["new_tokens"] == 40 and stats["steps"] == 40 and stats["tau"] == 1.0 and stats["seconds"] > 0


def test_eos_stops_like_hf(tiny):
    model, fast = tiny
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    free = fast.generate(ids, max_new_tokens=20)
    eos = int(free[0, 7 + 5])  # the 6th generated token becomes EOS
    out = fast.generate(ids, max_new_tokens=20, eos_token_id=eos)
    ref = hf_greedy(model, ids, 20, eos)
    assert torch.equal(out, ref)
    assert int(out[0, -1]) == eos and out.shape[1] <= 7 + 6


def test_one_dim_prompt_and_int32_ids_accepted(tiny):
    _, fast = tiny
    ids = torch.arange(5, 12)
    a = fast.generate(ids, max_new_tokens=5)
    b = fast.generate(ids[None].to(torch.int32), max_new_tokens=5)
    assert a.dtype == torch.long and torch.equal(a, b)


def test_sampling_is_seeded(tiny):
    _, fast = tiny
    ids = torch.arange(3, 9)[None]
    a = fast.generate(ids, max_new_tokens=12, do_sample=True, temperature=1.3, top_p=0.9, seed=7)
    b = fast.generate(ids, max_new_tokens=12, do_sample=True, temperature=1.3, top_p=0.9, seed=7)
    c = fast.generate(ids, max_new_tokens=12, do_sample=True, temperature=1.3, top_p=0.9, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(input_ids=torch.rand(1, 4)), TypeError, "integer token ids"),
        (dict(input_ids="1 2 3"), TypeError, "LongTensor"),
        (dict(input_ids=torch.ones(2, 2, 4, dtype=torch.long)), ValueError, r"or a batch \[B, seq\], got shape"),
        (dict(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0, 0]] * 2)),
         ValueError, "attention_mask='row 0': is not left-padded"),
        (dict(input_ids=torch.ones(1, 0, dtype=torch.long)), ValueError, "empty"),
        (dict(input_ids=torch.tensor([[1, 500]])), ValueError, r"must be in \[0, 96\)"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens=0: must be a positive int"),
        (dict(max_new_tokens=-3), ValueError, "max_new_tokens=-3: must be a positive int"),
        (dict(max_new_tokens=2.5), TypeError, "max_new_tokens=2.5: must be an int"),
        (dict(input_ids=torch.ones(1, 250, dtype=torch.long), max_new_tokens=10), ValueError, "exceeds the model's context of 256"),
        (dict(temperature=0.0, do_sample=True), ValueError, "temperature"),
        (dict(top_p=1.5, do_sample=True), ValueError, "top_p"),
    ],
)
def test_bad_generate_input(tiny, kwargs, error, match):
    _, fast = tiny
    call = dict(input_ids=torch.ones(1, 4, dtype=torch.long), max_new_tokens=4)
    call.update(kwargs)
    with pytest.raises(error, match=match):
        fast.generate(**call)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(backend="tpu"), r"backend='tpu': unknown backend; accepted values: \['cudagraphs', 'eager'"),
        (dict(drafter="telepathy"), r"drafter='telepathy': unknown drafter; accepted values"),
        (dict(kv_cache="zip"), r"unknown kv_cache 'zip'"),
    ],
)
def test_bad_compile_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        speccomp.compile(tiny_llama(), **kwargs)


def test_not_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        speccomp.compile("llama")


def test_weights_without_values_or_on_two_devices_are_refused():
    """A model on the meta device (built empty, or offloaded by device_map) cannot run to be captured: named, with
    the fix, before the export (was a raw RuntimeError from inside transformers)."""
    model = tiny_llama()
    model.lm_head.to("meta")
    with pytest.raises(speccomp.OptionError, match=r"model='LlamaForCausalLM': has weights on the meta device "
                                                   r"\(lm_head.weight, ...\).*load the weights first"):
        speccomp.compile(model)
    with pytest.raises(speccomp.OptionError, match="meta device"):
        speccomp.compile(tiny_llama().to("meta"))


def test_inference_mode_weights_are_refused_naming_the_fix():
    """A model built inside torch.inference_mode() failed deep in torch.export ("requires_grad ... inference tensor")."""
    with torch.inference_mode():
        model = tiny_llama()
    with pytest.raises(speccomp.OptionError, match=r"model='LlamaForCausalLM': holds inference-mode parameters .*"
                                                   r"load the model outside inference_mode"):
        speccomp.compile(model)
    model = tiny_llama()  # an inference-mode buffer (a cached table refreshed under inference_mode) exports fine
    with torch.inference_mode():
        model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.clone()
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(speccomp.compile(model).generate(ids, max_new_tokens=4), hf_greedy(model, ids, 4))


@pytest.mark.parametrize("backend", ["eager", "onnxruntime"])
@pytest.mark.parametrize("change", ["in_place", "load_state_dict", "to_bfloat16", "through_data", "assign"])
def test_weights_changed_after_compile_are_refused_not_mixed(backend, change):
    """The eager graph read the model's norms and embeddings live but its linears from copies packed at compile
    (onnxruntime: every weight from its file): after a weight change the text was neither model's. Refused now."""
    model = tiny_llama()
    fast = speccomp.compile(model, backend=backend)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(fast.generate(ids, max_new_tokens=8), hf_greedy(model, ids, 8))
    with torch.no_grad():
        if change == "in_place":
            model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
        elif change == "load_state_dict":
            model.load_state_dict(tiny_llama(initializer_range=0.3).state_dict())
        elif change == "through_data":  # EMA, weight averaging, fused optimizers: no version counter bumped (passed)
            model.model.embed_tokens.weight.data.mul_(1.5)
        elif change == "assign":  # new parameter objects in the model, the graph holding the old ones (passed)
            model.load_state_dict(tiny_llama(initializer_range=0.3).state_dict(), assign=True)
        else:
            model.to(torch.bfloat16)
    with pytest.raises(speccomp.SpeccompError, match=r"weights changed after compile \(model\..*compile it again"):
        fast.generate(ids, max_new_tokens=8)
    if change != "to_bfloat16":  # compiled again: the new weights' own greedy text
        assert torch.equal(speccomp.compile(model, backend=backend).generate(ids, max_new_tokens=8),
                           hf_greedy(model, ids, 8))



def test_generate_inside_autocast_and_copies_of_a_compiled_model():
    """Under the caller's torch.autocast(bfloat16) the eager graph's packed float32 linears met bfloat16 activations
    (a oneDNN error); a copy.copy shared the original's last_stats; deepcopy / pickle failed inside torch."""
    import copy
    import pickle

    model = tiny_llama(initializer_range=0.2)
    fast = speccomp.compile(model, drafter="token_recycling")
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(fast.generate(ids, max_new_tokens=12), hf_greedy(model, ids, 12))
    twin = copy.copy(fast)
    twin.generate(ids, max_new_tokens=5)
    assert twin.last_stats["new_tokens"] == 5 and fast.last_stats["new_tokens"] == 12
    for clone in (copy.deepcopy, pickle.dumps):
        with pytest.raises(speccomp.SpeccompError, match="cannot be deep-copied or pickled.*compile it again"):
            clone(fast)


def test_a_capture_whose_model_was_given_new_parameters_is_refused():
    """compile(capture) after load_state_dict(assign=True) decoded the capture's old weights; capture again."""
    model = tiny_llama()
    captured = speccomp.capture(model)
    model.load_state_dict(tiny_llama(initializer_range=0.3).state_dict(), assign=True)
    with pytest.raises(speccomp.OptionError, match=r"^model='speccomp.capture\(LlamaForCausalLM\)': the model's "
                                                   r"parameters were replaced after this capture.*speccomp.capture"):
        speccomp.compile(captured)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(speccomp.compile(speccomp.capture(model)).generate(ids, max_new_tokens=8), hf_greedy(model, ids, 8))


def test_generation_config_options_speccomp_does_not_apply_are_named():
    """HF's generate applies a checkpoint's repetition_penalty / suppress_tokens / ... by default; speccomp decoded
    without them, silently."""
    import warnings

    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unset: no warning
        fast = speccomp.compile(model)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.suppress_tokens = [5]
    with pytest.warns(UserWarning, match=r"generation_config sets \{'repetition_penalty': 1.3, 'suppress_tokens': "
                                         r"\[5\]\}.*equals HF's generate with these unset"):
        fast = speccomp.compile(model)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    model.generation_config.repetition_penalty, model.generation_config.suppress_tokens = None, None
    assert torch.equal(fast.generate(ids, max_new_tokens=8), hf_greedy(model, ids, 8))
    # a chat checkpoint's sampling defaults (HF's generate() samples with them; speccomp's reads its arguments)
    model.generation_config.temperature = 0.6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # without do_sample HF's generate() decodes greedily too: nothing to say
        speccomp.compile(model)
    model.generation_config.do_sample = True
    with pytest.warns(UserWarning, match=r"generation_config sets do_sample=True, temperature=0.6: HF's generate\(\) "
                                         r"samples with them by default.*pass generate\(\.\.\., do_sample=True, "
                                         r"temperature=0.6\).*top_k=50 tokens"):
        speccomp.compile(model)


def test_structure_found(tiny):
    model, fast = tiny
    s = annotate(fast.graph.captured)
    assert len(s.layers) == 3 and [a.layer for a in s.attention] == [0, 1, 2]
    assert [l.module for l in s.layers] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert s.final_norm == "model.norm" and s.lm_head_module == "lm_head"
    assert all(a.kind == "sdpa" and a.mask is not None for a in s.attention)
    # residual stream is chained: each layer's entry is the previous layer's exit
    for prev, nxt in zip(s.layers, s.layers[1:]):
        assert nxt.entry is prev.exit
    # plain decoding verifies the root alone through the one decode loop: the graph has the tree mask too
    assert [n.name for n in fast.graph.gm.graph.nodes if n.op == "placeholder"] == [
        "input_ids", "position_ids", "attention_mask", "past_kv", "tree_mask"
    ]


def test_eager_attention_model_captured():
    model = tiny_llama(attn_implementation="eager")
    fast = speccomp.compile(model)
    assert {a.kind for a in fast.graph.structure.attention} == {"eager"}
    ids = torch.arange(2, 15)[None]
    assert torch.equal(fast.generate(ids, max_new_tokens=20), hf_greedy(model, ids, 20))


def test_debug_dump(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECCOMP_DEBUG", "1")
    monkeypatch.setenv("SPECCOMP_DEBUG_DIR", str(tmp_path))
    speccomp.compile(tiny_llama())
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files and files[0] == "00_captured.py"
    assert "scaled_dot_product_attention" in (tmp_path / "00_captured.py").read_text()
    assert "[speccomp] 00 captured" in capsys.readouterr().err



def test_debug_dump_shows_a_plain_modules_own_rewrites(tmp_path, monkeypatch):
    """A plain nn.Module's KV rewrites (explicit_kv's four passes) ran outside run_passes: nothing was dumped before
    the rewritten graph, so the passes such a user most needs to see were missing."""
    from test_plain_module import GPTConfig, NanoGPT, _init

    monkeypatch.setenv("SPECCOMP_DEBUG", "1")
    monkeypatch.setenv("SPECCOMP_DEBUG_DIR", str(tmp_path))
    speccomp.compile(_init(NanoGPT(GPTConfig(n_layer=2)), 0))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files[:2] == ["00_captured.py", "01_add_convention_inputs.py"], files
    assert any(f.endswith("+convention_outputs.py") for f in files) and "past_kv" not in (tmp_path / files[0]).read_text()
