"""Mode (a) of KV compression, lossless: the target drafts for itself over a compressed cache.

    target cache (full, exact) ──► after every verification, the drafter ingests the newly
        │                          accepted tokens' keys/values and compacts its own copy
        │                          (sink / SnapKV / H2O eviction, KIVI quantisation)
        ▼
    drafter = the target's own graph (TreeAttention; + AttentionScores for SnapKV / H2O), run
              level by level like GraphDrafter, reading the compressed cache + scratch slots
    target  = verifies the draft tree against the full cache: greedy output is the model's own

(TriForce / MagicDec / QuantSpec.) The drafter only ever ingests tokens the target accepted, with
the target's exact keys/values, so rejected drafts never reach its cache; draft nodes live in
scratch slots past the compressed tokens and are overwritten next step.

drafter_options {"skip": [...]} or {"exit_layer": k} also drop layers from the draft graph
(SkipLayers / EarlyExit, TriForce's hierarchy idea): drafts then cost fewer layers as well as
fewer keys. By default the whole model drafts. {"weights": "int4"} or {"weights": "int8"} (onnxruntime
backends): the draft graph's weight MatMuls as 4- or 8-bit MatMulNBits, the quantized drafter's export
(QuantSpec's hierarchy: quantised weights over a compressed cache; on SmolLM2 at 4k slower than plain decoding,
because verifying a tree there costs about 1.6x a one-token step: benchmarks/README.md).

Positions: a compressed cache holds fewer slots than the sequence has tokens, so draft positions
come from the target's length (keys already carry their rotary position; every cached key is
visible to the draft, so which slot a key sits in does not matter). Models with sliding windows: their window is
counted in slots, which in an evicting cache are not positions, so once a sequence passes the window every kept key
falls outside it and no draft is accepted (still exact; compile_kv_draft warns). KIVI keeps every token: slots equal
positions, it drafts at any length.

SnapKV and H2O need attention: after the prompt, one extra forward of the last w prompt tokens
(SnapKV's observation window) against the target's cache gives the votes; H2O then adds the root
token's attention at every draft step (the root is always a real token).
"""
from __future__ import annotations

import warnings
import weakref
from types import SimpleNamespace

import numpy as np
import torch

from speccomp.backends import lower
from speccomp.backends.onnx_export import QUANT_BLOCK
from speccomp.drafters.registry import _default_tree, _early_exit_passes, _layer_skip_passes
from speccomp.frontend.graph import run_passes
from speccomp.runtime.model import SpecModel
from speccomp.frontend.convention import KV_ROOM, KVSpec
from speccomp.kv.cache import EvictingCache, all_layers, make_cache, needs_votes
from speccomp.drafters.graph import GraphDrafter
from speccomp.drafters.grow import MAX_DYNAMIC_DEPTH
from speccomp.errors import OptionError, OptionTypeError
from speccomp.kv.policies import KVPolicy, KVPolicyError, parse_kv_cache, policy_bytes, snapkv_window
from speccomp.runtime.calls import choice
from speccomp.runtime.decode import KVCache, DraftContext
from speccomp.runtime.tree import DynamicTreeSpec, check_tree_width, max_tree_nodes, tree_option

KV_MODES = ("draft", "target")


def numpy_dtype(dtype: torch.dtype):
    """The numpy dtype a compressed cache (speccomp/kv/cache.py, numpy) holds a torch dtype's keys/values in
    (bfloat16, which numpy lacks: float32)."""
    return np.float32 if dtype == torch.bfloat16 else torch.empty((), dtype=dtype).numpy().dtype


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor for the numpy cache: a view on the CPU (no copy), else a host copy."""
    t = t.detach()
    return (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy()


def as_torch(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A numpy cache array for a graph: shares its memory when `like` is a CPU tensor of the same dtype."""
    return torch.from_numpy(a).to(like.device, like.dtype)


def tree_depth(tree) -> int:
    """Deepest draft the tree spec can produce (a dynamic tree is capped by GraphDrafter)."""
    if isinstance(tree, DynamicTreeSpec):
        return min(MAX_DYNAMIC_DEPTH, tree.budget)
    return int(tree.max_depth)


class _Room:
    """What a cache buffer's KV_ROOM names: how many of its first slots are in use."""

    __slots__ = ("length", "__weakref__")

    def __init__(self, length: int):
        self.length = length


