"""``ResumableLoader``: the training data stream that knows where it is and resumes there exactly."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kiln.launch.rng import rng_state, set_rng_state

__all__ = ["ResumableLoader"]

_KEYS = ("epoch", "batch_in_epoch", "sample_in_epoch", "sampler", "rng")


class ResumableLoader:
    """The training loader of a run: it owns the epoch, the position in it and an exact resume.

    Each ``iter()`` starts the current epoch at the current position, in this order:

    1. the sampler's ``set_epoch(epoch)`` when it has one;
    2. past what the epoch already consumed: a :class:`~kiln.launch.ResumableSampler` starts after the
       consumed start of the epoch's global order (``skip_world``: on the world size that consumed it,
       each rank after its own samples; on another, the rest is dealt to the new ranks), a sampler
       with only ``skip`` after this rank's batches; any other loader skips them by fetching;
    3. once, after :meth:`load_state_dict` of a mid-epoch position: the RNG states put back as they
       were when it was saved. ``iter()`` (and a skip by fetching) drew from them, and the
       uninterrupted run drew that seed at the epoch's start, before the save;
    4. ``subset_num_batches``: the epoch ends after that many batches, those consumed before included.

    The position advances as batches are yielded, the epoch when an iterator runs out, so a
    :meth:`state_dict` taken between batches is where the next ``iter()`` continues. An iterator
    left unfinished leaves its epoch unfinished: the next ``iter()`` goes on with it.

    Attributes the wrapped loader has (``dataset``, ``batch_size``, ``sampler``, ...) read through.

    Args:
        loader: a DataLoader (with a ``ResumableSampler`` it resumes without loading what it skips:
            :func:`~kiln.launch.data.with_resumable_sampler` gives a plain DataLoader one) or any iterable
            of batches. ``None`` holds a loaded position until a loader comes (the Trainer's case).
        subset_num_batches: end each epoch after this many batches (None: all of them).

    Example::

        loader = kiln.ResumableLoader(kiln.get_dataloader(data, shuffle=True, batch_size=32))
        for epoch in range(3):
            for batch in loader:
                ...
        torch.save({"loader": loader.state_dict(), ...}, "ckpt.pt")     # plain data, also mid-epoch
        # a new process: the next iter() continues where the saved one was
        loader.load_state_dict(torch.load("ckpt.pt", weights_only=True)["loader"])
    """

    def __init__(self, loader: Iterable | None, subset_num_batches: int | None = None) -> None:
        if subset_num_batches is not None and (
            isinstance(subset_num_batches, bool) or not isinstance(subset_num_batches, int) or subset_num_batches < 1
        ):
            raise ValueError(f"subset_num_batches={subset_num_batches!r} must be a positive int or None (all batches)")
        self.subset_num_batches = subset_num_batches
        self.epoch = 0
        self.batch_in_epoch = 0
        # sample_in_epoch is counted from here: (batch_in_epoch, sample_in_epoch) then. Deriving it
        # when asked keeps the per-batch cost at one increment.
        self._counted_from = (0, 0)
        self._sampler_state: Any = None  # a loaded sampler state that no sampler took (yet)
        self._rng: Any = None  # RNG states to put back after the next iter()
        self.loader = loader

    @property
    def loader(self) -> Iterable | None:
        """The wrapped loader. Setting another keeps the position: the run's data goes on from there."""
        return self._loader

    @loader.setter
    def loader(self, loader: Iterable | None) -> None:
        self._loader = loader
        try:
            self._num_batches: int | None = len(loader)  # type: ignore[arg-type]
        except TypeError:
            self._num_batches = None
        self._give_sampler_state()

    # -- the position ---------------------------------------------------------------------------
    @property
    def sample_in_epoch(self) -> int | None:
        """Samples of the epoch consumed by all ranks together: the start of the epoch's global order
        (what a ``ResumableSampler`` deals the rest from). None when unknown (no ``batch_size``)."""
        batches, samples = self._counted_from
        if self.batch_in_epoch == batches:
            return samples
        per_batch = self._samples_per_batch()
        return None if per_batch is None else samples + (self.batch_in_epoch - batches) * per_batch

    def _samples_per_batch(self) -> int | None:
        # Every batch of an epoch but its last is full, on every rank (a DistributedSampler evens
        # the ranks out), and after the last one nothing is left to skip.
        batch_size = getattr(self._loader, "batch_size", None)
        if not batch_size:
            return None
        return batch_size * getattr(getattr(self._loader, "sampler", None), "num_replicas", 1)

    def __len__(self) -> int:
        """Batches per epoch, ``subset_num_batches`` applied; TypeError when neither gives a number."""
        num, subset = self._num_batches, self.subset_num_batches
        if num is None:
            if subset is None:
                raise TypeError(
                    f"the wrapped {type(self._loader).__name__} has no len() and there is no subset_num_batches"
                )
            return subset
        return num if subset is None else min(num, subset)

    # -- iterating ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if self._loader is None:
            raise TypeError(
                "this ResumableLoader holds a loaded position but no loader: give it one (the Trainer: "
                "train_dataloader=) before iterating"
            )
        sampler: Any = getattr(self._loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        to_fetch = self._skip_in_sampler(sampler)
        iterator = iter(self._loader)
        for _ in range(to_fetch):  # a loader that cannot start mid-epoch: skip by fetching
            next(iterator, None)
        if self._rng is not None:
            # Both iter() and the fetches above drew from the RNGs that load restored; the run
            # continues from the state the uninterrupted one had at the save. Once: the next
            # epoch's iter() draws as the uninterrupted run's does.
            rng, self._rng = self._rng, None
            set_rng_state(rng)
        if self.subset_num_batches is not None:
            iterator = itertools.islice(iterator, max(0, self.subset_num_batches - self.batch_in_epoch))
        return self._count(iterator)

    def _skip_in_sampler(self, sampler: Any) -> int:
        """Start ``sampler`` after what this epoch consumed (clearing an earlier skip when nothing
        was); returns the batches left to skip by fetching."""
        samples = self.sample_in_epoch
        if hasattr(sampler, "skip_world") and samples is not None:
            # The consumed samples are always the start of the epoch's global order, whatever world
            # sizes consumed them: on this world size skip_world is each rank's own skip.
            sampler.skip_world(samples)
            return 0
        batch_size = getattr(self._loader, "batch_size", None)
        if hasattr(sampler, "skip") and batch_size:
            sampler.skip(self.batch_in_epoch * batch_size)
            return 0
        return self.batch_in_epoch

    def _count(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self.batch_in_epoch += 1  # the one per-batch cost; a state_dict() while it trains counts it
            yield batch
        self.epoch += 1
        self.batch_in_epoch = 0
        self._counted_from = (0, 0)

    def restart(self) -> None:
        """Back to the start of epoch 0, as a new run would begin (``fit(reset_time=True)``)."""
        self.epoch = self.batch_in_epoch = 0
        self._counted_from = (0, 0)
        self._rng = None

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position as plain data (loadable with ``torch.load(weights_only=True)``): ``epoch``,
        ``batch_in_epoch`` (this rank's), ``sample_in_epoch`` (all ranks', or None), ``sampler`` (its
        ``state_dict()``, or None) and ``rng`` (mid-epoch: the RNG states now, which the next
        ``iter()`` after a load puts back; else None)."""
        sampler: Any = getattr(self._loader, "sampler", None)
        sampler_state = self._sampler_state
        if sampler_state is None and hasattr(sampler, "state_dict"):
            sampler_state = sampler.state_dict()
        rng = None
        if self.batch_in_epoch:
            rng = self._rng if self._rng is not None else rng_state()
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "sample_in_epoch": self.sample_in_epoch,
            "sampler": sampler_state,
            "rng": rng,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s position with the next ``iter()``. ``sample_in_epoch``
        None counts full batches on this world size; ``rng`` None (or an epoch's start) restores no RNG."""
        unknown = set(state_dict) - set(_KEYS)
        if unknown:
            raise ValueError(f"unknown ResumableLoader state keys {sorted(unknown)}; expected {list(_KEYS)}")
        self.epoch, self.batch_in_epoch = int(state_dict["epoch"]), int(state_dict["batch_in_epoch"])
        samples = state_dict.get("sample_in_epoch")
        self._counted_from = (0, 0) if samples is None else (self.batch_in_epoch, int(samples))
        self._sampler_state = state_dict.get("sampler")
        self._give_sampler_state()
        # At an epoch's start the uninterrupted run too drew iter()'s seed after the saved RNG state.
        self._rng = state_dict.get("rng") if self.batch_in_epoch else None

    def _give_sampler_state(self) -> None:
        sampler: Any = getattr(self._loader, "sampler", None)
        if self._sampler_state is not None and hasattr(sampler, "load_state_dict"):
            sampler.load_state_dict(self._sampler_state)  # its seed: the order the saved run had
            self._sampler_state = None  # else kept, and passed on by state_dict()

    def __getattr__(self, name: str) -> Any:  # the wrapped loader's attributes: dataset, batch_size, sampler, ...
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)  # not set yet (unpickling), or private: not the wrapped loader's
        return getattr(self._loader, name)
