"""How many candidates a coarser first screening pass over the target's head would leave.

    python -m scripts.screen_width [--prompts mixed:test+humaneval:test] [--limit 4]

Why: the screened head (``uag.kernels.screened``) reads an int8 copy of Gemma 3's 262,144-row
head every step (~173 MB of a ~296 MB step), and a 4-bit first pass would halve that, *if* its
rigorous bound still leaves few candidates: every candidate must then be computed exactly (or by
a second, finer pass), and the argmax stays exact only if the bound is rigorous. A weight
rounded with error at most ``e`` moves a logit by at most ``e · ‖x‖₁`` (any signs), so the
bound grows with the format's step, not with its typical error.

For each format this counts, on real decode-step hidden states (greedy, the prompts given), the
tokens whose interval ``[l − b, l + b]`` reaches the row's best lower bound, with ``l`` the
*exact* logits: a lower bound on what that pass would leave (its own approximate logits would
only widen the spread). The outlier channels stay on int8 in every row (as the shipped head
rounds them on their own scale); the other channels take:

* ``int8`` (per vocabulary row, today's): error ≤ 0.5 steps of the row's scale ``s``;
* ``7-bit`` / ``6-bit`` / ``5-bit`` (per row): ≤ 1 / 2 / 4 steps of ``s``;
* ``4-bit per row`` (the int8 integers rounded to multiples of 17, -7..7): ≤ 8.5 steps;
* ``4-bit per block of 32`` (symmetric, one scale per block as Q4_0): ≤ half a block step,
  summed block by block against the activations' block norms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import torch

from uag import api
from uag.errors import UagError
from uag.harness.prompts import load_prompts
from uag.kernels.screened import ScreenedHead

ROW_FORMATS = {"int8": 0.5, "7-bit": 1.0, "6-bit": 2.0, "5-bit": 4.0, "4-bit per row": 8.5}
"""Per-row formats: the largest weight error, in steps of the row's int8 scale."""
BLOCK = 32


@dataclass(frozen=True)
class Width:
    """Candidates a format's bound leaves per decode row."""

    name: str
    median: float
    mean: float
    p90: int


def screened_head(pair: api.Pair) -> ScreenedHead:
    """The target's screened greedy head (the native kernels' on CPU), or a clear error."""
    greedy = pair.target_lm._greedy
    head = greedy.fast if greedy is not None else None
    if not isinstance(head, ScreenedHead):
        raise UagError("the target's head is not screened here (needs the native kernels)")
    return head


def decode_hidden(pair: api.Pair, prompts: list[str], *, tokens: int) -> torch.Tensor:
    """``[n, h]``: the hidden state the target's greedy head sees at each target-alone step."""
    head = screened_head(pair)
    seen: list[torch.Tensor] = []
    greedy = head.greedy

    def record(hidden: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        seen.append(hidden.reshape(-1, head.in_features)[-1:].float().clone())
        return greedy(hidden)

    head.greedy = record  # type: ignore[method-assign]
    try:
        for prompt in prompts:
            api.generate(pair, prompt, plan=None, max_new_tokens=tokens)
    finally:
        del head.greedy  # the class's method again
    return torch.cat(seen)


def widths(pair: api.Pair, hidden: torch.Tensor) -> list[Width]:
    """Each format's candidates per row of ``hidden`` (module docstring)."""
    head = screened_head(pair)
    exact = head.full_head()
    scale = head._scales[: head.out_features].double()
    rest = torch.ones(head.in_features, dtype=torch.bool)
    rest[head.outliers] = False
    weight = head.rows(torch.arange(head.out_features))  # [V, h] fp32, exact
    width = head.in_features // BLOCK * BLOCK
    blocks = weight[:, :width].reshape(head.out_features, -1, BLOCK)
    block_mask = rest[:width].reshape(-1, BLOCK)
    # half a 4-bit step per block (symmetric, step = max|w| / 7), over the non-outlier channels
    half_step = (blocks.abs().amax(dim=-1).double() / 7.0 / 2.0).float()
    counts: dict[str, list[int]] = {name: [] for name in [*ROW_FORMATS, "4-bit per block of 32"]}
    for x in hidden:
        logits = exact(x[None])[0].double()
        abs_x = x.abs().double()
        x_rest, x_out = float(abs_x[rest].sum()), float(abs_x[~rest].sum())
        for name, steps in ROW_FORMATS.items():
            counts[name].append(_count(logits, scale * (steps * x_rest + 0.5 * x_out)))
        block_norms = (abs_x[:width].reshape(-1, BLOCK) * block_mask).sum(-1).float()
        per_block = (half_step @ block_norms).double() + scale * 0.5 * x_out
        counts["4-bit per block of 32"].append(_count(logits, per_block))
    return [
        Width(
            name=name,
            median=statistics.median(c),
            mean=statistics.mean(c),
            p90=sorted(c)[int(0.9 * len(c))],
        )
        for name, c in counts.items()
    ]


def _count(logits: torch.Tensor, bound: torch.Tensor) -> int:
    floor = float((logits - bound).max())
    return int((logits + bound >= floor).sum())


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.screen_width", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--prompts", default="mixed:test+humaneval:test")
    parser.add_argument("--limit", type=int, default=4, help="prompts per source")
    parser.add_argument("--tokens", type=int, default=48, help="decode steps per prompt")
    args = parser.parse_args()
    try:
        pair = api.load_pair()
        prompts = [p.text for p in load_prompts(args.prompts, limit=args.limit)]
        hidden = decode_hidden(pair, prompts, tokens=args.tokens)
    except UagError as err:
        print(f"screen_width: {err}", file=sys.stderr)
        return 2
    print(
        f"{hidden.shape[0]} decode rows ({len(prompts)} prompts of {args.prompts}, "
        f"{args.tokens} tokens each); vocabulary {pair.target_lm.vocab_size}"
    )
    print("\n| first pass | candidates median | mean | p90 |\n|---|---|---|---|")
    for w in widths(pair, hidden):
        print(f"| {w.name} | {w.median:.0f} | {w.mean:.0f} | {w.p90} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
