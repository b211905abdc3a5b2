"""A Trainer run on streamed data, for the SIGKILL-and-resume tests of stateful loaders.

    stream_trainer.py OUT --data stream|plain|hf [--kill-at N] [--autoresume] [--tag NAME]
                          [--workers 2] [--stateful 1|0|none] [--save-at 3,13]

``--data stream``: ``stream_data.StatefulStream``, a torch ``IterableDataset`` with
``state_dict``/``load_state_dict``. ``plain``: ``stream_data.Stream``, the same without state.
``hf``: a Hugging Face streaming ``text`` dataset over the local files ``OUT/text/*.txt`` (the test
writes them, one id a line; the Trainer splits it by rank). Every fetch appends ``epoch id`` to
``OUT/fetched_<tag>_rank<r>.txt`` (from the loader's worker processes too);
every trained batch appends ``batch id id ...`` to ``OUT/trained_<tag>_rank<r>.txt``.
Checkpoints are saved after the batches of ``--save-at``. ``--kill-at N``: SIGKILL to this very
process at the start of batch N + 1 (the loader workers die with it). At the end the full model
and optimizer state go to ``OUT/final_<tag>_rank<r>.pt``.

``--then OUT ...`` starts the arguments of another run, trained after this one in the same process
(and process group), from the same seeds with a new model, loader and Trainer: one launch pays the
interpreter and process-group start-up once for both. Only the last run may ``--kill-at``.
"""

import argparse
import functools
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import kiln
from stream_data import StatefulStream, Stream, features, log_fetch
from then_runs import split_runs

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--data", default="stream", choices=["stream", "plain", "hf"])
p.add_argument("--kill-at", type=int, default=0)
p.add_argument("--autoresume", action="store_true")
p.add_argument("--tag", default="run")
p.add_argument("--workers", type=int, default=2)
p.add_argument("--stateful", default="none", choices=["1", "0", "none"])
p.add_argument("--save-at", default="3,13")
p.add_argument("--samples", type=int, default=40)
p.add_argument("--epochs", type=int, default=2)


RUNS = split_runs(p, sys.argv[1:], "kill_at")

if "RANK" in os.environ:
    kiln.launch_from_torch()
RANK = kiln.context().rank


def hf_collate(fetched, rows):
    ids = [int(row["text"]) for row in rows]
    for sample in ids:
        log_fetch(fetched, 0, sample)  # logged at collation, in the worker that read the rows (tests run 1 epoch)
    return torch.stack([features(s) for s in ids]), torch.tensor([s % 2 for s in ids]), torch.tensor(ids)


def hf_data(out):
    from datasets import load_dataset

    files = sorted(os.path.join(f"{out}/text", f) for f in os.listdir(f"{out}/text"))
    return load_dataset("text", data_files=files, split="train", streaming=True)


class Net(kiln.Model):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, batch):
        return self.net(batch[0])

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch[1])


class Record(kiln.Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def batch_start(self, state, logger):
        if self.args.kill_at and state.timestamp.batch.value == self.args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # the next batch is fetched: no cleanup, no flushing

    def batch_end(self, state, logger):
        ids = " ".join(str(i) for i in state.batch[2].tolist())
        with open(f"{self.args.out}/trained_{self.args.tag}_rank{RANK}.txt", "a") as f:
            f.write(f"{state.timestamp.batch.value} {ids}\n")


def train(args: argparse.Namespace) -> None:
    fetched = f"{args.out}/fetched_{args.tag}_rank{RANK}.txt"
    save_at = {int(b) for b in args.save_at.split(",") if b}

    def save_when(state, event):
        return event == kiln.Event.BATCH_CHECKPOINT and state.timestamp.batch.value in save_at

    if args.data == "hf":
        loader = DataLoader(
            hf_data(args.out), batch_size=4, num_workers=args.workers, collate_fn=functools.partial(hf_collate, fetched)
        )
    else:
        loader = DataLoader(
            (StatefulStream if args.data == "stream" else Stream)(args.samples, fetched),
            batch_size=4,
            num_workers=args.workers,
        )

    kiln.seed_everything(0)
    model = Net()
    trainer = kiln.Trainer(
        model,
        train_dataloader=loader,
        max_duration=f"{args.epochs}ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        seed=0,
        callbacks=[Record(args)],
        save_folder=f"{args.out}/ckpt_{args.data}",
        save_interval=save_when,
        autoresume=args.autoresume,
        progress_bar=False,
        stateful_dataloader={"1": True, "0": False, "none": None}[args.stateful],
    )
    trainer.fit()
    final = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "loader": type(trainer.train_dataloader.loader).__name__,
    }
    torch.save(final, f"{args.out}/final_{args.tag}_rank{RANK}.pt")


for run in RUNS:
    train(run)
