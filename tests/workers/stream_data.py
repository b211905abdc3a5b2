"""Streamed test data whose every fetch is logged: the stateful-loader and streaming-dataset tests
count what a resumed run fetches (tests/test_stateful_loader.py, tests/test_hf_datasets.py).

A fetch appends ``epoch id`` to a log file with ``O_APPEND`` (each line lands whole), so fetches
in DataLoader worker processes are counted too.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import IterableDataset, get_worker_info


def log_fetch(path: str, epoch: int, sample: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{epoch} {sample}\n".encode())
    os.close(fd)


def read_fetches(path) -> list[tuple[int, int]]:
    """The ``(epoch, id)`` of every logged fetch, in the order they landed."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [tuple(int(v) for v in line.split()) for line in f if line.strip()]  # type: ignore[misc]


def features(sample: int) -> torch.Tensor:
    return torch.sin(sample * torch.arange(1, 9, dtype=torch.float32))


class Stream(IterableDataset):
    """Samples ``(features, label, id)`` for ids 0..n-1 in order; worker w of W reads ids w, w+W,
    ... Without state: a resume can only fetch the epoch's start again."""

    def __init__(self, n: int, log: str) -> None:
        self.n, self.log = n, log
        self.epoch, self.position, self._start = 0, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        share = range(worker, self.n, num_workers)
        self.position, self._start = self._start, 0
        while self.position < len(share):
            sample = share[self.position]
            self.position += 1
            log_fetch(self.log, self.epoch, sample)
            yield features(sample), sample % 2, sample


class StatefulStream(Stream):
    """:class:`Stream` with its position in its share as state (a StatefulDataLoader collects
    each worker's)."""

    def state_dict(self) -> dict:
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        assert state["epoch"] == self.epoch, f"state of epoch {state['epoch']} loaded in epoch {self.epoch}"
        self._start = state["position"]
