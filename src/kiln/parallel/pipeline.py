"""``strategy="pp"``: pipeline parallelism over every rank, and :class:`PipelineSteps`, the Engine's
loss and backward through a pipeline schedule (which ``Hybrid`` shares). How a step maps onto the
schedule, the traced stages and the runtime: :mod:`kiln.parallel.pipelining.runtime`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from kiln.parallel.pipelining.runtime import (
    PipelineOutput,
    PipelineRuntime,
    full_pipeline_state_dict,
    validate_split_points,
)
from kiln.parallel.pipelining.schedules import (
    SCHEDULES,
    stage_count_error,
)
from kiln.parallel.pipelining.tied_weights import pipeline_ranks
from kiln.parallel.state.grad_norm import clip_grad_norm_
from kiln.parallel.strategy import Strategy
from kiln.parallel.transforms.data_parallel import mixed_precision_policy
from kiln.parallel.transforms.parallelize import STAGE_STEPS, WHOLE_MODEL_STEPS, ParallelizePlan, parallelize

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision
__all__ = [
    "Pipeline",
    "PipelineOutput",
    "PipelineRuntime",
    "PipelineSteps",
    "validate_split_points",
    "full_pipeline_state_dict",
]


class PipelineSteps(Strategy):
    """The Engine's loss and backward through the pipeline schedule, for a strategy whose ``setup``
    may build a :class:`PipelineRuntime` in ``self.pipeline`` (Pipeline; Hybrid with ``pp > 1``).
    Without one (``pipeline`` None) they are the plain ones. Its clipping counts a tied weight's
    copies on the stages once (:mod:`kiln.parallel.pipelining.tied_weights`)."""

    pipeline: PipelineRuntime | None = None
    _grad_sync = True  # whether the next backward ends an optimizer step (set_grad_sync)
    split_points: list[str]
    schedule: str
    microbatches: int | None
    example_input: Any

    @property
    def fixed_batch_rows(self) -> bool:
        return self.pipeline is not None

    def setup_pipeline(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        plan: ParallelizePlan,
        group: dist.ProcessGroup,
        pp_rank: int,
        pp_size: int,
        *,
        prepare_stage: Callable[[nn.Module], None] | None = None,
        trace_context: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
    ) -> nn.Module:
        """The whole-model steps, then the cut into stages (on the first batch, or now from
        ``example_input``), then the per-stage steps on each of this rank's stages (see
        :mod:`kiln.parallel.transforms.parallelize`). Returns the module to train with."""
        # A model whose weights are deferred (HuggingFaceModel.from_pretrained, built on the meta
        # device) keeps its parameters there through the trace and the cut; each rank then reads
        # its own stages' weights after their sharding steps (PipelineRuntime.build), never the whole.
        for module in model.modules():
            per_stage = getattr(module, "read_weights_per_stage", None)
            if getattr(module, "deferred_weights", False) and callable(per_stage):
                per_stage()
        # with the optimizer: a whole-model step that replaces parameters (placement of a model built
        # on the meta device, in a dry run) re-points it, as the per-stage steps do later
        model = parallelize(self, model, plan, optimizer=optimizer, only=WHOLE_MODEL_STEPS)

        def transform(stage: nn.Module) -> None:
            if prepare_stage is not None:
                prepare_stage(stage)
            # the runtime keeps the stage object: the per-stage steps must work in place
            if parallelize(self, stage, plan, only=STAGE_STEPS) is not stage:
                raise TypeError(
                    f"strategy={self.name!r}: a step replaced a pipeline stage instead of changing it "
                    "in place, which the pipeline cannot run"
                )

        # FSDP inside the stages gathers their parameters in its mixed-precision dtype: the stages are
        # traced in it (PipelineRuntime's trace_dtype)
        policy = mixed_precision_policy(plan.precision) if plan.dp_mesh is not None else None
        trace_dtype = policy.param_dtype if policy is not None else None
        pipelines = None  # one pipeline over the world (Pipeline), else one per pp slice of the mesh (Hybrid)
        if plan.mesh is not None and "pp" in (plan.mesh.mesh_dim_names or ()):
            pipelines = pipeline_ranks(plan.mesh)
        self.pipeline = PipelineRuntime(
            model,
            self.split_points,
            self.schedule,
            self.microbatches or len(self.split_points) + 1,
            group,
            pp_rank,
            pp_size,
            plan.ctx.device,
            plan.precision,
            optimizer,
            transform=transform,
            trace_context=trace_context,
            pipelines=pipelines,
            trace_dtype=trace_dtype,
        )
        if self.example_input is not None:
            example = self.example_input
            self.pipeline.build(tuple(example) if isinstance(example, (tuple, list)) else (example,), {})
        return self.pipeline.view

    def loss(self, model: nn.Module, criterion: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.pipeline is not None and model.training and torch.is_grad_enabled():
            # the loss is computed on the last stage inside backward(); an eval forward returned
            # the real outputs, so its loss is computed like any other
            return self.pipeline.defer_loss(criterion, *args, **kwargs)
        return criterion(*args, **kwargs)

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        self._grad_sync = enabled

    def backward(
        self, model: nn.Module, loss: torch.Tensor, scale: float | None, scaler: torch.amp.GradScaler | None
    ) -> None:
        if self.pipeline is None:
            super().backward(model, loss, scale, scaler)
        else:  # the schedule applies the same scales per microbatch; the step's last backward sums
            # the tied weights' copies (as DDP syncs its gradients on it), before clipping and the step
            self.pipeline.backward(loss, scale=1.0 if scale is None else scale, scaler=scaler, sync=self._grad_sync)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        pipeline = self.pipeline
        if pipeline is None:
            return clip_grad_norm_(model.parameters(), max_norm, norm_type)
        return clip_grad_norm_(
            model.parameters(), max_norm, norm_type, pp_group=pipeline.group, uncounted=pipeline.tied.uncounted
        )


class Pipeline(PipelineSteps):
    """Pipeline parallelism over all ranks (``strategy="pp"``); with data or tensor parallelism
    inside each stage use :class:`kiln.parallel.Hybrid` (``pp=...``).

    Args:
        split_points: module names where a new stage begins, in forward order: one fewer than the
            ranks (``"gpipe"``, ``"1f1b"``), ``k * ranks - 1`` for ``"interleaved1f1b"`` and
            ``"interleaved_zb"``, exactly ``2 * ranks - 1`` for ``"zbv"`` and ``"dualpipev"``.
        schedule: ``"1f1b"`` (default: the least activation memory), ``"gpipe"``, ``"interleaved1f1b"``,
            or a zero-bubble one: ``"interleaved_zb"``, ``"zbv"``, ``"dualpipev"`` (two stages per rank
            in a V: rank r holds stages r and 2 * ranks - 1 - r).
        microbatches: microbatches per batch (default: the number of stages).
        example_input: a batch to trace the model with at setup; by default the first batch is used.

    Example::

        strategy = kiln.parallel.Pipeline(["layers.4"], schedule="1f1b", microbatches=8)
    """

    name = "pp"
    steps = ("placement", "float8", "activation_checkpointing", "compile")

    def __init__(
        self,
        split_points: Sequence[str] = (),
        schedule: str = "1f1b",
        microbatches: int | None = None,
        example_input: Any = None,
    ) -> None:
        if isinstance(split_points, str):
            split_points = [split_points]
        if not split_points:
            raise ValueError("Pipeline needs split_points=[module names where stages begin], e.g. ['layers.4']")
        schedule = str(schedule).lower()
        if schedule not in SCHEDULES:
            raise ValueError(f"Pipeline schedule={schedule!r} is not known; expected one of {', '.join(SCHEDULES)}")
        if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
            raise ValueError(f"Pipeline microbatches={microbatches!r} must be an integer >= 1")
        self.split_points, self.schedule, self.microbatches = list(split_points), schedule, microbatches
        self.example_input = example_input
        self.pipeline: PipelineRuntime | None = None
        self.data_parallel_rank, self.data_parallel_size = 0, 1

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Context, precision: Precision
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        validate_split_points(model, self.split_points)  # user errors first, before any collective
        error = stage_count_error(len(self.split_points) + 1, ctx.world_size, self.schedule, self.microbatches)
        if error:
            raise ValueError(error)
        plan = self.parallelize_plan(model, ctx, precision)
        world = cast(dist.ProcessGroup, dist.group.WORLD)  # typed Optional: None only before init_process_group
        return self.setup_pipeline(model, optimizer, plan, world, ctx.rank, ctx.world_size), optimizer

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "split_points": self.split_points,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
        }

    def __repr__(self) -> str:
        return f"Pipeline({self.split_points!r}, schedule={self.schedule!r}, microbatches={self.microbatches})"
