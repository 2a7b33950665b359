"""Lowering passes of the eager backend: golden structure + numerics against the unlowered graph."""
import shutil

import pytest
import torch

import speccomp
from speccomp.frontend import capture
from speccomp.errors import GraphStructureError
from speccomp.frontend.graph import SpecGraph, run_passes
from speccomp.passes.grouped_query_attention import GroupedQueryAttention
from speccomp.passes.inplace_kv import extend_in_place
from speccomp.passes.prepack_linear import PrepackLinear, available
from speccomp.passes.tree_attention import TreeAttention
from speccomp.runtime.tree import Tree
from tiny_models import ARCHITECTURES, tiny_llama

aten = torch.ops.aten
needs_onednn = pytest.mark.skipif(not available(), reason="this PyTorch has no oneDNN")


def step_inputs(vocab, past, q, layers=3, kv_heads=2, head_dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, vocab, (1, q), generator=g),
        torch.arange(past, past + q)[None],
        torch.ones(1, past + q, dtype=torch.long),
        torch.randn(layers, 2, 1, kv_heads, past, head_dim, generator=g),
    )


def test_gqa_golden_structure_and_bitwise_equal():
    model = tiny_llama()  # 4 query heads, 2 KV heads: HF repeats each KV head twice
    plain = SpecGraph.from_captured(capture(model))
    sg = run_passes(plain.clone(), [GroupedQueryAttention()])
    before, after = plain.op_counts(), sg.op_counts()
    sdpa = "aten.scaled_dot_product_attention.default"
    assert before[sdpa] == after[sdpa] == 3
    gqa_calls = [n for n in sg.gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert all(n.kwargs.get("enable_gqa") for n in gqa_calls)
    # the repeat_kv chains (unsqueeze -> expand -> clone -> view) of K and V are gone
    assert after["aten.expand.default"] == before["aten.expand.default"] - 6
    assert after["aten.clone.default"] == before["aten.clone.default"] - 6
    assert all(n.args[1].meta["val"].shape[1] == 2 for n in gqa_calls)  # SDPA reads the 2 KV heads
    assert all(s.node in gqa_calls for s in sg.structure.attention)
    assert all(n.meta.get("nn_module_stack") for n in gqa_calls)
    for past, q in [(0, 4), (7, 1), (9, 3)]:
        args = step_inputs(96, past, q)
        for a, b in zip(plain.gm(*args), sg.gm(*args)):
            assert torch.equal(a, b)  # the same math, not just close


def test_gqa_leaves_multi_head_models_alone():
    model = tiny_llama(num_key_value_heads=4)  # MHA: no repeat_kv in the graph
    sg = run_passes(SpecGraph.from_captured(capture(model)), [GroupedQueryAttention()])
    assert not any(n.kwargs.get("enable_gqa") for n in sg.gm.graph.nodes if n.op == "call_function")


def test_gqa_after_tree_attention_keeps_tree_numerics():
    model = tiny_llama()
    tree = Tree.from_choices([[0], [1], [0, 0], [1, 0]])
    ta = run_passes(SpecGraph.from_captured(capture(model)), [TreeAttention()])
    both = run_passes(ta.clone(), [GroupedQueryAttention()])
    ids, _, mask, past_kv = step_inputs(96, 11, tree.size)
    args = (ids, tree.positions(11), mask, past_kv, tree.mask)
    for a, b in zip(ta.gm(*args), both.gm(*args)):
        assert torch.equal(a, b)


@needs_onednn
def test_prepack_golden_structure_and_numerics():
    model = tiny_llama(tie_word_embeddings=True)
    plain = SpecGraph.from_captured(capture(model))
    sg = run_passes(plain.clone(), [PrepackLinear()])
    n_linear = plain.op_counts()["aten.linear.default"]
    assert n_linear == 3 * 7 + 1  # q, k, v, o, gate, up, down per layer + LM head
    assert sg.op_counts()["aten.linear.default"] == 0
    assert sg.op_counts()["mkldnn._linear_pointwise.default"] == n_linear
    packed = [n for n in sg.gm.graph.nodes if n.op == "get_attr" and n.target.startswith("_packed_")]
    assert len({n.target for n in packed}) == n_linear  # one packed buffer per weight
    # the packed weights are buffers of the graph module, not parameters (nothing to train or save)
    assert not any(name.startswith("_packed_") for name, _ in sg.gm.named_parameters())
    for past, q in [(0, 5), (6, 1), (6, 4)]:
        args = step_inputs(96, past, q)
        for a, b in zip(plain.gm(*args), sg.gm(*args)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_prepack_shares_packed_weights_between_graphs():
    model = tiny_llama()
    base = SpecGraph.from_captured(capture(model))
    a = run_passes(base.clone(), [PrepackLinear()])
    b = run_passes(base.clone(), [PrepackLinear()])
    name = next(n for n, _ in a.gm.named_buffers() if n.startswith("_packed_"))
    assert a.gm.get_buffer(name) is b.gm.get_buffer(name)


@needs_onednn
def test_a_compile_after_the_weights_changed_in_place_decodes_the_new_weights():
    """load_state_dict (or an optimizer step) writes into the same Parameter objects: the packed copies, cached per
    weight, are packed again for the next compile (it decoded the old linears with the new embeddings and norms)."""
    model, other = tiny_llama(initializer_range=0.2), tiny_llama(initializer_range=0.2, vocab_size=96)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_(0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    ids = torch.arange(5, 17)[None]

    def hf():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              pad_token_id=0, eos_token_id=None)

    first = speccomp.compile(model)
    assert torch.equal(first.generate(ids, max_new_tokens=12), hf())
    before = hf()
    model.load_state_dict(other.state_dict())
    assert not torch.equal(hf(), before)  # the new weights decode another text
    assert torch.equal(speccomp.compile(model).generate(ids, max_new_tokens=12), hf())


@needs_onednn
def test_prepack_refuses_non_float32_weights():
    model = tiny_llama().to(torch.bfloat16)
    sg = SpecGraph.from_captured(capture(model, check=False))
    assert not PrepackLinear.applies(sg)
    with pytest.raises(GraphStructureError, match="float32"):
        PrepackLinear()(sg)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "mistral"])
