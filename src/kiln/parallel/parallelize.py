"""The model transformations of every strategy, in one documented order (torchtitan's ``parallelize``).

A strategy's ``setup`` builds a :class:`ParallelizePlan` (the options, the model's blocks and, for
the strategies that need one, a mesh validated against the world) and hands the model to
:func:`parallelize`. It runs the steps the strategy declares in ``Strategy.steps``, always in this
order, each one the strategy's ``apply_<step>`` method (a strategy overrides only the steps that
differ; the defaults are the functions below):

============================  ===========================================================================
``placement``                 move to ``ctx.device``, cast to the precision's storage dtypes (every
                              strategy but deepspeed, whose ``deepspeed.initialize`` does both)
``float8``                    seam: float8 training of the Linear layers (torchao); not available yet
(pipeline cut)                ``pp``/``hybrid`` cut the model into stages here; the steps below run on
                              each stage (on the whole model without a pipeline)
``tensor_parallel``           split Linear/Embedding weights over the ``tp`` mesh (``tp``, ``hybrid``)
``activation_checkpointing``  seam: recompute each block's activations in the backward; not available yet
``compile``                   seam: ``torch.compile`` each block; not available yet
``data_parallel``             ``fully_shard`` each block, then the root, over the data-parallel mesh
                              (``zero2``, ``zero3``/``fsdp``, ``hybrid``); ``ddp``/``zero1`` override it
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
* Activation checkpointing before compile: compile then traces the checkpointed block, so the
  recomputation is inside the compiled graph (torchtitan: checkpointing, then compile).
* Compile, block by block, before data parallelism: the compiled units are the blocks FSDP wraps
  next, so FSDP's per-block hooks (all-gather before a block, reduce-scatter after it) wrap each
  compiled block from outside instead of being traced into it.
* Data parallelism last: ``fully_shard`` takes ownership of whatever parameters a module holds when
  it is applied (tensor-parallel DTensors become 2-D shards), and ``DistributedDataParallel`` must be
  the outermost wrapper, hooking the final parameters. Until then every step sees the user's names.

Example::

    class RootOnlyFSDP(kiln.parallel.FSDP):       # one fully_shard for the whole model
        def apply_data_parallel(self, model, plan):
            return super().apply_data_parallel(model, dataclasses.replace(plan, blocks=[]))
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from kiln.parallel.mesh import ParallelDims, dp_mesh, tp_mesh

if TYPE_CHECKING:
    import torch

    from kiln.launch.context import Context
    from kiln.parallel.strategy import Strategy
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
    "apply_activation_checkpointing",
    "apply_compile",
    "fully_shard_blocks",
]

STEPS = ("placement", "float8", "tensor_parallel", "activation_checkpointing", "compile", "data_parallel")
# A pipeline runs these on the whole model, cuts it into stages, and runs the rest on each stage.
WHOLE_MODEL_STEPS = STEPS[:2]
STAGE_STEPS = STEPS[2:]
# The steps a user option turns on; each option has the name of its step. With the option None they do nothing.
SEAMS = ("float8", "activation_checkpointing", "compile")
_AC_MODES = ("full", "selective")

WrapSpec = str | type | Iterable[str | type] | None


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
        compile: ``True`` or a dict of ``torch.compile`` arguments, applied to each block.
        activation_checkpointing: ``"full"``, ``"selective"`` or a callable choosing the blocks.
        float8: ``True`` or a dict of torchao float8 settings.

    None of them is available yet: a value is refused, naming the option, when the step runs.

    Example::

        strategy.parallelize_options = ParallelizeOptions()   # what every strategy starts with
    """

    compile: bool | Mapping[str, Any] | None = None
    activation_checkpointing: str | Callable[..., bool] | None = None
    float8: bool | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in SEAMS:
            if getattr(self, name) is False:
                object.__setattr__(self, name, None)  # False reads as "off", like None
        for name in ("compile", "float8"):
            value = getattr(self, name)
            if value is not None and value is not True and not isinstance(value, Mapping):
                raise ValueError(f"{name}={value!r} must be True, a dict of settings, or None")
        ac = self.activation_checkpointing
        if ac is not None and ac not in _AC_MODES and not callable(ac):
            raise ValueError(
                f"activation_checkpointing={ac!r} must be 'full', 'selective', a callable choosing the blocks, or None"
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
        reshard_after_forward / cpu_offload: FSDP's settings.
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
    reshard_after_forward: bool = True
    cpu_offload: bool = False

    @classmethod
    def on_mesh(cls, dims: ParallelDims, *, ctx: Context, **fields: Any) -> ParallelizePlan:
        """A plan on the mesh of ``dims``, checked against the world first: sizes that do not fit
        raise a one-line ``ValueError`` naming them, before any process group is made."""
        dims = dims.resolve(ctx.world_size)
        mesh = dims.build_mesh(ctx.device.type)
        return cls(ctx=ctx, dims=dims, mesh=mesh, tp_mesh=tp_mesh(mesh, dims), dp_mesh=dp_mesh(mesh, dims), **fields)


# -- the pipeline -----------------------------------------------------------------------------------
def parallelize(
    strategy: Strategy,
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
    before = dict(model.named_parameters(remove_duplicate=False)) if optimizer is not None else {}
    for step in STEPS:
        if step in strategy.steps and step in only:
            model = getattr(strategy, f"apply_{step}")(model, plan)
    if optimizer is not None:
        from kiln.parallel.optimizer_params import repoint_optimizer

        after = dict(strategy.unwrap(model).named_parameters())
        if any(before.get(name) is not p for name, p in after.items()):
            repoint_optimizer(optimizer, {id(p): name for name, p in before.items()}, after, strategy=strategy.name)
    return model


# -- the steps' default bodies (Strategy.apply_<step> calls them) -----------------------------------
def apply_placement(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """Move to ``ctx.device`` and cast to the precision's storage dtypes."""
    # Module.to and the precision cast replace tensor data in place, so the optimizer's
    # references to the Parameter objects stay valid.
    model.to(plan.ctx.device)
    plan.precision.setup_module(model)
    return model


def _not_available(option: str, value: Any) -> ValueError:
    return ValueError(
        f"{option}={value!r} is not available yet: kiln has the {option} step of its parallelize "
        f"pipeline but does not fill it in this version; leave {option}=None"
    )


def apply_float8(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """Seam: float8 Linear layers (torchao). Does nothing with ``float8=None``."""
    if plan.options.float8 is None:
        return model
    raise _not_available("float8", plan.options.float8)


def apply_tensor_parallel(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """``parallelize_module`` with the part of ``plan.tp_plan`` whose modules ``model`` holds (a
    pipeline stage holds some of them). Does nothing without a ``tp_mesh``."""
    if plan.tp_mesh is None:
        return model
    from kiln.parallel.tensor import apply_tp, matching_modules

    return apply_tp(model, plan.tp_mesh, {p: s for p, s in plan.tp_plan.items() if matching_modules(model, p)})


def apply_activation_checkpointing(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """Seam: recompute the activations of ``plan.blocks`` in the backward. Does nothing with
    ``activation_checkpointing=None``."""
    if plan.options.activation_checkpointing is None:
        return model
    raise _not_available("activation_checkpointing", plan.options.activation_checkpointing)


def apply_compile(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """Seam: ``torch.compile`` each of ``plan.blocks``. Does nothing with ``compile=None``."""
    if plan.options.compile is None:
        return model
    raise _not_available("compile", plan.options.compile)


def fully_shard_blocks(model: nn.Module, plan: ParallelizePlan) -> nn.Module:
    """FSDP2 over ``plan.dp_mesh``: each of ``plan.blocks`` that ``model`` holds, then the root.
    Does nothing without a ``dp_mesh``."""
    if plan.dp_mesh is None:
        return model
    from kiln.parallel.fsdp import apply_fsdp

    return apply_fsdp(
        model,
        plan.dp_mesh,
        plan.precision,
        reshard_after_forward=plan.reshard_after_forward,
        wrap=[n for n in plan.blocks if _has_module(model, n)],
        cpu_offload=plan.cpu_offload,
    )
