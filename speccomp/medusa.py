"""Medusa draft heads: the module, and checkpoints in FasterDecoding/Medusa's layout.

Head k (0-based) reads the target's last hidden state h_t (after the final norm) and predicts
the token k + 2 places ahead (the LM head itself predicts k = -1, the next token):

    s_k = h_t + SiLU(W_k h_t + b_k)          (one ResBlock; `num_layers` of them in sequence)
    logits_k = P_k s_k                       (P_k: the frozen LM head when tied, else its own)

Checkpoint layout (what FasterDecoding/Medusa writes and reads):

    config.json                  {"medusa_num_heads": K, "medusa_num_layers": L, "hidden_size": H,
                                  "vocab_size": V, "base_model_name_or_path": ..., ...}
    medusa_lm_head.safetensors   medusa_head.{k}.{j}.linear.weight [H, H], .bias [H]   (j < L)
                                 medusa_head.{k}.{L}.weight [V, H]                     (projection)

speccomp's own files leave the projections out when they are the LM head (`"tied_lm_head": true`
in config.json), which keeps a head file at a few MB; `save_medusa(..., medusa_layout=True)`
writes them in, so the Medusa code base can load the file.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .errors import SpeccompError

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
        self.proj = None if lm_head is not None else nn.ParameterList(
            nn.Parameter(torch.zeros(vocab, hidden)) for _ in range(num_heads)
        )

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


def _lm_head_weight(model) -> torch.Tensor:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is None or not hasattr(out, "weight"):
        raise HeadsError(f"{type(model).__name__} has no output embedding (LM head) to tie Medusa heads to")
    return out.weight.detach()


def new_heads(model, num_heads: int = 4, num_layers: int = 1) -> MedusaHeads:
    """Fresh heads for `model`, tied to its frozen LM head (Medusa-1: the backbone stays frozen)."""
    w = _lm_head_weight(model)
    return MedusaHeads(num_heads, w.shape[1], w.shape[0], num_layers, lm_head=w)


def save_medusa(heads: MedusaHeads, directory, *, base_model: str = "", medusa_layout: bool = False) -> Path:
    """Write config.json + medusa_lm_head.safetensors; `medusa_layout` also writes tied projections."""
    tensors = {}
    for k, blocks in enumerate(heads.blocks):
        for j, block in enumerate(blocks):
            tensors[f"medusa_head.{k}.{j}.linear.weight"] = block.linear.weight.detach().contiguous()
            tensors[f"medusa_head.{k}.{j}.linear.bias"] = block.linear.bias.detach().contiguous()
        if not heads.tied:
            tensors[f"medusa_head.{k}.{heads.num_layers}.weight"] = heads.proj[k].detach().contiguous()
        elif medusa_layout:
            tensors[f"medusa_head.{k}.{heads.num_layers}.weight"] = heads.lm_head.detach().clone().contiguous()
    tied_out = heads.tied and not medusa_layout
    config = {
        "medusa_num_heads": heads.num_heads,
        "medusa_num_layers": heads.num_layers,
        "hidden_size": heads.hidden,
        "vocab_size": heads.vocab,
        "base_model_name_or_path": base_model,
        "tied_lm_head": tied_out,
    }
    return write_head_files(directory, WEIGHTS, tensors, config)


def write_head_files(directory, weights: str, tensors: dict, config: dict) -> Path:
    """Write a head directory: `weights` (safetensors) + config.json; read back by `read_head_files`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / weights))
    (directory / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return directory


def display_kind(kind: str) -> str:
    """"a Medusa", "a Hydra", "an EAGLE": how messages name a head kind."""
    return {"eagle": "an EAGLE"}.get(kind, f"a {kind.capitalize()}")


def read_head_files(directory, kind: str, weights: str):
    """(config, number of heads, layers per head, tensors) of a head directory (`kind`: "medusa" or
    "hydra", the prefix of its config keys), with clear errors for missing or corrupt files."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg_path, w_path = directory / CONFIG, directory / weights
    if not w_path.exists() or not cfg_path.exists():
        raise HeadsError(f"{directory} is not {display_kind(kind)} head directory: it needs {CONFIG} and {weights}")
    try:
        config = json.loads(cfg_path.read_text())
        k_heads, layers = int(config[f"{kind}_num_heads"]), int(config.get(f"{kind}_num_layers", 1))
    except (ValueError, KeyError, TypeError) as exc:
        raise HeadsError(
            f"{cfg_path}: not a {kind.capitalize()} config (needs {kind}_num_heads, {kind}_num_layers): {exc}"
        ) from None
    try:
        tensors = load_file(str(w_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise HeadsError(f"{w_path} is corrupt or not a safetensors file: {exc}") from None
    return config, k_heads, layers, tensors


def load_medusa(directory, model) -> MedusaHeads:
    """Heads from a Medusa-layout directory, checked against `model` (hidden size, vocabulary)."""
    directory = Path(directory)
    w_path = directory / WEIGHTS
    config, k_heads, layers, tensors = read_head_files(directory, "medusa", WEIGHTS)
    lm = _lm_head_weight(model)
    vocab, hidden = lm.shape
    first = tensors.get("medusa_head.0.0.linear.weight")
    if first is None:
        raise HeadsError(f"{w_path} has no medusa_head.0.0.linear.weight; is it a Medusa head file?")
    if tuple(first.shape) != (hidden, hidden):
        raise HeadsError(
            f"heads in {directory} were made for hidden size {first.shape[1]}, but the model has hidden size {hidden}"
        )
    proj_key = f"medusa_head.0.{layers}.weight"
    tied = proj_key not in tensors
    if not tied and tensors[proj_key].shape[0] != vocab:
        raise HeadsError(f"heads in {directory} project to {tensors[proj_key].shape[0]} tokens, the model's vocabulary is {vocab}")
    if tied and int(config.get("vocab_size", vocab)) != vocab:
        raise HeadsError(f"heads in {directory} were made for a vocabulary of {config['vocab_size']}, the model's is {vocab}")
    if not tied and all(torch.equal(tensors[f"medusa_head.{k}.{layers}.weight"], lm) for k in range(k_heads)):
        tied = True  # Medusa-layout file whose projections are the frozen LM head: share it, do not copy
    heads = MedusaHeads(k_heads, hidden, vocab, layers, lm_head=lm if tied else None)
    state = {}
    for k in range(k_heads):
        for j in range(layers):
            for p in ("weight", "bias"):
                key = f"medusa_head.{k}.{j}.linear.{p}"
                if key not in tensors:
                    raise HeadsError(f"{w_path} is missing {key} (config says {k_heads} heads x {layers} layers)")
                state[f"blocks.{k}.{j}.linear.{p}"] = tensors[key]
        if not tied:
            state[f"proj.{k}"] = tensors[f"medusa_head.{k}.{layers}.weight"]
    heads.load_state_dict(state)
    return heads.eval()
