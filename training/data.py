"""Collected runs → arrays, split by prompt (never by row): the columnar data model that replay,
`bench` and training share. No Lightning here (the DataModule is ``training.datamodule``), so the
runtime can replay without importing it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from uag.decoding.features import to_gate_rows
from uag.decoding.profile import LatencyProfile
from uag.errors import UagError

ITERATION_KEYS = ("prompt_id", "iteration")


@dataclass
class Collected:
    """All rows of one or more collect runs that share a schema."""

    features: np.ndarray
    """[N, F] float32."""
    labels: np.ndarray
    """[N] float32 in {0, 1}: the outcome (draft prefix accepted or not); AUC is computed on it."""
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
    targets: np.ndarray | None = None
    """[N] float32 in [0, 1]: what the network learns. Sampling runs: the soft label
    ``accept_prob`` (the outcome's expectation given the draft: same mean, less variance);
    greedy runs: None, the labels themselves."""

    @property
    def train_targets(self) -> np.ndarray:
        return self.labels if self.targets is None else self.targets

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
            targets=None if self.targets is None else self.targets[mask],
        )


def from_columns(parts: list[dict[str, np.ndarray]], meta: dict[str, Any]) -> Collected:
    """In-memory rows (as ``uag.harness.collect.rows_for_prompt`` makes them) → ``Collected``, for replay."""
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


MUST_MATCH = ("schema_version", "feature_names")
"""Runs that differ here cannot share one feature matrix at all."""
SHOULD_MATCH = (
    "target",
    "assistant",
    "assistant_int8",
    "assistant_draft_vocab",
    "decoding",
    "latency_device",
)
"""Runs that differ here measure different things (acceptance of another pair or precision,
latencies of another device): mixed only with ``allow_mixed``."""


def read_meta(path: Path) -> dict[str, Any]:
    """A run's ``meta*.json``, or one clear error when it is not one."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UagError(f"{path} is not a readable collect meta file ({err})") from None
    if not isinstance(meta, dict):
        raise UagError(f"{path} is not a collect meta file (expected a JSON object)")
    return meta


def _metas(run: Path) -> list[dict[str, Any]]:
    files = sorted(run.glob("meta*.json"))
    if not files:
        raise UagError(f"{run} holds no meta.json: is it a uag collect output directory?")
    metas = [read_meta(f) for f in files]
    for f, meta in zip(files, metas, strict=True):
        missing = [k for k in MUST_MATCH if k not in meta]
        if missing:
            raise UagError(f"{f} lacks {', '.join(missing)}: not a uag collect meta file")
    return metas


def _setting(meta: dict[str, Any], key: str) -> Any:
    if key == "latency_device":
        return str((meta.get("latency_profile") or {}).get("device", "?")).split(":")[0]
    if key == "assistant_draft_vocab":  # runs from before it: every id
        return meta.get(key, 0)
    return meta.get(key, "greedy" if key == "decoding" else None)


def _run_files(dirs: list[Path]) -> tuple[list[tuple[Path, dict[str, Any]]], list[Path]]:
    """Every run's metas (each with its directory, for the errors) and Parquet parts; a run
    that is not a collect output directory is refused by name."""
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
    return metas, parts


def _check_agreement(metas: list[tuple[Path, dict[str, Any]]], *, allow_mixed: bool) -> None:
    """Every run against the first: ``MUST_MATCH`` always, ``SHOULD_MATCH`` unless
    ``allow_mixed``; the error names both runs and both values."""
    first_dir, first = metas[0]
    for run, meta in metas[1:]:
        for key in MUST_MATCH + (() if allow_mixed else SHOULD_MATCH):
            if _setting(meta, key) != _setting(first, key):
                hint = "" if key in MUST_MATCH else " (pass --allow-mixed to train on both anyway)"
                raise UagError(
                    f"runs disagree on {key}: {first_dir} has {_setting(first, key)!r}, "
                    f"{run} has {_setting(meta, key)!r}{hint}"
                )


def _read_parts(parts: list[Path]) -> tuple[Any, str]:
    """The parts as one pyarrow table (a column some parts lack: nulls there) and the sha256
    over their bytes; an empty or unreadable part, or parts of clashing schemas, is one clear
    error."""
    # pyarrow is slow to import, and uag.harness.collect (imported by the CLI) imports this module.
    import pyarrow as pa
    import pyarrow.parquet as pq

    for part in parts:
        if part.stat().st_size == 0:
            raise UagError(f"{part} is empty: not a Parquet part (delete it and --resume)")
    digest = hashlib.sha256()
    frames = []
    for part in parts:
        digest.update(part.read_bytes())
        try:
            frames.append(pq.read_table(part))
        except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
            raise UagError(f"{part} is not a readable Parquet part ({err})") from None
    try:
        table = pa.concat_tables(frames, promote_options="default")  # missing columns: nulls
    except pa.ArrowInvalid as err:
        raise UagError(f"the collected parts do not share one schema ({err})") from None
    return table, digest.hexdigest()


def _columns(table: Any, *, names: list[str], dirs: list[Path]) -> dict[str, np.ndarray]:
    """The table's columns as arrays, once it is known to hold the feature columns and rows.
    Fixed-lookahead runs lack ``explored`` and ``propensity`` values: every round was drafted
    in full, so they read 1."""
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise UagError(f"collected parts lack feature columns {missing}")
    if table.num_rows == 0:
        raise UagError(f"{', '.join(map(str, dirs))}: the collected parts hold no rows")
    data = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    for name in ("explored", "propensity"):
        if name in data:
            data[name] = np.nan_to_num(data[name].astype(np.float32), nan=1.0)
    return data


def _labels_and_targets(data: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """(the outcomes, the soft labels of sampling runs or None); refuses one label class, which
    teaches nothing, and soft labels on only some rows, which would train two things at once."""
    labels = data["accepted"].astype(np.float32)
    if len(np.unique(labels)) < 2:
        raise UagError(
            "the collected data holds a single label class: every drafted token was "
            f"{'accepted' if labels[0] else 'rejected'}, so there is nothing to learn"
        )
    targets = None
    if "accept_prob" in data:
        targets = data["accept_prob"].astype(np.float32)
        if np.isnan(targets).any():
            raise UagError(
                "some runs hold soft labels (sampling) and some do not: train them apart"
            )
    return labels, targets


def load_runs(dirs: list[Path], *, allow_mixed: bool = False) -> Collected:
    """Read every Parquet part of ``dirs``; refuse runs whose schema or feature names differ,
    and (unless ``allow_mixed``) runs of another pair, assistant precision, decoding mode or
    latency device."""
    if not dirs:
        raise UagError("no --data directory given")
    metas, parts = _run_files(dirs)
    _check_agreement(metas, allow_mixed=allow_mixed)
    first = metas[0][1]
    names = list(first["feature_names"])
    table, data_hash = _read_parts(parts)
    data = _columns(table, names=names, dirs=dirs)
    features = np.stack([data[n].astype(np.float32) for n in names], axis=1)
    labels, targets = _labels_and_targets(data)
    rest = {k: v for k, v in data.items() if k not in ("accepted", "accept_prob")}  # (rate stays)
    return Collected(
        features=features,
        labels=labels,
        prompt_ids=data["prompt_id"].astype(str),
        columns=rest,
        feature_names=names,
        schema_version=int(first["schema_version"]),
        meta=first,
        data_hash=data_hash,
        targets=targets,
    )


def replayable(data: Collected) -> Collected:
    """The rows replay can simulate any policy on: rounds that drafted the full lookahead (every
    round of a fixed-lookahead run; the explored rounds of an on-policy run, whose other rounds
    stopped where their controller did and would look like short drafts)."""
    explored = data.columns.get("explored")
    if explored is None or explored.all():
        return data
    keep = explored.astype(bool)
    if not keep.any():
        raise UagError(
            "the validation prompts hold no explored rounds to replay: collect on-policy runs "
            "with --explore above 0 (e.g. 0.2)"
        )
    return data.subset(keep)


def split_by_prompt(
    data: Collected, *, val_fraction: float, seed: int, report_fraction: float = 0.0
) -> tuple[Collected, Collected, Collected | None]:
    """Seeded split of whole prompts, so no prompt's tokens sit on two sides: (train, tune,
    report), report None when ``report_fraction`` is 0. Tune and report take at least one
    prompt each, train the rest (at least one)."""
    prompts = np.unique(data.prompt_ids)
    parts = 3 if report_fraction > 0 else 2
    if len(prompts) < parts:
        raise UagError(
            f"need at least {parts} collected prompts to split into "
            + ("train, tune and report" if parts == 3 else "train and validation")
        )
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(prompts)
    n_report = max(1, round(len(prompts) * report_fraction)) if parts == 3 else 0
    n_val = min(max(1, round(len(prompts) * val_fraction)), len(prompts) - n_report - 1)
    n_report = min(n_report, len(prompts) - n_val - 1)
    val_prompts = set(shuffled[:n_val].tolist())
    report_prompts = set(shuffled[n_val : n_val + n_report].tolist())
    is_val = np.array([p in val_prompts for p in data.prompt_ids])
    is_report = np.array([p in report_prompts for p in data.prompt_ids])
    report = data.subset(is_report) if parts == 3 else None
    return data.subset(~is_val & ~is_report), data.subset(is_val), report


def decision_rows(data: Collected) -> np.ndarray:
    """Rows a stop decision is made on: drafted tokens up to and including each round's first
    rejection. Rows after it are trivially rejected (the round already failed there), so an AUC
    over every row overstates how well the controller decides where to stop."""
    return data.columns["position"] <= data.columns["iter_accepted_drafts"] + 1


def with_gate_rows(data: Collected) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token rows plus one gate row per iteration (from its first drafted token, same label):
    ``(features, training targets, outcome labels)``.

    The same network then answers both questions: "keep drafting?" after a token, and "draft at
    all?" before an iteration (see ``uag.decoding.features.gate_row``).
    """
    first = data.columns["position"] == 1
    features = np.concatenate([data.features, to_gate_rows(data.features[first])])
    targets, labels = data.train_targets, data.labels
    return (
        features,
        np.concatenate([targets, targets[first]]),  # what the loss sees
        np.concatenate([labels, labels[first]]),  # what the metrics see (outcomes)
    )
