"""The tensor-parallel transformation: a plan of module-name patterns, validated and applied with
DTensor's ``parallelize_module`` (the ``tensor_parallel`` step; :class:`kiln.parallel.TensorParallel`
and ``Hybrid(tp=N)`` run it).

A plan maps module-name patterns to styles. ``colwise`` splits a Linear's output features over the
ranks (its input is replicated), ``rowwise`` splits its input features (its output is summed over
the ranks): a ``colwise`` layer followed by a ``rowwise`` one, as in an MLP or attention block,
needs one all-reduce in the forward and one in the backward. ``sequence`` shards a norm layer's
activations along the sequence dimension. Every rank of the tensor-parallel group must be given
the same batch: the group is one data-parallel replica.

Sequence and loss parallelism (:mod:`kiln.parallel.transforms.sequence_parallel`) choose another
plan, of torch ``ParallelStyle`` objects, which this file validates and applies like any other.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

__all__ = [
    "resolve_tp_plan",
    "apply_tp",
    "matching_modules",
    "model_tp_plan",
    "local_linear_features",
    "check_tp_size",
]

_STYLE_NAMES = (
    "colwise",
    "rowwise",
    "sequence",
    "colwise_rep",
    "rowwise_rep",
    "fused_experts",
    "fused_experts_partial",
)
# Hugging Face's tp_plan spellings that mean the same thing
_ALIASES = {"sequence_parallel": "sequence", "local_colwise": "colwise", "local_rowwise": "rowwise"}
_SPLITTABLE = (nn.Linear, nn.Embedding)


def _style(name: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from kiln.parallel.transforms.fused_experts import FusedExpertsParallel

    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "sequence": SequenceParallel,
        # the output gathered on every rank (e.g. an LM head feeding an ordinary loss)
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(output_layouts=Replicate()),
        # transformers' fused MoE experts (kiln.parallel.transforms.fused_experts)
        "fused_experts": FusedExpertsParallel,
        # the same, each rank's partial sum left a Partial() DTensor (a sequence-parallel MoE block)
        "fused_experts_partial": lambda: FusedExpertsParallel(partial_output=True),
    }
    return styles[name]()


def matching_modules(model: nn.Module, pattern: str) -> list[str]:
    """Names of the modules ``pattern`` selects, matched dot-separated part by part as
    ``parallelize_module`` does (``"layers.*.mlp.fc1"``; a ``*`` never spans a dot)."""
    parts = pattern.split(".")
    return [
        name
        for name, _ in model.named_modules()
        if name
        and len(name.split(".")) == len(parts)
        and all(fnmatch.fnmatchcase(a, b) for a, b in zip(name.split("."), parts))
    ]


def resolve_tp_plan(model: nn.Module, plan: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate a plan against the model and turn style names into ``ParallelStyle`` objects.

    ``plan=None`` uses the model's own plan (:func:`model_tp_plan`). Raises ``ValueError`` naming
    the pattern, the value and the fix when a pattern selects no module, a style is unknown or a
    ``colwise``/``rowwise`` target is not a Linear or Embedding. Runs no collective.
    """
    from torch.distributed.tensor.parallel import ParallelStyle

    if plan is None:
        plan = model_tp_plan(model)
        if plan is None:
            raise ValueError(
                f"TensorParallel(plan=None) needs a plan: pass plan={{'layers.*.fc1': 'colwise', ...}} "
                f"or give {type(model).__name__} a tp_plan attribute"
            )
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(
            f"tensor-parallel plan={plan!r} must be a non-empty mapping of module-name patterns to "
            f"styles ({', '.join(_STYLE_NAMES)})"
        )
    resolved: dict[str, Any] = {}
    for pattern, style in plan.items():
        names = matching_modules(model, pattern)
        if not names:
            top = ", ".join(n for n, _ in model.named_children())
            raise ValueError(
                f"tensor-parallel plan key {pattern!r} names no module of {type(model).__name__} "
                f"(its top-level modules: {top}); use dotted module names, '*' for one level"
            )
        if isinstance(style, ParallelStyle):
            resolved[pattern] = style
            continue
        key = _ALIASES.get(str(style), str(style))
        if key not in _STYLE_NAMES:
            raise ValueError(
                f"tensor-parallel plan[{pattern!r}]={style!r} is not a style; expected one of "
                f"{', '.join(_STYLE_NAMES)} or a torch ParallelStyle object"
            )
        if key in ("fused_experts", "fused_experts_partial"):
            from kiln.parallel.transforms.fused_experts import is_fused_experts

            for name in names:
                module = model.get_submodule(name)
                if not is_fused_experts(module):
                    raise ValueError(
                        f"tensor-parallel plan[{pattern!r}]={style!r} selects {name!r}, a {type(module).__name__}; "
                        "fused_experts splits a module of 3-D gate_up_proj and down_proj parameters (transformers' "
                        "fused MoE experts): point the pattern at such a module"
                    )
        elif key != "sequence":
            for name in names:
                module = model.get_submodule(name)
                if not isinstance(module, _SPLITTABLE):
                    raise ValueError(
                        f"tensor-parallel plan[{pattern!r}]={style!r} selects {name!r}, a "
                        f"{type(module).__name__}; {key} splits only nn.Linear and nn.Embedding "
                        "weights: point the pattern at the Linear layers inside it"
                    )
        resolved[pattern] = _style(key)
    return resolved


