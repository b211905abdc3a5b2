"""``TrainerArgs``: a whole training run as typed dataclass arguments (nnScaler's TrainerArgs).

A YAML file maps one-to-one onto these dataclasses; dotted command-line overrides change any
field; ``kiln train`` builds a :class:`kiln.Trainer` from the result::

    args = load_trainer_args("run.yaml", ["--optimizer.args.lr", "0.01"], world_size=2)
    print(dump_yaml(args))          # the fully resolved config, which load_trainer_args accepts back

Checks happen in three steps, all before anything is created: field types and rules when the
dataclasses are built, the world-size arithmetic in :meth:`TrainerArgs.resolve`, and imports and
constructor arguments in :func:`kiln.config.preflight.check_components`.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from kiln.config.build import TYPE_KEY, VALUE_KEY, VALUE_TYPE_KEY, build_value
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
    apply_overrides,
    format_error,
    get_path,
    guess_value,
    load_yaml,
    parse_overrides,
    resolve_references,
)
from kiln.config.types import annotation_at, build_dataclass, check_fields, is_dataclass_type, is_text_type, to_plain

__all__ = ["TrainerArgs", "dump_yaml", "load_trainer_args", "typed_overrides"]


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
        from kiln.parallel.levers import checkpoint_every
        from kiln.parallel.parallelize import ParallelizeOptions

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


# -- files and command lines ------------------------------------------------------------------
def _is_flag(key: str, cfg: Mapping[str, Any] | None) -> bool:
    """Whether ``key`` is a boolean field (``bool``, ``bool | None``, or ``bool`` or a mapping such as
    ``compile``), which nnScaler lets the command line give bare."""
    from kiln.config.types import is_flag_type  # here: the module's import lines are another change's

    annotation = annotation_at(TrainerArgs, key, cfg)
    return annotation is not None and is_flag_type(annotation)


def typed_overrides(argv: Iterable[str], cfg: Mapping[str, Any] | None = None) -> list[tuple[str, Any, bool]]:
    """``--a.b value`` overrides with values converted by field type: a ``str`` field keeps the raw
    text (``--checkpoint.save_dir 001``), anything else is guessed with ``ast.literal_eval``.

    As in nnScaler, the ``value`` of a ``__value_type`` dict is never guessed (``--x.__value_type str
    --x.value 1e3`` builds ``'1e3'``), a bare boolean field (``--enable_progress_bar``) is true and a
    boolean field reads ``true/1/false/0`` in any case. A ``--vars.x`` value has no field type: it
    stays a :class:`~kiln.config.overrides.CommandLineText`, typed by each field that references it
    (``--vars.tag 1e3`` makes ``run-$(vars.tag)`` ``'run-1e3'``).
    """
    # Imported here: the module's import lines belong to another change.
    from kiln.config.overrides import CommandLineText
    from kiln.config.types import is_flag_type, settle_text

    parsed = parse_overrides(argv, guess=False, flag=lambda key: _is_flag(key, cfg))
    suffix = "." + VALUE_TYPE_KEY
    value_typed = {key[: -len(suffix)] for key, _, delete in parsed if not delete and key.endswith(suffix)}
    out: list[tuple[str, Any, bool]] = []
    for key, raw, delete in parsed:
        if not delete and isinstance(raw, str):
            parent, _, last = key.rpartition(".")
            if (
                last == VALUE_KEY
                and parent
                and (
                    parent in value_typed
                    or isinstance(get_path(cfg or {}, parent, None), Mapping)
                    and VALUE_TYPE_KEY in get_path(cfg or {}, parent)
                )
            ):
                out.append((key, raw, delete))  # converted by value_type(raw) when built: no guessing first
                continue
            if key.startswith("vars."):
                raw = CommandLineText(raw)  # typed where it is referenced, as nnScaler does
            else:
                annotation = annotation_at(TrainerArgs, key, cfg)
                if annotation is not None and (is_text_type(annotation) or is_flag_type(annotation)):
                    raw = settle_text(raw, annotation)  # text as typed; nnScaler's booleans
                else:
                    raw = guess_value(raw)
        out.append((key, raw, delete))
    return out


def _build_typed_fields(cfg: dict[str, Any], cls: type | None = None, path: str = "") -> None:
    """Build, in place, a ``__type``/``__value_type`` dict given for a field that is not itself a
    mapping (nnScaler: ``instance_name: {__type: mypkg.make_name, ...}`` calls the function while the
    config is read). Component ``args`` dicts are left for the builder."""
    cls = cls or TrainerArgs
    hints = typing.get_type_hints(cls)
    for name, value in list(cfg.items()):
        annotation = hints.get(name)
        if annotation is None or not isinstance(value, dict):
            continue
        where = f"{path}.{name}" if path else name
        arms = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
        classes = [a for a in arms if is_dataclass_type(a)]
        if classes:
            if len(classes) == 1 and TYPE_KEY not in value and VALUE_TYPE_KEY not in value:
                _build_typed_fields(value, classes[0], where)
            continue
        if (TYPE_KEY in value or VALUE_TYPE_KEY in value) and not any(
            a is Any or a is dict or typing.get_origin(a) is dict for a in arms
        ):
            cfg[name] = build_value(value, where)


def _check_vars(cfg: dict[str, Any]) -> None:
    """nnScaler's top-level ``vars:`` holds values for ``$(vars.x)`` references only: it is no
    field, and goes once the references are resolved. It must be a mapping."""
    variables = cfg.get("vars")
    if variables is not None and not isinstance(variables, Mapping):
        raise ConfigError(
            format_error("vars", variables, "a mapping of names to values, referenced as $(vars.name)"), path="vars"
        )


def _add_missing_lists(cfg: dict[str, Any], key: str) -> None:
    """Create the missing list fields on ``key``'s way (``--log.0.type console`` without ``log:``)."""
    segments = key.split(".")
    node: Any = cfg
    for i, segment in enumerate(segments[:-1]):
        if not isinstance(node, dict):
            return
        if node.get(segment) is None:
            annotation = annotation_at(TrainerArgs, ".".join(segments[: i + 1]), cfg)
            if typing.get_origin(annotation) is not list:
                return
            node[segment] = []
        node = node[segment]


