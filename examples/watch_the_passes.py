"""Watch the compiler: SPECCOMP_DEBUG=1 dumps the FX graph's code after every pass, one file per pass.

    python examples/watch_the_passes.py                # SmolLM2-135M-Instruct
    python examples/watch_the_passes.py --tiny         # a tiny random Llama: seconds
    python examples/watch_the_passes.py --out dumps/   # keep the files (default: a temporary directory); a folder
                                                       # that holds files gets them in a new run-N folder inside

Shows: speccomp.compile(model, drafter="early_exit") with SPECCOMP_DEBUG=1 and SPECCOMP_DEBUG_DIR set. Two graphs
go through the passes: the target (captured -> tree_attention -> the eager backend's lowering passes) and the
early-exit drafter (captured -> early_exit -> tree_attention -> lowering). Files are named NN_<passes so far>.py,
NN counting the dumps in order (speccomp/frontend/graph.py `dump`): NN_tree_attention.py is the target's, the
NN_captured.py just before it its input.
Then prints which aten ops TreeAttention added and removed, counted from the dumped code.
"""
import argparse
import os
import re
import tempfile
from collections import Counter
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
parser.add_argument("--out", help="directory to keep the graph dumps in (default: a temporary directory)")
args = parser.parse_args()

tmp = tempfile.TemporaryDirectory(prefix="speccomp-debug-")  # removed at exit; --out keeps the dumps
out = Path(args.out or tmp.name)
os.environ["SPECCOMP_DEBUG"] = "1"  # read by every pass run: prints one line per pass to stderr
os.environ["SPECCOMP_DEBUG_DIR"] = str(out)

import torch  # noqa: E402

import speccomp  # noqa: E402

if args.tiny:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)).eval()
else:
    model, _ = speccomp.load_default_model()

fast = speccomp.compile(model, drafter="early_exit")
print(f"compiled {fast}; the passes applied to the target graph: {fast.graph.applied}")
from speccomp.frontend.graph import dump_folder  # noqa: E402

out = dump_folder()  # --out itself, or a run-N folder inside it where it already held files: nothing is overwritten
if out is None:
    raise SystemExit("no graph dumps were written (see speccomp's message above)")

files = sorted(p.name for p in out.glob("*.py"))
print(f"{len(files)} graph dumps in {out}:")
for name in files:
    print(f"  {name:<36} {len((out / name).read_text().splitlines()):>5} lines")


def op_counts(path: Path) -> Counter:
    return Counter(re.findall(r"torch\.ops\.([\w.]+)\(", path.read_text()))


target = next(name for name in files if re.fullmatch(r"\d+_tree_attention\.py", name))
source = max(name for name in files if name.endswith("_captured.py") and name < target)
before, after = op_counts(out / source), op_counts(out / target)
print(f"{source} -> {target}:")
print("aten ops changed by tree_attention (it also removes the capture's dead metadata asserts):")
for op in sorted(set(before) | set(after), key=lambda op: after[op] - before[op]):
    if after[op] != before[op]:
        print(f"  {op:<40} {before[op]:>4} -> {after[op]:<4} ({after[op] - before[op]:+d})")
print(f"tree_mask is a graph input now: {'tree_mask' in fast.graph.input_names()}")
ok = "tree_mask" in fast.graph.input_names() and len(files) >= 4 and after != before
raise SystemExit(0 if ok else 1)
