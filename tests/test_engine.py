"""Exported engines: `compiled.export(dir)` + `speccomp.load(dir)` decode exactly like the model, in a
process that has no torch; bad directories and missing providers fail with errors naming the fix."""
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import pytest
import torch

import speccomp
from speccomp.engine.runtime import EngineError, load, read_manifest
from speccomp.runtime.decode import Draft, Drafter
from speccomp.runtime.tree import Tree
from tiny_models import ARCHITECTURES, tiny_llama

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

ROOT = Path(__file__).resolve().parents[1]


def hf_greedy(model, ids, n, eos=2):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos)


def repetitive_prompt(seed: int, vocab: int = 96) -> torch.Tensor:
    base = torch.randint(3, vocab, (6,), generator=torch.Generator().manual_seed(seed))
    return base.repeat(3)[None]  # drafts get accepted


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(num_hidden_layers=4, initializer_range=0.2)


@pytest.fixture(scope="module")
def engine_dir(llama, tmp_path_factory):
    """token_recycling engine of the tiny llama, exported from the eager backend (fresh ONNX export)."""
    path = tmp_path_factory.mktemp("engines") / "tr"
    speccomp.compile(llama, drafter="token_recycling").export(path)
    return path


def test_manifest_describes_the_engine(engine_dir, llama):
    m = read_manifest(engine_dir)
    assert m["format"] == "speccomp-engine" and m["speccomp_version"] == speccomp.__version__
    assert m["drafter"]["name"] == "token_recycling" and m["drafter"]["options"]["top_k"] == 8
    target = m["graphs"]["target"]
    # ... and the nodes whose top-k the runtime asks for (not a prefill's, nor a switched-off batch row's)
    assert target["inputs"] == ["input_ids", "position_ids", "attention_mask", "past_kv", "tree_mask", "top_ids_rows"]
    assert target["outputs"][:2] == ["logits", "new_kv"]
    # Token Recycling's top-k is a TopK inside the target graph, which the engine's drafter reads
    assert target["outputs"][-1] == "top_ids" and speccomp.load(engine_dir).drafter.outputs == ("top_ids",)
    assert m["kv"]["num_layers"] == 4 and m["model"]["vocab_size"] == llama.config.vocab_size
    assert isinstance(m["opset"], int) and m["opset"] >= 17
    assert sorted(p.name for p in engine_dir.iterdir()) == ["manifest.json", "target.onnx"]


def record_steps(drafter, torch_side: bool) -> list:
    """Wrap a drafter's observe: each verification's (drafted tokens, accepted path) is appended to the list."""
    steps, observe = [], drafter.observe

    def spy(draft, path, logits, *extras):
        tokens = draft.tokens.tolist() if torch_side else list(draft)
        steps.append((tokens, list(path)))
        return observe(draft, path, logits, *extras)

    drafter.observe = spy
    return steps


@pytest.mark.parametrize("drafter", [None, "ngram", "suffix", "token_recycling"])
def test_engine_greedy_identical(llama, drafter, tmp_path):
    """The engine runs the torch runtime's algorithm in numpy: same tokens, and with a drafter the same drafts and
    the same accepted paths at every step (both run the same ONNX graph: onnxruntime backend and its export)."""
    fast = speccomp.compile(llama, drafter=drafter, backend="onnxruntime")
    fast.export(tmp_path / "e")  # from the onnxruntime backend: its ONNX file is copied, not exported again
    engine = speccomp.load(tmp_path / "e")
    assert len(engine.session.layers) == 2 * 4  # the copied graph writes the cache in place, bound per layer
    if drafter is not None:
        engine_steps, torch_steps = record_steps(engine.drafter, False), record_steps(fast.drafter, True)
    for seed in (0, 1):
        ids = repetitive_prompt(seed)
        out = engine.generate(ids.numpy(), max_new_tokens=30, eos_token_id=2)
        assert out.dtype == np.int64
        assert np.array_equal(out, hf_greedy(llama, ids, 30).numpy()), (drafter, seed)
        assert np.array_equal(out, fast.generate(ids, max_new_tokens=30, eos_token_id=2).numpy())
        assert engine.last_stats["steps"] == fast.last_stats["steps"], (drafter, seed)
    if drafter is not None:
        assert engine_steps == torch_steps and len(engine_steps) > 10, "the same drafts, the same accepted paths"
        assert engine.last_stats["tau"] > 1.2, "drafts were accepted (else the tree path is untested)"


def steps_like_torch(engine, fast, model):
    """HF greedy's text from the engine on three repetitive prompts, in as many steps as the torch runtime `fast`
    (the same drafts), with drafts accepted; returns the last prompt."""
    taus = []
    for seed in (0, 1, 2):
        ids = repetitive_prompt(seed)
        out = engine.generate(ids.numpy(), max_new_tokens=30, eos_token_id=2)
        assert np.array_equal(out, hf_greedy(model, ids, 30).numpy()), seed
        fast.generate(ids, max_new_tokens=30, eos_token_id=2)
        assert engine.last_stats["steps"] == fast.last_stats["steps"], seed
        taus.append(engine.last_stats["tau"])
    assert max(taus) > 1.2, "drafts were accepted (else the tree path is untested)"
    return ids


