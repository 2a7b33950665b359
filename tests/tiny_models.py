"""Tiny random-init causal LMs for fast breadth tests (no weights downloaded).

`tiny_llama` is the default tiny model other tests use. `ARCHITECTURES` is a registry of one tiny,
seeded config per supported `*ForCausalLM` family (hidden 32, 2-3 layers, vocab 96-128,
>= 256 positions), and `captured(name)` exports one of them once per test session; `UNSUPPORTED` holds
models speccomp must refuse with a clear error.

Weights are initialised with a larger `initializer_range` than HF's default 0.02 so the
logits of a random model have clear argmax margins (greedy outputs are then stable
under the tiny float differences between HF's cache path and speccomp's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

WINDOW = 8  # sliding window of the sliding-window tiny models but gemma2_w16's 16 (prompt + new tokens go well past it)


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


@dataclass(frozen=True)
class Arch:
    """One tiny architecture and what speccomp should find in its graph."""

    name: str
    builder: Callable[..., torch.nn.Module]  # builder(seed, **config_overrides)
    seed: int  # chosen so greedy decoding of the test prompt has clear argmax margins
    attention: str  # "sdpa" | "eager": the attention kind annotate must report
    sliding_window: int | None  # window of the sliding layers (None: all layers global)
    sliding_layers: tuple[int, ...]  # indices of the layers that use the window
    tied: bool  # LM head shares the token embedding matrix

    def build(self, **overrides) -> torch.nn.Module:
        return self.builder(self.seed, **overrides)


def _build(config_cls, model_cls, seed: int, overrides: dict, attn: str | None = None, **cfg):
    cfg = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **cfg, **overrides}
    torch.manual_seed(seed)
    config = config_cls(**cfg)
    if attn is not None:
        config._attn_implementation = attn
    model = model_cls(config)
    if attn is not None:
        model.set_attn_implementation(attn)
    return model.eval()


_COMMON = dict(vocab_size=128, hidden_size=32, max_position_embeddings=256, initializer_range=0.5)
# Gemma2/3 scale embeddings by sqrt(hidden) and stack extra norms: a large init saturates them into one token
_GEMMA2_COMMON = {**_COMMON, "initializer_range": 0.05}
_GEMMA3_COMMON = {**_COMMON, "initializer_range": 0.1}
_GQA = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)


def _llama(seed, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build(LlamaConfig, LlamaForCausalLM, seed, kw, num_hidden_layers=3, **_COMMON, **_GQA)


def _mistral(seed, **kw):
    from transformers import MistralConfig, MistralForCausalLM

    return _build(MistralConfig, MistralForCausalLM, seed, kw, num_hidden_layers=2, sliding_window=WINDOW, **_COMMON, **_GQA)


def _qwen2(seed, **kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # layers 0-1 slide, layer 2 is global (what Qwen2's max_window_layers split produces)
    return _build(
        Qwen2Config, Qwen2ForCausalLM, seed, kw, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], tie_word_embeddings=True,
        **_COMMON, **_GQA,
    )


def _qwen3(seed, **kw):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _build(Qwen3Config, Qwen3ForCausalLM, seed, kw, num_hidden_layers=2, head_dim=16, **_COMMON, **_GQA)


def _gemma(seed, **kw):
    from transformers import GemmaConfig, GemmaForCausalLM

    return _build(GemmaConfig, GemmaForCausalLM, seed, kw, num_hidden_layers=2, head_dim=8, **_COMMON, **_GQA)


def _gemma2(seed, **kw):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # softcapping is only implemented by HF's eager attention, which Gemma2 uses
    return _build(
        Gemma2Config, Gemma2ForCausalLM, seed, kw, attn="eager", num_hidden_layers=2, head_dim=8, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=8, **_GEMMA2_COMMON, **_GQA,
    )


def _gemma3(seed, **kw):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _build(
        Gemma3TextConfig, Gemma3ForCausalLM, seed, kw, num_hidden_layers=3, head_dim=8, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], query_pre_attn_scalar=8,
        tie_word_embeddings=True, **_GEMMA3_COMMON, **_GQA,
    )


def _phi3(seed, **kw):
    from transformers import Phi3Config, Phi3ForCausalLM

    # Phi3 keeps the window only in its config and slides every layer (like Mistral / Starcoder2)
    return _build(Phi3Config, Phi3ForCausalLM, seed, kw, num_hidden_layers=2, sliding_window=WINDOW, **_COMMON, **_GQA)


def _gpt2(seed, **kw):
    from transformers import GPT2Config, GPT2LMHeadModel

    return _build(
        GPT2Config, GPT2LMHeadModel, seed, kw, vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=256,
        initializer_range=0.5, tie_word_embeddings=True,
    )


def _gpt_neox(seed, **kw):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return _build(
        GPTNeoXConfig, GPTNeoXForCausalLM, seed, kw, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        **_COMMON,
    )


def _opt(seed, **kw):
    from transformers import OPTConfig, OPTForCausalLM

    return _build(
        OPTConfig, OPTForCausalLM, seed, kw, vocab_size=128, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, ffn_dim=64, max_position_embeddings=256, word_embed_proj_dim=32, init_std=0.5,
        tie_word_embeddings=True,
    )


def _falcon(seed, **kw):
    from transformers import FalconConfig, FalconForCausalLM

    # the new decoder architecture: rotary positions, grouped KV heads, parallel attention/MLP
    return _build(
        FalconConfig, FalconForCausalLM, seed, kw, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, alibi=False, parallel_attn=True, bias=False, **_COMMON,
    )


def _stablelm(seed, **kw):
    from transformers import StableLmConfig, StableLmForCausalLM

    return _build(StableLmConfig, StableLmForCausalLM, seed, kw, num_hidden_layers=2, **_COMMON, **_GQA)


def _starcoder2(seed, **kw):
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    return _build(
        Starcoder2Config, Starcoder2ForCausalLM, seed, kw, num_hidden_layers=2, sliding_window=WINDOW,
        **_COMMON, **_GQA,
    )


def _mixtral(seed, **kw):
    from transformers import MixtralConfig, MixtralForCausalLM

    # sparse MoE MLP (4 experts, top-2; HF stores the experts as stacked [E, 2I, H] / [E, H, I] parameters)
    return _build(
        MixtralConfig, MixtralForCausalLM, seed, kw, num_hidden_layers=2, sliding_window=WINDOW, num_local_experts=4,
        num_experts_per_tok=2, **_COMMON, **_GQA,
    )


def _phi(seed, **kw):
    from transformers import PhiConfig, PhiForCausalLM

    # parallel attention/MLP reading one LayerNorm, partial rotary (half of each head), biased LM head
    return _build(
        PhiConfig, PhiForCausalLM, seed, kw, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, **_COMMON,
    )


def _gptj(seed, **kw):
    from transformers import GPTJConfig, GPTJForCausalLM

    # parallel attention/MLP, rotary on the first 4 of 8 head dims (interleaved), biased LM head
    return _build(
        GPTJConfig, GPTJForCausalLM, seed, kw, vocab_size=128, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
        n_inner=64, n_positions=256, initializer_range=0.5,
    )


def _olmo2(seed, **kw):
    from transformers import Olmo2Config, Olmo2ForCausalLM

    # norms after attention and MLP (not before), RMS-normed queries and keys
    return _build(Olmo2Config, Olmo2ForCausalLM, seed, kw, num_hidden_layers=2, **_COMMON, **_GQA)


def _granite(seed, **kw):
    from transformers import GraniteConfig, GraniteForCausalLM

    # the multipliers Granite scales embeddings, residual branches, attention and logits with
    return _build(
        GraniteConfig, GraniteForCausalLM, seed, kw, num_hidden_layers=2, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0, **_COMMON, **_GQA,
    )


def _cohere(seed, **kw):
    from transformers import CohereConfig, CohereForCausalLM

    # parallel attention/MLP, bias-free LayerNorm, logit scale, interleaved rotary, tied embeddings
    return _build(
        CohereConfig, CohereForCausalLM, seed, kw, num_hidden_layers=2, logit_scale=0.5, tie_word_embeddings=True,
        **_COMMON, **_GQA,
    )


def _smollm3(seed, **kw):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    # layer 2 has no rotary positions (NoPE) and, being NoPE with use_sliding_window, slides
    return _build(
        SmolLM3Config, SmolLM3ForCausalLM, seed, kw, num_hidden_layers=3, no_rope_layers=[1, 1, 0],
        use_sliding_window=True, sliding_window=WINDOW, tie_word_embeddings=True, **_COMMON, **_GQA,
    )


def _exaone4(seed, **kw):
    from transformers import Exaone4Config, Exaone4ForCausalLM

    # every layer's module carries sliding_window, global ones too (EXAONE-4.0-32B's layout): layer_types decide
    return _build(
        Exaone4Config, Exaone4ForCausalLM, seed, kw, num_hidden_layers=2, head_dim=8, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], **_COMMON, **_GQA,
    )


def _gemma2_w16(seed, **kw):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # issue 20: 3 layers, window 16, layers 0 and 2 sliding through one shared mask node (a self-drafter that
    # skips one of them must leave the other's mask to the tree pass); init 0.1: at Gemma2's 0.05 three
    # softcapped layers leave near-ties on the greedy path
    return _build(
        Gemma2Config, Gemma2ForCausalLM, seed, kw, attn="eager", num_hidden_layers=3, head_dim=8, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=8, **_GEMMA3_COMMON, **_GQA,
    )


ARCHITECTURES = {
    a.name: a
    for a in [
        Arch("llama", _llama, 11, "sdpa", None, (), False),
        Arch("mistral", _mistral, 3, "sdpa", WINDOW, (0, 1), False),
        Arch("qwen2", _qwen2, 5, "sdpa", WINDOW, (0, 1), True),
        Arch("qwen3", _qwen3, 4, "sdpa", None, (), False),
        Arch("gemma", _gemma, 3, "sdpa", None, (), True),
        Arch("gemma2", _gemma2, 9, "eager", WINDOW, (0,), True),
        Arch("gemma3", _gemma3, 6, "sdpa", WINDOW, (0, 1), True),
        Arch("phi3", _phi3, 2, "sdpa", WINDOW, (0, 1), False),
        Arch("gpt2", _gpt2, 7, "sdpa", None, (), True),
        Arch("gpt_neox", _gpt_neox, 7, "sdpa", None, (), False),
        Arch("opt", _opt, 10, "sdpa", None, (), True),
        Arch("falcon", _falcon, 11, "sdpa", None, (), True),
        Arch("stablelm", _stablelm, 0, "sdpa", None, (), False),
        Arch("starcoder2", _starcoder2, 6, "sdpa", WINDOW, (0, 1), True),
        Arch("mixtral", _mixtral, 0, "sdpa", WINDOW, (0, 1), False),
        Arch("phi", _phi, 9, "sdpa", None, (), False),
        Arch("gptj", _gptj, 9, "eager", None, (), False),
        Arch("olmo2", _olmo2, 10, "sdpa", None, (), False),
        Arch("granite", _granite, 7, "sdpa", None, (), False),
        Arch("cohere", _cohere, 2, "sdpa", None, (), True),
        Arch("smollm3", _smollm3, 5, "sdpa", WINDOW, (2,), True),
        Arch("gemma2_w16", _gemma2_w16, 13, "eager", 16, (0, 2), True),
        Arch("exaone4", _exaone4, 7, "sdpa", WINDOW, (0,), False),
    ]
}


_CAPTURED: dict[str, tuple] = {}


def captured(name: str):
    """(model, speccomp.capture(model)) of ARCHITECTURES[name], built and exported once per test session:
    export is most of the cost of an architecture, and test_architectures.py and test_matrix.py compile
    each one several ways (`speccomp.compile(captured, ...)` rewrites a copy of the graph)."""
    if name not in _CAPTURED:
        import speccomp

        model = ARCHITECTURES[name].build()
        _CAPTURED[name] = (model, speccomp.capture(model))
    return _CAPTURED[name]


def seeded_prompt(length: int = 12, vocab_size: int = 128) -> torch.Tensor:
    """The seeded prompt [1, length] the architecture tests use (ids from 3 up: no pad/bos/eos)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab_size, (1, length), generator=gen)


