"""Eager backend: run the rewritten FX GraphModule as Python, op by op (no compilation).

Lowering runs, on a copy of the graph, three CPU-minded passes first (each documented in its module):
InPlaceKV (each layer writes its new keys/values into the runtime's preallocated cache instead of copying the
past into a cat), GroupedQueryAttention (SDPA reads the shared KV heads, no per-step copies of the cache) and,
for float32 CPU weights with oneDNN available, PrepackLinear (every linear runs on a weight
packed once for oneDNN, whose few-row matmuls are what decoding and tree verification need).
"""
from __future__ import annotations

from speccomp.frontend.graph import run_passes
from speccomp.passes.grouped_query_attention import GroupedQueryAttention
from speccomp.passes.inplace_kv import InPlaceKV
from speccomp.passes.prepack_linear import PrepackLinear


def lower_eager(sg):
    """The runnable GraphModule; `sg` itself stays backend-neutral (other backends export it)."""
    sg = sg.clone()
    passes = [InPlaceKV(), GroupedQueryAttention()]
    if PrepackLinear.applies(sg):
        passes.append(PrepackLinear())
    run_passes(sg, passes, dump_input=False)
    return sg.gm
