"""Checks that need imports: every named type exists and accepts the arguments it will be given.

Run by :func:`kiln.config.load_trainer_args` after the dataclasses are built and before any
process group, file or directory is created. Nothing is constructed here: constructor arguments are
bound to signatures (``inspect.Signature.bind``) with placeholders for what kiln fills in.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kiln.config.build import check_arguments, check_value, import_type
from kiln.config.components import SAMPLER_FILLED, HookConfig, HookMapConfig
from kiln.config.overrides import ConfigError, format_error

if TYPE_CHECKING:
    from kiln.config.trainer_args import TrainerArgs

__all__ = ["check_components", "is_kiln_model_type"]

_FILLED = object()  # stands for a value kiln provides (parameters, dataset, sampler, ...)


def _component(type_name: str | None, path: str, positional: list[Any], kwargs: dict[str, Any], args_path: str) -> Any:
    factory = import_type(type_name, f"{path}.type")
    assert type_name is not None  # import_type refused an unset type
    if not callable(factory):
        raise ConfigError(format_error(f"{path}.type", type_name, "a class or function"), path=f"{path}.type")
    check_value(kwargs, args_path)
    check_arguments(factory, positional, kwargs, args_path, type_name)
    return factory


def _function(name: str | None, path: str) -> Callable[..., Any] | None:
    if not name:
        return None
    fn = import_type(name, path)
    if not callable(fn):
        raise ConfigError(format_error(path, name, "the name of a function"), path=path)
    return fn


def is_kiln_model_type(factory: Any) -> bool:
    from kiln.core.model import Model

    return inspect.isclass(factory) and issubclass(factory, Model)


def _loader_kwargs(args: dict[str, Any], path: str) -> dict[str, Any]:
    kwargs = dict(args)
    if isinstance(kwargs.get("collate_fn"), str):  # nnScaler: collate_fn may name a function
        _function(kwargs["collate_fn"], f"{path}.collate_fn")
        kwargs["collate_fn"] = _FILLED
    return {"dataset": _FILLED, "batch_size": 1, "sampler": _FILLED, **kwargs}


def check_components(args: TrainerArgs) -> None:
    """Import every component of ``args`` and check the arguments each will be called with.

    Raises:
        ConfigError: naming the field (``optimizer.type``, ``model.args``, ...) that is wrong.
    """
    _function(args.init_env_fn, "init_env_fn")
    model = _component(args.model.type, "model", [], args.model.args, "model.args")
    if args.criterion is not None:
        _component(args.criterion.type, "criterion", [], args.criterion.args, "criterion.args")
    elif args.compute_config.use_end2end is False and not is_kiln_model_type(model):
        raise ConfigError(
            "compute_config.use_end2end: got False, but the model is not a kiln.Model and no criterion "
            "is set; expected true (forward(batch) returns the loss) or a criterion",
            path="compute_config.use_end2end",
        )
    opt = args.optimizer
    _component(opt.type, "optimizer", [_FILLED], opt.args, "optimizer.args")
    _function(opt.aggregate_outputs_fn, "optimizer.aggregate_outputs_fn")

    data = args.dataset
    _component(data.type, "dataset", [], data.train_args, "dataset.train_args")
    if data.val_args:
        _component(data.type, "dataset", [], data.val_args, "dataset.val_args")
    sampler = args.dataset_sampler
    for stage in ("train_args", "val_args"):
        given = getattr(sampler, stage)
        if stage == "val_args" and not given:
            continue
        kwargs = {k: v for k, v in given.items() if k not in SAMPLER_FILLED}
        _component(
            sampler.type,
            "dataset_sampler",
            [],
            {**dict.fromkeys(SAMPLER_FILLED, _FILLED), **kwargs},
            f"dataset_sampler.{stage}",
        )
    loader = args.dataloader
    _component(
        loader.type,
        "dataloader",
        [],
        _loader_kwargs(loader.train_args, "dataloader.train_args"),
        "dataloader.train_args",
    )
    if data.val_args and loader.val_args:
        _component(
            loader.type, "dataloader", [], _loader_kwargs(loader.val_args, "dataloader.val_args"), "dataloader.val_args"
        )

    if args.lr_scheduler is not None:
        from kiln.optim.schedulers import takes_optimizer

        scheduler = import_type(args.lr_scheduler.type, "lr_scheduler.type")
        filled = [_FILLED] if takes_optimizer(scheduler) else []
        _component(args.lr_scheduler.type, "lr_scheduler", filled, args.lr_scheduler.args, "lr_scheduler.args")
    for i, log in enumerate(args.log):
        _component(log.type, f"log.{i}", [], log.args, f"log.{i}.args")
    if isinstance(args.hook, HookConfig):
        _component(args.hook.type, "hook", [], args.hook.args, "hook.args")
    elif isinstance(args.hook, HookMapConfig):
        for point, name in args.hook.functions().items():
            _function(name, f"hook.{point}")
