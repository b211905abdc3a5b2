"""`NaNMonitor`: stop a run whose training loss became NaN or infinite, naming the batch."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from kiln.core.callback import Callback
from kiln.core.state import State

__all__ = ["NaNMonitor", "NonFiniteLossError"]

log = logging.getLogger(__name__)

_NONE = 2**62  # "no bad batch yet": larger than any batch count, so a MIN over ranks finds the first bad one


class NonFiniteLossError(RuntimeError):
    """The training loss was NaN or infinite (raised by :class:`NaNMonitor`)."""


def _losses(loss: Any) -> Iterable[Any]:
    """The loss values of ``state.loss``: a tensor, a number, or a dict/sequence of them."""
    if isinstance(loss, Mapping):
        return loss.values()
    if isinstance(loss, (list, tuple)):
        return loss
    return () if loss is None else (loss,)


class NaNMonitor(Callback):
    """Check at every ``AFTER_LOSS`` that the loss is finite; raise (or stop) naming the first bad batch.

    Checking ``torch.isfinite(loss)`` on the host every step would stall the host until the device
    has caught up, every step, and lose the overlap of Python with GPU work. So the check is split:
    at ``AFTER_LOSS`` a few device ops record, *on the device*, the number of the first batch whose
    loss was not finite (no sync); every ``check_interval`` batches, and at ``EPOCH_END`` and
    ``FIT_END``, ``BATCH_END`` reads that one number back (the single host sync). On CPU a read
    costs nothing, so the default interval there is 1; on accelerators it is 10, and the run may
    go on for up to 9 more batches on NaN weights before it stops. Either way the batch named is
    exactly the first bad one (but a checkpoint saved in between holds NaN weights: pass
    ``check_interval=1`` where that matters). With more than one rank the number is MIN-reduced
    across ranks first (one small all-reduce per check), so all ranks raise at the same check and
    none is left waiting in a collective.

    Batches are numbered as ``state.timestamp.batch`` reads at that batch's ``BATCH_END`` (the
    first batch of the run is batch 1).

    Args:
        check_interval: batches between host reads; None picks 1 on CPU and 10 on accelerators.
        raise_error: raise :class:`NonFiniteLossError` (default), or else end the run with
            ``state.stop_training(reason)`` and log the reason.

    Example::

        trainer = kiln.Trainer(model, ..., callbacks=[kiln.callbacks.NaNMonitor()])
        # NonFiniteLossError: NaNMonitor: the training loss was not finite (nan) at batch 17 ...
    """

    def __init__(self, check_interval: int | None = None, raise_error: bool = True) -> None:
        if check_interval is not None and (not isinstance(check_interval, int) or check_interval < 1):
            raise ValueError(f"NaNMonitor check_interval must be a positive int or None, got {check_interval!r}")
        self.check_interval = check_interval
        self.raise_error = raise_error
        self._interval = check_interval
        self._first: torch.Tensor | None = None  # first bad batch number, on the loss's device
        self._value: torch.Tensor | None = None  # that batch's loss
        self._host_first: tuple[int, float] | None = None  # for losses given as Python numbers
        self._unchecked = 0
        self._reported = False

    def after_loss(self, state: State, logger: Any) -> None:
        batch = state.timestamp.batch.value + 1  # not yet counted: the timestamp advances before BATCH_END
        for loss in _losses(state.loss):
            if not isinstance(loss, torch.Tensor):
                if self._host_first is None and not math.isfinite(loss):
                    self._host_first = (batch, float(loss))
                continue
            loss = loss.detach()
            if self._first is None:
                self._first = torch.full((), _NONE, dtype=torch.long, device=loss.device)
                self._value = torch.zeros((), dtype=torch.float32, device=loss.device)
                if self._interval is None:
                    self._interval = 1 if loss.device.type == "cpu" else 10
            # All device-side and asynchronous: no .item(), no Python branch on a tensor.
            value = loss.float().sum()  # NaN or inf if any element is
            new = ~torch.isfinite(value) & (self._first == _NONE)
            assert self._value is not None  # set with _first
            self._first = torch.where(new, batch, self._first)
            self._value = torch.where(new, value, self._value)

    def batch_end(self, state: State, logger: Any) -> None:
        self._unchecked += 1
        if self._unchecked >= (self._interval or 1):
            self._check(state, logger)

    def epoch_end(self, state: State, logger: Any) -> None:
        self._check(state, logger)

    def fit_end(self, state: State, logger: Any) -> None:
        self._check(state, logger)

    def _check(self, state: State, logger: Any) -> None:
        self._unchecked = 0
        if self._reported:
            return
        first = self._first
        if self._host_first is not None:
            host = self._host_first[0]
            first = torch.tensor(host) if first is None else first.clamp(max=host)
        if state.world_size > 1 and dist.is_available() and dist.is_initialized():
            # Every rank gets here at the same batch: agree on the earliest bad batch of any rank,
            # so that all ranks stop together and none waits forever in the next collective.
            first = (
                torch.full((), _NONE, dtype=torch.long, device=state.device)
                if first is None
                else first.to(state.device, copy=True)
            )  # a copy: all_reduce works in place
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        if first is None:
            return
        bad = int(first.item())  # the one host sync of the check
        if bad == _NONE:
            return
        # The failure path may sync again: the loss value, if this rank saw it.
        value: float | None = None
        if self._host_first is not None and self._host_first[0] == bad:
            value = self._host_first[1]
        elif self._first is not None and self._value is not None and int(self._first.item()) == bad:
            value = float(self._value.item())
        self._reported = True
        self._report(state, logger, bad, value)

    def _report(self, state: State, logger: Any, batch: int, value: float | None) -> None:
        timestamp = state.timestamp
        where = f"batch {batch}"
        back = timestamp.batch.value - batch
        if 0 <= back < timestamp.batch_in_epoch.value:  # the bad batch was in the current epoch
            # 1-based, as people count: the 5th batch of the 3rd epoch.
            where += f" (batch {timestamp.batch_in_epoch.value - back} of epoch {timestamp.epoch.value + 1})"
        shown = f" ({value})" if value is not None else " (on another rank)"
        message = (
            f"NaNMonitor: the training loss was not finite{shown} at {where}; check the learning rate, "
            f"the input data and the precision (loss scaling for fp16)"
        )
        if self.raise_error:
            raise NonFiniteLossError(message)
        log.warning(message)
        logger.log_text(message)
        state.stop_training(message)
