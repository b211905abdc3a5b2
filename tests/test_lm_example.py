"""The LM pretraining example and its YAML twin: a Llama-style model from a transformers config on the
standard library's sources, zero3 x tp on 4 real processes, with compile and activation checkpointing."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from distributed import ROOT, base_env, check, kiln_run

pytest.importorskip("transformers")

SMALL = ["--steps", "4", "--seq-len", "32", "--hidden", "32", "--layers", "2", "--batch-size", "2"]


@pytest.mark.world_size(4)
def test_python_example_zero3_x_tp_compiled_and_checkpointed(tmp_path):
    result = check(
        kiln_run(
            ROOT / "examples" / "lm_pretrain.py",
            *SMALL,
            "--max-bytes",
            "60000",
            "--peak-tflops",
            "1",
            nproc=4,
            timeout=600,
            cwd=tmp_path,
        )
    )
    line = [line for line in result.stdout.splitlines() if line.startswith("lm_pretrain:")]
    assert len(line) == 1, result.stdout  # rank 0 only
    assert "4 ranks, strategy hybrid" in line[0]
    values = dict(re.findall(r"(\S+) ([-+0-9.e]+)(?:,|$)", line[0].split("hybrid, ", 1)[1]))
    assert 0 < float(values["train/loss"]) < 5.6  # below ln(256) = 5.55 + noise: it learned something
    assert float(values["throughput/tokens_per_sec"]) > 0 and 0 < float(values["throughput/mfu"]) < 1


@pytest.mark.world_size(2)
def test_yaml_twin_trains_under_the_config_cli(tmp_path):
    overrides = [
        "--nproc-per-node", "2", "--compute_config.tp", "2",
        "--compile", "false", "--max_train_steps", "2", "--micro_batch_size", "2", "--global_batch_size", "2",
        "--dataset.train_args.seq_len", "32", "--dataset.val_args.seq_len", "32",
        "--dataset.train_args.max_bytes", "40000", "--dataset.val_args.max_bytes", "40000",
        "--model.args.config.hidden_size", "32", "--model.args.config.num_hidden_layers", "2",
        "--checkpoint.save_dir", str(tmp_path / "checkpoints"),
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "train", "-f", str(ROOT / "examples" / "lm_pretrain.yaml"), *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=base_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "last").exists()
