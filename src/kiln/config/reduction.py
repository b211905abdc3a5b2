"""nnScaler's loss and gradient reduction over micro-batches, on kiln's Trainer events.

For one optimizer step every rank runs ``grad_accumulation_steps`` micro-batches; ``L_i`` is the loss
of micro-batch ``i`` (what the model or criterion returns) and the sums run over the micro-batches
of all data-parallel ranks:

==================  ==========================================  =========================================
option              gradient                                    reported loss
==================  ==========================================  =========================================
``mean``            ``sum_i grad L_i / num_batches``            ``loss_reduction: mean``: ``sum_i L_i / num_batches``
``sum``             ``sum_i grad L_i``                          ``loss_reduction: sum``: ``sum_i L_i``
``per-token-mean``  ``sum_i grad L_i / num_tokens``             (``L_i`` is then a sum over tokens)
==================  ==========================================  =========================================

``num_batches`` and ``num_tokens`` come from the :class:`AggregatedOutputs` that
``aggregate_outputs_fn(loss_outputs, sync_group)`` returns. The Trainer already averages the
gradients of equal micro-batches over ranks, which is ``mean``; :class:`GradReduction` is added only
when something else is asked for. It asks the Engine's step for the plain sum of the micro-batch
gradients (``state.microbatch_weighting = "sum"``) and scales the complete gradients by one factor
before clipping and the optimizer step (``AFTER_TRAIN_BATCH``), as nnScaler does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kiln.core.callback import Callback
from kiln.core.model import Model
from kiln.launch.context import context

__all__ = ["AggregatedOutputs", "EndToEndModel", "GradReduction", "aggregate_outputs", "as_end_to_end", "first_loss"]


@dataclass
class AggregatedOutputs:
    """What ``aggregate_outputs_fn(loss_outputs, sync_group)`` returns: sums over every rank.

    Args:
        loss_sum: the loss summed over all micro-batches of all ranks.
        num_batches: the number of micro-batches of all ranks.
        num_tokens: the number of tokens of all ranks (needed for ``per-token-mean``).
        aggregated_outputs: anything else the function wants to pass on (to hooks).
    """

    loss_sum: float | None = None
    num_batches: int | None = None
    num_tokens: int | None = None
    aggregated_outputs: Any = None

    @classmethod
    def aggregate(
        cls,
        loss_outputs: list[Any],
        sync_group: Any,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        ntokens_fn: Callable[[Any], Any] | None = None,
    ) -> AggregatedOutputs:
        """Sum ``loss_fn(output)`` (default: the first element) and ``ntokens_fn(output)`` over all ranks."""
        loss_fn = loss_fn or first_loss
        losses = [torch.as_tensor(loss_fn(o), dtype=torch.float64).detach().cpu() for o in loss_outputs]
        ntokens = [float(ntokens_fn(o)) for o in loss_outputs] if ntokens_fn is not None else [0.0]
        totals = torch.tensor(
            [float(torch.stack(losses).sum()) if losses else 0.0, float(len(losses)), sum(ntokens)], dtype=torch.float64
        )
        if dist.is_available() and dist.is_initialized():
            # one collective for all three sums, on the device the backend syncs (NCCL: this rank's GPU)
            totals = totals.to(context().device)
            dist.all_reduce(totals, group=sync_group)
        loss_sum, num_batches, num_tokens = totals.tolist()
        return cls(
            loss_sum=loss_sum,
            num_batches=int(num_batches),
            num_tokens=int(num_tokens) if ntokens_fn is not None else None,
        )


def first_loss(output: Any) -> torch.Tensor:
    """The loss of an end-to-end output: the output itself, or its first element."""
    return output[0] if isinstance(output, (tuple, list)) else output


def aggregate_outputs(loss_outputs: list[Any], sync_group: Any) -> AggregatedOutputs:
    """The default ``aggregate_outputs_fn``: loss sum and micro-batch count over all ranks."""
    return AggregatedOutputs.aggregate(loss_outputs, sync_group)


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


class GradReduction(Callback):
    """Loss and gradient reduction over all micro-batches of all ranks (see the module docstring).

    Args:
        grad_reduction: ``"mean"``, ``"sum"`` or ``"per-token-mean"``.
        loss_reduction: ``"mean"`` or ``"sum"``: what ``state.loss`` reports after the step.
        aggregate_fn: ``fn(loss_outputs, sync_group) -> AggregatedOutputs``.
        data_parallel_size: ranks over which the strategy averages gradients.
        end_to_end: loss outputs are the model's outputs (else ``(loss, outputs, batch)`` tuples).
        sync_group: the process group passed to ``aggregate_fn`` (``None``: the default group).
    """

    def __init__(
        self,
        grad_reduction: str = "mean",
        loss_reduction: str = "mean",
        aggregate_fn: Callable[[list[Any], Any], AggregatedOutputs] | None = None,
        data_parallel_size: int = 1,
        end_to_end: bool = True,
        sync_group: Any = None,
    ) -> None:
        self.grad_reduction, self.loss_reduction = grad_reduction, loss_reduction
        self.aggregate_fn = aggregate_fn or aggregate_outputs
        self.data_parallel_size, self.end_to_end, self.sync_group = data_parallel_size, end_to_end, sync_group
        self.loss_outputs: list[Any] = []
        self.batches: list[Any] = []
        self.last: AggregatedOutputs | None = None

    def before_train_batch(self, state: Any, logger: Any) -> None:
        # the Engine adds the micro-batch gradients unweighted; the factor below makes the reduction
        state.microbatch_weighting = "sum"
        self.loss_outputs, self.batches = [], []

    def after_loss(self, state: Any, logger: Any) -> None:
        output = state.outputs if self.end_to_end else (state.loss, state.outputs, state.batch)
        self.loss_outputs.append(_detach(output))
        self.batches.append(state.batch)

    def after_train_batch(self, state: Any, logger: Any) -> None:
        agg = self.aggregate_fn(self.loss_outputs, self.sync_group)
        if not isinstance(agg, AggregatedOutputs):
            raise TypeError(f"aggregate_outputs_fn returned {type(agg).__name__}, expected AggregatedOutputs")
        self.last = agg
        # the strategy averaged over data-parallel ranks: times their number gives the plain sum
        factor = float(self.data_parallel_size)
        if self.grad_reduction == "mean":
            factor /= _required(agg.num_batches, "num_batches", "mean")
        elif self.grad_reduction == "per-token-mean":
            factor /= _required(agg.num_tokens, "num_tokens", "per-token-mean")
        if factor != 1.0:
            grads = [p.grad for p in state.model.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor)
        loss = summed_loss(agg)
        if self.loss_reduction == "mean":
            loss = loss / _required(agg.num_batches, "num_batches", "mean")
        elif self.loss_reduction == "per-token-mean":
            loss = loss / _required(agg.num_tokens, "num_tokens", "per-token-mean")
        # the same value on every rank, so the Trainer's cross-rank average for logging keeps it
        state.loss = torch.tensor(loss, dtype=torch.float32, device=getattr(state, "device", None))


def summed_loss(agg: AggregatedOutputs) -> float:
    """``agg.loss_sum``, which every ``aggregate_outputs_fn`` must fill in."""
    if agg.loss_sum is None:
        raise TypeError("aggregate_outputs_fn returned AggregatedOutputs with loss_sum=None; expected the summed loss")
    return agg.loss_sum


def _required(value: Any, name: str, reduction: str) -> float:
    if not value:
        raise RuntimeError(
            f"aggregate_outputs_fn returned AggregatedOutputs with {name}={value!r}; "
            f"reduction {reduction!r} needs a positive {name}"
        )
    return float(value)


class EndToEndModel(Model):
    """A mixin that makes a module whose ``forward(batch)`` returns its loss (or a tuple starting with
    it) a :class:`kiln.Model`: ``loss`` takes the first output (nnScaler's end-to-end mode)."""

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        return first_loss(outputs)


_END_TO_END: dict[type, type] = {}


def as_end_to_end(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as a kiln.Model whose loss is its forward's first output, in place.

    The instance's class becomes a subclass of its own class and :class:`EndToEndModel`, so its
    parameters, state-dict keys and ``forward`` are unchanged (a wrapper module would prefix every key).
    """
    if isinstance(model, Model):
        return model
    cls = type(model)
    if cls not in _END_TO_END:
        _END_TO_END[cls] = type(
            cls.__name__, (cls, EndToEndModel), {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        )
    model.__class__ = _END_TO_END[cls]
    return model
