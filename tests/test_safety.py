"""Hardening: nothing of the user's is lost, nothing fails silently, concurrent calls are safe.

export never deletes what it did not write; head checkpoints are checked against their safetensors
header before anything is allocated; generate's arguments are typed; model identity ignores how a
model was loaded; ONNX Runtime's silent CPU fallback and telemetry are caught / off; triton refuses a
model it would not change; a kv_mode='target' model refuses export; the prompt sets ship in the repo.
"""
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import speccomp
from speccomp.engine.export import _check_replaceable, check_destination, swap_in
from speccomp.engine.runtime import MANIFEST, EngineError, check_session_providers
from speccomp.errors import OptionError, OptionTypeError
from speccomp.drafters.medusa import HeadsError, load_medusa, new_heads, save_medusa
from speccomp.models import fingerprint
from tiny_models import tiny_llama

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def engine_dir(llama, tmp_path_factory):
    """One exported ngram engine (plain eager compile: the export itself makes the ONNX file)."""
    return speccomp.compile(llama, drafter="ngram").export(tmp_path_factory.mktemp("eng") / "engine")


def repetitive(seed=0, n=18):
    base = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(seed))
    return base.repeat(n // 6 + 1)[:n][None]


# --------------------------------------------------------------------------------------
# 1. export never deletes what it did not write
# --------------------------------------------------------------------------------------
def test_export_refuses_folders_it_did_not_write(llama, engine_dir, tmp_path, monkeypatch):
    fast = speccomp.compile(llama)
    webapp = tmp_path / "webapp"
    webapp.mkdir()
    (webapp / MANIFEST).write_text(json.dumps({"name": "my web app", "icons": []}))  # a manifest.json, not ours
    (webapp / "index.html").write_text("<html>")
    with pytest.raises(EngineError, match="not a speccomp engine"):
        fast.export(webapp, overwrite=True)
    assert sorted(p.name for p in webapp.iterdir()) == ["index.html", MANIFEST]
    # an engine plus a file of the user's: overwrite would delete the file, so it is refused
    mixed = tmp_path / "mixed"
    shutil.copytree(engine_dir, mixed)
    (mixed / "notes.txt").write_text("precious")
    with pytest.raises(EngineError, match=r"files it did not write \['notes.txt'\]"):
        fast.export(mixed, overwrite=True)
    assert (mixed / "notes.txt").read_text() == "precious" and (mixed / MANIFEST).is_file()
    # an engine whose graph file was replaced by hand after its export: not what export wrote, so it is kept
    edited = tmp_path / "edited"
    shutil.copytree(engine_dir, edited)
    (edited / "target.onnx").write_bytes(b"the user's own graph")
    with pytest.raises(EngineError, match=r"files \['target.onnx'\] changed after its export"):
        fast.export(edited, overwrite=True)
    assert (edited / "target.onnx").read_bytes() == b"the user's own graph"
    # ".", the working directory's parents, the home directory, the root: refused whatever they hold
    work = tmp_path / "home" / "me" / "project"
    work.mkdir(parents=True)
    (work / "code.py").write_text("print(1)")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home" / "me"))
    for target in (".", "..", work, tmp_path / "home" / "me", "~", "/"):
        with pytest.raises(EngineError, match="refusing to export into"):
            check_destination(target, overwrite=True)
    assert (work / "code.py").read_text() == "print(1)"
    (tmp_path / "file").write_text("x")
    with pytest.raises(EngineError, match="not a directory"):
        check_destination(tmp_path / "file", overwrite=True)
    with pytest.raises(OptionTypeError, match="path=3: must be a directory path"):
        check_destination(3, overwrite=False)
    with pytest.raises(OptionTypeError, match="overwrite='yes': must be True or False"):
        check_destination(tmp_path / "new", overwrite="yes")
    assert check_destination(tmp_path / "new" / "engine", overwrite=False) == tmp_path / "new" / "engine"


def test_export_into_an_empty_folder_loads_and_leaves_no_temporaries(llama, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    path = speccomp.compile(llama).export(empty)
    assert path == empty and speccomp.load(empty).generate([5, 6, 7], 3).shape == (1, 6)
    assert [p.name for p in tmp_path.iterdir()] == ["empty"], "no temporary directories left beside it"


def _fake_engine(path: Path, text: str) -> Path:
    path.mkdir()
    (path / MANIFEST).write_text(json.dumps({"format": "speccomp-engine", "graphs": {}, "note": text}))
    return path


def _swap_in(new, path, overwrite):
    """export's swap: `path` replaced where it is an engine export may replace."""
    swap_in(new, path, lambda where: _check_replaceable(where, overwrite, path))


def test_swap_keeps_the_old_engine_when_the_new_one_cannot_move_in(tmp_path, monkeypatch):
    old, new = _fake_engine(tmp_path / "engine", "old"), _fake_engine(tmp_path / ".engine-new", "new")
    rename = os.rename

    def failing(src, dst):
        if Path(src) == new:
            raise OSError("disk full")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(EngineError, match="could not move the new engine"):
        _swap_in(new, old, overwrite=True)
    assert "old" in (old / MANIFEST).read_text(), "the previous engine is back in place"
    monkeypatch.setattr(os, "rename", rename)
    _swap_in(new, old, overwrite=True)
    assert "new" in (old / MANIFEST).read_text() and sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


def test_swap_checks_what_is_there_at_the_last_moment(tmp_path):
    """Files that appear at the destination after the export's checks (another program writing there) are never
    deleted: an empty destination that filled up, or an engine that got a user's file, is left as it is."""
    new = _fake_engine(tmp_path / ".new", "new")
    late = tmp_path / "late"
    late.mkdir()
    (late / "thesis.tex").write_text("precious")  # appeared after check_destination saw an empty directory
    with pytest.raises(EngineError, match="not a speccomp engine"):
        _swap_in(new, late, overwrite=True)
    engine = _fake_engine(tmp_path / "engine", "old")
    (engine / "thesis.tex").write_text("precious")
    with pytest.raises(EngineError, match=r"files it did not write \['thesis.tex'\]"):
        _swap_in(new, engine, overwrite=True)
    for where in (late, engine):
        assert (where / "thesis.tex").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".new", "engine", "late"], "nothing moved aside is left"


# --------------------------------------------------------------------------------------
# 2. head checkpoints: the header is checked before anything is allocated
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, field, value, words", [
    ("medusa", "medusa_num_heads", 1_000_000_000, "config.json says 1000000000 heads"),
    ("medusa", "medusa_num_layers", 10**9, "x 1000000000 layers"),
    ("medusa", "medusa_num_heads", "4", "medusa_num_heads must be a positive int"),
    ("hydra", "hydra_num_layers", 10**9, "x 1000000000 layers"),
    ("eagle", "intermediate_size", 10**9, r"gate_up.weight has shape \[128, 32\], but heads for this model need \[2000000000, 32\]"),
    ("eagle", "rope_theta", "big", "rope_theta must be a positive number"),
])
def test_edited_head_configs_are_refused_before_allocation(llama, tmp_path, kind, field, value, words):
    from speccomp.drafters.eagle import load_eagle, new_eagle, save_eagle
    from speccomp.drafters.hydra import load_hydra, new_hydra, save_hydra

    make, save, load = {
        "medusa": (lambda: new_heads(llama, 2), save_medusa, load_medusa),
        "hydra": (lambda: new_hydra(llama, torch.arange(10), 2), save_hydra, load_hydra),
        "eagle": (lambda: new_eagle(llama, torch.arange(10), intermediate=64), save_eagle, load_eagle),
    }[kind]
    save(make(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadsError, match=words):
        load(tmp_path, llama)


def test_head_shape_errors_name_the_tensor_and_both_shapes(llama, tmp_path):
    other = tiny_llama(hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    save_medusa(new_heads(other, 2), tmp_path)
    with pytest.raises(HeadsError, match="hidden size 48 .*the model has hidden size 32"):
        load_medusa(tmp_path, llama)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["hidden_size"]  # now only the weights can tell
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadsError, match=r"0.0.linear.weight has shape \[48, 48\], but heads for this model need \[32, 32\]"):
        load_medusa(tmp_path, llama)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HeadsError, match="not valid JSON"):
        load_medusa(tmp_path, llama)
    with pytest.raises(OptionTypeError, match="heads=3: must be a path"):
        speccomp.compile(llama, drafter="medusa", drafter_options={"heads": 3})


