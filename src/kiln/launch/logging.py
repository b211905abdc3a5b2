"""Rank-aware logging: ``get_dist_logger(name).info(msg, ranks=[0])``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

__all__ = ["DistributedLogger", "get_dist_logger"]

_LOGGERS: dict[str, DistributedLogger] = {}


class _StdoutHandler(logging.StreamHandler):
    # Looks sys.stdout up at each record, so redirections made after the logger was created
    # (contextlib.redirect_stdout, test capture) are honoured.
    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


class DistributedLogger:
    """A ``logging.Logger`` that knows its rank; ``ranks=[0]`` logs on rank 0 only.

    Example::

        logger = kiln.get_dist_logger()
        logger.info("epoch 1 done", ranks=[0])
    """

    def __init__(self, name: str) -> None:
        self._logger = logging.getLogger(name)
        if not self._logger.handlers:
            handler = _StdoutHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
            self._logger.addHandler(handler)
            self._logger.setLevel(logging.INFO)
            # kiln prints through its own handler; the root logger would print twice.
            self._logger.propagate = False

    @property
    def logger(self) -> logging.Logger:
        return self._logger

    def set_level(self, level: int | str) -> None:
        self._logger.setLevel(level)

    def _log(self, level: int, msg: str, ranks: Iterable[int] | None) -> None:
        from kiln.launch.context import context

        rank = context().rank
        if ranks is None or rank in ranks:
            prefix = f"[rank {rank}] " if context().world_size > 1 and ranks is None else ""
            self._logger.log(level, prefix + str(msg))

    def debug(self, msg: str, ranks: Iterable[int] | None = None) -> None:
        self._log(logging.DEBUG, msg, ranks)

    def info(self, msg: str, ranks: Iterable[int] | None = None) -> None:
        self._log(logging.INFO, msg, ranks)

    def warning(self, msg: str, ranks: Iterable[int] | None = None) -> None:
        self._log(logging.WARNING, msg, ranks)

    def error(self, msg: str, ranks: Iterable[int] | None = None) -> None:
        self._log(logging.ERROR, msg, ranks)


def get_dist_logger(name: str = "kiln") -> DistributedLogger:
    if name not in _LOGGERS:
        _LOGGERS[name] = DistributedLogger(name)
    return _LOGGERS[name]
