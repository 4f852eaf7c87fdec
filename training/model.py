"""The controller network: raw features in, P(accepted) out. Plain torch, no Lightning.

Normalisation statistics from the training split are buffers of the network, so the exported
ONNX graph takes raw feature rows exactly as ``uag.decoding.features.feature_row`` produces them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


class Standardised(nn.Module):
    """A network whose input is standardised by the training split's statistics, kept as
    buffers so that the exported graph takes raw feature rows."""

    def __init__(self, n_features: int) -> None:
        super().__init__()
        self.mean: torch.Tensor
        self.std: torch.Tensor
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("std", torch.ones(n_features))

    def set_normalisation(self, features: np.ndarray) -> None:
        """Bake the training split's mean/std into the network (constant columns get std 1)."""
        mean = features.mean(axis=0)
        std = features.std(axis=0)
        std[std < 1e-6] = 1.0
        self.mean.copy_(torch.from_numpy(mean.astype(np.float32)))
        self.std.copy_(torch.from_numpy(std.astype(np.float32)))


def hidden_layers(n_features: int, hidden: Sequence[int]) -> tuple[list[nn.Module], int]:
    """Linear → ReLU for each width of ``hidden``: the layers, and the width they end at (the
    head's input)."""
    layers: list[nn.Module] = []
    width = n_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return layers, width


class ControllerNet(Standardised):
    """Standardise → MLP (ReLU) → one logit. ``forward`` returns probabilities ``[N]``."""

    def __init__(self, n_features: int, hidden: tuple[int, ...] = (32, 32)) -> None:
        super().__init__(n_features)
        layers, width = hidden_layers(n_features, hidden)
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        # features: [N, F] → [N]
        return self.mlp((features - self.mean) / self.std).squeeze(-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(features))
