"""Model knowledge for tensor parallelism: which modules of a Hugging Face architecture are split
column-wise or row-wise, read from its config's ``base_model_tp_plan`` (transformers' own table).

The tensor-parallel transformation (:mod:`kiln.parallel.transforms.tensor_parallel`) reads it when a
strategy is given no plan; the model wrappers expose it as their ``tp_plan``. It imports no strategy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.batch import IGNORE_INDEX

__all__ = [
    "huggingface_tp_plan",
    "is_huggingface_module",
    "SEQUENCE_PARALLEL_FAMILIES",
    "MOE_SEQUENCE_PARALLEL_FAMILIES",
    "huggingface_sequence_parallel_plan",
    "huggingface_sequence_parallel_refusal",
    "huggingface_pipeline_sequence_parallel_refusal",
    "tied_embeddings",
    "token_mean_cross_entropy",
    "full_logits",
]

# The styles of a Hugging Face base_model_tp_plan that mean torch's ColwiseParallel / RowwiseParallel
# with their defaults (the attention reshapes with -1 heads, so it runs on its local heads).
_HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "fused_experts": "fused_experts"}
# transformers' styles for fused MoE experts (Mixtral, Qwen-MoE: ``experts.gate_up_proj``
# packed_colwise, ``experts.down_proj`` rowwise, ``experts`` moe_tp_experts): one kiln style on the
# experts module (kiln.parallel.transforms.fused_experts)
_FUSED_EXPERTS = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise", "": "moe_tp_experts"}


def _fused_experts(base_plan: dict[str, str]) -> dict[str, str]:
    """``base_plan`` with each trio of transformers' fused-experts styles as one ``fused_experts``."""
    plan = dict(base_plan)
    for pattern, style in base_plan.items():
        if style != "moe_tp_experts":
            continue
        keys = {f"{pattern}.{p}" if p else pattern: s for p, s in _FUSED_EXPERTS.items()}
        if all(plan.get(k) == s for k, s in keys.items()):
            for k in keys:
                del plan[k]
            plan[pattern] = "fused_experts"
    return plan


def is_huggingface_module(module: nn.Module) -> bool:
    # A transformers PreTrainedModel, told without importing transformers.
    return hasattr(type(module), "base_model_prefix") and callable(
        getattr(getattr(module, "config", None), "to_dict", None)
    )


