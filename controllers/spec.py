"""One grammar for naming a policy: ``uag generate --policy`` and ``uag bench --policies`` share it.

Why: generate took ``--policy NAME --lookahead K --threshold T`` while bench took strings such as
``static-4`` and ``confidence-0.6``, matched by a regular expression and split apart again where
the arms were built: two grammars, and a number the regular expression let through
(``confidence-1.2.3``) failed deep inside as an internal error. Here a spec is parsed once into a
``PolicySpec`` (every error one clear line) and built into a policy in one place.

Grammar::

    target-only | default | lookup | bandit | POLICY[+lookup[-N]] | transformers | oracle
    POLICY := static[-K] | heuristic[-K] | confidence[-T] | entropy[-T]
              | learned | learned:PATH.onnx

``K`` is a whole number ≥ 1 (static: tokens per draft; heuristic: the starting lookahead), ``T``
a number (confidence: stop below this probability, in (0, 1]; entropy: stop above this many
nats, > 0). ``transformers`` and ``oracle`` are bench arms, not runtime policies. ``default``
is the product's plan for the pair in use (``uag.recipes.default_plan``: what ``uag generate``
runs when no policy is named), so a bench can put the default beside every alternative.
``+lookup`` runs prompt lookup (``uag.decoding.lookup``) before each round: when the last target tokens
occurred before, their old continuation is verified and the assistant does not draft that
round. ``lookup`` alone is prompt lookup without the assistant (a plain target step when
nothing matches).

``+lookup-N`` (N a whole number, 2 to 8) is the *hybrid rule* (Arctic Inference's
SuffixDecoding hybrid: a fixed match score decides copy or draft): copy only when the match is
at least ``N`` tokens long, else the policy's assistant drafts (``static-2+lookup-3``). The
score is the matched n-gram's length, not the copy's: the copy's length is a function of the
match length (``PromptLookup.max_tokens``) and of the room left, so it tells nothing more,
while the match length is what predicts the copy (a 1-token match was right at least once 46 %
of the time, 3 tokens 74 %, 4 tokens 92 %: ``uag.decoding.lookup``). N = 1 is ``+lookup``
itself.

``bandit`` is an online UCB1 bandit per prompt, no training (``controllers.bandit``): each round
it picks a plain target step, prompt lookup's copy (when one matches) or the assistant under
static-1, -2 or -4, rewarded by the round's tokens per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from controllers.bandit import BanditPlan
from controllers.plans import RulePlan
from controllers.rules import (
    ConfidencePolicy,
    EntropyPolicy,
    HeuristicPolicy,
    NoDraftPolicy,
    StaticPolicy,
)
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import Plan
from uag.decoding.policy import StopPolicy
from uag.errors import UagError

RULES = ("static", "heuristic", "confidence", "entropy")
"""Hand-written rules: built here, with an optional number."""
KINDS = (
    "target-only",
    "default",
    *RULES,
    "learned",
    "transformers",
    "oracle",
    "lookup",
    "bandit",
)
LOOKUP = "+lookup"
GRAMMAR = (
    "target-only, default, static[-K], heuristic[-K], confidence[-T], entropy[-T], learned, "
    "learned:PATH.onnx, lookup, bandit, transformers, oracle; a drafting policy may end in "
    "+lookup or +lookup-N (copy only after a match of N tokens or more)"
)
MIN_MATCH = (2, 8)
"""The range of ``+lookup-N``'s N: 1 is ``+lookup``; the index keeps n-grams up to 8."""
NGRAM = PromptLookup.max_ngram
"""Prompt lookup's longest indexed match by default."""
DEFAULTS = {"static": 3, "heuristic": 5, "confidence": 0.4, "entropy": 1.5}
"""A rule's number when the spec gives none (and no flag does)."""
RULE_CAP = 20
"""Longest draft of the confidence and entropy rules unless a lookahead is given."""


