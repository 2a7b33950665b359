"""Medusa draft heads: the module, and checkpoints in FasterDecoding/Medusa's layout.

Head k (0-based) reads the target's last hidden state h_t (after the final norm) and predicts
the token k + 2 places ahead (the LM head itself predicts k = -1, the next token):

    s_k = h_t + SiLU(W_k h_t + b_k)          (one ResBlock; `num_layers` of them in sequence)
    logits_k = P_k s_k                       (P_k: the frozen LM head when tied, else its own)

Checkpoint layout (what FasterDecoding/Medusa writes and reads):

    config.json                  {"medusa_num_heads": K, "medusa_num_layers": L, "hidden_size": H,
                                  "vocab_size": V, "base_model_name_or_path": ..., ...}
    medusa_lm_head.safetensors   {k}.{j}.linear.weight [H, H], .bias [H]   (j < L)
                                 {k}.{L}.weight [V, H]                     (projection)

(the names of Medusa's `medusa_head` ModuleList's state dict, which its code loads; files speccomp wrote before
prefixed them with "medusa_head.", and load too)

speccomp's own files leave the projections out when they are the LM head (`"tied_lm_head": true`
in config.json), which keeps a head file at a few MB; `save_medusa(..., medusa_layout=True)`
writes them in, so the Medusa code base can load the file.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from speccomp.errors import SpeccompError

WEIGHTS = "medusa_lm_head.safetensors"
CONFIG = "config.json"


class HeadsError(SpeccompError, ValueError):
    """A head checkpoint that is missing, corrupt, or made for another model."""


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: head k begins as the LM head
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads of L ResBlocks. `states(h)` [.., H] -> [.., K, H]; `logits(h)` applies the projections."""

    def __init__(self, num_heads: int, hidden: int, vocab: int, num_layers: int = 1, lm_head: torch.Tensor | None = None):
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise HeadsError(f"need at least one head and one layer, got heads={num_heads}, layers={num_layers}")
        self.num_heads, self.num_layers, self.hidden, self.vocab = num_heads, num_layers, hidden, vocab
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)]) for _ in range(num_heads))
        # tied: the frozen LM head weight [V, H], kept as a plain attribute (not saved, not trained)
        self.lm_head = lm_head
        self.proj = None if lm_head is not None else nn.ParameterList(nn.Parameter(torch.zeros(vocab, hidden))
                                                                      for _ in range(num_heads))

    @property
    def tied(self) -> bool:
        return self.proj is None

    def states(self, h: torch.Tensor) -> torch.Tensor:
        return torch.stack([blocks(h) for blocks in self.blocks], dim=-2)  # [..., K, H]

    def project(self, s: torch.Tensor) -> torch.Tensor:
        """Logits [..., K, V] of head states [..., K, H]."""
        if self.tied:
            return s @ self.lm_head.t()
        return torch.stack([s[..., k, :] @ self.proj[k].t() for k in range(self.num_heads)], dim=-2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.project(self.states(h))


def _model_weight(model, getter: str, what: str) -> torch.Tensor:
    """The frozen weight of `model.<getter>()` (an embedding or the LM head), or a HeadsError naming `what`."""
    module = getattr(model, getter)() if hasattr(model, getter) else None
    if module is None or not hasattr(module, "weight"):
        layer = "nn.Linear LM head" if getter == "get_output_embeddings" else "nn.Embedding"
        raise HeadsError(f"{type(model).__name__} has no {what}: the heads drafters (medusa, hydra, eagle) read it "
                         f"through `{getter}()`, as Hugging Face models have it; give a plain module a `{getter}()` "
                         f"that returns its {layer}")
    return module.weight.detach()


def _lm_head_weight(model) -> torch.Tensor:
    return _model_weight(model, "get_output_embeddings", "output embedding (LM head) for the heads' logits")


def on_model_device(heads: nn.Module, lm: torch.Tensor, dtype: torch.dtype | None = None) -> nn.Module:
    """Heads are read from files (and made fresh) in float32 on the CPU; they run where the model's LM head is and in
    its dtype (or `dtype`), since their states come from the model and their logits go through its LM head (a GPU
    model drafts on the GPU; a bfloat16 model's states would not multiply float32 weights)."""
    return heads.to(lm.device, dtype or lm.dtype)


def made_for(heads: nn.Module, model) -> nn.Module:
    """Record which model fresh heads are for: saved in config.json (base_fingerprint, base_dtype), compared at load
    by `read_head_files` (heads of another model with the same sizes load and stay exact, but their drafts miss)."""
    heads.trained_for = _model_identity(model)
    return heads


def _model_identity(model) -> dict:
    """{"base_fingerprint", "base_dtype"} of `model`; {} where its weights cannot be read (the meta device). The
    dtype is kept because the fingerprint hashes values: the same model cast to bfloat16 has another one."""
    from speccomp.models import fingerprint

    weight = next(model.parameters(), None)
    if weight is None or weight.device.type == "meta":
        return {}
    return {"base_fingerprint": fingerprint(model), "base_dtype": str(weight.dtype).removeprefix("torch.")}


def block_names(prefix: str, num_heads: int, num_layers: int, hidden: int) -> dict[str, tuple[str, tuple]]:
    """File tensor name -> (state-dict name, shape) of the heads' ResBlocks, `{prefix}{k}.{j}.linear.{p}`."""
    shapes = {"weight": (hidden, hidden), "bias": (hidden,)}
    return {f"{prefix}{k}.{j}.linear.{p}": (f"blocks.{k}.{j}.linear.{p}", shapes[p])
            for k in range(num_heads) for j in range(num_layers) for p in shapes}


def new_heads(model, num_heads: int = 4, num_layers: int = 1) -> MedusaHeads:
    """Fresh heads for `model`, tied to its frozen LM head (Medusa-1: the backbone stays frozen)."""
    w = _lm_head_weight(model)
    return made_for(on_model_device(MedusaHeads(num_heads, w.shape[1], w.shape[0], num_layers, lm_head=w), w), model)


def save_medusa(heads: MedusaHeads, directory, *, base_model: str = "", medusa_layout: bool = False) -> Path:
    """Write config.json + medusa_lm_head.safetensors; `medusa_layout` also writes tied projections."""
    state = heads.state_dict()
    names = block_names("", heads.num_heads, heads.num_layers, heads.hidden)
    tensors = {name: state[own].cpu().contiguous() for name, (own, _) in names.items()}
    for k in range(heads.num_heads):
        if not heads.tied or medusa_layout:
            proj = heads.lm_head.detach().clone() if heads.tied else heads.proj[k].detach()
            tensors[f"{k}.{heads.num_layers}.weight"] = proj.cpu().contiguous()
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers, "hidden_size": heads.hidden,
              "vocab_size": heads.vocab, "base_model_name_or_path": base_model,
              "tied_lm_head": heads.tied and not medusa_layout, **getattr(heads, "trained_for", {})}
    return write_head_files(directory, WEIGHTS, tensors, config)


