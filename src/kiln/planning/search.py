"""``kiln plan --search``: every (dp_shard, tp, pp, activation checkpointing, microbatch) plan of a
transformer on a world of devices, the infeasible ones dropped, the rest ranked by a cost model.

The plans are what kiln's ``hybrid`` strategy runs on the mesh ``(pp, dp_shard, tp)``, outermost
first: tensor parallelism with the model's own plan (a Hugging Face model's ``base_model_tp_plan``:
attention and MLP Linears split, embeddings and LM head whole), FSDP2 over ``dp_shard``, a pipeline
of ``pp`` stages (1F1B), or of ``2 x pp`` stages, 2 a rank (interleaved 1F1B), cut at block
boundaries. Everything is analytic (a plan costs microseconds
to price); ``kiln plan --dry-run`` of a plan's overrides runs the real code, and ``kiln plan
--search --confirm`` dry-runs the first plans and ranks them by what it measures
(:mod:`kiln.planning.confirm`).

This file is the grid and what drops a plan from it; the search's other rooms, each re-exported
here under the names it always had:

==========================================  ============================================================
:mod:`~kiln.planning.search_shape`          :class:`ModelShape`: what the search knows of a model
:mod:`~kiln.planning.search_plan`           :class:`SearchPlan`, :class:`SearchResult`: the records
:mod:`~kiln.planning.search_memory`         memory per rank of a plan's largest stage, in closed form
:mod:`~kiln.planning.search_collectives`    the bytes each collective moves per step, in closed form
:mod:`~kiln.planning.search_cost`           the seconds of a step (compute + communication + bubble),
                                            :func:`rank`
:mod:`~kiln.planning.search_text`           :func:`parse_bytes` (``--memory``), :func:`format_plans`
==========================================  ============================================================

``tests/test_search_vs_dry_run.py`` holds the closed forms' memory and collectives within 10% of
kiln's dry run over a grid of plans, tied embeddings included. For Llama-3-8B at FSDP 64 x TP 8
(8192 tokens, full checkpointing, amp_bf16) the search estimates 1,675 MiB of activations where the
dry run measures 1,665 MiB (docs/planning.md has the terms).

Infeasible: ``tp`` not dividing the attention or key/value heads, ``pp`` above the layers (or, for a
Hugging Face decoder outside :data:`kiln.models.hf_stages.MASK_RULES`' families, above 2: its rotary
embeddings would cross 3+ stages as a skip connection), a global batch that does not split over the
data-parallel ranks, fewer pipeline microbatches than stages, memory over the budget.
"""

from __future__ import annotations

from kiln.cost.devices import DeviceClass
from kiln.planning.search_cost import price_communication, price_plan, rank
from kiln.planning.search_memory import precision_bytes
from kiln.planning.search_plan import SearchPlan, SearchResult
from kiln.planning.search_shape import ModelShape
from kiln.planning.search_text import format_plans, parse_bytes

__all__ = [
    "ModelShape",
    "SearchPlan",
    "SearchResult",
    "search",
    "precision_bytes",
    "parse_bytes",
    "format_plans",
    "price_communication",
    "rank",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _split_points(shape: ModelShape, pp: int) -> list[str]:
    if pp == 1 or len(shape.blocks) < pp:
        return []
    # the first len % pp stages take one block more: the largest has ceil(len / pp), as priced
    per, extra = divmod(len(shape.blocks), pp)
    return [shape.blocks[i * per + min(i, extra)] for i in range(1, pp)]


def _schedules(shape: ModelShape, pp: int, m: int) -> tuple[str, ...]:
    # a pipeline runs 1F1B (a stage a rank), and interleaved 1F1B (2 stages a rank: half the
    # bubble, twice the sends) where the model has 2 layers a stage for it, cuts into that many
    # stages, and its microbatches come in whole rounds of the pp ranks
    if pp > 1 and shape.num_layers >= 2 * pp and shape.deep_pipeline and m % pp == 0:
        return ("1f1b", "interleaved1f1b")
    return ("1f1b",)


def search(
    shape: ModelShape,
    world_size: int,
    device: DeviceClass,
    *,
    budget: int | None,
    global_batch: int,
    seq_len: int,
    precision: str = "amp_bf16",
    optimizer_factor: int = 2,
    devices_per_node: int | None = None,
) -> SearchResult:
    """Every plan of ``shape`` on ``world_size`` devices of class ``device``, priced (module docstring).

    Args:
        budget: bytes per rank (None: the device's memory; unknown for ``cpu``: every plan fits).
        global_batch: sequences per optimizer step over all ranks.
        seq_len: tokens per sequence.
        precision: kiln's precision name (``amp_bf16``: fp32 parameters, bf16 compute).
        optimizer_factor: optimizer state tensors per parameter (AdamW: 2).
        devices_per_node: devices sharing the fast links (default: the device class's).

    Example::

        result = search(ModelShape.from_model(model), 8, device_class("h100"), budget=None,
                        global_batch=16, seq_len=8192)
        best = result.plans[0]
    """
    if world_size < 1:
        raise ValueError(f"--world-size={world_size} must be >= 1")
    if global_batch < 1 or seq_len < 1:
        raise ValueError(f"global batch {global_batch} and sequence length {seq_len} must be >= 1")
    precision_bytes(precision)
    per_node = devices_per_node or device.devices_per_node
    limit = budget if budget is not None else device.memory
    plans: list[SearchPlan] = []
    infeasible: dict[str, int] = {}
    searched = 0

    def drop(reason: str, count: int = 1) -> None:
        infeasible[reason] = infeasible.get(reason, 0) + count

    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            reason = None
            if shape.heads % tp or shape.kv_heads % tp:
                reason = "tp does not divide the attention heads or key/value heads"
            elif pp > shape.num_layers:
                reason = "pp above the number of layers (a stage without layers)"
            elif not shape.deep_pipeline and pp > 2:
                reason = "pp above 2 for this Hugging Face model (its rotary embeddings cross 3+ stages)"
            elif global_batch % dp:
                reason = "the global batch does not split over the data-parallel ranks"
            if reason is not None:  # with and without checkpointing, whatever the microbatch
                drop(reason, 2)
                searched += 2
                continue
            local = global_batch // dp
            for mbs in _divisors(local):
                m = local // mbs
                for ac in (None, "full"):
                    for schedule in _schedules(shape, pp, m):
                        searched += 1
                        if pp > 1 and m < pp:
                            drop("fewer pipeline microbatches than stages")
                            continue
                        plan = SearchPlan(dp, tp, pp, ac, mbs, m, schedule)
                        plan.split_points = _split_points(shape, pp * plan.stages_per_rank)
                        price_plan(
                            shape,
                            plan,
                            device,
                            world_size,
                            global_batch,
                            seq_len,
                            precision,
                            optimizer_factor,
                            per_node,
                        )
                        if limit is not None and plan.memory["total"] > limit:
                            drop("memory over the budget")
                            continue
                        plans.append(plan)
    rank(plans)
    return SearchResult(
        plans, infeasible, searched, device, world_size, limit, global_batch, seq_len, precision, shape, per_node
    )
