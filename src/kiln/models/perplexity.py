"""Perplexity of next-token predictions, the default evaluation metric of kiln's language models.

A module of its own so that importing :mod:`kiln.models` does not import torchmetrics, which takes
longer to import than torch itself when transformers, scipy and matplotlib are installed (it loads
all of them): the metric's users import it when they build one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import Metric

from kiln.core.batch import IGNORE_INDEX

__all__ = ["LanguagePerplexity"]


class LanguagePerplexity(Metric):
    """Perplexity of next-token predictions: ``exp`` of the mean cross-entropy over every counted
    token (labels equal to ``ignore_index`` are left out) of every rank.

    Args:
        ignore_index: the label of positions that do not count (transformers' -100).
        **kwargs: torchmetrics ``Metric`` options.

    Example::

        ppl = kiln.models.LanguagePerplexity()
        ppl.update(logits[:, :-1], labels[:, 1:])   # (N, T, V) scores, (N, T) labels
        ppl.compute()                               # over every batch and rank
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    sum_loss: torch.Tensor
    total: torch.Tensor

    def __init__(self, ignore_index: int = IGNORE_INDEX, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        # A sum and a count, summed over ranks by compute(): ranks that hold the same batch
        # (tensor or pipeline parallel) count it twice in both, which cancels in the ratio.
        self.add_state("sum_loss", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        preds = preds.detach()
        if preds.dtype in (torch.float16, torch.bfloat16):
            preds = preds.float()
        loss = F.cross_entropy(
            preds.reshape(-1, preds.shape[-1]), target.reshape(-1), ignore_index=self.ignore_index, reduction="sum"
        )
        self.sum_loss += loss.to(self.sum_loss.dtype)
        self.total += (target != self.ignore_index).sum()

    def compute(self) -> torch.Tensor:
        return torch.exp(self.sum_loss / self.total.clamp(min=1))
