"""DeepSpeed ZeRO through ``deepspeed.initialize``, for users who bring a ``deepspeed_config``.

kiln's own ``zero1``/``zero2``/``zero3`` need nothing beyond torch; this strategy exists so a
DeepSpeed JSON config (reference doc 002) keeps working. DeepSpeed is optional: without it the
strategy says so when it is created, before any process group or model is touched.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from kiln.parallel.strategy import Strategy

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = ["DeepSpeed"]


def _require_deepspeed() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError("strategy='deepspeed' needs the 'deepspeed' package, which is not installed: "
                          "run `pip install deepspeed`, or use strategy='zero1', 'zero2' or 'zero3', which need "
                          "only torch")


class DeepSpeed(Strategy):
    """Model and optimizer wrapped by ``deepspeed.initialize(model, optimizer, config=...)``.

    The DeepSpeed engine owns loss scaling, gradient accumulation and clipping, as configured in
    ``deepspeed_config`` (its ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
    ``zero_optimization``, ``fp16``/``bf16`` sections); set kiln's own ``precision``,
    ``gradient_accumulation`` and ``clip_grad_norm`` to their defaults. Not exercised in kiln's test
    suite beyond the missing-package error: DeepSpeed is not installed there. Known gap: the Engine
    still calls ``loss.backward()`` and ``optimizer.step()``, while DeepSpeed's ZeRO expects its own
    ``engine.backward(loss)`` and ``engine.step()``; until the Engine delegates those two calls to
    the strategy, treat this strategy as unfinished.

    Args:
        deepspeed_config: a dict, or the path of a DeepSpeed JSON file.

    Example::

        engine, *_ = kiln.initialize(model, opt, config={"strategy": {"name": "deepspeed",
                                     "deepspeed_config": "ds_zero2.json"}})
    """

    name = "deepspeed"

    def __init__(self, deepspeed_config: Mapping[str, Any] | str | Path | None = None, **config: Any) -> None:
        _require_deepspeed()
        if isinstance(deepspeed_config, (str, Path)):
            with open(deepspeed_config) as f:
                deepspeed_config = json.load(f)
        self.config = {**dict(deepspeed_config or {}), **config}

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Context,
              precision: Precision) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        import deepspeed

        if precision.name != "fp32":
            raise ValueError(f"strategy='deepspeed' with precision={precision.name!r}: set precision in the "
                             "deepspeed_config ('fp16'/'bf16' sections) and leave kiln's precision at fp32")
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config)
        return engine, ds_optimizer

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        # DeepSpeed accumulates by its own gradient_accumulation_steps; nothing to switch here.
        pass

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise ValueError("strategy='deepspeed' clips inside DeepSpeed: set 'gradient_clipping' in deepspeed_config "
                         "and leave kiln's clip_grad_norm unset")

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "deepspeed_config": self.config}
