"""nnScaler's train hooks (``HookConfig``/``HookMapConfig``) as a kiln Callback.

Each hook point is called with the :class:`kiln.Trainer` first, on the kiln event where it belongs:

=====================================  =================================================================
hook point                             kiln event
=====================================  =================================================================
on_train_start / on_train_end          FIT_START / FIT_END
on_epoch_start / on_epoch_end          EPOCH_START / EPOCH_END (``epoch``: 0-based index of that epoch)
on_train_step_start                    BATCH_START (``batches``: the micro-batches, ``idx``: step in epoch)
before_zero_grad / after_zero_grad     BEFORE_TRAIN_BATCH / the step's first BEFORE_FORWARD
after_aggregate_train_step_outputs     AFTER_TRAIN_BATCH, once outputs are aggregated across ranks
before_sync_grad / after_sync_grad     AFTER_TRAIN_BATCH (the strategy has synchronised gradients)
before_gnorm_clip                      AFTER_TRAIN_BATCH, after gradient reduction
after_gnorm_clip                       BEFORE_OPTIMIZER_STEP, clipped (``gnorm``: the norm before it)
before_optimizer_step                  BEFORE_OPTIMIZER_STEP, on the final (clipped) gradients
after_optimizer_step                   BATCH_END
on_train_step_end                      BATCH_END
on_val_start / on_val_end              EVAL_START / EVAL_END (``val_loss``: ``eval/loss``)
on_val_step_start / on_val_step_end    EVAL_BATCH_START / EVAL_BATCH_END
after_aggregate_val_step_outputs       EVAL_BATCH_END
on_save_checkpoint                     when a checkpoint is written: put plain data in ``checkpoint``
on_load_checkpoint                     after a checkpoint is loaded, with that data
after_setup                            once the Trainer is built (called by ``kiln.config.build_trainer``)
=====================================  =================================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kiln.config.components import HookMapConfig
from kiln.config.reduction import AggregatedOutputs, GradReduction, summed_loss
from kiln.core.batch import num_samples, split_batch
from kiln.core.callback import Callback

__all__ = ["HOOK_POINTS", "HookCallback", "TrainHook", "hook_from_functions"]

HOOK_POINTS = tuple(f.name for f in dataclasses.fields(HookMapConfig))


class TrainHook:
    """nnScaler's hook interface: override any hook point; each receives the Trainer first.

    A model, optimizer or LR scheduler that is a ``TrainHook`` is called too, in that order and
    before the configured hook.

    Example::

        class PrintLoss(kiln.config.TrainHook):
            def after_aggregate_train_step_outputs(self, trainer, aggregated_outputs, train_loss, idx):
                print(idx, train_loss)
    """


def _noop(self: Any, trainer: Any, *args: Any) -> None:
    """A hook point that does nothing."""


for _point in HOOK_POINTS:
    setattr(TrainHook, _point, _noop)


def hook_from_functions(functions: dict[str, Callable[..., Any]]) -> TrainHook:
    """A hook whose points are plain functions (the ``HookMapConfig`` form)."""
    hook = TrainHook()
    for point, fn in functions.items():
        setattr(hook, point, fn)
    return hook


def _defines(hook: Any, point: str) -> bool:
    fn = getattr(hook, point, None)
    return callable(fn) and getattr(fn, "__func__", fn) is not _noop


class HookCallback(Callback):
    """Calls nnScaler-style hooks on kiln events (see the module docstring for the mapping).

    Args:
        hooks: hook objects, called in order.
        reduction: the :class:`GradReduction` of the run, whose aggregated outputs the
            ``after_aggregate_*`` points receive (``None``: aggregated here when asked for).
        clips: whether the Engine clips gradients (then ``after_gnorm_clip`` gets its norm).

    The hooks receive ``self.trainer``, which :meth:`bind` sets once the Trainer exists.
    """

    def __init__(self, hooks: Sequence[Any], reduction: GradReduction | None = None, clips: bool = False) -> None:
        self.hooks = list(hooks)
        self.reduction = reduction
        self.clips = clips
        self.trainer: Any = None
        self.points = {p for p in HOOK_POINTS if any(_defines(h, p) for h in self.hooks)}
        self._pending_load: dict[str, Any] | None = None
        self._first_forward = False
        self._outputs: list[Any] = []
        self._batches: list[Any] = []
        self._val_index = 0

    def bind(self, trainer: Any) -> None:
        """Give the hooks their Trainer; runs ``on_load_checkpoint`` if a checkpoint was loaded already."""
        self.trainer = trainer
        if self._pending_load is not None:
            self.call("on_load_checkpoint", self._pending_load)
            self._pending_load = None

    def call(self, point: str, *args: Any) -> None:
        if point in self.points:
            for hook in self.hooks:
                fn = getattr(hook, point, None)
                if fn is not None:
                    fn(self.trainer, *args)

    # -- training -------------------------------------------------------------------------------
    def fit_start(self, state: Any, logger: Any) -> None:
        self.call("on_train_start")

    def fit_end(self, state: Any, logger: Any) -> None:
        self.call("on_train_end")

    def epoch_start(self, state: Any, logger: Any) -> None:
        self.call("on_epoch_start", state.timestamp.epoch.value)

    def epoch_end(self, state: Any, logger: Any) -> None:
        self.call("on_epoch_end", state.timestamp.epoch.value - 1)

    def batch_start(self, state: Any, logger: Any) -> None:
        self._outputs = []
        if "on_train_step_start" in self.points or "on_train_step_end" in self.points:
            size = num_samples(state.batch)
            self._batches = split_batch(state.batch, self.trainer.options.microbatching.microbatch_size(size))
        self.call("on_train_step_start", self._batches, state.timestamp.batch_in_epoch.value)

    def before_train_batch(self, state: Any, logger: Any) -> None:
        self.call("before_zero_grad")
        self._first_forward = True

    def before_forward(self, state: Any, logger: Any) -> None:
        if self._first_forward:
            self._first_forward = False
            self.call("after_zero_grad")

    def after_loss(self, state: Any, logger: Any) -> None:
        if "on_train_step_end" in self.points and self.reduction is None:
            self._outputs.append(state.loss.detach())

    def after_train_batch(self, state: Any, logger: Any) -> None:
        if self.reduction is not None and self.reduction.last is not None:
            self._outputs = self.reduction.loss_outputs
            if "after_aggregate_train_step_outputs" in self.points:  # float() syncs with the device
                self.call(
                    "after_aggregate_train_step_outputs",
                    self.reduction.last,
                    float(state.loss),
                    state.timestamp.batch_in_epoch.value,
                )
        self.call("before_sync_grad")
        self.call("after_sync_grad")
        self.call("before_gnorm_clip")

    def before_optimizer_step(self, state: Any, logger: Any) -> None:
        # The Engine has unscaled and clipped once between AFTER_TRAIN_BATCH and this event.
        engine = self.trainer.engine
        if "after_gnorm_clip" in self.points:
            gnorm = (
                engine.last_grad_norm
                if self.clips  # an infinite max norm measures without clipping
                else engine.strategy.clip_grad_norm_(engine.model, float("inf"))
            )
            self.call("after_gnorm_clip", gnorm)
        self.call("before_optimizer_step")

    def batch_end(self, state: Any, logger: Any) -> None:
        self.call("after_optimizer_step")
        self.call("on_train_step_end", self._outputs, self._batches, state.timestamp.batch_in_epoch.value - 1)

    # -- validation -----------------------------------------------------------------------------
    def eval_start(self, state: Any, logger: Any) -> None:
        self._val_index = 0
        self.call("on_val_start")

    def eval_batch_start(self, state: Any, logger: Any) -> None:
        self.call("on_val_step_start", [state.batch], self._val_index)

    def eval_batch_end(self, state: Any, logger: Any) -> None:
        self.call("on_val_step_end", [state.outputs], [state.batch], self._val_index)
        if "after_aggregate_val_step_outputs" in self.points:
            loss = getattr(state, "eval_loss", None)
            reduction = self.reduction
            if reduction is not None:
                output = state.outputs if reduction.end_to_end else (loss, state.outputs, state.batch)
                agg = reduction.aggregate_fn([output], reduction.sync_group)
            else:
                agg = AggregatedOutputs.aggregate([loss], None)
            val_loss = summed_loss(agg) / agg.num_batches if agg.num_batches else float("nan")
            self.call("after_aggregate_val_step_outputs", agg, val_loss, self._val_index)
        self._val_index += 1

    def eval_end(self, state: Any, logger: Any) -> None:
        self.call("on_val_end", state.metrics.get("eval/loss"))

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if "on_save_checkpoint" not in self.points:
            return {}
        checkpoint: dict[str, Any] = {}
        self.call("on_save_checkpoint", checkpoint)
        return {"checkpoint": checkpoint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        checkpoint = dict(state.get("checkpoint", {}))
        if self.trainer is None:  # loading happens inside Trainer.__init__, before bind()
            self._pending_load = checkpoint
        else:
            self.call("on_load_checkpoint", checkpoint)
