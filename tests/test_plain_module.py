"""Plain nn.Module causal LMs (input_ids -> logits, no cache): captured by graph rewriting.

Two small models defined here, in the styles people write by hand:
  NanoGPT   learned absolute position embeddings, MHA through F.scaled_dot_product_attention(is_causal=True)
  GptFast   Llama-style: RMSNorm, rotary angles from torch.arange(seq), GQA with repeat_interleave
`speccomp.compile` must decode exactly what naive greedy decoding (re-running the module on the
whole sequence every step) decodes; variants cover the other GQA / rotary / mask spellings.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import speccomp
from speccomp.frontend.convention import INPUT_NAMES
from speccomp.frontend import capture
from speccomp.frontend.module import capture_module
from speccomp.frontend.graph import SDPA_OPS, annotate

aten = torch.ops.aten


# --------------------------------------------------------------------------------------
# nanoGPT style
# --------------------------------------------------------------------------------------
@dataclass
class GPTConfig:  # a plain dataclass `config`, not a Hugging Face one
    vocab_size: int = 101
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.n_head, self.n_embd = c.n_head, c.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GPTBlock(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c.n_embd), CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, c: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd),
            wpe=nn.Embedding(c.block_size, c.n_embd),
            h=nn.ModuleList([GPTBlock(c) for _ in range(c.n_layer)]),
            ln_f=nn.LayerNorm(c.n_embd),
        ))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of {t} > block size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x)), None  # (logits, loss)


# --------------------------------------------------------------------------------------
# gpt-fast / Llama style
# --------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def apply_rotary(x, cos, sin):  # x [B, T, H, D]; cos, sin [T, D/2]; interleaved pairs as in gpt-fast
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(3)


class Attention(nn.Module):
    gqa = "repeat_interleave"  # variants: "enable_gqa", "expand" (HF repeat_kv), "meta" (Meta-Llama repeat_kv)
    mask = "is_causal"  # variants: "tril" (a bool causal mask built in the graph), "meta" (Meta Llama's float one),
    # "window" (of `window` tokens)
    window = 12

    def __init__(self, dim: int, n_head: int, n_kv: int):
        super().__init__()
        self.n_head, self.n_kv, self.hd = n_head, n_kv, dim // n_head
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_kv) * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split([self.n_head * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], -1)
        q = apply_rotary(q.view(B, T, self.n_head, self.hd), cos, sin)
        k = apply_rotary(k.view(B, T, self.n_kv, self.hd), cos, sin)
        v = v.view(B, T, self.n_kv, self.hd)
        rep, kwargs = self.n_head // self.n_kv, {"is_causal": True}
        if self.gqa == "meta":  # repeat heads in [B, T, H, D] layout, before the transpose
            k, v = (t[:, :, :, None].expand(B, T, self.n_kv, rep, self.hd).reshape(B, T, self.n_head, self.hd)
                    for t in (k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.gqa == "repeat_interleave":
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        elif self.gqa == "expand":
            k, v = (t[:, :, None].expand(B, self.n_kv, rep, T, self.hd).reshape(B, self.n_head, T, self.hd)
                    for t in (k, v))
        elif self.gqa == "enable_gqa":
            kwargs["enable_gqa"] = True
        if self.mask == "tril":
            kwargs = {**kwargs, "is_causal": False, "attn_mask": torch.ones(T, T, dtype=torch.bool, device=x.device).tril()}
        elif self.mask == "meta":  # Meta Llama's additive mask, cast like the hidden states (read their dtype alone)
            mask = torch.full((T, T), float("-inf"), device=x.device).triu(1).type_as(x)
            kwargs = {**kwargs, "is_causal": False, "attn_mask": mask}
        elif self.mask == "window":  # a sliding window: the causal mask up to `window` tokens, not after
            ones = torch.ones(T, T, dtype=torch.bool, device=x.device)
            kwargs = {**kwargs, "is_causal": False, "attn_mask": ones.tril() & ones.triu(1 - self.window)}
        y = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, -1))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, n_kv: int):
        super().__init__()
        self.attention = Attention(dim, n_head, n_kv)
        self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class GptFast(nn.Module):
    rope = "arange"  # variant: "table" (cos/sin precomputed for max_seq_len and sliced [:T])

    def __init__(self, vocab: int = 97, dim: int = 32, n_layer: int = 3, n_head: int = 4, n_kv: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([TransformerBlock(dim, n_head, n_kv) for _ in range(n_layer)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        hd = dim // n_head
        self.register_buffer("inv_freq", 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd), persistent=False)
        angles = torch.outer(torch.arange(128).float(), self.inv_freq)
        self.register_buffer("cos_table", angles.cos(), persistent=False)
        self.register_buffer("sin_table", angles.sin(), persistent=False)

    def forward(self, idx):
        T = idx.shape[1]
        if self.rope == "table":
            cos, sin = self.cos_table[:T], self.sin_table[:T]
        elif self.rope == "moved_table":  # Meta Llama's self.freqs_cis.to(h.device)[:seqlen]
            cos, sin = self.cos_table.to(idx.device)[:T], self.sin_table.to(idx.device)[:T]
        else:
            angles = torch.outer(torch.arange(T, device=idx.device).float(), self.inv_freq)
            cos, sin = angles.cos(), angles.sin()
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def _init(model: nn.Module, seed: int) -> nn.Module:
    """Seeded weights with a wide spread, so greedy argmaxes have clear margins."""
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.3)
    return model.eval()


MODELS = {
    "nanogpt": lambda: _init(NanoGPT(), 0),
    "gptfast": lambda: _init(GptFast(), 1),
}
LAYER_PATHS = {"nanogpt": "transformer.h.{}", "gptfast": "layers.{}"}


def naive_greedy(model: nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Re-run the plain module on the whole sequence for every new token."""
    with torch.no_grad():
        for _ in range(n):
            out = model(ids)
            logits = out[0] if isinstance(out, tuple) else out
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(name):
        if name not in cache:
            model = MODELS[name]()
            cache[name] = (model, speccomp.compile(model))
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_matches_naive_greedy(compiled, name):
    model, fast = compiled(name)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(3))
    got = fast.generate(ids, max_new_tokens=30)
    want = naive_greedy(model, ids, 30)
    assert torch.equal(got, want), f"{name}: compiled {got[0, 7:].tolist()} != naive {want[0, 7:].tolist()}"
    assert fast.last_stats["new_tokens"] == 30


