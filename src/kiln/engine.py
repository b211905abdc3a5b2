"""The Engine: one optimisation step over a plain PyTorch loop (Colossal-AI's ``initialize``).

    engine, train_dl, test_dl, lr_scheduler = kiln.initialize(model, optimizer, criterion, train_dl, test_dl)
    for x, y in train_dl:
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        engine.step()

The Engine applies the precision policy (autocast, input casts, loss scaling), gradient
accumulation over N ``step()`` calls and device placement of batches. Everything else is a method
of the strategy, called unconditionally: placement, DDP gradient sync only on the last
accumulation step, loss, backward, global-norm clipping and the optimizer step (the Engine never
asks which strategy it runs under). Its per-step path does no host synchronisation and no
allocation a raw loop would not do.

:meth:`Engine.train_step` is the one home of a whole optimisation step over microbatches: their
weights, gradient sync only on the last, unscaling and clipping once, the optimizer step, and the
caller's callbacks at the points between. The Trainer, SAM's second pass, nnScaler's gradient
reductions and Colossal-AI's ``Trainer(engine=...)`` all go through it; the four-line loop's
``step()`` ends in the same :meth:`optimizer_step`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from kiln.core.batch import microbatch_weights
from kiln.launch import heartbeat
from kiln.launch.config import Config, load_config
from kiln.launch.context import Context, context
from kiln.launch.data import ensure_distributed_sampler
from kiln.launch.join import join_launcher
from kiln.optim.implementation import apply_default_implementation
from kiln.parallel.strategy import Strategy, get_strategy
from kiln.parallel.transforms.parallelize import ParallelizeOptions
from kiln.precision import Precision, get_precision, precision_from_config

__all__ = ["Engine", "initialize", "GradAccumLRScheduler", "move_to_device"]


def move_to_device(data: Any, device: torch.device) -> Any:
    """Move tensors in nested lists, tuples and dicts to ``device`` (non-blocking)."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, (list, tuple)):
        return type(data)(move_to_device(d, device) for d in data)
    if isinstance(data, Mapping):
        return type(data)(  # type: ignore[call-arg]  # its own mapping class, which takes a dict
            {k: move_to_device(v, device) for k, v in data.items()}
        )
    return data


