"""Token trees and lossless acceptance.

A step of tree speculation feeds the target one flat batch of n tokens laid out as a tree:

    node 0        the root: the last token already decided (its KV is not in the cache yet)
    nodes 1..n-1  draft tokens; node i continues the text of its parent parents[i] < i

Every node attends to its ancestors and itself (`Tree.mask`) and sits at position
past_len + depth (`Tree.positions`), so one target forward scores every root-to-leaf
path at once. The target's output at node u is its prediction for a child of u.

Acceptance then walks down from the root:
  * `greedy_accept`: follow the child whose token is the target's argmax (exact match
    with greedy decoding).
  * `sample_accept`: multi-draft recursive rejection sampling (SpecInfer), whose emitted
    tokens are distributed exactly as sampling from the target one token at a time.

Either returns `path` (accepted nodes, starting with the root 0) plus one token the target
chose itself (the "bonus"); emitted tokens are tokens[path[1:]] + [bonus], the KV entries to
keep are those of `path`, and the bonus becomes the next step's root.

Trees come from Medusa-style choice lists (`[[0], [1], [0, 0]]`: each node is the path of
sibling ranks from the root), chains, or parent arrays; `parse_tree_spec` maps the user-facing
`tree=` argument to one of those, or to a request for a dynamic / automatically chosen tree.
"""
from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from speccomp.errors import OptionError, OptionTypeError, SpeccompError

DEFAULT_DYNAMIC_BUDGET = 16
DEFAULT_DYNAMIC_TOP_K = 4


class TreeError(SpeccompError, ValueError):
    """A token tree or tree spec is malformed (the message names the problem and the fix)."""


class TreeSizeError(TreeError):
    """A token tree or tree spec holds more nodes than fit (checked before any tree is built)."""


class TreeTypeError(TreeError, TypeError):
    """A token tree or tree spec holds a value of the wrong type (a float rank, a dict for a tree)."""


def _as_int(x, what: str) -> int:
    """`x` as a Python int; bools, floats and strings are refused (they are always a mistake here)."""
    if isinstance(x, bool):
        raise TreeTypeError(f"{what} must be an int, got bool {x!r}; use plain integers")
    try:
        return operator.index(x)  # int, numpy ints, 0-d integer tensors
    except TypeError:
        raise TreeTypeError(f"{what} must be an int, got {type(x).__name__} {x!r}; use plain integers") from None


def _seq(x, what: str) -> tuple:
    """A list / tuple / 1-d tensor as a tuple (its entries are checked by Tree)."""
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if isinstance(x, (str, bytes)) or not isinstance(x, (list, tuple)):
        raise TreeTypeError(f"{what} must be a list of ints, got {type(x).__name__} {x!r}")
    return tuple(x)


def _check_size(size: int, max_nodes: int) -> None:
    max_nodes = _as_int(max_nodes, "max_nodes")
    if size > max_nodes:
        raise TreeSizeError(
            f"token tree has {size} nodes (root + {size - 1} drafts) but at most {max_nodes} fit; "
            "use a smaller tree (fewer choices / a shorter chain / a smaller dynamic budget)"
        )


# --------------------------------------------------------------------------------------------
# Tree
# --------------------------------------------------------------------------------------------


def _check_parents(parents: tuple[int, ...]) -> tuple[int, ...]:
    """A parent array: the root first (-1), then every node's parent before it."""
    n = len(parents)
    if n == 0:
        raise TreeError("empty tree: a tree needs at least the root node (parents=[-1])")
    if parents[0] != -1:
        raise TreeError(f"parents[0] must be -1 (node 0 is the root), got {parents[0]}")
    for i in range(1, n):
        if parents[i] == -1:
            raise TreeError(f"node {i} has parent -1 but only node 0 may be the root; give it a parent in 0..{i - 1}")
        if not 0 <= parents[i] < i:
            raise TreeError(
                f"parents not topological: parents[{i}] = {parents[i]} but must be in 0..{i - 1}; "
                "order nodes so that every parent comes before its children"
            )
    return parents


