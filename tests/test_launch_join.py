"""One job, whatever the launcher (issue 23): the Trainer, kiln.initialize and the config CLI join
the launcher's world by themselves (kiln.launch.join), an explicit launch call wins, and a world
of one makes no process group. Two-process jobs: one real `kiln run` (the Trainer, which also
checks the lock's torchrun run id); the other front doors and launchers with the ranks forked from
the warm server (tests/distributed.py), each with exactly the variables its launcher sets (torchrun's
as `kiln run` sets them, SLURM's, Open MPI's): joining reads those variables, the launcher process
itself plays no part. Launcher detection and SLURM's derived address in one process."""

from __future__ import annotations

import json
import socket
import sys

import pytest
import torch.distributed as dist

import kiln
from distributed import WORKERS, _fork_job, base_env, check, fork_ranks, fork_run, free_port, kiln_run
from kiln.launch import join
from kiln.launch.environments import Launcher, detect, first_host, slurm_address

WORKER = WORKERS / "unlaunched_trainer.py"


def _ranks(out, n=2):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def _one_job_split(ranks):
    """Both ranks saw a world of 2 (in their state and in torch's group) and half the samples each."""
    assert [(r["rank"], r["world"], r["group"]) for r in ranks] == [(0, 2, 2), (1, 2, 2)], ranks
    first, second = (set(r["seen"]) for r in ranks)
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == 8 and not first & second
    assert first | second == set(range(16))


# -- real processes -------------------------------------------------------------------------------
def test_kiln_run_of_a_trainer_script_without_launch_is_one_job(tmp_path):
    check(kiln_run(WORKER, str(tmp_path), "trainer"))
    ranks = _ranks(tmp_path)
    _one_job_split(ranks)
    # One history in the metrics file: rank 0's 8 batches / 2 ranks = 4 steps, each logged once.
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "train/loss" in r.get("metrics", {})]
    assert steps == [1, 2, 3, 4]
    # The save folder's lock was held by the job (rank 0's process, torchrun's run id) while it
    # trained, without conflicting with itself, and given back at the end.
    lock = ranks[0]["lock"]
    assert lock is not None and lock["pid"] == ranks[0]["pid"] and lock["run_id"].startswith("torchrun:"), lock
    assert lock["host"] == socket.gethostname()
    assert not (tmp_path / "ck" / ".kiln-lock").exists() and (tmp_path / "ck" / "last").exists()
    assert not (tmp_path / ".metrics.jsonl.kiln-lock").exists()


@pytest.mark.parametrize("mode", ["engine", "explicit"])
def test_kiln_run_initialize_joins_and_an_explicit_launch_wins(tmp_path, mode):
    check(fork_run(WORKER, str(tmp_path), mode))  # torchrun's variables, as kiln run sets them
    ranks = _ranks(tmp_path)
    _one_job_split(ranks)
    # explicit: kiln.context() after the Trainer is still the Context launch_from_torch returned
    assert all(r["explicit_kept"] == (mode == "explicit") for r in ranks)


