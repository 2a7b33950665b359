"""The k largest scores of each row of a vocabulary-wide array, in numpy: shared by the torch runtime and the
torch-free engine (this module imports no torch).

    values, ids = top_k(scores, k)      # [n, V] -> [n, k] each, largest first, ties: the lower id first
    logp, ids = top_logp(logits, k)     # the same k as log-probabilities (log-softmax of each row)

Drafters read a handful of candidates out of ~50k logits per tree node, every step: Token Recycling's observe
(every verified node's top k), a dynamic tree's expand (each frontier node's top k), Medusa's heads. torch.topk and
numpy's argpartition look at every element several times (benchmarks/host_ops.py: ~1.1 ms for 20 nodes of a 49k
vocabulary on one thread). Here one pass finds each group's largest score, and the answer is read out of the few
groups whose maxima are the k largest:

    group g = columns g, g + G, g + 2G, ... (ROWS strided rows of the row seen as [ROWS, G]: numpy reduces over
              the outer axis with whole-vector maximums, much faster than over a short inner axis)
    why it is exact: take the k groups with the largest maxima. Each holds a score >= the k-th of those maxima, m;
              any score outside them is <= its own group's maximum <= m. So the k largest scores of the row
              (as values) are the k largest of the chosen groups' scores (plus the columns past ROWS * G).

The groups are chosen by k rounds of a vectorised argmax over the [n, G] maxima (argpartition over 1,536 values
costs several times more). Ties are ordered by id, as ONNX Runtime's TopK orders them (so the engine's in-graph top k
and this one agree): where a score left out of the chosen groups could equal the k-th found (a tie across groups),
or fewer than k groups hold a number above -inf, that row reads every id whose score reaches the k-th value, in id
order; a row with a NaN, or a vocabulary too small for the shortcut to pay, is sorted whole. Integer scores are
read as float64.
"""
from __future__ import annotations

import numpy as np

ROWS = 32  # scores per group; G = V // ROWS groups (1,536 for a 49,152-token vocabulary)


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, ids) of the k largest scores of each row of `scores` [n, V] (any float dtype), largest first, ties
    broken by the lower id, NaN after every number; k is cut to V."""
    scores = np.asarray(scores)
    if scores.ndim != 2:
        raise ValueError(f"top_k takes scores [n, V], got shape {scores.shape}")
    if not np.issubdtype(scores.dtype, np.floating):  # integers: -inf marks and negation need a float
        scores = scores.astype(np.float64)
    n, vocab = scores.shape
    if vocab == 0 or int(k) < 1:
        raise ValueError(f"top_k needs k >= 1 of a vocabulary of V >= 1, got k={k}, V={vocab}")
    k = min(int(k), vocab)
    groups = vocab // ROWS
    if n == 0 or 8 * k > groups:  # a small vocabulary: sorting it whole is as cheap
        return _sorted(scores, np.broadcast_to(np.arange(vocab), scores.shape), k)
    scores = np.ascontiguousarray(scores)
    grouped = scores[:, : groups * ROWS].reshape(n, ROWS, groups)
    maxima = grouped.max(1)  # [n, G]
    nan = np.isnan(maxima).any(-1)
    chosen, rows = np.empty((n, k), dtype=np.int64), np.arange(n)
    for i in range(k):  # the k groups of the largest maxima
        chosen[:, i] = maxima.argmax(-1)
        kth = maxima[rows, chosen[:, i]]
        maxima[rows, chosen[:, i]] = -np.inf
    ids = (np.arange(ROWS)[None, :, None] * groups + np.sort(chosen, -1)[:, None, :]).reshape(n, ROWS * k)
    if vocab > groups * ROWS:  # the last columns belong to no group: always candidates
        ids = np.concatenate([ids, np.broadcast_to(np.arange(groups * ROWS, vocab), (n, vocab - groups * ROWS))], 1)
    values, ids = _sorted(np.take_along_axis(scores, ids, -1), ids, k)
    # exact as it stands where every score left out is below the k-th found; where one may equal it (a tie), the
    # k-th found is still the k-th largest value: read every id reaching it, in id order. A -inf k-th group maximum
    # means fewer than k groups hold a number (the rounds may then take a group twice): such rows, and rows with a
    # NaN, are sorted whole
    whole = nan | (kth == -np.inf)
    tied = ~(maxima.max(-1) < values[:, -1]) & ~whole
    for r in np.flatnonzero(tied | whole):
        row = scores[r]
        reach = np.arange(vocab) if whole[r] else np.flatnonzero(row >= values[r, -1])
        values[r], ids[r] = (a[0] for a in _sorted(row[reach][None], reach[None], k))
    return values, ids


def _sorted(values: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest of each row of `values` with their `ids` (same shape, ascending along each row), largest first,
    ties by the lower id (a stable sort of the negated values keeps ascending ids first; NaN sorts last)."""
    order = np.argsort(-values, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(values, order, -1), np.take_along_axis(ids, order, -1).astype(np.int64, copy=False)


def top_logp(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(log-probabilities, ids) of each row's k likeliest tokens, best first: log-softmax of the row at its top k
    only (the normaliser still reads every logit, once)."""
    x = np.asarray(logits, dtype=np.float32)
    values, ids = top_k(x, k)
    peak = values[:, :1]  # the row's max (a row with a NaN: NaN log-probabilities either way, through the sum)
    return (values - peak) - np.log(np.exp(x - peak).sum(-1, keepdims=True)), ids
