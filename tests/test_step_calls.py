"""Collectives and host reads per training step (issue 13): kiln's Engine and Trainer against a raw
DDP loop, counted by ``benchmarks/step_calls.py``.

* The counter itself: it sees host reads (``float()``, ``item``, ``tolist``, ...), collectives
  and store operations, each with the line that made it; without this a counter broken by a torch
  upgrade would pass the two-rank test with nothing counted.
* The progress bar and the progress lines of a log file read no loss from the device per step:
  they show the loss the Logger last wrote; when no Logger writes it, they read it only when they
  show it (a line; a redraw of the bar at most once a second; the end of the run).
* A real 2-rank gloo run of the three loops: the Engine issues exactly the raw loop's collectives
  (DDP's: one gradient all-reduce per step, two broadcasts when DDP rebuilds its buckets after the
  first step) and no host read. The Trainer, with the progress bar drawn, a ConsoleLogger and a
  FileLogger, adds only at its log steps: one all-reduce of the loss (every rank) and one host
  read of the averaged loss (rank 0, the rank that writes). Until the Trainer hands its Logger to
  the bar, the bar also reads the loss once per epoch, at the epoch's last batch.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from distributed import ROOT, check, fork_run
from kiln.core.time import Time, Timestamp, TimeUnit
from kiln.loggers import Logger, LoggerDestination
from kiln.trainer.progress import ProgressBar


def _load_step_calls():
    spec = importlib.util.spec_from_file_location("step_calls", ROOT / "benchmarks" / "step_calls.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


step_calls = _load_step_calls()


def where(records: list[str]) -> list[str]:
    """``tolist at kiln/loggers/logger.py:124 (_metrics_to_python)`` without its line number."""
    return [re.sub(r":\d+ \(", " (", record) for record in records]


# -- the counter ------------------------------------------------------------------------------------
def test_the_counter_sees_host_reads_collectives_and_store_operations():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    store = dist.HashStore()
    x = torch.tensor([1.5])
    with step_calls.StepCalls() as calls:
        calls.next_step()
        float(x), x.item(), x.tolist(), bool(x > 0), int(x), f"{x[0]:.2f}", x.numpy()
        dist.all_reduce(x)
        dist.barrier()
        store.set("key", "value")
        calls.next_step()
        torch.ones(2) * 2  # no read
    setup, first, second = calls.per_step()
    me = "test_step_calls.py (test_the_counter_sees_host_reads_collectives_and_store_operations)"
    assert where(first["host_reads"]) == [
        f"{read} at {me}" for read in ("__float__", "item", "tolist", "__bool__", "__int__", "__format__", "numpy")
    ]
    assert first["collectives"] == {"c10d::allreduce_": 1, "c10d::barrier": 1}
    assert where(first["python_collectives"]) == [f"all_reduce at {me}", f"barrier at {me}"]
    assert where(first["store_ops"]) == [f"set at {me}"]
    assert setup == {"step": "setup", "collectives": {}, "python_collectives": [], "store_ops": [], "host_reads": []}
    assert second == {"step": 2, "collectives": {}, "python_collectives": [], "store_ops": [], "host_reads": []}


# -- the progress bar and lines ------------------------------------------------------------------------
def _run(bar: ProgressBar, batches: int = 6, total: int | None = None) -> list[dict]:
    """A fit() of ``batches`` through ``bar`` (the bar redrawing on every batch, the loop calling
    ``update`` when it is due, as the Trainer does); the host reads per batch."""
    state = SimpleNamespace(
        max_duration=Time(total or batches, TimeUnit.BATCH),
        timestamp=Timestamp(),
        dataloader_len=batches,
        loss=torch.tensor(0.75),
        lr=0.1,
        metrics={},
        stop_reason=None,
        _stop=False,
    )
    with step_calls.StepCalls() as calls:
        bar.start(state)
        if bar._bar is not None:
            bar._bar.mininterval = 0  # redraw on every update, as a slow step would
        for _ in range(batches):
            calls.next_step()
            state.timestamp.advance_batch(4, 0, 0.01)
            if state.timestamp._batch >= bar.due_batch or time.perf_counter() >= bar.due_time:
                bar.update(state)
        calls.next_step()
        bar.finish(state)
    return calls.per_step()


def _reads(steps: list[dict]) -> dict:
    return {s["step"]: where(s["host_reads"]) for s in steps if s["host_reads"]}


def test_the_progress_bar_and_lines_show_the_logged_loss_and_read_nothing():
    logger = Logger([LoggerDestination()], rank=0)
    logger.latest.update({"train/loss": 0.25, "train/lr": 0.5})  # what log_metrics leaves there
    stream, lines = step_calls.TerminalStream(), io.StringIO()
    steps = _run(ProgressBar(stream=stream, logger=logger, console_interval="1h", console_stream=lines), 50)
    assert [s["host_reads"] for s in steps] == [[]] * len(steps)
    assert "50/50" in stream.getvalue() and "loss=0.25, lr=0.5" in stream.getvalue()
    assert len(re.findall(r"^\S+ step ", lines.getvalue(), re.M)) == 9 and "loss 0.25  lr 0.5" in lines.getvalue()


def test_without_a_logged_loss_it_is_read_only_when_shown():
    # the bar: at its first redraw, then at most once a second of redraws, and at the end
    stream = step_calls.TerminalStream()
    steps = _run(ProgressBar(stream=stream, console_interval=None))
    assert _reads(steps) == {1: ["__float__ at kiln/trainer/progress.py (_loss)"], 7: [f"__float__ at {LOSS}"]}
    assert "loss=0.75, lr=0.1" in stream.getvalue()
    # lines: one read per step line (each tenth of a 50-step run) and the summary line, no other
    lines = io.StringIO()
    steps = _run(ProgressBar(stream=io.StringIO(), console_interval="1h", console_stream=lines), 50)
    assert _reads(steps) == {step: [f"__float__ at {LOSS}"] for step in (5, 10, 15, 20, 25, 30, 35, 40, 45, 51)}
    assert lines.getvalue().count("loss 0.75") == 10


LOSS = "kiln/trainer/progress.py (_loss)"


# -- a real two-rank run ----------------------------------------------------------------------------
STEPS, EPOCH_BATCHES, LOG_INTERVAL = 12, 6, 4


def ddp_collectives(step: int | str) -> dict[str, int]:
    """What a raw DDP loop issues: one gradient all-reduce per step (the MLP's gradients fit one
    bucket); in the second step's forward DDP rebuilds its buckets in the order the first backward
    produced them (two broadcasts)."""
    if step == "setup":
        return {}
    return {"c10d::allreduce_": 1, **({"c10d::broadcast_": 2} if step == 2 else {})}


@pytest.mark.world_size(2)
@pytest.mark.timeout(240)
def test_a_two_rank_trainer_adds_collectives_and_host_reads_only_at_log_steps(tmp_path):
    check(
        fork_run(
            ROOT / "benchmarks" / "step_calls.py",
            "--out",
            str(tmp_path),
            "--steps",
            str(STEPS),
            "--epoch-batches",
            str(EPOCH_BATCHES),
            "--log-interval",
            str(LOG_INTERVAL),
            timeout=200,
        )
    )
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        raw, engine, trainer = (result["loops"][name] for name in ("raw", "engine", "trainer"))
        assert [entry["step"] for entry in raw] == ["setup", *range(1, STEPS + 1)]
        for entry in raw:
            assert entry == {
                "step": entry["step"],
                "collectives": ddp_collectives(entry["step"]),
                "python_collectives": [],
                "store_ops": [],
                "host_reads": [],
            }, f"rank {rank}, raw"
        assert engine == raw, f"rank {rank}: the Engine loop differs from the raw loop"

        assert [entry["step"] for entry in trainer] == ["setup", *range(1, STEPS + 1)]
        for entry in trainer:
            step = entry["step"]
            logs = step != "setup" and step % LOG_INTERVAL == 0
            collectives = ddp_collectives(step)
            if logs:  # train/loss averaged across ranks, on every rank
                collectives["c10d::allreduce_"] += 1
            reads = []
            if logs and rank == 0:  # the loggers write on rank 0: one copy of the loss to the host
                reads.append("tolist at kiln/loggers/logger.py (_metrics_to_python)")
            # the bar and the lines show the loss the loggers wrote: they read nothing
            assert result["bar_shows_logged"]
            assert entry["collectives"] == collectives, f"rank {rank}, trainer step {step}: {entry}"
            assert where(entry["python_collectives"]) == (
                ["all_reduce at kiln/trainer/trainer.py (_log_train)"] if logs else []
            ), f"rank {rank}, step {step}"
            assert sorted(where(entry["host_reads"])) == sorted(reads), f"rank {rank}, trainer step {step}"
            assert entry["store_ops"] == [], f"rank {rank}, trainer step {step}"

        # The run was what it says: the bar (one over the run's two epochs) and the lines on rank 0,
        # both loggers written every 4 batches.
        if rank == 0:
            assert result["bar_enabled"] and f"{STEPS}/{STEPS}" in result["bar"] and "loss=" in result["bar"]
            steps = re.findall(r"^\S+ step (\d+)/", result["lines"], re.M)
            assert steps == ["2", "3", "4", "5", "6", "8", "9", "10", "11"], result["lines"]  # each tenth
            assert "loss " in result["lines"] and "done: step 12/12" in result["lines"]
            logged = [json.loads(line)["step"] for line in result["logged"].splitlines()]
            assert logged == [4, 8, 12]
            # each console line: the time of day, then the batch
            assert [line.split("]")[0] for line in result["console"].splitlines()] == [
                f"{clock} [batch {step}"
                for clock, step in zip(re.findall(r"^(\d\d:\d\d:\d\d) ", result["console"], re.M), (4, 8, 12))
            ]
            assert len(result["console"].splitlines()) == 3
        else:
            assert not result["bar_enabled"] and result["bar"] == result["lines"] == result["console"] == ""