@dataclass(frozen=True)
class PolicySpec:
    """A parsed policy name: its ``kind``, the rule's ``number`` if written, a controller
    ``path`` for ``learned:PATH``, whether prompt lookup runs first (``lookup``), and the
    shortest match it copies after (``min_match``, ``+lookup-N``; None: any match)."""

    kind: str
    number: float | None = None
    path: Path | None = None
    lookup: bool = False
    min_match: int | None = None

    def __str__(self) -> str:
        suffix = ""
        if self.lookup and self.kind not in ("lookup", "bandit"):
            suffix = LOOKUP if self.min_match is None else f"{LOOKUP}-{self.min_match}"
        if self.path is not None:
            return f"learned:{self.path}{suffix}"
        if self.number is None:
            return self.kind + suffix
        number = int(self.number) if self.kind in ("static", "heuristic") else self.number
        return f"{self.kind}-{number}{suffix}"

    @property
    def is_rule(self) -> bool:
        """``plan`` makes its plan (a hand-written rule, ``lookup`` alone, or the bandit)."""
        return self.kind in RULES or self.kind in ("lookup", "bandit")

    def make_lookup(self, lengths: tuple[int, ...] | None = None) -> PromptLookup | None:
        """A fresh prompt lookup for this spec's runs, or None without ``+lookup``; ``lengths``
        are its copy lengths by match length (``uag calibrate``; None: the built-in ones).
        ``+lookup-N`` finds only matches of ``N`` tokens or more (it indexes up to ``N`` when
        that is longer than the default 4), so a shorter one is no match: the assistant drafts."""
        if not self.lookup:
            return None
        shortest = self.min_match or 1
        return PromptLookup(
            max_ngram=max(NGRAM, shortest),
            min_ngram=shortest,
            max_tokens=PromptLookup.max_tokens if lengths is None else lengths,
        )

    def plan(
        self,
        *,
        lookahead: int | None = None,
        threshold: float | None = None,
        lengths: tuple[int, ...] | None = None,
    ) -> Plan:
        """The plan this spec names (a rule kind: ``is_rule``): the bandit, or the stop rule
        with prompt lookup first (``+lookup``, ``lookup``; ``lengths`` as in ``make_lookup``)."""
        lookup = self.make_lookup(lengths)
        if self.kind == "bandit":
            self._no_flags(lookahead, threshold, "(its drafting arms are static-1, -2 and -4)")
            return BanditPlan(lookup=lookup)
        if self.kind == "lookup":
            self._no_flags(lookahead, threshold, "")
            return RulePlan(None, lookup=lookup)
        return RulePlan(self.build(lookahead=lookahead, threshold=threshold), lookup=lookup)

    def _no_flags(self, lookahead: int | None, threshold: float | None, why: str) -> None:
        if lookahead is not None or threshold is not None:
            raise UagError(
                f"--lookahead and --threshold do not apply to the {self.kind} policy {why}".strip()
            )

    def build(self, *, lookahead: int | None = None, threshold: float | None = None) -> StopPolicy:
        """The stop rule this spec names (``plan`` puts it in a plan). ``lookahead`` /
        ``threshold`` are ``uag generate``'s flags: for static and heuristic the lookahead is
        the spec's own number (give one or the other), for confidence and entropy it caps the
        draft."""
        if not self.is_rule or self.kind == "bandit":
            raise UagError(f"{self} is not a stop rule: build its plan where its model or file is")
        if self.kind == "lookup":
            self._no_flags(lookahead, threshold, "")
            return NoDraftPolicy()
        if self.kind in ("static", "heuristic"):
            if threshold is not None:
                raise UagError(f"--threshold does not apply to the {self.kind} policy")
            if self.number is not None and lookahead is not None:
                raise UagError(f"the lookahead is given twice: {self} and --lookahead {lookahead}")
            k = lookahead or int(self.number or DEFAULTS[self.kind])
            return StaticPolicy(k=k) if self.kind == "static" else HeuristicPolicy(start=k)
        if self.number is not None and threshold is not None:
            raise UagError(f"the threshold is given twice: {self} and --threshold {threshold}")
        value = threshold if threshold is not None else self.number
        value = DEFAULTS[self.kind] if value is None else value
        _check_threshold(self.kind, value)
        cap = lookahead or RULE_CAP
        if self.kind == "confidence":
            return ConfidencePolicy(threshold=value, max_lookahead=cap)
        return EntropyPolicy(threshold=value, max_lookahead=cap)


