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
    modes = {m: m.training for m in model.modules()}
    try:
        captured = capture_hf(model, check) if is_hf(model) else capture_module(model, check=check)
    finally:
        for m, training in modes.items():
            m.training = training
    captured.model = model
    return captured


def _check_devices(model: nn.Module) -> None:
    """Weights that are not there (the meta device: a model built empty, or loaded with device_map and offloaded) or
    on two devices cannot be run to capture: named before the export fails somewhere inside it."""
    devices = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        devices.setdefault(tensor.device, name)
    meta = [name for device, name in devices.items() if device.type == "meta"]
    if meta:
        raise OptionError("model", type(model).__name__, f"has weights on the meta device ({meta[0]}, ...): they hold "
                          "no values", "load the weights first (e.g. from_pretrained without device_map, or "
                          "model.to_empty(device='cpu') then load_state_dict)")
    if len(devices) > 1:
        where = ", ".join(f"{name} on {device}" for device, name in devices.items())
        raise OptionError("model", type(model).__name__, f"has weights on several devices ({where})",
                          "move the whole model to one device: model.to('cpu') or model.to('cuda')")