@pytest.mark.parametrize("name", sorted(MODELS))
def test_structure(compiled, name):
    model, fast = compiled(name)
    captured = speccomp.capture(model)  # the capture's graph (compile adds the tree mask on top)
    gm = captured.graph_module
    n_layers = len(model.transformer.h) if name == "nanogpt" else len(model.layers)
    structure = annotate(captured)
    assert [layer.module for layer in structure.layers] == [LAYER_PATHS[name].format(i) for i in range(n_layers)]
    assert [site.layer for site in structure.attention] == list(range(n_layers))
    assert all(site.kind == "sdpa" and site.mask is not None for site in structure.attention)
    assert structure.final_norm == ("transformer.ln_f" if name == "nanogpt" else "norm")
    assert structure.lm_head_module == ("lm_head" if name == "nanogpt" else "output")

    # golden counts: the 4 convention inputs, one cat per cached K and V, no causal SDPA left
    nodes = list(gm.graph.nodes)
    assert [n.name for n in nodes if n.op == "placeholder"] == list(INPUT_NAMES)
    assert sum(n.target is aten.cat.default for n in nodes) == 2 * n_layers
    sdpa = [n for n in nodes if n.target in SDPA_OPS]
    assert len(sdpa) == n_layers and not any(n.kwargs.get("is_causal") for n in sdpa)
    assert all("val" in n.meta for n in nodes if n.op in ("placeholder", "call_function"))
    kv = fast.graph.captured.kv
    assert (kv.num_layers, kv.num_kv_heads, kv.head_dim) == ((2, 4, 8) if name == "nanogpt" else (3, 2, 8))
    assert fast.max_positions == (64 if name == "nanogpt" else None)

    # hidden is the final norm's output; positions come from position_ids
    norm = model.transformer.ln_f if name == "nanogpt" else model.norm
    seen = []
    handle = norm.register_forward_hook(lambda mod, args, out: seen.append(out))
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    past = torch.zeros(kv.shape(0))
    with torch.no_grad():
        model(ids)
        handle.remove()
        logits, new_kv, hidden = gm(ids, torch.arange(6)[None], torch.ones(1, 6, dtype=torch.long), past)
        shifted, _, _ = gm(ids, torch.arange(6)[None] + 5, torch.ones(1, 6, dtype=torch.long), past)
    torch.testing.assert_close(hidden, seen[0])
    assert tuple(new_kv.shape) == kv.shape(6)  # [L, 2, 1, Hkv, q, D]
    assert not torch.allclose(logits, shifted), "position_ids do not reach the positional encoding"


