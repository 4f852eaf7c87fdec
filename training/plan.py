"""Training a round's plan: expected tokens per action from round-start features.

The network (``PlanNet``) estimates, for every action of the set, the target tokens the round
would emit (``E_a``); the run-time choice (``controllers.plan.plan_choice``) prices each action
with the carried latency profile and takes ``argmax E_a − R · T_a``. Estimating tokens rather
than choosing an action keeps the prices out of the network: the same network re-priced for
another machine is the same plan rebuilt for those prices (``uag bench --reprice``).

Structure, so that few rows teach a consistent answer:

* a copy of ``L`` yields ``1 + Σ_{j≤L} S_j`` where ``S_j`` is the probability that the first ``j``
  copied tokens are all right: a hazard per position, ``S_j = Π_{i≤j} σ(h_i)``, trained with
  the exact run of the round's whole match (every position up to the first wrong one is a
  label; positions past the match are none);
* a draft of ``k`` yields ``1 + Σ_{j≤k} softplus(d_j)``, trained by squared error on the exact
  emitted count of every ``k`` (a draft's candidates are the assistant's text re-encoded, not
  one target token per drafted token, so no per-position label exists);
* a plain step yields 1.

Data: ``uag collect --plan`` (``uag.harness.plan_collect``). Prompts are split by a hash of their
id into train (70 %), tune (15 %: the rate R) and report (15 %: the figures the exported file
carries, from prompts neither trained nor tuned on).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import nn

from controllers.plan import ActionPrices, action_price, plan_choice
from training.model import Standardised, hidden_layers
from training.steps import SplitSteps
from uag.decoding.actions import ActionSet, Copy, Draft
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan_features import PLAN_FEATURE_NAMES, PLAN_SCHEMA_VERSION
from uag.decoding.plan_features import PLAN_META as META
from uag.decoding.profile import LatencyProfile
from uag.errors import UagError

SPLITS = {"train": range(0, 14), "tune": range(14, 17), "report": range(17, 20)}
"""Of ``sha1(prompt id) % 20``: which split a prompt falls in."""
RATE_GRID = tuple(round(1.0 + 0.25 * i, 2) for i in range(13))
"""Dinkelbach's R searched on the tune split, × the target-alone rate (1.0 .. 4.0)."""
_NGRAM = PLAN_FEATURE_NAMES.index("match_ngram")
_MATCH = PLAN_FEATURE_NAMES.index("match_tokens")


def split_of(prompt_id: str) -> str:
    bucket = int(hashlib.sha1(prompt_id.encode()).hexdigest()[:8], 16) % 20
    return next(name for name, r in SPLITS.items() if bucket in r)


@dataclass
class PlanData:
    """Collected rounds: features [R, F] and every action's outcome columns [R, A]."""

    actions: ActionSet
    profile: LatencyProfile
    meta: dict[str, Any]
    features: np.ndarray
    emitted: np.ndarray
    candidates: np.ndarray
    draft_steps: np.ndarray
    lag: np.ndarray
    prompt: np.ndarray
    """Per round, the index of its prompt in ``prompt_ids``."""
    prompt_ids: list[str] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)
    """Prompt id → its text (collections that stored it): what whole-run replay runs on."""

    def subset(self, rows: np.ndarray) -> PlanData:
        return PlanData(
            actions=self.actions,
            profile=self.profile,
            meta=self.meta,
            features=self.features[rows],
            emitted=self.emitted[rows],
            candidates=self.candidates[rows],
            draft_steps=self.draft_steps[rows],
            lag=self.lag[rows],
            prompt=self.prompt[rows],
            prompt_ids=self.prompt_ids,
            texts=self.texts,
        )

    def split(self, name: str) -> PlanData:
        keep = {i for i, p in enumerate(self.prompt_ids) if split_of(p) == name}
        return self.subset(np.array([p in keep for p in self.prompt], dtype=bool))

    def prompts_in(self, name: str) -> list[str]:
        return sorted(p for p in self.prompt_ids if split_of(p) == name)

    def realized_prices(self) -> np.ndarray:
        """[R, A] seconds each action's exact outcome costs."""
        rounds, actions = self.emitted.shape
        out = np.empty((rounds, actions), dtype=np.float64)
        for r in range(rounds):
            for a in range(actions):
                out[r, a] = action_price(
                    self.profile,
                    candidates=int(self.candidates[r, a]),
                    draft_steps=int(self.draft_steps[r, a]),
                    lag=int(self.lag[r, a]),
                )
        return out


