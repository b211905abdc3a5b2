"""The bytes each collective moves, counted as the collectives run (:class:`CollectiveCounter`).

Every collective torch runs goes through the dispatcher as one op, whoever calls it: FSDP2's
all-gathers and reduce-scatters (``torch.distributed``'s in-place ``c10d`` ops), DTensor's tensor
parallel redistributions (the functional ``_c10d_functional`` ops, which do not pass through the
``torch.distributed`` Python functions), a pipeline schedule's sends and receives. A
``TorchDispatchMode`` sees each of them once (inside it, the op runs with the mode off), with its
tensors and its process group, which is how torch's own ``CommDebugMode`` counts them. Under a
fake process group (:mod:`kiln.planning.fake_world`) nothing moves, but the ops and their tensors
are the same, so the count is what the real run would move.

What one call counts, per rank (the size of the collective's whole buffer, as NCCL's tests
state sizes; a ring moves (n-1)/n of it over each rank's link):

==================  =====================================================================
``all_gather``      the gathered output (n times this rank's input)
``reduce_scatter``  the input before the reduction (n times this rank's output)
``all_reduce``      the tensor reduced
``broadcast``       the tensor broadcast
``p2p``             each tensor this rank sends, plus each tensor it receives
``all_to_all``      this rank's input
==================  =====================================================================

Calls are grouped by the mesh dimension of their process group (``dp_shard``, ``tp``, ``pp``,
``dp_replicate+dp_shard`` for a group spanning two, ...), told from the group's ranks by
:func:`mesh_dimension`.

A DTensor op's own collectives, the redistributions its sharding needs (a ``Partial`` operand
summed for an op with a replicated one, loss parallelism's all-reduces over the vocabulary shards,
a norm's over the shards), run inside DTensor's ``__torch_dispatch__``. A mode runs an op with
itself off, so by default the counter sees the DTensor op and none of them: only the
redistributions tensor parallelism's styles, FSDP2 and kiln call outside any op.
``inside_dtensor=True`` hands DTensor's ops back to DTensor (``NotImplemented``, as torch's
``CommDebugMode`` does), which then runs its local ops with the counter on: each of those
collectives is counted. The modes entered after (above) the counter then see those local ops
instead of the DTensor op; the modes entered before it (below) see DTensor's ops as they did.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["KINDS", "CollectiveCounter", "mesh_dimension", "tensor_bytes"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "p2p", "all_to_all")


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (nested lists and tuples), by shape and dtype."""
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


@functools.cache
def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _ops() -> dict[Any, tuple[str, Callable[..., int], Callable[..., Any]]]:
    """op -> (kind, bytes(args, out), group(args)); the schemas are torch's (``c10d::*``, ``_c10d_functional::*``)."""
    c10d, functional = torch.ops.c10d, torch.ops._c10d_functional
    autograd = getattr(torch.ops, "_c10d_functional_autograd", None)

    def boxed(index: int) -> Callable[..., Any]:  # a c10d op's ProcessGroup script object
        return lambda args: dist.ProcessGroup.unbox(args[index])

    def named(index: int) -> Callable[..., Any]:  # a functional op's group name
        return lambda args: args[index]

    def arg(index: int) -> Callable[..., int]:
        return lambda args, out: tensor_bytes(args[index])

    def output(args: Sequence[Any], out: Any) -> int:
        return tensor_bytes(out)

    table: dict[Any, tuple[str, Callable[..., int], Callable[..., Any]]] = {
        # torch.distributed's in-place ops (FSDP2, DDP, kiln's own all-reduces, pipeline schedules)
        c10d._allgather_base_.default: ("all_gather", arg(0), boxed(2)),
        c10d.allgather_.default: ("all_gather", arg(0), boxed(2)),
        c10d.allgather_into_tensor_coalesced_.default: ("all_gather", arg(0), boxed(2)),
        c10d.allgather_coalesced_.default: ("all_gather", arg(0), boxed(2)),
        c10d._reduce_scatter_base_.default: ("reduce_scatter", arg(1), boxed(2)),
        c10d.reduce_scatter_.default: ("reduce_scatter", arg(1), boxed(2)),
        c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", arg(1), boxed(2)),
        c10d.allreduce_.default: ("all_reduce", arg(0), boxed(1)),
        c10d.allreduce_coalesced_.default: ("all_reduce", arg(0), boxed(1)),
        c10d.broadcast_.default: ("broadcast", arg(0), boxed(1)),
        c10d.send.default: ("p2p", arg(0), boxed(1)),
        c10d.recv_.default: ("p2p", arg(0), boxed(1)),
        c10d.recv_any_source_.default: ("p2p", arg(0), boxed(1)),
        c10d.alltoall_.default: ("all_to_all", arg(1), boxed(2)),
        c10d.alltoall_base_.default: ("all_to_all", arg(1), boxed(2)),
        # functional collectives (DTensor: tensor parallelism, sequence parallelism)
        functional.all_gather_into_tensor.default: ("all_gather", output, named(2)),
        functional.all_gather_into_tensor_out.default: ("all_gather", output, named(2)),
        functional.all_gather_into_tensor_coalesced.default: ("all_gather", output, named(2)),
        functional.reduce_scatter_tensor.default: ("reduce_scatter", arg(0), named(3)),
        functional.reduce_scatter_tensor_out.default: ("reduce_scatter", arg(0), named(3)),
        functional.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", arg(0), named(3)),
        functional.all_reduce.default: ("all_reduce", arg(0), named(2)),
        functional.all_reduce_.default: ("all_reduce", arg(0), named(2)),
        functional.all_reduce_coalesced.default: ("all_reduce", arg(0), named(2)),
        functional.all_reduce_coalesced_.default: ("all_reduce", arg(0), named(2)),
        functional.broadcast.default: ("broadcast", arg(0), named(2)),
        functional.broadcast_.default: ("broadcast", arg(0), named(2)),
        functional.all_to_all_single.default: ("all_to_all", arg(0), named(3)),
        functional.isend.default: ("p2p", arg(0), named(3)),
        functional.irecv.default: ("p2p", arg(0), named(3)),
        functional.batch_p2p_ops.default: ("p2p", arg(3), named(4)),
    }
    if autograd is not None:
        table[autograd.all_gather_into_tensor.default] = ("all_gather", output, named(2))
        table[autograd.reduce_scatter_tensor.default] = ("reduce_scatter", arg(0), named(3))
        table[autograd.all_to_all_single.default] = ("all_to_all", arg(0), named(3))
    return table