def huggingface_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan of the first Hugging Face model in ``model`` (itself or a submodule, such as a
    :class:`kiln.models.HuggingFaceModel`'s), from its ``config.base_model_tp_plan``; None when
    ``model`` holds none or its config has no plan.

    That plan's keys are relative to the base model (``layers.*.self_attn.q_proj``); they are
    prefixed with the base model's path in ``model`` (``model.model.``). Its ``"colwise"`` and
    ``"rowwise"`` become torch's ``ColwiseParallel`` and ``RowwiseParallel``; any other style
    (transformers' packed, MoE or local ones) raises ``ValueError`` naming it: pass a plan then.
    Embeddings and the LM head are not in the base plan and stay whole on every rank.

    Example::

        huggingface_tp_plan(HuggingFaceModel(LlamaForCausalLM(config)))
        # {"model.model.layers.*.self_attn.q_proj": "colwise", ..., "model.model.layers.*.mlp.down_proj": "rowwise"}
    """
    for name, module in model.named_modules():  # pre-order: the outermost Hugging Face model first
        if not is_huggingface_module(module):
            continue
        base_plan = getattr(module.config, "base_model_tp_plan", None)
        if not base_plan:
            return None
        base = getattr(module, "base_model", module)
        base_name = next((n for n, m in module.named_modules() if m is base), "")
        prefix = ".".join(part for part in (name, base_name) if part)
        plan: dict[str, str] = {}
        for pattern, style in _fused_experts(base_plan).items():
            if style not in _HF_STYLES:
                raise ValueError(
                    f"{type(module.config).__name__}.base_model_tp_plan[{pattern!r}]={style!r} is a transformers "
                    f"style kiln does not translate (it translates {', '.join(_HF_STYLES)}); pass "
                    "TensorParallel(plan={...}) (or Hybrid(tp_plan=...)) with torch ParallelStyle objects"
                )
            plan[f"{prefix}.{pattern}" if prefix else pattern] = _HF_STYLES[style]
        return plan
    return None


# -- sequence parallelism and loss parallelism ---------------------------------------------------
# The transformers decoders kiln has a sequence-parallel plan for: Llama's layout (pre-norm decoder
# layers of input_layernorm, self_attn with q/k/v/o_proj called with hidden_states=..., and
# post_attention_layernorm, mlp; embed_tokens and norm in the base model, an lm_head beside it) and
# the base_model_tp_plan of each family exactly. The mlp is Llama's gate/up/down_proj, or in the MoE
# families (MOE_SEQUENCE_PARALLEL_FAMILIES) a sparse block of a router (gate), fused experts and, in
# Qwen2-MoE, a shared expert with its sigmoid shared_expert_gate; Qwen-MoE's dense layers
# (mlp_only_layers, decoder_sparse_step) keep Llama's mlp.
MOE_SEQUENCE_PARALLEL_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
SEQUENCE_PARALLEL_FAMILIES = ("llama", "mistral", "qwen2", *MOE_SEQUENCE_PARALLEL_FAMILIES)
_ATTENTION_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}
_MLP_PLAN = {
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
_EXPERTS_PLAN = {f"layers.*.mlp.experts{'.' if p else ''}{p}": s for p, s in _FUSED_EXPERTS.items()}
_LLAMA_BASE_PLAN = {**_ATTENTION_PLAN, **_MLP_PLAN}
# each family's config.base_model_tp_plan (transformers 5), which its layout is checked against
_BASE_PLANS = {
    "llama": _LLAMA_BASE_PLAN,
    "mistral": _LLAMA_BASE_PLAN,
    "qwen2": _LLAMA_BASE_PLAN,
    "mixtral": {**_ATTENTION_PLAN, **_EXPERTS_PLAN},
    "qwen2_moe": {**_ATTENTION_PLAN, **_EXPERTS_PLAN, **_MLP_PLAN},
    "qwen3_moe": {
        **_ATTENTION_PLAN,
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        **_EXPERTS_PLAN,
        **_MLP_PLAN,
    },
}


def _first_huggingface(model: nn.Module) -> tuple[str, Any] | None:
    # Any: a transformers PreTrainedModel (get_input_embeddings, get_output_embeddings, base_model)
    return next(((n, m) for n, m in model.named_modules() if is_huggingface_module(m)), None)


def _path(root: nn.Module, target: object) -> str | None:
    return next((n for n, m in root.named_modules() if m is target), None)


def huggingface_sequence_parallel_refusal(model: nn.Module) -> str | None:
    """Why kiln has no sequence-parallel plan for ``model`` (one clause), or None when it has one."""
    found = _first_huggingface(model)
    if found is None:
        return f"{type(model).__name__} holds no Hugging Face model"
    _, hf = found
    config = hf.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SEQUENCE_PARALLEL_FAMILIES:
        return f"its model_type {model_type!r} is not one of {', '.join(SEQUENCE_PARALLEL_FAMILIES)}"
    if dict(getattr(config, "base_model_tp_plan", None) or {}) != _BASE_PLANS[model_type]:
        return f"its config.base_model_tp_plan is not the {model_type} one kiln's plan is written for"
    head = hf.get_output_embeddings() if callable(getattr(hf, "get_output_embeddings", None)) else None
    base = getattr(hf, "base_model", hf)
    if head is None or base is hf or not all(hasattr(base, n) for n in ("embed_tokens", "norm", "layers")):
        return f"{type(hf).__name__} is not a causal LM with embed_tokens, norm and layers in its base model"
    for i, layer in enumerate(base.layers):
        if _mlp_kind(getattr(layer, "mlp", None)) is None:
            return f"layer {i}'s mlp is neither gate/up/down_proj Linears nor a MoE block of a router and fused experts"
    return None


def huggingface_pipeline_sequence_parallel_refusal(model: nn.Module) -> str | None:
    """Why kiln runs no sequence parallelism for ``model`` inside pipeline stages (one clause), or None:
    a MoE family's blocks (their partial outputs, the router's plain tensors) are written for an eager
    model, not for a traced stage (kiln.parallel.pipelining.sequence_stages); they keep plain tensor
    parallelism there."""
    found = _first_huggingface(model)
    model_type = getattr(found[1].config, "model_type", None) if found is not None else None
    if model_type in MOE_SEQUENCE_PARALLEL_FAMILIES:
        return f"its {model_type} MoE blocks' sequence-parallel plan does not run in traced pipeline stages"
    return None


def _mlp_kind(mlp: object) -> str | None:
    # "dense": Llama's gate/up/down_proj Linears; "moe": a router (gate), fused experts and, optionally,
    # a shared expert (dense) with a shared_expert_gate Linear; None: neither
    def linears(module: object, *names: str) -> bool:
        return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)

    if linears(mlp, "gate_proj", "up_proj", "down_proj"):
        return "dense"
    experts = getattr(mlp, "experts", None)
    # transformers' fused experts (kiln.parallel.transforms.fused_experts.is_fused_experts, not imported:
    # model knowledge imports no strategy): 3-D gate_up_proj and down_proj, no other parameter
    dims = {n: p.dim() for n, p in experts.named_parameters(recurse=False)} if isinstance(experts, nn.Module) else {}
    if dims != {"gate_up_proj": 3, "down_proj": 3} or not isinstance(getattr(mlp, "gate", None), nn.Module):
        return None
    if hasattr(mlp, "shared_expert") and not (
        linears(mlp.shared_expert, "gate_proj", "up_proj", "down_proj") and linears(mlp, "shared_expert_gate")
    ):
        return None
    return "moe"


def tied_embeddings(model: nn.Module) -> bool:
    """Whether the first Hugging Face model in ``model`` shares one weight between its input
    embedding and its LM head (``tie_word_embeddings``): both cannot be split their own way."""
    found = _first_huggingface(model)
    if found is None:
        return False
    hf = found[1]
    head, embed = hf.get_output_embeddings(), hf.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def huggingface_sequence_parallel_plan(model: nn.Module, *, loss_parallel: bool) -> dict[str, Any] | None:
    """The tensor-parallel plan with sequence parallelism of the first Hugging Face model in
    ``model`` (a Llama-family or MoE causal LM, :data:`SEQUENCE_PARALLEL_FAMILIES`), keyed by module names
    in ``model``, with torch ``ParallelStyle`` objects; None when kiln has none for it
    (:func:`huggingface_sequence_parallel_refusal` says why).

    What runs where, over the ``tp`` ranks (torchtitan's Llama plan, in transformers' names):

    * ``embed_tokens``: split over the vocabulary (``RowwiseParallel``); its output, summed over
      the ranks, is reduce-scattered to a slice of the sequence on each rank (``Shard(1)``).
    * The residual stream between the projections stays a DTensor sharded on the sequence
      (dimension 1), and so do the norms (``SequenceParallel``): their activations are 1/tp.
    * ``self_attn`` and ``mlp`` gather the sequence first (``PrepareModuleInput``, an all-gather);
      q/k/v and gate/up are column-wise, o_proj and down_proj row-wise with their outputs
      reduce-scattered back to the sequence shards (``Shard(1)``), in place of TP's all-reduce.
      The rotary ``position_embeddings`` (cos, sin) the base model computes from the position ids
      are plain tensors of the whole sequence: ``self_attn`` gets them as they are, and applies
      them to the gathered queries and keys, so they are never sharded.
    * In the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE) each sparse block gathers the sequence
      and reduce-scatters its output; inside it the router runs whole on every rank and the
      experts (and Qwen2-MoE's shared expert) are split over their intermediate dimension
      (:func:`_mlp_plan`). Qwen3-MoE's per-head q_norm/k_norm run on the rank's heads.
    * ``norm`` (the last one) is sequence-sharded; ``lm_head`` gathers the sequence and is split
      column-wise over the vocabulary: with ``loss_parallel`` its logits stay a DTensor sharded
      over the vocabulary (``Shard(-1)``, no rank holds the whole ``tokens x vocab``), for
      :func:`token_mean_cross_entropy`; without, they are gathered whole on every rank.

    With tied input and output embeddings (``tie_word_embeddings``) neither is split (their one
    weight cannot be row-wise and column-wise at once): the embedding output is cut to the
    sequence shards and the head gathers the sequence; ``loss_parallel`` is then refused.

    Raises ``ValueError`` when ``loss_parallel`` is asked of tied embeddings.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    if huggingface_sequence_parallel_refusal(model) is not None:
        return None
    found = _first_huggingface(model)
    assert found is not None  # the refusal checked
    name, hf = found
    base = getattr(hf, "base_model", hf)
    prefix = ".".join(p for p in (name, _path(hf, base)) if p)
    head = ".".join(p for p in (name, _path(hf, hf.get_output_embeddings())) if p)
    tied = tied_embeddings(hf)
    if loss_parallel and tied:
        raise ValueError(
            f"loss_parallel=True needs the LM head split over the vocabulary, but {type(hf).__name__} ties "
            "it to the input embedding (tie_word_embeddings); set loss_parallel=False (or untie the weights)"
        )
    layer = f"{prefix}.layers.*"
    # The gathered sequence stays a DTensor into the column-wise projections (use_local_output=False),
    # as in torchtitan's plan: the projections' input gradients then add up as one Partial DTensor
    # that the gather's backward reduce-scatters once, where local tensors would make each projection
    # all-reduce its own (q, k, v, gate, up: five all-reduces of the whole sequence per layer).
    gather_sequence: dict[str, Any] = {
        "input_layouts": (Shard(1),),
        "desired_input_layouts": (Replicate(),),
        "use_local_output": False,
    }
    plan: dict[str, Any] = {
        f"{prefix}.embed_tokens": (
            PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False)
            if tied
            else RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
        ),
        f"{layer}.input_layernorm": SequenceParallel(),
        f"{layer}.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        ),
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        f"{layer}.post_attention_layernorm": SequenceParallel(),
    }
    if getattr(hf.config, "model_type", None) == "qwen3_moe":
        # Qwen3's q_norm/k_norm normalise each head of the column-wise q/k outputs (the rank's own
        # heads, dimension 2 of (batch, sequence, heads, head_dim)): their weights replicated, their
        # gradients partial sums over the ranks' heads (summed as the norms' are)
        for norm in ("q_norm", "k_norm"):
            plan[f"{layer}.self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    mlps = [decoder_layer.mlp for decoder_layer in base.layers]
    if len({_mlp_kind(mlp) for mlp in mlps}) == 1:  # one pattern for every layer's (a pipeline stage's too)
        plan.update(_mlp_plan(f"{layer}.mlp", mlps[0], gather_sequence))
    else:  # Qwen-MoE's dense layers among the sparse ones: each layer's own
        for i, mlp in enumerate(mlps):
            plan.update(_mlp_plan(f"{prefix}.layers.{i}.mlp", mlp, gather_sequence))
    plan[f"{prefix}.norm"] = SequenceParallel()
    plan[head] = (
        PrepareModuleInput(**{**gather_sequence, "use_local_output": True})  # a plain Linear takes it
        if tied
        else ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    )
    return plan


def _mlp_plan(mlp: str, module: nn.Module, gather_sequence: dict[str, Any]) -> dict[str, Any]:
    """The sequence-parallel styles of one decoder layer's ``mlp`` (named ``mlp`` in ``model``).

    A dense mlp is Llama's: the sequence gathered, gate/up column-wise, down row-wise with its output
    reduce-scattered to the sequence shards (``Shard(1)``). A MoE block gets the whole sequence as a
    plain tensor on every rank (``PrepareModuleInputOutput``, an all-gather): transformers' own block
    forward runs on it, the router (``gate``) replicated on every rank with every token (its top-k,
    softmax and renormalisation as transformers computes them), the fused experts split over their
    intermediate dimension (``fused_experts_partial``: each rank's output is its partial sum, a
    ``Partial()`` DTensor) and, in Qwen2-MoE, the shared expert split likewise (gate/up column-wise,
    down row-wise with its ``Partial()`` output left unsummed) times its sigmoid gate (a replicated
    Linear whose output is a ``Replicate()`` DTensor, so DTensor sums its gradient, a partial sum of
    the ranks' shared-expert parts). The block's output, the experts' and the shared expert's partial
    sums added, is reduce-scattered to the sequence shards (``Partial()`` to ``Shard(1)``) where plain
    tensor parallelism all-reduces it.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
    )

    if _mlp_kind(module) == "dense":
        return {
            mlp: PrepareModuleInput(**gather_sequence),
            f"{mlp}.gate_proj": ColwiseParallel(),
            f"{mlp}.up_proj": ColwiseParallel(),
            f"{mlp}.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
    plan: dict[str, Any] = {
        mlp: PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,  # transformers' router and its reshapes take a plain tensor
            output_layouts=(Partial(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=False,
        ),
        f"{mlp}.experts": "fused_experts_partial",
    }
    if hasattr(module, "shared_expert"):
        shared = f"{mlp}.shared_expert"
        plan.update(
            {
                # one DTensor into gate and up: their partial input gradients summed in one all-reduce
                shared: PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
                ),
                f"{shared}.gate_proj": ColwiseParallel(),
                f"{shared}.up_proj": ColwiseParallel(),
                f"{shared}.down_proj": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
                f"{mlp}.shared_expert_gate": PrepareModuleOutput(
                    output_layouts=(Replicate(),), desired_output_layouts=(Replicate(),), use_local_output=False
                ),
            }
        )
    return plan


def token_mean_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` ``(..., vocab)`` against ``target`` ``(...)``: the mean over the
    positions whose label is not ``IGNORE_INDEX`` (-100), as ``F.cross_entropy`` computes it.

    ``logits`` sharded over the vocabulary (a DTensor with ``Shard(-1)`` on the tensor-parallel
    mesh: a loss-parallel LM head) are never gathered: the log-softmax and the picked labels are
    computed on each rank's shard inside torch's ``loss_parallel()`` (two small all-reduces over
    the rows: the max and the sum of exponentials; one for the picked logits), forward and
    backward, and the loss comes back as a plain tensor (every rank of the group holds it). Logits
    below float32 are computed in float32, as transformers does. A plain tensor is
    ``F.cross_entropy(..., ignore_index=-100)`` as it is.
    """
    if not _is_dtensor(logits):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LossParallelCrossEntropy.apply(logits, target)
    return _sharded_cross_entropy(logits, target).to_local()


def full_logits(logits: Any) -> Any:
    """``logits`` whole on every rank: a DTensor sharded over the vocabulary is all-gathered (the
    one place the full ``tokens x vocab`` is built: metrics and predictions need it), anything
    else is returned as it is."""
    return logits.full_tensor() if _is_dtensor(logits) else logits


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _sharded_cross_entropy(logits: Any, target: torch.Tensor) -> Any:
    from torch.distributed.tensor.parallel import loss_parallel

    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    with loss_parallel():
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX)


class _LossParallelCrossEntropy(torch.autograd.Function):
    """torch's loss_parallel() must be active in the backward as well as the forward; the backward
    runs in the Engine (``engine.backward``), which knows nothing of it. This function runs its own
    small graph, from a detached copy of the logits to the loss, under the context both ways."""

    @staticmethod
    def forward(ctx: Any, logits: Any, target: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_()
            loss = _sharded_cross_entropy(leaf, target)
        ctx.leaf, ctx.loss = leaf, loss
        return loss.to_local().detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        loss, leaf = ctx.loss, ctx.leaf
        grad = DTensor.from_local(grad, loss.device_mesh, loss.placements, run_check=False)
        with loss_parallel():
            (grad_logits,) = torch.autograd.grad(loss, leaf, grad)
        ctx.leaf = ctx.loss = None
        return grad_logits, None
