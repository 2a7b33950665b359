"""Capture a causal LM into one flat torch.fx graph with the KV cache, positions and mask as inputs.

The captured graph has the calling convention every pass and backend relies on:

    logits, new_kv, hidden = graph(input_ids, position_ids, attention_mask, past_kv)

    input_ids      int64 [1, q]                 tokens fed this step (prompt, 1 token, or a token tree)
    position_ids   int64 [1, q]                 their positions (a tree pass feeds past + depth)
    attention_mask int64 [1, past + q]          key padding mask (all ones for batch 1)
    past_kv        float [L, 2, 1, Hkv, past, D] keys (index 0) and values (index 1) of every layer
    logits         float [1, q, V]
    new_kv         float [L, 2, 1, Hkv, q, D]   this step's keys/values; the runtime owns the cache
    hidden         float [1, q, H]              final hidden state (after the final norm)

Hugging Face models are captured by speccomp/frontend/hf.py, plain nn.Modules by speccomp/frontend/module.py.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from speccomp.errors import SpeccompError, UnsupportedModelError

INPUT_NAMES = ("input_ids", "position_ids", "attention_mask", "past_kv")
OUTPUT_NAMES = ("logits", "new_kv", "hidden")
# Set on a cache buffer to a weak reference to its owner (the runtime's KVCache), whose first `owner.length` slots
# are in use: a graph given a view of the buffer that covers them may write its new entries into the free slots
# after the view (passes/inplace_kv.py, backends/onnx_kv.py). A view that stops short of `length` gets no writes.
KV_ROOM = "_speccomp_room"


def room_owner(buffer):
    """The owner a cache buffer names under KV_ROOM, or None (no owner, or it is gone)."""
    ref = getattr(buffer, KV_ROOM, None)
    return ref() if ref is not None else None


@dataclass(frozen=True)
class KVSpec:
    """Shape of the KV cache one layer holds: [1, num_kv_heads, length, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def shape(self, length: int) -> tuple[int, ...]:
        return (self.num_layers, 2, 1, self.num_kv_heads, length, self.head_dim)

    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


@dataclass
class CapturedModel:
    """What capture hands to the passes: the flat graph plus the facts the graph cannot tell."""

    graph_module: torch.fx.GraphModule
    kv: KVSpec
    vocab_size: int
    max_positions: int | None
    attn_implementation: str
    model_type: str
    sliding_windows: dict[str, int] = field(default_factory=dict)  # attention module path -> window
    model: object = field(default=None, repr=False, compare=False)  # the source nn.Module (identity, heads)

    def copy(self, val_map: dict | None = None) -> "CapturedModel":
        """A copy whose graph can be rewritten without touching this one (weights are shared, not copied);
        `val_map`, if given, receives each node's copy."""
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(self.graph_module.graph, {} if val_map is None else val_map))
        graph._codegen = self.graph_module.graph._codegen
        return dataclasses.replace(self, graph_module=torch.fx.GraphModule(self.graph_module, graph))


def example_inputs(kv: KVSpec, q: int, past: int, device="cpu", vocab_size: int = 2):
    """Inputs of the graph's calling convention for q new tokens after `past` cached ones."""
    gen = torch.Generator().manual_seed(q * 1000 + past)
    return (
        torch.randint(0, vocab_size, (1, q), generator=gen).to(device),
        torch.arange(past, past + q, device=device)[None],
        torch.ones(1, past + q, dtype=torch.long, device=device),
        torch.randn(*kv.shape(past), generator=gen).to(device=device, dtype=kv.dtype),
    )


_NOT_ONE_GUARD = re.compile(r"^\(?[^!=<>]*\)?\s*!=\s*1$")


