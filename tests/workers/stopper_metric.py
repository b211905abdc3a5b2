"""2 ranks: each holds its own train/loss; the stopping callbacks must read one value on every rank."""

import json
import sys
import types

import torch

import kiln
from kiln.callbacks._monitor import read_metric

out = sys.argv[1]
ctx = kiln.launch_from_torch()
state = types.SimpleNamespace(
    metrics={"train/loss": torch.tensor(float(ctx.rank + 1)), "eval/Accuracy": 0.25}, world_size=ctx.world_size
)
values = {
    "train": read_metric(state, "loss", "train", "EarlyStopper"),
    "eval": read_metric(state, "Accuracy", "eval", "EarlyStopper"),
}
with open(f"{out}/rank{ctx.rank}.json", "w") as f:
    json.dump(values, f)
