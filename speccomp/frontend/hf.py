"""Capture a Hugging Face causal LM through its own cache interface (see speccomp/frontend/convention.py for
the calling convention the graph gets).

A `DynamicCache` whose layers are pre-filled with views of `past_kv` lets `torch.export` record the
model's own `cat(past, new)` and its own mask construction (causal, sliding window, ...). Every dynamic
dimension is `Dim.AUTO` and export runs with `backed_size_oblivious`, so one graph serves prefill
(past = 0), single-token decode (q = 1) and tree verification (q = tree size). HF's attention functions
are swapped for twins (`_speccomp_sdpa`, `_speccomp_eager`) that do not branch on `q == 1`.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
from torch import nn
from torch.export import Dim

from speccomp.errors import UnsupportedModelError
from speccomp.frontend.convention import CapturedModel, KVSpec, _flatten, check_outputs, example_inputs, export_dynamic


def _repeated(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """KV heads [b, Hkv, s, d] repeated for their query heads: [b, Hkv, n_rep, s, d], contiguous (the caller views it
    as [b, Hkv * n_rep, s, d]). clone + view, not reshape: reshape of the expanded view guards on past + q != 1."""
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).clone(memory_format=torch.contiguous_format)


def _speccomp_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """HF's SDPA attention without its shape-dependent shortcuts.

    `transformers`' own `sdpa_attention_forward` branches on `q_length > 1` / `q_length == 1`;
    under torch.export that branch becomes a guard that pins q to >= 2, so one graph could not
    serve both decode and verification. This version always takes the explicit mask (the
    graph input the tree pass rewrites) and repeats KV heads the way HF does when a mask is given."""
    if kwargs.get("softcap") is not None:
        raise UnsupportedModelError("attention softcapping needs eager attention; load the model with attn_implementation='eager'")
    if attention_mask is None:
        raise UnsupportedModelError("the model built no attention mask while being captured, so the tree pass would "
                                    "have nothing to rewrite")
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        b, h, s, d = key.shape
        key = _repeated(key, n_rep).view(b, h * n_rep, s, d)  # [b, H, s, d]
        value = _repeated(value, n_rep).view(b, h * n_rep, s, value.shape[-1])
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.where(attention_mask, position_bias, torch.finfo(query.dtype).min)
        else:
            attention_mask = attention_mask + position_bias
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                                           scale=scaling, is_causal=False)
    # clone, not .contiguous(): contiguous() checks strides, which guards on q != 1 for some layouts
    return out.transpose(1, 2).clone(memory_format=torch.contiguous_format), None  # [b, s, H, d] as HF expects


def _speccomp_eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """HF's eager attention (softmax(QK^T * scale [softcapped] + mask) V) written with `bmm`.

    `torch.matmul` on 4-D tensors decomposes under export into broadcasting reshapes that
    guard on q != 1; batched matmuls over explicitly folded [b*H, q, d] tensors do not."""
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise UnsupportedModelError("attention sinks (s_aux) are not supported by the eager capture path")
    b, h, q, d = query.shape
    n_rep = h // key.shape[1]
    kv_len, dv = key.shape[2], value.shape[-1]
    key = _repeated(key, n_rep).view(b * h, kv_len, d)
    value = _repeated(value, n_rep).view(b * h, kv_len, dv)
    query = query.clone(memory_format=torch.contiguous_format)  # .contiguous() would guard on q == 1
    scores = torch.bmm(query.view(b * h, q, d), key.transpose(1, 2)).view(b, h, q, kv_len)
    scores = scores * (scaling if scaling is not None else d**-0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:
        raise UnsupportedModelError("the model built no attention mask while being captured")
    scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.bmm(probs.view(b * h, q, kv_len), value).view(b, h, q, dv)
    return out.transpose(1, 2).clone(memory_format=torch.contiguous_format), None  # [b, q, H, dv]


TWINS = {"sdpa": "speccomp_sdpa", "eager": "speccomp_eager"}  # HF's attention -> the twin registered for it


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    for kind, attention, mask in (("sdpa", _speccomp_sdpa, sdpa_mask), ("eager", _speccomp_eager, eager_mask)):
        AttentionInterface.register(TWINS[kind], attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(TWINS[kind], mask)


@contextlib.contextmanager
def _capture_attention(model):
    """Swap HF's SDPA / eager attention for export-friendly twins while exporting."""
    old = model.config._attn_implementation
    if old not in TWINS:
        raise UnsupportedModelError(f"attention implementation {old!r} cannot be captured; load the model with "
                                    "attn_implementation='sdpa' or 'eager'")
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        # Models that call torch's attention themselves (Falcon) ignore AttentionInterface; capture them
        # as they are (check_against_eager verifies the graph at every sequence length it relies on).
        yield old
        return
    _register_attention()
    model.set_attn_implementation(TWINS[old])
    try:
        yield old
    finally:
        model.set_attn_implementation(old)


