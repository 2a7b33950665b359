"""Autotune a drafter's token tree on this machine, then compile with tree="auto".

    python examples/autotune_tree.py                  # SmolLM2-135M-Instruct (several minutes)
    python examples/autotune_tree.py --tiny           # a tiny random Llama with small settings: seconds
    python examples/autotune_tree.py --keep           # store the tree in your speccomp cache for later tree="auto"

Shows: speccomp.autotune(model, "token_recycling", prompts, ...) measures acceptance by depth and rank and the step
costs here, runs Sequoia's tree DP (speccomp/tuning/autotune.py), decodes the best candidates and stores the fastest
(or that plain decoding beat them all here); then speccomp.compile(model, drafter="token_recycling", tree="auto") reads
it back. The result is stored under
$SPECCOMP_CACHE, which this script points at a temporary directory unless --keep is given.
Exits 1 if the tree="auto" model's output differs from HF greedy.
"""
import argparse
import os
import tempfile

import torch

import speccomp

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
parser.add_argument("--keep", action="store_true", help="store the result in your speccomp cache (default: a temp dir)")
args = parser.parse_args()

if args.tiny:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)).eval()
    g = torch.Generator().manual_seed(0)
    prompts, eos = [torch.randint(3, 96, (6,), generator=g).repeat(2)[None] for _ in range(2)], 2
    settings = dict(max_new_tokens=24, repeats=2, max_nodes=12)
    test_ids = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(2)).repeat(3)[None]
else:
    from speccomp.models import chat_ids
    from speccomp.prompts import load_prompts

    model, tokenizer = speccomp.load_default_model()  # from your cache: loaded before SPECCOMP_CACHE moves
    prompts, eos = [chat_ids(tokenizer, p.text) for p in load_prompts(limit=4)], tokenizer.eos_token_id
    settings = dict(max_new_tokens=64, repeats=3, max_nodes=32, progress=True)
    test_ids = chat_ids(tokenizer, "Give me three tips for learning to cook.")
    torch.set_num_threads(min(2, torch.get_num_threads()))  # the tuned tree is keyed by the thread count too

if not args.keep:
    tmp = tempfile.TemporaryDirectory(prefix="speccomp-cache-")  # removed at exit
    os.environ["SPECCOMP_CACHE"] = tmp.name

result = speccomp.autotune(model, "token_recycling", prompts, eos_token_id=eos, **settings)
print(result.summary())
print(f"chosen tree ({result.mode}, {len(result.tree) + 1} nodes): {result.tree}")

fast = speccomp.compile(model, drafter="token_recycling", tree="auto")  # the stored tree
out = fast.generate(test_ids, max_new_tokens=40, eos_token_id=eos)
ref = model.generate(test_ids, attention_mask=torch.ones_like(test_ids), max_new_tokens=40, do_sample=False,
                     eos_token_id=eos, pad_token_id=eos)
if fast.drafter is None:  # autotune measured plain decoding faster than every tree here (result.plain; warned)
    print(f"tree='auto': plain decoding (no tree paid on this machine), tau {fast.last_stats['tau']:.2f}")
else:
    print(f"tree='auto': {fast.drafter.tree.size} nodes, tau {fast.last_stats['tau']:.2f}")
identical = torch.equal(out, ref)
print(f"identical: {identical}")
raise SystemExit(0 if identical else 1)
