"""Pipeline parallelism on ``torch.distributed.pipelining``.

The model is traced once (``torch.distributed.pipelining.pipeline``, torch.export underneath) and
cut before each split point; each rank keeps its stage(s), with the original parameter names (which
stages, and which schedules need several per rank: :mod:`kiln.parallel.pipelining.schedules`).
A model whose weights are read after the strategy's steps (``HuggingFaceModel.from_pretrained``,
built on the meta device) is traced with its parameters as fake tensors (no storage, as in a dry
run) and each rank reads its own stages' weights after the cut and their sharding steps
(``load_stage_weights``): no pipeline rank ever holds the whole model. A batch is cut into
microbatches and a schedule (GPipe, 1F1B, interleaved 1F1B, or the zero-bubble interleaved, ZBV
and DualPipeV) runs the forward, the loss on the last stage and the backward of every microbatch
in one ``schedule.step``. A weight several stages read (tied embeddings) is a copy in each; the
copies' gradients are summed after the step's last backward
(:mod:`kiln.parallel.pipelining.tied_weights`, Megatron's embedding group).

How the Engine's four calls map onto that one step (through :class:`PipelineSteps`' ``loss`` and
``backward``, which Pipeline and Hybrid inherit):

=====================  ===========================================================================
``out = engine(x)``    the model returns a :class:`PipelineOutput` that only holds ``x``
``engine.criterion``   records ``(criterion, out, target)``; returns a 0-d tensor, filled in below
``engine.backward``    runs ``schedule.step``: each microbatch loss is ``criterion(out_mb, y_mb)``
                       times the Engine's scale (1/accumulation or ``weight``, and the fp16 loss
                       scale) / microbatches; the mean unscaled loss is written into the tensor from
                       ``criterion`` and broadcast from the last stage, so every rank can log it
``engine.step``        steps each rank's optimizer over its own stage's parameters
=====================  ===========================================================================

Code that drives a step itself (a Trainer whose model computes its own loss) calls
``strategy.pipeline.train_step(args, kwargs, target, loss_fn)`` directly. The pipeline of a
:class:`kiln.Model` is a ``kiln.Model`` too (its ``loss``, ``eval_forward`` and metrics are the
model's), and its target may be the whole batch (a dict): each microbatch's loss gets its rows.
torch passes a pipeline's inputs to its first stage only, so a model whose batch holds what only
the loss reads (a Hugging Face model's ``labels``) names the stages' part with a
``pipeline_inputs(batch)`` method; the loss still gets the whole batch. In eval mode or under
``torch.no_grad()`` the model runs a forward-only schedule and returns the last stage's output on
every rank. The traced shapes are fixed: every batch must have the shape of the first one
(``drop_last=True``), and its size must divide into ``microbatches``.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from kiln.core.batch import num_samples
from kiln.core.model import Model
from kiln.parallel.pipelining.boundary import keep_traced_dtypes, traced_output_dtypes
from kiln.parallel.pipelining.schedules import (
    MULTI_STAGE,
    V_SHAPED,
    forward_only,
    schedule_class,
    set_up_stages,
    skip_same_rank_warmup,
    stage_ids,
    stage_rank,
)
from kiln.parallel.pipelining.tied_weights import TiedWeights, keep_read_copies, tied_names
from kiln.parallel.state.optimizer_params import parameter_names, repoint_optimizer

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from kiln.precision import Precision
__all__ = [
    "PipelineOutput",
    "PipelineModule",
    "PipelineRuntime",
    "validate_split_points",
    "full_pipeline_state_dict",
]


def validate_split_points(model: nn.Module, split_points: Sequence[str]) -> None:
    """Every split point must name a (non-root) submodule, once. Runs no collective."""
    names = [n for n, _ in model.named_modules() if n]
    for point in split_points:
        if not isinstance(point, str) or point not in names:
            close = difflib.get_close_matches(str(point), names, n=3)
            hint = (
                f"did you mean {', '.join(map(repr, close))}?" if close else f"its modules start {', '.join(names[:8])}"
            )
            raise ValueError(
                f"Pipeline split point {point!r} is not a module of {type(model).__name__}; a split point "
                f"names the module where a new stage begins ({hint})"
            )
    if len(set(split_points)) != len(split_points):
        raise ValueError(f"Pipeline split_points={list(split_points)!r} names a module twice; list each boundary once")


class PipelineOutput:
    """What ``engine(x)`` returns under pipeline parallelism in training: the inputs, kept for the
    schedule that ``engine.backward`` runs (forward and backward happen there, microbatch by microbatch)."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.args, self.kwargs = args, kwargs

    def __repr__(self) -> str:
        return "PipelineOutput(deferred: pass it to engine.criterion(out, target), then engine.backward(loss))"


