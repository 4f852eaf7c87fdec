"""``train(cfg)``: collected runs → a trained, replay-tuned, exported ONNX controller.

A plain function the CLI wraps (tests call it directly with tiny data).
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

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


def train(cfg: TrainConfig) -> TrainSummary | None:
    """Train, tune thresholds by replay on the validation (tune) prompts, report on the report
    prompts when there are any, export ONNX; None in every process but the first of a
    multi-process run (``--devices N --strategy ddp``)."""
    L.seed_everything(cfg.seed, verbose=False)
    trainer = _trainer(cfg)  # first: a bad --accelerator, --devices or --strategy fails at once
    logger = trainer.logger
    assert isinstance(logger, TensorBoardLogger)
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
    train_set, val_set = dm.train_set, dm.val_set
    if len(np.unique(train_set.labels)) < 2:
        raise UagError("the training split holds a single label class; collect more prompts")
    net = ControllerNet(len(train_set.feature_names), cfg.hidden)
    net.set_normalisation(train_set.features)
    positives = float(train_set.train_targets.sum())  # soft labels count as their expectation
    replay_set = replayable(val_set)  # AUC uses every validation row, replay full drafts only
    pos_weight = (len(train_set.labels) - positives) / positives
    module = ControllerModule(
        net,
        pos_weight=pos_weight,
        lr=cfg.lr,
        val_data=replay_set,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        trainer.fit(module, datamodule=dm)
    rank_zero = trainer.is_global_zero
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Lightning leaves the process group alive after fit; a gloo group still alive at
        # interpreter exit can abort a process ("terminate called without an active
        # exception"), and the launcher then kills every rank (seen once in CI, -9). Nothing
        # below communicates.
        torch.distributed.destroy_process_group()
    if not rank_zero:
        return None  # the first process chooses thresholds and exports, once

    net = net.cpu()
    its = iterations_with_scores(net, replay_set)
    profile = val_set.profile
    max_lookahead = int(val_set.meta.get("max_lookahead", its.max_len))
    logit_shift = float(np.log(pos_weight))  # the class weighting multiplied the odds by it
    # every parameter is chosen on the tune (validation) prompts ...
    threshold, gate_threshold, by_threshold = replay.best_learned(its, profile, gate=cfg.gate)
    rate_factor, by_cost = replay.rate_fixed_point(
        its, profile, max_lookahead=max_lookahead, logit_shift=logit_shift, gate=cfg.gate
    )
    conf_t, conf_best = replay.best_threshold(
        its,
        profile,
        column="prob",
        below=True,
        grid=replay.PROB_GRID,
        name=lambda t: f"confidence-{t:.2f} (tuned)",
    )
    ent_t, ent_best = replay.best_threshold(
        its,
        profile,
        column="entropy",
        below=False,
        grid=replay.ENTROPY_GRID,
        name=lambda t: f"entropy-{t:.1f} (tuned)",
    )
    best_k = replay.best_static_k(its, profile)
    reported = dm.report_set if dm.report_set is not None else val_set
    if dm.report_set is not None:  # ... and applied unchanged to the report prompts
        its = iterations_with_scores(net, replayable(dm.report_set))
        rule = replay.cost_rule(
            profile, rate_factor=rate_factor, max_lookahead=max_lookahead, logit_shift=logit_shift
        )
        by_cost = replay.learned_by_cost(its, profile, rule, gate=cfg.gate)
        by_threshold = replay.learned(its, profile, stop_below=threshold, gate_below=gate_threshold)
        conf_best = replay.threshold_rule(
            its, profile, column="prob", threshold=conf_t, below=True, name=conf_best.name
        )
        ent_best = replay.threshold_rule(
            its, profile, column="entropy", threshold=ent_t, below=False, name=ent_best.name
        )
    scores = predict(net, reported.features)
    auc = {"mlp": _auc(reported.labels, scores), **_baselines(train_set, reported)}
    deciding = decision_rows(reported)
    auc["mlp, decision rows"] = _auc(reported.labels[deciding], scores[deciding])
    learned = by_cost if cfg.decision == "cost" else by_threshold
    sims = {
        "learned": learned,
        "learned_other_rule": by_threshold if cfg.decision == "cost" else by_cost,
        "best_static": replay.static(its, profile, best_k),
        "confidence_0.4": replay.threshold_rule(
            its, profile, column="prob", threshold=0.4, below=True, name="confidence-0.4"
        ),
        "confidence_tuned": conf_best,
        "entropy_tuned": ent_best,
        "oracle": replay.oracle(its, profile),
    }
    meta = val_set.meta
    metadata = {
        "feature_names": list(val_set.feature_names),
        "schema_version": str(val_set.schema_version),
        "decision": cfg.decision,
        "rate_factor": f"{rate_factor:.6f}",
        "logit_shift": f"{logit_shift:.6f}",
        "gate": json.dumps(cfg.gate),
        "threshold": f"{threshold:.6f}",
        "gate_threshold": f"{gate_threshold:.6f}",
        "max_lookahead": str(max_lookahead),
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
        "figures_on": "report" if dm.report_set is not None else "validation",
        "report_prompt_ids": json.dumps(
            sorted({str(i) for i in dm.report_set.prompt_ids}) if dm.report_set is not None else []
        ),
        "val_auc": auc,
        "sim_speedup": {k: round(v.speedup, 4) for k, v in sims.items()},
    }
    diff = export_onnx(net, cfg.out, metadata=metadata, check_rows=val_set.features)
    logger.experiment.add_text(
        "summary", "```\n" + "\n".join(f"{k}: {v}" for k, v in metadata.items()) + "\n```"
    )
    logger.experiment.flush()
    return TrainSummary(
        out=cfg.out,
        decision=cfg.decision,
        rate_factor=rate_factor,
        threshold=threshold,
        gate_threshold=gate_threshold,
        auc=auc,
        sims=sims,
        onnx_max_abs_diff=diff,
        log_dir=logger.log_dir,
        rows={
            "train": len(train_set.labels),
            "val": len(val_set.labels),
            **({"report": len(dm.report_set.labels)} if dm.report_set is not None else {}),
        },
        reported="report" if dm.report_set is not None else "validation",
    )
