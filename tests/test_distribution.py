"""The PIT check of sampled tokens: uniform for exact draws, rejects distortions (no models)."""

from __future__ import annotations

import math

import pytest
import torch

from uag.harness.distribution import pit_value, uniformity_check


def _probs() -> torch.Tensor:
    """A distribution with ties, a dominant token and a zero (as top-k / top-p leave them)."""
    p = torch.tensor([0.30, 0.0, 0.15, 0.15, 0.05, 0.20, 0.05, 0.10], dtype=torch.float64)
    return p / p.sum()


def _pits(sample_from: torch.Tensor, score_under: torch.Tensor, n: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.multinomial(sample_from, n, replacement=True, generator=gen).tolist()
    us = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
    return [pit_value(score_under, t, u) for t, u in zip(tokens, us, strict=True)]


def test_exact_draws_give_uniform_pit_values():
    p = _probs()
    for seed in (0, 1):
        check = uniformity_check(_pits(p, p, 5000, seed))
        assert check.samples == 5000 and check.consistent and check.p_value > 0.01


def test_pit_orders_by_probability_with_ties_by_id():
    p = _probs()
    assert pit_value(p, 0, 0.0) == 0.0  # the most probable token comes first
    assert math.isclose(pit_value(p, 5, 0.5), 0.30 + 0.10)
    assert math.isclose(pit_value(p, 3, 0.0), 0.30 + 0.20 + 0.15)  # after its tie, id 2
    assert math.isclose(pit_value(p, 6, 1.0), 1.0)  # the last one ends at 1
    assert math.isnan(pit_value(p, 1, 0.5))  # probability 0: no draw of p is that token


def test_distorted_draws_fail_the_same_test():
    """Drawing from a slightly sharper (T = 0.8) or flatter (T = 1.25) version of p, or from a
    mix that gives 10 % of the draws to the argmax, is caught by the same 5,000-draw test."""
    p = _probs()
    logp = torch.log(p.clamp_min(1e-300)).masked_fill(p == 0, -math.inf)
    sharper = torch.softmax(logp / 0.8, dim=0)
    flatter = torch.softmax(logp / 1.25, dim=0)
    greedier = 0.9 * p + 0.1 * torch.nn.functional.one_hot(p.argmax(), len(p)).double()
    for q in (sharper, flatter, greedier):
        check = uniformity_check(_pits(q, p, 5000, 0))
        assert not check.consistent and check.p_value < 1e-3


def test_an_impossible_token_fails():
    p = _probs()
    values = _pits(p, p, 200, 0) + [pit_value(p, 1, 0.5)]
    assert not uniformity_check(values).consistent
    assert not uniformity_check([]).consistent


def _excess(sample_from: torch.Tensor, score_under: torch.Tensor, n: int, seed: int):
    from uag.harness.distribution import ExcessCheck, logprob_moments

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.multinomial(sample_from, n, replacement=True, generator=gen).tolist()
    entropy, var = logprob_moments(score_under)
    logs = [math.log(float(score_under[t])) if score_under[t] > 0 else -math.inf for t in tokens]
    return ExcessCheck(tokens=n, excess=sum(x + entropy for x in logs), variance=n * var)


def test_excess_logprob_is_centred_for_exact_draws_and_catches_a_rare_bad_token():
    """The tail the PIT cannot see: 1 % of draws replaced by the least likely token moves the
    mean log-probability enough for the z-test, while the PIT still passes."""
    p = torch.softmax(torch.linspace(0.0, 12.0, 64, dtype=torch.float64), dim=0)
    for seed in (0, 1):
        exact = _excess(p, p, 5000, seed)
        assert exact.consistent and abs(exact.z) < 3
    rare = 0.99 * p + 0.01 * torch.nn.functional.one_hot(p.argmin(), len(p)).double()
    bad = _excess(rare, p, 5000, 0)
    assert not bad.consistent and bad.z < -5 and bad.mean < 0
    assert uniformity_check(_pits(rare, p, 5000, 0)).consistent  # what the PIT misses
    sharper = _excess(torch.softmax(torch.log(p) / 0.8, dim=0), p, 5000, 0)
    assert not sharper.consistent and sharper.z > 0


def test_logprob_moments_are_exact():
    from uag.harness.distribution import logprob_moments

    p = torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=torch.float64)
    entropy, var = logprob_moments(p)
    assert entropy == pytest.approx(1.5 * math.log(2))
    assert var == pytest.approx(0.5 * math.log(2) ** 2 + 0.5 * (2 * math.log(2)) ** 2 - entropy**2)
