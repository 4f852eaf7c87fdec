"""The draft vocabulary: the assistant drafts from its most common ids only.

Why: every draft step multiplies the last hidden state by the assistant's whole head and takes a
softmax over it (SmolLM2: 49,152 × 576; on a 2-core CPU ~2.1 ms of a ~10 ms int8 draft step),
yet a draft only has to be *likely* right: the target verifies every drafted token, so a token
the assistant cannot propose costs acceptance, never correctness. BPE and SentencePiece
vocabularies number their tokens roughly by frequency (merge order, piece score), so a prefix of
the ids holds most of what text needs: SmolLM2's ids below 16,384 cover ~95 % of the default
target's outputs re-tokenised, and its head over them costs 0.9 ms instead of 2.1. FR-Spec
(2025) ranks a vocabulary by corpus counts instead; the id order needs no corpus and makes the
draft head a view of the full one (no copy, no index map).

Greedy drafting only: speculative sampling drafts from the assistant's whole distribution over
the vocabulary intersection (``uag.decoding.sampling``), and its acceptance test needs exactly that.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from uag.errors import UagError
from uag.kernels.native import NativeLinear

DEFAULT_DRAFT_VOCAB = 16384
"""The draft vocabulary where none is asked for and the head can be cut (``draft_head``)."""
GRANULE = 64
"""Sizes round up to a multiple of this (the native kernels' blocks of outputs divide it)."""


class PrefixLinear(nn.Module):
    """A linear layer's first ``rows`` outputs, as views of its weight and bias (any device)."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        super().__init__()
        self.weight = linear.weight[:rows]
        self.bias = None if linear.bias is None else linear.bias[:rows]
        self.out_features, self.in_features = rows, linear.in_features

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


def check_size(requested: int | None) -> None:
    """Refuse a size that cannot mean anything (None: the default)."""
    if requested is not None and requested < 0:
        raise UagError(f"--draft-vocab must be 0 (every id) or a positive size, got {requested}")


def draft_head(
    head: nn.Module, requested: int | None, *, vocab: int
) -> tuple[nn.Module | None, int]:
    """``(head over the first N ids, N)``, or ``(None, 0)`` for the whole vocabulary.

    ``requested`` None: ``DEFAULT_DRAFT_VOCAB`` where ``head`` can be cut, else the whole
    vocabulary; 0: the whole vocabulary; N: the first N ids rounded up to ``GRANULE`` (an error
    where ``head`` is a kind that cannot be cut: oneDNN's packed weight, fbgemm or int8pack).
    """
    check_size(requested)
    size = DEFAULT_DRAFT_VOCAB if requested is None else requested
    size = -(-size // GRANULE) * GRANULE
    if size == 0 or size >= vocab:
        return None, 0
    if isinstance(head, NativeLinear):
        return head.prefix(size), size
    if type(head) is nn.Linear:
        return PrefixLinear(head, size), size
    if requested is None:
        return None, 0  # the default only applies where it is free to build
    raise UagError(
        f"--draft-vocab: the assistant's head ({type(head).__name__}) cannot be cut; "
        "use --draft-vocab 0 or --kernels native"
    )