def mesh_dimension(ranks: Sequence[int], sizes: Mapping[str, int]) -> str:
    """The mesh dimension(s) a process group of ``ranks`` spans, on a row-major mesh of ``sizes``
    (outermost first, e.g. ``{"pp": 2, "dp_shard": 32, "tp": 8}``): the names of the dimensions
    along which its ranks' coordinates differ, joined by ``+`` (``"self"`` for a group of one)."""
    names = [name for name, size in sizes.items() if size > 1]
    shape = [sizes[name] for name in names]

    def coordinates(rank: int) -> list[int]:
        out = []
        for size in reversed(shape):
            rank, index = divmod(rank, size)
            out.append(index)
        return out[::-1]

    points = [coordinates(r) for r in ranks]
    varying = [name for i, name in enumerate(names) if len({p[i] for p in points}) > 1]
    return "+".join(varying) or "self"


class CollectiveCounter(TorchDispatchMode):
    """Counts the bytes of every collective run while it is active, by kind and mesh dimension.

    Args:
        sizes: the mesh, outermost dimension first (``{"dp_shard": 4, "tp": 2}``), to name each
            group's dimension (:func:`mesh_dimension`); None names each group by its size
            (``"group of 4"``).
        inside_dtensor: also count the collectives DTensor runs inside its ops (see the module
            docstring); enter the counter before any mode that must see DTensor's ops whole.

    ``bytes[kind][dimension]`` and ``calls[kind][dimension]`` hold the totals (kinds:
    :data:`KINDS`; see the module docstring for what one call counts).

    Example::

        with CollectiveCounter({"dp_shard": 2}) as counter:
            engine.train_step([batch], loss_of)
        counter.bytes["all_gather"]["dp_shard"]
    """

    def __init__(self, sizes: Mapping[str, int] | None = None, *, inside_dtensor: bool = False) -> None:
        super().__init__()
        self.sizes = dict(sizes) if sizes is not None else None
        self.inside_dtensor = inside_dtensor
        self.bytes: dict[str, dict[str, int]] = {}
        self.calls: dict[str, dict[str, int]] = {}
        self._ops = _ops()
        self._names: dict[str, str] = {}  # group name -> its dimension

    def dimension(self, group: Any) -> str:
        """The mesh dimension of ``group`` (a ``ProcessGroup`` or a group name)."""
        if isinstance(group, str):
            name = group
            # the functional ops' own lookup of a group by name (torch has no public one)
            group = dist.distributed_c10d._resolve_process_group(group)  # type: ignore[arg-type]  # a GroupName is a str
        else:
            name = group.group_name
        if name not in self._names:
            ranks = dist.get_process_group_ranks(group)
            if self.sizes is None:
                self._names[name] = f"group of {len(ranks)}"
            else:
                self._names[name] = mesh_dimension(ranks, self.sizes)
        return self._names[name]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.inside_dtensor and any(issubclass(t, _dtensor_type()) for t in types):
            return NotImplemented  # DTensor runs the op's local ops, its collectives too, with this mode on
        out = func(*args, **(kwargs or {}))
        entry = self._ops.get(func)
        if entry is not None:
            kind, size, group = entry
            where = self.dimension(group(args))
            self.bytes.setdefault(kind, {}).setdefault(where, 0)
            self.bytes[kind][where] += size(args, out)
            self.calls.setdefault(kind, {}).setdefault(where, 0)
            self.calls[kind][where] += 1
        return out

    def total(self, kind: str | None = None) -> int:
        """Bytes of every call (of one ``kind``)."""
        kinds = [kind] if kind is not None else list(self.bytes)
        return sum(sum(self.bytes.get(k, {}).values()) for k in kinds)
