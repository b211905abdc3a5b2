"""The evaluation loss: a sample-weighted mean over every batch of every rank.

It does what torchmetrics' ``MeanMetric`` did here, number for number (the same float64 sums, NaN
losses left out with a warning, the ranks' sums gathered and added in rank order), without
importing torchmetrics: with transformers, scipy and matplotlib installed, ``import torchmetrics``
loads all three, which costs a process more than importing torch. An evaluation with metrics of
its own still imports torchmetrics for them; one that reports only the loss no longer does.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

__all__ = ["LossMean"]


class LossMean:
    """``sum(loss x samples) / sum(samples)`` over the batches :meth:`update` saw, on every rank.

    The sums are float64 (float32 on MPS, which has no float64): a long evaluation's float32 running
    sum would drift from the one-process mean. Ranks that hold the same batch (tensor or pipeline
    parallel) count it in both sums, which cancels in the ratio.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.total = torch.zeros((), dtype=self.dtype, device=self.device)
        self.weight = torch.zeros((), dtype=self.dtype, device=self.device)

    def reset(self) -> None:
        self.total.zero_()
        self.weight.zero_()

    def update(self, value: torch.Tensor, weight: float | int | torch.Tensor = 1.0) -> None:
        """Add ``value`` (a loss, any shape) with ``weight`` (its sample count), NaNs left out."""
        weight = torch.broadcast_to(torch.as_tensor(weight, dtype=self.dtype, device=self.device), value.shape)
        nans = torch.isnan(value) | torch.isnan(weight)
        if nans.any():  # one host read a batch, as MeanMetric's check had
            warnings.warn("Encountered `nan` values in tensor. Will be removed.", UserWarning, stacklevel=2)
            value, weight = value[~nans], weight[~nans]
            if value.numel() == 0:
                return
        value = value.to(self.dtype)
        self.total += (value * weight).sum()
        self.weight += weight.sum()

    def compute(self) -> torch.Tensor:
        """The mean over every rank (each rank's sums gathered, then added in rank order)."""
        total, weight = self.total, self.weight
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            total, weight = (_summed_over_ranks(t) for t in (total, weight))
        return total / weight


def _summed_over_ranks(value: torch.Tensor) -> torch.Tensor:
    gathered = [torch.zeros_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value)
    return torch.stack(gathered).sum(0)
