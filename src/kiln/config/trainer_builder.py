"""``TrainerArgs`` -> :class:`kiln.Trainer`: build each component, then hand them to the Trainer.

There is no second training loop here: nnScaler's options become Trainer arguments, callbacks
(:class:`~kiln.config.reduction.GradReduction`, :class:`~kiln.config.hooks.HookCallback`) and
schedules. The mapping:

======================================================  ==============================================
TrainerArgs                                             kiln.Trainer
======================================================  ==============================================
micro_batch_size * grad_accumulation_steps              the dataloader's batch_size (one batch = one step)
grad_accumulation_steps                                 grad_accum
max_epochs / max_train_steps (whichever comes first)    max_duration ("4ep" / "10ba")
val_every_n_train_steps / val_every_n_epochs            eval_interval;  max_val_steps: eval_subset_num_batches
optimizer.clip_gnorm                                    clip_grad_norm
checkpoint.save_dir / no_save                           save_folder
checkpoint.every_n_train_steps / every_n_epochs         save_interval (validating first, as nnScaler does)
checkpoint.keep_last_n_checkpoints / save_type          save_num_checkpoints_to_keep / save_type
checkpoint.save_best / resume_from                      save_best="eval/loss" / load_path
checkpoint.storage_options                              storage_options (save_dir may be an fsspec URL)
compute_config (+ pas_policy)                           strategy;  precision: precision
compile / activation_checkpointing                      compile / activation_checkpointing (a name: the function)
lr_scheduler.interval                                   step_schedulers_every_batch
stateful_dataloader                                     stateful_dataloader
log / hook / enable_progress_bar / seed / instance_name  loggers / callbacks / progress_bar / seed / run_name
console_interval                                        console_interval
fault_tolerance                                         fault_tolerance
======================================================  ==============================================
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from kiln.config.args import TrainerArgs
from kiln.config.build import build_value, import_type
from kiln.config.components import SAMPLER_FILLED, HookConfig, HookMapConfig
from kiln.config.hooks import HookCallback, TrainHook, hook_from_functions
from kiln.config.reduction import GradReduction, as_end_to_end
from kiln.core.event import Event
from kiln.core.model import Model
from kiln.core.warn import KilnWarning
from kiln.launch.context import context, seed_everything
from kiln.launch.join import join_launcher
from kiln.precision import DTYPES, TENSOR_TYPES, Precision

__all__ = ["build_model", "build_precision", "build_trainer"]


def build_precision(spec: str | dict[str, str] | None) -> str | Precision | None:
    """nnScaler's precision as kiln's: a name, or per tensor type (a missing type, or ``"none"``, is
    left as it is)."""
    if spec is None or spec == "none":
        return None
    if isinstance(spec, str):
        return spec
    dtypes = {k: None if spec.get(k, "none") == "none" else DTYPES[spec[k]] for k in TENSOR_TYPES}
    return Precision(
        "custom",
        param_dtype=dtypes["param"],
        buffer_dtype=dtypes["buffer"],
        input_dtype=dtypes["input"],
        scaled=dtypes["param"] is torch.float16,
    )


def _make(type_name: str | None, where: str, /, *positional: Any, **kwargs: Any) -> Any:
    return import_type(type_name, f"{where}.type")(*positional, **kwargs)


def build_scheduler(args: TrainerArgs, optimizer: torch.optim.Optimizer) -> Any:
    """The run file's ``lr_scheduler`` (None without one): torch's schedulers take the optimizer
    first; kiln's time-aware ones (``kiln.optim.CosineAnnealingWithWarmupScheduler``, ...) read the
    Trainer's state and take none."""
    if args.lr_scheduler is None:
        return None
    from kiln.optim.schedulers import takes_optimizer

    factory = import_type(args.lr_scheduler.type, "lr_scheduler.type")
    first = [optimizer] if takes_optimizer(factory) else []
    return factory(*first, **build_value(args.lr_scheduler.args, "lr_scheduler.args"))


class _Every:
    """True every ``steps`` batches (at ``batch_event``) or ``epochs`` epochs (at ``epoch_event``)."""

    def __init__(self, steps: int | None, epochs: int | None, batch_event: Event, epoch_event: Event) -> None:
        self.steps, self.epochs, self.batch_event, self.epoch_event = steps, epochs, batch_event, epoch_event

    def __call__(self, state: Any, event: Event) -> bool:
        ts = state.timestamp
        if event == self.batch_event:
            return bool(self.steps) and ts.batch.value % self.steps == 0
        return event == self.epoch_event and bool(self.epochs) and ts.epoch.value % self.epochs == 0


