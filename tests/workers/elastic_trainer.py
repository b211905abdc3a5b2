"""A 2-rank Trainer run with checkpoints and autoresume; with `crash`, rank 1 dies hard at batch 5
of the first attempt and torchrun restarts the workers, which resume from `last`.

    kiln run -n 2 [--max-restarts 1] elastic_trainer.py OUT none|crash [PLAIN]

(tests/test_elastic.py forks both attempts' ranks, the second with TORCHELASTIC_RESTART_COUNT=1.)

With PLAIN, the first attempt trains the same run uninterrupted in PLAIN first (the reference, in
the same launch: a launch's processes cost more than this run), then the run in OUT. Each run's
ranks write OUT/rank<r>.json: the attempt, the batch the run started from and the weights.
"""

import json
import os
import sys

import torch
from torch import nn

import kiln

ctx = kiln.launch_from_torch()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def run(out, crash):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 2))

    class Crash(kiln.Callback):
        def batch_end(self, state, logger):
            if crash and attempt == 0 and ctx.rank == 1 and state.timestamp.batch.value == 5:
                os._exit(1)

    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=8, shuffle=True),
        max_duration="3ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=0.01),
        criterion=nn.CrossEntropyLoss(),
        callbacks=[Crash()],
        save_folder=f"{out}/ckpt",
        save_interval="2ba",
        autoresume=True,
        seed=3,
        progress_bar=False,
    )
    start = trainer.state.timestamp.batch.value
    trainer.fit()
    weights = kiln.parallel.full_model_state_dict(trainer.engine.model)
    with open(f"{out}/rank{ctx.rank}.json", "w") as f:
        json.dump({"attempt": attempt, "start": start, "weights": {k: v.tolist() for k, v in weights.items()}}, f)
    trainer.close()


if len(sys.argv) > 3 and attempt == 0:
    run(sys.argv[3], crash=False)
run(sys.argv[1], crash=sys.argv[2] == "crash")
torch.distributed.destroy_process_group()
