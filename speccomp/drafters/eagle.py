"""EAGLE draft head: one small decoder layer that runs ahead of the target in its feature space.

Medusa and Hydra heads read one hidden state h_t and guess several tokens ahead blind to the
rest of the text. EAGLE (Li et al., 2024) drafts autoregressively at the *feature* level: a
single decoder layer reads, at every position p, the target's feature f_p (its final hidden
state, the LM head's input) and the embedding of the next token x_{p+1}, attends over all
earlier positions through its own KV cache, and predicts f_{p+1}; the frozen LM head turns
that into the next draft token. Deeper drafts feed the predicted feature back in:

    u_p   = W_fc [f_p ; E(x_{p+1})] + b_fc                 f_p: target feature, or the head's own guess
    o_p   = Layer(u_p | u_{<p})                            pre-norm attention (RoPE) + SwiGLU MLP, residual
    f̂_{p+1} = o_p,  logits = P o_p                         P: the frozen LM head on the draft vocabulary

Training (speccomp/tuning/train_heads.py, kind="eagle") unrolls the head on its own predictions
(`unrolled`), so the deeper drafts it is trained on are the ones it makes at run time (the
"training-time test" of HASS / EAGLE-3): at unroll step s, anchor p attends to the true
entries <= p and to its own earlier steps, exactly as a chain drafted after p does.

Checkpoint layout (our own), in a directory:

    config.json               {"head_type": "eagle", "eagle_num_heads": A, "eagle_num_layers": 1,
                               "hidden_size": H, "vocab_size": V, "draft_vocab_size": Vd,
                               "intermediate_size": F, "rope_theta": ..., "train_steps": S, ...}
    eagle_head.safetensors    fc.weight [H, 2H], fc.bias [H], norm1.weight, qkv.weight [3H, H],
                              o.weight [H, H], norm2.weight, gate_up.weight [2F, H], down.weight [H, F],
                              draft_vocab [Vd] (int64 token ids)
Weights are stored as float16 and loaded as float32.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from speccomp.drafters.hydra import MAX_SIBLINGS, HydraHeads, _input_embedding, save_draft_heads
from speccomp.drafters.medusa import (CONFIG, HeadsError, _lm_head_weight, check_dimensions, config_int, identity_in,
                                      made_for, on_model_device, read_head_files)

WEIGHTS = "eagle_head.safetensors"


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE: x [..., n, A, D] at positions [..., n]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)  # [D/2]
    ang = positions.to(torch.float32)[..., None] * inv  # [..., n, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[..., None, :]  # [..., n, 1, D]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[..., None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class EagleHead(nn.Module):
    """The draft layer. `entries(f, tokens, positions)` -> (u, q, k, v); `finish(u, attn)` -> o; `logits(o)`."""

    kind = "eagle"
    num_layers = 1
    train_steps: int | None = None  # draft depths it was trained for (unrolled steps); dynamic trees go no deeper

    def __init__(self, hidden: int, vocab: int, num_heads: int, intermediate: int, lm_head: torch.Tensor,
                 embed: torch.Tensor, draft_vocab: torch.Tensor, rope_theta: float = 10000.0):
        super().__init__()
        if num_heads < 1 or hidden % num_heads or (hidden // num_heads) % 2:
            raise HeadsError(f"the hidden size {hidden} must split into num_heads={num_heads} attention heads of an even "
                             f"size (RoPE rotates pairs of dimensions)")
        self.hidden, self.vocab, self.num_heads, self.intermediate = hidden, vocab, num_heads, intermediate
        self.head_dim, self.rope_theta = hidden // num_heads, float(rope_theta)
        self.fc = nn.Linear(2 * hidden, hidden)
        self.norm1 = RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = RMSNorm(hidden)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        for lin in (self.qkv, self.gate_up):
            nn.init.normal_(lin.weight, std=0.02)
        with torch.no_grad():  # start as the identity on the feature: o_p = f_p (the blocks' outputs begin at zero)
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden] = torch.eye(hidden)
            for zero in (self.fc.bias, self.o.weight, self.down.weight):
                zero.zero_()
        self.embed = embed.float()  # [V, H] frozen, not saved (a float32 model's own tensor; a copy for others)
        self.set_draft_vocab(lm_head, draft_vocab)

    # the same contract as HydraHeads: the frozen LM head restricted to the draft vocabulary (draft_lm [Vd, H]), in
    # float32 whatever the model's dtype, as EAGLE's cache (speccomp/drafters/eagle_cache.py) and its states are held
    set_draft_vocab = HydraHeads.set_draft_vocab

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        """Scores [..., Vd] over the draft vocabulary (index i is token draft_vocab[i])."""
        return o @ self.draft_lm.t()

    def entries(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """Layer inputs of entries (feature f_p, next token x_{p+1}) at `positions`: feats [..., n, H], tokens and
        positions [..., n] -> u [..., n, H] (the residual stream) and q, k, v [..., n, A, D] (RoPE applied)."""
        u = self.fc(torch.cat([feats, self.embed[tokens]], -1))
        q, k, v = self.qkv(self.norm1(u)).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(-3)
        return u, _rotate(q, positions, self.rope_theta), _rotate(k, positions, self.rope_theta), v

    def finish(self, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream u [..., n, H] + attention output attn [..., n, A, D] -> the predicted next feature."""
        x = u + self.o(attn.flatten(-2))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)

    def unrolled(self, feats: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training view, `steps` chained drafts from every anchor at once. feats [B, T, H] (f_0..f_{T-1}), tokens
        [B, T] (x_0..x_{T-1}), valid [B, T] (False on padding). Returns o^s [B, T, H] for s = 1..steps, where o^s at
        anchor p predicts f_{p+s} after reading the true entries <= p and its own s - 1 earlier guesses, with the
        true tokens x_{p+2}..x_{p+s} as the path (rows whose p + s is out of range are garbage; mask them)."""
        b, t, _ = feats.shape
        pos = torch.arange(t, device=feats.device).expand(b, t)
        nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1)  # x_{p+1}; the last column is never a valid anchor
        u, q, k1, v1 = self.entries(feats, nxt, pos)
        scale = 1.0 / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=feats.device).tril() & valid[:, None, None, :]  # [B, 1, T, T]
        keys, values = [], []  # the anchor's own earlier steps (s >= 2): one key per anchor each
        outs = []
        for s in range(1, steps + 1):
            if s > 1:  # entry (o^{s-1}_p, x_{p+s}) at position p + s - 1
                tok = torch.cat([tokens[:, s:], tokens[:, -1:].expand(b, s)], 1)  # x_{p+s}, clamped at the end
                u, q, k, v = self.entries(outs[-1], tok, pos + s - 1)
                keys.append(k)
                values.append(v)
            qh = q.transpose(1, 2)  # [B, A, T, D]
            scores = (qh @ k1.transpose(1, 2).transpose(-1, -2)) * scale  # [B, A, T, T] over the true entries
            scores = scores.masked_fill(~causal, float("-inf"))
            diag = [((q * kk).sum(-1) * scale).transpose(1, 2)[..., None] for kk in keys]  # [B, A, T, 1] each
            p = torch.cat([scores, *diag], -1).softmax(-1)
            attn = p[..., :t] @ v1.transpose(1, 2)  # [B, A, T, D]
            for j, vv in enumerate(values):
                attn = attn + p[..., t + j : t + j + 1] * vv.transpose(1, 2)
            outs.append(self.finish(u, attn.transpose(1, 2)))
        return outs


class EagleStep(nn.Module):
    """One run of the EAGLE layer over its own cache, the graph EAGLE drafts with on every backend and in engines
    (eagle.onnx); the cache is explicit, in and out, as the target graph's is:

        feats [q, H], tokens [q], positions [q]        q entries (feature f_p, next token x_{p+1}) at positions p
        past_k, past_v [A, P, D]                       the cache entries these entries may read
        mask [q, P + q] (bool)                         which of those (then of the q new ones) each entry reads
     -> out [q, H]                                     each entry's predicted next feature
        new_k, new_v [A, q, D]                         the entries' keys and values, for the caller to store
        top_logp, top_ids [q, top]                     the `top` best next tokens per entry, best first
                                                       (top = min(MAX_SIBLINGS, draft vocabulary), as Hydra's)

    The draft-vocabulary projection is a plain linear, packed for oneDNN by the eager lowering like the target's."""

    def __init__(self, head: EagleHead):
        super().__init__()
        self.head = head
        self.register_buffer("draft_lm", head.draft_lm.detach(), persistent=False)
        self.register_buffer("vocab", head.draft_vocab, persistent=False)
        self.top = min(MAX_SIBLINGS, len(head.draft_vocab))

    def forward(self, feats, tokens, positions, past_k, past_v, mask):
        u, q, k, v = self.head.entries(feats, tokens, positions)  # q, k, v: [q, A, D]
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], torch.cat([past_k, k], 1)[None],
                                              torch.cat([past_v, v], 1)[None], attn_mask=mask)  # [1, A, q, D]
        out = self.head.finish(u, attn[0].transpose(0, 1))
        logp, idx = F.linear(out, self.draft_lm).log_softmax(-1).topk(self.top, dim=-1)
        return out, k, v, logp, self.vocab[idx]

    def graph_spec(self):
        from torch.export import Dim

        from speccomp.backends.drafter_graph import DrafterGraphSpec
        from speccomp.engine.runtime import EAGLE_INPUTS, EAGLE_OUTPUTS

        h, a, d = self.head.hidden, self.head.num_heads, self.head.head_dim
        q, past = Dim("q", min=1, max=4096), Dim("past", min=0)
        on = {"device": self.head.embed.device}  # the step is captured where it runs
        example = (torch.zeros(3, h, **on), torch.zeros(3, dtype=torch.long, **on), torch.arange(5, 8, **on),
                   torch.zeros(a, 5, d, **on), torch.zeros(a, 5, d, **on), torch.ones(3, 8, dtype=torch.bool, **on))
        dynamic = ({0: q}, {0: q}, {0: q}, {1: past}, {1: past}, {0: q, 1: Dim.AUTO})
        return DrafterGraphSpec("eagle", EAGLE_INPUTS, EAGLE_OUTPUTS, example, dynamic)


