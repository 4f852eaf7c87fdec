"""Every decoder layer of a body in one native call (``csrc/layer.c``), for forwards of up to
16 rows (and the assistant's prompts: ``uag.runtime.lean.LeanBody.native_prompts``).

Why: once the matrix products run on ``skinny.c``, what is left of a decode step is ~25 small
torch calls per layer (norms, rotary embedding, cache write, attention, activation, residuals),
~9 ms of a ~19 ms SmolLM2 draft step. ``layer.c`` does them in plain loops around the same
products. It computes every row on its own, so a forward stays row-count invariant (lossless
verification); it rounds differently from the torch path (``tests/test_loop.py`` bounds the
difference), which is why one model always uses one path for every forward of up to 16 rows.

Used only when every linear of the model is a fusable ``NativeLinear`` (``--kernels native``).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import torch

from uag.kernels.choice import ROWWISE_MAX_ROWS
from uag.kernels.formats import Format
from uag.kernels.native import NativeLinear


class _Linear(ctypes.Structure):
    _fields_ = [
        ("weight", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("wsum", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("in_", ctypes.c_int64),
        ("out", ctypes.c_int64),
        ("format", ctypes.c_int64),
        ("block", ctypes.c_int64),
        ("affine", ctypes.c_int64),
        ("bits", ctypes.c_int64),
        ("offset", ctypes.c_int64),
        ("span", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("gemma", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scaling", ctypes.c_float),
        ("norm_in", ctypes.c_void_p),
        ("norm_post_attn", ctypes.c_void_p),
        ("norm_pre_ff", ctypes.c_void_p),
        ("norm_post_ff", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("kv_half", ctypes.c_int64),
    ]


class _Scratch(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("x", "qkv", "attn", "o", "gu", "act")]


def _linear(layer: NativeLinear | None) -> _Linear | None:
    """The C view of a native linear whose widths need no padding, else None."""
    if not isinstance(layer, NativeLinear):
        return None
    if layer.padded_in != layer.in_features or layer.padded_out != layer.out_features:
        return None
    return _Linear(
        layer.weight_ilv.data_ptr(),
        layer.params_ptr(),
        layer.wsum.data_ptr() if layer.format is Format.DYNAMIC_INT8 else None,
        None if layer.bias_padded is None else layer.bias_padded.data_ptr(),
        layer.in_features,
        layer.out_features,
        int(layer.format),
        layer.x8_block,
        int(layer.x8_affine),
        layer.x8_bits,
        layer.x8_offset,
        layer.x8_span,
    )


MAX_ROWS = ROWWISE_MAX_ROWS
"""Rows the scratch buffers hold at first (``reserve`` grows them for a prompt's pieces)."""


class NativeLayers:
    """Every layer of a ``uag.runtime.lean.LeanBody`` as a ``layer.c`` call; build with ``for_body``."""

    def __init__(self, body: Any, structs: list[_Layer], keep: list[Any]) -> None:
        self.body = body
        self.structs = (_Layer * len(structs))(*structs)
        """The layers' C structs, contiguous: one ``uag_decoder_layers`` call runs them all."""
        self._keep = keep  # tensors the structs point into
        self._call = body.layers[0].qkv.lib.uag_decoder_layers
        kinds = list(dict.fromkeys(body.layer_types))
        self._kinds = kinds  # the rotary tables' kinds, in the order cos/sin pass them
        self._kind = torch.tensor([kinds.index(k) for k in body.layer_types], dtype=torch.int64)
        self._cache_ptrs: tuple[Any, int, torch.Tensor, torch.Tensor] | None = None
        hq, hkv, d = body.groups * body.kv_heads, body.kv_heads, body.head_dim
        hidden, inter = structs[0].hidden, structs[0].inter
        widths = {
            "x": hidden,
            "qkv": (hq + 2 * hkv) * d,
            "attn": hq * d,
            "o": hidden,
            "gu": 2 * inter,
            "act": inter,
        }
        self._widths = widths
        self._buffers: dict[str, torch.Tensor] = {}
        self.scratch = _Scratch()
        self.rows = 0
        """Rows the scratch buffers hold (``reserve``)."""
        self.reserve(MAX_ROWS)
        self.kv_half = False
        """Whether the cache holds keys and values as half floats (``set_kv_half``)."""

    def reserve(self, rows: int) -> None:
        """Scratch for forwards of up to ``rows`` rows (a prompt's chunk: ``LeanBody``)."""
        if rows <= self.rows:
            return
        self._buffers = {k: torch.empty(rows, w) for k, w in self._widths.items()}
        self.scratch = _Scratch(**{k: b.data_ptr() for k, b in self._buffers.items()})
        self.rows = rows

    def set_kv_half(self, half: bool) -> None:
        """Read and write the cache's keys and values as half floats (``layer.c``), or floats."""
        for struct in self.structs:
            struct.kv_half = int(half)
        self.kv_half = half

    @classmethod
    def for_body(cls, body: Any) -> NativeLayers | None:
        """The native layers of ``body``, or None where a piece does not fit ``layer.c``."""
        if body.device.type != "cpu" or body.dtype != torch.float32:
            return None
        structs, keep = [], []
        for index, layer in enumerate(body.layers):
            pieces = [_linear(m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(p is None for p in pieces):
                return None
            norms = [n.weight.contiguous() for n in layer.norms]
            qk = [n.weight.contiguous() for n in layer.qk_norms] if layer.qk_norms else []
            keep += norms + qk
            window = body.window if body.layer_types[index] == "sliding_attention" else None
            gemma = body.gemma
            struct = _Layer(
                hidden=layer.o.out_features,
                heads=body.groups * body.kv_heads,
                kv_heads=body.kv_heads,
                head_dim=body.head_dim,
                inter=layer.down.in_features,
                gemma=int(gemma),
                window=window or 0,
                eps=layer.norms[0].eps,
                scaling=body.scaling,
                norm_in=norms[0].data_ptr(),
                norm_post_attn=norms[1].data_ptr(),
                norm_pre_ff=norms[2].data_ptr() if gemma else None,
                norm_post_ff=norms[3].data_ptr() if gemma else None,
                q_norm=qk[0].data_ptr() if qk else None,
                k_norm=qk[1].data_ptr() if qk else None,
                qkv=pieces[0],
                o=pieces[1],
                gate_up=pieces[2],
                down=pieces[3],
            )
            structs.append(struct)
        return cls(body, structs, keep)

    def __call__(
        self,
        hidden: torch.Tensor,
        cache: Any,
        start: int,
        tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """``hidden`` ``[n, h]`` (updated in place; contiguous) through every layer, at
        positions ``start`` on; ``tables``: each layer kind's whole rotary cos/sin table,
        float32 ``[P, head_dim]`` from position 0 (``uag.runtime.lean._Rope.table``), read
        from row ``start`` by address."""
        n = hidden.shape[0]
        self.reserve(n)
        if (cache.keys[0].dtype == torch.float16) != self.kv_half:
            raise RuntimeError("cache dtype does not match the native layers' (set_kv_half)")
        keys, values = self._addresses(cache)
        row = start * self.body.head_dim * 4  # bytes to the first row of a float32 table
        count = len(self._kinds)
        cos = (ctypes.c_void_p * count)(*(tables[k][0].data_ptr() + row for k in self._kinds))
        sin = (ctypes.c_void_p * count)(*(tables[k][1].data_ptr() + row for k in self._kinds))
        self._call(
            self.structs,
            len(self.structs),
            hidden.data_ptr(),
            n,
            start,
            keys.data_ptr(),
            values.data_ptr(),
            cache.capacity,
            self._kind.data_ptr(),
            cos,
            sin,
            ctypes.byref(self.scratch),
        )
        return hidden

    def _addresses(self, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Each layer's key and value tensor addresses, as int64 tensors for the C call;
        rebuilt when the cache is another one or has grown (``LeanCache.reserve`` replaces
        its tensors), else reused (a step's Python cost is what the one call saves). The cache
        is held weakly, so an old one is freed as before."""
        held = self._cache_ptrs
        if held is None or held[0]() is not cache or held[1] != cache.capacity:
            keys = torch.tensor([k.data_ptr() for k in cache.keys], dtype=torch.int64)
            values = torch.tensor([v.data_ptr() for v in cache.values], dtype=torch.int64)
            held = self._cache_ptrs = (weakref.ref(cache), cache.capacity, keys, values)
        return held[2], held[3]

    def norm(self, x: torch.Tensor, norm: Any, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[n, h]`` (contiguous fp32) through ``norm`` (a ``uag.runtime.lean._Norm``) with the
        layers' own RMS norm: the body's final norm, on the path these layers take. Into a new
        tensor, or into ``out`` (contiguous, ``x``'s shape; may be ``x``): a decode step passes
        its own hidden state, since an allocation after the weights' stream costs ~30 us."""
        y = torch.empty_like(x) if out is None else out
        lib = self.body.layers[0].qkv.lib
        eps = ctypes.c_float(norm.eps)
        lib.uag_rms_norm_rows(
            x.data_ptr(), x.shape[0], x.shape[1], norm.weight.data_ptr(), eps, y.data_ptr()
        )
        return y
