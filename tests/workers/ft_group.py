"""One replica group of tests/test_fault_tolerance.py: a one-process Trainer joined to the others
by torchft (fault_tolerance=), logging each step as one JSON line (one os.write, whole lines).

    python ft_group.py GROUP LIGHTHOUSE DIR LIFE [DIE_AT | UNTIL]

LIFE 1 waits for the other group's ``ready`` file after building its Trainer (so both Managers
heartbeat before the first quorum). LIFE 3 resumes from the checkpoint group 0 wrote and trains
alone until batch UNTIL. DIE_AT: SIGKILL this process in the middle of that step (after
its forward, before its backward), a death with no cleanup at all.

What a heal must carry, so that the test's replay, which derives it from the run's seed and the
steps alone, sees a heal that skips any of it: the model drops out inputs (the torch RNG), every
group reads its share through kiln's shuffling sampler (the data position and the sampler's seed)
and the learning rate decays each batch (the scheduler's own step count; each step logs the
learning rate it used). A restarted group (LIFE 2 and 3) is built with another seed, so its
sampler's order and its RNG are the run's only when the heal (or the checkpoint) gives them back.
Each group keeps a goodput account, written at every step (group 0's beside the save folder, the
others' at ``DIR/g<GROUP>.goodput.json``).

The run ends by a rule both groups compute from the quorums alone, so they stop at the same step:
``DUMP`` steps after the first step (past the death) on which both groups take part again, each
group writes its model and optimizer state to ``DIR/final-g<GROUP>.pt``; group 1 then stops itself
with SIGSTOP in the middle of the next step (a hung group: alive, holding its sockets, answering
nothing), and group 0 goes on until it has committed ``ALONE`` steps without it, and stops. A group
stepping without the other sleeps a little per step, so the outage spans a bounded number of steps.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import kiln
from kiln.trainer.goodput import GoodputMonitor

DUMP, ALONE = 3, 3
GROUPS = int(os.environ.get("FT_GROUPS", "2"))  # 3: the kill-and-restart drill only, stopping at the dump
SIZE = 64 * GROUPS  # samples: 16 batches per group and epoch, so the drill crosses epochs
group, lighthouse, folder, life = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
die_at = int(sys.argv[5]) if len(sys.argv) > 5 and life == 1 else -1
until = int(sys.argv[5]) if len(sys.argv) > 5 and life == 3 else 1000

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(SIZE, 4), torch.randn(SIZE, 1))
model = nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
# The learning rate is the scheduler's closed form of its own step count, 0.02 x 0.99^k, so only a
# restored scheduler gives the run's: StepLR multiplies the optimizer's current lr, which the
# optimizer's state already restores, and a heal that kept the fresh StepLR went unseen.
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.99**k)
SEED = 0 if life == 1 else 100 + life  # the run's seed comes to a restarted group with its state


def emit(record: dict) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())


class Drill(kiln.Callback):
    def __init__(self) -> None:
        self.committed = 0
        self.outage = life == 2  # group 0 sees it as a step without group 1
        self.together: int | None = None  # the first step after the outage with both groups
        self.dumped: int | None = None
        self.alone = 0  # steps group 0 committed without group 1 after the dump
        self.lr = 0.0  # the learning rate of the step running

    def after_forward(self, state, logger) -> None:
        t = state.timestamp.batch.value + 1
        self.lr = optimizer.param_groups[0]["lr"]  # this step's (the scheduler steps after the optimizer)
        if t == die_at:
            emit({"event": "die", "g": group, "t": die_at, "time": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)
        if GROUPS == 2 and group == 1 and self.dumped is not None and t == self.dumped + 1:
            # hung between its forward and the gradient allreduce, the others already in it
            emit({"event": "hang", "g": group, "t": t, "time": time.time()})
            os.kill(os.getpid(), signal.SIGSTOP)

    def batch_end(self, state, logger) -> None:
        ft = trainer.fault_tolerance
        t, n = state.timestamp.batch.value, ft.num_participants
        committed = ft.num_committed > self.committed
        self.committed = ft.num_committed
        inputs, targets = state.batch
        emit(
            {
                "event": "step",
                "g": group,
                "t": t,
                "n": n,
                "committed": committed,
                "loss": float(state.loss.detach()),
                "lr": self.lr,
                "x": inputs.tolist(),
                "y": targets.tolist(),
                "time": time.time(),
                "attempted": ft.num_attempted,
                "num_committed": ft.num_committed,
            }
        )
        self.outage = self.outage or n < GROUPS
        # committed: a heal that failed (a transfer past its timeout on a loaded machine) leaves the
        # returning group a step of its own in the quorum, which neither group commits
        if self.together is None and self.outage and n == GROUPS and committed:
            self.together = t
        if self.together is not None and t == self.together + DUMP:
            self.dumped = t
            saved = {"t": t, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(saved, folder / f"final-g{group}.pt")
            emit({"event": "dumped", "g": group, "t": t, "time": time.time()})
            if GROUPS > 2:
                state.stop_training()
        if self.dumped is not None and t > self.dumped:
            self.alone += n == 1 and committed
            if self.alone >= ALONE:
                state.stop_training()
        if n < GROUPS or self.dumped is not None:
            time.sleep(0.1)  # a bounded number of steps while the test restarts or stops group 1


# Each group reads its share of the data through kiln's sampler (num_replica_groups x 1 shares),
# shuffled by the seed and the epoch.
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
trainer = kiln.Trainer(
    model,
    train_dataloader=loader,
    criterion=nn.MSELoss(),
    optimizers=optimizer,
    schedulers=scheduler,
    step_schedulers_every_batch=True,
    max_duration=f"{until}ba",
    autoresume=life == 3,
    progress_bar=False,
    seed=SEED,
    callbacks=[Drill()],
    goodput=GoodputMonitor(interval=0),  # a record per step: the test reads the last one
    save_folder=str(folder / "checkpoints"),
    save_interval="1000ba",
    save_type="merged",
    fault_tolerance={
        "lighthouse": lighthouse,
        "replica_group": group,
        "num_replica_groups": GROUPS,
        "timeout": 4,  # tests/test_fault_tolerance.py TIMEOUT: a heal under load must load within it
        "quorum_timeout": 30,
        "connect_timeout": 10,
        "hostname": "127.0.0.1",
    },
)
if group != 0:  # a group that writes no checkpoints has no save folder to keep its account beside
    trainer.goodput.path = folder / f"g{group}.goodput.json"
emit({"event": "built", "g": group, "writes": trainer._saver is not None, "time": time.time()})
if life == 1:
    (folder / f"ready-g{group}").touch()
    while not all((folder / f"ready-g{other}").exists() for other in range(GROUPS)):
        time.sleep(0.01)
trainer.fit()
emit({"event": "done", "g": group, "t": trainer.state.timestamp.batch.value, "time": time.time()})
trainer.close()
