"""The distribution: `python -m build` makes a wheel that installs in a fresh virtual environment
(no system site-packages) and runs `kiln --help`; its metadata and contents are what we publish.

The build runs on a copy of the files a wheel is made from, so nothing (build/, *.egg-info) is
written into the repository. It builds without isolation, with the setuptools of the running
environment (checked against pyproject's build-system requirement): an isolated build would first
install setuptools into a build environment of its own, for no more proof about the wheel. torch
comes from the machine's pinned CPU wheel (as the Makefile installs it), the other dependencies
from the index; pip installs without byte-compiling (the compile of every torch module was most of
the test's CPU; the interpreters that import them compile what they import), and the venv gets no
pip of its own (the running environment's pip installs into it with --python).
"""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
DIST_NAME = "kiln-train"
EXTRAS = {"hf", "vision", "s3", "loggers", "report", "deepspeed", "docs"}


_PROBE = """
import importlib.metadata as m, json, sys
import torch
from torch import nn
import kiln

torch.manual_seed(0)
model = nn.Linear(4, 2)
data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
loader = torch.utils.data.DataLoader(data, batch_size=8)
trainer = kiln.Trainer(
    model, train_dataloader=loader, eval_dataloader=loader, max_duration="1ep",
    optimizers=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
    eval_metrics={"Accuracy": kiln.metrics.Accuracy()}, save_folder=sys.argv[1], progress_bar=False,
)
trainer.fit()
trainer.close()
print(json.dumps([kiln.__version__, m.version("kiln-train"), kiln.__file__, sorted(trainer.state.metrics)]))
"""


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _run(*command, cwd=None, timeout=600, env=None) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _version() -> str:
    import kiln

    return kiln.__version__


def test_pyproject_declares_a_publishable_distribution():
    project = _pyproject()["project"]
    assert project["name"] == DIST_NAME
    # One place for the version: kiln.__version__, read by setuptools.
    assert "version" not in project and "version" in project["dynamic"]
    assert _pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kiln.__version__"}
    assert EXTRAS <= set(project["optional-dependencies"])
    report = project["optional-dependencies"]["report"]
    assert any(r.startswith("matplotlib") for r in report)
    assert any(r.startswith("tensorboard") for r in project["optional-dependencies"]["loggers"])
    assert all(url.startswith("https://") for url in project["urls"].values())
    assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert f"## {_version()}" in (ROOT / "CHANGELOG.md").read_text()
    # The declared torch floor is the version the suite runs on (see pyproject's comment).
    torch_spec = next(d for d in project["dependencies"] if d.startswith("torch"))
    import torch

    floor = tuple(int(p) for p in torch_spec.split(">=")[1].split("."))
    assert tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= floor


def test_kiln_version_flag_matches_the_package(capsys):
    from kiln.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kiln {_version()}"


@pytest.mark.slow  # about a minute, two on a busy machine: torch is installed into the new venv
@pytest.mark.timeout(900)  # 264 s measured beside the other xdist worker on a loaded machine
def test_wheel_installs_in_a_fresh_venv_and_runs(tmp_path):
    pytest.importorskip("build")
    # The files a wheel is built from, copied: setuptools writes build/ and *.egg-info beside them.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path / "dist"
    # Built without isolation, so the setuptools here must be one pyproject's build-system allows.
    from importlib.metadata import version as installed_version

    from packaging.requirements import Requirement

    for requirement in map(Requirement, _pyproject()["build-system"]["requires"]):
        assert requirement.specifier.contains(installed_version(requirement.name)), requirement
    _run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, source, timeout=300)
    (wheel,) = dist.glob("*.whl")
    version = _version()
    assert wheel.name == f"kiln_train-{version}-py3-none-any.whl"

    names = zipfile.ZipFile(wheel).namelist()
    dist_info = f"kiln_train-{version}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in names
    assert "kiln/py.typed" in names and "kiln/cli/report.py" in names and "kiln/report/plots.py" in names
    assert not [n for n in names if not (n.startswith("kiln/") or n.startswith(dist_info))], "stray files"
    metadata = email.message_from_bytes(zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA"))
    assert metadata["Name"] == DIST_NAME and metadata["Version"] == version
    assert EXTRAS <= set(metadata.get_all("Provides-Extra"))
    assert metadata.get_all("Classifier") and metadata.get_all("Project-URL")

    # A fresh environment: no system site-packages, so the wheel's declared dependencies must do.
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python, kiln = venv / "bin" / "python", venv / "bin" / "kiln"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # torch pinned in the same resolve: an unpinned one would pull a multi-GB CUDA build (Makefile's
    # note). --no-compile: no .pyc for the thousands of modules nothing here imports.
    pip = (sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-compile")
    _run(*pip, "torch==2.13.0", wheel, env=env)

    assert _run(kiln, "--help", cwd=tmp_path, env=env).stdout.startswith("usage: kiln")
    assert _run(kiln, "--version", cwd=tmp_path, env=env).stdout.strip() == f"kiln {version}"
    # A one-epoch fit with evaluation metrics and a checkpoint: the core runs on the declared
    # dependencies alone (an import of kiln.Trainer alone does not reach torchmetrics).
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    out = _run(python, probe, tmp_path / "checkpoints", cwd=tmp_path, env=env).stdout
    found, installed, location, metrics = json.loads(out.strip().splitlines()[-1])
    assert found == installed == version
    assert Path(location).is_relative_to(venv), f"kiln imported from {location}, not the venv"
    assert {"eval/loss", "eval/Accuracy"} <= set(metrics)
    assert (tmp_path / "checkpoints" / "last").exists()
    # Without the `report` extra, kiln report says what to install, in one line, and exits 2.
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "metrics": {"train/loss": 1.0}}\n')
    done = subprocess.run([kiln, "report", run], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"kiln report needs matplotlib: pip install '{DIST_NAME}[report]'"
    assert not (run / "report").exists()
