"""Distil a small draft LM for a model on CPU (DistillSpec / FastDraft): `speccomp train-draft`.

    draft_dir = speccomp.train_draft(model, prompts=[ids, ...], out="draft/", num_layers=2)
    fast = speccomp.compile(model, drafter="draft_model")        # finds it in the user cache (or drafter_options path)

The draft is the model's own architecture cut to `num_layers` decoder layers, initialised from the model's first
layers and final norm, sharing (frozen) its token embedding and LM head: only the layers and the norm train, and only
they are saved (draft.safetensors + config.json, a few MB), so a draft cannot drift from its model's vocabulary.

Data and labels are train_heads' (speccomp/tuning/train_heads.py): the model's own greedy replies (plus `sampled`
sampled ones) to the prompts, and at every position the model's greedy next token g_t, which is exactly what
verification accepts. Loss: cross-entropy to g_t over the reply positions (and the last prompt position, which
drafts the reply's first token). AdamW, linear decay, resumable from `out/_train/` like the heads.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from speccomp.errors import OptionError, OptionTypeError
from speccomp.tuning.train_heads import (_fit, _hidden_states, _open_run, _self_distill, _vocab_size, check_on_cpu,
                                        check_prompts, check_sampling, check_training_numbers, eos_identity,
                                        run_identity)

CONFIG = "config.json"
WEIGHTS = "draft.safetensors"
FORMAT = "speccomp-draft-model"


def draft_architecture(model, num_layers: int):
    """An untrained draft for `model` (a Hugging Face causal LM): its class and config with `num_layers` layers,
    the first `num_layers` of its layers and its final norm copied, its embedding and LM head shared."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (sliding windows)
        config.layer_types = config.layer_types[:num_layers]
    for k in _DROPOUTS:  # no dropout: a draft trains the same for a seed (GPT-2's and OPT's configs say 0.1)
        if isinstance(getattr(config, k, None), float):
            setattr(config, k, 0.0)
    draft = type(model)(config).eval()
    share(draft, model)
    own = own_state(draft)
    draft.load_state_dict({k: v for k, v in model.state_dict().items() if k in own}, strict=False)
    return draft


_DROPOUTS = ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
             "activation_dropout", "attention_probs_dropout_prob", "hidden_dropout_prob")


def own_state(draft) -> dict:
    """The draft's own (trained, saved) state: everything but the token embedding and LM head it shares with its
    model. By identity, not by name: GPT-2's `transformer.h.N`, Falcon's, OPT's learned positions all belong (a first
    version matched `.layers.N.` and `*norm*` and saved none of GPT-2's weights: a loaded draft was partly random)."""
    shared = {id(draft.get_input_embeddings().weight), id(draft.get_output_embeddings().weight)}
    return {k: v for k, v in draft.state_dict(keep_vars=True).items() if id(v) not in shared}


def share(draft, model) -> None:
    """`draft` reads `model`'s token embedding and LM head (the same tensors; their requires_grad is the model's:
    compile leaves the model as it was, train_draft freezes them only while it trains)."""
    draft.get_input_embeddings().weight = model.get_input_embeddings().weight
    draft.get_output_embeddings().weight = model.get_output_embeddings().weight


@contextlib.contextmanager
def _frozen(*params):
    """`params` without gradients for a while (the draft's backward never writes the model's .grad), then as they
    were."""
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def _trainable(draft) -> nn.Module:
    """The draft's own weights as one module (what _fit trains and checkpoints): the base model's children but the
    shared embedding (layers, final norm, rotary tables)."""
    embedding = draft.get_input_embeddings()
    return nn.ModuleDict({k: m for k, m in draft.base_model.named_children() if m is not embedding})


