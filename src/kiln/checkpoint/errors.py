"""The one error kiln raises for checkpoints it cannot write, trust or load."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, unsafe or does not fit the run.

    The message always names the file (or folder) and the problem, and says what to do, so that a
    user never has to read a traceback from deep inside torch to learn that a download was cut short.

    Attributes:
        path: the file or folder at fault (a local path or a URL).
        problem: what is wrong with it.
        fix: what to do about it (may be empty).

    Example::

        try:
            kiln.checkpoint.load_checkpoint("runs/a/last", state)
        except kiln.checkpoint.CheckpointError as err:
            print(err.path, err.problem)
    """

    def __init__(self, path: str | os.PathLike | Any, problem: str, fix: str = "") -> None:
        self.path = str(path)
        self.problem = problem
        self.fix = fix
        super().__init__(f"checkpoint {self.path}: {problem}" + (f"; {fix}" if fix else ""))

    def __reduce__(self):  # picklable, so all_gather_object can carry it between ranks
        return (CheckpointError, (self.path, self.problem, self.fix))
