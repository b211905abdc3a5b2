"""Dataloaders that know the world: a resumable distributed sampler and `get_dataloader`."""

from __future__ import annotations

import hashlib
import random
import struct
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    get_worker_info,
)

from kiln.launch.context import context

__all__ = [
    "ResumableSampler",
    "WorkerSeeded",
    "ShardSampler",
    "get_dataloader",
    "ensure_distributed_sampler",
    "with_resumable_sampler",
]


class ResumableSampler(DistributedSampler):
    """torch's ``DistributedSampler`` whose order depends only on ``seed`` and the epoch, and which
    can start part-way through an epoch.

    Used for every world size (a world of 1 is ``num_replicas=1``), so a resumed run sees exactly
    the samples an uninterrupted one would, without loading the ones it already consumed. After a
    change of world size, :meth:`skip_world` deals the rest of the epoch to the new ranks: every
    sample not yet seen comes once (plus the usual padding), none seen comes again.

    Example::

        sampler = ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=17)
        sampler.set_epoch(3); sampler.skip(64)    # continue epoch 3 after 64 samples

    ``worker_seeds=True`` yields ``(index, seed)`` pairs for a :class:`WorkerSeeded` dataset: the
    seed is a function of ``seed``, the epoch, the rank and the sample's position in the epoch.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        worker_seeds: bool = False,
    ) -> None:
        ctx = context()
        super().__init__(
            dataset,
            num_replicas=ctx.world_size if num_replicas is None else num_replicas,
            rank=ctx.rank if rank is None else rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self._skip = 0  # this rank's samples already consumed in the epoch
        self._world_skip = 0  # or: every rank's, in the epoch's global order
        self.worker_seeds = worker_seeds

    def skip(self, num_samples: int) -> None:
        """Start the current epoch after ``num_samples`` of this rank's samples (cleared by set_epoch)."""
        self._skip, self._world_skip = num_samples, 0

    def skip_world(self, num_samples: int) -> None:
        """Start the current epoch after the first ``num_samples`` of the epoch's global order, the
        samples all ranks of the world that saved them consumed together, whatever its size. On the
        same world size this is :meth:`skip` of ``num_samples / num_replicas``."""
        if num_samples % self.num_replicas == 0:
            self.skip(num_samples // self.num_replicas)  # the plain case, and the same order
        else:
            self._skip, self._world_skip = 0, num_samples

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._skip = self._world_skip = 0
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self._world_skip:
            indices = iter(self._rest_of_world()[self.rank :: self.num_replicas])
        else:
            indices = super().__iter__()
            if self._skip:
                indices = iter(list(indices)[self._skip :])
        if not self.worker_seeds:
            return indices
        # Positions count from the epoch's start, skipped samples included, so a resumed epoch gives
        # each sample the seed it had (after a change of world size the positions are the new deal's).
        return (
            (index, sample_seed(self.seed, self.epoch, self.rank, self._skip + n)) for n, index in enumerate(indices)
        )

    def _rest_of_world(self) -> list[int]:
        # The epoch's global order is the one-rank order (the seed and the epoch fix it; the world
        # size only pads or trims its end): skip its consumed start, then even the rest out over
        # this world's ranks as DistributedSampler does.
        whole: DistributedSampler = DistributedSampler(
            self.dataset, num_replicas=1, rank=0, shuffle=self.shuffle, seed=self.seed
        )
        whole.set_epoch(self.epoch)
        rest = list(whole)[self._world_skip :]
        extra = len(rest) % self.num_replicas
        if extra and self.drop_last:
            rest = rest[: len(rest) - extra]
        elif extra:
            rest += (rest * self.num_replicas)[: self.num_replicas - extra]
        return rest

    def __len__(self) -> int:
        if self._world_skip:  # the length of _rest_of_world() per rank, without building it
            rest = max(len(self.dataset) - self._world_skip, 0)  # type: ignore[arg-type]
            return rest // self.num_replicas if self.drop_last else -(-rest // self.num_replicas)
        return self.num_samples - self._skip

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "skip": self._skip, "seed": self.seed, "world_skip": self._world_skip}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._skip, self.seed = int(state["epoch"]), int(state["skip"]), int(state["seed"])
        self._world_skip = int(state.get("world_skip", 0))  # absent in checkpoints before it existed


