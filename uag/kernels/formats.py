"""The weight storage formats of a ``uag.kernels.native.NativeLinear``, one row each.

A linear holds one ``Format``; everything that depends on it reads this table: which C function
multiplies it, which tensor the kernel's parameter pointer reads, whether the weights can be
gathered as fp32 rows, and how to turn the stored blocks back into fp32 weights. The codes are
``csrc/formats.h``'s (read from it here), so C and Python share one numbering; adding a format is
a line there, a row here and its kernel. (ggml's ``type_traits`` table, on a smaller scale.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Protocol

import torch

CSRC = Path(__file__).parent / "csrc"
"""The kernels' C sources and headers (shipped in the wheel: pyproject's package-data)."""

BLOCK_ROWS, K_STEP, Q8_K_STEP, BLOCK_K, AFFINE_K = 8, 1, 4, 32, 16
"""The kernels' layout: blocks of 8 outputs, their weights side by side for every input
(``skinny.c``) or for every 4 consecutive inputs (``q8.c``); block-scaled int8 has one scale
per ``BLOCK_K`` inputs of each output, block-affine uint8 one scale and one base per
``AFFINE_K``."""
X8_GROUP, X8_QUAD = 16, 4
"""``exact.c``'s layout: 16 outputs' 4 consecutive weights side by side, ``[N/16][K/4][16][4]``,
block parameters ``[N/16][K/block][1 or 2][16]`` (scales, then bases for the affine format)."""


def _codes(header: Path) -> dict[str, int]:
    """``{name: code}`` of ``enum uag_format`` (``UAG_FMT_<name> = <code>``)."""
    return {
        m[1]: int(m[2]) for m in re.finditer(r"\bUAG_FMT_(\w+)\s*=\s*(\d+)", header.read_text())
    }


_CODE = _codes(CSRC / "formats.h")


class Format(IntEnum):
    """How a native linear stores its weight (codes: ``csrc/formats.h``)."""

    FP32 = _CODE["FP32"]
    """fp32 in ``skinny.c``'s ``[N/8][K][8]``."""
    INT8 = _CODE["INT8"]
    """int8 with one scale per output, fp32 activations (weight-only, ``skinny.c``)."""
    BLOCK_INT8 = _CODE["BLOCK_INT8"]
    """int8 times a scale per block of 32, *equal* to the fp32 weight (``skinny.c``)."""
    BLOCK_AFFINE = _CODE["BLOCK_AFFINE"]
    """uint8 times a scale plus a base per block of 16, equal to the fp32 weight (``skinny.c``)."""
    DYNAMIC_INT8 = _CODE["DYNAMIC_INT8"]
    """int8 with one scale per output times int8 activations (``q8.c``, approximate)."""
    Q4 = _CODE["Q4"]
    """4-bit blocks of 32 times int8 activations (``q4.c``, approximate)."""
    EXACT = _CODE["EXACT"]
    """An exact block form's integers times the activations as exact integer sums (``exact.c``)."""


class Stored(Protocol):
    """What a format's functions read of a layer (``NativeLinear``)."""

    weight_ilv: torch.Tensor
    block_scales: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    k_step: int
    x8_block: int
    x8_affine: bool
    x8_bits: int
    x8_offset: int
    x8_span: int


@dataclass(frozen=True)
class Spec:
    """One format's row."""

    kernel: str
    """The C function computing ``y = x @ W^T (+ bias)`` (``csrc/kernels.h``)."""
    label: str
    """What ``NativeLinear``'s repr calls it."""
    params: str | None
    """The layer's tensor the kernel's parameter pointer reads (``scales``, ``block_scales``)."""
    per_entry: int
    """Outputs per leading index of the stored weight (``NativeLinear.prefix``, ``fuse``)."""
    dequantize: Callable[[Stored], torch.Tensor]
    """The weight as the kernel sees it, fp32 ``[out, in]``."""
    block: int = 0
    """Formats in ``skinny.c``'s fp32 layout whose weights are exact: inputs per block of
    parameters (0: fp32 itself, or not such a format)."""
    widen: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """Formats whose stored values are the fp32 weights in ``skinny.c``'s layout (fp32 and the
    exact block forms): ``(integers, their block's parameters [..., 1 or 2])`` → fp32 weights,
    rounded as the kernels widen them (``q · s``, or ``fl(q · s) + b``). None: rows and columns
    cannot be read back (``NativeLinear.rows``)."""