class CompressedKVDrafter(GraphDrafter):
    """GraphDrafter over a compressed copy of the target's cache (see the module docstring)."""

    reads = ("target_cache", "own_cache")  # the accepted tokens' exact KV from the target, kept compressed

    def __init__(self, step, kv: KVSpec, policy: KVPolicy, tree, name: str = "compressed_kv", kv_layers=None,
                 options: dict | None = None, graph=None, light: bool = False):
        super().__init__(step, list(range(kv.num_layers)) if kv_layers is None else list(kv_layers), tree, name,
                         options, graph, light)
        self.kv, self.policy = kv, policy
        self.min_window = tree_depth(tree) + 1
        policy.check(kv, min_window=self.min_window)
        self.cache, self.prompt_length, self._position_base = None, 0, 0
        self._room = None  # what the cache buffer handed to the draft graph names as its owner (_workspace)
        self._scores_pending = False  # H2O: take the root's attention at the next depth-0 forward
        self.measured: dict = {}

    def with_tree(self, tree) -> "CompressedKVDrafter":
        return CompressedKVDrafter(self.step, self.kv, self.policy, tree, self.name, self.layer_index.tolist(),
                                   self.options, self.graph, self.light_graphs)

    def begin(self, prompt: list[int]) -> None:
        self.cache = make_cache(self.kv, self.policy, self.min_window, numpy_dtype(self.kv.dtype))
        self.prompt_length = len(prompt)
        self.measured = {}

    # ---- keeping the compressed copy in step with the target --------------------------------
    def _observe(self, target: KVCache, tokens: list[int]) -> np.ndarray:
        """Votes [L, Hkv, n] of the last w prompt tokens' queries over the n cached prompt tokens."""
        n, device = target.length, target.data.device  # the model's (a GPU's too)
        w = min(snapkv_window(self.policy.budget), n)
        with torch.no_grad():
            outs = self.step(torch.tensor([tokens[n - w : n]], device=device), torch.arange(n - w, n, device=device)[None],
                             torch.ones(1, n, dtype=torch.long, device=device), target.data[..., : n - w, :],
                             torch.ones(w, w, dtype=torch.bool, device=device).tril())
        return all_layers(as_numpy(outs[-1][:, 0].sum(2)), self.layer_index.numpy(), self.kv.num_layers)

    def _sync(self, target: KVCache, tokens: list[int]) -> None:
        start = self.cache.length
        if target.length < start:
            raise RuntimeError(f"the target cache shrank from {start} to {target.length} tokens")
        votes = self._observe(target, tokens) if needs_votes(self.cache, target.length) else None
        self.cache.extend(as_numpy(target.data[..., start : target.length, :]), votes)
        self.measured = {"kv_bytes_full": target.past().nbytes, "kv_bytes_draft": self.cache.nbytes(),
                         "kv_bytes_draft_closed_form": policy_bytes(self.kv, self.policy, target.length,
                                                                    self.prompt_length),
                         "kv_tokens_full": target.length, "kv_tokens_draft": self.cache.slots}

    # ---- drafting ---------------------------------------------------------------------------
    def propose(self, ctx: DraftContext):
        self._sync(ctx.cache, ctx.tokens)
        self._position_base = ctx.cache.length
        self._scores_pending = self.policy.kind == "h2o"
        view = SimpleNamespace(data=self._workspace(ctx), length=self.cache.slots)  # what GraphDrafter reads
        draft = super().propose(DraftContext(ctx.tokens, view, ctx.max_depth, ctx.max_nodes))
        self.measured["kv_workspace_bytes"] = self.cache.workspace_bytes()
        return draft

    def _workspace(self, ctx: DraftContext) -> torch.Tensor:
        """The compressed cache with ctx.max_nodes scratch slots after it, as the draft graph's cache. An evicting
        cache on the CPU hands over its whole buffer, owned like the runtime's KVCache (frontend/convention.py
        KV_ROOM: its first `slots` in use), so an in-place step (backends/onnx_kv.py, passes/inplace_kv.py) writes
        each draft level's entries into the scratch slots instead of copying the cache into a new buffer every call
        (11.8 MB a call for SmolLM2 at sink:256)."""
        workspace, like = self.cache.workspace(ctx.max_nodes), ctx.cache.data  # (evicting: reserves the scratch)
        whole = torch.from_numpy(self.cache.data) if isinstance(self.cache, EvictingCache) else None
        if whole is None or like.device.type != "cpu" or whole.dtype != like.dtype:
            return as_torch(workspace, like)  # KIVI's dequantised mirror, a GPU, bfloat16: a copy
        self._room = _Room(self.cache.slots)  # held here: the buffer names it weakly
        setattr(whole, KV_ROOM, weakref.ref(self._room))
        return whole

    def _forward(self, cache, base: int, used: int, tokens, depth: int, mask):
        """GraphDrafter._forward with positions from the target's length, not the compressed slot count."""
        outs = self._run(cache, base, used, tokens, self._position_base + depth, mask)
        if self._scores_pending and used == 0:  # the root's row: a real token's attention over the cache
            self.cache.accumulate(all_layers(as_numpy(outs[-1][:, 0, :, 0, :base]), self.layer_index.numpy(),
                                             self.kv.num_layers))
            self._scores_pending = False
        return outs[0][0]

    def kv_stats(self) -> dict:
        return {"kv_cache": self.policy.spec, "kv_mode": "draft", **self.measured}


