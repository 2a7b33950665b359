"""Triton tree attention: the q new tokens of a forward against every key, under the graph's mask.

    out = torch.ops.speccomp.tree_attention(q, k, v, mask, scale)

    q     [B, Hq,  M, D]    the new tokens (prompt, 1 token, or a whole token tree)
    k, v  [B, Hkv, N, D|Dv] cached prefix + the new tokens (N = past + M), Hq = G * Hkv
    mask  [B|1, Hq|1, M, N] bool (True = may attend) or additive float, as SDPA takes it
    out   [B, Hq,  M, Dv]   = SDPA(q, k, v, mask, scale, enable_gqa=True), float32

The mask is the graph's own (causal prefix, tree mask, sliding windows: passes/tree_attention.py
builds it), so the kernel applies it as given and knows nothing about trees.

Kernel: one program per (block of rows, batch x KV head). The G query heads that share a KV head
are packed as the rows of one tile (row r = g * M + i: head hkv * G + g, token i), so each K/V
block is loaded once per group and no repeat_kv copy exists (flash-decoding's GQA packing; a
tree of 8 tokens with G = 4 fills 32 rows instead of 8). Keys are visited BLOCK_N at a time with an
online softmax: a running row max m, running sum l and an accumulator rescaled by exp(m_old - m_new),
so scores are never materialised for the whole key range. Everything is float32; the dots use
IEEE float32 (Triton's default for float32 dots on GPU is TF32: 10-bit mantissa inputs).

Where it runs: CUDA tensors → compiled Triton. Any tensors → Triton's interpreter (numpy, program by
program: slow, for tests and for stepping through the kernel without a GPU) when TRITON_INTERPRET=1
was set *when triton was imported*: `import triton` wraps Triton's own language library (tl.max,
tl.sum, tl.zeros, ...) for the GPU or for the interpreter once, and torch imports triton early
(torch._dynamo, so torch.export and transformers' model classes), so setting the variable later in
the process cannot switch modes. `check_available` detects that case and says to set it before
Python starts (`TRITON_INTERPRET=1 python ...`).

A fully masked row (never produced by speccomp: every token sees itself) gives zeros, like SDPA's
math kernel, not NaN.
"""
from __future__ import annotations

import torch
from torch import Tensor

from speccomp.errors import SpeccompError

try:  # the kernel's language; the custom op and its fake impl register without it (graphs can hold the op)
    import triton.language as tl
except ImportError:
    tl = None

INSTALL = "pip install 'speccomp[triton]' (triton==3.9.0)"


class TritonBackendError(SpeccompError, RuntimeError):
    """The Triton kernel cannot run here (no Triton, no GPU, no interpreter); the message names the fix."""


def _import_triton():
    try:
        import triton
    except ImportError as exc:
        raise TritonBackendError(f"backend='triton' needs Triton, which is not installed: {INSTALL}") from exc
    return triton


