"""A causal LM plus its KV cache over a growing list of token ids.

``CachedLM`` keeps ``ids`` (everything the model has been given) and ``cached`` (how many of them
are in the KV cache). ``forward()`` feeds the uncached tail in one call and returns its last hidden
states; ``truncate(keep)`` rolls both back. The heads are separate so each caller pays only for what
it needs: the target needs an argmax per position, the assistant a full distribution for one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

HEAD_CHUNK = 2048
"""Vocabulary entries per matrix product when several positions share the head pass."""
HEAD_GROUP = 3
"""Positions per matrix product in the CPU greedy head (see ``GreedyHead``)."""


class CachedLM:
    """One model's running sequence: ids, KV cache, and the two heads."""

    def __init__(self, model: Any, *, greedy_head: bool = False) -> None:
        from transformers import DynamicCache

        self.model = model
        self._cache_cls = DynamicCache
        self.body = model.base_model
        self.head = model.get_output_embeddings()
        self.softcap: float | None = getattr(model.config, "final_logit_softcapping", None)
        weight = self.head.weight
        weight = weight() if callable(weight) else weight  # int8-quantised Linear: a method
        self.device = weight.device
        self.vocab_size = int(weight.shape[0])
        self._greedy = GreedyHead(weight, self.head.bias) if greedy_head else None
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
        if self.cached == 0:
            return  # nothing fed yet (Transformers 5.24 crashes cropping an empty sliding layer)
        drop = max(self.cached - keep, 0)
        self.cache.crop(-drop)
        self.cached -= drop

    @torch.inference_mode()
    def greedy(self, hidden: torch.Tensor) -> HeadOutput:
        """Argmax token after each row of ``hidden`` ``[n, hidden]`` (statistics on demand)."""
        if self._greedy is None:
            logits = self.logits(hidden)
            return HeadOutput(logits.argmax(dim=-1).tolist(), [logits])
        return self._greedy(hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full float32 logits for the rows of ``hidden`` (with Gemma-style soft-capping)."""
        out = self.head(hidden).float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


class GreedyHead:
    """Argmax of the LM head per position, without materialising what greedy decoding ignores.

    Why: Gemma's 262,144 × 640 head is more than half of a CPU step, and on this CPU MKL's
    ``F.linear`` with the row-major weight costs ~60 ms for one position and almost a full pass
    more per extra position. The same product against the transposed weight ([hidden, vocab]) runs
    at memory speed (~35 ms) for 1–3 positions but falls off a cliff at 4 and 8, so positions go
    in groups of at most ``HEAD_GROUP``.
    Soft-capping is monotonic and cannot move the argmax, so it is skipped. Target-alone decoding
    and verification both use this head, so they see the same numbers.
    On CUDA a plain ``F.linear`` + argmax is already bandwidth-bound and is used as is.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        # A transposed copy (+1x head memory) only where it pays: the CPU path.
        self.weight_t = weight.detach().T.contiguous() if weight.device.type == "cpu" else None

    def __call__(self, hidden: torch.Tensor) -> HeadOutput:
        """``hidden``: [n, h] → argmax ids [n], keeping the logits for ``HeadOutput.stats``."""
        if self.weight_t is None:
            logits = torch.nn.functional.linear(hidden, self.weight, self.bias)
            return HeadOutput(logits.argmax(dim=-1).tolist(), [logits])
        hidden = hidden.to(self.weight_t.dtype)
        groups = [
            self._group(hidden[i : i + HEAD_GROUP]) for i in range(0, hidden.shape[0], HEAD_GROUP)
        ]
        return HeadOutput([t for ids, _ in groups for t in ids], [blocks for _, blocks in groups])

    def _group(self, x: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Argmax ids of up to ``HEAD_GROUP`` rows and their logits ``[g, V]``."""
        wt = self.weight_t
        assert wt is not None
        if x.shape[0] == 1:  # one position: a plain vector-matrix product is the fastest path
            logits = torch.mm(x, wt)
            if self.bias is not None:
                logits += self.bias
            return logits.argmax(dim=-1).tolist(), logits
        vals, idxs, blocks = [], [], []
        for start in range(0, wt.shape[1], HEAD_CHUNK):
            block = torch.mm(x, wt[:, start : start + HEAD_CHUNK])  # [g, C]
            if self.bias is not None:
                block += self.bias[start : start + HEAD_CHUNK]
            v, i = block.max(dim=-1)  # first maximum within the chunk
            vals.append(v)
            idxs.append(i + start)
            blocks.append(block)
        vals_t, idxs_t = torch.stack(vals, dim=1), torch.stack(idxs, dim=1)  # [g, chunks]
        # argmax takes the first chunk holding the maximum: ties go to the lowest id, as a plain
        # argmax over the whole row does.
        ids = idxs_t.gather(1, vals_t.argmax(dim=1, keepdim=True))[:, 0].tolist()
        return ids, torch.cat(blocks, dim=1)


@dataclass
class HeadOutput:
    """Greedy head result: argmax id per position, and the logits to derive statistics from."""

    ids: list[int]
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    """Logits in groups of rows (``[g, V]`` each), in position order."""

    def stats(self, row: int) -> tuple[float, float]:
        """Probability of the argmax token at ``row`` and the entropy (nats) of that distribution.

        Computed for one row on demand (about a millisecond), since only the row of the last
        emitted token is ever needed and which row that is depends on verification.
        """
        offset = 0
        for group in self.logits:
            if row < offset + group.shape[0]:
                logp = torch.log_softmax(group[row - offset].float(), dim=-1)
                return float(logp.max().exp()), float(-(logp.exp() * logp).sum())
            offset += group.shape[0]
        raise IndexError(row)
