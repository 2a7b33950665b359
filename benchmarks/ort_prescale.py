"""Does moving the attention scale onto the queries speed up the onnxruntime step? (passes/ort_attention.py)

    python benchmarks/ort_prescale.py            # SmolLM2-135M, 2 threads, 5 rounds

ONNX Runtime's CPU GroupQueryAttention computes Q.K^T as a GEMM with alpha = scale; MLAS runs a one-row GEMM
without packing K only when alpha is 1. `fused_attention` therefore multiplies the queries by the scale and passes
1.0. This script compiles the onnxruntime backend twice in one process, once as shipped and once with the previous
lowering (the scale as the kernel's alpha, patched in here), and times one forward over the runtime's own cache for
each cell (cached tokens, q), the two alternating for --rounds rounds; it prints the median ms of each and the geometric
mean of the paired per-round ratios. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from floor import graph_step  # noqa: E402
from step_cost import median_ms  # noqa: E402

CELLS = ((300, 1), (4096, 1), (300, 5), (4096, 5))


def alpha_lowering(q4, new_k, new_v, past_key, past_value, mask, scale: float):
    """fused_attention as it was: the scale handed to the kernel (its GEMM's alpha)."""
    from speccomp.passes.ort_attention import group_query_attention

    _, hq, q, d = q4.shape
    bias = torch.zeros(mask.shape, dtype=q4.dtype).masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else mask
    flat = [t.transpose(1, 2).reshape(1, q, -1) for t in (q4, new_k, new_v)]
    out, pk, pv = group_query_attention(*flat, past_key, past_value, bias.expand(1, 1, q, bias.shape[-1]), hq,
                                        new_k.shape[1], scale)
    return out.view(1, q, hq, d).transpose(1, 2), pk, pv


def gqa_scale(path) -> float:
    """The one scale attribute every GroupQueryAttention node of the ONNX file at `path` carries."""
    import onnx

    scales = {onnx.helper.get_attribute_value(a) for n in onnx.load(str(path)).graph.node
              if n.op_type == "GroupQueryAttention" for a in n.attribute if a.name == "scale"}
    assert len(scales) == 1, scales
    return scales.pop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7, help="calls per cell and round (median)")
    ap.add_argument("--json", default=str(HERE / "results_ort_prescale.json"))
    args = ap.parse_args(argv)
    for flag in ("rounds", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} {getattr(args, flag)}: must be at least 1")

    import speccomp
    import speccomp.passes.ort_attention as ort_attention

    torch.set_num_threads(2)
    model, _ = speccomp.load_default_model()
    shipped = ort_attention.fused_attention
    variants = {}
    for name, lowering in (("shipped", shipped), ("alpha", alpha_lowering)):
        ort_attention.fused_attention = lowering  # the pass looks it up when it rewrites
        variants[name] = (speccomp.compile(model, backend="onnxruntime"),  # q = 1
                          speccomp.compile(model, drafter="ngram", backend="onnxruntime"))  # its verify graph: q > 1
    ort_attention.fused_attention = shipped
    for name, want in (("shipped", 1.0), ("alpha", 0.125)):  # the two files really differ where they should
        assert {gqa_scale(m.step.path) for m in variants[name]} == {want}, (name, want)
    times = {f"{c}:{q}": {name: [] for name in variants} for c, q in CELLS}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for c, q in CELLS:
            for name in order:
                times[f"{c}:{q}"][name].append(median_ms(graph_step(variants[name][q > 1], c, q), args.repeats))
        print(f"round {r}: " + json.dumps({k: {n: round(v[-1], 1) for n, v in t.items()} for k, t in times.items()}),
              file=sys.stderr)
    print("| cached tokens | q | alpha = scale ms | queries scaled ms | alpha / scaled (paired geomean) |")
    print("|---:|---:|---:|---:|---:|")
    for (c, q), t in zip(CELLS, times.values()):
        ratio = math.exp(statistics.fmean(math.log(a / s) for a, s in zip(t["alpha"], t["shipped"])))
        print(f"| {c} | {q} | {statistics.median(t['alpha']):.1f} | {statistics.median(t['shipped']):.1f} | {ratio:.3f} |")
    command = " ".join(["python", "benchmarks/ort_prescale.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps({"command": command, "ms": times}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
