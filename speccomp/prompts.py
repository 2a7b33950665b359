"""Prompt sets: a few shipped with the package, or any JSONL file in the common format.

Each line: {"question_id": int, "category": str, "turns": [str, ...]}; turns[0] is the user message.
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


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[Prompt]:
    """Prompts from `path` (JSONL), or the ones shipped with speccomp when None."""
    if path is None:
        text = resources.files("speccomp").joinpath("data/prompts.jsonl").read_text()
        source = "speccomp/data/prompts.jsonl"
    else:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"prompt file {path} does not exist")
        text, source = path.read_text(), str(path)
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(Prompt(str(row.get("question_id", lineno)), row.get("category", "general"), row["turns"][0]))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"{source}:{lineno}: expected JSON with a non-empty 'turns' list ({exc})") from exc
    if not prompts:
        raise ValueError(f"{source} holds no prompts")
    return prompts[:limit] if limit else prompts
