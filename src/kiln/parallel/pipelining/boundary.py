"""Stage outputs keep the dtypes the pipeline was traced with.

torch.distributed.pipelining sizes every send and receive buffer from the traced model. kiln traces
it in the dtype its stages' parameters compute in: FSDP's mixed-precision dtype where FSDP shards
the stages (bfloat16 under amp_bf16: :class:`~kiln.parallel.pipelining.runtime.PipelineRuntime`'s
``trace_dtype``), else the storage dtype (float32 under autocast alone, whose eager residual stream
is float32 too). Autocast can still change a stage's output dtype at run time (a stage that ends in
a Linear returns bfloat16 from a float32 trace; one that ends in a norm returns float32 from a
bfloat16 one), and the receiving rank's buffer has the traced dtype: with gloo the bytes of a
bfloat16 tensor land in a float32 buffer and the losses are garbage (1e21 on the first step, nan
on the second), and with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch stops with "Stage 0 forward
outputs[0]: dtype mismatch: torch.float32 vs torch.bfloat16".

Casting each stage's floating-point outputs to the traced dtype fixes both: the next stage computes
on the values it was traced for (its autocast or FSDP input cast takes them down where it would),
and autograd's cast backward hands the gradient back in the dtype the stage computed in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["keep_traced_dtypes", "traced_output_dtypes"]


def traced_output_dtypes(pipe: Any, stage_index: int) -> Any:
    """The dtype of each output of stage ``stage_index`` of a traced ``Pipe`` (before
    ``build_stage`` takes the stage's module), in the shape of the output: a dtype, or a
    tuple/list of them; None for what is not a tensor."""
    graph = pipe.split_gm.graph
    node = next(n for n in graph.nodes if n.op == "call_module" and n.meta.get("stage_idx") == stage_index)
    submod = pipe.split_gm.get_submodule(node.target)
    out = next(n for n in submod.graph.nodes if n.op == "output").args[0]
    return _dtypes(out)


def _dtypes(node: Any) -> Any:
    if isinstance(node, (tuple, list)):
        return type(node)(_dtypes(n) for n in node)
    value = getattr(node, "meta", {}).get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def _cast(value: Any, dtypes: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if isinstance(dtypes, torch.dtype) and value.is_floating_point() and value.dtype != dtypes:
            return value.to(dtypes)
        return value
    if isinstance(value, (tuple, list)) and isinstance(dtypes, (tuple, list)) and len(value) == len(dtypes):
        return type(value)(_cast(v, d) for v, d in zip(value, dtypes, strict=True))
    return value


def keep_traced_dtypes(module: nn.Module, dtypes: Any) -> None:
    """Cast ``module``'s floating-point outputs to ``dtypes`` (see the module docstring) after
    every forward, with whatever other hooks (FSDP's) the module has."""

    def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
        return _cast(output, dtypes)

    module.register_forward_hook(hook)
