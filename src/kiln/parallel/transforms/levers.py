"""Activation checkpointing and ``torch.compile`` applied to a module in place, keeping every name.

torch's own wrappers rename what they wrap: ``checkpoint_wrapper`` puts the block under
``_checkpoint_wrapped_module.`` and ``torch.compile(block)`` under ``_orig_mod.``, so a checkpoint
written with the lever on would not load with it off, and the optimizer's re-pointing by parameter
name (:func:`kiln.parallel.transforms.parallelize.parallelize`) would lose track. Here the module object stays
where it is and only its ``forward`` changes: an instance attribute ``forward`` bound to the module
(``types.MethodType``), which ``nn.Module.__call__`` finds before the class's. So

* ``state_dict``, ``named_parameters`` and ``named_modules`` are those of the plain model, with the
  levers on or off, and checkpoints load across the two;
* hooks registered on the module later (FSDP's all-gather and reduce-scatter) run in ``__call__``,
  around the checkpointed or compiled forward rather than inside it (torchtitan's order);
* ``copy.deepcopy`` rebinds the forward to the copy (a bound method is deep-copied with its
  ``__self__``), so a copied model (an EMA) runs its own weights.

The levers stack: compile after checkpointing compiles the checkpointed forward, and the
recomputation is traced into the compiled graph. Applying a lever twice to one module does nothing
the second time (a Trainer built twice on one model).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MethodType
from typing import Any

import torch
from torch import nn

__all__ = [
    "checkpoint_every",
    "check_compile_settings",
    "checkpoint_targets",
    "outermost",
    "checkpoint_module",
    "compile_module",
    "applied_levers",
    "save_matmuls_policy",
    "SAVED_OPS",
]

_LEVER = "__kiln_lever__"  # set on the forward functions this module makes: which lever, and what it wraps
_INNER = "__kiln_inner__"
_SAVES_MATMULS = "__kiln_saves_matmuls__"


# -- what the options mean ------------------------------------------------------------------------
def checkpoint_every(mode: Any) -> int | None:
    """For an ``activation_checkpointing`` string: 1 for ``"full"``, N for ``"selective:N"``, 0 for the
    op-level ``"selective"`` (or ``"selective:op"``); None when the string is no mode."""
    if not isinstance(mode, str):
        return None
    if mode == "full":
        return 1
    if mode in ("selective", "selective:op"):
        return 0
    head, _, every = mode.partition(":")
    if head == "selective" and every.isdigit() and int(every) >= 1:
        return int(every)
    return None


def check_compile_settings(settings: Mapping[str, Any]) -> None:
    """Refuse a key ``torch.compile`` does not take, in one line naming the ones it does."""
    accepted = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    unknown = [key for key in settings if key not in accepted]
    if unknown:
        raise ValueError(
            f"compile={dict(settings)!r} has {', '.join(map(repr, unknown))}, which torch.compile does not "
            f"take; its settings are {', '.join(accepted)}"
        )


def outermost(names: Iterable[str]) -> list[str]:
    """``names`` without those inside another of them (checkpointing or compiling a block already
    covers the modules in it); ``""`` is the root."""
    names = list(names)
    return [n for n in names if not any(n != o and (o == "" or n.startswith(o + ".")) for o in names)]


def checkpoint_targets(model: nn.Module, mode: str | Callable[[nn.Module], bool], blocks: Sequence[str]) -> list[str]:
    """The names of the modules ``activation_checkpointing=mode`` wraps, ``blocks`` being the
    model's (:func:`kiln.parallel.transforms.parallelize.find_blocks`).

    A choice that wraps nothing is an error: a silent no-op would leave the memory where it was.
    """
    if callable(mode):
        # containers have no forward to checkpoint: the callable is asked about what they hold
        containers = (nn.ModuleList, nn.ModuleDict)
        names = outermost(
            name for name, m in model.named_modules() if name and not isinstance(m, containers) and mode(m)
        )
        if not names:
            raise ValueError(
                f"activation_checkpointing={mode!r} accepted no module of {type(model).__name__}; it is asked "
                "fn(module) -> bool of every submodule (e.g. lambda m: isinstance(m, MyBlock))"
            )
        return names
    chosen = outermost(blocks)
    if not chosen:
        raise ValueError(
            f"activation_checkpointing={mode!r} found no blocks in {type(model).__name__} (the indexed "
            "modules with parameters, like layers.0); choose the modules with a callable instead, e.g. "
            "activation_checkpointing=lambda m: isinstance(m, MyBlock)"
        )
    every = checkpoint_every(mode)
    if every:  # "full" (1) or "selective:N": the Nth, 2Nth, ... block (torchtitan counts the same way)
        chosen = [name for index, name in enumerate(chosen, 1) if index % every == 0]
    return chosen


# -- in place ---------------------------------------------------------------------------------------
def _forward_function(module: nn.Module) -> Callable[..., Any]:
    """The function behind ``module.forward``, taking the module first."""
    own = module.__dict__.get("forward")
    if own is None:
        return type(module).forward
    if isinstance(own, MethodType) and own.__self__ is module:
        return own.__func__
    # a forward someone else set on the instance (a plain function or another object's method)
    return lambda _module, *args, **kwargs: own(*args, **kwargs)


def applied_levers(module: nn.Module) -> list[str]:
    """The levers on ``module``'s forward, outermost first (``["compile", "activation_checkpointing"]``)."""
    levers = []
    function: Any = _forward_function(module)
    while (lever := getattr(function, _LEVER, None)) is not None:
        levers.append(lever)
        function = getattr(function, _INNER)
    return levers


