"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024; a drafter of vLLM, SGLang and TensorRT-LLM), plain Python:
the torch drafter (speccomp/drafters/ngram.py `SuffixDrafter`) and the engine (speccomp/engine/runtime.py) share it.

The text so far ends in a suffix that occurred before: in the prompt, in the reply so far, or in earlier replies of
the same drafter (its cross-request memory, capped in size). What followed those occurrences, weighted by how often,
is the draft: a tree of the likeliest continuations.

    SuffixIndex    how often every token string of length <= depth occurs in the texts added (a count trie,
                   O(depth) per appended token)
    SuffixDecoder  one index for the current text (prompt + reply), one for earlier texts (memory); each step
                   finds the longest suffix of the text (<= max_match tokens) that some earlier occurrence
                   continues, and grows the draft best-first over the continuations both indexes count:
                   P(child) = P(parent) * count(parent + t) / count of all continuations of the parent, keeping
                   at most `budget` drafts, down to `max_depth`, none below `min_prob`.
Drafts are deterministic (q = 1): lossless under greedy and sampled acceptance alike.
"""
from __future__ import annotations

import heapq
from collections import deque


class SuffixIndex:
    """Counts of every token string of length <= `depth` in the texts added: trie node = string, count = occurrences.

    Appending token t extends every open suffix (the strings ending at the previous token, shorter than depth)
    and the empty one by t, so each text costs O(len * depth) and a lookup O(len(pattern))."""

    def __init__(self, depth: int):
        self.depth = depth
        self.kids: list[dict[int, int]] = [{}]
        self.count, self.level = [0], [0]
        self.open: list[int] = []  # trie nodes of the current text's suffixes that can still grow

    @property
    def nodes(self) -> int:
        return len(self.count)

    def new_text(self) -> None:
        """The next tokens start a new text (no string spans two texts)."""
        self.open = []

    def extend(self, tokens) -> None:
        for t in tokens:
            grown = []
            for node in self.open + [0]:
                c = self.kids[node].get(t)
                if c is None:
                    c = self.kids[node][t] = len(self.count)
                    self.kids.append({})
                    self.count.append(0)
                    self.level.append(self.level[node] + 1)
                self.count[c] += 1
                if self.level[c] < self.depth:
                    grown.append(c)
            self.open = grown

    def find(self, pattern) -> int | None:
        node = 0
        for t in pattern:
            node = self.kids[node].get(t)
            if node is None:
                return None
        return node


class SuffixMemory:
    """Earlier texts in one SuffixIndex of at most about `max_nodes` nodes (and as many tokens kept): past the cap,
    the oldest texts leave (the index is rebuilt from the newest that fit; a text alone over the cap keeps its end)."""

    def __init__(self, depth: int, max_nodes: int):
        self.depth, self.max_nodes = depth, max_nodes
        self.texts: deque[list[int]] = deque()
        self.index = SuffixIndex(depth)

    def add(self, text: list[int]) -> None:
        self.texts.append(list(text))
        self.index.new_text()
        self.index.extend(text)
        # texts that repeat earlier ones add few nodes: the tokens kept are capped too (a long-running engine)
        if self.index.nodes > self.max_nodes or sum(map(len, self.texts)) > self.max_nodes:
            self._rebuild()

    def _rebuild(self) -> None:
        kept, nodes = deque(), 0
        for text in reversed(self.texts):  # newest first; a text costs at most len * depth nodes
            cost = len(text) * self.depth
            if kept and nodes + cost > self.max_nodes // 2:
                break
            kept.appendleft(text if cost <= self.max_nodes // 2 else text[-max(1, self.max_nodes // (2 * self.depth)):])
            nodes += cost
        self.texts, self.index = kept, SuffixIndex(self.depth)
        for text in kept:
            self.index.new_text()
            self.index.extend(text)


class SuffixDecoder:
    """The drafting state of one drafter: begin(prompt) per generation, propose(tokens, max_depth, max_nodes) per
    step (tokens: the text so far, root last) -> (parents, tokens) of the draft tree, root first, parents first."""

    def __init__(self, max_match: int = 16, max_depth: int = 8, budget: int = 16, min_prob: float = 0.1,
                 memory: int = 100_000):
        self.max_match, self.max_depth, self.budget, self.min_prob = max_match, max_depth, budget, min_prob
        self.depth = max_match + max_depth  # a match plus a draft below it
        self.memory = SuffixMemory(self.depth, memory) if memory else None
        self.request, self.text = SuffixIndex(self.depth), []

    def row(self) -> "SuffixDecoder":
        """A decoder for one row of a batch: it reads this decoder's memory and adds its own text to it at finish()
        (when the batch lets the row go), so batched and served requests are remembered as single ones are."""
        new = SuffixDecoder(self.max_match, self.max_depth, self.budget, self.min_prob, memory=0)
        new.memory = self.memory
        return new

    def finish(self, text: list[int]) -> None:
        """A generation ended with `text` (prompt + reply): it joins the memory. The whole text, not what propose last
        saw: the last step's tokens, and a tail a batch's budget let the row decode without drafting."""
        if self.memory is not None and text:
            self.memory.add(list(text))
        self.text = []

    def begin(self, prompt) -> None:
        """A new generation: the prompt is indexed (and the last one's text, as far as propose saw it, joins the memory
        where no finish() came after it: it raised, or a wrapper such as autotune's recorder did not pass it on)."""
        if self.memory is not None and self.text:
            self.memory.add(self.text)
        self.request, self.text = SuffixIndex(self.depth), []
        self._catch_up(list(prompt))

    def _catch_up(self, tokens: list[int]) -> None:
        """Index what the text gained since the last call (the reply's new tokens, the root included)."""
        if tokens[: len(self.text)] != self.text:  # not a continuation: a text of its own
            self.request, self.text = SuffixIndex(self.depth), []
        self.request.extend(tokens[len(self.text):])
        self.text = list(tokens)

    def _indexes(self) -> list[SuffixIndex]:
        return [self.request] + ([self.memory.index] if self.memory is not None else [])

    def match(self, tokens: list[int]) -> list[tuple[SuffixIndex, int]]:
        """(index, node) of the longest suffix of `tokens` (<= max_match) that an earlier occurrence continues, in
        every index where it does; [] when none does."""
        for m in range(min(self.max_match, len(tokens)), 0, -1):
            pattern = tokens[-m:]
            found = [(ix, node) for ix in self._indexes() if (node := ix.find(pattern)) is not None and ix.kids[node]]
            if found:
                return found
        return []

    def propose(self, tokens: list[int], max_depth: int, max_nodes: int) -> tuple[list[int], list[int]]:
        self._catch_up(tokens)
        parents, out = [-1], [tokens[-1]]
        depth_limit, budget = min(self.max_depth, max_depth), min(self.budget, max_nodes - 1)
        places = self.match(tokens)
        if not places or depth_limit < 1 or budget < 1:
            return parents, out
        # best first: a candidate joins the tree when it is the likeliest left (children are never likelier than
        # their parent, so parents come first); (-P, tie-break, parent's tree index, token, places, depth)
        heap: list = []
        seq = self._push_children(heap, 1.0, 0, places, 1, 0)
        while heap and len(out) <= budget:
            neg_p, _, parent, token, kids, depth = heapq.heappop(heap)
            if -neg_p < self.min_prob:
                break
            parents.append(parent)
            out.append(token)
            if depth < depth_limit:
                seq = self._push_children(heap, -neg_p, len(out) - 1, kids, depth + 1, seq)
        return parents, out

    @staticmethod
    def _push_children(heap: list, p: float, at: int, places: list, depth: int, seq: int) -> int:
        """Push the continuations of one candidate (its trie nodes in every index) with their probabilities."""
        counts: dict[int, list] = {}
        for ix, node in places:
            for t, c in ix.kids[node].items():
                entry = counts.setdefault(t, [0, []])
                entry[0] += ix.count[c]
                entry[1].append((ix, c))
        total = sum(n for n, _ in counts.values())
        for t, (n, kids) in counts.items():
            heapq.heappush(heap, (-p * n / total, seq, at, t, kids, depth))
            seq += 1
        return seq
