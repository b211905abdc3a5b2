"""Expert parallelism: the experts of each MoE layer split over the ``ep`` ranks.

Two kinds of layers are split: kiln's own :class:`kiln.models.MoE` and transformers' sparse MoE
blocks with fused experts (Mixtral, Qwen2-MoE, Qwen3-MoE: one module holding ``gate_up_proj`` and
``down_proj`` for all experts; :mod:`kiln.parallel.transforms.hf_expert_parallel` knows their
layout and forward, and routes with the block's own router). Both go through the same dispatch
(:class:`ExpertParallel`), the same sharding on dim 0 and the same gradient scale.

Each rank of an expert-parallel group holds ``num_experts / ep`` consecutive experts: the layer's
grouped weights become DTensors sharded on dim 0 over the ``ep`` mesh, so a checkpoint (DCP) holds
whole ``(num_experts, ...)`` tensors and loads under any other ``ep`` (one process included).
Every rank routes its own tokens, then per layer:

1. **dispatch**: the (token, expert) pairs, already sorted by expert, go to the ranks holding
   their experts with ``all_to_all_single`` (variable splits: first the per-expert counts are
   exchanged, then the rows); the received rows are regrouped by local expert;
2. the local experts run on their rows;
3. **combine**: the rows go back in the reverse order with the reverse all-to-all; the layer
   then weights them by their routing scores and sums each token's experts, as on one process.

Both all-to-alls are differentiable (:class:`_AllToAll`: the backward is the reverse exchange).

``ep`` borrows its ranks from ``dp_shard`` (torchtitan's layout): the ranks of an expert-parallel
group read different batches and hold the same non-expert weights, FSDP-sharded over all of
``dp_shard`` as usual. Experts are FSDP-sharded over what ``dp_shard`` has left once ``ep`` took
its share, the ``efsdp = dp_shard / ep`` ranks that hold the same experts (with ``dp_replicate``
too: HSDP), which average their gradients as FSDP does. An expert's gradient on its rank already
sums over the ``ep`` ranks' batches (the all-to-all's backward brings their tokens' share), so the
experts scale their weights' gradients by ``1 / ep`` (``GroupedExperts.grad_scale``): FSDP's mean
over ``efsdp x dp_replicate`` then makes it the mean over every data-parallel rank's batch, as for
every other weight.

(FSDP's ``set_gradient_divide_factor(dp)`` would say the same, but torch 2.13 divides twice by a
custom factor when the reduce-scatter group has one rank, ``efsdp = 1``, and the gradients are
float64 or float16: the scale in the backward leaves FSDP's own averaging alone.)

Tensor parallelism splits the attention and dense layers within each ``tp`` group; the experts
are not split by ``tp``: every rank of a ``tp`` group holds the same tokens and runs the same
experts (an ``ep`` group is made of ranks with the same ``tp`` coordinate). A transformers model's
own tensor-parallel plan splits its fused experts over ``tp`` (the ``fused_experts`` style): with
``ep`` too, that is refused; a ``tp_plan`` without the experts leaves them to ``ep``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from kiln.models.moe import MoE
    from kiln.precision import Precision

__all__ = ["ExpertParallel", "check_expert_parallel", "apply_expert_parallel", "fully_shard_experts"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits whose backward is the reverse exchange.

    (``torch.distributed.nn.functional.all_to_all_single`` does the same but is deprecated in
    torch 2.13, pointing at a private module.)"""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.input_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return back, None, None, None


@dataclass
class Route:
    """How one dispatch moved the rows, for its combine."""

    order: torch.Tensor  # received rows -> rows grouped by local expert
    send_splits: list[int]  # rows this rank sent to each ep rank
    recv_splits: list[int]  # rows this rank received from each ep rank


