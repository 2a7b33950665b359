"""ONNX Runtime with the KV cache written in place (passes/ort_attention.py's graphs).

    step = lower_onnxruntime(sg)   # an OrtKVStep where OrtAttention applies
    logits, new_kv, hidden = step(input_ids, position_ids, attention_mask, past_kv, tree_mask)

The exported graph takes one layer of the cache per input (`past_key_l`, `past_value_l`: [1, Hkv, capacity, D])
and returns `present_key_l`, ... `OrtKVStep` binds both to the same memory, one layer of the runtime's
preallocated buffer (speccomp/runtime/decode.py `KVCache`, flagged `KV_ROOM`), so ONNX Runtime's
GroupQueryAttention reads the past where it lies and writes only this step's entries, at slots [past, past + q)
(the same slots the loop's commit then fills with the accepted ones). The caller keeps the calling convention:
`past_kv` is a view `data[..., :past, :]` of that buffer. Any other `past_kv` (a compressed cache, a user's
tensor) is copied into a scratch buffer first: correct, and as slow as the plain export.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch.export import Dim

from speccomp.backends.onnx_export import _EXAMPLE_PAST, _EXAMPLE_Q, OrtStep
from speccomp.engine.runtime import LayerBindings
from speccomp.passes.inplace_kv import free_room

_ONNX_INT32 = 6
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16}  # cache dtypes the fused op runs on the CPU


def _schema():
    """The part of ONNX Runtime's GroupQueryAttention schema used here (onnx registers none for contrib ops, and
    onnxscript builds a node only from a schema)."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    optional = OpSchema.FormalParameterOption.Optional
    names = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache",
             "sin_cache", "position_ids", "attention_bias")
    types = {"seqlens_k": "M", "total_sequence_length": "M", "position_ids": "P"}
    inputs = [param(n, types.get(n, "T"), "", param_option=optional if i > 6 else OpSchema.FormalParameterOption.Single)
              for i, n in enumerate(names)]
    outputs = [param(n, "T", "") for n in ("output", "present_key", "present_value")]
    attr = OpSchema.Attribute
    return OpSchema(
        "GroupQueryAttention", "com.microsoft", 1, inputs=inputs, outputs=outputs,
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("M", ["tensor(int32)"], ""), ("P", ["tensor(int64)"], "")],
        attributes=[attr("num_heads", OpSchema.AttrType.INT, ""), attr("kv_num_heads", OpSchema.AttrType.INT, ""),
                    attr("scale", OpSchema.AttrType.FLOAT, ""), attr("causal", OpSchema.AttrType.INT, "")])


def translation_table() -> dict:
    """torch.onnx's custom translation: speccomp::group_query_attention -> com.microsoft.GroupQueryAttention."""
    import onnxscript
    from onnxscript import opset18 as op

    fused = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "GroupQueryAttention", _schema())

    def gqa(query, key, value, past_key, past_value, bias, num_heads: int, kv_num_heads: int, scale: float):
        total = op.Shape(bias, start=3)  # [1]: past + q, the keys this step attends over
        seqlens_k = op.Cast(op.Sub(total, op.Constant(value_ints=[1])), to=_ONNX_INT32)
        return fused(
            query, key, value, past_key, past_value, seqlens_k, op.Cast(op.Squeeze(total), to=_ONNX_INT32),
            None, None, None, bias, num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, causal=0,
            _outputs=3)

    return {torch.ops.speccomp.group_query_attention.default: gqa}


def export_args(sg) -> tuple[tuple, tuple]:
    """(example_args, dynamic_shapes) for the rewritten graph: the calling convention's inputs that remain, then
    one [1, Hkv, capacity, D] buffer per layer and kv (capacity a dim of its own: the runtime's buffer)."""
    from speccomp.frontend.convention import example_inputs

    q, past = _EXAMPLE_Q, _EXAMPLE_PAST
    ids, pos, mask, past_kv = example_inputs(sg.captured.kv, q, past, vocab_size=sg.captured.vocab_size)
    q_dim, capacity = Dim("q", min=1), Dim("capacity", min=1)
    known = {"input_ids": (ids, {1: q_dim}), "position_ids": (pos, {1: q_dim}), "attention_mask": (mask, {1: Dim.AUTO}),
             "tree_mask": (torch.ones(q, q + 2, dtype=torch.bool).tril(2), {0: q_dim, 1: Dim.AUTO})}
    room = torch.zeros(*past_kv.shape[:4], past + q + 2, past_kv.shape[5], dtype=past_kv.dtype)
    room[..., :past, :] = past_kv
    args, dynamic = [], []
    for name in sg.input_names():
        if name in known:
            args.append(known[name][0])
            dynamic.append(known[name][1])
        else:  # past_key_<l> / past_value_<l>
            layer, kv = int(name.rsplit("_", 1)[1]), int(name.startswith("past_value"))
            args.append(room[layer, kv].clone())
            dynamic.append({2: capacity})
    return tuple(args), tuple(dynamic)


def cache_buffer(past_kv: torch.Tensor, q: int) -> torch.Tensor | None:
    """The runtime's buffer when `past_kv` is its `data[..., :past, :]` with room for q more (else None)."""
    base = free_room(past_kv, q)
    if base is None or base.device.type != "cpu" or not base.is_contiguous():  # raw host pointers are bound
        return None
    return base if past_kv.shape[:4] == base.shape[:4] and past_kv.storage_offset() == base.storage_offset() else None


