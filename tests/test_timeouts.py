"""Timeouts: ``timeout=`` on every launcher and in the config CLI, and the one line naming a rank
that did not arrive (kiln.launch.heartbeat). Real stuck ranks: a Trainer's under `kiln run` (whose
summary is the line), a plain Engine loop's on one and on two nodes forked from the warm server
(tests/distributed.py) with torchrun's variables (the line is the rank's own)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import kiln
from distributed import WORKERS, base_env, fork_ranks, fork_run
from kiln.launch.heartbeat import _KEY, CollectiveTimeout, Heartbeat, is_timeout

LAUNCHERS = {
    "launch": lambda t: kiln.launch(rank=0, world_size=1, timeout=t),
    "launch_from_torch": lambda t: kiln.launch_from_torch(timeout=t),
    "launch_from_slurm": lambda t: kiln.launch_from_slurm(host="127.0.0.1", port=1, timeout=t),
    "launch_from_openmpi": lambda t: kiln.launch_from_openmpi(host="127.0.0.1", port=1, timeout=t),
}


@pytest.mark.parametrize(
    "value",
    [0, -5, timedelta(0), "600", True, float("nan"), float("inf")],
    ids=["zero", "negative", "zero-timedelta", "string", "bool", "nan", "inf"],
)
@pytest.mark.parametrize("name", LAUNCHERS)
def test_bad_timeouts_are_refused_naming_the_value(name, value):
    with pytest.raises(ValueError, match=re.escape(f"timeout={value!r}")):
        LAUNCHERS[name](value)  # before any environment variable is read


@pytest.mark.parametrize("value", [20, 2.5, timedelta(seconds=20)])
def test_good_timeouts_launch(value):
    assert kiln.launch(rank=0, world_size=1, timeout=value).world_size == 1


def test_config_cli_timeout_is_checked_and_reaches_the_launcher(tmp_path, monkeypatch, capsys):
    from kiln.cli import train
    from kiln.cli.main import main
    from kiln.config import ComputeConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(
        "model: {type: torch.nn.Linear, args: {in_features: 2, out_features: 1}}\ncompute_config: {timeout: 0}\n"
    )
    assert main(["train", "-f", "run.yaml", "--print-config"]) == 2
    assert "compute_config.timeout: got 0" in capsys.readouterr().err
    assert ComputeConfig().timeout == 600

    seen = []

    class Stop(Exception):
        pass

    def launch(**kwargs):
        seen.append(kwargs)
        raise Stop

    from kiln.launch import join

    # Under torchrun with a world of 2 the CLI joins through kiln.launch.join (its one home).
    monkeypatch.setitem(join._LAUNCHERS, "torchrun", launch)
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = type("Args", (), {"compute_config": ComputeConfig(timeout=20)})()
    with pytest.raises(Stop):
        train.run_training(args)
    assert seen == [{"timeout": 20.0}]


# -- the heartbeat, in one process ----------------------------------------------------------------
@pytest.fixture
def store():
    # port 0: the store binds a free port itself and holds it (no other test or xdist worker can take it)
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def _peer(store, rank, where, waiting=False):
    store.set(_KEY.format(rank), json.dumps({"where": where, "waiting": waiting}))


def test_two_ranks_the_other_did_not_arrive(store):
    beat = Heartbeat(store, 0, 2, timeout=20)
    beat.where = lambda: "BEFORE_BACKWARD (batch 5)"
    beat.start()
    _peer(store, 1, "BATCH_START (batch 5)")
    error = beat.timed_out()
    assert isinstance(error, CollectiveTimeout) and error.missing == [1]
    assert str(error) == (
        "kiln: rank 1 did not arrive within 20 s; last events: "
        "rank 0 BEFORE_BACKWARD (batch 5), rank 1 BATCH_START (batch 5)"
    )
    assert json.loads(store.get(_KEY.format(0)))["waiting"] is True


def test_larger_worlds_name_the_ranks_that_are_not_waiting(store):
    beat = Heartbeat(store, 2, 4, timeout=0.8)  # grace: 0.2 s for the other waiting ranks' marks
    beat.start()
    _peer(store, 0, "BEFORE_BACKWARD (batch 3)", waiting=True)
    _peer(store, 1, "AFTER_FORWARD (batch 3)")
    error = beat.timed_out()  # rank 3 never published
    assert error.missing == [1, 3]
    assert str(error).startswith(
        "kiln: ranks 1, 3 did not arrive within 0.8 s; last events: rank 0 BEFORE_BACKWARD "
        "(batch 3), rank 1 AFTER_FORWARD (batch 3), rank 2 no kiln event yet, rank 3 no heartbeat"
    )


def test_only_c10d_timeouts_are_explained():
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv"
    assert is_timeout(RuntimeError(gloo)) and is_timeout(dist.DistBackendError("wait timeout after 20000ms"))
    assert not is_timeout(RuntimeError("HTTP request timed out")) and not is_timeout(ValueError(gloo))
    assert not is_timeout(CollectiveTimeout(gloo, [], {}))


# -- a real stuck rank ----------------------------------------------------------------------------
def _warm_forkserver(folder) -> None:
    """Fork one empty rank first: the clock is the job's, not the start of the warm server (once per
    pytest worker: torch and kiln imported, a minute or more on a loaded machine)."""
    empty = folder / "empty.py"
    empty.write_text("")
    fork_ranks(empty, lambda r: {}, nproc=1, timeout=60)


@pytest.mark.timeout(400)  # the warm server's start included, when this is the worker's first fork
@pytest.mark.parametrize(
    "loop, timeout, events",
    [
        # 10 s, not 20: rank 0 sits out the whole timeout before the line; the engine job has run
        # with 5 under the loaded suite, so 10 leaves the Trainer's start-up twice that slack
        ("trainer", 10, r"rank 0 [A-Z_]+ \(batch 5\), rank 1 BATCH_START \(batch 5\)"),
        ("engine", 5, r"rank 0 Engine\.\w+ \(step 5\), rank 1 Engine\.optimizer_step \(step 4\)"),
    ],
    ids=["trainer", "engine"],
)
def test_a_rank_that_stops_is_named_within_the_timeout(tmp_path, loop, timeout, events):
    """Rank 1 sleeps at batch 5; the job ends within the timeout and a little, failed, with one line
    naming rank 1 and each rank's last event: raised by the Trainer (the line is `kiln run`'s summary
    of rank 0's failure: a real launch, in its own process group, killed whole if it outlives the
    test's patience, as torchrun would otherwise leave the sleeping rank behind), printed by rank 0
    for a plain Engine loop (the line is the rank's own: the ranks are forked from the warm server
    with torchrun's variables, and once rank 0 has failed the others are stopped, as torchrun's
    agent does)."""
    if loop == "trainer":
        cmd = [sys.executable, "-m", "kiln.cli.main", "run", "-n", "2", str(WORKERS / "stuck_rank.py"), str(timeout)]
        start = time.monotonic()
        proc = subprocess.Popen(
            [*cmd, loop], env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        code = proc.returncode
    else:
        _warm_forkserver(tmp_path)
        start = time.monotonic()
        result = fork_run(WORKERS / "stuck_rank.py", str(timeout), loop, timeout=90)
        out, code = result.stdout + result.stderr, result.returncode
    seconds = time.monotonic() - start
    assert code != 0, out[-4000:]
    assert seconds < timeout + 40, f"took {seconds:.0f} s\n{out[-4000:]}"
    lines = [line for line in out.splitlines() if "did not arrive within" in line]
    assert len(lines) == 1, out[-4000:]
    assert re.search(rf"kiln: rank 1 did not arrive within {timeout} s; last events: {events}$", lines[0]), lines[0]


# -- several nodes: the line names the node and host of the ranks that did not arrive -----------
def test_in_a_multi_node_job_the_ranks_that_did_not_arrive_are_named_with_node_and_host(store):
    def beat(rank, node, host, where, waiting=False):
        peer = Heartbeat(store, rank, 4, timeout=0.8, node=node, num_nodes=2, host=host)
        peer.where = lambda: where
        peer._publish(store, waiting=waiting)  # what its thread publishes

    beat(0, 0, "gpu01", "BEFORE_BACKWARD (batch 3)", waiting=True)
    beat(1, 0, "gpu01", "AFTER_FORWARD (batch 3)")
    beat(3, 1, "gpu02", "BATCH_START (batch 3)")
    me = Heartbeat(store, 2, 4, timeout=0.8, node=1, num_nodes=2, host="gpu02")
    me.start()
    error = me.timed_out()
    assert error.missing == [1, 3]
    assert str(error) == (
        "kiln: ranks 1 (node 0, host gpu01), 3 (node 1, host gpu02) did not arrive within 0.8 s; last events: "
        "rank 0 BEFORE_BACKWARD (batch 3), rank 1 AFTER_FORWARD (batch 3), rank 2 no kiln event yet, "
        "rank 3 BATCH_START (batch 3)"
    )


@pytest.mark.timeout(400)  # the warm server's start included, when this is the worker's first fork
def test_a_stuck_rank_on_another_node_is_named_with_its_node_and_host(tmp_path):
    """Two real processes as torchrun starts them on two nodes of one process each (GROUP_RANK 0
    and 1, GROUP_WORLD_SIZE 2): rank 1 stops at step 5; rank 0's line names rank 1's node and host."""
    from distributed import free_port

    port = free_port()
    env = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    # forked from the warm server; once rank 0 has failed, rank 1 (asleep at step 5) is stopped
    results = fork_ranks(
        WORKERS / "stuck_rank.py", lambda r: {**env, "RANK": r, "GROUP_RANK": r}, args=("3", "engine"), timeout=90
    )
    out = results[0].stdout + results[0].stderr
    assert results[0].returncode != 0, out[-4000:]
    lines = [line for line in out.splitlines() if "did not arrive within" in line]
    host = re.escape(socket.gethostname())
    assert len(lines) == 1 and re.fullmatch(
        rf"kiln: rank 1 \(node 1, host {host}\) did not arrive within 3 s; last events: "
        r"rank 0 Engine\.\w+ \(step 5\), rank 1 Engine\.optimizer_step \(step 4\)",
        lines[0],
    ), out[-4000:]
