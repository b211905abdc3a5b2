"""tests/distributed.py's fork_run, which most multi-process tests start their ranks with: each rank
a process of its own with torchrun's variables, the job's environment and working directory, its
output returned, and a failing rank's status (the others stopped, as torchrun's agent stops them)."""

from __future__ import annotations

import os

from distributed import WORKERS, fork_run

PROBE = WORKERS / "fork_probe.py"


def test_every_rank_runs_in_its_own_process_with_the_jobs_environment(tmp_path):
    job = fork_run(PROBE, "ok", nproc=3, env={"KILN_FORK_PROBE": "yes"}, cwd=tmp_path, timeout=60)
    assert job.returncode == 0, job.stderr
    lines = job.stdout.splitlines()
    assert lines == [f"rank {r} of 3 cwd={tmp_path} probe=yes threads=1 loader=15" for r in range(3)]
    assert job.stderr.splitlines() == [f"rank {r} done" for r in range(3)]
    assert "KILN_FORK_PROBE" not in os.environ  # the job's variables stay in the job


def test_a_failing_rank_fails_the_job_and_its_peer_is_stopped(tmp_path):
    job = fork_run(PROBE, "fail", nproc=2, cwd=tmp_path, timeout=120)
    assert job.returncode == 1
    assert "RuntimeError: planned failure on rank 1" in job.stderr
    assert "rank 0 done" not in job.stderr  # rank 0 waited in the barrier until it was stopped


def test_the_first_nonzero_exit_status_is_the_jobs(tmp_path):
    job = fork_run(PROBE, "exit3", nproc=2, cwd=tmp_path, timeout=120)
    assert job.returncode == 3
    assert "rank 0 done" in job.stderr
