"""Train 3 steps on N ranks under each strategy in turn, save one checkpoint of each save type, and
record the full model and optimizer state for comparison, in OUT/STRATEGY/.

    python ckpt_save_ranks.py OUT STRATEGY[,STRATEGY...] [SAVE_TYPES=sharded,deduped,merged]
"""

import sys

import torch
from torch import nn

import kiln
from kiln.checkpoint import save_checkpoint
from kiln.parallel.state.dcp_state import get_state_dict

out, strategies = sys.argv[1], sys.argv[2].split(",")
save_types = (sys.argv[3] if len(sys.argv) > 3 else "sharded,deduped,merged").split(",")
ctx = kiln.launch_from_torch(seed=0)
for strategy in strategies:  # a fresh model, optimizer and Engine each
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = kiln.Engine(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
    state = kiln.State(model, rank=ctx.rank, world_size=ctx.world_size, optimizers=[engine.optimizer])
    state.engine = engine
    g = torch.Generator().manual_seed(10 + ctx.rank)
    for _ in range(3):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
        state.timestamp.advance_batch(16)
    for save_type in save_types:
        save_checkpoint(f"{out}/{strategy}/{save_type}", state, save_type)
    full = get_state_dict(engine.model, engine.optimizer, full=True)
    if ctx.rank == 0:
        torch.save(full, f"{out}/{strategy}/expected.pt")
torch.distributed.destroy_process_group()