class _Schedules:
    """When to validate and when to save. As in nnScaler, every save validates first (once per
    step), so the checkpoint's ``best`` link compares fresh validation losses."""

    def __init__(self, args: TrainerArgs) -> None:
        ckpt = args.checkpoint
        self.eval = _Every(args.val_every_n_train_steps, args.val_every_n_epochs, Event.BATCH_END, Event.EPOCH_END)
        every_epochs = ckpt.every_n_epochs or (None if ckpt.every_n_train_steps else 1)
        self.save = _Every(ckpt.every_n_train_steps, every_epochs, Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT)
        self.trainer: Any = None
        self._validated_at: int | None = None

    def _claim(self, state: Any) -> bool:
        step = state.timestamp.batch.value
        first, self._validated_at = self._validated_at != step, step
        return first

    def eval_due(self, state: Any, event: Event) -> bool:
        return self.eval(state, event) and self._claim(state)

    def save_due(self, state: Any, event: Event) -> bool:
        due = self.save(state, event)
        trainer = self.trainer
        if due and trainer is not None and trainer.eval_dataloader is not None and self._claim(state):
            trainer.eval()
        return due


def _max_duration(args: TrainerArgs, steps_per_epoch: int | None) -> str:
    epochs, steps = args.max_epochs, args.max_train_steps
    if steps is None:
        return f"{epochs}ep"
    if epochs is None or steps_per_epoch is None or epochs * steps_per_epoch > steps:
        return f"{steps}ba"
    return f"{epochs}ep"  # epochs end first: keep the unit, so the last epoch's end events run


def _dataloaders(args: TrainerArgs, dp: int, dp_rank: int, train_shares: tuple[int, int]) -> tuple[Any, Any]:
    """The train and validation loaders; ``train_shares``: (shares, index) of the training data, which
    is (dp, dp_rank) unless replica groups split it further (validation stays within the group)."""
    data, sampler_cfg, loader_cfg = args.dataset, args.dataset_sampler, args.dataloader
    micro, accum = args.micro_batch_size, args.grad_accumulation_steps or 1

    def loader(stage: str, batch_size: int, num_replicas: int, rank: int) -> Any:
        dataset_args = getattr(data, f"{stage}_args")
        if stage != "train" and not dataset_args:
            return None  # as in nnScaler: no arguments, no validation dataset
        dataset = _make(data.type, "dataset", **build_value(dataset_args, f"dataset.{stage}_args"))
        sampler = None
        sampler_args = getattr(sampler_cfg, f"{stage}_args")
        # Validation data without a sampler is split by the Trainer; an iterable dataset orders itself.
        if (stage == "train" or sampler_args) and not isinstance(dataset, torch.utils.data.IterableDataset):
            kwargs = {k: v for k, v in sampler_args.items() if k not in SAMPLER_FILLED}
            sampler = _make(
                sampler_cfg.type,
                "dataset_sampler",
                dataset=dataset,
                num_replicas=num_replicas,
                rank=rank,
                **build_value(kwargs, f"dataset_sampler.{stage}_args"),
            )
        loader_args = getattr(loader_cfg, f"{stage}_args") or loader_cfg.train_args
        kwargs = build_value(loader_args, f"dataloader.{stage}_args")
        if isinstance(kwargs.get("collate_fn"), str):
            kwargs["collate_fn"] = import_type(kwargs["collate_fn"], f"dataloader.{stage}_args.collate_fn")
        return _make(loader_cfg.type, "dataloader", dataset=dataset, batch_size=batch_size, sampler=sampler, **kwargs)

    # one dataloader batch is one optimizer step; the Trainer splits it into micro-batches
    return loader("train", micro * accum, *train_shares), loader("val", micro, dp, dp_rank)


def build_model(args: TrainerArgs) -> torch.nn.Module:
    """The model of ``args`` alone, as the Trainer would get it (for ``kiln plan``; seeds like a run)."""
    if args.seed is not None:
        seed_everything(args.seed)
    return _model(args)[0]


