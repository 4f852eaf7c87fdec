"""uag's own skinny matrix product (``csrc/skinny.c``), built once with the system C compiler.

Why a kernel of our own: a decode or verify step multiplies 1–16 rows by every weight once, so
it should cost one read of the weights. Neither MKL nor oneDNN gets there for these shapes on
AVX2 CPUs (the head alone: ~57 ms in oneDNN for one row, ~28–38 ms here), and oneDNN computes a
lone row differently from a row among others. ``skinny.c`` streams each weight once, register-
blocks the rows (8 rows of an fp32 layer cost ~1.5x one row, not 8x), and computes every output
the same way whatever the row count: row-count invariance by construction, which is what makes
greedy verification lossless without guards.

Weights that are exactly an fp16 scale times small integers per block of 32 (Gemma 3's Q5_0 and
Q8_0 tensors, de-quantised from its GGUF file: q/k/v, gate/up and the 262k-row head) are held
as int8 plus one scale per block (``block_int8``) and multiplied back in registers: bitwise the
fp32 product from ~28 % of the bytes (a one-row target body ~30 % faster, the full head that
sampling reads ~3x). Weights that are exactly ``q · s + b`` per block of 16 with small integers
``q`` (GGUF's k-quants Q4_K and Q6_K: Gemma 3's o and down projections) are held as uint8 plus a
scale and a base per block (``block_affine``): bitwise the fp32 product from 1.5 of 4 bytes per
weight. Both are found from the values alone and checked weight by weight, so a model whose
weights have no such form simply stays fp32. Where the CPU has AVX-512 VNNI, a decoder body's
block layers move on to ``exact.c`` (``NativeLinear.to_integer``): the same integers times the
activations as exact integer sums, one multiply by each block's scale in float, so the
multiply-adds no longer bound a forward (Gemma 3's body: ~8 → ~6.6 ms for one row, ~13.5 →
~10.5 for eight), still row-count invariant by construction and closer to the exact product
than fp32's chain.

Building: ``cc -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp``, linked against the OpenMP runtime
torch itself loaded (one thread pool, no oversubscription), cached under
``$UAG_CACHE/kernels/`` by a hash of source, flags and torch version (a few seconds, once).
Where that cannot work (no compiler, no AVX2, a torch without GNU OpenMP, ``UAG_KERNELS`` set to
``onednn`` or ``plain``) ``native_unavailable()`` says why and ``uag.kernels.choice`` uses oneDNN or
plain kernels instead, which the tests also cover.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from uag.errors import UagError
from uag.kernels.formats import (
    AFFINE_K,
    BLOCK_K,
    BLOCK_ROWS,
    CSRC,
    EXACT_BLOCKS,
    FACTOR_SPAN,
    FORMATS,
    K_STEP,
    PACKED_BITS,
    Q8_K_STEP,
    X8_GROUP,
    X8_QUAD,
    Format,
    block_parameters,
    exact_parameters,
    factor_parameters,
    pack_integers,
)
from uag.paths import cache_root

SOURCES = (
    CSRC / "skinny.c",  # the matrix products
    CSRC / "layer.c",  # a whole decoder layer around them
    CSRC / "screen.c",  # the greedy head's candidates, draft stats
    CSRC / "q8.c",  # int8 weights x int8 activations (approximate)
    CSRC / "q4.c",  # 4-bit weights x int8 activations (approximate)
    CSRC / "exact.c",  # block weights x activations as exact integers
)
HEADERS = tuple(CSRC / name for name in ("kernels.h", "formats.h", "simd.h", "vexp.h"))
"""Included by the sources: part of the build's cache key."""
FLAGS = (
    "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
    "-Werror=missing-prototypes",  # every exported function is in kernels.h, so it is bound
)  # fmt: skip
BLOCK_MULTIPLIERS = (127, 16, 8)
"""Largest |integer| of a block in the formats ``block_int8`` recognises: GGUF's Q8_0 (the
largest weight of a block is 127 steps), Q5_0 (−16 steps) and Q4_0 (−8 steps)."""
CHUNK_ROWS = 16384
"""Output rows converted at a time when building a layer (a multiple of ``BLOCK_ROWS``)."""


def _torch_openmp() -> Path | None:
    """The GNU OpenMP runtime bundled with torch (linking to it shares torch's thread pool)."""
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libgomp*.so*"))
    return found[0] if found else None


def _build(cache: Path) -> Path:
    """Compile ``SOURCES`` into ``cache`` unless an identical build is there; return the path."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    gomp = _torch_openmp()
    if gomp is None:
        raise RuntimeError("this torch build bundles no GNU OpenMP runtime to share")
    key = hashlib.sha256(
        b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS))
        + " ".join(FLAGS).encode()
        + torch.__version__.encode()
    ).hexdigest()[:16]
    target = cache / f"skinny-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    sources = [str(src) for src in SOURCES]
    cmd = [compiler, *FLAGS, *sources, "-o", tmp, str(gomp), f"-Wl,-rpath,{gomp.parent}", "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"compiling uag's kernels failed: {done.stderr.strip()[:300]}")
    os.replace(tmp, target)  # atomic: concurrent builders (torchrun ranks) never see half a file
    return target


CType: TypeAlias = "type[ctypes._SimpleCData[Any]] | None"
"""A ctypes argument or result type (None: ``void``)."""
_C_TYPES: dict[str, CType] = {
    "void": None,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
"""``kernels.h``'s value types; any pointer binds as ``c_void_p`` (a tensor's ``data_ptr()``,
None, or a ctypes object by reference)."""


def _ctype(declaration: str) -> CType:
    """The ctypes type of a C type such as ``const float *`` or ``int64_t``."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = [w for w in declaration.split() if w != "const"]
    if len(words) != 1 or words[0] not in _C_TYPES:
        raise ValueError(f"kernels.h: no ctypes type for {declaration.strip()!r}")
    return _C_TYPES[words[0]]


def signatures(header: Path = CSRC / "kernels.h") -> dict[str, tuple[CType, list[CType]]]:
    """``{name: (restype, argtypes)}`` of every function ``kernels.h`` declares: the kernels'
    signatures are written once, there (the compiler checks each definition against it)."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", header.read_text(), flags=re.S)
    text = re.sub(r"^\s*#.*$", " ", text, flags=re.M)
    found = {}
    for statement in text.split(";"):
        if "(" not in statement:
            continue  # a forward declaration of a struct
        match = re.fullmatch(r"\s*([\w\s*]+?)\s*\b(uag_\w+)\s*\(([^()]*)\)\s*", statement)
        if match is None:
            raise ValueError(f"kernels.h: not a prototype this reader knows: {statement.strip()!r}")
        params = [] if match[3].strip() in ("", "void") else match[3].split(",")
        argtypes = [_ctype(re.sub(r"\w+\s*$", "", param)) for param in params]
        found[match[2]] = (_ctype(match[1]), argtypes)
    return found


def _load(path: Path) -> ctypes.CDLL:
    """The built library with every ``kernels.h`` function's ctypes signature set."""
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in signatures().items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)`` or ``(None, why not)``; built, loaded and self-tested once."""
    if os.environ.get("UAG_KERNELS", "") in ("onednn", "plain"):
        return None, f"UAG_KERNELS={os.environ['UAG_KERNELS']}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"needs an x86-64 CPU (this is {platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return None, f"needs AVX2 (torch reports {capability})"
    try:
        path = _build(cache_root() / "kernels")
        lib = _load(path)
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as err:
        return None, str(err)
    passed = _self_test_mark(path)
    if passed.is_file():
        return lib, None
    problem = _self_test(lib)
    if problem:
        return None, problem
    with contextlib.suppress(OSError):  # a read-only cache: the test runs on every start
        passed.touch()
    return lib, None


def cpuinfo() -> dict[str, str]:
    """The first value of each field of ``/proc/cpuinfo`` (the first CPU's: model name,
    flags...), stripped; empty where the file cannot be read (not Linux). The one reader of
    that file: the kernels' self-test key, the machine line and the ISA line use it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    found: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep and name.strip() not in found:
            found[name.strip()] = value.strip()
    return found


