"""A mixture-of-experts feed-forward block: token-choice top-k routing over grouped experts.

:class:`MoE` replaces a transformer block's feed-forward layer. Each token's router scores pick
its ``top_k`` experts; the token goes to each of them and comes back weighted by its score:

1. **route** (:class:`Router`): ``scores = softmax(gate(x))`` (Mixtral, Qwen3-MoE) or
   ``sigmoid(gate(x))`` (DeepSeek-V3, Llama 4); the top ``top_k`` experts of each token, chosen
   on ``scores + expert_bias`` when balancing by bias, weighted by their ``scores`` (renormalised
   to sum to 1 with ``route_norm``, times ``route_scale``);
2. **dispatch**: the (token, expert) pairs sorted by expert, so each expert's tokens are one
   contiguous block (under expert parallelism: sent to the rank that holds the expert with an
   all-to-all, :mod:`kiln.parallel.transforms.expert_parallel`);
3. **experts** (:class:`GroupedExperts`): one SwiGLU feed-forward per expert, kept as one weight
   per projection for all experts, ``w1``/``w3`` of shape ``(num_experts, dim, hidden_dim)``
   and ``w2`` of ``(num_experts, hidden_dim, dim)`` (what expert parallelism shards on dim 0);
4. **combine**: the outputs back in token order (the reverse all-to-all), times the routing
   weights, summed over each token's experts; plus the shared experts' output, which every token
   gets (``num_shared_experts``, DeepSeek-V3 / Qwen's shared expert).

Load balancing (``load_balance``):

* ``"aux_loss"`` (default): DeepSeek-V3's sequence-wise auxiliary loss
  ``aux_loss_coef * mean_over_sequences(sum_i f_i * P_i)``, where ``f_i`` is the share of the
  sequence's routed slots that expert ``i`` received, times ``num_experts / top_k`` (1 when
  balanced) and ``P_i`` its mean normalised score. Kept in ``module.aux_loss`` after each
  training forward; :func:`aux_loss` sums them over a model, for the model's ``loss`` to add.
  It is a mean over sequences, so data and expert parallelism give one process's value.
* ``"bias"``: DeepSeek-V3's auxiliary-loss-free balancing. A per-expert ``expert_bias`` is added
  to the scores for the choice of experts only (never to the weights); after each optimizer
  step :func:`update_expert_bias` moves it by ``bias_update_rate`` towards balance:
  ``+rate`` for experts that got fewer tokens than the mean, ``-rate`` for more, counting the
  tokens of every data-parallel rank. :class:`kiln.callbacks.MoEMonitor` calls it in the Trainer.
* ``None``: no balancing.

Capacity (``capacity_factor``): ``None`` (default) is dropless: every expert takes every token
routed to it. A factor ``c`` caps each expert at ``ceil(c * tokens * top_k / num_experts)``
(token, expert) pairs of the tokens this rank routes, keeping the earliest; the dropped pairs
contribute nothing (the token keeps its residual and the shared experts). The cap applies to
each rank's own tokens before dispatch, so with a factor set, a data- or expert-parallel run
drops other pairs than one process would (dropless runs are equal).

Router statistics: every training forward adds its tokens per expert to counters on the device
(no host read); :func:`router_stats` reads and clears them (``moe/tokens_per_expert/<i>``,
``moe/imbalance``: the largest layer's busiest expert over its mean, 1.0 when balanced,
``moe/dropped_tokens`` with a capacity). :class:`kiln.callbacks.MoEMonitor` logs them.

Example::

    moe = MoE(dim=64, hidden_dim=128, num_experts=8, top_k=2)
    y = moe(torch.randn(4, 16, 64))                 # (batch, seq, dim) -> same shape
    loss = y.square().mean() + kiln.models.moe.aux_loss(moe)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SCORE_FUNCS",
    "LOAD_BALANCE",
    "FeedForward",
    "GroupedExperts",
    "Router",
    "MoE",
    "moe_layers",
    "aux_loss",
    "update_expert_bias",
    "router_stats",
    "split_sizes",
]

SCORE_FUNCS = ("softmax", "sigmoid")
LOAD_BALANCE = ("aux_loss", "bias", None)
# A bias-balanced layer warns once when this many training forwards pass without a bias update.
_STALE_BIAS_FORWARDS = 200


class Dispatcher(Protocol):
    """What carries a MoE layer's routed tokens to its experts and back (expert parallelism's
    :class:`kiln.parallel.transforms.expert_parallel.ExpertParallel`); without one, the experts are all local."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor: ...


