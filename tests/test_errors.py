"""Input validation contract: every user-facing option is checked where it is given (compile, load, generate,
export, the CLI before it loads a model) and a bad one raises speccomp's own error naming the parameter and the
offending value (and the fix):

    OptionTypeError (TypeError)   a value of the wrong type (a string where an int is wanted, "False" for a bool)
    OptionError     (ValueError)  a value of the right type that cannot be used (tree rank past the vocabulary)
    EngineError                   engine directories and manifests (missing / mistyped / disagreeing fields)
    HeadsError                    head checkpoints (config.json numbers, weight shapes, another model's heads)

Ints may be Python ints, numpy integers or 0-d integer tensors/arrays (never bools); sequences of ints are lists,
tuples or 1-D integer arrays/tensors (never strings). `compile(model)` leaves the user's model as it was.

Built from an adversarial audit (the cases are the inputs that raised cryptically, late, or not at all, plus a
sample of good ones so that they stay good). Everything runs on tiny random models; the model, its capture, the
compiled models and the engines are built once per module.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import speccomp
from speccomp import OptionError, OptionTypeError
from speccomp.engine.runtime import EngineError
from speccomp.drafters.medusa import HeadsError
from tiny_models import tiny_llama

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

TYPE, VALUE = OptionTypeError, OptionError
VOCAB = 96  # tiny_llama(): vocab 96, hidden 32, 3 layers, 2 KV heads of 8, 256 positions


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _names(cls) -> str:
    return " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))


def expect(cls, call, *needles):
    """call() must raise `cls` (a class or a tuple) whose message contains every needle (a str, or a tuple of
    alternatives). Accepting the input, or raising anything else, fails with what happened instead."""
    try:
        result = call()
    except cls as exc:
        text = str(exc)
        missing = [n for n in needles if not any(str(a) in text for a in (n if isinstance(n, tuple) else (n,)))]
        assert not missing, f"{type(exc).__name__} does not name {missing}: {text}"
        return exc
    except Exception as exc:  # noqa: BLE001 - the wrong kind of error is the finding
        first = (str(exc).splitlines() or [""])[0][:300]
        pytest.fail(f"expected {_names(cls)}, got {type(exc).__module__}.{type(exc).__name__}: {first}")
    pytest.fail(f"expected {_names(cls)}, but the input was accepted (returned {type(result).__name__})")


def _random_heads(model, root: Path, num_heads: int = 2) -> dict[str, str]:
    """Medusa / Hydra / EAGLE checkpoints with random weights for `model` (draft vocabulary: all of it)."""
    from speccomp.drafters.eagle import new_eagle, save_eagle
    from speccomp.drafters.hydra import new_hydra, save_hydra
    from speccomp.drafters.medusa import new_heads, save_medusa

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out = {}
    for kind, (heads, save) in {
        "medusa": (new_heads(model, num_heads), save_medusa),
        "hydra": (new_hydra(model, torch.arange(vocab), num_heads), save_hydra),
        "eagle": (new_eagle(model, torch.arange(vocab)), save_eagle),
    }.items():
        with torch.no_grad():
            for w in heads.parameters():
                w.copy_(torch.randn(w.shape, generator=g) * 0.5)
        save(heads, root / kind)
        out[kind] = str(root / kind)
    return out


def _tiny_tokenizer(vocab: int = VOCAB):
    """A Hugging Face fast tokenizer without a download: words w0 .. w{vocab-1} are ids 0 .. vocab-1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")


# ---------------------------------------------------------------------------------------------
# module fixtures (built once)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def captured(model):
    """compile(captured, ...) rewrites a copy: each compile below costs a fraction of a second."""
    return speccomp.capture(model)


@pytest.fixture(scope="module")
def heads(model, tmp_path_factory):
    return _random_heads(model, tmp_path_factory.mktemp("heads"))


@pytest.fixture(scope="module")
def heads64(tmp_path_factory):
    """Heads of a model with hidden size 64 (the tiny model's is 32)."""
    return _random_heads(tiny_llama(hidden_size=64), tmp_path_factory.mktemp("heads64"))


@pytest.fixture(scope="module")
def plain(captured):
    return speccomp.compile(captured)


@pytest.fixture(scope="module")
def ort_ngram(captured):
    return speccomp.compile(captured, drafter="ngram", backend="onnxruntime")


@pytest.fixture(scope="module")
def engine_dir(ort_ngram, tmp_path_factory):
    """An ngram engine with a tokenizer.json."""
    path = tmp_path_factory.mktemp("engines") / "ngram"
    ort_ngram.export(path, tokenizer=_tiny_tokenizer())
    return path


@pytest.fixture(scope="module")
def medusa_engine_dir(captured, heads, tmp_path_factory):
    """A Medusa engine: 2 heads, tree [[0], [1], [0, 0]] (medusa.onnx returns the top 2 of each head)."""
    path = tmp_path_factory.mktemp("engines") / "medusa"
    fast = speccomp.compile(captured, drafter="medusa", tree=[[0], [1], [0, 0]], drafter_options={"heads": heads["medusa"]})
    fast.export(path)
    return path


@pytest.fixture(scope="module")
def engine(engine_dir):
    return speccomp.load(engine_dir)


# ---------------------------------------------------------------------------------------------
# compile(): options are checked at compile time (never first inside generate)
# ---------------------------------------------------------------------------------------------
MERGE = "early_exit+ngram"

COMPILE_ERRORS = [
    # drafter=
    ("drafter-list", dict(drafter=["ngram"]), TYPE, ("drafter", "ngram")),
    ("drafter-dict", dict(drafter={}), TYPE, ("drafter",)),
    ("drafter-int", dict(drafter=3), TYPE, ("drafter", "3")),
    ("drafter-bool", dict(drafter=True), TYPE, ("drafter", "True")),
    ("drafter-unknown", dict(drafter="nope"), VALUE, ("drafter", "nope")),
    ("drafter-merge-unknown", dict(drafter="a+b"), VALUE, ("drafter", "a+b")),
    ("drafter-merge-duplicate", dict(drafter="ngram+ngram"), VALUE, ("drafter", "ngram+ngram")),
    ("drafter-merge-two-model-drafters", dict(drafter="early_exit+layer_skip"), VALUE, ("drafter", "early_exit+layer_skip")),
    # backend= / kv_cache= / kv_mode=
    ("backend-unknown", dict(backend="cpu"), VALUE, ("backend", "cpu")),
    ("backend-list", dict(backend=["eager"]), TYPE, ("backend", "eager")),
    ("kv_cache-int", dict(kv_cache=3), TYPE, ("kv_cache", "3")),
    ("kv_cache-unknown", dict(kv_cache="foo"), VALUE, ("kv_cache", "foo")),
    ("kv_cache-bad-budget", dict(kv_cache="sink:x"), VALUE, ("kv_cache", "sink:x")),
    ("kv_mode-unknown", dict(kv_cache="sink:16", kv_mode="lossy"), VALUE, ("kv_mode", "lossy")),
    ("kv_mode-int", dict(kv_cache="sink:16", kv_mode=3), TYPE, ("kv_mode", "3")),
    # drafter_options= / tree= without a drafter
    ("drafter_options-list", dict(drafter="ngram", drafter_options=[1]), TYPE, ("drafter_options",)),
    ("drafter_options-str", dict(drafter="ngram", drafter_options="x"), TYPE, ("drafter_options",)),
    ("drafter_options-without-drafter", dict(drafter_options={"max_ngram": 2}), VALUE, ("drafter_options",)),
    ("tree-without-drafter", dict(tree=7), VALUE, ("tree", "7")),
    # ngram / token_recycling options
    ("ngram-max_ngram-str", dict(drafter="ngram", drafter_options={"max_ngram": "3"}), TYPE, ("max_ngram", "3")),
    ("ngram-max_ngram-float", dict(drafter="ngram", drafter_options={"max_ngram": 3.0}), TYPE, ("max_ngram", "3.0")),
    ("ngram-max_ngram-0", dict(drafter="ngram", drafter_options={"max_ngram": 0}), VALUE, ("max_ngram", "0")),
    ("ngram-max-below-min", dict(drafter="ngram", drafter_options={"max_ngram": 1, "min_ngram": 3}), VALUE, ("max_ngram", "min_ngram")),
    ("ngram-unknown-option", dict(drafter="ngram", drafter_options={"bogus": 3}), VALUE, ("bogus",)),
    ("ngram-non-str-key", dict(drafter="ngram", drafter_options={1: 3}), TYPE, ("drafter_options",)),
    ("ngram-tree", dict(drafter="ngram", tree=3), VALUE, ("tree",)),
    ("recycling-top_k-str", dict(drafter="token_recycling", drafter_options={"top_k": "8"}), TYPE, ("top_k", "8")),
    ("recycling-persist-str", dict(drafter="token_recycling", drafter_options={"persist": "no"}), TYPE, ("persist", "no")),
    ("recycling-two-trees", dict(drafter="token_recycling", tree=2, drafter_options={"tree": 3}), VALUE, ("tree",)),
    ("recycling-rank-past-top_k", dict(drafter="token_recycling", tree=[[0], [9]]), VALUE, ("tree", "9", "top_k")),
    ("recycling-dynamic-tree", dict(drafter="token_recycling", tree="dynamic"), VALUE, ("tree", "dynamic")),
    ("recycling-tree-too-big", dict(drafter="token_recycling", tree=100), VALUE, ("tree", "100", "64")),
    # graph self-drafters' options
    ("early_exit-layer-out-of-range", dict(drafter="early_exit", drafter_options={"exit_layer": 5}), VALUE, ("exit_layer", "5")),
    ("early_exit-layer-str", dict(drafter="early_exit", drafter_options={"exit_layer": "1"}), TYPE, ("exit_layer", "1")),
    ("early_exit-layer-float", dict(drafter="early_exit", drafter_options={"exit_layer": 1.0}), TYPE, ("exit_layer", "1.0")),
    ("early_exit-unknown-option", dict(drafter="early_exit", drafter_options={"exit": 1}), VALUE, ("exit",)),
    ("layer_skip-missing-layer", dict(drafter="layer_skip", drafter_options={"skip": [5]}), VALUE, ("skip", "5")),
    ("layer_skip-all-layers", dict(drafter="layer_skip", drafter_options={"skip": [0, 1, 2]}), VALUE, ("skip",)),
    ("layer_skip-empty", dict(drafter="layer_skip", drafter_options={"skip": []}), VALUE, ("skip",)),
    ("layer_skip-str", dict(drafter="layer_skip", drafter_options={"skip": "1"}), TYPE, ("skip", "1")),
    ("layer_skip-float-entry", dict(drafter="layer_skip", drafter_options={"skip": [1.0]}), TYPE, ("skip", "1.0")),
    # tree= forms (each a compile-time error naming tree=)
    ("tree-negative-rank", dict(drafter="early_exit", tree=[[0], [-1]]), VALUE, ("tree", "-1")),
    ("tree-str-entry", dict(drafter="early_exit", tree=[[0], [1, "a"]]), TYPE, ("tree", "a")),
    ("tree-float-entry", dict(drafter="early_exit", tree=[[0], [0.5]]), TYPE, ("tree", "0.5")),
    ("tree-bool-entry", dict(drafter="early_exit", tree=[[0], [True]]), TYPE, ("tree", "True")),
    ("tree-nested-junk", dict(drafter="early_exit", tree=[[[0]]]), TYPE, ("tree",)),
    ("tree-float", dict(drafter="early_exit", tree=3.5), TYPE, ("tree", "3.5")),
    ("tree-bool", dict(drafter="early_exit", tree=True), TYPE, ("tree", "True")),
    ("tree-dict", dict(drafter="early_exit", tree={"a": 1}), TYPE, ("tree",)),
    ("tree-zero", dict(drafter="early_exit", tree=0), VALUE, ("tree", "0")),
    ("tree-negative-chain", dict(drafter="early_exit", tree=-1), VALUE, ("tree", "-1")),
    ("tree-duplicate", dict(drafter="early_exit", tree=[[0], [0]]), VALUE, ("tree", "[0]")),
    ("tree-orphan", dict(drafter="early_exit", tree=[[0, 1]]), VALUE, ("tree", "[0, 1]")),
    ("tree-bad-json", dict(drafter="early_exit", tree="[[0],[1]"), VALUE, ("tree", "[[0],[1]")),
    ("tree-dynamic-zero-budget", dict(drafter="early_exit", tree="dynamic:0:1"), VALUE, ("tree", "dynamic:0:1")),
    ("tree-dynamic-not-int", dict(drafter="early_exit", tree="dynamic:x"), VALUE, ("tree", "dynamic:x")),
    ("tree-dynamic-zero-top_k", dict(drafter="early_exit", tree="dynamic:4:0"), VALUE, ("tree", "dynamic:4:0")),
    # trees that compile accepted and generate then failed on ('selected index k out of range'), or silently cut
    ("early_exit-rank-past-vocab", dict(drafter="early_exit", tree=[[0], [1000]]), VALUE, ("tree", "1000")),
    ("layer_skip-rank-past-vocab", dict(drafter="layer_skip", tree=[[0], [VOCAB]]), VALUE, ("tree", str(VOCAB))),
    ("early_exit-dynamic-top_k-past-vocab", dict(drafter="early_exit", tree="dynamic:4:1000"), VALUE, ("tree", "dynamic:4:1000")),
    ("layer_skip-dynamic-top_k-past-vocab", dict(drafter="layer_skip", tree="dynamic:4:1000"), VALUE, ("tree", "dynamic:4:1000")),
    ("merge-dynamic-top_k-past-vocab", dict(drafter=MERGE, tree="dynamic:4:1000"), VALUE, ("tree", "dynamic:4:1000")),
    ("early_exit-chain-too-big", dict(drafter="early_exit", tree=1000), VALUE, ("tree", "1000", "64")),
    ("early_exit-dynamic-budget-too-big", dict(drafter="early_exit", tree="dynamic:1000"), VALUE, ("tree", "dynamic:1000", "64")),
    # merged drafters' options
    ("merge-options-not-dict", dict(drafter=MERGE, drafter_options={"early_exit": [1]}), TYPE, ("drafter_options", "early_exit")),
    ("merge-options-flat", dict(drafter=MERGE, drafter_options={"exit_layer": 1}), VALUE, ("drafter_options", "exit_layer")),
    ("merge-inner-option-type", dict(drafter=MERGE, drafter_options={"ngram": {"max_ngram": "x"}}), TYPE, ("max_ngram", "x")),
]


