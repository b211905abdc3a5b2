"""The Colossal-AI walk-through: ResNet-34 on CIFAR-10 with the Engine (steps 1-5).

    kiln run -n 2 examples/cifar10_resnet.py --data ./data             # CIFAR-10 already in ./data
    kiln run -n 2 examples/cifar10_resnet.py --data ./data --download  # torchvision downloads it

With torchvision this is the walk-through's code: ``resnet34(num_classes=10)`` and ``CIFAR10`` with
its transforms. Without torchvision (it does not import beside some torch builds) the same run uses
ResNet-34 from transformers (``ResNetConfig(depths=[3, 4, 6, 3], layer_type="basic")``) and reads
CIFAR-10's own python batch files (``cifar-10-batches-py/data_batch_*``, ``test_batch``) directly,
with the same transforms written in torch. ``--model transformers`` forces that path.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import kiln
from kiln.optim import CosineAnnealingLR

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)  # the walk-through's Normalize


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.environ.get("DATA", "./data"), help="folder holding cifar-10-batches-py")
    parser.add_argument("--download", action="store_true", help="let torchvision download CIFAR-10 into --data")
    parser.add_argument("--model", choices=["auto", "torchvision", "transformers"], default="auto")
    parser.add_argument("--batch-size", type=int, default=128)  # BATCH_SIZE of the walk-through's config
    parser.add_argument("--epochs", type=int, default=200)  # NUM_EPOCHS
    parser.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps")
    return parser.parse_args()


# -- the walk-through's components with torchvision -------------------------------------------------
def torchvision_components(root: str, download: bool) -> tuple[nn.Module, Any, Any]:
    from torchvision import transforms
    from torchvision.datasets import CIFAR10
    from torchvision.models import resnet34

    model = resnet34(num_classes=10)
    normalize = transforms.Normalize(mean=list(MEAN), std=list(STD))
    train = CIFAR10(
        root=root,
        download=download,
        transform=transforms.Compose(
            [
                transforms.RandomCrop(size=32, padding=4),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                normalize,
            ]
        ),
    )
    test = CIFAR10(root=root, train=False, transform=transforms.Compose([transforms.ToTensor(), normalize]))
    return model, train, test


# -- the same without torchvision ------------------------------------------------------------------
class _BatchUnpickler(pickle.Unpickler):
    """CIFAR-10's batch files are pickles of a dict of bytes, lists and numpy arrays: nothing else
    is allowed to load (a pickle can otherwise run any code)."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a CIFAR-10 batch file holds {module}.{name}, which is not CIFAR data")


def read_batches(folder: Path, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N, 3, 32, 32) uint8 and labels (N,) from CIFAR-10 python batch files."""
    images, labels = [], []
    for name in names:
        with open(folder / name, "rb") as f:
            batch = _BatchUnpickler(io.BytesIO(f.read()), encoding="bytes").load()
        images.append(torch.as_tensor(batch[b"data"]).reshape(-1, 3, 32, 32))
        labels.append(torch.as_tensor(batch[b"labels"], dtype=torch.long))
    return torch.cat(images), torch.cat(labels)


class CifarBatches(torch.utils.data.Dataset):
    """CIFAR-10 from its batch files, with the walk-through's transforms when ``train``: random
    crop of 32 after padding 4, random horizontal flip, then to [0, 1] and normalised."""

    def __init__(self, root: str, train: bool) -> None:
        folder = Path(root) / "cifar-10-batches-py"
        names = sorted(p.name for p in folder.glob("data_batch_*")) if train else ["test_batch"]
        if not names or not all((folder / n).is_file() for n in names):
            raise FileNotFoundError(
                f"no CIFAR-10 {'training' if train else 'test'} batches in {folder}; download and unpack "
                "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz there, or pass --download with torchvision"
            )
        self.images, self.labels = read_batches(folder, names)
        self.train = train
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index].float() / 255
        if self.train:
            padded = nn.functional.pad(image, (4, 4, 4, 4))
            top, left = (int(v) for v in torch.randint(0, 9, (2,)))
            image = padded[:, top : top + 32, left : left + 32]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        return (image - self.mean) / self.std, self.labels[index]


class HFResNet(nn.Module):
    """ResNet-34 from transformers returning logits, as torchvision's does."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification

        config = ResNetConfig(depths=[3, 4, 6, 3], hidden_sizes=[64, 128, 256, 512], layer_type="basic", num_labels=10)
        self.net = ResNetForImageClassification(config)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values=images).logits


def transformers_components(root: str) -> tuple[nn.Module, Any, Any]:
    return HFResNet(), CifarBatches(root, train=True), CifarBatches(root, train=False)


def components(args: argparse.Namespace) -> tuple[nn.Module, Any, Any, str]:
    if args.model in ("auto", "torchvision"):
        try:
            return (*torchvision_components(args.data, args.download), "torchvision")
        except ImportError:
            if args.model == "torchvision":
                raise
        except RuntimeError as exc:  # torchvision present but broken beside this torch build
            if args.model == "torchvision" or "torchvision" not in str(exc):
                raise
    return (*transformers_components(args.data), "transformers")


def main() -> float:
    args = parse_args()
    # Step 1 and 2: the config (here inline) and the distributed environment.
    config = {"BATCH_SIZE": args.batch_size, "NUM_EPOCHS": args.epochs}
    if torch.cuda.is_available():
        config["fp16"] = {"mode": kiln.AMP_TYPE.TORCH}  # the walk-through's mixed precision
    ctx = kiln.launch_from_torch(config=config, seed=42) if "RANK" in os.environ else kiln.launch(config=config)
    logger = kiln.get_dist_logger()

    # Step 3: the components as in any PyTorch script.
    model, train_dataset, test_dataset, source = components(args)
    train_dataloader = kiln.get_dataloader(train_dataset, shuffle=True, batch_size=args.batch_size, drop_last=True)
    test_dataloader = kiln.get_dataloader(test_dataset, add_sampler=False, batch_size=args.batch_size)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=args.epochs)

    # Step 4: the Engine.
    engine, train_dataloader, test_dataloader, _ = kiln.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader
    )
    logger.info(
        f"ResNet-34 ({source}) on {len(train_dataset)} CIFAR-10 images, {ctx.world_size} process(es), "
        f"precision {engine.precision.name}, strategy {engine.strategy.name}",
        ranks=[0],
    )

    # Step 5: train with the Engine.
    accuracy = 0.0
    for epoch in range(args.epochs):
        start = time.perf_counter()
        train_dataloader.sampler.set_epoch(epoch)
        engine.train()
        for step, (img, label) in enumerate(train_dataloader):
            if args.max_steps is not None and step >= args.max_steps:
                break
            engine.zero_grad()
            output = engine(img)
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)
            engine.step()
        lr_scheduler.step()

        engine.eval()
        correct = total = 0
        for img, label in test_dataloader:
            with torch.no_grad():
                output = engine(img)
                test_loss = engine.criterion(output, label)
            correct += int((output.argmax(dim=-1) == label.to(output.device)).sum())
            total += img.size(0)
        accuracy = correct / total
        logger.info(
            f"Epoch {epoch} - train loss: {train_loss.item():.5}, test loss: {test_loss.item():.5}, "
            f"acc: {accuracy:.5}, lr: {lr_scheduler.get_last_lr()[0]:.5g}, {time.perf_counter() - start:.1f} s",
            ranks=[0],
        )
    return accuracy


if __name__ == "__main__":
    main()
