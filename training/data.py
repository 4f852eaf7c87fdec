"""Collected runs → arrays, split by prompt (never by row), and the Lightning DataModule."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from uag.errors import UagError
from uag.features import to_gate_rows
from uag.latency import LatencyProfile

ITERATION_KEYS = ("prompt_id", "iteration")


@dataclass
class Collected:
    """All rows of one or more collect runs that share a schema."""

    features: np.ndarray
    """[N, F] float32."""
    labels: np.ndarray
    """[N] float32 in {0, 1}."""
    prompt_ids: np.ndarray
    """[N] str: the unit of the train/validation split."""
    columns: dict[str, np.ndarray]
    """Every other column (iteration, position, iter_*), for replay."""
    feature_names: list[str]
    schema_version: int
    meta: dict[str, Any]
    """meta.json of the first run (pair, latency profile, ...)."""
    data_hash: str
    """sha256 over every Parquet part's bytes: which data a controller was trained on."""

    @property
    def profile(self) -> LatencyProfile:
        return LatencyProfile.from_dict(self.meta["latency_profile"])

    def subset(self, mask: np.ndarray) -> Collected:
        return Collected(
            features=self.features[mask],
            labels=self.labels[mask],
            prompt_ids=self.prompt_ids[mask],
            columns={k: v[mask] for k, v in self.columns.items()},
            feature_names=self.feature_names,
            schema_version=self.schema_version,
            meta=self.meta,
            data_hash=self.data_hash,
        )


def from_columns(parts: list[dict[str, np.ndarray]], meta: dict[str, Any]) -> Collected:
    """In-memory rows (as ``uag.collect.rows_for_prompt`` makes them) → ``Collected``, for replay."""
    names = list(meta["feature_names"])
    data = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return Collected(
        features=np.stack([data[n].astype(np.float32) for n in names], axis=1),
        labels=data["accepted"].astype(np.float32),
        prompt_ids=data["prompt_id"].astype(str),
        columns={k: v for k, v in data.items() if k != "accepted"},
        feature_names=names,
        schema_version=int(meta["schema_version"]),
        meta=meta,
        data_hash="",
    )


def _metas(run: Path) -> list[dict[str, Any]]:
    files = sorted(run.glob("meta*.json"))
    if not files:
        raise UagError(f"{run} holds no meta.json: is it a uag collect output directory?")
    return [json.loads(f.read_text()) for f in files]


def load_runs(dirs: list[Path]) -> Collected:
    """Read every Parquet part of ``dirs``; refuse runs whose schema or feature names differ."""
    import pyarrow.parquet as pq

    if not dirs:
        raise UagError("no --data directory given")
    metas: list[tuple[Path, dict[str, Any]]] = []
    parts: list[Path] = []
    for run in dirs:
        if not run.is_dir():
            raise UagError(f"--data {run} is not a directory")
        metas += [(run, m) for m in _metas(run)]
        found = sorted(run.glob("part-*.parquet"))
        if not found:
            raise UagError(f"{run} holds no collected parts (part-*.parquet)")
        parts += found
    first_dir, first = metas[0]
    for run, meta in metas[1:]:
        for key in ("schema_version", "feature_names"):
            if meta.get(key) != first.get(key):
                raise UagError(
                    f"runs disagree on {key}: {first_dir} has {first.get(key)!r}, {run} has {meta.get(key)!r}"
                )
    names = list(first["feature_names"])
    digest = hashlib.sha256()
    frames = []
    for part in parts:
        digest.update(part.read_bytes())
        frames.append(pq.read_table(part))
    import pyarrow as pa

    table = pa.concat_tables(frames)
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise UagError(f"collected parts lack feature columns {missing}")
    if table.num_rows == 0:
        raise UagError(f"{', '.join(map(str, dirs))}: the collected parts hold no rows")
    data = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    features = np.stack([data[n].astype(np.float32) for n in names], axis=1)
    labels = data["accepted"].astype(np.float32)
    if len(np.unique(labels)) < 2:
        raise UagError(
            "the collected data holds a single label class: every drafted token was "
            f"{'accepted' if labels[0] else 'rejected'}, so there is nothing to learn"
        )
    rest = {k: v for k, v in data.items() if k != "accepted"}  # keys like position stay here too
    return Collected(
        features=features,
        labels=labels,
        prompt_ids=data["prompt_id"].astype(str),
        columns=rest,
        feature_names=names,
        schema_version=int(first["schema_version"]),
        meta=first,
        data_hash=digest.hexdigest(),
    )


def split_by_prompt(
    data: Collected, *, val_fraction: float, seed: int
) -> tuple[Collected, Collected]:
    """Seeded split of whole prompts, so no prompt's tokens sit on both sides."""
    prompts = np.unique(data.prompt_ids)
    if len(prompts) < 2:
        raise UagError("need at least 2 collected prompts to split into train and validation")
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(prompts)
    n_val = min(max(1, round(len(prompts) * val_fraction)), len(prompts) - 1)
    val_prompts = set(shuffled[:n_val].tolist())
    is_val = np.array([p in val_prompts for p in data.prompt_ids])
    return data.subset(~is_val), data.subset(is_val)


def with_gate_rows(data: Collected) -> tuple[np.ndarray, np.ndarray]:
    """Token rows plus one gate row per iteration (from its first drafted token, same label).

    The same network then answers both questions: "keep drafting?" after a token, and "draft at
    all?" before an iteration (see ``uag.features.gate_row``).
    """
    first = data.columns["position"] == 1
    features = np.concatenate([data.features, to_gate_rows(data.features[first])])
    labels = np.concatenate([data.labels, data.labels[first]])
    return features, labels


class ControllerDataModule(L.LightningDataModule):
    """Train/validation loaders over collected runs (I/O in ``setup``, split seeded)."""

    def __init__(
        self, dirs: list[Path], *, val_fraction: float = 0.25, seed: int = 0, batch_size: int = 512
    ) -> None:
        super().__init__()
        self.dirs = dirs
        self.val_fraction = val_fraction
        self.seed = seed
        self.batch_size = batch_size
        self.train_set: Collected | None = None
        self.val_set: Collected | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = split_by_prompt(
                load_runs(self.dirs), val_fraction=self.val_fraction, seed=self.seed
            )

    @staticmethod
    def _loader(data: Collected, *, shuffle: bool, batch_size: int, seed: int) -> DataLoader:
        features, labels = with_gate_rows(data)
        ds = TensorDataset(torch.from_numpy(features), torch.from_numpy(labels))
        gen = torch.Generator().manual_seed(seed)
        return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=gen)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return self._loader(
            self.train_set, shuffle=True, batch_size=self.batch_size, seed=self.seed
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return self._loader(self.val_set, shuffle=False, batch_size=4096, seed=self.seed)
