"""The small model and data every parallel parity test trains: 4 residual MLP blocks."""

import os

import torch
from torch import nn

from kiln.parallel import Hybrid, Pipeline, TensorParallel

PLAN = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}

# Every strategy the parity tests compare with one process, built fresh for each run.
STRATEGIES = {
    "ddp": lambda: "ddp",
    "zero1": lambda: "zero1",
    "zero2": lambda: "zero2",
    "zero3": lambda: "zero3",
    "tp": lambda: TensorParallel(PLAN),
    "pp_1f1b": lambda: Pipeline(["blocks.2"], schedule="1f1b", microbatches=4),
    "pp_gpipe": lambda: Pipeline(["blocks.2"], schedule="gpipe", microbatches=4),
    "pp_interleaved": lambda: Pipeline(
        ["blocks.1", "blocks.2", "blocks.3"], schedule="interleaved1f1b", microbatches=4
    ),
    "hybrid_fsdp_tp": lambda: Hybrid(dp_shard=2, tp=2, tp_plan=PLAN),
    "hybrid_hsdp": lambda: Hybrid(dp_replicate=2, dp_shard=2),
    "hybrid_pp_fsdp": lambda: Hybrid(pp=2, dp_shard=2, split_points=["blocks.2"], microbatches=2),
    "hybrid_pp_tp": lambda: Hybrid(pp=2, tp=2, tp_plan=PLAN, split_points=["blocks.2"], microbatches=2),
}


class Block(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    tp_plan = PLAN

    def __init__(self, num_blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# float64 keeps reduction-order noise (different sums on different layouts) near 1e-15, so a
# 1e-5 tolerance after Adam, which amplifies relative noise in small gradients, catches logic errors only.
# DeepSpeed reduces only half and single precision: its launch sets KILN_PARITY_DTYPE=float32.
DTYPE = getattr(torch, os.environ.get("KILN_PARITY_DTYPE", "float64"))


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(DTYPE)


def make_data(steps: int = 4, global_batch: int = 16):
    g = torch.Generator().manual_seed(1)
    n = steps * global_batch
    return torch.randn(n, 8, generator=g, dtype=DTYPE), torch.randint(0, 4, (n,), generator=g)


def check_loads_on_one_process(out, tag: str) -> None:
    """The DCP checkpoint OUT/ckpt_<tag>, saved by 2 ranks, loaded into a plain one-process model and
    AdamW with no process group: the weights equal OUT/<tag>_full.pt and Adam's state is all there."""
    import torch.distributed.checkpoint as dcp

    from kiln.parallel.state.dcp_state import get_state_dict, set_state_dict

    model = make_model(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    state = get_state_dict(model, opt)  # no process group: DCP reads the 2-rank shards whole
    dcp.load(state, checkpoint_id=str(out / f"ckpt_{tag}"))
    set_state_dict(model, opt, state)
    full = torch.load(out / f"{tag}_full.pt", weights_only=True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, full[name]), name
    assert {float(s["step"]) for s in opt.state.values()} == {4.0}
    assert all(s["exp_avg_sq"].abs().sum() > 0 for s in opt.state.values())
