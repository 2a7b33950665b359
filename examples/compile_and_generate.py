"""Compile a Hugging Face causal LM and decode speculatively: the same tokens as HF greedy, in fewer forwards.

    python examples/compile_and_generate.py            # SmolLM2-135M-Instruct (speccomp.load_default_model())
    python examples/compile_and_generate.py --tiny     # a tiny random Llama built here: runs in seconds
    python examples/compile_and_generate.py --device cuda --backend cudagraphs   # on a GPU: steps replayed as graphs

Shows: speccomp.compile(model, drafter=...) -> generate -> token-for-token equal to model.generate(do_sample=False),
with tokens/s and tau (tokens per target forward) from fast.last_stats; then speccomp.capture(model) once and
speccomp.compile(captured, drafter=...) twice (one torch.export, two compiled models).
Exits 1 if any output differs from HF greedy.
"""
import argparse
import time

import torch

import speccomp

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
parser.add_argument("--drafter", default="token_recycling", help=f"one of {speccomp.available_drafters()}")
parser.add_argument("--backend", default="eager", help="eager (default), onnxruntime (the quantized drafter needs it), ...")
parser.add_argument("--device", default="cpu", help="cpu (default) or cuda (with --backend cudagraphs or triton)")
parser.add_argument("--max-new-tokens", type=int, default=None)
args = parser.parse_args()

if args.tiny:  # any HF *ForCausalLM works; this one is random, seeded, and fast
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)).eval()
    ids = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(2)).repeat(3)[None]  # repetitive
    eos, n = 2, args.max_new_tokens or 40
else:
    from speccomp.models import chat_ids

    model, tokenizer = speccomp.load_default_model()
    ids = chat_ids(tokenizer, "List the planets of the solar system, one per line, with one fact about each.")
    eos, n = tokenizer.eos_token_id, args.max_new_tokens or 128
    torch.set_num_threads(min(2, torch.get_num_threads()))
model, ids = model.to(args.device), ids.to(args.device)


def hf_greedy(ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)


start = time.perf_counter()
ref = hf_greedy(ids)
hf_tps = (ref.shape[1] - ids.shape[1]) / (time.perf_counter() - start)

fast = speccomp.compile(model, drafter=args.drafter, backend=args.backend)
print(fast)
out = fast.generate(ids, max_new_tokens=n, eos_token_id=eos)
stats = fast.last_stats
print(f"HF greedy:   {hf_tps:7.1f} tokens/s")  # on the tiny model Python overhead, not the model, sets the speed
print(f"speccomp:    {stats['tokens_per_second']:7.1f} tokens/s, {stats['new_tokens']} tokens in {stats['steps']} "
      f"target forwards, tau {stats['tau']:.2f}")
if not args.tiny:
    print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
identical = torch.equal(out, ref)

# one capture (torch.export runs once), compiled two ways
captured = speccomp.capture(model)
for drafter in ("ngram", "early_exit"):
    other = speccomp.compile(captured, drafter=drafter)
    same = torch.equal(other.generate(ids, max_new_tokens=n, eos_token_id=eos), ref)
    print(f"from one capture, drafter={drafter!r}: tau {other.last_stats['tau']:.2f}, identical: {same}")
    identical = identical and same

print(f"identical: {identical}")
raise SystemExit(0 if identical else 1)
