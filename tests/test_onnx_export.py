"""The captured graph exports to ONNX and ONNX Runtime reproduces it (backends/onnx_export.py).

Tiny random Llama: names, dynamic axes, greedy decode, errors. SmolLM2-135M's exported graph is
checked in tests/test_real_model.py (one export serves the precision check, the onnxruntime backend's
256-token decode and the torch-free engine).
"""
import sys
import time

import numpy as np
import pytest
import torch

from speccomp.backends.onnx_export import OnnxBackendError, OrtStep, export_onnx
from speccomp.frontend.convention import INPUT_NAMES, OUTPUT_NAMES, example_inputs
from speccomp.frontend.hf import _HFStep
from speccomp.frontend import capture
from speccomp.frontend.graph import SpecGraph
from speccomp.runtime.decode import KVCache

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

ATOL = 1e-4


def _max_diff(got, want):
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


def _assert_close(got, want, what, atol=ATOL):
    assert len(got) == len(want) == 3
    for name, g, w in zip(OUTPUT_NAMES, got, want):
        assert g.shape == w.shape, f"{what}: {name} shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert g.dtype == w.dtype, f"{what}: {name} dtype {g.dtype} != {w.dtype}"
        tol = atol[name] if isinstance(atol, dict) else atol
        diff = float((g - w).abs().max())
        assert diff <= tol, f"{what}: {name} differs by {diff:.3g} > {tol}"


def _prefill_then_decode(step, model_step, graph, ids, atol=ATOL):
    """`graph` is the CapturedModel. Prefill `ids` (past = 0), then one decode step with the prefill's KV; compare all three."""
    n = ids.shape[1]
    pos, mask = torch.arange(n)[None], torch.ones(1, n, dtype=torch.long)
    kv = graph.kv
    past = torch.zeros(kv.shape(0), dtype=kv.dtype)
    with torch.no_grad():
        want = graph.graph_module(ids, pos, mask, past)
        model = model_step(ids, pos, mask, past)
    got = step(ids, pos, mask, past)
    _assert_close(got, want, "prefill ORT vs graph", atol)
    _assert_close(got, model, "prefill ORT vs model", atol)
    diffs = {"prefill": _max_diff(got[:1], want[:1])}

    token = want[0][:, -1:].argmax(-1)  # [1, 1]
    args = (token, torch.tensor([[n]]), torch.ones(1, n + 1, dtype=torch.long), want[1])
    with torch.no_grad():
        want_d = graph.graph_module(*args)
        model_d = model_step(*args)
    got_d = step(*args)
    _assert_close(got_d, want_d, "decode ORT vs graph", atol)
    _assert_close(got_d, model_d, "decode ORT vs model", atol)
    diffs["decode"] = _max_diff(got_d[:1], want_d[:1])
    diffs["kv"] = max(_max_diff(got[1:2], want[1:2]), _max_diff(got_d[1:2], want_d[1:2]))
    return diffs


# --------------------------------------------------------------------------------------
# Tiny Llama
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import tiny_llama

    model = tiny_llama()
    captured = capture(model)
    path = tmp_path_factory.mktemp("onnx_tiny") / "tiny.onnx"
    start = time.perf_counter()
    # from a SpecGraph (what passes hand over), weights as external data next to the file
    out = export_onnx(SpecGraph.from_captured(captured), path, external_data=True)
    seconds = time.perf_counter() - start
    print(f"\n[onnx] tiny llama export: {seconds:.1f}s", file=sys.stderr)
    return model, captured, out, OrtStep(out)


def test_tiny_file_names_and_dynamic_axes(tiny):
    _, captured, path, step = tiny
    assert path.exists() and path.with_name(path.name + ".data").exists(), "external data should sit next to the .onnx"
    proto = onnx.load(str(path), load_external_data=False)
    onnx.checker.check_model(str(path))

    def dims(v):
        return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]

    kv = captured.kv
    assert [i.name for i in proto.graph.input] == list(INPUT_NAMES)
    assert [o.name for o in proto.graph.output] == list(OUTPUT_NAMES)
    ins = {i.name: dims(i) for i in proto.graph.input}
    outs = {o.name: dims(o) for o in proto.graph.output}
    assert ins["input_ids"] == [1, "q"] and ins["position_ids"] == [1, "q"]
    assert ins["attention_mask"] == [1, "past_plus_q"]
    assert ins["past_kv"] == [kv.num_layers, 2, 1, kv.num_kv_heads, "past", kv.head_dim]
    assert outs["logits"] == [1, "q", captured.vocab_size]
    assert outs["new_kv"] == [kv.num_layers, 2, 1, kv.num_kv_heads, "q", kv.head_dim]
    assert outs["hidden"][:2] == [1, "q"]
    assert step.input_names == list(INPUT_NAMES) and step.output_names == list(OUTPUT_NAMES)


