"""Precision: how tensors are typed during a step, and the loss scaler that fp16 needs.

=========  ===================  =====================  ===============
name       parameters/buffers   forward math           loss scaling
=========  ===================  =====================  ===============
fp32       float32              float32                none
amp_bf16   float32              autocast bfloat16      none
amp_fp16   float32              autocast float16       GradScaler
bf16       bfloat16             bfloat16               none
fp16       float16              float16                GradScaler
=========  ===================  =====================  ===============

A dict gives per-tensor-type dtypes: ``{"param": "bf16", "buffer": "fp32", "input": "bf16"}``.
Colossal-AI's ``fp16=dict(mode=AMP_TYPE.TORCH)`` maps to ``amp_fp16``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from enum import Enum
from typing import Any

import torch
from torch import nn

from kiln.core.names import did_you_mean

__all__ = ["AMP_TYPE", "DTYPES", "Precision", "PRECISIONS", "TENSOR_TYPES", "get_precision", "precision_from_config"]

# The one home of these names: the config layer, the checkpoint tools and the CLI builder read them here.
# Dtype names for per-tensor-type precisions and for casting checkpoints (``kiln checkpoint export --dtype``).
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
TENSOR_TYPES = ("param", "buffer", "input")
# Each named precision as Precision's keyword arguments (the table in this module's docstring).
_NAMED: dict[str, dict[str, Any]] = {
    "fp32": {},
    "amp_bf16": {"autocast_dtype": torch.bfloat16},
    "amp_fp16": {"autocast_dtype": torch.float16, "scaled": True},
    "bf16": {"param_dtype": torch.bfloat16, "buffer_dtype": torch.bfloat16, "input_dtype": torch.bfloat16},
    "fp16": {"param_dtype": torch.float16, "buffer_dtype": torch.float16, "input_dtype": torch.float16, "scaled": True},
}
PRECISIONS = tuple(_NAMED)
_ALIASES = {
    "amp": "amp_fp16",
    "torch": "amp_fp16",
    "float32": "fp32",
    "32": "fp32",
}  # other spellings get_precision takes


class AMP_TYPE(str, Enum):  # noqa: N801 -- Colossal-AI's public name
    """Colossal-AI's mixed-precision modes, mapped onto kiln's precision names."""

    TORCH = "torch"  # torch.amp autocast + GradScaler -> amp_fp16
    APEX = "apex"  # apex O1/O2 has no torch equivalent beyond autocast -> amp_fp16
    NAIVE = "naive"  # parameters in fp16 with a loss scaler -> fp16


_AMP_TO_PRECISION = {AMP_TYPE.TORCH: "amp_fp16", AMP_TYPE.APEX: "amp_fp16", AMP_TYPE.NAIVE: "fp16"}


class _FP16ParamScaler(torch.amp.GradScaler):
    # Parameters held in fp16 have fp16 gradients, which torch's GradScaler refuses to unscale
    # unless told it may (FSDP's ShardedGradScaler does the same).
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


class Precision:
    """A precision policy.

    Args:
        name: one of ``fp32``, ``amp_bf16``, ``amp_fp16``, ``bf16``, ``fp16``, or ``custom`` for a dict.
        param_dtype / buffer_dtype / input_dtype: storage dtypes (``None`` leaves tensors alone).
        autocast_dtype: the autocast dtype, ``None`` for no autocast.
        scaled: whether the loss needs a GradScaler.

    Example::

        precision = kiln.precision.get_precision("amp_bf16")
        with precision.autocast(device):
            out = model(x)
    """

    def __init__(
        self,
        name: str,
        param_dtype: torch.dtype | None = None,
        buffer_dtype: torch.dtype | None = None,
        input_dtype: torch.dtype | None = None,
        autocast_dtype: torch.dtype | None = None,
        scaled: bool = False,
    ) -> None:
        self.name = name
        self.param_dtype = param_dtype
        self.buffer_dtype = buffer_dtype
        self.input_dtype = input_dtype
        self.autocast_dtype = autocast_dtype
        self.scaled = scaled

    def __repr__(self) -> str:
        return f"Precision({self.name!r})"

    @property
    def casts_inputs(self) -> bool:
        return self.input_dtype is not None and self.input_dtype != torch.float32

    def setup_module(self, model: nn.Module) -> nn.Module:
        """Cast parameters and floating buffers to their storage dtypes, in place."""
        for module in model.modules():
            for _name, param in module.named_parameters(recurse=False):
                if self.param_dtype is not None and param.is_floating_point() and param.dtype != self.param_dtype:
                    param.data = param.data.to(self.param_dtype)
            for name, buf in module.named_buffers(recurse=False):
                if self.buffer_dtype is not None and buf.is_floating_point() and buf.dtype != self.buffer_dtype:
                    module._buffers[name] = buf.to(self.buffer_dtype)
        return model

    def autocast(self, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device_type = torch.device(device).type
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    def cast_input(self, data: Any) -> Any:
        """Cast floating-point tensors in ``data`` (nested lists, tuples, dicts) to the input dtype."""
        dtype = self.input_dtype
        if dtype is None:
            return data
        if isinstance(data, torch.Tensor):
            return data.to(dtype) if data.is_floating_point() else data
        if isinstance(data, (list, tuple)):
            return type(data)(self.cast_input(d) for d in data)
        if isinstance(data, Mapping):
            return type(data)(  # type: ignore[call-arg]  # its own mapping class, which takes a dict
                {k: self.cast_input(v) for k, v in data.items()}
            )
        return data

    def make_scaler(self, device: torch.device | str) -> torch.amp.GradScaler | None:
        if not self.scaled:
            return None
        device_type = torch.device(device).type
        cls = _FP16ParamScaler if self.param_dtype == torch.float16 else torch.amp.GradScaler
        return cls(device_type)


def _dtype(value: Any, key: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise ValueError(
            f"precision[{key!r}]={value!r} is not a dtype name; expected one of fp32, bf16, fp16"
            + did_you_mean(value, DTYPES)
        )
    return DTYPES[value]


def get_precision(spec: str | Mapping[str, Any] | Precision | None) -> Precision:
    """Build a :class:`Precision` from a name, a per-tensor-type dict, or ``None`` (fp32)."""
    if isinstance(spec, Precision):
        return spec
    if spec is None:
        spec = "fp32"
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(TENSOR_TYPES))
        if unknown:
            raise ValueError(
                f"precision has unknown tensor types {unknown}; expected keys among {list(TENSOR_TYPES)}"
                + did_you_mean(unknown[0], TENSOR_TYPES)
            )
        dtypes = {k: _dtype(v, k) for k, v in spec.items()}
        param = dtypes.get("param", torch.float32)
        return Precision(
            "custom",
            param_dtype=param,
            buffer_dtype=dtypes.get("buffer", param),
            input_dtype=dtypes.get("input", param),
            scaled=param == torch.float16,
        )
    name = str(spec.value if isinstance(spec, Enum) else spec).lower()
    name = _ALIASES.get(name, name)
    if name in _NAMED:
        return Precision(name, **_NAMED[name])
    raise ValueError(
        f"precision={spec!r} is not known; expected one of {', '.join(PRECISIONS)} "
        f"or a dict of {{param, buffer, input}} dtypes{did_you_mean(name, [*PRECISIONS, *_ALIASES])}"
    )


def precision_from_config(config: Mapping[str, Any]) -> Precision:
    """Read ``precision`` or Colossal-AI's ``fp16=dict(mode=AMP_TYPE.TORCH)`` from a config."""
    if "precision" in config and "fp16" in config:
        raise ValueError("config sets both 'precision' and 'fp16'; keep one of them")
    if "fp16" in config:
        fp16 = config["fp16"]
        mode = fp16.get("mode") if isinstance(fp16, Mapping) else fp16
        try:
            amp = AMP_TYPE(mode.value if isinstance(mode, Enum) else str(mode).lower())
        except ValueError:
            raise ValueError(
                f"config fp16.mode={mode!r} is not known; expected one of "
                f"{', '.join(m.name for m in AMP_TYPE)} (kiln.AMP_TYPE)"
            ) from None
        return get_precision(_AMP_TO_PRECISION[amp])
    return get_precision(config.get("precision"))
