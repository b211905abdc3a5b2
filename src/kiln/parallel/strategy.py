"""The strategy interface and its registry.

A strategy decides how model and optimizer are spread over the world. Each one is a class in its
own file; adding one is a new file plus one line in ``_BUILTIN`` below (strategy objects, not
type switches). The Engine calls the strategy's methods unconditionally and never asks which
strategy it runs under (Lightning Fabric's pattern):

=======================  ======================================================================
``setup``                wrap model and optimizer: the model through :mod:`kiln.parallel.transforms.parallelize`
``make_scaler``          the fp16 loss scaler, if any (DeepSpeed: none, it scales itself)
``set_grad_sync``        whether the next backward synchronises gradients (before the forward)
``microbatch_context``   what a training microbatch's forward and backward run inside
``loss``                 the loss of an Engine forward (Pipeline records it for its schedule)
``backward``             backward of ``loss * scale`` through the scaler (DeepSpeed: its engine;
                         Pipeline: the whole schedule)
``clip_gradients``       unscale and clip to a global norm (``clip_grad_norm_``)
``optimizer_step``       step the optimizer through the scaler (DeepSpeed: clips inside)
``unwrap``               the plain module underneath
=======================  ======================================================================

A strategy overrides only what differs from a single device. ``setup`` runs the model
transformations the strategy declares in ``steps`` (placement, float8, tensor parallel,
expert parallel, activation checkpointing, compile, data parallel), always in the order of
:mod:`kiln.parallel.transforms.parallelize`, each through an ``apply_<step>`` method that a strategy may
override on its own; ``parallelize_plan`` validates the strategy's options and builds its mesh
before the first step. The checkpoint layer asks for model and optimizer state
(``state_dict``/``load_state_dict``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kiln.core.names import did_you_mean
from kiln.parallel.transforms import parallelize as _steps
from kiln.parallel.transforms.parallelize import ParallelizeOptions, ParallelizePlan, find_blocks, parallelize

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = ["Strategy", "register_strategy", "get_strategy", "strategy_names"]

# name -> "module:Class"; imported on first use so `import kiln` stays cheap.
_BUILTIN: dict[str, str] = {
    "single": "kiln.parallel.single:SingleDevice",
    "ddp": "kiln.parallel.ddp:DDP",
    "zero1": "kiln.parallel.zero:Zero1",
    "zero2": "kiln.parallel.fsdp:Zero2",
    "zero3": "kiln.parallel.fsdp:Zero3",
    "fsdp": "kiln.parallel.fsdp:FSDP",
    "tp": "kiln.parallel.tensor:TensorParallel",
    "pp": "kiln.parallel.pipeline:Pipeline",
    "hybrid": "kiln.parallel.hybrid:Hybrid",
    "deepspeed": "kiln.parallel.deepspeed:DeepSpeed",
    "auto": "kiln.cost.auto:Auto",
}
_REGISTERED: dict[str, type[Strategy]] = {}


class Strategy:
    """How a model and its optimizer are placed on the world.

    Subclasses set ``name`` and override what differs from a single device: the ``steps`` they
    apply, an ``apply_<step>`` method, ``parallelize_plan`` or ``setup`` itself.

    Example::

        class ChannelsLast(kiln.parallel.Strategy):
            name = "channels_last"
            def apply_placement(self, model, plan):
                return super().apply_placement(model, plan).to(memory_format=torch.channels_last)
        kiln.parallel.register_strategy(ChannelsLast)
    """

    name: ClassVar[str] = "base"
    # The model transformations setup applies (kiln.parallel.transforms.parallelize.STEPS gives their order):
    # a single device's. Strategies add tensor_parallel / data_parallel, or apply none (deepspeed).
    steps: ClassVar[tuple[str, ...]] = ("placement", "float8", "activation_checkpointing", "compile")
    # compile= / activation_checkpointing= / float8=, set before setup (all None: those steps do nothing).
    parallelize_options: ParallelizeOptions = ParallelizeOptions()
    # Set by setup() when only some ranks read different batches (tensor/pipeline groups share one).
    data_parallel_rank: int | None = None
    data_parallel_size: int | None = None
    # Set by the Trainer when an algorithm leaves parameters without gradients on some steps;
    # DDP-based strategies pass it to DistributedDataParallel (an explicit ddp kwarg wins).
    find_unused_parameters: bool = False

    @property
    def fixed_batch_rows(self) -> bool:
        """Whether every forward must see the same number of rows (a traced pipeline's shapes are
        fixed): evaluation then pads a short last batch and drops the padding's outputs."""
        return False

    def configure(self, *, gradient_accumulation: int, clip_grad_norm: float | None) -> None:
        """Told before ``setup`` how the Engine accumulates and clips; a strategy that does either
        itself (DeepSpeed) reads them here."""

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Context, precision: Precision
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Place ``model`` (and its optimizer) on ``ctx``; returns the objects to train with.

        The model goes through the declared ``steps``; the optimizer follows any parameter a step
        replaced (it keeps its object, param groups and hyperparameters)."""
        plan = self.parallelize_plan(model, ctx, precision)
        return parallelize(self, model, plan, optimizer=optimizer), optimizer

    # -- the model transformations (kiln.parallel.transforms.parallelize runs the declared ones in its order) --
    def parallelize_plan(self, model: nn.Module, ctx: Context, precision: Precision) -> ParallelizePlan:
        """What ``setup`` applies. Strategies with options check them here, before any collective,
        then build their mesh (:meth:`ParallelizePlan.on_mesh`)."""
        return ParallelizePlan(
            ctx=ctx, precision=precision, options=self.parallelize_options, blocks=find_blocks(model)
        )

    def apply_placement(self, model: nn.Module, plan: ParallelizePlan) -> nn.Module:
        return _steps.apply_placement(model, plan)

    def apply_float8(self, model: nn.Module, plan: ParallelizePlan) -> nn.Module:
        return _steps.apply_float8(model, plan)

    def apply_tensor_parallel(self, model: nn.Module, plan: ParallelizePlan) -> nn.Module:
        return _steps.apply_tensor_parallel(model, plan)

    def apply_expert_parallel(self, model: nn.Module, plan: ParallelizePlan) -> nn.Module:
        return _steps.apply_expert_parallel(model, plan)

    def apply_activation_checkpointing(self, model: nn.Module, plan: ParallelizePlan) -> nn.Module:
        return _steps.apply_activation_checkpointing(model, plan)

    def apply_compile(self, model: nn.Module, plan: ParallelizePlan) -> nn.Module:
        return _steps.apply_compile(model, plan)

    def apply_data_parallel(self, model: nn.Module, plan: ParallelizePlan) -> nn.Module:
        return _steps.fully_shard_blocks(model, plan)

    def make_scaler(self, precision: Precision, device: torch.device) -> torch.amp.GradScaler | None:
        """The loss scaler the Engine hands to ``backward``, ``clip_gradients`` and
        ``optimizer_step`` (None: the precision needs none, or the strategy scales itself)."""
        return precision.make_scaler(device)

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        """Whether the next backward synchronises gradients (off on non-final accumulation steps).

        Called before the forward, because DDP decides at forward time: a flag rather than a
        context manager, since the Engine's forward and backward are separate calls of user code.
        """

    @property
    def wraps_microbatches(self) -> bool:
        """Whether :meth:`microbatch_context` does anything in this run (read after ``setup``; the
        Engine's common step skips it when not)."""
        return False

    def microbatch_context(self, batch: Any) -> AbstractContextManager[None]:
        """What the forward and backward of one training microbatch run inside (the Engine's
        ``train_step`` enters it); context parallelism splits the batch's sequences there."""
        return nullcontext()

    def loss(self, model: nn.Module, criterion: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        """``criterion(*args, **kwargs)`` on the outputs of ``model`` (called under the forward's autocast)."""
        return criterion(*args, **kwargs)

    def backward(
        self, model: nn.Module, loss: torch.Tensor, scale: float | None, scaler: torch.amp.GradScaler | None
    ) -> None:
        """Backward of ``loss * scale`` (``scale`` None: 1), scaled by ``scaler`` when given (fp16).

        ``scale`` is the Engine's 1/accumulation, or the weight of an unequal microbatch.
        """
        if scale is not None:
            loss = loss * scale
        if scaler is not None:
            loss = scaler.scale(loss)
        loss.backward()

    def clip_gradients(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        scaler: torch.amp.GradScaler | None,
    ) -> torch.Tensor | None:
        """Unscale (fp16) and clip to a global norm of ``max_norm``; returns the norm before clipping
        (None: the strategy clips inside :meth:`optimizer_step`)."""
        if scaler is not None:
            assert optimizer is not None  # a scaler only comes with an optimizer
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        return self.clip_grad_norm_(model, max_norm)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients to a global norm of ``max_norm``; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type, foreach=True)

    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> torch.Tensor | None:
        """Step ``optimizer`` (through ``scaler``, which skips an update with inf/nan gradients and
        lowers its scale then). Returns the gradient norm when the step itself clipped (DeepSpeed),
        else None: :meth:`clip_gradients` ran before it."""
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        return None

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module without wrappers."""
        return model

    def state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, full: bool = False
    ) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` keyed by parameter name, for DCP (see
        :mod:`kiln.parallel.state.dcp_state`); shards stay shards unless ``full``."""
        from kiln.parallel.state.dcp_state import get_state_dict

        return get_state_dict(model, optimizer, full=full)

    def load_state_dict(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        state: dict[str, Any],
        *,
        full: bool = False,
        strict: bool = True,
    ) -> None:
        """Load what :meth:`state_dict` returned, after ``dcp.load`` filled it."""
        from kiln.parallel.state.dcp_state import set_state_dict

        set_state_dict(model, optimizer, state, full=full, strict=strict)

    def data_parallel(self, ctx: Context) -> tuple[int, int]:
        """(rank, size) of this process among the ranks that read different batches."""
        if self.data_parallel_size is None or self.data_parallel_rank is None:
            return ctx.rank, ctx.world_size
        return self.data_parallel_rank, self.data_parallel_size

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def register_strategy(cls: type[Strategy], *aliases: str) -> type[Strategy]:
    """Make ``cls`` available by its ``name`` (and aliases) to ``strategy=`` arguments."""
    for name in (cls.name, *aliases):
        _REGISTERED[name] = cls
    return cls


def strategy_names() -> list[str]:
    return sorted({*_BUILTIN, *_REGISTERED, "auto"})


def _lookup(name: str) -> type[Strategy]:
    if name in _REGISTERED:
        return _REGISTERED[name]
    module, _, cls = _BUILTIN[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_strategy(spec: str | Strategy | None, ctx: Context | None = None, **options: Any) -> Strategy:
    """A Strategy from a name (with its options) or an existing object.

    ``"auto"`` (and ``None``) is ``single`` for a world of 1; otherwise :class:`kiln.cost.auto.Auto`,
    which estimates memory per rank at setup and uses ddp, zero1, zero2 or zero3 (``kiln plan``).
    """
    if isinstance(spec, Strategy):
        return spec
    name = "auto" if spec is None else str(spec).lower()
    if name == "auto":
        from kiln.launch.context import context

        if (ctx or context()).world_size == 1 and not options:
            name = "single"  # one rank: nothing to plan
    if name not in _BUILTIN and name not in _REGISTERED:
        names = strategy_names()
        raise ValueError(
            f"strategy={spec!r} is not known; expected one of {', '.join(names)}{did_you_mean(name, names)}"
        )
    cls = _lookup(name)
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"strategy {name!r} does not accept options {sorted(options)}: {exc}") from None