def sample_seed(seed: int, epoch: int, rank: int, position: int) -> int:
    """A 63-bit seed for the sample at ``position`` of ``rank``'s share of ``epoch``."""
    digest = hashlib.blake2b(struct.pack("<4q", seed, epoch, rank, position), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _seed_worker(seed: int) -> None:
    if get_worker_info() is None:
        return  # in the main process the global RNGs belong to the run (and are checkpointed)
    random.seed(seed)
    torch.random.default_generator.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional
        pass


class WorkerSeeded(Dataset):
    """``dataset`` for DataLoader workers, seeding python's, numpy's and torch's RNGs before each sample.

    torch seeds each worker once per ``iter()``, from a seed drawn in the main process, so what
    an augmentation draws for a sample depends on which worker fetched it and on everything that
    worker fetched before: a run resumed mid-epoch, whose workers start fresh at the resume point,
    would draw differently. Here the seed of each sample comes with its index from a
    ``ResumableSampler(worker_seeds=True)``, so the draws depend only on the sampler's seed, the
    epoch, the rank and the sample's position: the same with any number of workers, and after a resume.

    Example::

        sampler = ResumableSampler(data, shuffle=True, seed=17, worker_seeds=True)
        loader = DataLoader(WorkerSeeded(data), sampler=sampler, batch_size=32, num_workers=4)
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        _seed_worker(seed)
        return self.dataset[index]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is None:
            return [self[key] for key in keys]
        _seed_worker(keys[0][1])  # a dataset that fetches a batch in one call draws for it from one seed
        return getitems([index for index, _ in keys])

    def __getattr__(self, name: str) -> Any:  # the wrapped dataset's own attributes (classes, transforms)
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)  # not set yet (unpickling), or a protocol method: not the wrapped one's
        return getattr(self.dataset, name)


def get_dataloader(
    dataset: Dataset,
    shuffle: bool = False,
    seed: int = 1024,
    add_sampler: bool = True,
    drop_last: bool = False,
    pin_memory: bool = False,
    num_workers: int = 0,
    **kwargs: Any,
) -> DataLoader:
    """A DataLoader with a distributed sampler when the world is larger than one (Colossal-AI's helper).

    Example::

        train_dl = kiln.get_dataloader(train_set, shuffle=True, batch_size=128)
    """
    keyed = num_workers > 0  # workers seeded per sample: a resume gives the same augmentation
    if add_sampler and context().world_size > 1:
        sampler = ResumableSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last, worker_seeds=keyed)
        return DataLoader(
            WorkerSeeded(dataset) if keyed else dataset,
            sampler=sampler,
            drop_last=drop_last,
            pin_memory=pin_memory,
            num_workers=num_workers,
            **kwargs,
        )
    if shuffle:
        sampler = ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed, worker_seeds=keyed)
        return DataLoader(
            WorkerSeeded(dataset) if keyed else dataset,
            sampler=sampler,
            drop_last=drop_last,
            pin_memory=pin_memory,
            num_workers=num_workers,
            **kwargs,
        )
    return DataLoader(
        dataset, shuffle=False, drop_last=drop_last, pin_memory=pin_memory, num_workers=num_workers, **kwargs
    )


_LOADER_ARGS = (
    "batch_size",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
    "prefetch_factor",
    "in_order",
    "snapshot_every_n_steps",  # torchdata's StatefulDataLoader
)


def loader_arguments(loader: DataLoader) -> dict[str, Any]:
    """The arguments that rebuild ``loader`` (batching, workers, collation), without its dataset and sampler."""
    kwargs = {name: getattr(loader, name) for name in _LOADER_ARGS if hasattr(loader, name)}
    kwargs.pop("generator", None)
    if kwargs.get("num_workers", 0) == 0:
        for name in ("persistent_workers", "multiprocessing_context", "timeout", "prefetch_factor"):
            kwargs.pop(name, None)
    return kwargs


def ensure_distributed_sampler(
    loader: DataLoader | None, seed: int = 1024, num_replicas: int | None = None, rank: int | None = None
) -> DataLoader | None:
    """Return ``loader``, rebuilt with a :class:`ResumableSampler` if the data is split over more
    than one rank and it has no distributed sampler, keeping its shuffling, batch size and worker
    settings. ``num_replicas``/``rank`` default to the world (a strategy with tensor or pipeline
    groups passes its data-parallel size and rank)."""
    if (context().world_size if num_replicas is None else num_replicas) == 1:
        return loader
    return with_resumable_sampler(loader, seed, num_replicas, rank)


def with_resumable_sampler(
    loader: Any, seed: int = 1024, num_replicas: int | None = None, rank: int | None = None
) -> Any:
    """Return ``loader`` rebuilt with a :class:`ResumableSampler` (over ``num_replicas`` ranks,
    default the world) in place of a plain random or sequential sampler, so its order depends only
    on seed and epoch and a resumed run can start mid-epoch. With loader workers, the dataset is
    wrapped in :class:`WorkerSeeded`, so their random augmentation resumes too. Other loaders come
    back unchanged."""
    if loader is None or not isinstance(loader, DataLoader):
        return loader
    if isinstance(loader.sampler, DistributedSampler) or loader.batch_sampler is None:
        return loader
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler, *_stateful_random_sampler())):
        return loader  # a custom sampler: the user decides how data is split
    shuffle = not isinstance(loader.sampler, SequentialSampler)
    kwargs = loader_arguments(loader)
    keyed = loader.num_workers > 0
    dataset = loader.dataset.dataset if isinstance(loader.dataset, WorkerSeeded) else loader.dataset
    sampler = ResumableSampler(
        dataset,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=loader.drop_last,
        worker_seeds=keyed,
    )
    return loader_class(loader)(WorkerSeeded(dataset) if keyed else dataset, sampler=sampler, **kwargs)


# -- torchdata's StatefulDataLoader ---------------------------------------------------------------
def loaded_torchdata() -> Any:
    """torchdata's stateful_dataloader module when something imported it (a StatefulDataLoader
    exists only then), else None: checking a loader's class imports nothing."""
    return sys.modules.get("torchdata.stateful_dataloader")


def _stateful_random_sampler() -> tuple[type, ...]:
    module = loaded_torchdata()
    return () if module is None else (module.sampler.RandomSampler,)


def loader_class(loader: DataLoader) -> type[DataLoader]:
    """The class to rebuild ``loader`` with: a StatefulDataLoader stays one, others become DataLoaders."""
    module = loaded_torchdata()
    if module is not None and isinstance(loader, module.StatefulDataLoader):
        return module.StatefulDataLoader
    return DataLoader


class ShardSampler(Sampler[int]):
    """Evaluation sharding without padding: rank r takes samples r, r+W, r+2W, ...

    torch's DistributedSampler pads the last shard with repeated samples, which would count them
    twice in a metric. Shards here differ by at most one sample, so ranks may read different
    numbers of batches; under strategies whose forward is a collective (FSDP, tensor, pipeline)
    the Trainer's evaluation and prediction then run padding forwards on the shorter shards, whose
    outputs count nowhere (see :mod:`kiln.trainer.evaluation`). Sample ``i`` of the dataset is
    row ``i // W`` of rank ``i % W``'s shard, which is how gathered predictions regain dataset order.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int) -> None:
        self.dataset: Any = dataset  # map-style: has a length (DataLoader checks it)
        self.num_replicas, self.rank = num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return self.shard_length(self.rank)

    def shard_length(self, rank: int) -> int:
        """Samples in ``rank``'s shard; rank 0's is the longest. Known on every rank without communication."""
        return len(range(rank, len(self.dataset), self.num_replicas))

    @classmethod
    def wrap(cls, loader: Any, num_replicas: int | None = None, rank: int | None = None) -> Any:
        """``loader`` sharded across ``num_replicas`` ranks (default the world) when that is more
        than one and it is a plain sequential DataLoader; anything else is returned unchanged."""
        ctx = context()
        num_replicas = ctx.world_size if num_replicas is None else num_replicas
        rank = ctx.rank if rank is None else rank
        if num_replicas == 1 or not isinstance(loader, DataLoader) or not isinstance(loader.sampler, SequentialSampler):
            return loader
        kwargs = loader_arguments(loader)
        return DataLoader(loader.dataset, sampler=cls(loader.dataset, num_replicas, rank), **kwargs)
