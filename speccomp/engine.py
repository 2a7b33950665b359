"""Run an exported engine directory with ONNX Runtime and numpy only: no torch anywhere.

    engine = speccomp.load("engine/")                      # needs only onnxruntime + numpy (+ tokenizers)
    ids = engine.chat_ids("Write a haiku about speed")     # tokenizer.json + the manifest's chat template
    out = engine.generate(ids, max_new_tokens=128)          # np.int64 [1, prompt + new], like SpecModel
    print(engine.decode(out[0, ids.shape[1]:]))

`SpecModel.export(dir)` (backends/onnx_engine.py) writes the directory:

    manifest.json    what is inside and how to call it (MANIFEST_KEYS; format speccomp-engine v1)
    target.onnx      the target verify graph after TreeAttention: one file serves prefill (causal
                     tree_mask), plain decoding (q = 1) and tree verification (q = tree size)
    tokenizer.json   the Hugging Face fast tokenizer (when export was given one)
    medusa.onnx      (Medusa engines) the heads' projection: head states [K, H] -> top token ids [K, top]

The decode loop is speccomp/speculative.py's, restated in numpy: draft a tree (no drafter: the root
alone), verify it in one session run, walk the tree while the target agrees, keep the KV of the
accepted path. Drafters here are the model-free ones (prompt lookup, Token Recycling), sharing their
lookup code with the torch drafters (speccomp/lookup.py), and Medusa heads, whose residual blocks are
inside target.onnx (an extra output: head states of every token) and whose projection is medusa.onnx.
Sessions run through IO binding; the KV cache and the contiguous `past_kv` it is fed from are
allocated once per generate.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from .errors import SpeccompError
from .lookup import NGramIndex, Trie, fill_template, recycle

FORMAT, FORMAT_VERSION = "speccomp-engine", 1
MANIFEST = "manifest.json"
MEDUSA_FILE = "medusa.onnx"
MANIFEST_KEYS = ("format", "format_version", "speccomp_version", "model", "kv", "graphs", "opset", "max_tree", "drafter")
ENGINE_DRAFTERS = (None, "ngram", "token_recycling", "medusa")  # drafters the torch-free loop can run
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": None}


class EngineError(SpeccompError, RuntimeError):
    """An engine directory is missing, corrupt or does not match; the message names the fix."""


# --------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(path, verify: bool = True) -> dict:
    """The validated manifest of engine directory `path`. verify=True also checks every graph file's
    size and SHA-256 against the manifest (a truncated or edited file is caught before ORT loads it)."""
    path = Path(path)
    remake = "re-export it with `compiled.export(dir)` or `speccomp export DIR`"
    if not path.is_dir():
        raise EngineError(f"no engine directory at {path}; {remake}")
    file = path / MANIFEST
    if not file.is_file():
        raise EngineError(f"{path} is not a speccomp engine: it has no {MANIFEST}; {remake}")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError(f"{file} is not valid JSON ({exc}); the engine is corrupt, {remake}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise EngineError(f"{file} is not a speccomp engine manifest (format must be {FORMAT!r}); {remake}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise EngineError(
            f"{file} has format_version {manifest.get('format_version')!r}; this speccomp reads version "
            f"{FORMAT_VERSION}; {remake} with this speccomp"
        )
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise EngineError(f"{file} lacks the keys {missing}; the engine is corrupt, {remake}")
    if "target" not in manifest["graphs"]:
        raise EngineError(f"{file} names no target graph; the engine is corrupt, {remake}")
    drafter = manifest["drafter"].get("name")
    if drafter not in ENGINE_DRAFTERS:
        raise EngineError(f"{file} asks for drafter {drafter!r}; engines run {list(ENGINE_DRAFTERS)}")
    if drafter == "medusa" and (manifest["drafter"].get("graph") != MEDUSA_FILE or "medusa" not in manifest["graphs"]):
        raise EngineError(f"{file} asks for Medusa heads but names no {MEDUSA_FILE} graph; the engine is corrupt, {remake}")
    for name, graph in manifest["graphs"].items():
        onnx_file = path / graph["file"]
        if not onnx_file.is_file():
            raise EngineError(f"the engine's {name} graph {onnx_file} is missing; {remake}")
        if verify:
            size = onnx_file.stat().st_size
            if size != graph["bytes"] or sha256(onnx_file) != graph["sha256"]:
                raise EngineError(
                    f"the engine's {name} graph {onnx_file} does not match its manifest (size {size} bytes, "
                    f"manifest {graph['bytes']}; or a different SHA-256): the file is corrupt or was replaced; {remake}"
                )
    return manifest


# --------------------------------------------------------------------------------------
# ONNX Runtime session with IO binding
# --------------------------------------------------------------------------------------
PROVIDERS = {  # speccomp's names for ONNX Runtime execution providers
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
_PROVIDER_HINTS = {  # what to install for an execution provider the plain `onnxruntime` wheel lacks
    "CUDAExecutionProvider": "pip install onnxruntime-gpu (in place of onnxruntime) on a machine with an NVIDIA GPU and CUDA",
    "TensorrtExecutionProvider": "pip install onnxruntime-gpu (in place of onnxruntime) plus TensorRT, on a machine with an NVIDIA GPU",
    "DmlExecutionProvider": "pip install onnxruntime-directml (in place of onnxruntime)",
    "OpenVINOExecutionProvider": "pip install onnxruntime-openvino (in place of onnxruntime)",
    "ROCMExecutionProvider": "pip install onnxruntime-rocm (in place of onnxruntime)",
    "CoreMLExecutionProvider": "use the macOS onnxruntime wheel",
}


def onnxruntime_module():
    try:
        import onnxruntime
    except ImportError as exc:
        raise EngineError("running an engine needs ONNX Runtime: pip install onnxruntime (or onnxruntime-gpu)") from exc
    return onnxruntime


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
    if provider not in PROVIDERS:
        raise EngineError(f"unknown execution provider {provider!r}; accepted values: {sorted(PROVIDERS)}")
    name = PROVIDERS[provider]
    message = missing_provider(onnxruntime_module(), name, provider)
    if message:
        raise EngineError(message)
    return [name] if name == "CPUExecutionProvider" else [name, "CPUExecutionProvider"]


class BoundSession:
    """An InferenceSession run through one reused IO binding: inputs bound from numpy arrays in place
    (no copies on the CPU provider), only the outputs asked for are fetched."""

    def __init__(self, path: Path, providers: list[str], threads: int | None = None):
        ort = onnxruntime_module()
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(os.fspath(path), sess_options=options, providers=providers)
        except Exception as exc:  # ORT raises its own Fail / InvalidProtobuf / ... types
            raise EngineError(f"ONNX Runtime cannot load {path}: {str(exc).splitlines()[0]}") from exc
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.binding = self.session.io_binding()

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
        b = self.binding
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        for name in self.inputs:
            b.bind_cpu_input(name, feeds[name])
        for name in outputs:
            b.bind_output(name)  # ORT allocates (shapes depend on q)
        self.session.run_with_iobinding(b)
        return b.copy_outputs_to_cpu()


class KVCache:
    """Preallocated [L, 2, 1, Hkv, capacity, D] plus one preallocated flat buffer that `past()` packs
    the valid prefix into, contiguous, for the session's `past_kv` input (ORT wants dense inputs)."""

    def __init__(self, kv: dict, capacity: int, dtype):
        self.shape = (kv["num_layers"], 2, 1, kv["num_kv_heads"], capacity, kv["head_dim"])
        self.data = np.zeros(self.shape, dtype=dtype)
        self.flat = np.empty(self.data.size, dtype=dtype)
        self.length = 0

    def past(self) -> np.ndarray:
        shape = self.shape[:4] + (self.length, self.shape[5])
        out = self.flat[: int(np.prod(shape))].reshape(shape)  # [L, 2, 1, Hkv, length, D], contiguous
        np.copyto(out, self.data[..., : self.length, :])
        return out

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