def check_head_directory(directory) -> Path:
    """A directory heads may be written to: new, or one whose config.json (if any) is a head config. Nothing else
    in it is touched, so a project folder's own config.json is never overwritten by a head config."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise HeadsError(f"{directory} exists and is not a directory; choose a directory for the heads")
    cfg = directory / CONFIG
    if cfg.exists():
        try:
            config = json.loads(cfg.read_text())
        except (ValueError, UnicodeDecodeError, OSError):
            config = None
        if not isinstance(config, dict) or not ("head_type" in config or "medusa_num_heads" in config):
            raise HeadsError(f"{cfg} exists and is not a head config; refusing to overwrite it (choose a new "
                             "directory for the heads)")
    return directory


def write_head_files(directory, weights: str, tensors: dict, config: dict) -> Path:
    """Write a head directory: `weights` (safetensors) + config.json; read back by `read_head_files`."""
    from safetensors.torch import save_file

    from speccomp.models import replace_atomically, write_atomically

    directory = check_head_directory(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # each file replaced in one rename: a reader sees old or new files, never half a file (a mismatched pair is
    # caught at load, where config.json is checked against the weights' header)
    replace_atomically(directory / weights, lambda tmp: save_file(tensors, str(tmp)))
    write_atomically(directory / CONFIG, json.dumps(config, indent=1) + "\n")
    return directory


def display_kind(kind: str) -> str:
    """"a Medusa", "a Hydra", "an EAGLE": how messages name a head kind."""
    return {"eagle": "an EAGLE"}.get(kind, f"a {kind.capitalize()}")


FLOAT_DTYPES, INT_DTYPES = ("F16", "BF16", "F32"), ("I64", "I32")  # safetensors dtype names


def config_int(config: dict, key: str, where, default=None) -> int:
    """A positive int field of a head config.json, or a HeadsError naming the field."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HeadsError(f"{where}: {key} must be a positive int, got {value!r}; the file is corrupt or not a head config")
    return value


