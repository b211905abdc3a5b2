"""What a run shows of its progress (kiln.trainer.progress), on fake clocks.

* On a terminal: one tqdm bar over the run (its total is the run's, not an epoch's), with loss,
  lr, throughput and the run's ETA; at most one redraw per refresh_interval.
* Off a terminal (a log file): a line after the first step, a step line every console_interval
  and at each tenth of the run (never one per step), eval start and end lines, a summary line.
* The loop calls ``update`` only when a line is due (``due_batch``/``due_time``), and the loss is
  read from the device only when a line is printed (or once a second of redraws), never per step.

A real ``kiln train`` writing into a file is tests/test_run_output.py's.
"""

from __future__ import annotations

import io
import json
import re
import time
from types import SimpleNamespace

import pytest
import torch
import tqdm.std
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from kiln.core.time import Time, Timestamp, TimeUnit
from kiln.loggers import FileLogger, Logger, LoggerDestination
from kiln.trainer import progress as progress_module
from kiln.trainer.progress import ProgressBar, parse_console_interval

STAMP = r"\d\d:\d\d:\d\d"


class Terminal(io.StringIO):
    def isatty(self):
        return True


class CountedLoss:
    """A loss whose reads to the host are counted."""

    def __init__(self, value: float = 0.75) -> None:
        self.value, self.reads = value, 0

    def detach(self):
        return self

    def __float__(self):
        self.reads += 1
        return self.value


@pytest.fixture
def clock(monkeypatch):
    """tqdm's clock and the progress module's, advanced by hand."""
    now = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])
    monkeypatch.setattr(progress_module, "time", SimpleNamespace(perf_counter=lambda: now[0], strftime=time.strftime))
    return now


def _renders(stream):
    return [r for r in stream.getvalue().replace("\n", "\r").split("\r") if r]


def _state(max_duration, dataloader_len=4, loss=None, timestamp=None):
    return SimpleNamespace(
        max_duration=max_duration,
        timestamp=timestamp or Timestamp(),
        dataloader_len=dataloader_len,
        loss=torch.tensor(0.75) if loss is None else loss,
        lr=0.1,
        metrics={},
        stop_reason=None,
        _stop=False,
    )


def _fit(bar, clock, state, batches, seconds, samples=4, tokens=0, finish=True):
    """The Trainer loop's calls, with its compare: ``update`` only when due. Returns the number of calls."""
    calls = 0
    bar.start(state)
    bar.start_epoch(state)
    for _ in range(batches):
        clock[0] += seconds
        state.timestamp.advance_batch(samples, tokens, seconds)
        if state.timestamp._batch >= bar.due_batch or clock[0] >= bar.due_time:
            calls += 1
            bar.update(state)
    if finish:
        bar.finish(state, checkpoint="/runs/x/ep0-ba50")
    return calls


def _lines(stream):
    """The lines without their time of day (checked to be there)."""
    lines = stream.getvalue().splitlines()
    assert all(re.match(STAMP + " ", line) for line in lines), lines
    return [line[9:] for line in lines]


def _step_lines(stream):
    return [line for line in _lines(stream) if line.startswith("step ")]


# -- the bar --------------------------------------------------------------------------------------
def test_the_bar_counts_the_run_and_shows_loss_lr_throughput_and_eta(clock):
    logger = Logger([], rank=0)
    logger.latest.update({"train/loss": 0.25, "train/lr": 0.5})
    stream = Terminal()
    bar = ProgressBar(stream=stream, logger=logger, refresh_interval=0, console_stream=Terminal())
    state = _state(Time(2, TimeUnit.EPOCH))
    # 4 batches of 4 samples, 0.5 s each, in a run of 2 epochs of 4 batches
    _fit(bar, clock, state, batches=4, seconds=0.5, finish=False)
    assert bar._bar.total == 8  # the run's batches, not the epoch's 4
    renders = _renders(stream)
    # tqdm's remaining time and kiln's eta agree: both are the run's (each redraw shows the
    # postfix computed at the one before)
    assert (
        renders[2] == "epoch 1/2:  25%|##5       | 2/8 [00:01<00:03,  2.00ba/s, loss=0.25, lr=0.5, sp/s=8, eta=00:03]"
    )
    assert (
        renders[-1] == "epoch 1/2:  50%|#####     | 4/8 [00:02<00:02,  2.00ba/s, loss=0.25, lr=0.5, sp/s=8, eta=00:02]"
    )
    state.timestamp.advance_epoch()
    bar.start_epoch(state)
    clock[0] += 0.5
    state.timestamp.advance_batch(4, 0, 0.5)
    bar.update(state)
    assert _renders(stream)[-1].startswith("epoch 2/2:  62%|######2   | 5/8 [00:02<00:01")
    bar.finish(state)
    assert bar._bar is None and stream.getvalue().endswith("\n")


