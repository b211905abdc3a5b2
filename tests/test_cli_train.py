"""`kiln train`: help, --print-config round trip, one-line errors before anything exists, and real
runs of the example config on two processes (checkpoint every step, resume, per-token-mean).

The two-process runs are the ranks of `kiln train ... --nproc-per-node 2` after its relaunch, forked
from the warm server (tests/distributed.py: fork_train): what they check is the training, not the
launcher. The whole command, launcher included, runs in tests/test_hygiene.py (examples/mlp.yaml
on 2 processes); its errors before torchrun starts as a process here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from distributed import ROOT, WORKERS, base_env, check, fork_train

sys.path[:0] = [str(ROOT), str(WORKERS)]

from kiln.cli.main import main  # noqa: E402
from kiln.config import ComputeConfig, TrainerArgs  # noqa: E402
from kiln.config.components import __all__ as COMPONENTS  # noqa: E402

BASE = """\
model: {type: examples.mlp_model.MLP, args: {dim: 4, nlayers: 2}}
optimizer: {type: torch.optim.Adam, args: {lr: 0.01}}
dataset: {type: examples.mlp_model.RandomDataset, train_args: {dim: 4, size: 16}}
micro_batch_size: 2
max_train_steps: 2
enable_progress_bar: false
checkpoint: {save_dir: ./ck, every_n_train_steps: 1}
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh working directory holding run.yaml; sys.path is restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "run.yaml").write_text(BASE)
    return tmp_path


def _kiln(*argv: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base_env(), **(env or {})},
    )


# -- help and --print-config --------------------------------------------------------------------
def test_help_lists_every_field_with_type_default_and_doc(capsys):
    import dataclasses

    from kiln.cli.train import fields_help
    from kiln.config import components

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert fields_help().splitlines()[1] in text
    prefixes = {
        "TrainerArgs": "",
        "ComputeConfig": "compute_config.",
        "ModelConfig": "model.",
        "CriterionConfig": "criterion.",
        "OptimizerConfig": "optimizer.",
        "DatasetConfig": "dataset.",
        "DataloaderConfig": "dataloader.",
        "DatasetSamplerConfig": "dataset_sampler.",
        "LRSchedulerConfig": "lr_scheduler.",
        "CheckpointConfig": "checkpoint.",
        "LogConfig": "log.N.",
        "HookConfig": "hook.",
        "HookMapConfig": "hook.",
    }
    assert set(prefixes) - {"TrainerArgs", "ComputeConfig"} == {n for n in COMPONENTS if n.endswith("Config")}
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  --")}
    for name, prefix in prefixes.items():
        cls = {"TrainerArgs": TrainerArgs, "ComputeConfig": ComputeConfig}.get(name) or getattr(components, name)
        for f in dataclasses.fields(cls):
            line = lines[f"--{prefix}{f.name}"]
            assert "(" in line and "):" in line and not line.endswith(": "), line
    assert "(int | None, default None): stop after this many optimizer steps" in lines["--max_train_steps"]


def test_print_config_round_trip(workdir, capsys):
    assert (
        main(
            [
                "train",
                "-f",
                "run.yaml",
                "--print-config",
                "--optimizer.args.lr",
                "0.5",
                "--log.0.type",
                "console",
                "--dataset.train_args.size",
                "$(micro_batch_size)",
            ]
        )
        == 0
    )
    first = capsys.readouterr().out
    (workdir / "printed.yaml").write_text(first)
    assert main(["train", "-f", "printed.yaml", "--print-config"]) == 0
    assert capsys.readouterr().out == first
    printed = yaml.safe_load(first)
    assert printed["optimizer"]["args"]["lr"] == 0.5 and printed["dataset"]["train_args"]["size"] == 2
    assert printed["log"][0]["type"] == "kiln.loggers.ConsoleLogger" and printed["grad_accumulation_steps"] == 1
    assert sorted(p.name for p in workdir.iterdir()) == ["printed.yaml", "run.yaml"]


