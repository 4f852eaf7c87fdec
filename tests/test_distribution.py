"""The PIT check of sampled tokens: uniform for exact draws, rejects distortions (no models)."""

from __future__ import annotations

import math

import torch

from uag.distribution import pit_value, uniformity_check


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
