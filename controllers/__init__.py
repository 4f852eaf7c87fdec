"""Plans (``uag.decoding.plan``) and the stop rules a plan's drafts run under
(``uag.decoding.policy``): the fixed plans, the bandit, the learned plan and stop controller."""

from controllers.bandit import BanditPlan
from controllers.plans import RulePlan, TargetOnlyPlan
from controllers.rules import (
    ConfidencePolicy,
    EntropyPolicy,
    HeuristicPolicy,
    NoDraftPolicy,
    StaticPolicy,
)
from uag.decoding.plan import Plan
from uag.decoding.policy import DraftContext, DraftStep, IterationOutcome, StopPolicy

__all__ = [
    "BanditPlan",
    "ConfidencePolicy",
    "DraftContext",
    "DraftStep",
    "EntropyPolicy",
    "HeuristicPolicy",
    "IterationOutcome",
    "NoDraftPolicy",
    "Plan",
    "RulePlan",
    "StaticPolicy",
    "StopPolicy",
    "TargetOnlyPlan",
]
