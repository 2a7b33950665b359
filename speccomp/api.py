"""`speccomp.compile(model)`: capture -> passes -> lower -> a model with `.generate`."""
from __future__ import annotations

import torch

from .capture import capture
from .errors import SpeccompError
from .graph import SpecGraph, run_passes
from .runtime import decode_plain
from .sampling import Sampler

DRAFTERS: dict[str, object] = {}  # name -> drafter factory; filled by the drafter modules


def available_drafters() -> list[str]:
    return sorted(DRAFTERS)


def _choice(name: str, value, accepted) -> None:
    if value not in accepted:
        raise ValueError(f"unknown {name} {value!r}; accepted values: {sorted(accepted, key=str)}")


class SpecModel:
    """A compiled causal LM. `generate` returns prompt + new tokens, like HF `generate`."""

    def __init__(self, spec_graph: SpecGraph, step, backend: str):
        self.graph = spec_graph
        self.step = step
        self.backend = backend
        self.kv = spec_graph.captured.kv
        self.max_positions = spec_graph.captured.max_positions
        self.last_stats: dict = {}

    def _check_inputs(self, input_ids, max_new_tokens, temperature, top_p) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.LongTensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [seq] or [1, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"speccomp decodes one sequence at a time (batch size 1), got batch size {input_ids.shape[0]}; "
                "call generate once per prompt"
            )
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty; give at least one prompt token")
        vocab = self.graph.captured.vocab_size
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise ValueError(f"input_ids must be in [0, {vocab}), got values in [{int(input_ids.min())}, {int(input_ids.max())}]")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if self.max_positions is not None and input_ids.shape[1] + max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
                f"of {self.max_positions} positions; shorten the prompt or ask for fewer tokens"
            )
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        return input_ids.long()

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        eos_token_id=None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> torch.Tensor:
        input_ids = self._check_inputs(input_ids, max_new_tokens, temperature, top_p)
        if eos_token_id is None:
            eos = set()
        elif isinstance(eos_token_id, int):
            eos = {eos_token_id}
        else:
            eos = {int(e) for e in eos_token_id}
        sampler = Sampler(do_sample, temperature, top_p, seed)
        new, stats = decode_plain(self.step, self.kv, input_ids, max_new_tokens, eos, sampler)
        self.last_stats = stats.as_dict()
        return torch.cat([input_ids, new[None]], dim=1)


def compile(model, *, drafter=None, tree=None, kv_cache=None, backend: str = "eager") -> SpecModel:  # noqa: A001
    """Capture `model` with torch.export, rewrite the graph for speculative decoding, lower it.

    drafter: None (plain decoding) or one of `available_drafters()`.
    backend: "eager".
    """
    from speccomp.backends import BACKENDS, lower

    _choice("backend", backend, BACKENDS)
    if drafter is not None:
        _choice("drafter", drafter, DRAFTERS)
    if tree is not None:
        raise ValueError("tree= needs a drafter; accepted values without one: [None]")
    if kv_cache is not None:
        raise ValueError(f"unknown kv_cache {kv_cache!r}; accepted values: [None]")
    try:
        captured = capture(model)
    except SpeccompError:
        raise
    sg = run_passes(SpecGraph.from_captured(captured), [])
    return SpecModel(sg, lower(sg, backend), backend)
