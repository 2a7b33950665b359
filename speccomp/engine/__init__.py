"""Engines: a compiled model written to a directory (`export.py`, needs torch) and run without torch
(`runtime.py`: ONNX Runtime + numpy only). `import speccomp.engine` imports no torch."""
from speccomp.engine.runtime import (ENGINE_DRAFTERS, FORMAT, FORMAT_VERSION, MANIFEST, MEDUSA_FILE, Engine,
                                     EngineError, load, read_manifest)

__all__ = ["ENGINE_DRAFTERS", "FORMAT", "FORMAT_VERSION", "MANIFEST", "MEDUSA_FILE", "Engine", "EngineError", "load",
           "read_manifest"]
