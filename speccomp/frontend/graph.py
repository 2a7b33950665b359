"""The captured graph, the model structure found in it, and the pass driver.

`annotate` finds, in a captured graph, the pieces every pass talks about:

    embedding ─► layer 0 ─► layer 1 ─► ... ─► layer L-1 ─► final norm ─► lm head ─► logits
                 entry/exit on the residual stream      (hidden output)
                 attention site: sdpa | eager softmax, with its mask, K cat, V cat

It reads `node.meta["nn_module_stack"]` (which module a node came from) and op patterns
(`aten.embedding`, `aten.scaled_dot_product_attention`, `softmax`, `cat(past, new)`), never
model class names, so the same code finds Llama's `model.layers.3` and GPT-2's `transformer.h.3`.

`run_passes` applies passes one by one, lints the graph after each, and with
`SPECCOMP_DEBUG=1` dumps the graph after each pass (see `dump`).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx

from speccomp.frontend.convention import INPUT_NAMES, CapturedModel
from speccomp.errors import GraphStructureError, UnsupportedModelError

aten = torch.ops.aten
SDPA_OPS = {
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
}
SOFTMAX_OPS = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
MATMUL_OPS = {aten.linear.default, aten.matmul.default, aten.mm.default, aten.addmm.default, aten.bmm.default}
if hasattr(torch.ops.mkldnn, "_linear_pointwise"):  # what passes/prepack_linear.py lowers linear to
    MATMUL_OPS.add(torch.ops.mkldnn._linear_pointwise.default)
WRAPPER_PREFIX = "model."  # capture wraps the HF model as `_HFStep.model`


# ---- Small node helpers --------------------------------------------------------------
def module_paths(node: fx.Node) -> list[str]:
    """Modules a node came from, outermost first, as the user's model names them."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path.removeprefix(WRAPPER_PREFIX) for path, _ in stack.values()]


def module_path(node: fx.Node) -> str:
    """Innermost module a node came from ('' for top level)."""
    paths = module_paths(node)
    return paths[-1] if paths else ""


def shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _shape_only(node: fx.Node) -> bool:
    return node.target in (aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int)


