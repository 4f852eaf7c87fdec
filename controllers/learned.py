"""The learned controller at run time: an ONNX classifier behind the stop-policy protocol.

Before each iteration it scores a *gate row* (only what is known before drafting: the target's
confidence in its last token, how far into the answer) and after each drafted token the token's
feature row: estimates that the draft so far will be accepted. Both rows come from
``uag.decoding.features``, the code ``uag collect`` used for the training data. What it does with them is
the ``decision`` its metadata names: ``cost`` (``controllers.cost``: draft on while the expected
tokens are worth their price under the carried latency profile; skipping a round is the budget-0
case) or ``threshold`` (stop below one score, skip below another; controllers exported before
the cost rule).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from controllers.cost import CostRule, CostState
from controllers.plans import RulePlan
from uag.decoding.features import FEATURE_NAMES, SCHEMA_VERSION, feature_row, gate_row
from uag.decoding.lookup import PromptLookup
from uag.decoding.policy import DraftContext, DraftStep, IterationOutcome
from uag.errors import UagError


@dataclass(frozen=True)
class ControllerInfo:
    """The contract an exported controller carries in its ONNX metadata."""

    path: Path
    feature_names: list[str]
    schema_version: int
    threshold: float
    gate_threshold: float
    max_lookahead: int
    target: str
    assistant: str
    assistant_int8: bool
    decoding: str
    """``greedy`` or ``sampling``: the decoding its training data was collected under (files
    exported before this was recorded carry none and were all greedy)."""
    latency_profile: dict[str, Any]
    raw: dict[str, str] = field(repr=False)
    decision: str = "threshold"
    """``cost`` or ``threshold`` (see the module docstring)."""
    rate_factor: float = 1.0
    """``cost``: κ, the rate the decisions assume relative to the target alone."""
    logit_shift: float = 0.0
    """``cost``: what undoes the class weighting of the scores (``controllers.cost``)."""
    gate: bool = True
    """Whether a round may be skipped (files without the key: a positive gate threshold)."""
    draft_vocab: int | None = None
    """The assistant's draft vocabulary its data was collected with (``uag.runtime.draft_vocab``; 0:
    every id; None: files exported before it was recorded)."""
    train_prompts: frozenset[str] = frozenset()
    """Ids of the prompts its training data came from (train and validation): figures measured
    on them are not held-out (files exported before this was recorded carry none)."""

    def cost_rule(self) -> CostRule:
        """The ``cost`` decision's prices and rate, from the carried latency profile."""
        return CostRule.from_profile(
            self.latency_profile,
            rate_factor=self.rate_factor,
            max_lookahead=self.max_lookahead,
            logit_shift=self.logit_shift,
        )