# -- bad configs: status 2, one line naming the field, nothing created ---------------------------
BAD = [
    ({"max_epoch": 3}, [], "max_epoch: unknown key 'max_epoch' (did you mean 'max_epochs'?)"),
    ({}, ["--checkpoint.every_n_train_step", "1"], "checkpoint.every_n_train_step: unknown key"),
    ({"max_train_steps": "ten"}, [], "max_train_steps: got 'ten' (str), expected"),
    ({}, ["--micro_batch_size", "2.5"], "micro_batch_size: got 2.5 (float), expected an int"),
    ({}, ["--global_batch_size", "5"], "global_batch_size: got 5 (int), expected a multiple of"),
    ({}, ["--global_batch_size", "8", "--grad_accumulation_steps", "3"], "grad_accumulation_steps: got 3 (int)"),
    ({}, ["--model.type", "examples.mlp_model.MLPP"], "model.type: cannot import 'examples.mlp_model.MLPP'"),
    ({}, ["--optimizer.type", "torch.optimm.Adam"], "optimizer.type: cannot import 'torch.optimm.Adam'"),
    ({}, ["--model.args.dimm", "3"], "model.args: examples.mlp_model.MLP does not accept argument(s) 'dimm'"),
    ({}, ["--dataset.train_args.sise", "3"], "dataset.train_args: examples.mlp_model.RandomDataset does not accept"),
    ({}, ["--checkpoint.save_type", "shard"], "checkpoint.save_type: got 'shard' (str), expected one of"),
    ({}, ["--precision", "bf17"], "precision: got 'bf17' (str), expected one of"),
    ({}, ["--precision.param", "int8"], "precision.param: got 'int8' (str)"),
    (
        {"lr_scheduler": {"type": "torch.optim.lr_scheduler.StepLR", "args": {"step_size": 1}}},
        ["--lr_scheduler.interval", "iteration"],
        "lr_scheduler.interval: got 'iteration' (str), expected one of",
    ),
    ({}, ["--optimizer.grad_reduction", "avg"], "optimizer.grad_reduction: got 'avg' (str)"),
    ({}, ["--optimizer.loss_reduction", "max"], "optimizer.loss_reduction: got 'max' (str)"),
    ({}, ["--optimizer.grad_reduction", "per-token-mean"], "optimizer.aggregate_outputs_fn: is not set"),
    ({}, ["--checkpoint.resume_from", "elsewhere/ep1-ba3"], "checkpoint.resume_from: got 'elsewhere/ep1-ba3'"),
    ({}, ["--micro_batch_size", "0"], "micro_batch_size: got 0 (int), expected an int >= 1"),
    ({}, ["--checkpoint.keep_last_n_checkpoints", "-1"], "checkpoint.keep_last_n_checkpoints: got -1 (int)"),
    ({}, ["--checkpoint.every_n_epochs", "1"], "checkpoint.every_n_epochs: got 1 while every_n_train_steps is 1"),
    ({}, ["--compute_config.runtime_ngpus", "4"], "compute_config.runtime_ngpus: got 4 (int), expected the world"),
    ({}, ["--log.0.type", "tensorbord"], "log.0.type: got 'tensorbord' (str), expected one of"),
    ({}, ["--dataloader.train_args.batch_size", "4"], "dataloader.train_args.batch_size: kiln sets this"),
    ({}, ["--dataloader.train_args.shuffle", "true"], "dataloader.train_args.shuffle: got True (bool)"),
    ({}, ["--dataset.train_args.dim", "$(model.args.dimx)"], "dataset.train_args.dim: reference '$(model.args.dimx)'"),
    ({}, ["--max_train_steps"], "max_train_steps: no value given"),
    ({}, ["--max_train_steps!"], "max_epochs: is not set (nor max_train_steps)"),
    ({}, ["--hook.on_train_start", "examples.mlp_model.nope"], "hook.on_train_start: cannot import"),
    ({}, ["--compute_config.strategy", "fdsp"], "compute_config.strategy: got 'fdsp' (str)"),
    ({}, ["--nproc-per-node", "0"], "--nproc-per-node: got '0' (str), expected a positive int"),
]


@pytest.mark.parametrize(
    "patch, overrides, message", BAD, ids=[m.split(":")[0] + f"-{i}" for i, (_, _, m) in enumerate(BAD)]
)
def test_bad_config_exits_2_with_one_line(workdir, capsys, patch, overrides, message):
    if patch:
        cfg = {**yaml.safe_load(BASE), **patch}
        (workdir / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "-f", "run.yaml", *overrides]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert lines[0].startswith("kiln train: error: ") and not out
    assert [p.name for p in workdir.iterdir()] == ["run.yaml"]  # no checkpoint folder, no log file


