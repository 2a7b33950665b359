"""ONNX backend: export a captured (or rewritten) graph to ONNX and run it with ONNX Runtime.

    path = export_onnx(spec_graph, "model.onnx")            # or a CapturedModel / GraphModule + kv_spec
    step = OrtStep(path)                                     # CPU execution provider by default
    logits, new_kv, hidden = step(input_ids, position_ids, attention_mask, past_kv)

The ONNX model keeps the captured graph's calling convention (speccomp/frontend/convention.py): inputs
`input_ids, position_ids, attention_mask, past_kv`, outputs `logits, new_kv, hidden`, with the
dynamic axes

    q            input_ids / position_ids dim 1, logits / new_kv / hidden token dim
    past         past_kv dim 4
    past_plus_q  attention_mask dim 1; exported as Dim.AUTO so torch.export derives whatever tie the
                 graph makes to past and q (a separately named Dim would clash with it). Callers
                 pass past + q, as for the captured graph.

so one file serves prefill (past = 0), decode (q = 1) and tree verification (q = tree size), and
`OrtStep` can be the target of speccomp/runtime/decode.py's loop like any other `step`.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.fx.experimental._config as fx_config
from torch import fx
from torch.export import Dim

from speccomp.frontend.convention import INPUT_NAMES, OUTPUT_NAMES, CapturedModel, KVSpec, example_inputs
from speccomp.errors import SpeccompError

_EXAMPLE_Q, _EXAMPLE_PAST = 3, 7  # distinct sizes, none 0 or 1, so export cannot confuse or specialise them


class OnnxBackendError(SpeccompError, RuntimeError):
    """ONNX export or ONNX Runtime is unavailable or failed; the message names the fix."""


def _unpack(obj, kv_spec: KVSpec | None):
    """(GraphModule, KVSpec, vocab size) from a SpecGraph, a CapturedModel or a bare GraphModule."""
    captured = obj if isinstance(obj, CapturedModel) else getattr(obj, "captured", None)  # a SpecGraph's
    if captured is not None:
        return captured.graph_module, kv_spec or captured.kv, captured.vocab_size
    if isinstance(obj, fx.GraphModule):
        if kv_spec is None:
            raise TypeError("export_onnx of a bare GraphModule needs kv_spec= (CapturedModel.kv) to build example inputs")
        return obj, kv_spec, 2
    raise TypeError(f"export_onnx expects a SpecGraph, CapturedModel or torch.fx.GraphModule, got {type(obj).__name__}")


def export_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the graph ready for re-export; shares the weights with `gm`, which is left untouched.

    Drops what `ExportedProgram.module()` added for Python execution and that ONNX has no use for:
    the `_guards_fn` input-guard call (capture already checked its guards) and the
    `aten._assert_tensor_metadata` checks. The copy is a plain GraphModule, so `.eval()` works
    (the unlifted module refuses `train()`/`eval()`).
    """
    graph = copy.deepcopy(gm.graph)
    for node in list(graph.nodes):
        guards = node.op == "call_module" and str(node.target).startswith("_guards_fn")
        if not node.users and (guards or node.target is torch.ops.aten._assert_tensor_metadata.default):
            graph.erase_node(node)
    graph.lint()
    return fx.GraphModule(gm, graph).eval()  # copies only the attributes the graph references (weights shared)


def _dynamic_shapes(names: list[str]):
    q = Dim("q", min=1)
    # attention_mask = past + q: Dim.AUTO, so export derives it (an independent Dim would conflict)
    known = {"input_ids": {1: q}, "position_ids": {1: q}, "attention_mask": {1: Dim.AUTO},
             "past_kv": {4: Dim("past", min=0)}}
    return tuple(known[n] for n in names)


def _name_mask_axis(program, names: list[str]) -> None:
    """Give the mask length (a Dim.AUTO symbol such as `s53`) a readable name in the ONNX file."""
    if "attention_mask" not in names:
        return
    dim = program.model.graph.inputs[names.index("attention_mask")].shape[1]
    value = getattr(dim, "value", None)
    if isinstance(value, str) and value.isidentifier() and value not in ("q", "past"):
        program.rename_axes({dim: "past_plus_q"})


# onnxscript rewrite rules left out of the optimiser: `SlicesSplit` matches *pairs* of Slice nodes
# on the same input, which is quadratic in the slices the flat graph takes of `past_kv` and the
# rotary halves (≈45 s per sweep on SmolLM2-135M, for a Split ONNX Runtime does not need).
SLOW_REWRITE_RULES = ("SlicesSplit",)


