"""Replica fault tolerance on torchft (issue 24, items 3 and 5): real processes, no mocks.

One drill, shared by the cases: ``kiln lighthouse`` and two replica groups (one process each,
tests/workers/ft_group.py), forked from the warm server of tests/distributed.py (how they start is
not under test). Group 1 dies by SIGKILL in the middle of step 4 and is started again once group 0
has gone on alone for a few steps and past two epochs; the new process heals from group 0 (weights,
optimizer, timestamp, data position) and joins the quorum. Both groups write their state a few
steps after that; then group 1 stops itself with SIGSTOP between its forward and the gradient
allreduce (a hung group), and group 0 must drop that step after the collective timeout and go on
alone. A reference replay in this process, from the run's seed alone (no kiln code), of every
step, each committed one averaging the gradients of the groups that took part, must give each
group's loss, learning rate and the weights bit for bit: the groups drop out inputs, read a
shuffled share and take the learning rate from their scheduler's step count, and a restarted group
is built with another seed, so a heal that leaves out the RNG, the data position, the sampler's
seed or the scheduler fails it. The groups' goodput accounts show the restarted group's recovery
and no lost steps.

Heal restores broken on purpose in ``ReplicaGroup._load_peer_state``, each failing (then restored):
no RNG restore (the replay: group 1's loss after the heal), the sampler state dropped (its seed:
the data check and the replay), the position set to the epoch's start (the data check and the
replay), the restarted group's own fresh scheduler state kept (the learning-rate test: group 1's
0.0198 at the second step after the heal against group 0's 0.01247; the replay's learning-rate
check at that step; the weights after the heal, in both drills). That last break had gone unseen
while the groups used StepLR: it multiplies the optimizer's current lr, which the optimizer's
restored state already holds, so a fresh StepLR went on from the right value (the drill passed
with it, twice); the first heal committed in each run with it. The heal that did not commit in an
earlier round of that break is what a heal slower than the collective timeout gives (a 2.5 s sleep
put in the heal: group 0's allreduce timed out after 2 s while group 1 loaded the state, so the
healed group's first step did not commit, and the next one did): the healing group loads the state
between the quorum and the allreduce, while the live group already waits in the allreduce.
"""

from __future__ import annotations

import functools
import json
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from distributed import WORKERS, ForkedWorker, base_env, free_port

pytest.importorskip("torchft")

DIE_AT = 4
SEED = 0  # the run's seed (tests/workers/ft_group.py: a restarted group gets it with the state it heals from)
RESUMED = 2  # steps a group resumed from the checkpoint trains
# the groups' collective timeout (a heal must load within it: 2 s was measured too tight under
# load); the Lighthouse's heartbeat timeout
TIMEOUT, HEARTBEAT = 4.0, 1.0
SLACK = 6.0  # seconds a loaded machine may add to a stall (torchft's default timeouts are 60 s)
DEADLINE = 120.0  # seconds any one phase of the drill may take before the test fails with the logs


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


