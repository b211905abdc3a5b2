"""A traced pipeline stage runs the model's casts on whatever dtype its parameters run in.

torch.export records a model's ``tensor.to(dtype)`` as the cast plus an assertion that the tensor
has the dtype it had at trace time: ``aten._assert_tensor_metadata(tensor, dtype=...)`` before
``aten.to.dtype(tensor, ...)``. kiln traces a pipeline in the parameters' storage dtype (float32
under ``amp_bf16``), but FSDP's bf16 mixed-precision policy runs the stage on bf16 parameters and
activations: the first forward stops at the assertion ("Tensor dtype mismatch! Expected:
torch.float32, Got: torch.bfloat16"; a Hugging Face Llama's RMSNorm casts its input to float32)
although the cast right after it would have done what the model asks.

:func:`drop_cast_assertions` removes those assertions, and only those whose tensor the graph then
casts: the casts run (the RMSNorm computes in float32 on bf16 input, as the model asks), and an
assertion on a tensor nothing casts is kept. Where the trace made a later use of the tensor read the
cast (export aliases a cast that changed nothing), that use sees the traced dtype.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["drop_cast_assertions"]


def _is_cast(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in ("to", "_to_copy")


def drop_cast_assertions(stage: nn.Module) -> int:
    """Remove, in every graph of ``stage``, each dtype assertion on a tensor that the graph casts;
    returns how many were removed."""
    target = torch.ops.aten._assert_tensor_metadata.default
    removed = 0
    for module in stage.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        before = removed
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is target and any(_is_cast(u) for u in node.args[0].users):
                graph.erase_node(node)
                removed += 1
        if removed > before and isinstance(module, torch.fx.GraphModule):
            module.recompile()
    return removed