def save_draft(draft, out: Path, model, num_layers: int, base_model: str = "") -> Path:
    from safetensors.torch import save_file

    from speccomp.models import fingerprint, replace_atomically, write_atomically

    own = {k: v.detach().contiguous() for k, v in own_state(draft).items()}
    replace_atomically(out / WEIGHTS, lambda tmp: save_file(own, str(tmp)))  # each file in one rename, config last
    write_atomically(out / CONFIG, json.dumps({
        "format": FORMAT, "num_layers": num_layers, "base_model_name_or_path": base_model,
        "base_fingerprint": fingerprint(model), "reads_from_the_model": ["embedding", "lm_head"],
        "config": draft.config.to_dict()}, indent=1, default=str) + "\n")
    return out


def train_draft(model, prompts, *, out, num_layers: int = 2, max_new_tokens: int = 128, epochs: int = 3,
                lr: float = 3e-4, batch_size: int = 8, sampled: int = 1, temperature: float = 0.8, seed: int = 0,
                eos_token_id=None, progress: bool = True, base_model: str = "") -> Path:
    """Train a `num_layers`-layer draft for `model` on its own replies to `prompts` (token id tensors); save it to
    `out` (a new directory or one this function wrote). Returns `out`."""
    _check(model, prompts, num_layers, epochs=epochs, batch_size=batch_size, max_new_tokens=max_new_tokens, lr=lr)
    check_training_numbers(lr, 0.0, seed, eos_token_id, _vocab_size(model))
    check_sampling(sampled, temperature)
    prompts = check_prompts(prompts, _vocab_size(model))
    out = check_draft_directory(out)
    state = out / "_train"
    args = {"kind": "draft_model", "num_layers": num_layers, "max_new_tokens": max_new_tokens, "epochs": epochs,
            "lr": lr, "batch_size": batch_size, "seed": seed, **run_identity(model, prompts), "sampled": sampled,
            "temperature": temperature, "weight_decay": 0.0, **eos_identity(eos_token_id)}
    _open_run(state, args)
    seqs, starts = _self_distill(model, prompts, max_new_tokens, eos_token_id, progress, state, sampled, temperature,
                                 seed)
    labels = [g for _, g, _ in _hidden_states(model, seqs, progress)]
    draft = draft_architecture(model, num_layers)
    order = torch.Generator().manual_seed(seed)
    batches = [[[int(i) for i in chunk] for chunk in torch.randperm(len(seqs), generator=order).split(batch_size)]
               for _ in range(epochs)]
    loss_of = lambda batch: _loss(draft, [seqs[i] for i in batch], [labels[i] for i in batch],  # noqa: E731
                                  [starts[i] for i in batch])
    with _frozen(draft.get_input_embeddings().weight, draft.get_output_embeddings().weight):
        _fit(_trainable(draft), batches, loss_of, state=state, args=args, progress=progress, clip=True)
    return save_draft(draft.eval(), out, model, num_layers, base_model)


def _loss(draft, seqs, labels, starts) -> torch.Tensor:
    """Cross-entropy of the draft's next-token logits to the model's greedy tokens over reply positions (right
    padding; padded and prompt positions ignored)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    target = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, g, start) in enumerate(zip(seqs, labels, starts)):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
        target[i, start - 1 : len(s)] = g[start - 1 :]
    logits = draft(input_ids=ids, attention_mask=mask).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def draft_accuracy(draft, model, seqs, starts) -> float:
    """How often the draft's greedy next token is the model's, over reply positions (teacher-forced)."""
    right = total = 0
    with torch.no_grad():
        for s, start in zip(seqs, starts):
            want = model(s[None]).logits[0, start - 1 :].argmax(-1)
            got = draft(s[None]).logits[0, start - 1 :].argmax(-1)
            right, total = right + int((want == got).sum()), total + len(want)
    return right / max(total, 1)


def check_num_layers(num_layers, layers: int) -> None:
    """A draft of `num_layers` layers cut from a model of `layers` (the CLI checks it before the model loads)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < layers:
        raise OptionError("num_layers", num_layers, f"must be an int in [1, {layers - 1}] (the model has {layers} "
                          "layers)", "e.g. num_layers=2 (CLI: --layers 2)")