def _merge_into(dst: nn.Module, sources: Sequence[nn.Module]) -> None:
    # Mirror the original module tree: a child held by one source is attached as is; a name held by
    # several (e.g. "layers" when one rank holds stages 0 and 2) becomes a fresh container.
    children: dict[str, list[nn.Module]] = {}
    for src in sources:
        for name, p in src._parameters.items():
            if p is not None:
                dst.register_parameter(name, p)
        for name, b in src._buffers.items():
            if b is not None:
                dst.register_buffer(name, b, persistent=name not in src._non_persistent_buffers_set)
        for name, child in src._modules.items():
            if child is not None:
                children.setdefault(name, []).append(child)
    for name, mods in children.items():
        if len(mods) == 1:
            dst.add_module(name, mods[0])
        else:
            container = nn.Module()
            _merge_into(container, mods)
            dst.add_module(name, container)


class PipelineModule(nn.Module):
    """This rank's stage modules under their original names (state dicts, optimizers and
    clipping see exactly this rank's parameters); calling it defers to the schedule."""

    def __init__(self, model: nn.Module, runtime: PipelineRuntime) -> None:
        super().__init__()
        self.runtime = runtime  # a plain object, not a submodule
        _merge_into(self, [model])  # until the stages exist, the whole model

    def show_stages(self, modules: Sequence[nn.Module]) -> None:
        self._parameters.clear()
        self._buffers.clear()
        self._modules.clear()
        _merge_into(self, modules)

    def gather_full_state_dict(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's full (unsharded) state dict merged with the other pipeline ranks' ones."""
        local = {k: v.detach().cpu() for k, v in local.items()}
        if not self.runtime.built:
            return local  # not cut yet: this rank holds the whole model
        parts: list[Any] = [None] * self.runtime.pp_size
        dist.all_gather_object(parts, local, group=self.runtime.group)
        return {k: v for part in parts for k, v in part.items()}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            return PipelineOutput(args, kwargs)
        return self.runtime.eval_forward(args, kwargs)


class ModelPipelineModule(PipelineModule, Model):
    """The pipeline view of a :class:`kiln.Model`: a ``kiln.Model`` whose forward is the
    pipeline's and whose loss, eval outputs and metrics are the user's model's, so the Trainer
    treats it as the model it was given."""

    def loss(self, outputs: Any, batch: Any) -> Any:
        return cast(Model, self.runtime.model).loss(outputs, batch)

    def eval_forward(self, batch: Any, outputs: Any | None = None) -> Any:
        return cast(Model, self.runtime.model).eval_forward(batch, outputs if outputs is not None else self(batch))

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return cast(Model, self.runtime.model).get_metrics(is_train)

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        cast(Model, self.runtime.model).update_metric(batch, outputs, metric)


def _rows(data: Any, index: torch.Tensor, size: int) -> Any:
    """The rows ``index`` of every tensor in ``data`` whose first dimension is ``size``."""
    if isinstance(data, torch.Tensor):
        return data[index.to(data.device)] if data.dim() and data.shape[0] == size else data
    if isinstance(data, (tuple, list)):
        return type(data)(_rows(item, index, size) for item in data)
    if isinstance(data, Mapping):  # a dict, or e.g. transformers' BatchEncoding
        return {k: _rows(v, index, size) for k, v in data.items()}
    return data


def _skip_connection(pipe: Any) -> str | None:
    """Why the cut model cannot train: a floating-point value one stage sends to more than one later
    stage (a skip connection), whose backward torch.distributed.pipelining does not run. None if none."""
    import operator

    graph = pipe.split_gm.graph
    stages = {node: node.meta.get("stage_idx") for node in graph.nodes if node.op == "call_module"}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in stages:
            source, index = node.args[0], node.args[1]
        elif node in stages:
            source, index = node, None
        else:
            continue
        consumers = sorted(stages[user] for user in node.users if user in stages)
        if len(consumers) < 2:
            continue
        out = next(n for n in pipe.split_gm.get_submodule(source.target).graph.nodes if n.op == "output").args[0]
        value = (out[index] if index is not None else out).meta.get("val")
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return (
                f"stage {stages[source]} passes a {str(value.dtype).replace('torch.', '')} tensor of shape "
                f"{list(value.shape)} to stages {consumers} (a skip connection, such as a transformer's position "
                "embeddings computed once for every layer), and torch.distributed.pipelining cannot run the "
                "backward of a skip connection; cut the model where each stage passes its outputs to the next "
                "stage only, or have each stage compute the value itself (a model's pipeline_trace(), as "
                "kiln.models.HuggingFaceModel does for its rotary embeddings)"
            )
    return None


def _weights_per_stage(model: nn.Module) -> list[tuple[str, Any]]:
    """The modules of ``model`` (with their names and a dot) whose parameters are still on the
    meta device, to be read stage by stage after the cut (``HuggingFaceModel.read_weights_per_stage``)."""
    return [
        (f"{name}." if name else "", module)
        for name, module in model.named_modules()
        if getattr(module, "_per_stage", False)
        and getattr(module, "deferred_weights", False)
        and callable(getattr(module, "load_stage_weights", None))
        and any(p.is_meta for p in module.parameters())
    ]


@contextmanager
def _on_fake_tensors(
    model: nn.Module, device: torch.device, param_dtype: torch.dtype | None = None
) -> Iterator[dict[int, torch.Tensor]]:
    """While tracing: every parameter and buffer of ``model`` is a fake tensor on ``device`` (meta
    parameters cannot meet the batch's device in a trace; fake ones have no storage either, as in a
    dry run), tied ones one fake; with ``param_dtype``, the floating-point parameters' fakes are of
    that dtype (the stages compute in it: :meth:`PipelineRuntime.build`). Yields the map from each
    fake's id to the tensor it stands for; the model gets its own tensors back when the block ends."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    # a dry run's tensors are fake already, of the mode it runs under: their stand-ins must be of it
    mode = detect_fake_mode(list(model.parameters())) or FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}
    originals: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    with mode:
        for module in model.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                for name, value in list(table.items()):
                    if value is None:
                        continue
                    if id(value) not in fakes:
                        dtype = (
                            param_dtype
                            if param_dtype is not None and table is module._parameters and value.is_floating_point()
                            else value.dtype
                        )
                        data = torch.empty_like(value, dtype=dtype, device=device if value.is_meta else value.device)
                        fake = nn.Parameter(data, value.requires_grad) if isinstance(value, nn.Parameter) else data
                        fakes[id(value)], originals[id(fake)] = fake, value
                    swapped.append((table, name, value))
                    table[name] = fakes[id(value)]
    try:
        with mode, warnings.catch_warnings():
            # torch copies a parameter several stages use (tied embeddings) with deepcopy, which
            # reads a fake tensor's data pointer; the copies are replaced by _put_back
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield originals
    finally:
        for table, name, value in swapped:
            table[name] = value


