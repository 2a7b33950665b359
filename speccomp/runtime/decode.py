"""The decode loop, written once, and what it shares: the KV cache the runtime owns, stats, the drafter protocol.

    verifier.prefill(prompt)                      -> the first token (the first root)
    loop:
        draft  = drafter.propose(ctx)             # ctx: the text so far (root last), cache, room; Tree + tokens
        logits = verifier.verify(tokens, tree)    # one forward: positions past + depth, tree_mask ancestor-or-self
        path, bonus = greedy_accept | sample_accept   # path starts at the root
        verifier.commit(path)                     # keep the KV of root + accepted drafts, in order
        emit tokens[path[1:]] + [bonus]; bonus is the next root

Plain decoding is the same loop with `RootOnly`, which drafts nothing: every step verifies the root alone.
The target side is a verifier (any object with prefill / verify / commit / cache): `FullCache` runs the target graph
(after TreeAttention) over a `KVCache`; speccomp/kv/target.py's reads a compressed cache. The engine
(speccomp/engine/runtime.py) runs this algorithm in numpy; tests/test_engine.py pins the two together step by step.

`target` is any callable with the captured graph's convention (speccomp/frontend/convention.py) plus the
tree mask: logits, new_kv, hidden[, extra outputs] = target(input_ids, position_ids, attention_mask, past_kv,
tree_mask). Backends hand the runtime such a callable; the runtime never looks inside it.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from speccomp.errors import GraphStructureError, OptionError
from speccomp.frontend.convention import KV_ROOM, KVSpec
from speccomp.runtime.calls import Generation
from speccomp.runtime.sampling import Sampler, argmax
from speccomp.runtime.tree import Tree, greedy_accept, sample_accept, typical_accept_lossy


class KVCache:
    """A preallocated cache [L, 2, 1, Hkv, capacity, D]; positions [0, length) are valid.

    Static storage (as in gpt-fast) means appending is a copy into place and dropping
    rejected tokens is just `length -= n`. Slots past `length` are scratch: a lowered graph given a view
    `data[..., :n, :]` with n >= length writes its step's entries there itself (frontend/convention.py KV_ROOM)
    instead of copying the past.
    """

    def __init__(self, spec: KVSpec, capacity: int, device="cpu", data: torch.Tensor | None = None):
        """`data`: a buffer of spec.shape(capacity) to reuse (a CUDA graph's fixed address, backends/cudagraphs.py);
        its old entries must be finite (attention reads the free slots behind a mask there)."""
        self.spec = spec
        self.data = torch.zeros(spec.shape(capacity), dtype=spec.dtype, device=device) if data is None else data
        setattr(self.data, KV_ROOM, weakref.ref(self))  # slots past `length` are scratch (weak: no cycle)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def past(self) -> torch.Tensor:
        return self.data[..., : self.length, :]  # [L, 2, 1, Hkv, length, D] (a view)

    def append(self, new_kv: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Append this step's entries; `keep` (indices along the token axis) selects some of them."""
        if self.length == 0 and (new_kv.dim() != 6 or new_kv.shape[:4] != self.data.shape[:4]
                                 or new_kv.shape[5] != self.data.shape[5]):
            # a target pass changed the output (fewer layers broadcast into every layer: a text neither model gives);
            # the graph is the same at every step: its first entries (the prefill's) are checked, not every step's
            raise GraphStructureError(f"the target graph's new_kv output is {list(new_kv.shape)}; the cache holds "
                                      f"{list(self.data.shape[:4])} + [tokens, {self.data.shape[5]}]: a target pass "
                                      "may add outputs after logits, new_kv, hidden, not change them")
        if keep is not None:
            new_kv = new_kv.index_select(4, keep)
        n = new_kv.shape[4]
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.length} + {n} > capacity {self.capacity}")
        self.data[..., self.length : self.length + n, :] = new_kv
        self.length += n

    def nbytes(self) -> int:
        """Bytes the valid part of the cache holds."""
        return self.length * self.spec.bytes_per_token()


