"""``kiln plan --search``: every (dp_shard, tp, pp, activation checkpointing, microbatch) plan of a
transformer on a world of devices, the infeasible ones dropped, the rest ranked by a cost model.

The plans are what kiln's ``hybrid`` strategy runs on the mesh ``(pp, dp_shard, tp)``, outermost
first: tensor parallelism with the model's own plan (a Hugging Face model's ``base_model_tp_plan``:
attention and MLP Linears split, embeddings and LM head whole), FSDP2 over ``dp_shard``, a pipeline
of ``pp`` stages (1F1B) cut at block boundaries. Everything is analytic (a plan costs microseconds
to price); ``kiln plan --dry-run`` of a plan's overrides runs the real code, and ``kiln plan
--search --confirm`` dry-runs the first plans and ranks them by what it measures
(:mod:`kiln.planning.confirm`).

Memory per rank: the closed form of :mod:`kiln.planning.search_memory` (parameters, gradients and
optimizer state of the largest stage's shard; activations as the largest of three moments of the
step: the loss, a checkpointed block's backward, the embedding's backward), which
``tests/test_search_vs_dry_run.py`` holds within 10% of kiln's dry run over a grid of plans. For
Llama-3-8B at FSDP 64 x TP 8 (8192 tokens, full checkpointing, amp_bf16) it estimates 1,675 MiB
of activations where the dry run measures 1,665 MiB (docs/planning.md has the terms).

Cost of one optimizer step, in seconds: ``compute + communication + bubble``.

* compute: the stage's FLOPs (``(6 + 2 if checkpointed) x`` parameters per token, the attention's
  ``12 x layers x seq x heads x head_dim``, the LM head on each tensor-parallel rank, its vocabulary
  shard under loss parallelism) over ``bf16_flops x COMPUTE_EFFICIENCY`` of :mod:`kiln.cost.devices`;
* communication, each collective's bytes over the bandwidth of the link its mesh dimension crosses
  (inside a node when the dimension's group fits in ``devices_per_node``, else the network), as a
  ring moves them: all-gather, reduce-scatter and broadcast ``(n-1)/n x bytes``, all-reduce twice
  that, point-to-point the bytes. The bytes are the dry run's (``t`` tokens of a microbatch, ``h``
  hidden, ``cb`` the compute dtype's bytes, ``a`` the residual stream's: ``cb`` under FSDP, fp32
  under amp without it): FSDP gathers a stage's parameters in ``cb`` twice per microbatch (once a
  step in a pipeline, whose stages keep them gathered) and reduce-scatters its gradients once per
  step. Tensor parallelism with sequence parallelism (kiln's default where it has the model's plan:
  Llama, Mistral, Qwen2 without a pipeline; loss parallelism too unless the embeddings are tied)
  gathers and reduce-scatters ``t x h`` per call: each block gathers ``2 a + 2 cb`` (``4 a + 2
  cb`` checkpointed) and reduce-scatters ``2 cb + 2 a`` (``3 cb + 2 a``) per microbatch, the head
  and the embedding's backward gather ``2 a`` more, loss parallelism reduce-scatters ``2 a`` more;
  under FSDP the norms' weight gradients are all-reduced once a step, ``(2 x layers + 1) x h`` in
  ``cb`` (fp32 when accumulated). Without it tensor parallelism all-reduces ``t x h`` 7 times per
  block and microbatch (8 checkpointed): 2 forward in ``cb`` (3 checkpointed), 5 backward in
  ``cb``, or fp32 inside a pipeline stage (traced in fp32). A pipeline sends each microbatch's
  fp32 activations and receives their gradients, and broadcasts the loss. Nothing is overlapped;
* bubble: ``(pp - 1) / microbatches`` of the compute (1F1B).

Infeasible: ``tp`` not dividing the attention or key/value heads, ``pp`` above the layers (or, for a
Hugging Face decoder outside :data:`kiln.models.hf_stages.MASK_RULES`' families, above 2: its rotary
embeddings would cross 3+ stages as a skip connection), a global batch that does not split over the data-parallel ranks, fewer pipeline
microbatches than stages, memory over the budget.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from kiln.cost.devices import COMPUTE_EFFICIENCY, DeviceClass
from kiln.planning.search_memory import plan_memory, precision_bytes, stage_params

__all__ = [
    "ModelShape",
    "SearchPlan",
    "SearchResult",
    "search",
    "precision_bytes",
    "parse_bytes",
    "format_plans",
    "price_communication",
    "rank",
]

_GiB = 1024**3
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1024, "mib": 1024**2, "gib": _GiB, "tib": 1024**4})


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
    deep_pipeline: bool = True  # any number of pipeline stages (a Hugging Face decoder kiln cuts: hf_stages)
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
            deep_pipeline=_cuts_into_any_stages(config),
            blocks=blocks,
            sequence_parallel=_has_sequence_parallel_plan(model),
        )


def _cuts_into_any_stages(config: Any) -> bool:
    # a Hugging Face decoder of a family whose layers kiln makes self-contained for the pipeline's
    # trace (kiln.models.hf_stages) runs in any number of stages; any other keeps the model's rotary
    # embeddings as a skip connection from stage 0, which only 2 stages can run
    from kiln.models.hf_stages import MASK_RULES

    return not callable(getattr(config, "to_dict", None)) or getattr(config, "model_type", None) in MASK_RULES


def _has_sequence_parallel_plan(model: nn.Module) -> bool:
    # what Hybrid(tp=N) turns on by default: sequence parallelism and, with untied embeddings, loss
    # parallelism (kiln.parallel.transforms.sequence_parallel; ModelShape.tied says which);
    # kiln.models.tp_plan knows the families
    from kiln.models.tp_plan import huggingface_sequence_parallel_refusal

    return huggingface_sequence_parallel_refusal(model) is None


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
    activation_moments: dict[str, int] = field(default_factory=dict)  # kiln.planning.search_memory's
    measured: dict[str, int] | None = None  # memory its dry run measured (kiln.planning.confirm), if run
    estimated: dict[str, int] | None = None  # the closed form's memory, once measured replaced it

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
            "confirmed": self.measured is not None,
            **({"estimated_memory": dict(self.estimated)} if self.estimated is not None else {}),
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
    devices_per_node: int = 8

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
    ckpt = plan.activation_checkpointing is not None
    # sequence parallelism: on with tp > 1 where kiln has the model's plan, not with a pipeline; loss
    # parallelism with it, unless the embeddings are tied
    sp = shape.sequence_parallel and tp > 1 and pp == 1
    lp = sp and not shape.tied
    memory = plan_memory(
        shape,
        dp=dp,
        tp=tp,
        pp=pp,
        checkpointing=ckpt,
        micro_batch_size=plan.micro_batch_size,
        microbatches=m,
        seq_len=seq_len,
        precision=precision,
        optimizer_factor=optimizer_factor,
    )
    plan.memory = {
        "params": memory.params,
        "grads": memory.grads,
        "optimizer": memory.optimizer,
        "activations": memory.activations,
        "total": memory.total,
    }
    plan.activation_moments = dict(memory.moments)
    layers = math.ceil(shape.num_layers / pp)
    first, last, layer_tp = stage_params(shape, tp, pp, lp)
    stage = max(first, last)

    # compute: FLOPs of the stage on this rank's tokens
    t = plan.micro_batch_size * seq_len  # tokens of one microbatch
    q = shape.heads * shape.head_dim
    tokens = global_batch * seq_len // dp
    fwd_per_token = 2 * layers * layer_tp + 4 * layers * seq_len * q // tp
    # the LM head: whole on each tensor-parallel rank, or its vocabulary shard with loss parallelism
    fwd_per_token += 2 * shape.vocab * shape.hidden // (tp if lp else 1)
    flops = (3 + (1 if ckpt else 0)) * fwd_per_token * tokens
    compute = flops / (device.bf16_flops * COMPUTE_EFFICIENCY)
    bubble = compute * (pp - 1) / m if pp > 1 else 0.0

    collectives: dict[str, dict[str, int]] = {}
    amp = precision.startswith("amp")
    # the residual stream's bytes: FSDP gathers amp's parameters in the compute dtype, so it is bf16
    # there; without FSDP autocast leaves it (and the norms' outputs) fp32
    a = cb if (dp > 1 or not amp) else rb
    if dp > 1:
        # a forward and a backward gather per microbatch; a pipeline stage keeps its blocks gathered
        # across its microbatches (Hybrid's default under pp): one gather a step
        gathers = 1 if pp > 1 else 2 * m
        ag, rs = gathers * stage * cb, stage * gb
        collectives["all_gather"] = {"dp_shard": ag}
        collectives["reduce_scatter"] = {"dp_shard": rs}
    if tp > 1 and sp:
        # each block gathers the sequence before its attention and its MLP (the norms' output, in the
        # residual's dtype) and reduce-scatters the row-wise projections' outputs (compute dtype)
        # after them; the backward runs their transposes (the gathers' on the outputs' gradients),
        # and a checkpointed block's recomputation gathers twice and reduce-scatters once more (it
        # stops before its last). The head gathers the sequence, and its transpose (the embedding's
        # shards' gradient) gathers too; with loss parallelism the embedding reduce-scatters its
        # output and the head its input's gradient. Each call: one microbatch, t x h.
        per_token = t * shape.hidden
        ag_layer = (2 + (2 if ckpt else 0)) * a + 2 * cb
        rs_layer = (2 + (1 if ckpt else 0)) * cb + 2 * a
        ag = (layers * ag_layer + 2 * a) * m * per_token
        rs = (layers * rs_layer + (2 * a if lp else 0)) * m * per_token
        collectives["all_gather"] = {**collectives.get("all_gather", {}), "tp": ag}
        collectives["reduce_scatter"] = {**collectives.get("reduce_scatter", {}), "tp": rs}
        if dp > 1:
            # the sequence-parallel norms' weight gradients, partial sums over tp, all-reduced once
            # a step inside FSDP's backward (fp32 when accumulated over microbatches)
            ar = (2 * layers + 1) * shape.hidden * (cb if m == 1 else gb)
            collectives["all_reduce"] = {"tp": ar}
    elif tp > 1:
        # each block all-reduces its attention's and its MLP's output in the forward (and the first
        # again in a checkpointed block's recomputation) and q, k, v, gate and up their input's
        # gradient in the backward: in the compute dtype, or fp32 (the trace's) in a pipeline stage
        backward = rb if pp > 1 else cb
        ar = ((3 if ckpt else 2) * cb + 5 * backward) * layers * m * t * shape.hidden
        collectives["all_reduce"] = {"tp": ar}
    if pp > 1:
        # each microbatch's activations sent forward and their gradients back, in the trace's dtype
        # (fp32 under amp: the stage's output is cast back to it), once per neighbour; and the loss
        # broadcast (one fp32 scalar)
        p2p = (2 if pp == 2 else 4) * m * t * shape.hidden * rb
        collectives["p2p"] = {"pp": p2p}
        collectives["broadcast"] = {"pp": 4}
    plan.collectives = collectives
    plan.seconds = {"compute": compute, "bubble": bubble}
    _price_communication(plan, device, devices_per_node, global_batch * seq_len / world_size)


# A ring's share of a collective's bytes over each rank's link (kiln.planning.comm_count's sizes)
_RING = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "broadcast": 1.0, "all_to_all": 1.0}


def _price_communication(plan: SearchPlan, device: DeviceClass, devices_per_node: int, tokens: float) -> None:
    """``plan.seconds``' communication and total, and its tokens per second and device, from its
    collectives: each collective's bytes over the bandwidth of the link its mesh dimension crosses,
    as a ring moves them; point-to-point the bytes (a dimension the search does not name, such as
    ``dp_replicate``, is priced on the network)."""
    sizes = {"pp": plan.pp, "dp_shard": plan.dp_shard, "tp": plan.tp}
    bw = _mesh_bandwidth(device, sizes, devices_per_node)
    comm = 0.0
    for kind, dims in plan.collectives.items():
        for dim, moved in dims.items():
            n = sizes.get(dim, 2)
            share = 1.0 if kind == "p2p" else _RING.get(kind, 1.0) * (n - 1) / n
            comm += share * moved / bw.get(dim, device.inter_node_bw)
    total = plan.seconds["compute"] + comm + plan.seconds["bubble"]
    plan.seconds = {**plan.seconds, "communication": comm, "total": total}
    plan.seconds = {k: plan.seconds[k] for k in ("compute", "communication", "bubble", "total")}
    plan.tokens_per_second = tokens / total


def price_communication(plan: SearchPlan, result: SearchResult) -> None:
    """Price ``plan``'s step again from its collectives (after a dry run replaced them)."""
    _price_communication(
        plan, result.device, result.devices_per_node, result.global_batch * result.seq_len / result.world_size
    )


