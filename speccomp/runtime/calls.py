"""What `generate` means in both runtimes, SpecModel (torch) and the exported Engine (numpy only), written
once: its arguments' checks, its calling discipline and `Generation`, the text both loops emit. This module imports
neither torch nor anything that does.

Calling discipline (`CallGuard`): one generate runs at a time per model (a lock: drafters keep per-generation
state, sessions keep bindings), and `last_stats` is the stats of the calling thread's own last call, so
threads may share a model and each reads its own numbers (a thread that never called reads the latest).

Arguments:

Integers may be Python ints, numpy integers or 0-d integer arrays/tensors (anything `operator.index`
takes), never bools; sequences of token ids are lists, tuples, sets or 1-D integer arrays/tensors, never
strings (a string is a sequence of characters: "88" would otherwise stop at token 8). A wrong type is an
`OptionTypeError`, a wrong value an `OptionError`; both name the parameter, the value and the fix.
"""
from __future__ import annotations

import math
import operator
import threading
import warnings
from dataclasses import dataclass

import numpy as np

from speccomp.errors import OptionError, OptionTypeError

ACCEPTANCE = ("exact", "typical-lossy")
MAX_TREE = 64  # nodes (root included) one verification may hold (both runtimes; sliding windows can lower it)


def as_int(name: str, value, fix: str = "") -> int:
    """`value` as a Python int, or an OptionTypeError naming `name`."""
    if isinstance(value, (bool, np.bool_)) or getattr(value, "dtype", None) in (bool, np.bool_):
        raise OptionTypeError(name, value, "must be an int, got a bool", fix)
    if str(getattr(value, "dtype", "")) == "torch.bool":
        raise OptionTypeError(name, value, "must be an int, got a bool tensor", fix)
    try:
        return operator.index(value)
    except TypeError:
        raise OptionTypeError(name, value, f"must be an int, got {type(value).__name__}", fix) from None


def as_number(name: str, value, fix: str = "") -> float:
    """`value` as a finite float (ints, numpy numbers and 0-d arrays/tensors welcome; bools, strings, NaN not)."""
    zero_d = getattr(value, "ndim", None) == 0 and "bool" not in str(getattr(value, "dtype", "bool"))
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, (int, float, np.integer, np.floating)) or zero_d):
        raise OptionTypeError(name, value, f"must be a number, got {type(value).__name__}", fix)
    try:
        number = float(value)
    except OverflowError:  # an int past float's range (a JSON body's 400-digit number)
        number = math.inf
    if not math.isfinite(number):
        raise OptionError(name, value, "must be a finite number", fix)
    return number


def positive_int(name: str, value, fix: str = "") -> int:
    n = as_int(name, value, fix)
    if n <= 0:
        raise OptionError(name, value, "must be a positive int", fix)
    return n


def token_ids(name: str, value, vocab_size: int) -> list[int]:
    """A token id or a sequence of them (see the module docstring), each in [0, vocab_size)."""
    if isinstance(value, (str, bytes)):
        raise OptionTypeError(name, value, "must be a token id (int) or a list of token ids, got a string",
                              f"pass the id itself, e.g. {name}=tokenizer.eos_token_id")
    ndim = getattr(value, "ndim", None)
    if ndim == 0 or isinstance(value, (int, np.integer)) or (ndim is None and not hasattr(value, "__iter__")):
        ids = [as_int(name, value)]
    elif ndim is not None and ndim != 1:
        raise OptionError(name, value, f"must be an int or a 1-D sequence of ints, got {ndim} dimensions")
    else:
        ids = [as_int(name, v, "every entry must be a token id (int)") for v in value]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise OptionError(name, value, f"token ids {bad[:4]} are outside the vocabulary [0, {vocab_size}) and could "
                          "never be generated", "pass ids of this model's tokenizer")
    return ids


@dataclass(frozen=True)
class GenerateArgs:
    """generate()'s options, checked and normalised."""

    prompt: np.ndarray  # int64 [n]
    max_new_tokens: int
    eos: tuple  # in the order given, each id once (a batch pads with the first, as HF)
    do_sample: bool
    temperature: float
    top_p: float
    seed: int | None


