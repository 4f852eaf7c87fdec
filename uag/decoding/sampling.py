"""Lossless speculative *sampling* across tokenizers: token-level intersection (TLI).

Why this algorithm (Timor et al., ICML 2025, arXiv 2502.05202): classic speculative sampling
needs the drafter's distribution ``q`` over the *target's* vocabulary, so that each drafted
token can be accepted with probability ``min(1, p/q)`` and a rejection resampled from the
normalised residual ``max(p − q, 0)``. Across tokenizers that is well defined for the tokens
both vocabularies share: an assistant token whose decoded bytes are exactly one target token's
bytes. The assistant drafts from its own (processed) distribution restricted to those tokens,
so ``q`` lives on the target vocabulary and the standard proof applies unchanged: every emitted
token is distributed exactly as the target's own processed distribution, whatever the assistant
and the lookahead.

The intersection is built from the bridge's byte tables, never from vocabulary key strings
(SmolLM2's ``Ċ`` and Gemma's ``<0x0A>`` are both the byte ``\\n``; Transformers' string matching
maps them wrongly). Special tokens are left out on both sides: their literal text is not what
they mean.

Processing (``SamplingConfig``): temperature, then top-k, then top-p, as Transformers orders its
warpers; target-alone sampling (``speculative.target_alone``) and verification use the same
``processed_probs`` on the same logits (``CachedLM.full_logits``), so "the target's
distribution" is one definition, not two.

Randomness (``SamplingConfig.streams``): a *position's own sample* of the target's distribution
(target-alone sampling, a plain step, the bonus token, and the check of a copied candidate)
inverts the CDF at a uniform keyed by the seed and the token's position (``PositionDraws``), not
at the next draw of a stream. A copied candidate is then accepted exactly when it equals that
sample, and a rejection emits the sample: the same law as ``min(1, p/q)`` with a point-mass ``q``
(accept with ``p(token)``, else ``p`` without it), but a run whose rounds are copies and steps
emits token for token what target-alone sampling emits with the same seed. Every such run is a
checkable identity, and a benchmark compares arms on the same text. The assistant's drafts
keep the stream (``torch.Generator``) and the TLI rule.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from uag.decoding.bridge import Bridge
from uag.errors import UagError

NUCLEUS_RATIOS = (1e-3, 1e-6)
"""Top-p first sorts only the tokens at least this share of the most probable one's mass (a
few dozen on real text; one comparison pass, where ``topk`` over Gemma's 262,144 entries took
~2.5 ms for the 4,096 it used to take, and a full sort ~18 ms): the nucleus lies among them
whenever their mass reaches top-p, else the next ratio is tried, then everything."""


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's logits become the distribution to sample from."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    """Seeds the run's random stream (None: a fresh random seed)."""

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise UagError(f"temperature must be > 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise UagError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 1):
            raise UagError(f"top-k must be >= 1, got {self.top_k}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise UagError(f"seed must be an integer, got {self.seed!r}")

    def streams(self) -> tuple[torch.Generator, PositionDraws]:
        """The run's randomness from one seed (None: a fresh random one): the stream the
        assistant's drafts and the TLI rule draw from, and each position's own uniform."""
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        return torch.Generator().manual_seed(seed), PositionDraws(seed)


@dataclass(frozen=True)
class PositionDraws:
    """The uniform that target position ``t``'s own sample inverts the CDF at: a hash of
    (seed, ``t``), so it is the same whichever arm reaches ``t`` and however many draws the
    rounds before took (module docstring). Each position is decided once, so its uniform is
    used once and is independent of every earlier token and of the drafts."""

    seed: int

    def __call__(self, position: int) -> float:
        digest = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest()
        return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def uniform(gen: torch.Generator) -> float:
    """The stream's next uniform in [0, 1)."""
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def processed_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """``logits [n, V]`` → probabilities ``[n, V]`` (float64) after temperature, top-k, top-p.

    Top-k keeps every token at least as likely as the k-th (ties included), and top-p the
    smallest most-probable set whose mass reaches ``top_p`` (Transformers' rules: drop tokens
    whose ascending cumulative mass is ≤ 1 − top_p; the most probable always stays).

    With top-k, only the survivors are touched after one pass over the row: the k-th largest is
    found on the logits as given (dividing by the temperature in float64 keeps distinct float32
    values distinct and in order, so the same tokens survive), and the survivors' softmax and
    top-p cut are the dense computation's on the same values in the same order, so the result is
    bitwise the dense one's (``tests/test_sampling.py``), at ~a third of its time on Gemma's
    262,144 entries (a boolean-mask write over the whole row cost most of ~2 ms a row).
    """
    n, vocab = logits.shape
    if cfg.top_k is None or cfg.top_k >= vocab or cfg.temperature < _SMALLEST_TEMPERATURE:
        return _dense_probs(logits, cfg)
    kth = torch.topk(logits, cfg.top_k, dim=-1).values[:, -1]
    out = torch.zeros(n, vocab, dtype=torch.float64)
    for row in range(n):
        ids = (logits[row] >= kth[row]).nonzero()[:, 0]
        values = torch.softmax(logits[row, ids].double() / cfg.temperature, dim=-1)
        if cfg.top_p < 1.0:
            cut = _sparse_nucleus(ids, values, cfg.top_p)
            if cut is None:  # the nucleus needs every entry: the dense rule, zeros and all
                dense = torch.zeros(vocab, dtype=torch.float64)
                dense[ids] = values
                out[row] = _nucleus(dense, cfg.top_p)
                continue
            ids, values = cut
        out[row, ids] = values
    return out


_SMALLEST_TEMPERATURE = 1e-30
"""Below it a logit divided by the temperature may overflow float64 (equal infinities would tie
tokens that differ as float32): the dense path, which computes that tie as it is."""


def _dense_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    x = logits.double() / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        probs = torch.zeros_like(x)
        for row in range(x.shape[0]):  # softmax over the few survivors only
            keep = x[row] >= kth[row]
            probs[row, keep] = torch.softmax(x[row, keep], dim=-1)
    else:
        probs = torch.softmax(x, dim=-1)
    if cfg.top_p < 1.0:
        probs = torch.stack([_nucleus(row, cfg.top_p) for row in probs])
    return probs


def categorical(probs: torch.Tensor, u: float) -> int:
    """The draw from ``probs`` (``[V]``, summing to ~1) at uniform ``u``: inverse CDF over the
    support.

    ``torch.multinomial`` took ~9 ms on a 262k-entry float64 vector; this takes ~0.4 ms. The
    cumulative sum runs over every entry: adding a zero changes no partial sum, so the first
    entry whose sum exceeds ``u`` always has mass (a zero repeats the sum before it), and the
    draw is the one a sum over the support alone gives (it needed a ``nonzero`` pass).
    """
    cdf = probs.cumsum(0)
    at = torch.tensor([u], dtype=cdf.dtype) * cdf[-1]
    pick = int(torch.searchsorted(cdf, at, right=True))
    if pick >= probs.numel():  # u rounded up to the total: the last entry with mass
        pick = int(probs.nonzero()[-1])
    return pick


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """One row's top-p cut, renormalised.

    Only tokens at least ``ratio`` times the most probable one's mass are sorted, for the first
    ratio whose tokens hold at least ``top_p`` (``NUCLEUS_RATIOS``, then all): every other token
    comes after them in descending order, so the mass before it is already ≥ top-p and the rule
    drops it. Ties sort by id (stable), as any fixed order keeps the distribution exact.
    """
    top = float(probs.max())
    for ratio in NUCLEUS_RATIOS:
        ids = (probs >= top * ratio).nonzero()[:, 0]
        mass = probs[ids]
        if float(mass.sum()) >= top_p + 1e-9:  # margin: the cumulative sums' rounding
            break
    else:  # none of them holds the nucleus: every token
        ids, mass = torch.arange(probs.numel()), probs
    values, order = torch.sort(mass, descending=True, stable=True)
    ids = ids[order]
    # Descending cumulative mass *before* each token < top_p ⇔ ascending mass after it > 1 − p.
    before = torch.cumsum(values, dim=0) - values
    keep = before < top_p
    keep[0] = True
    out = torch.zeros_like(probs)
    out[ids[keep]] = values[keep] / values[keep].sum()
    return out


def _sparse_nucleus(
    ids: torch.Tensor, values: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``_nucleus`` on a row whose only nonzero entries are ``values`` at ascending ``ids``:
    (kept ids, renormalised mass), the entries ``_nucleus`` writes, computed on the same values
    in the same order; None where ``_nucleus`` would need every entry of the row."""
    top = float(values.max())
    for ratio in NUCLEUS_RATIOS:
        pick = values >= top * ratio
        mass = values[pick]
        if float(mass.sum()) >= top_p + 1e-9:
            break
    else:
        return None
    sorted_mass, order = torch.sort(mass, descending=True, stable=True)
    kept_ids = ids[pick][order]
    before = torch.cumsum(sorted_mass, dim=0) - sorted_mass
    keep = before < top_p
    keep[0] = True
    return kept_ids[keep], sorted_mass[keep] / sorted_mass[keep].sum()


@dataclass
class Intersection:
    """Assistant ids whose bytes are exactly one (non-special) target token's bytes."""

    to_target: torch.Tensor
    """``[Va]`` long: the target id each assistant id stands for, or −1."""
    size: int
    _sources: dict[int, tuple[int, ...]] | None = field(default=None, repr=False)
    _spelled: dict[bytes, int] = field(default_factory=dict, repr=False)
    """Bytes → the (canonical, non-special) target id spelling them."""
    _pieces: list[bytes] = field(default_factory=list, repr=False)
    """The assistant's bytes per id (b"" for special ids)."""
    _healed: dict[bytes, Intersection] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls, bridge: Bridge, *, target_special: set[int], assistant_special: set[int]
    ) -> Intersection:
        """Map every assistant id whose bytes some target id spells exactly.

        Where several target ids spell the same bytes (Gemma: ``\\n`` and its byte-fallback
        ``<0x0A>``), the one the target's tokenizer itself produces for that text stands for
        it; any fixed choice keeps sampling exact (``q`` is then simply a distribution over
        target ids), this one keeps the target's context canonical.
        """
        owners: dict[bytes, list[int]] = {}
        for tid, data in enumerate(bridge.target.table):
            if data and tid not in target_special:
                owners.setdefault(data, []).append(tid)
        chosen = {data: ids[0] for data, ids in owners.items()}
        for data, ids in owners.items():
            if len(ids) > 1:
                chosen[data] = _canonical(bridge, data, ids)
        pieces = [
            b"" if aid in assistant_special else data
            for aid, data in enumerate(bridge.assistant.table)
        ]
        to_target = torch.tensor(
            [chosen.get(data, -1) if data else -1 for data in pieces], dtype=torch.long
        )
        return cls(
            to_target=to_target,
            size=int((to_target >= 0).sum()),
            _spelled=chosen,
            _pieces=pieces,
        )

    def healed(self, spell: bytes) -> Intersection:
        """The intersection for a draft that must first spell ``spell`` again (token healing,
        ``uag.decoding.assistant_text.AssistantText.sync``): an assistant id stands for the target id
        spelling what follows ``spell`` in its bytes, when that is exactly one target token.

        Why: the healed assistant drafts ``·return`` where the target's text already ends in
        the space, so the draft proposes ``return``. ``q`` is then the assistant's distribution
        restricted to those ids, a distribution over target ids like any other, and the
        acceptance rule stays exact. Cached per ``spell`` (a space, a tab, a few newlines)."""
        if spell not in self._healed:
            n = len(spell)
            mapping = [
                self._spelled.get(data[n:], -1) if len(data) > n and data.startswith(spell) else -1
                for data in self._pieces
            ]
            to_target = torch.tensor(mapping, dtype=torch.long)
            self._healed[spell] = Intersection(
                to_target=to_target, size=int((to_target >= 0).sum())
            )
        return self._healed[spell]

    def can_heal(self, spell: bytes) -> bool:
        """Whether some assistant id spells ``spell`` and then exactly one target token (a
        newline is healed whole, e.g. ``:\n``, which few ids or none spell that way)."""
        return self.healed(spell).size > 0

    def restrict(self, probs: torch.Tensor) -> torch.Tensor | None:
        """The assistant's distribution restricted to the intersection, renormalised (None: no
        mass there, nothing can be drafted)."""
        q = probs.masked_fill(self.to_target < 0, 0.0)
        total = float(q.sum())
        return q / total if total > 0 else None

    def on_target(self, q_assistant: torch.Tensor, target_vocab: int) -> torch.Tensor:
        """``q`` as a distribution over target ids (assistant ids sharing bytes add up, in
        ascending assistant id, as ``mass_at`` adds them: the same value for every id)."""
        out = torch.zeros(target_vocab, dtype=q_assistant.dtype)
        keep = self.to_target >= 0
        out.index_add_(0, self.to_target[keep], q_assistant[keep])
        for tid in self.shared():
            out[tid] = self.mass_at(q_assistant, tid)
        return out

    def mass_at(self, q_assistant: torch.Tensor, target_id: int) -> float:
        """``on_target(q_assistant)[target_id]`` without building the vector (~5 µs, not
        ~0.45 ms): what acceptance needs of a drafted position."""
        total = 0.0
        for aid in self.sources().get(target_id, ()):
            total += float(q_assistant[aid])
        return total

    def sources(self) -> dict[int, tuple[int, ...]]:
        """Target id → the assistant ids standing for it, ascending (built on first use)."""
        if self._sources is None:
            found: dict[int, list[int]] = {}
            for aid, tid in enumerate(self.to_target.tolist()):
                if tid >= 0:
                    found.setdefault(tid, []).append(aid)
            self._sources = {tid: tuple(aids) for tid, aids in found.items()}
        return self._sources

    def shared(self) -> list[int]:
        """Target ids several assistant ids stand for."""
        return [tid for tid, aids in self.sources().items() if len(aids) > 1]


class TargetQ:
    """One drafted position's ``q`` over target ids, from the assistant's restricted
    distribution: the drafted token's mass is all acceptance needs; the whole vector (a
    rejection's residual, soft labels) is built on first use."""

    def __init__(self, q_assistant: torch.Tensor, intersection: Intersection, vocab: int) -> None:
        self.q_assistant, self.intersection, self.vocab = q_assistant, intersection, vocab
        self._dense: torch.Tensor | None = None

    def at(self, target_id: int) -> float:
        return self.intersection.mass_at(self.q_assistant, target_id)

    def dense(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = self.intersection.on_target(self.q_assistant, self.vocab)
        return self._dense


class PointQ(TargetQ):
    """``q`` of a token proposed with certainty (prompt lookup copies it): all mass on it, so
    it is accepted with probability ``p(token)`` and a rejection samples ``p`` without it."""

    def __init__(self, token: int, vocab: int) -> None:
        self.token, self.vocab = token, vocab
        self._dense = None

    def at(self, target_id: int) -> float:
        return 1.0 if target_id == self.token else 0.0

    def dense(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = torch.zeros(self.vocab)
            self._dense[self.token] = 1.0
        return self._dense


def _mass(q: torch.Tensor | TargetQ, token: int) -> float:
    return q.at(token) if isinstance(q, TargetQ) else float(q[token])


def _dense(q: torch.Tensor | TargetQ) -> torch.Tensor:
    return q.dense() if isinstance(q, TargetQ) else q


def _canonical(bridge: Bridge, data: bytes, ids: list[int]) -> int:
    """Of target ids spelling the same ``data``, the one the target tokenizer encodes it to."""
    try:
        encoded = bridge.target.encode(data.decode("utf-8"))
    except UnicodeDecodeError:  # part of a character: no encoding to ask
        return ids[0]
    return encoded[0] if len(encoded) == 1 and encoded[0] in ids else ids[0]


def special_ids(tokenizer: object) -> set[int]:
    """Every special or added-special id of a tokenizer (their bytes are not their meaning)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids |= {i for i, tok in decoder.items() if getattr(tok, "special", False)}
    return ids


def verify_draft(
    *,
    draft: Sequence[int],
    q_rows: Sequence[torch.Tensor | TargetQ],
    p_row: Callable[[int], torch.Tensor],
    gen: torch.Generator,
    own: Callable[[int], float],
) -> tuple[list[int], int]:
    """Speculative sampling's accept/resample rule: ``(emitted target ids, accepted count)``.

    ``draft[i]`` was sampled from ``q_rows[i]`` (over the target vocabulary); ``p_row(i)`` is the
    target's processed distribution after the first ``i`` draft tokens (only the rows reached
    are asked for); ``own(i)`` is row ``i``'s position uniform (``PositionDraws``). An assistant's
    draft token i is kept with probability ``min(1, p/q)`` (a ``gen`` coin); the first rejection
    emits a sample of ``max(p − q, 0)`` normalised. A copied token (``PointQ``) is kept when it
    equals the row's own sample of ``p`` and else that sample is emitted: the same law as
    ``min(1, p/q)`` with all of ``q`` on it. A fully accepted draft emits the next row's own
    sample of ``p``. Each emitted token is then distributed exactly as ``p`` (Leviathan et al.,
    2023).
    """
    for i, tok in enumerate(draft):
        p, q = p_row(i), q_rows[i]
        if isinstance(q, PointQ):
            mine = categorical(p, own(i))
            if mine == tok:
                continue
            return [*draft[:i], mine], i
        ratio = float(p[tok]) / _mass(q, tok)
        if ratio >= 1.0 or uniform(gen) < ratio:
            continue
        residual = (p - _dense(q)).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p ≤ q everywhere yet p[tok] < q[tok]: only rounding
            residual = p
        fix = categorical(residual, uniform(gen))
        return [*draft[:i], fix], i
    bonus = categorical(p_row(len(draft)), own(len(draft)))
    return [*draft, bonus], len(draft)


def expected_acceptance(
    draft: Sequence[int],
    q_rows: Sequence[torch.Tensor | TargetQ],
    p_row: Callable[[int], torch.Tensor],
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Soft labels of a verified draft: ``(prefix, rates)`` per draft position i.

    ``prefix[i]`` = ∏_{j ≤ i} min(1, p_j(t_j) / q_j(t_j)): the probability, given the drafted
    tokens t, that drafts 0..i are all accepted. It is the exact expectation of the sampled
    label ("draft i lies inside the accepted prefix") given everything the controller saw, so
    training on it keeps the label's mean and drops the acceptance coin flips' variance.
    ``rates[i]`` = Σ_x min(p_i(x), q_i(x)): position i's acceptance probability before its token
    was drawn (the TLI paper's acceptance rate), logged beside it.
    """
    prefix, rates, survive = [], [], 1.0
    for i, (tok, q) in enumerate(zip(draft, q_rows, strict=True)):
        p = p_row(i)
        survive *= min(1.0, float(p[tok]) / _mass(q, tok))
        prefix.append(survive)
        rates.append(min(float(torch.minimum(p, _dense(q)).sum()), 1.0))
    return tuple(prefix), tuple(rates)


class ProcessedRows:
    """Row i of the target's processed distribution, computed the first time it is asked for
    (verification stops at the first rejection)."""

    def __init__(self, logits: torch.Tensor, sampling: SamplingConfig) -> None:
        self.logits, self.sampling = logits, sampling
        self.done: dict[int, torch.Tensor] = {}

    def __call__(self, i: int) -> torch.Tensor:
        if i not in self.done:
            self.done[i] = processed_probs(self.logits[i : i + 1], self.sampling)[0]
        return self.done[i]
