"""The model and data set of ``examples/mlp.yaml`` (nnScaler's CLI test config, with kiln paths).

``MLP`` is an end-to-end model: ``forward(batch)`` returns the loss, so the config needs no criterion.
``RandomDataset`` is reproducible random regression data; no download.

    kiln train -f examples/mlp.yaml --nproc-per-node 2
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

__all__ = ["MLP", "RandomDataset"]


class MLP(nn.Module):
    """``nlayers`` linear layers of width ``dim`` with a sigmoid output and a BCE loss on ``batch["target"]``.

    Args:
        dim: input, hidden and output width.
        nlayers: number of linear layers.
    """

    def __init__(self, dim: int = 16, nlayers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(nlayers))
        self.loss_fn = nn.BCELoss()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["data"]
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return self.loss_fn(torch.sigmoid(x), batch["target"])


class RandomDataset(Dataset):
    """``size`` samples ``{"data": randn(dim), "target": rand(dim)}``, the same for a given ``seed``.

    Args:
        dim: width of each sample.
        size: number of samples.
        seed: seed of the generator (the global RNG is not touched).
    """

    def __init__(self, dim: int = 16, size: int = 100, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randn(size, dim, generator=generator)
        self.target = torch.rand(size, dim, generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"data": self.data[index], "target": self.target[index]}
