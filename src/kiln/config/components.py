"""The component configs of :class:`kiln.config.TrainerArgs` (nnScaler's names and rules).

Components are named by fully qualified type with their constructor ``args``; kiln builds them
(see :mod:`kiln.config.trainer_builder`). Every class is keyword-only and checks its fields in
``__post_init__``, so a wrong value fails when the config is read, before anything is created.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from kiln.config.overrides import ConfigError, format_error
from kiln.config.types import check_fields
from kiln.core.names import did_you_mean
from kiln.core.paths import is_url

__all__ = [
    "CheckpointConfig",
    "CriterionConfig",
    "DataloaderConfig",
    "DatasetConfig",
    "DatasetSamplerConfig",
    "HookConfig",
    "HookMapConfig",
    "LRSchedulerConfig",
    "LogConfig",
    "ModelConfig",
    "OptimizerConfig",
    "check_count",
    "require",
]


def check_count(obj: Any, name: str, *, minimum: int = 1, also: tuple[Any, ...] = ()) -> None:
    """Refuse a count below ``minimum`` (``None`` and the values in ``also`` pass)."""
    value = getattr(obj, name)
    if value is None or value in also or value >= minimum:
        return
    allowed = f"an int >= {minimum}" + "".join(f" or {a!r}" for a in also if a is not None)
    raise ConfigError(format_error(name, value, allowed), path=name)


def require(obj: Any, name: str, what: str) -> None:
    if not getattr(obj, name):
        raise ConfigError(f"{name}: is not set, expected {what}", path=name)


@dataclass(kw_only=True)
class ModelConfig:
    """The model: ``type(**args)``.

    Args:
        type: fully qualified name of the model class or factory (e.g. ``examples.mlp_model.MLP``).
        args: keyword arguments of the constructor (``__type`` dicts build nested objects).
    """

    type: str | None = None
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(kw_only=True)
class CriterionConfig:
    """A loss function ``criterion(outputs, targets)`` for a plain model (kiln; nnScaler has none).

    Args:
        type: fully qualified name of the loss class or factory (e.g. ``torch.nn.CrossEntropyLoss``).
        args: keyword arguments of the constructor.
    """

    type: str | None = None
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self)
        require(self, "type", "a loss class such as 'torch.nn.CrossEntropyLoss'")


GRAD_REDUCTIONS = ("mean", "sum", "per-token-mean")


@dataclass(kw_only=True)
class OptimizerConfig:
    """The optimizer: ``type(model.parameters(), **args)``, and how gradients are reduced.

    Args:
        type: fully qualified name of the optimizer class or factory (first argument: the parameters).
        args: keyword arguments of the optimizer (``lr``, ``weight_decay``, ...).
        clip_gnorm: clip the global gradient norm to this value; 0.0 or null means no clipping.
        loss_reduction: the reported training loss over micro-batches: 'mean' or 'sum'.
        grad_reduction: gradients over all micro-batches of all ranks: 'mean', 'sum' or 'per-token-mean'.
        aggregate_outputs_fn: fully qualified name of fn(loss_outputs, sync_group) -> AggregatedOutputs; required for per-token-mean.
    """

    type: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    clip_gnorm: float | None = 0.0
    loss_reduction: Literal["mean", "sum", "per-token-mean"] = "mean"
    grad_reduction: Literal["mean", "sum", "per-token-mean"] = "mean"
    aggregate_outputs_fn: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.clip_gnorm is not None and self.clip_gnorm < 0:
            raise ConfigError(
                format_error("clip_gnorm", self.clip_gnorm, "a number >= 0 (0 = no clipping)"), path="clip_gnorm"
            )
        for name in ("grad_reduction", "loss_reduction"):
            if getattr(self, name) == "per-token-mean" and not self.aggregate_outputs_fn:
                raise ConfigError(
                    f"aggregate_outputs_fn: is not set, expected the name of a function returning "
                    f"AggregatedOutputs with num_tokens, because {name} is 'per-token-mean'",
                    path="aggregate_outputs_fn",
                )


@dataclass(kw_only=True)
class DatasetConfig:
    """The datasets: ``type(**train_args)`` and, when ``val_args`` is not empty, ``type(**val_args)``.

    Args:
        type: fully qualified name of the dataset class or factory.
        train_args: keyword arguments of the training dataset.
        val_args: keyword arguments of the validation dataset (empty: no validation).
    """

    type: str | None = None
    train_args: dict[str, Any] = field(default_factory=dict)
    val_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(kw_only=True)
class DataloaderConfig:
    """The dataloaders: ``type(dataset=..., batch_size=..., sampler=..., **train_args)``.

    Args:
        type: fully qualified name of the dataloader class or factory.
        train_args: keyword arguments except dataset, batch_size and sampler, which kiln sets.
        val_args: the same for validation (empty: train_args).
        test_args: the same for testing (empty: train_args).
    """

    type: str = "torch.utils.data.DataLoader"
    train_args: dict[str, Any] = field(default_factory=dict)
    val_args: dict[str, Any] = field(default_factory=dict)
    test_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self)
        for stage in ("train_args", "val_args", "test_args"):
            for key in ("dataset", "batch_size", "sampler"):
                if key in getattr(self, stage):
                    instead = "micro_batch_size" if key == "batch_size" else f"the {key} config"
                    raise ConfigError(
                        f"{stage}.{key}: kiln sets this argument itself; set {instead} instead", path=f"{stage}.{key}"
                    )
        if "shuffle" in self.train_args:  # torch refuses shuffle= together with a sampler
            raise ConfigError(
                format_error(
                    "train_args.shuffle",
                    self.train_args["shuffle"],
                    "no shuffle here: kiln passes a sampler; set dataset_sampler.train_args.shuffle instead",
                ),
                path="train_args.shuffle",
            )


SAMPLER_FILLED = ("dataset", "num_replicas", "rank")


@dataclass(kw_only=True)
class DatasetSamplerConfig:
    """The dataset sampler: ``type(dataset=..., num_replicas=..., rank=..., **train_args)``.

    Args:
        type: fully qualified name of the sampler class or factory (default: a resumable DistributedSampler).
        train_args: keyword arguments; dataset, num_replicas and rank are set by kiln and ignored here.
        val_args: the same for validation (empty: validation data is split across ranks without a sampler).
        test_args: the same for testing (empty: train_args).
    """

    type: str = "kiln.launch.ResumableSampler"
    train_args: dict[str, Any] = field(default_factory=dict)
    val_args: dict[str, Any] = field(default_factory=dict)
    test_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(kw_only=True)
class LRSchedulerConfig:
    """The learning-rate scheduler: ``type(optimizer, **args)``.

    Args:
        type: fully qualified name of the scheduler class or factory (first argument: the optimizer).
        args: keyword arguments of the scheduler.
        interval: when a torch scheduler steps: 'epoch' or 'step' (kiln time-aware schedulers step every batch).
    """

    type: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    interval: Literal["epoch", "step"] = "epoch"

    def __post_init__(self) -> None:
        check_fields(self)
        require(self, "type", "a scheduler such as 'torch.optim.lr_scheduler.StepLR'")


# kiln.checkpoint.formats.SAVE_TYPES is the home of the save types. A Literal must spell its values
# out, and the config layer imports no torch (nor, so, the checkpoint code): this copy is kept equal
# to the home by tests/test_single_sources.py::test_config_save_types_are_the_checkpoint_layers.
SaveType = Literal["sharded", "deduped", "merged"]


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoints: where, how often, how many, and what to resume from.

    Args:
        save_dir: the folder of checkpoints (one sub-folder per checkpoint, links 'last' and 'best').
        no_save: write no checkpoints at all.
        save_type: 'sharded', 'deduped' or 'merged' (one consolidated file).
        save_last: keep a 'last' link to the newest checkpoint (kiln always saves when training ends and links it).
        save_best: keep a 'best' link to the checkpoint with the lowest validation loss (needs val data).
        symlink_best_and_last: 'last' and 'best' are symlinks (kiln always links, copying where links are impossible).
        every_n_train_steps: save every n optimizer steps (not together with every_n_epochs).
        every_n_epochs: save every n epochs (default when neither is set: 1).
        keep_last_n_checkpoints: keep only the newest n checkpoints (null: keep all).
        resume_from: 'last', 'best' (skipped when absent) or the path of a checkpoint (must exist).
        storage_options: for a save_dir or resume_from that is an fsspec URL (``s3://bucket/run``),
            the filesystem's options (``key``, ``secret``, ``endpoint_url``, ...); null: the
            standard places (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
    """

    save_dir: str = "./checkpoints"
    no_save: bool = False
    save_type: SaveType = "sharded"
    save_last: bool = True
    save_best: bool = True
    symlink_best_and_last: bool = True
    every_n_train_steps: int | None = None
    every_n_epochs: int | None = None
    keep_last_n_checkpoints: int | None = None
    resume_from: str | None = None
    storage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("every_n_train_steps", "every_n_epochs", "keep_last_n_checkpoints"):
            check_count(self, name)
        if self.every_n_train_steps is not None and self.every_n_epochs is not None:
            raise ConfigError(
                f"every_n_epochs: got {self.every_n_epochs} while every_n_train_steps is {self.every_n_train_steps}, "
                "expected only one of them to be set",
                path="every_n_epochs",
            )
        if not self.save_dir and (not self.no_save or self.resume_from in ("last", "best")):
            raise ConfigError(format_error("save_dir", self.save_dir, "a folder path"), path="save_dir")
        # A URL is checked when the checkpoint is loaded (the store may need the storage options).
        if self.resume_from is not None and self.resume_from not in ("last", "best") and not is_url(self.resume_from):
            import os

            if not os.path.exists(self.resume_from):
                raise ConfigError(
                    format_error(
                        "resume_from", self.resume_from, "'last', 'best' or the path of an existing checkpoint"
                    ),
                    path="resume_from",
                )


