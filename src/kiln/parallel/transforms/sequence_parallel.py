"""Sequence parallelism and loss parallelism: the switches of tensor parallelism that decide which
plan it applies (:class:`kiln.parallel.TensorParallel` and :class:`kiln.parallel.Hybrid` take them).

With ``tp > 1`` and no plan of the user's, kiln uses the model's sequence-parallel plan when it has
one (a Llama-family or MoE (Mixtral, Qwen2-MoE, Qwen3-MoE) Hugging Face causal LM:
:func:`kiln.models.tp_plan.huggingface_sequence_parallel_plan`;
a kiln model with a ``sequence_parallel_plan(loss_parallel=...)`` method, such as
:class:`kiln.models.MoELlama`):

* **sequence parallelism** (``sequence_parallel``): between the tensor-parallel projections the
  residual stream and the norms are sharded on the sequence dimension over the ``tp`` ranks; each
  attention and MLP all-gathers the sequence before its column-wise projections and its row-wise
  projection reduce-scatters its output back to the shards (where plain tensor parallelism
  all-reduces it and every rank holds the whole sequence). The same bytes move; the norms' and
  residuals' activations take 1/tp of the memory, and their compute is split too.
* **loss parallelism** (``loss_parallel``, on with sequence parallelism): the embedding is split
  over the vocabulary, the LM head column-wise with its logits left sharded over the vocabulary,
  and the cross-entropy is computed on the shards (torch's ``loss_parallel()``): no rank holds the
  ``tokens x vocab`` logits, each holds ``tokens x vocab / tp``.

``None`` (the default) is "on where kiln has a plan": tp > 1, no plan given, no context
parallelism, and a model kiln has a plan for; under a pipeline, sequence parallelism runs inside
each stage (except for the MoE families, which keep plain tensor parallelism there) and loss
parallelism is off. ``True`` asks for it and is refused in one
line where it cannot run; ``False`` turns it off (the plain tensor-parallel plan, bit for bit).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["sequence_parallel_plan", "mark_loss_parallel", "shards_vocabulary"]


def _check_switch(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True, False or None (on where kiln has a plan)")


def sequence_parallel_plan(
    model: nn.Module,
    *,
    sequence_parallel: bool | None,
    loss_parallel: bool | None,
    plan: Mapping[str, Any] | None,
    tp: int,
    blocker: str | None = None,
    pipeline: str | None = None,
) -> dict[str, Any] | None:
    """The tensor-parallel plan with sequence (and loss) parallelism for ``model``, or None when
    sequence parallelism is off (the caller then resolves the ordinary plan).

    Args:
        sequence_parallel / loss_parallel: the user's switches (None: on where kiln has a plan).
        plan: the user's tensor-parallel plan; kiln's sequence-parallel plan is used only without one.
        tp: the tensor-parallel size (nothing to do at 1).
        blocker: what else runs that sequence parallelism does not combine with (``"cp=2"``), if any.
        pipeline: the pipeline it runs in (``"pp=2"``), if any: sequence parallelism runs inside each
            stage (:mod:`kiln.parallel.pipelining.sequence_stages`), loss parallelism does not (the
            last stage's logits are gathered: its default is off, and True is refused).

    Raises ``ValueError`` in one line, before any collective, when a switch set to True cannot be
    honoured: no plan for the model (it says why), a plan of the user's, a pipeline, or
    ``loss_parallel=True`` with ``sequence_parallel=False``.
    """
    _check_switch("sequence_parallel", sequence_parallel)
    _check_switch("loss_parallel", loss_parallel)
    if loss_parallel and sequence_parallel is False:
        raise ValueError(
            "loss_parallel=True with sequence_parallel=False: kiln's loss-parallel plans are part of its "
            "sequence-parallel ones; set sequence_parallel=True (or None), or loss_parallel=False"
        )
    asked = bool(sequence_parallel or loss_parallel)
    which = "sequence_parallel=True" if sequence_parallel else "loss_parallel=True"
    if tp <= 1 or sequence_parallel is False:
        return None
    if pipeline is not None and loss_parallel:
        raise ValueError(
            f"loss_parallel=True does not run with {pipeline} in kiln (the last stage's logits are gathered "
            "whole); set loss_parallel=False (or leave it None: off under a pipeline)"
        )
    if pipeline is not None:
        loss_parallel = False
    if blocker is not None:
        if asked:
            raise ValueError(
                f"{which} does not run with {blocker} in kiln; set sequence_parallel=False (or leave it None)"
            )
        return None
    if plan is not None:
        if asked:
            raise ValueError(
                f"{which} uses kiln's own sequence-parallel plan for the model, and a tensor-parallel plan was "
                "given; pass no plan (plan=None / tp_plan=None), or write SequenceParallel and the layouts into "
                "your plan and set sequence_parallel=False"
            )
        return None
    from kiln.models.tp_plan import (
        huggingface_pipeline_sequence_parallel_refusal,
        huggingface_sequence_parallel_plan,
        huggingface_sequence_parallel_refusal,
        is_huggingface_module,
        tied_embeddings,
    )

    builder = getattr(model, "sequence_parallel_plan", None)
    # a MoE family keeps plain tensor parallelism in pipeline stages
    why = huggingface_pipeline_sequence_parallel_refusal(model) if pipeline is not None else None
    if why is not None:
        pass  # refused below when asked
    elif callable(builder):  # a kiln model (HuggingFaceModel, MoELlama) that brings its own
        reason = getattr(model, "sequence_parallel_refusal", None)
        why = reason() if callable(reason) else None
        if why is None:
            lp = loss_parallel if loss_parallel is not None else not tied_embeddings(model)
            return dict(builder(loss_parallel=lp))
    elif is_huggingface_module(model):
        # a bare transformers model computes its own loss from whole logits: no loss parallelism
        if loss_parallel:
            raise ValueError(
                f"loss_parallel=True: a bare {type(model).__name__} computes its loss from whole logits; wrap it "
                "in kiln.models.HuggingFaceModel, whose loss runs on the vocabulary shards, or set loss_parallel=False"
            )
        why = huggingface_sequence_parallel_refusal(model)
        if why is None:
            return huggingface_sequence_parallel_plan(model, loss_parallel=False)
    else:
        why = f"{type(model).__name__} has no sequence_parallel_plan method and is no Hugging Face model"
    if asked:
        raise ValueError(
            f"{which}: kiln has no sequence-parallel plan for {type(model).__name__} ({why}); set "
            "sequence_parallel=False, or give the model a sequence_parallel_plan(loss_parallel=...) method"
        )
    return None


def shards_vocabulary(style: Any) -> bool:
    """Whether ``style`` leaves a Linear's output a DTensor sharded on its last dimension (a
    loss-parallel LM head: ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    if not isinstance(style, ColwiseParallel) or style.use_local_output:
        return False
    out = style.output_layouts[0] if style.output_layouts else None
    return isinstance(out, Shard) and out.dim in (-1, 2)


def mark_loss_parallel(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Tell a model with a ``loss_parallel`` attribute (:class:`kiln.models.HuggingFaceModel`) that
    the plan applied leaves its logits sharded over the vocabulary: it then computes the loss itself,
    on the shards, instead of handing the labels to the transformers model."""
    if hasattr(model, "loss_parallel") and any(shards_vocabulary(style) for style in plan.values()):
        setattr(model, "loss_parallel", True)  # noqa: B010  # an attribute nn.Module's typing does not know