def is_plan_collection(directory: Path) -> bool:
    """Whether ``directory`` holds a ``uag collect --plan`` run."""
    return (Path(directory) / META).is_file()


def _pair(meta: dict[str, Any]) -> dict[str, Any]:
    """A collection's pair settings (what must agree to train on several together)."""
    return {k: v for k, v in meta.get("settings", {}).items() if k != "max_new_tokens"}


def load_plan_data(directories: Path | list[Path]) -> PlanData:
    """Every prompt file of one or more ``uag collect --plan`` runs (the same actions, feature
    schema, pair and decoding: an on-policy round beside the oracle's, or another
    temperature), checked against this uag's schema. The first run's latency profile prices."""
    dirs = [directories] if isinstance(directories, Path) else list(directories)
    metas: list[dict[str, Any]] = []
    for directory in dirs:
        meta_file = directory / META
        if not meta_file.is_file():
            raise UagError(
                f"{directory} holds no plan collection ({META} missing): run uag collect --plan"
            )
        meta = json.loads(meta_file.read_text())
        if meta.get("plan_schema_version") != PLAN_SCHEMA_VERSION or meta.get(
            "feature_names"
        ) != list(PLAN_FEATURE_NAMES):
            raise UagError(
                f"{directory} was collected with plan feature schema "
                f"v{meta.get('plan_schema_version')} but this uag computes "
                f"v{PLAN_SCHEMA_VERSION}: collect again"
            )
        if metas:
            first = metas[0]
            same = {
                "actions": meta.get("actions") == first.get("actions"),
                "decoding": meta.get("decoding") == first.get("decoding"),
                "pair": _pair(meta) == _pair(first),
            }
            for what, ok in same.items():
                if not ok:
                    raise UagError(f"{directory} differs from {dirs[0]} in its {what}: train apart")
        metas.append(meta)
    parts = sorted(p for d in dirs for p in d.glob("plan-*.npz"))
    if not parts:
        raise UagError(f"{', '.join(map(str, dirs))} hold no collected prompts yet")
    cols: dict[str, list[np.ndarray]] = {
        k: [] for k in ("features", "emitted", "candidates", "draft_steps", "lag", "prompt")
    }
    ids: list[str] = []
    texts: dict[str, str] = {}
    for part in parts:
        with np.load(part) as d:
            prompt_id = str(d["prompt_id"])
            if "prompt_text" in d:
                texts[prompt_id] = str(d["prompt_text"])
            if prompt_id not in ids:
                ids.append(prompt_id)
            n = len(d["features"])
            for k in ("features", "emitted", "candidates", "draft_steps", "lag"):
                cols[k].append(d[k])
            cols["prompt"].append(np.full(n, ids.index(prompt_id), dtype=np.int32))
    meta = metas[0]
    return PlanData(
        actions=ActionSet.from_names(meta["actions"]),
        profile=LatencyProfile.from_dict(meta["latency_profile"]),
        meta=meta,
        features=np.concatenate(cols["features"]).astype(np.float32),
        emitted=np.concatenate(cols["emitted"]).astype(np.float32),
        candidates=np.concatenate(cols["candidates"]).astype(np.int32),
        draft_steps=np.concatenate(cols["draft_steps"]).astype(np.int32),
        lag=np.concatenate(cols["lag"]).astype(np.int32),
        prompt=np.concatenate(cols["prompt"]),
        prompt_ids=ids,
        texts=texts,
    )


def _shape(actions: ActionSet) -> tuple[int, int]:
    """(copies, drafts) of a standard action set; refuses any other order."""
    copies = sum(isinstance(a, Copy) for a in actions)
    drafts = sum(isinstance(a, Draft) for a in actions)
    if actions != ActionSet.standard(max_copy=copies, max_draft=drafts):
        raise UagError(
            f"a plan network needs step, copy:1..C, draft:1..D in order, got {actions.names}"
        )
    return copies, drafts


