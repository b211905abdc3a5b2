"""Which kernels a torch optimizer's step runs: fused, foreach or the per-parameter loop.

torch's optimizers take ``foreach=`` and (Adam, AdamW, SGD, Adagrad) ``fused=``. Left unset, torch
picks foreach only for plain tensors on CUDA and never fused, so a CPU run, and an FSDP2 or tensor
parallel run (whose parameters are DTensors), step through a Python loop over the parameters.
kiln fills in the choice once the strategy has placed the parameters (:func:`apply_default_implementation`),
for the param groups where the user set neither option; a group that sets either keeps it, as
torch treats either one as the user's decision.

The rules (:func:`choose_implementation`):

* **fused** for Adam, AdamW and SGD when every parameter is a floating point tensor on CUDA and the
  optimizer has not stepped yet (fused keeps its step counts on the device; earlier state has them
  on the CPU). DTensor parameters (FSDP2, tensor parallel) only for Adam and AdamW: DTensor has
  sharding rules for ``_fused_adam(w)_`` and for no other fused kernel. Not Adagrad, whose
  constructor creates its state at once, for the loop.
* **foreach** for the other optimizers of ``torch.optim`` on CUDA, and for DTensor parameters on
  the CPU (FSDP2 or tensor parallel over gloo), where the loop pays DTensor's dispatch for every
  op of every parameter. torch's CPU foreach ops give the same bits as the loop
  (``tests/test_optimizer_choice.py`` checks), so checkpoints saved with either resume alike.
* **plain tensors on the CPU keep torch's own default, the loop**: there foreach is no clear win.
  It saves the per-tensor Python overhead for many small tensors and for large ones (AdamW
  1.3-1.5x faster, ``benchmarks/optimizer_step.py``), but runs each op over every tensor before
  the next, so mid-sized models whose tensors the loop keeps in cache step slower (0.6x for 24
  256x256 layers), and for a few tensors its grouping costs more than it saves (a 32-64-10 MLP
  under SGD: 4% more instructions per training step, 8% more time,
  ``benchmarks/overhead_instructions.py``). A user asks for it with ``foreach=True``; CPU fused
  kernels are 3-6x faster than either but round differently from the loop (``fused=True``).
* **the loop, said explicitly** (``foreach=False``) for a group that mixes DTensors with plain
  tensors (tensor parallel leaves unplanned layers plain) or holds DTensors of several meshes:
  DTensor's foreach and fused ops take lists on one mesh only, and torch's own default would pick
  foreach for such a group on CUDA and fail in the step.
* **the loop** (nothing set) for anything else: optimizers outside ``torch.optim`` (DeepSpeed's,
  third-party ones, subclasses), ``differentiable=True``, a Tensor learning rate, tensor
  subclasses other than DTensor, devices without foreach kernels.

The choice follows the parameters: a strategy that points a group at other parameters after the
default was applied (a pipeline builds its stages at the first forward, and only then holds the
stage's DTensors) calls :func:`refresh_default_implementation`, which chooses again for the groups
kiln filled in (never for a group the user set). The Engine applies the default after its
strategy's setup, for ``kiln.initialize`` and the Trainer alike.

A checkpoint stores each group's ``foreach``/``fused`` flags and loading it puts them back, so a
resumed run steps with the kernels it was saved with.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Literal

import torch

__all__ = ["choose_implementation", "apply_default_implementation", "refresh_default_implementation", "Implementation"]

Implementation = Literal["fused", "foreach", "for-loop"]

# torch.optim classes kiln steps fused (Adagrad has a kernel too, but builds its state in the
# constructor, for the loop), and those of them DTensor can run fused.
_FUSED = ("Adam", "AdamW", "SGD")
_FUSED_DTENSOR = ("Adam", "AdamW")
# Devices kiln steps fused by default: elsewhere fused rounds differently from the loop (see above).
_FUSED_DEVICES = ("cuda",)
# Devices with foreach kernels (torch's list plus the CPU, whose foreach ops loop in C++).
_FOREACH_DEVICES = ("cuda", "cpu", "xpu", "mtia")
# The param groups whose choice kiln made, per optimizer (the group dicts themselves: a group has
# no room for a mark that would not end up in the optimizer's state_dict), and whether kiln set
# ``_step_supports_amp_scaling``.
_FILLED: weakref.WeakKeyDictionary[Any, tuple[list[dict[str, Any]], bool]] = weakref.WeakKeyDictionary()


def _device_type(tensor: torch.Tensor) -> str:
    """The device type a parameter lives on (a function of its own so tests can pretend CUDA)."""
    return tensor.device.type


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def choose_implementation(
    optimizer_cls: type, params: Iterable[torch.Tensor], *, differentiable: bool = False, has_state: bool = False
) -> Implementation:
    """The step kernels kiln uses for ``params`` under an optimizer of class ``optimizer_cls``.

    Args:
        optimizer_cls: the optimizer's class (``torch.optim.AdamW``, ...).
        params: the parameters of one param group, as the strategy left them (placed, sharded).
        differentiable: the group's ``differentiable`` option (True: the loop, as torch requires).
        has_state: the optimizer has stepped already (then not fused: its step counts are on the CPU).

    Example::

        choose_implementation(torch.optim.AdamW, model.parameters())   # "fused" on CUDA, "for-loop" on CPU
    """
    name = optimizer_cls.__name__
    params = list(params)
    if differentiable or not params or not optimizer_cls.__module__.startswith("torch.optim"):
        return "for-loop"
    dtensor = [_is_dtensor(p) for p in params]
    if any(dtensor):
        if _mixes_meshes(params, dtensor):
            return "for-loop"
    elif not all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in params):
        return "for-loop"  # another tensor subclass: its own kernels decide
    devices = {_device_type(p) for p in params}
    if (
        name in _FUSED
        and not has_state
        and devices <= set(_FUSED_DEVICES)
        and all(torch.is_floating_point(p) for p in params)
        and (name in _FUSED_DTENSOR or not any(dtensor))
    ):
        return "fused"
    if devices == {"cpu"} and not any(dtensor):
        return "for-loop"  # torch's CPU default: foreach is no clear win there (see the module docstring)
    if devices <= set(_FOREACH_DEVICES):
        return "foreach"
    return "for-loop"


def _mixes_meshes(params: list[torch.Tensor], dtensor: list[bool]) -> bool:
    """Whether a group's DTensors come with plain tensors or with DTensors of another mesh:
    DTensor's foreach and fused ops take lists on one mesh only."""
    return not all(dtensor) or len({id(getattr(p, "device_mesh", None)) for p in params}) > 1