_BUILTIN_LOGGERS = {
    "console": "kiln.loggers.ConsoleLogger",
    "file": "kiln.loggers.FileLogger",
    "tensorboard": "kiln.loggers.TensorBoardLogger",
    "wandb": "kiln.loggers.WandBLogger",
    "mlflow": "kiln.loggers.MLflowLogger",
}


@dataclass(kw_only=True)
class LogConfig:
    """A logger: ``type(**args)``; a bare name (console, file, tensorboard, wandb, mlflow) is kiln's.

    Args:
        type: a bare logger name or the fully qualified name of a logger class.
        args: keyword arguments of the logger (e.g. ``path`` for file, ``log_dir`` for tensorboard).
    """

    type: str | None = None
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self)
        require(self, "type", f"a logger: one of {', '.join(_BUILTIN_LOGGERS)} or a class name")
        assert self.type is not None  # require() refused an unset type
        if "." not in self.type:
            name = self.type.lower().removesuffix("logger")
            if name not in _BUILTIN_LOGGERS:
                hint = did_you_mean(name, _BUILTIN_LOGGERS)
                raise ConfigError(
                    format_error(
                        "type", self.type, "one of " + ", ".join(_BUILTIN_LOGGERS) + " or a fully qualified class name"
                    )
                    + hint,
                    path="type",
                )
            self.type = _BUILTIN_LOGGERS[name]


