"""backend="inductor": torch.compile of the rewritten graphs decodes exactly like the model and does not
recompile step after step."""
import pytest
import torch

import speccomp
from tiny_models import ARCHITECTURES, tiny_llama


def hf_greedy(model, ids, n, eos=2):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(num_hidden_layers=4, initializer_range=0.2)


def test_inductor_greedy_identical_and_compiles_once_per_call_class(llama):
    """layer_skip: the target graph (prefill, tree verification) and the drafter's graph (one token) both run
    compiled. Plain decoding on inductor is checked past the sliding window below."""
    from speccomp.backends.inductor import InductorStep

    drafter = "layer_skip"
    fast = speccomp.compile(llama, drafter=drafter, backend="inductor", drafter_options={"skip": [1, 2]})
    assert isinstance(fast.step, InductorStep)
    outs = []
    for seed in (0, 1):
        base = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(seed))
        ids = base.repeat(3)[None]
        out = fast.generate(ids, max_new_tokens=24, eos_token_id=2)
        assert torch.equal(out, hf_greedy(llama, ids, 24)), (drafter, seed)
        outs.append(fast.step.compiles)
    # one compilation per class of call (prefill, single token, several tokens), never one per step
    assert 1 <= outs[-1] <= 3, f"compilations after each generation: {outs}"
    assert fast.drafter.step.compiles <= 3, "the drafter graph runs compiled too, once per call class"


def test_inductor_sliding_window_past_the_window():
    """Plain decoding (one token per step) past mistral's sliding window."""
    model = ARCHITECTURES["mistral"].build()
    fast = speccomp.compile(model, backend="inductor")
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    assert torch.equal(fast.generate(ids, max_new_tokens=30, eos_token_id=2), hf_greedy(model, ids, 30))
    assert fast.step.compiles <= 2  # prefill and the single-token step
