"""Decoding: the loops, the KV cache they own, token trees and acceptance, sampling, SpecModel.

No import here: `calls.py`, `packed.py` and `budget.py` are torch-free and the engine imports them alone."""
