"""The digits data set that scikit-learn ships (1,797 8x8 images), as torch datasets.

No download: the data is inside the scikit-learn package. The split is fixed (seeded) so every
rank and every run sees the same train and test sets.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def digits_datasets(
    test_fraction: float = 0.2, seed: int = 0, flat: bool = False
) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) datasets of images (N, 1, 8, 8) in [0, 1] (or (N, 64) when flat) and labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    images = images.reshape(len(images), 64) if flat else images.unsqueeze(1)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    num_test = int(len(labels) * test_fraction)
    test, train = order[:num_test], order[num_test:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


class DigitsCNN(torch.nn.Module):
    """A small CNN for 8x8 digits: two 3x3 convolutions, a pooling, two linear layers."""

    def __init__(self, num_classes: int = 10, dropout: float = 0.1) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        self.classifier = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(64 * 4 * 4, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