# ---- The wrapper torch.export traces -------------------------------------------------
def _cache_from_tensor(past_kv: torch.Tensor):
    """A DynamicCache whose layers already hold past_kv[l, 0] / past_kv[l, 1] (views, no copy).

    Layers are full (never sliding) on purpose: the runtime owns the cache and never evicts,
    and HF builds the sliding-window mask from positions either way."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()
    cache.layers = [DynamicLayer() for _ in range(past_kv.shape[0])]
    for i, layer in enumerate(cache.layers):
        layer.dtype, layer.device = past_kv.dtype, past_kv.device
        layer.keys, layer.values = past_kv[i, 0], past_kv[i, 1]  # [1, Hkv, past, D] (selects: annotate finds them)
        layer.is_initialized = True
    return cache


class _HFStep(nn.Module):
    """One forward of a HF causal LM with the cache as a tensor in and the new entries out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, past_kv):
        cache = _cache_from_tensor(past_kv)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         past_key_values=cache, use_cache=True, output_hidden_states=True, return_dict=True)
        past = past_kv.shape[4]
        new_kv = torch.stack([torch.stack([layer.keys[:, :, past:], layer.values[:, :, past:]])
                              for layer in cache.layers])  # [L, 2, 1, Hkv, q, D]
        return out.logits, new_kv, out.hidden_states[-1]


# ---- Checks on the model before export -----------------------------------------------
def _check_hf_model(model) -> None:
    config, name = getattr(model, "config", None), type(model).__name__
    if config is None:
        raise UnsupportedModelError(f"{name} has no `config`; pass a Hugging Face *ForCausalLM model")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; speccomp compiles decoder-only causal LMs "
                                    "(*ForCausalLM)")
    if model.get_output_embeddings() is None:
        raise UnsupportedModelError(f"{name} has no LM head; pass the *ForCausalLM class, not the base model")
    if getattr(config, "alibi", False) or config.model_type == "bloom":
        raise UnsupportedModelError(f"{config.model_type} uses ALiBi position biases computed from the padding mask; "
                                    "tree attention cannot place tree tokens at their depth there. Supported: rotary "
                                    "or learned absolute positions.")
    params = inspect.signature(model.forward).parameters
    if "cache_params" in params and "past_key_values" not in params:
        raise UnsupportedModelError(f"{name} is a recurrent (state-space) model: it carries a recurrent state "
                                    "(`cache_params`), not a per-layer key/value cache, so there is no KV cache to "
                                    "verify draft tokens against")
    if "dynamic" in _rope_types(_text_config(model)):
        raise UnsupportedModelError(f"{name} uses rope_type='dynamic' (dynamic NTK scaling): its rotary frequencies are "
                                    "recomputed from the sequence length, so keys cached earlier no longer match; use "
                                    "a config with static RoPE scaling (default, linear, llama3, yarn)")
    for arg in ("position_ids", "past_key_values", "attention_mask"):
        if arg not in params:
            raise UnsupportedModelError(f"{name}.forward takes no `{arg}`, which speccomp needs as an explicit graph "
                                        "input")


