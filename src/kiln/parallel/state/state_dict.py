"""Full, unwrapped state dicts under every strategy, through DCP's state_dict helpers."""

from __future__ import annotations

from typing import Any, Literal, Protocol, overload

import torch
from torch import nn

__all__ = ["full_model_state_dict"]

# torch's key for what a module's get_extra_state returns (nn.Module's _EXTRA_STATE_KEY_SUFFIX):
# a module's own extra state, any picklable object (a HuggingFaceModel's is its config as JSON).
_EXTRA_STATE = "_extra_state"


class Engine(Protocol):
    """What this reads of a :class:`kiln.Engine` (the layer above the strategies: a protocol, not an
    import): its wrapped model and the strategy that knows its layout."""

    model: nn.Module
    strategy: Any


@overload
def full_model_state_dict(
    model: nn.Module | Engine, *, extra_state: Literal[False] = False
) -> dict[str, torch.Tensor]: ...
@overload
def full_model_state_dict(model: nn.Module | Engine, *, extra_state: bool) -> dict[str, Any]: ...
def full_model_state_dict(model: nn.Module | Engine, *, extra_state: bool = False) -> dict[str, Any]:
    """The model's full weights: no ``module.`` prefixes, no DTensors, on every rank.

    Works for plain modules, DDP, FSDP2 and DTensor-parallel models alike, because
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` knows each of them. Given a
    kiln Engine it asks the Engine's strategy, which also covers DeepSpeed (fp32 master weights,
    gathered from ZeRO partitions).

    Every value is a ``torch.Tensor`` (parameters and buffers), so ``{k: v.cpu() for k, v in
    sd.items()}`` works under every strategy. A module's extra state (``get_extra_state``, kept
    under a key ending in ``_extra_state``: a :class:`kiln.models.HuggingFaceModel`'s class and
    config as JSON) is left out unless ``extra_state=True``; checkpoints keep it either way, and
    ``kiln checkpoint export --hf`` writes the config from there.

    Args:
        model: a module (wrapped by any strategy) or a kiln Engine.
        extra_state: also return the modules' extra state, as the objects they gave (not tensors).

    Example::

        sd = kiln.parallel.full_model_state_dict(engine.model)  # or (engine), under any strategy
        cpu = {k: v.cpu() for k, v in sd.items()}
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not isinstance(model, nn.Module):  # a kiln Engine: its strategy knows the layout
        module = model.model
        weights, extras = _split(model.strategy.state_dict(module, None, full=True)["model"])
    else:
        module = model
        weights, extras = _split(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
    gather = getattr(module, "gather_full_state_dict", None)
    if gather is not None:  # a pipeline stage holds only its layers: collect every stage's
        weights = gather(weights)
    weights = {k: _plain(v) for k, v in weights.items()}
    return {**weights, **extras} if extra_state else weights


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(weights, extra state)`` of a state dict: the entries of modules' get_extra_state apart."""
    weights: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for key, value in state.items():
        is_extra = key == _EXTRA_STATE or key.endswith("." + _EXTRA_STATE)
        (extras if is_extra else weights)[key] = value
    return weights, extras


def _plain(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    return value