def _put_back(split: nn.Module, originals: Mapping[int, torch.Tensor], model: nn.Module) -> None:
    """The cut stages' tensors after a trace on fake ones: each the tensor its fake stood for (the
    model's meta parameters, its real buffers). torch copies a parameter that several stages use
    (tied embeddings: the first stage's embedding, the last stage's head) into each of them, so
    that no two stages share it; a copy becomes the model's own parameter again where its stage
    holds that one too under its other name (torch leaves both names in the first stage: one
    tensor, read once; the name the stage never reads is dropped next, by
    ``tied_weights.keep_read_copies``), else a meta parameter of its own, read from the files like
    the others."""
    from torch._subclasses.fake_tensor import is_fake

    by_name = dict(model.named_parameters(remove_duplicate=False))
    for stage in split.children():
        places = [
            (f"{prefix}.{name}" if prefix else name, table, name, value)
            for prefix, module in stage.named_modules()
            for table in (module._parameters, module._buffers)
            for name, value in table.items()
            if value is not None and (id(value) in originals or is_fake(value))
        ]
        held = {id(originals[id(value)]) for *_, value in places if id(value) in originals}
        for fqn, table, name, value in places:
            original = originals.get(id(value))
            if original is None and isinstance(value, nn.Parameter):
                source = by_name.get(fqn)
                if source is not None and id(source) in held:
                    original = source
                elif source is not None and not source.is_meta:  # traced on fakes for the dtype only
                    original = nn.Parameter(source.detach().clone(), value.requires_grad)
                else:
                    dtype = source.dtype if source is not None else value.dtype
                    original = nn.Parameter(torch.empty(value.shape, dtype=dtype, device="meta"), value.requires_grad)
            if original is None:
                raise RuntimeError(
                    f"pipeline stage tensor {fqn!r} was made while tracing on fake tensors and has no values; "
                    "load the model with meta_init=False"
                )
            table[name] = original


