"""Cost of one target forward vs the number of tokens scored, with and without the eager lowering passes.

    python benchmarks/step_cost.py            # SmolLM2-135M, 300 cached tokens, 2 threads

Prints, for q = 1, 4, 16 tokens: the LM-head matmul alone (PyTorch's default linear vs the
oneDNN-packed one of passes/prepack_linear.py) and a whole forward of the captured graph before
and after lowering (backends/eager.py). Same process, same inputs, median of 7 runs.
"""
import statistics
import time

import torch

from speccomp.backends.eager import lower_eager
from speccomp.frontend import capture
from speccomp.frontend.convention import example_inputs
from speccomp.frontend.graph import SpecGraph
from speccomp.models import load_default_model
from speccomp.passes.prepack_linear import linear as packed_linear


def median_ms(fn, runs=7):
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main():
    torch.set_num_threads(2)
    model, _ = load_default_model()
    base = SpecGraph.from_captured(capture(model, check=False))
    lowered = lower_eager(base)
    head = model.get_output_embeddings().weight.detach()
    print("| q | LM head, torch linear | LM head, packed | forward, captured graph | forward, lowered graph |")
    print("|---:|---:|---:|---:|---:|")
    with torch.no_grad():
        for q in (1, 4, 16):
            x = torch.randn(q, head.shape[1])
            args = example_inputs(base.captured.kv, q, 300, vocab_size=base.captured.vocab_size)
            row = [median_ms(lambda: torch.nn.functional.linear(x, head)), median_ms(lambda: packed_linear(x, head)),
                   median_ms(lambda: base.gm(*args)), median_ms(lambda: lowered(*args))]
            print(f"| {q} | " + " | ".join(f"{v:.1f} ms" for v in row) + " |")


if __name__ == "__main__":
    main()
