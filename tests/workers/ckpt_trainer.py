"""A Trainer run for end-to-end resume tests: ``ckpt_trainer.py OUT [--die-after N] [--autoresume] [...]``.

Dropout, ``DataLoader(shuffle=True)`` (the Trainer gives it a seedable sampler), AdamW, warmup +
cosine, grad_accum=2, amp_bf16 and MixUp. ``--die-after N`` ends the process with ``os._exit``
after batch N (on the first attempt only, under torchrun's restarts); the final model and optimizer go to ``OUT/final_rank<r>.pt``.
``ARGS --then ARGS`` runs several in the same processes (tests/workers/then_runs.py), each a fresh
Trainer: the uninterrupted reference a resume is compared with, without a launch of its own.
"""

import argparse
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
p.add_argument("--interval", default="4ba")
p.add_argument("--save-type", default="sharded")
p.add_argument("--strategy", default="auto")
p.add_argument("--async", dest="save_async", action="store_true")
RUNS = split_runs(p, sys.argv[1:], "die_after")

if "RANK" in os.environ:
    kiln.launch_from_torch()


class Die(kiln.Callback):
    def __init__(self, after: int) -> None:
        self.after = after

    def batch_end(self, state, logger):
        # Under torchrun --max-restarts only the first attempt dies: the restarted one must finish.
        if state.timestamp.batch.value == self.after and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os._exit(17)  # a hard crash: no finally blocks, no flushing


def fit(args):
    kiln.seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 4, (96,), generator=g))
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=8, shuffle=True),
        max_duration="3ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3),
        schedulers=kiln.optim.CosineAnnealingWithWarmupScheduler(t_warmup="3ba"),
        criterion=nn.CrossEntropyLoss(),
        precision="amp_bf16",
        grad_accum=2,
        seed=0,
        strategy=args.strategy,
        algorithms=[kiln.algorithms.MixUp(alpha=0.3)],
        callbacks=[Die(args.die_after)] if args.die_after else [],
        save_folder=f"{args.out}/ckpt",
        save_interval=args.interval,
        save_type=args.save_type,
        save_async=args.save_async,
        autoresume=args.autoresume,
        progress_bar=False,
    )
    trainer.fit()
    engine = trainer.engine
    final = engine.strategy.state_dict(engine.model, engine.optimizer, full=True)
    torch.save({**final, "batch": trainer.state.timestamp.batch.value}, f"{args.out}/final_rank{trainer.state.rank}.pt")


for run in RUNS:
    fit(run)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
