"""Speculative sampling is lossless in distribution: tests that can fail.

Goodness of fit against the *exact* target distribution (chi-square, p > 0.01, ≥ 20,000
samples), with a deliberately broken acceptance rule failing the same test; then the whole loop
on tiny models, cross-tokenizer and same-tokenizer.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from controllers.plans import RulePlan
from controllers.rules import NoDraftPolicy, StaticPolicy
from uag.api import encode_prompt
from uag.decoding.lookup import PromptLookup
from uag.decoding.round import Generation, LoopOutput
from uag.decoding.sampling import (
    PointQ,
    PositionDraws,
    SamplingConfig,
    expected_acceptance,
    processed_probs,
    uniform,
    verify_draft,
)
from uag.decoding.speculative import Assisting, speculate, target_alone
from uag.errors import UagError
from uag.runtime.tokcache import token_bytes_table

from .tiny import cross_pair, same_tokenizer_pair
from .toy import toy_pair

P_MIN = 0.01


def _fits(counts: dict, expected: dict[tuple, float], n: int) -> float:
    """Chi-square p-value of observed ``counts`` against exact probabilities (cells under 5
    expected samples pooled into one, as the test requires)."""
    observed, wanted, rest_obs, rest_exp = [], [], 0, 0.0
    for cell, prob in expected.items():
        if prob * n >= 5:
            observed.append(counts.get(cell, 0))
            wanted.append(prob * n)
        else:
            rest_obs += counts.get(cell, 0)
            rest_exp += prob * n
    unexpected = sum(v for k, v in counts.items() if k not in expected)
    observed.append(rest_obs + unexpected)
    wanted.append(rest_exp)
    if wanted[-1] == 0:
        if observed[-1]:
            return 0.0  # samples where the target puts no mass
        observed.pop(), wanted.pop()
    total = sum(wanted)
    return float(chisquare(observed, [w * sum(observed) / total for w in wanted]).pvalue)


def _toy(seed: int, vocab: int = 8):
    """A two-step toy: target p(x1), p(x2 | x1); a drafter q with different beliefs and no mass
    on token 0 (outside the 'intersection')."""
    gen = torch.Generator().manual_seed(seed)

    def dist(scale: float) -> torch.Tensor:
        return torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * scale, 0)

    p1 = dist(1.5)
    p2 = {x: dist(1.5) for x in range(vocab)}
    q1 = dist(1.0)
    q1[0] = 0.0
    q1 /= q1.sum()
    q2 = {x: dist(1.0) for x in range(vocab)}
    return p1, p2, q1, q2


def _sample_two(rule, seed: int, n: int) -> tuple[dict, dict[tuple, float]]:
    """``n`` runs of a 2-token draft through ``rule``; counts of the first two emitted tokens."""
    p1, p2, q1, q2 = _toy(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    counts: dict[tuple, int] = {}
    for _ in range(n):
        d1 = int(torch.multinomial(q1, 1, generator=gen))
        d2 = int(torch.multinomial(q2[d1], 1, generator=gen))
        draft = [d1, d2]

        def p_row(i: int, draft: list[int] = draft) -> torch.Tensor:
            return p1 if i == 0 else p2[draft[0]] if i == 1 else p2[draft[1]]

        emitted, _ = rule(
            draft=draft, q_rows=[q1, q2[d1]], p_row=p_row, gen=gen, own=lambda i: uniform(gen)
        )
        if len(emitted) == 1:  # rejected at once: the second token comes from p2 (the target)
            emitted = [emitted[0], int(torch.multinomial(p2[emitted[0]], 1, generator=gen))]
        key = (emitted[0], emitted[1])
        counts[key] = counts.get(key, 0) + 1
    expected = {(a, b): float(p1[a] * p2[a][b]) for a in range(8) for b in range(8)}
    return counts, expected


def test_verify_draft_reproduces_the_target_distribution():
    for seed in (0, 1):
        counts, expected = _sample_two(verify_draft, seed, 20_000)
        assert _fits(counts, expected, 20_000) > P_MIN


def test_a_broken_acceptance_rule_fails_the_same_test():
    def accept_by_target_only(*, draft, q_rows, p_row, gen, own):
        # The classic mistake: accept with probability p (as if q were uniform / ignored).
        return verify_draft(
            draft=draft,
            q_rows=[p_row(i) for i in range(len(draft))],
            p_row=p_row,
            gen=gen,
            own=own,
        )

    counts, expected = _sample_two(accept_by_target_only, 0, 20_000)
    assert _fits(counts, expected, 20_000) < P_MIN


def _sample_copied(rule, seed: int, n: int) -> tuple[dict, dict[tuple, float]]:
    """``n`` verifications of one fixed copied draft (prompt lookup: ``PointQ``, all mass on
    the copy) through ``rule``; counts of the first two emitted tokens."""
    p1, p2, _, _ = _toy(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    d1, d2 = int(p1.argmax()), int(p2[int(p1.argmax())].argmin())  # one likely, one unlikely
    counts: dict[tuple, int] = {}
    for trial in range(n):

        def p_row(i: int) -> torch.Tensor:
            return p1 if i == 0 else p2[d1] if i == 1 else p2[d2]

        emitted, _ = rule(  # a copy is checked against its position's own keyed draw
            draft=[d1, d2],
            q_rows=[PointQ(d1, 8), PointQ(d2, 8)],
            p_row=p_row,
            gen=gen,
            own=PositionDraws(seed * 1_000_003 + trial),
        )
        if len(emitted) == 1:
            emitted = [emitted[0], int(torch.multinomial(p2[emitted[0]], 1, generator=gen))]
        key = (emitted[0], emitted[1])
        counts[key] = counts.get(key, 0) + 1
    expected = {(a, b): float(p1[a] * p2[a][b]) for a in range(8) for b in range(8)}
    return counts, expected


def test_a_copied_draft_keeps_the_target_distribution():
    """A copied token is kept with probability p (q puts all its mass on it) and a rejection
    samples p without it: the emitted tokens follow p. Accepting copies outright fails."""

    def accept_copies(*, draft, q_rows, p_row, gen, own):
        return verify_draft(
            draft=draft,
            q_rows=[p_row(i) for i in range(len(draft))],
            p_row=p_row,
            gen=gen,
            own=own,
        )

    for seed in (0, 1):
        counts, expected = _sample_copied(verify_draft, seed, 20_000)
        assert _fits(counts, expected, 20_000) > P_MIN
    counts, expected = _sample_copied(accept_copies, 0, 20_000)
    assert _fits(counts, expected, 20_000) < P_MIN


def _soft_vs_outcome(label) -> list[tuple[float, float, float]]:
    """Per draft position of the toy 2-token drafts: (mean sampled outcome, mean soft label,
    standard error of their paired difference) over 8,000 verified drafts."""
    p1, p2, q1, q2 = _toy(3)
    gen = torch.Generator().manual_seed(4)
    rows: list[list[tuple[float, float]]] = [[], []]
    for _ in range(8_000):
        d1 = int(torch.multinomial(q1, 1, generator=gen))
        d2 = int(torch.multinomial(q2[d1], 1, generator=gen))
        draft, q_rows = [d1, d2], [q1, q2[d1]]

        def p_row(i: int, d1: int = d1) -> torch.Tensor:
            return p1 if i == 0 else p2[d1]

        _, accepted = verify_draft(
            draft=draft, q_rows=q_rows, p_row=p_row, gen=gen, own=lambda i: uniform(gen)
        )
        soft = label(draft, q_rows, p_row)
        for i in range(2):
            rows[i].append((float(accepted > i), soft[i]))
    out = []
    for pairs in rows:
        t = torch.tensor(pairs, dtype=torch.float64)
        diff = t[:, 0] - t[:, 1]
        out.append(
            (float(t[:, 0].mean()), float(t[:, 1].mean()), float(diff.std() / len(diff) ** 0.5))
        )
    return out


def test_soft_labels_have_the_sampled_outcomes_mean():
    """``accept_prob`` (what collect logs and training learns under sampling) is the outcome's
    expectation given the draft: equal means, checked at both draft positions; labelling with
    the position's acceptance rate Σ min(p, q) alone, conditioned on nothing, fails at the
    second position, where the draft's first token matters."""
    for outcome, soft, se in _soft_vs_outcome(lambda *a: expected_acceptance(*a)[0]):
        assert abs(outcome - soft) < 4 * se, (outcome, soft, se)
        assert 0.05 < outcome < 0.95  # the toy accepts and rejects: a real test
    wrong = _soft_vs_outcome(lambda *a: expected_acceptance(*a)[1])  # rates, not prefixes
    assert any(abs(o - s) > 4 * se for o, s, se in wrong)


