"""The LightningModule: class-weighted BCE, ROC-AUC / PR-AUC / calibration per split, and the
simulated speed-up of the current network each validation epoch."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision, BinaryCalibrationError

from training import replay
from training.data import Collected
from training.model import ControllerNet
from training.steps import SplitSteps
from uag.decoding.features import to_gate_rows


class ControllerModule(SplitSteps):
    net: ControllerNet

    def __init__(
        self,
        net: ControllerNet,
        *,
        pos_weight: float,
        lr: float = 3e-3,
        val_data: Collected | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net", "val_data"])
        self.lr = lr
        self.net = net
        self.val_data = val_data
        self.loss = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight), reduction="sum")
        self.metrics: torch.nn.ModuleDict = torch.nn.ModuleDict(
            {
                f"{split}_metrics": torch.nn.ModuleDict(
                    {
                        "auroc": BinaryAUROC(),
                        "pr_auc": BinaryAveragePrecision(),
                        "ece": BinaryCalibrationError(),
                    }
                )
                for split in ("train", "val")
            }
        )

    def _step(self, batch: Any, split: str) -> torch.Tensor:
        x, y, outcome = batch  # y: the target to learn (soft under sampling), outcome: 0/1
        logits = self.net.logits(x)
        # The mean over the *global* batch (all processes' shares of it, see SharedOrderBatches),
        # times the process count that DDP's gradient averaging divides by: the gradient is then
        # the single-process one whatever the number of processes.
        world = self.trainer.world_size if self._trainer is not None else 1
        rows = torch.tensor(float(len(y)), device=logits.device)
        if world > 1:
            rows = self.trainer.strategy.reduce(rows, reduce_op="sum")
        loss = self.loss(logits, y) * world / rows
        probs = torch.sigmoid(logits)
        metrics: Any = self.metrics[f"{split}_metrics"]  # "train" alone would shadow Module.train
        for name, metric in metrics.items():
            metric.update(probs, outcome.int())
            self.log(f"{split}/{name}", metric, on_step=False, on_epoch=True)
        self.log(
            f"{split}/loss",
            loss,  # the processes' mean: the global batch's mean loss
            on_step=False,
            on_epoch=True,
            prog_bar=split == "val",
            sync_dist=True,
        )
        return loss

    def on_validation_epoch_end(self) -> None:
        if self.val_data is None or self.trainer.sanity_checking:
            return
        # Replay runs once, on all validation data, in the first process; the others receive
        # its figures (so every process logs the same values).
        figures = self._replay_figures() if self.trainer.is_global_zero else {}
        for name, value in self.trainer.strategy.broadcast(figures, src=0).items():
            self.log(name, value, sync_dist=True)

    def _replay_figures(self) -> dict[str, float]:
        assert self.val_data is not None
        with torch.no_grad():
            scores = (
                self.net(torch.from_numpy(self.val_data.features).to(self.device)).cpu().numpy()
            )
        its = replay.build_iterations(self.val_data, scores)
        profile = self.val_data.profile
        _, learned = replay.best_threshold(
            its, profile, column="score", below=True, grid=replay.PROB_GRID, name=str
        )
        best_static = replay.best_static(its, profile)
        return {
            "val/sim_speedup_vs_target": learned.speedup,
            "val/sim_speedup_vs_best_static": learned.tokens_per_s / best_static.tokens_per_s,
        }


def predict(net: ControllerNet, features: np.ndarray) -> np.ndarray:
    was_training = net.training
    net.eval()
    device = next(net.parameters()).device
    with torch.no_grad():
        out = net(torch.from_numpy(features).to(device)).cpu().numpy()
    net.train(was_training)
    return out


def iterations_with_scores(net: ControllerNet, data: Collected) -> replay.Iterations:
    """Replay iterations carrying the network's per-token scores and per-iteration gate scores."""
    return replay.build_iterations(
        data, predict(net, data.features), predict(net, to_gate_rows(data.features))
    )
