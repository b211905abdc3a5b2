"""SLURM the way clusters use it (issue 24, item 4).

* A signal ahead of the time limit: ``#SBATCH --signal=USR1@120`` sends SIGUSR1 to ``kiln run``,
  which passes it to its workers; the Trainer checkpoints, rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (a fake ``scontrol`` on PATH records
  its arguments), ``kiln run`` exits 75, and the requeued job, the same command in the same folder,
  autoresumes from that checkpoint: losses and weights as an uninterrupted run's, bit for bit.
  A SIGTERM (``scancel``, SLURM's own preemption) checkpoints without requeueing, unless asked.
* Where rank, world size, local rank and rank 0's address come from in a job step, for SLURM's
  real variable sets of a 1-node and a 2-node job (``srun`` inside ``sbatch``).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import WORKERS, base_env
from kiln.checkpoint import PREEMPTED_EXIT_CODE
from kiln.checkpoint.preemption import Preempted, PreemptionHandler
from kiln.launch.environments import Launcher, detect, node_of, slurm_address

JOB = "4242"
WORKER = WORKERS / "slurm_requeue.py"


def _fake_scontrol(folder: Path) -> Path:
    """An ``scontrol`` that appends its arguments to folder/scontrol.log; returns the log's path."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    log = folder / "scontrol.log"
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n')
    script.chmod(0o755)
    return log


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def _in_process(out: Path, monkeypatch, env: dict[str, str]) -> None:
    """The worker run here (no interpreter start-up to pay for); kiln's context is reset by conftest."""
    with monkeypatch.context() as m:
        for name, value in env.items():
            m.setenv(name, value)
        m.setattr(sys, "argv", [str(WORKER), str(out)])
        runpy.run_path(str(WORKER), run_name="__main__")


def test_sigusr1_checkpoints_requeues_the_job_and_the_requeued_job_resumes_bit_exact(tmp_path, monkeypatch):
    scontrol = _fake_scontrol(tmp_path)
    job, reference = tmp_path / "job", tmp_path / "reference"
    job.mkdir()
    reference.mkdir()
    # what a task of `srun -n 1` inside the allocation sees (one task: no process group to join)
    slurm = {
        "SLURM_JOB_ID": JOB, "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node01",
    }  # fmt: skip
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    # `srun kiln run -n 1 train.py`: the signal reaches kiln run, which passes it to its worker
    first = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "run", "-n", "1", str(WORKER), str(job), "--signal-after", "6"]
        + ["--signal-launcher"],
        env={**base_env(), **slurm, "PATH": path},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert first.returncode == PREEMPTED_EXIT_CODE, first.stderr[-3000:]
    assert scontrol.read_text() == f"requeue {JOB}\n"  # once, by rank 0
    assert f"kiln: SIGUSR1: SLURM job {JOB} requeued (scontrol requeue)" in first.stderr.splitlines()
    assert first.stderr.splitlines()[-1] == (
        "kiln run: preempted: the workers saved a checkpoint and exited 75; the same command resumes from it (autoresume)"
    )
    assert os.readlink(job / "ckpt" / "last") == "ep0-ba6"  # the batch the signal came in
    # SLURM starts the requeued job with the same command (and SLURM_RESTART_COUNT=1)
    _in_process(job, monkeypatch, {**slurm, "SLURM_RESTART_COUNT": "1", "PATH": path})
    _in_process(reference, monkeypatch, {"PATH": path})  # never signalled
    assert scontrol.read_text() == f"requeue {JOB}\n"  # nobody requeued again
    lines, uninterrupted = _lines(job), _lines(reference)
    assert [x["batch"] for x in lines if x.get("event") == "start"] == [0, 6]
    losses = [(x["batch"], x["loss"]) for x in lines if "loss" in x]
    assert losses == [(x["batch"], x["loss"]) for x in uninterrupted if "loss" in x]  # batches 1-32, bit for bit
    assert [x for x in lines if x.get("event") == "end"] == [x for x in uninterrupted if x.get("event") == "end"]