def ancestors(node: fx.Node, stop=lambda n: False) -> set[fx.Node]:
    """Nodes whose *values* flow into `node` (shape reads like sym_size do not count)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if _shape_only(n):
            continue
        for a in n.all_input_nodes:
            if a not in seen and not stop(a):
                seen.add(a)
                todo.append(a)
    return seen


def copy_meta(new: fx.Node, old: fx.Node) -> fx.Node:
    """New nodes keep the provenance of the node they replace (module stack, source trace)."""
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
    return new


# ---- Structure -----------------------------------------------------------------------
@dataclass
class AttentionSite:
    node: fx.Node  # the sdpa call, or the softmax of an eager attention
    kind: str  # "sdpa" | "eager"
    layer: int  # cache layer index (from past_kv[layer])
    module: str  # module path, e.g. "model.layers.3.self_attn"
    mask: fx.Node | None  # bool (sdpa) or additive float (eager) mask, [1|b, 1|H, q, past+q]
    key_cat: fx.Node  # cat(past_k, new_k)
    value_cat: fx.Node  # cat(past_v, new_v)
    sliding_window: int | None = None
    mask_user: fx.Node | None = None  # the node that consumes `mask` (the sdpa call, or the add of an eager attention)

    def __post_init__(self):
        if self.mask_user is None:
            self.mask_user = self.node


@dataclass
class Layer:
    index: int
    module: str  # e.g. "model.layers.3"
    entry: fx.Node  # residual stream into the layer
    exit: fx.Node  # residual stream out of the layer


@dataclass
class Structure:
    inputs: dict[str, fx.Node]
    embedding: fx.Node
    layers: list[Layer]
    attention: list[AttentionSite]
    final_norm: str | None  # module path of the final norm (None: a post-LN model, whose blocks end normalised)
    final_hidden: fx.Node
    lm_head: fx.Node  # the matmul/linear that produces the logits
    lm_head_module: str
    logits: fx.Node
    new_kv: fx.Node

    def summary(self) -> str:
        kinds = Counter(s.kind for s in self.attention)
        windows = sorted({s.sliding_window for s in self.attention if s.sliding_window})
        return (f"embedding={module_path(self.embedding)} layers={len(self.layers)} attention={dict(kinds)} "
                f"sliding_windows={windows or None} final_norm={self.final_norm} lm_head={self.lm_head_module}")


def _placeholders(graph: fx.Graph) -> dict[str, fx.Node]:
    return {n.name: n for n in graph.nodes if n.op == "placeholder"}


def _cache_slot(cat: fx.Node, past_kv: fx.Node) -> tuple[int, int] | None:
    """(layer, 0=key|1=value) if `cat` is cat([past_kv[layer, kv], new], -2)."""
    if cat.target is not aten.cat.default:
        return None
    idx, node = [], cat.args[0][0]
    while isinstance(node, fx.Node) and node.target is aten.select.int:
        idx.append(node.args[2])
        node = node.args[0]
    if node is not past_kv or len(idx) < 2:
        return None
    layer, kv = idx[-1], idx[-2]  # innermost select is past_kv[layer], then [kv]
    return int(layer), int(kv)


def _find_cat(start: fx.Node, past_kv: fx.Node) -> tuple[fx.Node, int, int]:
    """The nearest cat(past_kv[l, kv], new) above `start` (breadth-first, so an earlier layer's cache read,
    reachable through the residual stream, is never mistaken for this one)."""
    frontier, seen = [start], {start}
    while frontier:
        nxt = []
        for node in frontier:
            slot = _cache_slot(node, past_kv)
            if slot is not None:
                return node, slot[0], slot[1]
            for a in node.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    nxt.append(a)
        frontier = nxt
    raise GraphStructureError(f"no cat(past, new) cache read found above {start.name}")


def _eager_attention(softmax: fx.Node, past_kv: fx.Node, attention_mask: fx.Node):
    """For softmax(QK^T*s + mask) @ V: the mask operand, the K cat and the V cat."""
    scores = softmax.args[0]
    # walk down dtype casts / dropout to the matmul with V
    user = softmax
    for _ in range(6):
        users = [u for u in user.users if u.op == "call_function" and u.users]  # skip metadata asserts
        mm = [u for u in users if u.target in MATMUL_OPS]
        if mm:
            user = mm[0]
            break
        if not users:
            return None
        user = users[0]
    else:
        return None
    value_cat = _find_cat(user.args[1], past_kv)[0]
    key_cat, layer_k, _ = _find_cat(scores, past_kv)
    mask = mask_user = None
    node = scores
    for _ in range(8):  # follow the score chain through adds; the mask is the add operand fed by the padding mask
        if node.target in (aten.add.Tensor, aten.add_.Tensor):
            for arg in node.args:
                if isinstance(arg, fx.Node) and attention_mask in ancestors(arg) and past_kv not in ancestors(arg):
                    mask, mask_user = arg, node
            if mask is not None:
                break
        nxt = [a for a in node.args if isinstance(a, fx.Node) and past_kv in ancestors(a) | {a}]
        if not nxt:
            break
        node = nxt[0]
    return mask, mask_user, key_cat, value_cat, layer_k


RESHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
               aten.squeeze.dim, aten.flatten.using_ints, aten.clone.default, aten.alias.default}


def _reshaped_from(node, source: fx.Node) -> bool:
    """`node` is `source` itself or `source` through shape-only ops (GPT-2 and OPT view input_ids as [-1, q])."""
    while isinstance(node, fx.Node):
        if node is source:
            return True
        if node.target not in RESHAPE_OPS:
            return False
        node = node.args[0]
    return False


def _decoder_layer_path(node: fx.Node) -> str | None:
    """Outermost enclosing module whose last path component is an index: a block of a ModuleList."""
    for path in module_paths(node):
        if path and path.rsplit(".", 1)[-1].isdigit():
            return path
    return None


def annotate(captured: CapturedModel) -> Structure:
    """Find the model's structure in the captured graph, or fail naming the model and what is missing."""
    try:
        return _structure(captured)
    except UnsupportedModelError as e:  # the graph's own words ("decoder block model.layers.0 ...") lack the model
        raise UnsupportedModelError(f"{captured.model_type}: {e}; speccomp finds no decoder-only structure it can "
                                    "rewrite in this model's captured graph") from e


