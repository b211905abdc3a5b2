"""Peak FLOP/s of common accelerators, for model FLOPs utilisation (MFU).

Dense (no 2:4 structured sparsity) tensor-core peaks per GPU, from the vendors' data sheets: the
sheets print the sparse figure for the tensor cores, and the dense one is half of it. Unknown
devices and CPUs give None, and :func:`describe_peak` says so: an MFU against a guessed peak would
mislead more than help (``SpeedMonitor(peak_flops_per_sec=...)`` takes the peak of any device).

Sources (per GPU; TF32/BF16/FP16/FP8 are the tensor-core rows):

* H100 SXM, H100 PCIe, H100 NVL: NVIDIA H100 Tensor Core GPU datasheet
  (nvidia.com/en-us/data-center/h100): BF16 1,979 / 1,513 / 1,671 TFLOPS with sparsity.
* H200 SXM and H200 NVL: NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): the H100's
  GH100 at the same clocks (SXM BF16 1,979 sparse; NVL 1,671 sparse).
* A100 (SXM and PCIe, 40 and 80 GB): NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100):
  BF16 312 dense, TF32 156 dense; no FP8 tensor cores.
* L40S: NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s): BF16 362 dense (733 sparse),
  FP8 733 dense, TF32 183 dense. L40: NVIDIA L40 datasheet. L4: NVIDIA L4 datasheet
  (nvidia.com/en-us/data-center/l4): BF16 242 sparse, FP8 485 sparse, TF32 120 sparse.
* B200 (HGX, 1,000 W): NVIDIA HGX B200 datasheet (nvidia.com/en-us/data-center/hgx), per GPU of
  the 8: FP8 9 PFLOPS sparse, BF16 4.5 sparse, TF32 2.2 sparse, FP64 37 TFLOPS. GB200 (1,200 W):
  NVIDIA GB200 NVL72 datasheet, per GPU: FP8 10 PFLOPS sparse, BF16 5 sparse, TF32 2.5 sparse.
* A10, V100, T4: their NVIDIA datasheets (kept from the first table; no BF16 on V100/T4).
"""

from __future__ import annotations

import re

import torch

__all__ = ["peak_flops_per_sec", "device_family", "describe_peak"]

_T = 1e12
_PEAK: dict[str, dict[str, float]] = {
    "b200": {
        "fp64": 37 * _T,
        "fp32": 75 * _T,
        "tf32": 1100 * _T,
        "bf16": 2250 * _T,
        "fp16": 2250 * _T,
        "fp8": 4500 * _T,
    },
    "gb200": {
        "fp64": 45 * _T,
        "fp32": 90 * _T,
        "tf32": 1250 * _T,
        "bf16": 2500 * _T,
        "fp16": 2500 * _T,
        "fp8": 5000 * _T,
    },
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
    "h200-nvl": {
        "fp64": 60 * _T,
        "fp32": 60 * _T,
        "tf32": 417.5 * _T,
        "bf16": 835.5 * _T,
        "fp16": 835.5 * _T,
        "fp8": 1671 * _T,
    },
    "a100": {"fp64": 19.5 * _T, "fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
    "a10": {"fp32": 31.2 * _T, "tf32": 62.5 * _T, "bf16": 125 * _T, "fp16": 125 * _T},
    "l40s": {"fp32": 91.6 * _T, "tf32": 183 * _T, "bf16": 362 * _T, "fp16": 362 * _T, "fp8": 733 * _T},
    "l40": {"fp32": 90.5 * _T, "tf32": 90.5 * _T, "bf16": 181 * _T, "fp16": 181 * _T, "fp8": 362 * _T},
    "l4": {"fp32": 30.3 * _T, "tf32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T, "fp8": 242.5 * _T},
    "v100-sxm": {"fp64": 7.8 * _T, "fp32": 15.7 * _T, "fp16": 125 * _T},
    "v100-pcie": {"fp64": 7 * _T, "fp32": 14 * _T, "fp16": 112 * _T},
    "v100s": {"fp64": 8.2 * _T, "fp32": 16.4 * _T, "fp16": 130 * _T},
    "t4": {"fp32": 8.1 * _T, "fp16": 65 * _T},
}

_DTYPE_KEYS = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# float8 training (torchao) runs its matmuls in either float8 format at the same peak
_DTYPE_KEYS.update({getattr(torch, n): "fp8" for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)})


def device_family(name: str) -> str | None:
    """The table key for a CUDA device name such as ``"NVIDIA H100 80GB HBM3"``; None if unknown."""
    words = set(re.split(r"[\s\-_]+", name.lower()))
    if "h100" in words:  # the SXM part reports HBM3; PCIe and NVL say so in the name
        return "h100-nvl" if "nvl" in words else "h100-pcie" if "pcie" in words else "h100-sxm"
    if words & {"h200", "gh200"}:
        return "h200-nvl" if "nvl" in words else "h200"
    if "gb200" in words:
        return "gb200"
    if "b200" in words:
        return "b200"
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


def _resolve(device: torch.device | str, dtype: torch.dtype) -> tuple[str | None, str | None, str]:
    """(table family, dtype key, the device's name) for a device and a matmul dtype."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, _DTYPE_KEYS.get(dtype), device.type
    name = torch.cuda.get_device_name(device)
    key = _DTYPE_KEYS.get(dtype)
    if key == "fp32" and (torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"):
        key = "tf32"  # what the kernels run
    return device_family(name), key, name


def peak_flops_per_sec(device: torch.device | str, dtype: torch.dtype = torch.float32) -> float | None:
    """The device's peak FLOP/s for matmuls in ``dtype``; None for CPUs and devices not in the table.

    float32 counts as TF32 when torch lets matmuls use it (``torch.backends.cuda.matmul.allow_tf32``
    or a float32 matmul precision other than ``"highest"``), since that is what the kernels run.

    Example::

        peak_flops_per_sec("cuda:0", torch.bfloat16)   # 989.4e12 on an H100 SXM
    """
    family, key, _ = _resolve(device, dtype)
    if family is None or key is None:
        return None
    return _PEAK[family].get(key)


def describe_peak(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """One line on the peak :func:`peak_flops_per_sec` gives: its value and where from, or why
    there is none (a CPU, a device the table does not know, a dtype the device has no peak for).

    Example::

        describe_peak("cpu")   # "no peak FLOP/s for cpu (kiln's table covers NVIDIA GPUs); ..."
    """
    family, key, name = _resolve(device, dtype)
    fix = "pass SpeedMonitor(peak_flops_per_sec=...) for MFU"
    if family is None:
        what = "CPUs" if name == "cpu" else f"{name!r}"
        known = ", ".join(sorted(_PEAK))
        return f"no peak FLOP/s for {what}: an unknown device (kiln's table covers {known}); {fix}"
    peak = _PEAK[family].get(key) if key is not None else None
    if peak is None:
        return f"no peak FLOP/s for {name} ({family}) in {key or dtype}; {fix}"
    return f"peak {peak / _T:g} TFLOP/s: {name} ({family}), dense {key}"