def _non_persistent_buffers(model: nn.Module) -> set[str]:
    """The names of ``model``'s buffers that its state dict leaves out (rotary frequencies, ...)."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in module._non_persistent_buffers_set
    }


def _keep_unsaved(stage: nn.Module, names: set[str]) -> None:
    # The trace registers every buffer of a stage as persistent; the ones the model leaves out of
    # its state dict stay out of the stage's (checkpoints of a pipeline hold the keys of one process).
    for prefix, module in stage.named_modules():
        for name in module._buffers:
            if (f"{prefix}.{name}" if prefix else name) in names:
                module._non_persistent_buffers_set.add(name)


# what _run returns for a step that only set up the schedule (PipelineRuntime.setting_up)
_SET_UP = object()


class PipelineRuntime:
    """The stages and schedule of one rank, built on the first batch (or from ``example_input``).

    Args:
        model: the full model (traced once; this rank keeps its stages).
        split_points: module names where stages 1, 2, ... begin.
        schedule: one of :data:`kiln.parallel.pipelining.schedules.SCHEDULES`.
        microbatches: microbatches per batch.
        group / pp_rank / pp_size: the pipeline process group and this rank's place in it.
        device, precision: where stages run, and the autocast to run them under.
        optimizer: pointed at this rank's parameters once the stages exist.
        transform: applied, in place, to each stage module after it is built (the per-stage steps of
            :mod:`kiln.parallel.transforms.parallelize`).
        pipelines: the global ranks of every pipeline of the world, each in pipeline-rank order (the
            same list on every rank; the groups that sum a tied weight's copies are made for all of
            them at once: :mod:`kiln.parallel.pipelining.tied_weights`). None: ``group`` is the only one.
        trace_dtype: the dtype the stages' parameters compute in where that is not their storage
            dtype (FSDP's mixed precision: bfloat16 under amp_bf16); the model is traced in it, so
            the stages send, receive and compute their gradients in it. None: the storage dtype.
    """

    def __init__(
        self,
        model: nn.Module,
        split_points: Sequence[str],
        schedule: str,
        microbatches: int,
        group: dist.ProcessGroup,
        pp_rank: int,
        pp_size: int,
        device: torch.device,
        precision: Precision,
        optimizer: torch.optim.Optimizer | None,
        transform: Callable[[nn.Module], None] | None = None,
        trace_context: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
        pipelines: Sequence[Sequence[int]] | None = None,
        trace_dtype: torch.dtype | None = None,
    ) -> None:
        self.model, self.split_points, self.schedule_name = model, list(split_points), schedule
        self.microbatches, self.group, self.pp_rank, self.pp_size = microbatches, group, pp_rank, pp_size
        self.device, self.precision, self.optimizer, self.transform = device, precision, optimizer, transform
        self.trace_context = trace_context  # entered around the trace (Hybrid's tensor parallelism: tp_trace)
        self.trace_dtype = trace_dtype
        self.num_stages = len(self.split_points) + 1
        # "loop" placement (stage s on rank s % pp), or the V of zbv and dualpipev, whose last stage
        # is on rank 0 (see kiln.parallel.pipelining.schedules)
        self.stage_ids = stage_ids(schedule, self.num_stages, pp_rank, pp_size)
        self.has_first, self.has_last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        last = stage_rank(schedule, self.num_stages - 1, self.num_stages, pp_size)
        self.last_rank = dist.get_global_rank(group, last)
        self.view = (ModelPipelineModule if isinstance(model, Model) else PipelineModule)(model, self)
        self._names = parameter_names(model)
        # the weights the model ties (before the cut copies them into each stage that reads them)
        self._tied_names = tied_names(model)
        self.pipelines = (
            [list(r) for r in pipelines] if pipelines is not None else [dist.get_process_group_ranks(group)]
        )
        self.tied = TiedWeights()  # this rank's copies of them, once the stages exist
        # The dtype the step's loss is reported in, the same on every rank (the broadcast from the
        # last stage needs it): float32, or float64 for a float64 model, whose loss is not rounded.
        floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
        self.loss_dtype = torch.float64 if floating and floating[0] == torch.float64 else torch.float32
        self._schedule: _PipelineSchedule | None = None
        self._step_loss: Callable[..., torch.Tensor] | None = None
        self._pending: tuple | None = None
        self._setting_up = False

    @property
    def built(self) -> bool:
        return self._schedule is not None

    @contextmanager
    def setting_up(self) -> Iterator[None]:
        """Within: a training step builds the stages (if they are not built yet) and sets up what the
        schedule's first step sets up (:func:`~kiln.parallel.pipelining.schedules.set_up_stages`),
        and runs no microbatch: no forward, no loss, no gradient (the step's loss is 0). The next
        step is then like every later one from its start, which is what a dry run measures
        (:mod:`kiln.planning.dry_run`). Where this torch's schedule cannot be set up apart from a
        step, the step runs whole."""
        self._setting_up = True
        try:
            yield
        finally:
            self._setting_up = False

    def build(self, args: tuple, kwargs: dict) -> None:
        """Trace the model on the first microbatch of ``args``/``kwargs`` and keep this rank's stages."""
        from torch.distributed.pipelining import SplitPoint, pipeline
        from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
        from torch.utils._pytree import tree_map_only

        args = self._stage_inputs(args)
        mb_args, mb_kwargs = split_args_kwargs_into_chunks(args, kwargs, self.microbatches)
        # the model's own preparation (a Hugging Face decoder's rotary embeddings computed in every
        # layer, kiln.models.hf_stages), then the strategy's (Hybrid's tensor parallelism: tp_trace)
        model_trace = getattr(self.model, "pipeline_trace", None)
        with (
            model_trace(*mb_args[0][:1]) if model_trace is not None else nullcontext(),
            self.trace_context(self.model) if self.trace_context is not None else nullcontext(),
        ):
            not_saved = _non_persistent_buffers(self.model)
            staged = _weights_per_stage(self.model)
            # The stages compute in trace_dtype (FSDP's bf16 under amp_bf16): traced in it, the
            # model's casts (an RMSNorm's back to its input's dtype) and the stage boundaries are in
            # it too, so what crosses a boundary and every gradient inside a stage are bf16, as in
            # the same model run eagerly under FSDP, not the storage dtype's float32.
            trace_dtype = self.trace_dtype
            if trace_dtype is not None and all(
                p.dtype == trace_dtype for p in self.model.parameters() if p.is_floating_point()
            ):
                trace_dtype = None
            on_fakes = bool(staged) or trace_dtype is not None
            if trace_dtype is not None:  # FSDP casts a stage's floating inputs the same way
                mb_args[0], mb_kwargs[0] = tree_map_only(
                    torch.Tensor,
                    lambda t: t.to(trace_dtype) if t.is_floating_point() else t,
                    (mb_args[0], mb_kwargs[0]),
                )
            with _on_fake_tensors(self.model, self.device, trace_dtype) if on_fakes else nullcontext() as originals:
                pipe = pipeline(
                    self.model,
                    mb_args=mb_args[0],
                    mb_kwargs=mb_kwargs[0],
                    split_spec={point: SplitPoint.BEGINNING for point in self.split_points},
                )
        if on_fakes:
            _put_back(pipe.split_gm, originals or {}, self.model)
        if pipe.num_stages != self.num_stages:
            raise ValueError(
                f"Pipeline split_points={self.split_points!r} gave {pipe.num_stages} stages instead of "
                f"{self.num_stages}: each split point must be a module the forward calls, listed in "
                "the order the forward calls them"
            )
        skip = _skip_connection(pipe)
        if skip is not None:
            raise ValueError(f"Pipeline split_points={self.split_points!r}: {skip}")
        # every rank sees every stage here: which stages hold a copy of a tied weight is known to all
        holders = keep_read_copies({i: pipe.get_stage_module(i) for i in range(pipe.num_stages)}, self._tied_names)
        dtypes = [traced_output_dtypes(pipe, i) for i in self.stage_ids]  # before build_stage takes them
        stages = [pipe.build_stage(i, self.device, self.group) for i in self.stage_ids]
        del pipe  # lets the other ranks' stage modules go
        for stage, stage_dtypes in zip(stages, dtypes, strict=True):
            _keep_unsaved(stage.submod, not_saved)
            if self.schedule_name in V_SHAPED:
                skip_same_rank_warmup(stage)
            if self.transform is not None:
                self.transform(stage.submod)
            # after FSDP (in transform): autocast and FSDP's bf16 would send what the receiving
            # stage's traced buffer cannot hold (see kiln.parallel.pipelining.boundary)
            keep_traced_dtypes(stage.submod, stage_dtypes)
        for prefix, module in staged:  # after the stages' own sharding steps: each rank reads its shards
            module.load_stage_weights([stage.submod for stage in stages], self.device, prefix)
        self.tied = TiedWeights.build(
            holders,
            self._tied_names,
            {i: stage.submod for i, stage in zip(self.stage_ids, stages, strict=True)},
            lambda stage: stage_rank(self.schedule_name, stage, self.num_stages, self.pp_size),
            self.pipelines,
            self.pp_rank,
        )
        self.view.show_stages([stage.submod for stage in stages])
        self.view.train(self.view.training)
        repoint_optimizer(
            self.optimizer, self._names, dict(self.view.named_parameters()), strategy="pp", drop_missing=True
        )
        cls = schedule_class(self.schedule_name)
        target = stages if self.schedule_name in MULTI_STAGE else stages[0]
        # scale_grads=False: torch would divide the whole .grad by the microbatch count after each
        # step, which also shrinks gradients kept from earlier accumulation steps; the 1/microbatches
        # goes into each microbatch loss instead.
        self._schedule = cls(target, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._step_loss is not None, "the pipeline schedule ran without a loss function"
        return self._step_loss(output, target)

    def _stage_inputs(self, args: tuple) -> tuple:
        select = getattr(self.model, "pipeline_inputs", None)
        return (select(args[0]), *args[1:]) if select is not None and args else args

    def _run(self, args: tuple, kwargs: dict, target: Any, eval_only: bool) -> Any:
        args = self._stage_inputs(args)
        if not self.built:
            self.build(args, kwargs)
        schedule = self._schedule
        assert schedule is not None  # built above
        step_args, step_kwargs = (args, kwargs) if self.has_first else ((), {})
        with self.precision.autocast(self.device):
            if self._setting_up and not eval_only:
                step_target = target if self.has_last else None
                if set_up_stages(schedule, step_args, step_kwargs, step_target, self.microbatches):
                    return _SET_UP
            if eval_only:
                with forward_only(schedule, self.schedule_name):
                    return schedule.eval(*step_args, target=target if self.has_last else None, **step_kwargs)
            return schedule.step(
                *step_args,
                target=target if self.has_last else None,
                losses=[] if self.has_last else None,
                return_outputs=False,
                **step_kwargs,
            )

    def train_step(
        self,
        args: tuple,
        kwargs: dict,
        target: Any,
        loss_fn: Callable[..., torch.Tensor],
        *,
        scale: float = 1.0,
        scaler: torch.amp.GradScaler | None = None,
        sync: bool = True,
    ) -> torch.Tensor:
        """Forward, loss and backward of one batch; returns the mean microbatch loss on every rank.

        ``loss_fn(output_mb, target_mb)`` runs on the last stage; the gradient is that of
        ``mean(losses) * scale`` (times the scaler's scale when given). ``sync``: this backward
        ends the optimizer step (the last of an accumulation): the copies of a tied weight on
        the stages then sum their gradients (:mod:`kiln.parallel.pipelining.tied_weights`).
        """
        recorded: list[torch.Tensor] = []
        factor = scale / self.microbatches
        if target is not None and not isinstance(target, torch.Tensor):
            # The schedule splits only a tensor target: it gets the row numbers, split like the
            # inputs, and each microbatch's loss gets those rows of the real target (a dict batch).
            size = num_samples(target)
            whole, batch_loss = target, loss_fn
            target = torch.arange(size, device=self.device)

            def loss_fn(output: Any, rows: torch.Tensor) -> torch.Tensor:
                return batch_loss(output, _rows(whole, rows, size))

        def step_loss(output: Any, target_mb: Any) -> torch.Tensor:
            loss = loss_fn(output, target_mb)
            recorded.append(loss.detach().to(self.loss_dtype))
            loss = loss * factor
            return scaler.scale(loss) if scaler is not None else loss

        self._step_loss = step_loss
        try:
            ran = self._run(args, kwargs, target, eval_only=False) is not _SET_UP
        finally:
            self._step_loss = None
        if sync and ran:
            self.tied.sum_grads()
        value = torch.stack(recorded).mean() if recorded else torch.zeros((), device=self.device, dtype=self.loss_dtype)
        dist.broadcast(value, src=self.last_rank, group=self.group)  # the loss lives on the last stage
        return value

    def eval_forward(self, args: tuple, kwargs: dict) -> Any:
        """Forward only; the last stage's output, sent to every pipeline rank."""
        batch = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) else self.microbatches
        # The schedule computes a loss on the last stage whenever it has a loss function; a zero
        # loss on a dummy target keeps it from failing without touching the stages' buffers.
        self._step_loss = lambda output, _: torch.zeros((), device=self.device)
        try:
            with torch.no_grad():
                out = self._run(args, kwargs, torch.zeros(batch, device=self.device), eval_only=True)
        finally:
            self._step_loss = None
        box = [out.cpu() if isinstance(out, torch.Tensor) else out]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return box[0].to(self.device) if isinstance(box[0], torch.Tensor) else box[0]

    # -- the Engine's hooks (see the module docstring) ------------------------------------------
    def defer_loss(self, criterion: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) != 2 or kwargs or not isinstance(args[0], PipelineOutput):
            raise TypeError(
                "under Pipeline, call engine.criterion(engine(x), target): the schedule computes "
                "criterion(output, target) microbatch by microbatch on the last stage"
            )
        loss = torch.zeros((), device=self.device, dtype=self.loss_dtype)
        self._pending = (loss, args[0], args[1], criterion)
        return loss

    def backward(
        self,
        loss: torch.Tensor,
        *,
        scale: float = 1.0,
        scaler: torch.amp.GradScaler | None = None,
        sync: bool = True,
    ) -> None:
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not loss:
            raise RuntimeError(
                "under Pipeline, engine.backward takes the tensor engine.criterion returned, "
                "unchanged: the schedule computes the loss and its backward together"
            )
        _, output, target, criterion = pending
        loss.copy_(
            self.train_step(output.args, output.kwargs, target, criterion, scale=scale, scaler=scaler, sync=sync)
        )


def full_pipeline_state_dict(model: PipelineModule) -> dict[str, torch.Tensor]:
    """The whole model's state dict on every rank (on the CPU): each rank's stages, gathered."""
    from kiln.parallel.state.state_dict import full_model_state_dict

    return model.gather_full_state_dict(full_model_state_dict(model))
