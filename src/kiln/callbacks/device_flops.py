"""Peak FLOP/s of common accelerators, for model FLOPs utilisation (MFU).

Dense (no structured sparsity) tensor-core peaks from the vendors' data sheets, per GPU.
Unknown devices and CPUs give None: an MFU against a guessed peak would mislead more than help.
"""

from __future__ import annotations

import re

import torch

__all__ = ["peak_flops_per_sec", "device_family"]

_T = 1e12
_PEAK: dict[str, dict[str, float]] = {
    "h100-sxm": {
        "fp64": 67 * _T,
        "fp32": 67 * _T,
        "tf32": 494.7 * _T,
        "bf16": 989.4 * _T,
        "fp16": 989.4 * _T,
        "fp8": 1978.9 * _T,
    },
    "h100-pcie": {
        "fp64": 51.2 * _T,
        "fp32": 51.2 * _T,
        "tf32": 378 * _T,
        "bf16": 756.5 * _T,
        "fp16": 756.5 * _T,
        "fp8": 1513 * _T,
    },
    "h100-nvl": {
        "fp64": 60 * _T,
        "fp32": 60 * _T,
        "tf32": 417.5 * _T,
        "bf16": 835.5 * _T,
        "fp16": 835.5 * _T,
        "fp8": 1671 * _T,
    },
    "h200": {
        "fp64": 67 * _T,
        "fp32": 67 * _T,
        "tf32": 494.7 * _T,
        "bf16": 989.4 * _T,
        "fp16": 989.4 * _T,
        "fp8": 1978.9 * _T,
    },
    "a100": {"fp64": 19.5 * _T, "fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
    "a10": {"fp32": 31.2 * _T, "tf32": 62.5 * _T, "bf16": 125 * _T, "fp16": 125 * _T},
    "l40s": {"fp32": 91.6 * _T, "tf32": 183 * _T, "bf16": 362 * _T, "fp16": 362 * _T, "fp8": 733 * _T},
    "l40": {"fp32": 90.5 * _T, "tf32": 90.5 * _T, "bf16": 181 * _T, "fp16": 181 * _T, "fp8": 362 * _T},
    "l4": {"fp32": 30.3 * _T, "tf32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T, "fp8": 242 * _T},
    "v100-sxm": {"fp64": 7.8 * _T, "fp32": 15.7 * _T, "fp16": 125 * _T},
    "v100-pcie": {"fp64": 7 * _T, "fp32": 14 * _T, "fp16": 112 * _T},
    "v100s": {"fp64": 8.2 * _T, "fp32": 16.4 * _T, "fp16": 130 * _T},
    "t4": {"fp32": 8.1 * _T, "fp16": 65 * _T},
}

_DTYPE_KEYS = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def device_family(name: str) -> str | None:
    """The table key for a CUDA device name such as ``"NVIDIA H100 80GB HBM3"``; None if unknown."""
    words = set(re.split(r"[\s\-_]+", name.lower()))
    if "h100" in words:  # the SXM part reports HBM3; PCIe and NVL say so in the name
        return "h100-nvl" if "nvl" in words else "h100-pcie" if "pcie" in words else "h100-sxm"
    if words & {"h200", "gh200"}:
        return "h200"
    if "a100" in words:
        return "a100"
    if words & {"a10", "a10g"}:
        return "a10"
    for family in ("l40s", "l40", "l4", "v100s", "t4"):
        if family in words:
            return family
    if "v100" in words:
        return "v100-pcie" if "pcie" in words else "v100-sxm"
    return None


def peak_flops_per_sec(device: torch.device | str, dtype: torch.dtype = torch.float32) -> float | None:
    """The device's peak FLOP/s for matmuls in ``dtype``; None for CPUs and devices not in the table.

    float32 counts as TF32 when torch lets matmuls use it (``torch.backends.cuda.matmul.allow_tf32``
    or a float32 matmul precision other than ``"highest"``), since that is what the kernels run.

    Example::

        peak_flops_per_sec("cuda:0", torch.bfloat16)   # 989.4e12 on an H100 SXM
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    family = device_family(torch.cuda.get_device_name(device))
    key = _DTYPE_KEYS.get(dtype)
    if family is None or key is None:
        return None
    if key == "fp32" and (torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"):
        key = "tf32"
    return _PEAK[family].get(key)
