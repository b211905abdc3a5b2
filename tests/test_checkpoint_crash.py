"""Crash safety: SIGKILL at random moments while checkpoints are saved, run after run in one folder.

A server process (one for the module) imports torch once and forks one training process per kill
(tests/workers/ckpt_crash.py), so a kill costs a fork and a few saves, not ~2 s of imports. Each
child saves every batch with ``num_checkpoints_to_keep=2`` (sync or async), either fresh (a new
run among the old run's checkpoints) or resuming ``last``, and is killed after a random delay once
it has saved at least once. After every kill:

* ``last`` verifies (sizes, checksums, safe pickles) and loads into a new State at its step;
* every complete checkpoint (a folder with a manifest) verifies, and nothing else is there but
  ``*.tmp-*`` debris and the links;
* at most ``keep + 1`` checkpoints exist (``keep + 1`` only when the kill fell between a commit and
  its retention), and ``last`` is one of the two most recently saved;
* once a run has made ``keep + 1`` save calls, no checkpoint of an earlier run is left: retention
  counts the whole folder in save order, whatever progress the earlier runs had reached.

Debris (``*.tmp-*``: the save, link update or delete the kill interrupted) may remain after a
kill; it is never taken for a checkpoint, and the next run removes it when it starts (checked:
the debris one kill left is gone after the next run).

Seed: ``KILN_CRASH_SEED=<int>`` replays the delays and fresh/resume choices (where the kills land
still depends on the machine's speed); otherwise each run draws a new seed, printed and named in
every failure message.
"""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
from collections import Counter

import pytest

from distributed import WORKERS, base_env
from kiln.checkpoint import layout, load_checkpoint, verify_checkpoint
from kiln.launch.runlock import LOCK_NAME
from workers.ckpt_common import build_state

NUM_KILLS = 10  # per mode: each run draws new delays, so runs together cover the phases
KEEP, WIDTH = 2, 512  # as in the worker
MAX_DELAY = 0.25  # seconds after the first save: several save cycles, so kills land in every phase


def _proc_state(pid: int | None) -> str:
    """``PID state=D wchan=...``: what a silent process is doing (D: stuck in the kernel, e.g. an fsync)."""
    if pid is None:
        return "none"
    try:
        state = next(line.split(":", 1)[1].strip() for line in open(f"/proc/{pid}/status") if line.startswith("State:"))
        wchan = open(f"/proc/{pid}/wchan").read().strip()
    except (OSError, StopIteration):
        return f"{pid} gone"
    return f"{pid} state={state} wchan={wchan or '-'}"


class Server:
    """The fork server, spoken to line by line; every read has a deadline."""

    def __init__(self, log_path):
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = {**base_env(), "PYTHONPATH": f"{WORKERS.parent}{os.pathsep}{base_env()['PYTHONPATH']}"}
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKERS / "ckpt_crash.py")],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.buffer = b""
        self.child: int | None = None
        self.expect("ready", timeout=120)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def lines(self, timeout: float):
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                yield line.decode()
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(
                    f"no answer from the crash server in {timeout} s (server {_proc_state(self.proc.pid)}, "
                    f"child {_proc_state(self.child)}); unterminated output {self.buffer!r}; its stderr:\n{self.stderr()}"
                )
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise AssertionError(f"the crash server died; its stderr:\n{self.stderr()}")
            self.buffer += chunk

    def expect(self, prefix: str, timeout: float = 60) -> list[str]:
        """Lines up to and including the first that starts with ``prefix``."""
        seen = []
        for line in self.lines(timeout):
            seen.append(line)
            if line.startswith("child "):
                self.child = int(line.split()[1])
            if line.startswith("error"):
                raise AssertionError(f"the training child failed: {line}\n{self.stderr()}")
            if line.startswith(prefix):
                return seen

    def stderr(self) -> str:
        self.log.flush()
        return open(self.log_path).read()[-4000:]

    def close(self) -> None:
        # No child is running (each was killed and reaped); the server holds nothing worth a clean
        # interpreter shutdown, which takes torch seconds.
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # One server for both modes: its start (an interpreter importing torch) is paid once.
    server = Server(tmp_path_factory.mktemp("server") / "server.log")
    yield server
    server.close()


