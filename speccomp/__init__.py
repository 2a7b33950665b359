"""speccomp: compile causal LMs into lossless speculative decoders.

    import speccomp
    model, tokenizer = speccomp.load_default_model()
    fast = speccomp.compile(model)
    out = fast.generate(input_ids, max_new_tokens=128)
    fast.export("engine/", tokenizer=tokenizer)     # then, without torch: speccomp.load("engine/")

Names are imported on first use (PEP 562), so `import speccomp` alone does not import torch: an
exported engine runs where only onnxruntime and numpy are installed.
"""
import os
from importlib import import_module

# speccomp runs offline: ONNX Runtime's OneDS telemetry (looked up at torch.onnx exports and at exit) stays off
# unless the user decided otherwise. Read by ONNX Runtime when it starts, so it is set before any import of it.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from speccomp.errors import GraphStructureError, OptionError, OptionTypeError, SpeccompError, UnsupportedModelError

__version__ = "0.1.0"

_LAZY = {  # public name -> module that defines it
    "compile": ".api",
    "check_options": ".api",
    "capture": ".frontend",
    "SpecModel": ".runtime.model",
    "available_drafters": ".drafters.registry",
    "load_default_model": ".models",
    "search_drafter": ".tuning.search",
    "train_heads": ".tuning.train_heads",
    "train_draft": ".tuning.train_draft",
    "load_draft": ".tuning.train_draft",
    "autotune": ".tuning.autotune",
    "load": ".engine",
    "Engine": ".engine",
    "EngineError": ".engine",  # an engine directory, provider or export destination refused (README)
    # for writing your own passes and drafters (examples/custom_pass_and_drafter.py)
    "Pass": ".frontend.graph",
    "SpecGraph": ".frontend.graph",
    "Drafter": ".runtime.decode",
    "Draft": ".runtime.decode",
    "Tree": ".runtime.tree",
}
__all__ = [*_LAZY, "SpeccompError", "UnsupportedModelError", "GraphStructureError", "OptionError", "OptionTypeError"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'speccomp' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