def target_cache(target, kv: KVSpec, capacity: int, device) -> KVCache:
    """A KVCache for `target`'s steps: in the target's own storage where it brings one (backends/cudagraphs.py: fixed
    addresses for its graphs), else a new buffer."""
    return getattr(target, "new_cache", KVCache)(kv, capacity, device)


@dataclass
class Stats:
    new_tokens: int = 0
    steps: int = 0  # target forwards, the prefill included
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    acceptance_by_depth: list = field(default_factory=list)  # P(draft at depth d accepted), d = 1, 2, ...
    _proposed: list = field(default_factory=list, repr=False)  # steps that drafted down to depth d (index d-1)
    _accepted: list = field(default_factory=list, repr=False)  # steps that accepted a draft at depth d

    def record(self, tree: Tree, path: list[int]) -> None:
        """One verification: drafts proposed down to tree.max_depth, accepted down to len(path) - 1."""
        depth = int(tree.max_depth)
        while len(self._proposed) < depth:
            self._proposed.append(0)
            self._accepted.append(0)
        for d in range(depth):
            self._proposed[d] += 1
        for d in range(len(path) - 1):
            self._accepted[d] += 1
        self.acceptance_by_depth = [a / p if p else 0.0 for a, p in zip(self._accepted, self._proposed)]

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "tau": self.new_tokens / max(self.steps, 1),
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "acceptance_by_depth": list(self.acceptance_by_depth),
            "tokens_per_second": self.new_tokens / self.seconds if self.seconds > 0 else float("nan"),
        }


@dataclass
class Draft:
    tree: Tree
    tokens: torch.Tensor  # long [n], tokens[0] = root
    probs: torch.Tensor | None = None  # [n, V] draft distributions when tokens were *sampled*; None = deterministic


@dataclass
class DraftContext:
    """What a drafter may look at: the text so far, the target's cache, and the room left."""

    tokens: list[int]  # prompt + emitted tokens (the last one is the root)
    cache: KVCache  # target cache (holds every token but the root); scratch room after `length`
    max_depth: int  # deeper drafts could not be emitted (max_new_tokens) or would not fit
    max_nodes: int  # tree size limit (context left, sliding windows)
    sampler: Sampler | None = None  # when the target samples (exact acceptance): a drafter may sample its drafts
    # too and return the distributions it drew them from (Draft.probs); None: greedy decoding


READS = ("states", "path_states", "target_cache", "own_cache")
TREES = ("static", "dynamic")


