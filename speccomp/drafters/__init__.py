"""Drafters: self-drafters from the graph, text drafters, Medusa / Hydra / EAGLE heads, merges; the registry.

No import here: `lookup.py` is torch-free and the engine imports it alone."""