def test_eager_backend_lowering_is_lossless(name):
    """The lowered eager backend decodes exactly what the model's own greedy decoding does."""
    arch = ARCHITECTURES[name]
    model = arch.build()
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    sm = speccomp.compile(model)
    ops = {str(n.target) for n in sm.step.graph.nodes}
    assert any(n.target is extend_in_place for n in sm.step.graph.nodes)  # the cache is written in place
    assert "aten.linear.default" in {str(n.target) for n in sm.graph.gm.graph.nodes}  # sm.graph stays portable
    if available():
        assert "mkldnn._linear_pointwise.default" in ops and "aten.linear.default" not in ops
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                         eos_token_id=2, pad_token_id=2)
    out = sm.generate(ids, max_new_tokens=24, eos_token_id=2)
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------------------
# The pass contract: order, repetition, the attention annotation, the calling convention, debug dumps
# --------------------------------------------------------------------------------------
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def test_passes_in_the_wrong_order_or_twice_are_refused_by_name():
    """TreeAttention after OrtAttention rewired a node that did not read the mask: the tree mask went unread and
    siblings saw each other (logits off by 0.11, no error). OrtAttention twice was a bare KeyError; a layer skipped
    twice was said not to exist."""
    from speccomp.passes.layer_skip import SkipLayers
    from speccomp.passes.ort_attention import OrtAttention

    sg = SpecGraph.from_captured(capture(tiny_llama()))
    with pytest.raises(GraphStructureError, match="TreeAttention must run before OrtAttention"):
        run_passes(sg.clone(), [GroupedQueryAttention(), OrtAttention(), TreeAttention()], dump_input=False)
    done = run_passes(sg.clone(), [TreeAttention(), GroupedQueryAttention(), OrtAttention()], dump_input=False)
    assert all(s.mask in s.mask_user.all_input_nodes for s in done.structure.attention)  # the fused call reads it
    with pytest.raises(GraphStructureError, match="OrtAttention was already applied"):
        run_passes(done, [OrtAttention()], dump_input=False)
    with pytest.raises(ValueError, match=r"layers \[1\] are not in this graph: an earlier pass skipped them"):
        run_passes(sg.clone(), [SkipLayers([1]), SkipLayers([1])], dump_input=False)
    # AttentionScores before TreeAttention scored with the model's mask (a node gave 0.08 of its attention to a
    # sibling the tree hides); before SkipLayers it kept scoring the skipped layer (2 score rows against 1 new_kv)
    from speccomp.passes.kv_compress import AttentionScores

    with pytest.raises(GraphStructureError, match="TreeAttention must run before AttentionScores"):
        run_passes(sg.clone(), [AttentionScores(), TreeAttention()], dump_input=False)
    with pytest.raises(GraphStructureError, match="SkipLayers must run before AttentionScores"):
        run_passes(sg.clone(), [TreeAttention(), AttentionScores(), SkipLayers([1])], dump_input=False)
    run_passes(sg.clone(), [SkipLayers([1]), TreeAttention(), AttentionScores()], dump_input=False)  # the order used