class _Drill:
    def __init__(self, folder: Path, groups: int = 2) -> None:
        self.folder, self.procs, self.env = folder, {}, {**base_env(), "FT_GROUPS": str(groups)}
        self.began, self.phases = time.monotonic(), []

    def start(self, name: str, *cmd: str) -> ForkedWorker:
        proc = ForkedWorker(list(cmd), self.env, self.folder / f"{name}.out", self.folder / f"{name}.err")
        self.procs[name] = proc
        return proc

    def group(self, name: str, group: int, life: int, *extra: str) -> ForkedWorker:
        return self.start(
            name, str(WORKERS / "ft_group.py"), str(group), self.lighthouse, str(self.folder), str(life), *extra
        )

    def log(self, name: str) -> list[dict]:
        return _records(self.folder / f"{name}.out")

    def wait_for(self, what: str, condition) -> None:
        deadline = time.monotonic() + DEADLINE
        self.phases.append(round(time.monotonic() - self.began, 1))
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"the drill did not reach: {what}\n{self.tails()}")
            time.sleep(0.02)

    def tails(self) -> str:
        parts = []
        for name, proc in self.procs.items():
            out = (self.folder / f"{name}.out").read_text()[-1500:]
            err = (self.folder / f"{name}.err").read_text()[-2500:]
            parts.append(f"--- {name} (exit {proc.poll()})\nstdout: {out}\nstderr: {err}")
        return "\n".join(parts)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ft")
    d = _Drill(folder)
    began = time.monotonic()
    try:
        # The groups start beside it (their Managers wait for it up to their connect timeout).
        port = free_port()
        lighthouse = d.start("lighthouse", *_lighthouse_args(port))
        d.lighthouse = f"http://127.0.0.1:{port}"
        g0 = d.group("g0", 0, 1)
        g1 = d.group("g1a", 1, 1, str(DIE_AT))
        d.wait_for("group 1's death", lambda: g1.poll() is not None)
        died_at = time.time()
        # group 0 goes on alone before group 1 is started again
        # (and past two epochs, which test_group_0_reads_its_share_of_the_data reads: a forked group
        # comes back in a second or two, no longer the ~30 s of a fresh interpreter under load)
        d.wait_for(
            "3 steps of group 0 alone, past two epochs",
            lambda: sum(r.get("n") == 1 for r in d.log("g0")) >= 3 and len(_steps(d.log("g0"))) > 2 * BATCHES,
        )
        restarted_at = time.time()
        g1b = d.group("g1b", 1, 2)
        d.wait_for("group 0's end", lambda: g0.poll() is not None)
        g1b.kill()
        g1b.wait()
        # any group resumes from the checkpoint group 0 wrote at its end
        final = _steps(d.log("g0"))[-1]["t"]
        g1c = d.group("g1c", 1, 3, str(final + RESUMED))
        d.wait_for("the resumed group's end", lambda: g1c.poll() is not None)
        print(f"\nphases (s from the start): {d.phases}, resumed run {time.monotonic() - began:.1f}")
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.wait(timeout=30)
        yield {
            "folder": folder,
            "port": str(port),
            "exit": {name: proc.returncode for name, proc in d.procs.items()},
            "g0": d.log("g0"),
            "g1a": d.log("g1a"),
            "g1b": d.log("g1b"),
            "g1c": d.log("g1c"),
            "died_at": died_at,
            "restarted_at": restarted_at,
            "tails": d.tails(),
        }
    finally:
        d.kill_all()


@pytest.fixture(scope="module")
def drill3(tmp_path_factory):
    """Three groups: group 2 dies in step 4 and is started again while groups 0 and 1 step on."""
    folder = tmp_path_factory.mktemp("ft3")
    d = _Drill(folder, groups=3)
    try:
        lighthouse = d.start("lighthouse", *_lighthouse_args(port := free_port()))
        d.lighthouse = f"http://127.0.0.1:{port}"
        g0, g1, g2 = d.group("g0", 0, 1), d.group("g1", 1, 1), d.group("g2a", 2, 1, str(DIE_AT))
        d.wait_for("group 2's death", lambda: g2.poll() is not None)
        d.wait_for("3 steps of groups 0 and 1 alone", lambda: sum(r.get("n") == 2 for r in d.log("g0")) >= 3)
        g2b = d.group("g2b", 2, 2)
        d.wait_for("the three groups' end", lambda: all(p.poll() is not None for p in (g0, g1, g2b)))
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.wait(timeout=30)
        yield {"folder": folder, "exit": {name: p.returncode for name, p in d.procs.items()}, "tails": d.tails()}
    finally:
        d.kill_all()


def _lighthouse_args(port: int) -> list[str]:
    return [
        *("-m", "kiln.cli.main", "lighthouse", "--min-replicas", "1", "--port", str(port)),
        *("--join-timeout", "2", "--heartbeat-timeout", str(HEARTBEAT), "--quorum-tick", "0.02"),
    ]


def _steps(log: list[dict]) -> list[dict]:
    return [r for r in log if r["event"] == "step"]


def test_lighthouse_printed_its_address(drill):
    line = (drill["folder"] / "lighthouse.out").read_text()
    assert line.startswith("kiln lighthouse: listening on http://") and ":" + drill["port"] in line, line


def test_groups_exit_as_driven(drill):
    expected = {"lighthouse": 0, "g0": 0, "g1a": -signal.SIGKILL, "g1b": -signal.SIGKILL, "g1c": 0}
    assert drill["exit"] == expected, drill["tails"]