def _structure(captured: CapturedModel) -> Structure:
    graph = captured.graph_module.graph
    inputs = _placeholders(graph)
    missing = [n for n in INPUT_NAMES if n not in inputs]
    if missing:
        raise GraphStructureError(f"graph inputs {missing} are missing; was it captured by speccomp.capture?")
    embeddings = [n for n in graph.nodes
                  if n.target is aten.embedding.default and _reshaped_from(n.args[1], inputs["input_ids"])]
    if not embeddings:
        raise UnsupportedModelError("no token embedding (aten.embedding of input_ids) found in the captured graph")
    sites = _attention_sites(captured, inputs["past_kv"], inputs["attention_mask"])
    order = {n: i for i, n in enumerate(graph.nodes)}
    logits, new_kv, final_hidden = graph.output_node().args[0][:3]
    layers = _decoder_layers(graph, sites, embeddings[0], final_hidden, order)
    last = order[layers[-1].exit]
    # LM head: the last matmul on the way from the final hidden state to the logits
    head = next((n for n in sorted(ancestors(logits) | {logits}, key=order.get, reverse=True)
                 if n.target in MATMUL_OPS and order[n] > last), None)
    if head is None:
        raise UnsupportedModelError("no LM head (a matmul producing the logits) found after the last decoder block")
    norm_paths = [p for n in graph.nodes if last < order[n] <= order[final_hidden] and (p := module_path(n))]
    return Structure(inputs=inputs, embedding=embeddings[0], layers=layers, attention=sites,
                     final_norm=Counter(norm_paths).most_common(1)[0][0] if norm_paths else None,
                     final_hidden=final_hidden,
                     lm_head=head, lm_head_module=module_path(head), logits=logits, new_kv=new_kv)


def _attention_sites(captured: CapturedModel, past_kv, attention_mask) -> list[AttentionSite]:
    """One attention site per cache layer (SDPA, or an eager softmax over cat(past, new) keys), in layer order."""
    sites = []
    for node in captured.graph_module.graph.nodes:
        if node.target in SDPA_OPS:
            key_cat, layer, _ = _find_cat(node.args[1], past_kv)
            value_cat, _, _ = _find_cat(node.args[2], past_kv)
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            sites.append(AttentionSite(node, "sdpa", layer, module_path(node), mask, key_cat, value_cat))
        elif node.target in SOFTMAX_OPS and past_kv in ancestors(node):
            found = _eager_attention(node, past_kv, attention_mask)
            if found is not None:
                mask, mask_user, key_cat, value_cat, layer = found
                sites.append(
                    AttentionSite(node, "eager", layer, module_path(node), mask, key_cat, value_cat, mask_user=mask_user)
                )
    if not sites:
        raise UnsupportedModelError("no attention site (scaled_dot_product_attention, or softmax over cat(past, new) "
                                    "keys) found in the graph")
    if len({s.layer for s in sites}) != len(sites) or len(sites) != captured.kv.num_layers:
        raise UnsupportedModelError(f"found {len(sites)} attention sites for {captured.kv.num_layers} cache layers; "
                                    "each layer must read its own cache")
    for site in sites:
        if site.mask is None:
            raise UnsupportedModelError(f"attention in {site.module} has no explicit mask input in the graph")
        for path, window in captured.sliding_windows.items():
            if site.module == path or site.module.startswith(path + "."):
                site.sliding_window = window
    return sorted(sites, key=lambda s: s.layer)


