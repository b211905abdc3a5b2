"""The pipeline schedules kiln offers, each torch's own class, and the stage layout each needs.

====================  =================================  ===============  ===========================
name                  torch class                        stages per rank  rank ``r`` of ``pp`` holds
====================  =================================  ===============  ===========================
``gpipe``             ``ScheduleGPipe``                  1                stage ``r``
``1f1b``              ``Schedule1F1B``                   1                stage ``r``
``interleaved1f1b``   ``ScheduleInterleaved1F1B``        2, 3, ...        ``r, r + pp, ...`` (loop)
``interleaved_zb``    ``ScheduleInterleavedZeroBubble``  2, 3, ...        ``r, r + pp, ...`` (loop)
``zbv``               ``ScheduleZBVZeroBubble``          exactly 2        ``r``, ``2 pp - 1 - r`` (V)
``dualpipev``         ``ScheduleDualPipeV``              exactly 2        ``r``, ``2 pp - 1 - r`` (V)
====================  =================================  ===============  ===========================

The three zero-bubble schedules split each stage's backward into the gradient of its input (sent
on to the previous stage at once) and the gradient of its weights (run later, in what would
otherwise be a bubble). In the V layout the first and the last stage share rank 0, so the last
stage's loss is computed where the input was read, and the turn at the bottom of the V (stages
``pp - 1`` and ``pp``) costs no send.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SCHEDULES", "schedule_class", "stage_ids", "stage_rank", "stage_count_error"]

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "interleaved_zb", "zbv", "dualpipev")
# Schedules that take a list of stages (several per rank), and among them those that need the V.
MULTI_STAGE = ("interleaved1f1b", "interleaved_zb", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
# Schedules that split a stage's backward into input and weight gradients (the zero-bubble ones).
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")


def schedule_class(name: str) -> Any:
    """torch's schedule class for ``name`` (one of :data:`SCHEDULES`)."""
    from torch.distributed import pipelining as pp

    return {
        "gpipe": pp.ScheduleGPipe,
        "1f1b": pp.Schedule1F1B,
        "interleaved1f1b": pp.ScheduleInterleaved1F1B,
        "interleaved_zb": pp.ScheduleInterleavedZeroBubble,
        "zbv": pp.ScheduleZBVZeroBubble,
        "dualpipev": pp.ScheduleDualPipeV,
    }[name]


def stage_ids(schedule: str, num_stages: int, pp_rank: int, pp_size: int) -> list[int]:
    """The stages rank ``pp_rank`` holds, in forward order of its first visit (see the table above)."""
    if schedule in V_SHAPED:
        return [pp_rank, num_stages - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp_size))


def stage_rank(schedule: str, stage: int, num_stages: int, pp_size: int) -> int:
    """The pipeline rank that holds ``stage``."""
    if schedule in V_SHAPED and stage >= pp_size:
        return num_stages - 1 - stage
    return stage % pp_size