def test_survivor_keeps_stepping_during_outage(drill):
    g0 = _steps(drill["g0"])
    assert [r["t"] for r in g0] == list(range(1, len(g0) + 1))  # one step per batch, none repeated
    by_t = {r["t"]: r for r in g0}
    # both groups stepped together before the death; the step group 1 died in does not commit
    assert all(by_t[t]["n"] == 2 and by_t[t]["committed"] for t in range(1, DIE_AT))
    assert by_t[DIE_AT]["committed"] is False
    # after it: group 0 alone, committing, until group 1 came back
    back = min(r["t"] for r in _steps(drill["g1b"]))
    alone = [by_t[t] for t in range(DIE_AT + 1, back)]
    assert len(alone) >= 3 and all(r["n"] == 1 and r["committed"] for r in alone)
    assert by_t[back]["n"] == 2 and by_t[back]["committed"]
    lost = by_t[DIE_AT + 1]["time"] - by_t[DIE_AT - 1]["time"]
    print(
        f"\nreplica death: {lost:.2f} s from group 0's last step with group 1 to its next committed step; "
        f"steps committed/attempted by group 0: {g0[-1]['num_committed']}/{g0[-1]['attempted']}"
    )
    assert lost < HEARTBEAT + SLACK


def test_restarted_group_heals_to_identical_state(drill):
    g1b = _steps(drill["g1b"])
    first = g1b[0]
    assert first["n"] == 2 and first["committed"]
    built = next(r for r in drill["g1b"] if r["event"] == "built")
    print(
        f"\nrestarted group: first step {first['time'] - drill['restarted_at']:.2f} s after its start, "
        f"{first['time'] - built['time']:.2f} s after its Trainer was built (quorum, state transfer, step)"
    )
    assert first["t"] > DIE_AT + 3  # it took the live group's timestamp, not its own from scratch
    # the data position and the sampler's seed came with it (it was built with another seed): group
    # 1 reads each step's batch of the run's shuffled order, as if it had never been away
    for r in [*_steps(drill["g1a"]), *g1b, *_steps(drill["g1c"])]:
        assert r["x"] == _batch(r["t"], 1, 2)[0].tolist(), r["t"]
    a, b = (torch.load(drill["folder"] / f"final-g{g}.pt", weights_only=True) for g in (0, 1))
    assert a["t"] == b["t"] == first["t"] + 3
    for key in ("model", "optimizer"):
        _assert_equal(a[key], b[key])
    assert b["optimizer"]["state"]  # momentum buffers: there is optimizer state to compare


def test_restarted_group_steps_with_the_live_group_s_learning_rate(drill):
    # The scheduler's state came with the heal (and the checkpoint): every step of every group
    # used the run's learning rate, 0.02 x 0.99^(t-1), the restarted group's the same as the live
    # one's at each step. A fresh scheduler kept through the heal starts the schedule again at 0.02
    # from the step after the heal (the heal's step has the optimizer's restored lr).
    live = {r["t"]: r["lr"] for r in _steps(drill["g0"])}
    healed = [(r["t"], r["lr"]) for r in _steps(drill["g1b"])]
    assert healed == [(t, live[t]) for t, _ in healed], "group 1's learning rate after the heal is not group 0's"
    for name in ("g0", "g1a", "g1b", "g1c"):
        lrs = [(r["t"], r["lr"]) for r in _steps(drill[name])]
        assert lrs == [(t, 0.02 * 0.99 ** (t - 1)) for t, _ in lrs], f"{name}'s learning rate per step"


def test_group_0_reads_its_share_of_the_data(drill):
    # kiln's sampler deals the samples over num_replica_groups x 1 shares: group 0 reads every other
    # one of the run's shuffled order (group 1 the rest)
    assert all(r["x"] == _batch(r["t"], 0, 2)[0].tolist() for r in _steps(drill["g0"]))
    assert len(_steps(drill["g0"])) > 2 * BATCHES  # past two epochs: the order of each epoch is its own


BATCHES = 16  # batches per group and epoch: ft_group.py's SIZE is 64 x the number of groups