def interpreting() -> bool:
    """Launches go to Triton's CPU interpreter: triton was imported with TRITON_INTERPRET=1.

    Read from Triton's own library (wrapped for one mode at `import triton`), not from the variable now."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_import_triton().language.max, InterpretedFunction)


def check_available(device: torch.device | str) -> None:
    """Raise TritonBackendError unless the kernel can run on tensors on `device`."""
    triton = _import_triton()
    device = torch.device(device)
    if interpreting():  # the interpreter takes any device's tensors (it copies CUDA ones to the host)
        return
    if triton.knobs.runtime.interpret:  # TRITON_INTERPRET=1 now, but triton's library was wrapped for the GPU
        raise TritonBackendError(
            "TRITON_INTERPRET=1 was set after triton was imported (torch imports it early, e.g. for torch.export), "
            "and Triton picks GPU or interpreter for its own library at import: set it before Python starts, "
            "e.g. `TRITON_INTERPRET=1 python script.py`"
        )
    if device.type == "cuda" and torch.cuda.is_available():
        return
    slow = ("or run on CPU in Triton's interpreter (slow; for tests and debugging) by starting Python with "
            "TRITON_INTERPRET=1")
    if torch.cuda.is_available():
        raise TritonBackendError(
            f"the Triton attention kernel runs on a CUDA GPU but the tensors are on {device}: move the model to the "
            f"GPU (model.cuda()), {slow}"
        )
    raise TritonBackendError(
        f"the Triton attention kernel needs a CUDA GPU (torch.cuda.is_available() is False here), {slow}; "
        "backend='eager' runs the same graph on CPU"
    )


# The kernel: a plain function, wrapped at first launch for the mode triton was imported in (_kernel)
def _tree_attention_kernel(
    Q, K, V, Mask, Out, scale,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smh, smm, smn,
    sob, soh, som, sod,
    M, N, Hkv,
    G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BOOL_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)  # int64 base offsets: B * H * N * D may pass 2^31
    hkv = (pid_bh % Hkv).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row r = g * M + i
    row_ok = rows < G * M
    h = hkv * G + rows // M  # [BLOCK_M] query head of each row (the repeat_kv pairing: h // G = hkv)
    i = rows % M  # [BLOCK_M] query token of each row
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)

    q = tl.load(Q + b * sqb + h[:, None] * sqh + i[:, None] * sqm + d[None, :] * sqd,
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)  # [BLOCK_M, BLOCK_D]
    k_base = K + b * skb + hkv * skh
    v_base = V + b * svb + hkv * svh
    mask_rows = Mask + b * smb + h[:, None] * smh + i[:, None] * smm  # [BLOCK_M, 1]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max of the scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # running sum of exp(s - m_i) * v
    for start in range(0, N, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < N
        k = tl.load(k_base + n[:, None] * skn + d[None, :] * skd,
                    mask=n_ok[:, None] & (d[None, :] < D), other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N]
        tile_ok = row_ok[:, None] & n_ok[None, :]
        if BOOL_MASK:
            allowed = tile_ok & (tl.load(mask_rows + n[None, :] * smn, mask=tile_ok, other=0) != 0)
        else:  # additive mask (0 / finfo.min or -inf), added to the scaled scores as SDPA does
            s += tl.load(mask_rows + n[None, :] * smn, mask=tile_ok, other=0.0)
            allowed = tile_ok
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing visible yet has m_new = -inf; subtract 0 instead so exp gives 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp(m_i - m_safe)  # rescales what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * svn + dv[None, :] * svd,
                    mask=n_ok[:, None] & (dv[None, :] < DV), other=0.0)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # fully masked rows: 0, like SDPA's math kernel
    tl.store(Out + b * sob + h[:, None] * soh + i[:, None] * som + dv[None, :] * sod, out,
             mask=row_ok[:, None] & (dv[None, :] < DV))


_KERNELS: dict[bool, object] = {}  # interpreted? -> the wrapped kernel (not @triton.jit: that reads TRITON_INTERPRET
#                                    when this module is imported, which may disagree with triton's own library)


def _kernel(interpret: bool):
    if interpret not in _KERNELS:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction as wrap
        else:
            from triton.runtime.jit import JITFunction as wrap
        _KERNELS[interpret] = wrap(_tree_attention_kernel)
    return _KERNELS[interpret]


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _check(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"tree_attention takes 4-D q, k, v [B, H, S, D], got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32:
            raise ValueError(f"tree_attention computes in float32; {name} is {t.dtype}")
    if mask.dtype not in (torch.bool, torch.float32):
        raise ValueError(f"tree_attention takes a bool or float32 mask, got {mask.dtype}")
    (B, Hq, M, D), (Bk, Hkv, N, Dk) = q.shape, k.shape
    if Bk != B or Dk != D or v.shape[:3] != k.shape[:3] or Hkv == 0 or Hq % Hkv:
        raise ValueError(
            f"tree_attention shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(k and v must share [B, Hkv, N], and Hq must be a multiple of Hkv)"
        )
    if N < M:
        raise ValueError(f"tree_attention: {N} keys for {M} queries; the keys are the cache plus the new tokens")
    if len({t.device for t in (q, k, v, mask)}) != 1:
        raise ValueError(f"tree_attention inputs are on different devices: {[str(t.device) for t in (q, k, v, mask)]}")


def launch(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None, block_n: int = 64) -> Tensor:
    """Run the kernel (what the custom op calls; `block_n` is exposed for tests of ragged key blocks)."""
    _check(q, k, v, mask)
    check_available(q.device)
    B, Hq, M, D = q.shape
    Hkv, N, DV = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    mask = mask.expand(B, Hq, M, N)  # broadcast dims get stride 0: no copy
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)  # same bytes; a plain byte pointer in the kernel
    # [B, Hq, M, DV] in SDPA's memory layout ([B, M, Hq, DV] underneath; the kernel writes through the strides): an
    # exported graph drops a `.transpose(1, 2).contiguous()` after SDPA as a no-op and views the result directly
    out = torch.empty(B, M, Hq, DV, device=q.device, dtype=q.dtype).transpose(1, 2)
    if out.numel() == 0:
        return out
    block_m = min(64, max(16, _next_pow2(G * M)))  # tl.dot wants every tile dim >= 16
    grid = (-(-G * M // block_m), B * Hkv)  # ceil(G * M / block_m) row blocks
    _kernel(interpreting())[grid](
        q, k, v, mask, out, scale,
        *q.stride(), *k.stride(), *v.stride(), *mask.stride(), *out.stride(),
        M, N, Hkv,
        G=G, D=D, DV=DV, BOOL_MASK=mask.dtype == torch.uint8,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, _next_pow2(D)), BLOCK_DV=max(16, _next_pow2(DV)),
    )
    return out


# The custom op FX graphs hold (passes/triton_attention.py puts it in place of SDPA)
@torch.library.custom_op("speccomp::tree_attention", mutates_args=())
def tree_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """SDPA(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True) computed by the Triton kernel."""
    return launch(q, k, v, mask, scale)


@tree_attention.register_fake
def _(q, k, v, mask, scale=None):
    B, Hq, M, _ = q.shape
    return q.new_empty(B, M, Hq, v.shape[-1]).transpose(1, 2)  # [B, Hq, M, Dv], laid out as launch's


TREE_ATTENTION = torch.ops.speccomp.tree_attention.default

