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

import os
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from kiln.config.build import TYPE_KEY, VALUE_KEY, VALUE_TYPE_KEY, build_value
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
from kiln.config.trainer_args import TrainerArgs
from kiln.config.types import annotation_at, is_dataclass_type, is_text_type, to_plain

__all__ = ["TrainerArgs", "dump_yaml", "load_trainer_args", "typed_overrides"]


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
