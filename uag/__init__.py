"""uag: lossless cross-tokenizer speculative decoding with a learned lookahead controller."""

from uag.api import GenerationResult, Pair, generate, load_pair
from uag.errors import UagError
from uag.lookup import PromptLookup
from uag.sampling import SamplingConfig

__all__ = [
    "GenerationResult",
    "Pair",
    "PromptLookup",
    "SamplingConfig",
    "UagError",
    "generate",
    "load_pair",
]
__version__ = "0.1.0"
