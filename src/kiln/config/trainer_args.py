"""``TrainerArgs``: the typed dataclass a run file maps onto, one field a key (nnScaler's
``TrainerArgs``), validated in ``__post_init__`` and resolved for the world by ``resolve``.

Reading a file and the command line into one is :mod:`kiln.config.args` (``load_trainer_args``);
the components it names are checked against their constructors in :mod:`kiln.config.preflight`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kiln.config.components import (
    CheckpointConfig,
    CriterionConfig,
    DataloaderConfig,
    DatasetConfig,
    DatasetSamplerConfig,
    HookConfig,
    HookMapConfig,
    LogConfig,
    LRSchedulerConfig,
    ModelConfig,
    OptimizerConfig,
    check_count,
)
from kiln.config.compute import ComputeConfig
from kiln.config.overrides import (
    ConfigError,
    format_error,
)
from kiln.config.types import build_dataclass, check_fields, to_plain

__all__ = ["TrainerArgs"]


@dataclass(kw_only=True)
class TrainerArgs:
    """Every argument of a training run; components by fully qualified type name with ``args``.

    Args:
        compute_config: strategy, mesh and world size (kiln's and nnScaler's compute config).
        gen_savedir: nnScaler's folder of generated code; accepted, kiln generates no code.
        gen_reuse: nnScaler's reuse of generated code; accepted, no effect in kiln.
        pas_policy: nnScaler's built-in policy when compute_config.strategy is null: autodist (= auto), dp and data (= ddp), tp (= hybrid over plan_ngpus), hybrid; pp is refused with what to write instead.
        broadcast_strategy: nnScaler's broadcast of generated files; accepted, no effect in kiln.
        instance_name: the run's name (used by loggers and checkpoints).
        run_mode: 'run' trains; 'compile' builds everything (model, strategy, data), prints a summary and stops.
        tracing_from_weights: a state-dict file loaded into the model before training starts.
        model: the model (a kiln.Model; a transformers model, which becomes a kiln.models.HuggingFaceModel; a plain module with a criterion; or an end-to-end module returning its loss).
        criterion: the loss for a plain model whose forward takes inputs (kiln; null for end-to-end models).
        optimizer: the optimizer, gradient clipping and loss/gradient reduction.
        dataset: the training and validation datasets.
        dataloader: the dataloader type and its arguments.
        dataset_sampler: the sampler that splits data across data-parallel ranks (not used for an iterable dataset).
        stateful_dataloader: true builds torchdata's StatefulDataLoader, which resumes iterable data mid-epoch without replay; null: only for an iterable dataset with state_dict/load_state_dict and workers.
        lr_scheduler: the learning-rate scheduler (optional).
        checkpoint: where and how often to save, and what to resume from.
        log: the loggers.
        hook: a hook class (type, args) or a map of hook functions by hook point.
        precision: fp32, fp16, bf16, amp_fp16, amp_bf16, none, or per tensor type {param, buffer, input}.
        compile: true, or a mapping of torch.compile arguments ({mode: max-autotune}): each block of the model is compiled.
        activation_checkpointing: full, selective (keeps matmul outputs), selective:N (every Nth block), or the fully qualified name of fn(module) -> bool.
        float8: true, or a mapping of float8 settings ({recipe: rowwise, emulate: false, skip: [lm_head]}): FP8 linears (torchao).
        micro_batch_size: samples per rank in one forward/backward.
        global_batch_size: samples per optimizer step over all ranks (= micro * data-parallel size * accumulation).
        grad_accumulation_steps: micro-batches per optimizer step on each rank.
        max_epochs: stop after this many epochs (with max_train_steps: whichever comes first).
        max_train_steps: stop after this many optimizer steps in total (a resumed run counts on).
        max_val_steps: validate on at most this many batches.
        val_every_n_train_steps: validate every n optimizer steps.
        val_every_n_epochs: validate every n epochs.
        enable_progress_bar: show progress on rank 0: a bar on a terminal, plain lines when stdout is not one.
        fault_tolerance: run as one replica group of a torchft job (a mapping of kiln.trainer.FaultTolerance's fields: lighthouse, replica_group, num_replica_groups, min_replicas, timeouts, save_group); null: no replica groups.
        console_interval: the most time between two progress lines when stdout is not a terminal ('30s', '5m', '100ba'; a line also comes at each tenth of the run); null: no lines.
        seed: seed python, numpy and torch before the model is built (same weights on every rank).
        init_env_fn: fully qualified name of fn(trainer_args) run first, before anything is built.

    Example::

        args = TrainerArgs(model=ModelConfig(type="examples.mlp_model.MLP", args={"dim": 16}),
                           optimizer=OptimizerConfig(type="torch.optim.AdamW", args={"lr": 1e-3}),
                           dataset=DatasetConfig(type="examples.mlp_model.RandomDataset"),
                           micro_batch_size=4, max_epochs=2).resolve(world_size=1)
    """

    compute_config: ComputeConfig = field(default_factory=ComputeConfig)
    gen_savedir: str = "./.nnscaler"
    gen_reuse: Literal["auto", "match", "override", "moo", "graph"] = "auto"
    pas_policy: str = "autodist"
    broadcast_strategy: Literal["none", "all", "no_weights", "code"] = "all"
    instance_name: str | None = None
    run_mode: Literal["run", "compile"] = "run"
    tracing_from_weights: str | None = None

    model: ModelConfig = field(default_factory=ModelConfig)
    criterion: CriterionConfig | None = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    dataloader: DataloaderConfig = field(default_factory=DataloaderConfig)
    dataset_sampler: DatasetSamplerConfig = field(default_factory=DatasetSamplerConfig)
    stateful_dataloader: bool | None = None
    lr_scheduler: LRSchedulerConfig | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: list[LogConfig] = field(default_factory=list)
    hook: HookConfig | HookMapConfig | None = None

    precision: str | dict[str, str] | None = None
    compile: bool | dict[str, Any] = False
    activation_checkpointing: str | None = None
    float8: bool | dict[str, Any] | None = None

    micro_batch_size: int = 1
    global_batch_size: int | None = None
    grad_accumulation_steps: int | None = None

    max_epochs: int | None = None
    max_train_steps: int | None = None
    max_val_steps: int | None = None

    val_every_n_train_steps: int | None = None
    val_every_n_epochs: int | None = 1

    enable_progress_bar: bool = True
    console_interval: str | float | None = "30s"
    fault_tolerance: dict[str, Any] | None = None
    seed: int | None = None
    init_env_fn: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        for name in (
            "micro_batch_size",
            "global_batch_size",
            "grad_accumulation_steps",
            "max_epochs",
            "max_train_steps",
            "max_val_steps",
            "val_every_n_train_steps",
            "val_every_n_epochs",
        ):
            check_count(self, name)
        self._check_precision()
        self._check_levers()
        self._check_console_interval()
        self._check_fault_tolerance()
        if self.max_epochs is None and self.max_train_steps is None:
            raise ConfigError(
                "max_epochs: is not set (nor max_train_steps), expected at least one of them", path="max_epochs"
            )
        for name, example in (
            ("model", "examples.mlp_model.MLP"),
            ("optimizer", "torch.optim.AdamW"),
            ("dataset", "examples.mlp_model.RandomDataset"),
        ):
            if not getattr(self, name).type:
                raise ConfigError(
                    f"{name}.type: is not set, expected a fully qualified name such as {example!r}", path=f"{name}.type"
                )
        if self.criterion is not None and self.compute_config.use_end2end:
            raise ConfigError(
                "criterion: is set while compute_config.use_end2end is true, expected no criterion "
                "for an end-to-end model (its forward returns the loss)",
                path="criterion",
            )
        if self.tracing_from_weights is not None and not os.path.isfile(self.tracing_from_weights):
            raise ConfigError(
                format_error(
                    "tracing_from_weights", self.tracing_from_weights, "the path of an existing state-dict file"
                ),
                path="tracing_from_weights",
            )

    def _check_fault_tolerance(self) -> None:
        from kiln.trainer.fault_tolerance import as_fault_tolerance  # the Trainer's rule

        try:
            as_fault_tolerance(self.fault_tolerance)
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc), path="fault_tolerance") from None

    def _check_console_interval(self) -> None:
        from kiln.trainer.progress import parse_console_interval  # the Trainer's rule

        try:
            parse_console_interval(self.console_interval)
        except ValueError:
            raise ConfigError(
                format_error(
                    "console_interval",
                    self.console_interval,
                    "a time like '30s' or '5m', batches like '100ba', or null",
                ),
                path="console_interval",
            ) from None

    def _check_levers(self) -> None:
        # ParallelizeOptions holds the rules; imported here, not at the top, as it imports torch.
        from kiln.parallel.transforms.levers import checkpoint_every
        from kiln.parallel.transforms.parallelize import ParallelizeOptions

        ac = self.activation_checkpointing
        if ac is not None and checkpoint_every(ac) is None and "." not in ac:
            raise ConfigError(
                format_error(
                    "activation_checkpointing",
                    ac,
                    "full, selective, selective:N (N >= 1) or the fully qualified name of fn(module) -> bool",
                ),
                path="activation_checkpointing",
            )
        try:
            ParallelizeOptions(compile=self.compile)
        except ValueError as e:
            raise ConfigError(f"compile: {e}", path="compile") from None

    def _check_precision(self) -> None:
        spec = self.precision
        if spec is None:
            return
        # The names live in kiln.precision, which imports torch: imported here, not at the top, so
        # that `import kiln.config` stays light (the component checks import torch anyway).
        from kiln.precision import DTYPES, PRECISIONS, TENSOR_TYPES

        # "none" is nnScaler's: leave the dtypes as the model has them.
        names, dtype_names = ("none", *PRECISIONS), ("none", *DTYPES)
        if isinstance(spec, str) and spec not in names:
            raise ConfigError(
                format_error(
                    "precision",
                    spec,
                    "one of " + ", ".join(names) + " or a mapping of param/buffer/input to fp32/fp16/bf16/none",
                ),
                path="precision",
            )
        if isinstance(spec, dict):
            for key, value in spec.items():
                if key not in TENSOR_TYPES:
                    raise ConfigError(
                        format_error(f"precision.{key}", key, "a tensor type: param, buffer or input"),
                        path=f"precision.{key}",
                    )
                if value not in dtype_names:
                    raise ConfigError(
                        format_error(f"precision.{key}", value, "one of " + ", ".join(dtype_names)),
                        path=f"precision.{key}",
                    )

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainerArgs:
        """Build from a plain mapping (a loaded YAML file), naming any bad field by its dotted path."""
        if not isinstance(data, Mapping):
            raise ConfigError(format_error("", data, "a mapping of TrainerArgs fields"))
        return build_dataclass(cls, data)

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts and lists, which :meth:`from_dict` accepts back unchanged."""
        return to_plain(self)

    # -- world-size arithmetic ---------------------------------------------------------------
    def data_parallel_size(self, world_size: int) -> int:
        """Model replicas in a world of ``world_size`` processes."""
        return max(1, world_size // self.compute_config.mesh_size)

    def resolve(self, world_size: int) -> TrainerArgs:
        """A copy with ``global_batch_size`` and ``grad_accumulation_steps`` filled in for this world
        (and ``compute_config.dp_shard`` -1 when the strategy is a hybrid mesh that left it unset).

        Raises:
            ConfigError: ``runtime_ngpus`` is not the world size, the mesh does not divide the world,
                or the batch sizes do not fit together.
        """
        cc = self.compute_config
        if cc.runtime_ngpus is not None and cc.runtime_ngpus != world_size:
            raise ConfigError(
                format_error(
                    "compute_config.runtime_ngpus",
                    cc.runtime_ngpus,
                    f"the world size {world_size} (processes started by --nproc-per-node or torchrun), or null",
                ),
                path="compute_config.runtime_ngpus",
            )
        if cc.plan_ngpus is not None and cc.tp * cc.pp > 1 and cc.plan_ngpus != cc.tp * cc.pp:
            raise ConfigError(
                format_error("compute_config.plan_ngpus", cc.plan_ngpus, f"tp * pp = {cc.tp * cc.pp}"),
                path="compute_config.plan_ngpus",
            )
        if world_size % cc.mesh_size:
            name = "plan_ngpus" if cc.plan_ngpus else "tp"
            raise ConfigError(
                format_error(
                    f"compute_config.{name}",
                    getattr(cc, name),
                    f"a divisor of the world size {world_size} (processes per model replica)",
                ),
                path=f"compute_config.{name}",
            )
        cc.check_expert_parallel(world_size)
        cc.check_pipeline(world_size, self.pas_policy)
        if cc.strategy_name(self.pas_policy, world_size) == "hybrid" and cc.dp_shard is None:
            cc = dataclasses.replace(cc, dp_shard=-1)  # a hybrid mesh's shards fill the rest of the world
        dp, micro = self.data_parallel_size(world_size), self.micro_batch_size
        per_step = micro * dp
        how = f"micro_batch_size * data-parallel size = {micro} * {dp}"
        accum, total = self.grad_accumulation_steps, self.global_batch_size
        if total is None:
            accum = accum or 1
            total = per_step * accum
        elif total % per_step:
            raise ConfigError(
                format_error("global_batch_size", total, f"a multiple of {how} = {per_step}"), path="global_batch_size"
            )
        elif accum is None:
            accum = total // per_step
        elif total != per_step * accum:
            raise ConfigError(
                format_error(
                    "grad_accumulation_steps",
                    accum,
                    f"global_batch_size / ({how}) = {total} / {per_step} = {total // per_step}",
                ),
                path="grad_accumulation_steps",
            )
        return dataclasses.replace(self, compute_config=cc, global_batch_size=total, grad_accumulation_steps=accum)
