"""Dataloaders that know the world: a resumable distributed sampler and `get_dataloader`."""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler

from kiln.launch.context import context

__all__ = ["ResumableSampler", "get_dataloader", "ensure_distributed_sampler"]


class ResumableSampler(DistributedSampler):
    """torch's ``DistributedSampler`` whose order depends only on ``seed`` and the epoch, and which
    can start part-way through an epoch.

    Used for every world size (a world of 1 is ``num_replicas=1``), so a resumed run sees exactly
    the samples an uninterrupted one would, without loading the ones it already consumed.

    Example::

        sampler = ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=17)
        sampler.set_epoch(3); sampler.skip(64)    # continue epoch 3 after 64 samples
    """

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        ctx = context()
        super().__init__(dataset, num_replicas=ctx.world_size if num_replicas is None else num_replicas,
                         rank=ctx.rank if rank is None else rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._skip = 0

    def skip(self, num_samples: int) -> None:
        """Start the current epoch after ``num_samples`` of this rank's samples (cleared by set_epoch)."""
        self._skip = num_samples

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._skip = 0
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = super().__iter__()
        if self._skip:
            indices = iter(list(indices)[self._skip:])
        return indices

    def __len__(self) -> int:
        return self.num_samples - self._skip

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "skip": self._skip, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._skip, self.seed = int(state["epoch"]), int(state["skip"]), int(state["seed"])


def get_dataloader(dataset: Dataset, shuffle: bool = False, seed: int = 1024, add_sampler: bool = True,
                   drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0, **kwargs: Any) -> DataLoader:
    """A DataLoader with a distributed sampler when the world is larger than one (Colossal-AI's helper).

    Example::

        train_dl = kiln.get_dataloader(train_set, shuffle=True, batch_size=128)
    """
    if add_sampler and context().world_size > 1:
        sampler = ResumableSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
        return DataLoader(dataset, sampler=sampler, drop_last=drop_last, pin_memory=pin_memory,
                          num_workers=num_workers, **kwargs)
    if shuffle:
        sampler = ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
        return DataLoader(dataset, sampler=sampler, drop_last=drop_last, pin_memory=pin_memory,
                          num_workers=num_workers, **kwargs)
    return DataLoader(dataset, shuffle=False, drop_last=drop_last, pin_memory=pin_memory, num_workers=num_workers, **kwargs)


_LOADER_ARGS = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout",
                "worker_init_fn", "multiprocessing_context", "generator", "persistent_workers", "pin_memory_device")


def ensure_distributed_sampler(loader: DataLoader | None, seed: int = 1024) -> DataLoader | None:
    """Return ``loader``, rebuilt with a :class:`ResumableSampler` if the world is larger than one
    and it has none, keeping its shuffling, batch size and worker settings."""
    ctx = context()
    if loader is None or ctx.world_size == 1 or not isinstance(loader, DataLoader):
        return loader
    if isinstance(loader.sampler, DistributedSampler) or loader.batch_sampler is None:
        return loader
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        return loader  # a custom sampler: the user decides how data is split
    shuffle = isinstance(loader.sampler, RandomSampler)
    kwargs = {name: getattr(loader, name) for name in _LOADER_ARGS if hasattr(loader, name)}
    kwargs["batch_size"] = loader.batch_size
    kwargs["drop_last"] = loader.drop_last
    kwargs.pop("generator", None)
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("persistent_workers", None)
        kwargs.pop("multiprocessing_context", None)
        kwargs.pop("timeout", None)
    sampler = ResumableSampler(loader.dataset, shuffle=shuffle, seed=seed, drop_last=loader.drop_last)
    return DataLoader(loader.dataset, sampler=sampler, **kwargs)
