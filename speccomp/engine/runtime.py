"""Run an exported engine directory with ONNX Runtime and numpy only: no torch anywhere.

    engine = speccomp.load("engine/")                      # needs only onnxruntime + numpy (+ tokenizers)
    ids = engine.chat_ids("Write a haiku about speed")     # tokenizer.json + the manifest's chat template
    out = engine.generate(ids, max_new_tokens=128)          # np.int64 [1, prompt + new], like SpecModel
    print(engine.decode(out[0, ids.shape[1]:]))

`SpecModel.export(dir)` (speccomp/engine/export.py) writes the directory: manifest.json (what is inside and how to
call it: MANIFEST_KEYS, format speccomp-engine v3; v1 and v2 load; `files`: the tokenizers' sizes and SHA-256,
checked at load as the graphs' are, absent from engines written before them); target.onnx, the target verify graph after TreeAttention, one file
for prefill (causal tree_mask), plain decoding (q = 1) and tree verification (q = tree size); tokenizer.json (when
export was given a tokenizer); a drafter's graph, GRAPH_FILES[name] (its drafter class below says what it computes).

The decode loop is speccomp/runtime/decode.py's, restated in numpy: draft a tree (no drafter: the root alone), verify
it in one session run, walk the tree while the target agrees, keep the KV of the accepted path. The drafters share
their torch-free code with the torch drafters (speccomp/drafters/lookup.py, grow.py, eagle_cache.py, kv/cache.py).
Sessions run through IO binding; the KV cache and the contiguous `past_kv` it is fed from are allocated once per
generate.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from collections import OrderedDict, namedtuple
from functools import partial
from pathlib import Path

import numpy as np

from speccomp.runtime.budget import AHEAD_PAST, AHEAD_Q, Budget, StepCosts
from speccomp.runtime.calls import (MAX_TREE, CallGuard, Generation, as_int, batch_rows, check_context,
                                    check_unmasked_padding, generate_args, host_array, one_padded_row, pad_id,
                                    row_seed, row_slots, run_batch, tightest_context)
from speccomp.runtime.packed import PackedBatch, Part
from speccomp.runtime.topk import top_k, top_logp
from speccomp.errors import OptionError, OptionTypeError, SpeccompError
from speccomp.drafters.eagle_cache import EagleCache
from speccomp.drafters.grow import (ancestor_rows, cut, grow_dynamic, grow_static, siblings_in_rank_order,
                                    state_expander)
from speccomp.drafters.lookup import NGramIndex, Trie, fill_template, merge_trees, own_view, recycle, shared_prefix
from speccomp.drafters.suffix import SuffixDecoder
from speccomp.drafters.text_bridge import TextBridge
from speccomp.tuning.step_curve import curve_path, engine_key, read_curve, write_curve
from speccomp.kv.cache import all_layers, make_cache, needs_votes
from speccomp.kv.policies import KVPolicyError, parse_kv_cache, snapkv_window

# version 2: graphs may take the cache one layer per input and write it in place (LAYER_INPUT); version 3: a Token
# Recycling target takes TOP_ROWS_INPUT; 1 and 2 still load
FORMAT, FORMAT_VERSION, READABLE_VERSIONS = "speccomp-engine", 3, (1, 2, 3)
MANIFEST = "manifest.json"
MEDUSA_FILE = "medusa.onnx"
# drafter graphs that run on one thread in an engine whose manifest does not say (exported before its parts recorded
# the compiled drafter's `light_graphs` as "light"). Not medusa.onnx: with tied heads it projects every head through
# the full 49k-token LM head, the model's largest matmul (and was not measured on one thread)
LIGHT_GRAPHS = ("hydra", "eagle", "quantized")
HYDRA_FILE = "hydra.onnx"
EAGLE_FILE = "eagle.onnx"
MANIFEST_KEYS = ("format", "format_version", "speccomp_version", "model", "kv", "graphs", "opset", "max_tree", "drafter")
SELF_DRAFTERS = ("early_exit", "layer_skip", "quantized", "compressed_kv")  # each drafts with its own NAME.onnx
# the drafters the torch-free loop runs, alone or merged ("hydra+token_recycling": at most one that reads the model)
ENGINE_DRAFTERS = (None, "ngram", "suffix", "token_recycling", "medusa", "hydra", "eagle", "draft_model", *SELF_DRAFTERS)
GRAPH_FILES = {"medusa": MEDUSA_FILE, "hydra": HYDRA_FILE, "eagle": EAGLE_FILE, "draft_model": "draft_model.onnx",
               **{name: f"{name}.onnx" for name in SELF_DRAFTERS}}  # drafters with a graph
TOP_IDS_OUTPUT = "top_ids"  # the target graph's TopK of the logits, added at export for Token Recycling
TOP_ROWS_INPUT = "top_ids_rows"  # the nodes that TopK reads (v3; a v2 graph's TopK reads every node)
HYDRA_OUTPUTS = ["next_states", "top_logp", "top_ids"]
EAGLE_INPUTS = ["feats", "tokens", "positions", "past_k", "past_v", "mask"]
EAGLE_OUTPUTS = ["out", "new_k", "new_v", "top_logp", "top_ids"]
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": None}


def _template_refuses(message: str):
    """`raise_exception(message)` inside a chat template (transformers defines it; templates call it to refuse a
    conversation): a jinja2 TemplateError, which chat_ids answers as an OptionError on `messages`."""
    from jinja2 import TemplateError

    raise TemplateError(message)


def _template_env():
    """A sandbox that renders chat templates as transformers' apply_chat_template does: {% break %} / {% continue %},
    a tojson that leaves < > & ' unescaped, strftime_now (Llama 3's date line) and raise_exception."""
    import datetime

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=_template_refuses,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env


class EngineError(SpeccompError, RuntimeError):
    """An engine directory is missing, corrupt or does not match; the message names the fix."""


def light_graph(spec: dict) -> bool:
    """Whether a drafter part's graph runs on one thread: what the compiled drafter declared (`light` in the manifest,
    its `light_graphs`), else, for an older engine, whether it is one of the LIGHT_GRAPHS."""
    return spec.get("light", spec.get("name") in LIGHT_GRAPHS)


def file_above(path: Path) -> Path | None:
    """The nearest existing path above absolute `path` where it is a file (nothing can be made under it), else None."""
    above = next((a for a in path.parents if a.exists()), None)
    return above if above is not None and not above.is_dir() else None


def check_makeable(path: Path) -> None:
    """A directory can be made at absolute `path`: no file on the way (refused before an export's work, not when it
    finally writes)."""
    above = file_above(path)
    if above is not None:
        raise EngineError(f"{above} is a file, so {path} cannot be made under it; choose another path")


def _corrupt(message: str) -> EngineError:
    return EngineError(f"{message}; the engine is corrupt, re-export it")


# ---- Manifest --------------------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(path, verify: bool = True) -> dict:
    """The validated manifest of engine directory `path`. verify=True also checks every graph file's
    size and SHA-256 against the manifest (a truncated or edited file is caught before ORT loads it)."""
    path = Path(path).expanduser()
    remake = "re-export it with `compiled.export(dir)` or `speccomp export DIR`"
    if not path.is_dir():
        raise EngineError(f"no engine directory at {path}; {remake}")
    file = path / MANIFEST
    if not file.is_file():
        raise EngineError(f"{path} is not a speccomp engine: it has no {MANIFEST}; {remake}")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise EngineError(f"{file} is not valid JSON ({exc}); the engine is corrupt, {remake}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise EngineError(f"{file} is not a speccomp engine manifest (format must be {FORMAT!r}); {remake}")
    version = manifest.get("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise EngineError(f"{file} has format_version {version!r}; this speccomp reads versions "
                          f"{list(READABLE_VERSIONS)}; {remake} with this speccomp")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise EngineError(f"{file} lacks the keys {missing}; the engine is corrupt, {remake}")
    check_schema(manifest, file, remake)
    for name, graph in manifest["graphs"].items():
        onnx_file = path / graph["file"]
        files = [(onnx_file, graph)]
        if "data" in graph:
            files.append((onnx_file.with_name(onnx_file.name + ".data"), graph["data"]))
        for file_, entry in files:
            if not file_.is_file():
                raise EngineError(f"the engine's {name} graph file {file_} is missing; {remake}")
            if verify and (file_.stat().st_size != entry["bytes"] or sha256(file_) != entry["sha256"]):
                raise EngineError(f"the engine's {name} graph file {file_} does not match its manifest (size "
                                  f"{file_.stat().st_size} bytes, manifest {entry['bytes']}; or a different SHA-256): "
                                  f"the file is corrupt or was replaced; {remake}")
    sums = manifest.get("files", {})  # the tokenizers' sizes and digests (engines before them list none)
    target = (manifest.get("tokenizer") or {}).get("file")
    for name in tokenizer_files(manifest):
        file_, which = path / name, "tokenizer" if name == target else "draft tokenizer"
        if not file_.is_file():
            raise EngineError(f"the engine's {which} {file_} is missing; copy it back, or {remake}")
        entry = sums.get(name)
        if verify and entry is not None and (file_.stat().st_size != entry["bytes"] or sha256(file_) != entry["sha256"]):
            raise EngineError(f"the engine's {which} {file_} does not match its manifest (size {file_.stat().st_size} "
                              f"bytes, manifest {entry['bytes']}; or a different SHA-256): another tokenizer would "
                              f"encode prompts into other ids; {remake}")
    return manifest


def tokenizer_files(manifest: dict) -> list[str]:
    """The tokenizer files an engine's manifest names (the target's, a draft model's own two); names that are not
    strings are left out (export's engine_files reads unchecked manifests too)."""
    tokenizer = manifest.get("tokenizer")
    names = [tokenizer["file"]] if isinstance(tokenizer, dict) and isinstance(tokenizer.get("file"), str) else []
    drafter = manifest.get("drafter") if isinstance(manifest.get("drafter"), dict) else {}
    for part in drafter.get("drafters") or [drafter]:
        files = (part.get("options") or {}).get("tokenizers") if isinstance(part, dict) else None
        names += [f for f in files.values() if isinstance(f, str)] if isinstance(files, dict) else []
    return list(dict.fromkeys(names))


def _is_int(x, minimum=None) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and (minimum is None or x >= minimum)


def _is_file_name(x) -> bool:
    """A plain file name inside the engine directory: no folders, no way out of it."""
    return isinstance(x, str) and x not in ("", ".", "..") and os.path.basename(x) == x and "\\" not in x


def _ints(x, minimum=None) -> bool:
    return isinstance(x, list) and all(_is_int(v, minimum) for v in x)


def _tree_ok(parents, ranks) -> bool:
    """A parent array in topological order (root first) with one sibling rank per node."""
    return (_ints(parents) and _ints(ranks, 0) and len(parents) == len(ranks) >= 1 and parents[0] == -1
            and all(0 <= p < i for i, p in enumerate(parents) if i))


def _grown_tree(v) -> bool:
    """A grown drafter's tree: static {parents, ranks} or dynamic {budget, top_k}."""
    return isinstance(v, dict) and (set(v) == {"parents", "ranks"} and _tree_ok(v["parents"], v["ranks"])
                                    or set(v) == {"budget", "top_k"} and _is_int(v["budget"], 1) and _is_int(v["top_k"], 1))


def _kv_policy_ok(spec) -> bool:
    try:
        return isinstance(spec, str) and bool(parse_kv_cache(spec))
    except KVPolicyError:
        return False


def _layer_list(v) -> bool:
    return _ints(v, 0) and len(v) >= 1


def _kv_layout(v) -> bool:
    """A KV layout entry as the manifest's `kv`: positive num_layers, num_kv_heads, head_dim and a known dtype."""
    return (isinstance(v, dict) and all(_is_int(v.get(k), 1) for k in ("num_layers", "num_kv_heads", "head_dim"))
            and isinstance(v.get("dtype"), str) and _DTYPES.get(v["dtype"]) is not None)


_positive, _indices = partial(_is_int, minimum=1), partial(_ints, minimum=0)
_SELF_DRAFT = {"kv_layers": _layer_list, "tree": _grown_tree, "max_depth": _positive}
# draft_model: only a draft with its own tokenizer; compressed_kv: quantised weights only; quantized: engines
# written before 8-bit weights (4 bits) have no bits
_OPTIONAL = {"tokenizers", "weights", "bits"}
_DRAFTER_OPTIONS = {  # name -> {option: check}; every option the torch-free drafters take
    None: {},
    "ngram": dict.fromkeys(("max_ngram", "min_ngram", "num_branches", "max_depth"), _positive),
    "suffix": {**dict.fromkeys(("max_match", "max_depth", "budget"), _positive), "memory": partial(_is_int, minimum=0),
               "min_prob": lambda v: isinstance(v, float) and 0 < v <= 1},
    "token_recycling": {**dict.fromkeys(("top_k", "max_ngram", "min_ngram", "ngram_depth"), _positive),
                        "ngram_branches": partial(_is_int, minimum=0), "persist": lambda v: isinstance(v, bool),
                        "parents": _ints, "ranks": _indices},
    "medusa": {"num_heads": _positive, "top": _positive, "parents": _ints, "ranks": _indices,
               "states_output": lambda v: isinstance(v, str)},
    "hydra": {**dict.fromkeys(("num_heads", "top", "max_depth"), _positive), "tree": _grown_tree},
    "eagle": {**dict.fromkeys(("num_heads", "head_dim", "top", "max_depth"), _positive), "tree": _grown_tree},
    "early_exit": {**_SELF_DRAFT, "exit_layer": partial(_is_int, minimum=0)},
    "draft_model": {**_SELF_DRAFT, "kv": _kv_layout, "max_nodes": _positive,
                    "max_positions": lambda v: v is None or _is_int(v, 1),
                    "tokenizers": lambda v: isinstance(v, dict) and set(v) == {"target", "draft"}  # own tokenizer
                    and all(map(_is_file_name, v.values()))},
    "layer_skip": {**_SELF_DRAFT, "skip": _layer_list},
    "quantized": {**_SELF_DRAFT, "bits": lambda v: _is_int(v) and v in (4, 8), "block_size": partial(_is_int, minimum=16)},
    "compressed_kv": {**_SELF_DRAFT, "kv_cache": _kv_policy_ok, "weights": lambda v: v in ("int4", "int8")},  # kv_mode="draft"
}


def check_schema(m: dict, file: Path, remake: str) -> None:
    """Every field the runtime reads has the type and range it needs (a hand-edited or truncated manifest fails
    here, naming the field, instead of as a KeyError or inside ONNX Runtime)."""
    def need(ok: bool, field: str, value, what: str) -> None:
        if not ok:
            raise EngineError(f"{file}: {field}={value!r} is not {what}; the engine is corrupt, {remake}")

    model, kv, graphs, drafter = m["model"], m["kv"], m["graphs"], m["drafter"]
    for field, value in (("model", model), ("kv", kv), ("graphs", graphs), ("drafter", drafter)):
        need(isinstance(value, dict), field, value, "a JSON object")
    need(_is_int(model.get("vocab_size"), 1), "model.vocab_size", model.get("vocab_size"), "a positive int")
    mp = model.get("max_positions")
    need(mp is None or _is_int(mp, 1), "model.max_positions", mp, "a positive int or null")
    windows = model.get("sliding_window_layers")
    need(windows is None or _is_int(windows, 0), "model.sliding_window_layers", windows, "a layer count or absent")
    eos, vocab = model.get("eos_token_id"), model["vocab_size"]
    need(eos is None or (_is_int(eos, 0) and eos < vocab) or (_ints(eos, 0) and all(i < vocab for i in eos)),
         "model.eos_token_id", eos, f"a token id in [0, {vocab}), a list of them or null")
    pad = model.get("pad_token_id")  # a batch's padding (absent in engines before it)
    need(pad is None or (_is_int(pad, 0) and pad < vocab), "model.pad_token_id", pad,
         f"a token id in [0, {vocab}) or null")
    for key in ("num_layers", "num_kv_heads", "head_dim"):
        need(_is_int(kv.get(key), 1), f"kv.{key}", kv.get(key), "a positive int")
    need(isinstance(kv.get("dtype"), str) and kv["dtype"] in _DTYPES, "kv.dtype", kv.get("dtype"), f"one of {list(_DTYPES)}")
    need("target" in graphs, "graphs", sorted(graphs), "a set of graphs naming 'target'")
    for name, graph in graphs.items():
        need(isinstance(graph, dict), f"graphs.{name}", graph, "a JSON object")
        need(_is_file_name(graph.get("file")), f"graphs.{name}.file", graph.get("file"), "a file name inside the engine")
        need(_is_int(graph.get("bytes"), 0), f"graphs.{name}.bytes", graph.get("bytes"), "a byte count")
        need(isinstance(graph.get("sha256"), str), f"graphs.{name}.sha256", graph.get("sha256"), "a hex digest")
        data = graph.get("data", {"bytes": 0, "sha256": ""})  # external weights: only graphs over 2 GB have them
        need(isinstance(data, dict) and _is_int(data.get("bytes"), 0) and isinstance(data.get("sha256"), str),
             f"graphs.{name}.data", data, "an object {bytes, sha256} for the graph's external weights file")
        for key in ("inputs", "outputs"):
            value = graph.get(key)
            need(isinstance(value, list) and all(isinstance(v, str) for v in value), f"graphs.{name}.{key}", value,
                 "a list of names")
    need(_is_int(m["max_tree"], 1) and m["max_tree"] <= MAX_TREE, "max_tree", m["max_tree"], f"an int in [1, {MAX_TREE}]")
    need("name" in drafter, "drafter.name", None, "present (null for plain decoding)")
    name = drafter.get("name")
    if isinstance(name, str) and "+" in name:  # a merge: one entry per drafter, in order
        parts = drafter.get("drafters")
        need(isinstance(parts, list) and [isinstance(p, dict) and p.get("name") for p in parts] == name.split("+"),
             "drafter.drafters", parts, f"one entry per drafter of {name!r}, in order")
        need(sum(p["name"] in GRAPH_FILES for p in parts) <= 1, "drafter.name", name, "a merge of at most one "
             "drafter that reads the model")
        for i, part in enumerate(parts):
            _check_drafter(part, graphs, f"drafter.drafters[{i}]", need, kv["num_layers"])
    else:
        _check_drafter(drafter, graphs, "drafter", need, kv["num_layers"])
    tokenizer = m.get("tokenizer")
    need(tokenizer is None or (isinstance(tokenizer, dict) and _is_file_name(tokenizer.get("file"))), "tokenizer",
         tokenizer, "null or an object naming its file")
    files = m.get("files", {})
    need(isinstance(files, dict) and all(_is_file_name(k) and isinstance(v, dict) and _is_int(v.get("bytes"), 0)
                                         and isinstance(v.get("sha256"), str) for k, v in files.items()),
         "files", files, "an object {file name: {bytes, sha256}}")
    if tokenizer is not None:
        template, special = tokenizer.get("chat_template"), tokenizer.get("special_tokens", {})
        need(template is None or isinstance(template, str), "tokenizer.chat_template", template, "a string or null")
        need(isinstance(special, dict) and all(isinstance(v, str) for v in special.values()),
             "tokenizer.special_tokens", special, "an object of token strings")


def _check_drafter(drafter: dict, graphs: dict, field: str, need, num_layers: int) -> None:
    """One (unmerged) drafter entry: a known name and exactly its options, each valid; its graph if it has one.
    `num_layers`: the target's, which the layer lists (kv_layers, skip) index, each layer once."""
    name = drafter.get("name")
    need(name in ENGINE_DRAFTERS and (name is not None or field == "drafter"), f"{field}.name", name,
         f"one of {list(ENGINE_DRAFTERS)}")
    options = drafter.get("options") or {}
    need(isinstance(options, dict), f"{field}.options", options, "a JSON object")
    checks = _DRAFTER_OPTIONS[name]
    for key, value in options.items():
        need(key in checks and checks[key](value), f"{field}.options.{key}", value, f"a valid {name} option")
    missing = sorted(set(checks) - set(options) - _OPTIONAL)
    need(not missing, f"{field}.options", sorted(options), f"complete (missing {missing})")
    if name == "draft_model":  # its kv_layers are the draft's own layers
        num_layers, whose = options["kv"]["num_layers"], f"the draft's {options['kv']['num_layers']} layers"
    else:
        whose = f"the target's {num_layers} layers (kv.num_layers)"
    for key in ("kv_layers", "skip"):
        if checks.get(key) is _layer_list:
            layers = options[key]
            need(max(layers) < num_layers and len(set(layers)) == len(layers), f"{field}.options.{key}", layers,
                 f"distinct layer indices of {whose}")
    if "parents" in options:
        need(len(options["ranks"]) == len(options["parents"]), f"{field}.options.ranks", options["ranks"],
             f"one rank per node of {field}.options.parents={options['parents']!r}")
        need(_tree_ok(options["parents"], options["ranks"]), f"{field}.options.parents", options["parents"],
             "a tree (root first, every parent before its children)")
    if name in GRAPH_FILES:
        need(drafter.get("graph") == GRAPH_FILES[name] and name in graphs, f"{field}.graph", drafter.get("graph"),
             f"{GRAPH_FILES[name]!r} with a {name!r} entry in graphs")
        need(isinstance(drafter.get("light", False), bool), f"{field}.light", drafter.get("light"),
             "true or false (whether the graph runs on one thread)")


# ---- ONNX Runtime session with IO binding ----------------------------------------------------------------
# speccomp's names for ONNX Runtime execution providers
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
_PROVIDER_HINTS = {  # what to install for an execution provider the plain `onnxruntime` wheel lacks
    "CUDAExecutionProvider": "pip install onnxruntime-gpu (in place of onnxruntime) on a machine with an NVIDIA GPU and CUDA",
    "TensorrtExecutionProvider": "pip install onnxruntime-gpu (in place of onnxruntime) plus TensorRT, on a machine with an NVIDIA GPU",
    "DmlExecutionProvider": "pip install onnxruntime-directml (in place of onnxruntime)",
    "OpenVINOExecutionProvider": "pip install onnxruntime-openvino (in place of onnxruntime)",
    "ROCMExecutionProvider": "pip install onnxruntime-rocm (in place of onnxruntime)",
    "CoreMLExecutionProvider": "use the macOS onnxruntime wheel",
}


def onnxruntime_module(error=None):
    """`import onnxruntime`, with its telemetry off (speccomp runs offline; `import speccomp` also sets
    ORT_DISABLE_TELEMETRY, which ORT reads when it starts). `error`: the exception class to raise when ONNX
    Runtime is not installed (default EngineError)."""
    try:
        import onnxruntime
    except ImportError as exc:
        raise (error or EngineError)("this needs ONNX Runtime: pip install onnxruntime (or onnxruntime-gpu)") from exc
    if not getattr(onnxruntime, "_speccomp_quiet", False):
        onnxruntime.disable_telemetry_events()
        onnxruntime._speccomp_quiet = True
    return onnxruntime


def check_session_providers(session, providers: list, what, error=None) -> list[str]:
    """The providers `session` really runs on; raises EngineError when ONNX Runtime fell back from the first
    provider asked for (it does so silently when, say, the CUDA libraries cannot be loaded)."""
    wanted = providers[0][0] if isinstance(providers[0], (tuple, list)) else providers[0]
    used = list(session.get_providers())
    if wanted not in used:
        raise (error or EngineError)(f"{what}: asked ONNX Runtime for {wanted}, but the session runs on {used}: ONNX "
                                     "Runtime fell back (for CUDA/TensorRT usually missing CUDA, cuDNN or TensorRT "
                                     "libraries; its log says which). Fix the installation, or ask for provider='cpu'")
    return used


def missing_provider(ort, name: str, alias: str | None = None) -> str | None:
    """None if ONNX Runtime `ort` has execution provider `name`, else a message naming what to install.
    (Shared with backends/onnx_export.py's OrtStep, which takes ORT's own provider names.)"""
    available = ort.get_available_providers()
    if name in available:
        return None
    label = f"{name} ({alias!r})" if alias else repr(name)
    hint = _PROVIDER_HINTS.get(name, "Install an onnxruntime build that has it")
    return (f"ONNX Runtime execution provider {label} is not available: onnxruntime {ort.__version__} here has "
            f"{available}. {hint}.")


def check_provider(provider: str) -> list[str]:
    """ORT provider list for speccomp's provider name ("cpu", "cuda", "tensorrt"), CPU as the fallback for
    ops a GPU provider leaves out. Raises EngineError naming what to install when the build lacks it."""
    if not isinstance(provider, str) or provider not in PROVIDERS:
        raise EngineError(f"unknown execution provider {provider!r}; accepted values: {sorted(PROVIDERS)}")
    name = PROVIDERS[provider]
    message = missing_provider(onnxruntime_module(), name, provider)
    if message:
        raise EngineError(message)
    return [name] if name == "CPUExecutionProvider" else [name, "CPUExecutionProvider"]


class BoundSession:
    """An InferenceSession run through one reused IO binding: inputs bound from numpy arrays in place
    (no copies on the CPU provider), only the outputs asked for are fetched. `providers`: what it runs on."""

    def __init__(self, path: Path, providers: list[str], threads: int | None = None, spin: bool = True):
        ort = onnxruntime_module()
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        if not spin:  # idle pool threads sleep instead of spinning: they would fight the drafter's work between runs
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = ort.InferenceSession(os.fspath(path), sess_options=options, providers=providers)
        except Exception as exc:  # ORT raises its own Fail / InvalidProtobuf / ... types
            raise EngineError(f"ONNX Runtime cannot load {path}: {str(exc).splitlines()[0]}") from exc
        self.providers = check_session_providers(self.session, providers, path)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.layers = [n for n in self.inputs if n.startswith(LAYER_INPUT)]
        self.presents = [o.name for o in self.session.get_outputs() if o.name.startswith("present_")]
        if self.layers and providers[0] != "CPUExecutionProvider":
            raise EngineError(f"{path.name} writes the KV cache in place in host memory (the onnxruntime backend's CPU "
                              f"graph), so it runs on the CPU provider only, not {providers[0]}; for a GPU, export "
                              "the engine from a model compiled with backend='eager'")
        self.binding = self.session.io_binding()
        self.in_place = LayerBindings(self.session, self.layers, self.presents)
        self.fed = [n for n in self.inputs if n not in self.layers]  # bound from feeds every run

    def run(self, feeds: dict, outputs: list[str]) -> list[np.ndarray]:
        """`outputs` of one run; feeds["past_kv"] may be a CacheView (dense for a past_kv graph, bound in place for
        a graph that writes the cache itself: per-layer past_<kv>_<l> inputs, present_<kv>_<l> outputs)."""
        past = feeds.get("past_kv")
        if self.layers:
            if not isinstance(past, CacheView):
                raise EngineError(f"{self.inputs} take the cache in place: pass past_kv as a CacheView "
                                  "(KVCache.view())")
            buffer = past.buffer(feeds["input_ids"].shape[1])
            b = self.in_place.binding(buffer, outputs, keep=buffer is past.data)
        else:
            if isinstance(past, CacheView):
                feeds = {**feeds, "past_kv": past.dense(past.n)}
            b = self.binding
            b.clear_binding_inputs()
            b.clear_binding_outputs()
            for name in outputs:
                b.bind_output(name)  # ORT allocates (shapes depend on q)
        for name in self.fed:
            b.bind_cpu_input(name, feeds[name])
        try:
            self.session.run_with_iobinding(b)
            return [v.numpy() for v in b.get_outputs()[: len(outputs)]]
        finally:
            if self.layers:
                self.in_place.release(b, outputs)


LAYER_INPUT = ("past_key_", "past_value_")  # a graph that writes the cache in place (backends/onnx_kv.py)


class LayerBindings:
    """IO bindings of a session that writes the KV cache in place, each keeping the cache's per-layer blocks bound
    between runs: binding them afresh every run (2 x L inputs and outputs, 120 for SmolLM2) cost 0.5-0.8 ms a step
    through ONNX Runtime's Python API (benchmarks/host_ops.py: 517 us against 6.5 us kept), 2-4% of a 25 ms decode
    step, while the blocks stay where they are as long as the buffer does.

        b = bindings.binding(buffer, outputs)   # layers bound once per buffer (its address, shape and type)
        ... bind the other inputs, run b, read b.get_outputs()[:len(outputs)] ...
        bindings.release(b, outputs)            # the outputs unbound: the binding holds no run's arrays

    The outputs asked for are bound first (ONNX Runtime lists outputs in the order first bound) and without memory,
    so ORT allocates them each run (their shapes follow q). The KEPT most recently used bindings are kept; a scratch
    buffer (`keep=False`: a copy made for one step) gets a binding of its own, not kept."""

    KEPT = 4  # bindings kept at most (a buffer that moved, an engine asking now for one output set, now another)

    def __init__(self, session, layers: list[str], presents: list[str]):
        self.session, self.layers, self.presents = session, list(layers), presents
        self._kept = OrderedDict()

    def binding(self, buffer: np.ndarray, outputs: list[str], keep: bool = True):
        key = (buffer.ctypes.data, buffer.shape, buffer.dtype.str, tuple(outputs))
        if keep and key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]
        b = self.session.io_binding()
        for name in self.layers:
            bind_layer(b.bind_input, name, buffer)
        self.release(b, outputs)
        for name in self.presents:  # the same memory as past_<kv>_<l>: only this step's entries are written
            bind_layer(b.bind_output, name, buffer)
        if keep:
            self._kept[key] = b
            if len(self._kept) > self.KEPT:
                self._kept.popitem(last=False)  # the least recently used
        return b

    @staticmethod
    def release(b, outputs: list[str]) -> None:
        """Bind `outputs` without memory: ORT allocates them at the next run, and lets go of the last run's."""
        for name in outputs:
            b.bind_output(name)


