"""backend="onnxruntime": the exported graphs run in ONNX Runtime and decode exactly like the model."""
import pytest
import torch

import speccomp
from tiny_models import ARCHITECTURES, tiny_llama

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


def hf_greedy(model, ids, n, eos=2):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(num_hidden_layers=4, initializer_range=0.2)


@pytest.mark.parametrize("drafter, tree", [(None, None), ("token_recycling", None), ("layer_skip", "dynamic:6:2"),
                                           ("early_exit", [[0], [1], [0, 0]])])
def test_onnxruntime_greedy_identical(llama, drafter, tree, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCOMP_ONNX_DIR", str(tmp_path))
    options = {"skip": [1, 2]} if drafter == "layer_skip" else {"exit_layer": 2} if drafter == "early_exit" else None
    fast = speccomp.compile(llama, drafter=drafter, tree=tree, backend="onnxruntime", drafter_options=options)
    from speccomp.backends.onnx_export import OrtStep

    assert isinstance(fast.step, OrtStep)
    assert list(tmp_path.glob("*/*.onnx")), "the exported engine files are where SPECCOMP_ONNX_DIR says"
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(3, 96, (6,), generator=g)
        ids = base.repeat(3)[None]  # repetitive: drafts get accepted
        out = fast.generate(ids, max_new_tokens=30, eos_token_id=2)
        assert torch.equal(out, hf_greedy(llama, ids, 30)), (drafter, seed)
    if drafter in ("layer_skip", "early_exit"):
        assert isinstance(fast.drafter.step, OrtStep)  # the drafter graph runs in ONNX Runtime too
    if drafter == "token_recycling":  # host-side torch ops run on one thread while ORT runs the graphs
        threads, step, before = [], fast.step, torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            fast.step = lambda *args: threads.append(torch.get_num_threads()) or step(*args)
            fast.generate(ids, max_new_tokens=8, eos_token_id=2)
            assert set(threads) == {1} and torch.get_num_threads() == 2  # one inside, restored after
        finally:
            fast.step = step
            torch.set_num_threads(before)


def test_onnxruntime_sliding_window_past_the_window(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCOMP_ONNX_DIR", str(tmp_path))
    model = ARCHITECTURES["mistral"].build()
    fast = speccomp.compile(model, drafter="token_recycling", backend="onnxruntime")
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    out = fast.generate(ids, max_new_tokens=30, eos_token_id=2)  # 42 tokens, window 8
    assert torch.equal(out, hf_greedy(model, ids, 30))


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="onnxruntime"):
        speccomp.compile(tiny_llama(), backend="onnx-runtime")


@pytest.mark.parametrize("backend", ["onnxruntime", "onnxruntime:cuda"])
def test_a_model_off_the_cpu_is_refused_before_export(backend):
    """ONNX export traces on the CPU and ONNX Runtime's provider places the graph: a model compiled on another device
    (meta standing in for a GPU) is refused naming the backend, the device and the fix, before any export."""
    from speccomp.backends import lower
    from speccomp.errors import OptionError
    from speccomp.frontend.graph import SpecGraph

    sg = SpecGraph.from_captured(speccomp.capture(tiny_llama()))
    sg.gm.to("meta")
    with pytest.raises(OptionError, match=rf"backend='{backend}': exports the model from the CPU; this model is on "
                                          r"meta; compile model.cpu\(\)"):
        lower(sg, backend)


def test_a_bfloat16_model_is_refused_before_export():
    """ONNX Runtime's CPU provider has no bfloat16 Mul or MatMul: such a model failed when its session loaded, after
    the whole export. Refused before it, naming the fix (float16 runs: greedy equal to HF's float16 text)."""
    with pytest.raises(speccomp.OptionError, match=r"backend='onnxruntime': ONNX Runtime's CPU provider has no "
                                                   r"bfloat16 kernels.*model.float\(\)"):
        speccomp.compile(tiny_llama().to(torch.bfloat16), backend="onnxruntime")
    model = tiny_llama(initializer_range=0.2).to(torch.float16)
    ids = torch.arange(5, 17)[None]
    out = speccomp.compile(model, backend="onnxruntime").generate(ids, max_new_tokens=10, eos_token_id=2)
    assert torch.equal(out, hf_greedy(model, ids, 10))


def test_an_op_onnx_cannot_lower_is_named_with_the_backends_that_run_it():
    """Mixtral's MoE experts are transformers' custom grouped_mm op, which torch.onnx has no function for: the error
    said only "Failed to convert the exported program to an ONNX model. This is step 3/3 ... Next steps:". It now
    names the op and the backends that run it."""
    from speccomp.errors import SpeccompError

    with pytest.raises(SpeccompError, match=r"torch.onnx.export failed on the captured graph: Failed to convert the "
                       r"exported program to an ONNX model: DispatchError: No ONNX function found .*"
                       r"the graph calls transformers\.grouped_mm_fallback.*backend='eager' or 'inductor'"):
        speccomp.compile(ARCHITECTURES["mixtral"].build(), backend="onnxruntime")


def test_kept_onnx_files_of_two_models_never_share_a_folder(tmp_path, monkeypatch):
    """With SPECCOMP_ONNX_DIR set, every graph of a pass name went to one folder and file: a second model compiled
    after the first overwrote its files, and the first model's export shipped the second's weights (wrong text)."""
    import numpy as np

    monkeypatch.setenv("SPECCOMP_ONNX_DIR", str(tmp_path / "keep"))
    a, b = tiny_llama(initializer_range=0.2), tiny_llama(initializer_range=0.3)
    fast_a = speccomp.compile(a, backend="onnxruntime")
    fast_b = speccomp.compile(b, backend="onnxruntime")
    assert fast_a.step.path != fast_b.step.path and fast_a.step.path.parent.parent == tmp_path / "keep"
    engine = speccomp.load(fast_a.export(tmp_path / "a"))
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    assert np.array_equal(engine.generate(ids.numpy(), max_new_tokens=12), hf_greedy(a, ids, 12).numpy())