def _batch(t: int, group: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``group``'s batch at step ``t``, from the run's seed alone: torch's DistributedSampler
    order (a permutation seeded by seed + epoch, dealt round-robin over the groups), computed
    here without kiln's sampler or its resume code."""
    inputs, targets = _dataset(groups)
    epoch, k = divmod(t - 1, BATCHES)
    rows = _order(groups, epoch)[group::groups][4 * k : 4 * k + 4]
    return inputs[rows], targets[rows]


@functools.cache
def _dataset(groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)  # the worker's torch.manual_seed(0), not touching this process's RNG
    return torch.randn(64 * groups, 4, generator=g), torch.randn(64 * groups, 1, generator=g)


@functools.cache
def _order(groups: int, epoch: int) -> torch.Tensor:
    return torch.randperm(64 * groups, generator=torch.Generator().manual_seed(SEED + epoch))


def test_final_loss_equals_reference_of_committed_steps(drill):
    saved = torch.load(drill["folder"] / "final-g0.pt", weights_only=True)
    logs = [*_steps(drill["g0"]), *_steps(drill["g1a"]), *_steps(drill["g1b"]), *_steps(drill["g1c"])]
    num_committed = _replay(logs, 2, saved)
    assert num_committed == max(r["t"] for r in logs) - 2  # the step group 1 died in and the one it hung in


def _replay(logs: list[dict], groups: int, saved: dict, rtol: float = 0.0) -> int:
    """Replay every step in this process from the run's seed alone, with no kiln code: each group's
    batch (:func:`_batch`), its dropout mask (the torch RNG stream of seed 0, which every live
    group is on: a DataLoader's ``iter()`` draws one number at each epoch's start, each forward
    draws its mask; a restarted group has it only from the heal or the checkpoint), the learning
    rate (the scheduler's closed form of the batches run) and, on the steps that committed, the
    gradients of the groups that logged the step averaged (summed in group order). Every step's
    learning rate and loss must be what each group logged, and the weights and momentum at ``saved["t"]`` what the groups wrote: bit for bit
    (``rtol`` 0: two values sum the same in any order), else within ``rtol`` (gloo sums three in an
    order of its own: a last-bit difference, where a dropped or extra step, a wrong batch, mask or
    learning rate, or an average over the wrong groups, moves the weights by ~1e-2). Returns the
    number of committed steps."""

    def same(a: Any, b: Any) -> None:
        if rtol:
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * 1e-2)
        else:
            _assert_equal(a, b)

    by_t: dict[int, list[dict]] = {}
    for r in logs:
        by_t.setdefault(r["t"], []).append(r)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        torch.randn(64 * groups, 4), torch.randn(64 * groups, 1)  # the dataset the groups build first
        model = nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.99**k)
        torch.manual_seed(SEED)  # the Trainer's seed
        num_committed = 0
        for t in range(1, max(by_t) + 1):
            if t == saved["t"] + 1:  # the state the groups wrote
                same(saved["model"], model.state_dict())
                same(saved["optimizer"]["state"], optimizer.state_dict()["state"])
            if (t - 1) % BATCHES == 0:  # the DataLoader's iter() draws its base seed
                torch.empty((), dtype=torch.int64).random_()
            records = sorted(by_t[t], key=lambda r: r["g"])
            assert len({r["committed"] for r in records}) == 1, records  # the groups agree
            lr = optimizer.param_groups[0]["lr"]
            for r in records:  # before the loss: a wrong learning rate shows here, at the step it is used
                assert r["lr"] == lr, f"group {r['g']}'s learning rate at step {t} is {r['lr']}, the run's {lr}"
            rng = torch.get_rng_state()
            grads = []
            for r in records:
                torch.set_rng_state(rng)  # each group's forward draws the same mask
                inputs, targets = _batch(t, r["g"], groups)
                model.zero_grad()
                loss = nn.functional.mse_loss(model(inputs), targets)
                same(loss.item(), r["loss"])  # the forward each group ran, committed or not
                loss.backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            if records[0]["committed"]:
                assert len(records) == records[0]["n"]  # every group of the quorum logged its batch
                for p, *gs in zip(model.parameters(), *grads):
                    total = gs[0]
                    for g in gs[1:]:
                        total = total + g
                    p.grad = total / len(gs)
                optimizer.step()
                num_committed += 1
            scheduler.step()  # every batch a group runs, committed or not
    return num_committed


