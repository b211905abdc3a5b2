"""ProfilerCallback: torch.profiler over the scheduled batches of a Trainer run; the TensorBoard and
Chrome traces parse and hold the scheduled steps' ops, and the memory timeline is written."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from kiln.callbacks import ProfilerCallback


def _fit(profiler, batches=8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(batches * 4, 8)
    trainer = kiln.Trainer(
        model,
        train_dataloader=DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4),
        criterion=nn.CrossEntropyLoss(),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        max_duration="1ep",
        progress_bar=False,
        callbacks=[profiler],
    )
    trainer.fit()
    trainer.close()


def _steps(trace):
    """The profiler steps (batches, counted from 0) a trace recorded, and its op names."""
    events = json.loads(trace.read_text())["traceEvents"]
    steps = sorted(int(m.group(1)) for e in events if (m := re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", ""))))
    ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    return steps, ops


def test_traces_hold_only_the_scheduled_batches(tmp_path):
    # 8 batches: batch 1 waits, 2 warms up, 3-4 record; again 5 / 6 / 7-8
    profiler = ProfilerCallback(tmp_path, wait=1, warmup=1, active=2, repeat=2, memory=True)
    _fit(profiler)
    tensorboard = sorted(tmp_path.glob("rank0.*.pt.trace.json"))
    assert len(tensorboard) == 2
    chrome = sorted((tmp_path / "chrome").iterdir())
    assert [p.name for p in chrome] == ["rank0-ba4.json", "rank0-ba8.json"]
    for trace, steps in ((chrome[0], [2, 3]), (chrome[1], [6, 7])):
        recorded, ops = _steps(trace)
        assert recorded == steps, trace.name  # profiler steps count from 0: batches 3-4, then 7-8
        assert {"aten::addmm", "aten::relu"} <= ops, sorted(ops)[:20]  # the forward's ops
    assert {_steps(p)[0][0] for p in tensorboard} == {2, 6}
    memory = sorted(p.name for p in (tmp_path / "memory").iterdir())
    assert memory in (["rank0-ba4.html", "rank0-ba8.html"], ["rank0-ba4.json", "rank0-ba8.json"])
    assert all(p.stat().st_size > 0 for p in (tmp_path / "memory").iterdir())
    assert set(profiler.traces) == {*tensorboard, *chrome, *(tmp_path / "memory").iterdir()}


def test_a_run_shorter_than_the_schedule_writes_what_it_recorded_and_chrome_alone(tmp_path):
    profiler = ProfilerCallback(tmp_path, skip_first=2, warmup=1, active=10, tensorboard=False)
    _fit(profiler, batches=6)  # skips 1-2, warms up 3, records 4-6 until fit ends
    assert not list(tmp_path.glob("*.pt.trace.json"))
    (chrome,) = (tmp_path / "chrome").iterdir()
    assert chrome.name == "rank0-ba6.json"
    # batches 4-6, then the step still open when fit() stopped the profiler (the end of the run)
    assert _steps(chrome)[0] == [3, 4, 5, 6]


def test_other_ranks_and_bad_schedules():
    profiler = ProfilerCallback("unused", ranks=[1])
    state = kiln.State(nn.Linear(1, 1), rank=0)
    profiler.fit_start(state, None)
    profiler.batch_end(state, None)
    assert profiler._profiler is None and profiler.traces == []
    with pytest.raises(ValueError, match=r"ProfilerCallback active=0 must be an integer >= 1"):
        ProfilerCallback(active=0)
    with pytest.raises(ValueError, match="writes nothing"):
        ProfilerCallback(chrome=False, tensorboard=False)
