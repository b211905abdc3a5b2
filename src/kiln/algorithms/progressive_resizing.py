"""Progressive resizing (as in fast.ai's ImageNet runs): train on small images first, full size last."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kiln.algorithms._batch import Key, get_item, set_item
from kiln.algorithms._random import SeededAlgorithm
from kiln.core.event import Event

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["ProgressiveResizing", "resize_scale"]


def resize_scale(elapsed: float, initial_scale: float, delay_fraction: float, finetune_fraction: float) -> float:
    """The image scale at ``elapsed`` (a fraction of the run): ``initial_scale`` until
    ``delay_fraction``, then linear to 1 at ``1 - finetune_fraction``, then 1."""
    if elapsed < delay_fraction:
        return initial_scale
    ramp = 1.0 - finetune_fraction - delay_fraction
    if ramp <= 0:
        return 1.0
    return initial_scale + (1.0 - initial_scale) * min(1.0, (elapsed - delay_fraction) / ramp)


class ProgressiveResizing(SeededAlgorithm):
    """Shrink training images early in training and grow them back to full size.

    Small images make early epochs cheaper while the network learns coarse features; the last
    ``finetune_fraction`` of training runs at full size so the model matches evaluation. Each
    side becomes ``scale * side`` rounded to a multiple of ``size_increment``. ``mode="resize"``
    interpolates (bilinear), ``mode="crop"`` takes one random crop per batch from this algorithm's
    generator. Inputs are ``(N, C, H, W)``; with ``resize_targets`` targets of the same height and
    width (segmentation masks) are changed alike (nearest-neighbour for integer targets).

    Events: ``BEFORE_TRAIN_BATCH`` (the whole batch, before it is split into microbatches).

    Args:
        mode: ``"resize"`` or ``"crop"``.
        initial_scale: the scale at the start, in ``(0, 1]``.
        finetune_fraction: the final fraction of training at full size.
        delay_fraction: the first fraction of training held at ``initial_scale``.
        size_increment: sides are rounded to multiples of this.
        resize_targets: change the targets too.
        input_key, target_key: where inputs and targets are in the batch.
        seed: seeds the crop positions (default: from the run's seed).

    Example::

        algorithms = [kiln.algorithms.ProgressiveResizing(initial_scale=0.5, finetune_fraction=0.2)]
    """

    def __init__(
        self,
        mode: str = "resize",
        initial_scale: float = 0.5,
        finetune_fraction: float = 0.2,
        delay_fraction: float = 0.5,
        size_increment: int = 4,
        resize_targets: bool = False,
        *,
        input_key: Key = 0,
        target_key: Key = 1,
        seed: int | None = None,
    ) -> None:
        super().__init__(seed)
        if mode not in ("resize", "crop"):
            raise ValueError(f"ProgressiveResizing(mode={mode!r}): expected 'resize' or 'crop'")
        if not 0.0 < initial_scale <= 1.0:
            raise ValueError(f"ProgressiveResizing(initial_scale={initial_scale!r}): must be in (0, 1]")
        if not (
            0.0 <= finetune_fraction <= 1.0
            and 0.0 <= delay_fraction <= 1.0
            and finetune_fraction + delay_fraction <= 1.0
        ):
            raise ValueError(
                f"ProgressiveResizing(finetune_fraction={finetune_fraction!r}, delay_fraction="
                f"{delay_fraction!r}): both must be in [0, 1] and sum to at most 1"
            )
        if size_increment < 1:
            raise ValueError(f"ProgressiveResizing(size_increment={size_increment!r}): must be >= 1")
        self.mode = mode
        self.initial_scale = initial_scale
        self.finetune_fraction = finetune_fraction
        self.delay_fraction = delay_fraction
        self.size_increment = size_increment
        self.resize_targets = resize_targets
        self.input_key = input_key
        self.target_key = target_key
        self.scale = initial_scale

    def match(self, event: Event, state: State) -> bool:
        return event == Event.BEFORE_TRAIN_BATCH

    def apply(self, event: Event, state: State, logger: Any) -> None:
        elapsed = state.get_elapsed_duration()
        if elapsed is None:
            raise ValueError("ProgressiveResizing needs the run's max_duration to know how far training is")
        self.scale = resize_scale(elapsed, self.initial_scale, self.delay_fraction, self.finetune_fraction)
        inputs = get_item(state.batch, self.input_key)
        if inputs.dim() != 4:
            raise ValueError(f"ProgressiveResizing needs images shaped (N, C, H, W), got {tuple(inputs.shape)}")
        height, width = inputs.shape[-2:]
        size = (self._side(height), self._side(width))
        if size == (height, width):
            return
        batch = state.batch
        top = left = 0
        if self.mode == "crop":
            generator = self.generator(state)
            top = int(torch.randint(height - size[0] + 1, (), generator=generator))
            left = int(torch.randint(width - size[1] + 1, (), generator=generator))
        batch = set_item(batch, self.input_key, self._change(inputs, size, top, left))
        if self.resize_targets:
            targets = get_item(batch, self.target_key)
            batch = set_item(batch, self.target_key, self._change(targets, size, top, left))
        state.batch = batch

    def _side(self, side: int) -> int:
        scaled = round(side * self.scale / self.size_increment) * self.size_increment
        return int(min(side, max(self.size_increment, scaled)))

    def _change(self, tensor: torch.Tensor, size: tuple[int, int], top: int, left: int) -> torch.Tensor:
        if self.mode == "crop":
            return tensor[..., top : top + size[0], left : left + size[1]]
        if tensor.is_floating_point():
            return F.interpolate(
                tensor if tensor.dim() == 4 else tensor.unsqueeze(1), size=size, mode="bilinear", align_corners=False
            ).reshape(*tensor.shape[:-2], *size)
        # Class masks must keep whole class ids: nearest neighbour, computed in float and cast back.
        spatial = tensor.unsqueeze(1).float() if tensor.dim() == 3 else tensor.float()
        return F.interpolate(spatial, size=size, mode="nearest").to(tensor.dtype).reshape(*tensor.shape[:-2], *size)
