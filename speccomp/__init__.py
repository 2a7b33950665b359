"""speccomp: compile causal LMs into lossless speculative decoders.

    import speccomp
    model, tokenizer = speccomp.load_default_model()
    fast = speccomp.compile(model)
    out = fast.generate(input_ids, max_new_tokens=128)
"""
from .api import SpecModel, available_drafters, compile  # noqa: A004
from .errors import GraphStructureError, SpeccompError, UnsupportedModelError
from .models import load_default_model
from .search import search_drafter
from .train_heads import train_heads
from .autotune import autotune

__version__ = "0.1.0"
__all__ = [
    "compile",
    "SpecModel",
    "available_drafters",
    "load_default_model",
    "search_drafter",
    "train_heads",
    "autotune",
    "SpeccompError",
    "UnsupportedModelError",
    "GraphStructureError",
]
