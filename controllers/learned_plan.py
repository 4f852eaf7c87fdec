"""The learned plan at run time: an ONNX network choosing each round's action.

At each round start it computes the round-start feature row (``uag.decoding.plan_features``,
the code ``uag collect --plan`` used), asks the network for every action's expected tokens, and
takes ``argmax E_a − R · T_a`` with each action priced by the latency profile the file carries
(``controllers.plan``). It is a ``Plan`` (``uag.decoding.plan``): a plain step, a copy of the
chosen length from its prompt lookup, or an assistant draft of the chosen lookahead.

The file's contract (ONNX metadata): ``kind`` ``plan``, the feature names and schema version,
the action names (the network's output order), R, the latency profile, the pair and decoding it
was trained for, and the prompts it was trained and reported on. A mismatch of the features or
of the actions is refused with one line; another pair or device only warns (speed, never the
output, depends on it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from controllers.learned import ContractWarnings, LearnedPolicy, _session
from controllers.plan import ActionPrices, plan_choice
from uag.decoding.actions import Action, ActionSet, copy_lookup
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import ChoosingPlan
from uag.decoding.plan_features import (
    PLAN_FEATURE_NAMES,
    PLAN_SCHEMA_VERSION,
    plan_row,
    round_state,
)
from uag.decoding.profile import LatencyProfile
from uag.decoding.round import Session
from uag.errors import UagError


@dataclass(frozen=True)
class PlanInfo:
    """A plan controller's contract (module docstring)."""

    path: Path
    actions: ActionSet
    rate_factor: float
    latency_profile: dict[str, Any]
    target: str
    assistant: str
    assistant_int8: bool
    decoding: str
    draft_vocab: int | None
    train_prompts: frozenset[str]
    raw: dict[str, str] = field(repr=False)

    @property
    def profile(self) -> LatencyProfile:
        return LatencyProfile.from_dict(self.latency_profile)


def is_plan_file(session: Any) -> bool:
    """Whether an ONNX session's metadata says it is a plan (``kind`` ``plan``)."""
    return dict(session.get_modelmeta().custom_metadata_map).get("kind") == "plan"


def read_plan_contract(path: Path, session: Any) -> PlanInfo:
    """The plan's metadata, checked against this uag's features and what it can run."""
    meta = dict(session.get_modelmeta().custom_metadata_map)
    try:
        version = int(meta["plan_schema_version"])
        names = json.loads(meta["feature_names"])
        action_names = json.loads(meta["actions"])
        info = PlanInfo(
            path=path,
            actions=ActionSet.from_names(action_names),
            rate_factor=float(meta["rate_factor"]),
            latency_profile=json.loads(meta["latency_profile"]),
            target=meta.get("target", "?"),
            assistant=meta.get("assistant", "?"),
            assistant_int8=bool(json.loads(meta.get("assistant_int8", "false"))),
            decoding=meta.get("decoding", "greedy"),
            draft_vocab=int(meta["draft_vocab"]) if "draft_vocab" in meta else None,
            train_prompts=frozenset(str(i) for i in json.loads(meta.get("train_prompt_ids", "[]"))),
            raw=meta,
        )
        LatencyProfile.from_dict(info.latency_profile)  # a profile the prices can be read from
    except UagError as exc:
        raise UagError(
            f"plan controller {path}: its action set is not one uag runs ({exc})"
        ) from exc
    except (KeyError, ValueError, TypeError) as exc:
        raise UagError(
            f"plan controller {path} lacks uag metadata ({exc}); export it with uag train-controller"
        ) from exc
    if version != PLAN_SCHEMA_VERSION or names != list(PLAN_FEATURE_NAMES):
        raise UagError(
            f"plan controller {path} was trained on plan feature schema v{version} "
            f"({len(names)} features) but this uag computes v{PLAN_SCHEMA_VERSION} "
            f"({len(PLAN_FEATURE_NAMES)} features): collect --plan and train again"
        )
    probe = np.zeros((1, len(PLAN_FEATURE_NAMES)), dtype=np.float32)
    output = session.get_outputs()[0].name
    try:
        width = np.asarray(session.run([output], {session.get_inputs()[0].name: probe})[0]).shape[
            -1
        ]
    except Exception as exc:  # onnxruntime's own error types: a graph that takes other inputs
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UagError(f"plan controller {path} does not take one feature row: {first}") from exc
    if width != len(info.actions):
        raise UagError(
            f"plan controller {path} names {len(info.actions)} actions but its network scores "
            f"{width}: the action set differs from the network's; export it again"
        )
    return info


