"""One replica group of two DDP ranks for tests/test_fault_tolerance_kill.py: killed whole, or one rank.

    kiln run -n 2 [--max-restarts 1] ft_ddp_group.py GROUP LIGHTHOUSE DIR

Each rank writes its pid to ``DIR/pid-g<GROUP>-r<RANK>`` (again after a restart) so that the test
kills exactly the process it means; rank 0 prints one JSON line a step (``t``: the batch, ``n``:
the groups in its quorum). Every rank waits for ``DIR/ready-*`` of all four ranks before its first
step (the first quorum has both groups) and stops after batch T once ``DIR/stop`` holds T (written
well ahead of every rank, so both ranks of a group stop at the same step). A step sleeps 0.1 s, so
that an outage spans a bounded number of steps.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import kiln

group, lighthouse, folder = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
rank = int(os.environ["RANK"])
# written whole (a rename), so that the test never reads the empty file a restarted rank truncated
(folder / f"pid-g{group}-r{rank}.tmp").write_text(str(os.getpid()))
os.replace(folder / f"pid-g{group}-r{rank}.tmp", folder / f"pid-g{group}-r{rank}")

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(8192, 4), torch.randn(8192, 1))
model = nn.Linear(4, 1)


class Drill(kiln.Callback):
    def batch_end(self, state, logger) -> None:
        t, ft = state.timestamp.batch.value, trainer.fault_tolerance
        if rank == 0:
            record = {"g": group, "t": t, "n": ft.num_participants, "committed": ft.num_committed, "time": time.time()}
            os.write(1, (json.dumps(record) + "\n").encode())
        stop = folder / "stop"
        if stop.exists() and t >= int(stop.read_text()):
            state.stop_training()
        time.sleep(0.1)


trainer = kiln.Trainer(
    model,
    train_dataloader=torch.utils.data.DataLoader(data, batch_size=4),
    criterion=nn.MSELoss(),
    optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
    max_duration="100000ba",
    strategy="ddp",
    progress_bar=False,
    seed=0,
    callbacks=[Drill()],
    fault_tolerance={
        "lighthouse": lighthouse,
        "replica_group": group,
        "num_replica_groups": 2,
        "timeout": 5,
        "quorum_timeout": 60,
        "connect_timeout": 30,
        "hostname": "127.0.0.1",
    },
)
(folder / f"ready-g{group}-r{rank}").touch()
while len(list(folder.glob("ready-*"))) < 4:
    time.sleep(0.01)
trainer.fit()
trainer.close()
