"""Round actions (``uag.decoding.actions``): their names, and the plan runner that executes them
(``uag.decoding.plan``)."""

from __future__ import annotations

import pytest
import torch

from tests.toy import toy_pair
from uag.api import encode_prompt, render_prompt, speculate_on
from uag.decoding.actions import (
    ActionSet,
    Copy,
    Draft,
    Step,
    copy_lookup,
    parse_action,
)
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import ChoosingPlan, FunctionPlan, ScriptedPlan
from uag.decoding.round import Generation
from uag.decoding.speculative import target_alone
from uag.errors import UagError

TOKENS = 24


@pytest.fixture(scope="module")
def pair():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only waits for a busy core
    yield toy_pair(noise=0.05, attention=True)
    torch.set_num_threads(before)


def test_names_are_stable_and_parse_back():
    actions = ActionSet.standard(max_copy=2, max_draft=3)
    assert actions.names == ("step", "copy:1", "copy:2", "draft:1", "draft:2", "draft:3")
    assert ActionSet.from_names(actions.names) == actions
    assert [parse_action(a.name) for a in actions] == list(actions)
    assert actions.max_lookahead == 3
    assert actions.index(Draft(lookahead=1)) == 3
    assert ActionSet.standard(max_copy=0, max_draft=0).names == ("step",)
    assert parse_action("draft") == Draft() and Draft().name == "draft"  # the stop rule's length
    assert parse_action("copy:suffix:3") == Copy(length=3, source="suffix")
    assert Copy(length=3, source="suffix").name == "copy:suffix:3"


@pytest.mark.parametrize("name", ["", "copy", "copy:", "copy:x", "draft:-1", "step:1", "jump:2"])
def test_a_bad_name_is_one_clean_error(name):
    with pytest.raises(UagError, match="unknown action"):
        parse_action(name)


def test_lengths_stay_within_the_verify_cap():
    with pytest.raises(UagError, match="verify cap"):
        Copy(length=0)
    with pytest.raises(UagError, match="at least 1"):
        Draft(lookahead=0)
    with pytest.raises(UagError, match="unknown action"):
        parse_action("draft:16")  # a controller's drafts stay within the verify cap
    with pytest.raises(UagError, match="repeated"):
        ActionSet((Step(), Step()))
    with pytest.raises(UagError, match="at least one"):
        ActionSet(())


def _run(pair, prompt: str, plan: ChoosingPlan, *, lookup: PromptLookup | None = None):
    plan.lookup = copy_lookup() if lookup is None else lookup
    target_ids, assistant_ids = encode_prompt(pair, render_prompt(pair, prompt, chat=False))
    alone = target_alone(
        Generation(
            target=pair.target_lm,
            eos=pair.target.eos_ids,
            prompt_ids=target_ids,
            max_new_tokens=TOKENS,
        )
    )
    out = speculate_on(
        pair,
        target_ids=target_ids,
        assistant_ids=assistant_ids,
        plan=plan,
        max_new_tokens=TOKENS,
    )
    return alone, out


def test_each_round_does_what_its_action_says(pair):
    """Steps verify nothing, copies at most their length (from lookup), drafts at most their
    lookahead; whatever the script, the output is the target's own."""
    script = [Step(), Draft(lookahead=3), Copy(length=2), Step(), Copy(length=5)]
    script += [Draft(lookahead=1), Copy(length=1), Draft(lookahead=2)] * 4
    seen = set()
    for prompt in ("hello world", "the cat sat on"):
        choice = ScriptedPlan(script, then=Copy(length=3))
        alone, out = _run(pair, prompt, choice)
        assert out.ids == alone.ids
        assert choice.taken == [*script, *[Copy(length=3)] * TOKENS][: len(out.iterations)]
        assert [r.action for r in out.iterations] == [a.name for a in choice.taken]
        for action, r in zip(choice.taken, out.iterations, strict=True):
            if isinstance(action, Step):
                assert (r.candidates, r.drafted, r.lookup) == (0, 0, False)
            elif isinstance(action, Copy):
                assert r.lookup and r.drafted == 0 and r.candidates <= action.length
                seen.add(("copy", r.candidates == action.length))
            else:
                assert not r.lookup and r.drafted <= action.lookahead
                seen.add(("draft", r.drafted == action.lookahead))
    assert seen >= {("copy", True), ("draft", True)}  # some rounds took the whole action


def test_a_plan_sees_the_session(pair):
    """A plan chooses from the round's state: here, copy where lookup matches, else draft."""

    def plan(session, sources):
        return Copy(length=4) if sources.match(session).ids else Draft(lookahead=2)

    choice = FunctionPlan(plan)
    alone, out = _run(pair, "hello world", choice)
    assert out.ids == alone.ids
    assert {type(a) for a in choice.taken} == {Copy, Draft}


def test_an_action_without_its_source_is_one_clean_error(pair):
    """A plan that copies where the run has no lookup, or names a source the run lacks, is
    refused with the plan's and the action's names."""
    target_ids, assistant_ids = encode_prompt(pair, "hello world")
    common = dict(target_ids=target_ids, assistant_ids=assistant_ids, max_new_tokens=TOKENS)
    with pytest.raises(UagError, match="scripted chose copy:2, but this run has no lookup"):
        speculate_on(pair, plan=ScriptedPlan([Step(), Copy(length=2)]), **common)
    plan = ScriptedPlan([Step(), Copy(length=2, source="suffix")], lookup=copy_lookup())
    with pytest.raises(UagError, match="copy:suffix:2, but this run has no suffix"):
        speculate_on(pair, plan=plan, **common)