def test_a_pass_that_leaves_an_invalid_graph_is_named():
    """FX's lint error (a node used before it is defined, or taken from another graph) came raw, followed by the
    whole graph (24k characters for a 2-layer GPT-2) and without the pass that broke it."""
    from speccomp.frontend.graph import Pass

    class HeadFirst(Pass):
        name = "head_first"

        def rewrite(self, sg):
            next(n for n in sg.gm.graph.nodes if n.op != "placeholder").prepend(sg.structure.lm_head)

    sg = SpecGraph.from_captured(capture(tiny_llama()))
    with pytest.raises(GraphStructureError, match=r"pass 'head_first' left an invalid graph: .* used before it has "
                                                  r"been defined") as raised:
        run_passes(sg, [HeadFirst()], dump_input=False)
    assert "\n" not in str(raised.value)


def test_a_pass_that_leaves_the_attention_annotation_on_erased_nodes_is_named():
    """A user pass replacing SDPA by hand (replace_all_uses_with, erase_node) left sg.structure on erased nodes; the
    next pass failed far away ("'<' not supported between NoneType"). Now the pass itself is named, with the fix."""
    from speccomp.frontend.graph import Pass, copy_meta

    class ReSDPA(Pass):
        name = "re_sdpa"

        def rewrite(self, sg):
            g = sg.gm.graph
            for n in [n for n in g.nodes if n.target is SDPA]:
                with g.inserting_before(n):
                    new = g.call_function(SDPA, n.args, dict(n.kwargs))
                copy_meta(new, n)
                n.replace_all_uses_with(new)
                g.erase_node(n)

    sg = SpecGraph.from_captured(capture(tiny_llama()))
    with pytest.raises(GraphStructureError, match=r"pass 're_sdpa' left attention .*\.replace_attention\(sg, old, "):
        run_passes(sg, [ReSDPA(), TreeAttention()], dump_input=False)


