"""What one more query row costs the attention scores at 4096 cached tokens on ONNX Runtime's CPU provider.

    python benchmarks/score_gemm.py        # SmolLM2's shapes: 30 layers x 9 query heads, head size 64, 2 threads

Times one session of 270 score GEMMs Q [M, 64] x K^T (K [4096, 64], a graph input as the KV cache is, so nothing is
prepacked; `FusedMatMul` with transB and alpha 1, as the fused attention computes them) for M = 1, 2, 3, 5: the rows
of a plain step and of verifying chains of 1, 2 and 4 drafts. With M = 1 MLAS reads K where it lies; with M > 1 it
first packs K into panels, per call. Also the same product with its operands swapped (K x Q^T: MLAS then streams K
and packs only Q) and the probabilities times V (P [M, 4096] x V). Median of 15 runs after 3 warm-ups; writes --json.
Run it on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    from speccomp.cli import positive  # argparse type: an int >= 1, the bad value named

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=positive, default=4096)
    ap.add_argument("--threads", type=positive, default=2)
    ap.add_argument("--json", default=str(HERE / "results_score_gemm.json"))
    args = ap.parse_args(argv)

    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    calls, head = 30 * 9, 64
    keys = np.random.default_rng(0).standard_normal((args.keys, head), dtype=np.float32)
    f32 = TensorProto.FLOAT
    # name: (the node's inputs, its attributes, the inputs' shapes, the per-row input's width)
    variants = {"Q.K^T": (["q", "k"], {"transB": 1}, {"q": ["M", head], "k": [args.keys, head]}, head),
                "K.Q^T (operands swapped)": (["k", "q"], {"transB": 1}, {"q": ["M", head], "k": [args.keys, head]}, head),
                "P.V": (["q", "k"], {}, {"q": ["M", args.keys], "k": [args.keys, head]}, args.keys)}
    rows = []
    for name, (inputs, attributes, shapes, width) in variants.items():
        nodes = [helper.make_node("FusedMatMul", inputs, [f"s{i}"], domain="com.microsoft", alpha=1.0, **attributes)
                 for i in range(calls)]
        graph = helper.make_graph(nodes, "scores", [helper.make_tensor_value_info(n, f32, d) for n, d in shapes.items()],
                                  [helper.make_tensor_value_info(f"s{i}", f32, None) for i in range(calls)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        for m in (1, 2, 3, 5):
            feeds = {"q": np.random.default_rng(m).standard_normal((m, width), dtype=np.float32), "k": keys}
            for _ in range(3):
                session.run(None, feeds)
            times = []
            for _ in range(15):
                start = time.perf_counter()
                session.run(None, feeds)
                times.append(time.perf_counter() - start)
            rows.append({"gemm": name, "rows": m, "ms": 1e3 * sorted(times)[7]})
    print(f"| GEMM ({calls} per session, {args.keys} keys) | 1 row ms | 2 rows | 3 rows | 5 rows |\n|---|---:|---:|---:|---:|")
    for name in variants:
        ms = [r["ms"] for r in rows if r["gemm"] == name]
        print(f"| {name} | {ms[0]:.2f} | " + " | ".join(f"{x:.2f} ({x / ms[0]:.2f}x)" for x in ms[1:]) + " |")
    command = " ".join(["python", "benchmarks/score_gemm.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps({"command": command, "settings": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
