"""The round written once (``uag.decoding.round``): drafters plug in, the output stays the
target's whatever they propose, and the time split is one stopwatch's."""

from __future__ import annotations

import random

import pytest

import uag
from controllers.plans import RulePlan, TargetOnlyPlan
from controllers.rules import StaticPolicy
from tests.nasty import NASTY_PROMPTS
from uag.api import encode_prompt
from uag.decoding.drafters import LookupDrafter
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import Plan, PlanRunner, Sources
from uag.decoding.round import Drafter, Generation, Proposal, Session, decode
from uag.decoding.speculative import target_alone
from uag.decoding.stopwatch import Stopwatch
from uag.decoding.verifiers import GreedyVerifier


def _gen(pair, prompt: str, *, max_new_tokens: int) -> Generation:
    target_ids, _ = encode_prompt(pair, prompt)
    return Generation(
        target=pair.target_lm,
        eos=pair.target.eos_ids,
        prompt_ids=target_ids,
        max_new_tokens=max_new_tokens,
    )


def _session(pair, prompt: str, *, max_new_tokens: int) -> Session:
    gen = _gen(pair, prompt, max_new_tokens=max_new_tokens)
    return Session(gen=gen, bridge=pair.bridge, verifier=GreedyVerifier())


def _reference(pair, prompt: str, *, max_new_tokens: int) -> list[int]:
    return target_alone(_gen(pair, prompt, max_new_tokens=max_new_tokens)).ids


class _ScriptedDrafter:
    """A third drafter the round has never heard of: it proposes ``propose(ids)`` target ids."""

    def __init__(self, propose) -> None:
        self._propose = propose
        self.settled: list[tuple[int, bool]] = []

    def reset(self, session: Session) -> None:
        self.settled.clear()

    def propose(self, session: Session, *, clock: Stopwatch) -> Proposal:
        ids = self._propose(list(session.target.ids))[: max(session.room - 1, 0)]
        return Proposal(candidates=ids)

    def settle(self, session, done, *, clock) -> int:
        self.settled.append((len(done.emitted), done.chosen))
        return 0


class _Always:
    """Choose one drafter every round but the first (the prompt is prefilled alone)."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafters = (drafter,)

    def choose(self, session: Session) -> tuple[str, Drafter | None]:
        return ("third", self.drafters[0]) if session.target.cached else ("step", None)


def _runner(plan: Plan, sources: Sources) -> PlanRunner:
    runner = PlanRunner(plan)
    runner.begin(sources)
    return runner


@pytest.mark.parametrize(
    "name", ["emoji_run", "cjk", "python_deep_indent", "crlf", "byte_fallback"]
)
def test_the_round_with_no_drafter_is_the_target_alone(cross, name):
    prompt = NASTY_PROMPTS[name]
    ref = _reference(cross, prompt, max_new_tokens=12)
    out = decode(
        session=_session(cross, prompt, max_new_tokens=12),
        choice=_runner(TargetOnlyPlan(), Sources()),
    )
    assert out.ids == ref
    assert all(r.candidates == 0 and r.emitted == 1 for r in out.iterations)
    assert len(out.iterations) == len(ref)


def test_any_drafter_plugs_into_the_round_and_the_output_stays_the_targets(cross):
    prompt = "def add(a, b):\n    return"
    ref = _reference(cross, prompt, max_new_tokens=20)
    prompt_len = len(encode_prompt(cross, prompt)[0])
    rng = random.Random(0)
    vocab = cross.target_lm.vocab_size

    def junk(ids: list[int]) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]

    def oracle(ids: list[int]) -> list[int]:
        done = len(ids) - prompt_len
        return ref[done : done + 4]

    for propose in (junk, oracle):
        drafter = _ScriptedDrafter(propose)
        out = decode(
            session=_session(cross, prompt, max_new_tokens=20),
            choice=_Always(drafter),
        )
        assert out.ids == ref
        assert [n for n, _ in drafter.settled] == [r.emitted for r in out.iterations]
        assert [chosen for _, chosen in drafter.settled][1:] == [True] * (len(out.iterations) - 1)
    # the oracle's copies are all accepted: 4 candidates + 1 of the target's own per round
    assert all(r.accepted_candidates == r.candidates for r in out.iterations)
    assert len(out.iterations) < len(ref)


def test_lookup_alone_is_a_drafter_in_the_fixed_choice(similar):
    prompt = "1 2 3 1 2 3 1 2 3 1 2"
    ref = _reference(similar, prompt, max_new_tokens=24)
    lookup = PromptLookup()
    choice = _runner(RulePlan(None, lookup=lookup), Sources(lookup=LookupDrafter(lookup)))
    out = decode(session=_session(similar, prompt, max_new_tokens=24), choice=choice)
    assert out.ids == ref
    assert any(r.lookup and r.candidates for r in out.iterations)
    assert all(r.drafted == 0 for r in out.iterations)


def test_the_time_split_is_disjoint_phases_of_the_round(similar):
    out = uag.generate(
        similar,
        "def f(x):\n    return",
        plan=RulePlan(StaticPolicy(k=3), lookup=PromptLookup()),
        max_new_tokens=24,
    )
    for r in out.iterations:
        phases = r.draft_s + r.verify_s + r.bridge_s + r.policy_s
        assert 0 < phases <= r.round_s
        assert r.first_draft_s <= r.draft_s
    assert any(r.drafted for r in out.iterations)
