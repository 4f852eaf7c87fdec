"""CPU kernels for a cheap, row-count-invariant verify (and a cheaper assistant).

Why this module exists: a decoding step on a CPU is memory-bound, so a verify over k ≤ 9
positions should cost about one step. MKL's ``F.linear`` does not get there for these skinny
shapes (Gemma's 262,144 × 640 head: ~75–100 ms for 1 row, ~150–250 ms for 2–8), while oneDNN
with the weight reordered once into its blocked layout stays close to one row's cost. The same
ops are what ``torch.compile``'s CPU freezing pass emits.

Losslessness needs more than speed: target-alone decoding (one row per forward) is the
reference, and a verify computes the same positions several rows at a time. Two things make a
row's numbers independent of how many rows share the forward, so greedy UAG equals target-alone
bit for bit, by construction:

* oneDNN's packed linear computes each row the same way for 1–16 rows (checked per weight shape
  when packing, ``row_invariance``; where one row alone differs, it is padded to two);
* attention runs row by row (``rowwise_attention``): each query row attends to exactly the keys
  its mask allows, in a call of its own, as it would in a one-row forward.

The oneDNN ops are private to torch (``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``), so they live only here, behind ``fast_kernels_available()``, with the
plain path as the tested fallback (where the speculative loop guards near-ties instead).
Measured on torch 2.13.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from uag.errors import UagError

KERNEL_CHOICES: tuple[str, ...] = ("auto", "native", "onednn", "plain")
ROWWISE_MAX_ROWS = 16
"""Forwards of up to this many rows run attention row by row (verify and decode); longer ones
(prompt prefill, the same call in every mode) use the fused kernel."""
ROWWISE_ATTENTION = "uag_rowwise"
"""Name under which ``rowwise_attention`` is registered with Transformers."""

Invariance = Literal["invariant", "pad-single-row", "variant"]


@functools.cache
def fast_kernels_available() -> bool:
    """True when oneDNN's prepacked fp32 linear exists and agrees with ``F.linear`` here."""
    if os.environ.get("UAG_KERNELS", "") == "plain":
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=gen)
        b = torch.randn(48, generator=gen)
        x = torch.randn(3, 40, generator=gen)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-5))
    except (AttributeError, RuntimeError):  # op missing in this torch build, or unsupported CPU
        return False


