"""Hybrid parallelism on one ``DeviceMesh``: pipeline x (replicate x shard) data x tensor.

The parallelisms are applied in :mod:`kiln.parallel.transforms.parallelize`'s order (torchtitan's), each one
step: placement on the whole model; the cut into pipeline stages (this rank keeps its own); then on
each stage tensor parallelism, which turns Linear weights into DTensors on the ``tp`` mesh, and
FSDP2 over the data-parallel mesh, which shards those DTensors again along the data dimension
(2-D parameters) and must come last, because it takes ownership of whatever parameters the module
holds when it is applied.

``dp_replicate > 1`` with ``dp_shard > 1`` is HSDP: parameters sharded within a group of
``dp_shard`` ranks and replicated across ``dp_replicate`` groups.

``ep > 1`` is expert parallelism (:mod:`kiln.parallel.transforms.expert_parallel`): the experts of the model's
:class:`kiln.models.MoE` layers split over ``ep`` ranks taken from ``dp_shard``, tokens sent to them
with all-to-alls; the experts are FSDP-sharded over the rest of ``dp_shard``.

``cp > 1`` is context parallelism (:mod:`kiln.parallel.context`): each sequence of a batch split
over ``cp`` ranks, which run torch's ring attention; FSDP shards over ``dp_shard x cp``. CUDA only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.parallel.context import ContextParallel, check_context_parallel
from kiln.parallel.pipeline import PipelineSteps
from kiln.parallel.pipelining.runtime import PipelineRuntime, validate_split_points
from kiln.parallel.pipelining.schedules import SCHEDULES, SPLIT_BACKWARD, stage_count_error
from kiln.parallel.pipelining.sequence_stages import sequence_boundaries, stage_styles
from kiln.parallel.pipelining.tp_trace import traced_as_tp_rank
from kiln.parallel.pipelining.traced_casts import drop_cast_assertions
from kiln.parallel.state.mesh import ParallelDims, dp_coordinate
from kiln.parallel.state.replicated_grads import reduce_partial_grads
from kiln.parallel.transforms.expert_parallel import check_expert_parallel
from kiln.parallel.transforms.parallelize import STEPS, ParallelizePlan, WrapSpec, find_blocks, parallelize
from kiln.parallel.transforms.sequence_parallel import sequence_parallel_plan
from kiln.parallel.transforms.tensor_parallel import check_tp_size, matching_modules, resolve_tp_plan

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = ["Hybrid"]


class Hybrid(PipelineSteps):
    """Several parallelisms at once on a validated 4-D mesh (``pp, dp_replicate, dp_shard, tp``),
    with expert parallelism inside ``dp_shard``.

    Args:
        dp_replicate: data-parallel replica groups (HSDP's outer dimension).
        dp_shard: ranks that shard parameters within a replica (``-1``: what the others leave).
        tp: tensor-parallel ranks; with ``tp_plan``, or the model's own plan (a Hugging Face
            model's ``base_model_tp_plan``, or a ``tp_plan`` attribute).
        pp: pipeline stages; needs ``split_points``.
        ep: expert-parallel ranks (MoE experts split over them); must divide ``dp_shard`` and each
            MoE layer's ``num_experts``; not with ``pp``.
        cp: context-parallel ranks (each sequence split over them, ring attention; causal LMs with
            dict batches of ``input_ids``/``labels``, on CUDA); not with ``pp`` or ``ep``.
        tp_plan: see :class:`kiln.parallel.TensorParallel`.
        sequence_parallel / loss_parallel: see :class:`kiln.parallel.TensorParallel`; on by default
            with ``tp > 1`` for the models kiln has a plan for, off with ``cp > 1``; with ``pp > 1``
            sequence parallelism runs inside each stage (its boundaries send the whole sequence:
            :mod:`kiln.parallel.pipelining.sequence_stages`) and loss parallelism is off.
        split_points / schedule / microbatches / example_input: see :class:`kiln.parallel.Pipeline`.
        wrap / cpu_offload: see :class:`kiln.parallel.FSDP`.
        reshard_after_forward: free each block's gathered parameters after its forward (True), or
            keep them until its backward (False). None (the default): True without a pipeline;
            with ``pp > 1`` False, as torchtitan does: a stage gathers its blocks once per step
            instead of once per microbatch (the all-gather bytes of ``microbatches`` forwards and
            backwards become those of one), at the cost of holding the stage's parameters
            unsharded from its first forward to its last backward (its blocks' full size, where
            resharding holds one block at a time). The zero-bubble schedules always keep them.

    ``data_parallel_rank`` and ``data_parallel_size`` say which batch this rank reads (ranks of one
    tensor-parallel group and of one pipeline read the same one).

    Example::

        strategy = kiln.parallel.Hybrid(dp_shard=2, tp=2, tp_plan={"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"})
        strategy = kiln.parallel.Hybrid(dp_shard=-1, ep=2)     # a MoE model: experts over 2 ranks
        strategy = kiln.parallel.Hybrid(dp_shard=-1, cp=4)     # long sequences: each over 4 GPUs
    """

    name = "hybrid"
    steps = STEPS

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        cp: int = 1,
        *,
        tp_plan: Mapping[str, Any] | None = None,
        split_points: Sequence[str] = (),
        schedule: str = "1f1b",
        microbatches: int | None = None,
        example_input: Any = None,
        wrap: WrapSpec = None,
        reshard_after_forward: bool | None = None,
        cpu_offload: bool = False,
        sequence_parallel: bool | None = None,
        loss_parallel: bool | None = None,
    ) -> None:
        self.sequence_parallel, self.loss_parallel = sequence_parallel, loss_parallel
        self.dims = ParallelDims(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, ep=ep, cp=cp)
        if cp > 1 and (pp > 1 or ep > 1):
            other = f"pp={pp}" if pp > 1 else f"ep={ep}"
            raise ValueError(
                f"Hybrid(cp={cp}, {other}): context parallelism is not combined with "
                f"{'pipeline' if pp > 1 else 'expert'} parallelism in kiln yet; use cp with dp_replicate, "
                "dp_shard and tp, or set cp=1"
            )
        if ep > 1 and pp > 1:
            raise ValueError(
                f"Hybrid(ep={ep}, pp={pp}): expert parallelism does not run inside pipeline stages (a MoE "
                "layer's token counts decide its all-to-all sizes, which a traced stage cannot); use pp=1 with ep"
            )
        if pp > 1 and not split_points:
            raise ValueError(f"Hybrid(pp={pp}) needs split_points=[module names where stages begin]")
        if str(schedule).lower() not in SCHEDULES:
            raise ValueError(f"Hybrid schedule={schedule!r} is not known; expected one of {', '.join(SCHEDULES)}")
        self.tp_plan, self.split_points = (
            tp_plan,
            [split_points] if isinstance(split_points, str) else list(split_points),
        )
        self.schedule, self.microbatches, self.example_input = str(schedule).lower(), microbatches, example_input
        self.wrap, self.reshard_after_forward, self.cpu_offload = wrap, reshard_after_forward, cpu_offload
        self.pipeline: PipelineRuntime | None = None
        self.sequence_parallel_stages = False  # sequence parallelism inside pipeline stages (parallelize_plan)
        self.data_parallel_rank, self.data_parallel_size = 0, 1
        self.context_parallel: ContextParallel | None = None

    def _reshard_after_forward(self, pp: int) -> bool:
        if pp > 1 and self.schedule in SPLIT_BACKWARD:
            return False  # see parallelize_plan
        return pp == 1 if self.reshard_after_forward is None else bool(self.reshard_after_forward)

    def parallelize_plan(self, model: nn.Module, ctx: Context, precision: Precision) -> ParallelizePlan:
        # Every user error is raised here, before the mesh exists (no collective has run).
        dims = self.dims.resolve(ctx.world_size)
        sp_plan = sequence_parallel_plan(
            model,
            sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel,
            plan=self.tp_plan,
            tp=dims.tp,
            blocker=f"cp={dims.cp}" if dims.cp > 1 else None,
            pipeline=f"pp={dims.pp}" if dims.pp > 1 else None,
        )
        self.sequence_parallel_stages = sp_plan is not None and dims.pp > 1
        tp_plan = resolve_tp_plan(model, sp_plan if sp_plan is not None else self.tp_plan) if dims.tp > 1 else {}
        if self.sequence_parallel_stages:  # a traced stage's blocks take their inputs positionally
            tp_plan = stage_styles(tp_plan)
        check_tp_size(model, tp_plan, dims.tp, pipeline=dims.pp > 1)
        check_expert_parallel(model, dims.ep)
        dry_run = ctx.backend == "fake"  # kiln.planning.fake_world: the dry run's stand-in attention
        if not dry_run:
            check_context_parallel(dims.cp, ctx.device.type)
        if dims.pp > 1:
            validate_split_points(model, self.split_points)
            error = stage_count_error(len(self.split_points) + 1, dims.pp, self.schedule, self.microbatches)
            if error:
                raise ValueError(error)
        blocks = find_blocks(model, self.wrap)
        # The zero-bubble schedules run each stage's weight gradients in a later pass than its input
        # gradients, and torch finds the weights through the stage's registered parameters. FSDP puts
        # the shards back in their place after each forward unless it keeps the gathered parameters
        # until the backward: the weight pass then finds no path to them (stages without gradients,
        # others wrong, measured on 4 ranks). So under those schedules the parameters stay gathered
        # (zero2 inside each stage; torchtitan does the same under any pipeline).
        plan = ParallelizePlan.on_mesh(
            dims,
            ctx=ctx,
            precision=precision,
            options=self.parallelize_options,
            blocks=blocks,
            tp_plan=tp_plan,
            reshard_after_forward=self._reshard_after_forward(dims.pp),
            cpu_offload=self.cpu_offload,
        )
        self.resolved_dims = dims
        self.context_parallel = ContextParallel(plan.cp_mesh, ring=not dry_run) if plan.cp_mesh is not None else None
        self.data_parallel_rank, self.data_parallel_size = dp_coordinate(plan.mesh, dims), dims.dp
        return plan

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Context, precision: Precision
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        plan = self.parallelize_plan(model, ctx, precision)
        if plan.dims is None or plan.dims.pp == 1:
            return parallelize(self, model, plan, optimizer=optimizer), optimizer

        def prepare_stage(stage: nn.Module) -> None:
            # FSDP's bf16 parameters meet the dtype assertions the trace left for the model's casts
            drop_cast_assertions(stage)
            if plan.tp_mesh is not None:
                stage_plan = {p: s for p, s in plan.tp_plan.items() if matching_modules(stage, p)}
                _restore_split_layers(stage, model, stage_plan)
                if self.sequence_parallel_stages:
                    sequence_boundaries(stage, plan.tp_mesh)

        mesh = plan.mesh
        return self.setup_pipeline(
            model,
            optimizer,
            plan,
            mesh["pp"].get_group(),
            mesh.get_local_rank("pp"),
            plan.dims.pp,
            prepare_stage=prepare_stage,
            # the trace sees each split layer as one tensor-parallel rank will (grouped-query attention's
            # repeated heads are sized from it): kiln.parallel.pipelining.tp_trace
            trace_context=lambda traced: traced_as_tp_rank(traced, plan.tp_plan, plan.dims.tp if plan.dims else 1),
        ), optimizer

    @property
    def wraps_microbatches(self) -> bool:
        return self.context_parallel is not None

    def microbatch_context(self, batch: Any) -> AbstractContextManager[None]:
        """With ``cp``: the microbatch's sequences split over the ``cp`` ranks, ring attention on."""
        if self.context_parallel is None:
            return super().microbatch_context(batch)
        return self.context_parallel.step(batch)

    def loss(self, model: nn.Module, criterion: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        """With ``cp``, inside a training step: the loss of the whole sequence (see
        :meth:`kiln.parallel.context.ContextParallel.reduce_loss`)."""
        if self.pipeline is not None:  # the schedule computes it (PipelineSteps.loss); cp is refused with pp
            return super().loss(model, criterion, *args, **kwargs)
        loss = criterion(*args, **kwargs)
        cp = self.context_parallel
        return cp.reduce_loss(loss) if cp is not None and cp.active else loss

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        # Under pp > 1 the pipeline schedule sets FSDP's sync for each of its own microbatches.
        super().set_grad_sync(model, enabled)  # the pipeline's tied weights sum on the step's last backward
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        reduce_partial_grads(model.parameters())  # see optimizer_step
        return super().clip_grad_norm_(model, max_norm, norm_type)  # PipelineSteps': tied weights once

    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> torch.Tensor | None:
        # Without FSDP (tp with dp_shard 1, or a pipeline's stages), sequence parallelism's replicated
        # norms end the backward with partial-sum gradients: summed here once a step (after every
        # accumulated backward, before clipping and the optimizer), where DTensor would sum them again
        # inside every optimizer op that reads them (AdamW: 3 a norm). Under FSDP nothing is partial.
        reduce_partial_grads(model.parameters())
        return super().optimizer_step(model, optimizer, scaler)

    def describe(self) -> dict[str, Any]:
        dims = getattr(self, "resolved_dims", self.dims)
        return {
            "name": self.name,
            "pp": dims.pp,
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            "tp": dims.tp,
            "ep": dims.ep,
            "cp": dims.cp,
            "split_points": self.split_points,
            "schedule": self.schedule,
            "sequence_parallel": self.sequence_parallel,
            "loss_parallel": self.loss_parallel,
        }

    def __repr__(self) -> str:
        d = self.dims
        ep = f", ep={d.ep}" if d.ep > 1 else ""
        cp = f", cp={d.cp}" if d.cp > 1 else ""
        return f"Hybrid(dp_replicate={d.dp_replicate}, dp_shard={d.dp_shard}, tp={d.tp}, pp={d.pp}{ep}{cp})"


def _restore_split_layers(stage: nn.Module, model: nn.Module, plan: Mapping[str, Any]) -> None:
    # Tracing turns every module of a stage into an fx InterpreterModule, which tensor parallelism
    # cannot split (it needs nn.Linear / nn.Embedding). The original layer objects hold the very
    # same parameters and take the same single tensor input, so they are put back in their place.
    # Other modules a plan names (sequence parallelism's norms and blocks) stay traced: their
    # originals take other inputs than the traced call passes (kiln.parallel.pipelining.sequence_stages).
    for pattern in plan:
        for name in matching_modules(stage, pattern):
            if not isinstance(model.get_submodule(name), (nn.Linear, nn.Embedding)):
                continue
            parent_name, _, leaf = name.rpartition(".")
            parent = stage.get_submodule(parent_name) if parent_name else stage
            setattr(parent, leaf, model.get_submodule(name))