class Drafter:
    """Proposes a token tree each step. Subclasses override `propose`; the hooks are optional.

    A drafter declares what it is; the decode loop, autotune, merges and export read these declarations
    and never look at its class:

    - `reads`: what it reads besides the text so far, a subset of READS: "states" (the target's outputs from
      `hidden` on at the newest token, via `take_states`), "path_states" (those outputs at every newly accepted
      position), "target_cache" (the target's KV cache: it writes its own entries in the scratch room past
      `cache.length`), "own_cache" (a KV cache of its own, rolled back by itself).
    - `trees`: the tree kinds `with_tree` accepts, a subset of TREES ("static": a Tree, "dynamic": a
      DynamicTreeSpec); () when it shapes its own trees (ngram). `max_tree_depth` / `max_siblings`: the deepest
      tree and the most candidates per node it can fill (None: no limit).
    - `graphs`: its parts that are captured graphs lowered by the backend (the rest is host-side Python);
      `light_graphs`: they are small next to the target (a head step, one layer): on ONNX Runtime they run on one
      thread, so the target's pool may keep spinning between its runs (backends.lower, `spin`);
      `forward_per_level`: it runs one forward per draft depth (autotune charges its propose time per level).
    - `options`: the JSON options that rebuild it (with its name and `tree`): what an engine manifest records.
    - `observe_optional`: skipping `observe` costs acceptance, never correctness: observe only learns from the
      target's outputs (Token Recycling's table) or does nothing, and whatever it needs of the text it reads from
      the context at its next `propose` (the n-gram and suffix indexes catch up on missed tokens there). A
      load-aware batch then skips it for a row whose drafter is switched off (runtime/budget.py `Budget.idle`), so
      that such a row pays no per-step upkeep. False (the default for a drafter that does not say): observe runs
      at every step.
    """

    name = "drafter"
    reads: tuple[str, ...] = ()
    trees: tuple[str, ...] = ()
    graphs: tuple[str, ...] = ()
    light_graphs = False
    forward_per_level = False
    max_tree_depth: int | None = None
    max_siblings: int | None = None
    max_positions: int | None = None  # the longest text it drafts for (a draft model's context); None: any
    tree = None
    options: dict = {}
    target_passes: tuple = ()  # passes it adds to the target graph (Medusa: head states at every token)
    observe_optional = False

    def begin(self, prompt: list[int]) -> None:
        """A new generation starts with `prompt`."""

    def propose(self, ctx: DraftContext) -> Draft:
        raise NotImplementedError

    def observe(self, draft: Draft, path: list[int], target_logits: torch.Tensor) -> None:
        """After verification: the accepted `path` and the target's logits [n, V] at every node."""

    def take_states(self, states: tuple) -> None:
        """The target's outputs from `hidden` on (hidden [H], then extra outputs of passes, e.g. Medusa
        head states [K, H]): with "states" in `reads` at the newest token (after the prefill its last prompt
        token, after a verification the last accepted node); with "path_states" at every newly accepted
        position ([m, H], ...: all prompt positions, then the accepted path root first)."""

    def with_tree(self, tree) -> "Drafter":
        """The same drafter (same graphs, heads, options, fresh state) drafting `tree`, a kind in `trees`."""
        raise TypeError(f"the {self.name} drafter shapes its own trees and takes no other tree")

    def fresh(self) -> "Drafter":
        """The same drafter (graphs, heads and options shared) with per-generation state of its own: one per row of
        a batch (speccomp/runtime/batch.py)."""
        if not self.trees:
            raise OptionError("drafter", self.name, "has no fresh(): a batch gives each row a copy of its own",
                              "define fresh() returning a copy with per-generation state of its own, or call generate "
                              "once per prompt")
        return self.with_tree(self.tree)

    def finish(self, text: list[int]) -> None:
        """A generation ended with `text`, its prompt and reply (`decode` returned, or a batch let the row go: done or
        cancelled, PackedBatch.remove): a drafter that learns across requests (suffix's memory) keeps it here.
        Nothing by default."""

    def describe(self) -> dict:
        """Its declaration as JSON: name, tree, options, reads, graphs."""
        tree = self.tree
        shape = tree.choices if isinstance(tree, Tree) else (None if tree is None else str(tree))
        return {"name": self.name, "tree": shape, "options": dict(self.options), "reads": list(self.reads),
                "graphs": list(self.graphs)}


def check_declaration(drafter: Drafter) -> None:
    """A Drafter given to compile declares what it reads, which trees it takes and which passes it adds to the target
    in the known words (before the capture)."""
    from speccomp.frontend.graph import Pass

    if hasattr(drafter, "wants_states"):
        raise OptionError("drafter", type(drafter).__name__, "sets wants_states, which speccomp no longer reads",
                          "declare reads = ('states',) for the newest token's outputs or ('path_states',) for every "
                          "accepted position's")
    if not isinstance(drafter.observe_optional, bool):
        raise OptionError("drafter", type(drafter).__name__, f"declares observe_optional={drafter.observe_optional!r}",
                          "declare True (skipping observe costs acceptance only) or False")
    for attr, known in (("reads", READS), ("trees", TREES)):
        value = getattr(drafter, attr)
        if not isinstance(value, tuple) or not set(value) <= set(known):
            raise OptionError("drafter", type(drafter).__name__, f"declares {attr}={value!r}",
                              f"declare a tuple of {list(known)}")
    passes = drafter.target_passes
    if not isinstance(passes, (tuple, list)) or not all(isinstance(p, Pass) for p in passes):
        raise OptionError("drafter", type(drafter).__name__, f"declares target_passes={passes!r}",
                          "declare a tuple of Pass instances, e.g. (MyPass(),)")


