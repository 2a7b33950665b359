"""Triton backend: the eager backend's FX graph with every SDPA attention in a Triton kernel.

    fast = speccomp.compile(model.cuda(), drafter="token_recycling", backend="triton")

Lowering, on a copy of the graph: GroupedQueryAttention (SDPA reads the shared KV heads), then
TritonAttention (each SDPA becomes `speccomp::tree_attention`, backends/triton_attention.py:
q new tokens against cache + new keys under the graph's own mask, KV heads shared per group,
online softmax). The rest of the graph runs op by op, as in the eager backend.

Where it runs: on a CUDA GPU (model and prompt on the GPU), or on CPU in Triton's interpreter when
Python was started with TRITON_INTERPRET=1 (slow; what the tests use; why "started with":
backends/triton_attention.py). Anything else fails here, at compile time, with a TritonBackendError
naming the fix, not at the first generate.

PrepackLinear runs when it applies, i.e. for float32 weights on CPU (the interpreter case): the
linears are then the same oneDNN matmuls as the eager backend's, so on CPU this backend differs
from eager only in attention. On CUDA weights the pass does not apply and linears stay aten.linear.
"""
from __future__ import annotations

import torch

from speccomp.graph import run_passes
from speccomp.passes.grouped_query_attention import GroupedQueryAttention
from speccomp.passes.prepack_linear import PrepackLinear
from speccomp.passes.triton_attention import TritonAttention

from .triton_attention import check_available


def _device(gm: torch.nn.Module) -> torch.device:
    for t in gm.parameters():
        return t.device
    for t in gm.buffers():
        return t.device
    return torch.device("cpu")


def lower_triton(sg):
    """The runnable GraphModule with Triton attention; `sg` itself stays backend-neutral."""
    check_available(_device(sg.gm))  # no GPU and no interpreter: fail now, naming the fix
    sg = sg.clone()
    passes = [GroupedQueryAttention(), TritonAttention()]
    if PrepackLinear.applies(sg):
        passes.append(PrepackLinear())
    run_passes(sg, passes, dump_input=False)
    return sg.gm
