"""Counterfactual labels (``uag.harness.counterfactual``) are what the real loop yields when it is
forced to take the action: for every round start of a behaviour's run and every action of a
small set, the loop (``speculate``, the real target) following the behaviour up to that round
and then taking the action records that round as labelled."""

from __future__ import annotations

import random

import pytest
import torch

from tests.toy import toy_pair
from uag.api import encode_prompt, render_prompt, speculate_on
from uag.decoding.actions import ActionSet, Copy, Draft, Step, copy_lookup
from uag.decoding.plan import ScriptedPlan
from uag.harness import counterfactual, dryrun

ACTIONS = ActionSet.standard(max_copy=3, max_draft=3)
TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and on a shared machine an OpenMP
    thread waiting for a busy core makes every forward ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def toy():
    """Attention on: outputs that change token every few steps (a last-token-only model loops
    on one token, where a label shifted by one position would still look right)."""
    return toy_pair(noise=0.05, attention=True)


def _ids(pair, prompt: str) -> tuple[list[int], list[int]]:
    return encode_prompt(pair, render_prompt(pair, prompt, chat=False))


class _Counted:
    """Per round of a run: the target's verify rows and the assistant's forwards (``on_tokens``
    closes a round: it is called once per round, after the verify)."""

    def __init__(self, pair, monkeypatch) -> None:
        self.rows: list[int] = []
        self.steps: list[int] = []
        self._rows = self._steps = 0
        target, assistant = pair.target_lm, pair.assistant_lm
        forward_t, forward_a = target.forward, assistant.forward

        def count_target():
            self._rows += len(target.ids) - target.cached
            return forward_t()

        def count_assistant():
            self._steps += 1
            return forward_a()

        monkeypatch.setattr(target, "forward", count_target)
        monkeypatch.setattr(assistant, "forward", count_assistant)

    def close_round(self, emitted: list[int]) -> None:
        self.rows.append(self._rows)
        self.steps.append(self._steps)
        self._rows = self._steps = 0


def _forced(pair, ids, script, counted: _Counted, *, tokens: int):
    target_ids, assistant_ids = ids
    counted.rows.clear()
    counted.steps.clear()
    return speculate_on(
        pair,
        target_ids=target_ids,
        assistant_ids=assistant_ids,
        plan=ScriptedPlan(script, lookup=copy_lookup()),
        max_new_tokens=tokens,
        on_tokens=counted.close_round,
    )


def _check(
    pair,
    prompt: str,
    *,
    seed: int,
    monkeypatch,
    actions: ActionSet = ACTIONS,
    tokens: int = TOKENS,
) -> list[counterfactual.Outcome]:
    """Label a random behaviour's run, then force every action at every round start."""
    ids = _ids(pair, prompt)
    trace = dryrun.record_trace(pair, ids[0], tokens)
    rng = random.Random(seed)
    behaviour = ScriptedPlan([rng.choice(actions.actions) for _ in range(tokens)])
    labels = counterfactual.label_run(
        pair, trace, behaviour, actions=actions, prompt_assistant_ids=ids[1]
    )
    assert [r.taken for r in labels.rounds] == behaviour.taken
    seen = []
    with monkeypatch.context() as patch:
        counted = _Counted(pair, patch)
        for r in range(len(labels.rounds)):
            for action in actions:
                out = _forced(pair, ids, [*behaviour.taken[:r], action], counted, tokens=tokens)
                assert tuple(out.ids) == trace.ids  # the target's own output, whatever the plan
                label = labels.outcome(r, action)
                where = (prompt, r, action.name)
                assert counterfactual.record_outcome(out.iterations[r]) == (
                    counterfactual.recorded(label)
                ), where
                assert (counted.rows[r], counted.steps[r]) == (label.rows, label.draft_steps), where
                seen.append(label)
    return seen


def _coverage(seen: list[counterfactual.Outcome]) -> set[str]:
    """What kinds of rounds the labels held (so the comparison above meant something)."""
    kinds = set()
    for o in seen:
        if o.copied and o.candidates:
            kinds.add("copy accepted" if o.accepted else "copy rejected")
        if o.drafted:
            kinds.add("draft accepted" if o.accepted else "draft rejected")
            kinds.add("draft all accepted" if o.accepted == o.candidates else "draft cut")
            if o.lag > 1:
                kinds.add("catch-up")
        if o.healed:
            kinds.add("healed")
    return kinds


def test_labels_are_the_loops_rounds_when_forced_toy(toy, monkeypatch):
    seen = _check(toy, "hello world", seed=1, monkeypatch=monkeypatch)
    seen += _check(toy, "the cat sat on", seed=2, monkeypatch=monkeypatch)
    seen += _check(toy, "for i in range(10):\n\t", seed=3, monkeypatch=monkeypatch)
    assert _coverage(seen) >= {
        "copy accepted",
        "copy rejected",
        "draft accepted",
        "draft rejected",
        "draft all accepted",
        "draft cut",
        "catch-up",
        "healed",
    }


def test_labels_are_the_loops_rounds_when_forced_cross(cross, monkeypatch):
    """Real tokenizers (Gemma ← SmolLM2: drafts re-encoded across vocabularies) and a target
    with Gemma's whole head (each forward ~8 ms): fewer actions, a shorter run."""
    few = ActionSet((Step(), Copy(length=2), Draft(lookahead=1), Draft(lookahead=3)))
    seen = _check(
        cross, "def f(x):\n    return", seed=3, monkeypatch=monkeypatch, actions=few, tokens=16
    )
    assert {"copy accepted", "draft rejected", "draft cut", "catch-up"} <= _coverage(seen)


def test_a_draft_of_k_is_the_longest_draft_cut_to_k(toy):
    """Labels of one round differ by lookahead where the assistant drafts (the fork drafts the
    longest once: each shorter draft must be its own, not the longest's)."""
    ids = _ids(toy, "the cat sat on")
    trace = dryrun.record_trace(toy, ids[0], TOKENS)
    behaviour = ScriptedPlan([Step(), *[Draft(lookahead=3)] * TOKENS])
    labels = counterfactual.label_run(
        toy, trace, behaviour, actions=ACTIONS, prompt_assistant_ids=ids[1]
    )
    drafted = [
        [labels.outcome(r, Draft(lookahead=k)).drafted for k in (1, 2, 3)]
        for r in range(1, len(labels.rounds))
    ]
    assert [1, 2, 3] in drafted
    assert all(labels.outcome(r, Copy(length=1)).drafted == 0 for r in range(len(labels.rounds)))
