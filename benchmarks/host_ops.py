"""The decode loop's host-side operations, each timed against the way the loop did it before 2026-11-28, in one run
(benchmarks/README.md, "Loop overhead between forwards").

    python benchmarks/host_ops.py          # one torch thread (what the loop runs with beside ONNX Runtime)

    argmax        greedy acceptance over a tree's logits [n, 49152]: torch's CPU argmax against
                  speccomp.runtime.sampling.argmax (numpy's scan), for trees of 5 and 20 nodes
    gather        a merged drafter handing one part 8 of 20 nodes' logits: a list index against index_select
    tree          Tree.from_parents for a tree of 21 nodes (the loop builds about three a step) against its derived
                  fields built the old way, by torch row ops and element writes (`torch_writes`, kept here only as
                  that baseline)
    top_k         Token Recycling's observe, each node's 8 likeliest ids out of [n, 49152] logits (n = 5, 20): torch.topk
                  (the torch runtime before) and the engine's numpy argpartition (its fallback when the graph has no
                  TopK output) against speccomp.runtime.sampling.top_ids / runtime/topk.py `top_k`
    top_logp      a dynamic tree's expand over 4 frontier nodes: their 4 likeliest tokens' log-probabilities, by
                  torch's log_softmax then topk (the torch runtime before) and by numpy's whole log-softmax then
                  argpartition (the engine before) against drafters/grow.py `torch_top` / runtime/topk.py `top_logp`
    bind          SmolLM2's onnxruntime step at 300 cached tokens: a run's binding work (LayerBindings' binding and
                  release) with the cache's 60 layer blocks bound afresh every run against kept (median over 64
                  calls each; --no-model skips it)

Medians in microseconds to stdout and --json (default benchmarks/results_host_ops.json). Run it on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from step_cost import median_ms  # noqa: E402  (one warm-up call, then the median in ms)


def median_us(fn, repeats: int = 300) -> float:
    return 1e3 * median_ms(fn, repeats)


def torch_writes(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree's mask and paths as runtime/tree.py built them before 2026-11-28 (the baseline of the tree row)."""
    n = len(parents)
    children, depth = [[] for _ in range(n)], [0] * n
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        children[parents[i]].append(i)
        depth[i] = depth[parents[i]] + 1
        mask[i] |= mask[parents[i]]
    leaves = [i for i in range(n) if not children[i]]
    paths = torch.full((len(leaves), max(depth) + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        j = leaf
        while j != -1:
            paths[row, depth[j]] = j
            j = parents[j]
    return mask, paths


def numpy_top_ids(scores, k: int):
    """The engine's top k before 2026-11-28 (baseline of the top_k row): argpartition, then a sort of the k."""
    import numpy as np

    k = min(k, scores.shape[-1])
    part = np.argpartition(-scores, k - 1, axis=-1)[..., :k]
    order = np.argsort(-np.take_along_axis(scores, part, -1), axis=-1, kind="stable")
    return np.take_along_axis(part, order, -1)


def numpy_top_logp(logits, k: int):
    """The engine's expand answer before 2026-11-28 (baseline of the top_logp row): the whole log-softmax, then
    numpy_top_ids."""
    import numpy as np

    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ids = numpy_top_ids(logp, k)
    return np.take_along_axis(logp, ids, -1).tolist(), ids.tolist()


def top_rows(g) -> dict:
    """The top_k and top_logp rows (module docstring), each checked to answer as its baseline does."""
    from speccomp.drafters.grow import torch_top
    from speccomp.runtime.sampling import top_ids
    from speccomp.runtime.topk import top_k, top_logp

    rows = {}
    for n in (5, 20):
        logits = torch.randn(n, 49152, generator=g) * 4
        scores = logits.numpy()
        assert torch.equal(top_ids(logits, 8), logits.topk(8).indices)
        assert (numpy_top_ids(scores, 8) == top_k(scores, 8)[1]).all()
        rows[f"top_k_{n}"] = {"torch_topk": median_us(lambda: logits.topk(8, dim=-1).indices.tolist()),
                              "top_ids": median_us(lambda: top_ids(logits, 8).tolist()),
                              "numpy_argpartition": median_us(lambda: numpy_top_ids(scores, 8).tolist()),
                              "top_k": median_us(lambda: top_k(scores, 8)[1].tolist())}
    logits = torch.randn(4, 49152, generator=g) * 4
    scores = logits.numpy()
    assert numpy_top_logp(scores, 4)[1] == top_logp(scores, 4)[1].tolist() == torch_top(logits, 4)[1]

    def torch_before():
        logp, ids = logits.log_softmax(-1).topk(4, dim=-1)
        return logp.tolist(), ids.tolist()

    rows["top_logp_4"] = {"torch_log_softmax_topk": median_us(torch_before), "torch_top": median_us(lambda: torch_top(logits, 4)),
                          "numpy_log_softmax_argpartition": median_us(lambda: numpy_top_logp(scores, 4)),
                          "top_logp": median_us(lambda: top_logp(scores, 4))}
    return rows


def binding_us(calls: int = 64) -> dict:
    """The binding call of the onnxruntime backend's step, kept against afresh, over the runtime's own cache."""
    import speccomp
    from speccomp.runtime.decode import KVCache

    model, _ = speccomp.load_default_model()
    fast = speccomp.compile(model, backend="onnxruntime")
    step = fast.step
    if not hasattr(step, "bindings"):
        return {"skipped": f"the step is a {type(step).__name__}, not an in-place ONNX Runtime step"}
    cache = KVCache(fast.kv, 512)
    cache.length = 300
    buffer, outputs, bindings = cache.data.numpy(), step.output_names[: step.n_outputs], step.bindings
    out = {}
    for name, keep in (("afresh", False), ("kept", True)):
        def call():
            bindings.release(bindings.binding(buffer, outputs, keep=keep), outputs)

        out[name] = median_us(call, calls)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-model", action="store_true", help="skip the binding rows (they load SmolLM2)")
    ap.add_argument("--json", default=str(HERE / "results_host_ops.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from speccomp.runtime.sampling import argmax
    from speccomp.runtime.tree import Tree

    g = torch.Generator().manual_seed(0)
    rows = {}
    for n in (5, 20):
        logits = torch.randn(n, 49152, generator=g)
        rows[f"argmax_{n}"] = {"torch": median_us(lambda: logits.argmax(-1)), "numpy": median_us(lambda: argmax(logits))}
    logits, picked = torch.randn(20, 49152, generator=g), [0, 2, 3, 5, 8, 11, 13, 17]
    rows["gather_8_of_20"] = {"list_index": median_us(lambda: logits[picked]),
                              "index_select": median_us(lambda: logits.index_select(0, torch.tensor(picked)))}
    parents = [-1] + [(i - 1) // 2 for i in range(1, 21)]
    tree = Tree.from_parents(parents)
    old_mask, old_paths = torch_writes(parents)
    assert torch.equal(old_mask, tree.mask) and torch.equal(old_paths, tree.paths)  # the same fields, both ways
    rows["tree_21_nodes"] = {"torch_writes": median_us(lambda: torch_writes(parents)),
                             "from_parents": median_us(lambda: Tree.from_parents(parents))}
    rows.update(top_rows(g))
    if not args.no_model:
        rows["bind_smollm2"] = binding_us()
    for name, row in rows.items():
        print(f"{name:>16}: " + ", ".join(f"{k} {v:.1f} us" if isinstance(v, float) else f"{k}: {v}"
                                            for k, v in row.items()))
    command = " ".join(["python", "benchmarks/host_ops.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
