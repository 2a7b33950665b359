"""Export a compiled model as an engine directory and run it in a process where `import torch` fails.

    python examples/engine_without_torch.py                  # SmolLM2-135M-Instruct (ONNX export: a minute or two)
    python examples/engine_without_torch.py --tiny           # a tiny random Llama: seconds
    python examples/engine_without_torch.py --out my-engine  # keep the engine (a new or empty directory)

Shows: speccomp.compile(model, drafter="token_recycling", backend="onnxruntime").export(DIR, tokenizer=...) writes
target.onnx + manifest.json (+ tokenizer.json); speccomp.load(DIR) runs it with ONNX Runtime and numpy alone. The
child process sets sys.modules["torch"] = None before `import speccomp`, so any import of torch would raise.
Its tokens must equal the torch model's (HF greedy). Exits 1 if they do not.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import speccomp

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
parser.add_argument("--out", help="engine directory to keep, new or empty (default: a temporary directory)")
args = parser.parse_args()

if args.tiny:  # no tokenizer: the engine takes and returns token ids
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)).eval()
    tokenizer, eos, n = None, 2, 40
    ids = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(2)).repeat(3)[None]
else:
    from speccomp.models import chat_ids

    model, tokenizer = speccomp.load_default_model()
    eos, n = tokenizer.eos_token_id, 64
    ids = chat_ids(tokenizer, "Name three primary colors and one fact about each.")

tmp = tempfile.TemporaryDirectory(prefix="speccomp-engine-")  # removed at exit; --out keeps the engine
engine_dir = Path(args.out or Path(tmp.name) / "engine")
fast = speccomp.compile(model, drafter="token_recycling", backend="onnxruntime")
fast.export(engine_dir, tokenizer=tokenizer)
print(f"engine in {engine_dir}: {sorted(p.name for p in engine_dir.iterdir())}")

CHILD = """
import json, sys
sys.modules["torch"] = None  # from here on `import torch` raises ImportError
import speccomp
engine = speccomp.load(sys.argv[1])
ids, n, eos = json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
out = engine.generate(ids, max_new_tokens=n, eos_token_id=eos)[0].tolist()
print(f"child: {engine}, tau {engine.last_stats['tau']:.2f}, torch imported: {sys.modules['torch'] is not None}")
if engine.tokenizer is not None:
    print("child:", engine.decode(out[len(ids):]))
print(json.dumps(out))
"""
child = subprocess.run([sys.executable, "-c", CHILD, str(engine_dir), json.dumps(ids[0].tolist()), str(n),
                        json.dumps(eos)], capture_output=True, text=True, timeout=600)
if child.returncode != 0:
    raise SystemExit(f"the engine process failed:\n{child.stderr}")
*lines, last = child.stdout.strip().splitlines()
print("\n".join(lines))
engine_out = json.loads(last)

ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                     eos_token_id=eos, pad_token_id=eos)[0].tolist()
print(f"engine (no torch): {len(engine_out) - ids.shape[1]} new tokens, the last ones {engine_out[-10:]}")
print(f"torch model:       {len(ref) - ids.shape[1]} new tokens, the last ones {ref[-10:]}")
identical = engine_out == ref
print(f"identical: {identical}")
raise SystemExit(0 if identical else 1)