class Generation:
    """One generation's text, for both runtimes' loops (decode.py's Sequence, the engine's _Row): the prompt, the
    tokens emitted so far (`context` is both; its last token is the next tree's root), and when it is done."""

    def __init__(self, prompt, max_new_tokens: int, eos, max_tree: int):
        self.prompt, self.max_new_tokens, self.eos, self.max_tree = list(prompt), max_new_tokens, set(eos), max_tree
        self.out: list[int] = []
        self.context = list(self.prompt)

    @property
    def done(self) -> bool:
        return bool(self.out) and (len(self.out) >= self.max_new_tokens or self.out[-1] in self.eos)

    def room(self, max_nodes: int | None) -> tuple[int, int]:
        """(tokens still allowed, the bonus included; the tree's node cap). `max_nodes`: a batch's cap for this row
        this step (runtime/budget.py); a cap of 1 asks the drafter for nothing."""
        return self.max_new_tokens - len(self.out), self.max_tree if max_nodes is None else min(max_nodes, self.max_tree)

    def finish(self) -> None:
        """The generation ended (returned, or a batch let the row go): its drafter, if any, is handed the whole text
        (Drafter.finish: suffix decoding's memory keeps it)."""
        drafter = getattr(self, "drafter", None)
        if drafter is not None:
            drafter.finish(self.prompt + self.out)

    def _emit(self, tokens) -> None:
        """Accepted tokens, up to the first eos or max_new_tokens."""
        for t in map(int, tokens):
            self.out.append(t)
            if t in self.eos or len(self.out) >= self.max_new_tokens:
                break
        self.context.extend(self.out[len(self.context) - len(self.prompt):])


def _prompt(input_ids, vocab_size: int):
    """The prompt as a 1-D int64 numpy array (an integer array/tensor is checked without a Python loop)."""
    shape = getattr(input_ids, "shape", None)
    if shape is None and not isinstance(input_ids, (list, tuple)):
        raise OptionTypeError("input_ids", input_ids, f"must be token ids ([seq] or [1, seq]), got {type(input_ids).__name__}",
                              "pass a LongTensor / int64 array such as tokenizer(text, return_tensors='pt').input_ids")
    if shape is None:  # a list: [ids] or [[ids]]
        rows = input_ids if input_ids and isinstance(input_ids[0], (list, tuple)) else [input_ids]
        shape = (len(rows), len(rows[0]) if rows else 0)
        flat = [as_int(f"input_ids[{i}]", v, "every entry must be a token id") for i, v in enumerate(v for r in rows for v in r)]
        if flat:  # checked as Python ints: an id past int64 would overflow the array first
            _check_ids_in(min(flat), max(flat), vocab_size, input_ids)
        ids = np.array(flat, dtype=np.int64)
    else:
        dtype = str(getattr(input_ids, "dtype", ""))
        if "int" not in dtype:  # torch.int64, int32, uint8, ...: not float, bool or object
            raise OptionTypeError("input_ids", input_ids, f"must hold integer token ids, got dtype {dtype}")
        ids = None
    shape = tuple(shape)
    if len(shape) not in (1, 2):
        _wrong_rank(input_ids, shape)
    if len(shape) == 2 and shape[0] != 1:  # generate() splits batches into rows first (batch_rows)
        raise OptionError("input_ids", input_ids, f"holds a batch of {shape[0]} sequences where one is expected")
    if shape[-1] == 0:
        raise OptionError("input_ids", input_ids, "is empty", "give at least one prompt token")
    if ids is None:
        host = input_ids.detach().cpu() if hasattr(input_ids, "detach") else input_ids  # a torch tensor
        ids = np.asarray(host).reshape(-1).astype(np.int64, copy=False)
    _check_ids_in(int(ids.min()), int(ids.max()), vocab_size, input_ids)
    return ids


def _check_ids_in(lo: int, hi: int, vocab_size: int, input_ids) -> None:
    if lo < 0 or hi >= vocab_size:
        raise OptionError("input_ids", input_ids, f"token ids must be in [0, {vocab_size}), got values in [{lo}, {hi}]",
                          "encode the prompt with this model's tokenizer")