def check_tree_kind(drafter: Drafter, tree) -> None:
    """`tree` must be a kind the drafter declares in `trees` (a clear error naming the kinds it takes)."""
    from speccomp.errors import OptionError, OptionTypeError
    from speccomp.runtime.tree import DynamicTreeSpec

    kind = "static" if isinstance(tree, Tree) else "dynamic" if isinstance(tree, DynamicTreeSpec) else None
    if kind is None:
        raise OptionTypeError("tree", tree, f"must be a Tree or a DynamicTreeSpec, got {type(tree).__name__}")
    if kind not in drafter.trees:
        raise OptionError("tree", str(tree), f"the {drafter.name} drafter takes {' or '.join(drafter.trees) or 'no'} "
                          f"trees, not {kind} ones", "pass a choice list or an int k (a chain)" if drafter.trees
                          else "drop tree=")


ROOT_ONLY = Tree.from_parents((-1,))


def truncate(tree: Tree, max_depth: int, max_nodes: int) -> tuple[Tree, list[int]]:
    """The sub-tree of nodes with depth <= max_depth (and the first max_nodes of them), plus kept indices."""
    if tree.max_depth <= max_depth and tree.size <= max_nodes:  # the usual case: nothing to cut (decode loop)
        return tree, list(range(tree.size))
    return restrict(tree, [i for i, d in enumerate(tree.depth.tolist()) if d <= max_depth][:max_nodes])


def restrict(tree: Tree, keep: list[int]) -> tuple[Tree, list[int]]:
    """The sub-tree of the nodes `keep` (ascending, prefix-closed: every kept node's parent is kept), plus `keep`."""
    if len(keep) == tree.size:
        return tree, keep
    remap = {old: new for new, old in enumerate(keep)}
    parents = [-1] + [remap[tree.parents[i]] for i in keep[1:]]
    ranks = None if tree.ranks is None else [tree.ranks[i] for i in keep]
    return Tree.from_parents(parents, ranks), keep


class RootOnly(Drafter):
    """Drafts nothing: the loop verifies the root alone each step, which is plain decoding."""

    name = "plain"
    observe_optional = True  # nothing to observe

    def fresh(self) -> "RootOnly":
        return self  # no state

    def propose(self, ctx: DraftContext) -> Draft:
        return Draft(ROOT_ONLY, torch.tensor([ctx.tokens[-1]]))


def synchronize(device) -> None:
    """Wait for the device's queued work before reading a timer: CUDA runs asynchronously, so a timer around a
    forward times its launch (the step-cost curve and autotune's timings would call every tree nearly free)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def prefill(target, cache: KVCache, prompt: torch.Tensor):
    """The prompt through `target` (a causal tree mask), its KV appended to `cache`; the target's outputs."""
    n = prompt.shape[1]
    positions = torch.arange(n, device=prompt.device)[None]
    mask = torch.ones(1, n, dtype=torch.long, device=prompt.device)
    causal = torch.ones(n, n, dtype=torch.bool, device=prompt.device).tril()
    with torch.no_grad():
        outs = target(prompt, positions, mask, cache.past(), causal)
    cache.append(outs[1])
    return outs  # logits, new_kv, hidden, *extra outputs of passes


class FullCache:
    """The usual verifier: the target graph (after TreeAttention) over a full KVCache it owns. `cache` is what
    graph drafters read, and write their own entries into past `cache.length` (the next verify overwrites them)."""

    def __init__(self, target, kv: KVSpec, capacity: int, device):
        self.target, self.cache, self._new_kv = target, target_cache(target, kv, capacity, device), None

    def prefill(self, prompt: torch.Tensor) -> tuple:
        return prefill(self.target, self.cache, prompt)

    def verify(self, tokens: torch.Tensor, tree: Tree) -> tuple:
        """The target's outputs for the tree's nodes (logits [1, n, V] first); their KV waits for `commit`."""
        past, device = self.cache.length, self.cache.data.device
        mask = torch.ones(1, past + tree.size, dtype=torch.long, device=device)
        with torch.no_grad():
            outs = self.target(tokens[None].to(device), tree.positions(past, device), mask, self.cache.past(),
                               tree.mask.to(device))
        self._new_kv = outs[1]
        return outs

    def commit(self, path: list[int]) -> None:
        """Keep the KV of the accepted nodes (root first), in order."""
        self.cache.append(self._new_kv, keep=torch.tensor(path, device=self.cache.data.device))


