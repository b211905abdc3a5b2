"""Typed config dataclasses: values checked against field annotations, dicts built into dataclasses.

The config dataclasses (``kiln.config.TrainerArgs`` and its components) call :func:`check_fields`
from ``__post_init__``, so a value of the wrong type is refused however the object is made: from
YAML, from the command line or in Python. :func:`build_dataclass` turns a mapping into a dataclass
and refuses unknown keys with a close match. Every error is a one-line
:class:`~kiln.config.overrides.ConfigError` that names the dotted field path.

Supported annotations: ``Any``, ``bool``, ``int``, ``float`` (an int is accepted), ``str``,
``Literal[...]``, ``X | None`` and other unions, ``list[X]``, ``dict[str, X]`` and nested dataclasses.

A :class:`~kiln.config.overrides.CommandLineText` (a ``--vars.x`` value, referenced) takes its type
here, from the field it reaches, as nnScaler converts its command-line text: a text field keeps
the text, a boolean one reads ``true/1/false/0`` in any case, anything else is guessed.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any, Literal, TypeGuard, Union

from kiln.config.build import VALUE_KEY, VALUE_TYPE_KEY
from kiln.config.overrides import CommandLineText, ConfigError, close_match, format_error, guess_value, parse_bool
from kiln.core.names import did_you_mean

__all__ = [
    "annotation_at",
    "build_dataclass",
    "check_fields",
    "field_docs",
    "is_dataclass_type",
    "is_flag_type",
    "is_text_type",
    "prefixed",
    "settle_text",
    "to_plain",
    "type_name",
]

_NONE = type(None)


def prefixed(error: ConfigError, parent: str) -> ConfigError:
    """``error`` about a field of the value at ``parent``, re-phrased with the full dotted path."""
    if not parent:
        return error
    message, path = str(error), error.path
    if path and message.startswith(path):
        full = f"{parent}.{path}"
        return ConfigError(full + message[len(path) :], path=full)
    return ConfigError(f"{parent}: {message}", path=parent)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def is_dataclass_type(annotation: Any) -> TypeGuard[type]:
    """``dataclasses.is_dataclass`` on an annotation, which is a class (never an instance)."""
    return dataclasses.is_dataclass(annotation)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (Union, types.UnionType)


def type_name(annotation: Any) -> str:
    """A short readable name: ``int | None``, ``'run' | 'compile'``, ``list[LogConfig]``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return "any"
    if annotation is _NONE:
        return "None"
    if _is_union(annotation):
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (list, tuple):
        return f"list[{type_name(args[0]) if args else 'any'}]"
    if origin is dict:
        return f"dict[{type_name(args[0])}, {type_name(args[1])}]" if args else "dict"
    return getattr(annotation, "__name__", str(annotation))


def is_text_type(annotation: Any) -> bool:
    """Whether every non-None value of ``annotation`` is a string (command-line values stay raw)."""
    if annotation is str:
        return True
    if typing.get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in typing.get_args(annotation))
    if _is_union(annotation):
        arms = [a for a in typing.get_args(annotation) if a is not _NONE]
        return bool(arms) and all(is_text_type(a) for a in arms)
    return False


def is_flag_type(annotation: Any) -> bool:
    """Whether ``annotation`` takes a boolean and no other plain value: ``bool``, ``bool | None``,
    and ``bool | dict[...]`` (``compile``, ``float8``), which the command line may give bare."""
    arms = [a for a in typing.get_args(annotation) if a is not _NONE] if _is_union(annotation) else [annotation]
    others = [a for a in arms if a is not bool]
    mappings = [a for a in others if a is dict or typing.get_origin(a) is dict or is_dataclass_type(a)]
    return len(others) < len(arms) and mappings == others


