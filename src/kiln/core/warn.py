"""kiln's own warnings: one category, printed as one ``kiln: ...`` line.

Python prints a warning as ``path/to/file.py:32: UserWarning: message`` followed by the source
line it came from, which for a warning kiln raises is a line of kiln's (``method(state, logger)``),
telling a user nothing. A :class:`KilnWarning` prints as ``kiln: message`` instead; every other
warning keeps Python's format. The format is set through ``warnings.formatwarning`` (which
``logging.captureWarnings`` uses too) when this module is first imported, that is before kiln can
raise one; a hook installed later by the user stays in charge.

``KilnWarning`` is a ``UserWarning``: filters and ``pytest.warns(UserWarning)`` still match it.

Example::

    import warnings

    from kiln.core.warn import KilnWarning

    warnings.warn("save_best='eval/loss' never appeared in state.metrics", KilnWarning, stacklevel=2)
    # stderr: kiln: save_best='eval/loss' never appeared in state.metrics
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["KilnWarning"]


class KilnWarning(UserWarning):
    """A warning kiln raises itself (printed as one ``kiln: ...`` line)."""


def _format(message: Any, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
    if isinstance(category, type) and issubclass(category, KilnWarning):
        return f"kiln: {message}\n"
    return _previous(message, category, filename, lineno, line)


_previous = warnings.formatwarning
warnings.formatwarning = _format
