"""Build values that a config names by type (nnScaler's ``__type`` and ``__value_type``).

A nested class argument is a dict with ``__type`` (a fully qualified name) whose other keys are
the constructor's keyword arguments; a value that must not be type-guessed is a dict with
``__value_type`` and ``value`` and becomes ``value_type(value)``::

    {"model_config": {"__type": "my_pkg.ModelConfig", "dim": 16}}
    {"name": {"__value_type": "str", "value": "1"}}
    {"fn": {"__value_type": "function", "value": "math.sqrt"}}   # the function itself
"""

from __future__ import annotations

import builtins
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from kiln.config.overrides import CommandLineText, ConfigError, close_match, guess_value

__all__ = ["TYPE_KEY", "VALUE_KEY", "VALUE_TYPE_KEY", "build_value", "check_arguments", "check_value", "import_type"]

TYPE_KEY = "__type"
VALUE_TYPE_KEY = "__value_type"
VALUE_KEY = "value"
FUNCTION_VALUE_TYPE = "function"


def _sub(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def import_type(qualname: Any, path: str = "") -> Any:
    """The object named by ``qualname`` (``"torch.optim.AdamW"``, ``"pkg.Outer.Inner"``, ``"int"``).

    The longest importable module prefix is imported and the rest looked up as attributes; a name
    without a dot is a builtin. A callable passed in is returned as it is.

    Raises:
        ConfigError: naming ``path`` and ``qualname`` when the name cannot be imported.
    """
    if callable(qualname):
        return qualname
    where = path or "type"
    if not isinstance(qualname, str) or not qualname.strip():
        raise ConfigError(
            f"{where}: got {qualname!r}, expected a fully qualified name such as 'torch.optim.AdamW'", path=path
        )
    parts = qualname.strip().split(".")
    obj: Any = builtins
    start = 0
    for n in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:n])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            # Only a missing module *on this name* means "try a shorter prefix"; a module that
            # exists but fails to import one of its own dependencies is reported as such.
            if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
                raise ConfigError(
                    f"{where}: cannot import {qualname!r}: module {module!r} failed to import: {e}", path=path
                ) from e
            continue
        except ImportError as e:
            raise ConfigError(
                f"{where}: cannot import {qualname!r}: module {module!r} failed to import: {e}", path=path
            ) from e
        start = n
        break
    for i in range(start, len(parts)):
        try:
            obj = getattr(obj, parts[i])
        except AttributeError:
            owner = ".".join(parts[:i]) or "builtins"
            if i == 0:
                reason = f"no module or builtin named {parts[0]!r}"
            elif inspect.ismodule(obj):
                reason = f"module {owner!r} has no attribute or submodule {parts[i]!r}"
            else:
                reason = f"{owner!r} has no attribute {parts[i]!r}"
            match = close_match(parts[i], dir(obj))
            hint = f" (did you mean {'.'.join([*parts[:i], match])!r}?)" if match else ""
            raise ConfigError(f"{where}: cannot import {qualname!r}: {reason}{hint}", path=path) from None
    return obj


def _rejected_keywords(factory: Callable[..., Any], kwargs: dict[str, Any], error: TypeError) -> list[str]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # builtins such as datetime.timedelta have no signature
        return [k for k in kwargs if repr(k) in str(error)]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return []
    accepted = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return [k for k in kwargs if k not in accepted]


def _signature(factory: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):  # builtins such as datetime.timedelta may have none
        return None


def _argument_error(
    factory: Callable[..., Any], args: list[Any], kwargs: dict[str, Any], path: str, name: str, error: Exception
) -> ConfigError:
    signature = _signature(factory)
    rejected = _rejected_keywords(factory, kwargs, error) if isinstance(error, TypeError) else []
    if rejected:
        names = ", ".join(repr(k) for k in rejected)
        candidates = list(signature.parameters) if signature is not None else []
        hints = [f"{k!r} -> {m!r}" for k in rejected if (m := close_match(k, candidates))]
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        return ConfigError(f"{path}: {name} does not accept argument(s) {names}{hint}", path=path)
    given = ", ".join([*(repr(a) for a in args), *kwargs]) or "no arguments"
    return ConfigError(f"{path}: {name} rejected its arguments ({given}): {error}", path=path)