def _ranks(children: list[list[int]], given) -> tuple[int, ...]:
    """Sibling ranks: `given` checked (one per node, root 0, distinct among siblings), or the order of appearance."""
    n = len(children)
    if given is None:
        ranks = [0] * n
        for kids in children:
            for r, c in enumerate(kids):
                ranks[c] = r
        return tuple(ranks)
    ranks = tuple(_as_int(r, f"ranks[{i}]") for i, r in enumerate(_seq(given, "ranks")))
    if len(ranks) != n:
        raise TreeError(f"ranks has {len(ranks)} entries but the tree has {n} nodes; give one rank per node")
    if ranks[0] != 0:
        raise TreeError(f"ranks[0] must be 0 (the root has no siblings), got {ranks[0]}")
    for i, r in enumerate(ranks):
        if r < 0:
            raise TreeError(f"negative rank {r} at node {i}; ranks are 0-based sibling indices (top-k slots)")
    for u, kids in enumerate(children):
        seen = {}
        for c in kids:
            if ranks[c] in seen:
                raise TreeError(
                    f"duplicate nodes: nodes {seen[ranks[c]]} and {c} are both child rank {ranks[c]} of node {u}; "
                    "give each sibling a distinct rank"
                )
            seen[ranks[c]] = c
    return ranks


def _paths(parents, children, depth) -> torch.Tensor:
    """Root-to-leaf paths [leaves, max_depth + 1], -1 padded (built as lists: the decode loop builds trees every
    step, and a torch element write costs microseconds)."""
    rows, width = [], max(depth) + 1
    for leaf in (i for i in range(len(parents)) if not children[i]):
        row, j = [-1] * width, leaf
        while j != -1:
            row[depth[j]] = j
            j = parents[j]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long)


