"""Inductor backend: the lowered graph compiled by `torch.compile` (TorchInductor, C++ on CPU).

    fast = speccomp.compile(model, drafter="token_recycling", backend="inductor")

Lowering: a copy of the graph gets the eager backend's GroupedQueryAttention pass (SDPA reads the
shared KV heads), then goes to `torch.compile(fullgraph=True)` with inductor's *freezing* on:
weights become constants, and inductor packs every linear for oneDNN itself, which is what
PrepackLinear does by hand for the eager backend. PrepackLinear is not run here: inductor would
only see its packed weights as opaque buffers and call the same oneDNN kernel, so freezing gives
the same matmuls plus constant folding and fusion around them (measured: README, `InductorStep`).

Dynamic shapes: one graph serves prefill, decode (q = 1) and tree verification (q = n), and the
cache grows every step, so every call marks the sequence dims dynamic (q, past, past + q, and the
tree mask's two dims). Dynamo still specialises sizes 0 and 1, so a graph compiles once per *class*
of call — prefill (past = 0), single token (q = 1), several tokens — never once per step.
`InductorStep.compiles` counts the compilations; tests assert it stops growing.

The first call of each class compiles (seconds for a tiny model, minutes for SmolLM2 on 2 cores;
inductor's on-disk cache makes later processes faster). Compilation runs lazily, inside the first
`generate`, because which classes a graph meets depends on how it is used (a drafter graph never
prefills, plain decoding never verifies a tree).
"""
from __future__ import annotations

import time

import torch

from speccomp.errors import SpeccompError
from speccomp.frontend.graph import run_passes
from speccomp.passes.grouped_query_attention import GroupedQueryAttention
from speccomp.passes.tree_attention import TREE_MASK

from speccomp.backends.onnx_export import export_copy

# which dims of each input vary from call to call (see the calling convention, speccomp/frontend/convention.py)
DYNAMIC_DIMS = {"input_ids": (1,), "position_ids": (1,), "attention_mask": (1,), "past_kv": (4,), TREE_MASK: (0, 1)}


class InductorBackendError(SpeccompError, RuntimeError):
    """torch.compile / TorchInductor could not compile the graph; the message names the fix."""


class InductorStep:
    """A graph compiled by TorchInductor, with the captured graph's calling convention. Counts what it
    compiled (`compiles`, `compile_seconds`) so callers can check that decoding does not recompile step after step.
    """

    def __init__(self, gm: torch.fx.GraphModule, input_names: list[str], options: dict, dims: list[tuple] | None = None):
        self.input_names = list(input_names)
        # `dims`: which dims of each input vary (a drafter graph's, backends/drafter_graph.py); marked "maybe" dynamic,
        # since some of them take sizes 0 and 1 that dynamo specialises (an EAGLE mask [1, 1] after a 1-token prompt)
        self._dims = dims if dims is not None else [DYNAMIC_DIMS.get(name, ()) for name in self.input_names]
        self._mark = torch._dynamo.mark_dynamic if dims is None else torch._dynamo.maybe_mark_dynamic
        self.options = dict(options)
        self.compiles = 0
        self.compile_seconds = 0.0
        self._compiled = torch.compile(gm, backend=self._inductor, fullgraph=True, dynamic=None)

    def _inductor(self, gm, example_inputs):
        """The dynamo backend: inductor's compile_fx, counted and timed."""
        from torch._inductor.compile_fx import compile_fx

        start = time.perf_counter()
        try:
            return compile_fx(gm, example_inputs, config_patches=self.options)
        finally:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - start

    def __call__(self, *inputs):
        if len(inputs) != len(self._dims):
            raise TypeError(f"the compiled graph takes {len(self._dims)} inputs {self.input_names}, got {len(inputs)}")
        for x, dims in zip(inputs, self._dims):
            for d in dims:
                self._mark(x, d)
        with torch.no_grad():
            try:
                return self._compiled(*inputs)
            except Exception as exc:
                compiler = type(exc).__module__.startswith(("torch._dynamo", "torch._inductor"))
                if isinstance(exc, SpeccompError) or not compiler:
                    raise
                raise InductorBackendError(
                    f"torch.compile (inductor) failed on the graph: {str(exc).splitlines()[0] if str(exc) else exc!r}; "
                    "inductor needs a C++ compiler (g++) on CPU; backend='eager' runs the same graph uncompiled"
                ) from exc

    def __repr__(self) -> str:
        return f"InductorStep(inputs={self.input_names}, compiles={self.compiles}, options={self.options})"


def lower_inductor(sg):
    """The graph (on a copy of `sg`) compiled by torch.compile."""
    sg = sg.clone()
    run_passes(sg, [GroupedQueryAttention()], dump_input=False)
    unknown = [n for n in sg.input_names() if n not in DYNAMIC_DIMS]
    if unknown:
        raise ValueError(f"the inductor backend does not know which dims of graph inputs {unknown} vary")
    return InductorStep(export_copy(sg.gm), sg.input_names(), {"freezing": True})