# --------------------------------------------------------------------------------------
# 3. concurrent generate calls
# --------------------------------------------------------------------------------------
def _threads(work, n):
    results, errors = [None] * n, []

    def run(i):
        try:
            results[i] = work(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_specmodel_generate_from_threads_equals_sequential(llama):
    """Seeded sampling with a stateful drafter (Token Recycling's table, the n-gram index) from 4 threads at
    once gives each call exactly what it gives alone, and each thread reads its own last_stats."""
    fast = speccomp.compile(llama, drafter="token_recycling")
    calls = [dict(input_ids=repetitive(i), max_new_tokens=10 + i, do_sample=True, temperature=0.8, seed=i) for i in range(4)]
    alone = [fast.generate(**c) for c in calls]

    def work(i):
        out = fast.generate(**calls[i])
        return out, fast.last_stats["new_tokens"]

    for out, (got, new_tokens) in zip(alone, _threads(work, 4)):
        assert torch.equal(got, out) and new_tokens == out.shape[1] - 18


def test_engine_generate_from_threads_equals_sequential(engine_dir):
    engine = speccomp.load(engine_dir)
    prompts = [repetitive(i)[0].tolist() for i in range(4)]
    alone = [engine.generate(p, 12 + i, do_sample=i % 2 == 1, seed=i) for i, p in enumerate(prompts)]

    def work(i):
        out = engine.generate(prompts[i], 12 + i, do_sample=i % 2 == 1, seed=i)
        return out, engine.last_stats["new_tokens"]

    for out, (got, new_tokens) in zip(alone, _threads(work, 4)):
        assert np.array_equal(got, out) and new_tokens == out.shape[1] - 18


# --------------------------------------------------------------------------------------
# 4. generate's arguments are typed, in both runtimes
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, words", [
    (dict(eos_token_id="88"), OptionTypeError, "eos_token_id='88': must be a token id"),
    (dict(eos_token_id=[2.0]), OptionTypeError, "eos_token_id=.*must be an int"),
    (dict(eos_token_id=500), OptionError, r"outside the vocabulary \[0, 96\)"),
    (dict(do_sample="False"), OptionTypeError, "do_sample='False': must be True or False"),
    (dict(temperature="hot"), OptionTypeError, "temperature='hot': must be a number"),
    (dict(top_p=float("nan")), OptionError, "top_p=nan: must be a finite number"),
    (dict(seed="1"), OptionTypeError, "seed='1': must be an int"),
])
def test_generate_argument_types(llama, engine_dir, kwargs, error, words):
    fast, engine = speccomp.compile(llama), speccomp.load(engine_dir)
    for model in (fast, engine):
        with pytest.raises(error, match=words):
            model.generate([5, 6, 7], 4, **kwargs)