@pytest.mark.parametrize(
    "received, requeue, slurm_job, requeued",
    [
        ("SIGUSR1", None, JOB, True),  # the signal asked for ahead of the time limit
        ("SIGTERM", None, JOB, False),  # scancel, or SLURM's own preemption: checkpoint, no requeue
        ("SIGTERM", True, JOB, True),
        ("SIGUSR1", False, JOB, False),
        ("SIGUSR1", None, None, False),  # not inside a SLURM job
    ],
    ids=["usr1", "term", "term-requeue-true", "usr1-requeue-false", "outside-slurm"],
)
def test_which_signals_requeue(tmp_path, monkeypatch, received, requeue, slurm_job, requeued):
    scontrol = _fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    if slurm_job is None:
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    else:
        monkeypatch.setenv("SLURM_JOB_ID", slurm_job)
    handler = PreemptionHandler(requeue=requeue)
    handler.received = getattr(signal, received)  # what its handler records
    with pytest.raises(Preempted) as stopped:
        handler.exit()
    assert stopped.value.code == PREEMPTED_EXIT_CODE and stopped.value.signal_name == received
    assert (scontrol.read_text() if scontrol.exists() else "") == (f"requeue {JOB}\n" if requeued else "")


# -- where a task is: SLURM's variables for a 1-node and a 2-node job -----------------------------
def _task(common: dict[str, str], procid: int, tasks_per_node: int) -> dict[str, str]:
    return {
        **common,
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid % tasks_per_node),
        "SLURM_NODEID": str(procid // tasks_per_node),
    }


# `sbatch -N 1 --ntasks-per-node 2 --gpus-per-node 2` then `srun python train.py`, as SLURM sets them
ONE_NODE = {
    "SLURM_JOB_ID": "81234", "SLURM_JOBID": "81234", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
    "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
    "SLURM_STEP_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node07", "SLURM_NODELIST": "node07",
    "SLURM_STEP_NODELIST": "node07", "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_GPUS_ON_NODE": "2", "SLURM_CPUS_ON_NODE": "16", "SLURMD_NODENAME": "node07",
}  # fmt: skip
# `sbatch -N 2 --ntasks-per-node 2 --gpus-per-node 2` then `srun python train.py`
TWO_NODES = {
    **ONE_NODE,
    "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NODELIST": "node[01-02]",
    "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}  # fmt: skip


@pytest.mark.parametrize(
    "common, expected",
    [
        # (rank, world size, local rank, node, nodes) of each task; rank 0's host
        (ONE_NODE, ([(0, 2, 0, 0, 1), (1, 2, 1, 0, 1)], "node07")),
        (TWO_NODES, ([(0, 4, 0, 0, 2), (1, 4, 1, 0, 2), (2, 4, 0, 1, 2), (3, 4, 1, 1, 2)], "node01")),
    ],
    ids=["1-node", "2-nodes"],
)
def test_slurm_tasks_of_a_one_and_a_two_node_job(common, expected):
    places, host = expected
    tasks = [_task(common, p, 2) for p in range(len(places))]
    assert [(*detect(t)[1:], *node_of(t)) for t in tasks] == places
    assert {detect(t).name for t in tasks} == {"SLURM"}
    addresses = {slurm_address(t) for t in tasks}  # MASTER_ADDR/MASTER_PORT, the same in every task
    assert len(addresses) == 1
    ((first_node, port),) = addresses
    assert first_node == host and 15000 <= port < 25000
    # the batch script itself (no step) is one process, whatever the job's task count
    batch_script = {k: v for k, v in tasks[0].items() if k not in ("SLURM_STEP_ID", "SLURM_STEPID")}
    assert detect(batch_script) is None
    # `kiln run` started by srun, one task per node: torchrun's variables win
    under_torchrun = {**tasks[-1], "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_RANK": "1"}
    under_torchrun |= {"GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
    assert detect(under_torchrun) == Launcher("torchrun", 5, 8, 1) and node_of(under_torchrun) == (1, 2)