def check_dimensions(config: dict, directory, kind: str, hidden: int, vocab: int) -> None:
    """The config's hidden_size / vocab_size (where given) against the model's, before any tensor is read."""
    for key, have, what in (("hidden_size", hidden, "hidden size"), ("vocab_size", vocab, "a vocabulary of")):
        made = config.get(key)
        if made is not None and made != have:
            raise HeadsError(f"{display_kind(kind)} head in {directory} was made for {what} {made!r} (config.json "
                             f"{key}), but the model has {what} {have}; use heads trained for this model")


def tensor_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of a safetensors file, from its header alone (no tensor data is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise HeadsError(f"{path} is corrupt or not a safetensors file: {exc}") from None


def check_layout(path: Path, header: dict, expected: dict[str, tuple], integer=("draft_vocab",)) -> None:
    """Every tensor `expected` (name -> shape; None in a shape: any length) is in the file with that shape and a
    float dtype (integer names: an int dtype), and nothing else is."""
    missing = [n for n in expected if n not in header]
    extra = [n for n in header if n not in expected]
    if missing or extra:
        raise HeadsError(f"{path} does not hold the tensors its config.json describes: missing {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}, unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}; "
                         "the files are corrupt or do not belong together")
    for name, want in expected.items():
        shape, dtype = header[name]
        if len(shape) != len(want) or any(w is not None and w != d for w, d in zip(want, shape)):
            shown = [("any" if w is None else w) for w in want]
            raise HeadsError(f"{path}: {name} has shape {list(shape)}, but heads for this model need {shown}; "
                             "the heads were made for another model (or config.json was edited)")
        allowed = INT_DTYPES if name in integer else FLOAT_DTYPES
        if dtype not in allowed:
            raise HeadsError(f"{path}: {name} is stored as {dtype}, expected one of {list(allowed)}")


def read_head_files(directory, kind: str, weights: str, layout, model) -> tuple[dict, dict]:
    """(config, tensors) of a head directory, checked before any tensor is allocated: `layout(config, header)`
    returns the {name: shape} the config describes for this model (it checks the config's numbers against the
    file's header first, so an edited config.json cannot make anyone allocate what the file does not hold).
    Heads whose config names another model (base_fingerprint) load with a warning: exact, but slow."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg_path, w_path = directory / CONFIG, directory / weights
    if not w_path.is_file() or not cfg_path.is_file():
        raise HeadsError(f"{directory} is not {display_kind(kind)} head directory: it needs {CONFIG} and {weights}")
    try:
        config = json.loads(cfg_path.read_text())
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        raise HeadsError(f"{cfg_path} is not valid JSON ({exc}); the head directory is corrupt") from None
    if not isinstance(config, dict):
        raise HeadsError(f"{cfg_path}: expected a JSON object with {kind}_num_heads, got {type(config).__name__}")
    header = tensor_header(w_path)
    check_layout(w_path, header, layout(config, header))
    _check_made_for(config, directory, kind, model)  # after the sizes: heads that cannot load are refused alone
    try:
        tensors = load_file(str(w_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise HeadsError(f"{w_path} is corrupt or not a safetensors file: {exc}") from None
    return config, tensors


def identity_in(config: dict) -> dict:
    """The identity fields (`_model_identity`) a head config.json holds."""
    return {k: config[k] for k in ("base_fingerprint", "base_dtype") if isinstance(config.get(k), str)}


def _check_made_for(config: dict, directory, kind: str, model) -> None:
    """Warn where config.json names another model than `model` in the same dtype (a cast model is not compared)."""
    import warnings

    made, have = identity_in(config), _model_identity(model)
    if not have or made.get("base_fingerprint", have["base_fingerprint"]) == have["base_fingerprint"]:
        return  # nothing to compare, or the same model
    if made.get("base_dtype", have["base_dtype"]) != have["base_dtype"]:
        return  # the model cast to another dtype hashes otherwise: not compared
    name = config.get("base_model_name_or_path")
    warnings.warn(f"{display_kind(kind)} head in {directory} was trained for another model (fingerprint "
                  f"{made['base_fingerprint']}{f', {name}' if name else ''}; this model's is "
                  f"{have['base_fingerprint']}): decoding stays exact, but its drafts will rarely be accepted; "
                  "train heads for this model (speccomp.train_heads)", stacklevel=4)


def count_check(where, config_says: str, want: int, header: dict) -> None:
    if want != len(header):
        raise HeadsError(f"{where}: config.json says {config_says} ({want} tensors), but the file holds {len(header)}; "
                         "the files are corrupt or do not belong together")


def load_medusa(directory, model) -> MedusaHeads:
    """Heads from a Medusa-layout directory, checked against `model` (hidden size, vocabulary)."""
    directory = Path(directory)
    lm = _lm_head_weight(model)
    vocab, hidden = lm.shape
    shape = {}

    def layout(config, header):
        check_dimensions(config, directory, "medusa", hidden, vocab)
        k_heads = config_int(config, "medusa_num_heads", directory / CONFIG)
        layers = config_int(config, "medusa_num_layers", directory / CONFIG, default=1)
        # Medusa's names are its medusa_head module's ("0.0.linear.weight"); speccomp wrote them prefixed before
        prefix = "medusa_head." if any(name.startswith("medusa_head.") for name in header) else ""
        untied = f"{prefix}0.{layers}.weight" in header  # projections in the file (Medusa's own layout)
        count_check(directory / WEIGHTS, f"{k_heads} heads x {layers} layers", k_heads * (2 * layers + untied), header)
        shape.update(names=block_names(prefix, k_heads, layers, hidden), heads=k_heads, layers=layers,
                     untied=untied, prefix=prefix)
        want = {name: size for name, (_, size) in shape["names"].items()}
        want.update({f"{prefix}{k}.{layers}.weight": (vocab, hidden) for k in range(k_heads) if untied})
        return want

    config, tensors = read_head_files(directory, "medusa", WEIGHTS, layout, model)
    k_heads, layers = shape["heads"], shape["layers"]
    projections = [tensors.get(f"{shape['prefix']}{k}.{layers}.weight") for k in range(k_heads)]
    # (a Medusa-layout file whose projections are the frozen LM head shares it instead of copying it)
    host_lm = lm.cpu() if shape["untied"] else None  # the files are read on the CPU; one copy of a GPU model's head
    tied = not shape["untied"] or all(torch.equal(p, host_lm) for p in projections)
    heads = MedusaHeads(k_heads, hidden, vocab, layers, lm_head=lm if tied else None)
    state = {own: tensors[name].float() for name, (own, _) in shape["names"].items()}
    state.update({f"proj.{k}": p.float() for k, p in enumerate(projections) if not tied})
    heads.load_state_dict(state)
    heads.trained_for = identity_in(config)  # saved back as it came
    return on_model_device(heads, lm).eval()
