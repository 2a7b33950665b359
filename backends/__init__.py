"""Lowerings: turn a rewritten SpecGraph into a callable with the captured graph's convention.

    step = lower(spec_graph, "eager")
    logits, new_kv, hidden = step(input_ids, position_ids, attention_mask, past_kv)

    eager               the FX graph run op by op, after CPU lowering passes (eager.py)
    inductor            torch.compile / TorchInductor of the same graph (inductor.py)
    onnxruntime         exported to ONNX, run by ONNX Runtime's CPU provider (onnxruntime.py)
    onnxruntime:cuda    the same on ONNX Runtime's CUDA provider (needs onnxruntime-gpu and a GPU)
    tensorrt            the same on ONNX Runtime's TensorRT provider (needs onnxruntime-gpu, TensorRT, a GPU)
    triton              the eager graph with attention in a Triton kernel (triton.py; GPU or TRITON_INTERPRET=1)
    cudagraphs          the eager graph, its decode steps replayed from CUDA graphs (cudagraphs.py; a CUDA GPU)

Each import happens only when its backend is chosen, so a missing optional package fails there,
with a message naming it. GPU-only choices fail at compile time on a machine without the GPU stack.
"""
from __future__ import annotations

from importlib import import_module

from speccomp.backends.eager import lower_eager


def _lazy(module: str, *bound):
    """speccomp.backends.<module>.lower_<module>(sg, *bound, ...), imported at the first call: torch._inductor is
    heavy to import, and onnx / onnxruntime / triton are optional."""
    def lower_on(sg, *args):
        return getattr(import_module(f"speccomp.backends.{module}"), f"lower_{module}")(sg, *bound, *args)

    return lower_on


ORT_PROVIDERS = {"onnxruntime": "cpu", "onnxruntime:cuda": "cuda", "tensorrt": "tensorrt"}  # backend -> ORT provider
BACKENDS = {
    "eager": lower_eager,
    "inductor": _lazy("inductor"),
    **{backend: _lazy("onnxruntime", provider) for backend, provider in ORT_PROVIDERS.items()},
    "triton": _lazy("triton"),
    "cudagraphs": _lazy("cudagraphs"),
}


def check(backend: str) -> None:
    """Fail fast (before capture) on an unknown backend or a GPU provider this machine lacks."""
    from speccomp.runtime.calls import choice

    choice("backend", backend, BACKENDS)
    if ORT_PROVIDERS.get(backend, "cpu") != "cpu":
        from speccomp.engine.runtime import EngineError, check_provider
        from speccomp.errors import OptionError

        try:
            check_provider(ORT_PROVIDERS[backend])
        except EngineError as exc:  # named as the parameter it is here (load's provider= keeps the EngineError)
            raise OptionError("backend", backend, str(exc), "or backend='onnxruntime' (ONNX Runtime's CPU provider) "
                              "on this machine") from None
    if backend == "triton":  # no GPU and no interpreter: say so before the capture (and before a CLI loads a model)
        import torch

        from speccomp.backends.triton_attention import check_available

        check_available("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "cudagraphs":
        from speccomp.backends.cudagraphs import check_available

        check_available()


def lower(sg, backend: str, spin: bool = True, quantize: tuple[int, int] | None = None):
    """`spin=False`: one of several ONNX Runtime sessions of a compiled model (a drafter graph beside the target):
    idle pool threads then sleep between runs instead of spinning against each other and the host-side work (the
    engine's rule: speccomp/engine/runtime.py). Other backends have no pools to set.

    `quantize=(bits, block_size)`: ONNX Runtime only; the exported graph's weight MatMuls become MatMulNBits
    (onnx_export.quantize_weights) before a session loads it, and the step runs on one thread (a light drafter
    graph beside the target's spinning pool: the quantised self-drafters)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; accepted values: {sorted(BACKENDS)}")
    if is_onnxruntime(backend):
        return BACKENDS[backend](sg, spin, quantize)
    if quantize is not None:
        raise ValueError(f"quantize={quantize!r}: MatMulNBits weights are ONNX Runtime's; backend {backend!r} has none")
    return BACKENDS[backend](sg)


def is_onnxruntime(backend: str) -> bool:
    return backend in ORT_PROVIDERS
