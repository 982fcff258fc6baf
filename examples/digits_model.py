"""The digits CNN and its data, imported by ``hpo_digits_cnn.py`` (a sibling module)."""

from __future__ import annotations


def load_digits_tensors(device: object) -> tuple[object, object, object, object]:
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.images.astype("float32")[:, None] / 16.0  # (n, 1, 8, 8) in [0, 1]
    x_train, x_val, y_train, y_val = train_test_split(
        x, digits.target, test_size=0.25, stratify=digits.target, random_state=0
    )
    as_tensor = lambda a, dtype: torch.as_tensor(a, dtype=dtype, device=device)  # noqa: E731
    return (
        as_tensor(x_train, torch.float32),
        as_tensor(y_train, torch.long),
        as_tensor(x_val, torch.float32),
        as_tensor(y_val, torch.long),
    )


def build_model(channels: int, keep_prob: float, pool: str) -> object:
    from torch import nn

    pooling = nn.MaxPool2d(2) if pool == "max" else nn.AvgPool2d(2)
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1),
        nn.ReLU(),
        pooling,  # 8x8 -> 4x4
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(p=1.0 - keep_prob),
        nn.Linear(2 * channels * 16, 10),
    )