def _slurm_job_with_a_free_port() -> str:
    """A SLURM_JOB_ID whose derived port (step 0) is free here, so rank 0 can listen on it."""
    for job in range(4242, 4342):
        _, port = slurm_address({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0"})
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(job)
    raise AssertionError("no free port among 100 derived ones")


def test_srun_of_a_trainer_script_without_launch_or_master_address(tmp_path):
    # What srun sets for each task of a 2-task step on one node; no MASTER_ADDR/MASTER_PORT: the
    # address is derived from the node list and the job id, the same in both tasks.
    job = _slurm_job_with_a_free_port()
    env = {"SLURM_NTASKS": 2, "SLURM_STEP_ID": 0, "SLURM_JOB_ID": job, "SLURM_STEP_NODELIST": "localhost"}
    for result in fork_ranks(
        WORKER, lambda r: {**env, "SLURM_PROCID": r, "SLURM_LOCALID": r}, args=(str(tmp_path), "trainer")
    ):
        check(result)
    _one_job_split(_ranks(tmp_path))
    assert _ranks(tmp_path)[0]["lock"]["run_id"] == f"slurm:{job}.0"


def test_mpirun_of_a_trainer_script_without_launch(tmp_path):
    env = {"OMPI_COMM_WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}
    results = fork_ranks(
        WORKER,
        lambda r: {**env, "OMPI_COMM_WORLD_RANK": r, "OMPI_COMM_WORLD_LOCAL_RANK": r},
        args=(str(tmp_path), "trainer"),
    )
    for result in results:
        check(result)
    _one_job_split(_ranks(tmp_path))


def test_config_cli_joins_an_mpirun_world(tmp_path):
    # `kiln train` under mpirun without --nproc-per-node: one job of 2 (it used to join torchrun only).
    (tmp_path / "run.yaml").write_text(
        "model: {type: mlp_model.MLP, args: {dim: 4, nlayers: 2}}\n"
        "optimizer: {type: torch.optim.SGD, args: {lr: 0.1}}\n"
        "dataset: {type: mlp_model.RandomDataset, train_args: {dim: 4, size: 16}}\n"
        "micro_batch_size: 2\nmax_train_steps: 1\nenable_progress_bar: false\n"
        "checkpoint: {no_save: true}\nrun_mode: compile\n"
    )
    env = {"OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    envs = [
        {**base_env(), **env, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r)} for r in range(2)
    ]
    # `python -m kiln.cli.main train` in each rank (through kiln's worker bootstrap, which sets no
    # launcher variable), forked, in the folder of run.yaml
    argv = ["-m", "kiln.cli.main", "train", "-f", "run.yaml"]
    results, _ = _fork_job(argv, True, envs, 180, tmp_path)
    for result in results:
        check(result)
    assert "world 2;" in results[0].stdout and "data-parallel 2 =" in results[0].stdout, results[0].stdout
    assert results[1].stdout == ""  # the summary is rank 0's


# -- detection, in one process --------------------------------------------------------------------
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
SRUN = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77"}
MPIRUN = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
SBATCH = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "77"}  # no step


@pytest.mark.parametrize(
    "env, expected",
    [
        (TORCHRUN, Launcher("torchrun", 1, 2, 1)),
        ({**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}, Launcher("torchrun", 0, 1, 0)),
        (SRUN, Launcher("SLURM", 1, 4, 1)),
        (
            {**SRUN, "SLURM_STEP_ID": None, "SLURM_STEPID": "0", "SLURM_NTASKS": None, "SLURM_NPROCS": "4"},
            Launcher("SLURM", 1, 4, 1),
        ),
        (MPIRUN, Launcher("Open MPI", 3, 4, 1)),
        ({**SRUN, **MPIRUN}, Launcher("Open MPI", 3, 4, 1)),  # mpirun's daemons started by srun
        ({**SRUN, **TORCHRUN}, Launcher("torchrun", 1, 2, 1)),  # kiln run inside an srun task
        ({**SRUN, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, None),  # srun -n 1
        ({**MPIRUN, "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}, None),
        (SBATCH, None),  # a batch script is one process, whatever the job's task count
        ({}, None),
    ],
    ids=[
        "torchrun",
        "torchrun-world-1",
        "srun",
        "srun-old-names",
        "mpirun",
        "mpirun-under-slurm",
        "torchrun-under-srun",
        "srun-one-task",
        "mpirun-one-rank",
        "sbatch-script",
        "nothing",
    ],
)
def test_detect_picks_the_launcher_and_its_rank_and_world(env, expected):
    env = {k: v for k, v in env.items() if v is not None}
    assert detect(env) == expected


def test_detect_names_a_missing_companion_variable():
    with pytest.raises(
        kiln.LaunchError, match="environment variable MASTER_PORT is not set; expected it from torchrun"
    ):
        detect({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"})
    with pytest.raises(kiln.LaunchError, match="SLURM_PROCID is not set"):
        detect({k: v for k, v in SRUN.items() if k != "SLURM_PROCID"})


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("gpu[07-09,12],cpu1", "gpu07"),
        ("n[3-5]-ib", "n3-ib"),
        ("a,b", "a"),
        ("node1", "node1"),
        ("x[1,2]y[5-6]", "x1y5"),
    ],
)
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_slurm_address_is_derived_alike_in_every_task_and_overridden_by_master_vars(monkeypatch):
    tasks = [
        {**SRUN, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 2), "SLURM_STEP_NODELIST": "gpu[07-08]"}
        for r in range(4)
    ]
    addresses = {slurm_address(env) for env in tasks}
    assert len(addresses) == 1
    ((host, port),) = addresses
    assert host == "gpu07" and 15000 <= port < 25000
    assert slurm_address({**tasks[0], "SLURM_STEP_ID": "1"})[1] != port  # another step of the job
    assert slurm_address({"SLURM_JOB_NODELIST": "c[2-3]"}) == ("c2", None)

    seen = []
    context_module = sys.modules["kiln.launch.context"]  # `kiln.launch.context` is also the function
    monkeypatch.setattr(context_module, "launch", lambda *args, **kwargs: seen.append(args[3:5]))
    for name, value in {**tasks[0], "SLURM_STEP_NODELIST": "gpu[07-08]"}.items():
        monkeypatch.setenv(name, value)
    kiln.launch_from_slurm()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    kiln.launch_from_slurm()
    kiln.launch_from_slurm(host="h", port=5)
    assert seen == [("gpu07", port), ("10.0.0.1", "29511"), ("h", 5)]


def test_slurm_without_any_address_names_what_to_set(monkeypatch):
    for name, value in SRUN.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(kiln.LaunchError, match="MASTER_ADDR and MASTER_PORT is not set.*SLURM_STEP_NODELIST"):
        join.join_launcher()


# -- join_launcher, in one process ----------------------------------------------------------------
def _env(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _no_launch(monkeypatch):
    """Every launcher join could call, replaced by one that fails the test."""

    def refuse(**kwargs):
        raise AssertionError("join_launcher launched although it should not have")

    for name in join._LAUNCHERS:
        monkeypatch.setitem(join._LAUNCHERS, name, refuse)


def test_an_explicit_launch_wins_over_the_environment(monkeypatch):
    _env(monkeypatch, TORCHRUN)
    _no_launch(monkeypatch)
    ctx = kiln.launch(world_size=1)  # type: ignore[operator]  # kiln.launch is a callable module
    assert join.join_launcher() is ctx and not dist.is_initialized()


def test_a_world_of_one_makes_no_group(monkeypatch):
    _env(monkeypatch, {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    _no_launch(monkeypatch)
    ctx = join.join_launcher()
    assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, None) and not dist.is_initialized()


@pytest.mark.parametrize("env, launcher", [(TORCHRUN, "torchrun"), (SRUN, "SLURM"), (MPIRUN, "Open MPI")])
def test_join_calls_the_launch_function_of_the_launcher_found(monkeypatch, env, launcher):
    _env(monkeypatch, env)
    _no_launch(monkeypatch)
    calls = []
    monkeypatch.setitem(join._LAUNCHERS, launcher, lambda **kwargs: calls.append(kwargs) or kiln.context())
    join.join_launcher(timeout=30)
    assert calls == [{"timeout": 30}]


def test_a_default_context_read_early_does_not_stop_the_join(monkeypatch):
    _env(monkeypatch, TORCHRUN)
    _no_launch(monkeypatch)
    assert kiln.context().world_size == 1  # a script may look before building its Trainer
    calls = []
    monkeypatch.setitem(join._LAUNCHERS, "torchrun", lambda **kwargs: calls.append(kwargs) or kiln.context())
    join.join_launcher()
    assert len(calls) == 1


def test_mpirun_without_an_address_is_one_line_naming_it(monkeypatch):
    _env(monkeypatch, MPIRUN)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(kiln.LaunchError) as err:
        join.join_launcher()
    message = str(err.value)
    assert "\n" not in message and "MASTER_ADDR and MASTER_PORT is not set" in message
    assert "mpirun -x MASTER_ADDR=" in message
