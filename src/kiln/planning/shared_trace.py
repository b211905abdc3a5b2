"""One trace of a pipelined model per dry run, shared by the ranks it measures.

A pipeline traces the whole model (``torch.export``) before it keeps its own stages
(:mod:`kiln.parallel.pipelining.runtime`), and a dry run measures the first rank of every pipeline
stage, each with a model of its own built anew. Every one of those traces is the same graph: the
ranks build the same model with the same split points, tensor-parallel stand-ins and first
microbatch, and differ only in which stages they keep afterwards. On Llama-3-70B's 80 layers one
trace takes minutes; 8 pipeline ranks traced it 8 times.

:func:`one_trace` keeps the first rank's exported program and hands each later rank the same graph
over its own model's tensors (its parameters and buffers, looked up by the names the program
lifted them under), so the cut into stages, the stages' parameters and everything after are that
rank's own, as if it had traced. A module whose parameter and buffer names, shapes and dtypes, or
whose inputs' shapes, differ from the first one's is traced anew. The tensor constants the trace
lifted (no parameter or buffer of the model) are real tensors, shared as they are.

FX's recording of each traced node's Python stack (``torch.fx.config.do_not_emit_stack_traces``)
is off while the block lasts: it is for error messages of a real run's graph, and took a fifth of
the trace's time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["one_trace"]


def _signature(module: nn.Module, args: Any, kwargs: Any) -> tuple:
    tensors = [
        (name, tuple(t.shape), t.dtype)
        for name, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    ]
    inputs = [
        (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in tree_flatten((args, kwargs))[0]
    ]
    return type(module), tuple(tensors), tuple(inputs)


def _own(value: Any) -> Any:
    """A fake tensor like ``value`` made by the fake mode now active (a fake tensor has no values to
    keep); anything else (torch.export keeps the constants it lifts as real tensors) as it is."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(value, FakeTensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device).requires_grad_(
        value.requires_grad
    )


def _rebound(program: Any, module: nn.Module) -> Any:
    """``program`` over ``module``'s own tensors, by the names the program lifted them under."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    tensors: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    state = {name: tensors[name] for name in program.state_dict}
    constants = {name: tensors[name] if name in tensors else _own(value) for name, value in program.constants.items()}

    # The graph's metadata holds the first rank's fake tensors, which the constructor checks against
    # the fake mode active (this rank's): checked with none active, it takes theirs.
    with unset_fake_temporarily():
        return _program(program, state, constants)


def _program(program: Any, state: dict[str, Any], constants: dict[str, Any]) -> Any:
    from torch.export import ExportedProgram

    return ExportedProgram(
        root=program.graph_module,
        graph=program.graph,
        graph_signature=program.graph_signature,
        state_dict=state,
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs,
        constants=constants,
        verifiers=program.verifiers,
    )


@contextlib.contextmanager
def one_trace() -> Iterator[dict[str, int]]:
    """Within the block, ``torch.export.export`` of a module like one exported before in the block
    returns the earlier program over this module's tensors (see the module docstring). Yields the
    counts ``{"traced": n, "shared": m}``."""
    import torch.export
    import torch.fx.config as fx_config

    export = torch.export.export
    programs: dict[tuple, Any] = {}
    counts = {"traced": 0, "shared": 0}

    def shared_export(
        module: nn.Module, args: tuple = (), kwargs: dict | None = None, *rest: Any, **options: Any
    ) -> Any:
        key = _signature(module, args, kwargs)
        if rest or options or key not in programs:
            counts["traced"] += 1
            program = export(module, args, kwargs, *rest, **options)
            if not rest and not options:
                programs[key] = program
            return program
        counts["shared"] += 1
        return _rebound(programs[key], module)

    stack_traces = getattr(fx_config, "do_not_emit_stack_traces", False)
    torch.export.export = shared_export  # type: ignore[assignment]  # same call, as torch's pipelining makes it
    fx_config.do_not_emit_stack_traces = True
    try:
        yield counts
    finally:
        torch.export.export = export
        fx_config.do_not_emit_stack_traces = stack_traces
