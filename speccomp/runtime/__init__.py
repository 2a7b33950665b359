"""Decoding: the loops, the KV cache they own, token trees and acceptance, sampling, SpecModel.

No import here: `calls.py` is torch-free and the engine imports it alone."""