@dataclass(kw_only=True)
class HookConfig:
    """A hook object: ``type(**args)`` with methods named after nnScaler's hook points.

    Args:
        type: fully qualified name of the hook class (e.g. a kiln.config.TrainHook subclass).
        args: keyword arguments of the hook's constructor.
    """

    type: str | None = None
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self)
        require(self, "type", "a hook class name")


@dataclass(kw_only=True)
class HookMapConfig:
    """Hook functions by hook point, each a fully qualified function name called with the Trainer first.

    Args:
        after_setup: fn(trainer) after the Trainer is built (run_mode 'run' only).
        on_train_start: fn(trainer) when training starts.
        on_train_end: fn(trainer) when training ends.
        on_val_start: fn(trainer) when a validation starts.
        on_val_end: fn(trainer, val_loss) when a validation ends.
        on_epoch_start: fn(trainer, epoch) at the start of each epoch.
        on_epoch_end: fn(trainer, epoch) at the end of each epoch.
        on_train_step_start: fn(trainer, batches, idx) before each training step.
        on_train_step_end: fn(trainer, outputs, batches, idx) after each training step.
        on_val_step_start: fn(trainer, batches, idx) before each validation step.
        on_val_step_end: fn(trainer, outputs, batches, idx) after each validation step.
        after_aggregate_train_step_outputs: fn(trainer, aggregated_outputs, train_loss, idx).
        after_aggregate_val_step_outputs: fn(trainer, aggregated_outputs, val_loss, idx).
        before_zero_grad: fn(trainer) before gradients are zeroed.
        after_zero_grad: fn(trainer) after gradients are zeroed.
        before_sync_grad: fn(trainer) once gradients are complete (DDP has synchronised them already).
        after_sync_grad: fn(trainer) once gradients are synchronised.
        before_gnorm_clip: fn(trainer) before gradient clipping.
        after_gnorm_clip: fn(trainer, gnorm) after gradient clipping, with the norm before clipping.
        before_optimizer_step: fn(trainer) before the optimizer step.
        after_optimizer_step: fn(trainer) after the optimizer step.
        on_load_checkpoint: fn(trainer, checkpoint) with what on_save_checkpoint put in the checkpoint.
        on_save_checkpoint: fn(trainer, checkpoint) may add plain data to the checkpoint dict.
    """

    after_setup: str | None = None
    on_train_start: str | None = None
    on_train_end: str | None = None
    on_val_start: str | None = None
    on_val_end: str | None = None
    on_epoch_start: str | None = None
    on_epoch_end: str | None = None
    on_train_step_start: str | None = None
    on_train_step_end: str | None = None
    on_val_step_start: str | None = None
    on_val_step_end: str | None = None
    after_aggregate_train_step_outputs: str | None = None
    after_aggregate_val_step_outputs: str | None = None
    before_zero_grad: str | None = None
    after_zero_grad: str | None = None
    before_sync_grad: str | None = None
    after_sync_grad: str | None = None
    before_gnorm_clip: str | None = None
    after_gnorm_clip: str | None = None
    before_optimizer_step: str | None = None
    after_optimizer_step: str | None = None
    on_load_checkpoint: str | None = None
    on_save_checkpoint: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)

    def functions(self) -> dict[str, str]:
        """The hook points that are set, with their function names."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name)}
