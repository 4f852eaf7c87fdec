"""One-off measurement scripts, run from the repository root (``python -m scripts.<name>``).

Not part of the ``uag`` package or its wheel: they may import anything from ``uag``,
``controllers`` and ``training``; nothing there imports them (``lint-imports`` checks).
"""