class CompressedKVModel(SpecModel):
    """A SpecModel whose drafter runs over a compressed cache; `last_stats` adds the KV bytes held."""

    batch_refusal = "the compressed-KV drafter keeps one sequence's compressed cache"

    def _decode(self, prompt, args, sampler, acceptance):
        new, stats = super()._decode(prompt, args, sampler, acceptance)
        return new, {**stats, **self.drafter.kv_stats()}


def compile_kv_draft(base, policy: KVPolicy, tree, backend: str, drafter_options: dict | None) -> CompressedKVModel:
    """Mode (a): target with TreeAttention verifies; the same graph drafts over `policy`'s cache."""
    from speccomp.passes.kv_compress import AttentionScores
    from speccomp.passes.tree_attention import TreeAttention

    spec = _draft_tree(tree)
    windows = sorted({s.sliding_window for s in base.structure.attention if s.sliding_window})
    if windows and policy.kind != "kivi":  # still lossless (the full cache verifies), but drafting stops paying
        warnings.warn(f"kv_cache={policy.spec!r} evicts tokens and the model has sliding-window attention (windows "
                      f"{windows}), counted in cache slots: once a sequence passes {windows[0]} tokens the drafter's "
                      "evicted cache falls outside the window and its drafts are no longer accepted (decoding stays "
                      "exact); a KIVI policy (e.g. 'kivi4') keeps every token and drafts at any length",
                      UserWarning, stacklevel=3)
    if tree is not None:  # as every drafter's tree: it fits the model's windows and scores existing tokens
        tree_option(tree, max_tree_nodes(base.structure))
    check_tree_width(spec, base.captured.vocab_size, "model", tree)
    policy_fits(policy, policy.spec, lambda: policy.check(base.captured.kv, base.captured.max_positions, tree_depth(spec) + 1))
    options = dict(drafter_options or {})
    weights = draft_weights(options.pop("weights", "float"), backend)
    passes = _layer_passes(base, options)
    passes += [TreeAttention()] + ([AttentionScores()] if policy.needs_attention else [])
    draft_graph = run_passes(base.clone(), passes)
    light = weights != "float"
    # QuantSpec's hierarchy: 4- or 8-bit weights (MatMulNBits) over the compressed cache, on one thread beside the
    # target's spinning pool, as the quantized drafter's step: at a 4096-token prompt, sink:256, 8 bits, a chain of 2,
    # decode 33.6 against 29.5 tok/s with both on 2 sleeping threads (benchmarks/threads_ab.py,
    # results_threads_ab_kv_int8_4k_decode.*). Float weights stay on the pool: their step reads the whole float
    # model, which one thread reads at half the speed
    step = lower(draft_graph, backend, spin=False, quantize=(WEIGHT_BITS[weights], QUANT_BLOCK) if light else None)
    drafter = CompressedKVDrafter(step, base.captured.kv, policy, spec, kv_layers=draft_graph.kv_layers,
                                  options=drafter_options, graph=draft_graph, light=light)
    target = run_passes(base.clone(), [TreeAttention()])
    return CompressedKVModel(target, lower(target, backend, spin=light), backend, drafter=drafter,
                             model=getattr(base, "model", None))  # the source model: an export's manifest names it


WEIGHT_BITS = {"int4": 4, "int8": 8}  # drafter_options {"weights": ...} other than "float"


