"""SpecModel: what `speccomp.compile` returns. `generate` (one call at a time, lossless), `export` (an engine)."""
from __future__ import annotations

import contextlib
import copy
import functools
import threading
import time

import numpy as np
import torch

from speccomp.drafters.registry import max_tree_nodes
from speccomp.errors import OptionError, OptionTypeError, SpeccompError
from speccomp.frontend.graph import SpecGraph
from speccomp.runtime.batch import check_batchable, decode_batch, step_costs
from speccomp.runtime.budget import Budget
from speccomp.runtime.calls import (ACCEPTANCE, CallGuard, batch_rows, check_context, check_unmasked_padding,
                                    choice, generate_args, model_pad_id, one_padded_row, pad_id, row_seed)
from speccomp.runtime.decode import FullCache, RootOnly, Sequence, decode
from speccomp.runtime.sampling import Sampler
from speccomp.tuning.step_curve import load_curve


_HOST = {"lock": threading.Lock(), "inside": 0, "before": 1}  # host_threads' calls in flight, process-wide


def user_threads() -> int:
    """torch's thread count as the user set it: inside host_threads (ONNX Runtime runs) it is 1 for the while."""
    with _HOST["lock"]:
        return _HOST["before"] if _HOST["inside"] else torch.get_num_threads()


@contextlib.contextmanager
def host_threads(backend: str):
    """One torch thread while ONNX Runtime runs every graph. torch then only does the host-side work between runs
    (argmax, Token Recycling's top-k, the cache's bookkeeping): with more threads OpenMP's workers spin after each of
    those small ops on the cores ONNX Runtime's pool is about to use (measured on 2 cores, SmolLM2, a batch of 2 with
    token_recycling: each forward 24.4 instead of 28.7 ms, top-k 0.23 instead of 1.1 ms). torch's thread count is
    process-wide (another thread sees it too): the first call in sets it, the last one out restores it, so calls on
    several models in several threads may overlap."""
    from speccomp.backends import is_onnxruntime

    if not is_onnxruntime(backend):
        yield
        return
    with _HOST["lock"]:
        if _HOST["inside"] == 0:
            _HOST["before"] = torch.get_num_threads()
            torch.set_num_threads(1)
        _HOST["inside"] += 1
    try:
        yield
    finally:
        with _HOST["lock"]:
            _HOST["inside"] -= 1
            if _HOST["inside"] == 0:
                torch.set_num_threads(_HOST["before"])


SAMPLE_STRIDE = 997  # every 997th value of each weight: ~7 ms a call for SmolLM2's 135M (all of them: ~150 ms)


