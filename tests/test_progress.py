"""The progress bar's text: loss, lr, batches per second, throughput and ETA, on a fake clock; at
most one redraw per refresh_interval. (That it reads nothing from the device per step is
tests/test_step_calls.py's.)"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch
import tqdm.std
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from kiln.core.time import Time, Timestamp, TimeUnit
from kiln.loggers import FileLogger, Logger
from kiln.trainer.progress import ProgressBar


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def clock(monkeypatch):
    """tqdm's clock, advanced by hand."""
    now = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])
    return now


def _renders(stream):
    return [r for r in stream.getvalue().replace("\n", "\r").split("\r") if r]


def _run(bar, clock, state, batches, seconds, samples=4, tokens=0):
    bar.start_epoch(state)
    for _ in range(batches):
        clock[0] += seconds
        state.timestamp.advance_batch(samples, tokens, seconds)
        bar.update(state)
    bar.end_epoch(state)
    bar.close()


def _state(max_duration, dataloader_len=4):
    return SimpleNamespace(
        max_duration=max_duration, timestamp=Timestamp(), dataloader_len=dataloader_len, loss=torch.tensor(0.75), lr=0.1
    )


def test_the_bar_shows_loss_lr_rate_throughput_and_the_runs_eta(clock):
    logger = Logger([], rank=0)
    logger.latest.update({"train/loss": 0.25, "train/lr": 0.5})
    stream = Terminal()
    state = _state(Time(2, TimeUnit.EPOCH))
    # 4 batches of 4 samples, 0.5 s each: 2 ba/s, 8 samples/s; the run is 2 epochs
    _run(ProgressBar(stream=stream, logger=logger, refresh_interval=0), clock, state, batches=4, seconds=0.5)
    renders = _renders(stream)
    # each redraw shows what was computed at the one before (the postfix is set between redraws):
    # after batch 1 of 8 the run has 3.5 s left; after batch 4, 2 s
    assert (
        renders[2] == "epoch 1/2:  50%|#####     | 2/4 [00:01<00:01,  2.00ba/s, loss=0.25, lr=0.5, sp/s=8, eta=00:03]"
    )
    assert (
        renders[-1] == "epoch 1/2: 100%|##########| 4/4 [00:02<00:00,  2.00ba/s, loss=0.25, lr=0.5, sp/s=8, eta=00:02]"
    )


def test_tokens_per_second_the_state_lr_and_an_eta_in_batches(clock):
    stream = Terminal()
    state = _state(Time(10, TimeUnit.BATCH), dataloader_len=5)
    # no logger: the state's lr; the loss is read once, at the epoch's last batch
    _run(ProgressBar(stream=stream, refresh_interval=0), clock, state, batches=5, seconds=0.25, tokens=512)
    last = _renders(stream)[-1]
    assert last.endswith("5/5 [00:01<00:00,  4.00ba/s, loss=0.75, lr=0.1, tok/s=2.05e+03, eta=00:01]"), last


def test_the_summary_line_off_a_terminal(clock):
    stream = io.StringIO()
    _run(ProgressBar(stream=stream, refresh_interval=0), clock, _state(Time(1, TimeUnit.EPOCH)), batches=4, seconds=0.5)
    assert stream.getvalue() == "epoch 1/1: 4 batches, loss 0.75, 2.0 ba/s, 8 sp/s\n"


def test_the_bar_redraws_at_most_every_refresh_interval(clock):
    stream = Terminal()
    state = _state(Time(1, TimeUnit.EPOCH), dataloader_len=400)
    _run(ProgressBar(stream=stream, refresh_interval=0.25), clock, state, batches=400, seconds=0.005)  # 2 s
    # the first draw, one per 0.25 s, the last batch and the close: about 10, never one per batch
    assert 5 <= len(_renders(stream)) <= 12, len(_renders(stream))
    assert ProgressBar().refresh_interval == 0.25  # the Trainer's default: at most 4 redraws a second


def test_a_trainers_bar_shows_the_logged_loss(tmp_path, clock):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(24, 4)
    trainer = kiln.Trainer(
        model,
        train_dataloader=DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4),
        criterion=nn.CrossEntropyLoss(),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
        max_duration="2ep",
        loggers=[FileLogger(tmp_path / "m.jsonl")],
    )
    stream = Terminal()
    trainer.progress.stream, trainer.progress.refresh_interval = stream, 0
    trainer.fit()
    trainer.close()
    last_loss = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()][-1]["metrics"]
    last = _renders(stream)[-1]
    assert last.startswith("epoch 2/2: 100%") and "6/6" in last
    assert f"loss={last_loss['train/loss']:.4g}, lr=0.05, sp/s=" in last and "eta=00:00" in last
