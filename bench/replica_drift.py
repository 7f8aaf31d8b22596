"""How far apart do two honest replicas' stage outputs get after H inner steps?

    python bench/replica_drift.py [H]      (default 50; tiny)

Two trainers from the same init, each H inner steps on its own half of the data, no
outer round; prints the relative distance (node/canary.py, `distance`) of each stage's
output for one validation batch fed the same input: what canaries must tolerate.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agora_node.node.canary_rules import distance  # noqa: E402
from agora_node.node.train_local import LocalTrainConfig, LocalTrainer  # noqa: E402
from agora_node.stages.manifest_files import load_manifest  # noqa: E402

m = load_manifest("tiny")
H = int(sys.argv[1]) if len(sys.argv) > 1 else 50
a = LocalTrainer(m, LocalTrainConfig(eval_samples=8))
b = LocalTrainer(m, LocalTrainConfig(eval_samples=8))
b.cursor = len(b.train) // 2
t0 = time.time()
for _ in range(H):
    a.train_step()
    b.train_step()
print("trained", H, "steps each in", round(time.time() - t0), "s", flush=True)
with torch.no_grad():
    batch = a.val.batch(a.val_ids[:4])
    tokens = batch.inputs
    h = None
    for k in range(m.num_stages):
        oa, ob = a.stages[k](h, tokens), b.stages[k](h, tokens)
        if k < m.num_stages - 1:
            ea, eb = (
                a.stages[k].encode_boundary(oa, tokens),
                b.stages[k].encode_boundary(ob, tokens),
            )
            print(
                f"stage {k}: output distance {distance(oa, ob):.3f}, boundary {distance(ea, eb):.3f}"
            )
        else:
            print(f"stage {k}: logits distance {distance(oa, ob):.3f}")
        h = oa
