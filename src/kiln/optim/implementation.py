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
* **foreach** for the other optimizers of ``torch.optim``, and on the CPU: torch's CPU foreach ops
  give the same bits as the loop (``tests/test_optimizer_choice.py`` checks), so runs recorded
  before this default, golden runs and resumed checkpoints among them, do not move. On the CPU
  foreach saves the per-tensor Python overhead (AdamW 1.4-1.5x faster for many small tensors and
  for large ones, ``benchmarks/optimizer_step.py``) but runs each op over every tensor before the
  next, so mid-sized models whose tensors the loop keeps in cache step slower (0.6x for 24
  256x256 layers). CPU fused kernels are 3-6x faster than either but round differently from the
  loop: a user asks for them with ``fused=True``.
* **the loop** (nothing set) for anything else: optimizers outside ``torch.optim`` (DeepSpeed's,
  third-party ones, subclasses), ``differentiable=True``, a Tensor learning rate, tensor
  subclasses other than DTensor, a group mixing DTensors with plain tensors (tensor parallel leaves
  unplanned layers plain) or DTensors of several meshes, devices without foreach kernels.

A checkpoint stores each group's ``foreach``/``fused`` flags and loading it puts them back, so a
resumed run steps with the kernels it was saved with.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch

__all__ = ["choose_implementation", "apply_default_implementation", "Implementation"]

Implementation = Literal["fused", "foreach", "for-loop"]

# torch.optim classes kiln steps fused (Adagrad has a kernel too, but builds its state in the
# constructor, for the loop), and those of them DTensor can run fused.
_FUSED = ("Adam", "AdamW", "SGD")
_FUSED_DTENSOR = ("Adam", "AdamW")
# Devices kiln steps fused by default: elsewhere fused rounds differently from the loop (see above).
_FUSED_DEVICES = ("cuda",)
# Devices with foreach kernels (torch's list plus the CPU, whose foreach ops loop in C++).
_FOREACH_DEVICES = ("cuda", "cpu", "xpu", "mtia")


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

        choose_implementation(torch.optim.AdamW, model.parameters())   # "fused" on CUDA, "foreach" on CPU
    """
    name = optimizer_cls.__name__
    params = list(params)
    if differentiable or not params or not optimizer_cls.__module__.startswith("torch.optim"):
        return "for-loop"
    dtensor = [_is_dtensor(p) for p in params]
    if any(dtensor):
        # DTensor's foreach and fused ops take lists of DTensors on one mesh: not a mix with plain
        # tensors (tensor parallel leaves unplanned layers plain) or with another mesh.
        if not all(dtensor) or len({id(getattr(p, "device_mesh", None)) for p in params}) > 1:
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
    if devices <= set(_FOREACH_DEVICES):
        return "foreach"
    return "for-loop"


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
    device and type. Returns how many groups got each implementation (empty: nothing changed).

    Example::

        engine, *_ = kiln.initialize(model, torch.optim.AdamW(model.parameters()))
        apply_default_implementation(engine.optimizer)   # the Trainer does this itself
    """
    cls, groups, direct = _torch_optimizer(optimizer)
    chosen: dict[Implementation, int] = {}
    if cls is None:
        return chosen
    has_state = any(optimizer.state.values())
    every_group_fused = True
    for group in groups:
        unset = group.get("foreach", False) is None and group.get("fused", None) is None
        if not unset or isinstance(group.get("lr"), torch.Tensor):
            # the user's choice; or a Tensor lr, which foreach takes only with capturable=True
            every_group_fused = every_group_fused and bool(group.get("fused"))
            continue
        choice = choose_implementation(
            cls, group["params"], differentiable=bool(group.get("differentiable")), has_state=has_state
        )
        if choice == "fused":
            group["fused"], group["foreach"] = True, False
        elif choice == "foreach":
            group["foreach"] = True
            if "fused" in group:
                group["fused"] = False
        every_group_fused = every_group_fused and choice == "fused"
        chosen[choice] = chosen.get(choice, 0) + 1
    if every_group_fused and chosen.get("fused") and direct:
        # What the constructor sets for fused=True: a GradScaler then hands the scale to the fused
        # kernel, which unscales and skips an inf step itself. Only when every group is fused: the
        # loop and foreach refuse a grad_scale.
        optimizer._step_supports_amp_scaling = True
    return chosen
