"""A world of any size in this one process, for dry runs: torch's fake process group, and fake
tensors (a shape, a dtype and a device, no storage, no compute).

This file is the one home of the torch internals a dry run needs, each used the way torch's own
tools use it:

* ``torch.testing._internal.distributed.fake_pg`` registers the ``"fake"`` c10d backend. Its
  process group answers every collective at once and moves nothing, so rank ``r`` of a world of
  512 runs alone. torch has no public home for it; torchtitan's dry run imports it the same way.
* ``FakeTensorMode`` (``torch._subclasses``): every tensor the run makes is a fake one, as in
  :mod:`kiln.cost.activations`, so a Llama-3-8B costs no memory and its forward no compute.
* DTensor's caches of sharding decisions are cleared when a fake world begins and ends (they
  hold meshes, and one process may make several worlds, one rank after another).
* ``unset_fake_temporarily``: a ``DeviceMesh`` computes this rank's coordinates from a real tensor
  of ranks (``tolist``, ``nonzero``), which a fake tensor cannot answer. torch builds its sliced
  meshes with fake tensors switched off for this reason; here every mesh is built that way
  (``init_device_mesh``, and the ``DeviceMesh`` constructor FSDP2 calls to join the data-parallel
  and tensor-parallel meshes), and only while the fake world lasts.

Example::

    with fake_world(512, rank=0) as ctx:      # ctx: a kiln Context of rank 0 in a world of 512
        mesh = ParallelDims(dp_shard=64, tp=8).resolve(512).build_mesh("cpu")
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from kiln.launch.context import Context, context

__all__ = ["fake_world", "fake_tensor_mode", "real_tensors"]


def real_tensors() -> contextlib.AbstractContextManager[Any]:
    """Until the block ends, new tensors are real (fake ones stay fake): for code that reads the
    values of small tensors it makes, such as a mesh's ranks or DCP's shard offsets."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def _real_tensors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with :func:`real_tensors`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with real_tensors():
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _meshes_from_real_ranks() -> Iterator[None]:
    import torch.distributed.device_mesh as device_mesh

    saved = device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__
    device_mesh.init_device_mesh = _real_tensors(saved[0])
    device_mesh.DeviceMesh.__init__ = _real_tensors(saved[1])  # type: ignore[method-assign]  # same signature
    try:
        yield
    finally:
        device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__ = saved  # type: ignore[method-assign]


def _forget_meshes() -> None:
    """Drop DTensor's caches of sharding decisions (in Python and in its C++ fast path) and of
    redistribution plans. They are keyed by mesh equality (shape and names) and hold the meshes
    they were made on: a mesh of an earlier fake world, whose process groups are gone, would be
    handed to the next world's tensors. One run has one world; a dry run that visits several ranks
    makes one world after another."""
    from torch.distributed.tensor import _redistribute, debug

    debug._clear_sharding_prop_cache()  # torch's own way to clear both sharding caches
    from torch.distributed.tensor import DTensor

    cached = getattr(type(DTensor._op_dispatcher.sharding_propagator), "_propagate_tensor_meta_cached", None)
    for cache in (cached, getattr(_redistribute, "_gen_transform_infos", None)):
        clear = getattr(cache, "cache_clear", None)
        if clear is not None:
            clear()
    _redistribute.clear_redistribute_planner_cache()


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` that turns real tensors it meets into fake ones (a batch, a model's
    meta parameters moved to a device) rather than refusing them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[Context]:
    """Be rank ``rank`` of a world of ``world_size`` processes, on the CPU, with fake tensors,
    until the block ends; yields the :class:`kiln.Context` to build an Engine with.

    The default process group is torch's fake one for the block (none may exist before it); the
    current kiln context is left as it was (the block's code gets the one yielded, not
    ``kiln.context()``).

    Raises:
        RuntimeError: a process group exists already (a launched run cannot dry-run in place).
    """
    if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"fake_world(world_size={world_size!r}, rank={rank!r}): expected 0 <= rank < world_size")
    if dist.is_initialized():
        raise RuntimeError(
            "a dry run makes its own (fake) process group, but this process already has one; "
            "run the dry run in a process that was not launched (kiln plan --dry-run, not under torchrun)"
        )
    context()  # the current context is fixed now, so nothing in the block takes the fake world for it
    # importing the module registers the "fake" backend with torch.distributed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with _meshes_from_real_ranks(), fake_tensor_mode():
            yield Context(rank=rank, world_size=world_size, local_rank=0, device=torch.device("cpu"), backend="fake")
    finally:
        dist.destroy_process_group()
        _forget_meshes()