VARIANTS = {  # (GQA spelling, rotary source, causal mask): each spelling appears at least once
    "enable_gqa+rope_table": ("enable_gqa", "table", "is_causal"),
    "hf_repeat_kv+tril_mask": ("expand", "arange", "tril"),
    "meta_repeat_kv+rope_table+tril_mask": ("meta", "table", "tril"),
    "moved_rope_table": ("repeat_interleave", "moved_table", "is_causal"),  # was "no positions found"
    "meta_type_as_mask": ("repeat_interleave", "arange", "meta"),  # was "not the plain causal mask"
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_capture(variant, monkeypatch):
    """Other spellings of GQA, rotary and the causal mask; capture checks the graph against the module."""
    gqa, rope, mask = VARIANTS[variant]
    monkeypatch.setattr(Attention, "gqa", gqa)
    monkeypatch.setattr(Attention, "mask", mask)
    monkeypatch.setattr(GptFast, "rope", rope)
    model = _init(GptFast(n_layer=2), 2)
    captured = capture(model)  # dispatches to capture_module (no Hugging Face config) and checks against the module
    structure = annotate(captured)
    assert len(structure.layers) == len(structure.attention) == 2
    assert captured.kv.num_kv_heads == 2  # the cache holds the un-repeated K/V heads
    assert sum(n.target is aten.cat.default for n in captured.graph_module.graph.nodes) == 4
    assert captured.max_positions == (128 if "table" in rope else None)


class RepeatBeforeRotaryAttention(Attention):
    """K/V heads repeated to the query heads first, the rotary embedding applied to the repeated K after."""

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split([self.n_head * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], -1)
        k, v = (t.view(B, T, self.n_kv, self.hd).repeat_interleave(self.n_head // self.n_kv, dim=2) for t in (k, v))
        q, k = apply_rotary(q.view(B, T, self.n_head, self.hd), cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, -1))


def test_heads_repeated_before_the_rotary_are_cached_as_attention_reads_them(monkeypatch):
    """Only the repeated K passes through the rotary, so K's un-repeated form is not in the graph: K and V are both
    cached with the query's heads (refused before: "keys [*, 4, *, 8] and values [*, 2, *, 8] differ in shape")."""
    monkeypatch.setattr(Attention, "forward", RepeatBeforeRotaryAttention.forward)
    model = _init(GptFast(n_layer=2), 2)
    fast = speccomp.compile(model, drafter="ngram")
    assert fast.kv.num_kv_heads == 4
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(1)).repeat(1, 3)
    assert torch.equal(fast.generate(ids, max_new_tokens=30), naive_greedy(model, ids, 30))
    assert fast.last_stats["tau"] > 1, fast.last_stats


# --------------------------------------------------------------------------------------
# What cannot be captured
# --------------------------------------------------------------------------------------
class SoftmaxAttention(CausalSelfAttention):
    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (k.size(-1) ** -0.5)
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class SoftmaxGPT(NanoGPT):
    def __init__(self):
        super().__init__(GPTConfig(n_layer=1))
        for block in self.transformer.h:
            block.attn = SoftmaxAttention(self.config)


class NoPositionsGPT(NanoGPT):
    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class LastTokenGPT(NanoGPT):
    def forward(self, idx, targets=None):
        logits, _ = super().forward(idx)
        return logits[:, [-1], :]  # nanoGPT's inference shortcut


class ScoresDictGPT(NanoGPT):
    def forward(self, idx, targets=None):
        return {"scores": super().forward(idx)[0]}  # no "logits" key (was a TypeError: unhashable type 'slice')


class LossFirstGPT(NanoGPT):
    def forward(self, idx, targets=None):
        return None, super().forward(idx)[0]  # (loss, logits) (was "no attention found ... not a transformer")


class LengthScaledGPT(NanoGPT):
    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) * torch.log(torch.tensor(float(idx.shape[1]) + 1.0))  # fixes the length
        x = x + self.transformer.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class CountingGPT(NanoGPT):
    def __init__(self, config=GPTConfig(n_layer=1)):
        super().__init__(config)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, idx, targets=None):
        self.calls += 1  # state in a buffer: the graph wrote into the user's module at every step
        return super().forward(idx)


