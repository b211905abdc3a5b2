"""One replica group of tests/test_fault_tolerance_fsdp.py: two ranks under `kiln run -n 2`, a Trainer
with STRATEGY inside the group (fsdp: FSDP2 over its ranks; tp: tensor parallel, the first Linear
split by columns and the second by rows) joined to the other group by torchft.

    kiln run -n 2 ft_fsdp_group.py GROUP LIGHTHOUSE DIR STRATEGY

Float64 SGD for 6 steps on a fixed dataset; rank 0 writes the whole model (gathered from its shards)
to DIR/final-g<GROUP>.pt, and each rank prints one JSON line of its step counts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import kiln
from kiln.parallel import full_model_state_dict

STEPS, SAMPLES, BATCH = 6, 256, 4
group, lighthouse, folder, name = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
strategy = kiln.parallel.TensorParallel({"0": "colwise", "2": "rowwise"}) if name == "tp" else name

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(
    torch.randn(SAMPLES, 8, dtype=torch.float64), torch.randn(SAMPLES, 1, dtype=torch.float64)
)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
trainer = kiln.Trainer(
    model,
    train_dataloader=torch.utils.data.DataLoader(data, batch_size=BATCH),
    criterion=nn.MSELoss(),
    optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
    max_duration=f"{STEPS}ba",
    strategy=strategy,
    progress_bar=False,
    seed=0,
    fault_tolerance={
        "lighthouse": lighthouse,
        "replica_group": group,
        "num_replica_groups": 2,
        "timeout": 30,
        "quorum_timeout": 120,
        "connect_timeout": 60,
        "hostname": "127.0.0.1",
    },
)
trainer.fit()
state = full_model_state_dict(trainer.engine.model)  # a collective: every rank of the group
ft, rank = trainer.fault_tolerance, int(os.environ["RANK"])
if rank == 0:
    torch.save({k: v.cpu() for k, v in state.items()}, folder / f"final-g{group}.pt")
record = {"g": group, "rank": rank, "committed": ft.num_committed, "attempted": ft.num_attempted}
os.write(1, (json.dumps(record) + "\n").encode())
trainer.close()
