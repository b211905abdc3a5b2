"""The data-parallel transformation: FSDP2's ``fully_shard`` with kiln's settings (the
``data_parallel`` step of ``zero2``, ``zero3``/``fsdp`` and ``hybrid``, and of the experts' own mesh
under expert parallelism)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from kiln.precision import Precision

__all__ = ["apply_fsdp", "fsdp_options", "mixed_precision_policy"]


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


def fsdp_options(
    mesh, precision: Precision, *, reshard_after_forward: bool = True, cpu_offload: bool = False
) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments for kiln's settings (every ``fully_shard`` kiln applies)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    policy = mixed_precision_policy(precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    # Pinned host memory needs CUDA; on a CPU-only machine the offload is a plain host copy.
    kwargs["offload_policy"] = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    )
    return kwargs


def apply_fsdp(
    model: nn.Module,
    mesh,
    precision: Precision,
    *,
    reshard_after_forward: bool = True,
    wrap: Sequence[str] = (),
    cpu_offload: bool = False,
) -> nn.Module:
    """``fully_shard`` each named block (deepest first: a wrapped block must not own its children's
    parameters), then the root, which takes whatever parameters are left."""
    from torch.distributed.fsdp import fully_shard

    kwargs = fsdp_options(mesh, precision, reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)
    for name in sorted(wrap, key=lambda n: -n.count(".")):
        fully_shard(model.get_submodule(name), **kwargs)
    fully_shard(model, **kwargs)
    return model
