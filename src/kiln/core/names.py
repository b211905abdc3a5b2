"""Close matches for misspelt names: the one home of kiln's "(did you mean 'fsdp'?)".

The YAML checks (:mod:`kiln.config`) and the Python API (``strategy=``, ``precision=``) name the
same alternatives the same way::

    from kiln.core.names import did_you_mean

    raise ValueError(f"strategy='fsdp3' is not known; expected one of ddp, fsdp, ...{did_you_mean('fsdp3', names)}")
    # strategy='fsdp3' is not known; expected one of ddp, fsdp, ... (did you mean 'fsdp'?)
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

__all__ = ["close_match", "did_you_mean"]


def close_match(name: Any, candidates: Iterable[Any], fold_case: bool = False) -> str | None:
    """The candidate closest to a misspelt ``name`` (difflib), or ``None`` if none is close.

    ``fold_case``: compare without case (``"adamw"`` finds ``"AdamW"``); the candidate is returned as given.
    """
    names = [str(c) for c in candidates]
    if fold_case:
        folded = {n.lower(): n for n in names}
        matches = difflib.get_close_matches(str(name).lower(), list(folded), n=1)
        return folded[matches[0]] if matches else None
    matches = difflib.get_close_matches(str(name), names, n=1)
    return matches[0] if matches else None


def did_you_mean(name: Any, candidates: Iterable[Any], fold_case: bool = False, prefix: str = "") -> str:
    """``" (did you mean 'fsdp'?)"`` for the closest candidate, or ``""`` when none is close.

    ``prefix`` goes before the match in the hint (``"torch.optim."``: ``'torch.optim.AdamW'``).
    """
    match = close_match(name, candidates, fold_case)
    return f" (did you mean {prefix + match!r}?)" if match else ""
