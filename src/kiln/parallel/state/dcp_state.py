"""Model and optimizer state under every strategy, through DCP's ``get_state_dict``/``set_state_dict``.

These are the helpers the checkpoint layer builds on. A *sharded* state (the default) holds this
rank's DTensor shards under the parameters' original names, so ``torch.distributed.checkpoint``
saves it without gathering and loads it into any other world size or strategy. The optimizer state
is in DCP's flattened form (``state.<param name>.<key>``, ``param_groups.<param name>.<key>``):
every entry is keyed by a parameter name, so ranks holding different parameters (ZeRO-1 shards,
pipeline stages) write and read disjoint keys.

Example::

    import torch.distributed.checkpoint as dcp
    dcp.save(get_state_dict(engine.model, engine.optimizer), checkpoint_id=path)
    state = get_state_dict(model, optimizer)          # the template: shapes and shards to fill
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, state)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["model_state_dict", "optimizer_state_dict", "get_state_dict", "set_state_dict"]


def _options(full: bool, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, flatten_optimizer_state_dict=True, strict=strict)


def _zero(optimizer: torch.optim.Optimizer | None):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None


def model_state_dict(model: nn.Module, *, full: bool = False) -> dict[str, Any]:
    """The model's state: this rank's shards (``full=False``) or whole tensors on every rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full))


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool = False) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (DCP's flattened form).

    Under ``zero1`` each rank holds the state of its own parameters; ``full=True`` gathers all of
    them on every rank.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    zero = _zero(optimizer)
    if zero is not None:
        # the local optimizer receives the groups' hyperparameters only at the next step: a scheduler
        # may have changed the learning rate since
        zero._sync_param_groups(zero.param_groups, zero.optim.param_groups)
    local = get_optimizer_state_dict(model, zero.optim if zero else optimizer, options=_options(full))
    if zero is None or not full or not dist.is_initialized():
        return local
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in local.items()})
    return {k: v for part in parts for k, v in part.items()}


def get_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, full: bool = False
) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}``, ready for ``torch.distributed.checkpoint.save``."""
    state: dict[str, Any] = {"model": model_state_dict(model, full=full)}
    if optimizer is not None:
        state["optimizer"] = optimizer_state_dict(model, optimizer, full=full)
    return state


def set_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    *,
    full: bool = False,
    strict: bool = True,
) -> None:
    """Load what :func:`get_state_dict` returned (after ``dcp.load`` filled it) into model and optimizer.

    Args:
        full: the state holds whole tensors (every rank has all of them) rather than shards.
        strict: every model key must be present (as ``nn.Module.load_state_dict``).
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if "model" in state:
        set_model_state_dict(model, state["model"], options=_options(full, strict))
    if optimizer is None or "optimizer" not in state:
        return
    zero = _zero(optimizer)
    set_optimizer_state_dict(
        model, zero.optim if zero else optimizer, state["optimizer"], options=_options(full, strict)
    )
    if zero is not None:
        # ZeroRedundancyOptimizer copies its own groups' hyperparameters into the local optimizer
        # before each step; give them the loaded values so they are not overwritten.
        zero._sync_param_groups(zero.optim.param_groups, zero.param_groups)
