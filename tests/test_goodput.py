"""The goodput account (issue 35, items 3 and 4): tests that know the answer.

* A run SIGKILLed once batch 10 is done (checkpoints at 4 and 8) and resumed by autoresume a second
  later (real processes, both forked from the warm server of tests/distributed.py, the resume with
  the pointer file `kiln run` hands its workers): the account says 2 steps lost (10 - 8), the
  resumed launch's recovery runs from the killed launch's last record to its first step (the time
  the worker itself logged, within 0.15 s), each launch's segments add up to its wall time within
  1%, `kiln run`'s goodput line (kiln.cli.run.goodput_line, from the pointer) says so and `kiln report`
  (in this process) prints the table and the figure (goodput.svg). That a real `kiln run` prints the
  line at a job's end: tests/test_multinode.py's elastic drill.
* A save stall injected as a 1.0 s sleep per save (two saves) is 2.0 s of checkpoint stall within 10%.
* A loader whose ``__getitem__`` sleeps 0.05 s (two items a batch) is 0.1 s of data wait per step
  after the first, within 10%.

Guards broken on purpose, each failing its test (then restored): the data-wait charge in
``GoodputMonitor.after_dataloader`` removed (the sum and data-wait tests failed); the save timer
not registered before the saver (the stall test failed: 0 s); ``fold_failure``'s lost steps
computed from ``first_step`` (the lost-steps test failed).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

import kiln
from distributed import WORKERS, fork_run
from kiln.cli.run import goodput_line
from kiln.report.goodput import POINTER_ENV, SEGMENTS, fraction, read_account
from kiln.trainer.goodput import GoodputMonitor

WORKER = WORKERS / "goodput_worker.py"


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    out = tmp_path_factory.mktemp("goodput")
    killed = fork_run(WORKER, str(out), "--kill-at", "10", nproc=1, timeout=180)
    first = read_account(out / "ckpt.goodput.json")
    # The restart comes a second after the death, as a scheduler's would: the recovery must count
    # that downtime, not only the new process's start (short for a rank forked from a warm process).
    time.sleep(1.0)
    # the file `kiln run` hands its workers, into which rank 0 writes the path of its account
    pointer = out / "pointer.txt"
    pointer.write_text("")
    resumed = fork_run(WORKER, str(out), nproc=1, timeout=240, env={POINTER_ENV: str(pointer)})
    return out, killed, first, resumed, goodput_line(str(pointer))


def _steps(out):
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def test_a_killed_run_resumed_reports_exactly_the_steps_lost(crashed):
    out, killed, first, resumed, _ = crashed
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [(x["ended"], x["last_step"]) for x in first] == [(False, 10)]  # step 10's record was written
    launches = read_account(out / "ckpt.goodput.json")
    assert [(x["first_step"], x["last_step"], x["ended"]) for x in launches] == [(0, 10, False), (8, 16, True)]
    assert [x["lost_steps"] for x in launches] == [2, 0]  # computed to 10, resumed from the checkpoint at 8
    # the lost seconds: the killed launch's time after the commit at 8, at most steps 9 and 10 and the rest
    steps = _steps(out)
    pids = list(dict.fromkeys(x["pid"] for x in steps))
    end_8, end_10 = (next(x["time"] for x in steps if x["pid"] == pids[0] and x["batch"] == b) for b in (8, 10))
    assert 0 < launches[0]["seconds"]["lost"] <= end_10 - end_8 + 0.15
    assert launches[0]["seconds"]["recovery"] == 0 and launches[1]["seconds"]["starting"] == 0


def test_recovery_runs_from_the_failure_to_the_first_step(crashed):
    out, _, _, _, _ = crashed
    launches = read_account(out / "ckpt.goodput.json")
    steps = _steps(out)
    pids = list(dict.fromkeys(x["pid"] for x in steps))
    first_step = next(x["time"] for x in steps if x["pid"] == pids[1])  # batch 9's end, in the resumed process
    expected = first_step - launches[0]["end"]
    print(f"recovery {launches[1]['seconds']['recovery']:.2f} s, measured by the worker {expected:.2f} s")
    assert expected > 1.0  # a new process, torch, the Trainer, the load
    assert abs(launches[1]["seconds"]["recovery"] - expected) < 0.15


def test_each_launch_s_segments_add_up_to_its_wall_time(crashed):
    out, _, _, _, _ = crashed
    launches = read_account(out / "ckpt.goodput.json")
    for launch in launches:
        wall = launch["end"] - launch["begin"]  # Unix times: the process's start (or the failure) to the last record
        total = sum(launch["seconds"].values())
        assert set(launch["seconds"]) == set(SEGMENTS)
        assert all(v >= 0 for v in launch["seconds"].values())
        assert abs(total - wall) <= 0.01 * wall, (total, wall, launch["seconds"])
    assert launches[1]["begin"] == launches[0]["end"]  # recovery starts where the killed launch's record ends
    assert 0 < fraction(launches) < 1


def test_kiln_run_prints_the_goodput_line_and_kiln_report_the_table(crashed, tmp_path, capsys):
    # kiln run's line at the end of a job: goodput_line, what kiln run prints from the account its
    # workers pointed it to (that kiln run prints it last: tests/test_multinode.py's elastic drill)
    out, _, _, resumed, line = crashed
    print(line)
    assert line.startswith("kiln run: goodput ")
    assert "over 2 launches" in line and "steps lost per failure: 2" in line and str(out / "ckpt") in line
    from kiln.cli.main import main

    capsys.readouterr()
    code = main(["report", str(out), "--out", str(tmp_path / "report")])
    result = capsys.readouterr()
    assert code == 0, result.err
    print(result.out)
    assert "steps lost per failure: 2" in result.out
    rows = [r.split() for r in result.out.splitlines()]
    assert rows[1][:2] == ["1", "0-10"] and rows[2][:2] == ["2", "8-16"] and rows[3][0] == "all"
    assert (tmp_path / "report" / "goodput.svg").stat().st_size > 0
    assert "Goodput" in (tmp_path / "report" / "report.html").read_text()
    metrics = [json.loads(x)["metrics"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if "goodput/fraction" in m][-1]
    assert 0 < last["goodput/fraction"] <= 1 and last["goodput/lost_steps"] == 2
    assert {f"goodput/seconds/{k}" for k in SEGMENTS} <= set(last)


class _Slow(torch.utils.data.Dataset):
    def __init__(self, n: int, sleep: float) -> None:
        self.n, self.sleep = n, sleep

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if self.sleep:
            time.sleep(self.sleep)
        return torch.full((4,), float(i)), i % 2


def _fit(tmp_path, batches: int, sleep: float = 0.0, **kwargs) -> GoodputMonitor:
    model = nn.Linear(4, 2)
    monitor = GoodputMonitor(start=time.time())
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(_Slow(2 * batches, sleep), batch_size=2),
        max_duration=f"{batches}ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        progress_bar=False,
        goodput=monitor,
        **kwargs,
    )
    trainer.fit()
    trainer.close()
    return monitor


def test_a_save_stall_shows_as_checkpoint_seconds(tmp_path, monkeypatch):
    import kiln.checkpoint.saver as saver

    _fit(tmp_path / "warm", 2, save_folder=tmp_path / "warm", save_interval="1ba")  # checkpoint code loaded
    # the same two saves without the sleep: what the saves themselves cost on this machine now
    baseline = _fit(tmp_path / "base", 8, save_folder=tmp_path / "base", save_interval="4ba").seconds["checkpoint"]
    real = saver.save_checkpoint

    def slow(*args, **kwargs):
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(saver, "save_checkpoint", slow)
    monitor = _fit(tmp_path, 8, save_folder=tmp_path / "ckpt", save_interval="4ba")  # saves at 4 and 8
    stall = monitor.seconds["checkpoint"]
    print(f"checkpoint stall {stall:.3f} s for 2.0 s injected (saves alone: {baseline:.3f} s)")
    assert 2.0 <= stall <= 2.2 + baseline  # the sleep, within 10%, and what the saves themselves cost
    assert read_account(tmp_path / "ckpt.goodput.json")[0]["seconds"]["checkpoint"] == stall


def test_a_slow_loader_shows_as_data_wait(tmp_path):
    # the same batches without the sleep: what fetching and collating cost on this machine now
    # (under the whole suite's load, up to 0.16 s of the 10 fetches)
    baseline = _fit(tmp_path / "base", 11).seconds["data"]
    monitor = _fit(tmp_path, 11, sleep=0.05)  # 0.1 s a batch; the first fetch is part of starting
    data = monitor.seconds["data"]
    print(f"data wait {data:.3f} s for 1.0 s injected (fetching alone: {baseline:.3f} s)")
    assert 1.0 <= data <= 1.1 + baseline  # the sleep, within 10%, and what the fetches themselves cost
    assert monitor.seconds["checkpoint"] == 0 and monitor.seconds["productive"] < data


def test_the_switch_leaves_the_account_out_and_bad_values_are_refused(tmp_path):
    model = nn.Linear(4, 2)
    trainer = kiln.Trainer(model, criterion=nn.CrossEntropyLoss(), goodput=False, progress_bar=False)
    assert trainer.goodput is None and not any(isinstance(c, GoodputMonitor) for c in trainer.state.callbacks)
    with pytest.raises(ValueError, match="goodput='yes' must be True"):
        kiln.Trainer(model, criterion=nn.CrossEntropyLoss(), goodput="yes")
    with pytest.raises(ValueError, match="interval=-1"):
        GoodputMonitor(interval=-1)


def test_kiln_run_prints_nothing_without_an_account(tmp_path):
    from kiln.cli.run import goodput_line

    pointer = tmp_path / "pointer"
    assert goodput_line(str(pointer)) is None  # never written: no Trainer, or goodput=False
    pointer.write_text("")
    assert goodput_line(str(pointer)) is None
    pointer.write_text(str(tmp_path / "missing.json"))
    assert goodput_line(str(pointer)) is None