def test_a_drafters_target_pass_may_add_outputs_not_inputs():
    """A target pass that added an input compiled, then generate failed inside torch (the new input took tree_mask's
    place in the positional call). One that cut new_kv to its first layer decoded a text neither model gives (that
    layer broadcast into every layer of the cache): refused at the first step."""
    from speccomp.frontend.graph import Pass
    from speccomp.runtime.decode import Draft, Drafter

    class AddTemperature(Pass):
        name = "temperature"

        def rewrite(self, sg):
            g = sg.gm.graph
            with g.inserting_after([n for n in g.nodes if n.op == "placeholder"][-1]):
                t = g.placeholder("temperature")
            out = g.output_node()
            with g.inserting_before(out):
                new = g.call_function(torch.ops.aten.div.Tensor, (out.args[0][0], t))
            out.args = ((new, *out.args[0][1:]),)

    class FirstLayerKV(Pass):
        name = "first_layer_kv"

        def rewrite(self, sg):
            out = sg.gm.graph.output_node()
            logits, new_kv, *rest = out.args[0]
            with sg.gm.graph.inserting_before(out):
                cut = sg.gm.graph.call_function(torch.ops.aten.slice.Tensor, (new_kv, 0, 0, 1))
            out.args = ((logits, cut, *rest),)

    class Chain(Drafter):
        name, reads, trees = "chain", (), ()

        def __init__(self, *passes):
            self.target_passes = passes

        def propose(self, ctx):
            return Draft(Tree.from_parents([-1]), torch.tensor([ctx.tokens[-1]]))

    with pytest.raises(GraphStructureError, match=r"chain drafter's target_passes \['temperature'\] .* not inputs"):
        speccomp.compile(tiny_llama(), drafter=Chain(AddTemperature()))
    fast = speccomp.compile(tiny_llama(), drafter=Chain(FirstLayerKV()))
    with pytest.raises(GraphStructureError, match=r"new_kv output is \[1, 2, 1, 2, 6, 8\]; the cache holds \[3, 2, 1, 2\]"):
        fast.generate(torch.arange(3, 9)[None], max_new_tokens=4)


def test_debug_dumps_never_overwrite_and_never_stop_a_compile(tmp_path, monkeypatch, capsys):
    """SPECCOMP_DEBUG=1 overwrote a user's 00_captured.py and mixed two runs' files in one folder; an unwritable
    SPECCOMP_DEBUG_DIR made compile fail with a bare FileNotFoundError."""
    monkeypatch.setenv("SPECCOMP_DEBUG", "1")
    mine = tmp_path / "dumps"
    mine.mkdir()
    (mine / "00_captured.py").write_text("MY FILE")
    monkeypatch.setenv("SPECCOMP_DEBUG_DIR", str(mine))
    speccomp.compile(tiny_llama())
    assert (mine / "00_captured.py").read_text() == "MY FILE"
    assert (mine / "run-1" / "00_captured.py").is_file()
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("SPECCOMP_DEBUG_DIR", str(tmp_path / "a-file" / "dumps"))
    ids = torch.arange(3, 9)[None]
    assert speccomp.compile(tiny_llama()).generate(ids, max_new_tokens=2).shape == (1, 8)
    assert "cannot write graph dumps to SPECCOMP_DEBUG_DIR=" in capsys.readouterr().err
    # a relative folder is where the process is: after a chdir, another folder, with a run of its own there (the
    # second compile's dumps went into the first folder's path, relative, among another run's files)
    monkeypatch.setenv("SPECCOMP_DEBUG_DIR", "dumps")
    for where in ("a", "b"):
        (tmp_path / where / "dumps").mkdir(parents=True)
        (tmp_path / where / "dumps" / "earlier.py").write_text("x")
        monkeypatch.chdir(tmp_path / where)
        speccomp.compile(tiny_llama())
        assert sorted(p.name for p in (tmp_path / where / "dumps").iterdir()) == ["earlier.py", "run-1"]
        assert (tmp_path / where / "dumps" / "run-1" / "00_captured.py").is_file()
    # a folder that stops taking files is said once, not once per dump
    shutil.rmtree(tmp_path / "b" / "dumps")
    speccomp.compile(tiny_llama())
    assert capsys.readouterr().err.count("compiling without dumps") == 1
    monkeypatch.setenv("SPECCOMP_DEBUG", "off")  # wrote dumps as "1" did
    monkeypatch.setenv("SPECCOMP_DEBUG_DIR", str(tmp_path / "off"))
    speccomp.compile(tiny_llama())
    assert not (tmp_path / "off").exists()