def _set_forward(module: nn.Module, lever: str, function: Callable[..., Any], inner: Callable[..., Any]) -> None:
    setattr(function, _LEVER, lever)
    setattr(function, _INNER, inner)
    module.forward = MethodType(function, module)  # an instance attribute, found before the class's forward


# -- activation checkpointing ---------------------------------------------------------------------
def _saved_ops() -> frozenset[Any]:
    aten, ops = torch.ops.aten, []
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        if hasattr(aten, name):
            ops.append(getattr(aten, name).default)
    # tensor parallel's sequence-parallel reduce-scatter: saving it spares a collective in the recompute
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.append(functional.reduce_scatter_tensor.default)
    return frozenset(ops)


SAVED_OPS = _saved_ops()
"""The ops whose outputs ``activation_checkpointing="selective"`` keeps: the matrix products and
attention kernels (the costly ones to recompute), and tensor parallel's reduce-scatter. Everything
else (norms, activations, elementwise ops) is recomputed in the backward."""


def save_matmuls_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The op-level policy of ``"selective"`` for ``create_selective_checkpoint_contexts``."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _save_matmuls_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(save_matmuls_policy)


def _checkpointed(inner: Callable[..., Any], save_matmuls: bool) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    # The context function is named directly, not held in a variable: dynamo accepts only a
    # function it can see (a plain or partial function) as checkpoint's context_fn under compile.
    @functools.wraps(inner)
    def checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(self, *args, **kwargs)
        # use_reentrant=False: works with inputs that need no grad, with kwargs, and under compile
        return checkpoint(inner, self, *args, use_reentrant=False, **kwargs)

    @functools.wraps(inner)
    def selective_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(self, *args, **kwargs)
        return checkpoint(inner, self, *args, use_reentrant=False, context_fn=_save_matmuls_context, **kwargs)

    function = selective_forward if save_matmuls else checkpointed_forward
    setattr(function, _SAVES_MATMULS, save_matmuls)
    return function


def checkpoint_module(module: nn.Module, *, save_matmuls: bool = False) -> None:
    """Recompute ``module``'s activations in the backward (``torch.utils.checkpoint``, non-reentrant).

    With ``save_matmuls`` the outputs of :data:`SAVED_OPS` are kept and only the rest is recomputed
    (torch's selective activation checkpointing). Under ``torch.no_grad`` (evaluation) the forward
    runs plainly: there is no backward to save for.
    """
    if "activation_checkpointing" in applied_levers(module):
        return
    inner = _forward_function(module)
    _set_forward(module, "activation_checkpointing", _checkpointed(inner, save_matmuls), inner)


# -- compile --------------------------------------------------------------------------------------
def _compiled(inner: Callable[..., Any], settings: Mapping[str, Any]) -> Callable[..., Any]:
    compiled = torch.compile(inner, **settings)

    @functools.wraps(inner)
    def compiled_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return compiled(self, *args, **kwargs)

    return compiled_forward


def _holds_dtensors(module: nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(p, DTensor) for p in module.parameters())


def compile_module(module: nn.Module, settings: Mapping[str, Any]) -> None:
    """``torch.compile`` ``module``'s forward with ``settings`` (``torch.compile``'s keyword arguments).

    The function is compiled unbound and called with the module as its first argument, so modules
    of one class share their compiled code (dynamo guards on the module's type and attributes).
    A checkpointed forward is compiled with its checkpoint, so the recomputation is in the graph;
    one exception, below, keeps the checkpoint outside.
    """
    if "compile" in applied_levers(module):
        return
    outer = _forward_function(module)
    if (
        getattr(outer, _LEVER, None) == "activation_checkpointing"
        and not getattr(outer, _SAVES_MATMULS)
        and _holds_dtensors(module)
    ):
        # torch 2.13 fails to compile a whole-block checkpoint over tensor-parallel (DTensor)
        # weights when the block recomputes scaled_dot_product_attention ("expected all
        # tensors_saved_with_vc_check to be Tensors": AOTAutograd saves the DeviceMesh among the
        # tensors). Compiling beneath the checkpoint instead recomputes the same ops, as one
        # compiled forward rather than inside the compiled backward.
        inner = getattr(outer, _INNER)
        compiled = _compiled(inner, settings)
        _set_forward(module, "compile", compiled, inner)
        _set_forward(module, "activation_checkpointing", _checkpointed(compiled, False), compiled)
        return
    _set_forward(module, "compile", _compiled(outer, settings), outer)
