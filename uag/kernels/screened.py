"""An exact greedy LM head that reads int8 weights: screen with int8, decide with fp32.

Why: Gemma 3's head is 262,144 × 640, 671 MB of fp32 read every step: ~40% of a target step on
these CPUs. Greedy decoding needs only the argmax, and an int8 copy (a quarter of the bytes)
locates it up to a known error. ``ScreenedHead``:

1. computes every logit approximately: int8 weights times 7-bit activations (``q8.c``: integer
   products, ~1.6x cheaper per row than widening the weights to fp32, so a verify's extra rows
   cost less), with a few *outlier channels* rounded on their own 7-bit scale (one more row of
   the same product over just the quads that hold them: the others' scale stays fine);
2. bounds each one's distance from its fp32 value: rounding the weight to int8 moves a dot
   product by at most ``scale / 2 · ‖x‖₁`` and float32 accumulation of the fp32 product by at
   most ``127 · scale · ‖x‖₁ · γ_K`` (``error_bound``, the standard bound, any summation order);
   rounding the activations adds at most ``r · ‖ŵ‖₁`` for each of the two sets of channels
   (``r`` per row and set, from ``q8.c``; ``‖ŵ‖₁`` over the set per vocabulary row,
   precomputed; ``bounds``);
3. keeps as candidates every row whose interval can reach the best lower bound, and computes
   those exactly in fp32 (the native kernel on the gathered rows of the original weight).

Where the head's weights are exactly an fp16 scale times small integers per block (Gemma's
Q8_0 head), the original is held as those blocks (``exact``: 190 MB instead of 671 MB of fp32)
and candidate rows and the full head that sampling reads come from them;
the fp32 weight is not kept. Other heads keep the fp32 original for those reads.

Why outlier channels: a handful of Gemma 3's final hidden channels are ~10-20x the others
(max |x| ~20x the mean), and 7 bits spread over them leave a bound that admits thousands of
candidates per row (a median of 1,130 on HumanEval). ``calibrate`` picks the 16 channels largest
on average over a fixed text once per model; with those on their own scale (exact fp32 before
this build, whose epilogue cost ~0.7 ms of a ~7 ms head), the median is ~12 on code. Flat
distributions (inside emoji and CJK byte sequences, some prose) still leave hundreds to
thousands. Computing a candidate exactly costs ~0.75 µs (its 2.5 KB fp32 row gathered, times the
rows), while narrowing the bounds costs a second pass over the whole int8 head (~7 ms), so only a
row with more than ``RESCREEN`` candidates runs a second activation level (what the first 7 bits
missed), which narrows its bound ~100-fold. Each row's path depends on that row alone
(row-count invariance).
The split affects only speed: the bound holds for any choice of channels.

Every step after the body's final norm is one C call (``uag_screened_greedy``: norms, channel
order, product, screen, exact step, argmax) where the exact weight is in a kernel format: as
~25 torch ops, each ran on caches the head's stream had just evicted (~0.6 ms of a 15 ms step;
one call, 1-2 % off a target step on a Zen 3, the same bits). A row with more than
``RESCREEN`` candidates hands the call back to Python for its second level.

A non-candidate's fp32 logit is below some candidate's, so the argmax (ties to the lowest id,
as everywhere) is exactly the fp32 head's, by construction, and a row's candidates and values do
not depend on the other rows in the forward (every product is computed on its own). The
returned logits are the approximate ones with the candidates' exact values patched in: what the
controller's confidence features are computed from.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from uag.kernels.formats import FORMATS
from uag.kernels.native import NativeLinear, fp32_product

CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969, 3 astronauts flew 384,400 km.\n"
    "def mean(values: list[float]) -> float:\n"
    '    """Return the arithmetic mean of values."""\n'
    "    if not values:\n"
    "        raise ValueError('empty')\n"
    "    return sum(values) / len(values)\n"
)
"""What ``calibrate`` sees once per model: prose, numbers and code (only speed depends on it)."""


def error_bound(in_features: int) -> float:
    """Coefficient ``c``: |int8 logit − fp32 logit| ≤ c · scale · ‖x‖₁ (see the module doc).

    0.5 for rounding the weight; 2 · 127 · γ for float32 accumulation, with γ = (K + 2) · 2⁻²⁴ (a
    little above K·u/(1 − K·u)): once for the fp32 product that decides, once more as margin for
    adding up the parts (the other channels, their second level, the outlier channels: each
    part's own output rounding is in its ``r``); 1 % on top for the bound's own rounding.
    """
    gamma = (in_features + 2) * 2.0**-24
    return (0.5 + 2 * 127 * gamma) * 1.01


class _Head(ctypes.Structure):
    """``screen.c``'s ``uag_head``: the constants of one call of ``uag_screened_greedy``."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("in_", "padded_in", "outliers")),
        *((name, ctypes.c_void_p) for name in ("order", "weight", "scale", "bias")),
        *((name, ctypes.c_void_p) for name in ("wsum", "wsum_o")),
        *((name, ctypes.c_int64) for name in ("padded_out", "quad0", "quads")),
        *((name, ctypes.c_void_p) for name in ("coef", "coef2", "coef3")),
        ("slack", ctypes.c_float),
        ("vocab", ctypes.c_int64),
        ("exact_format", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in ("exact_weight", "exact_params", "exact_bias")),
    ]


