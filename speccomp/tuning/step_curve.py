"""The step-cost curve a batch's budget plans with, learnt once per model, backend and machine, and stored.

runtime/budget.py's StepCosts is t(q, past): one forward of q packed tokens over `past` cached slots. A batch of B
rows verifying c nodes each over L cached tokens each is the point (q = B * c, past = B * L), so the grid over q and
past is the curve over batch size x tree size (issue 24). Measured lazily, a point costs its first batch a few
forwards; `speccomp autotune` (and `store_curve`) measures the grid up to CURVE_Q x CURVE_PAST ahead and stores it
next to the tuned trees, where every later `compile` of the same model on the same backend and machine finds it
(`load_curve`, read by SpecModel.step_costs). Points beyond the grid are still measured at first use.

    {"schema": 1, "key": {fingerprint, backend, device, dtype, threads, cpu}, "seconds": [[q, past, s], ...]}
"""
from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import torch

SCHEMA = 1
CURVE_Q, CURVE_PAST = 256, 4096  # the grid autotune measures ahead: 16 rows x 16 nodes over 16 rows x 256 tokens


def machine_key(model, backend: str) -> dict:
    """What a measurement is valid for: the model, backend, device, dtype, threads and CPU."""
    from speccomp.models import fingerprint

    p = next(iter(model.parameters()), None)
    return {"fingerprint": fingerprint(model), "backend": backend,
            "device": str(p.device) if p is not None else "cpu",
            "dtype": str(p.dtype).replace("torch.", "") if p is not None else "float32",
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}


def curve_path(model, backend: str) -> Path:
    from speccomp.models import cache_dir

    digest = hashlib.sha256(json.dumps(machine_key(model, backend), sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "step_costs" / f"{backend}-{digest}.json"


def load_curve(model, backend: str) -> dict | None:
    """The stored grid {(q, past): seconds} for this model, backend and machine; None where there is none (a damaged
    or foreign file counts as none: the curve is then measured at first use, as without autotune)."""
    try:
        path = curve_path(model, backend)
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA or data["key"] != machine_key(model, backend):
            return None
        return {(int(q), int(past)): float(s) for q, past, s in data["seconds"] if s > 0}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def store_curve(model, backend: str, costs, max_q: int = CURVE_Q, max_past: int = CURVE_PAST) -> Path:
    """Measure `costs` (a StepCosts) on its grid up to max_q x max_past and store every point it holds."""
    from speccomp.models import write_atomically

    q = 1
    while q <= max_q:
        past = costs.PAST0
        while past <= max_past:
            costs(q, past)
            past *= 2
        q *= 2
    path = curve_path(model, backend)
    seconds = [[q, past, s] for (q, past), s in sorted(costs.measured.items())]
    write_atomically(path, json.dumps({"schema": SCHEMA, "key": machine_key(model, backend), "seconds": seconds}))
    return path
