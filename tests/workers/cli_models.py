"""Models, datasets and hook functions that the config CLI tests name by type ("cli_models.X").

Importable in-process (the tests put this folder on sys.path) and in workers (tests/distributed.py
puts it on PYTHONPATH). Hooks record into ``RECORD`` and, when ``KILN_TEST_RECORD`` names a file,
rank 0 also writes it there with torch.save.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from kiln.config.reduction import AggregatedOutputs

RECORD: dict[str, Any] = {"points": [], "grads": [], "params": [], "input_dtypes": [], "loaded": []}


def reset() -> None:
    for value in RECORD.values():
        value.clear()


class TokenDataset(Dataset):
    """Sequences of ``length`` tokens of width ``dim``; sample i has ``1 + (i * 3) % length`` real tokens."""

    def __init__(self, size: int = 16, length: int = 5, dim: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, length, dim, generator=g)
        self.y = torch.randn(size, length, generator=g)
        counts = torch.tensor([1 + (i * 3) % length for i in range(size)])
        self.mask = (torch.arange(length)[None, :] < counts[:, None]).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "mask": self.mask[i]}


class TokenModel(nn.Module):
    """End-to-end: ``forward(batch)`` returns ``(sum of squared errors over real tokens, number of real tokens)``."""

    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        err = (self.proj(batch["x"]).squeeze(-1) - batch["y"]) ** 2
        return (err * batch["mask"]).sum(), batch["mask"].sum()


def token_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The hand computation: the same per-token error, summed, with plain autograd."""
    err = (model.proj(batch["x"]).squeeze(-1) - batch["y"]) ** 2
    return (err * batch["mask"]).sum()


def count_tokens(loss_outputs: list[Any], sync_group: Any) -> AggregatedOutputs:
    """``aggregate_outputs_fn``: loss sum, micro-batch count and token count over all ranks."""
    return AggregatedOutputs.aggregate(loss_outputs, sync_group, ntokens_fn=lambda output: output[1])


class DtypeModel(nn.Module):
    """Records the dtype of its input; holds a floating buffer to check per-tensor-type precision."""

    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        RECORD["input_dtypes"].append(batch["x"].dtype)
        return (self.proj(batch["x"]).float() ** 2).mean()


def _save_record() -> None:
    path = os.environ.get("KILN_TEST_RECORD")
    if path and int(os.environ.get("RANK", "0")) == 0:
        torch.save({k: v for k, v in RECORD.items() if k != "input_dtypes"}, path)


def record_grads(trainer: Any) -> None:
    """``before_optimizer_step``: the reduced gradients and the parameters they belong to."""
    model = trainer.state.model
    RECORD["grads"].append({n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()})
    RECORD["params"].append({n: p.detach().float().cpu().clone() for n, p in model.named_parameters()})
    _save_record()


def _point(name: str):
    def hook(trainer: Any, *args: Any) -> None:
        RECORD["points"].append(name)

    hook.__name__ = name
    return hook


for _name in (
    "on_train_start",
    "on_train_end",
    "on_epoch_start",
    "on_epoch_end",
    "on_train_step_start",
    "on_train_step_end",
    "before_zero_grad",
    "after_zero_grad",
    "after_aggregate_train_step_outputs",
    "before_gnorm_clip",
    "after_gnorm_clip",
    "before_optimizer_step",
    "after_optimizer_step",
    "on_val_start",
    "on_val_end",
    "on_val_step_start",
    "on_val_step_end",
    "after_setup",
):
    globals()[_name] = _point(_name)


def save_extra(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """``on_save_checkpoint``: put plain data in the checkpoint."""
    checkpoint["note"] = f"saved at {trainer.state.timestamp.batch.value}"


def load_extra(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """``on_load_checkpoint``: record what came back."""
    RECORD["loaded"].append(dict(checkpoint))


def init_env(trainer_args: Any) -> None:
    """``init_env_fn``: runs first, with the TrainerArgs."""
    RECORD["points"].append(("init_env", trainer_args.micro_batch_size))
