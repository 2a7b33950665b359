"""The step-cost curve a batch's budget plans with, learnt once per model, backend and machine, and stored.

runtime/budget.py's StepCosts is t(q, past): one forward of q packed tokens over `past` cached slots. A batch of B
rows verifying c nodes each over L cached tokens each is the point (q = B * c, past = B * L), so the grid over q and
past is the curve over batch size x tree size (issue 24). Measured lazily, a point costs its first batch a few
forwards; `speccomp autotune` (and `store_curve`) measures the grid up to CURVE_Q x CURVE_PAST (runtime/budget.py's
AHEAD_Q x AHEAD_PAST) afresh and stores it next to the tuned trees, where every later `compile` of the same model on
the same backend and machine finds it (`load_curve`, read by SpecModel.step_costs). Points beyond the grid are still
measured at first use. An engine's curve is keyed by its target graph's SHA-256 instead (`engine_key`; this module
is torch-free at import, so the engine runtime reads and writes curves too): `speccomp serve` measures the grid at its
first start on a machine and stores it, and every later start (and `Engine.step_costs`) begins from it.

    {"schema": 1, "key": {fingerprint, backend, device, dtype, threads, cpu, versions}, "seconds": [[q, past, s], ...]}
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from pathlib import Path

from speccomp.runtime.budget import AHEAD_PAST as CURVE_PAST
from speccomp.runtime.budget import AHEAD_Q as CURVE_Q

SCHEMA = 1


def machine_key(model, backend: str, threads: int | None = None) -> dict:
    """What a measurement is valid for: the model, backend, device (and the GPU's name), dtype, threads (default:
    torch's now; give the user's where a caller runs inside runtime/model.py's host_threads, which sets one) and CPU."""
    import torch

    from speccomp.frontend.convention import CapturedModel
    from speccomp.models import fingerprint

    if isinstance(model, CapturedModel):  # speccomp.capture(model): keyed by the model it captured, as compile keys it
        model = model.model
    p = next(iter(model.parameters()), None)
    key = {"fingerprint": fingerprint(model), "backend": backend,
           "device": str(p.device) if p is not None else "cpu",
           "dtype": str(p.dtype).replace("torch.", "") if p is not None else "float32",
           "threads": threads or torch.get_num_threads(), "cpu": cpu()}
    if p is not None and p.device.type == "cuda":  # hosts sharing a home folder and a CPU may hold other GPUs
        key["gpu"] = torch.cuda.get_device_name(p.device)
    return key


@functools.cache  # once per process: platform.processor() runs `uname -p`, and every key asks
def cpu() -> str:
    """This machine's CPU as timing depends on it: the model name (/proc/cpuinfo where there is one; Linux's
    platform.processor() is empty) and the cores this process may use."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} x{cores}"


def _versions(*packages: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in packages:
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            pass
    return versions


def curve_key(model, backend: str, threads: int | None = None) -> dict:
    """machine_key plus the versions of what runs the forward: a new torch or ONNX Runtime times differently."""
    return {**machine_key(model, backend, threads),
            "versions": _versions("speccomp", "torch", "onnxruntime", "onnxruntime-gpu")}


def engine_key(target_sha256: str, providers: list[str], threads: int | None, spin: bool) -> dict:
    """What an engine's curve is valid for: its target graph (the manifest's SHA-256), the providers its session runs
    on, ONNX Runtime's threads (None: its default, set by the cores in `cpu()`) and whether they spin, the CPU and
    the versions of what runs the step."""
    key = {"engine": target_sha256, "backend": "engine", "providers": list(providers), "threads": threads,
           "spin": spin, "cpu": cpu(), "versions": _versions("speccomp", "numpy", "onnxruntime", "onnxruntime-gpu")}
    if any(p in ("CUDAExecutionProvider", "TensorrtExecutionProvider") for p in providers):
        key["gpu"] = nvidia_gpus()  # hosts sharing a home folder and a CPU may hold other GPUs
    return key


def nvidia_gpus() -> list[str]:
    """The NVIDIA GPUs' model names as the driver lists them (/proc/driver/nvidia; no torch in an engine process)."""
    names = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            names += [line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("Model:")]
        except OSError:
            pass
    return names


def curve_path(key: dict) -> Path:
    from speccomp.models import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "step_costs" / f"{key['backend']}-{digest}.json"


def read_curve(key: dict) -> dict | None:
    """The stored grid {(q, past): seconds} for `key`; None where there is none (a damaged or foreign file counts as
    none: the curve is then measured at first use)."""
    try:
        data = json.loads(curve_path(key).read_text())
        if data.get("schema") != SCHEMA or data["key"] != key:
            return None
        return {(int(q), int(past)): float(s) for q, past, s in data["seconds"] if s > 0}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # AttributeError: JSON that is not an object
        return None


def write_curve(key: dict, measured: dict) -> Path:
    """Store `measured` ({(q, past): seconds}, a StepCosts' points) under `key`, atomically."""
    from speccomp.models import write_atomically

    path = curve_path(key)
    seconds = [[q, past, s] for (q, past), s in sorted(measured.items())]
    write_atomically(path, json.dumps({"schema": SCHEMA, "key": key, "seconds": seconds}))
    return path


def load_curve(model, backend: str, threads: int | None = None) -> dict | None:
    """read_curve for this model, backend and machine (a model that cannot be fingerprinted has none)."""
    try:
        key = curve_key(model, backend, threads)
    except (RuntimeError, AttributeError, TypeError, ValueError):
        return None
    return read_curve(key)


def store_curve(model, backend: str, costs, max_q: int = CURVE_Q, max_past: int = CURVE_PAST) -> Path:
    """Measure `costs` (a StepCosts) afresh on its grid up to max_q x max_past and store every point it holds (a
    curve it was seeded with is measured again: autotune run anew re-learns this machine)."""
    costs.reset()
    costs.measure_ahead(max_q, max_past)
    return write_curve(curve_key(model, backend), costs.measured)
