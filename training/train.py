"""``train(cfg)``: collected runs → a trained, replay-tuned, exported ONNX controller.

A plain function the CLI wraps (tests call it directly with tiny data).
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import TensorBoardLogger
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from training import replay
from training.config import TrainConfig
from training.data import Collected, decision_rows, replayable
from training.datamodule import ControllerDataModule
from training.export import export_onnx
from training.model import ControllerNet
from training.module import ControllerModule, iterations_with_scores, predict
from uag.decoding.profile import LatencyProfile
from uag.errors import UagError


@dataclass
class TrainSummary:
    out: Path
    decision: str
    """What the export decides by: ``cost`` or ``threshold``."""
    rate_factor: float
    """``cost``: κ, the rate its decisions price time at (× the target alone)."""
    threshold: float
    """Stop drafting after a token whose P(accept) is below this."""
    gate_threshold: float
    """Skip drafting an iteration when its gate row's P(accept) is below this (0: never skip)."""
    auc: dict[str, float]
    """ROC-AUC on the reported split: mlp, logistic_regression, confidence (the drafted token's
    probability), and mlp over the decision rows only (``decision_rows``)."""
    sims: dict[str, replay.SimResult]
    """Replay on the reported split: learned, best static, confidence 0.4, tuned confidence,
    entropy, oracle (parameters chosen on the tune split)."""
    onnx_max_abs_diff: float
    log_dir: str
    rows: dict[str, int] = field(default_factory=dict)
    reported: str = "validation"
    """Which prompts the figures are on: ``validation`` (the tune prompts, where thresholds were
    chosen) or ``report`` (held out from training and tuning)."""

    def table(self) -> str:
        where = "report" if self.reported == "report" else "validation"
        split = (
            f"rows: train {self.rows.get('train', 0)}, tune {self.rows.get('val', 0)}, "
            f"report {self.rows.get('report', 0)}"
            if self.reported == "report"
            else f"rows: train {self.rows.get('train', 0)}, validation {self.rows.get('val', 0)}"
        )
        lines = [
            split,
            f"{where} ROC-AUC: " + ", ".join(f"{k} {v:.3f}" for k, v in self.auc.items()),
            f"decision: {self.decision}"
            + (
                f" (draft while expected tokens beat their cost at {self.rate_factor:.2f}x the "
                "target-alone rate, its own replayed rate)"
                if self.decision == "cost"
                else f" (thresholds with max simulated tokens/s on validation: stop below "
                f"{self.threshold:.2f}, skip drafting below {self.gate_threshold:.2f})"
            ),
            f"simulated speed-up vs target alone ({where} replay"
            + ("; every parameter chosen on the tune prompts):" if where == "report" else "):"),
        ]
        lines += [
            f"  {s.name:24s} {s.speedup:5.2f}x   drafts/iter {s.mean_drafted:4.2f}   acceptance {s.acceptance:5.1%}"
            for s in self.sims.values()
        ]
        return "\n".join(lines)


def _auc(labels: np.ndarray, scores: np.ndarray) -> float:
    if len(np.unique(labels)) < 2:
        return float("nan")
    return float(roc_auc_score(labels, scores))


def _baselines(train: Collected, val: Collected) -> dict[str, float]:
    logreg = make_pipeline(
        StandardScaler(), LogisticRegression(class_weight="balanced", max_iter=2000)
    )
    logreg.fit(train.features, train.labels)
    prob_col = train.feature_names.index("prob")
    return {
        "logistic_regression": _auc(val.labels, logreg.predict_proba(val.features)[:, 1]),
        "confidence": _auc(val.labels, val.features[:, prob_col]),
    }


