"""The weights every decoding step streams, copied into memory backed by 2 MB pages.

Why: a step reads each weight of the body and of the screening head once, ~320 MB for Gemma 3
270M, in 4 KB pages that is ~80,000 translations the TLB cannot hold, so every page costs a
page walk. On 2 MB pages the same reads need ~160. Linux backs memory with 2 MB pages only
where asked (``transparent_hugepage`` in its default ``madvise`` mode) and never a file mapping,
so the prepared file's memory-mapped weights (``uag.runtime.prepared``) always get 4 KB pages.
Measured on this project's 2-core Xeon (``python -m scripts.runtime_bench --verify-table``, one
process each, alternating): one row 16.7 → 15.7 ms, eight rows 25.1 → 24.1 ms; the head
gained more than the body.

What: ``move`` copies the named tensors into one anonymous region advised ``MADV_HUGEPAGE``
and points their owners at the copies; the values are the same bits, so nothing downstream can
tell. The old pages of a memory-mapped original leave the process as each tensor is copied, so
the resident set never holds both: unmapped (``MADV_DONTNEED``) where the mapping holds no page of
its own (nothing written, so the file still has every value), which leaves them in the page cache
for the next start; paged out (``MADV_PAGEOUT``) otherwise. Why not page out always: that also
evicts clean file pages from the page cache, so every start read the ~300 MB it moves back from
disk (a one-token ``uag generate``: the move 0.8-1.5 s instead of ~0.4 s, and a slower first
forward on what else the previous start had evicted). Where the kernel has transparent huge pages off
(``never``), or off Linux, nothing moves. ``UAG_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HUGE_PAGE = 2 << 20
"""x86-64's transparent huge page size: the region is aligned to it."""
ALIGN = 64
"""Each tensor starts on a cache line, as the kernels' vector loads prefer."""
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_PAGEOUT = 21
_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


_REGIONS: list[tuple[int, int, list[weakref.ref[torch.Tensor]]]] = []
"""The regions ``move`` made (start, end, its copies): a tensor inside one whose copies are not
all gone (the memory is still the region's) is not moved again."""


def _in_a_region(tensor: torch.Tensor) -> bool:
    start = tensor.data_ptr()
    return any(
        lo <= start < hi and any(ref() is not None for ref in refs) for lo, hi, refs in _REGIONS
    )


def available() -> bool:
    """Linux with transparent huge pages in ``always`` or ``madvise`` mode, not turned off by
    ``UAG_HUGE_PAGES=0``."""
    if os.environ.get("UAG_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        return "[never]" not in _SETTING.read_text()
    except OSError:
        return False


class Move:
    """A move under way: the region is laid out by the caller, the bytes are copied on a thread
    of their own from construction, and ``finish`` points the owners at the copies.

    Why a thread: the first touch of fresh huge pages can be slow where a hypervisor backs guest
    memory on demand (this project's VM: 0.2-0.9 s for 400 MB, against ~0.05 s for pages the
    process had used before), and start-up should not wait for it. Why one system call for
    every tensor (``_copy_all``): what the caller does next, loading a tokenizer, holds the GIL
    for a second inside the Rust ``tokenizers`` library, and a thread that needed the GIL
    between two tensors' copies stalled there (~300 MB moved in ~2.3 s of a one-token
    ``uag generate``, most of it waiting); laid out beforehand and copied by one call that
    releases the GIL, the copy runs beside the tokenizer on the second core.
    """

    def __init__(self, slots: Sequence[tuple[Any, str]]) -> None:
        self.slots = list(slots)
        self._copies: dict[int, torch.Tensor] = {}
        self._bytes = 0
        self._error: BaseException | None = None
        unique: dict[int, torch.Tensor] = {}
        if available():
            for owner, name in self.slots:
                tensor = getattr(owner, name)
                if _movable(tensor):
                    unique.setdefault(id(tensor), tensor)
        plan = None
        try:
            plan = _plan(unique, self._copies)
        except BaseException as error:  # noqa: BLE001 - re-raised by finish
            self._error = error
        copying = threading.Event()
        # Not a daemon: a process that exits with the copy under way (``uag models prepare``
        # reads a prepared model and is done) waits for it; a daemon thread inside torch's copy
        # at interpreter exit aborted the process ("terminate called without an active
        # exception").
        self._thread = threading.Thread(target=self._copy, args=(plan, copying), daemon=False)
        self._thread.start()
        copying.wait(timeout=1.0)  # until it is inside the copy, past needing the GIL

    def _copy(self, plan: _Plan | None, copying: threading.Event) -> None:
        try:
            if plan is not None:
                _transfer(plan, copying)
                self._bytes = plan.total
        except BaseException as error:  # noqa: BLE001 - re-raised by finish, in the caller
            self._error = error
        finally:
            copying.set()

    def finish(self) -> int:
        """Wait for the copies, put them in place, drop the originals' file pages; returns the
        bytes moved (0 where nothing moved). Each tensor object moves once, even if named by
        several slots."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        for owner, name in self.slots:
            tensor = getattr(owner, name)
            if isinstance(tensor, torch.Tensor) and id(tensor) in self._copies:
                setattr(owner, name, self._copies[id(tensor)])
        self._copies = {}
        return self._bytes


def _movable(tensor: Any) -> bool:
    """A non-empty contiguous CPU tensor (copied as plain bytes)."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.device.type == "cpu"
        and tensor.numel() > 0
        and tensor.is_contiguous()
        and not _in_a_region(tensor)  # moved already (the same weights reached another way)
    )


