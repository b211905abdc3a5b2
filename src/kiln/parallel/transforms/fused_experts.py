"""Tensor parallelism of fused mixture-of-experts weights (transformers' Mixtral-style experts).

transformers 5 stores a MoE layer's experts as two 3-D parameters of one module
(``MixtralExperts``): ``gate_up_proj`` ``(experts, 2 * intermediate, hidden)``, the gate and the up
projection of every expert stacked (the gate's rows first), and ``down_proj``
``(experts, hidden, intermediate)``. Its config's ``base_model_tp_plan`` names them
``packed_colwise``, ``rowwise`` and ``moe_tp_experts``, transformers' own styles, which torch's
``parallelize_module`` does not know. The ``"fused_experts"`` style does what they mean, on DTensor:

* ``gate_up_proj`` is split over the intermediate dimension, the gate's rows and the up rows alike,
  so each rank holds ``[gate_r; up_r]`` of every expert (``_StridedShard(1, split_factor=2)``: the
  global tensor keeps transformers' layout, so checkpoints and Hugging Face exports are unchanged);
  ``down_proj`` is split over its input (``Shard(2)``);
* the module's forward (transformers' own, whichever experts implementation the config picks) runs
  on the local weights: each rank computes every token's routed experts over its slice of the
  intermediate dimension, and the outputs, partial sums, are all-reduced over the ranks;
* the inputs (the tokens and their routing weights, the same on every rank) get their gradients
  summed over the ranks in the backward (each rank's experts see a part of them), as a column-wise
  layer's input does.

The router stays whole on every rank. The intermediate size must divide by the tensor-parallel size.

``FusedExpertsParallel(partial_output=True)`` (style ``"fused_experts_partial"``) leaves the outputs
unsummed: each rank's partial sum comes back as a ``Partial()`` DTensor, for a caller that sums it
itself (sequence parallelism's MoE block reduce-scatters it to the sequence shards,
:func:`kiln.models.tp_plan.huggingface_sequence_parallel_plan`). Its gradient is the whole one
on every rank, as a sum's is.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import nn

__all__ = ["FusedExpertsParallel", "is_fused_experts"]


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds fused experts this style splits: 3-D ``gate_up_proj`` and
    ``down_proj`` parameters and no others (no biases)."""
    names = {name for name, _ in module.named_parameters(recurse=False)}
    return names == {"gate_up_proj", "down_proj"} and all(
        getattr(module, n).dim() == 3 for n in ("gate_up_proj", "down_proj")
    )


def FusedExpertsParallel(*, partial_output: bool = False) -> Any:  # noqa: N802  # a style, named as torch's are
    """The ``ParallelStyle`` of fused experts (see the module docstring): the outputs all-reduced, or
    with ``partial_output`` each rank's partial sum as a ``Partial()`` DTensor. (Its class is made on
    first use: importing this module imports no tensor-parallel code.)"""
    return _style_class()(partial_output=partial_output)


class _LocalView:
    """The experts module as its forward sees it, with the local weights in place of the
    DTensor parameters (a parameter attribute cannot hold a plain tensor)."""

    def __init__(self, module: nn.Module, local: dict[str, torch.Tensor]) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_local", local)

    def __getattr__(self, name: str) -> Any:
        local = object.__getattribute__(self, "_local")
        return local[name] if name in local else getattr(object.__getattribute__(self, "_module"), name)


@functools.cache
def _style_class() -> type:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.distributed.tensor.placement_types import _StridedShard

    class _FusedExpertsParallel(ParallelStyle):
        def __init__(self, *, partial_output: bool) -> None:
            super().__init__()
            self.partial_output = partial_output

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            if not is_fused_experts(module):
                raise ValueError(
                    f"tensor-parallel style 'fused_experts' selects a {type(module).__name__}, which does not hold "
                    "exactly 3-D gate_up_proj and down_proj parameters (transformers' fused experts); point it at "
                    "such a module, or write a plan for this one"
                )
            tp = device_mesh.size()
            inter = cast(torch.Tensor, module.down_proj).shape[2]
            if inter % tp:
                raise ValueError(
                    f"tensor-parallel size {tp} does not divide the experts' intermediate size {inter} of "
                    f"{type(module).__name__}; use a tp that divides {inter}"
                )
            placements = {"gate_up_proj": (_StridedShard(1, split_factor=2),), "down_proj": (Shard(2),)}
            for name, placement in placements.items():
                param = getattr(module, name)
                module.register_parameter(
                    name, nn.Parameter(distribute_tensor(param, device_mesh, placement), param.requires_grad)
                )
            forward = type(module).forward

            def summed_in_backward(value: Any) -> Any:
                # the same on every rank forward; its gradient is the sum of the ranks' parts
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    return value
                whole = DTensor.from_local(value, device_mesh, (Replicate(),), run_check=False)
                return whole.to_local(grad_placements=(Partial(),))

            def local_forward(*args: Any, **kwargs: Any) -> Any:
                local = {name: getattr(module, name).to_local() for name in placements}
                args = tuple(summed_in_backward(a) for a in args)
                kwargs = {k: summed_in_backward(v) for k, v in kwargs.items()}
                out = forward(_LocalView(module, local), *args, **kwargs)
                summed = DTensor.from_local(out, device_mesh, (Partial(),), run_check=False)
                if self.partial_output:  # the caller sums it (its backward hands every rank the whole gradient)
                    return summed
                return summed.redistribute(placements=(Replicate(),)).to_local()

            module.forward = local_forward  # an instance attribute: this module only
            return module

    return _FusedExpertsParallel
