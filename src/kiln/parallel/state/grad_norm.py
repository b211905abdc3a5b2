"""Global gradient-norm clipping when gradients are sharded (FSDP2, tensor and pipeline parallel).

``torch.nn.utils.clip_grad_norm_`` refuses a mix of plain tensors and DTensors, and DTensors on
different meshes (FSDP x TP leaves some parameters on the data-parallel mesh only), and it knows
nothing of pipeline stages on other ranks. Here the gradients are grouped by (mesh, placements);
each group's norm is a DTensor reduction that ``full_tensor()`` completes over exactly the ranks
that hold shards of it (a replicated placement is not summed twice); the groups combine locally;
pipeline stages combine with one all-reduce. A tied weight's copies on a pipeline's stages hold the
same gradient once they are summed (:mod:`kiln.parallel.pipelining.tied_weights`): the norm counts
the first stage's copy only (``uncounted`` names the others), as one process counts the one weight.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist

from kiln.launch.context import context

__all__ = ["clip_grad_norm_", "total_grad_norm"]


@torch.no_grad()
def total_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
    uncounted: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """The norm of all gradients of the model, across shards and pipeline stages, as a plain tensor;
    the gradients of ``uncounted`` (copies of a tied weight counted elsewhere) are left out."""
    from torch.distributed.tensor import DTensor

    norm_type = float(norm_type)
    skipped = {id(p) for p in uncounted}
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is None or id(p) in skipped:
            continue
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else g.device
        groups.setdefault(key, []).append(g)
    norms = []
    for grads in groups.values():
        dims = _reduced_dims(grads[0])
        if len(dims) > 1:
            norms.append(_norm_over_dims(grads, norm_type, dims))
            continue
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # the reduction over the ranks holding this group's shards
        norms.append(norm)
    # at least float32 (bf16 norms of many shards lose digits), float64 when the gradients are
    dtype = functools.reduce(torch.promote_types, (n.dtype for n in norms), torch.float32)
    norms = [n.to(dtype) for n in norms]
    # a stage without gradients still joins the stages' all-reduce, on the device the backend syncs
    device = norms[0].device if norms else context().device
    if math.isinf(norm_type):
        total = torch.stack(norms).max() if norms else torch.zeros((), device=device)
        if pp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        return total
    # sum of norm**p over groups (and stages), then the p-th root
    powered = torch.stack([n.pow(norm_type) for n in norms]).sum() if norms else torch.zeros((), device=device)
    if pp_group is not None:
        dist.all_reduce(powered, group=pp_group)
    return powered.pow(1.0 / norm_type)


def _reduced_dims(grad: torch.Tensor) -> list[int]:
    # the mesh dimensions (of more than one rank) that a DTensor gradient is split over
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return []
    mesh = grad.device_mesh
    return [i for i, p in enumerate(grad.placements) if not p.is_replicate() and mesh.size(i) > 1]


def _norm_over_dims(grads: list[torch.Tensor], norm_type: float, dims: list[int]) -> torch.Tensor:
    """The norm of gradients split over several mesh dimensions (FSDP x TP, experts over efsdp x
    ep): each rank's local norm, combined over each dimension's group in turn, as DTensor's
    ``full_tensor()`` of the norm would, without its warning that the dimensions are not one
    flattened group (the same collectives: one small all-reduce per dimension)."""
    mesh = grads[0].device_mesh  # type: ignore[attr-defined]  # a DTensor: _reduced_dims found dims
    local = torch.nn.utils.get_total_norm([g.to_local() for g in grads], norm_type)  # type: ignore[attr-defined]
    if math.isinf(norm_type):
        for dim in dims:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        return local
    powered = local.pow(norm_type)
    for dim in dims:
        dist.all_reduce(powered, group=mesh.get_group(dim))
    return powered.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
    uncounted: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """Scale gradients so that their global norm is at most ``max_norm``; returns the norm before.
    The gradients of ``uncounted`` are scaled too but left out of the norm (a pipeline's copies of
    a tied weight but the one the norm counts).

    Example::

        norm = clip_grad_norm_(model.parameters(), 1.0)   # DTensor and plain gradients alike
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, norm_type, pp_group, uncounted)
    # Same coefficient as torch.nn.utils.clip_grads_with_norm_; scaling the local shards scales the
    # whole DTensor, and avoids DTensor's refusal of a plain scalar tensor operand.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        assert grad is not None  # params are the parameters with a gradient
        # under no_grad, to_local() is the DTensor's own local tensor, so mul_ reaches the shard
        g = grad.to_local() if isinstance(grad, DTensor) else grad
        by_device.setdefault(g.device, []).append(g)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(device))
    return total
