"""Point the user's optimizer at the parameters a strategy created, keeping the optimizer object.

FSDP2 and tensor parallelism replace each ``nn.Parameter`` with a new DTensor parameter, and a
pipeline stage keeps only some of the parameters. Rather than building a new optimizer, kiln
edits the user's one in place (Accelerate does the same for FSDP2): the hyperparameters of every
param group stay, and so does the object, so an LR scheduler the user built on it still drives it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = ["parameter_names", "repoint_optimizer"]


def parameter_names(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """``id(param) -> its fully qualified names``, taken before a strategy replaces the parameters:
    a tied parameter has several (``embed_tokens.weight`` and ``lm_head.weight``), in
    ``named_parameters`` order. A pipeline's stages hold it under one name each (the first stage
    the embedding, the last the head: :mod:`kiln.parallel.pipelining.tied_weights`), so any name
    may be the one a stage keeps."""
    names: dict[int, tuple[str, ...]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names[id(p)] = (*names.get(id(p), ()), name)
    return names


def _names(value: str | Sequence[str] | None) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def repoint_optimizer(
    optimizer: torch.optim.Optimizer | None,
    old_names: Mapping[int, str | Sequence[str]],
    new_params: Mapping[str, nn.Parameter],
    *,
    strategy: str,
    drop_missing: bool = False,
) -> None:
    """Replace, in every param group, each old parameter by the new one of the same name: by each
    distinct new one under any of its names (a pipeline rank that holds both the first and the
    last stage holds a tied weight's two copies, each stepped).

    Args:
        optimizer: the user's optimizer (``None``: nothing to do).
        old_names: :func:`parameter_names` of the model before the strategy touched it (a name, or
            all the names of a tied parameter).
        new_params: name -> parameter after it (``dict(model.named_parameters())``).
        strategy: the strategy's name, for error messages.
        drop_missing: drop parameters that are not in ``new_params`` (a pipeline stage holds only
            its own layers) instead of raising.
    """
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            names = _names(old_names.get(id(p)))
            if optimizer.state.get(p) and any(new_params.get(name, p) is not p for name in names):
                # The state is full-size tensors keyed by the old parameter: sharding it here would be
                # a second, hidden checkpoint format. Building the Engine first avoids the question.
                raise ValueError(
                    f"strategy={strategy!r} got an optimizer that already has state (it has "
                    "stepped); create the Engine/Trainer before the first optimizer step, or load "
                    "the optimizer state afterwards with kiln.parallel.state.dcp_state.set_state_dict"
                )
    for group in optimizer.param_groups:
        params: list[torch.Tensor] = []
        for p in group["params"]:
            names = _names(old_names.get(id(p)))
            if not names:
                raise ValueError(
                    f"strategy={strategy!r}: the optimizer holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the model; build the optimizer from model.parameters()"
                )
            found = {id(new_params[n]): new_params[n] for n in names if n in new_params}
            if found:
                params.extend(found.values())
            elif drop_missing:
                optimizer.state.pop(p, None)  # another pipeline stage owns it now
            else:
                raise ValueError(
                    f"strategy={strategy!r}: parameter {names[0]!r} disappeared from the model while "
                    "it was being parallelised"
                )
        group["params"] = params
    # the fused/foreach choice kiln made for the old parameters may not suit the new ones (a
    # pipeline stage's mix of tensor-parallel DTensors and plain tensors takes no foreach step)
    from kiln.optim.implementation import refresh_default_implementation

    refresh_default_implementation(optimizer)
