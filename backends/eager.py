"""Eager backend: run the rewritten FX GraphModule as Python, op by op (no compilation)."""
from __future__ import annotations


def lower_eager(sg):
    return sg.gm
