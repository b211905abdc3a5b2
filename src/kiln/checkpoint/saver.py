"""``CheckpointSaver``: the callback that decides when to checkpoint, and keeps the folder tidy."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kiln.checkpoint import collectives, layout
from kiln.checkpoint.async_save import AsyncCheckpoint, start_async_save
from kiln.checkpoint.checkpointing import save_checkpoint
from kiln.checkpoint.formats import check_save_type
from kiln.checkpoint.preemption import PreemptionHandler
from kiln.checkpoint.storage import as_path
from kiln.core.callback import Callback
from kiln.core.event import Event
from kiln.core.time import Time, TimeUnit
from kiln.core.warn import KilnWarning
from kiln.launch.runlock import LOCK_NAME, FolderInUseError, RunLock

__all__ = ["CheckpointSaver"]

Interval = Time | str | int | Callable[[Any, Event], bool]


class CheckpointSaver(Callback):
    """Save checkpoints during training (what the Trainer's ``save_folder=`` builds).

    Saves at ``BATCH_CHECKPOINT``/``EPOCH_CHECKPOINT`` when the interval is due, always once more
    at ``FIT_END`` (unless that exact step is already saved), and at the end of the batch in which
    SIGTERM or SIGUSR1 arrived, after which the process exits with status 75
    (:data:`kiln.checkpoint.preemption.PREEMPTED_EXIT_CODE`).

    One run per folder: while it trains, rank 0 holds ``folder/.kiln-lock`` (host, pid, run id),
    and a folder held by another live run is refused on every rank with one line naming it
    (:mod:`kiln.launch.runlock`; checked at ``INIT``, taken at ``FIT_START``, given back at
    ``FIT_END``, on ``close`` and at exit). Folders on object stores are not locked.

    Args:
        folder: the save folder, a local path or an fsspec URL (``s3://bucket/run``, see
            :mod:`kiln.checkpoint.storage`); checkpoints are ``folder/ep{E}-ba{B}``, with ``last``
            and ``best`` links (pointer objects on object stores).
        interval: ``"1ep"``, ``"500ba"``, ``"2e4sp"``, ``"0.25dur"``, a :class:`kiln.Time`, an int
            (epochs), or ``callable(state, event) -> bool`` asked at both checkpoint events.
        num_checkpoints_to_keep: keep the N most recently saved checkpoints in the folder, earlier
            runs' included (-1: all). What ``last`` or ``best`` points to is never deleted.
        save_type: ``"sharded"``, ``"deduped"`` or ``"merged"``.
        save_best: a metric in ``state.metrics`` to minimise (``"eval/loss"``) or
            ``(name, "min" | "max")``; ``best`` points at the checkpoint with the best value. When an
            evaluation improves it and no checkpoint exists at that step, one is saved.
        save_async: write in the background (DCP ``async_save``); the training loop pays only for
            copying the tensors to CPU memory. Needs ``sharded`` or ``deduped``.
        every_n_train_steps, every_n_epochs: nnScaler's form; when given, they replace ``interval``
            (a checkpoint is saved when either is due).
        preemption_signals: signals that mean "checkpoint now and exit" (empty: none handled).
        requeue: inside a SLURM job, ``scontrol requeue`` after a preemption checkpoint: ``None``
            (default) after a SIGUSR1 (``#SBATCH --signal=USR1@120``) but not a SIGTERM (what
            ``scancel`` sends), ``True`` after any signal, ``False`` never.
        exit_on_preemption: exit after the preemption checkpoint (else only stop training).
        storage_options: for a URL, the fsspec filesystem's options (``{"endpoint_url": ...,
            "key": ..., "secret": ...}`` for S3); by default the standard environment variables.

    Example::

        saver = kiln.checkpoint.CheckpointSaver("runs/a", interval="500ba", num_checkpoints_to_keep=3,
                                                save_best=("eval/Accuracy", "max"), save_async=True)
        trainer = kiln.Trainer(model, ..., callbacks=[saver])
    """

    def __init__(
        self,
        folder: Any = "checkpoints",
        interval: Interval = "1ep",
        num_checkpoints_to_keep: int = -1,
        save_type: str = "sharded",
        save_best: str | tuple[str, str] | None = None,
        save_async: bool = False,
        *,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        preemption_signals: Sequence[str] = ("SIGTERM", "SIGUSR1"),
        requeue: bool | None = None,
        exit_on_preemption: bool = True,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.folder = as_path(folder, storage_options)
        self.save_type = check_save_type(save_type)
        if save_async and save_type == "merged":
            raise ValueError(
                "save_async=True needs save_type='sharded' or 'deduped'; a merged checkpoint is "
                "assembled on rank 0 and cannot be written in the background"
            )
        self.num_checkpoints_to_keep = layout.check_num_checkpoints_to_keep(num_checkpoints_to_keep)
        self.save_async = save_async
        self.intervals = _intervals(interval, every_n_train_steps, every_n_epochs)
        self.best_metric, self.best_mode = _best(save_best)
        self.best_value: float | None = None
        self.best_name: str | None = None
        self.preemption = PreemptionHandler(preemption_signals, requeue) if preemption_signals else None
        self.exit_on_preemption = exit_on_preemption
        self.last_path: Any = None
        self._resolved: list[Time | Callable] = []
        self._previous: dict[TimeUnit, float] = {}
        self._saved_name: str | None = None
        self._pending: AsyncCheckpoint | None = None
        self._fitting = False
        self._metric_seen = False
        # Only a local folder is locked: see kiln.launch.runlock for why object stores are not.
        self._lock = RunLock(self.folder / LOCK_NAME, "save_folder", folder) if isinstance(self.folder, Path) else None

    # -- events -------------------------------------------------------------------------------
    def init(self, state: Any, logger: Any) -> None:
        # Refused when the Trainer is built, before it loads or trains (FIT_START takes the lock).
        self._agree(self._lock.conflict() if self._lock is not None and state.rank == 0 else None)

    def fit_start(self, state: Any, logger: Any) -> None:
        self._fitting = True
        self._wait()
        refusal = None
        if state.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            try:
                if self._lock is not None:
                    self._lock.acquire()
            except FolderInUseError as exc:
                refusal = str(exc)
        self._agree(refusal)
        if state.rank == 0:
            layout.cleanup_temporary(self.folder)  # debris of saves a crash interrupted
            # A crash between a commit and its retention leaves keep + 1 checkpoints; trimmed here,
            # this run's first commit cannot bring the folder to keep + 2.
            layout.apply_retention(self.folder, self.num_checkpoints_to_keep)
        self._resolved = [iv if callable(iv) else state.resolve(iv) for iv in self.intervals]
        self._previous = {
            unit: state.timestamp.get(unit).value for unit in (TimeUnit.SAMPLE, TimeUnit.TOKEN, TimeUnit.SECOND)
        }
        name = layout.checkpoint_name(state.timestamp.epoch.value, state.timestamp.batch.value)
        self._saved_name = name if (self.folder / name / layout.MANIFEST).exists() else None  # just resumed from it
        if self.preemption is not None:
            self.preemption.install()

    def batch_checkpoint(self, state: Any, logger: Any) -> None:
        if self._preempted(state, Event.BATCH_CHECKPOINT):
            return
        if self._due(state, Event.BATCH_CHECKPOINT):
            self.save(state, logger)

    def epoch_checkpoint(self, state: Any, logger: Any) -> None:
        if self._preempted(state, Event.EPOCH_CHECKPOINT):
            return
        if self._due(state, Event.EPOCH_CHECKPOINT):
            self.save(state, logger)

    def eval_end(self, state: Any, logger: Any) -> None:
        # The loop may evaluate after the checkpoint event of the same step: then the checkpoint
        # just saved is the one this evaluation judged. Otherwise save one, so `best` can point at it.
        if not self._fitting or self.best_metric is None or not self._improves(state):
            return
        if self._saved_name == self._name(state):
            self._wait()  # an async save of this step must be committed before `best` can point at it
            self._mark_best(self._saved_name, float(state.metrics[self.best_metric]), link_now=True)
        else:
            self.save(state, logger)

    def fit_end(self, state: Any, logger: Any) -> None:
        try:
            self.save(state, logger)  # the final checkpoint, whatever the interval
            self._wait()
        finally:
            self._fitting = False
            if self._lock is not None:
                self._lock.release()
            if self.preemption is not None:
                self.preemption.uninstall()
        if self.best_metric is not None and not self._metric_seen and state.rank == 0:
            warnings.warn(
                f"save_best={self.best_metric!r} never appeared in state.metrics (it has "
                f"{sorted(state.metrics)}); no 'best' link was made",
                KilnWarning,
                stacklevel=2,
            )
        if self.preemption is not None and self.preemption.received and self.exit_on_preemption:
            self.preemption.exit()

    def close(self, state: Any, logger: Any) -> None:
        try:
            self._wait()
        finally:
            if self._lock is not None:
                self._lock.release()

    def _agree(self, refusal: str | None) -> None:
        """Rank 0's verdict on the folder's lock, raised on every rank alike (no rank left waiting)."""
        refusal = collectives.broadcast_object(refusal)
        if refusal is not None:
            raise FolderInUseError(refusal)

    # -- saving -------------------------------------------------------------------------------
    def save(self, state: Any, logger: Any = None) -> Path | None:
        """Save now (every rank), unless this step is already saved; returns the path (rank 0 knows it).
        With a ``logger``, ``checkpoint/saved`` is logged at this step (``kiln report`` marks it)."""
        name = self._name(state)
        if name == self._saved_name:
            return self.last_path
        self._wait()  # one save in flight at a time; a failed one is reported first
        if self.best_metric is not None and self._improves(state):
            self._mark_best(name, float(state.metrics[self.best_metric]), link_now=False)
        if self.save_async:
            self._pending = start_async_save(
                self.folder, state, self.save_type, name=name, on_commit=self._after_commit
            )
        else:
            path = save_checkpoint(self.folder, state, self.save_type, name=name)
            if state.rank == 0:
                self._after_commit(path)
            self.last_path = path
        self._saved_name = name
        if logger is not None:
            logger.log_metrics({"checkpoint/saved": 1}, step=state.timestamp.batch.value)
        return self.folder / name

    def _after_commit(self, path: Any) -> None:
        """Rank 0, once the checkpoint is visible: the ``best`` link, then retention."""
        self.last_path = path
        if self.best_name == path.name:
            layout.update_link(self.folder, "best", path.name)
        protect = {self._pending.name} if self._pending is not None else set()
        layout.apply_retention(self.folder, self.num_checkpoints_to_keep, protect=protect)

    def _wait(self) -> None:
        """Finish the save in flight; its failure is raised on every rank together."""
        if self._pending is not None:
            error, self._pending = self._pending.wait(), None
            collectives.raise_together(error)

    # -- policy -------------------------------------------------------------------------------
    @staticmethod
    def _name(state: Any) -> str:
        return layout.checkpoint_name(state.timestamp.epoch.value, state.timestamp.batch.value)

    def _due(self, state: Any, event: Event) -> bool:
        ts, due = state.timestamp, False
        for interval in self._resolved:
            if callable(interval):
                due = bool(interval(state, event)) or due
            elif interval.unit == TimeUnit.EPOCH:
                due = due or (event == Event.EPOCH_CHECKPOINT and ts.epoch.value % interval.value == 0)
            elif interval.unit == TimeUnit.BATCH:
                due = due or (event == Event.BATCH_CHECKPOINT and ts.batch.value % interval.value == 0)
            elif event == Event.BATCH_CHECKPOINT:  # samples, tokens, seconds: crossing a multiple
                now, before = ts.get(interval.unit).value, self._previous.get(interval.unit, 0)
                due = due or int(now // interval.value) > int(before // interval.value)
        if event == Event.BATCH_CHECKPOINT:
            self._previous = {unit: ts.get(unit).value for unit in self._previous}
        return due

    def _improves(self, state: Any) -> bool:
        value = state.metrics.get(self.best_metric)
        if value is None:
            return False
        self._metric_seen = True
        value = float(value)
        if self.best_value is None:
            return True
        return value < self.best_value if self.best_mode == "min" else value > self.best_value

    def _mark_best(self, name: str, value: float, link_now: bool) -> None:
        self.best_value, self.best_name = value, name
        if link_now and collectives.rank_and_world()[0] == 0 and (self.folder / name).exists():
            layout.update_link(self.folder, "best", name)
            layout.apply_retention(self.folder, self.num_checkpoints_to_keep)

    def _preempted(self, state: Any, event: Event) -> bool:
        if self.preemption is None or not self.preemption.should_stop():
            return False
        self.save(state)
        self._wait()  # the preemption checkpoint must be on disk before the process goes away
        state.stop_training(f"preempted by {self.preemption.signal_name}; checkpoint saved in {self.folder}")
        return True

    # -- state across a resume ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.best_value, "best_name": self.best_name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_value, self.best_name = state.get("best_value"), state.get("best_name")


def _intervals(interval: Interval, every_n_train_steps: int | None, every_n_epochs: int | None) -> list[Any]:
    if every_n_train_steps is not None or every_n_epochs is not None:
        found = []
        for value, unit, key in (
            (every_n_train_steps, TimeUnit.BATCH, "every_n_train_steps"),
            (every_n_epochs, TimeUnit.EPOCH, "every_n_epochs"),
        ):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} must be a positive int")
            found.append(Time(value, unit))
        return found
    if callable(interval) and not isinstance(interval, (Time, str)):
        return [interval]
    try:
        time = Time.from_input(interval, TimeUnit.EPOCH)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"interval={interval!r} is not a save interval: {exc}. Use e.g. '1ep', '500ba', "
            "'0.25dur', an int number of epochs, or a callable(state, event) -> bool"
        ) from None
    if not time.value > 0:
        raise ValueError(f"interval={interval!r} must be positive")
    return [time]


def _best(save_best: str | tuple[str, str] | None) -> tuple[str | None, str]:
    if save_best is None:
        return None, "min"
    if isinstance(save_best, str):
        return save_best, "min"
    if isinstance(save_best, (tuple, list)) and len(save_best) == 2 and save_best[1] in ("min", "max"):
        return str(save_best[0]), save_best[1]
    raise ValueError(
        f"save_best={save_best!r} must be a metric name such as 'eval/loss' (minimised) or "
        "(name, 'min' | 'max'), e.g. ('eval/Accuracy', 'max')"
    )
