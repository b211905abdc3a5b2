"""Nothing logged is lost to a crash, a full disk leaves no debris, a damaged ``last`` is skipped.

- A 2-rank Trainer with a FileLogger (its defaults: 100 records per flush) dies at batch 10, each
  way a job dies: a peer SIGKILLed, an exception in rank 0's forward, SIGTERM (plain, and kiln's
  preemption with a save folder). Every step logged before the end is in metrics.jsonl, exactly.
  A SIGKILL of the logging rank itself, after the records are older than the flush interval,
  keeps them too (the flush timer; tests/workers/crash_logging.py).
- A save that runs out of space says so in one line, keeps ``last`` and removes its ``*.tmp-*``
  folder (synchronous and background saves).
- Autoresume with a truncated shard in the newest checkpoint names it in one line and resumes from
  the newest that verifies, logging on into the same file; an explicit ``load_path`` to it fails.
"""

from __future__ import annotations

import errno
import json
import re
import signal
import time
import warnings

import pytest
import torch
from torch import nn

import kiln
from distributed import WORKERS, fork_run
from kiln.checkpoint import CheckpointError, hashing, layout, save_checkpoint
from kiln.checkpoint.async_save import start_async_save
from kiln.core.warn import KilnWarning
from kiln.launch.runlock import LOCK_NAME
from kiln.loggers import FileLogger
from kiln.loggers.flushing import DEFAULT_FLUSH_SECS
from workers.ckpt_common import build_state, train

WORKER = WORKERS / "crash_logging.py"
_real_write = hashing.HashingStream.write
STEPS_BEFORE_10 = list(range(1, 10))


def _records(out) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _train_steps(out) -> list[int]:
    return [r["step"] for r in _records(out) if "train/loss" in r.get("metrics", {})]


@pytest.mark.parametrize(
    "how, status",
    [("peer-sigkill", -signal.SIGKILL), ("raise", 1), ("sigterm", -signal.SIGTERM)],
    ids=["peer-sigkilled", "exception-in-forward", "sigterm"],
)
def test_a_crash_at_batch_10_keeps_every_earlier_step(tmp_path, how, status):
    result = fork_run(WORKER, str(tmp_path), how, "10", timeout=120)
    assert result.returncode == status, result.stderr[-3000:]
    assert _train_steps(tmp_path) == STEPS_BEFORE_10
    assert all(set(r["metrics"]) == {"train/loss", "train/lr"} for r in _records(tmp_path))


def test_sigterm_with_a_save_folder_checkpoints_and_keeps_every_step(tmp_path):
    result = fork_run(WORKER, str(tmp_path), "sigterm", "10", "--save", timeout=120)
    assert result.returncode == kiln.checkpoint.PREEMPTED_EXIT_CODE, result.stderr[-3000:]
    # preempted at the end of batch 10: its step is logged and checkpointed, then the exit
    assert _train_steps(tmp_path) == list(range(1, 11))
    assert layout.link_target(tmp_path / "ckpt", "last") == "ep0-ba10"


def test_sigkill_of_the_logging_rank_loses_no_step_older_than_the_flush_interval(tmp_path):
    # rank 0 waits 2 * flush_secs after logging step 9, then is SIGKILLed: no exit path runs, the
    # 9 records are far below flush_interval (100), so only the timer can have written them
    result = fork_run(WORKER, str(tmp_path), "self-sigkill", "10", timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert _train_steps(tmp_path) == STEPS_BEFORE_10
    assert DEFAULT_FLUSH_SECS == 2.0


def test_the_flush_timer_writes_within_flush_secs_without_another_record(tmp_path):
    file_logger = FileLogger(tmp_path / "m.jsonl", flush_secs=0.2)
    try:
        file_logger.log_metrics({"a": 1.0}, step=1)
        assert (tmp_path / "m.jsonl").read_text() == ""  # buffered: one record of 100
        deadline = time.monotonic() + 5
        while (tmp_path / "m.jsonl").read_text() == "" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "m.jsonl").read_text() == '{"step": 1, "metrics": {"a": 1.0}}\n'
    finally:
        file_logger.close()
    with pytest.raises(ValueError, match="FileLogger flush_secs must be a number of seconds > 0, got 0"):
        FileLogger(tmp_path / "n.jsonl", flush_secs=0)