def test_goodput_accounts_show_the_restarted_group_s_recovery_and_no_lost_steps(drill):
    from kiln.report.goodput import read_account

    folder = drill["folder"]
    survivor = read_account(folder / "checkpoints.goodput.json")  # group 0 writes the checkpoints
    assert [(x["first_step"], x["ended"], x["lost_steps"]) for x in survivor] == [(0, True, 0)]
    assert survivor[0]["seconds"]["recovery"] == survivor[0]["seconds"]["lost"] == 0
    g1a, g1b, g1c = launches = read_account(folder / "g1.goodput.json")
    back = _steps(drill["g1b"])[0]
    dumped = next(r["t"] for r in drill["g1b"] if r["event"] == "dumped")
    final = _steps(drill["g0"])[-1]["t"]
    assert [(x["first_step"], x["last_step"], x["ended"]) for x in launches] == [
        (0, DIE_AT - 1, False),  # the record of its last step before the death; none after a SIGKILL
        (back["t"] - 1, dumped, False),  # from the live group's step; killed while hung
        (final, final + RESUMED, True),  # from group 0's last checkpoint
    ]
    # the quorum kept every step the killed launches committed, and the next went on from a later
    # step: no step and no second is lost
    assert [(x["lost_steps"], x["seconds"]["lost"]) for x in launches] == [(0, 0.0)] * 3
    assert [x["seconds"]["starting"] > 0 for x in launches] == [True, False, False]
    # The restarted group's recovery: from the dead launch's last record to the end of its first
    # committed step after the heal (the first step's end closes it; the worker logs that step's
    # time at batch_end, just before). The drill's own measure runs from the death (the worker's
    # line just before its SIGKILL, in the middle of step DIE_AT) to that step: the account, which
    # has no record of a death, begins it at the end of step DIE_AT - 1, up to the part of step
    # DIE_AT that ran earlier; 0.15 s for the marks' distance from the logged times on a loaded machine.
    recovery = g1b["seconds"]["recovery"]
    died = next(r["time"] for r in drill["g1a"] if r["event"] == "die")
    before = _steps(drill["g1a"])[-1]["time"]  # step DIE_AT - 1's end
    measured = back["time"] - died
    print(f"\ngroup 1's recovery: {recovery:.2f} s in its account, {measured:.2f} s from its death to its first step")
    assert abs(recovery - (back["time"] - g1a["end"])) < 0.15
    assert -0.15 < recovery - measured < died - before + 0.15
    assert recovery > back["time"] - drill["restarted_at"]  # the new process's start is inside it
    assert g1c["seconds"]["recovery"] > 0


def test_hung_group_is_dropped_after_its_timeout(drill):
    hang = next(r for r in drill["g1b"] if r["event"] == "hang")
    g0 = {r["t"]: r for r in _steps(drill["g0"])}
    # the step it hung in: group 0 waited in the allreduce until the collective timeout, then
    # dropped the step; after it, group 0 steps alone
    assert g0[hang["t"]]["n"] == 2 and g0[hang["t"]]["committed"] is False
    after = [g0[t] for t in range(hang["t"] + 1, max(g0) + 1)]
    assert len(after) >= 3 and all(r["n"] == 1 and r["committed"] for r in after)
    stall = after[0]["time"] - g0[hang["t"] - 1]["time"]
    print(f"\nhung replica group: group 0 stepped alone again {stall:.2f} s after its last step with it")
    assert TIMEOUT < stall < TIMEOUT + HEARTBEAT + SLACK


def test_any_group_resumes_from_the_checkpoint(drill):
    # group 1 resumed what group 0 wrote at its end; its steps' losses are checked against the
    # reference (weights and momentum) in test_final_loss_equals_reference_of_committed_steps
    g1c = _steps(drill["g1c"])
    final = _steps(drill["g0"])[-1]["t"]
    assert [r["t"] for r in g1c] == [final + 1 + i for i in range(RESUMED)]
    assert all(r["n"] == 1 and r["committed"] for r in g1c)


