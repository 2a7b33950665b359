"""Capture a plain `nn.Module` causal LM (input_ids -> logits, no cache) into speccomp's convention.

    logits, new_kv, hidden = graph(input_ids, position_ids, attention_mask, past_kv)

(see speccomp/frontend/convention.py for the shapes). A plain module has none of the last three inputs, so it
is exported once as it is, `model(input_ids)` with a dynamic sequence length, and the passes in
`speccomp.passes.explicit_kv` make them explicit on the exported graph:

    captured:  input_ids -> [embed (+ wpe(arange(seq)))] -> blocks(sdpa(q, k, v, is_causal=True))
               -> norm -> lm_head -> logits
    rewritten: input_ids, position_ids, attention_mask, past_kv
               -> [embed (+ wpe(position_ids[0]))] -> blocks(sdpa(q, cat(past_k, k), cat(past_v, v), mask))
               -> norm -> lm_head -> (logits, stack(k, v per layer), norm output)

The user's module is exported inside a holder whose attribute is `model`, so module paths in the
graph read `model.<user path>` like HF captures and `speccomp.frontend.graph.annotate` strips the prefix
back to the user's own names (`transformer.h.0`, `layers.2.attention`).

Supported: attention through `F.scaled_dot_product_attention` that is causal (`is_causal=True`, or
a mask computed from the sequence length alone that equals the causal mask); MHA or GQA (heads
repeated with repeat_interleave, expand+reshape before or after the [B, T, H, D] -> [B, H, T, D]
transpose, repeat, or `enable_gqa=True`; the cache holds the un-repeated heads); positions from
`torch.arange(seq)` (learned absolute embeddings, rotary angles) or a table sliced `[:seq]`;
logits for every position, returned as a tensor, the first element of a tuple, a dict's
"logits" or an object's `.logits`. Anything else raises `UnsupportedModelError` naming what is
missing (explicit-softmax attention, no position-dependent op, last-position-only logits, ...).

torch.export's input guards are dropped (see `AddConventionInputs`); `check_against_module`
instead runs the rewritten graph for 1-token prompts, single-token decode and multi-token steps
against the module itself and refuses the model if they disagree. `max_positions` comes from the
position table the module indexes, the length bound its export recorded (an `assert t <= n`),
or a `block_size` / `max_seq_len`-style attribute of the module or its config.
"""
from __future__ import annotations

from collections.abc import Mapping

import sympy
import torch
import torch.fx.experimental._config as fx_config
from torch import fx, nn
from torch.export import Dim

from speccomp.frontend.convention import CapturedModel, KVSpec, check_outputs, export_dynamic
from speccomp.errors import UnsupportedModelError

EXAMPLE_LENGTH = 5  # sequence length used while exporting (any value >= 2 that the model accepts)
POSITION_ATTRS = ("max_position_embeddings", "block_size", "max_seq_len", "max_seq_length", "n_positions", "n_ctx")


class _PlainStep(nn.Module):
    """Holder exported instead of the user's module: `model` keeps paths like HF captures; returns only the logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids)
        if isinstance(out, (tuple, list)):
            logits, found = (out[0] if out else None), f"a {type(out).__name__} whose first item is {_what(out[:1])}"
        elif isinstance(out, Mapping):
            logits, found = out.get("logits"), f"a mapping with keys {list(out)[:8]}"
        elif isinstance(out, torch.Tensor):
            logits, found = out, _what([out])
        else:
            logits, found = getattr(out, "logits", None), f"a {type(out).__name__} with no tensor `.logits`"
        if not (isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.dim() == 3):
            raise UnsupportedModelError(  # (it failed later as a TypeError, or as "no attention found")
                f"{type(self.model).__name__}(input_ids) returned {found}; speccomp reads the logits [batch, seq, "
                "vocab] as the output itself, its first item (a tuple) or its 'logits' (a dict, or an object's "
                ".logits): return them that way (a (loss, logits) tuple: put the logits first)")
        return logits


def _what(items) -> str:
    """How an output item reads in an error: a tensor's dtype and rank, else its type."""
    if not items:
        return "nothing"
    x = items[0]
    return f"a {x.dtype} tensor of {x.dim()} dims" if isinstance(x, torch.Tensor) else type(x).__name__