@pytest.mark.parametrize(
    ("duration", "timestamp", "total", "initial"),
    [
        (Time(10, TimeUnit.BATCH), Timestamp(), 10, 0),
        (Time(3, TimeUnit.EPOCH), Timestamp(epoch=1, batch=6, batch_in_epoch=2), 12, 6),  # resumed mid-epoch
        (Time(1000, TimeUnit.SAMPLE), Timestamp(batch=2, sample=80), 1000, 80),  # counted in samples
        (Time(60, TimeUnit.SECOND), Timestamp(), None, 0),  # a run in seconds: its eta is in the postfix
    ],
)
def test_the_bars_total_is_the_runs(clock, duration, timestamp, total, initial):
    bar = ProgressBar(stream=Terminal(), refresh_interval=0, console_stream=Terminal())
    bar.start(_state(duration, dataloader_len=4, timestamp=timestamp))
    assert (bar._bar.total, bar._bar.n) == (total, initial)
    bar.close()


def test_tokens_per_second_the_state_lr_and_an_eta_in_batches(clock):
    stream = Terminal()
    state = _state(Time(10, TimeUnit.BATCH), dataloader_len=5)
    # no logger: the state's lr, and the loss read from the device
    _fit(ProgressBar(stream=stream, refresh_interval=0), clock, state, batches=5, seconds=0.25, tokens=512)
    last = _renders(stream)[-1]
    assert last.endswith("5/10 [00:01<00:01,  4.00ba/s, loss=0.75, lr=0.1, tok/s=2.05e+03, eta=00:01]"), last


def test_the_bar_reads_an_unlogged_loss_at_most_once_a_second(clock):
    loss = CountedLoss()
    stream = Terminal()
    state = _state(Time(100, TimeUnit.BATCH), loss=loss)
    # 40 redraws (one per batch, 0.1 s apart) over 4 s: the loss is read about once a second
    bar = ProgressBar(stream=stream, refresh_interval=0, console_stream=Terminal())
    _fit(bar, clock, state, batches=40, seconds=0.1, finish=False)
    assert 3 <= loss.reads <= 5, loss.reads
    assert _renders(stream)[-1].count("loss=0.75") == 1
    bar.close()
    # with a logger that writes the loss, the bar shows the written one and reads nothing
    logged = Logger([LoggerDestination()], rank=0)
    logged.latest["train/loss"] = 0.5
    loss.reads, stream = 0, Terminal()
    state = _state(Time(100, TimeUnit.BATCH), loss=loss)
    _fit(ProgressBar(stream=stream, logger=logged, refresh_interval=0), clock, state, batches=40, seconds=0.1)
    assert loss.reads == 0 and "loss=0.5" in _renders(stream)[-1]


def test_the_bar_redraws_at_most_every_refresh_interval(clock):
    stream = Terminal()
    state = _state(Time(1, TimeUnit.EPOCH), dataloader_len=400)
    bar = ProgressBar(stream=stream, refresh_interval=0.25, console_stream=Terminal())
    _fit(bar, clock, state, batches=400, seconds=0.005)  # 2 s
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
    trainer.progress.console_stream = Terminal()  # no lines: this test is the bar's
    trainer.fit()
    trainer.close()
    last_loss = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()][-1]["metrics"]
    last = _renders(stream)[-1]
    assert last.startswith("epoch 2/2: 100%") and "12/12" in last  # one bar: 2 epochs of 6
    assert f"loss={last_loss['train/loss']:.4g}, lr=0.05, sp/s=" in last and "eta=00:00" in last


