"""2-rank metrics: each rank updates on its own (uneven) share of the data; compute() must give the
metrics of the whole data set on every rank. Writes rank<r>.json with the synced values."""

import json
import sys

import torch
import torch.distributed as dist
import torchmetrics

import kiln
from kiln import metrics

out = sys.argv[1]
ctx = kiln.launch_from_torch()
g = torch.Generator().manual_seed(0)
logits, labels = torch.randn(64, 5, generator=g), torch.randint(0, 5, (64,), generator=g)
losses = torch.rand(64, generator=g)
# Uneven shares (37 and 27 samples) and uneven batch counts: sums must still add up exactly.
rows = torch.arange(0, 37) if ctx.rank == 0 else torch.arange(37, 64)
named = {
    "Accuracy": metrics.Accuracy(),
    "Top2": metrics.Accuracy(top_k=2),
    "CrossEntropy": metrics.CrossEntropy(),
    "F1": metrics.F1Score(num_classes=5, average="macro"),
    "loss": metrics.MeanMetric(),
}
for batch in rows.split(8):
    for name, metric in named.items():
        if name == "loss":
            metric.update(losses[batch])
        else:
            metric.update(logits[batch], labels[batch])
local_acc = float((logits[rows].argmax(1) == labels[rows]).float().mean())
values = metrics.sync_metrics(named, prefix="eval/")
# The torchmetrics form forwarded by kiln syncs the same way.
tm = torchmetrics.classification.MulticlassAccuracy(num_classes=5, average="micro")
tm.update(logits[rows], labels[rows])
values["eval/tm_accuracy"] = float(tm.compute())
values["local_accuracy"] = local_acc
with open(f"{out}/rank{ctx.rank}.json", "w") as f:
    json.dump(values, f)
dist.destroy_process_group()
