"""Parallel dimensions, validated against the world size before any process group is touched.

The mesh dimensions are, outermost first, ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``
(torchtitan's order). Ranks that differ only in the innermost dimension are neighbours
(consecutive ranks, usually one node), so tensor parallelism, which communicates every layer,
gets the fastest links and pipeline parallelism, which sends one activation per microbatch, the
slowest.

Expert parallelism (``ep``) is no dimension of its own: it borrows its ranks from ``dp_shard``
(torchtitan's layout), which :func:`ep_meshes` splits into ``(efsdp, ep)``, ``ep`` inner: an
expert-parallel group is ``ep`` neighbouring data-parallel ranks, whose all-to-all every MoE layer
runs twice per forward.

Context parallelism (``cp``, :mod:`kiln.parallel.context`) is a dimension of its own, inside the
data-parallel ones and outside ``tp``: its ranks read the same batch, each keeping a slice of every
sequence, and pass keys and values around a ring in every attention layer. FSDP shards the
parameters over ``dp_shard x cp`` together (one flattened dimension, ``dp_shard_cp``), so the
``cp`` ranks' gradients are averaged as the data-parallel ranks' are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ParallelDims", "dp_mesh", "tp_mesh", "ep_meshes", "cp_mesh", "dp_coordinate"]

_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the four parallel dimensions; ``dp_shard=-1`` takes what the others leave.

    Args:
        pp: pipeline stages.
        dp_replicate: data-parallel replicas (HSDP's replicate dimension; gradients all-reduced).
        dp_shard: data-parallel shards (FSDP; parameters, gradients and optimizer state sharded).
        tp: tensor-parallel ranks.
        ep: expert-parallel ranks, taken from ``dp_shard`` (which it must divide): MoE experts
            are split over them (:mod:`kiln.parallel.transforms.expert_parallel`).
        cp: context-parallel ranks: each sequence split over them (:mod:`kiln.parallel.context`).

    Example::

        dims = ParallelDims(dp_shard=-1, tp=2).resolve(world_size=8)   # dp_shard=4
        mesh = dims.build_mesh("cuda")
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in (*_DIMS, "ep"):
            value = getattr(self, name)
            fill = name == "dp_shard" and value == -1
            if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and not fill):
                allowed = "an integer >= 1, or -1 to fill the world" if name == "dp_shard" else "an integer >= 1"
                raise ValueError(f"parallel dimension {name}={value!r} must be {allowed}")

    def _text(self) -> str:
        return ", ".join(
            f"{name}={getattr(self, name)}"
            for name in (*_DIMS, "ep")
            if name not in ("ep", "cp") or getattr(self, name) > 1
        )

    def _product(self, leave_out: str = "") -> str:
        # the sizes that multiply to the world, as the user sets them (cp named only when used)
        return "*".join(n for n in _DIMS if n != leave_out and (n != "cp" or self.cp > 1))

    def resolve(self, world_size: int) -> ParallelDims:
        """These sizes with ``dp_shard=-1`` filled in; a clear error when they do not fit ``world_size``."""
        others = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if world_size % others:
                raise ValueError(
                    f"parallel sizes ({self._text()}) do not divide the world of {world_size} processes: "
                    f"{self._product('dp_shard')} = {others} must divide {world_size}; pick sizes whose product "
                    f"divides {world_size}, or launch a multiple of {others} processes"
                )
            return ParallelDims(
                pp=self.pp,
                dp_replicate=self.dp_replicate,
                dp_shard=world_size // others,
                tp=self.tp,
                ep=self.ep,
                cp=self.cp,
            )._check_ep()
        product = others * self.dp_shard
        if product != world_size:
            raise ValueError(
                f"parallel sizes ({self._text()}) multiply to {product} but the world has {world_size} "
                f"processes; make {self._product()} equal {world_size}, or set dp_shard=-1 "
                "to let it take the rest"
            )
        return self._check_ep()

    def _check_ep(self) -> ParallelDims:
        if self.dp_shard % self.ep:
            fits = [d for d in range(1, self.dp_shard + 1) if self.dp_shard % d == 0]
            raise ValueError(
                f"parallel dimension ep={self.ep} must divide dp_shard={self.dp_shard} ({self._text()}): "
                f"expert parallelism takes its ranks from dp_shard; use an ep in {fits}, or a dp_shard "
                f"that is a multiple of {self.ep}"
            )
        return self

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Sizes and names of the mesh: dimensions of size 1 are left out (they would only cost a
        process group each), except ``dp_shard`` next to ``dp_replicate``: FSDP2's HSDP needs both."""
        if self.dp_shard == -1:
            raise ValueError("call resolve(world_size) before building a mesh: dp_shard is still -1")
        keep = [name for name in _DIMS if getattr(self, name) > 1]
        if self.dp_replicate > 1 and "dp_shard" not in keep:
            keep.insert(keep.index("dp_replicate") + 1, "dp_shard")
        return tuple(getattr(self, name) for name in keep), tuple(keep)

    def build_mesh(self, device_type: str):
        """The ``DeviceMesh`` (``None`` when every dimension is 1)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.mesh_shape()
        if not shape:
            return None
        return init_device_mesh(device_type, shape, mesh_dim_names=names)


def dp_mesh(mesh, dims: ParallelDims):
    """The sub-mesh FSDP shards over: 2-D (replicate, shard) for HSDP, 1-D for FSDP, None without DP.
    With ``cp``, the shard dimension is ``dp_shard x cp`` flattened (``dp_shard_cp``)."""
    if mesh is None:
        return None
    if dims.cp > 1:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        names = tuple(n for n in ("dp_shard", "cp") if n in mesh.mesh_dim_names)
        # A mesh computes its ranks from a tensor's values, which the dry run's fake tensors lack.
        with unset_fake_temporarily():
            shard = mesh[names]._flatten("dp_shard_cp") if len(names) > 1 else mesh["cp"]
            return mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else shard
    if dims.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    if dims.dp_shard > 1:
        return mesh["dp_shard"]
    return None


def tp_mesh(mesh, dims: ParallelDims):
    """The sub-mesh tensor parallelism splits layers over (None without TP)."""
    if mesh is None or dims.tp == 1:
        return None
    return mesh["tp"]


def cp_mesh(mesh, dims: ParallelDims):
    """The sub-mesh context parallelism splits sequences over (None without CP)."""
    if mesh is None or dims.cp == 1:
        return None
    return mesh["cp"]


def ep_meshes(mesh, dims: ParallelDims) -> tuple[Any, Any]:
    """``(ep mesh, experts' FSDP mesh)``: ``dp_shard`` split into ``(efsdp, ep)``; the experts are
    sharded over ``ep`` and FSDP-sharded over ``efsdp`` (with ``dp_replicate``: HSDP over
    ``(dp_replicate, efsdp)``). ``(None, None)`` without expert parallelism."""
    if mesh is None or dims.ep == 1:
        return None, None
    # _unflatten makes the two sub-meshes (and their groups) on the same root mesh, which FSDP
    # needs to shard the experts' ep DTensors again over efsdp (as for tp x dp_shard).
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # A mesh computes its ranks from a tensor's values, which the dry run's fake tensors lack;
    # torch builds its own sliced meshes with fake tensors off too (a no-op outside a dry run).
    with unset_fake_temporarily():
        split = mesh._unflatten("dp_shard", (dims.dp_shard // dims.ep, dims.ep), ("efsdp", "ep"))
    experts_dp = split["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else split["efsdp"]
    return split["ep"], experts_dp


def dp_coordinate(mesh, dims: ParallelDims) -> int:
    """This rank's index among the data-parallel ranks (which batch it reads)."""
    if mesh is None or dims.dp == 1:
        return 0
    names = mesh.mesh_dim_names
    replicate = mesh.get_local_rank("dp_replicate") if "dp_replicate" in names else 0
    shard = mesh.get_local_rank("dp_shard") if "dp_shard" in names else 0
    return replicate * dims.dp_shard + shard