def _check(model, prompts, num_layers, **values) -> None:
    """Refuse bad settings before minutes of work, naming the setting and the value."""
    if not hasattr(model, "config") or not hasattr(model, "get_input_embeddings"):
        raise OptionTypeError("model", type(model).__name__, "train_draft needs a Hugging Face causal LM (its config "
                              "builds the draft)", "pass an AutoModelForCausalLM; a plain module's draft is any smaller "
                              "module given as compile(model, drafter=draft)")
    check_num_layers(num_layers, model.config.num_hidden_layers)
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf") or (
                name != "lr" and not isinstance(value, int)):
            example = {"lr": 3e-4, "epochs": 3, "batch_size": 8, "max_new_tokens": 128}[name]
            raise OptionError(name, value, f"must be {'a number > 0' if name == 'lr' else 'an int >= 1'}",
                              f"e.g. {name}={example} (the default)")
    if not prompts:
        raise OptionError("prompts", prompts, "train_draft needs at least one prompt (token ids) to self-distill from",
                          "pass token id tensors, e.g. [chat_ids(tokenizer, text)[0] for text in texts]")
    check_on_cpu(model, "train_draft")
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:  # the draft trains in float32 beside the model's shared embedding (it failed minutes in)
        raise OptionError("model", f"a {str(dtype).removeprefix('torch.')} model", "train_draft trains in float32",
                          "pass model.float() (the draft then loads in the model's dtype)")


