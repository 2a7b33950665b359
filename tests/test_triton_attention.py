"""backend="triton": the Triton tree-attention kernel against SDPA, the TritonAttention pass, greedy
decoding identical to the model's, and the errors without Triton / GPU / interpreter.

No GPU here: the kernel runs in Triton's CPU interpreter, which has to be chosen before triton is
imported (`import triton` wraps Triton's own library for one mode, and torch imports triton early,
see backends/triton_attention.py). So a test process has one mode: tests that need the other one are
skipped here and run in a child pytest of this file started with the other mode
(test_other_triton_mode_in_child_process); every test runs exactly once, whatever was imported first.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import speccomp  # noqa: E402
from speccomp.backends import lower  # noqa: E402
from speccomp.backends.triton_attention import TREE_ATTENTION, TritonBackendError, interpreting, launch  # noqa: E402
from speccomp.frontend import capture  # noqa: E402
from speccomp.drafters.head_drafters import DEFAULT_MEDUSA_TREE  # noqa: E402
from speccomp.errors import GraphStructureError  # noqa: E402
from speccomp.frontend.graph import SpecGraph, run_passes  # noqa: E402
from speccomp.passes.grouped_query_attention import GroupedQueryAttention  # noqa: E402
from speccomp.passes.tree_attention import TreeAttention  # noqa: E402
from speccomp.passes.triton_attention import TritonAttention  # noqa: E402
from speccomp.runtime.tree import Tree  # noqa: E402
from tiny_models import ARCHITECTURES, seeded_prompt, tiny_llama  # noqa: E402

SDPA = torch.ops.aten.scaled_dot_product_attention.default
CHILD = "SPECCOMP_TRITON_TEST_CHILD"  # set in the child process
IN_CHILD = os.environ.get(CHILD) == "1"
INTERPRETED = interpreting()  # this process imported triton with TRITON_INTERPRET=1
OTHER_MODE = "needs the other Triton mode; runs in test_other_triton_mode_in_child_process"

# the kernel on CPU: Triton's interpreter
interpreter = pytest.mark.skipif(not INTERPRETED, reason=OTHER_MODE)
# the errors of a CPU-only process without the interpreter (with a GPU they do not arise)
compiled = pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason=OTHER_MODE)
# tests that do not depend on the mode run in the parent only
parent_only = pytest.mark.skipif(IN_CHILD, reason="mode-independent: runs in the parent process")


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def tree_graph(llama):
    """The target graph of a drafter run (captured + TreeAttention), before lowering."""
    return run_passes(SpecGraph.from_captured(capture(llama)), [TreeAttention()], dump_input=False)


# --------------------------------------------------------------------------------------
# Kernel vs SDPA
# --------------------------------------------------------------------------------------
TREES = {
    "chain": Tree.chain(3),  # 4 tokens, each sees all earlier ones
    "wide": Tree.from_choices([[0], [1], [2], [3], [4]]),  # 6 tokens, 5 siblings under the root
    "medusa": Tree.from_choices(DEFAULT_MEDUSA_TREE),  # 17 tokens, depth 4
}


def graph_mask(tree: Tree, past: int, window: int | None = None) -> torch.Tensor:
    """bool [1, 1, q, past+q] as the graph computes it: the model's causal mask over cache slots AND
    cat(ones[q, past], tree.mask) (passes/tree_attention.py); with a window, older columns use
    the window on positions (past + depth), as the pass recomputes it."""
    q, kv = tree.size, past + tree.size
    slots = torch.arange(kv)
    causal = slots[None, :] <= past + torch.arange(q)[:, None]  # [q, kv]
    if window is not None:
        pos = past + tree.depth  # [q]
        older = slots < past
        causal = torch.where(older[None, :], pos[:, None] - slots[None, :] < window, causal)
    visible = torch.cat([torch.ones(q, past, dtype=torch.bool), tree.mask], dim=1)
    return (causal & visible)[None, None]


def qkv(q_len, kv_len, groups, kv_heads=2, head_dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q as the graph has it: [b, q, H, D] projections transposed to [b, H, q, D] (not contiguous)
    q = torch.randn(1, q_len, kv_heads * groups, head_dim, generator=g).transpose(1, 2)
    k = torch.randn(1, kv_heads, kv_len, head_dim, generator=g)
    v = torch.randn(1, kv_heads, kv_len, head_dim, generator=g)
    return q, k, v


def sdpa_reference(q, k, v, mask, scale=None):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # query head h reads KV head h // g
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@interpreter
@pytest.mark.parametrize("past", [0, 1, 37, 60])
@pytest.mark.parametrize("groups", [1, 3, 4])
@pytest.mark.parametrize("tree", list(TREES))
def test_kernel_matches_sdpa(tree, groups, past):
    t = TREES[tree]
    q, k, v = qkv(t.size, past + t.size, groups, seed=past)
    mask = graph_mask(t, past)
    # 16-key blocks: several blocks per row (the online-softmax rescaling runs), the last one ragged
    # except for chain + past 60 (64 keys, 4 full blocks)
    out = launch(q, k, v, mask, block_n=16)
    ref = sdpa_reference(q, k, v, mask)
    assert out.shape == ref.shape == (1, 2 * groups, t.size, 8)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)


@interpreter
def test_kernel_sliding_window_float_mask_scale_and_odd_head_dim():
    """A windowed mask (partial rows in the cache), as an additive 0/finfo.min float mask, a non-default
    scale and head_dim 12 (padded to a 16-wide tile), through the custom op itself."""
    t, past = TREES["medusa"], 29
    q, k, v = qkv(t.size, past + t.size, 3, head_dim=12, seed=5)
    allowed = graph_mask(t, past, window=8)
    assert not allowed[..., :past].all() and allowed[..., :past].any()  # the window hides part of the cache
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for mask in (allowed, additive):
        out = torch.ops.speccomp.tree_attention(q, k, v, mask, 0.2)
        torch.testing.assert_close(out, sdpa_reference(q, k, v, mask, scale=0.2), rtol=0, atol=1e-4)


@interpreter
def test_kernel_fully_masked_row_is_zero_not_nan():
    q, k, v = qkv(3, 5, 2)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 1, :] = False
    out = launch(q, k, v, mask, block_n=16)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    torch.testing.assert_close(out, sdpa_reference(q, k, v, mask), rtol=0, atol=1e-4)


@interpreter
def test_kernel_refuses_what_it_does_not_compute():
    q, k, v = qkv(2, 4, 2)
    mask = torch.ones(1, 1, 2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="float32"):
        launch(q.double(), k.double(), v.double(), mask)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        launch(q[:, :3], k, v, mask)  # 3 query heads over 2 KV heads


# --------------------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------------------
@parent_only
def test_pass_golden_structure(tree_graph):
    gqa = run_passes(tree_graph.clone(), [GroupedQueryAttention()], dump_input=False)
    sg = run_passes(gqa.clone(), [TritonAttention()], dump_input=False)
    sdpa_before = [n for n in gqa.gm.graph.nodes if n.target is SDPA]
    ops_after = [n for n in sg.gm.graph.nodes if n.target is TREE_ATTENTION]
    assert len(sdpa_before) == len(ops_after) == 3  # one per layer
    assert not any(n.target is SDPA for n in sg.gm.graph.nodes)
    sg.gm.graph.lint()
    for old, new in zip(sdpa_before, ops_after):
        assert new.meta["nn_module_stack"] == old.meta["nn_module_stack"]  # provenance kept
        assert new.meta["val"].shape == old.meta["val"].shape  # [1, 4, q, 8]
        q, k, v, mask, scale = new.args
        assert k.meta["val"].shape[1] == 2  # reads the 2 KV heads: no repeat_kv copy in front
        assert (q.name, k.name, v.name, mask.name) == tuple(a.name for a in old.args[:4])
        assert scale == old.kwargs["scale"] == 8 ** -0.5
    assert [s.node for s in sg.structure.attention] == ops_after  # the annotation follows the rewrite
    assert sg.applied[-1] == "triton_attention"


@interpreter
def test_pass_lowered_graph_matches_eager(tree_graph):
    """The lowered graph computes what the eager backend's graph does, on a tree step with a cache."""
    eager = lower(tree_graph, "eager")
    tri = lower(tree_graph, "triton")
    assert sum(n.target is TREE_ATTENTION for n in tri.graph.nodes) == 3
    tree, past = TREES["medusa"], 23
    g = torch.Generator().manual_seed(0)
    args = (torch.randint(0, 96, (1, tree.size), generator=g), tree.positions(past),
            torch.ones(1, past + tree.size, dtype=torch.long), torch.randn(3, 2, 1, 2, past, 8, generator=g), tree.mask)
    with torch.no_grad():
        for a, b in zip(eager(*args), tri(*args)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@parent_only
@pytest.mark.parametrize("edit, words", [({"is_causal": True}, "is_causal"), ({"dropout_p": 0.1}, "dropout"),
                                         ({"attn_mask": None}, "no mask")])
def test_pass_refuses_unsupported_sdpa(tree_graph, edit, words):
    sg = run_passes(tree_graph.clone(), [GroupedQueryAttention()], dump_input=False)
    node = next(n for n in sg.gm.graph.nodes if n.target is SDPA)
    args = dict(zip(("query", "key", "value", "attn_mask"), node.args))
    args.update(node.kwargs, **edit)
    node.args, node.kwargs = (), args  # all by keyword: the pass must read either form
    with pytest.raises(GraphStructureError, match=words):
        TritonAttention()(sg)


# --------------------------------------------------------------------------------------
# End to end: greedy decoding identical to HF's
# --------------------------------------------------------------------------------------
def hf_greedy(model, ids, n, eos=2):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos)


