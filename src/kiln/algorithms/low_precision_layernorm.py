"""LayerNorm in 16-bit under autocast, where torch would otherwise run it in float32."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.callback import Algorithm
from kiln.core.event import Event
from kiln.core.warn import KilnWarning

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["LowPrecisionLayerNorm", "LPLayerNorm"]


class LPLayerNorm(nn.LayerNorm):
    """An ``nn.LayerNorm`` that, inside autocast, runs in ``low_precision_dtype`` instead of float32."""

    low_precision_dtype: torch.dtype = torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            return super().forward(x)
        dtype = self.low_precision_dtype

        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(dtype)

        # autocast would cast layer_norm's inputs back up to float32; run it with autocast off.
        with torch.autocast(device, enabled=False):
            return F.layer_norm(x.to(dtype), self.normalized_shape, cast(self.weight), cast(self.bias), self.eps)


class _FP16LayerNorm(LPLayerNorm):
    low_precision_dtype = torch.float16


_CLASSES = {"amp_bf16": LPLayerNorm, "amp_fp16": _FP16LayerNorm}


class LowPrecisionLayerNorm(Algorithm):
    """Run every ``nn.LayerNorm`` in bf16 (or fp16) under mixed precision.

    Autocast keeps ``layer_norm`` in float32 for safety; for transformers that costs memory
    bandwidth and casts on every layer. This swaps each ``nn.LayerNorm``'s class for
    :class:`LPLayerNorm` at ``INIT`` (parameters and checkpoint keys unchanged), which runs the
    normalisation in the 16-bit dtype whenever autocast is on and exactly as before otherwise.
    It only has an effect with an ``amp_*`` precision; with another it warns and changes nothing.

    Events: ``INIT``, ``FIT_START``.

    Args:
        precision: ``"amp_bf16"`` or ``"amp_fp16"``: the dtype LayerNorm runs in.

    Example::

        trainer = kiln.Trainer(model, ..., precision="amp_bf16",
                               algorithms=[kiln.algorithms.LowPrecisionLayerNorm()])
    """

    def __init__(self, precision: str = "amp_bf16") -> None:
        if precision not in _CLASSES:
            raise ValueError(f"LowPrecisionLayerNorm(precision={precision!r}): expected one of {', '.join(_CLASSES)}")
        self.precision = precision
        self.num_replaced = 0
        self._done = False

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.INIT, Event.FIT_START) and not self._done

    def apply(self, event: Event, state: State, logger: Any) -> None:
        self._done = True
        if state.precision is not None and getattr(state.precision, "autocast_dtype", "?") is None:
            warnings.warn(
                f"LowPrecisionLayerNorm does nothing under precision {state.precision!r}: it needs autocast "
                "(precision='amp_bf16' or 'amp_fp16')",
                KilnWarning,
                stacklevel=2,
            )
            return
        subclass = _CLASSES[self.precision]
        for module in state.model.modules():
            if type(module) is nn.LayerNorm:  # exact type: subclasses may have their own forward
                module.__class__ = subclass
                self.num_replaced += 1