@contextlib.contextmanager
def _without_slow_rewrites():
    """Run torch.onnx's own optimiser (onnxscript `optimize_ir` + fusions) minus SLOW_REWRITE_RULES."""
    try:
        from onnxscript import rewriter
        rules = rewriter._DEFAULT_REWRITE_RULES
    except (ImportError, AttributeError):  # another onnxscript layout: run its optimiser unchanged
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in rules if getattr(r, "name", None) not in SLOW_REWRITE_RULES)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


def _input_names(gm, given: bool) -> list[str]:
    """The graph's inputs: the calling convention's, then any a pass added (which need example_args= and
    dynamic_shapes=, `given`)."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    extra = [n for n in names if n not in INPUT_NAMES]
    if extra and not given:
        raise OnnxBackendError(
            f"the graph has inputs {extra} beyond {list(INPUT_NAMES)}; pass example_args= and dynamic_shapes= "
            "for all inputs in order"
        )
    if list(names[: len(INPUT_NAMES)]) != list(INPUT_NAMES) and not extra:
        raise OnnxBackendError(f"graph inputs {names} are not {list(INPUT_NAMES)}; was it captured by speccomp.capture?")
    return names


def export_onnx(graph_module_or_specgraph, path, *, kv_spec: KVSpec | None = None, external_data: bool | None = None,
                example_args: tuple | None = None, dynamic_shapes: tuple | None = None, verbose: bool = False) -> Path:
    """Export the graph to an ONNX file at `path` with `torch.onnx.export(..., dynamo=True)`; returns `path`.

    `graph_module_or_specgraph`: a SpecGraph, a CapturedModel, or the flat GraphModule itself (then `kv_spec`
    is required). `external_data`: None keeps the weights inside
    the .onnx unless they exceed protobuf's 2 GB limit, True writes them to `<name>.onnx.data` next to it.
    The onnxscript optimiser runs on the result. Graphs with inputs beyond the four of the calling convention
    (added by passes) need `example_args` and `dynamic_shapes` (a tuple in input order, as for `torch.export`).
    It re-exports under `backed_size_oblivious` as capture does, so no size is specialised to 0 or 1.
    """
    try:
        import onnxscript  # noqa: F401  (torch.onnx's dynamo exporter is built on it)
    except ImportError as exc:
        raise OnnxBackendError("ONNX export needs onnxscript and onnx: pip install onnx onnxscript") from exc
    gm, kv, vocab = _unpack(graph_module_or_specgraph, kv_spec)
    gm = export_copy(gm)
    names = _input_names(gm, given=example_args is not None and dynamic_shapes is not None)
    if example_args is None:
        example_args = example_inputs(kv, _EXAMPLE_Q, _EXAMPLE_PAST, vocab_size=vocab)
    if dynamic_shapes is None:
        dynamic_shapes = _dynamic_shapes(names)
    n_out = len(gm.graph.output_node().args[0])
    output_names = list(OUTPUT_NAMES[:n_out]) + [f"output_{i}" for i in range(len(OUTPUT_NAMES), n_out)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _without_slow_rewrites(), fx_config.patch(backed_size_oblivious=True):
        program = onnx_program(gm, example_args, "torch.onnx.export failed on the captured graph", verbose=verbose,
                               dynamic_shapes=dynamic_shapes, input_names=names, output_names=output_names)
    _name_mask_axis(program, names)
    program.save(path, external_data=external_data)
    return path


def onnx_program(module, example_args, failure: str, **options):
    """`torch.onnx.export(module, example_args, dynamo=True, optimize=True, **options)`, quiet unless
    options["verbose"]; an OnnxBackendError starting with `failure` if it fails."""
    quiet = contextlib.nullcontext() if options.get("verbose") else contextlib.redirect_stdout(io.StringIO())
    with quiet, warnings.catch_warnings(), torch.no_grad():
        # inputs share a Dim on purpose (input_ids, position_ids: `q`); torch.onnx warns that it names it once
        warnings.filterwarnings("ignore", message="# The axis name")
        warnings.filterwarnings("ignore", message="Exporting a model while it is in training mode")
        try:
            return torch.onnx.export(module, tuple(example_args), dynamo=True, optimize=True, **options)
        except Exception as exc:
            raise OnnxBackendError(f"{failure}: {_why(exc)}") from exc


def _why(exc: BaseException) -> str:
    """torch.onnx's error in one line, with its root cause (its first line alone says "Failed to convert ... Next
    steps:"); an op without an ONNX function is named, with the backends that run it."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    head = re.sub(r"\.?\s*This is step .*$", "", _first_line(exc))  # "... This is step 3/3 ... Next steps:" says nothing here
    why = head if root is exc else f"{head}: {type(root).__name__}: {_first_line(root)}"
    op = re.search(r"No ONNX function found for <OpOverload\(op='([^']+)'", str(root))
    if op:
        core = op.group(1).split(".")[0] in ("aten", "prims")
        custom = "" if core else " (a custom op, such as transformers' MoE experts)"
        why += (f" (the graph calls {op.group(1)}, which torch.onnx cannot lower to ONNX{custom}; compile with "
                "backend='eager' or 'inductor', which run it; engines need the ONNX export)")
    return why


