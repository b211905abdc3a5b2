"""Staging for background saves: each rank's tensors copied into CPU buffers kept between saves.

A background save (``save_async=True``) must first copy every tensor it writes somewhere training
cannot change it; the training thread waits for that copy, and the write runs afterwards. DCP's
default staging (its ``FileSystemWriter``) allocates a fresh, pageable CPU copy of every tensor at
every save. From a GPU that is slow twice over: each device-to-host copy into pageable memory goes
through a driver bounce buffer and blocks the host, and the fresh allocation pays its page faults
again at every save.

:class:`StagingBuffers` stages into buffers it allocates once and hands out again: pinned
(page-locked) host memory for tensors on an accelerator, so the copies queue on the device's
stream without blocking and the host waits once, for all of them; plain memory for CPU tensors.
A save's buffers go back to the pool when its background write has finished (never sooner: the
writer reads them), and the next save of the same model reuses them, matched by dtype, shape,
strides and pinning. The pool keeps the buffers of the last finished save and no more: about one
copy of this rank's model and optimizer state, in host memory, for as long as the model lives.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager
from torch.distributed.tensor import DTensor

__all__ = ["StagingBuffers", "staging_buffers_for"]

# dtype, shape, strides of the source, pinned
_Key = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], bool]


class StagingBuffers(AsyncStager):
    """A pool of host buffers that ``stage`` copies a state dict into (DCP's ``AsyncStager``).

    Args:
        pin_memory: pin the buffers of tensors on an accelerator (``None``: when CUDA is there);
            ``False`` stages into plain memory, ``True`` pins every buffer.

    Example::

        buffers = StagingBuffers()
        future = torch.distributed.checkpoint.async_save(state_dict, storage_writer=writer,
                                                         async_stager=buffers)
        buffers.release_when_done(future)   # the next stage() reuses this save's buffers
    """

    # stage() has waited for its copies when it returns: nothing for DCP to synchronise later
    _synchronize_after_execute = False

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = pin_memory
        self._lock = threading.Lock()
        self._free: dict[_Key, list[torch.Tensor]] = {}
        self._last: list[tuple[_Key, torch.Tensor]] = []
        self.num_allocated = 0
        """Buffers allocated so far; a save that reuses the pool's buffers adds none."""

    def _pinned(self, tensor: torch.Tensor) -> bool:
        if self.pin_memory is None:
            return tensor.device.type == "cuda" and torch.cuda.is_available()
        return self.pin_memory

    def stage(self, state_dict: Any) -> Any:
        """A copy of ``state_dict`` whose tensors are this pool's host buffers (containers and other
        values as they are); returns once every copy has landed."""
        taken: list[tuple[_Key, torch.Tensor]] = []
        devices: set[torch.device] = set()
        with self._lock, torch.no_grad():
            staged = self._copy(state_dict, taken, devices)
        for device in devices:  # the copies were queued without blocking: wait for them, once per device
            torch.cuda.current_stream(device).synchronize()
        self._last = taken
        return staged

    def release_when_done(self, future: Any) -> None:
        """Hand the last ``stage()``'s buffers back to the pool once ``future`` (the write that
        reads them) is done, whether it succeeded or failed."""
        taken, self._last = self._last, []
        future.add_done_callback(lambda _: self._release(taken))

    def _release(self, taken: list[tuple[_Key, torch.Tensor]]) -> None:
        free: dict[_Key, list[torch.Tensor]] = {}
        for key, buffer in taken:
            free.setdefault(key, []).append(buffer)
        with self._lock:
            # Only the last finished save's buffers stay: a tensor that is gone (a shape that
            # changed, a save that failed) does not keep its buffer alive for ever.
            self._free = free

    def synchronize_staging(self) -> None:
        return None  # stage() returns with its copies done

    def close(self) -> None:
        return None  # nothing to shut down: the buffers go with the pool

    def free_buffers(self) -> list[torch.Tensor]:
        """The buffers waiting in the pool for the next save."""
        with self._lock:
            return [buffer for buffers in self._free.values() for buffer in buffers]

    def num_free(self) -> int:
        return len(self.free_buffers())

    def _copy(self, obj: Any, taken: list[tuple[_Key, torch.Tensor]], devices: set[torch.device]) -> Any:
        if isinstance(obj, DTensor):  # its local shard into a buffer, under the same sharding spec
            local = self._copy_tensor(obj._local_tensor, taken, devices)
            return DTensor(local, obj._spec, requires_grad=False)
        if type(obj) in (torch.Tensor, nn.Parameter):
            return self._copy_tensor(obj, taken, devices)
        if isinstance(obj, torch.Tensor):  # another subclass (ShardedTensor): DCP's own copy
            return BlockingAsyncStager().stage({"tensor": obj})["tensor"]
        if isinstance(obj, dict):
            return {key: self._copy(value, taken, devices) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            values = [self._copy(value, taken, devices) for value in obj]
            return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)  # namedtuples too
        return obj  # numbers, strings, bytes: written as they are, as DCP's staging does

    def _copy_tensor(
        self, tensor: torch.Tensor, taken: list[tuple[_Key, torch.Tensor]], devices: set[torch.device]
    ) -> torch.Tensor:
        pinned = self._pinned(tensor)
        key = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), pinned)
        free = self._free.get(key)
        if free:
            buffer = free.pop()
        else:
            # empty_like keeps a dense tensor's strides (and so the bytes DCP writes); the buffer
            # holds exactly the tensor, so DCP's writer does not clone it again.
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=pinned)
            self.num_allocated += 1
        async_copy = pinned and tensor.device.type == "cuda"
        buffer.copy_(tensor.detach(), non_blocking=async_copy)
        if async_copy:
            devices.add(tensor.device)
        taken.append((key, buffer))
        return buffer


_POOLS: weakref.WeakKeyDictionary[nn.Module, StagingBuffers] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def staging_buffers_for(model: nn.Module) -> StagingBuffers:
    """The pool of ``model``'s background saves: made at its first save, gone with the model."""
    with _POOLS_LOCK:
        pool = _POOLS.get(model)
        if pool is None:
            pool = _POOLS[model] = StagingBuffers()
        return pool