def _state_writes(gm: fx.GraphModule) -> list[str]:
    """The module's own tensors (get_attr: buffers, parameters) an op of the graph may write in place, directly or
    through what may be a view of them. torch.export under no_grad keeps `self.calls += 1` as aten.add_ on the buffer
    and does not list it in the signature's buffers_to_mutate; ops like `to` and `reshape` are annotated as aliasing
    but usually copy, so a hit here is only a suspicion (capture_module confirms it on the functionalized program)."""
    def root(node):
        while isinstance(node, fx.Node) and node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.args and node.target._schema.arguments and node.target._schema.arguments[0].alias_info:
            node = node.args[0]  # a view's base
        return node

    written = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            for spec, arg in zip(n.target._schema.arguments, n.args):
                base = root(arg) if spec.alias_info is not None and spec.alias_info.is_write else None
                if isinstance(base, fx.Node) and base.op == "get_attr":
                    written.append(str(base.target).removeprefix("model."))
    return written


def capture_module(model: nn.Module, *, check: bool = True) -> CapturedModel:
    """torch.export a plain causal LM and rewrite it into speccomp's calling convention (speccomp/frontend/convention.py)."""
    from speccomp.frontend.graph import run_passes
    from speccomp.passes.explicit_kv import PASSES, PlainGraph

    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module causal LM, got {type(model).__name__}")
    first = next(model.parameters(), None)
    if first is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no parameters; it is not a causal LM")
    model.eval()
    step = _PlainStep(model).eval()
    example = torch.zeros(1, EXAMPLE_LENGTH, dtype=torch.long, device=first.device)
    program = export_dynamic(step, (example,), ({1: Dim.AUTO},),
                             f"{type(model).__name__}(input_ids) with a dynamic sequence length")
    gm = program.module()
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    if not mutated and _state_writes(gm):  # an op that may write a buffer (or a copy: `.float()`, `reshape` may copy)
        with fx_config.patch(backed_size_oblivious=True):  # functionalized, the signature knows which
            mutated = set(program.run_decompositions().graph_signature.buffers_to_mutate.values())
    mutated = sorted(m.removeprefix("model.") for m in mutated)
    if mutated:  # checked before any call of the module: the check below runs it
        raise UnsupportedModelError(
            f"{type(model).__name__}.forward writes its buffers {mutated[:5]}: the compiled graph would write into "
            "your module at every step (verifying draft tokens it does not keep, too); keep forward free of state "
            "(keep counters or caches outside the module)")
    gm.graph._codegen = fx.graph.CodeGen()  # plain positional inputs and tuple output (passes add inputs)
    (input_ids,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    seq_size = input_ids.meta["val"].shape[1]
    if not isinstance(seq_size, torch.SymInt):
        raise UnsupportedModelError(f"{type(model).__name__} specializes on the sequence length while exported; it "
                                    "must accept any length")
    pg = run_passes(PlainGraph(gm, seq_size.node.expr), [cls() for cls in PASSES])  # dumped with SPECCOMP_DEBUG=1
    heads, head_dim, dtype = pg.kv_layout
    kv = KVSpec(len(pg.slots), heads, head_dim, dtype)
    _propagate_values(pg, kv)
    gm._forward_pre_hooks.clear()  # export's input check expects the one-input signature (as in capture._flatten)
    gm.recompile()
    logits_val = gm.graph.output_node().args[0][0].meta["val"]
    captured = CapturedModel(graph_module=gm, kv=kv, vocab_size=int(logits_val.shape[-1]),
                             max_positions=_max_positions(model, pg, program), attn_implementation="sdpa",
                             model_type=type(model).__name__, sliding_windows={})
    if check:
        check_against_module(captured, model)
    return captured


def _max_positions(model, pg, program) -> int | None:
    """The context the module allows: position tables it indexes, a length bound its export recorded, or a size attribute."""
    bounds = list(pg.position_tables)
    vr = program.range_constraints.get(pg.seq)
    if vr is not None and isinstance(vr.upper, sympy.Integer):  # else unbounded (int_oo)
        bounds.append(int(vr.upper))
    for holder in (model, getattr(model, "config", None), getattr(model, "params", None), getattr(model, "args", None)):
        for name in POSITION_ATTRS:
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                bounds.append(value)
    return min(bounds) if bounds else None


def _propagate_values(pg, kv: KVSpec) -> None:
    """Fill `meta["val"]` (fake tensors) on the new placeholders and every node the passes added.

    The exported nodes keep their values; the sequence length keeps its symbol and the cache
    length gets a new one, so new nodes carry shapes like [1, Hkv, past + q, D]."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    from speccomp.passes.explicit_kv import ADDED

    ids_val = pg.inputs["input_ids"].meta["val"]
    mode, q = ids_val.fake_mode, ids_val.shape[1]
    env = mode.shape_env
    source = ConstantSource("past_length")
    past = env.create_symintnode(env.create_symbol(7, source, dynamic_dim=DimDynamic.DYNAMIC), hint=7, source=source)
    with mode:
        pg.inputs["position_ids"].meta["val"] = torch.empty(1, q, dtype=torch.long, device=ids_val.device)
        pg.inputs["attention_mask"].meta["val"] = torch.empty(1, past + q, dtype=torch.long, device=ids_val.device)
        pg.inputs["past_kv"].meta["val"] = torch.empty(kv.shape(past), dtype=kv.dtype, device=ids_val.device)

    def value(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    with fx_config.patch(backed_size_oblivious=True), mode:
        for node in pg.graph.nodes:
            if node.op != "call_function" or ("val" in node.meta and not node.meta.get(ADDED)):
                continue  # exported nodes keep their values
            node.meta["val"] = node.target(*fx.node.map_arg(node.args, value), **fx.node.map_arg(node.kwargs, value))


def check_against_module(captured: CapturedModel, model: nn.Module, atol: float = 1e-4, length: int = 9) -> None:
    """The graph, fed the cache it produced, must reproduce the module run on the whole sequence.

    Runs the graph on a 1-token prompt (past = 0), then several tokens, one token and several
    tokens, each time against the K/V the graph itself returned, and compares the logits with
    `model(prefix + new tokens)` (the module run on the text up to them); hidden states and K/V must match one
    prefill of the whole sequence."""
    gm = captured.graph_module
    step = _PlainStep(model).eval()
    device = next(model.parameters()).device
    if captured.max_positions is not None:
        length = min(length, captured.max_positions)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, captured.vocab_size, (1, length), generator=gen).to(device)
    # a 1-token prompt, then several tokens, one token, several tokens: each against the cache so far
    cuts = sorted({0, 1, max(1, length - 4), max(1, length - 3), length})
    kv = captured.kv

    def run(start: int, end: int, past: torch.Tensor):
        try:
            return gm(ids[:, start:end], torch.arange(start, end, device=device)[None],
                      torch.ones(1, end, dtype=torch.long, device=device), past)
        except Exception as exc:  # a rewrite that does not hold for these lengths
            raise UnsupportedModelError(f"captured graph of {captured.model_type} fails for {end - start} new tokens "
                                        f"after {start} cached: "
                                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc

    with torch.no_grad():
        full = run(0, length, torch.zeros(kv.shape(0), dtype=kv.dtype, device=device))
        past = torch.zeros(kv.shape(0), dtype=kv.dtype, device=device)
        for start, end in zip(cuts, cuts[1:]):
            got = run(start, end, past)
            # the module run on the text so far, as naive decoding runs it: a module that branches on the length
            # (`if T > 4`) was captured on one side of the branch, and the prefix's own run takes the other
            want = step(ids[:, :end])[:, start:end]
            expected = (want, full[1][..., start:end, :], full[2][:, start:end])  # OUTPUT_NAMES order
            check_outputs(captured, got, expected, atol, "module", f"tokens [{start}, {end}) after {start} cached",
                          "the module likely computes something from the sequence length that the passes did not "
                          "make explicit, or branches on it (`if T > n`: the export keeps one side)")
            past = torch.cat([past, got[1]], dim=4)
