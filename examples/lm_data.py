"""Real text that ships on every machine: the Python standard library's own source files, as bytes.

Byte-level tokens (vocabulary 256) need no tokenizer download. The files are read in a fixed order
(sorted paths), joined, and cut into windows of ``seq_len`` tokens; the last ``val_fraction`` of
the stream is held out for evaluation. Each sample is ``{"input_ids": ..., "labels": ...}`` with
``labels == input_ids``: a causal LM shifts them itself (transformers' models do).

    train, val = stdlib_text(seq_len=128)
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

__all__ = ["StdlibText", "stdlib_text", "stdlib_bytes"]


def stdlib_bytes(max_bytes: int | None = None) -> bytes:
    """The standard library's ``.py`` files (top level and packages, no tests), joined in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, names in os.walk(root):
        # Installed packages are not the standard library: a Python's site-packages can hold ten times
        # its files (11,563 of 13,353 here), which a walk of the whole tree read through on every build.
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    files = sorted(p for p in found if "test" not in p.relative_to(root).parts[0].lower())
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    stream = b"\n".join(chunks)
    return stream if max_bytes is None else stream[:max_bytes]


class StdlibText(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len`` byte tokens from ``stream``."""

    def __init__(self, stream: bytes, seq_len: int) -> None:
        tokens = torch.frombuffer(bytearray(stream), dtype=torch.uint8).long()
        count = len(tokens) // seq_len
        if count == 0:
            raise ValueError(
                f"{len(tokens)} bytes make no window of seq_len={seq_len}; use more text or a shorter seq_len"
            )
        self.windows = tokens[: count * seq_len].view(count, seq_len)

    @classmethod
    def from_stdlib(cls, seq_len: int = 128, split: str = "train", max_bytes: int | None = 4_000_000) -> StdlibText:
        """One split of :func:`stdlib_text` (the config CLI builds datasets from a type and arguments)."""
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}: expected 'train' or 'val'")
        train, val = stdlib_text(seq_len, max_bytes)
        return train if split == "train" else val

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows[index]
        return {"input_ids": window, "labels": window}


def stdlib_text(
    seq_len: int = 128, max_bytes: int | None = 4_000_000, val_fraction: float = 0.02
) -> tuple[StdlibText, StdlibText]:
    """(train, val) datasets of byte windows; ``max_bytes`` caps how much of the library is read."""
    stream = stdlib_bytes(max_bytes)
    cut = int(len(stream) * (1 - val_fraction))
    return StdlibText(stream[:cut], seq_len), StdlibText(stream[cut:], seq_len)