def _decoder_layers(graph, sites: list[AttentionSite], embedding, final_hidden, order: dict) -> list[Layer]:
    """The decoder blocks around the attention sites (the indexed module of each), with their residual-stream
    entry (the previous block's exit; for the first, an activation computed from the token embedding) and exit."""
    layer_paths = []
    for site in sites:
        path = _decoder_layer_path(site.node)
        if path is None:
            raise UnsupportedModelError(f"attention {site.module} is not inside an indexed decoder block (ModuleList)")
        layer_paths.append(path)
    inside = {p: [] for p in layer_paths}
    for node in graph.nodes:
        p = _decoder_layer_path(node)
        if p in inside:
            inside[p].append(node)
    hidden_size = shape(final_hidden)[-1] if shape(final_hidden) else None

    def is_hidden(n):
        s = shape(n)
        return s is not None and len(s) == 3 and s[-1] == hidden_size and n.meta["val"].is_floating_point()

    layers, entry = [], None
    for i, path in enumerate(layer_paths):
        members = set(inside[path])
        exits = [n for n in inside[path] if is_hidden(n) and any(u not in members for u in n.users)]
        if not exits:
            raise UnsupportedModelError(f"decoder block {path} has no residual-stream output")
        if entry is None:
            # a parameter that merely has a hidden-sized last dim (a MoE's stacked expert weights [E, 2I, H]) is not
            # the residual stream: that is an activation computed from the token embedding
            external = {
                a for n in inside[path] for a in n.all_input_nodes
                if a not in members and is_hidden(a) and a.op == "call_function"
                and (a is embedding or embedding in ancestors(a))
            }
            if not external:
                raise UnsupportedModelError(f"decoder block {path} has no residual-stream input")
            entry = min(external, key=order.get)
        layers.append(Layer(i, path, entry, max(exits, key=order.get)))
        entry = layers[-1].exit
    return layers


# ---- The object passes rewrite -------------------------------------------------------
@dataclass
class SpecGraph:
    """A captured graph plus what is known about it. Passes rewrite `gm` in place."""

    captured: CapturedModel
    structure: Structure
    applied: list[str] = field(default_factory=list)
    kv_layers: list[int] = field(default_factory=list)  # cache layer of each new_kv row (passes may drop rows)
    model: object = field(default=None, repr=False, compare=False)  # the captured nn.Module (compile sets it)

    def __post_init__(self):
        if not self.kv_layers:
            self.kv_layers = list(range(self.captured.kv.num_layers))

    @property
    def gm(self) -> fx.GraphModule:
        return self.captured.graph_module

    @classmethod
    def from_captured(cls, captured: CapturedModel) -> "SpecGraph":
        return cls(captured, annotate(captured))

    def clone(self) -> "SpecGraph":
        """A copy whose graph can be rewritten independently; parameters are shared, not copied."""
        val_map: dict[fx.Node, fx.Node] = {}
        captured = self.captured.copy(val_map)
        # carry the annotation over node by node: a rewritten graph (layers skipped, say) may
        # no longer be one that `annotate` could find from scratch
        return SpecGraph(captured, _remap(self.structure, val_map), list(self.applied), list(self.kv_layers))

    def layer_of(self, node: fx.Node) -> str | None:
        """Module path of the decoder layer a node belongs to (None outside the layers)."""
        return _decoder_layer_path(node)

    def input_names(self) -> list[str]:
        return [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]

    def op_counts(self) -> Counter:
        return Counter(str(n.target) for n in self.gm.graph.nodes if n.op == "call_function")


