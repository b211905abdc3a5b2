"""A small Llama-style decoder whose feed-forward layers are mixtures of experts (:mod:`kiln.models.moe`).

Pre-norm blocks of grouped-query attention with rotary positions and a feed-forward that is a
:class:`kiln.models.moe.MoE` (the first ``num_dense_layers`` blocks keep a dense SwiGLU, as
DeepSeek-V3's do). The model is a :class:`kiln.Model`: batches are ``{"input_ids": ...,
"labels": ...}`` dicts (``labels`` default to the inputs) or a tensor of token ids; the loss is the
next-token cross-entropy plus the MoE layers' auxiliary losses; its evaluation metric is
:class:`kiln.models.LanguagePerplexity`.

It builds from keyword arguments, so a YAML file names it like the LM example's model::

    model:
      type: kiln.models.MoELlama
      args: {vocab_size: 256, dim: 128, num_layers: 4, num_heads: 4, num_experts: 8, top_k: 2}

``tp_plan`` splits the attention and the dense and shared feed-forwards over a tensor-parallel
mesh; the routed experts are split by expert parallelism instead (``Hybrid(ep=...)``).
``sequence_parallel_plan`` adds sequence and loss parallelism to it (tensor parallelism's default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.model import Model
from kiln.models.moe import FeedForward, MoE, aux_loss
from kiln.models.tp_plan import full_logits, token_mean_cross_entropy

__all__ = ["MoELlamaConfig", "MoELlama"]


@dataclass(frozen=True, kw_only=True)
class MoELlamaConfig:
    """The sizes of a :class:`MoELlama`.

    The fields ``num_experts``, ``top_k``, ``score_func``, ``route_norm``, ``route_scale``,
    ``num_shared_experts``, ``load_balance``, ``aux_loss_coef``, ``bias_update_rate`` and
    ``capacity_factor`` are the options of every MoE layer (see :class:`kiln.models.moe.MoE`).

    Args:
        vocab_size / dim / num_layers / num_heads: the decoder's sizes.
        num_kv_heads: key/value heads (grouped-query attention); None: ``num_heads``.
        max_seq_len: the longest sequence (rotary tables are built for it).
        dense_hidden_dim: the dense layers' feed-forward width (None: ``4 * dim``).
        num_dense_layers: the first blocks keep a dense feed-forward.
        moe_hidden_dim: each expert's hidden width (None: ``2 * dim``).
    """

    vocab_size: int = 256
    dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dense_hidden_dim: int | None = None
    num_dense_layers: int = 0
    moe_hidden_dim: int | None = None
    num_experts: int = 8
    top_k: int = 2
    score_func: str = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    num_shared_experts: int = 0
    load_balance: str | None = "aux_loss"
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 1e-3
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoELlama {name}={value!r} must be an integer >= 1")
        kv = self.kv_heads
        if self.dim % self.num_heads or self.num_heads % kv:
            raise ValueError(
                f"MoELlama num_heads={self.num_heads} must divide dim={self.dim} and be a multiple of "
                f"num_kv_heads={kv}; pick sizes where dim % num_heads == 0 and num_heads % num_kv_heads == 0"
            )
        if (self.dim // self.num_heads) % 2:
            raise ValueError(
                f"MoELlama dim / num_heads = {self.dim // self.num_heads} must be even (rotary embeddings "
                "rotate pairs); change dim or num_heads"
            )
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(
                f"MoELlama num_dense_layers={self.num_dense_layers!r} must be from 0 to num_layers={self.num_layers}"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions. Head counts are read from the
    projections' outputs, so under tensor parallelism each rank runs its own heads."""

    def __init__(self, config: MoELlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.dim // config.num_heads
        self.wq = nn.Linear(config.dim, config.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.num_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for p in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if k.shape[1] != q.shape[1]:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, config: MoELlamaConfig, dense: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward: nn.Module
        if dense:
            self.feed_forward = FeedForward(config.dim, config.dense_hidden_dim or 4 * config.dim)
        else:
            self.feed_forward = MoE(
                config.dim,
                config.moe_hidden_dim or 2 * config.dim,
                config.num_experts,
                config.top_k,
                score_func=config.score_func,
                route_norm=config.route_norm,
                route_scale=config.route_scale,
                num_shared_experts=config.num_shared_experts,
                load_balance=config.load_balance,
                aux_loss_coef=config.aux_loss_coef,
                bias_update_rate=config.bias_update_rate,
                capacity_factor=config.capacity_factor,
            )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class MoELlama(Model):
    """A Llama-style mixture-of-experts decoder (see the module's docstring).

    Args:
        config: a :class:`MoELlamaConfig` or a dict of its fields; or give the fields as keywords.

    Example::

        model = kiln.models.MoELlama(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_experts=4)
        trainer = kiln.Trainer(model, train_dataloader=loader, max_duration="10ba",
                               optimizers=torch.optim.AdamW(model.parameters()),
                               callbacks=[kiln.callbacks.MoEMonitor()])
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: MoELlamaConfig | Mapping[str, Any] | None = None, **fields: Any) -> None:
        super().__init__()
        if isinstance(config, MoELlamaConfig):
            config = dataclasses.replace(config, **fields) if fields else config
        else:
            known = {f.name for f in dataclasses.fields(MoELlamaConfig)}
            values = {**(config or {}), **fields}
            unknown = sorted(set(values) - known)
            if unknown:
                raise TypeError(f"MoELlama got unknown config fields {unknown}; its fields are {sorted(known)}")
            config = MoELlamaConfig(**values)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i < config.num_dense_layers) for i in range(config.num_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        head_dim = config.dim // config.num_heads
        inv = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64), inv).repeat(1, 2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.tp_plan = {
            "layers.*.attention.wq": "colwise",
            "layers.*.attention.wk": "colwise",
            "layers.*.attention.wv": "colwise",
            "layers.*.attention.wo": "rowwise",
        }
        for i in range(config.num_layers):
            ffn = "feed_forward" if i < config.num_dense_layers else "feed_forward.shared_experts"
            if i < config.num_dense_layers or config.num_shared_experts:
                self.tp_plan.update({f"layers.{i}.{ffn}.w1": "colwise", f"layers.{i}.{ffn}.w3": "colwise"})
                self.tp_plan[f"layers.{i}.{ffn}.w2"] = "rowwise"

    def sequence_parallel_plan(self, *, loss_parallel: bool) -> dict[str, Any]:
        """``tp_plan`` with sequence parallelism (torchtitan's Llama plan), what ``TensorParallel()``
        and ``Hybrid(tp=N)`` use by default (:mod:`kiln.parallel.transforms.sequence_parallel`).

        The embedding is split over the vocabulary and its output reduce-scattered to slices of the
        sequence (``Shard(1)``); the residual stream and the norms stay sequence-sharded DTensors.
        Each attention and dense feed-forward all-gathers the sequence, runs its column-wise
        projections on its own heads or hidden units, and reduce-scatters the row-wise output back
        to the shards; the rotary ``cos``/``sin`` are passed to the attention as they are (whole
        sequence, like the gathered queries and keys). A MoE feed-forward takes the gathered
        sequence and runs whole on every rank (its routed experts are not split by tensor
        parallelism; its shared experts are, as in ``tp_plan``); its output is cut back to the
        rank's slice. The last norm is sequence-sharded; the output layer gathers the sequence and
        is split over the vocabulary: with ``loss_parallel`` its logits stay sharded there
        (:func:`kiln.models.tp_plan.token_mean_cross_entropy` takes them), else they are gathered.
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleInputOutput,
            RowwiseParallel,
            SequenceParallel,
        )

        def reduce_scatter() -> RowwiseParallel:
            return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)

        gather: dict[str, Any] = {
            "input_layouts": (Shard(1),),
            "desired_input_layouts": (Replicate(),),
            "use_local_input": True,
        }
        plan: dict[str, Any] = {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.attention": PrepareModuleInput(  # a DTensor into wq/wk/wv: one reduce-scatter back
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=False,
            ),
            "layers.*.attention.wq": ColwiseParallel(),
            "layers.*.attention.wk": ColwiseParallel(),
            "layers.*.attention.wv": ColwiseParallel(),
            "layers.*.attention.wo": reduce_scatter(),
            "layers.*.ffn_norm": SequenceParallel(),
        }
        for i in range(self.config.num_layers):
            ffn = f"layers.{i}.feed_forward"
            if i < self.config.num_dense_layers:
                plan[ffn] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
                )
                plan.update(
                    {f"{ffn}.w1": ColwiseParallel(), f"{ffn}.w3": ColwiseParallel(), f"{ffn}.w2": reduce_scatter()}
                )
                continue
            # the whole MoE on the gathered sequence; its output (the same on every rank) cut to the slice
            plan[ffn] = PrepareModuleInputOutput(
                **gather, output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=False
            )
            if self.config.num_shared_experts:
                shared = f"{ffn}.shared_experts"
                plan.update({f"{shared}.w1": "colwise", f"{shared}.w3": "colwise", f"{shared}.w2": "rowwise"})
        plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
        return plan

    def forward(self, batch: Any) -> torch.Tensor:  # noqa: D102
        tokens = _input_ids(batch)
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"MoELlama got sequences of {seq} tokens, more than max_seq_len={self.config.max_seq_len}; "
                "raise max_seq_len or shorten the sequences"
            )
        x = self.embed(tokens)
        positions = batch.get("position_ids") if isinstance(batch, Mapping) else None
        if positions is None:
            cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        else:  # a slice of longer sequences (context parallelism): its tokens' own positions
            cos, sin = self.cos[positions].unsqueeze(1).to(x.dtype), self.sin[positions].unsqueeze(1).to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        """Next-token cross-entropy plus the MoE layers' auxiliary losses (``load_balance="aux_loss"``).
        A batch's ``shift_labels`` (labels already moved one to the left, as context parallelism
        gives them) are taken as they are, against every position."""
        if isinstance(batch, Mapping) and "shift_labels" in batch:
            logits, target = outputs, batch["shift_labels"]
        else:
            logits, target = outputs[:, :-1], _labels(batch)[:, 1:]
        # logits sharded over the vocabulary (loss parallelism) are never gathered for the loss
        ce = token_mean_cross_entropy(logits, target)
        return ce + aux_loss(self) if self.training else ce

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        from kiln.models.perplexity import LanguagePerplexity  # torchmetrics loads when a metric is made

        return {"LanguagePerplexity": LanguagePerplexity()}

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        # under loss parallelism the metric takes the whole logits: gathered here, and only here
        metric.update(full_logits(outputs)[:, :-1], _labels(batch)[:, 1:])


def _input_ids(batch: Any) -> torch.Tensor:
    if isinstance(batch, Mapping):
        return batch["input_ids"]
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return batch


def _labels(batch: Any) -> torch.Tensor:
    if isinstance(batch, Mapping):
        return batch.get("labels", batch["input_ids"])
    if isinstance(batch, (tuple, list)):
        return batch[1] if len(batch) > 1 else batch[0]
    return batch
