"""A GGUF's k-quant blocks as the exact block forms they are, for the native kernels.

Why: a model loaded from GGUF reaches uag as fp32 weights (Transformers de-quantises), and the
exact block forms found from those values alone (``uag.kernels.native.block_affine``) take a
block's smallest weight as its base: a number on no common grid. The file holds more: Q4_K's
scale and minimum of each block of 32 are one fp16 per 256 inputs times a 6-bit integer, and
Q6_K's scale of each block of 16 one fp16 per 256 times an int8, with no base at all. Read from
the file, ``exact.c`` can keep those parameters factored (``NativeLinear.factor``): 571 of the
1.5B Qwen body's 1,881 MB a token were fp32 scales and bases, factored 123.

Nothing is taken on trust: a linear gets its file's blocks (``KQuant``) only where their
weights, rounded as ``gguf``'s own de-quantiser rounds them, equal the fp32 weight loaded,
bitwise. Elsewhere (another permutation of rows, another format, a hub checkpoint) the linear
keeps the form found from its values.

The tensor directory is read here, not by ``gguf.GGUFReader``: the reader decodes every
metadata value into numpy objects (Gemma 3's 262k-token vocabulary: ~19 s), and only the
tensors' names, shapes, types and offsets are needed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

Q4_K, Q6_K = 12, 14
"""GGML type codes of the k-quants read here (``gguf.GGMLQuantizationType``)."""
SUPER = 256
"""Inputs per k-quant super-block."""
BLOCK_BYTES = {Q4_K: 144, Q6_K: 210}
"""Bytes per super-block."""

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF metadata value types of fixed size: bytes each."""
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file: where its bytes are and what they hold."""

    name: str
    shape: tuple[int, ...]
    """GGUF order: the innermost (input) dimension first."""
    kind: int
    """GGML type code."""
    offset: int
    """Absolute offset of its data in the file."""


def read_directory(path: Path) -> tuple[str, dict[str, TensorEntry]]:
    """``(architecture, {name: TensorEntry})`` of a GGUF file (format version 2 or 3)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)  # type: ignore[arg-type]
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        value = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value[0]

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        text = bytes(buf[pos : pos + n]).decode("utf-8", errors="replace")
        pos += n
        return text

    def skip(kind: int) -> Any:
        nonlocal pos
        if kind in _SCALAR:
            pos += _SCALAR[kind]
            return None
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            inner, count = take("<I"), take("<Q")
            if inner in _SCALAR:
                pos += _SCALAR[inner] * count
            else:
                for _ in range(count):
                    skip(inner)
            return None
        raise ValueError(f"{path.name}: unknown GGUF metadata type {kind}")

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path.name} is not a GGUF file")
    pos = 4
    version = take("<I")
    if version not in (2, 3):
        raise ValueError(f"{path.name}: GGUF version {version} is not read here")
    n_tensors, n_kv = take("<Q"), take("<Q")
    arch, alignment = "", 32
    for _ in range(n_kv):
        key, kind = string(), take("<I")
        if key == "general.alignment" and kind == 4:
            alignment = take("<I")
            continue
        value = skip(kind)
        if key == "general.architecture":
            arch = str(value)
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = tuple(take("<Q") for _ in range(take("<I")))
        kind, offset = take("<I"), take("<Q")
        infos.append((name, dims, kind, offset))
    start = (pos + alignment - 1) // alignment * alignment
    return arch, {n: TensorEntry(n, d, k, start + o) for n, d, k, o in infos}


@dataclass(frozen=True)
class KQuant:
    """One linear's k-quant blocks in the file (read when ``decode`` is called)."""

    path: Path
    entry: TensorEntry

    def decode(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """``(q int8 [N, K], scale fp32 [N, K/block], base fp32 [N, K/block] or None, block)``:
        weight = q · scale (+ base) per block, as the file defines it. Q4_K: q 0..15, blocks of
        32, scale d · sc, base −dmin · m; Q6_K: q −32..31, blocks of 16, scale d · sc."""
        k, n = self.entry.shape[0], int(np.prod(self.entry.shape[1:]))
        count = n * k // SUPER
        raw = np.memmap(
            self.path,
            dtype=np.uint8,
            mode="r",
            offset=self.entry.offset,
            shape=(count, BLOCK_BYTES[self.entry.kind]),
        )
        q, scale, base, block = (_q4_k if self.entry.kind == Q4_K else _q6_k)(np.asarray(raw))
        as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).reshape(n, -1)  # noqa: E731
        return as_t(q), as_t(scale), None if base is None else as_t(base), block

    def weight(self) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` as ``gguf``'s de-quantiser rounds it: Q4_K
        ``fl(fl(scale · q) + base)``, Q6_K ``fl(scale · q)``."""
        q, scale, base, block = self.decode()
        w = q.float().view(q.shape[0], -1, block) * scale[..., None]
        if base is not None:
            w = w + base[..., None]
        return w.reshape(q.shape)


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Q4_K super-blocks (d, dmin fp16; 12 bytes of 6-bit scales and minima; 128 of nibbles)
    as ``gguf.quants.Q4_K`` lays them out."""
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc_raw = raw[:, 4:16].reshape(-1, 3, 4)
    lo, mid, hi = sc_raw[:, 0], sc_raw[:, 1], sc_raw[:, 2]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    qs = raw[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, SUPER).astype(np.int8)
    scale = d * sc.astype(np.float32)  # exact: an fp16 times a 6-bit integer
    base = -(dmin * mins.astype(np.float32))
    return q, scale, base, 32


def _q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    """Q6_K super-blocks (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
    fp16) as ``gguf.quants.Q6_K`` lays them out."""
    shifts2 = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    shifts4 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    low = ((raw[:, :128].reshape(-1, 2, 1, 64) >> shifts2) & 0x0F).reshape(-1, 8, 32)
    high = ((raw[:, 128:192].reshape(-1, 2, 1, 32) >> shifts4) & 0x03).reshape(-1, 8, 32)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(-1, SUPER)
    sc = raw[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = raw[:, 208:210].copy().view(np.float16).astype(np.float32)
    return q, d * sc, None, 16  # d · sc exact: an fp16 times an int8


def attach(model: Any, path: Path) -> int:
    """Give each ``nn.Linear`` of ``model`` whose weight is a k-quant tensor of the GGUF at
    ``path`` its ``KQuant`` (attribute ``uag_kquant``), where the file's weights equal the
    loaded ones bitwise; the number attached. Read by ``uag.kernels.native.NativeLinear``."""
    import gguf  # Transformers' GGUF loading needs it: present wherever a GGUF loads

    arch_name, entries = read_directory(path)
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name), None)
    layers = getattr(model.config, "num_hidden_layers", None)
    if arch is None or layers is None:
        return 0
    names = gguf.get_tensor_name_map(arch, layers)
    attached = 0
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module.weight.dtype != torch.float32:
            continue
        found = names.get_name(module_name + ".weight", try_suffixes=(".weight",))
        entry = entries.get(found) if found else None
        if entry is None or entry.kind not in BLOCK_BYTES:
            continue
        if tuple(module.weight.shape) != (int(np.prod(entry.shape[1:])), entry.shape[0]):
            continue
        source = KQuant(path, entry)
        if torch.equal(source.weight(), module.weight.detach()):
            setattr(module, "uag_kquant", source)  # noqa: B010 (nn.Module's typing)
            attached += 1
    return attached