def stage_count_error(num_stages: int, pp: int, schedule: str, microbatches: int | None = None) -> str | None:
    """Why ``num_stages`` stages and ``microbatches`` microbatches (None: the default, one per stage)
    cannot run on ``pp`` ranks under ``schedule``; None when they can. Runs no collective."""
    splits = f"{num_stages - 1} split points make {num_stages} stages"
    if schedule in V_SHAPED:
        if num_stages != 2 * pp:
            return (
                f"Pipeline(schedule={schedule!r}) runs exactly 2 stages per rank in a V (rank r holds stages r "
                f"and {2 * pp - 1}-r), but {splits} for {pp} pipeline ranks; give {2 * pp - 1} split points"
            )
    elif schedule in MULTI_STAGE:
        if num_stages % pp or num_stages // pp < 2:
            return (
                f"Pipeline(schedule={schedule!r}) needs at least 2 stages per rank and a multiple of the "
                f"{pp} pipeline ranks, but {splits}; give {2 * pp - 1} split points (or {3 * pp - 1}, ...)"
            )
    elif num_stages != pp:
        return (
            f"Pipeline(schedule={schedule!r}) runs one stage per rank, but {splits} for {pp} pipeline ranks; "
            f"give {pp - 1} split points or launch {num_stages} processes"
        )
    n = num_stages if microbatches is None else microbatches
    given = f"microbatches={n}" + (" (the default: one per stage)" if microbatches is None else "")
    if schedule in ("1f1b", "dualpipev") and n < num_stages:
        return (
            f"Pipeline(schedule={schedule!r}) needs at least as many microbatches as its {num_stages} stages, "
            f"but got {given}; give microbatches={num_stages} or more"
        )
    if schedule == "zbv" and n < 2 * pp - 1:
        # torch's ZBV order always fills the pipeline with 2 * pp - 1 microbatches
        return (
            f"Pipeline(schedule='zbv') needs at least 2 * {pp} - 1 = {2 * pp - 1} microbatches on {pp} "
            f"pipeline ranks, but got {given}; give microbatches={2 * pp - 1} or more"
        )
    if schedule in ("interleaved1f1b", "interleaved_zb"):
        rounds = max(1, n // pp)
        if n % rounds:
            return (
                f"Pipeline(schedule={schedule!r}) runs microbatches in rounds of the {pp} pipeline ranks, so "
                f"microbatches must be a multiple of {rounds} (or at most {pp}), but got {given}; "
                f"give microbatches={rounds * pp}"
            )
    return None


def skip_same_rank_warmup(stage: Any) -> None:
    """Keep a traced stage's connection warm-up from sending to its own rank.

    Before its first step a schedule sends a dummy tensor to each stage's neighbours
    (``_get_init_p2p_neighbors_ops``, the path torch 2.13 takes for traced stages). In the V layout
    the neighbours at the bottom of the V (stages ``pp - 1`` and ``pp``) share a rank; the schedule
    itself hands their activations and gradients over in memory, but the warm-up sends to the rank
    itself, which gloo refuses ("Pair is not connected"). Dropping those messages leaves every
    message between two ranks as it was.
    """
    ops_of = stage._get_init_p2p_neighbors_ops
    own = stage.group_rank

    def ops() -> list:
        return [op for op in ops_of() if op.group_peer != own]

    stage._get_init_p2p_neighbors_ops = ops


def set_up_stages(schedule: Any, args: tuple, kwargs: dict, target: Any, microbatches: int) -> bool:
    """Do to ``schedule`` what its first ``step(*args, target=target, **kwargs)`` does before the
    first microbatch runs (each stage's receive buffers and backward bookkeeping, the warm-up
    exchange with the neighbouring stages) and nothing of the step itself.

    After it, the first step allocates and moves what every later step does, which is what a dry
    run measures (kiln.planning.dry_run), without a whole step run first only to set up. torch has
    no public call for it: this is the step's own private setup (``_initialize_stages`` of a
    multi-stage schedule, ``_initialize_stage`` of a single-stage one, torch 2.13 and 2.14), given
    the first microbatch as ``step`` splits it. Returns False, having done nothing, where this
    torch has neither (the first step then sets itself up).
    """
    set_up = getattr(schedule, "_initialize_stages", None) or getattr(schedule, "_initialize_stage", None)
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    if set_up is None or None in stages or not hasattr(schedule, "_has_backward"):
        return False
    for stage in stages:  # what step() tells its stages first: the buffers for gradients depend on it
        stage.has_backward = schedule._has_backward
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    if args or kwargs:  # only the first stage's rank gets the inputs
        arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(args, kwargs, microbatches)
        first_args, first_kwargs = arg_mbs[0], kwarg_mbs[0]
    else:
        first_args, first_kwargs = (), {}
    first_target = torch.tensor_split(target, microbatches)[0] if target is not None else None
    set_up(first_args, first_kwargs, first_target)
    return True


@contextlib.contextmanager
def forward_only(schedule: Any, name: str) -> Iterator[None]:
    """Run ``schedule.eval`` of a multi-stage schedule on the forward part of its order.

    torch 2.13's runtime for multi-stage schedules keeps the whole training order in ``eval()``
    (``pipeline_order_with_comms``) and relies on each stage ignoring its backward actions. At the
    turn of a V (two neighbouring stages on one rank) the backward hands the input gradient over in
    memory and fails ("can't steal_bwd_input if this stage doesn't have backward"); and a backward
    receive posted in eval and never consumed makes the next training step fail ("Recv twice").
    For the length of the eval the order keeps only the forward computations, their sends and
    receives and FSDP's unshard/reshard (DualPipeV's overlapped forward-backward pairs give their
    forward part), each rank's forward messages in their original order; the training order is
    restored after.
    """
    if name not in MULTI_STAGE:
        yield
        return
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    forward = (Kind.FORWARD, Kind.SEND_F, Kind.RECV_F, Kind.UNSHARD, Kind.RESHARD)
    order = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {
        rank: [
            part
            for action in actions
            for part in ((action.sub_actions or ()) if action.computation_type == Kind.OVERLAP_F_B else (action,))
            if part.computation_type in forward
        ]
        for rank, actions in order.items()
    }
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order
