"""The cache written in place (issue 22, item 1): eager's InPlaceKV and ONNX Runtime's fused attention.

Golden structure of the rewritten graphs, numerics against the unrewritten graph, the buffer really written
(this step's entries at slots [past, past + q), nothing else touched), the fallbacks for a past that is not the
runtime's buffer, and greedy decoding identical to the model's own.
"""
import gc
import weakref

import pytest
import torch

import speccomp
from speccomp.errors import UnsupportedModelError
from speccomp.frontend import capture
from speccomp.frontend.convention import KV_ROOM
from speccomp.frontend.graph import SpecGraph, run_passes
from speccomp.passes.grouped_query_attention import GroupedQueryAttention
from speccomp.passes.inplace_kv import InPlaceKV, extend_in_place
from speccomp.passes.ort_attention import OrtAttention, group_query_attention
from speccomp.passes.tree_attention import TreeAttention
from speccomp.runtime.tree import Tree
from tiny_models import ARCHITECTURES, tiny_llama

aten = torch.ops.aten
TREE = Tree.from_choices([[0], [1], [0, 0], [1, 0]])  # node 3 sees node 1, not node 2


def step_inputs(past: int, q: int, seed=0):
    """A tiny_llama step: q tokens after `past` cached ones (3 layers, 2 KV heads of 8)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (1, q), generator=g)
    past_kv = torch.randn(3, 2, 1, 2, past, 8, generator=g)
    return ids, torch.arange(past, past + q)[None], torch.ones(1, past + q, dtype=torch.long), past_kv


def tree_inputs(past: int, seed=0):
    ids, _, mask, past_kv = step_inputs(past, TREE.size, seed)
    return ids, TREE.positions(past), mask, past_kv


class Owner:
    def __init__(self, length: int):
        self.length = length


def room_buffer(past_kv, extra: int):
    """The runtime's kind of buffer: past_kv in its first slots (in use), `extra` free slots after."""
    buf = torch.zeros(*past_kv.shape[:4], past_kv.shape[4] + extra, past_kv.shape[5])
    buf.owner = Owner(past_kv.shape[4])  # kept alive by the buffer (the runtime's KVCache owns its buffer)
    setattr(buf, KV_ROOM, weakref.ref(buf.owner))
    buf[..., : past_kv.shape[4], :] = past_kv
    return buf


@pytest.fixture(scope="module")
def tree_graph():
    return run_passes(SpecGraph.from_captured(capture(tiny_llama())), [TreeAttention()])


def fused_step(sg, ids, pos, mask, past_kv):
    """One step of an OrtAttention graph (3 layers) over a runtime-style buffer holding past_kv, room for TREE."""
    buf = room_buffer(past_kv, TREE.size)
    return sg.gm(ids, pos, mask, TREE.mask, *[buf[l, kv] for l in range(3) for kv in range(2)])


def test_inplace_kv_golden_structure_numerics_and_writes():
    plain = SpecGraph.from_captured(capture(tiny_llama()))
    sg = run_passes(plain.clone(), [InPlaceKV(), GroupedQueryAttention()])
    writes = [n for n in sg.gm.graph.nodes if n.target is extend_in_place]
    assert len(writes) == 6  # K and V of 3 layers; no cat(past, new) is left
    assert sg.op_counts().get("aten.cat.default", 0) == plain.op_counts()["aten.cat.default"] - 6
    assert {s.key_cat for s in sg.structure.attention} | {s.value_cat for s in sg.structure.attention} == set(writes)
    for past, q in [(0, 4), (7, 1), (9, 3)]:
        ids, pos, mask, past_kv = step_inputs(past, q)
        want = plain.gm(ids, pos, mask, past_kv)
        for a, b in zip(want, sg.gm(ids, pos, mask, past_kv)):  # a plain tensor: the cat, same values
            assert torch.equal(a, b)
        buf = room_buffer(past_kv, q + 5)
        got = sg.gm(ids, pos, mask, buf[..., :past, :])
        for a, b in zip(want, got):
            assert torch.equal(a, b)
        assert torch.equal(buf[..., past : past + q, :], got[1])  # this step's entries, written in place
        assert torch.equal(buf[..., :past, :], past_kv) and not buf[..., past + q :, :].any()  # nothing else


def _from_slot_1(buf):
    buf.owner.length = 0
    return buf[..., 1:7, :][1, 0]


