"""Streamed training data: iterable datasets that a loader reads in order instead of indexing.

Such data resumes through its own state (see :class:`~kiln.launch.ResumableLoader`): torchdata's
``StatefulDataLoader`` collects it from each worker's copy of the dataset, and a Hugging Face
streaming dataset (``datasets.load_dataset(..., streaming=True)``) keeps it, split by rank with
``datasets.distributed.split_dataset_by_node``. Both libraries are optional: nothing here imports
them until a loader or dataset of theirs is there.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from kiln.launch.context import context
from kiln.launch.data import loaded_torchdata, loader_arguments, loader_class, with_resumable_sampler
from kiln.launch.loader import has_state

__all__ = ["as_stateful_dataloader", "shard_by_rank", "with_sharded_stream", "resumable_train_loader"]


def _is_hf_stream(dataset: Any) -> bool:
    """A Hugging Face ``datasets.IterableDataset`` (only possible once ``datasets`` was imported)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(dataset, module.IterableDataset)


def shard_by_rank(dataset: Any, num_replicas: int | None = None, rank: int | None = None) -> Any:
    """This rank's share of a Hugging Face dataset: ``datasets.distributed.split_dataset_by_node``
    over ``num_replicas`` ranks (default: the world). A stream with a multiple of ``num_replicas``
    shards (files) gives each rank whole shards; otherwise each rank keeps every
    ``num_replicas``-th example.

    Example::

        stream = load_dataset("text", data_files=files, split="train", streaming=True)
        loader = StatefulDataLoader(kiln.launch.shard_by_rank(stream), batch_size=8, num_workers=2)
    """
    from datasets.distributed import split_dataset_by_node

    ctx = context()
    return split_dataset_by_node(
        dataset,
        rank=ctx.rank if rank is None else rank,
        world_size=ctx.world_size if num_replicas is None else num_replicas,
    )


def with_sharded_stream(loader: Any, num_replicas: int, rank: int) -> Any:
    """``loader`` rebuilt over :func:`shard_by_rank` of its Hugging Face streaming dataset when the
    data is split over more than one rank and the dataset is not split yet; anything else unchanged."""
    if num_replicas == 1 or not isinstance(loader, DataLoader) or not _is_hf_stream(loader.dataset):
        return loader
    if getattr(loader.dataset, "_distributed", None) is not None:
        return loader  # split_dataset_by_node already gave it a rank's share (datasets keeps it there)
    kwargs = loader_arguments(loader)
    return loader_class(loader)(shard_by_rank(loader.dataset, num_replicas, rank), **kwargs)


def as_stateful_dataloader(loader: Any, stateful: bool | None = True) -> Any:
    """``loader`` rebuilt as torchdata's ``StatefulDataLoader`` with the same dataset, sampler,
    batching and worker settings, so a resume continues its data mid-epoch without replay.

    A StatefulDataLoader collects the state of each worker's copy of an iterable dataset (its
    ``state_dict()``) and the loader's own; :class:`~kiln.launch.ResumableLoader` saves that and
    loads it at a resume. ``stateful``: ``True`` rebuilds any torch DataLoader (an ImportError says
    what to install without torchdata); ``None`` only one that needs it to resume exactly, an
    iterable dataset with ``state_dict``/``load_state_dict`` read by workers (without torchdata it
    stays as it is, and a resume fetches the epoch's start again, saying so); ``False`` none.
    Anything that is not a plain DataLoader comes back unchanged.

    Example::

        loader = as_stateful_dataloader(DataLoader(stream, batch_size=8, num_workers=2))
    """
    if stateful is False or type(loader) is not DataLoader:  # a subclass may take other arguments
        return loader
    dataset = loader.dataset
    if stateful is None:
        if not (isinstance(dataset, IterableDataset) and has_state(dataset) and loader.num_workers > 0):
            return loader
        if loaded_torchdata() is None:
            try:
                import torchdata.stateful_dataloader  # noqa: F401
            except ImportError:
                return loader
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler
    except ImportError:
        raise ImportError(
            "stateful_dataloader=True needs torchdata (torchdata.stateful_dataloader.StatefulDataLoader): "
            "pip install 'kiln-train[data]' or pip install torchdata"
        ) from None
    kwargs = loader_arguments(loader)
    if isinstance(dataset, IterableDataset):
        pass  # no sampler: the dataset orders itself
    elif loader.batch_size is None:  # the user's batch_sampler decides the batches
        kwargs.pop("batch_size", None)
        kwargs.pop("drop_last", None)
        kwargs["batch_sampler"] = loader.batch_sampler
    elif type(loader.sampler) is RandomSampler:
        # torch's RandomSampler draws a new permutation at each iter(); torchdata's keeps its
        # generator's state, so a resumed epoch has the saved one's order.
        sampler: Any = loader.sampler
        kwargs["sampler"] = StatefulRandomSampler(dataset, sampler.replacement, sampler.num_samples, sampler.generator)
    else:
        kwargs["sampler"] = loader.sampler
    return StatefulDataLoader(dataset, **kwargs)


def resumable_train_loader(
    loader: Any, seed: int, num_replicas: int, rank: int, stateful_dataloader: bool | None = None
) -> Any:
    """The user's training loader as a run resumes it exactly (the Trainer's), in this order: a
    :class:`~kiln.launch.ResumableSampler` for map-style data (:func:`with_resumable_sampler`), a Hugging Face
    streaming dataset split over the ``num_replicas`` data-parallel ranks
    (:func:`kiln.launch.streaming.with_sharded_stream`), then a StatefulDataLoader where
    ``stateful_dataloader`` asks for one (:func:`as_stateful_dataloader`)."""
    loader = with_resumable_sampler(loader, seed, num_replicas, rank)
    loader = with_sharded_stream(loader, num_replicas, rank)
    return as_stateful_dataloader(loader, stateful_dataloader)