# -- lines in a log file --------------------------------------------------------------------------
def test_a_line_at_each_tenth_of_the_run_and_none_per_step(clock):
    out = io.StringIO()
    bar = ProgressBar(stream=io.StringIO(), console_interval="1h", console_stream=out)
    state = _state(Time(50, TimeUnit.BATCH), dataloader_len=1000)
    state.metrics.update({"eval/loss": 0.5, "train/loss": torch.tensor(0.7)})
    calls = _fit(bar, clock, state, batches=50, seconds=0.01)
    lines = _lines(out)
    assert lines[0] == "training started: first step done 0.01 s into fit(); 49 steps to go"
    assert [int(line.split()[1].split("/")[0]) for line in _step_lines(out)] == [5, 10, 15, 20, 25, 30, 35, 40, 45]
    assert calls == 10  # the loop called update() for the first step and the 9 lines only
    assert re.fullmatch(r"step 5/50 \(10%\)  loss 0\.75  lr 0\.1  400 sp/s  eta 00:00", _step_lines(out)[0])
    assert lines[-1] == (
        "done: step 50/50 (100%) in 00:00 (00:00 training), loss 0.75, eval/loss 0.5; last checkpoint /runs/x/ep0-ba50"
    )
    assert len(lines) == 11


def test_a_line_every_console_interval(clock):
    out = io.StringIO()
    bar = ProgressBar(stream=io.StringIO(), console_interval="1s", console_stream=out)
    calls = _fit(bar, clock, _state(Time(400, TimeUnit.BATCH)), batches=400, seconds=0.25)
    steps = [int(line.split()[1].split("/")[0]) for line in _step_lines(out)]
    # a line once a second of 0.25-s steps, and at each tenth (every 40 steps)
    assert steps[:4] == [5, 9, 13, 17] and 40 in steps and 80 in steps
    assert max(b - a for a, b in zip(steps, steps[1:])) == 4
    assert calls == len(steps) + 1  # + the first step's line
    # counted in batches: every 30 batches, and at each tenth
    out = io.StringIO()
    bar = ProgressBar(stream=io.StringIO(), console_interval="30ba", console_stream=out)
    _fit(bar, clock, _state(Time(400, TimeUnit.BATCH)), batches=100, seconds=0.25, finish=False)
    assert [int(line.split()[1].split("/")[0]) for line in _step_lines(out)] == [31, 40, 70, 80]


@pytest.mark.parametrize(
    ("duration", "timestamp", "batches", "seconds", "first"),
    [
        (Time(3, TimeUnit.EPOCH), Timestamp(), 12, 0.01, "step 2/12 (17%), epoch 1/3"),  # 1.2 batches a tenth
        (Time(10, TimeUnit.EPOCH), Timestamp(epoch=5, batch=20), 20, 0.01, "step 22/40 (55%), epoch 6/10"),
        (Time(400, TimeUnit.SAMPLE), Timestamp(), 100, 0.01, "step 10, 40/400 sp (10%)"),
        (Time(2.5, TimeUnit.SECOND), Timestamp(), 40, 0.0625, "step 4, 00:00/00:02 (10%)"),
    ],
)
def test_lines_in_every_unit_of_the_run(clock, duration, timestamp, batches, seconds, first):
    out = io.StringIO()
    state = _state(duration, timestamp=timestamp)
    bar = ProgressBar(console_interval="1h", console_stream=out)
    _fit(bar, clock, state, batches=batches, seconds=seconds, samples=4)
    steps = _step_lines(out)
    assert steps[0].startswith(first + "  "), steps
    assert len(steps) == 9, steps  # the tenths of this fit() (a resumed one: of what is left); the 10th is the summary


def test_the_loss_is_read_only_for_a_line(clock):
    loss = CountedLoss()
    out = io.StringIO()
    bar = ProgressBar(console_interval="1s", console_stream=out)
    _fit(bar, clock, _state(Time(1000, TimeUnit.BATCH), loss=loss), batches=1000, seconds=0.01)
    assert loss.reads == len(_step_lines(out)) + 1 < 30  # each step line and the summary, of 1000 steps
    # a Logger that writes the loss: lines show what it wrote, and read nothing
    logged = Logger([LoggerDestination()], rank=0)
    loss.reads, out = 0, io.StringIO()
    bar = ProgressBar(console_interval="1s", console_stream=out, logger=logged)
    state = _state(Time(100, TimeUnit.BATCH), loss=loss)
    bar.start(state)
    for step in range(1, 101):
        clock[0] += 0.1
        state.timestamp.advance_batch(4, 0, 0.1)
        if step % 20 == 0:
            logged.latest["train/loss"] = 1 / step
        bar.update(state)
    bar.finish(state)
    assert loss.reads == 0
    shown = [line.split("  ")[1] for line in _step_lines(out)]
    assert shown[0] == "lr 0.1" and "loss 0.05" in shown  # nothing written yet; then step 20's