def bind_layer(bind, name: str, buffer: np.ndarray) -> None:
    """Bind input past_<kv>_<l> / output present_<kv>_<l> to layer l's block of `buffer` [L, 2, 1, Hkv, cap, D]."""
    layer, kv = int(name.rsplit("_", 1)[1]), int("_value_" in name)
    block = buffer[layer, kv]  # [1, Hkv, capacity, D]: contiguous, the leading indices pick one block
    bind(name, "cpu", 0, block.dtype, list(block.shape), block.ctypes.data)


class CacheView:
    """past_kv as a session input: the first `n` slots of `data` [L, 2, 1, Hkv, capacity, D], whose first `in_use`
    hold live entries. `dense(n)`: those slots as one contiguous array (for graphs that take past_kv)."""

    def __init__(self, data: np.ndarray, n: int, in_use: int, dense):
        self.data, self.n, self.in_use, self.dense = data, n, in_use, dense

    def buffer(self, q: int) -> np.ndarray:
        """What a graph writing the cache in place is bound to: `data` itself when the view covers the live slots
        and q entries fit after it (they go where the decode loop puts them next anyway), else a scratch copy."""
        if self.in_use <= self.n and self.n + q <= self.data.shape[4] and self.data.flags.c_contiguous:
            return self.data
        scratch = np.zeros(self.data.shape[:4] + (self.n + q, self.data.shape[5]), dtype=self.data.dtype)
        scratch[..., : self.n, :] = self.data[..., : self.n, :]
        return scratch