def accept(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor, draft_probs, sampler: Sampler, acceptance: str):
    """(accepted path from the root, bonus token). acceptance="typical-lossy" (sampling only) is Medusa's typical
    acceptance: faster at high temperature, but the output no longer follows the model's distribution."""
    if acceptance == "typical-lossy":
        return typical_accept_lossy(tree, tokens, sampler.probs(logits), generator=sampler.generator)
    if sampler.do_sample:
        return sample_accept(tree, tokens, sampler.probs(logits), draft_probs, sampler.generator)
    return greedy_accept(tree, tokens, argmax(logits))


class Sequence(Generation):
    """One generation as the decode loops see it: its text, drafter, sampler and stats. `decode` (one sequence over a
    verifier) and runtime/batch.py's `Batch` (many, packed into one forward) drive the same steps:

        first(outs)               the prefill's outputs: the drafter begins, the first token is chosen
        draft(cache) -> Draft     what to verify next (the root alone on the last allowed token)
        accept(draft, outs)       the path the target accepts and the bonus token (held until `advance`)
        advance(draft, path, outs, idle) the drafter observes (unless idle allows it not to), the tokens are
                                  emitted, the stats counted
    """

    def __init__(self, prompt: list[int], drafter: Drafter, sampler: Sampler, max_new_tokens: int, eos,
                 max_tree: int, acceptance: str = "exact"):
        super().__init__(prompt, max_new_tokens, eos, max_tree)
        self.drafter, self.sampler, self.acceptance = drafter, sampler, acceptance
        self.stats = Stats()
        self._bonus = None
        # when the target samples (exact acceptance) a drafter may sample its drafts too
        self._drafts_sampler = sampler if sampler.do_sample and acceptance == "exact" else None

    def first(self, outs: tuple) -> None:
        """After the prefill: outs are the target's outputs over the prompt ([1, n, ...])."""
        self.drafter.begin(list(self.prompt))  # before take_states: a drafter may reset its state here
        _hand_states(self.drafter, outs, None)
        self.stats.steps = 1  # the prefill produced the first token
        self._vocab = outs[0].shape[-1]  # the ids a draft may hold (check_draft)
        self._emit([int(self.sampler(outs[0][0, -1]))])

    def draft(self, cache: KVCache, max_nodes: int | None = None) -> Draft:
        """`max_nodes`: a batch's cap for this row this step (Generation.room)."""
        room, cap = self.room(max_nodes)
        if room <= 1 or cap <= 1:  # the root alone: the drafter is asked for nothing (a batch's idle row each step)
            return Draft(ROOT_ONLY, torch.tensor([self.out[-1]]))
        # a copy: a drafter that appended to ctx.tokens shifted the text the loop emits into (wrong tokens, no error)
        ctx = DraftContext(list(self.context), cache, max_depth=room - 1, max_nodes=cap, sampler=self._drafts_sampler)
        draft = check_draft(self.drafter.propose(ctx), self.out[-1], self._vocab, self.drafter.name)
        tree, keep = truncate(draft.tree, ctx.max_depth, ctx.max_nodes)
        if len(keep) != draft.tree.size:
            draft = Draft(tree, draft.tokens[keep], None if draft.probs is None else draft.probs[keep])
        return draft

    def accept(self, draft: Draft, outs: tuple) -> list[int]:
        """The accepted path (root first) given the target's outputs over the draft's nodes ([1, n, ...])."""
        path, self._bonus = accept(draft.tree, draft.tokens, outs[0][0], draft.probs, self.sampler, self.acceptance)
        return path

    def observes(self, idle: bool) -> bool:
        """Whether `advance` hands the drafter this step: not where a batch's budget switched it off (`idle`) and its
        drafter declares that skipping costs acceptance only (`observe_optional`)."""
        return not (idle and self.drafter.observe_optional)

    def advance(self, draft: Draft, path: list[int], outs: tuple, idle: bool = False) -> None:
        """`idle`: a batch row whose drafter the budget switched off this step (it verified the root alone)."""
        if self.observes(idle):
            self.drafter.observe(draft, path, outs[0][0])
        _hand_states(self.drafter, outs, path)
        self.stats.steps += 1
        self.stats.record(draft.tree, path)
        self._emit(draft.tokens[path[1:]].tolist() + [int(self._bonus)])

    def _emit(self, tokens: list[int]) -> None:
        super()._emit(tokens)
        self.stats.new_tokens = len(self.out)