def rank(plans: list[SearchPlan]) -> None:
    """Sort ``plans`` cheapest first (fewer model-parallel ranks, then no checkpointing, on a tie)."""
    plans.sort(key=lambda p: (p.seconds["total"], p.tp * p.pp, p.activation_checkpointing is not None))


def _split_points(shape: ModelShape, pp: int) -> list[str]:
    if pp == 1 or len(shape.blocks) < pp:
        return []
    # the first len % pp stages take one block more: the largest has ceil(len / pp), as priced
    per, extra = divmod(len(shape.blocks), pp)
    return [shape.blocks[i * per + min(i, extra)] for i in range(1, pp)]


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
            elif not shape.deep_pipeline and pp > 2:
                reason = "pp above 2 for this Hugging Face model (its rotary embeddings cross 3+ stages)"
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
    rank(plans)
    return SearchResult(
        plans, infeasible, searched, device, world_size, limit, global_batch, seq_len, precision, shape, per_node
    )


def _gib(n: float) -> str:
    return f"{n / _GiB:.1f}"


def format_plans(result: SearchResult, top: int = 10, run_file: str | None = None) -> str:
    """The feasible plans as the text table ``kiln plan --search`` prints, cheapest first; the last
    line is the command that dry-runs the first plan, with ``run_file`` (the ``-f`` given)."""
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
        "by",
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
                "dry run" if p.measured is not None else "estimate",
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
        run = _quote(str(run_file)) if run_file is not None else "RUN.yaml"
        command = f"kiln plan -f {run} --dry-run --world-size {result.world_size} " + " ".join(
            _quote(a) for a in best.overrides()
        )
        lines.append(
            ("dry-run it: " if run_file is not None else "dry-run it with a run file of this model: ") + command
        )
    else:
        lines.append("no plan fits: add devices, raise --memory, or shorten the sequences / the global batch")
    return "\n".join(lines)


def _quote(arg: str) -> str:
    return f'"{arg}"' if any(c in arg for c in " '[{") else arg
