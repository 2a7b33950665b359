"""The quantized self-drafter (QuantSpec: the target's graph with 4- or 8-bit MatMulNBits weights drafts, the float
graph verifies) against plain decoding on the onnxruntime backend, SmolLM2-135M, for a few trees.

    python benchmarks/quantized_drafter.py              # prompts 3-4 of gsm8k and vicuna_bench, 128 new tokens
    python benchmarks/quantized_drafter.py --context 4096   # one prompt of 4096 tokens: every shipped prompt's text
                                                            # run together (a long-context continuation)
    python benchmarks/quantized_drafter.py --context 4096 --kv sink:256   # + the model drafting over a compressed
                                                            # cache, float and quantised weights
    python benchmarks/quantized_drafter.py --bits 4         # 4-bit rows only (default: 4 and 8)
    python benchmarks/quantized_drafter.py --files alpaca,humaneval --tree 4 --tree 6   # other prompts and trees
    python benchmarks/quantized_drafter.py --bits 8 --block 32,128 --tree 4     # weights per quantisation block

Rows run back to back in one process after one warm-up each, plain decoding first and again last (what the machine
drifted by); every output is compared with plain decoding's.
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
                    "with float weights and each --bits width (QuantSpec's hierarchy); repeatable")
    ap.add_argument("--files", default="gsm8k,vicuna_bench", help="prompt files, comma-separated: their 3rd and 4th "
                    "prompts (default gsm8k,vicuna_bench: the prompts that chose the default tree)")
    ap.add_argument("--tree", action="append", help=f"a tree of the quantized rows, repeatable (default {list(TREES)}); "
                    "also the trees of the --kv rows with quantised weights (default 4 and dynamic:16:4; before "
                    "2026-11-29 those rows ignored --tree)")
    ap.add_argument("--bits", default="4,8", help="weight widths of the quantized rows, comma-separated (4, 8)")
    ap.add_argument("--block", default="32", help="weights per quantisation block of the quantized rows, "
                    "comma-separated powers of two >= 16 (default 32: the block of every run recorded before the "
                    "drafter's own default became 128; --kv rows take kv_mode='draft''s default, 128); rows name "
                    "the block when there are several")
    ap.add_argument("--json", default=str(HERE / "results_quantized_drafter.json"))
    args = ap.parse_args(argv)
    widths = [b.strip() for b in args.bits.split(",")]
    if not all(b in ("4", "8") for b in widths):
        ap.error(f"--bits {args.bits!r}: MatMulNBits weights are 4 or 8 bits (e.g. --bits 4,8)")
    widths = [int(b) for b in widths]
    blocks = [b.strip() for b in args.block.split(",")]
    if not all(b.isdigit() for b in blocks):
        ap.error(f"--block {args.block!r}: comma-separated block sizes, e.g. --block 32,128")
    blocks = [int(b) for b in blocks]

    import torch

    import speccomp
    from speccomp.models import chat_ids
    from speccomp.prompts import SETS, load_prompts
    from speccomp.runtime.tree import parse_tree_spec

    torch.set_num_threads(2)
    model, tok = speccomp.load_default_model()
    prompts = [chat_ids(tok, p.text) for f in args.files.split(",") for p in load_prompts(f, limit=4)[2:4]]
    if args.context:
        text = "\n\n".join(p.text for f in SETS for p in load_prompts(f))
        ids = tok(text, return_tensors="pt").input_ids
        if ids.shape[1] < args.context:
            raise SystemExit(f"the shipped prompts hold {ids.shape[1]} tokens, fewer than --context {args.context}")
        prompts = [ids[:, : args.context]]
    plain = speccomp.compile(model, backend="onnxruntime")
    tree = lambda label: parse_tree_spec(json.loads(label) if label.startswith("[") else label)  # noqa: E731
    makers = {"plain": lambda: plain}
    for bits in widths:
        for block in blocks:
            drafted = speccomp.compile(model, drafter="quantized", backend="onnxruntime",
                                       drafter_options={"bits": bits, "block_size": block})
            name = f"int{bits}" + (f"/b{block}" if len(blocks) > 1 else "")
            makers.update({f"{name} {label}": lambda d=drafted, label=label: d.with_drafter(d.drafter.with_tree(tree(label)))
                           for label in args.tree or TREES})
    for policy in args.kv or []:  # the model drafting over a compressed cache, float or quantised weights
        quantised = [(f"int{bits}", label) for bits in widths for label in args.tree or ("4", "dynamic:16:4")]
        for weights, label in [("float", "4")] + quantised:
            makers[f"kv {policy} {weights}, tree {label}"] = (
                lambda policy=policy, weights=weights, label=label: speccomp.compile(
                    model, kv_cache=policy, tree=tree(label), backend="onnxruntime",
                    drafter_options={"weights": weights}))
    makers["plain, again"] = lambda: plain
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
        bits, _, shape = r["tree"].partition(" ")
        name = r["tree"] if r["tree"].startswith(("plain", "kv ")) else f"quantized {bits}, tree {shape}"
        decode, base = r["decode_tokens_per_s"], rows[0]["decode_tokens_per_s"]
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x | "
              f"{decode:.1f} | {decode / base:.2f}x | {r['tau']:.2f} | {r['identical']} | {acc} |")
    command = " ".join(["python", "benchmarks/quantized_drafter.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
