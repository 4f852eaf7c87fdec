"""Stop policies behind one protocol (see ``uag.decoding.policy``)."""

from controllers.rules import (
    ConfidencePolicy,
    EntropyPolicy,
    HeuristicPolicy,
    NoDraftPolicy,
    StaticPolicy,
)
from uag.decoding.policy import DraftContext, DraftStep, IterationOutcome, StopPolicy

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
