"""Hydra draft heads: Medusa heads that also read the token drafted before them.

A Medusa head guesses token t + k + 2 from h_t alone, blind to the tokens in between. A Hydra
head is sequential: it also reads the embedding of the token at the previous depth, so the
first head already knows the root token (the target's own next token) and deeper heads know
which branch of the tree they extend (Ankner et al., "Hydra", 2024). Head k (0-based):

    u_k = s_k + W_k E(x_k) + b_k        s_0 = h_t (the target's final hidden state), x_0 = the root
    s_{k+1} = ResBlocks_k(u_k)          (y + SiLU(W y + b), `num_layers` times)
    logits_k = P s_{k+1}                P = the frozen LM head restricted to the draft vocabulary

`E` is the model's frozen input embedding. The draft vocabulary (FR-Spec's idea) is the
`draft_vocab` most frequent tokens of the training data: a drafter can only propose tokens it
scores, and scoring 8k tokens instead of 49k makes each head ~6x cheaper on CPU. Verification
stays with the full model, so the restriction costs acceptance only when the target's token is
rare, never correctness.

Checkpoint layout (our own; Hydra's code base has no settled one), in a directory:

    config.json                {"head_type": "hydra", "hydra_num_heads": K, "hydra_num_layers": L,
                                "hidden_size": H, "vocab_size": V, "draft_vocab_size": Vd, ...}
    hydra_heads.safetensors    hydra_head.{k}.embed.weight [H, H], .bias [H]
                               hydra_head.{k}.{j}.linear.weight [H, H], .bias [H]     (j < L)
                               draft_vocab [Vd] (int64 token ids)
Weights are stored as float16 (a few MB) and loaded as float32.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from speccomp.drafters.medusa import (CONFIG, HeadsError, ResBlock, _lm_head_weight, _model_weight, block_names,
                                      check_dimensions, config_int, count_check, identity_in, made_for,
                                      on_model_device, read_head_files, write_head_files)

WEIGHTS = "hydra_heads.safetensors"


def _input_embedding(model) -> torch.Tensor:
    return _model_weight(model, "get_input_embeddings", "input embedding for Hydra heads to read")


def _names(num_heads: int, num_layers: int, hidden: int) -> dict[str, tuple[str, tuple]]:
    """File tensor name -> (state-dict name, shape) of the heads' weights (the draft vocabulary aside)."""
    names = {f"hydra_head.{k}.embed.{p}": (f"embeds.{k}.{p}", shape) for k in range(num_heads)
             for p, shape in (("weight", (hidden, hidden)), ("bias", (hidden,)))}
    return {**names, **block_names("hydra_head.", num_heads, num_layers, hidden)}


