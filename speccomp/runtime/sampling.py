"""Turning logits into tokens: greedy argmax, or sampling with temperature and top-p.

The warping matches Hugging Face's `TemperatureLogitsWarper` then `TopPLogitsWarper`
(with top_k disabled), so `do_sample=True` draws from the same distribution as
`model.generate(do_sample=True, temperature=T, top_p=P, top_k=0)`.
"""
from __future__ import annotations

import numpy as np
import torch

from speccomp.runtime.topk import top_k


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), through numpy where the logits are float32 on the CPU: torch's CPU argmax scans a 49k-token
    vocabulary about ten times slower than numpy's (benchmarks/host_ops.py: 813 against 65 us for a tree of 20 nodes,
    one thread). Both return the first index of the largest value, NaN counting as the largest."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1)))
    return logits.argmax(-1)


def top_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of each row's k largest logits [n, V] -> [n, k], largest first (k cut to V), through runtime/topk.py's
    numpy where the logits are on the CPU: torch.topk reads a 49k-token vocabulary several times (benchmarks/host_ops.py,
    a tree of 20 nodes, one thread: about 4x slower). Ties: the lower id first, as ONNX Runtime's TopK in an engine's
    graph (torch.topk does not say)."""
    if logits.device.type == "cpu" and not logits.requires_grad:
        return torch.from_numpy(top_k(logits.float().numpy(), k)[1])
    return logits.topk(min(k, logits.shape[-1]), dim=-1).indices


def warp(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities over the vocabulary (last dim) after temperature and nucleus filtering."""
    logits = logits.float()
    # shifted by the max first (softmax does not change): a temperature near 0 then leaves the max at 0 and sends
    # the rest to -inf (the argmax's point mass, ties shared) where logits / temperature alone overflows to inf - inf;
    # one below float32's smallest normal would round to 0 (0 / 0 at the max): it is that point mass already
    logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(dim=-1)


class Sampler:
    """Callable: logits [V] -> token id. Greedy when `do_sample` is False."""

    def __init__(self, do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None):
        self.do_sample, self.temperature, self.top_p = do_sample, temperature, top_p
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp(logits, self.temperature, self.top_p)

    def __call__(self, logits: torch.Tensor) -> int:
        if not self.do_sample:
            return int(argmax(logits))
        return int(torch.multinomial(self.probs(logits).cpu(), 1, generator=self.generator))
