"""A 2-rank Trainer with an algorithm that leaves parameters without gradients on some steps.

Usage: unused_params_trainer.py OUT ALGORITHM/STRATEGY... (one launch, a fresh model and Trainer
per case, in turn). StochasticDepth skips whole residual blocks; LayerFreezing freezes the first
layers halfway through. DDP must be told to look for unused parameters (the Trainer does, from the
algorithm's ``find_unused_parameters``), or its second step fails. The global batch is 16 on any
world size. For each case each rank writes OUT/<algorithm>_<strategy>_rank<r>.pt with its full
weights and the batch count.
"""

import sys

import torch
from torch import nn

import kiln

out, cases = sys.argv[1], sys.argv[2:]
ctx = kiln.launch_from_torch()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


torch.set_default_dtype(torch.float64)  # parity with one process to rounding, not to float32's
algorithms = {
    "stochastic_depth": lambda: kiln.algorithms.StochasticDepth("Block", drop_rate=0.5, seed=3),
    "layer_freezing": lambda: kiln.algorithms.LayerFreezing(freeze_start=0.5, freeze_level=0.6),
}
for case in cases:
    algorithm, strategy = case.split("/")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Block(), Block(), Block(), nn.Linear(16, 2))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    # global batch 16 on any world size: the sampler interleaves ranks, so 2 ranks see what 1 rank sees
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=16 // ctx.world_size),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        algorithms=[algorithms[algorithm]()],
        strategy=strategy,
        seed=0,
        progress_bar=False,
    )
    trainer.fit()
    weights = kiln.parallel.full_model_state_dict(trainer.engine)
    batches = trainer.state.timestamp.batch.value
    torch.save({"weights": weights, "batches": batches}, f"{out}/{algorithm}_{strategy}_rank{ctx.rank}.pt")
    trainer.close()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