def _remap(obj, val_map: dict):
    """A copy of an annotation with every fx.Node replaced by its copy (None where a pass removed it)."""
    if isinstance(obj, fx.Node):
        return val_map.get(obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(
            obj, **{f.name: _remap(getattr(obj, f.name), val_map) for f in dataclasses.fields(obj) if f.init}
        )
    if isinstance(obj, list):
        return [_remap(x, val_map) for x in obj]
    if isinstance(obj, dict):
        return {k: _remap(v, val_map) for k, v in obj.items()}
    return obj


class Pass:
    """One graph rewrite. Subclasses implement `check` (what they expect) and `rewrite`. After it the graph is linted
    and the attention annotation (sg.structure.attention) must still name live nodes, each site's `mask_user` reading
    its `mask`: a pass that replaces an attention call does so with speccomp.passes.replace_attention."""

    name = "pass"

    def check(self, sg: SpecGraph) -> None:  # raise GraphStructureError if the graph is not as expected
        pass

    def rewrite(self, sg: SpecGraph) -> None:
        raise NotImplementedError

    def __call__(self, sg: SpecGraph) -> SpecGraph:
        self.check(sg)
        self.rewrite(sg)
        try:
            sg.gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
            sg.gm.graph.lint()
        except (RuntimeError, AssertionError) as exc:  # FX's own message ends with the whole graph: its first line
            raise GraphStructureError(f"pass {self.name!r} left an invalid graph: "
                                      f"{str(exc).strip().splitlines()[0][:300]}") from exc
        self._check_structure(sg)
        sg.gm.recompile()
        sg.applied.append(self.name)
        return sg

    def _check_structure(self, sg: SpecGraph) -> None:
        """The attention annotation later passes rewrite by (sg.structure: each site's call, mask and the node reading
        it) must name nodes still in the graph: a pass that replaced an attention call by hand left it on erased
        nodes, and the next pass failed far away (a TypeError comparing None) or rewrote nothing."""
        live = set(sg.gm.graph.nodes)
        for site in getattr(getattr(sg, "structure", None), "attention", None) or ():  # drafter graphs have none
            for field_name in ("node", "mask", "mask_user"):
                node = getattr(site, field_name)
                if node is not None and node not in live:
                    raise GraphStructureError(
                        f"pass {self.name!r} left attention {site.module}'s `{field_name}` on {node.name}, no longer "
                        "in the graph; a pass that replaces an attention call must keep sg.structure on live nodes: "
                        "use speccomp.passes.replace_attention(sg, old, new) (or set the site's fields itself)")
            if site.mask is not None and site.mask not in site.mask_user.all_input_nodes:
                raise GraphStructureError(
                    f"pass {self.name!r} left attention {site.module}'s mask_user {site.mask_user.name} not reading "
                    f"its mask {site.mask.name}: a later mask rewrite (TreeAttention) would change nothing")


def _is_impure(node: fx.Node) -> bool:
    """Metadata asserts die with the values they check; attention and dropout that draw no random numbers
    die when unused; everything else as FX decides."""
    if node.target is aten._assert_tensor_metadata.default:
        return False
    if node.op == "call_module" and node.target == "_guards_fn":
        return True  # export's input guards stay
    if node.op == "call_function" and _draws_nothing(node):
        return False
    return node.is_impure()


def _argument(node: fx.Node, name: str, default=None):
    """The value of argument `name` of an aten call (positional or keyword), or `default`."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if name in names and names.index(name) < len(node.args):
        return node.args[names.index(name)]
    return default


DROPOUT_OPS = {aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default}


def _draws_nothing(node: fx.Node) -> bool:
    """True for an op FX counts as random (tag nondeterministic_seeded: never dead code to FX) that draws
    nothing here: SDPA with dropout_p = 0 (every capture, eval mode) and dropout with p = 0 or train=False.

    Without this, a self-drafter's skipped layers kept their whole attention (norm, q/k/v projections,
    rotary, cache read, SDPA) as dead code that still ran: FX's DCE keeps every 'random' op, used or not."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if target in SDPA_OPS:
        return _argument(node, "dropout_p", 0.0) == 0.0
    if target in DROPOUT_OPS:
        return _argument(node, "train", True) is False or _argument(node, "p", 0.5) == 0.0
    return False


def run_passes(sg: SpecGraph, passes, dump_input: bool = True) -> SpecGraph:
    if dump_input:
        dump(sg, "captured")
    for p in passes:
        p(sg)
        dump(sg, p.name)
    return sg


_DUMP_DIRS: dict = {}  # SPECCOMP_DEBUG_DIR -> (the folder this process dumps into, its dump counter); None: failed


