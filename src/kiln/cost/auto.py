"""``strategy="auto"``: estimate memory per rank for each candidate and use the cheapest that fits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.cost.memory import PlanRow, activation_summary, choice_line, format_table, plan_table
from kiln.parallel.strategy import Strategy, get_strategy

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = ["Auto", "peek_first_batch"]


class Auto(Strategy):
    """Picks ``ddp``, ``zero1``, ``zero2`` or ``zero3``: of those whose memory estimate
    (:func:`kiln.cost.memory.plan_table`) fits, the cheapest step by the cost model of ``kiln plan
    --search`` (:func:`kiln.cost.step_time.data_parallel_seconds`, this machine's device class;
    the earlier on a tie), then behaves exactly as the pick.

    With ``example_input`` the estimate counts activations, and when no strategy fits without
    activation checkpointing (activations dominate), or where the recomputation costs less than the
    communication sharding would add, it picks one with every block checkpointed:
    the chosen strategy then runs with ``activation_checkpointing="full"``, unless the user chose
    a mode already (then that mode is measured and kept).

    Args:
        memory_budget: bytes one rank may use (default: ``$KILN_MEMORY_BUDGET_BYTES``, else the
            device's free memory).
        example_input: one microbatch, to measure activation memory on fake tensors (see
            :func:`kiln.cost.activations.estimate_activations`).

    After ``setup``, ``chosen`` is the strategy in use, ``reason`` says why and ``table`` holds
    every candidate (what ``kiln plan`` prints).

    Example::

        engine, *_ = kiln.initialize(model, opt, config={"strategy": {"name": "auto", "memory_budget": 8e9}})
        print(engine.strategy.reason)
    """

    name = "auto"

    def __init__(self, memory_budget: int | float | None = None, example_input: Any = None) -> None:
        self.memory_budget = memory_budget
        self.example_input = example_input
        self.chosen: Strategy | None = None
        self.table: list[PlanRow] = []
        self.reason = "not planned yet: setup() plans"
        self._example_from_loader = False

    def use_loader_example(self, batch: Any) -> None:
        """Measure activations on ``batch``, the training loader's first microbatch (the Trainer
        passes it when the user gave no ``example_input``). Unlike an example the user gave, one
        the estimate cannot run leaves the plan without activations, with a warning, rather than
        stopping a run that never asked for the estimate."""
        self.example_input, self._example_from_loader = batch, True

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Context, precision: Precision
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        options = self.parallelize_options

        def plan(example: Any) -> list[PlanRow]:
            return plan_table(
                model,
                optimizer,
                ctx.world_size,
                self.memory_budget,
                example,
                activation_checkpointing=options.activation_checkpointing,
            )

        try:
            self.table = plan(self.example_input)
        except Exception as exc:
            if not self._example_from_loader:
                raise
            from kiln.launch.logging import get_dist_logger

            get_dist_logger().warning(
                f"strategy='auto' could not measure activations on the training loader's first batch "
                f"({type(exc).__name__}: {exc}); planning without them (pass Auto(example_input=...) to choose one)",
                ranks=[0],
            )
            self.table = plan(None)
        row = next(r for r in self.table if r.chosen)
        self.chosen = get_strategy(row.strategy, ctx)
        self.chosen.find_unused_parameters = self.find_unused_parameters
        if options.activation_checkpointing is None and row.options.get("activation_checkpointing"):
            # the plan chose checkpointing: activations would not fit otherwise
            options = dataclasses.replace(options, activation_checkpointing=row.options["activation_checkpointing"])
        self.chosen.parallelize_options = options
        self.reason = f"{row.label}: {row.note}"
        if ctx.is_main:
            from kiln.launch.logging import get_dist_logger

            # One line in every run; the table of every candidate is `kiln plan`'s, or the debug
            # level's (`kiln train --verbose`, get_dist_logger().set_level("DEBUG")).
            logger = get_dist_logger()
            logger.info(f"{choice_line(self.table)} (every candidate: kiln plan, or --verbose)", ranks=[0])
            summary = activation_summary(self.table)
            logger.debug(format_table(self.table) + (f"\n{summary}" if summary else ""), ranks=[0])
        return self.chosen.setup(model, optimizer, ctx, precision)

    # -- everything else is the chosen strategy's -------------------------------------------------
    def _strategy(self) -> Strategy:
        if self.chosen is None:
            raise RuntimeError("strategy='auto' has not chosen yet: call setup() (the Engine does) first")
        return self.chosen

    def make_scaler(self, precision: Precision, device: torch.device) -> torch.amp.GradScaler | None:
        return self._strategy().make_scaler(precision, device)

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        self._strategy().set_grad_sync(model, enabled)

    def loss(self, model: nn.Module, criterion: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._strategy().loss(model, criterion, *args, **kwargs)

    def backward(
        self, model: nn.Module, loss: torch.Tensor, scale: float | None, scaler: torch.amp.GradScaler | None
    ) -> None:
        self._strategy().backward(model, loss, scale, scaler)

    def clip_gradients(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        scaler: torch.amp.GradScaler | None,
    ) -> torch.Tensor | None:
        return self._strategy().clip_gradients(model, optimizer, max_norm, scaler)

    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> torch.Tensor | None:
        return self._strategy().optimizer_step(model, optimizer, scaler)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self._strategy().clip_grad_norm_(model, max_norm, norm_type)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self._strategy().unwrap(model)

    def __getattr__(self, name: str) -> Any:
        # data_parallel_size, pipeline, ... of the chosen strategy (only reached for missing names)
        chosen = self.__dict__.get("chosen")
        if chosen is None:
            raise AttributeError(name)
        return getattr(chosen, name)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "chosen": self.chosen.describe() if self.chosen else None, "reason": self.reason}

    def __repr__(self) -> str:
        return f"Auto(chosen={self.chosen!r})"


def peek_first_batch(loader: Any) -> Any:
    """The first batch ``loader`` would give, read without iterating it, or None where that is not
    possible: for the activation estimate (:class:`Auto`'s ``example_input``) of a run whose loader
    must stay where it is (an exact resume replays no batch and skips none).

    A ``DataLoader`` over a map-style dataset: its ``collate_fn`` on the dataset's first
    ``batch_size`` samples (iterating it would draw a shuffling seed from torch's generator and
    start workers). A sequence of batches (a list): its first item. Anything else (an iterator, an
    iterable or streaming dataset, a custom batch sampler): None. The random number generators of
    torch (CPU), ``random`` and NumPy are put back afterwards, so a dataset whose ``__getitem__``
    draws (random augmentation) leaves the run's draws as they were. Only the batch's shapes
    matter to the estimate: which samples are read does not.
    """
    import random

    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(loader, DataLoader):
        dataset, size = loader.dataset, loader.batch_size
        if size is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            return None
        count = min(size, len(dataset))
        if count == 0:
            return None
        python_state = random.getstate()
        numpy_random: Any = None
        try:
            import numpy

            numpy_random = numpy.random
        except ImportError:  # NumPy is optional
            pass
        numpy_state = numpy_random.get_state() if numpy_random is not None else None
        try:
            with torch.random.fork_rng(devices=[]):
                return loader.collate_fn([dataset[i] for i in range(count)])
        finally:
            random.setstate(python_state)
            if numpy_random is not None:
                numpy_random.set_state(numpy_state)
    if isinstance(loader, (list, tuple)) and loader:
        return loader[0]
    return None
