"""uag: lossless cross-tokenizer speculative decoding with a learned lookahead controller.

The names below load on first use (PEP 562), so ``import uag.errors`` or a CLI ``--help`` does
not import torch, and the floors below ``uag.api`` never import it back.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from uag.api import GenerationResult, Pair, generate, load_pair
    from uag.decoding.lookup import PromptLookup
    from uag.decoding.plan import Plan
    from uag.decoding.sampling import SamplingConfig
    from uag.errors import UagError

_WHERE = {
    "GenerationResult": "uag.api",
    "Pair": "uag.api",
    "generate": "uag.api",
    "load_pair": "uag.api",
    "Plan": "uag.decoding.plan",
    "PromptLookup": "uag.decoding.lookup",
    "SamplingConfig": "uag.decoding.sampling",
    "UagError": "uag.errors",
}
__all__ = [
    "GenerationResult",
    "Pair",
    "Plan",
    "PromptLookup",
    "SamplingConfig",
    "UagError",
    "generate",
    "load_pair",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'uag' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