def test_eos_ids_of_every_integer_kind_stop_both_runtimes(llama, engine_dir):
    fast, engine = speccomp.compile(llama, drafter="ngram"), speccomp.load(engine_dir)
    ids = repetitive(1)
    free = fast.generate(ids, 20)[0, 18:].tolist()
    eos = free[5]
    stop = free.index(eos) + 1
    for kind in (eos, np.int64(eos), torch.tensor(eos), [eos], (np.int32(eos),), np.array([eos])):
        assert fast.generate(ids, 20, eos_token_id=kind)[0, 18:].tolist() == free[:stop]
        assert engine.generate(ids.numpy(), 20, eos_token_id=kind)[0, 18:].tolist() == free[:stop]


def test_compile_leaves_the_users_model_as_it_was():
    model = tiny_llama().train()
    model.model.layers[1].eval()  # a mixed state is restored as it was, module by module
    modes = {name: m.training for name, m in model.named_modules()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = speccomp.compile(model, drafter="ngram")
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model.eval()
    ids = repetitive(2)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(fast.generate(ids, 12), ref)  # the graph was captured in eval mode (no dropout)


# --------------------------------------------------------------------------------------
# 5. identity depends on the math only
# --------------------------------------------------------------------------------------
def test_fingerprint_ignores_how_the_model_was_loaded():
    a, b = tiny_llama(), tiny_llama()
    b.config._name_or_path = "/somewhere/else"
    b.config.architectures = None
    b.config.quantization_config = {"quant_method": "gguf", "gguf_file": "model.Q4_1.gguf"}
    b.config.use_cache = False
    b.config.pad_token_id = 7
    assert fingerprint(a) == fingerprint(b)
    c = tiny_llama(rope_theta=5000.0)  # math: another rotary base
    d = tiny_llama()
    with torch.no_grad():
        d.model.layers[1].mlp.down_proj.weight.mul_(1.001)  # math: other weights (not their first values only)
    assert len({fingerprint(a), fingerprint(c), fingerprint(d)}) == 3


@pytest.mark.real_model
def test_gguf_loaded_model_finds_shipped_heads_and_default_identity(smollm):
    """`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` as the transformers docs show it is the same
    model as speccomp.load_default_model(): one fingerprint, so the shipped heads are found for both."""
    from transformers import AutoModelForCausalLM

    from speccomp.drafters.head_drafters import find_heads
    from speccomp.models import gguf_path

    src = gguf_path()
    gguf = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    assert fingerprint(gguf) == fingerprint(smollm[0])
    for kind in ("medusa", "hydra", "eagle"):  # find_heads is what compile's head drafters look them up with
        found = find_heads(gguf, kind=kind)
        assert found is not None and found == find_heads(smollm[0], kind=kind), kind
    assert speccomp.compile(gguf, drafter="hydra").drafter.heads.num_heads >= 1  # captured as loaded (quantizer attrs)


# --------------------------------------------------------------------------------------
# 6. nothing silent: providers, triton, lossy export
# --------------------------------------------------------------------------------------
class _Session:  # what ONNX Runtime reports after a silent fallback (needs a GPU to happen for real)
    def get_providers(self):
        return ["CPUExecutionProvider"]


def test_provider_fallback_is_an_error_and_providers_are_shown(llama, engine_dir):
    with pytest.raises(EngineError, match="asked ONNX Runtime for CUDAExecutionProvider, but the session runs on"):
        check_session_providers(_Session(), ["CUDAExecutionProvider", "CPUExecutionProvider"], "target.onnx")
    assert check_session_providers(_Session(), ["CPUExecutionProvider"], "x") == ["CPUExecutionProvider"]
    engine = speccomp.load(engine_dir)
    engine.generate([5, 6], 2)
    assert "CPUExecutionProvider" in repr(engine) and engine.last_stats["providers"] == ["CPUExecutionProvider"]
    fast = speccomp.compile(llama)
    fast.generate([5, 6], 2)
    assert fast.last_stats["providers"] is None and "backend='eager'" in repr(fast)


def test_triton_refuses_a_model_whose_attention_it_would_not_lower():
    from speccomp.backends.triton import check_attention
    from speccomp.backends.triton_attention import TritonBackendError
    from speccomp.frontend.graph import SpecGraph
    from tiny_models import ARCHITECTURES

    gemma2 = ARCHITECTURES["gemma2"].build()  # eager attention (logit softcapping): no SDPA to put in the kernel
    with pytest.raises(TritonBackendError, match="every attention site .* is captured as eager"):
        check_attention(SpecGraph.from_captured(speccomp.capture(gemma2)))  # what lower_triton runs first


def test_errors_survive_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(OptionError("tree", [[0], [0]], "duplicate choice [0]", "list each node once")))
    assert isinstance(err, OptionError) and err.parameter == "tree" and "duplicate choice" in str(err)


