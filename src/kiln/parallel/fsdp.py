"""ZeRO stages 2 and 3 with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Parameters, gradients and optimizer state are sharded over the data-parallel ranks. Each wrapped
block all-gathers its parameters just before its forward and reduce-scatters its gradients just
after its backward, so communication overlaps compute block by block. ``zero3`` frees the gathered
parameters after the forward (gathered again for the backward: least memory); ``zero2`` keeps them
until the backward (one all-gather less per step, full-size parameters during the step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.parallel.state.grad_norm import clip_grad_norm_
from kiln.parallel.state.mesh import ParallelDims, dp_coordinate
from kiln.parallel.strategy import Strategy
from kiln.parallel.transforms.parallelize import ParallelizePlan, WrapSpec, _as_list, find_blocks

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = ["FSDP", "Zero2", "Zero3"]


class FSDP(Strategy):
    """Fully sharded data parallel (FSDP2) over all ranks: ``zero3`` (alias ``fsdp``) by default.

    The optimizer keeps its class, param groups and hyperparameters and is pointed at the sharded
    DTensor parameters in place (build it before the Engine; it must not have stepped yet).

    Args:
        reshard_after_forward: free the gathered parameters after each block's forward (ZeRO-3,
            least memory) or keep them for the backward (ZeRO-2, one all-gather less).
        wrap: which modules get their own ``fully_shard``: classes, class names or name patterns
            (see :func:`kiln.parallel.transforms.parallelize.find_blocks`); default: the model's indexed blocks.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.

    Example::

        engine, *_ = kiln.initialize(model, opt, config={"strategy": {"name": "zero3", "wrap": ["Block"]}})
    """

    name = "fsdp"
    steps = ("placement", "float8", "activation_checkpointing", "compile", "data_parallel")
    default_reshard = True

    def __init__(
        self, *, reshard_after_forward: bool | None = None, wrap: WrapSpec = None, cpu_offload: bool = False
    ) -> None:
        self.reshard_after_forward = (
            self.default_reshard if reshard_after_forward is None else bool(reshard_after_forward)
        )
        self.wrap = wrap
        self.cpu_offload = bool(cpu_offload)
        self.data_parallel_rank, self.data_parallel_size = 0, 1

    def parallelize_plan(self, model: nn.Module, ctx: Context, precision: Precision) -> ParallelizePlan:
        blocks = find_blocks(model, self.wrap)  # user errors first, before any collective
        plan = ParallelizePlan.on_mesh(
            ParallelDims(dp_shard=ctx.world_size),
            ctx=ctx,
            precision=precision,
            options=self.parallelize_options,
            blocks=blocks,
            cpu_offload=self.cpu_offload,
            reshard_after_forward=self.reshard_after_forward,
        )
        # every rank reads its own batch (a world of 1 has no mesh: sharding would only add hooks)
        assert plan.dims is not None  # on_mesh sets it
        self.data_parallel_rank, self.data_parallel_size = dp_coordinate(plan.mesh, plan.dims), plan.dims.dp
        return plan

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        # Without sync FSDP keeps each block's unsharded gradient and reduce-scatters the sum on the
        # synchronising backward: accumulation costs memory, not communication.
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "reshard_after_forward": self.reshard_after_forward,
            "wrap": [w if isinstance(w, str) else w.__name__ for w in _as_list(self.wrap)],
            "cpu_offload": self.cpu_offload,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(reshard_after_forward={self.reshard_after_forward}, cpu_offload={self.cpu_offload})"
        )


class Zero2(FSDP):
    """FSDP2 keeping gathered parameters from forward to backward (``strategy="zero2"``)."""

    name = "zero2"
    default_reshard = False


class Zero3(FSDP):
    """FSDP2 freeing gathered parameters after each forward (``strategy="zero3"``)."""

    name = "zero3"
    default_reshard = True