def host_array(x) -> np.ndarray:
    """A tensor (any device; bfloat16 and float16 masks too, which numpy cannot hold), array or list as numpy."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        x = x.float() if x.is_floating_point() else x
    return np.asarray(x)


def one_padded_row(input_ids, attention_mask):
    """A batch of one, [1, n], left-padded (a tokenizer pads a list of one prompt too), as (the row without its
    padding [1, m], no mask, the padding columns [1, n - m] that go back in front of the output, as HF returns them);
    anything else as (input_ids, attention_mask, None), for batch_rows to split or refuse."""
    nested = isinstance(input_ids, (list, tuple)) and len(input_ids) == 1 and isinstance(input_ids[0], (list, tuple))
    shape = (1, len(input_ids[0])) if nested else tuple(getattr(input_ids, "shape", ()))
    if attention_mask is None or len(shape) != 2 or shape[0] != 1:
        return input_ids, attention_mask, None
    mask = host_array(attention_mask)
    if mask.shape != shape or mask.all() or not np.isin(mask, (0, 1)).all():  # batch_rows says what is wrong
        return input_ids, attention_mask, None
    first = _first_token(mask[0], 0)
    if nested:  # [[pad, pad, id, ...]]: an array, as a batch of lists is read (generate_args checks its ids)
        input_ids = np.asarray(input_ids)
    return input_ids[:, first:], None, input_ids[:, :first]


def _first_token(mask_row: np.ndarray, b: int) -> int:
    """Where row `b`'s tokens start after its left padding; a row of padding only, or with a hole, is refused."""
    first = int(mask_row.argmax())
    if not mask_row.any() or not mask_row[first:].all():
        raise OptionError("attention_mask", f"row {b}", "is not left-padded (zeros, then at least one 1)",
                          "pad on the left (tokenizer.padding_side = 'left'), as for HF generate")
    return first


def _wrong_rank(input_ids, shape: tuple):
    raise OptionError("input_ids", input_ids, f"must be [seq], [1, seq] or a batch [B, seq], got shape {shape}")


def batch_rows(input_ids, attention_mask) -> list[np.ndarray] | None:
    """The prompts of a batch input_ids [B, n] (B > 1), each without its left padding (attention_mask 0), or None for
    one sequence ([n] or [1, n], whose attention_mask, if given, must be all ones). Token ids are checked per row by
    `generate_args`."""
    if isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], (list, tuple)):
        lengths = sorted({len(r) for r in input_ids})
        if len(lengths) > 1:
            raise OptionError("input_ids", f"rows of lengths {lengths}", "is ragged",
                              "left-pad the rows to one length and pass attention_mask (0 on the padding), as HF "
                              "tokenizers do with padding_side='left'")
        input_ids = np.array(input_ids)
    shape = tuple(getattr(input_ids, "shape", ()))
    if isinstance(input_ids, (list, tuple)) and not shape:  # one sequence as a list of ids
        shape = (len(input_ids),)
    if len(shape) > 2:  # before the mask's checks: their messages speak of one sequence or of a batch
        _wrong_rank(input_ids, shape)
    mask = None
    if attention_mask is not None:
        mask = host_array(attention_mask)
        if mask.shape != shape and not (len(shape) == 1 and mask.shape == (1, shape[0])):
            raise OptionError("attention_mask", f"shape {mask.shape}", f"must have input_ids' shape {shape}")
        if not np.isin(mask, (0, 1)).all():
            raise OptionError("attention_mask", attention_mask, "must hold 0 (padding) and 1 (token) only")
    if len(shape) != 2 or shape[0] == 1:
        if mask is not None and not mask.all():
            raise OptionError("attention_mask", attention_mask, "has padding (zeros) for a single sequence",
                              "pass the sequence without its padding")
        return None
    if shape[0] == 0:
        raise OptionError("input_ids", input_ids, "holds no sequences (batch of 0)")
    if shape[1] == 0:
        raise OptionError("input_ids", f"shape {tuple(shape)}", "is empty", "give every row at least one prompt token")
    if hasattr(input_ids, "dtype") and "int" not in str(input_ids.dtype):
        raise OptionTypeError("input_ids", f"{type(input_ids).__name__} of {input_ids.dtype}",
                              "must hold integer token ids", "e.g. tokenizer(..., return_tensors='pt').input_ids")
    ids = host_array(input_ids)
    if mask is None:
        mask = np.ones(shape, dtype=np.int64)
    return [ids[b, _first_token(mask[b], b):] for b in range(shape[0])]


