"""Seconds of one step's communication and recomputation under a data-parallel strategy: the part
of the cost model that ``strategy="auto"`` ranks its candidates by (:mod:`kiln.cost.memory`), with
the same constants (:mod:`kiln.cost.devices`) and ring-collective rule as ``kiln plan --search``
(:mod:`kiln.planning.search`)."""

from __future__ import annotations

from kiln.cost.devices import COMPUTE_EFFICIENCY, DeviceClass

__all__ = ["data_parallel_seconds"]

# (all-reduced gradients, gathered parameters, reduce-scattered gradients) per step, in units of
# their bytes, of the data-parallel strategies strategy="auto" chooses among (kiln.cost.memory):
# DDP all-reduces the gradients; ZeRO-1 (ZeroRedundancyOptimizer over DDP) also gathers the updated
# parameters; FSDP reduce-scatters the gradients and gathers the parameters once (zero2: kept from
# forward to backward) or twice (zero3: again for the backward).
_DATA_PARALLEL_TRAFFIC = {
    "single": (0, 0, 0),
    "ddp": (1, 0, 0),
    "zero1": (1, 1, 0),
    "zero2": (0, 1, 1),
    "zero3": (0, 2, 1),
}


def data_parallel_seconds(
    strategy: str,
    param_bytes: int,
    grad_bytes: int,
    world_size: int,
    device: DeviceClass,
    *,
    devices_per_node: int | None = None,
    recompute_flops: float = 0.0,
) -> float | None:
    """Seconds of one step's communication and recomputation under a data-parallel strategy, by the
    cost model of :func:`search` (ring collectives over the link the world crosses; the recomputed
    forward of activation checkpointing at ``COMPUTE_EFFICIENCY`` of the peak). None for a strategy
    it does not price (``tp``). The compute every candidate shares is left out: it does not rank."""
    if strategy not in _DATA_PARALLEL_TRAFFIC:
        return None
    all_reduce, gather, reduce_scatter = _DATA_PARALLEL_TRAFFIC[strategy]
    n = max(world_size, 1)
    ring = (n - 1) / n
    inside = n <= (devices_per_node or device.devices_per_node)
    bandwidth = device.intra_node_bw if inside else device.inter_node_bw
    moved = ring * (2 * all_reduce * grad_bytes + gather * param_bytes + reduce_scatter * grad_bytes)
    return moved / bandwidth + recompute_flops / (device.bf16_flops * COMPUTE_EFFICIENCY)