def model_tp_plan(model: nn.Module) -> Mapping[str, Any] | None:
    """The plan a model brings: a Hugging Face model's (:func:`huggingface_tp_plan`) when ``model``
    is one, else its ``tp_plan`` attribute, else that of a Hugging Face model inside it; None if none.

    (A transformers model's own ``tp_plan`` attribute uses transformers' style names, which
    torch does not know: its ``base_model_tp_plan`` is translated instead.)
    """
    from kiln.models.tp_plan import huggingface_tp_plan, is_huggingface_module

    if is_huggingface_module(model):
        return huggingface_tp_plan(model)
    plan = getattr(model, "tp_plan", None)
    return plan if plan is not None else huggingface_tp_plan(model)


def check_tp_size(model: nn.Module, plan: Mapping[str, Any], tp: int, *, pipeline: bool = False) -> None:
    """Refuse a tensor-parallel size that does not divide the heads of an attention layer ``plan``
    splits: each rank must hold whole query and key/value heads (with grouped-query attention,
    ``num_key_value_heads`` too). An attention layer is the parent of a split layer that has a
    ``head_dim`` and a ``config`` with ``num_attention_heads`` (transformers' convention).

    ``pipeline``: the model is also cut into pipeline stages, which traces it before tensor
    parallelism splits it. The trace sees each split Linear as one rank will
    (:mod:`kiln.parallel.pipelining.tp_trace`), so grouped-query attention's repeated heads get a rank's
    counts; a split layer of a grouped-query attention whose style leaves sizes kiln cannot tell
    (a custom ``ParallelStyle``) is refused.

    Raises ``ValueError`` naming the layer, the counts and the sizes that fit. Runs no collective.
    """
    if tp <= 1:
        return
    checked: set[str] = set()
    # each pattern matched once: walking the model's modules per attention layer and pattern took
    # Llama-3-70B's 80 layers 5 s per dry-run rank
    matches = {pattern: matching_modules(model, pattern) for pattern in plan}
    for pattern in plan:
        for name in matches[pattern]:
            parent_name = name.rpartition(".")[0]
            if parent_name in checked:
                continue
            checked.add(parent_name)
            parent = model.get_submodule(parent_name) if parent_name else model
            config = getattr(parent, "config", None)
            heads = getattr(config, "num_attention_heads", None)
            if not hasattr(parent, "head_dim") or not isinstance(heads, int):
                continue
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            if pipeline and kv_heads != heads:
                _check_traceable_split(model, plan, matches, tp, parent_name, heads, kv_heads)
            for field, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
                if count % tp:
                    fits = [d for d in range(2, heads + 1) if heads % d == 0 and kv_heads % d == 0]
                    raise ValueError(
                        f"tensor parallelism over {tp} ranks splits the attention {parent_name!r} by heads, but "
                        f"its config has {field}={count}, which {tp} does not divide (each rank must hold whole "
                        f"heads); use a tensor-parallel size in {fits or '(none: keep tp=1)'}, or a plan that "
                        "leaves the attention whole"
                    )


def _check_traceable_split(
    model: nn.Module,
    plan: Mapping[str, Any],
    matches: Mapping[str, list[str]],
    tp: int,
    attention: str,
    heads: int,
    kv_heads: int,
) -> None:
    # A traced pipeline stage keeps the sizes of the trace: it must see what one rank computes
    prefix = f"{attention}." if attention else ""
    for pattern, style in plan.items():
        for name in matches[pattern]:
            if not name.startswith(prefix) or "." in name[len(prefix) :]:
                continue
            if local_linear_features(model.get_submodule(name), style, tp) is None:
                raise ValueError(
                    f"tensor parallelism inside pipeline stages cannot split the grouped-query attention "
                    f"{attention!r} ({heads} query heads, {kv_heads} key/value heads) with plan[{pattern!r}]="
                    f"{style!r}: the pipeline traces the model as one rank computes it, and kiln does not know "
                    "what that style leaves on a rank; use 'colwise'/'rowwise' (torch's ColwiseParallel/"
                    "RowwiseParallel with their default layouts) there, or tp without pp"
                )


def apply_tp(model: nn.Module, tp_mesh, plan: Mapping[str, Any]) -> nn.Module:
    """Parallelise ``model`` in place over ``tp_mesh`` with a resolved plan."""
    from torch.distributed.tensor.parallel import parallelize_module

    from kiln.parallel.transforms.sequence_parallel import mark_loss_parallel

    parallelize_module(model, tp_mesh, dict(plan))
    mark_loss_parallel(model, plan)
    return model


def local_linear_features(module: nn.Module, style: Any, tp: int) -> tuple[int, int] | None:
    """(in_features, out_features) of the local computation of one rank, for an ``nn.Linear``
    split by ``style`` over ``tp`` ranks; None when kiln does not know what the style leaves on a
    rank (a custom ParallelStyle) or ``module`` is not a Linear.

    ``style`` is a plan value: a style name (``"colwise"``, ``"rowwise"``, ``"colwise_rep"``,
    ``"rowwise_rep"``) or torch's ``ColwiseParallel``/``RowwiseParallel`` object.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(module, nn.Linear):
        return None
    n_in, n_out = module.in_features, module.out_features
    if isinstance(style, str):
        # rowwise_rep only changes the output's layout (gathered); its input is split as rowwise's
        return {
            "colwise": (n_in, n_out // tp),
            "colwise_rep": (n_in, n_out),
            "rowwise": (n_in // tp, n_out),
            "rowwise_rep": (n_in // tp, n_out),
        }.get(style)
    if type(style) is ColwiseParallel:
        out = style.output_layouts[0] if style.output_layouts else None
        if isinstance(out, Replicate):
            return n_in, n_out
        if isinstance(out, Shard) and out.dim in (-1, 1) and style.use_local_output:
            return n_in, n_out // tp
        return None
    if type(style) is RowwiseParallel:
        inp = style.input_layouts[0] if style.input_layouts else None
        return (n_in // tp, n_out) if isinstance(inp, Shard) and inp.dim == -1 else None
    return None