def left_pad(rows, pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token-id rows of different lengths as a left-padded batch: (input_ids, attention_mask), int64 [B, longest],
    what generate(input_ids, attention_mask=...) takes (as HF tokenizers pad with padding_side="left")."""
    rows = [np.asarray(r.detach().cpu() if hasattr(r, "detach") else r, dtype=np.int64).reshape(-1) for r in rows]
    n = max(len(r) for r in rows)
    ids = np.full((len(rows), n), pad, dtype=np.int64)
    mask = np.zeros((len(rows), n), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, n - len(r):], mask[i, n - len(r):] = r, 1
    return ids, mask


def row_slots(prompt_len: int, max_new_tokens: int, max_tree: int) -> int:
    """Cache slots a row of a batch needs at most: its text, plus the room its last step's tree is verified in."""
    return prompt_len + max_new_tokens + max_tree + 1


def pad_id(pad_token_id, eos, vocab_size: int, model_pad=None) -> int:
    """The id a batch pads stopped rows with, as HF's generate picks it: `pad_token_id` (one token id of the
    vocabulary), else the model's own (`model_pad`: `model_pad_id`'s, or an engine manifest's), else the first eos
    id given, else 0 (without eos every row runs to max_new_tokens)."""
    if pad_token_id is None:
        return model_pad if model_pad is not None else eos[0] if eos else 0
    if isinstance(pad_token_id, (list, tuple)) or getattr(pad_token_id, "ndim", 0) != 0:
        raise OptionTypeError("pad_token_id", pad_token_id, "must be one token id (an int)")
    return token_ids("pad_token_id", pad_token_id, vocab_size)[0]


def check_unmasked_padding(input_ids, attention_mask, pad_token_id, model_pad, eos_token_id, model_eos) -> None:
    """Without attention_mask, HF's generate reads the pad id (pad_token_id, else the model's) as padding wherever it
    sits (attention_mask = input_ids != pad), unless it is an eos id (eos_token_id, else the model's: `model_eos`);
    speccomp reads every token it is given. A row that starts with it (left padding given without its mask: another
    text, silently) is refused, naming both."""
    pad = model_pad if pad_token_id is None else pad_token_id
    eos_token_id = model_eos if eos_token_id is None else eos_token_id
    if attention_mask is not None or not isinstance(pad, (int, np.integer)) or isinstance(pad, bool):
        return
    try:
        ids = np.asarray(host_array(input_ids))
        eos = np.ravel(host_array(eos_token_id)) if eos_token_id is not None else ()
    except (TypeError, ValueError):  # ragged rows, a string: generate_args names them
        return
    if ids.ndim in (1, 2) and ids.size and pad not in eos and (ids.reshape(-1, ids.shape[-1])[:, 0] == pad).any():
        raise OptionError("attention_mask", None, f"is missing and input_ids starts with the pad id {pad}: HF's "
                          f"generate reads that as left padding (attention_mask = input_ids != {pad}), speccomp "
                          "would read every token given", "pass the tokenizer's attention_mask (or the ids unpadded)")


def model_pad_id(model, vocab_size: int) -> int | None:
    """The pad id HF's generate pads a batch with when given none: the model's generation_config's; None for a plain
    module, a config without one, or one past the LM head's rows (an added token never resized into the model)."""
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    return pad if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < vocab_size else None


def run_batch(batch, rows: list) -> int:
    """Add `rows` to `batch` (runtime/batch.py's Batch or the engine's EngineBatch) and step it until every row is
    done, each leaving as it finishes; the number of target forwards."""
    for row in rows:
        batch.add(row)
    while batch.rows:
        batch.step()
        for rid in [r for r, row in batch.rows.items() if row.done]:
            batch.remove(rid)
    return batch.forwards


def tightest_context(drafters) -> int | None:
    """A merge's context: the shortest of its parts' (a draft model's `max_positions`), None where none has one."""
    return min((d.max_positions for d in drafters if getattr(d, "max_positions", None)), default=None)


def check_context(drafter, prompt_len: int, max_new_tokens: int) -> None:
    """A drafter with a context of its own (a draft model's `max_positions`) must hold the whole text: refused before
    any work, naming the drafter's limit (the target's is `generate_args`')."""
    limit = getattr(drafter, "max_positions", None)
    if limit is not None and prompt_len + max_new_tokens > limit:
        name = getattr(drafter, "name", type(drafter).__name__)
        raise OptionError("max_new_tokens", max_new_tokens, f"prompt ({prompt_len} tokens) + max_new_tokens "
                          f"({max_new_tokens}) exceeds the {name} drafter's context of {limit} positions",
                          "shorten the prompt, ask for fewer tokens, or use a drafter with a longer context")


def row_seed(seed: int | None, row: int) -> int | None:
    """The sampling seed of row `row` of a batch generated with `seed` (both runtimes): `seed` itself for the first
    row (a batch of one samples as a single call does), a hash of (seed, row) for the others, so that no row repeats
    a row of a call with a nearby seed (seed + row would: row 1 of seed 0 was row 0 of seed 1)."""
    if seed is None or row == 0:
        return seed
    return int(np.random.SeedSequence([seed, row]).generate_state(1, np.uint64)[0] >> np.uint64(1))  # < 2**63


def generate_args(input_ids, max_new_tokens, eos_token_id, do_sample, temperature, top_p, seed, *,
                  vocab_size: int, max_positions: int | None) -> GenerateArgs:
    """Check everything generate() was given, before any work; returns the normalised values."""
    prompt = _prompt(input_ids, vocab_size)
    n = positive_int("max_new_tokens", max_new_tokens, "ask for at least one new token")
    if max_positions is not None and len(prompt) + n > max_positions:
        raise OptionError("max_new_tokens", max_new_tokens, f"prompt ({len(prompt)} tokens) + max_new_tokens ({n}) "
                          f"exceeds the model's context of {max_positions} positions",
                          "shorten the prompt or ask for fewer tokens")
    eos = () if eos_token_id is None else tuple(dict.fromkeys(token_ids("eos_token_id", eos_token_id, vocab_size)))
    if not isinstance(do_sample, (bool, np.bool_)):
        raise OptionTypeError("do_sample", do_sample, f"must be True or False, got {type(do_sample).__name__}",
                              "a string such as 'False' is not a bool")
    t = as_number("temperature", temperature, "pass a float > 0 such as 0.7")
    if not (t > 0 or (t == 0 and not do_sample)):  # 0 with greedy decoding is greedy decoding (HF accepts it too)
        raise OptionError("temperature", temperature, "must be > 0", "use do_sample=False for greedy decoding")
    p = as_number("top_p", top_p, "pass a float in (0, 1]")
    if not 0 < p <= 1:
        raise OptionError("top_p", top_p, "must be in (0, 1]", "1.0 keeps the whole distribution")
    if seed is not None:
        seed = as_int("seed", seed, "pass an int >= 0, or None for a fresh seed")
        if not 0 <= seed < 2**63:
            raise OptionError("seed", seed, "must be in [0, 2**63)")
    if not do_sample and (t not in (0.0, 1.0) or p != 1.0 or seed is not None):  # as HF: greedy reads none of them
        warnings.warn(f"temperature={temperature!r} / top_p={top_p!r} / seed={seed!r} are ignored without "
                      "do_sample=True (greedy decoding); pass do_sample=True to sample", UserWarning, stacklevel=3)
    return GenerateArgs(prompt, n, eos, bool(do_sample), t if t > 0 else 1.0, p, seed)


def choice(name: str, value, accepted) -> None:
    """`value` must be one of `accepted`; a value of the wrong type (a list where names are expected, say) is an
    OptionTypeError, an unknown one an OptionError; both list what is accepted."""
    names = sorted(accepted, key=str)
    if value is not None and not isinstance(value, str) and all(isinstance(a, str) for a in accepted if a is not None):
        raise OptionTypeError(name, value, f"must be a str, got {type(value).__name__}", f"accepted values: {names}")
    try:
        known = value in accepted
    except TypeError:  # unhashable
        raise OptionTypeError(name, value, f"cannot be a {type(value).__name__}", f"accepted values: {names}") from None
    if not known:
        raise OptionError(name, value, f"unknown {name}", f"accepted values: {names}")


class CallGuard:
    """The lock generate() holds and the per-thread `last_stats` (see the module docstring). Copies of a model
    that share its lowered graphs share its lock (`lock=`) but keep their own stats."""

    def __init__(self, lock=None):
        self.lock = lock or threading.Lock()
        self._local = threading.local()
        self._latest: dict = {}

    @property
    def stats(self) -> dict:
        return getattr(self._local, "stats", self._latest)

    @stats.setter
    def stats(self, value: dict) -> None:  # set while holding `lock`, so `_latest` is the last call to finish
        self._local.stats = self._latest = value
