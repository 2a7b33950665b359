"""Target tokens <-> draft tokens through text, for a draft model with a tokenizer of its own (HF's universal
assisted decoding). Torch-free: the torch drafter (drafters/draft_model.py `CrossTokenizerDrafter`) and the engine
(engine/runtime.py) share it.

    text so far (target ids) --target.decode--> text --draft.encode--> the draft model's prompt (draft ids)
    a draft path (draft ids) --draft.decode--> new text --target.encode--> target ids continuing the text

Only the target's tokens are ever emitted: the target verifies the mapped tree, so a poor mapping costs acceptance,
never exactness. Two places where the mapping can only guess:
  - the draft's prompt ends where the target's text ends, which may be mid-word; the draft model drafts from there;
  - new text is encoded after the text of the target's last few tokens, and that text's own tokens cut off
    (byte-level BPE and SentencePiece-like tokenizers both mark word starts, so encoding the new text alone could add
    or lose a space: a SentencePiece tokenizer put a word start before 40% of mid-word continuations). Where the two
    texts' tokens merge across the boundary, the new text alone is encoded instead.
"""
from __future__ import annotations

import os
from pathlib import Path

from speccomp.drafters.lookup import Trie
from speccomp.errors import OptionError, OptionTypeError

WINDOW = 4  # draft tokens decoded before a path, so that a decoder's word-start rules see the path mid-text


def text_after(decode, before: list[int], ids: list[int], before_text: str | None = None) -> str | None:
    """The text `ids` add after `before` (decoded together, `before`'s own text cut off, so a tokenizer's word-start
    rules see `ids` mid-text: SentencePiece drops a text's leading space), or None where decoding them together
    rewrote `before`'s text (a decoder's cleanup). `before_text`: decode(before), if known."""
    head = decode(before) if before_text is None else before_text
    text = decode(before + ids)
    return text[len(head):] if text.startswith(head) else None


def as_tokenizer(tok, param: str):
    """A `tokenizers.Tokenizer` for `tok`: a transformers fast tokenizer (its backend) or a tokenizers.Tokenizer.
    One kind of object on both runtimes, serialisable into an engine (tokenizer.json) and fast (Rust). A path (str or
    Path) names a tokenizer.json file or a directory holding one (how the CLI passes a tokenizer)."""
    if isinstance(tok, (str, os.PathLike)):
        file = Path(tok) / "tokenizer.json" if Path(tok).is_dir() else Path(tok)
        if not file.is_file():
            raise OptionError(param, str(tok), "names no tokenizer.json file (nor a directory holding one)",
                              "give the path of a tokenizer.json, or the directory save_pretrained wrote it to")
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            raise OptionError(param, str(file), f"is not a tokenizers JSON file ({exc})",
                              "give a tokenizer.json written by a fast tokenizer") from None
    backend = getattr(tok, "backend_tokenizer", tok)
    if all(callable(getattr(backend, a, None)) for a in ("encode", "decode", "get_vocab_size", "to_str")):
        return backend
    raise OptionTypeError(param, type(tok).__name__, "must be a transformers *fast* tokenizer or a tokenizers.Tokenizer",
                          "load it with AutoTokenizer.from_pretrained(..., use_fast=True), or tokenizers.Tokenizer")


class TextBridge:
    """Both tokenizers of a cross-tokenizer draft (tokenizers.Tokenizer objects, as_tokenizer)."""

    def __init__(self, target, draft):
        self.target, self.draft = target, draft

    def to_draft(self, tokens: list[int]) -> list[int]:
        """The draft model's tokens for the text of the target's `tokens` (special tokens dropped: the draft's own
        would differ)."""
        return self.draft.encode(self.target.decode(tokens, skip_special_tokens=True), add_special_tokens=False).ids

    def context(self, tokens: list[int], max_depth: int, limit: int | None) -> tuple[list[int], int]:
        """The draft's tokens for this step and how deep it may draft: at most `max_depth`, and no node past the draft
        model's `limit` positions (counted in its own tokens, which generate cannot know up front: near the end a
        step drafts less deep, at 0 not at all; it is never refused or cut). 0 too for an empty text."""
        context = self.to_draft(tokens)
        if limit is not None:
            max_depth = min(max_depth, limit - len(context))  # a node at depth d sits at position len(context) - 1 + d
        return context, max_depth if context else 0

    def continuation(self, tokens: list[int], context: list[int], path: list[int]) -> list[int]:
        """Target tokens for the text that draft tokens `path` add after the draft tokens `context`, continuing the
        target's text `tokens`. [] when the path adds no whole character."""
        return self._mapped(*self._anchors(tokens, context), path)

    def _anchors(self, tokens: list[int], context: list[int]) -> tuple:
        """What every path of one step is decoded and encoded after (computed once a step, not once a path): the
        text of the last target and draft tokens, so that both tokenizers see a path mid-text."""
        text = self.target.decode(tokens[-WINDOW:], skip_special_tokens=True)
        window = context[-WINDOW:]
        return (text, self.target.encode(text, add_special_tokens=False).ids,
                window, self.draft.decode(window, skip_special_tokens=True))

    def _mapped(self, text: str, head: list[int], window: list[int], before: str, path: list[int]) -> list[int]:
        new = text_after(lambda ids: self.draft.decode(ids, skip_special_tokens=True), window, path, before)
        if new is None:  # the path rewrote the decoded window (a decoder's cleanup): no guess
            return []
        new = new.rstrip("\ufffd")  # a path may end inside a multi-byte character
        if not new:
            return []
        anchored = self.target.encode(text + new, add_special_tokens=False).ids
        if anchored[:len(head)] == head and head:
            return anchored[len(head):]
        return self.target.encode(new, add_special_tokens=False).ids

    def target_tree(self, tokens: list[int], context: list[int], parents: list[int], draft_tokens: list[int],
                    max_depth: int, max_nodes: int) -> tuple[list[int], list[int]]:
        """A draft tree in draft tokens (parents, tokens; node 0 the root, `context` the draft's text so far) as a
        tree in target tokens under the root tokens[-1]: every root-to-leaf path mapped (`continuation`), the
        paths merged where they share a prefix, cut in BFS order to max_depth / max_nodes. (parents, tokens)."""
        leaves = set(range(len(parents))) - set(parents)
        trie, anchors = Trie(tokens[-1]), self._anchors(tokens, context)
        for leaf in sorted(leaves - {0}):
            path, u = [], leaf
            while u > 0:
                path.append(draft_tokens[u])
                u = parents[u]
            trie.insert(self._mapped(*anchors, path[::-1]))
        return trie.bfs(max_depth, max_nodes)


def check_vocabulary(tokenizer, model_vocab: int, param: str, model: str) -> None:
    """A tokenizer whose ids the model cannot embed is not that model's tokenizer."""
    size = tokenizer.get_vocab_size()  # added tokens included
    if size > model_vocab:
        raise OptionError("drafter_options", f"{param} ({size} tokens)",
                          f"the {model} model's vocabulary has {model_vocab} tokens: this is not its tokenizer",
                          f"pass the {model} model's own tokenizer as {param}")
