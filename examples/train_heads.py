"""Train small Hydra draft heads on the model's own continuations, then decode with them.

    python examples/train_heads.py                 # SmolLM2-135M-Instruct, 16 shipped prompts (several minutes)
    python examples/train_heads.py --tiny          # a tiny random Llama with small settings: seconds
    python examples/train_heads.py --out my-heads  # keep the heads (default: a temporary directory)

Shows: speccomp.train_heads(model, prompts, out=DIR, kind="hydra", ...) self-distills (the model greedily continues
each prompt), trains heads that predict the next tokens from the last hidden state (and, for Hydra, the tokens drafted
before), and writes DIR/config.json + safetensors (with DIR/_train/: the distilled text and a resumable checkpoint).
speccomp.compile(model, drafter="hydra", drafter_options={"heads": DIR}) drafts with them; the target still verifies
every token, so the output equals HF greedy. Exits 1 if it does not.
"""
import argparse
import tempfile
from pathlib import Path

import torch

import speccomp

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
parser.add_argument("--out", help="directory to keep the heads in, new or empty (default: a temporary directory)")
args = parser.parse_args()

if args.tiny:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)).eval()
    g = torch.Generator().manual_seed(1)
    prompts, eos = [torch.randint(3, 96, (1, 10), generator=g) for _ in range(8)], 2
    settings = dict(num_heads=2, max_new_tokens=24, epochs=6, lr=3e-2, batch_size=32, draft_vocab=64, progress=False)
else:
    from speccomp.models import chat_ids
    from speccomp.prompts import load_prompts

    model, tokenizer = speccomp.load_default_model()
    texts = load_prompts("alpaca", limit=8) + load_prompts("humaneval", limit=8)
    prompts, eos = [chat_ids(tokenizer, p.text) for p in texts], tokenizer.eos_token_id
    settings = dict(num_heads=3, max_new_tokens=64, epochs=2)
    torch.set_num_threads(min(2, torch.get_num_threads()))

tmp = tempfile.TemporaryDirectory(prefix="speccomp-heads-")  # removed at exit; --out keeps the heads
out = Path(args.out or Path(tmp.name) / "hydra")
heads = speccomp.train_heads(model, prompts, out=out, kind="hydra", seed=0, eos_token_id=eos, **settings)
print(f"trained {type(heads).__name__} ({settings['num_heads']} heads, {sum(p.numel() for p in heads.parameters())} "
      f"parameters) -> {out}: {sorted(p.name for p in out.iterdir())}")

fast = speccomp.compile(model, drafter="hydra", drafter_options={"heads": str(out)})
ids = prompts[0]  # a training prompt: the heads learned how the model continues it
out_ids = fast.generate(ids, max_new_tokens=24, eos_token_id=eos)
ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                     eos_token_id=eos, pad_token_id=eos)
stats = fast.last_stats
print(f"{fast}: {stats['new_tokens']} tokens in {stats['steps']} target forwards, tau {stats['tau']:.2f}")
identical = torch.equal(out_ids, ref)
print(f"identical: {identical}")
raise SystemExit(0 if identical else 1)
