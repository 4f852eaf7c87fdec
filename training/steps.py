"""What both Lightning modules (the stop controller's and the plan's) share: one loss per split,
and AdamW over the network."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn


class SplitSteps(L.LightningModule):
    """Training and validation steps that differ only in the split the loss logs under
    (``_step``), so each module writes its loss once; AdamW with a light weight decay over
    ``net``."""

    net: nn.Module
    lr: float

    def _step(self, batch: Any, split: str) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.net.parameters(), lr=self.lr, weight_decay=1e-4)