def settle_text(text: str, annotation: Any) -> Any:
    """Command-line ``text`` as the field ``annotation`` reads it (nnScaler: by the field's type).

    A text field keeps it (``'null'``/``'None'`` is ``None`` where the field is optional, as for
    ``--key null``), a flag field reads ``true/1/false/0`` in any case, anything else is guessed
    with :func:`~kiln.config.overrides.guess_value`.

    Examples:
        >>> settle_text("1e3", str | None), settle_text("0", bool), settle_text("1e3", float)
        ('1e3', False, 1000.0)
    """
    raw = str(text)  # a plain str, never the CommandLineText itself
    if annotation is not Any and is_text_type(annotation):
        optional = annotation is _NONE or _NONE in typing.get_args(annotation)
        return None if optional and raw in ("None", "null") else raw
    if annotation is not Any and is_flag_type(annotation):
        flag = parse_bool(raw)
        if flag is not None:
            return flag
    return guess_value(raw)


def _settle_any(value: Any) -> Any:
    """``value`` for an ``Any`` field: command-line text guessed, at any depth (the same object if
    there is none), except the ``value`` of a ``__value_type`` dict, which only that type converts."""
    if isinstance(value, CommandLineText):
        return guess_value(str(value))
    if isinstance(value, dict):
        items = {}
        for k, v in value.items():
            keep_text = VALUE_TYPE_KEY in value and k == VALUE_KEY and isinstance(v, str)
            items[k] = str(v) if keep_text else _settle_any(v)
        return items if any(items[k] is not value[k] for k in value) else value
    if isinstance(value, (list, tuple)):
        settled = [_settle_any(v) for v in value]
        if all(a is b for a, b in zip(settled, value, strict=True)):
            return value
        return type(value)(settled) if isinstance(value, list) else tuple(settled)
    return value