class ExpertParallel:
    """The all-to-all dispatch of one MoE layer over an expert-parallel group (``moe.dispatcher``).

    Args:
        group: the ``ep`` process group.
        num_experts: the layer's experts (all ranks together); ``num_experts / ep`` are local.
    """

    def __init__(self, group: Any, num_experts: int) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts, self.num_local = num_experts, num_experts // self.size

    def __call__(
        self, rows: torch.Tensor, counts: torch.Tensor, experts: Callable[[torch.Tensor, list[int]], torch.Tensor]
    ) -> torch.Tensor:
        """``experts``' outputs for ``rows`` (grouped by expert, ``counts`` per expert), in ``rows``' order;
        ``experts(local_rows, local_counts)`` runs this rank's experts on the rows they received."""
        local_rows, local_counts, route = self.dispatch(rows, counts)
        return self.combine(experts(local_rows, local_counts), route)

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, list[int], Route]:
        """Send each row to the rank holding its expert; returns this rank's rows grouped by local
        expert, their count per local expert, and the route for :meth:`combine`."""
        from torch._subclasses.fake_tensor import FakeTensor

        from kiln.models.moe import split_sizes

        # received[s * num_local + j]: rows rank s sends to local expert j (equal splits)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        # all_to_all_single takes its splits as Python lists: one device-to-host copy per layer
        # (on a GPU a sync; torchtitan has the same one), for both directions at once. (Under
        # the dry run's fake tensors: a balanced exchange, as many rows back as sent.)
        host = split_sizes(torch.cat([counts, received]), 2 * len(rows))
        sent, got = host[: self.num_experts], host[self.num_experts :]
        send_splits = [sum(sent[r * self.num_local : (r + 1) * self.num_local]) for r in range(self.size)]
        recv_splits = [sum(got[r * self.num_local : (r + 1) * self.num_local]) for r in range(self.size)]
        rows = _AllToAll.apply(rows, recv_splits, send_splits, self.group)
        # rows arrive by source rank, then local expert; the experts want them by local expert,
        # then source rank (a stable sort keeps each block's order)
        repeats = torch.tensor(got, device=rows.device) if isinstance(received, FakeTensor) else received
        block = torch.repeat_interleave(
            torch.arange(len(got), device=rows.device), repeats, output_size=sum(recv_splits)
        )
        order = ((block % self.num_local) * self.size + block // self.num_local).argsort(stable=True)
        local_counts = [sum(got[j :: self.num_local]) for j in range(self.num_local)]
        return rows.index_select(0, order), local_counts, Route(order, send_splits, recv_splits)

    def combine(self, out: torch.Tensor, route: Route) -> torch.Tensor:
        """The experts' outputs back on the ranks (and in the order) the rows came from."""
        back = torch.empty_like(out).index_copy(0, route.order, out)  # undo the regrouping
        return _AllToAll.apply(back, route.send_splits, route.recv_splits, self.group)


def _moe_layers(model: nn.Module) -> Iterator[tuple[str, MoE]]:
    from kiln.models.moe import moe_layers

    return moe_layers(model)


def _fused_experts(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from kiln.parallel.transforms.hf_expert_parallel import fused_experts

    return fused_experts(model)


def _model_name(model: nn.Module) -> str:
    """The class the user built: the model a kiln wrapper holds (``HuggingFaceModel``'s
    ``MixtralForCausalLM``), else the model's own."""
    inner = getattr(model, "model", None)
    if type(model).__module__.startswith("kiln.") and isinstance(inner, nn.Module):
        return type(inner).__name__
    return type(model).__name__


def check_expert_parallel(model: nn.Module, ep: int) -> None:
    """Refuse ``ep`` that cannot split ``model``'s experts; one line naming the layer, the value
    and the fix. Runs no collective."""
    if ep <= 1:
        return
    from kiln.parallel.transforms.hf_expert_parallel import fused_experts_refusal

    layers = list(_moe_layers(model))
    fused = list(_fused_experts(model))
    if not layers and not fused:
        others = sorted(
            {type(m).__name__ for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)}
        )
        theirs = (
            f" (its mixture-of-experts blocks are {', '.join(others)}, which kiln does not split)" if others else ""
        )
        raise ValueError(
            f"ep={ep} splits the experts of kiln.models.MoE layers over ranks, and {_model_name(model)} has "
            f"none, nor transformers' fused experts (gate_up_proj and down_proj, as Mixtral's){theirs}; build the "
            "model's feed-forwards from kiln.models.MoE (kiln.models.MoELlama does), or set ep=1"
        )
    for name, layer in layers:
        if layer.num_experts % ep:
            fits = [d for d in range(1, layer.num_experts + 1) if layer.num_experts % d == 0]
            raise ValueError(
                f"ep={ep} does not divide num_experts={layer.num_experts} of MoE layer {name!r} (each rank holds "
                f"num_experts / ep whole experts); use an ep in {fits}"
            )
    for name, experts in fused:
        refusal = fused_experts_refusal(name, experts, ep)
        if refusal:
            raise ValueError(refusal)


def _shard_experts(experts: nn.Module, ep_mesh: Any) -> None:
    """Each of ``experts``' own parameters as a DTensor sharded on dim 0 (the experts) over
    ``ep_mesh``: this rank keeps its slice (on the meta device of a model whose weights are
    read later, a meta slice), nothing is sent."""
    from torch.distributed.tensor import DTensor, Shard

    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name, weight in list(experts.named_parameters(recurse=False)):
        local = weight.detach().chunk(size, dim=0)[rank].clone()
        sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))


def apply_expert_parallel(model: nn.Module, ep_mesh: Any) -> nn.Module:
    """Shard every MoE layer's experts on dim 0 over ``ep_mesh`` and install the all-to-all dispatch
    (kiln's MoE layers and transformers' fused experts alike).

    Every rank must hold the same full weights (the same seed), as for FSDP and tensor
    parallelism: each keeps its own slice, nothing is sent."""
    from torch.distributed.tensor import DTensor

    from kiln.parallel.transforms.hf_expert_parallel import parallelize_fused_experts

    size, group = ep_mesh.size(), ep_mesh.get_group()
    for _, layer in _moe_layers(model):
        _shard_experts(layer.experts, ep_mesh)
        layer.experts.grad_scale = 1.0 / size  # see the module's docstring
        layer.dispatcher = ExpertParallel(group, layer.num_experts)
    for name, experts in _fused_experts(model):
        if any(isinstance(p, DTensor) for p in experts.parameters(recurse=False)):
            # the model's own tensor-parallel plan split them (kiln's fused_experts style) first
            raise ValueError(
                f"ep={size} splits the experts {type(experts).__name__} {name!r} over ranks, and tensor parallelism "
                "split them already (the model's own tp plan, style 'fused_experts'); set ep=1 or tp=1, or pass a "
                "tp_plan without the experts"
            )
        _shard_experts(experts, ep_mesh)
        parallelize_fused_experts(experts, ExpertParallel(group, int(cast(Any, experts).num_experts)), 1.0 / size)
    return model


def fully_shard_experts(
    model: nn.Module,
    mesh: Any,
    precision: Precision,
    *,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> None:
    """``fully_shard`` every MoE layer's experts over ``mesh`` (``efsdp``, or ``dp_replicate x
    efsdp``). Applied before the blocks' ``fully_shard``, which then leaves the experts' weights alone."""
    from torch.distributed.fsdp import fully_shard

    from kiln.parallel.transforms.data_parallel import fsdp_options

    options = fsdp_options(mesh, precision, reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)
    for _, layer in _moe_layers(model):
        fully_shard(layer.experts, **options)
    for _, experts in _fused_experts(model):
        fully_shard(experts, **options)
