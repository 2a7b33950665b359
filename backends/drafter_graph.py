"""Lower a drafter's own small graph (Hydra's head step, the EAGLE layer step) with the target's backend.

    step = lower_module(HydraStep(heads), DrafterGraphSpec(...), backend="onnxruntime")
    next_states, top_logp, top_ids = step(head, states, tokens)

The target is a captured HF model with the calling convention of speccomp/frontend/convention.py; a drafter
module is a few layers with a convention of its own, declared by a `DrafterGraphSpec` (input and output names,
an example call, which dims vary). Capture is the same (`torch.export`, so the drafter is an FX graph like the
target), and so is what each backend does with it:

    eager / triton    the captured FX graph with PrepackLinear (oneDNN packed matmuls on float32 CPU weights);
                      triton's kernel is the target's tree attention, so its drafter graphs run as eager's
    inductor          the captured graph compiled by torch.compile (InductorStep, the varying dims marked dynamic)
    onnxruntime...    exported to ONNX (`export_module_onnx`, also what an engine export writes), run by OrtStep

Every lowering returns a callable taking and returning torch tensors in the spec's order.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch


@dataclass
class DrafterGraphSpec:
    name: str  # file stem: "hydra" -> hydra.onnx
    inputs: list[str]
    outputs: list[str]
    example: tuple  # example inputs, sizes distinct from 0 and 1 on every varying dim
    dynamic: tuple | None  # per input: {dim: torch.export.Dim} (or None), as for torch.export; None: all static


def capture_module(module: torch.nn.Module, spec: DrafterGraphSpec) -> torch.fx.GraphModule:
    """`module` as a flat FX graph (torch.export, then without the input guards export_copy drops)."""
    from speccomp.backends.onnx_export import export_copy

    with torch.no_grad():
        program = torch.export.export(module.eval(), spec.example, dynamic_shapes=spec.dynamic)
    return export_copy(program.module())


def export_module_onnx(module: torch.nn.Module, spec: DrafterGraphSpec, path: Path) -> Path:
    """`module` exported to the ONNX file `path` with the spec's names and dynamic dims."""
    from speccomp.backends.onnx_export import onnx_program

    program = onnx_program(module.eval(), spec.example, f"exporting the {spec.name} drafter graph failed",
                           input_names=spec.inputs, output_names=spec.outputs, dynamic_shapes=spec.dynamic)
    program.save(path)
    return path


def lower_module(module: torch.nn.Module, spec: DrafterGraphSpec, backend: str):
    """A callable running `module`'s graph on `backend` (see the module docstring)."""
    from speccomp.backends import ORT_PROVIDERS, check

    check(backend)
    # a second session beside the target's, small: one thread, so it neither spins nor wakes a pool; the target's
    # pool spins meanwhile on the other cores (speccomp/api.py). On 2 cores, SmolLM2: 1.03-1.18x for
    # hydra+token_recycling, 1.09x for EAGLE against both sessions on 2 non-spinning threads (benchmarks/threads_ab.py)
    if backend in ORT_PROVIDERS:
        from speccomp.backends.onnx_export import OrtStep
        from speccomp.backends.onnxruntime import _export_dir
        from speccomp.engine.runtime import check_provider

        providers = check_provider(ORT_PROVIDERS[backend])
        path = export_module_onnx(module, spec, _export_dir(spec.name) / f"{spec.name}.onnx")
        return OrtStep(path, providers=providers, intra_op_threads=1, spin=False)
    gm = capture_module(module, spec)
    if backend == "inductor":
        from speccomp.backends.inductor import InductorStep

        dims = [tuple(d) if d else () for d in (spec.dynamic or [None] * len(spec.inputs))]
        return InductorStep(gm, spec.inputs, {"freezing": True}, dims=dims)
    from speccomp.passes.prepack_linear import PrepackLinear

    graph = SimpleNamespace(gm=gm, applied=[])  # what a Pass touches of a SpecGraph
    if PrepackLinear.applies(graph):
        PrepackLinear()(graph)
    return gm