def resolve_kernels(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` → the fastest kernels usable here: ``native`` (``uag.kernels.native``), else ``onednn``
    on a CPU with float32 weights, else ``plain`` (``F.linear``: GPUs, other dtypes).

    Asking for ``native`` or ``onednn`` where it cannot run is an error, not a silent fallback;
    ``auto`` on a float32 CPU without the native kernels says why on stderr (once).
    """
    from uag.kernels.native import native_unavailable

    if choice not in KERNEL_CHOICES:
        raise UagError(f"unknown kernels {choice!r}: use {', '.join(KERNEL_CHOICES)}")
    cpu32 = device.type == "cpu" and dtype == torch.float32
    onednn = cpu32 and fast_kernels_available()
    if choice == "onednn" and not onednn:
        raise UagError(
            "--kernels onednn needs float32 weights on a CPU whose torch build has oneDNN "
            f"(here: {device.type}, {dtype}, oneDNN usable: {fast_kernels_available()})"
        )
    if choice in ("native", "auto") and cpu32 and native_unavailable() is None:
        return "native"
    if choice == "native":
        why = (
            native_unavailable()
            if cpu32
            else f"it runs on float32 CPUs (here: {device.type}, {dtype})"
        )
        raise UagError(f"--kernels native is unavailable: {why}")
    if choice == "auto":
        mode = "onednn" if onednn else "plain"
        if cpu32 and os.environ.get("UAG_KERNELS", "") not in ("onednn", "plain"):
            _say_native_unavailable(str(native_unavailable()), mode)
        return mode
    return choice


@functools.cache
def _say_native_unavailable(why: str, mode: str) -> None:
    """Tell the user, once, that ``auto`` runs without the native kernels and why: a build that
    fails (no compiler, headers missing from an install) must not just run slower in silence.
    Not said when ``UAG_KERNELS`` asked for other kernels."""
    print(
        f"uag: native kernels unavailable ({why}); using {mode} kernels instead (slower)",
        file=sys.stderr,
    )


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def row_invariance(
    packed: torch.Tensor, in_features: int, *, max_rows: int = ROWWISE_MAX_ROWS
) -> Invariance:
    """Does a row's result depend on how many rows share the call? Checked bitwise, 1..max_rows.

    ``pad-single-row``: one row alone differs, but padded with a second row it equals every
    larger call (oneDNN picks a matrix-vector kernel for a single row on some CPUs).
    """
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(max_rows, in_features, generator=gen)
    full = _onednn_linear(x, packed, None)
    if any(
        not torch.equal(_onednn_linear(x[:k], packed, None), full[:k]) for k in range(2, max_rows)
    ):
        return "variant"
    if torch.equal(_onednn_linear(x[:1], packed, None), full[:1]):
        return "invariant"
    return (
        "pad-single-row"
        if torch.equal(_onednn_linear(x[:2], packed, None), full[:2])
        else "variant"
    )


class PackedLinear(nn.Module):
    """An fp32 linear whose weight oneDNN reordered once (CPU only); the plain weight is dropped.

    ``invariance`` is measured for this weight's shape when packing (``row_invariance``).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().float(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.invariance: Invariance = _shape_invariance(
            self.packed, self.out_features, self.in_features
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [n, in]
        if not rows.is_contiguous():
            rows = rows.contiguous()
        if rows.shape[0] == 1 and self.invariance == "pad-single-row":
            y = _onednn_linear(rows.expand(2, -1).contiguous(), self.packed, self.bias)[:1]
        else:
            y = _onednn_linear(rows, self.packed, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


_INVARIANCE_BY_SHAPE: dict[tuple[int, int], Invariance] = {}


def _shape_invariance(packed: torch.Tensor, out_features: int, in_features: int) -> Invariance:
    """``row_invariance`` once per weight shape (kernels are chosen by shape, not by values)."""
    key = (out_features, in_features)
    if key not in _INVARIANCE_BY_SHAPE:
        _INVARIANCE_BY_SHAPE[key] = row_invariance(packed, in_features)
    return _INVARIANCE_BY_SHAPE[key]


def release_pages(tensor: torch.Tensor) -> None:
    """Ask Linux to page out ``tensor``'s memory where that loses nothing (``MADV_PAGEOUT``).

    Why: Transformers maps checkpoint weights from the file; packing or quantising reads every
    page, and those clean file pages would stay in the resident set beside the new copy. Paged
    out, they cost nothing until read again (an embedding then faults in only the rows it looks
    up). Anonymous memory is left as it is (no swap here), so this never changes a value.
    """
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 21)  # MADV_PAGEOUT
    except (OSError, AttributeError):
        return  # an advisory call: nothing to do where it is missing


def _swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module], skip: set[int]) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` (except ids in ``skip``); return the count.

    The replaced weights' pages are released (``release_pages``): only the new copy stays.
    """
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and id(child) not in skip
    ]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
        release_pages(child.weight.detach())
    return len(swaps)


HEAD_CHUNK_ROWS = 32768
"""Vocabulary rows per packed block of the head: packing block by block, with each block's
source pages released at once, keeps the transient peak at one block instead of a whole head."""


class PackedHead(nn.Module):
    """An LM head packed for oneDNN in blocks of vocabulary rows; logits ``[n, V]`` in one call.

    Each block is an independent product, so a row's logits stay independent of the row count
    exactly as with one ``PackedLinear``.
    """

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        weight = head.weight.detach()
        bias = None if head.bias is None else head.bias.detach()
        self.out_features = int(weight.shape[0])
        self.blocks = nn.ModuleList()
        kinds: set[Invariance] = set()
        for start in range(0, self.out_features, HEAD_CHUNK_ROWS):
            rows = min(HEAD_CHUNK_ROWS, self.out_features - start)
            part = nn.Linear(weight.shape[1], rows, bias=bias is not None, device="meta")
            part.weight = nn.Parameter(weight[start : start + HEAD_CHUNK_ROWS], requires_grad=False)
            part.bias = (
                None if bias is None else nn.Parameter(bias[start : start + HEAD_CHUNK_ROWS])
            )
            block = PackedLinear(part)
            self.blocks.append(block)
            kinds.add(block.invariance)
            release_pages(part.weight.detach())  # a tied embedding faults rows back in on lookup
        self.invariance: Invariance = (
            "variant"
            if "variant" in kinds
            else ("pad-single-row" if "pad-single-row" in kinds else "invariant")
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[n, h]`` → logits ``[n, V]``."""
        if len(self.blocks) == 1:
            return self.blocks[0](hidden)
        return torch.cat([block(hidden) for block in self.blocks], dim=-1)


def fast_head_for(model: Any, mode: str) -> nn.Module:
    """The model's LM head on ``mode``'s kernels (``native`` or ``onednn``), built once per model
    and kept beside it.

    ``native``: ``uag.kernels.screened.ScreenedHead``, an int8 copy (Gemma: 168 MB) that screens and the
    original fp32 weight for the few candidate rows. ``onednn``: a packed copy (671 MB). Either
    way the original's file pages are released and fault back in only for the rows read.
    """
    head = getattr(model, "_uag_fast_head", None)
    if head is None:
        if mode == "native":
            from uag.kernels.screened import ScreenedHead

            linear = model.get_output_embeddings()
            head = ScreenedHead(linear)  # int8 screening, exact fp32 argmax
            release_pages(linear.weight.detach())
        else:
            head = PackedHead(model.get_output_embeddings())
        model._uag_fast_head = head
    return head


def is_row_invariant(model: Any, *, rowwise_attention: bool) -> bool:
    """True when every linear of ``model`` and its fast head compute a row independently of the
    row count (1..``ROWWISE_MAX_ROWS``) and attention runs row by row (``rowwise_attention``:
    the lean forward's, or Transformers' with ``use_rowwise_attention``)."""
    from uag.kernels.native import NativeLinear
    from uag.kernels.screened import ScreenedHead

    fast = (PackedLinear, NativeLinear, ScreenedHead)
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, *fast))]
    head = getattr(model, "_uag_fast_head", None)
    checked = [m for m in [*linears, head] if isinstance(m, (*fast, PackedHead))]
    return (
        (rowwise_attention or model.config._attn_implementation == ROWWISE_ATTENTION)
        and all(not isinstance(m, nn.Linear) or m is model.get_output_embeddings() for m in linears)
        and head is not None
        and all(m.invariance != "variant" for m in checked)
    )


