"""One trace and one cut of a pipelined model per dry run, shared by the ranks it measures.

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

The cut of that graph into stages (``torch.distributed.pipelining.pipeline``: the split, FX's code
for every stage, the unflattened modules) is the same on every rank too, and takes a fifth of a
70B rank. Within :meth:`SharedTraces.cut_only`, a pipeline's cut is made and kept, untouched, and
:class:`CutOnly` is raised out of the step: the dry run stops its first rank there
(:mod:`kiln.planning.dry_run`). The next cut of a module like it, in this process or in a process
forked from it (each fork has its own copy), takes the kept stages, once, over its own module's
tensors (the ones it would have lifted, looked up through the names the kept stages took them
from; fake tensors the cut made itself, such as a tied weight's copies, made anew in this rank's
fake mode), so each rank's stages are its own, as if it had cut them.

FX's recording of each traced node's Python stack (``torch.fx.config.do_not_emit_stack_traces``)
is off while the block lasts: it is for error messages of a real run's graph, and took a fifth of
the trace's time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["CutOnly", "SharedTraces", "one_trace"]


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
    keep; a parameter stays a parameter); anything else (torch.export keeps the constants it lifts
    as real tensors) as it is."""
    from torch._subclasses.fake_tensor import is_fake

    if not isinstance(value, torch.Tensor) or not is_fake(value):
        return value
    made = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    if isinstance(value, nn.Parameter):
        return nn.Parameter(made, value.requires_grad)
    return made.requires_grad_(value.requires_grad)


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    return tensors


def _rebound(program: Any, module: nn.Module) -> Any:
    """``program`` over ``module``'s own tensors, by the names the program lifted them under."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    tensors = _named_tensors(module)
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


class CutOnly(Exception):
    """Raised out of a pipeline's cut within :meth:`SharedTraces.cut_only`, once the stages are kept."""


# where a cut's stages hold their tensors: (module path in the split, "_parameters" / "_buffers" /
# "__dict__" (a lifted constant is a plain attribute), attribute name)
_Place = tuple[str, str, str]


@dataclass
class _KeptCut:
    pipe: Any  # torch's Pipe, as the cut made it
    # each tensor of the stages: the name of the module's tensor it is, or None (the cut made it)
    places: list[tuple[_Place, str | None]]


def _stage_tensors(pipe: Any) -> Iterator[tuple[_Place, torch.Tensor]]:
    for path, module in pipe.split_gm.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, value in getattr(module, kind).items():
                if value is not None:
                    yield (path, kind, name), value
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                yield (path, "__dict__", name), value


def _keep(pipe: Any, module: nn.Module) -> _KeptCut:
    names = {id(t): name for name, t in _named_tensors(module).items()}
    return _KeptCut(pipe, [(place, names.get(id(value))) for place, value in _stage_tensors(pipe)])


def _take(kept: _KeptCut, module: nn.Module) -> Any:
    """The kept stages over ``module``'s own tensors (see the module docstring)."""
    tensors = _named_tensors(module)
    split = kept.pipe.split_gm
    for (path, kind, name), source in kept.places:
        owner = split.get_submodule(path) if path else split
        table = vars(owner) if kind == "__dict__" else getattr(owner, kind)
        table[name] = tensors[source] if source is not None else _own(table[name])
    return kept.pipe


@dataclass
class SharedTraces:
    """What :func:`one_trace` shares: ``counts`` of ``{"traced", "shared", "cut", "cut_shared"}``
    (exports made and shared, cuts made and taken from a kept one)."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("traced", "shared", "cut", "cut_shared"), 0))
    stopping: bool = False
    kept: dict[tuple, _KeptCut] = field(default_factory=dict)

    @contextlib.contextmanager
    def cut_only(self) -> Iterator[None]:
        """Within the block, a pipeline's cut is kept for the next module like this one, and
        :class:`CutOnly` is raised out of it (see the module docstring)."""
        self.stopping = True
        try:
            yield
        finally:
            self.stopping = False


@contextlib.contextmanager
def one_trace() -> Iterator[SharedTraces]:
    """Within the block, ``torch.export.export`` of a module like one exported before in the block
    returns the earlier program over this module's tensors, and a pipeline's cut kept by
    :meth:`SharedTraces.cut_only` is taken by the next one (see the module docstring)."""
    import torch.distributed.pipelining as pipelining
    import torch.export
    import torch.fx.config as fx_config

    export, pipeline = torch.export.export, pipelining.pipeline
    programs: dict[tuple, Any] = {}
    shared = SharedTraces()
    counts = shared.counts

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

    def shared_pipeline(
        module: nn.Module, mb_args: tuple, mb_kwargs: dict | None = None, split_spec: dict | None = None, **rest: Any
    ) -> Any:
        if split_spec is None or rest:
            return pipeline(module, mb_args, mb_kwargs, split_spec, **rest)
        key = (_signature(module, mb_args, mb_kwargs), tuple(split_spec.items()))
        kept = None if shared.stopping else shared.kept.pop(key, None)
        if kept is not None:
            counts["cut_shared"] += 1
            return _take(kept, module)
        counts["cut"] += 1
        pipe = pipeline(module, mb_args, mb_kwargs, split_spec)
        if shared.stopping:
            shared.kept[key] = _keep(pipe, module)
            raise CutOnly(f"the pipeline's {pipe.num_stages} stages are cut and kept")
        return pipe

    stack_traces = getattr(fx_config, "do_not_emit_stack_traces", False)
    torch.export.export = shared_export  # type: ignore[assignment]  # same call, as torch's pipelining makes it
    pipelining.pipeline = shared_pipeline  # type: ignore[assignment]  # read at each cut (PipelineRuntime.build)
    fx_config.do_not_emit_stack_traces = True
    try:
        yield shared
    finally:
        torch.export.export = export
        pipelining.pipeline = pipeline
        fx_config.do_not_emit_stack_traces = stack_traces
