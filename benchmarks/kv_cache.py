"""KV-cache compression on SmolLM2-135M, in one run: (a) lossless self-drafting over a compressed cache,
speed vs context length; (b) LOSSY target-side compression, quality vs memory.

    python benchmarks/kv_cache.py                      # both parts, defaults below
    python benchmarks/kv_cache.py --part speed --lengths 1024 --new-tokens 64     # a quick look

Text: tests/data/long_text.txt (an original ~3.8k-word English essay shipped with the tests), tokenized
as plain text (no chat template).

(a) speed, mode "draft" (lossless): for each context length L the prompt is the text's first L tokens,
    then --new-tokens greedy tokens. Rows, all in the same run and back to back per length: HF greedy
    (the reference), plain speccomp decoding (the baseline the speedup is against) and
    `kv_cache=POLICY` drafting for each --draft-policies entry, optionally with the drafter also
    skipping layers (`+skip`: TriForce-style hierarchy, fewer layers and fewer keys per draft).
    Reported: tokens/s, speedup over plain, tau, identical to HF greedy, KV bytes held by the draft.
(b) quality, mode "target" (LOSSY): `SpecModel.quality` decodes the text token by token through the
    compressed cache and through the full cache (the same schedule), after a prompt of --quality-prompt
    tokens, scoring the next --quality-tokens: perplexity of both, mean KL(full || compressed), KV bytes
    held (measured) vs the full cache, and the closed-form size they must equal.

Writes tables to stdout, everything to --json (default benchmarks/results_kv_cache.json) and a PNG of
both curves (--plot, default benchmarks/kv_cache.png). Run on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "tests" / "data" / "long_text.txt"
SKIP = list(range(11, 19))  # the layer_skip drafter's layers `speccomp search` picked for SmolLM2 (README)


def text_ids(tok) -> torch.Tensor:
    return torch.tensor([tok(TEXT.read_text(), add_special_tokens=False)["input_ids"]])


def part_speed(model, tok, args) -> list[dict]:
    import speccomp

    ids_all = text_ids(tok)
    rows = []
    configs = [("plain", {})]
    for policy in args.draft_policies.split(","):
        configs.append((f"kv-draft {policy}", {"kv_cache": policy}))
        if args.with_skip:
            configs.append((f"kv-draft {policy} +skip", {"kv_cache": policy, "drafter_options": {"skip": SKIP}}))
    models = {name: speccomp.compile(model, **kw) for name, kw in configs}
    eos = tok.eos_token_id
    for length in [int(x) for x in args.lengths.split(",")]:
        if length + args.new_tokens > ids_all.shape[1]:
            raise SystemExit(f"the text has {ids_all.shape[1]} tokens; cannot make a {length}-token prompt + {args.new_tokens}")
        ids = ids_all[:, :length]
        # warm-up at this length (allocations, first-call costs), untimed
        for fast in models.values():
            fast.generate(ids, max_new_tokens=4)
        start = time.perf_counter()
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
        hf_secs = time.perf_counter() - start
        timing = {}
        for name, fast in models.items():
            start = time.perf_counter()
            out = fast.generate(ids, max_new_tokens=args.new_tokens, eos_token_id=eos)
            secs = time.perf_counter() - start
            timing[name] = (secs, out, dict(fast.last_stats))
        plain_secs = timing["plain"][0]
        for name, (secs, out, stats) in timing.items():
            new = out.shape[1] - length
            rows.append({
                "context": length, "row": name, "new_tokens": new, "seconds": secs, "tokens_per_second": new / secs,
                "speedup_vs_plain": plain_secs / secs, "speedup_vs_hf": hf_secs / secs, "tau": stats.get("tau"),
                "identical": bool(torch.equal(out, ref)), "kv_bytes_full": stats.get("kv_bytes_full"),
                "kv_bytes_draft": stats.get("kv_bytes_draft"),
            })
        rows.append({"context": length, "row": "hf_greedy", "new_tokens": ref.shape[1] - length, "seconds": hf_secs,
                     "tokens_per_second": (ref.shape[1] - length) / hf_secs, "speedup_vs_plain": plain_secs / hf_secs,
                     "speedup_vs_hf": 1.0, "tau": 1.0, "identical": True})
        print(f"context {length} done", file=sys.stderr)
    return rows


def part_quality(model, tok, args) -> list[dict]:
    import speccomp

    n, m = args.quality_prompt, args.quality_tokens
    ids = text_ids(tok)[:, : n + m]
    rows = []
    for policy in args.quality_policies.split(","):
        lossy = speccomp.compile(model, kv_cache=policy, kv_mode="target")
        start = time.perf_counter()
        q = lossy.quality(ids, n)
        q["seconds"] = time.perf_counter() - start
        q["memory_ratio"] = q["kv_bytes_full"] / q["kv_bytes_compressed"]
        q["perplexity_delta"] = q["perplexity_compressed"] - q["perplexity_full"]
        rows.append(q)
        print(f"quality {policy}: ppl {q['perplexity_compressed']:.3f} (full {q['perplexity_full']:.3f}), "
              f"KL {q['mean_kl']:.4f}, memory {q['memory_ratio']:.2f}x less", file=sys.stderr)
    return rows


def plot(speed: list[dict], quality: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    if speed:
        ax = axes[0]
        for name in dict.fromkeys(r["row"] for r in speed if r["row"] not in ("plain",)):
            pts = [(r["context"], r["speedup_vs_plain"]) for r in speed if r["row"] == name]
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("speedup over plain speccomp decoding")
        ax.set_title("(a) lossless: drafting over a compressed cache")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if quality:
        ax = axes[1]
        kinds = {}
        for r in quality:
            kinds.setdefault(r["kv_cache"].split(":")[0], []).append(r)
        for kind, rs in kinds.items():
            rs = sorted(rs, key=lambda r: r["memory_ratio"])
            ax.plot([r["memory_ratio"] for r in rs], [r["perplexity_compressed"] for r in rs], marker="o", label=kind)
            for r in rs:
                ax.annotate(r["kv_cache"], (r["memory_ratio"], r["perplexity_compressed"]), fontsize=7)
        ax.axhline(quality[0]["perplexity_full"], color="gray", linestyle="--", linewidth=1, label="full cache")
        ax.set_xlabel("KV memory reduction (full bytes / held bytes)")
        ax.set_ylabel("perplexity, decoded through the cache")
        ax.set_title("(b) LOSSY: the model reads the compressed cache")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["speed", "quality", "both"], default="both")
    ap.add_argument("--lengths", default="1024,2048,4096", help="context lengths of part (a) (default 1024,2048,4096)")
    ap.add_argument("--new-tokens", type=int, default=128, help="new tokens per decode in part (a) (default 128)")
    ap.add_argument("--draft-policies", default="sink:256", help="kv_cache policies drafting in part (a) (default sink:256)")
    ap.add_argument("--with-skip", action=argparse.BooleanOptionalAction, default=True,
                    help="also rows whose drafter skips the layer_skip layers (default yes)")
    ap.add_argument("--quality-policies", default="sink:128,sink:256,sink:512,snapkv:128,snapkv:256,snapkv:512,h2o:256,kivi4,kivi2",
                    help="policies of part (b)")
    ap.add_argument("--quality-prompt", type=int, default=1024, help="prompt tokens before scoring in part (b) (default 1024)")
    ap.add_argument("--quality-tokens", type=int, default=256, help="tokens scored in part (b) (default 256)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(HERE / "results_kv_cache.json"))
    ap.add_argument("--plot", default=str(HERE / "kv_cache.png"))
    args = ap.parse_args(argv)

    import speccomp

    torch.set_num_threads(args.threads)
    model, tok = speccomp.load_default_model()
    report = {"command": " ".join(["python", "benchmarks/kv_cache.py", *(sys.argv[1:] if argv is None else argv)]),
              "settings": vars(args), "load_start": os.getloadavg(), "text_tokens": int(text_ids(tok).shape[1])}
    speed = part_speed(model, tok, args) if args.part in ("speed", "both") else []
    quality = part_quality(model, tok, args) if args.part in ("quality", "both") else []
    report.update(speed=speed, quality=quality, load_end=os.getloadavg())

    if speed:
        print(f"\n(a) lossless drafting over a compressed cache: {args.new_tokens} new tokens, {args.threads} threads")
        print("| context | row | tok/s | speedup vs plain | speedup vs HF | tau | identical | draft KV bytes / full |")
        print("|---:|---|---:|---:|---:|---:|---|---:|")
        for r in speed:
            kv = f"{r['kv_bytes_draft'] / 2**20:.1f} MiB / {r['kv_bytes_full'] / 2**20:.1f} MiB" if r.get("kv_bytes_draft") else "–"
            print(f"| {r['context']} | {r['row']} | {r['tokens_per_second']:.1f} | {r['speedup_vs_plain']:.2f}x | "
                  f"{r['speedup_vs_hf']:.2f}x | {r['tau']:.2f} | {'yes' if r['identical'] else 'NO'} | {kv} |")
    if quality:
        print(f"\n(b) LOSSY, the model reads the compressed cache: prompt {args.quality_prompt} tokens, "
              f"{args.quality_tokens} tokens decoded and scored")
        print("| policy | perplexity | full-cache perplexity | delta | mean KL (nats) | KV held | full | less memory | closed form equal |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for q in quality:
            print(f"| {q['kv_cache']} | {q['perplexity_compressed']:.3f} | {q['perplexity_full']:.3f} | "
                  f"{q['perplexity_delta']:+.3f} | {q['mean_kl']:.4f} | {q['kv_bytes_compressed'] / 2**20:.2f} MiB | "
                  f"{q['kv_bytes_full'] / 2**20:.2f} MiB | {q['memory_ratio']:.2f}x | "
                  f"{q['kv_bytes_compressed'] == q['kv_bytes_compressed_closed_form']} |")
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    plot(speed, quality, Path(args.plot))
    print(f"\nwritten to {args.json} and {args.plot}")
    return 0 if all(r["identical"] for r in speed) else 1


if __name__ == "__main__":
    sys.exit(main())