class PlanNet(Standardised):
    """Standardise → MLP → per-action expected tokens ``[N, A]`` (module docstring)."""

    def __init__(
        self, n_features: int, actions: ActionSet, hidden: Sequence[int] = (64, 64)
    ) -> None:
        super().__init__(n_features)
        self.copies, self.drafts = _shape(actions)
        layers, width = hidden_layers(n_features, hidden)
        self.trunk = nn.Sequential(*layers)
        self.copy_head = nn.Linear(width, max(self.copies, 1))
        self.draft_head = nn.Linear(width, max(self.drafts, 1))

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(copy hazard logits [N, C], draft increments [N, D] ≥ 0)."""
        z = self.trunk((x - self.mean) / self.std)
        return self.copy_head(z)[:, : self.copies], nn.functional.softplus(self.draft_head(z))[
            :, : self.drafts
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hazard, increments = self.heads(x)
        # exp(Σ log σ): ONNX has no cumulative product
        survival = torch.exp(torch.cumsum(nn.functional.logsigmoid(hazard), dim=1))
        one = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        return torch.cat(
            [one, 1 + torch.cumsum(survival, dim=1), 1 + torch.cumsum(increments, dim=1)], dim=1
        )


def copy_targets(data: PlanData, copies: int) -> tuple[np.ndarray, np.ndarray]:
    """Per round and copy position ``j``: (the probability that copied token ``j`` is accepted
    given the ones before were, the probability that they were: the position's weight).

    ``S_j``, the chance the first ``j`` copied tokens are all accepted, is what a copy of ``j``
    emits beyond a copy of ``j − 1``: ``S_j = E[copy:j] − E[copy:j−1]`` (copy:0 the step).
    Greedy: 1 up to the match's run, then 0 (the label is 1 up to the run, 0 just after it,
    weightless beyond). Sampling: the expectation the TLI rule gives (``Π p_i(c_i)``). Positions
    past the match say nothing (weight 0)."""
    n = len(data.features)
    match = np.minimum(data.features[:, _MATCH].astype(int), copies)
    expected = data.emitted[:, : copies + 1].astype(np.float64)  # step, copy:1..copies
    survival = np.clip(np.diff(expected, axis=1), 0.0, 1.0)  # [n, copies]
    j = np.arange(1, copies + 1)[None, :]
    inside = j <= match[:, None]
    survival = np.where(inside, survival, 0.0)
    before = np.concatenate([np.ones((n, 1)), survival[:, :-1]], axis=1)
    label = np.where(before > 0, survival / np.maximum(before, 1e-12), 0.0)
    weight = np.where(inside, before, 0.0)
    return label.clip(0.0, 1.0).astype(np.float32), weight.astype(np.float32)


class PlanModule(SplitSteps):
    """Copy hazards by masked BCE, draft yields by squared error; each validation epoch logs
    the per-round replay figures of ``evaluate`` on the tune split."""

    net: PlanNet

    def __init__(self, net: PlanNet, *, lr: float = 3e-3, val: PlanData | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net", "val"])
        self.net, self.lr, self.val = net, lr, val

    def _step(self, batch: Any, split: str) -> torch.Tensor:
        x, copy_y, copy_m, draft_y = batch
        hazard, increments = self.net.heads(x)
        bce = nn.functional.binary_cross_entropy_with_logits(hazard, copy_y, reduction="none")
        copy_loss = (bce * copy_m).sum() / x.shape[0]
        loss = copy_loss
        if self.net.drafts:
            draft = 1 + torch.cumsum(increments, dim=1)
            draft_loss = ((draft - draft_y) ** 2).mean(dim=1).sum() / x.shape[0]
            loss = loss + draft_loss
            self.log(f"{split}/draft_mse", draft_loss, on_step=False, on_epoch=True)
        self.log(f"{split}/copy_bce", copy_loss, on_step=False, on_epoch=True)
        self.log(f"{split}/loss", loss, on_step=False, on_epoch=True, prog_bar=split == "val")
        return loss

    def on_validation_epoch_end(self) -> None:
        if self.val is None or self.trainer.sanity_checking:
            return
        expected = predict(self.net, self.val.features)
        figures = evaluate(self.val, expected, rate_factor=2.0)
        self.log("val/per_round_vs_lookup", figures["learned"] / figures["lookup"])
        self.log("val/per_round_vs_target", figures["learned"])


def tensors(data: PlanData, net: PlanNet) -> torch.utils.data.TensorDataset:
    copy_y, copy_m = copy_targets(data, net.copies)
    first_draft = 1 + net.copies
    draft_y = data.emitted[:, first_draft : first_draft + net.drafts]
    return torch.utils.data.TensorDataset(
        torch.from_numpy(data.features),
        torch.from_numpy(copy_y),
        torch.from_numpy(copy_m),
        torch.from_numpy(np.ascontiguousarray(draft_y, dtype=np.float32)),
    )


def predict(net: nn.Module, features: np.ndarray) -> np.ndarray:
    was = net.training
    net.eval()
    with torch.no_grad():
        out = net(torch.from_numpy(features)).numpy()
    net.train(was)
    return out


def lookup_choice(data: PlanData, lengths: tuple[int, ...] = PromptLookup.max_tokens) -> np.ndarray:
    """The fixed rule's action per round: copy ``lengths[n - 1]`` (cut to the match) after a
    match of ``n`` tokens, else a plain step."""
    ngram = data.features[:, _NGRAM].astype(int)
    match = data.features[:, _MATCH].astype(int)
    out = np.zeros(len(ngram), dtype=np.int64)
    for r, (n, m) in enumerate(zip(ngram, match, strict=True)):
        if n > 0 and m > 0:
            length = min(lengths[min(n, len(lengths)) - 1], m)
            out[r] = data.actions.index(Copy(length=length))
    return out


def choices(data: PlanData, expected: np.ndarray, *, rate_factor: float) -> np.ndarray:
    """The learned plan's action per round, by the run-time rule."""
    rate = rate_factor / data.profile.target_step_s
    drafts = any(isinstance(a, Draft) for a in data.actions)
    prices = ActionPrices(data.actions, data.profile)
    return np.array(
        [
            plan_choice(
                expected[r],
                data.features[r],
                prices=prices.for_row(data.features[r], drafts=drafts),
                rate=rate,
            )
            for r in range(len(expected))
        ],
        dtype=np.int64,
    )