class LearnedPlan(ContractWarnings, ChoosingPlan):
    """Each round's action chosen by an exported plan (module docstring). ``name``
    ``learned``: a bench arm and ``uag generate --controller``'s default. It copies from
    ``copy_lookup()`` (a copy's length is the action's, not a lookup table's)."""

    name = "learned"

    def __init__(self, path: Path | str, *, use_cuda: bool = False, session: Any = None) -> None:
        super().__init__(lookup=copy_lookup())
        self.path = Path(path)
        self.session = session if session is not None else _session(self.path, use_cuda=use_cuda)
        self.info = read_plan_contract(self.path, self.session)
        self.actions = self.info.actions
        self.input_name = self.session.get_inputs()[0].name
        self.output_name = self.session.get_outputs()[0].name
        self.profile = self.info.profile
        self.rate = self.info.rate_factor / self.profile.target_step_s
        self.decisions = 0
        self._prompt_bytes = b""

    @property
    def profile(self) -> LatencyProfile:
        """What the choice prices with (the file's; ``uag.harness.reprice`` swaps it)."""
        return self._prices.profile

    @profile.setter
    def profile(self, profile: LatencyProfile) -> None:
        self._prices = ActionPrices(self.actions, profile)

    def choose(self, session: Session) -> Action:
        if not session.records:
            self._prompt_bytes = session.bridge.target.bytes_of(session.prompt_ids)
        match = self.sources.match(session)
        drafts = self.sources.assistant is not None
        if not match.ids and self._prices.steps and not (drafts and self._prices.drafts):
            # Nothing to copy and no draft to choose: every action but the plain step is priced
            # inf, so the choice is the step whatever the network says. Skipping the feature row
            # and the network (~0.4 ms in the loop, cold after a forward) changes no choice.
            return self.actions.actions[self._prices.steps[0]]
        row = plan_row(
            session, match=match, state=round_state(session), prompt_bytes=self._prompt_bytes
        )
        return self.decide(row, drafts=drafts)

    def as_plan(self, lookup: PromptLookup | None) -> LearnedPlan:
        """Itself: a plan copies from its own lookup (``copy_lookup``), whatever is offered."""
        return self

    def decide(self, row: np.ndarray, *, drafts: bool) -> Action:
        """The action for a round-start feature row (``drafts``: the assistant can draft)."""
        self.decisions += 1
        expected = self.session.run([self.output_name], {self.input_name: row[None, :]})[0][0]
        prices = self._prices.for_row(row, drafts=drafts)
        return self.actions.actions[
            plan_choice(expected.tolist(), row, prices=prices, rate=self.rate)
        ]


def load_controller(path: Path | str, *, use_cuda: bool = False) -> LearnedPlan | LearnedPolicy:
    """The controller a file holds: a ``LearnedPlan`` (metadata ``kind`` ``plan``) or a stop
    controller (``LearnedPolicy``); either refuses a contract this uag cannot honour, and
    either becomes a plan with ``as_plan``."""

    session = _session(Path(path), use_cuda=use_cuda)
    if is_plan_file(session):
        return LearnedPlan(path, session=session)
    return LearnedPolicy(Path(path), use_cuda=use_cuda)
