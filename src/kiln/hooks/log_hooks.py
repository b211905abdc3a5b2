"""Hooks that report: metrics by epoch or step, memory, timing, TensorBoard, checkpoints."""

from __future__ import annotations

import time
from typing import Any

import torch

from kiln.hooks.base import BaseHook

__all__ = [
    "LogMetricByEpochHook",
    "LogMetricByStepHook",
    "LogMemoryByEpochHook",
    "LogTimingByEpochHook",
    "TensorboardHook",
    "SaveCheckpointHook",
    "memory_summary",
]


def _format(metrics: dict[str, Any], accumulated: bool = True) -> str:
    values = [
        (name, m.get_accumulated_value() if accumulated else m.get_last_step_value()) for name, m in metrics.items()
    ]
    return ", ".join(f"{name} = {value:.5g}" for name, value in values)


class LogMetricByEpochHook(BaseHook):
    """Log the accumulated train and test metrics every ``interval`` epochs on rank 0.

    Example::

        kiln.hooks.LogMetricByEpochHook(logger)   # "[Epoch 3 / Train]: Loss = 0.1234, LR = 0.05"
    """

    def __init__(self, logger: Any, interval: int = 1, priority: int = 10) -> None:
        super().__init__(priority)
        self.logger = logger
        self.interval = interval

    def _due(self, trainer: Any) -> bool:
        return trainer.cur_epoch % self.interval == 0

    def after_train_epoch(self, trainer: Any) -> None:
        if self._due(trainer):
            text = _format(trainer.states["metrics"].get("train", {}))
            self.logger.info(f"[Epoch {trainer.cur_epoch} / Train]: {text}", ranks=[0])

    def after_test_epoch(self, trainer: Any) -> None:
        if self._due(trainer):
            text = _format(trainer.states["metrics"].get("test", {}))
            self.logger.info(f"[Epoch {trainer.cur_epoch} / Test]: {text}", ranks=[0])


class LogMetricByStepHook(BaseHook):
    """Keep the last step's metric values in ``trainer.states['step_metrics']`` (one host sync per
    step: the cost of reading them every step)."""

    def __init__(self, priority: int = 10) -> None:
        super().__init__(priority)

    def after_train_iter(self, trainer: Any, output: Any, label: Any, loss: Any) -> None:
        trainer.states["step_metrics"] = {
            name.lower(): m.get_last_step_value() for name, m in trainer.states["metrics"].get("train", {}).items()
        }

    def after_test_iter(self, trainer: Any, output: Any, label: Any, loss: Any) -> None:
        trainer.states["step_metrics"] = {
            name.lower(): m.get_last_step_value() for name, m in trainer.states["metrics"].get("test", {}).items()
        }


def memory_summary() -> str:
    """Allocated/peak CUDA memory, or the process's peak resident memory on CPU."""
    if torch.cuda.is_available():
        return (
            f"allocated {torch.cuda.memory_allocated() / 2**20:.1f} MB, "
            f"peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MB"
        )
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_mb = peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux
    return f"peak resident {peak_mb:.1f} MB"


class LogMemoryByEpochHook(BaseHook):
    """Log memory use after every ``interval`` training epochs (and after tests when ``log_eval``)."""

    def __init__(self, logger: Any, interval: int = 1, log_eval: bool = True, priority: int = 10) -> None:
        super().__init__(priority)
        self.logger, self.interval, self.log_eval = logger, interval, log_eval

    def after_train_epoch(self, trainer: Any) -> None:
        if trainer.cur_epoch % self.interval == 0:
            self.logger.info(f"[Epoch {trainer.cur_epoch} / Train]: memory {memory_summary()}", ranks=[0])

    def after_test(self, trainer: Any) -> None:
        if self.log_eval:
            self.logger.info(f"[Epoch {trainer.cur_epoch} / Test]: memory {memory_summary()}", ranks=[0])