def check_target(bound: BoundSession, manifest: dict, dtype) -> None:
    """The target graph against the manifest, at load rather than deep inside ONNX Runtime at the first generate:
    its inputs, its past_kv / new_kv against the KV layout (fixed dims and element type), its outputs and vocabulary
    (a decode would otherwise index past the logits, or read an output that is not there)."""
    target, session = manifest["graphs"]["target"], bound.session
    file, outputs = target["file"], session.get_outputs()
    if bound.inputs != target["inputs"]:
        raise _corrupt(f"{file} takes inputs {bound.inputs} but the manifest says {target['inputs']}")
    check_kv_io(bound, manifest["kv"], dtype, file, "kv")
    names = [o.name for o in outputs]
    if names != target["outputs"]:
        raise _corrupt(f"{file} returns {names} but the manifest's graphs.target.outputs says {target['outputs']}")
    vocab = outputs[0].shape[-1] if outputs and outputs[0].shape else None
    if isinstance(vocab, int) and vocab != manifest["model"]["vocab_size"]:
        raise _corrupt(f"the manifest's model.vocab_size={manifest['model']['vocab_size']} but {file} scores {vocab} "
                       "tokens")


def check_kv_io(bound: BoundSession, kv: dict, dtype, file: str, field: str) -> None:
    """A graph's past_kv / new_kv (or per-layer cache inputs) against the manifest's KV layout `field` (the target's
    `kv`, a draft model's `drafter.options.kv`): layer count, fixed dims and element type."""
    layers = len(bound.layers) // 2
    if bound.layers and (layers != kv["num_layers"] or set(bound.layers) != {
            f"{prefix}{i}" for prefix in LAYER_INPUT for i in range(layers)}):  # counted first: the manifest's may be huge
        raise EngineError(f"{file} takes the cache of {layers} layers (past_key_<l>, past_value_<l>) but the "
                          f"manifest's {field}.num_layers is {kv['num_layers']}; the manifest and the graph do not "
                          "belong together, re-export the engine")
    want = [kv["num_layers"], 2, 1, kv["num_kv_heads"], None, kv["head_dim"]]
    layer = [1, kv["num_kv_heads"], None, kv["head_dim"]]  # one layer of the cache, written in place
    element = f"tensor({'float' if dtype == np.float32 else 'float16'})"
    found = {i.name: i for i in bound.session.get_inputs()} | {o.name: o for o in bound.session.get_outputs()}
    for name, shape_wanted in [("new_kv", want)] + ([(n, layer) for n in bound.layers] or [("past_kv", want)]):
        node = found.get(name)
        if node is None:
            raise _corrupt(f"{file} has no {name}")
        shape = node.shape
        fixed_ok = len(shape) == len(shape_wanted) and all(
            w is None or not isinstance(d, int) or d == w for w, d in zip(shape_wanted, shape))
        if not fixed_ok or node.type != element:
            raise EngineError(f"{file}: {name} is {node.type} {shape}, but the manifest's KV layout ({field}) is "
                              f"{kv['dtype']} [layers={kv['num_layers']}, 2, 1, kv_heads={kv['num_kv_heads']}, tokens, "
                              f"head_dim={kv['head_dim']}]; the manifest and the graph do not belong together, "
                              "re-export the engine")