def _seed(mode: str) -> int:
    base = int(os.environ.get("KILN_CRASH_SEED", time.time_ns() % 1_000_000))
    return base * 2 + (mode == "async")


def _folder_state(folder, where):
    """(complete checkpoints oldest save first as (name, manifest), debris names)."""
    complete, debris = [], set()
    for entry in folder.iterdir():
        if entry.name in layout.LINKS or entry.name == LOCK_NAME:  # a killed run's lock; the next takes it over
            continue
        if layout.is_temporary(entry.name):
            debris.add(entry.name)
            continue
        assert entry.is_dir() and (entry / layout.MANIFEST).is_file(), (
            f"{where}: {entry.name} is neither a checkpoint nor debris"
        )
        complete.append((entry.name, json.loads((entry / layout.MANIFEST).read_text())))
    complete.sort(key=lambda item: item[1]["created_unix"])
    return complete, debris


def _debris_kind(name: str) -> str:
    stem, nonce = name.split(layout.TMP, 1)
    if stem in layout.LINKS:
        return "link update"
    return {"old-": "replaced checkpoint", "del-": "retention delete"}.get(nonce[:4], "save in progress")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_at_random_moments_while_saving(tmp_path, server, mode):
    seed = _seed(mode)
    print(f"KILN_CRASH_SEED={seed // 2} ({mode}): {NUM_KILLS} kills")
    rng = random.Random(seed)
    folder = tmp_path / "run"
    previous_debris: set[str] = set()
    debris_seen, num_saves, num_beyond_keep = Counter(), 0, 0
    for kill in range(NUM_KILLS):
        start = "resume" if kill and rng.random() < 0.5 else "fresh"
        delay = rng.uniform(0, MAX_DELAY)
        where = f"seed {seed // 2}, {mode}, kill {kill} ({start}, {delay:.3f} s after the first save)"
        began = time.time()
        server.send(f"run {folder} {mode} {start}")
        lines = server.expect("saved")  # saving has begun: `last` exists from here on
        time.sleep(delay)
        server.send("kill")
        lines += server.expect("exit")
        assert lines[-1].endswith(" -9"), f"{where}: the child was not killed by SIGKILL: {lines[-1]}"
        saves = sum(line.startswith("saved") for line in lines)
        num_saves += saves

        complete, debris = _folder_state(folder, where)
        names = [name for name, _ in complete]
        assert not previous_debris & debris, (
            f"{where}: the last kill's debris was not cleaned up: {previous_debris & debris}"
        )
        assert 1 <= len(complete) <= KEEP + 1, f"{where}: {len(complete)} checkpoints with keep={KEEP}: {names}"
        if saves >= KEEP + 1:
            stale = [name for name, manifest in complete if manifest["created_unix"] < began]
            assert not stale, f"{where}: after {saves} saves an earlier run's checkpoints remain: {stale} of {names}"
        last = layout.link_target(folder, "last")
        assert last in names[-2:], f"{where}: last -> {last}, but the most recent saves are {names[-2:]}"
        for name in names:
            verify_checkpoint(folder / name)
        state = build_state(seed=1, width=WIDTH)
        manifest = load_checkpoint(folder / "last", state)
        assert manifest["name"] == last and state.timestamp.batch.value == manifest["timestamp"]["batch"] >= 1, where
        num_beyond_keep += len(complete) > KEEP
        debris_seen.update(_debris_kind(name) for name in debris)
        previous_debris = debris
    print(
        f"{num_saves} save calls; {num_beyond_keep} kills between a commit and its retention; "
        f"debris found: {dict(debris_seen)}"
    )