# --------------------------------------------------------------------------------------
# Trees, acceptance, sampling (numpy versions of tree.py / sampling.py)
# --------------------------------------------------------------------------------------
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


def warp(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Probabilities after temperature and nucleus filtering, as speccomp.sampling.warp (HF's warpers)."""
    x = logits.astype(np.float64) / temperature
    if top_p < 1.0:
        order = np.argsort(x, kind="stable")  # ascending
        p = np.exp(x[order] - x[order].max())
        cumulative = np.cumsum(p / p.sum())
        remove = cumulative <= 1 - top_p
        remove[-1] = False  # always keep the most likely token
        x = x.copy()
        x[order[remove]] = -np.inf
    p = np.exp(x - x.max())
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


# --------------------------------------------------------------------------------------
# Drafters (model-free; same lookup code as speccomp/drafters_ngram.py)
# --------------------------------------------------------------------------------------
class _NGram:
    outputs: tuple[str, ...] = ()  # extra outputs of the target graph the drafter reads (see _Medusa)

    def __init__(self, max_ngram=4, min_ngram=1, num_branches=4, max_depth=8):
        self.lookup, self.num_branches, self.max_depth = NGramIndex(max_ngram, min_ngram), num_branches, max_depth

    def begin(self, prompt, extras):
        self.lookup.begin(prompt)

    def propose(self, tokens, max_depth, max_nodes):
        depth = min(self.max_depth, max_depth)
        trie = Trie(tokens[-1])
        if depth > 0:
            self.lookup.add_branches(trie, tokens, self.num_branches, depth)
        return trie.bfs(depth, max_nodes)

    def observe(self, tokens, path, logits, extras):
        pass


class _TokenRecycling:
    outputs: tuple[str, ...] = ()

    def __init__(self, top_k, parents, ranks, ngram_branches, max_ngram, min_ngram, ngram_depth, persist):
        self.top_k, self.parents, self.ranks, self.persist = top_k, parents, ranks, persist
        self.ngram_branches, self.ngram_depth = ngram_branches, ngram_depth
        self.lookup = NGramIndex(max_ngram, min_ngram)
        self.adj: dict[int, list[int]] = {}

    def begin(self, prompt, extras):
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

    def observe(self, tokens, path, logits, extras):  # logits [n, V]
        k = min(self.top_k, logits.shape[-1])
        part = np.argpartition(-logits, k - 1, axis=-1)[:, :k]  # the top k, unordered
        order = np.argsort(-np.take_along_axis(logits, part, -1), axis=-1, kind="stable")
        recycle(self.adj, tokens, path, np.take_along_axis(part, order, -1).tolist())


class _Medusa:
    """Medusa heads (speccomp/drafters_medusa.py's MedusaDrafter in numpy). The target graph returns the
    head states [1, q, K, H] of every token as the extra output `states_output`; after each step the
    newest accepted token's [K, H] go through medusa.onnx, which returns each head's top token ids, and
    the next tree gives a node at depth d with sibling rank r head d-1's rank-r token."""

    def __init__(self, parents, ranks, num_heads, top, states_output, session: BoundSession):
        self.parents, self.ranks, self.num_heads, self.top = parents, ranks, num_heads, top
        self.depth, _, _ = tree_arrays(parents)
        self.outputs = (states_output,)
        self.session, self.top_ids = session, None

    def _take(self, states: np.ndarray, row: int) -> None:
        feed = {self.session.inputs[0]: np.ascontiguousarray(states[0, row])}  # [K, H] of one token
        self.top_ids = self.session.run(feed, ["top_ids"])[0]  # [K, top]

    def begin(self, prompt, extras):
        self._take(extras[0], len(prompt) - 1)

    def propose(self, tokens, max_depth, max_nodes):
        keep = [i for i, d in enumerate(self.depth) if d <= max_depth][:max_nodes]  # as speculative.truncate
        remap = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [remap[self.parents[i]] for i in keep[1:]]
        drafted = [tokens[-1]] + [int(self.top_ids[self.depth[i] - 1, self.ranks[i]]) for i in keep[1:]]
        return parents, drafted

    def observe(self, tokens, path, logits, extras):
        self._take(extras[0], path[-1])


def make_drafter(spec: dict, path: Path, providers: list[str], threads: int | None):
    name, options = spec.get("name"), dict(spec.get("options") or {})
    if name is None:
        return None
    if name == "ngram":
        return _NGram(**options)
    if name == "medusa":
        return _Medusa(**options, session=BoundSession(path / spec["graph"], providers, threads))
    return _TokenRecycling(**options)


# --------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------
class Engine:
    """An exported engine: `generate` with SpecModel's contract, on ONNX Runtime and numpy."""

    def __init__(self, path, provider: str = "cpu", threads: int | None = None, verify: bool = True,
                 draft: bool = True):
        if not isinstance(draft, bool):
            raise TypeError(f"draft must be True (use the engine's drafter) or False (plain decoding), got {draft!r}")
        self.path = Path(path)
        self.manifest = read_manifest(self.path, verify=verify)
        m = self.manifest
        self.kv, self.vocab_size, self.max_positions = m["kv"], m["model"]["vocab_size"], m["model"].get("max_positions")
        self.dtype = _DTYPES.get(self.kv["dtype"])
        if self.dtype is None:
            raise EngineError(f"engine KV dtype {self.kv['dtype']!r} is not supported by the numpy runtime")
        self.max_tree = int(m["max_tree"])
        self.provider = provider
        target = m["graphs"]["target"]
        providers = check_provider(provider)
        self.session = BoundSession(self.path / target["file"], providers, threads)
        if self.session.inputs != target["inputs"]:
            raise EngineError(
                f"{target['file']} takes inputs {self.session.inputs} but the manifest says {target['inputs']}; "
                "the engine is corrupt, re-export it"
            )
        # draft=False: plain decoding on the same target graph (extra outputs a drafter would read go unused)
        self.drafter = make_drafter(m["drafter"], self.path, providers, threads) if draft else None
        self.tokenizer = None
        self.last_stats: dict = {}

    # ---- text -------------------------------------------------------------------------
    def _tok(self):
        if self.tokenizer is None:
            info = self.manifest.get("tokenizer")
            if not info:
                raise EngineError("this engine was exported without a tokenizer; pass token ids, or re-export with tokenizer=")
            try:
                from tokenizers import Tokenizer
            except ImportError as exc:
                raise EngineError("text in and out of an engine needs the tokenizers package: pip install tokenizers") from exc
            self.tokenizer = Tokenizer.from_file(os.fspath(self.path / info["file"]))
        return self.tokenizer

    def chat_ids(self, prompt: str) -> np.ndarray:
        """Token ids [1, n] of `prompt` as a user turn in the model's chat template (as models.chat_ids)."""
        info = self.manifest.get("tokenizer") or {}
        template = info.get("chat_template")
        if template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # what transformers renders templates with

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            text = env.from_string(template).render(
                messages=[{"role": "user", "content": prompt}], add_generation_prompt=True, **info.get("special_tokens", {})
            )
        else:
            text = prompt
        return np.array([self._tok().encode(text, add_special_tokens=False).ids], dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok().decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def eos_token_id(self):
        return self.manifest["model"].get("eos_token_id")

    # ---- decoding ---------------------------------------------------------------------
    def _forward(self, cache: KVCache, tokens: list[int], positions: np.ndarray, tree_mask: np.ndarray):
        """logits [q, V], new_kv [L, 2, 1, Hkv, q, D], and the extra outputs the drafter reads."""
        q = len(tokens)
        feeds = {
            "input_ids": np.array([tokens], dtype=np.int64),
            "position_ids": positions[None],
            "attention_mask": np.ones((1, cache.length + q), dtype=np.int64),
            "past_kv": cache.past(),
            "tree_mask": tree_mask,
        }
        extra = list(self.drafter.outputs) if self.drafter is not None else []
        logits, new_kv, *extras = self.session.run(feeds, ["logits", "new_kv", *extra])
        return logits[0], new_kv, extras

    def _check(self, input_ids, max_new_tokens, temperature, top_p) -> list[int]:
        ids = np.asarray(input_ids)
        if ids.ndim == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"engines decode one sequence at a time (batch size 1), got batch size {ids.shape[0]}")
            ids = ids[0]
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"input_ids must be a non-empty [seq] or [1, seq] array of token ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"input_ids must be in [0, {self.vocab_size}), got values in [{ids.min()}, {ids.max()}]")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if self.max_positions is not None and ids.size + max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({ids.size} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
                f"{self.max_positions} positions"
            )
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        return [int(i) for i in ids]

    def generate(self, input_ids, max_new_tokens: int, eos_token_id=None, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None) -> np.ndarray:
        """Prompt + new tokens, np.int64 [1, n + m]; greedy output equals the model's greedy decoding."""
        prompt = self._check(input_ids, max_new_tokens, temperature, top_p)
        eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        rng = np.random.default_rng(seed)

        def pick(logits_row: np.ndarray) -> int:
            if not do_sample:
                return int(logits_row.argmax())
            return int(rng.choice(logits_row.shape[-1], p=warp(logits_row, temperature, top_p)))

        start = time.perf_counter()
        n = len(prompt)
        cache = KVCache(self.kv, n + max_new_tokens + self.max_tree + 1, self.dtype)
        logits, new_kv, extras = self._forward(cache, prompt, np.arange(n, dtype=np.int64), np.tril(np.ones((n, n), dtype=bool)))
        cache.append(new_kv)
        prefill_seconds = time.perf_counter() - start
        out = [pick(logits[-1])]
        steps, accepted = 1, 0
        context = prompt + out
        if self.drafter is not None:
            self.drafter.begin(prompt, extras)
        while len(out) < max_new_tokens and out[-1] not in eos:
            room = max_new_tokens - len(out)  # tokens still allowed, the bonus included
            if self.drafter is None or room <= 1:
                parents, tokens = [-1], [out[-1]]
            else:
                parents, tokens = self.drafter.propose(context, room - 1, self.max_tree)
            depth, mask, children = tree_arrays(parents)
            logits, new_kv, extras = self._forward(cache, tokens, cache.length + depth, mask)
            path, bonus = accept(tokens, children, lambda node: pick(logits[node]))
            cache.append(new_kv, keep=path)
            if self.drafter is not None:
                self.drafter.observe(tokens, path, logits, extras)
            steps += 1
            accepted += len(path) - 1
            for t in [tokens[i] for i in path[1:]] + [bonus]:
                out.append(t)
                if t in eos or len(out) >= max_new_tokens:
                    break
            context.extend(out[len(context) - n :])
        seconds = time.perf_counter() - start
        self.last_stats = {
            "new_tokens": len(out), "steps": steps, "tau": len(out) / steps, "seconds": seconds,
            "prefill_seconds": prefill_seconds, "tokens_per_second": len(out) / seconds,
            "kv_bytes": cache.nbytes(), "lossless": True,
        }
        return np.array([prompt + out], dtype=np.int64)

    def __repr__(self) -> str:
        d = (self.manifest["drafter"].get("name") if self.drafter is not None else None) or "plain"
        return f"Engine({str(self.path)!r}, drafter={d}, provider={self.provider!r})"


def load(path, provider: str = "cpu", threads: int | None = None, verify: bool = True, draft: bool = True) -> Engine:
    """Load an engine directory written by `SpecModel.export` (see the module docstring).

    provider: "cpu", "cuda" or "tensorrt" (ONNX Runtime execution providers; the GPU ones need
    onnxruntime-gpu and a GPU, and say so when missing). verify: check graph files against the
    manifest's SHA-256 first. draft=False: decode without the engine's drafter (plain decoding on
    the same target graph, the baseline to compare a drafter's speed against)."""
    return Engine(path, provider, threads, verify, draft)