def _check_threshold(kind: str, value: float) -> None:
    if kind == "confidence" and not 0.0 < value <= 1.0:
        raise UagError(f"a confidence threshold is a probability in (0, 1], got {value}")
    if kind == "entropy" and not value > 0.0:
        raise UagError(f"an entropy threshold is a number of nats > 0, got {value}")


def _min_match(spec: str, number: str) -> int:
    low, high = MIN_MATCH
    if not number.isdigit() or not low <= int(number) <= high:
        raise UagError(
            f"policy {spec!r}: +lookup-N copies after a match of N tokens or more, N a whole "
            f"number from {low} to {high} (+lookup copies after any match)"
        )
    return int(number)


def parse_policy(text: str) -> PolicySpec:
    """``text`` → ``PolicySpec``, or a one-line ``UagError`` saying what is wrong."""
    spec = text.strip()
    head, plus, tail = spec.rpartition(LOOKUP)
    if plus and (not tail or (tail.startswith("-") and not spec.endswith(".onnx"))):
        inner = parse_policy(head)
        if not (inner.is_rule or inner.kind == "learned") or inner.lookup:
            raise UagError(
                f"policy {spec!r}: {LOOKUP} goes with a drafting policy (static, heuristic, "
                "confidence, entropy, learned); 'lookup' alone is prompt lookup without "
                "drafts, 'bandit' has its own"
            )
        return replace(inner, lookup=True, min_match=_min_match(spec, tail[1:]) if tail else None)
    if spec == "lookup":
        return PolicySpec("lookup", lookup=True)
    if spec == "bandit":
        return PolicySpec("bandit", lookup=True)
    if spec.startswith("learned:"):
        path = spec.split(":", 1)[1]
        if not path.endswith(".onnx"):
            raise UagError(f"policy {spec!r}: a controller is a .onnx file (learned:PATH.onnx)")
        return PolicySpec("learned", path=Path(path))
    if spec in KINDS:
        return PolicySpec(spec)
    kind, dash, number = spec.partition("-")
    if not dash or kind not in RULES:
        raise UagError(f"unknown policy {spec!r}: use {GRAMMAR}")
    if kind in ("static", "heuristic"):
        if not number.isdigit() or int(number) < 1:
            raise UagError(f"policy {spec!r}: {kind}-K takes a whole number K >= 1")
        return PolicySpec(kind, number=int(number))
    try:
        value = float(number)
    except ValueError:
        raise UagError(f"policy {spec!r}: {kind}-T takes a number T, got {number!r}") from None
    if not math.isfinite(value):
        raise UagError(f"policy {spec!r}: {kind}-T takes a finite number")
    _check_threshold(kind, value)
    return PolicySpec(kind, number=value)


def parse_policy_list(text: str) -> list[PolicySpec]:
    """A comma-separated list (``uag bench --policies``), target-only first: every arm is
    checked against it. A rule without its number gets the default one written out
    (``entropy`` → ``entropy-1.5``, the arm's name). A policy listed twice is an error."""
    specs = [
        replace(s, number=DEFAULTS[s.kind]) if s.kind in RULES and s.number is None else s
        for s in (parse_policy(t) for t in text.split(",") if t.strip())
    ]
    if not specs:
        raise UagError("--policies is empty")
    if all(s.kind != "target-only" for s in specs):
        specs.insert(0, PolicySpec("target-only"))
    names = [str(s) for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UagError(f"a policy is listed twice: {', '.join(twice)}")
    return specs