class Engine:
    """Model, optimizer and criterion behind the calls of a plain training loop.

    Args:
        model: the user's module.
        optimizer: a torch optimizer over ``model``'s parameters.
        criterion: the loss function ``criterion(outputs, targets)``.
        precision: a precision name, dict or :class:`kiln.precision.Precision`.
        strategy: a strategy name or object (``"auto"``: single for one rank, ddp for more).
        gradient_accumulation: number of ``step()`` calls per optimizer step.
        clip_grad_norm: clip the global gradient norm to this value before each optimizer step.
        compile: ``True`` or a dict of ``torch.compile`` arguments: the strategy compiles each
            block's forward (see :class:`kiln.parallel.ParallelizeOptions`); None leaves the
            strategy's ``parallelize_options`` as they are.
        activation_checkpointing: ``"full"``, ``"selective"``, ``"selective:N"`` or
            ``fn(module) -> bool``: the blocks whose activations the backward recomputes.
        float8: ``True`` or a dict of torchao float8 settings (:mod:`kiln.parallel.transforms.float8`).
        ctx: the :class:`kiln.Context`; defaults to ``kiln.context()``.

    Example::

        engine = kiln.Engine(model, torch.optim.SGD(model.parameters(), 0.1), nn.CrossEntropyLoss(),
                             precision="amp_bf16", gradient_accumulation=4)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        *,
        precision: str | Mapping[str, Any] | Precision | None = None,
        strategy: str | Strategy | None = "auto",
        gradient_accumulation: int = 1,
        clip_grad_norm: float | None = None,
        compile: bool | Mapping[str, Any] | None = None,
        activation_checkpointing: str | Callable[[nn.Module], bool] | None = None,
        float8: bool | Mapping[str, Any] | None = None,
        ctx: Context | None = None,
    ) -> None:
        _check_accumulation(gradient_accumulation)
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm={clip_grad_norm!r} must be a positive number (or None for no clipping)")
        # checked first
        levers = ParallelizeOptions(compile=compile, activation_checkpointing=activation_checkpointing, float8=float8)
        self.ctx = ctx or context()
        self.precision = get_precision(precision)
        self.strategy = get_strategy(strategy, self.ctx)
        if levers != ParallelizeOptions():  # the strategy applies them in its setup, which runs next
            own = self.strategy.parallelize_options  # what is not given here stays the strategy's
            self.strategy.parallelize_options = dataclasses.replace(
                own,
                compile=own.compile if levers.compile is None else levers.compile,
                activation_checkpointing=levers.activation_checkpointing or own.activation_checkpointing,
                float8=own.float8 if levers.float8 is None else levers.float8,
            )
        self.strategy.configure(gradient_accumulation=gradient_accumulation, clip_grad_norm=clip_grad_norm)
        self.model, self.optimizer = self.strategy.setup(model, optimizer, self.ctx, self.precision)
        # fused/foreach steps where the user chose neither, now that the parameters are placed and
        # sharded (a pipeline, which builds its stages later, chooses again then)
        apply_default_implementation(self.optimizer)
        # which batch this rank reads: tensor and pipeline groups share one
        self.data_parallel_rank, self.data_parallel_size = self.strategy.data_parallel(self.ctx)
        self._criterion = criterion
        self.clip_grad_norm = clip_grad_norm
        self.scaler = self.strategy.make_scaler(self.precision, self.ctx.device)
        self.device = self.ctx.device
        self._accum = gradient_accumulation
        # what backward() multiplies the loss by (None: nothing); the setter below keeps it in step
        self._loss_scale = None if gradient_accumulation == 1 else 1.0 / gradient_accumulation
        self._micro = 0
        self.last_grad_norm: torch.Tensor | None = None
        self._in_step = False  # train_step() decides gradient sync, not the forward
        # Decided once here so the per-step path is a few attribute reads, not type checks.
        self._move = self.device.type != "cpu"
        self._cast = self.precision.casts_inputs
        self._autocast = self.precision.autocast_dtype is not None
        # A strategy method the strategy does not override is the base class's one-liner; the
        # per-step path runs those inline instead of through a call each (benchmarks/overhead.py).
        # The strategy still defines them: an override is always called.
        kind = type(self.strategy)
        self._inline_loss = kind.loss is Strategy.loss
        self._inline_backward = kind.backward is Strategy.backward and self.scaler is None
        self._inline_step = kind.optimizer_step is Strategy.optimizer_step and self.scaler is None
        self._gradient_sync: Callable[[], bool] | None = None  # set_gradient_sync's
        # A strategy that runs each microbatch inside a context (context parallelism) takes the general path.
        self._microbatch_context = self.strategy.wraps_microbatches
        # Where this rank is, for the heartbeat of a plain Engine loop (a Trainer describes its events instead).
        self._last_call, self._num_steps = "initialize", 0
        heartbeat.follow(self._describe, replace=False)

    # -- the four lines of a training loop ---------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._last_call = "forward"
        if self._move:
            args, kwargs = move_to_device(args, self.device), move_to_device(kwargs, self.device)
        if self._cast:
            args, kwargs = self.precision.cast_input(args), self.precision.cast_input(kwargs)
        if self._accum > 1 and not self._in_step:
            # Only the last micro-step's backward all-reduces; DDP decides this at forward time.
            self.strategy.set_grad_sync(self.model, self._micro == self._accum - 1)
        if self._autocast:
            with self.precision.autocast(self.device):
                return self.model(*args, **kwargs)
        return self.model(*args, **kwargs)

    def criterion(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The loss, computed under the same autocast as the forward."""
        if self._criterion is None:
            raise RuntimeError("this Engine has no criterion; pass criterion= to kiln.initialize")
        if self._move:
            args, kwargs = move_to_device(args, self.device), move_to_device(kwargs, self.device)
        if self._autocast:
            with self.precision.autocast(self.device):
                return self.strategy.loss(self.model, self._criterion, *args, **kwargs)
        if self._inline_loss:
            return self._criterion(*args, **kwargs)
        return self.strategy.loss(self.model, self._criterion, *args, **kwargs)

    def backward(self, loss: torch.Tensor, *, weight: float | None = None) -> None:
        """Backward of ``loss`` divided by the accumulation count (or times ``weight`` when given,
        which the Trainer uses for microbatches of unequal size), scaled for fp16."""
        self._last_call = "backward"
        scale = self._loss_scale if weight is None else weight
        if self._inline_backward:
            (loss if scale is None else loss * scale).backward()
        else:
            self.strategy.backward(self.model, loss, scale, self.scaler)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero gradients at the start of an accumulation cycle; a no-op inside one."""
        if self._micro == 0 and self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> bool:
        """Count a micro-step; on the last of ``gradient_accumulation`` unscale, clip and step.

        Returns True when the optimizer stepped (a GradScaler may still skip the update on inf/nan).
        """
        self._micro += 1
        if self._micro < self._accum:
            return False
        self._micro = 0
        if self._inline_step and self.clip_grad_norm is None and self.optimizer is not None:
            self._last_call = "optimizer_step"  # optimizer_step() with nothing to do around the step
            self._num_steps += 1
            self.optimizer.step()
            return True
        self.optimizer_step()
        return True

    def set_gradient_sync(self, sync: Callable[[], bool] | None) -> None:
        """Call ``sync()`` on the complete gradients before each optimizer step (before clipping and
        ``before_optimizer_step``); when it returns False the step is dropped and the weights stay.
        kiln's replica fault tolerance averages over the replica groups there and asks the quorum
        whether to commit (:mod:`kiln.trainer.fault_tolerance`). ``None`` removes it."""
        self._gradient_sync = sync
        # The inline steps bypass optimizer_step(), where the sync runs: off while there is one.
        plain = type(self.strategy).optimizer_step is Strategy.optimizer_step and self.scaler is None
        self._inline_step = plain and sync is None

    def optimizer_step(self, before_optimizer_step: Callable[[], None] | None = None) -> None:
        """Unscale, clip and step now, whatever the accumulation counter says.

        ``before_optimizer_step`` runs on the final gradients: unscaled (fp16) and clipped, with
        :attr:`last_grad_norm` the norm before clipping. Under DeepSpeed, which clips inside its
        step, it sees them unclipped.
        """
        self._last_call = "optimizer_step"
        self._num_steps += 1
        optimizer = self.optimizer
        if optimizer is None:
            raise RuntimeError("this Engine has no optimizer; pass one to kiln.initialize")
        if self._gradient_sync is not None and not self._gradient_sync():
            return  # the replica groups did not commit this step: no update anywhere
        if self.clip_grad_norm is not None:
            # None when the strategy clips inside its optimizer step (DeepSpeed)
            self.last_grad_norm = self.strategy.clip_gradients(self.model, optimizer, self.clip_grad_norm, self.scaler)
        elif before_optimizer_step is not None and self.scaler is not None:
            self.scaler.unscale_(optimizer)  # the callbacks see the true gradients
        if before_optimizer_step is not None:
            before_optimizer_step()
        if self._inline_step:
            optimizer.step()
            return
        norm = self.strategy.optimizer_step(self.model, optimizer, self.scaler)
        if norm is not None:  # measured inside the step by a strategy that clips there (DeepSpeed)
            self.last_grad_norm = norm

    def train_step(
        self,
        microbatches: Sequence[Any],
        loss_of: Callable[[Any], torch.Tensor],
        *,
        weighting: str | Sequence[float] = "samples",
        after_backward: Callable[[], None] | None = None,
        after_microbatches: Callable[[torch.Tensor], None] | None = None,
        before_optimizer_step: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """One optimizer step over ``microbatches`` (one micro-step of it when the Engine accumulates).

        In order: zero the gradients (at the start of an accumulation cycle); for each microbatch,
        ``loss = loss_of(microbatch)`` (the caller's forward and loss, with whatever it fires
        between) and its backward, times the microbatch's weight, with gradients synchronised only
        on the step's last backward, then ``after_backward()``; ``after_microbatches(loss)`` with
        the step's loss (gradients complete, still scaled under fp16); then, once the accumulation
        cycle is complete, :meth:`optimizer_step`: unscale and clip once, ``before_optimizer_step()``,
        step. An exception from a callback leaves the step undone (no optimizer step, no count),
        so a caller may retry the batch (the Trainer does on out-of-memory).

        Args:
            microbatches: the pieces of one batch (a batch that is not split: a one-element list).
            loss_of: ``fn(microbatch) -> loss``; runs the forward (through this Engine).
            weighting: ``"samples"`` (each microbatch by its share of samples: the batch mean),
                ``"sum"``, ``"tokens"`` (by its share of ``input_ids``) or one float per microbatch;
                see :func:`kiln.core.batch.microbatch_weights`. Under ``gradient_accumulation`` the
                weights are divided by it as well.
            after_backward, after_microbatches, before_optimizer_step: the caller's callbacks.

        Returns:
            The step's loss: ``loss_of``'s result for one microbatch, else the weighted sum of the
            (detached) microbatch losses.

        Example::

            loss = engine.train_step(split_batch(batch, 8), lambda mb: engine.criterion(engine(mb[0]), mb[1]))
        """
        optimizer = self.optimizer
        if (
            self._accum == 1
            and len(microbatches) == 1
            and (weighting == "samples" or weighting == "sum")
            and not self._microbatch_context
        ):
            # The common step, the general path below without its bookkeeping (the hot path of the
            # Trainer: benchmarks/overhead.py): one microbatch, weight 1, DDP's sync left on.
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            loss = loss_of(microbatches[0])
            self._last_call = "backward"
            if self._inline_backward:
                loss.backward()
            else:
                self.strategy.backward(self.model, loss, None, self.scaler)
            if after_backward is not None:
                after_backward()
            if after_microbatches is not None:
                after_microbatches(loss)
            if (
                self._inline_step
                and before_optimizer_step is None
                and self.clip_grad_norm is None
                and optimizer is not None
            ):
                self._last_call = "optimizer_step"  # optimizer_step() with nothing to do around the step
                self._num_steps += 1
                optimizer.step()
                return loss
            self.optimizer_step(before_optimizer_step)
            return loss
        if self._micro == 0 and optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        cycle_ends = self._micro == self._accum - 1
        loss = self.backward_microbatches(
            microbatches, loss_of, weighting=weighting, sync=cycle_ends, after_backward=after_backward
        )
        if after_microbatches is not None:
            after_microbatches(loss)
        if cycle_ends:
            self._micro = 0
            self.optimizer_step(before_optimizer_step)
        else:
            self._micro += 1
        return loss

    def backward_microbatches(
        self,
        microbatches: Sequence[Any],
        loss_of: Callable[[Any], torch.Tensor],
        *,
        weighting: str | Sequence[float] = "samples",
        sync: bool = True,
        after_backward: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Forward, loss and weighted backward of each microbatch, adding to the gradients; the
        last backward synchronises them across ranks when ``sync``. The first half of
        :meth:`train_step`, for passes that add gradients without a step of their own (SAM's
        second pass). Returns the step's loss as :meth:`train_step` does."""
        if not microbatches:
            raise ValueError("microbatches is empty: a step needs at least one microbatch")
        accum = self._accum
        weights = microbatch_weights(microbatches, weighting)
        last = len(microbatches) - 1
        # DDP decides at forward time whether a backward synchronises: set it per microbatch only when
        # there is more than one backward per step (a plain step leaves DDP's default on).
        sync_each = last > 0 or accum > 1
        strategy, model, scaler = self.strategy, self.model, self.scaler
        total: torch.Tensor | None = None
        loss: torch.Tensor | None = None
        self._in_step = True
        try:
            for index, microbatch in enumerate(microbatches):
                if sync_each:
                    strategy.set_grad_sync(model, sync and index == last)
                with strategy.microbatch_context(microbatch):
                    loss = loss_of(microbatch)
                    self._last_call = "backward"
                    if weights is None:
                        strategy.backward(model, loss, self._loss_scale, scaler)
                    else:
                        weight = weights[index]
                        strategy.backward(model, loss, weight if accum == 1 else weight / accum, scaler)
                        part = loss.detach() * weight
                        total = part if total is None else total + part
                if after_backward is not None:
                    after_backward()
        finally:
            self._in_step = False
        assert loss is not None  # at least one microbatch ran
        return loss if total is None else total

    def _describe(self) -> str:
        """``Engine.backward (step 5)``: the last Engine call and the optimizer step it belongs to."""
        step = self._num_steps + (self._last_call != "optimizer_step")
        return f"Engine.{self._last_call} (step {step})"

    # -- modes and state ---------------------------------------------------------------------
    def train(self, mode: bool = True) -> Engine:
        self.model.train(mode)
        return self

    def eval(self) -> Engine:
        self.model.eval()
        return self

    @property
    def gradient_accumulation(self) -> int:
        return self._accum

    @gradient_accumulation.setter
    def gradient_accumulation(self, value: int) -> None:
        _check_accumulation(value)
        self._accum = value
        self._loss_scale = None if value == 1 else 1.0 / value
        self._micro = 0
        if value == 1:
            self.strategy.set_grad_sync(self.model, True)

    @property
    def micro_step(self) -> int:
        """Backward passes counted so far in the current accumulation cycle (0: at a boundary)."""
        return self._micro

    @micro_step.setter
    def micro_step(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self._accum:
            raise ValueError(
                f"micro_step={value!r} must be an int in [0, {self._accum}) for gradient_accumulation={self._accum}"
            )
        self._micro = value

    @property
    def module(self) -> nn.Module:
        """The user's model without strategy wrappers."""
        return self.strategy.unwrap(self.model)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.module.state_dict(), "micro_step": self._micro}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        if "optimizer" in state and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if "scaler" in state and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._micro = int(state.get("micro_step", 0))