def test_one_group_writes_checkpoints(drill):
    built = {r["g"]: r["writes"] for log in ("g0", "g1a", "g1b", "g1c") for r in drill[log] if r["event"] == "built"}
    assert built == {0: True, 1: False}
    folder = drill["folder"] / "checkpoints"
    final = _steps(drill["g0"])[-1]["t"]
    assert (folder / "last").resolve().name.endswith(f"-ba{final}")


def test_three_groups_one_killed_and_restarted(drill3):
    assert drill3["exit"] == {"lighthouse": 0, "g0": 0, "g1": 0, "g2a": -signal.SIGKILL, "g2b": 0}, drill3["tails"]
    folder = drill3["folder"]
    logs = {name: _steps(_records(folder / f"{name}.out")) for name in ("g0", "g1", "g2a", "g2b")}
    g0 = {r["t"]: r for r in logs["g0"]}
    assert all(g0[t]["n"] == 3 and g0[t]["committed"] for t in range(1, DIE_AT))
    assert g0[DIE_AT]["committed"] is False
    back = logs["g2b"][0]["t"]
    outage = [g0[t] for t in range(DIE_AT + 1, back)]
    assert len(outage) >= 3 and all(r["n"] == 2 and r["committed"] for r in outage)
    assert [r["t"] for r in logs["g1"]] == [r["t"] for r in logs["g0"]]  # group 1 stepped alongside
    assert g0[back]["n"] == 3
    saved = [torch.load(folder / f"final-g{g}.pt", weights_only=True) for g in range(3)]
    for other in saved[1:]:
        _assert_equal(saved[0], other)
    committed = _replay([r for log in logs.values() for r in log], 3, saved[0], rtol=1e-5)
    # the kill's step is the first one dropped; on a loaded machine the rejoin's quorum change can
    # drop one more (seen once in a whole run: 108 of 110 committed), which the replay then skips too
    dropped = [t for t in range(1, saved[0]["t"] + 1) if t in g0 and not g0[t]["committed"]]
    assert dropped[0] == DIE_AT and len(dropped) <= 2, dropped
    assert committed == saved[0]["t"] - 1 - (len(dropped) - 1)


FOREIGN = ("Traceback", "NCCL", "HTTP/1.1", "UserWarning")  # what a healthy recovery must not print


def test_survivor_prints_one_line_per_departure_and_return(drill):
    # group 0 saw group 1 die (step DIE_AT did not commit; the next quorum is without it), come
    # back (group 0 sent it its state over the HTTP transport) and hang: exactly kiln's three lines
    g0 = _steps(drill["g0"])
    back = min(r["t"] for r in _steps(drill["g1b"]))
    hang = next(r for r in drill["g1b"] if r["event"] == "hang")["t"]
    assert [r["t"] for r in g0 if r["n"] == 1][:1] == [DIE_AT + 1]
    err = (drill["folder"] / "g0.err").read_text()
    assert err.splitlines() == [
        f"kiln: replica group 1 left the quorum at step {DIE_AT + 1}; continuing with 1 of 2 groups",
        f"kiln: replica group 1 rejoined the quorum at step {back}; 2 of 2 groups",
        f"kiln: replica group 1 left the quorum at step {hang + 1}; continuing with 1 of 2 groups",
    ], err[-3000:]


def test_restarted_group_prints_no_foreign_lines(drill):
    back = min(r["t"] for r in _steps(drill["g1b"]))
    for name in ("g1a", "g1b", "g1c"):
        err = (drill["folder"] / f"{name}.err").read_text()
        assert not [word for word in FOREIGN if word in err], f"{name}: {err[-3000:]}"
    lines = (drill["folder"] / "g1b.err").read_text().splitlines()
    assert lines[0] == f"kiln: replica group 1 took the live groups' state at step {back}", lines


def test_lighthouse_prints_a_line_per_quorum_change(drill):
    # torchft's Rust server logged ~700 INFO lines in this drill (a quorum request, a status and a
    # "Quorum!" line per step); kiln prints one line per change of the quorum's members
    assert (drill["folder"] / "lighthouse.err").read_text() == ""
    lines = (drill["folder"] / "lighthouse.out").read_text().splitlines()[1:]
    changes = [line.split("; ", 1)[1] if "; " in line else "" for line in lines]
    assert changes[:4] == ["", "kiln_group_1 left", "kiln_group_1 joined", "kiln_group_1 left"], lines
    assert lines[0].startswith("kiln lighthouse: quorum 1 at committed step 0: 2 replica groups "), lines
    assert len(lines) <= 6, lines


