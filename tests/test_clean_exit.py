"""Finished jobs exit 0 every time; a rank that raises still fails the job, named (real processes).

Without kiln's teardown about 1 two-rank job in 5 of this worker ends in SIGABRT after every rank
printed "finished" (torch 2.13's gloo threads, see kiln/launch/teardown.py). The abort is a race in
each rank's own interpreter shutdown, so every rank process is one sample of it, whatever the size
of its job or what started it: about 1 rank exit in 10 aborts on the old code.

The guard is in two parts, so that it is sure where a sample cannot be and cheap where a sample is:

* Deterministic: the mechanism. ``teardown()`` releases the GIL before and after it destroys the
  group, also when the script destroyed the group itself (in one process, the calls recorded); and
  in the real job below every rank that left the group to kiln reports that kiln's exit handler
  destroyed it after the script's last line, while Python was still alive. Dropping the handler
  (the old code) or its sleeps fails these every time.
* Stochastic: the symptom. One ``kiln run`` of 3 ranks (rank 1 ends with its own
  ``destroy_process_group()``: the group lives on inside DDP, so the race is the same; ranks 0 and 2
  leave it to kiln) must exit 0 with every rank finished. On the old code it passes about 3 times in
  4 (0.9 ** 3); it was 3 launches x 10 ranks (33 processes, 4% on the old code), then 6 ranks, but
  the deterministic checks above catch the old bug every time, and the sample is left to catch a
  fix that is there but no longer works (each rank ~6 CPU-s: torch, and torch._dynamo for DDP).
  Plain torchrun is not sampled separately any more: the teardown is registered by
  ``kiln.launch_from_torch`` in the rank and runs at the rank's own exit, whichever launcher
  started it.
"""

from __future__ import annotations

import types

import pytest

from distributed import WORKERS, kiln_run
from kiln.launch import teardown

WORKER = WORKERS / "exit_worker.py"
RAISE_LINE = next(i for i, line in enumerate(WORKER.read_text().splitlines(), 1) if "raise RuntimeError" in line)

RANKS = 3  # rank exits sampled in one launch: both ways of ending (own destroy, kiln's), on both sides of one


@pytest.mark.world_size(RANKS)
@pytest.mark.timeout(400)
def test_finished_jobs_exit_zero_every_time():
    result = kiln_run(WORKER, "mixed", nproc=RANKS, timeout=360)
    aborted = result.stderr.count("terminate called without an active exception")
    assert result.returncode == 0, (
        f"exit {result.returncode} after a finished job of {RANKS} ranks"
        f" ({aborted} printed 'terminate called')\n{result.stderr[-3000:]}"
    )
    lines = result.stdout.splitlines()
    missing = [r for r in range(RANKS) if f"rank {r} finished" not in lines]
    assert not missing, f"ranks {missing} did not print 'finished'\n{result.stdout}"
    # the ranks that left the group to kiln: its exit handler destroyed it after their last line
    for r in range(0, RANKS, 2):
        said = f"rank {r}: group destroyed at exit"
        assert said in lines and lines.index(said) > lines.index(f"rank {r} finished"), result.stdout


@pytest.mark.parametrize("script_destroyed", [False, True], ids=["group alive", "script destroyed the group"])
def test_teardown_releases_the_gil_before_and_after_destroying_the_group(monkeypatch, script_destroyed):
    calls = []
    monkeypatch.setattr(teardown, "time", types.SimpleNamespace(sleep=lambda s: calls.append(("sleep", s))))
    fake_dist = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: not script_destroyed,
        destroy_process_group=lambda: calls.append("destroy"),
    )
    monkeypatch.setattr(teardown, "dist", fake_dist)
    monkeypatch.setattr(teardown, "_raised", lambda: False)
    teardown.teardown()
    settle = ("sleep", teardown._SETTLE_SECONDS)
    assert teardown._SETTLE_SECONDS > 0
    # the script's destroy_process_group() leaves the group's threads alive inside DDP: settle anyway
    assert calls == ([settle] if script_destroyed else [settle, "destroy", settle])

    # a rank that raised: settle, but do not tear down a group its peers may still be using
    calls.clear()
    monkeypatch.setattr(teardown, "_raised", lambda: True)
    teardown.teardown()
    assert calls == [settle]


def test_the_teardown_is_registered_once_to_run_at_exit(monkeypatch):
    registered = []
    monkeypatch.setattr(teardown, "_registered", False)
    monkeypatch.setattr(teardown.atexit, "register", registered.append)
    teardown.register_teardown()
    teardown.register_teardown()
    assert registered == [teardown.teardown]


@pytest.mark.world_size(2)
def test_a_rank_that_raises_fails_the_job_and_is_named():
    result = kiln_run(WORKER, "1")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "RuntimeError: planned failure on rank 1" in result.stderr  # the rank's own traceback
    line = next(l for l in result.stderr.splitlines() if l.startswith("kiln run:"))
    assert line.startswith("kiln run: rank 1 (node 0, host "), line
    # rank 0 has finished by the time torchrun sees rank 1 fail, or is stopped by it: either is true
    cause = f"failed first: RuntimeError: planned failure on rank 1 (exit_worker.py:{RAISE_LINE})"
    assert line.endswith((cause, f"{cause}; rank 0 was stopped")), line


def test_describe_failure_puts_the_cause_before_the_ranks_torchrun_stopped():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from kiln.cli.run import describe_failure

    failures = {0: ProcessFailure(0, 101, -15, "<N/A>"), 1: ProcessFailure(1, 102, -6, "<N/A>")}
    line = describe_failure(ChildFailedError("worker", failures))
    assert line.startswith("rank 1 (host "), line
    assert line.endswith(", pid 102) failed first: killed by SIGABRT; rank 0 was stopped"), line
