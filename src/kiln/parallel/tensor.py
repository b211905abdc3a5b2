"""Tensor parallelism with DTensor's ``parallelize_module``.

A plan maps module-name patterns to styles. ``colwise`` splits a Linear's output features over the
ranks (its input is replicated), ``rowwise`` splits its input features (its output is summed over
the ranks): a ``colwise`` layer followed by a ``rowwise`` one, as in an MLP or attention block,
needs one all-reduce in the forward and one in the backward. ``sequence`` shards a norm layer's
activations along the sequence dimension. Every rank of the tensor-parallel group must be given
the same batch: the group is one data-parallel replica.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.parallel.grad_norm import clip_grad_norm_
from kiln.parallel.mesh import ParallelDims
from kiln.parallel.parallelize import ParallelizePlan, find_blocks
from kiln.parallel.strategy import Strategy

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = ["TensorParallel", "resolve_tp_plan", "apply_tp", "matching_modules"]

_STYLE_NAMES = ("colwise", "rowwise", "sequence", "colwise_rep", "rowwise_rep")
# Hugging Face's tp_plan spellings that mean the same thing
_ALIASES = {"sequence_parallel": "sequence", "local_colwise": "colwise", "local_rowwise": "rowwise"}
_SPLITTABLE = (nn.Linear, nn.Embedding)


def _style(name: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "sequence": SequenceParallel,
        # the output gathered on every rank (e.g. an LM head feeding an ordinary loss)
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(output_layouts=Replicate()),
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

    ``plan=None`` uses the model's own ``tp_plan`` attribute. Raises ``ValueError`` naming the
    pattern, the value and the fix when a pattern selects no module, a style is unknown or a
    ``colwise``/``rowwise`` target is not a Linear or Embedding. Runs no collective.
    """
    from torch.distributed.tensor.parallel import ParallelStyle

    if plan is None:
        plan = getattr(model, "tp_plan", None)
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
        if key != "sequence":
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


def apply_tp(model: nn.Module, tp_mesh, plan: Mapping[str, Any]) -> nn.Module:
    """Parallelise ``model`` in place over ``tp_mesh`` with a resolved plan."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, dict(plan))
    return model


class TensorParallel(Strategy):
    """Tensor parallelism over all ranks (``strategy="tp"``); for TP within data parallelism use
    :class:`kiln.parallel.Hybrid`.

    Args:
        plan: module-name patterns to ``"colwise"``, ``"rowwise"``, ``"sequence"`` (or
            ``"colwise_rep"``/``"rowwise_rep"``, or torch ``ParallelStyle`` objects). ``None``: the
            model's ``tp_plan`` attribute.

    Example::

        strategy = kiln.parallel.TensorParallel({"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"})
    """

    name = "tp"
    steps = ("placement", "float8", "tensor_parallel", "activation_checkpointing", "compile")

    def __init__(self, plan: Mapping[str, Any] | None = None) -> None:
        self.plan = plan
        # TP ranks are one data-parallel replica: they must all read the same batch.
        self.data_parallel_rank, self.data_parallel_size = 0, 1

    def parallelize_plan(self, model: nn.Module, ctx: Context, precision: Precision) -> ParallelizePlan:
        plan = resolve_tp_plan(model, self.plan)  # user errors first, before any collective
        return ParallelizePlan.on_mesh(
            ParallelDims(dp_shard=1, tp=ctx.world_size),
            ctx=ctx,
            precision=precision,
            options=self.parallelize_options,
            blocks=find_blocks(model),
            tp_plan=plan,
        )

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def describe(self) -> dict[str, Any]:
        plan = self.plan if self.plan is not None else "model.tp_plan"
        return {"name": self.name, "plan": {k: str(v) for k, v in plan.items()} if isinstance(plan, Mapping) else plan}

    def __repr__(self) -> str:
        return f"TensorParallel(plan={self.plan!r})"
