"""The quantized self-drafter (QuantSpec: the target's graph with 4-bit MatMulNBits weights drafts, the float graph
verifies) against plain decoding on the onnxruntime backend, SmolLM2-135M, for a few trees.

    python benchmarks/quantized_drafter.py              # prompts 3-4 of gsm8k and vicuna_bench, 128 new tokens
    python benchmarks/quantized_drafter.py --context 4096   # one prompt of 4096 tokens: every shipped prompt's text
                                                            # run together (a long-context continuation)
    python benchmarks/quantized_drafter.py --context 4096 --kv sink:256   # + the model drafting over a compressed
                                                            # cache, float and 4-bit weights

Rows run back to back in one process after one warm-up each; every output is compared with plain decoding's.
Prints tokens/s, tau and the acceptance by depth of the first prompt; writes --json. Run it on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TREES = ("dynamic:16:4", "4", "[[0], [0, 0]]")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=0, help="one long prompt of this many tokens instead (0: chat)")
    ap.add_argument("--kv", action="append", help="also draft over this compressed cache (kv_cache=, e.g. sink:256) "
                    "with float and with 4-bit weights (QuantSpec's hierarchy); repeatable")
    ap.add_argument("--json", default=str(HERE / "results_quantized_drafter.json"))
    args = ap.parse_args(argv)

    import torch

    import speccomp
    from speccomp.models import chat_ids
    from speccomp.prompts import SETS, load_prompts
    from speccomp.runtime.tree import parse_tree_spec

    torch.set_num_threads(2)
    model, tok = speccomp.load_default_model()
    prompts = [chat_ids(tok, p.text) for f in ("gsm8k", "vicuna_bench") for p in load_prompts(f, limit=4)[2:4]]
    if args.context:
        text = "\n\n".join(p.text for f in SETS for p in load_prompts(f))
        ids = tok(text, return_tensors="pt").input_ids
        if ids.shape[1] < args.context:
            raise SystemExit(f"the shipped prompts hold {ids.shape[1]} tokens, fewer than --context {args.context}")
        prompts = [ids[:, : args.context]]
    plain = speccomp.compile(model, backend="onnxruntime")
    drafted = speccomp.compile(model, drafter="quantized", backend="onnxruntime")
    tree = lambda label: parse_tree_spec(json.loads(label) if label.startswith("[") else label)  # noqa: E731
    makers = {"plain": lambda: plain}
    makers.update({label: (lambda label=label: drafted.with_drafter(drafted.drafter.with_tree(tree(label))))
                   for label in TREES})
    for policy in args.kv or []:  # the model drafting over a compressed cache, float or 4-bit weights
        for weights, label in (("float", "4"), ("int4", "4"), ("int4", "dynamic:16:4")):
            makers[f"kv {policy} {weights}, tree {label}"] = (
                lambda policy=policy, weights=weights, label=label: speccomp.compile(
                    model, kv_cache=policy, tree=tree(label), backend="onnxruntime",
                    drafter_options={"weights": weights}))
    rows, refs = [], []
    for label, make in makers.items():
        fast = make()
        fast.generate(prompts[0][:, :20], max_new_tokens=8)  # warm-up
        seconds = tokens = steps = prefill = 0
        identical, acceptance = True, None
        for i, ids in enumerate(prompts):
            out = fast.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
            if label == "plain":
                refs.append(out)
            identical &= bool(torch.equal(out, refs[i]))
            s = fast.last_stats
            seconds, tokens, steps = seconds + s["seconds"], tokens + s["new_tokens"], steps + s["steps"]
            prefill += s["prefill_seconds"]
            acceptance = acceptance or s.get("acceptance_by_depth")
        rows.append({"tree": label, "tokens_per_s": tokens / seconds, "decode_tokens_per_s": tokens / (seconds - prefill),
                     "tau": tokens / steps, "identical": identical,
                     "acceptance_by_depth_first_prompt": acceptance})
        print(json.dumps(rows[-1]), file=sys.stderr)
    what = f"one {args.context}-token prompt" if args.context else f"{len(prompts)} prompts"
    print(f"\nSmolLM2-135M, onnxruntime backend, {what} x {args.max_new_tokens} new tokens, 2 threads")
    print("| row | tok/s | vs plain | decode tok/s (prefill left out) | vs plain | tau | identical | "
          "acceptance by depth (first prompt) |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        acc = ", ".join(f"{a:.2f}" for a in (r["acceptance_by_depth_first_prompt"] or [])[:6])
        name = r["tree"] if r["tree"] == "plain" or r["tree"].startswith("kv ") else f"quantized, tree {r['tree']}"
        decode, base = r["decode_tokens_per_s"], rows[0]["decode_tokens_per_s"]
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x | "
              f"{decode:.1f} | {decode / base:.2f}x | {r['tau']:.2f} | {r['identical']} | {acc} |")
    command = " ".join(["python", "benchmarks/quantized_drafter.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
