"""What MixUp and CutMix share: a permutation and a mixing weight per microbatch, soft targets or
an interpolated loss, and putting the original targets back once the backward pass is done."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kiln.algorithms._batch import Key, get_item, set_item
from kiln.algorithms._forward import compute_loss
from kiln.algorithms._random import SeededAlgorithm, sample_beta
from kiln.core.event import Event

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["MixingAlgorithm", "soft_targets"]


def soft_targets(targets: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """Class-probability targets of shape ``(N, num_classes)``: one-hot for class indices, unchanged
    (cast) for targets that already are probabilities."""
    if targets.is_floating_point() and targets.dim() >= 2:
        return targets.to(dtype)
    if targets.is_floating_point():
        raise ValueError(
            f"targets of shape {tuple(targets.shape)} and dtype {targets.dtype} are neither class "
            "indices (an integer tensor) nor class probabilities of shape (N, num_classes)"
        )
    return F.one_hot(targets.long(), num_classes).to(dtype)


class MixingAlgorithm(SeededAlgorithm):
    """Base of MixUp and CutMix. Subclasses implement ``mix_inputs``.

    Events: ``BEFORE_FORWARD`` mixes the inputs; then either ``BEFORE_LOSS`` swaps in mixed soft
    targets (put back at ``AFTER_BACKWARD``), or, with ``interpolate_loss``, ``AFTER_LOSS`` replaces
    the loss by ``lam * loss + (1 - lam) * loss(permuted targets)``.
    """

    def __init__(
        self,
        alpha: float,
        num_classes: int | None,
        interpolate_loss: bool,
        input_key: Key,
        target_key: Key,
        seed: int | None,
    ) -> None:
        super().__init__(seed)
        if not alpha > 0:
            raise ValueError(
                f"{type(self).__name__}(alpha={alpha!r}): alpha must be > 0 (it parameterises Beta(alpha, alpha))"
            )
        if num_classes is not None and num_classes < 2:
            raise ValueError(
                f"{type(self).__name__}(num_classes={num_classes!r}): need at least 2 classes, or None to "
                "take the number from the model's outputs"
            )
        self.alpha = alpha
        self.num_classes = num_classes
        self.interpolate_loss = interpolate_loss
        self.input_key = input_key
        self.target_key = target_key
        self.mixing: float | None = None  # the last microbatch's weight of its own sample
        self.permutation: torch.Tensor | None = None  # and the partner of each sample
        self._original: Any = None
        self._replacement: Any = None

    @property
    def interpolates_loss(self) -> bool:
        return self.interpolate_loss

    def mix_inputs(
        self, inputs: torch.Tensor, permutation: torch.Tensor, lam: float, generator: torch.Generator
    ) -> tuple[torch.Tensor, float]:
        """Return mixed inputs and the weight of each sample's own content in them."""
        raise NotImplementedError

    def match(self, event: Event, state: State) -> bool:
        if event == Event.BEFORE_FORWARD:
            return True
        if self.interpolate_loss:
            return event == Event.AFTER_LOSS
        return event in (Event.BEFORE_LOSS, Event.AFTER_BACKWARD)

    def apply(self, event: Event, state: State, logger: Any) -> None:
        if event == Event.BEFORE_FORWARD:
            inputs = get_item(state.batch, self.input_key)
            generator = self.generator(state)
            permutation = torch.randperm(inputs.shape[0], generator=generator)
            lam = sample_beta(self.alpha, generator)
            mixed, self.mixing = self.mix_inputs(inputs, permutation.to(inputs.device), lam, generator)
            self.permutation = permutation
            state.batch = set_item(state.batch, self.input_key, mixed)
        elif event == Event.BEFORE_LOSS:
            # Mixed here rather than before the forward so the model's forward still sees the dataset's
            # targets, and so that num_classes can come from the outputs.
            targets = get_item(state.batch, self.target_key)
            mixed = self._mix_targets(targets, state.outputs)
            self._original, self._replacement = targets, mixed
            state.batch = set_item(state.batch, self.target_key, mixed)
        elif event == Event.AFTER_BACKWARD:
            # Put the dataset's targets back for metrics and callbacks; algorithms undo in reverse
            # order on AFTER_* events, so LabelSmoothing's change on top of ours is undone first.
            if self._replacement is not None and get_item(state.batch, self.target_key) is self._replacement:
                state.batch = set_item(state.batch, self.target_key, self._original)
            self._original = self._replacement = None
        elif event == Event.AFTER_LOSS:
            # The permuted term uses the targets as the loss saw them (smoothed by LabelSmoothing,
            # which puts them back only at AFTER_BACKWARD), whatever the algorithms' order.
            targets = get_item(state.batch, self.target_key)
            assert self.permutation is not None and self.mixing is not None
            permuted = set_item(state.batch, self.target_key, targets[self.permutation.to(targets.device)])
            other = compute_loss(state, state.outputs, permuted)
            state.loss = self.mixing * state.loss + (1.0 - self.mixing) * other

    def _mix_targets(self, targets: torch.Tensor, outputs: Any) -> torch.Tensor:
        assert self.permutation is not None and self.mixing is not None
        num_classes = self.num_classes
        if num_classes is None:
            if not isinstance(outputs, torch.Tensor):
                raise ValueError(
                    f"{type(self).__name__} cannot infer num_classes from outputs of type "
                    f"{type(outputs).__name__}; pass num_classes="
                )
            num_classes = outputs.shape[-1]
        dtype = outputs.dtype if isinstance(outputs, torch.Tensor) and outputs.is_floating_point() else torch.float32
        soft = soft_targets(targets, num_classes, dtype)
        return self.mixing * soft + (1.0 - self.mixing) * soft[self.permutation.to(soft.device)]
