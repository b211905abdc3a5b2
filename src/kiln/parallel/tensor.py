"""``strategy="tp"``: tensor parallelism over every rank (the transformation itself:
:mod:`kiln.parallel.transforms.tensor_parallel`).

The gradients of its replicated parameters (sequence parallelism's norms) come out of the backward
as per-rank partial sums; the last backward of each step sums them over the ranks once
(:mod:`kiln.parallel.state.replicated_grads`), before clipping and the optimizer, as FSDP2 does
for them under :class:`kiln.parallel.Hybrid`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.parallel.state.grad_norm import clip_grad_norm_
from kiln.parallel.state.mesh import ParallelDims
from kiln.parallel.state.replicated_grads import reduce_partial_grads
from kiln.parallel.strategy import Strategy
from kiln.parallel.transforms.parallelize import ParallelizePlan, find_blocks
from kiln.parallel.transforms.sequence_parallel import sequence_parallel_plan
from kiln.parallel.transforms.tensor_parallel import check_tp_size, resolve_tp_plan

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = ["TensorParallel"]


class TensorParallel(Strategy):
    """Tensor parallelism over all ranks (``strategy="tp"``); for TP within data parallelism use
    :class:`kiln.parallel.Hybrid`.

    Args:
        plan: module-name patterns to ``"colwise"``, ``"rowwise"``, ``"sequence"`` (or
            ``"colwise_rep"``/``"rowwise_rep"``, or torch ``ParallelStyle`` objects). ``None``: the
            model's own (:func:`kiln.parallel.transforms.tensor_parallel.model_tp_plan`: a Hugging Face model's ``base_model_tp_plan``, or
            a ``tp_plan`` attribute).
        sequence_parallel: shard the residual stream and the norms on the sequence dimension over
            the ranks, all-gathered before the attention and MLP projections and reduce-scattered
            after them (:mod:`kiln.parallel.transforms.sequence_parallel`). ``None`` (default): on
            where kiln has a plan for the model (Llama-family Hugging Face causal LMs,
            :class:`kiln.models.MoELlama`) and no ``plan`` is given; ``True``: required (refused in
            one line where kiln has no plan); ``False``: off, the plain tensor-parallel plan.
        loss_parallel: with sequence parallelism, the embedding split over the vocabulary and the
            logits left sharded over it, the cross-entropy computed on the shards (no rank holds
            the ``tokens x vocab`` logits). ``None``: on with sequence parallelism where the model
            allows (not with tied input/output embeddings); ``False``: the logits gathered whole.

    Example::

        strategy = kiln.parallel.TensorParallel({"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"})
        strategy = kiln.parallel.TensorParallel(sequence_parallel=False)   # a Llama, plain TP
    """

    name = "tp"
    steps = ("placement", "float8", "tensor_parallel", "activation_checkpointing", "compile")

    def __init__(
        self,
        plan: Mapping[str, Any] | None = None,
        *,
        sequence_parallel: bool | None = None,
        loss_parallel: bool | None = None,
    ) -> None:
        self.plan = plan
        self.sequence_parallel, self.loss_parallel = sequence_parallel, loss_parallel
        # TP ranks are one data-parallel replica: they must all read the same batch.
        self.data_parallel_rank, self.data_parallel_size = 0, 1
        self._grad_sync = True  # whether the next backward ends a step (set_grad_sync)

    def parallelize_plan(self, model: nn.Module, ctx: Context, precision: Precision) -> ParallelizePlan:
        # user errors first, before any collective
        sp_plan = sequence_parallel_plan(
            model,
            sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel,
            plan=self.plan,
            tp=ctx.world_size,
        )
        plan = resolve_tp_plan(model, sp_plan if sp_plan is not None else self.plan)
        check_tp_size(model, plan, ctx.world_size)
        return ParallelizePlan.on_mesh(
            ParallelDims(dp_shard=1, tp=ctx.world_size),
            ctx=ctx,
            precision=precision,
            options=self.parallelize_options,
            blocks=find_blocks(model),
            tp_plan=plan,
        )

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        self._grad_sync = enabled

    def backward(
        self, model: nn.Module, loss: torch.Tensor, scale: float | None, scaler: torch.amp.GradScaler | None
    ) -> None:
        super().backward(model, loss, scale, scaler)
        # The replicated parameters' gradients are partial sums (one per sequence shard): summed once
        # a step, after its last backward, as DDP and FSDP sync theirs; the accumulation's earlier
        # backwards add partial sums to partial sums, which needs no communication.
        if self._grad_sync:
            reduce_partial_grads(model.parameters())

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        reduce_partial_grads(model.parameters())  # a backward run outside the Engine's (nothing if none)
        return clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> torch.Tensor | None:
        # after a backward run outside the Engine's: else each optimizer op would sum them again
        reduce_partial_grads(model.parameters())
        return super().optimizer_step(model, optimizer, scaler)

    def describe(self) -> dict[str, Any]:
        plan = self.plan if self.plan is not None else "the model's own"
        return {
            "name": self.name,
            "plan": {k: str(v) for k, v in plan.items()} if isinstance(plan, Mapping) else plan,
            "sequence_parallel": self.sequence_parallel,
            "loss_parallel": self.loss_parallel,
        }

    def __repr__(self) -> str:
        switches = "".join(
            f", {name}={value}"
            for name, value in (("sequence_parallel", self.sequence_parallel), ("loss_parallel", self.loss_parallel))
            if value is not None
        )
        return f"TensorParallel(plan={self.plan!r}{switches})"
