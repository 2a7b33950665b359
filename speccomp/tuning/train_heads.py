"""Train Medusa, Hydra or EAGLE heads on CPU (frozen backbone) on the model's own outputs (EAGLE: `_train_eagle`).

    heads = speccomp.train_heads(model, prompts=[ids, ...], out="heads/", kind="hydra")

1. Self-distillation text: the model's own greedy reply to each prompt, plus `sampled` replies
   sampled at `temperature` (more, and more varied, text for the same prompts). HF models decode
   a batch of prompts at once (left-padded `generate`; on CPU a batch of 16 costs little more
   than one sequence), other modules one prompt at a time through speccomp.
2. One forward of the plain compiled graph over prompt + reply gives, at every position, the final
   hidden state h_t and the model's greedy next token g_t (its argmax): the labels. Labels come
   from the model, not from the text, so a sampled reply teaches exactly what verification
   checks: after the tokens x_{t+1} .. x_{t+k+1} of a path, the target accepts g_{t+k+1}.
3. Heads: head k learns g_{t+k+1} from h_t (Medusa) or from h_t and x_{t+1} .. x_{t+k+1} (Hydra,
   teacher-forced), over reply positions, cross-entropy weighted 0.8^k as in Medusa, AdamW with a
   linearly decaying learning rate. Projections are the frozen LM head, so only the heads'
   small matrices train. With `soft_labels=S`, each head also learns the model's top-S next-token
   probabilities at its position (cross-entropy to that distribution, teacher distillation as in
   Hydra++ / Medusa-2): more signal per position than the argmax alone. Hydra scores a draft
   vocabulary: the `draft_vocab` most frequent labels (others are skipped), which makes training and
   drafting several times cheaper (speccomp/drafters/hydra.py).

Resumable: after every data batch and every epoch the state goes to `out/_train/` (tokens,
heads, optimizer moments as safetensors, progress as JSON); a rerun with the same arguments
continues where it stopped. Deterministic for a seed (shuffling uses its own generator).
"""
from __future__ import annotations

import json
import math
import operator
import shutil
from pathlib import Path

import torch

from speccomp.drafters.medusa import MedusaHeads, check_head_directory, new_heads, save_medusa
from speccomp.errors import OptionError, OptionTypeError

KINDS = ("medusa", "hydra", "eagle")
DRAFT_VOCAB = 8192  # hydra, eagle: tokens the heads score by default (a larger vocabulary's most frequent ones)
DISTILL_BATCH = 32  # prompts decoded together by HF generate


def _generate_batch(model, batch: list[torch.Tensor], max_new_tokens: int, eos, temperature: float = 0.0,
                    seed: int = 0) -> list[torch.Tensor]:
    """Continuations of `batch` (1-D id tensors), greedy or sampled at `temperature`: prompt + reply up to
    and including eos."""
    width = max(len(p) for p in batch)
    pad = 0
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, p in enumerate(batch):  # left padding: every reply starts at column `width`
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    if eos is None:  # HF then stops at the model's own eos ids and pads after them: cut there
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():  # reproducible samples; the caller's RNG is left alone
        out = _seeded(seed, lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                                   eos_token_id=eos, pad_token_id=pad, **sampling))
    seqs = []
    eos_set = set([eos] if isinstance(eos, int) else (eos or []))
    for i, p in enumerate(batch):
        reply = out[i, width:].tolist()
        end = next((j + 1 for j, t in enumerate(reply) if t in eos_set), len(reply))
        seqs.append(torch.cat([p, torch.tensor(reply[:end], dtype=torch.long)]))
    return seqs


