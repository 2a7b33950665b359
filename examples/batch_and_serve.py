"""Decode a batch, then serve an engine over HTTP: every reply is its prompt's own greedy text.

    python examples/batch_and_serve.py            # SmolLM2-135M-Instruct (speccomp.load_default_model())
    python examples/batch_and_serve.py --tiny     # a tiny random Llama built here: runs in seconds

Shows: generate(input_ids [B, n], attention_mask=...) on a left-padded batch (rows packed into one forward a step,
speccomp/runtime/batch.py), each row equal to HF greedy on that prompt alone; then the compiled model exported as an
engine and served by `speccomp serve`'s app (speccomp/serve.py) on a loopback port, answering concurrent requests.
Needs FastAPI, uvicorn and httpx (pip install 'speccomp[serve]'). Exits 1 if any reply differs from HF greedy.
"""
import argparse
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
import uvicorn

import speccomp
from speccomp.serve import make_app

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
args = parser.parse_args()

if args.tiny:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)).eval()
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).repeat(2) for n in (3, 6, 8)]
    tokenizer, eos, n_new = None, 2, 24
else:
    from speccomp.models import chat_ids

    model, tokenizer = speccomp.load_default_model()
    prompts = [chat_ids(tokenizer, t)[0] for t in ("Name three planets.", "What is 7 times 8?", "Say hello in French.")]
    eos, n_new = tokenizer.eos_token_id, 48
    torch.set_num_threads(min(2, torch.get_num_threads()))


def hf_greedy(ids):
    with torch.no_grad():
        out = model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                             max_new_tokens=n_new, eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


want = [hf_greedy(p) for p in prompts]

# 1. a left-padded batch, as HF tokenizers pad for generate
fast = speccomp.compile(model, drafter="token_recycling", backend="onnxruntime")
width = max(len(p) for p in prompts)
ids = torch.zeros(len(prompts), width, dtype=torch.long)
mask = torch.zeros_like(ids)
for i, p in enumerate(prompts):
    ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
out = fast.generate(ids, attention_mask=mask, max_new_tokens=n_new, eos_token_id=eos)
rows = [[t for t in row[width:]] for row in out.tolist()]
rows = [r[: r.index(eos) + 1] if eos in r else r for r in rows]
batch_ok = rows == want
stats = fast.last_stats
print(f"batch of {stats['batch']}: {stats['new_tokens']} tokens in {stats['forwards']} forwards, "
      f"identical to HF greedy: {batch_ok}")

# 2. the same model as an engine behind the server, three clients at once
with tempfile.TemporaryDirectory() as tmp:
    fast.export(f"{tmp}/engine", tokenizer=tokenizer)
    app = make_app(speccomp.load(f"{tmp}/engine"), max_batch=4, kv_slots=2048)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)

    def ask(prompt):
        body = {"prompt": prompt.tolist(), "max_tokens": n_new, "temperature": 0}
        return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300).json()["choices"][0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    server.should_exit = True
serve_ok = [a["token_ids"] for a in answers] == want
for a in answers:
    print(f"served ({a['finish_reason']}): {a['text'][:60]!r}" if tokenizer else f"served: {a['token_ids'][:8]}...")
print(f"served replies identical to HF greedy: {serve_ok}")
print(f"identical: {batch_ok and serve_ok}")
raise SystemExit(0 if batch_ok and serve_ok else 1)
