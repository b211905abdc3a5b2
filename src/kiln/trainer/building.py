"""How the Trainer's parts are built from its arguments: the Engine, the loss, the schedulers.

Kept apart from ``trainer.py`` so that file holds the loop; everything here runs once, in
``Trainer.__init__``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from kiln.core.batch import num_samples, split_batch
from kiln.core.model import Model
from kiln.core.names import did_you_mean
from kiln.engine import Engine
from kiln.launch.context import Context, resolve_device
from kiln.trainer.options import LeverOptions, MicrobatchOptions

__all__ = ["build_engine", "targets_loss", "check_algorithms", "split_schedulers", "check_schedulers"]


def build_engine(
    model: nn.Module | None,
    optimizers: Any,
    criterion: Callable[..., torch.Tensor] | None,
    *,
    precision: Any,
    strategy: Any,
    clip_grad_norm: float | None,
    levers: LeverOptions | None = None,
    deepspeed_config: Mapping[str, Any] | str | None,
    algorithms: Sequence[Any],
    batch_size: int | None = None,
    train_dataloader: Any = None,
    microbatching: MicrobatchOptions | None = None,
    device: str | torch.device | None = None,
    ctx: Context,
) -> Engine:
    """The Engine for ``Trainer(model, optimizers=, criterion=, ...)``; ``batch_size``: the training
    loader's, per rank (DeepSpeed's config takes it when it names no batch size); ``device``: the
    Trainer's ``device=`` (see :func:`kiln.launch.context.resolve_device`); ``levers``: compile and
    activation checkpointing, which the Engine hands to the strategy before its setup;
    ``train_dataloader`` and ``microbatching``: where ``strategy="auto"`` takes its example
    microbatch (:func:`_auto_with_example`)."""
    if model is None:
        raise ValueError("Trainer needs model= (or engine= in the Colossal-AI form)")
    # The one place device= takes effect: the strategy places the model on ctx.device and the
    # Engine moves batches there, so a Context on the chosen device decides both.
    resolved = resolve_device(device, ctx)
    if resolved != ctx.device:
        ctx = dataclasses.replace(ctx, device=resolved)
    if not isinstance(model, Model) and criterion is None:
        raise ValueError(
            f"model is a plain {type(model).__name__}; pass criterion= (e.g. nn.CrossEntropyLoss()) "
            "or make it a kiln.Model with a loss(outputs, batch) method"
        )
    optimizer = _single_optimizer(optimizers) or torch.optim.SGD(model.parameters(), lr=0.1)
    if deepspeed_config is not None:  # Composer's switch: any dict, {} included, means DeepSpeed
        strategy = _deepspeed_strategy(strategy, deepspeed_config, batch_size)
    strategy = _auto_with_example(strategy, model, train_dataloader, microbatching, ctx)
    if any(getattr(a, "find_unused_parameters", False) for a in algorithms):
        from kiln.parallel.strategy import get_strategy

        strategy = get_strategy(strategy, ctx)
        strategy.find_unused_parameters = True
    engine = Engine(
        model,
        optimizer,
        model.loss if isinstance(model, Model) else criterion,
        precision=precision,
        strategy=strategy,
        clip_grad_norm=clip_grad_norm,
        compile=levers.compile if levers is not None else None,
        activation_checkpointing=levers.activation_checkpointing if levers is not None else None,
        float8=levers.float8 if levers is not None else None,
        ctx=ctx,
    )
    return engine


def default_callbacks(model: nn.Module, callbacks: list[Any], moe_monitor: bool, log_every: int) -> list[Any]:
    """The user's callbacks, and those a run gets by default: a :class:`kiln.callbacks.MoEMonitor`
    (every ``log_every`` batches, with the train metrics) for a model with :class:`kiln.models.MoE`
    layers, unless the callbacks hold one already or ``moe_monitor`` is False. The monitor logs the
    router statistics and runs the bias balancing of ``load_balance="bias"`` layers, which a run
    without it would silently skip."""
    from kiln.callbacks.moe_monitor import MoEMonitor
    from kiln.models.moe import moe_layers

    if not moe_monitor or any(isinstance(c, MoEMonitor) for c in callbacks):
        return callbacks
    if next(moe_layers(model), None) is None:
        return callbacks
    return [*callbacks, MoEMonitor(interval=log_every)]


def _auto_with_example(
    strategy: Any, model: nn.Module, loader: Any, microbatching: MicrobatchOptions | None, ctx: Context
) -> Any:
    """``strategy="auto"`` (or an ``Auto`` without ``example_input``) with the training loader's first
    microbatch as its example, so its plan counts activations. The loader is only peeked at
    (:func:`kiln.cost.auto.peek_first_batch`): its position and the run's random draws stay
    as they were. Any other strategy, or a loader that cannot be peeked, is left as it is."""
    from kiln.cost.auto import Auto, peek_first_batch
    from kiln.parallel.strategy import get_strategy

    named_auto = strategy is None or (isinstance(strategy, str) and strategy.lower() == "auto")
    if loader is None or not (named_auto or isinstance(strategy, Auto)):
        return strategy
    strategy = get_strategy(strategy, ctx)  # "auto" on one rank is single: nothing to plan
    if not isinstance(strategy, Auto) or strategy.example_input is not None:
        return strategy
    batch = peek_first_batch(loader)
    if batch is None:
        return strategy
    try:
        size = num_samples(batch)
    except ValueError:  # no tensor in it: nothing to measure
        return strategy
    if microbatching is not None and microbatching.splits_batches:
        microbatch = microbatching.microbatch_size(size)
        if microbatch < size:  # the estimate is of one microbatch, as the step runs them
            batch = split_batch(batch, microbatch)[0]
    if not isinstance(model, Model) and isinstance(batch, (tuple, list)) and batch:
        batch = (batch[0],)  # (inputs, targets): the forward takes the inputs, as one argument
    device = next((p.device for p in model.parameters()), None)
    if device is not None:  # where the model is now: the estimate runs before the strategy places it
        from torch.utils._pytree import tree_map_only

        batch = tree_map_only(torch.Tensor, lambda t: t.to(device), batch)
    strategy.use_loader_example(batch)
    return strategy


def _single_optimizer(optimizers: Any) -> torch.optim.Optimizer | None:
    if optimizers is None:
        return None
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers
    if isinstance(optimizers, str):  # a name, where the YAML's optimizer.type would take one
        names = [
            n
            for n, c in vars(torch.optim).items()
            if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
        ]
        raise ValueError(
            f"optimizers={optimizers!r} is a name, not an optimizer; pass one built on the model's "
            "parameters, e.g. torch.optim.AdamW(model.parameters())"
            + did_you_mean(optimizers.removeprefix("torch.optim."), names, fold_case=True, prefix="torch.optim.")
        )
    optimizers = list(optimizers)
    if len(optimizers) != 1:
        raise ValueError(f"optimizers has {len(optimizers)} optimizers; kiln trains with exactly one")
    return optimizers[0]


def _deepspeed_strategy(strategy: Any, deepspeed_config: Mapping[str, Any] | str, batch_size: int | None) -> Any:
    from kiln.parallel.deepspeed import DeepSpeed

    if strategy not in (None, "auto", "deepspeed"):
        raise ValueError(
            f"deepspeed_config= is given with strategy={strategy!r}: deepspeed_config selects the "
            "deepspeed strategy; drop one of them"
        )
    ds = DeepSpeed(deepspeed_config)
    if batch_size and "train_batch_size" not in ds.config:
        # Composer fills it from the loader too. The Trainer's grad_accum splits this batch itself,
        # so DeepSpeed sees one micro-batch of the whole per-rank batch per optimizer step.
        ds.config.setdefault("train_micro_batch_size_per_gpu", batch_size)
    return ds


def targets_loss(criterion: Callable[..., torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """``criterion(outputs, targets)`` as a loss of ``(outputs, batch)`` for ``(inputs, targets)`` batches."""

    def loss(outputs: Any, batch: Any) -> torch.Tensor:
        return criterion(outputs, batch[1])

    return loss


def check_algorithms(algorithms: Sequence[Any], engine: Engine) -> None:
    """Algorithms that cannot run together, and clipping asked for twice, fail before training."""
    if algorithms:
        from kiln.algorithms import GradientClipping, check_algorithm_compatibility

        check_algorithm_compatibility(algorithms)
        if engine.clip_grad_norm is not None and any(isinstance(a, GradientClipping) for a in algorithms):
            raise ValueError("clip_grad_norm= and the GradientClipping algorithm both clip gradients; keep one of them")


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer whose ``param_groups`` hold the learning rate: ``optimizer`` itself, or the
    one a strategy's wrapper holds (DeepSpeed's ZeRO optimizer shares its param_groups)."""
    inner = optimizer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def split_schedulers(schedulers: Any, state: Any, every_batch: bool | None, ssr: float) -> tuple[list[Any], list[Any]]:
    """(stepped every batch, stepped every epoch). Time-aware (Composer) schedulers, and functions
    ``f(state)``/``f(state, ssr)``, are compiled into a torch scheduler stepped every batch; torch
    schedulers step per epoch unless ``every_batch``, and are stretched by ``ssr`` as Composer does
    (or refused when they cannot be). Each one is also added to ``state.schedulers`` (checkpointed)."""
    per_batch: list[Any] = []
    per_epoch: list[Any] = []
    if schedulers is None:
        return per_batch, per_epoch
    from kiln.optim.lr_scheduler import compile_composer_scheduler, scale_torch_scheduler
    from kiln.optim.schedulers import ComposerScheduler

    for scheduler in schedulers if isinstance(schedulers, (list, tuple)) else [schedulers]:
        if isinstance(scheduler, ComposerScheduler) or (callable(scheduler) and not hasattr(scheduler, "step")):
            if state.optimizer is None:
                raise ValueError("a time-aware scheduler needs an optimizer; pass optimizers=")
            scheduler = compile_composer_scheduler(scheduler, state, _torch_optimizer(state.optimizer), ssr=ssr)
            per_batch.append(scheduler)
        else:
            scale_torch_scheduler(scheduler, ssr)
            (per_batch if every_batch else per_epoch).append(scheduler)
        state.schedulers.append(scheduler)
    return per_batch, per_epoch


def check_schedulers(schedulers: Sequence[Any], state: Any) -> None:
    """Evaluate each time-aware schedule once at fit start, so a schedule that cannot cover the run
    (e.g. a warmup scheduler whose ``t_max`` ends before ``max_duration``) fails before training."""
    if not schedulers:
        return  # fit() asks every call: no import to look up
    from kiln.optim.lr_scheduler import ComposerLRScheduler

    for scheduler in schedulers:
        if isinstance(scheduler, ComposerLRScheduler):
            scheduler._schedule(state, scheduler.ssr)
