"""The Trainer end to end: a run killed hard (os._exit) mid-epoch or at an epoch boundary and
started again with autoresume=True ends bit-for-bit where an uninterrupted run does; load_path
"best"/"last", save_best and trainer.save_checkpoint() work through kiln.checkpoint."""

from __future__ import annotations

import os
import runpy
import sys

import pytest
import torch
from torch import nn

import kiln
from distributed import WORKERS, fork_ranks
from kiln.checkpoint import verify_checkpoint

RUN = WORKERS / "ckpt_trainer.py"
sys.path.insert(0, str(WORKERS))  # the worker's own imports (then_runs), when it runs in this process


def _in_process(out, *args):
    saved = sys.argv
    sys.argv = [str(RUN), str(out), *args]
    try:
        runpy.run_path(str(RUN), run_name="__main__")
    finally:
        sys.argv = saved


def _same(a, b, rank=0, batches=36):
    x, y = (torch.load(f"{d}/final_rank{rank}.pt", weights_only=True) for d in (a, b))
    assert x["batch"] == y["batch"] == batches
    for section in ("model", "optimizer"):
        for key, value in x[section].items():
            same = torch.equal(value, y[section][key]) if isinstance(value, torch.Tensor) else value == y[section][key]
            assert same, f"{section}.{key} differs after the resume"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    _in_process(out)
    return out


@pytest.mark.parametrize(
    "interval, die_after, resumes_from",
    [("4ba", 17, "ep1-ba16"), ("1ep", 13, "ep1-ba12")],
    ids=["mid-epoch", "epoch-boundary"],
)
def test_trainer_killed_and_autoresumed_is_bit_exact(tmp_path, uninterrupted, interval, die_after, resumes_from):
    # `python ckpt_trainer.py ...` in a process of its own (it dies), forked from the warm server
    args = (str(tmp_path), "--interval", interval, "--die-after", str(die_after))
    crashed = fork_ranks(RUN, lambda rank: {}, nproc=1, args=args, timeout=300)[0]
    assert crashed.returncode == 17, crashed.stderr[-3000:]
    assert (tmp_path / "ckpt/last").resolve().name == resumes_from
    _in_process(tmp_path, "--interval", interval, "--autoresume")
    _same(uninterrupted, tmp_path)


def test_autoresume_without_checkpoints_starts_fresh(tmp_path, uninterrupted):
    _in_process(tmp_path, "--autoresume", "--async")
    _same(uninterrupted, tmp_path)
    verify_checkpoint(tmp_path / "ckpt/last")


def test_save_best_load_best_and_manual_save(tmp_path):
    kiln.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16)

    def trainer(**kwargs):
        model = nn.Linear(4, 2)
        return kiln.Trainer(
            model,
            train_dataloader=loader,
            eval_dataloader=loader,
            max_duration="3ep",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.5),
            criterion=nn.CrossEntropyLoss(),
            save_folder=tmp_path,
            progress_bar=False,
            **kwargs,
        )

    first = trainer(save_best="eval/loss", save_num_checkpoints_to_keep=1)
    first.fit()
    best = os.readlink(tmp_path / "best")
    assert verify_checkpoint(tmp_path / "best")["name"] == best and (tmp_path / "last").exists()
    manual = first.save_checkpoint()
    assert verify_checkpoint(manual)["timestamp"]["batch"] == 12

    again = trainer(load_path="best")
    assert again.state.timestamp.batch.value == int(best.split("-ba")[1])
    assert again.state.timestamp.epoch.value >= 1
