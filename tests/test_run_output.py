"""What a run prints (issue 23.2): a real ``kiln train`` with stdout into a file shows its progress
while it runs; the strategy choice is one line (the table behind ``--verbose`` and ``kiln plan``);
a warning of kiln's own is one ``kiln: ...`` line, without Python's source line."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
import time
import warnings

import pytest
import torch

from distributed import ROOT, base_env
from kiln.core.warn import KilnWarning
from kiln.launch.logging import get_dist_logger

STAMP = r"\d\d:\d\d:\d\d"
STEPS, SLEEP, INTERVAL = 200, 0.01, 0.1  # 2 s of steps at least; a line every 0.1 s; tenths every 20 steps

RUN = f"""\
model: {{type: slow_model.SlowMLP, args: {{dim: 4, nlayers: 2}}}}
optimizer: {{type: torch.optim.SGD, args: {{lr: 0.1}}}}
dataset:
  type: mlp_model.RandomDataset
  train_args: {{dim: 4, size: 4000}}   # 2000 steps an epoch: this run never ends one
  val_args: {{dim: 4, size: 40}}
micro_batch_size: 2
max_train_steps: {STEPS}
val_every_n_train_steps: 100
console_interval: {INTERVAL}s
checkpoint: {{save_dir: ./ck, every_n_train_steps: 100, resume_from: last}}
"""

SLOW_MODEL = f"""\
import time
from mlp_model import MLP

class SlowMLP(MLP):
    def forward(self, batch):
        if self.training:
            time.sleep({SLEEP})  # every step lasts at least this long
        return super().forward(batch)
"""


@pytest.mark.timeout(240)
def test_kiln_train_into_a_log_file_shows_progress_within_the_interval(tmp_path):
    (tmp_path / "run.yaml").write_text(RUN)
    (tmp_path / "slow_model.py").write_text(SLOW_MODEL)
    with open(tmp_path / "log.txt", "w") as log:  # kiln train ... > log.txt
        done = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli.main", "train", "-f", "run.yaml"],
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.PIPE,
            text=True,
            # as in a batch job: Python's stdout into a file is then block-buffered
            env={k: v for k, v in base_env().items() if k != "PYTHONUNBUFFERED"},
        )
        # Read while it runs: each line is in the file when printed (stdout into a file is
        # block-buffered; unflushed, the whole log would arrive at the exit, with the last line).
        shown_while_running, deadline = False, time.monotonic() + 200
        while done.poll() is None and time.monotonic() < deadline:
            text = (tmp_path / "log.txt").read_text()
            shown_while_running |= " step " in text and " done: " not in text
            time.sleep(0.02)
        stderr = done.communicate(timeout=10)[1]
    out = (tmp_path / "log.txt").read_text()
    assert done.returncode == 0, out[-3000:] + stderr[-3000:]
    assert shown_while_running, "the log showed no step line before the run ended"
    lines = out.splitlines()
    assert all(re.match(STAMP + " ", line) for line in lines), out  # every line says when
    lines = [line[9:] for line in lines]

    assert re.fullmatch(rf"training started: first step done [0-9.]+ s into fit\(\); {STEPS - 1} steps to go", lines[0])
    number = r"[-+0-9.e]+"
    step_line = re.compile(
        rf"step (\d+)/{STEPS} \(\d+%\)  loss {number}  lr 0\.1  {number} sp/s  eta \d\d:\d\d",
    )
    steps = [int(m.group(1)) for m in map(step_line.fullmatch, lines) if m]
    assert len(steps) == sum(line.startswith("step ") for line in lines), out  # every step line has it all
    # Every step lasts >= 10 ms, so 0.1 s is at most 10 steps, plus the one that sees it: a line
    # within 11 steps of the last (the tenths alone would leave 20).
    gaps = [b - a for a, b in zip([1, *steps], [*steps, STEPS])]
    assert max(gaps) <= 11, (gaps, out)

    # evaluation at step 100 and at the end, each with a start and an end line
    evals = [line for line in lines if line.startswith("eval")]
    assert [re.sub(r"[0-9.]+ s: eval/loss " + number, "T", line) for line in evals] == [
        "eval starts at step 100 (20 batches)",
        "eval done in T",
        f"eval starts at step {STEPS} (20 batches)",
        "eval done in T",
    ], evals
    assert lines[-1].startswith(f"done: step {STEPS}/{STEPS} (100%) in "), lines[-1]
    assert re.search(rf"training\), loss {number}, eval/loss {number}; last checkpoint \S*ep0-ba{STEPS}$", lines[-1])
    assert (tmp_path / "ck" / f"ep0-ba{STEPS}").is_dir()

    # the one warning of the run (resume_from: last, with nothing to resume) is one line of kiln's
    warning = [line for line in stderr.splitlines() if "resume_from" in line]
    assert warning == ["kiln: checkpoint.resume_from: 'last' does not exist in './ck'; training starts from scratch"]
    assert "UserWarning" not in stderr and "warnings.warn(" not in stderr, stderr


@pytest.fixture
def dist_log():
    """The output of kiln's logger, its level restored afterwards."""
    logger = get_dist_logger().logger
    level, stream = logger.level, io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_the_strategy_choice_is_one_line_and_the_table_is_verbose(dist_log):
    from kiln.cost.auto import Auto
    from kiln.launch.context import context
    from kiln.precision import get_precision

    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(), torch.nn.Linear(144, 2))

    def choose() -> list[str]:
        start = dist_log.tell()
        Auto(memory_budget=1e12).setup(model, torch.optim.AdamW(model.parameters()), context(), get_precision("fp32"))
        return dist_log.getvalue()[start:].splitlines()

    line = choose()
    assert len(line) == 1 and len(line[0]) < 160, line
    assert line[0].startswith("strategy='auto' chose single, ") and "kiln plan, or --verbose" in line[0]
    get_dist_logger().set_level("DEBUG")  # what kiln train --verbose does
    lines = choose()
    assert lines[0] == line[0] and lines[1].split() == [
        "strategy",
        "params",
        "grads",
        "optimizer",
        "activations",
        "total/rank",
        "fits",
        "why",
    ]
    assert lines[2].startswith("* single ")


