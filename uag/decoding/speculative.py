"""Speculative decoding's entry point and the target-alone reference, greedy or sampled.

``speculate`` builds one round's objects (``uag.decoding.round``): the verifier and the
assistant's draft distribution, greedy or sampled (the only difference between the two), the
sources a plan may draw candidates from (prompt lookup when the plan copies, the assistant),
and runs the rounds with the plan choosing each one's action (``uag.decoding.plan``).
Greedy output is token-for-token what ``target_alone`` returns; sampled output is distributed
as its.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from uag.decoding.bridge import Bridge
from uag.decoding.drafters import (
    AssistantDrafter,
    DraftDistribution,
    GreedyDraft,
    LookupDrafter,
    SampledDraft,
)
from uag.decoding.plan import Plan, PlanRunner, Sources
from uag.decoding.round import (
    Generation,
    LoopOutput,
    Session,
    Verifier,
    decode,
    target_only_loop,
)
from uag.decoding.sampling import Intersection, SamplingConfig, categorical, processed_probs
from uag.decoding.verifiers import GreedyVerifier, SamplingVerifier
from uag.runtime.runner import CachedLM


@dataclass(frozen=True, kw_only=True)
class Assisting:
    """The assistant's side of one generation: its model, its stop ids, the prompt encoded its
    way, and how its drafts reach the target: the bridge from its text to target ids, and
    (sampling) the vocabularies' intersection its draws are restricted to."""

    lm: CachedLM
    eos: frozenset[int]
    prompt_ids: Sequence[int]
    bridge: Bridge
    intersection: Intersection | None = None


def target_alone(gen: Generation, *, sampling: SamplingConfig | None = None) -> LoopOutput:
    """The reference: the target alone, one token per forward, with the same forward and head
    as verification: its argmax, or (``sampling``) one sample of ``processed_probs``."""
    target = gen.target
    next_token: Callable[[torch.Tensor], int]
    if sampling is None:

        def next_token(hidden: torch.Tensor) -> int:
            return target.greedy(hidden).ids[0]

    else:
        _, own = sampling.streams()
        cfg = sampling

        def next_token(hidden: torch.Tensor) -> int:  # the token at position len(target.ids)
            return categorical(
                processed_probs(target.full_logits(hidden), cfg)[0], own(len(target.ids))
            )

    return target_only_loop(gen, next_token=next_token)


def speculate(
    gen: Generation,
    *,
    assistant: Assisting,
    plan: Plan,
    sampling: SamplingConfig | None = None,
    keep_steps: bool = False,
) -> LoopOutput:
    """UAG: the target's own output (greedy), or its own distribution (``sampling``), in fewer
    target passes.

    Greedy: the assistant drafts its argmax, the drafted text is re-encoded into target ids,
    and the target keeps the prefix equal to its own argmax. Sampling (TLI, Timor et al., ICML
    2025; needs ``assistant.intersection``): the assistant drafts from its distribution
    restricted to tokens that are exactly one target token, and speculative sampling accepts or
    resamples. ``plan`` chooses each round's action: a step, a copy from its prompt lookup
    (``plan.lookup``), or an assistant draft (the assistant catches up on copied text the next
    time it drafts). ``keep_steps`` (collection) keeps each round's draft steps (and, sampling,
    their soft labels).
    """
    verifier: Verifier
    draw: DraftDistribution
    if sampling is None:
        verifier = GreedyVerifier()
        draw = GreedyDraft(bridge=assistant.bridge, assistant_eos=assistant.eos)
    else:
        if assistant.intersection is None:
            raise ValueError("speculative sampling needs the pair's intersection")
        # the drafts' draws and the TLI coins from one stream; each position's own sample keyed
        gen_draws, own = sampling.streams()
        verifier = SamplingVerifier(sampling=sampling, gen=gen_draws, own=own)
        draw = SampledDraft(intersection=assistant.intersection, sampling=sampling, gen=gen_draws)
    session = Session(
        gen=gen,
        bridge=assistant.bridge,
        verifier=verifier,
        keep_steps=keep_steps,
        # Target statistics and per-step re-encodings cost a little: only when someone reads them.
        rich=keep_steps or plan.needs_features,
    )
    runner = PlanRunner(plan)
    drafter = AssistantDrafter(
        assistant=assistant.lm, prompt_ids=assistant.prompt_ids, policy=runner, draw=draw
    )
    lookup = LookupDrafter(plan.lookup) if plan.lookup is not None else None
    runner.begin(Sources(lookup=lookup, assistant=drafter))
    return decode(session=session, choice=runner)