def _model(args: TrainerArgs) -> tuple[torch.nn.Module, Any, bool]:
    model = _make(args.model.type, "model", **build_value(args.model.args, "model.args"))
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model.type {args.model.type!r} built a {type(model).__name__}, expected a torch.nn.Module")
    if args.tracing_from_weights:
        model.load_state_dict(torch.load(args.tracing_from_weights, map_location="cpu", weights_only=True))
    criterion = None
    if args.criterion is not None:
        criterion = _make(args.criterion.type, "criterion", **build_value(args.criterion.args, "criterion.args"))
    if criterion is None and not isinstance(model, Model):
        from kiln.models.huggingface import HuggingFaceModel, is_huggingface_model

        if is_huggingface_model(model):  # model.type: transformers.LlamaForCausalLM, say
            model = HuggingFaceModel(model)
    end_to_end = criterion is None and not isinstance(model, Model)
    if end_to_end:
        model = as_end_to_end(model)
    return model, criterion, end_to_end


def _single_process_group(world_size: int) -> None:
    """A world of one has no process group; give it a local one, so that a user's
    ``aggregate_outputs_fn`` can call ``torch.distributed.all_reduce`` as it would under torchrun."""
    if world_size == 1 and dist.is_available() and not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _load_path(args: TrainerArgs) -> str | None:
    from kiln.checkpoint.storage import as_path

    ckpt = args.checkpoint
    if ckpt.resume_from not in ("last", "best"):
        return ckpt.resume_from
    link = as_path(ckpt.save_dir, ckpt.storage_options) / ckpt.resume_from  # a link, or a pointer object on a store
    if not link.exists():
        if context().rank == 0:
            warnings.warn(
                f"checkpoint.resume_from: {ckpt.resume_from!r} does not exist in {ckpt.save_dir!r}; "
                "training starts from scratch",
                KilnWarning,
                stacklevel=2,
            )
        return None
    return ckpt.resume_from if not ckpt.no_save else str(link)


def _callbacks(
    args: TrainerArgs, components: tuple[Any, ...], end_to_end: bool, dp: int, world_size: int
) -> tuple[list[Any], HookCallback | None]:
    """The reduction callback (when not the Trainer's own mean) and the hook adapter, in that order."""
    hooks = [obj for obj in components if isinstance(obj, TrainHook)]  # model, optimizer, scheduler first
    if isinstance(args.hook, HookConfig):
        hooks.append(_make(args.hook.type, "hook", **build_value(args.hook.args, "hook.args")))
    elif isinstance(args.hook, HookMapConfig):
        hooks.append(hook_from_functions({p: import_type(fn, f"hook.{p}") for p, fn in args.hook.functions().items()}))
    opt = args.optimizer
    hook_callback = HookCallback(hooks, clips=bool(opt.clip_gnorm)) if hooks else None
    wants_aggregate = hook_callback is not None and "after_aggregate_train_step_outputs" in hook_callback.points
    callbacks: list[Any] = []
    if opt.grad_reduction != "mean" or opt.loss_reduction != "mean" or opt.aggregate_outputs_fn or wants_aggregate:
        aggregate = None
        if opt.aggregate_outputs_fn:
            aggregate = import_type(opt.aggregate_outputs_fn, "optimizer.aggregate_outputs_fn")
            _single_process_group(world_size)
        reduction = GradReduction(
            opt.grad_reduction, opt.loss_reduction, aggregate, data_parallel_size=dp, end_to_end=end_to_end
        )
        callbacks.append(reduction)
        if hook_callback is not None:
            hook_callback.reduction = reduction
    if hook_callback is not None:
        callbacks.append(hook_callback)  # after the reduction: hooks see reduced gradients
    return callbacks, hook_callback


def _strategy(args: TrainerArgs, ctx: Any) -> Any:
    from kiln.parallel import get_strategy

    cc = args.compute_config
    name = cc.strategy_name(args.pas_policy, ctx.world_size)
    options = dict(cc.strategy_options)
    if name == "hybrid":
        tp, pp = cc.mesh_degrees(args.pas_policy)
        options = {
            "dp_replicate": cc.dp_replicate,
            "dp_shard": cc.dp_shard,
            "tp": tp,
            "pp": pp,
            "ep": cc.ep,
            "cp": cc.cp,
            **options,
        }
    return get_strategy(name, ctx, **options) if options else name