def _expected(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if is_dataclass_type(annotation):
        return f"a mapping of {annotation.__name__} fields"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    names = {bool: "true or false", int: "an int", float: "a number", str: "a string", _NONE: "null"}
    return names.get(annotation) or type_name(annotation)


def _pick_dataclass(arms: list[type], value: Mapping[str, Any]) -> type:
    """The dataclass of a union that a mapping means: the one whose fields cover the most keys."""

    def score(cls: type) -> tuple[int, int, int]:
        names = {f.name for f in dataclasses.fields(cls)}
        exact = sum(k in names for k in value)
        close = sum(close_match(k, names) is not None for k in value if k not in names)
        return (exact, close, -len(names))

    return max(arms, key=score)


def coerce(value: Any, annotation: Any, path: str) -> Any:
    """``value`` checked against ``annotation`` (dicts become dataclasses, ints become floats)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return _settle_any(value)
    if isinstance(value, CommandLineText):
        value = settle_text(value, annotation)
    if annotation is _NONE:
        if value is None:
            return None
        raise ConfigError(format_error(path, value, "null"), path=path)
    if _is_union(annotation):
        if value is None and _NONE in args:
            return None
        arms = [a for a in args if a is not _NONE]
        classes = [a for a in arms if is_dataclass_type(a)]
        if isinstance(value, Mapping) and classes:
            if any(isinstance(value, c) for c in classes):
                return value
            return coerce(value, _pick_dataclass(classes, value), path)
        for arm in arms:
            try:
                return coerce(value, arm, path)
            except ConfigError:
                continue
        raise ConfigError(format_error(path, value, " or ".join(_expected(a) for a in args)), path=path)
    if origin is Literal:
        if value in args and isinstance(value, type(args[0])):
            return value
        hint = did_you_mean(value, args) if isinstance(value, str) else ""
        raise ConfigError(format_error(path, value, _expected(annotation)) + hint, path=path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(format_error(path, value, f"a list ({type_name(annotation)})"), path=path)
        item = args[0] if args else Any
        return [coerce(v, item, f"{path}.{i}") for i, v in enumerate(value)]
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(format_error(path, value, f"a mapping ({type_name(annotation)})"), path=path)
        key_type, item = args if args else (Any, Any)
        out = {}
        for k, v in value.items():
            if key_type is str and not isinstance(k, str):
                raise ConfigError(format_error(f"{path}.{k}", k, "string keys"), path=f"{path}.{k}")
            out[k] = coerce(v, item, f"{path}.{k}")
        return out
    if is_dataclass_type(annotation):
        if isinstance(value, annotation):
            return value
        if isinstance(value, Mapping):
            return build_dataclass(annotation, value, path)
        raise ConfigError(format_error(path, value, _expected(annotation)), path=path)
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, bool):
        raise ConfigError(format_error(path, value, "an int"), path=path)
    if isinstance(annotation, type) and not isinstance(value, annotation):
        raise ConfigError(format_error(path, value, _expected(annotation)), path=path)
    return value


def check_fields(obj: Any) -> None:
    """Check (and normalise in place) every field of the dataclass ``obj`` against its annotation.

    Errors name the field relative to ``obj``; :func:`build_dataclass` adds the parents' path.
    """
    cls: type = type(obj)
    hints = _hints(cls)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        object.__setattr__(obj, f.name, coerce(value, hints[f.name], f.name))


def build_dataclass(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """``cls(**data)``, refusing keys that are not fields (with a close match) and naming paths."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in data:
        if key not in names:
            where = f"{path}.{key}" if path else str(key)
            hint = did_you_mean(key, names)
            raise ConfigError(f"{where}: unknown key {key!r}{hint}; {cls.__name__} has no such field", path=where)
    try:
        return cls(**data)
    except ConfigError as e:
        raise prefixed(e, path) from None


def to_plain(obj: Any) -> Any:
    """Dataclasses, tuples and nested containers as plain dicts and lists (YAML-ready)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


_ARG_LINE = re.compile(r"^(\s*)(\w+)(?: \([^)]*\))?: (.*)$")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """One line per field from the class docstring's Google-style ``Args:`` section."""
    docs: dict[str, str] = {}
    lines = (cls.__doc__ or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return docs
    indent, current = None, None
    for line in lines[start + 1 :]:
        if not line.strip():
            if docs:
                break
            continue
        match = _ARG_LINE.match(line)
        if match and (indent is None or len(match.group(1)) == indent):
            indent, current = len(match.group(1)), match.group(2)
            docs[current] = match.group(3).strip()
        elif indent is not None and len(line) - len(line.lstrip()) > indent and current:
            docs[current] += " " + line.strip()
        else:
            break
    return docs


def annotation_at(cls: type, dotted: str, cfg: Any = None) -> Any:
    """The annotation of the field at ``dotted`` below dataclass ``cls``, or ``None`` if unknown.

    ``cfg`` (the config dict) picks the dataclass a union means (``hook``: HookConfig or HookMapConfig).
    """
    annotation: Any = cls
    node = cfg
    for segment in dotted.split("."):
        if _is_union(annotation):
            arms = [a for a in typing.get_args(annotation) if a is not _NONE]
            classes = [a for a in arms if is_dataclass_type(a)]
            if classes:
                annotation = _pick_dataclass(classes, node if isinstance(node, Mapping) else {segment: None})
            elif len(arms) == 1:
                annotation = arms[0]
            else:
                return None
        origin = typing.get_origin(annotation)
        if is_dataclass_type(annotation):
            annotation = _hints(annotation).get(segment)
            if annotation is None:
                return None
        elif origin in (list, tuple) and segment.isdigit():
            annotation = typing.get_args(annotation)[0] if typing.get_args(annotation) else Any
        elif origin is dict:
            annotation = typing.get_args(annotation)[1] if typing.get_args(annotation) else Any
        else:
            return None
        node = _child(node, segment)
    return annotation


def _child(node: Any, segment: str) -> Any:
    if isinstance(node, Mapping):
        return node.get(segment)
    if isinstance(node, list) and segment.isdigit() and int(segment) < len(node):
        return node[int(segment)]
    return None
