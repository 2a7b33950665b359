"""cudagraphs backend: the eager graph, its decode steps replayed from CUDA graphs.

Why: on a GPU a decode step of a small model is bound by the host, not the GPU. The eager FX graph launches about a
thousand small kernels one Python call at a time (benchmarks/README.md, "On a GPU": SmolLM2-135M's step took the same
27 to 48 ms for 1 or 64 tokens). A CUDA graph records a step's launches once and replays them with one call.

A graph replays fixed shapes at fixed addresses, so the step stops growing with the context (the in-place cache of
runtime/decode.py's KVCache is the first half): the target reads its whole preallocated cache, the free slots hidden
by the key padding mask that every captured graph honours (left-padded batches rely on it):

    eager:       step(ids[1,q], pos[1,q], mask[1, past+q],                  cache.data[..., :past, :], tree[q,q])
    cudagraphs:  step(ids[1,w], pos[1,w], mask[:, :past] ++ 0 ++ mask[:, past:] ++ 1,  cache.data,  tree'[w,w])
                 [1, C+w]: C = the cache's capacity, w = q rounded up to a power of two (padding, below)

Attention does not care which slot a key sits in: keys carry their rotary position; TreeAttention's window test
reads positions; the older slots in use are slots [0, past) as before, so a model's own causal and window masks see
them as in eager. A masked key still enters the arithmetic (a NaN or inf there would survive the mask: -inf + NaN,
0 * NaN), so each step zeroes the free slots [past, C) first: they hold rejected drafts of this generation or an
earlier generation's entries, nothing anyone reads again (a self-drafter's scratch entries live only inside its
propose, between verifications). Reading all C slots costs a GPU little at these sizes (SmolLM2 at C=2048: 94 MB,
about 25 us at the H200's bandwidth); the step's concatenation of past and new entries copies them once more.

Graphs are kept per (width, buffer) and the cache's storage is this module's (`new_cache`), one buffer per capacity
reused by every generation, so a graph's addresses stay valid. A step of q tokens runs at the next power-of-two
width, padded with tokens that no real token sees (their outputs dropped): trees change size from step to step
(truncated near the end, grown per step), and each new size would otherwise cost an eager step and a capture
(~0.1 s for SmolLM2) in the middle of a generation. A width is captured at its first decode step (a prompt's
width at its second prefill: one-off prompt lengths run eagerly). Everything else runs the eager step unchanged: a past that is not one of these buffers
(a draft model's cache, a compressed cache, a batch), a tree mask reaching back past the step's own tokens (a
self-drafter's scratch levels), more than MAX_TREE tokens. If a capture fails (an op that synchronises with the
host), or the captured graph's first replay differs from the eager step on the same inputs, the step says why once
(warnings) and runs eagerly from then on: slower, never different.

Buffers and graphs live as long as the compiled model (one buffer per power-of-two capacity used, up to 2x the
slots a generation needs; one graph per width and buffer, at most 7).

`capture=False` runs the same static shapes without graphs: what the CPU tests check (no GPU in CI).
"""
from __future__ import annotations

import warnings

import torch

from speccomp.backends.eager import lower_eager
from speccomp.errors import OptionError
from speccomp.runtime.calls import MAX_TREE
from speccomp.runtime.decode import KVCache

MIN_CAPACITY = 256


def check_available() -> None:
    """Fail before the capture where there is no CUDA GPU."""
    if not torch.cuda.is_available():
        raise OptionError("backend", "cudagraphs", "replays CUDA graphs, but torch sees no CUDA GPU here",
                          "use backend='eager' (or 'onnxruntime') on a CPU")


def lower_cudagraphs(sg):
    weight = next(iter(sg.gm.parameters()), None)
    device = weight.device if weight is not None else torch.device("cpu")
    if device.type != "cuda":
        raise OptionError("backend", "cudagraphs", f"replays CUDA graphs, but the model's weights are on {device}",
                          "move the model to the GPU first (model.to('cuda')), or use backend='eager'")
    return GraphedStep(lower_eager(sg))


