"""kiln.planning.rank_workers: a dry run's ranks measured side by side in forked processes.

Each rank in a fresh fork of this process, results in rank order, a worker's error raised here with
its message, a worker that dies named with its exit code, and no hang after this process has run
ATen's OpenMP threads (a fork has none of them: the first parallel op in the worker waited for them
forever; that was Llama-3-70B's dry run, hanging in an ``arange``). Broken on purpose: without the
worker's ``torch.set_num_threads(1)``, the subprocess below does not finish in its 60 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kiln.planning.rank_workers import can_fork, measure_ranks

pytestmark = pytest.mark.skipif(not can_fork(), reason="the workers are forks")
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(autouse=True)
def _forks_run_autograd(monkeypatch):
    """These workers run no backward: whether a fork of this process could (torch 2.14 refuses one
    after a backward on fake tensors here, which earlier tests run) is not what they test."""
    import kiln.planning.rank_workers as rank_workers

    monkeypatch.setattr(rank_workers, "forks_can_backward", lambda: True)


def test_each_rank_in_a_fresh_fork_results_in_rank_order():
    out = measure_ranks(lambda rank: (rank * rank, os.getpid()), [5, 2, 9], workers=2)
    assert list(out) == [5, 2, 9] and [v for v, _ in out.values()] == [25, 4, 81]
    pids = [pid for _, pid in out.values()]
    assert os.getpid() not in pids and len(set(pids)) == 3


def test_one_worker_measures_here():
    assert measure_ranks(lambda rank: os.getpid(), [0, 1], workers=1) == {0: os.getpid(), 1: os.getpid()}


def _raises_for_three(rank: int) -> int:
    if rank == 3:
        raise ValueError("compute_config.tp: 3 does not divide 8 heads")
    return rank


def test_a_workers_error_is_raised_here_with_its_message():
    with pytest.raises(ValueError, match=r"^compute_config.tp: 3 does not divide 8 heads$"):
        measure_ranks(_raises_for_three, [1, 3, 5], workers=2)


def test_a_worker_that_dies_is_named_with_its_exit_code():
    def dies(rank: int) -> int:
        if rank == 1:
            os._exit(7)
        return rank

    with pytest.raises(RuntimeError, match=r"measuring rank 1 ended with exit code 7 and no report"):
        measure_ranks(dies, [0, 1], workers=2)


def test_no_hang_after_this_process_ran_openmp_threads():
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(SRC)!r})
        import torch
        from kiln.planning.rank_workers import measure_ranks
        torch.set_num_threads(2)
        torch.arange(10**7).sum()  # this process's OpenMP team exists now
        print(measure_ranks(lambda r: int(torch.arange(10**7 + r).sum()), [0, 1, 2], 2))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{0: 49999995000000, 1: 50000005000000, 2: 50000015000001}"


def test_where_a_fork_cannot_run_autograd_the_ranks_are_measured_here(monkeypatch):
    # torch 2.14 refuses a backward in a fork of a process that ran one on fake tensors (an earlier
    # dry run's step); the ranks are then measured one after another in this process
    import kiln.planning.rank_workers as rank_workers

    monkeypatch.setattr(rank_workers, "forks_can_backward", lambda: False)
    assert measure_ranks(lambda rank: os.getpid(), [0, 1, 2], workers=2) == dict.fromkeys([0, 1, 2], os.getpid())


def test_a_fresh_process_forks_that_run_autograd():
    script = f"import sys; sys.path.insert(0, {str(SRC)!r}); from kiln.planning.rank_workers import forks_can_backward; print(forks_can_backward())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True", done.stderr
