"""The policy grammar shared by `uag generate --policy` and `uag bench --policies`."""

from __future__ import annotations

from pathlib import Path

import pytest

from controllers.rules import ConfidencePolicy, EntropyPolicy, HeuristicPolicy, StaticPolicy
from controllers.spec import PolicySpec, parse_policy, parse_policy_list
from uag.errors import UagError
from uag.harness.bench import parse_policies


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("target-only", PolicySpec("target-only")),
        ("static", PolicySpec("static")),
        ("static-4", PolicySpec("static", number=4)),
        ("heuristic-7", PolicySpec("heuristic", number=7)),
        ("confidence-0.6", PolicySpec("confidence", number=0.6)),
        ("entropy-2", PolicySpec("entropy", number=2.0)),
        ("learned", PolicySpec("learned")),
        ("learned:runs/a b.onnx", PolicySpec("learned", path=Path("runs/a b.onnx"))),
        ("oracle", PolicySpec("oracle")),
    ],
)
def test_specs_parse_and_print_back(text, spec):
    assert parse_policy(text) == spec
    assert parse_policy(str(spec)) == spec


def test_build_gives_the_rule_with_its_number_or_the_flag_or_the_default():
    assert parse_policy("static-4").build() == StaticPolicy(k=4)
    assert parse_policy("static").build(lookahead=2) == StaticPolicy(k=2)
    assert parse_policy("static").build() == StaticPolicy(k=3)
    assert parse_policy("heuristic-6").build().start == 6
    assert isinstance(parse_policy("heuristic").build(), HeuristicPolicy)
    rule = parse_policy("confidence-0.6").build(lookahead=5)
    assert isinstance(rule, ConfidencePolicy) and (rule.threshold, rule.max_lookahead) == (0.6, 5)
    rule = parse_policy("entropy").build(threshold=2.5)
    assert isinstance(rule, EntropyPolicy) and (rule.threshold, rule.max_lookahead) == (2.5, 20)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("confidence-1.2.3", "takes a number T"),
        ("confidence-0", "probability in (0, 1]"),
        ("entropy--1", "nats > 0"),
        ("entropy-0", "nats > 0"),
        ("entropy-nan", "finite"),
        ("static-0", "whole number K >= 1"),
        ("static-2.5", "whole number K >= 1"),
        ("learned:model.pt", "a .onnx file"),
        ("fastest", "unknown policy"),
        ("oracle-3", "unknown policy"),
    ],
)
def test_bad_specs_are_one_clear_error(text, message):
    with pytest.raises(UagError) as err:
        parse_policy(text)
    assert message in str(err.value)


def test_a_list_puts_target_only_first_and_refuses_doubles():
    assert [str(s) for s in parse_policy_list("static-2, learned")] == [
        "target-only",
        "static-2",
        "learned",
    ]
    with pytest.raises(UagError, match="listed twice: static-2"):
        parse_policy_list("static-2,target-only,static-2")
    with pytest.raises(UagError, match="empty"):
        parse_policy_list(" , ")


def test_bench_writes_the_default_number_out():
    assert parse_policies("heuristic,entropy,confidence,static-1") == [
        "target-only",
        "heuristic-5",
        "entropy-1.5",
        "confidence-0.4",
        "static-1",
    ]