def check_draft(draft, root: int, vocab: int, name: str) -> Draft:
    """`draft` as `propose` returned it, refused unless the loop can verify it: a Draft of a Tree and a 1-D integer
    tensor of one token per node, the root first and equal to the last token emitted (a wrong root was verified as
    given: the target scored a text never emitted, and the output was not the model's), every id in the vocabulary,
    probs (if any) [nodes, vocab]. The built-in drafters pass it; a user's Drafter learns here what it got wrong."""
    def refuse(problem: str):
        from speccomp.errors import OptionError

        raise OptionError("drafter", name, f"proposed {problem}", "return Draft(tree, tokens) with tokens a long tensor "
                          "[tree.size], tokens[0] = ctx.tokens[-1] (see speccomp.runtime.decode.Draft)")

    if not isinstance(draft, Draft) or not isinstance(draft.tree, Tree):
        refuse(f"a {type(draft).__name__}, not a Draft of a speccomp Tree")
    tokens, n = draft.tokens, draft.tree.size
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() \
            or tokens.dtype == torch.bool or tokens.numel() != n:
        refuse(f"tokens {tokens!r} for a tree of {n} nodes, not a 1-D integer tensor of {n} ids")
    if int(tokens[0]) != root:
        refuse(f"a tree rooted at token {int(tokens[0])}; the root must be the last token emitted, {root}")
    lo, hi = (int(v) for v in torch.aminmax(tokens))
    if lo < 0 or hi >= vocab:
        refuse(f"token ids in [{lo}, {hi}], outside the vocabulary [0, {vocab})")
    if draft.probs is not None and tuple(draft.probs.shape) != (n, vocab):
        refuse(f"probs of shape {tuple(draft.probs.shape)}, not [{n}, {vocab}] (one distribution per node)")
    # ids in range, of a narrower integer type (int16, uint8, ...): the embedding takes long or int32 alone
    return draft if tokens.dtype in (torch.long, torch.int32) else Draft(draft.tree, tokens.long(), draft.probs)


def decode(verifier, drafter: Drafter, prompt: torch.Tensor, max_new_tokens: int, eos: set[int], sampler: Sampler,
           max_tree: int, acceptance: str = "exact") -> tuple[torch.Tensor, Stats]:
    """Decode up to `max_new_tokens` after `prompt` [1, n]: (new tokens [m], Stats). Lossless with
    acceptance="exact": greedy output is the target's greedy text, sampled output follows its distribution."""
    start = time.perf_counter()
    seq = Sequence(prompt[0].tolist(), drafter, sampler, max_new_tokens, eos, max_tree, acceptance)
    outs = verifier.prefill(prompt)
    seq.stats.prefill_seconds = time.perf_counter() - start
    seq.first(outs)
    while not seq.done:
        draft = seq.draft(verifier.cache)
        outs = verifier.verify(draft.tokens, draft.tree)
        path = seq.accept(draft, outs)
        verifier.commit(path)
        seq.advance(draft, path, outs)
    seq.finish()
    seq.stats.seconds = time.perf_counter() - start
    return torch.tensor(seq.out, dtype=torch.long, device=prompt.device), seq.stats


def _hand_states(drafter: Drafter, outs: tuple, path: list[int] | None) -> None:
    """The target's outputs from `hidden` on, for drafters that read them: at the newest token ("states"), or at
    every newly accepted position ("path_states"); path None: after the prefill (the prompt's positions)."""
    if "path_states" in drafter.reads:
        drafter.take_states(tuple(x[0] if path is None else x[0, path] for x in outs[2:]))
    elif "states" in drafter.reads:
        drafter.take_states(tuple(x[0, -1] if path is None else x[0, path[-1]] for x in outs[2:]))