# -- a full disk ------------------------------------------------------------------------------------
@pytest.fixture
def disk_full(monkeypatch):
    """Every DCP data file fails at its first write with ENOSPC, after rank<r>.pt was written."""
    write = hashing.HashingStream.write

    def fail(self, data):
        if self.name.endswith(".distcp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, data)

    monkeypatch.setattr(hashing.HashingStream, "write", fail)


def _entries(folder) -> set[str]:
    return {p.name for p in folder.iterdir() if p.name != LOCK_NAME}


def test_a_save_without_space_says_so_in_one_line_and_removes_its_tmp_folder(tmp_path, monkeypatch, disk_full):
    folder = tmp_path / "run"
    state = build_state()
    train(state, 2)
    with monkeypatch.context() as undo:
        undo.setattr(hashing.HashingStream, "write", _real_write)
        save_checkpoint(folder, state)
    train(state, 1)
    removed = []
    remove = layout.remove_checkpoint
    monkeypatch.setattr(layout, "remove_checkpoint", lambda path: (removed.append(path.name), remove(path)))
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(folder, state)
    message = str(err.value)
    assert "\n" not in message
    assert re.fullmatch(
        rf"checkpoint {re.escape(str(folder))}/ep0-ba3\.tmp-[0-9a-f]{{12}}: could not be written "
        r"\(OSError: \[Errno 28\] No space left on device\); check free space and permissions of the "
        r"save folder; the previous checkpoint is intact",
        message,
    ), message
    assert len(removed) == 1 and layout.is_temporary(removed[0]) and removed[0].startswith("ep0-ba3.tmp-")
    assert _entries(folder) == {"ep0-ba2", "last"}
    assert layout.link_target(folder, "last") == "ep0-ba2"


def test_a_background_save_without_space_removes_its_tmp_folder(tmp_path, monkeypatch, disk_full):
    folder = tmp_path / "run"
    state = build_state()
    train(state, 2)
    with monkeypatch.context() as undo:
        undo.setattr(hashing.HashingStream, "write", _real_write)
        save_checkpoint(folder, state)
    train(state, 1)
    error = start_async_save(folder, state, "sharded").wait()
    assert isinstance(error, CheckpointError) and "No space left on device" in error.problem
    assert "\n" not in str(error)
    assert _entries(folder) == {"ep0-ba2", "last"}
    assert layout.link_target(folder, "last") == "ep0-ba2"


# -- a damaged newest checkpoint ---------------------------------------------------------------------
def test_autoresume_skips_a_truncated_newest_checkpoint_and_logs_on(tmp_path):
    # dies in forward of batch 7, after the checkpoints of batches 2, 4 and 6
    crashed = fork_run(WORKER, str(tmp_path), "raise", "7", "--save", timeout=120)
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    assert layout.link_target(ckpt, "last") == "ep0-ba6"
    shard = max((ckpt / "ep0-ba6").glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)

    resumed = fork_run(WORKER, str(tmp_path), "none", "0", "--save", "--autoresume", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = [line for line in resumed.stderr.splitlines() if line.startswith("kiln: autoresume")]
    assert lines == [
        f"kiln: autoresume: {ckpt.resolve()}/ep0-ba6 is damaged ({shard.resolve()}: is truncated or altered: "
        f"{size // 2} bytes, the manifest says {size}); resumed from {ckpt.resolve()}/ep0-ba4, the newest "
        "checkpoint that verifies"
    ]
    records = _records(tmp_path)
    resumed_at = [r["step"] for r in records if "checkpoint/resumed" in r.get("metrics", {})]
    assert resumed_at == [4]
    # the crashed run's steps 1-6, then the resumed run's 5-40, in the same file
    assert _train_steps(tmp_path) == list(range(1, 7)) + list(range(5, 41))


def _trainer(folder, **kwargs):
    kiln.seed_everything(0)
    model = nn.Linear(8, 4)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 4, (48,), generator=g))
    return kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=8),
        max_duration="6ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        save_folder=folder,
        save_interval="2ba",
        progress_bar=False,
        **kwargs,
    )


def test_an_explicit_load_path_to_a_damaged_checkpoint_still_fails(tmp_path):
    folder = tmp_path / "ckpt"
    trainer = _trainer(folder)
    trainer.fit()
    trainer.close()
    expected = {
        k: v.clone() for k, v in _trainer(tmp_path / "x", load_path=folder / "ep0-ba4").state.model.state_dict().items()
    }
    shard = max((folder / "ep0-ba6").glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 1)
    problem = rf"checkpoint {re.escape(str(shard.resolve()))}: is truncated or altered: {size - 1} bytes, the manifest says {size}"
    for load_path in (folder / "ep0-ba6", "last"):  # the checkpoint itself, or the link to it
        with pytest.raises(CheckpointError, match=problem):
            _trainer(folder, load_path=load_path)
    # the same folder under autoresume: skipped, in one line, and ep0-ba4's weights loaded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _trainer(folder, autoresume=True)
    said = [str(w.message) for w in caught if issubclass(w.category, KilnWarning)]
    assert said == [
        f"autoresume: {folder.resolve()}/ep0-ba6 is damaged ({shard.resolve()}: is truncated or altered: "
        f"{size - 1} bytes, the manifest says {size}); resumed from {folder.resolve()}/ep0-ba4, the newest "
        "checkpoint that verifies"
    ]
    assert resumed.state.timestamp.batch.value == 4
    for key, value in resumed.state.model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    resumed.close()
