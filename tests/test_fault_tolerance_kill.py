"""Replica groups of two processes killed in the suite (issue 33, item 4): what the survivors print.

`kiln lighthouse` and two replica groups of two DDP ranks (tests/workers/ft_ddp_group.py): group 1
a real `kiln run -n 2 --max-restarts 1` (its torchrun agent's restart is under test), group 0's
ranks and the Lighthouse forked from the warm server (tests/distributed.py) as `kiln run` starts a
rank (group 0's output is its ranks', in rank order, as its `kiln run` passed it on). Once both
groups step together, one rank of group 1 is SIGKILLed: torchrun's agent ends the group's other
rank and starts the group again, and the new processes take group 0's state and rejoin. Then the whole of group 1
(its agent and both ranks) is SIGKILLed, and group 0 finishes alone.

Group 0, the survivor, must print exactly kiln's three lines (left, rejoined, left) with the steps
its own log shows, and nothing else: no traceback, no NCCL flight-recorder line on this gloo run, no
HTTP access line of the checkpoint server that sent its state, no foreign warning. Group 1 prints
the elastic restart's lines (kiln run's), kiln's line for the state it took, and none of those
either; the Lighthouse prints one line per change of the quorum, not torchft's INFO stream.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from distributed import WORKERS, ForkedWorker, base_env, free_port

pytest.importorskip("torchft")

DEADLINE = 150.0  # seconds any one phase may take before the test fails with the outputs
FOREIGN = ("Traceback", "NCCL", "HTTP/1.1", "UserWarning")


# Group 1's `kiln run` is real: its torchrun agent's restart is what the drill tests. Group 0 and
# the Lighthouse are forked from the warm server (ForkedWorker: ~19 CPU-s of fresh interpreters less).
@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ft_kill")
    env, procs = base_env(), {}

    def start(name: str, *cmd: str) -> subprocess.Popen:
        out, err = open(folder / f"{name}.out", "w"), open(folder / f"{name}.err", "w")
        procs[name] = subprocess.Popen([sys.executable, *cmd], env=env, stdout=out, stderr=err)
        return procs[name]

    def fork(name: str, cmd: list[str], torchrun: dict[str, str]) -> ForkedWorker:
        procs[name] = ForkedWorker(cmd, {**env, **torchrun}, folder / f"{name}.out", folder / f"{name}.err")
        return procs[name]

    def steps() -> list[dict]:
        lines = (folder / "g0-r0.out").read_text().splitlines()  # group 0's rank 0 logs its steps
        return [json.loads(line) for line in lines if line.startswith("{")]

    def wait_for(what: str, condition) -> None:
        deadline = time.monotonic() + DEADLINE
        while not condition():
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {name} (exit {p.poll()})\n{(folder / f'{name}.out').read_text()[-1500:]}\n"
                    f"{(folder / f'{name}.err').read_text()[-3000:]}"
                    for name, p in procs.items()
                )
                raise AssertionError(f"the drill did not reach: {what}\n{tails}")
            time.sleep(0.05)

    def pid(rank: int) -> int:
        return int((folder / f"pid-g1-r{rank}").read_text())

    def since(mark: float, n: int) -> list[dict]:
        return [r for r in steps() if r["time"] > mark and r["n"] == n]

    try:
        port = free_port()
        cmd = ["-m", "kiln.cli.main", "lighthouse", "--min-replicas", "1", "--port", str(port)]
        lighthouse = fork(
            "lighthouse", [*cmd, "--join-timeout", "2", "--heartbeat-timeout", "1", "--quorum-tick", "0.02"], {}
        )
        address = f"http://127.0.0.1:{port}"
        script = [str(WORKERS / "ft_ddp_group.py"), "0", address, str(folder)]
        master = str(free_port())
        g0 = [
            fork(f"g0-r{rank}", script, {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                        "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                        "MASTER_PORT": master})
            for rank in range(2)
        ]  # fmt: skip
        run = ("-m", "kiln.cli.main", "run", "-n", "2", "--max-restarts", "1", "--master-port", str(free_port()))
        g1 = start("g1", *run, str(WORKERS / "ft_ddp_group.py"), "1", address, str(folder))
        wait_for("3 steps of both groups", lambda: len(since(0, 2)) >= 3)
        first = pid(1)
        os.kill(first, signal.SIGKILL)  # one rank of group 1
        rank_killed = time.time()
        wait_for("group 1 restarted", lambda: (folder / "pid-g1-r1").exists() and pid(1) != first)
        wait_for(
            "group 1 rejoined for 3 steps", lambda: len(since(rank_killed, 1)) >= 1 and len(since(rank_killed, 2)) >= 3
        )
        for victim in (g1.pid, pid(0), pid(1)):  # the whole group: its agent and both ranks
            os.kill(victim, signal.SIGKILL)
        g1.wait()
        group_killed = time.time()
        wait_for("3 steps of group 0 alone", lambda: len(since(group_killed, 1)) >= 3)
        (folder / "stop.tmp").write_text(str(steps()[-1]["t"] + 8))
        (folder / "stop.tmp").rename(folder / "stop")
        wait_for("group 0's end", lambda: all(p.poll() is not None for p in g0))
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.wait(timeout=30)
        exits = {name: p.returncode for name, p in procs.items()}
        outputs = {
            f"{name}.{kind}": (folder / f"{name}.{kind}").read_text() for name in procs for kind in ("out", "err")
        }
        # group 0 as its `kiln run` would show it: the first failure's status, the ranks' output in rank order
        exits["g0"] = next((code for code in (exits.pop("g0-r0"), exits.pop("g0-r1")) if code != 0), 0)
        for kind in ("out", "err"):
            outputs[f"g0.{kind}"] = outputs.pop(f"g0-r0.{kind}") + outputs.pop(f"g0-r1.{kind}")
        yield {"exit": exits, "steps": steps(), "rank_killed": rank_killed, "group_killed": group_killed, **outputs}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for name in ("pid-g1-r0", "pid-g1-r1"):  # a worker the test killed no parent of
            try:
                os.kill(int((folder / name).read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass


def test_survivor_prints_exactly_the_left_and_rejoined_lines(killed):
    assert killed["exit"] == {"lighthouse": 0, "g0": 0, "g1": -signal.SIGKILL}, killed["g0.err"][-3000:]
    steps = killed["steps"]
    assert [r["t"] for r in steps] == list(range(1, len(steps) + 1))  # one line a step, none repeated
    # the steps of group 0's log where group 1 went and came back
    left = next(r["t"] for r in steps if r["time"] > killed["rank_killed"] and r["n"] == 1)
    back = next(r["t"] for r in steps if r["t"] > left and r["n"] == 2)
    gone = next(r["t"] for r in steps if r["time"] > killed["group_killed"] and r["n"] == 1)
    assert all(r["n"] == 2 for r in steps if r["t"] < left)
    assert all(r["n"] == 2 for r in steps if back <= r["t"] < gone - 1)
    assert killed["g0.err"].splitlines() == [
        f"kiln: replica group 1 left the quorum at step {left}; continuing with 1 of 2 groups",
        f"kiln: replica group 1 rejoined the quorum at step {back}; 2 of 2 groups",
        f"kiln: replica group 1 left the quorum at step {gone}; continuing with 1 of 2 groups",
    ]
    print(f"\nsurvivor's stderr:\n{killed['g0.err']}group 1's stderr:\n{killed['g1.err']}")


def test_killed_group_prints_no_foreign_lines(killed):
    err = killed["g1.err"]
    for word in FOREIGN[1:]:  # kiln run's report of the killed rank may hold a traceback of its own
        assert word not in err, err[-3000:]
    assert re.search(r"^kiln: replica group 1 took the live groups' state at step \d+$", err, re.M), err[-3000:]
    assert "kiln run:" in err  # the elastic restart's own lines stay


def test_lighthouse_prints_a_line_per_quorum_change(killed):
    assert killed["lighthouse.err"] == ""
    out = killed["lighthouse.out"].splitlines()
    assert out[0].startswith("kiln lighthouse: listening on http://")
    pattern = r"kiln lighthouse: quorum \d+ at committed step \d+: \d replica groups? \(kiln_group_[01](, kiln_group_1)?\)(; .*)?"
    assert all(re.fullmatch(pattern, line) for line in out[1:]), out
    changes = [line.split("; ", 1)[1] for line in out[1:] if "; " in line]
    assert changes[:3] == ["kiln_group_1 left", "kiln_group_1 joined", "kiln_group_1 left"], out
