"""Passes that turn a plain `input_ids -> logits` graph into speccomp's calling convention.

A plain `nn.Module` causal LM has no KV cache, no positions input and no mask input: exported
with `torch.export`, its graph recomputes attention over the whole sequence every call. These
passes make the three explicit, so the graph has speccomp's calling convention (speccomp/frontend/convention.py):

    logits, new_kv, hidden = graph(input_ids, position_ids, attention_mask, past_kv)

They run in this order on a `PlainGraph` (the graph plus what the passes learned about it):

    AddConventionInputs    add the position_ids, attention_mask, past_kv placeholders
    CachedAttention        causal SDPA -> SDPA over cat(past, new) K/V with an explicit mask
    ExplicitPositions      arange(seq) (or buffer[:seq]) -> position_ids
    ConventionOutputs      output (logits,) -> (logits, new_kv, hidden)

Each is a `speccomp.frontend.graph.Pass` whose `check` raises `UnsupportedModelError` naming what it
could not find. Nodes are found by op patterns and shapes, never module names. New nodes copy the
provenance of the nodes they replace, so `annotate` finds the user's module paths on them;
`speccomp.frontend.module` fills their fake values (`meta["val"]`) afterwards.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import sympy
import torch
from torch import fx

from speccomp.errors import GraphStructureError, UnsupportedModelError
from speccomp.frontend.convention import INPUT_NAMES
from speccomp.frontend.graph import MATMUL_OPS, SDPA_OPS, SOFTMAX_OPS, Pass, ancestors, copy_meta, module_path
from speccomp.frontend.graph import shape as tshape
from speccomp.passes import SDPA, replace_node, sdpa_arguments

aten = torch.ops.aten
ARANGE_OPS = {aten.arange.default, aten.arange.start, aten.arange.start_step}
# Ops between the LM head matmul and the logits, or between the final hidden state and the matmul.
PASS_THROUGH_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
                    aten.contiguous.default, aten.to.dtype, aten._to_copy.default, aten.alias.default}
# Ops that only repeat KV heads for grouped-query attention (or copy / reshape along the way).
HEAD_EXPAND_OPS = {aten.unsqueeze.default, aten.expand.default, aten.contiguous.default, aten.alias.default,
                   aten.clone.default, aten.reshape.default, aten.view.default, aten._unsafe_view.default,
                   aten.repeat.default, aten.repeat_interleave.self_int}
ADDED = "speccomp_added"  # meta key: the pass that created a node


@dataclass
class KVSlot:
    """One attention layer's new key/value, as the cache stores them: [1, Hkv, q, D] each."""

    layer: int
    sdpa: fx.Node
    key: fx.Node
    value: fx.Node


@dataclass
class PlainGraph:
    """A plain module's exported graph while the passes rewrite it (duck-types `SpecGraph` for `Pass`)."""

    gm: fx.GraphModule
    seq: sympy.Expr  # symbol of the input_ids sequence length
    applied: list[str] = field(default_factory=list)
    inputs: dict[str, fx.Node] = field(default_factory=dict)
    slots: list[KVSlot] = field(default_factory=list)
    kv_layout: tuple[int, int, torch.dtype] | None = None  # (Hkv, D, dtype) of the cached K/V
    position_tables: list[int] = field(default_factory=list)  # rows of tables indexed by position

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph


def val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_seq(size, seq: sympy.Expr) -> bool:
    """Whether a size (int, SymInt, or a node holding one) is the sequence length symbol."""
    if isinstance(size, fx.Node):
        size = val(size)
    return isinstance(size, torch.SymInt) and size.node.expr == seq


def depends_on(node: fx.Node, source: fx.Node) -> bool:
    """Whether the values of `source` flow into `node` (not just its shape)."""
    return node is source or source in ancestors(node)


def _mark(node: fx.Node, pass_name: str, like: fx.Node | None = None, root_of: fx.Node | None = None) -> fx.Node:
    """Tag a new node with its pass, and the provenance of `like` or the top level of `root_of`'s module stack."""
    if like is not None:
        copy_meta(node, like)
    elif root_of is not None:  # the stack's outermost entry: the exported holder, i.e. top level (path '')
        node.meta["nn_module_stack"] = dict(list((root_of.meta.get("nn_module_stack") or {}).items())[:1])
    node.meta[ADDED] = pass_name
    return node


