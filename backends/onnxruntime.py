"""ONNX Runtime backend: export the rewritten graph to ONNX, run it in an ONNX Runtime session.

    fast = speccomp.compile(model, drafter="token_recycling", backend="onnxruntime")

Every graph the compiled model runs (the target, after TreeAttention, and a self-drafter's graph)
is exported with its own calling convention (`tree_mask` included) and wrapped in an `OrtStep`,
which takes and returns torch tensors, so the decode loop in speccomp/runtime/decode.py is shared
with the eager backend. ONNX Runtime's CPU matmuls (MLAS) are what this buys on CPU.

Exported files go to a fresh temporary directory per graph (removed at exit) unless
SPECCOMP_ONNX_DIR names a directory to keep them in (each graph in a fresh NAME-XXXX folder there).
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch.export import Dim

from speccomp.frontend.convention import INPUT_NAMES, example_inputs
from speccomp.passes.tree_attention import TREE_MASK

from speccomp.backends.onnx_export import (_EXAMPLE_PAST, _EXAMPLE_Q, OrtStep, _dynamic_shapes, export_onnx,
                                           quantize_weights)
from speccomp.backends.onnx_kv import lower_in_place


def _export_dir(name: str) -> Path:
    keep = os.environ.get("SPECCOMP_ONNX_DIR")
    if keep:  # a fresh folder per lowering: two models (or two options) lowered alike never share, nor overwrite, files
        Path(keep).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=keep, prefix=f"{name}-"))
    path = Path(tempfile.mkdtemp(prefix=f"speccomp-{name}-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def export_args(sg):
    """(example_args, dynamic_shapes) for exporting `sg`: the calling convention plus `tree_mask` [q, T]."""
    names = sg.input_names()
    unknown = [n for n in names if n not in INPUT_NAMES and n != TREE_MASK]
    if unknown:
        raise ValueError(f"the onnxruntime backend cannot feed graph inputs {unknown}")
    args = list(example_inputs(sg.captured.kv, _EXAMPLE_Q, _EXAMPLE_PAST, vocab_size=sg.captured.vocab_size))
    dynamic = list(_dynamic_shapes([n for n in names if n in INPUT_NAMES]))
    if TREE_MASK in names:
        args.append(torch.ones(_EXAMPLE_Q, _EXAMPLE_Q + 2, dtype=torch.bool).tril(2))  # [q, T], T >= q
        dynamic.append({0: Dim("q", min=1), 1: Dim.AUTO})
    return tuple(args), tuple(dynamic)


def lower_onnxruntime(sg, provider: str = "cpu", spin: bool = True, quantize: tuple[int, int] | None = None):
    """An OrtStep running `sg` exported to ONNX on `provider` ("cpu", "cuda", "tensorrt"); `spin`, `quantize`: see
    lower(). On the CPU, graphs whose attention OrtAttention fuses write the cache in place (backends/onnx_kv.py)."""
    from speccomp.engine.runtime import check_provider

    check_exported_from_cpu(sg, provider)
    providers = check_provider(provider)  # before the export: a missing provider fails in a second, not a minute
    name = "-".join(sg.applied) or "plain"  # e.g. "tree_attention", "skip_layers-tree_attention"
    # the float file is only the quantiser's input then: no session loads it (538 MB of weights for nothing)
    rewrite = (lambda path: quantize_weights(path, *quantize)) if quantize else (lambda path: path)
    threads = 1 if quantize else None
    step = lower_in_place(sg, _export_dir(name) / f"{name}.onnx", providers, spin, rewrite, threads)
    if step is not None:
        return step
    args, dynamic = export_args(sg)
    path = export_onnx(sg, _export_dir(name) / f"{name}.onnx", example_args=args, dynamic_shapes=dynamic)
    return OrtStep(rewrite(path), providers=providers, spin=spin, intra_op_threads=threads)


def check_exported_from_cpu(sg, provider: str) -> None:
    """ONNX export traces the graph on the CPU (its example inputs, and OrtStep's feeds, are host tensors); ONNX
    Runtime's provider, not torch, puts the graph on a GPU. A model compiled elsewhere is refused by name."""
    from speccomp.errors import OptionError

    weight = next(iter(sg.gm.parameters()), None)
    if weight is not None and weight.device.type != "cpu":
        backend = {"cpu": "onnxruntime", "cuda": "onnxruntime:cuda"}.get(provider, provider)
        raise OptionError("backend", backend, f"exports the model from the CPU; this model is on {weight.device}",
                          "compile model.cpu() (backend='onnxruntime:cuda' then runs it on the GPU through ONNX "
                          "Runtime's CUDA provider), or use backend='eager', 'inductor' or 'triton' on the GPU")
    if provider == "cpu" and (sg.captured.kv.dtype == torch.bfloat16  # before a minute of export and a failed load
                              or any(p.dtype == torch.bfloat16 for p in sg.gm.parameters())):
        raise OptionError("backend", "onnxruntime", "ONNX Runtime's CPU provider has no bfloat16 kernels for this "
                          "model's ops (Mul, MatMul, ...)", "compile model.float() (or model.half()), or use "
                          "backend='eager' or 'inductor' for bfloat16")