@dataclass(frozen=True)
class Tree:
    """A token tree of `size` nodes in topological order (see the module docstring).

    Only `parents` and `ranks` define the tree (and take part in == / hash); everything
    else is derived once in __post_init__ so the decode loop never recomputes it.
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...] | None = None  # rank among siblings (top-k index); None: order of appearance
    # derived
    size: int = field(init=False, compare=False)
    depth: torch.Tensor = field(init=False, compare=False, repr=False)  # long [n], root 0
    mask: torch.Tensor = field(init=False, compare=False, repr=False)  # bool [n, n]: j ancestor-or-self of i
    children: list = field(init=False, compare=False, repr=False)  # children[u]: child nodes, in node order
    max_depth: int = field(init=False, compare=False, repr=False)
    paths: torch.Tensor = field(init=False, compare=False, repr=False)  # long [leaves, max_depth+1], -1 pad

    def __post_init__(self):
        parents = _check_parents(tuple(_as_int(p, f"parents[{i}]") for i, p in enumerate(_seq(self.parents, "parents"))))
        n = len(parents)
        children = [[] for _ in range(n)]
        for i in range(1, n):
            children[parents[i]].append(i)
        ranks = _ranks(children, self.ranks)
        depth = [0] * n
        mask = np.eye(n, dtype=bool)  # numpy rows: a torch row op per node cost a tree of 20 nodes ~0.1 ms
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
            mask[i] |= mask[parents[i]]  # topological order: the parent's row is already complete
        set_ = object.__setattr__  # frozen dataclass: fill the derived fields once
        set_(self, "parents", parents)
        set_(self, "ranks", ranks)
        set_(self, "size", n)
        set_(self, "depth", torch.tensor(depth, dtype=torch.long))
        set_(self, "mask", torch.from_numpy(mask))
        set_(self, "children", children)
        set_(self, "max_depth", max(depth))
        set_(self, "paths", _paths(parents, children, depth))

    # ---- constructors ---------------------------------------------------------------------

    @classmethod
    def from_parents(cls, parents, ranks=None, max_nodes: int | None = None) -> "Tree":
        """From a parent array (parents[0] == -1, parents[i] < i) and optional sibling ranks."""
        parents = _seq(parents, "parents")
        if max_nodes is not None:
            _check_size(len(parents), max_nodes)  # before the [n, n] mask is built
        return cls(parents, None if ranks is None else _seq(ranks, "ranks"))

    @classmethod
    def from_choices(cls, choices, max_nodes: int | None = None) -> "Tree":
        """From a Medusa-style choice list: each choice is the path of sibling ranks from the root.

        Nodes are ordered like Medusa's `sorted(choices, key=lambda x: (len(x), x))`: by depth,
        then lexicographically, so node i + 1 is the i-th choice in that order.
        """
        if isinstance(choices, (str, bytes)) or not isinstance(choices, (list, tuple)):
            raise TreeTypeError(
                f"tree choices must be a list of lists of ints like [[0], [1], [0, 0]], got {type(choices).__name__}"
            )
        if len(choices) == 0:
            raise TreeError("empty tree: the choice list has no draft nodes; give at least one choice, e.g. [[0]]")
        if max_nodes is not None:
            _check_size(len(choices) + 1, max_nodes)
        paths = []
        for k, choice in enumerate(choices):
            if isinstance(choice, (str, bytes)) or not isinstance(choice, (list, tuple)):
                raise TreeTypeError(f"choice {k} must be a list of ints like [0, 1], got {type(choice).__name__} {choice!r}")
            if len(choice) == 0:
                raise TreeError(f"choice {k} is empty; the root is implicit, list only draft nodes like [0]")
            path = tuple(_as_int(r, f"choice {k} ({list(choice)!r}) entry") for r in choice)
            if any(r < 0 for r in path):
                raise TreeError(f"negative rank in choice {list(path)}; ranks are 0-based top-k indices")
            paths.append(path)
        seen = set()
        for p in paths:
            if p in seen:
                raise TreeError(f"duplicate choice {list(p)}; list each node once")
            seen.add(p)
        paths.sort(key=lambda p: (len(p), p))
        index = {(): 0}
        for i, p in enumerate(paths, start=1):
            if p[:-1] not in index:
                raise TreeError(
                    f"orphan choice {list(p)}: its parent {list(p[:-1])} is not in the tree; add {list(p[:-1])} as well"
                )
            index[p] = i
        parents = (-1,) + tuple(index[p[:-1]] for p in paths)
        ranks = (0,) + tuple(p[-1] for p in paths)
        return cls.from_parents(parents, ranks, max_nodes=max_nodes)

    @classmethod
    def chain(cls, k: int, max_nodes: int | None = None) -> "Tree":
        """Root plus k draft nodes in a line (classic speculative decoding with k drafts)."""
        k = _as_int(k, "chain length")
        if k < 1:
            raise TreeError(f"empty tree: a chain needs k >= 1 draft tokens, got {k}")
        if max_nodes is not None:
            _check_size(k + 1, max_nodes)
        return cls.from_parents((-1,) + tuple(range(k)), max_nodes=max_nodes)

    # ---- queries --------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.size

    @property
    def choices(self) -> list[list[int]]:
        """The Medusa-style choice list of this tree (inverse of `from_choices`, root omitted)."""
        paths = [()] * self.size
        for i in range(1, self.size):
            paths[i] = paths[self.parents[i]] + (self.ranks[i],)
        return [list(p) for p in paths[1:]]

    def positions(self, past_len: int, device=None) -> torch.Tensor:
        """position_ids [1, n] of the tree's tokens when `past_len` tokens are already cached."""
        return (past_len + self.depth).unsqueeze(0).to(device)

    def full_mask(self, past_len: int, device=None) -> torch.Tensor:
        """Boolean attention mask [n, past_len + n]: every node sees the whole cache plus its ancestors."""
        past = torch.ones(self.size, past_len, dtype=torch.bool)
        return torch.cat([past, self.mask], dim=1).to(device)

    def _check_max(self, max_nodes: int) -> None:
        _check_size(self.size, max_nodes)

    def check_fits(self, context_left: int) -> "Tree":
        """Raise unless the whole tree fits in the `context_left` positions the model has left."""
        context_left = _as_int(context_left, "context_left")
        if self.size > context_left:
            raise TreeError(
                f"token tree has {self.size} nodes but only {context_left} positions are left in the model's context; "
                "use a smaller tree, a shorter prompt or fewer max_new_tokens"
            )
        return self


# --------------------------------------------------------------------------------------------
# Tree specs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DynamicTreeSpec:
    """Ask for a tree grown per step from draft confidences: `budget` draft nodes (root not counted),
    expanding at most `top_k` children per node."""

    budget: int = DEFAULT_DYNAMIC_BUDGET
    top_k: int = DEFAULT_DYNAMIC_TOP_K

    def __str__(self) -> str:
        return f"dynamic:{self.budget}:{self.top_k}"  # the tree= string that asks for it


@dataclass(frozen=True)
class AutoTreeSpec:
    """Ask speccomp to pick the tree (e.g. by measuring acceptance and step cost)."""


