"""PrepackLinear: lower every `aten.linear` to oneDNN's matmul on a weight packed once.

Expects: a graph on CPU whose `aten.linear` weights are float32 graph attributes
(parameters or buffers), and a PyTorch built with oneDNN (`torch.backends.mkldnn`).

    before:  x ──► linear(x, W, b) ──►
    after:   x ──► mkldnn._linear_pointwise(x, W_packed, b, "none", [], "") ──►
                   W_packed = get_attr  (W reordered once into oneDNN's blocked layout)

Why: decoding reads every weight for a handful of tokens. PyTorch's default CPU matmul for
few rows (MKL sgemm) is far from memory bound on some CPUs; measured on this project's AMD
EPYC (2 threads), the 49152x576 LM head takes 13 ms at 1 row and 22 ms at 4 rows there,
but ~6 ms at both with the packed oneDNN kernel (`python benchmarks/step_cost.py`). Speculative decoding lives on "scoring
q tokens costs about what scoring 1 does", so this is the lowering that makes it pay on CPU.

Numerics: the same math with a different summation order (fp32 rounding differences,
~1e-6 relative), like any change of kernel or of the number of rows. Losslessness is
still checked where it is defined, by token equality against the model (tests).

Packed weights are cached per source tensor, so the target graph and drafter graphs that
share parameters (SpecGraph.clone) also share one packed copy. Packing costs one extra copy
of the linear weights in memory.
"""
from __future__ import annotations

import operator
import weakref

import torch

from speccomp.errors import GraphStructureError
from speccomp.frontend.graph import Pass, SpecGraph
from speccomp.passes import replace_node

aten = torch.ops.aten
_PACKED: dict[int, tuple] = {}  # id(weight) -> (the weight's stamp when packed, packed copy); dropped when it dies


def available() -> bool:
    """oneDNN linear is built into this PyTorch (CPU builds from pytorch.org have it)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed(weight: torch.Tensor) -> torch.Tensor:
    key = id(weight)
    # a weight changed in place since it was packed (load_state_dict, an optimizer step: the same Parameter) has a
    # newer version counter: packed again, so a later compile decodes the weights the model holds now
    stamp = (weight._version, weight.data_ptr(), weight.dtype, tuple(weight.shape))
    held = _PACKED.get(key)
    if held is None or held[0] != stamp:
        if held is None:
            weakref.finalize(weight, _PACKED.pop, key, None)
        # no batch-size hint: one layout serves every row count (prefill, decode, trees)
        _PACKED[key] = held = (stamp, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
    return held[1]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through the packed kernel where it applies (float32 CPU, oneDNN), else plain linear.

    For matmuls the runtime does outside a graph (e.g. the Medusa drafter's head projection)."""
    if available() and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed(weight), None, "none", [], "")
    return torch.nn.functional.linear(x, weight)


class PrepackLinear(Pass):
    name = "prepack_linear"

    def _linears(self, sg: SpecGraph):
        return [n for n in sg.gm.graph.nodes if n.op == "call_function" and n.target is aten.linear.default]

    @classmethod
    def applies(cls, sg: SpecGraph) -> bool:
        """Whether the pass would accept this graph (backends use it to decide)."""
        try:
            cls().check(sg)
        except GraphStructureError:
            return False
        return True

    def check(self, sg: SpecGraph) -> None:
        if not available():
            raise GraphStructureError("PrepackLinear needs a PyTorch built with oneDNN (torch.backends.mkldnn)")
        for node in self._linears(sg):
            w = node.args[1]
            if w.op != "get_attr":
                raise GraphStructureError(f"{node.name}: weight {w.name} is computed in the graph, not a stored tensor")
            t = operator.attrgetter(w.target)(sg.gm)
            if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 2:
                raise GraphStructureError(
                    f"{node.name}: PrepackLinear lowers float32 CPU weights, got {t.dtype} on {t.device} with shape "
                    f"{tuple(t.shape)}"
                )

    def rewrite(self, sg: SpecGraph) -> None:
        graph = sg.gm.graph
        names: dict[str, str] = {}  # weight attribute -> packed attribute (a tied weight is packed once)
        for node in self._linears(sg):
            w = node.args[1]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            if w.target not in names:
                name = "_packed_" + w.target.replace(".", "_")
                sg.gm.register_buffer(name, packed(operator.attrgetter(w.target)(sg.gm)), persistent=False)
                names[w.target] = name
            with graph.inserting_before(node):
                pw = graph.get_attr(names[w.target])
                new = graph.call_function(
                    torch.ops.mkldnn._linear_pointwise.default, (node.args[0], pw, bias, "none", [], "")
                )
            replace_node(node, new)
