"""The gradients of replicated tensor-parallel parameters, summed over their ranks once a step.

Under sequence parallelism the norms' weights are ``Replicate()`` DTensors applied to sequence
shards: each rank's backward gives the gradient of its shard of the sequence, so ``.grad`` is a
``Partial(sum)`` DTensor. Nothing in tensor parallelism sums it; DTensor does it lazily, inside
every op that meets it with a replicated tensor: each optimizer op reads it with its own
all-reduce (AdamW: three a parameter, ``lerp_`` once and ``addcmul_`` twice, its two operands;
clipping's norm one more), and clipping would measure it first. FSDP2 sums such gradients itself
(one all-reduce over the tensor-parallel group in its reduce-scatter); without FSDP nothing did.

:func:`reduce_partial_grads` makes each ``Partial(sum)`` gradient of a parameter replicated on that
mesh dimension whole: the local gradients of one mesh, dimension set and dtype flattened into one
buffer, all-reduced once over each partial dimension's group, and handed back as DTensors of the
parameter's placements. A gradient that is already whole is left alone, so calling it again (the
strategy's fallback before clipping and the step) moves nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["reduce_partial_grads"]


def _sum_partial_dims(param: DTensor, grad: DTensor) -> tuple[int, ...] | None:
    """The mesh dimensions on which ``grad`` is ``Partial(sum)`` where ``param`` is replicated, when
    every other dimension already has the parameter's placement; None when the gradient needs
    something else (another reduction, a reduce-scatter): DTensor's own redistribution then."""
    dims = []
    for i, (want, got) in enumerate(zip(param.placements, grad.placements, strict=True)):
        if got == want:
            continue
        if got.is_partial() and want.is_replicate() and getattr(got, "reduce_op", None) == "sum":
            dims.append(i)
            continue
        return None
    return tuple(dims)


@torch.no_grad()
def reduce_partial_grads(parameters: Iterable[torch.Tensor]) -> int:
    """Sum every partial gradient of ``parameters`` over its ranks, once; returns how many were.

    Example::

        loss.backward()
        reduce_partial_grads(model.parameters())   # the norms' gradients whole before clipping
    """
    from torch.distributed.tensor import DTensor

    # (mesh, partial dimensions, dtype, device) -> the parameters whose gradients share one buffer
    buckets: dict[tuple[int, tuple[int, ...], torch.dtype, torch.device], list[DTensor]] = {}
    count = 0
    for p in parameters:
        grad = p.grad
        if not isinstance(p, DTensor) or not isinstance(grad, DTensor):
            continue
        if not any(placement.is_partial() for placement in grad.placements):
            continue
        count += 1
        dims = _sum_partial_dims(p, grad)
        if dims is None:
            p.grad = grad.redistribute(grad.device_mesh, p.placements)
            continue
        local = grad.to_local()
        buckets.setdefault((id(grad.device_mesh), dims, local.dtype, local.device), []).append(p)
    for (_, dims, _, _), params in buckets.items():
        grads: list[DTensor] = [p.grad for p in params]  # type: ignore[misc]  # DTensors: bucketed above
        mesh = grads[0].device_mesh
        # under no_grad, to_local() is the gradient's own local tensor: the sum is copied into it
        locals_ = [g.to_local() for g in grads]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim in dims:
            dist.all_reduce(flat, group=mesh.get_group(dim))
        for p, g, local, part in zip(params, grads, locals_, flat.split([t.numel() for t in locals_]), strict=True):
            local.copy_(part.view_as(local))
            p.grad = DTensor.from_local(local, mesh, p.placements, run_check=False, shape=g.shape, stride=g.stride())
    return count
