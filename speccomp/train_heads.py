"""Train Medusa heads on CPU (Medusa-1: frozen backbone) on the model's own outputs.

    heads = speccomp.train_heads(model, prompts=[ids, ...], out="heads/")

1. Self-distillation data: the model's own greedy continuation of each prompt (decoded with
   speccomp, token_recycling, so it is fast and exactly the model's greedy text).
2. Hidden states: one forward of the plain compiled graph over prompt + continuation gives the
   final hidden state h_t of every position (cached in memory; the backbone is frozen).
3. Heads: head k learns to predict token t + k + 2 from h_t (cross-entropy, weight 0.8^k, as
   Medusa), with AdamW; the projection is the frozen LM head, so only K x (H x H + H) weights train.

Resumable: after the data step and after every epoch the state goes to `out/_train/` (tokens,
heads, optimizer moments as safetensors, progress as JSON); a rerun with the same arguments
continues where it stopped. Deterministic for a seed (shuffling uses its own generator).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .medusa import MedusaHeads, new_heads, save_medusa


def _state_dir(out: Path) -> Path:
    d = out / "_train"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _self_distill(model, prompts, max_new_tokens: int, eos, progress: bool) -> list[torch.Tensor]:
    import speccomp
    from tqdm import tqdm

    fast = speccomp.compile(model, drafter="token_recycling")
    seqs = []
    for ids in tqdm(prompts, desc="self-distill", disable=not progress):
        seqs.append(fast.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos)[0])
    return seqs


def _hidden_states(model, seqs, progress: bool) -> list[torch.Tensor]:
    import speccomp
    from tqdm import tqdm

    plain = speccomp.compile(model)
    kv = plain.kv
    out = []
    with torch.no_grad():
        for s in tqdm(seqs, desc="hidden states", disable=not progress):
            n = s.shape[0]
            empty = torch.zeros(*kv.shape(0), dtype=kv.dtype)
            _, _, h = plain.step(s[None], torch.arange(n)[None], torch.ones(1, n, dtype=torch.long), empty)
            out.append(h[0].clone())  # [n, H]
    return out


def _examples(seqs, hiddens, num_heads: int):
    """(h [N, H], targets [N, K]) over every position with all K targets inside the sequence."""
    hs, ts = [], []
    for s, h in zip(seqs, hiddens):
        n = s.shape[0] - num_heads - 1
        if n <= 0:
            continue
        hs.append(h[:n])
        ts.append(torch.stack([s[k + 2 : k + 2 + n] for k in range(num_heads)], dim=1))
    if not hs:
        raise ValueError(f"no training positions: sequences are shorter than {num_heads + 2} tokens")
    return torch.cat(hs), torch.cat(ts)


def train_heads(
    model, prompts, *, out, num_heads: int = 4, num_layers: int = 1, max_new_tokens: int = 128, epochs: int = 3,
    lr: float = 1e-3, batch_size: int = 256, seed: int = 0, eos_token_id=None, progress: bool = True,
    base_model: str = "",
) -> MedusaHeads:
    """Train heads for `model` on its own continuations of `prompts` (token id tensors); save to `out`."""
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm

    for name, value in (("num_heads", num_heads), ("num_layers", num_layers), ("max_new_tokens", max_new_tokens),
                        ("epochs", epochs), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if not prompts:
        raise ValueError("train_heads needs at least one prompt (token ids) to self-distill from")
    out = Path(out)
    state = _state_dir(out)
    args = {"num_heads": num_heads, "num_layers": num_layers, "max_new_tokens": max_new_tokens, "epochs": epochs,
            "lr": lr, "batch_size": batch_size, "seed": seed, "prompts": len(prompts)}
    progress_file = state / "progress.json"
    done = json.loads(progress_file.read_text()) if progress_file.exists() else {}
    if done and done.get("args") != args:
        raise ValueError(f"{state} holds a run with other settings {done.get('args')}; use another out= or delete it")

    data_file = state / "tokens.safetensors"
    if data_file.exists():
        flat = load_file(str(data_file))
        seqs = [flat[f"seq_{i}"] for i in range(len(flat))]
    else:
        seqs = _self_distill(model, [p if p.dim() == 2 else p[None] for p in prompts], max_new_tokens, eos_token_id, progress)
        save_file({f"seq_{i}": s.contiguous() for i, s in enumerate(seqs)}, str(data_file))
        progress_file.write_text(json.dumps({"args": args, "epoch": 0}))
    h, targets = _examples(seqs, _hidden_states(model, seqs, progress), num_heads)

    torch.manual_seed(seed)
    heads = new_heads(model, num_heads, num_layers)
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    start = 0
    if (state / "heads.safetensors").exists() and done.get("epoch", 0) > 0:
        heads.load_state_dict(load_file(str(state / "heads.safetensors")))
        moments = load_file(str(state / "optimizer.safetensors"))
        opt_state = opt.state_dict()
        for i, _ in enumerate(opt.param_groups[0]["params"]):
            opt_state["state"][i] = {"step": moments[f"{i}.step"].reshape(()), "exp_avg": moments[f"{i}.exp_avg"],
                                     "exp_avg_sq": moments[f"{i}.exp_avg_sq"]}
        opt.load_state_dict(opt_state)
        start = done["epoch"]
    weights = torch.tensor([0.8**k for k in range(num_heads)])
    gen = torch.Generator().manual_seed(seed)
    orders = [torch.randperm(h.shape[0], generator=gen) for _ in range(epochs)]  # fixed whatever the resume point
    total = math.ceil(h.shape[0] / batch_size)
    for epoch in range(start, epochs):
        heads.train()
        seen, loss_sum = 0, 0.0
        bar = tqdm(range(total), desc=f"epoch {epoch + 1}/{epochs}", disable=not progress)
        for b in bar:
            idx = orders[epoch][b * batch_size : (b + 1) * batch_size]
            logits = heads(h[idx])  # [B, K, V]
            ce = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets[idx].reshape(-1), reduction="none"
            ).view(len(idx), num_heads)
            loss = (ce.mean(0) * weights).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += 1
            loss_sum += float(loss.detach())
            bar.set_postfix(loss=f"{loss_sum / seen:.3f}")
        heads.eval()
        save_file({k: v.detach().contiguous() for k, v in heads.state_dict().items()}, str(state / "heads.safetensors"))
        moments = {}
        for i, st in opt.state_dict()["state"].items():
            moments[f"{i}.step"] = torch.as_tensor(st["step"]).reshape(1).float()
            moments[f"{i}.exp_avg"] = st["exp_avg"].contiguous()
            moments[f"{i}.exp_avg_sq"] = st["exp_avg_sq"].contiguous()
        save_file(moments, str(state / "optimizer.safetensors"))
        progress_file.write_text(json.dumps({"args": args, "epoch": epoch + 1}))
    heads.eval()
    save_medusa(heads, out, base_model=base_model)
    return heads


def head_accuracy(heads: MedusaHeads, model, seqs) -> list[float]:
    """Top-1 accuracy of each head on `seqs` (token id tensors): how often head k names token t + k + 2."""
    hiddens = _hidden_states(model, seqs, progress=False)
    h, targets = _examples(seqs, hiddens, heads.num_heads)
    with torch.no_grad():
        pred = heads(h).argmax(-1)
    return (pred == targets).float().mean(0).tolist()