_SPEC_FORMS = (
    "a Medusa-style choice list like [[0], [1], [0, 0]], an int k >= 1 (a chain of k drafts), "
    "'dynamic', 'dynamic:BUDGET' (or 'dynamic:BUDGET:TOPK'), or 'auto'"
)


def _positive(text: str, what: str, spec) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TreeError(f"bad tree spec {spec!r}: {what} {text!r} is not an int; accepted forms: {_SPEC_FORMS}") from None
    if value < 1:
        raise TreeError(f"bad tree spec {spec!r}: {what} must be >= 1, got {value}")
    return value


def parse_tree_spec(spec, max_nodes: int | None = None):
    """The user-facing `tree=` argument as a `Tree`, `DynamicTreeSpec` or `AutoTreeSpec`.

    Strings from a command line are accepted too: "4" is a chain and "[[0],[1]]" a choice list.
    `max_nodes` (e.g. the model context) bounds the tree size, root included.
    """
    if isinstance(spec, Tree):
        if max_nodes is not None:
            spec._check_max(max_nodes)
        return spec
    if isinstance(spec, AutoTreeSpec):
        return spec
    if isinstance(spec, DynamicTreeSpec):
        budget, top_k = _as_int(spec.budget, "dynamic budget"), _as_int(spec.top_k, "dynamic top_k")
        if budget < 1 or top_k < 1:
            raise TreeError(f"dynamic tree needs budget >= 1 and top_k >= 1, got budget={budget}, top_k={top_k}")
    elif isinstance(spec, bool):
        raise TreeTypeError(f"bad tree spec {spec!r}; accepted forms: {_SPEC_FORMS}")
    elif isinstance(spec, int) or (getattr(spec, "ndim", None) == 0 and "int" in str(getattr(spec, "dtype", ""))):
        return Tree.chain(spec, max_nodes=max_nodes)  # an int, a numpy int, a 0-d integer tensor
    elif isinstance(spec, (list, tuple)):
        return Tree.from_choices(spec, max_nodes=max_nodes)
    elif isinstance(spec, str):
        text = spec.strip().lower()
        if text == "auto":
            return AutoTreeSpec()
        if text.startswith("["):
            try:
                choices = json.loads(text)
            except json.JSONDecodeError as e:
                raise TreeError(f"bad tree spec {spec!r}: not a valid choice list ({e}); accepted forms: {_SPEC_FORMS}") from None
            return Tree.from_choices(choices, max_nodes=max_nodes)
        if text.isdecimal() and text.isascii():
            return Tree.chain(int(text), max_nodes=max_nodes)
        name, sep, rest = text.partition(":")
        if name != "dynamic":
            raise TreeError(f"bad tree spec {spec!r}; accepted forms: {_SPEC_FORMS}")
        parts = rest.split(":") if sep else []  # "dynamic:" is an error, not the default
        if len(parts) > 2:
            raise TreeError(f"bad tree spec {spec!r}; accepted forms: {_SPEC_FORMS}")
        budget = _positive(parts[0], "budget", spec) if len(parts) >= 1 else DEFAULT_DYNAMIC_BUDGET
        top_k = _positive(parts[1], "top_k", spec) if len(parts) == 2 else DEFAULT_DYNAMIC_TOP_K
        spec = DynamicTreeSpec(budget, top_k)
    else:
        raise TreeTypeError(f"bad tree spec {spec!r} of type {type(spec).__name__}; accepted forms: {_SPEC_FORMS}")
    if max_nodes is not None and spec.budget + 1 > max_nodes:
        raise TreeSizeError(
            f"dynamic tree budget {spec.budget} (+ root) exceeds the {max_nodes} nodes that fit; use 'dynamic:{max(max_nodes - 1, 1)}' or less"
        )
    return spec


# --------------------------------------------------------------------------------------------
# Acceptance
# --------------------------------------------------------------------------------------------


def _check_tokens(tree: Tree, tokens: torch.Tensor, name: str = "tokens") -> list[int]:
    if tokens.dim() != 1 or tokens.shape[0] != tree.size:
        raise ValueError(f"{name} must have shape [{tree.size}] (one token per tree node), got {tuple(tokens.shape)}")
    return tokens.tolist()