def test_extend_in_place_takes_the_cat_unless_the_buffer_has_room():
    past_kv = torch.randn(2, 2, 1, 2, 6, 4)
    new = torch.randn(1, 2, 3, 4)
    want = torch.cat([past_kv[1, 0], new], 2)
    buf = room_buffer(past_kv, 3)
    full = extend_in_place(buf[..., :6, :][1, 0], new)
    assert torch.equal(full, want) and full.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    cases = {
        "no flag": past_kv[..., :6, :][1, 0],
        "no room": room_buffer(past_kv, 2)[..., :6, :][1, 0],
        "slots in use after the view": room_buffer(torch.cat([past_kv, past_kv], 4), 8)[..., :6, :][1, 0],
        "view not at slot 0": _from_slot_1(room_buffer(torch.cat([past_kv, past_kv], 4), 8)),
    }
    for name, past in cases.items():
        before = past._base.clone() if past._base is not None else None
        out = extend_in_place(past, new)
        assert torch.equal(out, torch.cat([past, new], 2)), name
        assert before is None or torch.equal(past._base, before), name  # the buffer was not written


def test_ort_attention_golden_structure_and_numerics(tree_graph):
    sg = run_passes(tree_graph.clone(), [GroupedQueryAttention(), OrtAttention()])
    layers = [f"past_{kv}_{l}" for l in range(3) for kv in ("key", "value")]
    assert sg.input_names() == ["input_ids", "position_ids", "attention_mask", "tree_mask", *layers]
    ops = sg.op_counts()
    assert ops.get("aten.scaled_dot_product_attention.default", 0) == 0
    assert ops["aten.cat.default"] == tree_graph.op_counts()["aten.cat.default"] - 6  # no cat(past, new) left
    assert [n.target.__name__ for n in sg.gm.graph.nodes if n.op == "call_function"].count("fused_attention") == 3
    assert len(sg.gm.graph.output_node().args[0]) == 3 + 6  # logits, new_kv, hidden + present_<kv>_<l>
    for past in (0, 11):
        ids, pos, mask, past_kv = tree_inputs(past)
        want = tree_graph.gm(ids, pos, mask, past_kv, TREE.mask)
        got = fused_step(sg, ids, pos, mask, past_kv)
        for a, b in zip(want, got[:3]):  # the same math, the scale moved onto the queries (head_dim 8: 8 ** -0.5
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # is not a power of two, so it rounds a little apart)
        presents = torch.stack([torch.stack(got[3 + 2 * l : 5 + 2 * l]) for l in range(3)])
        torch.testing.assert_close(presents[..., past : past + TREE.size, :], want[1], rtol=0, atol=1e-5)  # at past..
        assert torch.equal(presents[0, ..., past : past + TREE.size, :], want[1][0])  # layer 0's: before any rounding


@pytest.mark.parametrize("head_dim", [16, 64])  # SmolLM2's is 64: scale 1/8
def test_ort_attention_is_bitwise_where_the_scale_is_a_power_of_two(head_dim):
    """The scale 1/4 or 1/8 moves onto the queries exactly, so the rewritten graph equals the original."""
    model = tiny_llama(hidden_size=4 * head_dim)
    plain = run_passes(SpecGraph.from_captured(capture(model)), [TreeAttention()])
    sg = run_passes(plain.clone(), [GroupedQueryAttention(), OrtAttention()])
    ids, _, mask, _ = step_inputs(11, TREE.size)
    g = torch.Generator().manual_seed(1)
    pos, past_kv = TREE.positions(11), torch.randn(3, 2, 1, 2, 11, head_dim, generator=g)
    want = plain.gm(ids, pos, mask, past_kv, TREE.mask)
    for a, b in zip(want, fused_step(sg, ids, pos, mask, past_kv)[:3]):
        assert torch.equal(a, b)


def test_ort_attention_refuses_what_it_cannot_fuse():
    eager = SpecGraph.from_captured(capture(ARCHITECTURES["gemma2"].build()))  # softcapped eager attention
    with pytest.raises(UnsupportedModelError, match="eager attention"):
        run_passes(eager, [TreeAttention(), OrtAttention()])


