"""The config-dict layer of the ``kiln train`` command line (nnScaler ``TrainerArgs`` style).

A run is described by a YAML mapping that the command line can change with dotted overrides::

    kiln train -f run.yaml --optimizer.args.lr 1e-3 --model.layers.1.dim 4 --lr_scheduler!

Everything here works on plain dicts and lists, before any dataclass is built:

* ``load_yaml`` reads the file; ``parse_overrides`` turns ``argv`` into ``(key, value, delete)``
  triples, guessing value types with ``ast.literal_eval``; ``apply_overrides`` applies them.
  ``CommandLineText`` is a value whose type is decided where it lands (a ``--vars.x`` value);
  ``parse_bool`` reads nnScaler's command-line booleans.
* ``resolve_references`` replaces ``$(a.b.c)`` (or ``${a.b.c}``) with the value found at that path.
* ``get_path``/``set_path``/``delete_path``, ``close_match`` and ``format_error`` serve the
  typed layer.

Every user error is a ``ConfigError``: one line naming the dotted field, the value received and
what was expected.
"""

from __future__ import annotations

import ast
import copy
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from kiln.core.names import close_match, did_you_mean

__all__ = [
    "CommandLineText",
    "ConfigError",
    "apply_overrides",
    "close_match",
    "delete_path",
    "format_error",
    "get_path",
    "guess_value",
    "load_yaml",
    "merge",
    "parse_bool",
    "parse_overrides",
    "resolve_references",
    "set_path",
]

_MISSING: Any = object()
_REPR_LIMIT = 80
# $(a.b) or ${a.b}. "$\(" and "$\{" (nnScaler's first escape) and "$$(" and "$${" (its later one)
# escape the syntax and become "$(" and "${": the lookbehind keeps "$$(" from being a reference.
_REFERENCE = re.compile(r"(?<!\$)\$\(([^)]+)\)|(?<!\$)\$\{([^}]+)\}")


class ConfigError(ValueError):
    """A user error in a config: one line that names the dotted field path.

    Args:
        message: the whole message, conventionally ``"<path>: <what is wrong>"``.
        path: the dotted field path the error is about ("" for the config as a whole).

    Examples:
        >>> raise ConfigError(format_error("max_epochs", "ten", "an int"), path="max_epochs")
    """

    def __init__(self, message: str, path: str = "") -> None:
        # The CLI prints this as its single line of output, so no line breaks may survive.
        super().__init__(re.sub(r"\s*\n\s*", " ", str(message)).strip())
        self.path = path


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def format_error(path: str, value: Any, expected: str) -> str:
    """The standard one-line message: ``"<path>: got <value> (<type>), expected <expected>"``."""
    where = path or "config"
    return f"{where}: got {_short_repr(value)} ({type(value).__name__}), expected {expected}"


