"""A causal LM plus its KV cache over a growing list of token ids.

``CachedLM`` keeps ``ids`` (everything the model has been given) and ``cached`` (how many of them
are in the KV cache). ``forward()`` feeds the uncached tail in one call and returns its last hidden
states; ``truncate(keep)`` rolls both back. The heads are separate so each caller pays only for what
it needs: the target needs an argmax per position, the assistant a full distribution for one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

HEAD_CHUNK_ROWS = 16384
"""Vocabulary rows per chunk of the streamed greedy head (see ``greedy_argmax``)."""


class CachedLM:
    """One model's running sequence: ids, KV cache, and the two heads."""

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        self.model = model
        self._cache_cls = DynamicCache
        self.body = model.base_model
        head = model.get_output_embeddings()
        self.head_weight: torch.Tensor = head.weight
        self.head_bias: torch.Tensor | None = getattr(head, "bias", None)
        self.softcap: float | None = getattr(model.config, "final_logit_softcapping", None)
        self.device = self.head_weight.device
        self.vocab_size = int(self.head_weight.shape[0])
        self.ids: list[int] = []
        self.cached = 0
        self.cache: Any = None

    def reset(self, ids: Sequence[int], *, rollback: bool) -> None:
        """Start a new sequence (a fresh cache; nothing fed yet).

        ``rollback=True`` when the caller will ``truncate``: sliding-window layers (Gemma 3) then
        keep states past the window until the next crop; without it, rolling back after ~512
        tokens fails. Plain decoding leaves it off so those layers stay bounded.
        """
        self.ids = list(ids)
        self.cached = 0
        self.cache = self._cache_cls(config=self.model.config)
        if rollback:
            self.cache.activate_past_recording()

    @torch.inference_mode()
    def forward(self) -> torch.Tensor:
        """Feed ``ids[cached:]`` and return their last hidden states ``[n, hidden]``."""
        new = self.ids[self.cached :]
        assert new, "forward() with nothing to feed"
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)  # [1, n]
        out = self.body(input_ids=input_ids, cache=self.cache, use_cache=True)
        self.cached = len(self.ids)
        return out.last_hidden_state[0]  # [n, hidden]

    def truncate(self, keep: int) -> None:
        """Keep the first ``keep`` ids; drop the rest from ``ids`` and from the cache.

        Always crops (possibly by zero): sliding-window layers recording the past shrink back to
        their window only on a crop.
        """
        del self.ids[keep:]
        drop = max(self.cached - keep, 0)
        self.cache.crop(-drop)
        self.cached -= drop

    @torch.inference_mode()
    def greedy(self, hidden: torch.Tensor) -> list[int]:
        """Argmax token after each row of ``hidden`` ``[n, hidden]``."""
        return greedy_argmax(hidden, self.head_weight, self.head_bias).tolist()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full float32 logits for the rows of ``hidden`` (with Gemma-style soft-capping)."""
        out = torch.nn.functional.linear(hidden, self.head_weight, self.head_bias).float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


def greedy_argmax(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Argmax of ``hidden @ weight.T (+ bias)`` per row, streaming ``weight`` in row chunks.

    Why: a 262k-row LM head dominates a Gemma step on CPU, and for 2+ rows ``F.linear`` on this
    skinny, huge matrix costs almost one full pass per row. Chunks of ``HEAD_CHUNK_ROWS`` rows stay
    in cache while all positions use them, so verifying k candidates costs about one head pass.
    Soft-capping is monotonic, so it cannot move the argmax and is skipped here. The same function
    serves target-alone decoding and verification, so both see identical numbers.
    """
    # hidden: [n, h], weight: [V, h]
    if hidden.device.type != "cpu":
        logits = torch.nn.functional.linear(hidden, weight, bias)
        return logits.argmax(dim=-1)
    xt = hidden.T.contiguous()  # [h, n]
    best_vals = []
    best_idx = []
    for start in range(0, weight.shape[0], HEAD_CHUNK_ROWS):
        block = torch.mm(weight[start : start + HEAD_CHUNK_ROWS], xt)  # [C, n]
        if bias is not None:
            block += bias[start : start + HEAD_CHUNK_ROWS, None]
        vals, idx = block.max(dim=0)  # [n]
        best_vals.append(vals)
        best_idx.append(idx + start)
    vals_t = torch.stack(best_vals)  # [chunks, n]
    idx_t = torch.stack(best_idx)
    # max() keeps the first maximum within a chunk and argmax the first chunk: ties go to the
    # lowest id, as torch.argmax over the full row does.
    winner = vals_t.argmax(dim=0, keepdim=True)  # [1, n]
    return idx_t.gather(0, winner)[0]