def test_processing_matches_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    cfg = SamplingConfig(temperature=0.7, top_k=20, top_p=0.8)
    scores = TemperatureLogitsWarper(0.7)(None, logits.double())
    scores = TopKLogitsWarper(20)(None, scores)
    scores = TopPLogitsWarper(0.8)(None, scores)
    torch.testing.assert_close(processed_probs(logits, cfg), torch.softmax(scores, -1))


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
def test_top_p_on_a_large_vocabulary_matches_the_full_sort(spread, top_p):
    """The nucleus over Gemma-sized rows, peaked (spread 12: a few tokens hold it) to flat
    (0.5: tens of thousands do, past the first ratios), is Transformers' full-sort rule's."""
    from transformers.generation.logits_process import TopPLogitsWarper

    gen = torch.Generator().manual_seed(int(spread * 10))
    logits = torch.randn(2, 262_144, generator=gen) * spread
    cfg = SamplingConfig(temperature=0.7, top_p=top_p)
    scores = TopPLogitsWarper(top_p)(None, logits.double() / 0.7)
    want = torch.softmax(scores, -1)
    got = processed_probs(logits, cfg)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"temperature": -1.0}, "temperature must be > 0"),
        ({"top_p": 0.0}, r"top-p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top-p must be in \(0, 1\]"),
        ({"top_k": 0}, "top-k must be >= 1"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_bad_sampling_settings_are_refused(kwargs, message):
    with pytest.raises(UagError, match=message):
        SamplingConfig(**kwargs)


def test_intersection_is_built_from_bytes(tokenizers):
    pair = cross_pair(tokenizers)
    inter = pair.intersection()
    table_t, table_a = pair.bridge.target.table, pair.bridge.assistant.table
    assert 1000 < inter.size < len(table_a)
    mapped = (inter.to_target >= 0).nonzero().flatten().tolist()
    assert all(table_a[a] == table_t[int(inter.to_target[a])] for a in mapped)
    newline_a = next(a for a in mapped if table_a[a] == b"\n")  # SmolLM2's 'Ċ'
    newline_t = int(inter.to_target[newline_a])  # Gemma spells it twice ('\n', '<0x0A>'):
    assert pair.bridge.target.encode("\n") == [newline_t]  # the one its tokenizer produces
    eos = pair.assistant.tokenizer.eos_token_id
    assert int(inter.to_target[eos]) == -1  # special tokens never stand for text


def test_a_healed_draft_stands_for_the_token_after_the_healed_text(tokenizers):
    """After the assistant gives back a final space (token healing), its first draft spells
    the space and then new text: SmolLM2's ``·return`` stands for Gemma's ``return``. Every
    mapped id is the healed bytes followed by exactly one target token's; an id that spells
    only them, or does not start with them, stands for nothing."""
    pair = cross_pair(tokenizers)
    inter = pair.intersection()
    table_t, table_a = pair.bridge.target.table, pair.bridge.assistant.table
    for spell, least in ((b" ", 1000), (b"\n", 10)):  # ·word; \n followed by indentation
        healed = inter.healed(spell)
        assert healed is inter.healed(spell)  # built once per text
        mapped = (healed.to_target >= 0).nonzero().flatten().tolist()
        assert least < healed.size == len(mapped)
        assert all(table_a[a] == spell + table_t[int(healed.to_target[a])] for a in mapped)
        alone = pair.bridge.assistant.encode(spell.decode())
        assert len(alone) == 1 and int(healed.to_target[alone[0]]) == -1
    assert inter.can_heal(b" ") and not inter.can_heal(b"\x00\x00\x00\x00")
    (ret,) = pair.bridge.assistant.encode(" return")
    assert table_t[int(inter.healed(b" ").to_target[ret])] == b"return"
    (word,) = pair.bridge.assistant.encode("return")
    assert int(inter.healed(b" ").to_target[word]) == -1
    eos = pair.assistant.tokenizer.eos_token_id
    assert int(inter.healed(b" ").to_target[eos]) == -1


def test_a_drafted_positions_mass_is_its_dense_entry(tokenizers):
    """Acceptance reads q at the drafted token (``TargetQ.at``) and a rejection's residual the
    whole vector (``dense``): the same value for every target id, shared ones included."""
    from uag.decoding.sampling import Intersection, TargetQ

    gen = torch.Generator().manual_seed(0)
    real = cross_pair(tokenizers).intersection()
    # and a mapping where several assistant ids stand for one target id (three for id 7)
    toy = torch.randint(-1, 40, (3000,), generator=gen)
    toy[[5, 900, 2999]] = 7
    for inter in (real, Intersection(to_target=toy, size=int((toy >= 0).sum()))):
        q = torch.rand(len(inter.to_target), generator=gen, dtype=torch.float64) ** 4
        q = inter.restrict(q / q.sum())
        vocab = int(inter.to_target.max()) + 5
        lazy = TargetQ(q, inter, vocab)
        dense = lazy.dense()
        ids = [*inter.shared(), *inter.to_target[inter.to_target >= 0][:500].tolist(), vocab - 1]
        assert all(lazy.at(t) == float(dense[t]) for t in ids)
        assert float(dense.sum()) == pytest.approx(1.0)
    assert 7 in inter.shared() and len(inter.sources()[7]) >= 3


def _exact_three(pair, prompt: list[int], cfg: SamplingConfig):
    """Exact target distribution of the first three tokens (top-k keeps the support small)."""
    lm = pair.target_lm

    def probs(ids: list[int]) -> torch.Tensor:
        lm.reset(ids, rollback=False)
        return processed_probs(lm.full_logits(lm.forward()[-1:]), cfg)[0]

    out: dict[tuple, float] = {}
    p1 = probs(prompt)
    for a in p1.nonzero().flatten().tolist():
        p2 = probs([*prompt, a])
        for b in p2.nonzero().flatten().tolist():
            p3 = probs([*prompt, a, b])
            for c in p3.nonzero().flatten().tolist():
                out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return out


def _gen(pair, prompt_t: list[int], max_new_tokens: int) -> Generation:
    """A generation on ``pair``'s target with no stop ids (every run is as long as asked)."""
    return Generation(
        target=pair.target_lm, eos=frozenset(), prompt_ids=prompt_t, max_new_tokens=max_new_tokens
    )


def _assisting(pair, prompt_a: list[int]) -> Assisting:
    """``pair``'s assistant, drafting into the sampling intersection, with no stop ids."""
    return Assisting(
        lm=pair.assistant_lm,
        eos=frozenset(),
        prompt_ids=prompt_a,
        bridge=pair.bridge,
        intersection=pair.intersection(),
    )


def _run_many(pair, prompt_t, prompt_a, cfg, seeds, policy=None, lookup=False):
    """Seeded speculative runs, one per seed; counts of their first three tokens, drafted and
    accepted candidates, candidates copied by prompt lookup (``lookup``), and rounds that
    drafted after token healing."""
    counts: dict[tuple, int] = {}
    drafted = accepted = copied = healed = 0
    for i in seeds:
        run = SamplingConfig(cfg.temperature, cfg.top_p, cfg.top_k, seed=i)
        out: LoopOutput = speculate(
            _gen(pair, prompt_t, 4),
            assistant=_assisting(pair, prompt_a),
            plan=RulePlan(policy or StaticPolicy(k=2), lookup=PromptLookup() if lookup else None),
            sampling=run,
        )
        drafted += sum(r.drafted for r in out.iterations)
        accepted += sum(r.accepted_candidates for r in out.iterations)
        copied += sum(r.candidates for r in out.iterations if r.lookup)
        healed += sum(bool(r.healed and r.drafted) for r in out.iterations)
        key = tuple(out.ids[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts, drafted, accepted, copied, healed


def _toy_runs(job: tuple[str | list[int], bool, range, str]):
    """A worker process's share of ``_run_many`` on its own (identical, seeded) toy pair;
    the prompt as text, or as target ids (the assistant gets their text); ``mode``: the
    assistant drafts 2 (``draft``), prompt lookup alone (``lookup``) or lookup first and the
    assistant when it finds nothing (``both``)."""
    prompt, ascii_only, seeds, mode = job
    torch.set_num_threads(1)
    pair = toy_pair(ascii_only=ascii_only)
    if isinstance(prompt, str):
        prompt_t, prompt_a = encode_prompt(pair, prompt)
    else:
        prompt_t = prompt
        prompt_a = encode_prompt(pair, pair.target.tokenizer.decode(prompt[1:]))[1]
    policy = NoDraftPolicy() if mode == "lookup" else None
    return _run_many(pair, prompt_t, prompt_a, TOY_SAMPLING, seeds, policy, mode != "draft")


@pytest.fixture(scope="module")
def toy_pool():
    """Two worker processes for the toy runs (CI has two cores; the runs are python-bound and
    independent), started once for this module's tests: each start imports torch and builds
    the toy pair, ~10 s."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        yield pool


def _pooled_runs(pool, prompt: str | list[int], ascii_only: bool, n: int, *, mode: str = "draft"):
    """``_run_many`` over seeds 1000.. split between ``pool``'s two processes: the counts are
    exactly the serial loop's."""
    halves = [range(1000, 1000 + n // 2), range(1000 + n // 2, 1000 + n)]
    parts = pool.map(_toy_runs, [(prompt, ascii_only, h, mode) for h in halves])
    counts: dict[tuple, int] = {}
    for part, *_ in parts:
        for key, c in part.items():
            counts[key] = counts.get(key, 0) + c
    drafted, accepted, copied, healed = (sum(part[i] for part in parts) for i in (1, 2, 3, 4))
    return counts, drafted, accepted, copied, healed


TOY_SAMPLING = SamplingConfig(temperature=1.0, top_k=4)


@pytest.mark.parametrize(
    ("prompt", "ascii_only"),
    [("print(x) # is", True), ("café 😀", False)],
    ids=["ascii", "multibyte"],
)
def test_speculative_sampling_matches_the_target_on_toy_models(toy_pool, prompt, ascii_only):
    """The whole loop, cross-tokenizer (hand-made byte-level BPE vocabularies of ~300 tokens),
    two drafted tokens per round: the first three tokens follow the target's exact joint.

    ``ascii``: after 'is' the toy target's first token is whitespace ~2/3 of the time, so the
    next round's first draft is healed (``Intersection.healed``: a draft spelling the space
    again stands for the token after it) in most runs.

    ``multibyte``: after 'café 😀' most of the target's mass (~89 % of the joint) is on tokens
    of multi-byte characters, whole or in byte pieces, so samples stop mid-character, the
    bridge carries incomplete UTF-8 both ways, and the intersection leaves many target tokens
    to the residual: the case the real pair's small negative log-probability differences
    pointed at."""
    pair = toy_pair(ascii_only=ascii_only)
    prompt_t, _ = encode_prompt(pair, prompt)
    expected = _exact_three(pair, prompt_t, TOY_SAMPLING)
    table = token_bytes_table(pair.target.tokenizer, len(pair.target.tokenizer))
    wide = sum(v for k, v in expected.items() if any(max(table[t], default=0) > 127 for t in k))
    assert (wide == 0) if ascii_only else (wide > 0.5)
    n = 20_000
    counts, drafted, accepted, _, healed = _pooled_runs(toy_pool, prompt, ascii_only, n)
    assert drafted >= n  # round 2 drafts two tokens in nearly every run
    assert n // 4 < accepted < drafted  # both paths exercised: acceptances and rejections
    assert healed > n // 2 or not ascii_only
    assert _fits(counts, expected, n) > P_MIN


@pytest.mark.parametrize(
    "mode",
    # ``lookup`` alone (copies only) is slow-marked to keep the suite under its 15 minutes:
    # ``both`` copies in most runs too, and drafts when lookup finds nothing.
    [pytest.param("lookup", marks=pytest.mark.slow), "both"],
)
def test_speculative_sampling_with_lookup_matches_the_target_on_toy_models(toy_pool, mode):
    """The whole loop with prompt lookup as the only drafter (``lookup``), or first with the
    assistant drafting 2 when it finds nothing (``both``), on a prompt that ends in the toy
    target's own greedy loop (so sampled tokens often occurred before): rounds verify copied
    tokens, accepted and rejected, and the first three tokens still follow the target's exact
    joint."""
    pair = toy_pair(ascii_only=True)
    prompt_t, _ = encode_prompt(pair, "ab ab")
    lm = pair.target_lm
    for _ in range(40):
        lm.reset(prompt_t, rollback=False)
        prompt_t = [*prompt_t, lm.greedy(lm.forward()[-1:]).ids[0]]
    expected = _exact_three(pair, prompt_t, TOY_SAMPLING)
    n = 20_000
    counts, drafted, accepted, copied, _ = _pooled_runs(toy_pool, prompt_t, True, n, mode=mode)
    assert copied > n // 2  # most runs copy after their first token
    assert (drafted == 0) if mode == "lookup" else (drafted > n // 10)  # both: some draft too
    assert n // 10 < accepted < copied + drafted  # candidates accepted and rejected
    assert _fits(counts, expected, n) > P_MIN


def test_target_only_sampling_is_reproducible_and_seeded(tokenizers):
    pair = same_tokenizer_pair(tokenizers, noise=0.05)
    prompt_t, _ = encode_prompt(pair, "x = 1")
    cfg = SamplingConfig(temperature=1.0, seed=5)
    runs = [target_alone(_gen(pair, prompt_t, 8), sampling=cfg).ids for _ in range(2)]
    assert runs[0] == runs[1]
    other = target_alone(
        _gen(pair, prompt_t, 8), sampling=SamplingConfig(temperature=1.0, seed=6)
    ).ids
    assert other != runs[0]


def test_copies_and_steps_emit_target_alone_sampling_token_for_token():
    """Each position's own sample is keyed by (seed, position) (``PositionDraws``), and a copy
    is kept when it equals that sample: a run whose rounds only copy (prompt lookup) and step
    emits what target-alone sampling emits with the same seed, rejections included. With the
    classic stream-drawn coin (accept with ``p(token)``, resample from the residual) this
    fails: the same law, but other tokens."""
    pair = toy_pair(ascii_only=True)
    prompt_t, prompt_a = encode_prompt(pair, "ab ab")
    lm = pair.target_lm
    for _ in range(30):  # end in the toy target's own loop: lookup finds matches
        lm.reset(prompt_t, rollback=False)
        prompt_t = [*prompt_t, lm.greedy(lm.forward()[-1:]).ids[0]]
    prompt_a = encode_prompt(pair, pair.target.tokenizer.decode(prompt_t[1:]))[1]
    copied = accepted = 0
    for seed in range(12):
        cfg = SamplingConfig(temperature=1.0, top_k=4, seed=seed)
        alone = target_alone(_gen(pair, prompt_t, 24), sampling=cfg).ids
        out = speculate(
            _gen(pair, prompt_t, 24),
            assistant=_assisting(pair, prompt_a),
            plan=RulePlan(None, lookup=PromptLookup()),
            sampling=cfg,
        )
        assert out.ids == alone, seed
        copied += sum(r.candidates for r in out.iterations if r.lookup)
        accepted += sum(r.accepted_candidates for r in out.iterations if r.lookup)
    assert 0 < accepted < copied  # copies kept and copies rejected, both on the identity


@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.5, 0.999999])
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.7])
def test_top_k_sampling_touches_only_the_survivors_bitwise(top_p, temperature):
    """The top-k path (the k-th largest found on the float32 logits, softmax and top-p on the
    survivors alone) returns bitwise what the dense computation over the whole row returns,
    ties at the k-th value included; and it fails when the k-th is taken one place off."""
    from uag.decoding.sampling import _dense_probs

    gen = torch.Generator().manual_seed(int(temperature * 10 + top_p * 1000))
    logits = (torch.randn(3, 50_000, generator=gen) * 4).float()
    logits[1, :40] = logits[1, 0]  # a tie straddling the k-th place
    logits[2] = (logits[2] * 8).round() / 8  # many ties everywhere
    for k in (1, 20, 64, 300):
        cfg = SamplingConfig(temperature=temperature, top_p=top_p, top_k=k)
        fast, dense = processed_probs(logits, cfg), _dense_probs(logits, cfg)
        assert torch.equal(fast, dense), (k, (fast - dense).abs().max())
    # the comparison can fail: one more survivor changes every kept probability (no top-p cut)
    wrong = _dense_probs(logits, SamplingConfig(temperature=temperature, top_k=65))
    assert not torch.equal(processed_probs(logits, SamplingConfig(temperature, top_k=64)), wrong)


@pytest.mark.parametrize(
    "side", ["nfc-target", pytest.param("nfc-assistant", marks=pytest.mark.slow)]
)
def test_speculative_sampling_through_a_normalising_side_matches_the_target(side):
    """A target (or an assistant) whose tokenizer normalises to NFC, as Qwen2's does, the other
    side plain (toy byte-level BPE vocabularies that spell decomposed and composed accents,
    Hangul jamo and ligatures), a prompt out of normal form: drafts cross the bridge in the
    target's normal form, and the first three tokens still follow the target's exact joint."""
    from tokenizers import normalizers

    from tests.test_normalising import NOT_NORMAL, _tokenizer

    nfc, plain = _tokenizer(normalizers.NFC()), _tokenizer(vocab=290)
    pair = toy_pair(
        ascii_only=False, tokenizers=(nfc, plain) if side == "nfc-target" else (plain, nfc)
    )
    normalising = pair.bridge.target if side == "nfc-target" else pair.bridge.assistant
    assert normalising.normalise.forms == ("NFC",)
    prompt = NOT_NORMAL["mixed"]
    prompt_t, prompt_a = encode_prompt(pair, prompt)
    expected = _exact_three(pair, prompt_t, TOY_SAMPLING)
    n = 6000
    counts, drafted, accepted, _, _ = _run_many(pair, prompt_t, prompt_a, TOY_SAMPLING, range(n))
    assert drafted >= n and n // 10 < accepted < drafted  # acceptances and rejections
    assert _fits(counts, expected, n) > P_MIN
