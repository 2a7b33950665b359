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

import itertools
import warnings

import torch

from speccomp.frontend.graph import run_passes
from speccomp.passes.grouped_query_attention import GroupedQueryAttention
from speccomp.passes.prepack_linear import PrepackLinear
from speccomp.passes.triton_attention import TritonAttention

from speccomp.backends.triton_attention import TritonBackendError, check_available


def _device(gm: torch.nn.Module) -> torch.device:
    first = next(itertools.chain(gm.parameters(), gm.buffers()), None)
    return torch.device("cpu") if first is None else first.device


def check_attention(sg) -> None:
    """backend="triton" must put attention into the kernel: a model whose attention is all captured as eager
    (softmax chains, e.g. Gemma2's logit softcapping) would lower nothing and still be called triton, so it is
    refused; one with some eager layers is lowered with a warning naming them."""
    eager = [s.module for s in sg.structure.attention if s.kind != "sdpa"]
    if eager and len(eager) == len(sg.structure.attention):
        raise TritonBackendError(
            f"backend='triton' runs SDPA attention in the Triton kernel, but every attention site of this "
            f"{sg.captured.model_type} model is captured as eager ({sg.captured.attn_implementation} attention: "
            f"softmax chains, e.g. for logit softcapping), so nothing would run in Triton. Use backend='eager', or load "
            "the model with attn_implementation='sdpa' if it supports it"
        )
    if eager:
        warnings.warn(f"backend='triton': attention of {eager} stays eager (not SDPA), only the other layers run in "
                      "the Triton kernel", stacklevel=3)
    if sg.captured.kv.dtype != torch.float32:  # the kernel's loads and accumulators are float32
        raise TritonBackendError(f"backend='triton': the Triton attention kernel computes in float32, and this model "
                                 f"is {sg.captured.kv.dtype}. Compile model.float(), or use backend='eager' or "
                                 "'inductor' for half precision")


def lower_triton(sg):
    """The runnable GraphModule with Triton attention; `sg` itself stays backend-neutral."""
    check_attention(sg)  # nothing to lower: say so instead of calling an unchanged graph "triton"
    check_available(_device(sg.gm))  # no GPU and no interpreter: fail now, naming the fix
    sg = sg.clone()
    passes = [GroupedQueryAttention(), TritonAttention()]
    if PrepackLinear.applies(sg):
        passes.append(PrepackLinear())
    run_passes(sg, passes, dump_input=False)
    return sg.gm
