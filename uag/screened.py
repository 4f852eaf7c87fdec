"""An exact greedy LM head that reads int8 weights: screen with int8, decide with fp32.

Why: Gemma 3's head is 262,144 × 640, 671 MB of fp32 read every step: ~40% of a target step on
these CPUs. Greedy decoding needs only the argmax, and an int8 copy (a quarter of the bytes)
locates it up to a known error. ``ScreenedHead``:

1. computes every logit with the int8 weight (``uag.native``, one scale per vocabulary row);
2. bounds each one's distance from its fp32 value (``error_bound``): rounding the weight to
   int8 moves a dot product by at most ``scale / 2 · ‖x‖₁``, and float32 accumulation of either
   product adds at most ``127 · scale · ‖x‖₁ · γ_K`` (the standard bound, any summation order);
3. keeps as candidates every row whose interval can reach the best lower bound, and computes
   those exactly in fp32 (the native kernel on the gathered rows of the original weight).

A non-candidate's fp32 logit is below some candidate's, so the argmax (ties to the lowest id,
as everywhere) is exactly the fp32 head's, by construction, and a row's candidates and values do
not depend on the other rows in the forward (every product is computed on its own). The
returned logits are the int8 ones with the candidates' exact values patched in: what the
controller's confidence features are computed from.
"""

from __future__ import annotations

import torch
from torch import nn

from uag.native import NativeLinear


def error_bound(in_features: int) -> float:
    """Coefficient ``c``: |int8 logit − fp32 logit| ≤ c · scale · ‖x‖₁ (see the module doc).

    0.5 for rounding the weight; 2 · 127 · γ for the float32 accumulation of both products, with
    γ = (K + 2) · 2⁻²⁴ (a little above K·u/(1 − K·u)); 1 % on top for the bound's own rounding.
    """
    gamma = (in_features + 2) * 2.0**-24
    return (0.5 + 2 * 127 * gamma) * 1.01


class ScreenedHead(nn.Module):
    """``hidden [n, h]`` → logits ``[n, V]`` whose argmax is exactly the fp32 head's."""

    ABSOLUTE_SLACK = 1e-4
    """Added to every bound: covers rounding in the comparison itself (logits are O(10))."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.weight = head.weight.detach()
        """The original fp32 weight: only candidate rows are ever read from it."""
        self.bias = None if head.bias is None else head.bias.detach().float()
        self.approx = NativeLinear(head, int8=True)
        self.out_features = self.approx.out_features
        self.in_features = self.approx.in_features
        coefficient = error_bound(self.in_features)
        self.row_bound = (self.approx.scales[: self.out_features] * coefficient).contiguous()
        self.invariance = "invariant"
        self.last_candidates = 0
        """Candidates in the last call (all rows together): how much exact work screening left."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.greedy(hidden)[1]

    def greedy(self, hidden: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """``hidden [..., h]`` → (fp32 argmax per row, logits ``[..., V]``).

        The argmax is taken over the candidates only: a non-candidate's int8 logit is below
        the floor, which some candidate's exact logit reaches, so it can never win (not even a
        tie), and no full-vocabulary argmax pass is needed.
        """
        x = hidden.reshape(-1, self.in_features).float().contiguous()  # [n, h]
        logits = self.approx(x)  # [n, V]
        rows, cols = self._candidates(logits, x.abs().sum(dim=-1))
        self.last_candidates = int(cols.numel())
        union, where = torch.unique(cols, return_inverse=True)
        exact = _exact_product(x, self.weight[union], self.bias, union)[rows, where]
        logits[rows, cols] = exact
        ids = []
        for r in range(x.shape[0]):  # candidates are sorted by id within a row: ties go low
            mine = rows == r
            ids.append(int(cols[mine][exact[mine].argmax()]))
        return ids, logits.reshape(*hidden.shape[:-1], self.out_features)

    def _candidates(
        self, logits: torch.Tensor, norms: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, id) of every token whose interval reaches its row's floor (``csrc/screen.c``)."""
        n = logits.shape[0]
        cap = 64 * n
        lib = self.approx.lib
        assert lib is not None  # NativeLinear refuses to exist without it
        while True:
            rows = torch.empty(cap, dtype=torch.int64)
            cols = torch.empty(cap, dtype=torch.int64)
            count = lib.uag_screen(
                logits.data_ptr(), n, self.out_features, logits.stride(0),
                self.row_bound.data_ptr(), norms.contiguous().data_ptr(), self.ABSOLUTE_SLACK,
                rows.data_ptr(), cols.data_ptr(), cap,
            )  # fmt: skip
            if count >= 0:
                return rows[:count], cols[:count]
            cap = n * self.out_features  # rare (near-flat distributions): room for everything


def _exact_product(
    x: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor
) -> torch.Tensor:
    """``x @ rows.T (+ bias[ids])`` on the native fp32 kernel: the same value for a (row, id)
    pair as a full fp32 head on that kernel would give, whatever else is in the call."""
    part = nn.Linear(rows.shape[1], rows.shape[0], bias=bias is not None, device="meta")
    part.weight = nn.Parameter(rows.float(), requires_grad=False)
    if bias is not None:
        part.bias = nn.Parameter(bias[ids], requires_grad=False)
    return NativeLinear(part)(x)
