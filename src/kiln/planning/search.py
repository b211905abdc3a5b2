"""``kiln plan --search``: every (dp_shard, tp, pp, activation checkpointing, microbatch) plan of a
transformer on a world of devices, the infeasible ones dropped, the rest ranked by a cost model.

The plans are what kiln's ``hybrid`` strategy runs on the mesh ``(pp, dp_shard, tp)``, outermost
first: tensor parallelism with the model's own plan (a Hugging Face model's ``base_model_tp_plan``:
attention and MLP Linears split, embeddings and LM head whole), FSDP2 over ``dp_shard``, a pipeline
of ``pp`` stages (1F1B) cut at block boundaries. Everything is analytic (a plan costs microseconds
to price); ``kiln plan --dry-run`` of a plan's overrides runs the real code to confirm it.

Memory per rank, in bytes (``pb``/``gb``: parameter and reduced-gradient bytes per element, ``cb``
the compute dtype's, ``rb`` the residual stream's; ``S``: the parameters of the largest pipeline
stage, with the attention and MLP Linears divided by ``tp``):

* parameters ``S/dp x pb``, gradients ``S/dp x gb``, optimizer ``k x S/dp x pb`` (AdamW: k = 2);
* FSDP's gathered blocks: two blocks (one running, one prefetched) in ``cb``;
* activations of one microbatch of ``t`` tokens per layer, without checkpointing, what a Hugging
  Face Llama block saves for its backward under autocast (counted op by op: ``amp`` is 1 under
  ``amp_*``, 0 else): ``t x (h(4 rb + 5 cb amp) + (q(4 cb + 2 rb + 3 cb amp) + kv(3 cb + rb) + 4 cb
  ffn) / tp)``: the two norms' inputs and outputs and the bf16 casts of q/k/v's and gate/up's
  input; q, k, v, their rotary halves and embeddings (fp32: the rotary tables are), the repeated
  keys and values, attention's bf16 inputs and output; the MLP's gate, activation, up and product.
  With every block checkpointed: ``t x h x rb`` per block plus one block recomputed. The first stage
  of a 1F1B pipeline holds ``min(pp, microbatches)`` microbatches; the last stage holds the logits
  of one microbatch, ``t x vocab x 10`` bytes (bf16 logits, their fp32 copy and fp32 log-softmax),
  and under ``amp_*`` in a pipeline ``t x vocab x 4`` more (the stage's output cast back to fp32).
  Against kiln's dry run of Llama-3-8B (8192 tokens a microbatch, amp_bf16), estimated / measured:
  89.1 / 100.3 GiB without checkpointing (FSDP 8), 14.9 / 16.1 GiB with it (FSDP 64 x TP 8), 16.8 /
  19.1 GiB on the last stage of FSDP 32 x TP 8 x PP 2: 7 to 12% under.

Cost of one optimizer step, in seconds: ``compute + communication + bubble``.

* compute: the stage's FLOPs (``(6 + 2 if checkpointed) x`` parameters per token, the attention's
  ``12 x layers x seq x heads x head_dim``, the LM head whole on each tensor-parallel rank) over
  ``bf16_flops x COMPUTE_EFFICIENCY`` of :mod:`kiln.cost.devices`;
* communication, each collective's bytes over the bandwidth of the link its mesh dimension crosses
  (inside a node when the dimension's group fits in ``devices_per_node``, else the network), as a
  ring moves them: all-gather and reduce-scatter ``(n-1)/n x bytes``, all-reduce twice that,
  point-to-point the bytes. FSDP gathers a stage's parameters in ``cb`` twice per microbatch (forward,
  backward; ``microbatches + 1`` times in a pipeline, as kiln's dry run measures) and reduce-scatters
  its gradients once per step; tensor parallelism with sequence and loss parallelism (the default
  where kiln has the model's plan: Llama, Mistral, Qwen2 without a pipeline) gathers and
  reduce-scatters ``t x h x cb`` bytes, each block 4 and 4 times per microbatch (6 and 5 with
  checkpointing), plus 2 for the embedding and the head, and all-reduces ``t x cb`` per token in
  the loss (2 per block and 1); its parameters, norms, residual stream and logits are divided by
  ``tp`` (the embedding and the head split over the vocabulary). Without it, tensor parallelism
  all-reduces ``t x h x cb`` bytes 7 times per layer and microbatch (2 forward; 5 backward: q, k,
  v, gate and up each all-reduce their input's gradient), 8 with checkpointing (as the dry run
  counts them; tests/test_search_vs_dry_run.py holds the two to each other); a pipeline
  sends each microbatch's activations and receives their gradients. Nothing is assumed overlapped;
* bubble: ``(pp - 1) / microbatches`` of the compute (1F1B).

Infeasible: ``tp`` not dividing the attention or key/value heads, ``pp`` above the layers (or, for a
Hugging Face Llama, above 2: kiln refuses its rotary embeddings as a skip connection across 3+
stages), a global batch that does not split over the data-parallel ranks, fewer pipeline
microbatches than stages, memory over the budget.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from kiln.cost.devices import COMPUTE_EFFICIENCY, DeviceClass

__all__ = [
    "ModelShape",
    "SearchPlan",
    "SearchResult",
    "search",
    "precision_bytes",
    "parse_bytes",
    "format_plans",
]

_GiB = 1024**3
# (parameter, reduced gradient, compute, residual stream) bytes per element, by kiln precision name
_PRECISION_BYTES = {
    "amp_bf16": (4, 4, 2, 4),
    "amp_fp16": (4, 4, 2, 4),
    "bf16": (2, 2, 2, 2),
    "fp16": (2, 2, 2, 2),
    "fp32": (4, 4, 4, 4),
}
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1024, "mib": 1024**2, "gib": _GiB, "tib": 1024**4})
_LOGITS_BYTES_PER_VOCAB = 10  # bf16 logits + their fp32 copy + fp32 log-softmax, per token and vocabulary entry


def precision_bytes(precision: str | None) -> tuple[int, int, int, int]:
    """(parameter, gradient, compute, residual) bytes per element of a kiln precision name."""
    name = precision or "fp32"
    if name not in _PRECISION_BYTES:
        raise ValueError(f"precision={name!r} cannot be planned; expected one of {', '.join(_PRECISION_BYTES)}")
    return _PRECISION_BYTES[name]


def parse_bytes(text: str | float | int) -> int:
    """``"80GiB"``, ``"141GB"``, ``"512MiB"`` or a number of bytes -> bytes."""
    match = re.fullmatch(r"([0-9.eE+]+)\s*([kKmMgGtT]i?[bB]|[bB])?", str(text).strip())
    value = None
    if match:
        try:
            value = float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()]
        except ValueError:
            value = None
    if value is None or value <= 0:
        raise ValueError(f"--memory {text!r} is not a size above 0; expected bytes or e.g. 80GiB, 141GB")
    return int(value)


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a decoder-only transformer."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    num_parameters: int
    layer_params: int  # one block
    tied: bool = False
    huggingface: bool = False
    blocks: tuple[str, ...] = ()  # module names of the blocks (pipeline split points)
    sequence_parallel: bool = False  # kiln has a sequence-parallel plan for it (tp > 1 uses it, without pp)

    @property
    def layer_split_params(self) -> int:
        """Parameters of a block that tensor parallelism splits (attention and MLP Linears)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.ffn

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    @classmethod
    def from_model(cls, model: nn.Module) -> ModelShape:
        """The shape of ``model`` (meta-device parameters count too): a transformer with a Hugging
        Face-style config (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ...)."""
        from kiln.parallel.transforms.parallelize import find_blocks

        config: Any = next(
            (
                getattr(m, "config")  # noqa: B009  # typed Any: a Hugging Face config, not a submodule
                for m in model.modules()
                if all(hasattr(getattr(m, "config", None), k) for k in ("num_hidden_layers", "hidden_size"))
            ),
            None,
        )
        if config is None:
            raise ValueError(
                f"kiln plan --search plans transformers: {type(model).__name__} has no Hugging Face-style config "
                "(num_hidden_layers, hidden_size, num_attention_heads, intermediate_size, vocab_size); use "
                "kiln plan without --search for its memory per strategy"
            )
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        blocks = tuple(find_blocks(model))
        num_parameters = sum(p.numel() for p in model.parameters())
        layer = sum(p.numel() for p in model.get_submodule(blocks[0]).parameters()) if blocks else 0
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden=hidden,
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            ffn=int(config.intermediate_size),
            vocab=int(config.vocab_size),
            num_parameters=num_parameters,
            layer_params=layer,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            huggingface=callable(getattr(config, "to_dict", None)),
            blocks=blocks,
            sequence_parallel=_has_sequence_parallel_plan(model),
        )


