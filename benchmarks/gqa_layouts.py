"""What ONNX Runtime's CPU GroupQueryAttention costs at long context, for one token and for a tree's worth.

    python benchmarks/gqa_layouts.py             # SmolLM2's shapes: 30 layers, 9 query / 3 KV heads of 64, 4096 cached

A standalone ONNX graph of 30 GroupQueryAttention nodes (one per layer, each over its own preallocated cache bound in
place, as backends/onnx_kv.py binds the runtime's buffer), nothing else, timed with ONNX Runtime's CPU provider and 2
threads (median of --repeats runs) in four layouts of the same q query tokens:

    alpha        9 heads, q rows, scale handed to the kernel (its GEMM's alpha): the lowering before the fix
    scaled       9 heads, q rows, scale 1.0 (the queries pre-scaled): what passes/ort_attention.py exports now
    tree-heads   9q heads of one row each (the tree folded into the heads), scale 1.0
    group-rows   3 heads of 3q rows each (each KV head's query group folded into the rows), scale 1.0
    explicit     no fused kernel: per layer FusedMatMul(Q, K^T) + bias, Softmax, MatMul(P, V) over 3 KV heads of 3q
                 rows each (every KV head's keys read once for its whole query group), over contiguous copies of
                 the cache's first past + q slots; it writes no cache entries (the fused layouts write q rows)

Only the timing is measured (the folded layouts would need the graph to place the new keys differently; none is
shipped). Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
LAYERS, KV_HEADS, HEAD_DIM, GROUP = 30, 3, 64, 3


def gqa_graph(path: Path, heads: int, rows: int, scale: float, capacity: int) -> None:
    """30 chained GroupQueryAttention nodes, each with its own past_key/past_value input and present outputs."""
    import onnx
    from onnx import TensorProto, helper

    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("q", f32, [1, rows, heads * HEAD_DIM]),
              helper.make_tensor_value_info("k", f32, [1, rows, KV_HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("v", f32, [1, rows, KV_HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("bias", f32, [1, 1, rows, "T"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    nodes, outputs, query = [], [], "q"
    for layer in range(LAYERS):
        for kv in ("k", "v"):
            inputs.append(helper.make_tensor_value_info(f"past_{kv}{layer}", f32, [1, KV_HEADS, capacity, HEAD_DIM]))
            outputs.append(helper.make_tensor_value_info(f"present_{kv}{layer}", f32, [1, KV_HEADS, capacity, HEAD_DIM]))
        nodes.append(helper.make_node(
            "GroupQueryAttention", [query, "k", "v", f"past_k{layer}", f"past_v{layer}", "seqlens_k", "total", "", "",
                                    "", "bias"],
            [f"out{layer}", f"present_k{layer}", f"present_v{layer}"], domain="com.microsoft", num_heads=heads,
            kv_num_heads=KV_HEADS, scale=scale, causal=0))
        query = f"out{layer}"
    outputs.insert(0, helper.make_tensor_value_info(query, f32, [1, rows, heads * HEAD_DIM]))
    model = helper.make_model(helper.make_graph(nodes, "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, path)


def explicit_graph(path: Path, rows: int, total: int) -> None:
    """30 layers of unfused attention: each KV head's query group as rows, K^T by FusedMatMul's transB."""
    import onnx
    from onnx import TensorProto, helper

    f32, query, nodes = TensorProto.FLOAT, "q", []
    inputs = [helper.make_tensor_value_info("q", f32, [1, KV_HEADS, rows, HEAD_DIM]),
              helper.make_tensor_value_info("bias", f32, [1, 1, rows, total])]
    for layer in range(LAYERS):
        inputs += [helper.make_tensor_value_info(f"{kv}{layer}", f32, [1, KV_HEADS, total, HEAD_DIM]) for kv in "kv"]
        nodes += [helper.make_node("FusedMatMul", [query, f"k{layer}"], [f"s{layer}"], domain="com.microsoft", transB=1),
                  helper.make_node("Add", [f"s{layer}", "bias"], [f"sb{layer}"]),
                  helper.make_node("Softmax", [f"sb{layer}"], [f"p{layer}"], axis=-1),
                  helper.make_node("MatMul", [f"p{layer}", f"v{layer}"], [f"o{layer}"])]
        query = f"o{layer}"
    outputs = [helper.make_tensor_value_info(query, f32, [1, KV_HEADS, rows, HEAD_DIM])]
    model = helper.make_model(helper.make_graph(nodes, "explicit", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, path)


def session_for(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def median_run_ms(session, binding, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times[1:]))


def time_explicit(folder: Path, caches: list, q: int, past: int, repeats: int) -> float:
    rows, total = GROUP * q, past + q
    path = folder / f"explicit_{q}.onnx"
    explicit_graph(path, rows, total)
    session, rng = session_for(path), np.random.default_rng(0)
    binding = session.io_binding()
    feeds = {"q": rng.standard_normal((1, KV_HEADS, rows, HEAD_DIM), dtype=np.float32),
             "bias": np.zeros((1, 1, rows, total), np.float32)}
    for layer in range(LAYERS):
        for i, kv in enumerate("kv"):
            feeds[f"{kv}{layer}"] = np.ascontiguousarray(caches[2 * layer + i][:, :, :total])
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    binding.bind_output(session.get_outputs()[0].name, "cpu")
    return median_run_ms(session, binding, repeats)


def time_layout(folder: Path, caches: list, heads: int, rows: int, scale: float, past: int, repeats: int) -> float:
    capacity = caches[0].shape[2]
    path = folder / f"gqa_{heads}_{rows}_{scale}.onnx"
    gqa_graph(path, heads, rows, scale, capacity)
    session = session_for(path)
    rng, total = np.random.default_rng(0), past + rows
    feeds = {"q": rng.standard_normal((1, rows, heads * HEAD_DIM), dtype=np.float32),
             "k": rng.standard_normal((1, rows, KV_HEADS * HEAD_DIM), dtype=np.float32),
             "v": rng.standard_normal((1, rows, KV_HEADS * HEAD_DIM), dtype=np.float32),
             "bias": np.zeros((1, 1, rows, total), np.float32),
             "seqlens_k": np.array([total - 1], np.int32), "total": np.array(total, np.int32)}
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for layer in range(LAYERS):
        for i, kv in enumerate("kv"):
            buf = caches[2 * layer + i]
            for bind, name in ((binding.bind_input, f"past_{kv}{layer}"), (binding.bind_output, f"present_{kv}{layer}")):
                bind(name, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
    binding.bind_output(session.get_outputs()[0].name, "cpu")
    return median_run_ms(session, binding, repeats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--past", type=int, default=4096, help="cached tokens")
    ap.add_argument("--q", default="1,5,8", help="query tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=str(HERE / "results_gqa_layouts.json"))
    args = ap.parse_args(argv)
    try:
        qs = [int(x) for x in args.q.split(",")]
    except ValueError:
        qs = []
    if not qs or min(qs) < 1 or args.past < 1 or args.repeats < 1:
        ap.error(f"--q {args.q!r} --past {args.past} --repeats {args.repeats}: give positive integers (--q: e.g. 1,5,8)")
    capacity = args.past + GROUP * max(qs)
    rng = np.random.default_rng(1)
    caches = [rng.standard_normal((1, KV_HEADS, capacity, HEAD_DIM), dtype=np.float32) for _ in range(2 * LAYERS)]
    heads, scale = KV_HEADS * GROUP, HEAD_DIM ** -0.5
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for q in qs:
            layouts = {"alpha": (heads, q, scale), "scaled": (heads, q, 1.0), "tree-heads": (heads * q, 1, 1.0),
                       "group-rows": (KV_HEADS, GROUP * q, 1.0)}
            rows.append({"q": q, **{name: time_layout(Path(folder), caches, *shape, args.past, args.repeats)
                                    for name, shape in layouts.items()},
                         "explicit": time_explicit(Path(folder), caches, q, args.past, args.repeats)})
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"30 GroupQueryAttention nodes, 9 / 3 heads of {HEAD_DIM}, {args.past} cached tokens, 2 threads, median ms")
    print("| q | alpha = scale | scaled queries | tree folded into heads | group folded into rows | explicit, unfused |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['q']} | {r['alpha']:.1f} | {r['scaled']:.1f} | {r['tree-heads']:.1f} | {r['group-rows']:.1f} | "
              f"{r['explicit']:.1f} |")
    command = " ".join(["python", "benchmarks/gqa_layouts.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