def evaluate(data: PlanData, expected: np.ndarray, *, rate_factor: float) -> dict[str, float]:
    """Per-round replay on the collected round starts: each arm's action at every round, its
    exact outcome there, priced; tokens per second relative to the target alone. Not a whole
    run (the states are the behaviour's), but the same states for every arm."""
    prices = data.realized_prices()
    rows = np.arange(len(data.emitted))

    def rate(pick: np.ndarray) -> float:
        tokens = data.emitted[rows, pick].sum()
        seconds = prices[rows, pick].sum()
        return float(tokens / seconds * data.profile.target_step_s) if seconds else 0.0

    gain = data.emitted - rate_factor / data.profile.target_step_s * prices
    out = {
        "step": rate(np.zeros(len(rows), dtype=np.int64)),
        "lookup": rate(lookup_choice(data)),
        "learned": rate(choices(data, expected, rate_factor=rate_factor)),
        "oracle": rate(np.argmax(gain, axis=1)),
    }
    for k in (1, 2, 4):
        if Draft(lookahead=k) in data.actions:
            out[f"draft:{k}"] = rate(np.full(len(rows), data.actions.index(Draft(lookahead=k))))
    return out


def tune_rate(data: PlanData, expected: np.ndarray) -> tuple[float, dict[str, float]]:
    """Dinkelbach's R (× the target-alone rate) maximising the tune split's per-round rate."""
    best = max(RATE_GRID, key=lambda k: evaluate(data, expected, rate_factor=k)["learned"])
    return best, evaluate(data, expected, rate_factor=best)


REPLAY_GRID = (1.5, 2.0, 2.5, 3.0, 3.5)
"""Dinkelbach's R (× the target-alone rate) tried by whole-run replay on the tune prompts."""