@pytest.mark.parametrize("kwargs, cls, needles", [c[1:] for c in COMPILE_ERRORS], ids=[c[0] for c in COMPILE_ERRORS])
def test_compile_rejects_bad_options_at_compile_time(captured, kwargs, cls, needles):
    expect(cls, lambda: speccomp.compile(captured, **kwargs), *needles)


# Head drafters: heads= must be a path; trees must fit the heads (depth) and the vocabulary (ranks, top-k).
HEAD_OPTION_ERRORS = [
    ("medusa-heads-int", "medusa", dict(heads=3), None, TYPE, ("heads", "3")),
    ("medusa-heads-bytes", "medusa", dict(heads=b"/tmp"), None, TYPE, ("heads",)),
    ("hydra-heads-list", "hydra", dict(heads=["/tmp/x"]), None, TYPE, ("heads", "/tmp/x")),
    ("eagle-heads-dict", "eagle", dict(heads={"a": 1}), None, TYPE, ("heads",)),
    ("eagle-heads-float", "eagle", dict(heads=3.0), None, TYPE, ("heads", "3.0")),
    ("medusa-unknown-option", "medusa", dict(top=3), [[0]], VALUE, ("top",)),
    ("medusa-tree-deeper-than-heads", "medusa", {}, [[0], [0, 0], [0, 0, 0]], VALUE, ("tree", "2")),
    ("hydra-tree-deeper-than-heads", "hydra", {}, [[0], [0, 0], [0, 0, 0]], VALUE, ("tree", "2")),
    ("medusa-rank-past-vocab", "medusa", {}, [[0], [VOCAB]], VALUE, ("tree", str(VOCAB))),
    ("hydra-rank-past-vocab", "hydra", {}, [[0], [1000]], VALUE, ("tree", "1000")),
    ("eagle-rank-past-vocab", "eagle", {}, [[0], [1000]], VALUE, ("tree", "1000")),
    ("hydra-dynamic-top_k-past-vocab", "hydra", {}, "dynamic:4:1000", VALUE, ("tree", "dynamic:4:1000")),
    ("eagle-dynamic-top_k-past-vocab", "eagle", {}, "dynamic:4:1000", VALUE, ("tree", "dynamic:4:1000")),
    ("medusa-dynamic-tree", "medusa", {}, "dynamic:4:2", VALUE, ("tree", "dynamic:4:2")),
]


@pytest.mark.parametrize("kind, options, tree, cls, needles", [c[1:] for c in HEAD_OPTION_ERRORS],
                         ids=[c[0] for c in HEAD_OPTION_ERRORS])
def test_compile_rejects_bad_head_drafter_options(captured, heads, kind, options, tree, cls, needles):
    opts = {"heads": heads[kind], **options}
    expect(cls, lambda: speccomp.compile(captured, drafter=kind, tree=tree, drafter_options=opts), *needles)


def test_merged_drafter_heads_option_is_checked(captured):
    expect(TYPE, lambda: speccomp.compile(captured, drafter="medusa+ngram", drafter_options={"medusa": {"heads": 3}}),
           "heads", "3")


# Values the issue says are fine: numpy ints, 0-d tensors, sequences of them, pathlib paths; a checkpoint with fewer
# heads than the default tree is deep, when the user gave no tree.
def _compiles(captured, heads, **kwargs):
    opts = kwargs.pop("drafter_options", None)
    if callable(opts):
        opts = opts(heads)
    return speccomp.compile(captured, drafter_options=opts, **kwargs)


COMPILE_ACCEPTS = [
    ("tree-numpy-int", dict(drafter="early_exit", tree=np.int64(3))),
    ("tree-0d-tensor", dict(drafter="early_exit", tree=torch.tensor(3))),
    ("exit_layer-numpy-int", dict(drafter="early_exit", drafter_options={"exit_layer": np.int64(1)})),
    ("exit_layer-0d-tensor", dict(drafter="early_exit", drafter_options={"exit_layer": torch.tensor(1)})),
    ("skip-numpy-ints", dict(drafter="layer_skip", drafter_options={"skip": [np.int64(1)]})),
    ("skip-numpy-array", dict(drafter="layer_skip", drafter_options={"skip": np.array([1])})),
    ("skip-1d-tensor", dict(drafter="layer_skip", drafter_options={"skip": torch.tensor([1])})),
    ("ngram-numpy-int", dict(drafter="ngram", drafter_options={"num_branches": np.int64(2)})),
    ("medusa-heads-pathlib", dict(drafter="medusa", tree=[[0], [1]], drafter_options=lambda h: {"heads": Path(h["medusa"])})),
    ("medusa-default-tree-2-heads", dict(drafter="medusa", drafter_options=lambda h: {"heads": h["medusa"]})),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in COMPILE_ACCEPTS], ids=[c[0] for c in COMPILE_ACCEPTS])
def test_compile_accepts_numpy_and_tensor_ints(captured, heads, kwargs):
    fast = _compiles(captured, heads, **dict(kwargs))
    out = fast.generate(torch.tensor([[1, 2, 3, 4, 1, 2, 3]]), max_new_tokens=6)
    assert out.shape == (1, 13)
    if kwargs.get("drafter") == "medusa":
        assert fast.drafter.tree.max_depth <= 2, "the default tree must be cut to the checkpoint's 2 heads"


# ---------------------------------------------------------------------------------------------
# compile(model) must not change the user's model
# ---------------------------------------------------------------------------------------------
def _snapshot(model):
    return {
        "modes": {n: m.training for n, m in model.named_modules()},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "storage": {n: p.data_ptr() for n, p in model.named_parameters()},
        "config": model.config.to_dict(),
    }


