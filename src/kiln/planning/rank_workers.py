"""Measure a dry run's ranks side by side, one process per CPU.

Each rank of a dry run is measured on its own (its own fake world, model and step) and costs
seconds to minutes of one CPU (Llama-3-70B's 8 pipeline ranks at 512: about half a minute each),
while a laptop or a login node has several. The ranks are measured in processes forked from this
one, at most ``workers`` at once, each rank in a fresh fork: a fork inherits what this process has
made for every rank (the model's trace and its cut into stages: :mod:`kiln.planning.shared_trace`),
the run's arguments and the imports, so a worker starts in milliseconds, and what it sends back is
the rank's report (plain numbers), never a tensor.

Nothing else in a worker is shared: each builds its rank's fake world, model and Engine as the
process measuring the ranks one after another would, and an error raised in a worker (a
configuration error: its message) is raised here. ``workers=1`` measures them one after another in
this process (no fork).

The workers are ``multiprocessing`` processes started from this thread, each with a pipe for its
result (no ``multiprocessing.Pool``, whose threads fork the workers it replaces while others run),
and each runs ATen on one thread: a fork has none of its parent's OpenMP threads, and the first op
large enough to use them (an ``arange`` at Llama-3-70B's size) waited for them forever. Where a fork
of this process cannot run autograd at all (:func:`forks_can_backward`: torch 2.14 after a backward
on fake tensors here, such as an earlier dry run's), the ranks are measured one after another here.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["can_fork", "default_workers", "forks_can_backward", "measure_ranks"]

R = TypeVar("R")
logger = logging.getLogger("kiln")


def default_workers() -> int:
    """The CPUs this process may run on (1 inside a daemonic process, which may not fork workers)."""
    if multiprocessing.current_process().daemon:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def can_fork() -> bool:
    """Whether this platform can fork workers (Linux and macOS; not Windows)."""
    return "fork" in multiprocessing.get_all_start_methods()


def _backward_once() -> None:
    import torch

    torch.set_num_threads(1)
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError:
        sys.exit(1)


def forks_can_backward() -> bool:
    """Whether a process forked from this one can run a backward: torch refuses it in a fork of a
    process whose autograd engine has started its device threads ("Unable to handle autograd's
    threading in combination with fork-based multiprocessing"), which torch 2.14's build does for a
    backward on fake tensors (an earlier dry run's step in this process). One fork that runs one
    backward of one element tells."""
    process = multiprocessing.get_context("fork").Process(target=_backward_once, daemon=True)
    process.start()
    process.join()
    return process.exitcode == 0


def _in_worker(measure: Callable[[int], Any], rank: int, send: Any) -> None:
    import torch

    # One thread of ATen's own: the OpenMP threads this process's parent may have started are not in
    # the fork, and the first parallel op (an arange of 70B's size) waited for them forever. The
    # worker's ops are on fake tensors, or tiny real ones: threads do not speed them up.
    torch.set_num_threads(1)
    try:
        result: tuple[bool, Any] = (True, measure(rank))
    except BaseException as error:  # noqa: BLE001 - raised again in the parent
        result = (False, error)
    try:
        send.send(result)
    except Exception as error:  # the result or the error does not pickle
        send.send((False, RuntimeError(f"the dry run of rank {rank}: {result[1]!r} ({error})")))
    finally:
        send.close()


def measure_ranks(measure: Callable[[int], R], ranks: Sequence[int], workers: int) -> dict[int, R]:
    """``{rank: measure(rank)}`` for ``ranks``, measured in up to ``workers`` forked processes at once
    (in this process when ``workers`` is 1, there is one rank, or the platform cannot fork).

    Raises:
        the first error a rank's ``measure`` raised; RuntimeError when a worker died without an answer.
    """
    ranks = list(ranks)
    workers = min(workers, len(ranks))
    if workers > 1 and can_fork() and not forks_can_backward():
        logger.info(
            "dry run: a fork of this process cannot run autograd (an earlier backward here started its "
            "threads); measuring %d ranks one after another in this process",
            len(ranks),
        )
        workers = 1
    if workers <= 1 or not can_fork():
        return {rank: measure(rank) for rank in ranks}
    context = multiprocessing.get_context("fork")
    waiting, results = list(ranks), {}
    running: dict[Any, tuple[int, Any]] = {}  # the result's end of each worker's pipe: (rank, process)
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                rank = waiting.pop(0)
                receive, send = context.Pipe(duplex=False)
                # a closure is fine: a fork inherits it, nothing is pickled on the way in
                process = context.Process(target=_in_worker, args=(measure, rank, send), daemon=True)
                process.start()
                send.close()
                running[receive] = (rank, process)
            for ready in multiprocessing.connection.wait(list(running)):
                receive = ready  # type: ignore[assignment]  # wait returns the connections it was given
                rank, process = running.pop(receive)
                try:
                    ok, value = receive.recv()
                except EOFError:
                    process.join()
                    raise RuntimeError(
                        f"the dry-run worker measuring rank {rank} ended with exit code {process.exitcode} "
                        "and no report (killed for memory?); run with workers=1 to measure in this process"
                    ) from None
                finally:
                    receive.close()
                process.join()
                if not ok:
                    raise value
                results[rank] = value
    finally:
        for receive, (_, process) in running.items():
            process.kill()
            process.join()
            receive.close()
    return {rank: results[rank] for rank in ranks}
