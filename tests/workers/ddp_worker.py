"""2-rank DDP through kiln.initialize: replicas stay identical, accumulation syncs only at the end."""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

import kiln

out, accum = sys.argv[1], int(sys.argv[2])
ctx = kiln.launch_from_torch(config={"gradient_accumulation": accum, "strategy": "ddp"}, seed=0)
torch.manual_seed(ctx.rank)  # different init per rank: DDP must broadcast rank 0's weights
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(
    torch.randn(64, 6, generator=torch.Generator().manual_seed(5)),
    torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(6)),
)
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
engine, loader, _, _ = kiln.initialize(model, opt, nn.CrossEntropyLoss(), loader)
assert isinstance(loader.sampler, torch.utils.data.DistributedSampler), type(loader.sampler)
unsynced_differs = []
for i, (x, y) in enumerate(loader):
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    grad = engine.module[0].weight.grad.clone()
    others = [torch.empty_like(grad) for _ in range(2)]
    dist.all_gather(others, grad)
    if (i + 1) % accum != 0:
        unsynced_differs.append(not torch.equal(others[0], others[1]))
    else:
        assert torch.equal(others[0], others[1]), "gradients differ after the synchronising step"
    engine.step()
sd = kiln.parallel.full_model_state_dict(engine.model)
flat = torch.cat([v.flatten() for v in sd.values()])
gathered = [torch.empty_like(flat) for _ in range(2)]
dist.all_gather(gathered, flat)
with open(f"{out}/rank{ctx.rank}.json", "w") as f:
    json.dump(
        {
            "identical": torch.equal(gathered[0], gathered[1]),
            "keys": sorted(sd),
            "unsynced_differs": unsynced_differs,
            "len": len(loader),
        },
        f,
    )
dist.destroy_process_group()
