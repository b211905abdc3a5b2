"""A Trainer that records which samples each rank trains on, for resumes on another world size.

Usage: world_change.py OUT [--die-after N] [--autoresume]. 50 samples whose input is their index,
3 per rank per batch, shuffled, a checkpoint every 3 batches, 2 epochs. Each rank appends
[epoch, index] pairs to OUT/seen_rank<r>_<attempt>.json after every batch (attempt: "first" or
"resumed"); --die-after N ends the process with os._exit after batch N.

``--then OUT ...`` starts the arguments of another run, trained after this one in the same process
(and process group), from the same seeds with a new model, loader and Trainer: one launch pays the
interpreter and process-group start-up once for both. Only the last run may ``--die-after``.
"""

import argparse
import json
import os
import sys

import torch
from torch import nn

import kiln
from then_runs import split_runs

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--die-after", type=int, default=0)
p.add_argument("--autoresume", action="store_true")


RUNS = split_runs(p, sys.argv[1:], "die_after")
ctx = kiln.launch_from_torch()


class Record(kiln.Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.die_after, self.seen = args.die_after, []
        self.path = f"{args.out}/seen_rank{ctx.rank}_{'resumed' if args.autoresume else 'first'}.json"

    def batch_start(self, state, logger):
        self.seen.extend([state.timestamp.epoch.value, int(i)] for i in state.batch[0][:, 0].tolist())

    def batch_end(self, state, logger):
        with open(self.path, "w") as f:
            json.dump(self.seen, f)
        if state.timestamp.batch.value == self.die_after:
            os._exit(17)  # a hard crash after the batch's checkpoint decision


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.arange(50, dtype=torch.float32)[:, None], torch.zeros(50, dtype=torch.long)
    )
    trainer = kiln.Trainer(
        nn.Linear(1, 2),
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=3, shuffle=True),
        max_duration="2ep",
        optimizers=None,
        criterion=nn.CrossEntropyLoss(),
        callbacks=[Record(args)],
        seed=5,
        save_folder=f"{args.out}/ckpt",
        save_interval="3ba",
        autoresume=args.autoresume,
        progress_bar=False,
    )
    trainer.fit()


for run in RUNS:
    train(run)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