class GraphedStep:
    """A lowered step (the captured graph's convention) whose whole-cache calls replay CUDA graphs."""

    def __init__(self, step, capture: bool = True, pad: bool = True):
        self.step, self.capture, self.pad = step, capture, pad
        self.graphs: dict[tuple, tuple] = {}  # (width, buffer address) -> (graph, static inputs, static outputs)
        self.seen: dict[tuple, int] = {}
        self.replays = 0  # steps served by a graph (what the GPU test checks)
        self.refusal: str | None = None  # why a capture failed; then every step runs eagerly
        self._buffers: dict[tuple, torch.Tensor] = {}  # (shape, dtype, device) -> the cache storage of that size
        self._pool = None

    def __getattr__(self, name):  # whatever else callers ask of the eager step
        if "step" not in self.__dict__:  # mid-copy or mid-unpickle: no step yet
            raise AttributeError(name)
        return getattr(self.__dict__["step"], name)

    def new_cache(self, kv, capacity: int, device) -> KVCache:
        """A KVCache over this step's buffer of the next power-of-two capacity (one per size, reused: fixed
        addresses). One generation at a time uses it: SpecModel's calls hold its lock."""
        capacity = max(MIN_CAPACITY, 1 << (capacity - 1).bit_length())
        device = torch.empty(0, device=device).device  # "cuda" and "cuda:0" are one device: one buffer
        key = (kv.shape(capacity), kv.dtype, str(device))
        if key not in self._buffers:
            self._buffers[key] = torch.zeros(kv.shape(capacity), dtype=kv.dtype, device=device)
        return KVCache(kv, capacity, device, data=self._buffers[key])

    def __call__(self, *args):
        buffer = self._whole_cache(args)
        if buffer is None:
            return self.step(*args)
        q = args[0].shape[1]
        width = 1 << (q - 1).bit_length() if self.pad else q  # few graphs: a tree of 5..8 nodes runs the 8-token one
        prefill = args[3].shape[-2] == 0  # a prompt: its width may never come back
        outs = self._run((width, buffer.data_ptr()), self._static_inputs(args, buffer, width), buffer, prefill)
        if width == q:
            return outs
        axes = [4 if i == 1 else 1 for i in range(len(outs))]  # the token axis: new_kv's 4, every other output's 1
        if all(x.dim() > a and x.shape[a] == width for x, a in zip(outs, axes)):
            return tuple(x.narrow(a, 0, q) for x, a in zip(outs, axes))
        self.pad = False  # an output without the token axis where the convention puts it: exact sizes from now on
        return self(*args)

    @staticmethod
    def _static_inputs(args, buffer: torch.Tensor, width: int) -> tuple:
        """The call over the whole buffer (module doc), its q tokens padded to `width`: each padding token (a copy of
        the last one at its position) sees the past and itself (so no row is all masked), no real token sees it, and
        its outputs are dropped (`__call__`; where an output lacks the token axis, padding is switched off)."""
        input_ids, position_ids, attention_mask, past_kv, tree_mask = args
        past, q, capacity = past_kv.shape[-2], input_ids.shape[1], buffer.shape[-2]
        buffer[..., past:, :].zero_()  # masked, but a NaN or inf there would still poison attention (module doc)
        if width > q:
            input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(-1, width - q)], 1)
            position_ids = torch.cat([position_ids, position_ids[:, -1:].expand(-1, width - q)], 1)
            grown = torch.eye(width, dtype=tree_mask.dtype, device=tree_mask.device)
            grown[:q, :q] = tree_mask
            tree_mask = grown
        mask = attention_mask.new_ones((*attention_mask.shape[:-1], capacity + width))
        mask[..., past:capacity] = 0
        mask[..., :past] = attention_mask[..., :past]
        mask[..., capacity:capacity + q] = attention_mask[..., past:]
        return input_ids, position_ids, mask, buffer, tree_mask

    def _run(self, key: tuple, inputs: tuple, buffer: torch.Tensor, prefill: bool) -> tuple:
        """The step on static inputs from its graph, captured at the width's first decode step (a prefill's width at
        its second sighting: one-off prompt lengths run eagerly)."""
        self.seen[key] = self.seen.get(key, 0) + 1
        if not self.capture or self.refusal is not None or (key not in self.graphs and prefill and self.seen[key] < 2):
            return self.step(*inputs)
        if key not in self.graphs and not self._record(key, inputs):
            return self.step(*inputs)
        graph, static_in, static_out = self.graphs[key]
        for slot, value in zip(static_in, inputs):
            if slot is not buffer:
                slot.copy_(value)
        with torch.cuda.device(buffer.device):
            graph.replay()
        self.replays += 1
        return tuple(out.clone() for out in static_out)  # the next replay overwrites the static outputs

    def _whole_cache(self, args) -> torch.Tensor | None:
        """The buffer to read whole, when this call fits the static form (the module's list); else None."""
        if len(args) != 5 or not isinstance(args[3], torch.Tensor):
            return None
        input_ids, _, _, past_kv, tree_mask = args
        base, q = past_kv._base, input_ids.shape[1]
        if base is None or not any(base is b for b in self._buffers.values()):
            return None
        starts_at_zero = (past_kv.storage_offset() == base.storage_offset() and past_kv.stride() == base.stride()
                          and past_kv.shape[:-2] == base.shape[:-2])  # every layer, from slot 0
        square = tree_mask.dim() == 2 and tuple(tree_mask.shape) == (q, q)
        return base if starts_at_zero and square and 0 < q <= MAX_TREE and input_ids.shape[0] == 1 else None

    def _record(self, key: tuple, inputs: tuple) -> bool:
        """Capture the step for `key` on the buffer's GPU (warm-up on a side stream first, as CUDA graphs need), then
        replay it once against the eager step's outputs. False (and eager from then on) if either fails."""
        static_in = tuple(x if i == 3 else x.clone() for i, x in enumerate(inputs))
        try:
            with torch.cuda.device(inputs[3].device), torch.no_grad():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        eager = self.step(*static_in)
                torch.cuda.current_stream().wait_stream(side)
                self._pool = self._pool or torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    static_out = self.step(*static_in)
                graph.replay()
                if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max().clamp(min=1)))
                           for a, b in zip(static_out, eager) if a.is_floating_point()):
                    raise RuntimeError("its first replay differs from the eager step on the same inputs")
        except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly (exact), and say so once
            self.refusal = f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly"
            warnings.warn(f"speccomp backend 'cudagraphs': {self.refusal}", RuntimeWarning, stacklevel=3)
            return False
        self.graphs[key] = (graph, static_in, tuple(static_out))
        return True
