"""Prompt sets: the ones shipped with the package, or any JSONL file in the common format.

Each line: {"question_id": int, "category": str, "turns": [str, ...]}; turns[0] is the user message.

Shipped (speccomp/data/, origins and licences in speccomp/data/prompts/README.md):
    prompts.jsonl                 six everyday requests: the demo's default
    prompts/alpaca.jsonl          80 instructions          \  what the shipped heads were trained on
    prompts/humaneval.jsonl       80 code completions      /
    prompts/gsm8k.jsonl           77 grade-school problems \  held out: measurements, tests
    prompts/vicuna_bench.jsonl    78 chat questions        /
`load_prompts("gsm8k")` reads a shipped set by name; any other string is a path.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


SETS = ("alpaca", "gsm8k", "humaneval", "vicuna_bench")  # shipped under speccomp/data/prompts/
TRAIN_SETS, HELD_OUT_SETS = ("alpaca", "humaneval"), ("gsm8k", "vicuna_bench")


def prompt_file(name: str) -> Path:
    """The path of a shipped prompt set (one of SETS)."""
    if name not in SETS:
        raise ValueError(f"unknown prompt set {name!r}; shipped sets: {list(SETS)} (or give a JSONL file's path)")
    return Path(str(resources.files("speccomp").joinpath(f"data/prompts/{name}.jsonl")))


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[Prompt]:
    """Prompts from `path` (a JSONL file, or the name of a shipped set), or the demo's six when None."""
    if path is None:
        text = resources.files("speccomp").joinpath("data/prompts.jsonl").read_text()
        source = "speccomp/data/prompts.jsonl"
    else:
        if isinstance(path, str) and path in SETS and not Path(path).exists():
            path = prompt_file(path)
        path = Path(path)
        if not path.is_file():
            what = "is a directory, not a JSONL file" if path.is_dir() else "does not exist"
            raise FileNotFoundError(f"prompt file {path} {what} (shipped sets by name: {list(SETS)})")
        text, source = path.read_text(), str(path)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an int >= 1 (or None for every prompt), got {limit!r}")
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}:{lineno}: not JSON ({exc})") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        # a string "turns" would index to its first character: refused, as anything but a list of strings
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{source}:{lineno}: expected a JSON object with 'turns', a non-empty list of strings, "
                             f"got {line.strip()[:80]}")
        category = row.get("category") or "general"
        if not isinstance(category, str):
            raise ValueError(f"{source}:{lineno}: 'category' must be a string, got {category!r}")
        prompts.append(Prompt(str(row.get("question_id", lineno)), category, turns[0]))
    if not prompts:
        raise ValueError(f"{source} holds no prompts")
    return prompts[:limit] if limit else prompts