def _assert_unchanged(model, before, what):
    after = _snapshot(model)
    assert after["modes"] == before["modes"], f"{what} changed train/eval modes"
    for group in ("params", "buffers"):
        changed = [n for n, t in after[group].items() if not torch.equal(t, before[group][n])]
        assert not changed and after[group].keys() == before[group].keys(), f"{what} changed {group} {changed[:5]}"
    assert after["requires_grad"] == before["requires_grad"], f"{what} changed requires_grad"
    assert after["storage"] == before["storage"], f"{what} replaced parameter tensors"
    diff = {k for k in set(after["config"]) | set(before["config"]) if after["config"].get(k) != before["config"].get(k)}
    assert not diff, f"{what} changed the model's config: {sorted(diff)}"
    assert torch.is_grad_enabled(), f"{what} left autograd disabled"


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_compile_leaves_the_users_model_alone(mode, heads):
    model = tiny_llama()
    getattr(model, mode)()
    for p in list(model.parameters())[:2]:  # a partly frozen model stays partly frozen
        p.requires_grad_(False)
    before = _snapshot(model)
    kinds = [dict(), dict(drafter="medusa", tree=[[0], [1], [0, 0]], drafter_options={"heads": heads["medusa"]})]
    for kwargs in kinds if mode == "train" else kinds[:1]:
        fast = speccomp.compile(model, **kwargs)
        _assert_unchanged(model, before, f"compile(model, **{kwargs})")
        assert model.training == (mode == "train")
        fast.generate(torch.tensor([[1, 2, 3, 1, 2]]), max_new_tokens=4)
        _assert_unchanged(model, before, "generate of the compiled model")


# ---------------------------------------------------------------------------------------------
# generate(): SpecModel and Engine check the same arguments the same way
# ---------------------------------------------------------------------------------------------
class _Runtime:
    def __init__(self, kind, runner):
        self.kind, self.runner = kind, runner
        self.ids = np.array([[3, 4, 5, 6, 7, 3, 4, 5, 6]], dtype=np.int64)
        self.ref = np.asarray(self.generate(input_ids=self.ids, max_new_tokens=8))
        self.first = int(self.ref[0, self.ids.shape[1]])

    def generate(self, **kwargs):
        kwargs.setdefault("input_ids", self.ids)
        kwargs.setdefault("max_new_tokens", 8)
        ids = kwargs.pop("input_ids")
        if self.kind == "specmodel" and isinstance(ids, np.ndarray):  # SpecModel is fed tensors, the Engine arrays
            ids = torch.from_numpy(ids)
        return self.runner.generate(ids, **kwargs)


@pytest.fixture(scope="module")
def specmodel_runtime(captured):
    return _Runtime("specmodel", speccomp.compile(captured, drafter="ngram"))


@pytest.fixture(scope="module")
def engine_runtime(engine):
    return _Runtime("engine", engine)


@pytest.fixture(params=["specmodel", "engine"])
def runtime(request):
    return request.getfixturevalue(f"{request.param}_runtime")


SAMPLE = dict(do_sample=True)
GENERATE_ERRORS = [
    # input_ids
    ("input_ids-str", dict(input_ids="hello"), TYPE, ("input_ids", "hello")),
    ("input_ids-None", dict(input_ids=None), TYPE, ("input_ids", "None")),
    ("input_ids-float", dict(input_ids=np.array([[1.0, 2.0]])), TYPE, ("input_ids", "float")),
    ("input_ids-bool", dict(input_ids=np.array([[True, False]])), TYPE, ("input_ids", "bool")),
    ("input_ids-str-list", dict(input_ids=["3", "4"]), TYPE, ("input_ids",)),
    ("input_ids-ragged", dict(input_ids=[[1, 2], [3]]), (TYPE, VALUE), ("input_ids",)),
    # a batch [B, seq] is fine (tests/test_batch.py); its mask must pad on the left
    ("attention_mask-right-padded", dict(input_ids=np.array([[1, 2], [3, 4]]), attention_mask=np.array([[1, 0], [1, 1]])),
     VALUE, ("attention_mask", "left-padded")),
    ("attention_mask-not-binary", dict(input_ids=np.array([[1, 2], [3, 4]]), attention_mask=np.array([[1, 2], [1, 1]])),
     VALUE, ("attention_mask", "0 (padding) and 1")),
    ("input_ids-empty", dict(input_ids=np.zeros((1, 0), dtype=np.int64)), VALUE, ("input_ids",)),
    ("input_ids-empty-batch-rows", dict(input_ids=np.zeros((2, 0), dtype=np.int64)), VALUE, ("input_ids", "empty")),
    ("input_ids-list-past-int64", dict(input_ids=[3, 10**30]), VALUE, ("input_ids", str(10**30))),
    ("input_ids-3d", dict(input_ids=np.ones((1, 1, 2), dtype=np.int64)), VALUE, ("input_ids",)),
    ("input_ids-negative", dict(input_ids=np.array([[-1, 2]])), VALUE, ("input_ids", "-1")),
    ("input_ids-past-vocab", dict(input_ids=np.array([[VOCAB]])), VALUE, ("input_ids", str(VOCAB))),
    # max_new_tokens
    ("max_new_tokens-str", dict(max_new_tokens="8"), TYPE, ("max_new_tokens", "8")),
    ("max_new_tokens-float", dict(max_new_tokens=8.0), TYPE, ("max_new_tokens", "8.0")),
    ("max_new_tokens-bool", dict(max_new_tokens=True), TYPE, ("max_new_tokens", "True")),
    ("max_new_tokens-None", dict(max_new_tokens=None), TYPE, ("max_new_tokens", "None")),
    ("max_new_tokens-0", dict(max_new_tokens=0), VALUE, ("max_new_tokens", "0")),
    ("max_new_tokens-negative", dict(max_new_tokens=-1), VALUE, ("max_new_tokens", "-1")),
    ("max_new_tokens-past-context", dict(max_new_tokens=10**6), VALUE, ("max_new_tokens", "1000000")),
    # eos_token_id: "88" was read character by character (SpecModel) or ignored (Engine)
    ("eos-str", dict(eos_token_id="88"), TYPE, ("eos_token_id", "88")),
    ("eos-float", dict(eos_token_id=88.0), TYPE, ("eos_token_id", "88.0")),
    ("eos-list-of-str", dict(eos_token_id=["88"]), TYPE, ("eos_token_id", "88")),
    ("eos-nested", dict(eos_token_id=[[88]]), (TYPE, VALUE), ("eos_token_id", "88")),
    ("eos-bool", dict(eos_token_id=True), TYPE, ("eos_token_id", "True")),
    ("eos-bytes", dict(eos_token_id=b"x"), TYPE, ("eos_token_id",)),
    ("eos-list-of-float", dict(eos_token_id=[1.5]), TYPE, ("eos_token_id", "1.5")),
    ("eos-negative", dict(eos_token_id=-5), VALUE, ("eos_token_id", "-5")),
    ("eos-past-vocab", dict(eos_token_id=10**6), VALUE, ("eos_token_id", "1000000")),
    # do_sample: "False" sampled
    ("do_sample-str-False", dict(do_sample="False", seed=0), TYPE, ("do_sample", "False")),
    ("do_sample-str-yes", dict(do_sample="yes", seed=0), TYPE, ("do_sample", "yes")),
    # temperature / top_p
    ("temperature-str", dict(temperature="hot"), TYPE, ("temperature", "hot")),
    ("temperature-str-sampling", dict(temperature="hot", **SAMPLE), TYPE, ("temperature", "hot")),
    ("temperature-None", dict(temperature=None), TYPE, ("temperature", "None")),
    ("temperature-list", dict(temperature=[1.0]), TYPE, ("temperature", "1.0")),
    ("temperature-bool", dict(temperature=True, **SAMPLE), TYPE, ("temperature", "True")),
    ("temperature-nan", dict(temperature=float("nan")), VALUE, ("temperature", "nan")),
    ("temperature-inf", dict(temperature=float("inf"), **SAMPLE), VALUE, ("temperature", "inf")),
    ("temperature-negative", dict(temperature=-1.0), VALUE, ("temperature", "-1")),
    ("temperature-0", dict(temperature=0, **SAMPLE), VALUE, ("temperature", "0")),  # greedy takes 0 (below)
    ("top_p-str", dict(top_p="0.9"), TYPE, ("top_p", "0.9")),
    ("top_p-None", dict(top_p=None), TYPE, ("top_p", "None")),
    ("top_p-bool", dict(top_p=True), TYPE, ("top_p", "True")),
    ("top_p-0", dict(top_p=0), VALUE, ("top_p", "0")),
    ("top_p-above-1", dict(top_p=1.5), VALUE, ("top_p", "1.5")),
    ("top_p-nan", dict(top_p=float("nan")), VALUE, ("top_p", "nan")),
    # seed
    ("seed-str", dict(seed="a", **SAMPLE), TYPE, ("seed", "a")),
    ("seed-str-greedy", dict(seed="a"), TYPE, ("seed", "a")),
    ("seed-float", dict(seed=1.5, **SAMPLE), TYPE, ("seed", "1.5")),
    ("seed-list", dict(seed=[1], **SAMPLE), TYPE, ("seed", "[1]")),
    ("seed-bool", dict(seed=True, **SAMPLE), TYPE, ("seed", "True")),
    ("seed-huge", dict(seed=2**70, **SAMPLE), VALUE, ("seed", str(2**70))),
]


@pytest.mark.parametrize("kwargs, cls, needles", [c[1:] for c in GENERATE_ERRORS], ids=[c[0] for c in GENERATE_ERRORS])
def test_generate_rejects_bad_arguments(runtime, kwargs, cls, needles):
    expect(cls, lambda: runtime.generate(**dict(kwargs)), *needles)


SPECMODEL_ONLY_ERRORS = [
    ("acceptance-unknown", dict(acceptance="typical"), VALUE, ("acceptance", "typical")),
    ("acceptance-list", dict(acceptance=["exact"]), TYPE, ("acceptance", "exact")),
    ("acceptance-lossy-greedy", dict(acceptance="typical-lossy"), VALUE, ("acceptance", "typical-lossy")),
]


