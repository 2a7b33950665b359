"""The compiler's frontend: a causal LM in, one flat torch.fx graph with speccomp's calling convention out.

    convention.py   the graph's inputs and outputs (INPUT_NAMES ...), KVSpec, CapturedModel, torch.export
    hf.py           Hugging Face *ForCausalLM, through the model's own cache interface
    module.py       plain nn.Module LMs (input_ids -> logits): KV made explicit by passes/explicit_kv.py
    graph.py        `annotate` (layers, attention sites, LM head found in the graph), SpecGraph, Pass, run_passes
"""
from __future__ import annotations

from torch import nn

from speccomp.errors import OptionError, OptionTypeError
from speccomp.frontend.convention import CapturedModel
from speccomp.frontend.hf import capture_hf
from speccomp.frontend.module import capture_module


def is_hf(model) -> bool:
    from transformers import PreTrainedConfig

    return isinstance(getattr(model, "config", None), PreTrainedConfig)


def capture(model: nn.Module, *, check: bool = True) -> CapturedModel:
    """torch.export a causal LM (a Hugging Face *ForCausalLM, or a plain nn.Module mapping input_ids to logits)
    into speccomp's flat graph (speccomp/frontend/convention.py).

    `speccomp.compile(model)` calls this; call it yourself to compile one model several ways without
    exporting it again (`speccomp.compile(captured, drafter=...)`: each compile rewrites a copy). The
    model is captured in eval mode and handed back in the modes it came in (nothing of it is changed)."""
    if not isinstance(model, nn.Module):
        raise OptionTypeError("model", model, f"expected a torch.nn.Module causal LM, got {type(model).__name__}",
                              "pass a Hugging Face *ForCausalLM or an nn.Module mapping input_ids to logits")
    _check_devices(model)
    if is_hf(model):
        warn_generation_config(model)
    modes = {m: m.training for m in model.modules()}
    try:
        captured = capture_hf(model, check) if is_hf(model) else capture_module(model, check=check)
    finally:
        for m, training in modes.items():
            m.training = training
    captured.model = model
    return captured


def _check_devices(model: nn.Module) -> None:
    """Weights that are not there (the meta device: a model built empty, or loaded with device_map and offloaded), on
    two devices, or inference-mode parameters cannot be run to capture: named before the export fails inside it."""
    devices = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        devices.setdefault(tensor.device, name)
    meta = [name for device, name in devices.items() if device.type == "meta"]
    if meta:
        raise OptionError("model", type(model).__name__, f"has weights on the meta device ({meta[0]}, ...): they hold "
                          "no values", "load the weights first (e.g. from_pretrained without device_map, or "
                          "model.to_empty(device='cpu') then load_state_dict)")
    inference = next((name for name, t in model.named_parameters() if t.is_inference()), None)
    if inference is not None:  # torch.export cannot trace such parameters ("requires_grad ... on inference tensor")
        raise OptionError("model", type(model).__name__, f"holds inference-mode parameters ({inference}, ...): it was "
                          "built or loaded inside torch.inference_mode()", "load the model outside inference_mode "
                          "(torch.no_grad() is fine)")
    if len(devices) > 1:
        where = ", ".join(f"{name} on {device}" for device, name in devices.items())
        raise OptionError("model", type(model).__name__, f"has weights on several devices ({where})",
                          "move the whole model to one device: model.to('cpu') or model.to('cuda')")


# GenerationConfig fields that change the text HF's generate() produces (logits processors): speccomp decodes without
# them. A checkpoint that sets one would have HF's generate apply it by default.
TEXT_CHANGING = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens",
                 "begin_suppress_tokens", "sequence_bias", "min_length", "min_new_tokens", "forced_bos_token_id",
                 "forced_eos_token_id", "encoder_repetition_penalty", "exponential_decay_length_penalty",
                 "epsilon_cutoff", "eta_cutoff", "typical_p", "min_p", "top_k")


# ... and those with which HF's generate() samples by default where do_sample is set: speccomp's reads its arguments
SAMPLING = ("do_sample", "temperature", "top_p")


def warn_generation_config(model) -> None:
    """Warn, naming them, when the model's generation_config sets text-changing options HF's generate() would apply
    by default and speccomp does not (its text is HF's with those unset; top_k and the other sampling filters matter
    only with do_sample=True), or makes HF's generate() sample by default (do_sample, with its temperature / top_p)."""
    import warnings

    from transformers import GenerationConfig

    config = getattr(model, "generation_config", None)
    if config is None:
        return
    neutral = getattr(GenerationConfig, "_get_default_generation_params", dict)()  # HF's values when unset
    changed = {f: v for f in TEXT_CHANGING
               if (v := getattr(config, f, None)) not in (None, [], ()) and v != neutral.get(f)}
    if changed:
        warnings.warn(f"the model's generation_config sets {changed}, which HF's generate() applies by default: "
                      "speccomp's generate does not: its text equals HF's generate with these unset (to compare the two, "
                      f"set model.generation_config.{next(iter(changed))} = None, ...)", stacklevel=3)
    if getattr(config, "do_sample", None) is True:  # else HF's generate() decodes greedily, as speccomp's does
        sampling = {f: v for f in SAMPLING if (v := getattr(config, f, None)) is not None and v != neutral.get(f)}
        given = ", ".join(f"{f}={v!r}" for f, v in sampling.items())
        top_k = "" if getattr(config, "top_k", None) is not None else (  # a set top_k is named by the warning above
            f"; HF's also keeps only the top_k={neutral.get('top_k', 50)} tokens, speccomp's the whole distribution")
        warnings.warn(f"the model's generation_config sets {given}: HF's generate() samples with them by default; "
                      "speccomp's generate reads only its own arguments (greedy unless do_sample=True; temperature and "
                      f"top_p 1.0 unless given): pass generate(..., {given}) to sample as the checkpoint asks{top_k}",
                      stacklevel=3)
