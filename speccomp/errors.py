"""Errors speccomp raises on purpose. Each message names the problem and the fix.

Bad arguments raise `OptionError` (a bad value) or `OptionTypeError` (a value of the wrong type). Both
are also `ValueError` / `TypeError`, so code that catches the builtin types keeps working, and both
carry `.parameter`, `.value` and `.fix` for programs that want to react to them.
"""
import os


class SpeccompError(Exception):
    """Base class of speccomp's own errors."""


class UnsupportedModelError(SpeccompError, ValueError):
    """The model cannot be captured or its structure cannot be found in the graph."""


class GraphStructureError(SpeccompError):
    """A pass found the graph in a shape it does not expect."""


def _describe(value) -> str:
    """repr(value) on one line, cut in the middle when long: a path keeps its file name (up to 300 characters whole),
    a tensor or list its first and last items."""
    text = " ".join(repr(value).split())  # tensors and arrays print over several lines
    limit = 300 if isinstance(value, (str, os.PathLike)) else 80
    return text if len(text) <= limit else f"{text[:limit * 2 // 3]}...{text[-(limit // 3 - 3):]}"


class _BadOption:
    def __init__(self, parameter: str, value, problem: str, fix: str = ""):
        self.parameter, self.value, self.problem, self.fix = parameter, value, problem, fix
        message = f"{parameter}={_describe(value)}: {problem}"
        super().__init__(f"{message}; {fix}" if fix else message)

    def __reduce__(self):  # pickle / copy rebuild it from its parts (errors cross process pools)
        return type(self), (self.parameter, self.value, self.problem, self.fix)


class OptionError(_BadOption, SpeccompError, ValueError):
    """A parameter's value cannot be used. The message reads `parameter=value: problem; fix`."""


class OptionTypeError(_BadOption, SpeccompError, TypeError):
    """A parameter's value has the wrong type. The message reads `parameter=value: problem; fix`."""