def _torch_optimizer(optimizer: Any) -> tuple[type | None, list[dict[str, Any]], bool]:
    """(the class whose step runs, the param groups to set, whether ``optimizer`` is that optimizer
    itself) for a torch optimizer or torch's ``ZeroRedundancyOptimizer`` (whose local optimizer
    copies the groups' options at every step)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None, [], False  # DeepSpeed's wrappers and other optimizers kiln does not know
    local = getattr(optimizer, "optim", None)
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer" and isinstance(local, torch.optim.Optimizer):
        return type(local), optimizer.param_groups, False
    return type(optimizer), optimizer.param_groups, True


def apply_default_implementation(optimizer: Any) -> dict[Implementation, int]:
    """Set ``fused`` or ``foreach`` on each param group of ``optimizer`` that left both unset (None).

    Call it after the strategy has placed and sharded the parameters: the choice depends on their
    device and type (the Engine does, after its strategy's setup). Returns how many groups got each
    implementation (empty: nothing changed).

    Example::

        optimizer = torch.optim.AdamW(model.parameters())
        apply_default_implementation(optimizer)   # fused on CUDA; the CPU keeps torch's loop
    """
    cls, groups, direct = _torch_optimizer(optimizer)
    if cls is None:
        return {}
    filled = [g for g in groups if g.get("foreach", False) is None and g.get("fused", None) is None]
    # a Tensor lr: foreach takes it only with capturable=True, so such a group keeps torch's choice
    filled = [g for g in filled if not isinstance(g.get("lr"), torch.Tensor)]
    chosen = _choose_for(optimizer, cls, groups, filled, direct, amp_flag_set=False)
    return chosen


def refresh_default_implementation(optimizer: Any) -> dict[Implementation, int]:
    """Choose again for the groups :func:`apply_default_implementation` filled in, after a strategy
    pointed them at other parameters (:func:`kiln.parallel.state.optimizer_params.repoint_optimizer`
    calls it). Groups the user set, and optimizers kiln never filled, are left as they are."""
    cls, groups, direct = _torch_optimizer(optimizer)
    entry = _FILLED.get(optimizer)
    if cls is None or entry is None:
        return {}
    previous, amp_flag_set = entry
    filled = [g for g in groups if any(g is p for p in previous)]  # a loaded state_dict makes new groups
    for group in filled:
        group["foreach"] = None
        if "fused" in group:
            group["fused"] = None
    return _choose_for(optimizer, cls, groups, filled, direct, amp_flag_set=amp_flag_set)


def _choose_for(
    optimizer: Any,
    cls: type,
    groups: list[dict[str, Any]],
    filled: list[dict[str, Any]],
    direct: bool,
    *,
    amp_flag_set: bool,
) -> dict[Implementation, int]:
    """Set the choice on the ``filled`` groups of ``groups`` and remember them."""
    chosen: dict[Implementation, int] = {}
    has_state = any(optimizer.state.values())
    for group in filled:
        params = list(group["params"])
        choice = choose_implementation(
            cls, params, differentiable=bool(group.get("differentiable")), has_state=has_state
        )
        if choice == "fused":
            group["fused"], group["foreach"] = True, False
        elif choice == "foreach":
            group["foreach"] = True
            if "fused" in group:
                group["fused"] = False
        elif _mixes_meshes(params, [_is_dtensor(p) for p in params]) and any(_is_dtensor(p) for p in params):
            group["foreach"] = False  # torch's default would take foreach here on CUDA, and fail
            if "fused" in group:
                group["fused"] = False
        chosen[choice] = chosen.get(choice, 0) + 1
    every_group_fused = bool(groups) and all(bool(g.get("fused")) for g in groups)
    if direct and every_group_fused:
        # What the constructor sets for fused=True: a GradScaler then hands the scale to the fused
        # kernel, which unscales and skips an inf step itself. Only when every group is fused: the
        # loop and foreach refuse a grad_scale.
        optimizer._step_supports_amp_scaling = True
        amp_flag_set = True
    elif direct and amp_flag_set:
        optimizer._step_supports_amp_scaling = False  # kiln set it, and a group is no longer fused
        amp_flag_set = False
    if filled:
        _FILLED[optimizer] = (filled, amp_flag_set)
    return chosen