def _default_world_size(cfg: Mapping[str, Any]) -> int:
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    compute = cfg.get("compute_config") or {}
    return int(compute.get("runtime_ngpus") or 1) if isinstance(compute, Mapping) else 1


def _read(source: str | os.PathLike | Mapping[str, Any] | None) -> dict[str, Any]:
    """The config as plain dicts: a YAML (or JSON) file, a ``.py`` file's module-level names, or a dict."""
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return to_plain(source)
    if os.fspath(source).endswith(".py"):
        from kiln.launch.config import Config

        try:
            return to_plain(Config.from_file(os.fspath(source)))
        except FileNotFoundError:
            raise ConfigError(f"config file {os.fspath(source)!r} does not exist", path=os.fspath(source)) from None
        except Exception as e:  # the file's own code failed: report it on one line
            raise ConfigError(
                f"{os.fspath(source)}: running the config file failed: {type(e).__name__}: {e}", path=os.fspath(source)
            ) from e
    return load_yaml(source)


def load_trainer_args(
    path: str | os.PathLike | Mapping[str, Any] | None,
    overrides: Iterable[str] = (),
    *,
    world_size: int | None = None,
    check: bool = True,
) -> TrainerArgs:
    """Read a YAML file, apply dotted overrides and ``$(refs)``, check everything, resolve for the world.

    Args:
        path: a YAML (or JSON) file, a ``.py`` file (its module-level names) or a dict (``None``: empty).
        overrides: command-line tokens such as ``["--optimizer.args.lr", "0.01", "--lr_scheduler!"]``.
        world_size: processes of the run (default: ``WORLD_SIZE``, else ``compute_config.runtime_ngpus``, else 1).
        check: also import every component and check its constructor arguments.

    Raises:
        ConfigError: one line naming the field, the value received and what was expected.
    """
    cfg = _read(path)
    typed = typed_overrides(list(overrides), cfg)
    for key, _, delete in typed:
        if not delete:
            _add_missing_lists(cfg, key)
    cfg = apply_overrides(cfg, typed)
    _check_vars(cfg)
    cfg = resolve_references(cfg)
    cfg.pop("vars", None)
    _build_typed_fields(cfg)
    args = TrainerArgs.from_dict(cfg).resolve(world_size or _default_world_size(cfg))
    if check:
        from kiln.config.preflight import check_components

        check_components(args)
    return args


def dump_yaml(args: TrainerArgs) -> str:
    """The config as YAML that :func:`load_trainer_args` reads back to the same ``TrainerArgs``."""
    return yaml.safe_dump(args.to_dict(), sort_keys=False, default_flow_style=False, allow_unicode=True)
