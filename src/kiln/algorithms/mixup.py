"""MixUp (Zhang et al., 2018): train on convex combinations of pairs of samples and their targets."""

from __future__ import annotations

import torch

from kiln.algorithms._batch import Key
from kiln.algorithms._mixing import MixingAlgorithm

__all__ = ["MixUp"]


class MixUp(MixingAlgorithm):
    """Mix each sample with a random partner from the same microbatch.

    For a weight ``lam ~ Beta(alpha, alpha)`` drawn per microbatch and a permutation ``perm``,
    inputs become ``lam * x + (1 - lam) * x[perm]`` and targets ``lam * y + (1 - lam) * y[perm]``
    (as class probabilities; losses such as ``nn.CrossEntropyLoss`` accept them). With
    ``interpolate_loss=True`` the targets stay as they are and the loss becomes
    ``lam * loss(y) + (1 - lam) * loss(y[perm])``, which suits losses that need class indices.

    Events: ``BEFORE_FORWARD`` (mix inputs), ``BEFORE_LOSS``/``AFTER_BACKWARD`` (swap in the soft
    targets, put the originals back), or ``AFTER_LOSS`` with ``interpolate_loss``.
    ``mixing`` and ``permutation`` hold the last draw.

    Args:
        alpha: Beta concentration; small values mix little, 1.0 draws ``lam`` uniformly.
        num_classes: number of classes for one-hot targets; ``None`` takes ``outputs.shape[-1]``.
        interpolate_loss: interpolate two losses instead of mixing the targets.
        input_key, target_key: where inputs and targets are in the batch (``0``/``1`` for a tuple).
        seed: seeds this algorithm's generator (default: from the run's seed).

    Example::

        trainer = kiln.Trainer(model, train_dataloader=dl, max_duration="10ep", criterion=nn.CrossEntropyLoss(),
                               algorithms=[kiln.algorithms.MixUp(alpha=0.2)])
    """

    def __init__(
        self,
        alpha: float = 0.2,
        num_classes: int | None = None,
        interpolate_loss: bool = False,
        *,
        input_key: Key = 0,
        target_key: Key = 1,
        seed: int | None = None,
    ) -> None:
        super().__init__(alpha, num_classes, interpolate_loss, input_key, target_key, seed)

    def mix_inputs(
        self, inputs: torch.Tensor, permutation: torch.Tensor, lam: float, generator: torch.Generator
    ) -> tuple[torch.Tensor, float]:
        return lam * inputs + (1.0 - lam) * inputs[permutation], lam
