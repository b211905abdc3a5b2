"""From nnScaler's trainer to kiln's config CLI: a ``TrainerArgs`` YAML, a hook, and
``merge_checkpoint``.

    kiln train -f examples/migrate/from_nnscaler.yaml --nproc-per-node 2       # the run alone
    kiln run -n 2 examples/migrate/from_nnscaler.py [--dotted.key value ...]   # the run, then a merge

This file holds what the YAML names (the model, the dataset factory, the hook) and a ``main``
that does what nnScaler users do by hand: train from the YAML, merge the last checkpoint into one
file (nnScaler: ``Trainer.merge_checkpoint(files, "merged.ckpt")``) and load that file in plain
PyTorch with ``weights_only=True``. Writes under ``runs/from_nnscaler`` in the working directory.
docs/migrate/nnscaler.md shows both sides.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import kiln
from kiln.checkpoint import merge_checkpoint
from kiln.config import TrainHook, build_trainer, load_trainer_args

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE.parents[1]))  # the YAML names this file as examples.migrate.from_nnscaler
from digits_data import DigitsCNN, digits_datasets  # noqa: E402

CONFIG = _HERE / "from_nnscaler.yaml"


class DigitsNet(DigitsCNN):
    """The model the YAML builds: ``model.type`` with ``model.args``."""


def digits_split(split: str = "train") -> TensorDataset:
    """The dataset factory the YAML names: ``dataset.type`` with ``train_args`` / ``val_args``."""
    if split not in ("train", "test"):
        raise ValueError(f"split: got {split!r}, expected 'train' or 'test'")
    train, test = digits_datasets()
    return train if split == "train" else test


# --8<-- [start:hook]
class LossHistory(TrainHook):
    """nnScaler's hook points, kept by name: each receives the Trainer first."""

    def __init__(self) -> None:
        self.train_losses: list[float] = []
        self.val_losses: list[float] = []

    def after_aggregate_train_step_outputs(self, trainer, aggregated_outputs, train_loss, idx) -> None:
        self.train_losses.append(float(train_loss))

    def on_val_end(self, trainer, val_loss) -> None:
        self.val_losses.append(float(val_loss))

    def on_save_checkpoint(self, trainer, checkpoint) -> None:
        checkpoint["val_losses"] = list(self.val_losses)  # plain data, saved with the checkpoint

    def on_train_end(self, trainer) -> None:
        if trainer.state.is_main and self.train_losses:
            print(f"train loss: first {self.train_losses[0]:.4f}, last {self.train_losses[-1]:.4f}")
            print(f"validation losses: {', '.join(f'{v:.4f}' for v in self.val_losses)}")


# --8<-- [end:hook]


def main(argv: list[str] | None = None) -> float:
    ctx = kiln.launch_from_torch() if "RANK" in os.environ else kiln.launch()
    args = load_trainer_args(CONFIG, sys.argv[1:] if argv is None else argv, world_size=ctx.world_size)
    trainer = build_trainer(args)
    trainer.fit()
    trainer.close()

    # --8<-- [start:merge]
    accuracy = 0.0
    if ctx.is_main:  # merging is offline work: no process group, one process
        save_dir = Path(args.checkpoint.save_dir)
        merged = save_dir.parent / "merged.pt"
        merged.unlink(missing_ok=True)
        merge_checkpoint(save_dir / "last", merged)
        weights = torch.load(merged, weights_only=True)["model"]  # plain PyTorch from here on
        model = DigitsNet()
        model.load_state_dict(weights)
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for inputs, targets in DataLoader(digits_split("test"), batch_size=256):
                correct += int((model(inputs).argmax(dim=-1) == targets).sum())
                total += len(targets)
        accuracy = correct / total
        print(f"merged {merged} ({merged.stat().st_size} bytes)")
        print(f"final test accuracy: {accuracy:.4f} (merged weights, plain PyTorch)")
    # --8<-- [end:merge]
    return accuracy


if __name__ == "__main__":
    main()
