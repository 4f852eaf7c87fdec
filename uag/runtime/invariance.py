"""Does a position's result depend on how many positions share its forward? Checked at load.

Why: greedy verification equals target-alone decoding bitwise only if the target computes each
verified position exactly as a one-row decode step would. uag's native kernels do so by
construction (integer products, rows computed alone). Every other path (``--kernels plain``,
``onednn``, any GPU, bf16/fp16) runs library kernels whose rounding can change with the row
count: a GPU's one-row GEMV against its GEMM, a split reduction, a vectorised activation whose
scalar tail falls on other elements (oneDNN's GELU on widths that are not a multiple of 32
differs by ~1.5e-7), bf16's rounding of every product. Checking the linears alone misses most
of these, so this module checks the whole forward, on the model's own shapes, at load:

1. prefill a probe of ``PROBE_PREFILL`` pseudo-random ids (the path every prompt takes), then
   decode ``ROWWISE_MAX_ROWS`` more one row at a time, keeping each row's hidden state and
   logits (what target-alone computes);
2. roll back and feed the same ids as verifies of ``ROW_COUNTS`` rows; every row's hidden
   state, greedy logits and sampling logits must equal the one-row ones *bitwise*.

It runs first as is; where that fails and the model has a lean body, again with every short
forward padded to one shape (``CachedLM.set_pad_rows``: a GPU's GEMM then never turns into a
GEMV, a vector tail always falls on the same padding). A path that passes either way is
``row_invariant`` (the verifier trusts its rows); one that fails both keeps the near-tie guard
(``uag.decoding.verifiers``). Where the rounding does not depend on the values (kernel choice,
split, tail) random ids expose it; the check cannot prove a kernel that changes its algorithm
with the values, which is why the guard stays wherever it fails and docs/lossless.md states the
guarantee per path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from uag.kernels.choice import ROWWISE_MAX_ROWS

PROBE_PREFILL = 24
"""Prompt rows of the probe: more than ``ROWWISE_MAX_ROWS``, so the prefill takes the long
forward a real prompt takes."""
ROW_COUNTS = (1, 2, 7, ROWWISE_MAX_ROWS)
"""Verify sizes compared with the one-row steps: ``ROWWISE_MAX_ROWS`` puts a row in every slot."""


@dataclass(frozen=True)
class Invariance:
    """The check's verdict for one model on one path."""

    invariant: bool
    """Every compared row was bitwise equal."""
    padded: bool
    """Short forwards run padded to ``ROWWISE_MAX_ROWS`` rows (set on the model)."""
    detail: str
    """The first difference found, or how it passed (for ``--verbose`` and reports)."""


def settle(lm: Any) -> Invariance:
    """Check ``lm`` (a ``uag.runtime.runner.CachedLM``) as is, then padded where it has a lean
    body; leave it in the first configuration that passes (padding off if none does) and set
    ``lm.row_invariant``."""
    lm.set_pad_rows(0)
    first = compare_rows(lm)
    if first is None:
        lm.row_invariant = True
        return Invariance(invariant=True, padded=False, detail="rows equal unpadded")
    if lm.lean is not None:
        lm.set_pad_rows(ROWWISE_MAX_ROWS)
        padded = compare_rows(lm)
        if padded is None:
            lm.row_invariant = True
            return Invariance(
                invariant=True,
                padded=True,
                detail=f"unpadded: {first}; rows equal padded to {ROWWISE_MAX_ROWS}",
            )
        lm.set_pad_rows(0)
        first = f"{first}; padded: {padded}"
    lm.row_invariant = False
    return Invariance(invariant=False, padded=False, detail=first)


@torch.inference_mode()
def compare_rows(lm: Any) -> str | None:
    """None when every verify row equals its one-row step bitwise (hidden state, greedy logits,
    sampling logits), else where the first difference is. Leaves ``lm`` reset (no sequence)."""
    gen = torch.Generator().manual_seed(0)
    total = PROBE_PREFILL + ROWWISE_MAX_ROWS
    probe = torch.randint(0, lm.vocab_size, (total,), generator=gen).tolist()
    lm.reset(probe[:PROBE_PREFILL], rollback=True)
    lm.forward()
    alone: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for token in probe[PROBE_PREFILL:]:
        lm.ids.append(token)
        alone.append(_row_results(lm, lm.forward()[-1:]))
    try:
        for rows in ROW_COUNTS:
            lm.truncate(PROBE_PREFILL)
            lm.ids.extend(probe[PROBE_PREFILL : PROBE_PREFILL + rows])
            hidden = lm.forward()
            together = _row_results(lm, hidden)
            for row in range(rows):
                for name, mine, ref in zip(
                    ("hidden state", "greedy logits", "sampling logits"),
                    (t[row] for t in together),
                    alone[row],
                    strict=True,
                ):
                    if not torch.equal(mine, ref[0]):
                        diff = float((mine.float() - ref[0].float()).abs().max())
                        return f"{name} of row {row} of {rows} differs by {diff:.3g}"
        return None
    finally:
        lm.reset([], rollback=False)


def _row_results(lm: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What verification reads of a forward's rows: hidden states, greedy and sampling logits."""
    return hidden.clone(), lm.greedy(hidden).logits.clone(), lm.full_logits(hidden).clone()
