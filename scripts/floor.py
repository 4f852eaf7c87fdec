"""How close a decode step runs to the bytes it reads: the read floor of each step.

A decode step on these CPUs is bound by memory: every weight it multiplies is streamed from
DRAM once per forward, whatever the row count. So the question for any kernel change is how
many bytes a step reads and how close its time is to ``bytes / read bandwidth``. This module
counts the bytes (from the same ``streamed`` slots the huge-page move uses, so what is counted
is what the kernels read in full), measures the machine's read bandwidth with a plain
reduction over a buffer larger than the last-level cache, and times the steps:

* the target's forward over 1–9 rows (a decode step, a verify of 0–8 candidates): the body's
  layers, the screened head's int8 screening copy and its bounds, the keys and values attended
  to at the given context, and the exact rows of the head's candidates;
* the assistant's draft step: its body and its draft head (the draft vocabulary's rows).

``ratio`` is the step's median time over its floor: 1.0 would read every byte at the
bandwidth a plain reduction reaches. Used by ``python -m scripts.runtime_bench
--floor-table``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from uag.harness.latency import measure_verify_costs, text_ids
from uag.runtime.runner import streamed_slots

BANDWIDTH_BYTES = 1 << 30
"""Buffer the bandwidth is measured over: 1 GiB, far above any last-level cache here."""


@dataclass(frozen=True)
class StepBytes:
    """What one forward reads, in bytes, by part."""

    body: int
    head: int
    kv: int
    candidates: int

    @property
    def total(self) -> int:
        return self.body + self.head + self.kv + self.candidates


@dataclass(frozen=True)
class FloorRow:
    """One step's bytes, median time and its ratio to the read floor."""

    step: str
    rows: int
    bytes: StepBytes
    ms: float
    floor_ms: float

    @property
    def ratio(self) -> float:
        return self.ms / self.floor_ms