def _self_distill(model, prompts, max_new_tokens: int, eos, progress: bool, state: Path, sampled: int = 0,
                  temperature: float = 0.8, seed: int = 0):
    """The model's replies to `prompts` (greedy, then `sampled` sampled ones per prompt) as (sequence, reply
    start) pairs, saved batch by batch so an interrupted run keeps them."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from speccomp.models import replace_atomically

    data_file = state / "tokens.safetensors"
    seqs, starts = distilled_text(state.parent) if data_file.exists() else ([], [])
    jobs = []  # (prompts, temperature, seed) per batch
    for r in range(1 + sampled):
        step = DISTILL_BATCH if hasattr(model, "generate") else 1
        for i in range(0, len(prompts), step):
            jobs.append((prompts[i : i + step], 0.0 if r == 0 else temperature, seed + 1000 * r + i))
    if hasattr(model, "generate"):
        decode = lambda batch, t, sd: _generate_batch(model, batch, max_new_tokens, eos, t, sd)  # noqa: E731
    else:  # a plain module: one prompt at a time through speccomp
        import speccomp

        plain = speccomp.compile(model)
        decode = lambda batch, t, sd: [plain.generate(batch[0], max_new_tokens=max_new_tokens, eos_token_id=eos,  # noqa: E731
                                                      **(dict(do_sample=True, temperature=t, seed=sd) if t > 0 else {}))[0]]
    done = 0
    with tqdm(total=len(prompts) * (1 + sampled), desc="self-distill", disable=not progress) as bar:
        for batch, temp, sd in jobs:
            if done + len(batch) > len(seqs):  # not decoded before an interruption
                seqs.extend(decode(batch, temp, sd))
                starts.extend(len(p) for p in batch)
                flat = {f"seq_{i}": x.contiguous() for i, x in enumerate(seqs)}
                flat.update({f"start_{i}": torch.tensor(st) for i, st in enumerate(starts)})
                replace_atomically(data_file, lambda tmp: save_file(flat, str(tmp)))  # noqa: B023 (called at once)
            done += len(batch)
            bar.update(len(batch))
    return seqs, starts


def distilled_text(out) -> tuple[list[torch.Tensor], list[int]]:
    """The self-distilled sequences stored by a (finished or interrupted) run into `out`, and where each
    reply starts."""
    flat = read_state(Path(out) / "_train" / "tokens.safetensors")
    n = len(flat) // 2
    try:
        return [flat[f"seq_{i}"] for i in range(n)], [int(flat[f"start_{i}"]) for i in range(n)]
    except KeyError as exc:
        raise _damaged(Path(out) / "_train" / "tokens.safetensors", f"no tensor {exc}") from None


def read_state(file: Path) -> dict:
    """A run's checkpoint file (safetensors), or an OptionError naming it and the fix: a truncated file (an
    interrupted copy, a full disk) failed as a bare SafetensorError naming no file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise _damaged(file, str(exc).splitlines()[0][:200]) from None


def _damaged(file: Path, why: str) -> OptionError:
    state = file.parent
    return OptionError("out", str(state.parent), f"its training run's {file.name} is damaged ({why})",
                       f"delete {state} to train again from the start")


def _hidden_states(model, seqs, progress: bool, mass: torch.Tensor | None = None, soft_k: int = 0) -> list[tuple]:
    """Per sequence: final hidden states h [n, H], the model's greedy next token after every position [n] and,
    with soft_k > 0, its top-`soft_k` next-token probabilities (float16 [n, soft_k]) and ids ([n, soft_k]), else
    None. `mass` [V], if given, accumulates the model's next-token probabilities over all positions."""
    import speccomp
    from tqdm import tqdm

    plain = speccomp.compile(model)
    kv = plain.kv
    out = []
    with torch.no_grad():
        for s in tqdm(seqs, desc="hidden states", disable=not progress):
            n = s.shape[0]
            empty = torch.zeros(*kv.shape(0), dtype=kv.dtype)
            causal = torch.ones(n, n, dtype=torch.bool).tril()  # the plain graph takes a tree mask too
            logits, _, h = plain.step(s[None], torch.arange(n)[None], torch.ones(1, n, dtype=torch.long), empty, causal)
            probs = logits[0].softmax(-1) if (mass is not None or soft_k) else None
            top = probs.topk(soft_k, dim=-1) if soft_k else None
            out.append((h[0].clone(), logits[0].argmax(-1), (top.values.half(), top.indices) if soft_k else None))
            if mass is not None:
                mass += probs.sum(0)
    return out


def _examples(seqs, states, num_heads: int, starts=None):
    """(h [N, H], inputs [N, K], targets [N, K], soft) over positions t >= start (the reply, and the last prompt
    token) with all K targets inside the sequence. inputs[:, k] = x_{t+k+1} (the text's token: what Hydra
    head k reads along a path), targets[:, k] = the model's greedy token after x_{t+k+1}, i.e. what the
    target accepts at depth k + 1. For greedy text that is x_{t+k+2}; for sampled text it still is the
    label verification would check, so sampled replies are valid training text. soft: None, or (probabilities
    [N, K, S], ids [N, K, S]) of the model's top-S tokens where targets holds its argmax (when `states` carry them)."""
    hs, ins, ts, sp, si = [], [], [], [], []
    longest = 0  # tokens after the prompt, over every reply (for the refusal below)
    for i, (s, (h, greedy, soft)) in enumerate(zip(seqs, states)):
        first = max(0, (starts[i] - 1) if starts else 0)
        longest = max(longest, s.shape[0] - first - 1)
        n = s.shape[0] - num_heads - first
        if n <= 0:
            continue
        ahead = lambda x: torch.stack([x[first + k + 1 : first + k + 1 + n] for k in range(num_heads)], dim=1)  # noqa: E731
        hs.append(h[first : first + n])
        ins.append(ahead(s))
        ts.append(ahead(greedy))  # [n, K]
        if soft is not None:
            sp.append(ahead(soft[0]))  # [n, K, S]
            si.append(ahead(soft[1]))
    if not hs:
        raise OptionError("num_heads", num_heads, f"is more than any reply holds: the longest reply has {longest} "
                          "tokens after its prompt (replies stop at eos_token_id or max_new_tokens)",
                          "train fewer heads, or on prompts with longer replies")
    soft = (torch.cat(sp), torch.cat(si)) if sp else None
    return torch.cat(hs), torch.cat(ins), torch.cat(ts), soft


