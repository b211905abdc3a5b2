"""One traceback per failure, at any world size (issue 33.2): real launches through `kiln run`.

* One rank of 3 raises: its traceback once, then the one summary line (the other 2 ranks grouped,
  one on each side of it; the grouping of 512 ranks is checked without processes at the end).
* Every rank of 3 raises the same error: still one traceback, and "ranks ... failed the same way".
* An optimizer given by name in Python (``optimizers="adamw"``): one line at the user's line (a
  launch of 2 ranks; kiln refuses that name before it builds anything, a misspelt strategy only
  after building the optimizer, whose first construction imports torch._dynamo: ~1.5 CPU-s a rank
  more). A misspelt strategy or precision is a refusal of the same kind: checked in this process,
  from the report the worker would write to the one line the launcher would print.
* A script that does not compile: one line naming the file and line, before any worker starts
  (kiln run's main, in this process); a module the script imports that does not compile: one
  line at that module's line (a launch of 1 rank).
* ``--max-restarts 2``: each restart line names the rank that died first and how: one launch whose
  first attempt loses a rank to a SIGKILL (as the OOM killer sends it), the second to an exception
  (after its one traceback), and the third finishes.

The scripts are written here, so the lines the output names are known. Lines that a process
killed with a signal writes go out with one ``os.write`` each.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import textwrap
from pathlib import Path

import pytest

from distributed import kiln_run
from kiln.launch import failures

HOST = r"\(node 0, host \S+, pid \d+\)"


def _script(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def _line(path: Path, text: str) -> int:
    """The number of the first line of ``path`` that holds ``text`` (whole-line statements: Python
    3.11 underlines part of a line with ^^^, which a comment after the statement would bring)."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _ranks(clause: str) -> set[int]:
    """``ranks 0-2, 4`` -> {0, 1, 2, 4}."""
    numbers: set[int] = set()
    for span in clause.split(" ", 1)[1].split(", "):
        low, _, high = span.partition("-")
        numbers.update(range(int(low), int(high or low) + 1))
    return numbers


def _others(tail: str) -> dict[str, set[int]]:
    """The ranks of each clause of a summary's tail: ``; ranks 1-2 lost their peer; rank 0 was stopped``."""
    found: dict[str, set[int]] = {}
    for clause in filter(None, tail.split("; ")):
        m = re.fullmatch(
            r"(ranks? [\d, -]+) (lost its peer|lost their peer|was stopped|were stopped|failed the same way)", clause
        )
        assert m, f"unexpected clause {clause!r} in {tail!r}"
        what = {"lost its peer": "lost", "lost their peer": "lost", "was stopped": "stopped", "were stopped": "stopped"}
        found.setdefault(what.get(m.group(2), m.group(2)), set()).update(_ranks(m.group(1)))
    return found


ONE_RAISES = """\
import torch.distributed as dist

import kiln

ctx = kiln.launch_from_torch()
if ctx.rank == 1:
    raise RuntimeError("boom")
dist.barrier()  # the others wait here for rank 1, which never comes
"""


@pytest.mark.world_size(3)
@pytest.mark.timeout(300)
def test_one_rank_of_3_raising_is_one_traceback_and_one_line(tmp_path):
    # 3 ranks, rank 1 failing: the others are grouped on both sides of it (ranks 0, 2); a fourth
    # rank (~3.5 CPU-s) shows nothing more: ranges of ranks are checked without processes below
    script = _script(tmp_path, "boom.py", ONE_RAISES)
    boom = _line(script, "raise")
    result = kiln_run(script, nproc=3, timeout=280)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert lines[:4] == [
        "[rank1]: Traceback (most recent call last):",
        f'[rank1]:   File "{script}", line {boom}, in <module>',
        '[rank1]:     raise RuntimeError("boom")',
        "[rank1]: RuntimeError: boom",
    ], result.stderr
    assert len(lines) == 5 and result.stdout == "", result.stderr
    m = re.fullmatch(rf"kiln run: rank 1 {HOST} failed first: RuntimeError: boom \(boom\.py:{boom}\)(.*)", lines[4])
    assert m, lines[4]
    # every other rank is named once: it lost its peer (gloo saw rank 1 go) or torchrun stopped it first
    others = _others(m.group(1))
    assert set(others) <= {"lost", "stopped"}, others
    assert sorted(n for ranks in others.values() for n in ranks) == [0, 2], lines[4]


EVERY_RANK_RAISES = """\
import os

import kiln

ctx = kiln.launch_from_torch()
open(os.path.join(os.path.dirname(__file__), "data.csv"))
"""