def greedy_accept(tree: Tree, tokens: torch.Tensor, target_tokens: torch.Tensor) -> tuple[list[int], int]:
    """Longest root-to-node path the target's argmax agrees with.

    tokens        long [n]  token of each node (tokens[0] = root token)
    target_tokens long [n]  target argmax at each node = its choice for that node's child
    Returns (path, bonus): accepted nodes starting at the root, and the target's token after them.
    """
    toks = _check_tokens(tree, tokens)
    want = _check_tokens(tree, target_tokens, "target_tokens")
    path, u = [0], 0
    while True:
        t = want[u]
        # First matching child; a later sibling with the same token would score the same context.
        nxt = next((c for c in tree.children[u] if toks[c] == t), None)
        if nxt is None:
            return path, t
        path.append(nxt)
        u = nxt


_TINY = 1e-12  # residual mass below this is float noise: the rejection that produced it "could not happen"


def sample_accept(
    tree: Tree,
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Multi-draft recursive rejection sampling: emitted tokens are distributed exactly as the target's.

    tokens       long [n]      token of each node (tokens[0] = root token)
    target_probs float [n, V]  target distribution (already warped) for the child of each node
    draft_probs  float [n, V]  draft_probs[c] = distribution child c's token was drawn from, given its
                               parent's context and the siblings drawn before it (row 0 unused);
                               None: deterministic drafts (point masses), e.g. top-k trees
    Returns (path, next_token): accepted nodes starting at the root, and one token sampled by the target
    after the last of them.

    At node u with residual p (initially target_probs[u]) each child c in order is accepted with
    probability min(1, p(x_c) / q_c(x_c)); a rejection replaces p with normalize(max(p - q_c, 0)).
    Whatever the children were, the token that leaves u is distributed as target_probs[u]: the
    accepted mass is min(p, q_c) and the rejected mass (1 - sum min(p, q_c)) times the new
    residual is max(p - q_c, 0), which add up to p. If no child survives, the token is drawn
    from the last residual. Siblings that repeat a token are fine: for point masses the residual
    already gives that token 0, so the repeat is rejected.

    draft_probs=None is lossless for any tokens (fixed before this call), however they were drafted;
    passing draft_probs gives higher acceptance when the drafter *sampled* its tokens. Passing
    draft_probs for tokens the drafter picked deterministically (argmax / top-k) is NOT lossless.
    """
    toks = _check_sample_args(tree, tokens, target_probs, draft_probs)
    coins = torch.rand(tree.size, generator=generator, dtype=torch.float64).tolist()  # one per node, drawn up front
    path, u = [0], 0
    while True:
        accepted, p = _first_accepted(tree.children[u], toks, _row(target_probs, u), draft_probs, coins)
        if accepted is None:  # no child survived: the token leaving u is drawn from the last residual
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(accepted)
        u = accepted


def _check_sample_args(tree: Tree, tokens, target_probs, draft_probs) -> list[int]:
    toks = _check_tokens(tree, tokens)
    n = tree.size
    if target_probs.dim() != 2 or target_probs.shape[0] != n:
        raise ValueError(f"target_probs must have shape [{n}, V], got {tuple(target_probs.shape)}")
    V = target_probs.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (n, V):
        raise ValueError(f"draft_probs must have shape [{n}, {V}] like target_probs, got {tuple(draft_probs.shape)}")
    bad = [i for i, t in enumerate(toks) if not 0 <= t < V]
    if bad:
        raise ValueError(f"tokens at nodes {bad} are outside the vocabulary [0, {V})")
    return toks


def _row(probs: torch.Tensor, i: int) -> torch.Tensor:
    r = probs[i].detach().to("cpu", torch.float64)  # float64: residuals subtract close numbers
    s = float(r.sum())
    if not s > 0:
        raise ValueError(f"row {i} of the probabilities has no mass (sum {s}); pass warped probabilities, not logits")
    return r / s


def _first_accepted(children: list[int], toks: list[int], p: torch.Tensor, draft_probs, coins: list[float]):
    """Test `children` in order against the residual `p`: (the first accepted child or None, the last residual)."""
    for c in children:
        x = toks[c]
        if draft_probs is None:
            # q = point mass on x: accept with p(x); residual = p without x.
            if coins[c] < float(p[x]):
                return c, p
            residual = p.clone()
            residual[x] = 0.0
        else:
            q = _row(draft_probs, c)
            qx = float(q[x])
            if qx <= 0.0:
                raise ValueError(
                    f"draft_probs[{c}] gives probability 0 to node {c}'s token {x}, so it was not drawn from it; "
                    "pass the distribution the drafter sampled from, or draft_probs=None for deterministic drafts"
                )
            if coins[c] * qx < float(p[x]):  # u < p(x)/q(x), without dividing
                return c, p
            residual = (p - q).clamp_min_(0.0)
        s = float(residual.sum())
        # s ~ 0 means p <= q everywhere (p == q up to rounding): rejection had ~zero probability,
        # so keep p rather than divide noise by noise.
        if s > _TINY:
            p = residual / s
    return None, p


def typical_accept_lossy(
    tree: Tree,
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    epsilon: float = 0.3,
    delta: float = 0.09,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Medusa's *typical acceptance*. LOSSY: the emitted text is NOT distributed as the target's.

    A child c of node u is acceptable when p_u(x_c) > min(epsilon, delta * exp(-H(p_u))), with p_u =
    target_probs[u] (already warped) and H its entropy: plausible tokens pass, so long drafts survive
    at high temperature where rejection sampling would cut them. The path is the deepest chain of
    acceptable nodes from the root (first in BFS order on ties); the next token is sampled from
    p at its last node. Offered as an explicit opt-in (`generate(acceptance="typical-lossy")`);
    the default, `sample_accept`, is exact.
    """
    toks = _check_tokens(tree, tokens)
    if not 0 < epsilon <= 1 or not delta > 0:
        raise ValueError(f"typical acceptance needs 0 < epsilon <= 1 and delta > 0, got epsilon={epsilon}, delta={delta}")
    p = target_probs.detach().to("cpu", torch.float64)
    p = p / p.sum(-1, keepdim=True)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [n]
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    ok = [True] + [bool(p[tree.parents[c], toks[c]] > threshold[tree.parents[c]]) for c in range(1, tree.size)]
    reach = [False] * tree.size  # every node from the root to c acceptable
    best = 0
    for c in range(tree.size):  # parents come before children
        reach[c] = ok[c] and (c == 0 or reach[tree.parents[c]])
        if reach[c] and int(tree.depth[c]) > int(tree.depth[best]):
            best = c
    path = [best]
    while tree.parents[path[-1]] >= 0:
        path.append(tree.parents[path[-1]])
    path.reverse()
    bonus = int(torch.multinomial(p[best].float(), 1, generator=generator))
    return path, bonus


def tree_option(tree, max_nodes: int | None = None, name: str = "tree"):
    """The user's `tree=` (or a drafter's "tree" option) parsed, with errors that name it (OptionError /
    OptionTypeError instead of the TreeError of speccomp/runtime/tree.py)."""
    try:
        return parse_tree_spec(tree, max_nodes=max_nodes)
    except TreeError as exc:
        raise (OptionTypeError if isinstance(exc, TypeError) else OptionError)(name, tree, str(exc)) from None


def max_tree_nodes(structure) -> int:
    """How many tree nodes fit in one verification: MAX_TREE, or less where a sliding window is smaller (every
    node of a tree must see the whole tree inside every window: passes/tree_attention.py)."""
    from speccomp.runtime.calls import MAX_TREE

    return min([MAX_TREE] + [s.sliding_window for s in structure.attention if s.sliding_window])


def check_tree_width(spec, vocab: int, what: str, tree) -> None:
    """A static tree's sibling ranks and a dynamic tree's top_k must be below the number of tokens the drafter
    scores (`vocab`: the model's vocabulary, or a head's draft vocabulary), or drafting fails mid-generate.
    `tree`: the user's value, named in the error (a Tree shows as its choice list, a dynamic spec as its string)."""
    tree = tree.choices if isinstance(tree, Tree) else str(tree) if isinstance(tree, DynamicTreeSpec) else tree
    if isinstance(spec, Tree) and max(spec.ranks) >= vocab:
        raise OptionError("tree", tree, f"uses sibling rank {max(spec.ranks)}, but the {what} scores only {vocab} "
                          f"tokens (ranks 0..{vocab - 1})", "use smaller ranks")
    if isinstance(spec, DynamicTreeSpec) and spec.top_k > vocab:
        raise OptionError("tree", tree, f"expands the top {spec.top_k} tokens, but the {what} scores only {vocab}",
                          f"use top_k <= {vocab}")
