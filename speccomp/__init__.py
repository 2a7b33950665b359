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
import sys
import types
from importlib import import_module

# speccomp runs offline: ONNX Runtime's OneDS telemetry (looked up at torch.onnx exports and at exit) stays off
# unless the user decided otherwise. Read by ONNX Runtime when it starts, so it is set before any import of it.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from .errors import GraphStructureError, OptionError, OptionTypeError, SpeccompError, UnsupportedModelError

__version__ = "0.1.0"

_LAZY = {  # public name -> module that defines it
    "compile": ".api",
    "capture": ".capture",
    "SpecModel": ".api",
    "available_drafters": ".api",
    "load_default_model": ".models",
    "search_drafter": ".search",
    "train_heads": ".train_heads",
    "autotune": ".autotune",
    "load": ".engine",
    "Engine": ".engine",
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


class _Package(types.ModuleType):
    """`speccomp.autotune`, `speccomp.capture` and `speccomp.train_heads` are functions named like their modules: importing
    the module must not replace the function on the package (the import system sets the attribute)."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and name in _LAZY and _LAZY[name] == f".{name}":
            return  # the submodule stays reachable as sys.modules["speccomp." + name]
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
