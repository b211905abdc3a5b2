"""Brings up a group through the launcher named in argv[1] and proves it works with an all-reduce."""

import json
import sys

import torch
import torch.distributed as dist

import kiln

how, out = sys.argv[1], sys.argv[2]
if how == "torch":
    ctx = kiln.launch_from_torch(config={"name": "x"})
elif how == "slurm":
    ctx = kiln.launch_from_slurm(config={"name": "x"}, host="127.0.0.1", port=int(sys.argv[3]))
else:
    ctx = kiln.launch_from_openmpi(config={"name": "x"}, host="127.0.0.1", port=int(sys.argv[3]))
t = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(t)
assert kiln.context() is ctx
with open(f"{out}/rank{ctx.rank}.json", "w") as f:
    json.dump(
        {
            "rank": ctx.rank,
            "world": ctx.world_size,
            "local": ctx.local_rank,
            "sum": t.item(),
            "backend": ctx.backend,
            "name": ctx.config.name,
        },
        f,
    )
dist.destroy_process_group()