def draft_weights(weights, backend: str) -> str:
    """drafter_options {"weights": "int4"} or {"weights": "int8"}: the draft graph's weight MatMuls as ONNX Runtime's
    4- or 8-bit MatMulNBits (the quantized drafter's export), so a draft step reads an eighth or a quarter of the
    weight bytes as well as fewer keys; "float" (the default): the target's own weights."""
    from speccomp.backends import is_onnxruntime

    choice("weights", weights, ("float", *WEIGHT_BITS))
    if weights != "float" and not is_onnxruntime(backend):
        raise OptionError("weights", weights, f"{WEIGHT_BITS[weights]}-bit draft weights run in ONNX Runtime (MatMulNBits), "
                          f"not on backend={backend!r}", "use backend='onnxruntime', or weights='float'")
    return weights


def _layer_passes(base, options: dict) -> list:
    """drafter_options {"skip": [...]} or {"exit_layer": k}: the drafter also skips layers (TriForce's
    hierarchy idea: fewer layers *and* fewer keys per draft token). None given: the whole model drafts."""
    given = dict(options)  # as the user wrote them, for the messages (the passes below take theirs out)
    if "skip" in options and "exit_layer" in options:
        raise OptionError("drafter_options", options, "gives both 'skip' and 'exit_layer'", "give one of them")
    if "skip" in options:
        passes, rest = _layer_skip_passes(base, options)
    elif "exit_layer" in options:
        passes, rest = _early_exit_passes(base, options)
    else:
        passes, rest = [], options
    if rest:
        raise OptionError("drafter_options", given, f"has unknown compressed-KV drafter options {sorted(rest)}",
                          "accepted: 'skip' or 'exit_layer', and 'weights'")
    return passes


def check_kv_options(kv_cache, kv_mode, drafter, tree=None) -> tuple[KVPolicy, str]:
    """Validate compile's kv_cache= / kv_mode= before anything is captured (with kv_mode 'draft', that the policy's
    recent window keeps the drafter's tree: the CLI checks it before it loads a model)."""
    if kv_cache is not None and not isinstance(kv_cache, (str, KVPolicy)):
        raise OptionTypeError("kv_cache", kv_cache, f"must be a policy string, got {type(kv_cache).__name__}",
                              "e.g. 'sink:256', 'snapkv:512' or 'kivi4'")
    try:
        policy = parse_kv_cache(kv_cache)
    except KVPolicyError as exc:
        raise OptionError("kv_cache", kv_cache, str(exc)) from None
    if policy is None:
        raise OptionError("kv_mode", kv_mode, "needs a kv_cache= policy", "e.g. kv_cache='sink:256' or 'kivi4'")
    if kv_mode is not None:
        choice("kv_mode", kv_mode, KV_MODES)
    mode = "draft" if kv_mode is None else kv_mode
    if drafter is not None:
        what = ("'target' (LOSSY: the target reads the compressed cache) runs plain decoding only for now"
                if mode == "target" else "'draft' makes the drafter itself (the model over its compressed cache)")
        raise OptionError("drafter", drafter, f"given with kv_mode={what}", "drop drafter=")
    if mode == "draft" and isinstance(tree, str) and tree.strip().lower() == "auto":  # was refused after capture
        raise OptionError("tree", tree, "autotune does not tune the compressed-cache drafter's tree",
                          "give a tree, e.g. tree=3 or 'dynamic:16:4', or leave it out (the default dynamic tree)")
    if mode == "draft":
        policy_fits(policy, kv_cache, lambda: policy.check_window(tree_depth(_draft_tree(tree)) + 1))
    return policy, mode


def _draft_tree(tree):
    """kv_mode='draft''s tree: the user's, or a dynamic tree of 16 nodes (top 4 per node; up to MAX_DYNAMIC_DEPTH
    deep)."""
    return _default_tree(tree, DynamicTreeSpec(16, 4), "compressed_kv", dynamic_ok=True)


def policy_fits(policy: KVPolicy, kv_cache, check) -> None:
    """A check of `policy` whose KVPolicyError is an OptionError naming kv_cache (the CLI: --kv-cache)."""
    try:
        check()
    except KVPolicyError as exc:
        raise OptionError("kv_cache", kv_cache, str(exc).removeprefix(f"kv_cache {policy.spec!r}: ")) from None