# --------------------------------------------------------------------------------------
# Models speccomp must refuse: name -> (builder, words the error message must contain)
# --------------------------------------------------------------------------------------
def _bloom():
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4)).eval()


def _falcon_alibi():
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    return FalconForCausalLM(
        FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True)
    ).eval()


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(
        T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    ).eval()


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    return BartForConditionalGeneration(
        BartConfig(
            vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        )
    ).eval()


def _mamba():
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    return MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=32, state_size=4, num_hidden_layers=2)).eval()


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # a linear-attention layer (its own recurrent state) beside a full-attention one: crashed in the KV probe
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0,
        layer_types=["linear_attention", "full_attention"])).eval()


def _minimax():
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    torch.manual_seed(0)
    return MiniMaxForCausalLM(MiniMaxConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, num_local_experts=2,
        num_experts_per_tok=1, layer_types=["linear_attention", "full_attention"])).eval()


def _minicpm3():
    from transformers import AutoConfig, AutoModelForCausalLM

    # multi-head latent attention: its cache holds a compressed latent as keys, the rotary part as values
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "minicpm3", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, max_position_embeddings=256, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0)).eval()


def _gemma3n():
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    # per-layer inputs and AltUp's several residual streams: no decoder block hands one hidden state to the next
    torch.manual_seed(0)
    return Gemma3nForCausalLM(Gemma3nTextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2, num_kv_shared_layers=0,
        activation_sparsity_pattern=[0.0, 0.0], layer_types=["sliding_attention", "full_attention"],
        sliding_window=8)).eval()