@pytest.mark.world_size(3)
@pytest.mark.timeout(300)
def test_every_rank_raising_the_same_error_is_one_traceback(tmp_path):
    # 3 ranks: three copies of one traceback, and two others to group in one clause (a fourth rank
    # proves nothing more; the grouping of 512 ranks is checked without processes below)
    script = _script(tmp_path, "train.py", EVERY_RANK_RAISES)
    opened = _line(script, "open(")
    result = kiln_run(script, nproc=3, timeout=280)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert result.stderr.count("Traceback (most recent call last)") == 1 and len(lines) == 5, result.stderr
    first = re.fullmatch(r"\[rank(\d)\]: Traceback \(most recent call last\):", lines[0])
    assert first, lines[0]
    rank = int(first.group(1))
    assert lines[1:4] == [
        f'[rank{rank}]:   File "{script}", line {opened}, in <module>',
        f'[rank{rank}]:     open(os.path.join(os.path.dirname(__file__), "data.csv"))',
        f"[rank{rank}]: FileNotFoundError: [Errno 2] No such file or directory: '{tmp_path / 'data.csv'}'",
    ], result.stderr
    how = rf"FileNotFoundError: \[Errno 2\] No such file or directory: '{re.escape(str(tmp_path / 'data.csv'))}' \(train\.py:{opened}\)"
    m = re.fullmatch(rf"kiln run: rank {rank} {HOST} failed first: {how}(.*)", lines[4])
    assert m, lines[4]
    others = _others(m.group(1))  # most fail the same way; one torchrun stopped first would be said so
    assert "failed the same way" in others and set(others) <= {"failed the same way", "stopped"}, others
    assert sorted(n for ranks in others.values() for n in ranks) == sorted({0, 1, 2} - {rank}), lines[4]


MISSPELT = """\
import sys

import torch

import kiln

ctx = kiln.launch_from_torch()
model = torch.nn.Linear(2, 2)
name, value = sys.argv[1], sys.argv[2]
trainer = kiln.Trainer(model, criterion=torch.nn.MSELoss(), progress_bar=False, **{name: value})
"""


STRATEGY = (
    "strategy='ddpp' is not known; expected one of auto, ddp, deepspeed, fsdp, hybrid, pp, single, tp, "
    "zero1, zero2, zero3 (did you mean 'ddp'?)"
)
OPTIMIZER = (
    "optimizers='adamw' is a name, not an optimizer; pass one built on the model's parameters, "
    "e.g. torch.optim.AdamW(model.parameters()) (did you mean 'torch.optim.AdamW'?)"
)


@pytest.mark.timeout(300)
def test_a_misspelt_name_in_python_is_one_line_at_the_user_s_call(tmp_path):
    script = _script(tmp_path, "train.py", MISSPELT)
    call = _line(script, "kiln.Trainer(")
    result = kiln_run(script, "optimizers", "adamw", nproc=2, timeout=280)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
    [line] = result.stderr.splitlines()
    m = re.fullmatch(
        rf"kiln run: rank (\d) {HOST} failed first: ValueError: (optimizers=.*\(did you mean '.+'\?\)) "
        rf"\(train\.py:{call}\)(.*)",
        line,
    )
    assert m, line
    assert m.group(2) == OPTIMIZER
    # the other rank failed the same way, or torchrun stopped it before it could
    assert m.group(3) in (
        f"; rank {1 - int(m.group(1))} failed the same way",
        f"; rank {1 - int(m.group(1))} was stopped",
    )


@pytest.mark.parametrize("name, value, said", [("precision", "amp_bf61", None), ("strategy", "ddpp", STRATEGY)])
def test_a_misspelt_precision_or_strategy_is_one_line_at_the_user_s_call(tmp_path, name, value, said):
    """What the launch above shows for an optimizer given by name, for the other names: the worker's report
    (kiln.launch.failures.describe, which its excepthook writes) is brief and at the user's line,
    so the launcher's summary (failures.explain) is one line and no traceback. A one-rank summary
    has no clause after the cause (as the launch of main.py below shows)."""
    import torch

    import kiln

    try:
        kiln.Trainer(torch.nn.Linear(2, 2), criterion=torch.nn.MSELoss(), progress_bar=False, **{name: value})
    except ValueError as exc:
        report = failures.describe(exc, exc.__traceback__)
        call = exc.__traceback__.tb_lineno  # this frame's line: the call into kiln
    assert report.brief and report.where == f"test_one_traceback.py:{call}", report
    summary = failures.explain(
        {0: _rank(tmp_path, 0, dataclasses.replace(report, host="h", pid=100, node=0, num_nodes=1))}
    )
    assert summary.traceback is None, summary.traceback
    m = re.fullmatch(
        rf"rank 0 \(node 0, host h, pid 100\) failed first: ValueError: ({re.escape(name)}=.*\(did you mean '.+'\?\)) "
        rf"\(test_one_traceback\.py:{call}\)",
        summary.line,
    )
    assert m, summary.line
    assert said is None or m.group(1) == said  # the strategy's whole sentence, as the launch once showed it


@pytest.mark.timeout(300)
def test_a_script_that_does_not_compile_is_one_line_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    script = _script(tmp_path, "train.py", "import kiln\n\ndef step(:\n    pass\n")
    logs = tmp_path / "logs"
    # `kiln run` refuses it before torchrun starts: the main that `python -m kiln.cli.main` exits
    # with, in this process (a launch would pay the launcher's start-up to show the same)
    from kiln.cli.main import main

    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the working directory on it
    assert main(["run", "-n", "2", "--log-dir", str(logs), str(script)]) == 1
    assert capsys.readouterr().err == f"kiln run: SyntaxError: invalid syntax ({script}:3); no worker was started\n"
    assert not logs.exists()  # torchrun makes it when it starts: it never did

    # a module it imports is compiled by the worker, which names that module's line
    _script(tmp_path, "helper.py", "steps = (\n")
    main = _script(tmp_path, "main.py", "import helper\n")
    result = kiln_run(main, nproc=1, timeout=120)
    assert result.returncode == 1
    assert re.fullmatch(
        rf"kiln run: rank 0 {HOST} failed first: SyntaxError: '\(' was never closed \(helper\.py:1\)\n", result.stderr
    ), result.stderr