def _cpu_identity() -> str:
    """The CPU as far as the kernels' results can depend on it: its model name and every
    instruction-set flag the kernel reports (``/proc/cpuinfo``), beside what torch detects."""
    found = cpuinfo()
    wanted = ("model name", "flags", "Features")
    return "|".join(
        [platform.machine(), str(torch.backends.cpu.get_cpu_capability())]
        + [f"{name}={' '.join(found.get(name, '').split())}" for name in wanted]
    )


def _self_test_mark(library: Path) -> Path:
    """The file whose presence says ``_self_test`` passed for this exact library on this CPU.

    Why cached: the self-test costs ~0.1-1 s of every start (~1 s where OpenMP's threads wait
    for a busy core), a quarter of a one-token ``uag generate``. Why this key: what the test
    proves depends on the compiled code (the ``.so``'s bytes, not its name), on the CPU that
    runs it (model and instruction-set flags: another CPU may take other code paths, e.g. VNNI),
    on the Python that packs the weights and checks the results (this module and
    ``uag.kernels.formats``), on torch (the reference ``F.linear``) and on the thread count the
    kernels split their rows over. Any of them changing gives another file, so the test runs
    again; a failed test writes nothing."""
    digest = hashlib.sha256()
    digest.update(library.read_bytes())
    for source in (Path(__file__), Path(__file__).with_name("formats.py")):
        digest.update(source.read_bytes())
    digest.update(_cpu_identity().encode())
    digest.update(f"|torch {torch.__version__}|threads {torch.get_num_threads()}".encode())
    return library.with_name(f"{library.stem}-selftest-{digest.hexdigest()[:20]}.ok")


def integer_products() -> bool:
    """Whether ``exact.c`` runs fast here (AVX-512 VNNI): where decoder bodies and sampling's
    full head hold its layout (``NativeLinear.to_integer``)."""
    lib = _library()[0]
    return bool(lib is not None and lib.uag_x8_available())


def packed_body() -> tuple[int, ...]:
    """The widths ``NativeLinear.pack`` may store integers at. By default 4 bits (the 1.5B
    Qwen's Q4_K products: a one-row step 0.89x the int8 layout's, 3-9 rows the same; its Q6_K
    ones at 6 bits, also unpacked in registers, made 3-8 rows 1.05-1.14x slower, and 5 bits
    go through memory), or
    none where ``exact.c``'s SIMD unpacking disagrees with its definition (the int8 layout
    then; the products are the same bits either way). ``UAG_PACKED_BODY=0``: none; ``=4``: 4
    bits; ``=1``: 4 to 6 bits; asking for packing where the unpacking disagrees is a clear
    error."""
    flag = os.environ.get("UAG_PACKED_BODY", "")
    if flag not in ("", "0", "1", "4"):
        raise UagError(f"UAG_PACKED_BODY={flag!r}: use 0 (int8), 4 (4-bit only) or 1 (4-6 bits)")
    if flag == "0":
        return ()
    problem = _packing_unavailable()
    if problem and flag:
        raise UagError(f"UAG_PACKED_BODY={flag} cannot be used here: {problem}; unset it")
    if problem:
        _say_unpacked(problem)
        return ()
    return PACKED_BITS if flag == "1" else (4,)


@functools.cache
def _say_unpacked(problem: str) -> None:
    """Say once, on stderr, that the body stays int8 (same bits, more bytes) and why."""
    print(f"uag: the body stays int8, not packed at 4 bits: {problem}", file=sys.stderr)


@functools.cache
def _packing_unavailable() -> str | None:
    """Why packed products cannot run here, or None (``exact.c``'s ``uag_x8_unpack_check``:
    the SIMD unpacking and the 4-bit products unpacked in registers against their scalar
    definitions). Checked on first use, not in the build's self-test: where it fails the
    default keeps the int8 layout, and asking for packing is a clear error."""
    lib = _library()[0]
    if lib is not None and not lib.uag_x8_unpack_check():
        return "exact.c's AVX-512 unpacking of packed integers disagrees with its definition"
    return None


def native_unavailable() -> str | None:
    """None when the native kernel is usable here, else the reason it is not."""
    return _library()[1]


def _self_test(lib: ctypes.CDLL) -> str | None:
    """Agreement with ``F.linear`` and bitwise row-count invariance on a small odd shape."""
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(45, 22)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(22, 45, generator=gen))
        linear.bias.copy_(torch.randn(22, generator=gen))
    x = torch.randn(7, 45, generator=gen)
    for int8 in (False, True):
        layer = NativeLinear(linear, int8=int8, lib=lib)
        full = layer(x)
        ref = F.linear(x, layer.dequantized(), linear.bias)
        if not torch.allclose(full, ref, rtol=1e-4, atol=1e-4):
            return "the native kernel disagrees with F.linear here"
        if not _invariant(layer, x, full):
            return "the native kernel is not row-count invariant here"
    blocked = _blocked_self_test(lib, gen)
    if blocked:
        return blocked
    dynamic = NativeLinear(linear, int8=True, dynamic=True, lib=lib)
    return _approximate_check(dynamic, x, linear.bias, "dynamic int8") or _q4_self_test(lib, gen)


def _approximate_check(
    layer: NativeLinear, x: torch.Tensor, bias: torch.Tensor | None, what: str
) -> str | None:
    """A kernel that quantises its input (dynamic int8, 4-bit): within 2 % of ``F.linear`` on
    its own weights, and bitwise row-count invariant; else why not."""
    full = layer(x)
    ref = F.linear(x, layer.dequantized(), bias)
    if (full - ref).norm() > 0.02 * ref.norm():
        return f"the native {what} kernel disagrees with F.linear here"
    if not _invariant(layer, x, full):
        return f"the native {what} kernel is not row-count invariant here"
    return None