def _llama_base():
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)).eval()


UNSUPPORTED = {
    "bloom_alibi": (_bloom, ("alibi",)),
    "falcon_alibi": (_falcon_alibi, ("alibi",)),
    "t5_encoder_decoder": (_t5, ("encoder-decoder",)),
    "bart_encoder_decoder": (_bart, ("encoder-decoder",)),
    "mamba_recurrent": (_mamba, ("recurrent",)),
    "qwen3_next_hybrid": (_qwen3_next, ("hybrid", "['linear_attention']")),
    "minimax_hybrid": (_minimax, ("hybrid", "['linear_attention']")),  # it raised a ValueError of its own
    "llama_base_model_no_head": (_llama_base, ("lm head",)),
    "minicpm3_latent_attention": (_minicpm3, ("minicpm3", "latent")),  # named neither before
    "gemma3n_altup": (_gemma3n, ("gemma3n_text", "residual-stream")),  # did not name the model before
    # dynamic NTK recomputes its frequencies from the sequence length: was refused by a torch.export guard's message
    "llama_dynamic_rope": (lambda: ARCHITECTURES["llama"].build(
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, max_position_embeddings=24),
        ("rope_type='dynamic'",)),
}


def hf_greedy_with_margin(model, prompt: torch.Tensor, max_new_tokens: int):
    """HF greedy generate of exactly max_new_tokens tokens (no EOS stop); returns (sequences, the smallest
    top-1 minus top-2 logit margin along the way: near-ties make a reference fragile)."""
    cfg = model.generation_config
    cfg.do_sample, cfg.eos_token_id, cfg.pad_token_id = False, None, model.config.pad_token_id
    cfg.temperature = cfg.top_p = cfg.top_k = None
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=model.config.pad_token_id, return_dict_in_generate=True, output_scores=True,
        )
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values  # [new, 2]
    return out.sequences, float((top2[:, 0] - top2[:, 1]).min())


def keep_drafting(result):
    """An autotune result, stored, with its tree drafting under tree="auto". On a tiny model timing decides whether
    decoding without drafts beat every tree (`plain`: compile then decodes plainly, tested by
    test_autotune.py::test_tree_auto_compiles_plain_decoding_where_no_tree_paid); tests of the tree's own path store
    the other verdict so that they check it on every run."""
    import dataclasses
    import json
    from pathlib import Path

    if not result.plain:
        return result
    result = dataclasses.replace(result, plain=False)
    Path(result.path).write_text(json.dumps(result.to_dict(), default=float))
    return result
