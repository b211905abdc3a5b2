"""Launch layer: configs, context, environment errors, and 2-process groups per launcher: the ranks
forked from the warm server (tests/distributed.py) with the variables torchrun (as `kiln run` sets
them), srun and mpirun set; a real `kiln run` only for the test helper's own hang handling (the
launch functions under a real `kiln run`: tests/test_clean_exit.py, tests/test_one_traceback.py)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import kiln
from distributed import WORKERS, check, fork_ranks, fork_run, free_port, kiln_run
from kiln.launch.environments import from_openmpi, from_slurm, from_torchrun


def test_world_of_one_without_launch():
    ctx = kiln.context()
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.is_main) == (0, 1, 0, True)
    assert ctx.device == torch.device("cpu")


def test_launch_single_process_sets_context_and_seed():
    ctx = kiln.launch(config={"seed": 7, "BATCH_SIZE": 4}, rank=0, world_size=1)
    assert kiln.context() is ctx and ctx.config.BATCH_SIZE == 4 and ctx.backend is None
    a = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(a, torch.rand(3))


def test_config_from_py_yaml_json_and_dict(tmp_path):
    (tmp_path / "c.py").write_text(
        "import os\nfrom pathlib import Path\nBATCH_SIZE = 128\n"
        "fp16 = dict(mode='torch')\nclass Helper: pass\n__secret__ = 1\n"
    )
    cfg = kiln.Config.from_file(tmp_path / "c.py")
    assert dict(cfg) == {"BATCH_SIZE": 128, "fp16": {"mode": "torch"}}
    assert cfg.fp16.mode == "torch"
    (tmp_path / "c.yaml").write_text("lr: 0.1\nmodel:\n  dim: 4\n")
    assert kiln.Config.from_file(tmp_path / "c.yaml").model.dim == 4
    (tmp_path / "c.json").write_text('{"a": {"b": [1, 2]}}')
    assert kiln.Config.from_file(tmp_path / "c.json").a.b == [1, 2]
    cfg = kiln.Config({"x": {"y": 1}})
    cfg.z = 3
    assert cfg["z"] == 3 and cfg.x.y == 1
    with pytest.raises(AttributeError, match="no key 'nope'"):
        cfg.nope  # noqa: B018 - reading the missing key is what raises


def test_config_file_that_does_not_exist(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match="nope.py.*does not exist"):
        kiln.launch(config=str(missing))
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ValueError, match="suffix '.toml'"):
        kiln.Config.from_file(tmp_path / "c.toml")


@pytest.mark.parametrize(
    "reader,env,missing",
    [
        (from_torchrun, {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK"),
        (from_torchrun, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "1"}, "MASTER_ADDR"),
        (from_slurm, {"SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, "SLURM_NTASKS or SLURM_NPROCS"),
        (from_slurm, {"SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, "SLURM_PROCID"),
        (from_openmpi, {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_LOCAL_RANK"),
    ],
)
def test_missing_variable_names_it(reader, env, missing):
    with pytest.raises(kiln.LaunchError, match=f"environment variable {missing} is not set"):
        reader(env)


def test_contradictory_and_malformed_variables():
    with pytest.raises(kiln.LaunchError, match=r"RANK=3 is outside \[0, WORLD_SIZE=2\)"):
        from_torchrun({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(kiln.LaunchError, match="SLURM_PROCID='x' is not an integer"):
        from_slurm({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"})
    assert from_slurm({"SLURM_PROCID": "1", "SLURM_NPROCS": "2", "SLURM_LOCALID": "1"}) == (1, 2, 1)


def test_launch_from_torch_without_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(kiln.LaunchError, match="RANK is not set; expected it from torchrun"):
        kiln.launch_from_torch()


def test_bad_backend_and_rank():
    with pytest.raises(ValueError, match="backend='tcp' is not known"):
        kiln.launch(backend="tcp")
    with pytest.raises(kiln.LaunchError, match="rank=2 and world_size=2"):
        kiln.launch(rank=2, world_size=2)


def test_default_parser():
    args = kiln.get_default_parser().parse_args(
        ["--config", "c.py", "--host", "h", "--port", "29501", "--world_size", "2", "--rank", "1", "--local_rank", "1"]
    )
    assert (args.config, args.host, args.port, args.world_size, args.rank, args.local_rank, args.backend) == (
        "c.py",
        "h",
        29501,
        2,
        1,
        1,
        "auto",
    )


def _read(tmp_path, n=2):
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]


def test_launch_from_torch_two_processes(tmp_path):
    check(fork_run(WORKERS / "launch_worker.py", "torch", str(tmp_path)))  # torchrun's variables
    ranks = _read(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 and r["backend"] == "gloo" and r["name"] == "x" for r in ranks)


def test_launch_from_slurm_two_processes(tmp_path):
    port = free_port()
    results = fork_ranks(
        WORKERS / "launch_worker.py",
        lambda r: {"SLURM_PROCID": r, "SLURM_NTASKS": 2, "SLURM_LOCALID": r},
        args=("slurm", str(tmp_path), str(port)),
    )
    for res in results:
        check(res)
    assert [(r["rank"], r["local"], r["sum"]) for r in _read(tmp_path)] == [(0, 0, 3.0), (1, 1, 3.0)]


def test_launch_from_openmpi_two_processes(tmp_path):
    port = free_port()
    results = fork_ranks(
        WORKERS / "launch_worker.py",
        lambda r: {"OMPI_COMM_WORLD_RANK": r, "OMPI_COMM_WORLD_SIZE": 2, "OMPI_COMM_WORLD_LOCAL_RANK": r},
        args=("openmpi", str(tmp_path), str(port)),
    )
    for res in results:
        check(res)
    assert [(r["rank"], r["world"], r["sum"]) for r in _read(tmp_path)] == [(0, 2, 3.0), (1, 2, 3.0)]


def test_dist_logger_ranks(capsys):
    logger = kiln.get_dist_logger("kiln.test")
    logger.info("hello from rank 0", ranks=[0])
    logger.info("never printed", ranks=[1])
    out = capsys.readouterr().out
    assert "hello from rank 0" in out and "never printed" not in out


def test_get_dataloader_single_process_shuffles_by_seed():
    data = torch.utils.data.TensorDataset(torch.arange(20))
    a = [int(x) for (b,) in kiln.get_dataloader(data, shuffle=True, seed=3, batch_size=5) for x in b]
    b = [int(x) for (b,) in kiln.get_dataloader(data, shuffle=True, seed=3, batch_size=5) for x in b]
    assert a == b and sorted(a) == list(range(20)) and a != list(range(20))
    plain = [int(x) for (b,) in kiln.get_dataloader(data, batch_size=5) for x in b]
    assert plain == list(range(20))


def test_a_hung_launch_fails_with_its_process_tree_and_leaves_no_process(tmp_path):
    # The test helper itself: a launch past its timeout must say what each process was doing and
    # kill the whole tree (ranks included), not only the launcher.
    import re

    script = tmp_path / "hang.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(AssertionError, match="did not finish within 20 s") as exc:
        kiln_run(script, timeout=20)
    message = str(exc.value)
    assert "WCHAN" in message and message.count("hang.py") >= 3  # the launcher and both ranks
    pids = [int(line.split()[0]) for line in message.splitlines() if re.match(r"\s*\d+ ", line)]
    time.sleep(1)
    alive = [
        pid for pid in pids if os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
    ]
    assert alive == [], f"still running after the timeout: {alive}"
