"""A Trainer run that saves to a URL: ``ckpt_storage.py OUT SAVE_FOLDER [--kill-in-upload N] [--async]``.

Dropout, a shuffled DataLoader, AdamW, warmup + cosine, a checkpoint every 4 batches, 2 kept.
``--kill-in-upload N``: the process ends with ``os._exit(19)`` (a hard kill: no finally blocks, no
flushing) in the middle of the N-th checkpoint's upload: its ``rank<r>.pt`` is in the bucket, its
tensor files are being written, no manifest exists. The final model and optimizer go to
``OUT/final_rank<r>.pt``. S3's endpoint and credentials come from the environment.

``--then OUT SAVE_FOLDER ...`` starts the arguments of another run, trained after this one in the
same process (and process group), from the same seeds with a new model, loader and Trainer: one
launch pays the interpreter and process-group start-up once for both. Only the last run may
``--kill-in-upload``.
"""

import argparse
import contextlib
import os
import sys

import torch
from torch import nn

import kiln
from kiln.checkpoint import hashing
from then_runs import split_runs

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("save_folder")
p.add_argument("--kill-in-upload", type=int, default=0)
p.add_argument("--async", dest="save_async", action="store_true")


RUNS = split_runs(p, sys.argv[1:], "kill_in_upload")

if "RANK" in os.environ:
    kiln.launch_from_torch()


def die_in_upload(n: int) -> None:
    """From now on, end the process in the middle of the n-th checkpoint folder's upload."""
    folders: list[str] = []
    create_stream = hashing.HashingFileSystem.create_stream

    @contextlib.contextmanager
    def create_stream_then_die(self, path, mode):
        folder = os.path.dirname(str(path))
        if folder not in folders:
            folders.append(folder)
        with create_stream(self, path, mode) as stream:
            if len(folders) == n and str(path).endswith(".distcp"):
                # rank<r>.pt of this checkpoint is in the bucket (one PUT, before the tensors)
                os._exit(19)
            yield stream

    hashing.HashingFileSystem.create_stream = create_stream_then_die


def train(args: argparse.Namespace) -> None:
    if args.kill_in_upload:
        die_in_upload(args.kill_in_upload)
    kiln.seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=8, shuffle=True),
        max_duration="3ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3),
        schedulers=kiln.optim.CosineAnnealingWithWarmupScheduler(t_warmup="3ba"),
        criterion=nn.CrossEntropyLoss(),
        seed=0,
        save_folder=args.save_folder,
        save_interval="4ba",
        save_num_checkpoints_to_keep=2,
        save_async=args.save_async,
        autoresume=True,
        progress_bar=False,
    )
    trainer.fit()
    engine = trainer.engine
    final = engine.strategy.state_dict(engine.model, engine.optimizer, full=True)
    torch.save({**final, "batch": trainer.state.timestamp.batch.value}, f"{args.out}/final_rank{trainer.state.rank}.pt")


for run in RUNS:
    train(run)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
