"""The cudagraphs backend (backends/cudagraphs.py): decode steps over the whole preallocated cache, replayed from CUDA
graphs on a GPU.

No GPU in CI: the static-shape form (the whole cache read, its free slots behind the padding mask) runs here with
`capture=False` through the same `GraphedStep`, greedy-equal to HF with plain decoding, trees, a self-drafter and a
sliding-window model, with the free slots filled with large values first (a mask in the wrong place changes the
text). The capture itself is checked on a GPU (skipped without one; benchmarks/gpu_check.py's `cudagraphs` section).
"""
import pytest
import torch

import speccomp
from speccomp.backends.cudagraphs import GraphedStep
from speccomp.errors import OptionError
from tiny_models import ARCHITECTURES, hf_greedy_with_margin, seeded_prompt, tiny_llama

NEW = 30


def static(fast):
    """`fast` with its target step in the static-shape form (no graphs: the CPU's version of the backend)."""
    fast.step = GraphedStep(fast.step, capture=False)
    return fast


def poison_free_slots(fast, prompt_len: int, new: int):
    """Fill the whole buffer the next generation will use with large finite values: only the padding mask keeps
    them out of attention."""
    kv = fast.kv
    cache = fast.step.new_cache(kv, prompt_len + new + fast.max_tree + 1, "cpu")
    cache.data.normal_(0, 50, generator=torch.Generator().manual_seed(5))
    return cache.data


@pytest.mark.parametrize("drafter,options,tree", [
    (None, None, None),
    ("token_recycling", None, [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]),
    ("ngram", None, None),
    ("layer_skip", {"skip": [1]}, 2),  # its draft levels read scratch slots: they run eagerly beside the static target
], ids=["plain", "token_recycling", "ngram", "layer_skip"])
def test_static_shapes_equal_hf_greedy(drafter, options, tree):
    model = tiny_llama()
    fast = static(speccomp.compile(model, drafter=drafter, tree=tree, drafter_options=options))
    prompt = torch.randint(0, 96, (1, 14), generator=torch.Generator().manual_seed(3))
    prompt[0, 7:] = prompt[0, :7]  # a repeat, so the lookup drafters find drafts
    want, _ = hf_greedy_with_margin(model, prompt, NEW)
    buffer = poison_free_slots(fast, prompt.shape[1], NEW)
    assert torch.equal(fast.generate(prompt, max_new_tokens=NEW), want)
    capacity = buffer.shape[-2]
    assert capacity >= 256 and capacity & (capacity - 1) == 0, "capacities are powers of two (few graphs)"
    assert (1, capacity) in fast.step.seen or drafter is not None
    if drafter is not None:
        sizes = {q for q, c in fast.step.seen if c == capacity}
        assert max(sizes) > 1, "tree steps went through the static form"
    # a second generation reuses the buffer, the first one's entries now stale in its free slots
    shorter = prompt[:, :9]
    want, _ = hf_greedy_with_margin(model, shorter, NEW)
    assert torch.equal(fast.generate(shorter, max_new_tokens=NEW), want)
    assert fast.step.new_cache(fast.kv, 9 + NEW + fast.max_tree + 1, "cpu").data is buffer


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_static_shapes_with_sliding_windows(name):
    """Windowed layers: the older slots in use are [0, past) as in eager, and the new ones are decided by the tree
    mask, so the window still sees what a sequential decode sees (prompt + reply go well past the window)."""
    model = ARCHITECTURES[name].build()
    fast = static(speccomp.compile(model, drafter="token_recycling", tree=[[0], [1], [0, 0]]))
    prompt = seeded_prompt(12, model.config.vocab_size)
    want, _ = hf_greedy_with_margin(model, prompt, NEW)
    poison_free_slots(fast, prompt.shape[1], NEW)
    assert torch.equal(fast.generate(prompt, max_new_tokens=NEW), want)


def test_calls_outside_the_static_form_run_the_eager_step():
    """A past that is not one of the step's buffers (a user's tensor, another cache) is passed through untouched."""
    fast = static(speccomp.compile(tiny_llama()))
    step = fast.step
    past = torch.randn(3, 2, 1, 2, 5, 8)
    args = (torch.tensor([[4]]), torch.tensor([[5]]), torch.ones(1, 6, dtype=torch.long), past,
            torch.ones(1, 1, dtype=torch.bool))
    got, want = step(*args), step.step(*args)
    assert torch.equal(got[0], want[0]) and not step.seen


def test_refused_without_a_gpu_or_with_the_model_on_the_cpu():
    with pytest.raises(OptionError, match="cudagraphs") as e:
        speccomp.compile(tiny_llama(), backend="cudagraphs")
    assert "backend='eager'" in str(e.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.py runs it there)")
@pytest.mark.parametrize("drafter,tree", [(None, None), ("token_recycling", [[0], [1], [0, 0]])])
def test_graphs_replay_on_the_gpu(drafter, tree):
    model = tiny_llama().cuda()
    fast = speccomp.compile(model, drafter=drafter, tree=tree, backend="cudagraphs")
    prompt = seeded_prompt(12, 96).cuda()
    want, _ = hf_greedy_with_margin(model, prompt, NEW)
    for _ in range(2):  # the second generation replays the graphs the first one captured
        assert torch.equal(fast.generate(prompt, max_new_tokens=NEW), want)
    assert fast.step.refusal is None and fast.step.replays > NEW // 2 and fast.step.graphs


def test_autotune_times_the_steps_decoding_runs():
    """autotune's step timings go through the static form too (on a GPU: the graphs, not eager steps 10x slower)."""
    from speccomp.tuning.autotune import time_steps

    fast = static(speccomp.compile(tiny_llama(), drafter="token_recycling"))
    prompts = [torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    timing = time_steps(fast, prompts, context_len=16, sizes=[1, 4], repeats=1)
    assert {q for q, _ in fast.step.seen} >= {1, 4} and timing