def test_reference_op_writes_only_the_new_slots():
    g = torch.Generator().manual_seed(0)
    q, past, cap = 3, 5, 10
    query, key, value = (torch.randn(1, q, n * 8, generator=g) for n in (4, 2, 2))
    past_k, past_v = torch.randn(1, 2, cap, 8, generator=g), torch.randn(1, 2, cap, 8, generator=g)
    bias = torch.zeros(1, 1, q, past + q)
    out, pk, pv = group_query_attention(query, key, value, past_k, past_v, bias, 4, 2, 0.5)
    assert torch.equal(pk[:, :, :past], past_k[:, :, :past]) and torch.equal(pk[:, :, past + q :], past_k[:, :, past + q :])
    assert torch.equal(pk[:, :, past : past + q], key.view(1, q, 2, 8).transpose(1, 2))
    keys = torch.cat([past_k[:, :, :past], key.view(1, q, 2, 8).transpose(1, 2)], 2).repeat_interleave(2, 1)
    vals = torch.cat([past_v[:, :, :past], value.view(1, q, 2, 8).transpose(1, 2)], 2).repeat_interleave(2, 1)
    attn = (query.view(1, q, 4, 8).transpose(1, 2) @ keys.transpose(-1, -2) * 0.5).softmax(-1) @ vals
    torch.testing.assert_close(out, attn.transpose(1, 2).reshape(1, q, 32))


@pytest.fixture(scope="module")
def ort_step(tree_graph, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from speccomp.backends.onnx_kv import lower_in_place

    path = tmp_path_factory.mktemp("ortkv") / "tree_attention.onnx"
    return lower_in_place(tree_graph, path, ["CPUExecutionProvider"], spin=False)


def test_onnxruntime_fused_attention_writes_the_runtime_buffer(tree_graph, ort_step):
    import onnx

    nodes = onnx.load(str(ort_step.path)).graph.node
    fused = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    assert len(fused) == 3
    for node in fused:  # the scale rides on the queries: alpha 1 is what sends ORT's q = 1 GEMM to its unpacked kernel
        assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}["scale"] == 1.0
    past = 9
    ids, pos, mask, past_kv = tree_inputs(past, seed=3)
    want = tree_graph.gm(ids, pos, mask, past_kv, TREE.mask)
    buf = room_buffer(past_kv, TREE.size + 4)
    got = ort_step(ids, pos, mask, buf[..., :past, :], TREE.mask)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buf[..., past : past + TREE.size, :], want[1], rtol=1e-6, atol=1e-6)
    assert torch.equal(buf[..., :past, :], past_kv) and not buf[..., past + TREE.size :, :].any()
    in_use = room_buffer(torch.cat([past_kv, past_kv], 4), 8)[..., :past, :]  # live slots after the view
    for other in (past_kv, room_buffer(past_kv, 2)[..., :past, :], in_use):  # each run on a scratch copy
        before = other._base.clone() if other._base is not None else None
        for a, b in zip(want, ort_step(ids, pos, mask, other, TREE.mask)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert before is None or torch.equal(other._base, before)


def test_onnxruntime_keeps_the_cache_layers_bound_between_steps(tree_graph, ort_step):
    """One IO binding per buffer and output set (LayerBindings): steps of other q and past over the same buffer reuse
    it and still match the graph; an earlier step's outputs stay intact; another buffer gets a binding of its own."""
    ort_step.bindings._kept.clear()
    past_kv = tree_inputs(12, seed=5)[3]
    buf = room_buffer(past_kv, 2 * TREE.size)
    kept = []
    for past, q in [(7, TREE.size), (9, 1), (12, TREE.size), (3, 1)]:
        ids, pos, mask, _ = step_inputs(past, q, seed=past)
        block = TREE.mask if q == TREE.size else torch.ones(1, 1, dtype=torch.bool)
        pos = TREE.positions(past) if q == TREE.size else pos
        buf.owner.length = past  # the runtime's cache holds `past` entries: the step writes after them
        want = tree_graph.gm(ids, pos, mask, buf[..., :past, :].clone(), block)
        got = ort_step(ids, pos, mask, buf[..., :past, :], block)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(buf[..., past : past + q, :], want[1], rtol=1e-6, atol=1e-6)
        kept.append((got[0], got[0].clone()))
    assert len(ort_step.bindings._kept) == 1
    assert all(torch.equal(a, b) for a, b in kept)  # each run's logits are its own, not overwritten by the next
    other = room_buffer(past_kv, 2 * TREE.size)  # the same shape as buf: only its address tells them apart
    before = buf.clone()
    ids, pos, mask, _ = tree_inputs(12, seed=6)
    want = tree_graph.gm(ids, pos, mask, past_kv, TREE.mask)
    torch.testing.assert_close(ort_step(ids, pos, mask, other[..., :12, :], TREE.mask)[0], want[0], rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(other[..., 12 : 12 + TREE.size, :], want[1], rtol=1e-6, atol=1e-6)
    assert torch.equal(buf, before) and len(ort_step.bindings._kept) == 2
    for extra in range(1, 4):  # a scratch copy (a view the step may not write after) gets a binding it does not keep
        ort_step(ids, pos, mask, room_buffer(past_kv, extra)[..., :12, :], TREE.mask)
    assert len(ort_step.bindings._kept) == 2


@pytest.mark.parametrize("drafter, options", [(None, None), ("layer_skip", {"skip": [1]})])
def test_onnxruntime_backend_decodes_like_the_model_with_the_cache_in_place(drafter, options, tmp_path, monkeypatch):
    from speccomp.backends.onnx_kv import OrtKVStep

    monkeypatch.setenv("SPECCOMP_ONNX_DIR", str(tmp_path))
    model = tiny_llama(num_hidden_layers=3, initializer_range=0.2)
    fast = speccomp.compile(model, drafter=drafter, drafter_options=options, backend="onnxruntime")
    assert isinstance(fast.step, OrtKVStep)
    ids = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(0)).repeat(3)[None]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                         eos_token_id=2, pad_token_id=2)
    assert torch.equal(fast.generate(ids, max_new_tokens=30, eos_token_id=2), ref)
    if drafter:
        assert isinstance(fast.drafter.step, OrtKVStep) and fast.last_stats["tau"] > 1.0  # drafts were accepted


