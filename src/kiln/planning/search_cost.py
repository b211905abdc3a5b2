"""The price of a searched plan and the order it gives: :func:`price_plan` fills a
:class:`~kiln.planning.search_plan.SearchPlan`'s memory (:mod:`kiln.planning.search_memory`),
collectives (:mod:`kiln.planning.search_collectives`) and the seconds of one optimizer step,
``compute + communication + bubble``; :func:`rank` sorts plans cheapest first.

* compute: the stage's FLOPs (``(6 + 2 if checkpointed) x`` parameters per token, the attention's
  ``12 x layers x seq x heads x head_dim``, the LM head on each tensor-parallel rank, its vocabulary
  shard where it is split) over ``bf16_flops x COMPUTE_EFFICIENCY`` of :mod:`kiln.cost.devices`;
* communication: each collective's bytes over the bandwidth of the link its mesh dimension crosses
  (inside a node when the dimension's group fits in ``devices_per_node``, else the network), as a
  ring moves them: all-gather, reduce-scatter and broadcast ``(n-1)/n x bytes``, all-reduce twice
  that, point-to-point the bytes. Nothing is overlapped;
* bubble: ``(pp - 1) / microbatches`` of the compute (1F1B), ``(pp - 1) / (2 x microbatches)``
  interleaved (2 stages a rank: each idle slot is half a rank's layers).

:func:`price_communication` prices a plan's step again once a dry run replaced its collectives
(:mod:`kiln.planning.confirm`).
"""

from __future__ import annotations

import math

from kiln.cost.devices import COMPUTE_EFFICIENCY, DeviceClass
from kiln.planning.search_collectives import plan_collectives
from kiln.planning.search_memory import plan_memory, stage_params
from kiln.planning.search_plan import SearchPlan, SearchResult
from kiln.planning.search_shape import ModelShape

__all__ = ["price_plan", "price_communication", "rank"]

# A ring's share of a collective's bytes over each rank's link (kiln.planning.comm_count's sizes)
_RING = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "broadcast": 1.0, "all_to_all": 1.0}


def price_plan(
    shape: ModelShape,
    plan: SearchPlan,
    device: DeviceClass,
    world_size: int,
    global_batch: int,
    seq_len: int,
    precision: str,
    optimizer_factor: int,
    devices_per_node: int,
) -> None:
    """Fill ``plan``'s memory, activation moments, collectives, seconds and tokens per second."""
    dp, tp, pp, m, v = plan.dp_shard, plan.tp, plan.pp, plan.microbatches, plan.stages_per_rank
    ckpt = plan.activation_checkpointing is not None
    mbs = plan.micro_batch_size
    memory = plan_memory(
        shape,
        dp=dp,
        tp=tp,
        pp=pp,
        checkpointing=ckpt,
        micro_batch_size=mbs,
        microbatches=m,
        seq_len=seq_len,
        precision=precision,
        optimizer_factor=optimizer_factor,
        stages_per_rank=v,
    )
    plan.memory = {
        "params": memory.params,
        "grads": memory.grads,
        "optimizer": memory.optimizer,
        "activations": memory.activations,
        "total": memory.total,
    }
    plan.activation_moments = dict(memory.moments)
    plan.collectives = plan_collectives(
        shape,
        dp=dp,
        tp=tp,
        pp=pp,
        checkpointing=ckpt,
        micro_batch_size=mbs,
        microbatches=m,
        seq_len=seq_len,
        precision=precision,
        stages_per_rank=v,
    )

    # compute: FLOPs of the stage on this rank's tokens
    layers = math.ceil(shape.num_layers / pp)
    _, _, layer_tp = stage_params(shape, tp, pp, shape.vocab_split_at(tp, pp))
    q = shape.heads * shape.head_dim
    tokens = global_batch * seq_len // dp
    fwd_per_token = 2 * layers * layer_tp + 4 * layers * seq_len * q // tp
    # the LM head: whole on each tensor-parallel rank, or its vocabulary shard where it is split
    fwd_per_token += 2 * shape.vocab * shape.hidden // (tp if shape.vocab_split_at(tp, pp) else 1)
    flops = (3 + (1 if ckpt else 0)) * fwd_per_token * tokens
    compute = flops / (device.bf16_flops * COMPUTE_EFFICIENCY)
    # 1F1B idles (pp - 1) of a rank's m stage-steps; interleaved, each of them is a stage of 1/v
    bubble = compute * (pp - 1) / (m * v) if pp > 1 else 0.0
    plan.seconds = {"compute": compute, "bubble": bubble}
    _price_communication(plan, device, devices_per_node, global_batch * seq_len / world_size)


def _mesh_bandwidth(device: DeviceClass, sizes: dict[str, int], devices_per_node: int) -> dict[str, float]:
    # mesh (pp, dp_shard, tp), outermost first: a dimension's group spans its size times the inner sizes
    bandwidth, inner = {}, 1
    for dim in ("tp", "dp_shard", "pp"):
        span = sizes[dim] * inner
        inside = span <= devices_per_node and devices_per_node % span == 0
        bandwidth[dim] = device.intra_node_bw if inside else device.inter_node_bw
        inner = span
    return bandwidth


def _price_communication(plan: SearchPlan, device: DeviceClass, devices_per_node: int, tokens: float) -> None:
    """``plan.seconds``' communication and total, and its tokens per second and device, from its
    collectives: each collective's bytes over the bandwidth of the link its mesh dimension crosses,
    as a ring moves them; point-to-point the bytes (a dimension the search does not name, such as
    ``dp_replicate``, is priced on the network)."""
    sizes = {"pp": plan.pp, "dp_shard": plan.dp_shard, "tp": plan.tp}
    bw = _mesh_bandwidth(device, sizes, devices_per_node)
    comm = 0.0
    for kind, dims in plan.collectives.items():
        for dim, moved in dims.items():
            n = sizes.get(dim, 2)
            share = 1.0 if kind == "p2p" else _RING.get(kind, 1.0) * (n - 1) / n
            comm += share * moved / bw.get(dim, device.inter_node_bw)
    total = plan.seconds["compute"] + comm + plan.seconds["bubble"]
    plan.seconds = {**plan.seconds, "communication": comm, "total": total}
    plan.seconds = {k: plan.seconds[k] for k in ("compute", "communication", "bubble", "total")}
    plan.tokens_per_second = tokens / total


def price_communication(plan: SearchPlan, result: SearchResult) -> None:
    """Price ``plan``'s step again from its collectives (after a dry run replaced them)."""
    _price_communication(
        plan, result.device, result.devices_per_node, result.global_batch * result.seq_len / result.world_size
    )


def rank(plans: list[SearchPlan]) -> None:
    """Sort ``plans`` cheapest first (fewer model-parallel ranks, then no checkpointing, on a tie)."""
    plans.sort(key=lambda p: (p.seconds["total"], p.tp * p.pp, p.activation_checkpointing is not None))
