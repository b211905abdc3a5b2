"""The Trainer under 2-rank DDP: per-rank losses, the logged (averaged) loss, counts and weights."""

import json
import sys

import torch
from torch import nn

import kiln
from kiln.loggers import FileLogger

out = sys.argv[1]
ctx = kiln.launch_from_torch()
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 8, generator=g)
data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
losses = []


class Record(kiln.Callback):
    def batch_end(self, state, logger):
        losses.append(float(state.loss))


trainer = kiln.Trainer(
    model,
    train_dataloader=torch.utils.data.DataLoader(data, batch_size=8, shuffle=True),
    max_duration="2ep",
    optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
    criterion=nn.CrossEntropyLoss(),
    callbacks=[Record()],
    loggers=[FileLogger(f"{out}/log.jsonl")],
    seed=11,
    progress_bar=False,
)
trainer.fit()
ts = trainer.state.timestamp
with open(f"{out}/rank{ctx.rank}.json", "w") as f:
    json.dump(
        {
            "losses": losses,
            "samples": ts.sample.value,
            "batches": ts.batch.value,
            "order": list(trainer.train_dataloader.sampler),
            "weights": {k: v.tolist() for k, v in kiln.parallel.full_model_state_dict(trainer.engine.model).items()},
        },
        f,
    )
torch.distributed.destroy_process_group()