def _session(path: Path, *, use_cuda: bool) -> Any:
    # onnxruntime is slow to import, and the CLI imports this module at start-up.
    import onnxruntime as ort

    if not path.is_file():
        raise UagError(f"controller not found: {path}")
    opts = ort.SessionOptions()
    # One tiny call per drafted token: a single thread avoids thread-pool wake-ups, which cost
    # more than the MLP itself.
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    providers = ["CPUExecutionProvider"]
    if use_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    try:
        return ort.InferenceSession(str(path), sess_options=opts, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception types for corrupt files
        raise UagError(
            f"cannot load controller {path}: not a valid ONNX model ({str(exc).splitlines()[0][:120]})"
        ) from exc


def read_contract(path: Path, session: Any) -> ControllerInfo:
    meta = dict(session.get_modelmeta().custom_metadata_map)
    try:
        info = ControllerInfo(
            path=path,
            feature_names=json.loads(meta["feature_names"]),
            schema_version=int(meta["schema_version"]),
            threshold=float(meta["threshold"]),
            gate_threshold=float(meta.get("gate_threshold", "0")),
            max_lookahead=int(meta.get("max_lookahead", "10")),
            target=meta.get("target", "?"),
            assistant=meta.get("assistant", "?"),
            assistant_int8=json.loads(meta.get("assistant_int8", "false")),
            decoding=meta.get("decoding", "greedy"),
            latency_profile=json.loads(meta.get("latency_profile", "{}")),
            raw=meta,
            decision=meta.get("decision", "threshold"),
            rate_factor=float(meta.get("rate_factor", "1")),
            logit_shift=float(meta.get("logit_shift", "0")),
            gate=bool(json.loads(meta["gate"]))
            if "gate" in meta
            else float(meta.get("gate_threshold", "0")) > 0,
            draft_vocab=int(meta["draft_vocab"]) if "draft_vocab" in meta else None,
            train_prompts=frozenset(str(i) for i in json.loads(meta.get("train_prompt_ids", "[]"))),
        )
        if info.decision not in ("cost", "threshold"):
            raise ValueError(f"decision {info.decision!r}")
        if info.decision == "cost":
            info.cost_rule()  # a profile the rule can price with
    except (KeyError, ValueError, TypeError) as exc:
        raise UagError(
            f"controller {path} lacks uag metadata ({exc}); export it with uag train-controller"
        ) from exc
    if info.schema_version != SCHEMA_VERSION or info.feature_names != list(FEATURE_NAMES):
        raise UagError(
            f"controller {path} was trained on feature schema v{info.schema_version} "
            f"({len(info.feature_names)} features) but this uag computes v{SCHEMA_VERSION} "
            f"({len(FEATURE_NAMES)} features): collect and train again"
        )
    return info


class ContractWarnings:
    """Warnings a controller file's contract gives at run time (``info``: its pair, precision,
    decoding, draft vocabulary, profile device and training prompts; ``path``: the file)."""

    info: Any
    path: Path

    def warn_if_foreign(
        self,
        *,
        target: str,
        assistant: str,
        assistant_int8: bool,
        device: str,
        decoding: str = "greedy",
        draft_vocab: int | None = None,
    ) -> list[str]:
        """Warnings (printed to stderr) when run on another pair, device or decoding mode than
        trained for (a mismatch changes speed, never the output or its distribution)."""
        notes = []
        if (self.info.target, self.info.assistant) != (target, assistant):
            notes.append(
                f"trained for {self.info.target} <- {self.info.assistant}, running {target} <- {assistant}"
            )
        if self.info.assistant_int8 != assistant_int8:
            notes.append(
                f"trained with assistant_int8={self.info.assistant_int8}, running with {assistant_int8}"
            )
        if self.info.decoding != decoding:
            notes.append(f"trained on {self.info.decoding} decoding, running {decoding}")
        if (
            None not in (self.info.draft_vocab, draft_vocab)
            and self.info.draft_vocab != draft_vocab
        ):
            notes.append(
                f"trained with draft vocabulary {self.info.draft_vocab or 'all'}, running "
                f"{draft_vocab or 'all'}"
            )
        trained_device = str(self.info.latency_profile.get("device", "?")).split(":")[0]
        if trained_device != device:
            notes.append(f"trained on {trained_device}, running on {device}")
        for note in notes:
            print(
                f"uag: warning: controller {self.path.name} {note}; its thresholds may not fit "
                "(the output is unaffected)",
                file=sys.stderr,
            )
        return notes

    def warn_if_trained_on(self, prompt_ids: list[str]) -> list[str]:
        """The ids among ``prompt_ids`` this controller was trained on, with a warning on stderr
        (a bench on them measures fitting, not generalisation)."""
        seen = [i for i in prompt_ids if i in self.info.train_prompts]
        if seen:
            shown = ", ".join(seen[:5]) + (", ..." if len(seen) > 5 else "")
            print(
                f"uag: warning: controller {self.path.name} was trained on {len(seen)} of these "
                f"{len(prompt_ids)} prompts ({shown}): its figures on them are not held-out",
                file=sys.stderr,
            )
        return seen

    def warn_if_foreign_to(
        self, job: Any, *, device: str, draft_vocab: int | None = None
    ) -> list[str]:
        """``warn_if_foreign`` for a prompt-set job's config (collect, bench): its pair, assistant
        precision and decoding (``job.sampling`` None: greedy); ``draft_vocab``: the loaded
        pair's (``Pair.draft_vocab``)."""
        return self.warn_if_foreign(
            target=job.target,
            assistant=job.assistant,
            assistant_int8=job.assistant_int8,
            device=device,
            decoding="greedy" if job.sampling is None else "sampling",
            draft_vocab=draft_vocab,
        )


@dataclass
class LearnedPolicy(ContractWarnings):
    """Stop policy backed by an exported controller (see module docstring)."""

    path: Path
    use_cuda: bool = False
    name: str = field(default="learned", init=False)
    needs_features: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.path = Path(self.path)  # a str from Python callers too
        self.session = _session(self.path, use_cuda=self.use_cuda)
        self.info = read_contract(self.path, self.session)
        self.input_name = self.session.get_inputs()[0].name
        self.output_name = self.session.get_outputs()[0].name
        self.decisions = 0
        self._cost = CostState(self.info.cost_rule()) if self.info.decision == "cost" else None

    def as_plan(self, lookup: PromptLookup | None) -> RulePlan:
        """The stop controller drafting after ``lookup``'s copies (None: no copies)."""
        return RulePlan(self, lookup=lookup)

    def _score(self, row: np.ndarray) -> float:
        self.decisions += 1
        out = self.session.run([self.output_name], {self.input_name: row[None, :]})[0]
        return float(np.asarray(out).reshape(-1)[0])

    def reset(self) -> None:
        pass

    def budget(self, ctx: DraftContext) -> int:
        if self._cost is not None:
            # With copies in the run, skipping is weighed even by a controller trained without
            # it: R is no longer the rate its training found skips never paid at.
            gated = self.info.gate or ctx.copies > 0
            gate = self._score(gate_row(ctx)) if gated else None
            rate = self._cost.rule.rate_with_copies(
                generated=ctx.generated,
                copies=ctx.copies,
                copied=ctx.copied,
                copy_emitted=ctx.copy_emitted,
            )
            start = self._cost.start(gate, rate=rate, lag=ctx.lag)
            return self.info.max_lookahead if start else 0
        if self.info.gate_threshold > 0 and self._score(gate_row(ctx)) < self.info.gate_threshold:
            return 0
        return self.info.max_lookahead

    def stop(self, step: DraftStep) -> bool:
        score = self._score(feature_row(step))
        if self._cost is not None:
            candidates = step.target_tokens if step.target_tokens >= 0 else step.position
            return not self._cost.keep_going(
                score=score, position=step.position, candidates=candidates
            )
        return score < self.info.threshold

    def update(self, outcome: IterationOutcome) -> None:
        pass