@dataclass
class PlanSummary:
    """What ``train_plan`` exported and its per-round figures."""

    out: Path
    rate_factor: float
    rows: dict[str, int]
    figures: dict[str, dict[str, float]]
    """Per split (tune, report): per-round tokens per second relative to the target alone for
    step, lookup, the learned plan, the oracle and fixed drafts."""
    onnx_max_abs_diff: float
    log_dir: str
    replayed: dict[str, dict[str, float]] = field(default_factory=dict)
    """Whole-run exact replay (greedy): tune (R's grid) and report (the chosen R) prompts."""

    def table(self) -> str:
        lines = [
            "rows: " + ", ".join(f"{k} {v}" for k, v in self.rows.items()),
            f"decision: argmax expected tokens - R x price, R = {self.rate_factor:.2f}x the "
            "target-alone rate (chosen on the tune prompts"
            + (", by whole-run replay)" if self.replayed else ", per round)"),
            "per-round replay on collected round starts, tokens/s vs target alone "
            "(report: prompts neither trained nor tuned on):",
        ]
        for split, figs in self.figures.items():
            lines.append(
                f"  {split:6s} "
                + "  ".join(f"{k} {v:.3f}" for k, v in figs.items())
                + f"  learned/lookup {figs['learned'] / figs['lookup']:.3f}"
            )
        for split, figs in self.replayed.items():
            lines.append(
                f"  whole-run replay, {split}: "
                + "  ".join(f"{k} {v:.3f}" for k, v in figs.items())
            )
        lines.append(f"exported {self.out} (ONNX parity {self.onnx_max_abs_diff:.1e})")
        return "\n".join(lines)


def _nonempty_splits(data: PlanData) -> dict[str, PlanData]:
    """The collection split by prompt (``SPLITS``); every split must hold a prompt, since each
    has a job (fit, choose R, report)."""
    splits = {name: data.split(name) for name in SPLITS}
    for name, part in splits.items():
        if not len(part.features):
            raise UagError(
                f"the {name} split holds no prompts: collect more prompts (about 20 or more)"
            )
    return splits


def _fit_plan(
    cfg: Any, *, trainer: L.Trainer, actions: ActionSet, splits: dict[str, PlanData]
) -> PlanNet:
    """A network normalised on the train split and fitted by Lightning, validated on the tune
    split; returned on the CPU in eval mode, for replay and export."""
    net = PlanNet(len(PLAN_FEATURE_NAMES), actions, hidden=cfg.hidden)
    net.set_normalisation(splits["train"].features)
    module = PlanModule(net, lr=cfg.lr, val=splits["tune"])
    train_loader = torch.utils.data.DataLoader(
        tensors(splits["train"], net), batch_size=cfg.batch_size, shuffle=True
    )
    val_loader = torch.utils.data.DataLoader(tensors(splits["tune"], net), batch_size=4096)
    trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader)
    return net.cpu().eval()


def _plan_metadata(data: PlanData, *, rate: float, figures: dict[str, Any]) -> dict[str, Any]:
    """The exported plan's contract (what the runtime reads to price and choose) and its
    provenance, with ``figures`` (the speed-ups it reports) at the end."""
    meta = data.meta
    settings = meta.get("settings", {})
    return {
        "kind": "plan",
        "plan_schema_version": str(PLAN_SCHEMA_VERSION),
        "feature_names": list(PLAN_FEATURE_NAMES),
        "actions": list(data.actions.names),
        "rate_factor": f"{rate:.6f}",
        "decoding": meta.get("decoding", "greedy"),
        "temperatures": meta.get("temperatures", []),
        "target": settings.get("target", "?"),
        "assistant": settings.get("assistant", "?"),
        "assistant_int8": json.dumps(bool(settings.get("assistant_int8", False))),
        "draft_vocab": str(int(settings.get("draft_vocab") or 0)),
        "latency_profile": meta["latency_profile"],
        "train_prompt_ids": json.dumps(data.prompts_in("train") + data.prompts_in("tune")),
        "report_prompt_ids": json.dumps(data.prompts_in("report")),
        "figures_on": "report",
        **figures,
    }