def test_membership_lines():
    from kiln.trainer.ft_quiet import membership_lines

    seen: set[int] = set()
    assert membership_lines(None, [0, 1, 2], step=1, num_groups=3, seen=seen) == []
    assert membership_lines([0, 1, 2], [0], step=5, num_groups=3, seen=seen) == [
        "replica groups 1 and 2 left the quorum at step 5; continuing with 1 of 3 groups"
    ]
    assert membership_lines([0], [0, 2], step=9, num_groups=3, seen=seen) == [
        "replica group 2 rejoined the quorum at step 9; 2 of 3 groups"
    ]
    late: set[int] = set()
    assert membership_lines(None, [1], step=3, num_groups=2, seen=late) == [
        "training from step 3 with 1 of 2 replica groups (replica group 0 not yet in the quorum)"
    ]
    assert membership_lines([1], [0, 1], step=4, num_groups=2, seen=late) == [
        "replica group 0 joined the quorum at step 4; 2 of 2 groups"
    ]


def test_cross_group_process_group_follows_the_device():
    # CUDA gradients are averaged by NCCL on the GPUs, not staged through host memory over gloo
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    from kiln.trainer.fault_tolerance import process_group_class

    assert process_group_class(torch.device("cuda", 3)) is ProcessGroupNCCL
    assert process_group_class("cuda") is ProcessGroupNCCL
    assert process_group_class(torch.device("cpu")) is ProcessGroupGloo
    assert process_group_class("meta") is ProcessGroupGloo


def test_replica_group_records_the_quorum_groups():
    # torchft configures the process group with the quorum's global ranks (group x size + rank)
    from torchft import ProcessGroupGloo

    from kiln.trainer.fault_tolerance import _recording

    pg = _recording(ProcessGroupGloo)(timeout=timedelta(seconds=0.2))
    assert isinstance(pg, ProcessGroupGloo) and pg.groups is None
    with pytest.raises(RuntimeError):  # no store there: the groups are recorded before torchft's configure
        pg.configure("127.0.0.1:1/x", "kiln_group_1", 0, 2, 7, 1, 2, [1, 5])
    assert pg.groups == (0, 2)


def test_torchft_messages_go_to_kilns_debug(capsys, monkeypatch):
    """What ReplicaGroup quiets: torchft's loggers reach kiln's logger at DEBUG only (--verbose),
    the flight-recorder line is dropped on gloo, the checkpoint server's access line is logged, not
    written to stderr, and torch's non-writable-buffer warning is ignored."""
    import logging
    import warnings
    from http.server import BaseHTTPRequestHandler

    from kiln.launch.logging import get_dist_logger
    from kiln.trainer import ft_quiet

    monkeypatch.delenv("KILN_DEBUG", raising=False)
    torchft, manager = logging.getLogger("torchft"), logging.getLogger("torchft.manager")
    saved = (torchft.handlers[:], torchft.propagate, torchft.level, manager.filters[:], get_dist_logger().logger.level)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # below the filter quiet_torchft adds in front
            ft_quiet.quiet_torchft(nccl=False)
            ft_quiet.quiet_torchft(nccl=False)  # twice, as two Trainers in one process: one handler
            assert sum(isinstance(h, ft_quiet._ToKilnDebug) for h in torchft.handlers) == 1
            manager.warning("[kiln_group_0/0 - step 3] got exception waiting for work")
            manager.warning("[kiln_group_0/0 - step 3] Unable to reset NCCL flight recorder recording so ...")
            assert capsys.readouterr() == ("", "")  # kiln's level is INFO: nothing
            get_dist_logger().set_level("DEBUG")
            manager.warning("[kiln_group_0/0 - step 3] got exception waiting for work")
            manager.warning("[kiln_group_0/0 - step 3] Unable to reset NCCL flight recorder recording so ...")

            class Handler(BaseHTTPRequestHandler):
                def __init__(self) -> None:  # no socket: only log_message is called
                    self.client_address = ("::1", 1)
                    self.requestline = "GET /checkpoint/152/full HTTP/1.1"

            server = type("Server", (), {"RequestHandlerClass": Handler})()
            ft_quiet.quiet_checkpoint_server(type("Transport", (), {"_server": server})())
            server.RequestHandlerClass().log_request(200)
            try:
                raise BrokenPipeError(32, "Broken pipe")
            except BrokenPipeError:
                server.handle_error(None, ("::1", 1))  # socketserver's call for a failed request
            out, err = capsys.readouterr()
            assert err == ""
            assert "DEBUG kiln.torchft: [torchft.manager WARNING] [kiln_group_0/0 - step 3] got exception" in out
            assert "flight recorder" not in out
            assert "checkpoint request from ('::1', 1) failed\nTraceback" in out and "BrokenPipeError" in out
            assert '[torchft.checkpointing.http_transport DEBUG] ::1 "GET /checkpoint/152/full HTTP/1.1" 200 -' in out
            warnings.warn_explicit(
                "The given buffer is not writable, and PyTorch does not support non-writable tensors.",
                UserWarning,
                "_serialization.py",
                63,
                module="torch.distributed._serialization",
            )
            with pytest.raises(UserWarning):  # the same words from elsewhere are not hidden
                warnings.warn_explicit("The given buffer is not writable", UserWarning, "x.py", 1, module="mine")
    finally:
        torchft.handlers[:], torchft.propagate = saved[0], saved[1]
        torchft.setLevel(saved[2])
        manager.filters[:] = saved[3]
        get_dist_logger().set_level(saved[4])