class OrtKVStep(OrtStep):
    """An OrtStep whose graph takes the cache one layer per input, bound in place (see the module docstring).

    `call_names`: the inputs callers pass, in order (the calling convention's, `tree_mask` if any); the session's
    own inputs are those minus past_kv plus the per-layer buffers. `n_outputs`: the outputs callers get."""

    def __init__(self, path, call_names: list[str], n_outputs: int, **options):
        super().__init__(path, **options)
        self.call_names, self.n_outputs = list(call_names), n_outputs
        self.outputs = self.output_names[:n_outputs]  # the outputs callers get (ORT allocates them every run)
        typed = list(zip(self.input_names, self.input_types))
        self.inputs = [(name, dtype) for name, dtype in typed if name in self.call_names]  # the rest: past_<kv>_<l>
        layers = [name for name, _ in typed if name not in self.call_names]
        self.bindings = LayerBindings(self.session, layers, self.output_names[self.n_outputs:])

    def __call__(self, *inputs):
        if len(inputs) != len(self.call_names):
            raise TypeError(f"{self.path.name} takes {len(self.call_names)} inputs {self.call_names}, got {len(inputs)}")
        given = dict(zip(self.call_names, inputs))
        past_kv, q = given["past_kv"], int(given["input_ids"].shape[1])
        if not isinstance(past_kv, torch.Tensor):
            past_kv = torch.from_numpy(np.asarray(past_kv))
        buffer, outputs = cache_buffer(past_kv, q), self.outputs
        scratch = buffer is None
        if scratch:  # not the runtime's buffer: a scratch one with room for this step's entries
            buffer = past_kv.new_zeros(*past_kv.shape[:4], past_kv.shape[4] + q, past_kv.shape[5])
            buffer[..., : past_kv.shape[4], :] = past_kv
        binding = self.bindings.binding(buffer.numpy(), outputs, keep=not scratch)  # a numpy view: no copy
        kept = []
        for name, dtype in self.inputs:
            value = given[name]
            value = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
            kept.append(np.ascontiguousarray(value, dtype=dtype))
            binding.bind_cpu_input(name, kept[-1])
        try:
            self.session.run_with_iobinding(binding)
            return tuple(torch.from_numpy(o.numpy()) for o in binding.get_outputs()[: self.n_outputs])
        finally:
            self.bindings.release(binding, outputs)

    def __repr__(self) -> str:
        return f"OrtKVStep({str(self.path)!r}, providers={self.providers})"


def lower_in_place(sg, path, providers: list, spin: bool, rewrite=lambda path: path, threads: int | None = None):
    """An OrtKVStep for `sg` (exported to `path`, then `rewrite(path)`: the file the session loads), or None where
    OrtAttention does not apply (the caller exports the plain graph). CPU only: a GPU provider would copy the host
    buffer in and out every step."""
    import torch.fx.experimental._config as fx_config

    from speccomp.backends.onnx_export import _without_slow_rewrites, export_copy, onnx_program
    from speccomp.errors import UnsupportedModelError
    from speccomp.frontend.graph import run_passes
    from speccomp.passes.grouped_query_attention import GroupedQueryAttention
    from speccomp.passes.ort_attention import OrtAttention

    import onnxruntime

    cpu_only = [p if isinstance(p, str) else p[0] for p in providers] == ["CPUExecutionProvider"]
    recent = tuple(int(x) for x in onnxruntime.__version__.split(".")[:2]) >= (1, 32)  # causal=0 + attention_bias
    if not cpu_only or not recent or sg.captured.kv.dtype not in _NUMPY:
        return None
    call_names, n_outputs = sg.input_names(), len(sg.gm.graph.output_node().args[0])
    fused = sg.clone()
    try:
        run_passes(fused, [GroupedQueryAttention(), OrtAttention()], dump_input=False)
    except UnsupportedModelError:
        return None
    args, dynamic = export_args(fused)
    names = fused.input_names()
    layers = [n.replace("past_", "present_", 1) for n in names if n.startswith("past_")]
    outputs = ["logits", "new_kv", "hidden"][:n_outputs] + [f"output_{i}" for i in range(3, n_outputs)] + layers
    try:
        with _without_slow_rewrites(), fx_config.patch(backed_size_oblivious=True):
            program = onnx_program(export_copy(fused.gm), args, "torch.onnx.export failed on the fused-attention graph",
                                   dynamic_shapes=dynamic, input_names=names, output_names=outputs,
                                   custom_translation_table=translation_table())
        program.save(path)
    except Exception as exc:  # export refused the fused graph: the plain export still works
        return _copied_cache(path, exc)
    loaded = rewrite(path)  # the quantiser's failures are its own, not the fused graph's
    try:
        return OrtKVStep(loaded, call_names, n_outputs, providers=providers, spin=spin, intra_op_threads=threads)
    except Exception as exc:  # ONNX Runtime refused the fused graph: the plain export still works
        return _copied_cache(path, exc)


def _copied_cache(path, exc: Exception) -> None:
    warnings.warn(f"the cache stays a copied input for {Path(path).name}: {str(exc).splitlines()[0]}", stacklevel=3)