class BranchingGPT(NanoGPT):
    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        if idx.shape[1] > 3:  # exported at 5 tokens: the graph always took this side; short prompts decoded wrongly
            x = x.flip(-1)
        return self.lm_head(self.transformer.ln_f(x))


@pytest.mark.parametrize(
    "build, message",
    [
        (SoftmaxGPT, "softmax"),
        (lambda: _init(BranchingGPT(GPTConfig(n_layer=1)), 0), r"logits. for tokens \[0, 1\).*branches on it"),
        (lambda: NoPositionsGPT(GPTConfig(n_layer=1)), "no positions"),
        (lambda: LastTokenGPT(GPTConfig(n_layer=1)), "every position"),
        (lambda: ScoresDictGPT(GPTConfig(n_layer=1)), r"returned a mapping with keys \['scores'\].*'logits'"),
        (lambda: LossFirstGPT(GPTConfig(n_layer=1)), "first item is NoneType.*put the logits first"),
        (CountingGPT, r"writes its buffers \['calls'\]"),
        (lambda: LengthScaledGPT(GPTConfig(n_layer=1)), r"not the fixed \d+: .*float\(x.shape\[1\]\)"),
    ],
    ids=["softmax_attention", "branch_on_length", "no_positions", "last_token_logits", "dict_without_logits", "loss_first",
         "buffer_state", "length_as_a_number"],
)
def test_unsupported_plain_modules(build, message):
    model = build().eval()
    with pytest.raises(speccomp.UnsupportedModelError, match=message):
        speccomp.compile(model)
    if isinstance(model, CountingGPT):
        assert int(model.calls) == 0  # refused before the module ever ran


class BufferMaskAttention(CausalSelfAttention):
    """nanoGPT's non-flash path: a mask buffer of block_size cut to [:T, :T]; `window`: a sliding window in it."""

    def __init__(self, c: GPTConfig, window: int | None = None):
        super().__init__(c)
        mask = torch.ones(c.block_size, c.block_size, dtype=torch.bool).tril()
        self.register_buffer("bias", mask if window is None else mask & mask.triu(1 - window), persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:T, :T])
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def test_a_mask_buffer_is_causal_up_to_the_block_and_a_window_in_one_is_refused():
    """The mask check evaluated lengths 1, 2, 5, 64, ...: a buffer of 48 failed at 64 and the check ended there, so
    a 12-token window stored in the buffer passed as causal and decoded other tokens past 12. The buffer's longest
    mask is checked now."""
    c = GPTConfig(block_size=48, n_layer=1)
    for window in (None, 12):
        model = NanoGPT(c)
        model.transformer.h[0].attn = BufferMaskAttention(c, window)
        model = _init(model, 3)
        if window is not None:
            with pytest.raises(speccomp.UnsupportedModelError, match="not the plain causal mask"):
                speccomp.compile(model)
            continue
        ids = torch.randint(0, 101, (1, 10), generator=torch.Generator().manual_seed(3))
        assert torch.equal(speccomp.compile(model, drafter="ngram").generate(ids, max_new_tokens=38),
                           naive_greedy(model, ids, 38))  # up to the whole block