def _drop_not_one_guards(program: torch.export.ExportedProgram) -> None:
    """Drop export's `<sequence size> != 1` input guards; `check_against_eager` verifies size 1 instead.

    With `backed_size_oblivious`, torch.export reasons about a dynamic size as if it were >= 2
    wherever a size of 1 would change strides (reshape / contiguous of transposed views, e.g.
    Falcon's own `query.transpose(1, 2).reshape(...)`) and records that as a `q != 1` guard,
    so the graph would refuse single-token decode. The traced code is the general case, which
    is also right for size 1; `check_against_eager` runs q = 1 and a 1-token prompt against the
    model and refuses the model if they disagree (a real `if q == 1` branch in model code)."""
    codes = getattr(program, "_guards_code", None)
    if isinstance(codes, list):
        program._guards_code = [g for g in codes if not _NOT_ONE_GUARD.match(g.strip())]


def export_dynamic(step: nn.Module, args: tuple, dynamic: tuple, what: str) -> torch.export.ExportedProgram:
    """torch.export with size-oblivious dynamic dims (0 and 1 stay legal sizes); errors name `what` failed."""
    with fx_config.patch(backed_size_oblivious=True), torch.no_grad():
        try:
            return torch.export.export(step, args, dynamic_shapes=dynamic)
        except SpeccompError:
            raise
        except Exception as exc:  # torch.export's errors are long; lead with what failed
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UnsupportedModelError(f"torch.export could not capture {what}: {first}{_why(exc, step)}") from exc


def _why(exc: Exception, step: nn.Module) -> str:
    """For a guard on a tensor's values (an `if` on what a tensor holds): where, and the common cause's fix."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if not isinstance(exc, GuardOnDataDependentSymNode):
        return ""
    lines = str(exc).splitlines()
    at = next((lines[i + 1].strip() for i, line in enumerate(lines[:-1]) if "following call raised" in line), "")
    where = f" ({at})" if at else ""
    why = f"; the model branches on a tensor's values{where}, which one captured graph cannot hold"
    if any(isinstance(m, (nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))
           for m in step.modules()):  # they test a given mask for causality by its values (_detect_is_causal_mask)
        why += ("; nn.TransformerEncoder(Layer) reads its mask's values to see whether it is causal: pass "
                "is_causal=True with the causal mask")
    return why


def check_outputs(captured: CapturedModel, got, want, atol: float, what: str, where: str, why: str) -> None:
    """The graph's outputs `got` against the `what`'s (`want`, in OUTPUT_NAMES order), or an UnsupportedModelError
    naming the output, `where` (the lengths run) and `why` they likely differ. Each output agrees within rtol 1e-4
    and an atol scaled by its largest magnitude (at least 1): a wrong branch differs by O(1), while float32 rounding
    grows with the values, and on a GPU the graph and the model may run different kernels for one matmul (a real
    SmolLM2's logits, up to ~30, differed by 1.7e-4 on an H200)."""
    for name, g, w in zip(OUTPUT_NAMES, got, want):
        finite = w[w.isfinite()] if w.is_floating_point() else w[:0]  # a -inf mask value must not widen it
        scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
        if g.shape != w.shape or not torch.allclose(g, w, atol=atol * scale, rtol=1e-4):
            diff = (g - w).abs().max().item() if g.shape == w.shape else f"shape {tuple(g.shape)} vs {tuple(w.shape)}"
            raise UnsupportedModelError(f"captured graph of {captured.model_type} disagrees with the {what} on "
                                        f"`{name}` for {where} (max diff {diff}); {why}")


def _flatten(program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """The exported program as a GraphModule with plain positional inputs and a tuple output.

    `ExportedProgram.module()` calls through pytree specs; passes add inputs, so the
    codegen is reset to plain FX, which takes and returns flat tensors."""
    _drop_not_one_guards(program)
    gm = program.module()
    gm._forward_pre_hooks.clear()  # the pytree input-spec check would reject inputs that passes add
    graph = gm.graph
    graph._codegen = torch.fx.graph.CodeGen()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, INPUT_NAMES):
        node.name = node.target = name
    out = graph.output_node()
    (flat,) = out.args
    if isinstance(flat, (list, tuple)) and len(flat) == 1 and isinstance(flat[0], (list, tuple)):
        flat = flat[0]
    out.args = (tuple(flat),)
    graph.lint()
    gm.recompile()
    return gm