def _probe_kv(model) -> KVSpec:
    """Run two tokens through the model with a fresh cache to learn the cache layout."""
    from transformers import DynamicCache

    cache = DynamicCache()
    device = next(model.parameters()).device
    other = _other_layer_kinds(_text_config(model))
    unsupported = (f"{type(model).__name__} does not keep a key/value cache per layer (recurrent or hybrid models, "
                   "whose linear-attention, state-space or convolution layers keep other state, are not "
                   f"supported{other})")
    with torch.no_grad():
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        try:
            model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True)
        except (IndexError, KeyError, AttributeError, TypeError, ValueError) as exc:  # (MiniMax: a ValueError)
            if not other:  # not a hybrid's own state looked up in the key/value cache: the model's error, as it is
                raise
            raise UnsupportedModelError(f"{unsupported}; running it with a key/value cache failed: "
                                        f"{type(exc).__name__}: {exc}") from exc
    layers = getattr(cache, "layers", None)
    if not layers or any(getattr(layer, "keys", None) is None for layer in layers):
        raise UnsupportedModelError(unsupported)
    shapes = {(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in layers}
    if len(shapes) != 1:
        raise UnsupportedModelError(f"{type(model).__name__} has layers with different KV shapes {sorted(shapes)}; "
                                    "speccomp needs one shape for all layers")
    (kshape, vshape), = shapes
    if kshape == vshape and kshape[2] != 2:
        raise UnsupportedModelError(f"{type(model).__name__} ({model.config.model_type}) holds {kshape[2]} tokens in "
                                    f"its KV cache after 2 (keys {list(kshape)}); speccomp needs one entry per token")
    if kshape != vshape:
        what = (" (keys and values of different widths: a compressed latent cache, as multi-head latent attention "
                "keeps)" if kshape[:3] == vshape[:3] else "")
        raise UnsupportedModelError(f"{type(model).__name__} ({model.config.model_type}) keeps a KV cache of keys "
                                    f"{list(kshape)} and values {list(vshape)}{what}; speccomp caches keys and values "
                                    "of one shape [batch, heads, tokens, head_dim]")
    return KVSpec(len(layers), kshape[1], kshape[3], layers[0].keys.dtype)


def _text_config(model):
    """The config of the language model: a multimodal model's (`*ForConditionalGeneration`) `text_config`, whose
    layer_types and sliding_window its decoder reads; a causal LM's own."""
    config = model.config
    try:
        return config.get_text_config()
    except (AttributeError, ValueError):  # an older config class; one with several text configs (transformers asks)
        return config


def _other_layer_kinds(config) -> str:
    """", layers of kind ['linear_attention']": the config's layer kinds other than full or sliding attention (linear
    attention, state-space, convolution, compressed attention ...), for the refusal."""
    kinds = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or []
    other = sorted({k for k in kinds if isinstance(k, str) and k not in ("full_attention", "sliding_attention")})
    return f": layers of kind {other}" if other else ""


def _sliding_windows(model) -> dict[str, int]:
    """Attention modules that only see a recent window, by module path (from the modules, not class names).

    Where the config lists `layer_types`, they decide, as they decide the masks HF builds: a "sliding_attention"
    layer sees the config's `sliding_window` (or its module's own, where set), any other kind the whole past. The
    module attribute alone misleads: EXAONE 4, EXAONE-MoE and Kolibri1 set `sliding_window` on global layers too, and
    SmolLM3 sets None on a layer its config makes slide. Without `layer_types`, a module's own `sliding_window`
    wins, and modules without it fall back to the config's `sliding_window` (Mistral, Starcoder2 and Phi3 keep the
    window only there and build a sliding mask for every layer), gated by `use_sliding_window`."""
    config = _text_config(model)
    configured = getattr(config, "sliding_window", None)
    configured = configured if isinstance(configured, int) and configured > 0 else None
    default = None if getattr(config, "use_sliding_window", True) is False else configured
    layer_types = getattr(config, "layer_types", None)
    windows = {}
    for path, module in model.named_modules():
        layer_idx = getattr(module, "layer_idx", None)
        if not isinstance(layer_idx, int):
            continue
        own = getattr(module, "sliding_window", None)
        own = own if isinstance(own, int) and own > 0 else None
        if layer_types is not None and layer_idx < len(layer_types):
            window = (own or configured) if layer_types[layer_idx] == "sliding_attention" else None
        else:
            window = own if hasattr(module, "sliding_window") else default
        if window is not None:
            windows[path] = window
    # a decoder block that carries layer_idx too (Gemma3) has its attention module's entry: one entry a layer
    return {p: w for p, w in windows.items() if not any(q.startswith(p + ".") for q in windows)}


def _rope_types(config) -> dict:
    """rope_type -> its parameters, for every rotary setting of the config (transformers' rope_parameters, one dict or
    one per layer type; older configs' rope_scaling)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    dicts = [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
    return {d.get("rope_type", d.get("type")): d for d in dicts}


def _max_positions(config) -> int | None:
    limit = None
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            limit = value
            break
    longrope = _rope_types(config).get("longrope")
    switch = (longrope or {}).get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None)
    if longrope is not None and isinstance(switch, int) and 0 < switch < (limit or switch + 1):
        # HF switches to the long factors once a sequence passes `switch` and then recomputes the whole cache with
        # them (Phi3's prepare_inputs_for_generation); speccomp keeps its cache, so its context ends there
        warnings.warn(f"{config.model_type}: longrope RoPE changes its factors past original_max_position_embeddings="
                      f"{switch} and HF then recomputes the whole KV cache; speccomp keeps its cache, so prompt + new "
                      f"tokens are limited to {switch} positions (of {limit})", UserWarning, stacklevel=4)
        return switch
    return limit


# ---- Export --------------------------------------------------------------------------
def capture_hf(model: nn.Module, check: bool = True) -> CapturedModel:
    """torch.export a Hugging Face *ForCausalLM into speccomp's flat graph (see the module docstring)."""
    _check_hf_model(model)
    model.eval()
    kv = _probe_kv(model)
    config = model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    step = _HFStep(model).eval()
    args = example_inputs(kv, 3, 7, next(model.parameters()).device, vocab)  # q, past distinct: no symbol confusion
    dynamic = ({1: Dim.AUTO}, {1: Dim.AUTO}, {1: Dim.AUTO}, {4: Dim.AUTO})
    with _capture_attention(model) as attn:
        program = export_dynamic(step, args, dynamic, f"{type(model).__name__} ({config.model_type}) with dynamic "
                                 "cache and sequence lengths")
    captured = CapturedModel(graph_module=_flatten(program), kv=kv, vocab_size=vocab,
                             max_positions=_max_positions(_text_config(model)), attn_implementation=attn,
                             model_type=config.model_type, sliding_windows=_sliding_windows(model))
    if check:
        check_against_eager(captured, step)
    return captured


def check_against_eager(captured: CapturedModel, step: nn.Module, atol: float = 1e-4) -> None:
    """Run the graph and the model on prefill, decode and multi-token shapes; they must agree."""
    device = next(step.parameters()).device
    for q, past in ((4, 0), (1, 5), (2, 9), (1, 0)):  # (1, 0): a 1-token prompt
        args = example_inputs(captured.kv, q, past, device, captured.vocab_size)
        with torch.no_grad():
            try:
                got = captured.graph_module(*args)
            except AssertionError as exc:  # an input guard of the exported graph
                raise UnsupportedModelError(f"captured graph of {captured.model_type} only accepts some sequence "
                                            f"lengths ({exc}) for q={q}, past={past}; the model's code specializes "
                                            "on lengths torch.export cannot keep dynamic") from exc
            want = step(*args)
        check_outputs(captured, got, want, atol, "model", f"q={q}, past={past}",
                      "the model likely branches on sequence length in a way torch.export cannot keep")
