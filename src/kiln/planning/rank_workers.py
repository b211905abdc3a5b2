"""Measure a dry run's ranks side by side, one process per CPU.

Each rank of a dry run is measured on its own (its own fake world, model and step) and costs
seconds to minutes of one CPU (Llama-3-70B's 8 pipeline ranks at 512: about a minute each), while
a laptop or a login node has several. After the first rank, which traces the model that the others
share (:mod:`kiln.planning.shared_trace`), the other ranks are measured in processes forked from
this one: a fork inherits the trace, the run's arguments and the imports, so a worker starts in
milliseconds, and what it sends back is the rank's report (plain numbers), never a tensor.

Nothing else in a worker is shared: each builds its rank's fake world, model and Engine as the
process measuring the ranks one after another would, and a configuration error raised in a
worker is raised here with its message. ``workers=1`` measures them one after another in this
process (no fork).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["default_workers", "measure_ranks"]

R = TypeVar("R")

# the measuring function of the dry run in progress: set before the fork, so the workers get it
# by inheritance (a closure over the run's arguments and its first microbatch is not picklable)
_measure: Callable[[int], Any] | None = None


def default_workers() -> int:
    """The CPUs this process may run on (1 inside a daemonic process, which may not fork workers)."""
    if multiprocessing.current_process().daemon:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _in_worker(rank: int) -> Any:
    assert _measure is not None, "a dry-run worker started without its measuring function"
    return _measure(rank)


def measure_ranks(measure: Callable[[int], R], ranks: Sequence[int], workers: int) -> dict[int, R]:
    """``{rank: measure(rank)}`` for ``ranks``, measured in up to ``workers`` forked processes at once
    (in this process when ``workers`` is 1, there is one rank, or the platform cannot fork)."""
    global _measure
    ranks = list(ranks)
    workers = min(workers, len(ranks))
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return {rank: measure(rank) for rank in ranks}
    _measure = measure
    try:
        # maxtasksperchild=1: each rank in a fresh fork of this process, as if it were the next
        # one measured here (no state of an earlier rank's fake world or Engine carried over)
        with multiprocessing.get_context("fork").Pool(workers, maxtasksperchild=1) as pool:
            return dict(zip(ranks, pool.map(_in_worker, ranks, chunksize=1), strict=True))
    finally:
        _measure = None