class KVCache:
    """Preallocated [L, 2, 1, Hkv, capacity, D] plus one preallocated flat buffer that `past()` packs
    the valid prefix into, contiguous, for the session's `past_kv` input (ORT wants dense inputs)."""

    def __init__(self, kv: dict, capacity: int, dtype):
        self.shape = (kv["num_layers"], 2, 1, kv["num_kv_heads"], capacity, kv["head_dim"])
        self.data = np.zeros(self.shape, dtype=dtype)
        self.flat = np.empty(self.data.size, dtype=dtype)
        self.length = 0

    def past(self, length: int | None = None) -> np.ndarray:
        """The first `length` positions (default: the valid ones), contiguous: [L, 2, 1, Hkv, length, D]."""
        length = self.length if length is None else length
        shape = self.shape[:4] + (length, self.shape[5])
        out = self.flat[: int(np.prod(shape))].reshape(shape)
        np.copyto(out, self.data[..., :length, :])
        return out

    def view(self, n: int | None = None) -> CacheView:
        """The first n slots (default: the valid ones) as a session's past_kv."""
        return CacheView(self.data, self.length if n is None else n, self.length, self.past)

    def append(self, new_kv: np.ndarray, keep=None) -> None:
        if keep is not None:
            new_kv = new_kv[..., keep, :]
        n = new_kv.shape[4]
        if self.length + n > self.shape[4]:
            raise EngineError(f"KV cache overflow: {self.length} + {n} > capacity {self.shape[4]}")
        self.data[..., self.length : self.length + n, :] = new_kv
        self.length += n

    def nbytes(self) -> int:
        return self.length * self.data[..., :1, :].nbytes


# ---- Trees, acceptance, sampling (numpy versions of tree.py / sampling.py) -------------------------------
def tree_arrays(parents: list[int]) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """depth [n], ancestor-or-self mask bool [n, n], children lists of a parent array."""
    n = len(parents)
    depth = np.zeros(n, dtype=np.int64)
    mask = np.eye(n, dtype=bool)
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        mask[i] |= mask[parents[i]]  # topological order: the parent's row is already complete
        children[parents[i]].append(i)
    return depth, mask, children


def _scaled(logits: np.ndarray, temperature: float) -> np.ndarray:
    """(logits - their max) / temperature in float64 (as speccomp.runtime.sampling.warp: no overflow near 0). A
    temperature below float64's range sends every other logit to -inf (the argmax's point mass): meant, not warned."""
    x = logits.astype(np.float64)
    with np.errstate(over="ignore"):
        return (x - x.max(-1, keepdims=True)) / temperature


_F32_MAX, _F32_TINY = float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)