def check_draft_directory(directory) -> Path:
    """A directory a draft may be written to: new, or one whose config.json (if any) is a draft's. Nothing else in
    it is touched, so a project folder's own config.json is never overwritten."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise OptionError("out", str(directory), "exists and is not a directory", "choose a directory for the draft")
    config = _read_config(directory / CONFIG) if (directory / CONFIG).exists() else {"format": FORMAT}
    if config.get("format") != FORMAT:
        raise OptionError("out", str(directory), "holds a config.json that is not a speccomp draft's; refusing to "
                          "overwrite it", "choose a new directory for the draft")
    return directory


def _read_config(file: Path) -> dict:
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError, OSError):
        config = None
    return config if isinstance(config, dict) else {}


def drafts_dir(model) -> Path:
    """Where `speccomp train-draft` stores the draft for `model` (the user cache)."""
    from speccomp.models import cache_dir, fingerprint

    return cache_dir() / "drafts" / fingerprint(model)


def any_draft_stored() -> bool:
    """Whether any trained draft lies where load_draft looks without a path (the user cache, the shipped drafts), for
    any model: without one, drafter='draft_model' cannot run (bench --drafters all skips its row before a model loads)."""
    from speccomp.models import cache_dir

    return any(any(folder.glob(f"*/{CONFIG}")) for folder in (cache_dir() / "drafts", _shipped_drafts()) if folder.is_dir())


def _shipped_drafts() -> Path:
    """The drafts shipped inside the speccomp package, one folder per model fingerprint."""
    from importlib import resources

    return Path(str(resources.files("speccomp").joinpath("data/drafts")))


def find_draft(model, path=None) -> tuple[Path | None, list[Path]]:
    """(the folder load_draft reads: `path`, else the user cache, else the shipped drafts; None where none holds a
    config, the folders looked in)."""
    from speccomp.models import fingerprint

    candidates = [Path(path)] if path is not None else [drafts_dir(model), _shipped_drafts() / fingerprint(model)]
    return next((c for c in candidates if (c / CONFIG).is_file()), None), candidates


def load_draft(model, path=None):
    """The draft `train_draft` saved for `model` (at `path`, else the user cache, else the drafts shipped with speccomp),
    rebuilt around the model's own embedding and LM head; or, at `path`, any Hugging Face causal LM checkpoint
    directory (config.json with a model_type, safetensors weights: a small model of the target's family, say).
    Safetensors only: nothing is unpickled."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from speccomp.models import fingerprint

    found, candidates = find_draft(model, path)
    weight = next(model.parameters())  # the draft is placed and cast as the model's weights are
    if found is None and path is not None:
        raise OptionError("path", str(path), f"holds no {CONFIG} of a draft or a Hugging Face checkpoint",
                          "pass the directory `speccomp train-draft` (speccomp.train_draft) wrote, or a checkpoint's")
    if found is None:
        dtype = weight.dtype
        kept = sorted(str(c.parent) for c in drafts_dir(model).parent.glob(f"*/{CONFIG}"))
        cast = "" if dtype == torch.float32 else (  # train_draft trains in float32, and a cast model hashes otherwise
            f" (drafts are kept under the float32 model's fingerprint, which a {str(dtype).removeprefix('torch.')} "
            f"model does not have; drafts in the cache: {kept or 'none'}: pass one as drafter_options={{'path': DIR}})")
        raise OptionError("drafter", "draft_model", f"no trained draft for this model in {[str(c) for c in candidates]}"
                          + cast, "train one with `speccomp train-draft` (default model) or speccomp.train_draft(model, "
                          "prompts, out=DIR), or pass drafter_options={'path': DIR}")
    config = _read_config(found / CONFIG)
    if path is not None and config.get("format") is None and isinstance(config.get("model_type"), str):
        return load_hf_checkpoint(found, weight.dtype).to(weight.device)
    if config.get("format") != FORMAT or not isinstance(config.get("num_layers"), int):
        raise OptionError("path", str(found), "is not a speccomp draft (config.json)", "pass a directory "
                          "written by speccomp train-draft")
    # trained in float32 (train_draft refuses other dtypes): the same model cast to bfloat16 hashes otherwise, so a
    # cast model is not compared (as heads are not); the weights' shapes still have to fit below
    if weight.dtype == torch.float32 and config.get("base_fingerprint") != fingerprint(model):
        raise OptionError("path" if path is not None else "drafter_options", str(found), f"holds a draft trained for another model "
                          f"({config.get('base_model_name_or_path') or config.get('base_fingerprint')})",
                          "train a draft for this model with speccomp.train_draft")
    try:
        check_num_layers(config["num_layers"], model.config.num_hidden_layers)
        draft = draft_architecture(model, config["num_layers"])
        own = load_file(str(found / WEIGHTS))
        _, unexpected = draft.load_state_dict(own, strict=False)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # missing, truncated, other shapes
        raise OptionError("path" if path is not None else "drafter_options", str(found), f"holds a draft that does "
                          f"not load ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})", "train the draft "
                          "again for this model (speccomp train-draft), or restore its files") from None
    missing = sorted(k for k in own_state(draft) if k not in own)
    if unexpected or missing:
        raise OptionError("drafter_options", str(found), f"{WEIGHTS} does not fit the model (unexpected "
                          f"{unexpected[:3]}, missing {missing[:3]})", "train the draft again for this model")
    return draft.to(device=weight.device, dtype=weight.dtype).eval()  # beside the model's shared embedding and head


def load_hf_checkpoint(directory: Path, dtype):
    """A Hugging Face causal LM saved with save_pretrained in `directory`, loaded offline from its safetensors
    weights (a checkpoint holding only pickled .bin weights is refused, never unpickled)."""
    from transformers import AutoModelForCausalLM

    if not any(directory.glob("*.safetensors")):
        raise OptionError("drafter_options", str(directory), "is a Hugging Face checkpoint without .safetensors weights "
                          "(speccomp never unpickles a .bin file)", "save the draft with save_pretrained("
                          "safe_serialization=True), or convert its weights to safetensors")
    try:  # trust_remote_code=False: a directory's own modeling code is never run (nor asked about)
        draft = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, use_safetensors=True,
                                                     dtype=dtype, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - a corrupt safetensors file, shapes that do not fit, an unknown model
        raise OptionError("drafter_options", str(directory), f"could not be loaded as a Hugging Face causal LM ({exc})",
                          "pass a directory written by save_pretrained of a causal LM, or one from speccomp "
                          "train-draft") from None
    return draft.eval()
