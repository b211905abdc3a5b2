"""Images for the loggers: whatever the user hands over, as one uint8 NHWC NumPy array."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["as_uint8_nhwc"]


def as_uint8_nhwc(images: Any, channels_last: bool = False) -> np.ndarray:
    """``images`` as a ``(N, H, W, C)`` uint8 array, C being 1, 3 or 4.

    Accepts a tensor or NumPy array shaped ``(N, C, H, W)``, ``(C, H, W)`` or ``(H, W)``
    (``(N, H, W, C)`` / ``(H, W, C)`` with ``channels_last=True``), or a list of such images of
    one size. Floats are read as values in [0, 1] (clipped), integers as values in [0, 255].
    """
    if isinstance(images, Sequence) and not isinstance(images, (str, bytes)):
        if not images:
            raise ValueError("log_images got an empty list of images")
        parts = [as_uint8_nhwc(image, channels_last) for image in images]
        if len({part.shape[1:] for part in parts}) > 1:
            raise ValueError(
                f"log_images got images of different shapes {[part.shape[1:] for part in parts]}; "
                "log each size under its own name"
            )
        return np.concatenate(parts)
    if isinstance(images, torch.Tensor):
        images = images.detach().cpu()
        if images.dtype == torch.bfloat16 or images.dtype == torch.float16:
            images = images.float()
        array = images.numpy()
    elif isinstance(images, np.ndarray):
        array = images
    else:
        raise TypeError(
            f"log_images takes a torch.Tensor, a NumPy array or a list of them, got {type(images).__name__}"
        )
    if array.ndim == 2:  # one grey image
        array = array[None, None] if not channels_last else array[None, :, :, None]
    elif array.ndim == 3:
        array = array[None]
    if array.ndim != 4:
        raise ValueError(
            f"log_images takes images shaped (N, C, H, W), (C, H, W) or (H, W), got shape {tuple(array.shape)}"
        )
    if not channels_last:
        array = array.transpose(0, 2, 3, 1)
    if array.shape[-1] not in (1, 3, 4):
        layout = "(N, H, W, C)" if channels_last else "(N, C, H, W)"
        raise ValueError(
            f"log_images: images of shape {tuple(array.shape)} as {layout} have {array.shape[-1]} channels; "
            "expected 1, 3 or 4 (pass channels_last=True for (N, H, W, C) images)"
        )
    if array.dtype == np.bool_:
        array = array.astype(np.uint8) * 255
    elif np.issubdtype(array.dtype, np.floating):
        array = np.round(np.clip(array, 0.0, 1.0) * 255)
    elif not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"log_images takes float or integer images, got dtype {array.dtype}")
    return np.ascontiguousarray(np.clip(array, 0, 255).astype(np.uint8))
