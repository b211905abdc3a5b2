"""Model knowledge for tensor parallelism: which modules of a Hugging Face architecture are split
column-wise or row-wise, read from its config's ``base_model_tp_plan`` (transformers' own table).

The tensor-parallel transformation (:mod:`kiln.parallel.transforms.tensor_parallel`) reads it when a
strategy is given no plan; the model wrappers expose it as their ``tp_plan``. It imports no strategy.
"""

from __future__ import annotations

from torch import nn

__all__ = ["huggingface_tp_plan", "is_huggingface_module"]

# The styles of a Hugging Face base_model_tp_plan that mean torch's ColwiseParallel / RowwiseParallel
# with their defaults (the attention reshapes with -1 heads, so it runs on its local heads).
_HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise"}


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
        for pattern, style in base_plan.items():
            if style not in _HF_STYLES:
                raise ValueError(
                    f"{type(module.config).__name__}.base_model_tp_plan[{pattern!r}]={style!r} is a transformers "
                    f"style kiln does not translate (it translates {', '.join(_HF_STYLES)}); pass "
                    "TensorParallel(plan={...}) (or Hybrid(tp_plan=...)) with torch ParallelStyle objects"
                )
            plan[f"{prefix}.{pattern}" if prefix else pattern] = _HF_STYLES[style]
        return plan
    return None
