"""HF greedy alone in its own process (no ONNX Runtime loaded): the 10 prompts of results_engine_merged.json.

    python benchmarks/hf_alone.py > benchmarks/results_hf_alone.json

A check on that benchmark's baseline, which was timed in the same process as ONNX Runtime sessions whose thread
pools may spin between runs (run it on an otherwise idle machine)."""
import json
import time

import torch

import speccomp
from speccomp.models import chat_ids
from speccomp.prompts import load_prompts
torch.set_num_threads(2)
model, tok = speccomp.load_default_model()
prompts = [chat_ids(tok, p.text) for f in ("gsm8k", "vicuna_bench")
           for i, p in enumerate(load_prompts(f"speccomp/data/prompts/{f}.jsonl", limit=6)) if i != 2]
model.generate(prompts[0][:, :32], attention_mask=torch.ones_like(prompts[0][:, :32]), max_new_tokens=8, do_sample=False)
secs, toks = [], 0
for ids in prompts:
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=256, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    secs.append(time.perf_counter() - t); toks += out.shape[1] - ids.shape[1]
print(json.dumps({"hf_alone_tokens_per_second": toks / sum(secs), "new_tokens": toks, "prompt_seconds": secs}))