def q4_like_weight(out: int, width: int, *, generator: torch.Generator) -> torch.Tensor:
    """A weight as GGUF's Q4_1 de-quantises: per block of 32, ``d · q + m`` with fp16 ``d`` and
    ``m`` and q in 0..15, each block's extremes at q = 0 and 15 (as Q4_1's quantiser puts them)."""
    q = torch.randint(0, Q4_LEVELS + 1, (out, width // BLOCK_K, BLOCK_K), generator=generator)
    q[..., 0], q[..., 1] = 0, Q4_LEVELS
    d = (torch.rand(out, width // BLOCK_K, 1, generator=generator) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(out, width // BLOCK_K, 1, generator=generator) * 0.2).half().float()
    return (d * q.float() + m).reshape(out, width)


def _q4_self_test(lib: ctypes.CDLL, gen: torch.Generator) -> str | None:
    """The 4-bit kernel: close to ``F.linear`` on its own weights, row-count invariant."""
    linear = nn.Linear(64, 24)
    with torch.no_grad():
        linear.weight.copy_(q4_like_weight(24, 64, generator=gen))
    x = torch.randn(7, 64, generator=gen)
    layer = NativeLinear(linear, int8=True, dynamic=True, q4=True, lib=lib)
    if not layer.q4:
        return "the 4-bit grid search missed a Q4_1-like weight"
    return _approximate_check(layer, x, linear.bias, "4-bit")


def _blocked_self_test(lib: ctypes.CDLL, gen: torch.Generator) -> str | None:
    """Block-scaled int8 of an exactly representable weight gives bitwise the fp32 kernel's."""
    q = torch.randint(-127, 128, (21, 64), generator=gen).float()
    q[:, ::BLOCK_K] = -127.0  # as in Q8_0: each block's largest weight is 127 steps
    scales = torch.rand(21, 2, generator=gen).half().float()  # fp16 scales: exact products
    linear = nn.Linear(64, 21)
    with torch.no_grad():
        linear.weight.copy_(q * scales.repeat_interleave(BLOCK_K, dim=1))
    x = torch.randn(7, 64, generator=gen)
    blocked = NativeLinear(linear, lib=lib)
    plain = NativeLinear(linear, exact_blocks=False, lib=lib)
    if blocked.exact_format != "block_int8":
        return "the block int8 search missed an exactly representable weight"
    full = blocked(x)
    if not torch.equal(full, plain(x)) or not _invariant(blocked, x, full):
        return "the block int8 kernel does not give bitwise the fp32 kernel's rows"
    with torch.no_grad():  # as Q4_K de-quantises: (fp16 scale · 6 bits) · q − (fp16 · 6 bits)
        linear.weight.copy_(affine_like_weight(21, 64, levels=16, generator=gen))
    affine, plain = NativeLinear(linear, lib=lib), NativeLinear(linear, exact_blocks=False, lib=lib)
    if affine.exact_format != "block_affine":
        return "the block affine search missed an exactly representable weight"
    full = affine(x)
    if not torch.equal(full, plain(x)) or not _invariant(affine, x, full):
        return "the block affine kernel does not give bitwise the fp32 kernel's rows"
    return None


def affine_like_weight(
    out: int, width: int, *, levels: int, generator: torch.Generator
) -> torch.Tensor:
    """``[out, width]`` fp32 as GGUF's k-quants de-quantise, per block of ``AFFINE_K``: an exact
    scale (fp16 × 6-bit) times integers 0..15 minus an exact base (Q4_K: ``levels`` 16), or times
    integers −32..31 (Q6_K: ``levels`` 64)."""
    blocks = width // AFFINE_K
    low = 0 if levels == 16 else -levels // 2
    q = torch.randint(low, low + levels, (out, width), generator=generator).float()

    def exact(size: tuple[int, int]) -> torch.Tensor:  # an fp16 times a 6-bit integer
        d = (torch.rand(size, generator=generator) * 1e-3).half().float()
        return d * torch.randint(1, 64, size, generator=generator).float()

    scale, base = exact((out, blocks)), exact((out, blocks)) * (levels == 16)
    scale, base = scale.repeat_interleave(AFFINE_K, 1), base.repeat_interleave(AFFINE_K, 1)
    return q * scale - base


def _invariant(layer: NativeLinear, x: torch.Tensor, full: torch.Tensor) -> bool:
    """Every run of 1-3 consecutive rows gives bitwise the rows of the full call."""
    n = x.shape[0]
    pieces = (layer(x[i : i + k]) for k in (1, 2, 3) for i in range(n - k + 1))
    expected = (full[i : i + k] for k in (1, 2, 3) for i in range(n - k + 1))
    return all(torch.equal(a, b) for a, b in zip(pieces, expected, strict=True))


def _ceil(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def interleave(weight: torch.Tensor, k_step: int = K_STEP) -> torch.Tensor:
    """``[N, K]`` → the kernels' layout ``[N/8, K/k_step, 8, k_step]`` (zero-padded to whole
    blocks)."""
    n, k = weight.shape
    padded = F.pad(weight, (0, _ceil(k, k_step) - k, 0, _ceil(n, BLOCK_ROWS) - n))
    np_, kp = padded.shape
    return (
        padded.view(np_ // BLOCK_ROWS, BLOCK_ROWS, kp // k_step, k_step)
        .permute(0, 2, 1, 3)
        .contiguous()
    )


def fp32_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias)`` on ``skinny.c``'s fp32 path without building a
    module: bitwise what an fp32 ``NativeLinear`` of ``weight`` computes (each output on its
    own), for small matrices gathered per call (the screened head's candidate rows)."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(f"native kernel unavailable: {native_unavailable()}")
    n, k = weight.shape
    packed = interleave(weight.float())
    padded = packed.shape[0] * BLOCK_ROWS
    b = None if bias is None else F.pad(bias.float(), (0, padded - n))
    rows = x.float().contiguous()
    y = torch.empty(rows.shape[0], padded)
    lib.uag_linear_f32(
        rows.data_ptr(), k, rows.shape[0], k, packed.data_ptr(), None, padded,
        None if b is None else b.data_ptr(), y.data_ptr(), padded,
    )  # fmt: skip
    return y[:, :n]


def block_int8(
    weight: torch.Tensor, lib: ctypes.CDLL | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q int8 [N, K], s fp32 [N, K/32])`` with ``q[n, k] · s[n, k // 32]`` *equal* to every
    fp32 weight, or None where that does not hold.

    Why: a model de-quantised from GGUF's Q8_0 / Q5_0 / Q4_0 holds, in each block of 32 weights,
    an fp16 scale times small integers, and those products are exact in fp32. Storing the
    integers and scales and multiplying them back in registers hands the multiply-adds bitwise
    the same weights from ~28 % of the bytes: a memory-bound product gets faster without any
    change to its result. Nothing is assumed about where the weights came from: each block's
    scale is its largest |weight| over each of ``BLOCK_MULTIPLIERS`` in turn, and the first that
    reproduces every weight of the block wins; one block that none reproduces rejects the
    matrix (``csrc/skinny.c``'s ``uag_block_int8``; torch ops took ~4 s on Gemma's head). (Equal, not bitwise: a −0.0 weight comes back +0.0, which no sum can tell apart,
    since every product chain starts from +0.)
    """
    mult = torch.tensor(BLOCK_MULTIPLIERS, dtype=torch.int32)
    return _exact_form(
        weight,
        lib,
        block=BLOCK_K,
        q_dtype=torch.int8,
        per_block=(),
        split=lambda lib, w, q, p: lib.uag_block_int8(
            w.data_ptr(), *w.shape, mult.data_ptr(), len(mult), q.data_ptr(), p.data_ptr()
        ),
    )


def block_affine(
    weight: torch.Tensor, lib: ctypes.CDLL | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q uint8 [N, K], p fp32 [N, K/16, 2])`` with ``q[n, k] · p[n, k // 16, 0] +
    p[n, k // 16, 1]`` (two float32 roundings, in that order) *equal* to every fp32 weight, or
    None where that does not hold.

    Why: GGUF's k-quants de-quantise to ``d · q − m`` per sub-block (Q4_K: 4-bit ``q`` and a
    minimum per 32; Q6_K: 6-bit ``q`` per 16), with ``d`` and ``m`` exact products of an fp16
    and a 6-bit integer, so every weight is exactly representable that way. Gemma 3's o and
    down projections are stored so: ~40 % of its body's fp32 bytes. As with ``block_int8``,
    nothing is assumed about the source: each block of 16 gets its smallest weight as the base
    and the greatest common divisor of the distances from it as the scale, and one block that
    this pair does not reproduce rejects the matrix (``csrc/skinny.c``'s ``uag_block_affine``).
    """
    return _exact_form(
        weight,
        lib,
        block=AFFINE_K,
        q_dtype=torch.uint8,
        per_block=(2,),
        split=lambda lib, w, q, p: lib.uag_block_affine(
            w.data_ptr(), *w.shape, q.data_ptr(), p.data_ptr()
        ),
    )


def _exact_form(
    weight: torch.Tensor,
    lib: ctypes.CDLL | None,
    *,
    block: int,
    q_dtype: torch.dtype,
    per_block: tuple[int, ...],
    split: Callable[[ctypes.CDLL, torch.Tensor, torch.Tensor, torch.Tensor], int],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q [N, K] of q_dtype, p fp32 [N, K/block, *per_block])`` as ``split`` (one of
    ``csrc/skinny.c``'s ``uag_block_*``) finds them, or None where the kernels are missing, the
    weight is not fp32 with K a multiple of ``block``, or some block has no exact form."""
    out, width = weight.shape
    lib = lib if lib is not None else _library()[0]
    if lib is None or width % block or weight.dtype != torch.float32:
        return None
    w = weight.contiguous()
    q = torch.empty(out, width, dtype=q_dtype)
    params = torch.empty(out, width // block, *per_block)
    return (q, params) if split(lib, w, q, params) else None


Q4_LEVELS = 15
"""Steps of a 4-bit block (``q4_grid``): q in 0..15, as GGUF's Q4_1."""


def q4_grid(
    weight: torch.Tensor, *, tolerance: float = 1e-3, lib: ctypes.CDLL | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(packed uint8 [N/8, K/32, 128], params fp16 [N/8, K/32, 2, 8])`` for ``q4.c`` when every
    block of 32 weights of each output lies on a 16-level grid (``d · q + m``, q in 0..15, to
    ``tolerance`` of a step), else None.

    Why only then: a model de-quantised from GGUF's Q4_1 (SmolLM2's file) holds exactly such
    blocks, so 4 bits per weight are the model's own weights, read at 0.625 bytes per weight
    instead of int8's 1 (the assistant's draft step is bound by those bytes). ``d`` and ``m`` are
    held as half floats, as Q4_1 stores them (exact for the file's own weights; a block whose
    grid needs more precision is off the grid). Rounding another
    model's weights to 4 bits would change the assistant more than int8 does, so such a matrix
    stays on ``q8.c``. The grid is each block's minimum and (maximum − minimum) / 15: Q4_1's
    quantiser puts the block's extremes at q = 0 and q = 15. Found and packed in C
    (``uag_q4_grid``; torch ops took ~1 s of start-up for SmolLM2).
    """
    out, width = weight.shape
    lib = lib if lib is not None else _library()[0]
    if lib is None or width % BLOCK_K or out % BLOCK_ROWS or weight.dtype != torch.float32:
        return None
    w = weight.contiguous()
    blocks = width // BLOCK_K
    packed = torch.empty(out // BLOCK_ROWS, blocks, BLOCK_ROWS * BLOCK_K // 2, dtype=torch.uint8)
    params = torch.empty(out // BLOCK_ROWS, blocks, 2, BLOCK_ROWS, dtype=torch.float16)
    found = lib.uag_q4_grid(
        w.data_ptr(), out, width, tolerance, packed.data_ptr(), params.data_ptr()
    )
    return (packed, params) if found else None


def symmetric_int8(
    weight: torch.Tensor, lib: ctypes.CDLL | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` rounded to int8 with one scale per output row (symmetric): ``(q, scales)``.
    In C where the kernels are built (the same numbers as the torch ops, ~10x faster)."""
    weight = weight.float()
    lib = lib if lib is not None else _library()[0]
    if lib is not None:
        w = weight.contiguous()
        q = torch.empty(w.shape, dtype=torch.int8)
        scales = torch.empty(w.shape[0])
        lib.uag_symmetric_int8(
            w.data_ptr(), w.shape[0], w.shape[1], q.data_ptr(), scales.data_ptr()
        )
        return q, scales
    scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [out]
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


class NativeLinear(nn.Module):
    """A linear layer on the native kernels, its weight held in one storage ``format``
    (``uag.kernels.formats``): fp32 or weight-only int8 (``skinny.c``), exact block forms of the
    fp32 weight (``skinny.c``, ``exact.c``), or int8 / 4-bit weights times int8 activations
    (``dynamic``: ``q8.c``, ``q4.c``; approximate, for the assistant).

    The constructor's flags say what the caller allows; ``format`` is what the weight's values
    made of it. The weight is kept only in the kernel's layout (the caller releases the
    original's pages).
    """

    origin = Format.FP32
    """``Format.EXACT``: the exact block form its integers came from (``BLOCK_INT8`` or
    ``BLOCK_AFFINE``)."""
    x8_block = 0
    """``Format.EXACT``: inputs per block (32 or 16)."""
    x8_affine = False
    """``Format.EXACT``: each block has a base besides its scale."""
    x8_bits = 8
    """``Format.EXACT``: bits per stored integer (8, or packed at 4-6: ``pack``)."""
    x8_offset = 0
    """``Format.EXACT``, packed: what each stored value is offset by (``pack_integers``)."""
    x8_span = 0
    """``Format.EXACT``: 0, or ``FACTOR_SPAN`` where the block parameters are factored
    (``factor``)."""
    kquant: Any = None
    """Until ``to_integer``: the GGUF k-quant blocks this weight was de-quantised from
    (``uag.runtime.kquants.KQuant``), checked equal to it; their integers and parameters then
    become ``exact.c``'s, which keep the file's structure (``factor``)."""

    def __init__(
        self,
        linear: nn.Linear,
        *,
        int8: bool = False,
        dynamic: bool = False,
        exact_blocks: bool = True,
        q4: bool = False,
        lib: ctypes.CDLL | None = None,
    ) -> None:
        super().__init__()
        lib = lib if lib is not None else _library()[0]
        if lib is None:
            raise RuntimeError(f"native kernel unavailable: {native_unavailable()}")
        self.lib: ctypes.CDLL | None = lib
        if dynamic and not int8:
            raise ValueError("dynamic (int8 activations) needs int8 weights")
        if q4 and not dynamic:
            raise ValueError("q4 (4-bit weights) runs with int8 activations: needs dynamic")
        weight = linear.weight.detach()
        self.format = Format.FP32
        """How the weight is stored (``uag.kernels.formats.FORMATS[format]``)."""
        self.block_scales: torch.Tensor = torch.empty(0)
        """The block parameters of exact block storage (``block_int8``: scales
        ``[N/8, K/32, 8]``; ``block_affine``: scales and bases ``[N/8, K/16, 2, 8]``), of
        ``Format.Q4`` and ``Format.EXACT``; empty: none."""
        if exact_blocks and not int8:
            for fmt, find in ((Format.BLOCK_INT8, block_int8), (Format.BLOCK_AFFINE, block_affine)):
                found = find(weight.float(), lib)
                if found is not None:
                    self._init_blocked(linear, *found, fmt=fmt)
                    source = getattr(linear, "uag_kquant", None)
                    if source is not None and torch.equal(source.weight(), weight.float()):
                        self.kquant = source  # the file's blocks, checked
                    return
        if q4:
            grid = q4_grid(weight.float(), lib=lib)
            if grid is not None:
                self._init_q4(linear, *grid)
                return
        self.format = Format.DYNAMIC_INT8 if dynamic else Format.INT8 if int8 else Format.FP32
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.k_step = Q8_K_STEP if dynamic else K_STEP
        self.padded_out = _ceil(self.out_features, BLOCK_ROWS)
        self.padded_in = _ceil(self.in_features, self.k_step)
        self.weight_ilv: torch.Tensor
        self.scales: torch.Tensor
        self.wsum: torch.Tensor
        blocks, steps = self.padded_out // BLOCK_ROWS, self.padded_in // self.k_step
        dtype = torch.int8 if int8 else torch.float32
        self.register_buffer(
            "weight_ilv", torch.empty(blocks, steps, BLOCK_ROWS, self.k_step, dtype=dtype)
        )
        self.register_buffer("scales", torch.zeros(self.padded_out))
        self.register_buffer("wsum", torch.zeros(self.padded_out, dtype=torch.int32))
        # Chunk by chunk: converting a 262k-row head at once would hold several full-size
        # temporaries (abs, quotient, rounding) at the peak.
        for start in range(0, self.out_features, CHUNK_ROWS):
            part = weight[start : start + CHUNK_ROWS].float()
            scales = torch.ones(part.shape[0])
            if int8:
                part, scales = symmetric_int8(part, lib)
            ilv = interleave(part, self.k_step)
            first = start // BLOCK_ROWS
            self.weight_ilv[first : first + ilv.shape[0]] = ilv
            self.scales[start : start + part.shape[0]] = scales
            if dynamic:
                self.wsum[start : start + part.shape[0]] = part.sum(dim=1, dtype=torch.int32)
        bias = linear.bias
        self.bias_padded: torch.Tensor | None = (
            None
            if bias is None
            else F.pad(bias.detach().float(), (0, self.padded_out - self.out_features))
        )
        self._bind(lib)
        self.invariance = "invariant"
        """Row-count invariant by construction (``skinny.c``), checked at build time."""

    def _bind(self, lib: ctypes.CDLL) -> None:
        """Point at ``lib`` and at its product for this layer's format."""
        self.lib = lib
        self._fn = getattr(lib, FORMATS[self.format].kernel)

    def _init_blocked(
        self, linear: nn.Linear, q: torch.Tensor, bs: torch.Tensor, *, fmt: Format
    ) -> None:
        """Store ``q · s`` or ``q · s + b`` (exactly the fp32 weight): the integers in the fp32
        layout, the block parameters beside."""
        assert self.lib is not None
        self.format = fmt
        self.out_features, self.in_features = (int(d) for d in q.shape)
        self.k_step = K_STEP
        self.padded_out = _ceil(self.out_features, BLOCK_ROWS)
        self.padded_in = self.in_features
        pad = self.padded_out - self.out_features
        self.register_buffer("weight_ilv", interleave(F.pad(q, (0, 0, 0, pad)), K_STEP))
        if fmt is Format.BLOCK_INT8:
            self.block_scales = interleave(F.pad(bs, (0, 0, 0, pad)), 1)[..., 0].contiguous()
        else:  # [N, K/16, 2] -> [N/8, K/16, 2, 8]
            padded = F.pad(bs, (0, 0, 0, 0, 0, pad))
            blocks = padded.shape[0] // BLOCK_ROWS
            self.block_scales = padded.view(blocks, BLOCK_ROWS, -1, 2).permute(0, 2, 3, 1)
            self.block_scales = self.block_scales.contiguous()
        self.register_buffer("scales", torch.ones(self.padded_out))
        self.register_buffer("wsum", torch.zeros(self.padded_out, dtype=torch.int32))
        bias = linear.bias
        self.bias_padded = None if bias is None else F.pad(bias.detach().float(), (0, pad))
        self._bind(self.lib)
        self.invariance = "invariant"

    def _init_q4(self, linear: nn.Linear, packed: torch.Tensor, params: torch.Tensor) -> None:
        """Store the 4-bit blocks and their parameters (``q4.c``'s layout)."""
        assert self.lib is not None
        self.format = Format.Q4
        self.out_features, self.in_features = (int(d) for d in linear.weight.shape)
        self.k_step = Q8_K_STEP
        self.padded_out, self.padded_in = self.out_features, self.in_features
        self.register_buffer("weight_ilv", packed)
        self.block_scales = params
        self.register_buffer("scales", torch.ones(self.padded_out))
        self.register_buffer("wsum", torch.zeros(self.padded_out, dtype=torch.int32))
        bias = linear.bias
        self.bias_padded = None if bias is None else bias.detach().float().clone()
        self._bind(self.lib)
        self.invariance = "invariant"

    @classmethod
    def exact_blocks_of(cls, weight: torch.Tensor) -> NativeLinear | None:
        """``weight`` ``[out, in]`` held in exact block storage (``block_int8`` or
        ``block_affine``), or None where it has neither form: never an fp32 copy."""
        lib = _library()[0]
        if lib is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        for fmt, find in ((Format.BLOCK_INT8, block_int8), (Format.BLOCK_AFFINE, block_affine)):
            found = find(weight, lib)
            if found is not None:
                layer = cls.__new__(cls)
                nn.Module.__init__(layer)
                layer.lib = lib
                part = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
                layer._init_blocked(part, *found, fmt=fmt)
                return layer
        return None

    def __getstate__(self) -> dict[str, object]:
        """Everything but the library handles (``uag.runtime.prepared`` saves prepared layers)."""
        state = self.__dict__.copy()
        state.pop("lib", None)
        state.pop("_fn", None)
        state.pop("kquant", None)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        lib = _library()[0]
        if lib is None:
            raise RuntimeError(f"native kernel unavailable: {native_unavailable()}")
        self._bind(lib)

    # What the format implies, by the names the rest of uag reads:

    @property
    def q4(self) -> bool:
        """Held as 4-bit blocks (``q4_grid``, ``q4.c``): the weights lie on such a grid."""
        return self.format is Format.Q4

    @property
    def integer(self) -> bool:
        """Exact block storage moved to ``exact.c``'s layout (``to_integer``): the product runs
        through exact integers, not fp32 multiply-adds."""
        return self.format is Format.EXACT

    @property
    def blocked(self) -> bool:
        """Weights held in blocks equal to the fp32 ones (bitwise fp32 results, or on
        ``exact.c`` closer still)."""
        return self.format in EXACT_BLOCKS or self.format is Format.EXACT

    @property
    def exact_format(self) -> str:
        """``block_int8``, ``block_affine`` (the exact block form the weights are held in, on
        ``exact.c`` too) or empty."""
        fmt = self.origin if self.format is Format.EXACT else self.format
        return fmt.name.lower() if fmt in EXACT_BLOCKS else ""

    def rows(self, ids: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """Weight rows ``ids`` as fp32 ``[len(ids), in]``, exactly as the kernel multiplies them
        (an embedding lookup or the screened head's exact candidates, without an fp32 copy of
        the whole matrix), each value times ``scale`` in one fp32 multiply. In one C call
        (``skinny.c``), else torch: the same bits."""
        spec = FORMATS[self.format]
        if spec.widen is None:
            raise ValueError(
                "rows(): only fp32 and exact block storage in the fp32 layout hold the weights"
            )
        ids = ids.long()
        if self.lib is not None and self.weight_ilv.device.type == "cpu":  # one C call
            ids = ids.contiguous()
            out = torch.empty(len(ids), self.in_features)
            self.lib.uag_gather_rows(
                int(self.format), self.weight_ilv.data_ptr(),
                self.block_scales.data_ptr() if spec.block else None, self.in_features,
                ids.data_ptr(), len(ids), ctypes.c_float(scale), out.data_ptr(),
            )  # fmt: skip
            return out
        w = self.weight_ilv[ids // BLOCK_ROWS, :, ids % BLOCK_ROWS]  # [n, steps, k_step]
        w = w.reshape(len(ids), -1)[:, : self.in_features].float()
        if spec.block:
            p = block_parameters(self)[ids // BLOCK_ROWS, :, :, ids % BLOCK_ROWS]  # [n, K/b, P]
            w = spec.widen(w, p.repeat_interleave(spec.block, dim=1))
        return w if scale == 1.0 else w * scale

    def columns(self, channels: torch.Tensor) -> torch.Tensor:
        """Weight columns ``channels`` as fp32 ``[out, len(channels)]``, exactly as ``rows``."""
        spec = FORMATS[self.format]
        if spec.widen is None:
            raise ValueError(
                "columns(): only fp32 and exact block storage in the fp32 layout hold the weights"
            )
        c = channels.long()
        w = self.weight_ilv[:, c // self.k_step, :, c % self.k_step]  # [C, N/8, 8]
        w = w.permute(1, 0, 2).float()  # [N/8, C, 8]
        if spec.block:
            p = block_parameters(self)[:, c // spec.block]  # [N/8, C, P, 8]
            w = spec.widen(w, p.transpose(2, 3))
        return w.permute(0, 2, 1).reshape(self.padded_out, len(c))[: self.out_features]

    def to_integer(self, *, anywhere: bool = False) -> bool:
        """Move exact block storage to ``exact.c`` (exact integer products: a verify's extra
        rows cost a fraction of the fp32 multiply-adds) where this CPU runs it fast (AVX-512
        VNNI), or with ``anywhere`` also where only its scalar reference runs (tests: the
        definition every path must match); True when moved. Layers whose integers do not fit
        int8, or whose widths do not fit the layout, stay where they are."""
        layout = self._integer_layout(anywhere=anywhere)
        if layout is None:
            return False
        self.weight_ilv, self.block_scales, self.x8_block, self.x8_affine = layout
        self.origin, self.format = self.format, Format.EXACT
        self.kquant = None
        assert self.lib is not None
        self._bind(self.lib)
        return True

    def integer_copy(self) -> NativeLinear | None:
        """A new layer holding this one's exact blocks in ``exact.c``'s layout (this one
        unchanged), or None where ``to_integer`` would not move them: built straight from the
        blocks, without first copying them whole (a deep copy of Gemma's head: +189 MB)."""
        layout = self._integer_layout()
        if layout is None:
            return None
        twin = copy.copy(self)  # shares the small tensors; its own table of buffers:
        twin._buffers = dict(self._buffers)
        twin.weight_ilv, twin.block_scales, twin.x8_block, twin.x8_affine = layout
        twin.origin, twin.format = self.format, Format.EXACT
        assert self.lib is not None
        twin._bind(self.lib)
        return twin

    def reblock(self, *, block: int, affine: bool) -> None:
        """Hold this layer's exact integers under finer or affine block parameters: a block of
        32 as two of 16 with its scale (and base), a scale-only block with base 0. The integers
        and the weight they make stay the same; only how often a sum meets its scale changes.

        Why: ``fuse`` joins parts stored one way. Qwen2's q/k are Q4_K (blocks of 32 once
        merged) while v is Q6_K (blocks of 16), and joining them in fp32 read 4 bytes a weight
        instead of 1 (352 of the 1.5B's ~2,200 MB a token)."""
        assert self.format is Format.EXACT and self.x8_bits == 8 and self.lib is not None
        assert not self.x8_span, "reblock before factor"
        if self.x8_block % block or (self.x8_affine and not affine):
            raise ValueError(f"blocks of {self.x8_block} cannot be held as blocks of {block}")
        params = self.block_scales  # [groups, K / block, scale (and base), 16 outputs]
        if self.x8_block != block:
            params = params.repeat_interleave(self.x8_block // block, dim=1)
        if affine and not self.x8_affine:
            params = torch.cat([params, torch.zeros_like(params)], dim=2)
        self.block_scales = params.contiguous()
        self.x8_block, self.x8_affine = block, affine
        self._bind(self.lib)

    def pack(self) -> bool:
        """Hold ``exact.c``'s integers at the fewest bits their range needs (4, 5 or 6:
        ``pack_integers``) where ``packed_body()`` allows; True when packed. The products stay
        bitwise the same (``exact.c`` unpacks the same integers); a one-row step reads fewer
        bytes. Call it after ``fuse``: parts stored at different widths could not be fused."""
        widths = packed_body()
        if self.format is not Format.EXACT or self.x8_bits != 8 or not widths:
            return False
        packed = pack_integers(self.weight_ilv, self.x8_block, widths=widths)
        if packed is None:
            return False
        self.weight_ilv, self.x8_bits, self.x8_offset = packed
        return True

    def factor(self) -> bool:
        """Hold ``exact.c``'s block parameters factored (``factor_parameters``: an fp32 unit
        per ``FACTOR_SPAN`` inputs times an int8 multiplier per block) where every span
        factors exactly; True when factored. The kernel multiplies them back to the same
        floats, so every product is bitwise the same; a step reads 4-8 bytes per block less
        (a k-quant body's scales and minima: 571 of the 1.5B Qwen's 1,881 MB a token).
        Call it after ``fuse`` (which joins plain parameters)."""
        if self.format is not Format.EXACT or self.x8_span:
            return False
        factored = factor_parameters(exact_parameters(self), self.x8_block)
        if factored is None:
            return False
        self.block_scales, self.x8_span = factored, FACTOR_SPAN
        return True

    def _integer_layout(
        self, *, anywhere: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, int, bool] | None:
        """``(weight, block parameters, block width, affine)`` in ``exact.c``'s layout, or None.
        The block form is read off the stored blocks: Q8_0 / Q5_0's int8 blocks of 32; for the
        affine blocks of 16, a base that is a whole number of steps (Q6_K) folds into the
        integers, and two neighbours sharing scale and base (Q4_K) make one block of 32, so
        fewer blocks each meet their scale."""
        if not self.blocked or self.integer or self.lib is None:
            return None
        if not (anywhere or self.lib.uag_x8_available()):
            return None
        n, k = self.padded_out, self.in_features
        if n % X8_GROUP or n != self.out_features:
            return None
        tiles = self.weight_ilv.shape[0]
        q = self.weight_ilv.reshape(tiles, k, BLOCK_ROWS).permute(0, 2, 1).reshape(n, k)
        if self.kquant is not None:  # the file's own integers and parameters
            ints, scale, base, block = self.kquant.decode()
            affine = base is not None
            scales = torch.stack([scale, base], dim=-1) if base is not None else scale[..., None]
        elif self.format is Format.BLOCK_INT8:
            ints = q.to(torch.int8)
            scales = self.block_scales.permute(0, 2, 1).reshape(n, k // BLOCK_K, 1)
            block, affine = BLOCK_K, False
        else:
            p = self.block_scales.permute(0, 3, 1, 2).reshape(n, k // AFFINE_K, 2).double()
            scale, base = p[..., 0], p[..., 1]
            ints16 = q.view(n, k // AFFINE_K, AFFINE_K).to(torch.int32)
            steps = (base / torch.where(scale == 0, 1.0, scale)).round()
            affine = not bool((steps * scale == base).all())
            if not affine:  # q · s + j · s = (q + j) · s
                ints16 = ints16 + steps.to(torch.int32)[..., None]
                base = torch.zeros_like(base)
            block = AFFINE_K
            if k % BLOCK_K == 0:
                # Neighbours whose scales are whole multiples of the smaller (a block's scale is
                # the gcd of its steps, so a half of only even steps reads twice Q4_K's) and
                # whose bases differ by whole steps of it: one block of 32.
                s2, b2 = scale.view(n, -1, 2), base.view(n, -1, 2)
                step = s2.min(dim=-1).values
                unit = torch.where(step == 0, 1.0, step)
                mult, shift = (
                    (s2 / unit[..., None]).round(),
                    ((b2[..., 1] - b2[..., 0]) / unit).round(),
                )
                same = (mult * step[..., None] == s2).all(dim=-1) & (
                    shift * step == b2[..., 1] - b2[..., 0]
                )
                if bool(same.all()):
                    ints16 = ints16.view(n, -1, 2, AFFINE_K) * mult.to(torch.int32)[..., None]
                    ints16[:, :, 1] += shift.to(torch.int32)[..., None]
                    scale, base, block = step, b2[..., 0], BLOCK_K
            if ints16.min() < -128 or ints16.max() > 127:
                return None
            ints = ints16.reshape(n, k).to(torch.int8)
            scales = torch.stack([scale, base], dim=-1) if affine else scale[..., None]
            scales = scales.float()
        if not affine and self.kquant is None:  # the file's integers are in its own range
            ints, scales = _lean_negative(ints, scales, block)
        groups = n // X8_GROUP
        weight = ints.view(groups, X8_GROUP, k // X8_QUAD, X8_QUAD).permute(0, 2, 1, 3)
        params = scales.reshape(groups, X8_GROUP, k // block, -1).permute(0, 2, 3, 1)
        return weight.contiguous(), params.contiguous(), block, affine

    def to_fp32(self) -> None:
        """Hold the weight as fp32 again (fusing with an fp32 part; same results)."""
        if not self.blocked:
            return
        assert self.lib is not None
        w = self.dequantized()
        self.weight_ilv = interleave(F.pad(w, (0, 0, 0, self.padded_out - self.out_features)))
        self.block_scales = torch.empty(0)
        self.format, self.origin = Format.FP32, Format.FP32
        self.x8_block, self.x8_affine, self.x8_bits, self.x8_offset = 0, False, 8, 0
        self.x8_span = 0
        self._bind(self.lib)

    def prefix(self, rows: int) -> NativeLinear:
        """The layer restricted to its first ``rows`` outputs (a multiple of 16), sharing this
        layer's memory: the weights are stored by blocks of outputs, so a prefix of the blocks is
        a prefix of the outputs, each computed exactly as here (bitwise the same values).

        Why: a draft head over the assistant's most common ids (``uag.runtime.draft_vocab``) reads a
        fraction of the head's bytes, and as views it costs no memory and stays in huge pages."""
        if rows <= 0 or rows % X8_GROUP or rows > self.padded_out:
            raise ValueError(f"a prefix needs 0 < rows <= {self.padded_out}, a multiple of 16")
        per_entry = FORMATS[self.format].per_entry
        part = copy.copy(self)  # its own attribute dictionary; the buffers' is replaced
        part._buffers = {
            name: None if t is None else t[: rows // per_entry if name == "weight_ilv" else rows]
            for name, t in self._buffers.items()
        }
        if self.block_scales.numel():
            part.block_scales = self.block_scales[: rows // per_entry]
        if self.bias_padded is not None:
            part.bias_padded = self.bias_padded[:rows]
        part.out_features = part.padded_out = rows
        return part

    def with_bias(self, bias: torch.Tensor) -> NativeLinear:
        """This layer plus ``bias`` (``[out]``), sharing its weights: every kernel adds a bias
        in its own epilogue. Why: the exact block forms are built from a weight alone (an LM
        head's ``ScreenedHead.exact``), and what sampling reads must include the head's bias."""
        part = copy.copy(self)  # its own attribute dictionary; the weights shared
        part._buffers = dict(self._buffers)
        part.bias_padded = F.pad(bias.detach().float(), (0, self.padded_out - self.out_features))
        return part

    def streamed(self) -> list[tuple[nn.Module, str]]:
        """The tensors every forward reads in full, as (owner, attribute) slots for
        ``uag.kernels.hugepages.move``."""
        names = ("weight_ilv", "block_scales", "scales", "wsum", "bias_padded")
        return [(self, name) for name in names]

    def params_ptr(self) -> int | None:
        """Where the kernel's parameter pointer points for this format (``Spec.params``)."""
        name = FORMATS[self.format].params
        return None if name is None else getattr(self, name).data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            rows = rows.float()
        if self.padded_in != self.in_features:
            rows = F.pad(rows, (0, self.padded_in - self.in_features))
        elif not rows.is_contiguous():
            rows = rows.contiguous()
        y = torch.empty(rows.shape[0], self.padded_out)
        self.into(rows, y)
        if self.padded_out != self.out_features:
            y = y[:, : self.out_features]
        return y.reshape(*x.shape[:-1], self.out_features)

    def into(self, rows: torch.Tensor, y: torch.Tensor) -> None:
        """``y = rows @ W^T (+ bias)`` in one C call: ``rows`` contiguous fp32 ``[m, padded
        in]``, ``y`` contiguous fp32 ``[m, padded out]``, both the caller's. Why apart from
        ``forward``: a draft step writes its head's logits into a buffer it keeps (each torch
        call after the weights' stream costs tens of microseconds on cold caches)."""
        m = rows.shape[0]
        bias = None if self.bias_padded is None else self.bias_padded.data_ptr()
        if self.format is Format.EXACT:
            self._fn(
                rows.data_ptr(), self.padded_in, m, self.padded_in, self.weight_ilv.data_ptr(),
                self.block_scales.data_ptr(), self.x8_block, int(self.x8_affine), self.x8_bits,
                self.x8_offset, self.x8_span, self.padded_out, bias, y.data_ptr(), self.padded_out,
            )  # fmt: skip
        elif self.format is Format.DYNAMIC_INT8:
            self.product_q8(rows, y)
        else:
            self._fn(
                rows.data_ptr(), self.padded_in, m, self.padded_in, self.weight_ilv.data_ptr(),
                self.params_ptr(), self.padded_out, bias, y.data_ptr(), self.padded_out,
            )  # fmt: skip

    def product_q8(
        self,
        rows: torch.Tensor,
        y: torch.Tensor,
        *,
        levels: int = 1,
        bound: torch.Tensor | None = None,
        outliers: tuple[torch.Tensor, range, torch.Tensor] | None = None,
        bound_outliers: torch.Tensor | None = None,
    ) -> None:
        """``y = rows @ W^T (+ bias)`` through ``q8.c`` (``rows``: contiguous fp32, padded
        width; ``y``: contiguous, padded width): ``levels`` 2 adds the residual's pass,
        ``bound`` receives the per-row error bound; ``outliers`` = (``xo [M, padded width]``:
        the outlier channels' values, zeros elsewhere, ``rows`` zero there; ``quads``: the run of
        quads holding them; ``wsum`` int32 ``[padded out]``: the weights' sums over those quads)
        adds them on their own scale, their bound into ``bound_outliers`` (see ``q8.c``)."""
        assert self.lib is not None and self.format is Format.DYNAMIC_INT8
        xo, quads, wsum = outliers if outliers is not None else (None, None, None)
        self.lib.uag_linear_q8(
            rows.data_ptr(), self.padded_in, rows.shape[0], self.padded_in,
            self.weight_ilv.data_ptr(), self.scales.data_ptr(), self.wsum.data_ptr(),
            self.padded_out,
            None if self.bias_padded is None else self.bias_padded.data_ptr(),
            y.data_ptr(), self.padded_out, levels,
            None if bound is None else bound.data_ptr(),
            None if xo is None else xo.data_ptr(), self.padded_in,
            None if bound_outliers is None else bound_outliers.data_ptr(),
            0 if quads is None else quads.start, 0 if quads is None else len(quads),
            None if wsum is None else wsum.data_ptr(),
        )  # fmt: skip

    def dequantized(self) -> torch.Tensor:
        """The weight as the kernel sees it, ``[out, in]`` fp32 (tests, tied embeddings)."""
        return FORMATS[self.format].dequantize(self)

    def extra_repr(self) -> str:
        label = FORMATS[self.origin if self.format is Format.EXACT else self.format].label
        return f"in_features={self.in_features}, out_features={self.out_features}, native {label}"


def _lean_negative(
    ints: torch.Tensor, scales: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ints [n, k] int8, scales [n, k/block, 1])`` with every block whose integers lean
    positive negated, its scale too. Why: GGUF's Q5_0 holds -16..15 (Q6_K -32..31), but the
    block forms are found from the values alone, block by block as -16..15 or 15..-16 negated:
    33 levels in all, a bit more than the file's (``pack``). Negating both changes the sign of
    the exact sum and of ``s · v`` together, and IEEE rounding is symmetric: every bit after
    them is the same."""
    n, k = ints.shape
    blocks = ints.view(n, k // block, block).to(torch.int16)
    flip = (blocks.amax(dim=-1) + blocks.amin(dim=-1)) > 0
    if not bool(flip.any()) or int(blocks.min()) < -127:  # -(-128) would not fit
        return ints, scales
    sign = 1 - 2 * flip.to(torch.int16)
    return (blocks * sign[..., None]).reshape(n, k).to(torch.int8), scales * sign[..., None]


def fuse(parts: list[nn.Module]) -> NativeLinear | None:
    """One ``NativeLinear`` computing ``parts`` side by side (q/k/v, gate/up), or None.

    Why: one call instead of three saves the per-call overhead, and since every output is
    computed on its own (``skinny.c``), the fused outputs are bitwise the parts' outputs. The
    parts are rebound to views of the fused weight, so fusing costs no memory.
    """
    if not parts or not all(isinstance(p, NativeLinear) for p in parts):
        return None
    layers: list[NativeLinear] = [p for p in parts if isinstance(p, NativeLinear)]
    _one_exact_form(layers)
    storage = {
        (p.format, p.origin, p.x8_block, p.x8_affine, p.x8_bits, p.x8_offset) for p in layers
    }
    if len(storage) > 1:  # one storage per fused product
        for p in layers:
            p.to_fp32()
    first = layers[0]
    compatible = all(
        p.in_features == first.in_features
        and p.format is first.format
        and p.lib is first.lib
        and p.out_features == p.padded_out
        and (p.bias_padded is None) == (first.bias_padded is None)
        for p in layers
    )
    if not compatible:
        return None
    fused = NativeLinear.__new__(NativeLinear)
    nn.Module.__init__(fused)
    fused.format, fused.origin = first.format, first.origin
    fused.x8_block, fused.x8_affine = first.x8_block, first.x8_affine
    fused.x8_bits, fused.x8_offset = first.x8_bits, first.x8_offset
    fused.k_step = first.k_step
    fused.in_features, fused.padded_in = first.in_features, first.padded_in
    fused.out_features = fused.padded_out = sum(p.out_features for p in layers)
    fused.register_buffer("weight_ilv", torch.cat([p.weight_ilv for p in layers]))
    fused.register_buffer("scales", torch.cat([p.scales for p in layers]))
    fused.register_buffer("wsum", torch.cat([p.wsum for p in layers]))
    blocks = first.block_scales.numel() > 0
    fused.block_scales = torch.cat([p.block_scales for p in layers]) if blocks else torch.empty(0)
    biases = [p.bias_padded for p in layers]
    fused.bias_padded = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
    fused.invariance = "invariant"
    assert first.lib is not None
    fused._bind(first.lib)
    fused.pack()  # the parts share one width (packing each first could not)
    fused.factor()
    start, rows = 0, FORMATS[first.format].per_entry  # outputs per leading index
    for p in layers:
        count = p.weight_ilv.shape[0]
        p.weight_ilv = fused.weight_ilv[start : start + count]
        p.x8_bits, p.x8_offset, p.x8_span = fused.x8_bits, fused.x8_offset, fused.x8_span
        p.scales = fused.scales[start * rows : (start + count) * rows]
        p.wsum = fused.wsum[start * rows : (start + count) * rows]
        if blocks:
            p.block_scales = fused.block_scales[start : start + count]
        if fused.bias_padded is not None:
            p.bias_padded = fused.bias_padded[start * rows : (start + count) * rows]
        start += count
    return fused


def _one_exact_form(layers: list[NativeLinear]) -> None:
    """Parts held as exact integers in different block forms (``reblock``) brought to one: the
    smallest block, affine if any part is. Unpacked parts only (``fuse`` packs afterwards)."""
    if not all(p.format is Format.EXACT and p.x8_bits == 8 for p in layers):
        return
    forms = {(p.x8_block, p.x8_affine) for p in layers}
    if len(forms) < 2:
        return
    block = min(b for b, _ in forms)
    if any(b % block for b, _ in forms):
        return
    affine = any(a for _, a in forms)
    for p in layers:
        p.reblock(block=block, affine=affine)


def draft_stats(logits: torch.Tensor, *, count: int = 0) -> tuple[int, float, float, float]:
    """``(argmax id, top probability, second probability, entropy)`` of ``softmax(logits)``
    (``[V]``, or its first ``count`` values: a padded head's row): what a drafted token's
    features read. One C pass (``screen.c``) on CPU float32 where the kernels are built
    (torch's five ops cost ~0.45 ms a draft step), else torch."""
    lib = _library()[0] if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if lib is not None:
        x = logits if logits.is_contiguous() else logits.contiguous()
        out = (ctypes.c_double * 3)()
        top = int(lib.uag_draft_stats(x.data_ptr(), count or x.numel(), out))
        if top >= 0:  # else NaN logits: torch says what it makes of them
            return top, out[0], out[1], out[2]
    if count:
        logits = logits.reshape(-1)[:count]
    probs = torch.softmax(logits.float(), dim=-1)
    best = torch.topk(probs, 2)
    entropy = float(-(probs * torch.log(probs.clamp_min(1e-30))).sum())
    return int(best.indices[0]), float(best.values[0]), float(best.values[1]), entropy