def _has_sequence_parallel_plan(model: nn.Module) -> bool:
    # what Hybrid(tp=N) turns on by default: sequence parallelism and, with untied embeddings, loss
    # parallelism (kiln.parallel.transforms.sequence_parallel); kiln.models.tp_plan knows the families
    from kiln.models.tp_plan import huggingface_sequence_parallel_refusal, tied_embeddings

    return huggingface_sequence_parallel_refusal(model) is None and not tied_embeddings(model)


@dataclass
class SearchPlan:
    """One plan and its price (bytes per rank of its largest stage, seconds per optimizer step)."""

    dp_shard: int
    tp: int
    pp: int
    activation_checkpointing: str | None
    micro_batch_size: int  # sequences per forward (a pipeline microbatch)
    microbatches: int  # per step and rank: accumulation steps, or the pipeline's microbatches
    memory: dict[str, int] = field(default_factory=dict)
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    tokens_per_second: float = 0.0  # per device
    split_points: list[str] = field(default_factory=list)
    reason: str = ""  # why it is infeasible ("" when it is not)

    @property
    def label(self) -> str:
        ac = "ckpt" if self.activation_checkpointing else "-"
        return f"{self.dp_shard}x{self.tp}x{self.pp} {ac} mb{self.micro_batch_size}x{self.microbatches}"

    def overrides(self) -> list[str]:
        """The dotted overrides of a run file for this plan (for ``kiln plan --dry-run`` or ``kiln train``)."""
        out = ["--compute_config.dp_shard", str(self.dp_shard), "--compute_config.tp", str(self.tp)]
        out += ["--compute_config.pp", str(self.pp)]
        if self.pp > 1:
            options = {"split_points": self.split_points, "microbatches": self.microbatches}
            out += ["--compute_config.strategy_options", repr(options)]
            out += ["--micro_batch_size", str(self.micro_batch_size * self.microbatches)]
            out += ["--grad_accumulation_steps", "1"]
        else:
            out += ["--micro_batch_size", str(self.micro_batch_size)]
            out += ["--grad_accumulation_steps", str(self.microbatches)]
        out += ["--activation_checkpointing", self.activation_checkpointing or "null"]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "dp_shard": self.dp_shard,
            "tp": self.tp,
            "pp": self.pp,
            "activation_checkpointing": self.activation_checkpointing,
            "micro_batch_size": self.micro_batch_size,
            "microbatches": self.microbatches,
            "memory": dict(self.memory),
            "collectives": {k: dict(v) for k, v in self.collectives.items()},
            "seconds": dict(self.seconds),
            "tokens_per_second_per_device": self.tokens_per_second,
            "overrides": self.overrides(),
        }


