"""The model transformations of every strategy, in one documented order (torchtitan's ``parallelize``).

A strategy's ``setup`` builds a :class:`ParallelizePlan` (the options, the model's blocks and, for
the strategies that need one, a mesh validated against the world) and hands the model to
:func:`parallelize`. It runs the steps the strategy declares in ``Strategy.steps``, always in this
order, each one the strategy's ``apply_<step>`` method (a strategy overrides only the steps that
differ; the defaults are the functions below):

============================  ===========================================================================
``placement``                 move to ``ctx.device``, cast to the precision's storage dtypes (every
                              strategy but deepspeed, whose ``deepspeed.initialize`` does both)
``float8``                    float8 training of the Linear layers (torchao; :mod:`kiln.parallel.transforms.float8`)
(pipeline cut)                ``pp``/``hybrid`` cut the model into stages here; the steps below run on
                              each stage (on the whole model without a pipeline)
``tensor_parallel``           split Linear/Embedding weights over the ``tp`` mesh (``tp``, ``hybrid``)
``expert_parallel``           split the experts of MoE layers over the ``ep`` mesh, tokens sent to them
                              with all-to-alls (``hybrid``; :mod:`kiln.parallel.transforms.expert_parallel`)
``activation_checkpointing``  recompute the activations of the blocks (or those a callable chose) in the
                              backward: ``"full"``, ``"selective"`` (op-level), ``"selective:N"``
``compile``                   ``torch.compile`` each block's forward (the whole module when it has none)
``data_parallel``             ``fully_shard`` each block, then the root, over the data-parallel mesh
                              (``zero2``, ``zero3``/``fsdp``, ``hybrid``; with ``ep``, each MoE layer's
                              experts first, over their own mesh); ``ddp``/``zero1`` override it
                              to wrap the model in ``DistributedDataParallel``
============================  ===========================================================================

Why the order matters:

* Placement and precision first: every later step builds new objects from the parameters as they
  are then (DTensor shards, float8 layers, compiled graphs, FSDP's sharded storage). A move or a cast
  afterwards would have to reach through them: ``param.data = ...`` on a sharded parameter would
  leave FSDP's own storage behind.
* float8 next, on the whole model (torchtitan converts before the pipeline cut): it swaps Linear
  classes, so it must come before anything that looks at or wraps them: tensor parallelism picks
  its styles by layer class, checkpointing and compile must wrap and trace the converted forward.
* Tensor parallelism before checkpointing and compile: it turns weights into DTensors and adds the
  input/output redistributions around each layer, which the recomputation must repeat and the
  compiled graph must contain (compiling first would trace the unsharded forward).
* Expert parallelism with tensor parallelism (torchtitan applies both in one step), after it and
  for the same reasons: it turns the experts' weights into DTensors on the ``ep`` mesh and puts
  the all-to-alls into the MoE layers' forward, which checkpointing must recompute (the
  all-to-alls run again in the backward, on every rank alike) and compile must trace; FSDP then
  shards the experts' DTensors again over the ranks that hold the same experts. The two touch
  different layers (tensor parallelism leaves the experts whole).
* Activation checkpointing before compile: compile then traces the checkpointed block, so the
  recomputation is inside the compiled graph (torchtitan: checkpointing, then compile). The one
  exception, a torch bug with whole-block checkpointing over tensor-parallel weights, is in
  :func:`kiln.parallel.transforms.levers.compile_module`.
* Compile, block by block, before data parallelism: the compiled units are the blocks FSDP wraps
  next, so FSDP's per-block hooks (all-gather before a block, reduce-scatter after it) wrap each
  compiled block from outside instead of being traced into it.
* Neither checkpointing nor compile renames anything: both change a block's ``forward`` in place
  (:mod:`kiln.parallel.transforms.levers`), where torch's wrappers would add ``_checkpoint_wrapped_module.``
  and ``_orig_mod.`` to every name. The optimizer's re-pointing below goes by name, and a
  checkpoint saved with the levers on loads with them off and back.
* Data parallelism last: ``fully_shard`` takes ownership of whatever parameters a module holds when
  it is applied (tensor-parallel DTensors become 2-D shards), and ``DistributedDataParallel`` must be
  the outermost wrapper, hooking the final parameters. Until then every step sees the user's names.

Example::

    class RootOnlyFSDP(kiln.parallel.FSDP):       # one fully_shard for the whole model
        def apply_data_parallel(self, model, plan):
            return super().apply_data_parallel(model, dataclasses.replace(plan, blocks=[]))
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from kiln.parallel.state.mesh import ParallelDims, cp_mesh, dp_mesh, ep_meshes, tp_mesh
from kiln.parallel.transforms.levers import (
    check_compile_settings,
    checkpoint_every,
    checkpoint_module,
    checkpoint_targets,
    compile_module,
    outermost,
)

if TYPE_CHECKING:
    import torch

    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = [
    "STEPS",
    "WHOLE_MODEL_STEPS",
    "STAGE_STEPS",
    "ParallelizeOptions",
    "ParallelizePlan",
    "parallelize",
    "find_blocks",
    "apply_placement",
    "apply_float8",
    "apply_tensor_parallel",
    "apply_expert_parallel",
    "apply_activation_checkpointing",
    "apply_compile",
    "fully_shard_blocks",
    "materialize",
]

STEPS = (
    "placement",
    "float8",
    "tensor_parallel",
    "expert_parallel",
    "activation_checkpointing",
    "compile",
    "data_parallel",
)
# A pipeline runs these on the whole model, cuts it into stages, and runs the rest on each stage.
WHOLE_MODEL_STEPS = STEPS[:2]
STAGE_STEPS = STEPS[2:]
# The steps a user option turns on; each option has the name of its step. With the option None they do nothing.
SEAMS = ("float8", "activation_checkpointing", "compile")

WrapSpec = str | type | Iterable[str | type] | None


class Steps(Protocol):
    """What :func:`parallelize` asks of a strategy (:class:`kiln.parallel.Strategy` is one): the steps
    it declares, an ``apply_<step>`` method for each, and its plain module underneath. A protocol,
    so this file, which the strategy interface imports, imports no strategy back."""

    @property
    def name(self) -> str: ...
    @property
    def steps(self) -> tuple[str, ...]: ...
    def unwrap(self, model: nn.Module) -> nn.Module: ...


# -- the model's blocks ---------------------------------------------------------------------------
def _as_list(wrap: WrapSpec) -> list[str | type]:
    if wrap is None:
        return []
    if isinstance(wrap, (str, type)):
        return [wrap]
    return list(wrap)


def _indexed_blocks(model: nn.Module) -> list[str]:
    # The repeated blocks of a model live in a ModuleList/Sequential, so their names end in an
    # index ("layers.3", "h.0", "blocks.2"); under a traced pipeline stage the class is gone but
    # the names remain. The shallowest such modules with parameters are the blocks.
    found = [
        (name.count("."), name)
        for name, m in model.named_modules()
        if name and name.rsplit(".", 1)[-1].isdigit() and any(True for _ in m.parameters())
    ]
    if not found:
        return []
    depth = min(d for d, _ in found)
    return [name for d, name in found if d == depth]


def find_blocks(model: nn.Module, wrap: WrapSpec = None) -> list[str]:
    """Names of the model's blocks: the modules FSDP shards one by one (the root gets its own
    ``fully_shard`` too), and the units activation checkpointing and compile apply to.

    ``wrap`` entries are module classes, class names (``"Block"``) or name patterns
    (``"layers.*"``, fnmatch style); ``None`` picks the indexed blocks of the model (``layers.0``,
    ``layers.1``, ...). A pattern that matches nothing is an error, as a silent no-op would quietly
    leave the model unsharded.
    """
    entries = _as_list(wrap)
    if not entries:
        return _indexed_blocks(model)
    names: list[str] = []
    for entry in entries:
        if isinstance(entry, type):
            hits = [n for n, m in model.named_modules() if n and isinstance(m, entry)]
        elif isinstance(entry, str):
            hits = [
                n
                for n, m in model.named_modules()
                if n and (type(m).__name__ == entry or fnmatch.fnmatchcase(n, entry))
            ]
        else:
            raise ValueError(f"FSDP wrap entry {entry!r} must be a module class, a class name or a name pattern")
        if not hits:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"FSDP wrap={entry!r} matches no module of the model; its module classes are "
                f"{', '.join(classes)}; name patterns look like 'layers.*'"
            )
        names.extend(n for n in hits if n not in names)
    return names


def _has_module(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


# -- what the steps read ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ParallelizeOptions:
    """The user's choices for the seam steps; ``None`` (or ``False``) leaves a step out.

    Args:
        compile: ``True`` or a dict of ``torch.compile`` keyword arguments (``{"mode":
            "max-autotune", "fullgraph": True}``), applied to each block's forward; a model
            without blocks is compiled whole.
        activation_checkpointing: which activations to recompute in the backward instead of
            keeping them (torchtitan's modes):

            * ``"full"``: every block (the least memory, one more forward's compute);
            * ``"selective"`` (also ``"selective:op"``): every block, keeping the outputs of the
              matrix products and attention (:data:`kiln.parallel.transforms.levers.SAVED_OPS`) and
              recomputing the cheap ops around them (torch's selective activation checkpointing);
            * ``"selective:N"``: every Nth block in full (``"selective:2"``: every other block,
              the 2nd, 4th, ...; ``"selective:1"`` is ``"full"``);
            * a callable ``fn(module) -> bool``: asked of every submodule of the model (but
              ``ModuleList``/``ModuleDict`` containers) before any step changed it; the outermost
              modules it accepts are checkpointed in full.
        float8: ``True`` or a dict of torchao float8 settings (``recipe``, ``emulate``, ``skip``;
            see :mod:`kiln.parallel.transforms.float8`): FP8 matmuls in the eligible Linear layers, on GPUs
            with FP8 tensor cores (refused elsewhere, unless emulated).

    Both keep every parameter name: a checkpoint saved with them loads without them and back
    (see :mod:`kiln.parallel.transforms.levers`).

    Example::

        strategy.parallelize_options = ParallelizeOptions(compile=True, activation_checkpointing="full")
    """

    compile: bool | Mapping[str, Any] | None = None
    activation_checkpointing: str | Callable[[nn.Module], bool] | None = None
    float8: bool | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in SEAMS:
            if getattr(self, name) is False:
                object.__setattr__(self, name, None)  # False reads as "off", like None
        for name in ("compile", "float8"):
            value = getattr(self, name)
            if value is not None and value is not True and not isinstance(value, Mapping):
                raise ValueError(f"{name}={value!r} must be True, a dict of settings, or None/False (off)")
        if isinstance(self.compile, Mapping):
            check_compile_settings(self.compile)
        if self.float8 is not None:
            from kiln.parallel.transforms.float8 import float8_settings

            float8_settings(self.float8)  # its rules, checked before any step runs
        ac = self.activation_checkpointing
        if ac is not None and not callable(ac) and checkpoint_every(ac) is None:
            raise ValueError(
                f"activation_checkpointing={ac!r} must be 'full', 'selective' (keeps matmul outputs), "
                "'selective:N' (every Nth block), a callable fn(module) -> bool choosing the modules, or None"
            )


@dataclass(kw_only=True)
class ParallelizePlan:
    """What one ``setup`` applies; built by ``Strategy.parallelize_plan`` before any step runs.

    Args:
        ctx: where this process runs (``ctx.device``, ``ctx.world_size``).
        precision: the storage dtypes (placement) and FSDP's mixed-precision policy.
        options: the seams' options (:class:`ParallelizeOptions`).
        blocks: :func:`find_blocks` of the model: what FSDP shards one by one, and where
            checkpointing and compile apply.
        dims / mesh: the validated sizes and their ``DeviceMesh`` (None: no mesh, or a world of 1).
        tp_mesh / tp_plan: tensor parallelism (``tp_mesh`` None: off); ``tp_plan`` is resolved.
        dp_mesh: the mesh FSDP shards over (None: no sharding).
        ep_mesh / experts_dp_mesh: expert parallelism's mesh (None: off) and the mesh FSDP shards
            the experts over (``efsdp``, or ``dp_replicate x efsdp``); see :mod:`kiln.parallel.transforms.expert_parallel`.
        cp_mesh: context parallelism's mesh (None: off; see :mod:`kiln.parallel.context`): no
            step changes the model for it, the training step splits the sequences.
        reshard_after_forward / cpu_offload: FSDP's settings.
        checkpointed: the modules activation checkpointing wraps (None: not chosen yet).
    """

    ctx: Context
    precision: Precision
    options: ParallelizeOptions  # no default: a strategy that builds a plan passes the user's on
    blocks: list[str]
    dims: ParallelDims | None = None
    mesh: Any = None
    tp_mesh: Any = None
    tp_plan: Mapping[str, Any] = field(default_factory=dict)
    dp_mesh: Any = None
    ep_mesh: Any = None
    experts_dp_mesh: Any = None
    cp_mesh: Any = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    # Filled by parallelize() on the whole model, before any step: a pipeline stage is a traced
    # copy whose modules are no longer the user's classes, so a callable must choose before the cut.
    checkpointed: list[str] | None = None

    @classmethod
    def on_mesh(cls, dims: ParallelDims, *, ctx: Context, **fields: Any) -> ParallelizePlan:
        """A plan on the mesh of ``dims``, checked against the world first: sizes that do not fit
        raise a one-line ``ValueError`` naming them, before any process group is made."""
        dims = dims.resolve(ctx.world_size)
        mesh = dims.build_mesh(ctx.device.type)
        ep, experts_dp = ep_meshes(mesh, dims)
        return cls(
            ctx=ctx,
            dims=dims,
            mesh=mesh,
            tp_mesh=tp_mesh(mesh, dims),
            dp_mesh=dp_mesh(mesh, dims),
            ep_mesh=ep,
            experts_dp_mesh=experts_dp,
            cp_mesh=cp_mesh(mesh, dims),
            **fields,
        )


# -- the pipeline -----------------------------------------------------------------------------------
def parallelize(
    strategy: Steps,
    model: nn.Module,
    plan: ParallelizePlan,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    only: Collection[str] = STEPS,
) -> nn.Module:
    """Run the steps ``strategy.steps`` declares (those in ``only``), in :data:`STEPS` order.

    Returns the model to train (a step may wrap it). With ``optimizer``, the parameters a step
    replaced (tensor parallelism, FSDP) are swapped in its param groups, by name.
    """
    unknown = [step for step in strategy.steps if step not in STEPS]
    if unknown:
        raise ValueError(
            f"{type(strategy).__name__}.steps names {unknown}, which are not steps; the steps are {', '.join(STEPS)}"
        )
    for option in SEAMS:  # refuse an option the strategy would silently ignore
        value = getattr(plan.options, option)
        if value is not None and option not in strategy.steps:
            raise ValueError(
                f"{option}={value!r} is not applied under strategy={strategy.name!r}: its steps are "
                f"{', '.join(strategy.steps) or 'none'}; leave {option}=None with this strategy"
            )
    ac = plan.options.activation_checkpointing
    if ac is not None and plan.checkpointed is None:
        plan.checkpointed = checkpoint_targets(model, ac, plan.blocks)
    before = dict(model.named_parameters(remove_duplicate=False)) if optimizer is not None else {}
    for step in STEPS:
        if step in strategy.steps and step in only:
            if step == "data_parallel" and plan.dp_mesh is None:
                # a wrapper that does not shard (DDP broadcasts rank 0's weights as it wraps): weights first
                materialize(model, plan)
            model = getattr(strategy, f"apply_{step}")(model, plan)
    materialize(model, plan)
    if optimizer is not None:
        from kiln.parallel.state.optimizer_params import repoint_optimizer

        after = dict(strategy.unwrap(model).named_parameters())
        if any(before.get(name) is not p for name, p in after.items()):
            names: dict[int, str] = {}
            for name, p in before.items():  # a tied parameter by its first name, as named_parameters() lists it
                names.setdefault(id(p), name)
            repoint_optimizer(optimizer, names, after, strategy=strategy.name)
    return model


def _deferred(model: nn.Module) -> list[nn.Module]:
    """The modules whose weights are read after the steps (``deferred_weights``, e.g. a
    ``HuggingFaceModel.from_pretrained``), outside a dry run (whose fake tensors read nothing)."""
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is not None:
        return []
    return [m for m in model.modules() if getattr(m, "deferred_weights", False)]


def materialize(model: nn.Module, plan: ParallelizePlan) -> None:
    """Storage on ``ctx.device`` and weights for a model built on the meta device whose weights are
    deferred: each such module's ``load_deferred_weights`` (:mod:`kiln.models.hf_weights`), once the
    steps that shard it (tensor parallel, FSDP) have run, so each rank allocates and reads only its
    shards. :func:`parallelize` calls it after its steps, or just before a data-parallel wrapper that
    does not shard (DDP); a pipeline's whole-model steps end with it, before the trace: a module
    that reads its weights stage by stage (``read_weights_per_stage``, which the pipeline calls
    first) then gets its buffers only, and each pipeline rank reads its own stages' parameters after
    the cut and the stages' steps (:class:`kiln.parallel.pipelining.runtime.PipelineRuntime`);
    another is read whole there. Nothing deferred: nothing."""
    for module in _deferred(model):
        module.load_deferred_weights(plan.ctx.device)  # type: ignore[operator]  # the protocol's method


# -- the steps' default bodies (Strategy.apply_<step> calls them) -----------------------------------
def apply_placement(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """Move to ``ctx.device`` and cast to the precision's storage dtypes (tensors on the meta device
    of a model whose weights are deferred stay there until :func:`materialize`)."""
    # Module.to and the precision cast replace tensor data in place, so the optimizer's
    # references to the Parameter objects stay valid.
    with _tied_kept(model):
        if _deferred(model):
            device = plan.ctx.device
            model._apply(lambda t: t if t.is_meta else t.to(device))
        else:
            model.to(plan.ctx.device)
        plan.precision.setup_module(model)
    return model


@contextlib.contextmanager
def _tied_kept(model: nn.Module) -> Iterator[None]:
    """Parameters shared by several modules (tied embeddings) are one parameter again after the
    block. Module.to swaps in new Parameter objects where it cannot set ``.data`` in place (meta
    parameters made fake in a dry run), one per module that holds it, which untied them: the copy
    the optimizer does not hold was never updated, and counted twice."""
    shared: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                shared.setdefault(id(param), []).append((module, name))
    yield
    for places in shared.values():
        if len(places) > 1:
            first = getattr(places[0][0], places[0][1])
            for module, name in places[1:]:
                if getattr(module, name) is not first:
                    setattr(module, name, first)


def apply_float8(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """torchao's float8 Linear layers in place of the eligible ones (see :mod:`kiln.parallel.transforms.float8`);
    refused with one line where FP8 cannot run. Does nothing with ``float8=None``."""
    if plan.options.float8 is None:
        return model
    from kiln.parallel.transforms.float8 import convert_float8

    return convert_float8(model, plan.options.float8, plan.ctx.device)


def apply_tensor_parallel(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """``parallelize_module`` with the part of ``plan.tp_plan`` whose modules ``model`` holds (a
    pipeline stage holds some of them). Does nothing without a ``tp_mesh``."""
    if plan.tp_mesh is None:
        return model
    from kiln.parallel.transforms.tensor_parallel import apply_tp, matching_modules

    return apply_tp(model, plan.tp_mesh, {p: s for p, s in plan.tp_plan.items() if matching_modules(model, p)})


def apply_expert_parallel(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """Split each :class:`kiln.models.MoE` layer's experts over ``plan.ep_mesh`` and dispatch its
    tokens with all-to-alls (:mod:`kiln.parallel.transforms.expert_parallel`). Does nothing without an ``ep_mesh``."""
    if plan.ep_mesh is None:
        return model
    from kiln.parallel.transforms.expert_parallel import apply_expert_parallel as split_experts

    return split_experts(model, plan.ep_mesh)


def apply_activation_checkpointing(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """Recompute the activations of ``plan.checkpointed`` (those ``model`` holds) in the backward,
    in place: names, and so checkpoints, stay those of the plain model. Does nothing with
    ``activation_checkpointing=None``."""
    ac = plan.options.activation_checkpointing
    if ac is None:
        return model
    names = plan.checkpointed if plan.checkpointed is not None else checkpoint_targets(model, ac, plan.blocks)
    save_matmuls = checkpoint_every(ac) == 0
    for name in names:
        if _has_module(model, name):  # a pipeline stage holds some of them
            checkpoint_module(model.get_submodule(name), save_matmuls=save_matmuls)
    return model


def apply_compile(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """``torch.compile`` the forward of each of ``plan.blocks`` that ``model`` holds (``model``'s own
    when it holds none), in place: names, and so checkpoints, stay those of the plain model.
    Does nothing with ``compile=None``."""
    settings = plan.options.compile
    if settings is None:
        return model
    names = [name for name in outermost(plan.blocks) if _has_module(model, name)] or [""]
    for name in names:
        compile_module(model.get_submodule(name), settings if isinstance(settings, Mapping) else {})
    return model


def fully_shard_blocks(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """FSDP2 over ``plan.dp_mesh``: each of ``plan.blocks`` that ``model`` holds, then the root
    (with expert parallelism, each MoE layer's experts first, over ``plan.experts_dp_mesh``).
    Does nothing without a ``dp_mesh``."""
    if plan.dp_mesh is None:
        return model
    from kiln.parallel.transforms.data_parallel import apply_fsdp

    if plan.experts_dp_mesh is not None:  # the experts on their own mesh, before their blocks take them
        from kiln.parallel.transforms.expert_parallel import fully_shard_experts

        fully_shard_experts(
            model,
            plan.experts_dp_mesh,
            plan.precision,
            reshard_after_forward=plan.reshard_after_forward,
            cpu_offload=plan.cpu_offload,
        )
    return apply_fsdp(
        model,
        plan.dp_mesh,
        plan.precision,
        reshard_after_forward=plan.reshard_after_forward,
        wrap=[n for n in plan.blocks if _has_module(model, n)],
        cpu_offload=plan.cpu_offload,
    )
