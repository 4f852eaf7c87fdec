"""Stop policies behind one protocol (see ``controllers.base``)."""

from controllers.base import DraftContext, DraftStep, IterationOutcome, StopPolicy
from controllers.rules import (
    ConfidencePolicy,
    EntropyPolicy,
    HeuristicPolicy,
    NoDraftPolicy,
    StaticPolicy,
)

__all__ = [
    "ConfidencePolicy",
    "DraftContext",
    "DraftStep",
    "EntropyPolicy",
    "HeuristicPolicy",
    "IterationOutcome",
    "NoDraftPolicy",
    "StaticPolicy",
    "StopPolicy",
]