class HydraHeads(nn.Module):
    """K sequential heads. `step(k, s, x)` -> next state; `logits(s)` over the draft vocabulary."""

    kind = "hydra"

    def __init__(self, num_heads: int, hidden: int, vocab: int, num_layers: int, lm_head: torch.Tensor,
                 embed: torch.Tensor, draft_vocab: torch.Tensor):
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise HeadsError(f"need at least one head and one layer, got heads={num_heads}, layers={num_layers}")
        self.num_heads, self.num_layers, self.hidden, self.vocab = num_heads, num_layers, hidden, vocab
        self.embeds = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_heads))
        for lin in self.embeds:  # start by ignoring the token: head k begins as a Medusa head
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)]) for _ in range(num_heads))
        self.embed = embed.float()  # [V, H] frozen, not saved (a float32 model's own tensor; a copy for others)
        self.set_draft_vocab(lm_head, draft_vocab)

    def set_draft_vocab(self, lm_head: torch.Tensor, draft_vocab: torch.Tensor) -> None:
        draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.long)
        if draft_vocab.dim() != 1 or len(draft_vocab) == 0:
            raise HeadsError("draft_vocab must be a non-empty 1-D list of token ids")
        if int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= self.vocab:
            raise HeadsError(f"draft_vocab holds token ids outside the model's vocabulary [0, {self.vocab})")
        self.lm_head = lm_head
        self.draft_vocab = draft_vocab.to(lm_head.device)  # indexes the LM head (and maps the step's ids) there
        # [Vd, H], frozen; float32 whatever the model's dtype: the heads read states handed over as float32 numpy
        # (grow.py's host side and the engine share that convention), so they run in float32 (on_model_device)
        self.draft_lm = lm_head.index_select(0, self.draft_vocab).float().contiguous()

    def step(self, k: int, s: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """State after head k: s [n, H] (the parent's state), tokens [n] (the parent's token) -> [n, H]."""
        return self.blocks[k](s + self.embeds[k](self.embed[tokens]))

    def logits(self, s: torch.Tensor) -> torch.Tensor:
        """Scores [..., Vd] over the draft vocabulary (index i is token draft_vocab[i])."""
        return s @ self.draft_lm.t()

    def forward(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced training view: h [B, H], tokens [B, K] (x_{t+1} .. x_{t+K}) -> logits [B, K, Vd]."""
        s, out = h, []
        for k in range(self.num_heads):
            s = self.step(k, s, tokens[:, k])
            out.append(s)
        return self.logits(torch.stack(out, dim=1))


MAX_SIBLINGS = 10  # the step graphs return each state's 10 best next tokens (EAGLE-2's top_k): sibling ranks 0..9


class HydraStep(nn.Module):
    """One head step for any head, the graph Hydra drafts with on every backend and in engines (hydra.onnx):

        (head [], states [n, H], tokens [n]) -> (next_states [n, H], top_logp [n, top], top_ids [n, top])

    = HydraHeads.step(head, states, tokens), then the log-softmax over the draft vocabulary and its `top` best as
    token ids, best first (top = min(MAX_SIBLINGS, draft vocabulary): trees rank siblings below it). The heads'
    weights are stacked [K, ...] and indexed by `head`, so one graph (and one copy of the input embedding) serves
    every depth; the draft-vocabulary projection is a plain linear, which the eager lowering packs for oneDNN like
    the target's."""

    def __init__(self, heads: HydraHeads):
        super().__init__()
        stack = torch.stack
        weights = {
            "embed_w": stack([lin.weight for lin in heads.embeds]),  # [K, H, H]
            "embed_b": stack([lin.bias for lin in heads.embeds]),  # [K, H]
            "block_w": stack([stack([b.linear.weight for b in blocks]) for blocks in heads.blocks]),  # [K, L, H, H]
            "block_b": stack([stack([b.linear.bias for b in blocks]) for blocks in heads.blocks]),  # [K, L, H]
            "embed": heads.embed, "draft_lm": heads.draft_lm, "vocab": heads.draft_vocab,
        }
        for name, tensor in weights.items():
            self.register_buffer(name, tensor.detach(), persistent=False)
        self.top = min(MAX_SIBLINGS, len(heads.draft_vocab))

    def forward(self, head, states, tokens):
        # on the CPU w[head] is a view of the head's weights; captured on CUDA, a 0-d index tensor is read as a Python
        # int there (a data-dependent guard: gpu_check.py), so off the CPU the weights are picked by index_select (a
        # copy per call: H^2 (1 + L) floats). The choice is made at capture time, from where the weights are.
        on_cpu = self.embed_w.device.type == "cpu"
        pick = {name: getattr(self, name)[head] if on_cpu else getattr(self, name).index_select(0, head.reshape(1))[0]
                for name in ("embed_w", "embed_b", "block_w", "block_b")}
        x = states + self.embed[tokens] @ pick["embed_w"].t() + pick["embed_b"]
        for j in range(self.block_w.shape[1]):
            x = x + nn.functional.silu(x @ pick["block_w"][j].t() + pick["block_b"][j])
        logp, idx = nn.functional.linear(x, self.draft_lm).log_softmax(-1).topk(self.top, dim=-1)
        return x, logp, self.vocab[idx]

    def graph_spec(self):
        from speccomp.backends.drafter_graph import DrafterGraphSpec
        from speccomp.engine.runtime import HYDRA_OUTPUTS  # the engine's names for this graph's outputs

        n = torch.export.Dim("n", min=1, max=4096)
        device = self.embed.device  # the step is captured where it runs
        example = (torch.tensor(0, device=device), torch.zeros(2, self.embed.shape[1], device=device),
                   torch.zeros(2, dtype=torch.long, device=device))
        return DrafterGraphSpec("hydra", ["head", "states", "tokens"], HYDRA_OUTPUTS, example, (None, {0: n}, {0: n}))


def new_hydra(model, draft_vocab, num_heads: int = 4, num_layers: int = 1) -> HydraHeads:
    lm = _lm_head_weight(model)
    heads = HydraHeads(num_heads, lm.shape[1], lm.shape[0], num_layers, lm, _input_embedding(model), draft_vocab)
    return made_for(on_model_device(heads, lm, torch.float32), model)


def save_hydra(heads: HydraHeads, directory, *, base_model: str = "") -> Path:
    state = heads.state_dict()
    tensors = {name: state[own] for name, (own, _) in _names(heads.num_heads, heads.num_layers, heads.hidden).items()}
    return save_draft_heads(heads, directory, WEIGHTS, tensors, base_model, head_type="hydra",
                            hydra_num_heads=heads.num_heads, hydra_num_layers=heads.num_layers)


def save_draft_heads(heads, directory, weights: str, tensors: dict, base_model: str, **fields) -> Path:
    """Write a head kind tied to the frozen LM head on a draft vocabulary (Hydra, EAGLE): `tensors` as float16 plus
    draft_vocab, and config.json with `fields` and the model's sizes."""
    tensors = {name: t.detach().half().cpu().contiguous() for name, t in tensors.items()}
    tensors["draft_vocab"] = heads.draft_vocab.cpu().contiguous()
    config = {**fields, "hidden_size": heads.hidden, "vocab_size": heads.vocab,
              "draft_vocab_size": len(heads.draft_vocab), "base_model_name_or_path": base_model,
              "tied_lm_head": True, "dtype": "float16", **getattr(heads, "trained_for", {})}
    return write_head_files(directory, weights, tensors, config)


def load_hydra(directory, model) -> HydraHeads:
    """Heads from a directory written by `save_hydra`, checked against `model`."""
    directory = Path(directory)
    lm = _lm_head_weight(model)
    vocab, hidden = lm.shape
    shape = {}

    def layout(config, header):
        check_dimensions(config, directory, "hydra", hidden, vocab)
        k_heads = config_int(config, "hydra_num_heads", directory / CONFIG)
        layers = config_int(config, "hydra_num_layers", directory / CONFIG, default=1)
        count_check(directory / WEIGHTS, f"{k_heads} heads x {layers} layers", k_heads * (2 + 2 * layers) + 1, header)
        shape.update(names=_names(k_heads, layers, hidden), heads=k_heads, layers=layers)
        want = {name: size for name, (_, size) in shape["names"].items()}
        return {"draft_vocab": (config.get("draft_vocab_size"),), **want}

    config, tensors = read_head_files(directory, "hydra", WEIGHTS, layout, model)
    heads = HydraHeads(shape["heads"], hidden, vocab, shape["layers"], lm, _input_embedding(model), tensors["draft_vocab"])
    heads.load_state_dict({own: tensors[name].float() for name, (own, _) in shape["names"].items()})
    heads.trained_for = identity_in(config)  # saved back as it came
    return on_model_device(heads, lm, torch.float32).eval()
