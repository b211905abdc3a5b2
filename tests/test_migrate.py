"""The migration scripts of docs/migrate/ (examples/migrate/) run on 2 real processes and learn.

Each writes only under its working directory (a temporary folder here).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from distributed import ROOT, base_env, check, kiln_run

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


def _number(stdout: str, label: str) -> float:
    lines = [line for line in stdout.splitlines() if label in line]
    assert len(lines) == 1, f"expected one line with {label!r} (rank 0 only), got {lines}\n{stdout[-3000:]}"
    return float(re.search(re.escape(label) + r"\s*([0-9.]+)", lines[0]).group(1))


def test_from_ddp_trains_with_the_engine(tmp_path):
    result = check(kiln_run(MIGRATE / "from_ddp.py", cwd=tmp_path, timeout=300))
    assert "on 2 process(es)" in result.stdout
    assert _number(result.stdout, "last loss:") < 0.5 * _number(result.stdout, "first loss:")
    assert _number(result.stdout, "final test accuracy:") >= 0.9


def test_from_colossalai_config_file_engine_trainer_and_hooks(tmp_path):
    result = check(kiln_run(MIGRATE / "from_colossalai.py", cwd=tmp_path, timeout=300))
    out = result.stdout + result.stderr  # the dist logger writes to stderr
    assert "precision amp_fp16" in out  # the config file's fp16=dict(mode=AMP_TYPE.TORCH) took effect
    losses = [float(v) for v in re.search(r"epoch losses: ([0-9., ]+)", out).group(1).split(", ")]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], losses  # the user hook saw every epoch
    assert _number(out, "final test accuracy:") >= 0.9


def test_from_composer_model_trainer_callbacks_algorithms_checkpoints(tmp_path):
    result = check(kiln_run(MIGRATE / "from_composer.py", cwd=tmp_path, timeout=300))
    assert _number(result.stdout, "final test accuracy:") >= 0.9
    assert "after 132 batches" in result.stdout  # 6 epochs of 22 batches per rank
    run = tmp_path / "runs" / "from_composer"
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["ep4-ba88", "ep6-ba132", "last"]  # keep 2, every 2ep
    log = (run / "metrics.jsonl").read_text()
    assert '"eval/Accuracy"' in log and '"throughput/samples_per_sec"' in log and '"lr-AdamW/group0"' in log


def test_from_nnscaler_yaml_hook_and_merged_checkpoint(tmp_path):
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{base_env()['PYTHONPATH']}"}
    result = check(kiln_run(MIGRATE / "from_nnscaler.py", cwd=tmp_path, env=env, timeout=300))
    out = result.stdout
    assert _number(out, "final test accuracy:") >= 0.9
    assert _number(out, ", last") < 0.5 * _number(out, "train loss: first")  # the example's line, not kiln's progress
    assert len(re.search(r"validation losses: (.*)", out).group(1).split(", ")) == 4  # on_val_end, every epoch
    merged = tmp_path / "runs" / "from_nnscaler" / "merged.pt"
    content = torch.load(merged, weights_only=True)
    assert content["manifest"]["timestamp"]["epoch"] == 4
    assert content["model"]["classifier.4.weight"].shape == (10, 128)


def test_from_nnscaler_yaml_under_kiln_train(tmp_path):
    env = {**base_env(), "PYTHONPATH": f"{ROOT}{os.pathsep}{base_env()['PYTHONPATH']}"}
    cmd = [sys.executable, "-m", "kiln.cli.main", "train", "-f", str(MIGRATE / "from_nnscaler.yaml")]
    cmd += ["--nproc-per-node", "2", "--max_train_steps", "3", "--checkpoint.every_n_train_steps", "3"]
    cmd += ["--checkpoint.every_n_epochs!"]
    check(subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300))
    assert (tmp_path / "runs" / "from_nnscaler" / "checkpoints" / "ep0-ba3" / "manifest.json").is_file()
