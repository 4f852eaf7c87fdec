"""The weights every decoding step streams, copied into memory backed by 2 MB pages.

Why: a step reads each weight of the body and of the screening head once, ~320 MB for Gemma 3
270M, in 4 KB pages that is ~80,000 translations the TLB cannot hold, so every page costs a
page walk. On 2 MB pages the same reads need ~160. Linux backs memory with 2 MB pages only
where asked (``transparent_hugepage`` in its default ``madvise`` mode) and never a file mapping,
so the prepared file's memory-mapped weights (``uag.runtime.prepared``) always get 4 KB pages.
Measured on this project's 2-core Xeon (``python -m uag.harness.runtime_bench --verify-table``, one
process each, alternating): one row 16.7 → 15.7 ms, eight rows 25.1 → 24.1 ms; the head
gained more than the body.

What: ``move`` copies the named tensors into one anonymous region advised ``MADV_HUGEPAGE``
and points their owners at the copies; the values are the same bits, so nothing downstream can
tell. The old pages of a memory-mapped original are paged out (``MADV_PAGEOUT``) as each
tensor is copied, so the resident set never holds both. Where the kernel has transparent huge pages off
(``never``), or off Linux, nothing moves. ``UAG_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

HUGE_PAGE = 2 << 20
"""x86-64's transparent huge page size: the region is aligned to it."""
ALIGN = 64
"""Each tensor starts on a cache line, as the kernels' vector loads prefer."""
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
    """A move under way: the copies are made on a thread of their own from construction (one
    ``memmove`` per tensor, which releases the GIL, so on a second core they overlap what the
    caller does next, e.g. loading a tokenizer), and ``finish`` points the owners at them.

    Why a thread: the first touch of fresh huge pages can be slow where a hypervisor backs guest
    memory on demand (this project's VM: 0.2-0.9 s for 400 MB, against ~0.05 s for pages the
    process had used before), and start-up should not wait for it.
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
        # Not a daemon: a process that exits with the copy under way (``uag models prepare``
        # reads a prepared model and is done) waits for it; a daemon thread inside torch's copy
        # at interpreter exit aborted the process ("terminate called without an active
        # exception").
        self._thread = threading.Thread(target=self._copy, args=(unique,), daemon=False)
        self._thread.start()

    def _copy(self, unique: dict[int, torch.Tensor]) -> None:
        try:
            self._bytes = _copy_into_region(unique, self._copies)
        except BaseException as error:  # noqa: BLE001 - re-raised by finish, in the caller
            self._error = error

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


def _copy_into_region(tensors: dict[int, torch.Tensor], copies: dict[int, torch.Tensor]) -> int:
    """Copy ``tensors`` into one new region advised for huge pages, each on a cache line;
    fill ``copies`` under the same keys. Returns the region's used bytes."""
    if not tensors:
        return 0
    offsets, total = {}, 0
    for key, tensor in tensors.items():
        offsets[key] = total
        total += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    span = -(-total // HUGE_PAGE) * HUGE_PAGE
    region = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)  # untouched: no page yet
    skip = -region.data_ptr() % HUGE_PAGE
    _advise(region.data_ptr() + skip, span)
    mapped = _file_mappings()
    for key, tensor in tensors.items():
        start = skip + offsets[key]
        nbytes = tensor.numel() * tensor.element_size()
        copy = region[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        # one plain memmove (GIL released, one core: the caller keeps the other), the first
        # touch of the region, where the kernel backs it with huge pages if it can
        ctypes.memmove(copy.data_ptr(), tensor.data_ptr(), nbytes)
        copies[key] = copy
        origin = tensor.data_ptr()
        if any(lo <= origin < hi for lo, hi in mapped):  # clean file pages: dropped at once,
            _page_out(origin, origin + nbytes)  # so the resident set never holds both copies
    refs = [weakref.ref(copy) for copy in copies.values()]
    _REGIONS.append((region.data_ptr(), region.data_ptr() + region.numel(), refs))
    return total


def _file_mappings() -> list[tuple[int, int]]:
    """This process's memory mapped from files (``/proc/self/maps``): the address ranges whose
    pages can be dropped and read again. Anonymous memory is never paged out here (with swap,
    that would write it out)."""
    ranges = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            lo, hi = fields[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def _page_out(lo: int, hi: int) -> None:
    """``madvise(MADV_PAGEOUT)`` over the whole pages inside [lo, hi): they are read again from
    the file only if something still asks for them."""
    page = os.sysconf("SC_PAGE_SIZE")
    lo, hi = -(-lo // page) * page, hi // page * page
    if hi > lo:
        _madvise(lo, hi - lo, MADV_PAGEOUT)


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