class AddConventionInputs(Pass):
    """Add the three inputs the convention has and a plain module does not.

    before:  input_ids;                                         _guards_fn(input_ids)
    after:   input_ids, position_ids, attention_mask, past_kv   (unused until the next passes)

    The input guards torch.export recorded (`_guards_fn`) are dropped: they constrain the length
    of the *whole* sequence the module saw (e.g. `seq <= block_size`, or `seq != 1` when some op
    picked a copy over a view), while input_ids now holds only the new tokens. The whole-sequence
    limit becomes `CapturedModel.max_positions`, and `capture_module` checks the rewritten graph
    against the module for one and for several new tokens.
    """

    name = "add_convention_inputs"

    def check(self, pg: PlainGraph) -> None:
        placeholders = [n for n in pg.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            raise UnsupportedModelError(
                f"the exported module takes {len(placeholders)} tensor inputs; a plain causal LM must map input_ids -> logits"
            )
        shape = tshape(placeholders[0])
        if shape is None or len(shape) != 2 or not is_seq(shape[1], pg.seq):
            raise GraphStructureError(f"input_ids placeholder has shape {shape}, expected [1, seq]")

    def rewrite(self, pg: PlainGraph) -> None:
        (input_ids,) = [n for n in pg.graph.nodes if n.op == "placeholder"]
        input_ids.name = input_ids.target = INPUT_NAMES[0]
        for node in list(pg.graph.nodes):
            if node.op == "call_module" and node.target == "_guards_fn":
                pg.graph.erase_node(node)
                pg.gm.delete_submodule("_guards_fn")
        pg.inputs = {INPUT_NAMES[0]: input_ids}
        last = input_ids
        for name in INPUT_NAMES[1:]:
            with pg.graph.inserting_after(last):
                last = pg.graph.placeholder(name)
            pg.inputs[name] = last


@dataclass
class _Source:
    """Where the new keys (or values) are before any head repetition."""

    top: fx.Node  # [1, Hkv, q, D] ("bhsd") or [1, q, Hkv, D] ("bshd", cached transposed)
    layout: str
    expand: list[fx.Node]  # ops from `top` (exclusive) down to the sdpa operand, in graph order
    heads: int  # Hkv
    head_dim: int


class CachedAttention(Pass):
    """Causal SDPA over the sequence -> SDPA over cache + sequence with an explicit mask.

    Expects every attention to be `aten.scaled_dot_product_attention` that is causal, either by
    `is_causal=True` or by a mask computed in the graph from the sequence length alone (checked
    by evaluating that subgraph: it must equal the lower-triangular causal mask). The K/V the
    cache stores are found above any head repetition (GQA's repeat_interleave, repeat, or
    unsqueeze/expand/reshape, before or after the [B, T, H, D] -> [B, H, T, D] transpose; see
    `_unexpanded`), so the cache holds the un-expanded [1, Hkv, q, D] K/V; the repetition is
    replayed on the concatenated K/V (where heads were repeated before the rotary, K's un-repeated form is not in the
    graph: K and V are cached repeated). Layer l is the l-th SDPA in graph order; K/V after rotary
    embedding, since they are taken from the sdpa operands.

    before (one layer, GQA):
        k = transpose(rope(...))                                   # [1, Hkv, q, D]
        k_rep = repeat_interleave(k, n_rep, 1)                     # [1, H, q, D]
        out = scaled_dot_product_attention(q, k_rep, v_rep, None, 0.0, True)
    after:
        k_all = cat([select(select(past_kv, 0, l), 0, 0), k], 2)   # [1, Hkv, past+q, D]
        k_rep = repeat_interleave(k_all, n_rep, 1)                 # [1, H, past+q, D]
        out = scaled_dot_product_attention(q, k_rep, v_rep, mask)  # is_causal=False
    and once per graph, shared by all layers:
        mask = (arange(past+q)[None, :] <= arange(past, past+q)[:, None])[None, None]
               & (attention_mask != 0)[:, None, None, :]           # bool [1, 1, q, past+q]
    """

    name = "cached_attention"

    def check(self, pg: PlainGraph) -> None:
        graph = pg.graph
        others = [n for n in graph.nodes if n.target in SDPA_OPS and n.target is not SDPA]
        if others:
            raise UnsupportedModelError(f"attention op {others[0].target} is not supported; use F.scaled_dot_product_attention")
        sites = [n for n in graph.nodes if n.target is SDPA]
        if not sites:
            if any(n.target in SOFTMAX_OPS for n in graph.nodes):
                raise UnsupportedModelError(
                    "no scaled_dot_product_attention found: the module computes attention with an explicit softmax; "
                    "speccomp captures plain modules whose attention is torch.nn.functional.scaled_dot_product_attention "
                    "(is_causal=True)"
                )
            raise UnsupportedModelError(
                "no attention (scaled_dot_product_attention) found in the exported module; it is not a transformer causal LM"
            )
        input_ids = pg.inputs[INPUT_NAMES[0]]
        self.plans = []
        for node in sites:
            args = sdpa_arguments(node)
            where = _where(node)
            if args["dropout_p"] != 0:
                raise UnsupportedModelError(
                    f"attention {where} uses dropout_p={args['dropout_p']} in eval mode (speccomp captures the model "
                    "in eval mode); pass dropout_p=0 outside training, e.g. dropout_p=self.dropout if self.training "
                    "else 0.0")
            if args["attn_mask"] is None and not args["is_causal"]:
                raise UnsupportedModelError(
                    f"attention {where} is bidirectional (no mask, is_causal=False); speccomp needs causal attention"
                )
            if args["attn_mask"] is not None and not _is_causal_mask(pg.gm, args["attn_mask"], input_ids):
                raise UnsupportedModelError(
                    f"attention {where} takes a mask that is not the plain causal mask of the sequence "
                    "(or depends on more than its length); pass is_causal=True instead"
                )
            for name in ("query", "key", "value"):
                shape = tshape(args[name])
                if shape is None or len(shape) != 4 or shape[0] != 1 or not is_seq(shape[2], pg.seq):
                    fixed = (shape is not None and len(shape) == 4 and isinstance(shape[2], int)
                             and not any(is_seq(d, pg.seq) for d in shape))  # else the length sits elsewhere
                    raise UnsupportedModelError(
                        f"attention {where}: {name} has shape {shape}, expected [1, heads, seq, head_dim]" + (
                            f" with seq the input's length, not the fixed {shape[2]}: the module computes something "
                            "from the sequence length as a Python number (e.g. float(x.shape[1])), which fixes it at "
                            "the length it was captured with; compute it with tensor ops" if fixed else "")
                    )
            key = _unexpanded(args["key"], pg.seq, where, "key")
            value = _unexpanded(args["value"], pg.seq, where, "value")
            if key.heads != value.heads:  # K repeated before an op only it passes through (rotary): both cached
                wide = max(key.heads, value.heads)  # repeated, as the sdpa reads them (more bytes, same numbers)
                key, value = (_unexpanded(args[n], pg.seq, where, n, wide) for n in ("key", "value"))
            self.plans.append((node, args, key, value))
        layouts = {(k.heads, k.head_dim, v.heads, v.head_dim) for _, _, k, v in self.plans}
        if len(layouts) != 1:
            raise UnsupportedModelError(f"attention layers cache K/V of different shapes {sorted(layouts)}; speccomp needs one")
        ((hk, dk, hv, dv),) = layouts
        if (hk, dk) != (hv, dv):
            raise UnsupportedModelError(f"keys [*, {hk}, *, {dk}] and values [*, {hv}, *, {dv}] differ in shape")

    def rewrite(self, pg: PlainGraph) -> None:
        graph, past_kv = pg.graph, pg.inputs["past_kv"]
        mask = self._build_mask(graph, pg.inputs["input_ids"], pg.inputs["attention_mask"], anchor=self.plans[0][0])
        first = self.plans[0][2]
        pg.kv_layout = (first.heads, first.head_dim, val(first.top).dtype)
        pg.slots = []
        for layer, (node, args, key, value) in enumerate(self.plans):
            with graph.inserting_before(node):
                k_new, k_all = self._cached(graph, past_kv, layer, 0, key, pg.seq)
                v_new, v_all = self._cached(graph, past_kv, layer, 1, value, pg.seq)
                kwargs = {"dropout_p": 0.0, "is_causal": False}
                kwargs.update({k: args[k] for k in ("scale", "enable_gqa")  # where given, not the default
                               if args[k] is not None and args[k] is not False})
                new = graph.call_function(SDPA, (args["query"], k_all, v_all, mask), kwargs)
            replace_node(node, _mark(new, self.name))  # same output: [1, H, q, D]
            pg.slots.append(KVSlot(layer, new, k_new, v_new))

    def _cached(self, graph, past_kv, layer, kv, source: _Source, seq) -> tuple[fx.Node, fx.Node]:
        """(new entries [1, Hkv, q, D], the sdpa operand over cat(past_kv[layer, kv], new) with the head repetition replayed)."""
        top = source.top

        def add(target, *args):
            return _mark(graph.call_function(target, args), self.name, like=top)

        new = top if source.layout == "bhsd" else add(aten.transpose.int, top, 1, 2)
        cat = add(aten.cat.default, [add(aten.select.int, add(aten.select.int, past_kv, 0, layer), 0, kv), new], 2)
        if not source.expand:
            return new, cat
        total = add(aten.sym_size.int, cat, 2)
        env = {top: cat if source.layout == "bhsd" else add(aten.transpose.int, cat, 1, 2)}
        for op in source.expand:
            def swap(a):
                if a in env:
                    return env[a]
                if isinstance(a, fx.Node) and is_seq(a, seq):
                    return total
                if isinstance(a, fx.Node) and isinstance(val(a), torch.SymInt):
                    raise GraphStructureError(f"{op.name} repeats KV heads with a size {a.name} that is not the sequence length")
                return a
            env[op] = _mark(graph.call_function(op.target, fx.node.map_arg(op.args, swap), fx.node.map_arg(op.kwargs, swap)),
                            self.name, like=op)
        return new, env[source.expand[-1]]

    def _build_mask(self, graph, input_ids, attention_mask, anchor):
        first_use = next(n for n in graph.nodes if n.op == "call_function")  # right after the inputs
        with graph.inserting_before(first_use):
            def add(target, *args, **kwargs):
                return _mark(graph.call_function(target, args, kwargs), self.name, root_of=anchor)

            q = add(aten.sym_size.int, input_ids, 1)
            total = add(aten.sym_size.int, attention_mask, 1)
            past = add(operator.sub, total, q)
            device = val(input_ids).device
            rows = add(aten.arange.start, past, total, dtype=torch.long, device=device)  # absolute query positions
            cols = add(aten.arange.default, total, dtype=torch.long, device=device)  # key positions
            causal = add(aten.le.Tensor, add(aten.unsqueeze.default, cols, 0), add(aten.unsqueeze.default, rows, 1))
            keep = add(aten.ne.Scalar, attention_mask, 0)  # [1, past+q]
            keep = add(aten.unsqueeze.default, add(aten.unsqueeze.default, keep, 1), 1)  # [1, 1, 1, past+q]
            causal = add(aten.unsqueeze.default, add(aten.unsqueeze.default, causal, 0), 0)  # [1, 1, q, past+q]
            return add(aten.bitwise_and.Tensor, causal, keep)


def _where(node: fx.Node) -> str:
    path = module_path(node)  # the user's own module path
    return f"{node.name} (module {path})" if path else node.name


def _unexpanded(operand: fx.Node, seq, where: str, what: str, heads: int | None = None) -> _Source:
    """The K (or V) before any head repetition, and the repetition ops from it down to `operand`; `heads` given:
    the closest to the sdpa with that many heads.

    Walks up from the sdpa operand through HEAD_EXPAND_OPS and transposes. Candidates are nodes
    shaped [1, h, seq, D] ("bhsd") or [1, seq, h, D] ("bshd", Meta-Llama's repeat_kv repeats heads
    before the transpose), D the operand's head_dim. The cache takes the candidate with the fewest
    heads closest to the sdpa, so MHA caches the operand itself and GQA the un-repeated K/V.
    """
    d = tshape(operand)[3]
    chain = [operand]
    node = operand
    while node.target in HEAD_EXPAND_OPS or node.target in (aten.transpose.int, aten.permute.default):
        inputs = [a for a in node.all_input_nodes if isinstance(val(a), torch.Tensor)]
        if len(inputs) != 1:
            break
        node = inputs[0]
        chain.append(node)
    candidates = []  # (heads, position in chain, layout)
    for i, n in enumerate(chain):
        s = tshape(n)
        if s is None or len(s) != 4 or s[0] != 1 or s[3] != d:
            continue
        if is_seq(s[2], seq) and isinstance(s[1], int):
            candidates.append((s[1], i, "bhsd"))
        elif is_seq(s[1], seq) and isinstance(s[2], int):
            candidates.append((s[2], i, "bshd"))
    candidates = [c for c in candidates if heads in (None, c[0])]
    if not candidates:
        raise UnsupportedModelError(f"attention {where}: cannot find the {what} tensor [1, heads, seq, head_dim] to cache")
    heads, best, layout = min(candidates)  # fewest heads, then closest to the sdpa
    return _Source(chain[best], layout, list(reversed(chain[:best])), heads, d)


def _is_causal_mask(gm: fx.GraphModule, mask: fx.Node, input_ids: fx.Node) -> bool:
    """Evaluate the mask's subgraph for a few lengths: is it exactly the causal mask, and only a function of length?
    Short lengths must evaluate; longer ones (up to 4097) are checked where the module computes them: a sliding
    window (i - j < W) is the causal mask up to W tokens (a window above 4096 is not seen here). A mask cut from a
    table shorter than a length (nanoGPT's tril buffer) ends the check there: the module's context ends there too."""
    def reads(n: fx.Node):  # type_as(x, h) reads h's dtype alone (Meta Llama's mask.type_as(h)), not its values
        return [n.args[0]] if n.target is aten.type_as.default else n.all_input_nodes

    nodes, todo = {mask}, [mask]  # everything the mask is computed from, shape reads included
    while todo:
        for a in reads(todo.pop()):
            if a not in nodes:
                nodes.add(a)
                todo.append(a)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sub, env = fx.Graph(), {}
    for node in sorted(nodes, key=order.get):
        if node.op == "placeholder":
            if node is not input_ids:
                return False
            env[node] = sub.placeholder("input_ids")
            continue
        if node.op not in ("call_function", "get_attr"):
            return False
        if input_ids in node.all_input_nodes and node.target is not aten.sym_size.int:
            return False  # depends on token values, not just the length
        if node.target is aten.type_as.default:
            env[node] = sub.call_function(aten._to_copy.default, (env[node.args[0]],),
                                          {"dtype": node.args[1].meta["val"].dtype})
            continue
        env[node] = sub.node_copy(node, lambda a: env[a])
    if input_ids not in env:
        env[input_ids] = sub.placeholder("input_ids")
    sub.output(env[mask])
    module = fx.GraphModule(gm, sub)
    def evaluate(n: int):  # the mask at length n, or None where the module cannot make an [n, n] one
        try:
            with torch.no_grad():
                m = module(torch.zeros(1, n, dtype=torch.long))
        except Exception:  # noqa: BLE001 - a mask we cannot evaluate is not one we can replace
            return None
        return m.reshape(-1, n, n) if m.dim() >= 2 and m.shape[-2:] == (n, n) else None

    def causal(m, n: int) -> bool:
        tril = torch.ones(n, n, dtype=torch.bool).tril()
        if m.dtype == torch.bool:
            return bool((m == tril).all())
        # additive: 0 where visible, very negative elsewhere
        return m.is_floating_point() and bool(((m == 0) == tril).all() and (m[:, ~tril] <= -1e4).all())

    good = 0  # the longest length checked
    for n in (1, 2, 5, 64, 512, 4097):  # 4097: a window of 4096 (Mistral's) shows there
        m = evaluate(n)
        if m is None:
            if n <= 5:
                return False
            # the module's context ends between `good` and n (a mask cut from a table): its longest mask is checked
            # too, or a window narrower than the table (tril & triu in a buffer) would pass as causal
            while n - good > 1:  # bisect: `good` evaluates, n does not
                mid = (good + n) // 2
                if evaluate(mid) is None:
                    n = mid
                else:
                    good = mid
            return causal(evaluate(good), good)
        if not causal(m, n):
            return False
        good = n
    return True


class ExplicitPositions(Pass):
    """Positions 0..seq-1 computed in the graph -> the position_ids input.

    Two patterns, both found by op and shape:
      arange(seq) / arange(0, seq) / arange(0, seq, 1)   (learned position embedding lookup,
                                                          or rotary angles outer(arange, inv_freq))
      slice(table, 0, 0, seq)                             (a precomputed table cut to the length,
                                                          e.g. gpt-fast's freqs_cis[:seq])
      slice(param, 1, 0, seq) of a [1, positions, C] one  (minGPT's pos_emb[:, :t, :])

    before:  pos = arange(sym_size(input_ids, 1));  wpe = embedding(wpe_weight, pos)
    after:   pos = select(position_ids, 0, 0);      wpe = embedding(wpe_weight, pos)
             (one `pos` for all uses, followed by `to(dtype)` where the arange was not int64;
              a sliced table becomes index_select(table, dim, pos))
    Runs after CachedAttention, whose mask builds aranges of its own (tagged, so left alone).
    """

    name = "explicit_positions"

    def check(self, pg: PlainGraph) -> None:
        self.aranges, self.slices = [], []
        for node in pg.graph.nodes:
            if node.meta.get(ADDED) or not node.users:
                continue
            if node.target in ARANGE_OPS and self._is_position_arange(node, pg.seq):
                self.aranges.append(node)
            elif node.target is aten.slice.Tensor and self._is_table_slice(node, pg.seq):
                self.slices.append(node)
        if not self.aranges and not self.slices:
            raise UnsupportedModelError(
                "no positions found in the exported module: speccomp looks for torch.arange over the sequence length "
                "(learned position embeddings, rotary angles) or a table sliced to it (table[:seq], or pos[:, :seq] of "
                "a [1, positions, C] parameter); a module without position-dependent ops cannot place tree tokens at "
                "their depth"
            )

    @staticmethod
    def _is_position_arange(node, seq) -> bool:
        shape = tshape(node)
        if shape is None or len(shape) != 1 or not is_seq(shape[0], seq):
            return False
        if node.target is aten.arange.default:
            return True
        step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
        return node.args[0] == 0 and step == 1

    @staticmethod
    def _is_table_slice(node, seq) -> bool:
        table, _, start, end, step = (list(node.args) + [None] * 5)[:5]
        while isinstance(table, fx.Node) and table.op == "call_function" and table.target in _MOVES:
            table = table.args[0]  # Meta Llama's self.freqs_cis.to(h.device)[:seqlen]: the same stored table
        return (isinstance(table, fx.Node) and table.op == "get_attr" and _position_dim(node) is not None
                and start in (None, 0) and step in (None, 1) and is_seq(end, seq))

    def rewrite(self, pg: PlainGraph) -> None:
        graph = pg.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(self.aranges + self.slices, key=order.get)
        with graph.inserting_before(first):  # one [q] view of position_ids for every use
            pos = _mark(graph.call_function(aten.select.int, (pg.inputs["position_ids"], 0, 0)), self.name, like=first)
        for node in self.aranges:
            dtype = val(node).dtype
            new = pos
            if dtype != torch.long:
                with graph.inserting_before(node):
                    new = _mark(graph.call_function(aten.to.dtype, (pos, dtype)), self.name, like=node)
            for user in node.users:
                if user.target is aten.embedding.default and user.args[0].op == "get_attr":
                    pg.position_tables.append(tshape(user.args[0])[0])  # a learned position table bounds the context
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        for node in self.slices:
            table, dim = node.args[0], _position_dim(node)
            with graph.inserting_before(node):
                rows = _mark(graph.call_function(aten.index_select.default, (table, dim, pos)), self.name, like=node)
            node.replace_all_uses_with(rows)
            graph.erase_node(node)
            pg.position_tables.append(tshape(table)[dim])


def _position_dim(table_slice: fx.Node) -> int | None:
    """The dim a position table is sliced on: 0 (`table[:seq]`), or 1 of a [1, positions, C] parameter
    (minGPT's `pos_emb[:, :t, :]`); None for any other slice (a [1, 1, T, T] mask buffer's rows are not positions)."""
    shape = tshape(table_slice.args[0])
    dim = table_slice.args[1] if len(table_slice.args) > 1 else 0
    if dim == 0 or (dim == 1 and shape is not None and len(shape) == 3 and shape[0] == 1):
        return dim
    return None


# ops that hand a stored table on unchanged in value (a device move, a copy)
_MOVES = (aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.alias.default, aten.clone.default)


class ConventionOutputs(Pass):
    """Output (logits,) -> (logits, new_kv, hidden).

    new_kv stacks the keys/values CachedAttention found (the cache layout, not the repeated heads);
    hidden is the input of the LM head: the matmul the logits come from, followed up through
    views to the [1, q, H] tensor.

    before:  return (lm_head_linear,)
    after:   new_kv = stack([stack([k_0, v_0]), ..., stack([k_L-1, v_L-1])])   # [L, 2, 1, Hkv, q, D]
             return (lm_head_linear, new_kv, final_norm_out)
    """

    name = "convention_outputs"

    def check(self, pg: PlainGraph) -> None:
        flat = pg.graph.output_node().args[0]
        tensors = [a for a in ((flat,) if isinstance(flat, fx.Node) else flat) if isinstance(a, fx.Node)]
        if len(tensors) != 1:
            raise UnsupportedModelError(
                f"the module returns {len(tensors)} tensors; a plain causal LM must return the logits "
                "(a tuple's first element, or `.logits`, is taken)"
            )
        logits = tensors[0]
        shape = tshape(logits)
        if shape is None or len(shape) != 3 or shape[0] != 1:
            raise UnsupportedModelError(f"the module returns shape {shape}; logits must be [1, seq, vocab]")
        if not is_seq(shape[1], pg.seq):
            raise UnsupportedModelError(
                f"the module returns logits of shape {shape}, not one row per input token; speccomp needs logits for "
                "every position (e.g. do not cut to the last position when no targets are given)"
            )
        if not pg.slots:
            raise GraphStructureError("no cached K/V recorded; run CachedAttention before ConventionOutputs")
        self.logits = logits
        self.hidden = _lm_head_input(logits, pg.inputs["input_ids"], pg.seq)

    def rewrite(self, pg: PlainGraph) -> None:
        graph = pg.graph
        out = graph.output_node()
        with graph.inserting_before(out):
            layers = []
            for slot in pg.slots:
                pair = graph.call_function(aten.stack.default, ([slot.key, slot.value], 0))
                layers.append(_mark(pair, self.name, root_of=slot.sdpa))
            new_kv = _mark(graph.call_function(aten.stack.default, (layers, 0)), self.name, root_of=pg.slots[0].sdpa)
        out.args = ((self.logits, new_kv, self.hidden),)


def _lm_head_input(logits: fx.Node, input_ids: fx.Node, seq) -> fx.Node:
    """Walk up from the logits to the LM head matmul; its activation operand, as [1, q, H]."""
    node = logits
    for _ in range(32):
        if node.target in MATMUL_OPS:
            break
        deps = [a for a in node.all_input_nodes if depends_on(a, input_ids)]
        if len(deps) != 1:
            raise UnsupportedModelError(f"cannot follow the logits back to the LM head matmul (stuck at {node.name})")
        node = deps[0]
    else:
        raise UnsupportedModelError("no LM head matmul found above the logits")
    acts = [a for a in node.all_input_nodes if depends_on(a, input_ids)]
    if len(acts) != 1:
        raise UnsupportedModelError(f"the LM head {node.name} has {len(acts)} activation operands, expected 1")
    hidden = acts[0]
    for _ in range(8):
        shape = tshape(hidden)
        if shape is not None and len(shape) == 3 and shape[0] == 1 and is_seq(shape[1], seq):
            return hidden
        if hidden.target not in PASS_THROUGH_OPS:
            break
        hidden = hidden.args[0]
    raise UnsupportedModelError(
        f"the LM head input {acts[0].name} has shape {tshape(acts[0])}; expected the final hidden state [1, seq, hidden]"
    )


PASSES = (AddConventionInputs, CachedAttention, ExplicitPositions, ConventionOutputs)
