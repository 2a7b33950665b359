"""Errors speccomp raises on purpose. Each message names the problem and the fix."""


class SpeccompError(Exception):
    """Base class of speccomp's own errors."""


class UnsupportedModelError(SpeccompError, ValueError):
    """The model cannot be captured or its structure cannot be found in the graph."""


class GraphStructureError(SpeccompError):
    """A pass found the graph in a shape it does not expect."""