def test_kiln_train_verbose_sets_the_debug_level_and_is_passed_to_each_process(tmp_path, dist_log, monkeypatch):
    from kiln.cli import train as train_cli
    from kiln.cli.main import main, parse_args

    (tmp_path / "run.yaml").write_text(RUN)
    (tmp_path / "slow_model.py").write_text(SLOW_MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(ROOT / "examples"), *sys.path])  # mlp_model; kiln train adds the cwd
    monkeypatch.setattr(sys, "modules", dict(sys.modules))  # slow_model is imported only here
    assert parse_args(["train", "-f", "run.yaml"]).verbose is False
    assert main(["train", "-f", "run.yaml", "--print-config"]) == 0
    assert get_dist_logger().logger.level == logging.INFO
    assert main(["train", "-f", "run.yaml", "--verbose", "--print-config"]) == 0
    assert get_dist_logger().logger.level == logging.DEBUG
    seen = {}
    monkeypatch.setattr("kiln.cli.run.run", lambda ns: seen.setdefault("argv", ns.script_args) and 0)
    args = parse_args(["train", "-f", "run.yaml", "-v", "--nproc-per-node", "2", "--seed", "3"])
    train_cli._relaunch(args, 2)
    assert seen["argv"] == ["train", "-f", "run.yaml", "--verbose", "--seed", "3"]


def test_a_bad_console_interval_in_the_yaml_is_one_line(tmp_path, monkeypatch, capsys):
    from kiln.cli.main import main

    (tmp_path / "run.yaml").write_text(RUN)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "-f", "run.yaml", "--console_interval", "3ep", "--print-config"]) == 2
    assert capsys.readouterr().err == (
        "kiln train: error: console_interval: got '3ep' (str), expected a time like '30s' or '5m', "
        "batches like '100ba', or null\n"
    )


def test_a_kiln_warning_is_one_line_and_others_keep_pythons_format():
    kiln_line = warnings.formatwarning("it happened", KilnWarning, "/x/kiln/core/callback.py", 32, "method(state)")
    assert kiln_line == "kiln: it happened\n"
    other = warnings.formatwarning("it happened", UserWarning, "/x/y.py", 3, "f()")
    assert other == "/x/y.py:3: UserWarning: it happened\n  f()\n"
    with pytest.warns(UserWarning, match="still a UserWarning"):  # filters and pytest.warns still match
        warnings.warn("still a UserWarning", KilnWarning, stacklevel=1)