def warp(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Probabilities after temperature and nucleus filtering, as speccomp.runtime.sampling.warp (HF's warpers).
    Where logits tie exactly at the nucleus cut, which of the tied tokens stay is up to the sort: torch's (HF's) is
    not stable, this one is, so the two may keep different tied tokens (exact ties are rare with float32 logits). The
    cut is made in float32, as torch makes it (a running total of exactly 1 - top_p is cut there; in float64 it was
    kept: uniform logits over 5 tokens at top_p=0.8 kept a token the target never samples); float32 sums in another
    order may still round a total at the cut differently, in ties alone."""
    x = _scaled(logits, temperature)
    if top_p < 1.0:
        x32 = logits.astype(np.float32)
        # (a temperature above float32's range divides by inf: every logit 0, as torch's float32 division gives)
        t32 = np.float32(np.inf) if temperature > _F32_MAX else np.float32(max(temperature, _F32_TINY))
        with np.errstate(over="ignore"):  # to -inf near 0, as _scaled
            x32 = (x32 - x32.max(-1, keepdims=True)) / t32
        order = np.argsort(x32, kind="stable")  # ascending
        p = np.exp(x32[order])  # x32.max() is 0
        cumulative = np.cumsum(p / p.sum(dtype=np.float32), dtype=np.float64).astype(np.float32)  # as torch's CPU
        # cumsum: a float64 running total, each output rounded to float32
        remove = cumulative <= np.float32(1 - top_p)
        remove[-1] = False  # always keep the most likely token
        x = x.copy()
        x[order[remove]] = -np.inf
    p = np.exp(x)  # x's max is 0 (_scaled), and the nucleus always keeps that token
    return p / p.sum()


def accept(tokens: list[int], children: list[list[int]], pick) -> tuple[list[int], int]:
    """Walk the tree from the root while the target's token (pick(node)) is a drafted child.
    Greedy: pick = argmax, so the output is the target's greedy text. Sampling: pick draws from the
    target's distribution at that node; drafts here are deterministic, so following the child that
    equals the draw (else emitting the draw) is exact rejection sampling for every tree."""
    path, node = [0], 0
    while True:
        t = pick(node)
        nxt = next((c for c in children[node] if tokens[c] == t), None)
        if nxt is None:
            return path, t
        path.append(nxt)
        node = nxt


def sample_accept(tokens: list[int], children: list[list[int]], target, probs: list, rng) -> tuple[list[int], int]:
    """Multi-draft recursive rejection sampling for drafts *sampled* from q (speccomp/runtime/tree.py's
    sample_accept, in numpy): at node u with residual p (first target(u), the warped target distribution) each child
    c in order is accepted with probability min(1, p(x_c) / q_c(x_c)), q_c = probs[c] the distribution it was drawn
    from; a rejection turns p into normalize(max(p - q_c, 0)). The token leaving u is distributed as target(u)
    whatever was drafted; with no child accepted it is drawn from the last residual."""
    coins = rng.random(len(tokens))  # one per node, drawn up front (as the torch sampler)
    path, u = [0], 0
    while True:
        p, nxt = target(u), None
        for c in children[u]:
            x, q = tokens[c], probs[c]
            if coins[c] * q[x] < p[x]:  # u < p(x) / q(x), without dividing
                nxt = c
                break
            residual = np.maximum(p - q, 0.0)
            s = residual.sum()
            if s > 1e-12:  # s ~ 0: p <= q everywhere, rejection had ~zero probability; keep p
                p = residual / s
        if nxt is None:
            return path, int(rng.choice(len(p), p=p / p.sum()))
        path.append(nxt)
        u = nxt


def _sample_children(logits: np.ndarray, temperature: float, nodes: list, k: int, drawn: dict, rng) -> list:
    """k children of each node, drawn in order without replacement from q = softmax(logits / temperature) (float64);
    drawn[(node, r)] = the distribution the rank-r child came from (q less ranks 0..r-1, renormalised). Where q has
    fewer than k tokens it can draw, the rest are the likeliest others as point masses (as the torch drafter's
    draft_model.sample_children)."""
    q = np.exp(_scaled(logits, temperature))  # each row's max is 0 already
    q /= q.sum(-1, keepdims=True)
    out = []
    for i, u in enumerate(nodes):
        row, ids = q[i].copy(), []
        for r in range(min(k, int((row > 0).sum()))):
            drawn[(u, r)] = row / row.sum()
            ids.append(int(rng.choice(len(row), p=drawn[(u, r)])))
            row[ids[-1]] = 0.0
        for t in np.argsort(-logits[i], kind="stable") if len(ids) < k else ():
            if len(ids) == k:
                break
            if int(t) not in ids:
                drawn[(u, len(ids))] = np.eye(1, len(row), int(t))[0]
                ids.append(int(t))
        out.append(ids)
    return out


def _feeds(tokens: list[int], positions: np.ndarray, attended: int, past_kv, tree_mask: np.ndarray) -> dict:
    """The inputs of a graph in the target's convention (the target's, a self-drafter's) for `tokens` at `positions`
    attending to `attended` positions: the `past_kv` ones (a CacheView) and theirs, among themselves as `tree_mask`
    says."""
    return {"input_ids": np.array([tokens], dtype=np.int64), "position_ids": positions[None],
            "attention_mask": np.ones((1, attended), dtype=np.int64), "past_kv": past_kv, "tree_mask": tree_mask}


# ---- Drafters ------------------------------------------------------------------------------------------
class _Drafter:
    """The torch drafters' algorithms on the same torch-free code (speccomp/drafters/lookup.py, grow.py). Each:
    begin(prompt, cache); take(extras, rows): the target's extra outputs (`outputs` names them) at the newly accepted
    rows, the newest last; propose(tokens, max_depth, max_nodes) -> (parents, tokens); observe(tokens, path, logits,
    extras) after each verification (extras: its outputs at every verified node)."""

    outputs: tuple[str, ...] = ()  # the target graph's outputs it reads (none: a text drafter)
    # Drafter.observe_optional (runtime/decode.py): skipping observe costs acceptance only. True here, where observe
    # does nothing and the text drafters catch up on the text at their next propose; Token Recycling says why too
    observe_optional = True

    def fresh(self):
        """The same drafter (sessions shared) with per-generation state of its own, for one row of a batch: a copy,
        where `begin` and `take` replace the state rather than change it (subclasses that change it override)."""
        return copy.copy(self)

    def begin(self, prompt, cache):
        pass

    def take(self, extras, rows):
        pass

    def observe(self, tokens, path, logits, extras):
        pass

    def finish(self, text):
        """A batch let this row go with `text` (decode.py's Drafter.finish)."""


class _NGram(_Drafter):
    def __init__(self, max_ngram=4, min_ngram=1, num_branches=4, max_depth=8):
        self.lookup, self.num_branches, self.max_depth = NGramIndex(max_ngram, min_ngram), num_branches, max_depth

    def fresh(self):
        return _NGram(self.lookup.max_ngram, self.lookup.min_ngram, self.num_branches, self.max_depth)

    def begin(self, prompt, cache):
        self.lookup.begin(prompt)

    def propose(self, tokens, max_depth, max_nodes):
        depth = min(self.max_depth, max_depth)
        trie = Trie(tokens[-1])
        if depth > 0:
            self.lookup.add_branches(trie, tokens, self.num_branches, depth)
        return trie.bfs(depth, max_nodes)


class _Suffix(_Drafter):
    """Suffix decoding (speccomp/drafters/suffix.py, the torch drafter's code): its memory spans this engine's calls."""

    def __init__(self, **options):
        self.options, self.decoder = options, SuffixDecoder(**options)

    def fresh(self):
        new = _Suffix(**{**self.options, "memory": 0})
        new.decoder = self.decoder.row()  # a batch row reads the memory and adds its text at finish
        return new

    def finish(self, text):
        self.decoder.finish(text)

    def begin(self, prompt, cache):
        self.decoder.begin(list(prompt))

    def propose(self, tokens, max_depth, max_nodes):
        return self.decoder.propose(tokens, max_depth, max_nodes)


class _TokenRecycling(_Drafter):
    """Token Recycling (speccomp/drafters/ngram.py). An engine exported with it has a TopK in its target graph
    (output TOP_IDS_OUTPUT: every node's top_k token ids), so no numpy top-k over the vocabulary runs per step. A
    skipped observe (a switched-off batch row) leaves the table without that step's top-k: staler drafts, all verified."""

    def __init__(self, top_k, parents, ranks, ngram_branches, max_ngram, min_ngram, ngram_depth, persist,
                 target_outputs=()):
        self.top_k, self.parents, self.ranks, self.persist = top_k, parents, ranks, persist
        self.outputs = (TOP_IDS_OUTPUT,) if TOP_IDS_OUTPUT in target_outputs else ()
        self.ngram_branches, self.ngram_depth = ngram_branches, ngram_depth
        self.lookup = NGramIndex(max_ngram, min_ngram)
        self.adj: dict[int, list[int]] = {}

    def fresh(self):  # persist: every row shares this drafter's table (TokenRecyclingDrafter.fresh)
        new = copy.copy(self)
        new.lookup = NGramIndex(self.lookup.max_ngram, self.lookup.min_ngram)
        new.adj = self.adj if self.persist else {}
        return new

    def begin(self, prompt, cache):
        if not self.persist:
            self.adj = {}
        if self.ngram_branches:
            self.lookup.begin(prompt)

    def propose(self, tokens, max_depth, max_nodes):
        trie = Trie(tokens[-1])
        fill_template(trie, self.parents, self.ranks, self.adj)
        if self.ngram_branches and max_depth > 0:
            self.lookup.add_branches(trie, tokens, self.ngram_branches, min(self.ngram_depth, max_depth))
        return trie.bfs(max_depth, max_nodes)

    def observe(self, tokens, path, logits, extras):  # logits [n, V]; extras: ([1, n, >= top_k] ids,) or ()
        top = extras[0][0, :, : self.top_k] if extras else top_k(logits, self.top_k)[1]
        recycle(self.adj, tokens, path, top.tolist())


class _Medusa(_Drafter):
    """Medusa heads (speccomp/drafters/head_drafters.py's MedusaDrafter in numpy). The target graph returns the
    head states [1, q, K, H] of every token as the extra output `states_output`; the newest accepted token's
    [K, H] go through medusa.onnx, which returns each head's top token ids, and the next tree gives a node at
    depth d with sibling rank r head d-1's rank-r token. The heads run when a tree is asked for, as the torch
    drafter's: a batch row that drafts nothing (its cap 1) runs none."""

    def __init__(self, parents, ranks, num_heads, top, states_output, session: BoundSession):
        self.parents, self.ranks, self.num_heads, self.top = parents, ranks, num_heads, top
        self.outputs = (states_output,)
        self.session, self.states = session, None

    def take(self, extras, rows):
        self.states = extras[0][0, rows[-1]]  # [K, H] of the newest token

    def propose(self, tokens, max_depth, max_nodes):
        parents, ranks = cut(self.parents, self.ranks, max_depth, max_nodes)  # as decode.truncate
        depth, _, _ = tree_arrays(parents)
        top_ids = self.session.run({self.session.inputs[0]: np.ascontiguousarray(self.states)}, ["top_ids"])[0]
        return parents, [tokens[-1]] + [int(top_ids[depth[i] - 1, ranks[i]]) for i in range(1, len(parents))]


class _Grown(_Drafter):
    """A drafter whose manifest tree ({parents, ranks} or {budget, top_k}) grows by `_expander(tokens, max_nodes)`,
    an expand function of speccomp/drafters/grow.py: Hydra, EAGLE, the self-drafters. A dynamic tree grows at most
    `max_depth` deep; a static one whole, as far as the room left allows."""

    def __init__(self, tree: dict, max_depth: int):
        self.tree, self.max_depth = tree, max_depth

    def propose(self, tokens, max_depth, max_nodes):
        tree, root, expand = self.tree, tokens[-1], self._expander(tokens, max_nodes)
        if "budget" in tree:  # `max_depth` of its own bounds a dynamic tree's growth only, as grow.grow's in torch
            return grow_dynamic(min(tree["budget"], max_nodes - 1), tree["top_k"], root, expand,
                                min(self.max_depth, max_depth))
        parents, ranks = cut(tree["parents"], tree["ranks"], max_depth, max_nodes)  # a static tree: all that fits
        return parents, grow_static(parents, ranks, root, expand)


class _Hydra(_Grown):
    """Hydra heads (head_drafters.py's HydraDrafter): hydra.onnx is one head step (head index, parent states [n, H],
    parent tokens [n]) -> (states [n, H], the top `top` log-probs and token ids [n, top]); the root's state is the
    target's final hidden state at the newest token."""

    outputs = ("hidden",)

    def __init__(self, num_heads, top, max_depth, tree, session: BoundSession):
        super().__init__(tree, max_depth)
        self.session, self.h = session, None

    def take(self, extras, rows):
        self.h = extras[0][0, rows[-1]]  # [H]

    def _run(self, d, states, tokens):
        return self.session.run({"head": np.array(d, dtype=np.int64), "states": states, "tokens": tokens}, HYDRA_OUTPUTS)

    def _expander(self, tokens, max_nodes):
        return state_expander(self._run, self.h)  # grow.py's, shared with the torch drafter


class _Eagle(_Grown):
    """The EAGLE layer (eagle_drafter.py's EagleDrafter): its cache and entries are speccomp/drafters/eagle_cache.py's,
    shared with the torch runtime; eagle.onnx is the layer step; it reads the target's final hidden state at every
    newly accepted position."""

    outputs = ("hidden",)

    def __init__(self, num_heads, head_dim, top, max_depth, tree, session: BoundSession):
        super().__init__(tree, max_depth)
        self.cache = EagleCache(lambda *a: session.run(dict(zip(EAGLE_INPUTS, a)), EAGLE_OUTPUTS), num_heads, head_dim)

    def fresh(self):
        new = copy.copy(self)
        new.cache = EagleCache(self.cache.run, self.cache.k.shape[0], self.cache.k.shape[2])
        return new

    def begin(self, prompt, cache):
        self.cache.begin(prompt)

    def take(self, extras, rows):
        self.cache.take(extras[0][0, rows])

    def _expander(self, tokens, max_nodes):
        return self.cache.expander(tokens)


class _SelfDraft(_Grown):
    """early_exit / layer_skip / quantized (speccomp/drafters/graph.py's GraphDrafter): NAME.onnx is the target's own
    graph with layers bypassed (quantized: 4- or 8-bit MatMulNBits weights), run depth by depth over the target's cache (the
    expanded nodes of one depth in one run); the draft nodes' KV goes to the scratch room past the cache's length,
    which the verification overwrites."""

    def __init__(self, kv_layers, tree, max_depth, session: BoundSession, exit_layer=None, skip=None, block_size=None,
                 bits=None):  # the last four shaped the graph file; recorded, not read
        super().__init__(tree, max_depth)
        self.kv_layers, self.session, self.cache = kv_layers, session, None

    def begin(self, prompt, cache):
        self.cache = cache

    def _room(self, tokens, max_nodes):
        """(buffer [L, 2, 1, Hkv, >= base + max_nodes, D] the drafts read and write, base: its valid slots, the
        position of the root's children, past(n): the buffer's first n slots as a CacheView)."""
        return self.cache.data, self.cache.length, self.cache.length, self.cache.view

    def _run(self, feeds, used):
        return self.session.run(feeds, ["logits", "new_kv"])

    def _expander(self, tokens, max_nodes):
        data, base, position, past = self._room(tokens, max_nodes)
        slot = {}

        def expand(d, nodes, grown, k):
            used, q = len(slot), len(nodes)
            if used + q > max_nodes:  # the drafter's tree mask must fit where the target's does
                return None
            # past: the accepted prefix and the scratch slots filled so far
            feeds = _feeds([grown.token[c] for c in nodes], np.full(q, position + d, dtype=np.int64), base + used + q,
                           past(base + used), np.array(ancestor_rows(nodes, grown, slot, used), dtype=bool))
            logits, new_kv = self._run(feeds, used)
            data[self.kv_layers, ..., base + used : base + used + q, :] = new_kv
            return _top_logp(logits[0], k)

        return expand


def _top_logp(logits: np.ndarray, k: int) -> tuple[list, list]:
    """expand's answer from logits [n, V]: the top k log-probabilities and ids of each row, best first."""
    logp, ids = top_logp(logits, k)
    return logp.tolist(), ids.tolist()


class _DraftModel(_Grown):
    """A separate draft LM (speccomp/drafters/draft_model.py's DraftModelDrafter): draft_model.onnx is its whole graph
    (after TreeAttention), run over a KV cache of its own: each step rolls it back to the text it shares with the
    target, runs the unseen text and the root in one causal forward (depth 1's scores), then one forward per depth
    over that depth's expanded nodes in the scratch slots past the root. Greedy drafts are its top-k. When the row
    samples (`sampler` = (temperature, rng), set by _Row), a static tree's children are drawn from the draft's own q
    without replacement and `probs` holds each node's q for `sample_accept` (as the torch DraftModelDrafter); dynamic
    trees keep top-k point masses (which candidates survive depends on the draws, which q would not describe)."""

    name = "draft_model"

    def __init__(self, kv_layers, tree, max_depth, kv, max_nodes, max_positions, session: BoundSession):
        super().__init__(tree, max_depth)
        self.session, self.kv, self.max_nodes, self.max_positions = session, kv, max_nodes, max_positions
        self.dtype = _DTYPES[kv["dtype"]]
        self.cache, self.cached = None, []
        self.sampler, self.probs = None, None
        # whether it may sample its children (a static tree whose siblings come in rank order), decided once
        self.samples = "budget" not in tree and siblings_in_rank_order(tree["parents"], tree["ranks"])

    def begin(self, prompt, cache):
        self.cache, self.cached = KVCache(self.kv, max(512, 2 * len(prompt)), self.dtype), []

    def propose(self, tokens, max_depth, max_nodes):
        max_nodes, self.probs = min(max_nodes, self.max_nodes), None
        if self.sampler is None or not self.samples:
            return super().propose(tokens, max_depth, max_nodes)
        parents, ranks = cut(self.tree["parents"], self.tree["ranks"], max_depth, max_nodes)
        drawn = {}
        grown = grow_static(parents, ranks, tokens[-1], self._expander(tokens, max_nodes, drawn))
        if len(parents) > 1:
            self.probs = [None] + [drawn[(parents[c], ranks[c])] for c in range(1, len(parents))]
        return parents, grown

    def _forward(self, tokens, positions, past: int, mask) -> np.ndarray:
        """`tokens` after `past` cached slots; their KV written at [past, past + k); logits [k, V]."""
        feeds = _feeds(tokens, positions, past + len(tokens), self.cache.view(past), mask)
        logits, new_kv = self.session.run(feeds, ["logits", "new_kv"])
        self.cache.data[..., past : past + len(tokens), :] = new_kv
        return logits[0]

    def _expander(self, tokens, max_nodes, drawn=None):
        """expand for grow.py; `drawn` given: children sampled from q, their distributions recorded there."""
        base = len(tokens) - 1
        start = shared_prefix(self.cached, tokens[:-1])  # the last step's rejected drafts leave here
        self.cache.length = start
        if base + max_nodes + 1 > self.cache.shape[4]:  # a bigger buffer, the valid part copied
            bigger = KVCache(self.kv, max(base + max_nodes + 1, 2 * self.cache.shape[4]), self.dtype)
            bigger.append(self.cache.data[..., :start, :])
            self.cache = bigger
        slot = {}

        def expand(d, nodes, grown, k):
            if d == 0:  # the unseen text, root last: its last row scores depth 1
                n = base + 1 - start
                logits = self._forward(tokens[start:], np.arange(start, base + 1, dtype=np.int64), start,
                                       np.tril(np.ones((n, n), dtype=bool)))[-1:]
                self.cache.length, self.cached, slot[0] = base, list(tokens[:-1]), 0
                return top(logits, nodes, k)
            used, q = len(slot), len(nodes)
            if used + q > max_nodes:
                return None
            rows = np.array(ancestor_rows(nodes, grown, slot, used), dtype=bool)
            return top(self._forward([grown.token[c] for c in nodes], np.full(q, base + d, dtype=np.int64),
                                     base + used, rows), nodes, k)

        def top(logits, nodes, k):
            if drawn is None:
                return _top_logp(logits, k)
            return None, _sample_children(logits, self.sampler[0], nodes, k, drawn, self.sampler[1])

        return expand


def _tree_depth(tree: dict, max_depth: int) -> int:
    """How deep a manifest tree drafts: a static tree's depth, a dynamic one's `max_depth`."""
    return int(max(tree_arrays(tree["parents"])[0])) if "parents" in tree else max_depth


# an engine's KV layout as speccomp/kv/cache.py reads it (the torch runtime hands it a KVSpec)
_Layout = namedtuple("_Layout", "num_layers num_kv_heads head_dim dtype")


class _CompressedKV(_SelfDraft):
    """kv_mode="draft" (speccomp/kv/draft.py's CompressedKVDrafter): the self-drafter's graph over a compressed copy
    of the target's cache, kept by speccomp/kv/cache.py (the torch runtime's own, numpy). Before each draft the newly
    accepted tokens' exact KV joins it and it compacts; draft positions count from the target's length. SnapKV and
    H2O read the graph's attention output (AttentionScores, its last): the observation window's votes once after the
    prompt, and (H2O) the root's attention at every step."""

    def __init__(self, kv_cache, kv_layers, tree, max_depth, session: BoundSession, kv: dict, dtype):
        super().__init__(kv_layers, tree, max_depth, session)
        self.policy = parse_kv_cache(kv_cache)
        self.layout = _Layout(kv["num_layers"], kv["num_kv_heads"], kv["head_dim"], np.dtype(dtype))
        self.min_window = _tree_depth(tree, min(max_depth, tree.get("budget", max_depth))) + 1
        try:  # a hand-edited manifest fails at load, not at the first generate
            self.policy.check(self.layout, min_window=self.min_window)
        except KVPolicyError as exc:
            raise _corrupt(f"drafter.options.kv_cache: {exc}") from None
        self.scores = session.session.get_outputs()[-1].name if self.policy.needs_attention else None
        self.compressed, self.h2o_root = None, False

    def begin(self, prompt, cache):
        self.cache = cache
        self.compressed = make_cache(self.layout, self.policy, self.min_window, self.layout.dtype)

    def _observe(self, tokens) -> np.ndarray:
        """Votes [L, Hkv, n] of the last w prompt tokens' queries over the n cached prompt tokens."""
        n = self.cache.length
        w = min(snapkv_window(self.policy.budget), n)
        feeds = _feeds(tokens[n - w : n], np.arange(n - w, n, dtype=np.int64), n, self.cache.view(n - w),
                       np.tril(np.ones((w, w), dtype=bool)))
        scores = self.session.run(feeds, [self.scores])[0]  # [L', 1, Hkv, w, n]
        return all_layers(scores[:, 0].sum(2), self.kv_layers, self.layout.num_layers)

    def _room(self, tokens, max_nodes):
        target, cache = self.cache, self.compressed
        votes = self._observe(tokens) if needs_votes(cache, target.length) else None
        cache.extend(target.data[..., cache.length : target.length, :], votes)
        self.h2o_root = self.policy.kind == "h2o"
        data, slots = cache.workspace(max_nodes), cache.slots
        dense = lambda n: np.ascontiguousarray(data[..., :n, :])  # noqa: E731
        return data, slots, target.length, lambda n: CacheView(data, n, slots, dense)

    def _run(self, feeds, used):
        if self.scores is None:
            return super()._run(feeds, used)
        logits, new_kv, scores = self.session.run(feeds, ["logits", "new_kv", self.scores])
        if self.h2o_root and used == 0:  # the root's row: a real token's attention over the cache
            base = self.compressed.slots
            self.compressed.accumulate(all_layers(scores[:, 0, :, 0, :base], self.kv_layers, self.layout.num_layers))
            self.h2o_root = False
        return logits, new_kv


class _Merged(_Drafter):
    """Merged drafters (speccomp/drafters/merge.py's MergedDrafter): every drafter drafts from the same root, the
    trees merge into one (lookup.merge_trees), each drafter observes its own part of the verified tree."""

    def __init__(self, drafters: list, name: str):
        self.drafters, self.drafts, self.wheres, self.name = drafters, [], [], name
        self.outputs = tuple(o for d in drafters for o in d.outputs)
        self.observe_optional = all(d.observe_optional for d in drafters)
        self.max_positions = tightest_context(drafters)  # a draft model's bounds the merge's text (check_context)

    def fresh(self):
        return _Merged([d.fresh() for d in self.drafters], self.name)

    def finish(self, text):
        for d in self.drafters:
            d.finish(text)

    def begin(self, prompt, cache):
        for d in self.drafters:
            d.begin(prompt, cache)

    def _split(self, extras):
        """Each drafter with its own slice of the extra outputs."""
        at = 0
        for d in self.drafters:
            yield d, extras[at : at + len(d.outputs)]
            at += len(d.outputs)

    def take(self, extras, rows):
        for d, own in self._split(extras):
            d.take(own, rows)

    def propose(self, tokens, max_depth, max_nodes):
        drafts = [d.propose(tokens, max_depth, max_nodes) for d in self.drafters]
        parents, merged, self.wheres = merge_trees(tokens[-1], drafts, max_depth, max_nodes)
        self.drafts = drafts
        return parents, merged

    def observe(self, tokens, path, logits, extras):
        if len(tokens) == 1:  # the root alone was verified (the last token): so would each drafter
            for d, own_extras in self._split(extras):
                d.observe(tokens, path, logits, own_extras)
            return
        for (d, own_extras), (_, own_tokens), where in zip(self._split(extras), self.drafts, self.wheres):
            own, merged, own_path = own_view(where, path)
            d.observe([own_tokens[i] for i in own], own_path, logits[merged], [e[:, merged] for e in own_extras])


class _CrossTokenizer(_Drafter):
    """A draft model with a tokenizer of its own (drafters/draft_model.py's CrossTokenizerDrafter): the text so far
    re-tokenized for `inner` (a _DraftModel), its tree mapped into target ids path by path (drafters/text_bridge.py,
    the same code as torch's). Drafts are point masses (q = 1)."""

    name = "draft_model"

    def __init__(self, inner: _DraftModel, bridge: TextBridge):
        self.inner, self.bridge = inner, bridge

    def fresh(self):
        return _CrossTokenizer(self.inner.fresh(), self.bridge)

    def begin(self, prompt, cache):
        self.inner.begin(self.bridge.to_draft(list(prompt)), cache)

    def propose(self, tokens, max_depth, max_nodes):
        tokens, room = list(tokens), min(max_nodes, self.inner.max_nodes)
        context, depth = self.bridge.context(tokens, max_depth, self.inner.max_positions)
        if depth < 1:
            return [-1], [tokens[-1]]
        parents, drafted = self.inner.propose(context, depth, room)
        return self.bridge.target_tree(tokens, context, list(parents), list(drafted), max_depth, max_nodes)


def _text_bridge(files: dict, path: Path) -> TextBridge:
    """The draft model's two tokenizers, named by the manifest's draft_model.options.tokenizers."""
    from tokenizers import Tokenizer

    loaded = {}
    for side in ("target", "draft"):
        file = path / files[side]
        if not file.is_file():
            raise EngineError(f"the draft model's {side} tokenizer {file} is missing; re-export the engine")
        try:
            loaded[side] = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises its own Exception type for unreadable files
            raise EngineError(f"the draft model's {side} tokenizer {file} is corrupt ({str(exc).splitlines()[0]}); "
                              "re-export the engine") from None
    return TextBridge(loaded["target"], loaded["draft"])


def check_batchable(manifest: dict, rows: int, draft: bool = True) -> None:
    """A batch of `rows` > 1 needs a model without sliding windows and (`draft`: the engine loaded with its drafter) a
    drafter that reads no target cache. From the manifest alone, so `speccomp serve --replicas` checks it before
    any replica loads the engine."""
    if rows <= 1:
        return
    fix = "call generate once per prompt"
    windows = manifest["model"].get("sliding_window_layers")
    if windows is None:
        raise EngineError(f"a batch of {rows}: this engine's manifest does not say whether the model has "
                          f"sliding-window attention (exported by an older speccomp); re-export it, or {fix}")
    if windows:
        raise EngineError(f"a batch of {rows}: the model has sliding-window attention ({windows} layers), whose "
                          f"window counts cache slots; packed rows' slots are not their positions; {fix}")
    name = manifest["drafter"].get("name")
    if draft and name is not None and any(part in SELF_DRAFTERS for part in name.split("+")):
        raise EngineError(f"a batch of {rows}: the {name} drafter drafts over the target's own KV cache, which a "
                          f"batch shares between rows; load the engine with draft=False (`speccomp serve "
                          f"--no-draft`: plain decoding), or {fix}")


def make_drafter(spec: dict, path: Path, providers: list[str], threads: int | None, target_outputs: list[str],
                 kv: dict, dtype):
    name, options = spec.get("name"), dict(spec.get("options") or {})
    if name is None:
        return None
    if "+" in name:
        return _Merged([make_drafter(part, path, providers, threads, target_outputs, kv, dtype)
                        for part in spec["drafters"]], name)
    if name == "ngram":
        return _NGram(**options)
    if name == "suffix":
        return _Suffix(**options)
    if name == "token_recycling":
        return _TokenRecycling(**options, target_outputs=target_outputs)
    light = light_graph(spec)  # one thread, no pool (the target's may spin: Engine.__init__)
    session = BoundSession(path / spec["graph"], providers, 1 if light else threads, spin=False)
    if name == "medusa":
        check_medusa(options, session.session, target_outputs)
        return _Medusa(**options, session=session)
    if name in ("hydra", "eagle"):
        check_head_step(name, options, session.session)
        return (_Hydra if name == "hydra" else _Eagle)(**options, session=session)
    check_self_draft(options, session.session, spec["graph"])
    if name == "draft_model":
        check_kv_io(session, options["kv"], _DTYPES[options["kv"]["dtype"]], spec["graph"], "drafter.options.kv")
        files = options.pop("tokenizers", None)
        inner = _DraftModel(**options, session=session)
        return inner if files is None else _CrossTokenizer(inner, _text_bridge(files, path))
    if name == "compressed_kv":
        options.pop("weights", None)  # quantised weights are in the graph file itself; the manifest says so
        return _CompressedKV(**options, session=session, kv=kv, dtype=dtype)
    return _SelfDraft(**options, session=session)


def check_medusa(options: dict, session, target_outputs: list[str]) -> None:
    """A Medusa engine's tree and options against medusa.onnx ([K, H] states -> [K, top] ids) and the target graph
    (which must return the head states as its 4th output)."""
    def bad(field, value, what):
        raise _corrupt(f"{MEDUSA_FILE}: drafter.options.{field}={value!r} {what}")

    k_heads = session.get_inputs()[0].shape[0]
    top = session.get_outputs()[0].shape[-1]
    if isinstance(k_heads, int) and options["num_heads"] != k_heads:
        bad("num_heads", options["num_heads"], f"but {MEDUSA_FILE} takes the states of {k_heads} heads")
    if isinstance(top, int) and options["top"] != top:
        bad("top", options["top"], f"but {MEDUSA_FILE} returns the top {top} tokens of each head")
    if max(options["ranks"]) >= options["top"]:
        bad("ranks", options["ranks"], f"use sibling ranks up to {max(options['ranks'])}, past the top {options['top']}")
    depth = _tree_depth(options, 0)
    if depth > options["num_heads"]:
        bad("parents", options["parents"], f"make a tree {depth} deep for {options['num_heads']} heads")
    if len(target_outputs) < 4 or options["states_output"] != target_outputs[3]:
        bad("states_output", options["states_output"], f"is not the target graph's head-state output "
            f"(its outputs: {target_outputs})")


def check_self_draft(options: dict, session, file: str) -> None:
    """A self-drafter's graph takes the target's convention and returns the KV of `kv_layers`."""
    inputs = [i.name for i in session.get_inputs()]
    layers = next((o.shape[0] for o in session.get_outputs() if o.name == "new_kv"), None)
    convention = [n for n in inputs if not n.startswith(LAYER_INPUT)]  # in place: past_kv one layer an input
    past = ["past_kv"] if "past_kv" in inputs else []
    in_place = len(convention) < len(inputs)
    if convention != ["input_ids", "position_ids", "attention_mask", *past, "tree_mask"] or layers is None \
            or bool(past) == in_place:  # the cache comes in one way: past_kv, or one input per layer
        raise _corrupt(f"{file} takes {inputs}, not a self-drafter graph")
    if isinstance(layers, int) and layers != len(options["kv_layers"]):
        raise _corrupt(f"{file} returns the KV of {layers} layers but drafter.options.kv_layers names "
                       f"{len(options['kv_layers'])}")


def check_head_step(name: str, options: dict, session) -> None:
    """A Hydra or EAGLE engine's options against its step graph (hydra.onnx: head index, states, tokens -> next
    states, top log-probs, ids; eagle.onnx: EagleStep's convention)."""
    file, inputs, outputs = {"hydra": (HYDRA_FILE, ["head", "states", "tokens"], HYDRA_OUTPUTS),
                             "eagle": (EAGLE_FILE, EAGLE_INPUTS, EAGLE_OUTPUTS)}[name]
    names = [o.name for o in session.get_outputs()]
    if [i.name for i in session.get_inputs()] != inputs or names != outputs:
        raise _corrupt(f"{file} takes {[i.name for i in session.get_inputs()]} and returns {names}, not the "
                       f"{name} step graph")
    top = session.get_outputs()[-1].shape[-1]
    tree = options["tree"]
    k = max(tree["ranks"]) + 1 if "ranks" in tree else tree["top_k"]
    if isinstance(top, int) and (top != options["top"] or k > top):
        raise _corrupt(f"{file} returns the top {top} tokens but drafter.options.top={options['top']} and "
                       f"the tree needs {k}")
    if name == "eagle":
        shape = session.get_inputs()[3].shape  # past_k [A, P, D]
        if shape[0] != options["num_heads"] or shape[2] != options["head_dim"]:
            raise _corrupt(f"{file} reads a cache of {shape[0]} heads of size {shape[2]} but drafter.options say "
                           f"{options['num_heads']} of {options['head_dim']}")
        return
    depth = _tree_depth(tree, options["max_depth"])
    if depth > options["num_heads"] or options["max_depth"] > options["num_heads"]:
        raise _corrupt(f"drafter.options: a tree {depth} deep for {options['num_heads']} Hydra heads")


# ---- One generation in the loop -----------------------------------------------------------------------------
class _Row(Generation):
    """One generation (speccomp/runtime/decode.py's Sequence in numpy): first(prefill outputs), draft(), accept(),
    advance(); Engine._decode runs one, Engine._decode_batch many packed into one forward a step."""

    def __init__(self, args, drafter, max_tree: int, seed):
        super().__init__(args.prompt.tolist(), args.max_new_tokens, args.eos, max_tree)
        self.drafter, self.args = drafter, args
        self.rng = np.random.default_rng(seed)
        self.steps, self._bonus = 0, None
        if hasattr(drafter, "sampler"):  # a draft model: it samples its drafts from q when the row samples
            drafter.sampler = (args.temperature, self.rng) if args.do_sample else None

    def pick(self, logits_row: np.ndarray) -> int:
        if not self.args.do_sample:
            return int(logits_row.argmax())
        return int(self.rng.choice(logits_row.shape[-1], p=warp(logits_row, self.args.temperature, self.args.top_p)))

    def first(self, logits, extras, cache) -> None:
        """The prefill's logits [n, V] and extra outputs ([1, n, ...])."""
        self.steps = 1
        self._emit([self.pick(logits[-1])])
        if self.drafter is not None:
            self.drafter.begin(self.prompt, cache)
            self.drafter.take(extras, list(range(len(self.prompt))))

    def draft(self, max_nodes: int | None = None) -> tuple[list[int], list[int]]:
        """`max_nodes`: a batch's cap for this row this step (Generation.room)."""
        room, cap = self.room(max_nodes)
        if self.drafter is None or room <= 1 or cap <= 1:
            if hasattr(self.drafter, "probs"):
                self.drafter.probs = None  # no draft this step: no q from an earlier one
            return [-1], [self.out[-1]]
        return self.drafter.propose(self.context, room - 1, cap)

    def accept(self, draft: tuple, mine: tuple) -> list[int]:
        """draft: (tokens, children); mine: the target's (logits [n, V], extras) over its nodes."""
        probs = getattr(self.drafter, "probs", None) if self.args.do_sample else None
        if probs is not None:  # drafts sampled from q: recursive rejection sampling
            target = lambda node: warp(mine[0][node], self.args.temperature, self.args.top_p)  # noqa: E731
            path, self._bonus = sample_accept(*draft, target, probs, self.rng)
        else:
            path, self._bonus = accept(*draft, lambda node: self.pick(mine[0][node]))
        return path

    def observes(self, idle: bool) -> bool:
        """Whether `advance` hands the drafter this step's outputs: not where a batch's budget switched the row's
        drafter off (`idle`, runtime/budget.py) and skipping costs acceptance only (decode.py's Drafter)."""
        return self.drafter is not None and not (idle and self.drafter.observe_optional)

    def advance(self, draft: tuple, path: list[int], mine: tuple, idle: bool = False) -> None:
        tokens, (logits, extras) = draft[0], mine
        if self.observes(idle):
            self.drafter.observe(tokens, path, logits, extras)
        if self.drafter is not None:
            self.drafter.take(extras, path)
        self.steps += 1
        self._emit([tokens[i] for i in path[1:]] + [self._bonus])

    def stats(self, seconds) -> dict:
        about = {"new_tokens": len(self.out), "steps": self.steps, "tau": len(self.out) / self.steps}
        if seconds:
            about |= {"seconds": seconds, "tokens_per_second": len(self.out) / seconds}
        return about


class EngineBatch(PackedBatch):
    """Rows of one engine decoding together (speccomp/runtime/batch.py's Batch in numpy; the step is
    runtime/packed.py's): `add` a row between steps, `step`, `remove` a row. Rows are `Engine.row`s."""

    error = EngineError

    def __init__(self, engine, capacity: int, budget=None):
        super().__init__(capacity, engine.max_tree, budget)
        self.engine = engine
        self.cache = KVCache(engine.kv, capacity, engine.dtype)

    def _prefill(self, rid: int) -> Part:
        n = len(self.rows[rid].prompt)
        return Part(rid, self.rows[rid].prompt, np.arange(n), np.tri(n, dtype=bool))

    def _draft(self, rid: int, cap: int | None) -> Part:
        row = self.rows[rid]
        parents, tokens = row.draft(cap)
        depth, block, children = tree_arrays(parents)
        return Part(rid, tokens, len(row.context) - 1 + depth, block, (tokens, children))  # cached: all but the root

    def _forward(self, parts: list[Part], mask: np.ndarray, observed: list[int]) -> tuple:
        return self.engine._forward(self.cache, [t for p in parts for t in p.tokens],
                                    np.concatenate([p.positions for p in parts]).astype(np.int64), mask, observed)

    def _share(self, outs: tuple, at: int, n: int) -> tuple:
        return outs[0][at:at + n], [e[:, at:at + n] for e in outs[2]]

    def _first(self, row: "_Row", mine: tuple) -> None:
        row.first(*mine, self.cache)

    def _append(self, outs: tuple, keep: list[int]) -> None:
        self.cache.append(outs[1], keep=np.array(keep))

    def _move(self, idx: np.ndarray) -> None:
        self.cache.data[..., :len(idx), :] = self.cache.data[..., idx, :]


# ---- The engine ------------------------------------------------------------------------------------------
class Engine:
    """An exported engine: `generate` with SpecModel's contract, on ONNX Runtime and numpy.

    Thread safety as SpecModel's: concurrent `generate` calls run one at a time (they share the sessions'
    IO bindings and the drafter's state) and `last_stats` is the calling thread's own last call's."""

    def __init__(self, path, provider: str = "cpu", threads: int | None = None, verify: bool = True,
                 draft: bool = True):
        for name, value in (("draft", draft), ("verify", verify)):
            if not isinstance(value, bool):
                raise OptionTypeError(name, value, "must be True or False")
        if threads is not None:
            threads = as_int("threads", threads, "a positive int, or None for ONNX Runtime's default")
            if threads < 1:
                raise OptionError("threads", threads, "must be >= 1", "or None for ONNX Runtime's default")
        if not isinstance(provider, str):
            raise OptionTypeError("provider", provider, f"must be a str, got {type(provider).__name__}",
                                  f"one of {sorted(PROVIDERS)}")
        if not isinstance(path, (str, os.PathLike)):
            raise OptionTypeError("path", path, f"must be an engine directory's path, got {type(path).__name__}")
        self.path = Path(path).expanduser()  # "~/engine" as export takes it (a shell leaves --engine=~/e as is)
        self.manifest = m = read_manifest(self.path, verify=verify)
        self.kv, self.vocab_size, self.max_positions = m["kv"], m["model"]["vocab_size"], m["model"].get("max_positions")
        self.dtype = _DTYPES.get(self.kv["dtype"])
        if self.dtype is None:
            raise EngineError(f"engine KV dtype {self.kv['dtype']!r} is not supported by the numpy runtime; export "
                              "the model in float32 (or float16) instead")
        self.max_tree = int(m["max_tree"])
        self.provider = provider
        target = m["graphs"]["target"]
        providers = check_provider(provider)
        # a heavy drafter graph (a draft model, a self-drafter) is a second pool: then no session's threads spin
        # between runs (on 2 cores two spinning pools made hydra+token_recycling slower than plain decoding). A light
        # one (Hydra, EAGLE steps) runs on one thread beside the spinning target: benchmarks/README.md
        second = draft and any(p.get("graph") and not light_graph(p) for p in m["drafter"].get("drafters") or [m["drafter"]])
        self.session = BoundSession(self.path / target["file"], providers, threads, spin=not second)
        self._curve_key = engine_key(target["sha256"], self.session.providers, threads, spin=not second)
        check_target(self.session, m, self.dtype)
        # draft=False: plain decoding on the same target graph (extra outputs a drafter would read go unused)
        self.drafter = make_drafter(m["drafter"], self.path, providers, threads, target["outputs"], self.kv,
                                    self.dtype) if draft else None
        self.tokenizer = self._load_tokenizer()  # a missing or corrupt tokenizer.json is named now, not at first use
        self._template = self._chat_template()
        self._calls = CallGuard()

    @property
    def providers(self) -> list[str]:
        """The ONNX Runtime execution providers the target session really runs on."""
        return self.session.providers

    @property
    def last_stats(self) -> dict:
        return self._calls.stats

    # ---- text -------------------------------------------------------------------------
    def _load_tokenizer(self):
        """The engine's tokenizer (tokenizers' Tokenizer), None when it was exported without one; a missing or
        unreadable tokenizer.json is an EngineError. Without the tokenizers package: None, checked at first use."""
        info = self.manifest.get("tokenizer")
        if not info:
            return None
        file = self.path / info["file"]
        if not file.is_file():
            raise EngineError(f"the engine's tokenizer {file} is missing; re-export with tokenizer= (or copy it back)")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return None
        try:
            return Tokenizer.from_file(os.fspath(file))
        except Exception as exc:  # tokenizers raises its own Exception type for unreadable files
            raise EngineError(f"the engine's tokenizer {file} is corrupt ({str(exc).splitlines()[0]}); re-export "
                              "the engine with tokenizer=") from None

    def _tok(self):
        if self.tokenizer is None:
            if not self.manifest.get("tokenizer"):
                raise EngineError("this engine was exported without a tokenizer; pass token ids, or re-export with tokenizer=")
            raise EngineError("text in and out of an engine needs the tokenizers package: pip install tokenizers")
        return self.tokenizer

    def _chat_template(self):
        """The manifest's chat template compiled (None: no template, or jinja2 missing: then at first use)."""
        template = (self.manifest.get("tokenizer") or {}).get("chat_template")
        if not template:
            return None
        try:
            from jinja2 import TemplateError
        except ImportError:
            return None
        try:
            return _template_env().from_string(template)
        except TemplateError as exc:
            raise EngineError(f"the engine's tokenizer.chat_template is not a valid Jinja template ({exc}); re-export "
                              "the engine with a tokenizer whose chat template works") from None

    def chat_ids(self, prompt) -> np.ndarray:
        """Token ids [1, n] of `prompt` as a user turn in the model's chat template (as models.chat_ids), or of a
        conversation: a list of {"role", "content"} messages. Without a template: the messages' contents, joined."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        info = self.manifest.get("tokenizer") or {}
        if info.get("chat_template"):
            if self._template is None:
                raise EngineError("rendering the engine's chat template needs jinja2: pip install jinja2")
            from jinja2 import TemplateError

            try:
                # tools and documents None, as transformers renders them: templates test `tools is not none`
                text = self._template.render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                             **info.get("special_tokens", {}))
            except TemplateError as exc:  # the template's own refusal (roles must alternate, ...) or its bug
                raise OptionError("messages", messages, f"the model's chat template refused them: {exc}",
                                  "order the messages as the model's chat template expects (e.g. user and "
                                  "assistant turns alternating)") from None
        else:
            text = "\n".join(m["content"] for m in messages)
        return np.array([self._tok().encode(text, add_special_tokens=False).ids], dtype=np.int64)

    def text_ids(self, text: str) -> list[int]:
        """Token ids of plain `text` (a completion prompt), with the tokenizer's special tokens (BOS) if it adds any."""
        return self._tok().encode(text, add_special_tokens=True).ids

    def decode(self, ids) -> str:
        return self._tok().decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def eos_token_id(self):
        return self.manifest["model"].get("eos_token_id")

    # ---- decoding ---------------------------------------------------------------------
    def _forward(self, cache: KVCache, tokens: list[int], positions: np.ndarray, tree_mask: np.ndarray,
                 observed=None):
        """logits [q, V], new_kv [L, 2, 1, Hkv, q, D], and the extra outputs the drafter reads. `observed`: the nodes
        whose outputs the drafter observes (None: all); a v3 Token Recycling graph's TopK reads those alone
        (TOP_ROWS_INPUT: a vocabulary-wide top-k per node is what a switched-off batch row saves), the other nodes' rows
        of TOP_IDS_OUTPUT are 0 and read by nobody."""
        feeds = _feeds(tokens, positions, cache.length + len(tokens), cache.view(), tree_mask)
        extra = list(self.drafter.outputs) if self.drafter is not None else []
        gathered = TOP_ROWS_INPUT in self.session.inputs
        if gathered:
            rows = np.arange(len(tokens)) if observed is None else np.asarray(observed, dtype=np.int64)
            rows = feeds[TOP_ROWS_INPUT] = rows if TOP_IDS_OUTPUT in extra else rows[:0]
        logits, new_kv, *extras = self.session.run(feeds, ["logits", "new_kv", *extra])
        if gathered and TOP_IDS_OUTPUT in extra:  # one row per node again, as a v2 graph returns it
            at = extra.index(TOP_IDS_OUTPUT)
            full = np.zeros((1, len(tokens), extras[at].shape[-1]), dtype=np.int64)
            full[0, rows] = extras[at][0]
            extras[at] = full
        return logits[0], new_kv, extras

    def generate(self, input_ids, max_new_tokens: int, eos_token_id=None, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None, attention_mask=None,
                 pad_token_id: int | None = None, load_aware: bool = True) -> np.ndarray:
        """Prompt + new tokens, np.int64 [1, n + m]; greedy output equals the model's greedy decoding. A left-padded
        batch [B, n] with `attention_mask` decodes every row as if alone ([B, n + m], padded with `pad_token_id`,
        default as HF: the exported model's generation_config.pad_token_id, else the first eos id; `load_aware`: caps
        on each row's tree by goodput), as SpecModel.generate. Arguments are checked as SpecModel.generate's
        (speccomp/runtime/calls.py)."""
        if not isinstance(load_aware, bool):  # checked for one sequence too, where it changes nothing
            raise OptionTypeError("load_aware", load_aware, "must be True or False")
        check_unmasked_padding(input_ids, attention_mask, pad_token_id, self.manifest["model"].get("pad_token_id"),
                               eos_token_id, self.eos_token_id)
        input_ids, attention_mask, padding = one_padded_row(input_ids, attention_mask)  # [1, n] left-padded
        rows = batch_rows(input_ids, attention_mask)
        if rows is not None:
            return self._generate_batch(input_ids, rows, max_new_tokens, eos_token_id, do_sample, temperature, top_p,
                                        seed, pad_token_id, load_aware)
        args = generate_args(input_ids, max_new_tokens, eos_token_id, do_sample, temperature, top_p, seed,
                             vocab_size=self.vocab_size, max_positions=self.max_positions)
        check_context(self.drafter, len(args.prompt), args.max_new_tokens)
        pad_id(pad_token_id, args.eos, self.vocab_size)  # unused by one sequence, checked all the same
        with self._calls.lock:
            out, stats = self._decode(args)
            self._calls.stats = stats
        out = np.concatenate([args.prompt, np.asarray(out, dtype=np.int64)])[None]
        return out if padding is None else np.concatenate([host_array(padding).astype(np.int64), out], axis=1)

    def _decode(self, args) -> tuple[list[int], dict]:
        """The decode loop (speccomp/runtime/decode.py's, in numpy): new tokens and stats."""
        start, n = time.perf_counter(), len(args.prompt)
        row = _Row(args, self.drafter, self.max_tree, args.seed)
        cache = KVCache(self.kv, n + args.max_new_tokens + self.max_tree + 1, self.dtype)
        logits, new_kv, extras = self._forward(cache, row.prompt, np.arange(n, dtype=np.int64),
                                               np.tril(np.ones((n, n), dtype=bool)), observed=[])  # a prefill
        cache.append(new_kv)
        prefill_seconds = time.perf_counter() - start
        row.first(logits, extras, cache)
        while not row.done:
            parents, tokens = row.draft()
            depth, mask, children = tree_arrays(parents)
            logits, new_kv, extras = self._forward(cache, tokens, cache.length + depth, mask)
            path = row.accept((tokens, children), (logits, extras))
            cache.append(new_kv, keep=path)
            row.advance((tokens, children), path, (logits, extras))
        row.finish()
        seconds = time.perf_counter() - start
        return row.out, {**row.stats(seconds), "prefill_seconds": prefill_seconds, "kv_bytes": cache.nbytes(),
                         "lossless": True, "providers": self.providers}

    def _generate_batch(self, input_ids, rows, max_new_tokens, eos_token_id, do_sample, temperature, top_p, seed,
                        pad_token_id, load_aware) -> np.ndarray:
        """A batch: every row checked as a single generate's, then decoded together, packed into one forward a step
        (speccomp/runtime/batch.py's scheme, in numpy)."""
        args = [generate_args(r, max_new_tokens, eos_token_id, do_sample, temperature, top_p, seed,
                              vocab_size=self.vocab_size, max_positions=self.max_positions) for r in rows]
        for a in args:
            check_context(self.drafter, len(a.prompt), a.max_new_tokens)
        self.check_batchable(len(rows))
        pad = pad_id(pad_token_id, args[0].eos, self.vocab_size, self.manifest["model"].get("pad_token_id"))
        with self._calls.lock:
            start = time.perf_counter()
            seqs = [_Row(a, None if self.drafter is None else self.drafter.fresh(), self.max_tree,
                         row_seed(a.seed, i)) for i, a in enumerate(args)]
            forwards = self._decode_batch(seqs, load_aware)
            seconds = time.perf_counter() - start
            new_tokens = sum(len(r.out) for r in seqs)
            self._calls.stats = {"batch": len(seqs), "forwards": forwards, "new_tokens": new_tokens, "seconds": seconds,
                                 "tokens_per_second": new_tokens / seconds, "rows": [r.stats(None) for r in seqs],
                                 "lossless": True, "providers": self.providers}
        given = np.asarray(input_ids.detach().cpu() if hasattr(input_ids, "detach") else input_ids, dtype=np.int64)
        new = np.full((len(seqs), max(len(r.out) for r in seqs)), pad, dtype=np.int64)
        for i, r in enumerate(seqs):
            new[i, : len(r.out)] = r.out
        return np.concatenate([given, new], axis=1)

    def check_batchable(self, rows: int) -> None:
        check_batchable(self.manifest, rows, draft=self.drafter is not None)

    def _decode_batch(self, rows: list, load_aware: bool = True) -> int:
        """All rows to the end together; the number of target forwards."""
        return run_batch(self.batch(sum(row_slots(len(r.prompt), r.max_new_tokens, self.max_tree) for r in rows),
                                    load_aware), rows)

    def batch(self, kv_slots: int, load_aware: bool = True) -> "EngineBatch":
        """An empty batch over a cache of `kv_slots` slots, for rows to join and leave (`speccomp serve`)."""
        budget = Budget(self.step_costs(), self.max_tree) if load_aware and self.drafter is not None else None
        return EngineBatch(self, kv_slots, budget)

    def row(self, input_ids, max_new_tokens: int, eos_token_id=None, do_sample: bool = False, temperature: float = 1.0,
            top_p: float = 1.0, seed: int | None = None) -> "_Row":
        """One generation for a batch, its arguments checked as generate's (eos: the engine's own by default)."""
        args = generate_args(input_ids, max_new_tokens, self.eos_token_id if eos_token_id is None else eos_token_id,
                             do_sample, temperature, top_p, seed, vocab_size=self.vocab_size,
                             max_positions=self.max_positions)
        check_context(self.drafter, len(args.prompt), args.max_new_tokens)
        return _Row(args, None if self.drafter is None else self.drafter.fresh(), self.max_tree, args.seed)

    def step_costs(self):
        """The target's step-cost curve (runtime/budget.py's StepCosts): the grid stored for this engine on this
        machine (`store_step_curve`, `speccomp serve`'s first start), other points measured at first use."""
        if getattr(self, "_step_costs", None) is None:
            held = {}

            def run(q: int, past: int) -> None:
                if held.get("cache") is None or held["cache"].shape[4] < past + q:  # allocated in a warm-up call
                    held["cache"] = None
                    held["cache"] = KVCache(self.kv, past + q, self.dtype)
                cache = held["cache"]
                cache.length = past
                positions = np.arange(past, past + q, dtype=np.int64)  # wrapped: a batch's slots pass a row's context
                self._forward(cache, [0] * q, positions if self.max_positions is None else positions % self.max_positions,
                              np.tril(np.ones((q, past + q), dtype=bool), past))

            run.release = held.clear  # StepCosts lets go of the cache after each grid point
            self._step_costs = StepCosts(run, measured=read_curve(self._curve_key))
        return self._step_costs

    def store_step_curve(self, max_q: int = AHEAD_Q, max_past: int = AHEAD_PAST) -> Path:
        """Measure the step-cost grid up to max_q x max_past (what is not stored yet) and store all it holds for
        this engine on this machine (tuning/step_curve.py), where every later Engine on it starts from it."""
        costs = self.step_costs()
        known = len(costs.measured)
        costs.measure_ahead(max_q, max_past)
        path = curve_path(self._curve_key)
        return write_curve(self._curve_key, costs.measured) if len(costs.measured) > known or not path.is_file() else path

    def __repr__(self) -> str:
        d = (self.manifest["drafter"].get("name") if self.drafter is not None else None) or "plain"
        return f"Engine({str(self.path)!r}, drafter={d}, providers={self.providers})"


def load(path, provider: str = "cpu", threads: int | None = None, verify: bool = True, draft: bool = True) -> Engine:
    """Load an engine directory written by `SpecModel.export` (see the module docstring).

    provider: "cpu", "cuda" or "tensorrt" (ONNX Runtime execution providers; the GPU ones need
    onnxruntime-gpu and a GPU, and say so when missing). verify: check graph files against the
    manifest's SHA-256 first. draft=False: decode without the engine's drafter (plain decoding on
    the same target graph, the baseline to compare a drafter's speed against)."""
    return Engine(path, provider, threads, verify, draft)
