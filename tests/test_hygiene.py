"""Nothing an example runs writes into the repository, and no run output is committed.

Each example YAML runs as shipped under the config CLI on 2 processes, from a temporary working
directory, for 2 steps (examples/mlp.yaml as the whole `kiln train --nproc-per-node 2` command, the
others as its forked ranks; the MoE example on a tenth of its text). The LM example's run is also
its YAML twin's test (tensor parallel 2 and compile as shipped, at small dimensions): it trains and
leaves a ``last`` checkpoint where the run file says, relative to the working directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from distributed import ROOT, base_env, check, fork_train

# Smaller dimensions for the LM example (the run file's shape takes ~3x longer to compile and read;
# one layer, not two, cuts the run's ~67 CPU-s to ~50 on a loaded machine): the strategy, compile
# (inductor, whose caches go under /tmp, outside the repository this test watches), activation
# checkpointing and checkpoint layout stay as shipped. Compile under tp is also proved by
# tests/test_levers.py (its "tp" lever case) and tests/test_lm_example.py (the Python twin, 4 ranks).
_SMALL = {
    "lm_pretrain.yaml": [
        "--micro_batch_size", "2", "--global_batch_size", "2",
        "--dataset.train_args.seq_len", "32", "--dataset.val_args.seq_len", "32",
        "--dataset.train_args.max_bytes", "40000", "--dataset.val_args.max_bytes", "40000",
        "--model.args.config.hidden_size", "32", "--model.args.config.num_hidden_layers", "1",
    ],
    # the MoE example as shipped but for its text: a tenth of it (every rank walks and reads the
    # standard library for each split; its 2% validation split is still 31 sequences)
    "moe_pretrain.yaml": ["--dataset.train_args.max_bytes", "200000", "--dataset.val_args.max_bytes", "200000"],
}  # fmt: skip

_SKIP = {".git", ".venv", "__pycache__", ".pytest_cache", "site", "build"}


def _files(root):
    out = set()
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP and not d.endswith(".egg-info")]
        out.update(os.path.relpath(os.path.join(folder, n), root) for n in names if not n.endswith(".pyc"))
    return out


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_no_run_output_is_tracked():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not [p for p in tracked if p.split("/")[0] in ("checkpoints", "runs", "mlruns", "wandb")]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_example_yaml_writes_only_under_the_working_directory(tmp_path, example):
    before = _files(ROOT)
    env = {**base_env(), "PYTHONPATH": f"{ROOT}{os.pathsep}{base_env()['PYTHONPATH']}"}  # the yaml names examples.*
    argv = ["-f", str(ROOT / "examples" / example), "--max_train_steps", "2", *_SMALL.get(example, [])]
    if example == "mlp.yaml":  # the whole command once: its launcher must write nothing here either
        cmd = [sys.executable, "-m", "kiln.cli.main", "train", *argv, "--nproc-per-node", "2"]
        check(subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300))
    else:  # the ranks of the same command (tests/distributed.py: fork_train)
        check(fork_train(*argv, nproc=2, cwd=tmp_path, env=env, timeout=300))
    assert _files(ROOT) == before, f"the run wrote into the repository: {sorted(_files(ROOT) - before)}"
    written = _files(tmp_path)
    assert any(p.startswith(os.path.join("runs", "")) and p.endswith("manifest.json") for p in written), written
    if example == "lm_pretrain.yaml":  # the run file's relative save_dir, under the working directory
        assert (tmp_path / "runs" / "lm_pretrain" / "checkpoints" / "last").exists(), sorted(written)
