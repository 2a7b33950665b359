"""What one more query row costs the attention scores at 4096 cached tokens on ONNX Runtime's CPU provider.

    python benchmarks/score_gemm.py        # SmolLM2's shapes: 30 layers x 9 query heads, head size 64, 2 threads

Times one session of 270 score GEMMs Q [M, 64] x K^T (K [4096, 64], a graph input as the KV cache is, so nothing is
prepacked; `FusedMatMul` with transB and alpha 1, as the fused attention computes them) for M = 1, 2, 3, 5: the rows
of a plain step and of verifying chains of 1, 2 and 4 drafts. With M = 1 MLAS reads K where it lies; with M > 1 it
first packs K into panels, per call. Median of 15 runs after 3 warm-ups; writes --json. Run it on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(HERE / "results_score_gemm.json"))
    args = ap.parse_args(argv)

    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    calls, head = 30 * 9, 64
    nodes = [helper.make_node("FusedMatMul", ["q", "k"], [f"s{i}"], domain="com.microsoft", transB=1, alpha=1.0)
             for i in range(calls)]
    graph = helper.make_graph(
        nodes, "scores", [helper.make_tensor_value_info("q", TensorProto.FLOAT, ["M", head]),
                          helper.make_tensor_value_info("k", TensorProto.FLOAT, [args.keys, head])],
        [helper.make_tensor_value_info(f"s{i}", TensorProto.FLOAT, None) for i in range(calls)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    keys = np.random.default_rng(0).standard_normal((args.keys, head), dtype=np.float32)
    rows = []
    for m in (1, 2, 3, 5):
        feeds = {"q": np.random.default_rng(m).standard_normal((m, head), dtype=np.float32), "k": keys}
        for _ in range(3):
            session.run(None, feeds)
        times = []
        for _ in range(15):
            start = time.perf_counter()
            session.run(None, feeds)
            times.append(time.perf_counter() - start)
        rows.append({"rows": m, "ms": 1e3 * sorted(times)[7]})
    print(f"| query rows | ms for {calls} score GEMMs over {args.keys} keys | x one row |\n|---:|---:|---:|")
    for r in rows:
        print(f"| {r['rows']} | {r['ms']:.2f} | {r['ms'] / rows[0]['ms']:.2f} |")
    command = " ".join(["python", "benchmarks/score_gemm.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps({"command": command, "settings": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