def check_arguments(factory: Callable[..., Any], args: list[Any], kwargs: dict[str, Any], path: str, name: str) -> None:
    """Check that ``factory(*args, **kwargs)`` binds to its signature, without calling it.

    Raises:
        ConfigError: naming ``path``, the rejected argument and a close match, or a missing one.
    """
    signature = _signature(factory)
    if signature is None:
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        raise _argument_error(factory, args, kwargs, path, name, e) from e


def _call(factory: Callable[..., Any], args: list[Any], kwargs: dict[str, Any], path: str, name: str) -> Any:
    # Check the arguments first, so a TypeError raised inside the constructor is not mistaken
    # for a bad argument list.
    check_arguments(factory, args, kwargs, path, name)
    try:
        return factory(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise _argument_error(factory, args, kwargs, path, name, e) from e


def build_value(obj: Any, path: str = "") -> Any:
    """Recursively build ``__type`` dicts into instances and ``__value_type`` dicts into values.

    Args:
        obj: a config value (dicts, lists and tuples are walked; anything else is returned).
        path: the dotted path of ``obj``, used in error messages.

    Examples:
        >>> build_value({"t": {"__type": "datetime.timedelta", "seconds": 90}})["t"].seconds
        90
    """
    if isinstance(obj, dict):
        if TYPE_KEY in obj:
            name = obj[TYPE_KEY]
            factory = import_type(name, _sub(path, TYPE_KEY))
            kwargs = {k: build_value(v, _sub(path, k)) for k, v in obj.items() if k != TYPE_KEY}
            bad = [k for k in kwargs if not isinstance(k, str)]
            if bad:
                raise ConfigError(
                    f"{path or 'config'}: got key {bad[0]!r} beside {TYPE_KEY}, expected argument names (strings)",
                    path=path,
                )
            return _call(factory, [], kwargs, path or "config", str(name))
        if VALUE_TYPE_KEY in obj:
            extra = sorted(str(k) for k in obj if k not in (VALUE_TYPE_KEY, VALUE_KEY))
            if extra or VALUE_KEY not in obj:
                problem = f"extra key(s) {extra}" if extra else f"no {VALUE_KEY!r} key"
                raise ConfigError(
                    f"{path or 'config'}: {problem}, expected exactly the keys {VALUE_TYPE_KEY!r} and {VALUE_KEY!r}",
                    path=path,
                )
            name = obj[VALUE_TYPE_KEY]
            if name == FUNCTION_VALUE_TYPE:  # nnScaler: the value names a function to pass as it is
                return import_type(obj[VALUE_KEY], _sub(path, VALUE_KEY))
            value_type = import_type(name, _sub(path, VALUE_TYPE_KEY))
            raw = obj[VALUE_KEY]
            # Text goes to value_type as it is, never guessed first (nnScaler: value_type(value)).
            value = str(raw) if isinstance(raw, str) else build_value(raw, _sub(path, VALUE_KEY))
            return _call(value_type, [value], {}, path or "config", str(name))
        return {k: build_value(v, _sub(path, k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [build_value(v, _sub(path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(build_value(v, _sub(path, i)) for i, v in enumerate(obj))
    if isinstance(obj, CommandLineText):  # a --vars.x value that no typed field converted
        return guess_value(str(obj))
    return obj


def check_value(obj: Any, path: str = "") -> None:
    """Check what :func:`build_value` would build, without building it: every ``__type`` and
    ``__value_type`` imports, and ``__type`` arguments bind to the constructor's signature."""
    if isinstance(obj, dict):
        if TYPE_KEY in obj:
            factory = import_type(obj[TYPE_KEY], _sub(path, TYPE_KEY))
            kwargs = {k: v for k, v in obj.items() if k != TYPE_KEY}
            for k, v in kwargs.items():
                check_value(v, _sub(path, k))
            check_arguments(factory, [], {str(k): v for k, v in kwargs.items()}, path or "config", str(obj[TYPE_KEY]))
        elif VALUE_TYPE_KEY in obj:
            if obj[VALUE_TYPE_KEY] == FUNCTION_VALUE_TYPE:
                import_type(obj.get(VALUE_KEY), _sub(path, VALUE_KEY))
            else:
                import_type(obj[VALUE_TYPE_KEY], _sub(path, VALUE_TYPE_KEY))
                check_value(obj.get(VALUE_KEY), _sub(path, VALUE_KEY))
        else:
            for k, v in obj.items():
                check_value(v, _sub(path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_value(v, _sub(path, i))
