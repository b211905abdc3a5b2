"""What a failed `kiln run` says: reports, their classification and the summary line (no processes).

The jobs themselves (a crash beside a rank that lost its peer, two nodes, Ctrl-C, SIGKILL) are in
tests/test_run_stop.py; here are the rules, fast.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from distributed import base_env
from kiln.launch import failures
from kiln.launch.heartbeat import CollectiveTimeout

GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:27783. This is typically caused by a remote worker crashing. Check the logs of the remote worker "
    "before reporting an error. GLHF!"
)


def _report(kind="error", rank=1, node=0, **kw) -> failures.Report:
    values = dict(
        kind=kind,
        type="RuntimeError",
        message="boom",
        where="model.py:12",
        rank=rank,
        local_rank=rank,
        node=node,
        num_nodes=1,
        host="h",
        pid=100 + rank,
        time=1000.0 + rank,
    )
    values.update(kw)
    return failures.Report(**values)


def _failure(tmp_path, rank, exitcode, report=None) -> ProcessFailure:
    path = tmp_path / f"error{rank}.json"
    if report is not None:
        failures.write(report, "Traceback ...", str(path))
    return ProcessFailure(rank, 100 + rank, exitcode, str(path))


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(GLOO_CLOSED),
        RuntimeError("[../gloo/transport/tcp/pair.cc:598] Connection reset by peer [127.0.0.1]:1"),
        RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation"),
        dist.DistNetworkError("failed to recv, got 0 bytes"),
        dist.DistStoreError("wait timeout after 30000ms, keys: /kiln/x"),
        CollectiveTimeout("kiln: rank 1 did not arrive within 20 s", [1], {}),
    ],
    ids=["gloo-closed", "gloo-reset", "gloo-timeout", "store-network", "store-timeout", "kiln-timeout"],
)
def test_a_vanished_peer_is_a_lost_peer(error):
    assert failures.is_peer_loss(error)
    try:
        raise ValueError("wrapped") from error  # a kiln error raised from the collective's
    except ValueError as wrapped:
        assert failures.is_peer_loss(wrapped)


@pytest.mark.parametrize(
    "error",
    [RuntimeError("boom"), ConnectionResetError(104, "Connection reset by peer"), RuntimeError("shape mismatch")],
    ids=["user-error", "user-download", "torch-error"],
)
def test_the_rank_s_own_errors_are_not_a_lost_peer(error):
    # a ConnectionResetError of the user's own (a download) is the rank's failure, not a peer's
    assert not failures.is_peer_loss(error)


def test_describe_names_type_first_line_and_the_user_frame(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    try:
        json.loads("{")  # raised inside the standard library: the user's line is this one
    except ValueError as exc:
        line = exc.__traceback__.tb_lineno
        report = failures.describe(exc, exc.__traceback__)
    assert (report.kind, report.type, report.rank, report.node) == ("error", "JSONDecodeError", 3, 1)
    assert report.message.startswith("Expecting property name") and report.where == f"test_run_failures.py:{line}"
    lost = failures.describe(RuntimeError(GLOO_CLOSED), None)  # on node 1 of 2: node 0 went away
    assert (lost.kind, lost.message, lost.gone) == (
        "lost_peer",
        "Connection closed by peer [127.0.0.1]:27783",
        "node 0",
    )


def test_summary_names_the_crash_with_its_text_and_the_peer_as_lost(tmp_path):
    found = {
        0: _failure(tmp_path, 0, 1, _report("lost_peer", rank=0, type="RuntimeError", message="Connection closed")),
        1: _failure(tmp_path, 1, 1, _report("error", rank=1)),
        2: _failure(tmp_path, 2, -15),
        3: _failure(tmp_path, 3, -15),
    }
    line = failures.summarize(found)
    assert line == (
        "rank 1 (node 0, host h, pid 101) failed first: RuntimeError: boom (model.py:12); "
        "rank 0 lost its peer; ranks 2-3 were stopped"
    )


def test_a_crash_first_by_time_wins_over_a_later_one_and_signals_name_themselves(tmp_path):
    found = {
        0: _failure(tmp_path, 0, 1, _report("error", rank=0, message="second", time=2000.0)),
        1: _failure(tmp_path, 1, 1, _report("error", rank=1, message="first", time=1000.0)),
    }
    assert failures.summarize(found).startswith("rank 1 (node 0, host h, pid 101) failed first: RuntimeError: first")
    assert "rank 0 also failed: RuntimeError: second (model.py:12)" in failures.summarize(found)
    no_reports = {0: ProcessFailure(0, 101, -15, "<N/A>"), 1: ProcessFailure(1, 102, -6, "<N/A>")}
    line = failures.summarize(no_reports, single_node=True)
    assert line.startswith("rank 1 (node 0, host ") and line.endswith(
        ", pid 102) failed first: killed by SIGABRT; rank 0 was stopped"
    )


def test_the_surviving_node_says_which_node_went_away_and_why(tmp_path):
    peer = _report("error", rank=1, node=1, host="h1", pid=77)
    lost = _report("lost_peer", rank=0, node=0, message="Connection closed", num_nodes=2, gone="node 1")
    lost.peer = dataclasses.asdict(peer)
    line = failures.summarize({0: _failure(tmp_path, 0, 1, lost)})
    assert (
        line
        == "node 1 (host h1) went away: its rank 1 (pid 77) failed first: RuntimeError: boom (model.py:12); rank 0 lost its peer here"
    )
    # without the peer's report (its node died whole): which node, from this rank's own guess
    lost.peer = None
    line = failures.summarize({0: _failure(tmp_path, 0, 1, lost)})
    assert (
        line
        == "node 1 went away: rank 0 (node 0, host h, pid 100) lost its peer at model.py:12: RuntimeError: Connection closed"
    )


def test_a_timeout_with_no_crash_known_ends_the_line_with_the_heartbeat_s_text(tmp_path):
    # the stuck rank is stopped by torchrun; the line ends with the heartbeat's words, as Python ends with the error
    message = "kiln: rank 1 did not arrive within 20 s; last events: rank 0 BEFORE_BACKWARD (batch 5), rank 1 BATCH_START (batch 5)"
    lost = _report("lost_peer", rank=0, type="CollectiveTimeout", message=message, where="train.py:40")
    line = failures.summarize({0: _failure(tmp_path, 0, 1, lost), 1: _failure(tmp_path, 1, -15)}, single_node=True)
    assert (
        line
        == f"rank 1 was stopped; rank 0 (node 0, host h, pid 100) lost its peer at train.py:40: CollectiveTimeout: {message}"
    )


def test_reports_are_found_in_the_last_attempt_of_the_log_folder(tmp_path):
    for attempt, message in ((0, "old"), (1, "new")):
        failures.write(_report(message=message), "", str(tmp_path / f"run_x/attempt_{attempt}/1/error.json"))
    (tmp_path / "run_x/attempt_1/0").mkdir()
    [report] = failures.find_reports(tmp_path)
    assert report.message == "new"
    assert failures.summarize_reports([report]).endswith("failed first: RuntimeError: new (model.py:12)")


def test_the_error_file_is_torchs_format_too(tmp_path):
    report = _report()
    failures.write(report, "Traceback (most recent call last): ...", str(tmp_path / "error.json"))
    failure = ProcessFailure(1, 101, 1, str(tmp_path / "error.json"))  # torchrun parses it on its own
    assert failure.message["message"] == "RuntimeError: boom"
    assert int(failure.timestamp) == int(report.time)
    assert "failed first: RuntimeError: boom" in failures.summarize(ChildFailedError("x", {1: failure}).failures)


def test_the_worker_bootstrap_runs_the_script_as_python_would(tmp_path):
    script = tmp_path / "sub" / "script.py"
    script.parent.mkdir()
    (script.parent / "helper.py").write_text("VALUE = 42\n")
    script.write_text(
        "import pickle, sys\n"
        "from helper import VALUE\n"  # the script's folder is first on sys.path
        "class Thing: pass\n"
        "assert pickle.loads(pickle.dumps(Thing())).__class__ is Thing\n"  # __main__ is the script
        "print(__name__, __file__, sys.argv, VALUE)\n"
        "def fail():\n"
        "    raise KeyError('missing')\n"
        "fail()\n"
    )
    env = {**base_env(), "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json"), "RANK": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "kiln.launch.worker", str(script), "a", "--b"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stdout == f"__main__ {script} ['{script}', 'a', '--b'] 42\n"
    # the traceback starts at the script: no bootstrap or runpy frames
    assert result.stderr.splitlines()[:2] == [
        "Traceback (most recent call last):",
        f'  File "{script}", line 8, in <module>',
    ]
    assert "kiln/launch/worker.py" not in result.stderr and "runpy" not in result.stderr
    report = failures.read(str(tmp_path / "error.json"))
    assert report is not None and report.how() == "KeyError: 'missing' (script.py:7)"


def test_the_worker_bootstrap_runs_a_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text("import sys\nprint(__name__, __package__, sys.argv[1:])\n")
    result = subprocess.run(
        [sys.executable, "-m", "kiln.launch.worker", "-m", "pkg", "x"],
        env=base_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout) == (0, "__main__ pkg ['x']\n"), result.stderr


def test_parent_death_is_armed_and_an_orphan_ends_itself():
    # A child whose recorded launcher pid is not its parent (the launcher died before it armed):
    # it kills itself at once instead of running on.
    code = "from kiln.launch import parent_death; parent_death.arm(parent_pid=1); import time; time.sleep(30)"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], env=base_env(), capture_output=True, timeout=60)
    assert result.returncode == -9 and time.monotonic() - start < 30
    armed = "from kiln.launch import parent_death; import os; print(parent_death.arm(parent_pid=os.getppid()))"
    result = subprocess.run([sys.executable, "-c", armed], env=base_env(), capture_output=True, text=True, timeout=60)
    assert result.stdout == "True\n"


def test_a_sigterm_during_the_report_waits_until_it_is_written():
    # torchrun SIGTERMs the other ranks as soon as one exits: a rank writing its report finishes it first
    import os
    import signal

    from kiln.launch import worker

    seen: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("terminated"))
    try:
        with worker._sigterm_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # Python runs the handler at once, here
            seen.append("report written")
        assert seen == ["report written", "terminated"]
    finally:
        signal.signal(signal.SIGTERM, previous)
