"""A script with no launch call, as a new user writes it (issue 23): started by `kiln run -n 2`,
`srun` or `mpirun`, the front door named in argv[2] must join the launcher's world by itself.

argv: OUT MODE; MODE is one of
  trainer   kiln.Trainer with a save folder and a FileLogger, no launch call
  engine    kiln.initialize, no launch call
  explicit  kiln.launch_from_torch(config=...) first, then kiln.Trainer: the explicit call wins
Each process writes OUT/rank<launcher rank>.json: the world it saw and the samples it trained on.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from kiln.loggers import FileLogger

out, mode = sys.argv[1], sys.argv[2]
NUM_SAMPLES = 16
# Sample i is the vector (i, i, i, i): a batch says which samples this rank got.
data = TensorDataset(
    torch.arange(NUM_SAMPLES, dtype=torch.float32).unsqueeze(1).repeat(1, 4), torch.zeros(NUM_SAMPLES, dtype=torch.long)
)
seen: list[int] = []
torch.manual_seed(0)
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
explicit = None
lock_seen = None

if mode == "engine":
    engine, loader, _, _ = kiln.initialize(model, optimizer, nn.CrossEntropyLoss(), DataLoader(data, batch_size=2))
    for x, _y in loader:
        seen.extend(int(v) for v in x[:, 0])
    rank, world = kiln.context().rank, kiln.context().world_size
else:
    if mode == "explicit":
        explicit = kiln.launch_from_torch(config={"name": "explicit"})

    class Record(kiln.Callback):
        def after_dataloader(self, state, logger):
            seen.extend(int(v) for v in state.batch[0][:, 0])

        def batch_end(self, state, logger):  # the save folder's lock while the job trains
            global lock_seen
            path = os.path.join(out, "ck", ".kiln-lock")
            if lock_seen is None and state.rank == 0 and os.path.exists(path):
                with open(path) as f:
                    lock_seen = json.load(f)

    trainer = kiln.Trainer(
        model,
        criterion=nn.CrossEntropyLoss(),
        train_dataloader=DataLoader(data, batch_size=2),
        optimizers=optimizer,
        max_duration="1ep",
        progress_bar=False,
        callbacks=[Record()],
        loggers=[FileLogger(os.path.join(out, "metrics.jsonl"))],
        save_folder=os.path.join(out, "ck") if mode == "trainer" else None,
    )
    trainer.fit()
    rank, world = trainer.state.rank, trainer.state.world_size

name = next(os.environ[n] for n in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID") if n in os.environ)
record = {
    "rank": rank,
    "world": world,
    "group": dist.get_world_size() if dist.is_initialized() else None,
    "seen": seen,
    "explicit_kept": explicit is not None and kiln.context() is explicit and kiln.context().config.name == "explicit",
    "lock": lock_seen,
    "pid": os.getpid(),
}
with open(os.path.join(out, f"rank{name}.json"), "w") as f:
    json.dump(record, f)