RESTARTED = """\
import os
import signal
import sys

import torch.distributed as dist

import kiln

ctx = kiln.launch_from_torch()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if ctx.rank == 1 and attempt < len(sys.argv) - 1:
    os.write(1, f"dying {os.getpid()}\\n".encode())
    if sys.argv[1 + attempt] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
    raise RuntimeError("boom")
dist.barrier()
os.write(1, f"done {ctx.rank}\\n".encode())
"""


@pytest.mark.timeout(400)
def test_a_restart_names_the_rank_that_died_first_and_how(tmp_path):
    # one launch, 3 attempts: rank 1 is SIGKILLed in the first, raises in the second
    script = _script(tmp_path, "train.py", RESTARTED)
    boom = _line(script, "raise")
    result = kiln_run(script, "kill", "raise", nproc=2, extra=["--max-restarts", "2"], timeout=380)
    assert result.returncode == 0, result.stderr
    pids = re.findall(r"^dying (\d+)$", result.stdout, re.MULTILINE)
    assert len(pids) == 2, result.stdout
    assert sorted(re.findall(r"^done \d$", result.stdout, re.MULTILINE)) == ["done 0", "done 1"], result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 6, result.stderr

    def restart(pid, said, left):
        return (
            rf"kiln run: rank 1 \(node 0, host \S+, pid {pid}\) failed first: {said}"
            rf"(; rank 0 (lost its peer|was stopped))?; restarting the workers \({left} of 2 restarts left after this one\)"
        )

    # the kill: one line, no traceback
    assert re.fullmatch(restart(pids[0], "killed by SIGKILL", 1), lines[0]), result.stderr
    # the exception: the traceback of the attempt that failed, once, then its line
    assert lines[1:5] == [
        "[rank1]: Traceback (most recent call last):",
        f'[rank1]:   File "{script}", line {boom}, in <module>',
        '[rank1]:     raise RuntimeError("boom")',
        "[rank1]: RuntimeError: boom",
    ], result.stderr
    assert re.fullmatch(restart(pids[1], rf"RuntimeError: boom \(train\.py:{boom}\)", 0), lines[5]), result.stderr


# ----------------------------------------------------------------------------- the rules, no processes


def _rank(
    tmp_path, rank, report=None, exitcode=1, traceback="Traceback (most recent call last):\n  x\nValueError: v\n"
):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error{rank}.json"
    if report is not None:
        failures.write(report, traceback, str(path))
    return ProcessFailure(rank, 100 + rank, exitcode, str(path))


def _report(rank, **kw) -> failures.Report:
    values = dict(kind="error", type="ValueError", message="v", where="train.py:9", rank=rank, local_rank=rank)
    values.update(node=0, num_nodes=1, host="h", pid=100 + rank, time=1000.0 + rank)
    values.update(kw)
    return failures.Report(**values)


def test_the_same_failure_on_many_ranks_is_one_clause_and_one_traceback(tmp_path):
    found = {r: _rank(tmp_path, r, _report(r)) for r in range(512) if r not in (7, 9)}
    found[7] = _rank(tmp_path, 7, _report(7, message="other"))
    found[9] = _rank(tmp_path, 9, exitcode=-15)  # no report: torchrun's SIGTERM
    summary = failures.explain(found)
    assert summary.line == (
        "rank 0 (node 0, host h, pid 100) failed first: ValueError: v (train.py:9); ranks 1-6, 8, 10-511 failed "
        "the same way; rank 7 also failed: ValueError: other (train.py:9); rank 9 was stopped"
    )
    assert summary.traceback == "[rank0]: Traceback (most recent call last):\n[rank0]:   x\n[rank0]: ValueError: v"


def test_a_brief_report_has_no_traceback_and_kiln_s_refusals_are_brief(tmp_path):
    summary = failures.explain({0: _rank(tmp_path, 0, _report(0, brief=True))})
    assert summary.traceback is None and summary.line.endswith("failed first: ValueError: v (train.py:9)")
    import torch

    import kiln

    try:
        kiln.Trainer(torch.nn.Linear(2, 2), criterion=torch.nn.MSELoss(), strategy="ddpp", progress_bar=False)
    except ValueError as exc:
        report = failures.describe(exc, exc.__traceback__)
        call = exc.__traceback__.tb_lineno  # this frame's line: the call into kiln
    assert report.brief and report.where == f"test_one_traceback.py:{call}"  # not kiln's line that raised
    try:
        raise ValueError("the user's own")
    except ValueError as exc:
        assert not failures.describe(exc, exc.__traceback__).brief  # raised by the user: a traceback
