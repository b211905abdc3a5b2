"""2 ranks: every tensor collective kiln issues (or has torchmetrics issue) is on kiln.context().device.

Usage: collective_devices.py OUT under ``kiln run -n 2``. The tensor collectives of torch.distributed are
wrapped (collective_trace.py); the run covers the Trainer (fit with the OOM vote of
device_train_microbatch_size="auto", NaNMonitor, a logger, nnScaler's GradReduction, eval with metrics
of a loader, a list and a generator, the preemption check of a CheckpointSaver) and Colossal-AI's
metric hooks. Each rank writes OUT/rank<r>.json: {"device": ctx.device, "calls": [[op, devices, site,
allowed], ...]}.
"""

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from collective_trace import allowed, install
from kiln import callbacks, hooks
from kiln.config.reduction import GradReduction
from kiln.loggers import LoggerDestination
from kiln.metrics import Accuracy


def data(n=40):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


class Kept(LoggerDestination):
    def __init__(self):
        super().__init__(rank_zero_only=False)
        self.metrics = []

    def log_metrics(self, metrics, step=None):
        self.metrics.append(metrics)


def trainer_run(folder):
    net = model()
    trainer = kiln.Trainer(
        net,
        train_dataloader=DataLoader(data(), batch_size=8),
        eval_dataloader=DataLoader(data(13), batch_size=4),
        max_duration="3ba",
        eval_interval="3ba",
        criterion=nn.CrossEntropyLoss(),
        progress_bar=False,
        optimizers=torch.optim.SGD(net.parameters(), lr=0.1),
        device_train_microbatch_size="auto",
        eval_metrics={"Accuracy": Accuracy()},
        loggers=[Kept()],
        save_folder=folder,
        save_interval="100ep",
        callbacks=[callbacks.NaNMonitor(), GradReduction("sum", "sum", data_parallel_size=2)],
    )
    trainer.fit()
    rank = kiln.context().rank
    mine = [(x, y) for x, y in DataLoader(data(9 + rank), batch_size=4)]  # uneven: 3 and 3 batches, 9 and 10 rows
    trainer.eval(mine)  # a list has a length: one all-reduce agrees on the batch count
    trainer.eval(batch for batch in mine[: 2 + rank])  # no length: the ranks agree batch by batch


def hooks_run():
    net = model()
    engine, train_dl, test_dl, _ = kiln.initialize(
        net,
        torch.optim.SGD(net.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        kiln.get_dataloader(data(), batch_size=8),
        kiln.get_dataloader(data(13), batch_size=4),
    )
    logger = kiln.get_dist_logger()
    trainer = kiln.Trainer(engine=engine, logger=logger)
    count = hooks.AccuracyHook(accuracy_func=lambda out, label: (out.argmax(-1) == label).sum())
    metric = hooks.AccuracyHook(accuracy_func=Accuracy())
    trainer.fit(
        train_dataloader=train_dl,
        epochs=1,
        test_dataloader=test_dl,
        display_progress=False,
        hooks=[hooks.LossHook(), count, metric, hooks.ThroughputHook(), hooks.LogMetricByEpochHook(logger)],
    )
    return {"count": count.metric.get_accumulated_value(), "torchmetrics": metric.metric.get_accumulated_value()}


if __name__ == "__main__":
    out = sys.argv[1]
    ctx = kiln.launch_from_torch()
    calls = []
    install(lambda call: calls.append([call.op, [str(d) for d in call.devices], call.site, allowed(call, ctx.device)]))
    trainer_run(os.path.join(out, "checkpoints"))  # one folder for both ranks
    accuracy = hooks_run()
    with open(f"{out}/rank{ctx.rank}.json", "w") as f:
        json.dump({"device": str(ctx.device), "calls": calls, "accuracy": accuracy}, f)
    torch.distributed.destroy_process_group()