def test_options_are_checked():
    from kiln.trainer import FaultTolerance
    from kiln.trainer.fault_tolerance import as_fault_tolerance

    good = {"lighthouse": "http://h:29510", "replica_group": 1, "num_replica_groups": 2}
    assert as_fault_tolerance(good) == FaultTolerance(**good)
    cases = [
        ({**good, "min_replica": 1}, "unknown key 'min_replica' (did you mean 'min_replicas'?)"),
        ({**good, "replica_group": 2}, "fault_tolerance.replica_group=2 must be an int from 0 to"),
        ({**good, "lighthouse": "h:29510"}, "is not an address; expected http://host:port"),
        ({**good, "min_replicas": 3}, "min_replicas=3 exceeds num_replica_groups=2"),
        ({**good, "timeout": 0}, "fault_tolerance.timeout=0 must be a positive number of seconds"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
            as_fault_tolerance(options)


def test_yaml_key_reaches_the_trainer_and_is_checked(capsys, monkeypatch):
    from kiln.cli.main import main
    from kiln.config import load_trainer_args
    from kiln.config.trainer_builder import __doc__ as mapping

    example = str(Path(__file__).resolve().parents[1] / "examples" / "mlp.yaml")
    fields = ["--fault_tolerance.lighthouse", "http://node0:29510", "--fault_tolerance.replica_group", "1"]
    fields += ["--fault_tolerance.num_replica_groups", "2"]
    args = load_trainer_args(example, fields, world_size=2)
    assert args.fault_tolerance == {"lighthouse": "http://node0:29510", "replica_group": 1, "num_replica_groups": 2}
    assert "fault_tolerance                                         fault_tolerance" in mapping
    for var in ("TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"):
        monkeypatch.delenv(var, raising=False)
    code = main(["train", "-f", example, "--nproc-per-node", "2", *fields[:4], "--fault_tolerance.min_replica", "2"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fault_tolerance has an unknown key 'min_replica'" in err


def test_lighthouse_cli_refuses_bad_arguments(capsys, monkeypatch):
    from kiln.cli.main import main

    assert main(["lighthouse", "--min-replicas", "0"]) == 2
    assert capsys.readouterr().err == "kiln lighthouse: --min-replicas 0 must be at least 1\n"
    assert main(["lighthouse", "--min-replicas", "1", "--bind", "nowhere"]) == 2
    assert "kiln lighthouse: cannot listen on 'nowhere'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "torchft.coordination", None)  # as if torchft were not installed
    assert main(["lighthouse", "--min-replicas", "1"]) == 2
    assert capsys.readouterr().err == "kiln lighthouse: needs torchft: pip install 'kiln-train[ft]'\n"


def _assert_equal(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), (a, b)
    else:
        assert a == b
