"""The Trainer: a whole training run in one object (Composer's Trainer, Colossal-AI's too).

``fit`` holds the loop; ``_train_batch`` splits a batch into microbatches and hands them, with the
events to fire between, to the Engine's step. From ``Trainer.fit`` to ``optimizer.step`` is three
hops: fit -> _train_batch -> Engine.train_step (-> Engine.optimizer_step -> strategy.optimizer_step).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from kiln.core.batch import num_samples, num_tokens, split_batch
from kiln.core.callback import Algorithm, Callback
from kiln.core.event import Event
from kiln.core.model import Model
from kiln.core.state import State
from kiln.core.time import Time, TimeUnit
from kiln.core.warn import KilnWarning
from kiln.engine import Engine, move_to_device
from kiln.launch import heartbeat
from kiln.launch.context import resolve_device, seed_everything
from kiln.launch.data import ShardSampler
from kiln.launch.join import join_launcher
from kiln.launch.loader import ResumableLoader
from kiln.launch.streaming import resumable_train_loader
from kiln.loggers.logger import Logger
from kiln.precision import Precision
from kiln.trainer.building import (
    build_engine,
    check_algorithms,
    check_schedulers,
    default_callbacks,
    split_schedulers,
    targets_loss,
)
from kiln.trainer.evaluation import evaluate_due, evaluate_sets, predict
from kiln.trainer.evaluator import Evaluator, as_evaluators, evaluates_on
from kiln.trainer.events import EventRunner
from kiln.trainer.fault_tolerance import FaultTolerance, ReplicaGroup, as_fault_tolerance
from kiln.trainer.goodput import GoodputMonitor
from kiln.trainer.options import (
    CheckpointOptions,
    DataOptions,
    DurationOptions,
    EvalOptions,
    LeverOptions,
    LogOptions,
    MicrobatchOptions,
    TrainerOptions,
    resolve_duration,
)
from kiln.trainer.progress import ProgressBar

__all__ = ["Trainer"]


class Trainer:
    """Train, evaluate and checkpoint a model.

    Args:
        model: a :class:`kiln.Model`, or any ``nn.Module`` with ``criterion=`` (batches are
            ``(inputs, targets)``).
        train_dataloader, eval_dataloader: iterables of batches (per-rank batches). ``eval_dataloader``
            may also be a :class:`kiln.Evaluator` or a list of them: named sets, each with its own
            metrics and interval, logged as ``eval/<label>/<metric>``.
        max_duration: int epochs or a time string (``"10ep"``, ``"500ba"``, ``"2e4sp"``,
            ``"1e6tok"``, ``"1h30m"``) or a :class:`kiln.Time`.
        optimizers, schedulers: a torch optimizer; torch schedulers (stepped per epoch unless
            ``step_schedulers_every_batch``) or kiln time-aware schedulers (stepped per batch).
        device: where the model and batches go: ``"cpu"``, ``"gpu"``/``"cuda"`` (this rank's GPU),
            ``"cuda:N"``, a ``torch.device``, or ``None`` for the best available (the context's
            device: ``cuda:<local_rank>`` when CUDA is there, else the CPU).
        precision, strategy: see :mod:`kiln.precision` and :mod:`kiln.parallel`.
        deepspeed_config: Composer's form of ``strategy="deepspeed"``: a DeepSpeed config dict (``{}``
            is valid) or JSON path; kiln fills accumulation, clipping and precision into it.
        grad_accum / device_train_microbatch_size: split each batch into microbatches (int, or
            ``"auto"``: halve on out-of-memory and retry).
        compile: ``True`` or a dict of ``torch.compile`` arguments: each block of the model (the
            modules FSDP shards, ``layers.0``, ...) is compiled in place; checkpoints keep their keys.
        activation_checkpointing: recompute activations in the backward: ``"full"`` (every block),
            ``"selective"`` (every block, keeping the matmul outputs), ``"selective:N"`` (every Nth
            block) or ``fn(module) -> bool``. See :class:`kiln.parallel.ParallelizeOptions`.
        float8: ``True`` or a dict of torchao float8 settings: FP8 matmuls in the eligible Linear
            layers, on GPUs with FP8 tensor cores (see :mod:`kiln.parallel.transforms.float8`).
        algorithms, callbacks, loggers: run on the events of :class:`kiln.Event`.
        eval_interval: a Time (``"1ep"``, ``"100ba"``) or int epochs.
        train_subset_num_batches: train on only the first N batches of each epoch (Composer's;
            ``None`` or ``-1``: the whole loader). Epoch-based times count N batches per epoch.
        stateful_dataloader: ``True`` rebuilds a torch DataLoader as torchdata's
            ``StatefulDataLoader``, whose state (each worker's iterable dataset's too) resumes the
            data mid-epoch without replay; ``None`` does so only for an iterable dataset with
            ``state_dict``/``load_state_dict`` and workers; ``False`` never.
        save_folder, save_interval, ...: checkpointing (see :mod:`kiln.checkpoint`); ``save_folder``
            and ``load_path`` may be fsspec URLs (``s3://bucket/run``), with ``storage_options``
            (credentials, ``endpoint_url``) for their filesystem, by default the environment's.
        progress_bar, console_interval: progress on rank 0. On a terminal, a tqdm bar over the
            whole run; when stdout is not a terminal (a log file, ``nohup``, SLURM, a pipe), a plain
            line at least every ``console_interval`` (``"30s"``, ``"100ba"``; ``None``: no lines)
            and at each tenth of the run, a line for the first step, for each evaluation and at the
            end (see :class:`kiln.trainer.progress.ProgressBar`).
        engine, logger: the Colossal-AI form ``Trainer(engine=engine, logger=logger)``.
        fault_tolerance: run as one replica group of a torchft job: a dict or
            :class:`kiln.trainer.FaultTolerance` (Lighthouse address, this group's index, ...); steps
            commit only when the quorum of live groups agrees, and a restarted group takes the state
            of a live one. ``trainer.fault_tolerance`` is then the :class:`~kiln.trainer.fault_tolerance.ReplicaGroup`.
        goodput: keep the run's goodput account (``True``, the default; ``False``: none; or a
            :class:`kiln.trainer.goodput.GoodputMonitor`, kept always) when there is a save folder or a logger:
            wall time by segment across launches, logged as ``goodput/*`` and written beside the
            save folder (``<save_folder>.goodput.json``; docs/report.md). ``trainer.goodput``: the monitor or None.
        moe_monitor: a model with :class:`kiln.models.MoE` layers gets a
            :class:`kiln.callbacks.MoEMonitor` every ``log_interval`` (router statistics, and the
            bias balancing of ``load_balance="bias"`` layers) unless ``callbacks`` hold one; False: none.

    Example::

        trainer = kiln.Trainer(model, train_dataloader=train_dl, eval_dataloader=eval_dl,
                               max_duration="10ep", optimizers=torch.optim.AdamW(model.parameters()))
        trainer.fit()
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        train_dataloader: Iterable | None = None,
        eval_dataloader: Iterable | Evaluator | Sequence[Evaluator] | None = None,
        max_duration: int | str | Time | None = None,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        schedulers: Any = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        device: str | torch.device | None = None,
        precision: str | Mapping[str, Any] | Precision | None = None,
        strategy: Any = "auto",
        grad_accum: int = 1,
        device_train_microbatch_size: int | str | None = None,
        clip_grad_norm: float | None = None,
        compile: bool | Mapping[str, Any] = False,
        activation_checkpointing: str | Callable[[nn.Module], bool] | None = None,
        float8: bool | Mapping[str, Any] | None = None,
        algorithms: Sequence[Algorithm] | Algorithm = (),
        callbacks: Sequence[Callback] | Callback = (),
        loggers: Any = (),
        eval_interval: int | str | Time | Callable[[State, Event], bool] = "1ep",
        eval_subset_num_batches: int | None = None,
        save_folder: str | os.PathLike | None = None,
        save_interval: str | int | Time | Callable[[State, Event], bool] = "1ep",
        save_num_checkpoints_to_keep: int = -1,
        save_type: str = "sharded",
        save_best: str | tuple[str, str] | None = None,
        load_path: str | os.PathLike | None = None,
        autoresume: bool = False,
        seed: int | None = None,
        deterministic: bool = False,
        progress_bar: bool = True,
        log_interval: int | str | Time = "1ba",
        console_interval: str | float | Time | None = "30s",
        engine: Engine | None = None,
        logger: Any = None,
        save_async: bool = False,
        eval_metrics: Mapping[str, Any] | None = None,
        scale_schedule_ratio: float = 1.0,
        step_schedulers_every_batch: bool | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        deepspeed_config: Mapping[str, Any] | str | None = None,
        train_subset_num_batches: int | None = None,
        stateful_dataloader: bool | None = None,
        storage_options: Mapping[str, Any] | None = None,
        moe_monitor: bool = True,
        fault_tolerance: FaultTolerance | Mapping[str, Any] | None = None,
        goodput: bool | GoodputMonitor = True,
    ) -> None:
        if isinstance(model, Engine) and engine is None:  # Colossal-AI's Trainer(engine)
            model, engine = None, model
        # Every argument checked before anything is built: a bad value fails here, in one line.
        self.options = opts = TrainerOptions(
            duration=DurationOptions(
                max_duration,  # type: ignore[arg-type]  # __post_init__ makes it a Time
                scale_schedule_ratio,
                train_subset_num_batches,
                step_schedulers_every_batch,
            ),
            microbatching=MicrobatchOptions(grad_accum, device_train_microbatch_size),
            evaluation=EvalOptions(eval_interval, eval_subset_num_batches),  # type: ignore[arg-type]  # made a Time
            logging=LogOptions(loggers, log_interval, progress_bar, console_interval, goodput),
            levers=LeverOptions(compile, activation_checkpointing, float8),
            data=DataOptions(stateful_dataloader),
            checkpointing=CheckpointOptions(
                save_folder,
                save_interval,
                save_num_checkpoints_to_keep,
                save_type,
                save_best,
                save_async,
                load_path,
                autoresume,
                storage_options,
            ),
        )
        replicas = as_fault_tolerance(fault_tolerance)
        ctx = join_launcher()  # under torchrun, SLURM or Open MPI: their world, as launch_from_* would
        if seed is not None:
            seed_everything(seed)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.config = dict(config or {})
        self.eval_metrics = eval_metrics
        self.dist_logger = logger  # Colossal-AI's logger, used by its hooks

        # -- the engine: model, optimizer, precision, strategy ------------------------------
        if engine is None:
            engine = build_engine(
                model,
                optimizers,
                criterion,
                precision=precision,
                strategy=strategy,
                clip_grad_norm=clip_grad_norm,
                levers=opts.levers,
                deepspeed_config=deepspeed_config,
                algorithms=[algorithms] if isinstance(algorithms, Algorithm) else list(algorithms),
                batch_size=getattr(train_dataloader, "batch_size", None),
                train_dataloader=train_dataloader,
                microbatching=opts.microbatching,
                device=device,
                ctx=ctx,
            )
        elif device is not None and resolve_device(device, ctx) != engine.device:
            raise ValueError(
                f"device={device!r} differs from the device of the engine= given ({engine.device}); the "
                "Engine already placed the model: drop device=, or build the Engine on that device"
            )
        elif opts.levers != LeverOptions():
            raise ValueError(
                f"compile={compile!r} / activation_checkpointing={activation_checkpointing!r} / float8={float8!r} "
                "are given with "
                "engine=, whose strategy already set up the model: pass them to kiln.Engine (or initialize's config)"
            )
        self.engine = engine
        module = engine.module
        self._is_kiln_model = isinstance(module, Model)
        # The loss of (outputs, batch): a kiln.Model's own, or the criterion on the batch's targets.
        self.loss_fn = engine.criterion if self._is_kiln_model else targets_loss(engine.criterion)
        self._targets_loss = None if self._is_kiln_model else self.loss_fn  # the loss _plain_loss inlines

        # -- state ---------------------------------------------------------------------------
        self.state = state = State(
            module,
            rank=ctx.rank,
            world_size=ctx.world_size,
            optimizers=[engine.optimizer] if engine.optimizer else [],
            precision=engine.precision,
            device=engine.device,
            seed=seed,
            algorithms=[algorithms] if isinstance(algorithms, Algorithm) else list(algorithms),
            callbacks=default_callbacks(
                engine.model,
                [callbacks] if isinstance(callbacks, Callback) else list(callbacks),
                moe_monitor,
                opts.logging.log_every,
            ),
            run_name=run_name or "kiln",
        )
        state.engine = engine
        state.loss_fn = self.loss_fn
        state.config = self.config  # recorded in each checkpoint's manifest
        state.max_duration = opts.duration.max_duration
        check_algorithms(state.algorithms, engine)
        # torchft's Manager for this replica group: it hooks the Engine's step and the loop's events.
        self.fault_tolerance = ReplicaGroup(replicas, state, engine) if replicas is not None else None

        self.logger = Logger(opts.logging.loggers, rank=ctx.rank, state=state)
        self.events = EventRunner(state, self.logger)
        self._step_plan: tuple[Any, ...] = (-1,)  # _plan_step's choices, for the listeners of events.version
        self.progress = ProgressBar(
            enabled=progress_bar and ctx.rank == 0,
            logger=self.logger,
            console_interval=opts.logging.console_interval,
        )

        # -- data ----------------------------------------------------------------------------
        self.train_dataloader: Iterable | None = None
        self.eval_dataloader: Iterable | None = None  # the first evaluation set's loader
        self.evaluators: list[Evaluator] = []  # every evaluation set (a plain loader is one, labelled eval)
        self._set_train_dataloader(train_dataloader)
        self._set_eval_dataloader(eval_dataloader)

        # -- schedulers, checkpoints ---------------------------------------------------------
        self._per_batch_schedulers, self._per_epoch_schedulers = split_schedulers(
            schedulers, state, opts.duration.step_schedulers_every_batch, opts.duration.scale_schedule_ratio
        )
        self._saver = None
        # the default goodput account where it has somewhere to go (a save folder, a logger); a monitor given, always
        keep = goodput is not True or save_folder is not None or bool(self.logger.destinations)
        self.goodput = opts.logging.goodput if keep else None
        if self.fault_tolerance is not None:  # before the saver: its quorum comes first at each event
            self.events.add(self.fault_tolerance)
        if save_folder is not None and (self.fault_tolerance is None or self.fault_tolerance.writes_checkpoints):
            from kiln.checkpoint import CheckpointSaver  # checkpoint code loads only when used

            self._saver = CheckpointSaver(
                save_folder,
                interval=save_interval,
                num_checkpoints_to_keep=save_num_checkpoints_to_keep,
                save_type=save_type,
                save_best=save_best,
                save_async=save_async,
                storage_options=storage_options,
            )
            if self.goodput is not None:  # times the saves: registered just before the saver
                self.events.add(self.goodput.save_timer)
            self.events.add(self._saver)
        if self.goodput is not None:  # after the saver: it charges the saver's time as checkpoint stall
            self.goodput.attach(self._saver, self.logger.destinations)
            self.events.add(self.goodput)

        self.events.run(Event.INIT)
        self._load(load_path, autoresume, save_folder)

    # -- construction helpers -----------------------------------------------------------------
    def _set_train_dataloader(self, loader: Iterable | None) -> None:
        if loader is None:
            return
        if not isinstance(loader, ResumableLoader):  # one the user built is used as it is
            seed = self.state.seed if self.state.seed is not None else 1024
            shares, share = self.engine.data_parallel_size, self.engine.data_parallel_rank
            if self.fault_tolerance is not None:  # each replica group reads its own part of the data
                shares, share = self.fault_tolerance.data_shard(shares, share)
            loader = resumable_train_loader(loader, seed, shares, share, self.options.data.stateful_dataloader)
            subset, resumable = self.options.duration.train_subset_num_batches, self.state.dataloader
            # the run's position (a loaded checkpoint's, or the last loader's) goes on
            if isinstance(resumable, ResumableLoader):
                resumable.loader, resumable.subset_num_batches = loader, subset
            else:
                resumable = ResumableLoader(loader, subset)
            loader = resumable
        self.train_dataloader = self.state.dataloader = loader
        try:  # an epoch is the subset when there is one (Composer sets dataloader_len the same way)
            self.state.dataloader_len = len(loader)
        except TypeError:
            self.state.dataloader_len = None

    def _set_eval_dataloader(self, loader: Any) -> None:
        if loader is not None:
            self.evaluators = as_evaluators(loader, self._shard)
            self.eval_dataloader = self.evaluators[0].dataloader

    def _shard(self, loader: Any) -> Any:
        return ShardSampler.wrap(loader, self.engine.data_parallel_size, self.engine.data_parallel_rank)

    def _load(self, load_path: Any, autoresume: bool, save_folder: Any) -> None:
        from kiln.checkpoint import load_checkpoint
        from kiln.checkpoint.autoresume import load_newest_intact, resume_candidates
        from kiln.checkpoint.layout import resolve_checkpoint

        storage_options = self.options.checkpointing.storage_options
        # autoresume (with a save_folder: CheckpointOptions checked it) wins over load_path once
        # the folder holds a checkpoint: the newest that verifies, a damaged `last` named and
        # skipped rather than failing every restart. An explicit load_path fails loudly instead.
        candidates = resume_candidates(save_folder, storage_options) if autoresume else []
        path = None
        if not candidates and load_path is not None:
            path = resolve_checkpoint(save_folder, load_path, storage_options=storage_options)
            assert path is not None  # must_exist: resolve_checkpoint raised otherwise
        if not candidates and path is None:
            return
        self.events.run(Event.BEFORE_LOAD)
        if candidates:
            load_newest_intact(candidates, self.state, save_folder, storage_options)
        else:
            load_checkpoint(path, self.state)
        self.events.run(Event.AFTER_LOAD)
        # A mark on the run's time axis (where `kiln report` draws the resume); no device read.
        self.logger.log_metrics({"checkpoint/resumed": 1}, step=self.state.timestamp.batch.value)

    # -- small helpers the loop and the evaluator share ----------------------------------------
    def to_device(self, batch: Any) -> Any:
        return batch if self.engine.device.type == "cpu" else move_to_device(batch, self.engine.device)

    def forward(self, batch: Any) -> Any:
        """Outputs of the (wrapped) model: ``model(batch)`` for a kiln.Model, else ``model(batch[0])``."""
        return self.engine(batch) if self._is_kiln_model else self.engine(batch[0])

    # -- the loop ------------------------------------------------------------------------------
    def fit(
        self,
        train_dataloader: Iterable | None = None,
        duration: int | str | Time | None = None,
        eval_dataloader: Iterable | Evaluator | Sequence[Evaluator] | None = None,
        epochs: int | None = None,
        test_dataloader: Iterable | None = None,
        test_interval: int = 1,
        hooks: Sequence[Any] | None = None,
        display_progress: bool | None = None,
        reset_time: bool = False,
    ) -> None:
        """Train until ``max_duration`` (or ``duration`` more, or ``epochs``), evaluating and
        checkpointing as configured. The Colossal-AI arguments (``epochs``, ``test_dataloader``,
        ``test_interval``, ``hooks``, ``display_progress``) work as in its Trainer."""
        hook_callback = self._prepare_fit(
            train_dataloader,
            duration,
            eval_dataloader,
            epochs,
            test_dataloader,
            test_interval,
            hooks,
            display_progress,
            reset_time,
        )
        state, events, opts, progress = self.state, self.events, self.options, self.progress
        ts, loader, max_duration = state.timestamp, self.train_dataloader, state.max_duration
        assert loader is not None and max_duration is not None  # _prepare_fit raised otherwise
        counter = "_" + _COUNTER[max_duration.unit]  # the Timestamp field max_duration counts
        limit, by_epoch = max_duration.value, max_duration.unit == TimeUnit.EPOCH
        # Events nobody listens to are skipped with one set lookup: the loop's per-batch cost
        # without callbacks is a handful of attribute reads (benchmarks/overhead.py).
        active, run = events.active, events.run
        move, world = self.engine.device.type != "cpu", self.engine.data_parallel_size
        evaluate_batches = evaluates_on(self.evaluators, opts.evaluation, Event.BATCH_END)
        log_every = opts.logging.log_every
        perf_counter = time.perf_counter
        heartbeat.follow(events.describe)
        try:
            progress.start(state)  # the time to the first step counts from here
            run(Event.FIT_START)
            state.clear_stop()
            while not state._stop and getattr(ts, counter) < limit:
                if not ts._batch_in_epoch:  # a new epoch, not a resumed one
                    run(Event.EPOCH_START)
                progress.start_epoch(state)
                # The loader sets the sampler's epoch, continues a resumed epoch where it was and
                # restores the RNG after a resume: the loop only asks it for batches.
                iterator = iter(loader)
                batch = None
                while True:
                    if _BEFORE_DATALOADER in active:
                        run(_BEFORE_DATALOADER)
                    start = perf_counter()  # a batch's time runs from its fetch to its count
                    batch = next(iterator, None)
                    if batch is None:
                        break
                    state.batch = move_to_device(batch, self.engine.device) if move else batch
                    if _AFTER_DATALOADER in active:
                        run(_AFTER_DATALOADER)
                    if _BATCH_START in active:
                        run(_BATCH_START)
                    # Counted as the dataloader gave it (an algorithm may shrink the batch), for
                    # every data-parallel rank as Composer counts, without a collective: the
                    # samplers give every rank the same number of samples per batch.
                    samples = num_samples(state.batch)
                    tokens = 0 if type(state.batch) in (tuple, list) else num_tokens(state.batch)
                    self._train_batch(samples)
                    now = perf_counter()
                    ts.advance_batch(samples * world, tokens * world, now - start)
                    if active or evaluate_batches:  # else nobody reads it before the loop stops (below)
                        state.metrics["train/loss"] = state.loss.detach()
                    for scheduler in self._per_batch_schedulers:
                        scheduler.step()
                    if _BATCH_END in active:
                        run(_BATCH_END)
                    if self.logger.destinations and ts._batch % log_every == 0:
                        self._log_train()
                    if ts._batch >= progress.due_batch or now >= progress.due_time:  # a bar, or a line due
                        progress.update(state)
                    # Evaluation runs before the checkpoint event (Composer's order): the checkpoint
                    # then holds this step's metrics and the RNG state after the eval loader drew from it.
                    if evaluate_batches:
                        evaluate_due(self, Event.BATCH_END)  # each set at its own interval
                    if _BATCH_CHECKPOINT in active:
                        run(_BATCH_CHECKPOINT)
                    if state._stop or (not by_epoch and getattr(ts, counter) >= limit):
                        break
                if state.loss is not None:
                    state.metrics["train/loss"] = state.loss.detach()
                if batch is not None or state._stop:
                    continue  # stopped inside the epoch: the while condition ends the run
                if ts._batch_in_epoch == 0:
                    raise ValueError("the training dataloader produced no batches; check its length and drop_last")
                ts.advance_epoch()
                for scheduler in self._per_epoch_schedulers:
                    scheduler.step()
                run(Event.EPOCH_END)
                if self.evaluators:
                    evaluate_due(self, Event.EPOCH_END)
                run(Event.EPOCH_CHECKPOINT)
            run(Event.FIT_END)
            self.logger.flush()
            progress.finish(state, self._saver.last_path if self._saver is not None else None)
        except BaseException as exc:
            # An error, a peer's death (a failed collective), a preemption's exit: what the
            # loggers hold is written before the process can end (they stay open for a caller
            # that goes on; the interpreter's exit and SIGTERM close them, kiln.loggers.flushing).
            self._flush_loggers()
            if isinstance(exc, RuntimeError):
                heartbeat.raise_if_timed_out(exc)  # a collective timed out: say which rank is missing
            raise
        finally:
            if hook_callback is not None:
                events.remove(hook_callback)
            progress.close()

    def _prepare_fit(
        self,
        train_dataloader: Any,
        duration: Any,
        eval_dataloader: Any,
        epochs: Any,
        test_dataloader: Any,
        test_interval: int,
        hooks: Any,
        display_progress: Any,
        reset_time: bool,
    ) -> Any:
        """Apply fit()'s arguments to the Trainer; returns the Colossal-AI hook callback, if any."""
        state, opts = self.state, self.options
        if train_dataloader is not None:
            self._set_train_dataloader(train_dataloader)
        if eval_dataloader is not None or test_dataloader is not None:
            self._set_eval_dataloader(eval_dataloader if eval_dataloader is not None else test_dataloader)
            if test_dataloader is not None:
                opts.evaluation.eval_interval = Time(test_interval, TimeUnit.EPOCH)
        if display_progress is not None:
            self.progress.enabled = display_progress and state.rank == 0
        if reset_time:  # time and data start again from epoch 0
            state.timestamp.load_state_dict({})
            if isinstance(self.train_dataloader, ResumableLoader):
                self.train_dataloader.restart()
        if epochs is not None:
            duration = Time(epochs, TimeUnit.EPOCH)
        if duration is not None:
            duration = resolve_duration(duration)
            state.max_duration = state.timestamp.get(duration.unit) + duration
        if state.max_duration is None:
            raise ValueError("no duration: pass max_duration= to the Trainer, or duration=/epochs= to fit()")
        if self.train_dataloader is None:
            raise ValueError("no training data: pass train_dataloader= to the Trainer or to fit()")
        check_schedulers(self._per_batch_schedulers, state)
        self.events.rebuild()  # callbacks, algorithms or loggers whose lists were edited directly count from here
        self._step_plan = (-1,)  # planned again at the first step, for this fit's options
        hook_callback = None
        if hooks:
            from kiln.trainer.hooks import ColossalHookCallback

            hook_callback = ColossalHookCallback(hooks, self)
            self.events.add(hook_callback)
        return hook_callback

    def _train_batch(self, batch_size: int) -> None:
        """One optimizer step over ``state.batch`` (of ``batch_size`` samples), through
        :meth:`Engine.train_step`: this method splits the batch and fires the events between."""
        state, engine, opts = self.state, self.engine, self.options.microbatching
        plan = self._step_plan
        if plan[0] != self.events.version:  # the listeners changed (or the first step)
            plan = self._plan_step()
        _, before_train_batch, loss_of, after_backward, after_microbatches, before_step = plan
        if before_train_batch:
            self.events.run(_BEFORE_TRAIN_BATCH)
            batch_size = num_samples(state.batch)  # an algorithm may have resized the batch
        self._step_batch = batch = state.batch
        while True:
            microbatch_size = opts.microbatch_size(batch_size) if opts.splits_batches else batch_size
            microbatches = split_batch(batch, microbatch_size) if microbatch_size < batch_size else (batch,)
            try:
                loss = engine.train_step(
                    microbatches,
                    loss_of,
                    weighting=state.microbatch_weighting,
                    after_backward=after_backward,
                    after_microbatches=after_microbatches,
                    before_optimizer_step=before_step,
                )
                if after_microbatches is None:
                    state.batch, state.loss = batch, loss
                return
            except _RetryBatch:  # another rank ran out of memory: retry with the same smaller microbatch
                opts.halve_microbatch(batch_size)
            except torch.OutOfMemoryError:
                if not opts.auto_microbatch:
                    raise
                opts.any_rank_oom(True)
                opts.halve_microbatch(batch_size)
                state.outputs = state.loss = None
                state.batch = batch
                if engine.device.type == "cuda":
                    torch.cuda.empty_cache()

    def _plan_step(self) -> tuple[Any, ...]:
        """What a step fires between its phases, given who listens now; kept in ``_step_plan`` (per
        step this is a handful of set lookups, which the loop pays only when the listeners change)."""
        active, events = self.events.active, self.events
        after_backward = self._after_backward if _AFTER_BACKWARD in active else None
        before_step = self._before_optimizer_step if _BEFORE_OPTIMIZER_STEP in active else None
        # nothing to do between the microbatches and the step: the batch and its loss go back on the state after it
        after_microbatches = (
            self._after_microbatches
            if before_step is not None or _AFTER_TRAIN_BATCH in active or self.options.microbatching.auto_microbatch
            else None
        )
        # without listeners between forward and backward, the loss needs no event checks
        loss_of = self._plain_loss if active.isdisjoint(_MICROBATCH_EVENTS) else self._microbatch_loss
        plan = (events.version, _BEFORE_TRAIN_BATCH in active, loss_of, after_backward, after_microbatches, before_step)
        self._step_plan = plan
        return plan

    # The Engine's train_step calls these between its phases; each fires the Trainer's events there.
    def _microbatch_loss(self, microbatch: Any) -> torch.Tensor:
        """Forward and loss of one microbatch, with their events; the loss the backward takes."""
        state, active, run = self.state, self.events.active, self.events.run
        state.batch = microbatch
        state.outputs = None  # the last step's outputs would stay alive through this forward
        if _BEFORE_FORWARD in active:
            run(_BEFORE_FORWARD)
        state.outputs = self.forward(state.batch)
        if _AFTER_FORWARD in active:
            run(_AFTER_FORWARD)
        if _BEFORE_LOSS in active:
            run(_BEFORE_LOSS)
        state.loss = self.loss_fn(state.outputs, state.batch)
        if _AFTER_LOSS in active:
            run(_AFTER_LOSS)
        if _BEFORE_BACKWARD in active:
            run(_BEFORE_BACKWARD)
        return state.loss

    def _plain_loss(self, microbatch: Any) -> torch.Tensor:
        """:meth:`_microbatch_loss` when no one listens to its events."""
        state, engine = self.state, self.engine
        state.batch = microbatch
        state.outputs = None  # the last step's outputs would stay alive through this forward
        if self.loss_fn is self._targets_loss:  # a plain module: (inputs, targets), the criterion on the outputs
            state.outputs = outputs = engine(microbatch[0])
            state.loss = loss = engine.criterion(outputs, microbatch[1])
        else:
            state.outputs = outputs = self.forward(microbatch)
            state.loss = loss = self.loss_fn(outputs, microbatch)
        return loss

    def _after_backward(self) -> None:
        self.events.run(_AFTER_BACKWARD)

    def _after_microbatches(self, loss: torch.Tensor) -> None:
        """Gradients complete: the batch and its loss back on the state, then ``AFTER_TRAIN_BATCH``."""
        opts = self.options.microbatching
        if opts.auto_microbatch and opts.any_rank_oom(False):
            raise _RetryBatch
        state = self.state
        state.batch = self._step_batch
        state.loss = loss
        if _AFTER_TRAIN_BATCH in self.events.active:
            self.events.run(_AFTER_TRAIN_BATCH)

    def _before_optimizer_step(self) -> None:
        self.events.run(_BEFORE_OPTIMIZER_STEP)

    def _log_train(self) -> None:
        """Log train/loss (averaged across ranks) and train/lr; called every log_interval batches."""
        ts = self.state.timestamp
        loss = self.state.loss.detach()
        if self.state.world_size > 1:  # averaged across ranks, only when a logger will write it
            import torch.distributed as dist

            loss = loss.clone()
            dist.all_reduce(loss)  # a SUM: gloo has no AVG
            loss /= self.state.world_size
        metrics: dict[str, Any] = {"train/loss": loss}
        if self.state.optimizer is not None:
            metrics["train/lr"] = self.state.optimizer.param_groups[0]["lr"]
        self.logger.log_metrics(metrics, step=ts._batch)

    # -- evaluation, prediction, checkpoints ---------------------------------------------------
    def eval(
        self,
        dataloader: Iterable | Evaluator | Sequence[Evaluator] | None = None,
        subset_num_batches: int | None = None,
        label: str = "eval",
    ) -> dict[str, float]:
        """Evaluate on ``dataloader`` (default: every evaluation set of the Trainer); returns
        ``{"eval/loss": ..., "eval/<Metric>": ...}`` (``label`` replaces ``eval`` for a plain loader),
        and ``eval/<label>/<Metric>`` for each :class:`kiln.Evaluator`.

        Every rank runs the same number of forwards, padding a shorter shard with forwards whose
        outputs count nowhere, so the values equal one process's (see :mod:`kiln.trainer.evaluation`)."""
        evaluators = as_evaluators(dataloader, self._shard, label) if dataloader is not None else self.evaluators
        if not evaluators:
            raise ValueError("no evaluation data: pass eval_dataloader= to the Trainer or dataloader= to eval()")
        heartbeat.follow(self.events.describe)
        try:
            return evaluate_sets(self, evaluators, subset_num_batches)
        except RuntimeError as exc:
            heartbeat.raise_if_timed_out(exc)
            raise

    def predict(self, dataloader: Iterable, gather: bool = False) -> list[Any] | None:
        """Model outputs for ``dataloader`` (eval mode, no gradients), sharded over the data-parallel
        ranks like evaluation. ``gather=False``: this rank's outputs, batch by batch. ``gather=True``:
        rank 0 gets all of them in dataset order, batched as one process would batch them (on the
        CPU when there are several ranks); the other ranks get ``None``. See :func:`kiln.trainer.evaluation.predict`."""
        loader = ShardSampler.wrap(dataloader, self.engine.data_parallel_size, self.engine.data_parallel_rank)
        return predict(self, loader, gather)

    def save_checkpoint(self, folder: str | os.PathLike | None = None) -> str:
        """Write a checkpoint now; returns its path."""
        from kiln.checkpoint import save_checkpoint

        folder = folder or (self._saver.folder if self._saver is not None else None)
        if folder is None:
            raise ValueError("save_checkpoint() needs a folder: pass save_folder= to the Trainer or folder= here")
        return str(save_checkpoint(folder, self.state, save_type=self.options.checkpointing.save_type))

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        from kiln.checkpoint import load_checkpoint

        load_checkpoint(path, self.state, storage_options=self.options.checkpointing.storage_options)

    def _flush_loggers(self) -> None:
        """Flush every logger on this rank without raising: the error on its way out stays the one seen."""
        for destination in self.logger.destinations:
            try:
                destination.flush()
            except Exception as exc:  # noqa: BLE001 - a full disk must not hide the run's own error
                warnings.warn(
                    f"{type(destination).__name__} could not flush its records ({type(exc).__name__}: {exc})",
                    KilnWarning,
                    stacklevel=2,
                )

    def close(self) -> None:
        """Release loggers and callbacks (files, writers)."""
        for callback in self.state.callbacks:
            callback.close(self.state, self.logger)
        self.logger.close()
        self.progress.close()

    # -- Colossal-AI's trainer attributes, for its hooks -----------------------------------------
    @property
    def cur_epoch(self) -> int:
        return self.state.timestamp.epoch.value

    @property
    def cur_step(self) -> int:
        return self.state.timestamp.batch.value

    @property
    def steps_per_epoch(self) -> int | None:
        return self.state.dataloader_len


# Module-level aliases: reading an Enum member through its class costs more than a global.
_BEFORE_DATALOADER, _AFTER_DATALOADER, _BATCH_START = Event.BEFORE_DATALOADER, Event.AFTER_DATALOADER, Event.BATCH_START
_BEFORE_TRAIN_BATCH, _AFTER_TRAIN_BATCH = Event.BEFORE_TRAIN_BATCH, Event.AFTER_TRAIN_BATCH
_BEFORE_OPTIMIZER_STEP = Event.BEFORE_OPTIMIZER_STEP
_BEFORE_FORWARD, _AFTER_FORWARD = Event.BEFORE_FORWARD, Event.AFTER_FORWARD
_BEFORE_LOSS, _AFTER_LOSS = Event.BEFORE_LOSS, Event.AFTER_LOSS
_BEFORE_BACKWARD, _AFTER_BACKWARD = Event.BEFORE_BACKWARD, Event.AFTER_BACKWARD
_MICROBATCH_EVENTS = frozenset({_BEFORE_FORWARD, _AFTER_FORWARD, _BEFORE_LOSS, _AFTER_LOSS, _BEFORE_BACKWARD})
_BATCH_END, _BATCH_CHECKPOINT = Event.BATCH_END, Event.BATCH_CHECKPOINT


class _RetryBatch(Exception):
    """Another rank ran out of memory in this batch: every rank retries it with smaller microbatches."""


_COUNTER = {
    TimeUnit.EPOCH: "epoch",
    TimeUnit.BATCH: "batch",
    TimeUnit.SAMPLE: "sample",
    TimeUnit.TOKEN: "token",
    TimeUnit.SECOND: "total_wct",
}
