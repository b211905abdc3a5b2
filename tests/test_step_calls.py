"""Collectives and host reads per training step (issue 13): kiln's Engine and Trainer against a raw
DDP loop, counted by ``benchmarks/step_calls.py``.

* The counter itself: it sees host reads (``float()``, ``item``, ``tolist``, ...), collectives
  and store operations, each with the line that made it; without this a counter broken by a torch
  upgrade would pass the two-rank test with nothing counted.
* The progress bar reads no loss from the device while an epoch runs: it shows the loss the
  Logger last wrote, or reads it once per epoch when nothing was logged.
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
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from distributed import ROOT, check, kiln_run
from kiln.core.time import Time, Timestamp, TimeUnit
from kiln.loggers import Logger
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


# -- the progress bar -------------------------------------------------------------------------------
def _epoch(bar: ProgressBar, batches: int = 6) -> list[dict]:
    """Run one epoch of ``batches`` through ``bar`` (redrawing on every batch); the host reads per batch."""
    state = SimpleNamespace(
        max_duration=Time(batches, TimeUnit.BATCH),
        timestamp=Timestamp(),
        dataloader_len=batches,
        loss=torch.tensor(0.75),
        lr=0.1,
    )
    with step_calls.StepCalls() as calls:
        bar.start_epoch(state)
        if bar._bar is not None:
            bar._bar.mininterval = 0  # redraw on every update, as a slow step would
        for _ in range(batches):
            calls.next_step()
            state.timestamp.advance_batch(4, 0, 0.01)
            bar.update(state)
        calls.next_step()
        bar.end_epoch(state)
        bar.close()
    return calls.per_step()


def test_the_progress_bar_shows_the_logged_loss_and_reads_nothing():
    logger = Logger([], rank=0)
    logger.latest.update({"train/loss": 0.25, "train/lr": 0.5})  # what log_metrics leaves there
    stream = step_calls.TerminalStream()
    steps = _epoch(ProgressBar(stream=stream, logger=logger))
    assert [s["host_reads"] for s in steps] == [[]] * len(steps)
    assert "6/6" in stream.getvalue() and "loss=0.25, lr=0.5" in stream.getvalue()


def test_the_progress_bar_without_a_logged_loss_reads_it_once_per_epoch():
    stream = step_calls.TerminalStream()
    steps = _epoch(ProgressBar(stream=stream))
    reads = {s["step"]: where(s["host_reads"]) for s in steps if s["host_reads"]}
    assert reads == {6: ["__float__ at kiln/trainer/progress.py (_loss)"]}, "read on the epoch's last batch only"
    assert "loss=0.75, lr=0.1" in stream.getvalue()

    not_a_terminal = io.StringIO()
    steps = _epoch(ProgressBar(stream=not_a_terminal))
    reads = {s["step"]: where(s["host_reads"]) for s in steps if s["host_reads"]}
    assert reads == {7: ["__float__ at kiln/trainer/progress.py (_loss)"]}, "the summary line's read, at epoch end"
    assert not_a_terminal.getvalue().startswith("epoch 1: 6 batches, loss 0.75")


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
        kiln_run(
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
            epoch_ends = step != "setup" and step % EPOCH_BATCHES == 0
            if epoch_ends and rank == 0 and not result["bar_shows_logged"]:
                # Until the Trainer hands its Logger to the bar (ProgressBar(logger=...)), the bar has
                # no logged loss and reads the loss once per epoch, at its last batch.
                reads.append("__float__ at kiln/trainer/progress.py (_loss)")
            assert entry["collectives"] == collectives, f"rank {rank}, trainer step {step}: {entry}"
            assert where(entry["python_collectives"]) == (
                ["all_reduce at kiln/trainer/trainer.py (_log_train)"] if logs else []
            ), f"rank {rank}, step {step}"
            assert sorted(where(entry["host_reads"])) == sorted(reads), f"rank {rank}, trainer step {step}"
            assert entry["store_ops"] == [], f"rank {rank}, trainer step {step}"

        # The run was what it says: the bar drawn on rank 0, both loggers written every 4 batches.
        if rank == 0:
            assert result["bar_enabled"] and result["bar"].count(f"{EPOCH_BATCHES}/{EPOCH_BATCHES}") == 2
            assert "loss=" in result["bar"]
            logged = [json.loads(line)["step"] for line in result["logged"].splitlines()]
            assert logged == [4, 8, 12]
            assert [line.split("]")[0] for line in result["console"].splitlines()] == [
                "[batch 4",
                "[batch 8",
                "[batch 12",
            ]
        else:
            assert not result["bar_enabled"] and result["bar"] == "" and result["console"] == ""