def _debug_dir_setting() -> str:
    """SPECCOMP_DEBUG_DIR as an absolute path (a relative one is where the process was when it dumped first: after a
    chdir it is another folder, with a run of its own)."""
    return str(Path(os.environ.get("SPECCOMP_DEBUG_DIR") or "speccomp_debug").expanduser().absolute())


def dump_folder() -> Path | None:
    """The folder this process's SPECCOMP_DEBUG dumps went to for the SPECCOMP_DEBUG_DIR now set: the folder itself,
    or a run-N folder inside it where it already held files (`dump`); None before the first dump or where it could
    not be written."""
    chosen = _DUMP_DIRS.get(_debug_dir_setting())
    return chosen[0] if chosen else None


def dump(sg: SpecGraph, stage: str) -> None:
    """With SPECCOMP_DEBUG=1: print a one-line summary per stage and write the graph's code.

    Files go to $SPECCOMP_DEBUG_DIR (default ./speccomp_debug) as NN_<passes applied so far>.py, NN counting
    every dump of the process (a compile dumps the drafter's graphs, then the target's, each after every pass,
    lowering passes included: 00_captured.py, 01_early_exit.py, 02_early_exit+tree_attention.py, ...,
    06_captured.py, 07_tree_attention.py, ...), so a newcomer can diff what each pass changed. A process whose folder
    already holds files (an earlier run's, or anyone's) writes into a fresh run-N folder inside it: no file is ever
    overwritten, and one run's dumps are not mixed with another's. A folder that cannot be written is said once and
    the compile goes on without dumps."""
    if os.environ.get("SPECCOMP_DEBUG", "0").strip().lower() in ("", "0", "false", "off", "no"):
        return
    chosen = _dump_dir()
    if chosen is None:
        return
    out, index = chosen[0], next(chosen[1])
    name = "+".join(sg.applied) or stage
    name = name if len(name) <= 80 else f"{len(sg.applied)}_passes_to_{sg.applied[-1][:60]}"  # names have a limit
    path = out / f"{index:02d}_{''.join(c if c.isalnum() or c in '+._-' else '_' for c in name)}.py"
    try:
        with open(path, "x") as f:  # "x": never over a file (a name made twice in one run is a pass named alike)
            f.write(sg.gm.code)
    except OSError as exc:
        again = isinstance(exc, FileExistsError)  # a name made twice: only this dump is lost; else the folder is
        print(f"[speccomp] SPECCOMP_DEBUG: could not write {path} ({exc.strerror or exc}); "
              f"{'not dumped' if again else 'compiling without dumps'}", file=sys.stderr)
        if not again:
            _DUMP_DIRS[_debug_dir_setting()] = None  # said once
        return
    counts, inputs = SpecGraph.op_counts(sg), SpecGraph.input_names(sg)  # they read sg.gm only: a PlainGraph's too
    top = ", ".join(f"{k.split('.')[-2] if '.' in k else k}={v}" for k, v in counts.most_common(6))
    print(f"[speccomp] {index:02d} {stage:<18} nodes={len(sg.gm.graph.nodes):<5} inputs={inputs} "
          f"{top} -> {path}", file=sys.stderr)


def _dump_dir():
    """(the folder of this process's dumps, its counter) for the SPECCOMP_DEBUG_DIR now set (see `dump`), made at its
    first dump; None where it cannot be."""
    given = _debug_dir_setting()
    if given not in _DUMP_DIRS:
        root = Path(given)
        try:
            root.mkdir(parents=True, exist_ok=True)
            out = root
            if any(root.iterdir()):  # someone's files, or an earlier run's dumps: a run folder of its own
                k = 1
                while True:
                    try:
                        (out := root / f"run-{k}").mkdir()
                        break
                    except FileExistsError:
                        k += 1
            _DUMP_DIRS[given] = (out, itertools.count())
        except OSError as exc:
            print(f"[speccomp] SPECCOMP_DEBUG: cannot write graph dumps to SPECCOMP_DEBUG_DIR={given!r} "
                  f"({exc.strerror or exc}); set it to a writable folder. Compiling without dumps", file=sys.stderr)
            _DUMP_DIRS[given] = None
    return _DUMP_DIRS[given]
