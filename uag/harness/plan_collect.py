"""``uag collect --plan``: round-start features and every action's exact outcome, per round.

Why: a plan (``controllers.plan``) chooses each round's action; it is trained on what *every*
action would have yielded at each round start, not only the one taken. Greedy decoding makes
that exact (``uag.harness.counterfactual``): the target's continuation is recorded once
(``dryrun.record_trace``), then a behaviour runs the real loop against the record and at each
round start every action is labelled (emitted tokens, candidates, assistant steps, lag).

The behaviour is the oracle plan over the same actions, with a share of rounds (``explore``)
taking a uniformly random action the round can run: its states are those a good plan visits
(how far the assistant lags, how the copies went), with coverage around them. Labels cover every
action whatever was taken, so no propensity weighting is needed; each round's propensity is
logged anyway.

Layout (``--resume`` skips prompts whose file exists; a crash loses the prompt in flight)::

    DIR/plan-meta.json            actions, feature names and schema, the latency profile, pair
    DIR/plan-<sha1(id)>.npz       per prompt: features [R, F], emitted/candidates/draft_steps/
                                  lag [R, A], taken [R], propensity [R], prompt id
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from controllers.plan import action_price, best_action
from uag import api
from uag.decoding.actions import Action, ActionSet, Copy, Draft, copy_lookup
from uag.decoding.plan import ChoosingPlan, Sources
from uag.decoding.plan_features import (
    PLAN_FEATURE_NAMES,
    PLAN_SCHEMA_VERSION,
    plan_row,
    round_state,
)
from uag.decoding.plan_features import PLAN_META as META
from uag.decoding.profile import LatencyProfile
from uag.decoding.round import MAX_CANDIDATES, Session
from uag.decoding.sampling import SamplingConfig
from uag.errors import UagError
from uag.harness import dryrun
from uag.harness.counterfactual import Labeller
from uag.harness.prompts import Prompt

if TYPE_CHECKING:  # for annotations; imported where a run follows a controller (``_follow``)
    from controllers.learned_plan import LearnedPlan

OUTCOME_COLUMNS = ("emitted", "candidates", "draft_steps", "lag")
"""Per round and action: what ``Outcome`` says, the columns a price and a label need."""


def default_actions(*, drafts: bool = True, max_draft: int = 8) -> ActionSet:
    """``step``, ``copy:1..MAX_CANDIDATES`` and (with the assistant) ``draft:1..max_draft``."""
    return ActionSet.standard(max_copy=MAX_CANDIDATES, max_draft=max_draft if drafts else 0)


def runnable(actions: ActionSet, *, match: int, drafts: bool) -> list[int]:
    """Indices of the actions a round can run: a copy no longer than the match, a draft only
    with the assistant; the step always."""
    out = []
    for i, a in enumerate(actions):
        if isinstance(a, Copy) and a.length > match:
            continue
        if isinstance(a, Draft) and not drafts:
            continue
        out.append(i)
    return out


class SamplingLabeller:
    """Under sampling, each step/copy action's *expected* outcome at a round start: a copy of
    ``L`` is verified as point masses, its ``j``-th token accepted with probability
    ``p_j(c_j)`` (the target's processed distribution given the copy before it), so it emits
    ``1 + Σ_{j≤L} Π_{i≤j} p_i(c_i)`` tokens on average: the accept probabilities the TLI rule
    computes. One forward of a fork of the target over the whole match gives every ``p_j``
    (the run's own target and cache are left as they were). Drafts are not labelled (an
    action set for sampling has none)."""

    def __init__(self, *, actions: ActionSet, sampling: SamplingConfig) -> None:
        if any(isinstance(a, Draft) for a in actions):
            raise UagError("sampling plans choose steps and copies: collect without drafts")
        self.actions, self.sampling = actions, sampling
        self.rounds: list[dict[str, Any]] = []

    def __call__(self, session: Session, sources: Sources) -> None:
        from uag.decoding.sampling import ProcessedRows
        from uag.harness.counterfactual import _fork_lm, round_start, undrafted

        match = sources.match(session).ids
        pending = len(session.target.ids) - session.target.cached
        survival = [1.0]
        if match and session.target.cached:
            fork = _fork_lm(session.target)
            fork.ids.extend(match)
            hidden = fork.forward()
            rows = ProcessedRows(fork.full_logits(hidden[-(len(match) + 1) :]), self.sampling)
            for j, tok in enumerate(match):
                survival.append(survival[-1] * float(rows(j)[tok]))
        outcomes = []
        for a in self.actions:
            length = a.length if isinstance(a, Copy) else 0
            length = min(length, len(match), max(session.room - 1, 0))
            outcomes.append(
                undrafted(
                    candidates=length,
                    accepted=0,
                    emitted=min(1.0 + sum(survival[1 : length + 1]), session.room),  # type: ignore[arg-type]
                    copied=isinstance(a, Copy),
                    pending=pending,
                )
            )
        self.rounds.append(round_start(session, match=len(match), outcomes=outcomes))


class OraclePlan(ChoosingPlan):
    """Each round takes the action whose *exact* outcome there (counterfactual labels from
    ``trace``, or ``labeller``'s: under sampling, the expected outcome) maximises emitted −
    ``rate`` × price: the ceiling a learned plan is judged against.

    ``rate``: tokens per second (Dinkelbach's R; the caller iterates it to the plan's own rate,
    ``oracle_rate``)."""

    name = "oracle-plan"

    def __init__(
        self,
        *,
        actions: ActionSet,
        profile: LatencyProfile,
        rate: float,
        trace: Any = None,
        eos: Any = None,
        labeller: Any = None,
    ) -> None:
        super().__init__(lookup=copy_lookup())
        self.actions, self.profile, self.rate = actions, profile, rate
        if labeller is None:  # greedy: exact outcomes from the recorded target run
            labeller = Labeller(trace=trace, actions=actions, eos=eos)
        self.labeller = labeller  # else e.g. sampling's expected outcomes (``SamplingLabeller``)

    def choose(self, session: Session) -> Action:
        self.labeller(session, self.sources)
        outcomes = self.labeller.rounds[-1]["outcomes"]
        prices = [
            action_price(
                self.profile, candidates=o.candidates, draft_steps=o.draft_steps, lag=o.lag
            )
            for o in outcomes
        ]
        return self.actions.actions[
            best_action([o.emitted for o in outcomes], prices, rate=self.rate)
        ]


class ExploringOracle(OraclePlan):
    """The collection's behaviour: the oracle plan (or, with ``follow``, a learned plan: the
    states it meets itself), or with probability ``explore`` a uniformly random runnable
    action; records each round's plan features as it chooses."""

    name = "plan-collect"

    def __init__(self, *, explore: float, seed: int, follow: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.explore, self.rng, self.follow = explore, random.Random(seed), follow
        self.rows: list[np.ndarray] = []
        self.propensity: list[float] = []
        self._prompt_bytes = b""

    def choose(self, session: Session) -> Action:
        if not session.records:
            self._prompt_bytes = session.bridge.target.bytes_of(session.prompt_ids)
        match = self.sources.match(session)
        row = plan_row(
            session, match=match, state=round_state(session), prompt_bytes=self._prompt_bytes
        )
        self.rows.append(row)
        best = super().choose(session)  # labels every action at this round start
        drafts = self.sources.assistant is not None
        if self.follow is not None:
            best = self.follow.decide(row, drafts=drafts)
        options = runnable(self.actions, match=len(match.ids), drafts=drafts)
        p_best = 1 - self.explore + self.explore / len(options)
        if self.rng.random() < self.explore:
            pick = self.actions.actions[self.rng.choice(options)]
            self.propensity.append(p_best if pick == best else self.explore / len(options))
            return pick
        self.propensity.append(p_best)
        return best


@dataclass(frozen=True)
class PlanCollectConfig:
    """What ``collect_plan`` runs and writes."""

    out: Path
    max_new_tokens: int = 128
    explore: float = 0.25
    rate_factor: float = 2.0
    """The oracle behaviour's Dinkelbach rate, × the target-alone rate."""
    drafts: bool = True
    max_draft: int = 8
    follow: Path | None = None
    """A plan controller to follow instead of the oracle (on-policy: its own states)."""
    sampling: SamplingConfig | None = None
    """Sample (one run per prompt, labelled by expectation: ``SamplingLabeller``); None:
    greedy, labelled exactly by replay. Collections at several temperatures share a directory
    (``--resume``): the temperature is a plan feature; top-p and top-k are settings."""
    seed: int = 0
    resume: bool = False
    overwrite: bool = False
    settings: dict[str, Any] = field(default_factory=dict)
    """Pair and run settings a resumed run must share (written into the meta)."""


def part_path(out: Path, prompt_id: str) -> Path:
    return out / f"plan-{hashlib.sha1(prompt_id.encode()).hexdigest()[:16]}.npz"


def _atomic_npz(path: Path, arrays: dict[str, Any]) -> None:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


def _prepare(cfg: PlanCollectConfig, meta: dict[str, Any]) -> None:
    meta_file = cfg.out / META
    if meta_file.exists():
        if cfg.overwrite:
            for part in cfg.out.glob("plan-*.npz"):
                part.unlink()
        elif not cfg.resume:
            raise UagError(
                f"{cfg.out} already holds a plan collection: pass --resume to continue it or "
                "--overwrite to replace it"
            )
        else:
            old = json.loads(meta_file.read_text())
            keys = ("actions", "feature_names", "plan_schema_version", "settings", "decoding")
            differ = [k for k in keys if old.get(k) != meta.get(k)]
            if differ:
                raise UagError(
                    f"--resume: {cfg.out} was collected with other {', '.join(differ)}; "
                    "use another --out or --overwrite"
                )
            meta["latency_profile"] = old["latency_profile"]
            # another temperature joins a sampling collection
            meta["temperatures"] = sorted({*old.get("temperatures", []), *meta["temperatures"]})
    cfg.out.mkdir(parents=True, exist_ok=True)
    meta_file.write_text(json.dumps(meta, indent=1))


def collect_plan(
    pair: Any,
    prompts: list[Prompt],
    cfg: PlanCollectConfig,
    *,
    profile: Callable[[], LatencyProfile],
    encode: Callable[[Prompt], tuple[list[int], list[int]]],
    progress: bool = True,
) -> tuple[int, int]:
    """Collect every prompt not already on disk; return (prompts written, rounds written).
    ``profile`` is called only when no earlier run's profile is kept (``--resume``)."""
    sampled = cfg.sampling is not None
    actions = default_actions(drafts=cfg.drafts and not sampled, max_draft=cfg.max_draft)
    prices = _open_collection(cfg, actions=actions, profile=profile)
    shared = _Behaviour(
        actions=actions,
        prices=prices,
        rate=cfg.rate_factor / prices.target_step_s,
        explore=cfg.explore,
        follow=_follow(cfg, actions=actions),
    )
    temperature = None if cfg.sampling is None else cfg.sampling.temperature
    runs = [(p, temperature) for p in prompts]
    todo = [(p, t) for p, t in runs if not part_path(cfg.out, _run_key(p.id, t)).exists()]
    written = rounds = 0
    for p, temperature in tqdm(todo, desc="collect --plan", unit="run", disable=not progress):
        target_ids, assistant_ids = encode(p)
        seed = cfg.seed + int(
            hashlib.sha1(_run_key(p.id, temperature).encode()).hexdigest()[:8], 16
        )
        behaviour = _behave(
            pair,
            cfg,
            shared=shared,
            prompt=_EncodedPrompt(prompt=p, target_ids=target_ids, assistant_ids=assistant_ids),
            seed=seed,
            temperature=temperature,
        )
        arrays = _part_arrays(behaviour, actions=actions, prompt=p)
        _atomic_npz(part_path(cfg.out, _run_key(p.id, temperature)), arrays)
        written += 1
        rounds += len(behaviour.labeller.rounds)
    return written, rounds


def _open_collection(
    cfg: PlanCollectConfig, *, actions: ActionSet, profile: Callable[[], LatencyProfile]
) -> LatencyProfile:
    """The collection's meta written (``--resume`` and ``--overwrite`` checked against what
    ``cfg.out`` holds) and the latency profile its rounds are priced with: a resumed run's own,
    so every part of one collection shares its prices, else ``profile()`` measured now."""
    sampling = cfg.sampling
    meta: dict[str, Any] = {
        "kind": "plan",
        "actions": list(actions.names),
        "feature_names": list(PLAN_FEATURE_NAMES),
        "plan_schema_version": PLAN_SCHEMA_VERSION,
        "settings": {
            **cfg.settings,
            "max_new_tokens": cfg.max_new_tokens,
            **({} if sampling is None else {"top_p": sampling.top_p, "top_k": sampling.top_k}),
        },
        "decoding": "greedy" if sampling is None else "sampling",
        "temperatures": [] if sampling is None else [sampling.temperature],
        "explore": cfg.explore,
        "behaviour": "oracle" if cfg.follow is None else str(cfg.follow),
        "rate_factor": cfg.rate_factor,
    }
    _prepare(cfg, meta)
    if "latency_profile" not in meta:
        meta["latency_profile"] = profile().to_dict()
        (cfg.out / META).write_text(json.dumps(meta, indent=1))
    return LatencyProfile.from_dict(meta["latency_profile"])


def _follow(cfg: PlanCollectConfig, *, actions: ActionSet) -> LearnedPlan | None:
    """The plan controller ``cfg.follow`` names (None: the oracle behaves), checked to choose
    among the actions this collection labels."""
    if cfg.follow is None:
        return None
    from controllers.learned_plan import LearnedPlan

    follow = LearnedPlan(cfg.follow)
    if follow.actions != actions:
        raise UagError(
            f"{cfg.follow} chooses among {len(follow.actions)} actions, this collection "
            f"labels {len(actions)}: collect with its --max-lookahead"
        )
    return follow


@dataclass(frozen=True)
class _Behaviour:
    """What every run's behaviour (``ExploringOracle``) shares: the actions, their prices, the
    oracle's Dinkelbach rate, the share of random rounds and the plan it follows (None: the
    oracle's choice)."""

    actions: ActionSet
    prices: LatencyProfile
    rate: float
    explore: float
    follow: LearnedPlan | None

    def oracle(self, *, seed: int, **labels: Any) -> ExploringOracle:
        """The behaviour of one run, its random rounds drawn from ``seed``; ``labels``: where
        its labels come from (the recorded ``trace`` and ``eos``, or a ``labeller``)."""
        return ExploringOracle(
            explore=self.explore,
            seed=seed,
            follow=self.follow,
            actions=self.actions,
            profile=self.prices,
            rate=self.rate,
            **labels,
        )


@dataclass(frozen=True)
class _EncodedPrompt:
    """A prompt and its ids for each model (``encode``'s)."""

    prompt: Prompt
    target_ids: list[int]
    assistant_ids: list[int]


def _behave(
    pair: Any,
    cfg: PlanCollectConfig,
    *,
    shared: _Behaviour,
    prompt: _EncodedPrompt,
    seed: int,
    temperature: float | None,
) -> ExploringOracle:
    """One run of the behaviour, every round start labelled. Greedy: against the target's
    recorded run (exact replay: exact labels, and the output must stay the record's);
    sampling: the loop itself, seeded, labelled by expectation (``SamplingLabeller``)."""
    if temperature is None:
        trace = dryrun.record_trace(pair, prompt.target_ids, cfg.max_new_tokens)
        behaviour = shared.oracle(seed=seed, trace=trace, eos=pair.target.eos_ids)
        out = dryrun.replay_loop(pair, trace, behaviour, prompt_assistant_ids=prompt.assistant_ids)
        if tuple(out.ids) != tuple(trace.ids):
            raise RuntimeError(f"{prompt.prompt.id}: the behaviour's output left the recorded one")
        return behaviour
    assert cfg.sampling is not None
    sampling = replace(cfg.sampling, seed=seed)
    labeller = SamplingLabeller(actions=shared.actions, sampling=sampling)
    behaviour = shared.oracle(seed=seed, labeller=labeller)
    api.speculate_on(
        pair,
        target_ids=prompt.target_ids,
        assistant_ids=prompt.assistant_ids,
        plan=behaviour,
        max_new_tokens=cfg.max_new_tokens,
        sampling=sampling,
    )
    return behaviour


def _part_arrays(
    behaviour: ExploringOracle, *, actions: ActionSet, prompt: Prompt
) -> dict[str, Any]:
    """One run's part file: per round its features, the action taken and its propensity,
    and every action's outcome (``OUTCOME_COLUMNS``, [rounds, actions])."""
    labelled = behaviour.labeller.rounds
    arrays: dict[str, Any] = {
        "features": np.stack(behaviour.rows).astype(np.float32),
        "taken": np.array([actions.index(a) for a in behaviour.taken], dtype=np.int16),
        "propensity": np.array(behaviour.propensity, dtype=np.float32),
        "prompt_id": np.array(prompt.id),
        "prompt_text": np.array(prompt.text),
    }
    for column in OUTCOME_COLUMNS:
        arrays[column] = np.array(
            [[getattr(o, column) for o in r["outcomes"]] for r in labelled],
            dtype=np.float32 if column == "emitted" else np.int16,
        )
    return arrays


def _run_key(prompt_id: str, temperature: float | None) -> str:
    return prompt_id if temperature is None else f"{prompt_id}@T{temperature:g}"
