"""The device classes ``kiln plan --search`` (and ``strategy="auto"``) plans for: one table.

Per device, the constants of the cost model of :mod:`kiln.planning.search`:

* ``bf16_flops``: the dense bf16 tensor-core peak, FLOP/s (the vendors' data sheets, as
  :mod:`kiln.callbacks.device_flops` has them for MFU; a test keeps the two equal);
* ``memory``: bytes of device memory (the data sheets' capacity);
* ``intra_node_bw``: bytes/s one device moves to the others of its node in one direction (NVLink:
  900 GB/s both ways on H100/H200, so 450 GB/s each way; A100 NVLink 3: 300; B200 NVLink 5: 900;
  MI300X Infinity Fabric: 7 links of 64 GB/s each way);
* ``inter_node_bw``: bytes/s one device moves across nodes in one direction (one 400 Gb/s NIC per GPU
  on H100/H200/B200/MI300X clusters = 50 GB/s; 200 Gb/s HDR on A100 clusters = 25 GB/s);
* ``devices_per_node``: devices that share the intra-node links (8 on every HGX/OAM board).

``cpu`` is this kind of machine: gloo over shared memory and a 10 Gb/s network; its peak is a
nominal 1 TFLOP/s and its memory the host's (None: the search needs ``--memory``). These are
peaks: :data:`COMPUTE_EFFICIENCY` of the FLOP/s peak is assumed reached (torchtitan reports 33-39%
MFU for Llama 3.1 8B on H100; nnScaler 41% for Llama 3 8B at 128K), and the bandwidths as printed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceClass", "DEVICES", "COMPUTE_EFFICIENCY", "device_class", "device_class_of"]

_G = 1e9
_GiB = 1024**3


@dataclass(frozen=True)
class DeviceClass:
    """The constants of one device class (see the module docstring)."""

    name: str
    bf16_flops: float
    memory: int | None
    intra_node_bw: float
    inter_node_bw: float
    devices_per_node: int


# fmt: off
DEVICES: dict[str, DeviceClass] = {d.name: d for d in (
    #           name      bf16 FLOP/s  memory (bytes)  intra-node B/s  inter-node B/s  per node
    DeviceClass("a100",   312e12,      80 * _GiB,      300 * _G,       25 * _G,        8),
    DeviceClass("h100",   989.4e12,    80 * _GiB,      450 * _G,       50 * _G,        8),
    DeviceClass("h200",   989.4e12,    141 * 10**9,    450 * _G,       50 * _G,        8),
    DeviceClass("b200",   2250e12,     180 * 10**9,    900 * _G,       50 * _G,        8),
    DeviceClass("mi300x", 1307.4e12,   192 * 10**9,    448 * _G,       50 * _G,        8),
    DeviceClass("cpu",    1e12,        None,           20 * _G,        1.25 * _G,      1),
)}
# fmt: on
COMPUTE_EFFICIENCY = 0.4  # the fraction of the bf16 peak a step's matmuls are assumed to reach


def device_class(name: str) -> DeviceClass:
    """The class named ``name`` (case-insensitive); ``ValueError`` naming the known ones otherwise."""
    key = str(name).lower().replace("-", "").replace("_", "")
    key = {"h100sxm": "h100", "a10080gb": "a100", "mi300": "mi300x"}.get(key, key)
    if key not in DEVICES:
        raise ValueError(f"--device {name!r} is not a device class kiln knows; expected one of {', '.join(DEVICES)}")
    return DEVICES[key]


def device_class_of(device_name: str | None) -> DeviceClass:
    """The class of a CUDA device name (``torch.cuda.get_device_name``), ``cpu`` for None or unknown."""
    if device_name:
        words = device_name.lower().replace("-", " ").split()
        for key in ("b200", "h200", "h100", "a100", "mi300x"):
            if any(key in word for word in words):
                return DEVICES[key]
    return DEVICES["cpu"]