def new_eagle(model, draft_vocab, num_heads: int | None = None, intermediate: int | None = None,
              rope_theta: float | None = None) -> EagleHead:
    """A fresh head for `model`: attention heads / MLP width / RoPE base from its config when it has one."""
    lm = _lm_head_weight(model)
    vocab, hidden = lm.shape
    cfg = getattr(model, "config", None)
    if num_heads is None:
        num_heads = getattr(cfg, "num_attention_heads", None) or max(1, hidden // 64)
        if hidden % num_heads or (hidden // num_heads) % 2:
            num_heads = 1
    if intermediate is None:
        intermediate = getattr(cfg, "intermediate_size", None) or 4 * hidden
    if rope_theta is None:
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope_theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or getattr(cfg, "rope_theta", None) or 10000.0
    head = EagleHead(hidden, vocab, int(num_heads), int(intermediate), lm, _input_embedding(model), draft_vocab, rope_theta)
    return made_for(on_model_device(head, lm, torch.float32), model)


_PARAMS = ("fc.weight", "fc.bias", "norm1.weight", "qkv.weight", "o.weight", "norm2.weight", "gate_up.weight", "down.weight")


def save_eagle(head: EagleHead, directory, *, base_model: str = "") -> Path:
    state = head.state_dict()
    steps = {"train_steps": head.train_steps} if head.train_steps else {}
    return save_draft_heads(head, directory, WEIGHTS, {name: state[name] for name in _PARAMS}, base_model,
                            head_type="eagle", eagle_num_heads=head.num_heads, eagle_num_layers=1,
                            intermediate_size=head.intermediate, rope_theta=head.rope_theta, **steps)


def load_eagle(directory, model) -> EagleHead:
    """A head from a directory written by `save_eagle`, checked against `model`."""
    directory = Path(directory)
    lm = _lm_head_weight(model)
    vocab, hidden = lm.shape

    def layout(config, header):
        check_dimensions(config, directory, "eagle", hidden, vocab)
        f, h = config_int(config, "intermediate_size", directory / CONFIG), hidden
        shapes = ((h, 2 * h), (h,), (h,), (3 * h, h), (h, h), (h,), (2 * f, h), (h, f))  # in _PARAMS order
        return {"draft_vocab": (config.get("draft_vocab_size"),), **dict(zip(_PARAMS, shapes))}

    config, tensors = read_head_files(directory, "eagle", WEIGHTS, layout, model)
    num_heads = config_int(config, "eagle_num_heads", directory / CONFIG)
    theta = config.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise HeadsError(f"{directory / CONFIG}: rope_theta must be a positive number, got {theta!r}")
    head = EagleHead(hidden, vocab, num_heads, config["intermediate_size"], lm, _input_embedding(model),
                     tensors["draft_vocab"], float(theta))
    head.load_state_dict({n: tensors[n].float() for n in _PARAMS})
    head.train_steps = config_int(config, "train_steps", directory / CONFIG) if config.get("train_steps") else None
    head.trained_for = identity_in(config)  # saved back as it came
    return on_model_device(head, lm, torch.float32).eval()
