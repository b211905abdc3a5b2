"""Point the user's optimizer at the parameters a strategy created, keeping the optimizer object.

FSDP2 and tensor parallelism replace each ``nn.Parameter`` with a new DTensor parameter, and a
pipeline stage keeps only some of the parameters. Rather than building a new optimizer, kiln
edits the user's one in place (Accelerate does the same for FSDP2): the hyperparameters of every
param group stay, and so does the object, so an LR scheduler the user built on it still drives it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["parameter_names", "repoint_optimizer"]


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(param) -> fully qualified name``, taken before a strategy replaces the parameters."""
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}


def repoint_optimizer(
    optimizer: torch.optim.Optimizer | None,
    old_names: Mapping[int, str],
    new_params: Mapping[str, nn.Parameter],
    *,
    strategy: str,
    drop_missing: bool = False,
) -> None:
    """Replace, in every param group, each old parameter by the new one of the same name.

    Args:
        optimizer: the user's optimizer (``None``: nothing to do).
        old_names: :func:`parameter_names` of the model before the strategy touched it.
        new_params: name -> parameter after it (``dict(model.named_parameters())``).
        strategy: the strategy's name, for error messages.
        drop_missing: drop parameters that are not in ``new_params`` (a pipeline stage holds only
            its own layers) instead of raising.
    """
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = old_names.get(id(p))
            if optimizer.state.get(p) and name is not None and new_params.get(name, p) is not p:
                # The state is full-size tensors keyed by the old parameter: sharding it here would be
                # a second, hidden checkpoint format. Building the Engine first avoids the question.
                raise ValueError(
                    f"strategy={strategy!r} got an optimizer that already has state (it has "
                    "stepped); create the Engine/Trainer before the first optimizer step, or load "
                    "the optimizer state afterwards with kiln.parallel.state.dcp_state.set_state_dict"
                )
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = old_names.get(id(p))
            if name is None:
                raise ValueError(
                    f"strategy={strategy!r}: the optimizer holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the model; build the optimizer from model.parameters()"
                )
            if name in new_params:
                params.append(new_params[name])
            elif drop_missing:
                optimizer.state.pop(p, None)  # another pipeline stage owns it now
            else:
                raise ValueError(
                    f"strategy={strategy!r}: parameter {name!r} disappeared from the model while "
                    "it was being parallelised"
                )
        group["params"] = params
    # the fused/foreach choice kiln made for the old parameters may not suit the new ones (a
    # pipeline stage's mix of tensor-parallel DTensors and plain tensors takes no foreach step)
    from kiln.optim.implementation import refresh_default_implementation

    refresh_default_implementation(optimizer)