# --- attention ---------------------------------------------------------------------------------


def _allowed_range(
    mask_row: torch.Tensor | None, *, row: int, rows: int, keys: int
) -> tuple[int, int]:
    """The contiguous key range ``[lo, hi)`` query ``row`` of ``rows`` may attend to."""
    if mask_row is None:  # no mask: causal over the keys, the new rows last
        return 0, keys - rows + row + 1
    allowed = mask_row if mask_row.dtype == torch.bool else mask_row == 0
    idx = allowed.nonzero()
    if idx.numel() == 0:
        raise RuntimeError(f"attention row {row} may attend to no key")
    lo, hi = int(idx[0]), int(idx[-1]) + 1
    if hi - lo != idx.numel():
        raise RuntimeError("row-wise attention needs a contiguous key range per row")
    return lo, hi


def rowwise_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers attention interface; each query row in a call of its own (≤ 16 rows).

    ``query`` ``[b, hq, n, d]``, ``key``/``value`` ``[b, hkv, L, d]`` → ``[b, n, hq, d]``.
    A row's result then depends only on its query and the keys it may see, never on how many
    rows share the forward: one SDPA call with one query and no mask, as in one-row decoding.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    rows, keys = query.shape[2], key.shape[2]
    if rows > ROWWISE_MAX_ROWS or query.shape[0] != 1 or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if attention_mask is not None and attention_mask.shape[-1] != keys:
        raise RuntimeError(f"attention mask covers {attention_mask.shape[-1]} keys, not {keys}")
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [1, hq, L, d]
    outs = []
    for row in range(rows):
        mask_row = None if attention_mask is None else attention_mask[0, 0, row]
        lo, hi = _allowed_range(mask_row, row=row, rows=rows, keys=keys)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, row : row + 1], key[:, :, lo:hi], value[:, :, lo:hi], scale=scaling
            )
        )
    out = torch.cat(outs, dim=2)  # [1, hq, n, d]
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register_rowwise_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)
    AttentionMaskInterface.register(ROWWISE_ATTENTION, sdpa_mask)


