"""Lowerings: turn a rewritten SpecGraph into a callable with the captured graph's convention.

    step = lower(spec_graph, "eager")
    logits, new_kv, hidden = step(input_ids, position_ids, attention_mask, past_kv)
"""
from __future__ import annotations

from .eager import lower_eager


def lower_onnxruntime(sg):
    from .onnxruntime import lower_onnxruntime as lower  # imports onnx / onnxruntime only when chosen

    return lower(sg)


def lower_triton(sg):
    from .triton import lower_triton as lower  # imports triton only when chosen

    return lower(sg)


BACKENDS = {"eager": lower_eager, "onnxruntime": lower_onnxruntime, "triton": lower_triton}


def lower(sg, backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; accepted values: {sorted(BACKENDS)}")
    return BACKENDS[backend](sg)