def _check_accumulation(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"gradient_accumulation={value!r} must be an integer >= 1")


class GradAccumLRScheduler:
    """Wraps an LR scheduler so that it advances once per ``accumulation`` calls to ``step()``,
    in step with the optimizer under gradient accumulation (Colossal-AI does the same)."""

    def __init__(self, scheduler: Any, accumulation: int) -> None:
        self.scheduler = scheduler
        self.accumulation = accumulation
        self._calls = 0

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._calls += 1
        if self._calls % self.accumulation == 0:
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "calls": self._calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self._calls = int(state["calls"])


def _parallel_size(value: Any) -> int:
    """A Colossal-AI ``parallel`` entry's size: ``2`` or ``dict(size=2, mode="1d")``."""
    if isinstance(value, Mapping):
        value = value.get("size", 1)
    try:
        return int(value if value is not None else 1)
    except (TypeError, ValueError):
        raise ValueError(f"config parallel entry {value!r} is not a size; expected an int or dict(size=N)") from None


def _check_colossal_parallel(cfg: Mapping[str, Any]) -> None:
    """Refuse Colossal-AI's ``parallel=dict(pipeline=..., tensor=...)`` sizes above 1 when no
    ``strategy`` says how: kiln does not read them, and running on data parallelism alone would
    train a different model layout than the config asks for without a word."""
    parallel = cfg.get("parallel")
    if not isinstance(parallel, Mapping) or "strategy" in cfg:
        return  # no parallel section (or data only), or the user chose kiln's strategy explicitly
    pp, tp = _parallel_size(parallel.get("pipeline", 1)), _parallel_size(parallel.get("tensor", 1))
    if pp > 1 or tp > 1:
        raise ValueError(
            f"config parallel={dict(parallel)!r} asks for pipeline={pp}, tensor={tp}, which kiln does not read "
            f"from Colossal-AI's parallel section; say it with kiln's strategy instead, e.g. "
            f"strategy=dict(name='hybrid', pp={pp}, tp={tp}, split_points=[...]) (or 'tp' / 'pp' alone)"
        )


