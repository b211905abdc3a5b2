"""The migration scripts of docs/migrate/ (examples/migrate/) run on 2 real processes and learn.

Each writes only under its working directory (a temporary folder here). The four scripts run one
after another in ONE `kiln run -n 2` job (tests/workers/migrate_worker.py: each script's ``main``
from a working directory of its own, its output kept per rank): the torch import, the process
group and DDP's first construction are paid once, not once per script. The YAML's run under
`kiln train` is its own launch: that CLI is what it tests.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

from distributed import ROOT, WORKERS, base_env, check, fork_train

sys.path.insert(0, str(WORKERS))
from examples_worker import one_job  # noqa: E402

MIGRATE = ROOT / "examples" / "migrate"

pytestmark = pytest.mark.world_size(2)


def _written() -> set[str]:
    """What a run could leave in the repository: its runs/ folders, files beside the scripts."""
    return {
        str(p.relative_to(ROOT))
        for p in [*ROOT.glob("runs/from_*"), *MIGRATE.rglob("*")]
        if "__pycache__" not in p.parts
    }


@pytest.fixture(autouse=True)
def _writes_nothing_into_the_repository():
    before = _written()
    yield
    assert _written() == before, f"a migration run wrote into the repository: {sorted(_written() - before)}"


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """The one job that runs every migration script; a function of a script's name that gives its
    working directory and both ranks' output (stdout, stderr), as its own launch would."""
    out = tmp_path_factory.mktemp("migrate")
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{base_env()['PYTHONPATH']}"}  # the YAML names examples.migrate.*
    names = ["from_ddp", "from_colossalai", "from_composer", "from_nnscaler"]
    before = _written()  # checked here too: the job runs before any test's own check begins
    job, result = one_job(out, [{"name": n, "path": str(MIGRATE / f"{n}.py")} for n in names], env=env, timeout=600)
    wrote = sorted(_written() - before)

    def checked(name: str) -> tuple[Path, str, str]:
        assert not wrote, f"a migration run wrote into the repository: {wrote}"
        return result(name)

    yield checked
    check(job)  # every script returned; the job must also exit 0 (its teardown, as each script's own launch)


def _number(stdout: str, label: str) -> float:
    lines = [line for line in stdout.splitlines() if label in line]
    assert len(lines) == 1, f"expected one line with {label!r} (rank 0 only), got {lines}\n{stdout[-3000:]}"
    return float(re.search(re.escape(label) + r"\s*([0-9.]+)", lines[0]).group(1))


def test_from_ddp_trains_with_the_engine(scripts):
    _, stdout, _ = scripts("from_ddp")
    assert "on 2 process(es)" in stdout
    assert _number(stdout, "last loss:") < 0.5 * _number(stdout, "first loss:")
    assert _number(stdout, "final test accuracy:") >= 0.9


def test_from_colossalai_config_file_engine_trainer_and_hooks(scripts):
    _, stdout, stderr = scripts("from_colossalai")
    out = stdout + stderr  # the dist logger writes to stderr
    assert "precision amp_fp16" in out  # the config file's fp16=dict(mode=AMP_TYPE.TORCH) took effect
    losses = [float(v) for v in re.search(r"epoch losses: ([0-9., ]+)", out).group(1).split(", ")]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], losses  # the user hook saw every epoch
    assert _number(out, "final test accuracy:") >= 0.9


def test_from_composer_model_trainer_callbacks_algorithms_checkpoints(scripts):
    folder, stdout, _ = scripts("from_composer")
    assert _number(stdout, "final test accuracy:") >= 0.9
    assert "after 132 batches" in stdout  # 6 epochs of 22 batches per rank
    run = folder / "runs" / "from_composer"
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["ep4-ba88", "ep6-ba132", "last"]  # keep 2, every 2ep
    log = (run / "metrics.jsonl").read_text()
    assert '"eval/Accuracy"' in log and '"throughput/samples_per_sec"' in log and '"lr-AdamW/group0"' in log


def test_from_nnscaler_yaml_hook_and_merged_checkpoint(scripts):
    folder, out, _ = scripts("from_nnscaler")
    assert _number(out, "final test accuracy:") >= 0.9
    assert _number(out, ", last") < 0.5 * _number(out, "train loss: first")  # the example's line, not kiln's progress
    assert len(re.search(r"validation losses: (.*)", out).group(1).split(", ")) == 4  # on_val_end, every epoch
    merged = folder / "runs" / "from_nnscaler" / "merged.pt"
    content = torch.load(merged, weights_only=True)
    assert content["manifest"]["timestamp"]["epoch"] == 4
    assert content["model"]["classifier.4.weight"].shape == (10, 128)


def test_from_nnscaler_yaml_under_kiln_train(tmp_path):
    env = {**base_env(), "PYTHONPATH": f"{ROOT}{os.pathsep}{base_env()['PYTHONPATH']}"}
    argv = ["-f", str(MIGRATE / "from_nnscaler.yaml"), "--max_train_steps", "3"]
    argv += ["--checkpoint.every_n_train_steps", "3", "--checkpoint.every_n_epochs!"]
    check(fork_train(*argv, nproc=2, cwd=tmp_path, env=env, timeout=300))  # kiln train ... --nproc-per-node 2
    assert (tmp_path / "runs" / "from_nnscaler" / "checkpoints" / "ep0-ba3" / "manifest.json").is_file()