@pytest.mark.parametrize("tied", [True, False])
def test_medusa_engine_greedy_identical_and_drafts_like_torch(tied, tmp_path):
    """Medusa heads in an engine: the target graph returns head states, medusa.onnx projects them. Zero
    ResBlocks make every head read the model's own hidden state, so drafts get accepted on these prompts;
    the engine takes exactly as many steps as the torch MedusaDrafter (the same drafts)."""
    from speccomp.drafters.medusa import MedusaHeads, new_heads, save_medusa

    model = tiny_llama(num_hidden_layers=3, initializer_range=0.2, tie_word_embeddings=True)
    if tied:
        heads = new_heads(model, 3)  # ResBlocks start at zero (Medusa's initialisation)
    else:  # own projections (here copies of the LM head), exported from the heads, not the model
        heads = MedusaHeads(3, 32, model.config.vocab_size)
        with torch.no_grad():
            for proj in heads.proj:
                proj.copy_(model.lm_head.weight)
    save_medusa(heads, tmp_path / "heads")
    fast = speccomp.compile(model, drafter="medusa", drafter_options={"heads": str(tmp_path / "heads")},
                            tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    engine = speccomp.load(fast.export(tmp_path / "e"))
    m = engine.manifest
    assert m["drafter"]["graph"] == "medusa.onnx" and m["graphs"]["medusa"]["outputs"] == ["top_ids"]
    assert m["drafter"]["options"]["states_output"] == m["graphs"]["target"]["outputs"][3]
    ids = steps_like_torch(engine, fast, model)
    plain = speccomp.load(tmp_path / "e", draft=False)  # the speed baseline: the same target graph, no drafter
    out = plain.generate(ids.numpy(), max_new_tokens=30, eos_token_id=2)
    assert np.array_equal(out, hf_greedy(model, ids, 30).numpy()) and "drafter=plain" in repr(plain)
    assert plain.last_stats["steps"] == plain.last_stats["new_tokens"] == out.shape[1] - ids.shape[1]
    with pytest.raises(TypeError, match="draft='no': must be True or False"):
        speccomp.load(tmp_path / "e", draft="no")
    (tmp_path / "e" / "medusa.onnx").unlink()
    with pytest.raises(EngineError, match="medusa graph .* is missing"):
        speccomp.load(tmp_path / "e")


@pytest.fixture(scope="module")
def hydra_model(tmp_path_factory):
    """A tiny tied Llama and random Hydra heads over a draft vocabulary subset (saved in a directory)."""
    from speccomp.drafters.hydra import save_hydra
    from test_medusa import random_hydra

    model = tiny_llama(num_hidden_layers=3, initializer_range=0.2, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("hydra") / "heads"
    save_hydra(random_hydra(model, 3, vocab=torch.arange(3, 80)), path)
    return model, str(path)


@pytest.mark.parametrize("drafter, tree", [
    ("hydra", [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]), ("hydra", "dynamic:8:3"),
    ("hydra+token_recycling", None), ("hydra+token_recycling+ngram", "dynamic:6:2"), ("hydra+suffix", None),
])
def test_hydra_engines_greedy_identical_and_step_like_torch(hydra_model, drafter, tree, tmp_path):
    """Hydra heads in an engine (hydra.onnx: one head step, the tree grown by speccomp/drafters/grow.py, shared with
    the torch drafter), alone and merged with text drafters: HF's greedy text, as many steps as the torch runtime."""
    model, heads = hydra_model
    fast = speccomp.compile(model, drafter=drafter, tree=tree,
                            drafter_options={"heads": heads} if drafter == "hydra" else {"hydra": {"heads": heads}})
    engine = speccomp.load(fast.export(tmp_path / "e"))
    m = engine.manifest
    parts = m["drafter"].get("drafters") or [m["drafter"]]
    assert [p["name"] for p in parts] == drafter.split("+") and m["graphs"]["hydra"]["file"] == "hydra.onnx"
    steps_like_torch(engine, fast, model)
    # two sessions (target, hydra step): the light head step runs on one thread, so the target's pool may spin
    head = engine.drafter.drafters[0].session if "+" in drafter else engine.drafter.session
    assert [pool(x.session) for x in (engine.session, head)] == [("spins", 0), ("sleeps", 1)]


def pool(session) -> tuple[str, int]:
    """An ONNX Runtime session's intra-op pool: whether idle threads spin, its thread count (0: ORT's default)."""
    options = session.get_session_options()
    try:
        sleeps = options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    except Exception:  # ORT raises when the entry was never set: its default, spinning
        sleeps = False
    return ("sleeps" if sleeps else "spins"), options.intra_op_num_threads


@pytest.fixture(scope="module")
def eagle_model(tmp_path_factory):
    """A tiny tied Llama and a random EAGLE layer over a draft vocabulary subset (saved in a directory)."""
    from speccomp.drafters.eagle import save_eagle
    from test_eagle import random_eagle

    model = tiny_llama(num_hidden_layers=3, initializer_range=0.2, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("eagle") / "head"
    save_eagle(random_eagle(model, vocab=torch.arange(3, 80)), path)
    return model, str(path)


@pytest.mark.parametrize("drafter, tree, backend", [
    ("eagle", [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], "eager"), ("eagle", "dynamic:8:3", "onnxruntime"),
    ("eagle+token_recycling", None, "onnxruntime"),
])
def test_eagle_engines_greedy_identical_and_step_like_torch(eagle_model, drafter, tree, backend, tmp_path):
    """The EAGLE layer in an engine (eagle.onnx: the layer step with its cache in and out; the cache and the tree's
    growth are speccomp/drafters/eagle_cache.py's, shared with the torch drafter), alone and merged: HF's greedy
    text in as many steps as the torch runtime; the onnxruntime backend's file is the one the engine carries."""
    model, head = eagle_model
    fast = speccomp.compile(model, drafter=drafter, tree=tree, backend=backend,
                            drafter_options={"heads": head} if drafter == "eagle" else {"eagle": {"heads": head}})
    engine = speccomp.load(fast.export(tmp_path / "e"))
    part = (engine.manifest["drafter"].get("drafters") or [engine.manifest["drafter"]])[0]
    assert part["name"] == "eagle" and part["graph"] == "eagle.onnx" and part["options"]["head_dim"] == 8
    if backend == "onnxruntime":
        step = (fast.drafter.drafters[0] if "+" in drafter else fast.drafter).step
        assert (tmp_path / "e" / "eagle.onnx").read_bytes() == step.path.read_bytes()
    steps_like_torch(engine, fast, model)
    broken = json.loads((tmp_path / "e" / "manifest.json").read_text())
    (broken["drafter"].get("drafters") or [broken["drafter"]])[0]["options"]["head_dim"] = 4
    (tmp_path / "e" / "manifest.json").write_text(json.dumps(broken))
    with pytest.raises(EngineError, match="reads a cache of 4 heads of size 8 but drafter.options say 4 of 4"):
        speccomp.load(tmp_path / "e")


@pytest.mark.parametrize("drafter, options, tree, backend", [
    ("early_exit", {"exit_layer": 1}, [[0], [1], [0, 0], [0, 0, 0]], "onnxruntime"),
    ("layer_skip", {"skip": [2]}, "dynamic:6:2", "onnxruntime"),
    ("layer_skip", {"skip": [1]}, 3, "eager"),  # the draft graph exported from the SpecGraph, not copied
    ("early_exit+token_recycling", {"early_exit": {"exit_layer": 2}}, None, "onnxruntime"),
])
def test_self_drafter_engines_greedy_identical(llama, drafter, options, tree, backend, tmp_path):
    """Graph self-drafters in an engine: NAME.onnx (the target graph with layers bypassed) drafts depth by depth over
    the engine's own cache, its trees grown by grow.py as in the torch runtime: HF's greedy text in as many steps."""
    fast = speccomp.compile(llama, drafter=drafter, drafter_options=options, tree=tree, backend=backend)
    engine = speccomp.load(fast.export(tmp_path / "e"))
    name = drafter.split("+")[0]
    part = (engine.manifest["drafter"].get("drafters") or [engine.manifest["drafter"]])[0]
    graph_drafter = fast.drafter.drafters[0] if "+" in drafter else fast.drafter
    assert part["graph"] == f"{name}.onnx" and part["options"]["kv_layers"] == graph_drafter.layer_index.tolist()
    steps_like_torch(engine, fast, llama)


def test_a_static_tree_deeper_than_dynamic_growth_drafts_whole_in_an_engine(llama, tmp_path):
    """A drafter's own max_depth (6 for the self-drafters) bounds the growth of a dynamic tree only: a static chain of
    8 drafts all 8 levels in torch (grow.grow) and in the engine (which once cut it to 6: same text, more steps)."""
    from test_speculative import repetitive_prompt as looping_prompt

    fast = speccomp.compile(llama, drafter="early_exit", drafter_options={"exit_layer": 2}, tree=8,
                            backend="onnxruntime")
    engine = speccomp.load(fast.export(tmp_path / "e"))
    ids = looping_prompt(96, 1)  # one the drafter follows for long
    assert np.array_equal(engine.generate(ids.numpy(), max_new_tokens=30), hf_greedy(llama, ids, 30).numpy())
    fast.generate(ids, max_new_tokens=30)
    assert len(fast.last_stats["acceptance_by_depth"]) == 8 and fast.last_stats["acceptance_by_depth"][7] > 0
    assert engine.last_stats["steps"] == fast.last_stats["steps"]
    # a hand-edited layer list: past the target's 4 layers (an IndexError at the first draft) or a layer twice
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    for layers in ([0, 9], [0, 0]):
        manifest["drafter"]["options"]["kv_layers"] = layers
        (tmp_path / "e" / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(EngineError, match=r"drafter.options.kv_layers=\[0, \d\] is not distinct layer indices "
                                              r"of the target's 4 layers"):
            speccomp.load(tmp_path / "e")


@pytest.mark.parametrize("kv_cache, options, tree, backend", [
    ("sink:16", None, None, "onnxruntime"),
    ("snapkv:16", None, [[0], [1], [0, 0]], "onnxruntime"),  # votes from the graph's attention output
    ("h2o:16", {"skip": [1]}, "dynamic:6:2", "eager"),  # + the root's attention each step; fewer layers too
    ("kivi4:8:8", None, 3, "onnxruntime"),
    ("sink:16", {"weights": "int4"}, 3, "onnxruntime"),  # QuantSpec's hierarchy: 4-bit weights over the sink cache
    ("sink:16", {"weights": "int8"}, 3, "onnxruntime"),  # 8-bit
])
def test_compressed_kv_engines_greedy_identical_and_step_like_torch(llama, kv_cache, options, tree, backend,
                                                                     tmp_path):
    """kv_mode="draft": compressed_kv.onnx drafts over a compressed copy of the engine's cache, kept by the torch
    runtime's own numpy cache (speccomp/kv/cache.py): HF's greedy text in as many steps as the torch runtime, with
    the cache really compressed (18-token prompts + 30 new tokens against budgets of 16 / KIVI groups of 8)."""
    fast = speccomp.compile(llama, kv_cache=kv_cache, drafter_options=options, tree=tree, backend=backend)
    engine = speccomp.load(fast.export(tmp_path / "e"))
    part = engine.manifest["drafter"]
    assert part["name"] == "compressed_kv" and part["graph"] == "compressed_kv.onnx"
    assert part["options"]["kv_cache"] == kv_cache and part["options"]["kv_layers"] == fast.drafter.layer_index.tolist()
    graph = onnx.load(str(tmp_path / "e" / "compressed_kv.onnx"), load_external_data=False).graph
    packed = (options or {}).get("weights")
    assert part["options"].get("weights") == packed and part["light"] == bool(packed)  # the compile's verdict, kept
    assert {onnx.helper.get_attribute_value(a) for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute
            if a.name == "bits"} == ({int(packed[3:])} if packed else set())
    if backend == "onnxruntime":  # a quantised draft step runs on one thread beside the target's spinning pool, in
        # both runtimes (as the quantized drafter's); a float one reads the float model: both pools then sleep
        torch_pools = [pool(x.session) for x in (fast.step, fast.drafter.step)]
        engine_pools = [pool(x.session) for x in (engine.session, engine.drafter.session)]
        assert fast.drafter.light_graphs == bool(packed) == fast.drafter.with_tree(fast.drafter.tree).light_graphs
        if packed:
            assert torch_pools == [("spins", torch.get_num_threads()), ("sleeps", 1)]
            assert engine_pools == [("spins", 0), ("sleeps", 1)]
        else:
            assert [kind for kind, _ in torch_pools + engine_pools] == ["sleeps"] * 4
        if packed == "int8":  # an engine exported before parts recorded "light" keeps the old rule (names only)
            m = json.loads((tmp_path / "e" / "manifest.json").read_text())
            del m["drafter"]["light"]
            (tmp_path / "e" / "manifest.json").write_text(json.dumps(m))
            old = speccomp.load(tmp_path / "e")
            assert [pool(x.session) for x in (old.session, old.drafter.session)] == [("sleeps", 0), ("sleeps", 0)]
    # the manifest names the source model and its end-of-sequence ids (serve, `speccomp run` and Triton stop there;
    # generate() stops only at the eos_token_id it is given)
    assert engine.eos_token_id == llama.generation_config.eos_token_id and engine.manifest["model"]["fingerprint"]
    ids = steps_like_torch(engine, fast, llama)
    assert fast.last_stats["kv_tokens_draft"] < fast.last_stats["kv_tokens_full"] or kv_cache.startswith("kivi")
    assert engine.drafter.compressed.nbytes() == fast.drafter.cache.nbytes() < engine.drafter.cache.nbytes()
    if kv_cache == "h2o:16":  # and without torch in the process
        child = subprocess.run([sys.executable, "-c", TORCH_FREE_CHILD, str(tmp_path / "e"), json.dumps([ids[0].tolist()]),
                                "30"], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert child.returncode == 0, child.stderr[-3000:]
        assert json.loads(child.stdout.strip().splitlines()[-1]) == [hf_greedy(llama, ids, 30).tolist()]


def test_merged_engine_drafts_like_torch(llama, tmp_path):
    """A merge of text drafters: the same merged drafts and accepted paths at every step in both runtimes."""
    fast = speccomp.compile(llama, drafter="token_recycling+ngram", backend="onnxruntime")
    engine = speccomp.load(fast.export(tmp_path / "e"))
    engine_steps, torch_steps = record_steps(engine.drafter, False), record_steps(fast.drafter, True)
    for seed in (0, 1):
        ids = repetitive_prompt(seed)
        out = engine.generate(ids.numpy(), max_new_tokens=30, eos_token_id=2)
        assert np.array_equal(out, hf_greedy(llama, ids, 30).numpy())
        fast.generate(ids, max_new_tokens=30, eos_token_id=2)
    assert engine_steps == torch_steps and len(engine_steps) > 10
    assert any(len(t) > 1 for t, _ in engine_steps) and engine.last_stats["tau"] > 1.2


def test_hydra_engine_runs_without_torch_and_checks_its_manifest(hydra_model, tmp_path):
    model, heads = hydra_model
    path = speccomp.compile(model, drafter="hydra+token_recycling",
                            drafter_options={"hydra": {"heads": heads}}).export(tmp_path / "e")
    prompts = [repetitive_prompt(seed) for seed in (0, 1)]
    child = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_CHILD, str(path), json.dumps([p[0].tolist() for p in prompts]), "30"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    for ids, out in zip(prompts, json.loads(child.stdout.strip().splitlines()[-1])):
        assert out == hf_greedy(model, ids, 30).tolist()
    manifest = json.loads((path / "manifest.json").read_text())
    for edit, needle in [
        (lambda d: d["drafters"][0]["options"].update(tree={"budget": 0, "top_k": 2}), r"drafter.drafters\[0\].options.tree="),
        (lambda d: d["drafters"].reverse(), "drafter.drafters=.*one entry per drafter"),
        (lambda d: d["drafters"][0].update(graph="target.onnx"), r"drafter.drafters\[0\].graph="),
        (lambda d: d["drafters"][0].update(light="yes"), r"drafter.drafters\[0\].light='yes' is not true or false"),
        (lambda d: d["drafters"][0]["options"].update(top=1), "returns the top 10 tokens but drafter.options.top=1"),
    ]:
        broken = json.loads(json.dumps(manifest))
        edit(broken["drafter"])
        (path / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(EngineError, match=needle):
            speccomp.load(path)


def test_engine_sliding_window_past_the_window(tmp_path):
    model = ARCHITECTURES["mistral"].build()
    speccomp.compile(model, drafter="token_recycling").export(tmp_path / "e")
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    out = speccomp.load(tmp_path / "e").generate(ids[0].tolist(), max_new_tokens=30, eos_token_id=2)  # 42 > window 8
    assert np.array_equal(out, hf_greedy(model, ids, 30).numpy())


TORCH_FREE_CHILD = textwrap.dedent("""
    import json, sys
    for name in ("torch", "transformers"):
        sys.modules[name] = None  # any `import torch` in this process now raises ImportError
    import speccomp
    engine = speccomp.load(sys.argv[1])
    prompts = json.loads(sys.argv[2])
    outs = [engine.generate(p, max_new_tokens=int(sys.argv[3]), eos_token_id=2).tolist() for p in prompts]
    assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules if sys.modules[m] is not None)
    print(json.dumps(outs))
""")


def test_a_format_2_token_recycling_engine_still_decodes(engine_dir, llama, tmp_path):
    """Before format 3 an engine's TopK read every node (no top_ids_rows input): such an engine still loads, decodes
    its greedy text and drafts from the table it observes."""
    import shutil

    import onnx

    old = tmp_path / "v2"
    shutil.copytree(engine_dir, old)
    proto = onnx.load(str(old / "target.onnx"))
    nodes = proto.graph.node
    nodes.remove(next(n for n in nodes if n.op_type == "Gather" and "top_ids_rows" in n.input))
    next(n for n in nodes if n.name == "top_ids").input[0] = "logits"
    proto.graph.input.remove(next(i for i in proto.graph.input if i.name == "top_ids_rows"))
    proto.graph.output[-1].type.tensor_type.shape.dim[1].dim_param = "q"
    onnx.save(proto, str(old / "target.onnx"))
    m = json.loads((old / "manifest.json").read_text())
    m["format_version"], m["graphs"]["target"]["inputs"] = 2, m["graphs"]["target"]["inputs"][:-1]
    (old / "manifest.json").write_text(json.dumps(m))
    engine = speccomp.load(old, verify=False)
    ids = repetitive_prompt(0)
    assert np.array_equal(engine.generate(ids.numpy(), max_new_tokens=30, eos_token_id=2), hf_greedy(llama, ids, 30))
    assert engine.last_stats["tau"] > 1.2


def test_engine_runs_without_torch(llama, engine_dir):
    prompts = [repetitive_prompt(seed) for seed in (0, 1)]
    child = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_CHILD, str(engine_dir), json.dumps([p[0].tolist() for p in prompts]), "30"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    outs = json.loads(child.stdout.strip().splitlines()[-1])
    for ids, out in zip(prompts, outs):
        assert out == hf_greedy(llama, ids, 30).tolist()


# ---- bad input ------------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bad_engine_directories(engine_dir, tmp_path):
    with pytest.raises(EngineError, match="no engine directory"):
        load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match="no manifest.json"):
        load(tmp_path / "empty")

    bad = _copy(engine_dir, tmp_path / "json")
    (bad / "manifest.json").write_text("{ not json")
    with pytest.raises(EngineError, match="not valid JSON"):
        load(bad)

    bad = _copy(engine_dir, tmp_path / "version")
    m = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps(dict(m, format_version=99)))
    with pytest.raises(EngineError, match="format_version 99"):
        load(bad)
    (bad / "manifest.json").write_text(json.dumps({k: v for k, v in m.items() if k != "kv"}))
    with pytest.raises(EngineError, match=r"lacks the keys \['kv'\]"):
        load(bad)

    bad = _copy(engine_dir, tmp_path / "corrupt")
    data = bytearray((bad / "target.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the weights
    (bad / "target.onnx").write_bytes(bytes(data))
    with pytest.raises(EngineError, match="does not match its manifest"):
        load(bad)
    (bad / "target.onnx").write_bytes(bytes(data[: len(data) // 3]))  # truncated
    with pytest.raises(EngineError, match="does not match its manifest"):
        load(bad)
    (bad / "target.onnx").unlink()
    with pytest.raises(EngineError, match="target graph .* is missing"):
        load(bad)


def test_a_graph_with_external_weights_is_verified_with_its_data_file(engine_dir, llama, tmp_path):
    """Graphs over 2 GB keep their weights in NAME.onnx.data: the manifest records that file's size and SHA-256
    too, so a corrupt or missing weights file is caught at load like a corrupt graph (not run as other weights)."""
    from speccomp.engine.export import _graph_entry

    eng = _copy(engine_dir, tmp_path / "external")
    proto = onnx.load(str(eng / "target.onnx"))
    onnx.save(proto, str(eng / "target.onnx"), save_as_external_data=True, location="target.onnx.data")
    m = json.loads((eng / "manifest.json").read_text())
    m["graphs"]["target"] = _graph_entry(eng / "target.onnx", proto)
    assert m["graphs"]["target"]["data"]["bytes"] == (eng / "target.onnx.data").stat().st_size > 0
    (eng / "manifest.json").write_text(json.dumps(m))
    ids = torch.tensor([[5, 17, 42, 8, 5, 17]])
    ref = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert load(eng).generate(ids.numpy(), 12).tolist() == ref.tolist()

    data = bytearray((eng / "target.onnx.data").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (eng / "target.onnx.data").write_bytes(bytes(data))
    with pytest.raises(EngineError, match="target graph file .*target.onnx.data does not match its manifest"):
        load(eng)
    (eng / "target.onnx.data").unlink()
    with pytest.raises(EngineError, match="target graph file .*target.onnx.data is missing"):
        load(eng)
    m["graphs"]["target"]["data"] = {"bytes": "many"}
    (eng / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="graphs.target.data"):
        load(eng)


def test_engine_generate_input_errors(engine_dir):
    engine = load(engine_dir)
    with pytest.raises(ValueError, match=r"or a batch \[B, seq\], got shape"):
        engine.generate(np.ones((2, 2, 3), dtype=np.int64), 4)
    with pytest.raises(ValueError, match="attention_mask.*has padding"):  # [n] is one sequence, unpadded
        engine.generate(np.ones(3, dtype=np.int64), 4, attention_mask=np.array([0, 1, 1]))
    padded = engine.generate(np.array([[0, 5, 6]]), 4, attention_mask=np.array([[0, 1, 1]]))  # [1, n]: as HF
    assert padded[:, :1].tolist() == [[0]] and padded[:, 1:].tolist() == engine.generate([5, 6], 4).tolist()
    with pytest.raises(ValueError, match=r"must be in \[0, 96\)"):
        engine.generate([1, 500], 4)
    with pytest.raises(ValueError, match="max_new_tokens=0: must be a positive int"):
        engine.generate([1, 2], 0)
    with pytest.raises(TypeError, match="integer token ids"):
        engine.generate(np.array([1.5, 2.0]), 4)
    with pytest.raises(EngineError, match="without a tokenizer"):
        engine.chat_ids("hello")


def test_missing_execution_provider_is_named(engine_dir, llama):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this machine has the CUDA provider")
    with pytest.raises(EngineError, match="CUDAExecutionProvider .*onnxruntime-gpu"):
        load(engine_dir, provider="cuda")
    with pytest.raises(EngineError, match="TensorrtExecutionProvider .*TensorRT"):
        load(engine_dir, provider="tensorrt")
    with pytest.raises(EngineError, match="unknown execution provider 'gpu'"):
        load(engine_dir, provider="gpu")
    for backend in ("tensorrt", "onnxruntime:cuda"):  # compile fails before capturing anything, naming backend=
        with pytest.raises(speccomp.OptionError,
                           match=f"backend='{backend}': .*onnxruntime-gpu.*or backend='onnxruntime'"):
            speccomp.compile(llama, backend=backend)


def test_export_refuses_what_it_cannot_run_or_would_destroy(llama, engine_dir, tmp_path):
    class Mine(Drafter):  # a drafter of the user's own: the torch-free runtime cannot know its algorithm
        name = "mine"

        def propose(self, ctx):
            return Draft(Tree.from_parents([-1]), torch.tensor([ctx.tokens[-1]]))

    with pytest.raises(EngineError, match="drafter 'mine' cannot be exported .* or decodes plainly"):
        speccomp.compile(llama, drafter=Mine()).export(tmp_path / "x")
    assert not (tmp_path / "x").exists()
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("precious")
    fast = speccomp.compile(llama)
    with pytest.raises(EngineError, match="not a speccomp engine; refusing"):
        fast.export(keep, overwrite=True)
    assert (keep / "notes.txt").read_text() == "precious"
    again = _copy(engine_dir, tmp_path / "again")
    with pytest.raises(EngineError, match="overwrite=True"):
        fast.export(again)
    target = read_manifest(again)["graphs"]["target"]
    assert "data" not in target  # a tiny model's weights are inline: no <graph>.onnx.data of the engine's
    (again / f"{target['file']}.data").write_text("mine")  # a user's file of that name was deleted by the overwrite
    with pytest.raises(EngineError, match=rf"files it did not write \['{target['file']}.data'\]"):
        fast.export(again, overwrite=True)
    (again / f"{target['file']}.data").unlink()
    fast.export(again, overwrite=True)  # plain decoding replaces the token_recycling engine
    assert read_manifest(again)["drafter"]["name"] is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary directories left behind"


def test_import_speccomp_does_not_import_torch():
    """Nor does catching a refused engine by the name the README gives, speccomp.EngineError (it was not exported:
    `except speccomp.EngineError` raised AttributeError over the real error)."""
    code = ("import sys, speccomp, speccomp.engine\n"
            "try:\n    speccomp.load('/nonexistent/engine')\nexcept speccomp.EngineError as exc:\n    caught = 'no engine' in str(exc)\n"
            "print(caught, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "True False", out.stderr[-2000:]


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_drafter_is_lossless_and_exports(llama, tmp_path, bits):
    """QuantSpec's self-drafter: the target's graph with 4- or 8-bit MatMulNBits weights drafts, the float graph
    verifies: HF's greedy text, drafts accepted, and the engine (quantized.onnx) steps like the torch runtime."""

    options = None if bits == 8 else {"bits": bits}  # 8: the default
    import onnxruntime

    loaded, session = [], onnxruntime.InferenceSession

    def spy(path, *args, **kwargs):
        loaded.append(Path(path).name)
        return session(path, *args, **kwargs)

    with mock.patch.object(onnxruntime, "InferenceSession", spy):
        fast = speccomp.compile(llama, drafter="quantized", drafter_options=options, backend="onnxruntime")
    # the target's session and the packed draft graph's; the float draft file is only the quantiser's input
    assert sorted(loaded) == sorted([fast.step.path.name, fast.drafter.step.path.name]), loaded
    assert fast.drafter.step.path.name.endswith(f"-int{bits}.onnx")
    proto = onnx.load(str(fast.drafter.step.path))
    weights = {i.name for i in proto.graph.initializer}
    packed = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert packed and {onnx.helper.get_attribute_value(a) for n in packed for a in n.attribute if a.name == "bits"} == {bits}
    assert not [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in weights]  # every weight packed
    engine = speccomp.load(fast.export(tmp_path / "e"))
    part = engine.manifest["drafter"]
    assert part["graph"] == "quantized.onnx" and part["options"]["block_size"] == 128 and part["options"]["bits"] == bits
    steps_like_torch(engine, fast, llama)
    assert fast.last_stats["acceptance_by_depth"][0] > 0.5  # the quantised model mostly agrees with the float one
    # the packed draft step runs on one thread and the target's pool spins, in both runtimes (as the head steps)
    assert fast.drafter.light_graphs and fast.drafter.with_tree(fast.drafter.tree).light_graphs
    assert [pool(x.session) for x in (fast.step, fast.drafter.step)] == [("spins", torch.get_num_threads()), ("sleeps", 1)]
    assert [pool(x.session) for x in (engine.session, engine.drafter.session)] == [("spins", 0), ("sleeps", 1)]
    if bits == 4:
        return
    with pytest.raises(speccomp.OptionError, match="backend='eager'.*MatMulNBits"):
        speccomp.compile(llama, drafter="quantized")
    for block in (24, 512):  # 512: a power of two the quantiser refuses (was a raw RuntimeError after the export)
        with pytest.raises(speccomp.OptionError, match=rf"block_size={block}: ONNX Runtime's quantiser takes blocks of "
                                                       r"\[16, 32, 64, 128, 256\]"):
            speccomp.compile(llama, drafter="quantized", drafter_options={"block_size": block}, backend="onnxruntime")
    with pytest.raises(speccomp.OptionError, match="bits=2: MatMulNBits weights are 4 or 8 bits"):
        speccomp.compile(llama, drafter="quantized", drafter_options={"bits": 2}, backend="onnxruntime")
    with pytest.raises(speccomp.OptionError, match=r"unknown quantized options \['group'\]"):
        speccomp.compile(llama, drafter="quantized", drafter_options={"group": 8}, backend="onnxruntime")


def test_token_recycling_top_k_past_the_vocabulary_exports_and_runs(llama, tmp_path):
    """top_k larger than the vocabulary: torch keeps every token (it clamps); the engine's in-graph TopK must too
    (ONNX Runtime refuses a k past its axis: before, the exported engine failed at its first step)."""
    fast = speccomp.compile(llama, drafter="token_recycling", drafter_options={"top_k": 128}, backend="onnxruntime")
    ids = repetitive_prompt(11)
    ref = fast.generate(ids, max_new_tokens=16)
    assert fast.last_stats["steps"] < 16  # drafts accepted
    engine = speccomp.load(fast.export(tmp_path / "e"))
    assert engine.generate(ids.numpy(), max_new_tokens=16).tolist() == ref.tolist()
    assert engine.last_stats["steps"] == fast.last_stats["steps"]


def test_export_stops_at_the_generation_configs_eos_ids_and_the_tokenizers():
    """A chat model's end-of-turn id often lives only in its generation config (Llama-3-Instruct: [eos, eot]): an
    export with tokenizer= kept only the tokenizer's eos, so engines ran past the end of every turn."""
    from types import SimpleNamespace

    from speccomp.engine.export import _eos_ids

    def model(eos):
        return SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))

    assert _eos_ids(model([2, 7]), SimpleNamespace(eos_token_id=2)) == [2, 7]
    assert _eos_ids(model(7), SimpleNamespace(eos_token_id=2)) == [7, 2]
    assert _eos_ids(model(2), SimpleNamespace(eos_token_id=2)) == 2
    assert _eos_ids(model(None), None) is None and _eos_ids(None, SimpleNamespace(eos_token_id=5)) == 5


def test_the_engine_renders_chat_templates_as_transformers_does(llama, tmp_path):
    """Templates use what transformers' apply_chat_template provides: {% break %} (jinja's loopcontrols), a tojson
    that leaves '<' unescaped, strftime_now (Llama 3's date line) and every named special token (sep_token here).
    The engine renders the same prompt ids as models.chat_ids (it failed to load, or rendered other tokens)."""
    from test_serve import word_tokenizer

    from speccomp.models import chat_ids

    tok = word_tokenizer()
    tok.sep_token = "w9"
    tok.chat_template = ("{% if strftime_now is defined and strftime_now('%Y') | int > 2000 %}w4 {% else %}w5 {% endif %}"
                         "{% if ('<' | tojson) == '\"<\"' %}w6 {% else %}w7 {% endif %}"
                         "{% if tools is not none or documents is not none %}w8 {% endif %}"  # Mistral v0.3's guard
                         "{% for m in messages %}w1 {{ m['content'] }} {{ sep_token }} {% break %}{% endfor %}w3")
    speccomp.compile(llama).export(tmp_path / "e", tokenizer=tok)
    expected = chat_ids(tok, "w10")[0].tolist()
    assert expected == [4, 6, 1, 10, 9, 3]  # no tools block: HF renders tools=None, documents=None
    assert load(tmp_path / "e").chat_ids("w10")[0].tolist() == expected


def test_an_engine_checks_its_tokenizer_as_its_graphs_and_is_found_from_home(llama, tmp_path, monkeypatch):
    """Another tokenizer.json over the engine's loaded silently and encoded prompts into other ids: the manifest now
    lists its size and SHA-256 (`files`), checked at load. `~/engine` loads as export writes it (load took it
    literally); a Triton repository is not made from an engine whose tokenizer is gone (it copied what was there)."""
    from test_serve import word_tokenizer

    from speccomp.engine.triton_repository import export_triton_repository

    monkeypatch.setenv("HOME", str(tmp_path))
    speccomp.compile(llama).export("~/e", tokenizer=word_tokenizer())
    entry = read_manifest(tmp_path / "e")["files"]["tokenizer.json"]
    assert entry["bytes"] == (tmp_path / "e" / "tokenizer.json").stat().st_size and len(entry["sha256"]) == 64
    engine = load("~/e")
    ids = engine.chat_ids("w5 w6")
    padded = [[0, 0, *ids[0].tolist()]]  # a left-padded [1, n] row as nested lists, as an array already was
    out = engine.generate(padded, attention_mask=[[0, 0] + [1] * ids.shape[1]], max_new_tokens=4)
    assert out[:, 2:].tolist() == engine.generate(ids, max_new_tokens=4).tolist() and out[0, :2].tolist() == [0, 0]
    word_tokenizer(50).backend_tokenizer.save(str(tmp_path / "e" / "tokenizer.json"))
    with pytest.raises(EngineError, match="tokenizer .*tokenizer.json does not match its manifest"):
        load(tmp_path / "e")
    load(tmp_path / "e", verify=False)  # verify=False skips digests, as for graphs
    (tmp_path / "e" / "tokenizer.json").unlink()
    with pytest.raises(EngineError, match="tokenizer .*tokenizer.json is missing"):
        export_triton_repository("~/e", tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_a_bfloat16_model_is_refused_before_the_export(tmp_path):
    """numpy holds no bfloat16: the engine exported (minutes for a real model), then never loaded."""
    fast = speccomp.compile(tiny_llama(num_hidden_layers=1).to(torch.bfloat16))
    with pytest.raises(EngineError, match="KV cache is bfloat16.*float32"):
        fast.export(tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_named_chat_templates_export_their_default(tmp_path):
    """transformers allows named chat templates ({"default": ..., "tool_use": ...}); the engine stores the default
    one (what chat uses), where it stored the dict and then failed to load."""
    from test_serve import word_tokenizer

    from speccomp.engine.export import _tokenizer_entry

    tok = word_tokenizer()
    tok.chat_template = {"default": "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}w3", "tool_use": "w4"}
    assert _tokenizer_entry(tok, tmp_path)["chat_template"].startswith("{% for m in messages %}")
    tok.chat_template = {"tool_use": "w4"}  # no default: no template (chat joins the messages' contents)
    assert _tokenizer_entry(tok, tmp_path)["chat_template"] is None


def test_an_onnx_file_with_external_weights_is_copied_with_its_own_data_file(tmp_path):
    """A graph over 2 GB keeps its weights in NAME.onnx.data and names that file inside: a copy under another name
    must name its own copy (the backend's file, named after its passes, is removed at exit)."""
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from speccomp.engine.export import _copy_onnx

    weight = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], initializer=[weight])
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(helper.make_model(graph), str(src / "tree_attention.onnx"), save_as_external_data=True,
              location="tree_attention.onnx.data", size_threshold=0)
    dst = tmp_path / "engine"
    dst.mkdir()
    _copy_onnx(src / "tree_attention.onnx", dst / "target.onnx")
    shutil.rmtree(src)
    assert sorted(p.name for p in dst.iterdir()) == ["target.onnx", "target.onnx.data"]
    y = onnxruntime.InferenceSession(str(dst / "target.onnx")).run(None, {"x": np.ones((1, 3), np.float32)})[0]
    assert y.tolist() == [[12.0, 15.0, 18.0, 21.0]]


def test_a_quantized_draft_past_protobufs_limit_keeps_its_weights_beside_it(llama, tmp_path, monkeypatch):
    """A draft graph whose weights pass 2 GB (a float embedding of 1.8 GB beside int8 matrices: 8B-class models) was
    written as one protobuf: a bare EncodeError after the export. Past the limit (here lowered to 0) its weights go
    to NAME.data, and the draft, the export and the engine read them."""
    from speccomp.backends import onnx_export

    monkeypatch.setattr(onnx_export, "PROTOBUF_LIMIT", 0)
    fast = speccomp.compile(llama, drafter="quantized", backend="onnxruntime")
    path = fast.drafter.step.path
    assert path.with_name(path.name + ".data").is_file()
    engine = speccomp.load(fast.export(tmp_path / "e"))
    assert (tmp_path / "e" / "quantized.onnx.data").is_file()
    steps_like_torch(engine, fast, llama)
