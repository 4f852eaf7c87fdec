"""A causal LM plus its KV cache over a growing list of token ids.

``CachedLM`` keeps ``ids`` (everything the model has been given) and ``cached`` (how many of them
are in the KV cache). ``forward()`` feeds the uncached tail in one call and returns its last hidden
states; ``truncate(keep)`` rolls both back. The heads are separate so each caller pays only for what
it needs: the target needs an argmax per position, the assistant a full distribution for one.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np
import torch
from torch import nn

from uag.kernels import hugepages
from uag.kernels.choice import accelerate_target, is_row_invariant, swap_linears
from uag.kernels.native import NativeLinear, draft_stats
from uag.kernels.screened import ScreenedHead, calibrate
from uag.runtime import invariance
from uag.runtime.draft_vocab import draft_head
from uag.runtime.lean import LeanBody, lean_body_for


def streamed_slots(lean: Any, head: Any, fast_head: Any) -> list[tuple[Any, str]]:
    """The tensors a greedy step reads in full: the lean body's native layers, and the head's
    product (the screened head's, else a native head's), as (owner, attribute) slots for
    ``uag.kernels.hugepages``."""
    slots = lean.streamed() if lean is not None else []
    reader = getattr(fast_head if fast_head is not None else head, "streamed", None)
    return slots + (reader() if reader is not None else [])


class CachedLM:
    """One model's running sequence: ids, KV cache, and the two heads."""

    def __init__(
        self,
        model: Any,
        *,
        greedy_head: bool = False,
        fast_head: nn.Module | None = None,
        lean: bool = True,
    ) -> None:
        self.model = model
        """The Transformers model (None when built ``from_lean``)."""
        self.body = model.base_model
        self.lean: LeanBody | None = lean_body_for(model) if lean else None
        """The lean forward (``uag.runtime.lean``) where the architecture allows; else Transformers'."""
        self._setup(
            head=model.get_output_embeddings(),
            softcap=getattr(model.config, "final_logit_softcapping", None),
            device=next(model.parameters()).device,
            greedy_head=greedy_head,
            fast_head=fast_head,
        )

    @classmethod
    def from_lean(
        cls,
        lean: LeanBody,
        *,
        head: nn.Module,
        softcap: float | None,
        greedy_head: bool = False,
        fast_head: nn.Module | None = None,
    ) -> CachedLM:
        """A model that exists only as its lean forward and heads (``uag.runtime.prepared``): no
        Transformers object behind it."""
        self = cls.__new__(cls)
        self.model = self.body = None
        self.lean = lean
        self._setup(
            head=head,
            softcap=softcap,
            device=lean.device,
            greedy_head=greedy_head,
            fast_head=fast_head,
        )
        return self

    def _setup(
        self,
        *,
        head: nn.Module,
        softcap: float | None,
        device: torch.device,
        greedy_head: bool,
        fast_head: nn.Module | None,
    ) -> None:
        self.head = head
        """The LM head ``logits`` multiplies by (the model's own, or a native copy)."""
        self.softcap = softcap
        self.device = device
        self.vocab_size = int(head.out_features)  # type: ignore[arg-type]
        self._greedy = (
            GreedyHead(getattr(head, "weight", None), getattr(head, "bias", None), fast=fast_head)
            if greedy_head
            else None
        )
        self.row_invariant = False
        """A position's logits do not depend on how many positions share the forward (bitwise),
        for forwards of up to ``ROWWISE_MAX_ROWS`` rows; otherwise verification guards near-ties.
        By construction on the native kernels; checked at load elsewhere
        (``uag.runtime.invariance``)."""
        self.invariance: Any = None
        """``uag.runtime.invariance.Invariance``: how ``row_invariant`` was found at load (None:
        by construction, or never checked)."""
        self.pad_rows = 0
        """The heads (and a lean body's products) run forwards of fewer rows on this many
        (``set_pad_rows``); 0: off."""
        self.ids: list[int] = []
        self.cached = 0
        self.cache: Any = None
        self._full: nn.Module | None = None
        self.draft_head: nn.Module | None = None
        """``draft`` multiplies by this instead of ``head`` (``uag.runtime.draft_vocab``: the first
        ``draft_vocab`` ids), None: by ``head``."""
        self.draft_vocab = 0
        """The ids ``draft`` chooses from are ``0 .. draft_vocab - 1``; 0: every id."""
        self.in_huge_pages = False
        """``move_to_huge_pages`` ran (the weights are shared by ``twin``s: once is enough)."""
        self.moving: Any = None
        """A ``uag.kernels.hugepages.Move`` of ``streamed()`` under way (``uag.runtime.prepared`` starts one)."""

    def streamed(self) -> list[tuple[Any, str]]:
        """What every greedy step reads in full, as slots for ``uag.kernels.hugepages``."""
        return streamed_slots(self.lean, self.head, self._greedy.fast if self._greedy else None)

    def move_to_huge_pages(self) -> int:
        """Move ``streamed()`` into huge pages (``uag.kernels.hugepages``), or finish the move already
        under way (``moving``); once per model. Returns the bytes moved."""
        if self.in_huge_pages:
            return 0
        moved = (self.moving or hugepages.Move(self.streamed())).finish()
        self.in_huge_pages, self.moving = True, None
        if moved and self.lean is not None:
            self.lean.attach_native()  # its C structs point into the weights
        return moved

    def set_pad_rows(self, rows: int) -> None:
        """Run every forward of up to ``rows`` rows, and the heads over its rows, on ``rows``
        rows (``uag.runtime.lean.LeanBody.pad_rows``): one shape for every decode step and
        verify. A model without a lean body pads its heads only."""
        self.pad_rows = rows
        if self.lean is not None:
            self.lean.pad_rows = rows

    def _padded(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` with zero rows after it up to ``pad_rows`` (a head's rows are computed
        alone by shape: the extra rows change no real row's result, only the kernel's shape)."""
        n = int(hidden.shape[0])
        if 0 < n < self.pad_rows:
            return torch.cat([hidden, hidden.new_zeros(self.pad_rows - n, hidden.shape[1])])
        return hidden

    def twin(self) -> CachedLM:
        """Another sequence on the same model and heads, with its own ids and cache."""
        other = copy.copy(self)
        other.ids, other.cached, other.cache = [], 0, None
        other.slots = None if self.slots is None else []  # its own kept sequences
        return other

    def reset(self, ids: Sequence[int], *, rollback: bool) -> None:
        """Start a new sequence (a fresh cache, or a kept one's shared prefix: ``keep_prefixes``).

        ``rollback=True`` when the caller will ``truncate``: sliding-window layers (Gemma 3) then
        keep states past the window until the next crop; without it, rolling back after ~512
        tokens fails. Plain decoding leaves it off so those layers stay bounded.
        """
        if self.slots is not None and self._resume(ids):
            return
        self.ids = list(ids)
        self.cached = 0
        if self.lean is not None:
            self.cache = self.lean.new_cache()
            return
        # Transformers takes seconds to import; a lean body (every prepared model) never needs it.
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        if rollback:
            self.cache.activate_past_recording()

    slots: list[tuple[list[int], Any]] | None = None
    """Sequences kept for ``reset`` besides the current one (most recent first), each its ids
    and cache; None: every ``reset`` starts afresh (``keep_prefixes`` turns this on)."""
    max_kept = 0
    """Positions the kept caches may hold together (their capacity: what they take)."""

    def keep_prefixes(self, positions: int = 8192) -> bool:
        """From now on ``reset`` starts from whichever earlier sequence shares the longest
        prefix with the new ids (a multi-turn chat does not re-read its history, even with
        other conversations in between), keeping the most recent ones whose caches hold up to
        ``positions`` positions together (Qwen2.5 1.5B: ~57 KB a position, Gemma 3 270M ~36 KB,
        SmolLM2 in half floats ~23 KB); returns whether this model can. Exact by construction
        only where every row is computed on its own, whatever rows share its forward: a lean
        body whose forwards of any length run on the native layers
        (``LeanBody.prompts_native``); anywhere else the states a prefix got inside a longer
        forward may round differently from a fresh prefill's."""
        can = self.lean is not None and self.lean.prompts_native
        self.slots, self.max_kept = ([], positions) if can else (None, 0)
        return can

    def _evict(self) -> None:
        """Drop the least recently used kept sequences beyond ``max_kept`` positions."""
        kept = self.slots or []
        total = 0
        for i, (_, cache) in enumerate(kept):
            total += cache.capacity
            if total > self.max_kept:
                del kept[i:]
                return

    def _resume(self, ids: Sequence[int]) -> bool:
        """Start ``ids`` from the cached sequence sharing the longest prefix with it (the last id
        is always fed again: its forward gives the hidden state the next token needs): that
        sequence itself, cropped, where most of it is shared, else a copy of the shared part,
        so a sequence that shares only a system prompt survives for its own next turn. The
        least recently used beyond ``max_kept`` positions are dropped. False where none shares
        any position (the caller starts afresh)."""
        kept = self.slots
        assert kept is not None
        if self.cache is not None and self.cached:
            kept.insert(0, (self.ids[: self.cached], self.cache))
        self.cache, self.cached = None, 0
        limit = len(ids) - 1
        shared = [_shared(seq, ids, limit) for seq, _ in kept]
        best = max(range(len(kept)), key=shared.__getitem__, default=None)
        if best is None or not shared[best]:
            self._evict()
            return False
        seq, cache = kept[best]
        if 2 * shared[best] >= len(seq):  # mostly the same sequence, e.g. a chat's next turn
            kept.pop(best)
            self.ids, self.cache, self.cached = list(seq), cache, len(seq)
            self.truncate(shared[best])
        else:  # a little in common (a system prompt): copy it, keep that sequence whole
            self.cache, self.cached = cache.prefix(shared[best]), shared[best]
        self._evict()
        self.ids = list(ids)
        return True

    @torch.inference_mode()
    def forward(self) -> torch.Tensor:
        """Feed ``ids[cached:]`` and return their last hidden states ``[n, hidden]``."""
        new = self.ids[self.cached :]
        assert new, "forward() with nothing to feed"
        input_ids = torch.tensor(new, dtype=torch.long, device=self.device)  # [n]
        if self.lean is not None:
            hidden = self.lean(input_ids, self.cache)
        else:
            out = self.body(input_ids=input_ids[None], cache=self.cache, use_cache=True)
            hidden = out.last_hidden_state[0]
        self.cached = len(self.ids)
        return hidden  # [n, hidden]

    def truncate(self, keep: int) -> None:
        """Keep the first ``keep`` ids; drop the rest from ``ids`` and from the cache.

        Always crops (possibly by zero): sliding-window layers recording the past shrink back to
        their window only on a crop.
        """
        del self.ids[keep:]
        if self.cached == 0:
            return  # nothing fed yet (Transformers 5.24 crashes cropping an empty sliding layer)
        drop = max(self.cached - keep, 0)
        if self.lean is not None:
            self.cache.crop(self.cached - drop)
        else:
            self.cache.crop(-drop)
        self.cached -= drop

    @torch.inference_mode()
    def greedy(self, hidden: torch.Tensor) -> HeadOutput:
        """Argmax token after each row of ``hidden`` ``[n, hidden]`` (statistics on demand)."""
        if self._greedy is None:
            logits = self.logits(hidden)
            return HeadOutput(logits.argmax(dim=-1).tolist(), logits)
        n = int(hidden.shape[0])
        out = self._greedy(self._padded(hidden))
        return out if len(out.ids) == n else HeadOutput(out.ids[:n], out.logits[:n])

    @torch.inference_mode()
    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every token's float32 logit for the rows of ``hidden`` (soft-capped): what sampling
        needs, since it reads the whole distribution and not just the argmax.

        Row-count invariant wherever the greedy head's kernel is: with the screened head (native
        kernels) an fp32 ``NativeLinear`` copy of the head is built on first use (Gemma 3:
        +671 MB, a few seconds), with oneDNN the packed head itself; elsewhere the model's own
        head (a GPU's ``F.linear``: a row may round differently with the row count, ~1e-6).
        """
        if self._full is None:
            self._full = self._full_head()
            streamed = getattr(self._full, "streamed", None)
            if self.in_huge_pages and streamed is not None:  # sampling streams it every step
                hugepages.move(streamed())
        out = self._full(self._padded(hidden))[: hidden.shape[0]].float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def _full_head(self) -> nn.Module:
        fast = self._greedy.fast if self._greedy is not None else None
        if isinstance(fast, ScreenedHead):
            return fast.full_head()
        return fast if fast is not None else self.head

    def set_draft_vocab(self, requested: int | None) -> int:
        """Draft from the first ids only (``uag.runtime.draft_vocab``; None: the default where the head
        can be cut; 0: every id); returns the size in effect. After ``move_to_huge_pages``:
        the draft head is a view of the head's memory."""
        self.draft_head, self.draft_vocab = draft_head(self.head, requested, vocab=self.vocab_size)
        return self.draft_vocab

    @torch.inference_mode()
    def draft(
        self, hidden: torch.Tensor, *, among: np.ndarray | None = None
    ) -> tuple[int, float, float, float]:
        """The greedy draft after the last row of ``hidden`` and its statistics
        ``(id, top probability, second probability, entropy)``, over the draft vocabulary
        (``set_draft_vocab``): what a drafted token's features read. ``among``: only these ids
        (each under ``draft_limit``), the statistics over them alone (token healing)."""
        head = self.draft_head if self.draft_head is not None else self.head
        if among is None and not self.softcap and _native_row(head, hidden):
            y = torch.empty(1, head.padded_out)  # two C calls, few torch ones: caches are cold
            head.into(hidden[-1:], y)
            return draft_stats(y, count=head.out_features)
        out = head(hidden[-1:]).float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        if among is None:
            return draft_stats(out[0])
        index = torch.from_numpy(among).to(out.device)  # int64 ids
        best, p1, p2, entropy = draft_stats(out[0, index].contiguous())
        return int(among[best]), p1, p2, entropy

    @property
    def draft_limit(self) -> int:
        """The ids ``draft`` chooses from are those below this."""
        return self.draft_vocab or self.vocab_size

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full float32 logits for the rows of ``hidden`` (with Gemma-style soft-capping)."""
        out = self.head(self._padded(hidden))[: hidden.shape[0]].float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


def _native_row(head: Any, hidden: torch.Tensor) -> TypeGuard[NativeLinear]:
    """Whether ``head`` can take ``hidden``'s last row as it is (``NativeLinear.into``)."""
    return (
        isinstance(head, NativeLinear)
        and head.lib is not None
        and head.padded_in == head.in_features
        and hidden.device.type == "cpu"
        and hidden.dtype == torch.float32
        and hidden.is_contiguous()
    )


class GreedyHead:
    """Argmax of the LM head per position, for target-alone decoding and verification alike.

    Why one head for both: target-alone decoding is the reference, so verification must compute
    each position's logits the same way. On CPU with float32 weights the product runs on the
    ``fast`` head (``uag.kernels.native.NativeLinear``, or oneDNN's ``uag.kernels.choice.PackedHead``), which
    costs about the same for 1–9 rows; elsewhere (CUDA, other dtypes, or ``--kernels plain``) a plain ``F.linear`` is used,
    which is bandwidth-bound on a GPU already. Soft-capping is monotonic and cannot move the
    argmax, so it is skipped.
    """

    def __init__(
        self, weight: torch.Tensor | None, bias: torch.Tensor | None, *, fast: nn.Module | None
    ) -> None:
        if weight is None and fast is None:
            raise ValueError("GreedyHead needs the head's weight or a fast head")
        self.weight = weight
        self.bias = bias
        self.fast = fast

    def __call__(self, hidden: torch.Tensor) -> HeadOutput:
        """``hidden``: [n, h] → argmax ids [n], keeping the logits for statistics and margins."""
        greedy = getattr(self.fast, "greedy", None)
        if greedy is not None:  # the exact screened head finds the argmax itself
            ids, logits = greedy(hidden.float())
            return HeadOutput(ids, logits)
        if self.fast is not None:
            logits = self.fast(hidden.float())  # [n, V]
        else:
            assert self.weight is not None
            logits = torch.nn.functional.linear(
                hidden.to(self.weight.dtype), self.weight, self.bias
            )
        # argmax takes the first maximum: ties go to the lowest id, on every path.
        return HeadOutput(logits.argmax(dim=-1).tolist(), logits)


@dataclass
class HeadOutput:
    """Greedy head result: argmax id per position, and the logits to derive statistics from."""

    ids: list[int]
    logits: torch.Tensor = field(repr=False)
    """``[n, V]``: the head's logits for the rows it was given (soft-capping not applied)."""

    def stats(self, row: int) -> tuple[float, float]:
        """Probability of the argmax token at ``row`` and the entropy (nats) of that distribution.

        Computed for one row on demand (about a millisecond), since only the row of the last
        emitted token is ever needed and which row that is depends on verification.
        """
        logp = torch.log_softmax(self.logits[row].float(), dim=-1)
        return float(logp.max().exp()), float(-(logp.exp() * logp).sum())

    def margin(self, row: int) -> float:
        """Top-1 minus top-2 logit at ``row``: how far the argmax is from flipping."""
        top = torch.topk(self.logits[row].float(), 2).values
        return float(top[0] - top[1])


def target_lm_for(model: Any, tokenizer: Any, mode: str) -> CachedLM:
    """The target on ``mode``'s kernels (linears swapped in place, the fast greedy head, the
    screened head calibrated), knowing whether its rows are count-invariant: what
    ``uag.api.make_pair`` and ``uag.runtime.prepared`` both run."""
    fast_head = accelerate_target(model, mode) if mode in ("native", "onednn") else None
    lm = CachedLM(model, greedy_head=True, fast_head=fast_head)
    if isinstance(fast_head, ScreenedHead):  # only speed depends on the channels it picks
        calibrate(lm, tokenizer, fast_head)
    if mode == "native":  # by construction: exact products, rows computed alone
        lm.row_invariant = fast_head is not None and is_row_invariant(
            model, rowwise_attention=lm.lean is not None
        )
    else:  # library kernels: the whole forward checked on this model's shapes
        lm.invariance = invariance.settle(lm)
        if not lm.invariance.invariant:  # the guard's fallback: say so
            print(
                f"uag: on {mode} kernels the target's rows depend on the row count here "
                f"({lm.invariance.detail}); verification recomputes near-ties alone "
                "(docs/lossless.md)",
                file=sys.stderr,
            )
    return lm


def assistant_lm_for(model: Any, mode: str) -> CachedLM:
    """The assistant on ``mode``'s kernels: a float32 CPU model's linears, its head included,
    are swapped in place (an int8 one has no fp32 linears left)."""
    param = next(model.parameters(), None)
    fp32_cpu = param is None or (param.device.type == "cpu" and param.dtype == torch.float32)
    if mode in ("native", "onednn") and fp32_cpu:
        swap_linears(model, mode, head=True)
    return CachedLM(model)


def _shared(seq: Sequence[int], ids: Sequence[int], limit: int) -> int:
    """How many leading ids ``seq`` and ``ids`` share, at most ``limit``."""
    n = min(len(seq), limit)
    same = 0
    while same < n and seq[same] == ids[same]:
        same += 1
    return same