@pytest.mark.parametrize("kwargs, cls, needles", [c[1:] for c in SPECMODEL_ONLY_ERRORS],
                         ids=[c[0] for c in SPECMODEL_ONLY_ERRORS])
def test_specmodel_generate_rejects_bad_acceptance(specmodel_runtime, kwargs, cls, needles):
    expect(cls, lambda: specmodel_runtime.generate(**dict(kwargs)), *needles)


# numpy ints, 0-d arrays / tensors and sequences of them are ints (eos must stop at the first token it names)
GENERATE_ACCEPTS = [
    ("eos-numpy-int", lambda r: dict(eos_token_id=np.int64(r.first)), "stops"),
    ("eos-0d-tensor", lambda r: dict(eos_token_id=torch.tensor(r.first)), "stops"),
    ("eos-0d-array", lambda r: dict(eos_token_id=np.array(r.first)), "stops"),
    ("eos-list-of-numpy-ints", lambda r: dict(eos_token_id=[np.int64(r.first)]), "stops"),
    ("eos-tuple", lambda r: dict(eos_token_id=(r.first, 0)), "stops"),
    ("max_new_tokens-numpy-int", lambda r: dict(max_new_tokens=np.int64(5)), "five"),
    ("max_new_tokens-0d-tensor", lambda r: dict(max_new_tokens=torch.tensor(5)), "five"),
    ("do_sample-numpy-bool", lambda r: dict(do_sample=np.bool_(False)), "greedy"),
    ("seed-numpy-int", lambda r: dict(seed=np.int64(3), do_sample=True), "runs"),
    ("temperature-numpy-float", lambda r: dict(temperature=np.float32(0.7), do_sample=True, seed=0), "runs"),
]


@pytest.mark.parametrize("make, check", [c[1:] for c in GENERATE_ACCEPTS], ids=[c[0] for c in GENERATE_ACCEPTS])
def test_generate_accepts_numpy_and_tensor_ints(runtime, make, check):
    out = np.asarray(runtime.generate(**make(runtime)))
    n = runtime.ids.shape[1]
    if check == "stops":
        assert out[0, n:].tolist() == [runtime.first], "eos_token_id must stop generation at that token"
    elif check == "five":
        assert out.shape[1] == n + 5
    elif check == "greedy":
        assert out.tolist() == runtime.ref.tolist()
    else:
        assert out.shape[1] == n + 8