@dataclass
class SearchResult:
    """The feasible plans, cheapest first, and how many of the others fell for each reason."""

    plans: list[SearchPlan]
    infeasible: dict[str, int]
    searched: int
    device: DeviceClass
    world_size: int
    budget: int | None
    global_batch: int
    seq_len: int
    precision: str
    shape: ModelShape

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        d = self.device
        return {
            "world_size": self.world_size,
            "device": d.name,
            "constants": {
                "bf16_flops": d.bf16_flops,
                "compute_efficiency": COMPUTE_EFFICIENCY,
                "memory": d.memory,
                "intra_node_bw": d.intra_node_bw,
                "inter_node_bw": d.inter_node_bw,
                "devices_per_node": d.devices_per_node,
            },
            "budget": self.budget,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "precision": self.precision,
            "model": {
                "num_parameters": self.shape.num_parameters,
                "num_layers": self.shape.num_layers,
                "hidden": self.shape.hidden,
                "heads": self.shape.heads,
                "kv_heads": self.shape.kv_heads,
                "vocab": self.shape.vocab,
            },
            "searched": self.searched,
            "feasible": len(self.plans),
            "infeasible": dict(self.infeasible),
            "plans": [p.to_dict() for p in self.plans[:top]],
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mesh_bandwidth(device: DeviceClass, sizes: dict[str, int], devices_per_node: int) -> dict[str, float]:
    # mesh (pp, dp_shard, tp), outermost first: a dimension's group spans its size times the inner sizes
    bandwidth, inner = {}, 1
    for dim in ("tp", "dp_shard", "pp"):
        span = sizes[dim] * inner
        inside = span <= devices_per_node and devices_per_node % span == 0
        bandwidth[dim] = device.intra_node_bw if inside else device.inter_node_bw
        inner = span
    return bandwidth


def _price(
    shape: ModelShape,
    plan: SearchPlan,
    device: DeviceClass,
    world_size: int,
    global_batch: int,
    seq_len: int,
    precision: str,
    optimizer_factor: int,
    devices_per_node: int,
) -> None:
    pb, gb, cb, rb = precision_bytes(precision)
    dp, tp, pp, m = plan.dp_shard, plan.tp, plan.pp, plan.microbatches
    # sequence and loss parallelism: on with tp > 1 where kiln has the model's plan, not with a pipeline
    sp = shape.sequence_parallel and tp > 1 and pp == 1
    layers = math.ceil(shape.num_layers / pp)
    layer_tp = shape.layer_params - shape.layer_split_params + shape.layer_split_params // tp
    norm = shape.hidden
    embed, head = (shape.embed_params // tp, shape.head_params // tp) if sp else (shape.embed_params, shape.head_params)
    first = layers * layer_tp + embed + (head + norm if pp == 1 else 0)
    last = layers * layer_tp + head + norm + (embed if pp == 1 else 0)
    shard = math.ceil(max(first, last) / dp)
    params, grads, optimizer = shard * pb, shard * gb, optimizer_factor * shard * pb
    gathered = 2 * layer_tp * cb if dp > 1 else 0

    t = plan.micro_batch_size * seq_len  # tokens of one microbatch
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    amp = 1 if precision.startswith("amp") else 0
    full_width = shape.hidden * (4 * rb + 5 * cb * amp)
    split = q * (4 * cb + 2 * rb + 3 * cb * amp) + kv * (3 * cb + rb) + 4 * cb * shape.ffn
    # with sequence parallelism the norms and the residual stream hold a sequence shard
    per_layer = t * (full_width // (tp if sp else 1) + split // tp)
    ckpt = plan.activation_checkpointing is not None
    kept = t * shape.hidden * rb // (tp if sp else 1) if ckpt else per_layer
    recompute = per_layer if ckpt else 0
    inflight = min(pp, m) if pp > 1 else 1
    logits = t * shape.vocab * _LOGITS_BYTES_PER_VOCAB // (tp if sp else 1)  # loss parallel: a vocabulary shard
    act_first = inflight * layers * kept + recompute + (logits if pp == 1 else 0)
    if pp > 1 and amp:
        # the last stage's output, bf16 logits under autocast, cast back to the traced fp32 for the loss
        # (kiln.parallel.pipelining.boundary): one more copy
        logits += t * shape.vocab * rb
    act_last = layers * kept + recompute + logits
    activations = max(act_first, act_last) + gathered
    plan.memory = {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "activations": activations,
        "total": params + grads + optimizer + activations,
    }

    # compute: FLOPs of the stage on this rank's tokens
    tokens = global_batch * seq_len // dp
    fwd_per_token = 2 * layers * layer_tp + 4 * layers * seq_len * q // tp
    # the LM head: whole on each tensor-parallel rank, or its vocabulary shard with loss parallelism
    fwd_per_token += 2 * shape.vocab * shape.hidden // (tp if sp else 1)
    flops = (3 + (1 if ckpt else 0)) * fwd_per_token * tokens
    compute = flops / (device.bf16_flops * COMPUTE_EFFICIENCY)
    bubble = compute * (pp - 1) / m if pp > 1 else 0.0

    sizes = {"pp": pp, "dp_shard": dp, "tp": tp}
    bw = _mesh_bandwidth(device, sizes, devices_per_node)
    collectives: dict[str, dict[str, int]] = {}
    comm = 0.0
    stage = max(first, last)
    if dp > 1:
        gathers = m + 1 if pp > 1 else 2 * m
        ag, rs = gathers * stage * cb, stage * gb
        collectives["all_gather"] = {"dp_shard": ag}
        collectives["reduce_scatter"] = {"dp_shard": rs}
        comm += (dp - 1) / dp * (ag + rs) / bw["dp_shard"]
    if tp > 1 and sp:
        # each block gathers the sequence before its attention and its MLP and reduce-scatters after
        # them, in the forward and (their transposes) in the backward, and again in a checkpointed
        # block's recomputation (which stops before its last reduce-scatter); the embedding
        # reduce-scatters, the head gathers. The loss's all-reduces are per token (as kiln's dry run
        # counts them: 2 per block and 1, each of t compute-dtype values).
        per_call = t * shape.hidden * cb
        gathers, scatters = (6, 5) if ckpt else (4, 4)
        ag, rs = (gathers * layers + 2) * m * per_call, (scatters * layers + 2) * m * per_call
        ar = (2 * layers + 1) * m * t * cb
        collectives["all_gather"] = {**collectives.get("all_gather", {}), "tp": ag}
        collectives["reduce_scatter"] = {**collectives.get("reduce_scatter", {}), "tp": rs}
        collectives["all_reduce"] = {"tp": ar}
        comm += (tp - 1) / tp * (ag + rs + 2 * ar) / bw["tp"]
    elif tp > 1:
        per_call = t * shape.hidden * cb
        ar = (8 if ckpt else 7) * layers * m * per_call
        collectives["all_reduce"] = {"tp": ar}
        comm += 2 * (tp - 1) / tp * ar / bw["tp"]
    if pp > 1:
        p2p = 2 * m * t * shape.hidden * cb
        collectives["p2p"] = {"pp": p2p}
        comm += p2p / bw["pp"]
    plan.collectives = collectives
    total = compute + comm + bubble
    plan.seconds = {"compute": compute, "communication": comm, "bubble": bubble, "total": total}
    plan.tokens_per_second = global_batch * seq_len / world_size / total


def _split_points(shape: ModelShape, pp: int) -> list[str]:
    if pp == 1 or len(shape.blocks) < pp:
        return []
    per = math.ceil(len(shape.blocks) / pp)
    return [shape.blocks[i * per] for i in range(1, pp)]


def search(
    shape: ModelShape,
    world_size: int,
    device: DeviceClass,
    *,
    budget: int | None,
    global_batch: int,
    seq_len: int,
    precision: str = "amp_bf16",
    optimizer_factor: int = 2,
    devices_per_node: int | None = None,
) -> SearchResult:
    """Every plan of ``shape`` on ``world_size`` devices of class ``device``, priced (module docstring).

    Args:
        budget: bytes per rank (None: the device's memory; unknown for ``cpu``: every plan fits).
        global_batch: sequences per optimizer step over all ranks.
        seq_len: tokens per sequence.
        precision: kiln's precision name (``amp_bf16``: fp32 parameters, bf16 compute).
        optimizer_factor: optimizer state tensors per parameter (AdamW: 2).
        devices_per_node: devices sharing the fast links (default: the device class's).

    Example::

        result = search(ModelShape.from_model(model), 8, device_class("h100"), budget=None,
                        global_batch=16, seq_len=8192)
        best = result.plans[0]
    """
    if world_size < 1:
        raise ValueError(f"--world-size={world_size} must be >= 1")
    if global_batch < 1 or seq_len < 1:
        raise ValueError(f"global batch {global_batch} and sequence length {seq_len} must be >= 1")
    precision_bytes(precision)
    per_node = devices_per_node or device.devices_per_node
    limit = budget if budget is not None else device.memory
    plans: list[SearchPlan] = []
    infeasible: dict[str, int] = {}
    searched = 0

    def drop(reason: str, count: int = 1) -> None:
        infeasible[reason] = infeasible.get(reason, 0) + count

    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            reason = None
            if shape.heads % tp or shape.kv_heads % tp:
                reason = "tp does not divide the attention heads or key/value heads"
            elif pp > shape.num_layers:
                reason = "pp above the number of layers (a stage without layers)"
            elif shape.huggingface and pp > 2:
                reason = "pp above 2 for a Hugging Face model (kiln refuses its rotary embeddings across 3+ stages)"
            elif global_batch % dp:
                reason = "the global batch does not split over the data-parallel ranks"
            if reason is not None:  # with and without checkpointing, whatever the microbatch
                drop(reason, 2)
                searched += 2
                continue
            local = global_batch // dp
            for mbs in _divisors(local):
                m = local // mbs
                for ac in (None, "full"):
                    searched += 1
                    if pp > 1 and m < pp:
                        drop("fewer pipeline microbatches than stages")
                        continue
                    plan = SearchPlan(dp, tp, pp, ac, mbs, m, split_points=_split_points(shape, pp))
                    _price(
                        shape, plan, device, world_size, global_batch, seq_len, precision, optimizer_factor, per_node
                    )
                    if limit is not None and plan.memory["total"] > limit:
                        drop("memory over the budget")
                        continue
                    plans.append(plan)
    plans.sort(key=lambda p: (p.seconds["total"], p.tp * p.pp, p.activation_checkpointing is not None))
    return SearchResult(plans, infeasible, searched, device, world_size, limit, global_batch, seq_len, precision, shape)


def _gib(n: float) -> str:
    return f"{n / _GiB:.1f}"


def format_plans(result: SearchResult, top: int = 10) -> str:
    """The feasible plans as the text table ``kiln plan --search`` prints, cheapest first."""
    d = result.device
    budget = "none" if result.budget is None else f"{_gib(result.budget)} GiB"
    lines = [
        f"{result.shape.num_parameters:,} parameters on {result.world_size} x {d.name} ({d.devices_per_node} per node), "
        f"budget {budget} per rank, global batch {result.global_batch} x {result.seq_len} tokens, {result.precision}",
        f"searched {result.searched} plans: {len(result.plans)} feasible"
        + "".join(f"; {n} {reason}" for reason, n in result.infeasible.items()),
    ]
    head = (
        "  dp_shard x tp x pp",
        "ckpt",
        "mbs x n",
        "GiB/rank",
        "compute s",
        "comm s",
        "bubble s",
        "step s",
        "tok/s/dev",
    )
    rows = []
    for i, p in enumerate(result.plans[:top]):
        rows.append(
            (
                ("* " if i == 0 else "  ") + f"{p.dp_shard} x {p.tp} x {p.pp}",
                "full" if p.activation_checkpointing else "-",
                f"{p.micro_batch_size} x {p.microbatches}",
                _gib(p.memory["total"]),
                f"{p.seconds['compute']:.3f}",
                f"{p.seconds['communication']:.3f}",
                f"{p.seconds['bubble']:.3f}",
                f"{p.seconds['total']:.3f}",
                f"{p.tokens_per_second:,.0f}",
            )
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    if result.plans:
        best = result.plans[0]
        comm = "; ".join(
            f"{kind} {dim} {_gib(b)} GiB" for kind, dims in best.collectives.items() for dim, b in dims.items()
        )
        lines.append(f"first plan's collectives per step and rank: {comm or 'none'}")
        lines.append("dry-run it: kiln plan -f RUN.yaml --dry-run --world-size " + str(result.world_size) + " "
                     + " ".join(_quote(a) for a in best.overrides()))  # fmt: skip
    else:
        lines.append("no plan fits: add devices, raise --memory, or shorten the sequences / the global batch")
    return "\n".join(lines)


def _quote(arg: str) -> str:
    return f'"{arg}"' if any(c in arg for c in " '[{") else arg