def test_the_runtime_cache_names_its_owner_weakly():
    """KV_ROOM holds a weak reference: a finished generate's cache is freed at once, not at the next GC cycle."""
    from speccomp.frontend.convention import room_owner
    from speccomp.runtime.decode import KVCache

    cache = KVCache(capture(tiny_llama()).kv, 8)
    data = weakref.ref(cache.data)
    assert room_owner(cache.data) is cache
    gc.disable()
    try:
        del cache
        assert data() is None
    finally:
        gc.enable()


def test_onnxruntime_keeps_the_plain_export_when_the_fused_one_fails(monkeypatch, tmp_path):
    """An export or session failure of the fused graph warns and falls back to the copying graph: still lossless."""
    from speccomp.backends import onnx_kv
    from speccomp.backends.onnx_export import OrtStep
    from speccomp.backends.onnx_kv import OrtKVStep

    def broken():
        raise RuntimeError("no GroupQueryAttention here")

    monkeypatch.setattr(onnx_kv, "translation_table", broken)
    monkeypatch.setenv("SPECCOMP_ONNX_DIR", str(tmp_path))
    model = tiny_llama(num_hidden_layers=2, initializer_range=0.2)
    with pytest.warns(UserWarning, match="no GroupQueryAttention here"):
        fast = speccomp.compile(model, backend="onnxruntime")
    assert isinstance(fast.step, OrtStep) and not isinstance(fast.step, OrtKVStep)
    ids = torch.randint(3, 96, (10,), generator=torch.Generator().manual_seed(2))[None]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         eos_token_id=2, pad_token_id=2)
    assert torch.equal(fast.generate(ids, max_new_tokens=12, eos_token_id=2), ref)


def test_a_head_size_the_fused_op_refuses_exports_the_plain_graph(tmp_path, monkeypatch):
    """GroupQueryAttention takes head sizes that are multiples of 8; a model with 12 (hidden 48, 4 heads) compiled
    and then failed at its first step on onnxruntime, the quantized drafter included. OrtAttention now refuses the
    site, and the plain export (the cache a copied input) runs: HF greedy's text."""
    from speccomp.backends.onnx_export import OrtStep
    from speccomp.backends.onnx_kv import OrtKVStep

    monkeypatch.setenv("SPECCOMP_ONNX_DIR", str(tmp_path))
    model = tiny_llama(hidden_size=48, intermediate_size=72, num_hidden_layers=2, initializer_range=0.2)
    ids = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(1)).repeat(2)[None]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                         eos_token_id=2, pad_token_id=2)
    for drafter in (None, "quantized"):
        fast = speccomp.compile(model, drafter=drafter, backend="onnxruntime")
        assert isinstance(fast.step, OrtStep) and not isinstance(fast.step, OrtKVStep)
        assert torch.equal(fast.generate(ids, max_new_tokens=16, eos_token_id=2), ref), drafter
