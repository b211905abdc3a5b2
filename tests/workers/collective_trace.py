"""Watch torch.distributed's tensor collectives for calls made on behalf of kiln code.

``install(on_call)`` wraps every tensor collective of ``torch.distributed`` (kiln and torchmetrics
look them up there at call time); each call whose Python stack passes through ``src/kiln`` is
reported as ``on_call(Call)`` before it runs. Object collectives (``*_object``) build their own
tensors on the right device inside torch and are not watched; barriers carry no tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

KILN_SRC = str(Path(__file__).resolve().parents[2] / "src" / "kiln")

TENSOR_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


@dataclass
class Call:
    op: str
    devices: list[torch.device]
    group: Any
    site: str  # the innermost kiln frame: "trainer/options.py:160 (any_rank_oom)"


def tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def kiln_site() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(KILN_SRC):
            return f"{filename[len(KILN_SRC) + 1 :]}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return None


def install(on_call: Callable[[Call], None]) -> Callable[[], None]:
    """Wrap the collectives; returns a function that restores them."""
    originals = {name: getattr(dist, name) for name in TENSOR_COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, original: Callable) -> Callable:
        def collective(*args: Any, **kwargs: Any) -> Any:
            site = kiln_site()
            if site is not None:
                tensors = tensors_in(list(args) + [v for k, v in kwargs.items() if k != "group"])
                on_call(Call(name, [t.device for t in tensors], kwargs.get("group"), site))
            return original(*args, **kwargs)

        return collective

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))

    def restore() -> None:
        for name, original in originals.items():
            setattr(dist, name, original)

    return restore


def allowed(call: Call, device: torch.device) -> bool:
    """Every tensor on ``device``, or a CPU tensor on a group that is explicitly gloo (the
    checkpoint layer's own groups, see kiln.checkpoint.collectives.gloo_group)."""
    if all(_same(d, device) for d in call.devices):
        return True
    explicit_gloo = call.group is not None and dist.is_initialized() and dist.get_backend(call.group) == "gloo"
    return explicit_gloo and all(d.type == "cpu" for d in call.devices)


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)