def _strategy_from_config(cfg: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    _check_colossal_parallel(cfg)
    spec = cfg.get("strategy", "auto")
    if isinstance(spec, Mapping):
        options = dict(spec)
        name = options.pop("name", None) or options.pop("type", None)
        if name is None:
            raise ValueError(f"config strategy={dict(spec)!r} needs a 'name' key (e.g. 'ddp')")
        return name, options
    return spec, dict(cfg.get("strategy_options", {}) or {})


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    criterion: Callable[..., torch.Tensor] | None = None,
    train_dataloader: Any = None,
    test_dataloader: Any = None,
    lr_scheduler: Any = None,
    config: Config | Mapping[str, Any] | str | None = None,
) -> tuple[Engine, Any, Any, Any]:
    """Wrap model, optimizer and criterion in an :class:`Engine` as the config asks.

    Reads ``precision`` (or Colossal-AI's ``fp16=dict(mode=kiln.AMP_TYPE.TORCH)``),
    ``gradient_accumulation``, ``clip_grad_norm``, ``strategy``, ``compile`` and
    ``activation_checkpointing`` from ``config``
    (default: ``kiln.context().config``). Dataloaders get a distributed sampler when the world is
    larger than one; the LR scheduler steps once per accumulation cycle.

    Example::

        engine, train_dl, test_dl, lr_scheduler = kiln.initialize(model, optimizer, criterion, train_dl, test_dl)
    """
    ctx = join_launcher()  # under torchrun, SLURM or Open MPI: their world, as launch_from_* would
    cfg = ctx.config if config is None else load_config(config)
    name, options = _strategy_from_config(cfg)
    engine = Engine(
        model,
        optimizer,
        criterion,
        precision=precision_from_config(cfg),
        strategy=get_strategy(name, ctx, **options),
        gradient_accumulation=cfg.get("gradient_accumulation", 1),
        clip_grad_norm=cfg.get("clip_grad_norm"),
        compile=cfg.get("compile"),
        activation_checkpointing=cfg.get("activation_checkpointing"),
        float8=cfg.get("float8"),
        ctx=ctx,
    )
    seed = cfg.get("seed", 1024)
    dp = engine.data_parallel_size, engine.data_parallel_rank
    train_dataloader = ensure_distributed_sampler(train_dataloader, seed, *dp)
    test_dataloader = ensure_distributed_sampler(test_dataloader, seed, *dp)
    if lr_scheduler is not None and engine.gradient_accumulation > 1:
        lr_scheduler = GradAccumLRScheduler(lr_scheduler, engine.gradient_accumulation)
    return engine, train_dataloader, test_dataloader, lr_scheduler
