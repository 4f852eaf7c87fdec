"""Prepared models: a local checkpoint's lean forward and heads on the native kernels, built
once and memory-mapped on every later start.

Why: turning a checkpoint into what uag runs (importing Transformers' modelling code, building
the model, finding the exact block forms, interleaving weights, the screened head's int8 copy
and its calibration, the assistant's 4-bit layout) took ~6 of the ~9 s a one-token
``uag generate`` needed, and faulted in the fp32 weights (1.6 GB) at the peak. What comes out
is a few hundred MB of tensors in uag's own layouts and small Python objects
(``uag.runtime.lean.LeanBody`` and the heads hold no Transformers object), so ``torch.save`` writes it
and ``torch.load(mmap=True)`` maps it back: pages fault in as the kernels first read them, and
rows the embedding or the screened head never touch stay on disk.

Where: ``uag-prepared-<role>-<key>.pt`` beside a converted checkpoint inside ``$UAG_CACHE``
(the embedded models and any GGUF file; as the tokenizer cache, ``uag.runtime.tokcache``: a user's own
checkpoint directory is never written to and loads the usual way), ``role`` one of ``ROLES``.
The key covers the checkpoint files' sizes and times, the role, uag's own source (the file
holds pickled objects of its classes, so any change of code builds it again) and torch's and
Python's versions; a new file replaces the role's stale ones. Only CPU float32 on the native
kernels, and only models with a lean forward (``uag.runtime.lean``) whose heads have a compact exact
form are prepared; for any other model an empty ``.none`` file of the same key records that, so
later starts load it the usual way at once. A file inside ``$UAG_CACHE`` is trusted as
``site-packages`` is; a damaged one is built again. ``UAG_PREPARED_CACHE=0`` bypasses it all.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from uag.kernels import hugepages
from uag.kernels.choice import quantize_int8
from uag.kernels.native import integer_products, packed_body
from uag.kernels.screened import ScreenedHead
from uag.paths import cache_root, locked
from uag.runtime.lean import LeanBody, lean_body_for
from uag.runtime.models import LoadedModel, checkpoint_dir, declared_context, load_model
from uag.runtime.runner import CachedLM, assistant_lm_for, streamed_slots, target_lm_for
from uag.runtime.tokcache import load_tokenizer

FORMAT = 1
"""Bumped when what a prepared file holds changes in a way the source hash would not show."""
ROLES = ("target", "assistant", "assistant-int8")
"""The target (screened greedy head, calibrated); the assistant in fp32 or with int8/4-bit
weights (``--assistant-int8``)."""
_CHECKPOINT_FILES = re.compile(r"^(?!uag-).*\.(json|safetensors|bin|model|jinja)$")
"""The files whose sizes and times key a prepared file (not uag's own files beside them)."""


@dataclass
class Prepared:
    """What ``CachedLM.from_lean`` needs, plus what the pair needs without the model."""

    lean: LeanBody
    head: nn.Module
    """The head ``logits`` / ``full_logits`` multiply by (the target's: its exact blocks)."""
    fast_head: nn.Module | None
    """The target's screened greedy head; None for an assistant."""
    softcap: float | None
    eos_ids: frozenset[int]
    row_invariant: bool
    moving: Any = None
    """The move of its streamed weights into huge pages (``uag.kernels.hugepages.Move``), started as
    soon as the file is read so that it overlaps loading the tokenizer; None in the file."""

    def cached_lm(self) -> CachedLM:
        lm = CachedLM.from_lean(
            self.lean,
            head=self.head,
            softcap=self.softcap,
            greedy_head=self.fast_head is not None,
            fast_head=self.fast_head,
        )
        lm.row_invariant = self.row_invariant
        lm.moving, self.moving = self.moving, None  # finished once the pair is assembled
        return lm


def enabled() -> bool:
    return os.environ.get("UAG_PREPARED_CACHE", "1") != "0"


@functools.cache
def _source_digest() -> str:
    """A hash of uag's Python and C sources: prepared files hold objects of its classes."""
    root = Path(__file__).parents[1]
    digest = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *(root / "kernels" / "csrc").glob("*")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _key(directory: Path, role: str) -> str:

    digest = hashlib.sha256()
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    digest.update(f"{FORMAT}|{role}|{torch.__version__}|{version}|{_source_digest()}".encode())
    digest.update(f"|integer:{integer_products()}|packed:{packed_body()}".encode())  # the layout
    for path in sorted(directory.iterdir()):
        if path.is_file() and _CHECKPOINT_FILES.match(path.name):
            stat = path.stat()
            digest.update(f"|{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


def _path(directory: Path, role: str) -> Path:
    return directory / f"uag-prepared-{role}-{_key(directory, role)}.pt"


def load(
    ref: str, *, role: str, tokenizer: Any = None, log: Any = None
) -> tuple[LoadedModel, Prepared] | None:
    """``ref`` prepared for ``role``: from its file when there is one, else built (loading the
    Transformers model once; ``log`` says so, default stderr) and saved. None where ``ref``
    cannot be prepared (see the module doc): the caller then loads it the usual way."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {ROLES}")
    source = checkpoint_dir(ref)
    directory = Path(source).resolve()
    if not enabled() or not directory.is_dir():
        return None
    if not directory.is_relative_to(cache_root().resolve()):
        return None  # a user's directory: never written to
    path = _path(directory, role)
    if path.with_suffix(".none").is_file():
        return None
    prepared = _read(path)  # first: its move into huge pages runs while the tokenizer loads
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source)
    if prepared is None:
        with _turn(path.with_name(f".uag-prepared-{role}.lock")):  # two processes: one builds
            prepared = _read(path)
            if prepared is None and path.with_suffix(".none").is_file():
                return None
            if prepared is None:
                say = log or (lambda msg: print(msg, file=sys.stderr))
                say(
                    f"uag: preparing {ref} as {role} for the native kernels "
                    "(once per model and uag build)"
                )
                prepared = _build(ref, role, tokenizer)
                _write(path, prepared)
        if prepared is None:
            return None
    loaded = LoadedModel(
        ref=ref,
        model=None,
        tokenizer=tokenizer,
        eos_ids=prepared.eos_ids,
        device=prepared.lean.device,
        dtype=prepared.lean.dtype,
        context=declared_context(json.loads((directory / "config.json").read_text())),
    )
    return loaded, prepared


@contextlib.contextmanager
def _turn(lock: Path) -> Iterator[None]:
    """``uag.paths.locked`` on ``lock``: a second process preparing the same model waits, then
    reads the first one's file (torchrun ranks, parallel test workers) instead of building it
    again; a read-only cache, where no lock can be made, builds without one."""
    try:
        held = locked(lock)
        held.__enter__()
    except OSError:
        yield
        return
    try:
        yield
    finally:
        held.__exit__(None, None, None)


def prepared_roles(directory: Path) -> list[str]:
    """The roles a converted checkpoint in ``directory`` has an up-to-date prepared file for."""
    if not directory.is_dir():
        return []
    return [role for role in ROLES if _path(directory, role).is_file()]


def _read(path: Path) -> Prepared | None:
    if not path.is_file():
        return None
    try:
        found = torch.load(path, mmap=True, weights_only=False)
    except Exception:  # a damaged or foreign entry: build it again  # noqa: BLE001
        found = None
    if isinstance(found, Prepared):
        found.moving = hugepages.Move(streamed_slots(found.lean, found.head, found.fast_head))
        return found
    path.unlink(missing_ok=True)
    return None


def _write(path: Path, prepared: Prepared | None) -> None:
    """Save atomically (concurrent starts, e.g. torchrun ranks, never read half a file), or
    mark the model as not preparable (``None``), and remove the role's stale files; a read-only
    cache just runs without."""
    stem = path.name.rsplit("-", 1)[0]  # uag-prepared-<role>
    try:
        for stale in path.parent.glob(f"{stem}-*"):
            if stale.name.rsplit("-", 1)[0] == stem and stale.suffix in (".pt", ".none"):
                stale.unlink(missing_ok=True)
        if prepared is None:
            path.with_suffix(".none").touch()
            return
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        try:
            torch.save(prepared, tmp)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except (OSError, RuntimeError):  # read-only or full disk (torch's writer raises RuntimeError)
        pass


def _build(ref: str, role: str, tokenizer: Any) -> Prepared | None:
    """Load the Transformers model, convert it as ``uag.api.make_pair`` does, keep the lean
    parts. None where the model has no lean forward or its head no compact exact form."""
    loaded = load_model(ref, device="cpu", dtype="float32")
    model = loaded.model
    if lean_body_for(model) is None:
        return None
    if role == "target":
        lm = target_lm_for(model, tokenizer, "native")
        fast = lm._greedy.fast if lm._greedy is not None else None
        if not isinstance(fast, ScreenedHead) or fast.exact is None:
            return None  # the fp32 head would be written out whole
        head: nn.Module = fast.exact  # what the screened head's exact step reads
    else:
        if role == "assistant-int8":
            model = quantize_int8(model, backend="native")
        lm = assistant_lm_for(model, "native")
        fast, head = None, lm.head
    assert lm.lean is not None
    return Prepared(
        lean=lm.lean,
        head=head,
        fast_head=fast,
        softcap=lm.softcap,
        eos_ids=loaded.eos_ids,
        row_invariant=lm.row_invariant,
    )