@interpreter
@pytest.mark.parametrize("drafter, options", [(None, None), ("token_recycling", None), ("layer_skip", {"skip": [1]})])
def test_triton_backend_greedy_identical(llama, drafter, options):
    fast = speccomp.compile(llama, drafter=drafter, backend="triton", drafter_options=options)
    assert sum(n.target is TREE_ATTENTION for n in fast.step.graph.nodes) == 3
    base = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(0))
    ids = base.repeat(3)[None]  # repetitive: drafts get accepted, trees get verified
    n = 16 if drafter is None else 24  # plain decoding: 3 interpreted launches per token
    out = fast.generate(ids, max_new_tokens=n, eos_token_id=2)
    assert torch.equal(out, hf_greedy(llama, ids, n))
    if drafter is not None:
        assert fast.last_stats["steps"] < n  # some step accepted a draft: a tree went through the kernel
    if drafter == "layer_skip":
        assert sum(n.target is TREE_ATTENTION for n in fast.drafter.step.graph.nodes) == 2  # layers 0 and 2


@interpreter
@pytest.mark.parametrize("name, sites", [("mistral", 2), ("gemma3", 3), ("gpt2", 2)])
def test_triton_backend_other_attention_layouts(name, sites):
    """mistral: every layer windowed (8), decoding goes past the window; gemma3: windowed and global layers;
    gpt2: multi-head (G = 1, no enable_gqa)."""
    model = ARCHITECTURES[name].build()
    fast = speccomp.compile(model, drafter="token_recycling", backend="triton")
    assert sum(n.target is TREE_ATTENTION for n in fast.step.graph.nodes) == sites
    ids = seeded_prompt(12, model.config.vocab_size)
    out = fast.generate(ids, max_new_tokens=16, eos_token_id=2)  # 28 tokens, windows of 8
    assert torch.equal(out, hf_greedy(model, ids, 16))