def frequent_tokens(seqs, size: int, always=(), fill: torch.Tensor | None = None) -> torch.Tensor:
    """The `size` most frequent token ids of `seqs` (ties: smaller id first), plus `always`, sorted.
    With fewer distinct tokens than `size`, the rest are the highest-scoring ids of `fill` [V] (e.g. the
    model's probability mass): tokens that never won an argmax in the training text still get drafted."""
    counts = torch.bincount(torch.cat(seqs))
    order = sorted(range(len(counts)), key=lambda t: (-int(counts[t]), t))
    chosen = {t for t in order[:size] if counts[t] > 0}
    if fill is not None and len(chosen) < size:
        for t in fill.argsort(descending=True).tolist():
            if len(chosen) >= size:
                break
            chosen.add(t)
    chosen |= {int(t) for t in always}
    return torch.tensor(sorted(chosen), dtype=torch.long)


def _vocab_size(model) -> int:
    from speccomp.drafters.medusa import _lm_head_weight

    return _lm_head_weight(model).shape[0]


def check_soft_labels(k) -> None:
    """soft_labels is 0 (off) or the number (>= 2) of the model's top tokens whose probabilities heads learn."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0 or k == 1:
        raise ValueError(f"soft_labels / --soft-labels (the model's top-k probabilities learned besides its argmax) must be "
                         f"0 (off) or an int >= 2 (1 would be the argmax label again), got {k!r}")


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the heads' scores logits [..., V] to a top-S teacher distribution (probs, ids [..., S],
    renormalized over what is left of it): [...]."""
    p = probs.float()
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-6)
    return -(p * logits.log_softmax(-1).gather(-1, ids)).sum(-1)


CHECKPOINT = "checkpoint.safetensors"  # a run's heads and AdamW moments after an epoch, the epoch in its metadata


def _checkpoint(state: Path, heads, opt, args: dict, epoch: int) -> None:
    """Heads, AdamW moments and progress after `epoch` epochs, so a rerun resumes there: one file replaced by one
    rename, its epoch inside it (heads and moments in two files, progress in a third, could be cut between renames:
    the rerun then trained epoch N+1's heads with epoch N's moments, and once more)."""
    from safetensors.torch import save_file

    from speccomp.models import replace_atomically, write_atomically

    tensors = {f"heads.{k}": v.detach().contiguous() for k, v in heads.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        tensors[f"opt.{i}.step"] = torch.as_tensor(st["step"]).reshape(1).float()
        tensors[f"opt.{i}.exp_avg"] = st["exp_avg"].contiguous()
        tensors[f"opt.{i}.exp_avg_sq"] = st["exp_avg_sq"].contiguous()
    replace_atomically(state / CHECKPOINT, lambda tmp: save_file(tensors, str(tmp), metadata={"epoch": str(epoch)}))
    write_atomically(state / "progress.json", json.dumps({"args": args, "epoch": epoch}))  # for people reading it


def _resume(state: Path, heads, opt) -> int:
    """The epoch to start at: 0 for a new run, else the checkpoint's, with its heads and AdamW moments loaded."""
    from safetensors import safe_open

    file = state / CHECKPOINT
    if not file.exists():
        return 0
    tensors = read_state(file)
    try:
        with safe_open(str(file), "pt") as f:
            epoch = int((f.metadata() or {})["epoch"])
        heads.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("heads.")})
        opt_state = opt.state_dict()
        for i, _ in enumerate(opt.param_groups[0]["params"]):
            opt_state["state"][i] = {"step": tensors[f"opt.{i}.step"].reshape(()),
                                     "exp_avg": tensors[f"opt.{i}.exp_avg"], "exp_avg_sq": tensors[f"opt.{i}.exp_avg_sq"]}
        opt.load_state_dict(opt_state)
    except (KeyError, RuntimeError, ValueError) as exc:  # other names or shapes than these heads'
        raise _damaged(file, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]) from None
    return epoch