class ScreenedHead(nn.Module):
    """``hidden [n, h]`` → logits ``[n, V]`` whose argmax is exactly the fp32 head's."""

    ABSOLUTE_SLACK = 1e-4
    """Added to every bound: covers rounding in the comparison itself (logits are O(10))."""

    OUTLIERS = 16
    """Channels quantised on their own scale (``calibrate``)."""
    RESCREEN = 4096
    """A row with more candidates than this is screened again with two activation levels (below
    it, computing them exactly is cheaper: at 256, 14 % of the head calls on 12 held-out prompts
    paid a second pass, and static-3 ran 6 % slower with the same tokens)."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.exact = NativeLinear.exact_blocks_of(head.weight.detach().float())
        """The weight in exact block storage (bitwise the fp32 values), where it has that form."""
        self.weight = None if self.exact is not None else head.weight.detach()
        """Otherwise the original fp32 weight: only candidate rows are read."""
        self.bias = None if head.bias is None else head.bias.detach().float().clone()
        self._full: nn.Module | None = None
        self.approx = NativeLinear(head, int8=True, dynamic=True)
        self.out_features = self.approx.out_features
        self.in_features = self.approx.in_features
        self._scales = self.approx.scales[: self.out_features]
        self.row_bound = (self._scales * error_bound(self.in_features)).contiguous()
        """Per vocabulary row: the weight's share of the bound, times ‖x‖₁."""
        self._abs_q = self.approx.weight_ilv.abs().sum(dim=(1, 3), dtype=torch.int32).reshape(-1)
        self.outliers = torch.zeros(0, dtype=torch.long)
        self.order = torch.arange(self.approx.padded_in)
        """The int8 product's input channel at each position (``set_outliers``)."""
        self.row_l1 = torch.empty(0)
        self.row_l1_out = torch.empty(0)
        self.outlier_quads = range(0)
        self.outlier_wsum = torch.empty(0, dtype=torch.int32)
        self.set_outliers(torch.zeros(0, dtype=torch.long))
        self.calibrated = False
        self.invariance = "invariant"
        self.last_candidates = 0
        """Candidates in the last call (all rows together): how much exact work screening left."""
        self._scratch_rows: tuple[torch.Tensor, ...] | None = None

    def set_outliers(self, channels: torch.Tensor) -> None:
        """Round ``channels``' activations on their own 7-bit scale, the rest on another.

        The int8 product's channels are stored with these last, so their row runs over only
        the last ``ceil(O / 4)`` quads (``q8.c``); integer sums do not depend on the order."""
        self._head: tuple[tuple[Any, ...], _Head] | None = None  # the C call's, rebuilt
        channels = torch.unique(channels.long())
        width = self.approx.padded_in
        outlier = torch.zeros(width, dtype=torch.bool)
        outlier[channels] = True
        self._reorder(torch.cat([torch.arange(width)[~outlier], channels]))
        self.outliers = channels
        blocks = self.approx.weight_ilv  # [V/8, K/4, 8, 4]: position p is [:, p // 4, :, p % 4]
        abs_out = torch.zeros_like(self._abs_q)
        for p in range(width - len(channels), width):
            abs_out += blocks[:, p // 4, :, p % 4].reshape(-1).abs().to(torch.int32)
        scales = self._scales.double() * 1.0001  # rounded up
        self.row_l1 = ((self._abs_q - abs_out)[: self.out_features].double() * scales).float()
        """Per vocabulary row: ‖ŵ‖₁ over the other channels, times their r."""
        self.row_l1_out = (abs_out[: self.out_features].double() * scales).float()
        """Per vocabulary row: ‖ŵ‖₁ over the outlier channels, times theirs."""
        self.outlier_quads = range((width - len(channels)) // 4, width // 4)
        """The int8 product's quads (4 channels each) that hold them: their row runs over these."""
        quads = slice(self.outlier_quads.start, self.outlier_quads.stop)
        self.outlier_wsum = blocks[:, quads].sum(dim=(1, 3), dtype=torch.int32).reshape(-1)
        """Per output: the int8 weights' sum over those quads (the outlier row's zero point)."""

    def _reorder(self, order: torch.Tensor) -> None:
        """Store the int8 product's input channels so that position p holds channel
        ``order[p]`` (activations are gathered the same way in ``approximate``)."""
        if torch.equal(order, self.order):
            return
        where = torch.empty_like(self.order)
        where[self.order] = torch.arange(len(self.order))  # channel -> its position now
        w = self.approx.weight_ilv  # [V/8, K/4, 8, 4]
        tiles, quads = w.shape[:2]
        by_channel = w.permute(0, 2, 1, 3).reshape(tiles, 8, quads * 4)[:, :, where[order]]
        self.approx.weight_ilv = (
            by_channel.reshape(tiles, 8, quads, 4).permute(0, 2, 1, 3).contiguous()
        )
        self.order = order

    def calibrate(self, hidden: torch.Tensor) -> None:
        """Pick the ``OUTLIERS`` channels largest on average over ``hidden`` ``[n, h]``."""
        mean = hidden.reshape(-1, self.in_features).float().abs().mean(dim=0)
        self.set_outliers(mean.topk(min(self.OUTLIERS, self.in_features)).indices)
        self.calibrated = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.greedy(hidden)[1]

    def streamed(self) -> list[tuple[nn.Module, str]]:
        """What every ``greedy`` call reads in full (``uag.kernels.hugepages.move``): the int8 product's
        weights and the per-row bounds."""
        return self.approx.streamed() + [
            (self, name) for name in ("row_bound", "row_l1", "row_l1_out")
        ]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The head's fp32 weight rows ``ids`` (``[len(ids), h]``)."""
        if self.exact is not None:
            return self.exact.rows(ids)
        assert self.weight is not None
        return self.weight[ids].float()

    def full_head(self) -> nn.Module:
        """Every logit (what sampling reads), built on first use: the exact blocks on
        ``exact.c`` where this CPU runs it (a copy in its layout, +189 MB for Gemma: its
        multi-row products cost a fraction of the fp32 multiply-adds, 8 rows ~10 ms against
        ~17), else the exact blocks themselves, else an fp32 native copy of the original
        (+671 MB for Gemma); plus the head's bias, which those forms do not hold."""
        if self._full is None:
            if self.exact is not None:
                full = self.exact.integer_copy() or self.exact
            else:
                assert self.weight is not None
                part = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
                part.weight = nn.Parameter(self.weight, requires_grad=False)
                full = NativeLinear(part, exact_blocks=False)
            self._full = full if self.bias is None else full.with_bias(self.bias)
        return self._full

    def greedy(self, hidden: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """``hidden [..., h]`` → (fp32 argmax per row, logits ``[..., V]``).

        The argmax is taken over the candidates only: a non-candidate's int8 logit is below
        the floor, which some candidate's exact logit reaches, so it can never win (not even a
        tie), and no full-vocabulary argmax pass is needed. Where the exact weight is in a
        kernel format, every step is one C call (``uag_screened_greedy``) unless a row needs
        a second activation level.
        """
        x = hidden.reshape(-1, self.in_features)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()  # [n, h]
        n, head = x.shape[0], self._c_head()
        if head is None:
            norms = x.abs().sum(dim=-1)
            logits, missed = self.approximate(x)
            ids = self._decide(x, logits, norms, missed)
        else:
            logits = torch.empty(n, self.approx.padded_out)
            norms, missed, rows, cols, found = self._scratch(n)
            count = self.approx.lib.uag_screened_greedy(  # type: ignore[union-attr]
                ctypes.byref(head), x.data_ptr(), n, logits.data_ptr(), norms.data_ptr(),
                missed.data_ptr(), rows.data_ptr(), cols.data_ptr(), rows.numel(),
                self.RESCREEN, found.data_ptr(),
            )  # fmt: skip
            if count == -2:
                raise RuntimeError("the screened head found no candidate in a row (NaN input?)")
            if self.approx.padded_out != self.out_features:
                logits = logits[:, : self.out_features]
            if count >= 0:
                self.last_candidates = count
                ids = found[:n].tolist()
            else:  # a row with more than RESCREEN candidates: from the C call's values on
                ids = self._decide(x, logits, norms[:n], missed[:n])
        if hidden.dim() == 2:
            return ids, logits
        return ids, logits.reshape(*hidden.shape[:-1], self.out_features)

    def _decide(
        self, x: torch.Tensor, logits: torch.Tensor, norms: torch.Tensor, missed: torch.Tensor
    ) -> list[int]:
        """The argmax per row from the approximate ``logits`` (patched in place with the
        candidates' exact values), ``norms`` ``[n]`` and ``missed`` ``[n, 2]``: a second
        activation level first for rows with more than ``RESCREEN`` candidates."""
        rows, cols = self._candidates(logits, norms, missed)
        if cols.numel() > self.RESCREEN:  # some row may have more: only then count them
            wide = (torch.bincount(rows, minlength=x.shape[0]) > self.RESCREEN).nonzero()[:, 0]
            if len(wide):  # flat distributions: a second level narrows those rows' bounds
                logits[wide], missed[wide] = self.approximate(x[wide], levels=2)
                rows, cols = self._candidates(logits, norms, missed)
        self.last_candidates = int(cols.numel())
        ids = self._exact_in_c(x, rows, cols, logits)
        if ids is None:  # torch: the same values (the exact weight's rows, the same kernel)
            union, where = torch.unique(cols, return_inverse=True)
            exact = _exact_product(x, self.rows(union), self.bias, union)[rows, where]
            logits[rows, cols] = exact
            ids = _row_argmax(rows, cols, exact, x.shape[0])
        return ids

    def _c_head(self) -> _Head | None:
        """``uag_screened_greedy``'s constants, or None where the exact weight is not in a
        kernel format. Rebuilt when a tensor they point into has been replaced or moved
        (``set_outliers``, ``uag.kernels.hugepages``) or the slack changed."""
        exact, approx = self._exact_in_kernels(), self.approx
        if exact is None:
            return None

        def at(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        where = {
            "order": at(self.order),
            "weight": at(approx.weight_ilv),
            "scale": at(approx.scales),
            "bias": at(approx.bias_padded),
            "wsum": at(approx.wsum),
            "wsum_o": at(self.outlier_wsum) if len(self.outliers) else None,
            "coef": at(self.row_bound),
            "coef2": at(self.row_l1),
            "coef3": at(self.row_l1_out),
            "exact_weight": at(exact.weight_ilv),
            "exact_params": exact.params_ptr(),
            "exact_bias": at(self.bias),
        }
        key = (*where.values(), self.ABSOLUTE_SLACK)
        if self._head is not None and self._head[0] == key:
            return self._head[1]
        head = _Head(
            **where,
            in_=self.in_features,
            padded_in=approx.padded_in,
            outliers=len(self.outliers),
            padded_out=approx.padded_out,
            quad0=self.outlier_quads.start,
            quads=len(self.outlier_quads),
            slack=self.ABSOLUTE_SLACK,
            vocab=self.out_features,
            exact_format=int(exact.format),
        )
        self._head = (key, head)
        return head

    def _exact_in_kernels(self) -> NativeLinear | None:
        """The exact weight where the kernels read it (``uag_exact_candidates``), else None."""
        exact = self.exact
        if exact is None or self.approx.lib is None or FORMATS[exact.format].widen is None:
            return None
        return exact

    def _scratch(self, n: int) -> tuple[torch.Tensor, ...]:
        """Per-call buffers for ``n`` rows, kept between calls (only the logits leave a call):
        norms, missed, candidates' rows and ids (room for ``64 + RESCREEN`` a row), argmaxes."""
        if self._scratch_rows is None or self._scratch_rows[0].numel() < n:
            cap = (64 + self.RESCREEN) * n
            self._scratch_rows = (
                torch.empty(n),
                torch.empty(n, 2),
                torch.empty(cap, dtype=torch.int64),
                torch.empty(cap, dtype=torch.int64),
                torch.empty(n, dtype=torch.int64),
            )
        return self._scratch_rows

    def _exact_in_c(
        self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, logits: torch.Tensor
    ) -> list[int] | None:
        """The candidates' exact logits into ``logits`` and each row's argmax, in one C call
        (``skinny.c``: the full product's own chain of multiply-adds for each), where the exact
        weight is held in the kernels' layout; else None."""
        exact, lib = self._exact_in_kernels(), self.approx.lib
        if exact is None or lib is None:
            return None
        ids = torch.empty(x.shape[0], dtype=torch.int64)
        done = lib.uag_exact_candidates(
            int(exact.format), exact.weight_ilv.data_ptr(), exact.params_ptr(),
            self.in_features, x.data_ptr(), x.stride(0), x.shape[0],
            None if self.bias is None else self.bias.data_ptr(),
            rows.data_ptr(), cols.data_ptr(), cols.numel(),
            logits.data_ptr(), logits.stride(0), ids.data_ptr(),
        )  # fmt: skip
        return ids.tolist() if done == 0 else None

    def approximate(self, x: torch.Tensor, *, levels: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [n, h]`` → (approximate logits ``[n, V]``, ``r [n, 2]``): logit (m, v) is within
        ``bounds(‖x_m‖₁, r_m)`` of its fp32 value. ``levels`` 2 also runs what the other
        channels' 7 bits missed (~126x smaller ``r[:, 0]``)."""
        n, pad = x.shape[0], self.approx.padded_in - self.in_features
        missed = torch.zeros(n, 2)
        rest = F.pad(x, (0, pad)) if pad else x
        rest = rest[:, self.order] if len(self.outliers) else rest.clone()  # the stored order
        outliers = None
        if len(self.outliers):  # stored last
            outliers = torch.zeros_like(rest)
            outliers[:, -len(self.outliers) :] = rest[:, -len(self.outliers) :]
            rest[:, -len(self.outliers) :] = 0.0
        logits = torch.empty(n, self.approx.padded_out)
        bound, bound_out = torch.empty(n), torch.zeros(n)
        self.approx.product_q8(
            rest,
            logits,
            levels=levels,
            bound=bound,
            outliers=None
            if outliers is None
            else (outliers, self.outlier_quads, self.outlier_wsum),
            bound_outliers=bound_out,
        )
        missed[:, 0], missed[:, 1] = bound, bound_out
        return logits[:, : self.out_features], missed

    def bounds(self, norms: torch.Tensor, missed: torch.Tensor) -> torch.Tensor:
        """``[n, V]``: how far each approximate logit may lie from its fp32 value, for rows with
        ``‖x‖₁`` ``norms [n]`` and ``approximate``'s ``missed [n, 2]`` (``screen.c``'s formula,
        in its order)."""
        terms = self.row_bound * norms[:, None] + self.row_l1 * missed[:, :1]
        return (terms + self.row_l1_out * missed[:, 1:]) + self.ABSOLUTE_SLACK

    def _candidates(
        self, logits: torch.Tensor, norms: torch.Tensor, missed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, id) of every token whose interval reaches its row's floor (``csrc/screen.c``)."""
        n = logits.shape[0]
        cap = (64 + self.RESCREEN) * n
        lib = self.approx.lib
        assert lib is not None  # NativeLinear refuses to exist without it
        rest, out = missed[:, 0].contiguous(), missed[:, 1].contiguous()
        while True:
            rows = torch.empty(cap, dtype=torch.int64)
            cols = torch.empty(cap, dtype=torch.int64)
            count = lib.uag_screen(
                logits.data_ptr(), n, self.out_features, logits.stride(0),
                self.row_bound.data_ptr(), norms.contiguous().data_ptr(),
                self.row_l1.data_ptr(), rest.data_ptr(),
                self.row_l1_out.data_ptr(), out.data_ptr(), self.ABSOLUTE_SLACK,
                rows.data_ptr(), cols.data_ptr(), cap,
            )  # fmt: skip
            if count >= 0:
                return rows[:count], cols[:count]
            cap = n * self.out_features  # rare (near-flat distributions): room for everything


def _row_argmax(rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, n: int) -> list[int]:
    """Per row r < n, the id in ``cols`` of the largest of ``values`` among the entries with
    ``rows == r`` (every row has one), the lowest id on a tie, as ``argmax`` over the full row
    would pick. A fixed handful of ops whatever n: a loop over rows cost ~0.08 ms a row."""
    best = torch.full((n,), -torch.inf).scatter_reduce(0, rows, values, "amax")
    top = values == best[rows]
    lowest = torch.full((n,), torch.iinfo(torch.int64).max).scatter_reduce(
        0, rows[top], cols[top], "amin"
    )
    return lowest.tolist()


def _exact_product(
    x: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor
) -> torch.Tensor:
    """``x @ rows.T (+ bias[ids])`` on the native fp32 kernel: the same value for a (row, id)
    pair as a full fp32 head on that kernel would give, whatever else is in the call."""
    return fp32_product(x, rows, None if bias is None else bias[ids])


def calibrate(lm: Any, tokenizer: Any, head: ScreenedHead) -> None:
    """Choose ``head``'s exact channels from the model's own hidden states over
    ``CALIBRATION_TEXT`` (``lm``: the ``uag.runtime.runner.CachedLM`` it serves), once per model."""
    if head.calibrated:
        return
    lm.reset(tokenizer(CALIBRATION_TEXT)["input_ids"], rollback=False)
    head.calibrate(lm.forward())
    lm.reset([], rollback=False)
