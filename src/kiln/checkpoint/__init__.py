"""Checkpoints you can trust: exact resume, atomic writes, sharded/deduped/merged, preemption.

::

    path = kiln.checkpoint.save_checkpoint("runs/a", state)               # runs/a/ep3-ba120, runs/a/last
    kiln.checkpoint.load_checkpoint("last", state, folder="runs/a")       # everything back, on any world size
    kiln.checkpoint.verify_checkpoint(path)                               # sizes, checksums, safe pickles

The layout on disk is in :mod:`kiln.checkpoint.layout`, the save types in
:mod:`kiln.checkpoint.formats`, what a checkpoint holds in :mod:`kiln.checkpoint.state`.
"""

from kiln.checkpoint.checkpointing import load_checkpoint, save_checkpoint, verify_checkpoint
from kiln.checkpoint.errors import CheckpointError
from kiln.checkpoint.export import export_hf
from kiln.checkpoint.offline import export_safetensors, inspect_checkpoint, merge_checkpoint
from kiln.checkpoint.preemption import PREEMPTED_EXIT_CODE
from kiln.checkpoint.saver import CheckpointSaver

__all__ = [
    "CheckpointError",
    "CheckpointSaver",
    "PREEMPTED_EXIT_CODE",
    "export_hf",
    "export_safetensors",
    "inspect_checkpoint",
    "load_checkpoint",
    "merge_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
