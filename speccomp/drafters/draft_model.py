"""A separate, smaller draft LM as the drafter (HF's `assistant_model`, the draft models of vLLM and SGLang).

    speccomp.compile(target, drafter=draft_lm)        # any model `speccomp.capture` accepts, same vocabulary
    speccomp.compile(target, drafter=draft_lm, tree=4)             # a chain of 4; or a choice list, "dynamic:B:K"
    speccomp.compile(target, drafter=draft_lm,                    # a draft with a tokenizer of its own
                     drafter_options={"draft_tokenizer": draft_tok, "target_tokenizer": target_tok})

The draft LM goes through the target's pipeline: captured by the same capture, rewritten by the same
TreeAttention pass, lowered by the same backend (its ONNX Runtime sessions do not spin, as every drafter
graph's). Its KV cache is its own runtime KVCache (one preallocated buffer; rejected drafts leave by
`length`), and each step it

  1. rolls its cache back to the longest prefix it shares with the text so far (what the target rejected
     last step leaves here),
  2. runs the text it has not seen, root last, in one causal forward (usually the tokens accepted last step
     and the new root): the root's top-k are the depth-1 candidates,
  3. grows the tree depth by depth as the self-drafters do (speccomp/drafters/grow.py: static trees and
     EAGLE-2 dynamic trees from its own log-probabilities), one forward per depth over that depth's expanded
     nodes, their KV in the scratch slots past the root (the next step's rollback drops them).

Greedy decoding is exact whatever it drafts: the target verifies. Greedy drafts are its top-k. When the
target samples (`generate(do_sample=True)`), a static tree's children are *sampled* from the draft's own
distribution q (the target's temperature, no top-p: every token stays possible), k siblings without
replacement, and the draft hands the loop the distribution each child was drawn from (q with its earlier
siblings removed): the multi-draft recursive rejection sampler (speccomp/runtime/tree.py `sample_accept`,
SpecInfer / Recursive Speculative Decoding) then accepts with min(1, p/q) and keeps the target's
distribution exactly. Dynamic trees keep top-k drafts when sampling: which candidates a dynamic tree keeps
depends on the drawn tokens, which the sampler's q would not describe; point masses are exact whatever the
drafts (q = 1).

With tokenizers of its own (`CrossTokenizerDrafter`, HF's universal assisted decoding), the text so far is
re-tokenized for the draft each step and its tree's paths are decoded to text and encoded with the target's tokenizer
(drafters/text_bridge.py, shared with the engine); those drafts are point masses under sampling too.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from speccomp.drafters.grow import ancestor_rows, grow, siblings_in_rank_order, torch_top
from speccomp.drafters.lookup import shared_prefix
from speccomp.drafters.text_bridge import TextBridge, as_tokenizer, check_vocabulary
from speccomp.errors import OptionError, OptionTypeError
from speccomp.runtime.decode import ROOT_ONLY, Draft, DraftContext, Drafter, KVCache, check_tree_kind
from speccomp.runtime.tree import DynamicTreeSpec, Tree, max_tree_nodes

DEFAULT_TREE = DynamicTreeSpec(16, 4)  # as the self-drafters: autotune or tree= pick another
START_CAPACITY = 512  # cache slots at the start of a generation; doubled when a longer text needs more


class _DraftLM(Drafter):
    """What a draft model declares (decode.py's Drafter protocol), with its target's tokenizer or its own."""

    name = "draft_model"
    reads = ("own_cache",)
    trees = ("static", "dynamic")
    graphs = ("draft",)
    forward_per_level = True
    observe_optional = True  # no observe: it catches up on the text at its next propose


class DraftModelDrafter(_DraftLM):

    def __init__(self, step, graph, tree=DEFAULT_TREE, options: dict | None = None):
        self.step, self.graph, self.tree = step, graph, tree
        check_tree_kind(self, tree)
        # a static tree it may sample when the target samples
        self._ordered = isinstance(tree, Tree) and siblings_in_rank_order(tree.parents, tree.ranks)
        self.max_nodes = max_tree_nodes(graph.structure)  # its own sliding windows may hold fewer nodes
        self.options = dict(options or {})
        self.kv = graph.captured.kv
        self.max_positions = graph.captured.max_positions  # generate refuses longer texts up front (check_context)
        weight = next(iter(graph.gm.parameters()), None)
        self.device = weight.device if weight is not None else torch.device("cpu")
        self.cache, self.cached = None, []  # cached: the tokens whose KV is valid in cache[0, length)

    def with_tree(self, tree) -> "DraftModelDrafter":
        return DraftModelDrafter(self.step, self.graph, tree, self.options)

    def begin(self, prompt: list[int]) -> None:
        self.cache, self.cached = KVCache(self.kv, max(START_CAPACITY, 2 * len(prompt)), self.device), []

    def _reserve(self, slots: int) -> None:
        """Room for `slots` positions: a bigger buffer (the valid part copied) when the text outgrew this one."""
        if slots > self.cache.capacity:
            bigger = KVCache(self.kv, max(slots, 2 * self.cache.capacity), self.device)
            bigger.append(self.cache.past())
            self.cache = bigger

    def _run(self, tokens: list[int], positions: torch.Tensor, past: int, mask: torch.Tensor) -> torch.Tensor:
        """`tokens` after `past` cached slots (tree mask [k, k'] over the last k' of those slots and the tokens);
        their KV written at [past, past + k). Logits [k, V]."""
        k = len(tokens)
        with torch.no_grad():
            outs = self.step(torch.tensor([tokens], device=self.device), positions[None],
                             torch.ones(1, past + k, dtype=torch.long, device=self.device),
                             self.cache.data[..., :past, :], mask)
        self.cache.data[..., past : past + k, :] = outs[1]
        return outs[0][0]

    def level_forward(self, cache, base: int, tokens) -> None:
        """One draft level, as autotune's time_steps times it per width: `tokens`, children of a root at `base`, scored
        over `base` + 1 slots of the draft's own cache (`cache`, the target's, is not its; what the slots hold does not
        change a timing, so a fresh buffer's zeros serve)."""
        k = len(tokens)
        if self.cache is None:
            self.begin([])
        self._reserve(base + 1 + k)
        rows = torch.cat([torch.ones(k, 1, dtype=torch.bool), torch.eye(k, dtype=torch.bool)], 1)  # root + itself
        self._run([int(t) for t in tokens], torch.full((k,), base + 1, device=self.device), base + 1,
                  rows.to(self.device))
        self.cached = []  # its cache no longer holds a text: the next propose starts from scratch

    def propose(self, ctx: DraftContext) -> Draft:
        ctx = dataclasses.replace(ctx, max_nodes=min(ctx.max_nodes, self.max_nodes))
        tokens = ctx.tokens
        base = len(tokens) - 1  # the root's position; every earlier token is committed text
        start = shared_prefix(self.cached, tokens[:-1])  # rejected drafts of the last step leave here
        self.cache.length = start
        self._reserve(base + ctx.max_nodes + 1)
        slot: dict[int, int] = {}  # candidate -> its scratch slot past `base` (the root's is 0)
        sampled = ctx.sampler is not None and self._ordered  # else top-k drafts: point masses, exact too
        drawn: dict[tuple[int, int], torch.Tensor] = {}  # (node, rank) -> the distribution that child was drawn from

        def top(logits: torch.Tensor, nodes: list[int], k: int):
            if not sampled:
                return torch_top(logits, k)
            return None, sample_children(logits, ctx.sampler.temperature, nodes, k, drawn, ctx.sampler.generator)

        def expand(d: int, nodes: list[int], grown, k: int):
            if d == 0:  # the unseen text, root last, in one causal forward: the root's row scores depth 1
                n = base + 1 - start
                logits = self._run(tokens[start:], torch.arange(start, base + 1, device=self.device), start,
                                   torch.ones(n, n, dtype=torch.bool, device=self.device).tril())[-1:]
                self.cache.length, self.cached, slot[0] = base, list(tokens[:-1]), 0
                return top(logits, nodes, k)
            used = len(slot)
            if used + len(nodes) > ctx.max_nodes:  # the tree must fit where the target's does
                return None
            rows = torch.tensor(ancestor_rows(nodes, grown, slot, used), device=self.device)
            positions = torch.full((len(nodes),), base + d, dtype=torch.long, device=self.device)
            logits = self._run([grown.token[c] for c in nodes], positions, base + used, rows)
            return top(logits, nodes, k)

        draft = grow(self.tree, ctx, expand)
        if sampled and draft.tree.size > 1:
            tree = draft.tree
            rows = [drawn[(tree.parents[c], tree.ranks[c])] for c in range(1, tree.size)]
            draft.probs = torch.stack([torch.full_like(rows[0], 1 / rows[0].numel())] + rows)  # row 0: unused
        return draft


def sample_children(logits: torch.Tensor, temperature: float, nodes: list[int], k: int, drawn: dict,
                    generator) -> list[list[int]]:
    """k children of each node in `nodes`, drawn in order without replacement from q = softmax(logits / temperature)
    (float64, on the CPU where the sampler's generator lives); drawn[(node, r)] = the distribution the rank-r child
    was drawn from: q with ranks 0..r-1 removed, renormalised. Where q has fewer than k tokens it can draw, the
    remaining ranks are the likeliest others as point masses (one-hot rows: exact as deterministic drafts are)."""
    x = logits.detach().to("cpu", torch.float64)
    q = torch.softmax((x - x.amax(-1, keepdim=True)) / temperature, dim=-1)  # shifted: no overflow near 0 (warp)
    out = []
    for i, u in enumerate(nodes):
        row = q[i].clone()
        m = min(k, int((row > 0).sum()))
        ids = torch.multinomial(row, m, replacement=False, generator=generator).tolist()
        if m < k:  # fill with the likeliest tokens not drawn, as point masses
            order = logits[i].detach().cpu().argsort(descending=True).tolist()
            taken = set(ids)
            ids += [t for t in order if t not in taken][: k - m]
        for r, t in enumerate(ids):
            if r < m:
                drawn[(u, r)] = row / row.sum()
                row[t] = 0.0
            else:
                drawn[(u, r)] = torch.nn.functional.one_hot(torch.tensor(t), q.shape[-1]).double()
        out.append(ids)
    return out


class CrossTokenizerDrafter(_DraftLM):
    """A draft model with a tokenizer of its own (drafters/text_bridge.py): the text so far re-tokenized for it, its
    tree (grown in its own tokens by `inner`, a DraftModelDrafter) mapped path by path into target tokens. Its drafts
    are point masses (q = 1): exact under sampling as under greedy decoding. The engine's twin is engine/runtime.py's
    _CrossTokenizer."""

    def __init__(self, inner: DraftModelDrafter, bridge):
        self.inner, self.bridge, self.tree = inner, bridge, inner.tree
        self.options = {"tokenizers": "own"}  # the engine writes both tokenizers beside draft_model.onnx

    def with_tree(self, tree) -> "CrossTokenizerDrafter":
        return CrossTokenizerDrafter(self.inner.with_tree(tree), self.bridge)

    def begin(self, prompt: list[int]) -> None:
        self.inner.begin(self.bridge.to_draft(prompt))

    def level_forward(self, cache, base: int, tokens) -> None:
        """The draft's level as autotune times it (DraftModelDrafter.level_forward); `tokens` are the target's ids,
        which the draft's vocabulary may not hold: a timing does not depend on which ids, so they are folded into it."""
        self.inner.level_forward(cache, base, [int(t) % self.inner.graph.captured.vocab_size for t in tokens])

    def propose(self, ctx: DraftContext) -> Draft:
        room = min(ctx.max_nodes, self.inner.max_nodes)
        context, depth = self.bridge.context(ctx.tokens, ctx.max_depth, self.inner.max_positions)
        if depth < 1:
            return Draft(ROOT_ONLY, torch.tensor([ctx.tokens[-1]]))
        inner = self.inner.propose(dataclasses.replace(ctx, tokens=context, max_depth=depth, max_nodes=room,
                                                       sampler=None))
        parents, tokens = self.bridge.target_tree(ctx.tokens, context, list(inner.tree.parents),
                                                  inner.tokens.tolist(), ctx.max_depth, ctx.max_nodes)
        return Draft(Tree.from_parents(parents), torch.tensor(tokens))


def check_draft_model_options(options: dict | None) -> None:
    """A draft model takes no options but its tokenizers, given together (checked before a model is loaded)."""
    options = options or {}
    unknown = sorted(set(options) - {"draft_tokenizer", "target_tokenizer"})
    if unknown:
        raise OptionError("drafter_options", unknown, "a draft model takes only draft_tokenizer and target_tokenizer "
                          "(a draft with a tokenizer of its own)", "drop the other options")
    if len(options) == 1:
        raise OptionError("drafter_options", sorted(options), "a draft with a tokenizer of its own needs both "
                          "draft_tokenizer and target_tokenizer", "pass both (or neither for a shared tokenizer)")
    for param, tok in options.items():
        as_tokenizer(tok, param)


def make_draft_model(base, draft, options: dict | None, tree, backend: str):
    """The drafter for `draft` (an nn.Module LM or a `speccomp.capture` result) beside the target `base`
    (a SpecGraph): captured, TreeAttention, lowered by `backend`; its vocabulary checked against the target's, or,
    given both tokenizers in `options`, against its own tokenizer (a CrossTokenizerDrafter)."""
    from speccomp.backends import lower
    from speccomp.frontend import capture
    from speccomp.frontend.convention import CapturedModel
    from speccomp.frontend.graph import SpecGraph, run_passes
    from speccomp.passes.tree_attention import TreeAttention
    from speccomp.runtime.tree import check_tree_width, tree_option

    check_draft_model_options(options)
    bridge = None
    if options:
        bridge = TextBridge(as_tokenizer(options["target_tokenizer"], "target_tokenizer"),
                            as_tokenizer(options["draft_tokenizer"], "draft_tokenizer"))
    captured = draft.copy() if isinstance(draft, CapturedModel) else capture(draft)
    target_vocab, draft_vocab = base.captured.vocab_size, captured.vocab_size
    if bridge is not None:
        check_vocabulary(bridge.target, target_vocab, "target_tokenizer", "target")
        check_vocabulary(bridge.draft, draft_vocab, "draft_tokenizer", "draft")
    elif draft_vocab != target_vocab:
        raise OptionError("drafter", f"{type(draft).__name__} ({draft_vocab} tokens)",
                          f"the draft model's vocabulary has {draft_vocab} tokens and the target's {target_vocab}: "
                          "without its tokenizers a draft model must share the target's (its token ids are the target's)",
                          "pass drafter_options={'draft_tokenizer': ..., 'target_tokenizer': ...} (drafts go through "
                          "text), or use a draft model of the target's family")
    spec = DEFAULT_TREE if tree is None else tree_option(tree)  # tree="auto" was resolved by compile (autotune.py)
    check_tree_width(spec, draft_vocab, "draft model", tree)
    sg = run_passes(SpecGraph.from_captured(captured), [TreeAttention()])
    try:
        step = lower(sg, backend, spin=False)
    except OptionError as e:  # a backend's dtype / device rule, met by the target (lowered first) but not its draft
        weight = next(iter(base.gm.parameters()), None)
        device = "" if weight is None else f", device='{weight.device}'"
        raise OptionError("drafter", f"{type(draft).__name__} ({captured.kv.dtype})",
                          f"the draft model cannot run on backend={backend!r}: {e.problem}",
                          f"pass the draft as the target is, drafter=draft.to({base.captured.kv.dtype}{device})") from e
    drafter = DraftModelDrafter(step, sg, spec)
    return drafter if bridge is None else CrossTokenizerDrafter(drafter, bridge)


# ---- drafter="draft_model": the draft `speccomp train-draft` made (speccomp/tuning/train_draft.py) ----------------
def make_named_draft_model(base, options: dict, tree, backend: str):
    """drafter="draft_model": the draft trained for the target (`load_draft`), or the Hugging Face checkpoint directory
    at `path`. Options: path; with a tokenizer of its own, draft_tokenizer and target_tokenizer too (tokenizer objects
    or tokenizer.json paths, as the CLI passes them)."""
    options = dict(options)
    path = options.pop("path", None)
    tokenizers = {k: options.pop(k) for k in ("draft_tokenizer", "target_tokenizer") if k in options}
    if options:
        raise OptionError("drafter_options", sorted(options), "draft_model takes only path (a trained draft's or a "
                          "Hugging Face checkpoint's directory) and, for a draft with a tokenizer of its own, "
                          "draft_tokenizer and target_tokenizer", "drop the other options")
    check_draft_model_options(tokenizers)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise OptionTypeError("path", path, f"must be a draft's directory, got {type(path).__name__}",
                              "e.g. drafter_options={'path': 'my-draft/'}")
    from speccomp.tuning.train_draft import load_draft

    drafter = make_draft_model(base, load_draft(base.model, path), tokenizers or None, tree, backend)
    drafter.options = {**drafter.options, **({} if path is None else {"path": str(path)})}
    return drafter