class LogTimingByEpochHook(BaseHook):
    """Log the wall-clock time of training epochs and tests."""

    def __init__(
        self, timer: Any = None, logger: Any = None, interval: int = 1, log_eval: bool = True, priority: int = 10
    ) -> None:
        super().__init__(priority)
        if logger is None:
            from kiln.launch.logging import get_dist_logger

            logger = get_dist_logger()
        self.logger, self.interval, self.log_eval = logger, interval, log_eval
        self._start = 0.0
        self.epoch_times: list[float] = []

    def before_train_epoch(self, trainer: Any) -> None:
        self._start = time.perf_counter()

    def after_train_epoch(self, trainer: Any) -> None:
        seconds = time.perf_counter() - self._start
        self.epoch_times.append(seconds)
        if trainer.cur_epoch % self.interval == 0:
            self.logger.info(f"[Epoch {trainer.cur_epoch} / Train]: {seconds:.3f} s", ranks=[0])

    def before_test(self, trainer: Any) -> None:
        self._test_start = time.perf_counter()

    def after_test(self, trainer: Any) -> None:
        if self.log_eval:
            self.logger.info(
                f"[Epoch {trainer.cur_epoch} / Test]: {time.perf_counter() - self._test_start:.3f} s", ranks=[0]
            )


class TensorboardHook(BaseHook):
    """Write the hooks' metrics to TensorBoard (TensorBoard's own SummaryWriter) on rank 0:
    last-step train values per iteration, accumulated values per epoch."""

    def __init__(self, log_dir: str, ranks: list[int] | None = None, priority: int = 10) -> None:
        super().__init__(priority)
        self.log_dir = log_dir
        self.ranks = [0] if ranks is None else ranks
        self.writer: Any = None

    def after_hook_is_attached(self, trainer: Any) -> None:
        if trainer.state.rank in self.ranks and self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=f"{self.log_dir}/rank{trainer.state.rank}")

    def _write(self, trainer: Any, mode: str, step: int, accumulated: bool) -> None:
        if self.writer is None and not accumulated:
            return
        # An accumulated value is a sum over ranks (a collective): every rank reads it, one writes it.
        for name, metric in trainer.states["metrics"].get(mode, {}).items():
            value = metric.get_accumulated_value() if accumulated else metric.get_last_step_value()
            if self.writer is not None:
                self.writer.add_scalar(f"{name}/{mode}" + ("" if accumulated else "_step"), value, step)

    def after_train_iter(self, trainer: Any, output: Any, label: Any, loss: Any) -> None:
        self._write(trainer, "train", trainer.cur_step, accumulated=False)

    def after_train_epoch(self, trainer: Any) -> None:
        self._write(trainer, "train", trainer.cur_epoch, accumulated=True)

    def after_test_epoch(self, trainer: Any) -> None:
        self._write(trainer, "test", trainer.cur_epoch, accumulated=True)

    def after_train(self, trainer: Any) -> None:
        if self.writer is not None:
            self.writer.flush()


class SaveCheckpointHook(BaseHook):
    """Save a kiln checkpoint into ``checkpoint_dir`` every ``interval`` epochs (or iterations with
    ``save_by_iter``), through the Trainer's checkpoint layer."""

    def __init__(
        self,
        interval: int = 1,
        checkpoint_dir: str | None = None,
        model: Any = None,
        save_by_iter: bool = False,
        priority: int = 10,
    ) -> None:
        super().__init__(priority)
        if checkpoint_dir is None:
            raise ValueError("SaveCheckpointHook needs checkpoint_dir= (the folder to save into)")
        self.interval, self.checkpoint_dir, self.save_by_iter = interval, checkpoint_dir, save_by_iter
        self.saved: list[str] = []

    def after_train_iter(self, trainer: Any, output: Any, label: Any, loss: Any) -> None:
        if self.save_by_iter and trainer.cur_step % self.interval == 0:
            self.saved.append(trainer.save_checkpoint(self.checkpoint_dir))

    def after_train_epoch(self, trainer: Any) -> None:
        if not self.save_by_iter and trainer.cur_epoch % self.interval == 0:
            self.saved.append(trainer.save_checkpoint(self.checkpoint_dir))
