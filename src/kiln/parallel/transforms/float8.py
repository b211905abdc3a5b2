"""FP8 training through torchao's float8 linears: which layers convert, on which devices, how.

``float8=True`` (or a dict of settings) swaps the eligible ``nn.Linear`` layers for torchao's
``Float8Linear`` at the parallelize pipeline's ``float8`` step: after placement and before tensor
parallel and compile, which then see the converted layers (torchtitan's order). The weights stay
in their dtype and under their names, so checkpoints are the same with and without FP8; the
matmuls run in FP8 with dynamic scales.

FP8 matmuls need an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or higher: L4, L40S,
H100, H200, B200). Elsewhere the conversion is refused with one line, unless ``emulate=True``,
torchao's emulation in higher precision, which runs anywhere and exists to check the conversion
(it is what the CPU tests use).

Settings (``float8={...}``):

================  =====================================================================
``recipe``        ``"tensorwise"`` (default: one scale per tensor, the fastest) or ``"rowwise"``
                  (one scale per row: more accurate, for large models)
``emulate``       run the FP8 casts in higher precision (any device; for checking)
``skip``          names of layers to keep in high precision; a layer is skipped when its
                  qualified name ends with one (default: ``["lm_head", "output"]``, the
                  vocabulary projection, which is sensitive to precision)
================  =====================================================================

A layer converts when its ``in_features`` and ``out_features`` are both multiples of 16 (FP8
kernels need them) and it is not skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "FLOAT8_RECIPES",
    "Float8Settings",
    "float8_settings",
    "check_float8_device",
    "float8_eligible",
    "convert_float8",
]

FLOAT8_RECIPES = ("tensorwise", "rowwise")
_KEYS = ("recipe", "emulate", "skip")
_MIN_CAPABILITY = (8, 9)


@dataclasses.dataclass(frozen=True)
class Float8Settings:
    """``float8=`` after validation (see the module docstring)."""

    recipe: str = "tensorwise"
    emulate: bool = False
    skip: tuple[str, ...] = ("lm_head", "output")


def float8_settings(spec: Any) -> Float8Settings | None:
    """``float8=`` as :class:`Float8Settings`: ``None``/``False`` is off, ``True`` the defaults, a dict
    the given settings. A bad value raises one line naming it and what is expected."""
    if spec is None or spec is False:
        return None
    if spec is True:
        return Float8Settings()
    if isinstance(spec, Float8Settings):
        return spec
    if not isinstance(spec, Mapping):
        raise ValueError(f"float8={spec!r}: expected True, False/None or a dict with keys {', '.join(_KEYS)}")
    unknown = sorted(set(spec) - set(_KEYS))
    if unknown:
        raise ValueError(f"float8 has unknown keys {unknown}; expected some of {', '.join(_KEYS)}")
    recipe = spec.get("recipe", "tensorwise")
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8 recipe={recipe!r}: expected one of {', '.join(FLOAT8_RECIPES)}")
    emulate = spec.get("emulate", False)
    if not isinstance(emulate, bool):
        raise ValueError(f"float8 emulate={emulate!r}: expected True or False")
    skip = spec.get("skip", Float8Settings.skip)
    if isinstance(skip, str) or not all(isinstance(name, str) for name in skip):
        raise ValueError(f"float8 skip={skip!r}: expected a list of layer names, e.g. ['lm_head']")
    return Float8Settings(recipe=recipe, emulate=emulate, skip=tuple(skip))


def check_float8_device(device: torch.device, settings: Float8Settings) -> None:
    """Refuse FP8 where it cannot run: not CUDA, or a GPU without FP8 tensor cores (emulation runs anywhere)."""
    if settings.emulate:
        return
    if device.type != "cuda":
        raise ValueError(
            f"float8 training needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: L4, L40S, H100, "
            f"H200, B200); this run is on {device.type}. Use precision='amp_bf16', or float8={{'emulate': True}} "
            "to check the conversion"
        )
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < _MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"float8 training needs compute capability 8.9 or higher (L4, L40S, H100, H200, B200); {name} has "
            f"{capability[0]}.{capability[1]}. Use precision='amp_bf16' on this GPU"
        )


def float8_eligible(module: nn.Module, name: str, settings: Float8Settings) -> bool:
    """Whether ``module`` (called ``name`` in the model) converts: a Linear with both sizes multiples
    of 16, not named in ``settings.skip``."""
    if not isinstance(module, nn.Linear):
        return False
    if module.in_features % 16 or module.out_features % 16:
        return False
    return not any(name == skip or name.endswith("." + skip) for skip in settings.skip)


def convert_float8(model: nn.Module, spec: Any, device: torch.device) -> nn.Module:
    """Swap ``model``'s eligible linears for torchao's ``Float8Linear`` in place; returns ``model``.

    Example::

        convert_float8(model, {"recipe": "rowwise"}, torch.device("cuda", 0))
    """
    settings = float8_settings(spec)
    if settings is None:
        return model
    check_float8_device(device, settings)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ImportError("float8 training needs torchao: pip install torchao (or kiln's 'fp8' extra)") from None
    config = Float8LinearConfig() if settings.recipe == "tensorwise" else Float8LinearConfig.from_recipe_name("rowwise")
    if settings.emulate:
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, name: float8_eligible(module, name, settings)
    )
    return model
