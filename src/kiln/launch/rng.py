"""This process's RNG states (python, numpy, torch, CUDA) as plain data, and putting them back.

Checkpoints store them (loadable with ``torch.load(weights_only=True)``), and a
:class:`kiln.launch.ResumableLoader` resumed mid-epoch puts them back after ``iter()`` drew from them.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from kiln.core.warn import KilnWarning

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's RNG states, as plain data (loadable with ``weights_only=True``)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        legacy = np.random.get_state(legacy=True)
        assert isinstance(legacy, tuple)  # legacy=True: the (kind, keys, pos, has_gauss, cached) form
        kind, keys, pos, has_gauss, cached = legacy
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except ImportError:  # numpy is optional
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state(
            (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(
                f"the checkpoint has CUDA RNG states for {len(cuda)} devices and this process sees "
                f"{torch.cuda.device_count()}; CUDA RNG states are not restored",
                KilnWarning,
                stacklevel=3,
            )
