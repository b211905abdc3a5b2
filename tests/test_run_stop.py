"""Stopping `kiln run`, and what a broken job says (real launches of tests/workers/stop_worker.py).

* SIGKILL of the launcher: no worker outlives it (the parent-death signal in each worker).
* Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it): exit 130, one line,
  no traceback; under a Trainer, ``last`` still names a complete checkpoint.
* A crash beside a rank that lost its peer: the summary names the crash with its type, message and
  ``file:line``, and the peer as having lost it.
* Two nodes on localhost, node 1's worker raises: node 0 says node 1 went away, and why.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from distributed import WORKERS, base_env, free_port, kiln_run

WORKER = WORKERS / "stop_worker.py"
BOOM_LINE = next(i for i, line in enumerate(WORKER.read_text().splitlines(), 1) if "# BOOM_LINE" in line)


class Launch:
    """`kiln run ... stop_worker.py MODE` in a session of its own, its output read line by line."""

    def __init__(self, *args: str, nproc: int = 2, extra: tuple[str, ...] = ()) -> None:
        cmd = [sys.executable, "-m", "kiln.cli.main", "run", "-n", str(nproc), *extra, str(WORKER), *args]
        self.proc = subprocess.Popen(
            cmd, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.stdout: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self.worker_pids: list[int] = []
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout.put), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr.append), daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))

    def wait_for(self, prefix: str, count: int = 1, timeout: float = 120) -> list[str]:
        """The next ``count`` stdout lines starting with ``prefix`` (others are skipped)."""
        found, deadline = [], time.monotonic() + timeout
        while len(found) < count:
            try:
                line = self.stdout.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no {prefix!r} line within {timeout} s; stderr:\n" + "\n".join(self.stderr)
                ) from None
            if line.startswith(prefix):
                found.append(line)
        return found

    def started(self, nproc: int = 2) -> list[int]:
        self.worker_pids = [int(line.split()[2]) for line in self.wait_for("started", nproc)]
        return self.worker_pids

    def finish(self, timeout: float = 120) -> int:
        code = self.proc.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=10)
        return code

    def kill_all(self) -> None:
        """Whatever is left of the launch: the launcher's process group and the workers it named."""
        for pid in [self.proc.pid, *self.worker_pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # an orphan's zombie is dead, whoever reaps it


@pytest.fixture
def launches():
    started: list[Launch] = []
    yield lambda *args, **kw: started.append(Launch(*args, **kw)) or started[-1]
    for launch in started:
        launch.kill_all()


@pytest.mark.world_size(2)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_sigkill_of_the_launcher_leaves_no_worker_after_10_s(launches, tmp_path):
    # a log folder of the test's: a SIGKILLed launcher cannot remove the temporary one it makes
    launch = launches("loop", extra=("--log-dir", str(tmp_path / "logs")))
    pids = launch.started()
    os.kill(launch.proc.pid, signal.SIGKILL)  # `kill -9 <kiln run>`: the launcher alone
    launch.finish()
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids)), f"workers {[p for p in pids if _alive(p)]} outlived the SIGKILLed launcher"


@pytest.mark.world_size(2)
def test_ctrl_c_exits_130_with_one_line_and_no_traceback(launches):
    launch = launches("loop")
    pids = launch.started()
    before = len(launch.stderr)
    os.killpg(launch.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the foreground group
    assert launch.finish() == 130
    after = launch.stderr[before:]
    assert after == ["kiln run: stopped by SIGINT (Ctrl-C); every worker has ended"], "\n".join(launch.stderr)
    assert not any(map(_alive, pids))


@pytest.mark.world_size(2)
def test_ctrl_c_during_a_trainer_run_leaves_last_on_a_complete_checkpoint(launches, tmp_path):
    from kiln.checkpoint import verify_checkpoint
    from kiln.checkpoint.layout import link_target

    launch = launches("trainer", str(tmp_path))
    launch.wait_for("saved")  # checkpoints are being written every batch from here on
    before = len(launch.stderr)
    os.killpg(launch.proc.pid, signal.SIGINT)
    assert launch.finish() == 130
    after = launch.stderr[before:]
    assert len(after) <= 2 and not any("Traceback" in line or "KeyboardInterrupt" in line for line in after), after
    assert after[-1] == "kiln run: stopped by SIGINT (Ctrl-C); every worker has ended"
    folder = tmp_path / "ckpt"
    name = link_target(folder, "last")
    assert name is not None and not name.endswith(".tmp") and ".tmp-" not in name
    verify_checkpoint(folder / "last")  # manifest, sizes and checksums of every file


@pytest.mark.world_size(2)
def test_a_crash_is_named_with_its_text_and_the_rank_that_lost_its_peer_is_not_blamed():
    result = kiln_run(WORKER, "boom", timeout=180)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert re.fullmatch(
        rf"kiln run: rank 1 \(node 0, host \S+, pid \d+\) failed first: "
        rf"RuntimeError: boom \(stop_worker\.py:{BOOM_LINE}\); rank 0 lost its peer",
        lines[-1],
    ), result.stderr
    # one traceback, the crash's, from the script on; the peer prints nothing (the summary says it)
    assert result.stderr.count("Traceback (most recent call last)") == 1
    assert f'[rank1]:   File "{WORKER}", line' in result.stderr and "runpy" not in result.stderr
    assert not any(line.startswith("[rank0]") for line in lines), result.stderr
    assert "closing signal" not in result.stderr and "failed (exitcode" not in result.stderr  # torch's, replaced


@pytest.mark.world_size(2)
@pytest.mark.timeout(400)
def test_two_nodes_the_survivor_says_node_1_went_away(launches):
    port, job = free_port(), uuid.uuid4().hex[:8]
    extra = ("--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job)
    nodes = [launches("node", nproc=1, extra=extra) for _ in range(2)]
    assert [node.finish(timeout=300) for node in nodes] == [1, 1]
    summaries = [node.stderr[-1] for node in nodes]
    boom = f"RuntimeError: boom (stop_worker.py:{BOOM_LINE})"
    crashed = [s for s in summaries if "(node 1, host" in s]
    survived = [s for s in summaries if s not in crashed]
    assert len(crashed) == 1 and len(survived) == 1, summaries
    assert re.fullmatch(rf"kiln run: rank 1 \(node 1, host \S+, pid \d+\) failed first: {re.escape(boom)}", crashed[0])
    assert re.fullmatch(
        rf"kiln run: node 1 \(host \S+\) went away: its rank 1 \(pid \d+\) failed first: {re.escape(boom)}; "
        r"rank 0 lost its peer here",
        survived[0],
    ), summaries