@interpreter
def test_triton_backend_on_plain_modules_written_the_usual_way():
    """nanoGPT / gpt-fast attention: `y.transpose(1, 2).contiguous().view(B, T, C)` after SDPA. SDPA's output is
    already laid out [B, T, H, D], so the export drops the `.contiguous()`; the kernel's output must have the same
    layout or the `view` fails (it did: a RuntimeError at the first generate, plain decoding included)."""
    from test_plain_module import GPTConfig, GptFast, NanoGPT, _init, naive_greedy

    for model in (_init(NanoGPT(), 0), _init(GptFast(), 1)):
        fast = speccomp.compile(model, backend="triton")
        assert any(n.target is TREE_ATTENTION for n in fast.step.graph.nodes)
        ids = torch.randint(0, GPTConfig.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
        assert torch.equal(fast.generate(ids, max_new_tokens=12), naive_greedy(model, ids, 12))


# --------------------------------------------------------------------------------------
# Errors: say what is missing, at compile time
# --------------------------------------------------------------------------------------
@compiled
def test_no_gpu_no_interpreter_fails_at_compile(monkeypatch, llama):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(TritonBackendError, match=r"CUDA GPU.*TRITON_INTERPRET=1"):
        speccomp.compile(llama, backend="triton")  # at compile, not at the first generate
    q, k, v = qkv(2, 4, 2)
    with pytest.raises(TritonBackendError, match="TRITON_INTERPRET=1"):  # the op itself, called directly
        launch(q, k, v, torch.ones(1, 1, 2, 4, dtype=torch.bool))


@compiled
def test_interpreter_set_after_triton_import_is_named(monkeypatch, tree_graph):
    """The usual mistake (os.environ set inside the script, after torch imported triton) gets its own message."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(TritonBackendError, match="set after triton was imported.*before Python starts"):
        lower(tree_graph, "triton")


@parent_only
def test_a_half_precision_model_is_refused_naming_the_fix():
    """The kernel computes in float32: a float16 / bfloat16 model is refused as the backend's error with its fix (it
    was the TritonAttention pass's internal GraphStructureError)."""
    from speccomp.frontend.graph import SpecGraph

    sg = SpecGraph.from_captured(speccomp.capture(tiny_llama().to(torch.float16)))
    with pytest.raises(TritonBackendError, match=r"computes in float32, and this model is torch.float16. Compile "
                                                 r"model.float\(\), or use backend='eager'"):
        lower(sg, "triton")


@parent_only
def test_triton_not_installed_names_the_install(monkeypatch, tree_graph):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    with pytest.raises(TritonBackendError, match=r"pip install 'speccomp\[triton\]' \(triton==3\.9\.0\)"):
        lower(tree_graph, "triton")


# --------------------------------------------------------------------------------------
# The other mode, in a child process
# --------------------------------------------------------------------------------------
@parent_only
def test_other_triton_mode_in_child_process(request):
    """Rerun this file with TRITON_INTERPRET flipped from process start; it must pass every test skipped here."""
    env = dict(os.environ, **{CHILD: "1", "OMP_NUM_THREADS": "1"})
    if INTERPRETED:
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
    here = request.node.path
    skipped_here = 0  # tests of this file skipped here for the mode (a -k selection may have dropped some)
    for item in request.session.items:
        marks = item.iter_markers("skipif") if item.path == here else ()
        skipped_here += any(m.args[0] and m.kwargs.get("reason") == OTHER_MODE for m in marks)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider"],
                          env=env, cwd=root, capture_output=True, text=True, timeout=900)
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= max(skipped_here, 1), report  # the child ran them, not skipped them
