"""`kiln run`: torchrun arguments, and clear exits on bad input (refused in this process, before any\nworker starts); a real launch for a worker's non-zero status."""

from __future__ import annotations

import subprocess
import sys

from kiln.cli.main import build_parser, main
from kiln.cli.run import torchrun_args


def _args(*argv):
    return build_parser().parse_args(["run", *argv])


def test_single_node_uses_standalone_rendezvous():
    assert torchrun_args(_args("-n", "2", "train.py", "--lr", "0.1")) == [
        "--nproc-per-node=2",
        "--nnodes=1",
        "--max-restarts=0",
        "--standalone",
        "--module",
        "kiln.launch.worker",  # kiln's worker bootstrap runs the script (parent-death signal, failure reports)
        "train.py",
        "--lr",
        "0.1",
    ]


def test_multi_node_options_pass_through():
    argv = torchrun_args(
        _args(
            "-n",
            "4",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--rdzv-endpoint",
            "host:29400",
            "--max-restarts",
            "3",
            "train.py",
        )
    )
    assert argv == [
        "--nproc-per-node=4",
        "--nnodes=2",
        "--max-restarts=3",
        "--rdzv-endpoint=host:29400",
        "--rdzv-backend=c10d",  # no --node-rank: the c10d rendezvous numbers the nodes itself
        "--module",
        "kiln.launch.worker",
        "train.py",
    ]


def test_a_module_runs_through_the_worker_bootstrap_too():
    assert torchrun_args(_args("-n", "2", "-m", "pkg.train", "--x"))[-5:] == [
        "--module",
        "kiln.launch.worker",
        "-m",
        "pkg.train",
        "--x",
    ]


def _kiln(*argv):
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", *argv], capture_output=True, text=True, timeout=60)


def _kiln_here(monkeypatch, capsys, *argv):
    """`kiln ARGV`'s exit status and stderr, in this process: bad input is refused before torchrun or
    any worker starts, by the ``main`` that ``python -m kiln.cli.main`` exits with."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the working directory on it
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_missing_script_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    code, err = _kiln_here(monkeypatch, capsys, "run", "-n", "2", str(tmp_path / "nope.py"))
    assert code == 2
    assert err.strip().splitlines() == [
        f"kiln run: script '{tmp_path / 'nope.py'}' does not exist (pass a Python file, or -m for a module)"
    ]


def test_bad_process_count_exits_2(tmp_path, monkeypatch, capsys):
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    code, err = _kiln_here(monkeypatch, capsys, "run", "-n", "two", str(script))
    assert code == 2 and "-n 'two' is not a process count" in err


def test_failing_worker_propagates_nonzero_status(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    result = _kiln("run", "-n", "1", str(script))
    assert result.returncode != 0