def weights_stamp(gm, model=None) -> tuple[list, list]:
    """What identifies a graph's parameters' values cheaply: name, in-place version counter, storage, dtype, device
    (an in-place write bumps the version; load_state_dict copies in place; .to() swaps the storage), the model's own
    parameter objects (load_state_dict(assign=True) or a replaced submodule puts new ones in the model, not the
    graph), and a sample of each weight's bits (a write through .data, torch._foreach_*_ or a fused optimizer step
    bumps no version)."""
    stamp = [(name, p._version, p.data_ptr(), p.dtype, p.device) for name, p in gm.named_parameters()]
    if isinstance(model, torch.nn.Module):
        stamp += [(f"model.{name}", id(p)) for name, p in model.named_parameters()]
    sample = [_bits(p.detach().reshape(-1)[::SAMPLE_STRIDE]) for p in gm.parameters()]
    return stamp, sample


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x`'s bytes (compared bit for bit: NaN weights equal themselves)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x).view(torch.uint8)


def _without_autocast(method):
    """Run `method` outside any torch.autocast region of the caller's: the graphs run in the dtype compile saw (the
    eager backend's packed float32 linears refused bfloat16 activations with a oneDNN error), as ONNX files do."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with torch.autocast(self.device.type, enabled=False):
            return method(self, *args, **kwargs)
    return run


class SpecModel:
    """A compiled causal LM. `generate` returns prompt + new tokens, like HF `generate`.

    Thread safety: `generate` may be called from several threads; calls on one SpecModel run one at a time
    (drafters keep per-generation state), and `last_stats` is the calling thread's own last call's."""

    export_refusal: str | None = None  # why `export` must refuse this kind of model (None: it can export)
    batch_refusal: str | None = None  # why generate must refuse a batch on this kind of model (None: it batches)

    def __init__(self, spec_graph: SpecGraph, step, backend: str, drafter=None, model=None):
        self.graph = spec_graph
        self.model = model  # the source model (identity for export manifests)
        self.step = step
        self.backend = backend
        self.drafter = drafter
        self.kv = spec_graph.captured.kv
        self.max_positions = spec_graph.captured.max_positions
        self._calls = CallGuard()
        self.max_tree = max_tree_nodes(spec_graph.structure)
        weight = next(iter(spec_graph.gm.parameters()), None)
        self.device = weight.device if weight is not None else torch.device("cpu")
        self._weights = weights_stamp(spec_graph.gm, model)

    def check_weights(self) -> None:
        """Refuse to decode after the model's weights changed (in place, load_state_dict, an optimizer step, .to()):
        the lowered graphs hold what compile saw (packed linears, ONNX files) beside what the model holds now, so the
        text would be neither model's."""
        (stamp, sample), (was, was_sample) = weights_stamp(self.graph.gm, self.model), self._weights
        if stamp != was:
            changed = next((a[0] for a, b in zip(was, stamp) if a != b), "the list of parameters")
        else:
            names = [name for name, _ in self.graph.gm.named_parameters()]
            changed = next((name for name, a, b in zip(names, was_sample, sample) if not torch.equal(a, b)), None)
        if changed is not None:
            raise SpeccompError(f"the model's weights changed after compile ({changed}, ...): a compiled model "
                                "decodes the weights it was compiled with; compile it again")

    @property
    def last_stats(self) -> dict:
        """new_tokens, steps (target forwards), tau, seconds, acceptance_by_depth, ... of this thread's last call."""
        return self._calls.stats

    @property
    def providers(self) -> list[str] | None:
        """The ONNX Runtime execution providers the sessions really run on (None: not an ONNX Runtime backend)."""
        return getattr(self.step, "providers", None)

    def __copy__(self) -> "SpecModel":  # a shallow copy shares the graphs (and so their lock), not the stats
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._calls = CallGuard(lock=self._calls.lock)
        return new

    def __deepcopy__(self, memo):
        raise SpeccompError("a compiled model cannot be deep-copied or pickled (its lowered graphs hold packed "
                            "weights, compiled kernels or ONNX Runtime sessions): compile it again (from one "
                            "speccomp.capture(model) to export it once), or export() an engine and load() it")

    def __reduce__(self):
        self.__deepcopy__(None)

    def with_drafter(self, drafter) -> "SpecModel":
        """A copy that shares this model's lowered graphs (and so its lock) but drafts with `drafter` (own stats)."""
        new = copy.copy(self)  # __copy__: the graphs (and their lock) shared, its own stats
        new.drafter = drafter
        return new

    def __repr__(self) -> str:
        about = self.drafter.describe() if self.drafter is not None else {"name": None, "tree": None}
        drafter, tree = about["name"], about["tree"]
        shape = f", tree={tree}" if tree is not None else ""
        on = f", providers={self.providers}" if self.providers else ""
        return (f"{type(self).__name__}({self.graph.captured.model_type}, drafter={drafter!r}{shape}, "
                f"backend={self.backend!r}{on})")

    @_without_autocast
    def generate(
        self,
        input_ids,
        max_new_tokens: int,
        eos_token_id=None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        acceptance: str = "exact",
        attention_mask=None,
        pad_token_id: int | None = None,
        load_aware: bool = True,
    ) -> torch.Tensor:
        """input_ids: [seq] or [1, seq] token ids (a LongTensor, an integer array or a list; [1, seq] left-padded with
        `attention_mask` decodes the row and puts its padding back in front, as HF does), or a batch [B, seq]
        left-padded with `attention_mask` (0 on padding) as for HF generate: each row is decoded as if alone
        (speccomp/runtime/batch.py) and the result is [B, seq + m], rows that stopped early padded on the right with
        `pad_token_id` (default, as HF: the model's generation_config.pad_token_id, else the first eos id); `load_aware`
        caps each row's tree step by step where the batch's goodput says trees cost more than they gain
        (speccomp/runtime/budget.py; False: every row verifies its drafter's whole tree). eos_token_id: an int or a list
        of ints (None: no stop token; HF's generate stops at its generation_config's eos). acceptance: "exact"
        (lossless: greedy equality / rejection sampling) or "typical-lossy" (Medusa's typical acceptance with
        do_sample=True; LOSSY, the text no longer follows the model's distribution; `last_stats["lossless"]` says which
        ran). A batch's first row samples with `seed`, the others with seeds derived from (seed, row) (calls.row_seed);
        a seed repeats its tokens where the trees repeat (README, "Seeds"). Every argument is checked before any work
        (speccomp/runtime/calls.py); a bad one raises OptionError / OptionTypeError naming it."""
        if not isinstance(load_aware, bool):  # checked for one sequence too, where it changes nothing
            raise OptionTypeError("load_aware", load_aware, "must be True or False")
        self.check_weights()
        vocab = self.graph.captured.vocab_size
        check_unmasked_padding(input_ids, attention_mask, pad_token_id, model_pad_id(self.model, vocab), eos_token_id,
                               getattr(getattr(self.model, "generation_config", None), "eos_token_id", None))
        input_ids, attention_mask, padding = one_padded_row(input_ids, attention_mask)  # [1, n] left-padded
        rows = batch_rows(input_ids, attention_mask)
        if rows is not None:
            return self._generate_batch(input_ids, rows, max_new_tokens, eos_token_id, do_sample, temperature, top_p,
                                        seed, acceptance, pad_token_id, load_aware)
        args = generate_args(input_ids, max_new_tokens, eos_token_id, do_sample, temperature, top_p, seed,
                             vocab_size=vocab, max_positions=self.max_positions)
        self._check_call(args, acceptance)
        pad_id(pad_token_id, args.eos, vocab)  # unused by one sequence, checked all the same
        if isinstance(input_ids, torch.Tensor):
            device, given = input_ids.device, input_ids.reshape(1, -1).long()
        else:
            device, given = self.device, torch.from_numpy(args.prompt)[None]
        prompt = given.to(self.device)  # decoded where the model is, answered where the prompt was
        sampler = Sampler(args.do_sample, args.temperature, args.top_p, args.seed)
        with self._calls.lock, host_threads(self.backend):
            new, stats = self._decode(prompt, args, sampler, acceptance)
            self._calls.stats = stats
        out = torch.cat([given.to(device), new[None].to(device)], dim=1)
        return out if padding is None else torch.cat([torch.as_tensor(padding).to(out), out], dim=1)  # as HF returns

    def step_costs(self):
        """The target's step-cost curve t(q, past) (runtime/budget.py's StepCosts): the grid autotune stored for this
        model, backend and machine (tuning/step_curve.py), any other point measured at its first use."""
        if getattr(self, "_step_costs", None) is None:
            self._step_costs = step_costs(self.step, self.kv, self.device, threads=lambda: host_threads(self.backend),
                                          measured=load_curve(self.model, self.backend, user_threads()),
                                          max_positions=self.max_positions)
        return self._step_costs

    def _check_call(self, args, acceptance: str) -> None:
        choice("acceptance", acceptance, ACCEPTANCE)
        check_context(self.drafter, len(args.prompt), args.max_new_tokens)
        if acceptance != "exact" and not args.do_sample:
            raise OptionError("acceptance", acceptance, "only changes sampling", "with greedy decoding use 'exact'")
        if acceptance != "exact" and self.drafter is None:
            raise OptionError("acceptance", acceptance, "needs a drafter (plain decoding accepts nothing)")

    def _generate_batch(self, input_ids, rows, max_new_tokens, eos_token_id, do_sample, temperature, top_p, seed,
                        acceptance, pad_token_id, load_aware) -> torch.Tensor:
        """A batch: every row checked as a single generate's, then decoded together (speccomp/runtime/batch.py)."""
        vocab = self.graph.captured.vocab_size
        args = [generate_args(r, max_new_tokens, eos_token_id, do_sample, temperature, top_p, seed, vocab_size=vocab,
                              max_positions=self.max_positions) for r in rows]
        for a in args:
            self._check_call(a, acceptance)
        check_batchable(self, len(rows))
        eos = args[0].eos
        pad = pad_id(pad_token_id, eos, vocab, model_pad_id(self.model, vocab))
        a = args[0]
        seqs = [Sequence(r.prompt.tolist(), (self.drafter or RootOnly()).fresh(),
                         Sampler(a.do_sample, a.temperature, a.top_p, row_seed(a.seed, i)),
                         a.max_new_tokens, eos, self.max_tree, acceptance) for i, r in enumerate(args)]
        with self._calls.lock, host_threads(self.backend):
            start = time.perf_counter()
            budget = Budget(self.step_costs(), self.max_tree) if load_aware and self.drafter is not None else None
            forwards = decode_batch(self.step, self.kv, self.device, seqs, self.max_tree, budget)
            seconds = time.perf_counter() - start
            new_tokens = sum(len(s.out) for s in seqs)
            self._calls.stats = {"batch": len(seqs), "forwards": forwards, "new_tokens": new_tokens,
                                 "seconds": seconds, "tokens_per_second": new_tokens / seconds,
                                 "rows": [s.stats.as_dict() for s in seqs], "acceptance": acceptance,
                                 "lossless": acceptance == "exact", "backend": self.backend,
                                 "providers": self.providers}
        device = input_ids.device if isinstance(input_ids, torch.Tensor) else self.device
        given = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(np.asarray(input_ids))
        width = max(len(s.out) for s in seqs)
        new = torch.full((len(seqs), width), pad, dtype=torch.long)
        for i, s in enumerate(seqs):
            new[i, : len(s.out)] = torch.tensor(s.out)
        return torch.cat([given.long().to(device), new.to(device)], dim=1)

    def _decode(self, prompt: torch.Tensor, args, sampler: Sampler, acceptance: str) -> tuple[torch.Tensor, dict]:
        """(new tokens [m], stats): the one decode loop (speccomp/runtime/decode.py) over this model's verifier;
        plain decoding is the loop with a drafter that drafts nothing."""
        new, stats = decode(self._verifier(prompt, args.max_new_tokens), self.drafter or RootOnly(), prompt,
                            args.max_new_tokens, set(args.eos), sampler, self.max_tree, acceptance)
        return new, {**stats.as_dict(), "acceptance": acceptance, "lossless": acceptance == "exact",
                     "backend": self.backend, "providers": self.providers}

    def _verifier(self, prompt: torch.Tensor, max_new_tokens: int):
        """The target side of the loop for one generation: the target graph over a fresh full cache."""
        return FullCache(self.step, self.kv, prompt.shape[1] + max_new_tokens + self.max_tree + 1, prompt.device)

    def export(self, path, tokenizer=None, overwrite: bool = False, model_id: str | None = None):
        """Write an engine directory (ONNX graph + manifest.json [+ tokenizer.json]) that `speccomp.load`
        runs with ONNX Runtime and numpy only. Plain decoding, every named drafter (and merges) and the
        compressed-KV drafter (kv_cache=, kv_mode="draft") export; the LOSSY kv_mode="target" does not.
        `path` must be a new or empty directory, or with overwrite=True an engine export wrote (nothing of
        anyone else's is ever deleted: speccomp/engine/export.py's `check_destination`). `model_id`: the name the
        manifest records and `speccomp serve` answers as (default: the model config's name_or_path)."""
        from speccomp.engine.export import export_engine

        self.check_weights()
        if self.export_refusal:
            from speccomp.engine.runtime import EngineError

            raise EngineError(self.export_refusal)
        if model_id is not None and not (isinstance(model_id, str) and model_id.strip()):
            raise OptionTypeError("model_id", model_id, "must be a non-empty string", "e.g. model_id='my-model'")
        return export_engine(self, path, tokenizer=tokenizer, overwrite=overwrite, model_id=model_id)


