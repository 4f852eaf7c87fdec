"""The Lightning side of training data: batches dealt across processes and the DataModule."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from training.data import Collected, load_runs, split_by_prompt, with_gate_rows
from uag.errors import UagError


class SharedOrderBatches(torch.utils.data.Sampler[list[int]]):
    """Batches in one seeded order, shared by every process: process ``rank`` of ``world``
    takes rows ``rank, rank + world, ...`` of each global batch of ``batch_size``.

    Why not Lightning's ``DistributedSampler``: it shuffles differently per process count and pads
    with repeated rows, so a 2-process run learns from other batches than a 1-process run. Here
    the union of the processes' batch ``b`` is the single-process batch ``b``, and with the loss
    normalised by the global batch's size (``ControllerModule``) the averaged gradient is the
    single-process gradient up to float summation order. A last global batch under half a batch
    joins the one before it, whatever the process count (so every process gets rows of every
    batch as long as ``world <= batch_size / 2``, which ``__init__`` checks).
    """

    def __init__(
        self, size: int, *, batch_size: int, shuffle: bool, seed: int, rank: int = 0, world: int = 1
    ) -> None:
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        if world > 1 and 2 * world > batch_size:
            raise UagError(
                f"--batch-size {batch_size} is too small for {world} processes: use at least "
                f"{2 * world} (each process takes a share of every batch)"
            )
        self.rank, self.world = rank, world
        self.epoch = 0
        """Passes so far: each pass (epoch) draws a new order, the same in every process."""

    def _bounds(self) -> list[int]:
        cuts = list(range(0, self.size, self.batch_size)) + [self.size]
        if len(cuts) > 2 and 2 * (cuts[-1] - cuts[-2]) < self.batch_size:
            del cuts[-2]
        return cuts

    def __len__(self) -> int:
        return len(self._bounds()) - 1

    def __iter__(self):  # type: ignore[no-untyped-def]
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=gen).tolist()
            self.epoch += 1
        else:
            order = list(range(self.size))
        cuts = self._bounds()
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            yield order[lo + self.rank : hi : self.world]


class ControllerDataModule(L.LightningDataModule):
    """Train/validation loaders over collected runs (I/O in ``setup``, split seeded; a report
    split, when asked for, is held out from both)."""

    def __init__(
        self,
        dirs: list[Path],
        *,
        val_fraction: float = 0.25,
        report_fraction: float = 0.0,
        seed: int = 0,
        batch_size: int = 512,
        allow_mixed: bool = False,
    ) -> None:
        super().__init__()
        self.dirs = dirs
        self.allow_mixed = allow_mixed
        self.val_fraction = val_fraction
        self.report_fraction = report_fraction
        self.seed = seed
        self.batch_size = batch_size
        self.train_set: Collected | None = None
        self.val_set: Collected | None = None
        self.report_set: Collected | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set, self.report_set = split_by_prompt(
                load_runs(self.dirs, allow_mixed=self.allow_mixed),
                val_fraction=self.val_fraction,
                report_fraction=self.report_fraction,
                seed=self.seed,
            )

    def _loader(self, data: Collected, *, shuffle: bool, batch_size: int) -> DataLoader:
        features, targets, labels = with_gate_rows(data)
        ds = TensorDataset(*(torch.from_numpy(a) for a in (features, targets, labels)))
        trainer = self.trainer  # None when used outside a Trainer (one process)
        batches = SharedOrderBatches(
            len(ds),
            batch_size=batch_size,
            shuffle=shuffle,
            seed=self.seed,
            rank=trainer.global_rank if trainer is not None else 0,
            world=trainer.world_size if trainer is not None else 1,
        )
        return DataLoader(ds, batch_sampler=batches)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return self._loader(self.train_set, shuffle=True, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return self._loader(self.val_set, shuffle=False, batch_size=4096)