def test_sampling_options_without_do_sample_warn_and_decode_greedily(runtime):
    """temperature / top_p without do_sample=True do nothing (greedy decoding): said, as HF says it, not silent."""
    import warnings

    with pytest.warns(UserWarning, match="ignored without do_sample=True"):
        out = runtime.generate(temperature=0.5)
    assert np.asarray(out).tolist() == runtime.ref.tolist()
    with pytest.warns(UserWarning, match="seed=3 are ignored without do_sample=True"):  # was silent
        runtime.generate(seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runtime.generate(temperature=1.0, top_p=1.0)  # the defaults: nothing to say
        out = runtime.generate(temperature=0.0)  # greedy decoding, as HF takes it (was refused, advising greedy)
    assert np.asarray(out).tolist() == runtime.ref.tolist()


# ---------------------------------------------------------------------------------------------
# SpecModel.export(): arguments checked before any export work
# ---------------------------------------------------------------------------------------------
PATH_ERRORS = (OptionTypeError, EngineError)  # a wrong-typed path is a type error about an engine directory

EXPORT_ERRORS = [
    ("path-int", dict(path=3), PATH_ERRORS, ("path", "3")),
    ("path-None", dict(path=None), PATH_ERRORS, ("path", "None")),
    ("path-list", dict(path=["x"]), PATH_ERRORS, ("path",)),
    ("tokenizer-str", dict(tokenizer="gpt2"), (OptionTypeError, EngineError), ("tokenizer", "gpt2")),
    ("tokenizer-int", dict(tokenizer=3), (OptionTypeError, EngineError), ("tokenizer", "3")),
    ("tokenizer-other-vocabulary", dict(tokenizer="vocab200"), (OptionError, EngineError), ("tokenizer", "200", str(VOCAB))),
    ("overwrite-str", dict(overwrite="no"), (OptionTypeError, EngineError), ("overwrite", "no")),
    ("overwrite-None", dict(overwrite=None), (OptionTypeError, EngineError), ("overwrite", "None")),
]


@pytest.mark.parametrize("kwargs, cls, needles", [c[1:] for c in EXPORT_ERRORS], ids=[c[0] for c in EXPORT_ERRORS])
def test_export_rejects_bad_arguments(ort_ngram, tmp_path, kwargs, cls, needles):
    kwargs = dict(kwargs)
    path = kwargs.pop("path", tmp_path / "engine")
    if kwargs.get("tokenizer") == "vocab200":  # a tokenizer of another model: ids the model cannot take
        kwargs["tokenizer"] = _tiny_tokenizer(200)
    expect(cls, lambda: ort_ngram.export(path, **kwargs), *needles)
    assert not (tmp_path / "engine").exists(), "a refused export must leave nothing behind"


def test_export_checks_the_tokenizer_before_exporting_the_graph(plain, tmp_path, monkeypatch):
    """The eager model's export spends seconds in torch.onnx before it looked at tokenizer= (then refused it)."""
    import speccomp.engine.export as onnx_engine

    class GraphExported(BaseException):
        pass

    def exported(*args, **kwargs):
        raise GraphExported("the target graph was exported before tokenizer= was checked")

    monkeypatch.setattr(onnx_engine, "_target_onnx", exported, raising=False)
    monkeypatch.setattr(onnx_engine, "export_onnx", exported, raising=False)
    try:
        expect((OptionTypeError, EngineError), lambda: plain.export(tmp_path / "e", tokenizer="gpt2"), "tokenizer", "gpt2")
    except GraphExported as exc:
        pytest.fail(str(exc))


# ---------------------------------------------------------------------------------------------
# speccomp.load(): its arguments
# ---------------------------------------------------------------------------------------------
LOAD_ERRORS = [
    ("path-int", dict(path=3), PATH_ERRORS, ("path", "3")),
    ("path-None", dict(path=None), PATH_ERRORS, ("path", "None")),
    ("path-list", dict(path=["x"]), PATH_ERRORS, ("path",)),
    ("provider-list", dict(provider=["cpu"]), TYPE, ("provider", "cpu")),
    ("threads-str", dict(threads="2"), TYPE, ("threads", "2")),
    ("threads-float", dict(threads=1.5), TYPE, ("threads", "1.5")),
    ("threads-bool", dict(threads=True), TYPE, ("threads", "True")),
    ("threads-negative", dict(threads=-1), VALUE, ("threads", "-1")),
    ("verify-str", dict(verify="no"), TYPE, ("verify", "no")),
    ("verify-None", dict(verify=None), TYPE, ("verify", "None")),
    ("draft-str", dict(draft="no"), TYPE, ("draft", "no")),
    ("draft-int", dict(draft=0), TYPE, ("draft", "0")),
]


@pytest.mark.parametrize("kwargs, cls, needles", [c[1:] for c in LOAD_ERRORS], ids=[c[0] for c in LOAD_ERRORS])
def test_load_rejects_bad_arguments(engine_dir, kwargs, cls, needles):
    kwargs = dict(kwargs)
    path = kwargs.pop("path", engine_dir)
    expect(cls, lambda: speccomp.load(path, **kwargs), *needles)


def test_load_accepts_numpy_threads(engine_dir):
    assert speccomp.load(engine_dir, threads=np.int64(1)).generate([3, 4, 5], max_new_tokens=2).shape == (1, 5)


def test_load_good_errors_stay_good(engine_dir, tmp_path):
    expect(EngineError, lambda: speccomp.load(tmp_path / "missing"), "missing")
    expect(EngineError, lambda: speccomp.load(engine_dir / "manifest.json"), "manifest.json")
    expect(EngineError, lambda: speccomp.load(engine_dir, provider="gpu"), "provider", "gpu")


# ---------------------------------------------------------------------------------------------
# Engine manifests: every field checked at load, against the graph too (not first inside ONNX Runtime)
# ---------------------------------------------------------------------------------------------
def _set(*path_and_value):
    *path, value = path_and_value

    def edit(m):
        for k in path[:-1]:
            m = m[k]
        m[path[-1]] = value

    return edit


def _del(*path):
    def edit(m):
        for k in path[:-1]:
            m = m[k]
        del m[path[-1]]

    return edit


def _mutated(src: Path, dst: Path, edit=None, files=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        manifest = json.loads((dst / "manifest.json").read_text())
        edit(manifest)
        (dst / "manifest.json").write_text(json.dumps(manifest))
    if files is not None:
        files(dst)
    return dst


MANIFEST_ERRORS = [
    ("files-not-an-object", "ngram", _set("files", 5), ("files",)),
    ("files-entry-without-digest", "ngram", _set("files", {"tokenizer.json": {"bytes": 3}}), ("files",)),
    ("files-outside-the-engine", "ngram", _set("files", {"../x.json": {"bytes": 3, "sha256": "0"}}), ("files",)),
    # missing fields (KeyError before)
    ("missing-model.vocab_size", "ngram", _del("model", "vocab_size"), ("vocab_size",)),
    ("missing-kv.num_layers", "ngram", _del("kv", "num_layers"), ("num_layers",)),
    ("missing-kv.num_kv_heads", "ngram", _del("kv", "num_kv_heads"), ("num_kv_heads",)),
    ("missing-kv.head_dim", "ngram", _del("kv", "head_dim"), ("head_dim",)),
    ("missing-kv.dtype", "ngram", _del("kv", "dtype"), ("dtype",)),
    ("missing-graphs.target.file", "ngram", _del("graphs", "target", "file"), ("file",)),
    ("missing-graphs.target.bytes", "ngram", _del("graphs", "target", "bytes"), ("bytes",)),
    ("missing-graphs.target.sha256", "ngram", _del("graphs", "target", "sha256"), ("sha256",)),
    ("missing-graphs.target.inputs", "ngram", _del("graphs", "target", "inputs"), ("inputs",)),
    ("missing-drafter.name", "ngram", _del("drafter", "name"), ("name",)),
    ("missing-medusa-top", "medusa", _del("drafter", "options", "top"), ("top",)),
    ("missing-medusa-states_output", "medusa", _del("drafter", "options", "states_output"), ("states_output",)),
    # mistyped fields (TypeError / AttributeError before, or a crash inside generate)
    ("model-str", "ngram", _set("model", "llama"), ("model", "llama")),
    ("model-null", "ngram", _set("model", None), ("model", "None")),
    ("kv-list", "ngram", _set("kv", []), ("kv",)),
    ("graphs.target-str", "ngram", _set("graphs", {"target": "target.onnx"}), ("target", "target.onnx")),
    ("drafter-str", "ngram", _set("drafter", "ngram"), ("drafter", "ngram")),
    ("drafter-null", "ngram", _set("drafter", None), ("drafter", "None")),
    ("tokenizer-str", "ngram", _set("tokenizer", "tokenizer.json"), ("tokenizer",)),
    ("vocab_size-str", "ngram", _set("model", "vocab_size", "96"), ("vocab_size", "96")),
    ("vocab_size-null", "ngram", _set("model", "vocab_size", None), ("vocab_size", "None")),
    ("max_positions-str", "ngram", _set("model", "max_positions", "256"), ("max_positions", "256")),
    ("max_positions-negative", "ngram", _set("model", "max_positions", -5), ("max_positions", "-5")),
    ("eos_token_id-str", "ngram", _set("model", "eos_token_id", "2"), ("eos_token_id", "2")),
    ("eos_token_id-float", "ngram", _set("model", "eos_token_id", 2.5), ("eos_token_id", "2.5")),
    # an eos past the vocabulary loaded, then failed every request blaming an argument nobody passed (review)
    ("eos_token_id-past-vocab", "ngram", _set("model", "eos_token_id", 500), ("eos_token_id", "500", str(VOCAB))),
    ("eos_token_id-list-past-vocab", "ngram", _set("model", "eos_token_id", [2, 500]), ("eos_token_id", "500")),
    ("tokenizer.chat_template-int", "ngram", _set("tokenizer", {"file": "tokenizer.json", "chat_template": 5}),
     ("chat_template", "5")),
    ("tokenizer.special_tokens-list", "ngram", _set("tokenizer", {"file": "tokenizer.json", "special_tokens": ["a"]}),
     ("special_tokens", "['a']")),
    ("kv.num_layers-str", "ngram", _set("kv", "num_layers", "3"), ("num_layers", "3")),
    ("kv.head_dim-float", "ngram", _set("kv", "head_dim", 8.0), ("head_dim", "8.0")),
    ("kv.dtype-list", "ngram", _set("kv", "dtype", ["float32"]), ("dtype", "float32")),
    ("max_tree-str", "ngram", _set("max_tree", "abc"), ("max_tree", "abc")),
    ("max_tree-null", "ngram", _set("max_tree", None), ("max_tree", "None")),
    ("max_tree-float", "ngram", _set("max_tree", 2.7), ("max_tree", "2.7")),
    ("max_tree-0", "ngram", _set("max_tree", 0), ("max_tree", "0")),
    ("max_tree-negative", "ngram", _set("max_tree", -3), ("max_tree", "-3")),
    ("max_tree-huge", "ngram", _set("max_tree", 10**9), ("max_tree", "1000000000")),
    ("graphs.target.file-int", "ngram", _set("graphs", "target", "file", 3), ("file", "3")),
    ("drafter.options-list", "ngram", _set("drafter", "options", [1, 2]), ("options",)),
    ("drafter.options-str", "ngram", _set("drafter", "options", "x"), ("options",)),
    ("ngram-unknown-option", "ngram", _set("drafter", "options", {"bogus": 1}), ("bogus",)),
    ("ngram-option-str", "ngram", _set("drafter", "options", {"max_ngram": "4"}), ("max_ngram", "4")),
    ("ngram-option-0", "ngram", _set("drafter", "options", {"max_ngram": 0}), ("max_ngram", "0")),
    ("ngram-option-negative", "ngram", _set("drafter", "options", {"max_depth": -1}), ("max_depth", "-1")),
    # fields that disagree with the graph (loaded fine, then failed inside ONNX Runtime or decoded silently)
    ("vocab_size-smaller-than-graph", "ngram", _set("model", "vocab_size", 50), ("vocab_size", "50", str(VOCAB))),
    ("vocab_size-larger-than-graph", "ngram", _set("model", "vocab_size", 200), ("vocab_size", "200", str(VOCAB))),
    ("kv.num_layers-vs-graph", "ngram", _set("kv", "num_layers", 2), (("num_layers", "layers=2"), "2")),
    ("kv.num_kv_heads-vs-graph", "ngram", _set("kv", "num_kv_heads", 4), (("num_kv_heads", "kv_heads=4"), "4")),
    ("kv.head_dim-vs-graph", "ngram", _set("kv", "head_dim", 16), ("head_dim", "16")),
    ("kv.dtype-vs-graph", "ngram", _set("kv", "dtype", "float16"), (("dtype", "KV layout"), "float16")),
    ("graphs.target.outputs-vs-graph", "ngram", _set("graphs", "target", "outputs", ["a", "b"]), ("outputs",)),
    ("medusa-parents-out-of-range", "medusa", _set("drafter", "options", "parents", [-1, 0, 0, 5]), ("parents",)),
    ("medusa-parents-no-root", "medusa", _set("drafter", "options", "parents", [0, 0]), ("parents",)),
    ("medusa-ranks-past-top", "medusa", _set("drafter", "options", "ranks", [0, 0, 7, 0]), ("ranks", "7")),
    ("medusa-ranks-length", "medusa", _set("drafter", "options", "ranks", [0, 0]), ("ranks",)),
    ("medusa-tree-deeper-than-heads", "medusa", _set("drafter", "options", "parents", [-1, 0, 1, 2]), ("parents",)),
    ("medusa-num_heads-vs-graph", "medusa", _set("drafter", "options", "num_heads", 1), ("num_heads", "1")),
    ("medusa-top-vs-graph", "medusa", _set("drafter", "options", "top", 500), ("top", "500")),
    ("medusa-states_output-unknown", "medusa", _set("drafter", "options", "states_output", "nope"), ("states_output", "nope")),
    ("medusa-states_output-logits", "medusa", _set("drafter", "options", "states_output", "logits"), ("states_output", "logits")),
    # good ones stay good
    ("good-missing-kv", "ngram", _del("kv"), ("kv",)),
    ("good-format_version-str", "ngram", _set("format_version", "1"), ("format_version",)),
    ("good-drafter-unknown", "ngram", _set("drafter", "name", "early_exit"), ("early_exit",)),
    ("good-kv.dtype-unsupported", "ngram", _set("kv", "dtype", "int8"), ("int8",)),
    ("good-inputs-vs-graph", "ngram", _set("graphs", "target", "inputs", ["input_ids"]), ("inputs",)),
]


@pytest.mark.parametrize("kind, edit, needles", [c[1:] for c in MANIFEST_ERRORS], ids=[c[0] for c in MANIFEST_ERRORS])
def test_engine_manifest_is_checked_at_load(engine_dir, medusa_engine_dir, tmp_path, kind, edit, needles):
    src = engine_dir if kind == "ngram" else medusa_engine_dir
    path = _mutated(src, tmp_path / "engine", edit=edit)
    expect(EngineError, lambda: speccomp.load(path), *needles)


TOKENIZER_ERRORS = [
    ("tokenizer.json-missing", lambda d: (d / "tokenizer.json").unlink()),
    ("tokenizer.json-not-json", lambda d: (d / "tokenizer.json").write_text("{oops")),
    ("tokenizer.json-empty", lambda d: (d / "tokenizer.json").write_text("")),
]


@pytest.mark.parametrize("files", [c[1] for c in TOKENIZER_ERRORS], ids=[c[0] for c in TOKENIZER_ERRORS])
def test_engine_tokenizer_file_is_checked_at_load(engine_dir, tmp_path, files):
    path = _mutated(engine_dir, tmp_path / "engine", files=files)
    expect(EngineError, lambda: speccomp.load(path), "tokenizer.json")


def test_engine_chat_template_errors_are_engine_errors(engine_dir, tmp_path):
    """A broken chat template: at load, or at the latest when it is used, an EngineError naming it."""
    path = _mutated(engine_dir, tmp_path / "engine", edit=_set("tokenizer", "chat_template", "{% for %}"))

    def use():
        return speccomp.load(path).chat_ids("w3 w4")

    expect(EngineError, use, "chat_template")


# ---------------------------------------------------------------------------------------------
# Head checkpoints: HeadsError naming the file, the key and both numbers
# ---------------------------------------------------------------------------------------------
WEIGHTS = {"medusa": "medusa_lm_head.safetensors", "hydra": "hydra_heads.safetensors", "eagle": "eagle_head.safetensors"}
TREE = [[0], [1], [0, 0]]


def _edit_heads(src: str, dst: Path, kind: str, config=None, tensors=None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(str(dst / WEIGHTS[kind]))
        tensors(t)
        save_file(t, str(dst / WEIGHTS[kind]))
    return dst


def _cfg(key, value):
    return lambda c: c.__setitem__(key, value)


def _shape(key, *shape):
    return lambda t: t.__setitem__(key, torch.zeros(*shape, dtype=t[key].dtype))


HEAD_FILE_ERRORS = [
    ("medusa-config-heads-float", "medusa", _cfg("medusa_num_heads", 1.5), None, ("medusa_num_heads", "1.5")),
    ("medusa-config-heads-bool", "medusa", _cfg("medusa_num_heads", True), None, ("medusa_num_heads", "True")),
    ("medusa-config-heads-0", "medusa", _cfg("medusa_num_heads", 0), None, ("medusa_num_heads", "0")),
    ("medusa-config-heads-vs-file", "medusa", _cfg("medusa_num_heads", 5), None, ("5",)),
    ("medusa-config-layers-vs-file", "medusa", _cfg("medusa_num_layers", 2), None, ("2",)),
    ("medusa-config-vocab-str", "medusa", _cfg("vocab_size", "abc"), None, ("vocab_size", "abc")),
    ("medusa-config-vocab-vs-model", "medusa", _cfg("vocab_size", 50), None, ("50", str(VOCAB))),
    ("medusa-weight-rows", "medusa", None, _shape("0.0.linear.weight", 33, 32), ("0.0.linear.weight", "33")),
    ("medusa-weight-second-head", "medusa", None, _shape("1.0.linear.weight", 32, 16), ("1.0.linear.weight", "16")),
    ("medusa-bias", "medusa", None, _shape("0.0.linear.bias", 16), ("0.0.linear.bias", "16")),
    ("medusa-integer-weights", "medusa", None,
     lambda t: t.__setitem__("0.0.linear.weight", torch.zeros(32, 32, dtype=torch.int64)), ("0.0.linear.weight",)),
    ("hydra-config-heads-str", "hydra", _cfg("hydra_num_heads", "two"), None, ("hydra_num_heads", "two")),
    ("hydra-embed-second-head", "hydra", None, _shape("hydra_head.1.embed.weight", 32, 16), ("hydra_head.1.embed.weight", "16")),
    ("hydra-bias", "hydra", None, _shape("hydra_head.1.0.linear.bias", 16), ("hydra_head.1.0.linear.bias", "16")),
    ("hydra-draft-vocab-2d", "hydra", None, _shape("draft_vocab", 2, 3), ("draft_vocab",)),
    ("eagle-config-heads-vs-hidden", "eagle", _cfg("eagle_num_heads", 5), None, ("5",)),
    ("eagle-config-intermediate-str", "eagle", _cfg("intermediate_size", "x"), None, ("intermediate_size", "x")),
    ("eagle-o-rows", "eagle", None, _shape("o.weight", 33, 32), ("o.weight", "33")),
    ("eagle-qkv", "eagle", None, _shape("qkv.weight", 96, 16), ("qkv.weight", "16")),
    ("eagle-fc", "eagle", None, _shape("fc.weight", 32, 32), ("fc.weight",)),
]


@pytest.mark.parametrize("kind, config, tensors, needles", [c[1:] for c in HEAD_FILE_ERRORS], ids=[c[0] for c in HEAD_FILE_ERRORS])
def test_head_checkpoints_are_checked(captured, heads, tmp_path, kind, config, tensors, needles):
    path = _edit_heads(heads[kind], tmp_path / kind, kind, config, tensors)
    expect(HeadsError, lambda: speccomp.compile(captured, drafter=kind, tree=TREE, drafter_options={"heads": str(path)}),
           *needles)


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_heads_of_another_hidden_size_name_both_sizes(captured, heads64, kind):
    expect(HeadsError, lambda: speccomp.compile(captured, drafter=kind, tree=TREE, drafter_options={"heads": heads64[kind]}),
           "64", "32")


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_corrupt_or_missing_head_files(captured, heads, tmp_path, kind):
    bad = _edit_heads(heads[kind], tmp_path / "corrupt", kind)
    (bad / WEIGHTS[kind]).write_bytes(b"garbage")
    expect(HeadsError, lambda: speccomp.compile(captured, drafter=kind, tree=TREE, drafter_options={"heads": str(bad)}),
           WEIGHTS[kind])
    cfg = _edit_heads(heads[kind], tmp_path / "config", kind)
    (cfg / "config.json").write_text('"not an object"')
    expect(HeadsError, lambda: speccomp.compile(captured, drafter=kind, tree=TREE, drafter_options={"heads": str(cfg)}),
           "config.json")
    other = "hydra" if kind == "medusa" else "medusa"
    expect(HeadsError, lambda: speccomp.compile(captured, drafter=kind, tree=TREE, drafter_options={"heads": heads[other]}),
           heads[other])


# ---------------------------------------------------------------------------------------------
# The CLI: a bad flag exits 2 with a message naming it, before the model loads; nothing escapes as a traceback
# ---------------------------------------------------------------------------------------------
class ModelLoaded(BaseException):
    """Raised by the stand-in for load_default_model: the CLI got as far as loading the model."""


@pytest.fixture
def cli_main(monkeypatch, capsys):
    from speccomp import cli
    import speccomp.models

    def refuse(*args, **kwargs):
        raise ModelLoaded

    monkeypatch.setattr(speccomp, "load_default_model", refuse, raising=False)
    monkeypatch.setattr(speccomp.models, "load_default_model", refuse)
    threads = torch.get_num_threads()

    def run(argv):
        try:
            try:
                rc = cli.main([str(a) for a in argv])
            except SystemExit as exc:  # argparse
                rc = exc.code
            except ModelLoaded:
                pytest.fail(f"`speccomp {' '.join(map(str, argv))}` loaded the model before reporting the bad flag")
            except Exception as exc:  # noqa: BLE001
                pytest.fail(f"`speccomp {' '.join(map(str, argv))}` escaped with {type(exc).__name__}: {exc}")
        finally:
            torch.set_num_threads(threads)
        return rc, capsys.readouterr().err

    return run


CLI_ERRORS = [
    ("generate-drafter", ["generate", "--prompt", "hi", "--drafter", "nope"], ("drafter", "nope")),
    ("generate-merge", ["generate", "--prompt", "hi", "--drafter", "a+b"], ("drafter", "a+b")),
    ("generate-backend", ["generate", "--prompt", "hi", "--backend", "cpu"], ("backend", "cpu")),
    ("generate-kv-cache", ["generate", "--prompt", "hi", "--kv-cache", "foo"], ("kv", "foo")),
    ("generate-threads-0", ["generate", "--prompt", "hi", "--threads", "0"], ("threads", "0")),
    ("generate-threads-negative", ["generate", "--prompt", "hi", "--threads", "-1"], ("threads", "-1")),
    ("demo-limit", ["demo", "--limit", "0"], ("limit", "0")),
    ("demo-prompts-missing", ["demo", "--prompts", "/nonexistent/prompts.jsonl"], ("/nonexistent/prompts.jsonl",)),
    ("demo-drafter", ["demo", "--drafter", "nope"], ("drafter", "nope")),
    ("export-drafter-unknown", ["export", "{tmp}/out", "--drafter", "nope"], ("drafter", "nope")),
    ("export-backend", ["export", "{tmp}/out", "--backend", "nope"], ("backend", "nope")),
    ("export-into-foreign-directory", ["export", "{tmp}/mine"], ("{tmp}/mine",)),
    ("bench-backend", ["bench", "--backend", "nope"], ("backend", "nope")),
    ("bench-drafter-option", ["bench", "--drafters", "ngram", "--drafter-options", 'ngram={"bogus": 1}'], ("bogus",)),
    ("autotune-drafter", ["autotune", "--drafter", "nope"], ("drafter", "nope")),
    ("autotune-backend", ["autotune", "--backend", "nope"], ("backend", "nope")),
    ("autotune-max-nodes", ["autotune", "--max-nodes", "0"], (("max-nodes", "max_nodes"), "0")),
    ("autotune-max-depth", ["autotune", "--max-depth", "0"], (("max-depth", "max_depth"), "0")),
    ("autotune-ranks", ["autotune", "--ranks", "0"], ("ranks", "0")),
    ("autotune-repeats", ["autotune", "--repeats", "0"], ("repeats", "0")),
    ("autotune-limit", ["autotune", "--limit", "0"], ("limit", "0")),
    ("search-drafter-not-searchable", ["search", "--drafter", "ngram"], ("drafter", "ngram")),
    ("search-drafter-unknown", ["search", "--drafter", "nope"], ("drafter", "nope")),
    ("search-tree", ["search", "--tree", "dynamic:x"], ("tree", "dynamic:x")),
    ("search-limit", ["search", "--limit", "0"], ("limit", "0")),
    ("train-heads-heads", ["train-heads", "--heads", "0"], ("heads", "0")),
    ("train-heads-layers", ["train-heads", "--layers", "0"], ("layers", "0")),
    ("train-heads-epochs", ["train-heads", "--epochs", "0"], ("epochs", "0")),
    ("train-heads-lr", ["train-heads", "--lr", "-1"], (("--lr", "lr=", "learning rate"), "-1")),
    ("train-heads-draft-vocab", ["train-heads", "--kind", "hydra", "--draft-vocab", "0"], (("draft-vocab", "draft_vocab"), "0")),
    ("train-heads-sampled", ["train-heads", "--sampled", "-1"], ("sampled", "-1")),
    ("train-heads-prompts-missing", ["train-heads", "--prompts", "/nonexistent/prompts.jsonl"], ("/nonexistent/prompts.jsonl",)),
    ("train-heads-limit", ["train-heads", "--limit", "0"], ("limit", "0")),
    ("train-heads-out-is-a-file", ["train-heads", "--out", "{tmp}/mine/notes.txt"], ("notes.txt",)),
    ("run-seed", ["run", "--engine", "{engine}", "--prompt", "w3 w4", "--do-sample", "--seed", "-1"], ("seed", "-1")),
    ("generate-seed", ["generate", "--prompt", "hi", "--do-sample", "--seed", "-5"], ("seed", "-5")),  # was after loading
    ("generate-seed-too-large", ["generate", "--prompt", "hi", "--do-sample", "--seed", str(2**63)], ("seed", str(2**63))),
    ("run-threads", ["run", "--engine", "{engine}", "--prompt", "w3 w4", "--threads", "-1"], ("threads", "-1")),
    ("run-tokenizer-missing", ["run", "--engine", "{notok}", "--prompt", "w3 w4"], ("tokenizer.json",)),
    ("run-exported-without-tokenizer", ["run", "--engine", "{untok}", "--prompt", "w3"],
     ("exported without a tokenizer", "speccomp export")),  # was "pass token ids", which `run` cannot take
    ("export-max-new-tokens", ["export", "{tmp}/e", "--max-new-tokens", "5"], ("--max-new-tokens",)),  # was ignored
    ("export-under-a-file", ["export", "{tmp}/mine/notes.txt/engine"], ("notes.txt",)),
    ("export-triton-under-a-file", ["export-triton", "{engine}", "{tmp}/mine/notes.txt"], ("notes.txt",)),
    ("demo-prompts-directory", ["demo", "--prompts", "{tmp}/mine"], ("{tmp}/mine", "directory")),
    ("bench-tree-for-ngram", ["bench", "--drafters", "ngram", "--tree", "3"], ("tree", "ngram")),
    ("generate-quantized-eager", ["generate", "--prompt", "hi", "--drafter", "quantized"], ("backend", "quantized")),
    ("serve-port", ["serve", "{engine}", "--port", "99999"], ("port", "99999")),
    ("search-backend", ["search", "--backend", "onnxruntime"], ("backend", "eager")),  # it times eager only
    ("train-heads-backend", ["train-heads", "--kind", "eagle", "--backend", "x"], ("--backend",)),  # compiles nothing
    ("train-draft-drafter", ["train-draft", "--drafter", "eagle"], ("--drafter",)),
    ("generate-drafter-options-not-json", ["generate", "--prompt", "hi", "--drafter-options", "{path: x}"],
     ("--drafter-options", "not JSON")),
    ("generate-drafter-options-not-object", ["generate", "--prompt", "hi", "--drafter-options", "[1]"],
     ("--drafter-options", "not an object")),
    ("export-drafter-options-bad-option", ["export", "{tmp}/e", "--drafter", "token_recycling", "--drafter-options",
                                           '{"top_k": 0}'], ("--drafter-options", "top_k")),
    ("bench-json-directory", ["bench", "--drafters", "none", "--json", "{tmp}/mine"], ("json", "directory")),
    ("bench-json-under-a-file", ["bench", "--drafters", "none", "--json", "{tmp}/mine/notes.txt/b.json"],
     ("--json", "notes.txt, which is a file")),  # an OS error without the flag before
    ("train-heads-out-under-a-file", ["train-heads", "--out", "{tmp}/mine/notes.txt/heads"],
     ("--out", "notes.txt, which is a file")),  # refused after the model loaded, as an OS error
    ("bench-kv-twice", ["bench", "--drafters", "none", "--kv", "sink:64,sink:64"], ("--kv", "twice")),
    ("bench-kv-empty", ["bench", "--drafters", "none", "--kv", ""], ("--kv", "at least one policy")),  # ignored
    ("demo-device-unknown", ["demo", "--device", "gpu9"], ("device", "gpu9")),
    ("bench-device-unknown", ["bench", "--drafters", "none", "--device", "gpu9"], ("device", "gpu9")),
    ("generate-device-not-cpu-or-cuda", ["generate", "--prompt", "hi", "--device", "meta"], ("device", "meta")),
    ("export-device", ["export", "{tmp}/e", "--device", "cpu"], ("--device",)),  # engines export from the CPU graph
    *([("generate-device-cuda-without-gpu", ["generate", "--prompt", "hi", "--device", "cuda"], ("device", "cuda")),
       ("demo-backend-cudagraphs-without-gpu", ["demo", "--backend", "cudagraphs"], ("backend", "cudagraphs"))]
      if not torch.cuda.is_available() else []),
    # results never replace what they were measured on; flags that would be ignored are refused (review, stop 45)
    ("bench-json-is-the-prompts", ["bench", "--drafters", "none", "--prompts", "{good}", "--json", "{good}"],
     ("--json", "--prompts")),
    ("bench-kv-mode-without-kv", ["bench", "--drafters", "none", "--kv-mode", "target"], ("--kv-mode", "--kv")),
    ("bench-tree-without-drafter-rows", ["bench", "--drafters", "none", "--tree", "3"], ("--tree", "none")),
    ("bench-tree-with-kv-rows-only", ["bench", "--drafters", "none", "--kv", "sink:256", "--tree", "3"], ("--tree",)),
    ("bench-drafter-options-twice", ["bench", "--drafters", "ngram", "--drafter-options", 'ngram={"max_ngram": 3}',
                                     "--drafter-options", 'ngram={"max_ngram": 2}'], ("--drafter-options", "already")),
    ("bench-drafters-twice", ["bench", "--drafters", "ngram,ngram"], ("--drafters", "more than once")),
    ("bench-plot-suffix", ["bench", "--drafters", "none", "--plot", "{tmp}/r.txt"], ("--plot", ".txt")),
    ("autotune-report-suffix", ["autotune", "--report", "{tmp}/r.txt"], ("--report", ".txt")),
    ("search-tree-auto", ["search", "--tree", "auto"], ("--tree", "autotune")),
    ("train-heads-draft-vocab-medusa", ["train-heads", "--kind", "medusa", "--draft-vocab", "100"],
     (("draft-vocab", "draft_vocab"), "100")),
    ("demo-prompts-turns-a-string", ["demo", "--prompts", "{bad}"], ("bad.jsonl:1", "list of strings")),
    ("train-heads-over-heads-no-run-wrote", ["train-heads", "--out", "{tmp}/heads"], ("--out", "no training run")),
    ("train-draft-over-a-draft-no-run-wrote", ["train-draft", "--out", "{tmp}/draft"], ("--out", "no training run")),
    ("train-heads-into-a-user-folder", ["train-heads", "--out", "{tmp}/mine"], ("--out", "no training run started")),
    ("train-draft-into-the-working-directory", ["train-draft", "--out", "."], ("--out", "working directory")),
    # review, 2026-11-29: checked before the model loads (or the engine, or the step-cost measurement)
    ("generate-kv-cache-window-below-the-tree", ["generate", "--prompt", "hi", "--kv-cache", "sink:2"],
     ("--kv-cache", "sink:2", "at least 7")),
    ("generate-kv-cache-superscript", ["generate", "--prompt", "hi", "--kv-cache", "kivi\u00b2"], ("kv", "\u00b2")),
    ("bench-tree-superscript", ["bench", "--drafters", "token_recycling", "--tree", "\u00b2"], ("tree", "\u00b2")),
    ("bench-json-a-users-file", ["bench", "--drafters", "none", "--json", "{tmp}/mine/notes.txt"],
     ("--json", "notes.txt", "refusing to replace")),
    ("bench-plot-a-users-file", ["bench", "--drafters", "none", "--plot", "{tmp}/mine/picture.png"],
     ("--plot", "picture.png", "refusing to replace")),
    ("autotune-report-directory", ["autotune", "--report", "{tmp}/mine/d.png"], ("--report", "directory")),
    ("bench-plot-jpg", ["bench", "--drafters", "none", "--plot", "{tmp}/r.jpg"], ("--plot", "r.jpg", ".png, .pdf, .svg")),
    ("autotune-report-a-users-file", ["autotune", "--report", "{tmp}/mine/picture.png"], ("--report", "refusing")),
    ("train-heads-max-new-tokens-below-heads", ["train-heads", "--heads", "3", "--max-new-tokens", "2"],
     ("--max-new-tokens", "--heads 3")),
    ("run-temperature-without-do-sample", ["run", "--engine", "{engine}", "--prompt", "w3", "--temperature", "0.5"],
     ("--temperature", "--do-sample")),
    ("run-seed-without-do-sample", ["run", "--engine", "{engine}", "--prompt", "w3", "--seed", "3"],
     ("--seed", "--do-sample")),
    ("generate-temperature-without-do-sample", ["generate", "--prompt", "hi", "--temperature", "0.5"],
     ("--temperature", "--do-sample")),  # generate had no sampling flags at all (review, stop 56)
    ("generate-top-p-out-of-range", ["generate", "--prompt", "hi", "--do-sample", "--top-p", "1.5"], ("top-p", "1.5")),
    ("generate-compare-a-sampled-reply", ["generate", "--prompt", "hi", "--do-sample", "--compare"],
     ("compare", "--do-sample")),
    ("serve-host-unresolvable", ["serve", "{engine}", "--host", "no-such-host.invalid"], ("--host", "no-such-host")),
    ("serve-kv-slots-below-one-request", ["serve", "{engine}", "--kv-slots", "1"], ("--kv-slots", "1")),
    # review, 2026-11-29 (second session): a subcommand's unknown flag was blamed on `speccomp`; export-triton made
    # a model folder in a parent of the working directory (`..`: /tmp/speccomp), home or /, where export refuses
    # (that one: test_export_triton_refuses_a_parent_of_the_working_directory, run from a folder of its own)
    ("generate-unknown-flag", ["generate", "--prompt", "hi", "--bogus"], ("speccomp generate:", "--bogus")),
    # good ones stay good
    ("good-max-new-tokens", ["generate", "--prompt", "hi", "--max-new-tokens", "0"], ("max-new-tokens",)),
    ("good-bench-drafters", ["bench", "--drafters", "nope"], ("nope",)),
    ("good-train-heads-synthetic", ["train-heads", "--synthetic", "-1"], ("synthetic", "-1")),
    ("good-run-no-engine", ["run", "--engine", "{tmp}/missing", "--prompt", "hi"], ("{tmp}/missing",)),
    ("good-run-temperature", ["run", "--engine", "{engine}", "--prompt", "w3", "--do-sample", "--temperature", "-1"], ("temperature", "-1")),
    ("good-run-provider", ["run", "--engine", "{engine}", "--prompt", "w3", "--provider", "gpu"], ("provider", "gpu")),
]


@pytest.mark.parametrize("argv, needles", [c[1:] for c in CLI_ERRORS], ids=[c[0] for c in CLI_ERRORS])
def test_cli_reports_bad_flags_before_loading_the_model(cli_main, engine_dir, tmp_path, argv, needles):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    (mine / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n mine")  # a user's picture, not a plot speccomp saved
    (mine / "d.png").mkdir()
    notok = _mutated(engine_dir, tmp_path / "notok", files=lambda d: (d / "tokenizer.json").unlink())
    untok = _mutated(engine_dir, tmp_path / "untok", edit=_set("tokenizer", None),
                     files=lambda d: (d / "tokenizer.json").unlink())
    (tmp_path / "bad.jsonl").write_text('{"turns": "Write a poem"}\n')  # a string, not a list: was read as "W"
    for folder, config in (("heads", {"medusa_num_heads": 2}), ("draft", {"format": "speccomp-draft-model"})):
        (tmp_path / folder).mkdir()  # weights downloaded or saved by hand: no training run's _train/progress.json
        (tmp_path / folder / "config.json").write_text(json.dumps(config))
    good = tmp_path / "good.jsonl"
    good.write_text('{"turns": ["Write a poem"]}\n')
    where = {"{tmp}": str(tmp_path), "{engine}": str(engine_dir), "{notok}": str(notok), "{untok}": str(untok),
             "{good}": str(good),
             "{bad}": str(tmp_path / "bad.jsonl")}

    def fill(text):
        for k, v in where.items():
            text = text.replace(k, v)
        return text

    rc, err = cli_main([fill(a) for a in argv])
    assert rc == 2, f"exit status {rc}; stderr: {err[-500:]}"
    for needle in needles:
        alternatives = tuple(fill(a) for a in (needle if isinstance(needle, tuple) else (needle,)))
        assert any(a in err for a in alternatives), f"stderr does not name {alternatives}: {err[-500:]}"
    assert (mine / "notes.txt").read_text() == "precious"
    assert (mine / "picture.png").read_bytes() == b"\x89PNG\r\n\x1a\n mine"
    assert good.read_text() == '{"turns": ["Write a poem"]}\n'


def test_cli_export_names_the_engine_as_the_model(monkeypatch, capsys, model, tmp_path):
    """`speccomp export` records the model's name in the manifest (what `speccomp serve` answers as): it recorded the
    config's name_or_path, for the default model the local cache folder it was converted into. Python's
    export(model_id=) sets it, and a name that is not a string is refused by name."""
    from speccomp import cli
    from speccomp.engine.runtime import read_manifest

    monkeypatch.setattr(cli, "_load", lambda args: (model, _tiny_tokenizer()))
    threads = torch.get_num_threads()
    try:
        assert cli.main(["export", str(tmp_path / "e"), "--drafter", "none"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert read_manifest(tmp_path / "e")["model"]["name"] == "SmolLM2-135M-Instruct"
    fast = speccomp.compile(model)
    with pytest.raises(OptionTypeError, match=r"^model_id=3: must be a non-empty string"):
        fast.export(tmp_path / "f", model_id=3)
    assert not (tmp_path / "f").exists()
    fast.export(tmp_path / "f", model_id="mine")
    assert read_manifest(tmp_path / "f")["model"]["name"] == "mine"


def test_training_flags_checked_before_the_model_loads_once_it_was_converted(cli_main, tmp_path, monkeypatch):
    """`train-draft --layers N` needs N below the model's layer count, `train-heads --soft-labels` / `--draft-vocab`
    at most its vocabulary: read from the converted model's config.json (no weights), so a bad value fails at once;
    before any conversion there is nothing to read and the model loads."""
    from speccomp.models import DEFAULT_NAME

    monkeypatch.setenv("SPECCOMP_CACHE", str(tmp_path / "cache"))
    with pytest.raises(pytest.fail.Exception, match="loaded the model"):  # no converted config yet: it must load
        cli_main(["train-draft", "--layers", "7", "--out", str(tmp_path / "d")])
    (tmp_path / "cache" / "models" / DEFAULT_NAME).mkdir(parents=True)
    (tmp_path / "cache" / "models" / DEFAULT_NAME / "config.json").write_text(json.dumps({"num_hidden_layers": 6}))
    rc, err = cli_main(["train-draft", "--layers", "7", "--out", str(tmp_path / "d")])
    assert rc == 2 and "num_layers=7" in err and "[1, 5]" in err and "6 layers" in err, err
    assert not (tmp_path / "d").exists()
    with pytest.raises(pytest.fail.Exception, match="loaded the model"):  # a good N goes on to load the model
        cli_main(["train-draft", "--layers", "5", "--out", str(tmp_path / "d")])
    (tmp_path / "cache" / "models" / DEFAULT_NAME / "config.json").write_text(json.dumps({"vocab_size": 50}))
    for argv in (["--soft-labels", "51"], ["--kind", "hydra", "--draft-vocab", "51"]):
        rc, err = cli_main(["train-heads", *argv, "--out", str(tmp_path / "h")])
        assert rc == 2 and f"{argv[-2]}=51: is more than the model's vocabulary (50 tokens)" in err, err


def test_long_values_are_cut_in_the_middle_so_a_path_keeps_its_file_name():
    from speccomp.errors import OptionError

    path = "/tmp/" + "deep/" * 40 + "notes.txt"  # 214 characters: named whole
    assert repr(path) in str(OptionError("out", path, "is a file"))
    longer = "/tmp/" + "deep/" * 100 + "notes.txt"
    message = str(OptionError("out", longer, "is a file", "give a directory"))
    assert "notes.txt'" in message and "..." in message and len(message) < 340
    assert str(OptionError("tree", list(range(100)), "bad")).endswith("98, 99]: bad")


@pytest.mark.parametrize("drafter", ["early_exit", "layer_skip"])
def test_self_drafters_say_a_one_layer_model_is_too_small(drafter):
    """Their defaults on a 1-layer model used to fail on options the user never gave (exit_layer=-1, skip=[0])."""
    with pytest.raises(OptionError, match=f"^model=.*{drafter} .* at least 2.*use a text drafter"):
        speccomp.compile(tiny_llama(num_hidden_layers=1), drafter=drafter)


def test_prompt_files_are_read_as_written_or_refused(tmp_path):
    from speccomp.prompts import load_prompts

    cases = {'{"turns": "Write a poem"}': "list of strings", '["hi"]': "JSON object", '"hi"': "JSON object",
             '{"turns": [1]}': "list of strings", '{"turns": []}': "list of strings", "{": "not JSON",
             '{"turns": ["x"], "category": ["a"]}': "'category' must be a string"}
    for i, (line, words) in enumerate(cases.items()):
        f = tmp_path / f"p{i}.jsonl"
        f.write_text('{"turns": ["fine"]}\n' + line + "\n")
        with pytest.raises(ValueError, match=f"p{i}.jsonl:2: .*{words}"):
            load_prompts(f)
    f.write_text('{"turns": ["one"], "category": null}\n{"turns": ["two"], "category": "c"}\n')
    assert [(p.text, p.category) for p in load_prompts(f)] == [("one", "general"), ("two", "c")]
    assert [p.text for p in load_prompts(f, limit=1)] == ["one"]
    with pytest.raises(ValueError, match="limit must be an int >= 1"):
        load_prompts(f, limit=0)  # was every prompt


def test_output_files_replace_only_what_speccomp_wrote(tmp_path):
    """bench --json / --plot and autotune --report replace an earlier run's result or plot (a JSON of header and
    rows; a figure saved with speccomp's mark in its metadata) and refuse any other existing file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from speccomp.cli import _our_json, _our_plot, check_output_file
    from speccomp.tuning.bench import save_figure

    result = tmp_path / "r.json"
    result.write_text(json.dumps({"header": {"command": "speccomp bench"}, "rows": []}))
    check_output_file("json", result, _our_json)  # an earlier result: replaced
    for suffix in (".png", ".svg", ".pdf"):
        plot = save_figure(plt.figure(), tmp_path / f"p{suffix}", dpi=40)
        check_output_file("plot", plot, _our_plot)
        plot.write_bytes(plot.read_bytes().replace(b"speccomp-plot-1", b"someones-plot-1"))  # not ours
        with pytest.raises(OptionError, match="refusing to replace"):
            check_output_file("plot", plot, _our_plot)
    assert save_figure(plt.figure(), tmp_path / "bare", dpi=40).name == "bare.png"  # what matplotlib writes
    result.write_text(json.dumps({"rows": []}))
    with pytest.raises(OptionError, match="json=.*refusing to replace"):
        check_output_file("json", result, _our_json)
    check_output_file("json", tmp_path / "new" / "r.json", _our_json)  # a new file: its folder made when written,
    assert not (tmp_path / "new").exists()  # not by a check a later one may refuse after


def test_bench_all_skips_the_draft_model_row_without_a_trained_draft(tmp_path, monkeypatch, capsys):
    """`speccomp bench` (--drafters all) on a fresh install: no draft has been trained, so the draft_model row is
    left out before the model loads, saying why (it failed after minutes of benchmarking, exit status 1)."""
    from types import SimpleNamespace

    from speccomp.cli import _bench_drafters

    monkeypatch.setenv("SPECCOMP_CACHE", str(tmp_path))
    available = speccomp.available_drafters()
    rows = _bench_drafters(SimpleNamespace(drafters="all", tree=None, backend="eager"), available)
    assert "draft_model" in available and "draft_model" not in rows and "token_recycling" in rows
    assert "no draft_model row: no trained draft" in capsys.readouterr().err
    (tmp_path / "drafts" / "0123abcd").mkdir(parents=True)
    (tmp_path / "drafts" / "0123abcd" / "config.json").write_text("{}")
    assert "draft_model" in _bench_drafters(SimpleNamespace(drafters="all", tree=None, backend="eager"), available)


def test_ctrl_c_is_one_line_that_says_how_to_resume(monkeypatch, capsys):
    """Ctrl-C in a resumable command printed a long traceback and nothing about resuming (training keeps its state
    after every batch): one line, exit status 130 as a shell's."""
    from speccomp import cli

    def interrupted(args):
        raise KeyboardInterrupt

    for command, name in (("train-heads", "cmd_train_heads"), ("export", "cmd_export")):
        monkeypatch.setattr(cli, name, interrupted)
        assert cli.main([command] + (["e"] if command == "export" else [])) == 130
        again = "; run the same command again to resume" if command == "train-heads" else ""
        assert capsys.readouterr().err == f"speccomp {command}: interrupted{again}\n"


def test_export_triton_refuses_a_parent_of_the_working_directory(cli_main, engine_dir, tmp_path, monkeypatch, capsys):
    """`speccomp export-triton ENGINE ..` made ../speccomp (a reviewer's run: /tmp/speccomp), where export refuses."""
    from speccomp import cli

    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # so that `..` is this test's own folder, even were it not refused
    assert cli.main(["export-triton", str(engine_dir), ".."]) == 2
    assert "out='..': is a parent of the working directory" in capsys.readouterr().err
    assert not (tmp_path / "speccomp").exists()