def test_lossy_kv_target_model_refuses_export(llama, tmp_path):
    lossy = speccomp.compile(llama, kv_cache="sink:16", kv_mode="target")
    with pytest.raises(EngineError, match="kv_mode='target' model cannot be exported"):
        lossy.export(tmp_path / "e")
    assert not (tmp_path / "e").exists()


# --------------------------------------------------------------------------------------
# 7. offline: ONNX Runtime's telemetry is off
# --------------------------------------------------------------------------------------
def test_onnxruntime_telemetry_is_off():
    assert os.environ.get("ORT_DISABLE_TELEMETRY") == "1"  # set by `import speccomp`, before ORT starts
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed: the DNS look-up check needs it")
    # an export and a session in a fresh process: no look-up of Microsoft's telemetry host
    code = ("import sys; sys.path.insert(0, 'tests'); import speccomp; from tiny_models import tiny_llama; "
            "f = speccomp.compile(tiny_llama(), backend='onnxruntime'); f.generate([5, 6], 2)")
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    def traced(*flags):
        return subprocess.run(["strace", "-f", *flags, "-e", "trace=sendto,connect", sys.executable, "-c", code],
                              capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)

    out = traced("--seccomp-bpf")  # filtered in the kernel: 14 s here instead of 73 s stopping at every syscall
    if out.returncode != 0 and "seccomp" in out.stderr:
        out = traced()  # an strace or kernel without seccomp-bpf filtering
    if "PTRACE" in out.stderr and out.returncode != 0:
        pytest.skip("strace may not trace here (no ptrace permission)")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "events" not in out.stderr and "htons(53)" not in out.stderr, "a DNS look-up left the process"


# --------------------------------------------------------------------------------------
# 11. a clone is self-contained
# --------------------------------------------------------------------------------------
def test_prompt_sets_ship_in_the_repository():
    from speccomp.prompts import SETS, load_prompts, prompt_file

    rows = {name: len(load_prompts(name)) for name in SETS}
    assert rows == {"alpaca": 80, "gsm8k": 77, "humaneval": 80, "vicuna_bench": 78}
    assert all(prompt_file(name).parent == ROOT / "speccomp" / "data" / "prompts" for name in SETS)
    readme = (ROOT / "speccomp" / "data" / "prompts" / "README.md").read_text()
    assert all(f"{name}.jsonl" in readme for name in SETS) and "licence" in readme
    reach = subprocess.run(["git", "grep", "-lE", r"\.\./shared|\"shared\"", "--", "speccomp", "passes", "backends",
                            "tests", "benchmarks/*.py", "benchmarks/*.sh"], capture_output=True, text=True, cwd=ROOT)
    assert reach.stdout.split() == [], "these files still read the shared folder beside the checkout, which a clone lacks"
