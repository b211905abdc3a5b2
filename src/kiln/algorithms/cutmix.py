"""CutMix (Yun et al., 2019): paste a box from a partner image and mix targets by area."""

from __future__ import annotations

import math

import torch

from kiln.algorithms._batch import Key
from kiln.algorithms._mixing import MixingAlgorithm

__all__ = ["CutMix"]


class CutMix(MixingAlgorithm):
    """Replace a random box of each image by the same box of a partner image.

    A weight ``lam ~ Beta(alpha, alpha)`` sets the box's area to about ``(1 - lam)`` of the image;
    the box's centre is uniform over the image and the box is clipped at the borders, so the
    weight used for the targets is the fraction of the image left untouched (``mixing``). Targets
    become ``mixing * y + (1 - mixing) * y[perm]``, or with ``interpolate_loss=True`` the loss is
    interpolated instead. Inputs are ``(N, ..., H, W)``: the last two dimensions are cut. One box
    is drawn per microbatch; ``box`` holds the last one as ``(top, bottom, left, right)``.

    Events: as :class:`MixUp`.

    Args:
        alpha: Beta concentration (1.0: the box's area is uniform).
        num_classes: classes for one-hot targets; ``None`` takes ``outputs.shape[-1]``.
        interpolate_loss: interpolate two losses instead of mixing the targets.
        input_key, target_key: where inputs and targets are in the batch.
        seed: seeds this algorithm's generator (default: from the run's seed).

    Example::

        algorithms = [kiln.algorithms.CutMix(alpha=1.0)]
    """

    def __init__(
        self,
        alpha: float = 1.0,
        num_classes: int | None = None,
        interpolate_loss: bool = False,
        *,
        input_key: Key = 0,
        target_key: Key = 1,
        seed: int | None = None,
    ) -> None:
        super().__init__(alpha, num_classes, interpolate_loss, input_key, target_key, seed)
        self.box: tuple[int, int, int, int] | None = None

    def mix_inputs(
        self, inputs: torch.Tensor, permutation: torch.Tensor, lam: float, generator: torch.Generator
    ) -> tuple[torch.Tensor, float]:
        if inputs.dim() < 3:
            raise ValueError(f"CutMix needs images shaped (N, ..., H, W), got inputs of shape {tuple(inputs.shape)}")
        height, width = inputs.shape[-2], inputs.shape[-1]
        ratio = math.sqrt(1.0 - lam)
        cut_h, cut_w = int(height * ratio), int(width * ratio)
        cy = int(torch.randint(height, (), generator=generator))
        cx = int(torch.randint(width, (), generator=generator))
        top, bottom = max(cy - cut_h // 2, 0), min(cy + cut_h - cut_h // 2, height)
        left, right = max(cx - cut_w // 2, 0), min(cx + cut_w - cut_w // 2, width)
        mixed = inputs.clone()
        mixed[..., top:bottom, left:right] = inputs[permutation][..., top:bottom, left:right]
        self.box = (top, bottom, left, right)
        return mixed, 1.0 - (bottom - top) * (right - left) / (height * width)