def _check_settings(model, prompts, kind, *, lr, sampled: int, temperature: float, soft_labels: int,
                    given: dict, **ints) -> None:
    """Refuse bad settings before minutes of work: each message names the setting, its value and what it takes.
    `given`: options the caller passed that `kind` does not use (refused, as the CLI refuses their flags)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    unused = {"num_layers": kind == "eagle", "draft_vocab": kind == "medusa"}  # as the CLI refuses their flags
    for name, value in given.items():
        if unused.get(name) and value is not None:
            raise OptionError(name, value, f"does not apply to kind={kind!r}", f"drop {name} (num_layers: the "
                              "ResBlocks per Medusa/Hydra head, an EAGLE head is one decoder layer; draft_vocab: the "
                              "tokens Hydra and EAGLE heads score, Medusa heads score the whole vocabulary)")
    for name, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    check_sampling(sampled, temperature)
    check_soft_labels(soft_labels)
    if not prompts:
        raise ValueError("train_heads needs at least one prompt (token ids) to self-distill from")
    check_on_cpu(model, "train_heads")
    if ints["num_heads"] > ints["max_new_tokens"]:  # a position trains with num_heads reply tokens after it (CLI: same)
        raise OptionError("max_new_tokens", ints["max_new_tokens"], f"is shorter than num_heads={ints['num_heads']}: "
                          "no reply would hold a training position", f"use max_new_tokens >= {ints['num_heads']}")
    if soft_labels > _vocab_size(model):
        raise ValueError(f"soft_labels={soft_labels} is more than the model's vocabulary ({_vocab_size(model)} tokens)")
    if kind in ("hydra", "eagle") and ints["draft_vocab"] > _vocab_size(model):  # would be cut to the vocabulary
        raise OptionError("draft_vocab", ints["draft_vocab"], f"is more than the model's vocabulary "
                          f"({_vocab_size(model)} tokens)", f"use at most {_vocab_size(model)} (the whole vocabulary)")


def check_training_numbers(lr, weight_decay, seed, eos_token_id, vocab_size: int | None = None) -> None:
    """lr a finite number > 0, weight_decay a finite number >= 0, seed an int in [0, 2**63), eos ids ints in
    [0, vocab_size): checked before the run folder exists (AdamW or manual_seed failing after it blocked the corrected rerun: "a run with other
    settings"; an infinite lr saved weights that were all NaN)."""
    def real(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    def token(i) -> bool:  # an int >= 0 (numpy's too), not a bool
        try:
            return not isinstance(i, bool) and operator.index(i) >= 0
        except TypeError:
            return False

    if not real(lr) or not lr > 0:
        raise OptionError("lr", lr, "must be a finite number > 0", "e.g. lr=1e-3")
    if not real(weight_decay) or weight_decay < 0:
        raise OptionError("weight_decay", weight_decay, "must be a finite number >= 0", "e.g. weight_decay=0.0")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise OptionTypeError("seed", seed, "must be an int", "e.g. seed=0 (the default)")
    if not 0 <= seed < 2**63:  # torch.manual_seed takes 64 bits; each reply batch seeds with seed + an offset
        raise OptionError("seed", seed, "must be in [0, 2**63)", "e.g. seed=0 (the default)")
    ids = [] if eos_token_id is None else eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if not all(token(i) for i in ids):
        raise OptionTypeError("eos_token_id", eos_token_id, "must be a token id, a list of them, or None",
                              "e.g. eos_token_id=tokenizer.eos_token_id")
    outside = [int(i) for i in ids if vocab_size is not None and operator.index(i) >= vocab_size]
    if outside:  # would fail minutes in (the draft vocabulary) or never stop a reply (Medusa)
        raise OptionError("eos_token_id", eos_token_id, f"token ids {outside[:4]} are outside the model's vocabulary "
                          f"[0, {vocab_size})", "pass ids of this model's tokenizer")


def check_on_cpu(model, what: str) -> None:
    """Training runs on the CPU (the replies, hidden states and batches are built there); a model elsewhere is refused
    before any work rather than failing on mixed devices minutes in. What it trains loads onto any device."""
    weight = next(iter(model.parameters()), None)
    if weight is not None and weight.device.type != "cpu":
        raise OptionError("model", f"a model on {weight.device}", f"{what} trains on the CPU",
                          "pass model.cpu() (the trained weights then load with the model on any device)")


def check_prompts(prompts, vocab: int) -> list[torch.Tensor]:
    """The prompts as 1-D int64 tensors, checked before a run folder is made (a failure after it blocked the corrected
    rerun): each [n] or [1, n] with n >= 1 (several rows are several prompts: a list), its ids in [0, vocab)."""
    fix = "pass a list of token id tensors, each [n] or [1, n], e.g. [chat_ids(tokenizer, text)[0] for text in texts]"
    prompts = list(prompts) if isinstance(prompts, torch.Tensor) and prompts.dim() == 2 else prompts  # rows [B, n]
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise OptionError("prompts", prompts, "must be a non-empty list of prompts", fix)
    checked = []
    for i, p in enumerate(prompts):
        t = p if isinstance(p, torch.Tensor) else None
        if t is None or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or not (
                t.dim() == 1 or (t.dim() == 2 and t.shape[0] == 1)) or t.numel() == 0:
            raise OptionError(f"prompts[{i}]", p, "must be a non-empty integer tensor [n] or [1, n]", fix)
        t = t.reshape(-1).to(torch.int64)
        if int(t.min()) < 0 or int(t.max()) >= vocab:
            raise OptionError(f"prompts[{i}]", p, f"has token ids outside the model's vocabulary [0, {vocab})",
                              "tokenize with the model's own tokenizer")
        checked.append(t)
    return checked


def check_sampling(sampled, temperature) -> None:
    """`sampled` extra replies per prompt drawn at `temperature` (train_heads, train_draft)."""
    if isinstance(sampled, bool) or not isinstance(sampled, int) or sampled < 0:
        raise ValueError(f"sampled (extra sampled replies per prompt) must be an int >= 0, got {sampled!r}")
    if sampled and (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0):
        raise ValueError(f"temperature must be > 0 for sampled replies, got {temperature!r}")


def eos_identity(eos_token_id) -> dict:
    """The eos ids a run's replies stop at, for its stored settings: a rerun with others is another run (a run stored
    before they were recorded has none: `_open_run` compares it without them, so it still resumes)."""
    ids = [] if eos_token_id is None else eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    return {"eos_token_id": sorted({int(i) for i in ids})}


def run_identity(model, prompts) -> dict:
    """What a stored run was distilled from, for `_open_run` to compare: the model (its fingerprint) and the prompts
    (their count and a digest of their ids). A resumed run on another model or other prompts would otherwise hand
    back the earlier run's weights."""
    import hashlib

    from speccomp.models import fingerprint

    digest = hashlib.sha256()
    for p in prompts:
        digest.update(torch.as_tensor(p).reshape(-1).to(torch.int64).numpy().tobytes() + b"|")
    return {"model": fingerprint(model), "prompts": len(prompts), "prompts_sha256": digest.hexdigest()[:16]}


def check_not_foreign(out) -> None:
    """Refuse an `out` a training run may not write into: one holding files that no run there started (no
    _train/progress.json), such as heads or a draft downloaded or saved by hand, a project folder or an engine; and the
    working directory, its parents, home or the root. New and empty directories are fine."""
    from speccomp.models import is_broad_directory

    out = Path(out)
    if is_broad_directory(out):
        raise OptionError("out", str(out), "is the working directory, one of its parents, the home directory or the "
                          "filesystem root", "give a new directory such as ./my-heads")
    if (out / "_train" / "progress.json").exists():  # a run started here: it resumes, or refuses other settings
        return
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        raise OptionError("out", str(out), f"is a non-empty directory no training run started (it holds {held[:3]}, "
                          "no _train/progress.json); refusing to write into it", "choose a new or empty directory")


def _open_run(state: Path, args: dict) -> None:
    """Start a run in `state`, or check that the run stored there has the same `args` (its checkpoint resumes it)."""
    from speccomp.models import write_atomically

    progress_file = state / "progress.json"
    if not progress_file.exists():
        check_not_foreign(state.parent)
        write_atomically(progress_file, json.dumps({"args": args, "epoch": 0}))  # makes `state` (after the check)
        return
    try:
        done = json.loads(progress_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise OptionError("out", str(state.parent), f"holds an unreadable training state {progress_file} ({e})",
                          f"delete {state.parent} to train again there") from None
    stored = done.get("args") if isinstance(done, dict) else None
    if isinstance(stored, dict) and "eos_token_id" not in stored:  # stored before eos ids were part of a run
        args = {k: v for k, v in args.items() if k != "eos_token_id"}
    if stored != args:  # a resumed run must be the same run; name what differs, not two whole settings dicts
        stored = stored if isinstance(stored, dict) else {}
        differ = [f"{k}: {stored.get(k, 'unset')!r} there, {args.get(k, 'unset')!r} now"
                  for k in sorted(set(stored) | set(args)) if stored.get(k) != args.get(k)]
        raise OptionError("out", str(state.parent), f"holds a training run with other settings ({'; '.join(differ)})",
                          "train with the same settings to resume it, or into another folder (out= / --out), or "
                          f"delete {state.parent}")


def _fit(head, batches: list, loss_of, *, state: Path, args: dict, progress: bool, warmup: int = 0,
         clip: bool = False) -> None:
    """AdamW on `head`'s trainable parameters from the last checkpoint to args["epochs"], a checkpoint after every
    epoch. batches[epoch] is that epoch's batches in order, loss_of(batch) their loss. The learning rate decays
    linearly to 5% (after a linear `warmup` of that many steps); `clip`: gradient norm clipped to 1."""
    from tqdm import tqdm

    lr, epochs = args["lr"], args["epochs"]
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=args["weight_decay"])
    total = len(batches[0]) if batches else 0
    for epoch in range(_resume(state, head, opt), epochs):
        head.train()
        loss_sum = 0.0
        bar = tqdm(batches[epoch], desc=f"epoch {epoch + 1}/{epochs}", disable=not progress)
        for b, batch in enumerate(bar):
            it = epoch * total + b
            warm = min(1.0, (it + 1) / warmup) if warmup else 1.0
            opt.param_groups[0]["lr"] = lr * warm * max(0.05, 1 - it / (epochs * total))
            loss = loss_of(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            loss_sum += float(loss.detach())
            bar.set_postfix(loss=f"{loss_sum / (b + 1):.3f}")
        head.eval()
        _checkpoint(state, head, opt, args, epoch + 1)
    head.eval()


def train_heads(
    model, prompts, *, out, kind: str = "medusa", num_heads: int = 4, num_layers: int = 1, max_new_tokens: int = 128,
    epochs: int = 3, lr: float = 1e-3, batch_size: int | None = None, draft_vocab: int | None = None, sampled: int = 0,
    temperature: float = 0.8, weight_decay: float = 0.0, soft_labels: int = 0, seed: int = 0, eos_token_id=None,
    progress: bool = True, base_model: str = "",
):
    """Train heads of `kind` for `model` on its own continuations of `prompts` (token id tensors); save to `out`."""
    if batch_size is None:  # positions per batch for heads; sequences per batch for EAGLE
        batch_size = 8 if kind == "eagle" else 256
    if kind == "eagle" and soft_labels:
        raise ValueError("soft_labels does not apply to kind='eagle': it always learns the model's whole distribution "
                         "over its draft vocabulary")
    draft_vocab_given = draft_vocab
    if draft_vocab is None:  # hydra, eagle: the 8192 most frequent tokens, or every token of a smaller vocabulary
        draft_vocab = min(DRAFT_VOCAB, _vocab_size(model))
    _check_settings(model, prompts, kind, lr=lr, sampled=sampled, temperature=temperature, soft_labels=soft_labels,
                    given={"num_layers": None if num_layers == 1 else num_layers, "draft_vocab": draft_vocab_given},
                    num_heads=num_heads, num_layers=num_layers, max_new_tokens=max_new_tokens, epochs=epochs,
                    batch_size=batch_size, draft_vocab=draft_vocab)
    check_training_numbers(lr, weight_decay, seed, eos_token_id, _vocab_size(model))
    prompts = check_prompts(prompts, _vocab_size(model))
    out = check_head_directory(out)  # before minutes of work: never over a folder's own config.json
    state = out / "_train"
    args = {"kind": kind, "num_heads": num_heads, "num_layers": num_layers, "max_new_tokens": max_new_tokens,
            "epochs": epochs, "lr": lr, "batch_size": batch_size, "seed": seed, **run_identity(model, prompts),
            "sampled": sampled, "temperature": temperature, "weight_decay": weight_decay,
            **eos_identity(eos_token_id)}
    if kind in ("hydra", "eagle"):
        args["draft_vocab"] = draft_vocab
    if soft_labels:  # only when on, so runs stored before the option existed still resume
        args["soft_labels"] = soft_labels
    _open_run(state, args)
    seqs, starts = _self_distill(model, prompts, max_new_tokens, eos_token_id, progress, state, sampled, temperature,
                                 seed)
    mass = torch.zeros(_vocab_size(model)) if kind in ("hydra", "eagle") else None
    run = dict(state=state, args=args, progress=progress)
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    if kind == "eagle":
        head = _train_eagle(model, seqs, starts, _hidden_states(model, seqs, progress, mass), eos, mass, run)
        from speccomp.drafters.eagle import save_eagle

        save_eagle(head, out, base_model=base_model)
        return head
    states = _hidden_states(model, seqs, progress, mass, soft_labels)
    try:
        examples = _examples(seqs, states, num_heads, starts)
    except OptionError:  # no epoch trained: the state only holds replies too short, which would block the rerun
        shutil.rmtree(state, ignore_errors=True)
        raise
    heads = _train_medusa(model, examples, eos, mass, run)
    if kind == "hydra":
        from speccomp.drafters.hydra import save_hydra

        save_hydra(heads, out, base_model=base_model)
    else:
        save_medusa(heads, out, base_model=base_model)
    return heads


def _seeded(seed: int, make):
    """`make()` with the global RNG seeded (sampled replies, fresh heads' initial weights), the caller's RNG left as
    it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return make()


def _train_medusa(model, examples, eos: list, mass, run: dict):
    """Medusa or Hydra heads (run["args"]) on `_examples`: head k's cross-entropy to the model's greedy token (and,
    with soft labels, to its top-S distribution) over reply positions, weighted 0.8^k."""
    h, inputs, targets, soft = examples
    args = run["args"]
    kind, num_heads, batch_size = args["kind"], args["num_heads"], args["batch_size"]
    if kind == "hydra":
        from speccomp.drafters.hydra import new_hydra

        vocab = frequent_tokens([targets.flatten()], args["draft_vocab"], always=eos, fill=mass)
        heads = _seeded(args["seed"], lambda: new_hydra(model, vocab, num_heads, args["num_layers"]))
        # targets as indices into the draft vocabulary; -100 (skipped by cross_entropy) outside it
        index = torch.full((heads.vocab,), -100, dtype=torch.long)
        index[heads.draft_vocab] = torch.arange(len(heads.draft_vocab))
        targets = index[targets]
        if soft is not None:  # soft labels outside the draft vocabulary get probability 0
            # (the rest is renormalized below, also where the argmax itself is outside and the hard loss skips the
            # position: the head then learns the in-vocabulary shape there; the shipped heads were trained so)
            soft = (soft[0] * (index[soft[1]] >= 0), index[soft[1]].clamp(min=0))
    else:
        heads = _seeded(args["seed"], lambda: new_heads(model, num_heads, args["num_layers"]))
    weights = torch.tensor([0.8**k for k in range(num_heads)])

    def loss_of(idx):
        logits = heads(h[idx], inputs[idx]) if kind == "hydra" else heads(h[idx])  # [B, K, V]
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets[idx].reshape(-1), reduction="none"
        ).view(len(idx), num_heads)
        valid = (targets[idx] != -100).float()
        loss = ((ce * valid).sum(0) / valid.sum(0).clamp(min=1) * weights).sum()
        if soft is not None:  # teacher distillation: cross-entropy to the model's top-k distribution
            loss = loss + (soft_cross_entropy(logits, soft[0][idx], soft[1][idx]).mean(0) * weights).sum()
        return loss

    gen = torch.Generator().manual_seed(args["seed"])
    total = math.ceil(h.shape[0] / batch_size)
    # fixed whatever the resume point
    orders = [torch.randperm(h.shape[0], generator=gen) for _ in range(args["epochs"])]
    _fit(heads, [[o[b * batch_size : (b + 1) * batch_size] for b in range(total)] for o in orders], loss_of, **run)
    return heads


def head_accuracy(heads, model, seqs, starts=None) -> list[float]:
    """Top-1 accuracy of each head on `seqs` (token id tensors), every position: how often head k names the
    model's greedy token after x_{t+k+1} (Hydra heads read x_{t+1..t+k+1}, as along an accepted path).
    `starts`: where each reply starts (then only reply positions count)."""
    h, inputs, targets, _ = _examples(seqs, _hidden_states(model, seqs, progress=False), heads.num_heads, starts)
    with torch.no_grad():
        if isinstance(heads, MedusaHeads):
            pred = heads(h).argmax(-1)
        else:
            pred = heads.draft_vocab[heads(h, inputs).argmax(-1)]
    return (pred == targets).float().mean(0).tolist()


def _train_eagle(model, seqs, starts, states, eos: list, mass, run: dict):
    """EAGLE: the head's one layer, unrolled `steps` (num_heads) deep on its own guesses (eagle.EagleHead.unrolled),
    learns at every anchor p and step s the target's feature f_{p+s} (smooth L1) and its next-token distribution
    over the draft vocabulary (cross-entropy to softmax(P f_{p+s}), the teacher), weighted 0.8^(s-1). Batches are
    `batch_size` sequences of similar length (padded)."""
    from speccomp.drafters.eagle import new_eagle

    args = run["args"]
    steps, batch_size, epochs = args["num_heads"], args["batch_size"], args["epochs"]
    labels = [greedy[max(0, st - 1):] for (_, greedy, _), st in zip(states, starts)]
    vocab = frequent_tokens(labels, args["draft_vocab"], always=eos, fill=mass)
    head = _seeded(args["seed"], lambda: new_eagle(model, vocab))
    by_length = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), i))
    batches = [by_length[i : i + batch_size] for i in range(0, len(by_length), batch_size)]
    gen = torch.Generator().manual_seed(args["seed"])
    orders = [torch.randperm(len(batches), generator=gen).tolist() for _ in range(epochs)]
    weights = [0.8**s for s in range(steps)]

    def loss_of(which: int) -> torch.Tensor:
        batch = batches[which]
        return _eagle_loss(head, [seqs[i] for i in batch], [states[i][0] for i in batch], [starts[i] for i in batch],
                           steps, weights)

    # linear warm-up (50 steps, at most a fifth of the run), then linear decay
    _fit(head, orders, loss_of, warmup=min(50, max(1, epochs * len(batches) // 5)), clip=True, **run)
    head.train_steps = steps
    return head


def _pad(seqs, feats, starts):
    """Pad a batch: tokens [B, T], features [B, T, H], valid [B, T], reply [B, T] (anchors from the last prompt token)."""
    t = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), t, dtype=torch.long)
    f = torch.zeros(len(seqs), t, feats[0].shape[-1])
    valid = torch.zeros(len(seqs), t, dtype=torch.bool)
    reply = torch.zeros(len(seqs), t, dtype=torch.bool)
    for i, (s, h, st) in enumerate(zip(seqs, feats, starts)):
        tokens[i, : len(s)], f[i, : len(s)], valid[i, : len(s)] = s, h.float(), True
        reply[i, max(0, st - 1) : len(s)] = True
    return tokens, f, valid, reply


def _eagle_loss(head, seqs, feats, starts, steps: int, weights) -> torch.Tensor:
    tokens, f, valid, reply = _pad(seqs, feats, starts)
    t = tokens.shape[1]
    outs = head.unrolled(f, tokens, valid, steps)
    with torch.no_grad():
        teacher = head.logits(f).softmax(-1)  # [B, T, Vd]: the model's distribution over the draft vocabulary
    loss = f.new_zeros(())
    for s, o in enumerate(outs, start=1):
        # anchor p predicts position p + s: it must exist (valid) and p must be in the reply
        ok = reply[:, : t - s] & valid[:, s:]  # [B, T - s]
        if not ok.any():
            continue
        o = o[:, : t - s][ok]  # [N, H]
        target = f[:, s:][ok]
        ce = -(teacher[:, s:][ok] * head.logits(o).log_softmax(-1)).sum(-1).mean()
        reg = torch.nn.functional.smooth_l1_loss(o, target)
        loss = loss + weights[s - 1] * (ce + reg)
    return loss


def eagle_accuracy(head, model, seqs, starts=None, steps: int = 4) -> list[float]:
    """Chain acceptance of an EAGLE head on `seqs` (greedy text of the model): for depth s, the fraction of reply
    anchors whose first s drafts (each made from the head's own guesses) are all the model's greedy tokens."""
    states = _hidden_states(model, seqs, progress=False)
    hits = torch.zeros(steps)
    count = 0
    with torch.no_grad():
        for i, (s, (h, greedy, _)) in enumerate(zip(seqs, states)):
            st = max(0, (starts[i] - 1) if starts else 0)
            n = len(s) - steps - 1 - st
            if n <= 0:
                continue
            outs = head.unrolled(h[None], s[None], torch.ones(1, len(s), dtype=torch.bool), steps)
            ok = torch.ones(n, dtype=torch.bool)
            for d, o in enumerate(outs):
                pred = head.draft_vocab[head.logits(o[0, st : st + n]).argmax(-1)]
                # the draft at depth d + 1 is the model's token after x_{p+d+1}; along greedy text, path tokens match
                ok &= (pred == greedy[st + d + 1 : st + d + 1 + n]) & (s[st + d + 2 : st + d + 2 + n] == greedy[st + d + 1 : st + d + 1 + n])
                hits[d] += float(ok.sum())
            count += n
    return (hits / max(count, 1)).tolist()
