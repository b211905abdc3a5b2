"""`MemoryMonitor`: log accelerator memory (CUDA allocator statistics) or the process's RSS on CPU."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from kiln.core.callback import Callback
from kiln.core.state import State

__all__ = ["MemoryMonitor"]

_GB = 1e9

# torch.cuda.memory_stats key -> logged name (Composer's names), in GB except the retry count.
_CUDA_STATS = {
    "allocated_bytes.all.current": "current_allocated_mem",
    "active_bytes.all.current": "current_active_mem",
    "inactive_split_bytes.all.current": "current_inactive_mem",
    "reserved_bytes.all.current": "current_reserved_mem",
    "allocated_bytes.all.peak": "peak_allocated_mem",
    "active_bytes.all.peak": "peak_active_mem",
    "inactive_split_bytes.all.peak": "peak_inactive_mem",
    "reserved_bytes.all.peak": "peak_reserved_mem",
    "num_alloc_retries": "alloc_retries",
}


def cuda_memory_report(device: torch.device) -> dict[str, float]:
    """The caching allocator's statistics for ``device`` as ``memory/<name>`` (GB; retries as a count).

    ``torch.cuda.memory_stats`` reads host-side counters: no kernel, no device synchronisation.
    """
    stats = torch.cuda.memory_stats(device)
    report = {}
    for key, name in _CUDA_STATS.items():
        if key in stats:
            value = stats[key]
            report[f"memory/{name}"] = float(value) if key == "num_alloc_retries" else value / _GB
    return report


def rss_memory_report() -> dict[str, float]:
    """This process's resident memory in GB: current (Linux ``/proc``) and peak (``resource``)."""
    report = {}
    try:  # /proc/self/statm: sizes in pages; the second field is the resident set
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        report["memory/current_rss_mem"] = resident_pages * os.sysconf("SC_PAGE_SIZE") / _GB
    except (OSError, ValueError, IndexError):
        pass  # not Linux
    try:
        import resource  # POSIX only

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss is in KiB on Linux but in bytes on macOS.
        report["memory/peak_rss_mem"] = (peak if sys.platform == "darwin" else peak * 1024) / _GB
    except ImportError:
        pass
    return report


class MemoryMonitor(Callback):
    """Log memory use every ``interval`` batches, at ``BATCH_END``.

    On CUDA: the caching allocator's current and peak allocated, active, inactive and reserved
    memory (``memory/current_allocated_mem``, ``memory/peak_reserved_mem``, ... in GB; peaks since
    the process started) and ``memory/alloc_retries`` (a rising count means the allocator is
    flushing its cache to satisfy requests: fragmentation or near-OOM). On CPU and other devices:
    the process's resident set, ``memory/current_rss_mem`` and ``memory/peak_rss_mem`` (GB).
    Neither reading synchronises the device.

    Args:
        interval: log every this many batches.

    Example::

        trainer = kiln.Trainer(model, ..., callbacks=[kiln.callbacks.MemoryMonitor()])
    """

    def __init__(self, interval: int = 1) -> None:
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"MemoryMonitor interval must be a positive int, got {interval!r}")
        self.interval = interval

    def batch_end(self, state: State, logger: Any) -> None:
        if state.timestamp.batch.value % self.interval:
            return
        device = torch.device(state.device)
        if device.type == "cuda" and torch.cuda.is_available():
            report = cuda_memory_report(device)
        else:
            report = rss_memory_report()
        logger.log_metrics(report)
