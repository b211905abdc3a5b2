"""Tracing a pipeline as one tensor-parallel rank sees it (pipeline x tensor parallelism).

A pipeline traces the whole model once (torch.export) before tensor parallelism splits each stage,
so the traced graph keeps the sizes the whole model had. Most of them do not change under tensor
parallelism (the residual stream, the sequence), and attention reshapes with ``-1`` heads, but
grouped-query attention repeats each key/value head with sizes read from the tensor's shape
(transformers' ``repeat_kv``: ``expand(batch, kv_heads, n_rep, seq, head_dim)``), which the trace
bakes in: after the split, a rank holding ``kv_heads / tp`` heads would have them broadcast back to
``kv_heads`` (silently wrong), or fail in the attention.

:func:`traced_as_tp_rank` makes the trace see the local sizes instead: for the trace only, each
split ``nn.Linear`` is replaced by a stand-in computing on the slice of its weight that one rank
holds (``colwise``: ``out_features / tp`` outputs; ``rowwise``: ``in_features / tp`` inputs), so
every size downstream, the repeated heads included, is a rank's. The stand-ins hold the very same
parameter objects under the same names (the traced stages own the same parameters), and the
original layers are put back in the stages before tensor parallelism splits them (``Hybrid``'s
``_restore_split_layers``), so the stand-ins never run outside the trace.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.parallel.transforms.tensor_parallel import local_linear_features, matching_modules

__all__ = ["traced_as_tp_rank"]


class _LocalLinear(nn.Module):
    """What one tensor-parallel rank computes of a Linear: the first ``in_features x out_features``
    block of its weight (only the sizes matter to the trace; the stand-in never runs for real)."""

    def __init__(self, linear: nn.Linear, in_features: int, out_features: int) -> None:
        super().__init__()
        self.original = [linear]  # a list: not a submodule, so its parameters are not listed twice
        self.in_features, self.out_features = in_features, out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight[: self.out_features, : self.in_features]
        bias = self.bias[: self.out_features] if self.bias is not None else None
        return F.linear(x, weight, bias)


@contextmanager
def traced_as_tp_rank(model: nn.Module, plan: Mapping[str, Any], tp: int) -> Iterator[None]:
    """Within the block, each Linear of ``model`` that ``plan`` splits over ``tp`` ranks computes
    what one rank will (see the module docstring); the originals are back on exit."""

    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        if tp > 1:
            for pattern, style in plan.items():
                for name in matching_modules(model, pattern):
                    module = model.get_submodule(name)
                    if not isinstance(module, nn.Linear):
                        continue
                    local = local_linear_features(module, style, tp)
                    if local is None or local == (module.in_features, module.out_features):
                        continue
                    parent_name, _, leaf = name.rpartition(".")
                    parent = model.get_submodule(parent_name) if parent_name else model
                    setattr(parent, leaf, _LocalLinear(module, *local))
                    swapped.append((parent, leaf, module))
        yield
    finally:
        for parent, leaf, module in reversed(swapped):
            setattr(parent, leaf, module)