def _first_line(exc: BaseException) -> str:
    """An error's first line, without the terminal colours torch.onnx puts in."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _as_numpy(x, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()  # .cpu() of a CPU tensor is the tensor itself: no copy
    return np.ascontiguousarray(x, dtype=dtype)


_ORT_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
              "tensor(double)": np.float64, "tensor(float16)": np.float16, "tensor(bool)": np.bool_}


QUANT_BLOCK = 128  # weights per MatMulNBits block, the quantised drafters' default (benchmarks/README: blocks of 128)
QUANT_BLOCKS = (16, 32, 64, 128, 256)  # the block sizes ONNX Runtime's MatMulNBits quantiser takes


PROTOBUF_LIMIT = 2**31 - 2**24  # a graph whose weights pass this is written with them beside it (protobuf's 2 GB)


def quantize_weights(path, bits: int = 8, block_size: int = QUANT_BLOCK) -> Path:
    """The ONNX graph at `path` with every MatMul against a constant weight turned into ONNX Runtime's `MatMulNBits`
    (blockwise symmetric int4 or int8 weights, `block_size` per block, int8 compute: accuracy_level 4), written
    beside it as NAME-int{bits}.onnx. A step then reads about an eighth (4 bits) or a quarter (8 bits) of the weight
    bytes (QuantSpec's draft model); on a CPU both run at about the same speed, and 8 bits agree with the float model
    far more often (benchmarks/README.md, "The quantized self-drafter"):

        before:  x -> MatMul(x, W: float32 [K, N])             after:  x -> MatMulNBits(x, Wq: uint8, scales)
    """
    import logging

    import onnx

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    root.handlers[:], root.level = handlers, level  # its import runs logging.basicConfig(level=INFO): undone

    if bits not in (4, 8):
        raise OnnxBackendError(f"bits={bits!r}: MatMulNBits weights are 4 or 8 bits here; pass bits=8 or bits=4")
    path = Path(path)
    model = onnx.load(os.fspath(path))
    fold_transposed_weights(model.graph)
    split_constant_gemms(model.graph)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    if not any(n.op_type == "MatMulNBits" for n in quantizer.model.model.graph.node):
        raise OnnxBackendError(f"{path.name} has no MatMul with a constant weight to quantise")
    out = path.with_name(f"{path.stem}-int{bits}.onnx")
    weights = sum(t.ByteSize() for t in quantizer.model.model.graph.initializer)  # the float embedding stays float
    quantizer.model.save_model_to_file(os.fspath(out), use_external_data_format=weights > PROTOBUF_LIMIT)  # OUT.data
    return out


def fold_transposed_weights(graph) -> int:
    """MatMul(x, Transpose(W)) with W a constant [N, K] gets its own constant W.T [K, N]: the exporter writes the LM
    head (tied to the embedding, which keeps W for its Gather) this way, and the quantizer takes only a constant
    B, so it left the largest MatMul of the graph in float32 (4.6 of 31 ms of a profiled draft step). The Transpose
    goes where nothing else reads it. Returns how many MatMuls were changed.

        before:  x -> MatMul(x, Transpose(W))              after:  x -> MatMul(x, W_transposed)
    """
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    outputs = {o.name for o in graph.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    folded = 0
    for node in list(graph.node):
        transpose = producers.get(node.input[1]) if node.op_type == "MatMul" else None
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in inits:
            continue
        perm = [list(a.ints) for a in transpose.attribute if a.name == "perm"]
        if len(inits[transpose.input[0]].dims) != 2 or perm not in ([], [[1, 0]]):
            continue
        node.input[1] = _transposed(graph, inits, transpose.input[0])
        readers[transpose.output[0]] -= 1
        if readers[transpose.output[0]] == 0 and transpose.output[0] not in outputs:
            graph.node.remove(transpose)
        folded += 1
    return folded


def _transposed(graph, inits: dict, name: str) -> str:
    """The name of constant `name`'s transpose [K, N], added to the graph's initializers once."""
    from onnx import numpy_helper

    out = f"{name}_transposed"
    if out not in inits:
        inits[out] = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(inits[name]).T), out)
        graph.initializer.append(inits[out])
    return out


def split_constant_gemms(graph) -> int:
    """Gemm(x, W, b) with W a constant becomes MatMul(x, W as [K, N]) + b: the quantizer takes only MatMuls, and the
    exporter writes a linear with a bias over 2-D input (GPT-2's Conv1D, OPT's MLP: aten.addmm) as a Gemm, so those
    weights stayed float32 (a GPT-2 "quantized" drafter had its LM head alone in 4 bits). Only the plain form
    (alpha = beta = 1, x not transposed) is split. Returns how many Gemms were.

        before:  x -> Gemm(x, W [N, K], b, transB=1)        after:  x -> MatMul(x, W.T [K, N]) -> Add(b)
    """
    from onnx import helper

    inits = {i.name: i for i in graph.initializer}
    split = 0
    for node in list(graph.node):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or node.input[1] not in inits or attrs.get("transA", 0) != 0
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            continue
        name = _transposed(graph, inits, node.input[1]) if attrs.get("transB", 0) else node.input[1]
        has_bias = len(node.input) > 2 and node.input[2] != ""
        product = f"{node.output[0]}_matmul" if has_bias else node.output[0]
        new = [helper.make_node("MatMul", [node.input[0], name], [product], name=f"{node.output[0]}_matmul")]
        if has_bias:
            new.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]],
                                        name=f"{node.output[0]}_bias"))
        at = list(graph.node).index(node)
        graph.node.remove(node)
        for i, n in enumerate(new):
            graph.node.insert(at + i, n)
        split += 1
    return split


class OrtStep:
    """An ONNX Runtime session with the captured graph's calling convention.

        step = OrtStep("model.onnx")                          # CPUExecutionProvider
        logits, new_kv, hidden = step(input_ids, position_ids, attention_mask, past_kv)

    Inputs may be torch tensors or numpy arrays; outputs are CPU torch tensors (sharing memory
    with ONNX Runtime's numpy outputs). Usable as the `step` of speccomp.runtime.decode's loops.
    """

    def __init__(self, path, providers=None, intra_op_threads: int | None = None, spin: bool = True):
        from speccomp.engine.runtime import check_session_providers, missing_provider, onnxruntime_module

        ort = onnxruntime_module(error=OnnxBackendError)
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"no ONNX model at {self.path}; create it with export_onnx")
        self.providers = list(providers or ["CPUExecutionProvider"])
        for provider in self.providers:
            message = missing_provider(ort, provider[0] if isinstance(provider, (tuple, list)) else provider)
            if message:
                raise OnnxBackendError(message)
        options = ort.SessionOptions()
        if intra_op_threads is None:
            intra_op_threads = torch.get_num_threads()
        if intra_op_threads:
            options.intra_op_num_threads = intra_op_threads
        if not spin:  # idle pool threads sleep between runs (backends.lower's `spin`)
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(os.fspath(self.path), sess_options=options, providers=self.providers)
        self.spin, self.threads = spin, intra_op_threads
        # what the session really runs on: ONNX Runtime falls back to CPU without a word when a GPU provider fails
        self.providers = check_session_providers(self.session, self.providers, self.path.name, OnnxBackendError)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.input_types = [_ORT_TYPES.get(i.type) for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def __call__(self, *inputs):
        if len(inputs) != len(self.input_names):
            raise TypeError(f"{self.path.name} takes {len(self.input_names)} inputs {self.input_names}, got {len(inputs)}")
        feeds = {name: _as_numpy(x, t) for name, x, t in zip(self.input_names, inputs, self.input_types)}
        outputs = self.session.run(self.output_names, feeds)
        return tuple(torch.from_numpy(o) for o in outputs)

    def __repr__(self) -> str:
        return f"OrtStep({str(self.path)!r}, providers={self.providers})"
