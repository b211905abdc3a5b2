"""Trainer runs with everything a resume can get wrong, for the kill-and-autoresume tests.

    resume_trainer.py OUT [--strategy ddp] [--die-after N] [--autoresume] [--workers 2] [--tag NAME]
                      [--epochs 3] [--then OUT ...]...

Dropout, ``DataLoader(shuffle=True)``, AdamW, ``CosineAnnealingWithWarmupScheduler``,
``grad_accum=2``, ``amp_bf16``, MixUp, and a dataset whose ``__getitem__`` draws from python's,
numpy's and torch's RNGs (an augmentation; with ``--workers N`` it runs in N loader workers).
Checkpoints are saved after the 3rd batch of each epoch (mid-epoch) and at each epoch's end.
``--die-after N`` ends the process with ``os._exit`` at ``BATCH_END`` of batch N: no cleanup, the
checkpoint of that batch not written. Each batch's loss and the first sample it trained on go to
``OUT/batches_<tag>_rank<r>.pt`` (the RNG-dependent outputs); at the end, the full model,
optimizer, scheduler, timestamp and RNG states go to ``OUT/final_rank<r>.pt``.

``--then`` starts the arguments of another run, trained after this one in the same process (and
process group), each from ``seed_everything(0)`` and a new model, loader and Trainer: one launch
pays the interpreter and process-group start-up once for several runs. Only the last run may
``--die-after``.
"""

import argparse
import os
import random
import sys

import numpy as np
import torch
from torch import nn

import kiln
from kiln.launch.rng import rng_state
from then_runs import split_runs

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--strategy", default="auto")
p.add_argument("--die-after", type=int, default=0)
p.add_argument("--autoresume", action="store_true")
p.add_argument("--workers", type=int, default=0)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--tag", default="run")


RUNS = split_runs(p, sys.argv[1:], "die_after")

if "RANK" in os.environ:
    kiln.launch_from_torch()


class Augmented(torch.utils.data.Dataset):
    """Noise from all three RNGs on every sample: careless augmentation code, as users write it."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(96, 8, generator=g), torch.randint(0, 4, (96,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        scale = 0.05 * random.random() + 0.05 * float(np.random.rand())
        return self.x[i] + scale * torch.randn(8), self.y[i]


class Record(kiln.Callback):
    """The per-batch outputs that depend on every RNG: dropout masks, MixUp's draws, augmentation."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.batches = args, {}

    def batch_end(self, state, logger):
        ts = state.timestamp
        self.batches[ts.batch.value] = {
            "loss": state.loss.detach().float().clone(),
            "first": state.batch[0][0].clone(),
            "lr": state.optimizers[0].param_groups[0]["lr"],
        }
        if ts.batch.value == self.args.die_after:
            self.dump()
            os._exit(17)  # a hard crash: no finally blocks, no flushing, no checkpoint of this batch

    def dump(self) -> None:
        torch.save(self.batches, f"{self.args.out}/batches_{self.args.tag}_rank{kiln.context().rank}.pt")


def save_when(state, event):
    # mid-epoch after the 3rd batch of an epoch, and at each epoch's end
    return event == kiln.Event.EPOCH_CHECKPOINT or state.timestamp.batch_in_epoch.value == 3


def train(args: argparse.Namespace) -> None:
    kiln.seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    record = Record(args)
    loader = torch.utils.data.DataLoader(Augmented(), batch_size=8, shuffle=True, num_workers=args.workers)
    trainer = kiln.Trainer(
        model,
        train_dataloader=loader,
        max_duration=f"{args.epochs}ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01),
        schedulers=kiln.optim.CosineAnnealingWithWarmupScheduler(t_warmup="3ba"),
        criterion=nn.CrossEntropyLoss(),
        precision="amp_bf16",
        grad_accum=2,
        seed=0,
        strategy=args.strategy,
        algorithms=[kiln.algorithms.MixUp(alpha=0.3)],
        callbacks=[record],
        save_folder=f"{args.out}/ckpt",
        save_interval=save_when,
        autoresume=args.autoresume,
        progress_bar=False,
    )
    trainer.fit()
    record.dump()
    engine = trainer.engine
    final = engine.strategy.state_dict(engine.model, engine.optimizer, full=True)
    ts = trainer.state.timestamp
    torch.save(
        {
            **final,
            "scheduler": trainer.state.schedulers[0].state_dict(),
            "rng": rng_state(),
            "timestamp": {k: v for k, v in ts.state_dict().items() if not k.endswith("wct")},
        },
        f"{args.out}/final_rank{trainer.state.rank}.pt",
    )
    trainer.close()


for run in RUNS:
    train(run)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
