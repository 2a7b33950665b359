"""Extend speccomp: (a) your own graph pass, (b) your own drafter.

    python examples/custom_pass_and_drafter.py          # SmolLM2-135M-Instruct
    python examples/custom_pass_and_drafter.py --tiny   # a tiny random Llama: seconds

(a) A Pass (speccomp/frontend/graph.py) has a name, `check` (raise GraphStructureError when the graph lacks what the
    pass expects) and `rewrite` (edit the torch.fx graph in place; run_passes then drops dead code, lints, recompiles).
    SiluToSigmoid rewrites every aten.silu(x) into x * sigmoid(x): the op counts change, the logits do not.
(b) A Drafter (speccomp/runtime/decode.py) proposes a token tree each step: propose(ctx) -> Draft(tree, tokens), with
    tokens[0] = the root (the last token so far); optional begin(prompt) / observe(draft, path, logits) hooks. It
    declares what it reads (`reads`: nothing here; "states" / "path_states" to be handed the target's hidden states)
    and which trees it takes (`trees`, with `with_tree`, for autotune); speccomp reads the declaration, never the class.
    LastFollower proposes a chain: the token that followed the root last time, then the one that followed that, ...
    The target verifies every draft, so the output is the model's greedy output whatever the drafter proposes.
Exits 1 if the logits differ, the output differs from HF greedy, or no draft was accepted (tau <= 1).
"""
import argparse

import torch

import speccomp
from speccomp.errors import GraphStructureError
from speccomp.frontend.graph import Pass, SpecGraph, copy_meta, run_passes
from speccomp.runtime.decode import Draft, Drafter
from speccomp.runtime.tree import Tree

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
args = parser.parse_args()

if args.tiny:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)).eval()
    ids, eos = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(2)).repeat(3)[None], 2
else:
    from speccomp.models import chat_ids

    model, tokenizer = speccomp.load_default_model()
    ids, eos = chat_ids(tokenizer, "Write the sentence 'the cat sat on the mat' five times."), tokenizer.eos_token_id

# ---- (a) a graph pass ------------------------------------------------------------------------------------------------
silu = torch.ops.aten.silu.default


class SiluToSigmoid(Pass):
    name = "silu_to_sigmoid"

    def check(self, sg: SpecGraph) -> None:
        if not any(n.target is silu for n in sg.gm.graph.nodes):
            raise GraphStructureError("no aten.silu in the graph: nothing to rewrite (already applied?)")

    def rewrite(self, sg: SpecGraph) -> None:
        graph = sg.gm.graph
        for node in [n for n in graph.nodes if n.target is silu]:
            x = node.args[0]
            with graph.inserting_before(node):
                sigmoid = graph.call_function(torch.ops.aten.sigmoid.default, (x,))
                new = graph.call_function(torch.ops.aten.mul.Tensor, (x, sigmoid))
            copy_meta(new, node).meta["val"] = node.meta.get("val")  # provenance and shape, for later passes
            node.replace_all_uses_with(new)  # the silu is dead now: run_passes removes it


base = SpecGraph.from_captured(speccomp.capture(model))
sg = run_passes(base.clone(), [SiluToSigmoid()])  # passes rewrite in place: keep `base` to compare with
for op in ("aten.silu.default", "aten.sigmoid.default", "aten.mul.Tensor"):
    print(f"{op:<22} {base.op_counts()[op]:>4} -> {sg.op_counts()[op]}")
n = ids.shape[1]
inputs = (ids, torch.arange(n)[None], torch.ones(1, n, dtype=torch.long), torch.zeros(sg.captured.kv.shape(0)))
with torch.no_grad():
    diff = (sg.gm(*inputs)[0] - base.gm(*inputs)[0]).abs().max().item()  # outputs: logits, new_kv, hidden
print(f"max |logits difference| after the pass: {diff:.2e}")
try:
    SiluToSigmoid()(sg)
except GraphStructureError as e:
    print(f"applied twice -> GraphStructureError: {e}")


# ---- (b) a drafter ---------------------------------------------------------------------------------------------------
class LastFollower(Drafter):
    name = "last_follower"
    reads = ()  # only the text so far: no target states, no cache
    trees = ()  # it shapes its own chains (autotune has no tree to tune)

    def __init__(self, depth: int = 4):
        self.depth = depth

    def begin(self, prompt: list[int]) -> None:  # a new generation: forget the last one
        self.follower, self.seen = {}, 0

    def fresh(self) -> "LastFollower":  # a batch gives each row a copy of its own
        return LastFollower(self.depth)

    def propose(self, ctx) -> Draft:
        tokens = ctx.tokens  # prompt + emitted so far; tokens[-1] is the root
        for i in range(max(self.seen - 1, 0), len(tokens) - 1):  # learn what followed what, newest wins
            self.follower[tokens[i]] = tokens[i + 1]
        self.seen = len(tokens)
        chain = [tokens[-1]]
        while len(chain) <= min(self.depth, ctx.max_depth, ctx.max_nodes - 1) and chain[-1] in self.follower:
            chain.append(self.follower[chain[-1]])
        tree = Tree.chain(len(chain) - 1) if len(chain) > 1 else Tree.from_parents([-1])
        return Draft(tree, torch.tensor(chain))


fast = speccomp.compile(model, drafter=LastFollower())
out = fast.generate(ids, max_new_tokens=40, eos_token_id=eos)
ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                     eos_token_id=eos, pad_token_id=eos)
tau = fast.last_stats["tau"]
print(f"{fast}: {fast.last_stats['new_tokens']} tokens in {fast.last_stats['steps']} target forwards, tau {tau:.2f}")
identical = torch.equal(out, ref)
print(f"identical: {identical}")
raise SystemExit(0 if identical and diff < 1e-4 and tau > 1 else 1)