def _trainer(cfg: TrainConfig) -> L.Trainer:
    """The Lightning trainer; Lightning's refusal of the hardware flags becomes one line."""
    logger = TensorBoardLogger(save_dir=str(cfg.logdir), name="controller", default_hp_metric=False)
    # Lightning's start-up chatter (accelerator lines, an advert) and a deprecation warning from
    # its own pytree helper are not the user's business; real warnings still show.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    try:
        return L.Trainer(
            max_epochs=cfg.max_epochs,
            accelerator=cfg.accelerator,
            devices=cfg.devices,
            strategy=cfg.strategy,
            num_nodes=cfg.num_nodes,
            logger=logger,
            enable_checkpointing=False,
            enable_progress_bar=cfg.progress,
            enable_model_summary=False,
            deterministic=True,
            log_every_n_steps=1,
            use_distributed_sampler=False,  # ControllerDataModule shards batches itself
        )
    except (MisconfigurationException, ValueError, TypeError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UagError(
            f"Lightning refuses --accelerator {cfg.accelerator} --devices {cfg.devices} "
            f"--strategy {cfg.strategy} --num-nodes {cfg.num_nodes}: {first}"
        ) from exc


def _tensorboard(trainer: L.Trainer) -> TensorBoardLogger:
    """The trainer's logger, typed: ``_trainer`` always makes a TensorBoard one."""
    logger = trainer.logger
    assert isinstance(logger, TensorBoardLogger)
    return logger


def _log_summary(logger: TensorBoardLogger, metadata: dict[str, Any]) -> None:
    """The exported file's metadata as one text entry beside the curves, so a run's TensorBoard
    says what it exported."""
    logger.experiment.add_text(
        "summary", "```\n" + "\n".join(f"{k}: {v}" for k, v in metadata.items()) + "\n```"
    )
    logger.experiment.flush()


@dataclass
class _Fitted:
    """What fitting leaves the first process: the network and the splits it tunes, reports and
    exports on."""

    net: ControllerNet
    train_set: Collected
    val_set: Collected
    """The tune prompts: every parameter of the decision rules is chosen on them."""
    report_set: Collected | None
    """Prompts held out from training and tuning (None: the figures are the tune prompts')."""
    replay_set: Collected
    """The tune rows replay can simulate on (full drafts only; AUC uses every row)."""
    pos_weight: float
    """The positive class's loss weight: the exported cost rule undoes it (``logit_shift``)."""

    @property
    def reported(self) -> Collected:
        return self.report_set if self.report_set is not None else self.val_set

    @property
    def figures_on(self) -> str:
        return "report" if self.report_set is not None else "validation"

    def rows(self) -> dict[str, int]:
        return {
            "train": len(self.train_set.labels),
            "val": len(self.val_set.labels),
            **({"report": len(self.report_set.labels)} if self.report_set is not None else {}),
        }


@dataclass(frozen=True)
class _Pricing:
    """What every replay of the cost rule shares, tune or report prompts alike."""

    profile: LatencyProfile
    max_lookahead: int
    logit_shift: float
    """log(pos_weight): the class weighting multiplied the odds by it."""
    gate: bool


@dataclass(frozen=True)
class _Baseline:
    """A one-column threshold rule, tuned on the tune prompts as the learned rule is."""

    column: str
    below: bool
    grid: np.ndarray
    label: str
    """Its name, formatted with the threshold."""


_TUNED_BASELINES = {
    "confidence_tuned": _Baseline(
        column="prob", below=True, grid=replay.PROB_GRID, label="confidence-{:.2f} (tuned)"
    ),
    "entropy_tuned": _Baseline(
        column="entropy", below=False, grid=replay.ENTROPY_GRID, label="entropy-{:.1f} (tuned)"
    ),
}


@dataclass(frozen=True)
class _Rules:
    """Every rule's parameters, chosen on the tune prompts, and its replay (on the tune prompts
    until ``_on_report`` replays them, unchanged, on the report prompts)."""

    threshold: float
    gate_threshold: float
    by_threshold: replay.SimResult
    rate_factor: float
    by_cost: replay.SimResult
    baselines: dict[str, tuple[float, replay.SimResult]]
    """``_TUNED_BASELINES`` key → (its threshold, its replay)."""
    best_k: int


def _datamodule(cfg: TrainConfig) -> ControllerDataModule:
    """The collected runs split by prompt; a training split of one label class teaches nothing,
    so it is refused before any fitting."""
    dm = ControllerDataModule(
        cfg.data,
        val_fraction=cfg.val_fraction,
        report_fraction=cfg.report_fraction,
        seed=cfg.seed,
        batch_size=cfg.batch_size,
        allow_mixed=cfg.allow_mixed,
    )
    dm.setup()
    assert dm.train_set is not None and dm.val_set is not None
    if len(np.unique(dm.train_set.labels)) < 2:
        raise UagError("the training split holds a single label class; collect more prompts")
    return dm


def _fit(cfg: TrainConfig, *, trainer: L.Trainer, dm: ControllerDataModule) -> _Fitted:
    """Normalise the network on the training split and fit it, the classes balanced by weight
    (soft labels count as their expectation)."""
    train_set, val_set = dm.train_set, dm.val_set
    assert train_set is not None and val_set is not None
    net = ControllerNet(len(train_set.feature_names), cfg.hidden)
    net.set_normalisation(train_set.features)
    positives = float(train_set.train_targets.sum())
    replay_set = replayable(val_set)
    pos_weight = (len(train_set.labels) - positives) / positives
    module = ControllerModule(net, pos_weight=pos_weight, lr=cfg.lr, val_data=replay_set)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        trainer.fit(module, datamodule=dm)
    return _Fitted(
        net=net,
        train_set=train_set,
        val_set=val_set,
        report_set=dm.report_set,
        replay_set=replay_set,
        pos_weight=pos_weight,
    )


def _release_process_group() -> None:
    """Lightning leaves the process group alive after fit; a gloo group still alive at
    interpreter exit can abort a process ("terminate called without an active exception"), and
    the launcher then kills every rank (seen once in CI, -9). Nothing after fit communicates."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _tune(its: replay.Iterations, *, pricing: _Pricing) -> _Rules:
    """Every parameter chosen by replay on the tune (validation) prompts: the learned rule's
    thresholds, the cost rule's rate (its own fixed point), the baselines' thresholds, the best
    static lookahead."""
    profile = pricing.profile
    threshold, gate_threshold, by_threshold = replay.best_learned(its, profile, gate=pricing.gate)
    rate_factor, by_cost = replay.rate_fixed_point(
        its,
        profile,
        max_lookahead=pricing.max_lookahead,
        logit_shift=pricing.logit_shift,
        gate=pricing.gate,
    )
    baselines = {
        key: replay.best_threshold(
            its,
            profile,
            column=b.column,
            below=b.below,
            grid=b.grid,
            name=b.label.format,
        )
        for key, b in _TUNED_BASELINES.items()
    }
    return _Rules(
        threshold=threshold,
        gate_threshold=gate_threshold,
        by_threshold=by_threshold,
        rate_factor=rate_factor,
        by_cost=by_cost,
        baselines=baselines,
        best_k=replay.best_static_k(its, profile),
    )


def _on_report(rules: _Rules, its: replay.Iterations, *, pricing: _Pricing) -> _Rules:
    """The tuned rules replayed unchanged on the report prompts' iterations ``its``: figures
    from prompts none of their parameters were chosen on."""
    profile = pricing.profile
    rule = replay.cost_rule(
        profile,
        rate_factor=rules.rate_factor,
        max_lookahead=pricing.max_lookahead,
        logit_shift=pricing.logit_shift,
    )
    by_cost = replay.learned_by_cost(its, profile, rule, gate=pricing.gate)
    by_threshold = replay.learned(
        its, profile, stop_below=rules.threshold, gate_below=rules.gate_threshold
    )
    baselines: dict[str, tuple[float, replay.SimResult]] = {}
    for key, (t, tuned) in rules.baselines.items():
        b = _TUNED_BASELINES[key]
        baselines[key] = (
            t,
            replay.threshold_rule(
                its, profile, column=b.column, threshold=t, below=b.below, name=tuned.name
            ),
        )
    return replace(rules, by_cost=by_cost, by_threshold=by_threshold, baselines=baselines)


def _aucs(net: ControllerNet, *, train_set: Collected, reported: Collected) -> dict[str, float]:
    """ROC-AUC on the reported split: the network, the baselines, and the network over the
    decision rows only (rows after a round's first rejection are trivially rejected)."""
    scores = predict(net, reported.features)
    auc = {"mlp": _auc(reported.labels, scores), **_baselines(train_set, reported)}
    deciding = decision_rows(reported)
    auc["mlp, decision rows"] = _auc(reported.labels[deciding], scores[deciding])
    return auc


def _sims(
    rules: _Rules, its: replay.Iterations, *, profile: LatencyProfile, decision: str
) -> dict[str, replay.SimResult]:
    """Every rule's replay on the reported iterations ``its``, the exported decision first."""
    learned = rules.by_cost if decision == "cost" else rules.by_threshold
    return {
        "learned": learned,
        "learned_other_rule": rules.by_threshold if decision == "cost" else rules.by_cost,
        "best_static": replay.static(its, profile, rules.best_k),
        "confidence_0.4": replay.threshold_rule(
            its, profile, column="prob", threshold=0.4, below=True, name="confidence-0.4"
        ),
        "confidence_tuned": rules.baselines["confidence_tuned"][1],
        "entropy_tuned": rules.baselines["entropy_tuned"][1],
        "oracle": replay.oracle(its, profile),
    }


def _metadata(
    cfg: TrainConfig,
    fitted: _Fitted,
    *,
    rules: _Rules,
    pricing: _Pricing,
    auc: dict[str, float],
    sims: dict[str, replay.SimResult],
) -> dict[str, Any]:
    """The exported file's contract (what the runtime reads to decide) and its provenance."""
    train_set, val_set, report_set = fitted.train_set, fitted.val_set, fitted.report_set
    meta = val_set.meta
    return {
        "feature_names": list(val_set.feature_names),
        "schema_version": str(val_set.schema_version),
        "decision": cfg.decision,
        "rate_factor": f"{rules.rate_factor:.6f}",
        "logit_shift": f"{pricing.logit_shift:.6f}",
        "gate": json.dumps(cfg.gate),
        "threshold": f"{rules.threshold:.6f}",
        "gate_threshold": f"{rules.gate_threshold:.6f}",
        "max_lookahead": str(pricing.max_lookahead),
        "target": meta["target"],
        "assistant": meta["assistant"],
        "assistant_int8": json.dumps(bool(meta.get("assistant_int8", False))),
        "draft_vocab": str(int(meta.get("assistant_draft_vocab", 0))),
        "decoding": str(meta.get("decoding", "greedy")),
        "latency_profile": meta["latency_profile"],
        "data_hash": train_set.data_hash,
        "train_prompt_ids": json.dumps(
            sorted({str(i) for i in (*train_set.prompt_ids, *val_set.prompt_ids)})
        ),
        "figures_on": fitted.figures_on,
        "report_prompt_ids": json.dumps(
            sorted({str(i) for i in report_set.prompt_ids}) if report_set is not None else []
        ),
        "val_auc": auc,
        "sim_speedup": {k: round(v.speedup, 4) for k, v in sims.items()},
    }


def train(cfg: TrainConfig) -> TrainSummary | None:
    """Train, tune thresholds by replay on the validation (tune) prompts, report on the report
    prompts when there are any, export ONNX; None in every process but the first of a
    multi-process run (``--devices N --strategy ddp``)."""
    L.seed_everything(cfg.seed, verbose=False)
    trainer = _trainer(cfg)  # first: a bad --accelerator, --devices or --strategy fails at once
    logger = _tensorboard(trainer)
    fitted = _fit(cfg, trainer=trainer, dm=_datamodule(cfg))
    rank_zero = trainer.is_global_zero
    _release_process_group()
    if not rank_zero:
        return None  # the first process chooses thresholds and exports, once

    net = fitted.net.cpu()
    its = iterations_with_scores(net, fitted.replay_set)
    pricing = _Pricing(
        profile=fitted.val_set.profile,
        max_lookahead=int(fitted.val_set.meta.get("max_lookahead", its.max_len)),
        logit_shift=float(np.log(fitted.pos_weight)),
        gate=cfg.gate,
    )
    rules = _tune(its, pricing=pricing)  # every parameter is chosen on the tune prompts ...
    if fitted.report_set is not None:  # ... and applied unchanged to the report prompts
        its = iterations_with_scores(net, replayable(fitted.report_set))
        rules = _on_report(rules, its, pricing=pricing)
    auc = _aucs(net, train_set=fitted.train_set, reported=fitted.reported)
    sims = _sims(rules, its, profile=pricing.profile, decision=cfg.decision)
    metadata = _metadata(cfg, fitted, rules=rules, pricing=pricing, auc=auc, sims=sims)
    diff = export_onnx(net, cfg.out, metadata=metadata, check_rows=fitted.val_set.features)
    _log_summary(logger, metadata)
    return TrainSummary(
        out=cfg.out,
        decision=cfg.decision,
        auc=auc,
        sims=sims,
        rate_factor=rules.rate_factor,
        threshold=rules.threshold,
        gate_threshold=rules.gate_threshold,
        onnx_max_abs_diff=diff,
        log_dir=logger.log_dir,
        rows=fitted.rows(),
        reported=fitted.figures_on,
    )