class PerHeadAttention(nn.Module):
    """"Let's build GPT"'s layout: one module per head, each its own attention call."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(c.n_embd, 3 * c.n_embd // c.n_head) for _ in range(c.n_head)])
        self.proj = nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x):
        heads = [h(x)[:, None].chunk(3, dim=-1) for h in self.heads]  # q, k, v [B, 1, T, hd] each
        return self.proj(torch.cat([F.scaled_dot_product_attention(*qkv, is_causal=True)[:, 0] for qkv in heads], -1))


def test_one_attention_module_per_head_decodes_and_layer_skipping_is_refused():
    """Several attention sites in one block: plain and ngram decoding are exact; early_exit / layer_skip never
    returned (a layer whose entry was its exit made the bypass loop forever). Refused now, naming the block."""
    model = NanoGPT(GPTConfig(n_layer=2))
    for block in model.transformer.h:
        block.attn = PerHeadAttention(model.config)
    model = _init(model, 4)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9]])
    assert torch.equal(speccomp.compile(model, drafter="ngram").generate(ids, max_new_tokens=12),
                       naive_greedy(model, ids, 12))
    for drafter, options in (("early_exit", None), ("layer_skip", {"skip": [1]})):
        with pytest.raises(speccomp.GraphStructureError, match=r"decoder block transformer.h.0 holds 4 attention sites"):
            speccomp.compile(model, drafter=drafter, drafter_options=options)


class FixedDropoutAttention(CausalSelfAttention):
    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)  # in eval mode too
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def test_a_fixed_dropout_is_refused_with_a_fix_that_works():
    """The advice was "call model.eval() first", which changes nothing for a hard-coded dropout_p."""
    model = NanoGPT(GPTConfig(n_layer=1))
    model.transformer.h[0].attn = FixedDropoutAttention(model.config)
    with pytest.raises(speccomp.UnsupportedModelError, match=r"dropout_p=0.1 in eval mode .*pass dropout_p=0 outside "
                                                             r"training"):
        speccomp.compile(_init(model, 5))


class PostLNEncoderLM(nn.Module):
    """A post-LN LM on PyTorch's own nn.TransformerEncoderLayer (norm_first=False): no norm after the last block."""

    def __init__(self, vocab: int = 96, dim: int = 32, n_layer: int = 3, block_size: int = 48):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        T = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=x.device)
        return self.head(self.enc(self.emb(x) + self.pos(torch.arange(T, device=x.device)), mask=mask,
                                  is_causal=self.is_causal))

    is_causal = True


class PositionParameterGPT(NanoGPT):
    """minGPT's learned positions: a [1, block, C] parameter sliced on its second dim (was "no positions found")."""

    def __init__(self, c: GPTConfig = GPTConfig(n_layer=2)):
        super().__init__(c)
        del self.transformer["wpe"]
        self.pos_emb = nn.Parameter(torch.zeros(1, c.block_size, c.n_embd))

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.pos_emb[:, :idx.shape[1], :]
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def test_a_position_parameter_sliced_on_its_second_dim_decodes():
    model = _init(PositionParameterGPT(), 5)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    for drafter in (None, "token_recycling"):
        fast = speccomp.compile(model, drafter=drafter)
        assert torch.equal(fast.generate(ids, max_new_tokens=20), naive_greedy(model, ids, 20))
    assert fast.max_positions == model.config.block_size


def test_a_post_ln_model_without_a_final_norm_decodes():
    """Refused before ("no final norm module found"), though nothing needs one: its blocks end normalised."""
    model = _init(PostLNEncoderLM(), 3)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9]])
    for drafter, options in ((None, None), ("ngram", None), ("early_exit", {"exit_layer": 1})):
        fast = speccomp.compile(model, drafter=drafter, drafter_options=options)
        assert torch.equal(fast.generate(ids, max_new_tokens=20), naive_greedy(model, ids, 20))
    assert fast.graph.structure.final_norm is None
    model.is_causal = None  # pytorch/examples' spelling: the encoder reads the mask's values to see it is causal
    with pytest.raises(speccomp.UnsupportedModelError, match=r"branches on a tensor's values \(File .*line \d+, in "
                                                             r"forward\).*pass is_causal=True with the causal mask"):
        speccomp.compile(model)