def test_tiny_prefill_and_decode_match_graph_and_model(tiny):
    model, captured, _, step = tiny
    ids = torch.randint(0, captured.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    diffs = _prefill_then_decode(step, _HFStep(model).eval(), captured, ids)
    print(f"\n[onnx] tiny max |logits diff| ORT vs graph: {diffs}", file=sys.stderr)


@pytest.mark.parametrize("q,past", [(1, 0), (2, 0), (1, 1), (5, 9), (16, 40), (33, 3)])
def test_tiny_dynamic_axes_are_dynamic(tiny, q, past):
    """Sizes never seen at export (export used q=3, past=7), including q=1 and past=0."""
    model, captured, _, step = tiny
    args = example_inputs(captured.kv, q, past, vocab_size=captured.vocab_size)
    with torch.no_grad():
        want = _HFStep(model).eval()(*args)  # the model, not the graph: its guard refuses q + past == 1
    _assert_close(step(*args), want, f"q={q} past={past}")


def test_tiny_numpy_inputs_and_padding_mask(tiny):
    _, captured, _, step = tiny
    ids, pos, mask, past = example_inputs(captured.kv, 4, 6, vocab_size=captured.vocab_size)
    mask[0, 2] = 0  # a padded cache slot must be masked the same way
    with torch.no_grad():
        want = captured.graph_module(ids, pos, mask, past)
    got = step(ids.numpy(), pos.numpy(), mask.numpy(), past.numpy())
    assert all(isinstance(g, torch.Tensor) for g in got)
    _assert_close(got, want, "numpy inputs, padded mask")
    # a non-contiguous past (the runtime passes a view of its preallocated cache)
    big = torch.randn(*captured.kv.shape(10))
    big[..., :6, :] = past
    _assert_close(step(ids, pos, mask, big[..., :6, :]), want, "non-contiguous past_kv")


def greedy(step, kv, prompt, n):
    """n greedy tokens through a graph with the captured convention (no tree mask): one token per forward."""
    cache, tokens, out = KVCache(kv, prompt.shape[1] + n), prompt, []
    for _ in range(n):
        start = cache.length
        with torch.no_grad():
            logits, new_kv, _ = step(tokens, torch.arange(start, start + tokens.shape[1])[None],
                                     torch.ones(1, start + tokens.shape[1], dtype=torch.long), cache.past())
        cache.append(new_kv)
        out.append(int(logits[0, -1].argmax()))
        tokens = torch.tensor([[out[-1]]])
    return out


def test_tiny_greedy_decode_through_ort_equals_graph(tiny):
    _, captured, _, step = tiny
    prompt = torch.randint(0, captured.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    want = greedy(captured.graph_module, captured.kv, prompt, 16)
    assert greedy(step, captured.kv, prompt, 16) == want and len(want) == 16


def test_export_leaves_the_graph_untouched(tiny):
    _, captured, _, _ = tiny
    gm = captured.graph_module
    assert any(n.op == "call_module" for n in gm.graph.nodes), "capture's _guards_fn call should still be there"
    args = example_inputs(captured.kv, 2, 3, vocab_size=captured.vocab_size)
    with torch.no_grad():
        gm(*args)


def test_bare_graph_module_needs_kv_spec(tiny, tmp_path):
    _, captured, _, _ = tiny
    with pytest.raises(TypeError, match="kv_spec"):
        export_onnx(captured.graph_module, tmp_path / "x.onnx")
    with pytest.raises(TypeError, match="SpecGraph, CapturedModel or torch.fx.GraphModule"):
        export_onnx(object(), tmp_path / "x.onnx")


def test_missing_execution_provider_is_named(tiny):
    _, _, path, _ = tiny
    with pytest.raises(OnnxBackendError, match="CUDAExecutionProvider.*onnxruntime-gpu"):
        OrtStep(path, providers=["CUDAExecutionProvider"])
    with pytest.raises(OnnxBackendError, match="'NoSuchExecutionProvider' is not available"):
        OrtStep(path, providers=["NoSuchExecutionProvider"])


def test_missing_onnxruntime_says_what_to_install(tiny, monkeypatch):
    _, _, path, _ = tiny
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` raise ImportError
    with pytest.raises(OnnxBackendError, match="pip install onnxruntime"):
        OrtStep(path)


def test_wrong_number_of_inputs(tiny):
    _, captured, _, step = tiny
    ids, pos, mask, _ = example_inputs(captured.kv, 1, 0)
    with pytest.raises(TypeError, match="takes 4 inputs"):
        step(ids, pos, mask)
    assert np.issubdtype(np.dtype(step.input_types[0]), np.integer)


# SmolLM2-135M: tests/test_real_model.py checks the onnxruntime backend's exported graph against a float64
# run of the model (prefill logits) and decodes 256 tokens through it and through its engine.


def test_a_transposed_tied_weight_is_folded_so_the_lm_head_quantises(tmp_path):
    """The exporter writes a tied LM head as MatMul(h, Transpose(W)) with W also the embedding's Gather table; the
    4-bit quantizer takes only constant weights, so the head stayed float32. fold_transposed_weights gives the MatMul
    its own W.T (the Gather keeps W); quantize_weights then turns it into MatMulNBits of 4 or 8 bits with the same outputs as the
    float graph within their error (8 bits: 16 times finer), and the orphaned Transpose is gone."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from speccomp.backends.onnx_export import fold_transposed_weights, quantize_weights

    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)  # [vocab, hidden]
    graph = helper.make_graph(
        [helper.make_node("Gather", ["W", "ids"], ["h"]), helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
         helper.make_node("MatMul", ["h", "Wt"], ["logits"])], "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [3, 64])], [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "tied.onnx"
    onnx.save(model, str(path))
    folded = onnx.load(str(path))
    assert fold_transposed_weights(folded.graph) == 1
    assert [n.op_type for n in folded.graph.node] == ["Gather", "MatMul"]
    ids = np.array([1, 5, 9])
    want = ort.InferenceSession(str(path)).run(None, {"ids": ids})[0]
    errors = {}
    for bits in (4, 8):
        out = quantize_weights(path, bits=bits)
        assert out.name == f"tied-int{bits}.onnx"
        quantized = onnx.load(str(out))
        assert sorted(n.op_type for n in quantized.graph.node) == ["Gather", "MatMulNBits"]
        node = next(n for n in quantized.graph.node if n.op_type == "MatMulNBits")
        assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["bits"] == bits
        got = ort.InferenceSession(str(out)).run(None, {"ids": ids})[0]
        errors[bits] = np.abs(got - want).max() / np.abs(want).max()
    assert errors[4] < 0.1 and errors[8] < 0.01 and errors[8] < errors[4] / 4, errors
    with pytest.raises(OnnxBackendError, match="bits=3: MatMulNBits weights are 4 or 8 bits"):
        quantize_weights(path, bits=3)


def test_a_linear_written_as_gemm_quantises_too(tmp_path):
    """A linear with a bias over 2-D input (GPT-2's Conv1D, OPT's MLP) exports as Gemm, which the quantizer does not
    take: a "quantized" GPT-2 drafter kept every weight but the LM head in float32. split_constant_gemms makes it a
    MatMul (+ Add for the bias), W transposed where Gemm read it so; the outputs stay the float graph's. A Gemm that
    scales or reads a transposed input is left alone."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from speccomp.backends.onnx_export import quantize_weights, split_constant_gemms

    rng = np.random.default_rng(0)
    w, wt, b = (rng.standard_normal(s).astype(np.float32) for s in ((32, 48), (48, 48), (48,)))
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"]), helper.make_node("Gemm", ["y", "Wt"], ["z"], transB=1),
         helper.make_node("Gemm", ["z", "Wt", "b"], ["out"], transB=1, alpha=0.5)], "linears",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 32])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3, 48])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(wt, "Wt"), numpy_helper.from_array(b, "b")])
    path = tmp_path / "linears.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    split = onnx.load(str(path))
    assert split_constant_gemms(split.graph) == 2
    assert [n.op_type for n in split.graph.node] == ["MatMul", "Add", "MatMul", "Gemm"]
    x = {"x": rng.standard_normal((3, 32)).astype(np.float32)}
    want = ort.InferenceSession(str(path)).run(None, x)[0]
    onnx.save(split, str(tmp_path / "split.onnx"))
    assert np.allclose(ort.InferenceSession(str(tmp_path / "split.onnx")).run(None, x)[0], want, atol=1e-5)
    out = quantize_weights(path, bits=8)
    assert [n.op_type for n in onnx.load(str(out)).graph.node] == ["MatMulNBits", "Add", "MatMulNBits", "Gemm"]
    got = ort.InferenceSession(str(out)).run(None, x)[0]
    assert np.abs(got - want).max() / np.abs(want).max() < 0.02
