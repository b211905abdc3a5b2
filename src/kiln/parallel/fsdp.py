"""ZeRO stages 2 and 3 with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Parameters, gradients and optimizer state are sharded over the data-parallel ranks. Each wrapped
block all-gathers its parameters just before its forward and reduce-scatters its gradients just
after its backward, so communication overlaps compute block by block. ``zero3`` frees the gathered
parameters after the forward (gathered again for the backward: least memory); ``zero2`` keeps them
until the backward (one all-gather less per step, full-size parameters during the step).
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch
from torch import nn

from kiln.parallel.grad_norm import clip_grad_norm_
from kiln.parallel.optimizer_params import parameter_names, repoint_optimizer
from kiln.parallel.strategy import Strategy

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = ["FSDP", "Zero2", "Zero3", "apply_fsdp", "wrap_targets", "mixed_precision_policy"]

WrapSpec = str | type | Iterable[str | type] | None


def mixed_precision_policy(precision: Precision):
    """FSDP2's ``MixedPrecisionPolicy`` for a kiln precision (``None``: keep the parameters' dtype).

    Under autocast precisions (amp_bf16, amp_fp16) FSDP all-gathers parameters already cast to the
    low dtype, which halves the all-gather, and reduces gradients in float32, which keeps the sum of
    many ranks' gradients exact enough. Under bf16/fp16 the parameters are stored low already.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision.autocast_dtype is not None:
        return MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)
    if precision.param_dtype is not None and precision.param_dtype != torch.float32:
        return MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=precision.param_dtype)
    return None


def _as_list(wrap: WrapSpec) -> list[str | type]:
    if wrap is None:
        return []
    if isinstance(wrap, (str, type)):
        return [wrap]
    return list(wrap)


def _default_targets(model: nn.Module) -> list[str]:
    # The repeated blocks of a model live in a ModuleList/Sequential, so their names end in an
    # index ("layers.3", "h.0", "blocks.2"); under a traced pipeline stage the class is gone but
    # the names remain. The shallowest such modules with parameters are the blocks.
    found = [(name.count("."), name) for name, m in model.named_modules()
             if name and name.rsplit(".", 1)[-1].isdigit() and any(True for _ in m.parameters())]
    if not found:
        return []
    depth = min(d for d, _ in found)
    return [name for d, name in found if d == depth]


def wrap_targets(model: nn.Module, wrap: WrapSpec = None) -> list[str]:
    """Names of the modules that get their own ``fully_shard`` (the root always gets one too).

    ``wrap`` entries are module classes, class names (``"Block"``) or name patterns
    (``"layers.*"``, fnmatch style); ``None`` picks the indexed blocks of the model (``layers.0``,
    ``layers.1``, ...). A pattern that matches nothing is an error, as a silent no-op would quietly
    leave the model unsharded.
    """
    entries = _as_list(wrap)
    if not entries:
        return _default_targets(model)
    names: list[str] = []
    for entry in entries:
        if isinstance(entry, type):
            hits = [n for n, m in model.named_modules() if n and isinstance(m, entry)]
        elif isinstance(entry, str):
            hits = [n for n, m in model.named_modules()
                    if n and (type(m).__name__ == entry or fnmatch.fnmatchcase(n, entry))]
        else:
            raise ValueError(f"FSDP wrap entry {entry!r} must be a module class, a class name or a name pattern")
        if not hits:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(f"FSDP wrap={entry!r} matches no module of the model; its module classes are "
                             f"{', '.join(classes)}; name patterns look like 'layers.*'")
        names.extend(n for n in hits if n not in names)
    return names


def apply_fsdp(model: nn.Module, mesh, precision: Precision, *, reshard_after_forward: bool = True,
               wrap: Sequence[str] = (), cpu_offload: bool = False) -> nn.Module:
    """``fully_shard`` each named block (deepest first: a wrapped block must not own its children's
    parameters), then the root, which takes whatever parameters are left."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    policy = mixed_precision_policy(precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    # Pinned host memory needs CUDA; on a CPU-only machine the offload is a plain host copy.
    kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for name in sorted(wrap, key=lambda n: -n.count(".")):
        fully_shard(model.get_submodule(name), **kwargs)
    fully_shard(model, **kwargs)
    return model


class FSDP(Strategy):
    """Fully sharded data parallel (FSDP2) over all ranks: ``zero3`` (alias ``fsdp``) by default.

    The optimizer keeps its class, param groups and hyperparameters and is pointed at the sharded
    DTensor parameters in place (build it before the Engine; it must not have stepped yet).

    Args:
        reshard_after_forward: free the gathered parameters after each block's forward (ZeRO-3,
            least memory) or keep them for the backward (ZeRO-2, one all-gather less).
        wrap: which modules get their own ``fully_shard``: classes, class names or name patterns
            (see :func:`wrap_targets`); default: the model's indexed blocks.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.

    Example::

        engine, *_ = kiln.initialize(model, opt, config={"strategy": {"name": "zero3", "wrap": ["Block"]}})
    """

    name = "fsdp"
    default_reshard = True

    def __init__(self, *, reshard_after_forward: bool | None = None, wrap: WrapSpec = None,
                 cpu_offload: bool = False) -> None:
        self.reshard_after_forward = self.default_reshard if reshard_after_forward is None else bool(reshard_after_forward)
        self.wrap = wrap
        self.cpu_offload = bool(cpu_offload)
        self.data_parallel_rank, self.data_parallel_size = 0, 1

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Context,
              precision: Precision) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        from torch.distributed.device_mesh import init_device_mesh

        targets = wrap_targets(model, self.wrap)  # user errors first, before any collective
        model.to(ctx.device)
        precision.setup_module(model)
        if ctx.world_size == 1:
            return model, optimizer  # sharding over one rank would only add hooks
        names = parameter_names(model)
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp_shard",))
        apply_fsdp(model, mesh, precision, reshard_after_forward=self.reshard_after_forward, wrap=targets,
                   cpu_offload=self.cpu_offload)
        repoint_optimizer(optimizer, names, dict(model.named_parameters()), strategy=self.name)
        self.data_parallel_rank, self.data_parallel_size = ctx.rank, ctx.world_size
        return model, optimizer

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        # Without sync FSDP keeps each block's unsharded gradient and reduce-scatters the sum on the
        # synchronising backward: accumulation costs memory, not communication.
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "reshard_after_forward": self.reshard_after_forward,
                "wrap": [w if isinstance(w, str) else w.__name__ for w in _as_list(self.wrap)],
                "cpu_offload": self.cpu_offload}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reshard_after_forward={self.reshard_after_forward}, cpu_offload={self.cpu_offload})"


class Zero2(FSDP):
    """FSDP2 keeping gathered parameters from forward to backward (``strategy="zero2"``)."""

    name = "zero2"
    default_reshard = False


class Zero3(FSDP):
    """FSDP2 freeing gathered parameters after each forward (``strategy="zero3"``)."""

    name = "zero3"
    default_reshard = True