def block_parameters(layer: Stored) -> torch.Tensor:
    """An exact block form's parameters as ``[N/8, K/block, 1 or 2, 8]`` (block int8 stores
    ``[N/8, K/32, 8]``: one scale, no base)."""
    bs = layer.block_scales
    return bs.unsqueeze(2) if bs.dim() == 3 else bs


def _fp32_layout(layer: Stored) -> torch.Tensor:
    """The stored values of ``skinny.c``'s (or ``q8.c``'s) layout as ``[out, in]`` fp32."""
    blocks, steps = layer.weight_ilv.shape[:2]
    w = layer.weight_ilv.permute(0, 2, 1, 3).reshape(blocks * BLOCK_ROWS, steps * layer.k_step)
    return w[: layer.out_features, : layer.in_features].float()


def _widen_scale(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return q * p[..., 0]  # one exact product


def _widen_affine(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return (q * p[..., 0]) + p[..., 1]  # two roundings, as the kernel: (q · s) + b


def _dequantize_blocks(
    layer: Stored, block: int, widen: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    p = block_parameters(layer)
    blocks, count, kinds = p.shape[:3]
    p = p.permute(0, 3, 1, 2).reshape(blocks * BLOCK_ROWS, count, kinds)[: layer.out_features]
    return widen(_fp32_layout(layer), p.repeat_interleave(block, dim=1))


def _dequantize_scaled(layer: Stored) -> torch.Tensor:
    return _fp32_layout(layer) * layer.scales[: layer.out_features, None]


def _dequantize_q4(layer: Stored) -> torch.Tensor:
    tiles, blocks = layer.weight_ilv.shape[:2]
    raw = layer.weight_ilv.view(tiles, blocks, 4, BLOCK_ROWS, 4)  # [tile, b, v, j, i]
    nib = torch.stack([raw & 15, raw >> 4], dim=-1)  # [tile, b, v, j, i, half]
    q = nib.permute(0, 3, 1, 2, 5, 4).reshape(tiles * BLOCK_ROWS, blocks, BLOCK_K)
    p = layer.block_scales.float().permute(0, 3, 1, 2).reshape(tiles * BLOCK_ROWS, blocks, 2)
    return (p[..., 1:] + p[..., :1] * q.float()).reshape(layer.out_features, -1)


PACKED_BITS = (4, 5, 6)
"""The widths ``exact.c`` reads packed integers at (``pack_integers``); else int8."""


def packed_block_bytes(block: int, bits: int) -> int:
    """Bytes of one group's block of ``block`` inputs at ``bits`` (``exact.c``'s
    ``packed_bytes``): the nibbles, then the high bits' planes."""
    if bits == 8:
        return block * X8_GROUP
    return block * 8 + (64 if bits == 5 else 64 * (block // 16) if bits == 6 else 0)


def pack_integers(
    weight: torch.Tensor, block: int, *, widths: tuple[int, ...] = PACKED_BITS
) -> tuple[torch.Tensor, int, int] | None:
    """``(packed uint8 [groups, K/block, bytes], bits, offset)``: ``exact.c``'s int8 layout
    ``weight`` (``[groups, K/4, 16, 4]``) at the fewest of ``widths`` its range needs,
    each value stored as ``q - offset`` (layout in ``exact.c``'s header), or None where the
    range needs 7 or 8 bits. Why: a GGUF body's Q4_K / Q5_0 / Q6_K integers read at their
    own width instead of a byte each; ``exact.c`` unpacks them to the same integers, so every
    product is bitwise the int8 layout's."""
    lo, hi = int(weight.min()), int(weight.max())
    bits = next((b for b in sorted(widths) if hi - lo < 1 << b), None)
    if bits is None or block % 16:
        return None
    groups, quads = weight.shape[0], block // 4
    u = (weight.to(torch.int16) - lo).to(torch.uint8).reshape(groups, -1, quads, 64)
    nibbles = u & 15
    parts = [(nibbles[:, :, 0::2] | (nibbles[:, :, 1::2] << 4)).flatten(2)]
    high = u >> 4
    if bits == 5:  # bit r: quad r's bit 4
        parts.append(sum((high[:, :, r] << r for r in range(quads)), torch.zeros_like(u[:, :, 0])))
    elif bits == 6:  # vector v, bits 2t and 2t + 1: quad 4v + t's bits 4 and 5
        for v in range(quads // 4):
            four = (high[:, :, 4 * v + t] << (2 * t) for t in range(4))
            parts.append(sum(four, torch.zeros_like(u[:, :, 0])))
    return torch.cat(parts, dim=-1).contiguous(), bits, lo


def exact_integers(layer: Stored) -> torch.Tensor:
    """``exact.c``'s integers of ``layer`` in the int8 layout ``[groups, K/4, 16, 4]``,
    unpacked where they are packed (``exact.c``'s ``unpack_ref``, in torch)."""
    w = layer.weight_ilv
    if layer.x8_bits == 8:
        return w
    groups, blocks, quads = w.shape[0], w.shape[1], layer.x8_block // 4
    nib = w[..., : layer.x8_block * 8].reshape(groups, blocks, quads // 2, 1, 64)
    u = torch.cat([nib & 15, nib >> 4], dim=3).reshape(groups, blocks, quads, 64).to(torch.int16)
    high = w[..., layer.x8_block * 8 :].to(torch.int16)
    r = torch.arange(quads)
    if layer.x8_bits == 5:
        u |= ((high[:, :, None, :] >> r[:, None]) & 1) << 4
    elif layer.x8_bits == 6:
        planes = high.reshape(groups, blocks, quads // 4, 64)[:, :, r // 4]
        u |= ((planes >> (2 * (r % 4))[:, None]) & 3) << 4
    q = (u + layer.x8_offset).to(torch.int8)
    return q.reshape(groups, blocks * quads, X8_GROUP, X8_QUAD)


FACTOR_SPAN = 256
"""Inputs per span of ``exact.c``'s factored block parameters: a k-quant's super-block, whose
fp16 scale (and minimum) every one of its 8 or 16 blocks' 6-bit multipliers share."""


def span_bytes(kinds: int, blocks: int) -> int:
    """Bytes of one group's span of factored parameters (``exact.c``'s ``span_bytes``):
    ``kinds`` fp32 units for 16 outputs, then ``kinds`` x ``blocks`` int8 multipliers."""
    return kinds * (64 + X8_GROUP * blocks)


def _factor_span(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(unit fp32 [...], mult int8 [..., B])`` with ``fl(unit · mult)`` equal to every fp32
    ``values [..., B]``, or None where some row of B has no such pair. The unit is the greatest
    common divisor of the row's values (each an integer times a power of two, aligned to the
    row's smallest exponent), so the multipliers are as small as the values allow."""
    mant, exp = torch.frexp(values)
    ints = torch.ldexp(mant.double(), torch.full_like(exp, 24)).long()  # |ints| < 2^24, exact
    exp = exp.long() - 24
    nonzero = ints != 0
    low = torch.where(nonzero, exp, 1 << 20).amin(dim=-1, keepdim=True)
    shift = torch.where(nonzero, exp - low, 0)
    if int(shift.max()) > 38:  # ints << shift would leave int64
        return None
    aligned = ints << shift
    g = aligned[..., 0].abs()
    for i in range(1, aligned.shape[-1]):
        g = torch.gcd(g, aligned[..., i])
    g = torch.where(g == 0, 1, g)
    mult = aligned // g[..., None]
    flip = mult.amax(dim=-1) > 127  # a negative unit: int8's -128 (Q6_K's scales reach it)
    mult = torch.where(flip[..., None], -mult, mult)
    if int(mult.max()) > 127 or int(mult.min()) < -128:
        return None
    low = torch.where(low[..., 0] == 1 << 20, 0, low[..., 0])
    unit = torch.ldexp(torch.where(flip, -g, g).double(), low.double()).float()
    mult8 = mult.to(torch.int8)
    if not bool((unit[..., None] * mult8.float() == values).all()):
        return None  # a unit beyond fp32's range or precision
    return unit, mult8


def factor_parameters(params: torch.Tensor, block: int) -> torch.Tensor | None:
    """``exact.c``'s fp32 block parameters ``[groups, K/block, kinds, 16]`` as its factored
    layout (uint8 ``[groups, K/FACTOR_SPAN, span_bytes]``), holding the same floats; None where
    K is not a whole number of spans or some span's values do not factor into an fp32 unit
    times int8 multipliers (``_factor_span``)."""
    groups, count, kinds, width = params.shape
    blocks = FACTOR_SPAN // block
    if FACTOR_SPAN % block or count % blocks:
        return None
    spans = count // blocks
    values = params.reshape(groups, spans, blocks, kinds, width).permute(0, 1, 3, 4, 2)
    found = _factor_span(values.contiguous())  # rows: [groups, spans, kinds, 16] of B values
    if found is None:
        return None
    unit, mult = found
    mult = mult.permute(0, 1, 2, 4, 3)  # [groups, spans, kinds, blocks, 16]
    out = torch.cat(
        [unit.contiguous().view(torch.uint8).reshape(groups, spans, -1),
         mult.contiguous().view(torch.uint8).reshape(groups, spans, -1)],
        dim=-1,
    )  # fmt: skip
    assert out.shape[-1] == span_bytes(kinds, blocks)
    return out.contiguous()


def exact_parameters(layer: Stored) -> torch.Tensor:
    """``exact.c``'s block parameters of ``layer`` as fp32 ``[groups, K/block, kinds, 16]``,
    multiplied out where they are factored (``exact.c``'s ``params_ref``: the same floats)."""
    kinds = 2 if layer.x8_affine else 1
    if not layer.x8_span:
        return layer.block_scales.reshape(layer.block_scales.shape[0], -1, kinds, X8_GROUP)
    blocks = layer.x8_span // layer.x8_block
    raw = layer.block_scales
    groups, spans = raw.shape[:2]
    unit = raw[..., : kinds * 64].contiguous().view(torch.float32)
    unit = unit.reshape(groups, spans, kinds, 1, X8_GROUP)
    mult = raw[..., kinds * 64 :].contiguous().view(torch.int8)
    mult = mult.reshape(groups, spans, kinds, blocks, X8_GROUP).float()
    values = (unit * mult).permute(0, 1, 3, 2, 4)  # [groups, spans, blocks, kinds, 16]
    return values.reshape(groups, spans * blocks, kinds, X8_GROUP)


def _dequantize_exact(layer: Stored) -> torch.Tensor:
    # exact.c multiplies q · s (+ b) exactly; this rounds each to fp32
    groups = layer.weight_ilv.shape[0]
    q = exact_integers(layer).permute(0, 2, 1, 3).reshape(groups * X8_GROUP, -1).float()
    p = (
        exact_parameters(layer)
        .permute(0, 3, 1, 2)
        .reshape(groups * X8_GROUP, -1, 2 if layer.x8_affine else 1)
    )
    p = p.repeat_interleave(layer.x8_block, dim=1)
    w = q * p[..., 0] + (p[..., 1] if layer.x8_affine else 0.0)
    return w[: layer.out_features, : layer.in_features]


def _exact_fp32(
    kernel: str, form: str, block: int, widen: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> Spec:
    """The row of an fp32 weight stored in an exact block form (``form``): ``kernel`` reads
    the blocks of ``block`` inputs, ``widen`` turns a block's integers and parameters back into
    the fp32 weights."""
    return Spec(
        kernel,
        f"fp32 (as exact {form})",
        "block_scales",
        BLOCK_ROWS,
        lambda layer: _dequantize_blocks(layer, block, widen),
        block=block,
        widen=widen,
    )


FORMATS: dict[Format, Spec] = {
    Format.FP32: Spec(
        "uag_linear_f32", "fp32", None, BLOCK_ROWS, _fp32_layout, widen=lambda q, p: q
    ),
    Format.INT8: Spec(
        "uag_linear_i8", "int8 weight-only", "scales", BLOCK_ROWS, _dequantize_scaled
    ),
    Format.BLOCK_INT8: _exact_fp32("uag_linear_b8", "block int8", BLOCK_K, _widen_scale),
    Format.BLOCK_AFFINE: _exact_fp32("uag_linear_a8", "block affine", AFFINE_K, _widen_affine),
    Format.DYNAMIC_INT8: Spec(
        "uag_linear_q8", "int8 dynamic", "scales", BLOCK_ROWS, _dequantize_scaled
    ),
    Format.Q4: Spec(
        "uag_linear_q4", "4-bit blocks x int8 dynamic", "block_scales", BLOCK_ROWS, _dequantize_q4
    ),
    Format.EXACT: Spec(
        "uag_linear_x8", "exact integer blocks", "block_scales", X8_GROUP, _dequantize_exact
    ),
}
"""Every format's row: ``FORMATS[layer.format]``."""

EXACT_BLOCKS = (Format.BLOCK_INT8, Format.BLOCK_AFFINE)
"""The forms found from the values alone that equal the fp32 weights, in the order tried."""
