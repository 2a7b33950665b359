"""EagleDrafter: grow a token tree with the EAGLE layer (speccomp/drafters/eagle.py) over its own KV cache.

The layer step is a graph (eagle.py's EagleStep, its cache explicit in and out) lowered by the compile's backend;
which entries it runs and where they go in its cache is speccomp/drafters/eagle_cache.py's, torch-free and shared
with the engine (eagle.onnx). Reads "path_states": the target's features at every newly accepted position.

Trees as for Hydra: a static `Tree` (node c gets its parent's rank-r candidate) or a `DynamicTreeSpec` (EAGLE-2:
the top_k likeliest frontier nodes expand each depth; the step's tree is the `budget` likeliest candidates).
"""
from __future__ import annotations

from functools import partial

from speccomp.drafters.eagle import EagleStep, load_eagle
from speccomp.drafters.eagle_cache import EagleCache
from speccomp.drafters.grow import MAX_DYNAMIC_DEPTH, grow
from speccomp.drafters.head_drafters import heads_for, lower_step, run_step
from speccomp.runtime.decode import Draft, DraftContext, Drafter, check_tree_kind
from speccomp.runtime.tree import DynamicTreeSpec

DEFAULT_EAGLE_TREE = DynamicTreeSpec(16, 4)


class EagleDrafter(Drafter):
    name = "eagle"
    reads = ("path_states", "own_cache")  # the target's features at every accepted position; its layer's KV
    trees = ("static", "dynamic")
    graphs = ("layer_step",)
    light_graphs = True  # one decoder layer and a reduced head: one thread (backends/drafter_graph.py)
    forward_per_level = True
    observe_optional = True  # nothing to observe: the path states it is handed run at its next propose

    def __init__(self, head, tree, heads_path: str | None = None, backend: str = "eager", lowered=None):
        self.head, self.tree, self.heads_path, self.backend = head, tree, heads_path, backend
        check_tree_kind(self, tree)
        lower_step(self, EagleStep, head, tree, lowered, backend, "EAGLE layer step")
        self.options = {} if heads_path is None else {"heads": heads_path}
        self.cache = EagleCache(partial(run_step, self.step, self.device), head.num_heads, head.head_dim)
        # no deeper than the head was trained to draft: its guesses past that are rarely accepted
        self.max_depth = min(MAX_DYNAMIC_DEPTH, head.train_steps or MAX_DYNAMIC_DEPTH)

    def with_tree(self, tree) -> "EagleDrafter":
        return EagleDrafter(self.head, tree, self.heads_path, self.backend, (self.module, self.step))

    def begin(self, prompt: list[int]) -> None:
        self.cache.begin(prompt)

    def take_states(self, states) -> None:
        self.cache.take(states[0].float().cpu().numpy())  # [m, H]: the prompt after the prefill, the accepted path after a step

    def propose(self, ctx: DraftContext) -> Draft:
        return grow(self.tree, ctx, self.cache.expander(ctx.tokens), self.max_depth)


def make_eagle(base, options: dict, tree, backend: str = "eager") -> EagleDrafter:
    path, given = heads_for(base, options, "eagle")
    return EagleDrafter(load_eagle(path, base.model), tree if tree is not None else DEFAULT_EAGLE_TREE, given, backend)