class FeedForward(nn.Module):
    """SwiGLU feed-forward ``w2(silu(w1(x)) * w3(x))``: a dense layer, or the shared experts."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU feed-forwards, one weight per projection for all of them.

    ``forward(rows, counts)`` takes the rows grouped by expert: the first ``counts[0]`` rows go to
    expert 0, the next ``counts[1]`` to expert 1, and so on. Under expert parallelism the weights
    are DTensors sharded on dim 0 (this rank's experts); the forward runs on the local shard.

    The experts run one after another, a matmul pair each. ``torch._grouped_mm`` does all of them
    in one kernel on CUDA, but on CPU (torch 2.13) it refuses float64 and its backward fails
    ("Invalid strides/sizes"), and a loop over the few experts a rank holds costs little on a CPU.
    An expert with no rows still runs (on 0 rows), so every weight gets a gradient, zeros included,
    on every rank: FSDP's reduce-scatter needs all ranks to bring one.

    ``grad_scale`` multiplies the weights' gradients (not the rows'): expert parallelism sets it to
    ``1 / ep`` (see :mod:`kiln.parallel.transforms.expert_parallel`).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.grad_scale = 1.0
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default, per expert: uniform in +-1/sqrt(fan_in)
        for weight, fan_in in ((self.w1, self.dim), (self.w2, self.hidden_dim), (self.w3, self.dim)):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        if self.grad_scale != 1.0:
            w1, w2, w3 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        if len(counts) != w1.shape[0]:
            raise ValueError(f"GroupedExperts got counts for {len(counts)} experts but holds {w1.shape[0]}")
        outs = []
        for e, block in enumerate(torch.split(rows, counts)):
            outs.append((F.silu(block @ w1[e]) * (block @ w3[e])) @ w2[e])
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}"


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _local(weight: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


class Router(nn.Module):
    """Token-choice top-k routing: ``(weights, experts, scores)`` for ``(tokens, dim)`` rows.

    ``weights`` and ``experts`` are ``(tokens, top_k)``; ``scores`` ``(tokens, num_experts)``. Scores
    are computed in at least float32 (softmax over bf16 logits loses the small ones).
    """

    expert_bias: torch.Tensor

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.gate = nn.Linear(dim, num_experts, bias=False)
        if bias:  # kept in checkpoints: the balance it reached is part of the run's state
            self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias.to(scores.dtype) if hasattr(self, "expert_bias") else scores
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, experts, scores


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer (see the module's docstring for the algorithm).

    Args:
        dim: model width (input and output features).
        hidden_dim: each routed expert's hidden width.
        num_experts: routed experts.
        top_k: experts per token.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        route_norm: renormalise each token's ``top_k`` weights to sum to 1 (Mixtral, Qwen3-MoE,
            DeepSeek-V3 do; with ``top_k=1`` the router then learns from the aux loss only).
        route_scale: factor on the routing weights (DeepSeek-V3: 2.5).
        num_shared_experts: experts every token goes through (one SwiGLU of
            ``num_shared_experts * hidden_dim``), added to the routed output.
        load_balance: ``"aux_loss"``, ``"bias"`` (auxiliary-loss-free) or ``None``.
        aux_loss_coef: the auxiliary loss's factor (``load_balance="aux_loss"``).
        bias_update_rate: the bias step per optimizer step (``load_balance="bias"``).
        capacity_factor: ``None`` (dropless) or the factor over an even share each expert takes.

    Example::

        moe = MoE(dim=64, hidden_dim=128, num_experts=8, top_k=2, score_func="sigmoid",
                  route_norm=True, num_shared_experts=1, load_balance="bias")
    """

    tokens_per_expert: torch.Tensor
    window_tokens: torch.Tensor
    window_dropped: torch.Tensor

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int = 8,
        top_k: int = 2,
        *,
        score_func: str = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        num_shared_experts: int = 0,
        load_balance: str | None = "aux_loss",
        aux_loss_coef: float = 0.01,
        bias_update_rate: float = 1e-3,
        capacity_factor: float | None = None,
    ) -> None:
        super().__init__()
        _check_options(
            num_experts=num_experts,
            top_k=top_k,
            score_func=score_func,
            num_shared_experts=num_shared_experts,
            load_balance=load_balance,
            capacity_factor=capacity_factor,
        )
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.load_balance, self.aux_loss_coef = load_balance, aux_loss_coef
        self.bias_update_rate, self.capacity_factor = bias_update_rate, capacity_factor
        self.router = Router(
            dim,
            num_experts,
            top_k,
            score_func=score_func,
            route_norm=route_norm,
            route_scale=route_scale,
            bias=load_balance == "bias",
        )
        self.experts = GroupedExperts(num_experts, dim, hidden_dim)
        self.shared_experts = FeedForward(dim, hidden_dim * num_shared_experts) if num_shared_experts else None
        # Counters on the device, never read in the step: this optimizer step's tokens (for the
        # bias update) and the logging window's (for router_stats). Not in checkpoints: both are
        # cleared by the step / the log line that reads them.
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("window_tokens", torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("window_dropped", torch.zeros((), dtype=torch.long), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        # Set by expert parallelism (kiln.parallel.transforms.expert_parallel): the all-to-all dispatch. None: local.
        self.dispatcher: Dispatcher | None = None
        self._forwards_since_update = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts, scores = self.router(tokens)
        flat = experts.reshape(-1)
        # (not bincount: its output's length depends on the values, which fake tensors do not have)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))
        # stable: each expert's (token, expert) pairs stay in token order (the capacity keeps the first)
        order = flat.argsort(stable=True)
        if self.capacity_factor is not None:
            order, counts = self._within_capacity(order, counts, len(tokens))
        self._count(counts, flat.numel())
        rows = tokens.index_select(0, order // self.top_k)
        if self.dispatcher is None:
            out = self.experts(rows, split_sizes(counts, len(rows)))  # one host read per layer
        else:
            out = self.dispatcher(rows, counts, self.experts)
        out = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype)
        y = torch.zeros((len(tokens), shape[-1]), dtype=out.dtype, device=out.device)
        y = y.index_add(0, order // self.top_k, out)
        if self.shared_experts is not None:
            y = y + self.shared_experts(tokens)
        if self.training and self.load_balance == "aux_loss":
            sequences = shape[0] if len(shape) > 2 else 1
            self.aux_loss = self.aux_loss_coef * _sequence_aux_loss(scores, experts, sequences)
        return y.reshape(*shape[:-1], y.shape[-1])

    def _within_capacity(
        self, order: torch.Tensor, counts: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.capacity_factor is not None
        capacity = math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
        # position of each sorted pair within its expert's block
        starts = torch.cumsum(counts, 0) - counts
        expert_of = torch.repeat_interleave(torch.arange(self.num_experts, device=counts.device), counts)
        position = torch.arange(order.numel(), device=order.device) - starts[expert_of]
        return order[position < capacity], counts.clamp(max=capacity)

    def _count(self, counts: torch.Tensor, routed: int) -> None:
        # Only training forwards count, and not activation checkpointing's recomputation of one in
        # the backward (it would count the batch twice): autograd's current graph task is -1
        # outside a backward.
        if not self.training or torch._C._current_graph_task_id() != -1:
            return
        with torch.no_grad():
            self.window_tokens += counts
            if self.capacity_factor is not None:
                self.window_dropped += routed - counts.sum()
            if self.load_balance == "bias":
                self.tokens_per_expert += counts
                self._forwards_since_update += 1
                if self._forwards_since_update == _STALE_BIAS_FORWARDS:
                    warnings.warn(
                        f"MoE load_balance='bias': the expert bias has not been updated in "
                        f"{_STALE_BIAS_FORWARDS} training forwards; add kiln.callbacks.MoEMonitor() to the "
                        "Trainer's callbacks, or call kiln.models.moe.update_expert_bias(model) after each "
                        "optimizer step",
                        stacklevel=3,
                    )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, load_balance={self.load_balance!r}, "
            f"capacity_factor={self.capacity_factor}"
        )


def split_sizes(counts: torch.Tensor, total: int) -> list[int]:
    """``counts.tolist()``: the rows per expert (or rank) that ``torch.split`` and the all-to-alls
    take as Python ints. Under fake tensors (kiln's dry run), which have shapes but no values, the
    even split of ``total`` rows instead: a balanced step's shapes, memory and bytes moved."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(counts, FakeTensor):
        base, extra = divmod(total, counts.numel())
        return [base + (i < extra) for i in range(counts.numel())]
    return counts.tolist()


def _check_options(**options: Any) -> None:
    num_experts, top_k = options["num_experts"], options["top_k"]
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"MoE num_experts={num_experts!r} must be an integer >= 1")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"MoE top_k={top_k!r} must be an integer from 1 to num_experts={num_experts}")
    if options["score_func"] not in SCORE_FUNCS:
        raise ValueError(f"MoE score_func={options['score_func']!r} must be one of {', '.join(SCORE_FUNCS)}")
    if options["load_balance"] not in LOAD_BALANCE:
        raise ValueError(
            f"MoE load_balance={options['load_balance']!r} must be 'aux_loss', 'bias' (auxiliary-loss-free) or None"
        )
    shared = options["num_shared_experts"]
    if not isinstance(shared, int) or shared < 0:
        raise ValueError(f"MoE num_shared_experts={shared!r} must be an integer >= 0")
    factor = options["capacity_factor"]
    if factor is not None and not (isinstance(factor, (int, float)) and factor > 0):
        raise ValueError(f"MoE capacity_factor={factor!r} must be a positive number, or None for dropless routing")


def _sequence_aux_loss(scores: torch.Tensor, experts: torch.Tensor, sequences: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss without its factor: mean over sequences of
    ``sum_i f_i * P_i`` (both per sequence; ``f_i`` is 1 for every expert when balanced)."""
    num_experts = scores.shape[-1]
    probs = scores / scores.sum(-1, keepdim=True)  # sigmoid scores do not sum to 1
    probs = probs.reshape(sequences, -1, num_experts)
    picks = experts.reshape(sequences, -1)
    hits = torch.zeros(sequences, num_experts, dtype=probs.dtype, device=probs.device)
    hits.scatter_add_(1, picks, torch.ones_like(picks, dtype=probs.dtype))
    f = hits * (num_experts / picks.shape[1])  # picks.shape[1] = tokens * top_k of one sequence
    return (f * probs.mean(1)).sum(-1).mean()


# -- over a whole model ------------------------------------------------------------------------------
def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoE]]:
    """``(name, layer)`` of every :class:`MoE` in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            yield name, module


def aux_loss(model: nn.Module) -> torch.Tensor | float:
    """The sum of the auxiliary losses of ``model``'s MoE layers from their last training forward
    (0.0 when none has one): add it to the training loss."""
    losses = [m.aux_loss for _, m in moe_layers(model) if m.aux_loss is not None]
    if not losses:
        return 0.0
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total


@torch.no_grad()
def update_expert_bias(model: nn.Module) -> None:
    """DeepSeek-V3's bias step for every ``load_balance="bias"`` layer of ``model``; call it after
    each optimizer step (:class:`kiln.callbacks.MoEMonitor` does in the Trainer).

    Each layer's bias moves by ``bias_update_rate * sign(mean - tokens_i)`` (``tokens_i``: what
    expert ``i`` got this step, summed over the ranks with one all-reduce for all layers), then is
    centred (its mean subtracted), and the step's counters are cleared. Every rank must call it
    (not under pipeline parallelism, whose stages hold different layers).
    """
    import torch.distributed as dist

    layers = [m for _, m in moe_layers(model) if m.load_balance == "bias"]
    if not layers:
        return
    counts = torch.cat([m.tokens_per_expert for m in layers]).to(torch.float64)
    # Summed over the whole world: ranks that hold the same batch (tensor parallel) add the same
    # counts, which scales every expert's count alike and leaves the signs below unchanged.
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    for layer, tokens in zip(layers, counts.split([m.num_experts for m in layers])):
        step = layer.bias_update_rate * torch.sign(tokens.mean() - tokens)
        bias = layer.router.expert_bias
        bias += step.to(bias.dtype)
        bias -= bias.mean()
        layer.tokens_per_expert.zero_()
        layer._forwards_since_update = 0


@torch.no_grad()
def router_stats(model: nn.Module, *, reset: bool = True) -> dict[str, torch.Tensor]:
    """This rank's routing since the last call, as metrics (tensors on the device: the logger
    reads them once). Empty when no MoE layer has routed a token.

    * ``moe/tokens_per_expert/<i>``: (token, expert) pairs expert ``i`` got, summed over layers;
    * ``moe/imbalance``: the largest over layers of (busiest expert's pairs / mean pairs);
    * ``moe/imbalance/<layer>``: the same for each layer;
    * ``moe/dropped_tokens``: the share of pairs over capacity (layers with a ``capacity_factor``).
    """
    layers = list(moe_layers(model))
    if not layers:
        return {}
    metrics: dict[str, torch.Tensor] = {}
    width = max(m.num_experts for _, m in layers)
    total = torch.zeros(width, dtype=torch.long, device=layers[0][1].window_tokens.device)
    imbalances = []
    dropped = routed = None
    for name, layer in layers:
        counts = layer.window_tokens
        total[: layer.num_experts] += counts
        ratio = counts.max().double() / counts.double().mean().clamp(min=1e-12)
        if name:  # a model's layer (a bare MoE has no name)
            metrics[f"moe/imbalance/{name}"] = ratio
        imbalances.append(ratio)
        if layer.capacity_factor is not None:
            dropped = layer.window_dropped.clone() if dropped is None else dropped + layer.window_dropped
            sent = counts.sum() + layer.window_dropped
            routed = sent if routed is None else routed + sent
    for i, value in enumerate(total.unbind()):
        metrics[f"moe/tokens_per_expert/{i}"] = value
    metrics["moe/imbalance"] = torch.stack(imbalances).max()
    if dropped is not None and routed is not None:
        metrics["moe/dropped_tokens"] = dropped.double() / routed.double().clamp(min=1)
    if reset:
        for _, layer in layers:
            layer.window_tokens.zero_()
            layer.window_dropped.zero_()
    return metrics
