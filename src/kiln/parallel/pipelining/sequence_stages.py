"""Sequence parallelism inside traced pipeline stages (pipeline x tensor parallelism).

kiln's sequence-parallel plans (:mod:`kiln.parallel.transforms.sequence_parallel`) keep the
residual stream a DTensor sharded on the sequence between the projections. Inside a stage that is
what they do without a pipeline; three things differ in a traced stage:

* **The stage's boundaries.** torch's pipeline sends and receives plain tensors of the traced
  shapes (the whole sequence). A stage's floating-point inputs (the hidden states from the stage
  before) are cut to this rank's sequence shard as they enter (a slice: every tensor-parallel rank
  received the same tensor), and a sequence-sharded output is gathered whole before it is sent (one
  all-gather per microbatch and stage; its backward is the slice, and the slice's backward the
  gather, so the input gradients sent back are whole too). torchtitan sends the shards instead
  (1/tp of the bytes), which a traced stage cannot: its receive buffers have the traced shapes.
* **Which modules are split.** A traced stage's modules are fx ``InterpreterModule`` objects; the
  layers tensor parallelism splits (``nn.Linear``, ``nn.Embedding``) are put back as the original
  objects (``Hybrid``'s ``_restore_split_layers``), the norms stay traced (``SequenceParallel``
  replicates their weights and takes their sharded input as it takes an eager norm's).
* **How a block is called.** The traced attention block is called with its inputs positional, so a
  ``PrepareModuleInput`` keyed by keyword (``hidden_states``) would never see its input and each
  projection would gather the sequence on its own (three gathers for q, k and v instead of one).
  :class:`GatherSequence` gathers the block's sequence-sharded input, positional or keyword.

Loss parallelism stays off under a pipeline: the last stage's logits are gathered whole, and the
loss runs on them as without tensor parallelism.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["GatherSequence", "sequence_boundaries", "stage_styles"]


def GatherSequence(*, use_local_output: bool = False) -> Any:  # noqa: N802  # a style, named as torch's are
    """A ``ParallelStyle`` that gathers a block's sequence-sharded input (the ``Shard(1)`` DTensor the
    norm before it leaves) to the whole sequence (``Replicate()``) before its forward, as a DTensor
    (``use_local_output=False``) or a local tensor. (Its class is made on first use: the module
    imports no tensor-parallel code until a plan needs it.)"""
    return _gather_sequence_class()(use_local_output=use_local_output)


@functools.cache
def _gather_sequence_class() -> type:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ParallelStyle

    class _GatherSequence(ParallelStyle):
        def __init__(self, *, use_local_output: bool) -> None:
            super().__init__()
            self.use_local_output = use_local_output

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def gather(value: DTensor) -> torch.Tensor:
                whole = value.redistribute(device_mesh, (Replicate(),))
                return whole.to_local() if self.use_local_output else whole

            def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                # the sequence-sharded DTensor among the inputs (a traced call passes the hidden
                # states, the rotary pair and the mask in the traced order), or among its keywords
                for i, value in enumerate(args):
                    if isinstance(value, DTensor) and value.placements == (Shard(1),):
                        return (*args[:i], gather(value), *args[i + 1 :]), kwargs
                for key, value in kwargs.items():
                    if isinstance(value, DTensor) and value.placements == (Shard(1),):
                        return args, {**kwargs, key: gather(value)}
                return args, kwargs

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

    return _GatherSequence


def stage_styles(plan: Mapping[str, Any]) -> dict[str, Any]:
    """``plan`` for traced stages: each ``PrepareModuleInput`` that gathers the sequence of a
    block's keyword input becomes a :class:`GatherSequence` of its first tensor input."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    styles: dict[str, Any] = {}
    for pattern, style in plan.items():
        if isinstance(style, PrepareModuleInput) and style.input_kwarg_layouts:
            given = list(style.input_kwarg_layouts.values())
            wanted = list(style.desired_input_kwarg_layouts.values())
            if given == [Shard(1)] and wanted == [Replicate()]:
                style = GatherSequence(use_local_output=style.use_local_output)
        styles[pattern] = style
    return styles


def sequence_boundaries(stage: nn.Module, tp_mesh: Any) -> None:
    """Cut ``stage``'s floating-point inputs to this rank's sequence shard as they enter, and gather
    its sequence-sharded outputs whole as they leave (see the module docstring)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def shard(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.is_floating_point():
            whole = DTensor.from_local(value, tp_mesh, (Replicate(),), run_check=False)
            return whole.redistribute(placements=(Shard(1),))
        return value

    def whole(value: Any) -> Any:
        if isinstance(value, DTensor) and value.placements == (Shard(1),):
            return value.redistribute(placements=(Replicate(),)).to_local()
        if isinstance(value, (tuple, list)):
            return type(value)(whole(v) for v in value)
        return value

    def enter(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(shard(a) for a in args), {k: shard(v) for k, v in kwargs.items()}

    def leave(_module: nn.Module, _args: Any, output: Any) -> Any:
        return whole(output)

    stage.register_forward_pre_hook(enter, with_kwargs=True)
    stage.register_forward_hook(leave)
