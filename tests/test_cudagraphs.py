"""The cudagraphs backend (backends/cudagraphs.py): decode steps over the whole preallocated cache, replayed from CUDA
graphs on a GPU.

No GPU in CI: the static-shape form (the whole cache read, its free slots behind the padding mask) runs here with
`capture=False` through the same `GraphedStep`, greedy-equal to HF with plain decoding, trees, a self-drafter and a
sliding-window model, with the free slots filled with large values first (a mask in the wrong place changes the
text). The capture itself is checked on a GPU (skipped without one; benchmarks/gpu_check.py with `--backends cudagraphs`).
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
    sizes = {q for q, address in fast.step.seen if address == buffer.data_ptr()}
    assert all(q & (q - 1) == 0 for q in sizes), f"steps padded to power-of-two widths (few graphs): {sizes}"
    steps = sizes - {16}  # the prefill of 14 tokens ran at width 16
    assert 1 in steps or drafter is not None, "plain steps went through the static form"
    if drafter is not None:
        assert max(steps) > 1, "tree steps went through the static form"
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
    sizes = {q for q, _ in fast.step.seen} - {16}  # the prefill (12 tokens at width 16) aside
    assert 1 in sizes and max(sizes) > 1, "plain and tree steps went through the static form"


def cached_step_inputs(step, past: int = 12, q: int = 3, poison=float("nan")):
    """A tiny_llama step of q chained tokens after `past` random cached ones in one of `step`'s buffers, its free
    slots filled with `poison`."""
    from speccomp.frontend.convention import KVSpec

    cache = step.new_cache(KVSpec(3, 2, 8, torch.float32), 40, "cpu")
    cache.data.fill_(poison)
    cache.data[..., :past, :] = torch.randn(3, 2, 1, 2, past, 8, generator=torch.Generator().manual_seed(0))
    cache.length = past
    ids = torch.randint(3, 96, (1, q), generator=torch.Generator().manual_seed(1))
    return cache, (ids, torch.arange(past, past + q)[None], torch.ones(1, past + q, dtype=torch.long), cache.past(),
                   torch.ones(q, q, dtype=torch.bool).tril())


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_free_slots_change_nothing(poison):
    """A masked key still enters attention's arithmetic (-inf + NaN, 0 * NaN): the step zeroes the free slots first
    (they hold rejected drafts or an earlier generation's entries)."""
    fast = static(speccomp.compile(tiny_llama()))
    cache, args = cached_step_inputs(fast.step, poison=poison)
    got = fast.step(*args)
    assert fast.step.seen, "the static form ran"
    clean = cache.data.clone()
    want = fast.step.step(*args[:3], clean[..., :12, :], args[4])  # eager over the 12 slots in use, no free slot read
    assert torch.isfinite(got[0]).all()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_exact_widths_without_padding():
    """pad=False: every tree size its own shape (the form a graph per size would take), the same text."""
    model = tiny_llama()
    fast = speccomp.compile(model, drafter="token_recycling", tree=[[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]])
    fast.step = GraphedStep(fast.step, capture=False, pad=False)
    prompt = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(3))
    prompt[0, 8:] = prompt[0, :8]
    want, _ = hf_greedy_with_margin(model, prompt, NEW)
    assert torch.equal(fast.generate(prompt, max_new_tokens=NEW), want)
    assert any(q & (q - 1) for q, _ in fast.step.seen), "a tree size that is no power of two ran unpadded"


def test_calls_outside_the_static_form_run_the_eager_step():
    """Passed through untouched: a past that is not one of the step's buffers (a user's tensor, another cache), a
    tree mask reaching back past the step's own tokens (a self-drafter's scratch levels), a view of some layers only,
    more tokens than MAX_TREE."""
    from speccomp.runtime.calls import MAX_TREE

    fast = static(speccomp.compile(tiny_llama()))
    step = fast.step
    past = torch.randn(3, 2, 1, 2, 5, 8)
    args = (torch.tensor([[4]]), torch.tensor([[5]]), torch.ones(1, 6, dtype=torch.long), past,
            torch.ones(1, 1, dtype=torch.bool))
    got, want = step(*args), step.step(*args)
    assert torch.equal(got[0], want[0]) and not step.seen
    cache, (ids, pos, mask, view, tree) = cached_step_inputs(step, poison=0.0)
    assert step._whole_cache((ids, pos, mask, view, tree)) is cache.data  # the static form's own case
    assert step._whole_cache((ids, pos, mask, view, torch.ones(3, 5, dtype=torch.bool))) is None  # T = 5 > q = 3
    assert step._whole_cache((ids, pos, mask, cache.data[:2, ..., :12, :], tree)) is None  # two of three layers
    assert step._whole_cache((ids, pos, mask, cache.data[..., 1:12, :], tree)) is None  # not from slot 0
    long = torch.randint(3, 96, (1, MAX_TREE + 1))
    assert step._whole_cache((long, pos, mask, view, torch.ones(MAX_TREE + 1, MAX_TREE + 1, dtype=torch.bool))) is None


def test_a_failed_capture_says_so_once_and_decodes_eagerly():
    """On the CPU every capture fails (no CUDA): a RuntimeWarning naming the reason, then the eager step, exact."""
    model = tiny_llama()
    fast = speccomp.compile(model)
    fast.step = GraphedStep(fast.step, capture=True)
    prompt = seeded_prompt(12, 96)
    want, _ = hf_greedy_with_margin(model, prompt, NEW)
    with pytest.warns(RuntimeWarning, match="capture failed") as warned:
        assert torch.equal(fast.generate(prompt, max_new_tokens=NEW), want)
    assert len(warned) == 1 and fast.step.refusal and not fast.step.graphs and fast.step.replays == 0


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
        fast.step.new_cache(fast.kv, prompt.shape[1] + NEW + fast.max_tree + 1, "cuda").data.fill_(float("nan"))
        assert torch.equal(fast.generate(prompt, max_new_tokens=NEW), want)
    assert fast.step.refusal is None and fast.step.replays > NEW // 2 and fast.step.graphs


def test_autotune_times_the_steps_decoding_runs():
    """autotune's step timings go through the static form too (on a GPU: the graphs, not eager steps 10x slower)."""
    from speccomp.tuning.autotune import time_steps

    fast = static(speccomp.compile(tiny_llama(), drafter="token_recycling"))
    prompts = [torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    timing = time_steps(fast, prompts, context_len=16, sizes=[1, 4], repeats=1)
    assert {q for q, _ in fast.step.seen} >= {1, 4} and timing