def move(slots: Sequence[tuple[Any, str]]) -> int:
    """Copy ``getattr(owner, name)`` for each slot (CPU tensors) into one region advised for
    huge pages and ``setattr`` the copy in its place (``Move``, waited for). Returns the bytes
    moved (0 where unavailable); a tensor already moved stays where it is."""
    return Move(slots).finish()


@dataclass
class _Plan:
    """A region laid out for some tensors: what to copy where, and which file pages to drop."""

    copies: list[tuple[int, int, int]]
    """``(destination, source, bytes)`` per tensor."""
    vectors: Vectors
    """``copies`` as ``process_vm_readv`` calls (``_copy_all``)."""
    drops: list[tuple[int, int, int]]
    """``(start, end, madvise advice)`` per original in a file mapping (``_drop``)."""
    total: int
    """The region's used bytes."""


def _plan(tensors: dict[int, torch.Tensor], copies: dict[int, torch.Tensor]) -> _Plan | None:
    """Lay ``tensors`` out in one new region advised for huge pages, each on a cache line, and
    fill ``copies`` with their places there (not written yet) under the same keys. None where
    there is nothing to move."""
    if not tensors:
        return None
    offsets, total = {}, 0
    for key, tensor in tensors.items():
        offsets[key] = total
        total += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    span = -(-total // HUGE_PAGE) * HUGE_PAGE
    region = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)  # untouched: no page yet
    skip = -region.data_ptr() % HUGE_PAGE
    _advise(region.data_ptr() + skip, span)
    mapped = _file_mappings()
    plan = _Plan(copies=[], vectors=[], drops=[], total=total)
    for key, tensor in tensors.items():
        start = skip + offsets[key]
        nbytes = tensor.numel() * tensor.element_size()
        copy = region[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        copies[key] = copy
        origin = tensor.data_ptr()
        plan.copies.append((copy.data_ptr(), origin, nbytes))
        for lo, hi, clean in mapped:  # file pages: dropped once copied, so that the resident
            if lo <= origin < hi:  # set does not keep both copies
                plan.drops.append(
                    (origin, origin + nbytes, MADV_DONTNEED if clean else MADV_PAGEOUT)
                )
                break
    if _process_vm_readv() is not None:  # bound here, not on the copying thread
        plan.vectors = _vectors(plan.copies)
    refs = [weakref.ref(copy) for copy in copies.values()]
    _REGIONS.append((region.data_ptr(), region.data_ptr() + region.numel(), refs))
    return plan


def _transfer(plan: _Plan, copying: threading.Event) -> None:
    """Copy the plan's bytes (the region's first touch, where the kernel backs it with huge
    pages if it can), each original's file pages dropped as soon as its batch is copied: in a
    few system calls where this kernel allows it (``_copy_all``), else one ``memmove`` per
    tensor (each releases the GIL). Dropping batch by batch keeps the resident set from holding
    both copies of everything at once (the 1.5B's 1.9 GB: a 4.3 GB peak otherwise)."""
    drops = {lo: (hi, advice) for lo, hi, advice in plan.drops}

    def drop(sources: Sequence[int]) -> None:
        for source in sources:
            if source in drops:
                _drop(source, *drops[source])

    if _copy_all(plan.vectors, copying, after=drop):
        return
    copying.set()
    for destination, source, nbytes in plan.copies:
        ctypes.memmove(destination, source, nbytes)
        if source in drops:
            _drop(source, *drops[source])


class _IoVec(ctypes.Structure):
    """``struct iovec``."""

    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


IOV_MAX = 1024
"""Linux's limit on the pieces of one ``process_vm_readv`` call."""
BATCH_BYTES = 64 << 20
"""Bytes per call (a larger tensor is a call of its own): what is resident twice at most."""
Vectors = list[tuple[Any, Any, int, int, tuple[int, ...]]]
"""``process_vm_readv``'s arguments per call: destinations, sources, pieces, bytes, and the
sources' addresses (whose file pages are dropped once the call is done)."""


def _vectors(copies: Sequence[tuple[int, int, int]]) -> Vectors:
    """``copies`` as ``process_vm_readv`` calls of at most ``IOV_MAX`` pieces and about
    ``BATCH_BYTES`` each (built beforehand: the copying thread should not need the GIL once
    it starts)."""
    batches: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for piece in copies:
        if batches[-1] and (len(batches[-1]) == IOV_MAX or size + piece[2] > BATCH_BYTES):
            batches.append([])
            size = 0
        batches[-1].append(piece)
        size += piece[2]
    calls = []
    for batch in filter(None, batches):
        local = (_IoVec * len(batch))(*(_IoVec(dst, n) for dst, _, n in batch))
        remote = (_IoVec * len(batch))(*(_IoVec(src, n) for _, src, n in batch))
        sources = tuple(src for _, src, _ in batch)
        calls.append((local, remote, len(batch), sum(n for *_, n in batch), sources))
    return calls


@functools.cache
def _process_vm_readv() -> Any:
    """libc's ``process_vm_readv`` with its signature, or None where libc lacks it."""
    try:
        call = _libc().process_vm_readv
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_ssize_t
    pieces = [ctypes.c_void_p, ctypes.c_ulong]  # an iovec array and its length
    call.argtypes = [ctypes.c_int, *pieces, *pieces, ctypes.c_ulong]  # pid, local, remote, flags
    return call


def _copy_all(
    vectors: Vectors,
    copying: threading.Event,
    *,
    after: Callable[[Sequence[int]], None] | None = None,
) -> bool:
    """Copy with ``process_vm_readv`` on this process itself: one system call per batch
    (``_vectors``), the GIL released for it (``copying`` set just before the first), ``after``
    told each batch's sources once it is copied. False where the call is missing, refused (e.g.
    by a seccomp filter) or copies short: the caller then copies every piece another way
    (copying the same bytes again is harmless; a dropped clean file page reads back)."""
    call = _process_vm_readv()
    if call is None or not vectors:
        return False
    pid = os.getpid()
    copying.set()
    for local, remote, n, nbytes, sources in vectors:
        if call(pid, local, n, remote, n, 0) != nbytes:
            return False
        if after is not None:
            after(sources)
    return True


def _file_mappings() -> list[tuple[int, int, bool]]:
    """This process's memory mapped from files (``/proc/self/smaps``) as ``(start, end,
    clean)``: the address ranges whose pages can be dropped and read again, ``clean`` where the
    mapping holds no anonymous (written, copy-on-write) or swapped page, so that unmapping any of
    its pages loses nothing. Anonymous memory is never dropped here (with swap, that would write
    it out)."""
    ranges: list[tuple[int, int]] = []
    written: set[int] = set()  # indices into ranges
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return []
    inside = False  # the current mapping is a file's
    for line in lines:
        fields = line.split(maxsplit=5)
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
            inside = len(fields) == 6 and fields[5].startswith("/")
            if inside:
                lo, hi = fields[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
        elif inside and fields[0] in ("Anonymous:", "Swap:") and fields[1] != "0":
            written.add(len(ranges) - 1)
    return [(lo, hi, i not in written) for i, (lo, hi) in enumerate(ranges)]


def _drop(lo: int, hi: int, advice: int) -> None:
    """``madvise(advice)`` over the whole pages inside [lo, hi): ``MADV_DONTNEED`` unmaps clean
    file pages (read again from the page cache or the file if anything still asks for them),
    ``MADV_PAGEOUT`` reclaims them."""
    page = os.sysconf("SC_PAGE_SIZE")
    lo, hi = -(-lo // page) * page, hi // page * page
    if hi > lo:
        _madvise(lo, hi - lo, advice)


def _advise(start: int, length: int) -> None:
    """``madvise(MADV_HUGEPAGE)`` over [start, start + length) (2 MB aligned)."""
    _madvise(start, length, MADV_HUGEPAGE)


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _madvise(start: int, length: int, advice: int) -> None:
    try:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)
    except (OSError, AttributeError):
        return  # advisory: the copy still works on small pages, the old pages stay resident
