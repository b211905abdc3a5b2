"""``ResumableLoader``: the training data stream that knows where it is and resumes there exactly."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch.utils.data import IterableDataset

from kiln.core.warn import KilnWarning
from kiln.launch.context import context
from kiln.launch.rng import rng_state, set_rng_state

__all__ = ["ResumableLoader"]

_KEYS = ("epoch", "batch_in_epoch", "sample_in_epoch", "sampler", "rng", "stream")


class ResumableLoader:
    """The training loader of a run: it owns the epoch, the position in it and an exact resume.

    Each ``iter()`` starts the current epoch at the current position, in this order:

    1. the sampler's ``set_epoch(epoch)`` when it has one;
    2. past what the epoch already consumed: a :class:`~kiln.launch.ResumableSampler` starts after the
       consumed start of the epoch's global order (``skip_world``: on the world size that consumed it,
       each rank after its own samples; on another, the rest is dealt to the new ranks), a sampler
       with only ``skip`` after this rank's batches; a *stream* (below) loads the state it had; any
       other loader skips them by fetching, with a warning that says how much it fetches again;
    3. once, after :meth:`load_state_dict` of a mid-epoch position: the RNG states put back as they
       were when it was saved. ``iter()`` (and a skip by fetching) drew from them, and the
       uninterrupted run drew that seed at the epoch's start, before the save;
    4. ``subset_num_batches``: the epoch ends after that many batches, those consumed before included.

    The position advances as batches are yielded, the epoch when an iterator runs out, so a
    :meth:`state_dict` taken between batches is where the next ``iter()`` continues. An iterator
    left unfinished leaves its epoch unfinished: the next ``iter()`` goes on with it.

    A stream is what holds the position of data that no sampler indexes: a loader with
    ``state_dict``/``load_state_dict`` (torchdata's ``StatefulDataLoader``, which asks each worker's
    copy of an iterable dataset for its state), or, in a loader without workers, an
    ``IterableDataset`` with them (a Hugging Face streaming dataset). Mid-epoch, :meth:`state_dict`
    holds its state, asked for only then (never per batch), and a resume loads it: the stream goes
    on from the next sample, fetching nothing twice, on the world size that saved it (another
    world size cannot take a rank's stream state; it falls back to fetching, with a warning).
    The epoch is set on the dataset too when it has ``set_epoch`` and the sampler does not.

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
        self._stream_state: Any = None  # a loaded stream state, for the next iter() to load
        self._streaming = False  # whether the stream's own position is this epoch's (it was iterated here)
        self.loader = loader

    @property
    def loader(self) -> Iterable | None:
        """The wrapped loader. Setting another keeps the position: the run's data goes on from there."""
        return self._loader

    @loader.setter
    def loader(self, loader: Iterable | None) -> None:
        self._loader = loader
        self._streaming = False  # a new loader's stream is not where this epoch got to (a loaded state is)
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
        else:
            dataset = getattr(self._loader, "dataset", None)
            if isinstance(dataset, IterableDataset) and hasattr(dataset, "set_epoch"):
                dataset.set_epoch(self.epoch)  # a streaming dataset's shuffle (and state) follow it
        stream = self._stream()
        if self._resume_stream(stream):
            to_fetch = 0
        else:
            to_fetch = self._skip_in_sampler(sampler)
        self._streaming = stream is not None
        iterator = iter(self._loader)
        if to_fetch:
            self._warn_replay(to_fetch)
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

    def _stream(self) -> Any:
        """What holds this loader's position when no sampler can start mid-epoch (see the class
        docstring), or None."""
        loader = self._loader
        if hasattr(getattr(loader, "sampler", None), "skip_world"):
            return None  # kiln's own position: exact on any world size, nothing to ask the loader
        if has_state(loader):
            return loader
        dataset = getattr(loader, "dataset", None)
        if isinstance(dataset, IterableDataset) and has_state(dataset) and not getattr(loader, "num_workers", 0):
            # Without workers the DataLoader iterates this very object. With workers it iterates
            # copies, whose state only a StatefulDataLoader collects.
            return dataset
        return None

    def _resume_stream(self, stream: Any) -> bool:
        """Load the stream's state for this epoch's position; whether it continues from there."""
        state, self._stream_state = self._stream_state, None
        if stream is None or not self.batch_in_epoch:
            return False
        if state is None and self._streaming:
            # An iterator of this epoch left unfinished: a new iter() of a stateful loader would
            # start the epoch over, so the stream goes on from its own position.
            state = stream.state_dict()
        if state is None:
            return False  # a position saved without the stream's state: fetched
        stream.load_state_dict(state)
        return True

    def _warn_replay(self, num_batches: int) -> None:
        batch_size = getattr(self._loader, "batch_size", None)
        samples = f" ({num_batches * batch_size} samples)" if batch_size else ""
        dataset = getattr(self._loader, "dataset", None)
        what = type(self._loader).__name__ + (f" over {type(dataset).__name__}" if dataset is not None else "")
        if dataset is None or isinstance(dataset, IterableDataset):
            fix = (
                "give the dataset state_dict()/load_state_dict() (with num_workers > 0 also "
                "stateful_dataloader=True: torchdata's StatefulDataLoader)"
            )
        else:
            fix = "use a kiln.ResumableSampler (or a sampler with skip(n)), or torchdata's StatefulDataLoader"
        warnings.warn(
            # a resume, or a fit() that goes on with an epoch an earlier fit() left unfinished
            f"continuing epoch {self.epoch} at batch {num_batches}: the {what} cannot start mid-epoch, so it "
            f"fetches the {num_batches} batches{samples} before it again and discards them; to continue "
            f"without replay, {fix}",
            KilnWarning,
            stacklevel=3,
        )

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
        self._rng = self._stream_state = None
        self._streaming = False

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position as plain data (loadable with ``torch.load(weights_only=True)``): ``epoch``,
        ``batch_in_epoch`` (this rank's), ``sample_in_epoch`` (all ranks', or None), ``sampler`` (its
        ``state_dict()``, or None) and ``rng`` (mid-epoch: the RNG states now, which the next
        ``iter()`` after a load puts back; else None); and, mid-epoch with a stream, ``stream``:
        ``{"rank", "world_size", "state"}``, the stream's ``state_dict()`` and whose it is."""
        sampler: Any = getattr(self._loader, "sampler", None)
        sampler_state = self._sampler_state
        if sampler_state is None and hasattr(sampler, "state_dict"):
            sampler_state = sampler.state_dict()
        rng = None
        if self.batch_in_epoch:
            rng = self._rng if self._rng is not None else rng_state()
        position = {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "sample_in_epoch": self.sample_in_epoch,
            "sampler": sampler_state,
            "rng": rng,
        }
        stream_state = self._stream_state
        if stream_state is None and self.batch_in_epoch and self._streaming:
            stream = self._stream()
            stream_state = None if stream is None else stream.state_dict()
        if stream_state is not None:  # only then: a position without a stream keeps its old form
            ctx = context()
            position["stream"] = {"rank": ctx.rank, "world_size": ctx.world_size, "state": stream_state}
        return position

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
        self._stream_state, self._streaming = self._own_stream_state(state_dict.get("stream")), False

    def _own_stream_state(self, saved: Mapping[str, Any] | None) -> Any:
        """The saved stream state when it is this rank's to continue (saved by this rank of a world
        of this size)."""
        if saved is None or not self.batch_in_epoch:
            return None
        ctx = context()
        if (int(saved["rank"]), int(saved["world_size"])) != (ctx.rank, ctx.world_size):
            warnings.warn(
                f"the data stream's position was saved by rank {saved['rank']} of {saved['world_size']} and "
                f"this is rank {ctx.rank} of {ctx.world_size}: a rank's stream state cannot be dealt to "
                "another rank, so the epoch's start is fetched again; resume on the same world size (or "
                "from a checkpoint at an epoch's end) to continue the stream exactly",
                KilnWarning,
                stacklevel=3,
            )
            return None
        return saved["state"]

    def _give_sampler_state(self) -> None:
        sampler: Any = getattr(self._loader, "sampler", None)
        if self._sampler_state is not None and hasattr(sampler, "load_state_dict"):
            sampler.load_state_dict(self._sampler_state)  # its seed: the order the saved run had
            self._sampler_state = None  # else kept, and passed on by state_dict()

    def __getattr__(self, name: str) -> Any:  # the wrapped loader's attributes: dataset, batch_size, sampler, ...
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)  # not set yet (unpickling), or private: not the wrapped loader's
        return getattr(self._loader, name)


def has_state(obj: Any) -> bool:
    """Whether ``obj`` has ``state_dict``/``load_state_dict`` (torch's ``Stateful`` protocol)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
