"""Full, unwrapped state dicts under every strategy, through DCP's state_dict helpers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from kiln.engine import Engine

__all__ = ["full_model_state_dict"]


def full_model_state_dict(model: nn.Module | Engine) -> dict[str, torch.Tensor]:
    """The model's full state dict: no ``module.`` prefixes, no DTensors, on every rank.

    Works for plain modules, DDP, FSDP2 and DTensor-parallel models alike, because
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` knows each of them. Given a
    kiln Engine it asks the Engine's strategy, which also covers DeepSpeed (fp32 master weights,
    gathered from ZeRO partitions).

    Example::

        sd = kiln.parallel.full_model_state_dict(engine.model)  # or (engine), under any strategy
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not isinstance(model, nn.Module):  # a kiln Engine: its strategy knows the layout
        state = model.strategy.state_dict(model.model, None, full=True)["model"]
        return {k: _plain(v) for k, v in state.items()}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    gather = getattr(model, "gather_full_state_dict", None)
    if gather is not None:  # a pipeline stage holds only its layers: collect every stage's
        state = gather(state)
    return {k: _plain(v) for k, v in state.items()}


def _plain(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    return value