def use_rowwise_attention(model: Any) -> None:
    """Route ``model``'s attention through ``rowwise_attention`` (batch size 1 decoding)."""
    _register_rowwise_attention()
    model.set_attn_implementation(ROWWISE_ATTENTION)


def swap_linears(model: Any, mode: str, *, head: bool) -> int:
    """Swap ``model``'s fp32 linears (its LM head too if ``head``) for ``mode``'s kernels:
    ``native`` or ``onednn``."""
    if mode == "native":
        from uag.kernels.native import NativeLinear

        make: Callable[[nn.Linear], nn.Module] = NativeLinear
    else:
        make = PackedLinear
    return _swap_linears(model, make, set() if head else {id(model.get_output_embeddings())})


def accelerate_target(model: Any, mode: str) -> nn.Module:
    """Put the target's linears and head on ``mode``'s kernels, make Transformers' attention row
    by row (for architectures without a lean forward); return the fast head."""
    swap_linears(model, mode, head=False)
    use_rowwise_attention(model)
    return fast_head_for(model, mode)


# --- the assistant's int8 linears ---------------------------------------------------------------


@functools.cache
def int8_backend() -> str:
    """``fbgemm`` (dynamic int8, fastest on AVX2/AVX-512 CPUs) when its ops work, else ``int8pack``.

    fbgemm's quantised-tensor API is deprecated in torch (its creation warns); when it is gone,
    ``torch._weight_int8pack_mm`` (weight-only int8, the kernel torchao uses) takes over.
    """
    try:
        layer = _FbgemmLinear(nn.Linear(8, 4))
        layer(torch.ones(2, 8))
        return "fbgemm"
    except (AttributeError, RuntimeError, NotImplementedError):
        return "int8pack"


def _symmetric_int8(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight rounded to int8 with one scale per output channel (symmetric): ``(q, scales)``."""
    weight = linear.weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [out]
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def _quiet_per_channel_int8(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        # torch warns that quantised tensors are deprecated; int8_backend() has the fallback.
        warnings.filterwarnings("ignore", message=r".*quantize_per_channel.*", category=UserWarning)
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        return torch.quantize_per_channel(weight, scales.double(), zero, 0, torch.qint8)


class _FbgemmLinear(nn.Module):
    """Dynamic int8 (weights per channel, activations per call), through fbgemm's packed GEMM."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # as _symmetric_int8's
        qweight = _quiet_per_channel_int8(weight, scales)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        # reduce_range=True: AVX2's 8-bit multiply-add saturates without it.
        y = torch.ops.quantized.linear_dynamic(rows, self.packed, True)
        return y.reshape(*x.shape[:-1], self.out_features)


class _Int8PackLinear(nn.Module):
    """Weight-only int8 (one scale per output channel), activations in fp32."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        qweight, scales = _symmetric_int8(linear)
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        y = torch._weight_int8pack_mm(rows, self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def quantize_int8(model: Any, *, backend: str | None = None) -> Any:
    """Int8 linear layers everywhere, the LM head included (CPU, float32 models), in place.

    A cheaper assistant: only the target decides the output, so the assistant's precision never
    changes what is generated. A tied embedding stays fp32; only the head's product is int8.
    ``backend``: ``native`` (weights on GGUF Q4_1's grid as 4-bit blocks times int8 activations
    per block, ``q4.c``; other weights int8 times per-row 7-bit activations, ``q8.c``),
    ``fbgemm`` or ``int8pack``;
    default ``int8_backend()``.
    """
    kind = backend or int8_backend()
    if kind == "native":
        from uag.kernels.native import NativeLinear

        make: Callable[[nn.Linear], nn.Module] = functools.partial(
            NativeLinear, int8=True, dynamic=True, q4=True
        )
    else:
        make = _FbgemmLinear if kind == "fbgemm" else _Int8PackLinear
    _swap_linears(model, make, set())
    return model
