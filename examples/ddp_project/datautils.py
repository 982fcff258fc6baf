"""A synthetic regression dataset, as in PyTorch's DDP tutorial (``MyTrainDataset``)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class MyTrainDataset(Dataset):
    """``size`` random (input, target) pairs, the same on every rank for a given seed."""

    def __init__(self, size: int, features: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = [
            (torch.rand(features, generator=generator), torch.rand(1, generator=generator))
            for _ in range(size)
        ]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]