def test_evaluation_lines(clock):
    out = io.StringIO()
    bar = ProgressBar(console_stream=out)
    state = _state(Time(100, TimeUnit.BATCH), timestamp=Timestamp(batch=40))
    bar.eval_start(state, "eval/val", list(range(20)), subset_num_batches=None)
    clock[0] += 61.25
    bar.eval_end("eval/val", {"eval/val/loss": 0.3125, "eval/val/Accuracy": 0.5})
    bar.eval_start(state, "eval", list(range(20)), subset_num_batches=5)
    assert _lines(out) == [
        "eval/val starts at step 40 (20 batches)",
        "eval/val done in 61.2 s: eval/val/loss 0.3125  eval/val/Accuracy 0.5",
        "eval starts at step 40 (5 batches)",
    ]


def test_no_lines_on_a_terminal_or_without_an_interval_or_off_rank_0(clock):
    for bar in (
        ProgressBar(console_stream=Terminal()),
        ProgressBar(console_stream=io.StringIO(), console_interval=None),
        ProgressBar(console_stream=io.StringIO(), enabled=False),
    ):
        state = _state(Time(20, TimeUnit.BATCH))
        calls = _fit(bar, clock, state, batches=20, seconds=0.5)
        bar.eval_start(state, "eval", [], None)
        bar.eval_end("eval", {})
        assert calls == 0 and bar.console_stream.getvalue() == ""


def test_a_trainer_writes_lines_to_stdout_when_it_is_not_a_terminal(capsys, monkeypatch):
    model = nn.Linear(4, 2)
    x = torch.randn(80, 4)
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=2)
    trainer = kiln.Trainer(
        model,
        train_dataloader=data,
        eval_dataloader=DataLoader(TensorDataset(x[:8], (x[:8, 0] > 0).long()), batch_size=4),
        eval_interval="10ba",
        criterion=nn.CrossEntropyLoss(),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
        max_duration="20ba",  # half an epoch: no epoch ever ends
        console_interval="1h",
    )
    trainer.progress.stream = io.StringIO()
    updates = []
    update = trainer.progress.update
    monkeypatch.setattr(
        trainer.progress, "update", lambda state: updates.append(state.timestamp._batch) or update(state)
    )
    trainer.fit()
    lines = _lines(SimpleNamespace(getvalue=lambda: capsys.readouterr().out))
    assert lines[0].startswith("training started: first step done ") and lines[0].endswith("; 19 steps to go")
    assert [re.sub(r" \(.*| in [0-9.]+ s: .*", "", line) for line in lines[1:-1]] == [
        "step 2/20",
        "step 4/20",
        "step 6/20",
        "step 8/20",
        "step 10/20",
        "eval starts at step 10",
        "eval done",
        "step 12/20",
        "step 14/20",
        "step 16/20",
        "step 18/20",  # none at the last step: the summary line is the tenth tenth
        "eval starts at step 20",
        "eval done",
    ]
    assert re.fullmatch(
        r"done: step 20/20 \(100%\) in \d\d:\d\d \(\d\d:\d\d training\), loss \S+, eval/loss \S+", lines[-1]
    )
    assert updates == [1, 2, 4, 6, 8, 10, 12, 14, 16, 18]  # the loop asks only when a line is due


# -- the argument -----------------------------------------------------------------------------------
def test_console_interval_values():
    assert parse_console_interval("30s") == Time(30, TimeUnit.SECOND)
    assert parse_console_interval(2.5) == Time(2.5, TimeUnit.SECOND)
    assert parse_console_interval("1h30m") == Time(5400, TimeUnit.SECOND)
    assert parse_console_interval("100ba") == Time(100, TimeUnit.BATCH)
    assert parse_console_interval(None) is None and parse_console_interval(False) is None
    for bad in ("3ep", "0.1dur", 0, -1, "soon", True):
        with pytest.raises(ValueError, match=r"^console_interval=.* must be a wall-clock time like '30s'"):
            parse_console_interval(bad)
