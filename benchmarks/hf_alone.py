"""HF greedy alone in its own process (no ONNX Runtime loaded), on the prompts a backends.py run used.

    python benchmarks/hf_alone.py > benchmarks/results_hf_alone.json      # results_engine_merged.json's 10 prompts
    python benchmarks/hf_alone.py --files alpaca,gsm8k,humaneval,vicuna_bench --limit 7 --skip 2,3

A check on that benchmark's baseline, which was timed in the same process as ONNX Runtime sessions whose thread
pools may spin between runs (run it on an otherwise idle machine). --files / --limit / --skip select prompts as
backends.py's flags of the same names do, through its own select_prompts (defaults: its README runs' gsm8k and
vicuna_bench, 6 each, the 3rd left out)."""
import argparse
import json
import time

import torch

import speccomp
from backends import select_prompts, skip_indices  # this script's folder is on sys.path when run as above

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--files", default="gsm8k,vicuna_bench")
ap.add_argument("--limit", type=int, default=6)
ap.add_argument("--skip", default="2", type=skip_indices, help="0-based prompt indices left out of every file, "
                "comma-separated")
ap.add_argument("--max-new-tokens", type=int, default=256)
args = ap.parse_args()
torch.set_num_threads(2)
model, tok = speccomp.load_default_model()
prompts = [ids for _, ids in select_prompts(tok, args.files, args.limit, args.skip)]
model.generate(prompts[0][:, :32], attention_mask=torch.ones_like(prompts[0][:, :32]), max_new_tokens=8, do_sample=False)
secs, toks = [], 0
for ids in prompts:
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    secs.append(time.perf_counter() - t); toks += out.shape[1] - ids.shape[1]
print(json.dumps({"hf_alone_tokens_per_second": toks / sum(secs), "new_tokens": toks, "prompt_seconds": secs,
                  "files": args.files, "limit": args.limit, "skip": args.skip}))