@dataclass
class _PlanExport:
    """Writes the plan file at ``out``, as often as the rate is chosen anew: whole-run replay
    runs the written file itself."""

    net: PlanNet
    data: PlanData
    out: Path
    check_rows: np.ndarray
    """Rows the ONNX parity check runs on (the tune split's)."""

    def write(self, *, rate: float, figures: dict[str, Any]) -> float:
        """Export at ``rate`` with ``figures``; the largest ONNX-vs-torch difference."""
        from training.export import export_onnx

        return export_onnx(
            self.net,
            self.out,
            metadata=_plan_metadata(self.data, rate=rate, figures=figures),
            check_rows=self.check_rows,
            output_name="expected_tokens",
        )


def _can_replay(data: PlanData) -> bool:
    """Whole-run exact replay needs greedy decoding and the text of every tune and report
    prompt."""
    greedy = data.meta.get("decoding", "greedy") == "greedy"
    ids = data.prompts_in("tune") + data.prompts_in("report")
    return greedy and all(i in data.texts for i in ids)


def _replay_whole_runs(
    export: _PlanExport, *, replayer: Any, rate_factor: float, figures: dict[str, Any]
) -> tuple[float, dict[str, dict[str, float]]]:
    """Whole runs, not rounds: R is chosen where a choice's effect on later rounds counts (on
    the tune prompts, over ``REPLAY_GRID``), then the report prompts are replayed at it; adds
    their figures to ``figures``. Returns (R, the replayed figures per split)."""
    data = export.data
    tune_ids, report_ids = data.prompts_in("tune"), data.prompts_in("report")
    replayed: dict[str, dict[str, float]] = {}
    export.write(rate=rate_factor, figures=figures)
    replay = replayer(data)
    replayed["tune"] = replay(export.out, tune_ids, grid=REPLAY_GRID)
    rate_factor = max(REPLAY_GRID, key=lambda k: replayed["tune"][f"learned@{k:g}"])
    export.write(rate=rate_factor, figures=figures)
    replayed["report"] = replay(export.out, report_ids, grid=(rate_factor,))
    figures["replay_speedup"] = {k: round(v, 4) for k, v in replayed["report"].items()}
    return rate_factor, replayed


def train_plan(cfg: Any, *, replayer: Any = None) -> PlanSummary:
    """A ``TrainConfig`` whose data is one ``uag collect --plan`` run → an exported plan.
    ``replayer`` (``uag.harness.plan_replay.Replayer``; the harness floor, which loads models):
    whole-run exact replay to choose R on the tune prompts and report on the report prompts;
    None: R chosen per round."""
    from training.train import _log_summary, _tensorboard, _trainer

    data = load_plan_data(list(cfg.data))
    splits = _nonempty_splits(data)
    L.seed_everything(cfg.seed, verbose=False)
    trainer = _trainer(cfg)
    net = _fit_plan(cfg, trainer=trainer, actions=data.actions, splits=splits)
    rate_factor, tuned = tune_rate(splits["tune"], predict(net, splits["tune"].features))
    reported = evaluate(
        splits["report"], predict(net, splits["report"].features), rate_factor=rate_factor
    )
    figures: dict[str, Any] = {"per_round_speedup": {k: round(v, 4) for k, v in reported.items()}}
    replayed: dict[str, dict[str, float]] = {}
    export = _PlanExport(net=net, data=data, out=cfg.out, check_rows=splits["tune"].features)
    if replayer is not None and cfg.replay and _can_replay(data):
        rate_factor, replayed = _replay_whole_runs(
            export, replayer=replayer, rate_factor=rate_factor, figures=figures
        )
    diff = export.write(rate=rate_factor, figures=figures)
    logger = _tensorboard(trainer)
    _log_summary(logger, _plan_metadata(data, rate=rate_factor, figures=figures))
    return PlanSummary(
        out=cfg.out,
        rate_factor=rate_factor,
        rows={name: len(part.features) for name, part in splits.items()},
        figures={"tune": tuned, "report": reported},
        replayed=replayed,
        onnx_max_abs_diff=diff,
        log_dir=str(logger.log_dir),
    )
