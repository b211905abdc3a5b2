"""Objects named on the command line by a dotted path (``kiln plan --model package.module:Name``)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["load_object"]


def load_object(path: str) -> Any:
    """``package.module:attr`` or ``package.module.attr`` -> the object."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"--model/--optimizer {path!r} is not a dotted path; expected 'package.module:Name'")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"cannot import {module_name!r} for {path!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    return obj