def _activation_checkpointing(spec: str | None) -> Any:
    """A mode as it is; any other string names the function that chooses the modules."""
    from kiln.parallel.transforms.levers import checkpoint_every

    if spec is None or checkpoint_every(spec) is not None:
        return spec
    return import_type(spec, "activation_checkpointing")


def build_trainer(args: TrainerArgs, *, callbacks: Sequence[Any] = ()) -> Any:
    """Build every component of ``args`` and the :class:`kiln.Trainer` that trains them.

    Under torchrun, SLURM or Open MPI the launcher's group is joined first unless a ``launch_*``
    call made one (:func:`kiln.launch.join.join_launcher`); the world size is then
    ``kiln.context().world_size``. ``args`` are resolved for it again, so a mismatch fails here.

    Example::

        trainer = build_trainer(load_trainer_args("run.yaml", world_size=1))
        trainer.fit()
    """
    from kiln.trainer.trainer import Trainer

    ctx = join_launcher(timeout=args.compute_config.timeout)
    args = args.resolve(ctx.world_size)
    cc = args.compute_config
    if args.init_env_fn:
        import_type(args.init_env_fn, "init_env_fn")(args)
    if args.seed is not None:  # before the model is built: the same initial weights on every rank
        seed_everything(args.seed)
    model, criterion, end_to_end = _model(args)
    optimizer = _make(
        args.optimizer.type, "optimizer", model.parameters(), **build_value(args.optimizer.args, "optimizer.args")
    )
    scheduler = build_scheduler(args, optimizer)
    dp = args.data_parallel_size(ctx.world_size)
    dp_rank = ctx.rank // cc.mesh_size
    train_shares = (dp, dp_rank)
    if args.fault_tolerance is not None:  # each replica group trains on its own part of the data
        from kiln.trainer.fault_tolerance import as_fault_tolerance

        replicas = as_fault_tolerance(args.fault_tolerance)
        assert replicas is not None
        train_shares = replicas.data_shard(dp, dp_rank)
    train_dl, val_dl = _dataloaders(args, dp, dp_rank, train_shares)
    loggers = [_make(log.type, f"log.{i}", **build_value(log.args, f"log.{i}.args")) for i, log in enumerate(args.log)]

    extra, hook_callback = _callbacks(args, (model, optimizer, scheduler), end_to_end, dp, ctx.world_size)
    strategy = _strategy(args, ctx)

    ckpt = args.checkpoint
    try:
        steps_per_epoch: int | None = len(train_dl)
    except TypeError:  # an iterable dataset without a length
        steps_per_epoch = None
    schedules = _Schedules(args)
    trainer = Trainer(
        model,
        train_dataloader=train_dl,
        eval_dataloader=val_dl,
        max_duration=_max_duration(args, steps_per_epoch),
        optimizers=optimizer,
        schedulers=scheduler,
        criterion=criterion,
        precision=build_precision(args.precision),
        strategy=strategy,
        grad_accum=args.grad_accumulation_steps or 1,
        clip_grad_norm=args.optimizer.clip_gnorm or None,
        compile=args.compile,
        activation_checkpointing=_activation_checkpointing(args.activation_checkpointing),
        float8=args.float8,
        stateful_dataloader=args.stateful_dataloader,
        callbacks=[*extra, *callbacks],
        loggers=loggers,
        eval_interval=schedules.eval_due,
        eval_subset_num_batches=args.max_val_steps,
        save_folder=None if ckpt.no_save else ckpt.save_dir,
        save_interval=schedules.save_due,
        save_num_checkpoints_to_keep=ckpt.keep_last_n_checkpoints or -1,
        save_type=ckpt.save_type,
        save_best="eval/loss" if ckpt.save_best and val_dl is not None else None,
        load_path=_load_path(args),
        storage_options=ckpt.storage_options,
        seed=args.seed,
        progress_bar=args.enable_progress_bar,
        console_interval=args.console_interval,
        fault_tolerance=args.fault_tolerance,
        step_schedulers_every_batch=args.lr_scheduler is not None and args.lr_scheduler.interval == "step",
        run_name=args.instance_name,
        config=args.to_dict(),
    )
    schedules.trainer = trainer
    if hook_callback is not None:
        hook_callback.bind(trainer)
        if args.run_mode == "run":
            hook_callback.call("after_setup")
    return trainer
