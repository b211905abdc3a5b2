"""Crash safety: a process killed with SIGKILL at random moments while saving leaves a `last`
that verifies and loads (and the debris is cleaned up by the next run)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest

from distributed import WORKERS, base_env
from kiln.checkpoint import load_checkpoint, verify_checkpoint
from kiln.checkpoint.layout import resolve_checkpoint
from workers.ckpt_common import build_state


def _kill_while_saving(folder, delay, mode):
    env = {**base_env(), "PYTHONPATH": f"{WORKERS.parent}:{base_env()['PYTHONPATH']}"}
    proc = subprocess.Popen([sys.executable, str(WORKERS / "ckpt_crash.py"), str(folder), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the first checkpoint is committed: now it is saving all the time
        assert line.startswith("saved"), proc.stderr.read()[-3000:]
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_while_saving_leaves_a_loadable_last(tmp_path, mode):
    rng = random.Random(0 if mode == "sync" else 1)
    for round_ in range(2):  # the second run also starts among the first one's debris
        _kill_while_saving(tmp_path, rng.uniform(0.05, 0.6), mode)
        last = resolve_checkpoint(tmp_path, "last")
        manifest = verify_checkpoint(last)
        state = build_state(width=512)
        load_checkpoint(last, state)
        assert state.timestamp.batch.value == manifest["timestamp"]["batch"] >= 1
