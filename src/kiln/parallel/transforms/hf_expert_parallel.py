"""Expert parallelism of transformers' fused mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE).

transformers 5 keeps a sparse MoE block's experts as one module (``MixtralExperts``,
``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ...) with two 3-D parameters, ``gate_up_proj``
``(experts, 2 * intermediate, hidden)`` and ``down_proj`` ``(experts, hidden, intermediate)``, and
calls it as ``experts(hidden_states, top_k_index, top_k_weights)`` once the block's own router has
chosen each token's experts and weights. Expert parallelism leaves the block and its router
alone (the same top-k, the same softmax and normalisation, in transformers' own code: one
process's routing) and replaces that call (:func:`parallelize_fused_experts`):

1. the (token, expert) pairs are sorted by expert, stably, so each expert's rows are one block;
2. the rows go to the ranks holding their experts and back with kiln's all-to-all dispatch
   (the ``dispatcher``, :class:`kiln.parallel.transforms.expert_parallel.ExpertParallel`, which
   also serves kiln's own :class:`kiln.models.MoE`); in between, each rank runs its local experts
   (the block of ``gate_up_proj``/``down_proj`` it holds, sharded on dim 0 over ``ep``) with the
   module's own gate function (``_apply_gate``: ``act_fn(gate) * up``);
3. each pair's output is weighted by its routing weight and summed into its token, as
   transformers' eager forward does (the product in the weights' dtype promotion, the sum cast
   back to the hidden states' dtype).

The experts' weight gradients are scaled by ``1 / ep`` in the backward, for the reason
:mod:`kiln.parallel.transforms.expert_parallel` gives for kiln's MoE (the same
:class:`kiln.models.moe._ScaleGrad`). An expert with no rows still runs, on 0 rows, so every
rank's local experts and received rows join the backward: the reverse all-to-alls run on every
rank alike, and FSDP's reduce-scatter gets a gradient from each.

This file knows transformers' layout only; which modules to split and the mesh are
:mod:`kiln.parallel.transforms.expert_parallel`'s, which calls :func:`fused_experts` and
:func:`parallelize_fused_experts` (so neither file imports the other back).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models.moe import _ScaleGrad  # the one home of the 1/ep scale in the backward
from kiln.parallel.transforms.fused_experts import is_fused_experts

__all__ = ["fused_experts", "fused_experts_refusal", "parallelize_fused_experts"]

# what carries the rows to the ranks holding their experts and back:
# dispatcher(rows, counts, local_experts) -> the local experts' outputs, in rows' order
Dispatcher = Callable[[torch.Tensor, torch.Tensor, Callable[[torch.Tensor, list[int]], torch.Tensor]], torch.Tensor]


def fused_experts(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, experts module)`` of every transformers fused-experts module in ``model``: exactly
    3-D ``gate_up_proj`` and ``down_proj`` parameters, a ``num_experts`` count and transformers'
    experts interface (``_apply_gate``, which ``use_experts_implementation`` gives the class)."""
    for name, module in model.named_modules():
        if is_fused_experts(module) and isinstance(getattr(module, "num_experts", None), int):
            if callable(getattr(module, "_apply_gate", None)):
                yield name, module


def fused_experts_refusal(name: str, module: Any, ep: int) -> str | None:
    """Why ``ep`` cannot split ``module`` (named ``name``) in one line, or None: the experts must
    divide by ``ep``, and be laid out as this file reads them (not transposed, no norm after them)."""
    num_experts = int(module.num_experts)
    if num_experts % ep:
        fits = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        return (
            f"ep={ep} does not divide num_experts={num_experts} of {type(module).__name__} {name!r} (each rank "
            f"holds num_experts / ep whole experts); use an ep in {fits}"
        )
    unread = [flag for flag in ("is_transposed", "has_post_expert_norm") if getattr(module, flag, False)]
    gate_up, down = (getattr(module, n) for n in ("gate_up_proj", "down_proj"))
    if unread or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        what = ", ".join(f"{flag}=True" for flag in unread) or (
            f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)}"
        )
        return (
            f"ep={ep}: the experts {type(module).__name__} {name!r} are laid out as kiln's expert parallelism does "
            f"not read ({what}; it reads gate_up_proj (experts, 2 * intermediate, hidden) and down_proj "
            "(experts, hidden, intermediate)); set ep=1"
        )
    return None


def parallelize_fused_experts(module: Any, dispatcher: Dispatcher, grad_scale: float) -> None:
    """Route ``module``'s calls through ``dispatcher``: ``module``'s weights are already DTensors
    sharded on dim 0 over the ``ep`` mesh (this rank's experts); its forward becomes the
    dispatch, the local experts and the combine (the module docstring). ``grad_scale``
    multiplies the weights' gradients (``1 / ep``)."""
    module.expert_dispatcher = dispatcher
    module.grad_scale = grad_scale
    # an instance attribute: this module only (FSDP's hooks, on the module's call, still run around it)
    module.forward = types.MethodType(_forward, module)


def _forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    top_k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    # (not bincount: its output's length depends on the values, which the dry run's fake tensors lack)
    counts = torch.zeros(int(self.num_experts), dtype=torch.long, device=flat.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat))
    order = flat.argsort(stable=True)  # each expert's pairs in token order, as transformers visits them
    token_of = order // top_k
    rows = tokens.index_select(0, token_of)
    out = self.expert_dispatcher(rows, counts, functools.partial(_local_experts, self))
    # transformers: expert output * top_k_weights[token, k] (promoted: the router's float32 weights
    # times float64 rows stay float64), summed per token in the hidden states' dtype
    out = out * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    summed = torch.zeros_like(tokens).index_add(0, token_of, out.to(tokens.dtype))
    # not a view when the shapes agree (transformers passes (tokens, hidden)): FSDP hooks the output
    # for the backward, and warns that an in-place op on a view would lose its hook
    return summed if summed.shape == hidden_states.shape else summed.reshape(hidden_states.shape)


def _local_experts(module: Any, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """This rank's experts on ``rows``, grouped by local expert (``counts`` rows each)."""
    gate_up, down = module.gate_up_proj.to_local(), module.down_proj.to_local()
    if module.grad_scale != 1.0:
        gate_up, down = (_ScaleGrad.apply(w, module.grad_scale) for w in (gate_up, down))
    if len(counts) != gate_up.shape[0]:
        raise ValueError(f"{type(module).__name__} got rows for {len(counts)} experts but holds {gate_up.shape[0]}")
    outs = [
        F.linear(module._apply_gate(F.linear(block, gate_up[e])), down[e])
        for e, block in enumerate(torch.split(rows, counts))
    ]
    return torch.cat(outs)