def read_bandwidth(*, repeats: int = 7, size: int = BANDWIDTH_BYTES) -> float:
    """Bytes per second a plain float32 reduction (torch's, on every thread) reads from DRAM:
    the floor a memory-bound step is compared with. Median of ``repeats`` after a warm-up."""
    buffer = torch.ones(size // 4, dtype=torch.float32)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        buffer.sum()
        if i > 0:
            times.append(time.perf_counter() - start)
    return size / statistics.median(times)


def slot_bytes(slots: list[tuple[Any, str]]) -> int:
    """Bytes held by the tensors in (owner, attribute) ``slots``, each storage counted once
    (a draft head is a view of the head's memory)."""
    seen: set[int] = set()
    total = 0
    for owner, name in slots:
        tensor = getattr(owner, name, None)
        if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.nbytes
    return total


def kv_bytes(lm: Any, *, context: int, rows: int) -> int:
    """Keys and values a forward of ``rows`` positions after ``context`` reads: each layer's
    attended positions (a sliding layer's last ``window``) times both tensors' row size."""
    lean = lm.lean
    size = torch.tensor([], dtype=lean.kv_dtype).element_size()
    per_position = 2 * lean.kv_heads * lean.head_dim * size
    total = 0
    for kind in lean.layer_types:
        seen = context + rows
        if kind == "sliding_attention" and lean.window is not None:
            seen = min(seen, lean.window)
        total += seen * per_position
    return total


def _fast_head(lm: Any) -> Any:
    """The target's fast greedy head (the screened head on the native kernels), or None."""
    return lm._greedy.fast if lm._greedy is not None else None


def target_floor(
    pair: Any, *, bandwidth: float, context: int, repeats: int, max_rows: int = 9
) -> list[FloorRow]:
    """The target's forward over 1..``max_rows`` rows at ``context`` tokens: bytes by part, the
    median time (``measure_verify_costs``: body and greedy head, row counts interleaved) and
    the floor."""
    lm = pair.target_lm
    fast = _fast_head(lm)
    body = slot_bytes(lm.lean.streamed())
    head = slot_bytes(streamed_slots(None, lm.head, fast))
    exact = getattr(fast, "exact", None)
    # a candidate's exact logit reads its row of the exact block copy, else of the fp32 weight
    row_bytes = 0
    if exact is not None:
        row_bytes = slot_bytes(exact.streamed()) // exact.out_features
    elif isinstance(weight := getattr(fast, "weight", None), torch.Tensor):
        row_bytes = weight[0].nbytes
    costs = measure_verify_costs(
        lm, pair.target.tokenizer, max_rows=max_rows, context=context, repeats=repeats
    )
    candidates = _candidate_counts(lm, pair.target.tokenizer, context=context, max_rows=max_rows)
    rows_out = []
    for cost in costs:
        parts = StepBytes(
            body=body,
            head=head,
            kv=kv_bytes(lm, context=context, rows=cost.rows),
            candidates=candidates[cost.rows] * row_bytes,
        )
        rows_out.append(
            FloorRow(
                step="target",
                rows=cost.rows,
                bytes=parts,
                ms=cost.total_ms,
                floor_ms=parts.total / bandwidth * 1e3,
            )
        )
    return rows_out


def _candidate_counts(lm: Any, tokenizer: Any, *, context: int, max_rows: int) -> dict[int, int]:
    """The screened head's exact candidates (all rows together) per row count, on the same
    text ``measure_verify_costs`` times; 0 where the head does not screen."""
    fast = _fast_head(lm)
    ids = text_ids(tokenizer, context + max_rows)
    counts = {}
    lm.reset(ids[:context], rollback=True)
    lm.forward()
    for rows in range(1, max_rows + 1):
        lm.ids.extend(ids[context : context + rows])
        lm.greedy(lm.forward())
        counts[rows] = int(getattr(fast, "last_candidates", 0))
        lm.truncate(context)
    lm.reset([], rollback=False)
    return counts


@torch.inference_mode()
def assistant_floor(pair: Any, *, bandwidth: float, context: int, repeats: int) -> FloorRow:
    """The assistant's draft step (one row through its body, then its draft head) at
    ``context`` tokens: bytes, median time and floor."""
    lm = pair.assistant_lm
    body = slot_bytes(lm.lean.streamed())
    draft = lm.draft_head if lm.draft_head is not None else lm.head
    head = slot_bytes(streamed_slots(None, draft, None))
    ids = text_ids(pair.assistant.tokenizer, context + 1)
    lm.reset(ids[:context], rollback=True)
    lm.forward()
    times = []
    for i in range(repeats + 1):
        lm.ids.append(ids[context])
        start = time.perf_counter()
        lm.draft(lm.forward())
        elapsed = time.perf_counter() - start
        lm.truncate(context)
        if i > 0:
            times.append(elapsed)
    lm.reset([], rollback=False)
    parts = StepBytes(body=body, head=head, kv=kv_bytes(lm, context=context, rows=1), candidates=0)
    return FloorRow(
        step="assistant",
        rows=1,
        bytes=parts,
        ms=statistics.median(times) * 1e3,
        floor_ms=parts.total / bandwidth * 1e3,
    )


def _mb(size: float) -> str:
    return f"{size / 1e6:.1f}" if size >= 1e6 else f"{size / 1e6:.6f}"


def floor_table(pair: Any, *, context: int = 110, repeats: int = 7) -> str:
    """The read-floor table for ``pair`` on this machine, as Markdown."""
    bandwidth = read_bandwidth(repeats=repeats)
    rows = target_floor(pair, bandwidth=bandwidth, context=context, repeats=repeats)
    rows.append(assistant_floor(pair, bandwidth=bandwidth, context=context, repeats=repeats * 3))
    mb = 1e6
    lines = [
        f"read bandwidth (torch float32 sum over 1 GiB, {torch.get_num_threads()} threads): "
        f"{bandwidth / 1e9:.1f} GB/s; context {context} tokens; medians of {repeats} "
        f"(assistant {repeats * 3}); kernels {pair.kernels}",
        "",
        "| step | rows | body MB | head MB | KV MB | candidates MB | total MB | ms | floor ms "
        "| ms ÷ floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.step} | {r.rows} | {r.bytes.body / mb:.1f} | {r.bytes.head / mb:.1f} "
        f"| {r.bytes.kv / mb:.2f} | {r.bytes.candidates / mb:.2f} | {r.bytes.total / mb:.1f} "
        f"| {r.ms:.2f} | {r.floor_ms:.2f} | {r.ratio:.2f} |"
        for r in rows
    ]
    return "\n".join(lines)


@torch.inference_mode()
def layout_table(
    load_pair: Callable[[], Any],
    *,
    context: int = 110,
    rounds: int = 7,
    max_rows: int = 9,
    packed_flag: str = "1",
) -> str:
    """The target's forward over 1..``max_rows`` rows with its body in ``exact.c``'s int8
    layout and packed at its own bits (``UAG_PACKED_BODY``), as Markdown: both loaded in one
    process, timed in alternating rounds (order flipped each round, so drift spreads over both),
    the body's bytes, and whether every row's hidden state is bitwise the same in both.

    Why: packing changes only the bytes read, never a result; whether it pays depends on the
    CPU (a one-row step is bound by its bytes, a verify's extra rows by the products), so it
    is decided by this table on the machine at hand."""
    pairs = {}
    before = os.environ.get("UAG_PACKED_BODY")
    try:
        for name, flag in (("int8", "0"), ("packed", packed_flag)):
            os.environ["UAG_PACKED_BODY"] = flag
            pairs[name] = load_pair()
    finally:
        if before is None:
            os.environ.pop("UAG_PACKED_BODY", None)
        else:
            os.environ["UAG_PACKED_BODY"] = before
    times: dict[str, dict[int, list[float]]] = {name: {} for name in pairs}
    for r in range(rounds):
        for name in list(pairs)[:: 1 if r % 2 == 0 else -1]:
            pair = pairs[name]
            costs = measure_verify_costs(
                pair.target_lm, pair.target.tokenizer, max_rows=max_rows, context=context,
                repeats=1,
            )  # fmt: skip
            for cost in costs:
                times[name].setdefault(cost.rows, []).append(cost.total_ms)
    same = _same_hidden(pairs["int8"].target_lm, pairs["packed"].target_lm,
                        pairs["int8"].target.tokenizer, context=context, max_rows=max_rows)  # fmt: skip
    body = {name: slot_bytes(p.target_lm.lean.streamed()) for name, p in pairs.items()}
    packed = sum(
        getattr(m, "x8_bits", 8) < 8
        for layer in pairs["packed"].target_lm.lean.layers
        for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
    )
    lines = [
        # to the byte below 1 MB: a tiny test model's two bodies differ in the fourth decimal
        f"body MB: int8 {_mb(body['int8'])}, packed {_mb(body['packed'])} "
        f"({packed} products packed, UAG_PACKED_BODY={packed_flag}); context {context} tokens; "
        f"medians of {rounds} "
        f"alternating rounds; kernels {pairs['int8'].kernels}; hidden states of 1-{max_rows} "
        f"rows bitwise the same: {'yes' if same else 'NO'}",
        "",
        "| rows | int8 ms | packed ms | packed ÷ int8 |",
        "|---|---|---|---|",
    ]
    for rows in sorted(times["int8"]):
        a = statistics.median(times["int8"][rows])
        b = statistics.median(times["packed"][rows])
        lines.append(f"| {rows} | {a:.2f} | {b:.2f} | {b / a:.3f} |")
    return "\n".join(lines)


def _same_hidden(a: Any, b: Any, tokenizer: Any, *, context: int, max_rows: int) -> bool:
    """Whether two targets' forwards over 1..``max_rows`` rows after ``context`` tokens give
    bitwise the same hidden states."""
    ids = text_ids(tokenizer, context + max_rows)
    outs = []
    for lm in (a, b):
        lm.reset(ids[:context], rollback=True)
        lm.forward()
        rows = []
        for count in range(1, max_rows + 1):
            lm.ids.extend(ids[context : context + count])
            rows.append(lm.forward().clone())
            lm.truncate(context)
        lm.reset([], rollback=False)
        outs.append(rows)
    return all(torch.equal(x, y) for x, y in zip(*outs, strict=True))