def test_yaml_syntax_error_names_the_line(workdir, capsys):
    (workdir / "run.yaml").write_text(BASE + "seed: 1: 2\n")
    assert main(["train", "-f", "run.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run.yaml line 8: mapping values are not allowed here" in err, err
    assert main(["train", "-f", "missing.yaml"]) == 2
    assert "config file 'missing.yaml' does not exist" in capsys.readouterr().err


def test_errors_as_a_process_before_torchrun_starts(tmp_path, monkeypatch, capsys):
    (tmp_path / "run.yaml").write_text(BASE.replace("./ck", str(tmp_path / "ck")))
    bad = _kiln("train", "-f", str(tmp_path / "run.yaml"), "--nproc-per-node", "2", "--max_epoch", "1", timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "kiln train: error: max_epoch: unknown key 'max_epoch' "
        "(did you mean 'max_epochs'?); TrainerArgs has no such field"
    ]
    # KILN_DEBUG=1 adds the traceback: read by main itself, so checked in this process (the exit
    # status a process gets is main's return value, checked as a process just above)
    monkeypatch.setenv("KILN_DEBUG", "1")
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the working directory on it
    assert main(["train", "-f", str(tmp_path / "run.yaml"), "--max_epoch", "1"]) == 2
    debug = capsys.readouterr().err
    assert "Traceback" in debug and debug.strip().endswith("such field"), debug
    assert [p.name for p in tmp_path.iterdir()] == ["run.yaml"]


# -- real runs on two processes -------------------------------------------------------------------
def _losses(log: Path) -> dict[int, float]:
    rows = map(json.loads, log.read_text().splitlines())
    return {r["step"]: r["metrics"]["train/loss"] for r in rows if "train/loss" in r["metrics"]}


@pytest.mark.world_size(2)
def test_example_on_two_processes_then_resume_two_more_steps(tmp_path):
    folder = tmp_path / "ck"
    common = [
        "-f",
        "examples/mlp.yaml",
        "--checkpoint.save_dir",
        str(folder),
        "--checkpoint.keep_last_n_checkpoints",
        "3",
        "--enable_progress_bar",
        "false",
        "--log.0.type",
        "file",
    ]
    check(fork_train(*common, "--max_train_steps", "5", "--log.0.args.path", str(tmp_path / "full.jsonl"), cwd=ROOT))
    full = _losses(tmp_path / "full.jsonl")
    assert sorted(full) == [1, 2, 3, 4, 5] and os.readlink(folder / "last") == "ep0-ba5"
    best = os.readlink(folder / "best")
    saved = {p.name for p in folder.iterdir() if p.name.startswith("ep")}
    assert saved - {best} == {"ep0-ba3", "ep0-ba4", "ep0-ba5"} - {best}  # checkpoint every step, keep 3
    # leave the folder as a run stopped after step 3 would: then resume from `last` for two more steps
    for name in ("ep0-ba4", "ep0-ba5"):
        shutil.rmtree(folder / name)
    for link in ("last", "best"):
        os.remove(folder / link)
    os.symlink("ep0-ba3", folder / "last")
    check(
        fork_train(
            *common,
            "--checkpoint.resume_from",
            "last",
            "--max_train_steps",
            "5",
            "--log.0.args.path",
            str(tmp_path / "resumed.jsonl"),
            cwd=ROOT,
        )
    )
    resumed = _losses(tmp_path / "resumed.jsonl")
    assert resumed == {4: full[4], 5: full[5]}  # exactly two more steps, bit-exact
    assert os.readlink(folder / "last") == "ep0-ba5" and not (folder / "ep0-ba6").exists()


@pytest.mark.world_size(2)
def test_per_token_mean_over_two_ranks_matches_hand_computation(tmp_path):
    import cli_models

    config = {
        "model": {"type": "cli_models.TokenModel"},
        "optimizer": {
            "type": "torch.optim.SGD",
            "args": {"lr": 0.1},
            "grad_reduction": "per-token-mean",
            "aggregate_outputs_fn": "cli_models.count_tokens",
        },
        "dataset": {"type": "cli_models.TokenDataset", "train_args": {"size": 8}},
        "dataset_sampler": {"train_args": {"shuffle": False}},
        "checkpoint": {"no_save": True},
        "hook": {"before_optimizer_step": "cli_models.record_grads"},
        "micro_batch_size": 1,
        "global_batch_size": 4,
        "max_train_steps": 1,
        "seed": 0,
        "enable_progress_bar": False,
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    record = tmp_path / "record.pt"
    check(fork_train("-f", str(tmp_path / "run.yaml"), cwd=tmp_path, env={"KILN_TEST_RECORD": str(record)}))
    saved = torch.load(record, weights_only=True)
    model = cli_models.TokenModel()
    model.load_state_dict(saved["params"][0])
    data = cli_models.TokenDataset(size=8)
    # rank 0 has samples 0 and 2 (3 tokens), rank 1 samples 1 and 3 (9 tokens): one mean over all 12
    batch = torch.utils.data.default_collate([data[i] for i in range(4)])
    (cli_models.token_loss_sum(model, batch) / batch["mask"].sum()).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(saved["grads"][0][name], param.grad)
