"""Stochastic depth (Huang et al., 2016): skip residual blocks at random during training."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from kiln.algorithms._random import SeededAlgorithm
from kiln.core.event import Event
from kiln.core.time import Time, TimeUnit

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["StochasticDepth"]

Selector = str | type | Callable[[str, nn.Module], bool]
_SUBCLASSES: dict[type[nn.Module], type[nn.Module]] = {}

if TYPE_CHECKING:

    class _Patched(nn.Module):
        """What a patched block carries (for the type checker: no block is an instance of it)."""

        _kiln_base_forward: ClassVar[Callable[..., Any]]
        _kiln_base_class: ClassVar[type[nn.Module]]
        _kiln_generator: torch.Generator
        _kiln_method: str
        _kiln_checked: bool
        _kiln_drop_rate: float


def _stochastic_forward(self: _Patched, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    base_forward = type(self)._kiln_base_forward
    rate = self._kiln_drop_rate
    if not self.training or rate <= 0.0:
        return base_forward(self, x, *args, **kwargs)
    generator = self._kiln_generator
    if self._kiln_method == "block":
        drop = float(torch.rand((), generator=generator)) < rate  # drawn every time: the stream stays aligned
        if drop and self._kiln_checked:
            return x
        out = base_forward(self, x, *args, **kwargs)
        if not self._kiln_checked:  # run once to be sure that skipping the block keeps the shape
            _check_shape(self, x, out)
            self._kiln_checked = True
        return x if drop else out
    keep = torch.rand(x.shape[0], generator=generator) >= rate
    out = base_forward(self, x, *args, **kwargs)
    _check_shape(self, x, out)
    return torch.where(keep.to(x.device).view(-1, *([1] * (x.dim() - 1))), out, x)


def _check_shape(block: _Patched, x: torch.Tensor, out: Any) -> None:
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        name = type(block)._kiln_base_class.__name__
        raise ValueError(
            f"StochasticDepth cannot skip {name}: it maps {tuple(x.shape)} to {shape}; "
            "choose blocks whose output has the shape of their input (no downsampling)"
        )


def _stochastic_class(cls: type[nn.Module]) -> type[nn.Module]:
    # A subclass per block class, swapped in with __class__: parameters, state_dict keys and the
    # optimizer's references stay exactly as they were.
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(
            f"Stochastic{cls.__name__}",
            (cls,),
            {"forward": _stochastic_forward, "_kiln_base_forward": cls.forward, "_kiln_base_class": cls},
        )
    return _SUBCLASSES[cls]


def _matches(selector: Selector, name: str, module: nn.Module) -> bool:
    if isinstance(selector, str):
        return type(module).__name__ == selector
    if isinstance(selector, type):
        return isinstance(module, selector)
    return bool(selector(name, module))


class StochasticDepth(SeededAlgorithm):
    """Skip whole residual blocks at random in training; run every block in evaluation.

    A skipped block returns its input, so a block qualifies when its output has its input's shape
    (ResNet blocks without downsampling, transformer layers). ``stochastic_method="block"`` skips
    the block for the whole microbatch, saving its compute; ``"sample"`` skips it per sample,
    which regularises the same way but saves nothing. With ``drop_distribution="linear"`` the
    ``i``-th of ``L`` blocks is skipped with probability ``drop_rate * (i + 1) / L``, with
    ``"uniform"`` all with ``drop_rate``; ``drop_warmup`` ramps the rates up from zero. Blocks are
    changed in place at ``INIT`` (their class is swapped for a subclass), so parameters and
    checkpoint keys are untouched. Draws come from this algorithm's generator and are the same on
    every rank; under DDP with ``"block"`` the strategy must allow unused parameters.

    Events: ``INIT``/``FIT_START`` (patch the blocks), ``BATCH_START`` (warmup).

    Args:
        target_layer_name: which blocks: a class name (``"BasicBlock"``), a class, or a function
            ``(name, module) -> bool``; blocks inside a chosen block are not chosen again.
        stochastic_method: ``"block"`` or ``"sample"``.
        drop_rate: the largest probability of skipping a block, in ``[0, 1]``.
        drop_distribution: ``"linear"`` (deeper blocks more often) or ``"uniform"``.
        drop_warmup: time over which the rates rise linearly from zero (``"0.0dur"``: none).
        seed: seeds this algorithm's generator (default: from the run's seed).

    Example::

        algorithms = [kiln.algorithms.StochasticDepth("BasicBlock", drop_rate=0.2)]
    """

    find_unused_parameters = True  # skipped or frozen layers get no gradient: DDP must not wait for them

    def __init__(
        self,
        target_layer_name: Selector,
        stochastic_method: str = "block",
        drop_rate: float = 0.2,
        drop_distribution: str = "linear",
        drop_warmup: str | Time = "0.0dur",
        *,
        seed: int | None = None,
    ) -> None:
        super().__init__(seed)
        if stochastic_method not in ("block", "sample"):
            raise ValueError(f"StochasticDepth(stochastic_method={stochastic_method!r}): expected 'block' or 'sample'")
        if drop_distribution not in ("linear", "uniform"):
            raise ValueError(
                f"StochasticDepth(drop_distribution={drop_distribution!r}): expected 'linear' or 'uniform'"
            )
        if not 0.0 <= drop_rate <= 1.0:
            raise ValueError(f"StochasticDepth(drop_rate={drop_rate!r}): must be a probability in [0, 1]")
        self.target_layer_name = target_layer_name
        self.stochastic_method = stochastic_method
        self.drop_rate = drop_rate
        self.drop_distribution = drop_distribution
        self.drop_warmup = Time.from_input(drop_warmup, TimeUnit.EPOCH)
        self.blocks: list[_Patched] = []
        self._checked: list[bool] | None = None  # loaded before the blocks were patched

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.INIT, Event.FIT_START, Event.BATCH_START)

    def apply(self, event: Event, state: State, logger: Any) -> None:
        if not self.blocks:
            self._patch(state)
        if event == Event.BATCH_START and self.drop_warmup.value > 0:
            warmup = state.resolve(self.drop_warmup)
            done = state.timestamp.get(warmup.unit).value
            self._set_rates(min(1.0, done / warmup.value) if warmup.value else 1.0)

    def _patch(self, state: State) -> None:
        chosen: list[tuple[str, nn.Module]] = []
        for name, module in state.model.named_modules():
            if any(name.startswith(parent + ".") for parent, _ in chosen):
                continue
            if _matches(self.target_layer_name, name, module):
                chosen.append((name, module))
        if not chosen:
            kinds = sorted({type(m).__name__ for m in state.model.modules()})
            raise ValueError(
                f"StochasticDepth(target_layer_name={self.target_layer_name!r}) matched no module; the "
                f"model has {', '.join(kinds[:20])}"
            )
        generator = self.generator(state)
        for _, module in chosen:
            module.__class__ = _stochastic_class(type(module))
            block = cast("_Patched", module)
            block._kiln_generator = generator
            block._kiln_method = self.stochastic_method
            block._kiln_checked = False
        self.blocks = [cast("_Patched", block) for _, block in chosen]
        self._set_rates(0.0 if self.drop_warmup.value > 0 else 1.0)
        if self._checked is not None:
            self._set_checked(self._checked)

    def _set_checked(self, checked: list[bool]) -> None:
        for block, done in zip(self.blocks, checked):
            block._kiln_checked = bool(done)
        self._checked = None

    def state_dict(self) -> dict[str, Any]:
        # Which blocks ran their one shape check: that forward of a block that is being skipped
        # draws from the global RNG (dropout) and updates buffers (batch norm), so a resumed run
        # must not run it a second time.
        return {**super().state_dict(), "checked": [bool(b._kiln_checked) for b in self.blocks]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "checked" in state:
            self._checked = list(state["checked"])
            if self.blocks:
                self._set_checked(self._checked)

    def _set_rates(self, scale: float) -> None:
        count = len(self.blocks)
        for index, block in enumerate(self.blocks):
            depth = (index + 1) / count if self.drop_distribution == "linear" else 1.0
            block._kiln_drop_rate = self.drop_rate * depth * scale
