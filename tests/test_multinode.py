"""Multi-node and elastic jobs on localhost, one `kiln run` per 'node' (issue 24, items 1 and 2).

Real launchers, real torchrun agents and the c10d rendezvous, gloo; nothing mocked. One
module-scoped setup runs each drill once and the tests read what it left:

* two nodes of one process each (`--nnodes 2`) train the Trainer job of tests/workers/elastic_nodes.py
  with checkpoints; a single launcher `-n 2` runs the same job; the losses are equal, bit for bit.
  The same for a config-CLI job (examples/mlp.yaml), run by the same two launches' ranks after the
  first job (elastic_nodes.py --then): one pair of launches for both (and one forked job of 2 ranks
  for both references).
* an elastic job (`--nnodes 1:2 --max-restarts 3`): one node's `kiln run` is SIGKILLed after batch
  5 (the checkpoint at batch 4 is the last complete one); the other node re-rendezvouses alone,
  restarts at world size 1 and resumes from batch 4 (DCP reshards the 2-rank checkpoint). At batch
  8 it waits while a node comes back (a new `kiln run`): the agent stops its worker (which
  checkpoints batch 8 on the SIGTERM) and both nodes restart at world size 2 from batch 8. Its
  losses and final weights are those of a replay in this process that shares no resume code
  (:func:`_replay`: plain torch, each launch's batches, dropout masks and starting state derived
  from the run's seed and the rules a change of world size keeps), bit for bit; its goodput
  account shows each restart's recovery and the steps lost since the last checkpoint. (Broken on
  purpose: ``ResumableSampler.skip_world`` counting half the consumed samples, a resume bug the
  kiln-resumed references this replay replaced shared: both bit-exact tests failed.)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from distributed import ROOT, WORKERS, base_env, check, fork_run, free_port
from kiln.cli.run import torchrun_args

# The module's drills run once, in the setup of whichever test asks first: 2-4 minutes of real
# launches on a loaded 2-core machine, past pytest-timeout's 300 s default at worst.
pytestmark = pytest.mark.timeout(900)

SCRIPT = WORKERS / "elastic_nodes.py"
KILL_AT = 5  # after the checkpoint at batch 4 (save_interval 2ba)
HOLD_AT = 8  # at world size 1 the job waits at the end of this batch for the node coming back
DURATION = 16  # elastic_nodes.py's default: past the end of the first epoch at world size 2 (batch 14)


# A launcher started ahead, its imports done, that runs `kiln run` once GO exists: two nodes of an
# elastic job meet in one round only if the second joins within the first's 3 s last call, shorter
# than a cold start of Python and torch on this machine.
_WARM = """import os, sys, time
import torch.distributed.run
import kiln.cli.main, kiln.cli.run
ready, go = sys.argv[1], sys.argv[2]
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.02)
sys.exit(kiln.cli.main.main(sys.argv[3:]))
"""


def _launcher(port: int, out: Path, log: Path, nnodes: str, *options: str, script_args=(), target=None):
    argv = ["run", "-n", "1", "--nnodes", nnodes, "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "drill"]
    argv += [*options, *(target or [str(SCRIPT), str(out)]), *script_args]
    ready, go = log.with_suffix(".ready"), log.with_suffix(".go")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WARM, str(ready), str(go), *argv], env=base_env(), stdout=f, stderr=f
        )
    return proc, ready, go


def _wait(procs, timeout: float, logs) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()  # its workers die with it (the parent-death signal)
            text = "\n".join(Path(x).read_text()[-3000:] for x in logs)
            raise AssertionError(f"a launcher did not finish:\n{text}") from None


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _start_pair(port: int, out: Path, tmp: Path, nnodes: str, script_args=(), dying_args=(), options=(), target=None):
    """Two launchers of one job. The first hosts the rendezvous (torch's c10d store lives in the
    agent on the endpoint, and its loss ends every job), the second may die: it never hosts
    (is_host=false). Both are started warm; the second goes once the first's store listens."""
    first_log, second_log = tmp / f"{out.name}-first.log", tmp / f"{out.name}-second.log"
    first, first_ready, first_go = _launcher(
        port, out, first_log, nnodes, *options, script_args=script_args, target=target
    )
    second, second_ready, second_go = _launcher(
        port, out, second_log, nnodes, "--rdzv-conf", "is_host=false", *options,
        script_args=(*script_args, *dying_args), target=target,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    for proc, ready, log in ((first, first_ready, first_log), (second, second_ready, second_log)):
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
    first_go.touch()
    while not _listening(port):
        assert first.poll() is None and time.monotonic() < deadline, first_log.read_text()[-3000:]
        time.sleep(0.05)
    second_go.touch()
    return (first, first_log), (second, second_log)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(lines: list[dict], **where) -> dict[tuple[int, int], float]:
    """(rank, batch) -> loss of the step lines matching ``where``."""
    return {
        (x["rank"], x["batch"]): x["loss"]
        for x in lines
        if "loss" in x and all(x.get(k) == v for k, v in where.items())
    }


def _cli_job(out: Path) -> list[str]:
    """`kiln run` target: kiln's config CLI on examples/mlp.yaml, its losses in OUT/losses.jsonl."""
    return ["-m", "kiln.cli.main", "train", "-f", str(ROOT / "examples/mlp.yaml"), "--max_train_steps", "4"] + [
        "--checkpoint.save_dir", str(out / "ckpt"), "--enable_progress_bar", "false",
        "--log.0.type", "file", "--log.0.args.path", str(out / "losses.jsonl"),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def drills(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode")
    names = ("two_nodes", "one_node", "cli_two_nodes", "cli_one_node", "elastic")
    runs = {name: tmp / name for name in names}
    for path in runs.values():
        path.mkdir()
    # 1. two nodes x 1 process against one launcher x 2 processes; then, in the same launch (its
    # ranks and group), the same for a config-CLI job (examples/mlp.yaml: 2 ranks, a checkpoint
    # every step): one pair of launches for both, as a launch costs ~24 CPU-s of interpreters
    port = free_port()
    then = ("--then", *_cli_job(runs["cli_two_nodes"])[2:])
    pair = _start_pair(port, runs["two_nodes"], tmp, "2", script_args=("--duration", "8ba", *then))
    _wait([p for p, _ in pair], 240, [log for _, log in pair])
    for proc, log in pair:
        assert proc.returncode == 0, log.read_text()[-4000:]
    # the references: 2 ranks of one job, both jobs in them as in the pair's ranks (--then)
    then = ("--then", *_cli_job(runs["cli_one_node"])[2:])
    check(fork_run(SCRIPT, str(runs["one_node"]), "--duration", "8ba", *then, timeout=240, cwd=ROOT))
    # 2. an elastic job loses a node and goes on alone, then takes a node in again
    return runs, _elastic_drill(tmp, runs)


def _elastic_drill(tmp: Path, runs: dict[str, Path]) -> str:
    """The elastic job; returns the log of the node that stayed."""
    # an elastic job loses a node after batch 5 and goes on alone; at batch 8 a node comes back
    port = free_port()
    joining, joining_ready, joining_go = _launcher(
        port, runs["elastic"], tmp / "elastic-joining.log", "1:2", "--rdzv-conf", "is_host=false",
        "--max-restarts", "3",
    )  # fmt: skip
    (staying, staying_log), (dying, dying_log) = _start_pair(
        port,
        runs["elastic"],
        tmp,
        "1:2",
        script_args=("--hold-at", str(HOLD_AT)),
        dying_args=("--kill-agent-at", str(KILL_AT)),
        options=("--max-restarts", "3"),
    )
    steps, deadline = runs["elastic"] / "steps.jsonl", time.monotonic() + 240
    while not (steps.exists() and '"event": "hold"' in steps.read_text()):
        assert staying.poll() is None and time.monotonic() < deadline, staying_log.read_text()[-4000:]
        time.sleep(0.1)
    assert joining_ready.exists(), (tmp / "elastic-joining.log").read_text()[-3000:]
    joining_go.touch()  # the node comes back while the job holds at batch 8 at world size 1
    _wait([staying, dying, joining], 300, [staying_log, dying_log, tmp / "elastic-joining.log"])
    assert dying.returncode == -9
    assert staying.returncode == 0, staying_log.read_text()[-4000:]
    assert joining.returncode == 0, (tmp / "elastic-joining.log").read_text()[-4000:]
    return staying_log.read_text()


def _replay() -> dict[str, Any]:
    """The elastic job replayed in this process in plain torch, sharing no code with kiln's resume:
    ``{"losses": {(world, rank, batch): loss}, "weights": the final state_dict}``.

    What each launch starts from, by the rules of a change of world size (docs/checkpoints.md):
    the weights and AdamW state of the checkpoint it resumed (batch 4 at world size 1, batch 8 at
    world size 2; batch 5 at world size 2 ran and was lost); the epoch's order goes on from the
    samples already consumed, dealt to the new ranks (torch's DistributedSampler order: a
    permutation seeded by seed + epoch, rank r taking every world-th sample); the RNG states are
    not restored on another world size, so each launch's ranks start the stream of the Trainer's
    seed again (every rank the same one: a DataLoader's ``iter()`` draws one number at the launch's
    first batch and at each epoch's start, each forward its dropout mask). Gradients are the
    average of the ranks' (two addends: the same bits in any order)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    y = (x[:, 0] > 0).long()
    seed, losses = 3, {}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        resume: dict[int, Any] = {}
        # (world size, its batches, the batch of the checkpoint it starts from, samples of epoch 0 consumed before)
        for world, batches, start, consumed in (
            (2, range(1, KILL_AT + 1), 0, 0),
            (1, range(5, HOLD_AT + 1), 4, 32),
            (2, range(HOLD_AT + 1, DURATION + 1), HOLD_AT, 48),
        ):
            if start:
                model.load_state_dict(resume[start][0])
                optimizer.load_state_dict(resume[start][1])
            torch.manual_seed(seed)  # the Trainer's seed_everything, on every rank
            epoch, position = 0, consumed
            for batch in batches:
                if position == 96:  # the epoch's end: the next one's order
                    epoch, position = epoch + 1, 0
                if batch == batches[0] or position == 0:  # the DataLoader's iter() draws its base seed
                    torch.empty((), dtype=torch.int64).random_()
                order = torch.randperm(96, generator=torch.Generator().manual_seed(seed + epoch))[position:]
                rng, grads = torch.get_rng_state(), []
                for rank in range(world):
                    torch.set_rng_state(rng)
                    rows = order[rank::world][:4]
                    model.zero_grad()
                    loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
                    losses[world, rank, batch] = loss.item()
                    loss.backward()
                    grads.append([p.grad.clone() for p in model.parameters()])
                for p, *gs in zip(model.parameters(), *grads):
                    p.grad = gs[0] if world == 1 else (gs[0] + gs[1]) / 2
                optimizer.step()
                position += 4 * world
                if batch in (4, HOLD_AT):
                    resume[batch] = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    return {"losses": losses, "weights": model.state_dict()}


def test_two_nodes_train_as_one_launcher_of_the_same_world_size(drills):
    runs, _ = drills
    two, one = _lines(runs["two_nodes"] / "steps.jsonl"), _lines(runs["one_node"] / "steps.jsonl")
    assert {x["node"] for x in two if "loss" in x} == {0, 1}  # two agents, one rank each
    assert {x["node"] for x in one if "loss" in x} == {0}
    losses = _losses(two)
    assert sorted(losses) == [(r, b) for r in range(2) for b in range(1, 9)]
    assert losses == _losses(one)  # bit for bit
    ends = [x["weights"] for x in two if x.get("event") == "end"]
    assert len(ends) == 2 and ends[0] == ends[1] == next(x["weights"] for x in one if x.get("event") == "end")


def test_a_config_cli_job_on_two_nodes_trains_as_on_one_launcher(drills):
    runs, _ = drills

    def losses(out):
        rows = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
        return {r["step"]: r["metrics"]["train/loss"] for r in rows if "train/loss" in r["metrics"]}

    two = losses(runs["cli_two_nodes"])
    assert sorted(two) == [1, 2, 3, 4]
    assert two == losses(runs["cli_one_node"])  # bit for bit
    assert os.readlink(runs["cli_two_nodes"] / "ckpt" / "last") == "ep0-ba4"


@pytest.fixture(scope="module")
def replay():
    return _replay()


def test_elastic_job_goes_on_alone_from_the_last_checkpoint_bit_exact(drills, replay):
    runs, _ = drills
    lines = _lines(runs["elastic"] / "steps.jsonl")
    kill = next(x for x in lines if x.get("event") == "kill")
    assert kill["node"] in (0, 1)
    before = _losses([x for x in lines if x.get("batch", 0) <= KILL_AT], world=2)
    assert max(b for _, b in before) == KILL_AT  # both ranks stepped to batch 5, then one node died
    restart = [x for x in lines if x.get("event") == "start" and x["world"] == 1]
    assert [x["batch"] for x in restart] == [4]  # resumed once, from the checkpoint at batch 4
    alone = _losses(lines, world=1)
    assert sorted(alone) == [(0, b) for b in range(5, HOLD_AT + 1)]  # batch 5 again, on to the hold
    # the plain-torch replay: bit for bit, before the death and alone after it
    assert before == {(r, b): v for (w, r, b), v in replay["losses"].items() if w == 2 and b <= KILL_AT}
    assert alone == {(r, b): v for (w, r, b), v in replay["losses"].items() if w == 1}


def test_a_node_that_comes_back_is_taken_in_at_the_next_restart_bit_exact(drills, replay):
    runs, _ = drills
    lines = _lines(runs["elastic"] / "steps.jsonl")
    hold = next(x["time"] for x in lines if x.get("event") == "hold")
    rejoined = [x for x in lines if x.get("event") == "start" and x["time"] > hold]
    # both nodes start again at world size 2, from the checkpoint the world-size-1 worker wrote
    # at batch 8 when its agent stopped it (SIGTERM: the Trainer's preemption checkpoint)
    assert sorted((x["rank"], x["world"], x["batch"]) for x in rejoined) == [(0, 2, HOLD_AT), (1, 2, HOLD_AT)]
    assert {x["node"] for x in rejoined} == {0, 1}
    together = {k: v for k, v in _losses(lines, world=2).items() if k[1] > HOLD_AT}
    assert sorted(together) == [(r, b) for r in range(2) for b in range(HOLD_AT + 1, DURATION + 1)]
    # the plain-torch replay, bit for bit: its losses and its final weights
    assert together == {(r, b): v for (w, r, b), v in replay["losses"].items() if w == 2 and b > HOLD_AT}
    ends = [x["weights"] for x in lines if x.get("event") == "end"]
    assert len(ends) == 2 and ends[0] == ends[1] == {k: v.tolist() for k, v in replay["weights"].items()}


def test_elastic_restarts_say_which_node_left_which_joined_and_the_world_size(drills):
    runs, log = drills
    lines = _lines(runs["elastic"] / "steps.jsonl")
    gone = next(x["node"] for x in lines if x.get("event") == "kill")
    here = next(x for x in lines if x.get("event") == "start" and x["world"] == 2 and x["node"] != gone)
    # the job's closing goodput line (issue 35) aside, the restarts' own lines
    said = [line for line in log.splitlines() if line.startswith("kiln run: ")]
    assert [line for line in said if line.startswith("kiln run: goodput ")] == said[-1:], log[-3000:]
    said = said[:-1]
    assert len(said) == 4, log[-3000:]
    assert re.fullmatch(
        rf"kiln run: node {gone} went away: rank {here['rank']} \(node {here['node']}, host \S+, pid \d+\) lost its peer"
        r" at elastic_nodes.py:\d+: .+; restarting the workers \(2 of 3 restarts left after this one\)",
        said[0],
    ), said[0]
    assert said[1:] == [
        "kiln run: the job continues on 1 node, world size 1 (was 2 nodes, world size 2)",
        "kiln run: 1 node joined; restarting the workers to take it in",
        "kiln run: the job continues on 2 nodes, world size 2 (was 1 node, world size 1)",
    ]


def test_time_from_a_node_death_to_the_next_step(drills):
    from kiln.report.goodput import read_account

    runs, _ = drills
    lines = _lines(runs["elastic"] / "steps.jsonl")
    kill = next(x for x in lines if x.get("event") == "kill")
    step = min(x["time"] for x in lines if "loss" in x and x["world"] == 1)
    hold = next(x["time"] for x in lines if x.get("event") == "hold")
    back = min(x["time"] for x in lines if "loss" in x and x["time"] > hold)
    launches = read_account(runs["elastic"] / "ckpt.goodput.json")
    recovery = launches[1]["seconds"]["recovery"]
    print(
        f"node death -> next step: {step - kill['time']:.1f} s (goodput account: recovery {recovery:.1f} s); "
        f"node back -> next step: {back - hold:.1f} s"
    )
    # ~1 s for the worker left to fail and exit, the dead node's keep-alives expiring (3 s after its
    # last), a 2 s last call, then a fresh worker (imports, the Trainer, the checkpoint): 7-9 s
    # on two quiet cores, more under load; torch's rendezvous defaults alone take 45 s
    assert step - kill["time"] < 40
    assert back - hold < 60
    # The goodput account: a launch per world size, the steps the death lost (computed past the
    # checkpoint at batch 4, redone at world size 1), none at the node's return (the agent's SIGTERM:
    # a checkpoint of the batch it stopped at)
    assert [(x["world_size"], x["first_step"], x["last_step"], x["lost_steps"]) for x in launches] == [
        (2, 0, KILL_AT, KILL_AT - 4),
        (1, 4, HOLD_AT, 0),
        (2, HOLD_AT, DURATION, 0),
    ]
    assert [x["seconds"]["recovery"] > 0 for x in launches] == [False, True, True]
    # Its recovery runs from the failed launch's last record to the end of the first step at world
    # size 1 (the worker logs that step's time at batch_end, just before: 0.15 s for the marks'
    # distance on a loaded machine). The last record is batch 5's, written just before the kill when
    # rank 0 was on the node that died; else rank 0 wrote it at its exit, once its collective with
    # the dead node had failed, within the drill's death-to-step time: the account then counts that
    # wait as the failed launch's (lost) time, and its recovery is shorter by it.
    assert abs(recovery - (step - launches[0]["end"])) < 0.15
    if kill["rank"] == 0:
        assert abs(recovery - (step - kill["time"])) < 0.15
    else:
        assert 0 < recovery < step - kill["time"]


def _args(*argv: str) -> argparse.Namespace:
    from kiln.cli.main import parse_args

    return parse_args(["run", *argv, "train.py"])


def test_elastic_jobs_get_fast_rendezvous_settings_that_the_user_overrides():
    fast = "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2,close_timeout=5"
    endpoint = ["--rdzv-endpoint", "h:29400", "--rdzv-id", "j"]
    assert fast in torchrun_args(_args("--nnodes", "1:2", *endpoint))
    mine = torchrun_args(_args("--nnodes", "1:2", *endpoint, "--rdzv-conf", "last_call_timeout=20,is_host=false"))
    assert (
        "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=20,close_timeout=5,is_host=false"
        in mine
    )
    fixed = torchrun_args(_args("--nnodes", "2", *endpoint))  # a fixed size: torch's own settings
    assert not any(a.startswith("--rdzv-conf") for a in fixed)


def test_node_rank_goes_only_to_the_static_rendezvous():
    c10d = torchrun_args(_args("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:29400"))
    assert not any(a.startswith("--node-rank") for a in c10d)  # c10d numbers the nodes itself
    static = torchrun_args(_args("--nnodes", "2", "--node-rank", "1", "--master-addr", "h", "--master-port", "29400"))
    assert "--node-rank=1" in static


def test_a_bad_rdzv_conf_item_is_refused_in_one_line():
    from kiln.cli.run import run

    args = _args("--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--rdzv-conf", "last_call_timeout")
    args.script = __file__
    assert run(args) == 2


def test_the_global_batch_stays_when_the_world_shrinks_and_is_refused_where_it_cannot():
    from kiln.config import ConfigError
    from kiln.config.args import TrainerArgs
    from kiln.config.components import DatasetConfig, ModelConfig, OptimizerConfig

    args = TrainerArgs(
        model=ModelConfig(type="examples.mlp_model.MLP", args={"dim": 16}),
        optimizer=OptimizerConfig(type="torch.optim.AdamW", args={"lr": 1e-3}),
        dataset=DatasetConfig(type="examples.mlp_model.RandomDataset"),
        micro_batch_size=2,
        global_batch_size=8,
        max_epochs=1,
    )
    # one home for the rule (TrainerArgs.resolve): accumulation grows as the world shrinks
    assert [(w, args.resolve(w).grad_accumulation_steps) for w in (4, 2, 1)] == [(4, 1), (2, 2), (1, 4)]
    assert {args.resolve(w).global_batch_size for w in (4, 2, 1)} == {8}
    with pytest.raises(ConfigError) as refused:
        args.resolve(3)
    assert str(refused.value) == (
        "global_batch_size: got 8 (int), expected a multiple of micro_batch_size * data-parallel size = 2 * 3 = 6"
    )


def test_several_workers_get_one_openmp_thread_without_torchrun_s_banner(tmp_path):
    script = tmp_path / "omp.py"
    script.write_text("import os\nos.write(1, ('OMP=' + os.environ.get('OMP_NUM_THREADS', '-') + '\\n').encode())\n")
    env = {k: v for k, v in base_env().items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "run", "-n", "2", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["OMP=1", "OMP=1"]
    assert "Setting OMP_NUM_THREADS" not in done.stderr and "*****" not in done.stderr
