"""TreeAttention pass: golden structure + numerics (each tree node scores exactly its own path)."""
import pytest
import torch
from transformers import DynamicCache

from speccomp.frontend import capture
from speccomp.frontend.graph import SpecGraph, run_passes
from speccomp.passes.tree_attention import TreeAttention
from speccomp.runtime.tree import Tree
from tiny_models import ARCHITECTURES, WINDOW, tiny_llama

TREE = Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # 7 nodes <= WINDOW


def tree_graph(model):
    return run_passes(SpecGraph.from_captured(capture(model)), [TreeAttention()])


def hf_cache(model, ids):
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return torch.stack([torch.stack([layer.keys, layer.values]) for layer in cache.layers])


def max_error_vs_paths(model, sg, past, vocab, seed=0):
    """Score TREE after `past` prompt tokens in one forward; compare node i with the model run on its path."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (1, past), generator=g)
    tokens = torch.randint(3, vocab, (TREE.size,), generator=g)
    with torch.no_grad():
        logits, new_kv, _ = sg.gm(
            tokens[None], TREE.positions(past), torch.ones(1, past + TREE.size, dtype=torch.long),
            hf_cache(model, prompt), TREE.mask,
        )
        worst = 0.0
        for i in range(TREE.size):
            path, u = [], i
            while u >= 0:
                path.append(u)
                u = TREE.parents[u]
            seq = torch.cat([prompt, tokens[path[::-1]][None]], dim=1)
            ref = model(seq, attention_mask=torch.ones_like(seq)).logits[0, -1]
            worst = max(worst, (ref - logits[0, i]).abs().max().item())
    return worst


def test_golden_structure():
    model = tiny_llama()
    before = SpecGraph.from_captured(capture(model))
    n_sdpa = sum(1 for n in before.gm.graph.nodes if "scaled_dot_product" in str(n.target))
    masks_before = {s.mask for s in before.structure.attention}
    sg = run_passes(before, [TreeAttention()])
    placeholders = [n.name for n in sg.gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["input_ids", "position_ids", "attention_mask", "past_kv", "tree_mask"]
    assert sg.applied == ["tree_attention"]
    # one shared causal mask in Llama -> one rewritten mask feeding every sdpa
    new_masks = {s.mask for s in sg.structure.attention}
    assert len(masks_before) == 1 and len(new_masks) == 1 and new_masks.isdisjoint(masks_before)
    (mask,) = new_masks
    assert mask.target is torch.ops.aten.logical_and.default
    assert sum(1 for n in sg.gm.graph.nodes if "scaled_dot_product" in str(n.target)) == n_sdpa
    assert all(s.node.args[3] is mask for s in sg.structure.attention)
    assert mask.meta.get("nn_module_stack")  # new nodes keep the provenance of the mask they replace
    sg.gm.graph.lint()
    with pytest.raises(Exception, match="already applied"):
        TreeAttention()(sg)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gemma3", "gpt2", "starcoder2"])
def test_tree_nodes_match_their_paths_past_the_window(name):
    arch = ARCHITECTURES[name]
    model = arch.build()
    sg = tree_graph(model)
    vocab = model.config.vocab_size
    for past in (5, 3 * WINDOW + 1):  # inside and well past the sliding window
        assert max_error_vs_paths(model, sg, past, vocab) < 1e-4, (name, past)


def test_eager_attention_tree():
    model = tiny_llama(attn_implementation="eager")
    sg = tree_graph(model)
    assert {s.kind for s in sg.structure.attention} == {"eager"}
    assert max_error_vs_paths(model, sg, 9, 96) < 1e-4


def test_chain_tree_equals_plain_graph():
    model = tiny_llama()
    plain = SpecGraph.from_captured(capture(model))
    tree = plain.clone()
    TreeAttention()(tree)
    ids = torch.randint(0, 96, (1, 6))
    past = hf_cache(model, torch.randint(0, 96, (1, 10)))
    args = (ids, torch.arange(10, 16)[None], torch.ones(1, 16, dtype=torch.long), past)
    a = plain.gm(*args)
    b = tree.gm(*args, torch.ones(6, 6, dtype=torch.bool).tril())
    for x, y in zip(a, b):
        assert torch.equal(x, y)


FACTORIES = {torch.ops.aten.ones.default, torch.ops.aten.zeros.default, torch.ops.aten.full.default,
             torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step,
             torch.ops.aten.empty.memory_format}


def test_new_tensors_are_made_on_the_models_device():
    """Every tensor the pass creates from nothing (the tree's ones[q, past], the window's key columns) names the
    captured model's device: without it they are made on the CPU and a model on a GPU fails at its first step
    (found on an H200 by benchmarks/gpu_check.py; there is no GPU here, so the structure is what is checked)."""
    model = ARCHITECTURES["mistral"].build()  # windowed: the pass also builds an arange of key columns
    sg = SpecGraph.from_captured(capture(model))
    before = {n.name for n in sg.gm.graph.nodes}
    run_passes(sg, [TreeAttention()], dump_input=False)
    made = [n for n in sg.gm.graph.nodes if n.target in FACTORIES and n.name not in before]
    assert {n.target for n in made} == {torch.ops.aten.ones.default, torch.ops.aten.arange.default}
    for n in made:
        assert n.kwargs.get("device") == torch.device("cpu"), (n.name, n.kwargs)  # the device capture saw
    assert sg.structure.inputs["tree_mask"].meta["val"].device == torch.device("cpu")
