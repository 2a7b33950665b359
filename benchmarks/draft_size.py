#!/usr/bin/env python3
"""Draft step cost by size: a forward of 1 and of 4 tokens (eager, 2 threads) for SmolLM2 cut to L layers (its
embedding and LM head shared), against the model itself."""
import time, torch, speccomp
from speccomp.tuning.train_draft import draft_architecture
torch.set_num_threads(2)
model, tok = speccomp.load_default_model()
rows = {}
for L in (1, 2, 4, 8, 30):
    m = model if L == 30 else draft_architecture(model, L)
    costs = speccomp.compile(m).step_costs()
    out = []
    for q in (1, 4):
        for _ in range(3): costs.run(q, costs.PAST0)
        ts = []
        for _ in range(20):
            t = time.perf_counter(); costs.run(q, costs.PAST0); ts.append(time.perf_counter() - t)
        out.append(min(ts) * 1e3)
    rows[L] = out
for L, (a, b) in rows.items():
    print(f"layers {L:2d}: q=1 {a:6.2f} ms ({a / rows[30][0]:.2f} of the model), q=4 {b:6.2f} ms ({b / rows[30][1]:.2f})")