# ----------------------------------------------------------------------------- files and argv


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML config file whose top level is a mapping (an empty file gives ``{}``)."""
    name = os.fspath(path)
    try:
        text = Path(name).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {name!r} does not exist", path=name) from None
    except OSError as e:  # a directory, no permission, ...
        raise ConfigError(f"cannot read config file {name!r}: {e.strerror or e}", path=name) from e
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f" line {mark.line + 1}" if mark is not None else ""
        detail = e.problem or e.context or "invalid YAML"
        if e.context and e.problem:
            detail = f"{e.problem} ({e.context})"
        raise ConfigError(f"{name}{line}: {detail}", path=name) from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{name}: invalid YAML: {e}", path=name) from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{name}: the top level is a {type(data).__name__}, expected a mapping of field names to values", path=name
        )
    return data


class CommandLineText(str):
    """Command-line text whose type is decided where it lands, not when it is read.

    A ``--vars.x`` value has no field type to convert it by. nnScaler keeps such a value as the
    text typed and converts it by the type of each field that references it, so
    ``--vars.tag 1e3`` makes ``run-$(vars.tag)`` ``'run-1e3'`` and a ``str`` field ``'1e3'``
    (a guess first would give ``'run-1000.0'`` and refuse the ``str`` field's ``1000.0``).
    :func:`kiln.config.types.coerce` settles it by the field's annotation; anywhere else it is
    guessed (:func:`guess_value`), except as the ``value`` of a ``__value_type`` dict, which only
    that type converts.
    """

    __slots__ = ()


def parse_bool(raw: str) -> bool | None:
    """nnScaler's command-line booleans: ``true``/``1`` and ``false``/``0`` in any case; else ``None``."""
    text = raw.strip().lower()
    if text in ("true", "1"):
        return True
    if text in ("false", "0"):
        return False
    return None


def guess_value(raw: str) -> Any:
    """Guess a command-line value's type: ``ast.literal_eval``, else the string itself.

    ``"1e-3"`` -> 0.001, ``"[1,2]"`` -> [1, 2], ``"None"``/``"null"`` -> None, ``"true"``/``"false"``
    -> bool (as in nnScaler; ``null`` as YAML writes it, e.g. in ``--print-config`` output),
    ``"abc"``, ``"1.2.3"`` and ``"path/to.yaml"`` stay strings.
    """
    if raw == "true":
        return True
    if raw == "false":
        return False
    if raw == "null":
        return None
    try:
        return ast.literal_eval(raw)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return raw


def _parse_key(text: str, token: str) -> tuple[str, bool]:
    delete = text.endswith("!")
    if delete:
        text = text[:-1]
    key = text.replace("-", "_")  # --max-epochs is --max_epochs, as in nnScaler
    if not key or any(not segment for segment in key.split(".")):
        raise ConfigError(
            f"{key or token}: bad option {token!r}, expected --dotted.key VALUE, "
            "--dotted.key=VALUE or --dotted.key! (delete)",
            path=key,
        )
    return key, delete


def parse_overrides(
    argv: Iterable[str], *, guess: bool = True, flag: Callable[[str], bool] | None = None
) -> list[tuple[str, Any, bool]]:
    """Parse ``--a.b.c value``, ``--a.b.c=value`` and ``--a.b.c!`` into ``(key, value, delete)``.

    Args:
        argv: the override tokens (the CLI removes its own options first).
        guess: guess value types with ``guess_value``; ``False`` keeps raw strings, for a caller
            that knows each field's type and converts itself (``"1e3"`` for a ``str`` field).
        flag: ``flag(key)`` says whether ``key`` is a boolean field; such a key given bare
            (``--enable_progress_bar`` followed by another option or the end) means ``True``, as
            in nnScaler. Any other bare key is an error.
    """
    overrides: list[tuple[str, Any, bool]] = []
    pending: tuple[str, str] | None = None  # (key, token) still waiting for its value

    def missing_value(key: str, token: str) -> ConfigError:
        return ConfigError(
            f"{key}: no value given for {token!r}, expected {token} VALUE, {token}=VALUE or {token}! to delete the key",
            path=key,
        )

    def bare(key: str, token: str) -> None:
        if flag is None or not flag(key):
            raise missing_value(key, token)
        overrides.append((key, True, False))

    for token in argv:
        if token.startswith("--"):
            if pending is not None:
                bare(*pending)
                pending = None
            name, has_value, raw = token[2:].partition("=")
            key, delete = _parse_key(name, token)
            if delete and has_value:
                raise ConfigError(f"{key}: {token!r} deletes the key and takes no value", path=key)
            if delete:
                overrides.append((key, None, True))
            elif has_value:
                overrides.append((key, guess_value(raw) if guess else raw, False))
            else:
                pending = (key, token)
        elif pending is not None:
            key = pending[0]
            overrides.append((key, guess_value(token) if guess else token, False))
            pending = None
        else:
            raise ConfigError(
                f"unexpected argument {token!r}, expected --dotted.key VALUE (a value must follow its --key)", path=""
            )
    if pending is not None:
        bare(*pending)
    return overrides


# ----------------------------------------------------------------------------- dotted paths


def _join(parts: Iterable[Any]) -> str:
    return ".".join(str(p) for p in parts)


def _dict_key(node: Mapping[Any, Any], segment: str) -> Any:
    """The key in ``node`` that ``segment`` names: itself, or its int form (YAML ``1: x``)."""
    if segment in node:
        return segment
    if segment.isdigit() and int(segment) in node:
        return int(segment)
    return _MISSING


def _list_index(node: list[Any], segment: str, path: str, parent: str, *, append: bool) -> int:
    if not segment.isdigit():
        raise ConfigError(f"{path}: got key {segment!r}, expected a list index because {parent} is a list", path=path)
    index, size = int(segment), len(node)
    if index > size or (index == size and not append):
        allowed = f"0-{size - 1}" if size else "none"
        extra = f", or {size} to append" if append else ""
        raise ConfigError(
            f"{path}: index {index} is out of range, {parent} has {size} item(s) (indices {allowed}{extra})", path=path
        )
    return index


def _segments(dotted: str) -> list[str]:
    segments = str(dotted).split(".")
    if not dotted or any(not s for s in segments):
        raise ConfigError(f"{dotted or '(empty)'}: bad dotted path {dotted!r}", path=str(dotted))
    return segments


def _step(node: Any, segment: str, parents: list[Any]) -> Any:
    """The key of ``node`` that ``segment`` names; ``parents`` are the keys that led to ``node``."""
    parent = _join(parents) or "the config"
    here = _join([*parents, segment])
    if isinstance(node, Mapping):
        key = _dict_key(node, segment)
        if key is _MISSING:
            raise ConfigError(f"{here}: unknown key {segment!r} in {parent}{did_you_mean(segment, node)}", path=here)
        return key
    if isinstance(node, list):
        return _list_index(node, segment, here, parent, append=False)
    raise ConfigError(
        f"{here}: {parent} is {_short_repr(node)} ({type(node).__name__}), expected a mapping or a list", path=here
    )


def _walk(cfg: Any, dotted: str) -> tuple[list[Any], Any]:
    """The actual keys along ``dotted`` and the value found there; ConfigError if absent."""
    keys: list[Any] = []
    node = cfg
    for segment in _segments(dotted):
        key = _step(node, segment, keys)
        keys.append(key)
        node = node[key]
    return keys, node


def get_path(cfg: Any, dotted: str, default: Any = _MISSING) -> Any:
    """The value at ``dotted`` (``"model.layers.1.dim"``); ``default`` or ConfigError if absent."""
    try:
        return _walk(cfg, dotted)[1]
    except ConfigError:
        if default is _MISSING:
            raise
        return default


def set_path(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``dotted`` in place, creating nested dicts as needed.

    An integer segment indexes a list (its length appends). A parent that is not a dict or a
    list (``None``, a string) is replaced by a dict, as nnScaler does, so ``--lr_scheduler.type X``
    works on ``lr_scheduler: null``.
    """
    segments = _segments(dotted)
    node: Any = cfg
    for i, segment in enumerate(segments):
        here, parent = _join(segments[: i + 1]), _join(segments[:i]) or "the config"
        if isinstance(node, list):
            key: Any = _list_index(node, segment, here, parent, append=True)
            if key == len(node):
                node.append(None)
        else:
            key = _dict_key(node, segment)
            key = segment if key is _MISSING else key
        if i == len(segments) - 1:
            node[key] = value
            return
        if not isinstance(node[key] if isinstance(node, list) else node.get(key), (dict, list)):
            node[key] = {}
        node = node[key]


def delete_path(cfg: dict[str, Any], dotted: str) -> None:
    """Delete ``dotted`` in place (a list item is removed); ConfigError if it does not exist."""
    try:
        keys, _ = _walk(cfg, dotted)
    except ConfigError as e:
        raise ConfigError(f"{e} (cannot delete a key that does not exist)", path=e.path) from None
    parent = get_path(cfg, _join(keys[:-1])) if len(keys) > 1 else cfg
    del parent[keys[-1]]


def apply_overrides(cfg: Mapping[str, Any], overrides: Iterable[tuple[str, Any, bool]]) -> dict:
    """A new config with ``(key, value, delete)`` overrides applied in order (``cfg`` untouched)."""
    result = copy.deepcopy(dict(cfg))
    for key, value, delete in overrides:
        if delete:
            delete_path(result, key)
        else:
            set_path(result, key, copy.deepcopy(value))
    return result


def merge(base: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``other`` onto ``base`` (a new dict): mappings merge, anything else replaces."""
    result = copy.deepcopy(dict(base))
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


# ----------------------------------------------------------------------------- references


class _ResolveError(ConfigError):
    """A reference error already phrased for the field that holds it: passed up unchanged."""


def _unescape(text: str) -> str:
    return text.replace("$\\(", "$(").replace("$\\{", "${").replace("$$(", "$(").replace("$${", "${")


def resolve_references(cfg: Mapping[str, Any], *, environ: Mapping[str, str] | None = os.environ) -> dict[str, Any]:
    """A new config with every ``$(a.b.c)`` / ``${a.b.c}`` replaced by the value at that path.

    A string that is exactly one reference takes the referenced value with its type (a copy);
    otherwise the reference is formatted into the string. References to references resolve;
    a cycle is a ConfigError that names it (``a: circular reference a -> b -> a``). A name that
    is not a path in the config falls back to ``environ``, as nnScaler falls back to environment
    variables (pass ``None`` to turn that off). ``$\\(`` and ``$$(`` escape the syntax (``$$(a)`` is
    the text ``$(a)``). A :class:`CommandLineText` formatted into a string is its text as typed.
    """
    out = copy.deepcopy(dict(cfg))
    done: set[tuple[Any, ...]] = set()
    stack: list[tuple[Any, ...]] = []  # paths being resolved, outermost first

    def value_at(keys: tuple[Any, ...]) -> Any:
        node: Any = out
        for key in keys:
            node = node[key]
        return node

    def mark_done(keys: tuple[Any, ...], value: Any) -> None:
        # A substituted value is final: an unescaped "$(" inside it must not be read again.
        done.add(keys)
        children = value.items() if isinstance(value, dict) else (enumerate(value) if isinstance(value, list) else ())
        for key, child in children:
            mark_done((*keys, key), child)

    def locate(ref: str) -> tuple[Any, ...]:
        # Step segment by segment, resolving a string met on the way (it may be a reference to
        # a dict), but never a whole container: a.y = $(a.x) must not see `a` as a cycle.
        keys: tuple[Any, ...] = ()
        for segment in _segments(ref):
            node = value_at(keys)
            if isinstance(node, str):
                node = resolve(keys)
            keys += (_step(node, segment, list(keys)),)
        return keys

    def substitute(keys: tuple[Any, ...], text: str) -> Any:
        holder = _join(keys)
        values: dict[str, Any] = {}
        for match in _REFERENCE.finditer(text):
            ref = (match.group(1) or match.group(2)).strip()
            try:
                values[ref] = resolve(locate(ref))
            except _ResolveError:
                raise
            except ConfigError as e:  # the path does not exist in the config
                if environ is not None and ref in environ:
                    values[ref] = environ[ref]
                    continue
                raise _ResolveError(
                    f"{holder}: reference {match.group(0)!r} cannot be resolved: {e}", path=holder
                ) from None
        whole = _REFERENCE.fullmatch(text)
        if whole is not None:
            return copy.deepcopy(values[(whole.group(1) or whole.group(2)).strip()])
        replaced = _REFERENCE.sub(lambda m: str(values[(m.group(1) or m.group(2)).strip()]), text)
        return _unescape(replaced)

    def resolve(keys: tuple[Any, ...]) -> Any:
        if keys in done:
            return value_at(keys)
        if keys in stack:
            chain = [_join(k) for k in stack[stack.index(keys) :]] + [_join(keys)]
            raise _ResolveError(f"{chain[0]}: circular reference {' -> '.join(chain)}", path=chain[0])
        stack.append(keys)
        node = value_at(keys)
        if isinstance(node, dict):
            for key in list(node):
                resolve((*keys, key))
        elif isinstance(node, list):
            for index in range(len(node)):
                resolve((*keys, index))
        elif isinstance(node, str) and "$" in node:
            node = substitute(keys, node)
            value_at(keys[:-1])[keys[-1]] = node
        stack.pop()
        mark_done(keys, node)
        return node

    try:
        resolve(())
    except _ResolveError as e:
        raise ConfigError(str(e), path=e.path) from None
    return out