@pytest.mark.parametrize("window", [12, 4096])
def test_a_sliding_window_mask_is_refused(monkeypatch, window):
    """A mask computed from the length, (i >= j) & (i - j < W), equals the causal mask for up to W tokens: checked
    at short lengths only, it was taken for causal and decoded other tokens once past the window."""
    monkeypatch.setattr(Attention, "mask", "window")
    monkeypatch.setattr(Attention, "window", window)
    with pytest.raises(speccomp.UnsupportedModelError, match="not the plain causal mask"):
        capture(_init(GptFast(n_layer=1), 2))


class ScaledBufferGPT(NanoGPT):
    """In-place ops on copies of buffers: `.float()` and `reshape` of a non-contiguous view copy (export annotates
    both as possibly aliasing), so the buffer is not written."""

    def __init__(self, config=GPTConfig(n_layer=1)):
        super().__init__(config)
        self.register_buffer("scale", torch.full((config.n_embd,), 1.5, dtype=torch.float16))
        self.register_buffer("shift", torch.zeros(2, config.n_embd // 2))

    def forward(self, idx, targets=None):
        scale = self.scale.float().mul_(1.0)  # a copy (float16 -> float32), then in place on it
        shift = self.shift.t().reshape(-1).add_(0.0)  # reshape of a transposed view copies
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) * scale + shift + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def test_in_place_ops_on_copies_of_buffers_are_not_state():
    """The buffer-state refusal must not catch these (a first version walked through `to` and `reshape` as views)."""
    model = _init(ScaledBufferGPT(), 2)
    before = (model.scale.clone(), model.shift.clone())
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    assert torch.equal(speccomp.compile(model).generate(ids, max_new_tokens=8), naive_greedy(model, ids, 8))
    assert torch.equal(model.scale, before[0]) and torch.equal(model.shift, before[1])


@pytest.mark.parametrize("drafter", ["medusa", "hydra", "eagle"])
def test_heads_drafters_say_what_a_plain_module_needs(drafter):
    """A plain module has no get_output_embeddings(): the error named "Medusa heads" for every kind and no fix."""
    from speccomp.drafters.medusa import HeadsError

    from pathlib import Path

    heads = Path(speccomp.__file__).parent / "data" / {"medusa": "heads"}.get(drafter, drafter) / "661bbf7e835ec6bf"
    with pytest.raises(HeadsError, match=r"GptFast has no output embedding .*\(medusa, hydra, eagle\).*"
                                         r"get_output_embeddings\(\)` that returns its nn.Linear"):
        speccomp.compile(_init(GptFast(), 1), drafter=drafter, drafter_options={"heads": str(heads)})


def test_capture_module_rejects_non_modules():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        capture_module(lambda ids: ids)


@pytest.mark.parametrize("tree", [3, "dynamic:6:2"])
@pytest.mark.parametrize("draft", ["gptfast, first layer", "nanogpt"])
def test_a_plain_module_drafts_for_a_plain_module(tree, draft):
    """A separate draft LM that is a plain nn.Module too (issue 23: "any HF causal LM or plain module that capture
    accepts"): a 1-layer GptFast with the target's first layer, embedding and head (it agrees often), or a NanoGPT of
    the same vocabulary (another architecture, learned positions). Chains and dynamic trees: naive greedy's output."""
    target = _init(GptFast(vocab=101), 1)
    if draft == "nanogpt":
        drafter = _init(NanoGPT(), 4)
    else:
        drafter = GptFast(vocab=101, n_layer=1).eval()
        drafter.load_state_dict(target.state_dict(), strict=False)  # the target's layer 0, embedding, norm, head
    fast = speccomp.compile(target, drafter=drafter, tree=tree)
    ids = torch.randint(0, 101, (1, 7), generator=torch.Generator().manual_seed(5))
    assert torch.equal(fast.generate(ids, max_new_tokens=30), naive_greedy(target, ids, 30))
    if draft != "nanogpt":
        assert fast.last_stats["acceptance_by_depth"][0] > 0, fast.last_stats  # drafts really verified and taken
